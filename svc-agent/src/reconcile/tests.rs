use super::*;
use crate::model::{
    Backend as DesiredBackend, Cidr, DesiredState, Kind, NodeDesired, Scope as FeScope,
};
use crate::store::{FlowWalk, Snapshot};
use std::collections::HashMap as StdHashMap;
use std::collections::HashSet as StdHashSet;
use std::time::Instant;
use svc_common::{
    checks_match, node_addr_flags, AffinityMatchKey, Backend, DatapathConfig, MaglevBlock,
    MaglevIndex, MetaValue, NodeAddrValue, RevNatValue, ServiceName, SlotGroup, SrcRangeKey,
};

/// A `SLOTS` entry whose first slots name `backends`.
fn group(backends: &[BackendId]) -> SlotGroup {
    let mut g = SlotGroup::default();
    g.backends[..backends.len()].copy_from_slice(backends);
    g
}

/// The maps in memory, checked after every single write the way readers walk them: readers
/// that read a master entry at any time since the last retirement pass (the grace period)
/// must still find every slot and backend it names, and every backend a current master entry
/// names has its membership entry (else a remembered choice of it would be dropped).
#[derive(Default, Clone)]
struct ModelStore {
    services: StdHashMap<ServiceKey, ServiceValue>,
    slots: StdHashMap<SlotKey, SlotGroup>,
    backends: StdHashMap<BackendId, Backend>,
    rev_nat: StdHashMap<u32, RevNatValue>,
    names: StdHashMap<u32, ServiceName>,
    matches: StdHashSet<AffinityMatchKey>,
    ranges: std::collections::BTreeSet<SrcRangeKey>,
    node_addrs: StdHashMap<[u8; 16], NodeAddrValue>,
    config: DatapathConfig,
    meta: MetaValue,
    /// max_entries of the services map (others unbounded), as E2BIG enforces it.
    services_cap: Option<usize>,
    /// Fail the n-th put (0-based), to exercise partial writes.
    fail_put_at: Option<usize>,
    /// Fail every put to NODE_ADDRS (an address the map keeps refusing).
    fail_node_addr_puts: bool,
    /// Fail every write of the datapath config.
    fail_config_puts: bool,
    /// After this many ops the "process" is dead: nothing more reaches the maps.
    crash_after: Option<usize>,
    /// Fail every put of a backend at this address (a write the map keeps refusing).
    refuse_backend: Option<[u8; 16]>,
    /// `apply_batches` writes both, `then` before `first`, even when `first` fails: as a
    /// store that writes them at once may leave them (`BpfStore`).
    at_once: bool,
    /// Calls of `apply_batch`.
    batches: usize,
    puts: usize,
    ops: usize,
    log: Vec<Op>,
    /// Master values readers may still hold (every one written since `forget_readers`).
    held: Vec<(ServiceKey, ServiceValue)>,
    /// The maps were damaged on purpose: readers are not checked.
    unchecked: bool,
    /// Clients that must be admitted by a frontend whose master entry has SOURCE_RANGES, at
    /// every moment (a change of ranges may widen for a moment, never narrow what both the
    /// old and the new set admit).
    must_admit: Vec<(ServiceKey, Cidr)>,
    /// Addresses live packet-datapath flows are addressed to (what a walk of the
    /// connection-tracking map finds): NODE_ADDRS must keep them.
    flows_to: std::collections::BTreeSet<[u8; 16]>,
    /// Whether a live flow goes to a port in the SNAT range (the walk's other answer).
    snat_range_flows: bool,
    /// SVC_MAGLEV (blocks written), of `maglev_cap` blocks (0: the default capacity's).
    maglev: StdHashMap<u32, MaglevBlock>,
    maglev_cap: u32,
    /// BACKENDS' max_entries (0: the default capacity's), and the id at each index written:
    /// an array, where a put at a taken index would overwrite another backend.
    backend_entries: u32,
    backend_at: StdHashMap<u32, BackendId>,
    maglev_index: StdHashMap<SlotKey, MaglevIndex>,
    /// The table each index entry named when it was written: what readers that find the
    /// entry read, which must not change under them.
    index_tables: StdHashMap<SlotKey, Vec<MaglevBlock>>,
    /// Index values replaced or deleted since `forget_readers`, with their tables: a reader
    /// may still be reading them.
    held_tables: Vec<(MaglevIndex, Vec<MaglevBlock>)>,
}

impl ModelStore {
    fn check_reader_view(&self) {
        if self.unchecked {
            return;
        }
        self.check_tables();
        for (k, c) in &self.must_admit {
            let Some(v) = self.services.get(k) else {
                continue;
            };
            if v.flags & svc_flags::SOURCE_RANGES != 0 {
                assert!(
                    self.ranges.contains(&range_key(v.id, c)),
                    "{k:?} -> {v:?} does not admit {c}"
                );
            }
        }
        // The external ingress looks only at packets to NODE_ADDRS: an external frontend's
        // address is there before the frontend is, and one flows go to stays.
        for k in self.services.keys() {
            if k.scope == svc_common::scope::EXTERNAL && !is_wildcard(&k.addr) {
                assert!(
                    self.node_addrs.contains_key(&k.addr),
                    "{k:?} is written before its address is in NODE_ADDRS"
                );
            }
        }
        for a in &self.flows_to {
            assert!(
                self.node_addrs.contains_key(a),
                "{} has flows but left NODE_ADDRS",
                ip_from16(*a)
            );
        }
        let current = self.services.iter().map(|(k, v)| (*k, *v));
        for (k, v) in current.chain(self.held.iter().copied()) {
            if v.flags & svc_flags::ADDR_MARKER != 0 {
                continue;
            }
            for slot in 1..=v.count {
                let b = self
                    .slot(v.id, v.rev, slot)
                    .unwrap_or_else(|| panic!("{k:?} -> {v:?} leads to missing slot {slot}"));
                assert!(
                    self.backends.contains_key(&b),
                    "slot {slot} of {k:?} -> missing backend {b}"
                );
            }
        }
        for (k, v) in &self.services {
            if v.flags & svc_flags::ADDR_MARKER != 0 || !checks_match(k.proto, v.flags) {
                continue;
            }
            for slot in 1..=v.count {
                let b = self.slot(v.id, v.rev, slot).expect("slot");
                let m = AffinityMatchKey {
                    id: v.id,
                    backend: b,
                };
                assert!(
                    self.matches.contains(&m),
                    "{k:?} -> {v:?} names backend {b} without its membership entry"
                );
            }
        }
    }

    /// The grace period has passed: no reader holds an old master entry any more.
    fn forget_readers(&mut self) {
        self.held.clear();
        self.held_tables.clear();
    }

    /// The blocks index value `v` names, as the array holds them now.
    fn table_at(&self, v: &MaglevIndex) -> Vec<MaglevBlock> {
        let start = v.offset / svc_common::MAGLEV_BLOCK;
        (start..start + crate::maglev::blocks(v.size))
            .map(|i| self.maglev.get(&i).copied().unwrap_or_default())
            .collect()
    }

    /// A reader that reads a master entry with the Maglev flag finds its generation's index
    /// entry, and every table an index entry names (now, or since the grace period began)
    /// is as it was when the entry was written.
    fn check_tables(&self) {
        let current = self.services.iter().map(|(k, v)| (*k, *v));
        for (k, v) in current.chain(self.held.iter().copied()) {
            if v.flags & svc_flags::MAGLEV != 0 {
                let key = maglev_key(v.id, v.rev);
                assert!(
                    self.maglev_index.contains_key(&key),
                    "{k:?} -> {v:?} leads to a missing Maglev index entry"
                );
            }
        }
        for (k, v) in &self.maglev_index {
            assert!(
                self.table_at(v) == self.index_tables[k],
                "the table of index entry {k:?} changed under its readers"
            );
        }
        for (v, t) in &self.held_tables {
            assert!(
                self.table_at(v) == *t,
                "the table of a replaced index value {v:?} changed within the grace period"
            );
        }
    }

    /// The backend of 1-based slot `slot` of generation `rev` of frontend `id`, as a reader
    /// finds it.
    fn slot(&self, id: u32, rev: u16, slot: u16) -> Option<BackendId> {
        let (k, i) = SlotKey::of_slot(id, rev, u32::from(slot) - 1);
        self.slots
            .get(&k)
            .map(|g| g.backends[i])
            .filter(|b| *b != 0)
    }

    /// What a client would get for a frontend: its backends, in slot order.
    fn resolve(&self, fe: &Frontend) -> Option<Vec<SocketAddr>> {
        let v = self.services.get(&service_key(fe))?;
        Some(
            (1..=v.count)
                .map(|slot| {
                    let b = self.slot(v.id, v.rev, slot).expect("slot");
                    let b = self.backends[&b];
                    SocketAddr::new(ip_from16(b.addr), u16::from_be(b.port_be))
                })
                .collect(),
        )
    }
}

impl Store for ModelStore {
    fn apply(&mut self, op: &Op) -> Result<bool> {
        if self.crash_after.is_some_and(|n| self.ops >= n) {
            return Err(Error::Other("crashed".into()));
        }
        let is_put = matches!(
            op,
            Op::PutService(..)
                | Op::PutSlot(..)
                | Op::PutBackend(..)
                | Op::PutRevNat(..)
                | Op::PutName(..)
                | Op::PutMatch(..)
                | Op::PutRange(..)
                | Op::PutNodeAddr(..)
                | Op::PutMaglev(..)
                | Op::PutMaglevIndex(..)
        );
        if is_put {
            let n = self.puts;
            self.puts += 1;
            if self.fail_put_at == Some(n)
                || self.fail_node_addr_puts && matches!(op, Op::PutNodeAddr(..))
            {
                return Err(Error::map("test", "injected".into()));
            }
        }
        if matches!(op, Op::PutBackend(_, b) if Some(b.addr) == self.refuse_backend) {
            return Err(Error::map("test", "injected".into()));
        }
        if self.fail_config_puts && matches!(op, Op::PutConfig(_)) {
            return Err(Error::map("test", "injected".into()));
        }
        if let Op::PutMaglev(start, blocks) = op {
            let cap = match self.maglev_cap {
                0 => Capacity::default().maglev_blocks(),
                n => n,
            };
            if start + blocks.len() as u32 > cap {
                return Err(Error::map("test", "beyond the array".into()));
            }
        }
        if let (Op::PutService(k, _), Some(cap)) = (op, self.services_cap) {
            if !self.services.contains_key(k) && self.services.len() >= cap {
                return Err(Error::MapFull {
                    map: svc_common::map_names::SERVICES,
                    capacity: cap as u32,
                    object: String::new(),
                });
            }
        }
        self.ops += 1;
        self.log.push(op.clone());
        let found = match op.clone() {
            Op::PutService(k, v) => {
                if let Some(old) = self.services.insert(k, v) {
                    self.held.push((k, old));
                }
                true
            }
            Op::DelService(k) => {
                let old = self.services.remove(&k);
                if let Some(old) = old {
                    self.held.push((k, old));
                }
                old.is_some()
            }
            Op::PutSlot(k, v) => {
                self.slots.insert(k, v);
                true
            }
            Op::DelSlot(k) => self.slots.remove(&k).is_some(),
            Op::PutBackend(k, v) => {
                let n = match self.backend_entries {
                    0 => Capacity::default().backends,
                    n => n,
                };
                let i = svc_common::backend_index(k, n);
                if let Some(other) = self.backend_at.insert(i, k) {
                    assert!(
                        other == k || !self.backends.contains_key(&other),
                        "backend {k} written over backend {other} at index {i}"
                    );
                }
                assert_eq!(v.id, k, "a backend's entry holds its id");
                self.backends.insert(k, v);
                true
            }
            Op::DelBackend(k) => self.backends.remove(&k).is_some(),
            Op::PutRevNat(k, v) => {
                self.rev_nat.insert(k, v);
                true
            }
            Op::DelRevNat(k) => self.rev_nat.remove(&k).is_some(),
            Op::PutName(k, v) => {
                self.names.insert(k, v);
                true
            }
            Op::DelName(k) => self.names.remove(&k).is_some(),
            Op::PutMatch(k) => {
                self.matches.insert(k);
                true
            }
            Op::DelMatch(k) => self.matches.remove(&k),
            Op::PutMeta(v) => {
                self.meta = v;
                true
            }
            Op::PutRange(k) => {
                self.ranges.insert(k);
                true
            }
            Op::DelRange(k) => self.ranges.remove(&k),
            Op::PutNodeAddr(k, v) => {
                self.node_addrs.insert(k, v);
                true
            }
            Op::DelNodeAddr(k) => self.node_addrs.remove(&k).is_some(),
            Op::PutConfig(v) => {
                self.config = v;
                true
            }
            Op::PutMaglev(start, blocks) => {
                for (i, b) in blocks.iter().enumerate() {
                    self.maglev.insert(start + i as u32, *b);
                }
                true
            }
            Op::DelMaglevPage(page) => {
                let per = svc_common::MAGLEV_PAGE;
                let before = self.maglev.len();
                self.maglev.retain(|b, _| *b / per != page);
                self.maglev.len() < before
            }
            Op::PutMaglevIndex(k, v) => {
                let table = self.table_at(&v);
                if let Some(old) = self.maglev_index.insert(k, v) {
                    self.held_tables.push((old, self.index_tables[&k].clone()));
                }
                self.index_tables.insert(k, table);
                true
            }
            Op::DelMaglevIndex(k) => match self.maglev_index.remove(&k) {
                Some(old) => {
                    let t = self.index_tables.remove(&k).unwrap_or_default();
                    // A reader reaches an index entry only through a master entry of its
                    // generation with the Maglev flag: held while one is current, or may
                    // still be read.
                    let reachable = (self.services.values())
                        .chain(self.held.iter().map(|(_, v)| v))
                        .any(|v| v.flags & svc_flags::MAGLEV != 0 && maglev_key(v.id, v.rev) == k);
                    if reachable {
                        self.held_tables.push((old, t));
                    }
                    true
                }
                None => false,
            },
        };
        self.check_reader_view();
        Ok(found)
    }

    /// One op at a time, as the trait's own, counted: readers are checked after each.
    fn apply_batch(&mut self, ops: &[Op]) -> (usize, Result<()>) {
        self.batches += 1;
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = self.apply(op) {
                return (i, Err(e));
            }
        }
        (ops.len(), Ok(()))
    }

    fn apply_batches(&mut self, first: &[Op], then: &[Op]) -> [(usize, Result<()>); 2] {
        if !self.at_once {
            return crate::store::one_after_the_other(self, first, then);
        }
        let b = self.apply_batch(then);
        [self.apply_batch(first), b]
    }

    fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            services: self.services.iter().map(|(k, v)| (*k, *v)).collect(),
            slots: self.slots.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: self.backends.iter().map(|(k, v)| (*k, *v)).collect(),
            rev_nat: self.rev_nat.iter().map(|(k, v)| (*k, *v)).collect(),
            names: self.names.iter().map(|(k, v)| (*k, *v)).collect(),
            matches: self.matches.iter().copied().collect(),
            affinity_ids: vec![],
            meta: self.meta,
            ranges: self.ranges.iter().copied().collect(),
            node_addrs: self.node_addrs.iter().map(|(k, v)| (*k, *v)).collect(),
            config: self.config,
            maglev_index: self.maglev_index.iter().map(|(k, v)| (*k, *v)).collect(),
            // Cheap here: every check compares the tables too.
            maglev_tables: Some(
                self.maglev_index
                    .values()
                    .map(|v| (v.offset / svc_common::MAGLEV_BLOCK, self.table_at(v)))
                    .collect(),
            ),
            maglev_pages: (self.maglev.keys())
                .map(|b| b / svc_common::MAGLEV_PAGE)
                .collect::<std::collections::BTreeSet<u32>>()
                .into_iter()
                .collect(),
        })
    }

    fn read_maglev(&self, start: u32, len: u32) -> Result<Vec<MaglevBlock>> {
        Ok((start..start + len)
            .map(|i| self.maglev.get(&i).copied().unwrap_or_default())
            .collect())
    }

    fn flow_destinations(&self, _config: &DatapathConfig) -> Result<Option<FlowWalk>> {
        Ok(Some(FlowWalk {
            destinations: self.flows_to.clone(),
            snat_range_ports: self.snat_range_flows,
            ..Default::default()
        }))
    }
}

/// The NodePort key's address (either family's unspecified address).
fn is_wildcard(a: &[u8; 16]) -> bool {
    ip_from16(*a).is_unspecified()
}

fn fe(ip: &str, port: u16) -> Frontend {
    Frontend::cluster(ip.parse().unwrap(), port, Protocol::Tcp)
}

/// Each test frontend is a Service of its own.
fn owner_for(f: &Frontend) -> String {
    format!(
        "default/svc-{}-{}",
        f.ip.to_string().replace([':', '.'], "-"),
        f.port
    )
}

fn state(entries: &[(Frontend, &[&str])]) -> DesiredState {
    let mut s = DesiredState::default();
    for (f, backends) in entries {
        let mut b: Vec<crate::model::Backend> =
            backends.iter().map(|b| b.parse().unwrap()).collect();
        b.sort();
        s.frontends.insert(
            *f,
            DesiredFrontend {
                frontend: *f,
                service: owner_for(f),
                backends: b,
                affinity_timeout_s: None,
                internal_local: false,
                kind: crate::model::Kind::ClusterIP,
                external_local: false,
                source_ranges: None,
                created: None,
                serving: None,
                lb_algorithm: None,
            },
        );
        s.cluster_ips.insert(f.ip);
    }
    s
}

fn fresh() -> Programmed {
    Programmed::empty(Capacity::default(), Duration::from_secs(1))
}

/// Applies `desired` fully, then lets the grace period pass.
fn settle(p: &mut Programmed, store: &mut ModelStore, desired: &DesiredState) -> SyncReport {
    let now = Instant::now();
    let r = p.apply_scoped(store, desired, Scope::All, now);
    store.forget_readers();
    p.retire_due(store, now + Duration::from_secs(3600));
    r
}

/// The agent after a restart: recovered from what `store` holds, taking over `p`'s
/// retiring backends.
fn restarted(p: &mut Programmed, store: &ModelStore) -> Programmed {
    Programmed::recover(
        &store.snapshot().unwrap(),
        Capacity::default(),
        Duration::from_secs(1),
        std::mem::take(&mut p.retiring),
    )
}

/// The capacities of `store`'s maps: the default but for `backend_entries`.
fn capacity_of(store: &ModelStore) -> Capacity {
    match store.backend_entries {
        0 => Capacity::default(),
        n => Capacity {
            backends: n,
            ..Capacity::default()
        },
    }
}

/// A new agent's mirror of what `store` holds (nothing of its own retiring).
fn recovered(store: &ModelStore) -> Programmed {
    Programmed::recover(
        &store.snapshot().unwrap(),
        capacity_of(store),
        Duration::from_secs(1),
        Retiring::default(),
    )
}

fn exact(store: &ModelStore, desired: &DesiredState) {
    let problems = crate::verify::check(&store.snapshot().unwrap(), desired);
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn adds_changes_and_removes_keeping_readers_safe() {
    let mut store = ModelStore::default();
    let mut p = fresh();
    let a = fe("10.96.0.10", 80);
    let b = fe("fd00::10", 53);

    let s1 = state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"]), (b, &[])]);
    let r = settle(&mut p, &mut store, &s1);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &s1);
    assert!(store.services.contains_key(&marker_key(a.ip)));

    // Same desired state again: nothing is written.
    let r = settle(&mut p, &mut store, &s1);
    assert_eq!(r.ops, 0);

    // Replace one backend: a new generation; the old one and the unused backend are retired.
    let s2 = state(&[(a, &["10.0.0.1:8080", "10.0.0.3:8080"]), (b, &[])]);
    let r = settle(&mut p, &mut store, &s2);
    assert!(r.errors.is_empty());
    exact(&store, &s2);
    // Two slots: one entry.
    assert_eq!(p.usage.slots, 1);
    assert_eq!(p.usage.backends, 2);

    // Remove everything: maps end empty.
    let r = settle(&mut p, &mut store, &DesiredState::default());
    assert!(r.errors.is_empty());
    assert!(store.services.is_empty() && store.slots.is_empty() && store.backends.is_empty());
    assert!(store.rev_nat.is_empty() && store.names.is_empty() && store.matches.is_empty());
    assert_eq!(p.usage, Usage::default());
}

