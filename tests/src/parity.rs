//! Differential parity: the same Services and EndpointSlices, the same client probes, against
//! svc and against the real kube-proxy, side by side, and what each client saw.
//!
//! # Topology
//!
//! kube-proxy's rules act on packets in the network namespace it runs in; svc acts on the
//! sockets of processes in the cgroup its programs are attached to. So every proxy gets a
//! sandbox of its own ([`Sandbox`]: a client namespace, a backend namespace, a test cgroup),
//! all with the *same addresses* (the same third octet: namespaces never meet, so equal
//! addresses never clash), and one set of EndpointSlices describes the backends of all of them:
//!
//! ```text
//!   svc:           external ns ──up0── client ns (svc-agent, client in svc's cgroup) ──vc── backend ns (b1..b8)
//!   svc-xdp:       external ns ──up0── client ns (svc-agent --xdp-mode native)       ──vc── backend ns (b1..b8)
//!   kube-proxy X:  external ns ──up0── client ns (kube-proxy runs here)              ──vc── backend ns (b1..b8)
//! ```
//!
//! The client probe (`svc-probe`) is the same program with the same arguments for every proxy;
//! it always runs in the sandbox's client namespace and test cgroup. For svc the cgroup is
//! where the programs are attached; for kube-proxy the namespace is where its rules are. Each
//! client namespace has a default route into its backend namespace, as a node has one to its
//! gateway (kube-proxy needs it: the route lookup of connect() comes before netfilter's
//! OUTPUT hook); the backend namespace does not forward, so an address nothing serves times
//! out, as in a cluster, and nothing leaves the sandbox.
//!
//! The client namespace is also the node that traffic from outside reaches: an external client
//! ([`Origin::External`], in a namespace and a cgroup of its own, outside svc's) sits behind the
//! node's uplink `up0` ([`Sandbox::add_uplink`]) and reaches NodePorts on the node's
//! InternalIPs, ExternalIPs and LoadBalancer IPs through it; the node forwards to the backends.
//! svc's agent runs inside the node namespace (through an [`ApiRelay`], as kube-proxy does) with
//! its tc programs on `up0` and `vc`, so the packet datapath serves that traffic; kube-proxy's
//! PREROUTING rules serve it in its namespace.
//!
//! # The XDP column
//!
//! `svc-xdp` ([`ProxyKind::SvcXdp`]) is svc once more, with a sandbox and an agent of its
//! own, started with `--xdp-mode native`: its XDP program runs at the driver's hook of `up0`
//! and `vc`, before the tc programs, finishes what it can (new flows to another node's
//! endpoint, the packets of flows it knows and their replies, sent out with `XDP_TX` or a
//! redirect into the other device) and passes the rest to tc untouched. Native XDP on a veth
//! needs an XDP program on the far end (`XdpPass` on `ext0` and `vb`: without one the frames
//! sent into it wait unseen, and the agent does not redirect into it), and complete checksums
//! from the senders (transmit checksum offload off on `ext0` and `vb`), as
//! docs/design/xdp.md ("Known problems") says; the agent's link pins must say `native`.
//!
//! It applies to traffic from outside (NodePorts, ExternalIPs, LoadBalancer IPs), which meets
//! XDP. The checks from the node run there too rather than being left blank: the column is the
//! same agent with the same socket programs, so its outcome must be svc's, and a difference
//! (XDP's devices or the far ends' programs disturbing the node's own traffic) fails the row.
//! Every row of the XDP column must equal svc's; where svc differs from kube-proxy the same
//! entries of `tests/intended-differences.yaml` cover the XDP column (an entry's `svc` is the
//! outcome of either). A column whose traffic silently went through tc would show tc's
//! outcomes under XDP's name, so the suite reads the agent's XDP counters
//! ([`Proxy::xdp_counters`]) before and after each scenario and fails when XDP sent on none of
//! the packets of the checks from outside.
//!
//! Every proxy plays the same node (`NODE`): one Node object, whose InternalIPs are the client
//! addresses and whose zone label the topology scenarios set. All proxies watch one API server
//! at once, so a change is written once and each proxy's time to follow it is measured from the
//! same write. svc-agent runs with kube-proxy's default selection (no `--service-proxy-name`),
//! so both serve exactly the unlabelled, non-headless Services.
//!
//! # Outcomes
//!
//! An observation runs one probe (a few TCP connections or UDP exchanges) per proxy, in
//! parallel, again and again until what it saw is one of the outcomes the scenario expects or
//! the deadline passes, and records what it saw last as an [`Outcome`]: which backends answered
//! and how the others failed (refused, rejected with EPERM, timed out, unreachable), plus any
//! address that was not what a client of kube-proxy would see (`getpeername()`/the reply's
//! source not the ClusterIP; the backend seeing another source address than the client's).
//! Outcomes are compared as text across proxies; a difference between svc (or its XDP column)
//! and a kube-proxy column fails unless `tests/intended-differences.yaml` lists it, with its
//! reason, and so does any difference between svc's two columns.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{
    agent::{Agent, Bpffs},
    control_plane::ControlPlane,
    kube_proxy::{ApiRelay, KubeProxy, KubeProxyConfig, Mode},
    probe::{Attempt, Report},
    procs::Backend,
    sandbox::{Sandbox, AGENT_READY_TIMEOUT, UPLINK},
    sys::{TempDir, Tools},
    xdp::{tx_checksum_off, XdpPass},
};

