//! Putting back what was removed under a running agent.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use svc_common::map_names;

use super::load::store_map;
use super::lock::{lock_dir, own_dir};
use super::pins::{link_pin, map_pin};
use super::tc::tc_link_pin;
use super::xdp::xdp_pins;
use super::{io_err, load_err, Datapath, TcMode, PROGRAMS};
use crate::error::Error;
use crate::sys;

impl Datapath {
    /// Puts back what someone removed under the running agent: its directory, map pins,
    /// links. Returns what was repaired, in words; errors are what could not be.
    pub fn repair(&mut self) -> (Vec<String>, Vec<Error>) {
        let mut repaired = Vec::new();
        let mut errors = Vec::new();
        let same_dir = std::fs::metadata(&self.dir).is_ok_and(|m| m.ino() == self.dir_ino);
        if !same_dir {
            match own_dir(&self.dir).and_then(|()| lock_dir(&self.dir)) {
                Ok((lock, ino)) => {
                    self.lock = lock;
                    self.dir_ino = ino;
                    repaired.push(format!("directory {}", self.dir.display()));
                }
                Err(e) => {
                    errors.push(e);
                    return (repaired, errors);
                }
            }
        }
        for name in map_names::ALL {
            let path = map_pin(&self.dir, name);
            if path.exists() || self.staged.contains(&name) {
                continue;
            }
            let Some(map) = store_map(&self.store, name) else {
                continue;
            };
            match map.pin(&path) {
                Ok(()) => repaired.push(format!("map pin {}", path.display())),
                Err(e) => errors.push(load_err(path.display(), e)),
            }
        }
        if self.attached {
            let cgroup_file = match File::open(&self.cgroup) {
                Ok(f) => f,
                Err(e) => {
                    errors.push(io_err(&self.cgroup, e));
                    return (repaired, errors);
                }
            };
            for name in PROGRAMS {
                let pin = link_pin(&self.dir, name);
                if link_holds(&pin, sys::link_info, |(_, cg)| cg == self.cgroup_id) {
                    continue;
                }
                match self.attach_one(name, &cgroup_file, false) {
                    Ok(()) => repaired.push(format!("link {}", pin.display())),
                    Err(e) => errors.push(e),
                }
            }
        }
        // Not before they are attached: until then their verification may still run.
        if self.packet_attached {
            for (program, at, device) in self.tc_wanted() {
                if self.tc_mode == TcMode::Classic {
                    // Someone deleted the filter or the clsact qdisc (`tc qdisc del dev X
                    // clsact` takes every filter with it).
                    if self.classic_holds(program, at, &device) {
                        continue;
                    }
                    match self.attach_classic_one(program, at, &device) {
                        Ok(_) => {
                            repaired.push(format!("classic filter of {program} on {}", device.name))
                        }
                        Err(e) => errors.push(e),
                    }
                    continue;
                }
                let pin = tc_link_pin(&self.dir, program, &device.name);
                if link_holds(&pin, sys::tcx_link_info, |(ifindex, _)| {
                    ifindex == device.index
                }) {
                    continue;
                }
                self.tc_current.remove(&pin);
                match self.attach_tc_one(program, at, &device, &pin) {
                    Ok(_) => repaired.push(format!("link {}", pin.display())),
                    Err(e) => errors.push(e),
                }
            }
            for device in self.xdp_wanted() {
                if !self.xdp_attached_here(&device) {
                    continue;
                }
                let held = xdp_pins(&self.dir).iter().any(|(pin, _, ifname)| {
                    *ifname == device.name
                        && link_holds(pin, sys::tcx_link_info, |(ifindex, _)| {
                            ifindex == device.index
                        })
                });
                if held {
                    continue;
                }
                // Unpinned (its last reference) or detached (`bpftool link detach`): no
                // redirect target until its link is back.
                if let Err(e) = self.xdp_devs_remove(device.index) {
                    errors.push(e);
                }
                match self.attach_xdp_one(&device) {
                    // A redirect target again through the refresh below.
                    Ok((Some(pin), _)) => repaired.push(format!("link {}", pin.display())),
                    // Native XDP refused this time: tc serves it (warned, recorded).
                    Ok((None, _)) => {}
                    Err(e) => errors.push(e),
                }
            }
            errors.extend(self.xdp_devs_refresh());
        }
        (repaired, errors)
    }
}

/// Whether a link is pinned at `pin` and what `info` reads of it is `healthy`.
pub(super) fn link_holds<T>(
    pin: &Path,
    info: fn(BorrowedFd<'_>) -> std::io::Result<T>,
    healthy: impl FnOnce(T) -> bool,
) -> bool {
    pin.exists()
        && sys::obj_get(pin)
            .and_then(|l| info(l.as_fd()))
            .is_ok_and(healthy)
}
