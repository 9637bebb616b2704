//! Writes to the datapath maps, one operation at a time, in the order the executor decides.
//!
//! Every change is an [`Op`], so the order that keeps readers safe is visible in one place and
//! can be checked against a model of the maps in tests.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{Array, HashMap, IterableMap, MapData, MapError};
use svc_common::{
    ct_dir, ct_flags, ct_timeout, map_names, AffinityKey, AffinityMatchKey, AffinityValue, Backend,
    BackendId, CtKey, CtValue, DatapathConfig, MaglevBlock, MaglevIndex, MaglevPage, MetaValue,
    NodeAddrValue, RevNatValue, ServiceKey, ServiceName, ServiceStats, ServiceValue, SlotGroup,
    SlotKey, SrcRangeKey, MAGLEV_PAGE,
};

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    PutService(ServiceKey, ServiceValue),
    DelService(ServiceKey),
    PutSlot(SlotKey, SlotGroup),
    DelSlot(SlotKey),
    PutBackend(BackendId, Backend),
    DelBackend(BackendId),
    PutRevNat(u32, RevNatValue),
    DelRevNat(u32),
    PutName(u32, ServiceName),
    DelName(u32),
    /// Backend `backend` is a backend of frontend `id` (see `AffinityMatchKey`).
    PutMatch(AffinityMatchKey),
    DelMatch(AffinityMatchKey),
    PutMeta(MetaValue),
    /// A loadBalancerSourceRanges entry of a frontend (`SRC_RANGES`).
    PutRange(SrcRangeKey),
    DelRange(SrcRangeKey),
    /// An address of this node (`NODE_ADDRS`, keyed as `ServiceKey::addr`).
    PutNodeAddr([u8; 16], NodeAddrValue),
    DelNodeAddr([u8; 16]),
    /// The one entry of `CONFIG`.
    PutConfig(DatapathConfig),
    /// A Maglev table (`SVC_MAGLEV`) from its first block on, into a region no index entry
    /// names yet: written before its index entry, never under readers.
    PutMaglev(u32, Vec<MaglevBlock>),
    /// A page of `SVC_MAGLEV` none of whose blocks is in a region in use (`MaglevPage`): its
    /// memory goes back to the kernel.
    DelMaglevPage(u32),
    /// Where the table of a generation (`SlotKey` with slot 0) is (`SVC_MAGLEV_INDEX`).
    PutMaglevIndex(SlotKey, MaglevIndex),
    DelMaglevIndex(SlotKey),
}

impl Op {
    pub fn map(&self) -> &'static str {
        match self {
            Op::PutService(..) | Op::DelService(_) => map_names::SERVICES,
            Op::PutSlot(..) | Op::DelSlot(_) => map_names::SLOTS,
            Op::PutBackend(..) | Op::DelBackend(_) => map_names::BACKENDS,
            Op::PutRevNat(..) | Op::DelRevNat(_) => map_names::REV_NAT,
            Op::PutName(..) | Op::DelName(_) => map_names::NAMES,
            Op::PutMatch(_) | Op::DelMatch(_) => map_names::AFFINITY_MATCH,
            Op::PutMeta(_) => map_names::META,
            Op::PutRange(_) | Op::DelRange(_) => map_names::SRC_RANGES,
            Op::PutNodeAddr(..) | Op::DelNodeAddr(_) => map_names::NODE_ADDRS,
            Op::PutConfig(_) => map_names::CONFIG,
            Op::PutMaglev(..) | Op::DelMaglevPage(_) => map_names::MAGLEV,
            Op::PutMaglevIndex(..) | Op::DelMaglevIndex(_) => map_names::MAGLEV_INDEX,
        }
    }
}

/// Declares `Capacity`: one field per map the agent sizes (`MapDef::sized`), named after the
/// flag-friendly word, with the catalogue's default. A sized map without a field here fails
/// the test `every_sized_map_has_a_capacity`.
macro_rules! capacity {
    ($( $(#[$doc:meta])* $field:ident: $map:ident, )*) => {
        /// max_entries of each map the agent sizes.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct Capacity {
            $( $(#[$doc])* pub $field: u32, )*
            /// `--per-service-metrics`: frontends get `SERVICE_STATS` entries (the programs
            /// count only those). Off, the map is made one entry, which nothing writes.
            pub per_service: bool,
        }

        impl Default for Capacity {
            fn default() -> Self {
                Capacity {
                    $( $field: svc_common::capacity::$map, )*
                    per_service: true,
                }
            }
        }

        impl Capacity {
            /// The configured max_entries of `map`, or None for maps sized by the object alone.
            pub fn of(&self, map: &str) -> Option<u32> {
                if map == map_names::SERVICE_STATS && !self.per_service {
                    return Some(1);
                }
                // No room for tables (`--max-maglev-entries 0`) is still a map of one page.
                if map == map_names::MAGLEV && self.maglev == 0 {
                    return Some(1);
                }
                $( if map == map_names::$map { return Some(self.$field); } )*
                // Sized with the assured table, not on its own.
                (map == map_names::CT_NEW).then(|| svc_common::capacity::ct_new(self.ct))
            }

            /// Sets the max_entries of `map`, if it is one with a field of its own.
            pub fn set(&mut self, map: &str, entries: u32) {
                $( if map == map_names::$map { self.$field = entries; } )*
            }
        }
    };
}

capacity! {
    services: SERVICES,
    slots: SLOTS,
    backends: BACKENDS,
    rev_nat: REV_NAT,
    names: NAMES,
    sock_rev: SOCK_REV,
    affinity: AFFINITY,
    affinity_match: AFFINITY_MATCH,
    src_ranges: SRC_RANGES,
    node_addrs: NODE_ADDRS,
    /// Connection tracking (two entries per flow), for the packet datapath.
    ct: CT,
    /// (device, reason) counters of the packet datapath.
    dev_stats: DEV_STATS,
    /// Pages of Maglev table entries (`MaglevPage`), and the index of the tables.
    maglev: MAGLEV,
    maglev_index: MAGLEV_INDEX,
    /// Per-Service counters: one entry per frontend, as the names map.
    service_stats: SERVICE_STATS,
}

impl Capacity {
    /// Blocks of Maglev table entries `SVC_MAGLEV` has room for: where tables may be placed.
    pub fn maglev_blocks(&self) -> u32 {
        self.maglev.saturating_mul(MAGLEV_PAGE)
    }
}

/// Everything the programs read, as found in the maps, plus what names ids elsewhere.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    pub slots: Vec<(SlotKey, SlotGroup)>,
    pub backends: Vec<(BackendId, Backend)>,
    pub rev_nat: Vec<(u32, RevNatValue)>,
    pub names: Vec<(u32, ServiceName)>,
    pub matches: Vec<AffinityMatchKey>,
    /// Frontend and backend ids the kernel keeps in affinity entries: they count as used.
    pub affinity_ids: Vec<(u32, BackendId)>,
    pub meta: MetaValue,
    pub ranges: Vec<SrcRangeKey>,
    pub node_addrs: Vec<([u8; 16], NodeAddrValue)>,
    pub config: DatapathConfig,
    /// `SVC_MAGLEV_INDEX`: where each generation's table is.
    pub maglev_index: Vec<(SlotKey, MaglevIndex)>,
    /// The tables the index names, by first block, when read (`Store::read_tables`; the
    /// drift check does not read them: a table is never changed where it is).
    pub maglev_tables: Option<BTreeMap<u32, Vec<MaglevBlock>>>,
    /// The pages `SVC_MAGLEV` has (`MaglevPage`), by number.
    pub maglev_pages: Vec<u32>,
}

pub trait Store {
    /// Writes one op. `Ok(false)`: a delete found nothing to delete, which is what it wanted.
    fn apply(&mut self, op: &Op) -> Result<bool>;
    /// Writes `ops` in their order, as `apply` one after the other would, and stops at the
    /// first that fails: how many (the first ones) were written, and that one's error. A
    /// store may write a run of puts into one map in one call (`BpfStore`:
    /// BPF_MAP_UPDATE_BATCH); what lands is the same.
    fn apply_batch(&mut self, ops: &[Op]) -> (usize, Result<()>) {
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = self.apply(op) {
                return (i, Err(e));
            }
        }
        (ops.len(), Ok(()))
    }
    /// Writes `first` and `then` as `apply_batch` writes each: entries no reader can reach
    /// yet (no master entry leads to them), into different maps, so their order does not
    /// matter. `then` is not tried when `first` failed (its answer is then `(0, Ok(()))`),
    /// unless the store wrote both at once (`BpfStore`: a run of backends beside the rest, on
    /// two CPUs); each answer is as `apply_batch` gives it.
    fn apply_batches(&mut self, first: &[Op], then: &[Op]) -> [(usize, Result<()>); 2] {
        one_after_the_other(self, first, then)
    }
    /// Reads every map the agent writes, for recovery and drift checks.
    fn snapshot(&self) -> Result<Snapshot>;
    /// What a walk of the live flows of the packet datapath finds; `config` gives the
    /// timeouts and the SNAT range. None when this object has no connection-tracking map (a
    /// predecessor's programs may still have one).
    fn flow_destinations(&self, config: &DatapathConfig) -> Result<Option<FlowWalk>>;
    /// `len` blocks of `SVC_MAGLEV` from `start` (fewer where its room ends).
    fn read_maglev(&self, start: u32, len: u32) -> Result<Vec<MaglevBlock>>;

    /// `snap` with the tables its index names (`Snapshot::maglev_tables`), for an exact
    /// comparison (`verify::check`).
    fn read_tables(&self, snap: &mut Snapshot) -> Result<()> {
        let mut tables = BTreeMap::new();
        for (_, v) in &snap.maglev_index {
            let start = v.offset / svc_common::MAGLEV_BLOCK;
            let len = crate::maglev::blocks(v.size);
            tables.insert(start, self.read_maglev(start, len)?);
        }
        snap.maglev_tables = Some(tables);
        Ok(())
    }
}

/// `Store::apply_batches` on one thread: `first`, then `then` only if `first` all landed.
pub fn one_after_the_other<S: Store + ?Sized>(
    store: &mut S,
    first: &[Op],
    then: &[Op],
) -> [(usize, Result<()>); 2] {
    let a = store.apply_batch(first);
    if a.1.is_err() {
        return [a, (0, Ok(()))];
    }
    [a, store.apply_batch(then)]
}

/// `Store::flow_destinations`' answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowWalk {
    /// The addresses live flows of the external packet datapath are addressed to (the
    /// destination of their FORWARD entry).
    pub destinations: BTreeSet<[u8; 16]>,
    /// Whether a live flow, external or per-packet, was sent to a port in the SNAT range: its
    /// FORWARD tuple may be the reply tuple a SNAT port would give a new flow, so the SNAT port
    /// search must go on looking (`DatapathConfig::snat_range_frontends`).
    pub snat_range_ports: bool,
    /// Live SNATed flows (`snat_flow`) per backend address: the agent asks which device the
    /// node routes each through, as their replies come back by it.
    pub snat_backends: BTreeMap<[u8; 16], u64>,
}

