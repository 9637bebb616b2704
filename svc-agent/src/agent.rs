//! The agent: keeps the datapath in step with a source of Services and EndpointSlices, and
//! keeps it whole: failed Services are retried with backoff, what was retired is deleted once
//! its grace period has passed, the maps are compared with the mirror now and then and drift
//! is repaired, and pins or links removed under the agent are put back.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, instrument, warn};

use crate::datapath::{Datapath, XdpMode};
use crate::desired::Desired;
use crate::error::{Error, Result};
use crate::metrics::{self, Metrics};
use crate::model::{Frontend, Protocol, Served};
use crate::node::Node;
use crate::packet::PacketConfig;
use crate::reconcile::{
    Dirty, ProgFrontend, Programmed, Retiring, Scope, Seeded, SyncReport, Unsure,
};
use crate::retry::{Backoff, Retries};
use crate::store::{Capacity, Store};
use crate::tasks::stale::Keep;
use crate::tasks::stale_udp::ServingChange;
use crate::tasks::Effect;
use crate::translate::{Holders, NodeContext, Translated};

/// How the agent keeps its state whole; every interval has a flag.
#[derive(Clone, Debug)]
pub struct Upkeep {
    /// How long what a switch made unreachable stays in the maps.
    pub grace: Duration,
    /// First retry of a Service that could not be programmed; doubles up to `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// How often the maps are read back and compared with what should be there.
    pub reconcile_every: Duration,
    /// How often pins and links are checked.
    pub check_every: Duration,
}

impl Default for Upkeep {
    fn default() -> Self {
        Upkeep {
            grace: crate::reconcile::DEFAULT_GRACE,
            retry_min: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            reconcile_every: Duration::from_secs(60),
            check_every: Duration::from_secs(2),
        }
    }
}

impl Upkeep {
    /// How failed Services and node state are tried again.
    pub fn backoff(&self) -> Backoff {
        Backoff {
            min: self.retry_min,
            max: self.retry_max,
        }
    }
}

pub struct Agent {
    dp: Datapath,
    programmed: Programmed,
    desired: Desired,
    /// The node's devices and addresses, as read, and its desired state in the maps.
    node: Node,
    metrics: Arc<Metrics>,
    upkeep: Upkeep,
    /// What could not be programmed, Services and the node's state.
    retry: Retries,
    next_reconcile: Instant,
    /// The drift check reading the maps beside the loop, while it does (`start_check`).
    check: Option<Check>,
    /// Per shard of the maps a digest covers (`reconcile::digest`): how many checks in a row
    /// left it out, written under them or retiring. A shard left out by `HOT_CHECKS` checks
    /// in a row sends the next to the full check, so no entry escapes the check for long.
    left_out: Vec<u8>,
    /// A sync since the last full check had errors no retry covers (a ClusterIP marker, an
    /// external address): the full check's sync of every Service, which writes whatever is
    /// missing, is the retry, so the next check is a full one.
    unretried: bool,
    next_check: Instant,
    /// When the next slice of the per-Service counters still to be made is due, and how many
    /// were made since the last were all there (`make_pending_stats`).
    next_stats: Instant,
    stats_made: usize,
    /// The source's state has been applied in full once: before that, the desired state is
    /// not authoritative and no upkeep may act on it.
    synced: bool,
    /// What the side-effect tasks are to act on, in order, until the controller takes it
    /// (`take_effects`).
    effects: Vec<Effect>,
    /// The connection-tracking sweep's program was asked for once (`start_sweep`).
    sweep_tried: bool,
    /// Attaching everything was tried once (`attach`, after the verification).
    attach_tried: bool,
    /// When NODE_ADDRS was last brought to the pinned flows before an attach.
    flow_addrs_walked: Option<Instant>,
    /// Who served each frontend as the pinned maps said at start: the holders until the
    /// first sync makes a desired state.
    adopted: Option<Served>,
}

/// A drift check's reading of the maps, on a thread of its own.
struct Check {
    thread: std::thread::JoinHandle<Result<crate::store::Reading>>,
    hasher: Seeded,
    /// When the loop next looks whether the thread is done.
    poll: Instant,
}

/// How often the loop looks whether a drift check's reading is done.
const CHECK_POLL: Duration = Duration::from_millis(100);

/// How many drift checks in a row may leave one shard out of their comparison.
const HOT_CHECKS: u8 = 10;

