//! The connection-tracking sweep's thread: runs svc-ebpf's `tc_ct_sweep` (gc.rs there says
//! why) every `--conntrack-sweep-interval`, off the sync loop, until the agent stops.

use std::{
    os::fd::{AsFd, OwnedFd},
    sync::{Arc, Condvar, Mutex, PoisonError},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tracing::{debug, info, warn};

use crate::{
    error::{Error, Result},
    metrics::Metrics,
};

/// What BPF_PROG_TEST_RUN of a classifier wants at least (an Ethernet header); the sweep
/// reads none of it.
const INPUT: [u8; 64] = [0; 64];

/// The running sweep; dropping it stops the thread.
pub struct Sweeper {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Sweeper {
    /// Starts sweeping with the loaded program `prog`, one interval `every` between the end
    /// of a sweep and the start of the next.
    pub fn spawn(prog: OwnedFd, every: Duration, metrics: Arc<Metrics>) -> Result<Sweeper> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let signal = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ct-sweep".into())
            .spawn(move || {
                let (lock, cv) = &*signal;
                let mut stopped = lock.lock().unwrap_or_else(PoisonError::into_inner);
                let mut failing = false;
                loop {
                    let deadline = Instant::now() + every;
                    while !*stopped {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        stopped = cv
                            .wait_timeout(stopped, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    if *stopped {
                        return;
                    }
                    match crate::sys::prog_test_run(prog.as_fd(), &INPUT) {
                        Ok((removed, ran_ns)) => {
                            let took = Duration::from_nanos(ran_ns.into());
                            metrics.swept(removed, took);
                            debug!(removed, ?took, "swept connection tracking");
                            if failing {
                                info!("connection tracking is swept again");
                                failing = false;
                            }
                        }
                        Err(e) => {
                            metrics.error_kind("conntrack_sweep");
                            // Once, not every interval: the next sweep most likely fails alike.
                            if !failing {
                                warn!("sweeping connection tracking: {e}; retried every interval");
                                failing = true;
                            }
                        }
                    }
                }
            })
            .map_err(|e| Error::Other(format!("starting the connection-tracking sweep: {e}")))?;
        Ok(Sweeper {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
