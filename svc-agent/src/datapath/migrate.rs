//! Entries carried from a pin of another size or an older layout into this agent's maps.

use std::os::fd::AsFd;
use std::path::Path;

use aya::maps::{HashMap, LpmTrie, Map, MapData};
use svc_common::map_names;

use super::load::store_map;
use super::load_err;
use crate::error::{Error, Result};
use crate::store::BpfStore;
use crate::sys;

/// Copies every entry of `old` into `new`. `keep_newer`: entries `new` already has win
/// (the kernel may have written them since the first copy).
fn copy_hash<K, V>(
    name: &'static str,
    old: &MapData,
    new: &mut HashMap<MapData, K, V>,
    keep_newer: bool,
) -> Result<usize>
where
    K: aya::Pod + bytemuck::Pod,
    V: aya::Pod + bytemuck::Pod,
{
    let entries: Vec<(K, V)> = sys::dump_hash(old.fd().as_fd())
        .map_err(|e| Error::map_io(name, format!("reading the old map: {e}"), &e))?;
    insert_all(name, new, &entries, keep_newer, || {
        Error::load(format!(
            "map {name}: its {} entries do not fit in the capacity asked for; give a larger \
             one (see `svc-agent run --help`, the --max-* flags)",
            entries.len()
        ))
    })?;
    Ok(entries.len())
}

/// Writes `entries` into `new`; with `keep_newer` never over an entry it has
/// (`BPF_NOEXIST`). `full`: the error when `new` has no room left (E2BIG). How many entries
/// it wrote.
fn insert_all<K, V>(
    name: &'static str,
    new: &mut HashMap<MapData, K, V>,
    entries: &[(K, V)],
    keep_newer: bool,
    full: impl Fn() -> Error,
) -> Result<usize>
where
    K: aya::Pod,
    V: aya::Pod,
{
    let flags = if keep_newer {
        crate::store::BPF_NOEXIST
    } else {
        0
    };
    let mut written = 0;
    for (k, v) in entries {
        // A map allocated as used (`SVC_CT`) may find the kernel's caches empty for a moment.
        match crate::store::retry_enomem(crate::store::ENOMEM_TRIES, || new.insert(k, v, flags)) {
            Ok(()) => written += 1,
            Err(e) if keep_newer && crate::store::is_exists(&e) => {}
            Err(e) if crate::store::is_full(&e) => return Err(full()),
            Err(e) => return Err(crate::store::map_err(name, e)),
        }
    }
    Ok(written)
}

/// Copies a migrated map's entries into the new one.
pub(super) fn migrate(
    store: &mut BpfStore,
    name: &'static str,
    old: &MapData,
    late: bool,
) -> Result<usize> {
    match name {
        map_names::SERVICES => copy_hash(name, old, &mut store.services, late),
        map_names::SLOTS => copy_hash(name, old, &mut store.slots, late),
        map_names::BACKENDS => {
            let old: aya::maps::Array<MapData, svc_common::Backend> =
                aya::maps::Array::try_from(Map::Array(clone_map(old)?))
                    .map_err(|e| crate::store::map_err(name, e))?;
            let entries = crate::store::dump_backends(&old)?;
            if entries.len() > store.backends.len() as usize {
                return Err(Error::load(format!(
                    "map {name}: its {} backends do not fit in the capacity asked for; give a \
                     larger one (--max-backends)",
                    entries.len()
                )));
            }
            Ok(place_backends(&mut store.backends, &entries)?.0)
        }
        map_names::REV_NAT => copy_hash(name, old, &mut store.rev_nat, late),
        map_names::NAMES => copy_hash(name, old, &mut store.names, late),
        map_names::AFFINITY => copy_hash(name, old, &mut store.affinity, late),
        map_names::SOCK_REV => copy_hash(name, old, &mut store.sock_rev, late),
        map_names::AFFINITY_MATCH => copy_hash(name, old, &mut store.affinity_match, late),
        map_names::NODE_ADDRS => copy_hash(name, old, &mut store.node_addrs, late),
        map_names::SRC_RANGES => {
            let old: LpmTrie<MapData, crate::store::RangeData, u32> =
                LpmTrie::try_from(Map::LpmTrie(clone_map(old)?))
                    .map_err(|e| crate::store::map_err(name, e))?;
            let mut n = 0;
            for k in old.keys().flatten() {
                store
                    .src_ranges
                    .insert(&k, 0, 0)
                    .map_err(|e| crate::store::map_err(name, e))?;
                n += 1;
            }
            Ok(n)
        }
        map_names::CT | map_names::CT_NEW => match store_map(store, name) {
            Some(ct) => {
                let mut new: HashMap<MapData, svc_common::CtKey, svc_common::CtValue> =
                    HashMap::try_from(Map::HashMap(clone_map(ct)?))
                        .map_err(|e| crate::store::map_err(name, e))?;
                copy_hash(name, old, &mut new, late)
            }
            None => Ok(0),
        },
        map_names::MAGLEV_INDEX => match store.maglev_index.as_mut() {
            Some(new) => copy_hash(name, old, new, late),
            None => Ok(0),
        },
        map_names::MAGLEV => copy_tables(store, old),
        // Counters (`DEV_STATS`) start again in a resized map.
        _ => Ok(0),
    }
}

