//! svc-nodeport-bench: traffic from outside the node through a NodePort, per second, with svc's
//! tc programs, with the rules kube-proxy itself writes (iptables mode on iptables-nft and on
//! iptables-legacy, nftables mode) and with no translation at all, at several Service counts,
//! in one run on one machine.
//!
//! Every setup gets a topology of its own (`svc_tests::topology`: an external client, the lan
//! bridge, node 1 with its uplink `eth0` and pod 1 behind it, node 2 and pod 2), all with the
//! same addresses. The client reaches the pods' network through node 1 (a route it is given
//! here), so the same client can also talk to a pod directly:
//!
//! - `none`: no proxy; the client connects to pod 1 (or pod 2) itself, routed through node 1.
//!   The baseline: no translation at all.
//! - `svc`: svc-agent inside node 1 (nsenter) with `--devices eth0`, against the bench's API
//!   server: its tc programs on node 1's eth0 translate `NODE1:nodePort`.
//! - `kube-proxy ...`: kube-proxy inside node 1 (nsenter, `svc_tests::kube_proxy`), against the
//!   same API server: its rules in node 1's namespace translate `NODE1:nodePort`.
//!
//! One API server holds N NodePort Services with one endpoint each, pod 1 on node 1, plus one
//! Service whose endpoint is pod 2 on node 2 (the remote row: DNAT and SNAT). Every proxy sees
//! the same objects. Once a proxy has programmed them (svc: `ready`; kube-proxy: its first sync
//! of both families), it is stopped: its programs (pinned links) or rules stay, and what is
//! measured is the datapath alone, with no proxy process running, and no periodic resync of one
//! proxy falling into another's measurement.
//!
//! Measures, each for a few seconds from the client namespace, by `svc-probe loop` processes
//! (several workers, one backend `svc-probe serve --threads`):
//! - new TCP connections per second: connect, one line and its answer, close (RST, so no
//!   TIME_WAIT), to `NODE1:nodePort` (to the pod itself for `none`);
//! - UDP packets per second forwarded by node 1: each worker keeps one socket (one flow) and
//!   sends a datagram as soon as the last one was answered; request and reply count;
//! - non-service traffic: new TCP connections to pod 1 itself, through node 1, in each setup
//!   (for svc: through its programs, as traffic to no Service).
//!
//! Rounds interleave the setups (the order rotates each round); ratios are taken round by round
//! against `none`. In `none` and `svc` each round also takes the paired measures (`Way`):
//! the same traffic alternating, attempt by attempt, with the pod reached through a second node
//! network that no program sees, so that svc and no svc are compared at the same moments; and
//! the fixed-rate ones: the same traffic at a rate below capacity, with the machine's CPU time
//! per exchange. A target is met when the fixed-rate and the paired measures both show it. Results go to JSON (`--json`) and, with `--write`, to the `nodeport` section
//! of docs/benchmarks.md, together with the per-packet table of `--per-packet`.
//!
//! Nothing leaves the namespaces: programs attach only to node 1's `eth0` of the bench's own
//! namespaces, kube-proxy's rules live in node 1's namespace, and the machine's own firewall is
//! checked before and after. SIGTERM, SIGINT and SIGHUP end the run through the same teardown
//! as an error (`svc_tests::interrupt`), with status 128 + the signal's number.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Client;
use serde::{Deserialize, Serialize};
use svc_agent::source::kube::SERVICE_NAME_LABEL;
use svc_tests::agent::kube_run_args;
use svc_tests::bulk::{self, cluster_ip};
use svc_tests::control_plane::ControlPlane;
use svc_tests::interrupt;
use svc_tests::kube_proxy::{
    self, ApiRelay, HostFirewallGuard, IptablesBackend, KubeProxy, KubeProxyConfig, Mode,
};
use svc_tests::parity::ProxyKind;
use svc_tests::profile::{program_time, BpfStats, CpuClock, Profile};
use svc_tests::report::{self, fmt3};
use svc_tests::sandbox::AGENT_READY_TIMEOUT;
use svc_tests::sys::run;
use svc_tests::topology::{Nodes, CLIENT, NODE1, NODE2, POD1, POD1_B, POD2, POD2_B};
use svc_tests::{
    require_root, Agent, Backend, Bpffs, ClientRun, LoopReport, Report, TempDir, TestCgroup, Tools,
};

const NAMESPACE: &str = "bench";
/// The measures each target is judged by, in the order the targets are listed.
const TARGET_MEASURES: [&str; 5] = [
    "tcp-local",
    "udp-local",
    "tcp-remote",
    "udp-remote",
    "tcp-direct",
];
const NODE: &str = "node-1";
const REMOTE_NODE: &str = "node-2";
const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// NodePort of Service `i` is `NODE_PORT_BASE + i`; the API server is given this range (the
/// default, 30000-32767, holds 2,768), below the ephemeral ports (32768-60999).
const NODE_PORT_BASE: u16 = 20000;
const NODE_PORT_RANGE: &str = "20000-32767";
/// Receivers per backend socket: more than the client's workers, so no connection waits for
/// a thread.
const SERVER_THREADS: u32 = 8;

#[derive(Parser)]
struct Args {
    /// Service counts (NodePort Services to pod 1; one more goes to pod 2), each on its own
    /// control plane.
    #[arg(long, value_delimiter = ',', default_value = "1,10000")]
    services: Vec<u32>,
    /// Rounds; each measures every setup once, in an order that rotates.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Seconds per measure.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Concurrent client workers per measure.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Setups (none, svc, kube-proxy-iptables-nft, kube-proxy-iptables-legacy,
    /// kube-proxy-nftables), comma-separated; all by default.
    #[arg(long, value_delimiter = ',')]
    setups: Vec<String>,
    /// Measures by id (tcp-direct, tcp-local, tcp-direct-after, udp-local, tcp-remote,
    /// udp-remote; the paired pair-tcp-direct, pair-tcp-local, pair-udp-local,
    /// pair-tcp-remote, pair-udp-remote; and the same five at a fixed rate, cpu-tcp-direct
    /// and so on), comma-separated; all by default. A run of paired measures only needs no
    /// `none` setup: their baseline is in the same measure.
    #[arg(long, value_delimiter = ',')]
    measures: Vec<String>,
    /// New TCP connections per second offered in the fixed-rate (cpu-) measures: below what
    /// every measured path sustains here, so that the machine's CPU time per connection,
    /// not the rate, tells the paths apart.
    #[arg(long, default_value_t = 6000)]
    cpu_rate_tcp: u64,
    /// UDP exchanges (a request and its reply) per second offered in the fixed-rate measures.
    #[arg(long, default_value_t = 25000)]
    cpu_rate_udp: u64,
    /// How long a kube-proxy may take for its first sync before its setup is given up.
    #[arg(long, default_value_t = 600)]
    sync_timeout_s: u64,
    /// Quick: 1 and 1,000 Services, 3 rounds of 1 s measures.
    #[arg(long)]
    quick: bool,
    /// The per-packet table (markdown) that `per_packet_cost` of the kernel fixtures (svc-ebpf-tests)
    /// wrote, included in the section.
    #[arg(long)]
    per_packet: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Measure nothing: the tables of the run `--json` saved in this file, by this build's
    /// reading of them (with `--write`, into docs/benchmarks.md).
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// Replace the `nodeport` section of this markdown file (docs/benchmarks.md).
    #[arg(long)]
    write: Option<PathBuf>,
    /// Where each measure's CPU time goes, into this directory: the run time of the tc
    /// programs in node 1 (bpf_stats), the machine's CPU time, and a `perf record -a -g`
    /// profile per measure (nodeport_profile.rs).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Set by the run, not an argument: whether svc's program time can be read.
    #[arg(skip)]
    program_time: bool,
    /// One more svc-agent argument (repeatable), for an experiment such as
    /// `--agent-arg=--max-ct=1048576`; the section's method names them.
    #[arg(long, allow_hyphen_values = true)]
    agent_arg: Vec<String>,
}

impl Args {
    /// Whether `--measures` takes `m` taken `way`.
    fn chosen(&self, m: &Measure, way: Way) -> bool {
        self.measures.is_empty() || self.measures.iter().any(|id| *id == way.id(*m))
    }
}

/// What runs on node 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    /// Nothing: the client talks to the pods themselves.
    None,
    Proxy(ProxyKind),
}

