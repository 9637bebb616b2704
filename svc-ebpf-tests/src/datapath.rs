//! The programs under test, loaded once per test running at the same time (a pool), and
//! their maps.

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{xdp::DevMapHash, Array, HashMap, MapData, PerCpuHashMap};
use aya::programs::{SchedClassifier, TestRun, TestRunOptions, Xdp};
use aya::{Ebpf, EbpfLoader};

use crate::prelude::*;
use crate::reset;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prog {
    ExtIngress,
    ExtEgress,
    PodIngress,
    PodEgress,
    /// The XDP program of the external devices (verdicts `XDP_*`).
    Xdp,
}

impl Prog {
    pub fn name(self) -> &'static str {
        match self {
            Prog::ExtIngress => "tc_ext_ingress",
            Prog::ExtEgress => "tc_ext_egress",
            Prog::PodIngress => "tc_pod_ingress",
            Prog::PodEgress => "tc_pod_egress",
            Prog::Xdp => "xdp_ext",
        }
    }
}

/// The connection-tracking sweep the agent runs (never attached).
pub const SWEEP: &str = "tc_ct_sweep";

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;
pub const XDP_DROP: u32 = 1;

/// A test's datapath: the loaded object (taken from `POOL` or loaded) with the map state a
/// test starts from, and the devices of the test's own network namespace. Dropped, it puts the
/// object back for the next test; that one resets every map first.
pub struct Dp {
    obj: Option<Loaded>,
    pub ext0: u32,
    pub ext1: u32,
    pub pod0: u32,
}

/// The object with its programs loaded and verified, and handles on its maps. Loading and
/// verifying the programs costs far more than a test's rows, so a test binary does it once per
/// test running at the same time (and connection-tracking size), not once per test.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, SlotKey, svc_common::SlotGroup>,
    pub backends: aya::maps::Array<MapData, Backend>,
    pub matches: HashMap<MapData, AffinityMatchKey, u32>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub node_addrs: HashMap<MapData, [u8; 16], NodeAddrValue>,
    pub node_addr_bits: Array<MapData, u64>,
    pub src_ranges: LpmTrie<MapData, [u8; 20], u32>,
    /// Assured flows (`SVC_CT`).
    pub ct: HashMap<MapData, CtKey, CtValue>,
    /// Unassured flows (`SVC_CT_NEW`, an LRU).
    pub ct_new: HashMap<MapData, CtKey, CtValue>,
    pub config: Array<MapData, DatapathConfig>,
    pub dev_stats: PerCpuHashMap<MapData, DevStatKey, u64>,
    pub maglev: svc_agent::store::MaglevPages,
    pub maglev_index: HashMap<MapData, SlotKey, MaglevIndex>,
    /// Per-Service counters, whose entries the agent creates with each frontend (`frontend`
    /// does here). None for an object without them (a benchmark's older object).
    pub service_stats: Option<HashMap<MapData, u32, svc_common::ServiceStats>>,
    /// The devices XDP may redirect to (`SVC_XDP_DEVS`); empty as loaded. None for an object
    /// without it (a benchmark's older object).
    pub xdp_devs: Option<DevMapHash<MapData>>,
    /// Every map the programs use, taken or not, as loaded: what `reset` puts back.
    every_map: Vec<reset::KernelMap>,
    ct_capacity: u32,
    /// The fallbacks the object was loaded with (the agent's `.rodata` constants).
    kernel: Fit,
    /// Maps left in `ebpf` after loading: a test that took one (`take_map`) leaves an object
    /// the next test could not use in full, so it is not put back.
    maps_left: usize,
}

/// Loaded objects no test is using, for the next test that wants one of their CT size.
static POOL: std::sync::Mutex<Vec<Loaded>> = std::sync::Mutex::new(Vec::new());

impl std::ops::Deref for Dp {
    type Target = Loaded;
    fn deref(&self) -> &Loaded {
        self.obj.as_ref().expect("the object until drop")
    }
}

