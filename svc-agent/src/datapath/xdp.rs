//! The XDP program on the external devices (docs/design/xdp.md), next to the tc programs,
//! through pinned bpf links named after the mode each device runs:
//! `link_xdp_<mode>_<ifname>`, mode `native` (the driver's hook) or `generic` (the kernel's
//! skb-based hook, `--xdp-mode generic`). Adopted across restarts as the tc links are
//! (BPF_LINK_UPDATE swaps the new program in); removed when XDP is turned off, the device is
//! no longer chosen, and by `uninstall`. Under `native`, a device whose driver refuses native
//! XDP gets no XDP program (tc serves it), recorded as `xdp_tc_<ifname>` for `list` and
//! /metrics.
//!
//! The devices whose link is of the agent's mode are the ones XDP may redirect a packet to
//! (`SVC_XDP_DEVS`, docs/design/xdp.md, "Another device"; under `native` only those whose
//! driver takes redirected frames): a device is put there only once its link holds, and taken
//! out before the agent detaches its link or changes its mode, so no detach of the agent's
//! leaves the map naming a device without the program, nor one of the other mode (a link
//! detached by someone else is taken out at the next pin check).

use std::collections::BTreeSet;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{xdp::DevMapHash, MapData};
use aya::programs::{links::FdLink, ProgramError, Xdp, XdpMode as AttachMode};
use svc_common::map_names;
use tracing::{info, warn};

use super::tc::detach_pinned;
use super::{load_err, Datapath};
use crate::error::{Error, Result};
use crate::netdev::Device;
use crate::sys;

/// The XDP program of svc-ebpf/src/main.rs.
pub const XDP_PROGRAM: &str = "xdp_ext";

/// `--xdp-mode`: where the XDP program goes on the external devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XdpMode {
    /// No XDP program: tc alone (the default).
    #[default]
    Off,
    /// The driver's hook; a device whose driver refuses it gets no XDP program (tc serves
    /// it), and the log, `list` and /metrics say so.
    Native,
    /// The kernel's generic hook on every device (after the skb is built: no speed-up, but
    /// the same decisions; for testing and drivers without native XDP).
    Generic,
}

impl std::str::FromStr for XdpMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<XdpMode> {
        match s {
            "off" => Ok(XdpMode::Off),
            "native" => Ok(XdpMode::Native),
            "generic" => Ok(XdpMode::Generic),
            _ => Err(Error::load(format!(
                "--xdp-mode {s:?}: expected off, native or generic"
            ))),
        }
    }
}

/// The mode words of the pins.
const MODES: [&str; 2] = ["native", "generic"];

impl XdpMode {
    /// The mode word of this mode's link pins; None when off.
    pub fn word(self) -> Option<&'static str> {
        match self {
            XdpMode::Off => None,
            XdpMode::Native => Some("native"),
            XdpMode::Generic => Some("generic"),
        }
    }
}

/// The mode `list` and /metrics show for a device left to tc under `native`.
pub const TC_MODE: &str = "tc";

/// Where the refusal of native XDP on device `ifname` is recorded: a symbolic link (bpffs
/// holds nothing but pins, directories and those) whose target is the reason in words, read
/// by `list` and /metrics, which may run in another process.
fn xdp_tc_mark(dir: &Path, ifname: &str) -> PathBuf {
    dir.join(format!("xdp_tc_{ifname}"))
}

/// The devices recorded in `dir` as left to tc: (mark, device, reason).
pub(super) fn xdp_tc_marks(dir: &Path) -> Vec<(PathBuf, String, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        if let Some(ifname) = file.strip_prefix("xdp_tc_") {
            let why = std::fs::read_link(e.path())
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push((e.path(), ifname.to_string(), why));
        }
    }
    out.sort();
    out
}

/// What runs on each external device as the pins say, whichever agent attached it: its XDP
/// link's mode, or `tc` where native XDP was refused (with the reason).
pub fn xdp_listing(dir: &Path) -> Vec<crate::list::ListedXdpDevice> {
    let mut out: Vec<crate::list::ListedXdpDevice> = xdp_pins(dir)
        .into_iter()
        .map(|(_, mode, device)| crate::list::ListedXdpDevice {
            device,
            mode,
            why: None,
        })
        .collect();
    out.extend(xdp_tc_marks(dir).into_iter().map(|(_, device, why)| {
        crate::list::ListedXdpDevice {
            device,
            mode: TC_MODE,
            why: Some(why),
        }
    }));
    out.sort_by(|a, b| a.device.cmp(&b.device));
    out
}

