//! Prometheus metrics and a kube-proxy compatible `/healthz`, served over plain HTTP.
//!
//! As kube-proxy, two listeners: the health port (`--healthz-bind-address`, 0.0.0.0:10256 by
//! default, reachable by the kubelet and load balancers) answers only `/healthz` and `/livez`;
//! `/metrics`, which tells how many Services and backends the node has and what failed, is
//! only on the metrics port (`--metrics-bind-address`, 127.0.0.1:10249 by default), which
//! answers the health paths too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyper::{Method, StatusCode};
use k8s_openapi::jiff::Timestamp;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};
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

/// kube-proxy's sync duration buckets: ExponentialBuckets(0.001, 2, 15), 1 ms to 16.384 s.
fn kube_proxy_sync_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's network programming buckets: 0.25 s and 0.5 s, every second to 59 s, every 5 s
/// to 115 s, every 30 s from 2 to 5 minutes.
fn kube_proxy_programming_buckets() -> impl Iterator<Item = f64> {
    [0.25, 0.5]
        .into_iter()
        .chain((1..=59).map(f64::from))
        .chain((0..12).map(|i| f64::from(60 + 5 * i)))
        .chain((0..7).map(|i| f64::from(120 + 30 * i)))
}

/// One label's name and value.
type Label<V> = [(&'static str, V); 1];
type Labelled<M, V = &'static str> = Family<Label<V>, M>;

/// The metrics the agent records, registered under their names in `registry` in the order
/// /metrics shows them; the datapath's own counters follow, read at each scrape
/// (`DatapathCounters`).
///
/// prometheus-client appends `_total` to a counter's name and a full stop to each HELP text:
/// the names below are those of /metrics less `_total`, the texts without their stop.
#[derive(Debug)]
struct Recorded {
    registry: Registry,
    frontends: Gauge,
    backends: Gauge,
    cluster_ips: Gauge,
    syncs: Counter,
    sync_seconds: Histogram,
    event_lag_seconds: Histogram,
    programming_seconds: Histogram,
    errors: Labelled<Counter>,
    map_entries: Labelled<Gauge>,
    map_capacity: Labelled<Gauge>,
    failing: Gauge,
    unserved: Labelled<Gauge>,
    retiring: Gauge,
    attached: Gauge,
    snat_degraded: Gauge,
    http_open: Gauge,
    http_max: Gauge,
    /// `ConnLimit`'s own, kept here for the order of registration.
    _http_evicted: Counter,
    repairs: Labelled<Counter>,
    sweeps: Counter,
    swept: Counter,
    sweep_seconds: Counter<f64, AtomicU64>,
    unmanaged: Labelled<Gauge, String>,
    tc_attached: Family<[(&'static str, String); 3], Gauge>,
    drift_ops: Counter,
    kube_proxy: KubeProxy,
    snat_ports: Gauge,
    maglev_table_bytes: Gauge,
    maglev_capacity_bytes: Gauge,
    maglev_frontends: Labelled<Gauge>,
    /// client-go's rest_client_* of the agent's Kubernetes client (`source::rest_client`).
    rest_client: crate::source::rest_client::RestClientMetrics,
}

/// Under kube-proxy's names (pkg/proxy/metrics), with its types and buckets, what svc measures
/// with the same meaning, so that kube-proxy's dashboards and alerts read svc. Without
/// kube-proxy's `ip_family` label: one sync programs both families.
#[derive(Debug)]
struct KubeProxy {
    sync_seconds: Histogram,
    full_sync_seconds: Histogram,
    partial_sync_seconds: Histogram,
    last_synced: Gauge<f64, AtomicU64>,
    last_queued: Gauge<f64, AtomicU64>,
    programming_seconds: Histogram,
    service_changes: Counter,
    endpoint_changes: Counter,
    services_pending: Gauge,
    endpoints_pending: Gauge,
    healthz: Labelled<Counter, String>,
    livez: Labelled<Counter, String>,
    no_local_endpoints: Labelled<Gauge>,
}

impl KubeProxy {
    fn new(r: &mut Registry) -> KubeProxy {
        let sync = |r: &mut Registry, name: &str, help: &str| {
            let h = Histogram::new(kube_proxy_sync_buckets());
            r.register(name, help, h.clone());
            h
        };
        KubeProxy {
            sync_seconds: sync(r, "kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds: svc_sync_duration_seconds, on kube-proxy's buckets"),
            full_sync_seconds: sync(r, "kubeproxy_sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs (every Service)"),
            partial_sync_seconds: sync(r, "kubeproxy_sync_partial_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for partial resyncs (the Services that changed)"),
            last_synced: add(r, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were synced, in seconds since the epoch"),
            last_queued: add(r, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "The last time a sync of proxy rules was queued, in seconds since the epoch"),
            programming_seconds: {
                let h = Histogram::new(kube_proxy_programming_buckets());
                r.register("kubeproxy_network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds: svc_network_programming_duration_seconds, on kube-proxy's buckets", h.clone());
                h
            },
            endpoint_changes: add(r, "kubeproxy_sync_proxy_rules_endpoint_changes", "Cumulative proxy rules Endpoint changes: EndpointSlice changes the proxy saw (from the API server; none from manifest files)"),
            service_changes: add(r, "kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes: Service changes the proxy saw (from the API server; none from manifest files)"),
            endpoints_pending: add(r, "kubeproxy_sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes: EndpointSlice changes not yet synced"),
            services_pending: add(r, "kubeproxy_sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes: Services with a change not yet synced"),
            healthz: add(r, "kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status: /healthz answers, by status code"),
            livez: add(r, "kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status: /livez answers, by status code"),
            // A gauge, whatever its name says, as kube-proxy's.
            no_local_endpoints: add(r, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", "Number of services with a Local traffic policy and no endpoints: Service ports (per address family) whose internal (traffic_policy=internal) or external (external) traffic policy is Local and that have no local endpoint while they have usable endpoints elsewhere"),
        }
    }
}

/// Now, in seconds since the epoch.
fn epoch_seconds() -> f64 {
    Timestamp::now().as_millisecond() as f64 / 1000.0
}

/// A new metric registered as `name`.
fn add<M: Metric + Clone + Default>(r: &mut Registry, name: &str, help: &str) -> M {
    let m = M::default();
    r.register(name, help, m.clone());
    m
}

/// A new histogram of `buckets` registered as `name`.
fn histogram(r: &mut Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::new(buckets.iter().copied());
    r.register(name, help, h.clone());
    h
}

impl Recorded {
    fn new(bpffs: PathBuf, conns: &ConnLimit) -> Recorded {
        let mut r = Registry::default();
        r.register_collector(Box::new(DatapathCounters { bpffs }));
        r.register_collector(Box::new(ProcessCollector));
        let recorded = Recorded {
            frontends: add(&mut r, "svc_frontends_programmed", "Service frontends (ClusterIP, port, protocol) in the datapath"),
            backends: add(&mut r, "svc_backends_programmed", "Distinct backends (IP, port, protocol) in the datapath"),
            cluster_ips: add(&mut r, "svc_cluster_ips_programmed", "ClusterIPs known to the datapath"),
            syncs: add(&mut r, "svc_syncs", "Syncs of the datapath maps"),
            sync_seconds: histogram(&mut r, "svc_sync_duration_seconds", "Seconds to translate and write one sync", SYNC_BUCKETS),
            event_lag_seconds: histogram(&mut r, "svc_event_to_datapath_seconds", "Seconds from receiving an API event to the datapath reflecting it", LAG_BUCKETS),
            programming_seconds: histogram(&mut r, "svc_network_programming_duration_seconds", "Seconds from an EndpointSlice's last-change-trigger-time to the datapath reflecting it", LAG_BUCKETS),
            errors: add(&mut r, "svc_errors", "Objects skipped and operations failed, by kind"),
            map_entries: add(&mut r, "svc_map_entries", "Entries the agent keeps in each map"),
            map_capacity: add(&mut r, "svc_map_capacity", "max_entries of each map"),
            failing: add(&mut r, "svc_services_failing", "Services that could not be programmed and are retried with backoff"),
            unserved: add(&mut r, "svc_service_ports_not_served", "Service ports svc does not serve, by protocol"),
            retiring: add(&mut r, "svc_entries_retiring", "Entries made unreachable, deleted after their grace period"),
            attached: add(&mut r, "svc_datapath_attached", "1 when the programs are attached"),
            snat_degraded: add(&mut r, "svc_snat_degraded", "1 when SNAT to remote backends is off because its port range could not be reserved"),
            http_open: add(&mut r, "svc_http_connections", "Connections to the agent's HTTP servers that wait for their request"),
            http_max: add(&mut r, "svc_http_connections_max", "The most connections the HTTP servers keep waiting for a request"),
            _http_evicted: {
                let c = conns.evicted.clone();
                r.register("svc_http_connections_evicted", "Connections the HTTP servers closed unanswered to make room or free file descriptors", c.clone());
                c
            },
            repairs: add(&mut r, "svc_datapath_repairs", "Pins or links found missing and put back"),
            sweeps: add(&mut r, "svc_conntrack_sweeps", "Sweeps of the connection-tracking tables for dead flows"),
            swept: add(&mut r, "svc_conntrack_swept_entries", "Connection-tracking entries of dead flows that the sweeps removed"),
            sweep_seconds: add(&mut r, "svc_conntrack_sweep_seconds", "Seconds the sweeps' program ran, as the kernel measured it"),
            unmanaged: add(&mut r, "svc_flows_via_unmanaged_device", "Live SNATed flows routed out of a device without svc's programs, by device, at the last drift check"),
            tc_attached: add(&mut r, "svc_tc_program_attached", "1 per tc program svc has on a device, by device, program and attach mode (tcx, or classic: a clsact qdisc's cls_bpf filter)"),
            drift_ops: add(&mut r, "svc_drift_repaired_ops", "Map writes that repaired a difference between the maps and what was programmed"),
            kube_proxy: KubeProxy::new(&mut r),
            snat_ports: add(&mut r, "svc_snat_ports", "Ports in the SNAT port range: what svc_snat_ports_in_use_max runs up against"),
            maglev_table_bytes: add(&mut r, "svc_maglev_table_bytes", "Bytes of Maglev table entries the current frontend generations use (2 an entry)"),
            maglev_capacity_bytes: add(&mut r, "svc_maglev_capacity_bytes", "Bytes of table entries SVC_MAGLEV has room for (--max-maglev-entries; allocated as tables are written)"),
            maglev_frontends: add(&mut r, "svc_maglev_frontends", "External frontends by Maglev table: maglev (has its table), none (wants one, found no room: random choice, tried again at each sync)"),
            rest_client: {
                let m = crate::source::rest_client::RestClientMetrics::default();
                m.register(&mut r);
                m
            },
            registry: r,
        };
        // Shown at 0 too: the one protocol svc does not serve.
        recorded
            .unserved
            .get_or_create(&[("protocol", "SCTP")])
            .set(0);
        recorded
    }
}

/// A count as a gauge's value.
fn int(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The datapath's own counters, read from their pinned maps at each scrape. Where they come
/// from is `read_datapath`'s alone; this encodes what it returns.
#[derive(Debug)]
struct DatapathCounters {
    bpffs: PathBuf,
}

/// The datapath's counters at one scrape: the socket programs' decisions, and the packet
/// datapath's (None where a map cannot be read, as before the first load).
struct DatapathCounts {
    decisions: Option<Vec<(&'static str, u64)>>,
    packet: Option<crate::datapath::PacketStats>,
    services: Vec<crate::datapath::ServiceCounts>,
}

fn read_datapath(bpffs: &Path) -> DatapathCounts {
    let decisions = crate::datapath::read_stats(bpffs)
        .map_err(|e| debug!("datapath counters unavailable: {e}"))
        .ok();
    let packet = crate::datapath::read_packet_stats(bpffs)
        .map_err(|e| debug!("packet datapath counters unavailable: {e}"))
        .ok();
    let services = crate::datapath::read_service_stats(bpffs)
        .map_err(|e| debug!("per-Service counters unavailable: {e}"))
        .unwrap_or_default();
    DatapathCounts {
        decisions,
        packet,
        services,
    }
}

/// The samples of `svc_service_decisions_total`: per Service port, each reason counted
/// (zeros left out, but for `translated`, so every Service port has a series without
/// multiplying them by the reasons). Labels borrowed from the names, one sample at a time as
/// it is encoded: at 100,000 Service ports, copies of them all were 20 MB more for each
/// scrape.
fn service_samples(
    services: &[crate::datapath::ServiceCounts],
) -> impl Iterator<Item = ([(&'static str, &str); 4], ConstCounter)> {
    services.iter().flat_map(|s| {
        (svc_common::Reason::SERVICE.iter().zip(&s.counts))
            .filter(|(reason, n)| **n != 0 || **reason == svc_common::Reason::Translated)
            .map(move |(reason, &n)| {
                let (namespace, service, port) = s.parts();
                (
                    [
                        ("namespace", namespace),
                        ("service", service),
                        ("port", port),
                        ("reason", reason.name()),
                    ],
                    ConstCounter::new(n),
                )
            })
    })
}

/// `value` under `name`, one sample per label set in `samples`.
fn encode_samples<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, M)>,
    metric_type: MetricType,
) -> std::fmt::Result {
    let mut e = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, m) in samples {
        m.encode(e.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The `process_*` metrics every Prometheus client library exports (the Go client's names
/// and meanings, which kube-proxy's dashboards read), from /proc at each scrape:
/// prometheus-client has no process collector.
#[derive(Debug)]
struct ProcessCollector;

/// What `ProcessCollector` reads: CPU seconds, resident and virtual bytes, start time (seconds
/// since the epoch), open file descriptors and their limit.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    start_time_seconds: f64,
    open_fds: u64,
    max_fds: u64,
}

impl ProcessStats {
    /// From the text of /proc/self/stat and /proc/stat's `btime`, with the clock's ticks per
    /// second and the page size.
    fn parse(stat: &str, proc_stat: &str, ticks: f64, page: u64) -> Option<ProcessStats> {
        // The command name may hold spaces and parentheses: fields follow the last ')'.
        let fields: Vec<&str> = stat
            .get(stat.rfind(')')? + 1..)?
            .split_whitespace()
            .collect();
        // Field n of proc_pid_stat(5) is fields[n - 3].
        let num = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
        let btime: u64 = proc_stat
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
        Some(ProcessStats {
            cpu_seconds: (num(14)? + num(15)?) as f64 / ticks,
            start_time_seconds: btime as f64 + num(22)? as f64 / ticks,
            virtual_bytes: num(23)?,
            resident_bytes: num(24)? * page,
            ..Default::default()
        })
    }

    fn read() -> Option<ProcessStats> {
        // The boot time does not change: /proc/stat (long on a node of many CPUs) is read once.
        static BTIME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let btime = BTIME
            .get_or_init(|| {
                let text = std::fs::read_to_string("/proc/stat").ok()?;
                text.lines()
                    .find(|l| l.starts_with("btime "))
                    .map(String::from)
            })
            .as_deref()?;
        // SAFETY: sysconf only reads a setting of the system.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let mut s = ProcessStats::parse(&stat, btime, ticks.max(1) as f64, page.max(1) as u64)?;
        s.open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        s.max_fds = crate::http::nofile_soft();
        Some(s)
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(s) = ProcessStats::read() else {
            return Ok(());
        };
        let e = &mut encoder;
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(e.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            None,
            cpu.metric_type(),
        )?)?;
        encode_gauge(
            e,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            s.resident_bytes,
        )?;
        encode_gauge(
            e,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            s.virtual_bytes,
        )?;
        let start = ConstGauge::new(s.start_time_seconds);
        start.encode(e.encode_descriptor(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            None,
            start.metric_type(),
        )?)?;
        encode_gauge(
            e,
            "process_open_fds",
            "Number of open file descriptors.",
            s.open_fds,
        )?;
        encode_gauge(
            e,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            s.max_fds,
        )
    }
}

/// One unlabelled gauge.
fn encode_gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: u64,
) -> std::fmt::Result {
    let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for DatapathCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let counts = read_datapath(&self.bpffs);
        let e = &mut encoder;
        if let Some(decisions) = counts.decisions {
            encode_samples(
                e,
                "svc_datapath_decisions",
                "Decisions of the socket programs, by reason.",
                decisions
                    .into_iter()
                    .map(|(reason, v)| ([("reason", reason)], ConstCounter::new(v))),
                MetricType::Counter,
            )?;
        }
        if !counts.services.is_empty() {
            encode_samples(
                e,
                "svc_service_decisions",
                "Connections (socket programs: translated, refused_no_backend) and new flows \
                 (tc programs: new, reject_no_backend, drop_*) per Service port, by reason; \
                 err_missing_entry from either. Off with --per-service-metrics=false.",
                service_samples(&counts.services),
                MetricType::Counter,
            )?;
        }
        // From the pins: what runs on the devices, whichever agent attached it.
        let xdp = crate::datapath::xdp_listing(&self.bpffs);
        if !xdp.is_empty() {
            encode_samples(
                e,
                "svc_xdp_device",
                "1 per external device under --xdp-mode, by the mode it runs in (native: the \
                 driver's hook; generic: the kernel's skb-based hook, --xdp-mode generic; tc: \
                 no XDP program, the driver refused native XDP).",
                xdp.into_iter().map(|d| {
                    (
                        [("device", d.device), ("mode", d.mode.to_string())],
                        ConstGauge::new(1),
                    )
                }),
                MetricType::Gauge,
            )?;
        }
        let Some(p) = counts.packet else {
            return Ok(());
        };
        // By name in the agent's network namespace, the ifindex when the device is gone.
        encode_samples(
            e,
            "svc_packet_decisions",
            "Decisions of the tc programs, by device and reason (drops and rejects included).",
            p.devices.iter().map(|(ifindex, reason, v)| {
                let device = crate::netdev::ifname(*ifindex).unwrap_or_else(|| ifindex.to_string());
                (
                    [("device", device), ("reason", reason.to_string())],
                    ConstCounter::new(*v),
                )
            }),
            MetricType::Counter,
        )?;
        encode_gauge(
            e,
            "svc_conntrack_entries",
            "Entries in the assured flows' connection-tracking table.",
            p.ct_entries,
        )?;
        encode_gauge(
            e,
            "svc_conntrack_capacity",
            "max_entries of the assured flows' connection-tracking table (--max-ct).",
            p.ct_capacity.into(),
        )?;
        encode_gauge(
            e,
            "svc_conntrack_unassured_entries",
            "Entries in the unassured flows' connection-tracking table.",
            p.ct_new_entries,
        )?;
        encode_gauge(
            e,
            "svc_conntrack_unassured_capacity",
            "max_entries of the unassured flows' table.",
            p.ct_new_capacity.into(),
        )?;
        encode_samples(
            e,
            "svc_conntrack_flows",
            "Live flows tracked, by whether they are SNATed.",
            [
                ("true", p.snat_flows),
                ("false", p.flows.saturating_sub(p.snat_flows)),
            ]
            .map(|(snat, v)| {
                (
                    [("snat", snat)],
                    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)),
                )
            }),
            MetricType::Gauge,
        )?;
        encode_gauge(
            e,
            "svc_snat_ports_in_use_max",
            "The most SNAT ports one node address holds towards one backend for live flows.",
            p.snat_ports_max,
        )
    }
}

#[derive(Debug)]
struct Inner {
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
    attached: bool,
    /// The socket programs are attached, the rest perhaps not yet.
    sockets_attached: bool,
    /// The last repair attempt left the datapath incomplete.
    datapath_broken: bool,
    /// The sync loop's last turn.
    alive: Option<Instant>,
    /// Live SNATed flows per device their backend is routed through, for devices without
    /// svc's programs (their replies come back untranslated), as the last drift check found.
    unmanaged: BTreeMap<String, u64>,
    /// Why SNAT is off (`PacketConfig::snat_degraded`).
    snat_degraded: Option<String>,
    /// The node is not being deleted (`set_node_eligible`).
    node_eligible: bool,
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
    /// What /healthz and the health check node ports answer from.
    inner: Mutex<Inner>,
    recorded: Recorded,
    /// A queued change older than this makes /healthz fail, as kube-proxy's healthTimeout.
    health_timeout: Duration,
    /// The connections of every HTTP server of the agent.
    pub conns: Arc<ConnLimit>,
    /// The length of the last /metrics text: the next is written into that much room at
    /// once rather than doubling up to it (tens of MB with per-Service counters at 100,000).
    last_render: std::sync::atomic::AtomicUsize,
}

/// What /healthz says.
#[derive(Debug)]
pub struct Health {
    pub ok: bool,
    /// kube-proxy's nodeEligible: false while the node is being deleted, which fails
    /// /healthz (load balancers drain the node) but not /livez nor the health check node
    /// ports.
    pub node_eligible: bool,
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
    /// Every program: the socket programs, the tc and XDP programs.
    pub attached: bool,
    /// The socket programs (which serve ClusterIPs to the cgroup's sockets).
    pub sockets_attached: bool,
    /// The node's addresses (SVC_NODE_ADDRS) or datapath settings could not all be written;
    /// retried with backoff.
    pub node_failing: bool,
    /// Service ports svc does not serve (SCTP), "namespace/name:port 3868/SCTP".
    pub unserved: Vec<String>,
    pub maglev: MaglevUsage,
    /// Service ports whose Local traffic policy finds no local endpoint, summed over Services.
    pub no_local_endpoints: crate::model::NoLocalEndpoints,
}

/// The Maglev tables (docs/design/maglev.md).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MaglevUsage {
    /// Entries of the current generations' tables, 2 bytes each.
    pub table_bytes: u64,
    /// What `SVC_MAGLEV` has room for (8 bytes a block of 4 entries).
    pub capacity_bytes: u64,
    /// External frontends with a table, and those that want one and found no room.
    pub tables: usize,
    pub none: usize,
}

impl Metrics {
    pub fn new(bpffs: PathBuf, health_timeout: Duration) -> Arc<Metrics> {
        let conns = Arc::new(ConnLimit::for_this_process());
        Arc::new(Metrics {
            inner: Mutex::new(Inner {
                last_synced: None,
                queued_since: None,
                unsynced_since: None,
                failing: Vec::new(),
                unserved: Vec::new(),
                node_failing: false,
                attached: false,
                sockets_attached: false,
                datapath_broken: false,
                alive: None,
                snat_degraded: None,
                node_eligible: true,
                unmanaged: BTreeMap::new(),
            }),
            recorded: Recorded::new(bpffs, &conns),
            health_timeout,
            conns,
            last_render: Default::default(),
        })
    }

    /// What counts the requests of the agent's Kubernetes clients (`ApiServer::connect`).
    pub fn rest_client(&self) -> &crate::source::rest_client::RestClientMetrics {
        &self.recorded.rest_client
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere must not take the metrics down with it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn error(&self, e: &Error) {
        self.error_kind(e.kind());
    }

    /// The one way the agent tells of an error: a warning `what: error` (or the error alone
    /// when `what` is empty), and its count by kind in `svc_errors_total`.
    pub fn report(&self, what: &str, e: &Error) {
        self.report_as(e.kind(), what, e);
    }

    /// `report` for an error that is not the agent's own `Error`, counted as `kind`.
    pub fn report_as(&self, kind: &'static str, what: &str, e: &dyn std::fmt::Display) {
        if what.is_empty() {
            tracing::warn!("{e}");
        } else {
            tracing::warn!("{what}: {e}");
        }
        self.error_kind(kind);
    }

    /// A connection-tracking sweep removed `removed` entries in `took`.
    pub fn swept(&self, removed: u32, took: Duration) {
        let r = &self.recorded;
        r.sweeps.inc();
        r.swept.inc_by(removed.into());
        r.sweep_seconds.inc_by(took.as_secs_f64());
    }

    pub fn error_kind(&self, kind: &'static str) {
        self.recorded.errors.get_or_create(&[("kind", kind)]).inc();
    }

    /// A change arrived that is not programmed yet.
    pub fn queued(&self) {
        let mut i = self.lock();
        i.queued_since.get_or_insert_with(Instant::now);
        i.unsynced_since.get_or_insert_with(Instant::now);
        drop(i);
        self.recorded.kube_proxy.last_queued.set(epoch_seconds());
    }

    /// Changes the source saw since the last call, and what waits for a sync.
    pub fn changes(&self, c: crate::source::Changes) {
        let k = &self.recorded.kube_proxy;
        k.service_changes.inc_by(c.services);
        k.endpoint_changes.inc_by(c.endpoints);
        k.services_pending.set(int(c.services_pending));
        k.endpoints_pending.set(int(c.endpoints_pending));
    }

    /// A sync took `took`; `full`: it covered every Service, not only those that changed.
    pub fn synced(&self, took: Duration, full: bool, state: Programmed) {
        let r = &self.recorded;
        r.syncs.inc();
        r.sync_seconds.observe(took.as_secs_f64());
        let k = &r.kube_proxy;
        k.sync_seconds.observe(took.as_secs_f64());
        if full {
            k.full_sync_seconds.observe(took.as_secs_f64());
        } else {
            k.partial_sync_seconds.observe(took.as_secs_f64());
        }
        k.last_synced.set(epoch_seconds());
        let mut i = self.lock();
        i.last_synced = Some(Timestamp::now());
        i.unsynced_since = None;
        // A Service that failed is retried on its own backoff and named by /healthz; the
        // loop has kept up.
        i.queued_since = None;
        drop(i);
        self.state(state);
    }

    /// What is programmed now (after a sync or upkeep).
    pub fn state(&self, state: Programmed) {
        let r = &self.recorded;
        r.frontends.set(int(state.frontends));
        r.backends.set(int(state.backends));
        r.cluster_ips.set(int(state.cluster_ips));
        for (name, used, cap) in state.maps {
            r.map_entries.get_or_create(&[("map", name)]).set(int(used));
            r.map_capacity
                .get_or_create(&[("map", name)])
                .set(cap.into());
        }
        r.failing.set(int(state.failing.len()));
        r.unserved
            .get_or_create(&[("protocol", "SCTP")])
            .set(int(state.unserved.len()));
        r.retiring.set(int(state.retiring));
        r.attached.set(state.attached.into());
        let m = &state.maglev;
        r.maglev_table_bytes.set(m.table_bytes as i64);
        r.maglev_capacity_bytes.set(m.capacity_bytes as i64);
        (r.maglev_frontends.get_or_create(&[("table", "maglev")])).set(int(m.tables));
        (r.maglev_frontends.get_or_create(&[("table", "none")])).set(int(m.none));
        let n = &state.no_local_endpoints;
        let no_local = &r.kube_proxy.no_local_endpoints;
        (no_local.get_or_create(&[("traffic_policy", "internal")])).set(n.internal.into());
        (no_local.get_or_create(&[("traffic_policy", "external")])).set(n.external.into());
        let mut i = self.lock();
        i.failing = state.failing;
        i.unserved = state.unserved;
        i.node_failing = state.node_failing;
        i.attached = state.attached;
        i.sockets_attached = state.sockets_attached;
    }

    /// The sync loop took a turn.
    pub fn alive(&self) {
        self.lock().alive = Some(Instant::now());
    }

    pub fn repaired(&self, what: &'static str) {
        self.recorded.repairs.get_or_create(&[("what", what)]).inc();
    }

    /// SNAT is off, for this reason (None: on). A problem of /healthz, which load balancers
    /// of externalTrafficPolicy Cluster Services probe: this node cannot forward to remote
    /// backends. Not of the health check node ports, whose Services go to local endpoints only.
    /// Whether the node may take load balancer traffic (it is not being deleted).
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    pub fn snat_degraded(&self, why: Option<String>) {
        self.recorded.snat_degraded.set(why.is_some().into());
        self.lock().snat_degraded = why;
    }

    /// The SNAT port range, `lo..=hi`.
    pub fn snat_ports(&self, (lo, hi): (u16, u16)) {
        let n = if hi >= lo { u32::from(hi - lo) + 1 } else { 0 };
        self.recorded.snat_ports.set(n.into());
    }

    pub fn datapath_broken(&self, broken: bool) {
        self.lock().datapath_broken = broken;
    }

    /// The devices without svc's programs that live SNATed flows leave by, with their flows.
    pub fn unmanaged_devices(&self, flows: BTreeMap<String, u64>) {
        let unmanaged = &self.recorded.unmanaged;
        unmanaged.clear();
        for (device, n) in &flows {
            unmanaged
                .get_or_create(&[("device", device.clone())])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        self.lock().unmanaged = flows;
    }

    /// The tc programs attached, by device, and how.
    pub fn tc_attachments(&self, attached: &[crate::datapath::TcAttachment]) {
        let family = &self.recorded.tc_attached;
        family.clear();
        for a in attached {
            family
                .get_or_create(&[
                    ("device", a.device.clone()),
                    ("program", a.program.to_string()),
                    ("mode", a.mode.to_string()),
                ])
                .set(1);
        }
    }

    pub fn drift(&self, ops: usize) {
        self.recorded.drift_ops.inc_by(ops as u64);
    }

    /// From the agent receiving an event to the datapath reflecting it.
    pub fn event_lag(&self, d: Duration) {
        self.recorded.event_lag_seconds.observe(d.as_secs_f64());
    }

    /// From the change in the cluster (EndpointSlice's last-change-trigger-time) to the
    /// datapath reflecting it: kube-proxy's network programming latency.
    pub fn programming_latency(&self, d: Duration) {
        self.recorded.programming_seconds.observe(d.as_secs_f64());
        self.recorded
            .kube_proxy
            .programming_seconds
            .observe(d.as_secs_f64());
    }

    /// kube-proxy's rule: healthy unless a change has waited longer than the timeout, and
    /// never before the first sync; and not while the datapath is not attached whole, the
    /// node's addresses or SNAT are not programmed (every Service of the node suffers).
    /// A Service that cannot be programmed is named, not a failure: its cause (too many
    /// endpoints, a full map) is the same on every node, and a 503 would have every load
    /// balancer that checks this port drain every node of every Service for one of them; the
    /// Service is retried, counted (`svc_services_failing`) and alerted on instead.
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
        if i.node_failing {
            problems.push("the node's addresses cannot all be programmed (SVC_NODE_ADDRS)".into());
        }
        if i.last_synced.is_some() && !i.attached {
            problems.push(if i.sockets_attached {
                "the packet datapath is not attached yet (its programs are being verified): \
                 ClusterIPs answer, NodePorts, externalIPs and LoadBalancer addresses not yet"
                    .into()
            } else {
                "programs not attached".into()
            });
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
        if !i.failing.is_empty() {
            problems.push(format!(
                "{} Services cannot be programmed (retried; the others are served): {}",
                i.failing.len(),
                first_five(&i.failing)
            ));
        }
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
        if !i.node_eligible {
            problems.push(
                "the node is being deleted (deletionTimestamp or ToBeDeletedByClusterAutoscaler \
                 taint)"
                    .into(),
            );
        }
        Health {
            ok,
            node_eligible: i.node_eligible,
            last_synced: i.last_synced,
            problems,
        }
    }

    /// serviceProxyHealthy of Service `owner`'s health check node port: the proxy keeps up and
    /// its datapath is attached whole, the node's addresses are programmed, and this Service
    /// is. Another Service that cannot be programmed does not count, as on /healthz: every
    /// node fails it alike, and counting it would have load balancers drain every node.
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

    /// /metrics, in the Prometheus text format (0.0.4).
    pub fn render(&self) -> String {
        let r = &self.recorded;
        let c = self.conns.counts();
        r.http_open.set(int(c.open));
        r.http_max.set(int(self.conns.cap));
        use std::sync::atomic::Ordering::Relaxed;
        let mut out = String::with_capacity(self.last_render.load(Relaxed) * 9 / 8);
        if let Err(e) = prometheus_text::encode(&mut out, &r.registry) {
            debug!("encoding /metrics: {e}");
        }
        self.last_render.store(out.len(), Relaxed);
        out
    }
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
                h.ok && h.node_eligible
            };
            let last = h.last_synced.map(|t| t.to_string()).unwrap_or_default();
            let body = format!(
                "{{\"lastUpdated\": \"{last}\",\"currentTime\": \"{}\",\"nodeEligible\": {},\"problems\": {}}}",
                Timestamp::now(),
                h.node_eligible,
                serde_json::to_string(&h.problems).unwrap_or_else(|_| "[]".into())
            );
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let k = &metrics.recorded.kube_proxy;
            let answered = if path == "/livez" {
                &k.livez
            } else {
                &k.healthz
            };
            answered
                .get_or_create(&[("code", status.as_u16().to_string())])
                .inc();
            Answer::new(status, "application/json", body)
        }
        _ => Answer::new(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

pub use crate::http::bind;

/// How many /metrics and /healthz answers of one port are made at a time.
const ANSWERING: usize = 2;

/// Serves /metrics and /healthz until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, port: Port) {
    let conns = metrics.conns.clone();
    let what = format!("the {port:?} port");
    // Answers being made at once: a request leaves the connection cap when it arrives, so
    // without this many clients could each hold a blocking thread walking the maps (a timed
    // out request does not stop its thread; the permit goes when the answer is made).
    let answering = Arc::new(tokio::sync::Semaphore::new(ANSWERING));
    crate::http::serve(Arc::new(listener), conns, what, move |method, path, _| {
        let metrics = metrics.clone();
        let answering = answering.clone();
        async move {
            if method != Method::GET {
                return Answer::new(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
            }
            let Ok(permit) = answering.acquire_owned().await else {
                return Answer::new(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "closing\n");
            };
            // Off the runtime's one thread: a scrape walks the connection-tracking map (tens
            // of ms when full), which must not hold up the sync.
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                answer(&metrics, port, &path)
            })
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

    /// A full sync of nothing, with the programs attached.
    fn synced_attached(m: &Metrics) {
        m.synced(
            Duration::from_millis(1),
            true,
            Programmed {
                attached: true,
                ..Default::default()
            },
        );
    }

    /// KEP-3836: a node being deleted fails /healthz (nodeEligible false) and nothing else.
    #[test]
    fn a_node_being_deleted_fails_healthz_but_not_livez() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        synced_attached(&m);
        assert!(got(&m, Port::Health, "/healthz").contains("\"nodeEligible\": true"));
        m.set_node_eligible(false);
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("\"nodeEligible\": false") && reply.contains("being deleted"));
        assert!(got(&m, Port::Health, "/livez").starts_with("HTTP/1.1 200"));
        m.set_node_eligible(true);
        assert!(got(&m, Port::Health, "/healthz").starts_with("HTTP/1.1 200"));
    }

    #[test]
    fn healthz_fails_before_the_first_sync_and_when_a_change_waits_too_long() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_millis(20));
        assert!(!m.healthy().0);
        synced_attached(&m);
        assert!(m.healthy().0);
        m.queued();
        std::thread::sleep(Duration::from_millis(30));
        assert!(!m.healthy().0);
        assert!(got(&m, Port::Health, "/healthz").starts_with("HTTP/1.1 503"));
        synced_attached(&m);
        assert!(got(&m, Port::Health, "/healthz").starts_with("HTTP/1.1 200"));
        // A Service that cannot be programmed is named, and the node stays healthy, also
        // once the timeout has passed (every node fails it alike: a 503 would drain them
        // all); /livez stays up (a restart would not help).
        m.queued();
        m.synced(
            Duration::from_millis(1),
            true,
            Programmed {
                attached: true,
                failing: vec!["ns/big".into()],
                ..Default::default()
            },
        );
        std::thread::sleep(Duration::from_millis(30));
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
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
        m.synced(Duration::from_millis(1), true, state(true));
        let reply = got(&m, Port::Health, "/healthz");
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("SVC_NODE_ADDRS"), "{reply}");
        assert!(!m.service_healthy("shop/web"));
        m.synced(Duration::from_millis(1), true, state(false));
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
            true,
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
        synced_attached(&m);
        assert!(!got(&m, Port::Health, "/healthz").contains("SCTP"));
    }

    /// Flows leaving by a device without svc's programs are a gauge per device and a line of
    /// /healthz, which stays 200: the node serves every other flow.
    #[test]
    fn flows_via_an_unmanaged_device_are_counted_and_listed_without_failing_health() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        synced_attached(&m);
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
        synced_attached(&m);
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
        synced_attached(&m);
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
            true,
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
        synced_attached(&m);
        assert!(m.health().ok);
        assert!(m.render().contains("\nsvc_snat_degraded 0\n"));
        m.snat_degraded(Some("SNAT off: test".into()));
        let h = m.health();
        assert!(!h.ok);
        assert_eq!(h.problems, ["SNAT off: test"]);
        assert!(m.service_healthy("ns/web"));
        assert!(m.render().contains("\nsvc_snat_degraded 1\n"));
    }

    /// kube-proxy's names, types and buckets, so its dashboards read svc: a full and a scoped
    /// sync land in their own histograms and both in the overall one.
    #[test]
    fn kube_proxy_names_types_and_buckets() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.queued();
        m.synced(Duration::from_millis(3), true, Programmed::default());
        m.synced(Duration::from_millis(20), false, Programmed::default());
        m.programming_latency(Duration::from_millis(700));
        m.changes(crate::source::Changes {
            services: 3,
            endpoints: 5,
            services_pending: 2,
            endpoints_pending: 4,
        });
        m.changes(crate::source::Changes {
            services: 1,
            endpoints: 0,
            services_pending: 0,
            endpoints_pending: 0,
        });
        let text = m.render();
        let types: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE kubeproxy_"))
            .collect();
        assert_eq!(
            types,
            [
                "sync_proxy_rules_duration_seconds histogram",
                "sync_full_proxy_rules_duration_seconds histogram",
                "sync_partial_proxy_rules_duration_seconds histogram",
                "sync_proxy_rules_last_timestamp_seconds gauge",
                "sync_proxy_rules_last_queued_timestamp_seconds gauge",
                "network_programming_duration_seconds histogram",
                "sync_proxy_rules_endpoint_changes_total counter",
                "sync_proxy_rules_service_changes_total counter",
                "sync_proxy_rules_endpoint_changes_pending gauge",
                "sync_proxy_rules_service_changes_pending gauge",
                "sync_proxy_rules_no_local_endpoints_total gauge",
            ]
        );
        for line in [
            "kubeproxy_sync_proxy_rules_duration_seconds_count 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\"} 2",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{le=\"0.016\"} 0",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{le=\"0.032\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.5\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"115\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300\"} 1",
            "kubeproxy_sync_proxy_rules_service_changes_total 4",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 5",
            "kubeproxy_sync_proxy_rules_service_changes_pending 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 0",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"} 0",
        ] {
            assert!(text.contains(&format!("\n{line}\n")), "{line} in {text}");
        }
        let buckets = text
            .lines()
            .filter(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_bucket"))
            .count();
        // 2 + 59 + 12 + 7 and +Inf, as kube-proxy's.
        assert_eq!(buckets, 81);
        let now = epoch_seconds();
        for name in [
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        ] {
            let v: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} in {text}"));
            assert!((now - v).abs() < 60.0, "{name} {v}, now {now}");
        }
    }

    /// kube-proxy's no-local-endpoints gauge: the sum the agent reports, by policy, set again
    /// at each sync (down as well as up).
    #[test]
    fn no_local_endpoints_gauge_follows_each_sync() {
        use crate::model::NoLocalEndpoints;
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        let with = |internal, external| Programmed {
            no_local_endpoints: NoLocalEndpoints { internal, external },
            ..Default::default()
        };
        let line = |policy: &str, v: u32| {
            format!("\nkubeproxy_sync_proxy_rules_no_local_endpoints_total{{traffic_policy=\"{policy}\"}} {v}\n")
        };
        m.synced(Duration::from_millis(1), true, with(3, 1));
        let text = m.render();
        assert!(text.contains(&line("internal", 3)), "{text}");
        assert!(text.contains(&line("external", 1)), "{text}");
        m.synced(Duration::from_millis(1), false, with(0, 2));
        let text = m.render();
        assert!(text.contains(&line("internal", 0)), "{text}");
        assert!(text.contains(&line("external", 2)), "{text}");
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .expect("parses");
        let s = scrape
            .samples
            .iter()
            .find(|s| s.metric == "kubeproxy_sync_proxy_rules_no_local_endpoints_total")
            .expect("a sample");
        assert!(
            matches!(s.value, prometheus_parse::Value::Gauge(_)),
            "{s:?}"
        );
    }

    /// Every metric's name and type as /metrics has always shown them (the datapath's own
    /// counters are read from pinned maps, absent here), each HELP ending in one full stop. A
    /// labelled metric shows once it has a sample (before, its HELP and TYPE came alone).
    #[test]
    fn names_and_types_are_as_before() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        let text = m.render();
        assert!(!text.contains("svc_errors_total"), "{text}");
        m.error_kind("manifest");
        m.state(Programmed {
            maps: vec![("SVC_SERVICES", 3, 100)],
            ..Default::default()
        });
        m.repaired("pin");
        m.unmanaged_devices(BTreeMap::from([("eth1".to_string(), 2)]));
        m.snat_ports((61000, 65535));
        let text = m.render();
        let types: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter(|t| t.starts_with("svc_"))
            .collect();
        assert_eq!(
            types,
            [
                "svc_frontends_programmed gauge",
                "svc_backends_programmed gauge",
                "svc_cluster_ips_programmed gauge",
                "svc_syncs_total counter",
                "svc_sync_duration_seconds histogram",
                "svc_event_to_datapath_seconds histogram",
                "svc_network_programming_duration_seconds histogram",
                "svc_errors_total counter",
                "svc_map_entries gauge",
                "svc_map_capacity gauge",
                "svc_services_failing gauge",
                "svc_service_ports_not_served gauge",
                "svc_entries_retiring gauge",
                "svc_datapath_attached gauge",
                "svc_snat_degraded gauge",
                "svc_http_connections gauge",
                "svc_http_connections_max gauge",
                "svc_http_connections_evicted_total counter",
                "svc_datapath_repairs_total counter",
                "svc_conntrack_sweeps_total counter",
                "svc_conntrack_swept_entries_total counter",
                "svc_conntrack_sweep_seconds_total counter",
                "svc_flows_via_unmanaged_device gauge",
                "svc_drift_repaired_ops_total counter",
                "svc_snat_ports gauge",
                "svc_maglev_table_bytes gauge",
                "svc_maglev_capacity_bytes gauge",
                "svc_maglev_frontends gauge",
            ]
        );
        for help in text.lines().filter(|l| l.starts_with("# HELP ")) {
            assert!(help.ends_with('.') && !help.ends_with(".."), "{help}");
        }
        assert!(text.contains("\nsvc_service_ports_not_served{protocol=\"SCTP\"} 0\n"));
        assert!(text.contains("\nsvc_snat_ports 4536\n"), "{text}");
        assert!(text.contains("\nsvc_sync_duration_seconds_bucket{le=\"+Inf\"} 0\n"));
        assert!(
            text.contains("\nsvc_http_connections_evicted_total 0\n"),
            "{text}"
        );
    }

    /// /metrics as a parser other than the library that wrote it reads it: every sample
    /// parses, kube-proxy's names carry kube-proxy's types, the health answers are counted
    /// by code, and the process metrics are there.
    #[test]
    fn metrics_parse_and_carry_kube_proxys_names_and_process_metrics() {
        let m = Metrics::new(PathBuf::from("/nonexistent"), Duration::from_secs(60));
        m.queued();
        synced_attached(&m);
        m.programming_latency(Duration::from_millis(700));
        m.error_kind("invalid_service");
        for path in ["/healthz", "/healthz", "/livez"] {
            answer(&m, Port::Health, path);
        }
        // A few clock ticks of CPU, so the process's time is more than none.
        let busy = Instant::now();
        let mut spin = 0u64;
        while busy.elapsed() < Duration::from_millis(80) {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
        let text = m.render();
        let lines = text.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("a parsable exposition");
        let value = |name: &str, label: Option<(&str, &str)>| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
                .map(|s| match s.value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    _ => f64::NAN,
                })
        };
        // Counters parse as counters, gauges as gauges.
        let kind = |name: &str| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == name)
                .map(|s| std::mem::discriminant(&s.value))
        };
        let (counter, gauge) = (
            std::mem::discriminant(&prometheus_parse::Value::Counter(0.0)),
            std::mem::discriminant(&prometheus_parse::Value::Gauge(0.0)),
        );
        for name in [
            "kubeproxy_proxy_healthz_total",
            "kubeproxy_proxy_livez_total",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "process_cpu_seconds_total",
        ] {
            assert_eq!(kind(name), Some(counter), "{name} as a counter:\n{text}");
        }
        for name in [
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "process_resident_memory_bytes",
            "process_start_time_seconds",
        ] {
            assert_eq!(kind(name), Some(gauge), "{name} as a gauge:\n{text}");
        }
        assert_eq!(
            value("kubeproxy_proxy_healthz_total", Some(("code", "200"))),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            value("kubeproxy_proxy_livez_total", Some(("code", "200"))),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            value("svc_errors_total", Some(("kind", "invalid_service"))),
            Some(1.0)
        );
        assert!(value("kubeproxy_sync_proxy_rules_last_timestamp_seconds", None).unwrap() > 0.0);
        let histogram = scrape
            .samples
            .iter()
            .find(|s| s.metric == "kubeproxy_network_programming_duration_seconds")
            .expect("the programming latency histogram");
        assert!(
            matches!(histogram.value, prometheus_parse::Value::Histogram(_)),
            "{:?}",
            histogram.value
        );
        let rss = value("process_resident_memory_bytes", None).expect("process metrics");
        assert!(rss > 1e6, "resident {rss}");
        assert!(
            value("process_cpu_seconds_total", None).unwrap() > 0.0,
            "{text}"
        );
        assert!(value("process_open_fds", None).unwrap() >= 3.0);
        let start = value("process_start_time_seconds", None).unwrap();
        let now = epoch_seconds();
        assert!(
            start > now - 86_400.0 * 365.0 && start <= now,
            "{start} {now}"
        );
    }

    /// proc_pid_stat(5), a command name with a space and parentheses in it.
    #[test]
    fn process_stat_fields_follow_the_last_parenthesis() {
        let stat = "4242 (svc (agent) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 \
                    0 8 0 1000 123456789 2048 18446744073709551615";
        let s = ProcessStats::parse(stat, "cpu 1 2 3\nbtime 1700000000\n", 100.0, 4096)
            .expect("parsed");
        assert_eq!(
            s,
            ProcessStats {
                cpu_seconds: 3.0,
                resident_bytes: 2048 * 4096,
                virtual_bytes: 123_456_789,
                start_time_seconds: 1_700_000_010.0,
                open_fds: 0,
                max_fds: 0,
            }
        );
    }
}