impl std::ops::DerefMut for Dp {
    fn deref_mut(&mut self) -> &mut Loaded {
        self.obj.as_mut().expect("the object until drop")
    }
}

impl Drop for Dp {
    fn drop(&mut self) {
        // Also after a failed test: the next one resets every map before its first row.
        if let Some(obj) = self.obj.take() {
            if obj.ebpf.maps().count() == obj.maps_left {
                POOL.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(obj);
            }
        }
    }
}

/// max_entries of the object's maps but connection tracking and the fixed ones.
const SMALL: u32 = 1024;

/// The object, its programs not yet loaded: small maps (`ct` entries of connection tracking,
/// 1,024 of the others), with the fallbacks of `kernel` as the agent sets them.
pub fn load_object(ct: u32, kernel: Fit) -> Ebpf {
    let globals = kernel.globals();
    let mut loader = EbpfLoader::new();
    // Not required: a benchmark's older object has none.
    for (name, value) in &globals {
        loader.override_global(name, value, false);
    }
    // Small maps: a test needs a handful of entries, and LRU maps are allocated in full.
    for name in map_names::ALL {
        // The monitor's rings are sized in bytes, a multiple of the page size.
        if ![
            map_names::META,
            map_names::SOCK_STATE,
            map_names::CONFIG,
            map_names::MON_RING_0,
            map_names::MON_RING_1,
            map_names::MON_RING_2,
            map_names::MON_RING_3,
        ]
        .contains(&name)
        {
            let n = if [map_names::CT, map_names::CT_NEW].contains(&name) {
                ct
            } else {
                SMALL
            };
            loader.map_max_entries(name, n);
        }
    }
    // As the agent sets it: the index of a backend id is the id modulo the map's size.
    loader.override_global(svc_common::kernel_globals::BACKENDS, &SMALL, false);
    loader.load(&object()).expect("loading the object")
}

impl Loaded {
    /// Loads the object with `ct` entries of connection tracking and verifies its tc programs,
    /// with the fallbacks of `kernel` as the agent sets them.
    pub fn load(ct: u32, kernel: Fit) -> Loaded {
        let mut ebpf = load_object(ct, kernel);
        let mut map_ids = Vec::new();
        for prog in [
            Prog::ExtIngress.name(),
            Prog::ExtEgress.name(),
            Prog::PodIngress.name(),
            Prog::PodEgress.name(),
            SWEEP,
        ] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(prog)
                .unwrap_or_else(|| panic!("{prog} in the object"))
                .try_into()
                .expect("a classifier");
            p.load()
                .unwrap_or_else(|e| panic!("the verifier refuses {prog}: {e}"));
            let info = p.info().expect("program info");
            map_ids.extend(info.map_ids().expect("map ids").unwrap_or_default());
        }
        // Loaded whatever `kernel.xdp` says, as this kernel can: its rows then run with the
        // other fallbacks too.
        {
            let name = Prog::Xdp.name();
            let p: &mut Xdp = ebpf
                .program_mut(name)
                .unwrap_or_else(|| panic!("{name} in the object"))
                .try_into()
                .expect("an XDP program");
            p.load()
                .unwrap_or_else(|e| panic!("the verifier refuses {name}: {e}"));
            let info = p.info().expect("program info");
            map_ids.extend(info.map_ids().expect("map ids").unwrap_or_default());
        }
        map_ids.sort_unstable();
        map_ids.dedup();
        let every_map = map_ids.into_iter().map(reset::KernelMap::new).collect();
        let mut take = |name: &str| ebpf.take_map(name).unwrap_or_else(|| panic!("map {name}"));
        let services = take(map_names::SERVICES).try_into().unwrap();
        let slots = take(map_names::SLOTS).try_into().unwrap();
        let backends = take(map_names::BACKENDS).try_into().unwrap();
        let matches = take(map_names::AFFINITY_MATCH).try_into().unwrap();
        let affinity = take(map_names::AFFINITY).try_into().unwrap();
        let node_addrs = take(map_names::NODE_ADDRS).try_into().unwrap();
        let node_addr_bits = take(map_names::NODE_ADDR_BITS).try_into().unwrap();
        let src_ranges = take(map_names::SRC_RANGES).try_into().unwrap();
        let ct_map = take(map_names::CT).try_into().unwrap();
        let ct_new = take(map_names::CT_NEW).try_into().unwrap();
        let config = take(map_names::CONFIG).try_into().unwrap();
        let dev_stats = take(map_names::DEV_STATS).try_into().unwrap();
        let maglev = take(map_names::MAGLEV).try_into().unwrap();
        let maglev_index = take(map_names::MAGLEV_INDEX).try_into().unwrap();
        // An object of layout 1 (a per-CPU hash) would count nothing here: refused, not
        // skipped.
        let service_stats = ebpf.take_map(map_names::SERVICE_STATS).map(|m| {
            m.try_into()
                .expect("SVC_SERVICE_STATS of layout 2, a hash (an older object?)")
        });
        let xdp_devs = ebpf
            .take_map(map_names::XDP_DEVS)
            .and_then(|m| m.try_into().ok());
        let maps_left = ebpf.maps().count();
        Loaded {
            ebpf,
            services,
            slots,
            backends,
            matches,
            affinity,
            node_addrs,
            node_addr_bits,
            src_ranges,
            ct: ct_map,
            ct_new,
            config,
            dev_stats,
            maglev,
            maglev_index,
            service_stats,
            xdp_devs,
            every_map,
            ct_capacity: ct,
            kernel,
            maps_left,
        }
    }

    /// Every map as it was loaded: hash-like maps empty, arrays back to their first contents.
    pub fn reset(&self) {
        for m in &self.every_map {
            m.reset();
        }
    }
}

