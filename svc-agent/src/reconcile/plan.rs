//! The planner: what a sync must write, switch and retire, computed from the desired state,
//! the mirror of the maps and the node's view without touching the maps. One [`Plan`] holds
//! a whole sync: leftovers, the node's addresses and settings, the SNAT-range mark, external
//! addresses, each Service's [`UnitPlan`], ClusterIP markers. The executor (`super`) writes
//! it in its order, or undoes a Service's part.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use svc_common::{
    backend_flags, checks_match, node_addr_flags, svc_flags, AffinityMatchKey, Backend, BackendId,
    DatapathConfig, MetaValue, NodeAddrValue, RevNatValue, ServiceValue, SlotKey,
};

use super::addrs::external_addr;
use super::{
    addr16, encode_name, flags_of, maglev_key, range_key, ranges_of, service_key,
    snat_range_frontends, stored_name, BackendKey, Entry, HashMap, HashSet, ProgFrontend,
    Programmed, Retire, Scope, Strays, TableRef, Usage, ID_BLOCK, MAX_BACKENDS_PER_FRONTEND,
};
use crate::error::{Error, Result};
use crate::model::{
    Backend as DesiredBackend, Cidr, DesiredFrontend, DesiredState, Frontend, NodeDesired, Protocol,
};
use crate::store::Op;

/// One Service's changes, in the order that keeps readers safe.
#[derive(Debug, Default)]
pub struct UnitPlan {
    pub owner: String,
    /// Backends no entry has yet: written first.
    pub new_backends: Vec<(BackendId, DesiredBackend, Protocol)>,
    /// Entries no master entry leads to yet (new slots, reverse NAT, names, membership of new
    /// backends), each with what undoes it when the Service's sync fails.
    pub prepare: Vec<(Op, Option<Op>)>,
    /// Master entries of new frontends.
    pub add: Vec<Op>,
    /// Master entries replaced or deleted, each with the write that restores it.
    pub switch: Vec<(Op, Op)>,
    /// What the switch makes unreachable, deleted after the grace period.
    pub retire: Vec<Retire>,
    /// Deleted right after the switch: the membership of backends that left, so no
    /// remembered choice of them is honoured again; source ranges no longer wanted.
    pub after: Vec<Op>,
    /// The mirror after the switch: a frontend's new state, or None once removed.
    pub commit: Vec<(Frontend, Option<ProgFrontend>)>,
    /// Entries the plan adds (new backends not included) and deletes at once.
    pub needs: Usage,
    pub frees: Usage,
    /// The highest ids the plan uses (0: none), to be made durable before the first write.
    pub max_frontend_id: u32,
    pub max_backend_id: u32,
    /// The META write that makes them durable, first, when META does not cover them yet.
    pub meta: Option<MetaValue>,
    /// The Maglev index entries it writes, each with the table it names and whether the
    /// plan writes that table or shares one: their regions are taken (or shared) before the
    /// first write, and given back (or retired) if the Service's sync fails.
    pub tables: Vec<(SlotKey, TableRef, Region)>,
    /// External frontends that want a Maglev table and find no room: programmed without.
    pub roomless: Vec<Frontend>,
    /// Frontends that found no room before and need none now, with nothing to write.
    pub settled: Vec<Frontend>,
}

impl UnitPlan {
    pub fn is_empty(&self) -> bool {
        self.new_backends.is_empty()
            && self.prepare.is_empty()
            && self.add.is_empty()
            && self.switch.is_empty()
            && self.after.is_empty()
            && self.commit.is_empty()
    }

    /// Every op in execution order (switch without its undo), for tests and explanations.
    pub fn ops(&self) -> Vec<Op> {
        (self.meta.iter().map(|m| Op::PutMeta(*m)))
            .chain(
                self.new_backends
                    .iter()
                    .map(|(id, b, p)| Op::PutBackend(*id, backend_value(*id, *b, *p))),
            )
            .chain(self.prepare.iter().map(|(op, _)| op.clone()))
            .chain(self.add.iter().cloned())
            .chain(self.switch.iter().map(|(op, _)| op.clone()))
            .chain(self.after.iter().cloned())
            .collect()
    }
}

/// The `BACKENDS` entry of backend `id`.
pub fn backend_value(id: BackendId, b: DesiredBackend, protocol: Protocol) -> Backend {
    Backend {
        addr: b.addr16(),
        port_be: b.port().to_be(),
        proto: protocol.ipproto(),
        flags: if b.local { backend_flags::LOCAL } else { 0 },
        id,
    }
}

/// What sorted `a` has that sorted `b` has not.
fn ranges_minus<'a>(a: &'a [Cidr], b: &'a [Cidr]) -> impl Iterator<Item = &'a Cidr> {
    a.iter().filter(|x| b.binary_search(x).is_err())
}

fn put_range(id: u32, c: &Cidr) -> (Op, Option<Op>) {
    let k = range_key(id, c);
    (Op::PutRange(k), Some(Op::DelRange(k)))
}

