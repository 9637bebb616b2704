//! Brings the maps from what is programmed to what is desired, touching only what changed.
//!
//! A reader (a connect() in the kernel) starts at a frontend's master entry, follows it to the
//! slots of one generation, then to backends. The sync keeps every step of that walk valid:
//! - it is split into a pure planner ([`plan`]) that says what the whole sync writes (per
//!   Service: what to write before the switch, the switch itself, and what to retire), and an
//!   executor (here) that writes it;
//! - backends and slots are written before the master entry that makes them reachable; a new
//!   backend set goes under a new generation, and one write of the master entry switches to it;
//! - what the switch made unreachable (old generations, backends nothing names any more, the
//!   reverse-NAT and name entries of removed frontends) is retired only after a grace period,
//!   so a reader that read the old master entry just before the switch still finds it all;
//! - membership entries (AFFINITY_MATCH: which backends a frontend has, against which the
//!   kernel checks a remembered choice) are written before the switch for the new backends
//!   and deleted right after it for the departed ones: a missing entry only makes a reader
//!   choose again, a stale one would keep a client on a backend that left;
//! - a Service is programmed completely or left as it was: map space is checked before its
//!   first write, and a failed write undoes what the Service's sync wrote;
//! - ids are never handed out twice: a high-water mark is made durable in the META map before
//!   any id under it is used, so neither a crash nor a second process can reuse an id that a
//!   leftover entry still carries.

mod addrs;
mod backends;
mod digest;
mod execute;
mod ids;
pub mod plan;
mod recover;
mod retire;
mod show;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use svc_common::{
    is_v4_mapped, svc_flags, AffinityMatchKey, BackendId, DatapathConfig, MaglevIndex,
    NodeAddrValue, ServiceKey, ServiceName, ServiceValue, SlotGroup, SlotKey, SrcRangeKey,
    PROTO_ANY, SLOT_GROUP,
};
use tracing::warn;

use crate::error::{Error, Result};
use crate::model::{Backend, Cidr, DesiredFrontend, Frontend, Protocol};
use crate::store::{Capacity, Op, Store};

pub use addrs::{external_addr, FlowAddrsReport};
pub use backends::Backends;
pub use digest::{Digest, Dirty, Unsure, MAPS as DIGEST_MAPS, SHARDS};

pub use ids::Ids;
pub use plan::{NodePlan, Plan, Planned, ServicePlan, UnitPlan};
pub use retire::{Retire, RetireReport, Retiring};

/// The mirror's and the plans' hash tables: foldhash, not std's SipHash, which was a tenth of
/// the agent's CPU in a first sync of 100,000 Services.
pub type HashMap<K, V> = std::collections::HashMap<K, V, Seeded>;
pub type HashSet<K> = std::collections::HashSet<K, Seeded>;

/// foldhash seeded from the operating system's randomness (through std's `RandomState`): the
/// keys (backend addresses, port names) come from API objects, and foldhash's own seed comes
/// from addresses and the clock. One shared seed per process, one more per table.
#[derive(Clone, Debug)]
pub struct Seeded(foldhash::fast::SeedableRandomState);

impl Default for Seeded {
    fn default() -> Self {
        use std::hash::BuildHasher as _;
        static SHARED: std::sync::OnceLock<foldhash::SharedSeed> = std::sync::OnceLock::new();
        let random = || std::hash::RandomState::new().hash_one(0u64);
        let shared = SHARED.get_or_init(|| foldhash::SharedSeed::from_u64(random()));
        Seeded(foldhash::fast::SeedableRandomState::with_seed(
            random(),
            shared,
        ))
    }
}

impl std::hash::BuildHasher for Seeded {
    type Hasher = foldhash::fast::FoldHasher<'static>;

    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

/// The most backends one frontend can have: slots are numbered with a u16.
pub const MAX_BACKENDS_PER_FRONTEND: usize = u16::MAX as usize;

/// How long what a switch made unreachable stays in the maps. A reader holds a master entry
/// for microseconds; a second leaves room for preemption and a loaded machine.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(1);

/// Ids are reserved in blocks, so making them durable costs one META write per block.
const ID_BLOCK: u32 = 4096;

/// The state of an entry keyed by a frontend id (reverse NAT, name) as found in the maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Ok,
    Missing,
    /// Present with another value.
    Wrong,
}

