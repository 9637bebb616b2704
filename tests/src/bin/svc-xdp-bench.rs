//! svc-xdp-bench: packets per second one receiving core forwards through a NodePort to a
//! remote backend, with svc's XDP program (native), with svc's tc programs, and with no
//! translation (plain forwarding), in one interleaved run (issue 35, docs/design/xdp.md).
//!
//! The topology is two namespaces and one veth, so that the receiving core does node 1's work
//! and nothing else:
//!
//! ```text
//!  wire: gen0 10.77.0.100 (the client) and 10.77.0.2 (node 2) ── eth0 10.77.0.1: node 1
//! ```
//!
//! - The generator is the kernel's own (BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES, a
//!   program that writes one 64-byte UDP frame over its packet and answers XDP_TX) out of
//!   `gen0`, from a thread pinned to CPU 0. It must write the whole frame every time: live
//!   frames are pages of a pool recycled with what their last user left in them, and node 1
//!   forwards in place (its MAC rewrite, TTL, svc's NAT), so a frame sent as is would be the
//!   last one forwarded, addressed to gen0's MAC, and node 1 drop it before IP, uncounted (that
//!   lost two thirds of the frames of an earlier version). One flow: its first packet makes
//!   svc's connection-tracking entry, every other one is a known flow.
//! - Node 1 receives on `eth0` in NAPI mode (an XDP program, or GRO asked for, gives a veth
//!   its ring), with threaded NAPI, its thread pinned to CPU 1: everything node 1 does with a
//!   packet, translation and forwarding included, runs on that thread.
//! - Node 1 sends the translated packet to pod 2 (10.244.2.2), routed through node 2 back out
//!   of `eth0` (XDP_TX at XDP); `gen0` drops it in its driver (XDP_DROP), on CPU 0, and
//!   counts it (`ethtool -S`: xdp_drops). Neighbours are permanent: nothing else crosses.
//!
//! Setups: `none` (the frame goes to 10.244.2.2 itself: node 1 routes it), `svc-tc` (svc-agent
//! with `--devices eth0`, the frame to `10.77.0.1:nodePort`), `svc-xdp` (the same with
//! `--xdp-mode native`), and kube-proxy's (`svc_tests::kube_proxy`) in node 1's namespace:
//! `kube-proxy-iptables-nft` (`kube-proxy-iptables` for short), `kube-proxy-iptables-legacy`
//! and `kube-proxy-nftables`, the frame to the same NodePort. The agent reads the Services from
//! manifests; kube-proxy from a kube-apiserver holding the same objects (written straight into
//! etcd: `bulk::populate_via_etcd`) and the Nodes `node-1` (10.77.0.1) and `node-2`
//! (10.77.0.2), the endpoint's. Either proxy is stopped once it has programmed them (the agent:
//! ready, its pinned programs stay; kube-proxy: its first sync of both families, its rules
//! stay), and the datapath alone is measured. kube-proxy DNATs the frame to pod 2 in PREROUTING
//! and masquerades it in POSTROUTING (a NodePort of `externalTrafficPolicy: Cluster`), as svc
//! does: node 1's own address as its source, so pod 2's replies would come back through
//! node 1. Before the measures each setup must forward every frame it takes (a frame to the
//! NodePort that no rule translated would be node 1's own, answered at most by rate-limited
//! ICMP errors), and for kube-proxy node 1's conntrack must hold the flow translated both
//! ways. kube-proxy's rules live in node 1's namespace only; the machine's own firewall is
//! compared before and after (`HostFirewallGuard`). `--flows new` makes every frame a new UDP
//! flow (the generator counts flows in a map: source port and address change each frame);
//! before each such measure node 1's netfilter conntrack is flushed (see `World::measure`).
//!
//! Measured per setup, offered rate and round, from the devices' counters: the frames gen0
//! handed to node 1's ring (`tx_queue_0_xdp_xmit`), those the full ring refused, and those back
//! at gen0 (forwarded); every frame taken must come back (the table shows the ratio), and the
//! receiving thread's CPU time (schedstat) per frame forwarded. The generator offers more than
//! node 1 takes, yet the thread is not always busy: it sleeps when its ring is empty, and (likely)
//! the 256 frames of the ring fill before it is awake again. So frames forwarded a second are what
//! this wake-up rhythm allows, not the core's capacity; the core's cost per frame (with its
//! share of the wake-ups of bursts of up to 256 frames) is the figure to compare. A low offered
//! rate (`--rates`) checks the counting (offered = taken = forwarded), and prices a wake-up per
//! frame, not forwarding. Rounds rotate the order. Safety: everything happens in the
//! bench's namespaces, programs attach only to their devices, and the guards remove them on
//! any exit.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use svc_tests::bulk;
use svc_tests::control_plane::{Binaries, ControlPlane};
use svc_tests::interrupt;
use svc_tests::kube_proxy::{
    self, HostFirewallGuard, IptablesBackend, KubeProxy, KubeProxyConfig, Mode,
};
use svc_tests::netns::veth_pair;
use svc_tests::sandbox::AGENT_READY_TIMEOUT;
use svc_tests::xdp::{self, attach_native, bpf, ifindex, insn, put};
use svc_tests::{require_root, Agent, Bpffs, Manifests, NetNs, TestCgroup, Tools};

