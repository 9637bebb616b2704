//! Brings the maps from what is programmed to what is desired, touching only what changed.
//!
//! A reader (a connect() in the kernel) starts at a frontend's master entry, follows it to the
//! slots of one generation, then to backends. The sync keeps every step of that walk valid:
//! - it is split into a pure planner ([`plan`]) that says, per Service, what to write before
//!   the switch, the switch itself, and what to retire, and an executor (here) that writes it;
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
pub mod plan;
mod recover;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use svc_common::{
    is_v4_mapped, node_addr_flags, svc_flags, v4_mapped, AffinityMatchKey, BackendId,
    DatapathConfig, MetaValue, NodeAddrValue, ServiceKey, ServiceName, ServiceValue, SlotKey,
    SrcRangeKey, PROTO_ANY,
};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::model::{Backend, Cidr, DesiredFrontend, DesiredState, Frontend, NodeDesired, Protocol};
use crate::store::{Capacity, Op, Store};

pub use addrs::{external_addr, FlowAddrsReport};

pub use plan::UnitPlan;

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
    /// Slots the master entry names: 1..=count under (id, rev).
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
}

impl ProgFrontend {
    pub fn complete(&self) -> bool {
        self.backends.len() == self.count as usize
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
    }
}

/// "namespace/name" of a frontend's "namespace/name:port" (names and namespaces hold no ':').
pub fn owner_of(name: &str) -> &str {
    name.split_once(':').map_or(name, |(owner, _)| owner)
}

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

/// Something a switch made unreachable, deleted once the grace period has passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Retire {
    /// Slots 1..=count of generation `rev` of frontend `id`.
    Slots { id: u32, rev: u16, count: u16 },
    /// The reverse-NAT and name entries of a removed frontend.
    Ids(u32),
    /// A backend no slot names any more (deleted only if that is still true when due).
    Backend(BackendId),
    /// One entry: a leftover found in the maps, or what a failed Service's sync had written.
    Del(Op),
}

#[derive(Debug, Default)]
pub struct Retiring {
    queue: VecDeque<(Instant, Retire)>,
    /// Generations and ids with entries in the queue, with how many queue items name them:
    /// no new generation or id may be written over them.
    slot_gens: HashMap<(u32, u16), u32>,
    ids: HashMap<u32, u32>,
    backends: HashSet<BackendId>,
}

impl Retiring {
    fn push(&mut self, due: Instant, r: Retire) {
        match &r {
            Retire::Slots { id, rev, .. } | Retire::Del(Op::DelSlot(SlotKey { id, rev, .. })) => {
                *self.slot_gens.entry((*id, *rev)).or_default() += 1;
            }
            Retire::Ids(id) | Retire::Del(Op::DelRevNat(id) | Op::DelName(id)) => {
                *self.ids.entry(*id).or_default() += 1;
            }
            Retire::Backend(id) => {
                if !self.backends.insert(*id) {
                    return;
                }
            }
            Retire::Del(_) => {}
        }
        self.queue.push_back((due, r));
    }

    /// The bookkeeping of `r` once it has been carried out.
    fn done(&mut self, r: &Retire) {
        fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: K) {
            if let Some(n) = m.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&k);
                }
            }
        }
        match r {
            Retire::Slots { id, rev, .. } | Retire::Del(Op::DelSlot(SlotKey { id, rev, .. })) => {
                dec(&mut self.slot_gens, (*id, *rev))
            }
            Retire::Ids(id) | Retire::Del(Op::DelRevNat(id) | Op::DelName(id)) => {
                dec(&mut self.ids, *id)
            }
            Retire::Backend(id) => {
                self.backends.remove(id);
            }
            Retire::Del(_) => {}
        }
    }

    pub fn has_slot_gen(&self, id: u32, rev: u16) -> bool {
        self.slot_gens.contains_key(&(id, rev))
    }

    pub fn has_id(&self, id: u32) -> bool {
        self.ids.contains_key(&id)
    }

    pub fn has_backend(&self, id: BackendId) -> bool {
        self.backends.contains(&id)
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn next_due(&self) -> Option<Instant> {
        self.queue.front().map(|(t, _)| *t)
    }
}

/// Ids handed out so far, and how far they are durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ids {
    pub next_frontend: u32,
    pub next_backend: u32,
    /// Every id below these may be in use somewhere (META holds them).
    pub frontend_hwm: u32,
    pub backend_hwm: u32,
}

