//! What the running kernel lacks of what svc loads, found at start: each missing feature is
//! named with the part of svc that needs it and the Linux release that brought it, in one
//! error (or a warning where svc has a fallback), instead of a verifier or loader error deep in
//! a load. The list follows what svc-ebpf uses; README "Kernel requirements" says the same.
//!
//! Two helpers have fallbacks chosen at load time (`Fit`): without `bpf_set_retval` a refused
//! connect() fails with EPERM, without `bpf_xdp_load_bytes` the XDP program is not loaded.
//! The programs learn the first from a constant the loader sets (svc-common
//! `kernel_globals`; svc-ebpf kernel.rs; docs/design/packet-datapath.md, "Kernels before
//! 5.18").
//!
//! `--kernel-as 5.15` or `SVC_KERNEL_AS=5.15` (a testing aid, README "Kernel requirements")
//! makes the check report everything that came after that release missing, so the fallbacks
//! run on a newer kernel.

use std::fmt;
use std::os::fd::AsFd;
use std::path::Path;

use aya::maps::MapType;
use aya::programs::ProgramType;
use aya::sys::BpfHelper;

/// A part of svc, as the operator knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Every map of the object is created when it is loaded, whatever runs.
    Object,
    /// The cgroup hooks: ClusterIPs (and NodePorts) for the node's and its pods' sockets.
    SocketHooks,
    /// The tc programs: NodePorts, ExternalIPs, LoadBalancer IPs from outside. They are
    /// loaded at start even with `--devices none`.
    PacketDatapath,
    /// The XDP program, loaded under `--xdp-mode native|generic` unless the kernel lacks what
    /// it needs.
    Xdp,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Part::Object => "the eBPF object (its maps are created at load)",
            Part::SocketHooks => "the socket hooks (ClusterIP for the node's and pods' sockets)",
            Part::PacketDatapath => {
                "the packet datapath (NodePort, ExternalIP, LoadBalancer from outside)"
            }
            Part::Xdp => "the XDP program (--xdp-mode)",
        })
    }
}