#[derive(Parser)]
struct Args {
    /// Service counts (NodePort Services; the measured one is the last).
    #[arg(long, value_delimiter = ',', default_value = "1,10000")]
    services: Vec<u32>,
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Seconds per measure.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Setups (none, svc-tc, svc-xdp), comma-separated; all by default.
    #[arg(long, value_delimiter = ',')]
    setups: Vec<String>,
    /// Offered rates, frames a second, comma-separated; 0 is as fast as the generator goes.
    /// Paced runs reach a few thousand frames a second at most (a test run of 32 frames takes
    /// milliseconds to set up): they check that every frame offered is forwarded and counted.
    #[arg(long, value_delimiter = ',', default_value = "0,20000")]
    rates: Vec<u64>,
    /// Flows (one: every frame of one flow, known after its first frame; new: every frame a
    /// new UDP flow, its own source address and port), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "one")]
    flows: Vec<String>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

const NODE1: &str = "10.77.0.1";
const NODE2: &str = "10.77.0.2";
const CLIENT: &str = "10.77.0.100";
const POD2: &str = "10.244.2.2";
const POD_PORT: u16 = 5353;
const CLIENT_PORT: u16 = 40000;
const NODE_PORT_BASE: u16 = 20000;
const NAMESPACE: &str = "bench";
const NODE: &str = "node-1";
const REMOTE_NODE: &str = "node-2";
const GEN_CPU: usize = 0;
const RX_CPU: usize = 1;
const GEN_PRIORITY: i32 = 10;
const RX_PRIORITY: i32 = 50;
const DROP_PRIORITY: i32 = 60;
/// kube-proxy's first sync of 10,000 Services took about a minute on iptables-nft here.
const SYNC_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    None,
    SvcTc,
    SvcXdp,
    KubeProxy(Mode),
}

impl Setup {
    const ALL: [Setup; 6] = [
        Setup::None,
        Setup::SvcTc,
        Setup::SvcXdp,
        Setup::KubeProxy(Mode::Iptables(IptablesBackend::Nft)),
        Setup::KubeProxy(Mode::Iptables(IptablesBackend::Legacy)),
        Setup::KubeProxy(Mode::Nftables),
    ];

    fn id(self) -> &'static str {
        match self {
            Setup::None => "none",
            Setup::SvcTc => "svc-tc",
            Setup::SvcXdp => "svc-xdp",
            Setup::KubeProxy(mode) => mode.id(),
        }
    }

    /// `kube-proxy-iptables` alone is iptables mode on iptables-nft, Debian's default.
    fn parse(id: &str) -> Option<Setup> {
        if id == "kube-proxy-iptables" {
            return Some(Setup::KubeProxy(Mode::Iptables(IptablesBackend::Nft)));
        }
        Setup::ALL.into_iter().find(|s| s.id() == id)
    }
}