impl Setup {
    fn id(self) -> &'static str {
        match self {
            Setup::None => "none",
            Setup::Proxy(k) => k.id(),
        }
    }

    fn label(self) -> String {
        match self {
            Setup::None => "no translation".into(),
            Setup::Proxy(k) => k.label(),
        }
    }

    fn parse(id: &str) -> Option<Setup> {
        if id == "none" {
            return Some(Setup::None);
        }
        ProxyKind::parse(id).map(Setup::Proxy)
    }
}

/// One measure: what is sent, to which backend, and whether through a NodePort.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Measure {
    id: &'static str,
    name: &'static str,
    udp: bool,
    remote: bool,
    /// To the pod itself in every setup (traffic to no Service).
    direct: bool,
}

/// id, what the table calls it, UDP, to the remote backend, to the pod itself; in the order
/// they run in a setup's turn.
const MEASURES: &[Measure] = &[
    // First in the turn: the setup's last NodePort flows are more than a few seconds old
    // (every other setup ran meanwhile).
    Measure::new(
        "tcp-direct",
        "non-service traffic: new TCP connections/s to pod 1 itself, through node 1",
        [false, false, true],
    ),
    Measure::new(
        "tcp-local",
        "new TCP connections/s, NodePort → pod 1 on node 1 (DNAT)",
        [false, false, false],
    ),
    // The same as the first, right after the NodePort's: the client reuses source ports of
    // flows that closed a moment ago.
    Measure::new(
        "tcp-direct-after",
        "non-service traffic, right after the NodePort's connections from the same client",
        [false, false, true],
    ),
    Measure::new(
        "udp-local",
        "UDP packets/s, NodePort → pod 1 on node 1 (DNAT)",
        [true, false, false],
    ),
    Measure::new(
        "tcp-remote",
        "new TCP connections/s, NodePort → pod 2 on node 2 (DNAT+SNAT)",
        [false, true, false],
    ),
    Measure::new(
        "udp-remote",
        "UDP packets/s, NodePort → pod 2 on node 2 (DNAT+SNAT)",
        [true, true, false],
    ),
];

/// How a measure is taken. Every way takes the measures of `MEASURES`; the id of a measure
/// taken another way than back to back has the way's prefix (`pair-tcp-local`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// Back to back for a few seconds, one setup after the other: the rounds' `× none`. On a
    /// 2-core VM the machine's speed drifts by more than the targets between such measures.
    Sequential,
    /// The same traffic alternating attempt by attempt (`svc-probe loop --alternate-with`)
    /// between the measure's target through node 1's `eth0` and the same pod's second address
    /// through the second network (`Nodes::add_second_network`), where no program runs: svc
    /// and no svc at the same moments, so a change of the machine's speed falls on both. The
    /// two targets also share each other's waits for the CPU, which pulls their ratio towards
    /// 1: it understates svc's cost. Taken in `none` (both paths without programs: the
    /// control, which should be 1) and `svc`; not in kube-proxy's setups, whose rules act on
    /// every device of node 1, the second network's too.
    Paired,
    /// At a fixed rate below the machine's capacity (`svc-probe loop --rate`), with the CPU
    /// time all CPUs spent meanwhile (/proc/stat): CPU time per exchange, which is what a
    /// path costs, without the saturated loop's scheduling (who waits for whom) in it. In
    /// `none` and `svc`.
    Cpu,
}

const WAYS: [Way; 3] = [Way::Sequential, Way::Paired, Way::Cpu];

impl Way {
    fn id(self, m: Measure) -> String {
        match self {
            Way::Sequential => m.id.into(),
            Way::Paired => format!("pair-{}", m.id),
            Way::Cpu => format!("cpu-{}", m.id),
        }
    }

    /// Whether `m` is taken this way in `setup`: the other ways leave out the repeat of
    /// non-service traffic after the NodePort's, and kube-proxy.
    fn applies(self, m: Measure, setup: Setup) -> bool {
        m.applies_to(setup)
            && (self == Way::Sequential
                || (m.id != "tcp-direct-after"
                    && matches!(setup, Setup::None | Setup::Proxy(ProxyKind::Svc))))
    }
}

/// The measure of `MEASURES` with this id.
fn measure(id: &str) -> Measure {
    *MEASURES.iter().find(|m| m.id == id).expect("a measure")
}

/// Attempts per second of `m`'s fixed-rate measure, given the rates for TCP and for UDP.
fn cpu_rate(m: Measure, (tcp, udp): (u64, u64)) -> u64 {
    if m.udp {
        udp
    } else {
        tcp
    }
}

impl Measure {
    const fn new(id: &'static str, name: &'static str, [udp, remote, direct]: [bool; 3]) -> Self {
        Measure {
            id,
            name,
            udp,
            remote,
            direct,
        }
    }