impl Agent {
    /// Takes ownership of the bpffs directory, loads the datapath and mirrors what it holds.
    /// Nothing is attached until the first sync: see `apply_full`.
    pub fn start(
        bpffs: &Path,
        cgroup: &Path,
        capacity: Capacity,
        upkeep: Upkeep,
        node: NodeContext,
        packet: PacketConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Agent> {
        if let Some((major, minor)) = crate::features::kernel_as() {
            warn!(
                "taking the kernel for Linux {major}.{minor} (--kernel-as, SVC_KERNEL_AS: a \
                 testing aid): what came after it is reported missing"
            );
        }
        // Before anything is loaded: what this kernel lacks, named, rather than a verifier
        // error deep in a load.
        let kernel = crate::features::check(&crate::features::Kernel {
            cgroup: Some(cgroup),
        });
        for w in kernel.warnings() {
            warn!("{w}");
        }
        if let Some(e) = kernel.error() {
            return Err(Error::load(e));
        }
        let fit = kernel.fit();
        // A kernel without what the XDP program needs runs tc alone (warned above, once per
        // missing feature): as a device whose driver refuses native XDP is left to tc, not
        // refused, so that one set of flags serves nodes of several kernels and none of them
        // loses its Services over an acceleration.
        let xdp_mode = if fit.xdp || packet.xdp_mode == XdpMode::Off {
            packet.xdp_mode
        } else {
            warn!(
                "--xdp-mode {}: this kernel cannot load the XDP program (above): running as \
                 --xdp-mode off, tc serves every device",
                packet.xdp_mode.word().unwrap_or("off")
            );
            XdpMode::Off
        };
        let mut dp = Datapath::open(bpffs, cgroup, capacity, fit, xdp_mode)?;
        dp.set_tc_attach(packet.tc_attach)?;
        let snap = dp.store.snapshot()?;
        let mut programmed =
            Programmed::recover(&snap, capacity, upkeep.grace, Retiring::default());
        drop(snap);
        // Recovery fills the tree in the order the map dump gives, leaving its nodes about a
        // third empty (22.4 MiB of nodes at 100,000 frontends by heaptrack), and the restart's
        // peak (the assembly and first sync, the desired state beside this mirror) is ahead.
        programmed.compact();
        crate::sys::release_free_memory();
        info!(
            frontends = programmed.frontends.len(),
            backends = programmed.backends.len(),
            leftovers = programmed.strays.len(),
            "adopted pinned state"
        );
        let now = Instant::now();
        let node = Node::new(node, packet);
        let adopted = Some(programmed.served());
        let mut agent = Agent {
            adopted,
            dp,
            effects: vec![Effect::HealthBinds(node.health_binds().clone())],
            sweep_tried: false,
            attach_tried: false,
            programmed,
            desired: Desired::default(),
            node,
            metrics,
            next_reconcile: now + upkeep.reconcile_every,
            check: None,
            left_out: vec![0; crate::reconcile::DIGEST_MAPS.len() * crate::reconcile::SHARDS],
            unretried: false,
            next_check: now + upkeep.check_every,
            next_stats: now,
            stats_made: 0,
            retry: Retries::new(upkeep.backoff()),
            upkeep,
            synced: false,
            flow_addrs_walked: None,
        };
        agent.refresh_node();
        Ok(agent)
    }

    /// The Maglev flags the syncs write tables by (docs/design/maglev.md); before the first.
    pub fn set_maglev(&mut self, settings: crate::maglev::Settings) {
        self.programmed.maglev.settings = settings;
    }

    /// Reads the node's devices and addresses again and brings the packet datapath's node
    /// state (SVC_NODE_ADDRS, SVC_CONFIG, the devices the tc programs are on) in line.
    /// Returns true when the node's primary addresses changed: the Services must be
    /// translated again (loadBalancerSourceRanges admit the node by them).
    pub fn refresh_node(&mut self) -> bool {
        let Some(changed) = self.node.refresh(&self.metrics) else {
            return false;
        };
        if let Some((external, pods)) = changed.devices {
            match self.dp.set_tc_devices(external, pods) {
                Ok(done) => done.iter().for_each(|d| info!("{d}")),
                Err(e) => {
                    self.metrics.report("attaching the packet datapath", &e);
                }
            }
            self.metrics
                .tc_attachments(&self.dp.tc_current_attachments());
        }
        self.desired.state.node = self.node.desired().clone();
        self.apply_node(Instant::now());
        if let Some(binds) = changed.health_binds {
            self.effects.push(Effect::HealthBinds(binds));
        }
        changed.primary
    }

    /// The Node's addresses changed (Kubernetes API): kube-proxy's node IPs. Returns true
    /// when the Services must be translated again.
    pub fn set_api_node_ips(&mut self, ips: Vec<std::net::IpAddr>) -> bool {
        self.node.set_api_ips(ips) && self.refresh_node()
    }

    /// What translation needs to know of this node: its name, zone and primary addresses.
    pub fn node(&self) -> &NodeContext {
        self.node.context()
    }

    /// The node's topology zone, as the source states it.
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.node.set_zone(zone);
    }

