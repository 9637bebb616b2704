//! Map keys, values and constants shared by the kernel programs and the agent.
//!
//! One model of services and backends serves every datapath: addresses are always 16 bytes,
//! IPv4 stored as an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), so an IPv6 socket that
//! connects to a mapped address finds the same entry as an IPv4 socket does.
//!
//! Byte order is stated per field: `_be` fields hold network byte order (the bytes as on the
//! wire), everything else is host byte order. No `bool` or `Option`: every byte is explicit,
//! padding included, so a key compares equal exactly when its fields do.
#![no_std]

/// The type of a map, named as aya's `MapType` names it, so an error message reads the same
/// whichever side it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    Hash,
    Array,
    PerCpuHash,
    PerCpuArray,
    LruHash,
    LpmTrie,
    SkStorage,
    RingBuf,
    DevMapHash,
}

impl MapKind {
    /// The kernel's `bpf_map_type` number.
    pub const fn bpf_type(self) -> u32 {
        match self {
            MapKind::Hash => 1,
            MapKind::Array => 2,
            MapKind::PerCpuHash => 5,
            MapKind::PerCpuArray => 6,
            MapKind::LruHash => 9,
            MapKind::LpmTrie => 11,
            MapKind::SkStorage => 24,
            MapKind::RingBuf => 27,
            MapKind::DevMapHash => 25,
        }
    }
}

/// `map_flags`: entries allocated as they are written, not all at creation.
pub const BPF_F_NO_PREALLOC: u32 = 1;

/// `map_flags`: an array userspace may map into its memory (Linux 5.5), to read it whole
/// without a syscall per element.
pub const BPF_F_MMAPABLE: u32 = 1 << 10;

/// `map_flags`: programs may only read the map. The kernel sets it on every devmap itself
/// (`dev_map_init_map`), so a pinned devmap shows it though no one asked for it.
pub const BPF_F_RDONLY_PROG: u32 = 1 << 7;

/// One map of the kernel object: what the object declares, and what the agent does with it.
/// The kernel's `#[btf_map]` statics (svc-ebpf) are checked against these by the agent's
/// test `catalogue_matches_the_object`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapDef {
    /// As the object declares it (`bpftool map show` prints its first 15 bytes).
    pub name: &'static str,
    /// Layout version, part of the pin name (`SVC_SERVICES_v3`), so an agent never adopts a
    /// pin whose keys or values it would misread: bump it whenever key, value or type change
    /// (the agent then builds the new map beside the old one, see
    /// docs/design/architecture.md, "Where to add: a map"). 0 for a map never pinned.
    pub version: u32,
    pub kind: MapKind,
    /// Bytes. Unchecked for `kernel_only` maps (their types are the kernel's own).
    pub key_size: u32,
    pub value_size: u32,
    /// max_entries: the default when `sized`, else what the object declares.
    pub max_entries: u32,
    /// `map_flags` (`BPF_F_NO_PREALLOC` or 0).
    pub flags: u32,
    /// Pinned under the agent's bpffs directory as `NAME_v<version>`, so it outlives the agent.
    pub pinned: bool,
    /// The agent sets max_entries at load time (`svc-agent run --max-*`, store's `Capacity`).
    pub sized: bool,
    /// The agent writes it and creates it itself when the object does not declare it (an
    /// object without the packet datapath): its first sync fills it.
    pub owned: bool,
    /// The programs write it: entries the old programs wrote while a resized copy was being
    /// filled are carried over again once the new programs are attached.
    pub carry_late: bool,
    /// The kernel's working state, private to the programs: never pinned, and only its name
    /// and type are the agent's business.
    pub kernel_only: bool,
}

impl MapDef {
    /// A pinned map of layout `version` with keys `K` and values `V`, of one entry.
    pub const fn new<K, V>(name: &'static str, version: u32, kind: MapKind) -> MapDef {
        MapDef {
            name,
            version,
            kind,
            key_size: core::mem::size_of::<K>() as u32,
            value_size: core::mem::size_of::<V>() as u32,
            max_entries: 1,
            flags: 0,
            pinned: true,
            sized: false,
            owned: false,
            carry_late: false,
            kernel_only: false,
        }
    }

    /// The programs' own working state: never pinned, sizes their own.
    pub const fn kernel_only(name: &'static str, kind: MapKind) -> MapDef {
        MapDef {
            version: 0,
            pinned: false,
            kernel_only: true,
            ..MapDef::new::<(), ()>(name, 0, kind)
        }
    }

    /// Sized by the agent, `default` entries unless told otherwise.
    pub const fn sized(self, default: u32) -> MapDef {
        MapDef {
            max_entries: default,
            sized: true,
            ..self
        }
    }

    /// `n` entries, as the object declares.
    pub const fn entries(self, n: u32) -> MapDef {
        MapDef {
            max_entries: n,
            ..self
        }
    }

    pub const fn no_prealloc(self) -> MapDef {
        MapDef {
            flags: BPF_F_NO_PREALLOC,
            ..self
        }
    }

    pub const fn mmapable(self) -> MapDef {
        MapDef {
            flags: BPF_F_MMAPABLE,
            ..self
        }
    }

    pub const fn owned(self) -> MapDef {
        MapDef {
            owned: true,
            ..self
        }
    }

    pub const fn carry_late(self) -> MapDef {
        MapDef {
            carry_late: true,
            ..self
        }
    }

    /// Held only while a program runs (not pinned), but of types shared with the agent.
    pub const fn unpinned(self) -> MapDef {
        MapDef {
            version: 0,
            pinned: false,
            ..self
        }
    }
}

