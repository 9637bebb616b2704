//! Loading, attaching, adopting, guarding and removing the kernel programs and their pinned
//! maps.
//!
//! Layout under the bpffs directory (default /sys/fs/bpf/svc), which the agent creates itself
//! (0700, owned by the agent's user) and refuses when anyone else could write to it:
//! - one pinned map per name in `svc_common::map_names`, as `NAME_v<layout>`;
//! - `link_<program>`: one pinned bpf link per cgroup hook.
//!
//! One agent owns a directory at a time: it holds an exclusive flock on it for as long as it
//! runs (the kernel drops it when the process dies, however it dies). A second agent, or an
//! `uninstall`, refuses while the owner lives.
//!
//! Links are pinned so the datapath outlives the agent: a stopped agent leaves connections
//! working, and a new one swaps its programs into the existing links (BPF_LINK_UPDATE), so a
//! cgroup is never without its hooks. A new agent attaches only after its first sync, so the
//! programs it swaps in never see maps that are still being filled.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, IterableMap, LpmTrie, Map, MapData, MapType, PerCpuArray};
use aya::programs::{
    links::FdLink, tc::TcAttachOptions, CgroupAttachMode, CgroupSock, CgroupSockAddr, LinkOrder,
    SchedClassifier, TcAttachType,
};
use aya::{Ebpf, EbpfLoader};
use svc_common::{layout, map_names, stat};
use tracing::{info, warn};

use crate::error::{Error, Result};
use crate::netdev::Device;
use crate::store::{BpfStore, Capacity};
use crate::sys;

pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/svc";

/// The kernel object, built by `cargo xtask build-ebpf`.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/svc.bpf.o"));

/// Program names as in svc-ebpf/src/main.rs, one per cgroup attach point. The object holds
/// nothing else the agent loads (the decision's test program is in an object of its own).
pub const PROGRAMS: [&str; 9] = {
    let mut names = [""; 9];
    let mut i = 0;
    while i < names.len() {
        names[i] = sys::ATTACH_POINTS[i].1;
        i += 1;
    }
    names
};

/// The packet datapath's tc programs (svc-ebpf, docs/design/packet-datapath.md), each with
/// where it attaches and whether it belongs on the external devices (else on pod devices).
pub const TC_PROGRAMS: [(&str, TcAttachType, bool); 4] = [
    ("tc_ext_ingress", TcAttachType::Ingress, true),
    ("tc_ext_egress", TcAttachType::Egress, true),
    ("tc_pod_ingress", TcAttachType::Ingress, false),
    ("tc_pod_egress", TcAttachType::Egress, false),
];

/// The connection-tracking sweep (svc-ebpf's gc.rs): loaded, never attached; the agent runs
/// it (`Datapath::ct_sweep`).
pub const SWEEP_PROGRAM: &str = "tc_ct_sweep";

/// Where the tc link of `program` on device `ifname` is pinned.
pub fn tc_link_pin(dir: &Path, program: &str, ifname: &str) -> PathBuf {
    dir.join(format!("link_tc_{program}_{ifname}"))
}

/// The tc link pins in `dir`, with the program and device their names say.
fn tc_pins(dir: &Path) -> Vec<(PathBuf, &'static str, String)> {
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

const BPF_F_NO_PREALLOC: u32 = 1;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// What a pinned map must be for this agent to use it: type, key and value sizes, flags.
struct MapSpec {
    name: &'static str,
    kind: MapType,
    key: u32,
    value: u32,
    flags: u32,
}

fn specs() -> [MapSpec; 18] {
    use std::mem::size_of;
    use svc_common::*;
    let s = |name, kind, key: usize, value: usize, flags| MapSpec {
        name,
        kind,
        key: key as u32,
        value: value as u32,
        flags,
    };
    [
        s(
            map_names::SERVICES,
            MapType::Hash,
            size_of::<ServiceKey>(),
            size_of::<ServiceValue>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::SLOTS,
            MapType::Hash,
            size_of::<SlotKey>(),
            size_of::<BackendId>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::BACKENDS,
            MapType::Hash,
            4,
            size_of::<Backend>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::REV_NAT,
            MapType::Hash,
            4,
            size_of::<RevNatValue>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::SOCK_REV,
            MapType::LruHash,
            size_of::<SockRevKey>(),
            size_of::<SockRevValue>(),
            0,
        ),
        s(
            map_names::AFFINITY,
            MapType::LruHash,
            size_of::<AffinityKey>(),
            size_of::<AffinityValue>(),
            0,
        ),
        s(map_names::STATS, MapType::PerCpuArray, 4, 8, 0),
        s(
            map_names::NAMES,
            MapType::Hash,
            4,
            size_of::<ServiceName>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::META,
            MapType::Array,
            4,
            size_of::<MetaValue>(),
            0,
        ),
        s(
            map_names::AFFINITY_MATCH,
            MapType::Hash,
            size_of::<AffinityMatchKey>(),
            4,
            BPF_F_NO_PREALLOC,
        ),
        // Socket local storage: keyed by socket, sized by the sockets (max_entries 0).
        s(
            map_names::SOCK_STATE,
            MapType::SkStorage,
            4,
            size_of::<SockState>(),
            BPF_F_NO_PREALLOC,
        ),
        // The packet datapath's (docs/design/packet-datapath.md, "Map declarations").
        s(
            map_names::NODE_ADDRS,
            MapType::Hash,
            16,
            size_of::<NodeAddrValue>(),
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::SRC_RANGES,
            MapType::LpmTrie,
            size_of::<SrcRangeKey>(),
            4,
            BPF_F_NO_PREALLOC,
        ),
        s(
            map_names::CT,
            MapType::Hash,
            size_of::<CtKey>(),
            size_of::<CtValue>(),
            0,
        ),
        s(
            map_names::CT_NEW,
            MapType::LruHash,
            size_of::<CtKey>(),
            size_of::<CtValue>(),
            0,
        ),
        s(
            map_names::CONFIG,
            MapType::Array,
            4,
            size_of::<DatapathConfig>(),
            0,
        ),
        s(
            map_names::DEV_STATS,
            MapType::PerCpuHash,
            size_of::<DevStatKey>(),
            8,
            0,
        ),
        s(map_names::NODE_ADDR_BITS, MapType::Array, 4, 8, 0),
    ]
}

/// The maps the agent writes for the packet datapath: created and pinned by the agent itself
/// while the object does not declare them (the tc programs are not in every object), with the
/// `bpf_map_type` to create them with.
const OWN_MAPS: [(&str, u32); 4] = [
    (map_names::NODE_ADDRS, sys::map_type::HASH),
    (map_names::NODE_ADDR_BITS, sys::map_type::ARRAY),
    (map_names::SRC_RANGES, sys::map_type::LPM_TRIE),
    (map_names::CONFIG, sys::map_type::ARRAY),
];

/// max_entries a map of this agent has: configured, or fixed by the object.
fn max_entries(name: &str, capacity: &Capacity) -> u32 {
    capacity.of(name).unwrap_or(match name {
        map_names::STATS => stat::COUNT,
        map_names::SOCK_STATE => 0,
        map_names::NODE_ADDR_BITS => svc_common::NODE_ADDR_BIT_WORDS,
        _ => 1,
    })
}

/// Creates map `name` of `OWN_MAPS` as `specs()` describes it.
fn create_own(name: &'static str, capacity: &Capacity) -> Result<MapData> {
    let spec = specs()
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| load_err(name, "no spec"))?;
    let kind = OWN_MAPS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, k)| *k)
        .ok_or_else(|| load_err(name, "not a map the agent creates"))?;
    let fd = sys::map_create(
        kind,
        spec.key,
        spec.value,
        max_entries(name, capacity),
        spec.flags,
        name,
    )
    .map_err(|e| load_err(format!("creating map {name}"), e))?;
    MapData::from_fd(fd).map_err(|e| load_err(name, e))
}

/// Where `map` is pinned under `dir`: its name and layout version.
pub fn map_pin(dir: &Path, map: &str) -> PathBuf {
    dir.join(format!("{map}_v{}", layout::version(map)))
}