    /// The datapath, for the tasks' own handles on its maps.
    pub fn datapath(&self) -> &Datapath {
        &self.dp
    }

    /// What the side-effect tasks are to act on since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Drops what a full translation replaces of the desired state, all but who holds each
    /// frontend (`holders`).
    pub fn forget_desired(&mut self) {
        self.desired.keep_holders_only();
    }

    /// Makes ready for syncs of a few Services (`Desired::index_by_service`).
    pub fn prepare_service_syncs(&mut self) {
        self.desired.index_by_service();
    }

    /// Who holds each frontend, for resolving conflicts: the previous desired state; before
    /// the first sync, what the pinned maps served.
    pub fn holders(&self) -> &dyn Holders {
        match &self.adopted {
            Some(served) => served,
            None => &self.desired.state,
        }
    }

    pub fn programmed(&self) -> &Programmed {
        &self.programmed
    }

    /// The error of a program the kernel refused to load, once the verification has ended
    /// (never waits for it): this agent can never attach its tc programs.
    pub fn load_failed(&mut self) -> Option<Error> {
        self.dp.load_failed()
    }

    /// Whether links (ours or a previous agent's) are pinned: then the programs serve.
    pub fn links_pinned(&self) -> bool {
        self.dp.links_pinned()
    }

    fn record_input_errors(&self, errors: &[Error]) {
        for e in errors {
            // Input errors quote names, file names and document text as they came.
            let escaped = crate::names::Escaped(&e.to_string());
            self.metrics.report_as(e.kind(), "skipped", &escaped);
        }
    }

    /// Makes the datapath serve exactly `translated`: what is not in it is removed. The first
    /// call attaches the programs, once the maps hold the whole state.
    pub fn apply_full(&mut self, translated: Translated) -> SyncReport {
        let started = Instant::now();
        self.record_input_errors(&translated.errors);
        let mut state = translated.state;
        state.node = self.node.desired().clone();
        self.desired = Desired::from_full(state);
        self.adopted = None;
        let first = !self.synced;
        self.synced = true;
        let report = self.programmed.apply_scoped(
            &mut self.dp.store,
            &self.desired.state,
            Scope::All,
            started,
        );
        if first {
            // The first drift check an interval after the first sync ends, not at once after a
            // cold start longer than the interval: the maps were just written, and a check
            // then only competes with the first changes.
            self.next_reconcile = Instant::now() + self.upkeep.reconcile_every;
        }
        // A sync that wrote a large share of the frontends (the first, on empty maps) filled
        // the tree in key order; one that changed little (a manifest edit) need not pack it.
        // The first sync after a start, even one that wrote nothing (a restart on the pins),
        // leaves the largest transient memory behind (the lists, the assembly, the plan), to
        // be given back, else a restart that writes nothing keeps it resident.
        let wrote_much = report.frontends_written * 4 >= self.programmed.frontends.len().max(1);
        if wrote_much {
            self.programmed.compact();
        }
        if wrote_much || first {
            crate::sys::release_free_memory();
        }
        self.finish(report, started, None, Scope::All)
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
        let (mut scope, conflicts) = self.desired.replace(owners, translated.state);
        self.record_input_errors(&conflicts);
        for owner in owners {
            scope.extend(self.retry.frontends(owner).copied());
        }
        let report = self.programmed.apply_scoped(
            &mut self.dp.store,
            &self.desired.state,
            Scope::Only(&scope),
            started,
        );
        self.finish(report, started, Some(owners), Scope::Only(&scope))
    }

    /// Records what a sync did. `covered`: the Services it covered (None: every Service); those
    /// that did not fail need no retry any more. `scope`: the frontends it covered.
    fn finish(
        &mut self,
        report: SyncReport,
        started: Instant,
        covered: Option<&BTreeSet<String>>,
        scope: Scope<'_>,
    ) -> SyncReport {
        for e in &report.errors {
            self.metrics.report("not programmed", e);
        }
        if covered.is_none() {
            self.note_node(report.node_failed, started);
        }
        let healed: Vec<String> = match covered {
            None => self
                .retry
                .owners()
                .filter(|o| !report.failed.contains_key(*o))
                .cloned()
                .collect(),
            Some(owners) => owners
                .iter()
                .filter(|o| self.retry.contains(o) && !report.failed.contains_key(*o))
                .cloned()
                .collect(),
        };
        for owner in healed {
            self.retry.healed(&owner);
            info!(service = %owner, "programmed after earlier failures");
        }
        for (owner, frontends) in &report.failed {
            self.retry.failed(owner, frontends, started);
        }
        // One error for each Service that failed; any other is one no retry covers.
        if report.errors.len() > report.failed.len() {
            self.unretried = true;
        }
        self.after_sync(started, covered.is_none(), scope);
        report
    }