pub fn rev_nat_value(fe: &Frontend) -> RevNatValue {
    let key = service_key(fe);
    RevNatValue {
        addr: key.addr,
        port_be: key.port_be,
        _pad0: 0,
    }
}

/// The backends of a frontend whose remembered choices the kernel checks (see
/// `svc_common::checks_match`), sorted; none for the others.
fn members(fe: &Frontend, flags: u16, backends: &[BackendId]) -> Vec<BackendId> {
    if !checks_match(fe.protocol.ipproto(), flags) {
        return Vec::new();
    }
    let mut m = backends.to_vec();
    m.sort_unstable();
    m.dedup();
    m
}

/// What sorted `a` has that sorted `b` has not.
fn minus<'a>(a: &'a [BackendId], b: &'a [BackendId]) -> impl Iterator<Item = &'a BackendId> {
    a.iter().filter(|x| b.binary_search(x).is_err())
}

fn put_match(id: u32, backend: BackendId) -> (Op, Option<Op>) {
    let k = AffinityMatchKey { id, backend };
    (Op::PutMatch(k), Some(Op::DelMatch(k)))
}

/// The next generation of frontend `id` after `rev` that no retiring generation uses, nor a
/// leftover's (retired before anything is written).
fn next_rev(p: &Programmed, earlier: &Planned, id: u32, rev: u16) -> u16 {
    let mut r = rev.wrapping_add(1);
    while (p.retiring.has_slot_gen(id, r) || earlier.stray_gens.contains(&(id, r))) && r != rev {
        r = r.wrapping_add(1);
    }
    r
}

/// The next id of a kind, never one handed out before. The last id is never handed out, so
/// a counter that reached it (damaged pins carried an id that high) refuses rather than give
/// one id to two frontends or backends, which would then share slots.
fn take_id(next: &mut u32, kind: &str) -> Result<u32> {
    if *next == u32::MAX {
        return Err(Error::map(
            svc_common::map_names::META,
            format!(
                "no {kind} id left (the pinned maps carry ids up to {}); not programmed. \
                 `svc-agent uninstall` and a restart start the ids again",
                u32::MAX
            ),
        ));
    }
    let id = *next;
    *next += 1;
    Ok(id)
}

/// The next backend id whose index of `BACKENDS` (`backend_index`) neither the mirror's
/// entries (`backends`) nor `planned` take: the ids in between are passed over, never handed
/// out. None when every index was tried.
fn take_backend_id(
    next: &mut u32,
    backends: &super::Backends,
    planned: impl Fn(u32) -> bool,
) -> Result<Option<BackendId>> {
    let entries = backends.map_entries();
    let mut tried = 0u32;
    while tried < entries {
        let i = svc_common::backend_index(*next, entries);
        // The mirror's entries take runs of indexes (ids handed out in order), passed over a
        // word of its bitmap at a time.
        let run = backends.taken_run(i);
        if run > 0 {
            *next = next.saturating_add(run);
            tried = tried.saturating_add(run);
            continue;
        }
        let id = take_id(next, "backend")?;
        tried += 1;
        if !planned(i) {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// What the Services planned earlier in the same sync take: the ids they hand out and the
/// backends they write, so a later Service neither takes those ids again nor writes a
/// backend they write.
#[derive(Clone, Debug)]
pub struct Planned {
    pub next_frontend: u32,
    pub next_backend: u32,
    pub backends: HashMap<BackendKey, BackendId>,
    /// The `BACKENDS` indexes of `backends`' ids.
    backend_indexes: HashSet<u32>,
    /// The generations of leftover slots (`Programmed::strays`), retiring by the time a
    /// Service is written.
    stray_gens: HashSet<(u32, u16)>,
    /// The ids META makes durable (frontend, backend) once the plans so far are written.
    hwm: (u32, u32),
    /// The free space of `SVC_MAGLEV` once the tables planned so far are written (None:
    /// the mirror's, no table planned yet).
    regions: Option<crate::maglev::Regions>,
}

impl Planned {
    /// Nothing planned yet: the mirror's counters.
    pub fn new(p: &Programmed) -> Planned {
        Planned {
            next_frontend: p.ids.next_frontend,
            next_backend: p.ids.next_backend,
            backends: HashMap::default(),
            backend_indexes: HashSet::default(),
            stray_gens: p.strays.slots.iter().map(|k| (k.id, k.rev)).collect(),
            hwm: (p.ids.frontend_hwm, p.ids.backend_hwm),
            regions: None,
        }
    }

    fn regions<'a>(&'a mut self, p: &Programmed) -> &'a mut crate::maglev::Regions {
        self.regions.get_or_insert_with(|| p.maglev.regions.clone())
    }
}

/// Where the table of an index entry a plan writes comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// A free region the plan writes the table into.
    New,
    /// A region in use (a current table of another frontend of the Service, or one the plan
    /// writes for an earlier frontend) holding the same table: same seed, same backends in
    /// the same slot order, so the same slot numbers.
    Shared,
}

/// A table a Service's frontends can share: its seed and size, and the backends of the
/// slots it was built from, in slot order.
struct Shareable {
    table: TableRef,
    backends: Vec<BackendId>,
}