/// Expands the list of maps into the `catalogue` (one `MapDef` const per map, and `MAPS`),
/// `map_names` (each name; `ALL`, the pinned ones) and `capacity` (each max_entries): a
/// declarative macro rather than a table alone, so each map also has a name of its own that
/// the compiler checks (`map_names::CT`, `catalogue::CT`), and no second list can drift.
macro_rules! catalogue {
    ($( $(#[$doc:meta])* $id:ident = $def:expr; )*) => {
        /// Every map of the kernel object, each declared once.
        pub mod catalogue {
            use super::*;
            $( $(#[$doc])* pub const $id: MapDef = $def; )*
            /// In the order of `map_names::ALL`.
            pub const MAPS: [MapDef; [$(stringify!($id)),*].len()] = [$($id),*];

            /// The map named `name`.
            pub fn find(name: &str) -> Option<&'static MapDef> {
                MAPS.iter().find(|m| m.name == name)
            }
        }

        /// Names of the maps, as the object declares them (and `bpftool map show` prints them).
        pub mod map_names {
            use super::catalogue::MAPS;
            $( $(#[$doc])* pub const $id: &str = super::catalogue::$id.name; )*

            const PINNED: usize = {
                let (mut n, mut i) = (0, 0);
                while i < MAPS.len() {
                    if MAPS[i].pinned {
                        n += 1;
                    }
                    i += 1;
                }
                n
            };
            /// The maps pinned under the agent's directory.
            pub const ALL: [&str; PINNED] = {
                let mut out = [""; PINNED];
                let (mut i, mut j) = (0, 0);
                while i < MAPS.len() {
                    if MAPS[i].pinned {
                        out[j] = MAPS[i].name;
                        j += 1;
                    }
                    i += 1;
                }
                out
            };
        }

        /// max_entries of each map: the default for those the agent sizes (from flags at load
        /// time), else what the object declares.
        pub mod capacity {
            pub use super::ct_new_entries as ct_new;
            $( pub const $id: u32 = super::catalogue::$id.max_entries; )*
        }
    };
}

catalogue! {
    /// Frontends (slot-0 master entries) and ClusterIP address markers. Layout 3: the same
    /// entries, whose generations' slots are in `SLOTS` layout 2. A master entry leads into
    /// the slots map of its own layout: an agent upgraded from layout 2 writes a new map (the
    /// older one's entries carried over, datapath/migrate.rs), and the programs still
    /// attached keep reading the older pair until the new ones replace them, as they would
    /// not find a new generation's slots in the older slots map.
    SERVICES = MapDef::new::<ServiceKey, ServiceValue>("SVC_SERVICES", 3, MapKind::Hash)
        .sized(262_144)
        .no_prealloc();
    /// Backend slots of each frontend generation, `SLOT_GROUP` to an entry (`SlotGroup`).
    /// Layout 2: a group an entry (1 was one slot an entry, which costs as much as a group
    /// of eight from Linux 6.1 on: `SLOT_GROUP`). Sized for 2,097,152 slots, as many
    /// generations as the services map has entries, with room for a changed backend set's
    /// new slots to coexist with the old ones until those are retired.
    SLOTS = MapDef::new::<SlotKey, SlotGroup>("SVC_SLOTS", 2, MapKind::Hash)
        .sized(262_144)
        .no_prealloc();
    /// Backends (address, port, protocol), each at index `backend_index(id, max_entries)`
    /// with its id in the value (0: a free entry). Layout 2: an array, 24 bytes an entry
    /// allocated in full (1 was a hash keyed by id: a 96-byte element and 16 bytes of bucket
    /// array per entry of capacity, 100 MiB at 1,000,000 backends against 24 MiB now). Ids
    /// are still never handed out twice; the agent hands one out only where its index is
    /// free, and the programs take an entry only if it holds the id they look up, so an id
    /// whose index a later id took is missing, as a deleted key was. Mapped by the agent to be
    /// read whole (a batched read of a million entries took most of a second, the kernel
    /// copying one element at a time).
    BACKENDS = MapDef::new::<u32, Backend>("SVC_BACKENDS", 2, MapKind::Array)
        .sized(1_048_576)
        .mmapable();
    /// Frontend id to frontend: what a reply or getpeername() reports.
    REV_NAT = MapDef::new::<u32, RevNatValue>("SVC_REV_NAT", 1, MapKind::Hash)
        .sized(262_144)
        .no_prealloc();
    /// Per-socket reverse translation; LRU because sockets come and go without telling us.
    SOCK_REV = MapDef::new::<SockRevKey, SockRevValue>("SVC_SOCK_REV", 1, MapKind::LruHash)
        .sized(262_144)
        .carry_late();
    /// sessionAffinity ClientIP: each client's backend per Service port; LRU, as clients come
    /// and go. Layout 2: keyed by the Service port's affinity id.
    AFFINITY = MapDef::new::<AffinityKey, AffinityValue>("SVC_AFFINITY", 2, MapKind::LruHash)
        .sized(262_144)
        .carry_late();
    /// Frontend id to the object it came from; read by listings only.
    NAMES = MapDef::new::<u32, ServiceName>("SVC_NAMES", 1, MapKind::Hash)
        .sized(262_144)
        .no_prealloc();
    /// The agent's bookkeeping that must survive it (`MetaValue`).
    META = MapDef::new::<u32, MetaValue>("SVC_META", 1, MapKind::Array);
    /// One entry per backend of a current generation (of the frontends that check choices),
    /// sized on its own (`--max-affinity-match`): the slots of those frontends alone bound it.
    AFFINITY_MATCH = MapDef::new::<AffinityMatchKey, u32>("SVC_AFFINITY_MATCH", 1, MapKind::Hash)
        .sized(1_048_576)
        .no_prealloc();
    /// Socket local storage: keyed by socket, sized by the sockets (max_entries 0).
    SOCK_STATE = MapDef::new::<u32, SockState>("SVC_SOCK_STATE", 1, MapKind::SkStorage)
        .entries(0)
        .no_prealloc();
    /// Node addresses, external frontend addresses and lingering ones (allocated as used).
    NODE_ADDRS = MapDef::new::<[u8; 16], NodeAddrValue>("SVC_NODE_ADDRS", 1, MapKind::Hash)
        .sized(65_536)
        .no_prealloc()
        .owned();
    /// loadBalancerSourceRanges (`SrcRangeKey`).
    SRC_RANGES = MapDef::new::<SrcRangeKey, u32>("SVC_SRC_RANGES", 1, MapKind::LpmTrie)
        .sized(16_384)
        .no_prealloc()
        .owned();
    /// Connection tracking of the packet datapath's assured flows: two entries per flow.
    /// Layout 4: allocated as flows are assured, as the kernel's conntrack allocates its
    /// entries (3 was the same hash allocated in full: 42 MiB at the default capacity on a
    /// node without a flow; 2 was an LRU of every flow, before CT_NEW).
    CT = MapDef::new::<CtKey, CtValue>("SVC_CT", 4, MapKind::Hash)
        .sized(262_144)
        .no_prealloc()
        .carry_late();
    /// The packet datapath's settings (`DatapathConfig`).
    CONFIG = MapDef::new::<u32, DatapathConfig>("SVC_CONFIG", 1, MapKind::Array).owned();
    /// The datapath's counters, per CPU: (device, `Reason`), device 0 for the socket hooks.
    /// Layout 1 still: the socket hooks' reasons are numbers its keys never had.
    DEV_STATS = MapDef::new::<DevStatKey, u64>("SVC_DEV_STATS", 1, MapKind::PerCpuHash)
        .sized(4_096);
    /// The filter in front of `NODE_ADDRS` (`NODE_ADDR_BIT_WORDS`).
    NODE_ADDR_BITS = MapDef::new::<u32, u64>("SVC_NODE_ADDR_BITS", 1, MapKind::Array)
        .entries(NODE_ADDR_BIT_WORDS)
        .owned();
    /// Connection tracking of flows not assured yet (svc-ebpf's maps.rs); sized with `CT`
    /// (`capacity::ct_new`).
    CT_NEW = MapDef::new::<CtKey, CtValue>("SVC_CT_NEW", 1, MapKind::LruHash)
        .sized(ct_new_entries(CT.max_entries))
        .carry_late();
    /// Maglev tables of external frontends (docs/design/maglev.md), each at an offset the
    /// agent allocates, in pages of `MAGLEV_PAGE` blocks keyed by page number. Layout 2: a
    /// hash allocated as pages are written (1 was an array of blocks allocated in full, 32 MiB
    /// at the default 16,777,216 entries whether a table was written or not). Small until the
    /// agent sizes it (`--max-maglev-entries`).
    MAGLEV = MapDef::new::<u32, MaglevPage>("SVC_MAGLEV", 2, MapKind::Hash)
        .sized(1_024)
        .no_prealloc();
    /// Where the table of a frontend generation is (`SlotKey` with slot 0).
    MAGLEV_INDEX = MapDef::new::<SlotKey, MaglevIndex>("SVC_MAGLEV_INDEX", 1, MapKind::Hash)
        .sized(SERVICES.max_entries)
        .no_prealloc();
    /// Not pinned (claims held only while a program runs: svc-ebpf's `ct::claim`), so not
    /// in `ALL`.
    CT_CLAIMS = MapDef::new::<CtKey, u32>("SVC_CT_CLAIMS", 0, MapKind::Hash)
        .entries(4_096)
        .unpinned();
    /// Not pinned either: the ports of translated UDP datagrams whose later fragments are
    /// still to come (svc-ebpf's `frag.rs`); a datagram in flight across an agent restart
    /// loses its later fragments, as one the network loses.
    FRAGS = MapDef::kernel_only("SVC_FRAGS", MapKind::LruHash);
    /// The per-CPU working state of one packet (svc-ebpf's scratch.rs).
    SCRATCH = MapDef::kernel_only("SVC_SCRATCH", MapKind::PerCpuArray);
    SENT = MapDef::kernel_only("SVC_SENT", MapKind::PerCpuArray);
    /// svc-ebpf's tcpsum.rs: a chunk of a segment being summed.
    CSUM_BUF = MapDef::kernel_only("SVC_CSUM_BUF", MapKind::PerCpuArray);
    /// `svc-agent monitor`'s events (`MonitorEvent`), one ring per monitor slot (index 0..3
    /// of `MON_CTL`), written only while that slot's lease is current
    /// (docs/design/monitor.md). max_entries is the ring's size in bytes.
    MON_RING_0 = MapDef::new::<(), ()>("SVC_MON_RING_0", 1, MapKind::RingBuf).entries(MONITOR_RING_BYTES);
    MON_RING_1 = MapDef::new::<(), ()>("SVC_MON_RING_1", 1, MapKind::RingBuf).entries(MONITOR_RING_BYTES);
    MON_RING_2 = MapDef::new::<(), ()>("SVC_MON_RING_2", 1, MapKind::RingBuf).entries(MONITOR_RING_BYTES);
    MON_RING_3 = MapDef::new::<(), ()>("SVC_MON_RING_3", 1, MapKind::RingBuf).entries(MONITOR_RING_BYTES);
    /// The monitors' slots (`MonitorCtl`, one per slot); each monitor writes its own. Layout
    /// 2: `MONITOR_SLOTS` entries (1 was one monitor's lease).
    MON_CTL = MapDef::new::<u32, MonitorCtl>("SVC_MON_CTL", 2, MapKind::Array).entries(MONITOR_SLOTS);
    /// Which slots may be listening (`MonitorOn`): the one word every decision point reads.
    MON_ON = MapDef::new::<u32, MonitorOn>("SVC_MON_ON", 1, MapKind::Array);
    /// Per CPU and per slot: the events seen, written and lost (`MonitorStats`). Layout 2:
    /// `MONITOR_SLOTS` entries (1 was one monitor's).
    MON_STATS = MapDef::new::<u32, MonitorStats>("SVC_MON_STATS", 2, MapKind::PerCpuArray).entries(MONITOR_SLOTS);
    /// The event being written (svc-ebpf's monitor.rs), per CPU: built once, copied into each
    /// listening slot's ring.
    MON_EVENT = MapDef::kernel_only("SVC_MON_EVENT", MapKind::PerCpuArray);
    /// Per-Service counters (`ServiceStats`), keyed by frontend id: the agent creates an
    /// entry (zeroed) with a frontend's name and deletes it with the name; the programs only
    /// look entries up and add atomically, so a frontend without one
    /// (`--per-service-metrics=false`) is not counted. Allocated as written, 128 bytes an
    /// entry whatever the CPUs. Layout 2: one value shared by the CPUs (1 was a per-CPU hash,
    /// 64 bytes a possible CPU an entry: docs/design/metrics.md).
    SERVICE_STATS = MapDef::new::<u32, ServiceStats>("SVC_SERVICE_STATS", 2, MapKind::Hash)
        .sized(262_144)
        .no_prealloc();
    /// The devices XDP may redirect to (docs/design/xdp.md, "Another device"): those that
    /// carry `xdp_ext` at the driver's hook, keyed by ifindex (host order), each value the
    /// kernel's `struct bpf_devmap_val` (the same ifindex, no chained program). A hash, not
    /// an array: ifindexes are sparse and grow with every device a node ever made, and the
    /// route lookup names the device by its ifindex, which is then the key as it is.
    XDP_DEVS = MapDef::new::<u32, u64>("SVC_XDP_DEVS", 1, MapKind::DevMapHash).entries(256);
}

/// Each monitor slot's ring: 256 KiB, about 2,300 events (`MonitorEvent` and the ring's
/// 8-byte header each) between two reads of a monitor that wakes at least every 100 ms.
pub const MONITOR_RING_BYTES: u32 = 256 * 1024;

/// How many monitors may listen at once, each in a slot of its own (`MonitorCtl`, a ring, its
/// counters). A ring buffer has one consumer position, so each monitor needs a ring of its own
/// to see every event; a fixed number keeps the programs' loop over them bounded.
pub const MONITOR_SLOTS: u32 = 4;

/// The slots' rings, by slot.
pub const MON_RINGS: [&str; MONITOR_SLOTS as usize] = [
    map_names::MON_RING_0,
    map_names::MON_RING_1,
    map_names::MON_RING_2,
    map_names::MON_RING_3,
];

/// `MonitorCtl::flags`.
pub mod monitor_flags {
    /// Every packet of a known flow is an event (`svc-agent monitor --packets`); without it,
    /// only those that change the flow's state (a FIN, the second FIN, an RST).
    pub const PACKETS: u32 = 1 << 0;
}

/// `MonitorEvent::source`: which hook decided.
pub mod monitor_source {
    /// connect() (socket hooks).
    pub const CONNECT: u8 = 1;
    /// sendmsg() on a UDP socket.
    pub const SENDMSG: u8 = 2;
    /// recvmsg()/getpeername(): a backend reported as its frontend.
    pub const REVERSE: u8 = 3;
    /// The tc programs and the XDP program (`MonitorEvent::ifindex` names the device; XDP's
    /// own decisions have `xdp_` reasons, the drops it shares with tc tc's reasons).
    pub const TC: u8 = 4;
    /// The connection-tracking sweep (svc-ebpf's `gc.rs`, which the agent runs every
    /// `--conntrack-sweep-interval`): a dead flow removed (`Reason::CtSwept`).
    pub const SWEEP: u8 = 5;
}

/// One datapath decision, as the programs write it into the ring of each monitor slot that
/// listens (`MON_RINGS`). 112 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MonitorEvent {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC), host order.
    pub ts_ns: u64,
    /// The socket's cookie (socket hooks), host order; 0 from tc.
    pub cookie: u64,
    /// A `Reason`, as its number (host order): `Translated`, `RefusedNoBackend`, `New`, ...
    pub reason: u32,
    /// The frontend's id (host order): `SVC_NAMES` and `SVC_REV_NAT` key; 0 when the
    /// destination was no frontend (`RefusedNoPort`).
    pub id: u32,
    /// The chosen backend's id (host order); 0 when none was chosen or the hook does not know
    /// it (tc).
    pub backend_id: u32,
    /// The device a tc program ran on (host order); 0 for the socket hooks.
    pub ifindex: u32,
    /// As the client sent it: source (tc only; zero from the socket hooks, where the socket
    /// may not be bound yet) and destination. Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// After translation: source (the SNAT address, or the client) and destination (the
    /// backend); zero when nothing was translated. Network byte order, IPv4 mapped.
    pub nat_saddr: [u8; 16],
    pub nat_daddr: [u8; 16],
    /// Network byte order, matching the addresses above.
    pub sport_be: u16,
    pub dport_be: u16,
    pub nat_sport_be: u16,
    pub nat_dport_be: u16,
    pub proto: u8,
    /// A `how` constant: the socket hooks' choices, and a new flow's at tc (`New`); 0 when
    /// unknown. From tc and XDP, a known flow's packet (`CtHit`, `Reply`, `XdpCtHit`,
    /// `XdpReply`, and `XdpRedirect`, `XdpRedirectReply` when redirected) and a swept flow
    /// (`CtSwept`) carry the low byte of the flow's `ct_flags` here instead; a new flow's
    /// first packet redirected at XDP (`XdpRedirect` too) carries 0: XDP's new-flow event
    /// carries neither flags nor the choice.
    pub how: u8,
    /// A `monitor_source` constant.
    pub source: u8,
    /// `IcmpError` only: the ICMP (or ICMPv6) type and code of the error; 0 otherwise.
    pub icmp_type: u8,
    pub icmp_code: u8,
    pub _pad0: [u8; 3],
}

/// One entry of `SVC_MON_CTL`: a monitor slot. A lease, so a monitor killed without a word
/// stops the writing into its ring by itself (docs/design/monitor.md).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MonitorCtl {
    /// Events are written into this slot's ring until this CLOCK_MONOTONIC time (ns, host
    /// order); 0: the slot is free. The monitor renews it; a program that finds it past
    /// writes it 0.
    pub until_ns: u64,
    /// One event in `sample` is written, per CPU (host order); 0 and 1 write all.
    pub sample: u32,
    /// The listening monitor's process id (host order), so one refused can say who listens.
    pub pid: u32,
    /// `monitor_flags` bits (host order).
    pub flags: u32,
    pub _pad0: u32,
}

/// `SVC_MON_ON`'s one entry: the summary every decision point reads (nonzero `slots`: some
/// monitor may be listening). The monitors set their bits; a program clears a slot's bit when
/// it finds the slot's lease over. A hint, not the authority: the writer checks each slot's
/// `MonitorCtl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MonitorOn {
    /// Bit i: slot i may hold a current lease (host order).
    pub slots: u32,
    /// Bit i: slot i asked for every packet of known flows (`monitor_flags::PACKETS`).
    pub packets: u32,
}

/// `SVC_MON_STATS`, per CPU and slot (host order): events that happened while the slot's
/// monitor listened (of a kind it asked for), those written, and those lost because its ring
/// was full. Seen minus written minus lost were sampled out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MonitorStats {
    pub seen: u64,
    pub written: u64,
    pub lost: u64,
}

/// The unassured flows' table (an LRU, allocated in full) for an assured table of `ct`
/// entries: a quarter of it, at least 256 entries. It holds handshakes in flight (and a
/// flood's spoofed SYNs, which churn it), not connections.
pub const fn ct_new_entries(ct: u32) -> u32 {
    let q = ct / 4;
    if q < 256 {
        256
    } else {
        q
    }
}

/// Layout versions of the maps (`MapDef::version`).
/// Pins of maps that are no longer in the catalogue, as released agents left them: an agent
/// removes them once its programs are attached (and `uninstall` does), as it removes a pin of
/// another layout version. A counter map's entries are not carried over: they start again.
/// `SVC_STATS`: the socket hooks' counter array, whose reasons `DEV_STATS` counts now under
/// device 0 (unversioned, as the first release pinned it, and layout 1). `SVC_MONITOR`: the
/// one monitor's ring, now one a slot (`MON_RINGS`).
pub const RETIRED_PINS: &[&str] = &["SVC_STATS", "SVC_STATS_v1", "SVC_MONITOR_v1"];

pub mod layout {
    /// The layout version of `map`; 0 for a name that is not one of ours.
    pub fn version(map: &str) -> u32 {
        super::catalogue::find(map).map_or(0, |m| m.version)
    }
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// `ServiceKey::proto` of the marker entry that says "this address is a ClusterIP": any port or
/// protocol it does not define is refused rather than routed.
pub const PROTO_ANY: u8 = 0;

/// A service frontend: (VIP, port, protocol). With `port_be == 0` and `proto == PROTO_ANY` it is
/// the address marker entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceKey {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Network byte order.
    pub port_be: u16,
    /// IPPROTO_TCP, IPPROTO_UDP, or PROTO_ANY for the address marker.
    pub proto: u8,
    /// Reserved for the scope of the packet datapath (external / internal); 0 today.
    pub scope: u8,
}

/// `ServiceValue::flags` bits.
pub mod svc_flags {
    /// sessionAffinity: ClientIP.
    pub const AFFINITY: u16 = 1 << 0;
    /// The entry is the address marker (see `PROTO_ANY`), not a frontend.
    pub const ADDR_MARKER: u16 = 1 << 1;
    /// internalTrafficPolicy: Local was applied when the slots were chosen.
    pub const INTERNAL_LOCAL: u16 = 1 << 2;
    /// externalTrafficPolicy: Local was applied when the slots were chosen (external scope
    /// only): every backend is on this node, the client's address is kept (no SNAT), and no
    /// backend means the packet is dropped, as kube-proxy does.
    pub const EXTERNAL_LOCAL: u16 = 1 << 3;
    /// A LoadBalancer frontend with loadBalancerSourceRanges: a client must match an entry of
    /// `SRC_RANGES` for this frontend id.
    pub const SOURCE_RANGES: u16 = 1 << 4;
    /// A NodePort frontend: keyed by `NODEPORT_ADDR_V4`/`_V6`, it answers on every address in
    /// `NODE_ADDRS` that has `node_addr_flags::NODEPORT`.
    pub const NODEPORT: u16 = 1 << 5;
    /// The frontend is an ExternalIP (either scope). Informational (listings, metrics): the
    /// programs need not read it.
    pub const EXTERNAL_IP: u16 = 1 << 6;
    /// The frontend is a LoadBalancer ingress IP (either scope). Informational, as
    /// `EXTERNAL_IP`.
    pub const LOAD_BALANCER: u16 = 1 << 7;
    /// A new flow's backend comes from the Maglev table of this generation
    /// (`MAGLEV_INDEX`), where the caller hashes flows (the external ingress); else, or when
    /// the table is missing, at random.
    pub const MAGLEV: u16 = 1 << 8;
}

/// `ServiceKey::scope`: who a frontend is for.
pub mod scope {
    /// Traffic that starts on this node (pods' and the node's sockets, and pods whose packets
    /// the per-packet ClusterIP path translates): ClusterIPs, and the node-local view of
    /// NodePorts, ExternalIPs and LoadBalancer IPs (kube-proxy sends such traffic to every
    /// endpoint, whatever externalTrafficPolicy says).
    pub const CLUSTER: u8 = 0;
    /// Packets that arrive from outside the node on its external devices: NodePorts,
    /// ExternalIPs, LoadBalancer IPs, with externalTrafficPolicy applied.
    pub const EXTERNAL: u8 = 1;
}

/// The address of a NodePort frontend's key (IPv4 family): any node address.
pub const NODEPORT_ADDR_V4: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0];
/// The address of a NodePort frontend's key (IPv6 family): any node address.
pub const NODEPORT_ADDR_V6: [u8; 16] = [0; 16];