/// One frontend as it is in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgFrontend {
    pub id: u32,
    pub rev: u16,
    /// Slots the master entry names under (id, rev), in `slot_groups(count)` entries.
    pub count: u16,
    pub flags: u16,
    pub affinity_timeout_s: u32,
    /// `ServiceValue::affinity_id`: the Service port's (see `Programmed::affinity_ports`); 0
    /// without affinity.
    pub affinity_id: u32,
    /// Backend of each slot, in slot order; shorter than `count` when the maps lost slots or
    /// backends (then the next sync writes a new generation).
    pub backends: Vec<BackendId>,
    /// "namespace/name:port" as in the names map.
    pub name: String,
    pub name_entry: Entry,
    pub rev_nat_entry: Entry,
    /// Backends with a membership entry (AFFINITY_MATCH) under this id, as in the map:
    /// sorted, no duplicates; empty (no allocation) for frontends that do not keep them.
    pub matches: Vec<BackendId>,
    /// Source ranges (SRC_RANGES) under this id, as in the map: sorted; empty (no
    /// allocation) for all but LoadBalancer frontends with loadBalancerSourceRanges.
    pub ranges: Box<[Cidr]>,
    /// The Maglev table of generation `rev` (its index entry is written): the master entry
    /// carries `svc_flags::MAGLEV`, which `flags` never holds then.
    pub maglev: Option<TableRef>,
    /// Recovery found a slots entry of this generation naming a backend past its last slot:
    /// no reader reaches it, but the entry is not what this agent writes, so the generation
    /// is written again (`complete` is false) while `backends` keeps what readers reach.
    pub torn: bool,
}

/// Where a generation's Maglev table is in `SVC_MAGLEV`, as its index entry says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableRef {
    /// First block.
    pub start: u32,
    /// Entries, `M` (one of `maglev::SIZES`).
    pub size: u32,
    pub seed: u64,
}

impl TableRef {
    /// Blocks it takes.
    pub fn blocks(&self) -> u32 {
        crate::maglev::blocks(self.size)
    }

    pub fn index(&self) -> MaglevIndex {
        MaglevIndex {
            offset: self.start * svc_common::MAGLEV_BLOCK,
            size: self.size,
            seed: [self.seed as u32, (self.seed >> 32) as u32],
        }
    }

    /// The table an index entry names; None for one no agent writes (an offset inside a
    /// block, a size not in the ladder).
    pub fn of(v: &MaglevIndex) -> Option<TableRef> {
        (v.offset.is_multiple_of(svc_common::MAGLEV_BLOCK)
            && crate::maglev::SIZES.contains(&v.size))
        .then(|| TableRef {
            start: v.offset / svc_common::MAGLEV_BLOCK,
            size: v.size,
            seed: u64::from(v.seed[0]) | u64::from(v.seed[1]) << 32,
        })
    }
}

/// The `SLOTS` entries of generation `rev` of frontend `id` whose slots name `backends`, in
/// slot order.
pub fn slot_entries(
    id: u32,
    rev: u16,
    backends: &[BackendId],
) -> impl Iterator<Item = (SlotKey, SlotGroup)> + '_ {
    (1u16..)
        .zip(backends.chunks(SLOT_GROUP as usize))
        .map(move |(slot, chunk)| {
            let mut g = SlotGroup::default();
            g.backends[..chunk.len()].copy_from_slice(chunk);
            (SlotKey { id, rev, slot }, g)
        })
}

/// The `SLOTS` keys of generation `rev` of frontend `id`, of `count` slots.
pub fn slot_keys(id: u32, rev: u16, count: u16) -> impl Iterator<Item = SlotKey> {
    (1..=svc_common::slot_groups(count)).map(move |slot| SlotKey { id, rev, slot })
}

/// The index key of generation `rev` of frontend `id`.
pub fn maglev_key(id: u32, rev: u16) -> SlotKey {
    SlotKey { id, rev, slot: 0 }
}