/// The table in `shareable` built from `backends` (in slot order) with `seed`.
fn find_shared(shareable: &[Shareable], seed: u64, backends: &[BackendId]) -> Option<TableRef> {
    let size = crate::maglev::table_size(backends.len());
    (shareable.iter())
        .find(|s| s.table.seed == seed && s.table.size == size && s.backends == backends)
        .map(|s| s.table)
}

/// Whether `d` wants a Maglev table: an external frontend with backends whose algorithm
/// (the Service's annotation, else the flag) is Maglev, and an array that can hold one.
pub fn wants_table(p: &Programmed, d: &DesiredFrontend) -> bool {
    d.frontend.scope == crate::model::Scope::External
        && !d.backends.is_empty()
        && p.maglev.settings.external(d.lb_algorithm) == crate::maglev::Algorithm::Maglev
        && p.capacity.maglev_blocks() >= crate::maglev::blocks(crate::maglev::MIN_SIZE)
}

/// Plans the table of `d`, whose slots hold `ids`, under the index entry of `key` (a
/// generation no master entry names with a table yet), in `prepare`. The index entry names
/// a table in `shareable` built from the same backends in the same slot order with the same
/// seed when there is one (that table is valid for `d` as it is: its entries are slot
/// numbers); else the table is built from the backends in slot order, so its entries are
/// 0-based slot numbers, and written into a free region before the index entry, and offered
/// to the Service's later frontends. None when no region is free: the frontend is then
/// programmed without (`UnitPlan::roomless`).
fn plan_table(
    p: &Programmed,
    earlier: &mut Planned,
    plan: &mut UnitPlan,
    shareable: &mut Vec<Shareable>,
    (d, ids): (&DesiredFrontend, &[BackendId]),
    key: SlotKey,
) -> Option<TableRef> {
    let proto = d.frontend.protocol.ipproto();
    let seed = p.maglev.settings.seed;
    if let Some(t) = find_shared(shareable, seed, ids) {
        // Written and never edited where it is; held until this entry's generation retires.
        if earlier.regions(p).share(t.start, t.blocks()) {
            plan.prepare
                .push((Op::PutMaglevIndex(key, t.index()), None));
            plan.tables.push((key, t, Region::Shared));
            return Some(t);
        }
    }
    let size = crate::maglev::table_size(d.backends.len());
    let Some(start) = earlier.regions(p).alloc(crate::maglev::blocks(size)) else {
        plan.roomless.push(d.frontend);
        return None;
    };
    let idents: Vec<crate::maglev::Identity> = (d.backends.iter())
        .map(|b| crate::maglev::Identity::of(b.addr(), proto))
        .collect();
    let table = crate::maglev::build(seed, &idents).ok()?;
    let t = TableRef {
        start,
        size: table.size(),
        seed,
    };
    plan.prepare
        .push((Op::PutMaglev(start, table.to_blocks()), None));
    plan.prepare
        .push((Op::PutMaglevIndex(key, t.index()), None));
    plan.tables.push((key, t, Region::New));
    shareable.push(Shareable {
        table: t,
        backends: ids.to_vec(),
    });
    Some(t)
}

