//! The socket programs on the cgroup: checks, attach through pinned links, swap.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use aya::maps::MapData;
use svc_common::{catalogue, map_names};
use tracing::{info, warn};

use super::migrate::{carry_ct_of_layout, carry_ct_v1, migrate, CT_LAYOUTS_OF_THIS_VALUE};
use super::pins::{link_pin, map_pin, staged_pin};
use super::{io_err, load_err, Datapath, PROGRAMS};
use crate::error::{Error, Result};
use crate::sys;

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// Checks that `cgroup` is a cgroup v2 directory, before anything is created.
pub(super) fn check_cgroup(cgroup: &Path) -> Result<u64> {
    let meta = std::fs::metadata(cgroup).map_err(|e| io_err(cgroup, e))?;
    if !meta.is_dir() {
        return Err(Error::load(format!(
            "--cgroup {}: not a directory; give a cgroup v2 directory (the cgroup2 mount, or a \
             cgroup under it)",
            cgroup.display()
        )));
    }
    if sys::fs_magic(cgroup).map_err(|e| io_err(cgroup, e))? != CGROUP2_SUPER_MAGIC {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let cgroup2 = mounts
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2) == Some(&"cgroup2")).then(|| f[1].to_string())
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(Error::load(format!(
            "--cgroup {}: not on a cgroup v2 filesystem (socket programs attach to cgroup v2 \
             only); cgroup2 is mounted at: {}",
            cgroup.display(),
            if cgroup2.is_empty() {
                "nowhere"
            } else {
                &cgroup2
            }
        )));
    }
    Ok(meta.ino())
}