/// The Maglev side of the mirror (docs/design/maglev.md).
#[derive(Debug)]
pub struct MaglevState {
    pub settings: crate::maglev::Settings,
    /// Free space of `SVC_MAGLEV`: every region an index entry names, or a retirement will
    /// free, is taken.
    pub regions: crate::maglev::Regions,
    /// The generations (id, rev) whose current master entry carries a table, with it.
    pub live: HashMap<(u32, u16), TableRef>,
    /// External frontends that want a table and found no room: programmed without one
    /// (random choice), tried again at each sync of them.
    pub roomless: BTreeSet<Frontend>,
    /// Pages of `SVC_MAGLEV` that may hold no region in use any more (a region in them was
    /// freed, or a restart found them): deleted if so by `Programmed::drop_loose_pages`.
    pub loose: BTreeSet<u32>,
}

impl MaglevState {
    pub fn new(capacity: &Capacity) -> MaglevState {
        MaglevState {
            settings: crate::maglev::Settings::default(),
            regions: crate::maglev::Regions::new(capacity.maglev_blocks()),
            live: HashMap::default(),
            roomless: BTreeSet::new(),
            loose: BTreeSet::new(),
        }
    }

    /// `Regions::free`, which leaves the pages of the region loose when its last holder
    /// gives it back.
    pub fn free(&mut self, start: u32, len: u32) -> bool {
        if !self.regions.free(start, len) {
            return false;
        }
        if self.regions.holders(start) == 0 {
            let per = svc_common::MAGLEV_PAGE;
            self.loose.extend(start / per..(start + len).div_ceil(per));
        }
        true
    }

    /// Bytes of table entries the current generations use (2 an entry), a table their
    /// frontends share counted once.
    pub fn table_bytes(&self) -> u64 {
        let tables: BTreeMap<u32, u32> = self.live.values().map(|t| (t.start, t.size)).collect();
        tables.values().map(|&size| u64::from(size) * 2).sum()
    }
}

impl ProgFrontend {
    pub fn complete(&self) -> bool {
        self.backends.len() == self.count as usize && !self.torn
    }

    /// The Service ("namespace/name") this frontend belongs to.
    pub fn owner(&self) -> &str {
        owner_of(&self.name)
    }

    fn value(&self) -> ServiceValue {
        ServiceValue {
            id: self.id,
            count: self.count,
            rev: self.rev,
            flags: self.flags,
            _pad0: 0,
            affinity_timeout_s: self.affinity_timeout_s,
            affinity_id: self.affinity_id,
        }
        .with_table(self.maglev.is_some())
    }
}

trait WithTable {
    fn with_table(self, table: bool) -> Self;
}

impl WithTable for ServiceValue {
    fn with_table(mut self, table: bool) -> Self {
        if table {
            self.flags |= svc_flags::MAGLEV;
        }
        self
    }
}

pub use crate::model::owner_of;

/// Entries in the maps the agent writes, counted as they are written and deleted, so a
/// Service that does not fit is refused before its first write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub services: u64,
    pub slots: u64,
    pub backends: u64,
    pub rev_nat: u64,
    pub names: u64,
    pub matches: u64,
    pub ranges: u64,
    pub node_addrs: u64,
}

impl Usage {
    fn add(&mut self, o: &Usage) {
        self.services += o.services;
        self.slots += o.slots;
        self.backends += o.backends;
        self.rev_nat += o.rev_nat;
        self.names += o.names;
        self.matches += o.matches;
        self.ranges += o.ranges;
        self.node_addrs += o.node_addrs;
    }

    fn dec(&mut self, map: &str) {
        self.inc_by(map, -1);
    }

    fn inc_by(&mut self, map: &str, d: i64) {
        use svc_common::map_names as m;
        let c = match map {
            m::SERVICES => &mut self.services,
            m::SLOTS => &mut self.slots,
            m::BACKENDS => &mut self.backends,
            m::REV_NAT => &mut self.rev_nat,
            m::NAMES => &mut self.names,
            m::AFFINITY_MATCH => &mut self.matches,
            m::SRC_RANGES => &mut self.ranges,
            m::NODE_ADDRS => &mut self.node_addrs,
            _ => return,
        };
        *c = c.saturating_add_signed(d);
    }