/// `Backend::flags` bits.
pub mod backend_flags {
    /// The endpoint runs on this node: packets to it are DNATed only (the client's address is
    /// kept); packets to other nodes' endpoints are DNATed and SNATed to a node address.
    pub const LOCAL: u8 = 1 << 0;
}

/// `NodeAddrValue::flags` bits.
pub mod node_addr_flags {
    /// NodePorts answer on this address (kube-proxy's --nodeport-addresses).
    pub const NODEPORT: u32 = 1 << 0;
    /// Usable as the source of SNATed packets to other nodes' endpoints.
    pub const SNAT: u32 = 1 << 1;
    /// An ExternalIP or LoadBalancer IP of a programmed EXTERNAL frontend. Not a node address.
    pub const EXTERNAL: u32 = 1 << 2;
    /// Neither a node address nor an external frontend's any more, but svc's FORWARD entries
    /// may still be addressed to it (an established flow of a deleted Service goes on, as
    /// under conntrack): kept until the agent finds none.
    pub const LINGER: u32 = 1 << 3;
    /// A loopback address NodePorts answer on for the node's own sockets (kube-proxy's
    /// localhost NodePorts: iptables mode, IPv4). Only the socket hooks honour it, and only
    /// for a socket in the node's network namespace (`DatapathConfig::host_netns`): a pod's
    /// loopback is its own, and a packet to loopback arriving on a device is a martian
    /// (CVE-2020-8558), which the tc programs leave to the kernel.
    pub const LOCALHOST: u32 = 1 << 4;
    /// The bits that make it one of the node's own addresses.
    pub const OF_NODE: u32 = NODEPORT | SNAT | LOCALHOST;
}

/// An address the external ingress looks at (key of `NODE_ADDRS`: the address, network byte
/// order, IPv4 as `::ffff:a.b.c.d`): one of this node's, an external frontend's, or one svc
/// may still have flows to. A packet to any other address is neither a known flow nor a new
/// one, and skips the connection-tracking and frontend lookups.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct NodeAddrValue {
    /// `node_addr_flags` bits.
    pub flags: u32,
    /// The device that carries it (host order); 0 if unknown.
    pub ifindex: u32,
}

/// Words (u64, host order) of `NODE_ADDR_BITS`: a filter in front of `NODE_ADDRS`, one bit per
/// value of `node_addr_bit`. The agent sets an address's bit before it puts the address in
/// `NODE_ADDRS` and clears it only once no address there has it, so, while it alone writes
/// both, a clear bit means the address is not there: most packets through a node (to pods, to
/// other hosts) skip the hash lookup, which was about a third of such a packet's cost at the
/// external ingress.
pub const NODE_ADDR_BIT_WORDS: u32 = 1024;

/// The bit of `NODE_ADDR_BITS` that stands for `addr` (a `NODE_ADDRS` key), below
/// `NODE_ADDR_BIT_WORDS * 64`. Hashes the last 8 bytes, where node, pod and frontend addresses
/// differ (an IPv4 address whole; an IPv6 address's interface identifier): a multiplicative
/// hash of their two halves XORed, its top 16 bits.
#[inline(always)]
pub fn node_addr_bit(addr: &[u8; 16]) -> u32 {
    let w = u32::from_le_bytes([addr[8], addr[9], addr[10], addr[11]])
        ^ u32::from_le_bytes([addr[12], addr[13], addr[14], addr[15]]);
    w.wrapping_mul(0x9e37_79b1) >> 16
}

/// Key of the `SRC_RANGES` LPM trie: a LoadBalancer frontend's loadBalancerSourceRanges.
/// `prefixlen` counts the bits of `id` (always 32) plus the bits of the range's prefix
/// (IPv4 ranges count from bit 96 of the mapped address: a /8 is 32 + 96 + 8). The value is a
/// `u32`, reserved (0): a match is all that counts.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SrcRangeKey {
    /// Host order (the LPM trie's header).
    pub prefixlen: u32,
    /// Frontend id, network byte order (so it is the leading, always-matched part).
    pub id_be: u32,
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
}

/// A connection-tracking entry's key: a packet's tuple as it travels, in one direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtKey {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Network byte order (for ICMP echo: the identifier in both).
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// `ct_dir`.
    pub dir: u8,
    pub _pad0: [u8; 2],
}

/// `CtKey::dir`.
pub mod ct_dir {
    /// Client to frontend, as the client sent it.
    pub const FORWARD: u8 = 0;
    /// Backend to client (or to the SNAT address), as the backend sends its reply.
    pub const REPLY: u8 = 1;
}