/// The generator: writes `frame` (64 bytes) over the packet, then XDP_TX. The rewrite matters:
/// live frames come from a page pool whose pages are recycled with whatever the receivers
/// left in them (test_run.c resets the frame's pointers, never its data), and node 1 rewrites
/// the frame in place when it forwards it (MAC addresses, TTL, svc's NAT): unrewritten, the
/// next frame out of that page is addressed to gen0's MAC, and node 1's stack drops it
/// (PACKET_OTHERHOST) uncounted by IP and by svc.
fn xdp_sending(frame: &[u8], flows: Flows, counter: &OwnedFd) -> Result<OwnedFd> {
    assert_eq!(frame.len(), 64);
    // Jumps to the XDP_DROP at the end, patched once its place is known.
    let mut to_drop = Vec::new();
    let mut p = Vec::new();
    if flows == Flows::New {
        p.extend([
            insn(0xbf, 6, 1, 0, 0),                   // r6 = ctx
            insn(0x18, 1, 1, 0, counter.as_raw_fd()), // r1 = the counter map (pseudo map fd)
            insn(0, 0, 0, 0, 0),
            insn(0xbf, 2, 10, 0, 0),  // r2 = r10
            insn(0x07, 2, 0, 0, -4),  // r2 -= 4
            insn(0x62, 10, 0, -4, 0), // *(u32 *)(r10 - 4) = 0: the key
            insn(0x85, 0, 0, 0, 1),   // r0 = bpf_map_lookup_elem(r1, r2)
        ]);
        to_drop.push(p.len());
        p.extend([
            insn(0x15, 0, 0, 0, 0), // if r0 == 0: drop
            insn(0x79, 7, 0, 0, 0), // r7 = *(u64 *)r0: this frame's flow
            insn(0xbf, 8, 7, 0, 0), // r8 = r7
            insn(0x07, 8, 0, 0, 1), // r8 += 1
            insn(0x7b, 0, 8, 0, 0), // *(u64 *)r0 = r8
            insn(0xbf, 1, 6, 0, 0), // r1 = ctx
        ]);
    }
    p.extend([
        insn(0x61, 2, 1, 0, 0),  // r2 = ctx->data
        insn(0x61, 3, 1, 4, 0),  // r3 = ctx->data_end
        insn(0xbf, 4, 2, 0, 0),  // r4 = r2
        insn(0x07, 4, 0, 0, 64), // r4 += 64
    ]);
    to_drop.push(p.len());
    p.push(insn(0x2d, 4, 3, 0, 0)); // if r4 > r3: drop
    for (i, w) in frame.chunks(4).enumerate() {
        let imm = i32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        p.push(insn(0x62, 2, 0, (i * 4) as i16, imm)); // *(u32 *)(r2 + 4i) = imm
    }
    if flows == Flows::New {
        // Flow r7: source port 1024 + r7 % NEW_PORTS, source 10.77.0.(128 + r7 / NEW_PORTS %
        // NEW_HOSTS); the frame's source address ends in 0, so its header's folded sum grows
        // by that last byte, and the checksum is the complement of the sum.
        let sum0 = !u16::from_be_bytes([frame[24], frame[25]]);
        p.extend([
            insn(0xbf, 5, 7, 0, 0),                // r5 = r7
            insn(0x97, 5, 0, 0, NEW_PORTS as i32), // r5 %= NEW_PORTS
            insn(0x07, 5, 0, 0, 1024),             // r5 += 1024
            insn(0x73, 2, 5, 35, 0),               // data[35] = (u8)r5
            insn(0x77, 5, 0, 0, 8),                // r5 >>= 8
            insn(0x73, 2, 5, 34, 0),               // data[34] = (u8)r5
            insn(0xbf, 5, 7, 0, 0),                // r5 = r7
            insn(0x37, 5, 0, 0, NEW_PORTS as i32), // r5 /= NEW_PORTS
            insn(0x97, 5, 0, 0, NEW_HOSTS as i32), // r5 %= NEW_HOSTS
            insn(0x07, 5, 0, 0, 128),              // r5 += 128
            insn(0x73, 2, 5, 29, 0),               // data[29] = (u8)r5
            insn(0x07, 5, 0, 0, i32::from(sum0)),  // r5 += sum0
            insn(0xbf, 4, 5, 0, 0),                // r4 = r5
            insn(0x77, 4, 0, 0, 16),               // r4 >>= 16
            insn(0x57, 5, 0, 0, 0xffff),           // r5 &= 0xffff
            insn(0x0f, 5, 4, 0, 0),                // r5 += r4: folded
            insn(0xa7, 5, 0, 0, 0xffff),           // r5 ^= 0xffff: the checksum
            insn(0x73, 2, 5, 25, 0),               // data[25] = (u8)r5
            insn(0x77, 5, 0, 0, 8),                // r5 >>= 8
            insn(0x73, 2, 5, 24, 0),               // data[24] = (u8)r5
        ]);
    }
    p.extend([
        insn(0xb7, 0, 0, 0, 3), // XDP_TX
        insn(0x95, 0, 0, 0, 0),
    ]);
    let drop = p.len();
    p.extend([
        insn(0xb7, 0, 0, 0, 1), // XDP_DROP
        insn(0x95, 0, 0, 0, 0),
    ]);
    for j in to_drop {
        let off = (drop - j - 1) as i16;
        p[j][2..4].copy_from_slice(&off.to_le_bytes());
    }
    xdp::load(&p.concat())
}

/// Source ports and addresses of the new-flow measures: NEW_PORTS × NEW_HOSTS flows before
/// one comes again, more than either connection-tracking table holds.
const NEW_PORTS: u32 = 64512;
const NEW_HOSTS: u32 = 64;

/// An array of one u64, the generator's next flow in the new-flow measures: one per setup, so
/// that no measure repeats an earlier one's flows (until NEW_PORTS × NEW_HOSTS of them).
fn counter_map() -> Result<OwnedFd> {
    let mut attr = [0u8; 128];
    put(&mut attr, 0, &2u32.to_ne_bytes()); // BPF_MAP_TYPE_ARRAY
    put(&mut attr, 4, &4u32.to_ne_bytes()); // key_size
    put(&mut attr, 8, &8u32.to_ne_bytes()); // value_size
    put(&mut attr, 12, &1u32.to_ne_bytes()); // max_entries
    let fd = bpf(0, &mut attr, "BPF_MAP_CREATE")?;
    // SAFETY: the kernel just returned this descriptor to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Which flows the generator's frames are of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flows {
    /// One flow: after its first frame every frame is of a known connection.
    One,
    /// Every frame a flow of its own (source address and port), UDP: each is a new connection.
    New,
}

impl Flows {
    fn id(self) -> &'static str {
        match self {
            Flows::One => "one",
            Flows::New => "new",
        }
    }

    fn parse(id: &str) -> Option<Flows> {
        [Flows::One, Flows::New].into_iter().find(|f| f.id() == id)
    }
}

