//! The planner: what one Service's sync must write, switch and retire, computed from the
//! mirror of the maps without touching them. The executor (`super`) writes a plan in its
//! order, or undoes it.

use std::collections::HashMap;

use svc_common::{
    backend_flags, checks_match, svc_flags, AffinityMatchKey, Backend, BackendId, RevNatValue,
    ServiceValue, SlotKey,
};

use super::{
    encode_name, flags_of, range_key, ranges_of, service_key, stored_name, BackendKey, Entry,
    ProgFrontend, Programmed, Retire, Usage, MAX_BACKENDS_PER_FRONTEND,
};
use crate::error::{Error, Result};
use crate::model::{Backend as DesiredBackend, Cidr, DesiredFrontend, Frontend, Protocol};
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
        self.new_backends
            .iter()
            .map(|(id, b, p)| Op::PutBackend(*id, backend_value(*b, *p)))
            .chain(self.prepare.iter().map(|(op, _)| op.clone()))
            .chain(self.add.iter().cloned())
            .chain(self.switch.iter().map(|(op, _)| op.clone()))
            .chain(self.after.iter().cloned())
            .collect()
    }
}

pub fn backend_value(b: DesiredBackend, protocol: Protocol) -> Backend {
    Backend {
        addr: super::addr16(b.addr.ip()),
        port_be: b.addr.port().to_be(),
        proto: protocol.ipproto(),
        flags: if b.local { backend_flags::LOCAL } else { 0 },
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

/// The next generation of frontend `id` after `rev` that no retiring generation uses.
fn next_rev(p: &Programmed, id: u32, rev: u16) -> u16 {
    let mut r = rev.wrapping_add(1);
    while p.retiring.has_slot_gen(id, r) && r != rev {
        r = r.wrapping_add(1);
    }
    r
}

/// The next id of a kind, never one handed out before. The last id is never handed out, so
/// a counter that reached it (damaged pins carried an id that high) refuses rather than give
/// one id to two frontends or backends, which would then share slots.
fn take_id(next: &mut u32, kind: &str) -> Result<u32> {
    if *next == u32::MAX {
        return Err(Error::Map {
            map: svc_common::map_names::META,
            message: format!(
                "no {kind} id left (the pinned maps carry ids up to {}); not programmed. \
                 `svc-agent uninstall` and a restart start the ids again",
                u32::MAX
            ),
        });
    }
    let id = *next;
    *next += 1;
    Ok(id)
}

/// Plans Service `owner`: write `upserts`, remove `gone`.
pub fn plan_unit(
    p: &Programmed,
    owner: &str,
    upserts: &[&DesiredFrontend],
    gone: &[Frontend],
) -> Result<UnitPlan> {
    let mut plan = UnitPlan {
        owner: owner.to_string(),
        ..Default::default()
    };
    let mut next_frontend = p.ids.next_frontend;
    let mut next_backend = p.ids.next_backend;
    let mut planned: HashMap<BackendKey, BackendId> = HashMap::new();
    let mut planned_ports: HashMap<(&str, Protocol), u32> = HashMap::new();

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
            let id = match p.backend_ids.get(&k).or_else(|| planned.get(&k)) {
                Some(id) => *id,
                None => {
                    let id = take_id(&mut next_backend, "backend")?;
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
            ids.iter().enumerate().map(move |(i, b)| {
                let k = SlotKey {
                    id,
                    rev,
                    slot: i as u16 + 1,
                };
                (Op::PutSlot(k, *b), Some(Op::DelSlot(k)))
            })
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
            plan.needs.ranges += ranges.len() as u64;
            plan.needs.rev_nat += 1;
            plan.needs.names += 1;
            plan.needs.slots += ids.len() as u64;
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
        if same_set
            && same_settings
            && name_ok
            && rev_nat_ok
            && matches == cur.matches
            && same_ranges
        {
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
        let rev = if same_set {
            cur.rev
        } else {
            let rev = next_rev(p, cur.id, cur.rev);
            plan.prepare.extend(slots(cur.id, rev));
            plan.needs.slots += ids.len() as u64;
            rev
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
        };
        if !same_set || !same_settings {
            plan.switch.push((
                Op::PutService(key, pf.value()),
                Op::PutService(key, cur.value()),
            ));
        }
        if !same_set {
            plan.retire.push(Retire::Slots {
                id: cur.id,
                rev: cur.rev,
                count: cur.count,
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
    Ok(plan)
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
