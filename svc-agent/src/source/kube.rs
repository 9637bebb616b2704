//! Services, EndpointSlices and this node from the Kubernetes API.
//!
//! Three watchers produce the events; the [`Cache`] keeps what they brought. Nothing is due
//! until Services and EndpointSlices have both been listed completely; then everything, once;
//! then only the Services that changed, with bursts coalesced. A relist replaces a cache
//! atomically (watcher `Init`/`InitDone`) and marks only what differs. Watch errors and API
//! outages keep the last programmed state serving; the watchers retry with backoff.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use tracing::{info, warn};

use super::listed::{slice_event, ListedSlice};
use super::{Batch, Event as SourceEvent, Tracker};
use crate::error::{Error, Result};
use crate::model::Frontend;
use crate::translate::{self, Holders, NodeContext, ParsedService, ParsedSlice};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The cluster autoscaler's taint on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// kube-proxy's rule (KEP-3836): a node being deleted, by its deletionTimestamp or the
/// cluster autoscaler's taint, fails /healthz so that load balancers drain it first.
fn node_eligible(n: &Node) -> bool {
    let tainted = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    n.metadata.deletion_timestamp.is_none() && !tainted
}
/// Set by the EndpointSlice controller: when the change that produced this slice happened.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

#[derive(Clone, Debug)]
pub struct KubeOptions {
    /// None: in-cluster configuration, then $KUBECONFIG and ~/.kube/config.
    pub kubeconfig: Option<PathBuf>,
    pub node_name: String,
    /// Serve only Services labelled with this proxy name, as kube-proxy's --service-proxy-name
    /// does; None: only Services without the label.
    pub service_proxy_name: Option<String>,
    /// How long a burst of events may keep arriving before the affected Services are synced.
    pub coalesce: Duration,
    /// The API server's own address (https://HOST:PORT), instead of the configuration's:
    /// in a cluster, the configured one is the `kubernetes` Service's ClusterIP, which only
    /// svc itself serves once kube-proxy is gone.
    pub api_server: Option<String>,
    /// The cluster's Service ranges: an API server address in them needs svc to reach.
    pub service_cidrs: Vec<Cidr>,
    /// The DaemonSet this agent runs in (namespace, name): when the agent is stopped because
    /// that DaemonSet no longer runs it on this node, it uninstalls instead of leaving a
    /// datapath that nothing updates.
    pub daemonset: Option<(String, String)>,
    /// The first lists as a watch with the existing objects first (WatchList), not pages.
    pub watch_list: bool,
}

/// An address range, "10.96.0.0/12" or "fd00:10:96::/112".
pub use crate::model::Cidr;

/// Objects per page of the Services' and EndpointSlices' lists (kube-rs: 500; a streaming list,
/// `--watch-list`, has no pages). A large share of the API server's cost is per page at 500: at
/// 100,000 Services of 10 endpoints, a restart's lists were done 5.0–5.8 s after spawn with
/// pages of 5,000, against 9.1–9.4 s (docs/benchmarks.md). The price is one page of each kind
/// held at once: about 43 MB of slices of 10 endpoints decoded whole, many times that for a
/// cluster's (`targetRef`s, `managedFields`), which is why slices are decoded only as far as
/// the agent reads them (`listed::ListedSlice`); kube-proxy's first list, unpaged from the
/// watch cache, holds every object at once.
pub const LIST_PAGE: u32 = 5_000;

/// kube-proxy's selection of Services (cmd/kube-proxy/app/server.go): those without a service
/// proxy name, or with svc's --service-proxy-name, those labelled with it. Headless Services
/// are dropped by their `clusterIP: None` (translate), not by the headless label.
pub fn service_selector(service_proxy_name: Option<&str>) -> String {
    match service_proxy_name {
        Some(name) => format!("{PROXY_NAME_LABEL}={name}"),
        None => format!("!{PROXY_NAME_LABEL}"),
    }
}

/// kube-proxy's selection of EndpointSlices: those not labelled headless, whatever their
/// service proxy name (their Service's decides). With --service-proxy-name, also labelled with
/// it (translate::service::is_foreign_slice says why).
pub fn slice_selector(service_proxy_name: Option<&str>) -> String {
    match service_proxy_name {
        Some(name) => format!("{PROXY_NAME_LABEL}={name},!{HEADLESS_LABEL}"),
        None => format!("!{HEADLESS_LABEL}"),
    }
}

pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client> {
    let config = config(kubeconfig, None).await?;
    Client::try_from(config).map_err(|e| Error::Other(format!("Kubernetes client: {e}")))
}

/// The client configuration: `kubeconfig`, else in-cluster, else $KUBECONFIG and
/// ~/.kube/config; with `api_server`, that address replaces the configured one.
pub async fn config(
    kubeconfig: Option<&std::path::Path>,
    api_server: Option<&str>,
) -> Result<kube::Config> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(e.to_string()),
            })?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| Error::Other(format!("kubeconfig {}: {e}", path.display())))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| Error::Other(format!("no Kubernetes configuration: {e}")))?,
    };
    if let Some(url) = api_server {
        config.cluster_url = url
            .parse()
            .map_err(|e| Error::Other(format!("--k8s-api-server {url:?}: {e}")))?;
    }
    Ok(config)
}

/// Why the API server at `url` can only be reached through a Service address, if it can.
fn service_address_reason(host: IpAddr, cidrs: &[Cidr]) -> Option<String> {
    if std::env::var("KUBERNETES_SERVICE_HOST")
        .ok()
        .and_then(|h| h.parse::<IpAddr>().ok())
        == Some(host)
    {
        return Some("the `kubernetes` Service's ClusterIP ($KUBERNETES_SERVICE_HOST)".into());
    }
    cidrs
        .iter()
        .find(|c| c.contains(host))
        .map(|c| format!("in the Service range {}/{}", c.addr, c.prefix))
}

/// The agent is what serves ClusterIPs: an API server address that is one cannot be reached
/// before the agent serves it, which after a reboot (empty pins) or on a new node it never
/// does. Says so at once instead of retrying forever. `served`: whether the datapath a
/// previous agent left pinned serves a frontend.
fn check_api_server(
    url: &str,
    host: Option<&str>,
    port: u16,
    served: &dyn Fn(&Frontend) -> bool,
    cidrs: &[Cidr],
) -> Result<()> {
    let Some(ip) = host
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<IpAddr>().ok())
    else {
        return Ok(());
    };
    let Some(reason) = service_address_reason(ip, cidrs) else {
        return Ok(());
    };
    let fe = Frontend::cluster(ip, port, crate::model::Protocol::Tcp);
    if served(&fe) {
        warn!(
            "the API server address {url} is {reason}; reachable only through the datapath a \
             previous svc-agent left pinned: set --k8s-api-server to the API server's own \
             address so a node with empty pins can start too"
        );
        return Ok(());
    }
    Err(Error::Other(format!(
        "the API server address {url} is {reason}, which only svc serves on this node, and \
         nothing serves it yet (no pinned datapath: a reboot, or a new node). Give the API \
         server's own address with --k8s-api-server https://HOST:PORT (or $SVC_K8S_API_SERVER), \
         as for Cilium's k8sServiceHost/k8sServicePort"
    )))
}

/// "namespace/name": one allocation, shared by every index and mark of the object. At 100,000
/// Services a pair of Strings per key, copied into each index, cost the cache half its size.
type Key = Arc<str>;

fn key(namespace: &str, name: &str) -> Key {
    Arc::from(format!("{namespace}/{name}"))
}