/// The node every proxy plays.
pub const NODE: &str = "parity-node";

/// A proxy under comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProxyKind {
    Svc,
    /// svc with `--xdp-mode native` on its packet devices (the uplink and `vc`): its own
    /// agent in a sandbox of its own, as svc's.
    SvcXdp,
    KubeProxy(Mode),
}

/// The id of the XDP column ([`ProxyKind::SvcXdp`]).
pub const SVC_XDP: &str = "svc-xdp";

impl ProxyKind {
    /// `svc`, `svc-xdp`, `kube-proxy-iptables-nft`, `kube-proxy-iptables-legacy`,
    /// `kube-proxy-nftables`.
    pub fn id(self) -> &'static str {
        match self {
            ProxyKind::Svc => "svc",
            ProxyKind::SvcXdp => SVC_XDP,
            ProxyKind::KubeProxy(m) => m.id(),
        }
    }

    pub fn label(self) -> String {
        match self {
            ProxyKind::Svc => "svc".into(),
            ProxyKind::SvcXdp => "svc (XDP native)".into(),
            ProxyKind::KubeProxy(m) => m.label(),
        }
    }

    pub fn parse(id: &str) -> Option<ProxyKind> {
        match id {
            "svc" => Some(ProxyKind::Svc),
            SVC_XDP => Some(ProxyKind::SvcXdp),
            _ => Mode::parse(id).map(ProxyKind::KubeProxy),
        }
    }

    /// One of svc's columns (svc, svc with XDP), whose outcomes the table compares with
    /// kube-proxy's.
    pub fn is_svc(self) -> bool {
        matches!(self, ProxyKind::Svc | ProxyKind::SvcXdp)
    }
}

/// Whether the column `id` is one of svc's ([`ProxyKind::is_svc`]).
pub fn is_svc_id(id: &str) -> bool {
    ProxyKind::parse(id).is_some_and(ProxyKind::is_svc)
}

/// What runs the proxy.
#[derive(Debug)]
enum Runner {
    // Fields drop in order: the agent stops before its pins are removed, and before the API
    // relay and the kubeconfig it uses go.
    Svc {
        agent: Agent,
        _bpffs: Bpffs,
        _api: Option<(ApiRelay, TempDir)>,
        /// The XDP column's `XDP_PASS` programs on the far ends of its native veths: they go
        /// after the agent, whose redirects need them.
        _peers: Vec<XdpPass>,
    },
    KubeProxy(KubeProxy),
}

/// One proxy and its sandbox. Fields drop in declaration order: the proxy stops, then the
/// sandbox (namespaces, with kube-proxy's rules in them, and the cgroup) goes.
#[derive(Debug)]
pub struct Proxy {
    pub kind: ProxyKind,
    runner: Runner,
    pub sb: Sandbox,
}

impl Proxy {
    /// A sandbox with addresses `10.201.x.*`, a default route and an uplink with an external
    /// client ([`Sandbox::add_uplink`]), and the proxy on it, ready (svc: `svc-agent: ready`;
    /// kube-proxy: its rules synced once). svc's agent runs inside the node namespace (as
    /// kube-proxy does), with its tc programs on the uplink and on `vc`, the device towards
    /// the backends: the backends of an endpoint without this node's name are another
    /// node's, reached through `vc`, so that is where svc's SNATed flows leave and their
    /// replies come back, as on a node's single network device.
    pub fn start(
        kind: ProxyKind,
        cp: &ControlPlane,
        tools: &Tools,
        x: u8,
        kube_proxy: Option<&Path>,
    ) -> Result<Proxy> {
        Self::start_within(
            kind,
            cp,
            tools,
            x,
            kube_proxy,
            crate::kube_proxy::READY_TIMEOUT,
            true,
        )
    }

