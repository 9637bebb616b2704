//! The mirror's backends (`Programmed::backends`).

use std::hash::BuildHasher;

use hashbrown::HashTable;
use svc_common::BackendId;

use super::{BackendKey, Seeded};

/// Every backend entry the agent knows to be in the maps: its id, its address and how many
/// slots of current generations name it; and for each address, the id its new slots use. The
/// entries sit in one vector, found by id through their index in `BACKENDS` (one id an index)
/// and by address through a table of their 4-byte positions: three std maps keyed by id and by
/// address (with the count apart) take about 118 MB at 1,000,000 backends by their sizing, two
/// tables of positions took 48 MB, this 44 MB.
#[derive(Debug)]
pub struct Backends {
    entries: Blocks<Slot>,
    /// `BACKENDS`' max_entries, and which of its indexes (`backend_index`) these entries
    /// take, a bit each: a new id goes only where the bit is clear.
    map_entries: u32,
    taken: Vec<u64>,
    /// Positions of removed entries, reused first.
    vacant: Vec<u32>,
    /// Per index of `BACKENDS`, the position of the entry there plus one (0: none): an index
    /// holds one id at most, as the map does (`take_index`). 4 bytes an index, resident as
    /// written, where a table by id took 10.5 MB at 1,000,000 backends.
    at_index: Vec<u32>,
    /// One position per address: that of the id its new slots use. An address two entries
    /// have (a crash between writes) is here once (`choose_ids`).
    by_key: HashTable<u32>,
    hasher: Seeded,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// 0: vacant (0 is no backend id).
    id: BackendId,
    /// Slots of current generations that name it.
    refs: u32,
    key: BackendKey,
}

impl Default for Backends {
    fn default() -> Self {
        Backends::new(svc_common::capacity::BACKENDS)
    }
}

impl Backends {
    /// No entries, for a `BACKENDS` of `map_entries` entries.
    pub fn new(map_entries: u32) -> Backends {
        Backends {
            entries: Blocks::default(),
            map_entries: map_entries.max(1),
            taken: Vec::new(),
            vacant: Vec::new(),
            at_index: Vec::new(),
            by_key: HashTable::new(),
            hasher: Seeded::default(),
        }
    }

    /// `BACKENDS`' max_entries, by which an id gives its index.
    pub fn map_entries(&self) -> u32 {
        self.map_entries
    }

    /// Whether an entry here holds index `index` of `BACKENDS`.
    pub fn index_taken(&self, index: u32) -> bool {
        let (word, bit) = (index as usize / 64, index % 64);
        self.taken.get(word).is_some_and(|w| w & (1 << bit) != 0)
    }

    /// How many indexes from `index` on, within its word of the bitmap, these entries take
    /// (0: `index` is free).
    pub fn taken_run(&self, index: u32) -> u32 {
        let (word, bit) = (index as usize / 64, index % 64);
        let w = self.taken.get(word).map_or(0, |w| w >> bit);
        (!w).trailing_zeros().min(64 - bit)
    }