/// The backend address of the SNATed flow whose FORWARD entry is `k`/`v`, if the entry has
/// not timed out at `now_ns` and the flow is not closed (no reply is awaited). Only the FORWARD entry's own last packet counts: a flow whose
/// replies svc's programs never see (they come back on a device without them) has only the
/// client's packets to keep it fresh, and one whose replies svc does see came back through
/// svc's programs anyway. No second pass, no memory per flow.
pub fn snat_flow(k: &CtKey, v: &CtValue, now_ns: u64, config: &DatapathConfig) -> Option<[u8; 16]> {
    if k.dir != ct_dir::FORWARD
        || v.flags & ct_flags::SNAT == 0
        || v.flags & ct_flags::POD != 0
        || ct_flags::closed(v.flags)
    {
        return None;
    }
    let timeout_ns = u64::from(ct_timeout::seconds(config, k.proto, v.flags)) * 1_000_000_000;
    (now_ns.saturating_sub(v.last_seen_ns) <= timeout_ns).then_some(v.nat_addr)
}

/// Whether the flow of entry `k`/`v` was sent to a port in `config`'s SNAT range, and the
/// entry has not timed out at `now_ns` (its partner, met by the same walk, answers for itself).
pub fn to_snat_range_port(k: &CtKey, v: &CtValue, now_ns: u64, config: &DatapathConfig) -> bool {
    let timeout_ns = u64::from(ct_timeout::seconds(config, k.proto, v.flags)) * 1_000_000_000;
    if now_ns.saturating_sub(v.last_seen_ns) > timeout_ns {
        return false;
    }
    let forward = if k.dir == ct_dir::FORWARD {
        *k
    } else {
        k.partner(v)
    };
    let (min, max) = config.snat_range();
    (min..=max).contains(&u16::from_be(forward.dport_be))
}

/// The FORWARD destination of the external flow entry `k`/`v` belongs to, if the entry has
/// not timed out at `now_ns` (the datapath's clock, CLOCK_MONOTONIC_COARSE) by `config`'s
/// timeouts. The datapath also takes an entry for alive while the entry at its partner key
/// is: that entry is met by the same walk and counted for its own flow's destination, which
/// is this one's unless the key was taken over by another flow (whose replies this flow's
/// would then be translated as anyway). Per-packet ClusterIP flows (`ct_flags::POD`) are no
/// external flows.
pub fn flow_destination(
    k: &CtKey,
    v: &CtValue,
    now_ns: u64,
    config: &DatapathConfig,
) -> Option<[u8; 16]> {
    if v.flags & ct_flags::POD != 0 {
        return None;
    }
    let timeout_ns = u64::from(ct_timeout::seconds(config, k.proto, v.flags)) * 1_000_000_000;
    if now_ns.saturating_sub(v.last_seen_ns) > timeout_ns {
        return None;
    }
    if k.dir == ct_dir::FORWARD {
        return Some(k.daddr);
    }
    Some(k.partner(v).daddr)
}

/// The pinned maps of a running datapath.
pub struct BpfStore {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, SlotKey, SlotGroup>,
    /// Backends at `backend_index` (`backend_at`).
    pub backends: Array<MapData, Backend>,
    /// A pinned `BACKENDS` of layout 1, which the programs still attached read, from the
    /// start of an agent that found one until its programs are attached: every backend the
    /// agent writes or deletes is written or deleted there too, so those programs find the
    /// backends of a frontend the first sync changes (`carry_backends_v1`). Not those the
    /// carry left out, which the agent does not know (they stay there until the old map
    /// goes), nor one whose write there failed (said in the log).
    pub backends_v1: Option<HashMap<MapData, BackendId, svc_common::BackendV1>>,
    pub rev_nat: HashMap<MapData, u32, RevNatValue>,
    pub names: HashMap<MapData, u32, ServiceName>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub affinity_match: HashMap<MapData, AffinityMatchKey, u32>,
    pub sock_rev: HashMap<MapData, svc_common::SockRevKey, svc_common::SockRevValue>,
    /// Socket local storage: only pinned (so sockets keep their state across restarts), never
    /// read here.
    pub sock_state: MapData,
    pub meta: Array<MapData, MetaValue>,
    /// The packet datapath's maps the agent writes.
    pub src_ranges: LpmTrie<MapData, RangeData, u32>,
    pub node_addrs: HashMap<MapData, [u8; 16], NodeAddrValue>,
    /// The filter in front of `node_addrs`, kept by `write` (`svc_common::node_addr_bit`).
    pub node_addr_bits: Array<MapData, u64>,
    pub addr_bits: AddrBits,
    pub config: Array<MapData, DatapathConfig>,
    /// Connection tracking and per-device counters: written by the tc programs, read for
    /// metrics; None while the object does not declare them.
    pub ct: Option<MapData>,
    /// The unassured flows' table (`SVC_CT_NEW`), beside `ct`.
    pub ct_new: Option<MapData>,
    pub dev_stats: Option<MapData>,
    /// The Maglev tables and their index (docs/design/maglev.md). None while the object does
    /// not declare them.
    pub maglev: Option<MaglevPages>,
    /// A pinned `MAGLEV` of layout 1 (an array of blocks), which the programs still attached
    /// read, from the start of an agent that found one until its programs are attached: every
    /// table the agent writes is written there too (`migrate::carry_maglev_v1`).
    pub maglev_v1: Option<Array<MapData, MaglevBlock>>,
    pub maglev_index: Option<HashMap<MapData, SlotKey, MaglevIndex>>,
    /// `svc-agent monitor`'s rings (one a slot), slots, summary and counters
    /// (docs/design/monitor.md): held for their pins only; the monitors open them themselves.
    /// None while the object does not declare them.
    pub mon_rings: [Option<MapData>; svc_common::MONITOR_SLOTS as usize],
    pub mon_ctl: Option<MapData>,
    pub mon_on: Option<MapData>,
    pub mon_stats: Option<MapData>,
    /// Per-Service counters (`SERVICE_STATS`): an entry per named frontend while
    /// `capacity.per_service`. None while the object does not declare it.
    pub service_stats: Option<HashMap<MapData, u32, ServiceStats>>,
    pub capacity: Capacity,
    /// Until when a write that fails with ENOMEM is not tried again: set when one failed all
    /// its tries, so memory that stays short (the pod at its limit) fails a sync's writes at
    /// once instead of pausing each of them.
    pub enomem_until: Option<std::time::Instant>,
    /// Whether `apply_batch` writes runs of puts with BPF_MAP_UPDATE_BATCH: until the kernel
    /// refuses it (a kernel before 5.6), then one element per call.
    pub batch_writes: bool,
    /// While a drift check's thread reads the maps: the shards of the entries written since
    /// it began (`Store::apply` and its batches), which its comparison leaves out.
    pub dirty: Option<crate::reconcile::Dirty>,
    /// Named frontends whose per-Service counters are still to be made (`create_pending_stats`):
    /// a bulk write leaves them here rather than making them one syscall each on the way to
    /// `ready`, and a single write whose allocation failed puts its id here.
    pub stats_pending: Vec<u32>,
}