/// Item 9 of issue 6: a reader that read the master entry just before a switch still finds
/// the old generation and its backends until the grace period has passed.
#[test]
fn readers_holding_an_old_master_entry_keep_working() {
    let mut store = ModelStore::default();
    let mut p = fresh();
    let a = fe("10.96.0.10", 80);
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    let t0 = Instant::now();
    // Many changes within the grace period: every master value ever written stays valid
    // (ModelStore checks that after each write).
    for i in 2..40u8 {
        let b = format!("10.0.0.{i}:8080");
        let r = p.apply_scoped(&mut store, &state(&[(a, &[&b])]), Scope::All, t0);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
    }
    assert!(
        store.slots.len() > 30,
        "old generations are retired too early"
    );
    // Not due yet: nothing is deleted.
    assert_eq!(
        p.retire_due(&mut store, t0 + Duration::from_millis(999))
            .deleted,
        0
    );
    store.forget_readers();
    p.retire_due(&mut store, t0 + Duration::from_secs(1));
    exact(&store, &state(&[(a, &["10.0.0.39:8080"])]));
}

#[test]
fn a_backend_named_again_within_the_grace_period_is_kept() {
    let mut store = ModelStore::default();
    let mut p = fresh();
    let a = fe("10.96.0.10", 80);
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    let t0 = Instant::now();
    p.apply_scoped(
        &mut store,
        &state(&[(a, &["10.0.0.2:8080"])]),
        Scope::All,
        t0,
    );
    p.apply_scoped(
        &mut store,
        &state(&[(a, &["10.0.0.1:8080"])]),
        Scope::All,
        t0,
    );
    store.forget_readers();
    p.retire_due(&mut store, t0 + Duration::from_secs(2));
    exact(&store, &state(&[(a, &["10.0.0.1:8080"])]));
}

#[test]
fn master_entry_is_the_last_write_of_a_change() {
    let mut store = ModelStore::default();
    let mut p = fresh();
    let a = fe("10.96.0.10", 80);
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
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
    assert!(store.log[..master]
        .iter()
        .all(|o| matches!(o, Op::PutBackend(..) | Op::PutSlot(..) | Op::PutMeta(..))));
    // Nothing is deleted in the sync itself: the old generation is retired later.
    assert_eq!(master, store.log.len() - 1, "{:?}", store.log);
}

#[test]
fn a_failed_write_keeps_the_old_state_and_other_services() {
    let a = fe("10.96.0.10", 80);
    let c = fe("10.96.0.11", 80);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    // The next sync's first put fails (the new backend of `a`).
    store.fail_put_at = Some(store.puts);
    let want = state(&[(a, &["10.0.0.9:8080"]), (c, &["10.0.0.5:8080"])]);
    let r = settle(&mut p, &mut store, &want);
    assert_eq!(r.errors.len(), 1);
    assert!(
        r.errors[0].to_string().contains(&owner_for(&a)),
        "{}",
        r.errors[0]
    );
    assert_eq!(
        r.failed.keys().collect::<Vec<_>>(),
        vec![&owner_for(&a)],
        "{:?}",
        r.failed
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
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty());
    exact(&store, &want);
}

/// A failure in the middle of a Service's writes leaves nothing of the attempt reachable, for
/// every position of the failure.
#[test]
fn a_service_is_written_completely_or_not_at_all() {
    let a = fe("10.96.0.10", 80);
    let a2 = fe("10.96.0.10", 81);
    let before = state(&[(a, &["10.0.0.1:8080"])]);
    let mut after = state(&[
        (a, &["10.0.0.2:8080", "10.0.0.3:8080"]),
        (a2, &["10.0.0.4:8080"]),
    ]);
    for d in after.frontends.values_mut() {
        d.service = format!("default/web:{}", d.frontend.port);
    }
    let mut before = before;
    for d in before.frontends.values_mut() {
        d.service = "default/web:80".into();
    }
    for fail_at in 0..12 {
        let mut store = ModelStore::default();
        let mut p = fresh();
        settle(&mut p, &mut store, &before);
        store.fail_put_at = Some(store.puts + fail_at);
        let r = p.apply(&mut store, &after);
        if r.errors.is_empty() {
            break;
        }
        assert_eq!(
            store.resolve(&a).unwrap(),
            vec!["10.0.0.1:8080".parse().unwrap()],
            "fail at {fail_at}"
        );
        assert!(store.resolve(&a2).is_none(), "fail at {fail_at}");
        store.fail_put_at = None;
        settle(&mut p, &mut store, &after);
        exact(&store, &after);
    }
}

/// Item 6 of issue 6: a Service that does not fit is not programmed at all, the ClusterIP
/// marker still goes in (its ports are refused, not routed), and the error names the Service
/// and the map.
#[test]
fn a_full_services_map_refuses_whole_services_and_keeps_their_markers() {
    let mut store = ModelStore::default();
    let cap = Capacity {
        services: 20,
        ..Capacity::default()
    };
    store.services_cap = Some(cap.services as usize);
    let mut p = Programmed::empty(cap, Duration::from_secs(1));
    let mut want = DesiredState::default();
    // Three Services of 8 ports each on their own ClusterIPs: 24 frontends + 3 markers.
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let ip: IpAddr = format!("10.96.0.{}", i + 1).parse().unwrap();
        want.cluster_ips.insert(ip);
        for port in 0..8u16 {
            let f = Frontend::cluster(ip, 80 + port, Protocol::Tcp);
            want.frontends.insert(
                f,
                DesiredFrontend {
                    frontend: f,
                    service: format!("default/{name}:p{port}"),
                    backends: vec![format!("10.0.{i}.1:8080").parse().unwrap()],
                    affinity_timeout_s: None,
                    internal_local: false,
                    kind: crate::model::Kind::ClusterIP,
                    external_local: false,
                    source_ranges: None,
                    created: None,
                    serving: None,
                    lb_algorithm: None,
                },
            );
        }
    }
    let r = settle(&mut p, &mut store, &want);
    assert_eq!(
        r.failed.keys().map(String::as_str).collect::<Vec<_>>(),
        ["default/c"]
    );
    let msg = r.errors[0].to_string();
    assert!(
        msg.contains("default/c") && msg.contains("SVC_SERVICES"),
        "{msg}"
    );
    // Nothing of c, but all three markers.
    for port in 0..8 {
        assert!(store.resolve(&fe("10.96.0.3", 80 + port)).is_none());
    }
    for i in 1..=3 {
        let ip: IpAddr = format!("10.96.0.{i}").parse().unwrap();
        assert!(store.services.contains_key(&marker_key(ip)), "marker {ip}");
    }
    assert_eq!(store.services.len(), 19);
    assert!(
        store.slots.keys().all(|k| k.id <= 16),
        "no slot of c is left"
    );
}

#[test]
fn recovery_adopts_pinned_state_and_cleans_leftovers_first() {
    let a = fe("10.96.0.10", 80);
    let mut store = ModelStore::default();
    let mut p = fresh();
    let desired = state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"])]);
    settle(&mut p, &mut store, &desired);
    // A dead agent left a half-written next generation behind.
    let leftover = SlotKey {
        id: 1,
        rev: 2,
        slot: 1,
    };
    store.slots.insert(leftover, group(&[1]));

    let mut p2 = recovered(&store);
    store.log.clear();
    let t0 = Instant::now();
    let r = p2.apply_scoped(&mut store, &desired, Scope::All, t0);
    assert!(r.errors.is_empty());
    assert_eq!(r.strays_deleted, 1);
    // The live service is not rewritten, and the leftover waits out the grace period.
    assert_eq!(store.log, vec![]);

    // A change meanwhile writes a generation that is not the leftover's.
    let changed = state(&[(a, &["10.0.0.3:8080"])]);
    p2.apply_scoped(&mut store, &changed, Scope::All, t0);
    assert_eq!(store.services[&service_key(&a)].rev, 3);
    store.forget_readers();
    p2.retire_due(&mut store, t0 + Duration::from_secs(2));
    exact(&store, &changed);
}

/// Item 1 of issue 6, deterministic form: the agent dies after writing the slots and
/// reverse-NAT entry of a new frontend id, before its master entry. The restarted agent must
/// not hand that id out again, and its first sync must end exactly at the desired state.
#[test]
fn an_agent_killed_before_a_master_entry_leaves_nothing_behind() {
    let a = fe("10.96.0.10", 80);
    let b = fe("10.96.0.11", 80);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    let want = state(&[
        (a, &["10.0.0.1:8080"]),
        (b, &["10.0.0.2:8080", "10.0.0.3:8080"]),
    ]);
    // A restarted agent dies right before the master entry of b.
    let ops_before = store.ops;
    let mut probe = store.clone();
    fresh_apply_count(&mut probe, &want);
    let master_at = probe.log[ops_before..]
        .iter()
        .position(|o| matches!(o, Op::PutService(k, _) if *k == service_key(&b)))
        .unwrap();
    store.crash_after = Some(ops_before + master_at);
    fresh_apply_count(&mut store, &want);
    store.crash_after = None;
    assert!(
        store.rev_nat.len() == 2 && store.slots.len() == 2,
        "half-written b"
    );
    let dead_id = *store.rev_nat.keys().max().unwrap();

    let mut p2 = recovered(&store);
    settle(&mut p2, &mut store, &want);
    exact(&store, &want);
    let b_id = store.services[&service_key(&b)].id;
    assert!(b_id > dead_id, "id {dead_id} handed out again");
}

fn fresh_apply_count(store: &mut ModelStore, want: &DesiredState) {
    let mut p = recovered(store);
    p.apply(store, want);
}

/// Item 1 of issue 6, every kill point: whatever op the agent dies after, the next agent's
/// first sync ends exactly at the desired state, and no reader ever meets a dangling entry.
#[test]
fn a_crash_after_any_op_is_repaired_by_the_next_agent() {
    let mk = |spec: &[(&str, u16, &[&str])]| {
        let mut s = DesiredState::default();
        for (ip, port, backends) in spec {
            // Port 53 is UDP: its frontends keep membership entries, as 443's (affinity) do.
            let f = Frontend {
                protocol: if *port == 53 {
                    Protocol::Udp
                } else {
                    Protocol::Tcp
                },
                ..fe(ip, *port)
            };
            let mut b: Vec<crate::model::Backend> =
                backends.iter().map(|b| b.parse().unwrap()).collect();
            b.sort();
            s.frontends.insert(
                f,
                DesiredFrontend {
                    frontend: f,
                    service: format!("ns/{}:{port}", ip.replace(':', "-")),
                    backends: b,
                    affinity_timeout_s: (*port == 443).then_some(60),
                    internal_local: false,
                    kind: crate::model::Kind::ClusterIP,
                    external_local: false,
                    source_ranges: None,
                    created: None,
                    serving: None,
                    lb_algorithm: None,
                },
            );
            s.cluster_ips.insert(f.ip);
        }
        s
    };
    let before = mk(&[
        ("10.96.0.1", 80, &["10.0.0.1:80", "10.0.0.2:80"]),
        ("10.96.0.1", 443, &["10.0.0.1:443"]),
        ("10.96.0.2", 53, &["10.0.0.3:53"]),
        ("fd00::3", 80, &[]),
    ]);
    let after = mk(&[
        (
            "10.96.0.1",
            80,
            &["10.0.0.2:80", "10.0.0.4:80", "10.0.0.5:80"],
        ),
        ("10.96.0.2", 53, &["10.0.0.3:53", "10.0.0.7:53"]),
        ("10.96.0.5", 53, &["10.0.0.3:53"]),
        ("10.96.0.4", 8080, &["10.0.0.9:8080", "10.0.0.1:80"]),
        ("fd00::3", 80, &["[fd00::9]:80"]),
    ]);
    // The default array, and one of 16 entries, where the ids past the recovered high-water
    // mark go round it and meet the indexes in use.
    for entries in [0, 16] {
        crash_after_any_op(&before, &after, entries);
    }
}

fn crash_after_any_op(before: &DesiredState, after: &DesiredState, backend_entries: u32) {
    let mut base = ModelStore {
        backend_entries,
        ..ModelStore::default()
    };
    let mut p = Programmed::empty(capacity_of(&base), Duration::from_secs(1));
    settle(&mut p, &mut base, before);
    let total = {
        let mut s = base.clone();
        let n0 = s.ops;
        fresh_apply_count(&mut s, after);
        s.ops - n0
    };
    assert!(total > 10);
    for kill_at in 0..=total {
        // The first agent: adopted the maps, dies after `kill_at` ops of the change.
        let mut store = base.clone();
        store.crash_after = Some(store.ops + kill_at);
        fresh_apply_count(&mut store, after);
        store.crash_after = None;
        // The second agent: recovers, syncs once, waits out the grace period.
        let mut p = recovered(&store);
        let r = settle(&mut p, &mut store, after);
        assert!(r.errors.is_empty(), "kill at {kill_at}: {:?}", r.errors);
        let problems = crate::verify::check(&store.snapshot().unwrap(), after);
        assert!(problems.is_empty(), "kill at {kill_at}: {problems:#?}");
        // And a third agent finds nothing to do.
        let mut p3 = recovered(&store);
        let r = p3.apply(&mut store, after);
        assert_eq!(
            r.ops,
            0,
            "kill at {kill_at}: {:?}",
            &store.log[store.log.len() - r.ops..]
        );
    }
}

/// Item 8 of issue 6: drift (entries deleted or changed behind the agent's back) is found by
/// comparing the maps with the mirror, and repaired.
#[test]
fn drift_is_repaired_from_a_fresh_reading_of_the_maps() {
    let a = fe("10.96.0.10", 80);
    let b = fe("10.96.0.11", 80);
    let want = state(&[
        (a, &["10.0.0.1:8080", "10.0.0.2:8080"]),
        (b, &["10.0.0.3:8080"]),
    ]);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    // Someone clears a slot, a reverse-NAT entry and a marker, and adds junk.
    let id_a = store.services[&service_key(&a)].id;
    for g in store.slots.iter_mut().filter(|(k, _)| k.id == id_a) {
        g.1.backends[1] = 0;
    }
    let id_b = store.services[&service_key(&b)].id;
    // And names a backend past b's one slot, which no reader reaches.
    for g in store.slots.iter_mut().filter(|(k, _)| k.id == id_b) {
        g.1.backends[3] = g.1.backends[0];
    }
    store.rev_nat.remove(&id_b);
    store.services.remove(&marker_key(a.ip));
    store.backends.insert(
        999,
        plan::backend_value(999, "10.9.9.9:1".parse().unwrap(), Protocol::Tcp),
    );
    store.unchecked = true;
    let retiring = std::mem::take(&mut p.retiring);
    let mut p = Programmed::recover(
        &store.snapshot().unwrap(),
        Capacity::default(),
        Duration::from_secs(1),
        retiring,
    );
    // b's one slot still reaches its backend: it stays b's (no stray to delete) while b is
    // written again.
    let pb = &p.frontends[&b];
    assert_eq!((pb.backends.len(), pb.complete()), (1, false));
    assert!(!p.strays.backends.contains(&pb.backends[0]));
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.ops > 0);
    exact(&store, &want);
    // b was written again: its current generation's entry names its one backend alone.
    let v = store.services[&service_key(&b)];
    let (k, _) = SlotKey::of_slot(v.id, v.rev, 0);
    assert_eq!(store.slots[&k].backends[1..], [0; 7]);
}

/// A generation of 20 slots is three slots entries (8, 8, 4): recovery reads each slot from
/// its place, a missing middle entry leaves its 8 slots out (the others keep theirs), and an
/// entry naming a backend past the last slot has its generation written again, its backends
/// kept meanwhile; either way the next sync ends exactly at the desired state.
#[test]
fn recovery_reads_slots_eight_to_an_entry() {
    let a = fe("10.96.0.10", 80);
    let addrs: Vec<String> = (1..=20).map(|i| format!("10.0.0.{i}:8080")).collect();
    let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    let want = state(&[(a, &refs)]);
    for tear in ["middle entry missing", "backend past the last slot"] {
        let mut store = ModelStore::default();
        let mut p = fresh();
        settle(&mut p, &mut store, &want);
        let v = store.services[&service_key(&a)];
        let keys: Vec<SlotKey> = super::slot_keys(v.id, v.rev, v.count).collect();
        assert_eq!(keys.len(), 3);
        assert_eq!(store.slots[&keys[2]].backends[4..], [0; 4]);
        let before = p.frontends[&a].backends.clone();
        if tear == "middle entry missing" {
            store.slots.remove(&keys[1]);
        } else {
            let g = store.slots.get_mut(&keys[2]).unwrap();
            g.backends[6] = g.backends[0];
        }
        store.unchecked = true;
        let mut p = recovered(&store);
        let pf = &p.frontends[&a];
        assert!(!pf.complete(), "{tear}");
        if tear == "middle entry missing" {
            let kept: Vec<BackendId> = [&before[..8], &before[16..]].concat();
            assert_eq!(pf.backends, kept, "{tear}");
        } else {
            assert_eq!(pf.backends, before, "{tear}");
            assert!(p.strays.backends.is_empty(), "{tear}");
        }
        let r = settle(&mut p, &mut store, &want);
        assert!(r.errors.is_empty(), "{tear}: {:?}", r.errors);
        exact(&store, &want);
        let v = store.services[&service_key(&a)];
        let (last, _) = SlotKey::of_slot(v.id, v.rev, 19);
        assert_eq!(store.slots[&last].backends[4..], [0; 4], "{tear}");
    }
}

#[test]
fn ids_are_made_durable_before_use_and_never_reused() {
    let mut store = ModelStore::default();
    let mut p = fresh();
    let a = fe("10.96.0.10", 80);
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    assert!(store.meta.frontend_id_hwm > 1 && store.meta.backend_id_hwm > 1);
    assert!(matches!(store.log[0], Op::PutMeta(_)), "{:?}", store.log);
    // Everything deleted, then a restart: the next id is above the durable mark.
    settle(&mut p, &mut store, &DesiredState::default());
    let hwm = store.meta.frontend_id_hwm;
    let mut p2 = recovered(&store);
    settle(&mut p2, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    assert!(store.services[&service_key(&a)].id >= hwm);
}

#[test]
fn scoped_sync_touches_only_its_frontends() {
    let a = fe("10.96.0.10", 80);
    let b = fe("10.96.0.11", 80);
    let c = fe("10.96.0.12", 80);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(
        &mut p,
        &mut store,
        &state(&[(a, &["10.0.0.1:8080"]), (b, &["10.0.0.1:8080"])]),
    );
    // Desired changes for a and b, a removal of b and an addition of c; only b and c are in
    // scope, so a keeps what it had.
    let desired = state(&[(a, &["10.0.0.7:8080"]), (c, &["10.0.0.2:8080"])]);
    let scope: BTreeSet<Frontend> = [b, c].into_iter().collect();
    let now = Instant::now();
    let r = p.apply_scoped(&mut store, &desired, Scope::Only(&scope), now);
    assert!(r.errors.is_empty());
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(5));
    assert_eq!(
        store.resolve(&a).unwrap(),
        vec!["10.0.0.1:8080".parse().unwrap()]
    );
    assert_eq!(store.resolve(&b), None);
    assert!(!store.services.contains_key(&marker_key(b.ip)));
    assert_eq!(
        store.resolve(&c).unwrap(),
        vec!["10.0.0.2:8080".parse().unwrap()]
    );
    // 10.0.0.1 is still used by a, so it stays.
    assert_eq!(store.backends.len(), 2);
}

