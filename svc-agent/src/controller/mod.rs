//! The controller: the one loop that says what happens when.
//!
//! The sources (the Kubernetes API or the manifest files, the node's devices and addresses)
//! produce events; their tracker keeps what they brought. The controller takes each event,
//! and when the tracker says a sync is due, translates what it hands over and has the agent
//! program it; in between, it runs the agent's upkeep at its deadlines. What follows the
//! source is the same code for Kubernetes and for manifests.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::jiff::Timestamp;
use tracing::{debug, info};

use crate::agent::{Agent, Upkeep};
use crate::datapath;
use crate::error::Result;
use crate::metrics::{self, Metrics};
use crate::model::NodeDesired;
use crate::packet::PacketConfig;
use crate::reconcile::{Plan, Programmed, Scope, SyncReport};
use crate::source::kube::{ApiServer, Cache, KubeOptions};
use crate::source::manifest::ManifestSource;
use crate::source::manifest_tracker::{self, ManifestTracker};
use crate::source::{self, Event, Tracker};
use crate::store::Capacity;
use crate::tasks::Tasks;
use crate::translate::{self, NodeContext};
use svc_common::map_names;

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub node: NodeContext,
    /// Where /healthz (and, on a metrics port, /metrics) is served.
    pub listen: Vec<(std::net::SocketAddr, metrics::Port)>,
    pub health_timeout: Duration,
    pub capacity: Capacity,
    pub upkeep: Upkeep,
    pub packet: PacketConfig,
    /// How external frontends choose backends (docs/design/maglev.md): the plan's Maglev
    /// tables.
    pub maglev: crate::maglev::Settings,
    /// Maglev with `--maglev-seed` left at its built-in default: with the Kubernetes API,
    /// warned about once the cluster has more than one Node.
    pub default_seed: bool,
}

/// How often the agent counts Nodes while the seed is at its default and one node was seen.
const SEED_CHECK_EVERY: Duration = Duration::from_secs(300);

/// Where the Services come from.
pub enum Input {
    Kube(KubeOptions),
    /// A manifest file or a directory of them, looked at every `poll`.
    Manifests {
        path: PathBuf,
        poll: Duration,
    },
}

type Events = Pin<Box<dyn Stream<Item = Event> + Send>>;

/// A source of Services, reachable.
enum Opened {
    Kube(ApiServer, KubeOptions),
    Manifests(ManifestSource, Duration),
}

/// A source that cannot be reached or read at all is a mistake in the command line: it is
/// said before anything is attached, rather than serve no Services and look healthy.
async fn open(input: Input, metrics: &Metrics) -> Result<Opened> {
    Ok(match input {
        Input::Kube(opts) => Opened::Kube(
            ApiServer::connect(&opts, Some(metrics.rest_client())).await?,
            opts,
        ),
        Input::Manifests { path, poll } => Opened::Manifests(ManifestSource::open(&path)?, poll),
    })
}

/// How the agent stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop {
    /// For a restart, or for a reason the API could not tell: the datapath stays attached and
    /// pinned.
    Kept,
    /// For good on this node (why): the caller uninstalls.
    Removed(String),
}