/// The `NODE_ADDRS` keys a store has written and how many share each bit of the filter
/// (`NODE_ADDR_BITS`): a bit is cleared only when its last key goes.
#[derive(Debug, Default)]
pub struct AddrBits {
    keys: std::collections::HashSet<[u8; 16]>,
    shared: std::collections::HashMap<u32, u32>,
}

impl AddrBits {
    /// Counts `addr`; the index of its word in the filter.
    fn add(&mut self, addr: &[u8; 16]) -> u32 {
        let bit = svc_common::node_addr_bit(addr);
        if self.keys.insert(*addr) {
            *self.shared.entry(bit).or_default() += 1;
        }
        bit / 64
    }

    /// Stops counting `addr`; the index of its word when that word loses a bit.
    fn remove(&mut self, addr: &[u8; 16]) -> Option<u32> {
        if !self.keys.remove(addr) {
            return None;
        }
        let bit = svc_common::node_addr_bit(addr);
        let n = self.shared.get_mut(&bit)?;
        *n -= 1;
        if *n > 0 {
            return None;
        }
        self.shared.remove(&bit);
        Some(bit / 64)
    }

    /// Word `w` of the filter as the counted keys make it.
    fn word(&self, w: u32) -> u64 {
        (0..64)
            .filter(|b| self.shared.contains_key(&(w * 64 + b)))
            .fold(0, |word, b| word | 1 << b)
    }
}

/// `SrcRangeKey` after its prefix length: what aya's LPM trie key wraps.
pub type RangeData = [u8; 20];

fn lpm_key(k: &SrcRangeKey) -> LpmKey<RangeData> {
    let mut data = [0u8; 20];
    data[..4].copy_from_slice(&k.id_be.to_ne_bytes());
    data[4..].copy_from_slice(&k.addr);
    LpmKey::new(k.prefixlen, data)
}

fn range_key(k: &LpmKey<RangeData>) -> SrcRangeKey {
    let data = k.data();
    SrcRangeKey {
        prefixlen: k.prefix_len(),
        id_be: u32::from_ne_bytes(data[..4].try_into().expect("4 bytes")),
        addr: data[4..].try_into().expect("16 bytes"),
    }
}

/// aya's syscall errors name the call and keep the errno as their source: both are said.
pub fn map_err(map: &'static str, e: MapError) -> Error {
    match &e {
        MapError::SyscallError(s) => {
            Error::map_io(map, format!("{e}: {}", s.io_error), &s.io_error)
        }
        _ => Error::map(map, e.to_string()),
    }
}

/// `BPF_NOEXIST`: create, never replace.
pub(crate) const BPF_NOEXIST: u64 = 1;

/// ENOENT on delete: already gone, which is what we wanted.
fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound)
        || matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOENT))
}

/// EEXIST on a BPF_NOEXIST insert: the key is there already.
pub(crate) fn is_exists(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::EEXIST))
}

fn is_enomem(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOMEM))
}

/// E2BIG on an insert: the map holds max_entries.
pub(crate) fn is_full(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG))
}

/// Every entry of a hash map, in batches.
pub fn dump<K: aya::Pod + bytemuck::Pod, V: aya::Pod + bytemuck::Pod>(
    map: &'static str,
    m: &HashMap<MapData, K, V>,
) -> Result<Vec<(K, V)>> {
    crate::sys::dump_hash(m.map().fd().as_fd())
        .map_err(|e| Error::map_io(map, format!("reading every entry: {e}"), &e))
}

/// `SVC_MAGLEV` (layout 2): `MaglevPage`s by page number.
pub type MaglevPages = HashMap<MapData, u32, MaglevPage>;

/// Writes `blocks` from block `start` on. Each page they touch is written whole, in one
/// update the kernel swaps in for the old element: a page they cover in part is read first
/// (zeroed if the map lacks it), so the tables it holds besides stay as they were. Written
/// again whole, it writes the same pages the same way (a retry after ENOMEM).
pub fn write_maglev_pages(
    m: &mut MaglevPages,
    start: u32,
    blocks: &[MaglevBlock],
) -> Result<(), MapError> {
    let per = MAGLEV_PAGE as usize;
    let mut at = 0;
    while at < blocks.len() {
        let block = start as usize + at;
        let (page, from) = (block / per, block % per);
        let n = (per - from).min(blocks.len() - at);
        let mut v = if n == per {
            MaglevPage::default()
        } else {
            match m.get(&(page as u32), 0) {
                Ok(v) => v,
                Err(e) if is_not_found(&e) => MaglevPage::default(),
                Err(e) => return Err(e),
            }
        };
        v.blocks[from..from + n].copy_from_slice(&blocks[at..at + n]);
        m.insert(page as u32, v, 0)?;
        at += n;
    }
    Ok(())
}

/// `len` blocks from block `start` on; those of a page the map lacks are zeroed.
pub fn read_maglev_pages(
    m: &MaglevPages,
    start: u32,
    len: u32,
) -> Result<Vec<MaglevBlock>, MapError> {
    let per = MAGLEV_PAGE;
    let mut out = Vec::with_capacity(len as usize);
    let end = start.saturating_add(len);
    let mut block = start;
    while block < end {
        let (page, from) = (block / per, block % per);
        let n = (per - from).min(end - block);
        match m.get(&page, 0) {
            Ok(v) => out.extend_from_slice(&v.blocks[from as usize..(from + n) as usize]),
            Err(e) if is_not_found(&e) => {
                out.resize(out.len() + n as usize, MaglevBlock::default())
            }
            Err(e) => return Err(e),
        }
        block += n;
    }
    Ok(out)
}

/// A write into `BpfStore::backends_v1` failed: the programs still attached may miss that
/// backend until the new ones replace them (a retry of the frontend, then a refusal), which
/// the agent's own maps do not; said, not returned.
fn note_v1(r: Result<(), MapError>) {
    match r {
        Err(e) if !is_not_found(&e) => {
            tracing::warn!(map = map_names::BACKENDS, error = %e,
                "writing a backend into the map of layout 1 the programs still attached read")
        }
        _ => {}
    }
}

/// Every backend in `BACKENDS`, by id: the entries with an id, at that id's index (one
/// elsewhere is found by no lookup).
pub fn dump_backends(m: &Array<MapData, Backend>) -> Result<Vec<(BackendId, Backend)>> {
    let mut out = Vec::new();
    for_each_backend(m.map().fd().as_fd(), m.len(), |id, v| out.push((id, *v)))
        .map_err(|e| Error::map_io(map_names::BACKENDS, format!("reading every entry: {e}"), &e))?;
    Ok(out)
}