#[test]
fn names_round_trip_and_truncate_on_char_boundary() {
    assert_eq!(decode_name(&encode_name("ns/web:http")), "ns/web:http");
    let long = "é".repeat(200);
    let d = decode_name(&encode_name(&long));
    assert!(d.len() <= 159 && long.starts_with(&d));
    assert_eq!(owner_of("ns/web:http"), "ns/web");
    assert_eq!(owner_of("ns/web"), "ns/web");
}

/// A frontend of `protocol` with `backends` and optional sessionAffinity, a Service of its own.
fn frontend(s: &mut DesiredState, f: Frontend, backends: &[&str], affinity_timeout_s: Option<u32>) {
    let mut b: Vec<crate::model::Backend> = backends.iter().map(|b| b.parse().unwrap()).collect();
    b.sort();
    s.frontends.insert(
        f,
        DesiredFrontend {
            frontend: f,
            service: owner_for(&f),
            backends: b,
            affinity_timeout_s,
            internal_local: false,
            kind: crate::model::Kind::ClusterIP,
            external_local: false,
            source_ranges: None,
            created: None,
            serving: None,
            lb_algorithm: None,
        },
    );
    s.cluster_ips.insert(f.ip);
}

fn udp(ip: &str, port: u16) -> Frontend {
    Frontend {
        protocol: Protocol::Udp,
        ..fe(ip, port)
    }
}

fn matches_of(store: &ModelStore, f: &Frontend) -> Vec<BackendId> {
    let id = store.services[&service_key(f)].id;
    let mut v: Vec<BackendId> = store
        .matches
        .iter()
        .filter(|k| k.id == id)
        .map(|k| k.backend)
        .collect();
    v.sort();
    v
}

/// Issue 7, item 3: membership entries of a frontend's new backends are written before the
/// master entry switches to them, those of departed backends deleted right after the switch
/// (not after the grace period); frontends that never check a remembered choice (TCP without
/// affinity) have none; turning affinity off deletes them after the switch.
#[test]
fn membership_goes_in_before_the_switch_and_departed_backends_leave_right_after() {
    let a = udp("10.96.0.10", 53);
    let t = fe("10.96.0.11", 80);
    let mut store = ModelStore::default();
    let mut p = fresh();
    let mut s1 = DesiredState::default();
    frontend(&mut s1, a, &["10.0.0.1:53", "10.0.0.2:53"], None);
    frontend(&mut s1, t, &["10.0.0.1:80"], None);
    settle(&mut p, &mut store, &s1);
    exact(&store, &s1);
    assert_eq!(matches_of(&store, &a).len(), 2);
    assert!(matches_of(&store, &t).is_empty());

    let mut s2 = DesiredState::default();
    frontend(&mut s2, a, &["10.0.0.2:53", "10.0.0.3:53"], None);
    frontend(&mut s2, t, &["10.0.0.1:80"], Some(30));
    store.log.clear();
    let now = Instant::now();
    let r = p.apply_scoped(&mut store, &s2, Scope::All, now);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let at = |log: &[Op], pred: &dyn Fn(&Op) -> bool| log.iter().position(pred).unwrap();
    let master_a = at(
        &store.log,
        &|o| matches!(o, Op::PutService(k, _) if *k == service_key(&a)),
    );
    let put_a = at(&store.log, &|o| matches!(o, Op::PutMatch(_)));
    let del_a = at(&store.log, &|o| matches!(o, Op::DelMatch(_)));
    assert!(put_a < master_a && master_a < del_a, "{:?}", store.log);
    // Gone at once, before any retirement.
    let departed = p
        .backends
        .id_of(&BackendKey::new(
            "10.0.0.1:53".parse().unwrap(),
            Protocol::Udp,
        ))
        .unwrap();
    let id_a = store.services[&service_key(&a)].id;
    assert!(!store.matches.contains(&AffinityMatchKey {
        id: id_a,
        backend: departed
    }));
    // t gained affinity: its entries went in before its master entry.
    let master_t = at(
        &store.log,
        &|o| matches!(o, Op::PutService(k, _) if *k == service_key(&t)),
    );
    let id_t = store.services[&service_key(&t)].id;
    let put_t = at(
        &store.log,
        &|o| matches!(o, Op::PutMatch(k) if k.id == id_t),
    );
    assert!(put_t < master_t, "{:?}", store.log);
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(5));
    exact(&store, &s2);

    // Affinity off again: deleted right after the switch.
    store.log.clear();
    let r = settle(&mut p, &mut store, &s1);
    assert!(r.errors.is_empty());
    let master_t = at(
        &store.log,
        &|o| matches!(o, Op::PutService(k, _) if *k == service_key(&t)),
    );
    let del_t = at(
        &store.log,
        &|o| matches!(o, Op::DelMatch(k) if k.id == id_t),
    );
    assert!(master_t < del_t, "{:?}", store.log);
    exact(&store, &s1);

    // A removed frontend's entries go with its master entry.
    let r = settle(&mut p, &mut store, &DesiredState::default());
    assert!(r.errors.is_empty());
    assert!(store.matches.is_empty());
    assert_eq!(p.usage, Usage::default());
}

/// Issue 7, item 3: recovery reads membership entries back and repairs them: a missing one is
/// written, one of a backend the frontend does not have and one of no frontend are deleted.
#[test]
fn recovery_repairs_membership_entries() {
    let a = udp("10.96.0.10", 53);
    let b = fe("10.96.0.11", 443);
    let mut want = DesiredState::default();
    frontend(&mut want, a, &["10.0.0.1:53", "10.0.0.2:53"], None);
    frontend(&mut want, b, &["10.0.0.1:443"], Some(60));
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    let id_a = store.services[&service_key(&a)].id;
    let lost = *store.matches.iter().find(|k| k.id == id_a).unwrap();
    store.matches.remove(&lost);
    store.matches.insert(AffinityMatchKey {
        id: id_a,
        backend: 777,
    });
    store.matches.insert(AffinityMatchKey {
        id: 4242,
        backend: 1,
    });
    store.unchecked = true;
    let problems = crate::verify::check(&store.snapshot().unwrap(), &want);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    let mut p2 = recovered(&store);
    assert_eq!(p2.strays.matches.len(), 1);
    assert!(p2.ids.next_frontend > 4242, "a stray's id is spent");
    let r = settle(&mut p2, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);
    assert_eq!(p2.usage.matches, 3);
}

/// `BACKENDS` is an array: a backend's entry is at its id modulo the array's size. Ids go
/// round it and one is handed out only where the index is free (the model store refuses a
/// write over another backend's entry), also while old sets wait out their grace period
/// beside new ones and after a restart; a set that finds no free index refuses its Service,
/// naming the map, until the old sets are retired.
#[test]
fn backend_ids_go_round_the_array_and_never_take_a_taken_index() {
    let cap = Capacity {
        backends: 8,
        ..Capacity::default()
    };
    let mut store = ModelStore {
        backend_entries: 8,
        ..ModelStore::default()
    };
    let mut p = Programmed::empty(cap, Duration::from_secs(1));
    let a = fe("10.96.0.10", 80);
    let set = |round: u32| {
        let b: Vec<String> = (1..=2).map(|i| format!("10.0.{round}.{i}:80")).collect();
        let b: Vec<&str> = b.iter().map(String::as_str).collect();
        state(&[(a, &b)])
    };
    let mut highest = 0;
    for round in 0..24u32 {
        if round == 12 {
            // A restart: the next ids avoid what the recovered mirror holds.
            p = Programmed::recover(
                &store.snapshot().unwrap(),
                cap,
                Duration::from_secs(1),
                std::mem::take(&mut p.retiring),
            );
        }
        let want = set(round);
        let now = Instant::now();
        let r = p.apply_scoped(&mut store, &want, Scope::All, now);
        assert!(r.errors.is_empty(), "round {round}: {:?}", r.errors);
        store.forget_readers();
        // Every third round retires; the two before leave their old sets beside the new.
        if round % 3 == 2 {
            p.retire_due(&mut store, now + Duration::from_secs(3600));
            exact(&store, &want);
            assert_eq!(store.backends.len(), 2, "round {round}");
        }
        highest = highest.max(store.backends.keys().copied().max().unwrap_or(0));
    }
    assert!(highest > 3 * 8, "the ids went round the array: {highest}");

    // Three sets held (one current, two retiring) and one more: the array is full.
    let mut held = 0;
    for round in 100..104u32 {
        let r = p.apply_scoped(&mut store, &set(round), Scope::All, Instant::now());
        store.forget_readers();
        if !r.errors.is_empty() {
            assert!(
                r.errors[0].to_string().contains("SVC_BACKENDS"),
                "{}",
                r.errors[0]
            );
            break;
        }
        held += 1;
    }
    assert_eq!((held, store.backends.len()), (3, 8));
    p.retire_due(&mut store, Instant::now() + Duration::from_secs(3600));
    let r = settle(&mut p, &mut store, &set(104));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &set(104));
}

/// Membership entries count against their map's capacity: a Service that does not fit is
/// refused whole, naming the map.
#[test]
fn a_full_membership_map_refuses_the_service() {
    let cap = Capacity {
        affinity_match: 3,
        ..Capacity::default()
    };
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(cap, Duration::from_secs(1));
    let mut want = DesiredState::default();
    let big = udp("10.96.0.10", 53);
    let small = udp("10.96.0.11", 53);
    frontend(
        &mut want,
        big,
        &["10.0.0.1:53", "10.0.0.2:53", "10.0.0.3:53"],
        None,
    );
    frontend(&mut want, small, &["10.0.0.4:53"], None);
    let r = settle(&mut p, &mut store, &want);
    assert_eq!(r.failed.len(), 1, "{:?}", r.errors);
    assert!(
        r.errors[0].to_string().contains("SVC_AFFINITY_MATCH"),
        "{}",
        r.errors[0]
    );
    assert_eq!(store.matches.len(), 3);
    assert_eq!(p.usage.matches, 3);
}

// ---------------------------------------------------------------------------------------------
// The packet datapath's state: scopes, backend flags, source ranges, node addresses, config.

/// A LoadBalancer frontend (external scope) of Service "ns/lb", with source ranges.
fn lb_frontend(
    s: &mut DesiredState,
    ip: &str,
    port: u16,
    ranges: Option<&[&str]>,
    backends: &[DesiredBackend],
) -> Frontend {
    let f = Frontend {
        scope: FeScope::External,
        ..fe(ip, port)
    };
    let mut d = DesiredFrontend::cluster_ip(f, &format!("ns/lb:{port}"), backends.to_vec());
    d.kind = Kind::LoadBalancer;
    d.source_ranges = ranges.map(|r| r.iter().map(|c| c.parse().unwrap()).collect());
    s.frontends.insert(f, d);
    f
}

fn cidr(c: &str) -> Cidr {
    c.parse().unwrap()
}

fn local(addr: &str) -> DesiredBackend {
    DesiredBackend::new(addr.parse().unwrap(), true)
}

#[test]
fn scopes_are_separate_frontends_and_node_ports_use_the_wildcard_key() {
    let mut want = DesiredState::default();
    let np_ext = Frontend::node_port(
        "0.0.0.0".parse().unwrap(),
        30080,
        Protocol::Tcp,
        FeScope::External,
    );
    let np_local = Frontend::node_port(
        "0.0.0.0".parse().unwrap(),
        30080,
        Protocol::Tcp,
        FeScope::Cluster,
    );
    for (f, backends) in [
        (np_ext, vec![local("10.0.1.1:8080")]),
        (
            np_local,
            vec![local("10.0.1.1:8080"), "10.0.2.1:8080".parse().unwrap()],
        ),
    ] {
        let mut d = DesiredFrontend::cluster_ip(f, "ns/np", backends);
        d.kind = Kind::NodePort;
        d.external_local = f.scope == FeScope::External;
        want.frontends.insert(f, d);
    }
    let mut store = ModelStore::default();
    let mut p = fresh();
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);
    let ext = store.services[&service_key(&np_ext)];
    let cl = store.services[&service_key(&np_local)];
    assert_eq!(service_key(&np_ext).addr, svc_common::NODEPORT_ADDR_V4);
    assert_eq!(service_key(&np_ext).scope, svc_common::scope::EXTERNAL);
    // External: its backend comes from its Maglev table.
    assert_eq!(
        ext.flags,
        svc_flags::NODEPORT | svc_flags::EXTERNAL_LOCAL | svc_flags::MAGLEV,
        "{ext:?}"
    );
    assert_eq!(cl.flags, svc_flags::NODEPORT);
    assert_ne!(ext.id, cl.id);
    // No marker for a wildcard; the local backend carries its flag, once for both frontends.
    assert!(store.services.keys().all(|k| k.proto != PROTO_ANY));
    let flagged: Vec<_> = store
        .backends
        .values()
        .filter(|b| b.flags & svc_common::backend_flags::LOCAL != 0)
        .collect();
    assert_eq!(flagged.len(), 1);
    // A restarted agent reads scopes and flags back and has nothing to do.
    let mut p2 = recovered(&store);
    assert_eq!(p2.apply(&mut store, &want).ops, 0);
}

/// A backend that moves to this node (or away) is a new backend entry, written before the
/// generation that names it: a reader never sees a backend's flags change under it.
#[test]
fn a_backend_changing_locality_gets_a_new_entry_and_generation() {
    let a = fe("10.96.0.10", 80);
    let mk = |b: DesiredBackend| {
        let mut s = DesiredState::default();
        s.frontends
            .insert(a, DesiredFrontend::cluster_ip(a, "ns/a", vec![b]));
        s.cluster_ips.insert(a.ip);
        s
    };
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &mk("10.0.1.1:8080".parse().unwrap()));
    let before = store.services[&service_key(&a)];
    store.log.clear();
    let want = mk(local("10.0.1.1:8080"));
    settle(&mut p, &mut store, &want);
    exact(&store, &want);
    let after = store.services[&service_key(&a)];
    assert_ne!(before.rev, after.rev);
    assert!(!store.log.iter().any(
        |o| matches!(o, Op::PutBackend(id, _) if p.backends.get(*id).is_some_and(|k| !k.local))
    ));
    assert_eq!(store.backends.len(), 1, "the old entry is retired");
}

#[test]
fn source_ranges_go_in_before_the_master_and_narrowing_never_drops_what_both_admit() {
    let b: DesiredBackend = "10.0.0.1:80".parse().unwrap();
    let mut s1 = DesiredState::default();
    let f = lb_frontend(
        &mut s1,
        "198.51.100.1",
        80,
        Some(&["10.0.0.0/8", "203.0.113.0/24"]),
        &[b],
    );
    let key = service_key(&f);
    let mut store = ModelStore {
        must_admit: vec![(key, cidr("10.0.0.0/8")), (key, cidr("203.0.113.0/24"))],
        ..Default::default()
    };
    let mut p = fresh();
    store.log.clear();
    let r = settle(&mut p, &mut store, &s1);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &s1);
    let master = store
        .log
        .iter()
        .position(|o| matches!(o, Op::PutService(k, _) if *k == key))
        .unwrap();
    assert_eq!(
        store.log[..master]
            .iter()
            .filter(|o| matches!(o, Op::PutRange(_)))
            .count(),
        2
    );
    assert!(store.services[&key].flags & svc_flags::SOURCE_RANGES != 0);

    // A range replaced: the one both sets have is admitted throughout; the new one goes in
    // before, the old one out right after (not after the grace period).
    let mut s2 = DesiredState::default();
    lb_frontend(
        &mut s2,
        "198.51.100.1",
        80,
        Some(&["10.0.0.0/8", "192.0.2.0/24"]),
        &[b],
    );
    store.must_admit = vec![(key, cidr("10.0.0.0/8"))];
    let r = p.apply_scoped(&mut store, &s2, Scope::All, Instant::now());
    assert!(r.errors.is_empty());
    let id = store.services[&key].id;
    assert!(!store
        .ranges
        .contains(&range_key(id, &cidr("203.0.113.0/24"))));
    store.forget_readers();
    exact(&store, &s2);
    store.must_admit.clear();

    // Ranges off: the flag goes with the switch, the entries right after.
    let mut s3 = DesiredState::default();
    lb_frontend(&mut s3, "198.51.100.1", 80, None, &[b]);
    settle(&mut p, &mut store, &s3);
    exact(&store, &s3);
    assert!(store.ranges.is_empty());
    assert_eq!(store.services[&key].flags & svc_flags::SOURCE_RANGES, 0);

    // Given but none valid: the flag with no entry admits nobody.
    let mut s4 = DesiredState::default();
    lb_frontend(&mut s4, "198.51.100.1", 80, Some(&[]), &[b]);
    settle(&mut p, &mut store, &s4);
    exact(&store, &s4);
    assert!(store.services[&key].flags & svc_flags::SOURCE_RANGES != 0);

    // A removed frontend's ranges are retired with its other entries.
    let t0 = Instant::now();
    settle(&mut p, &mut store, &s1);
    p.apply_scoped(&mut store, &DesiredState::default(), Scope::All, t0);
    assert_eq!(
        store.ranges.len(),
        2,
        "kept for readers holding the master entry"
    );
    store.forget_readers();
    p.retire_due(&mut store, t0 + Duration::from_secs(2));
    assert!(store.ranges.is_empty());
    // The LoadBalancer IP lingers in NODE_ADDRS until no flow goes to it.
    assert_eq!(p.check_flow_addrs(&mut store).deleted, 1);
    assert_eq!(p.usage, Usage::default());
}

#[test]
fn a_full_source_ranges_map_refuses_the_service() {
    let cap = Capacity {
        src_ranges: 1,
        ..Capacity::default()
    };
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(cap, Duration::from_secs(1));
    let mut want = DesiredState::default();
    lb_frontend(
        &mut want,
        "198.51.100.1",
        80,
        Some(&["10.0.0.0/8", "192.0.2.0/24"]),
        &[],
    );
    let r = settle(&mut p, &mut store, &want);
    assert_eq!(r.failed.len(), 1);
    assert!(
        r.errors[0].to_string().contains("SVC_SRC_RANGES"),
        "{}",
        r.errors[0]
    );
    assert!(store.services.is_empty() && store.ranges.is_empty());
}

#[test]
fn range_keys_round_trip_and_count_the_mapped_prefix() {
    for c in [
        "10.0.0.0/8",
        "198.51.100.1/32",
        "0.0.0.0/0",
        "2001:db8::/32",
        "::/0",
    ] {
        let c = cidr(c);
        let k = range_key(7, &c);
        assert_eq!(range_of(&k), Some((7, c)), "{c}");
    }
    assert_eq!(range_key(1, &cidr("10.0.0.0/8")).prefixlen, 32 + 96 + 8);
    assert_eq!(range_key(1, &cidr("2001:db8::/32")).prefixlen, 32 + 32);
    assert_eq!(
        range_key(0x01020304, &cidr("10.0.0.0/8")).id_be,
        0x01020304u32.to_be()
    );
}

/// Drift in the new maps is found and repaired like any other: a range deleted, one added
/// under a live frontend, a node address changed, the config overwritten.
/// A node address `ip` taking NodePorts, and SNAT settings.
fn with_node(want: &mut DesiredState, ip: IpAddr) {
    want.node.addrs.insert(
        ip,
        NodeAddrValue {
            flags: svc_common::node_addr_flags::NODEPORT,
            ifindex: 2,
        },
    );
    want.node.config = Some(DatapathConfig {
        snat_port_min: 61000,
        snat_port_max: 65535,
        ..Default::default()
    });
}

