//! The desired state kept up to date one Service at a time, so an event about one Service
//! costs work for that Service only.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;

use tracing::info;

use crate::error::Error;
use crate::model::{DesiredState, Frontend, Kind, Protocol, Scope};
use crate::reconcile::HashMap;

#[derive(Debug, Default)]
pub struct Desired {
    pub state: DesiredState,
    /// The frontends of each Service ("namespace/name"), by a hash of its name: built on the
    /// first per-Service change, so a source that only ever replaces everything (manifest
    /// files) never pays for it. Keyed by hash, not name, and one frontend kept inline: a copy
    /// of every name and a vector each cost 17 MiB at 100,000 Services. Owners whose hashes
    /// collide share an entry; `state` says whose each frontend is.
    by_owner: Option<OwnerIndex>,
}

#[derive(Debug, Default)]
struct OwnerIndex {
    hasher: RandomState,
    frontends: HashMap<u64, Frontends>,
}

/// Most Services have one port and one family: one frontend, and no vector.
#[derive(Debug)]
enum Frontends {
    One(Frontend),
    Many(Vec<Frontend>),
}

impl Frontends {
    fn as_slice(&self) -> &[Frontend] {
        match self {
            Frontends::One(fe) => std::slice::from_ref(fe),
            Frontends::Many(v) => v,
        }
    }

    fn push(&mut self, fe: Frontend) {
        match self {
            Frontends::One(first) => *self = Frontends::Many(vec![*first, fe]),
            Frontends::Many(v) => v.push(fe),
        }
    }
}

impl OwnerIndex {
    fn add(&mut self, owner: &str, fe: Frontend) {
        self.add_hashed(self.hasher.hash_one(owner), fe);
    }

    /// The frontends filed under `owner`'s hash (a colliding owner's included).
    fn get(&self, owner: &str) -> &[Frontend] {
        let h = self.hasher.hash_one(owner);
        self.frontends.get(&h).map_or(&[], Frontends::as_slice)
    }

    /// Takes `owner`'s frontends out; a colliding owner's stay.
    fn remove(&mut self, owner: &str, state: &DesiredState) -> Vec<Frontend> {
        let h = self.hasher.hash_one(owner);
        let Some(filed) = self.frontends.remove(&h) else {
            return Vec::new();
        };
        let (mine, others): (Vec<Frontend>, Vec<Frontend>) = filed
            .as_slice()
            .iter()
            .partition(|fe| state.frontends.get(fe).is_none_or(|d| d.owner() == owner));
        for fe in others {
            self.add_hashed(h, fe);
        }
        mine
    }

    fn add_hashed(&mut self, h: u64, fe: Frontend) {
        match self.frontends.get_mut(&h) {
            Some(f) => f.push(fe),
            None => {
                self.frontends.insert(h, Frontends::One(fe));
            }
        }
    }
}

fn ip_range(ip: IpAddr) -> std::ops::RangeInclusive<Frontend> {
    Frontend {
        ip,
        port: 0,
        protocol: Protocol::Tcp,
        scope: Scope::Cluster,
    }..=Frontend {
        ip,
        port: u16::MAX,
        protocol: Protocol::Udp,
        scope: Scope::External,
    }
}

impl Desired {
    pub fn from_full(state: DesiredState) -> Desired {
        // Its frontends' tree comes packed (`translate::assemble_with` builds it in one go).
        Desired {
            state,
            by_owner: None,
        }
    }

    /// Keeps who holds each frontend (the owners of `state.frontends`) and drops the rest,
    /// before a full translation that asks who holds what builds the next desired state:
    /// one copy of the backends in memory, not two.
    pub fn keep_holders_only(&mut self) {
        let frontends = std::mem::take(&mut self.state.frontends);
        *self = Desired::default();
        self.state.frontends = frontends;
        for d in self.state.frontends.values_mut() {
            d.backends = Vec::new();
            d.source_ranges = None;
        }
    }

    /// Builds the index by Service now, for a source whose later syncs come Service by
    /// Service: at 100,000 Services it takes tens of milliseconds, which the first change
    /// after a cold start would otherwise wait for.
    pub fn index_by_service(&mut self) {
        self.index();
    }

    fn index(&mut self) -> &mut OwnerIndex {
        let state = &self.state;
        self.by_owner.get_or_insert_with(|| {
            let mut index = OwnerIndex::default();
            for (fe, d) in &state.frontends {
                index.add(d.owner(), *fe);
            }
            index
        })
    }