/// Calls `f` on every backend of the `BACKENDS` array `fd` of `entries` entries (those with an
/// id, at that id's index), read through a mapping of the array.
fn for_each_backend(
    fd: BorrowedFd<'_>,
    entries: u32,
    mut f: impl FnMut(BackendId, &Backend),
) -> std::io::Result<()> {
    let n = entries.max(1);
    crate::sys::for_each_mapped(fd, entries, |i, v: &Backend| {
        if v.id != 0 && svc_common::backend_index(v.id, n) == i {
            f(v.id, v);
        }
    })
}

/// The index and value a put of backends writes into `BACKENDS` of `entries` entries.
fn backend_put(op: &Op, entries: u32) -> Option<(u32, Backend)> {
    match op {
        Op::PutBackend(k, v) => Some((svc_common::backend_index(*k, entries), v.with_id(*k))),
        _ => None,
    }
}

/// Duplicates of the descriptors of the maps a drift check's digest covers, so that a thread
/// reads them beside the loop that writes them (`reconcile::digest`).
pub struct DigestReader {
    fds: Vec<(usize, std::os::fd::OwnedFd)>,
    /// `SERVICE_STATS`, with its capacity, and whether named frontends are to have counters
    /// (`Capacity::per_service`).
    stats: Option<(std::os::fd::OwnedFd, usize)>,
    per_service: bool,
    /// `BACKENDS`' max_entries: an entry counts where its id's index is, as `dump_backends`.
    backend_entries: u32,
}

/// What a drift check's thread read.
pub struct Reading {
    pub digest: crate::reconcile::Digest,
    /// Named frontends it found without per-Service counters, and counters of no named
    /// frontend (all of them with `per_service` off): ids for the loop to look at again.
    pub stats_lacking: Vec<u32>,
    pub stats_unnamed: Vec<u32>,
}

impl DigestReader {
    /// The digest of the maps as this thread finds them, in memory of one batch of entries.
    pub fn read(&self, hasher: &crate::reconcile::Seeded) -> Result<Reading> {
        use crate::sys::for_each_hash;
        let mut d = crate::reconcile::Digest::default();
        let mut named: Vec<u32> = Vec::new();
        for (map, fd) in &self.fds {
            let (map, fd) = (*map, fd.as_fd());
            let r = match map {
                0 => for_each_hash(fd, |k: &ServiceKey, v: &ServiceValue| {
                    d.service(hasher, k, v)
                }),
                1 => for_each_hash(fd, |k: &SlotKey, v: &SlotGroup| d.add(hasher, map, k, v)),
                2 => for_each_backend(fd, self.backend_entries, |id, v| d.backend(hasher, &id, v)),
                3 => for_each_hash(fd, |k: &u32, v: &RevNatValue| d.add(hasher, map, k, v)),
                4 => for_each_hash(fd, |k: &u32, v: &ServiceName| {
                    d.name(hasher, k, v);
                    named.push(*k);
                }),
                5 => for_each_hash(fd, |k: &AffinityMatchKey, _: &u32| d.member(hasher, k)),
                6 => for_each_hash(fd, |k: &[u8; 16], v: &NodeAddrValue| {
                    d.add(hasher, map, k, v)
                }),
                _ => for_each_hash(fd, |k: &SlotKey, v: &MaglevIndex| d.add(hasher, map, k, v)),
            };
            let name = crate::reconcile::DIGEST_MAPS[map];
            r.map_err(|e| Error::map_io(name, format!("reading every entry: {e}"), &e))?;
        }
        let mut have: Vec<u32> = Vec::new();
        if let Some((fd, capacity)) = &self.stats {
            // Twice the map's keys: a walk that long met deletes all the way (the loop's).
            let limit = capacity.saturating_mul(2);
            crate::sys::for_each_key(fd.as_fd(), limit, |k: &u32| have.push(*k)).map_err(|e| {
                Error::map_io(
                    map_names::SERVICE_STATS,
                    format!("reading every key: {e}"),
                    &e,
                )
            })?;
        } else {
            named.clear();
        }
        if !self.per_service {
            named.clear();
        }
        let (stats_lacking, stats_unnamed) = stats_out_of_line(named, have);
        Ok(Reading {
            digest: d,
            stats_lacking,
            stats_unnamed,
        })
    }
}

/// Of the named frontends `named` and the ids with counters `have`: the named without
/// counters, and the counters without a name.
fn stats_out_of_line(mut named: Vec<u32>, mut have: Vec<u32>) -> (Vec<u32>, Vec<u32>) {
    for ids in [&mut named, &mut have] {
        ids.sort_unstable();
        ids.dedup();
    }
    let missing = |of: &[u32], from: &[u32]| -> Vec<u32> {
        (of.iter())
            .filter(|id| from.binary_search(id).is_err())
            .copied()
            .collect()
    };
    (missing(&named, &have), missing(&have, &named))
}

impl BpfStore {
    /// Where backend `id`'s entry is in `BACKENDS`.
    fn backend_at(&self, id: BackendId) -> u32 {
        svc_common::backend_index(id, self.backends.len().max(1))
    }

    /// Backend `id` as the programs find it: None unless its entry holds that id.
    pub fn backend(&self, id: BackendId) -> Option<Backend> {
        let b = self.backends.get(&self.backend_at(id), 0).ok()?;
        (id != 0 && b.id == id).then_some(b)
    }

    fn write(&mut self, op: &Op) -> Result<(), MapError> {
        match op {
            Op::PutService(k, v) => self.services.insert(k, v, 0),
            Op::PutSlot(k, v) => self.slots.insert(k, v, 0),
            Op::PutBackend(k, v) => {
                // Never over another backend's entry: the planner hands an id out only where
                // its index is free, and this holds it to that (the batched puts of a chunk
                // of Services, `put_run`, are not checked).
                let i = self.backend_at(*k);
                let there = self.backends.get(&i, 0)?.id;
                if there != 0 && there != *k {
                    return Err(MapError::SyscallError(aya::sys::SyscallError {
                        call: "bpf_map_update_elem (SVC_BACKENDS: index taken by another id)",
                        io_error: std::io::Error::from_raw_os_error(libc::EEXIST),
                    }));
                }
                self.backends.set(i, v.with_id(*k), 0)?;
                if let Some(old) = self.backends_v1.as_mut() {
                    note_v1(old.insert(k, svc_common::BackendV1::of(v), 0));
                }
                Ok(())
            }
            Op::PutRevNat(k, v) => self.rev_nat.insert(k, v, 0),
            Op::PutName(k, v) => {
                self.names.insert(k, v, 0)?;
                // The counters are not the Service: an entry the kernel cannot allocate yet
                // (ENOMEM: its caches refill in the background) is made later
                // (`create_pending_stats`), and never fails or delays the Service's write.
                if let Err(e) = self.create_service_stats(*k) {
                    tracing::debug!(frontend = k, error = %e, "per-Service counters made later");
                    self.stats_pending.push(*k);
                }
                Ok(())
            }
            Op::PutMatch(k) => self.affinity_match.insert(k, 0, 0),
            Op::PutMeta(v) => self.meta.set(0, v, 0),
            Op::PutRange(k) => self.src_ranges.insert(&lpm_key(k), 0, 0),
            Op::PutNodeAddr(k, v) => {
                // The bit first: the datapath looks an address up only once its bit is set.
                // Written on every put, so a put also restores a bit that was lost.
                let w = self.addr_bits.add(k);
                self.node_addr_bits.set(w, self.addr_bits.word(w), 0)?;
                self.node_addrs.insert(k, v, 0)
            }
            Op::PutConfig(v) => self.config.set(0, v, 0),
            Op::DelRange(k) => self.src_ranges.remove(&lpm_key(k)),
            Op::DelNodeAddr(k) => {
                // The bit after the address: cleared once no address left there has it.
                let removed = self.node_addrs.remove(k);
                if matches!(&removed, Err(e) if !is_not_found(e)) {
                    return removed;
                }
                if let Some(w) = self.addr_bits.remove(k) {
                    self.node_addr_bits.set(w, self.addr_bits.word(w), 0)?;
                }
                removed
            }
            Op::DelService(k) => self.services.remove(k),
            Op::DelSlot(k) => self.slots.remove(k),
            Op::DelBackend(k) => {
                if let Some(old) = self.backends_v1.as_mut() {
                    note_v1(old.remove(k));
                }
                // An entry is never deleted from an array: a free one holds id 0.
                let i = self.backend_at(*k);
                match self.backends.get(&i, 0) {
                    Ok(b) if b.id == *k => self.backends.set(i, Backend::default(), 0),
                    Ok(_) => Err(MapError::KeyNotFound),
                    Err(e) => Err(e),
                }
            }
            Op::DelRevNat(k) => self.rev_nat.remove(k),
            Op::DelName(k) => {
                let removed = self.names.remove(k);
                self.delete_service_stats(*k)?;
                removed
            }
            Op::DelMatch(k) => self.affinity_match.remove(k),
            Op::PutMaglev(start, blocks) => {
                let end = start.saturating_add(blocks.len() as u32);
                let Some(m) = self.maglev.as_mut() else {
                    return Err(MapError::OutOfBounds {
                        index: *start,
                        max_entries: 0,
                    });
                };
                if end > self.capacity.maglev_blocks() {
                    return Err(MapError::OutOfBounds {
                        index: end - 1,
                        max_entries: self.capacity.maglev_blocks(),
                    });
                }
                write_maglev_pages(m, *start, blocks)?;
                if let Some(old) = self.maglev_v1.as_ref().filter(|_| !blocks.is_empty()) {
                    if let Err(e) = crate::sys::update_array(old.map().fd().as_fd(), *start, blocks)
                    {
                        tracing::warn!(map = map_names::MAGLEV, error = %e,
                            "writing a table into the array of layout 1 the programs still \
                             attached read");
                    }
                }
                Ok(())
            }
            Op::DelMaglevPage(p) => match self.maglev.as_mut() {
                Some(m) => m.remove(p),
                None => Err(MapError::KeyNotFound),
            },
            Op::PutMaglevIndex(k, v) => match self.maglev_index.as_mut() {
                Some(m) => m.insert(k, v, 0),
                None => Err(MapError::OutOfBounds {
                    index: 0,
                    max_entries: 0,
                }),
            },
            Op::DelMaglevIndex(k) => match self.maglev_index.as_mut() {
                Some(m) => m.remove(k),
                None => Err(MapError::KeyNotFound),
            },
        }
    }

