//! svc-kube-bench: the agent against a real API server holding 10,000 Services.
//!
//! A real etcd and kube-apiserver on loopback (the harness's `ControlPlane`) get 10,000
//! Services of one TCP port, each with one EndpointSlice of 10 ready endpoints on made-up
//! addresses, each naming one of 1,000 nodes (`--nodes`), none of them the agent's. Then, in
//! one run:
//!
//! 1. cold start: `svc-agent run --kubeconfig ...` (the release binary, as a process, on a test
//!    cgroup and a private bpffs directory) from spawn to `svc-agent: ready`, which the agent
//!    prints after its first full sync; the pinned maps are then read back and every Service
//!    must be there with exactly its 10 backends;
//! 2. change latency: 1,000 sequential EndpointSlice updates, each replacing one endpoint
//!    address of a random slice, timed from just before the API write until a lookup in the
//!    pinned maps (services, then slots, then backends, as the socket hook does) finds the
//!    new address;
//! 3. the agent's RSS and CPU time, from /proc, after the cold start and at the end;
//!
//! and the agent's own latency histograms from its /metrics. A breakdown of the cold start
//! (listing through kube-rs, translating, writing the maps) is measured afterwards in this
//! process, with the same objects, so a missed target can be traced to its cause. With
//! `SVC_BENCH_TIMELINE` set, the agent's log of the cold start, of the changes and of the
//! restart is printed (stderr), each line at its offset from the spawn (the changes' from the
//! first change's write): where the agent's own time went.
//!
//! Nothing leaves loopback: the API server, the agent's /metrics and /healthz listen on
//! 127.0.0.1, and no traffic is sent to any Service.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use svc_agent::model::{Frontend, Protocol};
use svc_agent::reconcile::{addr16, service_key, Programmed};
use svc_agent::source::kube::{
    list_all, service_selector, slice_selector, TRIGGER_TIME_ANNOTATION,
};
use svc_agent::store::{BpfStore, Store};
use svc_agent::translate::NodeContext;
use svc_common::{ServiceKey, SlotKey};
use svc_tests::agent::kube_run_args;
use svc_tests::control_plane::ControlPlane;
use svc_tests::memcg::{MemCgroup, MemUsage};
use svc_tests::{
    bulk, interrupt, report, require_root, sys, Agent, Bpffs, TempDir, TestCgroup, Tools,
};

#[derive(Parser)]
struct Args {
    /// Replace this benchmark's section of this markdown file (docs/benchmarks.md).
    #[arg(long)]
    write: Option<PathBuf>,
    /// Services in the API server, one port and one EndpointSlice each.
    #[arg(long, default_value_t = 10_000)]
    services: u32,
    /// Ready endpoints per EndpointSlice.
    #[arg(long, default_value_t = 10)]
    endpoints: u32,
    /// Nodes the endpoints run on (each endpoint's `nodeName`, cloud-style names, endpoint
    /// after endpoint in turn), as in a real cluster; 0: no `nodeName`, as the runs before
    /// 2026-12-07 had. The agent's own node is none of them.
    #[arg(long, default_value_t = 1_000)]
    nodes: u32,
    /// Sequential EndpointSlice changes timed for the change latency.
    #[arg(long, default_value_t = 1_000)]
    changes: u32,
    /// API requests in flight while the objects are created.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Write the Services and slices straight into etcd instead of creating them through the
    /// API (`svc_tests::bulk::populate_via_etcd`: kube-apiserver's ClusterIP allocation is
    /// quadratic in the Service count); the agent still reads them through the API server.
    #[arg(long)]
    via_etcd: bool,
    /// Cold starts, each on empty maps; the median is reported, the last agent stays for the
    /// changes.
    #[arg(long, default_value_t = 5)]
    cold_starts: u32,
    /// Seed of the choice of slices and endpoints to change.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The section of docs/benchmarks.md `--write` replaces.
    #[arg(long, default_value = "kube")]
    section: String,
    /// The target for the agent's RSS, in MiB.
    #[arg(long, default_value_t = 100)]
    rss_target_mib: u64,
    /// Another svc-agent binary (an older build): cold starts alternate between it and the
    /// agent under test, `--cold-starts` each, it first, so that the agent under test comes
    /// last and stays. Its cold starts are reported beside, round by round, and are in no
    /// other figure.
    #[arg(long)]
    compare_agent: Option<PathBuf>,
}

const NAMESPACE: &str = "svc-bench";
const NODE: &str = "bench-node";
const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// How long one change may take to show in the maps before the run fails.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the agent may take to its first full sync before the run fails.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_micros(100);

/// The targets this benchmark checks.
const TARGET_COLD_START: Duration = Duration::from_secs(2);
const TARGET_CHANGE_P99: Duration = Duration::from_millis(50);

/// Endpoint `k` of Service `i` at creation: 10.128.0.0 onwards. Nothing listens there.
fn endpoint_ip(i: u32, k: u32, per_service: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a80_0000 + i * per_service + k)
}

/// The address change `c` puts in: 10.224.0.0 onwards, never one of the initial ones.
fn changed_ip(c: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0ae0_0000 + c)
}

/// Service `i` and its slice as created, its endpoints on `nodes` nodes in turn (none: 0).
fn objects(i: u32, per_service: u32, nodes: u32) -> (Service, EndpointSlice) {
    let mut slice = bulk::slice(
        NAMESPACE,
        i,
        (0..per_service).map(|k| endpoint_ip(i, k, per_service)),
        TARGET_PORT,
    );
    if nodes > 0 {
        for (k, e) in slice.endpoints.iter_mut().enumerate() {
            let n = (u64::from(i) * u64::from(per_service) + k as u64) % u64::from(nodes);
            e.node_name = Some(bulk::node_name(n as u32));
        }
    }
    (bulk::service(NAMESPACE, i, PORT, TARGET_PORT), slice)
}

