//! Loading, attaching, adopting, guarding and removing the kernel programs and their pinned
//! maps.
//!
//! Layout under the bpffs directory (default /sys/fs/bpf/svc), which the agent creates itself
//! (0700, owned by the agent's user) and refuses when anyone else could write to it:
//! - one pinned map per pinned entry of `svc_common::catalogue`, as `NAME_v<version>`;
//! - `link_<program>`: one pinned bpf link per cgroup hook;
//! - `link_tc_<program>_<ifname>`: one pinned tcx link per tc program and device (tcx mode). In
//!   classic mode (`--tc-attach`, kernels before 6.6) the tc programs hang on cls_bpf filters at
//!   a fixed priority and handle (`tc_classic.rs`), which nothing pins: the kernel is their
//!   record.
//!
//! One agent owns a directory at a time: it holds an exclusive flock on it for as long as it
//! runs (the kernel drops it when the process dies, however it dies). A second agent, or an
//! `uninstall`, refuses while the owner lives.
//!
//! Links are pinned so the datapath outlives the agent: a stopped agent leaves connections
//! working, and a new one swaps its programs into the existing links (BPF_LINK_UPDATE), so a
//! cgroup is never without its hooks. A new agent attaches only after its first sync, so the
//! programs it swaps in never see maps that are still being filled. On a cold start the socket
//! programs go on first, the tc and XDP programs once the kernel has verified them
//! (docs/design/architecture.md, "Startup: what overlaps").

mod cgroup;
mod load;
mod lock;
mod migrate;
mod pins;
mod repair;
mod stats;
mod tc;
mod tc_classic;
mod uninstall;
mod xdp;

pub use load::open_pinned;
pub use pins::map_pin;
pub use stats::{
    counters_of, decision_totals, read_packet_stats, read_service_stats, read_stats, FlowCount,
    PacketStats, ServiceCounts,
};
pub use tc::{tc_attachments, tc_link_pin, TcAttach, TcAttachment, TcMode};
pub use uninstall::{uninstall, Uninstalled};
pub use xdp::{xdp_listing, xdp_pins, XdpMode, TC_MODE, XDP_PROGRAM};

use std::fs::File;
use std::path::{Path, PathBuf};

use aya::programs::TcAttachType;

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

fn load_err(what: impl std::fmt::Display, e: impl Into<Box<dyn std::error::Error>>) -> Error {
    // aya's errors keep the errno in their source chain; the top message alone hides it.
    let e = e.into();
    let mut msg = format!("{what}: {e}");
    let errno_of = |s: &(dyn std::error::Error + 'static)| {
        s.downcast_ref::<std::io::Error>()
            .and_then(|io| io.raw_os_error())
            .map(crate::error::Errno)
    };
    let mut errno = errno_of(e.as_ref());
    let mut cur = e.source();
    while let Some(s) = cur {
        msg.push_str(&format!(": {s}"));
        errno = errno.or(errno_of(s));
        cur = s.source();
    }
    Error::Load {
        message: msg,
        errno,
    }
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The loaded programs and maps of one agent, and the directory it owns.
pub struct Datapath {
    dir: PathBuf,
    /// The open directory; holding it holds the lock.
    lock: File,
    dir_ino: u64,
    /// Reached through `ebpf()`, which waits for the end of the programs' verification.
    programs: load::Programs,
    /// True once that verification has ended (`programs_verified`).
    verified: tokio::sync::watch::Receiver<bool>,
    /// The socket programs' descriptors, from the verifying thread (`Sockets::wait`).
    sockets: load::Sockets,
    pub store: BpfStore,
    cgroup: PathBuf,
    cgroup_id: u64,
    /// The socket programs are attached (`attach_sockets`).
    attached: bool,
    /// The rest is too, the tc and XDP programs, and the resized maps have taken their pins
    /// (`attach`).
    packet_attached: bool,
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
    /// `--xdp-mode`, given to `open`.
    xdp_mode: XdpMode,
    /// Whether the mode asks for XDP and the object has the program: loaded with the tc
    /// programs, or refused by the kernel (then unloaded, every device left to tc).
    xdp_loaded: bool,
    /// XDP link pins this agent has attached or swapped its program into.
    xdp_current: std::collections::BTreeSet<PathBuf>,
    /// Devices with a native XDP link that do not take redirected XDP frames (warned about
    /// once each): not redirect targets.
    xdp_no_xmit: std::collections::BTreeSet<u32>,
    /// Devices whose driver refused native XDP (warned about once each): left to tc, not
    /// tried again before the next start.
    xdp_refused: xdp::Refused,
    /// How the tc programs attach (`set_tc_attach`; by default tcx where the kernel has it).
    tc_mode: TcMode,
    /// Whether the kernel has tcx, asked once at `open`.
    kernel_tcx: bool,
    /// svc's classic filters (program, device) in this namespace: found at the first attach,
    /// then as this agent makes and removes them. None until that first look.
    tc_classic: Option<std::collections::BTreeSet<(&'static str, String)>>,
    /// The connection-tracking sweep, once loaded (`ct_sweep`).
    sweep: Option<std::os::fd::OwnedFd>,
}

impl Datapath {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `open` and `attach` at once (XDP off), for tools that program the maps themselves:
    /// with the fallbacks of the running kernel (`features::check`).
    pub fn open_attached(dir: &Path, cgroup: &Path, capacity: Capacity) -> Result<Datapath> {
        let kernel = crate::features::check(&crate::features::Kernel {
            cgroup: Some(cgroup),
        })
        .fit();
        let mut dp = Datapath::open(dir, cgroup, capacity, kernel, XdpMode::Off)?;
        dp.attach()?;
        Ok(dp)
    }
}

#[cfg(test)]
mod tests {
    use aya_obj::EbpfSectionKind;
    use svc_common::catalogue;

    /// The kernel's `#[btf_map]` statics (svc-ebpf) and svc-common's catalogue agree: every map
    /// of the object is in the catalogue, and every catalogue entry is in the object with its
    /// type, key and value sizes, flags and max_entries (for the maps the agent sizes, the
    /// default). A map added on one side only fails here, by name.
    #[test]
    fn catalogue_matches_the_object() {
        let obj = aya_obj::Object::parse(super::OBJECT).expect("the embedded object parses");
        let mut problems = Vec::new();
        let mut checked = 0;
        let mut names: Vec<&String> = obj.maps.keys().collect();
        names.sort();
        for name in names {
            let map = &obj.maps[name];
            if !matches!(
                map.section_kind(),
                EbpfSectionKind::BtfMaps | EbpfSectionKind::Maps
            ) {
                continue;
            }
            let Some(def) = catalogue::find(name) else {
                problems.push(format!("{name}: in the object, not in the catalogue"));
                continue;
            };
            let mut check = |what: &str, object: u32, catalogue: u32| {
                if object != catalogue {
                    problems.push(format!(
                        "{name}: {what} {object} in the object, {catalogue} in the catalogue"
                    ));
                }
            };
            checked += 1;
            check("map type", map.map_type(), def.kind.bpf_type());
            if !def.kernel_only {
                check("key size", map.key_size(), def.key_size);
                check("value size", map.value_size(), def.value_size);
                check("flags", map.map_flags(), def.flags);
                check("max_entries", map.max_entries(), def.max_entries);
            }
        }
        for def in catalogue::MAPS {
            if !obj.maps.contains_key(def.name) {
                problems.push(format!("{}: in the catalogue, not in the object", def.name));
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        assert_eq!(checked, catalogue::MAPS.len(), "every map compared");
    }
}