    /// What follows any sync, whatever it wrote: attach what is not yet, end stale UDP flows
    /// of `scope`, bring the health checks in line, record the sync.
    fn after_sync(&mut self, started: Instant, full: bool, scope: Scope<'_>) {
        self.attach();
        self.end_stale_udp(scope);
        self.sync_health_checks();
        self.metrics
            .synced(started.elapsed(), full, self.snapshot_metrics());
    }

    /// Attaches what of this agent's programs can be attached now, after a sync (the maps
    /// hold the whole state), nothing again once all is. On a cold start the socket programs
    /// go on at once, or as soon as the kernel has verified them (ClusterIPs answer from then
    /// on), the tc and XDP programs once it has verified those too (`programs_verified`,
    /// which the controller waits on); where a previous agent's programs serve, or maps are
    /// migrated, everything goes on at that later moment together.
    fn attach(&mut self) {
        if self.dp.is_attached() {
            return;
        }
        let verified = self.dp.programs_verified();
        let sockets_now = !self.dp.sockets_attached() && self.dp.sockets_first();
        if !verified && !sockets_now {
            return;
        }
        // The programs about to replace the pinned ones pass untouched any packet to an
        // address NODE_ADDRS lacks; the pinned flows' addresses go in first (with the
        // timeouts this agent has written). Not again at every sync while attaching keeps
        // failing.
        let now = Instant::now();
        if self
            .flow_addrs_walked
            .is_none_or(|t| now.duration_since(t) >= self.upkeep.check_every)
        {
            self.flow_addrs_walked = Some(now);
            self.check_flow_addrs(false);
        }
        if !verified {
            match self.dp.attach_sockets() {
                Ok(()) => info!(
                    "socket programs attached (ClusterIPs answer); the tc and XDP programs \
                     follow once the kernel has verified them"
                ),
                Err(e) => self.metrics.report("attaching", &e),
            }
            return;
        }
        self.attach_tried = true;
        match self.dp.attach() {
            Ok(()) => {
                let tc = self.dp.tc_current_attachments();
                info!(
                    tc_mode = %self.dp.tc_mode(),
                    tc_programs = %tc
                        .iter()
                        .map(|a| format!("{} on {} ({})", a.program, a.device, a.mode))
                        .collect::<Vec<_>>()
                        .join(", "),
                    "datapath attached"
                );
                self.metrics.tc_attachments(&tc);
                self.start_sweep();
            }
            Err(e) => {
                self.metrics.report("attaching", &e);
            }
        }
    }

    /// The tc programs' verification has ended: attaches what waited for it (after the
    /// first sync), and says in `/healthz` where things stand.
    pub fn programs_verified(&mut self) {
        if self.synced {
            self.attach();
        }
        self.metrics.state(self.snapshot_metrics());
    }

    /// Whether this agent's socket programs are attached.
    pub fn sockets_attached(&self) -> bool {
        self.dp.sockets_attached()
    }

    /// Whether all of this agent's programs are attached.
    pub fn attached(&self) -> bool {
        self.dp.is_attached()
    }

    /// Whether everything has been attached, or tried to be (the first attempt after the
    /// verification; what failed is /healthz's to say).
    pub fn attach_tried(&self) -> bool {
        self.attach_tried
    }