fn frontend_key(i: u32) -> ServiceKey {
    service_key(&Frontend::cluster(
        IpAddr::V4(bulk::cluster_ip(i)),
        PORT,
        Protocol::Tcp,
    ))
}

fn backend_addr(ip: Ipv4Addr) -> [u8; 16] {
    addr16(IpAddr::V4(ip))
}

/// Resident set and its peak, KiB, from /proc/PID/status.
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    rss_kib: u64,
    hwm_kib: u64,
}

fn memory(pid: u32) -> Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("{name} in /proc/{pid}/status"))
    };
    Ok(Memory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// Whether the pinned maps serve `want` as a backend of `key` now: the socket hook's own
/// path, services → slots of the current generation → backends.
fn serves(store: &BpfStore, key: &ServiceKey, want: &[u8; 16]) -> bool {
    let Ok(v) = store.services.get(key, 0) else {
        return false;
    };
    (0..u32::from(v.count)).any(|slot| {
        let (k, i) = SlotKey::of_slot(v.id, v.rev, slot);
        store
            .slots
            .get(&k, 0)
            .ok()
            .and_then(|g| store.backend(g.backends[i]))
            .is_some_and(|b| b.addr == *want)
    })
}

/// How many of the bench's Services the pinned maps serve with exactly their backends.
fn verify(store: &BpfStore, args: &Args) -> Result<(usize, usize)> {
    let snap = store.snapshot()?;
    let services: HashMap<ServiceKey, _> = snap.services.iter().copied().collect();
    let slots: HashMap<SlotKey, svc_common::SlotGroup> = snap.slots.iter().copied().collect();
    let backends: HashMap<u32, [u8; 16]> =
        snap.backends.iter().map(|(id, b)| (*id, b.addr)).collect();
    let mut complete = 0;
    for i in 0..args.services {
        let Some(v) = services.get(&frontend_key(i)) else {
            continue;
        };
        let mut have: Vec<[u8; 16]> = (0..u32::from(v.count))
            .filter_map(|slot| {
                let (k, i) = SlotKey::of_slot(v.id, v.rev, slot);
                slots.get(&k).map(|g| g.backends[i])
            })
            .filter_map(|b| backends.get(&b).copied())
            .collect();
        have.sort_unstable();
        let mut want: Vec<[u8; 16]> = (0..args.endpoints)
            .map(|k| backend_addr(endpoint_ip(i, k, args.endpoints)))
            .collect();
        want.sort_unstable();
        if have == want {
            complete += 1;
        }
    }
    Ok((complete, snap.services.len()))
}

/// xorshift64*: a fixed, seedable sequence, so two runs change the same slices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32 % n
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn mib_bytes(bytes: u64) -> String {
    mib(bytes / 1024)
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "**not met**"
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

fn scrape(addr: SocketAddr) -> Result<String> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    Ok(text)
}

/// A Prometheus histogram from the agent's /metrics: count, sum, and the bucket bounds that
/// hold the median and the 99th percentile (an upper bound, as Prometheus estimates them).
fn histogram(metrics: &str, name: &str) -> Option<String> {
    let value = |line: &str| line.rsplit(' ').next()?.parse::<f64>().ok();
    let count = metrics
        .lines()
        .find(|l| l.starts_with(&format!("{name}_count ")))
        .and_then(value)?;
    let sum = metrics
        .lines()
        .find(|l| l.starts_with(&format!("{name}_sum ")))
        .and_then(value)?;
    if count == 0.0 {
        return Some("no observations".into());
    }
    let buckets: Vec<(String, f64)> = metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&format!("{name}_bucket{{le=\""))?;
            let (le, _) = rest.split_once('"')?;
            Some((le.to_string(), value(l)?))
        })
        .collect();
    let bound = |q: f64| {
        buckets
            .iter()
            .find(|(_, c)| *c >= q * count)
            .map(|(le, _)| format!("≤ {le} s"))
            .unwrap_or_else(|| "> largest bucket".into())
    };
    Some(format!(
        "{count:.0} observations, mean {:.1} ms, p50 {}, p99 {}",
        sum / count * 1e3,
        bound(0.5),
        bound(0.99)
    ))
}

/// Counts the heap this process holds, so the breakdown can say what each of the agent's data
/// structures costs in bytes as well as in time.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is passed on to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One step of the breakdown: its time, the heap its result holds, and the heap's peak above
/// the start while it ran.
struct Step {
    started: Instant,
    live: usize,
}

impl Step {
    fn start() -> Self {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
        Self {
            started: Instant::now(),
            live: LIVE.load(Ordering::Relaxed),
        }
    }

    /// The table row; also records (heap held after, heap peak above start) in MiB.
    fn row(self, what: &str, mib: &mut Vec<(f64, f64)>) -> String {
        let elapsed = self.started.elapsed();
        let now = LIVE.load(Ordering::Relaxed) as f64;
        let peak = PEAK.load(Ordering::Relaxed) as f64;
        let held = (now - self.live as f64) / (1024.0 * 1024.0);
        let transient = (peak - self.live as f64) / (1024.0 * 1024.0);
        mib.push((held, transient));
        format!(
            "| {what} | {} | {held:+.1} MiB | {transient:.1} MiB |",
            ms(elapsed)
        )
    }
}

/// The breakdown's table and, per row in order, (heap held after, heap peak) in MiB.
struct Breakdown {
    table: String,
    mib: Vec<(f64, f64)>,
}