    /// A zeroed `SERVICE_STATS` entry for frontend `id`, unless it has one: written with its
    /// name, so the counters of a name written again (a repair) go on, and a frontend id
    /// never starts from another's counts (its entry goes with its name, `DelName`, and
    /// `sync_service_stats` removes any left without one).
    fn create_service_stats(&mut self, id: u32) -> Result<(), MapError> {
        let Some(m) = self
            .service_stats
            .as_mut()
            .filter(|_| self.capacity.per_service)
        else {
            return Ok(());
        };
        match m.insert(id, ServiceStats::default(), BPF_NOEXIST) {
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(())
            }
            r => r,
        }
    }

    /// Makes the per-Service counters of up to `budget` frontends of `stats_pending` that
    /// still have a name (one removed since has none to make). Stops at ENOMEM (the kernel's
    /// caches refill in the background: the caller comes back later) and at any other
    /// error, which it returns; what it did not make stays pending. Returns how many it made,
    /// and whether it stopped at ENOMEM.
    pub fn create_pending_stats(&mut self, budget: usize) -> Result<(usize, bool)> {
        let mut made = 0;
        let mut tried = 0;
        while tried < budget {
            let Some(id) = self.stats_pending.pop() else {
                break;
            };
            tried += 1;
            match self.names.get(&id, 0) {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => continue,
                Err(e) => {
                    self.stats_pending.push(id);
                    return Err(map_err(map_names::NAMES, e));
                }
            }
            if let Err(e) = self.create_service_stats(id) {
                self.stats_pending.push(id);
                if is_enomem(&e) {
                    return Ok((made, true));
                }
                return Err(map_err(map_names::SERVICE_STATS, e));
            }
            made += 1;
        }
        Ok((made, false))
    }

    fn delete_service_stats(&mut self, id: u32) -> Result<(), MapError> {
        match self.service_stats.as_mut().map(|m| m.remove(&id)) {
            Some(Err(e)) if !is_not_found(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Brings `SERVICE_STATS` in line with the names map: an entry for every named frontend
    /// that lacks one (the map is new, or was resized, or per-Service counting was off), none
    /// for an id without a name, and none at all while `per_service` is off. Returns how many
    /// entries it created and deleted.
    pub fn sync_service_stats(&mut self) -> Result<(usize, usize)> {
        let name = map_names::SERVICE_STATS;
        let Some(m) = self.service_stats.as_ref() else {
            return Ok((0, 0));
        };
        let have: Vec<u32> = m
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|e| map_err(name, e))?;
        let named: Vec<u32> = if self.capacity.per_service {
            dump(map_names::NAMES, &self.names)?
                .into_iter()
                .map(|(id, _)| id)
                .collect()
        } else {
            Vec::new()
        };
        let (lacking, unnamed) = stats_out_of_line(named, have);
        self.settle_service_stats(&lacking, &unnamed)
    }

    /// Makes the counters of the named ids of `lacking` that lack them and removes those of
    /// the unnamed ids of `unnamed`, each looked at again here: a drift check's thread found
    /// them out of line (`Reading`) and the loop's writes since may have settled them.
    pub fn settle_service_stats(
        &mut self,
        lacking: &[u32],
        unnamed: &[u32],
    ) -> Result<(usize, usize)> {
        let name = map_names::SERVICE_STATS;
        if self.service_stats.is_none() {
            return Ok((0, 0));
        }
        let named = |store: &Self, id: u32| -> Result<bool> {
            match store.names.get(&id, 0) {
                Ok(_) => Ok(store.capacity.per_service),
                Err(e) if is_not_found(&e) => Ok(false),
                Err(e) => Err(map_err(map_names::NAMES, e)),
            }
        };
        let (mut created, mut deleted) = (0, 0);
        // Those of a bulk write are made in slices (`create_pending_stats`): all at once here
        // would stall the loop as the slices are there not to.
        if self.stats_pending.is_empty() {
            for &id in lacking {
                if named(self, id)? && !self.has_service_stats(id)? {
                    self.create_service_stats(id)
                        .map_err(|e| map_err(name, e))?;
                    created += 1;
                }
            }
        }
        for &id in unnamed {
            if !named(self, id)? && self.has_service_stats(id)? {
                self.delete_service_stats(id)
                    .map_err(|e| map_err(name, e))?;
                deleted += 1;
            }
        }
        Ok((created, deleted))
    }

    fn has_service_stats(&self, id: u32) -> Result<bool> {
        match self.service_stats.as_ref().map(|m| m.get(&id, 0)) {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) if is_not_found(&e) => Ok(false),
            Some(Err(e)) => Err(map_err(map_names::SERVICE_STATS, e)),
        }
    }

    /// Makes the filter (`NODE_ADDR_BITS`) cover what `NODE_ADDRS` holds now: on opening the
    /// maps (a new filter beside pinned addresses, addresses carried into a resized map)
    /// and when reconciling. `clear`: also clear the bits no address has, which only this
    /// store's programs may be spared: before they are attached a predecessor's may read this
    /// filter beside another `NODE_ADDRS` (its pin replaced, its layout older). Returns how
    /// many of its words lacked a bit an address needs, which had the datapath take that
    /// address for none of the node's or frontends'.
    pub fn sync_node_addr_bits(&mut self, clear: bool) -> Result<usize> {
        let addrs = dump(map_names::NODE_ADDRS, &self.node_addrs)?;
        self.addr_bits = AddrBits::default();
        for (k, _) in &addrs {
            self.addr_bits.add(k);
        }
        let err = |e| map_err(map_names::NODE_ADDR_BITS, e);
        let mut lacking = 0;
        for w in 0..svc_common::NODE_ADDR_BIT_WORDS {
            let have = self.node_addr_bits.get(&w, 0).map_err(err)?;
            let want = if clear {
                self.addr_bits.word(w)
            } else {
                self.addr_bits.word(w) | have
            };
            if have != want {
                lacking += usize::from(want & !have != 0);
                self.node_addr_bits.set(w, want, 0).map_err(err)?;
            }
        }
        Ok(lacking)
    }

    /// Totals of the socket programs' decision counters, by reason (`decision_totals`);
    /// none while the object has no counter map.
    pub fn stats(&self) -> Result<Vec<(&'static str, u64)>> {
        match &self.dev_stats {
            Some(m) => Ok(crate::datapath::decision_totals(
                &crate::datapath::counters_of(m)?,
            )),
            None => Ok(Vec::new()),
        }
    }

    /// A reader of the maps a drift check's digest covers, for another thread.
    pub fn digest_reader(&self) -> Result<DigestReader> {
        let mut fds = Vec::new();
        let mut dup = |map: usize, fd: BorrowedFd<'_>| -> Result<()> {
            let name = crate::reconcile::DIGEST_MAPS[map];
            let fd = fd
                .try_clone_to_owned()
                .map_err(|e| Error::map_io(name, format!("duplicating its descriptor: {e}"), &e))?;
            fds.push((map, fd));
            Ok(())
        };
        dup(0, self.services.map().fd().as_fd())?;
        dup(1, self.slots.map().fd().as_fd())?;
        dup(2, self.backends.map().fd().as_fd())?;
        dup(3, self.rev_nat.map().fd().as_fd())?;
        dup(4, self.names.map().fd().as_fd())?;
        dup(5, self.affinity_match.map().fd().as_fd())?;
        dup(6, self.node_addrs.map().fd().as_fd())?;
        if let Some(m) = &self.maglev_index {
            dup(7, m.map().fd().as_fd())?;
        }
        let stats = match &self.service_stats {
            Some(m) => {
                let capacity = self.capacity.of(map_names::SERVICE_STATS).unwrap_or(0);
                let fd = m.map().fd().as_fd().try_clone_to_owned().map_err(|e| {
                    let what = format!("duplicating its descriptor: {e}");
                    Error::map_io(map_names::SERVICE_STATS, what, &e)
                })?;
                Some((fd, capacity as usize))
            }
            None => None,
        };
        Ok(DigestReader {
            fds,
            stats,
            per_service: self.capacity.per_service,
            backend_entries: self.backends.len().max(1),
        })
    }

    pub fn read_config(&self) -> Result<DatapathConfig> {
        self.config
            .get(&0, 0)
            .map_err(|e| map_err(map_names::CONFIG, e))
    }

    pub fn read_meta(&self) -> Result<MetaValue> {
        self.meta
            .get(&0, 0)
            .map_err(|e| map_err(map_names::META, e))
    }

    /// Every entry of the source ranges trie (LPM tries have no batch lookup; it is small).
    pub fn read_ranges(&self) -> Result<Vec<SrcRangeKey>> {
        self.src_ranges
            .keys()
            .map(|k| k.map(|k| range_key(&k)))
            .collect::<Result<_, _>>()
            .map_err(|e| map_err(map_names::SRC_RANGES, e))
    }
}

