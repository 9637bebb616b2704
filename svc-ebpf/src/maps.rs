//! Every map of the datapath, in one place. Types live in svc-common; names are pinned as is.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, SkStorage},
    macros::btf_map,
};
use svc_common::{
    capacity, stat, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendId, MetaValue,
    RevNatValue, ServiceKey, ServiceName, ServiceValue, SlotKey, SockRevKey, SockRevValue,
    SockState,
};

/// Maps that only the agent writes allocate on demand: a node with few services pays for few.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

/// Frontends (slot-0 master entries) and ClusterIP address markers.
#[btf_map]
pub static SVC_SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { capacity::SERVICES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Backend slots of each frontend generation.
#[btf_map]
pub static SVC_SLOTS: HashMap<SlotKey, BackendId, { capacity::SLOTS as usize }, NO_PREALLOC> =
    HashMap::new();

#[btf_map]
pub static SVC_BACKENDS: HashMap<BackendId, Backend, { capacity::BACKENDS as usize }, NO_PREALLOC> =
    HashMap::new();

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

#[btf_map]
pub static SVC_STATS: PerCpuArray<u64, { stat::COUNT as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count(index: u32) {
    if let Some(v) = SVC_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, and a program runs to completion on one CPU.
        unsafe { *v += 1 }
    }
}