#[test]
fn drift_in_ranges_node_addresses_and_config_is_repaired() {
    let b: DesiredBackend = "10.0.0.1:80".parse().unwrap();
    let mut want = DesiredState::default();
    let f = lb_frontend(&mut want, "198.51.100.1", 80, Some(&["10.0.0.0/8"]), &[b]);
    let node_ip: IpAddr = "192.168.1.10".parse().unwrap();
    with_node(&mut want, node_ip);
    let mut store = ModelStore::default();
    let mut p = fresh();
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);

    let id = store.services[&service_key(&f)].id;
    store.unchecked = true;
    store.ranges.clear();
    store.ranges.insert(range_key(id, &cidr("0.0.0.0/0")));
    store.ranges.insert(range_key(999, &cidr("10.0.0.0/8")));
    store
        .node_addrs
        .insert(addr16(node_ip), NodeAddrValue::default());
    store.node_addrs.insert(
        addr16("192.168.1.11".parse().unwrap()),
        NodeAddrValue::default(),
    );
    store.config = DatapathConfig::default();
    assert!(!crate::verify::check(&store.snapshot().unwrap(), &want).is_empty());
    let mut p = restarted(&mut p, &store);
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);
}

#[test]
fn node_addresses_follow_the_node_alone_and_respect_their_capacity() {
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(
        Capacity {
            node_addrs: 2,
            ..Capacity::default()
        },
        Duration::from_secs(1),
    );
    let mut node = NodeDesired::default();
    for i in 1..=3u8 {
        node.addrs.insert(
            IpAddr::from([192, 168, 1, i]),
            NodeAddrValue {
                flags: svc_common::node_addr_flags::SNAT,
                ifindex: 3,
            },
        );
    }
    let r = p.apply_node(&mut store, &node);
    assert_eq!(r.errors.len(), 1);
    assert!(r.errors[0].to_string().contains("SVC_NODE_ADDRS"));
    assert_eq!(store.node_addrs.len(), 2);
    // A removed address lingers (svc may still translate flows to it) and keeps its room
    // while a flow goes to it.
    let first = addr16(IpAddr::from([192, 168, 1, 1]));
    node.addrs.remove(&IpAddr::from([192, 168, 1, 1]));
    let r = p.apply_node(&mut store, &node);
    assert_eq!(r.errors.len(), 1);
    assert_eq!(store.node_addrs[&first].flags, node_addr_flags::LINGER);
    store.flows_to.insert(first);
    let pruned = p.check_flow_addrs(&mut store);
    assert_eq!((pruned.kept, pruned.deleted), (1, 0));
    store.flows_to.clear();
    let pruned = p.check_flow_addrs(&mut store);
    assert_eq!((pruned.kept, pruned.deleted), (0, 1));
    let r = p.apply_node(&mut store, &node);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.node_addrs.len(), 2);
    assert!(store
        .node_addrs
        .contains_key(&addr16(IpAddr::from([192, 168, 1, 3]))));
    assert_eq!(p.apply_node(&mut store, &node).ops, 0);
}

/// The crash test again with the packet datapath's entries: source ranges of LoadBalancer
/// frontends, both scopes, local backends, node addresses and config.
#[test]
fn a_crash_after_any_op_among_packet_datapath_entries_is_repaired() {
    let b1 = local("10.0.1.1:80");
    let b2: DesiredBackend = "10.0.2.1:80".parse().unwrap();
    let mut before = DesiredState::default();
    lb_frontend(
        &mut before,
        "198.51.100.1",
        80,
        Some(&["10.0.0.0/8", "192.0.2.0/24"]),
        &[b1, b2],
    );
    lb_frontend(
        &mut before,
        "198.51.100.2",
        80,
        Some(&["203.0.113.0/24"]),
        &[b2],
    );
    before.node.addrs.insert(
        "192.168.1.10".parse().unwrap(),
        NodeAddrValue {
            flags: 3,
            ifindex: 2,
        },
    );
    let mut after = DesiredState::default();
    lb_frontend(
        &mut after,
        "198.51.100.1",
        80,
        Some(&["10.0.0.0/8", "172.16.0.0/12"]),
        &[b1],
    );
    lb_frontend(
        &mut after,
        "198.51.100.3",
        80,
        Some(&["203.0.113.0/24"]),
        &[b2, local("10.0.1.2:80")],
    );
    let np = Frontend::node_port(
        "0.0.0.0".parse().unwrap(),
        30080,
        Protocol::Udp,
        FeScope::External,
    );
    let mut d = DesiredFrontend::cluster_ip(np, "ns/np", vec![b1]);
    d.kind = Kind::NodePort;
    d.external_local = true;
    after.frontends.insert(np, d);
    after.node.addrs.insert(
        "192.168.1.11".parse().unwrap(),
        NodeAddrValue {
            flags: 1,
            ifindex: 3,
        },
    );
    after.node.config = Some(DatapathConfig {
        snat_port_min: 61000,
        snat_port_max: 65535,
        ..Default::default()
    });
    let mut base = ModelStore::default();
    settle(&mut fresh(), &mut base, &before);
    let total = {
        let mut s = base.clone();
        let n0 = s.ops;
        fresh_apply_count(&mut s, &after);
        s.ops - n0
    };
    assert!(total > 10);
    for kill_at in 0..=total {
        let mut store = base.clone();
        store.crash_after = Some(store.ops + kill_at);
        fresh_apply_count(&mut store, &after);
        store.crash_after = None;
        let mut p = recovered(&store);
        let r = settle(&mut p, &mut store, &after);
        assert!(r.errors.is_empty(), "kill at {kill_at}: {:?}", r.errors);
        let problems = crate::verify::check(&store.snapshot().unwrap(), &after);
        assert!(problems.is_empty(), "kill at {kill_at}: {problems:#?}");
        let mut p3 = recovered(&store);
        assert_eq!(p3.apply(&mut store, &after).ops, 0, "kill at {kill_at}");
    }
}

/// A frontend of Service port `service` ("namespace/name:port") with sessionAffinity.
fn affinity_frontend(s: &mut DesiredState, f: Frontend, service: &str, backends: &[&str]) {
    let mut b: Vec<DesiredBackend> = backends.iter().map(|b| b.parse().unwrap()).collect();
    b.sort();
    let mut d = DesiredFrontend::cluster_ip(f, service, b);
    d.affinity_timeout_s = Some(60);
    if f.scope == FeScope::External {
        d.kind = Kind::LoadBalancer;
    } else {
        s.cluster_ips.insert(f.ip);
    }
    s.frontends.insert(f, d);
}

fn affinity_id_of(store: &ModelStore, f: &Frontend) -> u32 {
    store.services[&service_key(f)].affinity_id
}

/// sessionAffinity is one per Service port: every frontend of the port carries one affinity
/// id (a frontend added later joins it), no other port's; it survives a restart (choices
/// remembered before it keep matching); a port that goes and another that comes, or a
/// frontend that passes to another Service, never get an id that named another port.
#[test]
fn affinity_ids_are_per_service_port_stable_and_never_shared() {
    let ext = |ip: &str, port| Frontend {
        scope: FeScope::External,
        ..fe(ip, port)
    };
    let web4 = fe("10.96.0.10", 80);
    let web6 = fe("fd00:96::10", 80);
    let web_lb = ext("198.51.100.20", 80);
    let api = fe("10.96.0.20", 80);
    let plain = fe("10.96.0.30", 80);
    let mut s = DesiredState::default();
    for f in [web4, web6, web_lb] {
        affinity_frontend(
            &mut s,
            f,
            "ns/web:http",
            &["10.0.0.1:8080", "10.0.0.2:8080"],
        );
    }
    affinity_frontend(&mut s, api, "ns/api", &["10.0.0.1:8080", "10.0.0.2:8080"]);
    frontend(&mut s, plain, &["10.0.0.1:8080"], None);
    let mut store = ModelStore::default();
    let mut p = fresh();
    let r = settle(&mut p, &mut store, &s);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &s);
    let web = affinity_id_of(&store, &web4);
    assert_ne!(web, 0);
    assert_eq!(affinity_id_of(&store, &web6), web);
    assert_eq!(affinity_id_of(&store, &web_lb), web);
    let api_id = affinity_id_of(&store, &api);
    assert_ne!(api_id, 0);
    assert_ne!(api_id, web);
    assert_eq!(affinity_id_of(&store, &plain), 0);
    let frontend_ids: Vec<u32> = store.services.values().map(|v| v.id).collect();
    assert!(!frontend_ids.contains(&web) && !frontend_ids.contains(&api_id));

    // A LoadBalancer IP added later, by a sync of that frontend alone, joins the port.
    let web_lb2 = ext("198.51.100.21", 80);
    affinity_frontend(
        &mut s,
        web_lb2,
        "ns/web:http",
        &["10.0.0.1:8080", "10.0.0.2:8080"],
    );
    let only: BTreeSet<Frontend> = [web_lb2].into();
    p.apply_scoped(&mut store, &s, Scope::Only(&only), Instant::now());
    assert_eq!(affinity_id_of(&store, &web_lb2), web);

    // A restart: the recovered agent keeps every id and rewrites nothing; a frontend it adds
    // joins the port's id as before.
    let mut p = recovered(&store);
    store.log.clear();
    let r = settle(&mut p, &mut store, &s);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.log, vec![], "nothing rewritten after a restart");
    let web_ext_ip = ext("198.51.100.22", 80);
    affinity_frontend(&mut s, web_ext_ip, "ns/web:http", &["10.0.0.1:8080"]);
    settle(&mut p, &mut store, &s);
    assert_eq!(affinity_id_of(&store, &web_ext_ip), web);
    exact(&store, &s);

    // The ClusterIP passes to another Service while web's other frontends stay: not web's id.
    let mut moved = s.clone();
    moved.frontends.remove(&web4);
    affinity_frontend(&mut moved, web4, "ns/moved", &["10.0.0.1:8080"]);
    settle(&mut p, &mut store, &moved);
    exact(&store, &moved);
    let moved_id = affinity_id_of(&store, &web4);
    assert!(![0, web, api_id].contains(&moved_id));
    assert_eq!(affinity_id_of(&store, &web6), web);

    // web goes; another Service comes (after a restart, too): ids never seen before.
    let mut next = moved.clone();
    next.frontends.retain(|_, d| d.owner() != "ns/web");
    let other = fe("10.96.0.40", 80);
    affinity_frontend(&mut next, other, "ns/other", &["10.0.0.2:8080"]);
    settle(&mut p, &mut store, &next);
    exact(&store, &next);
    let other_id = affinity_id_of(&store, &other);
    assert!(![0, web, api_id, moved_id].contains(&other_id));
    let mut p = recovered(&store);
    let again = fe("10.96.0.50", 80);
    affinity_frontend(&mut next, again, "ns/again", &["10.0.0.2:8080"]);
    settle(&mut p, &mut store, &next);
    exact(&store, &next);
    let again_id = affinity_id_of(&store, &again);
    assert!(![0, web, api_id, moved_id, other_id].contains(&again_id));
}

/// NODE_ADDRS holds an external frontend's address before its master entry (the store checks
/// that at every write), keeps it as LINGER after the frontend is gone while a flow goes to
/// it, and lets it go when none does; across a restart too.
#[test]
fn external_frontend_addresses_go_in_first_and_linger_while_flows_go_to_them() {
    let mut store = ModelStore::default();
    let mut p = fresh();
    let b = DesiredBackend::new("10.0.0.1:8080".parse().unwrap(), false);
    let mut want = DesiredState::default();
    let f = lb_frontend(&mut want, "198.51.100.1", 80, None, &[b]);
    // Two frontends on one address: it goes only with the last.
    let g = lb_frontend(&mut want, "198.51.100.1", 443, None, &[b]);
    let lb = addr16(f.ip);
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);
    assert_eq!(store.node_addrs[&lb].flags, node_addr_flags::EXTERNAL);

    let mut one = want.clone();
    one.frontends.remove(&g);
    settle(&mut p, &mut store, &one);
    assert_eq!(store.node_addrs[&lb].flags, node_addr_flags::EXTERNAL);

    // The Service is deleted while a connection through its LoadBalancer IP is open.
    store.flows_to.insert(lb);
    let empty = DesiredState::default();
    settle(&mut p, &mut store, &empty);
    assert_eq!(store.node_addrs[&lb].flags, node_addr_flags::LINGER);
    exact(&store, &empty);
    assert_eq!(p.check_flow_addrs(&mut store).kept, 1);

    // A restart meanwhile: the lingering address is adopted as it is.
    let mut p = recovered(&store);
    settle(&mut p, &mut store, &empty);
    assert_eq!(store.node_addrs[&lb].flags, node_addr_flags::LINGER);
    assert_eq!(p.check_flow_addrs(&mut store).kept, 1);

    // The Service comes back: its address is an external frontend's again.
    settle(&mut p, &mut store, &want);
    assert_eq!(store.node_addrs[&lb].flags, node_addr_flags::EXTERNAL);
    exact(&store, &want);
    settle(&mut p, &mut store, &empty);

    // The connection closed: the address goes.
    store.flows_to.clear();
    let pruned = p.check_flow_addrs(&mut store);
    assert_eq!((pruned.kept, pruned.deleted), (0, 1));
    assert!(store.node_addrs.is_empty());
    assert_eq!(p.usage, Usage::default());
}

/// A flow to an address NODE_ADDRS lacks (state of an agent from before the gate, or an
/// entry someone deleted) gets a LINGER entry back (at start, before any program that looks
/// at NODE_ADDRS is attached, and at every drift check).
#[test]
fn flows_to_addresses_node_addrs_lacks_are_put_back() {
    let mut store = ModelStore::default();
    let old_lb = addr16("198.51.100.9".parse().unwrap());
    let node_ip = addr16("192.168.1.10".parse().unwrap());
    store.node_addrs.insert(
        node_ip,
        NodeAddrValue {
            flags: node_addr_flags::NODEPORT,
            ifindex: 2,
        },
    );
    store.flows_to.extend([old_lb, node_ip]);
    store.unchecked = true;
    let mut p = recovered(&store);
    let r = p.check_flow_addrs(&mut store);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.added, 1);
    assert_eq!(store.node_addrs[&old_lb].flags, node_addr_flags::LINGER);
    assert_eq!(store.node_addrs[&node_ip].flags, node_addr_flags::NODEPORT);
    let r = p.check_flow_addrs(&mut store);
    assert_eq!((r.added, r.kept, r.deleted), (0, 1, 0));
}

/// An external frontend whose address cannot go into NODE_ADDRS (full here) is not written
/// (no packet would reach it): its Service is left as it was and retried, the error names the
/// Service, the map and the address; the rest is programmed. Once there is room it goes in.
#[test]
fn a_frontend_whose_address_cannot_enter_node_addrs_is_not_written() {
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(
        Capacity {
            node_addrs: 1,
            ..Capacity::default()
        },
        Duration::from_secs(1),
    );
    let b = DesiredBackend::new("10.0.0.1:8080".parse().unwrap(), false);
    let mut want = state(&[(fe("10.96.0.10", 80), &["10.0.0.1:8080"])]);
    want.node.addrs.insert(
        "192.168.1.10".parse().unwrap(),
        NodeAddrValue {
            flags: node_addr_flags::NODEPORT,
            ifindex: 2,
        },
    );
    let f = lb_frontend(&mut want, "198.51.100.1", 80, None, &[b]);
    let r = settle(&mut p, &mut store, &want);
    assert!(!store.services.contains_key(&service_key(&f)));
    assert!(store
        .services
        .contains_key(&service_key(&fe("10.96.0.10", 80))));
    assert!(r.failed.contains_key("ns/lb"), "{:?}", r.failed);
    let text: Vec<String> = r.errors.iter().map(|e| e.to_string()).collect();
    assert!(
        text.iter().any(|t| t.contains("Service ns/lb")
            && t.contains("SVC_NODE_ADDRS")
            && t.contains("198.51.100.1")),
        "{text:?}"
    );

    // The node address goes: it lingers until no flow needs it, then there is room.
    want.node.addrs.clear();
    settle(&mut p, &mut store, &want);
    assert!(!store.services.contains_key(&service_key(&f)));
    assert_eq!(p.check_flow_addrs(&mut store).deleted, 1);
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);
}

/// An external frontend on one of the node's own addresses needs that address marked
/// `EXTERNAL` in NODE_ADDRS (the external ingress looks a node address up by a frontend's own
/// key only then): when the mark cannot be written, the frontend is held back like one whose
/// address is missing, and goes in once the mark does.
#[test]
fn a_frontend_on_a_node_address_waits_for_its_external_mark() {
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(Capacity::default(), Duration::from_secs(1));
    let mut want = state(&[(fe("10.96.0.10", 80), &["10.0.0.1:8080"])]);
    let node_ip = "192.168.1.10";
    want.node.addrs.insert(
        node_ip.parse().unwrap(),
        NodeAddrValue {
            flags: node_addr_flags::NODEPORT,
            ifindex: 2,
        },
    );
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let b = DesiredBackend::new("10.0.0.1:8080".parse().unwrap(), false);
    let f = lb_frontend(&mut want, node_ip, 443, None, &[b]);
    // The next put is the address's mark: it comes before the frontend's entries.
    store.fail_put_at = Some(store.puts);
    let r = settle(&mut p, &mut store, &want);
    assert!(!store.services.contains_key(&service_key(&f)));
    assert!(r.failed.contains_key("ns/lb"), "{:?}", r.failed);
    let text: Vec<String> = r.errors.iter().map(|e| e.to_string()).collect();
    assert!(
        text.iter()
            .any(|t| t.contains("Service ns/lb") && t.contains(node_ip)),
        "{text:?}"
    );
    assert_eq!(
        store.node_addrs[&addr16(node_ip.parse().unwrap())].flags,
        node_addr_flags::NODEPORT
    );

    store.fail_put_at = None;
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(
        store.node_addrs[&addr16(node_ip.parse().unwrap())].flags,
        node_addr_flags::NODEPORT | node_addr_flags::EXTERNAL
    );
    exact(&store, &want);
}

/// A frontend already programmed on a node address that lacks its `EXTERNAL` mark (pins of
/// an agent older than the mark, adopted at restart) is unreachable by its own key until the
/// mark is written. When that write fails, its Service is retried (with backoff), not left
/// for the periodic reconcile.
#[test]
fn a_programmed_frontend_whose_external_mark_fails_is_retried() {
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(Capacity::default(), Duration::from_secs(1));
    let node_ip = "192.168.1.10";
    let mut want = DesiredState::default();
    want.node.addrs.insert(
        node_ip.parse().unwrap(),
        NodeAddrValue {
            flags: node_addr_flags::NODEPORT,
            ifindex: 2,
        },
    );
    let b = DesiredBackend::new("10.0.0.1:8080".parse().unwrap(), false);
    let f = lb_frontend(&mut want, node_ip, 443, None, &[b]);
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);

    // The pins as an agent older than the mark left them: the frontend, its address unmarked.
    store.unchecked = true;
    let key = addr16(node_ip.parse().unwrap());
    store.node_addrs.get_mut(&key).unwrap().flags = node_addr_flags::NODEPORT;
    let mut p = recovered(&store);
    store.fail_node_addr_puts = true;
    let r = settle(&mut p, &mut store, &want);
    assert!(store.services.contains_key(&service_key(&f)));
    assert_eq!(store.node_addrs[&key].flags, node_addr_flags::NODEPORT);
    assert!(r.failed.contains_key("ns/lb"), "{:?}", r.failed);
    let text: Vec<String> = r.errors.iter().map(|e| e.to_string()).collect();
    assert!(
        text.iter()
            .any(|t| t.contains("Service ns/lb") && t.contains(node_ip)),
        "{text:?}"
    );

    store.fail_node_addr_puts = false;
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(
        store.node_addrs[&key].flags,
        node_addr_flags::NODEPORT | node_addr_flags::EXTERNAL
    );
    exact(&store, &want);
}

/// A node address the map refuses fails the sync of the node's state (`node_failed`), so the
/// agent retries it with backoff and reports it, rather than waiting for the next drift check;
/// the next sync that writes it clears the flag.
#[test]
fn a_node_address_the_map_refuses_fails_the_node_sync() {
    let mut store = ModelStore::default();
    let mut p = Programmed::empty(Capacity::default(), Duration::from_secs(1));
    let mut want = DesiredState::default();
    want.node.addrs.insert(
        "192.168.1.10".parse().unwrap(),
        NodeAddrValue {
            flags: node_addr_flags::NODEPORT,
            ifindex: 2,
        },
    );
    store.fail_node_addr_puts = true;
    assert!(settle(&mut p, &mut store, &want).node_failed);
    assert!(p.apply_node(&mut store, &want.node).node_failed);
    store.fail_node_addr_puts = false;
    assert!(!p.apply_node(&mut store, &want.node).node_failed);
    assert!(!settle(&mut p, &mut store, &want).node_failed);
    exact(&store, &want);
}