/// `CtValue::flags` bits.
pub mod ct_flags {
    /// The flow is SNATed to `CtValue::snat_addr`:`snat_port_be` (a backend on another node).
    pub const SNAT: u16 = 1 << 0;
    /// A reply has been seen.
    pub const SEEN_REPLY: u16 = 1 << 1;
    /// TCP: a FIN was seen, either way (half-closed: the other way may still send, so the
    /// flow lives on for `ct_timeout::TCP_HALF_CLOSED_S`). With an RST, or a FIN each way
    /// (`FIN_FORWARD` and `FIN_REPLY`), the flow is closed (the short closing timeout
    /// applies): a new connection may take its tuples (a SYN on them, a SNAT port search).
    pub const FIN: u16 = 1 << 2;
    /// TCP: an RST was seen.
    pub const RST: u16 = 1 << 3;
    /// Translated by the per-packet ClusterIP path (pod devices), not the external one.
    pub const POD: u16 = 1 << 4;
    /// TCP: a FIN was seen from the client (`FORWARD` direction); set with `FIN`.
    pub const FIN_FORWARD: u16 = 1 << 5;
    /// TCP: a FIN was seen from the backend (`REPLY` direction); set with `FIN`.
    pub const FIN_REPLY: u16 = 1 << 6;
    /// On a FORWARD entry: the node's conntrack carries the flow (a NATed entry `svc-agent
    /// uninstall` made); the client's packets go to the stack untranslated, for netfilter to
    /// translate.
    pub const HANDED: u16 = 1 << 7;
    /// On a FORWARD entry of a flow that goes through the node's stack: `svc-agent
    /// uninstall` is making the node's conntrack entry for it, and will mark it `HANDED`
    /// next. Until then the client's packets are dropped and change nothing in the entry (TCP
    /// sends a segment again; a UDP datagram is lost): translated beside the new kernel
    /// entry, one would be taken for a new connection and reset. The mark holds while fewer
    /// than `HANDING_HOLD_S` whole seconds have passed since `CtValue::handing_s` (2 to 3 s),
    /// so one left by an uninstall killed in between lapses.
    pub const HANDING: u16 = 1 << 8;
    /// See `HANDING`: making one kernel entry takes milliseconds.
    pub const HANDING_HOLD_S: u16 = 3;
    /// The flow is not assured (conntrack's SYN_SENT / SYN_RECV, or a UDP flow that is no
    /// stream yet): set on every new flow's entries; cleared for TCP by the client's first
    /// ACK after the backend's SYN-ACK, for UDP and ICMP echo by the client's first packet
    /// after a reply (conntrack assures a UDP flow once it is a stream). Such a flow lives in
    /// `SVC_CT_NEW`, the LRU table a flood churns, and moves to `SVC_CT`, which nothing
    /// evicts, when it is assured. A TCP one lives `ct_timeout::TCP_SYN_S`, not a day, and
    /// its SNAT port goes to a new flow that finds the range busy, as conntrack drops
    /// unassured entries first: spoofed SYNs a backend answers cannot hold a range. Entries
    /// of a datapath from before this bit lack it and count as assured.
    pub const UNASSURED: u16 = 1 << 9;
    /// TCP: the entries track where each side's sequence numbers are (`CtValue::seq_end`),
    /// so an RST or a FIN is taken only where its sender is, the first reply only when it
    /// acknowledges the client's SYN, and the handshake completes only with an ACK of the
    /// backend's SYN-ACK, as conntrack checks them. Entries carried over from a datapath that
    /// did not track lack it, and are taken as before.
    pub const TRACKED: u16 = 1 << 10;

    /// Whether a flow with `flags` is closed (an RST, or a FIN each way): its tuples, and its
    /// SNAT port, go to the next new connection that needs them. Not after one FIN: the other
    /// side may still send data (a half-close) and its socket still owns the tuple, so a new
    /// SYN on it could start nothing but would cut the live half.
    #[inline(always)]
    pub const fn closed(flags: u16) -> bool {
        flags & RST != 0 || flags & (FIN_FORWARD | FIN_REPLY) == FIN_FORWARD | FIN_REPLY
    }
}

/// A connection-tracking entry. In a `FORWARD` entry `nat_*` is the backend and `snat_*` the
/// source the packet leaves with (if `SNAT`); in a `REPLY` entry `nat_*` is the frontend the
/// reply must come from and `snat_*` the client it must go to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtValue {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub nat_addr: [u8; 16],
    pub snat_addr: [u8; 16],
    /// Network byte order.
    pub nat_port_be: u16,
    pub snat_port_be: u16,
    /// `ct_flags` bits.
    pub flags: u16,
    /// With `ct_flags::HANDING`: the datapath clock's whole seconds, modulo 65,536, when it
    /// was set (host order); else 0.
    pub handing_s: u16,
    /// Frontend id (host order), for metrics and explaining a flow.
    pub id: u32,
    /// Where replies leave: the device the flow came in on (host order).
    pub ifindex: u32,
    /// The datapath clock (CLOCK_MONOTONIC_COARSE) at the last packet in either direction.
    pub last_seen_ns: u64,
    /// TCP with `ct_flags::TRACKED` (host order): the sequence number just past the last this
    /// direction's sender was seen to send (sequence number plus length, a SYN and a FIN
    /// counting one). A REPLY entry's is known once `SEEN_REPLY`.
    pub seq_end: u32,
    pub _pad0: u32,
}

/// `CtValue` of layout 1 of `SVC_CT` (before sequence tracking), read when an agent carries
/// the flows of a pinned map of that layout over (`svc-agent`'s datapath).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtValueV1 {
    pub nat_addr: [u8; 16],
    pub snat_addr: [u8; 16],
    pub nat_port_be: u16,
    pub snat_port_be: u16,
    pub flags: u16,
    pub handing_s: u16,
    pub id: u32,
    pub ifindex: u32,
    pub last_seen_ns: u64,
}

impl From<CtValueV1> for CtValue {
    /// Untracked (no `TRACKED`): its RSTs and FINs are taken as that datapath took them.
    fn from(v: CtValueV1) -> CtValue {
        CtValue {
            nat_addr: v.nat_addr,
            snat_addr: v.snat_addr,
            nat_port_be: v.nat_port_be,
            snat_port_be: v.snat_port_be,
            flags: v.flags,
            handing_s: v.handing_s,
            id: v.id,
            ifindex: v.ifindex,
            last_seen_ns: v.last_seen_ns,
            seq_end: 0,
            _pad0: 0,
        }
    }
}

/// Settings of the packet datapath the agent writes (the one entry of `CONFIG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct DatapathConfig {
    /// SNAT source ports, inclusive (host order); outside the node's ephemeral range.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Connection-tracking timeouts, seconds (host order). 0: the built-in default.
    pub ct_tcp_established_s: u32,
    pub ct_tcp_closing_s: u32,
    pub ct_tcp_syn_s: u32,
    pub ct_udp_s: u32,
    pub ct_udp_stream_s: u32,
    pub ct_tcp_half_closed_s: u32,
    /// The node's network namespace cookie (the agent's own), as two host-order halves, low
    /// first: a u64 would move the pinned entry's layout to 8-byte alignment. 0: unknown, and
    /// no socket is taken as the node's (`node_addr_flags::LOCALHOST` answers none).
    pub host_netns: [u32; 2],
    /// Seconds a SNATed flow must have been idle (both ways) before a new flow may take its
    /// port when the range is full; 0: `ct_timeout::SNAT_RECLAIM_IDLE_S`.
    pub snat_reclaim_idle_s: u32,
    /// Nonzero: every IPv4 loopback address (127.0.0.0/8), not only those of
    /// `node_addr_flags::LOCALHOST`, answers NodePorts for the node's own sockets, as
    /// kube-proxy's iptables mode does when its --nodeport-addresses covers all IPv4
    /// addresses (its rule then matches any local destination).
    pub localhost_net: u32,
    /// Nonzero: some frontend's port lies in the SNAT range, or a live flow still goes to
    /// such a port, so a flow may hold, as its FORWARD tuple, the reply tuple a SNAT port
    /// would give a new flow; the SNAT port search then also passes over ports whose reply
    /// tuple a live flow's FORWARD entry holds, as conntrack picks a tuple no connection uses
    /// either way. Zero saves new SNATed flows that lookup.
    pub snat_range_frontends: u32,
    pub _reserved: [u32; 2],
}

/// SNAT ports when the agent wrote no range: above Linux's default ephemeral range
/// (32768-60999) and kube-proxy's NodePort range.
pub const SNAT_PORT_MIN: u16 = 61001;
pub const SNAT_PORT_MAX: u16 = 65535;

impl DatapathConfig {
    /// The SNAT ports, inclusive: the written range, or the built-in one when none is.
    #[inline(always)]
    pub fn snat_range(&self) -> (u16, u16) {
        snat_range_of(self.snat_port_min, self.snat_port_max)
    }

    /// `host_netns` as one cookie.
    #[inline(always)]
    pub fn host_netns_cookie(&self) -> u64 {
        u64::from(self.host_netns[0]) | (u64::from(self.host_netns[1]) << 32)
    }

    /// `host_netns` from one cookie.
    pub fn set_host_netns_cookie(&mut self, cookie: u64) {
        self.host_netns = [cookie as u32, (cookie >> 32) as u32];
    }
}

/// `DatapathConfig::snat_range` of a written `min` and `max`.
#[inline(always)]
pub fn snat_range_of(min: u16, max: u16) -> (u16, u16) {
    if min == 0 || max < min {
        (SNAT_PORT_MIN, SNAT_PORT_MAX)
    } else {
        (min, max)
    }
}

impl CtKey {
    /// The key of the other direction's entry of the flow this key and `v` belong to. Shared
    /// by the kernel (ct.rs) and the agent (its handover reads both entries of a flow).
    #[inline(always)]
    pub fn partner(&self, v: &CtValue) -> CtKey {
        let snat = v.flags & ct_flags::SNAT != 0;
        if self.dir == ct_dir::FORWARD {
            // Client to frontend; the reply comes from the backend to the client, or to the
            // address the flow was SNATed to.
            let (daddr, dport_be) = if snat {
                (v.snat_addr, v.snat_port_be)
            } else {
                (self.saddr, self.sport_be)
            };
            CtKey {
                saddr: v.nat_addr,
                daddr,
                sport_be: v.nat_port_be,
                dport_be,
                proto: self.proto,
                dir: ct_dir::REPLY,
                _pad0: [0; 2],
            }
        } else {
            let (saddr, sport_be) = if snat {
                (v.snat_addr, v.snat_port_be)
            } else {
                (self.daddr, self.dport_be)
            };
            CtKey {
                saddr,
                daddr: v.nat_addr,
                sport_be,
                dport_be: v.nat_port_be,
                proto: self.proto,
                dir: ct_dir::FORWARD,
                _pad0: [0; 2],
            }
        }
    }
}

/// Connection-tracking timeouts: the built-in defaults (seconds) and which applies to an entry.
pub mod ct_timeout {
    use super::{ct_flags, DatapathConfig, IPPROTO_TCP};

    /// kube-proxy's --conntrack-tcp-timeout-established default, which it sets for the
    /// node's conntrack: an idle connection through a NodePort lives as long as under it.
    pub const TCP_ESTABLISHED_S: u32 = 86_400;
    pub const TCP_CLOSING_S: u32 = 10;
    /// A FIN one way only: the other may still send, and its peer wait for it (conntrack's
    /// CLOSE_WAIT, where a connection is once its FIN is acknowledged). kube-proxy's
    /// --conntrack-tcp-timeout-close-wait default: the side that has not closed may keep its
    /// socket open long (kubernetes#32551), and its late FIN must still be translated.
    pub const TCP_HALF_CLOSED_S: u32 = 3_600;
    pub const TCP_SYN_S: u32 = 60;
    pub const UDP_S: u32 = 30;
    /// A SNAT port held by an open flow idle this long both ways goes to a new flow that finds
    /// the range full (`DatapathConfig::snat_reclaim_idle_s`): established flows live 24 h
    /// idle as under kube-proxy, but a SNAT range holds a few thousand ports per backend
    /// (kube-proxy's masquerade about 64,000), which clients that vanished without a FIN or
    /// RST would otherwise keep for a day. The table's own LRU forgets idle flows the same way
    /// when it is full.
    pub const SNAT_RECLAIM_IDLE_S: u32 = 7_200;
    pub const UDP_STREAM_S: u32 = 120;