/// Pins thread `tid` to `cpu`, at a real-time `priority`: the machine's other work (builds,
/// other tests) does not take the core from it. The kernel's real-time throttling (95 % of
/// each second by default) still leaves the rest of the machine some time on that core.
fn pin_to(tid: i32, cpu: usize, priority: i32) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t with one bit set, its size given; a sched_param.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "pinning {tid} to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        }
        let param = libc::sched_param {
            sched_priority: priority,
        };
        if libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) != 0 {
            bail!(
                "real-time priority for {tid}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

fn mac(ns: &NetNs, dev: &str) -> Result<[u8; 6]> {
    let out = ns.ip(["-j", "link", "show", "dev", dev])?;
    let v: Value = serde_json::from_str(&out)?;
    let text = v[0]["address"].as_str().context("no address")?;
    let mut m = [0u8; 6];
    for (i, b) in text.split(':').enumerate().take(6) {
        m[i] = u8::from_str_radix(b, 16)?;
    }
    Ok(m)
}

fn v4(s: &str) -> [u8; 4] {
    s.parse::<std::net::Ipv4Addr>()
        .expect("address literal")
        .octets()
}

/// One 64-byte Ethernet frame: IPv4 UDP from `src`, port 40000, to `dst`:`port`, without a UDP
/// checksum (IPv4 allows none).
fn frame(src_mac: [u8; 6], dst_mac: [u8; 6], src: &str, dst: &str, port: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend(dst_mac);
    f.extend(src_mac);
    f.extend(0x0800u16.to_be_bytes());
    let total: u16 = 64 - 14;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&v4(src));
    ip[16..20].copy_from_slice(&v4(dst));
    let mut sum: u32 = ip
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend(ip);
    f.extend(CLIENT_PORT.to_be_bytes());
    f.extend(port.to_be_bytes());
    f.extend((total - 20).to_be_bytes());
    f.extend([0, 0]);
    f.resize(64, 0x5a);
    f
}

/// The kernel's threads named `napi/...` and their ids.
fn napi_threads() -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) {
            if comm.starts_with("napi/") {
                out.push((pid, comm.trim().to_string()));
            }
        }
    }
    out
}

/// Turns threaded NAPI on for `dev` in `ns` and returns its threads (the `napi/` threads that
/// appeared: one per NAPI context of the device).
fn threaded(ns: &NetNs, dev: &str) -> Result<Vec<i32>> {
    let before = napi_threads();
    // `ip netns exec` mounts a /sys of the namespace's own; this process's /sys shows the
    // machine's devices, whatever namespace the thread is in.
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "sh", "-c"])
        .arg(format!("echo 1 > /sys/class/net/{dev}/threaded"))
        .output()?;
    if !out.status.success() {
        bail!(
            "threaded NAPI on {dev}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let new: Vec<i32> = napi_threads()
            .into_iter()
            .filter(|t| !before.contains(t) && t.1.starts_with(&format!("napi/{dev}-")))
            .map(|t| t.0)
            .collect();
        if !new.is_empty() {
            return Ok(new);
        }
        if Instant::now() > deadline {
            bail!("no napi thread appeared for {dev}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A thread's time on a CPU, in nanoseconds (schedstat: ticks are too coarse for seconds).
fn cpu_ns(tid: i32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{tid}/schedstat"))?;
    Ok(stat
        .split_whitespace()
        .next()
        .context("schedstat")?
        .parse()?)
}

/// `ethtool -S DEV` of `ns`: the value of the statistic `name`.
fn ethtool_stat(ns: &NetNs, dev: &str, name: &str) -> Result<u64> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "ethtool", "-S", dev])
        .output()
        .context("ethtool")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{name}: "))?.parse().ok())
        .with_context(|| format!("no {name} in ethtool -S {dev}: {text}"))
}

/// One setup's namespaces, programs and pins. Fields drop in order: the agent (stopped) before
/// its pins, the drop program's link before the namespaces.
struct World {
    setup: Setup,
    /// Stopped once it has synced: its rules stay in node 1's namespace.
    kube_proxy: Option<Box<KubeProxy>>,
    _agent: Option<Agent>,
    _bpffs: Option<Bpffs>,
    _drop: OwnedFd,
    _m: Manifests,
    _cgroup: TestCgroup,
    wire: NetNs,
    node1: NetNs,
    frame: Vec<u8>,
    new_frame: Vec<u8>,
    counter: OwnedFd,
    rx_threads: Vec<i32>,
    wire_ifindex: u32,
}

/// Service `i` and its one slice, as svc's manifests and the API server hold them alike: a
/// NodePort Service of one UDP port, its one endpoint pod 2 on node 2.
fn objects(i: u32) -> (Value, Value) {
    let name = format!("s{i}");
    let svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "type": "NodePort",
            "clusterIP": bulk::cluster_ip(i).to_string(),
            "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": POD_PORT,
                       "nodePort": NODE_PORT_BASE + i as u16}],
        },
    });
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-a"), "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": "dns", "port": POD_PORT, "protocol": "UDP"}],
        "endpoints": [{"addresses": [POD2], "conditions": {"ready": true, "serving": true,
                                                           "terminating": false},
                       "nodeName": REMOTE_NODE}],
    });
    (svc, slice)
}

fn service_docs(i: u32) -> String {
    let (svc, slice) = objects(i);
    format!(
        "---\n{}---\n{}",
        serde_saphyr::to_string(&svc).expect("yaml"),
        serde_saphyr::to_string(&slice).expect("yaml")
    )
}

