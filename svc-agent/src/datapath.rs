//! Loading, attaching, adopting and removing the kernel programs and their pinned maps.
//!
//! Layout under the bpffs directory (default /sys/fs/bpf/svc):
//! - one pinned map per name in `svc_common::map_names`;
//! - `link_<program>`: one pinned bpf link per cgroup hook.
//!
//! Links are pinned so the datapath outlives the agent: a stopped agent leaves connections
//! working, and a new one swaps its programs into the existing links (BPF_LINK_UPDATE), so a
//! cgroup is never without its hooks.

use std::collections::HashMap as StdHashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData, PerCpuArray};
use aya::programs::{links::FdLink, CgroupAttachMode, CgroupSockAddr};
use aya::{Ebpf, EbpfLoader};
use svc_common::{capacity, map_names};
use tracing::info;

use crate::error::{Error, Result};
use crate::store::BpfStore;
use crate::sys;

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/svc";

/// The kernel object, built by `cargo xtask build-ebpf`.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/svc.bpf.o"));

/// Program names as in svc-ebpf/src/main.rs, one per cgroup attach point.
pub const PROGRAMS: [&str; 8] = {
    let mut names = [""; 8];
    let mut i = 0;
    while i < names.len() {
        names[i] = sys::SOCK_ADDR_ATTACH_TYPES[i].1;
        i += 1;
    }
    names
};

fn capacities() -> StdHashMap<&'static str, u32> {
    StdHashMap::from([
        (map_names::SERVICES, capacity::SERVICES),
        (map_names::SLOTS, capacity::SLOTS),
        (map_names::BACKENDS, capacity::BACKENDS),
        (map_names::REV_NAT, capacity::REV_NAT),
        (map_names::SOCK_REV, capacity::SOCK_REV),
        (map_names::AFFINITY, capacity::AFFINITY),
        (map_names::NAMES, capacity::NAMES),
    ])
}

fn link_pin(dir: &Path, program: &str) -> PathBuf {
    dir.join(format!("link_{program}"))
}

fn load_err(what: impl std::fmt::Display, e: impl Into<Box<dyn std::error::Error>>) -> Error {
    // aya's errors keep the errno in their source chain; the top message alone hides it.
    let e = e.into();
    let mut msg = format!("{what}: {e}");
    let mut cur = e.source();
    while let Some(s) = cur {
        msg.push_str(&format!(": {s}"));
        cur = s.source();
    }
    Error::Load(msg)
}

/// Loads the programs (reusing pinned maps, with their entries), and attaches each to `cgroup`
/// through a pinned link, or swaps it into the link a previous agent pinned.
pub fn install(dir: &Path, cgroup: &Path) -> Result<BpfStore> {
    sys::ensure_bpffs(dir).map_err(|e| load_err("mounting bpffs at /sys/fs/bpf", e))?;
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let cgroup_file = File::open(cgroup).map_err(|source| Error::Io {
        path: cgroup.to_path_buf(),
        source,
    })?;
    let cgroup_id = cgroup_id(cgroup)?;

    let mut loader = EbpfLoader::new();
    let pins: Vec<(&str, PathBuf)> = map_names::ALL
        .iter()
        .map(|name| (*name, dir.join(name)))
        .collect();
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader
        .load(OBJECT)
        .map_err(|e| load_err("loading the eBPF object", e))?;

    for name in PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .ok_or_else(|| load_err(name, "program missing from the object"))?
            .try_into()
            .map_err(|e| load_err(name, e))?;
        prog.load().map_err(|e| load_err(name, e))?;
        let pin = link_pin(dir, name);
        if pin.exists() {
            let link = sys::obj_get(&pin).map_err(|e| load_err(pin.display(), e))?;
            let attached_to =
                sys::link_cgroup_id(link.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            if attached_to != cgroup_id {
                return Err(Error::Load(format!(
                    "{} attaches to another cgroup (id {attached_to}, not {} with id {cgroup_id}); \
                     run `svc-agent uninstall --bpffs {}` first",
                    pin.display(),
                    cgroup.display(),
                    dir.display()
                )));
            }
            let fd = prog.fd().map_err(|e| load_err(name, e))?;
            sys::link_update(link.as_fd(), fd.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            info!(program = name, "replaced the program of the pinned link");
        } else {
            // A bpf link takes no attach flags; links to one cgroup coexist with other links.
            let id = prog
                .attach(&cgroup_file, CgroupAttachMode::Single)
                .map_err(|e| load_err(format!("attaching {name} to {}", cgroup.display()), e))?;
            let link = prog.take_link(id).map_err(|e| load_err(name, e))?;
            let link = FdLink::try_from(link).map_err(|e| load_err(name, e))?;
            link.pin(&pin).map_err(|e| load_err(pin.display(), e))?;
            info!(program = name, cgroup = %cgroup.display(), "attached");
        }
    }
    store_from(&mut ebpf)
}

fn store_from(ebpf: &mut Ebpf) -> Result<BpfStore> {
    let mut take = |name: &'static str| {
        ebpf.take_map(name)
            .ok_or_else(|| load_err(name, "map missing from the object"))
    };
    build_store(&mut take)
}