/// Plans Service `owner`: write `upserts`, remove `gone`, after what `earlier` holds (which
/// takes this plan's ids and backends when it succeeds).
pub fn plan_unit(
    p: &Programmed,
    earlier: &mut Planned,
    owner: &str,
    upserts: &[&DesiredFrontend],
    gone: &[Frontend],
) -> Result<UnitPlan> {
    let mut plan = UnitPlan {
        owner: owner.to_string(),
        ..Default::default()
    };
    let mut next_frontend = earlier.next_frontend;
    let mut next_backend = earlier.next_backend;
    let mut planned: HashMap<BackendKey, BackendId> = HashMap::default();
    let mut planned_indexes: HashSet<u32> = HashSet::default();
    let entries = p.backends.map_entries();
    let mut planned_ports: HashMap<(&str, Protocol), u32> = HashMap::default();
    // The Service's current tables, each with the backends of its generation's slots: a
    // frontend whose backends and seed match one shares its region rather than write
    // another copy (its slots must then hold the same backends in the same order, which is
    // what `backends` compares).
    let mut shareable: Vec<Shareable> = (upserts.iter())
        .filter_map(|d| {
            let cur = p.frontends.get(&d.frontend)?;
            let table = cur.maglev.filter(|_| cur.complete())?;
            Some(Shareable {
                table,
                backends: cur.backends.clone(),
            })
        })
        .collect();

    for d in upserts {
        let fe = &d.frontend;
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
        for b in &d.backends {
            let k = BackendKey::new(*b, fe.protocol);
            let known = p
                .backends
                .id_of(&k)
                .or_else(|| earlier.backends.get(&k).copied());
            let id = match known.or_else(|| planned.get(&k).copied()) {
                Some(id) => id,
                None => {
                    let full = || Error::MapFull {
                        map: svc_common::map_names::BACKENDS,
                        capacity: entries,
                        object: d.service.clone(),
                    };
                    // Every index taken: refused without a walk round the array.
                    let held = p.backends.len() + earlier.backend_indexes.len();
                    if held + planned_indexes.len() >= entries as usize {
                        return Err(full());
                    }
                    let planned_here = |i: u32| {
                        earlier.backend_indexes.contains(&i) || planned_indexes.contains(&i)
                    };
                    let Some(id) = take_backend_id(&mut next_backend, &p.backends, planned_here)?
                    else {
                        return Err(full());
                    };
                    planned_indexes.insert(svc_common::backend_index(id, entries));
                    planned.insert(k, id);
                    plan.new_backends.push((id, *b, fe.protocol));
                    plan.max_backend_id = plan.max_backend_id.max(id);
                    id
                }
            };
            ids.push(id);
        }
        let (flags, timeout) = flags_of(d);
        let key = service_key(fe);
        let name = stored_name(&d.service);
        let ranges = ranges_of(d);
        let affinity_id = if flags & svc_flags::AFFINITY == 0 {
            0
        } else if let Some(id) = p.port_affinity(&name, fe.protocol).or_else(|| {
            planned_ports
                .get(&(d.service.as_str(), fe.protocol))
                .copied()
        }) {
            id
        } else {
            // An id of its own from the frontend ids, not one of the port's frontend ids: those
            // are never reused, so it names this port alone for ever, even when a frontend
            // later passes to another Service or leaves while the port stays.
            let id = take_id(&mut next_frontend, "frontend")?;
            plan.max_frontend_id = plan.max_frontend_id.max(id);
            planned_ports.insert((d.service.as_str(), fe.protocol), id);
            id
        };
        let slots = |id: u32, rev: u16| {
            super::slot_entries(id, rev, &ids)
                .map(|(k, g)| (Op::PutSlot(k, g), Some(Op::DelSlot(k))))
        };

        let Some(cur) = p.frontends.get(fe) else {
            let id = take_id(&mut next_frontend, "frontend")?;
            plan.max_frontend_id = plan.max_frontend_id.max(id);
            let rev = 1;
            plan.prepare.push((
                Op::PutRevNat(id, rev_nat_value(fe)),
                Some(Op::DelRevNat(id)),
            ));
            plan.prepare
                .push((Op::PutName(id, encode_name(&name)), Some(Op::DelName(id))));
            plan.prepare.extend(slots(id, rev));
            let matches = members(fe, flags, &ids);
            plan.prepare
                .extend(matches.iter().map(|b| put_match(id, *b)));
            // Before the master entry: a reader that sees its SOURCE_RANGES flag finds them.
            plan.prepare.extend(ranges.iter().map(|c| put_range(id, c)));
            // The table and its index entry before the master entry that flags it.
            let maglev = if wants_table(p, d) {
                plan_table(
                    p,
                    earlier,
                    &mut plan,
                    &mut shareable,
                    (d, &ids),
                    maglev_key(id, rev),
                )
            } else {
                None
            };
            plan.needs.ranges += ranges.len() as u64;
            plan.needs.rev_nat += 1;
            plan.needs.names += 1;
            plan.needs.slots += u64::from(svc_common::slot_groups(ids.len() as u16));
            plan.needs.matches += matches.len() as u64;
            let pf = ProgFrontend {
                id,
                rev,
                count: ids.len() as u16,
                flags,
                affinity_timeout_s: timeout,
                affinity_id,
                backends: ids,
                name,
                name_entry: Entry::Ok,
                rev_nat_entry: Entry::Ok,
                matches,
                ranges,
                maglev,
                torn: false,
            };
            plan.add.push(Op::PutService(key, pf.value()));
            plan.needs.services += 1;
            plan.commit.push((*fe, Some(pf)));
            continue;
        };

        let same_set = cur.complete() && cur.backends == ids;
        let same_settings = cur.flags == flags
            && cur.affinity_timeout_s == timeout
            && cur.affinity_id == affinity_id;
        let name_ok = cur.name_entry == Entry::Ok && cur.name == name;
        let rev_nat_ok = cur.rev_nat_entry == Entry::Ok;
        let matches = members(fe, flags, &ids);
        let same_ranges = ranges == cur.ranges;
        let wants = wants_table(p, d);
        let seed = p.maglev.settings.seed;
        let size = crate::maglev::table_size(d.backends.len());
        // Whether the generation's table (or its lack) can stay as it is: a table of this
        // seed and size (the same backends under the same generation build the same), or
        // none where none is wanted or none fits.
        let maglev_ok = match cur.maglev {
            Some(t) => wants && t.seed == seed && t.size == size,
            None if wants => {
                let fits = (earlier.regions.as_ref())
                    .unwrap_or(&p.maglev.regions)
                    .fits(crate::maglev::blocks(size))
                    || find_shared(&shareable, seed, &ids).is_some();
                if !fits {
                    plan.roomless.push(*fe);
                }
                !fits
            }
            None => true,
        };
        if same_set
            && same_settings
            && name_ok
            && rev_nat_ok
            && matches == cur.matches
            && same_ranges
            && maglev_ok
        {
            if p.maglev.roomless.contains(fe) && plan.roomless.last() != Some(fe) {
                plan.settled.push(*fe);
            }
            continue;
        }
        if !name_ok {
            plan.prepare
                .push((Op::PutName(cur.id, encode_name(&name)), None));
            if cur.name_entry == Entry::Missing {
                plan.needs.names += 1;
            }
        }
        if !rev_nat_ok {
            plan.prepare
                .push((Op::PutRevNat(cur.id, rev_nat_value(fe)), None));
            if cur.rev_nat_entry == Entry::Missing {
                plan.needs.rev_nat += 1;
            }
        }
        // A table of another seed (or size) is never replaced under its generation: the
        // old region stays named by its index entry until the old generation retires, so a
        // reader, or an agent restarted meanwhile, never finds it written over.
        let new_gen = !same_set || (wants && cur.maglev.is_some() && !maglev_ok);
        let rev = if new_gen {
            let rev = next_rev(p, earlier, cur.id, cur.rev);
            plan.prepare.extend(slots(cur.id, rev));
            plan.needs.slots += u64::from(svc_common::slot_groups(ids.len() as u16));
            rev
        } else {
            cur.rev
        };
        // A new generation gets its table beside its slots; the same generation keeps its
        // table, or gets one before the master entry gains the flag, or loses it when the
        // master entry drops the flag (retired with its region after the grace period).
        let maglev = if new_gen || (wants && cur.maglev.is_none() && !maglev_ok) {
            if wants {
                plan_table(
                    p,
                    earlier,
                    &mut plan,
                    &mut shareable,
                    (d, &ids),
                    maglev_key(cur.id, rev),
                )
            } else {
                None
            }
        } else if wants {
            cur.maglev
        } else {
            if let Some(old) = cur.maglev {
                plan.retire.push(Retire::Table {
                    key: maglev_key(cur.id, rev),
                    table: old,
                });
            }
            None
        };
        for b in minus(&matches, &cur.matches) {
            plan.prepare.push(put_match(cur.id, *b));
            plan.needs.matches += 1;
        }
        for b in minus(&cur.matches, &matches) {
            plan.after.push(Op::DelMatch(AffinityMatchKey {
                id: cur.id,
                backend: *b,
            }));
            plan.frees.matches += 1;
        }
        // Ranges are not versioned: new ones go in before the switch, those no longer wanted
        // right after it (for a moment the frontend admits both, never neither).
        for c in ranges_minus(&ranges, &cur.ranges) {
            plan.prepare.push(put_range(cur.id, c));
            plan.needs.ranges += 1;
        }
        for c in ranges_minus(&cur.ranges, &ranges) {
            plan.after.push(Op::DelRange(range_key(cur.id, c)));
            plan.frees.ranges += 1;
        }
        let pf = ProgFrontend {
            id: cur.id,
            rev,
            count: ids.len() as u16,
            flags,
            affinity_timeout_s: timeout,
            affinity_id,
            backends: ids,
            name,
            name_entry: Entry::Ok,
            rev_nat_entry: Entry::Ok,
            matches,
            ranges,
            maglev,
            torn: false,
        };
        if new_gen || !same_settings || pf.value() != cur.value() {
            plan.switch.push((
                Op::PutService(key, pf.value()),
                Op::PutService(key, cur.value()),
            ));
        }
        if new_gen {
            plan.retire.push(Retire::Slots {
                id: cur.id,
                rev: cur.rev,
                count: cur.count,
                table: cur.maglev,
            });
        }
        plan.commit.push((*fe, Some(pf)));
    }

    for fe in gone {
        let Some(cur) = p.frontends.get(fe) else {
            continue;
        };
        let key = service_key(fe);
        // Master first: from then on nothing new reaches the slots; they and the id's
        // entries go after the grace period.
        plan.switch
            .push((Op::DelService(key), Op::PutService(key, cur.value())));
        plan.frees.services += 1;
        plan.retire.push(Retire::Slots {
            id: cur.id,
            rev: cur.rev,
            count: cur.count,
            table: cur.maglev,
        });
        plan.retire.push(Retire::Ids(cur.id));
        for b in &cur.matches {
            plan.after.push(Op::DelMatch(AffinityMatchKey {
                id: cur.id,
                backend: *b,
            }));
        }
        plan.frees.matches += cur.matches.len() as u64;
        // Retired with the id's other entries: a reader holding the master entry still finds
        // them.
        for c in cur.ranges.iter() {
            plan.retire
                .push(Retire::Del(Op::DelRange(range_key(cur.id, c))));
        }
        plan.commit.push((*fe, None));
    }
    if !plan.is_empty() {
        plan.meta = durable_ids(earlier.hwm, plan.max_frontend_id, plan.max_backend_id);
        if let Some(m) = plan.meta {
            earlier.hwm = (m.frontend_id_hwm, m.backend_id_hwm);
        }
    }
    earlier.next_frontend = next_frontend;
    earlier.next_backend = next_backend;
    earlier.backends.extend(planned);
    earlier.backend_indexes.extend(planned_indexes);
    Ok(plan)
}

