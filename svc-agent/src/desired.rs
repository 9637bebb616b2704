//! The desired state kept up to date one Service at a time, so an event about one Service
//! costs work for that Service only.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use crate::error::Error;
use crate::model::{DesiredState, Frontend, Kind, Protocol, Scope};

#[derive(Debug, Default)]
pub struct Desired {
    pub state: DesiredState,
    /// Which frontends each Service ("namespace/name") contributes: built on the first
    /// per-Service change, so a source that only ever replaces everything (manifest files)
    /// never pays for it.
    by_owner: Option<HashMap<String, Vec<Frontend>>>,
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
        Desired {
            state,
            by_owner: None,
        }
    }

    fn index(&mut self) -> &mut HashMap<String, Vec<Frontend>> {
        let state = &self.state;
        self.by_owner.get_or_insert_with(|| {
            let mut by_owner: HashMap<String, Vec<Frontend>> = HashMap::new();
            for (fe, d) in &state.frontends {
                by_owner.entry(d.owner.clone()).or_default().push(*fe);
            }
            by_owner
        })
    }

    /// The frontends Service `owner` ("namespace/name") contributes.
    pub fn frontends_of(&self, owner: &str) -> Vec<Frontend> {
        match &self.by_owner {
            Some(index) => index.get(owner).cloned().unwrap_or_default(),
            None => self
                .state
                .frontends
                .values()
                .filter(|d| d.owner == owner)
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
            for fe in self.index().remove(owner).unwrap_or_default() {
                self.state.frontends.remove(&fe);
                touched.insert(fe);
            }
            self.state.health_checks.remove(owner);
        }
        self.state.health_checks.extend(translated.health_checks);
        for (fe, d) in translated.frontends {
            if let Some(holder) = self.state.frontends.get(&fe) {
                errors.push(Error::Invalid {
                    object: format!("Service {}", d.owner),
                    message: format!(
                        "frontend {fe} is already served by Service {}; skipped",
                        holder.owner
                    ),
                });
                continue;
            }
            self.index().entry(d.owner.clone()).or_default().push(fe);
            self.state.frontends.insert(fe, d);
            touched.insert(fe);
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
            DesiredFrontend::cluster_ip(frontend, owner, owner, vec![]),
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
        assert_eq!(desired.state.frontends[&a2.0].owner, "ns/a");
    }
}
