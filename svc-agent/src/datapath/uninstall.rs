//! `svc-agent uninstall`: links detached, pins and directory removed, flows handed over.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{Array, Map, MapData};
use svc_common::map_names;

use super::lock::lock_dir;
use super::migrate::CT_LAYOUTS_OF_THIS_VALUE;
use super::pins::{link_pin, map_pin, other_versions, staged_pin};
use super::tc::{tc_links_here, tc_pins};
use super::{io_err, load_err, PROGRAMS};
use crate::error::{Error, Result};
use crate::sys;

/// What `uninstall` did.
#[derive(Debug, Default)]
pub struct Uninstalled {
    pub removed: Vec<PathBuf>,
    /// svc's classic tc filters removed: "program on device (classic)".
    pub removed_filters: Vec<String>,
    /// Programs of others found on the cgroup's hooks: left alone.
    pub foreign: Vec<String>,
    /// svc's tc flows handed over to the node's conntrack; `None` when svc had no
    /// tc program on a device of this network namespace (nothing to hand over here).
    pub handover: Option<crate::handover::Handover>,
    /// Why the handover could not run at all.
    pub handover_error: Option<String>,
}

/// Removes every link and map pin under `dir`, then `dir`, and detaches svc's programs from
/// `cgroup` even if some process still holds their links. Refuses while an agent owns the
/// directory. Unpinning a map that no program uses frees it.
pub fn uninstall(dir: &Path, cgroup: Option<&Path>) -> Result<Uninstalled> {
    let mut done = Uninstalled::default();
    if !dir.exists() {
        if let Some(cg) = cgroup {
            done.foreign = check_detached(cg, &[])?;
        }
        return Ok(done);
    }
    let (_lock, _) = lock_dir(dir)?;
    // The links, opened before their pins go, so they can be detached whoever holds them.
    let tc_links: Vec<PathBuf> = tc_pins(dir)
        .into_iter()
        .map(|(p, _, _)| p)
        .chain(super::xdp_pins(dir).into_iter().map(|(p, _, _)| p))
        .collect();
    let links: Vec<(PathBuf, std::os::fd::OwnedFd)> = PROGRAMS
        .iter()
        .map(|p| link_pin(dir, p))
        .chain(tc_links.iter().cloned())
        .filter_map(|pin| sys::obj_get(&pin).ok().map(|fd| (pin, fd)))
        .collect();
    // svc's classic filters on this namespace's devices (kernels without tcx, or
    // `--tc-attach classic`); found before anything goes, removed with the links.
    // Only those whose programs read this directory's maps: another svc directory may serve
    // the same namespace.
    let our_maps: std::collections::BTreeSet<u32> = map_names::ALL
        .iter()
        .flat_map(|m| [map_pin(dir, m), staged_pin(dir, m)])
        .chain(other_versions(dir))
        .filter_map(|p| MapData::from_pin(p).ok()?.info().ok().map(|i| i.id()))
        .collect();
    let mut classic = match super::tc_classic::scan() {
        Ok(found) => found,
        Err(e) => return Err(load_err("listing the classic tc filters", e)),
    };
    classic.retain(|f| super::tc_classic::uses_maps(f.prog_id, &our_maps));
    let ours: Vec<u32> = links
        .iter()
        .filter_map(|(_, fd)| sys::link_info(fd.as_fd()).ok().map(|(prog, _)| prog))
        .collect();
    // While svc's tc programs still translate: once they are gone, a flow the node's conntrack
    // does not carry would meet kube-proxy's rules as a new connection.
    if tc_links_here(dir, &classic) {
        // The timeouts the agent wrote, if any: a flow's lifetime left, as svc would count it.
        let config = MapData::from_pin(map_pin(dir, map_names::CONFIG))
            .ok()
            .and_then(|m| {
                Array::<MapData, svc_common::DatapathConfig>::try_from(Map::Array(m)).ok()
            })
            .and_then(|a| a.get(&0, 0).ok())
            .unwrap_or_default();
        // Both tables: an unassured flow (a handshake in flight, a UDP flow with one reply)
        // is handed over as conntrack would hold it, unassured.
        for name in [map_names::CT, map_names::CT_NEW] {
            let mut path = map_pin(dir, name);
            if name == map_names::CT && !path.exists() {
                // An older agent's datapath whose table holds this layout's values (layout 3:
                // allocated in full; 2: one table of every flow).
                let older = CT_LAYOUTS_OF_THIS_VALUE
                    .iter()
                    .rev()
                    .map(|v| dir.join(format!("{name}_v{v}")))
                    .find(|p| p.exists());
                if let Some(older) = older {
                    path = older;
                }
            }
            if name == map_names::CT_NEW && !path.exists() {
                // An older agent's datapath: one table of every flow.
                continue;
            }
            match MapData::from_pin(&path) {
                Ok(ct) => match crate::handover::hand_over(ct, &config) {
                    Ok(h) => done.handover.get_or_insert_with(Default::default).add(h),
                    Err(e) => done.handover_error = Some(format!("ctnetlink: {e}")),
                },
                Err(e) => done.handover_error = Some(format!("map {name}: {e}")),
            }
        }
    }
    let mut names: Vec<PathBuf> = PROGRAMS
        .iter()
        .map(|p| link_pin(dir, p))
        .chain(tc_links)
        .chain(map_names::ALL.iter().map(|m| map_pin(dir, m)))
        .chain(map_names::ALL.iter().map(|m| staged_pin(dir, m)))
        .collect();
    names.extend(other_versions(dir));
    names.extend(super::xdp::xdp_tc_marks(dir).into_iter().map(|(m, _, _)| m));
    for path in names {
        match std::fs::remove_file(&path) {
            Ok(()) => done.removed.push(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { path, source }),
        }
    }
    for (pin, fd) in &links {
        match sys::link_detach(fd.as_fd()) {
            Ok(()) => {}
            // Already detached: its cgroup went away, or nothing held it once unpinned.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOLINK) | Some(libc::EINVAL)) => {}
            Err(e) => return Err(load_err(format!("detaching {}", pin.display()), e)),
        }
    }
    drop(links);
    for f in &classic {
        super::tc_classic::delete(f.program, &f.ifname).map_err(|e| {
            load_err(
                format!("removing {}'s classic filter from {}", f.program, f.ifname),
                e,
            )
        })?;
        done.removed_filters
            .push(format!("{} on {} (classic)", f.program, f.ifname));
    }
    std::fs::remove_dir(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    if let Some(cg) = cgroup {
        done.foreign = check_detached(cg, &ours)?;
    }
    Ok(done)
}

/// Fails if any of `ours` is still attached to `cgroup`; returns the other programs found on
/// svc's hooks there (not ours to judge).
fn check_detached(cgroup: &Path, ours: &[u32]) -> Result<Vec<String>> {
    let f = File::open(cgroup).map_err(|e| io_err(cgroup, e))?;
    let mut left = Vec::new();
    let mut foreign = Vec::new();
    for (t, name) in sys::ATTACH_POINTS {
        let ids = sys::attached_program_ids(f.as_fd(), t)
            .map_err(|e| load_err(format!("querying {} at {name}", cgroup.display()), e))?;
        for id in ids {
            if ours.contains(&id) {
                left.push(format!("{name}: program {id}"));
            } else {
                foreign.push(format!("{name}: program {id}"));
            }
        }
    }
    if !left.is_empty() {
        return Err(Error::load(format!(
            "svc's programs are still attached to {} ({})",
            cgroup.display(),
            left.join(", ")
        )));
    }
    Ok(foreign)
}
