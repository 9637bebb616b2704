//! A do-nothing XDP program (`XDP_PASS`) for the far end of a veth whose near end runs svc's
//! XDP program natively. A veth sends its `XDP_TX` and redirected frames into its peer's ring
//! but wakes the peer's NAPI only when the peer runs an XDP program of its own (veth.c,
//! `veth_xdp_flush`); without one the frames wait there until other traffic happens to wake
//! it. A NIC has no such peer. Raw bpf(2): two instructions need no object file or loader.

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};

use crate::NetNs;

/// The program attached through a bpf link that this guard holds: closing it detaches.
#[derive(Debug)]
pub struct XdpPass {
    _link: OwnedFd,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// bpf(2) with a zero-padded attribute block; the new descriptor.
fn bpf(cmd: libc::c_long, attr: &[u8; 128], what: &str) -> Result<OwnedFd> {
    // SAFETY: the kernel reads at most the size given from a buffer that outlives the call;
    // the pointers inside it (instructions, licence) point at locals of the caller that do too.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_ptr(), attr.len() as u32) };
    if fd < 0 {
        bail!("{what}: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn put(attr: &mut [u8; 128], off: usize, bytes: &[u8]) {
    attr[off..off + bytes.len()].copy_from_slice(bytes);
}

impl XdpPass {
    /// Attaches it to `ifname` in `ns`, in the driver's (native) mode.
    pub fn attach(ns: &NetNs, ifname: &str) -> Result<XdpPass> {
        let name = CString::new(ifname)?;
        ns.run_in(|| {
            // SAFETY: a NUL-terminated name.
            let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
            if ifindex == 0 {
                bail!("{ifname}: {}", std::io::Error::last_os_error());
            }
            // r0 = XDP_PASS (2); exit.
            let insns: [u8; 16] = [0xb7, 0, 0, 0, 2, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0];
            let license = c"GPL";
            let mut attr = [0u8; 128];
            put(&mut attr, 0, &BPF_PROG_TYPE_XDP.to_ne_bytes());
            put(&mut attr, 4, &2u32.to_ne_bytes());
            put(&mut attr, 8, &(insns.as_ptr() as u64).to_ne_bytes());
            put(&mut attr, 16, &(license.as_ptr() as u64).to_ne_bytes());
            let prog = bpf(BPF_PROG_LOAD, &attr, "loading an XDP_PASS program")?;
            let mut attr = [0u8; 128];
            let prog_fd = std::os::fd::AsRawFd::as_raw_fd(&prog) as u32;
            put(&mut attr, 0, &prog_fd.to_ne_bytes());
            put(&mut attr, 4, &ifindex.to_ne_bytes());
            put(&mut attr, 8, &BPF_XDP.to_ne_bytes());
            put(&mut attr, 12, &XDP_FLAGS_DRV_MODE.to_ne_bytes());
            let link = bpf(BPF_LINK_CREATE, &attr, "attaching it natively")
                .with_context(|| format!("XDP_PASS on {ifname}"))?;
            Ok(XdpPass { _link: link })
        })?
    }
}