    fn sub(&mut self, o: &Usage) {
        self.services = self.services.saturating_sub(o.services);
        self.slots = self.slots.saturating_sub(o.slots);
        self.backends = self.backends.saturating_sub(o.backends);
        self.rev_nat = self.rev_nat.saturating_sub(o.rev_nat);
        self.names = self.names.saturating_sub(o.names);
        self.matches = self.matches.saturating_sub(o.matches);
        self.ranges = self.ranges.saturating_sub(o.ranges);
        self.node_addrs = self.node_addrs.saturating_sub(o.node_addrs);
    }

    /// The first map `needs` does not fit in, with `reserved` services entries kept free.
    fn overflow(
        &self,
        needs: &Usage,
        cap: &Capacity,
        reserved: u64,
    ) -> Option<(&'static str, u32)> {
        use svc_common::map_names as m;
        let checks = [
            (
                m::SERVICES,
                self.services + reserved,
                needs.services,
                cap.services,
            ),
            (m::SLOTS, self.slots, needs.slots, cap.slots),
            (m::BACKENDS, self.backends, needs.backends, cap.backends),
            (m::REV_NAT, self.rev_nat, needs.rev_nat, cap.rev_nat),
            (m::NAMES, self.names, needs.names, cap.names),
            (
                m::AFFINITY_MATCH,
                self.matches,
                needs.matches,
                cap.affinity_match,
            ),
            (m::SRC_RANGES, self.ranges, needs.ranges, cap.src_ranges),
        ];
        checks
            .into_iter()
            .find(|(_, used, need, cap)| *need > 0 && used + need > *cap as u64)
            .map(|(map, _, _, cap)| (map, cap))
    }
}

/// Entries found in the maps that nothing leads to (a dead agent's half-written work, or
/// entries someone else wrote): deleted before anything else is written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Strays {
    pub services: Vec<ServiceKey>,
    pub slots: Vec<SlotKey>,
    pub rev_nat: Vec<u32>,
    pub names: Vec<u32>,
    pub backends: Vec<BackendId>,
    /// Membership entries of no frontend, or left by a delete that failed.
    pub matches: Vec<AffinityMatchKey>,
    /// Source ranges of no frontend, or left by a delete that failed.
    pub ranges: Vec<SrcRangeKey>,
    /// Maglev index entries of no current generation with a table, with the region each
    /// names when it is taken in the mirror until retired.
    pub maglev: Vec<(SlotKey, Option<TableRef>)>,
}

impl Strays {
    pub fn len(&self) -> usize {
        self.services.len()
            + self.slots.len()
            + self.rev_nat.len()
            + self.names.len()
            + self.backends.len()
            + self.matches.len()
            + self.ranges.len()
            + self.maglev.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A backend as the mirror keys it: 20 bytes where `(SocketAddr, Protocol)` takes 36, which
/// counts at hundreds of thousands of backends. Its flags are part of it: a backend entry is
/// never changed in place, so an endpoint that moves to this node (or away) gets a new id,
/// written before the slots that name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendKey {
    /// IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    pub port: u16,
    pub protocol: Protocol,
    /// `backend_flags::LOCAL`.
    pub local: bool,
}

impl BackendKey {
    pub fn new(b: Backend, protocol: Protocol) -> BackendKey {
        BackendKey {
            addr: b.addr16(),
            port: b.port(),
            protocol,
            local: b.local,
        }
    }

    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(ip_from16(self.addr), self.port)
    }

    pub fn backend(&self) -> Backend {
        Backend::new(self.socket_addr(), self.local)
    }
}

