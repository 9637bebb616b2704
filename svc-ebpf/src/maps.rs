//! Every pinned map of the datapath, in one place (the per-CPU working state, never pinned,
//! is in scratch.rs). Types live in svc-common; names are pinned as is.

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{
        lpm_trie::Key, Array, DevMapHash, HashMap, LpmTrie, LruHashMap, PerCpuHashMap, SkStorage,
    },
    macros::btf_map,
};
use svc_common::{
    capacity, AffinityKey, AffinityMatchKey, AffinityValue, Backend, CtKey, CtValue,
    DatapathConfig, DevStatKey, MaglevIndex, MaglevPage, MetaValue, NodeAddrValue, Reason,
    RevNatValue, ServiceKey, ServiceName, ServiceStats, ServiceValue, SlotGroup, SlotKey,
    SockRevKey, SockRevValue, SockState, NODE_ADDR_BIT_WORDS, SERVICE_STAT_SLOTS,
};

/// Maps allocated on demand: a node with few services, or few flows (`SVC_CT`), pays for few.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

/// An array the agent maps into its memory to read it whole (`svc_common::BPF_F_MMAPABLE`).
const MMAPABLE: usize = svc_common::BPF_F_MMAPABLE as usize;

/// Frontends (slot-0 master entries) and ClusterIP address markers.
#[btf_map]
pub static SVC_SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { capacity::SERVICES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Backend slots of each frontend generation, in groups (`SlotGroup`).
#[btf_map]
pub static SVC_SLOTS: HashMap<SlotKey, SlotGroup, { capacity::SLOTS as usize }, NO_PREALLOC> =
    HashMap::new();

/// Backends, each at `backend_index(id, max_entries)` (`backend_entries`).
#[btf_map]
pub static SVC_BACKENDS: Array<Backend, { capacity::BACKENDS as usize }, MMAPABLE> = Array::new();

/// max_entries of `SVC_BACKENDS` as the agent made it: a backend id's index is the id modulo
/// it. Patched by the loader as kernel.rs' constants are (the agent's `--max-backends`); the
/// object's default is the catalogue's.
#[unsafe(no_mangle)]
static SVC_KERNEL_BACKENDS: u32 = svc_common::capacity::BACKENDS;

/// `SVC_BACKENDS`' entries, at least 1.
#[inline(always)]
pub fn backend_entries() -> u32 {
    // SAFETY: a static of this object.
    let n = unsafe { core::ptr::read_volatile(&SVC_KERNEL_BACKENDS) };
    if n == 0 {
        1
    } else {
        n
    }
}

/// Frontend id to frontend: what a reply or getpeername() reports.
#[btf_map]
pub static SVC_REV_NAT: HashMap<u32, RevNatValue, { capacity::REV_NAT as usize }, NO_PREALLOC> =
    HashMap::new();

/// Per-socket reverse translation; LRU because sockets come and go without telling us.
#[btf_map]
pub static SVC_SOCK_REV: LruHashMap<SockRevKey, SockRevValue, { capacity::SOCK_REV as usize }> =
    LruHashMap::new();

#[btf_map]
pub static SVC_AFFINITY: LruHashMap<AffinityKey, AffinityValue, { capacity::AFFINITY as usize }> =
    LruHashMap::new();

/// (frontend id, backend id) for every current backend of the frontends that remember
/// choices: a remembered backend is used only while it is still one of the frontend's.
#[btf_map]
pub static SVC_AFFINITY_MATCH: HashMap<
    AffinityMatchKey,
    u32,
    { capacity::AFFINITY_MATCH as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Each unconnected UDP socket's backends, one per frontend it sends to; freed with the
/// socket.
#[btf_map]
pub static SVC_SOCK_STATE: SkStorage<SockState> = SkStorage::new();

/// Frontend id to the object it came from; read by listings only.
#[btf_map]
pub static SVC_NAMES: HashMap<u32, ServiceName, { capacity::NAMES as usize }, NO_PREALLOC> =
    HashMap::new();

/// The agent's bookkeeping that must survive it (id high-water marks); never read here, but
/// declared here so it is created, typed and pinned with the rest.
#[btf_map]
pub static SVC_META: Array<MetaValue, 1> = Array::new();

/// Maglev tables, four entries a block, `MAGLEV_PAGE` blocks a page (docs/design/maglev.md).
#[btf_map]
pub static SVC_MAGLEV: HashMap<u32, MaglevPage, { capacity::MAGLEV as usize }, NO_PREALLOC> =
    HashMap::new();

/// Where each frontend generation's Maglev table is.
#[btf_map]
pub static SVC_MAGLEV_INDEX: HashMap<
    SlotKey,
    MaglevIndex,
    { capacity::MAGLEV_INDEX as usize },
    NO_PREALLOC,
> = HashMap::new();

// The packet datapath's maps (docs/design/packet-datapath.md, "Map declarations").

/// The addresses the external ingress looks at (`NodeAddrValue`): this node's (which answer
/// NodePorts, which may source SNATed packets), external frontends', lingering ones.
#[btf_map]
pub static SVC_NODE_ADDRS: HashMap<
    [u8; 16],
    NodeAddrValue,
    { capacity::NODE_ADDRS as usize },
    NO_PREALLOC,
> = HashMap::new();

/// The filter in front of `SVC_NODE_ADDRS` (`svc_common::NODE_ADDR_BIT_WORDS`): a clear bit
/// says the address is not there. An array, so the lookup is inlined.
#[btf_map]
pub static SVC_NODE_ADDR_BITS: Array<u64, { NODE_ADDR_BIT_WORDS as usize }> = Array::new();

/// loadBalancerSourceRanges: (frontend id, client prefix). The data of a key is
/// `SrcRangeKey` without its prefix length: the id (network order) and the address.
#[btf_map]
pub static SVC_SRC_RANGES: LpmTrie<[u8; 20], u32, { capacity::SRC_RANGES as usize }> =
    LpmTrie::new();

/// Connection tracking of the packet datapath's assured flows (`ct_flags::UNASSURED` cleared):
/// two entries per flow. Not an LRU: nothing evicts an assured flow for a new one, as
/// conntrack never does; its entries go when the flow is dead (the sweep, gc.rs; a new flow
/// stored over a dead one) or closed and taken over. A full table keeps a newly assured flow
/// in `SVC_CT_NEW` (`Reason::CtAssuredFull`), as does an element the kernel could not allocate:
/// entries are allocated as flows are assured (from per-CPU caches the kernel refills), so a
/// node pays for the flows it has, not for the capacity.
#[btf_map]
pub static SVC_CT: HashMap<CtKey, CtValue, { capacity::CT as usize }, NO_PREALLOC> = HashMap::new();

/// Connection tracking of flows not assured yet (handshakes in flight, UDP flows that are no
/// stream yet, and a flood's spoofed SYNs): both entries of each, moved to `SVC_CT` when the
/// flow is assured (ct.rs, `assure`). LRU: a full table forgets the least recently used
/// unassured flows for new ones, as conntrack drops unassured entries first.
#[btf_map]
pub static SVC_CT_NEW: LruHashMap<CtKey, CtValue, { capacity::CT_NEW as usize }> =
    LruHashMap::new();

#[btf_map]
pub static SVC_CONFIG: Array<DatapathConfig, 1> = Array::new();

/// What the datapath decided, per device and reason, per CPU (device 0: the socket hooks).
#[btf_map]
pub static SVC_DEV_STATS: PerCpuHashMap<DevStatKey, u64, { capacity::DEV_STATS as usize }> =
    PerCpuHashMap::new();

/// Counts one event under `reason` on device `ifindex` (0 where there is none: the socket
/// hooks, and the backend choice, which does not know the device). Every counter goes
/// through here.
#[inline(always)]
pub fn count(reason: Reason, ifindex: u32) {
    let key = DevStatKey {
        ifindex,
        reason: reason as u32,
    };
    match SVC_DEV_STATS.get_ptr_mut(key) {
        // SAFETY: per-CPU value, and a program runs to completion on one CPU.
        Some(v) => unsafe { *v += 1 },
        None => {
            // Another CPU may create the entry first; each CPU's first count then lands in
            // its own slot either way (a per-CPU entry is created zeroed for the others).
            let _ = SVC_DEV_STATS.insert(key, 1, 0);
        }
    }
}

/// What the datapath decided per frontend id (`svc_common::ServiceStats`). The agent
/// creates and deletes the entries; the programs only look them up and add.
#[btf_map]
pub static SVC_SERVICE_STATS: HashMap<
    u32,
    ServiceStats,
    { capacity::SERVICE_STATS as usize },
    NO_PREALLOC,
> = HashMap::new();

/// The devices the XDP program may redirect a packet to, keyed by ifindex: those the agent
/// attached `xdp_ext` to in its mode, at the driver's hook only those that take redirected
/// frames (docs/design/xdp.md, "Another device"). A
/// device missing here is tc's to reach: a redirect into a device that cannot take XDP frames
/// is dropped without a word, where tc's redirect never is.
#[btf_map]
pub static SVC_XDP_DEVS: DevMapHash<{ capacity::XDP_DEVS as usize }> = DevMapHash::new();

/// Counts one connection or new flow of frontend `id` under `reason`, if the reason is one
/// counted per Service and the agent made the frontend an entry. Beside `count`, never
/// instead of it.
#[inline(always)]
pub fn count_service(reason: Reason, id: u32) {
    let slot = reason.service_slot();
    if slot != svc_common::NO_SERVICE_SLOT {
        count_slot(slot, id);
    }
}

/// `count_service`'s work, out of line: two arguments and an 8-byte frame, so the programs
/// whose stack is at the limit (tc_ext_ingress) pay for it only on the calls that reach it.
#[inline(never)]
fn count_slot(slot: u32, id: u32) {
    if slot as usize >= SERVICE_STAT_SLOTS {
        return;
    }
    if let Some(v) = SVC_SERVICE_STATS.get_ptr_mut(id) {
        // Atomically: one entry for every CPU, which costs 128 bytes where a per-CPU one cost
        // 64 bytes a CPU. The shared cache line is touched once per connect(), per new flow,
        // and per sendmsg() of an unconnected UDP socket (a DNS client's every query).
        // SAFETY: the element's memory stays valid while the program runs, and the slot is
        // in bounds (checked above). The BPF allocator may hand a deleted element to a new
        // entry at once: an add in flight for a frontend deleted meanwhile may count once
        // in the entry made next, as with layout 1.
        unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(
                core::ptr::addr_of_mut!((*v).counts[slot as usize]),
                1,
            );
        }
    }
}

/// The `SRC_RANGES` key for client `addr` of frontend `id`, with a full-length prefix.
#[inline(always)]
pub fn src_range_key(id: u32, addr: &[u8; 16]) -> Key<[u8; 20]> {
    let mut data = [0u8; 20];
    data[..4].copy_from_slice(&id.to_be_bytes());
    data[4..].copy_from_slice(addr);
    Key::new(160, data)
}