/// The META value that makes ids up to `frontend` and `backend` durable, with a block of ids
/// past each, when the high-water marks `hwm` (frontend, backend) do not cover them yet.
pub fn durable_ids(hwm: (u32, u32), frontend: u32, backend: u32) -> Option<MetaValue> {
    if frontend < hwm.0 && backend < hwm.1 {
        return None;
    }
    let block = |need: u32, hwm: u32| {
        if need < hwm {
            hwm
        } else {
            need.saturating_add(ID_BLOCK)
        }
    };
    Some(MetaValue {
        frontend_id_hwm: block(frontend, hwm.0),
        backend_id_hwm: block(backend, hwm.1),
        _reserved: [0; 6],
    })
}

/// A master entry value as the planner would write it for `d` under `id`/`rev` and
/// `affinity_id` (for tests).
pub fn master_value(d: &DesiredFrontend, id: u32, rev: u16, affinity_id: u32) -> ServiceValue {
    let (flags, timeout) = flags_of(d);
    ServiceValue {
        id,
        count: d.backends.len() as u16,
        rev,
        flags,
        _pad0: 0,
        affinity_timeout_s: timeout,
        affinity_id,
    }
}

/// Everything one sync writes, in the order it writes it: planned from the desired state, the
/// mirror of the maps and the node's view, without touching the maps. Each part is what is
/// written when every write before it succeeded; the executor (`super`) carries it out and
/// handles what a failed write changes (a Service held back, undone or retried).
#[derive(Debug, Default)]
pub struct Plan {
    /// Leftovers nothing leads to, dealt with before anything is written: master entries,
    /// source ranges and membership entries at once, the rest after the grace period.
    pub strays: Strays,
    /// The node's addresses and datapath settings (a sync of every frontend, or of the node
    /// alone).
    pub node: Option<NodePlan>,
    /// `DatapathConfig::snat_range_frontends`, set before any frontend: a new frontend has its
    /// port in the SNAT range.
    pub snat_mark: Option<DatapathConfig>,
    /// Whether a frontend port in the SNAT range is wanted after this sync (None: no datapath
    /// config, nothing to record).
    pub snat_range_wanted: Option<bool>,
    /// The external addresses of the frontends written, in order: each is marked in
    /// NODE_ADDRS before the frontends that have it; `external_addrs` is what that writes
    /// when the node's part has been written.
    pub externals: Vec<[u8; 16]>,
    pub external_addrs: Vec<([u8; 16], NodeAddrValue)>,
    /// Each Service the sync covers, in name order.
    pub services: Vec<ServicePlan>,
    /// ClusterIP markers written after the frontends, and those deleted.
    pub new_markers: Vec<IpAddr>,
    pub gone_markers: Vec<IpAddr>,
    /// The external addresses of the frontends written or removed: after the Services, each
    /// is brought to what the programmed frontends need (`touched_addrs`); `addrs_after` is
    /// what that writes when every Service is programmed.
    pub touched_addrs: BTreeSet<[u8; 16]>,
    pub addrs_after: Vec<([u8; 16], NodeAddrValue)>,
    /// Whether the Services' writes are left out (`services[..].plan` None) and made by the
    /// executor as it reaches each Service, with the same planner against the maps as they
    /// are then: what `Programmed::plan_outline` makes for a sync of many Services.
    pub outline: bool,
}

