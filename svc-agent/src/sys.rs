//! The bpf(2) commands aya 0.14 does not expose: a pinned link's own descriptor (its
//! `PinnedLink::from_pin` opens one but keeps the fd to itself) and replacing a link's program
//! in place, which is how a restarted agent swaps programs without
//! a moment in which the cgroup has none; and a test run on a bare program descriptor (aya's
//! needs the `Ebpf` object, which the sync owns, where the connection-tracking sweep runs on a
//! thread of its own).

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    os::unix::ffi::OsStrExt,
    path::Path,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_PROG_TEST_RUN: libc::c_long = 10;

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

/// Runs `prog` once on `data` (BPF_PROG_TEST_RUN): its return value, and how long the
/// program ran (the kernel's measure, ns).
pub fn prog_test_run(prog: BorrowedFd<'_>, data: &[u8]) -> io::Result<(u32, u32)> {
    let mut attr = Attr::zeroed();
    // struct { __u32 prog_fd; __u32 retval; __u32 data_size_in; __u32 data_size_out;
    //          __aligned_u64 data_in; __aligned_u64 data_out; __u32 repeat;
    //          __u32 duration; ... }
    attr.put_u32(0, prog.as_raw_fd() as u32);
    attr.put_u32(8, data.len() as u32);
    attr.put_u64(16, data.as_ptr() as u64);
    attr.put_u32(32, 1);
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    let at = |o: usize| u32::from_ne_bytes(attr.0[o..o + 4].try_into().expect("4 bytes"));
    Ok((at(4), at(36)))
}

/// Points an existing link at a new program, atomically.
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = Attr::zeroed();
    // struct { __u32 link_fd; __u32 new_prog_fd; __u32 flags; __u32 old_prog_fd; }
    attr.put_u32(0, link.as_raw_fd() as u32);
    attr.put_u32(4, prog.as_raw_fd() as u32);
    bpf(BPF_LINK_UPDATE, &mut attr).map(|_| ())
}

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_LINK_CREATE: libc::c_long = 28;