/// Writes backends `entries` (id, value) into `BACKENDS`, each at its index unless another
/// id's entry is there (`old` entries of a map of another size or layout can meet at one
/// index). A backend left out leaves the slots that name it missing until the first sync
/// writes their frontends again, as recovery finds them incomplete. (written, left out)
pub(super) fn place_backends(
    new: &mut aya::maps::Array<MapData, svc_common::Backend>,
    entries: &[(svc_common::BackendId, svc_common::Backend)],
) -> Result<(usize, usize)> {
    let name = map_names::BACKENDS;
    let n = new.len().max(1);
    let (mut written, mut collided) = (0, 0);
    for (id, b) in entries {
        let i = svc_common::backend_index(*id, n);
        let there = new.get(&i, 0).map_err(|e| crate::store::map_err(name, e))?;
        if there.id == *id {
            continue;
        }
        if there.id != 0 {
            collided += 1;
            continue;
        }
        new.set(i, b.with_id(*id), 0)
            .map_err(|e| crate::store::map_err(name, e))?;
        written += 1;
    }
    if collided > 0 {
        tracing::warn!(
            map = name,
            collided,
            "backends whose index another backend holds were left out; the first sync \
             writes their frontends again"
        );
    }
    Ok((written, collided))
}

/// Carries the backends of a pinned `SVC_BACKENDS` of layout 1 (a hash keyed by id) into
/// this layout's array under the same ids, before the first sync, so the mirror recovers them
/// and the frontends that name them whole. Until the new programs are attached, the store
/// writes each backend into the old map too (`BpfStore::backends_v1`): the programs still
/// attached read it, and a frontend the first sync changes names its new backends there as
/// well. The old pin goes with the other layouts' pins once the new programs are attached; a
/// start killed before then carries again, never over an entry the array has.
/// (carried, left out)
pub(super) fn carry_backends_v1(store: &mut BpfStore, dir: &Path) -> Result<(usize, usize)> {
    let pin = dir.join(format!("{}_v1", map_names::BACKENDS));
    if !pin.exists() {
        return Ok((0, 0));
    }
    let old: Vec<(svc_common::BackendId, svc_common::BackendV1)> =
        old_hash(&pin, map_names::BACKENDS)?;
    let entries: Vec<(svc_common::BackendId, svc_common::Backend)> = (old.into_iter())
        .filter(|(id, _)| *id != 0)
        .map(|(id, b)| (id, b.with_id(id)))
        .collect();
    let placed = place_backends(&mut store.backends, &entries)?;
    let old = MapData::from_pin(&pin).map_err(|e| load_err(pin.display(), e))?;
    store.backends_v1 =
        Some(HashMap::try_from(Map::HashMap(old)).map_err(|e| load_err(pin.display(), e))?);
    Ok(placed)
}