/// How often, and how long apart at first, a write that failed with ENOMEM is tried again.
pub(crate) const ENOMEM_TRIES: u32 = 12;
const ENOMEM_PAUSE: Duration = Duration::from_micros(100);

/// How long writes fail at once after one failed all its ENOMEM tries.
const ENOMEM_FAIL_FAST: Duration = Duration::from_secs(1);

/// Runs `write` (at most `tries` times) again while it fails with ENOMEM, pausing longer each
/// time (about 0.2 s for `ENOMEM_TRIES`).
/// A hash map that is not preallocated takes its elements from per-CPU caches the kernel
/// refills asynchronously (bpf_mem_alloc); a burst of writes on a busy machine finds them empty
/// for a moment (seen on 2 cores: 104 of 10,000 Services' first writes), which a pause cures.
pub fn retry_enomem(
    tries: u32,
    mut write: impl FnMut() -> Result<(), MapError>,
) -> Result<(), MapError> {
    let mut pause = ENOMEM_PAUSE;
    for _ in 1..tries {
        match write() {
            Err(e) if is_enomem(&e) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            r => return r,
        }
    }
    write()
}

/// Whether `op` is a put `BpfStore::apply_batch` writes in batches: the maps a first sync
/// fills, one entry or more per backend and per frontend.
fn batch_map(op: &Op) -> Option<&'static str> {
    matches!(
        op,
        Op::PutService(..)
            | Op::PutSlot(..)
            | Op::PutBackend(..)
            | Op::PutRevNat(..)
            | Op::PutName(..)
    )
    .then(|| op.map())
}

/// Whether a batch failed because the kernel has no batch updates for hash maps (before 5.6):
/// it refuses the call before the first element.
fn batch_refused(landed: usize, e: &std::io::Error) -> bool {
    landed == 0
        && matches!(
            e.raw_os_error(),
            Some(libc::EINVAL) | Some(crate::sys::ENOTSUPP) | Some(libc::EOPNOTSUPP)
        )
}

/// The keys and values of a run of puts of one kind (`pick` takes them from each).
fn unzip<K, V>(run: &[Op], pick: impl Fn(&Op) -> Option<(K, V)>) -> (Vec<K>, Vec<V>) {
    run.iter().filter_map(pick).unzip()
}

/// Writes `keys` -> `values` into the hash map `fd` in batches, from the first on, trying an
/// element that fails with ENOMEM again as `retry_enomem` does (`enomem_until` as in
/// `Store::apply`). How many landed, and the error that stopped it.
fn put_batch<K: bytemuck::Pod, V: bytemuck::Pod>(
    fd: std::os::fd::BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    enomem_until: &mut Option<std::time::Instant>,
) -> (usize, std::io::Result<()>) {
    let now = std::time::Instant::now();
    let tries = match *enomem_until {
        Some(t) if now < t => 1,
        _ => ENOMEM_TRIES,
    };
    let (mut done, mut left, mut pause) = (0, tries, ENOMEM_PAUSE);
    loop {
        let (n, r) = crate::sys::update_batch(fd, &keys[done..], &values[done..], 0);
        done += n;
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                if n > 0 {
                    (left, pause) = (tries, ENOMEM_PAUSE);
                }
                left -= 1;
                if left == 0 {
                    *enomem_until = Some(std::time::Instant::now() + ENOMEM_FAIL_FAST);
                    return (done, Err(e));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            r => return (done, r),
        }
    }
}

impl BpfStore {
    /// Writes `run`, puts into one map (`batch_map`), in one batch: how many landed, and the
    /// error of the one that did not (the kernel's refusal of the batch call itself included).
    fn put_run(&mut self, run: &[Op]) -> (usize, std::io::Result<()>) {
        let until = &mut self.enomem_until;
        match &run[0] {
            Op::PutService(..) => {
                let (k, v) = unzip(run, |op| match op {
                    Op::PutService(k, v) => Some((*k, *v)),
                    _ => None,
                });
                put_batch(self.services.map().fd().as_fd(), &k, &v, until)
            }
            Op::PutSlot(..) => {
                let (k, v) = unzip(run, |op| match op {
                    Op::PutSlot(k, v) => Some((*k, *v)),
                    _ => None,
                });
                put_batch(self.slots.map().fd().as_fd(), &k, &v, until)
            }
            Op::PutBackend(..) => {
                let entries = self.backends.len();
                let (k, v) = unzip(run, |op| backend_put(op, entries));
                let (n, r) = put_batch(self.backends.map().fd().as_fd(), &k, &v, until);
                if let Some(old) = &self.backends_v1 {
                    let (ids, v1) = unzip(&run[..n], |op| match op {
                        Op::PutBackend(k, v) => Some((*k, svc_common::BackendV1::of(v))),
                        _ => None,
                    });
                    let (_, r) = crate::sys::update_batch(old.map().fd().as_fd(), &ids, &v1, 0);
                    note_v1(r.map_err(|e| {
                        MapError::SyscallError(aya::sys::SyscallError {
                            call: "bpf_map_update_batch",
                            io_error: e,
                        })
                    }));
                }
                (n, r)
            }
            Op::PutRevNat(..) => {
                let (k, v) = unzip(run, |op| match op {
                    Op::PutRevNat(k, v) => Some((*k, *v)),
                    _ => None,
                });
                put_batch(self.rev_nat.map().fd().as_fd(), &k, &v, until)
            }
            Op::PutName(..) => {
                let (k, v) = unzip(run, |op| match op {
                    Op::PutName(k, v) => Some((*k, *v)),
                    _ => None,
                });
                let (n, r) = put_batch(self.names.map().fd().as_fd(), &k, &v, until);
                // Not made here: one syscall each, off the way to `ready` (layout 1's per-CPU
                // entries took about 13 µs each, ENOMEM once a burst drained the kernel's
                // per-CPU pool: 1.3 s of a cold start at 100,000 Services). Made right after,
                // in slices.
                if self.service_stats.is_some() && self.capacity.per_service {
                    self.stats_pending.extend_from_slice(&k[..n]);
                }
                (n, r)
            }
            op => unreachable!("a run of {} is not batched", op.map()),
        }
    }