/// Attaches `prog` to the cgroup `target` at `attach_type` through a new bpf link
/// (BPF_LINK_CREATE, no flags: what aya's cgroup attach makes), for a program whose aya object
/// is held by another thread (the one verifying the tc programs).
pub fn link_create(
    prog: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::zeroed();
    // struct { __u32 prog_fd; __u32 target_fd; __u32 attach_type; __u32 flags; ... }
    attr.put_u32(0, prog.as_raw_fd() as u32);
    attr.put_u32(4, target.as_raw_fd() as u32);
    attr.put_u32(8, attach_type);
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Pins a BPF object (here: a link) at `path`.
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = Attr::zeroed();
    // struct { __aligned_u64 pathname; __u32 bpf_fd; __u32 file_flags; }
    attr.put_u64(0, c.as_ptr() as u64);
    attr.put_u32(8, fd.as_raw_fd() as u32);
    bpf(BPF_OBJ_PIN, &mut attr).map(|_| ())
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
    // Without a mode the root of a fresh bpffs is world-writable and sticky: anyone could then
    // create the agent's directory first. 0700 and no suid, devices or exec, as systemd mounts
    // it (and deploy/daemonset.yaml's init container): only root needs to look inside.
    let (src, target, fstype, data) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"), c("mode=0700"));
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

/// A link's `struct bpf_link_info`, as 8-byte words: `{ u32 type; u32 id; u32 prog_id; u32
/// pad; union { ... } }`, so word 1's low half is the program's id and the type-specific union
/// starts at word 2.
fn link_info_words(link: BorrowedFd<'_>) -> io::Result<[u64; 32]> {
    let mut info = [0u64; 32];
    let mut attr = Attr::zeroed();
    // struct { __u32 bpf_fd; __u32 info_len; __aligned_u64 info; }
    attr.put_u32(0, link.as_raw_fd() as u32);
    attr.put_u32(4, std::mem::size_of_val(&info) as u32);
    attr.put_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

/// The low 32 bits of a word of `link_info_words`.
fn low(word: u64) -> u32 {
    (word & 0xffff_ffff) as u32
}

/// The program a link runs and the cgroup it attaches to (0 once detached or the cgroup is
/// gone).
pub fn link_info(link: BorrowedFd<'_>) -> io::Result<(u32, u64)> {
    let info = link_info_words(link)?;
    // The cgroup union: { u64 cgroup_id; u32 attach_type; }.
    Ok((low(info[1]), info[2]))
}

/// The device a tcx link attaches to (0 once the device is gone) and the program it runs.
pub fn tcx_link_info(link: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    let info = link_info_words(link)?;
    // The tcx union: { u32 ifindex; u32 attach_type; }.
    Ok((low(info[2]), low(info[1])))
}

/// The cgroup a cgroup link attaches to (0 once the cgroup is gone).
pub fn link_cgroup_id(link: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(link_info(link)?.1)
}

/// The cgroup attach points svc uses (enum bpf_attach_type), each with the program of
/// svc-ebpf/src/main.rs attached there: the sock_addr hooks, then sock_release
/// (BPF_CGROUP_INET_SOCK_RELEASE, a BPF_PROG_TYPE_CGROUP_SOCK program).
pub const ATTACH_POINTS: [(u32, &str); 9] = [
    (10, "connect4"),
    (11, "connect6"),
    (14, "sendmsg4"),
    (15, "sendmsg6"),
    (19, "recvmsg4"),
    (20, "recvmsg6"),
    (29, "getpeername4"),
    (30, "getpeername6"),
    (34, SOCK_RELEASE),
];

/// The one program of ATTACH_POINTS that is not a sock_addr program.
pub const SOCK_RELEASE: &str = "sock_release";

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

/// Whether the kernel has tcx (6.6): BPF_PROG_QUERY at BPF_TCX_INGRESS on the loopback
/// device (ifindex 1, in every network namespace) answers on a kernel that knows the attach
/// type and fails with EINVAL on one that does not. Read only: nothing is attached.
pub fn has_tcx() -> io::Result<bool> {
    const BPF_TCX_INGRESS: u32 = 46;
    let mut attr = Attr::zeroed();
    // The query's first field is the target: an ifindex for tcx.
    attr.put_u32(0, 1);
    attr.put_u32(4, BPF_TCX_INGRESS);
    match bpf(BPF_PROG_QUERY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The datapath's clock (bpf_ktime_get_coarse_ns), which stamps the flows.
pub fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The cookie of this thread's network namespace (SO_NETNS_COOKIE, what
/// bpf_get_netns_cookie gives the programs for a socket there).
pub fn netns_cookie() -> io::Result<u64> {
    // SAFETY: a new socket, owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a socket this function just opened.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: cookie and len describe a valid u64 buffer.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Every entry of a hash map, read in batches (BPF_MAP_LOOKUP_BATCH): a few syscalls per
/// thousand entries instead of two per entry, which is what makes reading 100,000 Services'
/// maps back (recovery, drift checks) take milliseconds rather than seconds.
pub fn dump_hash<K: bytemuck::Pod, V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for_each_hash(map, |k: &K, v: &V| out.push((*k, *v)))?;
    Ok(out)
}

/// Calls `f` on every entry of a hash map, read in batches as [`dump_hash`] does, in memory of
/// one batch: a walk of a full connection-tracking map does not hold the map.
pub fn for_each_hash<K: bytemuck::Pod, V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    mut f: impl FnMut(&K, &V),
) -> io::Result<()> {
    let mut chunk: u32 = 4096;
    let mut keys: Vec<K> = Vec::new();
    let mut values: Vec<V> = Vec::new();
    // The kernel's cursor for hash maps is a bucket index (u32).
    let mut in_batch: u32 = 0;
    let mut out_batch: u32 = 0;
    let mut first = true;
    loop {
        keys.resize(chunk as usize, K::zeroed());
        values.resize(chunk as usize, V::zeroed());
        let mut attr = Attr::zeroed();
        // struct { __aligned_u64 in_batch, out_batch, keys, values; __u32 count, map_fd;
        //          __u64 elem_flags, flags; } batch;
        if !first {
            attr.put_u64(0, &mut in_batch as *mut u32 as u64);
        }
        attr.put_u64(8, &mut out_batch as *mut u32 as u64);
        attr.put_u64(16, keys.as_mut_ptr() as u64);
        attr.put_u64(24, values.as_mut_ptr() as u64);
        attr.put_u32(32, chunk);
        attr.put_u32(36, map.as_raw_fd() as u32);
        let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let count = u32::from_ne_bytes(attr.0[32..36].try_into().expect("4 bytes")) as usize;
        let last = match r {
            Ok(_) => false,
            // The last batch: what it holds is valid.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            // One bucket holds more entries than the buffer: retry it with a larger one.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && chunk < (1 << 20) => {
                chunk *= 4;
                continue;
            }
            Err(e) => return Err(e),
        };
        for (k, v) in keys.iter().zip(&values).take(count) {
            f(k, v);
        }
        if last {
            return Ok(());
        }
        in_batch = out_batch;
        first = false;
    }
}

/// Calls `f` on every index and value of the array `map` of `entries` values `V`, created
/// with `BPF_F_MMAPABLE`, through a read-only mapping of its values: no syscall per element
/// (a batched read of a million 24-byte entries took 0.3 to 1 s). Values the kernel or the
/// agent write meanwhile may be seen half written, as by any lookup racing an update.
pub fn for_each_mapped<V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    entries: u32,
    mut f: impl FnMut(u32, &V),
) -> io::Result<()> {
    // An array's values are `value_size` rounded up to 8 bytes apart: `V` must be that long.
    assert!(
        size_of::<V>().is_multiple_of(8),
        "a mapped array's values are 8-byte aligned"
    );
    let len = entries as usize * size_of::<V>();
    if len == 0 {
        return Ok(());
    }
    // SAFETY: a shared read-only mapping of `len` bytes of the map's values, which the kernel
    // keeps while mapped; unmapped below on every path.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            map.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    for i in 0..entries as usize {
        // SAFETY: within the mapping; `V` is Pod, and an unaligned read copies it out.
        let v: V = unsafe { std::ptr::read_unaligned((ptr as *const V).add(i)) };
        f(i as u32, &v);
    }
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(ptr, len) };
    Ok(())
}