impl Breakdown {
    /// Why the agent's memory is what it is, from the heap figures of the agent's own types.
    fn memory_story(&self, rss: u64) -> String {
        let m = &self.mib;
        let (services, slices, parsed, assemble, desired, write) = (
            m[0].0,
            m[1].0,
            m[0].0 + m[1].0 + m[2].0,
            m[3].1,
            m[4].0,
            m[6].0,
        );
        format!(
            "Where the memory goes, from the heap figures of the breakdown below (the agent's \
             own code, the same objects): as API objects the Services and EndpointSlices take \
             {:.0} MiB (Services {services:.0}, EndpointSlices {slices:.0}); the agent's cache \
             keeps them parsed instead, in {parsed:.0} MiB, and parses each object as its page \
             of the list arrives, so the API objects never pile up. Assembling the frontends \
             peaks at {assemble:.0} MiB; the desired-state index and the mirror of the maps \
             keep {:.0} MiB. Agent RSS: {}.",
            services + slices,
            desired + write,
            mib(rss)
        )
    }
}

/// Where the cold start goes, measured here with the same objects and the agent's own code:
/// listing them through kube-rs (including deserialization; held here all at once, where the
/// agent parses page by page), parsing them into what the agent's cache keeps, assembling the
/// frontends, the agent's index of the desired state, loading the programs and writing the
/// maps into a datapath of its own (on a cgroup of its own). Heap figures are this process's
/// allocations (a counting allocator); glibc's own overhead comes on top.
fn breakdown(rt: &tokio::runtime::Runtime, client: &Client, tools: &Tools) -> Result<Breakdown> {
    let mut mib = Vec::new();
    let mut rows = vec![
        "| step | time | heap held after | heap peak during, above start |".to_string(),
        "|---|---|---|---|".to_string(),
    ];
    let step = Step::start();
    let services: Vec<Service> =
        rt.block_on(list_all(&Api::all(client.clone()), &service_selector(None)))?;
    rows.push(step.row(
        &format!(
            "list {} Services through kube-rs (pages of {}, deserialized)",
            services.len(),
            svc_agent::source::kube::LIST_PAGE
        ),
        &mut mib,
    ));
    let step = Step::start();
    // Decoded as the agent's watchers decode them: only what it reads.
    let slices: Vec<svc_agent::source::listed::ListedSlice> =
        rt.block_on(list_all(&Api::all(client.clone()), &slice_selector(None)))?;
    rows.push(step.row(
        &format!(
            "list {} EndpointSlices through kube-rs (same; decoded in part, as `ListedSlice`)",
            slices.len()
        ),
        &mut mib,
    ));

    let node = NodeContext {
        node_name: Some(NODE.into()),
        zone: None,
        service_proxy_name: None,
        node_ips: Vec::new(),
    };
    let step = Step::start();
    let mut errors = Vec::new();
    let parsed_services: Vec<_> = services
        .iter()
        .filter_map(|s| svc_agent::translate::parse_service(s, &node, &mut errors))
        .collect();
    let parsed_slices: Vec<_> = slices
        .iter()
        .filter_map(|s| {
            let s = EndpointSlice::from(s.clone());
            svc_agent::translate::parse_slice(&s, &node, &mut errors)
        })
        .collect();
    drop(services);
    drop(slices);
    rows.push(step.row(
        "parse them into what the agent's cache keeps, and drop the API objects",
        &mut mib,
    ));

    let step = Step::start();
    let translated = svc_agent::translate::assemble(&parsed_services, &parsed_slices, &node);
    let frontends = translated.state.frontends.len();
    rows.push(step.row(&format!("assemble the frontends ({frontends})"), &mut mib));

    let step = Step::start();
    let desired = svc_agent::desired::Desired::from_full(translated.state);
    rows.push(step.row(
        "index the desired state by Service (`Desired::from_full`)",
        &mut mib,
    ));

    let cgroup = TestCgroup::new()?;
    let bpffs = Bpffs::new(&tools.agent, cgroup.path())?;
    let step = Step::start();
    let mut dp = svc_agent::datapath::Datapath::open_attached(
        bpffs.path(),
        cgroup.path(),
        Default::default(),
    )?;
    let store = &mut dp.store;
    let mut programmed =
        Programmed::adopt(&*store, store.capacity, svc_agent::reconcile::DEFAULT_GRACE)?;
    rows.push(step.row(
        "load and attach the programs, read the (empty) pinned maps",
        &mut mib,
    ));
    let step = Step::start();
    let r = programmed.apply(store, &desired.state);
    if let Some(e) = r.errors.first() {
        bail!("writing the maps: {e} ({} errors)", r.errors.len());
    }
    rows.push(step.row(
        &format!(
            "write the maps ({} map operations, in batches), keeping the mirror of what is programmed",
            r.ops
        ),
        &mut mib,
    ));
    drop(programmed);
    drop(dp);
    drop(bpffs);
    drop(cgroup);

    // The same writes one entry per call, on fresh maps, for comparison.
    let cgroup = TestCgroup::new()?;
    let bpffs = Bpffs::new(&tools.agent, cgroup.path())?;
    let mut dp = svc_agent::datapath::Datapath::open_attached(
        bpffs.path(),
        cgroup.path(),
        Default::default(),
    )?;
    let store = &mut dp.store;
    store.batch_writes = false;
    let mut programmed =
        Programmed::adopt(&*store, store.capacity, svc_agent::reconcile::DEFAULT_GRACE)?;
    let step = Step::start();
    let r = programmed.apply(store, &desired.state);
    if let Some(e) = r.errors.first() {
        bail!(
            "writing the maps one entry per call: {e} ({} errors)",
            r.errors.len()
        );
    }
    rows.push(step.row(
        &format!(
            "for comparison: the same {} map operations one entry per call (batches off)",
            r.ops
        ),
        &mut Vec::new(),
    ));
    drop(programmed);
    drop(dp);
    drop(bpffs);
    drop(cgroup);
    Ok(Breakdown {
        table: rows.join("\n"),
        mib,
    })
}