/// An API server holding the bench's `n` Services, and the two nodes, for kube-proxy.
fn control_plane(rt: &tokio::runtime::Runtime, n: u32) -> Result<ControlPlane> {
    let range = format!("--service-node-port-range={NODE_PORT_BASE}-32767");
    let cp = ControlPlane::start_with_args(
        Binaries::from_env()?,
        // JSON storage: `bulk::populate_via_etcd` writes the objects straight into etcd.
        &[&range, "--storage-media-type=application/json"],
    )
    .context("starting the control plane")?;
    for (name, ip) in [(NODE, NODE1), (REMOTE_NODE, NODE2)] {
        cp.create_node(name, ip)?;
    }
    let client = rt.block_on(svc_agent::source::kube::client(Some(cp.kubeconfig_path())))?;
    let t = Instant::now();
    // Through the API, 10,000 Services take minutes (`bulk::populate_via_etcd` says why);
    // kube-proxy still reads them through the API server.
    interrupt::block_on(
        rt,
        bulk::populate_via_etcd(&cp, client, NAMESPACE, n, |i| {
            let (svc, slice) = objects(i);
            (
                serde_json::from_value(svc).expect("a Service"),
                serde_json::from_value(slice).expect("an EndpointSlice"),
            )
        }),
    )?;
    eprintln!(
        "{n} Services and slices in the API server in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(cp)
}

impl World {
    fn build(setup: Setup, tools: &Tools, n: u32, cp: Option<&ControlPlane>) -> Result<World> {
        let wire = NetNs::new("svc-c")?;
        let node1 = NetNs::new("svc-b")?;
        veth_pair(&wire, "gen0", &node1, "eth0")?;
        wire.add_addr("gen0", &format!("{CLIENT}/24"))?;
        wire.add_addr("gen0", &format!("{NODE2}/24"))?;
        node1.add_addr("eth0", &format!("{NODE1}/24"))?;
        node1.forward()?;
        let (wire_mac, node_mac) = (mac(&wire, "gen0")?, mac(&node1, "eth0")?);
        let wire_mac_s = wire_mac
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":");
        for addr in [CLIENT, NODE2] {
            node1.ip([
                "neigh",
                "replace",
                addr,
                "lladdr",
                &wire_mac_s,
                "dev",
                "eth0",
                "nud",
                "permanent",
            ])?;
        }
        node1.ip(["route", "add", "10.244.2.0/24", "via", NODE2])?;
        for setting in [
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.eth0.send_redirects=0",
        ] {
            node1.sysctl(setting)?;
        }
        // Forwarded skbs reach gen0's NAPI ring (not the backlog of the receiving CPU) only
        // when the sending veth offers no TSO (veth.c, veth_skb_is_eligible_for_gro).
        ethtool(&node1, &["-K", "eth0", "tso", "off"])?;
        // gen0 drops what node 1 sends, in its driver, counted.
        let drop = xdp::returning(1)?;
        let drop_link = wire.run_in(|| attach_native(&drop, ifindex("gen0")?))??;
        let wire_ifindex = wire.run_in(|| ifindex("gen0"))??;
        let m = Manifests::new()?;
        let cgroup = TestCgroup::new()?;
        let (mut agent, mut bpffs, mut kp) = (None, None, None);
        if let Setup::KubeProxy(mode) = setup {
            let cp = cp.context("kube-proxy needs the API server")?;
            let bin = kube_proxy::binary_from_env()?;
            let mut k = KubeProxy::start(KubeProxyConfig::new(&bin, mode, NODE), cp, &node1)?;
            k.quiet();
            let took = k.wait_ready(SYNC_TIMEOUT)?;
            eprintln!(
                "{}: {n} Services synced in {:.1} s",
                mode.label(),
                took.as_secs_f64()
            );
            // As svc's agent: the rules stay, no resync falls into a measure.
            k.stop(Duration::from_secs(10))?;
            kp = Some(Box::new(k));
        } else if setup != Setup::None {
            for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
                let text: String = chunk.iter().map(|i| service_docs(*i)).collect();
                m.write_raw(&format!("s{}.yaml", chunk[0]), &text)?;
            }
            let b = Bpffs::new(&tools.agent, cgroup.path())?;
            let mut args: Vec<OsString> = [
                "run",
                "--manifests",
                m.dir().to_str().context("path")?,
                "--cgroup",
                cgroup.path().to_str().context("path")?,
                "--bpffs",
                b.path().to_str().context("path")?,
                "--node-name",
                NODE,
                "--devices",
                "eth0",
            ]
            .into_iter()
            .map(Into::into)
            .collect();
            if setup == Setup::SvcXdp {
                args.extend(["--xdp-mode".into(), "native".into()]);
            }
            let launcher: [OsString; 2] = [
                "nsenter".into(),
                format!("--net={}", node1.path().display()).into(),
            ];
            let mut a =
                Agent::start_launched(&launcher, &tools.agent, args, b.path(), m.scratch())?;
            a.quiet();
            if let Err(e) = a.wait_ready(AGENT_READY_TIMEOUT) {
                bail!("svc-agent not ready: {e:#}; log:\n{}", a.log());
            }
            a.terminate(Duration::from_secs(10))?;
            agent = Some(a);
            bpffs = Some(b);
        }
        if setup != Setup::SvcXdp {
            // NAPI for eth0 without an XDP program: GRO asked for (toggled: it shows on
            // without having been asked for).
            ethtool(&node1, &["-K", "eth0", "gro", "off"])?;
            ethtool(&node1, &["-K", "eth0", "gro", "on"])?;
        }
        let rx_threads = threaded(&node1, "eth0")?;
        for t in &rx_threads {
            pin_to(*t, RX_CPU, RX_PRIORITY)?;
        }
        // Above the generator on their shared CPU: what node 1 sends is dropped as it comes,
        // never left to fill gen0's ring while the generator runs.
        for t in threaded(&wire, "gen0")? {
            pin_to(t, GEN_CPU, DROP_PRIORITY)?;
        }
        let (dst, port) = match setup {
            Setup::None => (POD2, POD_PORT),
            _ => (NODE1, NODE_PORT_BASE + (n - 1) as u16),
        };
        Ok(World {
            setup,
            kube_proxy: kp,
            _agent: agent,
            _bpffs: bpffs,
            _drop: drop_link,
            _m: m,
            _cgroup: cgroup,
            wire,
            node1,
            frame: frame(wire_mac, node_mac, CLIENT, dst, port),
            // The generator writes the last byte of the source address, and the checksum.
            new_frame: frame(wire_mac, node_mac, "10.77.0.0", dst, port),
            counter: counter_map()?,
            rx_threads,
            wire_ifindex,
        })
    }

    /// That kube-proxy's rules are what forwarded the frames: node 1's connection tracking
    /// holds the flow translated both ways, DNAT to pod 2 and SNAT to node 1 (so that pod 2's
    /// replies would come back through node 1). A setup without kube-proxy has nothing to check
    /// here: svc's own connection tracking is not netfilter's.
    fn check_conntrack(&self, n: u32) -> Result<()> {
        if self.kube_proxy.is_none() {
            return Ok(());
        }
        let port = NODE_PORT_BASE + (n - 1) as u16;
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", self.node1.path().display()))
            .args(["conntrack", "-L", "-p", "udp", "--dport", &port.to_string()])
            .output()
            .context("conntrack -L")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let original = format!("src={CLIENT} dst={NODE1} sport={CLIENT_PORT} dport={port} ");
        // kube-proxy masquerades with --random-fully: any source port of node 1's.
        let reply = format!("src={POD2} dst={NODE1} sport={POD_PORT} dport=");
        if !text
            .lines()
            .any(|l| l.contains(&original) && l.contains(&reply))
        {
            bail!(
                "{}: node 1's conntrack has no entry {original}whose reply is {reply}…: {text}{}",
                self.setup.id(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// How many flows node 1's netfilter conntrack holds (`conntrack -C`), where kube-proxy's
    /// rules run: after a new-flow measure, that each frame made one (up to the table's size,
    /// `nf_conntrack_max`, where new ones evict unreplied ones).
    fn conntrack_count(&self) -> Result<Option<u64>> {
        if self.kube_proxy.is_none() {
            return Ok(None);
        }
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", self.node1.path().display()))
            .args(["conntrack", "-C"])
            .output()
            .context("conntrack -C")?;
        let text = String::from_utf8_lossy(&out.stdout);
        Ok(Some(text.trim().parse().with_context(|| {
            format!(
                "conntrack -C: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?))
    }

    /// CPU time of node 1's receiving threads, in nanoseconds.
    fn rx_cpu_ns(&self) -> Result<u64> {
        self.rx_threads.iter().map(|t| cpu_ns(*t)).sum()
    }

    /// Counters of the bench's devices: (frames node 1 took off its ring, frames the ring
    /// refused, frames forwarded back to gen0).
    fn counters(&self) -> Result<(u64, u64, u64)> {
        Ok((
            ethtool_stat(&self.wire, "gen0", "tx_queue_0_xdp_xmit")?,
            ethtool_stat(&self.wire, "gen0", "tx_queue_0_xdp_xmit_errors")?,
            ethtool_stat(&self.wire, "gen0", "rx_queue_0_xdp_drops")?,
        ))
    }

    /// Sends for `secs` seconds from CPU 0, `rate` frames a second at most (0: as fast as the
    /// generator goes).
    fn measure(&self, secs: u64, rate: u64, flows: Flows) -> Result<Measure> {
        if flows == Flows::New && self.kube_proxy.is_some() {
            // Masquerading every flow to one backend from one address, netfilter has 64,512
            // source ports for them (1024-65535) until unreplied flows expire (30 s): past
            // that, new flows are dropped after a long search, and a measure would time
            // that, not the creation of flows. Each new-flow measure starts empty.
            let out = std::process::Command::new("nsenter")
                .arg(format!("--net={}", self.node1.path().display()))
                .args(["conntrack", "-F"])
                .output()
                .context("conntrack -F")?;
            if !out.status.success() {
                bail!("conntrack -F: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        let c0 = self.counters()?;
        let cpu0 = self.rx_cpu_ns()?;
        let started = Instant::now();
        let frame = match flows {
            Flows::One => self.frame.clone(),
            Flows::New => self.new_frame.clone(),
        };
        let (ifindex, counter) = (self.wire_ifindex, &self.counter);
        let sent = self.wire.run_in(move || -> Result<u64> {
            // SAFETY: gettid has no preconditions.
            pin_to(unsafe { libc::gettid() }, GEN_CPU, GEN_PRIORITY)?;
            let prog = xdp_sending(&frame, flows, counter)?;
            let mut ctx = [0u32; 6];
            ctx[1] = frame.len() as u32;
            ctx[3] = ifindex;
            let mut sent = 0u64;
            // Paced, in bursts well under node 1's ring (256 frames); the actual rate is
            // what is reported.
            let repeat: u32 = if rate == 0 { 1 << 16 } else { 32 };
            let start = Instant::now();
            let deadline = start + Duration::from_secs(secs);
            while Instant::now() < deadline {
                let mut attr = [0u8; 128];
                put(&mut attr, 0, &(prog.as_raw_fd() as u32).to_ne_bytes());
                put(&mut attr, 8, &(frame.len() as u32).to_ne_bytes()); // data_size_in
                put(&mut attr, 16, &(frame.as_ptr() as u64).to_ne_bytes()); // data_in
                put(&mut attr, 32, &repeat.to_ne_bytes()); // repeat
                put(&mut attr, 40, &24u32.to_ne_bytes()); // ctx_size_in
                put(&mut attr, 48, &(ctx.as_ptr() as u64).to_ne_bytes()); // ctx_in
                put(&mut attr, 64, &2u32.to_ne_bytes()); // BPF_F_TEST_XDP_LIVE_FRAMES
                bpf(10, &mut attr, "BPF_PROG_TEST_RUN")?;
                sent += u64::from(repeat);
                if rate > 0 {
                    let due = start + Duration::from_secs_f64(sent as f64 / rate as f64);
                    while Instant::now() < due {
                        std::hint::spin_loop();
                    }
                }
            }
            Ok(sent)
        })??;
        let elapsed = started.elapsed().as_secs_f64();
        // Let the rings drain.
        std::thread::sleep(Duration::from_millis(200));
        let c1 = self.counters()?;
        let cpu = self.rx_cpu_ns()? - cpu0;
        let (taken, refused, forwarded) = (c1.0 - c0.0, c1.1 - c0.1, c1.2 - c0.2);
        Ok(Measure {
            offered: sent as f64 / elapsed,
            taken: taken as f64 / elapsed,
            refused: refused as f64 / elapsed,
            forwarded: forwarded as f64 / elapsed,
            cpu_ns: cpu as f64 / forwarded.max(1) as f64,
            busy: cpu as f64 / 1e9 / elapsed,
        })
    }
}

/// One measure, in frames a second, and CPU of node 1's receiving thread.
struct Measure {
    /// Frames the generator ran.
    offered: f64,
    /// Frames gen0 handed to node 1's ring.
    taken: f64,
    /// Frames node 1's ring was full for.
    refused: f64,
    /// Frames back at gen0: forwarded by node 1.
    forwarded: f64,
    /// Nanoseconds of the receiving thread per forwarded frame.
    cpu_ns: f64,
    /// The receiving thread's share of its core.
    busy: f64,
}

fn ethtool(ns: &NetNs, args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "ethtool"])
        .args(args)
        .output()
        .context("ethtool")?;
    if !out.status.success() {
        bail!("ethtool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() -> ExitCode {
    interrupt::run(bench)
}

fn bench() -> Result<()> {
    require_root();
    let args = Args::parse();
    let tools = Tools::with_probe(PathBuf::from("/bin/true"));
    let setups: Vec<Setup> = if args.setups.is_empty() {
        Setup::ALL.to_vec()
    } else {
        args.setups
            .iter()
            .map(|id| Setup::parse(id).with_context(|| format!("unknown setup {id}")))
            .collect::<Result<_>>()?
    };
    let flows: Vec<Flows> = args
        .flows
        .iter()
        .map(|id| Flows::parse(id).with_context(|| format!("unknown flows {id}")))
        .collect::<Result<_>>()?;
    for &n in &args.services {
        if n == 0 || n > 32767 - u32::from(NODE_PORT_BASE) {
            bail!("--services {n}: between 1 and 12,767 (the NodePort range)");
        }
    }
    let kube = setups.iter().any(|s| matches!(s, Setup::KubeProxy(_)));
    // kube-proxy's rules go to node 1's namespace only: the machine's own firewall is compared
    // before and after.
    let mut firewall = HostFirewallGuard::new()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let load = std::fs::read_to_string("/proc/loadavg")?;
    let mut results = Vec::new();
    for &n in &args.services {
        let cp = if kube {
            Some(control_plane(&rt, n)?)
        } else {
            None
        };
        let worlds: Vec<World> = setups
            .iter()
            .map(|s| {
                interrupt::check()?;
                World::build(*s, &tools, n, cp.as_ref())
                    .with_context(|| format!("{} at {n}", s.id()))
            })
            .collect::<Result<_>>()?;
        // Every proxy has synced and stopped: nothing needs the API server any more.
        drop(cp);
        // The first packet of svc's flow goes through tc, which makes its entry; kube-proxy's,
        // through netfilter's conntrack. Every frame taken must be forwarded, and kube-proxy's
        // translation must be what forwards them: a frame to the NodePort that no rule
        // translated is node 1's own, answered with a rate-limited ICMP error at most.
        for w in &worlds {
            let m = w.measure(1, 1000, Flows::One)?;
            if m.taken == 0.0 || m.forwarded < 0.99 * m.taken {
                bail!(
                    "{} at {n}: node 1 forwarded {:.0} of the {:.0} frames a second it took",
                    w.setup.id(),
                    m.forwarded,
                    m.taken
                );
            }
            w.check_conntrack(n)?;
        }
        for round in 0..args.rounds {
            for &flow in &flows {
                for &rate in &args.rates {
                    for k in 0..worlds.len() {
                        interrupt::check()?;
                        let w = &worlds[(k + round as usize) % worlds.len()];
                        let m = w.measure(args.seconds, rate, flow)?;
                        let flows_held = w.conntrack_count()?;
                        let load = std::fs::read_to_string("/proc/loadavg")?;
                        let load1 = load.split_whitespace().next().unwrap_or("?").to_string();
                        eprintln!(
                            "{n} services, round {round}, {} flows, rate {rate}, {}: offered \
                             {:.0}/s, node 1 took {:.0}/s (its ring refused {:.0}/s), forwarded \
                             {:.0}/s, {:.0} ns of CPU 1 each, its thread {:.0} % busy, load {load1}{}",
                            flow.id(),
                            w.setup.id(),
                            m.offered,
                            m.taken,
                            m.refused,
                            m.forwarded,
                            m.cpu_ns,
                            m.busy * 100.0,
                            flows_held
                                .map(|c| format!(", node 1's conntrack holds {c} flows"))
                                .unwrap_or_default()
                        );
                        results.push(json!({"services": n, "round": round, "rate": rate,
                            "flows": flow.id(), "setup": w.setup.id(), "offered": m.offered,
                            "taken": m.taken, "refused": m.refused, "pps": m.forwarded,
                            "cpu_ns": m.cpu_ns, "busy": m.busy, "load1": load1,
                            "conntrack_flows": flows_held}));
                    }
                }
            }
        }
    }
    println!("load before: {}", load.trim());
    println!(
        "load after: {}",
        std::fs::read_to_string("/proc/loadavg")?.trim()
    );
    println!(
        "| services | flows | offered | setup | forwarded/s | × none | forwarded of taken | \
         ns of the receiving core per frame | × none | core busy |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let pick = |(n, f, rate): (u32, Flows, u64), k: &str, setup: &str| -> Vec<f64> {
        results
            .iter()
            .filter(|r| {
                r["services"] == n
                    && r["flows"] == f.id()
                    && r["rate"] == rate
                    && r["setup"] == setup
            })
            .map(|r| r[k].as_f64().unwrap_or(0.0))
            .collect()
    };
    // Per round, `setup`'s value over `base`'s of the same round: median (min–max).
    let ratio = |at: (u32, Flows, u64), k: &str, setup: &str, base: &str| {
        let mine = pick(at, k, setup);
        let theirs = pick(at, k, base);
        if theirs.len() != mine.len() || theirs.is_empty() {
            return None;
        }
        Some(median(
            mine.iter().zip(&theirs).map(|(a, b)| a / b).collect(),
        ))
    };
    let shown = |r: Option<(f64, f64, f64)>| {
        r.map(|(m, l, h)| format!("{m:.2} ({l:.2}–{h:.2})"))
            .unwrap_or_default()
    };
    let offered = |rate: u64| {
        if rate == 0 {
            "max".to_string()
        } else {
            rate.to_string()
        }
    };
    let mut measured = Vec::new();
    for &n in &args.services {
        for &f in &flows {
            for &rate in &args.rates {
                measured.push((n, f, rate));
            }
        }
    }
    for &at in &measured {
        let (n, f, rate) = at;
        for s in &setups {
            let (pps, lo, hi) = median(pick(at, "pps", s.id()));
            let (ns, nlo, nhi) = median(pick(at, "cpu_ns", s.id()));
            let (busy, _, _) = median(pick(at, "busy", s.id()));
            let taken: f64 = pick(at, "taken", s.id()).iter().sum();
            let fwd: f64 = pick(at, "pps", s.id()).iter().sum();
            println!(
                "| {n} | {} | {} | {} | {pps:.0} ({lo:.0}–{hi:.0}) | {} | {:.3} | \
                 {ns:.0} ({nlo:.0}–{nhi:.0}) | {} | {:.0} % |",
                f.id(),
                offered(rate),
                s.id(),
                shown(ratio(at, "pps", s.id(), "none")),
                fwd / taken.max(1.0),
                shown(ratio(at, "cpu_ns", s.id(), "none")),
                busy * 100.0
            );
        }
    }
    println!();
    let xdp = Setup::SvcXdp.id();
    for &at in &measured {
        let (n, f, rate) = at;
        for base in setups
            .iter()
            .filter(|s| !matches!(s, Setup::None | Setup::SvcXdp))
        {
            let (Some(pps), Some(ns)) = (
                ratio(at, "pps", xdp, base.id()),
                ratio(at, "cpu_ns", base.id(), xdp),
            ) else {
                continue;
            };
            println!(
                "- {n} Services, {} flows, offered {}: svc-xdp against {}: {} × the \
                     frames/s, {} × less CPU per frame",
                f.id(),
                offered(rate),
                base.id(),
                shown(Some(pps)),
                shown(Some(ns))
            );
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
    }
    firewall.check()?;
    Ok(())
}
