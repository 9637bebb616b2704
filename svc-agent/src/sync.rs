//! Brings the maps from what is programmed to what is desired, touching only what changed.
//!
//! Order is what keeps a connect() safe while the agent writes: a reader starts at a
//! frontend's master entry, follows it to the slots of one generation, then to backends. So
//! - backends and slots are written before the master entry that makes them reachable;
//! - a new backend set goes under a new generation, and one final write of the master entry
//!   switches to it;
//! - nothing is deleted while a master entry can still lead to it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use svc_common::{
    svc_flags, v4_mapped, Backend, BackendId, RevNatValue, ServiceKey, ServiceName, ServiceValue,
    SlotKey, PROTO_ANY,
};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::model::{DesiredFrontend, DesiredState, Frontend, Protocol};
use crate::store::{Op, Snapshot, Store};

/// The most backends one frontend can have: slots are numbered with a u16.
pub const MAX_BACKENDS_PER_FRONTEND: usize = u16::MAX as usize;

/// One frontend as it is in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgFrontend {
    pub id: u32,
    pub rev: u16,
    pub flags: u16,
    pub affinity_timeout_s: u32,
    /// Slot order.
    pub backends: Vec<BackendId>,
    pub name: String,
}

/// What the agent has written, mirrored in memory so a sync compares against it instead of
/// reading the maps back.
#[derive(Debug, Default)]
pub struct Programmed {
    pub frontends: BTreeMap<Frontend, ProgFrontend>,
    pub markers: BTreeSet<IpAddr>,
    pub backend_ids: HashMap<(SocketAddr, Protocol), BackendId>,
    pub backends: HashMap<BackendId, (SocketAddr, Protocol)>,
    /// How many frontend slots name each backend, kept as frontends change so a sync of a
    /// few services never walks all of them.
    backend_refs: HashMap<BackendId, u32>,
    /// Backends whose count fell to zero (or never rose): deleted at the end of a sync.
    unreferenced: HashSet<BackendId>,
    next_frontend_id: u32,
    next_backend_id: u32,
    /// Entries found in the maps that nothing leads to (a previous agent died mid-sync).
    stray_slots: Vec<SlotKey>,
    stray_ids: Vec<u32>,
}