fn key_of<K: Resource>(o: &K) -> Key {
    let m = o.meta();
    key(
        m.namespace.as_deref().unwrap_or_default(),
        m.name.as_deref().unwrap_or_default(),
    )
}

fn owner(k: &Key) -> String {
    k.to_string()
}

/// The Service a slice belongs to, if it names one.
fn slice_service(s: &EndpointSlice) -> Option<Key> {
    let name = s.labels().get(SERVICE_NAME_LABEL)?;
    Some(key(s.meta().namespace.as_deref().unwrap_or_default(), name))
}

/// A Service as the cache keeps it: parsed on arrival, so the cache holds what the rules read
/// rather than the API object, which is many times larger (managedFields, status, ...).
struct CachedService {
    version: Option<Version>,
    /// None: not ours, or too broken to use (reported when it arrived).
    parsed: Option<ParsedService>,
}

struct CachedSlice {
    version: Option<Version>,
    /// The Service it belongs to (its `kubernetes.io/service-name` label).
    service: Option<Key>,
    /// Its last-change-trigger-time, for network programming latency.
    trigger: Option<Timestamp>,
    parsed: Option<ParsedSlice>,
}

/// A resourceVersion, compared only for equality. The API server's are decimal numbers
/// (etcd revisions), kept as one without an allocation; anything else is kept as it came.
#[derive(Debug, PartialEq, Eq)]
enum Version {
    Number(u64),
    Text(Box<str>),
}

impl Version {
    fn new(v: &str) -> Version {
        match v.parse::<u64>() {
            // Only when it reads back the same: "007" and "7" stay different.
            Ok(n) if n.to_string() == v => Version::Number(n),
            _ => Version::Text(v.into()),
        }
    }
}

fn same_version(cached: &Option<Version>, listed: &Option<String>) -> bool {
    matches!((cached, listed), (Some(c), Some(l)) if *c == Version::new(l))
}

fn version_of<K: Resource>(o: &K) -> Option<Version> {
    o.meta().resource_version.as_deref().map(Version::new)
}

/// What a watcher brought.
// Each update is moved once from its watcher into the cache, never stored as an Update, so
// the size of the largest variant costs a copy, not memory.
#[allow(clippy::large_enum_variant)]
pub enum Update {
    Service(Event<Service>),
    Slice(Event<EndpointSlice>),
    // Boxed: a Node is far larger than the rest, and node events are rare.
    Node(Box<Event<Node>>),
}

/// The API objects this node serves, and which Services changed since the last sync.
#[derive(Default)]
pub struct Cache {
    /// What parsing needs to know: this proxy's name.
    node: NodeContext,
    /// How long a burst of events may keep arriving before the affected Services are synced.
    coalesce: Duration,
    services: BTreeMap<Key, CachedService>,
    slices: BTreeMap<Key, CachedSlice>,
    /// (Service, slice) pairs: no collection per Service, as most have a single slice.
    slices_of: BTreeSet<(Key, Key)>,
    /// A relist in progress; None for an object whose version is what the cache has.
    service_relist: Option<BTreeMap<Key, Option<CachedService>>>,
    slice_relist: Option<BTreeMap<Key, Option<CachedSlice>>>,
    services_listed: bool,
    slices_listed: bool,
    zone: Option<String>,
    /// The Node's addresses (kube-proxy's node IPs) when they changed, for the agent to take.
    node_ips: Option<Vec<IpAddr>>,
    /// Whether the node takes load balancer traffic (not while being deleted), as last seen,
    /// and whether that is still to be handed over.
    node_eligible: bool,
    eligible_changed: bool,
    /// Services to translate again at the next sync.
    dirty: BTreeSet<Key>,
    /// Everything must be translated again (first sync, the node's zone changed).
    all_dirty: bool,
    /// When the oldest change not yet programmed arrived.
    first_change: Option<Instant>,
    /// Problems found while parsing, reported with the next sync.
    errors: Vec<Error>,
    /// When the agent started watching: a change triggered before it has no programming
    /// latency of this agent's (kube-proxy's trackerStartTime); a listed slice's annotation
    /// may be days old.
    watching_since: Option<Timestamp>,
    /// kube-proxy's change counters since they were last taken, and what waits for a sync
    /// (`Tracker::take_changes`).
    changes: super::Changes,
    /// Services with a change of their own (not their slices') since the last sync.
    services_pending: BTreeSet<Key>,
}

impl Cache {
    /// An empty cache, which has everything to sync once both lists are complete.
    pub fn new(node: NodeContext, coalesce: Duration) -> Cache {
        Cache {
            node,
            coalesce,
            all_dirty: true,
            watching_since: Some(Timestamp::now()),
            node_eligible: true,
            ..Default::default()
        }
    }

    /// A change to Service `k` seen, as kube-proxy's ServiceChangeTracker counts one.
    fn service_changed(&mut self, k: &Key) {
        self.changes.services += 1;
        self.services_pending.insert(k.clone());
        self.changes.services_pending = self.services_pending.len();
    }

    /// `n` EndpointSlice changes seen, as kube-proxy's EndpointsChangeTracker counts them.
    fn endpoints_changed(&mut self, n: usize) {
        self.changes.endpoints += n as u64;
        self.changes.endpoints_pending += n;
    }

    fn mark(&mut self, k: Key) {
        self.dirty.insert(k);
        self.first_change.get_or_insert_with(Instant::now);
    }

    fn cache_service(&mut self, s: &Service) -> CachedService {
        CachedService {
            version: version_of(s),
            parsed: translate::parse_service(s, &self.node, &mut self.errors),
        }
    }

    fn cache_slice(&mut self, s: &EndpointSlice) -> CachedSlice {
        CachedSlice {
            version: version_of(s),
            service: slice_service(s).map(|k| self.shared(k)),
            trigger: s
                .annotations()
                .get(TRIGGER_TIME_ANNOTATION)
                .and_then(|t| t.parse::<Timestamp>().ok()),
            parsed: translate::parse_slice(s, &self.node, &mut self.errors),
        }
    }

    /// The Service's own key when it is cached, so that its slices do not keep copies.
    fn shared(&self, k: Key) -> Key {
        self.services
            .get_key_value(&k)
            .map_or(k, |(own, _)| own.clone())
    }

    fn index_slice(&mut self, k: &Key, service: Option<&Key>, add: bool) {
        if let Some(svc) = service {
            let pair = (svc.clone(), k.clone());
            if add {
                self.slices_of.insert(pair);
            } else {
                self.slices_of.remove(&pair);
            }
            self.mark(svc.clone());
        }
    }

