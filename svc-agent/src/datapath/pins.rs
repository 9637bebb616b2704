//! What is pinned where, and whether a pin found there can be used as it is.

use std::path::{Path, PathBuf};

use aya::maps::MapData;
use svc_common::{catalogue, layout, map_names, MapDef, MapKind};
use tracing::{info, warn};

use super::load_err;
use crate::error::{Error, Result};
use crate::store::Capacity;
use crate::sys;

/// The maps pinned under the agent's directory, as the catalogue declares them: what a pin
/// must be for this agent to use it (type, key and value sizes, flags).
pub(super) fn pinned_maps() -> impl Iterator<Item = &'static MapDef> {
    catalogue::MAPS.iter().filter(|m| m.pinned)
}

/// max_entries a map of this agent has: configured, or fixed by the object.
pub(super) fn max_entries(map: &MapDef, capacity: &Capacity) -> u32 {
    capacity.of(map.name).unwrap_or(map.max_entries)
}

/// Creates `map`, one the agent owns (`MapDef::owned`), as the catalogue describes it.
pub(super) fn create_own(map: &MapDef, capacity: &Capacity) -> Result<MapData> {
    let name = map.name;
    if !map.owned {
        return Err(load_err(name, "not a map the agent creates"));
    }
    let fd = sys::map_create(
        map.kind.bpf_type(),
        map.key_size,
        map.value_size,
        max_entries(map, capacity),
        map.flags,
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

/// Pins in `dir` of our maps under another layout version, staged pins a dead agent left, and
/// pins of retired maps (`svc_common::RETIRED_PINS`).
pub(super) fn other_versions(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        if svc_common::RETIRED_PINS.contains(&file.as_str()) {
            found.push(e.path());
            continue;
        }
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
pub(super) fn inspect_pin(spec: &MapDef, path: &Path, want_entries: u32) -> Result<Pinned> {
    if !path.exists() {
        return Ok(Pinned::Create);
    }
    let data = MapData::from_pin(path).map_err(|e| load_err(path.display(), e))?;
    let info = data.info().map_err(|e| load_err(path.display(), e))?;
    let kind = info.map_type().ok();
    let mut wrong = Vec::new();
    if kind.map(|k| k as u32) != Some(spec.kind.bpf_type()) {
        wrong.push(format!("type {kind:?}, not {:?}", spec.kind));
    }
    if info.key_size() != spec.key_size {
        wrong.push(format!(
            "{}-byte keys, not {}",
            info.key_size(),
            spec.key_size
        ));
    }
    if info.value_size() != spec.value_size {
        wrong.push(format!(
            "{}-byte values, not {}",
            info.value_size(),
            spec.value_size
        ));
    }
    let flags = if spec.kind == MapKind::DevMapHash {
        info.map_flags() & !svc_common::BPF_F_RDONLY_PROG
    } else {
        info.map_flags()
    };
    if flags != spec.flags {
        wrong.push(format!("flags {:#x}, not {:#x}", flags, spec.flags));
    }
    if !wrong.is_empty() {
        return Err(Error::load(format!(
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