/// One thing svc needs of the kernel.
#[derive(Clone, Copy, Debug)]
pub enum Feature {
    Program(ProgramType, &'static str),
    Map(MapType, &'static str),
    /// A helper, from programs of a type.
    Helper(ProgramType, BpfHelper, &'static str),
    /// A cgroup attach point (enum bpf_attach_type), asked with BPF_PROG_QUERY on the cgroup.
    CgroupHook(u32, &'static str),
    /// tcx (BPF_TCX_INGRESS/EGRESS).
    Tcx,
}

/// A feature, who needs it, since when, and what svc does without it.
#[derive(Clone, Copy, Debug)]
pub struct Need {
    pub feature: Feature,
    pub part: Part,
    /// The Linux release that brought it.
    pub since: &'static str,
    /// What svc does instead; None: it cannot run that part.
    pub fallback: Option<&'static str>,
}

impl Need {
    pub fn name(&self) -> String {
        match self.feature {
            Feature::Program(_, n) => format!("{n} programs"),
            Feature::Map(_, n) => format!("{n} maps"),
            Feature::Helper(_, h, from) => format!(
                "helper bpf_{} in {from} programs",
                format!("{h:?}").trim_start_matches("BPF_FUNC_")
            ),
            Feature::CgroupHook(_, n) => format!("cgroup hook {n}"),
            Feature::Tcx => "tcx".to_string(),
        }
    }
}

const SOCK_ADDR: ProgramType = ProgramType::CgroupSockAddr;
const SOCK: ProgramType = ProgramType::CgroupSock;
const TC: ProgramType = ProgramType::SchedClassifier;

/// Without bpf_set_retval.
const NO_SET_RETVAL: &str = "a connect() or sendmsg() svc refuses (a Service without ready \
     endpoints, a port it does not define) fails with EPERM (\"Operation not permitted\"), not \
     ECONNREFUSED";
/// Without a feature of the XDP program alone.
const NO_XDP: &str = "the XDP program is not loaded: --xdp-mode native or generic runs as \
     off, and tc serves every device";

/// What svc-ebpf uses that a kernel may lack, by part. Helpers every kernel with the program
/// type has (map lookups, bpf_redirect, the checksum helpers, bpf_skb_load_bytes) are left
/// out; so is BTF in the kernel (no CO-RE: the object's own BTF describes its maps).
pub fn needs() -> Vec<Need> {
    use BpfHelper as H;
    let need = |feature, part, since| Need {
        feature,
        part,
        since,
        fallback: None,
    };
    let mut out = vec![
        need(Feature::Map(MapType::Hash, "hash"), Part::Object, "3.19"),
        need(Feature::Map(MapType::Array, "array"), Part::Object, "3.19"),
        need(
            Feature::Map(MapType::PerCpuHash, "per-CPU hash"),
            Part::Object,
            "4.6",
        ),
        need(
            Feature::Map(MapType::PerCpuArray, "per-CPU array"),
            Part::Object,
            "4.6",
        ),
        need(
            Feature::Map(MapType::LruHash, "LRU hash"),
            Part::Object,
            "4.10",
        ),
        need(
            Feature::Map(MapType::LpmTrie, "LPM trie"),
            Part::Object,
            "4.11",
        ),
        need(
            Feature::Map(MapType::SkStorage, "socket storage"),
            Part::Object,
            "5.2",
        ),
        // `svc-agent monitor`'s rings (SVC_MON_RING_0 ...).
        need(
            Feature::Map(MapType::RingBuf, "ring buffer"),
            Part::Object,
            "5.8",
        ),
        need(
            Feature::Program(SOCK_ADDR, "cgroup sock_addr"),
            Part::SocketHooks,
            "4.17",
        ),
        need(
            Feature::Program(SOCK, "cgroup sock"),
            Part::SocketHooks,
            "4.10",
        ),
    ];
    for (attach_type, name) in crate::sys::ATTACH_POINTS {
        let since = match name {
            "connect4" | "connect6" => "4.17",
            "sendmsg4" | "sendmsg6" => "4.18",
            "recvmsg4" | "recvmsg6" => "5.2",
            "getpeername4" | "getpeername6" => "5.8",
            _ => "5.9",
        };
        out.push(need(
            Feature::CgroupHook(attach_type, name),
            Part::SocketHooks,
            since,
        ));
    }
    out.push(Need {
        feature: Feature::Helper(SOCK_ADDR, H::BPF_FUNC_set_retval, "cgroup sock_addr"),
        part: Part::SocketHooks,
        since: "5.18",
        fallback: Some(NO_SET_RETVAL),
    });
    for (h, since) in [
        (H::BPF_FUNC_get_netns_cookie, "5.7"),
        (H::BPF_FUNC_get_socket_cookie, "4.12"),
        (H::BPF_FUNC_ktime_get_coarse_ns, "5.11"),
        (H::BPF_FUNC_sk_storage_get, "5.2"),
        (H::BPF_FUNC_ringbuf_output, "5.8"),
    ] {
        out.push(need(
            Feature::Helper(SOCK_ADDR, h, "cgroup sock_addr"),
            Part::SocketHooks,
            since,
        ));
    }
    out.push(need(
        Feature::Helper(SOCK, H::BPF_FUNC_sk_storage_get, "cgroup sock"),
        Part::SocketHooks,
        "5.2",
    ));
    out.push(need(
        Feature::Program(TC, "sched_cls (tc)"),
        Part::PacketDatapath,
        "4.1",
    ));
    for (h, since) in [
        (H::BPF_FUNC_fib_lookup, "4.18"),
        (H::BPF_FUNC_csum_level, "5.8"),
        (H::BPF_FUNC_redirect_neigh, "5.10"),
        (H::BPF_FUNC_ktime_get_coarse_ns, "5.11"),
        (H::BPF_FUNC_ringbuf_output, "5.8"),
    ] {
        out.push(need(
            Feature::Helper(TC, h, "sched_cls"),
            Part::PacketDatapath,
            since,
        ));
    }
    // The XDP program, where `--xdp-mode` asks for it and the kernel has what it needs.
    out.push(Need {
        feature: Feature::Program(ProgramType::Xdp, "xdp"),
        part: Part::Xdp,
        since: "4.8",
        fallback: Some(NO_XDP),
    });
    for (h, since, fallback) in [
        (H::BPF_FUNC_xdp_load_bytes, "5.18", NO_XDP),
        (H::BPF_FUNC_fib_lookup, "4.18", NO_XDP),
        (H::BPF_FUNC_ktime_get_coarse_ns, "5.11", NO_XDP),
        (H::BPF_FUNC_ringbuf_output, "5.8", NO_XDP),
    ] {
        out.push(Need {
            feature: Feature::Helper(ProgramType::Xdp, h, "xdp"),
            part: Part::Xdp,
            since,
            fallback: Some(fallback),
        });
    }
    out.push(Need {
        feature: Feature::Tcx,
        part: Part::PacketDatapath,
        since: "6.6",
        fallback: Some("the tc programs attach the classic way (clsact qdisc, cls_bpf filters)"),
    });
    // The connection-tracking sweep's callback (BPF_PSEUDO_FUNC, for bpf_for_each_map_elem)
    // came in 5.13 with that helper. The sweep is loaded after the attach, and a refusal
    // there only leaves dead flows until evicted; the tc programs themselves hold no callback
    // since the SNAT search stopped using bpf_loop, and would load on 5.12. 5.13 is asked for
    // all the same: a packet datapath whose connection table is never swept fills it with
    // dead flows until new ones evict live ones. It also covers the socket hooks' atomic AND
    // of the monitor's summary word (5.12).
    out.push(need(
        Feature::Helper(TC, H::BPF_FUNC_for_each_map_elem, "sched_cls"),
        Part::PacketDatapath,
        "5.13",
    ));
    out
}

/// Asks the kernel. A probe that cannot tell (no permission) is an error.
pub trait Probe {
    fn has(&self, feature: Feature) -> std::io::Result<bool>;
}

/// The running kernel; cgroup hooks are asked on `cgroup` (read only: BPF_PROG_QUERY).
pub struct Kernel<'a> {
    pub cgroup: Option<&'a Path>,
}

/// The release the agent's hidden `--kernel-as` named (`assume_release`).
static ASSUMED: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();

/// The release `--kernel-as` or else `SVC_KERNEL_AS` names (`5.15`), if any: the check then
/// reports everything that came after it missing. A testing aid: it only ever takes
/// features away.
pub fn kernel_as() -> Option<(u32, u32)> {
    if let Some(r) = ASSUMED.get() {
        return Some(*r);
    }
    release(&std::env::var(KERNEL_AS).ok()?)
}

/// Takes the kernel for `s` (`5.15`) from now on (`kernel_as`); an error for anything but a
/// release.
pub fn assume_release(s: &str) -> std::result::Result<(), String> {
    let r = release(s).ok_or_else(|| format!("{s:?} is not a release such as 5.15"))?;
    let _ = ASSUMED.set(r);
    Ok(())
}

/// The variable `kernel_as` reads.
pub const KERNEL_AS: &str = "SVC_KERNEL_AS";

/// `5.15` → (5, 15); None for anything else.
fn release(s: &str) -> Option<(u32, u32)> {
    let (major, minor) = s.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// A kernel taken to have what came up to a release (major, minor), and nothing after it.
pub struct AsOf(pub (u32, u32));

impl Probe for AsOf {
    fn has(&self, feature: Feature) -> std::io::Result<bool> {
        Ok(!needs().iter().any(|n| {
            same(n.feature, feature) && release(n.since).is_some_and(|since| since > self.0)
        }))
    }
}

/// Whether `kernel_as` takes `feature` away.
fn taken_away(feature: Feature) -> bool {
    kernel_as().is_some_and(|r| !AsOf(r).has(feature).unwrap_or(true))
}

impl Probe for Kernel<'_> {
    fn has(&self, feature: Feature) -> std::io::Result<bool> {
        if taken_away(feature) {
            return Ok(false);
        }
        #[cfg(feature = "failpoints")]
        {
            let name = Need {
                feature,
                part: Part::Object,
                since: "",
                fallback: None,
            }
            .name();
            if let Some(Some(lacks)) = fail::eval(crate::fault::KERNEL_LACKS, |v| v) {
                if name.contains(&lacks) {
                    return Ok(false);
                }
            }
        }
        let other = |e: &dyn fmt::Display| std::io::Error::other(e.to_string());
        match feature {
            Feature::Program(t, _) => aya::sys::is_program_supported(t).map_err(|e| other(&e)),
            Feature::Map(t, _) => aya::sys::is_map_supported(t).map_err(|e| other(&e)),
            Feature::Helper(t, h, _) => aya::sys::is_helper_supported(t, h).map_err(|e| other(&e)),
            Feature::CgroupHook(attach_type, _) => {
                let Some(cg) = self.cgroup else {
                    return Ok(true);
                };
                let f = std::fs::File::open(cg)?;
                match crate::sys::attached_programs(f.as_fd(), attach_type) {
                    Ok(_) => Ok(true),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
                    Err(e) => Err(e),
                }
            }
            Feature::Tcx => crate::sys::has_tcx(),
        }
    }
}

/// Whether two features are one (a feature is a plain value, without `PartialEq` for aya's
/// types).
fn same(a: Feature, b: Feature) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

/// Whether the running kernel has tcx, as the check sees it (`SVC_KERNEL_AS` included).
pub fn has_tcx() -> std::io::Result<bool> {
    if taken_away(Feature::Tcx) {
        return Ok(false);
    }
    crate::sys::has_tcx()
}

/// What the programs are told of the kernel at load (svc-common `kernel_globals`), and whether
/// the XDP program is loaded: each false is a fallback the check warned about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fit {
    /// `bpf_set_retval`: a refused connect() fails with ECONNREFUSED, else EPERM.
    pub set_retval: bool,
    /// The XDP program is loaded (the kernel has all it needs).
    pub xdp: bool,
}

impl Fit {
    /// What `SVC_KERNEL_AS` leaves of a kernel taken to have everything, without asking the
    /// running one: the fallbacks the packet fixtures load the object with (svc-ebpf-tests).
    pub fn of_kernel_as() -> Fit {
        match kernel_as() {
            Some(r) => check(&AsOf(r)).fit(),
            None => Fit::ALL,
        }
    }

    /// A kernel with everything.
    pub const ALL: Fit = Fit {
        set_retval: true,
        xdp: true,
    };

    /// The `.rodata` constants for the loader, by name (`EbpfLoader::set_global`).
    pub fn globals(&self) -> [(&'static str, u32); 1] {
        [(
            svc_common::kernel_globals::SET_RETVAL,
            self.set_retval as u32,
        )]
    }
}

/// What the check found.
#[derive(Debug, Default)]
pub struct Report {
    /// Needed and missing, with no fallback.
    pub missing: Vec<Need>,
    /// Missing, with a fallback.
    pub degraded: Vec<Need>,
    /// Could not be asked: the load will tell.
    pub unknown: Vec<(Need, String)>,
}

/// Asks `probe` for everything svc needs.
pub fn check(probe: &dyn Probe) -> Report {
    let mut r = Report::default();
    for need in needs() {
        match probe.has(need.feature) {
            Ok(true) => {}
            Ok(false) if need.fallback.is_some() => r.degraded.push(need),
            Ok(false) => r.missing.push(need),
            Err(e) => r.unknown.push((need, e.to_string())),
        }
    }
    r
}

impl Report {
    /// The fallbacks the programs are loaded with.
    pub fn fit(&self) -> Fit {
        let lacks = |pred: &dyn Fn(&Need) -> bool| self.degraded.iter().any(pred);
        let helper = |want: BpfHelper| move |n: &Need| matches!(n.feature, Feature::Helper(_, h, _) if h as u32 == want as u32);
        Fit {
            set_retval: !lacks(&helper(BpfHelper::BPF_FUNC_set_retval)),
            xdp: !lacks(&|n| n.fallback == Some(NO_XDP)),
        }
    }

    /// One error naming every missing feature and the part that needs it; None when nothing
    /// needed is missing.
    pub fn error(&self) -> Option<String> {
        if self.missing.is_empty() {
            return None;
        }
        let items: Vec<String> = self
            .missing
            .iter()
            .map(|n| format!("{} (Linux {}), for {}", n.name(), n.since, n.part))
            .collect();
        Some(format!(
            "this kernel ({}) lacks what svc needs: {}. README \"Kernel requirements\" lists \
             the minimum release of each part",
            kernel_release(),
            items.join("; ")
        ))
    }

    /// A line per missing feature svc does without, and per feature it could not ask about.
    pub fn warnings(&self) -> Vec<String> {
        self.degraded
            .iter()
            .map(|n| {
                format!(
                    "this kernel lacks {} (Linux {}), for {}: {}",
                    n.name(),
                    n.since,
                    n.part,
                    n.fallback.unwrap_or_default()
                )
            })
            .chain(self.unknown.iter().map(|(n, e)| {
                format!(
                    "could not ask the kernel for {} ({}): {e}",
                    n.name(),
                    n.part
                )
            }))
            .collect()
    }
}

/// `uname -r`.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown release".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports `missing` (by name) absent, everything else present.
    struct Without(&'static [&'static str]);

    impl Probe for Without {
        fn has(&self, feature: Feature) -> std::io::Result<bool> {
            let name = Need {
                feature,
                part: Part::Object,
                since: "",
                fallback: None,
            }
            .name();
            Ok(!self.0.iter().any(|m| name.contains(m)))
        }
    }

    #[test]
    fn a_missing_helper_is_named_with_the_part_that_needs_it() {
        let r = check(&Without(&["bpf_redirect_neigh", "getpeername4"]));
        let e = r.error().expect("an error");
        assert!(
            e.contains(
                "helper bpf_redirect_neigh in sched_cls programs (Linux 5.10), for the packet \
                 datapath"
            ),
            "{e}"
        );
        assert!(
            e.contains("cgroup hook getpeername4 (Linux 5.8), for the socket hooks"),
            "{e}"
        );
        assert!(r.warnings().is_empty(), "{:?}", r.warnings());
    }

    /// Ubuntu 22.04's GA kernel: svc runs, each of the two helpers it lacks named once with
    /// what svc does without it, and the programs told (`Fit`).
    #[test]
    fn linux_5_15_runs_with_named_fallbacks() {
        let r = check(&AsOf((5, 15)));
        assert_eq!(r.error(), None);
        assert_eq!(
            r.fit(),
            Fit {
                set_retval: false,
                xdp: false,
            }
        );
        let w = r.warnings();
        let about = |what: &str| w.iter().filter(|l| l.contains(what)).count();
        assert_eq!(about("bpf_set_retval"), 1, "{w:#?}");
        assert_eq!(about("bpf_xdp_load_bytes"), 1, "{w:#?}");
        assert_eq!(about("lacks tcx"), 1, "{w:#?}");
        assert_eq!(w.len(), 3, "{w:#?}");
        let all = w.join("\n");
        assert!(
            all.contains("bpf_set_retval in cgroup sock_addr programs (Linux 5.18)")
                && all.contains("fails with EPERM"),
            "{all}"
        );
        assert!(
            all.contains("bpf_xdp_load_bytes in xdp programs (Linux 5.18), for the XDP program")
                && all.contains("--xdp-mode native or generic runs as off"),
            "{all}"
        );
    }

    /// Both helpers came in 5.18: 5.17 has the fallbacks of 5.15 (bpf_loop, 5.17, is not
    /// needed: the SNAT search's tries are calls of a global function on every kernel).
    #[test]
    fn linux_5_18_has_both_helpers_5_17_neither() {
        let fit = check(&AsOf((5, 17))).fit();
        assert_eq!(
            fit,
            Fit {
                set_retval: false,
                xdp: false,
            }
        );
        assert_eq!(fit.globals(), [("SVC_KERNEL_SET_RETVAL", 0)]);
        assert_eq!(check(&AsOf((5, 18))).fit(), Fit::ALL);
        assert_eq!(check(&Without(&[])).fit(), Fit::ALL);
    }

    /// Below 5.15 a part without fallback goes: the start refuses, naming it.
    #[test]
    fn linux_5_10_is_refused_naming_what_it_lacks() {
        let e = check(&AsOf((5, 10))).error().expect("an error");
        assert!(e.contains("bpf_ktime_get_coarse_ns"), "{e}");
        assert!(!e.contains("bpf_set_retval"), "{e}");
    }

    /// A kernel with the XDP helpers but without bpf_set_retval (a backport) loads XDP,
    /// and the other way round.
    #[test]
    fn xdp_goes_only_for_its_own_helpers() {
        let fit = check(&Without(&["bpf_set_retval"])).fit();
        assert!(fit.xdp && !fit.set_retval, "{fit:?}");
        let fit = check(&Without(&["bpf_xdp_load_bytes"])).fit();
        assert!(!fit.xdp && fit.set_retval, "{fit:?}");
    }

    #[test]
    fn releases_compare_as_numbers() {
        assert_eq!(release("5.15"), Some((5, 15)));
        assert_eq!(release(" 6.1\n"), Some((6, 1)));
        assert!(release("5.9") < release("5.15"));
        assert_eq!(release("5"), None);
        assert_eq!(release("5.15-generic"), None);
        assert!(assume_release("jammy").is_err());
    }

    #[test]
    fn tcx_has_a_fallback_and_only_warns() {
        let r = check(&Without(&["tcx"]));
        assert_eq!(r.error(), None);
        let w = r.warnings().join("\n");
        assert!(
            w.contains("lacks tcx (Linux 6.6)") && w.contains("classic way"),
            "{w}"
        );
    }

    /// 5.12 has every helper but the callbacks' (5.13), which the sweep holds: refused at
    /// start, naming it, not deep in a load.
    #[test]
    fn linux_5_12_is_refused_for_the_callbacks() {
        let e = check(&AsOf((5, 12))).error().expect("an error");
        assert!(
            e.contains("helper bpf_for_each_map_elem in sched_cls programs (Linux 5.13)"),
            "{e}"
        );
        assert!(!e.contains("bpf_ktime_get_coarse_ns"), "{e}");
        assert_eq!(check(&AsOf((5, 13))).error(), None);
    }

    /// Helpers of the first kernels with the program types svc uses (4.18 at the latest),
    /// which need no check.
    const OLD_HELPERS: &[&str] = &[
        "skb_load_bytes",
        "skb_store_bytes",
        "redirect",
        "l3_csum_replace",
        "l4_csum_replace",
        "get_prandom_u32",
        "csum_diff",
        "skb_change_tail",
        "get_socket_cookie",
        "map_lookup_elem",
        "map_update_elem",
        "map_delete_elem",
        "ktime_get_ns",
    ];

    /// Every helper svc-ebpf calls is checked at start or is in `OLD_HELPERS`: a helper
    /// added to the kernel programs without a line in `needs` fails here, by name.
    #[test]
    fn every_helper_svc_ebpf_calls_is_checked_or_known_old() {
        let checked: Vec<String> = needs()
            .iter()
            .filter_map(|n| match n.feature {
                Feature::Helper(_, h, _) => {
                    Some(format!("{h:?}").trim_start_matches("BPF_FUNC_").to_string())
                }
                _ => None,
            })
            .collect();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../svc-ebpf/src");
        let mut called = std::collections::BTreeSet::new();
        for e in std::fs::read_dir(&dir).expect("svc-ebpf's sources") {
            let text = std::fs::read_to_string(e.expect("an entry").path()).expect("a source");
            for (i, _) in text.match_indices("bpf_") {
                let rest = &text[i + 4..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                let before = text[..i].chars().last().unwrap_or(' ');
                if rest[end..].starts_with('(')
                    && !(before.is_ascii_alphanumeric() || before == '_')
                {
                    called.insert(rest[..end].to_string());
                }
            }
        }
        assert!(
            called.contains("get_prandom_u32"),
            "the scan finds calls: {called:?}"
        );
        let unchecked: Vec<&String> = called
            .iter()
            .filter(|h| !checked.contains(h) && !OLD_HELPERS.contains(&h.as_str()))
            .collect();
        assert!(
            unchecked.is_empty(),
            "helpers svc-ebpf calls that the start check does not know: {unchecked:?}"
        );
    }

    /// The kernel these tests run on has all of it (root: the probes load programs).
    #[test]
    fn this_kernel_has_everything_svc_needs() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: the probes need root");
            return;
        }
        // Any cgroup v2 directory answers BPF_PROG_QUERY; the query changes nothing.
        let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
        let cgroup = mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.get(2) == Some(&"cgroup2"))
            .map(|f| std::path::PathBuf::from(f[1]));
        let r = check(&Kernel {
            cgroup: cgroup.as_deref(),
        });
        assert_eq!(r.error(), None);
        assert!(r.unknown.is_empty(), "{:?}", r.unknown);
        assert!(r.degraded.is_empty(), "{:?}", r.warnings());
    }
}