    /// The `none` measure this one is compared with: the same traffic to the pod itself.
    fn baseline(self) -> &'static str {
        match (self.udp, self.remote) {
            (false, false) => "tcp-local",
            (true, false) => "udp-local",
            (false, true) => "tcp-remote",
            (true, true) => "udp-remote",
        }
    }

    /// `none` has no NodePort: its local and remote measures go to the pods, and its direct
    /// measure is its `tcp-local`.
    fn applies_to(self, setup: Setup) -> bool {
        !(setup == Setup::None && self.direct)
    }

    /// The pod's second address, on the second network: a paired measure's other target.
    fn second_network_target(self) -> SocketAddr {
        let pod = if self.remote { POD2_B } else { POD1_B };
        SocketAddr::new(pod.parse().expect("address literal"), TARGET_PORT)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Sample {
    services: u32,
    round: u32,
    setup: String,
    measure: String,
    per_s: f64,
    /// A paired measure's other target (the pod through the second network), per second of
    /// the time spent on it; `per_s` is then the first target's, likewise.
    #[serde(skip_serializing_if = "Option::is_none")]
    base_per_s: Option<f64>,
    ok: u64,
    failed: u64,
    errors: BTreeMap<String, u64>,
    /// The CPU time of the whole machine per answered attempt, µs (not for a paired measure);
    /// in a fixed-rate measure `per_s` is the rate achieved.
    #[serde(skip_serializing_if = "Option::is_none")]
    cpu_us: Option<f64>,
    /// svc's tc programs meanwhile (bpf_stats: runs, ns) and the machine's busy CPU
    /// seconds: the programs' share of the CPU, measured directly (svc's setup only, not for
    /// a paired measure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    programs: Option<ProgramTime>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct ProgramTime {
    runs: u64,
    ns: u64,
    busy_s: f64,
}

impl ProgramTime {
    /// The programs' share of the machine's busy CPU time.
    fn share(&self) -> f64 {
        self.ns as f64 / 1e9 / self.busy_s.max(1e-9)
    }
}

/// The Services' objects: `n` to pod 1, and Service `n` to pod 2.
fn service(i: u32, n: u32) -> Service {
    let node_port = i32::from(NODE_PORT_BASE) + i as i32;
    let port = |protocol: &str| ServicePort {
        name: Some(protocol.to_lowercase()),
        port: PORT.into(),
        target_port: Some(IntOrString::Int(TARGET_PORT.into())),
        protocol: Some(protocol.into()),
        node_port: Some(node_port),
        ..Default::default()
    };
    // UDP only where it is measured: the other Services' one TCP port each is what grows
    // kube-proxy's rules.
    let ports = if i == 0 || i == n {
        vec![port("TCP"), port("UDP")]
    } else {
        vec![port("TCP")]
    };
    Service {
        metadata: ObjectMeta {
            name: Some(format!("np-{i}")),
            namespace: Some(NAMESPACE.into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("NodePort".into()),
            cluster_ip: Some(cluster_ip(i).to_string()),
            ports: Some(ports),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(i: u32, n: u32) -> EndpointSlice {
    let (pod, node) = if i == n {
        (POD2, REMOTE_NODE)
    } else {
        (POD1, NODE)
    };
    let port = |protocol: &str| EndpointPort {
        name: Some(protocol.to_lowercase()),
        port: Some(TARGET_PORT.into()),
        protocol: Some(protocol.into()),
        ..Default::default()
    };
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("np-{i}-0")),
            namespace: Some(NAMESPACE.into()),
            labels: Some([(SERVICE_NAME_LABEL.to_string(), format!("np-{i}"))].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: vec![Endpoint {
            addresses: vec![pod.into()],
            conditions: Some(EndpointConditions {
                ready: Some(true),
                serving: Some(true),
                terminating: Some(false),
            }),
            node_name: Some(node.into()),
            ..Default::default()
        }],
        ports: Some(vec![port("TCP"), port("UDP")]),
    }
}

async fn populate(client: Client, n: u32) -> Result<()> {
    bulk::populate(client, NAMESPACE, n + 1, 32, |i| {
        (service(i, n), slice(i, n))
    })
    .await
    .map(drop)
}

/// What a proxy leaves behind once stopped, and must be removed after the measures: the
/// agent's pins (its tc links) or kube-proxy's guard (rules go with the namespace).
enum Runner {
    None,
    Svc(Box<SvcRunner>),
    KubeProxy(Box<KubeProxy>),
}

/// Fields drop in order: the agent (stopped already) before its pins.
struct SvcRunner {
    agent: Agent,
    _bpffs: Bpffs,
    _relay: ApiRelay,
    _logs: TempDir,
    _cgroup: TestCgroup,
}

/// One setup's namespaces, backends and proxy. Fields drop in declaration order: the proxy's
/// remains first, then the backends, then the client cgroup and the namespaces.
struct World {
    setup: Setup,
    _runner: Runner,
    _backends: Vec<Backend>,
    client_cgroup: TestCgroup,
    nodes: Nodes,
    probe: PathBuf,
    /// Spawn to ready (svc) or first sync (kube-proxy).
    ready: Duration,
}

impl World {
    fn build(setup: Setup, cp: &ControlPlane, tools: &Tools, args: &Args, n: u32) -> Result<World> {
        let nodes = Nodes::new()?;
        nodes.add_second_network()?;
        // The pods' network is routed through node 1, so that the client can reach them
        // directly, as it does in `none` and for non-service traffic; and node 2 sends pod
        // 2's replies to the client back through node 1, so that without translation too they
        // take the path a NodePort's replies take.
        nodes
            .client
            .ip(["route", "add", "10.244.0.0/16", "via", NODE1])?;
        nodes
            .node2
            .ip(["route", "add", &format!("{CLIENT}/32"), "via", NODE1])?;
        // Node 1 forwards out of the device it received on: an ICMP redirect would teach the
        // client and node 2 to skip it.
        for setting in [
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.eth0.send_redirects=0",
        ] {
            run(
                "ip",
                [
                    "netns",
                    "exec",
                    nodes.node1.name(),
                    "sysctl",
                    "-qw",
                    setting,
                ],
            )?;
        }
        let client_cgroup = TestCgroup::new()?;
        let threads = SERVER_THREADS.to_string();
        let backends = [
            (&nodes.pod1, "pod1", [POD1, POD1_B]),
            (&nodes.pod2, "pod2", [POD2, POD2_B]),
        ]
        .into_iter()
        .map(|(ns, name, ips)| {
            let at =
                ips.map(|ip| SocketAddr::new(ip.parse().expect("address literal"), TARGET_PORT));
            Backend::start_with(&tools.probe, ns, name, &at, &["--threads", &threads])
        })
        .collect::<Result<Vec<_>>>()?;
        let started = Instant::now();
        let runner = match setup {
            Setup::None => Runner::None,
            Setup::Proxy(ProxyKind::Svc) => start_svc(cp, tools, &nodes, &args.agent_arg)?,
            // This bench's XDP is svc with `--agent-arg=--xdp-mode=native`.
            Setup::Proxy(ProxyKind::SvcXdp) => {
                bail!("svc-xdp: use svc with --agent-arg=--xdp-mode=native")
            }
            Setup::Proxy(ProxyKind::KubeProxy(mode)) => {
                let bin = kube_proxy::binary_from_env()?;
                let mut kp =
                    KubeProxy::start(KubeProxyConfig::new(&bin, mode, NODE), cp, &nodes.node1)?;
                kp.quiet();
                kp.wait_ready(Duration::from_secs(args.sync_timeout_s))?;
                Runner::KubeProxy(Box::new(kp))
            }
        };
        let ready = started.elapsed();
        let mut world = World {
            setup,
            _runner: runner,
            _backends: backends,
            client_cgroup,
            nodes,
            probe: tools.probe.clone(),
            ready,
        };
        // Stopped once it has programmed everything: the datapath alone is measured.
        match &mut world._runner {
            Runner::Svc(svc) => {
                svc.agent.terminate(Duration::from_secs(10))?;
            }
            Runner::KubeProxy(kp) => kp.stop(Duration::from_secs(10))?,
            Runner::None => {}
        }
        world.check(n, args)?;
        Ok(world)
    }

    /// Where a measure's traffic goes in this setup.
    fn target(&self, m: Measure, n: u32) -> SocketAddr {
        let pod = |ip: &str| SocketAddr::new(ip.parse().expect("address literal"), TARGET_PORT);
        let node_port = |i: u32| {
            SocketAddr::new(
                IpAddr::V4(NODE1.parse().expect("address literal")),
                NODE_PORT_BASE + i as u16,
            )
        };
        match (self.setup, m.direct, m.remote) {
            (Setup::None, _, false) | (_, true, _) => pod(POD1),
            (Setup::None, _, true) => pod(POD2),
            (_, false, false) => node_port(0),
            (_, false, true) => node_port(n),
        }
    }

    /// Every chosen measure's target answers, by the backend it should, within a minute (the first
    /// packets also resolve the neighbours).
    fn check(&self, n: u32, args: &Args) -> Result<()> {
        let mut targets = Vec::new();
        for way in WAYS {
            for m in MEASURES
                .iter()
                .filter(|m| way.applies(**m, self.setup) && args.chosen(m, way))
            {
                targets.push((*m, self.target(*m, n)));
                if way == Way::Paired {
                    targets.push((*m, m.second_network_target()));
                }
            }
        }
        for (m, to) in targets {
            let want = if m.remote { "pod2" } else { "pod1" };
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let a: Vec<String> = vec![
                    if m.udp { "udp" } else { "tcp" }.into(),
                    "--to".into(),
                    to.to_string(),
                    "--timeout-ms".into(),
                    "1000".into(),
                    "--count".into(),
                    "1".into(),
                ];
                let r: Report = self.client(&a)?.wait(Duration::from_secs(20))?;
                if r.all_ok() && r.backends().contains_key(want) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "{}: {} to {to} does not reach {want}: {:?}",
                        self.setup.label(),
                        if m.udp { "UDP" } else { "TCP" },
                        r.results
                    );
                }
                interrupt::sleep(Duration::from_millis(200))?;
            }
        }
        Ok(())
    }

    /// svc's pins (its links among them), if svc runs here.
    fn bpffs(&self) -> Option<PathBuf> {
        match &self._runner {
            Runner::Svc(r) => Some(r._bpffs.path().to_path_buf()),
            _ => None,
        }
    }

    fn client(&self, args: &[String]) -> Result<ClientRun> {
        ClientRun::spawn(&self.probe, &self.client_cgroup, &self.nodes.client, args)
    }

    /// `m` for a few seconds, taken `way`, and, but for a paired measure (two targets), the
    /// seconds all CPUs spent busy meanwhile.
    fn measure(
        &self,
        m: Measure,
        n: u32,
        args: &Args,
        way: Way,
    ) -> Result<(LoopReport, Option<f64>, Option<ProgramTime>)> {
        let to = self.target(m, n);
        let mut a: Vec<String> = vec![
            "loop".into(),
            "--to".into(),
            to.to_string(),
            "--duration-ms".into(),
            (args.seconds * 1000).to_string(),
            "--interval-ms".into(),
            "0".into(),
            "--workers".into(),
            args.workers.to_string(),
            "--timeout-ms".into(),
            "1000".into(),
        ];
        if m.udp {
            a.push("--udp".into());
        }
        match way {
            Way::Sequential => {}
            Way::Paired => {
                a.push("--alternate-with".into());
                a.push(m.second_network_target().to_string());
            }
            Way::Cpu => {
                a.push("--rate".into());
                a.push(cpu_rate(m, (args.cpu_rate_tcp, args.cpu_rate_udp)).to_string());
            }
        }
        let pins = self
            .bpffs()
            .filter(|_| way != Way::Paired && args.program_time);
        let before = pins.as_deref().map(program_time).transpose()?;
        let clock = CpuClock::start()?;
        let r: LoopReport = self
            .client(&a)?
            .wait(Duration::from_secs(args.seconds + 30))?;
        let busy = clock.busy_s()?;
        let programs = match (before, pins.as_deref().map(program_time).transpose()?) {
            // No runs counted: bpf_stats are off (or nothing ran), not a free datapath.
            (Some((c0, n0)), Some((c1, n1))) if c1 > c0 => Some(ProgramTime {
                runs: c1.saturating_sub(c0),
                ns: n1.saturating_sub(n0),
                busy_s: busy,
            }),
            _ => None,
        };
        if r.netns_ino != self.nodes.client.inode()? {
            bail!("the client ran in the wrong network namespace");
        }
        if way == Way::Paired && r.alternate.is_none() {
            bail!("svc-probe loop --alternate-with reported one target only");
        }
        Ok((r, (way != Way::Paired).then_some(busy), programs))
    }
}

/// svc-agent inside node 1 on its `eth0`, reading the bench's API server through a relay on
/// node 1's loopback; returns once it is ready.
fn start_svc(cp: &ControlPlane, tools: &Tools, nodes: &Nodes, extra: &[String]) -> Result<Runner> {
    let upstream: SocketAddr = cp
        .server_url()
        .trim_start_matches("https://")
        .parse()
        .context("the API server's address")?;
    let relay = ApiRelay::start(&nodes.node1, upstream)?;
    let logs = TempDir::new("svc-nodeport-agent")?;
    let kubeconfig = logs.path().join("kubeconfig");
    let text = std::fs::read_to_string(cp.kubeconfig_path())?
        .replace(&cp.server_url(), &format!("https://{}", relay.addr()));
    std::fs::write(&kubeconfig, text)?;
    // The socket hooks need a cgroup: one of the bench's own, with nothing in it.
    let cgroup = TestCgroup::new()?;
    let bpffs = Bpffs::new(&tools.agent, cgroup.path())?;
    let mut args = kube_run_args(&kubeconfig, NODE, cgroup.path(), bpffs.path());
    // Always named: the programs attach to this namespace's eth0 and nowhere else.
    args.extend(["--devices".into(), "eth0".into()]);
    args.extend(extra.iter().map(Into::into));
    let launcher: [OsString; 2] = [
        "nsenter".into(),
        format!("--net={}", nodes.node1.path().display()).into(),
    ];
    let mut agent =
        Agent::start_launched(&launcher, &tools.agent, args, bpffs.path(), logs.path())?;
    agent.quiet();
    if let Err(e) = agent.wait_ready(AGENT_READY_TIMEOUT) {
        bail!("svc-agent not ready: {e:#}; log:\n{}", agent.log());
    }
    Ok(Runner::Svc(Box::new(SvcRunner {
        agent,
        _bpffs: bpffs,
        _relay: relay,
        _logs: logs,
        _cgroup: cgroup,
    })))
}

fn sample(
    (r, busy, programs): (&LoopReport, Option<f64>, Option<ProgramTime>),
    (m, way): (Measure, Way),
    setup: Setup,
    n: u32,
    round: u32,
) -> Sample {
    // Each exchange is two packets through node 1, the request and the reply.
    let per_exchange = if m.udp { 2.0 } else { 1.0 };
    let (per_s, base_per_s) = match &r.alternate {
        Some(other) => (
            r.per_busy_second() * per_exchange,
            Some(other.per_busy_second() * per_exchange),
        ),
        None => (r.per_second() * per_exchange, None),
    };
    let mut errors = r.errors.clone();
    let mut failed = r.failed;
    let mut ok = r.ok;
    if let Some(other) = &r.alternate {
        ok += other.ok;
        failed += other.failed;
        for (k, v) in &other.errors {
            *errors.entry(format!("second network: {k}")).or_default() += v;
        }
    }
    let cpu_us = busy.map(|b| b * 1e6 / r.ok.max(1) as f64);
    Sample {
        services: n,
        round,
        setup: setup.id().into(),
        measure: way.id(m),
        per_s,
        base_per_s,
        ok,
        failed,
        errors,
        cpu_us,
        programs,
    }
}

/// A paired measure's ratios (through eth0 ÷ through the second network), median over rounds
/// with (min, max).
fn pair_ratio(samples: &[Sample], n: u32, setup: &str, m: Measure) -> Option<[f64; 3]> {
    let id = Way::Paired.id(m);
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| s.services == n && s.setup == setup && s.measure == id)
        .filter_map(|s| {
            let base = s.base_per_s?;
            (base > 0.0).then(|| s.per_s / base)
        })
        .collect();
    report::spread(v)
}