    /// Which timeout applies to an entry.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        TcpEstablished,
        TcpHalfClosed,
        TcpClosing,
        TcpSyn,
        Udp,
        UdpStream,
    }

    /// The timeout of an entry with `flags` of protocol `proto`.
    #[inline(always)]
    pub fn of(proto: u8, flags: u16) -> Kind {
        if proto == IPPROTO_TCP {
            if ct_flags::closed(flags) {
                Kind::TcpClosing
            } else if flags & ct_flags::FIN != 0 {
                Kind::TcpHalfClosed
            } else if flags & (ct_flags::SEEN_REPLY | ct_flags::UNASSURED) == ct_flags::SEEN_REPLY {
                Kind::TcpEstablished
            } else {
                Kind::TcpSyn
            }
        } else if flags & ct_flags::SEEN_REPLY != 0 {
            Kind::UdpStream
        } else {
            Kind::Udp
        }
    }

    impl Kind {
        /// The agent's setting for it, 0 when it wrote none. A match rather than a function
        /// pointer: BPF has no indirect calls.
        #[inline(always)]
        pub fn setting(self, c: &DatapathConfig) -> u32 {
            match self {
                Kind::TcpEstablished => c.ct_tcp_established_s,
                Kind::TcpHalfClosed => c.ct_tcp_half_closed_s,
                Kind::TcpClosing => c.ct_tcp_closing_s,
                Kind::TcpSyn => c.ct_tcp_syn_s,
                Kind::Udp => c.ct_udp_s,
                Kind::UdpStream => c.ct_udp_stream_s,
            }
        }

        /// The built-in default, seconds.
        #[inline(always)]
        pub fn default_s(self) -> u32 {
            match self {
                Kind::TcpEstablished => TCP_ESTABLISHED_S,
                Kind::TcpHalfClosed => TCP_HALF_CLOSED_S,
                Kind::TcpClosing => TCP_CLOSING_S,
                Kind::TcpSyn => TCP_SYN_S,
                Kind::Udp => UDP_S,
                Kind::UdpStream => UDP_STREAM_S,
            }
        }
    }

    /// The SNAT reclaim bound in seconds under `config` (`SNAT_RECLAIM_IDLE_S` unless set).
    #[inline(always)]
    pub fn snat_reclaim_idle_s(config: &DatapathConfig) -> u32 {
        match config.snat_reclaim_idle_s {
            0 => SNAT_RECLAIM_IDLE_S,
            v => v,
        }
    }

    /// The timeout in seconds under `config`.
    pub fn seconds(config: &DatapathConfig, proto: u8, flags: u16) -> u32 {
        let k = of(proto, flags);
        match k.setting(config) {
            0 => k.default_s(),
            v => v,
        }
    }
}

/// A counter's key (`DEV_STATS`, the kernel's one counter map): what the datapath decided, on
/// which device.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct DevStatKey {
    /// Host order. The device a tc program ran on (for `CtAssuredFull`, the device the flow
    /// came in on); 0 for the socket hooks, which have none.
    pub ifindex: u32,
    /// A `Reason`, as its number.
    pub reason: u32,
}

/// The value of `SERVICE_STATS`: one frontend's decisions on every CPU, one counter per
/// reason of `Reason::SERVICE` (in its order), host order, added to atomically. Counted once
/// per connect() or sendmsg() the socket hooks translate or refuse, and once per new flow the
/// tc programs translate, refuse or drop; never per packet of a known flow. 64 bytes: a cache
/// line.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceStats {
    pub counts: [u64; SERVICE_STAT_SLOTS],
}

/// Counters in a `ServiceStats`.
pub const SERVICE_STAT_SLOTS: usize = 8;

/// `Reason::service_slot` of a reason not counted per Service.
pub const NO_SERVICE_SLOT: u32 = u32::MAX;

/// Why the datapath counted: the one vocabulary of the socket hooks and the tc programs,
/// counted through one kernel function (svc-ebpf's `maps::count`) under (device, reason).
/// Numbered once, never renumbered: 0-21 are the numbers the packet datapath's reasons had
/// when they were counted apart (so `DEV_STATS` kept its layout), 22 on the socket hooks'.
/// `name` is the `reason` label of the metrics.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// tc: a new flow to a frontend was translated to a backend.
    New = 0,
    /// tc: a packet of a known flow was translated (either direction).
    CtHit = 1,
    /// tc: a reply was translated back to its frontend.
    Reply = 2,
    /// tc: rejected, the frontend has no usable backend (TCP RST or ICMP unreachable sent
    /// back). The socket hooks' refusal is `RefusedNoBackend`.
    RejectNoBackend = 3,
    /// tc: dropped, externalTrafficPolicy Local and no endpoint on this node.
    DropNoLocalBackend = 4,
    /// tc: dropped, the client is outside the frontend's loadBalancerSourceRanges.
    DropSourceRange = 5,
    /// tc: dropped, no SNAT port was free for the flow.
    DropSnatExhausted = 6,
    /// tc: passed untouched, a packet the parser could not read far enough (truncated,
    /// unknown extension headers); it is not ours to judge.
    PassUnparsed = 7,
    /// tc: a non-first IPv4/IPv6 fragment with no record of its datagram's ports, passed
    /// untouched. Fragments of traffic svc does not translate, and of a translated UDP
    /// datagram whose first fragment came later (out of order) or whose record is gone (the
    /// fragment map full, or older than 30 s); see `FragmentTranslated`.
    Fragment = 8,
    /// tc: an ICMP error about a translated flow was translated too.
    IcmpError = 9,
    /// A slot or backend entry was missing (an update raced the lookup): the connect() was
    /// refused, or the packet dropped.
    ErrMissingEntry = 10,
    /// tc: a connection-tracking entry could not be stored (the packet was dropped).
    ErrCtUpdate = 11,
    /// tc: the packet could not be rewritten or redirected (a helper failed, or no route or
    /// SNAT address was found for a remote backend); it was dropped.
    ErrRewrite = 12,
    /// tc: a packet the program forwards itself did not fit the route's MTU (and may not be
    /// fragmented): an ICMP fragmentation needed / ICMPv6 packet too big was sent back.
    TooBig = 13,
    /// tc: a TCP packet other than a SYN that is no flow of svc's, left to the stack, whose
    /// conntrack may carry it (a connection made before svc took over).
    PassMidstream = 14,
    /// tc: dropped, a client's packet of a flow `svc-agent uninstall` is handing over to the
    /// node's conntrack (`ct_flags::HANDING`), for the milliseconds that takes.
    DropHanding = 15,
    /// tc: dropped, a packet svc forwards itself (to a remote backend, or a reply back to the
    /// client) whose TTL or hop limit its hop would spend, as a router drops it, and answered
    /// with an ICMP time exceeded. A new flow's is dropped before it takes a SNAT port.
    DropTtl = 16,
    /// tc: dropped without its answer, an ICMP error svc would have sent about the packet
    /// (port unreachable for a frontend without backends, time exceeded) was over the rate svc
    /// sends them at, the kernel's own default for the errors it sends: 1,000 a second per
    /// CPU, 50 at once. Fragmentation needed / packet too big is never limited (PMTU discovery
    /// needs it), nor a TCP RST. Counted besides the packet's own reason.
    IcmpRateLimited = 17,
    /// tc: dropped, a TCP segment with a flag set no TCP sends (SYN+FIN, SYN+RST, FIN without
    /// ACK, no flags, ...) to a node address or frontend; it creates and changes no state, as
    /// conntrack marks such a segment INVALID.
    DropInvalidTcp = 18,
    /// tc: dropped, an RST of a known flow outside its sequence window (a blind, forged or
    /// stale one); the flow is not closed, as conntrack ignores such an RST.
    DropTcpWindow = 19,
    /// tc: a non-first fragment of a UDP datagram whose first fragment svc translated, found
    /// by the record that fragment left (`SVC_FRAGS`) and translated as a packet of its flow
    /// (addresses only: the ports and the UDP checksum are in the first fragment).
    FragmentTranslated = 20,
    /// tc: dropped, a TCP segment that would start a flow (or be refused: no backend) whose
    /// checksum is wrong (zero included, unless that is its sum), as the receiving stack would
    /// drop it and conntrack marks it INVALID; it creates no state. A segment the device
    /// verified, or that a local sender left to the device to sum, is not checked.
    DropBadChecksum = 21,
    /// Socket: connect()/sendmsg() to a frontend translated to a backend.
    Translated = 22,
    /// Socket: refused, the frontend has no usable backend.
    RefusedNoBackend = 23,
    /// Socket: refused, a known ClusterIP but no frontend for that port and protocol.
    RefusedNoPort = 24,
    /// sessionAffinity reused a client's backend (socket hooks and tc alike, counted without a
    /// device: the choice does not know it).
    AffinityHit = 25,
    /// Socket: recvmsg()/getpeername() reported a frontend instead of a backend.
    RevTranslated = 26,
    /// Socket: a per-socket reverse entry could not be stored.
    ErrSockRevUpdate = 27,
    /// A slot or backend was missing on the first try and the frontend was read again
    /// (without a device, as `AffinityHit`).
    RetriedMissingEntry = 28,
    /// Socket: an unconnected UDP socket reached the backend it used before for that frontend.
    SockSticky = 29,
    /// Socket: an unconnected UDP socket's backend had left the frontend, a live one was
    /// chosen.
    SockMoved = 30,
    /// Socket: a socket sent to more frontends than it can remember (or its state could not be
    /// created): the backend came from its cookie.
    SockHashed = 31,
    /// Socket: a reverse entry was written that sock_release cannot find (the socket's state
    /// was full or missing): only the LRU removes it.
    SockRevUntracked = 32,
    /// A remembered affinity choice was not used: expired, or its backend left the frontend
    /// (without a device, as `AffinityHit`).
    AffinityStale = 33,
    /// Socket: reverse entries deleted when their socket was released.
    SockRevReleased = 34,
    /// tc: a flow was assured while the assured connection-tracking table (`SVC_CT`,
    /// `--max-ct`) was full, or the kernel could not allocate its entry at that moment; it
    /// stays in the unassured table, assured, where a flood of new flows may evict it.
    /// Counted under the device the flow came in on.
    CtAssuredFull = 35,
    /// A new flow to a frontend marked `svc_flags::MAGLEV` found no table for its generation
    /// (or one outside the map): its backend was chosen at random (without a device, as
    /// `AffinityHit`).
    MaglevMissing = 36,
    /// XDP: a packet of a known flow to a remote backend was translated (SNAT included) and
    /// sent on from the driver (XDP_TX or a redirect); tc never saw it (docs/design/xdp.md).
    XdpCtHit = 37,
    /// XDP: a remote backend's reply was translated back to its frontend and sent on from
    /// the driver.
    XdpReply = 38,
    /// XDP: a packet XDP could not finish (its route needs the stack: a neighbour to
    /// resolve, a packet too big or a hop too many, another device not in `SVC_XDP_DEVS`)
    /// went on to tc untouched:
    /// a known flow's, or a new flow's first before anything was stored.
    XdpPassRoute = 39,
    /// XDP: a new flow to a remote backend was stored (the entries tc makes) and its first
    /// packet translated and sent on from the driver.
    XdpNew = 40,
    /// XDP: a new flow's first packet went on to tc untouched, nothing stored: tc refuses or
    /// drops it (source ranges, no backend, a checksum XDP cannot verify, no SNAT address),
    /// or it needs what XDP does not do (sessionAffinity, a closed flow's tuple taken over).
    XdpPassNew = 41,
    /// XDP: a new flow to a local backend (or under externalTrafficPolicy Local) went on to
    /// tc untouched: the stack delivers it.
    XdpPassLocal = 42,
    /// XDP: a client's packet (a new flow's first, counted `XdpNew` too, or a known flow's,
    /// counted `XdpCtHit` too) left by another device than it came in on, redirected there
    /// from the XDP hook (`bpf_redirect_map` into `SVC_XDP_DEVS`).
    XdpRedirect = 43,
    /// XDP: a remote backend's reply (counted `XdpReply` too) left by another device than it
    /// came in on, redirected there from the XDP hook.
    XdpRedirectReply = 44,
    /// The connection-tracking sweep removed a dead flow (its FORWARD entry). Only a
    /// monitor's event: never counted under a device (`svc_conntrack_swept_entries_total`
    /// counts the entries the sweep removes).
    CtSwept = 45,
}