    /// The keys of the slices of Service `svc`.
    fn slices_of<'a>(&'a self, svc: &'a Key) -> impl Iterator<Item = &'a Key> + 'a {
        // One shared empty key as the range's lower bound: `Key::from("")` allocates each time.
        static LEAST: std::sync::LazyLock<Key> = std::sync::LazyLock::new(|| Key::from(""));
        let from = (svc.clone(), LEAST.clone());
        self.slices_of
            .range(from..)
            .take_while(move |(s, _)| s == svc)
            .map(|(_, slice)| slice)
    }

    fn put_slice(&mut self, k: Key, s: CachedSlice) {
        if let Some(old) = self.slices.remove(&k) {
            self.index_slice(&k, old.service.as_ref(), false);
        }
        self.index_slice(&k, s.service.as_ref(), true);
        self.slices.insert(k, s);
    }

    fn delete_slice(&mut self, k: &Key) {
        if let Some(old) = self.slices.remove(k) {
            self.index_slice(k, old.service.as_ref(), false);
        }
    }

    fn update(&mut self, u: Update) {
        self.apply_event(u);
        // The first full sync is due once both lists are complete, even when they were empty
        // (no event marked anything): an agent started before any Service exists must still
        // sync, clear what a previous run left in the maps, and report ready.
        if self.all_dirty && self.ready() {
            self.first_change.get_or_insert_with(Instant::now);
        }
    }

    fn apply_event(&mut self, u: Update) {
        match u {
            Update::Service(e) => match e {
                Event::Apply(s) => {
                    let k = key_of(&s);
                    self.service_changed(&k);
                    let cached = self.cache_service(&s);
                    self.services.insert(k.clone(), cached);
                    self.mark(k);
                }
                Event::Delete(s) => {
                    let k = key_of(&s);
                    self.service_changed(&k);
                    self.services.remove(&k);
                    self.mark(k);
                }
                Event::Init => self.service_relist = Some(BTreeMap::new()),
                Event::InitApply(s) => {
                    let k = key_of(&s);
                    let unchanged = self.services.get(&k).is_some_and(|old| {
                        same_version(&old.version, &s.metadata.resource_version)
                    });
                    let entry = (!unchanged).then(|| self.cache_service(&s));
                    if let Some(buf) = self.service_relist.as_mut() {
                        buf.insert(k, entry);
                    }
                }
                Event::InitDone => {
                    let fresh = self.service_relist.take().unwrap_or_default();
                    let mut services = Vec::with_capacity(fresh.len());
                    let mut changed = Vec::new();
                    for (k, entry) in fresh {
                        match entry {
                            Some(new) => {
                                changed.push(k.clone());
                                services.push((k, new));
                            }
                            None => {
                                if let Some(old) = self.services.remove(&k) {
                                    services.push((k, old));
                                }
                            }
                        }
                    }
                    // What is left was not listed again: deleted while we were not watching.
                    changed.extend(std::mem::take(&mut self.services).into_keys());
                    changed.iter().for_each(|k| self.service_changed(k));
                    // Collected from sorted entries: packed, as `sys::packed` makes it. Filled
                    // in key order, as a list arrives, a B-tree's nodes stay about half full;
                    // with the cache's large values that is a third of its memory.
                    self.services = services.into_iter().collect();
                    changed.into_iter().for_each(|k| self.mark(k));
                    self.services_listed = true;
                    info!(services = self.services.len(), "Services listed");
                }
            },
            Update::Slice(e) => match e {
                Event::Apply(s) => {
                    self.endpoints_changed(1);
                    let cached = self.cache_slice(&s);
                    self.put_slice(key_of(&s), cached);
                }
                Event::Delete(s) => {
                    self.endpoints_changed(1);
                    self.delete_slice(&key_of(&s))
                }
                Event::Init => self.slice_relist = Some(BTreeMap::new()),
                Event::InitApply(s) => {
                    let k = key_of(&s);
                    let unchanged = self.slices.get(&k).is_some_and(|old| {
                        same_version(&old.version, &s.metadata.resource_version)
                    });
                    let entry = (!unchanged).then(|| self.cache_slice(&s));
                    if let Some(buf) = self.slice_relist.as_mut() {
                        buf.insert(k, entry);
                    }
                }
                Event::InitDone => {
                    let fresh = self.slice_relist.take().unwrap_or_default();
                    let gone: Vec<Key> = self
                        .slices
                        .keys()
                        .filter(|k| !fresh.contains_key(*k))
                        .cloned()
                        .collect();
                    let listed_changes = fresh.values().filter(|e| e.is_some()).count();
                    self.endpoints_changed(gone.len() + listed_changes);
                    for k in gone {
                        self.delete_slice(&k);
                    }
                    for (k, entry) in fresh {
                        if let Some(new) = entry {
                            self.put_slice(k, new);
                        }
                    }
                    self.slices = crate::sys::packed(std::mem::take(&mut self.slices));
                    self.slices_of = crate::sys::packed(std::mem::take(&mut self.slices_of));
                    self.slices_listed = true;
                    info!(slices = self.slices.len(), "EndpointSlices listed");
                }
            },
            Update::Node(e) => {
                let eligible = match &*e {
                    Event::Apply(n) | Event::InitApply(n) => node_eligible(n),
                    // Deleted: being deleted, until its kubelet makes it again.
                    Event::Delete(_) => false,
                    Event::Init | Event::InitDone => self.node_eligible,
                };
                if eligible != self.node_eligible {
                    info!(
                        eligible,
                        "node eligibility for load balancer traffic changed"
                    );
                    self.node_eligible = eligible;
                    self.eligible_changed = true;
                }
                let (zone, addresses) = match *e {
                    Event::Apply(n) | Event::InitApply(n) => {
                        let addresses: Vec<(String, String)> = n
                            .status
                            .as_ref()
                            .and_then(|s| s.addresses.as_ref())
                            .into_iter()
                            .flatten()
                            .map(|a| (a.type_.clone(), a.address.clone()))
                            .collect();
                        (n.labels().get(ZONE_LABEL).cloned(), addresses)
                    }
                    // The node goes on running (its kubelet makes the object again): its
                    // labels are forgotten, as kube-proxy's proxier forgets them, but not its
                    // addresses, which kube-proxy's node IPs keep too.
                    Event::Delete(_) => (None, Vec::new()),
                    Event::Init | Event::InitDone => return,
                };
                // A Node without addresses (made again by its kubelet, before the cloud
                // controller sets them) says nothing about them: NodePorts keep answering on
                // the last known ones, or on the devices' until there are any.
                let ips = crate::packet::node_host_ips(&addresses);
                if !ips.is_empty() {
                    self.node_ips = Some(ips);
                }
                if zone != self.zone {
                    info!(?zone, "node zone changed; translating every Service again");
                    self.zone = zone;
                    self.all_dirty = true;
                    self.first_change.get_or_insert_with(Instant::now);
                }
            }
        }
    }

    fn ready(&self) -> bool {
        self.services_listed && self.slices_listed
    }

    /// The parsed Services in `keys`, and every parsed slice that belongs to them.
    fn objects_for<'a>(
        &'a self,
        keys: &BTreeSet<Key>,
    ) -> (Vec<&'a ParsedService>, Vec<&'a ParsedSlice>) {
        let services = keys
            .iter()
            .filter_map(|k| self.services.get(k)?.parsed.as_ref())
            .collect();
        let slices = keys
            .iter()
            .flat_map(|k| self.slices_of(k))
            .filter_map(|sk| self.slices.get(sk)?.parsed.as_ref())
            .collect();
        (services, slices)
    }

    /// The trigger times of the slices of `keys`, each with its Service, for network
    /// programming latency.
    fn trigger_times<'a>(
        &'a self,
        keys: &'a BTreeSet<Key>,
    ) -> impl Iterator<Item = (&'a Key, Timestamp)> + 'a {
        keys.iter()
            .flat_map(move |k| self.slices_of(k).map(move |sk| (k, sk)))
            .filter_map(|(k, sk)| Some((k, self.slices.get(sk)?.trigger?)))
            .filter(|(_, t)| self.watching_since.is_none_or(|since| *t > since))
    }
}

impl Tracker for Cache {
    fn syncs_by_service(&self) -> bool {
        true
    }

    fn apply(&mut self, event: SourceEvent) {
        if let SourceEvent::Api(u) = event {
            self.update(u);
        }
    }

    fn due(&self) -> Option<Instant> {
        self.first_change
            .filter(|_| self.ready())
            .map(|t| t + self.coalesce)
    }

    fn queued(&self) -> bool {
        self.first_change.is_some()
    }

    fn retranslate_all(&mut self) {
        self.all_dirty = true;
        self.first_change.get_or_insert_with(Instant::now);
    }