const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

/// Calls `f` on every key of a hash map, one BPF_MAP_GET_NEXT_KEY a key: no values copied.
/// A key deleted
/// under the walk restarts it from the first (the kernel's answer to a key it lacks), so a
/// key may come more than once; the walk gives up (EAGAIN) after `limit` keys.
pub fn for_each_key<K: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    limit: usize,
    mut f: impl FnMut(&K),
) -> io::Result<()> {
    let mut key = K::zeroed();
    let mut next = K::zeroed();
    for n in 0.. {
        if n > limit {
            return Err(io::Error::from_raw_os_error(libc::EAGAIN));
        }
        let mut attr = Attr::zeroed();
        // struct { __u32 map_fd; __aligned_u64 key; __aligned_u64 next_key; }
        attr.put_u32(0, map.as_raw_fd() as u32);
        if n > 0 {
            attr.put_u64(8, &mut key as *mut K as u64);
        }
        attr.put_u64(16, &mut next as *mut K as u64);
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Err(e) => return Err(e),
        }
        f(&next);
        key = next;
    }
    Ok(())
}

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Writes `values` into an array map from index `start` on in one syscall
/// (BPF_MAP_UPDATE_BATCH): a Maglev table of 1,021 entries is 256 elements, which one update
/// each would make 256 syscalls. The kernel may stop early (an index beyond the array): the
/// error is returned, with what it wrote before left written.
pub fn update_array<V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    start: u32,
    values: &[V],
) -> io::Result<()> {
    let keys: Vec<u32> = (0..values.len() as u32).map(|i| start + i).collect();
    update_batch(map, &keys, values, 0).1
}