impl Reason {
    pub const COUNT: usize = 46;
    /// Every reason, by number.
    pub const ALL: [Reason; Reason::COUNT] = {
        use Reason::*;
        [
            New,
            CtHit,
            Reply,
            RejectNoBackend,
            DropNoLocalBackend,
            DropSourceRange,
            DropSnatExhausted,
            PassUnparsed,
            Fragment,
            IcmpError,
            ErrMissingEntry,
            ErrCtUpdate,
            ErrRewrite,
            TooBig,
            PassMidstream,
            DropHanding,
            DropTtl,
            IcmpRateLimited,
            DropInvalidTcp,
            DropTcpWindow,
            FragmentTranslated,
            DropBadChecksum,
            Translated,
            RefusedNoBackend,
            RefusedNoPort,
            AffinityHit,
            RevTranslated,
            ErrSockRevUpdate,
            RetriedMissingEntry,
            SockSticky,
            SockMoved,
            SockHashed,
            SockRevUntracked,
            AffinityStale,
            SockRevReleased,
            CtAssuredFull,
            MaglevMissing,
            XdpCtHit,
            XdpReply,
            XdpPassRoute,
            XdpNew,
            XdpPassNew,
            XdpPassLocal,
            XdpRedirect,
            XdpRedirectReply,
            CtSwept,
        ]
    };
    /// The reasons `svc_datapath_decisions` reports, summed over every device (the socket
    /// hooks count without one): what the socket programs' own counter array held before
    /// the vocabularies were one, `CtAssuredFull` and `ErrMissingEntry` included, and the
    /// backend choice's `MaglevMissing`, counted without a device too.
    pub const DECISIONS: [Reason; 16] = {
        use Reason::*;
        [
            Translated,
            RefusedNoBackend,
            RefusedNoPort,
            ErrMissingEntry,
            AffinityHit,
            RevTranslated,
            ErrSockRevUpdate,
            RetriedMissingEntry,
            SockSticky,
            SockMoved,
            SockHashed,
            SockRevUntracked,
            AffinityStale,
            SockRevReleased,
            CtAssuredFull,
            MaglevMissing,
        ]
    };

    /// The reasons counted per Service (`ServiceStats`), in the order of its counters: what
    /// happened to a connection (socket hooks) or a new flow (tc) to a frontend, which a
    /// frontend id names. Not `RefusedNoPort` (no frontend has the port) nor the reasons
    /// about packets or the node rather than a Service. Released: append only.
    pub const SERVICE: [Reason; SERVICE_STAT_SLOTS] = {
        use Reason::*;
        [
            Translated,
            New,
            RefusedNoBackend,
            RejectNoBackend,
            DropNoLocalBackend,
            DropSourceRange,
            DropSnatExhausted,
            ErrMissingEntry,
        ]
    };

    /// This reason's counter in a `ServiceStats`, or `NO_SERVICE_SLOT`. A const fn, so that
    /// a call with a constant reason folds to its number in the programs.
    pub const fn service_slot(self) -> u32 {
        use Reason::*;
        match self {
            Translated => 0,
            New => 1,
            RefusedNoBackend => 2,
            RejectNoBackend => 3,
            DropNoLocalBackend => 4,
            DropSourceRange => 5,
            DropSnatExhausted => 6,
            ErrMissingEntry => 7,
            _ => NO_SERVICE_SLOT,
        }
    }

    /// The reason numbered `n`, if any.
    pub const fn from_u32(n: u32) -> Option<Reason> {
        if (n as usize) < Reason::COUNT {
            Some(Reason::ALL[n as usize])
        } else {
            None
        }
    }

    /// The `reason` label of the metrics.
    pub const fn name(self) -> &'static str {
        use Reason::*;
        match self {
            New => "new",
            CtHit => "ct_hit",
            Reply => "reply",
            RejectNoBackend => "reject_no_backend",
            DropNoLocalBackend => "drop_no_local_backend",
            DropSourceRange => "drop_source_range",
            DropSnatExhausted => "drop_snat_exhausted",
            PassUnparsed => "pass_unparsed",
            Fragment => "fragment",
            IcmpError => "icmp_error",
            ErrMissingEntry => "err_missing_entry",
            ErrCtUpdate => "err_ct_update",
            ErrRewrite => "err_rewrite",
            TooBig => "too_big",
            PassMidstream => "pass_midstream",
            DropHanding => "drop_handing",
            DropTtl => "drop_ttl",
            IcmpRateLimited => "icmp_rate_limited",
            DropInvalidTcp => "drop_invalid_tcp",
            DropTcpWindow => "drop_tcp_window",
            FragmentTranslated => "fragment_translated",
            DropBadChecksum => "drop_bad_checksum",
            Translated => "translated",
            RefusedNoBackend => "refused_no_backend",
            RefusedNoPort => "refused_no_port",
            AffinityHit => "affinity_hit",
            RevTranslated => "rev_translated",
            ErrSockRevUpdate => "err_sock_rev_update",
            RetriedMissingEntry => "retried_missing_entry",
            SockSticky => "sock_sticky",
            SockMoved => "sock_moved",
            SockHashed => "sock_hashed",
            SockRevUntracked => "sock_rev_untracked",
            AffinityStale => "affinity_stale",
            SockRevReleased => "sock_rev_released",
            CtAssuredFull => "ct_assured_full",
            MaglevMissing => "maglev_missing",
            XdpCtHit => "xdp_ct_hit",
            XdpReply => "xdp_reply",
            XdpPassRoute => "xdp_pass_route",
            XdpNew => "xdp_new",
            XdpPassNew => "xdp_pass_new",
            XdpPassLocal => "xdp_pass_local",
            XdpRedirect => "xdp_redirect",
            XdpRedirectReply => "xdp_redirect_reply",
            CtSwept => "ct_swept",
        }
    }
}

/// The master entry of a frontend. It is the last thing the agent writes for a service, so
/// a reader that sees it also sees every slot it names.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceValue {
    /// Frontend id: names this frontend's slots, its reverse NAT entry and its affinity entries.
    pub id: u32,
    /// Number of backend slots under `(id, rev)`, in `slot_groups(count)` entries of `SLOTS`
    /// (`SlotKey::of_slot`). 0 means "refuse".
    pub count: u16,
    /// Generation of the slots; a new backend set is written under `rev + 1` before this entry
    /// switches to it, so a reader never mixes two sets.
    pub rev: u16,
    /// `svc_flags` bits.
    pub flags: u16,
    pub _pad0: u16,
    /// sessionAffinity ClientIP timeout in seconds (when `flags & AFFINITY`).
    pub affinity_timeout_s: u32,
    /// Host order. With `flags & AFFINITY`: the id `AffinityKey`s of this frontend carry, one
    /// per Service port and the same in all its frontends (ClusterIPs, NodePort, ExternalIPs,
    /// LoadBalancer IPs), because kube-proxy keeps one affinity per Service port: a client
    /// keeps its backend whichever address of the port it uses. Drawn from the frontend ids,
    /// which are never reused, so it never names two Service ports. 0 without affinity.
    pub affinity_id: u32,
}

/// A group of backend slots of a frontend generation (`SLOTS`), or a generation
/// (`MAGLEV_INDEX`, with `slot` 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SlotKey {
    /// `ServiceValue::id`.
    pub id: u32,
    /// `ServiceValue::rev`.
    pub rev: u16,
    /// In `SLOTS`: the 1-based group, which holds the 0-based slots
    /// `SLOT_GROUP * (slot - 1)` up to `SLOT_GROUP * slot - 1`. In `MAGLEV_INDEX`: 0.
    pub slot: u16,
}

impl SlotKey {
    /// The `SLOTS` key of the 0-based slot `slot` of generation `rev` of frontend `id`, and
    /// the slot's place in that entry's `SlotGroup`.
    #[inline(always)]
    pub const fn of_slot(id: u32, rev: u16, slot: u32) -> (SlotKey, usize) {
        let k = SlotKey {
            id,
            rev,
            slot: (slot / SLOT_GROUP) as u16 + 1,
        };
        (k, (slot % SLOT_GROUP) as usize)
    }
}

/// A backend id (u32, host order); 0 is none. Its entry of `BACKENDS` is at
/// `backend_index`.
pub type BackendId = u32;

/// The index of backend `id`'s entry in `BACKENDS` of `entries` entries (its max_entries, at
/// least 1): ids go round the array, and a backend's entry says which id it holds.
#[inline(always)]
pub const fn backend_index(id: BackendId, entries: u32) -> u32 {
    id % entries
}

/// Slots an entry of `SLOTS` holds. Eight make a 32-byte value: the hash element is then 88
/// bytes, which the kernel serves from a 96-byte size class (from Linux 6.1 its BPF allocator
/// adds an 8-byte list node first), as it served the element of one slot from 6.1 on (64
/// bytes and the node, layout 1); before 6.1 one slot took kmalloc's 64-byte class, so there
/// a generation of one slot costs half as much again, and one of two or more less.
pub const SLOT_GROUP: u32 = 8;

/// The value of `SLOTS`: the backend of each slot of the group, in slot order; 0 past the
/// generation's last slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SlotGroup {
    pub backends: [BackendId; SLOT_GROUP as usize],
}

/// The `SLOTS` entries of a generation of `count` slots.
pub const fn slot_groups(count: u16) -> u16 {
    (count as u32).div_ceil(SLOT_GROUP) as u16
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Network byte order.
    pub port_be: u16,
    /// IPPROTO_TCP or IPPROTO_UDP.
    pub proto: u8,
    /// Reserved for backend state (active, terminating, maintenance); 0 today.
    pub flags: u8,
    /// The id whose entry this is in `BACKENDS` (host order); 0: a free entry. Elsewhere
    /// (a decision's backend) the id it was read under.
    pub id: BackendId,
}

/// `Backend` of layout 1 of `BACKENDS` (a hash keyed by id, so no id in the value): carried
/// over, and written beside the array until the new programs are attached (`svc-agent`'s
/// datapath).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct BackendV1 {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Network byte order.
    pub port_be: u16,
    pub proto: u8,
    pub flags: u8,
}

impl BackendV1 {
    pub const fn of(b: &Backend) -> BackendV1 {
        BackendV1 {
            addr: b.addr,
            port_be: b.port_be,
            proto: b.proto,
            flags: b.flags,
        }
    }

    /// This layout's entry of id `id`.
    pub const fn with_id(&self, id: BackendId) -> Backend {
        Backend {
            addr: self.addr,
            port_be: self.port_be,
            proto: self.proto,
            flags: self.flags,
            id,
        }
    }
}

impl Backend {
    /// This backend as the `BACKENDS` entry of id `id`.
    pub const fn with_id(self, id: BackendId) -> Backend {
        Backend { id, ..self }
    }
}

/// Four entries of the Maglev tables (`MAGLEV`, in a `MaglevPage`): each the 0-based slot number
/// (`SlotKey::of_slot`) of the generation its table belongs to, host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MaglevBlock {
    pub entries: [u16; 4],
}

/// Entries of one `MaglevBlock`.
pub const MAGLEV_BLOCK: u32 = 4;

/// `MAGLEV_PAGE` blocks of the Maglev tables (`MAGLEV`, layout 2): page `n` holds blocks
/// `n * MAGLEV_PAGE` up to `(n + 1) * MAGLEV_PAGE - 1`; a table may begin or end in the middle
/// of one, and share it with other tables.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MaglevPage {
    pub blocks: [MaglevBlock; MAGLEV_PAGE as usize],
}

/// Blocks of one `MaglevPage`: 960 bytes, so a hash element (48 bytes of the kernel's header,
/// the 8-byte key, and 8 of its allocator's) fills a 1,024-byte allocation exactly.
pub const MAGLEV_PAGE: u32 = 120;

impl Default for MaglevPage {
    fn default() -> MaglevPage {
        MaglevPage {
            blocks: [MaglevBlock::default(); MAGLEV_PAGE as usize],
        }
    }
}

