//! Putting maps back as loaded, through bpf(2) on any map whatever its key and value types.

use std::os::fd::{AsFd, AsRawFd};

use aya::maps::{MapFd, MapInfo, MapType};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

/// `union bpf_attr` as the element commands read it.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value_or_next_key: u64,
    flags: u64,
}

fn bpf(cmd: libc::c_long, attr: &mut ElemAttr) -> std::io::Result<()> {
    // SAFETY: `attr` is a valid bpf_attr prefix of the size given, its pointers point at
    // buffers of the map's key and value sizes (or are null where the command allows).
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut ElemAttr,
            std::mem::size_of::<ElemAttr>(),
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

enum Kind {
    /// Emptied: entries exist only where a test or a program put them.
    Hash,
    /// Each index set back to the value it had after loading (zeros, or .data's).
    Array { first: Vec<Vec<u8>> },
    /// Read-only for programs, or holding programs: left as it is.
    Kept,
}

pub struct KernelMap {
    fd: MapFd,
    name: String,
    key_size: usize,
    value_size: usize,
    kind: Kind,
}

impl KernelMap {
    /// The map with id `id`, and for an array its contents now.
    pub fn new(id: u32) -> KernelMap {
        let info = MapInfo::from_id(id).unwrap_or_else(|e| panic!("map id {id}: {e}"));
        let name = info.name_as_str().unwrap_or("?").to_string();
        let fd = info.fd().unwrap_or_else(|e| panic!("map {name}: {e}"));
        let map_type = info
            .map_type()
            .unwrap_or_else(|e| panic!("map {name}: {e}"));
        let per_cpu = matches!(map_type, MapType::PerCpuArray | MapType::PerCpuHash);
        let value_size = if per_cpu {
            let cpus = aya::util::nr_cpus().expect("possible CPUs");
            (info.value_size() as usize).div_ceil(8) * 8 * cpus
        } else {
            info.value_size() as usize
        };
        let mut m = KernelMap {
            fd,
            name,
            key_size: info.key_size() as usize,
            value_size,
            kind: Kind::Kept,
        };
        m.kind = match map_type {
            // Read-only for programs too (the kernel sets the flag on every devmap), but
            // written by the tests: emptied as a hash.
            MapType::DevMapHash => Kind::Hash,
            // Maps the programs cannot write (.rodata): nothing to put back, no update allowed.
            _ if info.map_flags() & svc_common::BPF_F_RDONLY_PROG != 0 => Kind::Kept,
            MapType::ProgramArray => Kind::Kept,
            // The monitor's ring: emptied by whoever reads it; the lease that makes the
            // programs write to it is an array, reset like the others.
            MapType::RingBuf => Kind::Kept,
            MapType::Hash
            | MapType::LruHash
            | MapType::PerCpuHash
            | MapType::LruPerCpuHash
            | MapType::LpmTrie => Kind::Hash,
            MapType::Array | MapType::PerCpuArray => Kind::Array {
                first: (0..info.max_entries()).map(|i| m.lookup(i)).collect(),
            },
            other => panic!(
                "map {}: the fixtures cannot reset a {other:?} between tests; teach \
                 `reset` how",
                m.name
            ),
        };
        m
    }

    fn attr(&self) -> ElemAttr {
        ElemAttr {
            map_fd: self.fd.as_fd().as_raw_fd() as u32,
            ..Default::default()
        }
    }

    fn lookup(&self, index: u32) -> Vec<u8> {
        let mut value = vec![0u8; self.value_size];
        let mut a = self.attr();
        a.key = &index as *const u32 as u64;
        a.value_or_next_key = value.as_mut_ptr() as u64;
        bpf(BPF_MAP_LOOKUP_ELEM, &mut a)
            .unwrap_or_else(|e| panic!("map {} [{index}]: {e}", self.name));
        value
    }

    pub fn reset(&self) {
        match &self.kind {
            Kind::Kept => {}
            Kind::Array { first } => {
                for (index, value) in (0u32..).zip(first) {
                    let mut a = self.attr();
                    a.key = &index as *const u32 as u64;
                    a.value_or_next_key = value.as_ptr() as u64;
                    bpf(BPF_MAP_UPDATE_ELEM, &mut a)
                        .unwrap_or_else(|e| panic!("map {} [{index}]: {e}", self.name));
                }
            }
            Kind::Hash => {
                // The first key, deleted, until there is none: no walk over keys that
                // deletions move.
                let mut key = vec![0u8; self.key_size];
                loop {
                    let mut a = self.attr();
                    a.value_or_next_key = key.as_mut_ptr() as u64;
                    match bpf(BPF_MAP_GET_NEXT_KEY, &mut a) {
                        Ok(()) => {}
                        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return,
                        Err(e) => panic!("map {}: first key: {e}", self.name),
                    }
                    let mut a = self.attr();
                    a.key = key.as_ptr() as u64;
                    bpf(BPF_MAP_DELETE_ELEM, &mut a)
                        .unwrap_or_else(|e| panic!("map {}: deleting: {e}", self.name));
                }
            }
        }
    }
}