/// Refuses when a program of svc's (by name) is attached to `cgroup` other than through a
/// link pinned under `dir`: another svc serves the cgroup, from another bpffs directory.
/// The error names the cgroup, the programs and links, and the process that holds them with
/// its bpffs directory when one does.
pub(super) fn check_other_svc(dir: &Path, cgroup: &Path, cgroup_id: u64) -> Result<()> {
    let f = File::open(cgroup).map_err(|e| io_err(cgroup, e))?;
    let mut others = Vec::new();
    for (t, name) in sys::ATTACH_POINTS {
        let pin = link_pin(dir, name);
        let ours = sys::obj_get(&pin)
            .and_then(|l| sys::link_info(l.as_fd()))
            .ok()
            .filter(|(_, cg)| *cg == cgroup_id)
            .map(|(prog, _)| prog);
        let ids = match sys::attached_program_ids(f.as_fd(), t) {
            Ok(ids) => ids,
            // Without the privilege to list them the agent cannot load its programs either,
            // and that load's error says which privilege is missing.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                warn!(
                    cgroup = %cgroup.display(),
                    "cannot list the cgroup's programs ({e}): another svc on it goes unnoticed"
                );
                return Ok(());
            }
            Err(e) => {
                return Err(load_err(
                    format!("querying {} at {name}", cgroup.display()),
                    e,
                ))
            }
        };
        for id in ids.into_iter().filter(|id| Some(*id) != ours) {
            // A program that went away meanwhile, or another's program: not svc's.
            if sys::prog_name(id).is_ok_and(|n| n == name) {
                others.push((name, id));
            }
        }
    }
    let Some(&(_, first)) = others.first() else {
        return Ok(());
    };
    let programs = others
        .iter()
        .map(|(hook, id)| {
            let links = sys::cgroup_links_of(*id, cgroup_id);
            if links.is_empty() {
                format!("{hook}: program {id}")
            } else {
                let links: Vec<String> = links.iter().map(u32::to_string).collect();
                format!("{hook}: program {id} (link {})", links.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let holders: Vec<String> = sys::prog_holders(first)
        .into_iter()
        .filter(|(pid, _)| *pid != std::process::id())
        .map(|(pid, bpffs)| {
            let at = bpffs
                .map(|d| format!(", bpffs {}", d.display()))
                .unwrap_or_default();
            format!("pid {pid} ({}{at})", sys::process_name(pid))
        })
        .collect();
    let who = if holders.is_empty() {
        "no running process holds them: a stopped agent's pinned links; `svc-agent uninstall \
         --bpffs ITS_DIR --cgroup CGROUP` removes them"
            .to_string()
    } else {
        format!("held by {}", holders.join("; "))
    };
    Err(Error::load(format!(
        "cgroup {} is already served by another svc, not through links pinned under {}: {programs}; \
         {who}. One svc agent per cgroup: stop the other (and uninstall its directory), or run \
         this one with its --bpffs",
        cgroup.display(),
        dir.display()
    )))
}

impl Datapath {
    /// Whether every program of this agent is attached: the socket programs, and the tc and
    /// XDP programs (where their devices are), with the resized maps in place (`attach`).
    pub fn is_attached(&self) -> bool {
        self.attached && self.packet_attached
    }

    /// Whether this agent's socket programs are attached (`attach_sockets`), the rest perhaps
    /// not yet.
    pub fn sockets_attached(&self) -> bool {
        self.attached
    }

    /// Whether every link is pinned (by us, or by a previous agent whose programs serve).
    pub fn links_pinned(&self) -> bool {
        PROGRAMS.iter().all(|p| link_pin(&self.dir, p).exists())
    }

    /// Whether the socket programs may attach before the tc programs are verified: every map
    /// this object uses is the one the pinned programs use (no resized copy waiting for its
    /// pin, no pin of another layout), so programs of either agent read the same state, as
    /// during any attach; and no socket program of svc serves the cgroup yet. Where one does
    /// (a restart), it serves the maps the first sync wrote already, and swapping the socket
    /// programs alone would gain nothing: the swap stays one moment, after the verification.
    pub fn sockets_first(&self) -> bool {
        self.staged.is_empty()
            && self.obsolete.is_empty()
            && !PROGRAMS.iter().any(|p| link_pin(&self.dir, p).exists())
    }

    /// Attaches each socket program to the cgroup through a pinned link, or swaps it into the
    /// link a previous agent pinned. Waits for the socket programs' verification (begun
    /// beside the first sync: usually over by its end), not for the tc programs'.
    pub fn attach_sockets(&mut self) -> Result<()> {
        // Again: another agent may have attached since `open` (both started at once).
        check_other_svc(&self.dir, &self.cgroup, self.cgroup_id)?;
        let cgroup_file = File::open(&self.cgroup).map_err(|e| io_err(&self.cgroup, e))?;
        for name in PROGRAMS {
            self.attach_one(name, &cgroup_file, true)?;
        }
        self.attached = true;
        Ok(())
    }

    /// Attaches everything not attached yet: the socket programs (`attach_sockets`), then
    /// the tc and XDP programs on their devices; then finishes migrations and removes pins of
    /// other layouts. Waits for the tc programs' verification, and attaches nothing more
    /// when the kernel refused one of them.
    pub fn attach(&mut self) -> Result<()> {
        super::load::ebpf(&mut self.programs)?;
        if !self.attached {
            self.attach_sockets()?;
        }
        self.packet_attached = true;
        if let Err(e) = self.attach_tc() {
            warn!("attaching the packet datapath: {e}");
        }
        if let Err(e) = self.attach_xdp() {
            warn!("attaching the XDP program: {e}");
        }

        // The new programs use the new maps now: entries the old programs wrote in the
        // meantime are carried over, then the new maps take the pins.
        for name in std::mem::take(&mut self.staged) {
            let path = map_pin(&self.dir, name);
            if let Ok(old) = MapData::from_pin(&path) {
                if catalogue::find(name).is_some_and(|m| m.carry_late) {
                    if let Err(e) = migrate(&mut self.store, name, &old, true) {
                        warn!(map = name, "carrying over late entries: {e}");
                    }
                }
            }
            let staged = staged_pin(&self.dir, name);
            std::fs::rename(&staged, &path).map_err(|e| io_err(&staged, e))?;
            info!(map = name, "resized map in place");
        }
        // The old programs may have made flows since the first carry; they are this map's
        // now.
        if let Err(e) = carry_ct_v1(&mut self.store, &self.dir) {
            warn!(
                map = map_names::CT,
                "carrying over late flows of layout 1: {e}"
            );
        }
        for layout in CT_LAYOUTS_OF_THIS_VALUE {
            if let Err(e) = carry_ct_of_layout(&mut self.store, &self.dir, layout) {
                warn!(
                    map = map_names::CT,
                    "carrying over late flows of layout {layout}: {e}"
                );
            }
        }
        // The old programs are gone: the backends map and the Maglev array of layout 1 are read
        // no more.
        self.store.backends_v1 = None;
        self.store.maglev_v1 = None;
        for path in std::mem::take(&mut self.obsolete) {
            match std::fs::remove_file(&path) {
                Ok(()) => info!(pin = %path.display(), "removed a pin of another map layout"),
                // One whose entries were carried over goes then (`carry_slots_v1`).
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => warn!("removing {}: {e}", path.display()),
            }
        }
        Ok(())
    }

    pub(super) fn attach_one(&mut self, name: &str, cgroup_file: &File, swap: bool) -> Result<()> {
        let pin = link_pin(&self.dir, name);
        let prog = self
            .sockets
            .wait()?
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, fd)| fd.as_fd())
            .ok_or_else(|| load_err(name, "program missing from the object"))?;
        if pin.exists() {
            let link = sys::obj_get(&pin).map_err(|e| load_err(pin.display(), e))?;
            let (_, attached_to) =
                sys::link_info(link.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            if attached_to == self.cgroup_id {
                if swap {
                    sys::link_update(link.as_fd(), prog).map_err(|e| load_err(pin.display(), e))?;
                    info!(program = name, "replaced the program of the pinned link");
                }
                return Ok(());
            }
            if attached_to != 0 {
                return Err(Error::load(format!(
                    "{} attaches to another cgroup (id {attached_to}, not {} with id {}); run \
                     `svc-agent uninstall --bpffs {}` first",
                    pin.display(),
                    self.cgroup.display(),
                    self.cgroup_id,
                    self.dir.display()
                )));
            }
            // Detached behind our back (its cgroup is gone, or someone detached it): replace.
            std::fs::remove_file(&pin).map_err(|e| io_err(&pin, e))?;
        }
        let attach_type = sys::ATTACH_POINTS
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(t, _)| *t)
            .ok_or_else(|| load_err(name, "not a cgroup attach point of svc"))?;
        // A bpf link with no attach flags, as aya's attach makes it: links to one cgroup
        // coexist with other links. Made by hand, as the program's aya object may be on the
        // verifying thread.
        let link = sys::link_create(prog, cgroup_file.as_fd(), attach_type)
            .map_err(|e| load_err(format!("attaching {name} to {}", self.cgroup.display()), e))?;
        sys::obj_pin(link.as_fd(), &pin).map_err(|e| load_err(pin.display(), e))?;
        info!(program = name, cgroup = %self.cgroup.display(), "attached");
        Ok(())
    }
}