/// What one sync did.
#[derive(Debug, Default)]
pub struct SyncReport {
    pub frontends_written: usize,
    pub frontends_removed: usize,
    pub ops: usize,
    pub affinity_purged: usize,
    pub errors: Vec<Error>,
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

pub fn service_key(fe: &Frontend) -> ServiceKey {
    ServiceKey {
        addr: addr16(fe.ip),
        port_be: fe.port.to_be(),
        proto: fe.protocol.ipproto(),
        scope: 0,
    }
}

pub fn marker_key(ip: IpAddr) -> ServiceKey {
    ServiceKey {
        addr: addr16(ip),
        port_be: 0,
        proto: PROTO_ANY,
        scope: 0,
    }
}

fn marker_value() -> ServiceValue {
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

fn flags_of(d: &DesiredFrontend) -> (u16, u32) {
    let mut flags = 0;
    if d.affinity_timeout_s.is_some() {
        flags |= svc_flags::AFFINITY;
    }
    if d.internal_local {
        flags |= svc_flags::INTERNAL_LOCAL;
    }
    (flags, d.affinity_timeout_s.unwrap_or(0))
}

/// Applies ops in order, counting them; the first failure stops the sequence.
struct Writer<'a, S: Store> {
    store: &'a mut S,
    ops: usize,
}

impl<S: Store> Writer<'_, S> {
    fn op(&mut self, op: Op) -> Result<()> {
        self.store.apply(&op)?;
        self.ops += 1;
        Ok(())
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

impl Programmed {
    /// Rebuilds the mirror from the maps a previous agent left pinned.
    pub fn recover(snap: &Snapshot) -> Programmed {
        let mut p = Programmed {
            next_frontend_id: 1,
            next_backend_id: 1,
            ..Default::default()
        };
        for (id, b) in &snap.backends {
            let Some(proto) = Protocol::from_ipproto(b.proto) else {
                continue;
            };
            let sa = SocketAddr::new(ip_from16(b.addr), u16::from_be(b.port_be));
            p.backend_ids.insert((sa, proto), *id);
            p.backends.insert(*id, (sa, proto));
            p.next_backend_id = p.next_backend_id.max(id.saturating_add(1));
        }
        let slots: HashMap<SlotKey, BackendId> = snap.slots.iter().copied().collect();
        let names: HashMap<u32, String> = snap
            .names
            .iter()
            .map(|(id, n)| (*id, decode_name(n)))
            .collect();
        let mut used_slots = HashSet::new();
        let mut used_ids = HashSet::new();
        for (k, v) in &snap.services {
            if v.flags & svc_flags::ADDR_MARKER != 0 {
                p.markers.insert(ip_from16(k.addr));
                continue;
            }
            let Some(protocol) = Protocol::from_ipproto(k.proto) else {
                continue;
            };
            let fe = Frontend {
                ip: ip_from16(k.addr),
                port: u16::from_be(k.port_be),
                protocol,
            };
            let mut backends = Vec::with_capacity(v.count as usize);
            for slot in 1..=v.count {
                let sk = SlotKey {
                    id: v.id,
                    rev: v.rev,
                    slot,
                };
                match slots.get(&sk) {
                    Some(b) if p.backends.contains_key(b) => {
                        backends.push(*b);
                        used_slots.insert(sk);
                    }
                    // A broken set is rewritten by the next sync: an empty list never equals
                    // a desired one that has backends.
                    _ => {
                        warn!(frontend = %fe, "slot {slot} missing in pinned maps; will rewrite");
                        backends.clear();
                        break;
                    }
                }
            }
            used_ids.insert(v.id);
            p.next_frontend_id = p.next_frontend_id.max(v.id.saturating_add(1));
            p.frontends.insert(
                fe,
                ProgFrontend {
                    id: v.id,
                    rev: v.rev,
                    flags: v.flags,
                    affinity_timeout_s: v.affinity_timeout_s,
                    backends,
                    name: names.get(&v.id).cloned().unwrap_or_default(),
                },
            );
        }
        p.stray_slots = slots
            .keys()
            .filter(|k| !used_slots.contains(*k))
            .copied()
            .collect();
        let mut stray: BTreeSet<u32> = snap.rev_nat.iter().map(|(id, _)| *id).collect();
        stray.extend(snap.names.iter().map(|(id, _)| *id));
        p.stray_ids = stray
            .into_iter()
            .filter(|id| !used_ids.contains(id))
            .collect();
        for f in p.frontends.values() {
            for b in &f.backends {
                *p.backend_refs.entry(*b).or_insert(0) += 1;
            }
        }
        p.unreferenced = p
            .backends
            .keys()
            .filter(|id| !p.backend_refs.contains_key(id))
            .copied()
            .collect();
        p
    }

    fn add_refs(&mut self, ids: &[BackendId]) {
        for id in ids {
            *self.backend_refs.entry(*id).or_insert(0) += 1;
        }
    }

    fn drop_refs(&mut self, ids: &[BackendId]) {
        for id in ids {
            if let Some(n) = self.backend_refs.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    self.backend_refs.remove(id);
                    self.unreferenced.insert(*id);
                }
            }
        }
    }

    /// Makes the maps serve `desired`. Errors are per object: the object is skipped, the rest
    /// is applied, and what was programmed for a failed object stays as it was.
    pub fn apply<S: Store>(&mut self, store: &mut S, desired: &DesiredState) -> SyncReport {
        self.apply_scoped(store, desired, Scope::All)
    }