/// What the agent has written, mirrored in memory so a sync compares against it instead of
/// reading the maps back.
#[derive(Debug)]
pub struct Programmed {
    pub frontends: BTreeMap<Frontend, ProgFrontend>,
    pub markers: BTreeSet<IpAddr>,
    /// The backend entries, with how many slots of current generations name each, and the
    /// id each address's new slots use.
    pub backends: Backends,
    pub ids: Ids,
    pub usage: Usage,
    pub capacity: Capacity,
    pub grace: Duration,
    pub retiring: Retiring,
    pub strays: Strays,
    /// SVC_NODE_ADDRS as written (see addrs.rs).
    pub node_addrs: BTreeMap<[u8; 16], NodeAddrValue>,
    /// The node's addresses as the last node sync wanted them.
    node_want: BTreeMap<[u8; 16], NodeAddrValue>,
    /// How many programmed frontends have each external frontend address.
    external_refs: BTreeMap<[u8; 16], u32>,
    /// SVC_CONFIG as written (None: not known to hold anything the agent wrote).
    pub config: Option<DatapathConfig>,
    /// Whether the last full sync's desired state had a frontend port in the SNAT range (a
    /// sync of some frontends alone only sets it): the mark
    /// (`DatapathConfig::snat_range_frontends`) stays while it does, a Service that failed
    /// included.
    snat_range_wanted: bool,
    /// The affinity id of each Service port with sessionAffinity ("namespace/name:port" as
    /// the names map holds it, and protocol), with how many programmed frontends carry it:
    /// a frontend added to the port later (a new LoadBalancer IP) joins its clients'
    /// choices. Rebuilt from the master entries after a restart, so choices remembered before
    /// it keep matching; forgotten with the port's last frontend.
    pub affinity_ports: HashMap<(Box<str>, Protocol), PortAffinity>,
    pub maglev: MaglevState,
}

/// One Service port's affinity id and how many programmed frontends carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAffinity {
    pub id: u32,
    pub frontends: u32,
}

impl Default for Programmed {
    fn default() -> Self {
        Programmed::empty(Capacity::default(), DEFAULT_GRACE)
    }
}

/// What one sync did.
#[derive(Debug, Default)]
pub struct SyncReport {
    pub frontends_written: usize,
    pub frontends_removed: usize,
    pub ops: usize,
    /// Leftovers found before the sync wrote anything (retired like everything unreachable).
    pub strays_deleted: usize,
    pub errors: Vec<Error>,
    /// Services that could not be programmed (left as they were), with the frontends their
    /// sync covered, so a retry covers the same.
    pub failed: BTreeMap<String, BTreeSet<Frontend>>,
    /// The node's addresses or datapath settings could not all be written (a sync of the
    /// node's state that failed): to be retried.
    pub node_failed: bool,
}

impl SyncReport {
    pub fn changed(&self) -> bool {
        self.ops > 0
    }
}

/// Which frontends a sync looks at.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// Every frontend: whatever is programmed and not desired is removed.
    All,
    /// Only these; the rest of the programmed state is left as it is. `desired.cluster_ips`
    /// must still be complete.
    Only(&'a BTreeSet<Frontend>),
}

pub use crate::model::{addr16, ip_from16};

/// Whether any of `frontends` has its port in `c`'s SNAT range: the datapath's SNAT port
/// search must then pass over live flows' FORWARD tuples
/// (`DatapathConfig::snat_range_frontends`).
pub fn snat_range_frontends<'a>(
    c: &DatapathConfig,
    frontends: impl IntoIterator<Item = &'a Frontend>,
) -> bool {
    let (min, max) = c.snat_range();
    frontends
        .into_iter()
        .any(|fe| (min..=max).contains(&fe.port))
}

pub fn service_key(fe: &Frontend) -> ServiceKey {
    ServiceKey {
        addr: addr16(fe.ip),
        port_be: fe.port.to_be(),
        proto: fe.protocol.ipproto(),
        scope: fe.scope.value(),
    }
}

/// The SRC_RANGES key of range `c` of frontend `id`.
pub fn range_key(id: u32, c: &Cidr) -> SrcRangeKey {
    let bits = match c.addr {
        IpAddr::V4(_) => 96 + u32::from(c.prefix),
        IpAddr::V6(_) => u32::from(c.prefix),
    };
    SrcRangeKey {
        prefixlen: 32 + bits,
        id_be: id.to_be(),
        addr: addr16(c.addr),
    }
}