impl Default for Ids {
    fn default() -> Self {
        // 0 is no id: markers carry frontend id 0 and the kernel reads backend 0 as "missing".
        Ids {
            next_frontend: 1,
            next_backend: 1,
            frontend_hwm: 0,
            backend_hwm: 0,
        }
    }
}

/// Entries found in the maps that nothing leads to (a dead agent's half-written work, or
/// entries someone else wrote): deleted before anything else is written.
#[derive(Debug, Default)]
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
            addr: addr16(b.addr.ip()),
            port: b.addr.port(),
            protocol,
            local: b.local,
        }
    }

    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(ip_from16(self.addr), self.port)
    }

    pub fn backend(&self) -> Backend {
        Backend {
            addr: self.socket_addr(),
            local: self.local,
        }
    }
}

/// What the agent has written, mirrored in memory so a sync compares against it instead of
/// reading the maps back.
#[derive(Debug)]
pub struct Programmed {
    pub frontends: BTreeMap<Frontend, ProgFrontend>,
    pub markers: BTreeSet<IpAddr>,
    pub backend_ids: HashMap<BackendKey, BackendId>,
    pub backends: HashMap<BackendId, BackendKey>,
    /// How many slots of current generations name each backend.
    backend_refs: HashMap<BackendId, u32>,
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

/// What one pass over due retirements did.
#[derive(Debug, Default)]
pub struct RetireReport {
    pub deleted: usize,
    pub errors: Vec<Error>,
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

pub fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

pub fn ip_from16(a: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(a);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

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
        Error::Map { map, message } => Error::Map {
            map,
            message: format!("{object}: {message}"),
        },
        other => other,
    }
}

/// The frontends of one sync, grouped by the Service they belong to: the unit that is
/// programmed completely or not at all.
type Units<'a> = BTreeMap<Cow<'a, str>, (Vec<&'a DesiredFrontend>, Vec<Frontend>)>;

impl Programmed {
    /// Packs the frontends' tree after a full sync. Filled in key order, a B-tree keeps its
    /// nodes about half full: at 100,000 Services that is 14 MiB of empty slots.
    pub fn compact(&mut self) {
        self.frontends = std::mem::take(&mut self.frontends).into_iter().collect();
    }

    pub fn empty(capacity: Capacity, grace: Duration) -> Programmed {
        Programmed {
            frontends: BTreeMap::new(),
            markers: BTreeSet::new(),
            backend_ids: HashMap::new(),
            backends: HashMap::new(),
            backend_refs: HashMap::new(),
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
            affinity_ports: HashMap::new(),
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
        self.backend_refs.get(&id).copied().unwrap_or(0)
    }

    /// Makes the maps serve `desired`. Errors are per Service: the Service is left as it was,
    /// the rest is applied.
    pub fn apply<S: Store>(&mut self, store: &mut S, desired: &DesiredState) -> SyncReport {
        self.apply_scoped(store, desired, Scope::All, Instant::now())
    }

    /// As `apply`, limited to `scope`: the cost follows the number of frontends in scope,
    /// not the number programmed. `now` dates what this sync retires.
    pub fn apply_scoped<S: Store>(
        &mut self,
        store: &mut S,
        desired: &DesiredState,
        scope: Scope<'_>,
        now: Instant,
    ) -> SyncReport {
        let mut report = SyncReport::default();
        let mut w = Writer { store, ops: 0 };
        report.strays_deleted = self.retire_strays(&mut w, now, &mut report.errors);
        if matches!(scope, Scope::All) {
            let before = report.errors.len();
            self.sync_node(&mut w, &desired.node, &mut report.errors);
            report.node_failed = report.errors.len() > before;
        }

        let units = self.units(desired, scope);
        // Before a frontend whose port lies in the SNAT range: from its first flow on, a SNAT
        // port search must pass over that flow's tuple. A frontend not yet programmed waits
        // for the mark (below).
        let mut range_unmarked = None;
        if let Some(c) = self.config {
            let adding = units
                .values()
                .flat_map(|(u, _)| u.iter().map(|d| &d.frontend));
            let wanted = snat_range_frontends(&c, adding);
            self.snat_range_wanted = match scope {
                Scope::All => snat_range_frontends(&c, desired.frontends.keys()),
                Scope::Only(_) => self.snat_range_wanted || wanted,
            };
            if wanted && c.snat_range_frontends == 0 {
                let mut errors = Vec::new();
                self.put_snat_range_frontends(&mut w, true, &mut errors);
                range_unmarked = errors.first().map(ToString::to_string);
                report.errors.extend(errors);
            }
        }
        let marker_ips: BTreeSet<IpAddr> = match scope {
            Scope::All => desired.cluster_ips.union(&self.markers).copied().collect(),
            Scope::Only(set) => set.iter().map(|fe| fe.ip).collect(),
        };
        let new_markers: Vec<IpAddr> = marker_ips
            .iter()
            .filter(|ip| desired.cluster_ips.contains(ip) && !self.markers.contains(ip))
            .copied()
            .collect();
        // A ClusterIP's marker is what refuses its undefined ports, and the ports of a
        // Service that did not fit: its room is kept before any Service takes its own.
        let mut reserved = new_markers.len() as u64;

        // External frontend addresses before the frontends: the external ingress looks only
        // at packets to addresses NODE_ADDRS holds. A frontend that leaves its address for
        // good is seen to after them.
        let mut addrs_touched = BTreeSet::new();
        let mut addrs_written = BTreeSet::new();
        // Addresses that NODE_ADDRS does not mark `EXTERNAL` after a failed write (absent, or
        // a node address without the mark), with why: new frontends there would be written
        // where no packet looks them up by their own key.
        let mut unwritten: BTreeMap<[u8; 16], String> = BTreeMap::new();
        for (upserts, gone) in units.values() {
            for d in upserts {
                if let Some(a) = addrs::external_addr(&d.frontend) {
                    addrs_touched.insert(a);
                    if !addrs_written.insert(a) {
                        continue;
                    }
                    let mut errors = Vec::new();
                    self.write_addr(&mut w, a, true, &mut errors);
                    let marked = self
                        .node_addrs
                        .get(&a)
                        .is_some_and(|v| v.flags & node_addr_flags::EXTERNAL != 0);
                    if let (Some(e), false) = (errors.first(), marked) {
                        unwritten.insert(a, e.to_string());
                    }
                    report.errors.extend(errors);
                }
            }
            addrs_touched.extend(gone.iter().filter_map(addrs::external_addr));
        }

        let mut unreferenced: Vec<BackendId> = Vec::new();
        for (owner, (upserts, gone)) in units {
            // Only a frontend not yet programmed is held back (with its whole Service): one
            // already programmed is unreachable from outside either way, and its Service's
            // other changes go on; the Service still fails, so the mark is retried.
            let unmarked = |programmed: bool| {
                upserts.iter().find_map(|d| {
                    let a = addrs::external_addr(&d.frontend)?;
                    (self.frontends.contains_key(&d.frontend) == programmed)
                        .then(|| Some((a, unwritten.get(&a)?)))?
                })
            };
            let (held, retried) = (unmarked(false), unmarked(true));
            let not_marked = |a: [u8; 16], why: &str, left: &str| Error::Map {
                map: svc_common::map_names::NODE_ADDRS,
                message: format!(
                    "its external address {} is not marked there ({why}); {left}",
                    ip_from16(a)
                ),
            };
            let range_held = range_unmarked.as_ref().filter(|_| {
                self.config.is_some_and(|c| {
                    let new = upserts.iter().map(|d| &d.frontend);
                    snat_range_frontends(&c, new.filter(|f| !self.frontends.contains_key(f)))
                })
            });
            let result = match (held, range_held) {
                (Some((a, why)), _) => Err(not_marked(a, why, "left as it was")),
                (None, Some(why)) => Err(Error::Map {
                    map: svc_common::map_names::CONFIG,
                    message: format!(
                        "a frontend port in the SNAT range, and the mark the SNAT port search \
                         needs for it is not written ({why}); left as it was"
                    ),
                }),
                (None, None) => Ok(()),
            };
            let result = result
                .and_then(|()| plan::plan_unit(self, &owner, &upserts, &gone))
                .and_then(|plan| self.execute(&mut w, plan, reserved, now, &mut unreferenced));
            let result = result.and_then(|(written, removed)| {
                report.frontends_written += written;
                report.frontends_removed += removed;
                match retried {
                    Some((a, why)) => {
                        Err(not_marked(a, why, "unreachable by its own key until it is"))
                    }
                    None => Ok(()),
                }
            });
            match result {
                Ok(()) => {}
                Err(e) => {
                    report
                        .errors
                        .push(name_object(e, &format!("Service {owner}")));
                    let covered = upserts
                        .iter()
                        .map(|d| d.frontend)
                        .chain(gone.iter().copied())
                        .collect();
                    report.failed.insert(owner.into_owned(), covered);
                }
            }
        }

        for a in addrs_touched {
            self.write_addr(&mut w, a, false, &mut report.errors);
        }

        // Markers after frontends: a new ClusterIP must not refuse a port whose frontend is
        // about to be written.
        for ip in &new_markers {
            match w.op(&Op::PutService(marker_key(*ip), marker_value())) {
                Ok(_) => {
                    self.markers.insert(*ip);
                    self.usage.services += 1;
                }
                Err(e) => report
                    .errors
                    .push(name_object(e, &format!("ClusterIP {ip}"))),
            }
            reserved = reserved.saturating_sub(1);
        }
        debug_assert_eq!(reserved, 0);
        for ip in &marker_ips {
            if !desired.cluster_ips.contains(ip) && self.markers.contains(ip) {
                match w.op(&Op::DelService(marker_key(*ip))) {
                    Ok(found) => {
                        self.markers.remove(ip);
                        if found {
                            self.usage.services -= 1;
                        }
                    }
                    Err(e) => report
                        .errors
                        .push(name_object(e, &format!("ClusterIP {ip}"))),
                }
            }
        }

        // Backends no current generation names: retired (unless named again before due).
        for id in unreferenced {
            if self.backend_refs(id) == 0 && !self.retiring.backends.contains(&id) {
                self.retiring.push(now + self.grace, Retire::Backend(id));
            }
        }
        report.ops = w.ops;
        report
    }

    /// The Services this sync covers, each with the frontends to write and to remove.
    fn units<'a>(&self, desired: &'a DesiredState, scope: Scope<'_>) -> Units<'a> {
        let mut units: Units<'a> = BTreeMap::new();
        let upsert = |units: &mut Units<'a>, d: &'a DesiredFrontend| {
            units
                .entry(Cow::Borrowed(d.owner.as_str()))
                .or_default()
                .0
                .push(d);
        };
        match scope {
            Scope::All => {
                for d in desired.frontends.values() {
                    upsert(&mut units, d);
                }
                for (fe, cur) in &self.frontends {
                    if !desired.frontends.contains_key(fe) {
                        units
                            .entry(Cow::Owned(cur.owner().to_string()))
                            .or_default()
                            .1
                            .push(*fe);
                    }
                }
            }
            Scope::Only(set) => {
                for fe in set {
                    if let Some(d) = desired.frontends.get(fe) {
                        upsert(&mut units, d);
                    } else if let Some(cur) = self.frontends.get(fe) {
                        units
                            .entry(Cow::Owned(cur.owner().to_string()))
                            .or_default()
                            .1
                            .push(*fe);
                    }
                }
            }
        }
        units
    }

    /// Brings SVC_NODE_ADDRS and SVC_CONFIG to `node` alone (after the node's addresses or
    /// the datapath settings changed): no Service is looked at.
    pub fn apply_node<S: Store>(&mut self, store: &mut S, node: &NodeDesired) -> SyncReport {
        let mut report = SyncReport::default();
        let mut w = Writer { store, ops: 0 };
        self.sync_node(&mut w, node, &mut report.errors);
        report.node_failed = !report.errors.is_empty();
        report.ops = w.ops;
        report
    }

    /// Node addresses (see addrs.rs) and the datapath settings.
    fn sync_node<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        node: &NodeDesired,
        errors: &mut Vec<Error>,
    ) {
        self.node_want = node.addrs.iter().map(|(ip, v)| (addr16(*ip), *v)).collect();
        self.write_addrs(w, errors);
        // The mark of frontend ports in the SNAT range is kept (the flow walk clears it once
        // nothing needs it, `clear_snat_range_mark`): a change of the node's settings alone
        // must not drop it under a frontend or a live flow that does.
        let want = node.config.map(|mut c| {
            let kept = self.config.is_some_and(|o| o.snat_range_frontends != 0);
            c.snat_range_frontends =
                u32::from(kept || snat_range_frontends(&c, self.frontends.keys()));
            c
        });
        if let Some(c) = want.filter(|c| self.config != Some(*c)) {
            match w.op(&Op::PutConfig(c)) {
                Ok(_) => self.config = Some(c),
                Err(e) => errors.push(e),
            }
        }
    }

    /// Clears `DatapathConfig::snat_range_frontends` once nothing needs it: no frontend port
    /// in the SNAT range wanted or programmed, and no live flow to such a port (`flows`, from
    /// the walk of the connection-tracking table: a removed frontend's flows live on, up to
    /// their timeout).
    fn clear_snat_range_mark<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        flows: bool,
        errors: &mut Vec<Error>,
    ) {
        let Some(c) = self.config.filter(|c| c.snat_range_frontends != 0) else {
            return;
        };
        if flows || self.snat_range_wanted || snat_range_frontends(&c, self.frontends.keys()) {
            return;
        }
        self.put_snat_range_frontends(w, false, errors);
    }

    /// Writes `DatapathConfig::snat_range_frontends` as `on` into the config as written (none
    /// before the node's config is).
    fn put_snat_range_frontends<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        on: bool,
        errors: &mut Vec<Error>,
    ) {
        let Some(c) = self.config.filter(|c| (c.snat_range_frontends != 0) != on) else {
            return;
        };
        let c = DatapathConfig {
            snat_range_frontends: u32::from(on),
            ..c
        };
        match w.op(&Op::PutConfig(c)) {
            Ok(_) => self.config = Some(c),
            Err(e) => errors.push(name_object(e, "the datapath config")),
        }
    }