fn build_store(take: &mut dyn FnMut(&'static str) -> Result<Map>) -> Result<BpfStore> {
    fn hash<K: aya::Pod, V: aya::Pod>(
        take: &mut dyn FnMut(&'static str) -> Result<Map>,
        name: &'static str,
    ) -> Result<HashMap<MapData, K, V>> {
        HashMap::try_from(take(name)?).map_err(|e| load_err(name, e))
    }
    Ok(BpfStore {
        services: hash(take, map_names::SERVICES)?,
        slots: hash(take, map_names::SLOTS)?,
        backends: hash(take, map_names::BACKENDS)?,
        rev_nat: hash(take, map_names::REV_NAT)?,
        names: hash(take, map_names::NAMES)?,
        affinity: hash(take, map_names::AFFINITY)?,
        stats: PerCpuArray::try_from(take(map_names::STATS)?)
            .map_err(|e| load_err(map_names::STATS, e))?,
        capacity: capacities(),
    })
}

/// Opens the maps pinned under `dir`, for listing; loads and attaches nothing.
pub fn open_pinned(dir: &Path) -> Result<BpfStore> {
    build_store(&mut |name| pinned(dir, name))
}

fn pinned(dir: &Path, name: &'static str) -> Result<Map> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|e| {
        load_err(
            path.display(),
            format!("{e} (is svc-agent running with --bpffs {}?)", dir.display()),
        )
    })?;
    Map::from_map_data(data).map_err(|e| load_err(name, e))
}

/// The cgroup v2 id of a cgroup directory is its inode number.
fn cgroup_id(cgroup: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(cgroup)
        .map(|m| m.ino())
        .map_err(|source| Error::Io {
            path: cgroup.to_path_buf(),
            source,
        })
}

/// Removes every link and map pin under `dir`, then `dir`. Unpinning a link that no process
/// holds detaches its program; unpinning a map that no program uses frees it.
pub fn uninstall(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    if !dir.exists() {
        return Ok(removed);
    }
    let names = PROGRAMS
        .iter()
        .map(|p| link_pin(dir, p))
        .chain(map_names::ALL.iter().map(|m| dir.join(m)));
    for path in names {
        match std::fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { path, source }),
        }
    }
    std::fs::remove_dir(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    Ok(removed)
}

/// Totals of the socket programs' decision counters, by reason, from the pinned map alone.
pub fn read_stats(dir: &Path) -> Result<Vec<(&'static str, u64)>> {
    let stats: PerCpuArray<MapData, u64> = PerCpuArray::try_from(pinned(dir, map_names::STATS)?)
        .map_err(|e| load_err(map_names::STATS, e))?;
    crate::store::stat_totals(&stats)
}