/// The frontend id and range of an SRC_RANGES key; None for a key no agent writes.
pub fn range_of(k: &SrcRangeKey) -> Option<(u32, Cidr)> {
    let bits = k.prefixlen.checked_sub(32).filter(|b| *b <= 128)?;
    let ip = ip_from16(k.addr);
    let prefix = match ip {
        IpAddr::V4(_) if is_v4_mapped(&k.addr) => bits.checked_sub(96)?,
        _ => bits,
    };
    let c = Cidr::new(ip, prefix as u8);
    // Only what `range_key` writes: host bits clear.
    (range_key(u32::from_be(k.id_be), &c) == *k).then_some((u32::from_be(k.id_be), c))
}

pub fn marker_key(ip: IpAddr) -> ServiceKey {
    ServiceKey {
        addr: addr16(ip),
        port_be: 0,
        proto: PROTO_ANY,
        scope: 0,
    }
}

pub fn marker_value() -> ServiceValue {
    ServiceValue {
        flags: svc_flags::ADDR_MARKER,
        ..Default::default()
    }
}

pub fn encode_name(name: &str) -> ServiceName {
    let mut out = ServiceName { name: [0; 160] };
    // Keep the last byte NUL; cut on a char boundary so the stored prefix is valid UTF-8.
    let mut end = name.len().min(out.name.len() - 1);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    out.name[..end].copy_from_slice(&name.as_bytes()[..end]);
    out
}

pub fn decode_name(n: &ServiceName) -> String {
    let end = n.name.iter().position(|&b| b == 0).unwrap_or(n.name.len());
    String::from_utf8_lossy(&n.name[..end]).into_owned()
}

/// The name as the names map would hold it (truncated like `encode_name`).
pub fn stored_name(name: &str) -> String {
    decode_name(&encode_name(name))
}

pub fn flags_of(d: &DesiredFrontend) -> (u16, u32) {
    let mut flags = d.kind.flags();
    if d.affinity_timeout_s.is_some() {
        flags |= svc_flags::AFFINITY;
    }
    if d.internal_local {
        flags |= svc_flags::INTERNAL_LOCAL;
    }
    if d.external_local {
        flags |= svc_flags::EXTERNAL_LOCAL;
    }
    if d.source_ranges.is_some() {
        flags |= svc_flags::SOURCE_RANGES;
    }
    (flags, d.affinity_timeout_s.unwrap_or(0))
}

/// The SRC_RANGES entries `d` wants, sorted.
pub fn ranges_of(d: &DesiredFrontend) -> Box<[Cidr]> {
    let mut r: Vec<Cidr> = d.source_ranges.as_deref().unwrap_or_default().to_vec();
    r.sort();
    r.dedup();
    r.into_boxed_slice()
}

/// Applies ops, counting them.
struct Writer<'a, S: Store> {
    store: &'a mut S,
    ops: usize,
}

impl<S: Store> Writer<'_, S> {
    /// `Ok(true)` when the op changed something (a delete found its key).
    fn op(&mut self, op: &Op) -> Result<bool> {
        let r = self.store.apply(op)?;
        self.ops += 1;
        if matches!(
            op,
            Op::PutNodeAddr(..) | Op::DelNodeAddr(_) | Op::PutConfig(_)
        ) {
            fail::fail_point!(crate::fault::NODE_WRITE_PAUSE);
        }
        Ok(r)
    }

    /// Writes `ops` in order as `op` one after the other would, stopping at the first that
    /// fails: how many landed (`Store::apply_batch`).
    fn batch(&mut self, ops: &[Op]) -> (usize, Result<()>) {
        let (landed, r) = self.store.apply_batch(ops);
        self.ops += landed;
        (landed, r)
    }

    /// `Store::apply_batches`: `first` and `then` in either order, or at once.
    fn batches(&mut self, first: &[Op], then: &[Op]) -> [(usize, Result<()>); 2] {
        let r = self.store.apply_batches(first, then);
        self.ops += r[0].0 + r[1].0;
        r
    }

    /// Best effort, for undoing and retiring: a failure is logged, never fatal.
    fn try_op(&mut self, op: &Op) -> bool {
        match self.op(op) {
            Ok(r) => r,
            Err(e) => {
                warn!("{op:?}: {e}");
                false
            }
        }
    }
}