    fn take_node_ips(&mut self) -> Option<Vec<IpAddr>> {
        self.node_ips.take()
    }

    fn take_node_eligible(&mut self) -> Option<bool> {
        std::mem::take(&mut self.eligible_changed).then_some(self.node_eligible)
    }

    /// Everything after the first lists and after a change of the node; else the Services
    /// marked, with their slices. Conflicts among the Services of one batch are resolved as
    /// a full sync resolves them (the holder keeps its frontend), so whether two changes land
    /// together does not decide.
    fn take_changes(&mut self) -> super::Changes {
        let c = self.changes;
        // The totals are handed over; what is pending stays until the sync takes it.
        self.changes.services = 0;
        self.changes.endpoints = 0;
        c
    }

    fn take(&mut self, _: &dyn Holders) -> Batch<'_> {
        self.services_pending.clear();
        self.changes.services_pending = 0;
        self.changes.endpoints_pending = 0;
        let since = self.first_change.take().unwrap_or_else(Instant::now);
        let dirty = std::mem::take(&mut self.dirty);
        let errors = std::mem::take(&mut self.errors);
        let all = std::mem::take(&mut self.all_dirty);
        let triggers = self
            .trigger_times(&dirty)
            .map(|(k, t)| (owner(k), t))
            .collect();
        let (owners, services, slices) = if all {
            (
                None,
                self.services
                    .values()
                    .filter_map(|s| s.parsed.as_ref())
                    .collect(),
                self.slices
                    .values()
                    .filter_map(|s| s.parsed.as_ref())
                    .collect(),
            )
        } else {
            let (services, slices) = self.objects_for(&dirty);
            (Some(dirty.iter().map(owner).collect()), services, slices)
        };
        Batch {
            owners,
            services,
            slices,
            errors,
            zone: self.zone.clone(),
            since,
            triggers,
            changed: dirty.len(),
        }
    }
}

fn updates<K, F>(
    api: Api<K>,
    config: watcher::Config,
    kind: &'static str,
    failures: Arc<std::sync::Mutex<FailureLog>>,
    wrap: F,
) -> impl Stream<Item = SourceEvent> + Send
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: Fn(Event<K>) -> Update + Send + 'static,
{
    watcher::watcher(api, config)
        .default_backoff()
        .map(move |r| {
            // A panic elsewhere must not silence the watches' log.
            let mut log = failures.lock().unwrap_or_else(|p| p.into_inner());
            match r {
                Ok(e) => {
                    log.answered(kind);
                    SourceEvent::Api(wrap(e))
                }
                Err(e) => {
                    let text = crate::error::error_chain(&e);
                    log.failed(kind, &text, Instant::now());
                    SourceEvent::WatchError(kind, text)
                }
            }
        })
}

/// How often, at most, the watches' failures are logged after the first: the watches retry
/// with backoff (from under a second), each on its own, so an unreachable API server would
/// otherwise give several lines a second.
pub const FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

/// The watches' failures as the log tells them: one line at the first failure, then at most
/// one every [`FAILURE_LOG_EVERY`], with the latest failure (its whole cause) and how many
/// were not logged; each is still counted in `svc_errors_total`. Shared by the watches.
#[derive(Debug)]
pub struct FailureLog {
    api_server: String,
    last_line: Option<Instant>,
    /// Failures since the last line.
    unlogged: u64,
    /// The watches failing now, and their failures so far.
    failing: BTreeMap<&'static str, u64>,
}

impl FailureLog {
    pub fn new(api_server: &str) -> FailureLog {
        FailureLog {
            api_server: api_server.to_string(),
            last_line: None,
            unlogged: 0,
            failing: BTreeMap::new(),
        }
    }

    /// A watch failed: logs it, unless a line was logged less than [`FAILURE_LOG_EVERY`] ago.
    pub fn failed(&mut self, kind: &'static str, error: &str, now: Instant) {
        if let Some(line) = self.line(kind, error, now) {
            warn!("{line}");
        }
    }

    /// `failed`'s line, if one is due.
    fn line(&mut self, kind: &'static str, error: &str, now: Instant) -> Option<String> {
        *self.failing.entry(kind).or_default() += 1;
        if self
            .last_line
            .is_some_and(|t| now.saturating_duration_since(t) < FAILURE_LOG_EVERY)
        {
            self.unlogged += 1;
            return None;
        }
        self.last_line = Some(now);
        let mut line = format!("{kind}: the API server {}: {error}", self.api_server);
        match std::mem::take(&mut self.unlogged) {
            0 => {}
            n => line.push_str(&format!(
                " (and {n} more failures of the watches since the last such line; they retry \
                 with backoff)"
            )),
        }
        Some(line)
    }

    /// A watch received something: it works (again).
    pub fn answered(&mut self, kind: &'static str) {
        if let Some(n) = self.failing.remove(kind) {
            info!(
                failures = n,
                "{kind}: the API server {} answers again", self.api_server
            );
        }
    }
}

/// The API server, connected.
pub struct ApiServer {
    client: Client,
    url: String,
    host: Option<String>,
    port: u16,
}

impl ApiServer {
    /// `rest`: what counts its requests (the agent's /metrics), if anything does.
    pub async fn connect(
        opts: &KubeOptions,
        rest: Option<&super::rest_client::RestClientMetrics>,
    ) -> Result<ApiServer> {
        let config = config(opts.kubeconfig.as_deref(), opts.api_server.as_deref()).await?;
        let url = config.cluster_url.to_string();
        let host = config.cluster_url.host().map(str::to_string);
        let port = config.cluster_url.port_u16().unwrap_or(443);
        let layer = rest.map(|m| m.layer(&config.cluster_url));
        let builder = kube::client::ClientBuilder::try_from(config)
            .map_err(|e| Error::Other(format!("Kubernetes client: {e}")))?;
        let client = match layer {
            Some(layer) => builder.with_layer(&layer).build(),
            None => builder.build(),
        };
        Ok(ApiServer {
            client,
            url,
            host,
            port,
        })
    }

    /// Whether the API server's address is a Service address (`check` then needs what the
    /// pinned datapath serves): the API can only be reached once that is known.
    pub fn behind_service(&self, cidrs: &[Cidr]) -> bool {
        self.host
            .as_deref()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
            .and_then(|h| h.parse::<IpAddr>().ok())
            .is_some_and(|ip| service_address_reason(ip, cidrs).is_some())
    }

    /// Fails when the API server can only be reached through a Service address that nothing
    /// serves yet; `served` says whether a frontend is served by what is pinned.
    pub fn check(&self, cidrs: &[Cidr], served: &dyn Fn(&Frontend) -> bool) -> Result<()> {
        check_api_server(&self.url, self.host.as_deref(), self.port, served, cidrs)
    }

    /// The Services, the EndpointSlices and this node as they are now, as the events a
    /// first watch would give (`--dry-run`): each list whole, then the Node.
    pub async fn snapshot(&self, opts: &KubeOptions) -> Result<Vec<Update>> {
        let (services, slices, node) = self.objects(opts).await?;
        let mut updates = vec![Update::Service(Event::Init)];
        updates.extend(
            services
                .into_iter()
                .map(|s| Update::Service(Event::InitApply(s))),
        );
        updates.extend([Update::Service(Event::InitDone), Update::Slice(Event::Init)]);
        updates.extend(
            slices
                .into_iter()
                .map(|s| Update::Slice(Event::InitApply(s))),
        );
        updates.push(Update::Slice(Event::InitDone));
        if let Some(n) = node {
            updates.push(Update::Node(Box::new(Event::Apply(n))));
        }
        Ok(updates)
    }

