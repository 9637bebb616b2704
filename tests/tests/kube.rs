//! The agent against a real kube-apiserver: kube-proxy's Service semantics, end to end, as a
//! client in the sandbox sees them.
//!
//! Each scenario is a test of its own (this target has its own `main`, through libtest-mimic):
//! `cargo test -p svc-tests --test kube -- s05` runs one, `-- --list` lists them, and the last
//! line is libtest's `test result: ... N passed; M failed; ...`.
//!
//! One control plane (etcd + kube-apiserver, ~6 s to start) serves every scenario: the first
//! scenario that runs starts it, and `main` stops it once every scenario has finished, passed
//! or failed (its processes also get SIGKILL should this process die without cleaning up).
//! Each scenario has its own Kubernetes namespace, sandbox and agent; its Services and
//! EndpointSlices carry `service.kubernetes.io/service-proxy-name: <scenario>` and its agent
//! runs with `--service-proxy-name <scenario>`, so no agent sees another scenario's objects
//! (the one scenario about that label runs a default agent on unlabelled objects).
//!
//! The scenarios run one after the other unless `--test-threads N` (or `RUST_TEST_THREADS`)
//! asks for more: each runs an agent, backends and clients, and the 1 s bounds below are
//! measured on a 2-core machine. When they do run in parallel, the scenario that restarts the
//! apiserver (`s12-lifecycle`) runs alone: it takes the control plane exclusively (`&mut`),
//! the others share it (`&`). Sequential runs capture each scenario's stderr (its own lines, its
//! agent's log, ...) and show it only when the scenario fails, as libtest does; `--nocapture`
//! and parallel runs let it through as it comes.
//!
//! There is no controller-manager: the scenarios write EndpointSlices (and a Node) themselves.
//! Changes the issue calls live must be visible to the client within 1 s of the API write
//! (measured from `kubectl apply` returning); other waits have generous deadlines.

mod common;

use std::{
    collections::BTreeSet,
    fs::File,
    io::{Read, Seek},
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    panic::AssertUnwindSafe,
    process::ExitCode,
    sync::{Arc, Mutex, PoisonError, RwLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, ensure, Context, Result};
use common::{names, sa, set};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{json, Value};
use svc_tests::{
    agent::{http_get, refusals},
    control_plane::ControlPlane,
    require_root, Agent, Backend, Bpffs, Report, Sandbox, Tools,
};

/// The issue's bound for a live change.
const LIVE: Duration = Duration::from_secs(1);
/// A generous bound where the issue sets none (first programming after a start, ...).
const SETTLE: Duration = Duration::from_secs(10);
/// After an apiserver restart the agent's watches come back with the client's backoff.
const AFTER_APISERVER_RESTART: Duration = Duration::from_secs(40);

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const SERVICE_NAME: &str = "kubernetes.io/service-name";
const ZONE: &str = "topology.kubernetes.io/zone";

const ECONNREFUSED: i32 = 111;

/// A scenario and how it uses the control plane.
#[derive(Clone, Copy)]
enum Scenario {
    /// Writes objects of its own namespace and proxy name: runs beside other scenarios.
    Shared(fn(&ControlPlane, &str) -> Result<()>),
    /// Restarts the apiserver: runs while no other scenario does.
    Exclusive(fn(&mut ControlPlane, &str) -> Result<()>),
}

/// Every scenario, by test name. The name is also the scenario's Kubernetes namespace and
/// service proxy name, so it must be a DNS label.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("s01-ports", Scenario::Shared(multi_port_and_protocols)),
    (
        "s02-named-ports",
        Scenario::Shared(named_target_ports_per_slice),
    ),
    (
        "s03-merge",
        Scenario::Shared(slices_merged_and_deduplicated),
    ),
    ("s04-dual-stack", Scenario::Shared(dual_stack_and_fqdn)),
    (
        "s05-conditions",
        Scenario::Shared(ready_serving_terminating),
    ),
    ("s06-local", Scenario::Shared(internal_traffic_policy_local)),
    ("s07-topology", Scenario::Shared(topology_hints)),
    ("s08-affinity", Scenario::Shared(session_affinity_live)),
    (
        "s09-external-name",
        Scenario::Shared(type_external_name_and_back),
    ),
    ("s10-proxy-name", Scenario::Shared(service_proxy_name_label)),
    (
        "s11-udp-stale",
        Scenario::Shared(udp_socket_leaves_deleted_backend),
    ),
    ("s12-lifecycle", Scenario::Exclusive(lifecycle)),
    ("s13-health", Scenario::Shared(healthz_and_metrics)),
    ("s14-deploy", Scenario::Shared(deploy_manifests_and_rbac)),
    ("s15-api-server", Scenario::Shared(api_server_given_by_flag)),
    ("s16-helm", Scenario::Shared(helm_chart)),
    ("s17-kube-proxy-config", Scenario::Shared(kube_proxy_config)),
    ("s18-dry-run", Scenario::Shared(dry_run_from_the_api)),
    ("s19-removal", Scenario::Shared(removed_from_the_node)),
    ("s20-explain", Scenario::Shared(explain_with_the_api)),
    (
        "s21-kube-proxy-metrics",
        Scenario::Shared(kube_proxy_metrics),
    ),
    (
        "s22-seed-warning",
        Scenario::Exclusive(default_seed_warning),
    ),
];

fn main() -> ExitCode {
    let mut args = arguments();
    // libtest-mimic would use every core; these scenarios are too heavy for that by default.
    if args.test_threads.is_none() {
        let from_env = std::env::var("RUST_TEST_THREADS").ok();
        args.test_threads = Some(from_env.and_then(|v| v.parse().ok()).unwrap_or(1));
    }
    // Sequential runs happen on this thread, one scenario at a time: fd 2 is ours to redirect.
    let capture = args.test_threads == Some(1) && !args.nocapture;
    let cluster = Arc::new(Cluster::default());
    let trials = SCENARIOS
        .iter()
        .map(|&(name, scenario)| {
            let cluster = cluster.clone();
            Trial::test(name, move || {
                let run = || cluster.run(name, scenario);
                if !capture {
                    return run().map_err(Failed::from);
                }
                let (outcome, output) = capturing_stderr(run).map_err(|e| format!("{e:#}"))?;
                // As libtest: the scenario's output first, then why it failed.
                outcome.map_err(|e| match output.is_empty() {
                    true => Failed::from(e),
                    false => Failed::from(format!("{output}\nerror: {e}")),
                })
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Err(e) = cluster.stop() {
        eprintln!("stopping the control plane: {e:#}");
        return ExitCode::FAILURE;
    }
    conclusion.exit_code()
}

/// libtest's arguments. libtest takes several name filters (`-- s05 s11`, which `cargo xtask
/// test -- ...` passes on to every test binary), libtest-mimic one: the filters (and `--skip`)
/// are resolved here into the exact names to skip, which libtest-mimic counts as filtered out.
fn arguments() -> Arguments {
    const TAKES_VALUE: &[&str] = &[
        "--test-threads",
        "--logfile",
        "--skip",
        "--color",
        "--format",
        "-Z",
    ];
    let mut raw = std::env::args();
    let mut rest: Vec<String> = raw.next().into_iter().collect();
    let mut filters = Vec::new();
    while let Some(arg) = raw.next() {
        if TAKES_VALUE.contains(&arg.as_str()) {
            rest.push(arg);
            rest.extend(raw.next());
        } else if arg.starts_with('-') {
            rest.push(arg);
        } else {
            filters.push(arg);
        }
    }
    let mut args = Arguments::from_iter(rest);
    let exact = args.exact;
    let matches = |name: &str, pattern: &String| {
        if exact {
            name == pattern
        } else {
            name.contains(pattern.as_str())
        }
    };
    if !filters.is_empty() || !args.skip.is_empty() {
        args.skip = SCENARIOS
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| {
                (!filters.is_empty() && !filters.iter().any(|f| matches(name, f)))
                    || args.skip.iter().any(|s| matches(name, s))
            })
            .map(String::from)
            .collect();
        args.exact = true;
    }
    args
}

/// The control plane every scenario shares, started by the first scenario that needs it.
///
/// `main` stops it after the last scenario. Its processes die with this process, not with the
/// worker thread that started (or, in `s12-lifecycle`, restarted) them: libtest-mimic's worker
/// threads end one by one as the scenarios run out.
#[derive(Default)]
struct Cluster {
    control_plane: RwLock<Option<ControlPlane>>,
    /// Set by the first start: `Err` (with the reason) makes every later scenario fail at once
    /// instead of starting another control plane.
    started: Mutex<Option<Result<(), String>>>,
}

impl Cluster {
    /// Runs one scenario, turning a panic into an error.
    fn run(&self, name: &str, scenario: Scenario) -> Result<(), String> {
        require_root();
        self.ensure_started()?;
        // From the moment the scenario has the control plane (it may wait for s12-lifecycle).
        let mut t = Instant::now();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match scenario {
            Scenario::Shared(f) => {
                let guard = self
                    .control_plane
                    .read()
                    .unwrap_or_else(PoisonError::into_inner);
                t = Instant::now();
                f(guard.as_ref().expect("started"), name)
            }
            Scenario::Exclusive(f) => {
                let mut guard = self
                    .control_plane
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                t = Instant::now();
                f(guard.as_mut().expect("started"), name)
            }
        }));
        let result = match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(panic) => Err(panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .map(|s| format!("panicked: {s}"))
                .unwrap_or_else(|| "panicked".into())),
        };
        match &result {
            Ok(()) => eprintln!("=== {name}: ok ({:.1?})", t.elapsed()),
            Err(_) => eprintln!("=== {name}: FAILED ({:.1?})", t.elapsed()),
        }
        result
    }

    fn ensure_started(&self) -> Result<(), String> {
        let mut started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        if started.is_none() {
            let t = Instant::now();
            let result = match ControlPlane::start() {
                Ok(cp) => {
                    eprintln!("control plane ready after {:?}", t.elapsed());
                    *self
                        .control_plane
                        .write()
                        .unwrap_or_else(PoisonError::into_inner) = Some(cp);
                    Ok(())
                }
                Err(e) => Err(format!("starting the control plane: {e:#}")),
            };
            *started = Some(result);
        }
        started.clone().expect("set above")
    }

    /// Stops the control plane if a scenario started it.
    fn stop(&self) -> Result<()> {
        let cp = self
            .control_plane
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match cp {
            Some(cp) => cp.stop(),
            None => Ok(()),
        }
    }
}

/// Runs `f` with file descriptor 2 (this process's stderr, and that of every child it starts
/// meanwhile) redirected to an unlinked temporary file; returns `f`'s result and what was
/// written. fd 2 is restored when `f` returns or panics. Only for one thread at a time.
fn capturing_stderr<T>(f: impl FnOnce() -> T) -> Result<(T, String)> {
    struct Restore(OwnedFd);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: dup2 onto fd 2 from a descriptor we own.
            unsafe { libc::dup2(self.0.as_raw_fd(), 2) };
        }
    }
    let path = std::env::temp_dir().join(format!(
        "svc-kube-stderr-{}-{}",
        std::process::id(),
        svc_tests::sys::next_id()
    ));
    let mut file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    std::fs::remove_file(&path)?;
    // SAFETY: dup of fd 2 returns a new descriptor (or -1, checked), which we then own.
    let saved = unsafe { libc::dup(2) };
    if saved < 0 {
        bail!("dup(2): {}", std::io::Error::last_os_error());
    }
    // SAFETY: `saved` is a fresh descriptor owned by nobody else.
    let restore = Restore(unsafe { OwnedFd::from_raw_fd(saved) });
    // SAFETY: both descriptors are open.
    if unsafe { libc::dup2(file.as_raw_fd(), 2) } < 0 {
        bail!("dup2 onto fd 2: {}", std::io::Error::last_os_error());
    }
    let value = f();
    drop(restore);
    let mut output = Vec::new();
    file.rewind()?;
    file.read_to_end(&mut output)
        .context("reading the captured stderr")?;
    Ok((value, String::from_utf8_lossy(&output).into_owned()))
}