    /// One element per call from here on (`batch_refused`), said once.
    fn no_batches(&mut self, map: &'static str, e: &std::io::Error) {
        if self.batch_writes {
            tracing::info!(map, error = %e,
                "the kernel refuses batched map updates: writing one entry per call");
        }
        self.batch_writes = false;
    }

    /// A batch's error as `apply` says it for the map.
    fn batch_err(&self, map: &'static str, e: std::io::Error) -> Error {
        if e.raw_os_error() == Some(libc::E2BIG) {
            return Error::MapFull {
                map,
                capacity: self.capacity.of(map).unwrap_or(0),
                object: String::new(),
            };
        }
        map_err(
            map,
            MapError::SyscallError(aya::sys::SyscallError {
                call: "bpf_map_update_batch",
                io_error: e,
            }),
        )
    }
}

impl Store for BpfStore {
    /// Runs of puts into the maps a first sync fills (`batch_map`) go in one syscall each;
    /// anything else, one op per call as `apply`. The kernel writes a batch element by element
    /// and says how many landed, so a failure stops exactly where one op at a time would.
    fn apply_batch(&mut self, ops: &[Op]) -> (usize, Result<()>) {
        if let Some(d) = &mut self.dirty {
            ops.iter().for_each(|op| d.mark_op(op));
        }
        let mut done = 0;
        while done < ops.len() {
            let rest = &ops[done..];
            let map = batch_map(&rest[0]);
            let run = match map {
                Some(m) if self.batch_writes => rest
                    .iter()
                    .take_while(|op| batch_map(op) == Some(m))
                    .count(),
                _ => 1,
            };
            if run == 1 {
                match self.apply(&rest[0]) {
                    Ok(_) => done += 1,
                    Err(e) => return (done, Err(e)),
                }
                continue;
            }
            let map = map.expect("a run is of one batched map");
            let (n, r) = self.put_run(&rest[..run]);
            done += n;
            match r {
                Ok(()) => {}
                Err(e) if batch_refused(n, &e) => self.no_batches(map, &e),
                Err(e) => return (done, Err(self.batch_err(map, e))),
            }
        }
        (done, Ok(()))
    }

    /// A run of backends (a first sync's: a million at 100,000 Services of 10) goes on a
    /// thread of its own beside `then`: at that size the lists and the verifier's work are
    /// usually done by then, the second CPU idle. (Measured when `BACKENDS` was a hash, whose
    /// inserts were most of such a sync; an array's writes are copies, and the thread's gain
    /// since is not measured.) Through a duplicate of the map's descriptor, as the rest needs the
    /// store itself. Where no thread can be made (the pod's pid limit), one after the other.
    fn apply_batches(&mut self, first: &[Op], then: &[Op]) -> [(usize, Result<()>); 2] {
        if let Some(d) = &mut self.dirty {
            first.iter().chain(then).for_each(|op| d.mark_op(op));
        }
        let backends = first.len() > 1
            && first.iter().all(|op| matches!(op, Op::PutBackend(..)))
            && !then.is_empty()
            && self.batch_writes
            && self.backends_v1.is_none();
        let fd = backends
            .then(|| self.backends.map().fd().as_fd().try_clone_to_owned().ok())
            .flatten();
        let Some(fd) = fd else {
            return one_after_the_other(self, first, then);
        };
        let entries = self.backends.len();
        let (k, v) = unzip(first, |op| backend_put(op, entries));
        let mut until = self.enomem_until;
        let beside = std::thread::scope(|scope| {
            let thread = std::thread::Builder::new()
                .name("svc-backends".into())
                .spawn_scoped(scope, || put_batch(fd.as_fd(), &k, &v, &mut until))
                .ok()?;
            let b = self.apply_batch(then);
            // put_batch does not panic. Were it to, what it wrote would be in the map and not
            // in the mirror: leftovers that the next agent's recovery retires.
            let a = thread
                .join()
                .unwrap_or_else(|_| (0, Err(std::io::Error::from_raw_os_error(libc::EIO))));
            Some((a, b))
        });
        let Some(((n, r), b)) = beside else {
            return one_after_the_other(self, first, then);
        };
        self.enomem_until = self.enomem_until.max(until);
        let a = match r {
            Ok(()) => (n, Ok(())),
            Err(e) if batch_refused(n, &e) => {
                self.no_batches(map_names::BACKENDS, &e);
                self.apply_batch(first)
            }
            Err(e) => (n, Err(self.batch_err(map_names::BACKENDS, e))),
        };
        [a, b]
    }

