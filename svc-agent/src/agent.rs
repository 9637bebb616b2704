//! The agent: keeps the datapath in step with a source of Services and EndpointSlices.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, instrument, warn};

use crate::datapath;
use crate::desired::Desired;
use crate::error::Result;
use crate::metrics::{self, Metrics};
use crate::source::manifest::ManifestSource;
use crate::store::BpfStore;
use crate::sync::{Programmed, Scope, SyncReport};
use crate::translate::{self, NodeContext, Translated};

pub struct Agent {
    store: BpfStore,
    programmed: Programmed,
    desired: Desired,
    cgroup: PathBuf,
    pub node: NodeContext,
    pub metrics: Arc<Metrics>,
}

impl Agent {
    /// Attaches (or adopts) the datapath and mirrors what it already holds.
    pub fn start(
        bpffs: &Path,
        cgroup: &Path,
        node: NodeContext,
        metrics: Arc<Metrics>,
    ) -> Result<Agent> {
        let store = datapath::install(bpffs, cgroup)?;
        let programmed = Programmed::recover(&store.snapshot()?);
        info!(
            frontends = programmed.frontends.len(),
            backends = programmed.backends.len(),
            "adopted pinned state"
        );
        Ok(Agent {
            store,
            programmed,
            desired: Desired::default(),
            cgroup: cgroup.to_path_buf(),
            node,
            metrics,
        })
    }

    fn record_input_errors(&self, errors: &[crate::Error]) {
        for e in errors {
            warn!("skipped: {e}");
            self.metrics.error(e);
        }
    }

    /// Makes the datapath serve exactly `translated`: what is not in it is removed.
    pub fn apply_full(&mut self, translated: Translated) -> SyncReport {
        let started = Instant::now();
        self.record_input_errors(&translated.errors);
        self.desired = Desired::from_full(translated.state);
        let report = self.programmed.apply(&mut self.store, &self.desired.state);
        self.finish(report, started)
    }

    /// Replaces what the Services `owners` ("namespace/name") contribute with `translated`, a
    /// translation of exactly those Services; every other Service is left alone.
    pub fn apply_services(
        &mut self,
        owners: &BTreeSet<String>,
        translated: Translated,
    ) -> SyncReport {
        let started = Instant::now();
        self.record_input_errors(&translated.errors);
        let (scope, conflicts) = self.desired.replace(owners, translated.state);
        self.record_input_errors(&conflicts);
        let report =
            self.programmed
                .apply_scoped(&mut self.store, &self.desired.state, Scope::Only(&scope));
        self.finish(report, started)
    }

    fn finish(&mut self, report: SyncReport, started: Instant) -> SyncReport {
        for e in &report.errors {
            warn!("not programmed: {e}");
            self.metrics.error(e);
        }
        self.close_stale_udp(&report);
        self.metrics.synced(
            started.elapsed(),
            metrics::Programmed {
                frontends: self.programmed.frontends.len(),
                backends: self.programmed.backends.len(),
                cluster_ips: self.programmed.markers.len(),
                maps: self.programmed.map_usage(),
            },
        );
        report
    }

    /// A connected UDP socket keeps its backend forever; once that backend is gone, close the
    /// socket so the application reconnects, and its connect() picks a live backend.
    fn close_stale_udp(&self, report: &SyncReport) {
        if report.udp_backends_deleted.is_empty() {
            return;
        }
        match crate::stale::destroy_udp_sockets(&self.cgroup, &report.udp_backends_deleted) {
            Ok(r) => {
                for e in &r.errors {
                    warn!("closing UDP sockets of removed backends: {e}");
                    self.metrics.error(e);
                }
                if r.destroyed() > 0 {
                    info!(
                        sockets = r.destroyed(),
                        namespaces = r.namespaces,
                        "closed connected UDP sockets of removed backends"
                    );
                }
            }
            Err(e) => {
                warn!("closing UDP sockets of removed backends: {e}");
                self.metrics.error(&e);
            }
        }
    }

    /// Reads the manifests, translates them, and applies the result.
    #[instrument(skip_all, fields(path = %source.path().display()))]
    pub fn sync_manifests(&mut self, source: &mut ManifestSource) -> SyncReport {
        let loaded = source.load();
        self.record_input_errors(&loaded.errors);
        let services: Vec<_> = loaded.services.into_iter().map(|n| n.object).collect();
        let slices: Vec<_> = loaded.slices.into_iter().map(|n| n.object).collect();
        let translated = translate::translate(&services, &slices, &self.node);
        self.apply_full(translated)
    }
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub node: NodeContext,
    /// Where /metrics and /healthz are served.
    pub listen: Vec<std::net::SocketAddr>,
    pub health_timeout: Duration,
}

/// Starts the agent and its metrics server.
pub async fn start(cfg: &RunConfig) -> Result<Agent> {
    let metrics = Metrics::new(cfg.bpffs.clone(), cfg.health_timeout);
    for &addr in &cfg.listen {
        let listener = metrics::bind(addr).await?;
        info!(%addr, "serving /metrics and /healthz");
        tokio::spawn(metrics::serve(listener, metrics.clone()));
    }
    Agent::start(&cfg.bpffs, &cfg.cgroup, cfg.node.clone(), metrics)
}

/// Completes when the agent should stop (SIGTERM or SIGINT).
pub async fn shutdown_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| crate::Error::Other(format!("installing the SIGTERM handler: {e}")))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// Stable lines for scripts and tests, independent of the log format.
pub fn announce(report: &SyncReport, first: bool) {
    if report.changed() {
        eprintln!("svc-agent: synced");
    }
    if first {
        eprintln!("svc-agent: ready");
    }
}

/// Serves manifest files until SIGTERM or SIGINT, re-reading them when they change. The
/// datapath stays attached and pinned when it returns.
pub async fn run_manifests(cfg: RunConfig, manifests: PathBuf, poll: Duration) -> Result<()> {
    // A path that cannot be read at all is a mistake in the command line: say so before
    // attaching anything, rather than serve no Services and look healthy.
    let mut source = ManifestSource::open(&manifests)?;
    let mut agent = start(&cfg).await?;
    let stop = shutdown_signal();
    tokio::pin!(stop);
    let mut first = true;
    let mut ticker = tokio::time::interval(poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            r = &mut stop => { r?; break; }
        }
        if !source.changed() {
            continue;
        }
        let report = agent.sync_manifests(&mut source);
        info!(
            written = report.frontends_written,
            removed = report.frontends_removed,
            ops = report.ops,
            errors = report.errors.len(),
            "sync"
        );
        announce(&report, first);
        first = false;
    }
    info!("stopping; programs stay attached and maps pinned");
    Ok(())
}