/// Copies the tables of a resized `SVC_MAGLEV` where they were: only the regions the index
/// names (the rest of the map is free space), read through the new index, which is
/// carried beside it. A region beyond the new map's room is left out: its frontend falls
/// back to the random choice until the first sync writes its table again (recovery finds the
/// region outside the map). Blocks copied.
fn copy_tables(store: &mut BpfStore, old: &MapData) -> Result<usize> {
    let name = map_names::MAGLEV;
    let old: crate::store::MaglevPages = HashMap::try_from(Map::HashMap(clone_map(old)?))
        .map_err(|e| crate::store::map_err(name, e))?;
    copy_regions(store, |start, len| {
        crate::store::read_maglev_pages(&old, start, len)
    })
}

/// Carries the tables of a pinned `SVC_MAGLEV` of layout 1 (an array of blocks, allocated in
/// full) into this layout's pages, where they were, before the first sync: the index, which
/// both layouts share, names them. Until the new programs are attached, the store writes
/// each new table into the old array too (`BpfStore::maglev_v1`), which the programs still
/// attached read. The old pin goes with the other layouts' pins once the new programs are
/// attached; a start killed before then carries again, the same tables to the same places.
/// Blocks carried.
pub(super) fn carry_maglev_v1(store: &mut BpfStore, dir: &Path) -> Result<usize> {
    let pin = dir.join(format!("{}_v1", map_names::MAGLEV));
    if store.maglev.is_none() || !pin.exists() {
        return Ok(0);
    }
    let name = map_names::MAGLEV;
    let data = MapData::from_pin(&pin).map_err(|e| load_err(pin.display(), e))?;
    let old: aya::maps::Array<MapData, svc_common::MaglevBlock> =
        aya::maps::Array::try_from(Map::Array(clone_map(&data)?))
            .map_err(|e| crate::store::map_err(name, e))?;
    let n = copy_regions(store, |start, len| {
        let end = start.saturating_add(len).min(old.len());
        (start..end).map(|i| old.get(&i, 0)).collect()
    })?;
    store.maglev_v1 =
        Some(aya::maps::Array::try_from(Map::Array(data)).map_err(|e| load_err(pin.display(), e))?);
    Ok(n)
}

/// Writes into `SVC_MAGLEV` every region the index names that fits in it, as `read` gives
/// it (a table several frontends share is named by several index entries: copied once).
/// Blocks copied.
fn copy_regions(
    store: &mut BpfStore,
    read: impl Fn(u32, u32) -> std::result::Result<Vec<svc_common::MaglevBlock>, aya::maps::MapError>,
) -> Result<usize> {
    let name = map_names::MAGLEV;
    let room = store.capacity.maglev_blocks();
    let (Some(new), Some(index)) = (store.maglev.as_mut(), store.maglev_index.as_ref()) else {
        return Ok(0);
    };
    let mut n = 0;
    let mut copied = std::collections::HashSet::new();
    for (_, v) in crate::store::dump(map_names::MAGLEV_INDEX, index)? {
        let start = v.offset / svc_common::MAGLEV_BLOCK;
        let end = start.saturating_add(crate::maglev::blocks(v.size));
        if end > room || !copied.insert((start, end)) {
            continue;
        }
        let blocks = read(start, end - start).map_err(|e| crate::store::map_err(name, e))?;
        crate::store::retry_enomem(crate::store::ENOMEM_TRIES, || {
            crate::store::write_maglev_pages(new, start, &blocks)
        })
        .map_err(|e| crate::store::map_err(name, e))?;
        n += blocks.len();
    }
    Ok(n)
}

/// Carries the flows of a pinned `SVC_CT` of layout 1 (before sequence tracking) into this
/// layout's tables (`carry_ct`), untracked, so an upgrade keeps every connection through a NodePort: before
/// the new programs attach, and again after (the old programs may have made flows in
/// between). Only the flows the new map lacks. How many entries were read.
pub(super) fn carry_ct_v1(store: &mut BpfStore, dir: &Path) -> Result<usize> {
    if store.ct.is_none() {
        return Ok(0);
    }
    let Some(entries) = old_ct::<svc_common::CtValueV1>(dir, 1)? else {
        return Ok(0);
    };
    let entries: Vec<(svc_common::CtKey, svc_common::CtValue)> = entries
        .into_iter()
        .map(|(k, v)| (k, svc_common::CtValue::from(v)))
        .collect();
    carry_ct(store, &entries)?;
    Ok(entries.len())
}

