//! The manifest files as a source of Services: polled for changes, and each object served
//! from one file when several define it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use tracing::instrument;

use super::manifest::{ManifestSource, Named};
use super::{Batch, Event, Tracker};
use crate::error::Error;
use crate::translate::{Holders, Keyed, ParsedService};

/// Which file served an object ("kind", namespace, name) when it was last defined twice.
type ServedFrom = HashMap<(&'static str, String, String), Arc<Path>>;

/// An [`Event::Poll`] every `every`, the first at once; a poll that is late does not bunch
/// up the next ones.
pub fn polls(every: Duration) -> impl Stream<Item = Event> + Send {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    futures::stream::unfold(ticker, |mut ticker| async move {
        ticker.tick().await;
        Some((Event::Poll, ticker))
    })
}

/// The manifest files, and whether they changed since the last sync. Every sync of them is
/// whole: the files are read again (those that changed) and translated all together.
pub struct ManifestTracker {
    source: ManifestSource,
    served_from: ServedFrom,
    /// Since when a sync has been due.
    pending: Option<Instant>,
}

impl ManifestTracker {
    pub fn new(source: ManifestSource) -> ManifestTracker {
        ManifestTracker {
            source,
            served_from: HashMap::new(),
            pending: None,
        }
    }
}

impl Tracker for ManifestTracker {
    fn apply(&mut self, event: Event) {
        if matches!(event, Event::Poll) && self.source.changed() {
            self.pending.get_or_insert_with(Instant::now);
        }
    }

    fn due(&self) -> Option<Instant> {
        self.pending
    }

    /// A change of the files is synced at the poll that finds it: none waits in a queue.
    fn queued(&self) -> bool {
        false
    }

    fn retranslate_all(&mut self) {
        self.pending.get_or_insert_with(Instant::now);
    }

    /// Reads the manifests that changed and chooses one definition of each object (keeping
    /// it with the file that served it when a second file defines it too).
    #[instrument(skip_all, fields(path = %self.source.path().display()))]
    fn take(&mut self, holders: &dyn Holders) -> Batch<'_> {
        let since = self.pending.take().unwrap_or_else(Instant::now);
        let loaded = self.source.load();
        let mut errors = loaded.errors;
        let serving = |s: &ParsedService, owner: &str| {
            s.frontends()
                .filter(|fe| holders.holder(fe) == Some(owner))
                .count()
        };
        let services = one_definition_each(
            "Service",
            loaded.services,
            &mut self.served_from,
            &serving,
            &mut errors,
        );
        let slices = one_definition_each(
            "EndpointSlice",
            loaded.slices,
            &mut self.served_from,
            &|_, _| 0,
            &mut errors,
        );
        Batch {
            owners: None,
            changed: services.len(),
            services,
            slices,
            errors,
            zone: None,
            since,
            triggers: Vec::new(),
        }
    }
}