/// Whether a native attach's error is the driver saying it has no native XDP
/// (`EOPNOTSUPP`): the device is then left to tc. Anything else (another program there, no
/// memory) is an error of the attach, as any other.
fn no_native_xdp(e: &ProgramError) -> bool {
    matches!(e, ProgramError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::EOPNOTSUPP))
}

/// The reason a listing gives for a device left to tc.
const NO_NATIVE_XDP: &str = "driver has no native XDP";

/// The reason a listing gives for every device when the kernel refused the program itself.
const KERNEL_REFUSED: &str = "kernel refused the XDP program";

/// The kernel's words for refusing the XDP program: the verifier's last line that is not
/// one of its statistics (`processed N insns ...`, `verification time`, `stack depth`, which
/// follow the refusal), else the error as a whole.
pub(super) fn refusal(e: &ProgramError) -> String {
    if let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = e
    {
        let log = verifier_log.to_string();
        let stats = ["processed ", "verification time", "stack depth"];
        if let Some(line) = log
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty() && !stats.iter().any(|s| l.starts_with(s)))
        {
            return format!("{line}; {io_error}");
        }
    }
    crate::error::error_chain(e)
}

/// Where the XDP link of device `ifname` in `mode` is pinned.
fn xdp_link_pin(dir: &Path, mode: &str, ifname: &str) -> PathBuf {
    dir.join(format!("link_xdp_{mode}_{ifname}"))
}

/// The XDP link pins in `dir`: (pin, mode, device).
pub fn xdp_pins(dir: &Path) -> Vec<(PathBuf, &'static str, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        for mode in MODES {
            if let Some(ifname) = file.strip_prefix(&format!("link_xdp_{mode}_")) {
                out.push((e.path(), mode, ifname.to_string()));
            }
        }
    }
    out.sort();
    out
}

impl Datapath {
    /// Attaches the XDP program to every external device (the `--xdp-mode` ones), or swaps it
    /// into the link a previous agent pinned there; detaches it from devices no longer chosen,
    /// and everywhere when XDP is off. Under `native`, a device whose driver refuses native
    /// XDP is left to tc.
    pub(super) fn attach_xdp(&mut self) -> Result<Vec<String>> {
        let mut done = Vec::new();
        let mut errors = Vec::new();
        let mut keep = BTreeSet::new();
        let wanted = self.xdp_wanted();
        // Before any link changes: only the devices whose link of this mode stays as it is
        // remain redirect targets (the programs attached now, a previous agent's included,
        // read the same pinned map). A device of the other mode is taken out: its link is
        // replaced below.
        let stays: BTreeSet<u32> = wanted
            .iter()
            .filter(|d| self.mode_link_holds(d))
            .map(|d| d.index)
            .collect();
        // A device the map may still name keeps its link: a redirect into a device without
        // the program is dropped by its driver.
        let trimmed = self.xdp_devs_retain(&stays);
        let trimmed = match trimmed {
            Ok(()) => true,
            Err(e) => {
                errors.push(e);
                false
            }
        };
        let mut linked = Vec::new();
        let mut tc = BTreeSet::new();
        for device in &wanted {
            match self.attach_xdp_one(device) {
                Ok((Some(pin), what)) => {
                    linked.push(device.clone());
                    keep.insert(pin);
                    done.extend(what);
                }
                Ok((None, what)) => {
                    tc.insert(device.name.clone());
                    done.extend(what);
                }
                Err(e) => {
                    // Its link is detached below: no redirect target any more.
                    if let Err(removing) = self.xdp_devs_remove(device.index) {
                        errors.push(removing);
                    }
                    errors.push(e);
                }
            }
        }
        // Before the targets go in: a previous agent's program of the other mode on a device
        // no longer chosen could redirect natively into a generic device, which may not take
        // the frames. These devices were taken out of the map above.
        for (pin, mode, ifname) in xdp_pins(&self.dir) {
            if keep.contains(&pin) || !trimmed {
                continue;
            }
            match detach_pinned(&pin) {
                Ok(()) => {
                    info!(device = %ifname, mode, "XDP detached");
                    done.push(format!("detached {XDP_PROGRAM} ({mode}) from {ifname}"));
                }
                Err(e) => errors.push(e),
            }
            self.xdp_current.remove(&pin);
        }
        for device in &linked {
            if let Err(e) = self.xdp_devs_insert(device) {
                errors.push(e);
            }
        }
        for (mark, ifname, _) in xdp_tc_marks(&self.dir) {
            if tc.contains(&ifname) {
                continue;
            }
            if let Err(e) = std::fs::remove_file(&mark) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    errors.push(super::io_err(&mark, e));
                }
            }
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// The devices that should carry the XDP program: the tc programs' own, unless XDP is off.
    pub(super) fn xdp_wanted(&self) -> Vec<Device> {
        if self.xdp_mode == XdpMode::Off || !self.xdp_loaded {
            Vec::new()
        } else {
            self.tc_devices.0.clone()
        }
    }