    /// As `apply`, limited to `scope`: the cost follows the number of frontends in scope,
    /// not the number programmed.
    pub fn apply_scoped<S: Store>(
        &mut self,
        store: &mut S,
        desired: &DesiredState,
        scope: Scope<'_>,
    ) -> SyncReport {
        let mut report = SyncReport::default();
        let mut w = Writer { store, ops: 0 };
        // Per frontend id, the backends it no longer uses: their affinity entries must go.
        let mut dropped: HashMap<u32, HashSet<BackendId>> = HashMap::new();
        let mut removed_ids: HashSet<u32> = HashSet::new();

        let (upserts, gone): (Vec<&DesiredFrontend>, Vec<Frontend>) = match scope {
            Scope::All => (
                desired.frontends.values().collect(),
                self.frontends
                    .keys()
                    .filter(|fe| !desired.frontends.contains_key(fe))
                    .copied()
                    .collect(),
            ),
            Scope::Only(set) => (
                set.iter().filter_map(|fe| desired.frontends.get(fe)).collect(),
                set.iter()
                    .filter(|fe| {
                        !desired.frontends.contains_key(fe) && self.frontends.contains_key(fe)
                    })
                    .copied()
                    .collect(),
            ),
        };

        for d in upserts {
            match self.upsert(&mut w, &d.frontend, d, &mut dropped) {
                Ok(true) => report.frontends_written += 1,
                Ok(false) => {}
                Err(e) => report.errors.push(name_object(e, &d.service)),
            }
        }

        // Markers after frontends: a new ClusterIP must not refuse a port whose frontend is
        // about to be written.
        let marker_ips: BTreeSet<IpAddr> = match scope {
            Scope::All => desired
                .cluster_ips
                .union(&self.markers)
                .copied()
                .collect(),
            Scope::Only(set) => set.iter().map(|fe| fe.ip).collect(),
        };
        for ip in &marker_ips {
            if desired.cluster_ips.contains(ip) && !self.markers.contains(ip) {
                match w.op(Op::PutService(marker_key(*ip), marker_value())) {
                    Ok(()) => {
                        self.markers.insert(*ip);
                    }
                    Err(e) => report.errors.push(name_object(e, &format!("ClusterIP {ip}"))),
                }
            }
        }

        for fe in gone {
            match self.remove(&mut w, &fe) {
                Ok(id) => {
                    removed_ids.insert(id);
                    report.frontends_removed += 1;
                }
                Err(e) => report.errors.push(name_object(e, &fe.to_string())),
            }
        }
        for ip in &marker_ips {
            if !desired.cluster_ips.contains(ip) && self.markers.contains(ip) {
                match w.op(Op::DelService(marker_key(*ip))) {
                    Ok(()) => {
                        self.markers.remove(ip);
                    }
                    Err(e) => report.errors.push(name_object(e, &format!("ClusterIP {ip}"))),
                }
            }
        }

        if let Err(e) = self.collect_garbage(&mut w) {
            report.errors.push(e);
        }

        if !dropped.is_empty() || !removed_ids.is_empty() {
            let stale = |k: &svc_common::AffinityKey, v: &svc_common::AffinityValue| {
                removed_ids.contains(&k.id)
                    || dropped.get(&k.id).is_some_and(|s| s.contains(&v.backend))
            };
            match w.store.purge_affinity(&stale) {
                Ok(n) => report.affinity_purged = n,
                Err(e) => report.errors.push(e),
            }
        }
        report.ops = w.ops;
        report
    }