    /// `start`, giving kube-proxy `ready_timeout` for its first sync (tens of thousands of
    /// Services take iptables mode minutes); the uplink only when `uplink` (without it svc's
    /// agent runs in the host namespace, with the socket hooks alone).
    pub fn start_within(
        kind: ProxyKind,
        cp: &ControlPlane,
        tools: &Tools,
        x: u8,
        kube_proxy: Option<&Path>,
        ready_timeout: Duration,
        uplink: bool,
    ) -> Result<Proxy> {
        Self::start_until(
            kind,
            cp,
            tools,
            x,
            kube_proxy,
            ready_timeout,
            uplink,
            crate::agent::READY_LINE,
        )
    }

    /// `start_within`, returning once svc's agent has printed `svc_line` (`SERVING_LINE`:
    /// its socket programs attached; without the uplink, before its tc programs are); the
    /// same for kube-proxy.
    #[allow(clippy::too_many_arguments)]
    pub fn start_until(
        kind: ProxyKind,
        cp: &ControlPlane,
        tools: &Tools,
        x: u8,
        kube_proxy: Option<&Path>,
        ready_timeout: Duration,
        uplink: bool,
        svc_line: &str,
    ) -> Result<Proxy> {
        let mut sb = Sandbox::with_x(tools.clone(), x)?;
        sb.add_default_route()?;
        if uplink {
            sb.add_uplink()?;
        }
        let runner = match kind {
            ProxyKind::Svc | ProxyKind::SvcXdp if uplink => {
                let xdp = kind == ProxyKind::SvcXdp;
                // Native XDP on a veth: the far end of each must run an XDP program of its own,
                // or the frames sent into it (XDP_TX, redirects) wait in its ring unseen, and a
                // veth without one takes no redirects at all (the agent leaves it out of
                // SVC_XDP_DEVS and tc forwards). The senders' transmit checksum offload off:
                // XDP rewrites a checksum incrementally, right only for a complete one, which
                // a local socket's packet through a veth may not carry (docs/design/xdp.md,
                // "Known problems"); a wire delivers complete ones.
                let peers = if xdp {
                    let ext = sb.external_ns()?;
                    tx_checksum_off(ext, "ext0")?;
                    tx_checksum_off(sb.server_ns(), "vb")?;
                    vec![
                        XdpPass::attach(ext, "ext0")?,
                        XdpPass::attach(sb.server_ns(), "vb")?,
                    ]
                } else {
                    Vec::new()
                };
                let bpffs = sb.bpffs()?;
                let relay = ApiRelay::to_api_server(sb.client_ns(), cp)?;
                let dir = TempDir::new("svc-parity-agent")?;
                let kubeconfig = relay.kubeconfig(cp, cp.kubeconfig_path(), dir.path())?;
                let launcher: [std::ffi::OsString; 2] = [
                    "nsenter".into(),
                    format!("--net={}", sb.client_ns().path().display()).into(),
                ];
                let devices = format!("{UPLINK},vc");
                let mut args = vec!["--devices", &devices];
                if xdp {
                    args.extend(["--xdp-mode", "native"]);
                }
                let mut agent = Agent::start_kube_launched(
                    &launcher,
                    &tools.agent,
                    &kubeconfig,
                    NODE,
                    sb.cgroup().path(),
                    bpffs.path(),
                    &args,
                )?;
                agent.wait_ready(AGENT_READY_TIMEOUT)?;
                if xdp {
                    // A driver that refuses native XDP gets no XDP program (tc serves it),
                    // with a warning: that would be another column than the one named.
                    for dev in [UPLINK, "vc"] {
                        let pin = bpffs.path().join(format!("link_xdp_native_{dev}"));
                        ensure!(
                            pin.exists(),
                            "{}: no native XDP link on {dev} ({} missing); the agent's pins: {:?}",
                            kind.label(),
                            pin.display(),
                            bpffs.entries()
                        );
                    }
                }
                agent.quiet();
                Runner::Svc {
                    agent,
                    _bpffs: bpffs,
                    _api: Some((relay, dir)),
                    _peers: peers,
                }
            }
            ProxyKind::SvcXdp => bail!("{}: needs the uplink", kind.label()),
            ProxyKind::Svc => {
                let bpffs = sb.bpffs()?;
                let mut agent = Agent::start_kube(
                    &tools.agent,
                    cp.kubeconfig_path(),
                    NODE,
                    sb.cgroup().path(),
                    bpffs.path(),
                    &[],
                )?;
                agent.wait_for_lines(svc_line, 1, AGENT_READY_TIMEOUT)?;
                // A failed scenario shows the end of the log itself.
                agent.quiet();
                Runner::Svc {
                    agent,
                    _bpffs: bpffs,
                    _api: None,
                    _peers: Vec::new(),
                }
            }
            ProxyKind::KubeProxy(mode) => {
                let bin = kube_proxy.context("no kube-proxy binary")?;
                let mut kp =
                    KubeProxy::start(KubeProxyConfig::new(bin, mode, NODE), cp, sb.client_ns())?;
                kp.wait_ready(ready_timeout)?;
                kp.quiet();
                Runner::KubeProxy(kp)
            }
        };
        Ok(Proxy { kind, runner, sb })
    }

