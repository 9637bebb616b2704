//! A client namespace and a backend namespace joined by a veth pair, plus a test cgroup: the
//! smallest world in which a ClusterIP can be exercised.
//!
//! ```text
//!  client ns                         backend ns
//!  vc: 10.201.X.1/24  <--veth-->  vb: 10.201.X.2/24, backend i: 10.201.X.(10+i)
//!      fd00:201:X::1/64                fd00:201:X::2/64,        fd00:201:X::(10+i)
//! ```
//! The client namespace has no default route, so an address no backend owns (a ClusterIP the
//! agent does not translate) is unreachable there and nothing ever leaves the sandbox.
//!
//! [`Sandbox::add_uplink`] puts an external client in front (for NodePorts, ExternalIPs and
//! LoadBalancer IPs, whose traffic does not start on the node): the client namespace then plays
//! the node, forwarding between its uplink and the backends.
//!
//! ```text
//!  external ns                       client ns (the node)
//!  ext0: 10.202.X.100/24 <--veth--> up0: 10.202.X.1/24        vc ... backend ns
//!        fd00:202:X::100/64              fd00:202:X::1/64
//!  routes: the node's addresses 10.201.X.1, fd00:201:X::1 and the external frontends
//!          10.203.X.0/24, fd00:203:X::/64 via the node
//! ```

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use crate::{
    agent::{Agent, Bpffs},
    cgroup::TestCgroup,
    control_plane::ControlPlane,
    manifest::Manifests,
    netns::{veth_pair, NetNs},
    probe::{HoldReport, LoopReport, Report, StreamReport, SweepReport},
    procs::{Backend, ClientRun},
    sys::{next_id, Tools},
};

/// Backend addresses configured in every sandbox (indexes 1..=MAX_BACKENDS).
pub const MAX_BACKENDS: u8 = 11;

/// How long an agent may take from start to `svc-agent: ready` (loading and attaching
/// programs on a 2-core machine while other tests run).
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The node's device towards the external client (see [`Sandbox::add_uplink`]).
pub const UPLINK: &str = "up0";

/// An external client's namespace and a cgroup of its own: outside the agent's cgroup, so no
/// socket hook ever sees its traffic.
#[derive(Debug)]
struct External {
    cgroup: TestCgroup,
    ns: NetNs,
}

#[derive(Debug)]
pub struct Sandbox {
    pub tools: Tools,
    x: u8,
    external: Option<External>,
    // Fields drop in declaration order: the cgroup (and any straggler in it) goes before the
    // namespaces.
    cgroup: TestCgroup,
    client: NetNs,
    server: NetNs,
}

impl Sandbox {
    pub fn new(tools: Tools) -> Result<Self> {
        // The third octet only has to differ between sandboxes for readability of logs; the
        // namespaces are isolated, so equal addresses in two sandboxes never meet.
        Self::with_x(tools, (next_id() % 250) as u8)
    }

    /// The veth pair and the addresses.
    fn configure(&self) -> Result<()> {
        let (sb, x) = (self, self.x);
        veth_pair(&sb.client, "vc", &sb.server, "vb")?;
        sb.client
            .add_addr("vc", &format!("{}/24", sb.client_v4()))?;
        sb.client
            .add_addr("vc", &format!("{}/64", sb.client_v6()))?;
        sb.server.add_addr("vb", &format!("10.201.{x}.2/24"))?;
        sb.server.add_addr("vb", &format!("fd00:201:{x}::2/64"))?;
        for i in 1..=MAX_BACKENDS {
            sb.server
                .add_addr("vb", &format!("{}/24", sb.backend_v4(i)))?;
            sb.server
                .add_addr("vb", &format!("{}/64", sb.backend_v6(i)))?;
        }
        Ok(())
    }