/// The node's part of a sync.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NodePlan {
    /// The node's addresses as NODE_ADDRS keys them.
    pub want: BTreeMap<[u8; 16], NodeAddrValue>,
    /// NODE_ADDRS entries written (node addresses, external ones, lingering ones).
    pub addrs: Vec<([u8; 16], NodeAddrValue)>,
    /// SVC_CONFIG, when it changes.
    pub config: Option<DatapathConfig>,
}

/// One Service's part of a sync: all of it is written, or none.
#[derive(Debug)]
pub struct ServicePlan {
    pub owner: String,
    /// Its frontends to write and to remove.
    pub upserts: Vec<Frontend>,
    pub gone: Vec<Frontend>,
    /// What it writes, or why it cannot be programmed. None in an outline, whose Services are
    /// planned as they are written: an empty `UnitPlan` kept for each of them took 50 MB at
    /// 100,000 Services. Boxed with its error, so an outline's entry is 80 bytes, not 136.
    pub plan: Option<Box<Result<UnitPlan>>>,
}

impl ServicePlan {
    /// The frontends the Service's sync covers: a retry covers the same.
    pub fn covered(&self) -> BTreeSet<Frontend> {
        self.upserts.iter().chain(&self.gone).copied().collect()
    }
}

impl Plan {
    /// Whether the sync writes nothing (an outline is never known to).
    pub fn is_empty(&self) -> bool {
        !self.outline
            && self.strays.is_empty()
            && self
                .node
                .as_ref()
                .is_none_or(|n| n.addrs.is_empty() && n.config.is_none())
            && self.snat_mark.is_none()
            && self.external_addrs.is_empty()
            && self
                .services
                .iter()
                .all(|s| matches!(s.plan.as_deref(), Some(Ok(u)) if u.is_empty()))
            && self.new_markers.is_empty()
            && self.gone_markers.is_empty()
            && self.addrs_after.is_empty()
    }
}