/// The bytes of a map key or value.
fn bytes<T: aya::Pod>(t: &T) -> Vec<u8> {
    // SAFETY: aya::Pod types are plain data without padding bytes left uninitialized (the
    // map types have explicit padding), so every byte of `t` is initialized.
    unsafe { std::slice::from_raw_parts((t as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

/// Entries added, removed and changed from `a` to `b`.
fn diff<K: aya::Pod, V: aya::Pod>(a: &[(K, V)], b: &[(K, V)]) -> (usize, usize, usize) {
    let a: HashMap<Vec<u8>, Vec<u8>> = a.iter().map(|(k, v)| (bytes(k), bytes(v))).collect();
    let b: HashMap<Vec<u8>, Vec<u8>> = b.iter().map(|(k, v)| (bytes(k), bytes(v))).collect();
    let added = b.keys().filter(|k| !a.contains_key(*k)).count();
    let removed = a.keys().filter(|k| !b.contains_key(*k)).count();
    let changed = a
        .iter()
        .filter(|(k, v)| b.get(*k).is_some_and(|w| w != *v))
        .count();
    (added, removed, changed)
}

/// What changed between two reads of the maps the agent writes, per map: "none" or each
/// map's added/removed/changed entries.
fn changed(a: &svc_agent::store::Snapshot, b: &svc_agent::store::Snapshot) -> String {
    let unit = |v: &[svc_common::AffinityMatchKey]| v.iter().map(|k| (*k, 0u8)).collect::<Vec<_>>();
    let ranges = |v: &[svc_common::SrcRangeKey]| v.iter().map(|k| (*k, 0u8)).collect::<Vec<_>>();
    let maps = [
        ("SVC_SERVICES", diff(&a.services, &b.services)),
        ("SVC_SLOTS", diff(&a.slots, &b.slots)),
        ("SVC_BACKENDS", diff(&a.backends, &b.backends)),
        ("SVC_REV_NAT", diff(&a.rev_nat, &b.rev_nat)),
        ("SVC_NAMES", diff(&a.names, &b.names)),
        (
            "SVC_AFFINITY_MATCH",
            diff(&unit(&a.matches), &unit(&b.matches)),
        ),
        (
            "SVC_SRC_RANGES",
            diff(&ranges(&a.ranges), &ranges(&b.ranges)),
        ),
        ("SVC_NODE_ADDRS", diff(&a.node_addrs, &b.node_addrs)),
        ("SVC_MAGLEV_INDEX", diff(&a.maglev_index, &b.maglev_index)),
        ("SVC_META", diff(&[(0u32, a.meta)], &[(0u32, b.meta)])),
        ("SVC_CONFIG", diff(&[(0u32, a.config)], &[(0u32, b.config)])),
    ];
    let total: usize = maps.iter().map(|(_, (x, y, z))| x + y + z).sum();
    let parts: Vec<String> = maps
        .iter()
        .filter(|(_, (x, y, z))| x + y + z > 0)
        .map(|(m, (x, y, z))| format!("{m} +{x} -{y} ~{z}"))
        .collect();
    if total == 0 {
        "no entry changed (of every map the agent writes)".into()
    } else {
        format!("{total} entries ({})", parts.join(", "))
    }
}

/// The agent's resident memory by kind of mapping, from /proc/PID/smaps: the brk heap,
/// anonymous mappings (large allocations, other threads' malloc arenas), files (the binary).
fn rss_by_mapping(pid: u32) -> Result<String> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut by: BTreeMap<&str, u64> = BTreeMap::new();
    let mut kind = "anonymous";
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or_default();
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            let path = line.split_whitespace().nth(5).unwrap_or("");
            kind = match path {
                "" => "anonymous",
                "[heap]" => "heap (brk)",
                p if p.starts_with('/') => "files",
                _ => "other",
            };
        } else if first == "Rss:" {
            *by.entry(kind).or_default() += f.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
    }
    Ok(by
        .iter()
        .map(|(k, kib)| format!("{k} {}", mib(*kib)))
        .collect::<Vec<_>>()
        .join(", "))
}

/// One cold start of the agent.
struct ColdStart {
    /// Spawn to `svc-agent: ready`.
    time: Duration,
    /// Spawn to the agent's log line saying it adopted the (empty) pinned maps: process start,
    /// loading and attaching the programs. The rest is listing, translating and writing.
    attached: Option<Duration>,
    cpu: Duration,
    mem: Memory,
    smaps: String,
    /// The agent's memory cgroup (as a pod's) after ready: its resident memory and the kernel
    /// memory of the maps it created.
    memcg: MemUsage,
    /// Services found in the maps with exactly their backends.
    complete: usize,
    service_entries: usize,
    /// Where this agent serves /metrics.
    metrics: SocketAddr,
}

/// A line of the agent's log as its timestamp and the rest; None for a line without one
/// (the `svc-agent: ...` lines on stderr).
fn stamped(line: &str) -> Option<(Timestamp, &str)> {
    let (t, rest) = line.split_once(' ')?;
    Some((t.parse().ok()?, rest))
}

/// When the agent said it adopted the pinned maps, from its log's timestamps.
fn adopted_at(log: &str) -> Option<Timestamp> {
    log.lines()
        .find(|l| l.contains("adopted pinned state"))
        .and_then(stamped)
        .map(|(t, _)| t)
}

/// The agent's log since `spawned_at`, each line at its offset from it: where the start's
/// time went, by the agent's own account.
fn timeline(log: &str, spawned_at: Timestamp) {
    for (t, rest) in log.lines().filter_map(stamped) {
        // Before the spawn: none expected (each start logs to a file of its own).
        let Ok(at) = Duration::try_from(t.duration_since(spawned_at)) else {
            continue;
        };
        if rest.contains("attached program=") {
            continue;
        }
        let rest: String = rest.chars().take(160).collect();
        eprintln!("  +{:7.3} s {rest}", at.as_secs_f64());
    }
}

/// Starts the agent on a fresh bpffs directory, waits for `svc-agent: ready`, then checks that
/// every Service is in the maps with exactly its backends.
fn cold_start(
    tools: &Tools,
    cp: &ControlPlane,
    cgroup: &TestCgroup,
    logs: &TempDir,
    args: &Args,
) -> Result<(Agent, Bpffs, BpfStore, MemCgroup, ColdStart)> {
    let bpffs = Bpffs::new(&tools.agent, cgroup.path())?;
    // A fresh one each time: the maps a previous agent created were charged to its cgroup.
    let memcg = MemCgroup::new()?;
    let metrics_addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), free_port()?);
    let healthz_addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), free_port()?);
    let mut agent_args = kube_run_args(cp.kubeconfig_path(), NODE, cgroup.path(), bpffs.path());
    agent_args.extend([
        OsString::from("--metrics-bind-address"),
        metrics_addr.to_string().into(),
        "--healthz-bind-address".into(),
        healthz_addr.to_string().into(),
    ]);
    let spawned_at = Timestamp::now();
    let started = Instant::now();
    let mut agent = Agent::start_launched(
        &memcg.launcher(),
        &tools.agent,
        agent_args,
        bpffs.path(),
        logs.path(),
    )?;
    let pid = agent.pid().context("agent pid")?;
    loop {
        if agent.count_lines(svc_tests::agent::READY_LINE) > 0 {
            break;
        }
        if let Some(status) = agent.exited()? {
            bail!("svc-agent exited ({status}) before it was ready");
        }
        if started.elapsed() > READY_TIMEOUT {
            bail!("svc-agent not ready within {READY_TIMEOUT:?}");
        }
        interrupt::check()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let time = started.elapsed();
    let cpu = sys::cpu_time(pid)?;
    let mem = memory(pid)?;
    let smaps = rss_by_mapping(pid)?;
    let memcg_usage = memcg.usage()?;
    let attached =
        adopted_at(&agent.log()).and_then(|t| t.duration_since(spawned_at).try_into().ok());
    if std::env::var_os("SVC_BENCH_TIMELINE").is_some() {
        timeline(&agent.log(), spawned_at);
    }
    let store = svc_agent::datapath::open_pinned(bpffs.path())?;
    let (complete, service_entries) = verify(&store, args)?;
    if complete != args.services as usize {
        bail!(
            "only {complete} of {} services are in the maps with their backends after ready",
            args.services
        );
    }
    Ok((
        agent,
        bpffs,
        store,
        memcg,
        ColdStart {
            time,
            attached,
            cpu,
            mem,
            smaps,
            memcg: memcg_usage,
            complete,
            service_entries,
            metrics: metrics_addr,
        },
    ))
}