/// The older layouts of `SVC_CT` whose values are this layout's `CtValue`: 2 (one LRU of
/// every flow) and 3 (the assured table allocated in full).
pub(super) const CT_LAYOUTS_OF_THIS_VALUE: [u32; 2] = [2, 3];

/// Carries the flows of a pinned `SVC_CT` of `layout` (one of `CT_LAYOUTS_OF_THIS_VALUE`) into
/// this layout's tables: unassured flows (`ct_flags::UNASSURED`) into `SVC_CT_NEW`, the others
/// into `SVC_CT`, so an upgrade keeps every connection; before the new programs attach, and
/// again after, as `carry_ct_v1`. How many entries were read.
pub(super) fn carry_ct_of_layout(store: &mut BpfStore, dir: &Path, layout: u32) -> Result<usize> {
    if store.ct.is_none() || store.ct_new.is_none() {
        return Ok(0);
    }
    let Some(entries) = old_ct::<svc_common::CtValue>(dir, layout)? else {
        return Ok(0);
    };
    carry_ct(store, &entries)?;
    Ok(entries.len())
}

/// Carries the frontends of a pinned `SVC_SERVICES` of layout 2 and the slots they reach (a
/// pinned `SVC_SLOTS` of layout 1, a slot an entry) into this layout's maps, the slots eight
/// to an entry, under the same ids and generations, before the first sync: the mirror then
/// recovers every frontend whole and the sync writes nothing again, so ids stay (affinity
/// choices, the per-Service counters, the reverse translation of sockets opened before),
/// while the programs still attached keep reading the older pair until the new ones replace
/// them. Never over an entry the new maps have (`BPF_NOEXIST`), so a start killed halfway
/// through is finished by the next; once done, the older slots map's pin goes (the programs
/// still attached hold the map itself), so a later start does not carry again what the first
/// sync may have deleted since. An error (the frontends do not fit, a write refused) stops the
/// agent: the first sync would otherwise retire, as leftovers, the shared entries (reverse
/// NAT, names, backends) of the frontends not carried, which the programs still attached
/// read. How many entries were carried.
pub(super) fn carry_slots_v1(store: &mut BpfStore, dir: &Path) -> Result<usize> {
    let services_pin = dir.join(format!("{}_v2", map_names::SERVICES));
    let slots_pin = dir.join(format!("{}_v1", map_names::SLOTS));
    if !services_pin.exists() || !slots_pin.exists() {
        return Ok(0);
    }
    let (slots, services) = slots_v1_carried(
        &old_hash(&services_pin, map_names::SERVICES)?,
        &old_hash(&slots_pin, map_names::SLOTS)?,
    );
    for (name, need, room) in [
        (map_names::SLOTS, slots.len(), store.capacity.slots),
        (map_names::SERVICES, services.len(), store.capacity.services),
    ] {
        if need > room as usize {
            return Err(Error::load(format!(
                "carrying the frontends of {} over needs {need} entries of {name}, which holds \
                 {room}: raise its capacity (--max-slots counts slots, eight to an entry; \
                 --max-services)",
                services_pin.display()
            )));
        }
    }
    let full = |name: &'static str| {
        let pin = services_pin.display();
        move || {
            Error::load(format!(
                "carrying the frontends of {pin} over: {name} is full; raise its capacity \
                 (--max-slots counts slots, eight to an entry; --max-services)"
            ))
        }
    };
    let (slots_name, services_name) = (map_names::SLOTS, map_names::SERVICES);
    let mut carried = insert_all(slots_name, &mut store.slots, &slots, true, full(slots_name))?;
    // After their slots, as a sync writes them.
    carried += insert_all(
        services_name,
        &mut store.services,
        &services,
        true,
        full(services_name),
    )?;
    std::fs::remove_file(&slots_pin).map_err(|e| {
        Error::load(format!(
            "removing {} once carried over: {e}",
            slots_pin.display()
        ))
    })?;
    Ok(carried)
}

