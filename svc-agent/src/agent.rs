//! `svc-agent run`: keeps the datapath in step with a source of Services and EndpointSlices.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, instrument, warn};

use crate::datapath;
use crate::error::Result;
use crate::model::DesiredState;
use crate::source::manifest;
use crate::store::BpfStore;
use crate::sync::{Programmed, SyncReport};
use crate::translate::{self, NodeContext};

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub manifests: PathBuf,
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub node: NodeContext,
    /// How often the manifests are checked for changes.
    pub poll: Duration,
}

/// Errors seen, by kind, since the agent started (for logs now, /metrics later).
#[derive(Debug, Default)]
pub struct Counters {
    pub syncs: u64,
    pub errors: BTreeMap<&'static str, u64>,
}

pub struct Agent {
    store: BpfStore,
    programmed: Programmed,
    node: NodeContext,
    pub counters: Counters,
}

impl Agent {
    /// Attaches (or adopts) the datapath and mirrors what it already holds.
    pub fn start(bpffs: &Path, cgroup: &Path, node: NodeContext) -> Result<Agent> {
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
            node,
            counters: Counters::default(),
        })
    }

    /// Reads the manifests, translates them, and applies the result. Bad objects are logged,
    /// counted and skipped; everything else is applied.
    #[instrument(skip(self), fields(path = %path.display()))]
    pub fn sync_manifests(&mut self, path: &Path) -> SyncReport {
        let loaded = manifest::load(path);
        let services: Vec<_> = loaded.services.into_iter().map(|n| n.object).collect();
        let slices: Vec<_> = loaded.slices.into_iter().map(|n| n.object).collect();
        let translated = translate::translate(&services, &slices, &self.node);
        for e in loaded.errors.iter().chain(&translated.errors) {
            warn!("skipped: {e}");
            *self.counters.errors.entry(e.kind()).or_default() += 1;
        }
        self.apply(&translated.state)
    }

    pub fn apply(&mut self, desired: &DesiredState) -> SyncReport {
        let report = self.programmed.apply(&mut self.store, desired);
        self.counters.syncs += 1;
        for e in &report.errors {
            warn!("not programmed: {e}");
            *self.counters.errors.entry(e.kind()).or_default() += 1;
        }
        report
    }
}

/// A cheap summary of the manifest files: names, sizes, inodes and modification times.
/// Editors and `kubectl`-style tools replace files by rename, which changes the inode.
fn fingerprint(path: &Path) -> Vec<(PathBuf, u64, u64, Option<SystemTime>)> {
    use std::os::unix::fs::MetadataExt;
    let mut files = Vec::new();
    let mut add = |p: PathBuf| {
        if let Ok(m) = std::fs::metadata(&p) {
            files.push((p, m.len(), m.ino(), m.modified().ok()));
        }
    };
    match std::fs::read_dir(path) {
        Ok(entries) => entries.flatten().for_each(|e| add(e.path())),
        Err(_) => add(path.to_path_buf()),
    }
    files.sort();
    files
}

/// Runs until SIGTERM or SIGINT. The datapath stays attached and pinned when it returns.
pub async fn run(cfg: RunConfig) -> Result<()> {
    let mut agent = Agent::start(&cfg.bpffs, &cfg.cgroup, cfg.node.clone())?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| crate::Error::Other(format!("installing the SIGTERM handler: {e}")))?;
    let mut last = None;
    let mut ticker = tokio::time::interval(cfg.poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        let fp = fingerprint(&cfg.manifests);
        if last.as_ref() == Some(&fp) {
            continue;
        }
        let first = last.is_none();
        last = Some(fp);
        let started = Instant::now();
        let report = agent.sync_manifests(&cfg.manifests);
        info!(
            written = report.frontends_written,
            removed = report.frontends_removed,
            ops = report.ops,
            errors = report.errors.len(),
            took_ms = started.elapsed().as_secs_f64() * 1e3,
            "sync"
        );
        // Stable lines for scripts and tests, independent of the log format.
        if report.changed() {
            eprintln!("svc-agent: synced");
        }
        if first {
            eprintln!("svc-agent: ready");
        }
    }
    info!("stopping; programs stay attached and maps pinned");
    Ok(())
}
