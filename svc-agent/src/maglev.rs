//! Maglev tables for the backend choice of external frontends (docs/design/maglev.md).
//!
//! Pure: backends in, table out. Every node must build the same table from the same seed and
//! backends, so the table depends only on the seed and the backends' stable identities
//! (address, port, protocol), never on node-local ids or on the order the backends came in.

use std::collections::BTreeMap;
use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// Table sizes: the largest prime below each power of two from 2^7 to 2^17. A size is a
/// function of the backend count alone (every node must pick the same), and a new size
/// reshuffles the whole table, so sizes come in classes, each twice the one before: adding
/// or removing a backend changes the size only when the count crosses into another class.
pub const SIZES: [u32; 11] = [
    127, 251, 509, 1_021, 2_039, 4_093, 8_191, 16_381, 32_749, 65_521, 131_071,
];
/// The smallest table: the size for one backend.
pub const MIN_SIZE: u32 = SIZES[0];
/// The largest table (2^17 - 1; Cilium's largest choice too): above 1,310 backends the
/// imbalance grows past 1 % rather than a table past 256 KiB.
pub const MAX_SIZE: u32 = SIZES[SIZES.len() - 1];
/// Entries per backend the size stays above: each backend then holds within 1 % of another's
/// share.
pub const ENTRIES_PER_BACKEND: u32 = 100;

/// The second SipHash key of each of the two permutation hashes (the seed is the first), so
/// offset and skip are independent functions of a backend.
const OFFSET_KEY: u64 = u64::from_be_bytes(*b"mglv-off");
const SKIP_KEY: u64 = u64::from_be_bytes(*b"mglv-skp");

/// The Service annotation that chooses the algorithm of its external frontends, overriding
/// `--lb-algorithm-external`.
pub const ANNOTATION: &str = "svc.dev/lb-algorithm";

/// The seed every agent uses unless told otherwise (`--maglev-seed`). Nodes agree only with
/// one seed; the same default everywhere agrees too, so it is a warning, not an error, to
/// leave it.
pub const DEFAULT_SEED: u64 = u64::from_be_bytes(*b"svc-mglv");

/// How a new flow to an external frontend chooses its backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// A table every node builds alike from the seed and the backends (this module).
    #[default]
    Maglev,
    /// `bpf_get_prandom_u32()` over the slots: no agreement between nodes.
    Random,
}

impl Algorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Maglev => "maglev",
            Algorithm::Random => "random",
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "maglev" => Ok(Algorithm::Maglev),
            "random" => Ok(Algorithm::Random),
            other => Err(format!("unknown algorithm {other:?} (maglev or random)")),
        }
    }
}

/// The agent-wide Maglev settings (flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// External frontends without the Service annotation.
    pub external: Algorithm,
    pub seed: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            external: Algorithm::default(),
            seed: DEFAULT_SEED,
        }
    }
}

impl Settings {
    /// The algorithm of a frontend whose Service asked for `annotated` (None: no annotation).
    pub fn external(&self, annotated: Option<Algorithm>) -> Algorithm {
        annotated.unwrap_or(self.external)
    }
}

/// What makes a backend the same backend on every node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity {
    /// IPv4 as `::ffff:a.b.c.d`.
    pub addr: [u8; 16],
    /// Host order.
    pub port: u16,
    /// IPPROTO_TCP, IPPROTO_UDP, ...
    pub proto: u8,
}

impl Identity {
    /// A backend as the slots hold it (`reconcile::addr16`'s address form, the port in host
    /// order, `proto` an IPPROTO number).
    pub fn of(addr: std::net::SocketAddr, proto: u8) -> Identity {
        Identity {
            addr: crate::reconcile::addr16(addr.ip()),
            port: addr.port(),
            proto,
        }
    }

    /// The bytes the permutation hashes read: address, port in network order, protocol.
    fn bytes(&self) -> [u8; 19] {
        let mut b = [0u8; 19];
        b[..16].copy_from_slice(&self.addr);
        b[16..18].copy_from_slice(&self.port.to_be_bytes());
        b[18] = self.proto;
        b
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    #[error("a Maglev table needs at least one backend")]
    NoBackend,
    /// A table entry is a u16 slot number, as the slots are.
    #[error("{0} backends: a Maglev table holds at most 65,535")]
    TooMany(usize),
}

/// A built table: entry `j` is the position, in the list it was built from, of the backend
/// that owns table position `j` (the kernel stores it as the 0-based slot number).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub entries: Vec<u16>,
}