/// Of several definitions of one object, the one that serves now: from the file that served
/// it when it was last defined twice, else the one its file has defined for longest (it
/// served before the other came), else (both came in one load, as after a restart) the one
/// whose frontends are programmed for it, else the older by creationTimestamp, else the first
/// file by name. So adding a file never takes an object over. `served_from` remembers files
/// for objects that have been defined twice only: the common case costs no memory.
fn one_definition_each<'a, T: Keyed>(
    kind: &'static str,
    objects: Vec<&'a Named<T>>,
    served_from: &mut ServedFrom,
    serving: &dyn Fn(&T, &str) -> usize,
    errors: &mut Vec<Error>,
) -> Vec<&'a T> {
    let mut chosen: HashMap<(&'a str, &'a str), usize> = HashMap::with_capacity(objects.len());
    let mut kept: Vec<&'a Named<T>> = Vec::with_capacity(objects.len());
    let mut twice: Vec<(String, String)> = Vec::new();
    for o in objects {
        let (ns, name) = (o.object.namespace(), o.object.name());
        if name.is_empty() {
            kept.push(o);
            continue;
        }
        let Some(&at) = chosen.get(&(ns, name)) else {
            chosen.insert((ns, name), kept.len());
            kept.push(o);
            continue;
        };
        let first = kept[at];
        let owner = format!("{ns}/{name}");
        let served = served_from.get(&(kind, ns.to_string(), name.to_string()));
        let rank = |n: &Named<T>| {
            let created = n.object.created();
            (
                served == Some(&n.path),
                std::cmp::Reverse(n.since),
                serving(&n.object, &owner),
                std::cmp::Reverse((created.is_none(), created)),
            )
        };
        let (keep, drop) = if rank(o) > rank(first) {
            (o, first)
        } else {
            (first, o)
        };
        errors.push(Error::Invalid {
            object: format!("{kind} {owner}"),
            message: format!(
                "defined again in {}; the definition in {} is served",
                drop.origin(),
                keep.origin()
            ),
        });
        kept[at] = keep;
        twice.push((ns.to_string(), name.to_string()));
    }
    served_from.retain(|k, _| k.0 != kind);
    for (ns, name) in twice {
        let at = chosen[&(ns.as_str(), name.as_str())];
        served_from.insert((kind, ns, name), kept[at].path.clone());
    }
    kept.into_iter().map(|n| &n.object).collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::{Frontend, Protocol};
    use crate::translate::{self, NodeContext};

    /// The backends `demo/web`'s ClusterIP frontend gets when the manifests of `source` are
    /// loaded again and each object is taken from one file, with what the choice reported.
    fn web_backends(
        source: &mut ManifestSource,
        served_from: &mut ServedFrom,
    ) -> (Vec<String>, Vec<String>) {
        let parsed = source.load();
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        let mut errors = Vec::new();
        let services = one_definition_each(
            "Service",
            parsed.services,
            served_from,
            &|_, _| 0,
            &mut errors,
        );
        let slices = one_definition_each(
            "EndpointSlice",
            parsed.slices,
            served_from,
            &|_, _| 0,
            &mut errors,
        );
        let t = translate::assemble(services, slices, &NodeContext::default());
        let fe = Frontend::cluster("10.96.0.10".parse().unwrap(), 80, Protocol::Tcp);
        let backends = t.state.frontends[&fe]
            .backends
            .iter()
            .map(|b| b.ip().to_string())
            .collect();
        (backends, errors.iter().map(ToString::to_string).collect())
    }

    const WEB: &str = "apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}
";

    fn slice(ip: &str) -> String {
        format!(
            "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: demo, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{{addresses: [{ip}]}}]
"
        )
    }

    /// Issue 33, item 9: a file added later that defines a serving EndpointSlice again (even
    /// one whose name sorts first) does not take it over; an edit of the serving file is still
    /// served, and the other definition serves once the first one goes.
    #[test]
    fn a_new_file_cannot_take_over_a_serving_endpoint_slice() {
        let dir = std::env::temp_dir().join(format!("svc-agent-dup-slice-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        struct Gone(PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let _gone = Gone(dir.clone());
        let write = |name: &str, text: &str| {
            // Renamed in, as editors do: a new inode, so the change is seen at once.
            let tmp = dir.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, dir.join(name)).unwrap();
        };
        write("50-web.yaml", &format!("{WEB}{}", slice("10.0.0.1")));
        let mut source = ManifestSource::open(&dir).unwrap();
        let mut served_from = HashMap::new();
        let (backends, errors) = web_backends(&mut source, &mut served_from);
        assert_eq!(backends, ["10.0.0.1"]);
        assert!(errors.is_empty(), "{errors:?}");

        write("00-intruder.yaml", &slice("10.0.0.9"));
        let (backends, errors) = web_backends(&mut source, &mut served_from);
        assert_eq!(backends, ["10.0.0.1"], "{errors:?}");
        assert_eq!(
            errors,
            [format!(
                "EndpointSlice demo/web-1: defined again in {}: document 1; the definition in \
                 {}: document 2 is served",
                dir.join("00-intruder.yaml").display(),
                dir.join("50-web.yaml").display()
            )]
        );

        // An edit is no new definition: the serving file keeps the slice.
        write("50-web.yaml", &format!("{WEB}{}", slice("10.0.0.2")));
        let (backends, _) = web_backends(&mut source, &mut served_from);
        assert_eq!(backends, ["10.0.0.2"]);

        write("50-web.yaml", WEB);
        let (backends, errors) = web_backends(&mut source, &mut served_from);
        assert_eq!(backends, ["10.0.0.9"]);
        assert!(errors.is_empty(), "{errors:?}");
        // Back in its old file, the slice is the newer definition now.
        write("50-web.yaml", &format!("{WEB}{}", slice("10.0.0.1")));
        let (backends, _) = web_backends(&mut source, &mut served_from);
        assert_eq!(backends, ["10.0.0.9"]);
    }
}