    /// Like `new`, with the third octet given: sandboxes with the same `x` have the same
    /// addresses (each in namespaces of its own, so they never meet), and one set of
    /// EndpointSlices describes the backends of every one of them.
    pub fn with_x(tools: Tools, x: u8) -> Result<Self> {
        let cgroup = TestCgroup::new()?;
        let client = NetNs::new("svc-c")?;
        let server = NetNs::new("svc-b")?;
        let sb = Self {
            tools,
            x,
            external: None,
            cgroup,
            client,
            server,
        };
        sb.configure()?;
        Ok(sb)
    }

    /// A default route in the client namespace, IPv4 and IPv6, to the backend namespace, as a
    /// node has one to its gateway. The backend namespace does not forward (a new namespace's
    /// default), so a packet to an address no backend owns is dropped there: the client's
    /// connection times out, as it would in a cluster, instead of failing at once with
    /// ENETUNREACH; and still nothing leaves the sandbox. kube-proxy needs the route: the route
    /// lookup of connect() comes before netfilter's OUTPUT hook, where its rules rewrite the
    /// ClusterIP.
    pub fn add_default_route(&self) -> Result<()> {
        let x = self.x;
        self.client
            .ip(["route", "add", "default", "via", &format!("10.201.{x}.2")])?;
        self.client.ip([
            "-6",
            "route",
            "add",
            "default",
            "via",
            &format!("fd00:201:{x}::2"),
        ])?;
        Ok(())
    }

    /// An external client in front of the client namespace, which becomes a node: forwarding
    /// on, its uplink `up0` towards the external namespace, and routes so that the node's own
    /// addresses and the external frontends (`10.203.X.0/24`, `fd00:203:X::/64`, where tests put
    /// ExternalIPs and LoadBalancer IPs) are reached through it, as a router in front of a
    /// node would. The backend namespace routes the external client's network back through
    /// the node (a backend that sees the client's own address answers it there). Still
    /// nothing leaves the sandbox: the backend namespace forwards nothing, and the external
    /// namespace routes nothing else.
    pub fn add_uplink(&mut self) -> Result<()> {
        if self.external.is_some() {
            return Ok(());
        }
        let x = self.x;
        // Prefix `svc-c`: the one `sys::clean_stale` removes after a killed run.
        let external = External {
            cgroup: TestCgroup::new()?,
            ns: NetNs::new("svc-c")?,
        };
        let ext = &external.ns;
        veth_pair(&self.client, UPLINK, ext, "ext0")?;
        self.client.add_addr(UPLINK, &format!("10.202.{x}.1/24"))?;
        self.client
            .add_addr(UPLINK, &format!("fd00:202:{x}::1/64"))?;
        ext.add_addr("ext0", &format!("{}/24", self.external_v4()))?;
        ext.add_addr("ext0", &format!("{}/64", self.external_v6()))?;
        let (via4, via6) = (format!("10.202.{x}.1"), format!("fd00:202:{x}::1"));
        for to in [
            format!("{}/32", self.client_v4()),
            format!("10.203.{x}.0/24"),
        ] {
            ext.ip(["route", "add", &to, "via", &via4])?;
        }
        for to in [
            format!("{}/128", self.client_v6()),
            format!("fd00:203:{x}::/64"),
        ] {
            ext.ip(["-6", "route", "add", &to, "via", &via6])?;
        }
        self.server.ip([
            "route",
            "add",
            &format!("10.202.{x}.0/24"),
            "via",
            &self.client_v4().to_string(),
        ])?;
        self.server.ip([
            "-6",
            "route",
            "add",
            &format!("fd00:202:{x}::/64"),
            "via",
            &self.client_v6().to_string(),
        ])?;
        // A device's own rp_filter was copied from the default when it was made.
        self.client.forward()?;
        for dev in ["vc", UPLINK] {
            self.client
                .sysctl(&format!("net.ipv4.conf.{dev}.rp_filter=0"))?;
        }
        self.external = Some(external);
        Ok(())
    }