/// Serves the Services of `input` until SIGTERM or SIGINT. The datapath stays attached and
/// pinned when it returns, unless it says the agent was removed from its node.
pub async fn run(cfg: RunConfig, input: Input) -> Result<Stop> {
    let metrics = Metrics::new(cfg.bpffs.clone(), cfg.health_timeout);
    let opened = open(input, &metrics).await?;
    serve_metrics(&cfg, &metrics).await?;
    let mut removal = None;
    let _seed_check = match &opened {
        Opened::Kube(api, _) if cfg.default_seed => Some(api.warn_default_seed(SEED_CHECK_EVERY)),
        _ => None,
    };
    let (agent, tracker, events): (Agent, Box<dyn Tracker>, Events) = match opened {
        // The API server is reached on its own address: nothing of the datapath is needed to
        // list, so the lists run while the object loads and verifies.
        Opened::Kube(api, opts) if !api.behind_service(&opts.service_cidrs) => {
            removal = api.removal(&opts);
            let mut cache = Cache::new(cfg.node.clone(), opts.coalesce);
            let mut events = api.watch(&opts).boxed();
            let agent = start_beside(&cfg, &metrics, &mut cache, &mut events).await?;
            (agent, Box::new(cache), events)
        }
        Opened::Kube(api, opts) => {
            removal = api.removal(&opts);
            let agent = start_agent(&cfg, metrics.clone())?;
            api.check(&opts.service_cidrs, &|fe| {
                agent.programmed().frontends.contains_key(fe) && agent.links_pinned()
            })?;
            let events = api.watch(&opts).boxed();
            let cache = Cache::new(agent.node().clone(), opts.coalesce);
            (agent, Box::new(cache), events)
        }
        Opened::Manifests(files, poll) => (
            start_agent(&cfg, metrics.clone())?,
            Box::new(ManifestTracker::new(files)),
            manifest_tracker::polls(poll).boxed(),
        ),
    };
    let tasks = Tasks::start(agent.datapath(), &cfg.cgroup, metrics.clone());
    let node = match source::node::changes() {
        Ok(changes) => changes.boxed(),
        Err(e) => {
            metrics.report_as("netlink", "devices and addresses will not be followed", &e);
            futures::stream::pending().boxed()
        }
    };
    let events = futures::stream::select_all([events, node]);
    let mut controller = Controller {
        agent,
        tasks,
        tracker,
        metrics,
        synced_once: false,
        serving_said: false,
        ready_said: false,
    };
    // What the lists brought while the agent started, as if it had come now.
    controller.took_events();
    controller.forward_effects();
    controller.run(events).await?;
    let Some(removal) = removal else {
        return Ok(Stop::Kept);
    };
    // Asked only now: a stop is a restart unless the API says otherwise at that moment, and a
    // kubelet's grace period (30 s by default) must leave time for the handover.
    let asked = tokio::time::timeout(Duration::from_secs(5), removal.reason()).await;
    // Read after the answer: the watch may have seen the deletion meanwhile.
    let watched = removal.watched();
    Ok(match (asked, watched) {
        (Ok(Ok(Some(why))), _) => Stop::Removed(why),
        (Ok(Ok(None)), _) => Stop::Kept,
        // The API refuses (`helm uninstall` took the RBAC with the DaemonSet) or is silent:
        // what the watch saw while the agent ran.
        (Ok(Err(e)), Some(seen)) => {
            Stop::Removed(format!("{seen} (seen while running; at the stop: {e})"))
        }
        (Err(_), Some(seen)) => Stop::Removed(format!(
            "{seen} (seen while running; no answer at the stop)"
        )),
        (Ok(Err(e)), None) => {
            tracing::warn!(error = %e, "could not tell whether this node keeps the agent: the datapath stays");
            Stop::Kept
        }
        (Err(_), None) => {
            tracing::warn!(
                "no answer in 5 s on whether this node keeps the agent: the datapath stays"
            );
            Stop::Kept
        }
    })
}

/// Starts the agent on a thread of its own while `events` (the API's watchers) are taken into
/// `cache`: the kernel verifies the programs while the API server lists. The cache parses
/// what arrives; nothing is translated or written before the agent is there, and nothing is
/// attached before its first sync, as when the agent starts first.
async fn start_beside(
    cfg: &RunConfig,
    metrics: &Arc<Metrics>,
    cache: &mut Cache,
    events: &mut Events,
) -> Result<Agent> {
    let starting = {
        let (cfg, metrics) = (cfg.clone(), metrics.clone());
        tokio::task::spawn_blocking(move || start_agent(&cfg, metrics))
    };
    tokio::pin!(starting);
    let mut listing = true;
    loop {
        tokio::select! {
            started = &mut starting => {
                return started.map_err(|e| {
                    crate::Error::Other(format!("starting the agent: {e}"))
                })?;
            }
            e = events.next(), if listing => match e {
                Some(Event::WatchError(kind, e)) => watch_failed(metrics, kind, &e),
                Some(e) => cache.apply(e),
                None => listing = false,
            },
        }
    }
}

/// A watch failed: counted here; the source logged it, at a bounded rate
/// (`kube::FailureLog`).
fn watch_failed(metrics: &Metrics, kind: &'static str, e: &str) {
    debug!(kind, error = %e, "watch failed");
    metrics.error_kind(kind);
}

struct Controller {
    agent: Agent,
    /// The side effects: fed what the agent says it did, after each of its calls.
    tasks: Tasks,
    tracker: Box<dyn Tracker>,
    metrics: Arc<Metrics>,
    synced_once: bool,
    /// `svc-agent: serving` and `svc-agent: ready` were said (`announce_start`).
    serving_said: bool,
    ready_said: bool,
}