impl Table {
    /// `M`, prime.
    pub fn size(&self) -> u32 {
        self.entries.len() as u32
    }
}

/// The table size for `backends`: the smallest of `SIZES` above 100 per backend, else the
/// largest.
pub fn table_size(backends: usize) -> u32 {
    let want = (backends as u64).saturating_mul(ENTRIES_PER_BACKEND as u64);
    SIZES
        .iter()
        .copied()
        .find(|&m| m as u64 > want)
        .unwrap_or(MAX_SIZE)
}

fn sip(k1: u64, seed: u64, bytes: &[u8]) -> u64 {
    let mut h = SipHasher13::new_with_keys(seed, k1);
    h.write(bytes);
    h.finish()
}

/// Builds the table of `backends` (the frontend's usable set, in slot order) under `seed`.
///
/// The paper's population: each backend walks its own permutation of the table positions
/// (`offset + j * skip mod M`, every `skip` a generator as `M` is prime), and the backends
/// take turns, each taking the next position of its walk still free. One position per
/// backend per round: each ends with `floor(M/N)` or `ceil(M/N)` entries. The turns go in
/// the order of the identities, not of `backends`, so the order backends came in changes
/// only the numbering of the result, never which backend owns a position.
pub fn build(seed: u64, backends: &[Identity]) -> Result<Table, TableError> {
    let n = backends.len();
    if n == 0 {
        return Err(TableError::NoBackend);
    }
    if n > u16::MAX as usize {
        return Err(TableError::TooMany(n));
    }
    let m = table_size(n) as u64;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| backends[i]);
    // (position in `backends`, offset, skip, next step), in identity order.
    let mut walks: Vec<(u16, u64, u64, u64)> = order
        .iter()
        .map(|&i| {
            let b = backends[i].bytes();
            let offset = sip(OFFSET_KEY, seed, &b) % m;
            let skip = sip(SKIP_KEY, seed, &b) % (m - 1) + 1;
            (i as u16, offset, skip, 0)
        })
        .collect();
    const FREE: u32 = u32::MAX;
    let mut entries = vec![FREE; m as usize];
    let mut filled = 0u64;
    'fill: loop {
        for (pos, offset, skip, next) in walks.iter_mut() {
            // Each walk visits every position once in `m` steps, and a free position
            // remains while `filled < m`, so this ends within `m` steps.
            let mut c = ((*offset + *next * *skip) % m) as usize;
            while entries[c] != FREE {
                *next += 1;
                c = ((*offset + *next * *skip) % m) as usize;
            }
            entries[c] = u32::from(*pos);
            *next += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    Ok(Table {
        entries: entries.into_iter().map(|e| e as u16).collect(),
    })
}

impl Table {
    /// The table as `SVC_MAGLEV` holds it: `blocks(size)` blocks, the last padded with 0
    /// (slot 1, never read: the kernel takes `flow_hash % size`).
    pub fn to_blocks(&self) -> Vec<svc_common::MaglevBlock> {
        self.entries
            .chunks(svc_common::MAGLEV_BLOCK as usize)
            .map(|c| {
                let mut b = svc_common::MaglevBlock::default();
                b.entries[..c.len()].copy_from_slice(c);
                b
            })
            .collect()
    }
}

/// Blocks (`svc_common::MaglevBlock`, `MAGLEV_BLOCK` entries each) a table of `size` entries
/// takes in `SVC_MAGLEV`.
pub fn blocks(size: u32) -> u32 {
    size.div_ceil(svc_common::MAGLEV_BLOCK)
}

/// The free space of `SVC_MAGLEV`, in blocks: where a new table goes. First fit: table sizes
/// repeat (one per size class), so a freed region is mostly taken again by a table of its
/// size, and neighbouring free regions are merged when freed.
///
/// A region in use has holders: the index entries that name it (current or retiring), one
/// `alloc`, `take` or `share` each. The external frontends of one Service port share one
/// table (docs/design/maglev.md, Memory), so a region is free again only when its last
/// holder gives it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regions {
    capacity: u32,
    /// Start block -> length, no two touching.
    free: BTreeMap<u32, u32>,
    /// Start block -> (length, holders, at least 1) of each region in use.
    used: BTreeMap<u32, (u32, u32)>,
}