    /// The Services and EndpointSlices kube-proxy's selection gives, and this node, as they
    /// are now.
    pub async fn objects(
        &self,
        opts: &KubeOptions,
    ) -> Result<(Vec<Service>, Vec<EndpointSlice>, Option<Node>)> {
        let proxy_name = opts.service_proxy_name.as_deref();
        let listing = |kind: &str, e: kube::Error| Error::Other(format!("listing {kind}: {e}"));
        let services = list_all(
            &Api::<Service>::all(self.client.clone()),
            &service_selector(proxy_name),
        )
        .await
        .map_err(|e| listing("Services", e))?;
        let slices = list_all(
            &Api::<ListedSlice>::all(self.client.clone()),
            &slice_selector(proxy_name),
        )
        .await
        .map_err(|e| listing("EndpointSlices", e))?
        .into_iter()
        .map(EndpointSlice::from)
        .collect();
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&opts.node_name)
            .await
            .map_err(|e| listing("Nodes", e))?;
        Ok((services, slices, node))
    }

    /// Warns, once, that `--maglev-seed` is left at its built-in default when the cluster has
    /// more than one Node: nodes whose seeds differ choose different backends for a flow that
    /// moves between them, and one default everywhere hides that a seed was meant to be set.
    /// A one-node cluster has no other node to agree with, so it is not told. Counted at
    /// start and again every `every` until told (a cluster grows), with a list of at most two
    /// Nodes' metadata (cheap at any cluster size; RBAC grants nodes list). A refused or
    /// failed list is tried again at the next round and says nothing.
    pub fn warn_default_seed(&self, every: Duration) -> SeedCheck {
        let client = self.client.clone();
        SeedCheck(tokio::spawn(async move {
            let mut first = true;
            loop {
                match several_nodes(&client).await {
                    Ok(false) if first => {
                        first = false;
                        info!(
                            "one Node in the cluster: --maglev-seed left at its built-in \
                             default is warned about once a second Node appears"
                        );
                    }
                    Ok(true) => {
                        warn!(
                            "--maglev-seed is left at its built-in default and the cluster \
                             has more than one node: every node must use the same seed for \
                             Maglev to send a flow to the same backend from any node; set \
                             one cluster-wide"
                        );
                        return;
                    }
                    Ok(false) => {}
                    Err(e) => tracing::debug!(error = %e, "counting Nodes for the seed warning"),
                }
                tokio::time::sleep(every).await;
            }
        }))
    }

    /// What answers, at the agent's stop, whether it stops for good on this node.
    pub fn removal(&self, opts: &KubeOptions) -> Option<Removal> {
        let (namespace, name) = opts.daemonset.clone()?;
        let seen = Arc::new(std::sync::Mutex::new(None));
        let watch = tokio::spawn(watch_daemonset(
            self.client.clone(),
            namespace.clone(),
            name.clone(),
            seen.clone(),
        ));
        Some(Removal {
            client: self.client.clone(),
            namespace,
            name,
            node: opts.node_name.clone(),
            seen,
            watch,
        })
    }

    /// The events of the Services, the EndpointSlices and this node, as kube-proxy selects
    /// them.
    pub fn watch(self, opts: &KubeOptions) -> impl Stream<Item = SourceEvent> + Send {
        info!(api_server = %self.url, "watching the Kubernetes API");
        let failures = Arc::new(std::sync::Mutex::new(FailureLog::new(&self.url)));
        let proxy_name = opts.service_proxy_name.as_deref();
        let config = || {
            let c = watcher::Config::default().page_size(LIST_PAGE);
            if opts.watch_list {
                c.streaming_lists()
            } else {
                c
            }
        };
        let services = updates(
            Api::<Service>::all(self.client.clone()),
            config().labels(&service_selector(proxy_name)),
            "watch_services",
            failures.clone(),
            Update::Service,
        );
        // Decoded only as far as the agent reads them (`ListedSlice`): a page of them is held
        // until each is parsed.
        let slices = updates(
            Api::<ListedSlice>::all(self.client.clone()),
            config().labels(&slice_selector(proxy_name)),
            "watch_endpointslices",
            failures.clone(),
            |e| Update::Slice(slice_event(e)),
        );
        let nodes = updates(
            Api::<Node>::all(self.client),
            watcher::Config::default().fields(&format!("metadata.name={}", opts.node_name)),
            "watch_node",
            failures,
            |e| Update::Node(Box::new(e)),
        );
        futures::stream::select_all([services.boxed(), slices.boxed(), nodes.boxed()])
    }
}

/// Every object `selector` selects, in pages of `LIST_PAGE` as the watchers list them: one
/// consistent snapshot (the continue token holds the first page's resourceVersion).
pub async fn list_all<K>(api: &Api<K>, selector: &str) -> std::result::Result<Vec<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut params = kube::api::ListParams::default()
        .labels(selector)
        .limit(LIST_PAGE);
    let mut out = Vec::new();
    loop {
        let page = api.list(&params).await?;
        out.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(out),
        }
    }
}

/// The default-seed check (`ApiServer::warn_default_seed`), stopped when dropped.
pub struct SeedCheck(tokio::task::JoinHandle<()>);