    /// Whether `device` has an XDP link of ours in the agent's mode, pinned and attached to
    /// it.
    fn mode_link_holds(&self, device: &Device) -> bool {
        let Some(word) = self.xdp_mode.word() else {
            return false;
        };
        super::repair::link_holds(
            &xdp_link_pin(&self.dir, word, &device.name),
            sys::tcx_link_info,
            |(ifindex, _)| ifindex == device.index,
        )
    }

    /// `SVC_XDP_DEVS` of the loaded object; None for an object without it.
    fn xdp_devs(&mut self) -> Result<Option<DevMapHash<&mut MapData>>> {
        let ebpf = super::load::ebpf(&mut self.programs)?;
        let Some(map) = ebpf.map_mut(map_names::XDP_DEVS) else {
            return Ok(None);
        };
        DevMapHash::try_from(map)
            .map(Some)
            .map_err(|e| load_err(map_names::XDP_DEVS, e))
    }

    /// Takes every device but those of `stays` out of `SVC_XDP_DEVS`.
    fn xdp_devs_retain(&mut self, stays: &BTreeSet<u32>) -> Result<()> {
        let Some(mut map) = self.xdp_devs()? else {
            return Ok(());
        };
        let keys: Vec<u32> = map
            .keys()
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| load_err(map_names::XDP_DEVS, e))?;
        for ifindex in keys {
            if stays.contains(&ifindex) {
                continue;
            }
            match map.remove(ifindex) {
                Ok(()) => info!(ifindex, "XDP: no longer a redirect target"),
                // Gone with its device meanwhile (the kernel removes it).
                Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(load_err(format!("{} [{ifindex}]", map_names::XDP_DEVS), e)),
            }
        }
        Ok(())
    }

    /// Makes `device`, whose link of the agent's mode holds, a redirect target. Under
    /// `generic` every such device is one: the generic hook's redirect goes through the skb
    /// path (`xdp_do_generic_redirect`), which any device takes. Under `native` only if its
    /// driver takes frames redirected from another device (`ndo-xmit` in its
    /// `xdp-features`), and no longer one if it lost that (a veth whose peer's XDP program
    /// went): the kernel would drop them. Warned about once per device while it lacks it.
    fn xdp_devs_insert(&mut self, device: &Device) -> Result<()> {
        let ifindex = device.index;
        let takes = match self.xdp_mode {
            XdpMode::Generic => true,
            XdpMode::Off => false,
            XdpMode::Native => match crate::netdev::xdp_features(ifindex) {
                Ok(f) => f & crate::netdev::XDP_ACT_NDO_XMIT != 0,
                Err(e) => {
                    if self.xdp_no_xmit.insert(ifindex) {
                        warn!(
                            device = %device.name,
                            "XDP: cannot read the device's xdp-features ({e}): not a redirect \
                             target, routes through it go on through tc"
                        );
                    }
                    false
                }
            },
        };
        if !takes {
            if self.xdp_mode == XdpMode::Native && self.xdp_no_xmit.insert(ifindex) {
                warn!(
                    device = %device.name,
                    "XDP: the device does not take redirected XDP frames (no ndo-xmit in its \
                     xdp-features; a veth needs an XDP program on its peer): routes through \
                     it go on through tc"
                );
            }
            return self.xdp_devs_remove(ifindex);
        }
        if self.xdp_no_xmit.remove(&ifindex) {
            info!(device = %device.name, "XDP: the device takes redirected XDP frames now");
        }
        let Some(mut map) = self.xdp_devs()? else {
            return Ok(());
        };
        if map.get(ifindex, 0).is_ok_and(|v| v.if_index == ifindex) {
            return Ok(());
        }
        map.insert(ifindex, ifindex, None, 0)
            .map_err(|e| load_err(format!("{} [{ifindex}]", map_names::XDP_DEVS), e))?;
        info!(device = %device.name, "XDP: a redirect target");
        Ok(())
    }

    /// The pin check's part: each device whose link of the agent's mode holds is a redirect
    /// target, under `native` as long as its driver takes redirected frames (a veth's peer
    /// may lose or gain its XDP program at any time).
    pub(super) fn xdp_devs_refresh(&mut self) -> Vec<crate::Error> {
        let mut errors = Vec::new();
        for device in self.xdp_wanted() {
            if self.mode_link_holds(&device) {
                if let Err(e) = self.xdp_devs_insert(&device) {
                    errors.push(e);
                }
            }
        }
        errors
    }

    /// Takes device `ifindex` out of `SVC_XDP_DEVS`: its link is gone or being replaced.
    pub(super) fn xdp_devs_remove(&mut self, ifindex: u32) -> Result<()> {
        let Some(mut map) = self.xdp_devs()? else {
            return Ok(());
        };
        match map.remove(ifindex) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(load_err(format!("{} [{ifindex}]", map_names::XDP_DEVS), e)),
        }
    }

    /// Whether this agent attached the XDP program to `device` (a link pinned under either
    /// mode's name, even if since removed): the devices the pin check puts a link back on. A
    /// device XDP never took (another program there, a driver refusing the generic hook) was
    /// the attach's warning, and a driver refusing native XDP its record: neither is retried
    /// at every check.
    pub(super) fn xdp_attached_here(&self, device: &Device) -> bool {
        MODES.iter().any(|m| {
            self.xdp_current
                .contains(&xdp_link_pin(&self.dir, m, &device.name))
        })
    }

    /// One device's XDP link: kept, swapped, or made in the agent's mode (a link of the other
    /// mode detached first: the kernel refuses both hooks on one device). Its pin, and what
    /// changed in words; no pin for a device whose driver refused native XDP under `native`
    /// (now or earlier in this agent's life: tried again at the next start, a new driver may
    /// have come), which tc serves.
    pub(super) fn attach_xdp_one(
        &mut self,
        device: &Device,
    ) -> Result<(Option<PathBuf>, Option<String>)> {
        let word = self.xdp_mode.word().unwrap_or("generic");
        // The kernel refused the program at start (`load_xdp`, warned there): a link an earlier
        // agent pinned here is not swapped but detached (`attach_xdp`: not kept).
        let prog = super::load::ebpf(&mut self.programs)?.program(XDP_PROGRAM);
        if prog.is_some_and(|p| p.fd().is_err()) {
            let new = self.mark_tc(device, KERNEL_REFUSED);
            return Ok((
                None,
                new.then(|| format!("{}: tc ({KERNEL_REFUSED})", device.name)),
            ));
        }
        for mode in MODES {
            let pin = xdp_link_pin(&self.dir, mode, &device.name);
            if !pin.exists() {
                continue;
            }
            let link = sys::obj_get(&pin).map_err(|e| load_err(pin.display(), e))?;
            // The xdp member of bpf_link_info's union starts with the ifindex, as tcx's does.
            let (ifindex, _) =
                sys::tcx_link_info(link.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            if ifindex != device.index || mode != word {
                detach_pinned(&pin)?;
                self.xdp_current.remove(&pin);
                info!(device = %device.name, mode, "XDP detached: not of this mode or device");
                continue;
            }
            if self.xdp_current.contains(&pin) {
                return Ok((Some(pin), None));
            }
            let prog = super::load::ebpf(&mut self.programs)?
                .program(XDP_PROGRAM)
                .ok_or_else(|| load_err(XDP_PROGRAM, "program missing from the object"))?;
            let fd = prog.fd().map_err(|e| load_err(XDP_PROGRAM, e))?;
            sys::link_update(link.as_fd(), fd.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            self.xdp_current.insert(pin.clone());
            info!(device = %device.name, mode, "XDP: replaced the program of the pinned link");
            return Ok((
                Some(pin),
                Some(format!("swapped {XDP_PROGRAM} ({mode}) on {}", device.name)),
            ));
        }
        if self.xdp_mode == XdpMode::Native && self.xdp_refused.contains(&device.index) {
            self.mark_tc(device, NO_NATIVE_XDP);
            return Ok((None, None));
        }
        let prog = super::load::ebpf(&mut self.programs)?
            .program_mut(XDP_PROGRAM)
            .ok_or_else(|| load_err(XDP_PROGRAM, "program missing from the object"))?;
        let prog = <&mut Xdp>::try_from(prog).map_err(|e| load_err(XDP_PROGRAM, e))?;
        let attached = if self.xdp_mode == XdpMode::Native {
            prog.attach(&device.name, AttachMode::Driver)
        } else {
            prog.attach(&device.name, AttachMode::Skb)
        };
        let id = match attached {
            Ok(id) => id,
            Err(e) if self.xdp_mode == XdpMode::Native && no_native_xdp(&e) => {
                warn!(
                    device = %device.name,
                    "native XDP refused ({}): no XDP program on the device, tc serves it; \
                     tried again at the agent's next start",
                    crate::error::error_chain(&e)
                );
                self.xdp_refused.insert(device.index);
                self.mark_tc(device, NO_NATIVE_XDP);
                return Ok((None, Some(format!("{}: tc ({NO_NATIVE_XDP})", device.name))));
            }
            Err(e) => return Err(load_err(format!("attaching XDP to {}", device.name), e)),
        };
        let link = prog.take_link(id).map_err(|e| load_err(XDP_PROGRAM, e))?;
        let link = FdLink::try_from(link).map_err(|e| load_err(XDP_PROGRAM, e))?;
        let pin = xdp_link_pin(&self.dir, word, &device.name);
        link.pin(&pin).map_err(|e| load_err(pin.display(), e))?;
        self.xdp_current.insert(pin.clone());
        info!(device = %device.name, mode = word, "XDP attached");
        Ok((
            Some(pin),
            Some(format!(
                "attached {XDP_PROGRAM} ({word}) to {}",
                device.name
            )),
        ))
    }

    /// Records that `device` runs tc alone, and `why`, for `list` and /metrics; a failure
    /// only costs the listing, so it is warned about. Whether the record is new.
    fn mark_tc(&self, device: &Device, why: &str) -> bool {
        let mark = xdp_tc_mark(&self.dir, &device.name);
        if std::fs::read_link(&mark).is_ok_and(|t| t.as_os_str() == why) {
            return false;
        }
        let _ = std::fs::remove_file(&mark);
        if let Err(e) = std::os::unix::fs::symlink(why, &mark) {
            warn!(device = %device.name, "recording {}: {e}", mark.display());
        }
        true
    }
}

/// Devices whose driver has no native XDP, found in this agent's life, by ifindex (a device
/// made again is tried again).
pub(super) type Refused = BTreeSet<u32>;

#[cfg(test)]
mod tests {
    use super::*;

    fn load_error(log: &str) -> ProgramError {
        ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
            verifier_log: aya_obj::VerifierLog::new(log.to_string()),
        }
    }

    #[test]
    fn a_refusal_names_the_verifiers_last_words_before_its_statistics() {
        // The end of 6.1's log for xdp_ext (the statistics follow the refusal).
        let e = load_error(
            "1234: (bf) r1 = r6\nBPF program is too large. Processed 1000001 insn\n\
             processed 1000001 insns (limit 1000000) max_states_per_insn 28 total_states 61000 \
             peak_states 5000 mark_read 300\n",
        );
        let got = refusal(&e);
        assert!(
            got.starts_with("BPF program is too large. Processed 1000001 insn; "),
            "{got}"
        );
        // No log at all (the kernel said nothing): the error itself.
        let got = refusal(&load_error(""));
        assert!(got.contains("BPF_PROG_LOAD"), "{got}");
    }
}
