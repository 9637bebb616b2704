//! Prometheus metrics and a kube-proxy compatible `/healthz`, served over plain HTTP.
//!
//! As kube-proxy, two listeners: the health port (`--healthz-bind-address`, 0.0.0.0:10256 by
//! default, reachable by the kubelet and load balancers) answers only `/healthz` and `/livez`;
//! `/metrics`, which tells how many Services and backends the node has and what failed, is
//! only on the metrics port (`--metrics-bind-address`, 127.0.0.1:10249 by default), which
//! answers the health paths too.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyper::{Method, StatusCode};
use k8s_openapi::jiff::Timestamp;
use tokio::net::TcpListener;
use tracing::debug;

use crate::error::Error;
use crate::http::{Answer, ConnLimit};

/// Seconds; from a fast incremental sync to a slow cold start.
const SYNC_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Seconds; kube-proxy's network programming latency is measured on the same scale.
const LAG_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug)]
struct Inner {
    syncs: u64,
    sync_seconds: Histogram,
    event_lag_seconds: Histogram,
    programming_seconds: Histogram,
    errors: BTreeMap<&'static str, u64>,
    frontends: usize,
    backends: usize,
    cluster_ips: usize,
    /// Map name to (entries the agent wrote, capacity).
    maps: BTreeMap<&'static str, (usize, u32)>,
    last_synced: Option<Timestamp>,
    /// Since when a change has waited to be programmed.
    queued_since: Option<Instant>,
    /// Since when a change has waited for a sync at all (one that failed included): whether
    /// the loop keeps up, for the health check node ports.
    unsynced_since: Option<Instant>,
    /// Services that could not be programmed (left as they were), retried with backoff.
    failing: Vec<String>,
    /// Service ports not served (SCTP): named on /healthz without failing it.
    unserved: Vec<String>,
    node_failing: bool,
    /// Entries waiting out their grace period before deletion.
    retiring: usize,
    attached: bool,
    /// Pins or links put back after someone removed them, by what.
    repairs: BTreeMap<&'static str, u64>,
    /// The last repair attempt left the datapath incomplete.
    datapath_broken: bool,
    /// Map entries rewritten because the maps differed from what was programmed.
    drift_ops: u64,
    /// The sync loop's last turn.
    alive: Option<Instant>,
    /// Connection-tracking sweeps run, the entries they removed, and their time.
    sweeps: u64,
    swept: u64,
    sweep_seconds: f64,
    /// Live SNATed flows per device their backend is routed through, for devices without
    /// svc's programs (their replies come back untranslated), as the last drift check found.
    unmanaged: BTreeMap<String, u64>,
    /// Why SNAT is off (`PacketConfig::snat_degraded`).
    snat_degraded: Option<String>,
}

/// "a, b, c, d, e, ...": the first five of `names`, for a /healthz problem.
fn first_five(names: &[String]) -> String {
    let mut out = names.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        out.push_str(", ...");
    }
    out
}

/// Shared between the sync loop, which records, and the HTTP server, which reads.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
    /// Where the per-CPU decision counters are pinned.
    bpffs: PathBuf,
    /// A queued change older than this makes /healthz fail, as kube-proxy's healthTimeout.
    health_timeout: Duration,
    /// The connections of every HTTP server of the agent.
    pub conns: Arc<ConnLimit>,
}

/// What /healthz says.
#[derive(Debug)]
pub struct Health {
    pub ok: bool,
    pub last_synced: Option<Timestamp>,
    pub problems: Vec<String>,
}