// ---------------------------------------------------------------------------------------------
// One scenario's world.

/// A scenario's sandbox, backends, pin directory and agent. Fields drop in declaration order:
/// the agent stops (printing its log if the test fails) before its pins go, then the backends,
/// then the sandbox.
struct Env {
    agent: Option<Agent>,
    bpffs: Bpffs,
    backends: Vec<Backend>,
    sb: Sandbox,
    /// Kubernetes namespace and service proxy name.
    name: String,
    /// The node the agent runs as.
    node: String,
}

impl Env {
    /// The scenario's namespace in the cluster and a fresh sandbox.
    fn new(cp: &ControlPlane, name: &str) -> Result<Env> {
        apply(
            cp,
            &[json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})],
        )?;
        let sb = Sandbox::new(Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe")))?;
        let bpffs = sb.bpffs()?;
        Ok(Env {
            agent: None,
            bpffs,
            backends: Vec::new(),
            sb,
            name: name.into(),
            node: format!("{name}-node"),
        })
    }

    /// Starts backend `b<i>` (TCP and UDP, IPv4 and IPv6) on `ports`.
    fn serve(&mut self, i: u8, ports: &[u16]) -> Result<()> {
        let b = self.sb.backend(&format!("b{i}"), i, ports)?;
        self.backends.push(b);
        Ok(())
    }

    /// Starts the agent with `--service-proxy-name <scenario>` and waits for ready.
    fn start_agent(&mut self, cp: &ControlPlane) -> Result<()> {
        let name = self.name.clone();
        self.start_agent_with(cp, &["--service-proxy-name", &name])
    }

    fn start_agent_with(&mut self, cp: &ControlPlane, extra: &[&str]) -> Result<()> {
        let agent = self.sb.agent_kube(&self.bpffs, cp, &self.node, extra)?;
        self.agent = Some(agent);
        Ok(())
    }

    fn agent(&mut self) -> &mut Agent {
        self.agent.as_mut().expect("agent started")
    }

    fn v4(&self, i: u8) -> String {
        self.sb.backend_v4(i).to_string()
    }

    fn v6(&self, i: u8) -> String {
        self.sb.backend_v6(i).to_string()
    }

    /// A Service of this scenario, labelled for its agent.
    fn service(&self, name: &str, spec: Value) -> Value {
        service(&self.name, name, Some(&self.name), spec)
    }

    /// An EndpointSlice of this scenario, labelled for its agent.
    fn slice(&self, name: &str, service: &str, family: &str, ports: Value, eps: Value) -> Value {
        slice(
            &self.name,
            name,
            service,
            Some(&self.name),
            family,
            ports,
            eps,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Objects, as JSON (which is YAML): exactly what a test writes is what the apiserver stores.

fn service(ns: &str, name: &str, proxy: Option<&str>, spec: Value) -> Value {
    let mut meta = json!({"name": name, "namespace": ns});
    if let Some(p) = proxy {
        meta["labels"] = json!({ PROXY_NAME: p });
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec})
}

fn slice(
    ns: &str,
    name: &str,
    service: &str,
    proxy: Option<&str>,
    family: &str,
    ports: Value,
    endpoints: Value,
) -> Value {
    let mut labels = json!({ SERVICE_NAME: service });
    if let Some(p) = proxy {
        labels[PROXY_NAME] = p.into();
    }
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "addressType": family,
        "ports": ports,
        "endpoints": endpoints,
    })
}

fn port(name: &str, port: u16, protocol: &str) -> Value {
    json!({"name": name, "port": port, "protocol": protocol})
}

/// An endpoint with explicit conditions.
fn ep_cond(addr: &str, ready: bool, serving: bool, terminating: bool) -> Value {
    json!({
        "addresses": [addr],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
    })
}

fn ep(addr: &str) -> Value {
    ep_cond(addr, true, true, false)
}

/// `v` with `key` set (endpoint fields such as nodeName, zone, hints).
fn with(mut v: Value, key: &str, value: Value) -> Value {
    v[key] = value;
    v
}

/// Server-side applies the objects; returns them as stored.
fn apply(cp: &ControlPlane, objects: &[Value]) -> Result<Vec<Value>> {
    let yaml: Vec<String> = objects.iter().map(Value::to_string).collect();
    cp.apply_yaml(&yaml.join("\n---\n"))
}

/// Applies and returns the moment `kubectl apply` returned: the write is in the API by then.
fn write(cp: &ControlPlane, objects: &[Value]) -> Result<Instant> {
    apply(cp, objects)?;
    Ok(Instant::now())
}

/// The clusterIPs of the (first) Service among stored objects, in spec order.
fn cluster_ips(stored: &[Value]) -> Result<Vec<IpAddr>> {
    let svc = stored
        .iter()
        .find(|o| o["kind"] == "Service")
        .context("no Service among the applied objects")?;
    svc["spec"]["clusterIPs"]
        .as_array()
        .context("Service has no clusterIPs")?
        .iter()
        .map(|ip| {
            ip.as_str()
                .context("clusterIP is not a string")?
                .parse::<IpAddr>()
                .context("clusterIP")
        })
        .collect()
}

fn cluster_ip(stored: &[Value]) -> Result<IpAddr> {
    cluster_ips(stored)?
        .first()
        .copied()
        .context("no clusterIP allocated")
}

// ---------------------------------------------------------------------------------------------
// What the client sees.

/// Calls `check` until it succeeds or `within` has passed (measured from `since`); returns how
/// long it took from `since`, or the last failure.
fn eventually(
    since: Instant,
    within: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    loop {
        let last = match check() {
            Ok(()) => {
                let took = since.elapsed();
                eprintln!("    {what}: after {took:.0?}");
                return Ok(took);
            }
            Err(e) => e,
        };
        if since.elapsed() >= within {
            bail!("{what}: not within {within:?} (last check: {last:#})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `n` new TCP connections to `to` all answered, by exactly the backends `want`, and
/// getpeername() showed the ClusterIP every time.
fn tcp_backends(sb: &Sandbox, to: SocketAddr, n: u32, want: &[&str]) -> Result<()> {
    let r = sb.tcp(to, n, &["--timeout-ms", "1000"])?;
    answered_by(&r, to, want, |a| a.peer.as_deref())
}

/// `n` UDP exchanges, each from a new socket (connected: peer; else: the reply's source).
fn udp_backends(
    sb: &Sandbox,
    to: SocketAddr,
    n: u32,
    connected: bool,
    want: &[&str],
) -> Result<()> {
    let r = sb.udp(to, n, connected)?;
    if connected {
        answered_by(&r, to, want, |a| a.peer.as_deref())
    } else {
        answered_by(&r, to, want, |a| a.from.as_deref())
    }
}

fn answered_by(
    r: &Report,
    to: SocketAddr,
    want: &[&str],
    seen_address: impl Fn(&svc_tests::Attempt) -> Option<&str>,
) -> Result<()> {
    ensure!(r.all_ok(), "failures to {to}: {:?}", r.failures());
    ensure!(
        names(r) == set(want),
        "{to} answered by {:?}, want {want:?}",
        r.backends()
    );
    let to_s = to.to_string();
    for a in &r.results {
        ensure!(
            seen_address(a) == Some(to_s.as_str()),
            "the socket showed {:?}, not the ClusterIP {to}",
            seen_address(a)
        );
    }
    Ok(())
}

/// Connections to `to` fail at once with ECONNREFUSED (kube-proxy's REJECT): the agent knows
/// the frontend and has no backend for it.
fn tcp_refused(sb: &Sandbox, to: SocketAddr) -> Result<()> {
    let r = sb.tcp(to, 3, &["--timeout-ms", "500"])?;
    refused(&r, to)
}

fn udp_refused(sb: &Sandbox, to: SocketAddr) -> Result<()> {
    let r = sb.udp(to, 3, false)?;
    refused(&r, to)
}

fn refused(r: &Report, to: SocketAddr) -> Result<()> {
    for a in &r.results {
        ensure!(
            !a.ok && a.errno == Some(ECONNREFUSED) && a.backend.is_none(),
            "{to}: want ECONNREFUSED (111), got {a:?}"
        );
    }
    Ok(())
}

/// Nothing answers at `to` (the agent does not translate it: the sandbox has no route there).
fn tcp_unanswered(sb: &Sandbox, to: SocketAddr) -> Result<()> {
    let r = sb.tcp(to, 2, &["--timeout-ms", "300"])?;
    for a in &r.results {
        ensure!(!a.ok && a.backend.is_none(), "{to} still answers: {a:?}");
    }
    Ok(())
}

/// `n` connections answered by at least two different backends (no affinity).
fn tcp_spread(sb: &Sandbox, to: SocketAddr, n: u32) -> Result<BTreeSet<String>> {
    let r = sb.tcp(to, n, &["--timeout-ms", "1000"])?;
    ensure!(r.all_ok(), "failures: {:?}", r.failures());
    let seen = names(&r);
    ensure!(seen.len() >= 2, "{n} connections all went to {seen:?}");
    Ok(seen)
}

/// The backends `list` shows for a frontend.
fn listed_backends(agent: &Agent, ip: IpAddr, port: u16, protocol: &str) -> Result<Vec<String>> {
    let list = agent.list()?;
    let fe = list
        .services
        .iter()
        .find(|s| {
            s.ip.parse::<IpAddr>().ok() == Some(ip) && s.port == port && s.protocol == protocol
        })
        .with_context(|| format!("no frontend {ip}:{port}/{protocol} in {list:?}"))?;
    let mut b = fe.backends.clone();
    b.sort();
    Ok(b)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Scenarios.

/// Scenario 1: Several ports, and one port number with both TCP and UDP going to different endpoints.
fn multi_port_and_protocols(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[8080, 9090, 5353])?;
    env.serve(2, &[5353])?;
    let stored = apply(
        cp,
        &[
            env.service(
                "web",
                json!({"ports": [
                    {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                    {"name": "metrics", "port": 9090, "targetPort": 9090, "protocol": "TCP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": 5353, "protocol": "TCP"},
                    {"name": "dns-udp", "port": 53, "targetPort": 5353, "protocol": "UDP"},
                ]}),
            ),
            // TCP ports on b1; the UDP port in a slice of its own, on b2.
            env.slice(
                "web-tcp",
                "web",
                "IPv4",
                json!([
                    port("http", 8080, "TCP"),
                    port("metrics", 9090, "TCP"),
                    port("dns-tcp", 5353, "TCP")
                ]),
                json!([ep(&env.v4(1))]),
            ),
            env.slice(
                "web-udp",
                "web",
                "IPv4",
                json!([port("dns-udp", 5353, "UDP")]),
                json!([ep(&env.v4(2))]),
            ),
        ],
    )?;
    let vip = cluster_ip(&stored)?;
    env.start_agent(cp)?;
    let sb = &env.sb;
    eventually(Instant::now(), SETTLE, "every port served", || {
        tcp_backends(sb, sa(vip, 80), 5, &["b1"])?;
        tcp_backends(sb, sa(vip, 9090), 5, &["b1"])?;
        tcp_backends(sb, sa(vip, 53), 5, &["b1"])?;
        udp_backends(sb, sa(vip, 53), 5, false, &["b2"])?;
        udp_backends(sb, sa(vip, 53), 5, true, &["b2"])
    })?;
    // Ports the Service does not define are refused, whatever the protocol.
    tcp_refused(sb, sa(vip, 8080))?;
    udp_refused(sb, sa(vip, 80))?;
    udp_refused(sb, sa(vip, 9090))?;
    Ok(())
}

/// Scenario 2: A named targetPort: each slice gives the name its own number (pods of two versions).
fn named_target_ports_per_slice(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    // Each backend listens on its own port only: a wrong number is a refused connection.
    env.serve(1, &[8080])?;
    env.serve(2, &[8081])?;
    let stored = apply(
        cp,
        &[
            env.service(
                "web",
                json!({"ports": [{"name": "http", "port": 80, "targetPort": "web"}]}),
            ),
            env.slice(
                "web-v1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([ep(&env.v4(1))]),
            ),
            env.slice(
                "web-v2",
                "web",
                "IPv4",
                json!([port("http", 8081, "TCP")]),
                json!([ep(&env.v4(2))]),
            ),
        ],
    )?;
    let vip = cluster_ip(&stored)?;
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "both numbers used", || {
        tcp_backends(&env.sb, sa(vip, 80), 30, &["b1", "b2"])
    })?;
    let want = vec![format!("{}:8080", env.v4(1)), format!("{}:8081", env.v4(2))];
    let listed = listed_backends(env.agent(), vip, 80, "TCP")?;
    ensure!(listed == want, "listed {listed:?}, want {want:?}");
    Ok(())
}

/// Scenario 3: Endpoints merged across slices; an endpoint listed twice (terminating in one slice,
/// ready in the other, as while it moves) is served once, as the ready copy.
fn slices_merged_and_deduplicated(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    for i in 1..=3 {
        env.serve(i, &[8080])?;
    }
    let http = json!([port("http", 8080, "TCP")]);
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": [{"name": "http", "port": 80}]})),
            // The terminating copy comes first in name order: first-wins would drop b2.
            env.slice(
                "web-a",
                "web",
                "IPv4",
                http.clone(),
                json!([ep(&env.v4(1)), ep_cond(&env.v4(2), false, true, true)]),
            ),
            env.slice(
                "web-b",
                "web",
                "IPv4",
                http,
                json!([ep(&env.v4(2)), ep(&env.v4(3))]),
            ),
        ],
    )?;
    let vip = cluster_ip(&stored)?;
    env.start_agent(cp)?;
    eventually(
        Instant::now(),
        SETTLE,
        "three backends from two slices",
        || tcp_backends(&env.sb, sa(vip, 80), 30, &["b1", "b2", "b3"]),
    )?;
    let want: Vec<String> = (1..=3).map(|i| format!("{}:8080", env.v4(i))).collect();
    let listed = listed_backends(env.agent(), vip, 80, "TCP")?;
    ensure!(
        listed == want,
        "listed {listed:?}, want {want:?} (each once)"
    );
    Ok(())
}

/// Scenario 4: Dual-stack by ipFamilies: each ClusterIP reaches its family's endpoints; an FQDN slice
/// is ignored.
fn dual_stack_and_fqdn(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[8080])?;
    env.serve(2, &[8080])?;
    let http = json!([port("http", 8080, "TCP")]);
    let stored = apply(
        cp,
        &[
            env.service(
                "web",
                json!({
                    "ipFamilyPolicy": "RequireDualStack",
                    "ipFamilies": ["IPv6", "IPv4"],
                    "ports": [{"name": "http", "port": 80}],
                }),
            ),
            env.slice(
                "web-v4",
                "web",
                "IPv4",
                http.clone(),
                json!([ep(&env.v4(1))]),
            ),
            env.slice(
                "web-v6",
                "web",
                "IPv6",
                http.clone(),
                json!([ep(&env.v6(2))]),
            ),
            env.slice(
                "web-fqdn",
                "web",
                "FQDN",
                http,
                json!([ep("backend.example.com")]),
            ),
        ],
    )?;
    let ips = cluster_ips(&stored)?;
    ensure!(ips.len() == 2, "want two clusterIPs, got {ips:?}");
    let v4 = *ips
        .iter()
        .find(|ip| ip.is_ipv4())
        .context("no IPv4 clusterIP")?;
    let v6 = *ips
        .iter()
        .find(|ip| ip.is_ipv6())
        .context("no IPv6 clusterIP")?;
    ensure!(
        ips[0] == v6,
        "ipFamilies [IPv6, IPv4]: primary should be IPv6: {ips:?}"
    );
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "both families served", || {
        tcp_backends(&env.sb, sa(v4, 80), 5, &["b1"])?;
        tcp_backends(&env.sb, sa(v6, 80), 5, &["b2"])
    })?;
    let l4 = listed_backends(env.agent(), v4, 80, "TCP")?;
    let l6 = listed_backends(env.agent(), v6, 80, "TCP")?;
    ensure!(
        l4 == vec![format!("{}:8080", env.v4(1))],
        "IPv4 frontend lists {l4:?}"
    );
    ensure!(
        l6 == vec![format!("[{}]:8080", env.v6(2))],
        "IPv6 frontend lists {l6:?}"
    );
    Ok(())
}