impl Controller {
    /// Said before the tasks are dropped, which joins their threads: the line marks the stop,
    /// not the end of their cleanup.
    async fn run(mut self, mut events: impl Stream<Item = Event> + Unpin) -> Result<()> {
        let stop = shutdown_signal();
        tokio::pin!(stop);
        // The end of the tc programs' verification, once: what waited for it is attached.
        let mut verified = self.agent.verified_watch();
        let mut verified_seen = false;
        let r = loop {
            let due = self.tracker.due().map(tokio::time::Instant::from_std);
            let upkeep = tokio::time::Instant::from_std(self.agent.next_deadline());
            tokio::select! {
                r = &mut stop => break r,
                e = events.next() => match e {
                    Some(e) => self.event(e),
                    None => break Ok(()),
                },
                _ = sleep_until(due), if due.is_some() => {
                    if let Err(e) = self.sync() {
                        break Err(e);
                    }
                }
                _ = tokio::time::sleep_until(upkeep) => self.agent.tick(Instant::now()),
                _ = verified.wait_for(|done| *done), if !verified_seen => {
                    verified_seen = true;
                    if let Err(e) = self.programs_verified() {
                        break Err(e);
                    }
                }
            }
            self.forward_effects();
            // Liveness is a turn of this loop, however long the upkeep interval is.
            self.metrics.alive();
        };
        info!("stopping; programs stay attached and maps pinned");
        r
    }

    /// The programs are verified, or one was refused: the rest of the datapath goes on after
    /// the first sync, or the agent stops with the kernel's refusal (a refused tc program
    /// leaves the socket programs it attached before, as a stopped agent's stay; a refused
    /// socket program leaves nothing of this agent attached).
    fn programs_verified(&mut self) -> Result<()> {
        self.agent.programs_verified();
        if let Some(e) = self.agent.load_failed() {
            return Err(e);
        }
        self.forward_effects();
        self.announce_start();
        Ok(())
    }

    /// The two lines of a start, each once, after the first sync: `svc-agent: serving` when
    /// this agent's socket programs have been attached (ClusterIPs answer the cgroup's
    /// sockets), `svc-agent: ready` when everything has been (NodePorts, externalIPs and
    /// LoadBalancer addresses answer too: the tc and XDP programs). Where both go on at once
    /// (a restart), both are said then. As ever, an attach that failed is said by /healthz,
    /// not by these lines.
    fn announce_start(&mut self) {
        if !self.synced_once {
            return;
        }
        let ready = self.agent.attach_tried();
        if !self.serving_said && (self.agent.sockets_attached() || ready) {
            self.serving_said = true;
            eprintln!("svc-agent: serving");
        }
        if !self.ready_said && ready {
            self.ready_said = true;
            eprintln!("svc-agent: ready");
        }
    }

    /// Hands the tasks what the agent did since the last call.
    fn forward_effects(&mut self) {
        self.tasks.handle(self.agent.take_effects());
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::NodeChanged => {
                if self.agent.refresh_node() {
                    self.tracker.retranslate_all();
                }
                // The node's problems in /healthz follow the change now, not at the next
                // upkeep; nothing of the upkeep runs before its own deadline.
                self.agent.tick(Instant::now());
                return;
            }
            Event::WatchError(kind, e) => {
                // The watcher retries with backoff; what is programmed keeps serving.
                watch_failed(&self.metrics, kind, &e);
            }
            e => self.tracker.apply(e),
        }
        self.took_events();
    }

    /// What the tracker learned from the events it took that is not a sync: the node's
    /// eligibility and addresses, and that changes wait.
    fn took_events(&mut self) {
        if let Some(eligible) = self.tracker.take_node_eligible() {
            self.metrics.set_node_eligible(eligible);
        }
        if let Some(ips) = self.tracker.take_node_ips() {
            if self.agent.set_api_node_ips(ips) {
                self.tracker.retranslate_all();
            }
        }
        if self.tracker.queued() {
            self.metrics.queued();
        }
        self.metrics.changes(self.tracker.take_changes());
    }

    /// Translates what the tracker hands over and programs it: everything, or only the
    /// Services that changed. Fails when a program of the object was refused by the kernel:
    /// this agent can never attach it.
    fn sync(&mut self) -> Result<()> {
        let started = Instant::now();
        let agent = &mut self.agent;
        let batch = self.tracker.take(agent.holders());
        // Nothing pending once the batch is taken (the counts of the changes stay).
        self.metrics.changes(crate::source::Changes::default());
        agent.set_zone(batch.zone);
        let (owners, full) = match batch.owners {
            Some(owners) => (owners, false),
            None => {
                // Of the old desired state, the new one needs only who holds what: the rest
                // goes first, so that one copy of the backends is in memory, not two.
                agent.forget_desired();
                (BTreeSet::new(), true)
            }
        };
        let mut translated =
            translate::assemble_with(batch.services, batch.slices, agent.node(), agent.holders());
        translated.errors.splice(0..0, batch.errors);
        let report = if full {
            agent.apply_full(translated)
        } else {
            agent.apply_services(&owners, translated)
        };
        if let Some(e) = agent.load_failed() {
            return Err(e);
        }
        // Before the sync is announced: its health check ports listen by then.
        self.tasks.handle(agent.take_effects());
        record_latency(&self.metrics, &report, &batch.triggers, batch.since);
        if full {
            info!(
                ms = started.elapsed().as_millis() as u64,
                services = batch.changed,
                written = report.frontends_written,
                removed = report.frontends_removed,
                ops = report.ops,
                errors = report.errors.len(),
                "sync"
            );
        } else {
            debug!(
                services = batch.changed,
                written = report.frontends_written,
                removed = report.frontends_removed,
                ops = report.ops,
                "sync"
            );
        }
        if report.changed() {
            eprintln!("svc-agent: synced");
        }
        self.synced_once = true;
        self.announce_start();
        // After `ready`, not in the first change's path.
        if full && self.tracker.syncs_by_service() {
            self.agent.prepare_service_syncs();
        }
        Ok(())
    }
}