    /// Returns whether anything was written.
    fn upsert<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        fe: &Frontend,
        d: &DesiredFrontend,
        dropped: &mut HashMap<u32, HashSet<BackendId>>,
    ) -> Result<bool> {
        if d.backends.len() > MAX_BACKENDS_PER_FRONTEND {
            return Err(Error::Invalid {
                object: d.service.clone(),
                message: format!(
                    "{} backends for {fe}; a frontend holds at most {MAX_BACKENDS_PER_FRONTEND}",
                    d.backends.len()
                ),
            });
        }
        let mut ids = Vec::with_capacity(d.backends.len());
        for sa in &d.backends {
            ids.push(self.ensure_backend(w, *sa, fe.protocol)?);
        }
        let (flags, timeout) = flags_of(d);
        let key = service_key(fe);

        let Some(cur) = self.frontends.get(fe).cloned() else {
            let id = self.next_frontend_id;
            let rev = 1;
            w.op(Op::PutRevNat(
                id,
                RevNatValue {
                    addr: key.addr,
                    port_be: key.port_be,
                    _pad0: 0,
                },
            ))?;
            w.op(Op::PutName(id, encode_name(&d.service)))?;
            // The id is spent even if what follows fails; garbage collection removes its
            // leftovers, and reusing it is never needed.
            self.next_frontend_id += 1;
            if let Err(e) = write_slots(w, id, rev, &ids) {
                let _ = w.op(Op::DelRevNat(id));
                let _ = w.op(Op::DelName(id));
                return Err(e);
            }
            let value = ServiceValue {
                id,
                count: ids.len() as u16,
                rev,
                flags,
                _pad0: 0,
                affinity_timeout_s: timeout,
            };
            if let Err(e) = w.op(Op::PutService(key, value)) {
                delete_slots(w, id, rev, ids.len());
                let _ = w.op(Op::DelRevNat(id));
                let _ = w.op(Op::DelName(id));
                return Err(e);
            }
            debug!(frontend = %fe, id, backends = ids.len(), "frontend added");
            self.add_refs(&ids);
            self.frontends.insert(
                *fe,
                ProgFrontend {
                    id,
                    rev,
                    flags,
                    affinity_timeout_s: timeout,
                    backends: ids,
                    name: d.service.clone(),
                },
            );
            return Ok(true);
        };

        let same_set = cur.backends == ids;
        if same_set
            && cur.flags == flags
            && cur.affinity_timeout_s == timeout
            && cur.name == d.service
        {
            return Ok(false);
        }
        if cur.name != d.service {
            w.op(Op::PutName(cur.id, encode_name(&d.service)))?;
        }
        let rev = if same_set {
            cur.rev
        } else {
            let rev = cur.rev.wrapping_add(1);
            write_slots(w, cur.id, rev, &ids).inspect_err(|_| {
                delete_slots(w, cur.id, rev, ids.len());
            })?;
            rev
        };
        let value = ServiceValue {
            id: cur.id,
            count: ids.len() as u16,
            rev,
            flags,
            _pad0: 0,
            affinity_timeout_s: timeout,
        };
        if let Err(e) = w.op(Op::PutService(key, value)) {
            if !same_set {
                delete_slots(w, cur.id, rev, ids.len());
            }
            return Err(e);
        }
        if !same_set {
            // Nothing leads to the old generation any more.
            delete_slots(w, cur.id, cur.rev, cur.backends.len());
            let now: HashSet<BackendId> = ids.iter().copied().collect();
            let gone: HashSet<BackendId> = cur
                .backends
                .iter()
                .filter(|b| !now.contains(b))
                .copied()
                .collect();
            if !gone.is_empty() {
                dropped.entry(cur.id).or_default().extend(gone);
            }
        }
        if cur.flags != flags || cur.affinity_timeout_s != timeout {
            // Affinity switched or retimed: old choices must not outlive the old setting.
            dropped
                .entry(cur.id)
                .or_default()
                .extend(cur.backends.iter().copied());
        }
        debug!(frontend = %fe, id = cur.id, rev, backends = ids.len(), "frontend updated");
        self.add_refs(&ids);
        self.drop_refs(&cur.backends);
        self.frontends.insert(
            *fe,
            ProgFrontend {
                id: cur.id,
                rev,
                flags,
                affinity_timeout_s: timeout,
                backends: ids,
                name: d.service.clone(),
            },
        );
        Ok(true)
    }

    fn ensure_backend<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        sa: SocketAddr,
        protocol: Protocol,
    ) -> Result<BackendId> {
        if let Some(id) = self.backend_ids.get(&(sa, protocol)) {
            return Ok(*id);
        }
        let id = self.next_backend_id;
        w.op(Op::PutBackend(
            id,
            Backend {
                addr: addr16(sa.ip()),
                port_be: sa.port().to_be(),
                proto: protocol.ipproto(),
                flags: 0,
            },
        ))?;
        self.next_backend_id += 1;
        // Unreferenced until a master entry names it; removed at the end of the sync if the
        // write that would have used it fails.
        self.unreferenced.insert(id);
        self.backend_ids.insert((sa, protocol), id);
        self.backends.insert(id, (sa, protocol));
        Ok(id)
    }

    fn remove<S: Store>(&mut self, w: &mut Writer<'_, S>, fe: &Frontend) -> Result<u32> {
        let Some(cur) = self.frontends.get(fe).cloned() else {
            return Ok(0);
        };
        // Master first: from then on nothing reaches the slots.
        w.op(Op::DelService(service_key(fe)))?;
        self.frontends.remove(fe);
        self.drop_refs(&cur.backends);
        delete_slots(w, cur.id, cur.rev, cur.backends.len());
        let _ = w.op(Op::DelRevNat(cur.id));
        let _ = w.op(Op::DelName(cur.id));
        debug!(frontend = %fe, id = cur.id, "frontend removed");
        Ok(cur.id)
    }

    /// Deletes what no master entry leads to any more: unreferenced backends, and entries a
    /// dead agent left behind.
    fn collect_garbage<S: Store>(&mut self, w: &mut Writer<'_, S>) -> Result<()> {
        for k in std::mem::take(&mut self.stray_slots) {
            w.op(Op::DelSlot(k))?;
        }
        for id in std::mem::take(&mut self.stray_ids) {
            w.op(Op::DelRevNat(id))?;
            w.op(Op::DelName(id))?;
        }
        for id in std::mem::take(&mut self.unreferenced) {
            if self.backend_refs.contains_key(&id) {
                continue;
            }
            if let Err(e) = w.op(Op::DelBackend(id)) {
                self.unreferenced.insert(id);
                return Err(e);
            }
            if let Some(k) = self.backends.remove(&id) {
                self.backend_ids.remove(&k);
            }
        }
        Ok(())
    }
}

