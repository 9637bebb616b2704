//! The agent's side effects, each a task of its own: the stale-UDP thread, the
//! connection-tracking sweep, the health check node port servers. The agent never holds or
//! calls them: it says what it did as [`Effect`]s (`Agent::take_effects`), the controller
//! hands them to [`Tasks`], and the tasks tell of their work and errors through the metrics
//! (`Metrics::report`, `Metrics::swept`), never back to the agent.

pub mod health;
pub mod stale;
pub mod stale_udp;
pub mod sweep;

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::datapath::Datapath;
use crate::metrics::Metrics;
use crate::model::HealthCheck;
use health::{Bind, HealthServers};
use stale_udp::{ServingChange, StaleUdp};
use sweep::Sweeper;

/// What the agent did that a task acts on.
#[derive(Debug)]
pub enum Effect {
    /// What serves UDP frontends after a sync (the stale-UDP task).
    UdpServing(ServingChange),
    /// The health check node ports the Services want, after every sync.
    HealthChecks(BTreeMap<String, HealthCheck>),
    /// Where the health check ports listen, as the node's addresses say now; from the next
    /// sync on, or at once when a sync has said which ports are wanted.
    HealthBinds(BTreeSet<Bind>),
    /// Upkeep while attached: a health check port that could not be bound (in use) is tried
    /// again.
    HealthRetry,
    /// This agent's programs are attached: connection tracking is swept with `prog` every
    /// `every` from now on.
    Sweep { prog: OwnedFd, every: Duration },
}

/// The running tasks, owned by the controller; dropping them stops the threads (each once
/// its current work is done) and the servers.
pub struct Tasks {
    /// None when its maps could not be opened a second time (logged at start).
    stale: Option<StaleUdp>,
    /// None until the programs are attached, when off, or when it could not start (logged).
    sweeper: Option<Sweeper>,
    health: HealthServers,
    /// The ports the last sync wanted; None before the first sync.
    health_wanted: Option<BTreeMap<String, HealthCheck>>,
    metrics: Arc<Metrics>,
}

impl Tasks {
    /// Starts the stale-UDP thread with its own handles on `dp`'s maps; the health check
    /// servers start with the first sync, the sweep once the programs are attached.
    pub fn start(dp: &Datapath, cgroup: &Path, metrics: Arc<Metrics>) -> Tasks {
        let stale = match StaleUdp::start(dp, cgroup, metrics.clone()) {
            Ok(s) => Some(s),
            Err(e) => {
                metrics.report(
                    "stale UDP flows will not be ended, nor stale UDP sockets closed",
                    &e,
                );
                None
            }
        };
        Tasks::new(stale, metrics)
    }

    /// The tasks with this stale-UDP task (None: none); the others start on their effects.
    fn new(stale: Option<StaleUdp>, metrics: Arc<Metrics>) -> Tasks {
        Tasks {
            stale,
            sweeper: None,
            health: HealthServers::new(metrics.clone(), BTreeSet::new()),
            health_wanted: None,
            metrics,
        }
    }

    /// Hands each effect to its task, in order; returns at once (the walks and sweeps run on
    /// their threads; health check ports are bound here, so that a sync's ports listen
    /// before the sync is announced).
    pub fn handle(&mut self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::UdpServing(change) => {
                    if let Some(s) = &mut self.stale {
                        s.change(change);
                    }
                }
                Effect::HealthChecks(wanted) => {
                    self.health_wanted = Some(wanted);
                    self.sync_health();
                }
                Effect::HealthBinds(binds) => {
                    self.health.set_binds(binds);
                    self.sync_health();
                }
                Effect::HealthRetry => self.sync_health(),
                Effect::Sweep { prog, every } => {
                    if self.sweeper.is_some() {
                        continue;
                    }
                    match Sweeper::spawn(prog, every, self.metrics.clone()) {
                        Ok(s) => self.sweeper = Some(s),
                        Err(e) => self
                            .metrics
                            .report("dead flows stay in connection tracking until evicted", &e),
                    }
                }
            }
        }
    }

    /// Starts and stops health check node port servers as the last sync said; nothing
    /// before the first sync.
    fn sync_health(&mut self) {
        let Some(wanted) = &self.health_wanted else {
            return;
        };
        for e in self.health.sync(wanted) {
            self.metrics.report("", &e);
        }
    }

    /// Where the health check server of Service `owner` listens (tests, tools).
    pub fn health_check_addrs(&self, owner: &str) -> Vec<std::net::SocketAddr> {
        self.health.addrs(owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, SocketAddr};

    fn binds(ip: [u8; 4]) -> BTreeSet<Bind> {
        BTreeSet::from([Bind::Addr {
            ip: IpAddr::from(ip),
            scope: 0,
        }])
    }

    /// Through real sockets on loopback: no health check port listens before a sync said
    /// which are wanted, whatever the node's addresses say; once one has, the ports follow
    /// the addresses at once, and a port that was in use is bound at the next retry.
    #[tokio::test]
    async fn health_check_ports_follow_the_effects_in_order() {
        let metrics = Metrics::new(
            std::path::PathBuf::from("/nonexistent"),
            Duration::from_secs(60),
        );
        let mut tasks = Tasks::new(None, metrics);
        let held = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let at = |ip: [u8; 4]| vec![SocketAddr::from((ip, port))];
        let wanted = BTreeMap::from([(
            "ns/web".to_string(),
            HealthCheck {
                port,
                local_endpoints: [Some(1), None],
            },
        )]);

        tasks.handle(vec![Effect::HealthBinds(binds([127, 0, 0, 1]))]);
        assert!(tasks.health_check_addrs("ns/web").is_empty());
        tasks.handle(vec![Effect::HealthChecks(wanted)]);
        assert_eq!(tasks.health_check_addrs("ns/web"), at([127, 0, 0, 1]));
        // Moved to an address where the port is in use: nothing listens until it is free
        // and the upkeep retries.
        tasks.handle(vec![Effect::HealthBinds(binds([127, 0, 0, 2]))]);
        assert!(tasks.health_check_addrs("ns/web").is_empty());
        drop(held);
        tasks.handle(vec![Effect::HealthRetry]);
        assert_eq!(tasks.health_check_addrs("ns/web"), at([127, 0, 0, 2]));
    }
}