    /// Makes ids up to `frontend` and `backend` durable before anything uses them.
    fn persist_ids<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        frontend: u32,
        backend: u32,
    ) -> Result<()> {
        if frontend < self.ids.frontend_hwm && backend < self.ids.backend_hwm {
            return Ok(());
        }
        let block = |need: u32, hwm: u32| {
            if need < hwm {
                hwm
            } else {
                need.saturating_add(ID_BLOCK)
            }
        };
        let f = block(frontend, self.ids.frontend_hwm);
        let b = block(backend, self.ids.backend_hwm);
        w.op(&Op::PutMeta(MetaValue {
            frontend_id_hwm: f,
            backend_id_hwm: b,
            _reserved: [0; 6],
        }))?;
        self.ids.frontend_hwm = f;
        self.ids.backend_hwm = b;
        Ok(())
    }

    /// Writes one Service's plan: all of it, or (on failure) nothing that a reader could
    /// reach. Returns the frontends written and removed.
    fn execute<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        plan: UnitPlan,
        reserved_services: u64,
        now: Instant,
        unreferenced: &mut Vec<BackendId>,
    ) -> Result<(usize, usize)> {
        if plan.is_empty() {
            return Ok((0, 0));
        }
        // Spent whatever happens next: an id a failed write may have left somewhere is never
        // handed out again.
        self.ids.next_frontend = self
            .ids
            .next_frontend
            .max(plan.max_frontend_id.saturating_add(1));
        self.ids.next_backend = self
            .ids
            .next_backend
            .max(plan.max_backend_id.saturating_add(1));
        let mut needs = plan.needs;
        needs.backends += plan.new_backends.len() as u64;
        if let Some((map, capacity)) =
            self.usage
                .overflow(&needs, &self.capacity, reserved_services)
        {
            return Err(Error::MapFull {
                map,
                capacity,
                object: String::new(),
            });
        }
        self.persist_ids(w, plan.max_frontend_id, plan.max_backend_id)?;

        for (id, sa, protocol) in &plan.new_backends {
            w.op(&Op::PutBackend(*id, plan::backend_value(*sa, *protocol)))?;
            // Unreferenced until a master entry names it; retired at the end of the sync if
            // what would have used it fails.
            let k = BackendKey::new(*sa, *protocol);
            self.backend_ids.insert(k, *id);
            self.backends.insert(*id, k);
            self.usage.backends += 1;
            unreferenced.push(*id);
        }

        // Before any master entry names them, prepared entries can go at once; after, a
        // reader may hold a master entry that names them, so they are retired. Membership
        // entries go at once either way: without one a reader only chooses again.
        let undo_prepare = |w: &mut Writer<'_, S>, done: &[(Op, Option<Op>)]| {
            for (_, undo) in done.iter().rev() {
                if let Some(undo) = undo {
                    w.try_op(undo);
                }
            }
        };
        let retire_prepared = |p: &mut Programmed, w: &mut Writer<'_, S>| {
            for (op, undo) in &plan.prepare {
                match undo {
                    Some(undo @ Op::DelMatch(k)) if !w.try_op(undo) => {
                        p.usage.matches += 1;
                        p.strays.matches.push(*k);
                    }
                    Some(Op::DelMatch(_)) => {}
                    Some(undo @ Op::DelRange(k)) if !w.try_op(undo) => {
                        p.usage.ranges += 1;
                        p.strays.ranges.push(*k);
                    }
                    Some(Op::DelRange(_)) => {}
                    Some(undo) => {
                        p.usage.inc_by(op.map(), 1);
                        p.retiring.push(now + p.grace, Retire::Del(undo.clone()));
                    }
                    None => {}
                }
            }
        };
        for (i, (op, _)) in plan.prepare.iter().enumerate() {
            if let Err(e) = w.op(op) {
                undo_prepare(w, &plan.prepare[..i]);
                return Err(e);
            }
        }
        for (i, op) in plan.add.iter().enumerate() {
            if let Err(e) = w.op(op) {
                for added in plan.add[..i].iter().rev() {
                    if let Op::PutService(k, _) = added {
                        w.try_op(&Op::DelService(*k));
                    }
                }
                if i == 0 {
                    undo_prepare(w, &plan.prepare);
                } else {
                    retire_prepared(self, w);
                }
                return Err(e);
            }
        }
        for (i, (op, _)) in plan.switch.iter().enumerate() {
            if let Err(e) = w.op(op) {
                for (_, undo) in plan.switch[..i].iter().rev() {
                    w.try_op(undo);
                }
                for added in plan.add.iter().rev() {
                    if let Op::PutService(k, _) = added {
                        w.try_op(&Op::DelService(*k));
                    }
                }
                if i == 0 && plan.add.is_empty() {
                    undo_prepare(w, &plan.prepare);
                } else {
                    retire_prepared(self, w);
                }
                return Err(e);
            }
        }

        // Committed: the mirror follows the maps.
        self.usage.add(&plan.needs);
        self.usage.sub(&plan.frees);
        let (mut written, mut removed) = (0, 0);
        for (fe, after) in plan.commit {
            let added = after.is_some();
            let before = match after {
                Some(pf) => {
                    written += 1;
                    for b in &pf.backends {
                        *self.backend_refs.entry(*b).or_insert(0) += 1;
                    }
                    self.port_ref(fe.protocol, &pf);
                    self.frontends.insert(fe, pf)
                }
                None => {
                    removed += 1;
                    self.frontends.remove(&fe)
                }
            };
            if before.is_some() != added {
                self.external_ref(&fe, added);
            }
            if let Some(before) = before {
                self.port_unref(fe.protocol, &before);
                for b in &before.backends {
                    if let Some(n) = self.backend_refs.get_mut(b) {
                        *n -= 1;
                        if *n == 0 {
                            self.backend_refs.remove(b);
                            unreferenced.push(*b);
                        }
                    }
                }
            }
        }
        for r in plan.retire {
            self.retiring.push(now + self.grace, r);
        }
        // Right after the switch: a choice remembered for a departed backend is honoured no
        // more (a reader still holding the old master entry just chooses again). A delete
        // that fails leaves a stray, deleted before the next sync writes anything.
        for op in &plan.after {
            match op {
                Op::DelMatch(k) if w.op(op).is_err() => {
                    warn!(
                        id = k.id,
                        backend = k.backend,
                        "membership entry not deleted"
                    );
                    self.usage.matches += 1;
                    self.strays.matches.push(*k);
                }
                // A range no longer wanted: the frontend admits a client too many until the
                // stray is deleted, before the next sync writes anything.
                Op::DelRange(k) if w.op(op).is_err() => {
                    warn!(id = u32::from_be(k.id_be), "source range not deleted");
                    self.usage.ranges += 1;
                    self.strays.ranges.push(*k);
                }
                _ => {}
            }
        }
        debug!(owner = %plan.owner, written, removed, "service synced");
        Ok((written, removed))
    }

    /// Retires what a dead agent (or anyone) left that nothing leads to. Done before any
    /// write: ids and generations are never written over a leftover (they are never reused,
    /// and new generations skip retiring ones), so a leftover is never mistaken for a new
    /// entry; and a reader that read a master entry just before the dead agent switched it
    /// still finds the old generation for the grace period.
    fn retire_strays<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        now: Instant,
        errors: &mut Vec<Error>,
    ) -> usize {
        if self.strays.is_empty() {
            return 0;
        }
        let strays = std::mem::take(&mut self.strays);
        let n = strays.len();
        warn!(entries = n, "retiring leftover entries nothing leads to");
        // A master entry that is not ours leads nowhere we know: it goes at once.
        for k in strays.services {
            match w.op(&Op::DelService(k)) {
                Ok(true) => self.usage.services = self.usage.services.saturating_sub(1),
                Ok(false) => {}
                Err(e) => errors.push(e),
            }
        }
        let due = now + self.grace;
        for k in strays.slots {
            self.retiring.push(due, Retire::Del(Op::DelSlot(k)));
        }
        for id in strays.rev_nat {
            self.retiring.push(due, Retire::Del(Op::DelRevNat(id)));
        }
        for id in strays.names {
            self.retiring.push(due, Retire::Del(Op::DelName(id)));
        }
        for id in strays.backends {
            self.retiring.push(due, Retire::Backend(id));
        }
        // A range of no frontend admits nobody anything: it goes at once.
        for k in strays.ranges {
            match w.op(&Op::DelRange(k)) {
                Ok(true) => self.usage.ranges = self.usage.ranges.saturating_sub(1),
                Ok(false) => {}
                Err(e) => {
                    self.strays.ranges.push(k);
                    errors.push(e);
                }
            }
        }
        // A membership entry only confirms a remembered choice: it goes at once.
        for k in strays.matches {
            match w.op(&Op::DelMatch(k)) {
                Ok(true) => self.usage.matches = self.usage.matches.saturating_sub(1),
                Ok(false) => {}
                Err(e) => {
                    self.strays.matches.push(k);
                    errors.push(e);
                }
            }
        }
        n
    }

    /// Deletes what has been unreachable for the grace period.
    pub fn retire_due<S: Store>(&mut self, store: &mut S, now: Instant) -> RetireReport {
        let mut report = RetireReport::default();
        let mut w = Writer { store, ops: 0 };
        while let Some((due, _)) = self.retiring.queue.front() {
            if *due > now {
                break;
            }
            let (_, r) = self.retiring.queue.pop_front().expect("front exists");
            self.retiring.done(&r);
            match r {
                Retire::Slots { id, rev, count } => {
                    for slot in 1..=count {
                        if w.try_op(&Op::DelSlot(SlotKey { id, rev, slot })) {
                            self.usage.slots = self.usage.slots.saturating_sub(1);
                            report.deleted += 1;
                        }
                    }
                }
                Retire::Ids(id) => {
                    if w.try_op(&Op::DelRevNat(id)) {
                        self.usage.rev_nat = self.usage.rev_nat.saturating_sub(1);
                        report.deleted += 1;
                    }
                    if w.try_op(&Op::DelName(id)) {
                        self.usage.names = self.usage.names.saturating_sub(1);
                        report.deleted += 1;
                    }
                }
                Retire::Del(op) => {
                    if w.try_op(&op) {
                        self.usage.dec(op.map());
                        report.deleted += 1;
                    }
                }
                Retire::Backend(id) => {
                    if self.backend_refs(id) > 0 {
                        continue;
                    }
                    match w.op(&Op::DelBackend(id)) {
                        Ok(found) => {
                            if found {
                                self.usage.backends = self.usage.backends.saturating_sub(1);
                                report.deleted += 1;
                            }
                            self.forget_backend(id);
                        }
                        Err(e) => {
                            // Kept in the mirror: the next drift check finds and retires it.
                            report.errors.push(e);
                        }
                    }
                }
            }
        }
        report
    }

    fn forget_backend(&mut self, id: BackendId) {
        if let Some(k) = self.backends.remove(&id) {
            if self.backend_ids.get(&k) == Some(&id) {
                self.backend_ids.remove(&k);
            }
        }
    }

    /// Every id below these is spoken for.
    pub fn id_marks(&self) -> (u32, u32) {
        (self.ids.next_frontend, self.ids.next_backend)
    }
}