fn write_slots<S: Store>(
    w: &mut Writer<'_, S>,
    id: u32,
    rev: u16,
    backends: &[BackendId],
) -> Result<()> {
    for (i, b) in backends.iter().enumerate() {
        let slot = SlotKey {
            id,
            rev,
            slot: i as u16 + 1,
        };
        w.op(Op::PutSlot(slot, *b))?;
    }
    Ok(())
}

fn delete_slots<S: Store>(w: &mut Writer<'_, S>, id: u32, rev: u16, count: usize) {
    for i in 0..count {
        let slot = SlotKey {
            id,
            rev,
            slot: i as u16 + 1,
        };
        if let Err(e) = w.op(Op::DelSlot(slot)) {
            warn!(id, rev, "deleting slot {}: {e}", i + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use svc_common::{AffinityKey, AffinityValue};

    /// The maps in memory, checked after every single write the way a reader would walk them.
    #[derive(Default)]
    struct ModelStore {
        services: HashMap<ServiceKey, ServiceValue>,
        slots: HashMap<SlotKey, BackendId>,
        backends: HashMap<BackendId, Backend>,
        rev_nat: HashMap<u32, RevNatValue>,
        names: HashMap<u32, ServiceName>,
        /// Fail the n-th put (0-based), to exercise partial writes.
        fail_put_at: Option<usize>,
        puts: usize,
        log: Vec<Op>,
    }

    impl ModelStore {
        /// Every master entry leads to complete slots and existing backends.
        fn check_reader_view(&self) {
            for (k, v) in &self.services {
                if v.flags & svc_flags::ADDR_MARKER != 0 {
                    continue;
                }
                for slot in 1..=v.count {
                    let sk = SlotKey {
                        id: v.id,
                        rev: v.rev,
                        slot,
                    };
                    let b = self
                        .slots
                        .get(&sk)
                        .unwrap_or_else(|| panic!("{k:?} leads to missing slot {sk:?}"));
                    assert!(
                        self.backends.contains_key(b),
                        "slot {sk:?} -> missing backend"
                    );
                }
            }
        }

        fn snapshot(&self) -> Snapshot {
            Snapshot {
                services: self.services.iter().map(|(k, v)| (*k, *v)).collect(),
                slots: self.slots.iter().map(|(k, v)| (*k, *v)).collect(),
                backends: self.backends.iter().map(|(k, v)| (*k, *v)).collect(),
                rev_nat: self.rev_nat.iter().map(|(k, v)| (*k, *v)).collect(),
                names: self.names.iter().map(|(k, v)| (*k, *v)).collect(),
            }
        }

        /// What a client would get for a frontend: its backends, in slot order.
        fn resolve(&self, fe: &Frontend) -> Option<Vec<SocketAddr>> {
            let v = self.services.get(&service_key(fe))?;
            Some(
                (1..=v.count)
                    .map(|slot| {
                        let b = self.slots[&SlotKey {
                            id: v.id,
                            rev: v.rev,
                            slot,
                        }];
                        let b = self.backends[&b];
                        SocketAddr::new(ip_from16(b.addr), u16::from_be(b.port_be))
                    })
                    .collect(),
            )
        }
    }

    impl Store for ModelStore {
        fn apply(&mut self, op: &Op) -> Result<()> {
            let is_put = matches!(
                op,
                Op::PutService(..)
                    | Op::PutSlot(..)
                    | Op::PutBackend(..)
                    | Op::PutRevNat(..)
                    | Op::PutName(..)
            );
            if is_put {
                let n = self.puts;
                self.puts += 1;
                if self.fail_put_at == Some(n) {
                    return Err(Error::MapFull {
                        map: "test",
                        capacity: 0,
                        object: String::new(),
                    });
                }
            }
            self.log.push(op.clone());
            match op.clone() {
                Op::PutService(k, v) => {
                    self.services.insert(k, v);
                }
                Op::DelService(k) => {
                    self.services.remove(&k);
                }
                Op::PutSlot(k, v) => {
                    self.slots.insert(k, v);
                }
                Op::DelSlot(k) => {
                    self.slots.remove(&k);
                }
                Op::PutBackend(k, v) => {
                    self.backends.insert(k, v);
                }
                Op::DelBackend(k) => {
                    self.backends.remove(&k);
                }
                Op::PutRevNat(k, v) => {
                    self.rev_nat.insert(k, v);
                }
                Op::DelRevNat(k) => {
                    self.rev_nat.remove(&k);
                }
                Op::PutName(k, v) => {
                    self.names.insert(k, v);
                }
                Op::DelName(k) => {
                    self.names.remove(&k);
                }
            }
            self.check_reader_view();
            Ok(())
        }

        fn purge_affinity(
            &mut self,
            _: &dyn Fn(&AffinityKey, &AffinityValue) -> bool,
        ) -> Result<usize> {
            Ok(0)
        }
    }

    fn fe(ip: &str, port: u16) -> Frontend {
        Frontend {
            ip: ip.parse().unwrap(),
            port,
            protocol: Protocol::Tcp,
        }
    }

    fn state(entries: &[(Frontend, &[&str])]) -> DesiredState {
        let mut s = DesiredState::default();
        for (f, backends) in entries {
            let mut b: Vec<SocketAddr> = backends.iter().map(|b| b.parse().unwrap()).collect();
            b.sort();
            s.frontends.insert(
                *f,
                DesiredFrontend {
                    frontend: *f,
                    owner: format!("default/svc-{}", f.port),
                    service: format!("default/svc-{}", f.port),
                    backends: b,
                    affinity_timeout_s: None,
                    internal_local: false,
                },
            );
            s.cluster_ips.insert(f.ip);
        }
        s
    }

    #[test]
    fn adds_changes_and_removes_keeping_readers_safe() {
        let mut store = ModelStore::default();
        let mut p = Programmed::recover(&Snapshot::default());
        let a = fe("10.96.0.10", 80);
        let b = fe("fd00::10", 53);

        let r = p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"]), (b, &[])]),
        );
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(
            store.resolve(&a).unwrap(),
            vec![
                "10.0.0.1:8080".parse().unwrap(),
                "10.0.0.2:8080".parse().unwrap()
            ]
        );
        assert_eq!(store.resolve(&b).unwrap(), vec![]);
        assert!(store.services.contains_key(&marker_key(a.ip)));

        // Same desired state again: nothing is written.
        let r = p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"]), (b, &[])]),
        );
        assert_eq!(r.ops, 0);

        // Replace one backend: new generation, old slots and the unused backend deleted.
        let r = p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.1:8080", "10.0.0.3:8080"]), (b, &[])]),
        );
        assert!(r.errors.is_empty());
        assert_eq!(
            store.resolve(&a).unwrap(),
            vec![
                "10.0.0.1:8080".parse().unwrap(),
                "10.0.0.3:8080".parse().unwrap()
            ]
        );
        assert_eq!(store.slots.len(), 2);
        assert_eq!(store.backends.len(), 2);

        // Remove everything: maps end empty.
        let r = p.apply(&mut store, &DesiredState::default());
        assert!(r.errors.is_empty());
        assert!(store.services.is_empty() && store.slots.is_empty() && store.backends.is_empty());
        assert!(store.rev_nat.is_empty() && store.names.is_empty());
    }

    #[test]
    fn master_entry_is_the_last_write_of_a_change() {
        let mut store = ModelStore::default();
        let mut p = Programmed::recover(&Snapshot::default());
        let a = fe("10.96.0.10", 80);
        p.apply(&mut store, &state(&[(a, &["10.0.0.1:8080"])]));
        store.log.clear();
        p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.2:8080", "10.0.0.3:8080"])]),
        );
        let master = store
            .log
            .iter()
            .position(|o| matches!(o, Op::PutService(k, _) if *k == service_key(&a)))
            .expect("master written");
        // Everything before the switch is a put of backends or new slots; everything after
        // is cleanup of what is no longer reachable.
        assert!(store.log[..master]
            .iter()
            .all(|o| matches!(o, Op::PutBackend(..) | Op::PutSlot(..))));
        assert!(store.log[master + 1..]
            .iter()
            .all(|o| matches!(o, Op::DelSlot(..) | Op::DelBackend(..))));
    }

    #[test]
    fn a_failed_write_keeps_the_old_state_and_other_services() {
        let a = fe("10.96.0.10", 80);
        let c = fe("10.96.0.11", 80);
        let mut store = ModelStore::default();
        let mut p = Programmed::recover(&Snapshot::default());
        p.apply(&mut store, &state(&[(a, &["10.0.0.1:8080"])]));
        // The next sync's first put fails (the new backend of `a`).
        store.fail_put_at = Some(store.puts);
        let r = p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.9:8080"]), (c, &["10.0.0.5:8080"])]),
        );
        assert_eq!(r.errors.len(), 1);
        assert!(
            r.errors[0].to_string().contains("default/svc-80"),
            "{}",
            r.errors[0]
        );
        assert_eq!(
            store.resolve(&a).unwrap(),
            vec!["10.0.0.1:8080".parse().unwrap()]
        );
        assert_eq!(
            store.resolve(&c).unwrap(),
            vec!["10.0.0.5:8080".parse().unwrap()]
        );
        // A later sync converges.
        let r = p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.9:8080"]), (c, &["10.0.0.5:8080"])]),
        );
        assert!(r.errors.is_empty());
        assert_eq!(
            store.resolve(&a).unwrap(),
            vec!["10.0.0.9:8080".parse().unwrap()]
        );
    }

    #[test]
    fn recovery_adopts_pinned_state_and_cleans_leftovers() {
        let a = fe("10.96.0.10", 80);
        let mut store = ModelStore::default();
        let mut p = Programmed::recover(&Snapshot::default());
        let desired = state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"])]);
        p.apply(&mut store, &desired);
        // A dead agent left a half-written generation behind.
        store.slots.insert(
            SlotKey {
                id: 1,
                rev: 7,
                slot: 1,
            },
            1,
        );

        let mut p2 = Programmed::recover(&store.snapshot());
        store.log.clear();
        let r = p2.apply(&mut store, &desired);
        assert!(r.errors.is_empty());
        // Only the leftover is touched; the live service is not rewritten.
        assert_eq!(
            store.log,
            vec![Op::DelSlot(SlotKey {
                id: 1,
                rev: 7,
                slot: 1
            })]
        );
        // New ids do not collide with adopted ones.
        let b = fe("10.96.0.12", 80);
        let mut d = desired.clone();
        d.frontends
            .extend(state(&[(b, &["10.0.0.3:8080"])]).frontends);
        p2.apply(&mut store, &d);
        let ids: HashSet<u32> = store
            .services
            .values()
            .filter(|v| v.id != 0)
            .map(|v| v.id)
            .collect();
        assert_eq!(ids.len(), 2);
    }

    #[test]
    fn scoped_sync_touches_only_its_frontends() {
        let a = fe("10.96.0.10", 80);
        let b = fe("10.96.0.11", 80);
        let c = fe("10.96.0.12", 80);
        let mut store = ModelStore::default();
        let mut p = Programmed::recover(&Snapshot::default());
        p.apply(
            &mut store,
            &state(&[(a, &["10.0.0.1:8080"]), (b, &["10.0.0.1:8080"])]),
        );
        // Desired changes for a and b, a removal of b and an addition of c; only b and c are in
        // scope, so a keeps what it had.
        let desired = state(&[(a, &["10.0.0.7:8080"]), (c, &["10.0.0.2:8080"])]);
        let scope: BTreeSet<Frontend> = [b, c].into_iter().collect();
        let r = p.apply_scoped(&mut store, &desired, Scope::Only(&scope));
        assert!(r.errors.is_empty());
        assert_eq!(store.resolve(&a).unwrap(), vec!["10.0.0.1:8080".parse().unwrap()]);
        assert_eq!(store.resolve(&b), None);
        assert!(!store.services.contains_key(&marker_key(b.ip)));
        assert_eq!(store.resolve(&c).unwrap(), vec!["10.0.0.2:8080".parse().unwrap()]);
        // 10.0.0.1 is still used by a, so it stays.
        assert_eq!(store.backends.len(), 2);
    }

    #[test]
    fn names_round_trip_and_truncate_on_char_boundary() {
        assert_eq!(decode_name(&encode_name("ns/web:http")), "ns/web:http");
        let long = "é".repeat(200);
        let d = decode_name(&encode_name(&long));
        assert!(d.len() <= 159 && long.starts_with(&d));
    }
}
