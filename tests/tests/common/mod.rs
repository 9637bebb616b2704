//! Shared setup of the integration tests.
#![allow(dead_code)] // each test binary uses a different part

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use svc_tests::{
    require_root, Agent, Backend, Bpffs, Endpoint, EndpointSlice, Manifests, Report, Sandbox,
    Service, ServicePort, SlicePort, Tools,
};

/// What deploy/'s dashboard reads that only an agent of the Kubernetes API exports (its own
/// client's requests): the packet test's agent reads manifests and leaves them out of its
/// check, and the kube scenario s21 checks each has samples.
pub const API_CLIENT_METRICS: &[&str] = &[
    "rest_client_requests_total",
    "rest_client_request_duration_seconds_bucket",
];

/// A fresh sandbox with the probe this package built; fails (never skips) without root.
pub fn sandbox() -> Sandbox {
    require_root();
    Sandbox::new(Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe"))).expect("creating sandbox")
}

pub fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// Calls `f` until it returns `Ok(Some(v))` or `within` has passed; the last error or "still
/// None" explains a timeout.
pub fn poll<T>(within: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + within;
    loop {
        let last = match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => "condition not met".to_string(),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("not within {within:?}: {last}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The ClusterIP most tests use.
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// Everything one agent test needs. Fields drop in declaration order: the agent stops (and
/// prints its log, shown for failed tests) before its pins are uninstalled, before the
/// backends, manifests and sandbox go.
pub struct World {
    pub agent: Agent,
    pub bpffs: Bpffs,
    pub backends: Vec<Backend>,
    pub m: Manifests,
    pub sb: Sandbox,
}

impl World {
    /// A sandbox with backends `b1..=bn` serving `ports`, manifests written by `setup`, and an
    /// agent that has reported ready (so its first full sync includes those manifests).
    pub fn start(n: u8, ports: &[u16], setup: impl FnOnce(&Sandbox, &Manifests)) -> World {
        World::start_with(n, ports, &[], setup)
    }

    /// As `start`, the agent run with `extra` flags.
    pub fn start_with(
        n: u8,
        ports: &[u16],
        extra: &[&str],
        setup: impl FnOnce(&Sandbox, &Manifests),
    ) -> World {
        World::start_bin(None, n, ports, extra, setup)
    }

    /// As `start_with`, with agent binary `bin` (None: the one under test).
    pub fn start_bin(
        bin: Option<&std::path::Path>,
        n: u8,
        ports: &[u16],
        extra: &[&str],
        setup: impl FnOnce(&Sandbox, &Manifests),
    ) -> World {
        let sb = sandbox();
        let m = Manifests::new().expect("manifests dir");
        setup(&sb, &m);
        let backends = sb.backends(n, ports).expect("backends");
        let bpffs = sb.bpffs().expect("bpffs");
        let mut agent = svc_tests::Agent::start(
            bin.unwrap_or(&sb.tools.agent),
            m.dir(),
            sb.cgroup().path(),
            bpffs.path(),
            extra,
            m.scratch(),
        )
        .expect("agent");
        agent
            .wait_ready(svc_tests::sandbox::AGENT_READY_TIMEOUT)
            .expect("agent ready");
        World {
            agent,
            bpffs,
            backends,
            m,
            sb,
        }
    }
}

/// `demo/web`: ClusterIP `VIP`, port `http` 80/TCP → 8080.
pub fn web_service() -> Service {
    Service::new("demo", "web", &VIP.to_string())
        .port(ServicePort::tcp(80).name("http").target(8080))
}

/// The IPv4 slice of `demo/web`: port `http` 8080, backends `ready` ready and `not_ready`
/// not ready (indexes into the sandbox's backend addresses).
pub fn web_slice(sb: &Sandbox, ready: &[u8], not_ready: &[u8]) -> EndpointSlice {
    let mut s = EndpointSlice::ipv4("demo", "web").port(SlicePort::tcp(8080).name("http"));
    for &i in ready {
        s = s.endpoint(Endpoint::ready(&sb.backend_v4(i).to_string()));
    }
    for &i in not_ready {
        s = s.endpoint(Endpoint::not_ready(&sb.backend_v4(i).to_string()));
    }
    s
}

/// The set of backend names that answered.
pub fn names(r: &Report) -> BTreeSet<String> {
    r.backends().into_keys().collect()
}

pub fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}
