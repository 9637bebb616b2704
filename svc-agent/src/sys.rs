//! The two bpf(2) commands aya 0.14 does not expose: opening a pinned link by path and
//! replacing a link's program in place, which is how a restarted agent swaps programs without
//! a moment in which the cgroup has none.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    os::unix::ffi::OsStrExt,
    path::Path,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_UPDATE: libc::c_long = 29;

/// `union bpf_attr` is larger, but the kernel only reads the leading fields of each command
/// and requires the rest to be zero.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn zeroed() -> Self {
        Attr([0; 128])
    }
    fn put_u32(&mut self, offset: usize, v: u32) {
        self.0[offset..offset + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put_u64(&mut self, offset: usize, v: u64) {
        self.0[offset..offset + 8].copy_from_slice(&v.to_ne_bytes());
    }
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: attr is a valid, zero-padded bpf_attr of the size we pass.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut Attr,
            std::mem::size_of::<Attr>() as u32,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Opens a pinned BPF object (here: a link).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = Attr::zeroed();
    // struct { __aligned_u64 pathname; __u32 bpf_fd; __u32 file_flags; }
    attr.put_u64(0, c.as_ptr() as u64);
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Points an existing link at a new program, atomically.
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = Attr::zeroed();
    // struct { __u32 link_fd; __u32 new_prog_fd; __u32 flags; __u32 old_prog_fd; }
    attr.put_u32(0, link.as_raw_fd() as u32);
    attr.put_u32(4, prog.as_raw_fd() as u32);
    bpf(BPF_LINK_UPDATE, &mut attr).map(|_| ())
}

/// Mounts bpffs at `/sys/fs/bpf` when nothing is mounted there (it is not at boot on some hosts).
pub fn ensure_bpffs(dir: &Path) -> io::Result<()> {
    let root = Path::new("/sys/fs/bpf");
    if !dir.starts_with(root) {
        return Ok(());
    }
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    let mounted = mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        let _src = f.next();
        f.next() == Some("/sys/fs/bpf") && f.next() == Some("bpf")
    });
    if mounted {
        return Ok(());
    }
    let c = |s: &str| CString::new(s).expect("no NUL in literal");
    let (src, target, fstype) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
    // As systemd mounts it: without `mode`, bpffs is 1777 and any user could create our pin
    // directory first.
    let data = c("mode=0700");
    // SAFETY: valid C strings; bpffs takes its options as a C string.
    let ret = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            data.as_ptr().cast(),
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;

/// The cgroup a cgroup link attaches to (0 once the cgroup is gone).
pub fn link_cgroup_id(link: BorrowedFd<'_>) -> io::Result<u64> {
    // struct bpf_link_info { u32 type; u32 id; u32 prog_id; union { struct { u64 cgroup_id;
    // u32 attach_type; } cgroup; ... } } — the union starts at offset 16.
    let mut info = [0u64; 32];
    let mut attr = Attr::zeroed();
    // struct { __u32 bpf_fd; __u32 info_len; __aligned_u64 info; }
    attr.put_u32(0, link.as_raw_fd() as u32);
    attr.put_u32(4, std::mem::size_of_val(&info) as u32);
    attr.put_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info[2])
}

/// The cgroup sock_addr attach points svc uses (enum bpf_attach_type).
pub const SOCK_ADDR_ATTACH_TYPES: [(u32, &str); 8] = [
    (10, "connect4"),
    (11, "connect6"),
    (14, "sendmsg4"),
    (15, "sendmsg6"),
    (19, "recvmsg4"),
    (20, "recvmsg6"),
    (29, "getpeername4"),
    (30, "getpeername6"),
];

/// How many programs are attached to `cgroup` at `attach_type` (directly, not inherited).
pub fn attached_programs(cgroup: BorrowedFd<'_>, attach_type: u32) -> io::Result<u32> {
    let mut attr = Attr::zeroed();
    // struct { __u32 target_fd; __u32 attach_type; __u32 query_flags; __u32 attach_flags;
    //          __aligned_u64 prog_ids; __u32 prog_cnt; }
    attr.put_u32(0, cgroup.as_raw_fd() as u32);
    attr.put_u32(4, attach_type);
    bpf(BPF_PROG_QUERY, &mut attr)?;
    let cnt = u32::from_ne_bytes(attr.0[24..28].try_into().expect("4 bytes"));
    Ok(cnt)
}