/// Where a frontend generation's Maglev table is (the value of `MAGLEV_INDEX`), host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MaglevIndex {
    /// The table's first entry, counted in entries (a multiple of `MAGLEV_BLOCK`).
    pub offset: u32,
    /// Its entries, `M` (prime). 0: no table.
    pub size: u32,
    /// The seed of the flow hash (`maglev_flow_hash`), as two halves, low first: a u64 would
    /// move the value to 8-byte alignment.
    pub seed: [u32; 2],
}

/// MurmurHash3's 64-bit finalizer.
#[inline(always)]
pub const fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[inline(always)]
fn le_word(b: &[u8; 16], half: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[half * 8..half * 8 + 8]);
    u64::from_le_bytes(w)
}

/// The hash a new flow's Maglev entry is taken from (`mod MaglevIndex::size`): the same on
/// every node for the same seed and 5-tuple (not `skb->hash`, which each kernel keys with a
/// secret of its own). Addresses as stored (IPv4 mapped), ports in network order as on the
/// wire, words read little-endian whatever the machine, so nodes of either byte order agree.
#[inline(always)]
pub fn maglev_flow_hash(
    saddr: &[u8; 16],
    daddr: &[u8; 16],
    sport_be: u16,
    dport_be: u16,
    proto: u8,
    seed: u64,
) -> u32 {
    let ports = u64::from(u16::from_be(sport_be)) << 32
        | u64::from(u16::from_be(dport_be)) << 16
        | u64::from(proto);
    let mut h = fmix64(seed ^ le_word(saddr, 0));
    h = fmix64(h ^ le_word(saddr, 1));
    h = fmix64(h ^ le_word(daddr, 0));
    h = fmix64(h ^ le_word(daddr, 1));
    (fmix64(h ^ ports) >> 32) as u32
}

/// Key of `REV_NAT` is the frontend id (u32, host order); the value is the frontend it names,
/// which replies and getpeername() report instead of the backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RevNatValue {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Network byte order.
    pub port_be: u16,
    pub _pad0: u16,
}

/// The object a frontend came from ("namespace/name:port"), NUL-padded UTF-8, for listings
/// and `bpftool map dump`. Written and read by userspace only; the programs never look at it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceName {
    pub name: [u8; 160],
}

/// Per-socket reverse translation: which frontend a socket meant when it reached a backend.
/// Written at connect()/sendmsg(), read at recvmsg()/getpeername().
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevKey {
    /// Socket cookie (host order).
    pub cookie: u64,
    /// Backend address, network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Backend port, network byte order.
    pub port_be: u16,
    pub _pad0: [u8; 6],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevValue {
    /// Frontend address, network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Frontend port, network byte order.
    pub port_be: u16,
    pub _pad0: u16,
    /// Frontend id; the entry is honoured only while `REV_NAT[id]` still names this frontend,
    /// so a deleted service's VIP is never reported for a recycled backend.
    pub id: u32,
}

/// sessionAffinity ClientIP: the client's backend for one Service port (all its frontends).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityKey {
    /// Who the client is, as `kind` says. `AFFINITY_CLIENT_NETNS`: the network namespace cookie
    /// in bytes 0..8 (host order), byte 8 1 at an IPv6 frontend (0 at an IPv4 one: one choice
    /// per family, as kube-proxy keeps), rest zero; a pod is a network namespace, and at
    /// connect() its source address is not chosen yet. `AFFINITY_CLIENT_IP`: the client address, network byte
    /// order, IPv4 as `::ffff:a.b.c.d` (the packet datapath).
    pub client: [u8; 16],
    /// `ServiceValue::affinity_id` (host order): the Service port's, not the frontend's, so
    /// the choice made at one of the port's frontends is found at the others. Whether the
    /// remembered backend serves the frontend at hand is still asked per frontend
    /// (`AFFINITY_MATCH`, by frontend id): with externalTrafficPolicy Local the external
    /// frontends have fewer backends than the ClusterIP.
    pub affinity_id: u32,
    /// `AFFINITY_CLIENT_IP` or `AFFINITY_CLIENT_NETNS`.
    pub kind: u8,
    pub _pad0: [u8; 3],
}

pub const AFFINITY_CLIENT_IP: u8 = 0;
pub const AFFINITY_CLIENT_NETNS: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityValue {
    /// The datapath clock (CLOCK_MONOTONIC_COARSE) at the last connection that used this entry.
    pub last_used_ns: u64,
    pub backend: BackendId,
    pub _pad0: u32,
}

/// Key of `AFFINITY_MATCH`: backend `backend` is a backend of frontend `id` now. The agent
/// writes a frontend's entries before the master entry that names a new backend, and deletes
/// those of a departed backend right after the switch; a remembered choice (sessionAffinity,
/// a UDP socket's backend) is honoured only while its entry is there, as Cilium's
/// lb_affinity_match. The value is reserved (0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityMatchKey {
    /// Frontend id (host order).
    pub id: u32,
    /// Backend id (host order).
    pub backend: BackendId,
}

/// Whether the programs check remembered choices of a frontend against `AFFINITY_MATCH`, so
/// the agent keeps its entries: with sessionAffinity, and for UDP (unconnected sockets keep
/// their backend).
#[inline(always)]
pub fn checks_match(proto: u8, flags: u16) -> bool {
    proto == IPPROTO_UDP || flags & svc_flags::AFFINITY != 0
}

/// How many frontends one socket remembers a backend for (`SockState`); beyond that its
/// choice comes from its cookie.
pub const SOCK_CHOICES: usize = 4;

/// One remembered choice of a socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockChoice {
    /// Frontend id; 0: a free slot.
    pub id: u32,
    pub backend: BackendId,
    /// The backend's address (network byte order; IPv4 as `::ffff:a.b.c.d`) and port, kept so
    /// the socket's reverse entry can be found at release, when the backend may be gone.
    pub addr: [u8; 16],
    pub port_be: u16,
    pub _pad0: u16,
}

/// Per-socket state in `SOCK_STATE` (socket local storage, freed with the socket): the
/// backend an unconnected UDP socket uses for each frontend it sends to, so every datagram of
/// one socket reaches one backend (as conntrack keeps a 5-tuple on one backend).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockState {
    pub choices: [SockChoice; SOCK_CHOICES],
}

/// How a decision was made (`LbTestIo::how`).
pub mod how {
    /// Uniformly random slot.
    pub const RANDOM: u32 = 1;
    /// sessionAffinity: the client's remembered backend.
    pub const AFFINITY: u32 = 2;
    /// The socket's remembered backend.
    pub const STICKY: u32 = 3;
    /// No room to remember a choice for the socket: the slot comes from its cookie.
    pub const HASHED: u32 = 4;
    /// Asked of the frontend's Maglev table, by the flow's 5-tuple (at random when the
    /// generation had none: `Reason::MaglevMissing`).
    pub const MAGLEV: u32 = 5;
}

/// What a frontend lookup or a backend choice came to (svc-ebpf's `lb`): the programs' next
/// step, never counted as such (each caller counts the `Reason` its step stands for).
/// Numbered apart from `Reason` on purpose: `LbTestIo::outcome` carries it as a number.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A frontend, and a backend when one was chosen.
    Found = 0,
    /// No frontend: the address is none of svc's (the caller leaves it alone).
    NotService = 1,
    /// A known ClusterIP, but no frontend for that port and protocol.
    NoPort = 2,
    /// The frontend has no usable backend.
    NoBackend = 3,
    /// A slot or backend entry was missing (an update raced the lookup).
    MissingEntry = 4,
}

/// `LbTestIo::mode`: which hook the decision stands for.
pub const LB_TEST_CONNECT: u32 = 0;
/// sendmsg() on an unconnected UDP socket whose state is `LbTestIo::sock`.
pub const LB_TEST_SENDMSG: u32 = 1;

/// The packet the test-only `lb_test` program runs on through BPF_PROG_TEST_RUN (the socket
/// hooks have no test run): a decision request, answered in place. Not part of the agent's
/// object.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct LbTestIo {
    /// Request: the frontend asked for.
    pub key: ServiceKey,
    /// Request: `LB_TEST_CONNECT` or `LB_TEST_SENDMSG`.
    pub mode: u32,
    /// Request: the datapath clock the decision sees.
    pub now_ns: u64,
    /// Request: the socket cookie.
    pub cookie: u64,
    /// Request: the client's network namespace cookie (sessionAffinity).
    pub netns_cookie: u64,
    /// Answer: an `Outcome`, as its number.
    pub outcome: u32,
    /// Answer: a `how` constant.
    pub how: u32,
    /// Answer: the frontend id and backend chosen.
    pub frontend_id: u32,
    pub backend_id: BackendId,
    pub backend: Backend,
    /// Request and answer: the socket's state (`LB_TEST_SENDMSG`).
    pub sock: SockState,
}

/// The one entry of `META`: the agent's own bookkeeping, which must outlive the agent. The
/// programs never read it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MetaValue {
    /// Frontend ids below this may have been handed out (host order): a new agent starts
    /// above it, so an id never names two frontends, even across crashes.
    pub frontend_id_hwm: u32,
    /// The same for backend ids.
    pub backend_id_hwm: u32,
    pub _reserved: [u32; 6],
}

/// `ECONNREFUSED`, which a refused connect()/sendmsg() returns, as kube-proxy's REJECT does.
pub const ECONNREFUSED: i32 = 111;

/// `addr` is an IPv4-mapped IPv6 address.
#[inline(always)]
pub fn is_v4_mapped(addr: &[u8; 16]) -> bool {
    addr[..10] == [0u8; 10] && addr[10] == 0xff && addr[11] == 0xff
}