/// Entries of a slots map of layout 2 and of a services map.
type Carried = (
    Vec<(svc_common::SlotKey, svc_common::SlotGroup)>,
    Vec<(svc_common::ServiceKey, svc_common::ServiceValue)>,
);

/// What `carry_slots_v1` writes: the entries of layout 3's services map and layout 2's slots
/// map that hold what `services` (layout 2) and `slots` (layout 1) hold. A frontend whose
/// slots are not all there is left out (the sync writes it again, as recovery would have it).
pub(super) fn slots_v1_carried(
    services: &[(svc_common::ServiceKey, svc_common::ServiceValue)],
    slots: &[(svc_common::SlotKey, svc_common::BackendId)],
) -> Carried {
    use svc_common::{BackendId, SlotKey};
    let slots: std::collections::HashMap<SlotKey, BackendId> = slots.iter().copied().collect();
    let (mut groups, mut masters) = (Vec::new(), Vec::new());
    for (k, v) in services {
        if v.flags & svc_common::svc_flags::ADDR_MARKER == 0 {
            let backends: Option<Vec<BackendId>> = (1..=v.count)
                .map(|slot| {
                    slots
                        .get(&SlotKey {
                            id: v.id,
                            rev: v.rev,
                            slot,
                        })
                        .copied()
                })
                .collect();
            let Some(backends) = backends else {
                continue;
            };
            groups.extend(crate::reconcile::slot_entries(v.id, v.rev, &backends));
        }
        masters.push((*k, *v));
    }
    (groups, masters)
}

/// Every entry of the pinned hash `path` of an older layout of map `name`, keys `K` and
/// values `V`; a pin of other key or value sizes is an error that names it.
fn old_hash<K: bytemuck::Pod, V: bytemuck::Pod>(
    path: &Path,
    name: &'static str,
) -> Result<Vec<(K, V)>> {
    let old = MapData::from_pin(path).map_err(|e| load_err(path.display(), e))?;
    let info = old.info().map_err(|e| load_err(path.display(), e))?;
    let (key, value) = (size_of::<K>() as u32, size_of::<V>() as u32);
    if (info.key_size(), info.value_size()) != (key, value) {
        return Err(Error::load(format!(
            "{} has {}-byte keys and {}-byte values, not {key} and {value}",
            path.display(),
            info.key_size(),
            info.value_size()
        )));
    }
    sys::dump_hash(old.fd().as_fd())
        .map_err(|e| Error::map_io(name, format!("reading {}: {e}", path.display()), &e))
}

/// The flows of the pinned `SVC_CT` of an older `layout` (pin `SVC_CT_v{layout}`), whose
/// values are `V`; None without that pin. A pin of other key or value sizes is an error that
/// names it.
fn old_ct<V: bytemuck::Pod>(
    dir: &Path,
    layout: u32,
) -> Result<Option<Vec<(svc_common::CtKey, V)>>> {
    let path = dir.join(format!("{}_v{layout}", map_names::CT));
    if !path.exists() {
        return Ok(None);
    }
    old_hash(&path, map_names::CT).map(Some)
}