    /// The frontends Service `owner` ("namespace/name") contributes.
    pub fn frontends_of(&self, owner: &str) -> Vec<Frontend> {
        match &self.by_owner {
            Some(index) => index
                .get(owner)
                .iter()
                .filter(|fe| {
                    self.state
                        .frontends
                        .get(fe)
                        .is_some_and(|d| d.owner() == owner)
                })
                .copied()
                .collect(),
            None => self
                .state
                .frontends
                .values()
                .filter(|d| d.owner() == owner)
                .map(|d| d.frontend)
                .collect(),
        }
    }

    /// Replaces everything `owners` contributed with `translated` (a translation of exactly
    /// those Services). Returns the frontends whose desired state may have changed, and an
    /// error for each frontend another Service already holds (the holder keeps it).
    pub fn replace(
        &mut self,
        owners: &BTreeSet<String>,
        translated: DesiredState,
    ) -> (BTreeSet<Frontend>, Vec<Error>) {
        let mut touched = BTreeSet::new();
        let mut errors = Vec::new();
        for owner in owners {
            self.index();
            let index = self.by_owner.as_mut().expect("built above");
            for fe in index.remove(owner, &self.state) {
                self.state.frontends.remove(&fe);
                touched.insert(fe);
            }
            self.state.health_checks.remove(owner);
            self.state.unserved.remove(owner);
            self.state.no_local_endpoints.remove(owner);
        }
        self.state.contested.retain(|_, claims| {
            claims.retain(|d| !owners.contains(d.owner()));
            !claims.is_empty()
        });
        for (fe, claims) in translated.contested {
            self.state.contested.entry(fe).or_default().extend(claims);
        }
        self.state.health_checks.extend(translated.health_checks);
        self.state.unserved.extend(translated.unserved);
        (self.state.no_local_endpoints).extend(translated.no_local_endpoints);
        for (fe, d) in translated.frontends {
            if let Some(holder) = self.state.frontends.get(&fe) {
                errors.push(Error::Invalid {
                    object: format!("Service {}", d.owner()),
                    message: format!(
                        "frontend {fe} is already served by Service {}; skipped",
                        holder.owner()
                    ),
                });
                self.state.contested.entry(fe).or_default().push(d);
                continue;
            }
            self.index().add(d.owner(), fe);
            self.state.frontends.insert(fe, d);
            touched.insert(fe);
        }
        // A frontend its holder gave up goes to the next Service that claims it: that Service
        // did not change, so nothing else would translate it again.
        let freed: Vec<Frontend> = touched
            .iter()
            .filter(|fe| {
                !self.state.frontends.contains_key(fe) && self.state.contested.contains_key(fe)
            })
            .copied()
            .collect();
        for fe in freed {
            let Some(mut claims) = self.state.contested.remove(&fe) else {
                continue;
            };
            // A new conflict, as a full translation resolves it.
            let ranked = claims.iter().map(|d| (d.owner(), d.created));
            let Some(first) = crate::translate::rightful(ranked, None) else {
                continue;
            };
            let d = claims.remove(first);
            if !claims.is_empty() {
                self.state.contested.insert(fe, claims);
            }
            info!(frontend = %fe, service = %d.owner(), "frontend given up by its holder; served by the Service that also claims it");
            self.index().add(d.owner(), fe);
            self.state.frontends.insert(fe, d);
        }
        let ips: BTreeSet<IpAddr> = touched.iter().map(|fe| fe.ip).collect();
        for ip in ips {
            // Only ClusterIPs get a marker, not ExternalIPs or LoadBalancer IPs.
            let cluster_ip = self
                .state
                .frontends
                .range(ip_range(ip))
                .any(|(_, d)| d.kind == Kind::ClusterIP);
            if cluster_ip {
                self.state.cluster_ips.insert(ip);
            } else {
                self.state.cluster_ips.remove(&ip);
            }
        }
        (touched, errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DesiredFrontend;

    fn d(owner: &str, ip: &str, port: u16) -> (Frontend, DesiredFrontend) {
        let frontend = Frontend::cluster(ip.parse().unwrap(), port, Protocol::Tcp);
        (
            frontend,
            DesiredFrontend::cluster_ip(frontend, owner, vec![]),
        )
    }

    fn state(items: &[(Frontend, DesiredFrontend)]) -> DesiredState {
        let mut s = DesiredState::default();
        for (fe, df) in items {
            s.frontends.insert(*fe, df.clone());
            s.cluster_ips.insert(fe.ip);
        }
        s
    }

    #[test]
    fn owners_sharing_a_hash_keep_their_own_frontends() {
        let a = d("ns/a", "10.96.0.1", 80);
        let b = d("ns/b", "10.96.0.2", 80);
        let st = state(&[a.clone(), b.clone()]);
        let mut index = OwnerIndex::default();
        // b filed under a's hash, as a collision would.
        let h = index.hasher.hash_one("ns/a");
        index.add_hashed(h, a.0);
        index.add_hashed(h, b.0);
        assert_eq!(index.remove("ns/a", &st), vec![a.0]);
        assert_eq!(index.get("ns/a"), &[b.0]);
        assert_eq!(
            index.remove("ns/b", &st),
            Vec::<Frontend>::new(),
            "b is not under its own hash"
        );
        assert_eq!(
            index.remove("ns/a", &st),
            Vec::<Frontend>::new(),
            "b is not a's"
        );
    }

    /// The index built right after a full sync (`index_by_service`) answers as the one a
    /// first change builds, and follows the changes after it.
    #[test]
    fn an_index_built_ahead_follows_the_changes() {
        let (a, b) = (d("ns/a", "10.96.0.1", 80), d("ns/b", "10.96.0.2", 80));
        let full = state(&[a.clone(), b.clone()]);
        let (mut ahead, mut lazy) = (Desired::from_full(full.clone()), Desired::from_full(full));
        ahead.index_by_service();
        assert!(ahead.by_owner.is_some() && lazy.by_owner.is_none());
        let only_a = BTreeSet::from(["ns/a".to_string()]);
        let moved = d("ns/a", "10.96.0.3", 80);
        for desired in [&mut ahead, &mut lazy] {
            assert_eq!(desired.frontends_of("ns/a"), vec![a.0]);
            let (touched, errors) = desired.replace(&only_a, state(std::slice::from_ref(&moved)));
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(touched, BTreeSet::from([a.0, moved.0]));
            assert_eq!(desired.frontends_of("ns/a"), vec![moved.0]);
            assert_eq!(desired.frontends_of("ns/b"), vec![b.0]);
        }
    }

    /// As the Kubernetes API source syncs: a Service's SCTP ports stay named while it has
    /// them, whatever other Services change, and go with the Service or the ports.
    #[test]
    fn unserved_ports_follow_their_service_through_partial_syncs() {
        let ports = |owner: &str| -> Box<[String]> { Box::new([format!("{owner} 9/SCTP")]) };
        let mut full = DesiredState::default();
        full.unserved.insert("ns/a".into(), ports("ns/a"));
        full.unserved.insert("ns/b".into(), ports("ns/b"));
        let mut desired = Desired::from_full(full);
        let named = |d: &Desired| d.state.unserved.keys().cloned().collect::<Vec<_>>();
        let only_a = BTreeSet::from(["ns/a".to_string()]);
        desired.replace(
            &BTreeSet::from(["ns/c".to_string()]),
            DesiredState::default(),
        );
        assert_eq!(named(&desired), ["ns/a", "ns/b"]);
        desired.replace(&only_a, DesiredState::default());
        assert_eq!(named(&desired), ["ns/b"]);
        let mut again = DesiredState::default();
        again.unserved.insert("ns/a".into(), ports("ns/a"));
        desired.replace(&only_a, again);
        assert_eq!(named(&desired), ["ns/a", "ns/b"]);
    }

    /// kube-proxy's no-local-endpoints gauge is the sum over Services: a partial sync
    /// replaces the counts of the Services it translated and keeps the others'.
    #[test]
    fn no_local_endpoints_follow_their_service_through_partial_syncs() {
        use crate::model::NoLocalEndpoints;
        let n = |internal, external| NoLocalEndpoints { internal, external };
        let mut full = DesiredState::default();
        full.no_local_endpoints.insert("ns/a".into(), n(1, 0));
        full.no_local_endpoints.insert("ns/b".into(), n(2, 1));
        let mut desired = Desired::from_full(full);
        let only_a = BTreeSet::from(["ns/a".to_string()]);
        desired.replace(&only_a, DesiredState::default());
        assert_eq!(
            desired.state.no_local_endpoints,
            std::collections::BTreeMap::from([("ns/b".to_string(), n(2, 1))])
        );
        let mut again = DesiredState::default();
        again.no_local_endpoints.insert("ns/a".into(), n(0, 3));
        desired.replace(&only_a, again);
        assert_eq!(
            desired.state.no_local_endpoints,
            std::collections::BTreeMap::from([
                ("ns/a".to_string(), n(0, 3)),
                ("ns/b".to_string(), n(2, 1))
            ])
        );
    }

    #[test]
    fn replacing_one_service_leaves_the_others() {
        let a = d("ns/a", "10.96.0.1", 80);
        let b = d("ns/b", "10.96.0.2", 80);
        let mut desired = Desired::from_full(state(&[a.clone(), b.clone()]));

        let a2 = d("ns/a", "10.96.0.1", 81);
        let owners = BTreeSet::from(["ns/a".to_string()]);
        let (touched, errors) = desired.replace(&owners, state(std::slice::from_ref(&a2)));
        assert!(errors.is_empty());
        assert_eq!(touched, BTreeSet::from([a.0, a2.0]));
        assert!(desired.state.frontends.contains_key(&b.0));
        assert!(desired.state.frontends.contains_key(&a2.0));
        assert!(!desired.state.frontends.contains_key(&a.0));

        // Deleting ns/b removes its ClusterIP; a conflicting newcomer does not take a's port.
        let owners = BTreeSet::from(["ns/b".to_string(), "ns/c".to_string()]);
        let c = d("ns/c", "10.96.0.1", 81);
        let (_, errors) = desired.replace(&owners, state(&[c]));
        assert_eq!(errors.len(), 1);
        assert!(errors[0].to_string().contains("ns/a"), "{}", errors[0]);
        assert_eq!(
            desired.state.cluster_ips,
            BTreeSet::from(["10.96.0.1".parse().unwrap()])
        );
        assert_eq!(desired.state.frontends[&a2.0].owner(), "ns/a");
    }

    /// A Service as the Kubernetes source caches it.
    fn parsed(name: &str, cluster_ip: &str, created: &str) -> crate::translate::ParsedService {
        let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "creationTimestamp": created},
            "spec": {"clusterIP": cluster_ip, "externalIPs": ["203.0.113.10"],
                     "ports": [{"port": 80}]}
        }))
        .unwrap();
        let mut errors = Vec::new();
        crate::translate::parse_service(&svc, &Default::default(), &mut errors).unwrap()
    }

    /// Two Services may list one ExternalIP and port (the API server allows it); one serves
    /// it. Once that one is deleted, the other serves it, as under kube-proxy, even though
    /// the Kubernetes source translates only the Service that changed.
    #[test]
    fn a_frontend_its_holder_gives_up_goes_to_the_service_that_also_claims_it() {
        use crate::translate::assemble;
        let node = Default::default();
        let old = parsed("old", "10.96.0.1", "2020-01-01T00:00:00Z");
        let new = parsed("new", "10.96.0.2", "2024-01-01T00:00:00Z");
        let full = assemble([&old, &new], [], &node);
        let ext = Frontend {
            ip: "203.0.113.10".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
            scope: Scope::External,
        };
        assert_eq!(full.state.frontends[&ext].owner(), "ns/old");
        let mut desired = Desired::from_full(full.state);

        // ns/old is deleted: only it is translated again.
        let owners = BTreeSet::from(["ns/old".to_string()]);
        let (touched, _) = desired.replace(&owners, assemble([], [], &node).state);
        assert!(touched.contains(&ext));
        let holder = desired.state.frontends.get(&ext).map(|d| d.owner());
        assert_eq!(holder, Some("ns/new"), "203.0.113.10:80 served by nobody");
        let local = Frontend {
            scope: Scope::Cluster,
            ..ext
        };
        assert_eq!(desired.state.frontends[&local].owner(), "ns/new");
        assert!(touched.contains(&local));
    }

    /// When the holder of a contested frontend leaves, the claimants left meet as a new
    /// conflict, which goes to the older Service (README), as a full sync (a restart, a
    /// relist) would give it, not to whichever the contested list happens to hold first.
    #[test]
    fn a_frontend_its_holder_gives_up_goes_to_the_older_claimant() {
        use crate::translate::assemble;
        let node = Default::default();
        let holder = parsed("holder", "10.96.0.1", "2020-01-01T00:00:00Z");
        let young = parsed("a-young", "10.96.0.2", "2024-01-01T00:00:00Z");
        let old = parsed("z-old", "10.96.0.3", "2022-01-01T00:00:00Z");
        let ext = Frontend {
            ip: "203.0.113.10".parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
            scope: Scope::External,
        };
        let full = assemble([&holder, &young, &old], [], &node);
        assert_eq!(full.state.frontends[&ext].owner(), "ns/holder");
        let mut desired = Desired::from_full(full.state);

        // ns/holder is deleted: only it is translated again.
        let owners = BTreeSet::from(["ns/holder".to_string()]);
        desired.replace(&owners, assemble([], [], &node).state);
        let full_sync = assemble([&young, &old], [], &node);
        assert_eq!(full_sync.state.frontends[&ext].owner(), "ns/z-old");
        assert_eq!(
            desired.state.frontends[&ext].owner(),
            "ns/z-old",
            "an incremental sync must give the frontend where a full sync would"
        );
    }
}
