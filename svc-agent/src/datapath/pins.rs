//! What is pinned where, and whether a pin found there can be used as it is.

use std::path::{Path, PathBuf};

use aya::maps::{MapData, MapType};
use svc_common::{layout, map_names, stat};
use tracing::{info, warn};

use super::load_err;
use crate::error::{Error, Result};
use crate::store::Capacity;
use crate::sys;

const BPF_F_NO_PREALLOC: u32 = 1;

/// What a pinned map must be for this agent to use it: type, key and value sizes, flags.
pub(super) struct MapSpec {
    pub(super) name: &'static str,
    pub(super) kind: MapType,
    pub(super) key: u32,
    pub(super) value: u32,
    pub(super) flags: u32,
}

pub(super) fn specs() -> [MapSpec; 18] {
    use std::mem::size_of;
    use svc_common::*;
    let s = |name, kind, key: usize, value: usize, flags| MapSpec {
        name,
        kind,
        key: key as u32,
        value: value as u32,
        flags,
    };
    [
        s(
            map_names::SERVICES,
            MapType::Hash,
            size_of::<ServiceKey>(),
            size_of::<ServiceValue>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::SLOTS,
            MapType::Hash,
            size_of::<SlotKey>(),
            size_of::<BackendId>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::BACKENDS,
            MapType::Hash,
            4,
            size_of::<Backend>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::REV_NAT,
            MapType::Hash,
            4,
            size_of::<RevNatValue>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::SOCK_REV,
            MapType::LruHash,
            size_of::<SockRevKey>(),
            size_of::<SockRevValue>(),
            0,
        ),
        s(
            map_names::AFFINITY,
            MapType::LruHash,
            size_of::<AffinityKey>(),
            size_of::<AffinityValue>(),
            0,
        ),
        s(map_names::STATS, MapType::PerCpuArray, 4, 8, 0),
        s(
            map_names::NAMES,
            MapType::Hash,
            4,
            size_of::<ServiceName>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::META,
            MapType::Array,
            4,
            size_of::<MetaValue>(),
            0,
        ),
        s(
            map_names::AFFINITY_MATCH,
            MapType::Hash,
            size_of::<AffinityMatchKey>(),
            4,
            BPF_F_NO_PREALLOC,
        ),
        // Socket local storage: keyed by socket, sized by the sockets (max_entries 0).
        s(
            map_names::SOCK_STATE,
            MapType::SkStorage,
            4,
            size_of::<SockState>(),
            BPF_F_NO_PREALLOC,
        ),
        // The packet datapath's (docs/design/packet-datapath.md, "Map declarations").
        s(
            map_names::NODE_ADDRS,
            MapType::Hash,
            16,
            size_of::<NodeAddrValue>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::SRC_RANGES,
            MapType::LpmTrie,
            size_of::<SrcRangeKey>(),
            4,
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::CT,
            MapType::Hash,
            size_of::<CtKey>(),
            size_of::<CtValue>(),
            0,
        ),
        s(
            map_names::CT_NEW,
            MapType::LruHash,
            size_of::<CtKey>(),
            size_of::<CtValue>(),
            0,
        ),
        s(
            map_names::CONFIG,
            MapType::Array,
            4,
            size_of::<DatapathConfig>(),
            0,
        ),
        s(
            map_names::DEV_STATS,
            MapType::PerCpuHash,
            size_of::<DevStatKey>(),
            8,
            0,
        ),
        s(map_names::NODE_ADDR_BITS, MapType::Array, 4, 8, 0),
    ]
}

/// The maps the agent writes for the packet datapath: created and pinned by the agent itself
/// while the object does not declare them (the tc programs are not in every object), with the
/// `bpf_map_type` to create them with.
pub(super) const OWN_MAPS: [(&str, u32); 4] = [
    (map_names::NODE_ADDRS, sys::map_type::HASH),
    (map_names::NODE_ADDR_BITS, sys::map_type::ARRAY),
    (map_names::SRC_RANGES, sys::map_type::LPM_TRIE),
    (map_names::CONFIG, sys::map_type::ARRAY),
];

/// max_entries a map of this agent has: configured, or fixed by the object.
pub(super) fn max_entries(name: &str, capacity: &Capacity) -> u32 {
    capacity.of(name).unwrap_or(match name {
        map_names::STATS => stat::COUNT,
        map_names::SOCK_STATE => 0,
        map_names::NODE_ADDR_BITS => svc_common::NODE_ADDR_BIT_WORDS,
        _ => 1,
    })
}