    fn take_index(&mut self, id: BackendId, taken: bool) {
        let i = svc_common::backend_index(id, self.map_entries);
        let (word, bit) = (i as usize / 64, i % 64);
        if word >= self.taken.len() {
            self.taken
                .resize((self.map_entries as usize).div_ceil(64).max(word + 1), 0);
        }
        if taken {
            debug_assert!(!self.index_taken(i), "backend {id}: index {i} taken twice");
            self.taken[word] |= 1 << bit;
        } else {
            self.taken[word] &= !(1 << bit);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len() - self.vacant.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Room for `n` more entries, so that a table filled at once (a restart's) is allocated
    /// once rather than at every doubling, with the old table beside the new.
    pub fn reserve(&mut self, n: usize) {
        let Backends {
            entries,
            vacant,
            by_key,
            hasher,
            ..
        } = self;
        entries.reserve(n.saturating_sub(vacant.len()));
        by_key.reserve(n, |&i| hasher.hash_one(entries[i as usize].key));
    }

    fn position(&self, id: BackendId) -> Option<usize> {
        let i = svc_common::backend_index(id, self.map_entries) as usize;
        let at = self.at_index.get(i).copied().filter(|&p| p != 0)? as usize - 1;
        (self.entries[at].id == id).then_some(at)
    }

    pub fn get(&self, id: BackendId) -> Option<&BackendKey> {
        self.position(id).map(|i| &self.entries[i].key)
    }

    pub fn contains(&self, id: BackendId) -> bool {
        self.position(id).is_some()
    }

    /// The id new slots of `key` use.
    pub fn id_of(&self, key: &BackendKey) -> Option<BackendId> {
        let h = self.hasher.hash_one(key);
        (self.by_key)
            .find(h, |&i| self.entries[i as usize].key == *key)
            .map(|&i| self.entries[i as usize].id)
    }

    /// Adds backend `id` (not known yet; 0 is no id) at `key`, the id new slots of `key` use
    /// from now on.
    pub fn insert(&mut self, id: BackendId, key: BackendKey) {
        let added = self.add(id, key);
        debug_assert!(added.is_some(), "backend {id} inserted twice");
        if let Some(i) = added {
            self.index_key(i);
        }
    }

    /// Adds backend `id` at `key` without making it the id of `key` (`choose_ids` does, once
    /// all are in); None if `id` is 0 or already known, or (never by the planner's choice of
    /// ids, nor from the map, which holds one id an index) if another id holds its index.
    pub(super) fn add(&mut self, id: BackendId, key: BackendKey) -> Option<usize> {
        if id == 0 || self.contains(id) {
            return None;
        }
        let index = svc_common::backend_index(id, self.map_entries);
        if self.index_taken(index) {
            debug_assert!(false, "backend {id}: index {index} taken by another id");
            return None;
        }
        let slot = Slot { id, refs: 0, key };
        self.take_index(id, true);
        let i = match self.vacant.pop() {
            Some(i) => {
                self.entries[i as usize] = slot;
                i
            }
            None => {
                self.entries.push(slot);
                (self.entries.len() - 1) as u32
            }
        };
        if self.at_index.is_empty() {
            // Zeroed by the allocator (calloc), not written: pages untouched stay unallocated.
            self.at_index = vec![0; self.map_entries as usize];
        }
        self.at_index[index as usize] = i + 1;
        Some(i as usize)
    }

    /// Makes the entry at `i` the one of its address.
    fn index_key(&mut self, i: usize) {
        let Backends {
            entries,
            by_key,
            hasher,
            ..
        } = self;
        let key = entries[i].key;
        let h = hasher.hash_one(key);
        match by_key.find_mut(h, |&j| entries[j as usize].key == key) {
            Some(j) => *j = i as u32,
            None => {
                by_key.insert_unique(h, i as u32, |&j| hasher.hash_one(entries[j as usize].key));
            }
        }
    }

    /// Removes backend `id`; its address is left without an id if `id` was its.
    pub fn remove(&mut self, id: BackendId) -> Option<BackendKey> {
        let i = self.position(id)? as u32;
        let key = self.entries[i as usize].key;
        self.at_index[svc_common::backend_index(id, self.map_entries) as usize] = 0;
        if let Ok(e) = (self.by_key).find_entry(self.hasher.hash_one(key), |&j| j == i) {
            e.remove();
        }
        self.entries[i as usize].id = 0;
        self.vacant.push(i);
        self.take_index(id, false);
        Some(key)
    }

    /// Slots of current generations that name `id`.
    pub fn refs(&self, id: BackendId) -> u32 {
        self.position(id).map_or(0, |i| self.entries[i].refs)
    }

    /// One more slot names `id` (a known backend).
    pub fn add_ref(&mut self, id: BackendId) {
        let found = self.position(id);
        debug_assert!(
            found.is_some(),
            "a slot names backend {id}, not in the mirror"
        );
        if let Some(i) = found {
            self.entries[i].refs += 1;
        }
    }

    /// One slot fewer names `id`: true when that was the last.
    pub fn unref(&mut self, id: BackendId) -> bool {
        match self.position(id) {
            Some(i) if self.entries[i].refs > 0 => {
                self.entries[i].refs -= 1;
                self.entries[i].refs == 0
            }
            _ => false,
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (BackendId, &BackendKey)> {
        (self.entries.iter())
            .filter(|s| s.id != 0)
            .map(|s| (s.id, &s.key))
    }

    /// The ids no slot of a current generation names.
    pub fn unreferenced(&self) -> impl Iterator<Item = BackendId> + '_ {
        (self.entries.iter())
            .filter(|s| s.id != 0 && s.refs == 0)
            .map(|s| s.id)
    }

    /// For each address: the id of its entries that slots name, the lower if several or none
    /// do (after a restart; `add` put them in).
    pub fn choose_ids(&mut self) {
        let rank = |s: &Slot| (s.refs == 0, s.id);
        for i in 0..self.entries.len() {
            let s = self.entries[i];
            if s.id == 0 {
                continue;
            }
            let h = self.hasher.hash_one(s.key);
            let entries = &self.entries;
            let better = match self.by_key.find(h, |&j| entries[j as usize].key == s.key) {
                Some(&j) => rank(&s) < rank(&entries[j as usize]),
                None => true,
            };
            if better {
                self.index_key(i);
            }
        }
    }
}

/// Entries in blocks of `BLOCK`, each allocated whole when the one before is full: a vector
/// grown by doubling holds the old and the new buffer at once while it moves, 44 MB at
/// 1,000,000 backends, the cold start's heap peak by heaptrack. A block's room is resident
/// only as it is written.
#[derive(Debug)]
struct Blocks<T> {
    blocks: Vec<Vec<T>>,
    len: usize,
}

/// 65,536 entries a block: 1.8 MB of `Slot`s.
const BLOCK: usize = 1 << 16;

impl<T> Default for Blocks<T> {
    fn default() -> Self {
        Blocks {
            blocks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Blocks<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, v: T) {
        if self.len == self.blocks.len() * BLOCK {
            self.blocks.push(Vec::with_capacity(BLOCK));
        }
        self.blocks[self.len / BLOCK].push(v);
        self.len += 1;
    }

    /// Room for `n` more entries' blocks in the list of blocks (the blocks come as filled).
    fn reserve(&mut self, n: usize) {
        let want = (self.len + n).div_ceil(BLOCK);
        self.blocks.reserve(want.saturating_sub(self.blocks.len()));
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.blocks.iter().flatten()
    }
}

impl<T> std::ops::Index<usize> for Blocks<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.blocks[i / BLOCK][i % BLOCK]
    }
}

impl<T> std::ops::IndexMut<usize> for Blocks<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.blocks[i / BLOCK][i % BLOCK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Backend, Protocol};

    fn key(s: &str) -> BackendKey {
        BackendKey::new(Backend::remote(s.parse().unwrap()), Protocol::Tcp)
    }

    /// Entries past a block's end go into the next block, found and listed in push order.
    #[test]
    fn blocks_hold_entries_across_their_ends() {
        let mut b = Blocks::default();
        let n = 2 * BLOCK + 3;
        for i in 0..n {
            b.push(i as u32);
        }
        assert_eq!((b.len(), b.blocks.len()), (n, 3));
        assert_eq!(
            (b[BLOCK - 1], b[BLOCK], b[n - 1]),
            (BLOCK as u32 - 1, BLOCK as u32, n as u32 - 1)
        );
        b[BLOCK] = 7;
        assert_eq!(b[BLOCK], 7);
        assert!(b
            .iter()
            .enumerate()
            .all(|(i, &v)| v == i as u32 || i == BLOCK));
    }

    #[test]
    fn ids_addresses_and_counts_follow_inserts_and_removals() {
        let mut b = Backends::default();
        let (a, c) = (key("10.0.0.1:80"), key("10.0.0.2:80"));
        b.insert(1, a);
        b.insert(2, c);
        assert_eq!(b.add(2, a), None, "an id is added once");
        assert_eq!(b.add(0, a), None, "0 is no id");
        assert_eq!((b.len(), b.id_of(&a), b.id_of(&c)), (2, Some(1), Some(2)));
        assert_eq!(b.get(2), Some(&c));
        b.add_ref(1);
        b.add_ref(1);
        assert!(!b.unref(1));
        assert!(b.unref(1));
        assert!(!b.unref(1), "no count below zero");
        assert_eq!(b.remove(1), Some(a));
        assert_eq!((b.len(), b.id_of(&a), b.get(1)), (1, None, None));
        assert_eq!(b.remove(1), None);
        // The vacant entry is reused.
        b.insert(3, a);
        assert_eq!(b.entries.len(), 2);
        assert_eq!(b.id_of(&a), Some(3));
        let mut all: Vec<_> = b.iter().map(|(id, k)| (id, *k)).collect();
        all.sort_by_key(|(id, _)| *id);
        assert_eq!(all, vec![(2, c), (3, a)]);
    }

    /// Each entry takes its id's index of `BACKENDS` (id modulo its size) while it is here;
    /// runs of taken indexes are told a word of the bitmap at a time.
    #[test]
    fn entries_take_the_index_of_their_id() {
        let mut b = Backends::new(100);
        for id in [3, 4, 5, 163, 70] {
            b.insert(id, key(&format!("10.0.0.{}:80", id % 250)));
        }
        let taken: Vec<u32> = (0..100).filter(|&i| b.index_taken(i)).collect();
        assert_eq!(taken, [3, 4, 5, 63, 70]);
        assert_eq!((b.taken_run(3), b.taken_run(5), b.taken_run(6)), (3, 1, 0));
        // 63 ends the first word: the run stops there.
        assert_eq!(b.taken_run(63), 1);
        b.remove(4);
        assert_eq!((b.index_taken(4), b.taken_run(3)), (false, 1));
        b.remove(163);
        assert!(!b.index_taken(63));
        assert_eq!(b.taken_run(99), 0);
    }

    #[test]
    fn an_address_with_two_ids_keeps_the_one_slots_name_else_the_lower() {
        let a = key("10.0.0.1:80");
        for (named, want) in [(None, 4), (Some(7), 7), (Some(4), 4)] {
            let mut b = Backends::default();
            for id in [7, 4, 9] {
                b.add(id, a);
            }
            assert_eq!(b.id_of(&a), None);
            if let Some(id) = named {
                b.add_ref(id);
            }
            b.choose_ids();
            assert_eq!(b.id_of(&a), Some(want), "named {named:?}");
            // Removing another id leaves the address's as it is; removing its own clears it.
            b.remove(9);
            assert_eq!(b.id_of(&a), Some(want));
            b.remove(want);
            assert_eq!(b.id_of(&a), None);
        }
    }
}