fn values(samples: &[Sample], n: u32, setup: &str, measure: &str) -> Vec<f64> {
    samples
        .iter()
        .filter(|s| s.services == n && s.setup == setup && s.measure == measure)
        .map(|s| s.per_s)
        .collect()
}

/// Median over rounds of `setup`'s `m` divided by `none`'s baseline of the same round.
fn ratio(samples: &[Sample], n: u32, setup: &str, m: Measure) -> Option<[f64; 3]> {
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| s.services == n && s.setup == setup && s.measure == m.id)
        .filter_map(|s| {
            let base = samples.iter().find(|o| {
                o.services == n
                    && o.round == s.round
                    && o.setup == "none"
                    && o.measure == m.baseline()
            })?;
            (base.per_s > 0.0).then(|| s.per_s / base.per_s)
        })
        .collect();
    report::spread(v)
}

/// `setup`'s fixed-rate measure of `m`, round by round: (its CPU time per exchange, `none`'s
/// of the same traffic without translation (`Measure::baseline`) in the same round), µs.
fn cpu_rounds(samples: &[Sample], n: u32, setup: &str, m: Measure) -> Vec<(f64, f64)> {
    let id = Way::Cpu.id(m);
    let base_id = Way::Cpu.id(measure(m.baseline()));
    samples
        .iter()
        .filter(|s| s.services == n && s.setup == setup && s.measure == id)
        .filter_map(|s| {
            let base = samples.iter().find(|o| {
                o.services == n && o.round == s.round && o.setup == "none" && o.measure == base_id
            })?;
            Some((s.cpu_us?, base.cpu_us?))
        })
        .collect()
}

/// A fixed-rate measure's ratios: `none`'s CPU time per exchange ÷ `setup`'s, round by round
/// (`cpu_rounds`), median over rounds with (min, max). Below 1 where `setup` costs more.
fn cpu_ratio(samples: &[Sample], n: u32, setup: &str, m: Measure) -> Option<[f64; 3]> {
    report::spread(
        cpu_rounds(samples, n, setup, m)
            .into_iter()
            .map(|(cpu, base)| base / cpu)
            .collect(),
    )
}

/// The fixed-rate measure carried to a saturated machine: svc's CPU time per exchange beyond
/// no translation's at the fixed rate (the same round), X, beside no translation's CPU time
/// per exchange in its saturated sequential loop, C (median over rounds): C / (C + X), median
/// over rounds with (min, max). The fixed-rate ratio itself understates the cost: below
/// capacity both paths also pay for waking up between exchanges, which a saturated loop does
/// not. It assumes X does not depend on the rate.
fn projected_ratio(r: &Recorded, n: u32, setup: &str, m: Measure) -> Option<[f64; 3]> {
    let samples = &r.samples[..];
    let saturated: Vec<f64> = samples
        .iter()
        .filter(|s| s.services == n && s.setup == "none" && s.measure == m.baseline())
        .filter_map(|s| s.cpu_us)
        .collect();
    let saturated_us = match report::spread(saturated) {
        Some([c, ..]) => c,
        // A run from before the sequential measures read the CPU time: all CPUs busy.
        None => {
            let per_exchange = if m.udp { 2.0 } else { 1.0 };
            let [rate, ..] = report::spread(values(samples, n, "none", m.baseline()))?;
            f64::from(r.cpus.max(1)) * 1e6 / (rate / per_exchange)
        }
    };
    report::spread(
        cpu_rounds(samples, n, setup, m)
            .into_iter()
            .map(|(cpu, base)| saturated_us / (saturated_us + cpu - base))
            .collect(),
    )
}

/// The first line `program args` prints, or why there is none.
fn version(program: &str, args: &[&str]) -> String {
    match std::process::Command::new(program).args(args).output() {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string(),
        Err(e) => format!("{program}: {e}"),
    }
}