/// Scenario 5: Ready endpoints only; with none ready, those serving while terminating; with neither,
/// refused.
fn ready_serving_terminating(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    for i in 1..=3 {
        env.serve(i, &[8080])?;
    }
    let slice = |env: &Env, eps: Value| {
        env.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            eps,
        )
    };
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": [{"name": "http", "port": 80}]})),
            slice(
                &env,
                json!([
                    ep(&env.v4(1)),
                    ep_cond(&env.v4(2), false, true, true),
                    ep_cond(&env.v4(3), false, false, false),
                ]),
            ),
        ],
    )?;
    let vip = sa(cluster_ip(&stored)?, 80);
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "only the ready endpoint", || {
        tcp_backends(&env.sb, vip, 20, &["b1"])
    })?;

    let t = write(
        cp,
        &[slice(
            &env,
            json!([
                ep_cond(&env.v4(1), false, false, true),
                ep_cond(&env.v4(2), false, true, true),
                ep_cond(&env.v4(3), false, false, false),
            ]),
        )],
    )?;
    eventually(
        t,
        LIVE,
        "none ready: the serving terminating endpoint",
        || tcp_backends(&env.sb, vip, 20, &["b2"]),
    )?;

    let t = write(
        cp,
        &[slice(
            &env,
            json!([
                ep_cond(&env.v4(1), false, false, true),
                ep_cond(&env.v4(2), false, false, true),
                ep_cond(&env.v4(3), false, false, false),
            ]),
        )],
    )?;
    eventually(t, LIVE, "neither: refused", || tcp_refused(&env.sb, vip))?;
    Ok(())
}

/// Scenario 6: internalTrafficPolicy: Local uses only endpoints on the agent's node; none there is a
/// refusal (no fallback to other nodes).
fn internal_traffic_policy_local(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    for i in 1..=3 {
        env.serve(i, &[8080])?;
    }
    let node = env.node.clone();
    let slice = |env: &Env, first_node: &str| {
        env.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([
                with(ep(&env.v4(1)), "nodeName", first_node.into()),
                with(ep(&env.v4(2)), "nodeName", "elsewhere".into()),
                ep(&env.v4(3)),
            ]),
        )
    };
    let stored = apply(
        cp,
        &[
            env.service(
                "web",
                json!({"internalTrafficPolicy": "Local", "ports": [{"name": "http", "port": 80}]}),
            ),
            slice(&env, &node),
        ],
    )?;
    let vip = sa(cluster_ip(&stored)?, 80);
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "only the local endpoint", || {
        tcp_backends(&env.sb, vip, 20, &["b1"])
    })?;
    let t = write(cp, &[slice(&env, "elsewhere")])?;
    eventually(t, LIVE, "no local endpoint: refused", || {
        tcp_refused(&env.sb, vip)
    })?;
    Ok(())
}

/// Scenario 7: Topology hints: every endpoint hinted, so only this node's zone is used; one endpoint
/// without hints, so all are.
fn topology_hints(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    for i in 1..=3 {
        env.serve(i, &[8080])?;
    }
    apply(
        cp,
        &[json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": env.node, "labels": { ZONE: "zone-a" }},
        })],
    )?;
    let hinted = |env: &Env, i: u8, zone: &str| {
        let e = with(ep(&env.v4(i)), "zone", zone.into());
        with(e, "hints", json!({"forZones": [{"name": zone}]}))
    };
    let stored = apply(
        cp,
        &[
            env.service(
                "web",
                json!({"trafficDistribution": "PreferClose", "ports": [{"name": "http", "port": 80}]}),
            ),
            env.slice(
                "web-1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([
                    hinted(&env, 1, "zone-a"),
                    hinted(&env, 2, "zone-b"),
                    hinted(&env, 3, "zone-a")
                ]),
            ),
        ],
    )?;
    let vip = sa(cluster_ip(&stored)?, 80);
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "only zone-a endpoints", || {
        tcp_backends(&env.sb, vip, 30, &["b1", "b3"])
    })?;
    let t = write(
        cp,
        &[env.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([
                hinted(&env, 1, "zone-a"),
                with(ep(&env.v4(2)), "zone", "zone-b".into()),
                hinted(&env, 3, "zone-a")
            ]),
        )],
    )?;
    eventually(t, LIVE, "one endpoint without hints: all used", || {
        tcp_backends(&env.sb, vip, 30, &["b1", "b2", "b3"])
    })?;
    cp.kubectl(&["delete", "node", &env.node])?;
    Ok(())
}

/// Scenario 8: sessionAffinity: ClientIP switched on and off on a live Service.
fn session_affinity_live(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    for i in 1..=3 {
        env.serve(i, &[8080])?;
    }
    let ports = json!([{"name": "http", "port": 80}]);
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": ports})),
            env.slice(
                "web-1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([ep(&env.v4(1)), ep(&env.v4(2)), ep(&env.v4(3))]),
            ),
        ],
    )?;
    let ip = cluster_ip(&stored)?;
    let vip = sa(ip, 80);
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "spread without affinity", || {
        tcp_spread(&env.sb, vip, 15).map(drop)
    })?;

    let t = write(
        cp,
        &[env.service(
            "web",
            json!({
                "ports": ports,
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}},
            }),
        )],
    )?;
    eventually(t, LIVE, "affinity on: 15 connections, one backend", || {
        let r = env.sb.tcp(vip, 15, &["--timeout-ms", "1000"])?;
        ensure!(r.all_ok(), "failures: {:?}", r.failures());
        ensure!(names(&r).len() == 1, "spread over {:?}", r.backends());
        Ok(())
    })?;
    let list = env.agent().list()?;
    let fe = list
        .services
        .iter()
        .find(|s| s.ip.parse::<IpAddr>().ok() == Some(ip) && s.port == 80)
        .context("frontend not listed")?;
    ensure!(
        fe.affinity_timeout_s == Some(30),
        "affinity timeout {:?}, want 30",
        fe.affinity_timeout_s
    );

    let t = write(
        cp,
        &[env.service("web", json!({"ports": ports, "sessionAffinity": "None"}))],
    )?;
    eventually(t, LIVE, "affinity off: spread again", || {
        tcp_spread(&env.sb, vip, 15).map(drop)
    })?;
    Ok(())
}