/// One Service leaves an external address as another takes it, in one sync, while the address
/// is missing from a full NODE_ADDRS (drift): the newcomer is held back, not written where no
/// packet would look it up.
#[test]
fn an_unwritable_address_one_service_leaves_as_another_takes_it_holds_the_newcomer_back() {
    let mut store = ModelStore::default();
    let cap = Capacity {
        node_addrs: 2,
        ..Capacity::default()
    };
    let mut p = Programmed::empty(cap, Duration::from_secs(1));
    let b = DesiredBackend::new("10.0.0.1:8080".parse().unwrap(), false);
    let lb = |s: &mut DesiredState, owner: &str, port: u16| {
        let f = Frontend {
            scope: FeScope::External,
            ..fe("198.51.100.1", port)
        };
        let mut d = DesiredFrontend::cluster_ip(f, &format!("{owner}:{port}"), vec![b]);
        d.kind = Kind::LoadBalancer;
        s.frontends.insert(f, d);
        f
    };
    let node = |s: &mut DesiredState, ip: &str| {
        s.node.addrs.insert(
            ip.parse().unwrap(),
            NodeAddrValue {
                flags: node_addr_flags::SNAT,
                ifindex: 2,
            },
        );
    };
    let mut before = DesiredState::default();
    node(&mut before, "192.168.1.10");
    lb(&mut before, "ns/a", 80);
    let r = settle(&mut p, &mut store, &before);
    assert!(r.errors.is_empty(), "{:?}", r.errors);

    // Someone deletes the address; a second node address fills the map; a restart adopts that.
    store.unchecked = true;
    store
        .node_addrs
        .remove(&addr16("198.51.100.1".parse().unwrap()));
    let mut after = DesiredState::default();
    node(&mut after, "192.168.1.10");
    node(&mut after, "192.168.1.11");
    let mut p = Programmed::recover(
        &store.snapshot().unwrap(),
        cap,
        Duration::from_secs(1),
        Retiring::default(),
    );
    let f = lb(&mut after, "ns/b", 443);
    let r = settle(&mut p, &mut store, &after);
    assert!(!store.services.contains_key(&service_key(&f)));
    assert!(r.failed.contains_key("ns/b"), "{:?}", r.failed);
    assert!(!r.failed.contains_key("ns/a"), "{:?}", r.failed);
}

/// A manifest Service "ns/name" on 10.96.0.10:80 (the API server never saw it, so nothing
/// bounded its name).
fn manifest_service(ns: &str, name: &str) -> k8s_openapi::api::core::v1::Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": ns, "name": name},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
    }))
    .unwrap()
}

/// What serves a frontend keeps serving it when another Service claims it too (README:
/// "what serves now keeps serving"), whatever the holder's name: owners are read back from
/// the names map, which keeps 159 bytes of "namespace/name:port" and splits at the first ':'.
/// A name the API server would refuse may be refused with an error naming the Service, but a
/// Service that is served must keep its frontend.
#[test]
fn a_frontend_stays_with_its_holder_whatever_the_holders_name() {
    let node = crate::translate::NodeContext::default();
    for name in [
        "web:v2".to_string(),
        "x".repeat(200),
        "web".into(),
        "x".repeat(63),
    ] {
        let holder = manifest_service("default", &name);
        let t = crate::translate::translate(std::slice::from_ref(&holder), &[], &node);
        let mut store = ModelStore::default();
        let mut p = fresh();
        let r = settle(&mut p, &mut store, &t.state);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        if t.state.frontends.is_empty() {
            let named = format!("Service default/{name}");
            assert!(
                t.errors.iter().any(|e| e.to_string().contains(&named)),
                "refused without an error naming it: {:?}",
                t.errors
            );
            continue;
        }

        // "default/a" comes later and sorts first: it must not take the frontend over.
        let newcomer = manifest_service("default", "a");
        let t = crate::translate::translate_with(&[holder, newcomer], &[], &node, &p.served());
        let owner = t.state.frontends[&fe("10.96.0.10", 80)].owner();
        assert_eq!(owner, format!("default/{name}"), "{:?}", t.errors);
    }
}

/// Two ports of one Service keep affinity ids of their own across a restart, whatever their
/// names: kube-proxy keeps one affinity per Service port, and the names map holds only 159
/// bytes of "namespace/name:port".
#[test]
fn long_port_names_never_share_an_affinity_id() {
    let node = crate::translate::NodeContext::default();
    let (ns, name) = ("n".repeat(63), "s".repeat(63));
    let port_a = format!("{}-a", "p".repeat(40));
    let port_b = format!("{}-b", "p".repeat(40));
    let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": ns, "name": name},
        "spec": {
            "clusterIP": "10.96.0.10",
            "sessionAffinity": "ClientIP",
            "ports": [{"name": port_a, "port": 80}, {"name": port_b, "port": 81}],
        },
    }))
    .unwrap();
    let t = crate::translate::translate(&[svc], &[], &node);
    let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.10", 81));
    if !t.state.frontends.contains_key(&a) || !t.state.frontends.contains_key(&b) {
        // Refusing a port name the API server refuses is fine, if the error says so.
        assert!(
            t.errors.iter().any(|e| e.to_string().contains("port")),
            "{:?}",
            t.errors
        );
        return;
    }
    let mut store = ModelStore::default();
    let mut p = fresh();
    let r = settle(&mut p, &mut store, &t.state);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_ne!(affinity_id_of(&store, &a), affinity_id_of(&store, &b));

    let mut p = recovered(&store);
    let r = settle(&mut p, &mut store, &t.state);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_ne!(
        affinity_id_of(&store, &a),
        affinity_id_of(&store, &b),
        "after a restart"
    );
}

/// A restart after the pinned state was damaged: one stray entry whose id is the highest
/// there is (a bit flip, a hand-written entry) is deleted as a stray, and must not leave the
/// agent unable to give new frontends ids of their own, nor make it panic.
#[test]
fn a_stray_entry_with_the_highest_id_does_not_make_frontends_share_ids() {
    let a = fe("10.96.0.10", 80);
    let b = fe("10.96.0.11", 80);
    let c = fe("10.96.0.12", 80);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
    store.unchecked = true;
    store.rev_nat.insert(u32::MAX, RevNatValue::default());
    store.backends.insert(u32::MAX, Backend::default());

    let want = state(&[
        (a, &["10.0.0.1:8080"]),
        (b, &["10.0.0.2:8080"]),
        (c, &["10.0.0.3:8080"]),
    ]);
    let mut p = recovered(&store);
    let r = settle(&mut p, &mut store, &want);
    // Refusing a Service for want of ids is fine, with an error naming it; sharing is not.
    let id = |f: &Frontend| store.services.get(&service_key(f)).map(|v| v.id);
    for f in [a, b, c] {
        if id(&f).is_none() {
            let named = format!("Service {}", owner_for(&f));
            assert!(
                r.errors.iter().any(|e| e.to_string().contains(&named)),
                "{f} neither programmed nor reported: {:?}",
                r.errors
            );
        }
    }
    let ids: Vec<u32> = [a, b, c].iter().filter_map(id).collect();
    let mut distinct = ids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), ids.len(), "frontend ids {ids:?}");
    assert_eq!(id(&a), Some(1), "the programmed frontend is kept");
}

/// A node whose SNAT range is 61000-65535, synced with `low` (port 80) alone; `high` (port
/// 62000) lies in the range.
struct SnatRangeStart {
    config: DatapathConfig,
    low: Frontend,
    high: Frontend,
    want: DesiredState,
    store: ModelStore,
    p: Programmed,
}

fn snat_range_start() -> SnatRangeStart {
    let config = DatapathConfig {
        snat_port_min: 61000,
        snat_port_max: 65535,
        ..Default::default()
    };
    let low = fe("10.96.0.10", 80);
    let mut want = state(&[(low, &["10.0.0.1:8080"])]);
    want.node.config = Some(config);
    let mut store = ModelStore::default();
    let mut p = fresh();
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.config, config, "no frontend port in the range");
    exact(&store, &want);
    SnatRangeStart {
        config,
        low,
        high: fe("10.96.0.11", 62000),
        want,
        store,
        p,
    }
}

/// The log of `store` writes the `snat_range_frontends` mark, and after it frontend `f`'s
/// SERVICES entry: what lets a flow to it start.
fn assert_marked_before(store: &ModelStore, f: &Frontend) {
    let mark = store
        .log
        .iter()
        .position(|op| matches!(op, Op::PutConfig(c) if c.snat_range_frontends != 0))
        .expect("the mark written");
    let first_entry = store
        .log
        .iter()
        .position(|op| matches!(op, Op::PutService(k, _) if *k == service_key(f)))
        .expect("the frontend written");
    assert!(mark < first_entry, "the mark first: {:?}", store.log);
}

/// `snat_range_frontends` is set, before its entries, as a frontend whose port lies in the
/// SNAT range is added (by a sync of that frontend alone too); kept by its removal, by a change
/// of the node's settings alone and by a restart while a live flow goes to such a port (the
/// flow walk); cleared by the walk once nothing needs it; kept, without a write each sync, while
/// such a Service is wanted but fails. The drift check wants it for such a desired frontend
/// and takes either value without one.
#[test]
fn the_snat_range_frontends_mark_comes_before_such_a_frontend_and_goes_after_its_flows() {
    let SnatRangeStart {
        config,
        low,
        high,
        want,
        mut store,
        mut p,
    } = snat_range_start();
    let marked = DatapathConfig {
        snat_range_frontends: 1,
        ..config
    };

    let mut with_high = state(&[(low, &["10.0.0.1:8080"]), (high, &["10.0.0.2:8080"])]);
    with_high.node.config = Some(config);
    store.log.clear();
    let only: BTreeSet<Frontend> = [high].into();
    let r = p.apply_scoped(&mut store, &with_high, Scope::Only(&only), Instant::now());
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.config, marked);
    assert_marked_before(&store, &high);
    exact(&store, &with_high);

    // The frontend goes (a sync of it alone); a flow to it lives on.
    store.snat_range_flows = true;
    let now = Instant::now();
    let r = p.apply_scoped(&mut store, &want, Scope::Only(&only), now);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(3600));
    assert!(!store.services.contains_key(&service_key(&high)));
    assert_eq!(store.config, marked, "kept by the removal");
    exact(&store, &want);
    // The node's settings change (its timeouts): the mark stays.
    let mut node = want.node.clone();
    node.config = Some(DatapathConfig {
        ct_udp_s: 45,
        ..config
    });
    let r = p.apply_node(&mut store, &node);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(
        (store.config.ct_udp_s, store.config.snat_range_frontends),
        (45, 1)
    );
    let r = p.apply_node(&mut store, &want.node);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // A restart and a full sync keep it; the walk keeps it while the flow lives.
    let mut p = restarted(&mut p, &store);
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.config, marked, "kept by a restart and a full sync");
    exact(&store, &want);
    let r = p.check_flow_addrs(&mut store);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.config, marked, "kept while the flow lives");
    // The flow is gone: the walk clears it.
    store.snat_range_flows = false;
    let r = p.check_flow_addrs(&mut store);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.config, config, "cleared");
    exact(&store, &want);

    // Wanted but failing (its backend does not fit): marked once, then no write per sync or
    // walk, and the drift check is content.
    let mut p = Programmed::empty(
        Capacity {
            backends: 1,
            ..Capacity::default()
        },
        Duration::from_secs(1),
    );
    let mut store = ModelStore::default();
    let r = settle(&mut p, &mut store, &with_high);
    assert!(!r.errors.is_empty(), "the Service that does not fit fails");
    assert!(!store.services.contains_key(&service_key(&high)));
    assert_eq!(store.config, marked);
    for _ in 0..2 {
        store.log.clear();
        settle(&mut p, &mut store, &with_high);
        p.check_flow_addrs(&mut store);
        assert_eq!(store.config, marked);
        assert!(
            !store.log.iter().any(|op| matches!(op, Op::PutConfig(_))),
            "no write: {:?}",
            store.log
        );
    }
    assert!(crate::verify::check(&store.snapshot().unwrap(), &with_high)
        .iter()
        .all(|p| !p.contains("datapath config")));

    // The drift check wants the mark for a desired frontend in the range.
    store.config = config;
    assert!(crate::verify::check(&store.snapshot().unwrap(), &with_high)
        .iter()
        .any(|p| p.contains("datapath config")));
}

/// A frontend whose port lies in the SNAT range waits while the mark the SNAT port search needs
/// for it (`snat_range_frontends`) cannot be written: left unprogrammed, with an error that
/// names its Service and the mark, while the other Services of the same sync are written. Once
/// the config takes writes again, the next sync writes the mark, then the frontend.
#[test]
fn a_frontend_in_the_snat_range_waits_for_its_mark() {
    let SnatRangeStart {
        config,
        low,
        high,
        mut store,
        mut p,
        ..
    } = snat_range_start();
    let other = fe("10.96.0.12", 81);
    let mut more = state(&[
        (low, &["10.0.0.1:8080"]),
        (other, &["10.0.0.3:8080"]),
        (high, &["10.0.0.2:8080"]),
    ]);
    more.node.config = Some(config);
    store.fail_config_puts = true;
    let r = settle(&mut p, &mut store, &more);
    assert!(
        !store.services.contains_key(&service_key(&high)),
        "held back without its mark"
    );
    assert_eq!(store.config.snat_range_frontends, 0);
    assert!(
        store.services.contains_key(&service_key(&other)),
        "the other Service is written"
    );
    let errors: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
    assert!(
        errors.iter().any(|e| e.contains(&owner_for(&high))
            && e.contains("SNAT range")
            && e.contains("mark")),
        "{errors:#?}"
    );
    assert!(
        !errors.iter().any(|e| e.contains(&owner_for(&other))),
        "{errors:#?}"
    );

    store.fail_config_puts = false;
    let r = settle(&mut p, &mut store, &more);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(store.config.snat_range_frontends, 1);
    assert_marked_before(&store, &high);
    exact(&store, &more);
}

/// The plan of a sync is a value: what it writes, read before anything is written.
mod plan_value {
    use super::*;

    #[test]
    fn a_sync_of_many_services_is_an_outline_that_writes_what_the_whole_plan_says() {
        let n = super::super::plan::OUTLINE_ABOVE + 1;
        let owned: Vec<(Frontend, Vec<String>)> = (0..n)
            .map(|i| {
                let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
                let backend = format!("10.1.{}.{}:8080", i / 250, i % 250 + 1);
                (fe(&ip, 80), vec![backend, "10.0.0.1:8080".to_string()])
            })
            .collect();
        let entries: Vec<(Frontend, Vec<&str>)> = owned
            .iter()
            .map(|(f, b)| (*f, b.iter().map(String::as_str).collect()))
            .collect();
        let entries: Vec<(Frontend, &[&str])> =
            entries.iter().map(|(f, b)| (*f, b.as_slice())).collect();
        let desired = state(&entries);

        let whole = fresh().plan(&desired, Scope::All);
        let outline = fresh().plan_outline(&desired, Scope::All);
        assert!(!whole.outline && outline.outline);
        assert!(!outline.is_empty());
        assert_eq!(outline.services.len(), n);
        assert!(outline.services.iter().all(|s| s.plan.is_none()));
        assert_eq!(outline.new_markers, whole.new_markers);
        assert!(outline.to_string().contains(
            "service default/svc-10-96-0-1-80: 1 frontends to write, 0 to remove (its writes are \
             planned as they are made)"
        ));

        // Both, executed on empty maps, leave the same maps.
        let (mut by_whole, mut by_outline) = (ModelStore::default(), ModelStore::default());
        let r = fresh().execute_plan(&mut by_whole, &desired, whole, Instant::now());
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        let mut p = fresh();
        let r = p.execute_plan(&mut by_outline, &desired, outline, Instant::now());
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(r.frontends_written, n);
        assert_eq!(by_whole.services, by_outline.services);
        assert_eq!(by_whole.slots, by_outline.slots);
        assert_eq!(by_whole.backends, by_outline.backends);
        assert_eq!(by_whole.rev_nat, by_outline.rev_nat);
        assert_eq!(by_whole.matches, by_outline.matches);
        assert_eq!(by_whole.meta, by_outline.meta);
        exact(&by_whole, &desired);
        exact(&by_outline, &desired);
        // And what the agent runs (`apply`) plans nothing more afterwards.
        assert!(p.plan(&desired, Scope::All).is_empty());
    }

    fn node_addr(flags: u32, ifindex: u32) -> NodeAddrValue {
        NodeAddrValue { flags, ifindex }
    }

    #[test]
    fn a_new_service_is_its_backends_slots_ids_master_entry_and_marker() {
        let a = fe("10.96.0.10", 80);
        let p = fresh();
        let desired = state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"])]);
        let plan = p.plan(&desired, Scope::All);
        assert_eq!(plan.services.len(), 1);
        assert_eq!(plan.new_markers, vec![a.ip]);
        let unit = plan.services[0].plan.as_deref().unwrap().as_ref().unwrap();
        assert_eq!((unit.new_backends.len(), unit.add.len()), (2, 1));
        assert_eq!(
            plan.to_string(),
            "service default/svc-10-96-0-10-80:
  put SVC_META frontend ids below 4097, backend ids below 4098
  put SVC_BACKENDS 1 -> 10.0.0.1:8080/TCP
  put SVC_BACKENDS 2 -> 10.0.0.2:8080/TCP
  put SVC_REV_NAT 1 -> 10.96.0.10:80
  put SVC_NAMES 1 -> default/svc-10-96-0-10-80
  put SVC_SLOTS 1/1/1 -> backends [1, 2]
  put SVC_SERVICES 10.96.0.10:80/TCP -> id 1 rev 1 slots 2 flags 0x0
clusterip markers:
  put SVC_SERVICES 10.96.0.10 marker
"
        );
    }

    #[test]
    fn a_changed_backend_set_is_a_new_generation_and_a_switch() {
        let a = fe("10.96.0.10", 80);
        let mut store = ModelStore::default();
        let mut p = fresh();
        settle(
            &mut p,
            &mut store,
            &state(&[(a, &["10.0.0.1:8080", "10.0.0.2:8080"])]),
        );
        let changed = state(&[(a, &["10.0.0.1:8080", "10.0.0.3:8080"])]);
        let plan = p.plan(&changed, Scope::All);
        assert!(plan.new_markers.is_empty());
        assert_eq!(
            plan.to_string(),
            "service default/svc-10-96-0-10-80:
  put SVC_BACKENDS 3 -> 10.0.0.3:8080/TCP
  put SVC_SLOTS 1/2/1 -> backends [1, 3]
  put SVC_SERVICES 10.96.0.10:80/TCP -> id 1 rev 2 slots 2 flags 0x0
  retire SVC_SLOTS 1/1/1..=1 (2 slots)
"
        );
        // Executed, it does what it says, and nothing is left to plan.
        let r = p.execute_plan(&mut store, &changed, plan, Instant::now());
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert!(p.plan(&changed, Scope::All).is_empty());
        assert_eq!(
            p.plan(&changed, Scope::All).to_string(),
            "nothing to write\n"
        );
    }