    /// The agent's or kube-proxy's log, for a failed scenario.
    pub fn log(&self) -> String {
        match &self.runner {
            Runner::Svc { agent, .. } => agent.log(),
            Runner::KubeProxy(kp) => kp.log(),
        }
    }

    pub fn agent(&self) -> Option<&Agent> {
        match &self.runner {
            Runner::Svc { agent, .. } => Some(agent),
            Runner::KubeProxy(_) => None,
        }
    }

    pub fn kube_proxy(&self) -> Option<&KubeProxy> {
        match &self.runner {
            Runner::KubeProxy(kp) => Some(kp),
            Runner::Svc { .. } => None,
        }
    }

    /// svc's packet decisions at XDP (`svc_packet_decisions_total` of the `xdp_*` reasons,
    /// summed over the devices), from the agent's /metrics in the node namespace; empty for
    /// kube-proxy.
    pub fn xdp_counters(&self) -> Result<XdpCounters> {
        let Runner::Svc { agent, .. } = &self.runner else {
            return Ok(XdpCounters::default());
        };
        let at = agent
            .metrics_addr()
            .context("the agent's /metrics address")?;
        let (status, text) = self
            .sb
            .client_ns()
            .run_in(|| crate::agent::http_get(at, "/metrics"))??;
        ensure!(
            status == 200,
            "GET /metrics of {}: {status}",
            self.kind.label()
        );
        Ok(XdpCounters::parse(&text))
    }

    /// Backend `b<i>` serving TCP and UDP on `ports`, in this proxy's backend namespace.
    pub fn serve(&self, i: u8, ports: &[u16]) -> Result<Backend> {
        self.sb.backend(&format!("b{i}"), i, ports)
    }

    /// `serve` with more `svc-probe serve` flags (`--threads N`).
    pub fn serve_with(&self, i: u8, ports: &[u16], extra: &[&str]) -> Result<Backend> {
        self.sb.backend_with(&format!("b{i}"), i, ports, extra)
    }
}

/// Packets svc's XDP program decided, by reason (`xdp_new`, `xdp_ct_hit`, `xdp_reply`, the
/// `xdp_pass_*` ones, ...), over all devices.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdpCounters(pub BTreeMap<String, u64>);

