//! Writes to the datapath maps, one operation at a time, in the order the executor decides.
//!
//! Every change is an [`Op`], so the order that keeps readers safe is visible in one place and
//! can be checked against a model of the maps in tests.

use std::os::fd::AsFd;

use aya::maps::{Array, HashMap, IterableMap, MapData, MapError, PerCpuArray};
use svc_common::{
    map_names, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendId, MetaValue,
    RevNatValue, ServiceKey, ServiceName, ServiceValue, SlotKey,
};

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    PutService(ServiceKey, ServiceValue),
    DelService(ServiceKey),
    PutSlot(SlotKey, BackendId),
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
        }
    }
}

/// max_entries of each map the agent sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub services: u32,
    pub slots: u32,
    pub backends: u32,
    pub rev_nat: u32,
    pub names: u32,
    pub sock_rev: u32,
    pub affinity: u32,
    pub affinity_match: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        use svc_common::capacity as c;
        Capacity {
            services: c::SERVICES,
            slots: c::SLOTS,
            backends: c::BACKENDS,
            rev_nat: c::REV_NAT,
            names: c::NAMES,
            sock_rev: c::SOCK_REV,
            affinity: c::AFFINITY,
            affinity_match: c::AFFINITY_MATCH,
        }
    }
}

impl Capacity {
    /// The configured max_entries of `map`, or None for maps sized by the object alone.
    pub fn of(&self, map: &str) -> Option<u32> {
        Some(match map {
            map_names::SERVICES => self.services,
            map_names::SLOTS => self.slots,
            map_names::BACKENDS => self.backends,
            map_names::REV_NAT => self.rev_nat,
            map_names::NAMES => self.names,
            map_names::SOCK_REV => self.sock_rev,
            map_names::AFFINITY => self.affinity,
            map_names::AFFINITY_MATCH => self.affinity_match,
            _ => return None,
        })
    }
}

/// Everything the programs read, as found in the maps, plus what names ids elsewhere.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    pub slots: Vec<(SlotKey, BackendId)>,
    pub backends: Vec<(BackendId, Backend)>,
    pub rev_nat: Vec<(u32, RevNatValue)>,
    pub names: Vec<(u32, ServiceName)>,
    pub matches: Vec<AffinityMatchKey>,
    /// Frontend and backend ids the kernel keeps in affinity entries: they count as used.
    pub affinity_ids: Vec<(u32, BackendId)>,
    pub meta: MetaValue,
}

pub trait Store {
    /// Writes one op. `Ok(false)`: a delete found nothing to delete, which is what it wanted.
    fn apply(&mut self, op: &Op) -> Result<bool>;
    /// Reads every map the agent writes, for recovery and drift checks.
    fn snapshot(&self) -> Result<Snapshot>;
}

/// The pinned maps of a running datapath.
pub struct BpfStore {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, SlotKey, BackendId>,
    pub backends: HashMap<MapData, BackendId, Backend>,
    pub rev_nat: HashMap<MapData, u32, RevNatValue>,
    pub names: HashMap<MapData, u32, ServiceName>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub affinity_match: HashMap<MapData, AffinityMatchKey, u32>,
    pub sock_rev: HashMap<MapData, svc_common::SockRevKey, svc_common::SockRevValue>,
    /// Socket local storage: only pinned (so sockets keep their state across restarts), never
    /// read here.
    pub sock_state: MapData,
    pub meta: Array<MapData, MetaValue>,
    pub stats: PerCpuArray<MapData, u64>,
    pub capacity: Capacity,
}

pub fn map_err(map: &'static str, e: MapError) -> Error {
    Error::Map {
        map,
        message: e.to_string(),
    }
}

/// ENOENT on delete: already gone, which is what we wanted.
fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound)
        || matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::ENOENT))
}

fn is_full(e: &MapError) -> bool {
    matches!(e, MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG))
}

/// Every entry of a hash map, in batches.
pub fn dump<K: aya::Pod + bytemuck::Pod, V: aya::Pod + bytemuck::Pod>(
    map: &'static str,
    m: &HashMap<MapData, K, V>,
) -> Result<Vec<(K, V)>> {
    crate::sys::dump_hash(m.map().fd().as_fd()).map_err(|e| Error::Map {
        map,
        message: format!("reading every entry: {e}"),
    })
}

impl BpfStore {
    /// Totals of the socket programs' decision counters, by reason.
    pub fn stats(&self) -> Result<Vec<(&'static str, u64)>> {
        stat_totals(&self.stats)
    }

    pub fn read_meta(&self) -> Result<MetaValue> {
        self.meta
            .get(&0, 0)
            .map_err(|e| map_err(map_names::META, e))
    }
}

/// Sums each per-CPU decision counter over the CPUs, named as `svc_common::stat::NAMES`.
pub fn stat_totals(stats: &PerCpuArray<MapData, u64>) -> Result<Vec<(&'static str, u64)>> {
    (0..svc_common::stat::COUNT)
        .map(|i| (i, svc_common::stat::NAMES[i as usize]))
        .filter(|(_, name)| *name != "reserved")
        .map(|(i, name)| {
            stats
                .get(&i, 0)
                .map(|per_cpu| (name, per_cpu.iter().sum()))
                .map_err(|e| map_err(map_names::STATS, e))
        })
        .collect()
}

impl Store for BpfStore {
    fn apply(&mut self, op: &Op) -> Result<bool> {
        let map = op.map();
        let r = match op {
            Op::PutService(k, v) => self.services.insert(k, v, 0),
            Op::PutSlot(k, v) => self.slots.insert(k, v, 0),
            Op::PutBackend(k, v) => self.backends.insert(k, v, 0),
            Op::PutRevNat(k, v) => self.rev_nat.insert(k, v, 0),
            Op::PutName(k, v) => self.names.insert(k, v, 0),
            Op::PutMatch(k) => self.affinity_match.insert(k, 0, 0),
            Op::PutMeta(v) => self.meta.set(0, v, 0),
            Op::DelService(k) => self.services.remove(k),
            Op::DelSlot(k) => self.slots.remove(k),
            Op::DelBackend(k) => self.backends.remove(k),
            Op::DelRevNat(k) => self.rev_nat.remove(k),
            Op::DelName(k) => self.names.remove(k),
            Op::DelMatch(k) => self.affinity_match.remove(k),
        };
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

    fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            services: dump(map_names::SERVICES, &self.services)?,
            slots: dump(map_names::SLOTS, &self.slots)?,
            backends: dump(map_names::BACKENDS, &self.backends)?,
            rev_nat: dump(map_names::REV_NAT, &self.rev_nat)?,
            names: dump(map_names::NAMES, &self.names)?,
            matches: dump(map_names::AFFINITY_MATCH, &self.affinity_match)?
                .into_iter()
                .map(|(k, _)| k)
                .collect(),
            affinity_ids: dump(map_names::AFFINITY, &self.affinity)?
                .into_iter()
                .map(|(k, v)| (k.id, v.backend))
                .collect(),
            meta: self.read_meta()?,
        })
    }
}