/// A frontend as a test programs it.
pub struct Fe<'a> {
    /// "addr:port"; a NodePort as "0.0.0.0:port" or "[::]:port" (its wildcard key).
    pub at: &'a str,
    pub proto: u8,
    pub scope: u8,
    pub id: u32,
    pub backends: &'a [BackendId],
    pub flags: u16,
    pub affinity_s: u32,
    /// The Service port's affinity id (with `affinity_s`); 0: the frontend's own id.
    pub affinity_id: u32,
}

impl<'a> Fe<'a> {
    /// A frontend without sessionAffinity.
    pub fn new(
        at: &'a str,
        proto: u8,
        scope: u8,
        id: u32,
        backends: &'a [BackendId],
        flags: u16,
    ) -> Fe<'a> {
        Fe {
            at,
            proto,
            scope,
            id,
            backends,
            flags,
            affinity_s: 0,
            affinity_id: 0,
        }
    }
}

impl Dp {
    #[allow(
        clippy::new_without_default,
        reason = "a test's datapath sets up a network namespace: not a default value"
    )]
    pub fn new() -> Dp {
        Dp::with_ct(1024)
    }

    /// `new` with `ct` entries of connection tracking, and the fallbacks `SVC_KERNEL_AS`
    /// asks for (none unset).
    pub fn with_ct(ct: u32) -> Dp {
        Dp::with(ct, Fit::of_kernel_as())
    }

    /// `new` with the object loaded with the fallbacks of `kernel`.
    pub fn as_kernel(kernel: Fit) -> Dp {
        Dp::with(1024, kernel)
    }

    fn with(ct: u32, kernel: Fit) -> Dp {
        require_root();
        private_network();
        let pooled = {
            let mut pool = POOL
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let i = pool
                .iter()
                .position(|o| o.ct_capacity == ct && o.kernel == kernel);
            i.map(|i| pool.swap_remove(i))
        };
        let obj = match pooled {
            Some(obj) => {
                obj.reset();
                obj
            }
            None => Loaded::load(ct, kernel),
        };
        let mut dp = Dp {
            obj: Some(obj),
            ext0: ifindex("ext0"),
            ext1: ifindex("ext1"),
            pod0: ifindex("pod0"),
        };
        let both = node_addr_flags::NODEPORT | node_addr_flags::SNAT;
        let ext0 = dp.ext0;
        let ext1 = dp.ext1;
        dp.node_addr("192.0.2.10", both, ext0);
        dp.node_addr("2001:db8::10", both, ext0);
        dp.node_addr("198.18.0.10", both, ext1);
        dp.node_addr("2001:db8:1::10", both, ext1);
        // One SNAT port: the port a new SNATed flow gets is known.
        dp.set_config(DatapathConfig {
            snat_port_min: 61000,
            snat_port_max: 61000,
            ..Default::default()
        });
        dp
    }

    /// Makes device `ifindex` one XDP may redirect to (as the agent does for a device it
    /// attached `xdp_ext` to natively), or no longer (`on` false).
    pub fn xdp_dev(&mut self, ifindex: u32, on: bool) {
        let m = self.xdp_devs.as_mut().expect("an object with SVC_XDP_DEVS");
        if on {
            m.insert(ifindex, ifindex, None, 0)
                .unwrap_or_else(|e| panic!("SVC_XDP_DEVS[{ifindex}]: {e}"));
        } else {
            m.remove(ifindex)
                .unwrap_or_else(|e| panic!("SVC_XDP_DEVS[{ifindex}]: {e}"));
        }
    }

    pub fn set_config(&mut self, c: DatapathConfig) {
        self.config.set(0, c, 0).unwrap();
    }

    pub fn node_addr(&mut self, a: &str, flags: u32, ifindex: u32) {
        self.put_node_addr(ip16(a), NodeAddrValue { flags, ifindex });
    }

    /// As the agent puts an address in NODE_ADDRS: its bit in the filter first.
    pub fn put_node_addr(&mut self, addr: [u8; 16], v: NodeAddrValue) {
        let bit = svc_common::node_addr_bit(&addr);
        let word = self.node_addr_bits.get(&(bit / 64), 0).unwrap();
        self.node_addr_bits
            .set(bit / 64, word | 1 << (bit % 64), 0)
            .unwrap();
        self.node_addrs.insert(addr, v, 0).unwrap();
    }

    pub fn backend(&mut self, id: BackendId, at: &str, proto: u8, flags: u8) {
        let s = sa(at);
        let b = Backend {
            addr: addr16(s.ip()),
            port_be: s.port().to_be(),
            proto,
            flags,
            id,
        };
        let at = svc_common::backend_index(id, SMALL);
        let there = self.backends.get(&at, 0).unwrap().id;
        assert!(
            there == 0 || there == id,
            "backend {id}: index {at} holds {there}"
        );
        self.backends.set(at, b, 0).unwrap();
    }

    /// A frontend's generation `rev` with its slots and match entries; for a cluster-scope
    /// frontend that is no NodePort, its ClusterIP marker too.
    pub fn frontend_rev(&mut self, f: &Fe<'_>, rev: u16) {
        let s = sa(f.at);
        let key = ServiceKey {
            addr: addr16(s.ip()),
            port_be: s.port().to_be(),
            proto: f.proto,
            scope: f.scope,
        };
        // The entries as the agent makes them.
        for (k, g) in svc_agent::reconcile::slot_entries(f.id, rev, f.backends) {
            self.slots.insert(k, g, 0).unwrap();
        }
        for b in f.backends.iter() {
            self.matches
                .insert(
                    AffinityMatchKey {
                        id: f.id,
                        backend: *b,
                    },
                    0,
                    0,
                )
                .unwrap();
        }
        if let Some(m) = self.service_stats.as_mut() {
            // A hash allocated as written may refuse for a moment (ENOMEM) while the kernel's
            // caches refill: tried again as the agent tries, for longer (30 tries, about 2 s:
            // the fixtures run beside whole test suites).
            svc_agent::store::retry_enomem(30, || {
                m.insert(f.id, svc_common::ServiceStats::default(), 0)
            })
            .unwrap_or_else(|e| panic!("SVC_SERVICE_STATS [{}]: {e}", f.id));
        }
        let mut flags = f.flags;
        if f.affinity_s != 0 {
            flags |= svc_flags::AFFINITY;
        }
        let v = ServiceValue {
            id: f.id,
            count: f.backends.len() as u16,
            rev,
            flags,
            _pad0: 0,
            affinity_timeout_s: f.affinity_s,
            affinity_id: match (f.affinity_s, f.affinity_id) {
                (0, _) => 0,
                (_, 0) => f.id,
                (_, a) => a,
            },
        };
        self.services.insert(key, v, 0).unwrap();
        if f.scope == scope::EXTERNAL && !s.ip().is_unspecified() {
            // As the agent writes it: the external ingress looks only at packets to addresses
            // NODE_ADDRS holds.
            let mut a = self.node_addrs.get(&key.addr, 0).unwrap_or_default();
            a.flags |= node_addr_flags::EXTERNAL;
            self.put_node_addr(key.addr, a);
        }
        if f.scope == scope::CLUSTER && flags & svc_flags::NODEPORT == 0 {
            let marker = ServiceKey {
                port_be: 0,
                proto: PROTO_ANY,
                ..key
            };
            let mv = ServiceValue {
                flags: svc_flags::ADDR_MARKER,
                ..Default::default()
            };
            self.services.insert(marker, mv, 0).unwrap();
        }
    }

    pub fn frontend(&mut self, f: Fe<'_>) {
        self.frontend_rev(&f, 1);
    }

    /// A Maglev table of `entries` (0-based slot numbers) at entry `offset` (a multiple of
    /// `MAGLEV_BLOCK`), then the index entry of frontend generation `id`/`rev` naming it: as
    /// the agent writes one, the table before the one write that makes it used.
    pub fn maglev_table(&mut self, id: u32, rev: u16, offset: u32, entries: &[u16], seed: u64) {
        assert_eq!(offset % MAGLEV_BLOCK, 0);
        self.maglev_entries(offset, entries);
        self.maglev_index(id, rev, offset, entries.len() as u32, seed);
    }

    /// Only the table: `entries` from entry `offset` on (a multiple of `MAGLEV_BLOCK`), in
    /// the pages the agent writes it into.
    pub fn maglev_entries(&mut self, offset: u32, entries: &[u16]) {
        let blocks: Vec<MaglevBlock> = (entries.chunks(MAGLEV_BLOCK as usize))
            .map(|chunk| {
                let mut b = MaglevBlock::default();
                b.entries[..chunk.len()].copy_from_slice(chunk);
                b
            })
            .collect();
        svc_agent::store::write_maglev_pages(&mut self.maglev, offset / MAGLEV_BLOCK, &blocks)
            .unwrap();
    }

    /// Only the index entry of frontend generation `id`/`rev`.
    pub fn maglev_index(&mut self, id: u32, rev: u16, offset: u32, size: u32, seed: u64) {
        let v = MaglevIndex {
            offset,
            size,
            seed: [seed as u32, (seed >> 32) as u32],
        };
        self.maglev_index
            .insert(SlotKey { id, rev, slot: 0 }, v, 0)
            .unwrap();
    }

    pub fn src_range(&mut self, id: u32, cidr: &str) {
        let (a, len) = cidr.split_once('/').unwrap();
        let ip: IpAddr = a.parse().unwrap();
        let bits: u32 = len.parse().unwrap();
        let bits = if ip.is_ipv4() { 96 + bits } else { bits };
        let mut data = [0u8; 20];
        data[..4].copy_from_slice(&id.to_be_bytes());
        data[4..].copy_from_slice(&addr16(ip));
        self.src_ranges
            .insert(&Key::new(32 + bits, data), 0, 0)
            .unwrap();
    }

    /// The counter of `reason` on device `ifindex` (0: none, the socket hooks' and the
    /// backend choice's), summed over the CPUs.
    pub fn dev_stat(&self, ifindex: u32, reason: Reason) -> u64 {
        let key = DevStatKey {
            ifindex,
            reason: reason as u32,
        };
        self.dev_stats
            .get(&key, 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }

    /// Every counter of device `ifindex` that is not zero.
    pub fn dev_stats_of(&self, ifindex: u32) -> BTreeMap<Reason, u64> {
        Reason::ALL
            .into_iter()
            .map(|r| (r, self.dev_stat(ifindex, r)))
            .filter(|(_, n)| *n != 0)
            .collect()
    }

    /// Frontend `id`'s per-Service counter of `reason`.
    pub fn service_stat(&self, id: u32, reason: Reason) -> u64 {
        let slot = reason.service_slot() as usize;
        self.service_stats
            .as_ref()
            .and_then(|m| m.get(&id, 0).ok())
            .map_or(0, |v| v.counts[slot])
    }

    /// A counter without a device (`dev_stat` of device 0).
    pub fn stat(&self, reason: Reason) -> u64 {
        self.dev_stat(0, reason)
    }

    pub fn ifindex_of(&self, prog: Prog) -> u32 {
        match prog {
            Prog::ExtIngress | Prog::ExtEgress | Prog::Xdp => self.ext0,
            Prog::PodIngress | Prog::PodEgress => self.pod0,
        }
    }

    /// Runs `input` through `prog` on device `ifindex` (`repeat` times); the verdict, the
    /// packet as it left, and the mean time of one run (ns).
    pub fn run_on(
        &self,
        prog: Prog,
        ifindex: u32,
        input: &[u8],
        repeat: u32,
    ) -> (u32, Vec<u8>, u64) {
        if prog == Prog::Xdp {
            return self.run_xdp(ifindex, input, repeat);
        }
        let p: &SchedClassifier = self.ebpf.program(prog.name()).unwrap().try_into().unwrap();
        let mut out = vec![0u8; input.len() + 512];
        // struct __sk_buff: ingress_ifindex at 36, ifindex at 40 (the device BPF_PROG_TEST_RUN
        // gives the packet, in this thread's network namespace).
        let mut ctx = [0u8; 192];
        ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        let r = p
            .test_run(TestRunOptions {
                data_in: Some(input),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat,
                ..Default::default()
            })
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {}: {e}", prog.name()));
        out.truncate(r.data_size_out as usize);
        (
            r.return_value,
            out,
            // The kernel reports the mean time of one run already.
            r.duration.as_nanos() as u64,
        )
    }

    /// `run_on` for the XDP program: the packet arrives on `ifindex`, receive queue 0.
    fn run_xdp(&self, ifindex: u32, input: &[u8], repeat: u32) -> (u32, Vec<u8>, u64) {
        let p: &Xdp = self
            .ebpf
            .program(Prog::Xdp.name())
            .unwrap()
            .try_into()
            .unwrap();
        let mut out = vec![0u8; input.len() + 512];
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
        // egress_ifindex. data_end must be the packet's length, the others 0.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(input.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let r = p
            .test_run(TestRunOptions {
                data_in: Some(input),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat,
                ..Default::default()
            })
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {}: {e}", Prog::Xdp.name()));
        out.truncate(r.data_size_out as usize);
        (r.return_value, out, r.duration.as_nanos() as u64)
    }

    /// Runs the connection-tracking sweep once, as the agent does; how many entries it
    /// removed.
    pub fn sweep(&self) -> u32 {
        self.sweep_timed().0
    }

    /// `sweep`, and how long it took in the kernel.
    pub fn sweep_timed(&self) -> (u32, Duration) {
        let p: &SchedClassifier = self.ebpf.program(SWEEP).unwrap().try_into().unwrap();
        // The sweep reads no packet, but BPF_PROG_TEST_RUN of a classifier wants an Ethernet
        // header's worth.
        let input = [0u8; 64];
        let r = p
            .test_run(TestRunOptions {
                data_in: Some(&input),
                ..Default::default()
            })
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {SWEEP}: {e}"));
        (r.return_value, r.duration)
    }

    /// (run count, run time in ns) of `prog` so far, as bpf_stats count them.
    pub fn prog_stats(&self, prog: Prog) -> (u64, u64) {
        let info = self
            .ebpf
            .program(prog.name())
            .unwrap()
            .info()
            .expect("program info");
        (info.run_count(), info.run_time().as_nanos() as u64)
    }

    /// The entry at `key`, in whichever table holds it.
    pub fn ct_entry(&self, key: &CtKey) -> Option<CtValue> {
        self.ct
            .get(key, 0)
            .or_else(|_| self.ct_new.get(key, 0))
            .ok()
    }

    /// Stores `v` at `key`: in the table that holds the key, else in the one its flags say
    /// (`ct_flags::UNASSURED`: the unassured one), as the datapath keeps a key in one.
    pub fn ct_put(&mut self, key: CtKey, v: CtValue) {
        let new = if self.ct.get(&key, 0).is_ok() {
            false
        } else if self.ct_new.get(&key, 0).is_ok() {
            true
        } else {
            v.flags & ct_flags::UNASSURED != 0
        };
        let table = if new { &mut self.ct_new } else { &mut self.ct };
        table
            .insert(key, v, 0)
            .expect("a connection-tracking entry");
    }

    /// Removes the entry at `key` from whichever table holds it; whether one did.
    pub fn ct_remove(&mut self, key: &CtKey) -> bool {
        let a = self.ct.remove(key).is_ok();
        let b = self.ct_new.remove(key).is_ok();
        a || b
    }

    /// Every connection-tracking entry, of both tables.
    pub fn ct_all(&self) -> Vec<(CtKey, CtValue)> {
        let mut all: Vec<(CtKey, CtValue)> = self.ct.iter().filter_map(Result::ok).collect();
        all.extend(self.ct_new.iter().filter_map(Result::ok));
        all
    }

    /// Fills connection tracking with `n` entries, as busy traffic leaves it: established
    /// flows of other clients (100.64.0.0/10) to the NodePort of frontend 1, both entries of
    /// each, fresh.
    pub fn fill_ct(&mut self, n: u32) {
        let now = coarse_ns();
        for i in 0..n / 2 {
            let client = format!(
                "{}:{}",
                std::net::Ipv4Addr::from(0x6440_0000 | (i >> 6)),
                10_000 + (i & 63)
            );
            self.put_flow(&client, IPPROTO_TCP, ct_flags::SEEN_REPLY, now, now);
        }
    }

    /// Stores both entries of a flow from `client` to the NodePort of frontend 1 (its
    /// local backend), with `flags`, each direction last seen at its own time; their keys.
    pub fn put_flow(
        &mut self,
        client: &str,
        proto: u8,
        flags: u16,
        fwd_seen: u64,
        rep_seen: u64,
    ) -> (CtKey, CtKey) {
        let (frontend, backend) = ("192.0.2.10:30080", "10.244.1.5:8080");
        let fwd_key = ct_key(client, frontend, proto, ct_dir::FORWARD);
        let entry = |to: &str, seen: u64| CtValue {
            nat_addr: addr16(sa(to).ip()),
            nat_port_be: sa(to).port().to_be(),
            flags,
            id: 1,
            ifindex: self.ext0,
            last_seen_ns: seen,
            ..Default::default()
        };
        let (fwd, rep) = (entry(backend, fwd_seen), entry(frontend, rep_seen));
        let rep_key = fwd_key.partner(&fwd);
        for (k, v) in [(fwd_key, fwd), (rep_key, rep)] {
            self.ct_put(k, v);
        }
        (fwd_key, rep_key)
    }
}

/// The key of a flow's entry, from "addr:port" strings.
pub fn ct_key(src: &str, dst: &str, proto: u8, dir: u8) -> CtKey {
    let (s, d) = (sa(src), sa(dst));
    CtKey {
        saddr: addr16(s.ip()),
        daddr: addr16(d.ip()),
        sport_be: s.port().to_be(),
        dport_be: d.port().to_be(),
        proto,
        dir,
        _pad0: [0; 2],
    }
}
