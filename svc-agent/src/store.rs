//! Writes to the datapath maps, one operation at a time, in the order `sync` decides.
//!
//! Every change is an [`Op`], so the order that keeps readers safe is visible in one place and
//! can be checked against a model of the maps in tests.

use std::collections::HashMap as StdHashMap;

use aya::maps::{HashMap, MapData, MapError, PerCpuArray};
use svc_common::{
    map_names, AffinityKey, AffinityValue, Backend, BackendId, RevNatValue, ServiceKey,
    ServiceName, ServiceValue, SlotKey,
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
}

impl Op {
    fn map(&self) -> &'static str {
        match self {
            Op::PutService(..) | Op::DelService(_) => map_names::SERVICES,
            Op::PutSlot(..) | Op::DelSlot(_) => map_names::SLOTS,
            Op::PutBackend(..) | Op::DelBackend(_) => map_names::BACKENDS,
            Op::PutRevNat(..) | Op::DelRevNat(_) => map_names::REV_NAT,
            Op::PutName(..) | Op::DelName(_) => map_names::NAMES,
        }
    }
}

/// Everything the programs read, as found in the maps.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    pub slots: Vec<(SlotKey, BackendId)>,
    pub backends: Vec<(BackendId, Backend)>,
    pub rev_nat: Vec<(u32, RevNatValue)>,
    pub names: Vec<(u32, ServiceName)>,
}

pub trait Store {
    fn apply(&mut self, op: &Op) -> Result<()>;
    /// Deletes the affinity entries `stale` picks; returns how many.
    fn purge_affinity(
        &mut self,
        stale: &dyn Fn(&AffinityKey, &AffinityValue) -> bool,
    ) -> Result<usize>;
}

/// The pinned maps of a running datapath.
pub struct BpfStore {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, SlotKey, BackendId>,
    pub backends: HashMap<MapData, BackendId, Backend>,
    pub rev_nat: HashMap<MapData, u32, RevNatValue>,
    pub names: HashMap<MapData, u32, ServiceName>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub stats: PerCpuArray<MapData, u64>,
    /// max_entries of each map, to name a full map in errors.
    pub capacity: StdHashMap<&'static str, u32>,
}

fn map_err(map: &'static str, e: MapError) -> Error {
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

impl BpfStore {
    pub fn snapshot(&self) -> Result<Snapshot> {
        fn all<K: aya::Pod, V: aya::Pod>(
            map: &'static str,
            m: &HashMap<MapData, K, V>,
        ) -> Result<Vec<(K, V)>> {
            m.iter()
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| map_err(map, e))
        }
        Ok(Snapshot {
            services: all(map_names::SERVICES, &self.services)?,
            slots: all(map_names::SLOTS, &self.slots)?,
            backends: all(map_names::BACKENDS, &self.backends)?,
            rev_nat: all(map_names::REV_NAT, &self.rev_nat)?,
            names: all(map_names::NAMES, &self.names)?,
        })
    }

    /// Totals of the socket programs' decision counters, by reason.
    pub fn stats(&self) -> Result<Vec<(&'static str, u64)>> {
        stat_totals(&self.stats)
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
    fn apply(&mut self, op: &Op) -> Result<()> {
        let map = op.map();
        let r = match op {
            Op::PutService(k, v) => self.services.insert(k, v, 0),
            Op::PutSlot(k, v) => self.slots.insert(k, v, 0),
            Op::PutBackend(k, v) => self.backends.insert(k, v, 0),
            Op::PutRevNat(k, v) => self.rev_nat.insert(k, v, 0),
            Op::PutName(k, v) => self.names.insert(k, v, 0),
            Op::DelService(k) => self.services.remove(k),
            Op::DelSlot(k) => self.slots.remove(k),
            Op::DelBackend(k) => self.backends.remove(k),
            Op::DelRevNat(k) => self.rev_nat.remove(k),
            Op::DelName(k) => self.names.remove(k),
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) if is_full(&e) => Err(Error::MapFull {
                map,
                capacity: self.capacity.get(map).copied().unwrap_or(0),
                object: String::new(),
            }),
            Err(e) => Err(map_err(map, e)),
        }
    }

    fn purge_affinity(
        &mut self,
        stale: &dyn Fn(&AffinityKey, &AffinityValue) -> bool,
    ) -> Result<usize> {
        let doomed: Vec<AffinityKey> = self
            .affinity
            .iter()
            .filter_map(|r| r.ok())
            .filter(|(k, v)| stale(k, v))
            .map(|(k, _)| k)
            .collect();
        for k in &doomed {
            match self.affinity.remove(k) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(map_names::AFFINITY, e)),
            }
        }
        Ok(doomed.len())
    }
}
