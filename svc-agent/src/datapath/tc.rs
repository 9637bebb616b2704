//! The packet datapath's programs on the node's devices: through pinned tcx links where the
//! kernel has tcx (6.6), else the classic way (`tc_classic.rs`).

use std::collections::BTreeSet;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions};
use aya::programs::{links::FdLink, LinkOrder, SchedClassifier, TcAttachType};
use serde::Serialize;
use tracing::{info, warn};

use super::tc_classic::{self, errno_of};
use super::{io_err, load_err, Datapath, TC_PROGRAMS};
use crate::error::{Error, Result};
use crate::netdev::Device;
use crate::sys;

/// `--tc-attach`: how the tc programs attach to the devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TcAttach {
    /// tcx where the kernel has it (6.6), else classic.
    #[default]
    Auto,
    /// tcx links, pinned; refused at start by a kernel without tcx.
    Tcx,
    /// A clsact qdisc and direct-action cls_bpf filters over netlink, as `tc filter add ...
    /// bpf da` makes them (every kernel svc runs on).
    Classic,
}

/// How the tc programs are attached: `--tc-attach` as the running kernel resolves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TcMode {
    Tcx,
    Classic,
}

impl TcMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TcMode::Tcx => "tcx",
            TcMode::Classic => "classic",
        }
    }
}

impl std::fmt::Display for TcMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TcAttach {
    /// The mode on a kernel with (`has_tcx`) or without tcx; forcing tcx where the kernel
    /// lacks it is an error naming the flag.
    pub fn resolve(self, has_tcx: bool) -> Result<TcMode> {
        match (self, has_tcx) {
            (TcAttach::Auto, true) | (TcAttach::Tcx, true) => Ok(TcMode::Tcx),
            (TcAttach::Auto, false) | (TcAttach::Classic, _) => Ok(TcMode::Classic),
            (TcAttach::Tcx, false) => Err(Error::load(
                "--tc-attach tcx: this kernel has no tcx (BPF_TCX_INGRESS, Linux 6.6); \
                 --tc-attach classic (or auto) attaches the tc programs through a clsact \
                 qdisc instead"
                    .to_string(),
            )),
        }
    }
}

/// One of svc's tc programs on a device, as `list` and /metrics show it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct TcAttachment {
    pub device: String,
    pub program: &'static str,
    pub mode: TcMode,
}