    /// The external client's addresses (after `add_uplink`).
    pub fn external_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 202, self.x, 100)
    }

    pub fn external_v6(&self) -> Ipv6Addr {
        format!("fd00:202:{}::100", self.x).parse().unwrap()
    }

    /// The node's address on its uplink.
    pub fn uplink_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 202, self.x, 1)
    }

    /// An address of the external frontends' range (`10.203.X.i`), routed to the node.
    pub fn frontend_v4(&self, i: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 203, self.x, i)
    }

    pub fn frontend_v6(&self, i: u8) -> Ipv6Addr {
        format!("fd00:203:{}::{i}", self.x).parse().unwrap()
    }

    fn external(&self) -> Result<&External> {
        self.external
            .as_ref()
            .context("this sandbox has no uplink (Sandbox::add_uplink)")
    }

    /// The external client's namespace.
    pub fn external_ns(&self) -> Result<&NetNs> {
        Ok(&self.external()?.ns)
    }

    /// Runs a `tcp` or `udp` probe as the external client (its namespace and cgroup).
    pub fn probe_external(&self, args: &[String], timeout: Duration) -> Result<Report> {
        let e = self.external()?;
        let report: Report =
            ClientRun::spawn(&self.tools.probe, &e.cgroup, &e.ns, args)?.wait(timeout)?;
        if report.cgroup != e.cgroup.relative() || report.netns_ino != e.ns.inode()? {
            bail!("the external probe ran in the wrong cgroup or network namespace");
        }
        Ok(report)
    }

    /// Starts `svc-probe hold` (see `spawn_hold`) as the external client; finish it with
    /// `finish_hold_external`.
    pub fn spawn_hold_external(
        &self,
        to: SocketAddr,
        connections: u32,
        duration: Duration,
        interval_ms: u64,
    ) -> Result<ClientRun> {
        let e = self.external()?;
        let args: Vec<String> = vec![
            "hold".into(),
            "--to".into(),
            to.to_string(),
            "--connections".into(),
            connections.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--interval-ms".into(),
            interval_ms.to_string(),
        ];
        ClientRun::spawn(&self.tools.probe, &e.cgroup, &e.ns, &args)
    }

    /// Starts `svc-probe udp-stream` (see `spawn_udp_stream`) as the external client; finish
    /// it with `finish_udp_stream_external`.
    pub fn spawn_udp_stream_external(
        &self,
        to: SocketAddr,
        duration: Duration,
        interval_ms: u64,
        timeout_ms: u64,
    ) -> Result<ClientRun> {
        let e = self.external()?;
        let args: Vec<String> = vec![
            "udp-stream".into(),
            "--to".into(),
            to.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--interval-ms".into(),
            interval_ms.to_string(),
            "--timeout-ms".into(),
            timeout_ms.to_string(),
        ];
        ClientRun::spawn(&self.tools.probe, &e.cgroup, &e.ns, &args)
    }

    pub fn finish_udp_stream_external(
        &self,
        run: ClientRun,
        timeout: Duration,
    ) -> Result<StreamReport> {
        let e = self.external()?;
        let report: StreamReport = run.wait(timeout)?;
        if report.cgroup != e.cgroup.relative() || report.netns_ino != e.ns.inode()? {
            bail!("the external UDP stream ran in the wrong cgroup or network namespace");
        }
        Ok(report)
    }

    pub fn finish_hold_external(&self, run: ClientRun, timeout: Duration) -> Result<HoldReport> {
        let e = self.external()?;
        let report: HoldReport = run.wait(timeout)?;
        if report.cgroup != e.cgroup.relative() || report.netns_ino != e.ns.inode()? {
            bail!("the external hold ran in the wrong cgroup or network namespace");
        }
        Ok(report)
    }

    pub fn x(&self) -> u8 {
        self.x
    }

    pub fn client_ns(&self) -> &NetNs {
        &self.client
    }

    pub fn server_ns(&self) -> &NetNs {
        &self.server
    }

    pub fn cgroup(&self) -> &TestCgroup {
        &self.cgroup
    }

    pub fn client_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 201, self.x, 1)
    }

    pub fn client_v6(&self) -> Ipv6Addr {
        format!("fd00:201:{}::1", self.x).parse().unwrap()
    }

    /// Address of backend `i` (1-based).
    pub fn backend_v4(&self, i: u8) -> Ipv4Addr {
        assert!((1..=MAX_BACKENDS).contains(&i), "backend index {i}");
        Ipv4Addr::new(10, 201, self.x, 10 + i)
    }

    pub fn backend_v6(&self, i: u8) -> Ipv6Addr {
        assert!((1..=MAX_BACKENDS).contains(&i), "backend index {i}");
        format!("fd00:201:{}::{}", self.x, 10 + i).parse().unwrap()
    }

    /// Starts backend `i` named `name`, serving TCP and UDP on both of its addresses on every
    /// port.
    pub fn backend(&self, name: &str, i: u8, ports: &[u16]) -> Result<Backend> {
        self.backend_with(name, i, ports, &[])
    }

    /// `backend` with more `svc-probe serve` flags (`--threads N`).
    pub fn backend_with(
        &self,
        name: &str,
        i: u8,
        ports: &[u16],
        extra: &[&str],
    ) -> Result<Backend> {
        let mut listens = Vec::new();
        for &p in ports {
            listens.push(SocketAddr::new(IpAddr::V4(self.backend_v4(i)), p));
            listens.push(SocketAddr::new(IpAddr::V6(self.backend_v6(i)), p));
        }
        Backend::start_with(&self.tools.probe, &self.server, name, &listens, extra)
    }

    /// Backends `b1..=bn` at indexes 1..=n.
    pub fn backends(&self, n: u8, ports: &[u16]) -> Result<Vec<Backend>> {
        (1..=n)
            .map(|i| self.backend(&format!("b{i}"), i, ports))
            .collect()
    }

    /// Spawns `svc-probe ARGS` as a client (test cgroup + client namespace).
    pub fn spawn_client(&self, args: &[String]) -> Result<ClientRun> {
        ClientRun::spawn(&self.tools.probe, &self.cgroup, &self.client, args)
    }

    /// Fails unless the probe ran in the test cgroup and the client namespace: a client outside
    /// the cgroup bypasses the agent entirely and would make every assertion meaningless.
    fn check_placement(&self, cgroup: &str, netns_ino: u64) -> Result<()> {
        if cgroup != self.cgroup.relative() {
            bail!(
                "probe ran in cgroup {cgroup:?}, not {:?}",
                self.cgroup.relative()
            );
        }
        if netns_ino != self.client.inode()? {
            bail!("probe ran in the wrong network namespace");
        }
        Ok(())
    }

    /// Runs a `tcp` or `udp` probe to completion.
    pub fn probe(&self, args: &[String], timeout: Duration) -> Result<Report> {
        let report: Report = self.spawn_client(args)?.wait(timeout)?;
        self.check_placement(&report.cgroup, report.netns_ino)?;
        Ok(report)
    }

    /// `count` sequential TCP connections to `to`; `extra` are more probe flags.
    pub fn tcp(&self, to: SocketAddr, count: u32, extra: &[&str]) -> Result<Report> {
        let mut args = vec![
            "tcp".to_string(),
            "--to".into(),
            to.to_string(),
            "--count".into(),
            count.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.probe(&args, probe_timeout(count))
    }

    /// `count` UDP exchanges with `to`.
    pub fn udp(&self, to: SocketAddr, count: u32, connected: bool) -> Result<Report> {
        let mut args = vec![
            "udp".to_string(),
            "--to".into(),
            to.to_string(),
            "--count".into(),
            count.to_string(),
        ];
        if connected {
            args.push("--connected".into());
        }
        self.probe(&args, probe_timeout(count))
    }

    /// Starts `svc-probe loop` (new TCP connections back to back for `duration`); finish it
    /// with `finish_loop`.
    pub fn spawn_loop(&self, to: SocketAddr, duration: Duration) -> Result<ClientRun> {
        self.spawn_client(&[
            "loop".into(),
            "--to".into(),
            to.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
        ])
    }

    pub fn finish_loop(&self, run: ClientRun, timeout: Duration) -> Result<LoopReport> {
        let report: LoopReport = run.wait(timeout)?;
        self.check_placement(&report.cgroup, report.netns_ino)?;
        Ok(report)
    }

    /// Starts `svc-probe udp-stream` (one connected UDP socket, an exchange every
    /// `interval_ms`, reconnecting after errors, for `duration`); finish it with
    /// `finish_udp_stream`.
    pub fn spawn_udp_stream(
        &self,
        to: SocketAddr,
        duration: Duration,
        interval_ms: u64,
        timeout_ms: u64,
    ) -> Result<ClientRun> {
        self.spawn_client(&[
            "udp-stream".into(),
            "--to".into(),
            to.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--interval-ms".into(),
            interval_ms.to_string(),
            "--timeout-ms".into(),
            timeout_ms.to_string(),
        ])
    }

    /// Starts `svc-probe udp-stream --unconnected SOCKETS`: that many unconnected sockets,
    /// each sending to `to` in turn with sendto()/recvfrom(), an exchange every `interval_ms`
    /// for `duration`; finish it with `finish_udp_stream`.
    pub fn spawn_udp_unconnected(
        &self,
        to: SocketAddr,
        sockets: u32,
        duration: Duration,
        interval_ms: u64,
        timeout_ms: u64,
    ) -> Result<ClientRun> {
        self.spawn_udp_unconnected_with(to, sockets, duration, interval_ms, timeout_ms, &[])
    }

    /// `spawn_udp_unconnected` with more probe flags (`--pipelined`).
    pub fn spawn_udp_unconnected_with(
        &self,
        to: SocketAddr,
        sockets: u32,
        duration: Duration,
        interval_ms: u64,
        timeout_ms: u64,
        extra: &[&str],
    ) -> Result<ClientRun> {
        let mut args: Vec<String> = vec![
            "udp-stream".into(),
            "--to".into(),
            to.to_string(),
            "--unconnected".into(),
            sockets.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--interval-ms".into(),
            interval_ms.to_string(),
            "--timeout-ms".into(),
            timeout_ms.to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        self.spawn_client(&args)
    }

    /// Starts `svc-probe hold`: `connections` TCP connections kept for `duration`, a line
    /// exchanged on each every `interval_ms`; finish it with `finish_hold`.
    pub fn spawn_hold(
        &self,
        to: SocketAddr,
        connections: u32,
        duration: Duration,
        interval_ms: u64,
    ) -> Result<ClientRun> {
        self.spawn_client(&[
            "hold".into(),
            "--to".into(),
            to.to_string(),
            "--connections".into(),
            connections.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--interval-ms".into(),
            interval_ms.to_string(),
        ])
    }

    pub fn finish_hold(&self, run: ClientRun, timeout: Duration) -> Result<HoldReport> {
        let report: HoldReport = run.wait(timeout)?;
        self.check_placement(&report.cgroup, report.netns_ino)?;
        Ok(report)
    }

    /// One TCP connection to each address listed in `targets` (one IP:PORT a line).
    pub fn sweep(
        &self,
        targets: &std::path::Path,
        timeout_ms: u64,
        within: Duration,
    ) -> Result<SweepReport> {
        let report: SweepReport = self
            .spawn_client(&[
                "sweep".into(),
                "--targets".into(),
                targets.display().to_string(),
                "--timeout-ms".into(),
                timeout_ms.to_string(),
            ])?
            .wait(within)?;
        self.check_placement(&report.cgroup, report.netns_ino)?;
        Ok(report)
    }

    /// `sweep` over each of `shards` at once, one probe process per shard: the reports
    /// summed, `elapsed_us` the wall time of the whole (a sweep's resolution, shortened).
    pub fn sweep_shards(
        &self,
        shards: &[std::path::PathBuf],
        workers: u32,
        timeout_ms: u64,
        within: Duration,
    ) -> Result<SweepReport> {
        let t0 = std::time::Instant::now();
        let runs = shards
            .iter()
            .map(|targets| {
                self.spawn_client(&[
                    "sweep".into(),
                    "--targets".into(),
                    targets.display().to_string(),
                    "--timeout-ms".into(),
                    timeout_ms.to_string(),
                    "--workers".into(),
                    workers.to_string(),
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let mut all = SweepReport::default();
        for run in runs {
            let r: SweepReport = run.wait(within)?;
            self.check_placement(&r.cgroup, r.netns_ino)?;
            all.ok += r.ok;
            all.failed += r.failed;
            all.first_failures.extend(r.first_failures);
            all.cgroup = r.cgroup;
            all.netns_ino = r.netns_ino;
        }
        all.elapsed_us = t0.elapsed().as_micros() as u64;
        Ok(all)
    }

    /// `svc-probe loop` with no pause between connections: the new-connection rate.
    pub fn spawn_loop_flat_out(&self, to: SocketAddr, duration: Duration) -> Result<ClientRun> {
        self.spawn_client(&[
            "loop".into(),
            "--to".into(),
            to.to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
            "--interval-ms".into(),
            "0".into(),
        ])
    }

    pub fn finish_udp_stream(&self, run: ClientRun, timeout: Duration) -> Result<StreamReport> {
        let report: StreamReport = run.wait(timeout)?;
        self.check_placement(&report.cgroup, report.netns_ino)?;
        Ok(report)
    }

    /// A bpffs directory for an agent attached to this sandbox's cgroup.
    pub fn bpffs(&self) -> Result<Bpffs> {
        Bpffs::new(&self.tools.agent, self.cgroup.path())
    }

    /// Starts the agent on this sandbox's cgroup and waits for `svc-agent: ready`.
    pub fn agent(&self, bpffs: &Bpffs, manifests: &Manifests) -> Result<Agent> {
        let mut agent = self.agent_no_wait(bpffs, manifests)?;
        agent.wait_ready(AGENT_READY_TIMEOUT)?;
        Ok(agent)
    }

    /// Starts the agent against `control_plane`'s API server (admin credentials) as node
    /// `node_name`, on this sandbox's cgroup, with `extra` flags (`--service-proxy-name X`,
    /// ...), and waits for `svc-agent: ready`.
    pub fn agent_kube(
        &self,
        bpffs: &Bpffs,
        control_plane: &ControlPlane,
        node_name: &str,
        extra: &[&str],
    ) -> Result<Agent> {
        self.agent_kubeconfig(bpffs, control_plane.kubeconfig_path(), node_name, extra)
    }

    /// Like `agent_kube`, with any kubeconfig (a service account's, for instance).
    pub fn agent_kubeconfig(
        &self,
        bpffs: &Bpffs,
        kubeconfig: &std::path::Path,
        node_name: &str,
        extra: &[&str],
    ) -> Result<Agent> {
        let mut agent = Agent::start_kube(
            &self.tools.agent,
            kubeconfig,
            node_name,
            self.cgroup.path(),
            bpffs.path(),
            extra,
        )?;
        agent.wait_ready(AGENT_READY_TIMEOUT)?;
        Ok(agent)
    }

    /// Starts the agent without waiting for it.
    pub fn agent_no_wait(&self, bpffs: &Bpffs, manifests: &Manifests) -> Result<Agent> {
        Agent::start(
            &self.tools.agent,
            manifests.dir(),
            self.cgroup.path(),
            bpffs.path(),
            &[],
            manifests.scratch(),
        )
    }

    /// `agent` with `extra` flags (`--max-backends 2`, ...).
    pub fn agent_with(
        &self,
        bpffs: &Bpffs,
        manifests: &Manifests,
        extra: &[&str],
    ) -> Result<Agent> {
        let mut agent = Agent::start(
            &self.tools.agent,
            manifests.dir(),
            self.cgroup.path(),
            bpffs.path(),
            extra,
            manifests.scratch(),
        )?;
        agent.wait_ready(AGENT_READY_TIMEOUT)?;
        Ok(agent)
    }
}

/// Generous wall-clock bound for a probe run: the probe's own per-attempt timeout (default
/// 2 s) for every attempt, plus process start-up.
fn probe_timeout(count: u32) -> Duration {
    Duration::from_secs(10) + Duration::from_secs(2) * count
}