/// Scenario 9: type: ClusterIP → ExternalName stops answering; back to ClusterIP answers again.
fn type_external_name_and_back(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[8080])?;
    let ip: IpAddr = "10.96.90.9".parse()?;
    let vip = sa(ip, 80);
    let cluster = json!({"type": "ClusterIP", "clusterIP": ip.to_string(),
                         "ports": [{"name": "http", "port": 80}]});
    apply(
        cp,
        &[
            env.service("web", cluster.clone()),
            env.slice(
                "web-1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([ep(&env.v4(1))]),
            ),
        ],
    )?;
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "ClusterIP served", || {
        tcp_backends(&env.sb, vip, 5, &["b1"])
    })?;

    let stored = apply(
        cp,
        &[env.service(
            "web",
            json!({"type": "ExternalName", "externalName": "web.example.com",
                   "ports": [{"name": "http", "port": 80}]}),
        )],
    )?;
    let t = Instant::now();
    let spec = &stored[0]["spec"];
    ensure!(
        spec["clusterIP"].as_str().unwrap_or("").is_empty(),
        "ExternalName kept clusterIP: {spec}"
    );
    eventually(t, LIVE, "ExternalName: not answered", || {
        tcp_unanswered(&env.sb, vip)
    })?;

    let t = write(cp, &[env.service("web", cluster)])?;
    eventually(t, LIVE, "ClusterIP again: answered", || {
        tcp_backends(&env.sb, vip, 5, &["b1"])
    })?;
    Ok(())
}

/// Scenario 10: The service-proxy-name label: a default agent serves an unlabelled Service; labelling it
/// (Service and slice, as the EndpointSlice controller copies labels) for another proxy stops
/// it live, removing the label brings it back.
fn service_proxy_name_label(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[8080])?;
    let ip: IpAddr = "10.96.100.10".parse()?;
    let vip = sa(ip, 80);
    let objects = |env: &Env, proxy: Option<&str>| {
        vec![
            service(
                &env.name,
                "web",
                proxy,
                json!({"clusterIP": ip.to_string(), "ports": [{"name": "http", "port": 80}]}),
            ),
            slice(
                &env.name,
                "web-1",
                "web",
                proxy,
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([ep(&env.v4(1))]),
            ),
        ]
    };
    apply(cp, &objects(&env, None))?;
    // The default selector: no --service-proxy-name.
    env.start_agent_with(cp, &[])?;
    eventually(Instant::now(), SETTLE, "unlabelled: served", || {
        tcp_backends(&env.sb, vip, 5, &["b1"])
    })?;
    let t = write(cp, &objects(&env, Some("another-proxy")))?;
    eventually(t, LIVE, "labelled for another proxy: not served", || {
        tcp_unanswered(&env.sb, vip)
    })?;
    let t = write(cp, &objects(&env, None))?;
    eventually(t, LIVE, "label removed: served again", || {
        tcp_backends(&env.sb, vip, 5, &["b1"])
    })?;
    Ok(())
}

/// Scenario 11: A connected UDP socket does not stay with a backend whose endpoint was deleted: the
/// agent closes it (sock_diag) within 1 s, and the reconnected socket reaches a live backend.
/// The old backend keeps running, so only the agent can end the old flow.
fn udp_socket_leaves_deleted_backend(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[5353])?;
    env.serve(2, &[5353])?;
    let slice = |env: &Env, eps: &[u8]| {
        let eps: Vec<Value> = eps.iter().map(|&i| ep(&env.v4(i))).collect();
        env.slice(
            "dns-1",
            "dns",
            "IPv4",
            json!([port("dns", 5353, "UDP")]),
            json!(eps),
        )
    };
    let stored = apply(
        cp,
        &[
            env.service(
                "dns",
                json!({"ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
            ),
            slice(&env, &[1]),
        ],
    )?;
    let vip = sa(cluster_ip(&stored)?, 53);
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "UDP served by b1", || {
        udp_backends(&env.sb, vip, 3, true, &["b1"])
    })?;

    let stream = env
        .sb
        .spawn_udp_stream(vip, Duration::from_millis(5000), 20, 300)?;
    // The stream connects to b1 (the only endpoint); then b2 joins (the socket stays with b1),
    // then b1's endpoint is deleted.
    // (The sleeps only lay out the timeline; what is asserted comes from the timestamps.)
    std::thread::sleep(Duration::from_millis(1000));
    apply(cp, &[slice(&env, &[1, 2])])?;
    std::thread::sleep(Duration::from_millis(500));
    let before = unix_ms(SystemTime::now());
    apply(cp, &[slice(&env, &[2])])?;
    let deleted = unix_ms(SystemTime::now());
    let report = env.sb.finish_udp_stream(stream, Duration::from_secs(15))?;
    let ex = &report.exchanges;
    let summary = || {
        ex.iter()
            .map(|e| {
                format!(
                    "{:+}ms s{} {}",
                    e.at_ms as i64 - deleted as i64,
                    e.socket,
                    e.backend.clone().or(e.error.clone()).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let early: Vec<_> = ex.iter().filter(|e| e.at_ms < before).collect();
    ensure!(
        early.len() >= 5
            && early
                .iter()
                .all(|e| e.ok && e.backend.as_deref() == Some("b1")),
        "before the deletion the socket should talk to b1 only: {}",
        summary()
    );
    ensure!(
        early.iter().all(|e| e.socket == 0),
        "the socket was replaced before the deletion: {}",
        summary()
    );
    let first_error = ex
        .iter()
        .find(|e| !e.ok)
        .with_context(|| format!("the socket never errored out: {}", summary()))?;
    ensure!(
        first_error.at_ms >= before && first_error.at_ms <= deleted + LIVE.as_millis() as u64,
        "the socket errored {}ms after the deletion (want ≤ {LIVE:?}): {}",
        first_error.at_ms as i64 - deleted as i64,
        summary()
    );
    eprintln!(
        "    connected socket closed {}ms after the write ({:?}, errno {:?})",
        first_error.at_ms as i64 - deleted as i64,
        first_error.error,
        first_error.errno
    );
    let after: Vec<_> = ex.iter().filter(|e| e.at_ms > first_error.at_ms).collect();
    ensure!(
        after.iter().filter(|e| e.ok).count() >= 10
            && after
                .iter()
                .filter(|e| e.ok)
                .all(|e| e.backend.as_deref() == Some("b2") && e.peer == Some(vip.to_string())),
        "after reconnecting the socket should reach b2 (peer {vip}): {}",
        summary()
    );
    let errors = ex.iter().filter(|e| !e.ok).count();
    ensure!(errors <= 2, "{errors} failed exchanges: {}", summary());
    Ok(())
}

/// Scenario 12: Lifecycle: an agent started on an empty cluster becomes ready and serves what comes
/// later; what changed while it was down is applied after a restart; an apiserver restart
/// costs no connection and later changes still arrive.
fn lifecycle(cp: &mut ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    for i in 1..=3 {
        env.serve(i, &[8080])?;
    }
    let http = || json!([port("http", 8080, "TCP")]);
    let web_slice =
        |env: &Env, i: u8| env.slice("web-1", "web", "IPv4", http(), json!([ep(&env.v4(i))]));

    // Nothing of this proxy exists yet.
    env.start_agent(cp)?;
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": [{"name": "http", "port": 80}]})),
            web_slice(&env, 1),
        ],
    )?;
    let t = Instant::now();
    let vip = sa(cluster_ip(&stored)?, 80);
    eventually(t, LIVE, "a Service created after ready", || {
        tcp_backends(&env.sb, vip, 5, &["b1"])
    })?;

    // Changes while the agent is down.
    env.agent().kill()?;
    apply(cp, &[web_slice(&env, 2)])?;
    let stored = apply(
        cp,
        &[
            env.service("api", json!({"ports": [{"name": "http", "port": 80}]})),
            env.slice("api-1", "api", "IPv4", http(), json!([ep(&env.v4(3))])),
        ],
    )?;
    let api = sa(cluster_ip(&stored)?, 80);
    // The datapath keeps serving what it had.
    tcp_backends(&env.sb, vip, 5, &["b1"]).context("while the agent is down")?;
    env.agent().restart()?;
    env.agent()
        .wait_ready(svc_tests::sandbox::AGENT_READY_TIMEOUT)?;
    let t = Instant::now();
    eventually(t, SETTLE, "changes made while down", || {
        tcp_backends(&env.sb, vip, 5, &["b2"])?;
        tcp_backends(&env.sb, api, 5, &["b3"])
    })?;

    // An apiserver restart under a connection loop.
    // The apiserver's graceful stop waits on the agent's watches until the harness's 15 s
    // SIGKILL, and a start takes a few seconds more: the loop covers all of it.
    let loop_for = Duration::from_secs(25);
    let run = env.sb.spawn_loop(vip, loop_for)?;
    let t = Instant::now();
    cp.restart_apiserver()?;
    let restart_took = t.elapsed();
    eprintln!("    apiserver restarted in {restart_took:.1?}");
    let t = write(cp, &[web_slice(&env, 3)])?;
    let result = eventually(
        t,
        AFTER_APISERVER_RESTART,
        "a change after the apiserver restart",
        || tcp_backends(&env.sb, vip, 5, &["b3"]),
    );
    let report = env
        .sb
        .finish_loop(run, loop_for + Duration::from_secs(20))?;
    result?;
    eprintln!(
        "    loop: {} connections, {} failed, over {}ms",
        report.ok, report.failed, report.duration_ms
    );
    ensure!(
        report.failed == 0 && report.ok > 0,
        "connections failed around the apiserver restart: {report:?}"
    );
    ensure!(
        restart_took < loop_for,
        "the restart ({restart_took:?}) outlasted the loop ({loop_for:?})"
    );
    Ok(())
}

/// Scenario 13: kube-proxy's /healthz and the Prometheus metrics, each on its own port.
/// Issue 6, item 10: the API server's own address given with --k8s-api-server replaces the
/// configured one, which in a cluster is the `kubernetes` ClusterIP only svc serves (here, an
/// address nothing answers on). With it the agent starts on empty pins and serves.
fn api_server_given_by_flag(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    let vip = serve_web(&mut env, cp)?;
    let real = cp.server_url();
    let kubeconfig = std::fs::read_to_string(cp.kubeconfig_path())?;
    ensure!(kubeconfig.contains(&real), "{real} not in the kubeconfig");
    let unreachable = kubeconfig.replace(&real, "https://10.96.0.1:443");
    let dir = svc_tests::TempDir::new("svc-kubeconfig")?;
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, unreachable)?;
    let agent = env.sb.agent_kubeconfig(
        &env.bpffs,
        &path,
        &env.node,
        &[
            "--service-proxy-name",
            name,
            "--service-cidr",
            "10.96.0.0/12",
            &format!("--k8s-api-server={real}"),
        ],
    )?;
    env.agent = Some(agent);
    tcp_backends(&env.sb, vip, 3, &["b1"])?;
    ensure!(
        env.agent()
            .log()
            .contains(&format!("watching the Kubernetes API api_server={real}")),
        "{}",
        env.agent().log()
    );
    Ok(())
}

fn healthz_and_metrics(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[8080, 9090])?;
    let stored = apply(
        cp,
        &[
            env.service(
                "web",
                json!({"ports": [{"name": "http", "port": 80}, {"name": "m", "port": 9090}]}),
            ),
            env.slice(
                "web-1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP"), port("m", 9090, "TCP")]),
                json!([ep(&env.v4(1))]),
            ),
        ],
    )?;
    let vip = cluster_ip(&stored)?;
    env.start_agent(cp)?;
    let healthz = env.agent().healthz_addr().context("no healthz address")?;
    let metrics = env.agent().metrics_addr().context("no metrics address")?;
    ensure!(healthz.ip().is_loopback() && metrics.ip().is_loopback());
    tcp_backends(&env.sb, sa(vip, 80), 3, &["b1"])?;

    let (status, body) = http_get(healthz, "/healthz")?;
    ensure!(status == 200, "/healthz: {status} {body}");
    let health: Value =
        serde_json::from_str(&body).with_context(|| format!("/healthz body {body:?}"))?;
    for field in ["lastUpdated", "currentTime"] {
        ensure!(
            health[field].as_str().is_some_and(|s| !s.is_empty()),
            "/healthz {field} missing or empty: {body}"
        );
    }
    ensure!(
        health["nodeEligible"] == true,
        "/healthz nodeEligible: {body}"
    );

    // kube-proxy's rule (KEP-3836): a node the cluster autoscaler is about to delete fails
    // /healthz, so load balancers drain it first; /livez and the connections stay.
    let tainted = |taints: Value| {
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": env.node},
            "spec": {"taints": taints},
        })
    };
    apply(
        cp,
        &[tainted(json!([{
            "key": "ToBeDeletedByClusterAutoscaler",
            "value": "1733400000",
            "effect": "NoSchedule"
        }]))],
    )?;
    eventually(
        Instant::now(),
        SETTLE,
        "/healthz 503 while being deleted",
        || {
            let (status, body) = http_get(healthz, "/healthz")?;
            let health: Value = serde_json::from_str(&body)?;
            ensure!(
                status == 503 && health["nodeEligible"] == false,
                "/healthz {status} {body}"
            );
            Ok(())
        },
    )?;
    let (status, body) = http_get(healthz, "/livez")?;
    ensure!(status == 200, "/livez while being deleted: {status} {body}");
    tcp_backends(&env.sb, sa(vip, 80), 3, &["b1"])?;
    apply(cp, &[tainted(json!([]))])?;
    eventually(
        Instant::now(),
        SETTLE,
        "/healthz 200 once the taint is gone",
        || {
            let (status, body) = http_get(healthz, "/healthz")?;
            ensure!(status == 200, "/healthz {status} {body}");
            Ok(())
        },
    )?;

    // As kube-proxy: the health port (0.0.0.0 by default) does not give the metrics away.
    let (status, _) = http_get(healthz, "/metrics")?;
    ensure!(
        status == 404,
        "/metrics on the health port {healthz}: {status}, want 404"
    );
    let (status, body) = http_get(metrics, "/metrics")?;
    ensure!(status == 200, "/metrics: {status}");
    ensure!(
        body.lines().any(|l| l == "svc_frontends_programmed 2"),
        "/metrics lacks `svc_frontends_programmed 2`:\n{body}"
    );
    ensure!(
        body.lines()
            .any(|l| l.starts_with("svc_sync_duration_seconds_count ") && !l.ends_with(" 0")),
        "/metrics lacks svc_sync_duration_seconds observations:\n{body}"
    );
    Ok(())
}