/// What the sync loop reports after a sync.
#[derive(Debug, Default, Clone)]
pub struct Programmed {
    pub frontends: usize,
    pub backends: usize,
    pub cluster_ips: usize,
    pub maps: Vec<(&'static str, usize, u32)>,
    /// Services that could not be programmed.
    pub failing: Vec<String>,
    pub retiring: usize,
    pub attached: bool,
    /// The node's addresses (SVC_NODE_ADDRS) or datapath settings could not all be written;
    /// retried with backoff.
    pub node_failing: bool,
    /// Service ports svc does not serve (SCTP), "namespace/name:port 3868/SCTP".
    pub unserved: Vec<String>,
}

impl Metrics {
    pub fn new(bpffs: PathBuf, health_timeout: Duration) -> Arc<Metrics> {
        Arc::new(Metrics {
            inner: Mutex::new(Inner {
                syncs: 0,
                sync_seconds: Histogram::new(SYNC_BUCKETS),
                event_lag_seconds: Histogram::new(LAG_BUCKETS),
                programming_seconds: Histogram::new(LAG_BUCKETS),
                errors: BTreeMap::new(),
                frontends: 0,
                backends: 0,
                cluster_ips: 0,
                maps: BTreeMap::new(),
                last_synced: None,
                queued_since: None,
                unsynced_since: None,
                failing: Vec::new(),
                unserved: Vec::new(),
                node_failing: false,
                retiring: 0,
                attached: false,
                repairs: BTreeMap::new(),
                datapath_broken: false,
                drift_ops: 0,
                alive: None,
                sweeps: 0,
                swept: 0,
                sweep_seconds: 0.0,
                snat_degraded: None,
                unmanaged: BTreeMap::new(),
            }),
            bpffs,
            health_timeout,
            conns: Arc::new(ConnLimit::for_this_process()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere must not take the metrics down with it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn error(&self, e: &Error) {
        *self.lock().errors.entry(e.kind()).or_default() += 1;
    }

    /// A connection-tracking sweep removed `removed` entries in `took`.
    pub fn swept(&self, removed: u32, took: Duration) {
        let mut i = self.lock();
        i.sweeps += 1;
        i.swept += u64::from(removed);
        i.sweep_seconds += took.as_secs_f64();
    }

    pub fn error_kind(&self, kind: &'static str) {
        *self.lock().errors.entry(kind).or_default() += 1;
    }

    pub fn errors_total(&self) -> u64 {
        self.lock().errors.values().sum()
    }

    /// A change arrived that is not programmed yet.
    pub fn queued(&self) {
        let mut i = self.lock();
        i.queued_since.get_or_insert_with(Instant::now);
        i.unsynced_since.get_or_insert_with(Instant::now);
    }

    pub fn synced(&self, took: Duration, state: Programmed) {
        let mut i = self.lock();
        i.syncs += 1;
        i.sync_seconds.observe(took.as_secs_f64());
        i.last_synced = Some(Timestamp::now());
        i.unsynced_since = None;
        // A change that failed has not landed: it keeps waiting.
        if state.failing.is_empty() {
            i.queued_since = None;
        }
        drop(i);
        self.state(state);
    }

    /// What is programmed now (after a sync or upkeep).
    pub fn state(&self, state: Programmed) {
        let mut i = self.lock();
        i.frontends = state.frontends;
        i.backends = state.backends;
        i.cluster_ips = state.cluster_ips;
        for (name, used, cap) in state.maps {
            i.maps.insert(name, (used, cap));
        }
        i.failing = state.failing;
        i.unserved = state.unserved;
        i.node_failing = state.node_failing;
        i.retiring = state.retiring;
        i.attached = state.attached;
    }

    /// The sync loop took a turn.
    pub fn alive(&self) {
        self.lock().alive = Some(Instant::now());
    }

    pub fn repaired(&self, what: &'static str) {
        *self.lock().repairs.entry(what).or_default() += 1;
    }

    /// SNAT is off, for this reason (None: on). A problem of /healthz, which load balancers
    /// of externalTrafficPolicy Cluster Services probe: this node cannot forward to remote
    /// backends. Not of the health check node ports, whose Services go to local endpoints only.
    pub fn snat_degraded(&self, why: Option<String>) {
        self.lock().snat_degraded = why;
    }

    pub fn datapath_broken(&self, broken: bool) {
        self.lock().datapath_broken = broken;
    }

    /// The devices without svc's programs that live SNATed flows leave by, with their flows.
    pub fn unmanaged_devices(&self, flows: BTreeMap<String, u64>) {
        self.lock().unmanaged = flows;
    }

    pub fn drift(&self, ops: usize) {
        self.lock().drift_ops += ops as u64;
    }

    /// From the agent receiving an event to the datapath reflecting it.
    pub fn event_lag(&self, d: Duration) {
        self.lock().event_lag_seconds.observe(d.as_secs_f64());
    }

    /// From the change in the cluster (EndpointSlice's last-change-trigger-time) to the
    /// datapath reflecting it: kube-proxy's network programming latency.
    pub fn programming_latency(&self, d: Duration) {
        self.lock().programming_seconds.observe(d.as_secs_f64());
    }

    /// kube-proxy's rule: healthy unless a change has waited longer than the timeout, and
    /// never before the first sync; and healthy means the datapath matches the source, so
    /// also not while a Service cannot be programmed or the datapath is not attached whole.
    pub fn health(&self) -> Health {
        let i = self.lock();
        let waiting_too_long = i
            .queued_since
            .is_some_and(|t| t.elapsed() > self.health_timeout);
        let mut problems = Vec::new();
        if i.last_synced.is_none() {
            problems.push("not synced yet".to_string());
        }
        if waiting_too_long {
            problems.push(format!(
                "a change has waited more than {}s",
                self.health_timeout.as_secs()
            ));
        }
        if !i.failing.is_empty() {
            problems.push(format!(
                "{} Services cannot be programmed: {}",
                i.failing.len(),
                first_five(&i.failing)
            ));
        }
        if i.node_failing {
            problems.push("the node's addresses cannot all be programmed (SVC_NODE_ADDRS)".into());
        }
        if i.last_synced.is_some() && !i.attached {
            problems.push("programs not attached".into());
        }
        if i.datapath_broken {
            problems.push("pins or links missing and not repaired".into());
        }
        if let Some(why) = &i.snat_degraded {
            problems.push(why.clone());
        }
        // Named, but no failure: every node lacks SCTP alike, so a 503 would have load
        // balancers drain every node, and the TCP and UDP Services with it; the agent itself
        // is in sync (kube-proxy's /healthz says that much and no more).
        let ok = problems.is_empty();
        if !i.unserved.is_empty() {
            problems.push(format!(
                "{} Service ports not served (svc does not serve SCTP): {}",
                i.unserved.len(),
                first_five(&i.unserved)
            ));
        }
        // Listed, but no failure: the node serves every other flow, and draining it would
        // not bring these flows' replies back.
        for (device, flows) in &i.unmanaged {
            problems.push(format!(
                "{flows} flows to remote backends leave by {device}, which has no svc programs: their replies return untranslated (add it to --devices)"
            ));
        }
        Health {
            ok,
            last_synced: i.last_synced,
            problems,
        }
    }

    /// serviceProxyHealthy of Service `owner`'s health check node port: the proxy keeps up and
    /// its datapath is attached whole, the node's addresses are programmed, and this Service
    /// is. Another Service that
    /// cannot be programmed does not count: every node fails it alike, and /healthz's rule
    /// would have every load balancer drain every node of every Service.
    pub fn service_healthy(&self, owner: &str) -> bool {
        let i = self.lock();
        let keeps_up = i
            .unsynced_since
            .is_none_or(|t| t.elapsed() <= self.health_timeout);
        i.last_synced.is_some()
            && keeps_up
            && i.attached
            && !i.datapath_broken
            && !i.node_failing
            && !i.failing.iter().any(|f| f == owner)
    }

    /// Whether the agent's loop still turns (for /livez): a stuck loop is worth a restart, a
    /// Service that does not fit is not.
    pub fn live(&self) -> bool {
        let i = self.lock();
        i.alive
            .is_none_or(|t| t.elapsed() <= self.health_timeout.max(Duration::from_secs(10)))
    }

    pub fn healthy(&self) -> (bool, Option<Timestamp>) {
        let h = self.health();
        (h.ok, h.last_synced)
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        {
            let i = self.lock();
            let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            };
            gauge(
                &mut out,
                "svc_frontends_programmed",
                "Service frontends (ClusterIP, port, protocol) in the datapath.",
                i.frontends,
            );
            gauge(
                &mut out,
                "svc_backends_programmed",
                "Distinct backends (IP, port, protocol) in the datapath.",
                i.backends,
            );
            gauge(
                &mut out,
                "svc_cluster_ips_programmed",
                "ClusterIPs known to the datapath.",
                i.cluster_ips,
            );
            let _ = writeln!(out, "# HELP svc_syncs_total Syncs of the datapath maps.\n# TYPE svc_syncs_total counter\nsvc_syncs_total {}", i.syncs);
            i.sync_seconds.render(
                &mut out,
                "svc_sync_duration_seconds",
                "Seconds to translate and write one sync.",
            );
            i.event_lag_seconds.render(
                &mut out,
                "svc_event_to_datapath_seconds",
                "Seconds from receiving an API event to the datapath reflecting it.",
            );
            i.programming_seconds.render(
                &mut out,
                "svc_network_programming_duration_seconds",
                "Seconds from an EndpointSlice's last-change-trigger-time to the datapath reflecting it.",
            );
            let _ = writeln!(out, "# HELP svc_errors_total Objects skipped and operations failed, by kind.\n# TYPE svc_errors_total counter");
            for (k, v) in &i.errors {
                let _ = writeln!(out, "svc_errors_total{{kind=\"{k}\"}} {v}");
            }
            let _ = writeln!(out, "# HELP svc_map_entries Entries the agent keeps in each map.\n# TYPE svc_map_entries gauge");
            for (m, (used, _)) in &i.maps {
                let _ = writeln!(out, "svc_map_entries{{map=\"{m}\"}} {used}");
            }
            let _ = writeln!(
                out,
                "# HELP svc_map_capacity max_entries of each map.\n# TYPE svc_map_capacity gauge"
            );
            for (m, (_, cap)) in &i.maps {
                let _ = writeln!(out, "svc_map_capacity{{map=\"{m}\"}} {cap}");
            }
            gauge(
                &mut out,
                "svc_services_failing",
                "Services that could not be programmed and are retried with backoff.",
                i.failing.len(),
            );
            let _ = writeln!(
                out,
                "# HELP svc_service_ports_not_served Service ports svc does not serve, by protocol.\n\
                 # TYPE svc_service_ports_not_served gauge\n\
                 svc_service_ports_not_served{{protocol=\"SCTP\"}} {}",
                i.unserved.len()
            );
            gauge(
                &mut out,
                "svc_entries_retiring",
                "Entries made unreachable, deleted after their grace period.",
                i.retiring,
            );
            gauge(
                &mut out,
                "svc_datapath_attached",
                "1 when the programs are attached.",
                usize::from(i.attached),
            );
            gauge(
                &mut out,
                "svc_snat_degraded",
                "1 when SNAT to remote backends is off because its port range could not be reserved.",
                usize::from(i.snat_degraded.is_some()),
            );
            let c = self.conns.counts();
            gauge(
                &mut out,
                "svc_http_connections",
                "Connections to the agent's HTTP servers that wait for their request.",
                c.open,
            );
            gauge(
                &mut out,
                "svc_http_connections_max",
                "The most connections the HTTP servers keep waiting for a request.",
                self.conns.cap,
            );
            let _ = writeln!(out, "# HELP svc_http_connections_evicted_total Connections the HTTP servers closed unanswered to make room or free file descriptors.\n# TYPE svc_http_connections_evicted_total counter\nsvc_http_connections_evicted_total {}", c.evicted);
            let _ = writeln!(out, "# HELP svc_datapath_repairs_total Pins or links found missing and put back.\n# TYPE svc_datapath_repairs_total counter");
            for (k, v) in &i.repairs {
                let _ = writeln!(out, "svc_datapath_repairs_total{{what=\"{k}\"}} {v}");
            }
            let _ = writeln!(out, "# HELP svc_conntrack_sweeps_total Sweeps of the connection-tracking tables for dead flows.\n# TYPE svc_conntrack_sweeps_total counter\nsvc_conntrack_sweeps_total {}", i.sweeps);
            let _ = writeln!(out, "# HELP svc_conntrack_swept_entries_total Connection-tracking entries of dead flows that the sweeps removed.\n# TYPE svc_conntrack_swept_entries_total counter\nsvc_conntrack_swept_entries_total {}", i.swept);
            let _ = writeln!(out, "# HELP svc_conntrack_sweep_seconds_total Seconds the sweeps' program ran, as the kernel measured it.\n# TYPE svc_conntrack_sweep_seconds_total counter\nsvc_conntrack_sweep_seconds_total {}", i.sweep_seconds);
            let _ = writeln!(out, "# HELP svc_flows_via_unmanaged_device Live SNATed flows routed out of a device without svc's programs, by device, at the last drift check.\n# TYPE svc_flows_via_unmanaged_device gauge");
            for (device, flows) in &i.unmanaged {
                let _ = writeln!(
                    out,
                    "svc_flows_via_unmanaged_device{{device=\"{device}\"}} {flows}"
                );
            }
            let _ = writeln!(out, "# HELP svc_drift_repaired_ops_total Map writes that repaired a difference between the maps and what was programmed.\n# TYPE svc_drift_repaired_ops_total counter\nsvc_drift_repaired_ops_total {}", i.drift_ops);
        }
        match crate::datapath::read_stats(&self.bpffs) {
            Ok(stats) => {
                let _ = writeln!(out, "# HELP svc_datapath_decisions_total Decisions of the socket programs, by reason.\n# TYPE svc_datapath_decisions_total counter");
                for (name, v) in stats {
                    let _ = writeln!(out, "svc_datapath_decisions_total{{reason=\"{name}\"}} {v}");
                }
            }
            Err(e) => debug!("datapath counters unavailable: {e}"),
        }
        match crate::datapath::read_packet_stats(&self.bpffs) {
            Ok(p) => render_packet(&mut out, &p),
            Err(e) => debug!("packet datapath counters unavailable: {e}"),
        }
        out
    }
}

/// The packet datapath's counters per device (by name in the agent's network namespace,
/// the ifindex when the device is gone) and its connection tracking.
fn render_packet(out: &mut String, p: &crate::datapath::PacketStats) {
    let _ = writeln!(out, "# HELP svc_packet_decisions_total Decisions of the tc programs, by device and reason (drops and rejects included).\n# TYPE svc_packet_decisions_total counter");
    for (ifindex, reason, v) in &p.devices {
        let device = crate::netdev::ifname(*ifindex).unwrap_or_else(|| ifindex.to_string());
        let _ = writeln!(
            out,
            "svc_packet_decisions_total{{device=\"{device}\",reason=\"{reason}\"}} {v}"
        );
    }
    let _ = writeln!(out, "# HELP svc_conntrack_entries Entries in the assured flows' connection-tracking table.\n# TYPE svc_conntrack_entries gauge\nsvc_conntrack_entries {}", p.ct_entries);
    let _ = writeln!(out, "# HELP svc_conntrack_capacity max_entries of the assured flows' connection-tracking table (--max-ct).\n# TYPE svc_conntrack_capacity gauge\nsvc_conntrack_capacity {}", p.ct_capacity);
    let _ = writeln!(out, "# HELP svc_conntrack_unassured_entries Entries in the unassured flows' connection-tracking table.\n# TYPE svc_conntrack_unassured_entries gauge\nsvc_conntrack_unassured_entries {}", p.ct_new_entries);
    let _ = writeln!(out, "# HELP svc_conntrack_unassured_capacity max_entries of the unassured flows' table.\n# TYPE svc_conntrack_unassured_capacity gauge\nsvc_conntrack_unassured_capacity {}", p.ct_new_capacity);
    let _ = writeln!(out, "# HELP svc_conntrack_flows Live flows tracked, by whether they are SNATed.\n# TYPE svc_conntrack_flows gauge\nsvc_conntrack_flows{{snat=\"true\"}} {}\nsvc_conntrack_flows{{snat=\"false\"}} {}", p.snat_flows, p.flows - p.snat_flows);
    let _ = writeln!(out, "# HELP svc_snat_ports_in_use_max The most SNAT ports one node address holds towards one backend for live flows.\n# TYPE svc_snat_ports_in_use_max gauge\nsvc_snat_ports_in_use_max {}", p.snat_ports_max);
}

/// Which paths a listener answers; every other path is 404 there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// `/healthz` and `/livez`.
    Health,
    /// `/metrics`, `/healthz` and `/livez`.
    Metrics,
}

impl Port {
    /// For the log line that says what is served where.
    pub fn paths(self) -> &'static str {
        match self {
            Port::Health => "/healthz /livez",
            Port::Metrics => "/metrics /healthz /livez",
        }
    }
}

fn answer(metrics: &Metrics, port: Port, path: &str) -> Answer {
    match path {
        "/metrics" if port == Port::Metrics => Answer::new(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(),
        ),
        "/healthz" | "/livez" => {
            let h = metrics.health();
            let ok = if path == "/livez" {
                metrics.live()
            } else {
                h.ok
            };
            let last = h.last_synced.map(|t| t.to_string()).unwrap_or_default();
            let body = format!(
                "{{\"lastUpdated\": \"{last}\",\"currentTime\": \"{}\",\"nodeEligible\": true,\"problems\": {}}}",
                Timestamp::now(),
                serde_json::to_string(&h.problems).unwrap_or_else(|_| "[]".into())
            );
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            Answer::new(status, "application/json", body)
        }
        _ => Answer::new(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

pub use crate::http::bind;

/// Serves /metrics and /healthz until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, port: Port) {
    let conns = metrics.conns.clone();
    let what = format!("the {port:?} port");
    crate::http::serve(Arc::new(listener), conns, what, move |method, path, _| {
        let metrics = metrics.clone();
        async move {
            if method != Method::GET {
                return Answer::new(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
            }
            // Off the runtime's one thread: a scrape walks the connection-tracking map (tens
            // of ms when full), which must not hold up the sync.
            tokio::task::spawn_blocking(move || answer(&metrics, port, &path))
                .await
                .unwrap_or_else(|e| {
                    Answer::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        format!("{e}\n"),
                    )
                })
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a client of `port` asking for `path` reads: status line, then the body.
    fn got(m: &Metrics, port: Port, path: &str) -> String {
        let a = answer(m, port, path);
        format!("HTTP/1.1 {}\r\n\r\n{}", a.status, a.body)
    }

    #[test]
    fn healthz_fails_before_the_first_sync_and_when_a_change_waits_too_long() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_millis(20));
        assert!(!m.healthy().0);
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        assert!(m.healthy().0);
        m.queued();
        std::thread::sleep(Duration::from_millis(30));
        assert!(!m.healthy().0);
        assert!(got(&m, Port::Health, "/healthz").starts_with("HTTP/1.1 503"));
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        assert!(got(&m, Port::Health, "/healthz").starts_with("HTTP/1.1 200"));
        // A Service that cannot be programmed makes the node unhealthy at once, and says
        // which; /livez stays up (a restart would not help).
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                failing: vec!["ns/big".into()],
                ..Default::default()
            },
        );
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("ns/big"), "{reply}");
        assert!(got(&m, Port::Health, "/livez").starts_with("HTTP/1.1 200"));
    }

    /// Node addresses that cannot be written leave NodePorts unanswered on this node: /healthz
    /// says so, and every health check node port says unhealthy (a load balancer should send
    /// its traffic elsewhere), until a retry writes them.
    #[test]
    fn node_addresses_that_cannot_be_programmed_are_a_health_problem() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        let state = |node_failing| Programmed {
            attached: true,
            node_failing,
            ..Default::default()
        };
        m.synced(Duration::from_millis(1), state(true));
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("SVC_NODE_ADDRS"), "{reply}");
        assert!(!m.service_healthy("shop/web"));
        m.synced(Duration::from_millis(1), state(false));
        assert!(got(&m, Port::Health, "/healthz").starts_with("HTTP/1.1 200"));
        assert!(m.service_healthy("shop/web"));
    }