/// What the figures were measured with: svc's commit, kube-proxy's and the firewalls'
/// versions.
fn versions() -> String {
    let commit = version("git", &["rev-parse", "--short", "HEAD"]);
    let kube_proxy = kube_proxy::binary_from_env()
        .map(|b| version(&b.display().to_string(), &["--version"]))
        .unwrap_or_else(|e| format!("{e:#}"));
    format!(
        "svc at commit {commit} (release build); {kube_proxy}; {} and {}; {}",
        version("xtables-nft-multi", &["iptables", "--version"]),
        version("xtables-legacy-multi", &["iptables", "--version"]),
        version("nft", &["--version"]),
    )
}

/// A run as `--json` saves it, with what its section says besides the samples, so that
/// `--from-json` writes the section of a run again as it was measured.
#[derive(Serialize, Deserialize)]
struct Recorded {
    samples: Vec<Sample>,
    failed_setups: Vec<String>,
    setups: Vec<String>,
    services: Vec<u32>,
    rounds: u32,
    seconds: u64,
    workers: u32,
    cpu_rate_tcp: u64,
    cpu_rate_udp: u64,
    /// The machine's CPUs (for the CPU time of an exchange at saturation).
    cpus: u32,
    /// (Services, setup id, seconds from start to programmed).
    ready: Vec<(u32, String, f64)>,
    /// Load averages before and after the measures.
    load: (String, String),
    command: String,
    machine: String,
    date: String,
    versions: String,
    per_packet: Option<String>,
}

impl Recorded {
    fn setups(&self) -> Result<Vec<Setup>> {
        self.setups
            .iter()
            .map(|p| Setup::parse(p).with_context(|| format!("unknown setup {p:?}")))
            .collect()
    }

    /// Seconds from start to programmed of `setup` at `n` Services.
    fn ready(&self, n: u32, setup: Setup) -> Option<f64> {
        self.ready
            .iter()
            .find(|(m, id, _)| *m == n && id == setup.id())
            .map(|r| r.2)
    }
}

/// The command that made this run, as its section names it.
fn command(args: &Args) -> String {
    // What `cargo xtask bench --nodeport [--quick]` passes besides output paths is `--quick`;
    // any other run names the bench itself with the arguments that shaped it.
    let shaping = report::shaping_arguments(&["--json", "--write", "--per-packet", "--profile"]);
    if shaping.is_empty() || shaping == ["--quick"] {
        format!(
            "cargo xtask bench --nodeport{}",
            if args.quick { " --quick" } else { "" }
        )
    } else {
        format!("svc-nodeport-bench {}", shaping.join(" "))
    }
}

fn markdown(r: &Recorded) -> Result<String> {
    let setups = r.setups()?;
    let samples = &r.samples[..];
    let mut out =
        String::from("## Packet datapath: NodePort traffic per second, and per-packet cost\n\n");
    let _ = writeln!(
        out,
        "Measured with `{}` on {}, {}; load average {} before the \
         measures, {} after. Versions: {}; kube-proxy with its default configuration. How it \
         is measured: `tests/src/bin/svc-nodeport-bench.rs`.\n",
        r.command, r.machine, r.date, r.load.0, r.load.1, r.versions,
    );
    out += "**Topology.** Every setup has network namespaces of its own with the same \
            addresses (`tests/src/topology.rs`): an external client on a bridge (the node \
            network) with node 1 (uplink `eth0`, 10.77.0.1) and node 2; pod 1 behind node 1, \
            pod 2 behind node 2. The client routes the pods' network through node 1. Setups: \
            **no translation** (no proxy: the client connects to the pod itself, routed \
            through node 1); **svc** (svc-agent with `--devices eth0` in node 1: its tc \
            programs translate); **kube-proxy** in iptables mode on iptables-nft (Debian's \
            default `iptables`) and on iptables-legacy, and in nftables mode, each run inside \
            node 1's namespace (`nsenter --net`) so that its rules act there. All read the \
            same Services and EndpointSlices from one kube-apiserver. Once a proxy has \
            programmed them (svc: ready; kube-proxy: its first sync of both families) it is \
            stopped, leaving its pinned programs or its rules in place: the datapath alone \
            is measured, and no proxy's periodic resync falls into another's measurement. \
            Each is checked to answer through every target before the measures.\n\n";
    let _ = writeln!(
        out,
        "**Services.** N NodePort Services (ports 20000 upwards; the API server's \
         `--service-node-port-range` is {NODE_PORT_RANGE}) of one TCP port each, with one \
         endpoint, pod 1 on node 1; the one measured also has a UDP port; plus one more \
         Service, TCP and UDP, whose endpoint is pod 2 on node 2 (the remote rows). \
         externalTrafficPolicy is Cluster: kube-proxy masquerades every NodePort flow, local \
         backend or not (its KUBE-EXT/external chains), where svc keeps the client's address \
         for a local backend and SNATs only to reach another node.\n"
    );
    let _ = writeln!(
        out,
        "**Measures.** {} rounds; in each, every setup in turn (the order rotates), each \
         measure for {} s by `svc-probe loop` with {} workers from the client namespace, \
         against `svc-probe serve --threads {SERVER_THREADS}` in the pod. New TCP connections: \
         connect, a line and its answer, close with RST (no TIME_WAIT); each a new flow, so it \
         exercises the new-flow path (svc: service lookup, backend choice, connection-tracking \
         entry; kube-proxy: the nat table's chains and conntrack). UDP: each worker keeps one \
         socket, one flow, and sends a datagram as soon as the previous one was answered; the \
         figure counts the request and the reply, so it is packets forwarded by node 1 per \
         second, and, after the first, every packet is a connection-tracking hit. \
         Non-service traffic: new TCP connections to pod 1 itself, through node 1, in every \
         setup. Each cell is the median over rounds with (min–max); `× none` is the figure \
         divided by no translation's of the same round (for non-service traffic: its direct \
         connections to pod 1), median over rounds with (min–max). Without translation the \
         remote rows' baseline goes to pod 2 itself (no SNAT); node 2 routes the client \
         through node 1, and node 1 sends no ICMP redirects, so its packets take the hops a \
         NodePort's take. In each setup's turn non-service traffic is measured first (its own \
         NodePort flows are then tens of seconds old) and again right after the NodePort's \
         connections, when the client reuses source ports of flows closed a moment ago.\n",
        r.rounds, r.seconds, r.workers
    );
    out += "**Paired measures.** A 2-core VM's speed drifts by more than the targets between \
            measures taken seconds apart: the rounds above spread over a fifth of their median. \
            So each round also measures no translation and svc side by side, as the socket \
            bench does. Each topology has a second node network beside the lan (bridge `br1`, \
            `eth1` in the client and both nodes, 10.78.0.0/24), and each pod a second address \
            (10.245.1.2, 10.245.2.2) that the client reaches through node 1's `eth1`, node 1 \
            routing pod 2's over it to node 2 and node 2 sending the replies back through node \
            1: the hops of the lan's traffic, through devices no program is attached to. Every \
            worker of one `svc-probe loop --alternate-with` alternates attempt by attempt \
            between the measure's target through `eth0` and the same pod's second address (for \
            UDP, one socket for each), so both see the machine at the same moments. A target's \
            rate is its answered attempts per second of the time the workers spent on them (a \
            failed attempt's time, a one-second timeout, is left out; failures are listed). The \
            ratio is svc's path over the second network's, per round. The same is measured \
            without translation (both paths without programs): the control, which shows how \
            far the two networks differ by themselves (for non-service traffic, the control's \
            local TCP row is the same traffic). The paired ratio is steady but not the whole \
            cost: the two targets' attempts share each other's waits for the CPU, which pulls \
            their ratio towards 1 (blocks of 50-250 ms, every worker on one target at a time, \
            avoid that, and were as noisy as the sequential rounds here): it can show a target \
            missed, not met by itself. Not for \
            kube-proxy: its rules act on every device of node 1, the second network's too.\n\n";
    let _ = writeln!(
        out,
        "**Fixed-rate measures (CPU time).** Each round also sends the same traffic without \
         translation and through svc at a fixed rate, below what either path sustains \
         ({} new TCP connections or {} UDP exchanges a second, `svc-probe loop --rate`, each \
         worker on a schedule of its own), and reads the CPU time all CPUs spent meanwhile: \
         the wall-clock time times the CPUs, less the idle, iowait and steal time of \
         /proc/stat, which the kernel measures at each entry to and exit from idle (its busy \
         counts are sampled at the timer tick, which a load paced by timers aliases with: one \
         path measured 28-175 µs a connection by them). The CPU time per connection or \
         exchange is the whole machine's (client, nodes, pods), as in the rates above, but \
         nobody waits long for a CPU, so neither path's cost falls on the other's measure (the \
         paired measure's bias). Below capacity, though, both paths also pay for waking up \
         between exchanges, which a saturated loop does not; that pulls the ratio of the two \
         towards 1 as well. So svc's extra CPU time per exchange (X, svc's less no \
         translation's in the same round) is carried to saturation: C / (C + X), where C is no \
         translation's CPU time per exchange in its saturated sequential loop (median over \
         rounds). That is the \
         rate svc reaches relative to no translation where CPU limits both, if X does not \
         depend on the rate.\n",
        r.cpu_rate_tcp, r.cpu_rate_udp
    );
    for &n in &r.services {
        let _ = writeln!(
            out,
            "### {n} NodePort Service{} (+1 remote)\n",
            if n == 1 { "" } else { "s" }
        );
        out += &report::table_header(
            setups
                .iter()
                .map(|st| (st.label(), (*st != Setup::None).then_some("× none"))),
        );
        for m in MEASURES {
            out += &format!("| {} |", m.name);
            for st in &setups {
                let cell = if m.applies_to(*st) {
                    fmt3(report::spread(values(samples, n, st.id(), m.id)), 0)
                } else {
                    "(= the DNAT row: to pod 1)".into()
                };
                out += &format!(" {cell} |");
                if *st != Setup::None {
                    out += &format!(" {} |", fmt3(ratio(samples, n, st.id(), *m), 3));
                }
            }
            out += "\n";
        }
        out += &paired_table(&setups, samples, n);
        out += &cpu_table(r, &setups, n);
        let ready: Vec<String> = setups
            .iter()
            .filter(|st| **st != Setup::None)
            .filter_map(|st| r.ready(n, *st).map(|t| format!("{} {t:.1} s", st.label())))
            .collect();
        if !ready.is_empty() {
            let _ = writeln!(
                out,
                "\nFrom start to programmed (svc: ready; kube-proxy: first sync), once: {}.",
                ready.join(", ")
            );
        }
        let failed: Vec<String> = samples
            .iter()
            .filter(|x| x.services == n && x.failed > 0)
            .map(|x| {
                format!(
                    "{} {} round {}: {} of {} failed ({:?})",
                    x.setup,
                    x.measure,
                    x.round + 1,
                    x.failed,
                    x.ok + x.failed,
                    x.errors
                )
            })
            .collect();
        if !failed.is_empty() {
            out += "\nAttempts that failed (the rates count answered ones only):\n\n";
            for f in failed {
                let _ = writeln!(out, "- {f}");
            }
        }
        out += "\n";
    }
    out += &targets(r);
    out += &findings(samples);
    if !r.failed_setups.is_empty() {
        out += "\nSetups that gave no figures (left out above):\n\n";
        for f in &r.failed_setups {
            let _ = writeln!(out, "- {f}");
        }
    }
    if let Some(table) = &r.per_packet {
        out += "\n### Per-packet cost of each tc path (BPF_PROG_TEST_RUN)\n\n";
        out += "Measured by the same command, before the traffic above, with \
                `cargo test --release -p svc-ebpf-tests --test fixtures per_packet_cost -- \
                --ignored` (the release-built kernel object, as root). The programs run in the \
                fixture tables' network namespace and maps (about 30 frontends). Each cell is \
                the program's own mean run time by bpf_stats over single runs, each on a fresh \
                copy of its packet (new flows: distinct client ports). Not the test run's \
                `repeat`: it runs the program again on the packet the run before rewrote, so a \
                translated row would measure the translated packet's path. bpf_stats add their \
                own clock read. Two columns: **in cache**, 2,000 runs with the fixture's maps \
                of 1,024 entries, what the code costs; **CPU's own caches evicted, full table**, \
                1,000 runs with the connection-tracking table at the agent's default size \
                (262,144 entries), filled with other clients' flows before the runs (so each \
                new flow evicts, as in busy traffic), and before each run the caches private \
                to the CPU (L1, L2) emptied by reading four times their size: what cache and \
                TLB misses add, as when other connections' work runs between two packets of a \
                flow (the shared L3 keeps part of what it held). Real traffic pays about the \
                second (see where the time goes).\n\n";
        out += table.trim();
        out += "\n";
    }
    Ok(out)
}