impl XdpCounters {
    /// Reasons whose packets XDP itself sent on (the others it passed to tc).
    pub const SERVED: [&'static str; 3] = ["xdp_new", "xdp_ct_hit", "xdp_reply"];

    /// From a /metrics text: every `svc_packet_decisions_total{device="D",reason="xdp_*"} N`.
    pub fn parse(metrics: &str) -> XdpCounters {
        let mut c = BTreeMap::new();
        for line in metrics.lines() {
            let Some(rest) = line.strip_prefix("svc_packet_decisions_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            let reason = labels
                .split(',')
                .find_map(|l| l.strip_prefix("reason=\"")?.strip_suffix('"'));
            let (Some(reason), Ok(n)) = (reason, value.trim().parse::<u64>()) else {
                continue;
            };
            if reason.starts_with("xdp_") {
                *c.entry(reason.to_string()).or_insert(0) += n;
            }
        }
        XdpCounters(c)
    }

    pub fn get(&self, reason: &str) -> u64 {
        self.0.get(reason).copied().unwrap_or(0)
    }

    /// Packets XDP sent on itself ([`Self::SERVED`]).
    pub fn served(&self) -> u64 {
        Self::SERVED.iter().map(|r| self.get(r)).sum()
    }

    /// What was counted since `before`.
    pub fn since(&self, before: &XdpCounters) -> XdpCounters {
        XdpCounters(
            self.0
                .iter()
                .map(|(r, n)| (r.clone(), n.saturating_sub(before.get(r))))
                .filter(|(_, n)| *n > 0)
                .collect(),
        )
    }

    pub fn add(&mut self, other: &XdpCounters) {
        for (r, n) in &other.0 {
            *self.0.entry(r.clone()).or_insert(0) += n;
        }
    }
}

/// What a probe does: the same arguments for every proxy.
#[derive(Clone, Debug)]
pub struct Probe {
    pub to: SocketAddr,
    pub kind: ProbeKind,
    pub count: u32,
    /// Per attempt (connect, reply).
    pub timeout_ms: u64,
    /// An AF_INET6 socket to the IPv4-mapped form of an IPv4 `to`.
    pub v6_mapped: bool,
    /// UDP: every socket bound to this source port (one flow for conntrack).
    pub source_port: Option<u16>,
    pub view: View,
    pub from: Origin,
}

/// Where a probe runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// On the node: the client namespace, in svc's cgroup (a pod or a process of the node).
    Node,
    /// The external client in front of the node's uplink, outside svc's cgroup: traffic that
    /// arrives from outside the node, as a NodePort's or a LoadBalancer's does.
    External,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeKind {
    Tcp,
    /// sendto/recvfrom on a new socket per exchange.
    Udp,
    /// connect, send, recv on a new socket per exchange.
    UdpConnected,
}

/// How a probe's attempts are summed up into an outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// Which backends answered (`b1,b3`) and how the rest failed.
    Backends,
    /// Whether one backend answered every time (`1 backend`) or `several backends` did: session
    /// affinity, where which backend is chance.
    Distinct,
}

impl Probe {
    pub fn tcp(to: SocketAddr, count: u32) -> Probe {
        Probe {
            to,
            kind: ProbeKind::Tcp,
            count,
            timeout_ms: 1000,
            v6_mapped: false,
            source_port: None,
            view: View::Backends,
            from: Origin::Node,
        }
    }

    pub fn udp(to: SocketAddr, count: u32) -> Probe {
        Probe {
            kind: ProbeKind::Udp,
            ..Probe::tcp(to, count)
        }
    }

    pub fn udp_connected(to: SocketAddr, count: u32) -> Probe {
        Probe {
            kind: ProbeKind::UdpConnected,
            ..Probe::tcp(to, count)
        }
    }

    /// Attempts expected to fail end sooner: a timeout is a timeout after 300 ms too.
    pub fn short(mut self) -> Probe {
        self.timeout_ms = 300;
        self
    }

    pub fn v6_mapped(mut self) -> Probe {
        self.v6_mapped = true;
        self
    }

    pub fn source_port(mut self, port: u16) -> Probe {
        self.source_port = Some(port);
        self
    }

    pub fn distinct(mut self) -> Probe {
        self.view = View::Distinct;
        self
    }

    /// From the external client (the sandbox needs an uplink).
    pub fn external(mut self) -> Probe {
        self.from = Origin::External;
        self
    }

    /// The probe's command line.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            match self.kind {
                ProbeKind::Tcp => "tcp",
                ProbeKind::Udp | ProbeKind::UdpConnected => "udp",
            }
            .to_string(),
            "--to".into(),
            self.to.to_string(),
            "--count".into(),
            self.count.to_string(),
            "--timeout-ms".into(),
            self.timeout_ms.to_string(),
            "--who".into(),
        ];
        if self.kind == ProbeKind::UdpConnected {
            a.push("--connected".into());
        }
        if self.v6_mapped {
            a.push("--v6-mapped".into());
        }
        if let Some(p) = self.source_port {
            a.push("--source-port".into());
            a.push(p.to_string());
        }
        a
    }

    /// Wall-clock bound for one run of the probe.
    pub fn run_timeout(&self) -> Duration {
        Duration::from_secs(10) + Duration::from_millis(self.timeout_ms * 2 * self.count as u64)
    }

    /// Runs the probe in `proxy`'s sandbox and sums it up.
    pub fn run(&self, proxy: &Proxy) -> Result<Outcome> {
        let report = match self.from {
            Origin::Node => proxy.sb.probe(&self.args(), self.run_timeout())?,
            Origin::External => proxy.sb.probe_external(&self.args(), self.run_timeout())?,
        };
        Ok(Outcome::of(&report, self, &proxy.sb))
    }
}