    fn apply(&mut self, op: &Op) -> Result<bool> {
        if let Some(d) = &mut self.dirty {
            d.mark_op(op);
        }
        let map = op.map();
        let now = std::time::Instant::now();
        let tries = match self.enomem_until {
            Some(t) if now < t => 1,
            _ => ENOMEM_TRIES,
        };
        let r = retry_enomem(tries, || self.write(op));
        if matches!(&r, Err(e) if is_enomem(e)) {
            self.enomem_until = Some(std::time::Instant::now() + ENOMEM_FAIL_FAST);
        }
        match r {
            Ok(()) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) if is_full(&e) => Err(Error::MapFull {
                map,
                capacity: self.capacity.of(map).unwrap_or(0),
                object: String::new(),
            }),
            Err(e) => Err(map_err(map, e)),
        }
    }

    fn flow_destinations(&self, config: &DatapathConfig) -> Result<Option<FlowWalk>> {
        let mut out = FlowWalk::default();
        let Some(ct) = &self.ct else {
            return Ok(None);
        };
        let now = crate::sys::coarse_now_ns();
        for (name, table) in [
            (map_names::CT, Some(ct)),
            (map_names::CT_NEW, self.ct_new.as_ref()),
        ] {
            let Some(table) = table else {
                continue;
            };
            crate::sys::for_each_hash::<CtKey, CtValue>(table.fd().as_fd(), |k, v| {
                if let Some(d) = flow_destination(k, v, now, config) {
                    out.destinations.insert(d);
                }
                out.snat_range_ports |= to_snat_range_port(k, v, now, config);
                if let Some(b) = snat_flow(k, v, now, config) {
                    *out.snat_backends.entry(b).or_default() += 1;
                }
            })
            .map_err(|e| Error::map_io(name, e.to_string(), &e))?;
        }
        Ok(Some(out))
    }

    fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            services: dump(map_names::SERVICES, &self.services)?,
            slots: dump(map_names::SLOTS, &self.slots)?,
            backends: dump_backends(&self.backends)?,
            rev_nat: dump(map_names::REV_NAT, &self.rev_nat)?,
            names: dump(map_names::NAMES, &self.names)?,
            matches: dump(map_names::AFFINITY_MATCH, &self.affinity_match)?
                .into_iter()
                .map(|(k, _)| k)
                .collect(),
            affinity_ids: dump(map_names::AFFINITY, &self.affinity)?
                .into_iter()
                .map(|(k, v)| (k.affinity_id, v.backend))
                .collect(),
            meta: self.read_meta()?,
            ranges: self.read_ranges()?,
            node_addrs: dump(map_names::NODE_ADDRS, &self.node_addrs)?,
            config: self
                .config
                .get(&0, 0)
                .map_err(|e| map_err(map_names::CONFIG, e))?,
            maglev_index: match &self.maglev_index {
                Some(m) => dump(map_names::MAGLEV_INDEX, m)?,
                None => Vec::new(),
            },
            maglev_tables: None,
            maglev_pages: match &self.maglev {
                Some(m) => {
                    let mut pages = Vec::new();
                    // A walk restarted by a delete repeats pages: at most twice the map.
                    let limit = (self.capacity.maglev as usize).saturating_mul(2);
                    crate::sys::for_each_key(m.map().fd().as_fd(), limit, |p: &u32| pages.push(*p))
                        .map_err(|e| {
                            Error::map_io(map_names::MAGLEV, format!("listing pages: {e}"), &e)
                        })?;
                    pages.sort_unstable();
                    pages.dedup();
                    pages
                }
                None => Vec::new(),
            },
        })
    }

    fn read_maglev(&self, start: u32, len: u32) -> Result<Vec<MaglevBlock>> {
        let Some(m) = &self.maglev else {
            return Ok(Vec::new());
        };
        let len = len.min(self.capacity.maglev_blocks().saturating_sub(start));
        read_maglev_pages(m, start, len).map_err(|e| map_err(map_names::MAGLEV, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Named frontends without counters and counters without a name, each once, whatever the
    /// order and repeats of a walk that restarted (`sys::for_each_key`).
    #[test]
    fn counters_out_of_line_are_the_two_differences() {
        let (lacking, unnamed) = stats_out_of_line(vec![5, 1, 3, 3], vec![3, 9, 1, 9, 7]);
        assert_eq!(lacking, vec![5]);
        assert_eq!(unnamed, vec![7, 9]);
    }

    /// Every map the catalogue says the agent sizes has its capacity here, with the
    /// catalogue's default; no other map has one.
    #[test]
    fn every_sized_map_has_a_capacity() {
        let c = Capacity::default();
        for m in svc_common::catalogue::MAPS {
            let want = m.sized.then_some(m.max_entries);
            assert_eq!(c.of(m.name), want, "{}", m.name);
        }
    }

    /// Two addresses on one bit of the filter: it stays set while either is there, and goes
    /// with the last; an address put twice (a retried write) counts once, and deleting one
    /// never put leaves the others' bits alone.
    #[test]
    fn a_filter_bit_goes_with_the_last_address_that_has_it() {
        let one = svc_common::v4_mapped([10, 0, 0, 1]);
        let bit = svc_common::node_addr_bit(&one);
        let twin = (0..=u16::MAX)
            .map(|i| {
                let [a, b] = i.to_be_bytes();
                svc_common::v4_mapped([10, 1, a, b])
            })
            .find(|a| svc_common::node_addr_bit(a) == bit)
            .expect("an address of 10.1/16 on the same bit");
        let set = |b: &AddrBits| b.word(bit / 64) & 1 << (bit % 64) != 0;
        let mut b = AddrBits::default();
        assert_eq!(b.add(&one), bit / 64);
        b.add(&one);
        b.add(&twin);
        assert!(set(&b));
        assert_eq!(b.remove(&svc_common::v4_mapped([10, 2, 0, 1])), None);
        assert_eq!(b.remove(&one), None, "the twin still has the bit");
        assert!(set(&b));
        assert_eq!(b.remove(&one), None, "already gone");
        assert!(set(&b));
        assert_eq!(b.remove(&twin), Some(bit / 64));
        assert!(!set(&b));
        assert_eq!(b.word(bit / 64), 0);
    }

    /// 198.51.100.`last`, mapped.
    fn doc_addr(last: u8) -> [u8; 16] {
        svc_common::v4_mapped([198, 51, 100, last])
    }

    /// The FORWARD key of a TCP flow from `client` port 40000 to `frontend`:`port`.
    fn tcp_forward(client: [u8; 16], frontend: [u8; 16], port: u16) -> CtKey {
        CtKey {
            saddr: client,
            daddr: frontend,
            sport_be: 40000u16.to_be(),
            dport_be: port.to_be(),
            proto: svc_common::IPPROTO_TCP,
            dir: ct_dir::FORWARD,
            _pad0: [0; 2],
        }
    }

    /// A FORWARD entry's value: translated to `backend`:8080, last seen at 1,000 s.
    fn to_backend(backend: [u8; 16], flags: u16) -> CtValue {
        CtValue {
            nat_addr: backend,
            nat_port_be: 8080u16.to_be(),
            flags,
            last_seen_ns: 1_000_000_000_000,
            ..Default::default()
        }
    }

    /// A flow's FORWARD entry names its frontend address; its REPLY entry leads there through
    /// the partner key; a timed-out entry and a per-packet ClusterIP flow name none.
    #[test]
    fn flow_destination_is_the_frontend_of_a_live_external_flow() {
        let (client, frontend, backend) = (doc_addr(7), doc_addr(10), doc_addr(20));
        let forward = tcp_forward(client, frontend, 80);
        let v = to_backend(backend, ct_flags::SEEN_REPLY);
        let reply = forward.partner(&v);
        let rv = CtValue {
            nat_addr: frontend,
            nat_port_be: 80u16.to_be(),
            ..v
        };
        let c = DatapathConfig::default();
        let now = v.last_seen_ns + 60 * 1_000_000_000;
        assert_eq!(flow_destination(&forward, &v, now, &c), Some(frontend));
        assert_eq!(flow_destination(&reply, &rv, now, &c), Some(frontend));
        // Established TCP lives its timeout without a packet, not a second more.
        let later = v.last_seen_ns
            + (u64::from(svc_common::ct_timeout::TCP_ESTABLISHED_S) + 1) * 1_000_000_000;
        assert_eq!(flow_destination(&forward, &v, later, &c), None);
        let pod = CtValue {
            flags: v.flags | ct_flags::POD,
            ..v
        };
        assert_eq!(flow_destination(&forward, &pod, now, &c), None);
    }

    /// A live SNATed flow is counted under its backend by its FORWARD entry alone: not by
    /// its REPLY entry, not once timed out or closed, not without SNAT.
    #[test]
    fn snat_flow_names_the_backend_of_a_live_snated_forward_entry() {
        let (client, frontend, backend, node) =
            (doc_addr(7), doc_addr(1), doc_addr(20), doc_addr(1));
        let forward = tcp_forward(client, frontend, 30080);
        let v = CtValue {
            snat_addr: node,
            snat_port_be: 61000u16.to_be(),
            ..to_backend(backend, ct_flags::SNAT)
        };
        let reply = forward.partner(&v);
        let rv = CtValue {
            nat_addr: frontend,
            nat_port_be: 30080u16.to_be(),
            snat_addr: client,
            snat_port_be: 40000u16.to_be(),
            ..v
        };
        let c = DatapathConfig::default();
        let now = v.last_seen_ns + 1_000_000_000;
        assert_eq!(snat_flow(&forward, &v, now, &c), Some(backend));
        assert_eq!(snat_flow(&reply, &rv, now, &c), None);
        let never = now + 100_000 * 1_000_000_000;
        assert_eq!(snat_flow(&forward, &v, never, &c), None);
        let local = CtValue { flags: 0, ..v };
        assert_eq!(snat_flow(&forward, &local, now, &c), None);
        let reset = CtValue {
            flags: ct_flags::SNAT | ct_flags::RST,
            ..v
        };
        assert_eq!(snat_flow(&forward, &reset, now, &c), None);
    }

    fn failed(errno: i32) -> MapError {
        MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_update_elem",
            io_error: std::io::Error::from_raw_os_error(errno),
        })
    }

    #[test]
    fn a_write_short_of_memory_for_a_moment_is_tried_again() {
        let mut calls = 0;
        let r = retry_enomem(ENOMEM_TRIES, || {
            calls += 1;
            if calls < 3 {
                Err(failed(libc::ENOMEM))
            } else {
                Ok(())
            }
        });
        assert!(r.is_ok());
        assert_eq!(calls, 3);
    }

    #[test]
    fn other_errors_and_lasting_enomem_are_returned() {
        let mut calls = 0;
        let r = retry_enomem(ENOMEM_TRIES, || {
            calls += 1;
            Err(failed(libc::E2BIG))
        });
        assert!(is_full(&r.unwrap_err()));
        assert_eq!(calls, 1, "a full map is not tried again");

        let mut calls = 0;
        let r = retry_enomem(ENOMEM_TRIES, || {
            calls += 1;
            Err(failed(libc::ENOMEM))
        });
        let e = map_err("SVC_SLOTS", r.unwrap_err());
        assert_eq!(calls, ENOMEM_TRIES);
        assert_eq!(e.errno(), Some(crate::error::Errno(libc::ENOMEM)), "{e}");
        // The operator reads it in the message.
        assert!(e.to_string().contains("Cannot allocate memory"), "{e}");

        // While memory stays short, a write is tried once: no pause.
        let mut calls = 0;
        let r = retry_enomem(1, || {
            calls += 1;
            Err(failed(libc::ENOMEM))
        });
        assert!(is_enomem(&r.unwrap_err()));
        assert_eq!(calls, 1);
    }
}