/// The paired measures of `n` Services: each target's rate per second spent on it, and their
/// ratio, for the control (`none`) and svc.
fn paired_table(setups: &[Setup], samples: &[Sample], n: u32) -> String {
    let svc = Setup::Proxy(ProxyKind::Svc);
    if !setups.contains(&svc) {
        return String::new();
    }
    let mut out = String::from(
        "\nThe same traffic, alternating attempt by attempt between the path through node 1's \
         `eth0` and the same pod through the second network, which no program sees (paired; \
         the ratio understates svc's cost, see above):\n\n\
         | measure | no translation: through eth0 /s | second network /s | ratio (control) | \
         svc: through eth0 /s | second network /s | svc × no svc |\n\
         |---|---|---|---|---|---|---|\n",
    );
    let rates = |setup: Setup, id: &str, base: bool| -> Option<[f64; 3]> {
        report::spread(
            samples
                .iter()
                .filter(|x| x.services == n && x.setup == setup.id() && x.measure == id)
                .filter_map(|x| if base { x.base_per_s } else { Some(x.per_s) })
                .collect(),
        )
    };
    for m in MEASURES.iter().filter(|m| Way::Paired.applies(**m, svc)) {
        let _ = write!(out, "| {} |", m.name);
        let id = Way::Paired.id(*m);
        for setup in [Setup::None, svc] {
            if Way::Paired.applies(*m, setup) {
                let _ = write!(
                    out,
                    " {} | {} | {} |",
                    fmt3(rates(setup, &id, false), 0),
                    fmt3(rates(setup, &id, true), 0),
                    fmt3(pair_ratio(samples, n, setup.id(), *m), 3)
                );
            } else {
                out += " (= the DNAT row) | | |";
            }
        }
        out += "\n";
    }
    out
}

/// The fixed-rate measures of `n` Services: the machine's CPU time per exchange without
/// translation and through svc, and their ratio.
fn cpu_table(r: &Recorded, setups: &[Setup], n: u32) -> String {
    let samples = &r.samples[..];
    let svc = Setup::Proxy(ProxyKind::Svc);
    if !setups.contains(&svc) || !setups.contains(&Setup::None) {
        return String::new();
    }
    let mut out = String::from(
        "\nThe same traffic at a fixed rate below what either path sustains; the machine's \
         CPU time (all of it: client, nodes, pods) per connection or UDP exchange, and the \
         rate achieved. `none ÷ svc` is no translation's CPU time per exchange divided by \
         svc's, round by round. Carried to saturation: svc's extra CPU time per exchange \
         added to what no translation's costs when its loop saturates the CPUs (see above).\n\n\
         | measure | offered /s | no translation: µs of CPU each | achieved /s | svc: µs of CPU \
         each | achieved /s | none ÷ svc | carried to saturation |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let of = |setup: Setup, id: &str, f: fn(&Sample) -> Option<f64>, digits: usize| {
        fmt3(
            report::spread(
                samples
                    .iter()
                    .filter(|x| x.services == n && x.setup == setup.id() && x.measure == id)
                    .filter_map(f)
                    .collect(),
            ),
            digits,
        )
    };
    for m in MEASURES.iter().filter(|m| Way::Cpu.applies(**m, svc)) {
        let id = Way::Cpu.id(*m);
        let base = Way::Cpu.id(measure(m.baseline()));
        // A UDP measure's rate counts packets (two an exchange); the offer counts exchanges.
        let per = if m.udp { 2 } else { 1 };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            m.name,
            cpu_rate(*m, (r.cpu_rate_tcp, r.cpu_rate_udp)) * per,
            of(Setup::None, &base, |x| x.cpu_us, 1),
            of(Setup::None, &base, |x| Some(x.per_s), 0),
            of(svc, &id, |x| x.cpu_us, 1),
            of(svc, &id, |x| Some(x.per_s), 0),
            fmt3(cpu_ratio(samples, n, svc.id(), *m), 3),
            fmt3(projected_ratio(r, n, svc.id(), *m), 3),
        );
    }
    out
}