impl Drop for SeedCheck {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether the cluster has more than one Node: a list of at most two.
async fn several_nodes(client: &Client) -> std::result::Result<bool, kube::Error> {
    let list = Api::<Node>::all(client.clone())
        .list_metadata(&kube::api::ListParams::default().limit(2))
        .await?;
    Ok(list.items.len() > 1)
}

/// The node as the agent's translation sees it, from its Node object (`explain`): name,
/// zone and node IPs as the watch gives them.
pub fn node_context(opts: &KubeOptions, node: Option<&Node>) -> NodeContext {
    let addresses: Vec<(String, String)> = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .map(|a| (a.type_.clone(), a.address.clone()))
        .collect();
    NodeContext {
        node_name: Some(opts.node_name.clone()),
        zone: node.and_then(|n| n.labels().get(ZONE_LABEL).cloned()),
        service_proxy_name: opts.service_proxy_name.clone(),
        node_ips: crate::packet::node_host_ips(&addresses),
    }
}

/// The DaemonSet an agent runs in, and its node.
///
/// A stopped agent leaves its programs attached and its maps pinned, so that a restart or an
/// upgrade drops no connection. But when the agent stops because it will not run on this node
/// again (its DaemonSet deleted, or the node no longer selected), that datapath would go on
/// sending new connections to the endpoints of the moment, ahead of whatever proxy comes next
/// (the socket hooks run before kube-proxy's rules): then it must uninstall.
pub struct Removal {
    client: Client,
    namespace: String,
    name: String,
    node: String,
    /// Why the DaemonSet no longer runs the agent, as a watch of it saw while the agent ran.
    /// `helm uninstall` deletes the RBAC with the DaemonSet: at the agent's stop the API then
    /// refuses to say, but the watch, open since the start, saw the deletion as it happened.
    seen: Arc<std::sync::Mutex<Option<String>>>,
    watch: tokio::task::JoinHandle<()>,
}

impl Drop for Removal {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// Watches DaemonSet `namespace`/`name` (by name: RBAC grants list and watch of that one
/// only) and keeps in `seen` why it no longer runs the agent: gone, or being deleted; None
/// while it stands. Refusals are logged once and change nothing.
async fn watch_daemonset(
    client: Client,
    namespace: String,
    name: String,
    seen: Arc<std::sync::Mutex<Option<String>>>,
) {
    use k8s_openapi::api::apps::v1::DaemonSet;
    let api = Api::<DaemonSet>::namespaced(client, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher::watcher(api, config).default_backoff().boxed();
    let set = |why: Option<&str>| {
        if let Ok(mut s) = seen.lock() {
            *s = why.map(str::to_string);
        }
    };
    let mut listed = false;
    let mut refused = false;
    while let Some(e) = events.next().await {
        match e {
            Ok(Event::Init) => listed = false,
            Ok(Event::InitApply(ds) | Event::Apply(ds)) => {
                listed = true;
                set(ds
                    .metadata
                    .deletion_timestamp
                    .is_some()
                    .then_some("is being deleted"));
            }
            Ok(Event::InitDone) if !listed => set(Some("is gone")),
            Ok(Event::InitDone) => {}
            Ok(Event::Delete(_)) => set(Some("is gone")),
            Err(e) if !refused => {
                refused = true;
                warn!(error = %crate::error::error_chain(&e), daemonset = %format!("{namespace}/{name}"),
                    "cannot watch the agent's DaemonSet: its removal is read at the stop only");
            }
            Err(_) => {}
        }
    }
}

impl Removal {
    /// Why the agent stops for good, as the watch of its DaemonSet last saw it: the answer
    /// when the API refuses to give one at the stop.
    pub fn watched(&self) -> Option<String> {
        let why = self.seen.lock().ok()?.clone()?;
        Some(format!("DaemonSet {}/{} {why}", self.namespace, self.name))
    }

    /// Why the agent stops for good on this node, or None when it is only restarted (a rolling
    /// update, a node shutdown) or the API cannot tell.
    pub async fn reason(&self) -> Result<Option<String>> {
        use k8s_openapi::api::apps::v1::DaemonSet;
        let ds_name = format!("DaemonSet {}/{}", self.namespace, self.name);
        let getting = |what: &str, e: kube::Error| Error::Other(format!("reading {what}: {e}"));
        let ds = Api::<DaemonSet>::namespaced(self.client.clone(), &self.namespace)
            .get_opt(&self.name)
            .await
            .map_err(|e| getting(&ds_name, e))?;
        let Some(ds) = ds else {
            return Ok(Some(format!("{ds_name} is gone")));
        };
        if ds.metadata.deletion_timestamp.is_some() {
            return Ok(Some(format!("{ds_name} is being deleted")));
        }
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&self.node)
            .await
            .map_err(|e| getting(&format!("Node {}", self.node), e))?;
        let Some(node) = node else {
            return Ok(Some(format!("Node {} is gone", self.node)));
        };
        let pod = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref());
        Ok(pod
            .and_then(|p| unselected(p, node.labels()))
            .map(|why| format!("{ds_name} no longer selects Node {}: {why}", self.node)))
    }
}

/// Why a pod of `spec` would not be scheduled on a node with `labels`, by its nodeSelector
/// and required node affinity (the parts of scheduling a DaemonSet's node selection is made
/// of; taints are left out: a DaemonSet's pods tolerate the node's own).
fn unselected(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    labels: &BTreeMap<String, String>,
) -> Option<String> {
    for (k, v) in spec.node_selector.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Some(format!("nodeSelector {k}={v}"));
        }
    }
    let terms = spec
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?;
    // The terms are ORed, each term's expressions ANDed; a term of fields only (matchFields,
    // metadata.name) is taken as matching: the agent runs on the node it names.
    let matches = |t: &k8s_openapi::api::core::v1::NodeSelectorTerm| {
        t.match_expressions
            .iter()
            .flatten()
            .all(|e| expression_holds(e, labels))
    };
    if terms.node_selector_terms.iter().any(matches) {
        None
    } else {
        Some("required node affinity".to_string())
    }
}