/// Writes `keys[i]` -> `values[i]` into a map, in order, in one syscall
/// (BPF_MAP_UPDATE_BATCH; aya 0.14 has no call for it), with `flags` for every element. The
/// kernel writes element by element and stops at the first that fails: the count returned
/// is how many (the first ones) landed, the error the failing element's. A kernel or map type
/// without batch updates fails before the first element (EINVAL, ENOTSUPP).
pub fn update_batch<K: bytemuck::Pod, V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    flags: u64,
) -> (usize, io::Result<()>) {
    assert_eq!(keys.len(), values.len(), "one value per key");
    if keys.is_empty() {
        return (0, Ok(()));
    }
    let mut attr = Attr::zeroed();
    // struct { __aligned_u64 in_batch, out_batch, keys, values; __u32 count, map_fd;
    //          __u64 elem_flags, flags; } batch;
    attr.put_u64(16, keys.as_ptr() as u64);
    attr.put_u64(24, values.as_ptr() as u64);
    attr.put_u32(32, keys.len() as u32);
    attr.put_u32(36, map.as_raw_fd() as u32);
    attr.put_u64(40, flags);
    let r = bpf(BPF_MAP_UPDATE_BATCH, &mut attr);
    match r {
        Ok(_) => (keys.len(), Ok(())),
        Err(e) => {
            // On an element's failure the kernel writes back how many came before it, always
            // fewer than passed; a call refused before the first element leaves the count as
            // passed: then none landed.
            let count = u32::from_ne_bytes(attr.0[32..36].try_into().expect("4 bytes")) as usize;
            (if count < keys.len() { count } else { 0 }, Err(e))
        }
    }
}

/// The kernel's internal "operation not supported" (not in libc): what a map type without
/// a batch operation answers.
pub const ENOTSUPP: i32 = 524;

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The filesystem type (statfs f_type) `path` lies on.
pub fn fs_magic(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs is plain data, filled by the kernel.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// Whether `path` lies on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> io::Result<bool> {
    Ok(fs_magic(path)? == BPF_FS_MAGIC)
}

