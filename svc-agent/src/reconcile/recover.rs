//! Rebuilding the mirror from the maps: after a restart (whatever a previous agent left, in
//! whatever state it died) and for drift checks.

use std::net::SocketAddr;
use std::time::Duration;

use svc_common::{svc_flags, BackendId, SlotGroup, SlotKey, PROTO_ANY, SLOT_GROUP};
use tracing::warn;

use super::{
    decode_name, ip_from16, maglev_key, plan::rev_nat_value, range_of, BackendKey, Entry, HashMap,
    HashSet, ProgFrontend, Programmed, Retiring, TableRef, Usage,
};
use crate::model::{Backend, Cidr, Frontend, Protocol, Scope};
use crate::store::{Capacity, Snapshot};

impl Programmed {
    /// The mirror of what `store` holds now, as a new agent finds it (nothing of its own
    /// retiring yet).
    pub fn adopt(
        store: &impl crate::store::Store,
        capacity: Capacity,
        grace: Duration,
    ) -> crate::error::Result<Programmed> {
        Ok(Programmed::recover(
            &store.snapshot()?,
            capacity,
            grace,
            Retiring::default(),
        ))
    }

    /// Rebuilds the mirror from `snap`. `retiring` is what this agent is itself retiring
    /// (nothing after a restart): those entries are not leftovers. Everything else that no
    /// master entry leads to becomes a stray, deleted before the next sync writes anything.
    pub fn recover(
        snap: &Snapshot,
        capacity: Capacity,
        grace: Duration,
        retiring: Retiring,
    ) -> Programmed {
        let mut p = Programmed::empty(capacity, grace);
        p.retiring = retiring;
        p.usage = Usage {
            services: snap.services.len() as u64,
            slots: snap.slots.len() as u64,
            backends: snap.backends.len() as u64,
            rev_nat: snap.rev_nat.len() as u64,
            names: snap.names.len() as u64,
            matches: snap.matches.len() as u64,
            ranges: snap.ranges.len() as u64,
            node_addrs: snap.node_addrs.len() as u64,
        };
        p.node_addrs = snap.node_addrs.iter().copied().collect();
        p.config = Some(snap.config);

        // Ids: above anything any map still carries, and above what was made durable, so a
        // leftover can never be mistaken for a new entry.
        let frontend_max = snap
            .services
            .iter()
            .flat_map(|(_, v)| [v.id, v.affinity_id])
            .chain(snap.slots.iter().map(|(k, _)| k.id))
            .chain(snap.rev_nat.iter().map(|(id, _)| *id))
            .chain(snap.names.iter().map(|(id, _)| *id))
            .chain(snap.matches.iter().map(|k| k.id))
            .chain(snap.ranges.iter().map(|k| u32::from_be(k.id_be)))
            .chain(snap.affinity_ids.iter().map(|(id, _)| *id))
            .chain(snap.maglev_index.iter().map(|(k, _)| k.id))
            .max()
            .unwrap_or(0);
        let backend_max = snap
            .backends
            .iter()
            .map(|(id, _)| *id)
            .chain(snap.slots.iter().flat_map(|(_, g)| g.backends))
            .chain(snap.matches.iter().map(|k| k.backend))
            .chain(snap.affinity_ids.iter().map(|(_, b)| *b))
            .max()
            .unwrap_or(0);
        p.ids.frontend_hwm = snap.meta.frontend_id_hwm;
        p.ids.backend_hwm = snap.meta.backend_id_hwm;
        p.ids.next_frontend = snap
            .meta
            .frontend_id_hwm
            .max(frontend_max.saturating_add(1))
            .max(1);
        p.ids.next_backend = snap
            .meta
            .backend_id_hwm
            .max(backend_max.saturating_add(1))
            .max(1);

        // Sized once: grown entry by entry, each table would hold its old buckets and twice
        // as many new ones at every doubling, a third more at the peak of a large restart.
        p.backends.reserve(snap.backends.len());
        for (id, b) in &snap.backends {
            let Some(proto) = Protocol::from_ipproto(b.proto).filter(|_| *id != 0) else {
                p.strays.backends.push(*id);
                continue;
            };
            let sa = SocketAddr::new(ip_from16(b.addr), u16::from_be(b.port_be));
            let local = b.flags & svc_common::backend_flags::LOCAL != 0;
            p.backends
                .add(*id, BackendKey::new(Backend::new(sa, local), proto));
        }
        // Each slot a master entry reaches is taken out: what is left are leftovers.
        let mut slots: HashMap<SlotKey, SlotGroup> = snap.slots.iter().copied().collect();
        let rev_nat: HashMap<u32, _> = snap.rev_nat.iter().copied().collect();
        let names: HashMap<u32, String> = snap
            .names
            .iter()
            .map(|(id, n)| (*id, decode_name(n)))
            .collect();

        let mut used_ids: HashSet<u32> = HashSet::default();
        used_ids.reserve(snap.services.len());
        for (k, v) in &snap.services {
            let marker_shaped = k.port_be == 0 && k.proto == PROTO_ANY;
            let is_marker = v.flags & svc_flags::ADDR_MARKER != 0;
            if marker_shaped && is_marker {
                p.markers.insert(ip_from16(k.addr));
                continue;
            }
            let protocol = Protocol::from_ipproto(k.proto);
            let scope = Scope::from_value(k.scope);
            let (Some(protocol), Some(scope)) = (protocol, scope) else {
                p.strays.services.push(*k);
                continue;
            };
            if is_marker || v.id == 0 || (marker_shaped && k.scope != 0) {
                p.strays.services.push(*k);
                continue;
            }
            if !used_ids.insert(v.id) {
                // Two frontends under one id would share slots: the second is dropped and,
                // if still desired, written again under an id of its own.
                warn!(id = v.id, "two frontends share one id in the pinned maps");
                p.strays.services.push(*k);
                continue;
            }
            let fe = Frontend {
                ip: ip_from16(k.addr),
                port: u16::from_be(k.port_be),
                protocol,
                scope,
            };
            let mut backends = Vec::with_capacity(v.count as usize);
            let mut left = usize::from(v.count);
            let mut torn = false;
            for sk in super::slot_keys(v.id, v.rev, v.count) {
                let Some(g) = slots.remove(&sk) else {
                    left = left.saturating_sub(SLOT_GROUP as usize);
                    continue;
                };
                let (mine, past) = g.backends.split_at(left.min(SLOT_GROUP as usize));
                left -= mine.len();
                torn |= past.iter().any(|b| *b != 0);
                backends.extend(mine.iter().filter(|b| p.backends.contains(**b)));
            }
            if backends.len() != v.count as usize || torn {
                warn!(frontend = %fe, "slots or backends missing in the pinned maps; will rewrite");
            }
            let rev_nat_entry = match rev_nat.get(&v.id) {
                Some(r) if *r == rev_nat_value(&fe) => Entry::Ok,
                Some(_) => Entry::Wrong,
                None => Entry::Missing,
            };
            let (name, name_entry) = match names.get(&v.id) {
                Some(n) => (n.clone(), Entry::Ok),
                None => (String::new(), Entry::Missing),
            };
            for b in &backends {
                p.backends.add_ref(*b);
            }
            if !p.frontends.contains_key(&fe) {
                super::plan::external_ref(&mut p.external_refs, &fe, true);
            }
            p.frontends.insert(
                fe,
                ProgFrontend {
                    id: v.id,
                    rev: v.rev,
                    count: v.count,
                    flags: v.flags,
                    affinity_timeout_s: v.affinity_timeout_s,
                    affinity_id: v.affinity_id,
                    backends,
                    name,
                    name_entry,
                    rev_nat_entry,
                    matches: Vec::new(),
                    ranges: Box::new([]),
                    maglev: None,
                    torn,
                },
            );
        }

        // Maglev tables: the regions of what this agent is retiring stay held until freed,
        // once for each retirement that names them (a shared table has several);
        // a master entry with the flag adopts its generation's index entry when it names a
        // table of a known size wholly inside the array and clear of the others, or the
        // very table another adopted entry names with the same seed for the same backends
        // in the same slot order (a table the Service's frontends share; then the region has
        // one holder per entry); the flag then moves to `ProgFrontend::maglev`. One that
        // does not keeps the flag in `flags`, so the next sync writes its table and master
        // entry again. Any other index entry is a leftover: retired, with its hold of its
        // region when that region is clear of the others or exactly one of them.
        for t in p.retiring.tables() {
            p.maglev.regions.hold(t.start, t.blocks());
        }
        let index: HashMap<SlotKey, svc_common::MaglevIndex> =
            snap.maglev_index.iter().copied().collect();
        let mut adopted: HashSet<SlotKey> = HashSet::default();
        // Region start -> the table and the backends (slot order) of the first generation
        // adopted with it.
        let mut adopted_at: HashMap<u32, (TableRef, Vec<BackendId>)> = HashMap::default();
        for (fe, pf) in p.frontends.iter_mut() {
            if pf.flags & svc_flags::MAGLEV == 0 {
                continue;
            }
            let key = maglev_key(pf.id, pf.rev);
            let table = (index.get(&key).and_then(TableRef::of)).filter(|t| {
                match adopted_at.get(&t.start) {
                    // Valid for this generation only if built for its slots as they are.
                    Some((first, backends)) => {
                        first == t
                            && pf.complete()
                            && *backends == pf.backends
                            && p.maglev.regions.share(t.start, t.blocks())
                    }
                    None => p.maglev.regions.hold(t.start, t.blocks()),
                }
            });
            let Some(t) = table else {
                warn!(frontend = %fe, "Maglev table missing or unusable in the pinned maps; will rewrite");
                continue;
            };
            pf.flags &= !svc_flags::MAGLEV;
            pf.maglev = Some(t);
            adopted_at
                .entry(t.start)
                .or_insert_with(|| (t, pf.backends.clone()));
            p.maglev.live.insert((pf.id, pf.rev), t);
            adopted.insert(key);
        }
        for (k, v) in &snap.maglev_index {
            if adopted.contains(k) || p.retiring.has_table_key(k) {
                continue;
            }
            let t = TableRef::of(v).filter(|t| p.maglev.regions.hold(t.start, t.blocks()));
            p.strays.maglev.push((*k, t));
        }
        p.strays.maglev.sort_by_key(|(k, _)| *k);
        // Pages a dead agent left with no table in use (it died before deleting them).
        p.maglev.loose.extend(snap.maglev_pages.iter().copied());

        // Each Service port's affinity id, as its master entries carry it. Only frontends whose
        // name is known: a port is its name. Should two of a port's frontends disagree (no
        // sync writes that), the first is kept and the next sync of the other rewrites it.
        let named: Vec<(Protocol, ProgFrontend)> = p
            .frontends
            .iter()
            .filter(|(_, pf)| pf.flags & svc_flags::AFFINITY != 0 && pf.name_entry == Entry::Ok)
            .map(|(fe, pf)| (fe.protocol, pf.clone()))
            .collect();
        for (protocol, pf) in &named {
            p.port_ref(*protocol, pf);
        }

        // Membership entries belong to the frontend of their id, whatever their backend: the
        // next sync of that frontend deletes those of backends it does not have. Those of no
        // frontend are strays (a frontend's ids are never reused).
        if !snap.matches.is_empty() {
            let by_id: HashMap<u32, Frontend> =
                p.frontends.iter().map(|(fe, pf)| (pf.id, *fe)).collect();
            for k in &snap.matches {
                match by_id.get(&k.id).and_then(|fe| p.frontends.get_mut(fe)) {
                    Some(pf) => pf.matches.push(k.backend),
                    None => p.strays.matches.push(*k),
                }
            }
            for pf in p.frontends.values_mut() {
                pf.matches.sort_unstable();
                pf.matches.dedup();
                pf.matches.shrink_to_fit();
            }
        }

        // Source ranges belong to the frontend of their id, as membership entries do.
        if !snap.ranges.is_empty() {
            let by_id: HashMap<u32, Frontend> =
                p.frontends.iter().map(|(fe, pf)| (pf.id, *fe)).collect();
            let mut found: HashMap<Frontend, Vec<Cidr>> = HashMap::default();
            for k in &snap.ranges {
                match range_of(k).and_then(|(id, c)| Some((by_id.get(&id)?, c))) {
                    Some((fe, c)) => found.entry(*fe).or_default().push(c),
                    None => p.strays.ranges.push(*k),
                }
            }
            for (fe, mut ranges) in found {
                ranges.sort();
                ranges.dedup();
                if let Some(pf) = p.frontends.get_mut(&fe) {
                    pf.ranges = ranges.into_boxed_slice();
                }
            }
        }

        // Two ids for one address (a crash between writes): the one slots name is reused (the
        // lower, if both or neither are); the other is retired once nothing names it.
        p.backends.choose_ids();
        p.strays.slots = slots
            .keys()
            .filter(|k| !p.retiring.has_slot_gen(k.id, k.rev))
            .copied()
            .collect();
        let loose = |id: &u32| !used_ids.contains(id) && !p.retiring.has_id(*id);
        p.strays.rev_nat = rev_nat.keys().filter(|id| loose(id)).copied().collect();
        p.strays.names = names.keys().filter(|id| loose(id)).copied().collect();
        let stray_backends: Vec<BackendId> = (p.backends.unreferenced())
            .filter(|id| !p.retiring.has_backend(*id))
            .collect();
        p.strays.backends.extend(stray_backends);
        // Deterministic order for logs and tests.
        p.strays.slots.sort();
        p.strays.rev_nat.sort();
        p.strays.names.sort();
        p.strays.backends.sort();
        p.strays.services.sort();
        p.strays.matches.sort();
        p.strays.ranges.sort();
        p
    }
}
