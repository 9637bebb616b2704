//! The stale-UDP task: a thread of its own ([`StaleWorker`]) that ends the UDP flows and
//! closes the connected UDP sockets whose backend no longer serves their frontend (stale.rs
//! says which and how). It is told what serves each UDP frontend ([`ServingChange`]) and
//! walks when something kept before may be stale now, and once at the first change of a run.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::info;

use crate::datapath::Datapath;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::model::Frontend;
use crate::tasks::stale::{Keep, StaleWorker, UdpServing};

/// What serves UDP frontends now, as a sync left them.
#[derive(Debug)]
pub enum ServingChange {
    /// Every programmed UDP frontend: its id and what it keeps. Those not listed are gone.
    All(Vec<(Frontend, u32, Keep)>),
    /// The UDP frontends a sync covered: their id and what they keep, None for one no
    /// longer programmed. The others stay as they were.
    Some(Vec<(Frontend, Option<(u32, Keep)>)>),
}

/// The handle of the stale-UDP thread; dropping it stops the thread once its walk is over.
pub struct StaleUdp {
    /// Shared with the thread, locked per question, so that a change during a walk is seen
    /// by the rest of that walk and a change never waits for a walk.
    serving: Arc<Mutex<UdpServing>>,
    worker: StaleWorker<()>,
    /// The thread has been asked to look once in this run: the flows and sockets of an
    /// earlier run (or of a crash between a sync and its cleanup) are judged too.
    looked: bool,
}

impl StaleUdp {
    /// Starts the thread, with its own handles on the maps that hold the flows (SVC_CT) and
    /// say which frontend each socket was translated for (SVC_SOCK_REV); the sockets are
    /// looked for in the network namespaces of the processes of `cgroup`.
    pub fn start(dp: &Datapath, cgroup: &Path, metrics: Arc<Metrics>) -> Result<StaleUdp> {
        let serving = Arc::new(Mutex::new(UdpServing::default()));
        let worker = spawn(dp, cgroup, metrics, serving.clone())?;
        Ok(StaleUdp {
            serving,
            worker,
            looked: false,
        })
    }

    /// Takes `change` in; the thread walks when something it kept may be stale now, or
    /// when it has not looked yet in this run. Returns at once.
    pub fn change(&mut self, change: ServingChange) {
        let lost = {
            let mut serving = self.serving.lock().unwrap_or_else(PoisonError::into_inner);
            match change {
                ServingChange::All(all) => serving.replace(all),
                ServingChange::Some(some) => some
                    .into_iter()
                    .fold(false, |lost, (fe, now)| serving.set(fe, now) || lost),
            }
        };
        if lost || !self.looked {
            self.looked = true;
            self.worker.submit(vec![()]);
        }
    }
}

/// The thread, judging flows and sockets by `serving`.
fn spawn(
    dp: &Datapath,
    cgroup: &Path,
    metrics: Arc<Metrics>,
    serving: Arc<Mutex<UdpServing>>,
) -> Result<StaleWorker<()>> {
    use aya::maps::{HashMap as BpfHashMap, MapData};
    use svc_common::{map_names, SockRevKey, SockRevValue};
    let map_err = |name, e| crate::store::map_err(name, e);
    let sock_rev: BpfHashMap<MapData, SockRevKey, SockRevValue> =
        BpfHashMap::try_from(dp.reopen(map_names::SOCK_REV)?)
            .map_err(|e| map_err(map_names::SOCK_REV, e))?;
    // The packet datapath's flows; absent from an object without it.
    // Both tables: a UDP flow is unassured until its client speaks after a reply.
    let mut cts: Vec<BpfHashMap<MapData, svc_common::CtKey, svc_common::CtValue>> =
        [map_names::CT, map_names::CT_NEW]
            .into_iter()
            .filter_map(|name| dp.reopen(name).ok())
            .filter_map(|m| BpfHashMap::try_from(m).ok())
            .collect();
    let cgroup = cgroup.to_path_buf();
    let stale = move |id: u32, backend: std::net::SocketAddr| {
        serving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stale(id, backend)
    };
    let run = move |_: Vec<()>| {
        fail::fail_point!(crate::fault::STALE_UDP_PAUSE);
        let doomed = |cookie: u64, peer: std::net::SocketAddr| {
            let key = SockRevKey {
                cookie,
                addr: crate::reconcile::addr16(peer.ip()),
                port_be: peer.port().to_be(),
                _pad0: [0; 6],
            };
            // Not translated by svc (a direct connection), or its entry is gone: left alone.
            let Ok(rev) = sock_rev.get(&key, 0) else {
                return false;
            };
            stale(rev.id, peer)
        };
        for ct in &mut cts {
            match crate::tasks::stale::forget_udp_flows(ct, &stale) {
                Ok(0) => {}
                Ok(n) => info!(
                    flows = n,
                    "forgot UDP flows of backends that no longer serve"
                ),
                Err(e) => {
                    metrics.report("", &e);
                }
            }
        }
        match crate::tasks::stale::destroy_udp_sockets(&cgroup, &doomed) {
            Ok(r) => {
                for e in &r.errors {
                    metrics.report("closing stale UDP sockets", e);
                }
                if r.destroyed() > 0 {
                    info!(
                        sockets = r.destroyed(),
                        namespaces = r.namespaces,
                        "closed connected UDP sockets of backends that no longer serve"
                    );
                }
            }
            Err(e) => {
                metrics.report("closing stale UDP sockets", &e);
            }
        }
    };
    StaleWorker::spawn(run).map_err(|e| Error::Other(format!("starting the stale-UDP thread: {e}")))
}