fn link_pin(dir: &Path, program: &str) -> PathBuf {
    dir.join(format!("link_{program}"))
}

/// A migrated map's new pin, until the programs that use it are attached.
fn staged_pin(dir: &Path, map: &str) -> PathBuf {
    dir.join(format!("{map}_v{}_new", layout::version(map)))
}

fn load_err(what: impl std::fmt::Display, e: impl Into<Box<dyn std::error::Error>>) -> Error {
    // aya's errors keep the errno in their source chain; the top message alone hides it.
    let e = e.into();
    let mut msg = format!("{what}: {e}");
    let mut cur = e.source();
    while let Some(s) = cur {
        msg.push_str(&format!(": {s}"));
        cur = s.source();
    }
    Error::Load(msg)
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What to do with each map at load time.
enum Pinned {
    /// No pin: a new map, pinned at once.
    Create,
    /// A compatible pin: the object uses it as it is.
    Adopt,
    /// A pin of the same layout but another size: a new map is filled from it, and replaces
    /// its pin once the new programs are attached.
    Migrate(MapData),
}

/// The loaded programs and maps of one agent, and the directory it owns.
pub struct Datapath {
    dir: PathBuf,
    /// The open directory; holding it holds the lock.
    lock: File,
    dir_ino: u64,
    ebpf: Ebpf,
    pub store: BpfStore,
    cgroup: PathBuf,
    cgroup_id: u64,
    attached: bool,
    /// Maps created beside a pin of another size, waiting for `attach`.
    staged: Vec<&'static str>,
    /// Pins of other layout versions, removed once our programs are attached.
    obsolete: Vec<PathBuf>,
    /// The tc programs this object has (loaded); the others are skipped.
    tc_loaded: Vec<&'static str>,
    /// Where the tc programs should be: external devices and pod devices.
    tc_devices: (Vec<Device>, Vec<Device>),
    /// tc link pins this agent has attached or swapped its programs into.
    tc_current: std::collections::BTreeSet<PathBuf>,
    /// The connection-tracking sweep, once loaded (`ct_sweep`).
    sweep: Option<std::os::fd::OwnedFd>,
}

/// Checks that `cgroup` is a cgroup v2 directory, before anything is created.
fn check_cgroup(cgroup: &Path) -> Result<u64> {
    let meta = std::fs::metadata(cgroup).map_err(|e| io_err(cgroup, e))?;
    if !meta.is_dir() {
        return Err(Error::Load(format!(
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
        return Err(Error::Load(format!(
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

/// Creates `dir` (0700) or checks that an existing one is ours alone: a directory (not a
/// link), owned by our user, writable by nobody else, on bpffs.
fn own_dir(dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Checked first, so a wrong --bpffs leaves no directory behind.
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
            if let Some(parent) = parent.filter(|p| p.exists()) {
                if !sys::is_bpffs(parent).map_err(|e| io_err(parent, e))? {
                    return Err(Error::Load(format!(
                        "--bpffs {} is not on a bpf filesystem (mount -t bpf bpf DIR): pins \
                         elsewhere are impossible",
                        dir.display()
                    )));
                }
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io_err(dir, e))?;
        }
        Err(e) => return Err(io_err(dir, e)),
        Ok(_) => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| io_err(dir, e))?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let mode = meta.permissions().mode();
    let problem = if !meta.file_type().is_dir() {
        Some("is not a directory".to_string())
    } else if meta.uid() != euid {
        Some(format!(
            "is owned by uid {}, not by us (uid {euid})",
            meta.uid()
        ))
    } else if mode & 0o022 != 0 {
        Some(format!("is writable by others (mode {:o})", mode & 0o7777))
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(Error::Load(format!(
            "--bpffs {} {problem}: whoever can write there can unpin the datapath; remove it \
             (or choose another directory) and let svc-agent create its own",
            dir.display()
        )));
    }
    if !sys::is_bpffs(dir).map_err(|e| io_err(dir, e))? {
        return Err(Error::Load(format!(
            "--bpffs {} is not on a bpf filesystem (mount -t bpf bpf DIR): pins elsewhere are \
             impossible",
            dir.display()
        )));
    }
    Ok(())
}

/// Locks `dir` for this process, naming the holder when another process has it.
fn lock_dir(dir: &Path) -> Result<(File, u64)> {
    let f = File::open(dir).map_err(|e| io_err(dir, e))?;
    let meta = f.metadata().map_err(|e| io_err(dir, e))?;
    if !sys::try_lock(f.as_fd()).map_err(|e| io_err(dir, e))? {
        return Err(Error::Locked {
            dir: dir.to_path_buf(),
            holder: describe_holders(meta.dev(), meta.ino()),
        });
    }
    Ok((f, meta.ino()))
}

fn describe_holders(dev: u64, ino: u64) -> String {
    let holders: Vec<String> = sys::flock_holders(dev, ino)
        .into_iter()
        .map(|pid| format!("pid {pid} ({})", sys::process_name(pid)))
        .collect();
    if holders.is_empty() {
        "another process".into()
    } else {
        holders.join(", ")
    }
}

/// Refuses when a program of svc's (by name) is attached to `cgroup` other than through a
/// link pinned under `dir`: another svc serves the cgroup, from another bpffs directory.
/// The error names the cgroup, the programs and links, and the process that holds them with
/// its bpffs directory when one does.
fn check_other_svc(dir: &Path, cgroup: &Path, cgroup_id: u64) -> Result<()> {
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
    Err(Error::Load(format!(
        "cgroup {} is already served by another svc, not through links pinned under {}: {programs}; \
         {who}. One svc agent per cgroup: stop the other (and uninstall its directory), or run \
         this one with its --bpffs",
        cgroup.display(),
        dir.display()
    )))
}

/// The previous release pinned maps without a version; their layout is version 1.
fn adopt_unversioned(dir: &Path) {
    for name in map_names::ALL {
        let old = dir.join(name);
        let new = map_pin(dir, name);
        if layout::version(name) == 1 && old.exists() && !new.exists() {
            match std::fs::rename(&old, &new) {
                Ok(()) => info!(map = name, "adopted an unversioned pin as layout 1"),
                Err(e) => warn!(map = name, "renaming {}: {e}", old.display()),
            }
        }
    }
}

/// Pins in `dir` of our maps under another layout version, and staged pins a dead agent left.
fn other_versions(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        for name in map_names::ALL {
            let ours = format!("{name}_v{}", layout::version(name));
            let Some(rest) = file.strip_prefix(name) else {
                continue;
            };
            let versioned = rest.strip_prefix("_v").is_some_and(|v| {
                !v.is_empty()
                    && v.trim_end_matches("_new")
                        .bytes()
                        .all(|b| b.is_ascii_digit())
            });
            if file != ours && (rest.is_empty() || versioned) {
                found.push(e.path());
            }
        }
    }
    found.sort();
    found
}

/// Checks the pin of `spec` at `path` against what this agent needs.
fn inspect_pin(spec: &MapSpec, path: &Path, want_entries: u32) -> Result<Pinned> {
    if !path.exists() {
        return Ok(Pinned::Create);
    }
    let data = MapData::from_pin(path).map_err(|e| load_err(path.display(), e))?;
    let info = data.info().map_err(|e| load_err(path.display(), e))?;
    let kind = info.map_type().ok();
    let mut wrong = Vec::new();
    if kind != Some(spec.kind) {
        wrong.push(format!("type {kind:?}, not {:?}", spec.kind));
    }
    if info.key_size() != spec.key {
        wrong.push(format!("{}-byte keys, not {}", info.key_size(), spec.key));
    }
    if info.value_size() != spec.value {
        wrong.push(format!(
            "{}-byte values, not {}",
            info.value_size(),
            spec.value
        ));
    }
    if info.map_flags() != spec.flags {
        wrong.push(format!(
            "flags {:#x}, not {:#x}",
            info.map_flags(),
            spec.flags
        ));
    }
    if !wrong.is_empty() {
        return Err(Error::Load(format!(
            "map {} pinned at {} has {}: it was not made by this layout of svc. Nothing was \
             changed; stop whatever made it, then `svc-agent uninstall --bpffs {}` (drops \
             sessionAffinity state and reverse translation of open sockets) and start again",
            spec.name,
            path.display(),
            wrong.join(", "),
            path.parent().unwrap_or(path).display()
        )));
    }
    if info.max_entries() != want_entries {
        info!(
            map = spec.name,
            pinned = info.max_entries(),
            wanted = want_entries,
            "map capacity changed; migrating its entries to a new map"
        );
        return Ok(Pinned::Migrate(data));
    }
    Ok(Pinned::Adopt)
}

/// Copies every entry of `old` into `new`. `keep_newer`: entries `new` already has win
/// (the kernel may have written them since the first copy).
fn copy_hash<K, V>(
    name: &'static str,
    old: &MapData,
    new: &mut HashMap<MapData, K, V>,
    keep_newer: bool,
) -> Result<usize>
where
    K: aya::Pod + bytemuck::Pod,
    V: aya::Pod + bytemuck::Pod,
{
    let entries: Vec<(K, V)> = sys::dump_hash(old.fd().as_fd()).map_err(|e| Error::Map {
        map: name,
        message: format!("reading the old map: {e}"),
    })?;
    let flags = if keep_newer {
        1 /* BPF_NOEXIST */
    } else {
        0
    };
    for (k, v) in &entries {
        match new.insert(k, v, flags) {
            Ok(()) => {}
            Err(aya::maps::MapError::SyscallError(e))
                if keep_newer && e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::E2BIG) =>
            {
                return Err(Error::Load(format!(
                    "map {name}: its {} entries do not fit in the capacity asked for; give a \
                     larger one (see `svc-agent run --help`, the --max-* flags)",
                    entries.len()
                )))
            }
            Err(e) => return Err(crate::store::map_err(name, e)),
        }
    }
    Ok(entries.len())
}

impl Datapath {
    /// Takes ownership of `dir`, loads the programs and adopts (or creates, or migrates) the
    /// maps. Nothing is attached yet: see [`Datapath::attach`]. On error nothing under `dir`
    /// has changed but for a directory this call created.
    pub fn open(dir: &Path, cgroup: &Path, capacity: Capacity) -> Result<Datapath> {
        let cgroup_id = check_cgroup(cgroup)?;
        sys::ensure_bpffs(dir).map_err(|e| load_err("mounting bpffs at /sys/fs/bpf", e))?;
        own_dir(dir)?;
        let (lock, dir_ino) = lock_dir(dir)?;
        // Before anything is loaded: the lock covers this directory alone, and an agent with
        // another directory on the same cgroup would attach beside the first and serve
        // nothing, the first's programs answering every connect().
        check_other_svc(dir, cgroup, cgroup_id)?;
        adopt_unversioned(dir);

        let mut plans = Vec::new();
        for spec in specs() {
            let want = max_entries(spec.name, &capacity);
            plans.push((
                spec.name,
                inspect_pin(&spec, &map_pin(dir, spec.name), want)?,
            ));
        }
        let mut loader = EbpfLoader::new();
        let pins: Vec<(&'static str, PathBuf)> = map_names::ALL
            .iter()
            .map(|name| (*name, map_pin(dir, name)))
            .collect();
        for (name, plan) in &plans {
            if matches!(plan, Pinned::Adopt) {
                let path = &pins.iter().find(|(n, _)| n == name).expect("every map").1;
                loader.map_pin_path(name, path.as_path());
            }
            if let Some(n) = capacity.of(name) {
                loader.map_max_entries(name, n);
            }
        }
        let mut ebpf = loader
            .load(OBJECT)
            .map_err(|e| load_err("loading the eBPF object", e))?;
        // Maps this object does not declare: those the agent writes are its own (created or
        // adopted here, and filled by the first sync before any program could read them);
        // the others (the packet datapath's, read only) wait for an object that has them.
        let mut own: Vec<(&'static str, MapData)> = Vec::new();
        for (name, plan) in plans.iter_mut() {
            if ebpf.map(name).is_some() {
                continue;
            }
            let plan = std::mem::replace(plan, Pinned::Adopt);
            if !OWN_MAPS.iter().any(|(n, _)| n == name) {
                continue;
            }
            let path = map_pin(dir, name);
            let data = match plan {
                Pinned::Adopt => {
                    MapData::from_pin(&path).map_err(|e| load_err(path.display(), e))?
                }
                Pinned::Create | Pinned::Migrate(_) => {
                    // A resized map of its own: no program reads it, so a new empty one takes
                    // the pin at once; the first sync writes its entries.
                    let data = create_own(name, &capacity)?;
                    let _ = std::fs::remove_file(&path);
                    data.pin(&path).map_err(|e| load_err(path.display(), e))?;
                    info!(
                        map = name,
                        "created (the loaded object does not declare it)"
                    );
                    data
                }
            };
            own.push((name, data));
        }
        for name in PROGRAMS {
            let prog = ebpf
                .program_mut(name)
                .ok_or_else(|| load_err(name, "program missing from the object"))?;
            let loaded = if name == sys::SOCK_RELEASE {
                <&mut CgroupSock>::try_from(prog)
                    .map_err(|e| load_err(name, e))?
                    .load()
            } else {
                <&mut CgroupSockAddr>::try_from(prog)
                    .map_err(|e| load_err(name, e))?
                    .load()
            };
            loaded.map_err(|e| load_err(name, e))?;
        }
        let mut tc_loaded = Vec::new();
        for (name, _, _) in TC_PROGRAMS {
            let Some(prog) = ebpf.program_mut(name) else {
                info!(
                    program = name,
                    "not in the eBPF object: the packet datapath (NodePort, ExternalIP, \
                     LoadBalancer, per-packet ClusterIP) is not attached; its maps are kept \
                     up to date for an object that has it"
                );
                continue;
            };
            <&mut SchedClassifier>::try_from(prog)
                .map_err(|e| load_err(name, e))?
                .load()
                .map_err(|e| load_err(name, e))?;
            tc_loaded.push(name);
        }
        let mut store = store_from(&mut ebpf, own, capacity)?;

        let mut staged = Vec::new();
        for (name, plan) in plans {
            match plan {
                Pinned::Adopt => {}
                Pinned::Create => {
                    let path = map_pin(dir, name);
                    held(&store, name)?
                        .pin(&path)
                        .map_err(|e| load_err(path.display(), e))?;
                }
                Pinned::Migrate(old) => {
                    let n = migrate(&mut store, name, &old, false)?;
                    info!(map = name, entries = n, "copied into the resized map");
                    let path = staged_pin(dir, name);
                    let _ = std::fs::remove_file(&path);
                    held(&store, name)?
                        .pin(&path)
                        .map_err(|e| load_err(path.display(), e))?;
                    staged.push(name);
                }
            }
        }
        let carried = carry_ct_v1(&mut store, dir)?;
        if carried > 0 {
            info!(
                map = map_names::CT,
                entries = carried,
                "carried the flows of layout 1 over (untracked: their RSTs and FINs are taken \
                 as before)"
            );
        }
        let carried = carry_ct_v2(&mut store, dir)?;
        if carried > 0 {
            info!(
                map = map_names::CT,
                entries = carried,
                "carried the flows of layout 2 over (assured ones to the assured table)"
            );
        }
        // Before any program of this object reads the filter: it may be new, or the
        // addresses may have been carried into a resized map. Bits are only added: the
        // programs still attached may read it beside another map of addresses.
        store.sync_node_addr_bits(false)?;
        Ok(Datapath {
            dir: dir.to_path_buf(),
            lock,
            dir_ino,
            ebpf,
            store,
            cgroup: cgroup.to_path_buf(),
            cgroup_id,
            attached: false,
            staged,
            obsolete: other_versions(dir),
            tc_loaded,
            tc_devices: (Vec::new(), Vec::new()),
            tc_current: Default::default(),
            sweep: None,
        })
    }

    /// A descriptor of the connection-tracking sweep, loaded on the first call, for a thread
    /// of its own; None when the object has none. Loaded only when asked for: a kernel that
    /// refuses it (before bpf_for_each_map_elem, 5.13) leaves the datapath running unswept.
    pub fn ct_sweep(&mut self) -> Result<Option<std::os::fd::OwnedFd>> {
        if self.sweep.is_none() {
            let Some(prog) = self.ebpf.program_mut(SWEEP_PROGRAM) else {
                return Ok(None);
            };
            let prog =
                <&mut SchedClassifier>::try_from(prog).map_err(|e| load_err(SWEEP_PROGRAM, e))?;
            prog.load().map_err(|e| load_err(SWEEP_PROGRAM, e))?;
            let fd = prog.fd().map_err(|e| load_err(SWEEP_PROGRAM, e))?;
            self.sweep = Some(
                fd.as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| load_err(SWEEP_PROGRAM, e))?,
            );
        }
        match &self.sweep {
            Some(fd) => fd
                .try_clone()
                .map(Some)
                .map_err(|e| load_err(SWEEP_PROGRAM, e)),
            None => Ok(None),
        }
    }

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
    fn tc_wanted(&self) -> Vec<(&'static str, TcAttachType, Device)> {
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
    fn attach_tc(&mut self) -> Result<Vec<String>> {
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
    fn attach_tc_one(
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
                let prog = self
                    .ebpf
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
        let prog = self
            .ebpf
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

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A second handle on one of the agent's maps, for a thread of its own.
    pub fn reopen(&self, name: &'static str) -> Result<Map> {
        let data = clone_map(held(&self.store, name)?)?;
        Map::from_map_data(data).map_err(|e| load_err(name, e))
    }

    /// `open` and `attach` at once, for tools that program the maps themselves.
    pub fn open_attached(dir: &Path, cgroup: &Path, capacity: Capacity) -> Result<Datapath> {
        let mut dp = Datapath::open(dir, cgroup, capacity)?;
        dp.attach()?;
        Ok(dp)
    }

    pub fn is_attached(&self) -> bool {
        self.attached
    }

    /// Whether every link is pinned (by us, or by a previous agent whose programs serve).
    pub fn links_pinned(&self) -> bool {
        PROGRAMS.iter().all(|p| link_pin(&self.dir, p).exists())
    }

    /// Attaches each program to the cgroup through a pinned link, or swaps it into the link
    /// a previous agent pinned; then finishes migrations and removes pins of other layouts.
    pub fn attach(&mut self) -> Result<()> {
        // Again: another agent may have attached since `open` (both started at once).
        check_other_svc(&self.dir, &self.cgroup, self.cgroup_id)?;
        let cgroup_file = File::open(&self.cgroup).map_err(|e| io_err(&self.cgroup, e))?;
        for name in PROGRAMS {
            self.attach_one(name, &cgroup_file, true)?;
        }
        self.attached = true;
        if let Err(e) = self.attach_tc() {
            warn!("attaching the packet datapath: {e}");
        }

        // The new programs use the new maps now: entries the old programs wrote in the
        // meantime are carried over, then the new maps take the pins.
        for name in std::mem::take(&mut self.staged) {
            let path = map_pin(&self.dir, name);
            if let Ok(old) = MapData::from_pin(&path) {
                if matches!(
                    name,
                    map_names::SOCK_REV | map_names::AFFINITY | map_names::CT | map_names::CT_NEW
                ) {
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
        if let Err(e) = carry_ct_v2(&mut self.store, &self.dir) {
            warn!(
                map = map_names::CT,
                "carrying over late flows of layout 2: {e}"
            );
        }
        for path in std::mem::take(&mut self.obsolete) {
            match std::fs::remove_file(&path) {
                Ok(()) => info!(pin = %path.display(), "removed a pin of another map layout"),
                Err(e) => warn!("removing {}: {e}", path.display()),
            }
        }
        Ok(())
    }

    fn attach_one(&mut self, name: &str, cgroup_file: &File, swap: bool) -> Result<()> {
        let pin = link_pin(&self.dir, name);
        let prog = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| load_err(name, "program missing from the object"))?;
        if pin.exists() {
            let link = sys::obj_get(&pin).map_err(|e| load_err(pin.display(), e))?;
            let (_, attached_to) =
                sys::link_info(link.as_fd()).map_err(|e| load_err(pin.display(), e))?;
            if attached_to == self.cgroup_id {
                if swap {
                    let fd = prog.fd().map_err(|e| load_err(name, e))?;
                    sys::link_update(link.as_fd(), fd.as_fd())
                        .map_err(|e| load_err(pin.display(), e))?;
                    info!(program = name, "replaced the program of the pinned link");
                }
                return Ok(());
            }
            if attached_to != 0 {
                return Err(Error::Load(format!(
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
        // A bpf link takes no attach flags; links to one cgroup coexist with other links.
        let attaching = |e| load_err(format!("attaching {name} to {}", self.cgroup.display()), e);
        let link = if name == sys::SOCK_RELEASE {
            let prog = <&mut CgroupSock>::try_from(prog).map_err(|e| load_err(name, e))?;
            let id = prog
                .attach(cgroup_file, CgroupAttachMode::Single)
                .map_err(attaching)?;
            let link = prog.take_link(id).map_err(|e| load_err(name, e))?;
            FdLink::try_from(link).map_err(|e| load_err(name, e))?
        } else {
            let prog = <&mut CgroupSockAddr>::try_from(prog).map_err(|e| load_err(name, e))?;
            let id = prog
                .attach(cgroup_file, CgroupAttachMode::Single)
                .map_err(attaching)?;
            let link = prog.take_link(id).map_err(|e| load_err(name, e))?;
            FdLink::try_from(link).map_err(|e| load_err(name, e))?
        };
        link.pin(&pin).map_err(|e| load_err(pin.display(), e))?;
        info!(program = name, cgroup = %self.cgroup.display(), "attached");
        Ok(())
    }

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
        for spec in specs() {
            let name = spec.name;
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
                let healthy = pin.exists()
                    && sys::obj_get(&pin)
                        .and_then(|l| sys::link_info(l.as_fd()))
                        .is_ok_and(|(_, cg)| cg == self.cgroup_id);
                if healthy {
                    continue;
                }
                match self.attach_one(name, &cgroup_file, false) {
                    Ok(()) => repaired.push(format!("link {}", pin.display())),
                    Err(e) => errors.push(e),
                }
            }
            for (program, at, device) in self.tc_wanted() {
                let pin = tc_link_pin(&self.dir, program, &device.name);
                let healthy = pin.exists()
                    && sys::obj_get(&pin)
                        .and_then(|l| sys::tcx_link_info(l.as_fd()))
                        .is_ok_and(|(ifindex, _)| ifindex == device.index);
                if healthy {
                    continue;
                }
                self.tc_current.remove(&pin);
                match self.attach_tc_one(program, at, &device, &pin) {
                    Ok(_) => repaired.push(format!("link {}", pin.display())),
                    Err(e) => errors.push(e),
                }
            }
        }
        (repaired, errors)
    }
}

/// The store's map of that name; None for a name the store does not hold.
fn store_map<'a>(store: &'a BpfStore, name: &str) -> Option<&'a MapData> {
    Some(match name {
        map_names::SERVICES => store.services.map(),
        map_names::SLOTS => store.slots.map(),
        map_names::BACKENDS => store.backends.map(),
        map_names::REV_NAT => store.rev_nat.map(),
        map_names::NAMES => store.names.map(),
        map_names::AFFINITY => store.affinity.map(),
        map_names::SOCK_REV => store.sock_rev.map(),
        map_names::STATS => store.stats.map(),
        map_names::AFFINITY_MATCH => store.affinity_match.map(),
        map_names::SOCK_STATE => &store.sock_state,
        map_names::META => store.meta.map(),
        map_names::SRC_RANGES => store.src_ranges.map(),
        map_names::NODE_ADDRS => store.node_addrs.map(),
        map_names::NODE_ADDR_BITS => store.node_addr_bits.map(),
        map_names::CONFIG => store.config.map(),
        map_names::CT => store.ct.as_ref()?,
        map_names::CT_NEW => store.ct_new.as_ref()?,
        map_names::DEV_STATS => store.dev_stats.as_ref()?,
        _ => return None,
    })
}

/// `store_map`, for a name that must be there.
fn held<'a>(store: &'a BpfStore, name: &str) -> Result<&'a MapData> {
    store_map(store, name).ok_or_else(|| load_err(name, "not a map the agent holds"))
}

/// Copies a migrated map's entries into the new one.
fn migrate(store: &mut BpfStore, name: &'static str, old: &MapData, late: bool) -> Result<usize> {
    match name {
        map_names::SERVICES => copy_hash(name, old, &mut store.services, late),
        map_names::SLOTS => copy_hash(name, old, &mut store.slots, late),
        map_names::BACKENDS => copy_hash(name, old, &mut store.backends, late),
        map_names::REV_NAT => copy_hash(name, old, &mut store.rev_nat, late),
        map_names::NAMES => copy_hash(name, old, &mut store.names, late),
        map_names::AFFINITY => copy_hash(name, old, &mut store.affinity, late),
        map_names::SOCK_REV => copy_hash(name, old, &mut store.sock_rev, late),
        map_names::AFFINITY_MATCH => copy_hash(name, old, &mut store.affinity_match, late),
        map_names::NODE_ADDRS => copy_hash(name, old, &mut store.node_addrs, late),
        map_names::SRC_RANGES => {
            let old: LpmTrie<MapData, crate::store::RangeData, u32> =
                LpmTrie::try_from(Map::LpmTrie(clone_map(old)?))
                    .map_err(|e| crate::store::map_err(name, e))?;
            let mut n = 0;
            for k in old.keys().flatten() {
                store
                    .src_ranges
                    .insert(&k, 0, 0)
                    .map_err(|e| crate::store::map_err(name, e))?;
                n += 1;
            }
            Ok(n)
        }
        map_names::CT | map_names::CT_NEW => match store_map(store, name) {
            Some(ct) => {
                let mut new: HashMap<MapData, svc_common::CtKey, svc_common::CtValue> =
                    HashMap::try_from(Map::HashMap(clone_map(ct)?))
                        .map_err(|e| crate::store::map_err(name, e))?;
                copy_hash(name, old, &mut new, late)
            }
            None => Ok(0),
        },
        map_names::STATS => {
            let old: PerCpuArray<MapData, u64> =
                PerCpuArray::try_from(Map::PerCpuArray(clone_map(old)?))
                    .map_err(|e| crate::store::map_err(name, e))?;
            let n = old.len().min(store.stats.len());
            for i in 0..n {
                if let Ok(v) = old.get(&i, 0) {
                    let _ = store.stats.set(i, v, 0);
                }
            }
            Ok(n as usize)
        }
        _ => Ok(0),
    }
}

/// Carries the flows of a pinned `SVC_CT` of layout 1 (before sequence tracking) into this
/// layout's tables (`carry_ct`), untracked, so an upgrade keeps every connection through a NodePort: before
/// the new programs attach, and again after (the old programs may have made flows in
/// between). Only the flows the new map lacks. How many entries were read.
fn carry_ct_v1(store: &mut BpfStore, dir: &Path) -> Result<usize> {
    if store.ct.is_none() {
        return Ok(0);
    }
    let Some(entries) = old_ct::<svc_common::CtValueV1>(dir, 1)? else {
        return Ok(0);
    };
    let entries: Vec<(svc_common::CtKey, svc_common::CtValue)> = entries
        .into_iter()
        .map(|(k, v)| (k, svc_common::CtValue::from(v)))
        .collect();
    carry_ct(store, &entries)?;
    Ok(entries.len())
}

/// Carries the flows of a pinned `SVC_CT` of layout 2 (one LRU of every flow) into this
/// layout's tables: unassured flows (`ct_flags::UNASSURED`) into `SVC_CT_NEW`, the others into
/// `SVC_CT`, so an upgrade keeps every connection; before the new programs attach, and again
/// after, as `carry_ct_v1`. How many entries were read.
fn carry_ct_v2(store: &mut BpfStore, dir: &Path) -> Result<usize> {
    if store.ct.is_none() || store.ct_new.is_none() {
        return Ok(0);
    }
    let Some(entries) = old_ct::<svc_common::CtValue>(dir, 2)? else {
        return Ok(0);
    };
    carry_ct(store, &entries)?;
    Ok(entries.len())
}

/// The flows of the pinned `SVC_CT` of an older `layout` (pin `SVC_CT_v{layout}`), whose
/// values are `V`; None without that pin. A pin of other key or value sizes is an error that
/// names it.
fn old_ct<V: bytemuck::Pod>(
    dir: &Path,
    layout: u32,
) -> Result<Option<Vec<(svc_common::CtKey, V)>>> {
    let path = dir.join(format!("{}_v{layout}", map_names::CT));
    if !path.exists() {
        return Ok(None);
    }
    let old = MapData::from_pin(&path).map_err(|e| load_err(path.display(), e))?;
    let info = old.info().map_err(|e| load_err(path.display(), e))?;
    let (key, value) = (
        std::mem::size_of::<svc_common::CtKey>() as u32,
        std::mem::size_of::<V>() as u32,
    );
    if (info.key_size(), info.value_size()) != (key, value) {
        return Err(Error::Load(format!(
            "{} has {}-byte keys and {}-byte values, not layout {layout}'s {key} and {value}",
            path.display(),
            info.key_size(),
            info.value_size()
        )));
    }
    sys::dump_hash(old.fd().as_fd())
        .map(Some)
        .map_err(|e| Error::Map {
            map: map_names::CT,
            message: format!("reading {}: {e}", path.display()),
        })
}

/// Stores the flows of an older layout's table: each entry into the table its flags say
/// (`ct_flags::UNASSURED`: `SVC_CT_NEW`), never over an entry either table has: the old pin
/// may outlive an attach that put this layout's programs in service (an agent killed before
/// it removed the pin), and its frozen flows must not overwrite live ones. An assured flow
/// that finds the assured table full goes to the unassured one, as the datapath keeps a flow
/// assured there when the table is full.
fn carry_ct(store: &BpfStore, entries: &[(svc_common::CtKey, svc_common::CtValue)]) -> Result<()> {
    let (Some(ct), Some(ct_new)) = (&store.ct, &store.ct_new) else {
        return Ok(());
    };
    let mut assured: HashMap<MapData, svc_common::CtKey, svc_common::CtValue> =
        HashMap::try_from(Map::HashMap(clone_map(ct)?))
            .map_err(|e| crate::store::map_err(map_names::CT, e))?;
    let mut unassured: HashMap<MapData, svc_common::CtKey, svc_common::CtValue> =
        HashMap::try_from(Map::LruHashMap(clone_map(ct_new)?))
            .map_err(|e| crate::store::map_err(map_names::CT_NEW, e))?;
    let errno = |e: &aya::maps::MapError| match e {
        aya::maps::MapError::SyscallError(e) => e.io_error.raw_os_error(),
        _ => None,
    };
    for (k, v) in entries {
        if assured.get(k, 0).is_ok() || unassured.get(k, 0).is_ok() {
            continue;
        }
        let first = if v.flags & svc_common::ct_flags::UNASSURED != 0 {
            unassured.insert(k, v, 1 /* BPF_NOEXIST */)
        } else {
            match assured.insert(k, v, 1 /* BPF_NOEXIST */) {
                Err(e) if errno(&e) == Some(libc::E2BIG) => {
                    unassured.insert(k, v, 1 /* BPF_NOEXIST */)
                }
                other => other,
            }
        };
        match first {
            Ok(()) => {}
            Err(e) if errno(&e) == Some(libc::EEXIST) => {}
            Err(e) => return Err(crate::store::map_err(map_names::CT, e)),
        }
    }
    Ok(())
}

fn clone_map(m: &MapData) -> Result<MapData> {
    let fd = m
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| Error::Load(format!("duplicating a map descriptor: {e}")))?;
    MapData::from_fd(fd).map_err(|e| load_err("reopening a map", e))
}

fn store_from(
    ebpf: &mut Ebpf,
    mut own: Vec<(&'static str, MapData)>,
    capacity: Capacity,
) -> Result<BpfStore> {
    let mut take = |name: &'static str| match ebpf.take_map(name) {
        Some(m) => Ok(m),
        None => match own.iter().position(|(n, _)| *n == name) {
            Some(i) => Map::from_map_data(own.swap_remove(i).1).map_err(|e| load_err(name, e)),
            None => Err(load_err(name, "map missing from the object")),
        },
    };
    build_store(&mut take, capacity)
}

fn build_store(
    take: &mut dyn FnMut(&'static str) -> Result<Map>,
    capacity: Capacity,
) -> Result<BpfStore> {
    fn hash<K: aya::Pod, V: aya::Pod>(
        take: &mut dyn FnMut(&'static str) -> Result<Map>,
        name: &'static str,
    ) -> Result<HashMap<MapData, K, V>> {
        HashMap::try_from(take(name)?).map_err(|e| load_err(name, e))
    }
    Ok(BpfStore {
        services: hash(take, map_names::SERVICES)?,
        slots: hash(take, map_names::SLOTS)?,
        backends: hash(take, map_names::BACKENDS)?,
        rev_nat: hash(take, map_names::REV_NAT)?,
        names: hash(take, map_names::NAMES)?,
        affinity: hash(take, map_names::AFFINITY)?,
        affinity_match: hash(take, map_names::AFFINITY_MATCH)?,
        sock_rev: hash(take, map_names::SOCK_REV)?,
        sock_state: match take(map_names::SOCK_STATE)? {
            Map::SkStorage(data) => data,
            other => {
                return Err(load_err(
                    map_names::SOCK_STATE,
                    format!("not socket storage: {other:?}"),
                ))
            }
        },
        meta: Array::try_from(take(map_names::META)?).map_err(|e| load_err(map_names::META, e))?,
        stats: PerCpuArray::try_from(take(map_names::STATS)?)
            .map_err(|e| load_err(map_names::STATS, e))?,
        src_ranges: LpmTrie::try_from(take(map_names::SRC_RANGES)?)
            .map_err(|e| load_err(map_names::SRC_RANGES, e))?,
        node_addrs: hash(take, map_names::NODE_ADDRS)?,
        node_addr_bits: Array::try_from(take(map_names::NODE_ADDR_BITS)?)
            .map_err(|e| load_err(map_names::NODE_ADDR_BITS, e))?,
        addr_bits: Default::default(),
        config: Array::try_from(take(map_names::CONFIG)?)
            .map_err(|e| load_err(map_names::CONFIG, e))?,
        ct: take(map_names::CT).ok().and_then(map_data),
        ct_new: take(map_names::CT_NEW).ok().and_then(map_data),
        dev_stats: take(map_names::DEV_STATS).ok().and_then(map_data),
        capacity,
        enomem_until: None,
    })
}

/// The map behind the kinds of `Map` the agent keeps untyped.
fn map_data(m: Map) -> Option<MapData> {
    match m {
        Map::LruHashMap(d) | Map::PerCpuHashMap(d) | Map::HashMap(d) => Some(d),
        _ => None,
    }
}

/// Opens the maps pinned under `dir`, for listing; loads and attaches nothing, takes no lock.
pub fn open_pinned(dir: &Path) -> Result<BpfStore> {
    let mut capacity = Capacity::default();
    for name in map_names::ALL {
        if let Ok(info) = MapData::from_pin(map_pin(dir, name)).and_then(|m| m.info()) {
            match name {
                map_names::SERVICES => capacity.services = info.max_entries(),
                map_names::SLOTS => capacity.slots = info.max_entries(),
                map_names::BACKENDS => capacity.backends = info.max_entries(),
                map_names::REV_NAT => capacity.rev_nat = info.max_entries(),
                map_names::NAMES => capacity.names = info.max_entries(),
                map_names::SOCK_REV => capacity.sock_rev = info.max_entries(),
                map_names::AFFINITY => capacity.affinity = info.max_entries(),
                map_names::AFFINITY_MATCH => capacity.affinity_match = info.max_entries(),
                map_names::SRC_RANGES => capacity.src_ranges = info.max_entries(),
                map_names::NODE_ADDRS => capacity.node_addrs = info.max_entries(),
                map_names::CT => capacity.ct = info.max_entries(),
                map_names::DEV_STATS => capacity.dev_stats = info.max_entries(),
                _ => {}
            }
        }
    }
    build_store(
        &mut |name| match pinned(dir, name) {
            // Pinned by an agent from before the packet datapath: nothing to list there.
            Err(_) if OWN_MAPS.iter().any(|(n, _)| *n == name) => {
                Map::from_map_data(create_own(name, &capacity)?).map_err(|e| load_err(name, e))
            }
            other => other,
        },
        capacity,
    )
}

fn pinned(dir: &Path, name: &'static str) -> Result<Map> {
    let path = map_pin(dir, name);
    let data = MapData::from_pin(&path).map_err(|e| {
        load_err(
            path.display(),
            format!("{e} (is svc-agent running with --bpffs {}?)", dir.display()),
        )
    })?;
    Map::from_map_data(data).map_err(|e| load_err(name, e))
}

/// What `uninstall` did.
#[derive(Debug, Default)]
pub struct Uninstalled {
    pub removed: Vec<PathBuf>,
    /// Programs of others found on the cgroup's hooks: left alone.
    pub foreign: Vec<String>,
    /// svc's tc flows handed over to the node's conntrack; `None` when svc had no
    /// tc program on a device of this network namespace (nothing to hand over here).
    pub handover: Option<crate::handover::Handover>,
    /// Why the handover could not run at all.
    pub handover_error: Option<String>,
}

/// Removes every link and map pin under `dir`, then `dir`, and detaches svc's programs from
/// `cgroup` even if some process still holds their links. Refuses while an agent owns the
/// directory. Unpinning a map that no program uses frees it.
pub fn uninstall(dir: &Path, cgroup: Option<&Path>) -> Result<Uninstalled> {
    let mut done = Uninstalled::default();
    if !dir.exists() {
        if let Some(cg) = cgroup {
            done.foreign = check_detached(cg, &[])?;
        }
        return Ok(done);
    }
    let (_lock, _) = lock_dir(dir)?;
    // The links, opened before their pins go, so they can be detached whoever holds them.
    let tc_links: Vec<PathBuf> = tc_pins(dir).into_iter().map(|(p, _, _)| p).collect();
    let links: Vec<(PathBuf, std::os::fd::OwnedFd)> = PROGRAMS
        .iter()
        .map(|p| link_pin(dir, p))
        .chain(tc_links.iter().cloned())
        .filter_map(|pin| sys::obj_get(&pin).ok().map(|fd| (pin, fd)))
        .collect();
    let ours: Vec<u32> = links
        .iter()
        .filter_map(|(_, fd)| sys::link_info(fd.as_fd()).ok().map(|(prog, _)| prog))
        .collect();
    // While svc's tc programs still translate: once they are gone, a flow the node's conntrack
    // does not carry would meet kube-proxy's rules as a new connection.
    if tc_links_here(dir) {
        // The timeouts the agent wrote, if any: a flow's lifetime left, as svc would count it.
        let config = MapData::from_pin(map_pin(dir, map_names::CONFIG))
            .ok()
            .and_then(|m| {
                Array::<MapData, svc_common::DatapathConfig>::try_from(Map::Array(m)).ok()
            })
            .and_then(|a| a.get(&0, 0).ok())
            .unwrap_or_default();
        // Both tables: an unassured flow (a handshake in flight, a UDP flow with one reply)
        // is handed over as conntrack would hold it, unassured.
        for name in [map_names::CT, map_names::CT_NEW] {
            let path = map_pin(dir, name);
            if name == map_names::CT_NEW && !path.exists() {
                // An older agent's datapath: one table of every flow.
                continue;
            }
            match MapData::from_pin(&path) {
                Ok(ct) => match crate::handover::hand_over(ct, &config) {
                    Ok(h) => done.handover.get_or_insert_with(Default::default).add(h),
                    Err(e) => done.handover_error = Some(format!("ctnetlink: {e}")),
                },
                Err(e) => done.handover_error = Some(format!("map {name}: {e}")),
            }
        }
    }
    let mut names: Vec<PathBuf> = PROGRAMS
        .iter()
        .map(|p| link_pin(dir, p))
        .chain(tc_links)
        .chain(map_names::ALL.iter().map(|m| map_pin(dir, m)))
        .chain(map_names::ALL.iter().map(|m| staged_pin(dir, m)))
        .collect();
    names.extend(other_versions(dir));
    for path in names {
        match std::fs::remove_file(&path) {
            Ok(()) => done.removed.push(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(Error::Io { path, source }),
        }
    }
    for (pin, fd) in &links {
        match sys::link_detach(fd.as_fd()) {
            Ok(()) => {}
            // Already detached: its cgroup went away, or nothing held it once unpinned.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOLINK) | Some(libc::EINVAL)) => {}
            Err(e) => return Err(load_err(format!("detaching {}", pin.display()), e)),
        }
    }
    drop(links);
    std::fs::remove_dir(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    if let Some(cg) = cgroup {
        done.foreign = check_detached(cg, &ours)?;
    }
    Ok(done)
}

/// Whether svc has tc links under `dir` and every one is on a device of the calling thread's
/// network namespace (the same name at the same index): the flows of its CT map are this
/// namespace's to hand over, and no other's conntrack gets them.
fn tc_links_here(dir: &Path) -> bool {
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

/// Fails if any of `ours` is still attached to `cgroup`; returns the other programs found on
/// svc's hooks there (not ours to judge).
fn check_detached(cgroup: &Path, ours: &[u32]) -> Result<Vec<String>> {
    let f = File::open(cgroup).map_err(|e| io_err(cgroup, e))?;
    let mut left = Vec::new();
    let mut foreign = Vec::new();
    for (t, name) in sys::ATTACH_POINTS {
        let ids = sys::attached_program_ids(f.as_fd(), t)
            .map_err(|e| load_err(format!("querying {} at {name}", cgroup.display()), e))?;
        for id in ids {
            if ours.contains(&id) {
                left.push(format!("{name}: program {id}"));
            } else {
                foreign.push(format!("{name}: program {id}"));
            }
        }
    }
    if !left.is_empty() {
        return Err(Error::Load(format!(
            "svc's programs are still attached to {} ({})",
            cgroup.display(),
            left.join(", ")
        )));
    }
    Ok(foreign)
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

/// Totals of the socket programs' decision counters, by reason, from the pinned map alone.
/// What the packet datapath's maps say, for `/metrics`.
#[derive(Debug, Default)]
pub struct PacketStats {
    /// (ifindex, `pkt_stat` name, total over the CPUs), from `DEV_STATS`.
    pub devices: Vec<(u32, &'static str, u64)>,
    /// Entries of `CT`, the assured flows' table (two per flow, dead ones included until the
    /// next sweep).
    pub ct_entries: u64,
    pub ct_capacity: u32,
    /// Entries of `CT_NEW`, the unassured flows' table (an LRU a flood churns), and its size.
    pub ct_new_entries: u64,
    pub ct_new_capacity: u32,
    /// Live flows (`FlowCount`), SNATed or not.
    pub flows: u64,
    pub snat_flows: u64,
    /// The most SNAT ports one (SNAT address, backend) pair holds for live flows that are
    /// not closed nor idle both ways for the reclaim bound (a closed, dead or long-idle
    /// flow's port goes to the next new flow that needs it): a new flow to that backend is
    /// dropped once this reaches the size of the SNAT port range.
    pub snat_ports_max: u64,
}

/// Counts the live flows of a walk of `CT`, as the datapath judges them: a flow is alive while
/// a packet of either direction came within its entry's timeout (the FORWARD entry, or the
/// entry at its partner key while that is still this flow's). Nothing removes a dead flow's entries but the need for room, so
/// a full table is the steady state; counting its entries would report a node that has been
/// busy once as busy for good, and its SNAT ports as nearly exhausted.
pub struct FlowCount {
    now_ns: u64,
    config: svc_common::DatapathConfig,
    flows: u64,
    snat_flows: u64,
    /// Per (SNAT address, backend address, backend port, protocol): as many entries as there
    /// are such pairs, not flows.
    ports: std::collections::HashMap<([u8; 16], [u8; 16], u16, u8), u64>,
    /// FORWARD entries past their timeout, with their partner key: alive if that entry is
    /// not, and leads back to them.
    stale: Vec<(svc_common::CtKey, svc_common::CtKey, svc_common::CtValue)>,
    /// REPLY entries within their timeout, to the FORWARD key they lead to.
    fresh_replies: std::collections::HashMap<svc_common::CtKey, svc_common::CtKey>,
    /// Live SNATed flows not closed (FORWARD key and entry): their ports are counted at the
    /// end, when both directions' last packets are known.
    snat_open: Vec<(svc_common::CtKey, svc_common::CtValue)>,
    /// SNATed REPLY entries: the FORWARD key they lead to and their last packet.
    snat_replies: std::collections::HashMap<svc_common::CtKey, (svc_common::CtKey, u64)>,
}

impl FlowCount {
    pub fn new(now_ns: u64, config: svc_common::DatapathConfig) -> Self {
        FlowCount {
            now_ns,
            config,
            flows: 0,
            snat_flows: 0,
            ports: Default::default(),
            stale: Default::default(),
            fresh_replies: Default::default(),
            snat_open: Default::default(),
            snat_replies: Default::default(),
        }
    }

    pub fn add(&mut self, k: &svc_common::CtKey, v: &svc_common::CtValue) {
        let timeout_ns = u64::from(svc_common::ct_timeout::seconds(
            &self.config,
            k.proto,
            v.flags,
        )) * 1_000_000_000;
        let fresh = self.now_ns.saturating_sub(v.last_seen_ns) <= timeout_ns;
        if k.dir == svc_common::ct_dir::REPLY && v.flags & svc_common::ct_flags::SNAT != 0 {
            self.snat_replies.insert(*k, (k.partner(v), v.last_seen_ns));
        }
        match (k.dir == svc_common::ct_dir::FORWARD, fresh) {
            (true, true) => self.live(k, v),
            (true, false) => self.stale.push((*k, k.partner(v), *v)),
            (false, true) => {
                self.fresh_replies.insert(*k, k.partner(v));
            }
            (false, false) => {}
        }
    }

    fn live(&mut self, k: &svc_common::CtKey, v: &svc_common::CtValue) {
        use svc_common::ct_flags;
        self.flows += 1;
        if v.flags & ct_flags::SNAT == 0 {
            return;
        }
        self.snat_flows += 1;
        // An unassured flow's port goes to a new flow that finds the range busy (from the
        // datapath's fifth try), as a closed one's: neither is a port in use.
        if !ct_flags::closed(v.flags) && v.flags & ct_flags::UNASSURED == 0 {
            self.snat_open.push((*k, *v));
        }
    }

    /// (flows, SNATed flows, the most SNAT ports in use towards one backend).
    pub fn finish(mut self) -> (u64, u64, u64) {
        let stale = std::mem::take(&mut self.stale);
        for (k, partner, v) in &stale {
            if self.fresh_replies.get(partner) == Some(k) {
                self.live(k, v);
            }
        }
        // A flow idle both ways for the reclaim bound gives its port to a new flow that needs
        // it, as the datapath's SNAT search does.
        let bound =
            u64::from(svc_common::ct_timeout::snat_reclaim_idle_s(&self.config)) * 1_000_000_000;
        for (k, v) in std::mem::take(&mut self.snat_open) {
            let reply = self
                .snat_replies
                .get(&k.partner(&v))
                .filter(|(to, _)| *to == k)
                .map_or(0, |(_, seen)| *seen);
            if self.now_ns.saturating_sub(v.last_seen_ns.max(reply)) > bound {
                continue;
            }
            *self
                .ports
                .entry((v.snat_addr, v.nat_addr, v.nat_port_be, k.proto))
                .or_default() += 1;
        }
        let most = self.ports.values().copied().max().unwrap_or(0);
        (self.flows, self.snat_flows, most)
    }
}

/// Reads `DEV_STATS` and `CT` from the pins in `dir`: the whole CT map, in batches of a few
/// hundred KB (a full 262,144-entry map is about 25 MB to read, never held at once).
pub fn read_packet_stats(dir: &Path) -> Result<PacketStats> {
    use svc_common::{pkt_stat, CtKey, CtValue, DatapathConfig, DevStatKey};
    let mut out = PacketStats::default();
    let dev: aya::maps::PerCpuHashMap<MapData, DevStatKey, u64> =
        aya::maps::PerCpuHashMap::try_from(pinned(dir, map_names::DEV_STATS)?)
            .map_err(|e| load_err(map_names::DEV_STATS, e))?;
    for entry in dev.iter() {
        let (k, per_cpu) = entry.map_err(|e| load_err(map_names::DEV_STATS, e))?;
        let name = pkt_stat::NAMES
            .get(k.reason as usize)
            .copied()
            .unwrap_or("unknown");
        out.devices.push((k.ifindex, name, per_cpu.iter().sum()));
    }
    out.devices.sort();
    let ct =
        MapData::from_pin(map_pin(dir, map_names::CT)).map_err(|e| load_err(map_names::CT, e))?;
    out.ct_capacity = ct
        .info()
        .map_err(|e| load_err(map_names::CT, e))?
        .max_entries();
    // The timeouts the datapath judges by; the built-in ones when the agent wrote none.
    let config: Array<MapData, DatapathConfig> = Array::try_from(pinned(dir, map_names::CONFIG)?)
        .map_err(|e| load_err(map_names::CONFIG, e))?;
    let config = config.get(&0, 0).unwrap_or_default();
    let mut count = FlowCount::new(sys::coarse_now_ns(), config);
    sys::for_each_hash::<CtKey, CtValue>(ct.fd().as_fd(), |k, v| {
        out.ct_entries += 1;
        count.add(k, v);
    })
    .map_err(|e| load_err(map_names::CT, e))?;
    // Absent where an older agent's datapath serves (one table of every flow).
    if let Ok(new) = MapData::from_pin(map_pin(dir, map_names::CT_NEW)) {
        out.ct_new_capacity = new
            .info()
            .map_err(|e| load_err(map_names::CT_NEW, e))?
            .max_entries();
        sys::for_each_hash::<CtKey, CtValue>(new.fd().as_fd(), |k, v| {
            out.ct_new_entries += 1;
            count.add(k, v);
        })
        .map_err(|e| load_err(map_names::CT_NEW, e))?;
    }
    (out.flows, out.snat_flows, out.snat_ports_max) = count.finish();
    Ok(out)
}

pub fn read_stats(dir: &Path) -> Result<Vec<(&'static str, u64)>> {
    let stats: PerCpuArray<MapData, u64> = PerCpuArray::try_from(pinned(dir, map_names::STATS)?)
        .map_err(|e| load_err(map_names::STATS, e))?;
    crate::store::stat_totals(&stats)
}

#[cfg(test)]
mod tests {
    use super::FlowCount;
    use svc_common::{ct_dir, ct_flags, CtKey, CtValue, DatapathConfig, IPPROTO_TCP, IPPROTO_UDP};

    const S: u64 = 1_000_000_000;

    fn a(last: u8) -> [u8; 16] {
        let mut x = [0u8; 16];
        x[10] = 0xff;
        x[11] = 0xff;
        x[12..].copy_from_slice(&[198, 51, 100, last]);
        x
    }

    /// A flow from client port `port` to a remote backend, SNATed to the node's port
    /// `snat_port`, its two entries last seen at `fwd_s` and `rep_s` (seconds).
    fn flow(
        proto: u8,
        port: u16,
        snat_port: u16,
        flags: u16,
        fwd_s: u64,
        rep_s: u64,
    ) -> [(CtKey, CtValue); 2] {
        let forward = CtKey {
            saddr: a(7),
            daddr: a(1),
            sport_be: port.to_be(),
            dport_be: 30080u16.to_be(),
            proto,
            dir: ct_dir::FORWARD,
            _pad0: [0; 2],
        };
        let v = CtValue {
            nat_addr: a(20),
            nat_port_be: 8080u16.to_be(),
            snat_addr: a(1),
            snat_port_be: snat_port.to_be(),
            flags: ct_flags::SNAT | flags,
            last_seen_ns: fwd_s * S,
            ..Default::default()
        };
        let reply = forward.partner(&v);
        let rv = CtValue {
            nat_addr: a(1),
            nat_port_be: 30080u16.to_be(),
            snat_addr: a(7),
            snat_port_be: port.to_be(),
            last_seen_ns: rep_s * S,
            ..v
        };
        assert_eq!(reply.partner(&rv), forward);
        [(forward, v), (reply, rv)]
    }

    /// What `/metrics` reports of a full table: only the flows the datapath takes for alive
    /// (either direction within its timeout), and of their SNAT ports only those of flows not
    /// closed. Before, every FORWARD entry counted, dead or not: a node busy once showed its
    /// SNAT ports in use, towards exhaustion, for good.
    #[test]
    fn flows_and_snat_ports_count_only_live_flows() {
        let now = 100_000;
        // Older than established TCP's timeout.
        let stale = u64::from(svc_common::ct_timeout::TCP_ESTABLISHED_S) + 100;
        let closed = ct_flags::FIN | ct_flags::FIN_FORWARD | ct_flags::FIN_REPLY;
        let entries = [
            // Established TCP, both fresh.
            flow(
                IPPROTO_TCP,
                40001,
                61001,
                ct_flags::SEEN_REPLY,
                now - 5,
                now - 5,
            ),
            // A download's tail: only the reply direction speaks.
            flow(
                IPPROTO_TCP,
                40002,
                61002,
                ct_flags::SEEN_REPLY,
                now - stale,
                now - 1,
            ),
            // Closed a moment ago: alive for its closing timeout, its port reclaimable.
            flow(IPPROTO_TCP, 40003, 61003, closed, now - 1, now - 1),
            // Dead: UDP silent for longer than its timeout, TCP for longer than its established timeout.
            flow(IPPROTO_UDP, 40004, 61004, 0, now - 3_600, now - 3_600),
            flow(
                IPPROTO_TCP,
                40005,
                61005,
                ct_flags::SEEN_REPLY,
                now - stale,
                now - stale,
            ),
        ];
        // Alive (established TCP lives 24 h idle), but idle both ways past the SNAT reclaim
        // bound: its port is not counted in use.
        let idle = u64::from(svc_common::ct_timeout::SNAT_RECLAIM_IDLE_S) + 60;
        let long_idle = flow(
            IPPROTO_TCP,
            40007,
            61007,
            ct_flags::SEEN_REPLY,
            now - idle,
            now - idle,
        );
        // Dead, its reply tuple taken by the first flow (the same SNAT port): that flow's
        // freshness is not its own.
        let [old, _] = flow(
            IPPROTO_TCP,
            40006,
            61001,
            ct_flags::SEEN_REPLY,
            now - stale,
            0,
        );
        let mut count = FlowCount::new(now * S, DatapathConfig::default());
        for (k, v) in entries
            .iter()
            .flatten()
            .chain([old].iter())
            .chain(&long_idle)
        {
            count.add(k, v);
        }
        assert_eq!(count.finish(), (4, 4, 2));
    }

    /// An unassured flow (a spoofed SYN the backend answered, never acknowledged) is a live
    /// flow, but its SNAT port is not in use: a new flow takes it. Before, a flood of spoofed
    /// SYNs showed the range as nearly exhausted.
    #[test]
    fn snat_ports_in_use_leave_unassured_flows_out() {
        let now = 100_000;
        let assured = flow(
            IPPROTO_TCP,
            40001,
            61001,
            ct_flags::SEEN_REPLY,
            now - 1,
            now - 1,
        );
        let spoofed = flow(
            IPPROTO_TCP,
            40002,
            61002,
            ct_flags::SEEN_REPLY | ct_flags::UNASSURED,
            now - 1,
            now - 1,
        );
        let mut count = FlowCount::new(now * S, DatapathConfig::default());
        for (k, v) in assured.iter().chain(&spoofed) {
            count.add(k, v);
        }
        assert_eq!(count.finish(), (2, 2, 1));
    }
}
