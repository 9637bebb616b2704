//! Retirement: what a switch made unreachable waits out the grace period, then is deleted.

use std::collections::VecDeque;
use std::time::Instant;

use svc_common::{BackendId, SlotKey};

use super::{maglev_key, HashMap, HashSet, Programmed, TableRef, Writer};
use crate::error::Error;
use crate::store::{Op, Store};
use tracing::warn;

/// Something a switch made unreachable, deleted once the grace period has passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Retire {
    /// The `count` slots of generation `rev` of frontend `id` (`slot_keys`), and its Maglev
    /// table (index entry and region) if it had one.
    Slots {
        id: u32,
        rev: u16,
        count: u16,
        table: Option<TableRef>,
    },
    /// A Maglev table no master entry leads to any more: its region is freed, and the index
    /// entry `key` deleted unless a current generation's table is there again (a table
    /// replaced under the same generation, an algorithm changed back).
    Table { key: SlotKey, table: TableRef },
    /// The reverse-NAT and name entries of a removed frontend.
    Ids(u32),
    /// A backend no slot names any more (deleted only if that is still true when due).
    Backend(BackendId),
    /// One entry: a leftover found in the maps, or what a failed Service's sync had written.
    Del(Op),
}

impl Retire {
    /// The Maglev index key it deletes, if any.
    fn maglev_key(&self) -> Option<SlotKey> {
        match self {
            Retire::Slots {
                id,
                rev,
                table: Some(_),
                ..
            } => Some(maglev_key(*id, *rev)),
            Retire::Table { key, .. } | Retire::Del(Op::DelMaglevIndex(key)) => Some(*key),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
pub struct Retiring {
    queue: VecDeque<(Instant, Retire)>,
    /// Generations and ids with entries in the queue, with how many queue items name them:
    /// no new generation or id may be written over them.
    slot_gens: HashMap<(u32, u16), u32>,
    ids: HashMap<u32, u32>,
    backends: HashSet<BackendId>,
    /// Maglev index keys with entries in the queue.
    tables: HashMap<SlotKey, u32>,
}

impl Retiring {
    pub(super) fn push(&mut self, due: Instant, r: Retire) {
        if let Some(k) = r.maglev_key() {
            *self.tables.entry(k).or_default() += 1;
        }
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
            Retire::Del(_) | Retire::Table { .. } => {}
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
        if let Some(k) = r.maglev_key() {
            dec(&mut self.tables, k);
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
            Retire::Del(_) | Retire::Table { .. } => {}
        }
    }

    /// Whether an entry in the queue deletes (or keeps) the Maglev index entry `k`.
    pub fn has_table_key(&self, k: &SlotKey) -> bool {
        self.tables.contains_key(k)
    }

    /// The regions of `SVC_MAGLEV` the queue will free: in use until then.
    pub fn tables(&self) -> impl Iterator<Item = &TableRef> {
        self.queue.iter().filter_map(|(_, r)| match r {
            Retire::Slots { table, .. } => table.as_ref(),
            Retire::Table { table, .. } => Some(table),
            _ => None,
        })
    }

    /// Marks the shards of every entry the queue will delete (or, for a backend, may).
    pub fn mark(&self, dirty: &mut super::digest::Dirty) {
        use bytemuck::bytes_of as b;
        for (_, r) in &self.queue {
            match r {
                Retire::Slots {
                    id,
                    rev,
                    count,
                    table,
                } => {
                    for k in super::slot_keys(*id, *rev, *count) {
                        dirty.mark(1, b(&k));
                    }
                    if table.is_some() {
                        dirty.mark(7, b(&maglev_key(*id, *rev)));
                    }
                }
                Retire::Table { key, .. } => dirty.mark(7, b(key)),
                Retire::Ids(id) => {
                    dirty.mark(3, b(id));
                    dirty.mark(4, b(id));
                }
                Retire::Backend(id) => dirty.mark(2, b(id)),
                Retire::Del(op) => dirty.mark_op(op),
            }
        }
    }

    /// The source ranges the queue will delete.
    pub fn ranges(&self) -> impl Iterator<Item = &svc_common::SrcRangeKey> {
        self.queue.iter().filter_map(|(_, r)| match r {
            Retire::Del(Op::DelRange(k)) => Some(k),
            _ => None,
        })
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

/// What one pass over due retirements did.
#[derive(Debug, Default)]
pub struct RetireReport {
    pub deleted: usize,
    pub errors: Vec<Error>,
}

impl Programmed {
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
                Retire::Slots {
                    id,
                    rev,
                    count,
                    table,
                } => {
                    for k in super::slot_keys(id, rev, count) {
                        if w.try_op(&Op::DelSlot(k)) {
                            self.usage.slots = self.usage.slots.saturating_sub(1);
                            report.deleted += 1;
                        }
                    }
                    if let Some(t) = table {
                        report.deleted += self.retire_table(&mut w, maglev_key(id, rev), &t);
                    }
                }
                Retire::Table { key, table } => {
                    report.deleted += self.retire_table(&mut w, key, &table);
                }
                Retire::Del(Op::DelMaglevIndex(key)) => {
                    if !self.maglev.live.contains_key(&(key.id, key.rev))
                        && w.try_op(&Op::DelMaglevIndex(key))
                    {
                        report.deleted += 1;
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
        report.deleted += self.drop_loose_pages(&mut w);
        report
    }

    /// Deletes each loose page of `SVC_MAGLEV` (`MaglevState::loose`) that holds no region in
    /// use, so the kernel gets its memory back. One a write has taken a block of since is
    /// kept; one whose delete fails is left for a restart to find. Pages deleted.
    pub(super) fn drop_loose_pages<S: Store>(&mut self, w: &mut Writer<'_, S>) -> usize {
        let per = svc_common::MAGLEV_PAGE;
        let mut deleted = 0;
        for p in std::mem::take(&mut self.maglev.loose) {
            if self.maglev.regions.is_free(p.saturating_mul(per), per)
                && w.try_op(&Op::DelMaglevPage(p))
            {
                deleted += 1;
            }
        }
        deleted
    }

    /// Deletes index entry `key` unless a current generation's table is there, and frees
    /// the region of `t`. Entries deleted.
    fn retire_table<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        key: SlotKey,
        t: &TableRef,
    ) -> usize {
        let mut deleted = 0;
        if !self.maglev.live.contains_key(&(key.id, key.rev)) && w.try_op(&Op::DelMaglevIndex(key))
        {
            deleted += 1;
        }
        if !self.maglev.free(t.start, t.blocks()) {
            warn!(
                start = t.start,
                blocks = t.blocks(),
                "a retired Maglev region was not in use"
            );
        }
        deleted
    }

    fn forget_backend(&mut self, id: BackendId) {
        self.backends.remove(id);
    }
}