    #[test]
    fn a_removed_service_is_a_deleted_master_entry_and_retirements() {
        let a = fe("10.96.0.10", 80);
        let mut store = ModelStore::default();
        let mut p = fresh();
        settle(&mut p, &mut store, &state(&[(a, &["10.0.0.1:8080"])]));
        let plan = p.plan(&DesiredState::default(), Scope::All);
        assert_eq!(plan.gone_markers, vec![a.ip]);
        assert_eq!(plan.services[0].gone, vec![a]);
        assert_eq!(
            plan.to_string(),
            "service default/svc-10-96-0-10-80:
  delete SVC_SERVICES 10.96.0.10:80/TCP
  retire SVC_SLOTS 1/1/1..=1 (1 slot)
  retire SVC_REV_NAT 1, SVC_NAMES 1
clusterip markers:
  delete SVC_SERVICES 10.96.0.10 marker
"
        );
    }

    #[test]
    fn a_node_address_change_is_its_entry_and_the_old_one_lingering() {
        let mut store = ModelStore::default();
        let mut p = fresh();
        let (old, new): (IpAddr, IpAddr) = (
            "192.168.1.1".parse().unwrap(),
            "192.168.1.2".parse().unwrap(),
        );
        let mut desired = DesiredState::default();
        desired
            .node
            .addrs
            .insert(old, node_addr(node_addr_flags::OF_NODE, 2));
        settle(&mut p, &mut store, &desired);
        desired.node.addrs.clear();
        desired
            .node
            .addrs
            .insert(new, node_addr(node_addr_flags::SNAT, 2));
        let plan = p.plan(&desired, Scope::All);
        let node = plan.node.as_ref().unwrap();
        assert_eq!(
            node.addrs,
            vec![
                (addr16(old), node_addr(node_addr_flags::LINGER, 0)),
                (addr16(new), node_addr(node_addr_flags::SNAT, 2)),
            ]
        );
        assert_eq!(
            plan.to_string(),
            "node:
  put SVC_NODE_ADDRS 192.168.1.1 LINGER
  put SVC_NODE_ADDRS 192.168.1.2 SNAT ifindex 2
"
        );
        // A sync of some Services alone leaves the node's part out.
        let none = BTreeSet::new();
        assert!(p.plan(&desired, Scope::Only(&none)).node.is_none());
    }

    #[test]
    fn a_stray_is_deleted_or_retired_before_anything_is_written() {
        let a = fe("10.96.0.10", 80);
        let mut store = ModelStore::default();
        let mut p = fresh();
        let desired = state(&[(a, &["10.0.0.1:8080"])]);
        settle(&mut p, &mut store, &desired);
        let leftover = SlotKey {
            id: 1,
            rev: 2,
            slot: 1,
        };
        store.slots.insert(leftover, group(&[1]));
        let p2 = restarted(&mut p, &store);
        let plan = p2.plan(&desired, Scope::All);
        assert_eq!(plan.strays.slots, vec![leftover]);
        assert_eq!(
            plan.to_string(),
            "leftovers:
  retire SVC_SLOTS 1/2/1
"
        );
    }

    /// An external frontend: its address is marked before it, and the plan says so.
    #[test]
    fn an_external_frontend_marks_its_address_first() {
        let lb = Frontend {
            ip: "203.0.113.7".parse().unwrap(),
            port: 443,
            protocol: Protocol::Tcp,
            scope: FeScope::External,
        };
        let mut desired = state(&[(lb, &["10.0.0.1:8443"])]);
        desired.cluster_ips.clear();
        let plan = fresh().plan(&desired, Scope::All);
        assert_eq!(
            plan.external_addrs,
            vec![(addr16(lb.ip), node_addr(node_addr_flags::EXTERNAL, 0))]
        );
        assert!(plan.addrs_after.is_empty());
        let text = plan.to_string();
        assert!(
            text.starts_with("external addresses:\n  put SVC_NODE_ADDRS 203.0.113.7 EXTERNAL\n"),
            "{text}"
        );
    }
}

/// Backends 10.0.3.1.. port 8080, `n` of them.
fn maglev_backends(n: u8) -> Vec<DesiredBackend> {
    (1..=n)
        .map(|i| format!("10.0.3.{i}:8080").parse().unwrap())
        .collect()
}

/// Where each op of `log` of these kinds is: (blocks, index, master of `f`).
fn first_of(log: &[Op], what: impl Fn(&Op) -> bool) -> usize {
    log.iter()
        .position(what)
        .unwrap_or_else(|| panic!("not written: {log:#?}"))
}

/// An external frontend's table goes in before its index entry, the index entry before the
/// master entry that flags it; a new backend set gets a new generation whose table is written
/// beside the old one, switched by the master entry, and the old table (index entry and
/// region) retired after the grace period.
#[test]
fn maglev_tables_go_in_beside_the_old_and_switch_with_the_master_entry() {
    let mut want = DesiredState::default();
    let f = lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(3));
    let mut store = ModelStore::default();
    let mut p = fresh();
    let cap = p.maglev.regions.capacity();

    // The plan says it, in order: blocks, index, master.
    let plan = p.plan(&want, Scope::All);
    let ops = plan.services[0]
        .plan
        .as_deref()
        .unwrap()
        .as_ref()
        .unwrap()
        .ops();
    let blocks = first_of(&ops, |o| matches!(o, Op::PutMaglev(..)));
    let index = first_of(&ops, |o| matches!(o, Op::PutMaglevIndex(..)));
    let master = first_of(
        &ops,
        |o| matches!(o, Op::PutService(k, _) if *k == service_key(&f)),
    );
    assert!(blocks < index && index < master, "{ops:#?}");

    settle(&mut p, &mut store, &want);
    exact(&store, &want);
    let v1 = store.services[&service_key(&f)];
    assert_ne!(v1.flags & svc_flags::MAGLEV, 0);
    let t1 = p.frontends[&f].maglev.expect("a table");
    assert_eq!(t1.size, 509);
    assert_eq!(p.maglev.regions.free_blocks(), cap - t1.blocks());

    // A fourth backend: a new generation, its table in another region.
    let mut four = DesiredState::default();
    lb_frontend(&mut four, "198.51.100.1", 80, None, &maglev_backends(4));
    let n0 = store.log.len();
    let now = Instant::now();
    let r = p.apply_scoped(&mut store, &four, Scope::All, now);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let log = &store.log[n0..];
    let blocks = first_of(log, |o| matches!(o, Op::PutMaglev(..)));
    let index = first_of(
        log,
        |o| matches!(o, Op::PutMaglevIndex(k, _) if k.rev == v1.rev + 1),
    );
    let master = first_of(log, |o| matches!(o, Op::PutService(..)));
    assert!(blocks < index && index < master, "{log:#?}");
    let t2 = p.frontends[&f].maglev.expect("a table");
    assert_ne!(t2.start, t1.start, "written beside the old table");
    // The old generation's index entry stays for readers that hold the old master entry.
    assert!(store.maglev_index.contains_key(&maglev_key(v1.id, v1.rev)));
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(3600));
    assert!(!store.maglev_index.contains_key(&maglev_key(v1.id, v1.rev)));
    assert_eq!(p.maglev.regions.free_blocks(), cap - t2.blocks());
    exact(&store, &four);

    // Removed: its table goes with its slots.
    settle(&mut p, &mut store, &DesiredState::default());
    assert!(store.maglev_index.is_empty());
    assert_eq!(p.maglev.regions.free_blocks(), cap);
    assert!(p.maglev.live.is_empty());
}

/// A change of algorithm keeps the generation: the index entry goes in before the master
/// entry gains the flag, and is retired after it loses it. A new seed is a new generation:
/// a table is never written over under its generation.
#[test]
fn an_algorithm_change_keeps_the_generation_and_a_seed_change_does_not() {
    let mut want = DesiredState::default();
    let f = lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(2));
    let mut store = ModelStore::default();
    let mut p = fresh();
    let cap = p.maglev.regions.capacity();
    settle(&mut p, &mut store, &want);
    let v = store.services[&service_key(&f)];
    let key = maglev_key(v.id, v.rev);

    let mut random = want.clone();
    random.frontends.get_mut(&f).unwrap().lb_algorithm = Some(crate::maglev::Algorithm::Random);
    let now = Instant::now();
    p.apply_scoped(&mut store, &random, Scope::All, now);
    let got = store.services[&service_key(&f)];
    assert_eq!((got.rev, got.flags & svc_flags::MAGLEV), (v.rev, 0));
    assert!(
        store.maglev_index.contains_key(&key),
        "retired after the grace period"
    );
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(3600));
    assert!(store.maglev_index.is_empty());
    assert_eq!(p.maglev.regions.free_blocks(), cap);
    exact(&store, &random);

    let n0 = store.log.len();
    settle(&mut p, &mut store, &want);
    let log = &store.log[n0..];
    let index = first_of(log, |o| matches!(o, Op::PutMaglevIndex(k, _) if *k == key));
    let master = first_of(log, |o| matches!(o, Op::PutService(..)));
    assert!(index < master, "{log:#?}");
    assert_eq!(store.services[&service_key(&f)].rev, v.rev);
    exact(&store, &want);

    // Another seed: a new generation, its table beside the old one, switched by the master
    // entry; the old table is never written over, and goes after the grace period.
    let t1 = p.frontends[&f].maglev.unwrap();
    p.maglev.settings.seed = 42;
    let n0 = store.log.len();
    let now = Instant::now();
    p.apply_scoped(&mut store, &want, Scope::All, now);
    let log: Vec<Op> = store.log[n0..].to_vec();
    let next = maglev_key(v.id, v.rev + 1);
    let blocks = first_of(&log, |o| matches!(o, Op::PutMaglev(s, _) if *s != t1.start));
    let index = first_of(
        &log,
        |o| matches!(o, Op::PutMaglevIndex(k, i) if *k == next && i.seed == [42, 0]),
    );
    let master = first_of(&log, |o| matches!(o, Op::PutService(..)));
    assert!(blocks < index && index < master, "{log:#?}");
    assert_eq!(store.services[&service_key(&f)].rev, v.rev + 1);
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(3600));
    assert!(!store.maglev_index.contains_key(&key));
    let t2 = p.frontends[&f].maglev.unwrap();
    assert_eq!(p.maglev.regions.free_blocks(), cap - t2.blocks());
    let problems = crate::verify::check_with(&store.snapshot().unwrap(), &want, &p.maglev.settings);
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(!crate::verify::check(&store.snapshot().unwrap(), &want).is_empty());
}

/// An agent restarted on the pinned maps adopts every table: nothing is written again.
#[test]
fn a_restarted_agent_adopts_the_tables_and_rewrites_none() {
    let mut want = DesiredState::default();
    for (i, n) in [1u8, 3, 12].iter().enumerate() {
        lb_frontend(
            &mut want,
            &format!("198.51.100.{}", i + 1),
            80,
            None,
            &maglev_backends(*n),
        );
    }
    let np = Frontend::node_port(
        "0.0.0.0".parse().unwrap(),
        30080,
        Protocol::Tcp,
        FeScope::External,
    );
    let mut d = DesiredFrontend::cluster_ip(np, "ns/np", maglev_backends(5));
    d.kind = Kind::NodePort;
    want.frontends.insert(np, d);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    exact(&store, &want);
    assert_eq!(p.maglev.live.len(), 4);
    let mut again = restarted(&mut p, &store);
    assert_eq!(again.maglev.live, p.maglev.live);
    assert_eq!(again.maglev.regions, p.maglev.regions);
    assert!(again.strays.is_empty(), "{:?}", again.strays);
    let r = again.apply(&mut store, &want);
    assert_eq!(r.ops, 0, "{:?}", &store.log[store.log.len() - r.ops..]);
}

/// The pages of SVC_MAGLEV a table is in, as the store holds them.
fn pages(store: &ModelStore) -> Vec<u32> {
    store.snapshot().unwrap().maglev_pages
}

/// A kill between any two writes of the retirement that deletes a table (its slots, its
/// index entry, the page it had alone) leaves no page behind once the next agent has synced:
/// the pages are those of the table still in use, and the maps are exact.
#[test]
fn a_crash_after_any_op_of_a_table_retirement_leaves_no_page_behind() {
    let mut want = DesiredState::default();
    lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(2));
    let other: Vec<DesiredBackend> = maglev_backends(3)[1..].to_vec();
    let b = lb_frontend(&mut want, "198.51.100.2", 80, None, &other);
    let mut only_a = want.clone();
    only_a.frontends.remove(&b);
    // The store and the agent with the second table's retirement due.
    let due = || {
        let mut store = ModelStore::default();
        let mut p = fresh();
        settle(&mut p, &mut store, &want);
        let now = Instant::now();
        p.apply_scoped(&mut store, &only_a, Scope::All, now);
        store.forget_readers();
        (store, p, now + Duration::from_secs(3600))
    };
    let total = {
        let (mut store, mut p, later) = due();
        let n0 = store.ops;
        p.retire_due(&mut store, later);
        assert_eq!(
            pages(&store),
            vec![0],
            "the second table's own page deleted"
        );
        store.ops - n0
    };
    assert!(total > 1, "{total}");
    for kill_at in 0..=total {
        let (mut store, mut p, later) = due();
        store.crash_after = Some(store.ops + kill_at);
        p.retire_due(&mut store, later);
        store.crash_after = None;
        let mut again = recovered(&store);
        let r = settle(&mut again, &mut store, &only_a);
        assert!(r.errors.is_empty(), "kill at {kill_at}: {:?}", r.errors);
        assert_eq!(pages(&store), vec![0], "kill at {kill_at}");
        exact(&store, &only_a);
    }
}

/// `--max-maglev-entries 0`: no room for tables, so no external frontend wants one (none
/// counted as without room, none written), though the map is one page, as a map must have
/// an entry.
#[test]
fn no_room_for_tables_writes_none_and_wants_none() {
    let capacity = Capacity {
        maglev: 0,
        ..Capacity::default()
    };
    assert_eq!(capacity.of(svc_common::map_names::MAGLEV), Some(1));
    assert_eq!(capacity.maglev_blocks(), 0);
    let mut want = DesiredState::default();
    let f = lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(2));
    let mut p = Programmed::empty(capacity, Duration::from_secs(1));
    let mut store = ModelStore::default();
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(
        store.services[&service_key(&f)].flags & svc_flags::MAGLEV,
        0
    );
    assert!(p.maglev.roomless.is_empty(), "{:?}", p.maglev.roomless);
    assert!(store.maglev.is_empty() && store.maglev_index.is_empty());
}

/// A page of SVC_MAGLEV goes back to the kernel once no table is in it: a table's pages when
/// it is retired, but not a page it shares with a table still in use; and at a restart, a
/// page a dead agent left without a table.
#[test]
fn pages_without_a_table_are_deleted() {
    // Two tables of 63 blocks: the first in page 0, the second across pages 0 and 1.
    let mut want = DesiredState::default();
    let a = lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(2));
    let other: Vec<DesiredBackend> = maglev_backends(3)[1..].to_vec();
    let b = lb_frontend(&mut want, "198.51.100.2", 80, None, &other);
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    let (ta, tb) = (
        p.frontends[&a].maglev.unwrap(),
        p.frontends[&b].maglev.unwrap(),
    );
    assert_eq!((ta.start, tb.start, tb.blocks()), (0, 63, 63));
    assert_eq!(pages(&store), vec![0, 1]);

    // The second goes: page 1 was its alone, page 0 keeps the first.
    let mut only_a = want.clone();
    only_a.frontends.remove(&b);
    settle(&mut p, &mut store, &only_a);
    assert_eq!(pages(&store), vec![0]);
    exact(&store, &only_a);
    // The first goes too.
    settle(&mut p, &mut store, &DesiredState::default());
    assert_eq!(pages(&store), Vec::<u32>::new());
    assert_eq!(p.maglev.regions.free_blocks(), p.maglev.regions.capacity());

    // A dead agent's page with no table in it (killed before its delete), found at a restart
    // and deleted by the first sync, which keeps the page of the table it writes.
    settle(&mut p, &mut store, &only_a);
    store.maglev.insert(
        5 * svc_common::MAGLEV_PAGE + 7,
        MaglevBlock { entries: [1; 4] },
    );
    assert_eq!(pages(&store), vec![0, 5]);
    let mut again = recovered(&store);
    let r = again.apply(&mut store, &only_a);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(pages(&store), vec![0]);
    exact(&store, &only_a);
}

/// A frontend whose table finds no room is programmed without one (random choice), never
/// refused, counted, and gets its table at a later sync once there is room.
#[test]
fn a_frontend_without_room_for_its_table_is_served_and_tried_again() {
    let a = Frontend {
        scope: FeScope::External,
        ..fe("198.51.100.1", 80)
    };
    let b = Frontend {
        scope: FeScope::External,
        ..fe("198.51.100.2", 80)
    };
    let mut want = DesiredState::default();
    lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(2));
    // Other backends than a's: a table of its own (the same would share a's).
    let other: Vec<DesiredBackend> = maglev_backends(3)[1..].to_vec();
    lb_frontend(&mut want, "198.51.100.2", 80, None, &other);
    // Room for one table of 2 backends (251 entries, 63 blocks) in one page of 120 blocks.
    let capacity = Capacity {
        maglev: 1,
        ..Capacity::default()
    };
    let mut p = Programmed::empty(capacity, Duration::from_secs(1));
    let mut store = ModelStore {
        maglev_cap: svc_common::MAGLEV_PAGE,
        ..Default::default()
    };
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.failed.is_empty());
    assert!(p.frontends[&a].maglev.is_some());
    assert_eq!(
        store.services[&service_key(&b)].flags & svc_flags::MAGLEV,
        0
    );
    assert!(store.resolve(&b).is_some(), "served");
    assert_eq!(p.maglev.roomless.iter().collect::<Vec<_>>(), vec![&b]);
    let problems = crate::verify::check(&store.snapshot().unwrap(), &want);
    assert_eq!(problems, vec![format!("{b}: no Maglev table")]);
    // Nothing to write while nothing changes.
    assert_eq!(p.apply(&mut store, &want).ops, 0);

    // a goes: its region comes free after the grace period, and b's next sync takes it.
    let mut only_b = want.clone();
    only_b.frontends.remove(&a);
    settle(&mut p, &mut store, &only_b);
    // a's index entry went after the grace period: no reader holds it when its region is
    // written again (with b's table, not the same as a's).
    store.forget_readers();
    settle(&mut p, &mut store, &only_b);
    assert!(p.frontends[&b].maglev.is_some());
    assert!(p.maglev.roomless.is_empty());
    exact(&store, &only_b);
}

/// A Service whose table's index write fails is left as it was, and the region it took is
/// free again; one whose master entry fails after its table is written retires the table.
#[test]
fn a_failed_service_gives_its_table_region_back() {
    let mut want = DesiredState::default();
    let f = lb_frontend(&mut want, "198.51.100.1", 80, None, &maglev_backends(3));
    for target in ["index", "master"] {
        let mut p = fresh();
        let cap = p.maglev.regions.capacity();
        // The puts: backends 3, rev nat, name, slots (one entry), blocks, index, master.
        let mut store = ModelStore {
            fail_put_at: Some(if target == "index" { 7 } else { 8 }),
            ..Default::default()
        };
        let now = Instant::now();
        let r = p.apply_scoped(&mut store, &want, Scope::All, now);
        assert_eq!(r.failed.len(), 1, "{target}");
        assert!(!store.services.contains_key(&service_key(&f)), "{target}");
        store.forget_readers();
        p.retire_due(&mut store, now + Duration::from_secs(3600));
        assert!(store.maglev_index.is_empty(), "{target}");
        assert_eq!(p.maglev.regions.free_blocks(), cap, "{target}");
        store.fail_put_at = None;
        settle(&mut p, &mut store, &want);
        exact(&store, &want);
    }
}