/// Why svc's figures fall short where they do, when they do: what was found out in this
/// benchmark's making (the reasons are in svc-ebpf's code; the run shows whether they still
/// apply).
fn findings(samples: &[Sample]) -> String {
    let svc = ProxyKind::Svc.id();
    let failed = |measure: &str| -> (u64, u64) {
        samples
            .iter()
            .filter(|s| s.setup == svc && s.measure == measure)
            .fold((0, 0), |(f, all), s| (f + s.failed, all + s.ok + s.failed))
    };
    let mut out = String::new();
    let (f, all) = failed("tcp-direct-after");
    if f > 0 {
        let _ = writeln!(
            out,
            "\n**svc failed non-service connections that reuse a client port of a NodePort \
             flow closed a moment before** ({f} of {all} attempts failed in this run). A \
             NodePort flow to a local backend is DNATed only, so its REPLY entry is the reply \
             tuple of a later direct connection from the same client port to pod 1; the \
             answer to its SYN, leaving by the external egress, removes the closed flow's \
             entries it meets (`ct::ANSWER`, svc-ebpf/src/ct.rs), and a failure here means \
             that did not happen."
        );
    }
    let (f, all) = failed("tcp-remote");
    if f > 0 {
        let _ = writeln!(
            out,
            "\n**svc failed new connections to the remote backend** ({f} of {all} attempts \
             failed in this run; the error counts are in the list above). Such a flow takes a \
             source port of its own from the SNAT range (default 61001-65535: 4,535 ports); \
             a closed flow's port is reclaimed for a new flow when 4 random tries find no \
             free one, or at once while the range is busy (`create_snat`, \
             svc-ebpf/src/ct.rs), so new flows are dropped only \
             when most of the range is held by open flows to one backend (with 90 % open, \
             about 3 % of new flows meet open ones in all their 32 tries), and such a drop is \
             counted \
             (`svc_packet_decisions_total`, reason `drop_snat_exhausted`). This run does not say which \
             of its packets were lost."
        );
    }
    out
}

/// The targets, each met or missed with its figures: the fixed-rate measure's CPU
/// time (unbiased), the paired measure divided by its control (biased towards 1: it can show
/// a target missed, not met by itself), and the sequential rounds' ratio (shown, not judged:
/// it drifts by more than the targets).
fn targets(r: &Recorded) -> String {
    let samples = &r.samples[..];
    let mut out = String::from(
        "**Targets** (medians over rounds; met when the fixed-rate measure carried to \
         saturation and the paired ratio divided by its control both reach the target; missed \
         when the fixed-rate measure carried to saturation does not; not shown when only the \
         paired ratio falls short. The fixed-rate ratio as measured, and the sequential \
         rounds' `× none`, are shown beside them; they do not judge: the first understates the \
         cost, the second spreads wider than the targets' margins. Lines \"by program time\" \
         judge by svc's programs' own run time (bpf_stats, held through the whole run) as a \
         share of the machine's busy CPU in svc's saturated measure: what they take from the \
         rest of the path, measured directly rather than as a difference of two noisy rates; \
         a first-order figure, as it leaves out the cache misses the programs cause in the \
         rest of the stack, and includes bpf_stats' own two clock reads a run):\n\n",
    );
    let svc = ProxyKind::Svc.id();
    let sequential = |n: u32, id: &str| match ratio(samples, n, svc, measure(id)) {
        Some([r, ..]) => format!("{r:.3}"),
        None => "—".into(),
    };
    for &n in &r.services {
        for id in TARGET_MEASURES {
            let m = measure(id);
            let cpu = cpu_ratio(samples, n, svc, m);
            let carried = projected_ratio(r, n, svc, m);
            let pair = pair_ratio(samples, n, svc, m);
            if carried.is_none() && pair.is_none() {
                continue;
            }
            // Direct connections to pod 1 in `none` are the control's local TCP row.
            let control_of = if m.direct { measure("tcp-local") } else { m };
            let control = pair_ratio(samples, n, "none", control_of).map(|[c, ..]| c);
            let corrected = match (pair, control) {
                (Some([r, ..]), Some(c)) => Some(r / c),
                _ => None,
            };
            let target = if m.direct { 0.98 } else { 0.90 };
            let verdict = match (carried, corrected) {
                (Some([c, ..]), _) if c < target => "**missed**",
                (Some(_), Some(k)) if k >= target => "met",
                (Some(_), _) | (None, _) => "**not shown**",
            };
            let seq = if m.direct {
                format!(
                    "{}; right after the NodePort's connections {}",
                    sequential(n, "tcp-direct"),
                    sequential(n, "tcp-direct-after")
                )
            } else {
                sequential(n, id)
            };
            let _ = writeln!(
                out,
                "- {n} Services, {}: svc at {} of {}{} by CPU time at a fixed rate carried to \
                 saturation ({} as measured); paired {}{} (target ≥ {target:.2}; sequential \
                 rounds {seq}): {verdict}",
                m.name,
                fmt3(carried, 3),
                if m.direct {
                    "no svc at all"
                } else {
                    "no translation"
                },
                if m.remote {
                    " (whose path has no SNAT)"
                } else {
                    ""
                },
                fmt3(cpu, 3),
                fmt3(pair, 3),
                match (control, corrected) {
                    (Some(c), Some(k)) => format!(", {k:.3} divided by its control ({c:.3})"),
                    _ => ", no control measured".into(),
                },
            );
        }
        for id in TARGET_MEASURES {
            if let Some(line) = program_line(samples, n, measure(id)) {
                out += &line;
            }
        }
        for kp in [
            Mode::Iptables(IptablesBackend::Nft),
            Mode::Iptables(IptablesBackend::Legacy),
            Mode::Nftables,
        ] {
            for id in ["tcp-local", "udp-local"] {
                let m = measure(id);
                let med =
                    |setup: &str| report::spread(values(samples, n, setup, id)).map(|[m, ..]| m);
                if let (Some(a), Some(b)) = (med(svc), med(kp.id())) {
                    let _ = writeln!(
                        out,
                        "- {n} Services, {}: svc {a:.0}, {} {b:.0}: svc {} ({:.2}×)",
                        m.name,
                        kp.label(),
                        if a > b { "ahead" } else { "**behind**" },
                        a / b
                    );
                }
            }
        }
    }
    out
}

/// The target of measure `m` judged by svc's programs' own run time (bpf_stats) as a share
/// of the busy CPU in its saturated sequential measure: the programs took that share from
/// everything else, so svc runs at (1 − share) of what the same path would without them, to
/// first order (a miss of the cache they cause in the rest of the stack is not in it, a
/// program's own is). For a remote backend the programs also forward the packet themselves,
/// work the stack does without them: the share is then an upper bound, which can show the
/// target met, not missed. Beside it, the share and the time per exchange at the fixed rate.
fn program_line(samples: &[Sample], n: u32, m: Measure) -> Option<String> {
    let svc = ProxyKind::Svc.id();
    let taken = |way: Way| -> Vec<(ProgramTime, u64)> {
        samples
            .iter()
            .filter(|s| s.services == n && s.setup == svc && s.measure == way.id(m))
            .filter_map(|s| Some((s.programs?, s.ok)))
            .collect()
    };
    let saturated = taken(Way::Sequential);
    let share = report::spread(saturated.iter().map(|(p, _)| p.share()).collect())?;
    let fixed = taken(Way::Cpu);
    let fixed_share = report::spread(fixed.iter().map(|(p, _)| p.share()).collect());
    let per_exchange = report::spread(
        fixed
            .iter()
            .chain(&saturated)
            .filter(|(_, ok)| *ok > 0)
            .map(|(p, ok)| p.ns as f64 / *ok as f64)
            .collect(),
    )?;
    let runs = report::spread(
        saturated
            .iter()
            .filter(|(_, ok)| *ok > 0)
            .map(|(p, ok)| p.runs as f64 / *ok as f64)
            .collect(),
    )?;
    let target = if m.direct { 0.98 } else { 0.90 };
    let pct =
        |[a, lo, hi]: [f64; 3]| format!("{:.2}% ({:.2}–{:.2}%)", 100.0 * a, 100.0 * lo, 100.0 * hi);
    Some(format!(
        "- {n} Services, {}: svc's programs took {} of the busy CPU at saturation, so svc at \
         {:.3} of {} by program time (target ≥ {target:.2}): {}; at the fixed rate {}; {:.0} ns \
         and {:.1} runs per exchange\n",
        m.name,
        pct(share),
        1.0 - share[0],
        if m.direct {
            "no svc at all"
        } else {
            "no translation"
        },
        match (1.0 - share[0] >= target, m.remote) {
            (true, _) => "met",
            (false, false) => "**missed**",
            // svc forwards these packets itself (route lookup, neighbour, redirect): its
            // programs do work the stack does in no translation, so the share is an upper
            // bound of what svc adds.
            (false, true) =>
                "**not shown** (an upper bound: svc forwards these packets \
                              itself, work the stack does without it)",
        },
        fixed_share.map_or_else(|| "not measured".into(), pct),
        per_exchange[0],
        runs[0],
    ))
}