/// How an attempt failed, in kube-proxy's terms.
pub fn failure_kind(a: &Attempt) -> String {
    match a.errno {
        Some(111) => "refused".into(),
        Some(1) => "EPERM".into(),
        // A reply that never came (EAGAIN from a receive timeout) or a connect that timed out.
        Some(11) | Some(110) => "timeout".into(),
        Some(101) | Some(113) => "unreachable".into(),
        Some(n) => format!("errno {n}"),
        None if a.error.as_deref().is_some_and(|e| e.contains("timed out")) => "timeout".into(),
        None => a.error.clone().unwrap_or_else(|| "failed".into()),
    }
}

/// What a client saw, summed up so that two proxies that behave alike give the same text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// `b1,b2`, `refused`, `b1 + timeout`, `1 backend`; with notes such as
    /// `peer=10.201.77.11:8080` (the socket showed the backend, not the ClusterIP) or
    /// `src=10.201.77.2` (the backend saw another source than the client's own address).
    pub text: String,
}

impl Outcome {
    pub fn of(r: &Report, probe: &Probe, sb: &Sandbox) -> Outcome {
        let answered: BTreeSet<String> = r
            .results
            .iter()
            .filter(|a| a.ok)
            .filter_map(|a| a.backend.clone())
            .collect();
        let failures: BTreeSet<String> = r
            .results
            .iter()
            .filter(|a| !a.ok)
            .map(failure_kind)
            .collect();
        let mut parts = Vec::new();
        if !answered.is_empty() {
            parts.push(match probe.view {
                View::Backends => answered.iter().cloned().collect::<Vec<_>>().join(","),
                View::Distinct if answered.len() == 1 => "1 backend".into(),
                View::Distinct => "several backends".into(),
            });
        }
        parts.extend(failures);
        let mut text = parts.join(" + ");
        // The address the application sees: getpeername() (TCP, connected UDP) or the reply's
        // source (unconnected UDP) must be the ClusterIP the client addressed.
        let addressed = match (probe.v6_mapped, probe.to) {
            (true, SocketAddr::V4(a)) => {
                SocketAddr::new(IpAddr::V6(a.ip().to_ipv6_mapped()), a.port())
            }
            _ => probe.to,
        };
        let shown: BTreeSet<String> = r
            .results
            .iter()
            .filter(|a| a.ok)
            .filter_map(|a| a.peer.clone().or_else(|| a.from.clone()))
            .filter(|s| s.parse::<SocketAddr>().ok() != Some(addressed))
            .collect();
        for s in shown {
            text += &format!(" peer={s}");
        }
        // The source the backend saw: the client's own address, unless something rewrote it.
        let client: [IpAddr; 2] = match probe.from {
            Origin::Node => [IpAddr::V4(sb.client_v4()), IpAddr::V6(sb.client_v6())],
            Origin::External => [IpAddr::V4(sb.external_v4()), IpAddr::V6(sb.external_v6())],
        };
        let sources: BTreeSet<String> = r
            .results
            .iter()
            .filter(|a| a.ok)
            .filter_map(|a| a.source.as_deref())
            .filter_map(|s| s.parse::<SocketAddr>().ok())
            .map(|s| match s.ip() {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(s.ip()),
                ip => ip,
            })
            .filter(|ip| !client.contains(ip))
            .map(|ip| ip.to_string())
            .collect();
        for s in sources {
            text += &format!(" src={s}");
        }
        if text.is_empty() {
            text = "nothing".into();
        }
        Outcome { text }
    }
}

/// One proxy's cell of the table.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cell {
    pub outcome: Outcome,
    /// From the write the observation follows (or the start of the observation) to the first
    /// expected outcome; None when it never came.
    pub after: Option<Duration>,
    /// Whether the outcome is one the scenario expected.
    pub expected: bool,
}

