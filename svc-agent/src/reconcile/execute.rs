//! The executor: writes a [`Plan`] in its order, records each write in the mirror, undoes a
//! Service whose writes fail, and says what failed.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use svc_common::{node_addr_flags, BackendId, DatapathConfig, SlotKey};
use tracing::{debug, warn};

use super::plan::{self, NodePlan, Plan, Planned, ServicePlan, UnitPlan};
use super::{
    addrs, ip_from16, marker_key, marker_value, name_object, snat_range_frontends, BackendKey,
    Programmed, Retire, Scope, Strays, SyncReport, TableRef, Usage, Writer,
};
use crate::error::{Error, Result};
use crate::model::{DesiredFrontend, DesiredState, NodeDesired};
use crate::store::{Op, Store};

impl Programmed {
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
        let plan = self.plan_outline(desired, scope);
        self.execute_plan(store, desired, plan, now)
    }

    /// Carries out `plan`, made by `plan` from this mirror and `desired` with nothing written
    /// since. A Service whose writes fail is left as it was (and reported); the Services
    /// after it were planned as if it had been programmed, so they are planned again
    /// against the maps as they are.
    pub fn execute_plan<S: Store>(
        &mut self,
        store: &mut S,
        desired: &DesiredState,
        plan: Plan,
        now: Instant,
    ) -> SyncReport {
        let mut report = SyncReport::default();
        let mut w = Writer { store, ops: 0 };
        report.strays_deleted = self.retire_strays(&mut w, plan.strays, now, &mut report.errors);
        if let Some(node) = plan.node {
            let before = report.errors.len();
            self.execute_node(&mut w, node, &mut report.errors);
            report.node_failed = report.errors.len() > before;
        }

        let mut range_unmarked = None;
        if let (Some(wanted), Some(_)) = (plan.snat_range_wanted, self.config) {
            self.snat_range_wanted = wanted;
        }
        if plan.snat_mark.is_some() {
            let mut errors = Vec::new();
            self.put_snat_range_frontends(&mut w, true, &mut errors);
            range_unmarked = errors.first().map(ToString::to_string);
            report.errors.extend(errors);
        }
        // A ClusterIP's marker is what refuses its undefined ports, and the ports of a
        // Service that did not fit: its room is kept before any Service takes its own.
        let reserved = plan.new_markers.len() as u64;

        // Addresses that NODE_ADDRS does not mark `EXTERNAL` after a failed write (absent, or
        // a node address without the mark), with why: new frontends there would be written
        // where no packet looks them up by their own key.
        let mut unwritten: BTreeMap<[u8; 16], String> = BTreeMap::new();
        for a in plan.externals {
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

        let mut unreferenced: Vec<BackendId> = Vec::new();
        // Whether the maps are as the plans of the Services still to come expect them.
        // An outline's Services are planned here, each against the maps as they are.
        let mut as_planned = !plan.outline;
        // An outline's Services go in chunks whose writes are batched (`Chunk`); a Service
        // the chunk does not take, or one of a chunk whose batch failed, goes alone.
        let mut queue = Queue::new(plan.services, plan.outline);
        let mut chunk = Chunk::new(self);
        // A sync that adds many frontends leaves the mirror's tree partly empty until
        // `Agent::apply_full` packs it: about half full when they come in key order (Services
        // in name order whose ClusterIPs follow their names, as in the scale bench), about
        // two thirds in random order. Packed each time it has doubled, it is smaller at the
        // sync's end, where the agent's memory peaks, and while `apply_full` packs it.
        let mut pack_at = PACK_FROM.max(self.frontends.len().saturating_mul(2));
        loop {
            let Some((service, batched)) = queue.pop_front() else {
                if chunk.members.is_empty() {
                    break;
                }
                let full = std::mem::take(&mut chunk.members);
                for s in self.execute_chunk(&mut w, full, now, &mut unreferenced, &mut report) {
                    queue.push_back((s, false));
                }
                continue;
            };
            // Not after the last Service: `apply_full` packs the tree then.
            if chunk.members.is_empty() && self.frontends.len() >= pack_at {
                self.compact();
                pack_at = self.frontends.len().saturating_mul(2);
            }
            let covered = service.covered();
            let upserts: Vec<&DesiredFrontend> = service
                .upserts
                .iter()
                .filter_map(|fe| desired.frontends.get(fe))
                .collect();
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
            let not_marked = |a: [u8; 16], why: &str, left: &str| {
                Error::map(
                    svc_common::map_names::NODE_ADDRS,
                    format!(
                        "its external address {} is not marked there ({why}); {left}",
                        ip_from16(a)
                    ),
                )
            };
            let range_held = range_unmarked.as_ref().filter(|_| {
                self.config.is_some_and(|c| {
                    let new = upserts.iter().map(|d| &d.frontend);
                    snat_range_frontends(&c, new.filter(|f| !self.frontends.contains_key(f)))
                })
            });
            if batched && held.is_none() && range_held.is_none() && retried.is_none() {
                // Planned against the mirror as it is when its first member is taken: Services
                // written alone or in a chunk before have changed it.
                if chunk.members.is_empty() {
                    chunk = Chunk::new(self);
                }
                match chunk.admit(self, service, &upserts, reserved) {
                    Admitted::Taken if chunk.members.len() < CHUNK => continue,
                    Admitted::Taken => {
                        let full = std::mem::take(&mut chunk.members);
                        let redo =
                            self.execute_chunk(&mut w, full, now, &mut unreferenced, &mut report);
                        for s in redo.into_iter().rev() {
                            queue.push_front((s, false));
                        }
                        continue;
                    }
                    Admitted::Nothing => continue,
                    // Alone, after the Services taken before it.
                    Admitted::Refused(service) => {
                        let full = std::mem::take(&mut chunk.members);
                        queue.push_front((*service, false));
                        let redo =
                            self.execute_chunk(&mut w, full, now, &mut unreferenced, &mut report);
                        for s in redo.into_iter().rev() {
                            queue.push_front((s, false));
                        }
                        continue;
                    }
                }
            }
            if !chunk.members.is_empty() {
                // Planned against the maps as they are once the Services taken before it are
                // written: ids are handed out in a chunk's `execute_chunk`, so a Service
                // planned alone while one waits would be given the ids its members hold.
                let full = std::mem::take(&mut chunk.members);
                queue.push_front((service, false));
                let redo = self.execute_chunk(&mut w, full, now, &mut unreferenced, &mut report);
                for s in redo.into_iter().rev() {
                    queue.push_front((s, false));
                }
                continue;
            }
            let ServicePlan {
                owner, gone, plan, ..
            } = service;
            let result = match (held, range_held) {
                (Some((a, why)), _) => Err(not_marked(a, why, "left as it was")),
                (None, Some(why)) => Err(Error::map(
                    svc_common::map_names::CONFIG,
                    format!(
                        "a frontend port in the SNAT range, and the mark the SNAT port search \
                         needs for it is not written ({why}); left as it was"
                    ),
                )),
                (None, None) => Ok(()),
            };
            let result = match result {
                Err(e) => {
                    as_planned = false;
                    Err(e)
                }
                Ok(()) => {
                    let plan = match plan {
                        Some(plan) if as_planned => *plan,
                        _ => {
                            let mut earlier = Planned::new(self);
                            plan::plan_unit(self, &mut earlier, &owner, &upserts, &gone)
                        }
                    };
                    plan.and_then(|plan| {
                        let done = self.execute(&mut w, plan, reserved, now, &mut unreferenced);
                        as_planned &= done.is_ok();
                        done
                    })
                }
            };
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
            if let Err(e) = result {
                report
                    .errors
                    .push(name_object(e, &format!("Service {owner}")));
                report.failed.insert(owner, covered);
            }
        }

        for a in plan.touched_addrs {
            self.write_addr(&mut w, a, false, &mut report.errors);
        }

        // Markers after frontends: a new ClusterIP must not refuse a port whose frontend is
        // about to be written.
        for ip in &plan.new_markers {
            match w.op(&Op::PutService(marker_key(*ip), marker_value())) {
                Ok(_) => {
                    self.markers.insert(*ip);
                    self.usage.services += 1;
                }
                Err(e) => report
                    .errors
                    .push(name_object(e, &format!("ClusterIP {ip}"))),
            }
        }
        for ip in &plan.gone_markers {
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

        // Backends no current generation names: retired (unless named again before due).
        for id in unreferenced {
            if self.backend_refs(id) == 0 && !self.retiring.has_backend(id) {
                self.retiring.push(now + self.grace, Retire::Backend(id));
            }
        }
        self.drop_loose_pages(&mut w);
        report.ops = w.ops;
        report
    }

    /// Brings SVC_NODE_ADDRS and SVC_CONFIG to `node` alone (after the node's addresses or
    /// the datapath settings changed): no Service is looked at.
    pub fn apply_node<S: Store>(&mut self, store: &mut S, node: &NodeDesired) -> SyncReport {
        let plan = Plan {
            node: Some(self.plan_node(node)),
            ..Default::default()
        };
        self.execute_plan(store, &DesiredState::default(), plan, Instant::now())
    }

    /// Writes the node's part of a plan.
    fn execute_node<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        node: NodePlan,
        errors: &mut Vec<Error>,
    ) {
        self.node_want = node.want;
        for (k, v) in node.addrs {
            if self.node_addrs.get(&k) != Some(&v) {
                self.put_addr(w, k, v, errors);
            }
        }
        if let Some(c) = node.config {
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
    pub(super) fn clear_snat_range_mark<S: Store>(
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
        // Told once, when a frontend starts to want a table it finds no room for.
        for fe in &plan.roomless {
            if self.maglev.roomless.insert(*fe) {
                warn!(
                    frontend = %fe,
                    "no room for its Maglev table in SVC_MAGLEV (--max-maglev-entries): \
                     programmed with the random choice, tried again at each sync"
                );
            }
        }
        for fe in &plan.settled {
            self.maglev.roomless.remove(fe);
        }
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
        // Ids are made durable before anything uses them.
        if let Some(m) = plan.meta {
            w.op(&Op::PutMeta(m))?;
            self.ids.frontend_hwm = m.frontend_id_hwm;
            self.ids.backend_hwm = m.backend_id_hwm;
        }

        for (id, sa, protocol) in &plan.new_backends {
            w.op(&Op::PutBackend(
                *id,
                plan::backend_value(*id, *sa, *protocol),
            ))?;
            // Unreferenced until a master entry names it; retired at the end of the sync if
            // what would have used it fails.
            self.backends.insert(*id, BackendKey::new(*sa, *protocol));
            self.usage.backends += 1;
            unreferenced.push(*id);
        }

        // Held only now: an error above returns with nothing to give back (a shared region
        // held for a plan that stops would keep another frontend's table forever).
        for (i, (_, t, region)) in plan.tables.iter().enumerate() {
            let held = match region {
                plan::Region::New => self.maglev.regions.take(t.start, t.blocks()),
                plan::Region::Shared => self.maglev.regions.share(t.start, t.blocks()),
            };
            if !held {
                for (_, t, _) in &plan.tables[..i] {
                    self.maglev.free(t.start, t.blocks());
                }
                return Err(Error::map(
                    svc_common::map_names::MAGLEV,
                    format!(
                        "blocks {}..{} planned for a table are not free, or not the table \
                         it shares (a bookkeeping error)",
                        t.start,
                        t.start + t.blocks()
                    ),
                ));
            }
        }
        // Before any master entry names them, prepared entries can go at once; after, a
        // reader may hold a master entry that names them, so they are retired
        // (`undo_prepare`, `retire_prepared`).
        for (i, (op, _)) in plan.prepare.iter().enumerate() {
            if let Err(e) = w.op(op) {
                self.undo_prepare(w, &plan.prepare[..i], &plan.tables);
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
                    self.undo_prepare(w, &plan.prepare, &plan.tables);
                } else {
                    self.retire_prepared(w, &plan.prepare, &plan.tables, now);
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
                    self.undo_prepare(w, &plan.prepare, &plan.tables);
                } else {
                    self.retire_prepared(w, &plan.prepare, &plan.tables, now);
                }
                return Err(e);
            }
        }

        Ok(self.commit_unit(w, plan, now, unreferenced))
    }

    /// The mirror after `plan`'s writes all landed (its master entries last), and what
    /// follows its switch. Returns the frontends written and removed.
    fn commit_unit<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        plan: UnitPlan,
        now: Instant,
        unreferenced: &mut Vec<BackendId>,
    ) -> (usize, usize) {
        // Committed: the mirror follows the maps.
        self.usage.add(&plan.needs);
        self.usage.sub(&plan.frees);
        let (mut written, mut removed) = (0, 0);
        for (fe, after) in plan.commit {
            let added = after.is_some();
            self.maglev.roomless.remove(&fe);
            if let Some(b) = self.frontends.get(&fe).filter(|b| b.maglev.is_some()) {
                self.maglev.live.remove(&(b.id, b.rev));
            }
            if let Some(t) = after.as_ref().and_then(|a| Some((a.id, a.rev, a.maglev?))) {
                self.maglev.live.insert((t.0, t.1), t.2);
            }
            let before = match after {
                Some(pf) => {
                    written += 1;
                    for b in &pf.backends {
                        self.backends.add_ref(*b);
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
                plan::external_ref(&mut self.external_refs, &fe, added);
            }
            if let Some(before) = before {
                self.port_unref(fe.protocol, &before);
                for b in &before.backends {
                    if self.backends.unref(*b) {
                        unreferenced.push(*b);
                    }
                }
            }
        }
        for fe in &plan.roomless {
            self.maglev.roomless.insert(*fe);
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
        (written, removed)
    }

    /// Undoes `prepare` (or what of it was written) before any master entry named it: gone at
    /// once, with the index entries and regions of `tables` (unless an entry is a current
    /// generation's, put back by the switch's undo).
    fn undo_prepare<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        prepare: &[(Op, Option<Op>)],
        tables: &[(SlotKey, TableRef, plan::Region)],
    ) {
        for (_, undo) in prepare.iter().rev() {
            if let Some(undo) = undo {
                w.try_op(undo);
            }
        }
        for (key, t, _) in tables {
            if !self.maglev.live.contains_key(&(key.id, key.rev)) {
                w.try_op(&Op::DelMaglevIndex(*key));
            }
            self.maglev.free(t.start, t.blocks());
        }
    }

    /// Retires `prepare` and `tables` after a master entry named them for a moment: a reader
    /// may hold it. Membership entries and ranges go at once (without one a reader only
    /// chooses again); what fails to go is a stray.
    fn retire_prepared<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        prepare: &[(Op, Option<Op>)],
        tables: &[(SlotKey, TableRef, plan::Region)],
        now: Instant,
    ) {
        for (op, undo) in prepare {
            match undo {
                Some(undo @ Op::DelMatch(k)) if !w.try_op(undo) => {
                    self.usage.matches += 1;
                    self.strays.matches.push(*k);
                }
                Some(Op::DelMatch(_)) => {}
                Some(undo @ Op::DelRange(k)) if !w.try_op(undo) => {
                    self.usage.ranges += 1;
                    self.strays.ranges.push(*k);
                }
                Some(Op::DelRange(_)) => {}
                Some(undo) => {
                    self.usage.inc_by(op.map(), 1);
                    self.retiring
                        .push(now + self.grace, Retire::Del(undo.clone()));
                }
                None => {}
            }
        }
        for (key, t, _) in tables {
            self.retiring.push(
                now + self.grace,
                Retire::Table {
                    key: *key,
                    table: *t,
                },
            );
        }
    }

    /// Retires what a dead agent (or anyone) left that nothing leads to. Done before any
    /// write: ids and generations are never written over a leftover (they are never reused,
    /// and new generations skip retiring ones), so a leftover is never mistaken for a new
    /// entry; and a reader that read a master entry just before the dead agent switched it
    /// still finds the old generation for the grace period.
    fn retire_strays<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        strays: Strays,
        now: Instant,
        errors: &mut Vec<Error>,
    ) -> usize {
        if strays.is_empty() {
            return 0;
        }
        // The plan's copy is the list now: what fails to go is listed again.
        self.strays = Strays::default();
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
        for (key, table) in strays.maglev {
            let r = match table {
                Some(table) => Retire::Table { key, table },
                None => Retire::Del(Op::DelMaglevIndex(key)),
            };
            self.retiring.push(due, r);
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
}

/// Services of an outline whose writes are batched together (BPF_MAP_UPDATE_BATCH where the
/// store has it): more Services per batch cut syscalls; fewer hold less at once (a 10-endpoint
/// Service plans about 16 writes).
pub(super) const CHUNK: usize = if cfg!(test) { 100 } else { 1024 };

/// Services planned one after the other (as `Programmed::plan` plans a sync) and not yet
/// written: their new backends and every entry their master entries lead to, then their
/// master entries, batched (`Programmed::execute_chunk`). Only Services that add frontends and
/// nothing else join: a switch, a retirement or a Maglev table goes alone.
struct Chunk {
    earlier: Planned,
    /// The mirror's usage with the members' entries added.
    usage: Usage,
    members: Vec<(ServicePlan, UnitPlan)>,
}

/// What `Chunk::admit` did with a Service.
enum Admitted {
    Taken,
    /// Nothing to write for it.
    Nothing,
    /// It goes alone (after the chunk is written).
    Refused(Box<ServicePlan>),
}

impl Chunk {
    fn new(p: &Programmed) -> Chunk {
        Chunk {
            earlier: Planned::new(p),
            usage: p.usage,
            members: Vec::new(),
        }
    }

    /// Plans `service` after the members and takes it when its writes only add (every
    /// prepared entry with its undo, no switch, retirement, table or room to track) and fit.
    /// A Service refused here leaves `earlier` holding its ids: the chunk is written next,
    /// before that Service is planned again against the mirror.
    fn admit(
        &mut self,
        p: &Programmed,
        service: ServicePlan,
        upserts: &[&DesiredFrontend],
        reserved: u64,
    ) -> Admitted {
        let Ok(unit) =
            plan::plan_unit(p, &mut self.earlier, &service.owner, upserts, &service.gone)
        else {
            return Admitted::Refused(Box::new(service));
        };
        if unit.is_empty() && unit.roomless.is_empty() && unit.settled.is_empty() {
            return Admitted::Nothing;
        }
        let adds_only = unit.switch.is_empty()
            && unit.retire.is_empty()
            && unit.after.is_empty()
            && unit.tables.is_empty()
            && unit.roomless.is_empty()
            && unit.settled.is_empty()
            && unit.prepare.iter().all(|(_, undo)| undo.is_some());
        let mut needs = unit.needs;
        needs.backends += unit.new_backends.len() as u64;
        if !adds_only || self.usage.overflow(&needs, &p.capacity, reserved).is_some() {
            return Admitted::Refused(Box::new(service));
        }
        self.usage.add(&needs);
        self.members.push((service, unit));
        Admitted::Taken
    }
}

impl Programmed {
    /// Writes a chunk's members: the ids made durable (the last META of the members covers
    /// them all), every new backend and every entry the master entries lead to (grouped by
    /// map, the backends beside the rest where the store can), then the master entries; the
    /// mirror follows each Service whose master entries all landed. A reader never finds a
    /// master entry before what it leads to, as when each Service is written alone. When a
    /// batch stops short, what it wrote is known (the ones before the failure): the landed
    /// backends enter the mirror, unreferenced; when the backends or the entries the master
    /// entries lead to stop short, the landed ones of the latter are undone and every member is
    /// returned; when the master entries stop short, the Service whose master entry failed is
    /// undone as `execute` undoes one (its entries retired if one of its master entries
    /// landed), the Services after it lose their prepared entries (no reader could reach
    /// them), and those are returned. What is returned is planned and written alone, each
    /// Service reporting its own error.
    fn execute_chunk<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        members: Vec<(ServicePlan, UnitPlan)>,
        now: Instant,
        unreferenced: &mut Vec<BackendId>,
        report: &mut SyncReport,
    ) -> Vec<ServicePlan> {
        let alone = |members: Vec<(ServicePlan, UnitPlan)>| -> Vec<ServicePlan> {
            members.into_iter().map(|(s, _)| s).collect()
        };
        // Spent whatever happens next, as in `execute`.
        for (_, u) in &members {
            self.ids.next_frontend =
                (self.ids.next_frontend).max(u.max_frontend_id.saturating_add(1));
            self.ids.next_backend = (self.ids.next_backend).max(u.max_backend_id.saturating_add(1));
        }
        if let Some(m) = members.iter().rev().find_map(|(_, u)| u.meta) {
            if w.op(&Op::PutMeta(m)).is_err() {
                return alone(members);
            }
            self.ids.frontend_hwm = m.frontend_id_hwm;
            self.ids.backend_hwm = m.backend_id_hwm;
        }

        let new_backends = || members.iter().flat_map(|(_, u)| &u.new_backends);
        let backend_ops: Vec<Op> = new_backends()
            .map(|(id, sa, protocol)| Op::PutBackend(*id, plan::backend_value(*id, *sa, *protocol)))
            .collect();
        // No master entry leads to the backends or to any of these yet: their order does not
        // matter to readers, and grouped by map they go in a few batches, the backends beside
        // the rest where the store can.
        let mut prepare: Vec<&(Op, Option<Op>)> =
            members.iter().flat_map(|(_, u)| &u.prepare).collect();
        prepare.sort_by_key(|(op, _)| op.map());
        let ops: Vec<Op> = prepare.iter().map(|(op, _)| op.clone()).collect();
        let [(backends_landed, backends), (landed, r)] = w.batches(&backend_ops, &ops);
        drop((backend_ops, ops));
        // As in `execute`: unreferenced until a master entry names it, retired at the end
        // of the sync if nothing does; the Services written alone find it here.
        for (id, sa, protocol) in new_backends().take(backends_landed) {
            self.backends.insert(*id, BackendKey::new(*sa, *protocol));
            self.usage.backends += 1;
            unreferenced.push(*id);
        }
        if backends.is_err() || r.is_err() {
            for (_, undo) in prepare[..landed].iter().rev() {
                if let Some(undo) = undo {
                    w.try_op(undo);
                }
            }
            return alone(members);
        }
        drop(prepare);

        let ops: Vec<Op> = members
            .iter()
            .flat_map(|(_, u)| u.add.iter().cloned())
            .collect();
        let (landed, r) = w.batch(&ops);
        let mut redo = Vec::new();
        let mut start = 0;
        for (service, unit) in members {
            let end = start + unit.add.len();
            if r.is_ok() || end <= landed {
                let (written, removed) = self.commit_unit(w, unit, now, unreferenced);
                report.frontends_written += written;
                report.frontends_removed += removed;
            } else if start < landed {
                for op in unit.add[..landed - start].iter().rev() {
                    if let Op::PutService(k, _) = op {
                        w.try_op(&Op::DelService(*k));
                    }
                }
                self.retire_prepared(w, &unit.prepare, &unit.tables, now);
                redo.push(service);
            } else {
                self.undo_prepare(w, &unit.prepare, &unit.tables);
                redo.push(service);
            }
            start = end;
        }
        redo
    }
}

/// The mirror's size from which a sync packs its tree as it grows (`execute_plan`): below it
/// the half-empty nodes cost little. Small in unit tests, so that their syncs go through it.
const PACK_FROM: usize = if cfg!(test) { 16 } else { 16_384 };

/// The Services of a sync still to write, in order: those put back in front, then the plan's
/// in its order, then those put back at the end. The plan's are taken from the end of their
/// vector, reversed once, which gives its memory back as it empties (13.7 MiB of a 100,000
/// Service outline held to the end of the first sync, the moment of its peak).
struct Queue {
    front: VecDeque<(ServicePlan, bool)>,
    planned: Vec<ServicePlan>,
    outline: bool,
    back: VecDeque<(ServicePlan, bool)>,
}

impl Queue {
    fn new(mut planned: Vec<ServicePlan>, outline: bool) -> Queue {
        planned.reverse();
        Queue {
            front: VecDeque::new(),
            planned,
            outline,
            back: VecDeque::new(),
        }
    }

    /// The next Service, and whether it may join a chunk (an outline's, not put back).
    fn pop_front(&mut self) -> Option<(ServicePlan, bool)> {
        if let Some(s) = self.front.pop_front() {
            return Some(s);
        }
        if let Some(s) = self.planned.pop() {
            // Halved capacity given back (glibc shrinks a block in place, without a copy).
            if self.planned.len() < self.planned.capacity() / 2 {
                self.planned.shrink_to_fit();
            }
            return Some((s, self.outline));
        }
        self.back.pop_front()
    }

    fn push_front(&mut self, s: (ServicePlan, bool)) {
        self.front.push_front(s);
    }

    fn push_back(&mut self, s: (ServicePlan, bool)) {
        self.back.push_back(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(owner: &str) -> ServicePlan {
        ServicePlan {
            owner: owner.to_string(),
            upserts: Vec::new(),
            gone: Vec::new(),
            plan: None,
        }
    }

    /// The order the single queue it replaced gave: put back in front, then the plan's in
    /// order (may join a chunk), then put back at the end; and the plan's vector shrinks.
    #[test]
    fn the_queue_keeps_the_order_and_gives_memory_back() {
        let planned: Vec<ServicePlan> = (0..64).map(|i| service(&format!("p{i:02}"))).collect();
        let mut q = Queue::new(planned, true);
        let mut order = Vec::new();
        let mut take = |q: &mut Queue| {
            let (s, batched) = q.pop_front().unwrap();
            order.push(format!("{}{}", s.owner, if batched { "" } else { "*" }));
        };
        take(&mut q);
        q.push_back((service("b1"), false));
        q.push_front((service("f1"), false));
        q.push_front((service("f0"), false));
        take(&mut q);
        take(&mut q);
        take(&mut q);
        q.push_back((service("b2"), false));
        while q.planned.len() > 8 {
            take(&mut q);
        }
        assert!(q.planned.capacity() < 32, "{}", q.planned.capacity());
        while q.pop_front().is_some_and(|(s, _)| s.owner != "p63") {}
        take(&mut q);
        take(&mut q);
        assert!(q.pop_front().is_none());
        assert_eq!(order[..4], ["p00", "f0*", "f1*", "p01"]);
        assert_eq!(order[order.len() - 2..], ["b1*", "b2*"]);
    }
}
