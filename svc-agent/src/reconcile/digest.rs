//! The drift check's fingerprint of the maps the agent writes (docs/design/architecture.md,
//! "The drift check"): a reader beside the event loop sums the entries it finds, the loop sums
//! what its mirror says is there, and only a difference costs a full check (read back,
//! rebuild the mirror, sync every Service), which at 100,000 Services of 10 endpoints held the
//! loop for 2 to 3 seconds.

use std::hash::BuildHasher;

use svc_common::{
    map_names, svc_flags, AffinityMatchKey, Backend, BackendId, DatapathConfig, MaglevIndex,
    MetaValue, ServiceKey, ServiceName, ServiceValue, SrcRangeKey, PROTO_ANY,
};

use super::{
    encode_name, maglev_key, marker_key, marker_value, plan::rev_nat_value, service_key, Entry,
    Programmed, Seeded,
};
use crate::store::Op;

/// The maps a digest covers, in `Digest::maps`' order. The ones left out are compared on the
/// loop, where they are small (META, CONFIG, SRC_RANGES), or kept by checks of their own
/// (NODE_ADDR_BITS, SERVICE_STATS); the Maglev tables are never changed where they are.
pub const MAPS: [&str; 8] = [
    map_names::SERVICES,
    map_names::SLOTS,
    map_names::BACKENDS,
    map_names::REV_NAT,
    map_names::NAMES,
    map_names::AFFINITY_MATCH,
    map_names::NODE_ADDRS,
    map_names::MAGLEV_INDEX,
];

/// Shards of each map's keys: what the loop writes while the thread reads, and what is
/// retiring, leaves its shards out of one comparison, the rest is compared.
pub const SHARDS: usize = 1024;

/// The shard of a key of map `MAPS[map]`: the same function for the reader, the mirror and
/// the loop's writes, so a fixed seed.
fn shard(map: usize, key: &[u8]) -> usize {
    const SHARDING: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x5eed);
    map * SHARDS + (SHARDING.hash_one(key) as usize % SHARDS)
}

/// Per shard of each map of `MAPS`: how many entries, and the wrapping sum of a keyed hash
/// of each entry's key and value bytes. A sum, not a hash of a sequence: the kernel's order
/// of a hash map is not the mirror's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digest {
    sums: Vec<(u64, u64)>,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            sums: vec![(0, 0); MAPS.len() * SHARDS],
        }
    }
}

/// Shards left out of a comparison: written by the loop while the thread read
/// (`BpfStore::dirty`), or holding retiring entries, which the mirror no longer names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dirty(Vec<u64>);

impl Default for Dirty {
    fn default() -> Self {
        Dirty(vec![0; MAPS.len() * SHARDS / 64])
    }
}

impl Dirty {
    pub fn mark(&mut self, map: usize, key: &[u8]) {
        let s = shard(map, key);
        self.0[s / 64] |= 1 << (s % 64);
    }

    /// Marks the shard of the entry `op` writes, if a digest covers its map.
    pub fn mark_op(&mut self, op: &Op) {
        use bytemuck::bytes_of as b;
        let (map, key) = match op {
            Op::PutService(k, _) | Op::DelService(k) => (0, b(k)),
            Op::PutSlot(k, _) | Op::DelSlot(k) => (1, b(k)),
            Op::PutBackend(k, _) | Op::DelBackend(k) => (2, b(k)),
            Op::PutRevNat(k, _) | Op::DelRevNat(k) => (3, b(k)),
            Op::PutName(k, _) | Op::DelName(k) => (4, b(k)),
            Op::PutMatch(k) | Op::DelMatch(k) => (5, b(k)),
            Op::PutNodeAddr(k, _) | Op::DelNodeAddr(k) => (6, b(k)),
            Op::PutMaglevIndex(k, _) | Op::DelMaglevIndex(k) => (7, b(k)),
            Op::PutMeta(_)
            | Op::PutRange(_)
            | Op::DelRange(_)
            | Op::PutConfig(_)
            | Op::PutMaglev(..)
            | Op::DelMaglevPage(_) => return,
        };
        self.mark(map, key);
    }

