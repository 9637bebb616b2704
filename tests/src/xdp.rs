//! Small XDP programs loaded with raw bpf(2), for the tests and the benches: a few
//! instructions need no object file or loader.
//!
//! The one the packet tests need is a do-nothing program (`XDP_PASS`) for the far end of a
//! veth whose near end runs svc's XDP program natively. A veth sends its `XDP_TX` and
//! redirected frames into its peer's ring but wakes the peer's NAPI only when the peer runs an
//! XDP program of its own (veth.c, `veth_xdp_flush`); without one the frames wait there until
//! other traffic happens to wake it. A NIC has no such peer.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};

use crate::NetNs;

/// `XDP_PASS` attached through a bpf link that this guard holds: closing it detaches.
#[derive(Debug)]
pub struct XdpPass {
    _link: OwnedFd,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// bpf(2) with a zero-padded attribute block; its return value.
pub fn bpf(cmd: libc::c_long, attr: &mut [u8; 128], what: &str) -> Result<i64> {
    // SAFETY: the kernel reads and writes at most the size given of a buffer that outlives
    // the call; the pointers inside it point at locals of the caller that do too.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len() as u32) };
    if r < 0 {
        bail!("{what}: {}", std::io::Error::last_os_error());
    }
    Ok(r)
}

/// Writes `bytes` into a bpf(2) attribute block at `off`.
pub fn put(attr: &mut [u8; 128], off: usize, bytes: &[u8]) {
    attr[off..off + bytes.len()].copy_from_slice(bytes);
}

/// One eBPF instruction.
pub fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let [o0, o1] = off.to_le_bytes();
    let [i0, i1, i2, i3] = imm.to_le_bytes();
    [code, dst | src << 4, o0, o1, i0, i1, i2, i3]
}

/// Loads an XDP program of `insns` (8-byte instructions).
pub fn load(insns: &[u8]) -> Result<OwnedFd> {
    let license = c"GPL";
    let mut attr = [0u8; 128];
    put(&mut attr, 0, &BPF_PROG_TYPE_XDP.to_ne_bytes());
    put(&mut attr, 4, &((insns.len() / 8) as u32).to_ne_bytes());
    put(&mut attr, 8, &(insns.as_ptr() as u64).to_ne_bytes());
    put(&mut attr, 16, &(license.as_ptr() as u64).to_ne_bytes());
    let fd = bpf(BPF_PROG_LOAD, &mut attr, "BPF_PROG_LOAD")?;
    // SAFETY: the kernel just returned this descriptor to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `r0 = action; exit`.
pub fn returning(action: u8) -> Result<OwnedFd> {
    load(&[insn(0xb7, 0, 0, 0, action.into()), insn(0x95, 0, 0, 0, 0)].concat())
}

/// Attaches `prog` natively to `ifindex` (of the calling thread's namespace) through a bpf
/// link; the link's descriptor (closing it detaches).
pub fn attach_native(prog: &OwnedFd, ifindex: u32) -> Result<OwnedFd> {
    let mut attr = [0u8; 128];
    put(&mut attr, 0, &(prog.as_raw_fd() as u32).to_ne_bytes());
    put(&mut attr, 4, &ifindex.to_ne_bytes());
    put(&mut attr, 8, &BPF_XDP.to_ne_bytes());
    put(&mut attr, 12, &XDP_FLAGS_DRV_MODE.to_ne_bytes());
    let fd = bpf(BPF_LINK_CREATE, &mut attr, "BPF_LINK_CREATE")?;
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The index of device `name` in the calling thread's namespace.
pub fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name)?;
    // SAFETY: a NUL-terminated name.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => bail!("{name}: {}", std::io::Error::last_os_error()),
        i => Ok(i),
    }
}

impl XdpPass {
    /// Attaches it to `ifname` in `ns`, in the driver's (native) mode.
    pub fn attach(ns: &NetNs, ifname: &str) -> Result<XdpPass> {
        ns.run_in(|| {
            let prog = returning(2)?;
            let link = attach_native(&prog, ifindex(ifname)?)
                .with_context(|| format!("XDP_PASS on {ifname}"))?;
            Ok(XdpPass { _link: link })
        })?
    }
}

/// Transmit checksum offload off on `dev` in `ns` (`ethtool -K DEV tx off`, Debian's
/// `ethtool`): a local socket's packets through it then carry their whole checksum, as a wire's
/// do, which XDP's incremental update needs (docs/design/xdp.md, "Known problems").
pub fn tx_checksum_off(ns: &NetNs, dev: &str) -> Result<()> {
    crate::sys::run(
        "ip",
        [
            "netns",
            "exec",
            ns.name(),
            "ethtool",
            "-K",
            dev,
            "tx",
            "off",
        ],
    )
    .with_context(|| format!("transmit checksum offload off on {dev} in {}", ns.name()))?;
    Ok(())
}