/// One node selector requirement, as the scheduler evaluates it.
fn expression_holds(
    e: &k8s_openapi::api::core::v1::NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> bool {
    let values = e.values.as_deref().unwrap_or_default();
    let value = labels.get(&e.key);
    let number = |s: &str| s.parse::<i64>().ok();
    match e.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => !value.is_some_and(|v| values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| number(v)),
                values.first().and_then(|b| number(b)),
            ) else {
                return false;
            };
            if e.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        // An operator the API server would have refused: it selects nothing, as in the
        // scheduler.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unreachable API server: three watches failing on their own backoff give one line at
    /// once, then at most one per FAILURE_LOG_EVERY, with the number not logged.
    #[test]
    fn watch_failures_are_one_line_per_interval() {
        let mut log = FailureLog::new("https://127.0.0.1:1/");
        let t0 = Instant::now();
        let refused = "client error (Connect): Connection refused (os error 111)";
        let mut lines = Vec::new();
        for ms in (0..25_000).step_by(250) {
            for kind in ["watch_services", "watch_endpointslices", "watch_node"] {
                lines.extend(log.line(kind, refused, t0 + Duration::from_millis(ms)));
            }
        }
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert_eq!(
            lines[0],
            "watch_services: the API server https://127.0.0.1:1/: client error (Connect): \
             Connection refused (os error 111)"
        );
        assert!(
            lines[1].ends_with(
                "(os error 111) (and 119 more failures of the watches since the last such \
                 line; they retry with backoff)"
            ),
            "{}",
            lines[1]
        );
        log.answered("watch_services");
        assert_eq!(log.failing.len(), 2);
    }

    fn pod_spec(v: serde_json::Value) -> k8s_openapi::api::core::v1::PodSpec {
        serde_json::from_value(v).expect("a pod spec")
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_node_is_unselected_by_a_missing_selector_label_or_a_failing_affinity() {
        let by_selector = pod_spec(serde_json::json!({
            "containers": [],
            "nodeSelector": {"kubernetes.io/os": "linux", "svc.dev/agent": "true"},
        }));
        let node = labels(&[("kubernetes.io/os", "linux"), ("svc.dev/agent", "true")]);
        assert_eq!(unselected(&by_selector, &node), None);
        assert_eq!(
            unselected(&by_selector, &labels(&[("kubernetes.io/os", "linux")])).as_deref(),
            Some("nodeSelector svc.dev/agent=true")
        );
        let none = pod_spec(serde_json::json!({"containers": []}));
        assert_eq!(unselected(&none, &labels(&[])), None);

        let by_affinity = |exprs: serde_json::Value| {
            pod_spec(serde_json::json!({
                "containers": [],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": exprs}],
                }}},
            }))
        };
        let held = |exprs: serde_json::Value, l: &[(&str, &str)]| {
            unselected(&by_affinity(exprs), &labels(l)).is_none()
        };
        let expr = |k: &str, op: &str, v: &[&str]| serde_json::json!([{"key": k, "operator": op, "values": v}]);
        assert!(held(expr("zone", "In", &["a", "b"]), &[("zone", "b")]));
        assert!(!held(expr("zone", "In", &["a"]), &[("zone", "b")]));
        assert!(!held(expr("zone", "In", &["a"]), &[]));
        assert!(held(expr("zone", "NotIn", &["a"]), &[]));
        assert!(!held(expr("zone", "NotIn", &["a"]), &[("zone", "a")]));
        assert!(held(expr("svc", "Exists", &[]), &[("svc", "")]));
        assert!(!held(expr("svc", "DoesNotExist", &[]), &[("svc", "")]));
        assert!(held(expr("gen", "Gt", &["5"]), &[("gen", "6")]));
        assert!(!held(expr("gen", "Lt", &["5"]), &[("gen", "6")]));
        assert!(!held(expr("gen", "Gt", &["5"]), &[("gen", "x")]));
        // Terms are ORed.
        let two_terms = pod_spec(serde_json::json!({
            "containers": [],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                    {"matchExpressions": [{"key": "b", "operator": "Exists"}]},
                ],
            }}},
        }));
        assert_eq!(unselected(&two_terms, &labels(&[("b", "1")])), None);
        assert_eq!(
            unselected(&two_terms, &labels(&[("c", "1")])).as_deref(),
            Some("required node affinity")
        );
    }

    fn svc(ns: &str, name: &str, rv: &str) -> Service {
        let mut s: Service = serde_json::from_value(serde_json::json!({
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}
        }))
        .unwrap();
        s.metadata.namespace = Some(ns.into());
        s.metadata.name = Some(name.into());
        s.metadata.resource_version = Some(rv.into());
        s
    }

    fn slice(ns: &str, name: &str, service: &str, rv: &str) -> EndpointSlice {
        let mut s: EndpointSlice = serde_json::from_value(serde_json::json!({
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"]}],
            "ports": [{"port": 8080}]
        }))
        .unwrap();
        s.metadata.namespace = Some(ns.into());
        s.metadata.name = Some(name.into());
        s.metadata.resource_version = Some(rv.into());
        s.metadata.labels = Some([(SERVICE_NAME_LABEL.to_string(), service.to_string())].into());
        s
    }

    fn k(ns: &str, n: &str) -> Key {
        key(ns, n)
    }

    /// The Node object is deleted (and made again by its kubelet, whose new object has no
    /// addresses until the cloud controller sets them) while the node runs: NodePorts must go
    /// on answering on its addresses, as under kube-proxy (which keeps its node IPs), not stop
    /// until the addresses are back.
    #[test]
    fn a_deleted_or_addressless_node_object_keeps_the_node_ips() {
        let node = |addresses: serde_json::Value| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "node-1"},
                "status": {"addresses": addresses}
            }))
            .unwrap()
        };
        let mut c = Cache::default();
        let n = node(serde_json::json!([{"type": "InternalIP", "address": "10.0.0.1"}]));
        c.update(Update::Node(Box::new(Event::Apply(n.clone()))));
        assert_eq!(c.node_ips.take(), Some(vec!["10.0.0.1".parse().unwrap()]));
        c.update(Update::Node(Box::new(Event::Delete(n))));
        assert_eq!(c.node_ips.take(), None, "the node IPs were dropped");
        c.update(Update::Node(Box::new(Event::Apply(node(
            serde_json::json!([]),
        )))));
        assert_eq!(c.node_ips.take(), None, "the node IPs were dropped");
    }

    /// Two Services that list ExternalIP 203.0.113.10 port 80; the younger serves it (it
    /// listed it first). An edit of the older one that lands in the same sync as any change of
    /// the younger one (a pod restarting) must not move the address: what serves keeps
    /// serving, as when either changes alone and as after a restart.
    #[test]
    fn a_frontend_stays_with_its_holder_when_both_claimants_change_together() {
        struct Holder;
        impl translate::Holders for Holder {
            fn holder(&self, fe: &crate::model::Frontend) -> Option<&str> {
                (fe.ip.to_string() == "203.0.113.10").then_some("ns/young")
            }
        }
        let claimant = |name: &str, ip: &str, created: &str| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "ns", "name": name, "resourceVersion": "2",
                             "creationTimestamp": created},
                "spec": {"clusterIP": ip, "externalIPs": ["203.0.113.10"],
                         "ports": [{"port": 80}]}
            }))
            .unwrap()
        };
        let mut c = Cache::default();
        c.update(Update::Service(Event::Apply(claimant(
            "old",
            "10.96.0.1",
            "2020-01-01T00:00:00Z",
        ))));
        c.update(Update::Service(Event::Apply(claimant(
            "young",
            "10.96.0.2",
            "2024-01-01T00:00:00Z",
        ))));
        assert_eq!(c.dirty, BTreeSet::from([k("ns", "old"), k("ns", "young")]));
        let batch = c.take(&Holder);
        let t = translate::assemble_with(
            batch.services,
            batch.slices,
            &NodeContext::default(),
            &Holder,
        );
        let owners: Vec<(String, String)> = t
            .state
            .frontends
            .values()
            .filter(|d| d.frontend.ip.to_string() == "203.0.113.10")
            .map(|d| (d.frontend.to_string(), d.owner().to_string()))
            .collect();
        assert_eq!(owners.len(), 2, "{owners:?}");
        for (fe, owner) in &owners {
            assert_eq!(
                owner, "ns/young",
                "{fe} moved away from the Service serving it"
            );
        }
    }

    #[test]
    fn objects_are_kept_parsed_and_their_problems_reported_once() {
        let mut c = Cache::default();
        let mut bad = svc("a", "bad", "1");
        if let Some(spec) = bad.spec.as_mut() {
            spec.cluster_ip = Some("not-an-ip".into());
            spec.cluster_ips = None;
        }
        c.update(Update::Service(Event::Apply(bad)));
        c.update(Update::Service(Event::Apply(svc("a", "web", "1"))));
        assert_eq!(c.errors.len(), 1, "{:?}", c.errors);
        assert!(c.errors[0].to_string().contains("a/bad"), "{}", c.errors[0]);
        assert!(c.services[&k("a", "bad")].parsed.is_none());
        assert!(c.services[&k("a", "web")].parsed.is_some());
        // A relist that finds the same versions parses nothing again.
        c.errors.clear();
        c.update(Update::Service(Event::Init));
        let mut bad = svc("a", "bad", "1");
        if let Some(spec) = bad.spec.as_mut() {
            spec.cluster_ip = Some("not-an-ip".into());
        }
        c.update(Update::Service(Event::InitApply(bad)));
        c.update(Update::Service(Event::InitDone));
        assert!(c.errors.is_empty());
        assert!(c.services.contains_key(&k("a", "bad")));
        assert!(
            !c.services.contains_key(&k("a", "web")),
            "web was not listed again"
        );
    }

    #[test]
    fn selectors_follow_kube_proxy() {
        assert_eq!(
            service_selector(None),
            "!service.kubernetes.io/service-proxy-name"
        );
        assert_eq!(slice_selector(None), "!service.kubernetes.io/headless");
        assert_eq!(
            service_selector(Some("svc")),
            "service.kubernetes.io/service-proxy-name=svc"
        );
        assert_eq!(
            slice_selector(Some("svc")),
            "service.kubernetes.io/service-proxy-name=svc,!service.kubernetes.io/headless"
        );
    }

    /// kube-proxy's change counters: every Service event and every EndpointSlice change
    /// counts; a relist counts what it changed; pending Services are distinct, pending
    /// EndpointSlice changes are changes, and a sync takes both to zero.
    #[test]
    fn changes_are_counted_as_kube_proxy_counts_them() {
        struct Holder;
        impl translate::Holders for Holder {
            fn holder(&self, _: &crate::model::Frontend) -> Option<&str> {
                None
            }
        }
        let mut c = Cache::default();
        c.update(Update::Service(Event::Init));
        c.update(Update::Service(Event::InitApply(svc("a", "web", "1"))));
        c.update(Update::Service(Event::InitApply(svc("a", "api", "1"))));
        c.update(Update::Service(Event::InitDone));
        c.update(Update::Slice(Event::Init));
        c.update(Update::Slice(Event::InitApply(slice(
            "a", "web-1", "web", "1",
        ))));
        c.update(Update::Slice(Event::InitDone));
        let got = c.take_changes();
        assert_eq!(
            got,
            crate::source::Changes {
                services: 2,
                endpoints: 1,
                services_pending: 2,
                endpoints_pending: 1,
            }
        );
        let _ = c.take(&Holder);
        c.update(Update::Service(Event::Apply(svc("a", "web", "2"))));
        c.update(Update::Service(Event::Apply(svc("a", "web", "3"))));
        c.update(Update::Slice(Event::Apply(slice("a", "web-1", "web", "2"))));
        c.update(Update::Slice(Event::Delete(slice(
            "a", "web-1", "web", "2",
        ))));
        let got = c.take_changes();
        assert_eq!(
            (
                got.services,
                got.endpoints,
                got.services_pending,
                got.endpoints_pending
            ),
            (2, 2, 1, 2)
        );
        // Taken: the totals start again, what is pending stays until the sync.
        assert_eq!(c.take_changes().services_pending, 1);
        assert_eq!(c.take_changes().services, 0);
        let _ = c.take(&Holder);
        assert_eq!(c.take_changes(), crate::source::Changes::default());
        // A relist that finds nothing new counts nothing.
        c.update(Update::Service(Event::Init));
        c.update(Update::Service(Event::InitApply(svc("a", "web", "3"))));
        c.update(Update::Service(Event::InitApply(svc("a", "api", "1"))));
        c.update(Update::Service(Event::InitDone));
        assert_eq!(c.take_changes(), crate::source::Changes::default());
    }

    #[test]
    fn nothing_is_ready_until_both_lists_complete() {
        let mut c = Cache::default();
        c.update(Update::Service(Event::Init));
        c.update(Update::Service(Event::InitApply(svc("a", "web", "1"))));
        c.update(Update::Service(Event::InitDone));
        assert!(!c.ready());
        c.update(Update::Slice(Event::Init));
        c.update(Update::Slice(Event::InitDone));
        assert!(c.ready());
        assert_eq!(c.dirty, BTreeSet::from([k("a", "web")]));
    }

    /// The autoscaler's taint, or a deletionTimestamp, or a deleted Node: not eligible; told
    /// once per change.
    #[test]
    fn a_node_being_deleted_is_not_eligible() {
        let node = |spec: serde_json::Value, deleting: bool| -> Node {
            let mut n = serde_json::json!({"metadata": {"name": "n1"}, "spec": spec});
            if deleting {
                n["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z".into();
            }
            serde_json::from_value(n).unwrap()
        };
        let mut c = Cache::new(NodeContext::default(), Duration::ZERO);
        c.update(Update::Node(Box::new(Event::Apply(node(
            serde_json::json!({}),
            false,
        )))));
        assert_eq!(c.take_node_eligible(), None, "eligible from the start");
        let taint = serde_json::json!({"taints": [
            {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}
        ]});
        c.update(Update::Node(Box::new(Event::Apply(node(
            taint.clone(),
            false,
        )))));
        assert_eq!(c.take_node_eligible(), Some(false));
        c.update(Update::Node(Box::new(Event::Apply(node(taint, false)))));
        assert_eq!(c.take_node_eligible(), None, "told once");
        c.update(Update::Node(Box::new(Event::Apply(node(
            serde_json::json!({}),
            false,
        )))));
        assert_eq!(c.take_node_eligible(), Some(true));
        c.update(Update::Node(Box::new(Event::Apply(node(
            serde_json::json!({}),
            true,
        )))));
        assert_eq!(c.take_node_eligible(), Some(false));
        c.update(Update::Node(Box::new(Event::Apply(node(
            serde_json::json!({}),
            false,
        )))));
        let other = serde_json::json!({"taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]});
        c.update(Update::Node(Box::new(Event::Apply(node(other, false)))));
        assert_eq!(
            c.take_node_eligible(),
            Some(true),
            "another taint is no deletion"
        );
    }

    #[test]
    fn empty_lists_still_make_the_first_sync_due() {
        let mut c = Cache {
            all_dirty: true,
            ..Default::default()
        };
        c.update(Update::Service(Event::Init));
        c.update(Update::Service(Event::InitDone));
        assert!(c.first_change.is_none(), "not before the slices are listed");
        c.update(Update::Slice(Event::Init));
        c.update(Update::Slice(Event::InitDone));
        assert!(c.ready());
        assert!(c.first_change.is_some(), "nothing would ever sync");
    }

    #[test]
    fn a_relist_marks_only_what_changed() {
        let mut c = Cache::default();
        for (ev, rv) in [("web", "1"), ("db", "1")] {
            c.update(Update::Service(Event::Apply(svc("a", ev, rv))));
        }
        c.update(Update::Slice(Event::Apply(slice("a", "web-1", "web", "1"))));
        c.update(Update::Slice(Event::Apply(slice("a", "db-1", "db", "1"))));
        c.dirty.clear();

        // Relist after a 410: web unchanged, db's slice changed, a slice of web vanished.
        c.update(Update::Service(Event::Init));
        c.update(Update::Service(Event::InitApply(svc("a", "web", "1"))));
        c.update(Update::Service(Event::InitApply(svc("a", "db", "1"))));
        c.update(Update::Service(Event::InitDone));
        assert!(c.dirty.is_empty());
        c.update(Update::Slice(Event::Init));
        c.update(Update::Slice(Event::InitApply(slice(
            "a", "db-1", "db", "2",
        ))));
        c.update(Update::Slice(Event::InitDone));
        assert_eq!(c.dirty, BTreeSet::from([k("a", "db"), k("a", "web")]));
        assert_eq!(c.slices_of(&k("a", "web")).count(), 0);
        let (services, slices) = c.objects_for(&BTreeSet::from([k("a", "db")]));
        assert_eq!(services.len(), 1);
        assert_eq!(slices.len(), 1);
    }

    #[test]
    fn versions_are_equal_only_when_they_are_the_same_text() {
        assert!(same_version(&Some(Version::new("42")), &Some("42".into())));
        assert!(!same_version(&Some(Version::new("7")), &Some("007".into())));
        assert!(same_version(
            &Some(Version::new("007")),
            &Some("007".into())
        ));
        assert!(same_version(&Some(Version::new("a1")), &Some("a1".into())));
        assert!(!same_version(&Some(Version::new("1")), &Some("2".into())));
        assert!(!same_version(&None, &Some("1".into())));
        assert!(!same_version(&Some(Version::new("1")), &None));
        assert_eq!(
            Version::new("12345678901234"),
            Version::Number(12345678901234)
        );
    }

    #[test]
    fn changes_from_before_the_agent_started_have_no_latency() {
        let since: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut c = Cache {
            watching_since: Some(since),
            ..Default::default()
        };
        let stamped = |name: &str, t: &str| {
            let mut s = slice("a", name, "web", "1");
            s.metadata.annotations = Some([(TRIGGER_TIME_ANNOTATION.to_string(), t.into())].into());
            s
        };
        c.update(Update::Slice(Event::Apply(stamped(
            "old",
            "2025-06-01T00:00:00Z",
        ))));
        c.update(Update::Slice(Event::Apply(stamped(
            "new",
            "2026-02-01T00:00:00Z",
        ))));
        let web = BTreeSet::from([k("a", "web")]);
        let times: Vec<Timestamp> = c.trigger_times(&web).map(|(_, t)| t).collect();
        assert_eq!(
            times,
            vec!["2026-02-01T00:00:00Z".parse::<Timestamp>().unwrap()]
        );
    }

    #[test]
    fn a_slice_that_moves_to_another_service_marks_both() {
        let mut c = Cache::default();
        c.update(Update::Slice(Event::Apply(slice("a", "s1", "web", "1"))));
        c.dirty.clear();
        c.update(Update::Slice(Event::Apply(slice("a", "s1", "api", "2"))));
        assert_eq!(c.dirty, BTreeSet::from([k("a", "api"), k("a", "web")]));
    }
}