/// Scenario 19: an agent stopped because its DaemonSet no longer runs it on this node (the
/// node unlabelled, the DaemonSet deleted) hands over and uninstalls; stopped otherwise (a
/// rolling update, a restart), it leaves the datapath serving. Without a controller-manager
/// the DaemonSet is an object only: the agent is the test's process, stopped by SIGTERM as a
/// kubelet stops it.
fn removed_from_the_node(cp: &ControlPlane, name: &str) -> Result<()> {
    const SELECT: &str = "svc.dev/agent";
    let mut env = Env::new(cp, name)?;
    let node_name = env.node.clone();
    let node = |labels: Value| {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": node_name, "labels": labels}})
    };
    apply(cp, &[node(json!({ SELECT: "true" }))])?;
    let daemonset = json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "svc-agent", "namespace": name},
        "spec": {
            "selector": {"matchLabels": {"app": "svc-agent"}},
            "template": {
                "metadata": {"labels": {"app": "svc-agent"}},
                "spec": {
                    "nodeSelector": { SELECT: "true" },
                    "containers": [{"name": "svc-agent", "image": "svc-agent:dev"}],
                },
            },
        },
    });
    apply(cp, std::slice::from_ref(&daemonset))?;
    let vip = serve_web(&mut env, cp)?;
    let ds_flag = format!("{name}/svc-agent");
    let flags = ["--service-proxy-name", name, "--daemonset", &ds_flag];
    const STOP: Duration = Duration::from_secs(20);
    const GONE: &str = "stopped for good on this node";

    // A stop while the DaemonSet still selects the node: a restart, the datapath stays.
    env.start_agent_with(cp, &flags)?;
    eventually(Instant::now(), SETTLE, "served", || {
        tcp_backends(&env.sb, vip, 3, &["b1"])
    })?;
    let status = env.agent().terminate(STOP)?;
    ensure!(status.success(), "agent exit: {status}");
    ensure!(
        !env.agent().log().contains(GONE),
        "uninstalled on a restart:\n{}",
        env.agent().log()
    );
    ensure!(
        !env.bpffs.entries().is_empty(),
        "pins gone after a restart's stop"
    );
    tcp_backends(&env.sb, vip, 3, &["b1"]).context("after a restart's stop")?;

    // The node unlabelled: the DaemonSet no longer runs the agent here.
    env.start_agent_with(cp, &flags)?;
    cp.kubectl(&["label", "node", &node_name, &format!("{SELECT}-")])?;
    let status = env.agent().terminate(STOP)?;
    ensure!(status.success(), "agent exit: {status}");
    let log = env.agent().log();
    ensure!(
        log.contains(GONE) && log.contains(&format!("nodeSelector {SELECT}=true")),
        "no uninstall, or not why, once the node is unselected:\n{log}"
    );
    let left = env.bpffs.entries();
    ensure!(left.is_empty(), "pins left after the removal: {left:?}");
    ensure!(
        tcp_backends(&env.sb, vip, 1, &["b1"]).is_err(),
        "the ClusterIP is still served after the removal"
    );

    // Labelled again, then the DaemonSet deleted.
    apply(cp, &[node(json!({ SELECT: "true" }))])?;
    env.start_agent_with(cp, &flags)?;
    eventually(Instant::now(), SETTLE, "served again", || {
        tcp_backends(&env.sb, vip, 3, &["b1"])
    })?;
    cp.kubectl(&[
        "-n",
        name,
        "delete",
        "daemonset",
        "svc-agent",
        "--wait=false",
    ])?;
    let status = env.agent().terminate(STOP)?;
    ensure!(status.success(), "agent exit: {status}");
    let log = env.agent().log();
    ensure!(
        log.contains(GONE) && (log.contains("is gone") || log.contains("is being deleted")),
        "no uninstall once the DaemonSet is deleted:\n{log}"
    );
    ensure!(
        env.bpffs.entries().is_empty(),
        "pins left after the DaemonSet's deletion"
    );

    // `helm uninstall`: the RBAC goes with the DaemonSet (here the binding first, the worst
    // order), so at its stop the agent can read neither; its watch of the DaemonSet, open
    // since its start, saw the deletion.
    let sa = format!("{name}-agent");
    let rbac = json!([
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": sa, "namespace": name}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": sa},
         "rules": [
            {"apiGroups": [""], "resources": ["services", "nodes"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["apps"], "resources": ["daemonsets"],
             "resourceNames": ["svc-agent"], "verbs": ["get", "list", "watch"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": sa},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": name}]},
    ]);
    apply(cp, rbac.as_array().expect("objects"))?;
    apply(cp, std::slice::from_ref(&daemonset))?;
    let sa_kubeconfig = cp.service_account_kubeconfig(name, &sa)?;
    let agent = env
        .sb
        .agent_kubeconfig(&env.bpffs, &sa_kubeconfig, &env.node, &flags)
        .context("agent with its ServiceAccount's credentials")?;
    env.agent = Some(agent);
    eventually(
        Instant::now(),
        SETTLE,
        "served by the ServiceAccount",
        || tcp_backends(&env.sb, vip, 3, &["b1"]),
    )?;
    for what in [
        vec!["delete", "clusterrolebinding", &sa],
        vec!["delete", "clusterrole", &sa],
        vec!["-n", name, "delete", "daemonset", "svc-agent"],
        vec!["-n", name, "delete", "serviceaccount", &sa],
    ] {
        cp.kubectl(&[what.as_slice(), &["--wait=false"]].concat())?;
    }
    // The pods of a deleted DaemonSet are deleted after it (by the garbage collector).
    std::thread::sleep(Duration::from_secs(1));
    let status = env.agent().terminate(STOP)?;
    ensure!(status.success(), "agent exit: {status}");
    let log = env.agent().log();
    ensure!(
        log.contains(GONE) && log.contains("is gone (seen while running; at the stop:"),
        "no uninstall, or not by the watch, after the DaemonSet and its RBAC were deleted \
         together:\n{log}"
    );
    ensure!(
        env.bpffs.entries().is_empty(),
        "pins left after the DaemonSet and its RBAC were deleted"
    );

    // Without --daemonset every stop keeps the datapath; kube-proxy's `--cleanup` removes it.
    env.start_agent(cp)?;
    let status = env.agent().terminate(STOP)?;
    ensure!(status.success(), "agent exit: {status}");
    ensure!(
        !env.bpffs.entries().is_empty(),
        "pins gone without --daemonset"
    );
    let out = std::process::Command::new(&env.sb.tools.agent)
        .arg("--cleanup")
        .arg("--bpffs")
        .arg(env.bpffs.path())
        .output()?;
    ensure!(
        out.status.success(),
        "svc-agent --cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(env.bpffs.entries().is_empty(), "pins left after --cleanup");
    Ok(())
}