fn name_object(e: Error, object: &str) -> Error {
    match e {
        Error::MapFull { map, capacity, .. } => Error::MapFull {
            map,
            capacity,
            object: object.to_string(),
        },
        Error::Map {
            map,
            message,
            errno,
        } => Error::Map {
            map,
            message: format!("{object}: {message}"),
            errno,
        },
        other => other,
    }
}

impl Programmed {
    /// Packs the frontends' tree after a full sync or a recovery, and as a large sync grows
    /// (`execute_plan`). Filled in key order, a B-tree keeps its nodes about half full (at
    /// 100,000 Services, 14 MiB of empty slots); in a map dump's order, about a third empty.
    pub fn compact(&mut self) {
        self.frontends = crate::sys::packed(std::mem::take(&mut self.frontends));
    }

    pub fn empty(capacity: Capacity, grace: Duration) -> Programmed {
        Programmed {
            frontends: BTreeMap::new(),
            markers: BTreeSet::new(),
            backends: Backends::new(capacity.backends),
            ids: Ids::default(),
            usage: Usage::default(),
            capacity,
            grace,
            retiring: Retiring::default(),
            strays: Strays::default(),
            node_addrs: BTreeMap::new(),
            node_want: BTreeMap::new(),
            external_refs: BTreeMap::new(),
            config: None,
            snat_range_wanted: false,
            affinity_ports: HashMap::default(),
            maglev: MaglevState::new(&capacity),
        }
    }

    /// The affinity id programmed for `name`'s port over `protocol`, if any frontend of it
    /// has one.
    pub fn port_affinity(&self, name: &str, protocol: Protocol) -> Option<u32> {
        // A lookup by (&str, Protocol) would need a borrowed key type; ports with affinity
        // are few and this runs once per frontend written.
        self.affinity_ports
            .get(&(Box::from(name), protocol))
            .map(|a| a.id)
    }

    /// Counts `pf` (a frontend of `protocol`) under its port's affinity id.
    fn port_ref(&mut self, protocol: Protocol, pf: &ProgFrontend) {
        if pf.flags & svc_flags::AFFINITY == 0 || pf.affinity_id == 0 {
            return;
        }
        self.affinity_ports
            .entry((Box::from(pf.name.as_str()), protocol))
            .or_insert(PortAffinity {
                id: pf.affinity_id,
                frontends: 0,
            })
            .frontends += 1;
    }

    /// Undoes `port_ref`.
    fn port_unref(&mut self, protocol: Protocol, pf: &ProgFrontend) {
        if pf.flags & svc_flags::AFFINITY == 0 || pf.affinity_id == 0 {
            return;
        }
        let key = (Box::from(pf.name.as_str()), protocol);
        if let Some(a) = self.affinity_ports.get_mut(&key) {
            a.frontends = a.frontends.saturating_sub(1);
            if a.frontends == 0 {
                self.affinity_ports.remove(&key);
            }
        }
    }

    /// Entries the agent keeps in each map it writes, with the map's capacity.
    pub fn map_usage(&self) -> Vec<(&'static str, usize, u32)> {
        use svc_common::map_names as m;
        let c = &self.capacity;
        let u = &self.usage;
        vec![
            (m::SERVICES, u.services as usize, c.services),
            (m::SLOTS, u.slots as usize, c.slots),
            (m::BACKENDS, u.backends as usize, c.backends),
            (m::REV_NAT, u.rev_nat as usize, c.rev_nat),
            (m::NAMES, u.names as usize, c.names),
            (m::AFFINITY_MATCH, u.matches as usize, c.affinity_match),
            (m::SRC_RANGES, u.ranges as usize, c.src_ranges),
            (m::NODE_ADDRS, u.node_addrs as usize, c.node_addrs),
        ]
    }

    pub fn backend_refs(&self, id: BackendId) -> u32 {
        self.backends.refs(id)
    }

    /// Who each programmed frontend belongs to, as the names map says.
    pub fn served(&self) -> crate::model::Served {
        (self.frontends.iter())
            .map(|(fe, f)| (*fe, f.owner().to_string()))
            .collect()
    }

    /// Every id below these is spoken for.
    pub fn id_marks(&self) -> (u32, u32) {
        (self.ids.next_frontend, self.ids.next_backend)
    }
}