/// `::ffff:a.b.c.d` from an IPv4 address in network byte order.
#[inline(always)]
pub fn v4_mapped(v4: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, v4[0], v4[1], v4[2], v4[3],
    ]
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: every type is repr(C), Copy, has no padding the compiler adds (all explicit) and
    // is valid for any bit pattern, which bytemuck::Pod checks at compile time above.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for SlotKey {}
    unsafe impl aya::Pod for SlotGroup {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for RevNatValue {}
    unsafe impl aya::Pod for ServiceName {}
    unsafe impl aya::Pod for SockRevKey {}
    unsafe impl aya::Pod for SockRevValue {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for MetaValue {}
    unsafe impl aya::Pod for NodeAddrValue {}
    unsafe impl aya::Pod for SrcRangeKey {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtValue {}
    unsafe impl aya::Pod for CtValueV1 {}
    unsafe impl aya::Pod for BackendV1 {}
    unsafe impl aya::Pod for DatapathConfig {}
    unsafe impl aya::Pod for DevStatKey {}
    unsafe impl aya::Pod for AffinityMatchKey {}
    unsafe impl aya::Pod for SockChoice {}
    unsafe impl aya::Pod for SockState {}
    unsafe impl aya::Pod for LbTestIo {}
    unsafe impl aya::Pod for MaglevBlock {}
    unsafe impl aya::Pod for MaglevPage {}
    unsafe impl aya::Pod for MaglevIndex {}
    unsafe impl aya::Pod for MonitorEvent {}
    unsafe impl aya::Pod for MonitorCtl {}
    unsafe impl aya::Pod for MonitorOn {}
    unsafe impl aya::Pod for MonitorStats {}
    unsafe impl aya::Pod for ServiceStats {}
}

#[cfg(all(test, feature = "user"))]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn ct_timeouts_default_unless_the_agent_set_one() {
        let mut c = DatapathConfig::default();
        let est = ct_flags::SEEN_REPLY;
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_TCP, est), 86_400);
        let fin_forward = ct_flags::FIN | ct_flags::FIN_FORWARD;
        assert_eq!(
            ct_timeout::seconds(&c, IPPROTO_TCP, est | fin_forward),
            3_600
        );
        assert_eq!(
            ct_timeout::seconds(&c, IPPROTO_TCP, est | fin_forward | ct_flags::FIN_REPLY),
            10
        );
        assert_eq!(
            ct_timeout::seconds(&c, IPPROTO_TCP, est | fin_forward | ct_flags::RST),
            10
        );
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_TCP, 0), 60);
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_UDP, 0), 30);
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_UDP, est), 120);
        c.ct_tcp_established_s = 300;
        c.ct_udp_s = 5;
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_TCP, est), 300);
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_UDP, 0), 5);
        assert_eq!(ct_timeout::seconds(&c, IPPROTO_UDP, est), 120);
    }

    /// A reason's number is in `DEV_STATS` keys a rolled-back or upgraded agent reads, and its
    /// name in dashboards: both are released, never changed.
    /// `svc_datapath_decisions_total` keeps every reason the retired `SVC_STATS` array
    /// exported (its names, in its order): dashboards read them.
    #[test]
    fn the_decisions_series_keeps_the_retired_arrays_reasons() {
        let retired = [
            "translated",
            "refused_no_backend",
            "refused_no_port",
            "err_missing_entry",
            "affinity_hit",
            "rev_translated",
            "err_sock_rev_update",
            "retried_missing_entry",
            "sock_sticky",
            "sock_moved",
            "sock_hashed",
            "sock_rev_untracked",
            "affinity_stale",
            "sock_rev_released",
            "ct_assured_full",
        ];
        for (i, name) in retired.iter().enumerate() {
            assert_eq!(Reason::DECISIONS[i].name(), *name, "position {i}");
        }
    }

    #[test]
    fn reasons_are_numbered_once() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{r:?}");
            assert_eq!(Reason::from_u32(i as u32), Some(*r));
        }
        assert_eq!(Reason::from_u32(Reason::COUNT as u32), None);
        for (i, a) in Reason::ALL.iter().enumerate() {
            for b in &Reason::ALL[i + 1..] {
                assert_ne!(a.name(), b.name(), "one name per reason");
            }
        }
        // As released: the packet datapath's numbers (0-21), then the socket hooks'.
        for (n, name) in [
            (0, "new"),
            (3, "reject_no_backend"),
            (10, "err_missing_entry"),
            (21, "drop_bad_checksum"),
            (22, "translated"),
            (23, "refused_no_backend"),
            (35, "ct_assured_full"),
        ] {
            assert_eq!(Reason::from_u32(n).map(Reason::name), Some(name));
        }
    }

    /// Slot `s` (0-based) of a generation is place `s % 8` of group `s / 8 + 1`, and a
    /// generation of `n` slots has `ceil(n / 8)` groups: at the edges of a group and of u16.
    #[test]
    fn slots_map_to_groups_of_eight() {
        for (slot, group, place) in [
            (0, 1, 0),
            (7, 1, 7),
            (8, 2, 0),
            (9, 2, 1),
            (15, 2, 7),
            (16, 3, 0),
            (65_534, 8_192, 6),
        ] {
            let (k, i) = SlotKey::of_slot(3, 4, slot);
            assert_eq!(
                (k.id, k.rev, k.slot, i),
                (3, 4, group, place),
                "slot {slot}"
            );
        }
        for (count, groups) in [(0, 0), (1, 1), (7, 1), (8, 1), (9, 2), (16, 2), (17, 3)] {
            assert_eq!(slot_groups(count), groups, "{count} slots");
        }
        assert_eq!(slot_groups(u16::MAX), 8_192);
    }

    #[test]
    fn sizes_are_stable() {
        // The kernel and the agent must agree byte for byte; a change here is a map format
        // change and needs a migration.
        assert_eq!(size_of::<ServiceKey>(), 20);
        assert_eq!(size_of::<ServiceValue>(), 20);
        assert_eq!(size_of::<SlotKey>(), 8);
        // 32: the element is then 88 bytes, in the kernel allocator's 96-byte class.
        assert_eq!(size_of::<SlotGroup>(), 32);
        assert_eq!(size_of::<Backend>(), 24);
        assert_eq!(size_of::<RevNatValue>(), 20);
        assert_eq!(size_of::<SockRevKey>(), 32);
        assert_eq!(size_of::<SockRevValue>(), 24);
        assert_eq!(size_of::<AffinityKey>(), 24);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<MetaValue>(), 32);
        assert_eq!(size_of::<MonitorEvent>(), 112);
        assert_eq!(size_of::<MonitorCtl>(), 24);
        assert_eq!(size_of::<MonitorOn>(), 8);
        assert_eq!(size_of::<MonitorStats>(), 24);
        assert_eq!(size_of::<NodeAddrValue>(), 8);
        assert_eq!(size_of::<SrcRangeKey>(), 24);
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<CtValue>(), 64);
        assert_eq!(size_of::<CtValueV1>(), 56);
        assert_eq!(size_of::<DatapathConfig>(), 56);
        assert_eq!(size_of::<DevStatKey>(), 8);
        assert_eq!(size_of::<AffinityMatchKey>(), 8);
        assert_eq!(size_of::<SockChoice>(), 28);
        assert_eq!(size_of::<SockState>(), 112);
        assert_eq!(size_of::<LbTestIo>(), 200);
        assert_eq!(size_of::<MaglevBlock>(), 8);
        assert_eq!(size_of::<MaglevPage>(), 960);
        assert_eq!(size_of::<MaglevIndex>(), 16);
        assert_eq!(size_of::<ServiceStats>(), 64);
    }

    /// A counter's place in `ServiceStats` is read by agents of other versions: each reason
    /// of `Reason::SERVICE` has its slot, and no other reason has one.
    #[test]
    fn service_slots_follow_the_service_reasons() {
        for (i, r) in Reason::SERVICE.iter().enumerate() {
            assert_eq!(r.service_slot(), i as u32, "{r:?}");
        }
        for r in Reason::ALL {
            if !Reason::SERVICE.contains(&r) {
                assert_eq!(r.service_slot(), NO_SERVICE_SLOT, "{r:?}");
            }
        }
        assert_eq!(Reason::SERVICE[0].name(), "translated");
        assert_eq!(Reason::SERVICE[7].name(), "err_missing_entry");
    }

    /// The filter keeps its use only if addresses of one subnet spread over its bits: a /16
    /// of IPv4 pods, or IPv6 interface identifiers counting up, leave few bits shared.
    #[test]
    fn node_addr_bits_spread_a_subnet_over_the_filter() {
        let bits = NODE_ADDR_BIT_WORDS * 64;
        let mut v4 = [0u16; 65_536];
        let mut v6 = [0u16; 65_536];
        for i in 0..=u16::MAX {
            let [a, b] = i.to_be_bytes();
            let b4 = node_addr_bit(&v4_mapped([10, 244, a, b]));
            let mut six = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, a, b];
            let b6 = node_addr_bit(&six);
            assert!(b4 < bits && b6 < bits);
            v4[b4 as usize] += 1;
            v6[b6 as usize] += 1;
            six[8] = 1;
            assert!(node_addr_bit(&six) < bits);
        }
        for (what, counts) in [("IPv4", &v4), ("IPv6", &v6)] {
            let used = counts.iter().filter(|c| **c != 0).count();
            let most = counts.iter().max().copied().unwrap_or(0);
            assert!(
                used > 40_000 && most <= 4,
                "{what}: 65,536 addresses on {used} bits, at most {most} on one"
            );
        }
    }

    /// Pin names are what an upgraded agent finds its predecessor's maps by: each pin of a
    /// released layout is still declared with its version and default size (a new map needs
    /// no line here; changing one of these is a layout change, with a version bump and a
    /// migration).
    #[test]
    fn pin_names_and_capacities_are_stable() {
        let pins: [(&str, u32, u32); 18] = [
            ("SVC_SERVICES", 3, 262_144),
            ("SVC_SLOTS", 2, 262_144),
            ("SVC_BACKENDS", 2, 1_048_576),
            ("SVC_REV_NAT", 1, 262_144),
            ("SVC_SOCK_REV", 1, 262_144),
            ("SVC_AFFINITY", 2, 262_144),
            ("SVC_NAMES", 1, 262_144),
            ("SVC_META", 1, 1),
            ("SVC_AFFINITY_MATCH", 1, 1_048_576),
            ("SVC_SOCK_STATE", 1, 0),
            ("SVC_NODE_ADDRS", 1, 65_536),
            ("SVC_SRC_RANGES", 1, 16_384),
            ("SVC_CT", 4, 262_144),
            ("SVC_CONFIG", 1, 1),
            ("SVC_DEV_STATS", 1, 4_096),
            ("SVC_NODE_ADDR_BITS", 1, NODE_ADDR_BIT_WORDS),
            ("SVC_CT_NEW", 1, 65_536),
            ("SVC_SERVICE_STATS", 2, 262_144),
        ];
        for (name, version, entries) in pins {
            assert!(map_names::ALL.contains(&name), "{name} is pinned");
            let m = catalogue::find(name).expect("in the catalogue");
            assert_eq!(
                (layout::version(name), m.max_entries),
                (version, entries),
                "{name}"
            );
        }
        // Released and retired since: removed on upgrade and by uninstall.
        let retired: [(&str, &[&str]); 2] = [
            ("SVC_STATS", &["SVC_STATS", "SVC_STATS_v1"]),
            ("SVC_MONITOR", &["SVC_MONITOR_v1"]),
        ];
        for (name, pins) in retired {
            assert!(catalogue::find(name).is_none(), "{name} is retired");
            for pin in pins {
                assert!(RETIRED_PINS.contains(pin), "{pin}");
            }
        }
        assert_eq!(layout::version(map_names::CT_CLAIMS), 0);
        assert_eq!(layout::version("SVC_UNKNOWN"), 0);
    }

    /// Nodes must agree on it whatever their version: these values were computed once; a
    /// change here breaks cross-node agreement during a rolling upgrade.
    #[test]
    fn the_maglev_flow_hash_does_not_change() {
        let c = v4_mapped([192, 0, 2, 10]);
        let f = v4_mapped([198, 51, 100, 1]);
        let h = |sport: u16, seed| maglev_flow_hash(&c, &f, sport.to_be(), 80u16.to_be(), 6, seed);
        assert_eq!(
            [h(40_000, 0), h(40_001, 0), h(40_000, 1)],
            [876_426_373, 737_919_940, 3_299_990_851]
        );
        assert_ne!(h(40_000, 0), h(40_001, 0));
        assert_ne!(h(40_000, 0), h(40_000, 1));
    }

    #[test]
    fn v4_mapping_round_trips() {
        let m = v4_mapped([10, 96, 0, 10]);
        assert!(is_v4_mapped(&m));
        assert_eq!(&m[12..], &[10, 96, 0, 10]);
        assert!(!is_v4_mapped(&[0xfd; 16]));
    }
}

/// What the loader tells the programs about the kernel: `u32` constants in the object's
/// `.rodata` (the program's `static`s of these names), set before the load (aya
/// `EbpfLoader::set_global`). aya freezes `.rodata` and creates it read-only for programs, so
/// the verifier knows each value, and a privileged load prunes the branch it rules out: a
/// helper the kernel lacks, called only there, is never checked (svc-ebpf kernel.rs). 1, the
/// object's default, means present.
pub mod kernel_globals {
    /// `bpf_set_retval` (Linux 5.18), the socket hooks' ECONNREFUSED.
    pub const SET_RETVAL: &str = "SVC_KERNEL_SET_RETVAL";
    /// max_entries of `BACKENDS`, by which a backend id gives its index (`backend_index`).
    pub const BACKENDS: &str = "SVC_KERNEL_BACKENDS";
}
