//! The packet datapath's programs on the node's devices, through pinned tcx links.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::programs::{links::FdLink, tc::TcAttachOptions, LinkOrder, SchedClassifier, TcAttachType};
use tracing::info;

use super::{io_err, load_err, Datapath, TC_PROGRAMS};
use crate::error::Result;
use crate::netdev::Device;
use crate::sys;

/// Where the tc link of `program` on device `ifname` is pinned.
pub fn tc_link_pin(dir: &Path, program: &str, ifname: &str) -> PathBuf {
    dir.join(format!("link_tc_{program}_{ifname}"))
}

/// The tc link pins in `dir`, with the program and device their names say.
pub(super) fn tc_pins(dir: &Path) -> Vec<(PathBuf, &'static str, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        for (program, _, _) in TC_PROGRAMS {
            if let Some(ifname) = file.strip_prefix(&format!("link_tc_{program}_")) {
                out.push((e.path(), program, ifname.to_string()));
            }
        }
    }
    out.sort();
    out
}

impl Datapath {
    /// Whether this object has the packet datapath's programs.
    pub fn has_tc_programs(&self) -> bool {
        !self.tc_loaded.is_empty()
    }

    /// Sets the devices the tc programs belong on; once attached, attaches them there (and
    /// detaches them from devices no longer chosen). Returns what changed, in words.
    pub fn set_tc_devices(
        &mut self,
        external: Vec<Device>,
        pods: Vec<Device>,
    ) -> Result<Vec<String>> {
        self.tc_devices = (external, pods);
        if self.attached {
            self.attach_tc()
        } else {
            Ok(Vec::new())
        }
    }

    /// The (program, device) pairs that should have a link.
    pub(super) fn tc_wanted(&self) -> Vec<(&'static str, TcAttachType, Device)> {
        let mut out = Vec::new();
        for (program, at, external) in TC_PROGRAMS {
            if !self.tc_loaded.contains(&program) {
                continue;
            }
            let devices = if external {
                &self.tc_devices.0
            } else {
                &self.tc_devices.1
            };
            for d in devices {
                out.push((program, at, d.clone()));
            }
        }
        out
    }

    /// Attaches each tc program to its devices through a tcx link pinned as
    /// `link_tc_<program>_<ifname>`, or swaps it into the link a previous agent pinned there
    /// (BPF_LINK_UPDATE: the device is never without it); detaches svc's links from devices
    /// no longer chosen. Other programs on those devices are never touched.
    pub(super) fn attach_tc(&mut self) -> Result<Vec<String>> {
        let mut done = Vec::new();
        let wanted = self.tc_wanted();
        let mut errors = Vec::new();
        let mut keep = std::collections::BTreeSet::new();
        for (program, at, device) in &wanted {
            let pin = tc_link_pin(&self.dir, program, &device.name);
            keep.insert(pin.clone());
            match self.attach_tc_one(program, *at, device, &pin) {
                Ok(Some(what)) => done.push(what),
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        for (pin, program, ifname) in tc_pins(&self.dir) {
            if keep.contains(&pin) {
                continue;
            }
            match detach_pinned(&pin) {
                Ok(()) => {
                    info!(program, device = %ifname, "detached from a device no longer chosen");
                    done.push(format!("detached {program} from {ifname}"));
                }
                Err(e) => errors.push(e),
            }
            self.tc_current.remove(&pin);
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// One tc link: kept, swapped, or made. Some(words) when something changed.
    pub(super) fn attach_tc_one(
        &mut self,
        program: &'static str,
        at: TcAttachType,
        device: &Device,
        pin: &Path,
    ) -> Result<Option<String>> {
        if pin.exists() {
            let link = sys::obj_get(pin).map_err(|e| load_err(pin.display(), e))?;
            let (ifindex, _) =
                sys::tcx_link_info(link.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            if ifindex == device.index {
                if self.tc_current.contains(pin) {
                    return Ok(None);
                }
                let prog = super::load::ebpf(&mut self.programs)?
                    .program(program)
                    .ok_or_else(|| load_err(program, "program missing from the object"))?;
                let fd = prog.fd().map_err(|e| load_err(program, e))?;
                sys::link_update(link.as_fd(), fd.as_fd())
                    .map_err(|e| load_err(pin.display(), e))?;
                self.tc_current.insert(pin.to_path_buf());
                info!(program, device = %device.name, "replaced the program of the pinned link");
                return Ok(Some(format!("swapped {program} on {}", device.name)));
            }
            // The device went away (or was made again under the same name): the old link is
            // dead or elsewhere; ours goes on the device that has the name now.
            detach_pinned(pin)?;
        }
        let prog = super::load::ebpf(&mut self.programs)?
            .program_mut(program)
            .ok_or_else(|| load_err(program, "program missing from the object"))?;
        let prog = <&mut SchedClassifier>::try_from(prog).map_err(|e| load_err(program, e))?;
        let id = prog
            .attach_with_options(
                &device.name,
                at,
                TcAttachOptions::TcxOrder(LinkOrder::first()),
            )
            .map_err(|e| load_err(format!("attaching {program} to {}", device.name), e))?;
        let link = prog.take_link(id).map_err(|e| load_err(program, e))?;
        let link = FdLink::try_from(link).map_err(|e| load_err(program, e))?;
        link.pin(pin).map_err(|e| load_err(pin.display(), e))?;
        self.tc_current.insert(pin.to_path_buf());
        info!(program, device = %device.name, "attached");
        Ok(Some(format!("attached {program} to {}", device.name)))
    }
}

/// Whether svc has tc links under `dir` and every one is on a device of the calling thread's
/// network namespace (the same name at the same index): the flows of its CT map are this
/// namespace's to hand over, and no other's conntrack gets them.
pub(super) fn tc_links_here(dir: &Path) -> bool {
    let pins = tc_pins(dir);
    !pins.is_empty()
        && pins.iter().all(|(pin, _, ifname)| {
            let Ok(fd) = sys::obj_get(pin) else {
                return false;
            };
            let Ok((ifindex, _)) = sys::tcx_link_info(fd.as_fd()) else {
                return false;
            };
            let Ok(name) = std::ffi::CString::new(ifname.as_str()) else {
                return false;
            };
            // SAFETY: a NUL-terminated name.
            ifindex != 0 && unsafe { libc::if_nametoindex(name.as_ptr()) } == ifindex
        })
}

/// Detaches the link pinned at `pin` (whoever else holds it) and removes the pin.
fn detach_pinned(pin: &Path) -> Result<()> {
    if let Ok(fd) = sys::obj_get(pin) {
        match sys::link_detach(fd.as_fd()) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOLINK) | Some(libc::EINVAL)) => {}
            Err(e) => return Err(load_err(format!("detaching {}", pin.display()), e)),
        }
    }
    match std::fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(pin, e)),
    }
}