/// Every tc program of svc attached in the calling thread's network namespace: the tcx links
/// pinned under `dir` (by the device they are on now, else the name of their pin) and svc's
/// classic filters on this namespace's devices.
pub fn tc_attachments(dir: &Path) -> Vec<TcAttachment> {
    let mut out: Vec<TcAttachment> = tc_pins(dir)
        .into_iter()
        .map(|(pin, program, ifname)| {
            let device = sys::obj_get(&pin)
                .and_then(|fd| sys::tcx_link_info(fd.as_fd()))
                .ok()
                .and_then(|(ifindex, _)| crate::netdev::ifname(ifindex))
                .unwrap_or(ifname);
            TcAttachment {
                device,
                program,
                mode: TcMode::Tcx,
            }
        })
        .collect();
    match tc_classic::scan() {
        Ok(found) => out.extend(found.into_iter().map(|f| TcAttachment {
            device: f.ifname,
            program: f.program,
            mode: TcMode::Classic,
        })),
        Err(e) => warn!("listing the classic tc filters: {e}"),
    }
    out.sort();
    out
}

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
    /// detaches them from devices no longer chosen). Returns what changed, in words. Before
    /// then (their verification may still run), `attach` takes them.
    pub fn set_tc_devices(
        &mut self,
        external: Vec<Device>,
        pods: Vec<Device>,
    ) -> Result<Vec<String>> {
        self.tc_devices = (external, pods);
        if self.packet_attached {
            let mut done = self.attach_tc()?;
            done.extend(self.attach_xdp()?);
            Ok(done)
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

    /// Sets how the tc programs attach (`--tc-attach`), resolved against the kernel, which
    /// is asked once (`sys::has_tcx`). Before `attach`; the attachments of the other mode are
    /// moved over when the programs are attached (each made in the new mode before the old
    /// one goes).
    pub fn set_tc_attach(&mut self, attach: TcAttach) -> Result<TcMode> {
        let has_tcx = self.kernel_tcx;
        self.tc_mode = attach.resolve(has_tcx)?;
        info!(
            mode = %self.tc_mode,
            kernel_has_tcx = has_tcx,
            "tc programs attach {}",
            match self.tc_mode {
                TcMode::Tcx => "through pinned tcx links",
                TcMode::Classic => "through a clsact qdisc and cls_bpf filters (classic)",
            }
        );
        Ok(self.tc_mode)
    }

    pub fn tc_mode(&self) -> TcMode {
        self.tc_mode
    }

    /// The tc programs this agent has attached or adopted, by device.
    pub fn tc_current_attachments(&self) -> Vec<TcAttachment> {
        let mut out: Vec<TcAttachment> = tc_pins(&self.dir)
            .into_iter()
            .filter(|(pin, _, _)| self.tc_current.contains(pin))
            .map(|(_, program, device)| TcAttachment {
                device,
                program,
                mode: TcMode::Tcx,
            })
            .chain(
                self.tc_classic
                    .iter()
                    .flatten()
                    .map(|(program, device)| TcAttachment {
                        device: device.clone(),
                        program,
                        mode: TcMode::Classic,
                    }),
            )
            .collect();
        out.sort();
        out
    }

    /// Attaches each tc program to its devices in the chosen mode: through a tcx link pinned
    /// as `link_tc_<program>_<ifname>`, or swaps it into the link a previous agent pinned
    /// there (BPF_LINK_UPDATE: the device is never without it); or through svc's classic
    /// filter, replaced in place where a previous agent left one. An attachment of the other
    /// mode goes once the new one is made. Detaches svc's programs from devices no longer
    /// chosen. Other programs on those devices are never touched.
    pub(super) fn attach_tc(&mut self) -> Result<Vec<String>> {
        let mut done = Vec::new();
        let wanted = self.tc_wanted();
        let mut errors = Vec::new();
        let mut keep = BTreeSet::new();
        let mut keep_classic = BTreeSet::new();
        if self.tc_classic.is_none() {
            // Once per agent: what a previous agent attached the classic way, wherever it is
            // in this namespace (filters are not pinned; the kernel is their only record).
            match tc_classic::scan() {
                Ok(found) => {
                    self.tc_classic =
                        Some(found.into_iter().map(|f| (f.program, f.ifname)).collect())
                }
                Err(e) => errors.push(load_err("listing the classic tc filters", e)),
            }
        }
        for (program, at, device) in &wanted {
            let pin = tc_link_pin(&self.dir, program, &device.name);
            let pair = (*program, device.name.clone());
            let made = match self.tc_mode {
                TcMode::Tcx => self.attach_tc_one(program, *at, device, &pin),
                TcMode::Classic => self.attach_classic_one(program, *at, device),
            };
            match made {
                Ok(what) => done.extend(what),
                Err(e) => {
                    // The other mode's attachment, if any, serves on.
                    keep.insert(pin.clone());
                    keep_classic.insert(pair.clone());
                    errors.push(e);
                    continue;
                }
            }
            match self.tc_mode {
                TcMode::Tcx => keep.insert(pin),
                TcMode::Classic => keep_classic.insert(pair),
            };
        }
        for (pin, program, ifname) in tc_pins(&self.dir) {
            if keep.contains(&pin) {
                continue;
            }
            match detach_pinned(&pin) {
                Ok(()) => {
                    info!(program, device = %ifname, mode = "tcx", "detached the tcx link");
                    done.push(format!("detached {program}'s tcx link from {ifname}"));
                }
                Err(e) => errors.push(e),
            }
            self.tc_current.remove(&pin);
        }
        let classic: Vec<(&'static str, String)> =
            self.tc_classic.iter().flatten().cloned().collect();
        for (program, ifname) in classic {
            if keep_classic.contains(&(program, ifname.clone())) {
                continue;
            }
            match tc_classic::delete(program, &ifname) {
                Ok(()) => {
                    info!(program, device = %ifname, mode = "classic", "removed the classic filter");
                    done.push(format!("removed {program}'s classic filter from {ifname}"));
                    if let Some(set) = self.tc_classic.as_mut() {
                        set.remove(&(program, ifname));
                    }
                }
                Err(e) => errors.push(load_err(
                    format!("removing {program}'s classic filter from {ifname}"),
                    e,
                )),
            }
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// One classic filter: kept, replaced in place, or made (with the clsact qdisc it needs).
    /// Some(words) when something changed.
    pub(super) fn attach_classic_one(
        &mut self,
        program: &'static str,
        at: TcAttachType,
        device: &Device,
    ) -> Result<Option<String>> {
        let dev = &device.name;
        let prog = super::load::ebpf(&mut self.programs)?
            .program_mut(program)
            .ok_or_else(|| load_err(program, "program missing from the object"))?;
        let prog = <&mut SchedClassifier>::try_from(prog).map_err(|e| load_err(program, e))?;
        let ours = prog.info().map_err(|e| load_err(program, e))?.id();
        if let Err(e) = aya::programs::tc::qdisc_add_clsact(dev) {
            if errno_of(&e) != Some(libc::EEXIST) {
                return Err(load_err(format!("adding a clsact qdisc to {dev}"), e));
            }
        }
        let found = tc_classic::at_our_place(device.index, at)
            .map_err(|e| load_err(format!("listing the tc filters of {dev}"), e))?;
        let words = match found {
            Some(f) if f.name.as_deref() == Some(program) && f.prog_id == Some(ours) => None,
            Some(f) if f.name.as_deref() == Some(program) => {
                let link = SchedClassifierLink::attached(
                    dev,
                    at,
                    tc_classic::PRIORITY,
                    tc_classic::handle(),
                    None,
                )
                .map_err(|e| load_err(dev, e))?;
                let id = prog
                    .attach_to_link(link)
                    .map_err(|e| load_err(format!("replacing {program}'s filter on {dev}"), e))?;
                // The filter stays when the agent goes: aya's link would remove it on drop.
                std::mem::forget(prog.take_link(id).map_err(|e| load_err(program, e))?);
                info!(program, device = %dev, mode = "classic", "replaced the program of the classic filter");
                Some(format!("swapped {program} on {dev} (classic)"))
            }
            Some(f) => {
                return Err(load_err(
                    format!("attaching {program} to {dev}"),
                    format!(
                        "the cls_bpf filter at svc's place (pref {} handle {:#x}) runs {:?},                          not a program of svc: left alone; remove it (tc filter del dev {dev}                          {} pref {} handle {:#x} bpf) or use --tc-attach tcx",
                        tc_classic::PRIORITY,
                        tc_classic::HANDLE,
                        f.name.unwrap_or_default(),
                        hook(at),
                        tc_classic::PRIORITY,
                        tc_classic::HANDLE,
                    ),
                ))
            }
            None => {
                let id = prog
                    .attach_with_options(
                        dev,
                        at,
                        TcAttachOptions::Netlink(NlOptions {
                            priority: tc_classic::PRIORITY,
                            handle: tc_classic::handle(),
                            classid: None,
                        }),
                    )
                    .map_err(|e| load_err(format!("attaching {program} to {dev}"), e))?;
                std::mem::forget(prog.take_link(id).map_err(|e| load_err(program, e))?);
                info!(program, device = %dev, mode = "classic", "attached");
                Some(format!("attached {program} to {dev} (classic)"))
            }
        };
        self.tc_classic
            .get_or_insert_with(Default::default)
            .insert((program, dev.clone()));
        Ok(words)
    }

    /// Whether svc's classic filter of `program` on `device` runs this agent's program.
    pub(super) fn classic_holds(&self, program: &str, at: TcAttachType, device: &Device) -> bool {
        let Some(Ok(info)) = self
            .programs
            .loaded()
            .and_then(|e| e.program(program))
            .map(|p| p.info())
        else {
            return false;
        };
        matches!(
            tc_classic::at_our_place(device.index, at),
            Ok(Some(f)) if f.prog_id == Some(info.id())
        )
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
                info!(program, device = %device.name, mode = "tcx", "replaced the program of the pinned link");
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
        info!(program, device = %device.name, mode = "tcx", "attached");
        Ok(Some(format!("attached {program} to {}", device.name)))
    }
}

/// Whether svc has tc programs attached (tcx links pinned under `dir`, or classic filters on
/// this namespace's devices) and every tcx link is on a device of the calling thread's
/// network namespace (the same name at the same index): the flows of its CT map are this
/// namespace's to hand over, and no other's conntrack gets them. Classic filters are found
/// in this namespace or not at all.
pub(super) fn tc_links_here(dir: &Path, classic: &[tc_classic::Ours]) -> bool {
    let pins = tc_pins(dir);
    (!pins.is_empty() || !classic.is_empty())
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

/// tc's word for a hook.
fn hook(at: TcAttachType) -> &'static str {
    match at {
        TcAttachType::Egress => "egress",
        _ => "ingress",
    }
}

/// Detaches the link pinned at `pin` (whoever else holds it) and removes the pin: tcx and
/// XDP links alike.
pub(super) fn detach_pinned(pin: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_attach_resolves_against_the_kernel() {
        assert_eq!(TcAttach::Auto.resolve(true).unwrap(), TcMode::Tcx);
        assert_eq!(TcAttach::Auto.resolve(false).unwrap(), TcMode::Classic);
        assert_eq!(TcAttach::Classic.resolve(true).unwrap(), TcMode::Classic);
        assert_eq!(TcAttach::Tcx.resolve(true).unwrap(), TcMode::Tcx);
        let e = TcAttach::Tcx.resolve(false).unwrap_err().to_string();
        assert!(e.contains("--tc-attach tcx") && e.contains("6.6"), "{e}");
    }

    /// This machine's kernel (6.6 or later, as the test suite needs) answers the probe.
    #[test]
    fn this_kernel_has_tcx() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: BPF_PROG_QUERY needs root");
            return;
        }
        assert!(sys::has_tcx().unwrap());
    }
}