impl Regions {
    /// An empty array of `capacity` blocks.
    pub fn new(capacity: u32) -> Regions {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Regions {
            capacity,
            free,
            used: BTreeMap::new(),
        }
    }

    pub fn free_blocks(&self) -> u32 {
        self.free.values().sum()
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// How many index entries hold the region at `start` (0: not a region in use).
    pub fn holders(&self, start: u32) -> u32 {
        self.used.get(&start).map_or(0, |&(_, n)| n)
    }

    /// Regions in use (each counted once, however many hold it).
    pub fn used_regions(&self) -> usize {
        self.used.len()
    }

    /// Whether no region in use has a block from `start` up to `start + len` (blocks beyond
    /// the array count as free).
    pub fn is_free(&self, start: u32, len: u32) -> bool {
        let end = start.saturating_add(len).min(self.capacity);
        if start >= end {
            return true;
        }
        self.free
            .range(..=start)
            .next_back()
            .is_some_and(|(&f, &have)| f + have >= end)
    }

    /// Whether `len` free blocks lie together somewhere.
    pub fn fits(&self, len: u32) -> bool {
        len > 0 && self.free.values().any(|&have| have >= len)
    }

    /// The start of `len` free blocks, now in use; None when no free region is that long.
    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        if len == 0 {
            return None;
        }
        let (&start, &have) = self.free.iter().find(|(_, &have)| have >= len)?;
        self.free.remove(&start);
        if have > len {
            self.free.insert(start + len, have - len);
        }
        self.used.insert(start, (len, 1));
        Some(start)
    }

    /// One more holder of the region in use of `len` blocks at `start` (a table whose
    /// content is the same for another frontend). `false` (nothing changed): no region in
    /// use starts there with that length.
    pub fn share(&mut self, start: u32, len: u32) -> bool {
        match self.used.get_mut(&start) {
            Some((l, n)) if *l == len => {
                *n += 1;
                true
            }
            _ => false,
        }
    }

    /// `take`, or `share` when the region is in use with that length already: a table
    /// found at start that several index entries name.
    pub fn hold(&mut self, start: u32, len: u32) -> bool {
        self.take(start, len) || self.share(start, len)
    }

    /// Marks `len` blocks from `start` used, as a table found in the maps at start holds
    /// them. `false` (nothing changed): they are not all free (two index entries overlap, or
    /// the region lies beyond the array), and the table must not be kept.
    pub fn take(&mut self, start: u32, len: u32) -> bool {
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        let Some((&f, &have)) = self.free.range(..=start).next_back() else {
            return false;
        };
        if len == 0 || f + have < end {
            return false;
        }
        self.free.remove(&f);
        if start > f {
            self.free.insert(f, start - f);
        }
        if f + have > end {
            self.free.insert(end, f + have - end);
        }
        self.used.insert(start, (len, 1));
        true
    }