/// The entry address `k` should have: the node's flags for it (`want`), `EXTERNAL` while a
/// programmed frontend (`external_refs`, or with `external` one about to be written) has
/// it, else `LINGER` if it is in NODE_ADDRS (`written`) at all.
pub(super) fn addr_target(
    want: &BTreeMap<[u8; 16], NodeAddrValue>,
    external_refs: &BTreeMap<[u8; 16], u32>,
    written: &BTreeMap<[u8; 16], NodeAddrValue>,
    k: &[u8; 16],
    external: bool,
) -> Option<NodeAddrValue> {
    let mut v = want.get(k).copied().unwrap_or_default();
    if external || external_refs.contains_key(k) {
        v.flags |= node_addr_flags::EXTERNAL;
    }
    if v.flags != 0 {
        return Some(v);
    }
    written.contains_key(k).then_some(NodeAddrValue {
        flags: node_addr_flags::LINGER,
        ifindex: 0,
    })
}

/// The frontends of one sync, grouped by the Service they belong to: the unit that is
/// programmed completely or not at all.
type Units<'a> = BTreeMap<Cow<'a, str>, (Vec<&'a DesiredFrontend>, Vec<Frontend>)>;

/// Above this many Services a sync's plan is an outline (`Plan::outline`). A Service's writes
/// take about 2.5 KB held at once (a 3-endpoint Service: its entries, each with its undo), so
/// a whole first sync of 100,000 Services would hold about 250 MB before writing anything;
/// an outline holds one Service's at a time, as the agent did before sync plans were values.
pub const OUTLINE_ABOVE: usize = 1024;

impl Programmed {
    /// Plans the sync that makes the maps serve `desired` within `scope`, every write of it.
    pub fn plan(&self, desired: &DesiredState, scope: Scope<'_>) -> Plan {
        self.plan_with(desired, scope, false)
    }

    /// `plan`, but an outline (`Plan::outline`) when the sync covers more than
    /// `OUTLINE_ABOVE` Services: what the agent executes.
    pub fn plan_outline(&self, desired: &DesiredState, scope: Scope<'_>) -> Plan {
        self.plan_with(desired, scope, true)
    }

    fn plan_with(&self, desired: &DesiredState, scope: Scope<'_>, outline: bool) -> Plan {
        let mut plan = Plan {
            strays: self.strays.clone(),
            ..Default::default()
        };
        // NODE_ADDRS and SVC_CONFIG as the node's part leaves them.
        let mut addrs = self.node_addrs.clone();
        let mut config = self.config;
        let mut want = &self.node_want;
        if matches!(scope, Scope::All) {
            plan.node = Some(self.plan_node(&desired.node));
        }
        if let Some(node) = &plan.node {
            addrs.extend(node.addrs.iter().copied());
            config = node.config.or(config);
            want = &node.want;
        }

        let units = self.units(desired, scope);
        // Before a frontend whose port lies in the SNAT range: from its first flow on, a SNAT
        // port search must pass over that flow's tuple. A frontend not yet programmed waits
        // for the mark.
        if let Some(c) = config {
            let adding = units
                .values()
                .flat_map(|(u, _)| u.iter().map(|d| &d.frontend));
            let wanted = snat_range_frontends(&c, adding);
            plan.snat_range_wanted = Some(match scope {
                Scope::All => snat_range_frontends(&c, desired.frontends.keys()),
                Scope::Only(_) => self.snat_range_wanted || wanted,
            });
            if wanted && c.snat_range_frontends == 0 {
                plan.snat_mark = Some(DatapathConfig {
                    snat_range_frontends: 1,
                    ..c
                });
            }
        }

        // External frontend addresses before the frontends: the external ingress looks only
        // at packets to addresses NODE_ADDRS holds. A frontend that leaves its address for
        // good is seen to after them.
        let mut external_refs = self.external_refs.clone();
        let mut marked = BTreeSet::new();
        for (upserts, gone) in units.values() {
            for d in upserts {
                let Some(a) = external_addr(&d.frontend) else {
                    continue;
                };
                plan.touched_addrs.insert(a);
                if !marked.insert(a) {
                    continue;
                }
                plan.externals.push(a);
                let v = addr_target(want, &self.external_refs, &addrs, &a, true);
                if let Some(v) = v.filter(|v| addrs.get(&a) != Some(v)) {
                    plan.external_addrs.push((a, v));
                    addrs.insert(a, v);
                }
            }
            plan.touched_addrs
                .extend(gone.iter().filter_map(external_addr));
        }

        let marker_ips: BTreeSet<IpAddr> = match scope {
            Scope::All => desired.cluster_ips.union(&self.markers).copied().collect(),
            Scope::Only(set) => set.iter().map(|fe| fe.ip).collect(),
        };
        for ip in marker_ips {
            match (
                desired.cluster_ips.contains(&ip),
                self.markers.contains(&ip),
            ) {
                (true, false) => plan.new_markers.push(ip),
                (false, true) => plan.gone_markers.push(ip),
                _ => {}
            }
        }

        plan.outline = outline && units.len() > OUTLINE_ABOVE;
        let mut earlier = Planned::new(self);
        // Held through the sync that follows, at its peak: no room beyond the Services.
        plan.services.reserve_exact(units.len());
        for (owner, (upserts, gone)) in units {
            if plan.outline {
                // What a programmed unit's commit would change, from its frontends alone.
                for fe in upserts.iter().map(|d| &d.frontend) {
                    if !self.frontends.contains_key(fe) {
                        external_ref(&mut external_refs, fe, true);
                    }
                }
                for fe in gone.iter().filter(|fe| self.frontends.contains_key(fe)) {
                    external_ref(&mut external_refs, fe, false);
                }
                plan.services.push(ServicePlan {
                    owner: owner.into_owned(),
                    upserts: upserts.iter().map(|d| d.frontend).collect(),
                    gone,
                    plan: None,
                });
                continue;
            }
            let unit = plan_unit(self, &mut earlier, &owner, &upserts, &gone);
            if let Ok(unit) = &unit {
                for (fe, after) in &unit.commit {
                    let before = self.frontends.contains_key(fe);
                    if before != after.is_some() {
                        external_ref(&mut external_refs, fe, after.is_some());
                    }
                }
            }
            plan.services.push(ServicePlan {
                owner: owner.into_owned(),
                upserts: upserts.iter().map(|d| d.frontend).collect(),
                gone,
                plan: Some(Box::new(unit)),
            });
        }
        for a in &plan.touched_addrs {
            let v = addr_target(want, &external_refs, &addrs, a, false);
            if let Some(v) = v.filter(|v| addrs.get(a) != Some(v)) {
                plan.addrs_after.push((*a, v));
            }
        }
        plan
    }

    /// The node's addresses (see addrs.rs) and the datapath settings.
    pub fn plan_node(&self, node: &NodeDesired) -> NodePlan {
        let want: BTreeMap<[u8; 16], NodeAddrValue> =
            node.addrs.iter().map(|(ip, v)| (addr16(*ip), *v)).collect();
        let keys: BTreeSet<&[u8; 16]> = self
            .node_addrs
            .keys()
            .chain(want.keys())
            .chain(self.external_refs.keys())
            .collect();
        let addrs = keys
            .into_iter()
            .filter_map(|k| {
                let v = addr_target(&want, &self.external_refs, &self.node_addrs, k, false)?;
                (self.node_addrs.get(k) != Some(&v)).then_some((*k, v))
            })
            .collect();
        // The mark of frontend ports in the SNAT range is kept (the flow walk clears it once
        // nothing needs it, `clear_snat_range_mark`): a change of the node's settings alone
        // must not drop it under a frontend or a live flow that does.
        let config = node
            .config
            .map(|mut c| {
                let kept = self.config.is_some_and(|o| o.snat_range_frontends != 0);
                c.snat_range_frontends =
                    u32::from(kept || snat_range_frontends(&c, self.frontends.keys()));
                c
            })
            .filter(|c| self.config != Some(*c));
        NodePlan {
            want,
            addrs,
            config,
        }
    }

    /// The Services this sync covers, each with the frontends to write and to remove.
    fn units<'a>(&self, desired: &'a DesiredState, scope: Scope<'_>) -> Units<'a> {
        let mut units: Units<'a> = BTreeMap::new();
        let upsert = |units: &mut Units<'a>, d: &'a DesiredFrontend| {
            units.entry(Cow::Borrowed(d.owner())).or_default().0.push(d);
        };
        let remove = |units: &mut Units<'a>, fe: &Frontend, cur: &ProgFrontend| {
            units
                .entry(Cow::Owned(cur.owner().to_string()))
                .or_default()
                .1
                .push(*fe);
        };
        match scope {
            Scope::All => {
                for d in desired.frontends.values() {
                    upsert(&mut units, d);
                }
                for (fe, cur) in &self.frontends {
                    if !desired.frontends.contains_key(fe) {
                        remove(&mut units, fe, cur);
                    }
                }
            }
            Scope::Only(set) => {
                for fe in set {
                    if let Some(d) = desired.frontends.get(fe) {
                        upsert(&mut units, d);
                    } else if let Some(cur) = self.frontends.get(fe) {
                        remove(&mut units, fe, cur);
                    }
                }
            }
        }
        units
    }
}

/// Counts (`up`) or uncounts a programmed frontend under its external address.
pub(super) fn external_ref(refs: &mut BTreeMap<[u8; 16], u32>, fe: &Frontend, up: bool) {
    let Some(a) = external_addr(fe) else {
        return;
    };
    if up {
        *refs.entry(a).or_insert(0) += 1;
    } else if let Some(n) = refs.get_mut(&a) {
        *n -= 1;
        if *n == 0 {
            refs.remove(&a);
        }
    }
}