/// Every kill point of a sync that changes tables every way (a new backend set, an algorithm
/// changed both ways, a new frontend, one removed) and then of a seed change: the next
/// agent's first sync ends at the desired state, no reader ever finds a table changed under
/// it or a flagged generation without its index entry, and a third agent writes nothing.
#[test]
fn a_crash_after_any_op_among_maglev_tables_is_repaired() {
    let random = Some(crate::maglev::Algorithm::Random);
    let mk = |spec: &[(&str, u8, bool)]| {
        let mut s = DesiredState::default();
        for (ip, n, rnd) in spec {
            let f = lb_frontend(&mut s, ip, 80, None, &maglev_backends(*n));
            if *rnd {
                s.frontends.get_mut(&f).unwrap().lb_algorithm = random;
            }
        }
        s
    };
    // .6 shares .1's table (one Service port, the same backends), before and after.
    let before = mk(&[
        ("198.51.100.1", 2, false),
        ("198.51.100.2", 1, true),
        ("198.51.100.3", 3, false),
        ("198.51.100.4", 6, false),
        ("198.51.100.6", 2, false),
    ]);
    let after = mk(&[
        ("198.51.100.1", 3, false),
        ("198.51.100.2", 1, false),
        ("198.51.100.3", 3, true),
        ("198.51.100.5", 2, false),
        ("198.51.100.6", 3, false),
    ]);
    let other_seed = crate::maglev::Settings {
        seed: 7,
        ..Default::default()
    };
    for (from, to, settings) in [
        (&before, &after, crate::maglev::Settings::default()),
        (&after, &after, other_seed),
    ] {
        let mut base = ModelStore::default();
        settle(&mut fresh(), &mut base, from);
        let run = |store: &ModelStore| {
            let mut p = recovered(store);
            p.maglev.settings = settings;
            p
        };
        let total = {
            let mut s = base.clone();
            let n0 = s.ops;
            run(&s).apply(&mut s, to);
            s.ops - n0
        };
        assert!(total > 2, "{total}");
        for kill_at in 0..=total {
            let mut store = base.clone();
            store.crash_after = Some(store.ops + kill_at);
            run(&store).apply(&mut store, to);
            store.crash_after = None;
            let mut p = run(&store);
            let r = settle(&mut p, &mut store, to);
            assert!(r.errors.is_empty(), "kill at {kill_at}: {:?}", r.errors);
            let problems = crate::verify::check_with(&store.snapshot().unwrap(), to, &settings);
            assert!(problems.is_empty(), "kill at {kill_at}: {problems:#?}");
            let mut p3 = run(&store);
            assert_eq!(p3.apply(&mut store, to).ops, 0, "kill at {kill_at}");
            // A shared table counted once, held once by each generation that names it.
            let used: std::collections::BTreeMap<u32, u32> = (p3.maglev.live.values())
                .map(|t| (t.start, t.blocks()))
                .collect();
            assert_eq!(
                p3.maglev.regions.free_blocks(),
                p3.maglev.regions.capacity() - used.values().sum::<u32>(),
                "kill at {kill_at}: no region leaked"
            );
            for start in used.keys() {
                let holders = (p3.maglev.live.values()).filter(|t| t.start == *start);
                assert_eq!(
                    p3.maglev.regions.holders(*start) as usize,
                    holders.count(),
                    "kill at {kill_at}: region {start}"
                );
            }
            let f1 = lb_frontend(&mut DesiredState::default(), "198.51.100.1", 80, None, &[]);
            let f6 = lb_frontend(&mut DesiredState::default(), "198.51.100.6", 80, None, &[]);
            assert!(
                p3.frontends[&f1].maglev.is_some(),
                "kill at {kill_at}: .1 has a table"
            );
            assert_eq!(
                p3.frontends[&f1].maglev.map(|t| t.start),
                p3.frontends[&f6].maglev.map(|t| t.start),
                "kill at {kill_at}: .1 and .6 share one table"
            );
        }
    }
}

/// A NodePort and a LoadBalancer IP of Service port ns/lb:80 with `backends` (in this slot
/// order): the port's two external frontends.
fn np_and_lb(s: &mut DesiredState, backends: &[DesiredBackend]) -> (Frontend, Frontend) {
    let lb = lb_frontend(s, "198.51.100.1", 80, None, backends);
    let np = Frontend::node_port(
        "0.0.0.0".parse().unwrap(),
        30080,
        Protocol::Tcp,
        FeScope::External,
    );
    let mut d = DesiredFrontend::cluster_ip(np, "ns/lb:80", backends.to_vec());
    d.kind = Kind::NodePort;
    s.frontends.insert(np, d);
    (np, lb)
}

/// The index entries of `a` and `b`'s current generations, as the store holds them.
fn index_of(store: &ModelStore, f: &Frontend) -> MaglevIndex {
    let v = store.services[&service_key(f)];
    store.maglev_index[&maglev_key(v.id, v.rev)]
}

/// The external frontends of one Service port with the same backends in the same slot order
/// share one table: one region, written once, named by both index entries. A new backend set
/// moves both to one new table, and the old region is free only once both old generations
/// have retired; a frontend that goes leaves the table to the other.
#[test]
fn the_external_frontends_of_a_service_port_share_one_table() {
    let mut want = DesiredState::default();
    let (np, lb) = np_and_lb(&mut want, &maglev_backends(3));
    let mut store = ModelStore::default();
    let mut p = fresh();
    let cap = p.maglev.regions.capacity();
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    exact(&store, &want);
    let tables = |store: &ModelStore| {
        (store.log.iter())
            .filter(|o| matches!(o, Op::PutMaglev(..)))
            .count()
    };
    assert_eq!(tables(&store), 1, "one table written");
    let t1 = p.frontends[&np].maglev.expect("a table");
    assert_eq!(p.frontends[&lb].maglev, Some(t1));
    assert_eq!(index_of(&store, &np), index_of(&store, &lb));
    assert_eq!(p.maglev.regions.holders(t1.start), 2);
    assert_eq!(p.maglev.regions.free_blocks(), cap - t1.blocks());
    assert_eq!(p.maglev.table_bytes(), u64::from(t1.size) * 2);

    // A fourth backend: both frontends switch to one new table, written once, beside the old.
    let mut four = DesiredState::default();
    np_and_lb(&mut four, &maglev_backends(4));
    let n0 = store.log.len();
    let now = Instant::now();
    let r = p.apply_scoped(&mut store, &four, Scope::All, now);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let log = &store.log[n0..];
    let written: Vec<u32> = (log.iter())
        .filter_map(|o| match o {
            Op::PutMaglev(s, _) => Some(*s),
            _ => None,
        })
        .collect();
    let t2 = p.frontends[&np].maglev.expect("a table");
    assert_eq!(written, vec![t2.start], "{log:#?}");
    assert_ne!(t2.start, t1.start);
    assert_eq!(p.frontends[&lb].maglev, Some(t2));
    assert_eq!(index_of(&store, &np), index_of(&store, &lb));
    // Each index entry goes in before the master entry that flags it.
    for f in [np, lb] {
        let v = store.services[&service_key(&f)];
        let index = first_of(
            log,
            |o| matches!(o, Op::PutMaglevIndex(k, _) if *k == maglev_key(v.id, v.rev)),
        );
        let master = first_of(
            log,
            |o| matches!(o, Op::PutService(k, _) if *k == service_key(&f)),
        );
        assert!(index < master, "{log:#?}");
    }
    // The old table, held by both old generations until they retire.
    assert_eq!(p.maglev.regions.holders(t1.start), 2);
    assert_eq!(p.maglev.regions.holders(t2.start), 2);
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(3600));
    assert_eq!(p.maglev.regions.holders(t1.start), 0);
    assert_eq!(p.maglev.regions.free_blocks(), cap - t2.blocks());
    exact(&store, &four);

    // The LoadBalancer IP goes: the NodePort keeps the table.
    let mut only_np = four.clone();
    only_np.frontends.remove(&lb);
    settle(&mut p, &mut store, &only_np);
    assert_eq!(p.frontends[&np].maglev, Some(t2));
    assert_eq!(p.maglev.regions.holders(t2.start), 1);
    assert_eq!(p.maglev.regions.free_blocks(), cap - t2.blocks());
    exact(&store, &only_np);

    // It comes back: it shares the NodePort's current table, nothing written in SVC_MAGLEV.
    let n0 = store.log.len();
    settle(&mut p, &mut store, &four);
    assert!(
        !store.log[n0..]
            .iter()
            .any(|o| matches!(o, Op::PutMaglev(..))),
        "{:#?}",
        &store.log[n0..]
    );
    assert_eq!(p.frontends[&lb].maglev, Some(t2));
    assert_eq!(p.maglev.regions.holders(t2.start), 2);
    exact(&store, &four);

    settle(&mut p, &mut store, &DesiredState::default());
    assert!(store.maglev_index.is_empty());
    assert_eq!(p.maglev.regions.free_blocks(), cap);
    assert_eq!(p.maglev.regions.used_regions(), 0);
}

/// A table is shared only by frontends whose slots hold the same backends in the same order
/// (its entries are slot numbers): the same backends in another order get a table of their
/// own, each right for its own slots.
#[test]
fn a_table_is_not_shared_by_slots_in_another_order() {
    let mut want = DesiredState::default();
    let (np, lb) = np_and_lb(&mut want, &maglev_backends(3));
    let mut reversed = maglev_backends(3);
    reversed.reverse();
    want.frontends.get_mut(&lb).unwrap().backends = reversed;
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    let (a, b) = (
        p.frontends[&np].maglev.unwrap(),
        p.frontends[&lb].maglev.unwrap(),
    );
    assert_ne!(a.start, b.start);
    assert_eq!(
        (
            p.maglev.regions.holders(a.start),
            p.maglev.regions.holders(b.start)
        ),
        (1, 1)
    );
    // The check builds each frontend's table from its own slots and compares.
    exact(&store, &want);
}

/// A restarted agent finds a region named by two index entries and adopts it as shared (two
/// holders), writes nothing, and frees it once, when both generations have retired.
#[test]
fn a_restarted_agent_adopts_a_shared_table_once() {
    let mut want = DesiredState::default();
    let (np, lb) = np_and_lb(&mut want, &maglev_backends(3));
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    let t = p.frontends[&np].maglev.unwrap();
    let mut again = restarted(&mut p, &store);
    assert_eq!(again.maglev.regions, p.maglev.regions);
    assert_eq!(again.maglev.regions.holders(t.start), 2);
    assert_eq!(again.frontends[&lb].maglev, Some(t));
    assert!(again.strays.is_empty(), "{:?}", again.strays);
    assert_eq!(again.apply(&mut store, &want).ops, 0);

    // A new backend set after the restart: the old region goes once, after both retire.
    let mut four = DesiredState::default();
    np_and_lb(&mut four, &maglev_backends(4));
    settle(&mut again, &mut store, &four);
    let t2 = again.frontends[&np].maglev.unwrap();
    assert_eq!(again.maglev.regions.holders(t.start), 0);
    assert_eq!(again.maglev.regions.holders(t2.start), 2);
    assert_eq!(
        again.maglev.regions.free_blocks(),
        again.maglev.regions.capacity() - t2.blocks()
    );
    exact(&store, &four);

    // Restarted within the grace period of a switch: the retiring generations hold the old
    // region (twice), the current ones the new.
    let now = Instant::now();
    again.apply_scoped(&mut store, &want, Scope::All, now);
    let t3 = again.frontends[&np].maglev.unwrap();
    let mut third = restarted(&mut again, &store);
    assert_eq!(third.maglev.regions, again.maglev.regions);
    assert_eq!(third.maglev.regions.holders(t2.start), 2);
    assert_eq!(third.maglev.regions.holders(t3.start), 2);
    store.forget_readers();
    third.retire_due(&mut store, now + Duration::from_secs(3600));
    assert_eq!(third.maglev.regions.holders(t2.start), 0);
    assert_eq!(
        third.maglev.regions.free_blocks(),
        third.maglev.regions.capacity() - t3.blocks()
    );
    exact(&store, &want);
}

/// A region that two index entries name, but whose generations' slots differ (no agent
/// shares such a table; a damaged map could), is adopted for the first only: the other's
/// table is written again, in a region of its own.
#[test]
fn a_region_named_for_other_slots_is_not_adopted_twice() {
    let mut want = DesiredState::default();
    let (np, lb) = np_and_lb(&mut want, &maglev_backends(3));
    let mut reversed = maglev_backends(3);
    reversed.reverse();
    want.frontends.get_mut(&lb).unwrap().backends = reversed;
    let mut store = ModelStore::default();
    let mut p = fresh();
    settle(&mut p, &mut store, &want);
    // The LoadBalancer IP's index entry now names the NodePort's table.
    let v = store.services[&service_key(&lb)];
    let np_index = index_of(&store, &np);
    store.maglev_index.insert(maglev_key(v.id, v.rev), np_index);
    store
        .index_tables
        .insert(maglev_key(v.id, v.rev), store.table_at(&np_index));
    let mut again = restarted(&mut p, &store);
    let adopted = [np, lb].map(|f| again.frontends[&f].maglev);
    assert_eq!(
        adopted.iter().filter(|t| t.is_some()).count(),
        1,
        "{adopted:?}"
    );
    // Held by the adopted entry and by the other, now a leftover retired with its hold.
    assert_eq!(
        again
            .maglev
            .regions
            .holders(np_index.offset / svc_common::MAGLEV_BLOCK),
        2
    );
    settle(&mut again, &mut store, &want);
    let (a, b) = (
        again.frontends[&np].maglev.unwrap(),
        again.frontends[&lb].maglev.unwrap(),
    );
    assert_ne!(a.start, b.start);
    let problems = crate::verify::check(&store.snapshot().unwrap(), &want);
    assert!(problems.is_empty(), "{problems:#?}");
    let mut third = restarted(&mut again, &store);
    assert_eq!(third.apply(&mut store, &want).ops, 0);
}

/// What the tables of 10,000 LoadBalancer Services of 10 backends take, each with a NodePort
/// and a LoadBalancer IP (one family): the first sync's plan, with the default
/// `--max-maglev-entries` (docs/design/maglev.md, Memory). A measurement, not a check: run
/// with `-- --ignored --nocapture`. "One table per frontend" is what the same plan's index
/// entries would take if each had its own region (the agent before sharing).
#[test]
#[ignore]
fn table_memory_at_10000_lb_services_of_10() {
    let mut want = DesiredState::default();
    for i in 0..10_000u32 {
        let backends: Vec<DesiredBackend> = (0..10u32)
            .map(|b| {
                let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i * 16 + b);
                format!("{ip}:8080").parse().unwrap()
            })
            .collect();
        let service = format!("ns/lb-{i}");
        let port_name = format!("{service}:80");
        let lb = Frontend {
            scope: FeScope::External,
            ..Frontend::cluster(
                std::net::Ipv4Addr::from(0xc633_0000 + i).into(),
                80,
                Protocol::Tcp,
            )
        };
        let np = Frontend::node_port(
            "0.0.0.0".parse().unwrap(),
            20_000 + i as u16,
            Protocol::Tcp,
            FeScope::External,
        );
        for (f, kind) in [(lb, Kind::LoadBalancer), (np, Kind::NodePort)] {
            let mut d = DesiredFrontend::cluster_ip(f, &port_name, backends.clone());
            d.kind = kind;
            want.frontends.insert(f, d);
        }
    }
    // `--max-maglev-entries`' default, 16,777,216 entries; room for the other maps' entries.
    let capacity = Capacity {
        maglev: 16_777_216 / (svc_common::MAGLEV_BLOCK * svc_common::MAGLEV_PAGE),
        services: 1 << 16,
        slots: 1 << 18,
        backends: 1 << 18,
        rev_nat: 1 << 16,
        names: 1 << 16,
        ..Capacity::default()
    };
    let p = Programmed::empty(capacity, Duration::from_secs(1));
    let t0 = Instant::now();
    let plan = p.plan(&want, Scope::All);
    let took = t0.elapsed();
    let units: Vec<&plan::UnitPlan> = (plan.services.iter())
        .filter_map(|s| s.plan.as_deref()?.as_ref().ok())
        .collect();
    let entries: Vec<&(SlotKey, TableRef, plan::Region)> =
        units.iter().flat_map(|u| &u.tables).collect();
    let new: Vec<&TableRef> = (entries.iter())
        .filter(|(_, _, r)| *r == plan::Region::New)
        .map(|(_, t, _)| t)
        .collect();
    let roomless: usize = units.iter().map(|u| u.roomless.len()).sum();
    let bytes = |ts: &mut dyn Iterator<Item = &TableRef>| -> u64 {
        ts.map(|t| u64::from(t.blocks()) * 8).sum()
    };
    let shared_bytes = bytes(&mut new.iter().copied());
    let own_bytes = bytes(&mut entries.iter().map(|(_, t, _)| t));
    let capacity = u64::from(p.capacity.maglev_blocks()) * 8;
    eprintln!(
        "10,000 Services x (NodePort + LB IP) x 10 backends: {} index entries, {} tables, \
         {:.1} MB shared against {:.1} MB one table per frontend; array {:.1} MB; \
         {roomless} frontends without room; planned in {took:?}",
        entries.len(),
        new.len(),
        shared_bytes as f64 / 1e6,
        own_bytes as f64 / 1e6,
        capacity as f64 / 1e6,
    );
    assert_eq!((entries.len(), new.len(), roomless), (20_000, 10_000, 0));
    assert!(own_bytes > capacity, "one table per frontend would not fit");
}

/// A first sync of many Services (an outline) writes them in chunks, batched: a chunk's new
/// backends and the entries its master entries lead to (`Store::apply_batches`), then its
/// master entries (`Store::apply_batch`).
mod batched {
    use super::*;

    /// `n` ClusterIP Services of port 80, Service `i` with the backends `backends(i)`.
    fn many(n: usize, backends: impl Fn(usize) -> Vec<String>) -> (Vec<Frontend>, DesiredState) {
        let owned: Vec<(Frontend, Vec<String>)> = (0..n)
            .map(|i| {
                let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
                (fe(&ip, 80), backends(i))
            })
            .collect();
        let entries: Vec<(Frontend, Vec<&str>)> = owned
            .iter()
            .map(|(f, b)| (*f, b.iter().map(String::as_str).collect()))
            .collect();
        let entries: Vec<(Frontend, &[&str])> =
            entries.iter().map(|(f, b)| (*f, b.as_slice())).collect();
        (owned.iter().map(|(f, _)| *f).collect(), state(&entries))
    }

    /// Every Service written alone, one write per call: the whole plan, executed.
    fn alone(store: &mut ModelStore, desired: &DesiredState) -> (Programmed, SyncReport) {
        let mut p = fresh();
        let plan = p.plan(desired, Scope::All);
        assert!(!plan.outline);
        let r = p.execute_plan(store, desired, plan, Instant::now());
        (p, r)
    }

    fn counts(s: &ModelStore) -> [usize; 6] {
        [
            s.services.len(),
            s.slots.len(),
            s.backends.len(),
            s.rev_nat.len(),
            s.names.len(),
            s.matches.len(),
        ]
    }

    fn wanted(desired: &DesiredState, f: &Frontend) -> Vec<SocketAddr> {
        desired.frontends[f]
            .backends
            .iter()
            .map(|b| b.addr())
            .collect()
    }

    /// A Service that goes alone in a batched first sync while a chunk waits (its programmed
    /// external frontend's mark cannot be written, so it is retried) is given no id a waiting
    /// Service of the chunk holds: its frontend reaches its own backends, once the mark lands.
    #[test]
    fn a_service_written_alone_while_a_chunk_waits_takes_no_id_of_it() {
        let node_ip = "192.168.1.10";
        let key = addr16(node_ip.parse().unwrap());
        let node = |want: &mut DesiredState| {
            want.node.addrs.insert(
                node_ip.parse().unwrap(),
                NodeAddrValue {
                    flags: node_addr_flags::NODEPORT,
                    ifindex: 2,
                },
            );
        };
        let backend = |a: &str| DesiredBackend::new(a.parse().unwrap(), false);
        let mut before = DesiredState::default();
        node(&mut before);
        lb_frontend(&mut before, node_ip, 443, None, &[backend("10.0.0.1:8080")]);
        let mut store = ModelStore::default();
        let r = settle(&mut fresh(), &mut store, &before);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        // Pins of an agent older than the mark: the address without it, and its write refused.
        store.unchecked = true;
        store.node_addrs.get_mut(&key).unwrap().flags = node_addr_flags::NODEPORT;
        store.fail_node_addr_puts = true;

        // Many new Services, whose owners come before ns/lb's: a chunk of them waits when
        // ns/lb, given a second backend, is written alone.
        let n = super::super::plan::OUTLINE_ABOVE + super::super::execute::CHUNK / 2;
        let (_, mut want) = many(n, |i| {
            vec![format!("10.2.{}.{}:8080", i / 250, i % 250 + 1)]
        });
        node(&mut want);
        lb_frontend(
            &mut want,
            node_ip,
            443,
            None,
            &[backend("10.0.0.1:8080"), backend("10.0.0.2:8080")],
        );
        let mut p = recovered(&store);
        let r = p.apply(&mut store, &want);
        assert!(r.failed.contains_key("ns/lb"), "{:?}", r.failed);
        store.forget_readers();
        p.retire_due(&mut store, Instant::now() + Duration::from_secs(3600));

        store.fail_node_addr_puts = false;
        let r = settle(&mut p, &mut store, &want);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        exact(&store, &want);
    }