fn main() -> ExitCode {
    interrupt::run(bench)
}

fn bench() -> Result<()> {
    let args = Args::parse();
    require_root();
    // 250 per /24 of 10.96.0.0/12, the first /24 left to the API server's own Service.
    let fit = 250 * (16 * 256 - 1);
    if args.services > fit {
        bail!("at most {fit} services fit the ClusterIP plan");
    }
    let tools = Tools::locate();
    let load_before = report::load_average();
    // Guards in dependency order: they drop in reverse, the agent first, the control plane last.
    let cp = if args.via_etcd {
        // Objects written into etcd are JSON; the API server must store (and read) JSON.
        ControlPlane::start_with_args(
            svc_tests::control_plane::Binaries::from_env()?,
            &["--storage-media-type=application/json"],
        )
    } else {
        ControlPlane::start()
    }
    .context("starting the control plane")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let client = rt.block_on(svc_agent::source::kube::client(Some(cp.kubeconfig_path())))?;

    eprintln!(
        "creating {} Services with {} endpoints each",
        args.services, args.endpoints
    );
    let started = Instant::now();
    let mut slices = if args.via_etcd {
        interrupt::block_on(
            &rt,
            bulk::populate_via_etcd(&cp, client.clone(), NAMESPACE, args.services, |i| {
                objects(i, args.endpoints, args.nodes)
            }),
        )?
    } else {
        interrupt::block_on(
            &rt,
            bulk::populate(
                client.clone(),
                NAMESPACE,
                args.services,
                args.concurrency,
                |i| objects(i, args.endpoints, args.nodes),
            ),
        )?
    };
    let populate_time = started.elapsed();
    eprintln!(
        "created {} objects in {:.1} s",
        2 * args.services,
        populate_time.as_secs_f64()
    );

    // 1. Cold start, several times (a fresh bpffs directory, so empty maps, each time); the
    // last agent stays for the changes.
    let cgroup = TestCgroup::new()?;
    let logs = TempDir::new("svc-kube-bench")?;
    let mut runs = Vec::new();
    let mut compared: Vec<ColdStart> = Vec::new();
    let mut unsettled = 0;
    let other = args.compare_agent.as_ref().map(|agent| Tools {
        agent: agent.clone(),
        ..tools.clone()
    });
    let (agent, bpffs, store, memcg) = loop {
        interrupt::check()?;
        let run = runs.len() + 1;
        let (this_run, theirs) = match &other {
            Some(o) if compared.len() < runs.len() + 1 => (o, true),
            _ => (&tools, false),
        };
        // The API server after the last agent's lists, the kernel freeing its maps.
        let settled = sys::settle(&cp.pids(), Duration::from_secs(120))?;
        unsettled += usize::from(!settled.quiet);
        eprintln!(
            "cold start {run}/{}{}: {} ({settled})",
            args.cold_starts,
            if theirs { ", compared" } else { "" },
            this_run.agent.display(),
        );
        let (agent, bpffs, store, memcg, cold) = cold_start(this_run, &cp, &cgroup, &logs, &args)?;
        eprintln!(
            "ready after {} (programs attached after {}): {}/{} services programmed with all {} backends",
            ms(cold.time),
            cold.attached.map(ms).unwrap_or_else(|| "?".into()),
            cold.complete,
            args.services,
            args.endpoints
        );
        if theirs {
            compared.push(cold);
        } else {
            runs.push(cold);
            if runs.len() >= args.cold_starts.max(1) as usize {
                break (agent, bpffs, store, memcg);
            }
        }
        let mut agent = agent;
        agent.terminate(Duration::from_secs(10))?;
        agent.quiet();
        drop(store);
        drop(agent);
        drop(bpffs);
        drop(memcg);
    };
    let mut agent = agent;
    let pid = agent.pid().context("agent pid")?;
    let metrics_addr = runs.last().context("no cold start")?.metrics;
    let median_of = |f: &dyn Fn(&ColdStart) -> Duration| {
        let mut v: Vec<Duration> = runs.iter().map(f).collect();
        v.sort_unstable();
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (cold_start, cold_min, cold_max) = median_of(&|c| c.time);
    let (cold_cpu, cold_cpu_min, cold_cpu_max) = median_of(&|c| c.cpu);
    let (attach, _, _) = median_of(&|c| c.attached.unwrap_or_default());
    let last = runs.last().context("no cold start")?;
    let (cold_mem, cold_memcg, cold_smaps, complete, service_entries) = (
        last.mem,
        last.memcg,
        last.smaps.clone(),
        last.complete,
        last.service_entries,
    );
    let cold_list = runs
        .iter()
        .map(|c| format!("{:.2}", c.time.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ");
    let settling = format!(
        " Each cold start began once kube-apiserver and etcd used less than a tenth of a core \
         and the machine less than 15 % of its CPUs, two seconds in a row (`sys::settle`){}.",
        match unsettled {
            0 => String::new(),
            n => format!(", except {n}, which began after 120 s on a busier machine"),
        }
    );
    // Round by round: the other agent's cold start, then this one's.
    let comparison = match &args.compare_agent {
        Some(path) if !compared.is_empty() => {
            let list = |v: &[ColdStart]| {
                v.iter()
                    .map(|c| format!("{:.2}", c.time.as_secs_f64()))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut ratios: Vec<f64> = (compared.iter().zip(&runs))
                .map(|(o, c)| o.time.as_secs_f64() / c.time.as_secs_f64())
                .collect();
            ratios.sort_by(f64::total_cmp);
            format!(
                " Interleaved with `{}` (its cold start first in each round): its cold starts \
                 {} s against this agent's {} s; its time over this agent's, round by round: \
                 median ×{:.2} (×{:.2} to ×{:.2}).",
                path.display(),
                list(&compared),
                list(&runs),
                ratios[ratios.len() / 2],
                ratios[0],
                ratios[ratios.len() - 1]
            )
        }
        _ => String::new(),
    };

    // 2. Change latency.
    eprintln!("{} sequential EndpointSlice changes", args.changes);
    let slice_api: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
    let mut rng = Rng(args.seed.max(1));
    let mut latencies = Vec::with_capacity(args.changes as usize);
    let mut writes = Vec::with_capacity(args.changes as usize);
    let cpu_before_changes = sys::cpu_time(pid)?;
    let changes_began = Timestamp::now();
    for c in 0..args.changes {
        let i = rng.below(args.services);
        let k = rng.below(args.endpoints) as usize;
        let new_ip = changed_ip(c);
        let mut s = slices[i as usize].clone();
        let node = (args.nodes > 0).then(|| bulk::node_name(c % args.nodes));
        s.endpoints[k] = bulk::ready_endpoint_on(new_ip, node);
        let name = s.metadata.name.clone().unwrap_or_default();
        let key = frontend_key(i);
        let want = backend_addr(new_ip);
        let t0 = Instant::now();
        // The change as the EndpointSlice controller would stamp it, so the agent's
        // network programming latency histogram sees it too.
        s.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(TRIGGER_TIME_ANNOTATION.into(), Timestamp::now().to_string());
        slices[i as usize] = rt
            .block_on(slice_api.replace(&name, &PostParams::default(), &s))
            .with_context(|| format!("replacing {name}"))?;
        writes.push(t0.elapsed());
        while !serves(&store, &key, &want) {
            if t0.elapsed() > CHANGE_TIMEOUT {
                bail!("change {c} ({name}: {new_ip}) not in the maps after {CHANGE_TIMEOUT:?}");
            }
            interrupt::check()?;
            std::thread::sleep(POLL);
        }
        latencies.push(t0.elapsed());
    }
    let change_cpu = sys::cpu_time(pid)? - cpu_before_changes;
    if std::env::var_os("SVC_BENCH_TIMELINE").is_some() {
        eprintln!("the agent's log during the changes, from the first change's write:");
        timeline(&agent.log(), changes_began);
    }
    // Which changes were slow, in the order made: a pattern (the first after the cold start,
    // one a minute) points at what delayed them.
    let mut slowest: Vec<(usize, Duration, Duration)> = (latencies.iter().zip(&writes))
        .enumerate()
        .map(|(c, (l, w))| (c, *l, *w))
        .collect();
    slowest.sort_by_key(|(_, l, _)| std::cmp::Reverse(*l));
    for (c, l, w) in slowest.iter().take(3) {
        eprintln!(
            "slow change: #{c} of {}, {} (the API write {})",
            args.changes,
            ms(*l),
            ms(*w)
        );
    }
    let end_mem = memory(pid)?;
    let end_smaps = rss_by_mapping(pid)?;
    let end_memcg = memcg.usage()?;
    let metrics = scrape(metrics_addr).unwrap_or_else(|e| {
        eprintln!("scraping {metrics_addr}/metrics: {e}");
        String::new()
    });
    let load_after = report::load_average();

    // 3. A restart on the pins (an upgrade: SIGTERM, then the same agent again): spawn to
    // ready, and every entry the new agent changed, from the pinned maps read before the stop
    // and after its ready (then again after the grace period: what it retires shows there).
    eprintln!("restart on the pinned maps");
    std::thread::sleep(Duration::from_secs(3));
    let before = store.snapshot()?;
    agent.terminate(Duration::from_secs(30))?;
    let started = Instant::now();
    let spawned_at = Timestamp::now();
    agent.restart()?;
    agent.wait_ready(READY_TIMEOUT)?;
    let restart_time = started.elapsed();
    let restart_pid = agent.pid().context("agent pid")?;
    let restart_cpu = sys::cpu_time(restart_pid)?;
    let at_ready = store.snapshot()?;
    std::thread::sleep(Duration::from_secs(3));
    let after_grace = store.snapshot()?;
    if std::env::var_os("SVC_BENCH_TIMELINE").is_some() {
        timeline(&agent.log(), spawned_at);
    }
    // The restarted agent adopts the maps charged to this cgroup and builds its state again
    // beside them: the cgroup's peak over the whole run may be the restart's.
    let restart_memcg = memcg.usage()?;
    let restart_hwm = memory(restart_pid)?.hwm_kib;
    let (restart_complete, _) = verify(&store, &args)?;
    let restart_changes = [
        format!("at ready: {}", changed(&before, &at_ready)),
        format!(
            "3 s later (after the grace period): {}",
            changed(&before, &after_grace)
        ),
    ];
    eprintln!(
        "restart: ready after {}, CPU {:.2} s, {restart_complete}/{} services complete; entries changed {}",
        ms(restart_time),
        restart_cpu.as_secs_f64(),
        args.services,
        restart_changes.join("; ")
    );
    agent.terminate(Duration::from_secs(30))?;
    agent.quiet();
    drop(store);
    drop(agent);
    drop(bpffs);
    drop(memcg);
    drop(cgroup);

    interrupt::check()?;
    eprintln!("breakdown of the cold start");
    let breakdown = breakdown(&rt, &client, &tools)?;
    drop(client);
    drop(rt);
    drop(cp);

    latencies.sort_unstable();
    writes.sort_unstable();
    let (p50, p99, max) = (
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        *latencies.last().context("no changes")?,
    );
    let peak = cold_mem.hwm_kib.max(end_mem.hwm_kib);
    let breakdown_table = &breakdown.table;
    let target_rss_kib = args.rss_target_mib * 1024;
    let memory_note = if peak >= target_rss_kib {
        format!("\n\n{}", breakdown.memory_story(peak))
    } else {
        String::new()
    };
    let n = args.services;
    let table = [
        "| measure | target | measured | |".to_string(),
        "|---|---|---|---|".to_string(),
        format!(
            "| cold start: spawn to every Service programmed ({n} Services, {} backends), median of {} | < {} s | {:.2} s (min {:.2}, max {:.2}) | {} |",
            n * args.endpoints,
            runs.len(),
            TARGET_COLD_START.as_secs(),
            cold_start.as_secs_f64(),
            cold_min.as_secs_f64(),
            cold_max.as_secs_f64(),
            verdict(cold_start < TARGET_COLD_START)
        ),
        format!(
            "| of which spawn to programs attached (median) | | {} | |",
            ms(attach)
        ),
        format!("| change latency p50: API write to new backend in the maps | | {} | |", ms(p50)),
        format!(
            "| change latency p99 | < {} ms | {} | {} |",
            TARGET_CHANGE_P99.as_millis(),
            ms(p99),
            verdict(p99 < TARGET_CHANGE_P99)
        ),
        format!("| change latency max | | {} | |", ms(max)),
        format!(
            "| agent RSS after cold start (VmRSS; peak VmHWM) | < {} MiB | {} (peak {}) | {} |",
            args.rss_target_mib,
            mib(cold_mem.rss_kib),
            mib(cold_mem.hwm_kib),
            verdict(cold_mem.hwm_kib < target_rss_kib)
        ),
        format!(
            "| agent RSS at the end (VmRSS; peak VmHWM) | < {} MiB | {} (peak {}) | {} |",
            args.rss_target_mib,
            mib(end_mem.rss_kib),
            mib(end_mem.hwm_kib),
            verdict(peak < target_rss_kib)
        ),
        format!(
            "| the agent's memory cgroup, as a pod's limit counts it: peak (of which kernel memory: the maps) | | {} ({} kernel) | |",
            mib_bytes(end_memcg.peak),
            mib_bytes(end_memcg.kernel)
        ),
        format!(
            "| the same cgroup's peak over the run, the restart on the pins included (the restarted agent's peak VmHWM) | | {} ({}) | |",
            mib_bytes(restart_memcg.peak),
            mib(restart_hwm)
        ),
        format!(
            "| agent CPU time, cold start (user + system), median | | {:.2} s (min {:.2}, max {:.2}) | |",
            cold_cpu.as_secs_f64(),
            cold_cpu_min.as_secs_f64(),
            cold_cpu_max.as_secs_f64()
        ),
        format!(
            "| agent CPU time, {} changes (user + system) | | {:.2} s ({:.2} ms per change) | |",
            args.changes,
            change_cpu.as_secs_f64(),
            change_cpu.as_secs_f64() * 1e3 / args.changes.max(1) as f64
        ),
    ]
    .join("\n");
    let context = format!(
        "Of the change latency, the API write alone (PUT of the EndpointSlice until the API \
         server answered): p50 {}, p99 {}, max {}. {} the {} Services and {} \
         EndpointSlices ({}) took {:.1} s. Cold starts, in order: \
         {cold_list} s.{comparison}{settling} After the last cold start the maps \
         held {complete} of {n} Services with exactly their {} backends ({service_entries} \
         entries in SVC_SERVICES, ClusterIP markers and the `kubernetes` Service included). \
         The agent's resident memory by mapping (/proc/PID/smaps) after the cold start: \
         {cold_smaps}; at the end: {end_smaps}. The agent ran in a memory cgroup of its own, \
         as in a pod: after the cold start it held {} ({} of it kernel memory, charged there \
         for the maps the agent created), {} at the end; its peak, {}, is what a container \
         memory limit must allow.",
        ms(percentile(&writes, 0.5)),
        ms(percentile(&writes, 0.99)),
        ms(*writes.last().context("no changes")?),
        if args.via_etcd { "Writing" } else { "Creating" },
        n,
        n,
        if args.via_etcd {
            "straight into etcd, with their IPAddress objects, because kube-apiserver v1.37's \
             ClusterIP allocator lists every IPAddress on each allocation, which makes \
             creating them through the API quadratic: 30,000 took 8 min here and the next \
             10,000 another 12; the agent reads them through the API server all the same, \
             which stores JSON for this run"
                .to_string()
        } else {
            format!("{} requests in flight", args.concurrency)
        },
        populate_time.as_secs_f64(),
        args.endpoints,
        mib_bytes(cold_memcg.usage),
        mib_bytes(cold_memcg.kernel),
        mib_bytes(end_memcg.usage),
        mib_bytes(end_memcg.peak),
    );
    let agent_view = [
        ("svc_event_to_datapath_seconds", "from the agent receiving an event to the maps written; the cold start's full sync is one observation"),
        ("svc_network_programming_duration_seconds", "from the slice's `endpoints.kubernetes.io/last-change-trigger-time`, stamped by the bench just before each write, to the maps written"),
    ]
    .iter()
    .map(|(name, what)| {
        format!(
            "- `{name}` ({what}): {}",
            histogram(&metrics, name).unwrap_or_else(|| "not scraped".into())
        )
    })
    .collect::<Vec<_>>()
    .join("\n");
    println!(
        "{table}\n\n{context}{memory_note}\n\nThe agent's own histograms:\n{agent_view}\n\n\
         Restart on the pins (SIGTERM, the same agent again): spawn to ready {}, CPU {:.2} s, \
         {restart_complete} of {n} Services complete; entries changed {}.\n\n\
         Cold start breakdown:\n\n{breakdown_table}\n\nLoad average before {load_before}, after \
         the changes {load_after}.",
        ms(restart_time),
        restart_cpu.as_secs_f64(),
        restart_changes.join("; ")
    );

    if let Some(path) = args.write {
        let body = format!(
            "## The agent against a real API server: {n} Services\n\n\
             Measured with `cargo xtask bench --write` (release build, as root) on {machine}, \
             {date}; load average {load_before} (1, 5, 15 min) before, {load_after} after the \
             changes (another engineer's integration tests may share the machine).\n\n\
             A real etcd v3.6.16 and kube-apiserver v1.37.2 on loopback (no controller-manager, \
             so nothing rewrites what the bench writes) hold {n} Services of one TCP port with \
             explicit ClusterIPs in 10.96.0.0/12, each with one EndpointSlice of {e} ready \
             endpoints on made-up addresses. `svc-agent run --kubeconfig ...` (the release \
             binary, as a process, on a test cgroup) is timed from spawn to `svc-agent: \
             ready`, which it prints after its first full sync, {runs} times, each on a fresh \
             bpffs directory (empty maps); the median is reported. After each, the pinned maps \
             are read back, and every Service must be there with exactly its {e} backends. The \
             last agent stays: {changes} sequential EndpointSlice updates, each replacing one \
             endpoint address of a random slice (a fixed seed), are timed from just before the \
             API write until a lookup in the pinned maps (services, then slots, then backends, \
             the socket hook's own path, every 100 µs) finds the new address. RSS is VmRSS and \
             VmHWM of /proc/PID/status; CPU is utime + stime of /proc/PID/stat.\n\n\
             {table}\n\n{context}{memory_note}\n\n\
             The agent's own histograms (its /metrics at the end; bucket bounds):\n\n\
             {agent_view}\n\n\
             Where the cold start's time and the agent's memory go, measured afterwards in the \
             bench process with the same objects and the agent's own code (listing like the \
             agent's watchers, its translation, its desired-state index, a datapath of its \
             own). The agent does these steps in this order (it lists Services and \
             EndpointSlices concurrently, on one thread) and also starts the process and \
             connects to the API server. Heap is what this process allocated (a counting \
             allocator); glibc's own overhead and freed memory it does not return to the \
             system come on top in the agent's RSS.\n\n\
             {breakdown_table}\n\n\
             Reproduce: `cargo xtask bench --kube` (prints the table), `cargo xtask bench \
             --kube --write` (rewrites this section); the bench itself is `svc-kube-bench \
             --help` (services, endpoints, changes, seed).",
            machine = report::machine(),
            date = report::today(),
            e = args.endpoints,
            changes = args.changes,
            runs = runs.len(),
        );
        report::write_section(&path, &args.section, &body)?;
        eprintln!("wrote the {} section of {}", args.section, path.display());
    }
    Ok(())
}