impl Cell {
    fn render(&self, timed: bool) -> String {
        let mut s = self.outcome.text.clone();
        match (timed, self.after) {
            (true, Some(d)) => s += &format!(" ({})", seconds(d)),
            (_, None) => s += " (not as expected)",
            _ => {}
        }
        s
    }
}

fn seconds(d: Duration) -> String {
    if d < Duration::from_millis(10) {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    } else if d < Duration::from_secs(1) {
        format!("{:.0} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// One row: a check of a scenario, and each proxy's outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    /// `scenario/check`.
    pub check: String,
    pub what: String,
    /// Whether the check follows a live change (its time is shown).
    pub timed: bool,
    /// By proxy id.
    pub cells: BTreeMap<String, Cell>,
}

/// A difference between svc and a kube-proxy that is meant, and why: an entry of
/// `tests/intended-differences.yaml`. It covers svc's XDP column too, whose outcomes must be
/// svc's.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct IntendedDifference {
    /// `scenario/check`.
    pub check: String,
    /// The kube-proxy column(s) it applies to: a proxy id or a prefix of ids
    /// (`kube-proxy-iptables` covers both iptables backends, `kube-proxy` every mode).
    pub proxy: String,
    /// svc's outcome (svc's or its XDP column's), exactly.
    pub svc: String,
    /// kube-proxy's outcome, exactly.
    pub kube_proxy: String,
    pub reason: String,
    /// `intended` (the default): svc means it. `svc-bug`: svc is wrong here; listed (with the
    /// report) so that the suite stays green until it is fixed, and shown as a bug.
    #[serde(default)]
    pub kind: DifferenceKind,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum DifferenceKind {
    #[default]
    Intended,
    SvcBug,
}

impl IntendedDifference {
    fn covers(&self, check: &str, proxy: &str, svc: &str, kp: &str) -> bool {
        self.check == check
            && proxy.starts_with(&self.proxy)
            && self.svc == svc
            && self.kube_proxy == kp
    }
}

pub fn load_intended(path: &Path) -> Result<Vec<IntendedDifference>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let list: Option<Vec<IntendedDifference>> =
        serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let list = list.unwrap_or_default();
    for d in &list {
        if d.reason.trim().is_empty() {
            bail!(
                "{}: the entry for {} gives no reason",
                path.display(),
                d.check
            );
        }
    }
    Ok(list)
}

/// The verdict on one row: the differences between svc's columns and kube-proxy's that no entry
/// covers, and between svc's two columns (svc and svc with XDP must agree: XDP passes to tc
/// whatever it does not finish exactly as tc would), and the entries that covered one. An
/// entry's `svc` outcome is the XDP column's too: one entry covers both.
pub fn judge(row: &Row, intended: &[IntendedDifference]) -> (Vec<String>, Vec<usize>) {
    let mut unexplained = Vec::new();
    let mut used = Vec::new();
    if let (Some(svc), Some(xdp)) = (row.cells.get("svc"), row.cells.get(SVC_XDP)) {
        if svc.outcome != xdp.outcome {
            unexplained.push(format!(
                "{}: svc saw `{}`, {SVC_XDP} saw `{}` (svc's columns must agree)",
                row.check, svc.outcome.text, xdp.outcome.text
            ));
        }
    }
    for (ours, mine) in row.cells.iter().filter(|(p, _)| is_svc_id(p)) {
        for (proxy, cell) in row.cells.iter().filter(|(p, _)| !is_svc_id(p)) {
            if cell.outcome == mine.outcome {
                continue;
            }
            match intended
                .iter()
                .position(|d| d.covers(&row.check, proxy, &mine.outcome.text, &cell.outcome.text))
            {
                Some(i) => used.push(i),
                None => unexplained.push(format!(
                    "{}: {ours} saw `{}`, {proxy} saw `{}`",
                    row.check, mine.outcome.text, cell.outcome.text
                )),
            }
        }
    }
    (unexplained, used)
}

/// The table, as Markdown: one row per check, one column per proxy, and a last column saying
/// whether they agree.
pub fn markdown(rows: &[Row], proxies: &[ProxyKind], intended: &[IntendedDifference]) -> String {
    let mut out = String::new();
    out += "| check | what the client does |";
    for p in proxies {
        out += &format!(" {} |", p.label());
    }
    out += " |\n|---|---|";
    for _ in proxies {
        out += "---|";
    }
    out += "---|\n";
    let mut notes: Vec<(String, String)> = Vec::new();
    for row in rows {
        out += &format!("| `{}` | {} |", row.check, row.what);
        for p in proxies {
            let cell = row
                .cells
                .get(p.id())
                .map(|c| c.render(row.timed))
                .unwrap_or_else(|| "—".into());
            out += &format!(" {} |", cell.replace('|', "\\|"));
        }
        let (unexplained, mut used) = judge(row, intended);
        // Both of svc's columns use the same entries: each once, in the order first used.
        let mut seen = BTreeSet::new();
        used.retain(|i| seen.insert(*i));
        let kp: BTreeSet<&str> = row
            .cells
            .iter()
            .filter(|(p, _)| !is_svc_id(p))
            .map(|(_, c)| c.outcome.text.as_str())
            .collect();
        let verdict = if !unexplained.is_empty() {
            "**differs**".to_string()
        } else if !used.is_empty() {
            let mut refs = Vec::new();
            let mut bug = false;
            for i in used {
                let d = &intended[i];
                bug |= d.kind == DifferenceKind::SvcBug;
                let key = format!("{} vs {}", d.check, d.proxy);
                if !notes.iter().any(|(k, _)| *k == key) {
                    let tag = match d.kind {
                        DifferenceKind::Intended => "",
                        DifferenceKind::SvcBug => "**svc bug.** ",
                    };
                    notes.push((key.clone(), format!("{tag}{}", d.reason.trim())));
                }
                let n = notes.iter().position(|(k, _)| *k == key).unwrap_or(0) + 1;
                refs.push(format!("[{n}](#intended-{n})"));
            }
            refs.dedup();
            let word = if bug { "**known svc bug**" } else { "intended" };
            format!("{word} {}", refs.join(" "))
        } else if kp.len() > 1 {
            "= (kube-proxy's modes differ)".into()
        } else {
            "=".into()
        };
        out += &format!(" {verdict} |\n");
    }
    if !notes.is_empty() {
        out += "\nDifferences listed in `tests/intended-differences.yaml`, and why:\n\n";
        for (i, (key, reason)) in notes.iter().enumerate() {
            let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
            out += &format!(
                "{}. <a id=\"intended-{}\"></a>`{key}`: {reason}\n",
                i + 1,
                i + 1
            );
        }
    }
    out
}

/// Calls `f` for every proxy at once, each on a thread of its own; results in proxy order.
pub fn each<T: Send>(proxies: &[Proxy], f: impl Fn(&Proxy) -> Result<T> + Sync) -> Vec<Result<T>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = proxies
            .iter()
            .map(|p| {
                let f = &f;
                scope.spawn(move || f(p))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a probe thread panicked")))
            })
            .collect()
    })
}