    /// Issue 33, item 12: SCTP ports that svc does not serve are named on /healthz and counted
    /// in /metrics, and the node stays healthy: a 503 would drain it of every Service.
    #[test]
    fn sctp_ports_not_served_are_named_on_healthz_which_stays_200() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                unserved: vec!["demo/diameter:dia 3868/SCTP".into()],
                ..Default::default()
            },
        );
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(
            reply.contains(
                "\"1 Service ports not served (svc does not serve SCTP): \
                 demo/diameter:dia 3868/SCTP\""
            ),
            "{reply}"
        );
        assert!(m.service_healthy("demo/diameter"));
        let metrics = got(&m, Port::Metrics, "/metrics");
        assert!(
            metrics.contains("\nsvc_service_ports_not_served{protocol=\"SCTP\"} 1\n"),
            "{metrics}"
        );
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        assert!(!got(&m, Port::Health, "/healthz").contains("SCTP"));
    }

    /// Flows leaving by a device without svc's programs are a gauge per device and a line of
    /// /healthz, which stays 200: the node serves every other flow.
    #[test]
    fn flows_via_an_unmanaged_device_are_counted_and_listed_without_failing_health() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        m.unmanaged_devices(BTreeMap::from([("eth1".to_string(), 2)]));
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(
            reply.contains("leave by eth1") && reply.contains("--devices"),
            "{reply}"
        );
        let text = m.render();
        assert!(
            text.contains("svc_flows_via_unmanaged_device{device=\"eth1\"} 2"),
            "{text}"
        );
        m.unmanaged_devices(BTreeMap::new());
        assert!(!got(&m, Port::Health, "/healthz").contains("eth1"));
        assert!(!m.render().contains("device=\"eth1\""));
    }

    #[test]
    fn the_health_port_answers_health_only_and_the_metrics_port_everything() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        let status = |port, path| got(&m, port, path)[..12].to_string();
        for path in ["/healthz", "/livez"] {
            assert_eq!(status(Port::Health, path), "HTTP/1.1 200", "{path}");
            assert_eq!(status(Port::Metrics, path), "HTTP/1.1 200", "{path}");
        }
        assert_eq!(status(Port::Health, "/metrics"), "HTTP/1.1 404");
        let metrics = got(&m, Port::Metrics, "/metrics");
        assert!(metrics.starts_with("HTTP/1.1 200"));
        assert!(metrics.contains("svc_frontends_programmed 0"));
        assert_eq!(status(Port::Metrics, "/debug/pprof"), "HTTP/1.1 404");
    }

    /// Through a real socket: what a client of each listener gets.
    #[tokio::test]
    async fn serve_keeps_metrics_off_the_health_listener() {
        use std::net::SocketAddr;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        let get = |addr: SocketAddr, path: &'static str| async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut reply = String::new();
            c.read_to_string(&mut reply).await.unwrap();
            reply[..12].to_string()
        };
        let mut addrs = Vec::new();
        for port in [Port::Health, Port::Metrics] {
            let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            addrs.push(listener.local_addr().unwrap());
            tokio::spawn(serve(listener, m.clone(), port));
        }
        let (health, metrics) = (addrs[0], addrs[1]);
        assert_eq!(get(health, "/healthz").await, "HTTP/1.1 200");
        assert_eq!(get(health, "/metrics").await, "HTTP/1.1 404");
        assert_eq!(get(metrics, "/metrics").await, "HTTP/1.1 200");
        assert_eq!(get(metrics, "/healthz").await, "HTTP/1.1 200");
    }

    #[test]
    fn metrics_render_histograms_and_errors() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.synced(
            Duration::from_millis(3),
            Programmed {
                frontends: 2,
                backends: 3,
                cluster_ips: 1,
                maps: vec![("SVC_SERVICES", 3, 100)],
                ..Default::default()
            },
        );
        m.error_kind("manifest");
        let text = m.render();
        assert!(text.contains("svc_frontends_programmed 2"));
        assert!(text.contains("svc_sync_duration_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("svc_sync_duration_seconds_bucket{le=\"0.001\"} 0"));
        assert!(text.contains("svc_errors_total{kind=\"manifest\"} 1"));
        assert!(text.contains("svc_map_capacity{map=\"SVC_SERVICES\"} 100"));
    }

    /// SNAT off takes the node out of load balancers that probe /healthz (externalTrafficPolicy
    /// Cluster: it cannot reach remote backends), not out of those of health check node ports
    /// (Local: local endpoints only, no SNAT).
    #[test]
    fn snat_off_is_a_problem_of_healthz_alone() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.synced(
            Duration::from_millis(1),
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
        assert!(m.health().ok);
        assert!(m.render().contains("\nsvc_snat_degraded 0\n"));
        m.snat_degraded(Some("SNAT off: test".into()));
        let h = m.health();
        assert!(!h.ok);
        assert_eq!(h.problems, ["SNAT off: test"]);
        assert!(m.service_healthy("ns/web"));
        assert!(m.render().contains("\nsvc_snat_degraded 1\n"));
    }
}