    pub fn union(&mut self, other: &Dirty) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a |= b;
        }
    }

    pub fn has(&self, s: usize) -> bool {
        self.0[s / 64] & (1 << (s % 64)) != 0
    }

    /// How many shards are marked.
    pub fn count(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// Why the mirror gives no digest to compare with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsure {
    /// The mirror knows the maps differ from what it wants (leftovers to delete, a frontend
    /// missing slots or entries, a Maglev table to place, a backend a failed retirement
    /// left): a full check settles it.
    Pending,
}

impl Digest {
    /// Adds one entry of map `MAPS[map]`.
    pub fn add<K: bytemuck::Pod, V: bytemuck::Pod>(
        &mut self,
        hasher: &Seeded,
        map: usize,
        k: &K,
        v: &V,
    ) {
        let (k, v) = (bytemuck::bytes_of(k), bytemuck::bytes_of(v));
        let h = hasher.hash_one((map, k, v));
        let (n, sum) = &mut self.sums[shard(map, k)];
        *n += 1;
        *sum = sum.wrapping_add(h);
    }

    /// A SERVICES entry, as the full check's recovery reads it: a marker-shaped key with the
    /// marker flag is a marker whatever else its value holds, and the padding is not read.
    /// What recovery does not read, the full check cannot repair: summed, it would send every
    /// check to the full one.
    pub fn service(&mut self, hasher: &Seeded, k: &ServiceKey, v: &ServiceValue) {
        if k.port_be == 0 && k.proto == PROTO_ANY && v.flags & svc_flags::ADDR_MARKER != 0 {
            let ip = super::ip_from16(k.addr);
            return self.add(hasher, 0, &marker_key(ip), &marker_value());
        }
        self.add(hasher, 0, k, &ServiceValue { _pad0: 0, ..*v });
    }

    /// A BACKENDS entry: of its flags, recovery reads LOCAL only.
    pub fn backend(&mut self, hasher: &Seeded, id: &BackendId, v: &Backend) {
        let flags = v.flags & svc_common::backend_flags::LOCAL;
        self.add(hasher, 2, id, &Backend { flags, ..*v });
    }

    /// A NAMES entry: recovery reads the name up to its first NUL.
    pub fn name(&mut self, hasher: &Seeded, id: &u32, v: &ServiceName) {
        self.add(hasher, 4, id, &encode_name(&super::decode_name(v)));
    }

    /// An AFFINITY_MATCH entry: its key is all recovery reads.
    pub fn member(&mut self, hasher: &Seeded, k: &AffinityMatchKey) {
        self.add(hasher, 5, k, &0u32);
    }

    /// The names of the maps with a shard outside `dirty` whose sums differ.
    pub fn differ(&self, other: &Digest, dirty: &Dirty) -> Vec<&'static str> {
        (MAPS.iter().enumerate())
            .filter(|(m, _)| {
                (m * SHARDS..(m + 1) * SHARDS)
                    .any(|s| !dirty.has(s) && self.sums[s] != other.sums[s])
            })
            .map(|(_, name)| *name)
            .collect()
    }

    /// The digest of a snapshot's entries, as the reader makes it from the maps.
    #[cfg(test)]
    pub fn of_snapshot(snap: &crate::store::Snapshot, hasher: &Seeded) -> Digest {
        let mut d = Digest::default();
        for (k, v) in &snap.services {
            d.service(hasher, k, v);
        }
        for (k, v) in &snap.slots {
            d.add(hasher, 1, k, v);
        }
        for (k, v) in &snap.backends {
            d.backend(hasher, k, v);
        }
        for (k, v) in &snap.rev_nat {
            d.add(hasher, 3, k, v);
        }
        for (k, v) in &snap.names {
            d.name(hasher, k, v);
        }
        for k in &snap.matches {
            d.member(hasher, k);
        }
        for (k, v) in &snap.node_addrs {
            d.add(hasher, 6, k, v);
        }
        for (k, v) in &snap.maglev_index {
            d.add(hasher, 7, k, v);
        }
        d
    }
}