    /// Turns true when the tc programs' verification ends.
    pub fn verified_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.dp.verified_watch()
    }

    /// Has the connection-tracking sweep started, once: after this agent's programs are attached,
    /// as until then the pinned links may run an earlier object's programs, whose claims
    /// (`SVC_CT_CLAIMS`, not pinned) are not the sweep's.
    fn start_sweep(&mut self) {
        let Some(every) = self.node.packet().ct_sweep_every else {
            return;
        };
        if std::mem::replace(&mut self.sweep_tried, true) {
            return;
        }
        match self.dp.ct_sweep() {
            Ok(Some(prog)) => self.effects.push(Effect::Sweep { prog, every }),
            Ok(None) => {
                info!(
                    "the eBPF object has no connection-tracking sweep: dead flows stay in \
                     connection tracking until evicted"
                );
            }
            Err(e) => {
                self.metrics
                    .report("dead flows stay in connection tracking until evicted", &e);
            }
        }
    }

    /// Has the health check node port servers started and stopped as the Services say.
    fn sync_health_checks(&mut self) {
        self.effects.push(Effect::HealthChecks(
            self.desired.state.health_checks.clone(),
        ));
    }

    /// Writes the node's state (addresses, datapath settings) as `node_desired` has it.
    fn apply_node(&mut self, now: Instant) {
        let report = self
            .programmed
            .apply_node(&mut self.dp.store, self.node.desired());
        for e in &report.errors {
            self.metrics.report("node addresses", e);
        }
        self.note_node(report.node_failed, now);
    }

    /// Schedules the next try at the node's state after a sync of it failed (as a Service's,
    /// with backoff), or forgets the tries after one that did not.
    fn note_node(&mut self, failed: bool, started: Instant) {
        if failed {
            self.retry.node_failed(started);
        } else if self.retry.node_healed() {
            info!("node addresses programmed after earlier failures");
        }
    }

    fn snapshot_metrics(&self) -> metrics::Programmed {
        metrics::Programmed {
            frontends: self.programmed.frontends.len(),
            backends: self.programmed.backends.len(),
            cluster_ips: self.programmed.markers.len(),
            maps: self.programmed.map_usage(),
            failing: self.retry.owners().cloned().collect(),
            retiring: self.programmed.retiring.len(),
            attached: self.dp.is_attached(),
            sockets_attached: self.dp.sockets_attached(),
            node_failing: self.retry.node_failing(),
            unserved: self
                .desired
                .state
                .unserved
                .values()
                .flat_map(|ports| ports.iter().cloned())
                .collect(),
            maglev: metrics::MaglevUsage {
                table_bytes: self.programmed.maglev.table_bytes(),
                capacity_bytes: u64::from(self.programmed.capacity.maglev_blocks()) * 8,
                tables: self.programmed.maglev.live.len(),
                none: self.programmed.maglev.roomless.len(),
            },
            no_local_endpoints: {
                let mut sum = crate::model::NoLocalEndpoints::default();
                for n in self.desired.state.no_local_endpoints.values() {
                    sum += *n;
                }
                sum
            },
        }
    }

    /// A UDP flow of the packet datapath, and a connected UDP socket, keep their backend for
    /// as long as the client sends; once that backend no longer serves the frontend they were
    /// translated for, the flow is ended and the socket closed, so the next datagram (or the
    /// application's new connect()) picks a live backend. Stateless, as kube-proxy's
    /// CleanStaleEntries: the stale-UDP task judges every flow and socket by what serves
    /// now (brought to the frontends `scope` covered), once the first full sync of a run has
    /// made the desired state whole, and again after every sync that may have left some
    /// stale. The walk is the task's: the sync does not wait.
    fn end_stale_udp(&mut self, scope: Scope<'_>) {
        if !self.synced {
            return;
        }
        let keep = |fe: &Frontend, pf: &ProgFrontend| -> Keep {
            let failing = |owner: &str| self.retry.contains(owner);
            let d = self.desired.state.frontends.get(fe);
            if failing(pf.owner()) || d.is_some_and(|d| failing(d.owner())) {
                return Keep::Any;
            }
            match d {
                Some(d) => Keep::Only(match &d.serving {
                    Some(serving) => serving.clone(),
                    None => {
                        let mut b: Vec<std::net::SocketAddr> = d
                            .backends
                            .iter()
                            .map(|b| std::net::SocketAddr::new(b.ip().to_canonical(), b.port()))
                            .collect();
                        b.sort();
                        Arc::new(b)
                    }
                }),
                // Programmed, not desired, and not failing: only a sync that did not cover
                // it; nothing is known against it.
                None => Keep::Any,
            }
        };
        let udp = |fe: &&Frontend| fe.protocol == Protocol::Udp;
        let change = match scope {
            Scope::All => ServingChange::All(
                self.programmed
                    .frontends
                    .iter()
                    .filter(|(fe, _)| udp(fe))
                    .map(|(fe, pf)| (*fe, pf.id, keep(fe, pf)))
                    .collect(),
            ),
            Scope::Only(frontends) => ServingChange::Some(
                frontends
                    .iter()
                    .filter(udp)
                    .map(|fe| {
                        let now = self.programmed.frontends.get(fe);
                        (*fe, now.map(|pf| (pf.id, keep(fe, pf))))
                    })
                    .collect(),
            ),
        };
        self.effects.push(Effect::UdpServing(change));
    }

    /// When `tick` next has something to do.
    pub fn next_deadline(&self) -> Instant {
        let mut t = self.next_reconcile.min(self.next_check);
        if let Some(due) = self.programmed.retiring.next_due() {
            t = t.min(due);
        }
        if let Some(r) = self.retry.next_due() {
            t = t.min(r);
        }
        if !self.dp.store.stats_pending.is_empty() {
            t = t.min(self.next_stats);
        }
        if let Some(c) = &self.check {
            t = t.min(c.poll);
        }
        t
    }

    /// Whatever upkeep is due at `now`: retirements, retries, the drift check, the pin check.
    pub fn tick(&mut self, now: Instant) {
        self.metrics.alive();
        if !self.synced {
            // No upkeep before the first sync, but its deadlines move on: the loop sleeps
            // until the next of them, and one left in the past would have it spin.
            if now >= self.next_check {
                self.next_check = now + self.upkeep.check_every;
            }
            if now >= self.next_reconcile {
                self.next_reconcile = now + self.upkeep.reconcile_every;
            }
            return;
        }
        if self
            .programmed
            .retiring
            .next_due()
            .is_some_and(|d| d <= now)
        {
            let r = self.programmed.retire_due(&mut self.dp.store, now);
            for e in &r.errors {
                self.metrics.report("retiring", e);
            }
        }
        let due = self.retry.due(now);
        if !due.is_empty() {
            let mut scope = BTreeSet::new();
            for owner in &due {
                scope.extend(self.desired.frontends_of(owner).iter().copied());
                scope.extend(self.retry.frontends(owner).copied());
            }
            info!(
                services = due.len(),
                "retrying Services that could not be programmed"
            );
            let report = self.programmed.apply_scoped(
                &mut self.dp.store,
                &self.desired.state,
                Scope::Only(&scope),
                now,
            );
            let due: BTreeSet<String> = due.into_iter().collect();
            self.finish(report, now, Some(&due), Scope::Only(&scope));
        }
        if now >= self.next_check {
            // Due again whether or not the programs are attached (a failed attach is tried
            // at the next sync): a deadline left in the past would have the loop spin.
            self.next_check = now + self.upkeep.check_every;
            if self.dp.sockets_attached() {
                self.check_pins();
                // A health check port that could not be bound (in use) is tried again.
                self.effects.push(Effect::HealthRetry);
            }
        }
        if self.retry.node_due(now) {
            self.apply_node(now);
        }
        if !self.dp.store.stats_pending.is_empty() && now >= self.next_stats {
            self.make_pending_stats();
        }
        match &mut self.check {
            Some(c) if c.thread.is_finished() => self.finish_check(now),
            Some(c) => c.poll = now + CHECK_POLL,
            None if now >= self.next_reconcile => self.start_check(now),
            None => {}
        }
        self.metrics.state(self.snapshot_metrics());
    }

    /// Brings the lingering addresses of NODE_ADDRS to the live flows (reconcile/addrs.rs).
    /// `drift`: an address found missing was deleted by someone else (else it predates this
    /// agent's programs).
    fn check_flow_addrs(&mut self, drift: bool) {
        let r = self.programmed.check_flow_addrs(&mut self.dp.store);
        if r.added > 0 && drift {
            warn!(
                addresses = r.added,
                "addresses live flows go to were missing from NODE_ADDRS; put back"
            );
            self.metrics.drift(r.added);
        } else if r.added > 0 {
            info!(
                addresses = r.added,
                "addresses that pinned flows go to, put in NODE_ADDRS"
            );
        }
        if r.deleted > 0 {
            info!(
                deleted = r.deleted,
                kept = r.kept,
                "lingering addresses no flow goes to any more, removed from NODE_ADDRS"
            );
        }
        for e in &r.errors {
            self.metrics.report("lingering addresses", e);
        }
        if let Some(backends) = r.snat_backends {
            self.node.check_unmanaged_egress(&backends, &self.metrics);
        }
    }

    /// Puts back pins and links someone removed under us.
    fn check_pins(&mut self) {
        let (repaired, errors) = self.dp.repair();
        for what in &repaired {
            warn!("{what} had disappeared; put back");
            self.metrics.repaired("pin");
        }
        if !repaired.is_empty() {
            self.metrics
                .tc_attachments(&self.dp.tc_current_attachments());
        }
        for e in &errors {
            self.metrics.report("repairing the datapath", e);
        }
        self.metrics.datapath_broken(!errors.is_empty());
    }

    /// Starts a drift check: a thread sums the maps' entries (`DigestReader`) while the loop
    /// goes on, the store marking the shards the loop writes meanwhile. Where no thread can
    /// be made, the full check runs on the loop.
    fn start_check(&mut self, now: Instant) {
        if self.left_out.iter().any(|n| *n >= HOT_CHECKS) {
            debug!("drift check: a shard of the maps was written under every recent check");
            return self.full_check(now);
        }
        if self.unretried {
            debug!("drift check: a sync had errors no retry covers; a full check");
            return self.full_check(now);
        }
        let reader = match self.dp.store.digest_reader() {
            Ok(r) => r,
            Err(e) => {
                self.metrics.report("reading the maps back", &e);
                return self.full_check(now);
            }
        };
        let hasher = Seeded::default();
        let h = hasher.clone();
        let thread = std::thread::Builder::new()
            .name("svc-drift".into())
            .spawn(move || reader.read(&h));
        match thread {
            Ok(thread) => {
                // Out of `next_deadline`'s way while the thread reads: `finish_check` sets it.
                self.next_reconcile = now + self.upkeep.reconcile_every;
                self.dp.store.dirty = Some(Dirty::default());
                self.check = Some(Check {
                    thread,
                    hasher,
                    poll: now + CHECK_POLL,
                })
            }
            Err(_) => self.full_check(now),
        }
    }

    /// Compares what the drift check's thread read with the mirror: the same, and the check
    /// is done; different, and the full check reads the maps back and repairs them.
    fn finish_check(&mut self, now: Instant) {
        let Some(c) = self.check.take() else {
            return;
        };
        let mut dirty = self.dp.store.dirty.take().unwrap_or_default();
        let read = match c.thread.join() {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                self.metrics.report("reading the maps back", &e);
                return self.full_check(now);
            }
            Err(_) => return self.full_check(now),
        };
        let began = Instant::now();
        let want = match self.programmed.digest(&c.hasher) {
            Ok((d, retiring)) => {
                dirty.union(&retiring);
                d
            }
            Err(Unsure::Pending) => return self.full_check(now),
        };
        let mut differ = want.differ(&read.digest, &dirty);
        let store = &self.dp.store;
        differ.extend(self.programmed.small_maps_differ(
            store.read_meta().ok(),
            store.read_config().ok(),
            store.read_ranges().ok(),
        ));
        if differ.is_empty() {
            for (s, n) in self.left_out.iter_mut().enumerate() {
                *n = if dirty.has(s) { n.saturating_add(1) } else { 0 };
            }
            debug!(
                on_loop_ms = began.elapsed().as_millis() as u64,
                left_out = dirty.count(),
                "drift check: the maps are as programmed"
            );
            return self.checked(now, began, &read);
        }
        debug!(maps = ?differ, "drift check: the maps differ; reading them back in full");
        self.full_check(now);
    }

    /// A drift check found nothing to repair: what the full check's sync of every Service
    /// also did (`after_sync`: an attach that failed is tried again, the metrics of a full
    /// resync), and the checks of the maps the digest leaves to others, the per-Service
    /// counters from what the thread read.
    /// `began`: when the loop began its part, which the sync metrics record.
    fn checked(&mut self, now: Instant, began: Instant, read: &crate::store::Reading) {
        self.next_reconcile = now + self.upkeep.reconcile_every;
        self.after_sync(began, true, Scope::All);
        let began = Instant::now();
        let r = (self.dp.store).settle_service_stats(&read.stats_lacking, &read.stats_unnamed);
        self.service_stats_checked(r);
        self.check_node_addr_bits();
        self.check_flow_addrs(true);
        debug!(
            ms = began.elapsed().as_millis() as u64,
            "drift check: the counters, the address filter and the flows' addresses"
        );
    }

    /// The full drift check, on the loop (`reconcile`).
    fn full_check(&mut self, now: Instant) {
        self.left_out.iter_mut().for_each(|n| *n = 0);
        self.unretried = false;
        self.next_reconcile = now + self.upkeep.reconcile_every;
        self.reconcile(now);
        self.check_flow_addrs(true);
    }

    /// Reads the maps back, compares them with what should be there, and repairs the
    /// difference. Returns how many entries were wrong.
    #[instrument(skip(self))]
    pub fn reconcile(&mut self, now: Instant) -> usize {
        let began = Instant::now();
        let snap = match self.dp.store.snapshot() {
            Ok(s) => s,
            Err(e) => {
                self.metrics.report("reading the maps back", &e);
                return 0;
            }
        };
        // The old mirror goes before the new one is built: at 100,000 Services of 10
        // endpoints both at once, with the snapshot, were the agent's peak: 633 MB of heap
        // against 331 MB after the first sync (docs/benchmarks.md, "The agent's heap").
        let capacity = self.programmed.capacity;
        let mut old = std::mem::replace(
            &mut self.programmed,
            Programmed::empty(capacity, self.upkeep.grace),
        );
        let (retiring, settings, roomless, ids) = (
            std::mem::take(&mut old.retiring),
            old.maglev.settings,
            std::mem::take(&mut old.maglev.roomless),
            old.ids,
        );
        drop(old);
        let read = began.elapsed();
        let mut fresh = Programmed::recover(&snap, capacity, self.upkeep.grace, retiring);
        drop(snap);
        let recovered = began.elapsed();
        fresh.maglev.settings = settings;
        fresh.maglev.roomless = roomless;
        // Ids already handed out stay spent even if nothing in the maps carries them.
        fresh.ids.next_frontend = fresh.ids.next_frontend.max(ids.next_frontend);
        fresh.ids.next_backend = fresh.ids.next_backend.max(ids.next_backend);
        self.programmed = fresh;
        let report =
            self.programmed
                .apply_scoped(&mut self.dp.store, &self.desired.state, Scope::All, now);
        let drift = report.strays_deleted + report.frontends_written + report.frontends_removed;
        debug!(
            read_ms = read.as_millis() as u64,
            recover_ms = (recovered - read).as_millis() as u64,
            sync_ms = (began.elapsed() - recovered).as_millis() as u64,
            "drift check"
        );
        if report.ops > 0 {
            warn!(
                strays = report.strays_deleted,
                rewritten = report.frontends_written,
                removed = report.frontends_removed,
                ops = report.ops,
                "the maps had drifted from what was programmed; repaired"
            );
            self.metrics.drift(report.ops);
        }
        self.finish(report, now, None, Scope::All);
        self.check_service_stats();
        drift + self.check_node_addr_bits()
    }

    /// Makes a slice of the per-Service counters a bulk write left to make (store's
    /// `stats_pending`): slices of 250 (about 3.5 ms on a 2-core machine at 100,000 Services
    /// with layout 1's per-CPU entries; layout 2's not measured),
    /// each followed by 2 ms in which the loop takes the events that came meanwhile; after an
    /// ENOMEM the next slice waits for the kernel's allocator to refill. The pause counts from the
    /// slice's end: from its start (as `tick`'s `now`), a slice longer than the pause made
    /// the next one due at once, and an event waited for several.
    fn make_pending_stats(&mut self) {
        const SLICE: usize = 250;
        let started = Instant::now();
        let r = self.dp.store.create_pending_stats(SLICE);
        let ended = Instant::now();
        debug!(
            ms = (ended - started).as_secs_f64() * 1e3,
            result = ?r.as_ref().ok(),
            "per-Service counters, a slice"
        );
        let pause = match r {
            Ok((made, enomem)) => {
                self.stats_made += made;
                // Not when the ids had no names left (Services deleted meanwhile): the
                // slice then made nothing, and failed at nothing.
                Duration::from_millis(if enomem { 200 } else { 2 })
            }
            Err(e) => {
                self.metrics.report("making the per-Service counters", &e);
                self.upkeep.check_every
            }
        };
        self.next_stats = ended + pause;
        if self.dp.store.stats_pending.is_empty() {
            info!(
                frontends = self.stats_made,
                "per-Service counters made for the frontends written without them"
            );
            self.stats_made = 0;
        }
    }

    /// Creates the per-Service counters a named frontend lacks (a write that failed, an
    /// entry deleted behind the agent's back) and deletes those of ids without a name.
    fn check_service_stats(&mut self) {
        let r = self.dp.store.sync_service_stats();
        self.service_stats_checked(r);
    }

    fn service_stats_checked(&mut self, r: Result<(usize, usize)>) {
        match r {
            Ok((0, 0)) => {}
            Ok((created, deleted)) => {
                info!(created, deleted, "per-Service counters brought in line");
            }
            Err(e) => self.metrics.report("checking the per-Service counters", &e),
        }
    }

    /// Puts back bits of the filter in front of NODE_ADDRS that someone cleared: without its
    /// bit an address is none of the node's or frontends' to the datapath (its flows and
    /// NodePorts pass untranslated, SNAT to it fails, sockets' NodePort connects to it are
    /// not translated). Returns how many words lacked one.
    fn check_node_addr_bits(&mut self) -> usize {
        let clear = self.dp.is_attached();
        match self.dp.store.sync_node_addr_bits(clear) {
            Ok(0) => 0,
            Ok(n) => {
                self.metrics.drift(n);
                warn!(
                    words = n,
                    "the filter in front of NODE_ADDRS had lost addresses' bits; put back"
                );
                n
            }
            Err(e) => {
                self.metrics
                    .report("checking the filter in front of NODE_ADDRS", &e);
                0
            }
        }
    }
}