    /// Gives one holder's hold of the `len` blocks from `start` back (a retired table's,
    /// after its grace period); the last holder's frees them, merged with the free regions
    /// they touch. `false` (nothing changed): no region in use starts there with that length
    /// (free already, beyond the array, or another region), which would be a bookkeeping
    /// error.
    pub fn free(&mut self, start: u32, len: u32) -> bool {
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        if len == 0 || end > self.capacity {
            return false;
        }
        match self.used.get_mut(&start) {
            Some((l, n)) if *l == len && *n > 1 => {
                *n -= 1;
                return true;
            }
            Some((l, _)) if *l == len => {}
            _ => return false,
        }
        let before = self.free.range(..start).next_back().map(|(&s, &l)| (s, l));
        if before.is_some_and(|(s, l)| s + l > start) {
            return false;
        }
        if self.free.range(start..end).next().is_some() {
            return false;
        }
        let (mut s, mut l) = (start, len);
        if let Some((bs, bl)) = before.filter(|(bs, bl)| bs + bl == start) {
            self.free.remove(&bs);
            s = bs;
            l += bl;
        }
        if let Some(al) = self.free.remove(&end) {
            l += al;
        }
        self.free.insert(s, l);
        self.used.remove(&start);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_hold_the_table_in_order_with_the_last_padded() {
        let backends: Vec<Identity> = ["10.0.0.1:80", "10.0.0.2:80", "[fd00::3]:80"]
            .iter()
            .map(|a| Identity::of(a.parse().unwrap(), 6))
            .collect();
        assert_eq!(backends[0].addr[10..12], [0xff, 0xff], "IPv4 is mapped");
        let t = build(DEFAULT_SEED, &backends).unwrap();
        let b = t.to_blocks();
        assert_eq!(b.len() as u32, blocks(t.size()));
        let flat: Vec<u16> = b.iter().flat_map(|b| b.entries).collect();
        assert_eq!(flat[..t.entries.len()], t.entries[..]);
        assert!(flat[t.entries.len()..].iter().all(|e| *e == 0));
    }

    #[test]
    fn an_annotation_overrides_the_flag_and_bad_values_are_refused() {
        let s = Settings::default();
        assert_eq!(s.external, Algorithm::Maglev);
        assert_eq!(s.external(None), Algorithm::Maglev);
        assert_eq!(s.external(Some(Algorithm::Random)), Algorithm::Random);
        assert_eq!("random".parse(), Ok(Algorithm::Random));
        assert!("Maglev"
            .parse::<Algorithm>()
            .unwrap_err()
            .contains("\"Maglev\""));
    }

    fn is_prime(n: u32) -> bool {
        if n < 2 {
            return false;
        }
        let mut d = 2u32;
        while d * d <= n {
            if n.is_multiple_of(d) {
                return false;
            }
            d += 1;
        }
        true
    }

    fn backend(i: u32) -> Identity {
        let [a, b, c, d] = (0x0a00_0000u32 + i).to_be_bytes();
        Identity {
            addr: svc_common::v4_mapped([a, b, c, d]),
            port: 8080,
            proto: svc_common::IPPROTO_TCP,
        }
    }

    fn backends(n: u32) -> Vec<Identity> {
        (1..=n).map(backend).collect()
    }

    /// The table as the backends each position names: what must agree across nodes.
    fn owners(t: &Table, list: &[Identity]) -> Vec<Identity> {
        t.entries.iter().map(|&e| list[e as usize]).collect()
    }

    fn moved(a: &[Identity], b: &[Identity]) -> usize {
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    }

    #[test]
    fn sizes_are_the_smallest_class_above_100_per_backend() {
        for (n, m) in [
            (1, 127),
            (2, 251),
            (3, 509),
            (5, 509),
            (6, 1_021),
            (10, 1_021),
            (11, 2_039),
            (100, 16_381),
            (1_000, 131_071),
            (1_310, 131_071),
            (65_535, 131_071),
        ] {
            assert_eq!(table_size(n), m, "{n} backends");
        }
        for (i, &m) in SIZES.iter().enumerate() {
            assert!(is_prime(m), "{m}");
            assert!(
                m < 1 << (i + 7) && !(m + 1..1 << (i + 7)).any(is_prime),
                "{m}"
            );
        }
        for n in 1..1_311 {
            let m = table_size(n);
            assert!(m as usize > 100 * n, "{n}: {m}");
            assert!(m == MIN_SIZE || (m as usize) < 2 * 100 * n + 2, "{n}: {m}");
        }
    }

    #[test]
    fn refuses_no_backend_and_more_than_a_slot_number_holds() {
        assert_eq!(build(1, &[]), Err(TableError::NoBackend));
        let many = vec![backend(1); 65_536];
        assert_eq!(build(1, &many), Err(TableError::TooMany(65_536)));
    }

    /// Two nodes with one seed and one backend set build one table, whatever order their
    /// backends came in; another seed gives another table.
    #[test]
    fn the_same_seed_and_backends_give_the_same_table_in_any_order() {
        let list = backends(10);
        let t = build(42, &list).unwrap();
        assert_eq!(t.size(), 1_021);
        assert_eq!(build(42, &list).unwrap(), t);
        let mut reversed = list.clone();
        reversed.reverse();
        let mut rotated = list.clone();
        rotated.rotate_left(3);
        for other in [reversed, rotated] {
            let u = build(42, &other).unwrap();
            assert_ne!(u.entries, t.entries, "numbered by the list it came in");
            assert_eq!(owners(&u, &other), owners(&t, &list));
        }
        let elsewhere = build(43, &list).unwrap();
        let differ = moved(&owners(&elsewhere, &list), &owners(&t, &list));
        assert!(
            differ > 850,
            "another seed, another table: {differ} of 1,021 differ"
        );
    }

    /// The function itself must never change: agents of two versions on two nodes must
    /// agree. These entries were computed once by this builder; a change here breaks
    /// cross-node agreement during a rolling upgrade.
    #[test]
    fn the_table_of_a_known_input_does_not_change() {
        let t = build(0x5eed, &backends(3)).unwrap();
        assert_eq!(t.size(), 509);
        assert_eq!(&t.entries[..24], GOLDEN);
    }
    const GOLDEN: &[u16] = &[
        2, 0, 2, 1, 1, 0, 2, 0, 0, 2, 0, 0, 1, 2, 1, 1, 2, 0, 2, 0, 0, 1, 2, 1,
    ];

    /// Every backend holds floor(M/N) or ceil(M/N) entries: within 1 % of the others when
    /// M > 100 N (the paper's rule), by construction.
    #[test]
    fn each_backend_holds_its_share_within_one_percent() {
        for n in [1, 2, 3, 7, 10, 31, 100, 500, 1_310] {
            let list = backends(n);
            let t = build(7, &list).unwrap();
            let mut counts = vec![0u32; n as usize];
            for &e in &t.entries {
                counts[e as usize] += 1;
            }
            let (lo, hi) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
            let m = t.size();
            assert!(
                lo == m / n && hi <= lo + 1,
                "{n} backends in {m}: {lo}..={hi}"
            );
            assert!(hi as f64 / lo as f64 <= 1.01, "{n}: {hi}/{lo}");
        }
        // Past the largest table the bound is ceil/floor of M/N: 2,600 backends, 2 %.
        let t = build(7, &backends(2_600)).unwrap();
        let mut counts = vec![0u32; 2_600];
        for &e in &t.entries {
            counts[e as usize] += 1;
        }
        let (lo, hi) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
        assert_eq!((lo, hi), (50, 51));
    }

    /// Seeds the disruption tests run under: the bounds hold for each.
    const SEEDS: std::ops::Range<u64> = 0..64;

    /// Adding one backend to N (the size staying in its class) moves the new backend's share,
    /// 1/(N+1), and an extra between the old backends: Maglev's permutations are not
    /// perfectly consistent, the price of its balance. Measured over these seeds: the extra
    /// averages 1.0 to 1.9 % of the table (most at a dozen backends), and for one seed it
    /// reaches 6.2 % at 3 backends, 2.4 % at 50, 1.0 % at 400. Bound: on average at most
    /// 1/(N+1) + 2.5 % of the flows move, for every seed at most 2/(N+1) + 1.5 %. A random
    /// choice moves N/(N+1).
    #[test]
    fn adding_a_backend_moves_about_its_share() {
        let new = backend(10_000);
        for n in [3u32, 6, 12, 25, 50, 100, 200, 400] {
            assert_eq!(table_size(n as usize), table_size(n as usize + 1));
            let share = 1.0 / (n as f64 + 1.0);
            let (mut sum, mut worst) = (0f64, 0f64);
            for seed in SEEDS {
                let list = backends(n);
                let before = owners(&build(seed, &list).unwrap(), &list);
                let mut more = list.clone();
                more.insert(n as usize / 2, new);
                let after = owners(&build(seed, &more).unwrap(), &more);
                let m = before.len() as f64;
                let to_new = after.iter().filter(|b| **b == new).count() as f64;
                assert!(
                    (to_new / m - share).abs() < 1.0 / m + 1e-9,
                    "{n}: its share"
                );
                let moved = moved(&before, &after) as f64 / m;
                assert!(
                    moved <= 2.0 * share + 0.015,
                    "{n} backends, seed {seed}: {:.2} % moved",
                    moved * 100.0
                );
                sum += moved;
                worst = worst.max(moved);
            }
            let mean = sum / SEEDS.end as f64;
            eprintln!(
                "add to {n}: 1/(N+1) = {:.2} %, moved {:.2} % on average, {:.2} % at most",
                share * 100.0,
                mean * 100.0,
                worst * 100.0
            );
            assert!(
                mean <= share + 0.025,
                "{n}: {:.2} % on average",
                mean * 100.0
            );
        }
    }

    /// Removing one backend of N moves its entries (1/N) and an extra of the same size as
    /// adding one does. Bound: as above.
    #[test]
    fn removing_a_backend_moves_about_its_entries() {
        for n in [4u32, 7, 13, 26, 51, 101, 201, 401] {
            assert_eq!(table_size(n as usize), table_size(n as usize - 1));
            let share = 1.0 / n as f64;
            let (mut sum, mut worst) = (0f64, 0f64);
            for seed in SEEDS {
                let list = backends(n);
                let before = owners(&build(seed, &list).unwrap(), &list);
                let gone = list[n as usize / 3];
                let fewer: Vec<_> = list.iter().copied().filter(|b| *b != gone).collect();
                let after = owners(&build(seed, &fewer).unwrap(), &fewer);
                assert!(!after.contains(&gone));
                let moved = moved(&before, &after) as f64 / before.len() as f64;
                assert!(
                    moved <= 2.0 * share + 0.015,
                    "{n} backends, seed {seed}: {:.2} % moved",
                    moved * 100.0
                );
                sum += moved;
                worst = worst.max(moved);
            }
            let mean = sum / SEEDS.end as f64;
            eprintln!(
                "remove from {n}: 1/N = {:.2} %, moved {:.2} % on average, {:.2} % at most",
                share * 100.0,
                mean * 100.0,
                worst * 100.0
            );
            assert!(
                mean <= share + 0.025,
                "{n}: {:.2} % on average",
                mean * 100.0
            );
        }
    }

    /// Crossing into another size class rebuilds the table at the new size: a flow's
    /// position changes with the size, so about as many flows move as with a random choice.
    /// The test states it so the design note's claim stays true.
    #[test]
    fn crossing_a_size_class_moves_most_entries() {
        let list = backends(10);
        let mut more = list.clone();
        more.push(backend(10_000));
        let (a, b) = (build(1, &list).unwrap(), build(1, &more).unwrap());
        assert_eq!((a.size(), b.size()), (1_021, 2_039));
        // Flows as hashes taken mod each size: the owner of each of 100,000 hashes.
        let moved = (0..100_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11)
            .filter(|h| {
                list[a.entries[(h % 1_021) as usize] as usize]
                    != more[b.entries[(h % 2_039) as usize] as usize]
            })
            .count();
        assert!(moved > 80_000, "{moved} of 100,000 moved");
    }

    #[test]
    fn a_table_takes_whole_blocks() {
        assert_eq!(blocks(127), 32);
        assert_eq!(blocks(1_021), 256);
        assert_eq!(blocks(131_071), 32_768);
    }

    /// Regions are handed out first fit, come back merged with their free neighbours, and a
    /// freed region is taken again by the next table of its size.
    #[test]
    fn regions_are_reused_and_merged() {
        let mut r = Regions::new(1_000);
        let a = r.alloc(256).unwrap();
        let b = r.alloc(256).unwrap();
        let c = r.alloc(256).unwrap();
        assert_eq!((a, b, c), (0, 256, 512));
        assert_eq!(r.alloc(256), None, "232 blocks left");
        assert_eq!(r.free_blocks(), 232);
        assert!(r.free(b, 256));
        assert_eq!(r.alloc(256), Some(b), "the freed region, reused");
        assert!(r.free(a, 256) && r.free(b, 256) && r.free(c, 256));
        assert_eq!(r, Regions::new(1_000), "merged back into one region");
        assert_eq!(r.alloc(1_000), Some(0));
    }

    /// A stretch is free when no region in use has a block in it, wherever in it that block
    /// is; blocks beyond the array are free.
    #[test]
    fn a_stretch_with_any_block_in_use_is_not_free() {
        let mut r = Regions::new(1_000);
        assert!(r.take(300, 10));
        assert!(r.is_free(0, 300) && r.is_free(310, 690));
        for (start, len) in [(0, 301), (299, 2), (305, 1), (309, 100), (200, 800)] {
            assert!(!r.is_free(start, len), "{start}+{len}");
        }
        assert!(
            r.is_free(990, 120),
            "the last page, beyond the array in part"
        );
        assert!(r.is_free(1_000, 120) && r.is_free(u32::MAX - 5, 120));
        assert!(r.free(300, 10));
        assert!(r.is_free(0, 1_000));
    }

    /// Freeing what is free, or beyond the array, is refused and changes nothing.
    #[test]
    fn freeing_a_free_region_is_refused() {
        let mut r = Regions::new(100);
        let a = r.alloc(10).unwrap();
        let before = r.clone();
        assert!(!r.free(a + 5, 10), "overlaps the free space after it");
        assert!(!r.free(95, 10), "beyond the array");
        assert!(!r.free(a, 0));
        assert_eq!(r, before);
        assert!(r.free(a, 10));
        assert!(!r.free(a, 10), "twice");
    }

    /// At start, each table the index names takes its region; two that overlap cannot both.
    #[test]
    fn tables_found_at_start_take_their_regions_once() {
        let mut r = Regions::new(100);
        assert!(r.take(10, 20));
        assert!(r.take(40, 5));
        assert!(!r.take(25, 10), "overlaps 10..30");
        assert!(!r.take(95, 10), "beyond the array");
        assert!(!r.take(u32::MAX, 2));
        assert_eq!(r.free_blocks(), 75);
        assert_eq!(r.alloc(10), Some(0));
        assert_eq!(r.alloc(10), Some(30));
        assert_eq!(r.alloc(50), Some(45));
        assert_eq!(r.alloc(1), Some(95));
    }

    /// A shared region stays in use until its last holder gives it back, and only a region
    /// in use of that exact length can be shared.
    #[test]
    fn a_shared_region_is_freed_by_its_last_holder() {
        let mut r = Regions::new(100);
        let a = r.alloc(10).unwrap();
        assert!(r.share(a, 10));
        assert!(r.share(a, 10));
        assert_eq!(r.holders(a), 3);
        assert!(!r.share(a, 11), "another length");
        assert!(!r.share(a + 1, 9), "inside it");
        assert!(!r.share(50, 10), "free space");
        assert!(r.free(a, 10) && r.free(a, 10));
        assert_eq!(r.holders(a), 1);
        assert_eq!(r.free_blocks(), 90, "still held by one");
        assert_eq!(r.alloc(10), Some(10), "not handed out while held");
        assert!(r.free(10, 10));
        assert!(r.free(a, 10), "the last holder");
        assert_eq!(r.holders(a), 0);
        assert!(!r.free(a, 10), "once more than held");
        assert_eq!(r, Regions::new(100));
    }

    /// At start, several index entries naming one region hold it together (`hold`); one
    /// that overlaps it otherwise cannot.
    #[test]
    fn tables_found_at_start_hold_a_shared_region() {
        let mut r = Regions::new(100);
        assert!(r.hold(10, 20));
        assert!(r.hold(10, 20));
        assert!(!r.hold(10, 25), "same start, another length");
        assert!(!r.hold(15, 10), "inside it");
        assert_eq!(
            (r.holders(10), r.used_regions(), r.free_blocks()),
            (2, 1, 80)
        );
        assert!(r.free(10, 20));
        assert_eq!(r.free_blocks(), 80);
        assert!(r.free(10, 20));
        assert_eq!(r.free_blocks(), 100);
    }

    /// What 10,000 Services of 10 backends cost (docs/design/maglev.md, Memory): the time
    /// to build their tables and the blocks they take. A measurement, not a check: run with
    /// `-- --ignored --nocapture` (the numbers of a debug build are the test profile's).
    #[test]
    #[ignore]
    fn build_cost_at_10000_services_of_10() {
        let mut regions = Regions::new(1 << 22);
        let t0 = std::time::Instant::now();
        let mut blocks_used = 0u64;
        for s in 0..10_000u32 {
            let backends: Vec<Identity> = (0..10).map(|b| backend(s * 10 + b)).collect();
            let t = build(DEFAULT_SEED, &backends).unwrap();
            let b = t.to_blocks();
            regions.alloc(b.len() as u32).unwrap();
            blocks_used += b.len() as u64;
        }
        let took = t0.elapsed();
        eprintln!(
            "10,000 tables of 10 backends: built in {took:?} ({:?} each), {} blocks, {:.1} MB",
            took / 10_000,
            blocks_used,
            blocks_used as f64 * 8.0 / 1e6
        );
        assert_eq!(blocks_used, 10_000 * u64::from(blocks(1_021)));
    }
}