impl Programmed {
    /// The digest of what the maps hold if nothing but this agent wrote them, with the shards
    /// of the entries that are retiring (in the maps for their grace period, no longer in the
    /// mirror); or why there is none to compare with.
    pub fn digest(&self, hasher: &Seeded) -> Result<(Digest, Dirty), Unsure> {
        // Leftovers to delete, Maglev tables still to place, a backend a failed retirement
        // left: the full check's sync is what deals with them.
        let left_behind = (self.backends.unreferenced()).any(|id| !self.retiring.has_backend(id));
        if !self.strays.is_empty()
            || self.config.is_none()
            || !self.maglev.roomless.is_empty()
            || left_behind
        {
            return Err(Unsure::Pending);
        }
        let mut retiring = Dirty::default();
        self.retiring.mark(&mut retiring);
        let mut d = Digest::default();
        for ip in &self.markers {
            d.service(hasher, &marker_key(*ip), &marker_value());
        }
        for (fe, pf) in &self.frontends {
            let whole = pf.complete()
                && pf.name_entry == Entry::Ok
                && pf.rev_nat_entry == Entry::Ok
                && pf.flags & svc_common::svc_flags::MAGLEV == 0;
            if !whole {
                return Err(Unsure::Pending);
            }
            let v: ServiceValue = pf.value();
            d.service(hasher, &service_key(fe), &v);
            for (k, g) in super::slot_entries(pf.id, pf.rev, &pf.backends) {
                d.add(hasher, 1, &k, &g);
            }
            d.add(hasher, 3, &pf.id, &rev_nat_value(fe));
            d.name(hasher, &pf.id, &encode_name(&pf.name));
            for b in &pf.matches {
                let k = svc_common::AffinityMatchKey {
                    id: pf.id,
                    backend: *b,
                };
                d.member(hasher, &k);
            }
            if let Some(t) = &pf.maglev {
                let v: MaglevIndex = t.index();
                d.add(hasher, 7, &maglev_key(pf.id, pf.rev), &v);
            }
        }
        for (id, key) in self.backends.iter() {
            let v = super::plan::backend_value(id, key.backend(), key.protocol);
            d.backend(hasher, &id, &v);
        }
        for (k, v) in &self.node_addrs {
            d.add(hasher, 6, k, v);
        }
        Ok((d, retiring))
    }

    /// The maps a digest leaves out whose contents, as read (None: not readable), differ from
    /// what this agent wrote: META, CONFIG, SRC_RANGES.
    pub fn small_maps_differ(
        &self,
        meta: Option<MetaValue>,
        config: Option<DatapathConfig>,
        ranges: Option<Vec<SrcRangeKey>>,
    ) -> Vec<&'static str> {
        let wrote_meta = MetaValue {
            frontend_id_hwm: self.ids.frontend_hwm,
            backend_id_hwm: self.ids.backend_hwm,
            _reserved: [0; 6],
        };
        let mut wrote_ranges: Vec<SrcRangeKey> = (self.frontends.values())
            .flat_map(|pf| pf.ranges.iter().map(|c| super::range_key(pf.id, c)))
            .collect();
        wrote_ranges.sort();
        for k in self.retiring.ranges() {
            wrote_ranges.push(*k);
        }
        wrote_ranges.sort();
        wrote_ranges.dedup();
        // Of META, recovery reads the high-water marks only.
        let meta = meta.map(|m| MetaValue {
            _reserved: [0; 6],
            ..m
        });
        let mut differ = Vec::new();
        if meta != Some(wrote_meta) {
            differ.push(map_names::META);
        }
        if config.is_none() || config != self.config {
            differ.push(map_names::CONFIG);
        }
        if ranges.map(|mut r| {
            r.sort();
            r
        }) != Some(wrote_ranges)
        {
            differ.push(map_names::SRC_RANGES);
        }
        differ
    }
}
