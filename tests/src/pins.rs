//! Pins an agent of an older layout would have left.

use std::os::fd::AsFd;
use std::path::Path;

use anyhow::{Context, Result};
use svc_common::CtKey;

/// `BPF_MAP_TYPE_HASH`: a preallocated one with flags 0 (`SVC_CT` of layout 3).
pub const HASH: u32 = 1;
/// `BPF_MAP_TYPE_LRU_HASH` (`SVC_CT` of layouts 1 and 2).
pub const LRU_HASH: u32 = 9;

/// Pins at `dir/SVC_CT_v{layout}` a map of `map_type` (`HASH` or `LRU_HASH`, flags 0) holding
/// `entries`, as an agent of that layout left its connection-tracking table.
pub fn pin_old_ct<V: aya::Pod>(
    dir: &Path,
    layout: u32,
    map_type: u32,
    entries: &[(CtKey, V)],
) -> Result<()> {
    let fd = svc_agent::sys::map_create(
        map_type,
        std::mem::size_of::<CtKey>() as u32,
        std::mem::size_of::<V>() as u32,
        1024,
        0,
        "SVC_CT",
    )
    .with_context(|| format!("a map of layout {layout}"))?;
    let map = aya::maps::MapData::from_fd(fd)?;
    let handle = aya::maps::MapData::from_fd(map.fd().as_fd().try_clone_to_owned()?)?;
    let mut m: aya::maps::HashMap<_, CtKey, V> = if map_type == LRU_HASH {
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(handle))?
    } else {
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(handle))?
    };
    for (k, v) in entries {
        m.insert(k, v, 0)
            .with_context(|| format!("a flow of layout {layout}"))?;
    }
    map.pin(dir.join(format!("SVC_CT_v{layout}")))
        .with_context(|| format!("pinning layout {layout}"))?;
    Ok(())
}

/// `BPF_MAP_TYPE_ARRAY` (`SVC_MAGLEV` of layout 1).
pub const ARRAY: u32 = 2;

/// Pins at `dir/SVC_MAGLEV_v1` an array of `len` Maglev blocks holding `tables` (first block,
/// blocks), as an agent of layout 1 left its Maglev tables.
pub fn pin_old_maglev(
    dir: &Path,
    len: u32,
    tables: &[(u32, Vec<svc_common::MaglevBlock>)],
) -> Result<()> {
    let fd = svc_agent::sys::map_create(
        ARRAY,
        4,
        std::mem::size_of::<svc_common::MaglevBlock>() as u32,
        len,
        0,
        "SVC_MAGLEV",
    )
    .context("an array of layout 1")?;
    let map = aya::maps::MapData::from_fd(fd)?;
    for (start, blocks) in tables {
        svc_agent::sys::update_array(map.fd().as_fd(), *start, blocks)
            .with_context(|| format!("a table at block {start} of layout 1"))?;
    }
    map.pin(dir.join("SVC_MAGLEV_v1"))
        .context("pinning layout 1")?;
    Ok(())
}