/// Creates map `name` of `OWN_MAPS` as `specs()` describes it.
pub(super) fn create_own(name: &'static str, capacity: &Capacity) -> Result<MapData> {
    let spec = specs()
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| load_err(name, "no spec"))?;
    let kind = OWN_MAPS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, k)| *k)
        .ok_or_else(|| load_err(name, "not a map the agent creates"))?;
    let fd = sys::map_create(
        kind,
        spec.key,
        spec.value,
        max_entries(name, capacity),
        spec.flags,
        name,
    )
    .map_err(|e| load_err(format!("creating map {name}"), e))?;
    MapData::from_fd(fd).map_err(|e| load_err(name, e))
}

/// Where `map` is pinned under `dir`: its name and layout version.
pub fn map_pin(dir: &Path, map: &str) -> PathBuf {
    dir.join(format!("{map}_v{}", layout::version(map)))
}

pub(super) fn link_pin(dir: &Path, program: &str) -> PathBuf {
    dir.join(format!("link_{program}"))
}

/// A migrated map's new pin, until the programs that use it are attached.
pub(super) fn staged_pin(dir: &Path, map: &str) -> PathBuf {
    dir.join(format!("{map}_v{}_new", layout::version(map)))
}

/// What to do with each map at load time.
pub(super) enum Pinned {
    /// No pin: a new map, pinned at once.
    Create,
    /// A compatible pin: the object uses it as it is.
    Adopt,
    /// A pin of the same layout but another size: a new map is filled from it, and replaces
    /// its pin once the new programs are attached.
    Migrate(MapData),
}

/// The previous release pinned maps without a version; their layout is version 1.
pub(super) fn adopt_unversioned(dir: &Path) {
    for name in map_names::ALL {
        let old = dir.join(name);
        let new = map_pin(dir, name);
        if layout::version(name) == 1 && old.exists() && !new.exists() {
            match std::fs::rename(&old, &new) {
                Ok(()) => info!(map = name, "adopted an unversioned pin as layout 1"),
                Err(e) => warn!(map = name, "renaming {}: {e}", old.display()),
            }
        }
    }
}

/// Pins in `dir` of our maps under another layout version, and staged pins a dead agent left.
pub(super) fn other_versions(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        for name in map_names::ALL {
            let ours = format!("{name}_v{}", layout::version(name));
            let Some(rest) = file.strip_prefix(name) else {
                continue;
            };
            let versioned = rest.strip_prefix("_v").is_some_and(|v| {
                !v.is_empty()
                    && v.trim_end_matches("_new")
                        .bytes()
                        .all(|b| b.is_ascii_digit())
            });
            if file != ours && (rest.is_empty() || versioned) {
                found.push(e.path());
            }
        }
    }
    found.sort();
    found
}

/// Checks the pin of `spec` at `path` against what this agent needs.
pub(super) fn inspect_pin(spec: &MapSpec, path: &Path, want_entries: u32) -> Result<Pinned> {
    if !path.exists() {
        return Ok(Pinned::Create);
    }
    let data = MapData::from_pin(path).map_err(|e| load_err(path.display(), e))?;
    let info = data.info().map_err(|e| load_err(path.display(), e))?;
    let kind = info.map_type().ok();
    let mut wrong = Vec::new();
    if kind != Some(spec.kind) {
        wrong.push(format!("type {kind:?}, not {:?}", spec.kind));
    }
    if info.key_size() != spec.key {
        wrong.push(format!("{}-byte keys, not {}", info.key_size(), spec.key));
    }
    if info.value_size() != spec.value {
        wrong.push(format!(
            "{}-byte values, not {}",
            info.value_size(),
            spec.value
        ));
    }
    if info.map_flags() != spec.flags {
        wrong.push(format!(
            "flags {:#x}, not {:#x}",
            info.map_flags(),
            spec.flags
        ));
    }
    if !wrong.is_empty() {
        return Err(Error::Load(format!(
            "map {} pinned at {} has {}: it was not made by this layout of svc. Nothing was \
             changed; stop whatever made it, then `svc-agent uninstall --bpffs {}` (drops \
             sessionAffinity state and reverse translation of open sockets) and start again",
            spec.name,
            path.display(),
            wrong.join(", "),
            path.parent().unwrap_or(path).display()
        )));
    }
    if info.max_entries() != want_entries {
        info!(
            map = spec.name,
            pinned = info.max_entries(),
            wanted = want_entries,
            "map capacity changed; migrating its entries to a new map"
        );
        return Ok(Pinned::Migrate(data));
    }
    Ok(Pinned::Adopt)
}