/// Mounts a bpf filesystem at `path` (created if missing) as systemd does, mode 0700,
/// nosuid, nodev, noexec: a bare `mount -t bpf` gives mode 1777, where any user of the node
/// could create the agent's directory first. `false` when one is there already.
pub fn mount_bpffs(path: &Path) -> io::Result<bool> {
    std::fs::create_dir_all(path)?;
    if is_bpffs(path)? {
        return Ok(false);
    }
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: valid C strings; the data is the filesystem's option string.
    let rc = unsafe {
        libc::mount(
            c"bpf".as_ptr(),
            target.as_ptr(),
            c"bpf".as_ptr(),
            flags,
            c"mode=0700".as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// Takes an exclusive advisory lock on `fd` without waiting; `false` when another open file
/// holds it. The kernel drops the lock when the holder's last descriptor closes, so a crashed
/// agent never leaves its directory locked.
pub fn try_lock(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: flock on a descriptor we borrow.
    if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// The processes holding a flock on the file (device, inode), from /proc/locks.
pub fn flock_holders(dev: u64, ino: u64) -> Vec<u32> {
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    // "1: FLOCK  ADVISORY  WRITE 13817 00:27:17106 0 EOF": the device as hex major:minor.
    let want = format!(
        "{:02x}:{:02x}:{ino}",
        libc::major(dev as libc::dev_t),
        libc::minor(dev as libc::dev_t)
    );
    locks
        .lines()
        .filter(|l| l.contains("FLOCK"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let at = f.iter().position(|w| *w == want)?;
            f.get(at.checked_sub(1)?)?.parse().ok()
        })
        .collect()
}

/// The command line of a process, for naming it in messages.
pub fn process_name(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

const BPF_LINK_DETACH: libc::c_long = 34;

/// Detaches a link from its hook whoever else holds it (the link object lives on, defunct).
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = Attr::zeroed();
    // struct { __u32 link_fd; } link_detach;
    attr.put_u32(0, link.as_raw_fd() as u32);
    bpf(BPF_LINK_DETACH, &mut attr).map(|_| ())
}

/// The ids of the programs attached to `cgroup` at `attach_type` (directly, not inherited).
pub fn attached_program_ids(cgroup: BorrowedFd<'_>, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut attr = Attr::zeroed();
    // struct { __u32 target_fd; __u32 attach_type; __u32 query_flags; __u32 attach_flags;
    //          __aligned_u64 prog_ids; __u32 prog_cnt; }
    attr.put_u32(0, cgroup.as_raw_fd() as u32);
    attr.put_u32(4, attach_type);
    attr.put_u64(16, ids.as_mut_ptr() as u64);
    attr.put_u32(24, ids.len() as u32);
    bpf(BPF_PROG_QUERY, &mut attr)?;
    let cnt = u32::from_ne_bytes(attr.0[24..28].try_into().expect("4 bytes")) as usize;
    Ok(ids[..cnt.min(ids.len())].to_vec())
}

/// The same B-tree (map or set) with full nodes, built in one go from its sorted entries; a
/// tree filled entry by entry keeps its nodes half to two thirds full.
pub fn packed<T: IntoIterator + FromIterator<T::Item>>(tree: T) -> T {
    tree.into_iter().collect()
}

/// Returns freed heap pages to the system (glibc keeps them otherwise, and the agent's RSS
/// would stay at its highest point forever).
pub fn release_free_memory() {
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

const BPF_MAP_CREATE: libc::c_long = 0;

/// `enum bpf_map_type` values of the maps the agent may create itself.
pub mod map_type {
    pub const HASH: u32 = 1;
    pub const ARRAY: u32 = 2;
    pub const LPM_TRIE: u32 = 11;
}

/// Creates a map (BPF_MAP_CREATE) named `name` (the kernel keeps 15 bytes of it): for maps
/// the agent writes that the loaded object does not declare yet.
pub fn map_create(
    kind: u32,
    key: u32,
    value: u32,
    max_entries: u32,
    flags: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::zeroed();
    // struct { __u32 map_type, key_size, value_size, max_entries, map_flags, inner_map_fd,
    //          numa_node; char map_name[16]; ... }
    attr.put_u32(0, kind);
    attr.put_u32(4, key);
    attr.put_u32(8, value);
    attr.put_u32(12, max_entries);
    attr.put_u32(16, flags);
    let bytes = name.as_bytes();
    let n = bytes.len().min(15);
    attr.0[28..28 + n].copy_from_slice(&bytes[..n]);
    let fd = bpf(BPF_MAP_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
const BPF_LINK_GET_NEXT_ID: libc::c_long = 31;

/// The name of program `id` (as the kernel keeps it: at most 15 bytes).
pub fn prog_name(id: u32) -> io::Result<String> {
    let mut attr = Attr::zeroed();
    // struct { __u32 prog_id; ... }
    attr.put_u32(0, id);
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that we now own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut info = [0u8; 256];
    let mut attr = Attr::zeroed();
    attr.put_u32(0, fd.as_raw_fd() as u32);
    attr.put_u32(4, info.len() as u32);
    attr.put_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    // struct bpf_prog_info { u32 type; u32 id; u8 tag[8]; u32 jited_prog_len;
    // u32 xlated_prog_len; u64 jited_prog_insns; u64 xlated_prog_insns; u64 load_time;
    // u32 created_by_uid; u32 nr_map_ids; u64 map_ids; char name[16]; ... }
    let name = &info[64..80];
    let end = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// The bpf links that run program `prog_id` on cgroup `cgroup_id`, by id (every link of the
/// system is looked at; those that vanish meanwhile are skipped).
pub fn cgroup_links_of(prog_id: u32, cgroup_id: u64) -> Vec<u32> {
    let mut out = Vec::new();
    let mut id = 0u32;
    loop {
        let mut attr = Attr::zeroed();
        // struct { __u32 start_id; __u32 next_id; ... }
        attr.put_u32(0, id);
        if bpf(BPF_LINK_GET_NEXT_ID, &mut attr).is_err() {
            break;
        }
        id = u32::from_ne_bytes(attr.0[4..8].try_into().expect("4 bytes"));
        let mut attr = Attr::zeroed();
        attr.put_u32(0, id);
        let Ok(fd) = bpf(BPF_LINK_GET_FD_BY_ID, &mut attr) else {
            continue;
        };
        // SAFETY: the kernel returned a new file descriptor that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        use std::os::fd::AsFd;
        if let Ok((prog, cg)) = link_info(fd.as_fd()) {
            if prog == prog_id && cg == cgroup_id {
                out.push(id);
            }
        }
    }
    out
}

/// The processes holding a descriptor of program `prog_id` (from /proc/PID/fdinfo), each
/// with a bpffs directory it holds open (an agent's locked `--bpffs`), if any.
pub fn prog_holders(prog_id: u32) -> Vec<(u32, Option<std::path::PathBuf>)> {
    let want = format!("prog_id:\t{prog_id}");
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fdinfo")) else {
            continue;
        };
        let holds = fds.flatten().any(|f| {
            std::fs::read_to_string(f.path()).is_ok_and(|t| t.lines().any(|l| l.trim_end() == want))
        });
        if !holds {
            continue;
        }
        let dir = std::fs::read_dir(p.path().join("fd")).ok().and_then(|fds| {
            fds.flatten()
                .filter_map(|f| std::fs::read_link(f.path()).ok())
                .find(|t| t.is_dir() && is_bpffs(t).unwrap_or(false))
        });
        out.push((pid, dir));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    const BPF_MAP_TYPE_HASH: u32 = 1;
    const BPF_F_NO_PREALLOC: u32 = 1;

    fn entries(map: BorrowedFd<'_>) -> Vec<(u32, u32)> {
        let mut e: Vec<(u32, u32)> = dump_hash(map).unwrap();
        e.sort_unstable();
        e
    }

    /// A batch that overflows the map stops at the first element that does not fit: exactly
    /// the ones before it are written, and the count says so.
    #[test]
    fn a_batch_stops_at_the_first_element_that_fails_and_says_how_many_landed() {
        let map = map_create(BPF_MAP_TYPE_HASH, 4, 4, 4, BPF_F_NO_PREALLOC, "test_batch").unwrap();
        let keys: Vec<u32> = (1..=6).collect();
        let values: Vec<u32> = keys.iter().map(|k| k * 10).collect();
        let (landed, r) = update_batch(map.as_fd(), &keys, &values, 0);
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::E2BIG));
        assert_eq!(landed, 4);
        assert_eq!(
            entries(map.as_fd()),
            vec![(1, 10), (2, 20), (3, 30), (4, 40)]
        );

        // Replacing what is there fits, and all of it lands.
        let values: Vec<u32> = keys[..4].iter().map(|k| k * 100).collect();
        let (landed, r) = update_batch(map.as_fd(), &keys[..4], &values, 0);
        r.unwrap();
        assert_eq!(landed, 4);
        assert_eq!(entries(map.as_fd())[3], (4, 400));

        // An element refused in the middle: the ones before it land, the ones after it are
        // not tried.
        let (landed, r) = update_batch(map.as_fd(), &[1u32, 2, 5, 3], &[7u32, 7, 7, 7], 0);
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::E2BIG));
        assert_eq!(landed, 2);
        assert_eq!(
            entries(map.as_fd()),
            vec![(1, 7), (2, 7), (3, 300), (4, 400)]
        );
    }

    /// A call the kernel refuses before the first element (here: element flags a batch may
    /// not carry, as a kernel without batch updates refuses them all) lands nothing, though
    /// the count it leaves is the one passed.
    #[test]
    fn a_batch_refused_before_the_first_element_lands_nothing() {
        let map = map_create(BPF_MAP_TYPE_HASH, 4, 4, 16, BPF_F_NO_PREALLOC, "test_batch").unwrap();
        let (landed, r) = update_batch(map.as_fd(), &[1u32, 2], &[1u32, 2], 1 << 10);
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EINVAL));
        assert_eq!(landed, 0);
        assert!(entries(map.as_fd()).is_empty());
    }
}