/// Stores the flows of an older layout's table: each entry into the table its flags say
/// (`ct_flags::UNASSURED`: `SVC_CT_NEW`), never over an entry either table has: the old pin
/// may outlive an attach that put this layout's programs in service (an agent killed before
/// it removed the pin), and its frozen flows must not overwrite live ones. An assured flow
/// that finds the assured table full goes to the unassured one, as the datapath keeps a flow
/// assured there when the table is full.
fn carry_ct(store: &BpfStore, entries: &[(svc_common::CtKey, svc_common::CtValue)]) -> Result<()> {
    let (Some(ct), Some(ct_new)) = (&store.ct, &store.ct_new) else {
        return Ok(());
    };
    let mut assured: HashMap<MapData, svc_common::CtKey, svc_common::CtValue> =
        HashMap::try_from(Map::HashMap(clone_map(ct)?))
            .map_err(|e| crate::store::map_err(map_names::CT, e))?;
    let mut unassured: HashMap<MapData, svc_common::CtKey, svc_common::CtValue> =
        HashMap::try_from(Map::LruHashMap(clone_map(ct_new)?))
            .map_err(|e| crate::store::map_err(map_names::CT_NEW, e))?;
    for (k, v) in entries {
        if assured.get(k, 0).is_ok() || unassured.get(k, 0).is_ok() {
            continue;
        }
        let first = if v.flags & svc_common::ct_flags::UNASSURED != 0 {
            unassured.insert(k, v, crate::store::BPF_NOEXIST)
        } else {
            // The assured table is allocated as used: the kernel's caches may be empty for a
            // moment in a burst of writes.
            let put = || assured.insert(k, v, crate::store::BPF_NOEXIST);
            match crate::store::retry_enomem(crate::store::ENOMEM_TRIES, put) {
                Err(e) if crate::store::is_full(&e) => {
                    unassured.insert(k, v, crate::store::BPF_NOEXIST)
                }
                other => other,
            }
        };
        match first {
            Ok(()) => {}
            Err(e) if crate::store::is_exists(&e) => {}
            Err(e) => return Err(crate::store::map_err(map_names::CT, e)),
        }
    }
    Ok(())
}

pub(super) fn clone_map(m: &MapData) -> Result<MapData> {
    let fd = m
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| Error::load(format!("duplicating a map descriptor: {e}")))?;
    MapData::from_fd(fd).map_err(|e| load_err("reopening a map", e))
}

#[cfg(test)]
mod tests {
    use svc_common::{svc_flags, ServiceKey, ServiceValue, SlotGroup, SlotKey};

    use super::slots_v1_carried;

    fn key(last: u8, port: u16) -> ServiceKey {
        let mut addr = [0u8; 16];
        addr[15] = last;
        ServiceKey {
            addr,
            port_be: port.to_be(),
            proto: 6,
            scope: 0,
        }
    }

    /// A frontend's slots of layout 1 become its entries of eight under the same id and
    /// generation; markers come as they are; a frontend missing a slot is left to the sync.
    #[test]
    fn slots_of_layout_1_are_carried_eight_to_an_entry() {
        let marker = (
            key(10, 0),
            ServiceValue {
                flags: svc_flags::ADDR_MARKER,
                ..Default::default()
            },
        );
        let whole = (
            key(10, 80),
            ServiceValue {
                id: 7,
                rev: 3,
                count: 10,
                ..Default::default()
            },
        );
        let torn = (
            key(11, 80),
            ServiceValue {
                id: 8,
                rev: 1,
                count: 2,
                ..Default::default()
            },
        );
        let mut slots: Vec<(SlotKey, u32)> = (1..=10)
            .map(|slot| {
                (
                    SlotKey {
                        id: 7,
                        rev: 3,
                        slot,
                    },
                    100 + u32::from(slot),
                )
            })
            .collect();
        // An older generation of 7 (retiring) and slot 1 of 8 alone.
        slots.push((
            SlotKey {
                id: 7,
                rev: 2,
                slot: 1,
            },
            99,
        ));
        slots.push((
            SlotKey {
                id: 8,
                rev: 1,
                slot: 1,
            },
            200,
        ));
        let (groups, masters) = slots_v1_carried(&[marker, whole, torn], &slots);
        let first = SlotGroup {
            backends: [101, 102, 103, 104, 105, 106, 107, 108],
        };
        let second = SlotGroup {
            backends: [109, 110, 0, 0, 0, 0, 0, 0],
        };
        assert_eq!(
            groups,
            vec![
                (
                    SlotKey {
                        id: 7,
                        rev: 3,
                        slot: 1
                    },
                    first
                ),
                (
                    SlotKey {
                        id: 7,
                        rev: 3,
                        slot: 2
                    },
                    second
                ),
            ]
        );
        assert_eq!(masters, vec![marker, whole]);
    }
}