/// Scenario 20: `explain --kubeconfig` gives the agent's intent (the Service port, its
/// EndpointSlices, each endpoint used or left out and why) beside the kernel's maps, and
/// warns where they differ: here, a change the stopped agent has not programmed.
fn explain_with_the_api(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    env.serve(1, &[8080])?;
    env.serve(2, &[8080])?;
    let http = || json!([port("http", 8080, "TCP")]);
    let (v4_1, v4_2) = (env.v4(1), env.v4(2));
    let endpoints = |b2_ready: bool| {
        json!([
            {"addresses": [v4_1], "conditions": {"ready": true}},
            {"addresses": [v4_2], "conditions": {"ready": b2_ready}},
        ])
    };
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": [{"name": "http", "port": 80}]})),
            env.slice("web-1", "web", "IPv4", http(), endpoints(false)),
        ],
    )?;
    let vip = sa(cluster_ip(&stored)?, 80);
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "served", || {
        tcp_backends(&env.sb, vip, 3, &["b1"])
    })?;
    let explain = |env: &Env| -> Result<Value> {
        let out = std::process::Command::new(&env.sb.tools.agent)
            .args(["explain", "-o", "json", "--dst", &vip.to_string()])
            .arg("--bpffs")
            .arg(env.bpffs.path())
            .arg("--kubeconfig")
            .arg(cp.kubeconfig_path())
            .args(["--node-name", &env.node, "--service-proxy-name", name])
            .output()?;
        ensure!(
            out.status.success(),
            "explain: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let b = |i: u8| format!("{}:8080", if i == 1 { &v4_1 } else { &v4_2 });
    let e = explain(&env)?;
    ensure!(
        e["read_from"] == "pinned maps and the Kubernetes API",
        "read_from: {e:#}"
    );
    let intent = &e["intent"];
    ensure!(
        intent["service"] == format!("{name}/web").as_str() && intent["port_name"] == "http",
        "intent: {e:#}"
    );
    let rv = cp.kubectl(&[
        "-n",
        name,
        "get",
        "endpointslice",
        "web-1",
        "-o",
        "jsonpath={.metadata.resourceVersion}",
    ])?;
    ensure!(
        intent["slices"]
            == json!([{"name": format!("{name}/web-1"), "resource_version": rv.trim()}]),
        "slices: {e:#}"
    );
    ensure!(
        intent["endpoints"]
            == json!([
                {"address": b(1), "used": true, "reason": "ready"},
                {"address": b(2), "used": false, "reason": "not ready"},
            ]),
        "endpoints: {e:#}"
    );
    ensure!(e["warnings"] == json!([]), "warnings while in step: {e:#}");

    // A change the agent does not see: the kernel and the intent differ, and explain says so.
    env.agent().kill()?;
    apply(
        cp,
        &[env.slice("web-1", "web", "IPv4", http(), endpoints(true))],
    )?;
    let e = explain(&env)?;
    ensure!(
        e["warnings"]
            == json!([format!(
                "{} is intended but not in the kernel's slots",
                b(2)
            )]),
        "warnings once the kernel is behind: {e:#}"
    );
    ensure!(
        e["verdict"] == "backend" && e["backends"] == json!([b(1)]),
        "the kernel's part changed: {e:#}"
    );
    Ok(())
}

/// The ConfigMap keys the DaemonSet's agent container reads.
fn checked_env(daemonset: &str) -> Result<Vec<String>> {
    let ds: Value = serde_saphyr::from_str(daemonset)?;
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("no containers")?;
    Ok(containers
        .iter()
        .flat_map(|c| c["env"].as_array().cloned().unwrap_or_default())
        .filter_map(|e| {
            e["valueFrom"]["configMapKeyRef"]["key"]
                .as_str()
                .map(String::from)
        })
        .collect())
}

/// Scenario 14: deploy/: the apiserver validates rbac.yaml and daemonset.yaml; an agent authenticated
/// as the ServiceAccount that rbac.yaml binds becomes ready and serves, so the ClusterRole
/// grants enough (and not more than listed).
fn deploy_manifests_and_rbac(cp: &ControlPlane, name: &str) -> Result<()> {
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    let rbac = std::fs::read_to_string(format!("{deploy}/rbac.yaml"))?;
    let daemonset = std::fs::read_to_string(format!("{deploy}/daemonset.yaml"))?;
    let checked = cp
        .dry_run_server_side(&rbac)
        .context("dry run of rbac.yaml")?;
    let kinds: BTreeSet<String> = checked
        .iter()
        .map(|o| o["kind"].as_str().unwrap_or_default().to_string())
        .collect();
    ensure!(
        kinds == set(&["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]),
        "rbac.yaml: {kinds:?}"
    );
    let checked = cp
        .dry_run_server_side(&daemonset)
        .context("dry run of daemonset.yaml")?;
    ensure!(checked.len() == 1 && checked[0]["kind"] == "DaemonSet");
    let config = std::fs::read_to_string(format!("{deploy}/config.yaml"))?;
    let checked = cp
        .dry_run_server_side(&config)
        .context("dry run of config.yaml")?;
    ensure!(checked.len() == 1 && checked[0]["kind"] == "ConfigMap");
    // Every ConfigMap key the DaemonSet reads exists.
    let env = checked_env(&daemonset)?;
    for key in env {
        ensure!(
            !checked[0]["data"][&key].is_null(),
            "daemonset.yaml reads {key} from the ConfigMap, which config.yaml does not set"
        );
    }
    ensure!(
        cp.kubectl(&["get", "clusterrole", "svc-agent"]).is_err(),
        "a dry run stored the ClusterRole"
    );

    cp.apply_yaml(&rbac).context("applying rbac.yaml")?;
    let sa_kubeconfig = cp.service_account_kubeconfig("kube-system", "svc-agent")?;
    let can = |verb: &str, resource: &str| -> bool {
        cp.kubectl_as(&sa_kubeconfig, &["auth", "can-i", verb, resource], None)
            .is_ok_and(|out| out.trim() == "yes")
    };
    for resource in ["services", "endpointslices.discovery.k8s.io", "nodes"] {
        for verb in ["list", "watch"] {
            ensure!(
                can(verb, resource),
                "the ServiceAccount cannot {verb} {resource}"
            );
        }
    }
    for (verb, resource) in [
        ("list", "secrets"),
        ("update", "services"),
        ("create", "pods"),
        ("list", "daemonsets.apps"),
        ("get", "daemonsets.apps/kube-proxy"),
    ] {
        ensure!(
            !can(verb, resource),
            "the ServiceAccount can {verb} {resource}"
        );
    }
    let can_in = |verb: &str, resource: &str, ns: &str| -> bool {
        cp.kubectl_as(
            &sa_kubeconfig,
            &["auth", "can-i", verb, resource, "-n", ns],
            None,
        )
        .is_ok_and(|out| out.trim() == "yes")
    };
    for verb in ["get", "watch"] {
        ensure!(
            can_in(verb, "daemonsets.apps/svc-agent", "kube-system"),
            "the ServiceAccount cannot {verb} its own DaemonSet"
        );
    }

    let mut env = Env::new(cp, name)?;
    let vip = serve_web(&mut env, cp)?;
    let agent = env
        .sb
        .agent_kubeconfig(
            &env.bpffs,
            &sa_kubeconfig,
            &env.node,
            &[
                "--service-proxy-name",
                name,
                "--daemonset",
                "kube-system/svc-agent",
            ],
        )
        .context("agent with the ServiceAccount's credentials")?;
    env.agent = Some(agent);
    eventually(
        Instant::now(),
        SETTLE,
        "served with the ServiceAccount",
        || tcp_backends(&env.sb, vip, 5, &["b1"]),
    )?;
    // No watch of the three kinds was refused (the Node watch does not gate readiness).
    let metrics = env.agent().metrics_addr().context("no metrics address")?;
    let (_, body) = http_get(metrics, "/metrics")?;
    let errors: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("svc_errors_total{kind=\"watch_"))
        .collect();
    ensure!(
        errors.is_empty(),
        "watch errors with the ServiceAccount: {errors:?}"
    );
    // Its stop reads its DaemonSet, which no one created here: gone, so it uninstalls (a
    // refused read would keep the datapath and say so).
    let status = env.agent().terminate(Duration::from_secs(20))?;
    ensure!(status.success(), "agent exit: {status}");
    let log = env.agent().log();
    let refused = refusals(&log);
    ensure!(
        refused.is_empty() && !log.contains("could not tell"),
        "the agent was refused something: {refused:#?}\n{log}"
    );
    ensure!(
        log.contains("DaemonSet kube-system/svc-agent is gone"),
        "the stop did not read the DaemonSet:\n{log}"
    );
    Ok(())
}

/// Backend b1 on 8080, and Service `web` (port 80, named http) with one slice of it: its
/// ClusterIP:80.
fn serve_web(env: &mut Env, cp: &ControlPlane) -> Result<SocketAddr> {
    env.serve(1, &[8080])?;
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": [{"name": "http", "port": 80}]})),
            env.slice(
                "web-1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([ep(&env.v4(1))]),
            ),
        ],
    )?;
    Ok(sa(cluster_ip(&stored)?, 80))
}

/// Labels Helm adds for its own bookkeeping; the plain manifests have no release to name.
const HELM_LABELS: [&str; 4] = [
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
];

/// `helm` (built by `cargo xtask control-plane`) with its caches and configuration in a
/// directory of the test's own.
struct Helm {
    bin: std::path::PathBuf,
    home: svc_tests::TempDir,
    chart: &'static str,
}

impl Helm {
    fn new() -> Result<Self> {
        let bin = std::env::var_os("SVC_HELM").context(
            "SVC_HELM is not set: `cargo xtask control-plane` builds helm and prints it",
        )?;
        Ok(Helm {
            bin: bin.into(),
            home: svc_tests::TempDir::new("svc-helm")?,
            chart: concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/helm/svc"),
        })
    }