fn main() -> ExitCode {
    interrupt::run(bench)
}

fn bench() -> Result<()> {
    let mut args = Args::parse();
    if let Some(path) = &args.from_json {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let recorded: Recorded = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a run `--json` saved", path.display()))?;
        args.json = None;
        return publish(&recorded, &args);
    }
    require_root();
    if args.quick {
        args.services = vec![1, 1000];
        args.rounds = 3;
        args.seconds = 1;
    }
    let setups: Vec<Setup> = if args.setups.is_empty() {
        vec![
            Setup::None,
            Setup::Proxy(ProxyKind::Svc),
            Setup::Proxy(ProxyKind::KubeProxy(Mode::Iptables(IptablesBackend::Nft))),
            Setup::Proxy(ProxyKind::KubeProxy(Mode::Iptables(
                IptablesBackend::Legacy,
            ))),
            Setup::Proxy(ProxyKind::KubeProxy(Mode::Nftables)),
        ]
    } else {
        args.setups
            .iter()
            .map(|p| Setup::parse(p).with_context(|| format!("unknown setup {p:?}")))
            .collect::<Result<_>>()?
    };
    for id in &args.measures {
        if !WAYS
            .iter()
            .any(|way| MEASURES.iter().any(|m| way.id(*m) == *id))
        {
            bail!("unknown measure {id:?}");
        }
    }
    let against_none = [Way::Sequential, Way::Cpu]
        .iter()
        .any(|way| MEASURES.iter().any(|m| args.chosen(m, *way)));
    if !setups.contains(&Setup::None) && against_none {
        bail!("--setups must include none: every ratio but the paired measures' is against it");
    }
    for &n in &args.services {
        if n == 0 || n + 1 > 32767 - u32::from(NODE_PORT_BASE) {
            bail!("--services {n}: between 1 and 12,766 (the NodePort range)");
        }
    }
    let per_packet = match &args.per_packet {
        Some(p) => {
            Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
        }
        None => None,
    };
    let tools = Tools::locate();
    let mut firewall = HostFirewallGuard::new()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut samples = Vec::new();
    let mut failures = Vec::new();
    let mut ready = Vec::new();
    let load_before = report::load_average();
    // Held for the whole run: every measure of svc's setup reads its programs' run time. Two
    // clock reads per run add to svc's side only (tens of ns a run).
    let _bpf_stats = match BpfStats::enable() {
        Ok(s) => Some(s),
        Err(e) if args.profile.is_some() => return Err(e),
        Err(e) => {
            eprintln!("svc's program time is not measured: {e:#}");
            None
        }
    };
    // Read through bpftool; without it, or without bpf_stats, the rates are still measured.
    args.program_time = _bpf_stats.is_some() && run("bpftool", ["version"]).is_ok();
    if !args.program_time {
        eprintln!("svc's program time is not measured: no bpf_stats, or no bpftool");
    }
    for &n in &args.services {
        interrupt::check()?;
        let cp = ControlPlane::start_with_node_port_range(NODE_PORT_RANGE)
            .context("starting the control plane")?;
        for (name, ip) in [(NODE, NODE1), (REMOTE_NODE, NODE2)] {
            cp.create_node(name, ip)?;
        }
        let client = rt.block_on(svc_agent::source::kube::client(Some(cp.kubeconfig_path())))?;
        let t = Instant::now();
        interrupt::block_on(&rt, populate(client, n))?;
        eprintln!(
            "{} Services and slices created in {:.1} s",
            n + 1,
            t.elapsed().as_secs_f64()
        );
        // One setup at a time, so a kube-proxy's first sync has the machine to itself.
        let mut worlds = Vec::new();
        for &setup in &setups {
            interrupt::check()?;
            eprintln!("  {} ({n} Services): setting up", setup.label());
            match World::build(setup, &cp, &tools, &args, n) {
                Ok(w) => {
                    eprintln!("    programmed in {:.1} s", w.ready.as_secs_f64());
                    ready.push((n, setup.id().to_owned(), w.ready.as_secs_f64()));
                    worlds.push(w);
                }
                // A setup failed by a stop is no result: the run ends.
                Err(e) if interrupt::requested().is_some() => return Err(e),
                Err(e) => {
                    eprintln!("    failed: {e:#}");
                    let text = format!("{e:#}");
                    let first = text.split("; log:").next().unwrap_or_default().trim();
                    failures.push(format!("{}, {n} Services: {first}", setup.label()));
                    if setup == Setup::None {
                        bail!("the baseline could not be set up: {e:#}");
                    }
                }
            }
        }
        // Nothing else of the bench's needs the API server any more.
        drop(cp);
        for round in 0..args.rounds {
            eprintln!("  {n} Services, round {}", round + 1);
            let k = worlds.len();
            for j in 0..k {
                let w = &worlds[(j + round as usize) % k];
                let taken = WAYS.iter().flat_map(|way| {
                    MEASURES
                        .iter()
                        .filter(|m| way.applies(**m, w.setup) && args.chosen(m, *way))
                        .map(|m| (*m, *way))
                });
                for (m, way) in taken {
                    interrupt::check()?;
                    let profile = match &args.profile {
                        Some(dir) => Some(Profile::start(
                            dir,
                            format!("{n}-{}-{}-r{}", w.setup.id(), way.id(m), round + 1),
                            w.bpffs(),
                            args.seconds,
                        )?),
                        None => None,
                    };
                    let (r, busy, programs) = w.measure(m, n, &args, way)?;
                    let profiled = match profile {
                        Some(p) => Some(p.finish(r.ok)?),
                        None => None,
                    };
                    let s = sample((&r, busy, programs), (m, way), w.setup, n, round);
                    eprintln!(
                        "    {:<28} {:<16} {:>9.0}/s{}{}",
                        w.setup.id(),
                        s.measure,
                        s.per_s,
                        match (s.base_per_s, s.cpu_us) {
                            (Some(b), _) => {
                                format!(", second network {b:.0}/s: {:.3}", s.per_s / b)
                            }
                            (None, Some(c)) => format!(", {c:.1} µs of CPU each"),
                            (None, None) => String::new(),
                        },
                        match (s.failed, s.programs) {
                            (0, None) => String::new(),
                            (0, Some(p)) => format!(", svc's programs {:.2}%", 100.0 * p.share()),
                            (f, _) => format!(" ({f} failed)"),
                        },
                    );
                    if let Some(line) = profiled {
                        eprintln!("      {line}");
                    }
                    samples.push(s);
                }
            }
        }
        drop(worlds);
    }
    let load_after = report::load_average();
    firewall.check()?;
    let recorded = Recorded {
        samples,
        failed_setups: failures,
        setups: setups.iter().map(|s| s.id().to_owned()).collect(),
        services: args.services.clone(),
        rounds: args.rounds,
        seconds: args.seconds,
        workers: args.workers,
        cpu_rate_tcp: args.cpu_rate_tcp,
        cpu_rate_udp: args.cpu_rate_udp,
        cpus: std::thread::available_parallelism().map_or(1, |c| c.get() as u32),
        ready,
        load: (load_before, load_after),
        command: command(&args),
        machine: report::machine(),
        date: report::today(),
        versions: versions(),
        per_packet,
    };
    publish(&recorded, &args)
}

/// The section of `recorded` to stdout and where `--json` and `--write` say.
fn publish(recorded: &Recorded, args: &Args) -> Result<()> {
    report::publish(
        &markdown(recorded)?,
        "nodeport",
        (args.json.as_deref(), serde_json::to_value(recorded)?),
        args.write.as_deref(),
    )
}