/// Runs `probe` for every proxy, again and again, until each saw one of `expect` or `within`
/// has passed since `since`; returns every proxy's cell.
pub fn observe(
    proxies: &[Proxy],
    probe: &Probe,
    expect: &[&str],
    since: Instant,
    within: Duration,
) -> Result<BTreeMap<String, Cell>> {
    observe_with(proxies, |p| probe.run(p), expect, since, within)
}

/// `observe` with any way of getting an outcome (`look`, run for each proxy).
pub fn observe_with(
    proxies: &[Proxy],
    look: impl Fn(&Proxy) -> Result<Outcome> + Sync,
    expect: &[&str],
    since: Instant,
    within: Duration,
) -> Result<BTreeMap<String, Cell>> {
    let cells = each(proxies, |p| {
        let mut last;
        loop {
            let outcome = look(p)?;
            let expected = expect.contains(&outcome.text.as_str());
            if expected {
                return Ok(Cell {
                    outcome,
                    after: Some(since.elapsed()),
                    expected: true,
                });
            }
            last = outcome;
            crate::interrupt::check()?;
            if since.elapsed() >= within {
                return Ok(Cell {
                    outcome: last,
                    after: None,
                    expected: false,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let mut out = BTreeMap::new();
    for (p, cell) in proxies.iter().zip(cells) {
        out.insert(
            p.kind.id().to_string(),
            cell.with_context(|| format!("probing through {}", p.kind.label()))?,
        );
    }
    Ok(out)
}