    fn run(&self, args: &[&str]) -> Result<String> {
        let home = self.home.path();
        let out = std::process::Command::new(&self.bin)
            .args(args)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .output()
            .with_context(|| format!("running {}", self.bin.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "helm {}: {}\n{stdout}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }

    /// `helm template` into kube-system with `--set`s: the YAML, and its objects by kind.
    fn template(&self, sets: &[&str]) -> Result<(String, Vec<Value>)> {
        let mut args = vec!["template", "svc", self.chart, "--namespace", "kube-system"];
        for set in sets {
            args.extend(["--set", set]);
        }
        let yaml = self.run(&args)?;
        let objects: Vec<Value> = serde_saphyr::from_multiple(&yaml)
            .with_context(|| format!("parsing what helm rendered:\n{yaml}"))?;
        Ok((yaml, objects.into_iter().filter(|o| !o.is_null()).collect()))
    }
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind)
}

fn without_helm_labels(mut o: Value) -> Value {
    if let Some(labels) = o["metadata"]["labels"].as_object_mut() {
        for l in HELM_LABELS {
            labels.remove(l);
        }
    }
    o
}

fn agent_container(objects: &[Value]) -> Result<&Value> {
    of_kind(objects, "DaemonSet")
        .and_then(|ds| ds["spec"]["template"]["spec"]["containers"].get(0))
        .context("no DaemonSet with a container rendered")
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Scenario 16: the Helm chart, deploy/helm/svc. `helm lint` passes; its defaults render the
/// plain manifests of deploy/, object for object (Helm's own labels aside), so the two cannot
/// drift apart; other values render the flags, privileges and objects they say, and the
/// apiserver accepts every rendered set (server-side dry run); an agent started with the
/// flags the chart rendered serves.
fn helm_chart(cp: &ControlPlane, name: &str) -> Result<()> {
    let helm = Helm::new()?;
    helm.run(&["lint", "--strict", helm.chart])?;

    // The defaults are deploy/.
    let (yaml, rendered) = helm.template(&[])?;
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    let mut plain = Vec::new();
    for file in ["rbac.yaml", "config.yaml", "daemonset.yaml"] {
        let text = std::fs::read_to_string(format!("{deploy}/{file}"))?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)?;
        plain.extend(docs.into_iter().filter(|o| !o.is_null()));
    }
    let kinds = |objects: &[Value]| -> BTreeSet<String> {
        objects
            .iter()
            .map(|o| {
                format!(
                    "{}/{}",
                    o["kind"].as_str().unwrap_or("?"),
                    o["metadata"]["name"]
                )
            })
            .collect()
    };
    ensure!(
        kinds(&rendered) == kinds(&plain),
        "the chart renders {:?}, deploy/ holds {:?}",
        kinds(&rendered),
        kinds(&plain)
    );
    for object in &plain {
        let kind = object["kind"].as_str().unwrap_or("?");
        let from_chart = of_kind(&rendered, kind).cloned().map(without_helm_labels);
        ensure!(
            from_chart.as_ref() == Some(object),
            "the chart's default {kind} differs from deploy/'s:\nchart: {}\ndeploy/: {}",
            serde_json::to_string_pretty(&from_chart)?,
            serde_json::to_string_pretty(object)?
        );
    }
    let checked = cp
        .dry_run_server_side(&yaml)
        .context("dry run of the default render")?;
    ensure!(
        checked.len() == rendered.len(),
        "dry run: {} objects",
        checked.len()
    );

    // Values that change flags, ports, host paths and what is created.
    let (yaml, rendered) = helm.template(&[
        "k8sApiServer=https://10.0.0.10:6443",
        "devices=eth+\\,bond0",
        "nodePortAddresses=10.0.0.0/8",
        "localhostNodePorts=false",
        &format!("serviceProxyName={name}"),
        "maps.maxServices=4096",
        "maps.maxCt=8192",
        "maps.maxMaglevEntries=65536",
        "metrics.perService=false",
        "healthz.port=10266",
        "metrics.port=10259",
        "bpffs.hostPath=/run/bpf/",
        "bpffs.mount=false",
        "cgroupRoot=/sys/fs/cgroup/unified",
        "extraArgs={--conntrack-sweep-interval=30s}",
        "serviceAccount.create=false",
        "serviceAccount.name=node-proxier",
        "rbac.create=false",
    ])?;
    let container = agent_container(&rendered)?;
    let args = strings(&container["args"]);
    let want = [
        "run",
        "--cgroup=/sys/fs/cgroup/unified",
        "--bpffs=/run/bpf/svc",
        "--healthz-bind-address=0.0.0.0:10266",
        "--metrics-bind-address=127.0.0.1:10259",
        "--nodeport-addresses=10.0.0.0/8",
        "--localhost-nodeports=false",
        "--devices=eth+,bond0",
        &format!("--service-proxy-name={name}"),
        "--max-ct=8192",
        "--max-maglev-entries=65536",
        "--max-services=4096",
        "--per-service-metrics=false",
        "--conntrack-sweep-interval=30s",
    ];
    ensure!(args == want, "rendered args {args:?}, expected {want:?}");
    let pod = &of_kind(&rendered, "DaemonSet").context("no DaemonSet")?["spec"]["template"]["spec"];
    ensure!(
        pod["initContainers"].is_null(),
        "bpffs.mount=false still mounts bpffs"
    );
    ensure!(pod["serviceAccountName"] == "node-proxier");
    ensure!(container["livenessProbe"]["httpGet"]["port"] == 10266);
    let mounts: Vec<&Value> = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    ensure!(
        mounts.iter().any(|m| m["mountPath"] == "/run/bpf")
            && mounts
                .iter()
                .any(|m| m["mountPath"] == "/sys/fs/cgroup/unified"),
        "mounts: {mounts:?}"
    );
    let config = of_kind(&rendered, "ConfigMap").context("no ConfigMap")?;
    ensure!(config["data"]["k8s-api-server"] == "https://10.0.0.10:6443");
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"] {
        ensure!(
            of_kind(&rendered, kind).is_none(),
            "rbac.create=false renders a {kind}"
        );
    }
    cp.dry_run_server_side(&yaml)
        .context("dry run of the tuned render")?;

    // The datapath's modes and Maglev, an IPv6 bind address (in brackets), and numbers as a
    // values file gives them (floats to Helm, which would print 1.048576e+06).
    let (yaml, rendered) = helm.template(&[
        "xdpMode=generic",
        "tcAttach=classic",
        "maglev.algorithm=random",
        "maglev.seed=0x5eed",
        "healthz.bindAddress=::",
        "metrics.bindAddress=::1",
    ])?;
    let tuned = strings(&agent_container(&rendered)?["args"]);
    for want in [
        "--xdp-mode=generic",
        "--tc-attach=classic",
        "--lb-algorithm-external=random",
        "--maglev-seed=0x5eed",
        "--healthz-bind-address=[::]:10256",
        "--metrics-bind-address=[::1]:10249",
    ] {
        ensure!(
            tuned.iter().any(|a| a == want),
            "{want} not rendered: {tuned:?}"
        );
    }
    cp.dry_run_server_side(&yaml)
        .context("dry run of the modes' render")?;
    // A values file as an operator writes it: YAML 1.1 reads an unquoted off as false.
    let values = helm.home.path().join("values.yaml");
    std::fs::write(&values, "xdpMode: off\n")?;
    let values = values.display().to_string();
    let floats = helm.run(&[
        "template",
        "svc",
        helm.chart,
        "--namespace",
        "kube-system",
        "-f",
        &values,
        "--set-json",
        "maps.maxCt=1048576",
        "--set-json",
        "maglev.seed=12345678901",
    ])?;
    for want in ["--max-ct=1048576", "--maglev-seed=12345678901"] {
        ensure!(
            floats.contains(want),
            "{want} not rendered from a JSON number:\n{floats}"
        );
    }
    ensure!(
        !floats.contains("--xdp-mode"),
        "an unquoted `xdpMode: off` rendered an XDP mode:\n{floats}"
    );
    let too_big = helm.run(&[
        "template",
        "svc",
        helm.chart,
        "--set-json",
        "maglev.seed=18446744073709551615",
    ]);
    ensure!(
        too_big.is_err_and(|e| e.to_string().contains("quote it")),
        "a seed Helm cannot hold exactly was rendered"
    );

    // Least privilege: no hostPID, and the capabilities that serve without it.
    let (yaml, rendered) = helm.template(&["closeStaleUdpSockets=false"])?;
    let pod = &of_kind(&rendered, "DaemonSet").context("no DaemonSet")?["spec"]["template"]["spec"];
    ensure!(pod["hostPID"] == false);
    let caps = strings(&agent_container(&rendered)?["securityContext"]["capabilities"]["add"]);
    ensure!(
        caps == ["BPF", "PERFMON", "NET_ADMIN"],
        "capabilities {caps:?}"
    );
    cp.dry_run_server_side(&yaml)
        .context("dry run of the least-privilege render")?;

    // The agent takes every flag the chart rendered; those the harness sets for the test
    // (its cgroup, bpffs and ports: never the node's own) are its.
    let harness = [
        "run",
        "--cgroup=",
        "--bpffs=",
        "--healthz-bind-address=",
        "--metrics-bind-address=",
    ];
    let flags: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !harness.iter().any(|h| a.starts_with(h)))
        .collect();
    let mut env = Env::new(cp, name)?;
    let vip = serve_web(&mut env, cp)?;
    let agent = env
        .sb
        .agent_kubeconfig(&env.bpffs, cp.kubeconfig_path(), &env.node, &flags)
        .with_context(|| format!("an agent with the chart's flags {flags:?}"))?;
    env.agent = Some(agent);
    eventually(
        Instant::now(),
        SETTLE,
        "served with the chart's flags",
        || tcp_backends(&env.sb, vip, 5, &["b1"]),
    )?;
    Ok(())
}

/// Scenario 17: `run --config` with the KubeProxyConfiguration kubeadm writes into the
/// kube-proxy ConfigMap (`kubeadm config print init-defaults --component-configs
/// KubeProxyConfiguration`, the real kubeadm of the pinned version), edited as an operator
/// would: the agent takes its kubeconfig, node name, health and metrics addresses from it, a
/// flag given on the command line beats the file, and the fields that do not apply are named
/// in one warning.
fn kube_proxy_config(cp: &ControlPlane, name: &str) -> Result<()> {
    let kubeadm = std::env::var_os("SVC_KUBEADM").context(
        "SVC_KUBEADM is not set: `cargo xtask control-plane` builds kubeadm and prints it",
    )?;
    let printed = std::process::Command::new(&kubeadm)
        .args([
            "config",
            "print",
            "init-defaults",
            "--component-configs",
            "KubeProxyConfiguration",
        ])
        .output()?;
    ensure!(printed.status.success(), "kubeadm: {}", printed.status);
    let docs: Vec<Value> = serde_saphyr::from_multiple(&String::from_utf8(printed.stdout)?)?;
    let mut config = docs
        .into_iter()
        .find(|d| d["kind"] == "KubeProxyConfiguration")
        .context("kubeadm printed no KubeProxyConfiguration")?;
    ensure!(config["apiVersion"] == "kubeproxy.config.k8s.io/v1alpha1");

    let mut env = Env::new(cp, name)?;
    let vip = serve_web(&mut env, cp)?;

    let healthz = svc_tests::agent::free_loopback_port()?;
    let in_file_metrics = svc_tests::agent::free_loopback_port()?;
    let metrics = svc_tests::agent::free_loopback_port()?;
    config["clientConnection"]["kubeconfig"] = json!(cp.kubeconfig_path());
    config["hostnameOverride"] = json!(env.node);
    config["healthzBindAddress"] = json!(healthz.to_string());
    config["metricsBindAddress"] = json!(in_file_metrics.to_string());
    config["conntrack"]["tcpEstablishedTimeout"] = json!("2h0m0s");
    let dir = svc_tests::TempDir::new("svc-kube-proxy-config")?;
    let path = dir.path().join("config.conf");
    std::fs::write(&path, serde_saphyr::to_string(&config)?)?;

    let metrics_flag = format!("--metrics-bind-address={metrics}");
    let mut agent = svc_tests::Agent::start_kube_config(
        &env.sb.tools.agent,
        &path,
        env.sb.cgroup().path(),
        env.bpffs.path(),
        &["--service-proxy-name", name, &metrics_flag],
        healthz,
        metrics,
    )?;
    agent.wait_ready(SETTLE)?;
    env.agent = Some(agent);
    eventually(
        Instant::now(),
        SETTLE,
        "served with kubeadm's configuration",
        || tcp_backends(&env.sb, vip, 5, &["b1"]),
    )?;
    let (status, _) = http_get(healthz, "/healthz")?;
    ensure!(
        status == 200,
        "/healthz at the file's healthzBindAddress: {status}"
    );
    let (status, body) = http_get(metrics, "/metrics")?;
    ensure!(
        status == 200 && body.contains("svc_"),
        "/metrics at the flag's address"
    );
    ensure!(
        std::net::TcpStream::connect_timeout(&in_file_metrics, Duration::from_secs(1)).is_err(),
        "the file's metricsBindAddress {in_file_metrics} answers, though a flag gave another"
    );
    let log = env.agent().log();
    let warning = log
        .lines()
        .find(|l| l.contains("ignored, each for the reason given:"))
        .with_context(|| format!("no warning about the fields left out:\n{log}"))?;
    ensure!(
        warning.contains("mode ("),
        "the warning does not name mode: {warning}"
    );
    ensure!(
        !warning.contains("ipvs") && !warning.contains("logging"),
        "the warning names fields kubeadm left at their defaults: {warning}"
    );
    ensure!(
        !warning.contains("bindAddress"),
        "bindAddress applies (the primary address, the default addresses' family): {warning}"
    );
    // conntrack.tcpEstablishedTimeout: 2h in the file is what the datapath's flows get.
    let timeouts = env.agent().list()?.ct_timeouts;
    ensure!(
        timeouts.tcp_established_s == 2 * 3600,
        "conntrack.tcpEstablishedTimeout: 2h0m0s not in effect: {timeouts:?}"
    );
    Ok(())
}

/// Scenario 18: `run --dry-run` against the Kubernetes API: the Services and EndpointSlices
/// of this proxy name (and only those) listed once, their writes printed one a line, nothing
/// pinned, no agent left running.
fn dry_run_from_the_api(cp: &ControlPlane, name: &str) -> Result<()> {
    let env = Env::new(cp, name)?;
    let stored = apply(
        cp,
        &[
            env.service("web", json!({"ports": [{"name": "http", "port": 80}]})),
            env.slice(
                "web-1",
                "web",
                "IPv4",
                json!([port("http", 8080, "TCP")]),
                json!([ep(&env.v4(1)), ep(&env.v4(2))]),
            ),
        ],
    )?;
    let vip = cluster_ip(&stored)?;
    let dir = svc_tests::TempDir::new("svc-dry-run")?;
    let bpffs = dir.path().join("bpffs");
    let out = std::process::Command::new(&env.sb.tools.agent)
        .arg("run")
        .arg("--kubeconfig")
        .arg(cp.kubeconfig_path())
        .args(["--node-name", &env.node, "--service-proxy-name", name])
        .arg("--cgroup")
        .arg(env.sb.cgroup().path())
        .arg("--bpffs")
        .arg(&bpffs)
        .arg("--dry-run")
        .output()?;
    let plan = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "dry run: {}\n{plan}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let has = |start: String, end: String| {
        plan.lines()
            .any(|l| l.starts_with(&start) && l.ends_with(&end))
    };
    ensure!(has(format!("service {name}/web:"), String::new()), "{plan}");
    for i in [1, 2] {
        ensure!(
            has(
                "  put SVC_BACKENDS".into(),
                format!("-> {}:8080/TCP", env.v4(i))
            ),
            "backend {i} missing:\n{plan}"
        );
    }
    ensure!(
        has(
            format!("  put SVC_SERVICES {vip}:80/TCP -> id"),
            "slots 2 flags 0x0".into()
        ),
        "{plan}"
    );
    // Services of other proxy names (the other scenarios') are not this agent's.
    let others = plan
        .lines()
        .filter(|l| l.starts_with("service ") && !l.starts_with(&format!("service {name}/")))
        .count();
    ensure!(others == 0, "Services of other proxy names in:\n{plan}");
    ensure!(!bpffs.exists(), "the dry run made {}", bpffs.display());
    Ok(())
}