    /// 1 to 10 endpoints each, many shared between Services: the batched sync leaves exactly
    /// the maps the Services written alone leave (same ids, same entries), in a few calls.
    #[test]
    fn a_batched_first_sync_writes_what_services_written_alone_write() {
        a_batched_first_sync(false);
    }

    /// The same with each chunk's backends written beside its other entries (after them,
    /// here): no reader meets a master entry before what it leads to either way.
    #[test]
    fn a_batched_first_sync_with_backends_beside_writes_the_same() {
        a_batched_first_sync(true);
    }

    fn a_batched_first_sync(at_once: bool) {
        let n = 1500;
        let (_, desired) = many(n, |i| {
            (0..=i % 10)
                .map(|k| format!("10.1.{}.{}:8080", (i * 7 + k) % 250, k + 1))
                .collect()
        });
        let mut batched = ModelStore {
            at_once,
            ..Default::default()
        };
        let mut p = fresh();
        let r = p.apply(&mut batched, &desired);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(r.frontends_written, n);
        let (mut by_one, mut q) = (ModelStore::default(), fresh());
        let plan = q.plan(&desired, Scope::All);
        let r1 = q.execute_plan(&mut by_one, &desired, plan, Instant::now());
        assert!(r1.errors.is_empty(), "{:?}", r1.errors);
        let tally = |s: &ModelStore| {
            let mut t: BTreeMap<&str, usize> = BTreeMap::new();
            for op in &s.log {
                *t.entry(op.map()).or_default() += 1;
            }
            t
        };
        assert_eq!(tally(&batched), tally(&by_one));
        assert_eq!(r.ops, r1.ops, "the same writes");
        assert_eq!(batched.services, by_one.services);
        assert_eq!(batched.slots, by_one.slots);
        assert_eq!(batched.backends, by_one.backends);
        assert_eq!(batched.rev_nat, by_one.rev_nat);
        assert_eq!(batched.names, by_one.names);
        assert_eq!(batched.matches, by_one.matches);
        assert_eq!(batched.meta, by_one.meta);
        exact(&batched, &desired);
        // Three batches per chunk.
        let chunk = super::super::execute::CHUNK;
        assert_eq!(
            batched.batches,
            3 * n.div_ceil(chunk),
            "{}",
            batched.batches
        );
        assert_eq!(by_one.batches, 0);
        // Its master entries after everything they lead to, chunk by chunk: in the log, each
        // chunk's first master entry comes after its last slot.
        let kinds: Vec<&str> = batched.log.iter().map(Op::map).collect();
        let first_master = kinds
            .iter()
            .position(|m| *m == svc_common::map_names::SERVICES);
        let slots_before: usize = kinds[..first_master.unwrap()]
            .iter()
            .filter(|m| **m == svc_common::map_names::SLOTS)
            .count();
        let mut owners: Vec<(String, usize)> = (desired.frontends.values())
            .map(|d| (d.owner().to_string(), d.backends.len()))
            .collect();
        owners.sort();
        let chunk_slots: usize = owners[..chunk]
            .iter()
            .map(|(_, n)| n.div_ceil(svc_common::SLOT_GROUP as usize))
            .sum();
        assert_eq!(slots_before, chunk_slots);
        // Nothing more to write afterwards.
        assert!(p.plan(&desired, Scope::All).is_empty());
        let r = p.apply(&mut batched, &desired);
        assert_eq!(r.ops, 0);
    }

    /// Whatever write the agent dies after during a batched first sync, no reader meets a
    /// master entry before what it leads to (the store checks after every write), and the next
    /// agent's sync ends exactly at the desired state.
    #[test]
    fn a_crash_during_a_batched_first_sync_is_repaired_by_the_next_agent() {
        let (_, desired) = many(1100, |i| {
            vec![
                format!("10.1.{}.{}:8080", i / 250, i % 250 + 1),
                "10.0.0.1:8080".to_string(),
            ]
        });
        let total = {
            let mut s = ModelStore::default();
            fresh().apply(&mut s, &desired);
            s.ops
        };
        let mut kills: Vec<usize> = (0..=total).step_by(total / 15).collect();
        // Around the first chunk's master entries (after META, its new backends and four
        // entries per Service), and the last write.
        let chunk = super::super::execute::CHUNK;
        let first_master = 1 + (chunk + 1) + chunk * 4;
        kills.extend([first_master - 1, first_master, first_master + 1, total - 1]);
        // Also with each chunk's backends written beside (here: after) its other entries.
        for (kill_at, at_once) in kills.iter().flat_map(|&k| [(k, false), (k, true)]) {
            let mut store = ModelStore {
                crash_after: Some(kill_at),
                at_once,
                ..Default::default()
            };
            fresh().apply(&mut store, &desired);
            store.crash_after = None;
            let mut p = recovered(&store);
            let r = settle(&mut p, &mut store, &desired);
            assert!(
                r.errors.is_empty(),
                "kill at {kill_at} (at once: {at_once}): {:?}",
                r.errors
            );
            exact(&store, &desired);
        }
    }

    /// A backend the map refuses, in the middle of a chunk's batch of backends: its Service
    /// alone fails, with its own error; every other Service of the sync is programmed, and
    /// the maps hold what writing each Service alone holds.
    #[test]
    fn a_backend_refused_in_a_batch_fails_its_service_alone() {
        a_backend_refused_in_a_batch(false);
    }

    /// The same when the chunk's other entries were written beside its backends (before
    /// them, here): the refused backend's chunk undoes what it prepared, and each of its
    /// Services is written alone.
    #[test]
    fn a_backend_refused_beside_the_rest_fails_its_service_alone() {
        a_backend_refused_in_a_batch(true);
    }

    fn a_backend_refused_in_a_batch(at_once: bool) {
        let n = 1500;
        let (fes, desired) = many(n, |i| {
            vec![
                format!("10.1.{}.{}:8080", i / 250, i % 250 + 1),
                format!("10.2.{}.{}:8080", i / 250, i % 250 + 1),
            ]
        });
        let bad = 750;
        let refused = addr16(desired.frontends[&fes[bad]].backends[1].addr().ip());
        let mut batched = ModelStore {
            refuse_backend: Some(refused),
            at_once,
            ..Default::default()
        };
        let mut p = fresh();
        let r = p.apply(&mut batched, &desired);
        let owner = owner_for(&fes[bad]);
        assert_eq!(r.failed.keys().collect::<Vec<_>>(), vec![&owner]);
        assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
        assert!(r.errors[0].to_string().contains(&owner), "{}", r.errors[0]);
        assert_eq!(r.frontends_written, n - 1);
        let mut by_one = ModelStore {
            refuse_backend: Some(refused),
            ..Default::default()
        };
        let (mut q, r1) = alone(&mut by_one, &desired);
        assert_eq!(r1.failed, r.failed);
        for (i, f) in fes.iter().enumerate() {
            let want = (i != bad).then(|| wanted(&desired, f));
            assert_eq!(batched.resolve(f), want, "{f}");
            assert_eq!(by_one.resolve(f), want, "{f}");
        }
        // Once the grace period has passed, no entry more than writing alone leaves.
        let later = Instant::now() + Duration::from_secs(3600);
        batched.forget_readers();
        p.retire_due(&mut batched, later);
        by_one.forget_readers();
        q.retire_due(&mut by_one, later);
        assert_eq!(counts(&batched), counts(&by_one));
        // The map takes it again: the next sync programs it.
        batched.refuse_backend = None;
        let r = settle(&mut p, &mut batched, &desired);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        exact(&batched, &desired);
    }

    /// A services map fuller than the agent counts (E2BIG in the middle of a chunk's batch of
    /// master entries): the Services that do not fit fail one by one with the map named,
    /// exactly those that fail when each Service is written alone, and the others are
    /// programmed.
    #[test]
    fn a_full_services_map_in_a_batch_refuses_what_writing_alone_refuses() {
        let n = 1500;
        let (fes, desired) = many(n, |i| {
            vec![format!("10.1.{}.{}:8080", i / 250, i % 250 + 1)]
        });
        let cap = 1250;
        let mut batched = ModelStore {
            services_cap: Some(cap),
            ..Default::default()
        };
        let mut p = fresh();
        let r = p.apply(&mut batched, &desired);
        let mut by_one = ModelStore {
            services_cap: Some(cap),
            ..Default::default()
        };
        let (mut q, r1) = alone(&mut by_one, &desired);
        assert_eq!(r.failed.len(), n - cap);
        assert_eq!(r.failed, r1.failed);
        let said = |r: &SyncReport| {
            let mut e: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
            e.sort();
            e
        };
        assert_eq!(said(&r), said(&r1));
        let services = said(&r)
            .into_iter()
            .filter(|e| e.contains("SVC_SERVICES") && e.contains("Service default/"))
            .count();
        assert_eq!(services, n - cap);
        for f in &fes {
            assert_eq!(batched.resolve(f), by_one.resolve(f), "{f}");
        }
        assert_eq!(
            fes.iter().filter(|f| batched.resolve(f).is_some()).count(),
            cap
        );
        let later = Instant::now() + Duration::from_secs(3600);
        batched.forget_readers();
        p.retire_due(&mut batched, later);
        by_one.forget_readers();
        q.retire_due(&mut by_one, later);
        assert_eq!(counts(&batched), counts(&by_one));
    }
}

/// The drift check's digests of `store` as a reader finds it and of `p`'s mirror, and the
/// small maps that differ: what `Agent::finish_check` compares.
fn drift_digests(
    p: &Programmed,
    store: &ModelStore,
) -> (Digest, Result<(Digest, Dirty), Unsure>, Vec<&'static str>) {
    let h = Seeded::default();
    let snap = store.snapshot().unwrap();
    let small = p.small_maps_differ(
        Some(snap.meta),
        Some(snap.config),
        Some(snap.ranges.clone()),
    );
    (Digest::of_snapshot(&snap, &h), p.digest(&h), small)
}

/// The maps whose sums differ outside the shards left out (the retiring entries' and
/// `written`), as `Agent::finish_check` finds them.
fn drift_differ(
    read: &Digest,
    mirror: Result<(Digest, Dirty), Unsure>,
    written: &Dirty,
) -> Vec<&'static str> {
    let (want, mut dirty) = mirror.unwrap();
    dirty.union(written);
    read.differ(&want, &dirty)
}

/// What a rich state (markers, affinity with membership entries, a LoadBalancer frontend with
/// source ranges and a Maglev table, node addresses, the datapath's settings) sums to is
/// what its mirror sums to: after a first sync, a change, a restart's recovery; while
/// retirements are pending the mirror declines. Each kind of entry changed by someone else
/// makes the digests differ in that map.
#[test]
fn the_drift_digest_of_the_maps_is_the_mirrors_until_someone_else_writes() {
    let mut want = DesiredState::default();
    let a = fe("10.96.0.10", 80);
    frontend(
        &mut want,
        a,
        &["10.0.0.1:8080", "10.0.0.2:8080"],
        Some(10800),
    );
    let b = fe("10.96.0.11", 53);
    frontend(&mut want, b, &["10.0.0.3:53"], None);
    let lb = lb_frontend(
        &mut want,
        "198.51.100.1",
        443,
        Some(&["10.0.0.0/8", "192.0.2.0/24"]),
        &maglev_backends(3),
    );
    with_node(&mut want, "192.168.1.10".parse().unwrap());
    let mut store = ModelStore::default();
    let mut p = fresh();
    let r = settle(&mut p, &mut store, &want);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(p.frontends[&lb].maglev.is_some());
    assert!(!p.frontends[&a].matches.is_empty());
    let same = |p: &Programmed, store: &ModelStore| {
        let (read, mirror, small) = drift_digests(p, store);
        let (want, retiring) = mirror.unwrap();
        assert_eq!(retiring, Dirty::default(), "nothing retiring");
        assert_eq!(read, want);
        assert!(small.is_empty(), "{small:?}");
    };
    same(&p, &store);
    let empty = Digest::default();
    assert_eq!(
        empty.differ(
            &Digest::of_snapshot(&store.snapshot().unwrap(), &Seeded::default()),
            &Dirty::default()
        ),
        crate::reconcile::DIGEST_MAPS.to_vec(),
        "every map summed"
    );

    // A change: a new generation, the old one retiring.
    frontend(
        &mut want,
        a,
        &["10.0.0.1:8080", "10.0.0.4:8080"],
        Some(10800),
    );
    // The thread reads before the change; the loop writes it (marking the shards it writes)
    // and the old generation is retiring when the loop compares: equal outside those shards,
    // and different inside them.
    let h = Seeded::default();
    let before = Digest::of_snapshot(&store.snapshot().unwrap(), &h);
    let now = Instant::now();
    let n0 = store.log.len();
    p.apply_scoped(&mut store, &want, Scope::All, now);
    let mut written = Dirty::default();
    store.log[n0..].iter().for_each(|op| written.mark_op(op));
    assert!(written.count() > 0);
    let (want_now, retiring) = p.digest(&h).unwrap();
    assert!(
        retiring.count() > 0,
        "the old generation's slots are retiring"
    );
    assert_ne!(before, want_now);
    assert_eq!(
        drift_differ(&before, Ok((want_now.clone(), retiring.clone())), &written),
        Vec::<&str>::new()
    );
    let after = Digest::of_snapshot(&store.snapshot().unwrap(), &h);
    assert_eq!(
        drift_differ(
            &after,
            Ok((want_now.clone(), retiring.clone())),
            &Dirty::default()
        ),
        Vec::<&str>::new()
    );
    assert!(!before.differ(&want_now, &Dirty::default()).is_empty());
    store.forget_readers();
    p.retire_due(&mut store, now + Duration::from_secs(3600));
    same(&p, &store);
    let mut p = restarted(&mut p, &store);
    same(&p, &store);
    settle(&mut p, &mut store, &want);
    same(&p, &store);

    let id_a = p.frontends[&a].id;
    let id_lb = p.frontends[&lb].id;
    type Tamper<'a> = Box<dyn Fn(&mut ModelStore) + 'a>;
    let tampered: Vec<(&str, Tamper)> = vec![
        (
            svc_common::map_names::SERVICES,
            Box::new(|s| {
                s.services
                    .get_mut(&service_key(&b))
                    .unwrap()
                    .affinity_timeout_s = 7;
            }),
        ),
        (
            svc_common::map_names::SERVICES,
            Box::new(|s| {
                s.services.remove(&marker_key(b.ip));
            }),
        ),
        (
            svc_common::map_names::SLOTS,
            Box::new(move |s| {
                for g in s.slots.iter_mut().filter(|(k, _)| k.id == id_a) {
                    g.1.backends[1] = 0;
                }
            }),
        ),
        (
            // A backend past the generation's last slot.
            svc_common::map_names::SLOTS,
            Box::new(move |s| {
                for g in s.slots.iter_mut().filter(|(k, _)| k.id == id_a) {
                    g.1.backends[7] = g.1.backends[0];
                }
            }),
        ),
        (
            svc_common::map_names::BACKENDS,
            Box::new(|s| {
                let v = s.backends.values_mut().next().unwrap();
                v.port_be = 1u16.to_be();
            }),
        ),
        (
            svc_common::map_names::BACKENDS,
            Box::new(|s| {
                s.backends.insert(
                    999_999,
                    plan::backend_value(999_999, "10.9.9.9:1".parse().unwrap(), Protocol::Tcp),
                );
            }),
        ),
        (
            svc_common::map_names::REV_NAT,
            Box::new(move |s| {
                s.rev_nat.get_mut(&id_a).unwrap().port_be = 1;
            }),
        ),
        (
            svc_common::map_names::NAMES,
            Box::new(move |s| {
                *s.names.get_mut(&id_a).unwrap() = encode_name("ns/other:80");
            }),
        ),
        (
            svc_common::map_names::AFFINITY_MATCH,
            Box::new(move |s| {
                s.matches.retain(|k| k.id != id_a);
            }),
        ),
        (
            svc_common::map_names::NODE_ADDRS,
            Box::new(|s| {
                s.node_addrs.insert([7; 16], NodeAddrValue::default());
            }),
        ),
        (
            svc_common::map_names::MAGLEV_INDEX,
            Box::new(move |s| {
                let v = s
                    .maglev_index
                    .iter_mut()
                    .find(|(k, _)| k.id == id_lb)
                    .unwrap()
                    .1;
                v.seed[0] ^= 1;
            }),
        ),
        (
            svc_common::map_names::META,
            Box::new(|s| s.meta.frontend_id_hwm -= 1),
        ),
        (
            svc_common::map_names::CONFIG,
            Box::new(|s| s.config.snat_port_min += 1),
        ),
        (
            svc_common::map_names::SRC_RANGES,
            Box::new(move |s| {
                s.ranges.insert(range_key(id_lb, &cidr("0.0.0.0/0")));
            }),
        ),
    ];
    // The maps that differ once `tamper` has changed a copy of the maps.
    let differ_after = |tamper: &Tamper| {
        let mut s = store.clone();
        s.unchecked = true;
        tamper(&mut s);
        let (read, mirror, small) = drift_digests(&p, &s);
        let mut differ = drift_differ(&read, mirror, &Dirty::default());
        differ.extend(small);
        differ
    };
    for (map, tamper) in &tampered {
        assert_eq!(differ_after(tamper), vec![*map]);
    }
    // What recovery does not read, the full check cannot repair: no difference.
    let unread: Vec<Tamper> = vec![
        Box::new(|s| s.services.get_mut(&service_key(&b)).unwrap()._pad0 = 9),
        Box::new(|s| s.services.get_mut(&marker_key(b.ip)).unwrap().id = 9),
        Box::new(|s| s.backends.values_mut().next().unwrap().flags |= 0x80),
        Box::new(move |s| s.names.get_mut(&id_a).unwrap().name[150] = b'x'),
        Box::new(|s| s.meta._reserved[0] = 1),
    ];
    for tamper in &unread {
        assert_eq!(differ_after(tamper), Vec::<&str>::new());
    }

    // The LoadBalancer frontend removed: its source ranges retire with the rest, and are no
    // difference for their grace period.
    let mut gone = want.clone();
    gone.frontends.remove(&lb);
    p.apply_scoped(&mut store, &gone, Scope::All, Instant::now());
    let (read, mirror, small) = drift_digests(&p, &store);
    assert!(
        !store.ranges.is_empty(),
        "still in the map for the grace period"
    );
    assert_eq!(small, Vec::<&str>::new());
    assert_eq!(
        drift_differ(&read, mirror, &Dirty::default()),
        Vec::<&str>::new()
    );

    // A backend a failed retirement left in the mirror (and the maps): only the full check's
    // recovery retires it, so the mirror sends the check there.
    let key = BackendKey::new("10.9.9.9:1".parse().unwrap(), Protocol::Tcp);
    p.backends.add(999_999, key);
    assert_eq!(p.digest(&Seeded::default()), Err(Unsure::Pending));
}