/// Network programming latency of the changes that landed (a failed one is retried), and
/// how long the oldest change waited.
fn record_latency(
    metrics: &Metrics,
    report: &SyncReport,
    triggers: &[(String, Timestamp)],
    since: Instant,
) {
    let now = Timestamp::now();
    for (owner, t) in triggers {
        if report.failed.contains_key(owner) {
            continue;
        }
        if let Ok(d) = now.duration_since(*t).try_into() {
            metrics.programming_latency(d);
        }
    }
    metrics.event_lag(since.elapsed());
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => futures::future::pending().await,
    }
}

/// Starts the metrics servers.
async fn serve_metrics(cfg: &RunConfig, metrics: &Arc<Metrics>) -> Result<()> {
    metrics.snat_degraded(cfg.packet.snat_degraded.clone());
    metrics.snat_ports(cfg.packet.snat_ports);
    for &(addr, port) in &cfg.listen {
        let listener = metrics::bind(addr).await?;
        info!(%addr, paths = port.paths(), "serving");
        tokio::spawn(metrics::serve(listener, metrics.clone(), port));
    }
    Ok(())
}

/// Starts the agent: the datapath loaded, the pinned maps adopted.
fn start_agent(cfg: &RunConfig, metrics: Arc<Metrics>) -> Result<Agent> {
    Agent::start(
        &cfg.bpffs,
        &cfg.cgroup,
        cfg.capacity,
        cfg.upkeep.clone(),
        cfg.node.clone(),
        cfg.packet.clone(),
        metrics,
    )
    .map(|mut agent| {
        agent.set_maglev(cfg.maglev);
        agent
    })
}

/// Completes when the agent should stop (SIGTERM or SIGINT).
async fn shutdown_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| crate::Error::Other(format!("installing the SIGTERM handler: {e}")))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// The plan of the first sync `run` would make now: the sources read once, the maps pinned
/// in `cfg.bpffs` read (none pinned: empty maps), the node's devices and addresses read.
/// Nothing is written, attached, pinned or locked. Input errors are in the second value.
pub async fn dry_run(cfg: &RunConfig, input: Input) -> Result<(Plan, Vec<crate::Error>)> {
    let mut programmed = if datapath::map_pin(&cfg.bpffs, map_names::SERVICES).exists() {
        let store = datapath::open_pinned(&cfg.bpffs)?;
        Programmed::adopt(&store, store.capacity, cfg.upkeep.grace)?
    } else {
        Programmed::empty(cfg.capacity, cfg.upkeep.grace)
    };
    programmed.maglev.settings = cfg.maglev;
    let devices = crate::netdev::read().map_err(|e| {
        crate::Error::Other(format!("reading the node's devices and addresses: {e}"))
    })?;
    let holders = programmed.served();
    // The source read once, as its first sync would find it.
    let (mut tracker, api_node_ips): (Box<dyn Tracker>, Option<Vec<std::net::IpAddr>>) = match input
    {
        Input::Manifests { path, .. } => (
            Box::new(ManifestTracker::new(ManifestSource::open(&path)?)),
            None,
        ),
        Input::Kube(opts) => {
            let api = ApiServer::connect(&opts, None).await?;
            let mut cache = Cache::new(cfg.node.clone(), opts.coalesce);
            for u in api.snapshot(&opts).await? {
                cache.apply(source::Event::Api(u));
            }
            let ips = cache.take_node_ips();
            (Box::new(cache), ips)
        }
    };
    let view = crate::packet::view(&cfg.packet, &devices, api_node_ips.as_deref());
    let node = NodeContext {
        node_ips: view.primary.clone(),
        ..cfg.node.clone()
    };
    let batch = tracker.take(&holders);
    let node = NodeContext {
        zone: batch.zone.clone().or(node.zone),
        ..node
    };
    let mut translated = translate::assemble_with(batch.services, batch.slices, &node, &holders);
    translated.errors.splice(0..0, batch.errors);
    let mut state = translated.state;
    state.node = NodeDesired {
        addrs: view.addrs,
        config: Some(cfg.packet.datapath_config()),
    };
    Ok((programmed.plan(&state, Scope::All), translated.errors))
}