/// /metrics parsed by a parser that is not the library that wrote it (nor client-go).
fn scrape(body: &str) -> Result<prometheus_parse::Scrape> {
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .context("parsing /metrics")
}

/// The sum of the samples of `name` whose labels include `labels` (a counter's or gauge's
/// value, a histogram's count); None when there is none.
fn sum_of(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for sample in &s.samples {
        if sample.metric != name || !labels.iter().all(|(k, v)| sample.labels.get(k) == Some(*v)) {
            continue;
        }
        let v = match &sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            // Cumulative: the largest is the +Inf bucket's, the count.
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => continue,
        };
        *found.get_or_insert(0.0) += v;
    }
    found
}

/// kube-proxy's no_local_endpoints gauge as (internal, external), summed over its address
/// families (kube-proxy has a series per family, svc one for both).
fn no_local_endpoints(body: &str) -> Result<(f64, f64)> {
    let s = scrape(body)?;
    let get = |policy: &str| {
        sum_of(
            &s,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            &[("traffic_policy", policy)],
        )
        .with_context(|| format!("no traffic_policy={policy} sample"))
    };
    Ok((get("internal")?, get("external")?))
}

/// The label names of `name`'s samples, and for a histogram its bucket bounds.
fn shape(s: &prometheus_parse::Scrape, name: &str) -> (BTreeSet<String>, Vec<f64>) {
    let mut labels = BTreeSet::new();
    let mut bounds = Vec::new();
    for sample in s.samples.iter().filter(|x| x.metric == name) {
        labels.extend(sample.labels.keys().map(|k| k.to_string()));
        if let prometheus_parse::Value::Histogram(b) = &sample.value {
            bounds = b.iter().map(|b| b.less_than).collect();
        }
    }
    (labels, bounds)
}

/// Scenario 21: kube-proxy's metrics where svc measures the same thing, beside the real
/// kube-proxy (nftables mode, playing the same node, reading the same objects):
/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total` follows a Service under each Local
/// traffic policy from local endpoints to none and back, with kube-proxy's values at each
/// step; `rest_client_requests_total` and `rest_client_request_duration_seconds` count the
/// agent's lists and watches with client-go's labels and buckets, a refused request (403) and
/// one that reached no server (`<error>`) by their codes.
fn kube_proxy_metrics(cp: &ControlPlane, name: &str) -> Result<()> {
    let mut env = Env::new(cp, name)?;
    let node = env.node.clone();
    apply(
        cp,
        &[json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
            "status": {"addresses": [{"type": "InternalIP", "address": env.sb.client_v4().to_string()}]},
        })],
    )?;
    // Unlabelled, for the default selector: kube-proxy has no --service-proxy-name, and both
    // must count the same Services. One endpoint here or elsewhere, one always elsewhere (so
    // the Service has endpoints and its Local policy, not a reject, decides).
    let (v4_1, v4_2) = (env.v4(1), env.v4(2));
    let objects = |here: &str| -> Vec<Value> {
        let eps = json!([
            with(ep(&v4_1), "nodeName", here.into()),
            with(ep(&v4_2), "nodeName", "elsewhere".into()),
        ]);
        let ports = json!([port("http", 8080, "TCP")]);
        vec![
            service(
                name,
                "itp",
                None,
                json!({"internalTrafficPolicy": "Local", "ports": [{"name": "http", "port": 80}]}),
            ),
            slice(
                name,
                "itp-1",
                "itp",
                None,
                "IPv4",
                ports.clone(),
                eps.clone(),
            ),
            service(
                name,
                "etp",
                None,
                json!({"type": "NodePort", "externalTrafficPolicy": "Local",
                       "ports": [{"name": "http", "port": 80}]}),
            ),
            slice(name, "etp-1", "etp", None, "IPv4", ports, eps),
        ]
    };
    apply(cp, &objects(&node))?;
    env.start_agent_with(cp, &[])?;
    let metrics = env.agent().metrics_addr().context("no metrics address")?;
    let svc_metrics = || -> Result<String> {
        let (status, body) = http_get(metrics, "/metrics")?;
        ensure!(status == 200, "/metrics: {status}");
        Ok(body)
    };
    let bin = svc_tests::kube_proxy::binary_from_env()?;
    let mut kp = svc_tests::kube_proxy::KubeProxy::start(
        svc_tests::kube_proxy::KubeProxyConfig::new(
            &bin,
            svc_tests::kube_proxy::Mode::Nftables,
            &node,
        ),
        cp,
        env.sb.client_ns(),
    )?;
    kp.wait_ready(svc_tests::kube_proxy::READY_TIMEOUT)?;

    for (step, here, want) in [
        ("local endpoints", node.as_str(), (0.0, 0.0)),
        ("no local endpoint", "elsewhere", (1.0, 1.0)),
        ("local endpoints again", node.as_str(), (0.0, 0.0)),
    ] {
        let t = write(cp, &objects(here))?;
        eventually(t, SETTLE, &format!("{step}: svc and kube-proxy"), || {
            let svc = no_local_endpoints(&svc_metrics()?).context("svc")?;
            let kube_proxy = no_local_endpoints(&kp.metrics()?).context("kube-proxy")?;
            ensure!(
                svc == want && kube_proxy == want,
                "(internal, external): svc {svc:?}, kube-proxy {kube_proxy:?}, want {want:?}"
            );
            Ok(())
        })?;
    }

    // The agent's lists and watches, by code and method, on the API server's host:port; the
    // lists timed (the watches are not, as client-go's).
    let host = cp.server_url().trim_start_matches("https://").to_string();
    let s = scrape(&svc_metrics()?)?;
    let ok = [("code", "200"), ("method", "GET"), ("host", host.as_str())];
    let gets = sum_of(&s, "rest_client_requests_total", &ok);
    ensure!(
        gets.is_some_and(|n| n >= 3.0),
        "GET 200 on {host}: {gets:?}"
    );
    let timed = sum_of(
        &s,
        "rest_client_request_duration_seconds",
        &[("verb", "GET"), ("host", host.as_str())],
    );
    ensure!(timed.is_some_and(|n| n >= 1.0), "GETs timed: {timed:?}");
    let body = svc_metrics()?;
    for name in common::API_CLIENT_METRICS {
        ensure!(
            body.lines().any(|l| l.starts_with(&format!("{name}{{"))),
            "no samples of {name}, which deploy/'s dashboard reads"
        );
    }
    // As kube-proxy (client-go) has them: the same label names. The buckets are
    // component-base v0.37.2's (as a program of that module alone exports them); the real
    // kube-proxy v1.37.2 was found to show every one of them but 8 s (docs/design/metrics.md).
    let kp_body = kp.metrics()?;
    let kp_scrape = scrape(&kp_body)?;
    let raw = |name: &str| {
        kp_body
            .lines()
            .filter(|l| l.starts_with(name))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for name in [
        "rest_client_requests_total",
        "rest_client_request_duration_seconds",
    ] {
        let ((ours, our_bounds), (theirs, their_bounds)) =
            (shape(&s, name), shape(&kp_scrape, name));
        ensure!(
            ours == theirs && their_bounds.iter().all(|b| our_bounds.contains(b)),
            "{name}: svc's labels and buckets {ours:?} {our_bounds:?}, kube-proxy's {theirs:?} \
             {their_bounds:?}:\n{}",
            raw(name)
        );
    }
    let (_, bounds) = shape(&s, "rest_client_request_duration_seconds");
    ensure!(
        bounds
            == [
                0.005,
                0.025,
                0.1,
                0.25,
                0.5,
                1.0,
                2.0,
                4.0,
                8.0,
                15.0,
                30.0,
                60.0,
                f64::INFINITY
            ],
        "svc's rest_client_request_duration_seconds buckets: {bounds:?}"
    );
    drop(kp);
    let status = env.agent().terminate(Duration::from_secs(20))?;
    ensure!(status.success(), "agent exit: {status}");

    // Refused: a ServiceAccount without any role may list nothing.
    apply(
        cp,
        &[json!({"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "nobody", "namespace": name}})],
    )?;
    let nobody = cp.service_account_kubeconfig(name, "nobody")?;
    // No server: nothing listens on port 1 of the loopback.
    let dir = svc_tests::TempDir::new("svc-kubeconfig")?;
    let nowhere = dir.path().join("kubeconfig");
    std::fs::write(
        &nowhere,
        std::fs::read_to_string(cp.kubeconfig_path())?
            .replace(&cp.server_url(), "https://127.0.0.1:1"),
    )?;
    for (kubeconfig, host, code) in [
        (&nobody, host.as_str(), "403"),
        (&nowhere, "127.0.0.1:1", "<error>"),
    ] {
        // On the first agent's pins, as a restart with other credentials.
        let mut agent = svc_tests::Agent::start_kube(
            &env.sb.tools.agent,
            kubeconfig,
            &node,
            env.sb.cgroup().path(),
            env.bpffs.path(),
            &[],
        )?;
        let metrics = agent.metrics_addr().context("no metrics address")?;
        let want = [("code", code), ("method", "GET"), ("host", host)];
        let counted = eventually(
            Instant::now(),
            SETTLE,
            &format!("GET {code} counted"),
            || {
                let (_, body) = http_get(metrics, "/metrics")?;
                let n = sum_of(&scrape(&body)?, "rest_client_requests_total", &want);
                ensure!(n.is_some_and(|n| n >= 1.0), "{want:?}: {n:?}");
                Ok(())
            },
        );
        agent.kill()?;
        counted.with_context(|| agent.log())?;
    }
    Ok(())
}

/// `--maglev-seed` left at its built-in default is warned about only on a cluster of more
/// than one Node (each node's seed must agree with the others'): nothing on a cluster of one,
/// the warning on one of two. Exclusive: it needs the cluster's Nodes (other scenarios'
/// objects; there is no kubelet) to be its own.
fn default_seed_warning(cp: &mut ControlPlane, name: &str) -> Result<()> {
    const WARNING: &str = "--maglev-seed is left at its built-in default";
    const ONE_NODE: &str = "one Node in the cluster";
    let mut env = Env::new(cp, name)?;
    cp.kubectl(&["delete", "nodes", "--all", "--wait=true"])?;
    let node = |n: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}});
    apply(cp, &[node(&env.node)])?;
    env.start_agent(cp)?;
    eventually(Instant::now(), SETTLE, "the Nodes counted", || {
        let log = env.agent.as_ref().expect("started").log();
        ensure!(log.contains(ONE_NODE), "{log}");
        Ok(())
    })?;
    let log = env.agent().log();
    ensure!(
        !log.contains(WARNING),
        "warned on a one-node cluster:\n{log}"
    );

    let other = format!("{name}-other-node");
    apply(cp, &[node(&other)])?;
    env.agent().terminate(Duration::from_secs(30))?;
    env.agent().restart()?;
    let warned = eventually(Instant::now(), SETTLE, "the default-seed warning", || {
        let log = env.agent.as_ref().expect("started").log();
        ensure!(log.contains(WARNING), "{log}");
        Ok(())
    });
    cp.kubectl(&["delete", "node", &other, &env.node, "--wait=true"])?;
    warned?;
    ensure!(!env.agent().log().contains(ONE_NODE));
    Ok(())
}
