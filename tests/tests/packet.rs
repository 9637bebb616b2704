//! The packet datapath (tc) as a user outside the cluster sees it, on the topology of
//! network namespaces `svc_tests::topology` makes (an external client and a second one, node
//! 1 whose uplink `eth0` carries the programs, node 2, a pod on each).
//!
//! The agent runs inside node 1's namespace (nsenter) with `--devices eth0`, so it only ever
//! sees and attaches to that namespace's devices; no traffic leaves the namespaces. Clients and
//! backends are threads of this process that entered a namespace (setns), and they sit outside
//! the agent's cgroup, so the socket hooks never see them: what they get is the tc programs'
//! work. Each backend answers with its name and the client address it saw.

mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{BufRead, BufReader, Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use common::poll;
use serde_json::{json, Value};
use svc_common::node_addr_flags;
use svc_tests::{
    netns::veth_pair,
    pins, require_root,
    sandbox::AGENT_READY_TIMEOUT,
    topology::{
        Nodes, CLIENT, CLIENT2, CLIENT6, NODE1, NODE1_6, NODE2, POD1, POD1_6, POD2, POD2_6,
    },
    Agent, Bpffs, Manifests, NetNs, TestCgroup, Tools,
};

const EXTERNAL_IP: &str = "10.77.100.10";
const LB_IP: &str = "10.77.100.20";
const ETP_LB_IP: &str = "10.77.100.30";
const EXTERNAL_IP6: &str = "fd77:100::10";
const LB_IP6: &str = "fd77:100::20";

/// How long a client waits for an answer that should come (a 2-core machine shared with
/// other tests), and how long it waits to conclude that a dropped packet got none.
const ANSWER: Duration = Duration::from_secs(3);
const SILENCE: Duration = Duration::from_millis(1500);

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address literal")
}

fn sa(addr: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip(addr), port)
}

// ---------------------------------------------------------------------------------------
// Threads in a namespace.

/// Moves the calling thread into network namespace `path` (only this thread: a network
/// namespace is per task).
fn enter(path: &std::path::Path) -> std::io::Result<()> {
    let f = File::open(path)?;
    // SAFETY: a valid fd of a namespace file; affects only the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Starts `f` in a new thread inside `ns`.
fn spawn_in<T: Send + 'static>(
    ns: &NetNs,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    let path = ns.path();
    std::thread::spawn(move || {
        enter(&path).unwrap_or_else(|e| panic!("entering {}: {e}", path.display()));
        f()
    })
}

/// Runs `f` in a thread inside `ns` and returns what it returned.
fn in_ns<T: Send + 'static>(ns: &NetNs, f: impl FnOnce() -> T + Send + 'static) -> T {
    spawn_in(ns, f)
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

// ---------------------------------------------------------------------------------------
// Backends: TCP and UDP echo servers that answer `NAME SEEN-CLIENT-ADDRESS`.

struct Echo {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Echo {
    /// Serves TCP `tcp_port` and UDP `udp_port` on each of `addrs` inside `ns`, as `name`.
    fn start(ns: &NetNs, name: &str, addrs: &[&str], tcp_port: u16, udp_port: u16) -> Echo {
        let stop = Arc::new(AtomicBool::new(false));
        let addrs: Vec<IpAddr> = addrs.iter().map(|a| ip(a)).collect();
        let (name, stop2) = (name.to_string(), stop.clone());
        let sockets = in_ns(ns, move || {
            let mut out = Vec::new();
            for a in addrs {
                let t = TcpListener::bind(SocketAddr::new(a, tcp_port))
                    .unwrap_or_else(|e| panic!("binding {a}:{tcp_port}: {e}"));
                t.set_nonblocking(true).unwrap();
                let u = UdpSocket::bind(SocketAddr::new(a, udp_port))
                    .unwrap_or_else(|e| panic!("binding {a}:{udp_port}: {e}"));
                u.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                out.push((t, u));
            }
            out
        });
        let mut threads = Vec::new();
        for (t, u) in sockets {
            let (n, s) = (name.clone(), stop2.clone());
            threads.push(std::thread::spawn(move || serve_tcp(t, &n, &s)));
            let (n, s) = (name.clone(), stop2.clone());
            threads.push(std::thread::spawn(move || serve_udp(u, &n, &s)));
        }
        Echo { stop, threads }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_tcp(l: TcpListener, name: &str, stop: &Arc<AtomicBool>) {
    let mut conns = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((c, peer)) => {
                let (name, stop) = (name.to_string(), stop.clone());
                conns.push(std::thread::spawn(move || {
                    let _ = c.set_nonblocking(false);
                    let _ = c.set_read_timeout(Some(Duration::from_millis(100)));
                    let mut r = BufReader::new(&c);
                    let mut line = String::new();
                    while !stop.load(Ordering::Relaxed) {
                        match r.read_line(&mut line) {
                            Ok(0) => break,
                            Ok(_) => {
                                let reply = format!("{name} {}\n", peer.ip());
                                if (&c).write_all(reply.as_bytes()).is_err() {
                                    break;
                                }
                                line.clear();
                            }
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            Err(_) => break,
                        }
                    }
                }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    for c in conns {
        let _ = c.join();
    }
}

/// Answers a datagram with `NAME SEEN-CLIENT-ADDRESS`, padded with spaces to the request's
/// length when that is longer: a request above the MTU gets a reply above it.
fn serve_udp(s: UdpSocket, name: &str, stop: &Arc<AtomicBool>) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((n, from)) = s.recv_from(&mut buf) {
            let mut answer = format!("{name} {}", from.ip()).into_bytes();
            if answer.len() < n {
                answer.resize(n, b' ');
            }
            let _ = s.send_to(&answer, from);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Clients.

/// What a client got from a backend: who answered, and the client address the backend saw.
#[derive(Debug, PartialEq, Eq)]
struct Answer {
    backend: String,
    saw: IpAddr,
}

fn parse_answer(text: &str) -> std::io::Result<Answer> {
    let (backend, saw) = text
        .trim()
        .split_once(' ')
        .ok_or_else(|| std::io::Error::other(format!("odd answer {text:?}")))?;
    Ok(Answer {
        backend: backend.to_string(),
        saw: saw
            .parse()
            .map_err(|_| std::io::Error::other(format!("odd answer {text:?}")))?,
    })
}

/// One TCP connection to `to` and one exchange; the connection's peer must be `to` itself.
fn tcp_once(to: SocketAddr, timeout: Duration) -> std::io::Result<Answer> {
    let c = TcpStream::connect_timeout(&to, timeout)?;
    let peer = c.peer_addr()?;
    if peer != to {
        return Err(std::io::Error::other(format!("peer {peer}, not {to}")));
    }
    c.set_read_timeout(Some(timeout))?;
    (&c).write_all(b"x\n")?;
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line)?;
    let _ = c.shutdown(Shutdown::Both);
    parse_answer(&line)
}

/// One UDP exchange with `to` from an unconnected socket; the reply must come from `to`.
fn udp_once(to: SocketAddr, timeout: Duration) -> std::io::Result<Answer> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let s = UdpSocket::bind(any)?;
    s.set_read_timeout(Some(timeout))?;
    s.send_to(b"x", to)?;
    let mut buf = [0u8; 512];
    let (n, from) = s.recv_from(&mut buf)?;
    if from != to {
        return Err(std::io::Error::other(format!(
            "reply from {from}, not {to}"
        )));
    }
    parse_answer(&String::from_utf8_lossy(&buf[..n]))
}

/// A connected UDP socket's exchange: an ICMP port unreachable shows as ECONNREFUSED.
fn udp_connected_once(to: SocketAddr, timeout: Duration) -> std::io::Result<Answer> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let s = UdpSocket::bind(any)?;
    s.connect(to)?;
    s.set_read_timeout(Some(timeout))?;
    s.send(b"x")?;
    let mut buf = [0u8; 512];
    let n = s.recv(&mut buf)?;
    parse_answer(&String::from_utf8_lossy(&buf[..n]))
}

/// `GET /` over HTTP/1.1: status and body.
fn http_get(to: SocketAddr) -> std::io::Result<(u16, String)> {
    http_get_path(to, "/")
}

fn http_get_path(to: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut c = TcpStream::connect_timeout(&to, ANSWER)?;
    c.set_read_timeout(Some(ANSWER))?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    c.read_to_string(&mut text)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no end of headers: {text:?}")))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status: {head:?}")))?;
    Ok((status, body.to_string()))
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

/// How many programs are attached to `dev` of `ns` through tcx, ingress and egress
/// (BPF_PROG_QUERY; the Debian bpftool here predates tcx and does not list them).
fn tcx_programs(ns: &NetNs, dev: &str) -> (u32, u32) {
    let dev = std::ffi::CString::new(dev).expect("device name");
    in_ns(ns, move || {
        // SAFETY: a valid NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(dev.as_ptr()) };
        assert_ne!(ifindex, 0, "no device {dev:?}");
        let query = |attach_type: u32| {
            // union bpf_attr, query: target_ifindex, attach_type, query_flags, attach_flags,
            // prog_ids (u64, null: count only), prog_cnt (u32, at 24).
            let mut attr = [0u8; 128];
            attr[0..4].copy_from_slice(&ifindex.to_ne_bytes());
            attr[4..8].copy_from_slice(&attach_type.to_ne_bytes());
            const BPF_PROG_QUERY: libc::c_long = 16;
            // SAFETY: attr is a zeroed bpf_attr of the size given.
            let r = unsafe {
                libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, attr.as_mut_ptr(), attr.len())
            };
            assert_eq!(r, 0, "BPF_PROG_QUERY: {}", std::io::Error::last_os_error());
            u32::from_ne_bytes(attr[24..28].try_into().unwrap())
        };
        const BPF_TCX_INGRESS: u32 = 46;
        const BPF_TCX_EGRESS: u32 = 47;
        (query(BPF_TCX_INGRESS), query(BPF_TCX_EGRESS))
    })
}

/// svc's classic filters on `dev` of `ns` as `tc filter show dev DEV ingress|egress` lists
/// them: the lines naming one of svc's tc programs, (ingress, egress).
fn classic_filters_of(ns: &NetNs, dev: &str) -> (Vec<String>, Vec<String>) {
    let show = |hook: &str| -> Vec<String> {
        run_in(ns, &["tc", "filter", "show", "dev", dev, hook])
            .lines()
            .filter(|l| l.contains("tc_ext_") || l.contains("tc_pod_"))
            .map(str::to_string)
            .collect()
    };
    (show("ingress"), show("egress"))
}

/// How many of svc's tc programs run on `dev` of `ns`, ingress and egress, however they are
/// attached (tcx links, or classic filters: the packet tests' second pass forces those,
/// `SVC_TEST_TC_ATTACH=classic`).
fn svc_programs(ns: &NetNs, dev: &str) -> (u32, u32) {
    let (tcx_in, tcx_out) = tcx_programs(ns, dev);
    let (ingress, egress) = classic_filters_of(ns, dev);
    (tcx_in + ingress.len() as u32, tcx_out + egress.len() as u32)
}

/// Whether this run's agents attach the tc programs the classic way when the test names no
/// mode (the second pass), rather than through tcx (this kernel's `auto`).
fn classic_by_default() -> bool {
    svc_tests::agent::forced_tc_attach().as_deref() == Some("classic")
}

// ---------------------------------------------------------------------------------------
// The topology.

/// Fields drop in declaration order: the agent stops first, then its pins go (uninstall),
/// then the backends, and the namespaces and the cgroup last.
struct Topo {
    agent: Option<Agent>,
    /// `NAME=VALUE` settings of the agent's environment (fault injection).
    agent_env: Vec<String>,
    /// A command the agent runs under, before it enters node 1 (`prlimit --nofile=...`,
    /// which execs it).
    agent_wrapper: Vec<String>,
    bpffs: Bpffs,
    _echo: Vec<Echo>,
    m: Manifests,
    tools: Tools,
    client: NetNs,
    client2: NetNs,
    node1: NetNs,
    node2: NetNs,
    pod1: NetNs,
    _pod2: NetNs,
    _lan: NetNs,
    cgroup: TestCgroup,
}

impl Topo {
    /// `svc-agent list` on node 1's pins, with `extra` flags: its output.
    fn list(&self, extra: &[&str]) -> String {
        let agent = self.tools.agent.display().to_string();
        let bpffs = self.bpffs.path().display().to_string();
        let mut args = vec![agent.as_str(), "list", "--bpffs", bpffs.as_str()];
        args.extend_from_slice(extra);
        run_in(&self.node1, &args)
    }

    fn new() -> Topo {
        require_root();
        let tools = Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe"));
        let cgroup = TestCgroup::new().expect("cgroup");
        let Nodes {
            lan,
            client,
            client2,
            node1,
            node2,
            pod1,
            pod2,
        } = Nodes::new().expect("building the topology");
        let echo = vec![
            Echo::start(&pod1, "pod1", &[POD1, POD1_6], 8080, 5353),
            Echo::start(&pod2, "pod2", &[POD2, POD2_6], 8080, 5353),
        ];
        let m = Manifests::new().expect("manifests");
        let bpffs = Bpffs::new(&tools.agent, cgroup.path()).expect("bpffs");
        Topo {
            agent: None,
            agent_env: Vec::new(),
            agent_wrapper: Vec::new(),
            bpffs,
            _echo: echo,
            m,
            tools,
            client,
            client2,
            node1,
            node2,
            pod1,
            _pod2: pod2,
            _lan: lan,
            cgroup,
        }
    }

    /// Starts the agent inside node 1 on its uplink, and waits until it is ready.
    fn start_agent(&mut self) {
        self.start_agent_with(&[]);
    }

    /// `start_agent` with more flags.
    fn start_agent_with(&mut self, extra: &[&str]) {
        let source = ["--manifests".into(), self.m.dir().into()];
        self.start_agent_from(source, extra);
    }

    /// Starts the agent with `source` (`--manifests DIR` or `--kubeconfig FILE`) and `extra`.
    fn start_agent_from(&mut self, source: [std::ffi::OsString; 2], extra: &[&str]) {
        self.launch_agent_from(source, extra);
        self.agent()
            .wait_ready(AGENT_READY_TIMEOUT)
            .expect("agent ready");
    }

    /// `start_agent_from`, not waiting for the agent to be ready.
    fn launch_agent_from(&mut self, source: [std::ffi::OsString; 2], extra: &[&str]) {
        let [flag, value] = source;
        let args: Vec<std::ffi::OsString> = [
            "run".into(),
            flag,
            value,
            "--cgroup".into(),
            self.cgroup.path().into(),
            "--bpffs".into(),
            self.bpffs.path().into(),
            "--node-name".into(),
            "node-1".into(),
            // Always named: a test never lets the agent choose devices.
            "--devices".into(),
            "eth0".into(),
        ]
        .into_iter()
        .chain(extra.iter().map(Into::into))
        .collect();
        let launcher: Vec<std::ffi::OsString> = (!self.agent_env.is_empty())
            .then(|| "env".to_string())
            .into_iter()
            .chain(self.agent_env.iter().cloned())
            .chain(self.agent_wrapper.iter().cloned())
            .chain([
                "nsenter".into(),
                format!("--net={}", self.node1.path().display()),
            ])
            .map(Into::into)
            .collect();
        let agent = Agent::start_launched(
            &launcher,
            &self.tools.agent,
            args,
            self.bpffs.path(),
            self.m.scratch(),
        )
        .expect("starting the agent");
        self.agent = Some(agent);
    }

    /// `start_agent_with`, not waiting for the agent to be ready.
    fn launch_agent(&mut self, extra: &[&str]) {
        let source = ["--manifests".into(), self.m.dir().into()];
        self.launch_agent_from(source, extra);
    }

    fn agent(&mut self) -> &mut Agent {
        self.agent.as_mut().expect("agent started")
    }

    /// How many of svc's programs run on node 1's eth0 (ingress, egress), tcx or classic.
    fn node1_eth0_programs(&self) -> (u32, u32) {
        svc_programs(&self.node1, "eth0")
    }

    fn service(&self, name: &str, value: Value) {
        self.m
            .write_value(&format!("svc-demo-{name}.yaml"), &value)
            .expect("writing a Service");
    }

    /// EndpointSlices (one per family) of `service`: TCP 8080 and UDP 5353 on the given pods.
    fn endpoints(&self, service: &str, pods: &[(&str, &str, &str)]) {
        let ready: Vec<_> = pods.iter().map(|p| (*p, READY)).collect();
        self.endpoints_as(service, &ready);
    }

    /// `endpoints`, each pod with its own conditions.
    fn endpoints_as(&self, service: &str, pods: &[((&str, &str, &str), Conditions)]) {
        for (family, v6) in [("IPv4", false), ("IPv6", true)] {
            let endpoints: Vec<Value> = pods
                .iter()
                .map(|((v4a, v6a, node), (ready, serving, terminating))| {
                    json!({
                        "addresses": [if v6 { v6a } else { v4a }],
                        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                        "nodeName": node,
                    })
                })
                .collect();
            let name = format!("{service}-{}", family.to_lowercase());
            let slice = json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": "demo",
                    "labels": {"kubernetes.io/service-name": service},
                },
                "addressType": family,
                "ports": [
                    {"name": "http", "port": 8080, "protocol": "TCP"},
                    {"name": "dns", "port": 5353, "protocol": "UDP"},
                ],
                "endpoints": endpoints,
            });
            self.m
                .write_value(&format!("eps-demo-{name}.yaml"), &slice)
                .expect("writing an EndpointSlice");
        }
    }
}

/// An endpoint's (ready, serving, terminating).
type Conditions = (bool, bool, bool);
const READY: Conditions = (true, true, false);
const TERMINATING_SERVING: Conditions = (false, true, true);
const TERMINATING: Conditions = (false, false, true);
const LOCAL_POD: (&str, &str, &str) = (POD1, POD1_6, "node-1");
const REMOTE_POD: (&str, &str, &str) = (POD2, POD2_6, "node-2");

/// A dual-stack Service of `kind` with ports http 80/TCP -> 8080 and dns 53/UDP -> 5353, both
/// on NodePort `node_port`; `extra` is merged into its spec, `status` is its status.
fn service(name: &str, kind: &str, vip: u8, node_port: u16, extra: Value, status: Value) -> Value {
    let mut spec = json!({
        "type": kind,
        "clusterIP": format!("10.96.0.{vip}"),
        "clusterIPs": [format!("10.96.0.{vip}"), format!("fd00:96::{vip}")],
        "ipFamilies": ["IPv4", "IPv6"],
        "ipFamilyPolicy": "RequireDualStack",
        "selector": {"app": name},
        "ports": [
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
        ],
    });
    if node_port != 0 {
        for p in spec["ports"].as_array_mut().unwrap() {
            p["nodePort"] = node_port.into();
        }
    }
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            spec.insert(k.clone(), v.clone());
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": spec,
        "status": status,
    })
}

fn nodeport(name: &str, vip: u8, node_port: u16) -> Value {
    service(name, "NodePort", vip, node_port, json!({}), json!({}))
}

/// Asks `f` in the client's namespace until it answers (the agent writes its maps after it
/// says ready in the same sync, but a first ARP/ND exchange may be slow), then once more,
/// returning that answer.
fn answered(
    ns: &NetNs,
    what: &str,
    f: impl Fn() -> std::io::Result<Answer> + Send + Sync + Clone + 'static,
) -> Answer {
    let f2 = f.clone();
    let what2 = what.to_string();
    in_ns(ns, move || {
        poll(Duration::from_secs(10), || Ok(Some(f2()?)))
            .unwrap_or_else(|e| panic!("{what2}: {e:#}"))
    });
    in_ns(ns, f).unwrap_or_else(|e| panic!("{what}: {e}"))
}

// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// The dashboard and alert rules in deploy/ read what the agent exports.

/// The metric names a PromQL expression reads: every identifier outside strings, label
/// matchers (`{...}`), ranges (`[...]`) and label lists (`by (...)`, `on (...)`, ...) that is
/// no keyword, aggregation or function (called: followed by `(`). Not a full parser: enough
/// for expressions that name metrics plainly (no `{__name__=...}`).
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    const LABEL_LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const WORDS: &[&str] = &[
        "bool",
        "offset",
        "and",
        "or",
        "unless",
        "atan2",
        "inf",
        "nan",
        "sum",
        "avg",
        "min",
        "max",
        "count",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "group",
        "limitk",
        "limit_ratio",
    ];
    let c: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let (mut braces, mut brackets) = (0u32, 0u32);
    let (mut list_next, mut in_list) = (false, false);
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        i += 1;
        match ch {
            '"' | '\'' | '`' => {
                while i < c.len() && c[i] != ch {
                    i += if c[i] == '\\' && ch != '`' { 2 } else { 1 };
                }
                i += 1;
            }
            '#' => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            '[' => brackets += 1,
            ']' => brackets = brackets.saturating_sub(1),
            '(' if list_next => (list_next, in_list) = (false, true),
            ')' if in_list => in_list = false,
            '0'..='9' | '.' => {
                while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '.') {
                    i += 1;
                }
            }
            ch if ch.is_ascii_alphabetic() || ch == '_' || ch == ':' => {
                let start = i - 1;
                while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_' || c[i] == ':') {
                    i += 1;
                }
                let word: String = c[start..i].iter().collect();
                let next = c[i..].iter().find(|c| !c.is_whitespace());
                if braces > 0 || brackets > 0 || in_list {
                    continue;
                }
                if LABEL_LISTS.contains(&word.as_str()) {
                    list_next = true;
                } else if !WORDS.contains(&word.as_str()) && next != Some(&'(') {
                    out.insert(word);
                }
            }
            _ => {}
        }
    }
    out
}

/// Every PromQL expression of deploy/'s dashboard and alert rules, with where it is; checks
/// the rule file's shape on the way (groups of named rules, each an alert with an expression,
/// a duration, a severity and a summary).
fn deploy_exprs() -> Vec<(String, String)> {
    let deploy = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut out = Vec::new();
    let dashboard = deploy.join("grafana/svc-dashboard.json");
    let d: Value = serde_json::from_str(&std::fs::read_to_string(&dashboard).expect("dashboard"))
        .expect("the dashboard is JSON");
    let panels = d["panels"].as_array().expect("dashboard panels");
    assert!(!panels.is_empty(), "{dashboard:?} has no panels");
    for p in panels {
        let title = p["title"].as_str().expect("a panel's title");
        let targets = p["targets"].as_array().expect("a panel's targets");
        assert!(!targets.is_empty(), "panel {title} has no targets");
        for t in targets {
            let expr = t["expr"].as_str().expect("a target's expr");
            out.push((format!("dashboard panel {title:?}"), expr.to_string()));
        }
    }
    let rules = deploy.join("prometheus/svc-alerts.yaml");
    let r: Value = serde_saphyr::from_str(&std::fs::read_to_string(&rules).expect("alert rules"))
        .expect("the alert rules are YAML");
    let groups = r["groups"].as_array().expect("`groups:` of the rule file");
    assert!(!groups.is_empty(), "{rules:?} has no groups");
    let mut alerts = BTreeSet::new();
    for g in groups {
        let name = g["name"].as_str().expect("a group's name");
        let rules = g["rules"]
            .as_array()
            .unwrap_or_else(|| panic!("rules of group {name}"));
        assert!(!rules.is_empty(), "group {name} has no rules");
        for rule in rules {
            let alert = rule["alert"]
                .as_str()
                .unwrap_or_else(|| panic!("an alert in {name}: {rule}"));
            assert!(alerts.insert(alert.to_string()), "alert {alert} twice");
            let expr = rule["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("expr of {alert}"));
            let r#for = rule["for"]
                .as_str()
                .unwrap_or_else(|| panic!("`for` of {alert}"));
            assert!(
                r#for.len() > 1
                    && r#for.ends_with(['s', 'm', 'h'])
                    && r#for[..r#for.len() - 1].parse::<u32>().is_ok(),
                "`for: {for}` of {alert}"
            );
            let severity = rule["labels"]["severity"].as_str();
            assert!(
                matches!(severity, Some("warning" | "critical")),
                "severity of {alert}: {severity:?}"
            );
            assert!(
                rule["annotations"]["summary"].is_string(),
                "summary of {alert}"
            );
            assert!(
                rule["annotations"]["description"].is_string(),
                "description of {alert}"
            );
            out.push((format!("alert {alert}"), expr.to_string()));
        }
    }
    for want in [
        "SvcSyncErrors",
        "SvcMapNearlyFull",
        "SvcConntrackNearlyFull",
        "SvcSnatPortsNearExhaustion",
        "SvcNetworkProgrammingSlow",
        "SvcRefusalsRising",
    ] {
        assert!(alerts.contains(want), "no alert {want} in {rules:?}");
    }
    out
}

/// The names /metrics shows samples of (a histogram's `_bucket`, `_sum`, `_count`).
fn sampled(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

#[test]
fn promql_metric_names_are_told_from_functions_labels_and_strings() {
    let got = promql_metrics(
        r#"histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{x="b_c",y=~"$i"}[5m])))
           / on (instance) group_left (map) b:c offset 1h > 0.9 and time() - c_total or vector(1)"#,
    );
    let want: BTreeSet<String> = ["a_bucket", "b:c", "c_total"].map(String::from).into();
    assert_eq!(got, want);
    assert!(
        sampled("# TYPE h histogram\nh_bucket{le=\"1\"} 0\nh_sum 0\ng 1\n")
            .iter()
            .eq(["g", "h_bucket", "h_sum"])
    );
}

/// Every metric deploy/'s Grafana dashboard and Prometheus alert rules read is one a running
/// agent exports, with samples: an agent of the packet datapath that has synced a Service,
/// answered a connection, refused one to a Service without endpoints, and skipped a manifest it
/// cannot read (so its labelled families, listed from their first sample on, are shown).
#[test]
fn deploy_dashboard_and_alerts_use_exported_metrics() {
    let exprs = deploy_exprs();
    let mut t = Topo::new();
    t.service("web", nodeport("web", 11, 30081));
    t.endpoints("web", &[LOCAL_POD]);
    t.service("empty", nodeport("empty", 13, 30083));
    t.endpoints("empty", &[]);
    t.m.write_raw("broken.yaml", "kind: [unterminated\n")
        .expect("writing a broken manifest");
    t.start_agent_with(&["--metrics-bind-address", "127.0.0.1:10249"]);
    let to = sa(NODE1, 30081);
    answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    let refused = sa(NODE1, 30083);
    let got = in_ns(&t.client, move || {
        tcp_once(refused, ANSWER).map(|_| ()).map_err(|e| e.kind())
    });
    assert_eq!(
        got,
        Err(std::io::ErrorKind::ConnectionRefused),
        "TCP {refused}"
    );
    let (status, text) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/metrics").expect("GET /metrics")
    });
    assert_eq!(status, 200);
    let exported = sampled(&text);
    let mut used = BTreeSet::new();
    let mut missing = Vec::new();
    for (what, expr) in &exprs {
        let names = promql_metrics(expr);
        assert!(!names.is_empty(), "{what} reads no metric: {expr}");
        for name in names {
            if !exported.contains(&name) && !common::API_CLIENT_METRICS.contains(&name.as_str()) {
                missing.push(format!("{name} ({what})"));
            }
            used.insert(name);
        }
    }
    // Left out above for what they are, not for being missing.
    for name in common::API_CLIENT_METRICS {
        assert!(used.contains(*name), "deploy/ no longer reads {name}");
    }
    assert!(
        missing.is_empty(),
        "not exported: {missing:#?}\n/metrics:\n{text}"
    );
    // Per Service port, counted by the tc programs: web's new flow and empty's refusal, each
    // under its own labels only.
    let per_service = |svc: &str, reason: &str| -> Option<u64> {
        let prefix = format!(
            "svc_service_decisions_total{{namespace=\"demo\",service=\"{svc}\",port=\"http\",reason=\"{reason}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse().ok())
    };
    assert!(per_service("web", "new").is_some_and(|n| n >= 1), "{text}");
    assert!(
        per_service("empty", "reject_no_backend").is_some_and(|n| n >= 1),
        "{text}"
    );
    assert_eq!(per_service("web", "reject_no_backend"), None, "{text}");
    assert_eq!(per_service("empty", "new"), None, "{text}");
    // kube-proxy's names among them, so its dashboards' queries are the ones shown.
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    ] {
        assert!(used.contains(name), "deploy/ does not read {name}");
    }
}

/// NodePort over TCP and UDP, IPv4 and IPv6: a backend on node 1 sees the client's own
/// address; a backend on node 2 sees node 1's address (SNAT), and the reply still comes back
/// from the address the client used. A NodePort without endpoints refuses at once (TCP RST,
/// ICMP port unreachable), never a timeout. The programs sit on node 1's eth0 and nowhere
/// else.
#[test]
fn nodeport_from_outside() {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.service("empty", nodeport("empty", 13, 30083));
    t.endpoints("empty", &[]);
    // /metrics on node 1's own loopback.
    t.start_agent_with(&["--metrics-bind-address", "127.0.0.1:10249"]);

    // One program each way on node 1's uplink, none anywhere else.
    assert_eq!(t.node1_eth0_programs(), (1, 1));
    assert_eq!(svc_programs(&t.node1, "podh"), (0, 0));
    assert_eq!(svc_programs(&t.client, "eth0"), (0, 0));
    // What `tc filter show dev eth0 ingress` shows a user on node 1: svc's direct-action
    // filter when attached the classic way, nothing of svc's with tcx (tc lists no tcx link).
    let show = run_in(
        &t.node1,
        &["tc", "filter", "show", "dev", "eth0", "ingress"],
    );
    let ours: Vec<&str> = show.lines().filter(|l| l.contains("tc_ext_")).collect();
    if classic_by_default() {
        assert!(
            ours.len() == 1
                && ours[0].contains("tc_ext_ingress")
                && ours[0].contains("direct-action")
                && ours[0].contains("handle 0x5356"),
            "tc filter show dev eth0 ingress:\n{show}"
        );
    } else {
        assert!(ours.is_empty(), "tc filter show dev eth0 ingress:\n{show}");
    }

    let cases = [
        (NODE1, CLIENT, "pod1", CLIENT),
        (NODE1, CLIENT, "pod2", NODE1),
        (NODE1_6, CLIENT6, "pod1", CLIENT6),
        (NODE1_6, CLIENT6, "pod2", NODE1_6),
    ];
    for (node, client, backend, seen) in cases {
        let port = if backend == "pod1" { 30081 } else { 30082 };
        let to = sa(node, port);
        let want = Answer {
            backend: backend.into(),
            saw: ip(seen),
        };
        let got = answered(&t.client, &format!("TCP to {to}"), move || {
            tcp_once(to, ANSWER)
        });
        assert_eq!(got, want, "TCP {client} -> {to}");
        let got = answered(&t.client, &format!("UDP to {to}"), move || {
            udp_once(to, ANSWER)
        });
        assert_eq!(got, want, "UDP {client} -> {to}");
    }

    // Many connections in a row, to both: every one answered.
    let failures = in_ns(&t.client, || {
        let mut failures = Vec::new();
        for i in 0..40u32 {
            let to = sa(NODE1, if i.is_multiple_of(2) { 30081 } else { 30082 });
            if let Err(e) = tcp_once(to, ANSWER) {
                failures.push(format!("{to}: {e}"));
            }
            if let Err(e) = udp_once(to, ANSWER) {
                failures.push(format!("udp {to}: {e}"));
            }
        }
        failures
    });
    assert!(failures.is_empty(), "{failures:?}");

    // No endpoints: refused at once.
    for node in [NODE1, NODE1_6] {
        let to = sa(node, 30083);
        let (tcp, udp) = in_ns(&t.client, move || {
            let start = Instant::now();
            let tcp = tcp_once(to, ANSWER).map(|_| ()).map_err(|e| e.kind());
            let udp = udp_connected_once(to, ANSWER)
                .map(|_| ())
                .map_err(|e| e.kind());
            assert!(
                start.elapsed() < ANSWER,
                "a reject took {:?}",
                start.elapsed()
            );
            (tcp, udp)
        });
        assert_eq!(tcp, Err(std::io::ErrorKind::ConnectionRefused), "TCP {to}");
        assert_eq!(udp, Err(std::io::ErrorKind::ConnectionRefused), "UDP {to}");
    }

    // A connection to the remote backend held open: its SNAT port is in use (the closed
    // flows' and the one-exchange UDP flows' are not: a new flow may take them).
    let remote = sa(NODE1, 30082);
    let _held = in_ns(&t.client, move || {
        let c = TcpStream::connect_timeout(&remote, ANSWER).expect("a connection");
        exchange(&c).expect("its first exchange");
        c
    });

    // What an operator sees in /metrics: the decisions on eth0, and the flows tracked.
    let (status, metrics) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/metrics").expect("GET /metrics")
    });
    assert_eq!(status, 200);
    // Read as a Prometheus server would, by a parser other than the library that wrote it.
    let scrape = prometheus_parse::Scrape::parse(metrics.lines().map(|l| Ok(l.to_string())))
        .expect("/metrics parses");
    let value = |name: &str, labels: &[(&str, &str)]| -> u64 {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .and_then(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => {
                    Some(v as u64)
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("no {name}{labels:?} in /metrics:\n{metrics}"))
    };
    let decisions = |reason| {
        value(
            "svc_packet_decisions_total",
            &[("device", "eth0"), ("reason", reason)],
        )
    };
    // 4 rejects (TCP and UDP, both families); at least the 8 + 80 flows above.
    assert_eq!(decisions("reject_no_backend"), 4);
    assert!(decisions("new") >= 88);
    assert!(decisions("reply") > 0);
    assert!(value("svc_conntrack_flows", &[("snat", "true")]) >= 40);
    assert!(value("svc_conntrack_flows", &[("snat", "false")]) >= 40);
    // Both tables: a UDP flow with one exchange is not assured.
    assert!(
        value("svc_conntrack_entries", &[]) + value("svc_conntrack_unassured_entries", &[])
            >= 2 * 88
    );
    assert!(value("svc_snat_ports_in_use_max", &[]) >= 1);
}

/// A TCP connection from local port `port` (SO_REUSEADDR, so a port whose last connection
/// was reset can be bound again at once) to `to`, within `timeout`.
fn tcp_from(port: u16, to: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to4) = to else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    // SAFETY: plain socket calls on a descriptor owned here (given to the TcpStream, or
    // closed on error); the addresses are valid sockaddr_in of the size given.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let one: libc::c_int = 1;
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        let sin = |port: u16, ip: std::net::Ipv4Addr| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(ip.octets()),
            },
            sin_zero: [0; 8],
        };
        let local = sin(port, std::net::Ipv4Addr::UNSPECIFIED);
        let remote = sin(to4.port(), *to4.ip());
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let ok = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
            // A blocking connect() gives up after SO_SNDTIMEO.
            && libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            ) == 0
            && libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) == 0
            && libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) == 0;
        if !ok {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINPROGRESS) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connect timed out",
                ));
            }
            return Err(e);
        }
        Ok(stream)
    }
}

/// One exchange on `c`, then an RST (SO_LINGER 0) rather than a FIN: no TIME_WAIT anywhere.
/// How many segments the kernel has retransmitted on `c` so far (a retried SYN counts).
fn retransmits(c: &TcpStream) -> std::io::Result<u32> {
    // SAFETY: zeroed tcp_info is valid (plain integers); getsockopt writes at most `len` bytes.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let r = libc::getsockopt(
            c.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(info.tcpi_total_retrans)
    }
}

fn exchange_and_reset(c: TcpStream, timeout: Duration) -> std::io::Result<Answer> {
    c.set_read_timeout(Some(timeout))?;
    (&c).write_all(b"x\n")?;
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line)?;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a linger of the size given.
    let r = unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    drop(c);
    parse_answer(&line)
}

/// Closed flows give their tuples up at once, not after the closing timeout (10 s): a client
/// that reset its NodePort connection to pod 1 connects to pod 1 directly from the same port
/// (its SYN-ACK must not come back from the NodePort), and back to the NodePort again from
/// it; with 4 SNAT ports, 24 connections in a row to pod 2 through the NodePort, each closed
/// as soon as answered (RST, or FIN each way), are all answered, and /metrics counts no SNAT
/// port in use once they are closed.
#[test]
fn closed_flows_give_their_tuples_up() {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 41, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 42, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.start_agent_with(&[
        "--snat-port-range",
        "61000-61003",
        "--metrics-bind-address",
        "127.0.0.1:10249",
    ]);
    // The client reaches pod 1 through node 1 (as the NodePort benchmark's client does).
    t.client
        .ip(["route", "add", "10.244.1.0/24", "via", NODE1])
        .expect("route to pod 1");
    let nodeport = sa(NODE1, 30081);
    answered(&t.client, "TCP to the local NodePort", move || {
        tcp_once(nodeport, ANSWER)
    });
    let pod = sa(POD1, 8080);
    let got = in_ns(&t.client, move || {
        let port = 45000;
        let mut got = Vec::new();
        for to in [nodeport, pod, nodeport, pod] {
            let a = tcp_from(port, to, ANSWER)
                .and_then(|c| Ok((retransmits(&c)?, exchange_and_reset(c, ANSWER)?)))
                .map_err(|e| format!("from port {port} to {to}: {e}"));
            got.push((to, a));
        }
        got
    });
    for (to, a) in got {
        let (retransmits, a) = a.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            a,
            Answer {
                backend: "pod1".into(),
                saw: ip(CLIENT)
            },
            "to {to}"
        );
        // A SYN-ACK from the old flow's translation would not match the socket: the client
        // would reset it and answer only after retrying its SYN.
        assert_eq!(
            retransmits, 0,
            "to {to}: answered, but only after a retried SYN"
        );
    }

    let remote = sa(NODE1, 30082);
    let failures = in_ns(&t.client, move || {
        let mut failures = Vec::new();
        for i in 0..24u32 {
            let a = if i.is_multiple_of(2) {
                TcpStream::connect_timeout(&remote, ANSWER)
                    .and_then(|c| exchange_and_reset(c, ANSWER))
            } else {
                tcp_once(remote, ANSWER)
            };
            match a {
                Ok(a) if a.backend == "pod2" && a.saw == ip(NODE1) => {}
                other => failures.push(format!("connection {i}: {other:?}")),
            }
        }
        failures
    });
    assert!(failures.is_empty(), "{failures:?}");
    // The last one's FIN from pod 2 may still be on its way: closed soon.
    let in_use = in_ns(&t.node1, || {
        poll(Duration::from_secs(5), || {
            let (status, metrics) = http_get_path(sa("127.0.0.1", 10249), "/metrics")?;
            anyhow::ensure!(status == 200, "/metrics: {status}");
            let n: u64 = metrics
                .lines()
                .find_map(|l| {
                    l.strip_prefix("svc_snat_ports_in_use_max")?
                        .trim()
                        .parse()
                        .ok()
                })
                .ok_or_else(|| anyhow::anyhow!("no svc_snat_ports_in_use_max"))?;
            Ok((n == 0).then_some(n))
        })
    });
    assert!(
        in_use.is_ok(),
        "SNAT ports still counted in use: {in_use:?}"
    );
}

/// A UDP socket of the client's, connected to `to` (a long-lived UDP client: every datagram
/// after the first takes the flow the first one made).
fn udp_client(ns: &NetNs, to: SocketAddr) -> UdpSocket {
    in_ns(ns, move || {
        let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
        s.connect(to).expect("connect");
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        s
    })
}

/// One datagram on `s` and its answer. The socket stays in the client's namespace; sends need
/// no namespace of their own.
fn ask_udp(s: &UdpSocket) -> std::io::Result<Answer> {
    s.send(b"x")?;
    let mut buf = [0u8; 512];
    let n = s.recv(&mut buf)?;
    parse_answer(&String::from_utf8_lossy(&buf[..n]))
}

/// Sends on `s` until `backend` answers, for at most 5 s.
fn udp_until(s: &UdpSocket, backend: &str) -> Result<(), String> {
    udp_until_within(s, backend, Duration::from_secs(5))
}

/// Sends on `s` until `backend` answers, for at most `within`.
fn udp_until_within(s: &UdpSocket, backend: &str, within: Duration) -> Result<(), String> {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < within {
        match ask_udp(s) {
            Ok(a) if a.backend == backend => return Ok(()),
            other => last = Some(format!("{other:?}")),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "not {backend} after {within:?} of one socket sending: last {last:?}"
    ))
}

/// Sends on `s` for `d` and says who answered each datagram that was answered.
fn udp_answers_for(s: &UdpSocket, d: Duration) -> Vec<String> {
    let start = Instant::now();
    let mut seen = Vec::new();
    while start.elapsed() < d {
        if let Ok(a) = ask_udp(s) {
            seen.push(a.backend);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    seen
}

/// A UDP flow through a NodePort whose backend leaves the Service moves to a live backend, as
/// under kube-proxy (which deletes the conntrack entries of UDP flows to a departed endpoint):
/// a client that keeps sending on one socket would otherwise keep its flow, and its old
/// backend, for as long as it sends. From a local backend to a remote one (SNATed) and back.
#[test]
fn a_udp_flow_leaves_a_backend_that_left_its_service() {
    let mut t = Topo::new();
    t.service("moving", nodeport("moving", 31, 30095));
    t.endpoints("moving", &[LOCAL_POD]);
    t.start_agent();
    let s = udp_client(&t.client, sa(NODE1, 30095));
    poll(Duration::from_secs(10), || Ok(ask_udp(&s).ok())).expect("a first answer");
    udp_until(&s, "pod1").expect("the local backend first");

    t.endpoints("moving", &[REMOTE_POD]);
    udp_until(&s, "pod2").expect("the remote backend, once the local one left");
    t.endpoints("moving", &[LOCAL_POD]);
    udp_until(&s, "pod1").expect("the local backend, once the remote one left");
}

/// The same across a crash, whoever saw the backend leave: a backend that left its Service
/// while no agent ran, and one whose departure an agent synced but was SIGKILLed before it
/// ended the flows (that window widened by fault injection), lose their UDP flows once the
/// agent is back, as kube-proxy's stateless cleanup after every sync ends them.
#[test]
fn a_udp_flow_leaves_a_backend_that_left_across_a_crash() {
    let pause = Duration::from_millis(1500);
    let mut t = Topo::new();
    t.agent_env = vec![format!("SVC_TEST_STALE_UDP_PAUSE_MS={}", pause.as_millis())];
    t.service("moving", nodeport("moving", 33, 30096));
    t.endpoints("moving", &[LOCAL_POD]);
    t.start_agent();
    let s = udp_client(&t.client, sa(NODE1, 30096));
    poll(Duration::from_secs(10), || Ok(ask_udp(&s).ok())).expect("a first answer");
    udp_until(&s, "pod1").expect("the local backend first");
    let within = pause + Duration::from_secs(5);
    let only =
        |seen: &[String], backend: &str| !seen.is_empty() && seen.iter().all(|b| b == backend);

    // Gone while no agent ran.
    t.agent().kill().expect("SIGKILL");
    t.endpoints("moving", &[REMOTE_POD]);
    let seen = udp_answers_for(&s, Duration::from_millis(500));
    assert!(only(&seen, "pod1"), "with no agent: {seen:?}");
    t.agent().restart().expect("restart");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("ready again");
    udp_until_within(&s, "pod2", within).expect("the remote backend, once the agent is back");

    // Gone in a sync whose cleanup a SIGKILL cut short.
    let synced = t.agent().count_lines("svc-agent: synced");
    t.endpoints("moving", &[LOCAL_POD]);
    t.agent()
        .wait_for_lines("svc-agent: synced", synced + 1, Duration::from_secs(10))
        .expect("the change synced");
    t.agent().kill().expect("SIGKILL");
    let seen = udp_answers_for(&s, Duration::from_millis(500));
    assert!(
        only(&seen, "pod2"),
        "the sync removed pod2, the flow's cleanup did not run: {seen:?}"
    );
    t.agent().restart().expect("restart");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("ready again");
    udp_until_within(&s, "pod1", within).expect("the local backend, once the agent is back");
}

/// kube-proxy's notion of a stale UDP flow: one to an endpoint that no longer *serves* the
/// Service. A terminating endpoint that still serves keeps its flows (new ones go to the
/// ready endpoint), as kube-proxy keeps their conntrack entries; once it stops serving, its
/// flows move.
#[test]
fn a_udp_flow_stays_with_a_terminating_backend_while_it_serves() {
    let mut t = Topo::new();
    t.service("draining", nodeport("draining", 34, 30097));
    t.endpoints("draining", &[LOCAL_POD]);
    t.start_agent();
    let s = udp_client(&t.client, sa(NODE1, 30097));
    poll(Duration::from_secs(10), || Ok(ask_udp(&s).ok())).expect("a first answer");
    udp_until(&s, "pod1").expect("the local backend first");

    t.endpoints_as(
        "draining",
        &[(LOCAL_POD, TERMINATING_SERVING), (REMOTE_POD, READY)],
    );
    // New flows (a new socket each) go to the ready endpoint once the agent has synced.
    let to = sa(NODE1, 30097);
    in_ns(&t.client2, move || {
        poll(Duration::from_secs(10), || {
            Ok(udp_once(to, ANSWER).ok().filter(|a| a.backend == "pod2"))
        })
    })
    .expect("new flows go to the ready endpoint");
    let seen = udp_answers_for(&s, Duration::from_millis(1500));
    assert!(
        !seen.is_empty() && seen.iter().all(|b| b == "pod1"),
        "the flow to the terminating, serving endpoint: {seen:?}"
    );

    t.endpoints_as("draining", &[(LOCAL_POD, TERMINATING), (REMOTE_POD, READY)]);
    udp_until(&s, "pod2").expect("the ready endpoint, once the terminating one stopped serving");
}

/// externalTrafficPolicy Local: only node 1's endpoint answers, and it sees the client's
/// address; the health check node port says 200 with one local endpoint. A Service whose only
/// endpoint is on node 2 is dropped here (no answer, not a reject) and its health check says
/// 503. An ExternalIP reaches its (remote) backend, SNATed, over IPv4 and IPv6. A
/// LoadBalancer IP with loadBalancerSourceRanges answers a client inside the range and drops
/// one outside it (both families), while the same Service's NodePort answers both. A NodePort
/// with sessionAffinity ClientIP sends every connection of a client to one backend.
#[test]
fn traffic_policy_health_checks_external_ips_source_ranges_affinity() {
    let mut t = Topo::new();
    let etp = |hc: u16| {
        json!({
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": hc,
        })
    };
    let lb_status = |ip: &str| json!({"loadBalancer": {"ingress": [{"ip": ip}]}});
    t.service(
        "etp",
        service(
            "etp",
            "LoadBalancer",
            21,
            30091,
            etp(30301),
            lb_status(ETP_LB_IP),
        ),
    );
    t.endpoints("etp", &[LOCAL_POD, REMOTE_POD]);
    t.service(
        "etp-remote",
        service(
            "etp-remote",
            "LoadBalancer",
            22,
            30092,
            etp(30302),
            json!({}),
        ),
    );
    t.endpoints("etp-remote", &[REMOTE_POD]);
    t.service(
        "ext",
        service(
            "ext",
            "ClusterIP",
            23,
            0,
            json!({"externalIPs": [EXTERNAL_IP, EXTERNAL_IP6]}),
            json!({}),
        ),
    );
    t.endpoints("ext", &[REMOTE_POD]);
    t.service(
        "lb",
        service(
            "lb",
            "LoadBalancer",
            24,
            30094,
            json!({"loadBalancerSourceRanges": [format!("{CLIENT}/32"), format!("{CLIENT6}/128")]}),
            json!({"loadBalancer": {"ingress": [{"ip": LB_IP}, {"ip": LB_IP6}]}}),
        ),
    );
    t.endpoints("lb", &[LOCAL_POD]);
    t.service(
        "sticky",
        service(
            "sticky",
            "NodePort",
            25,
            30095,
            json!({
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
            }),
            json!({}),
        ),
    );
    t.endpoints("sticky", &[LOCAL_POD, REMOTE_POD]);
    t.start_agent();

    // One UDP socket (one client port) talking to two frontends of the same local backend, in
    // turn: each answer comes from the frontend it was sent to.
    let (a, b) = (sa(LB_IP, 53), sa(NODE1, 30094));
    answered(&t.client, &format!("UDP to {a}"), move || {
        udp_once(a, ANSWER)
    });
    let froms = in_ns(
        &t.client,
        move || -> std::io::Result<Vec<(SocketAddr, SocketAddr)>> {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.set_read_timeout(Some(ANSWER))?;
            let mut buf = [0u8; 512];
            let mut out = Vec::new();
            for to in [a, b, a, b, a] {
                s.send_to(b"x", to)?;
                let (n, from) = s.recv_from(&mut buf)?;
                let answer = parse_answer(&String::from_utf8_lossy(&buf[..n]))?;
                assert_eq!(answer.backend, "pod1");
                assert_eq!(answer.saw, ip(CLIENT));
                out.push((to, from));
            }
            Ok(out)
        },
    )
    .expect("one socket, two frontends");
    for (to, from) in froms {
        assert_eq!(from, to, "the answer to {to} came from {from}");
    }

    // sessionAffinity ClientIP: every connection of a client reaches the same backend.
    let to = sa(NODE1, 30095);
    answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    let seen: std::collections::BTreeSet<String> = in_ns(&t.client, move || {
        (0..20)
            .map(|_| {
                tcp_once(to, ANSWER)
                    .map(|a| a.backend)
                    .unwrap_or_else(|e| e.to_string())
            })
            .collect()
    });
    assert_eq!(seen.len(), 1, "sessionAffinity ClientIP: {seen:?}");

    // eTP Local: always pod1, with the client's address, over the NodePort and the LB IP.
    // A NodePort has one port number for both protocols; the LB IP has the Service's ports.
    for (to, udp_to) in [
        (sa(NODE1, 30091), sa(NODE1, 30091)),
        (sa(NODE1_6, 30091), sa(NODE1_6, 30091)),
        (sa(ETP_LB_IP, 80), sa(ETP_LB_IP, 53)),
    ] {
        let client = if to.is_ipv4() { CLIENT } else { CLIENT6 };
        let want = Answer {
            backend: "pod1".into(),
            saw: ip(client),
        };
        answered(&t.client, &format!("TCP to {to}"), move || {
            tcp_once(to, ANSWER)
        });
        let got = in_ns(&t.client, move || {
            (0..10)
                .map(|_| tcp_once(to, ANSWER).map_err(|e| e.to_string()))
                .collect::<Vec<_>>()
        });
        assert!(got.iter().all(|a| a.as_ref() == Ok(&want)), "{to}: {got:?}");
        let got = answered(&t.client, &format!("UDP to {udp_to}"), move || {
            udp_once(udp_to, ANSWER)
        });
        assert_eq!(got, want, "UDP {udp_to}");
    }
    // No local endpoint: dropped, so the client hears nothing.
    let to = sa(NODE1, 30092);
    let r = in_ns(&t.client, move || tcp_once(to, SILENCE));
    assert!(
        matches!(&r, Err(e) if is_timeout(e)),
        "eTP Local without a local endpoint: {r:?}"
    );

    // Health checks, as a cloud load balancer asks them.
    let (status, body) = in_ns(&t.client, || {
        poll(Duration::from_secs(10), || {
            Ok(http_get(sa(NODE1, 30301)).ok())
        })
    })
    .expect("health check of etp");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("health check JSON");
    assert_eq!(v["service"], json!({"namespace": "demo", "name": "etp"}));
    assert_eq!(v["localEndpoints"], 1, "{body}");
    let (status, body) = in_ns(&t.client, || {
        poll(Duration::from_secs(10), || {
            Ok(http_get(sa(NODE1, 30302)).ok())
        })
    })
    .expect("health check of etp-remote");
    assert_eq!(status, 503, "{body}");
    let v: Value = serde_json::from_str(&body).expect("health check JSON");
    assert_eq!(v["localEndpoints"], 0, "{body}");

    // ExternalIP to a backend on node 2: SNATed to node 1.
    for (external, node) in [(EXTERNAL_IP6, NODE1_6), (EXTERNAL_IP, NODE1)] {
        let (to, udp_to) = (sa(external, 80), sa(external, 53));
        let want = Answer {
            backend: "pod2".into(),
            saw: ip(node),
        };
        assert_eq!(
            answered(&t.client, &format!("TCP to {to}"), move || tcp_once(
                to, ANSWER
            )),
            want
        );
        assert_eq!(
            answered(&t.client, &format!("UDP to {udp_to}"), move || udp_once(
                udp_to, ANSWER
            )),
            want
        );
    }
    // A port the ExternalIP does not define is not ours: nothing listens on node 1 there.
    let to = sa(EXTERNAL_IP, 81);
    let r = in_ns(&t.client, move || tcp_once(to, SILENCE));
    assert!(r.is_err(), "{to} answered: {r:?}");

    // Source ranges: the LB IP for a client inside, not for one outside; the NodePort for
    // both.
    let (to, udp_to) = (sa(LB_IP6, 80), sa(LB_IP6, 53));
    let want = Answer {
        backend: "pod1".into(),
        saw: ip(CLIENT6),
    };
    assert_eq!(
        answered(&t.client, &format!("TCP to {to}"), move || tcp_once(
            to, ANSWER
        )),
        want
    );
    assert_eq!(
        answered(&t.client, &format!("UDP to {udp_to}"), move || udp_once(
            udp_to, ANSWER
        )),
        want
    );
    let r = in_ns(&t.client2, move || tcp_once(to, SILENCE));
    assert!(
        matches!(&r, Err(e) if is_timeout(e)),
        "an IPv6 client outside loadBalancerSourceRanges: {r:?}"
    );
    let (to, udp_to) = (sa(LB_IP, 80), sa(LB_IP, 53));
    let want = Answer {
        backend: "pod1".into(),
        saw: ip(CLIENT),
    };
    assert_eq!(
        answered(&t.client, &format!("TCP to {to}"), move || tcp_once(
            to, ANSWER
        )),
        want
    );
    assert_eq!(
        answered(&t.client, &format!("UDP to {udp_to}"), move || udp_once(
            udp_to, ANSWER
        )),
        want
    );
    let r = in_ns(&t.client2, move || tcp_once(to, SILENCE));
    assert!(
        matches!(&r, Err(e) if is_timeout(e)),
        "a client outside loadBalancerSourceRanges: {r:?}"
    );
    let r = in_ns(&t.client2, move || udp_once(udp_to, SILENCE));
    assert!(
        matches!(&r, Err(e) if is_timeout(e)),
        "UDP from outside loadBalancerSourceRanges: {r:?}"
    );
    let to = sa(NODE1, 30094);
    let got = answered(&t.client2, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!(
        got,
        Answer {
            backend: "pod1".into(),
            saw: ip(CLIENT2)
        }
    );
}

/// The TCP sockets listening on `port` inside `ns`, as `ss -ltn` there lists them (the
/// namespace's /proc/net/tcp and tcp6, read by a thread inside it).
fn listening(ns: &NetNs, port: u16) -> std::collections::BTreeSet<SocketAddr> {
    in_ns(ns, move || {
        let mut out = std::collections::BTreeSet::new();
        for file in ["tcp", "tcp6"] {
            let path = format!("/proc/thread-self/net/{file}");
            let text =
                std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
            for line in text.lines().skip(1) {
                // sl, local_address, rem_address, st (0A: LISTEN), ...
                let f: Vec<&str> = line.split_whitespace().collect();
                let (Some(local), Some(&"0A")) = (f.get(1), f.get(3)) else {
                    continue;
                };
                let Some((hex, p)) = local.split_once(':') else {
                    continue;
                };
                if u16::from_str_radix(p, 16) != Ok(port) {
                    continue;
                }
                // The address's bytes as the kernel holds them, printed one native-endian
                // 32-bit word at a time.
                let bytes: Vec<u8> = (0..hex.len())
                    .step_by(8)
                    .flat_map(|i| {
                        u32::from_str_radix(&hex[i..i + 8], 16)
                            .unwrap_or_else(|e| panic!("{path}: {line:?}: {e}"))
                            .to_ne_bytes()
                    })
                    .collect();
                let ip = match <[u8; 4]>::try_from(bytes.as_slice()) {
                    Ok(v4) => IpAddr::from(v4),
                    Err(_) => IpAddr::from(<[u8; 16]>::try_from(bytes.as_slice()).unwrap()),
                };
                out.insert(SocketAddr::new(ip, port));
            }
        }
        out
    })
}

/// healthCheckNodePort servers listen where kube-proxy's do: on the node addresses
/// `--nodeport-addresses` selects (here node 1's uplink addresses, by CIDR), each its own
/// listener, not on every address of the node: a probe of loopback or of node 1's address on
/// the pod network is refused. An address that comes into the range later answers too (an
/// IPv6 one once its duplicate address detection is over, without a failed bind on the way),
/// and one that goes is given up.
#[test]
fn health_check_ports_listen_on_the_node_port_addresses() {
    const HC: u16 = 30311;
    let mut t = Topo::new();
    t.service(
        "etp",
        service(
            "etp",
            "LoadBalancer",
            31,
            30111,
            json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": HC}),
            json!({}),
        ),
    );
    t.endpoints("etp", &[LOCAL_POD]);
    t.start_agent_with(&["--nodeport-addresses", "10.77.0.0/16,fd77::/64"]);

    let healthy = |t: &Topo, at: &str| {
        let to = sa(at, HC);
        let (status, body) = in_ns(&t.client, move || {
            poll(Duration::from_secs(10), || Ok(http_get(to).ok()))
        })
        .unwrap_or_else(|e| panic!("health check at {to}: {e:#}"));
        assert_eq!(status, 200, "{to}: {body}");
        let v: Value = serde_json::from_str(&body).expect("health check JSON");
        assert_eq!(v["service"], json!({"namespace": "demo", "name": "etp"}));
    };
    healthy(&t, NODE1);
    healthy(&t, NODE1_6);
    let refused = |ns: &NetNs, at: &str| {
        let to = sa(at, HC);
        let r = in_ns(ns, move || {
            TcpStream::connect_timeout(&to, ANSWER).map(|_| ())
        });
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
            "{to} from {}: {r:?}",
            ns.name()
        );
    };
    refused(&t.node1, "127.0.0.1");
    refused(&t.node1, "::1");
    refused(&t.pod1, "10.244.1.1");
    refused(&t.pod1, "fd00:244:1::1");
    let uplink = [sa(NODE1, HC), sa(NODE1_6, HC)].into_iter().collect();
    assert_eq!(listening(&t.node1, HC), uplink);

    // Addresses that come into the range: at once, and after DAD (no `nodad`).
    t.node1.add_addr("eth0", "10.77.0.9/24").unwrap();
    t.node1
        .ip(["addr", "add", "fd77::9/64", "dev", "eth0"])
        .unwrap();
    healthy(&t, "10.77.0.9");
    healthy(&t, "fd77::9");
    let log = t.agent().log();
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("healthCheckNodePort")),
        "a health check port failed to listen:\n{log}"
    );
    t.node1
        .ip(["addr", "del", "10.77.0.9/24", "dev", "eth0"])
        .unwrap();
    t.node1
        .ip(["addr", "del", "fd77::9/64", "dev", "eth0"])
        .unwrap();
    poll(Duration::from_secs(10), || {
        Ok((listening(&t.node1, HC) == uplink).then_some(()))
    })
    .unwrap_or_else(|e| {
        panic!(
            "listening on {:?} after the addresses went: {e:#}",
            listening(&t.node1, HC)
        )
    });
}

/// `GET PATH` at `to` as a load balancer's health checker does: a bounded wait for the whole
/// answer; its status code.
fn probe_status(to: SocketAddr, path: &str, timeout: Duration) -> Result<u16, String> {
    let mut c = TcpStream::connect_timeout(&to, timeout).map_err(|e| format!("connect: {e}"))?;
    c.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    c.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("write: {e}"))?;
    let mut reply = String::new();
    c.read_to_string(&mut reply)
        .map_err(|e| format!("read: {e} (after {reply:?})"))?;
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {reply:?}"))
}

/// Holds up to `n` idle connections (no request sent) to `targets` in turn for `how_long`,
/// opening a new one whenever the server closes one, as a slow-loris attacker does; how many
/// it opened in all.
fn hold_slow_connections(targets: Vec<SocketAddr>, n: usize, how_long: Duration) -> usize {
    let end = Instant::now() + how_long;
    let mut held: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut opened = 0;
    while Instant::now() < end {
        for (i, slot) in held.iter_mut().enumerate() {
            let closed = slot.as_ref().is_none_or(|c| {
                let mut b = [0u8; 1];
                // 0: the server closed it; WouldBlock: still open and silent.
                !matches!(c.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            if !closed {
                continue;
            }
            *slot = TcpStream::connect_timeout(&targets[i % targets.len()], SILENCE)
                .ok()
                .inspect(|c| c.set_nonblocking(true).expect("nonblocking"));
            opened += usize::from(slot.is_some());
            if Instant::now() >= end {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    opened
}

/// Issue 33, item 6: 2,000 slow connections from one outside host to the health port and a
/// healthCheckNodePort, against an agent started under a container's file limit (`nofile`,
/// `prlimit`'s SOFT:HARD). A load balancer's checks from another host must get the answer the
/// state says (200: synced, a ready local endpoint), each within 3 s, all along; the agent
/// must not run out of descriptors, and must raise its soft limit to the hard one.
fn health_answers_hold_under_slow_connections(nofile: &str, soft_after: u64) {
    const HC: u16 = 30312;
    const HEALTHZ: u16 = 10256;
    let mut t = Topo::new();
    t.service(
        "etp",
        service(
            "etp",
            "LoadBalancer",
            33,
            30112,
            json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": HC}),
            json!({}),
        ),
    );
    t.endpoints("etp", &[LOCAL_POD]);
    t.agent_wrapper = vec!["prlimit".into(), format!("--nofile={nofile}")];
    t.start_agent_with(&[
        "--healthz-bind-address",
        &format!("0.0.0.0:{HEALTHZ}"),
        "--metrics-bind-address",
        "127.0.0.1:10249",
    ]);
    let pid = t.agent().pid().expect("agent pid");
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files in /proc/PID/limits");
    let soft: u64 = open_files
        .split_whitespace()
        .nth(3)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(soft, soft_after, "{open_files}");
    let (healthz, hc) = (sa(NODE1, HEALTHZ), sa(NODE1, HC));
    in_ns(&t.client2, move || {
        poll(Duration::from_secs(10), || {
            Ok((probe_status(hc, "/", ANSWER) == Ok(200)).then_some(()))
        })
    })
    .expect("the health check node port answers 200 before the attack");

    const ATTACK: Duration = Duration::from_secs(12);
    let attack = spawn_in(&t.client, move || {
        hold_slow_connections(vec![healthz, hc], 2000, ATTACK)
    });
    // Let the attacker fill up first.
    std::thread::sleep(Duration::from_secs(3));
    let checks = spawn_in(&t.client2, move || {
        let mut failed = Vec::new();
        let mut done = 0;
        let end = Instant::now() + Duration::from_secs(7);
        while Instant::now() < end {
            for (to, path) in [(healthz, "/healthz"), (hc, "/")] {
                let started = Instant::now();
                match probe_status(to, path, ANSWER) {
                    Ok(200) => {}
                    other => failed.push(format!(
                        "{to}{path}: {other:?} after {:?}",
                        started.elapsed()
                    )),
                }
                done += 1;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        (done, failed)
    });
    let fds_mid = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    let (done, failed) = checks.join().unwrap();
    let opened = attack.join().unwrap();
    eprintln!(
        "{opened} slow connections opened; {done} checks, {} failed; the agent held {fds_mid} \
         descriptors in the middle of the attack",
        failed.len()
    );
    assert!(
        opened >= 2000,
        "the attack opened only {opened} connections"
    );
    assert!(
        failed.is_empty(),
        "{} of {done} health checks failed under attack: {failed:#?}",
        failed.len()
    );
    let log = t.agent().log();
    assert!(
        !log.contains("Too many open files"),
        "the agent ran out of descriptors:\n{}",
        log.lines()
            .filter(|l| l.contains("Too many open files"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let metrics = in_ns(&t.node1, || {
        svc_tests::agent::http_get(sa("127.0.0.1", 10249), "/metrics")
    })
    .expect("/metrics");
    let evicted: u64 = metrics
        .1
        .lines()
        .find_map(|l| l.strip_prefix("svc_http_connections_evicted_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no eviction counter in {}", metrics.1));
    assert!(evicted > 0, "more connections than the cap, none closed");
}

/// A container's soft 1,024 under a higher hard limit (65,536, or this process's own hard
/// limit if lower: raising a hard limit takes CAP_SYS_RESOURCE).
#[test]
fn health_answers_hold_under_2000_slow_connections_with_a_raisable_file_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    let hard = r.rlim_max.min(65_536);
    assert!(hard > 4096, "this process's hard file limit is {hard}");
    health_answers_hold_under_slow_connections(&format!("1024:{hard}"), hard);
}

/// The hard limit is the container's too: the connection cap alone keeps descriptors for the
/// checkers and the agent's own work.
#[test]
fn health_answers_hold_under_2000_slow_connections_with_a_hard_file_limit_of_1024() {
    health_answers_hold_under_slow_connections("1024:1024", 1024);
}

/// net.ipv4.ip_local_reserved_ports of `ns`, as the kernel shows it.
fn reserved_ports(ns: &NetNs) -> String {
    in_ns(ns, || {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_reserved_ports").unwrap()
    })
    .trim()
    .to_string()
}

/// Issue 33, item 7: node 1's ephemeral ports span 1024-65000 (a common tuning), leaving no
/// room beside them for SNAT ports. The agent starts anyway: svc's range 61001-65535 goes into
/// ip_local_reserved_ports beside what was there, and a NodePort to a backend on node 2
/// (SNATed) answers.
#[test]
fn a_wide_ephemeral_port_range_gets_the_snat_ports_reserved() {
    let mut t = Topo::new();
    t.service("remote", nodeport("remote", 34, 30084));
    t.endpoints("remote", &[REMOTE_POD]);
    t.node1
        .sysctl("net.ipv4.ip_local_port_range=1024 65000")
        .unwrap();
    t.node1
        .sysctl("net.ipv4.ip_local_reserved_ports=8080,10250")
        .unwrap();
    t.start_agent();
    assert_eq!(reserved_ports(&t.node1), "8080,10250,61001-65535");
    let log = t.agent().log();
    assert!(
        log.lines().any(|l| l.contains("61001-65535")
            && l.contains("added to net.ipv4.ip_local_reserved_ports")),
        "{log}"
    );
    let to = sa(NODE1, 30084);
    let a = answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!((a.backend.as_str(), a.saw), ("pod2", ip(NODE1)));
    // A restart finds the reservation made and leaves it as it is.
    t.agent().terminate(Duration::from_secs(10)).unwrap();
    t.agent().restart().unwrap();
    t.agent().wait_ready(AGENT_READY_TIMEOUT).unwrap();
    assert_eq!(reserved_ports(&t.node1), "8080,10250,61001-65535");
    assert!(t
        .agent()
        .log()
        .contains("already in net.ipv4.ip_local_reserved_ports"));
}

/// Item 7, where the reservation cannot be made (a container's read-only /proc/sys): the agent
/// serves all the same, SNAT off. A NodePort to a local backend answers, one to a remote backend
/// does not (dropped, not sent from a port the node's own connections may hold), and /healthz,
/// /metrics and the log say why.
#[test]
fn snat_ports_that_cannot_be_reserved_turn_snat_off_and_say_so() {
    let mut t = Topo::new();
    t.service("remote", nodeport("remote", 35, 30085));
    t.endpoints("remote", &[REMOTE_POD]);
    t.service("local", nodeport("local", 36, 30086));
    t.endpoints("local", &[LOCAL_POD]);
    t.node1
        .sysctl("net.ipv4.ip_local_port_range=1024 65000")
        .unwrap();
    // The agent's own mount namespace, /proc/sys read-only in it as container runtimes mount
    // it; the machine's mounts are not touched.
    t.agent_wrapper = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec \"$@\"",
        "sh",
    ]
    .map(String::from)
    .to_vec();
    t.start_agent_with(&["--healthz-bind-address", "127.0.0.1:10256"]);
    assert_eq!(reserved_ports(&t.node1), "");
    let local = sa(NODE1, 30086);
    answered(&t.client, &format!("TCP to {local}"), move || {
        tcp_once(local, ANSWER)
    });
    let remote = sa(NODE1, 30085);
    let r = in_ns(&t.client, move || tcp_once(remote, SILENCE));
    assert!(r.is_err(), "a remote backend answered without SNAT: {r:?}");
    let (status, body) = in_ns(&t.node1, || {
        svc_tests::agent::http_get(sa("127.0.0.1", 10256), "/healthz")
    })
    .unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("SNAT off") && body.contains("ip_local_reserved_ports"),
        "{body}"
    );
    let log = t.agent().log();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("WARN") && l.contains("SNAT off"))
            .count(),
        1,
        "{log}"
    );
}

/// The agent SIGKILLed and started again while a client holds a NodePort connection to a
/// backend on node 2 (SNATed, so every reply needs the connection-tracking entry), while a
/// UDP client keeps one socket talking to it, and while another opens new connections back to
/// back: not one exchange fails. Then `uninstall`
/// removes the programs from node 1's eth0 and leaves the device as it was: the NodePort is
/// an ordinary closed port of node 1 again.
#[test]
fn restart_keeps_flows_and_uninstall_leaves_devices_clean() {
    restart_keeps_flows_and_uninstall(Attach::Tcx);
}

/// The same with the classic attach (clsact qdisc, cls_bpf filters), as on kernels without
/// tcx: NodePort TCP and UDP to a remote backend (SNAT and its reverse) and a local one, an
/// agent SIGKILL and restart under live flows, and uninstall removing svc's filters; what
/// `tc filter show`, `bpftool net show`, `list` and /metrics say of it.
#[test]
fn restart_keeps_flows_and_uninstall_leaves_devices_clean_with_the_classic_tc_attach() {
    restart_keeps_flows_and_uninstall(Attach::Classic);
}

/// The same with XDP (native) in front of the tc programs: the flows start and go on at XDP
/// (its counters move) across the SIGKILL and restart, which swaps the program into the
/// pinned XDP link; uninstall removes it.
#[test]
fn restart_keeps_flows_and_uninstall_leaves_devices_clean_with_xdp() {
    restart_keeps_flows_and_uninstall(Attach::Xdp);
}

/// How `restart_keeps_flows_and_uninstall` attaches the programs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Attach {
    Tcx,
    Classic,
    Xdp,
}

/// A kernel without `bpf_redirect_neigh` (before 5.10), as the start check's probe is told to
/// answer: the agent stops before loading anything, naming the helper and the part that needs
/// it, and attaches nothing.
#[test]
fn a_kernel_without_a_helper_is_named_at_start() {
    let mut t = Topo::new();
    t.agent_env = vec!["SVC_TEST_KERNEL_LACKS=bpf_redirect_neigh".into()];
    t.launch_agent(&[]);
    let status = poll(AGENT_READY_TIMEOUT, || t.agent().exited()).expect("the agent stops");
    assert!(!status.success());
    let log = t.agent().log();
    assert!(
        log.contains("lacks what svc needs: helper bpf_redirect_neigh in sched_cls programs (Linux 5.10), for the packet datapath"),
        "{log}"
    );
    assert_eq!(t.node1_eth0_programs(), (0, 0));
    assert!(
        !t.bpffs.path().exists(),
        "nothing made under the bpffs directory"
    );
}

/// Issue 37's start order: a Service of one remote endpoint, its ClusterIP asked from pod 1
/// inside the agent's cgroup (the socket programs' work) and its NodePort from outside (the
/// tc programs'). Returns the NodePort's address.
fn start_order_service(t: &Topo) -> SocketAddr {
    t.service("web", nodeport("web", 11, 30081));
    t.endpoints("web", &[REMOTE_POD]);
    sa(NODE1, 30081)
}

/// One connection to the ClusterIP of `start_order_service` from pod 1, inside the cgroup.
fn cluster_ip_from_the_cgroup(t: &Topo) -> svc_tests::Report {
    svc_tests::ClientRun::spawn(
        &t.tools.probe,
        &t.cgroup,
        &t.pod1,
        &["tcp".into(), "--to".into(), "10.96.0.11:80".into()],
    )
    .expect("probe in pod1")
    .wait(Duration::from_secs(20))
    .expect("probe report")
}

/// Issue 37: on a cold start the socket programs attach once the first sync has written the
/// maps (`svc-agent: serving`), the tc programs once the kernel has verified them
/// (`svc-agent: ready`). Killed between the two (the verification held back by a test
/// pause), the agent leaves ClusterIPs answering the cgroup's sockets and no program on the
/// device, so the NodePort does not answer; /healthz said so before the kill. The next agent
/// adopts the pins and the maps, attaches the rest, and the NodePort answers.
#[test]
fn a_kill_between_the_socket_and_the_tc_attach_is_completed_by_the_next_agent() {
    let mut t = Topo::new();
    let np = start_order_service(&t);
    t.agent_env = vec!["SVC_TEST_TC_VERIFY_PAUSE_MS=600000".into()];
    t.launch_agent(&["--metrics-bind-address", "127.0.0.1:10249"]);
    t.agent()
        .wait_for_lines(svc_tests::agent::SERVING_LINE, 1, AGENT_READY_TIMEOUT)
        .expect("socket programs attached");
    assert_eq!(t.agent().count_lines(svc_tests::agent::READY_LINE), 0);
    let r = cluster_ip_from_the_cgroup(&t);
    assert!(r.all_ok(), "ClusterIP before the tc attach: {r:?}");
    assert_eq!(r.results[0].backend.as_deref(), Some("pod2"), "{r:?}");
    assert_eq!(t.node1_eth0_programs(), (0, 0));
    let (status, body) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/healthz").expect("GET /healthz")
    });
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("the packet datapath is not attached yet"),
        "{body}"
    );
    let unanswered = in_ns(&t.client, move || tcp_once(np, SILENCE));
    assert!(
        unanswered.is_err(),
        "NodePort before the tc attach: {unanswered:?}"
    );

    t.agent().kill().expect("SIGKILL");
    let r = cluster_ip_from_the_cgroup(&t);
    assert!(r.all_ok(), "ClusterIP with the agent killed: {r:?}");

    t.agent = None;
    t.agent_env.clear();
    t.start_agent();
    assert_eq!(t.agent().count_lines(svc_tests::agent::SERVING_LINE), 1);
    assert_eq!(t.node1_eth0_programs(), (1, 1));
    let got = answered(&t.client, &format!("TCP to {np}"), move || {
        tcp_once(np, ANSWER)
    });
    assert_eq!(got.backend, "pod2", "NodePort after the restart: {got:?}");
    let r = cluster_ip_from_the_cgroup(&t);
    assert!(r.all_ok(), "ClusterIP after the restart: {r:?}");
}

/// Issue 37: a tc program the kernel refuses (a test's fault, after a pause that lets the
/// first sync and the socket programs' attach come first, as the verifier's seconds do on a
/// cold start) stops the agent with an error naming it, before `ready`. The socket programs
/// the kernel accepted stay attached, as a stopped agent's do, and serve the maps the first
/// sync wrote; nothing is on the device. The next agent, whose programs load, attaches
/// everything.
#[test]
fn a_refused_tc_program_stops_the_agent_and_leaves_its_socket_programs_serving() {
    let mut t = Topo::new();
    let np = start_order_service(&t);
    t.agent_env = vec![
        "SVC_TEST_TC_VERIFY_PAUSE_MS=2000".into(),
        "SVC_TEST_TC_REFUSED=tc_ext_ingress".into(),
    ];
    t.launch_agent(&[]);
    t.agent()
        .wait_for_lines(svc_tests::agent::SERVING_LINE, 1, AGENT_READY_TIMEOUT)
        .expect("socket programs attached");
    let status = poll(AGENT_READY_TIMEOUT, || t.agent().exited()).expect("the agent stops");
    assert!(!status.success());
    let log = t.agent().log();
    assert!(
        log.contains("tc_ext_ingress: refused by the kernel"),
        "{log}"
    );
    assert_eq!(
        t.agent().count_lines(svc_tests::agent::READY_LINE),
        0,
        "{log}"
    );
    assert_eq!(t.node1_eth0_programs(), (0, 0));
    let r = cluster_ip_from_the_cgroup(&t);
    assert!(r.all_ok(), "ClusterIP after the refusal: {r:?}");

    t.agent = None;
    t.agent_env.clear();
    t.start_agent();
    assert_eq!(t.node1_eth0_programs(), (1, 1));
    let got = answered(&t.client, &format!("TCP to {np}"), move || {
        tcp_once(np, ANSWER)
    });
    assert_eq!(got.backend, "pod2", "NodePort after the restart: {got:?}");
}

/// `CMD ARGS...` inside `ns` (nsenter, so tools that read the current namespace, as bpftool
/// does, see it); its stdout. Panics on failure.
fn run_in(ns: &NetNs, cmd: &[&str]) -> String {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", ns.path().display()))
        .args(cmd)
        .output()
        .expect("running nsenter");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// svc's filters on node 1's eth0 as `tc filter show` lists them: (ingress, egress) lines
/// naming a tc program of svc.
fn classic_filters(t: &Topo) -> (Vec<String>, Vec<String>) {
    classic_filters_of(&t.node1, "eth0")
}

fn restart_keeps_flows_and_uninstall(attach: Attach) {
    // Classic on purpose: first tcx, then moved over. Classic anyway: the second pass.
    let moves_over = attach == Attach::Classic;
    let classic = moves_over || classic_by_default();
    let mut t = Topo::new();
    let mut _peer = None;
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.service("local", nodeport("local", 32, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    if moves_over {
        // First through tcx, as the agent attaches on this kernel by itself (named, as the
        // second pass would force classic); then an agent told classic moves each program
        // over.
        t.start_agent_with(&["--tc-attach", "tcx"]);
        assert_eq!(tcx_programs(&t.node1, "eth0"), (1, 1));
        t.agent().terminate(Duration::from_secs(10)).expect("stop");
        t.start_agent_with(&[
            "--tc-attach",
            "classic",
            "--metrics-bind-address",
            "127.0.0.1:10249",
        ]);
        let log = t.agent().log();
        assert!(log.contains("detached the tcx link"), "{log}");
        // Filters, not tcx links: as tc and bpftool show them.
        assert_eq!(
            tcx_programs(&t.node1, "eth0"),
            (0, 0),
            "tcx programs on eth0"
        );
        let (ingress, egress) = classic_filters(&t);
        assert!(
            ingress.len() == 1
                && ingress[0].contains("tc_ext_ingress")
                && ingress[0].contains("direct-action"),
            "tc filter show dev eth0 ingress: {ingress:?}"
        );
        assert!(
            egress.len() == 1 && egress[0].contains("tc_ext_egress"),
            "tc filter show dev eth0 egress: {egress:?}"
        );
        let net = run_in(&t.node1, &["bpftool", "net", "show", "dev", "eth0"]);
        assert!(
            net.contains("eth0(")
                && net.contains("tc_ext_ingress")
                && net.contains("tc_ext_egress"),
            "bpftool net show dev eth0:\n{net}"
        );
        let list = t.list(&["-o", "json"]);
        let list: Value = serde_json::from_str(&list).expect("list's JSON");
        let mut listed: Vec<String> = list["tc_programs"]
            .as_array()
            .expect("tc_programs")
            .iter()
            .map(|a| format!("{} {} {}", a["device"], a["program"], a["mode"]))
            .collect();
        listed.sort();
        assert_eq!(
            listed,
            [
                "\"eth0\" \"tc_ext_egress\" \"classic\"",
                "\"eth0\" \"tc_ext_ingress\" \"classic\""
            ]
        );
        let (_, metrics) = in_ns(&t.node1, || {
            http_get_path(sa("127.0.0.1", 10249), "/metrics").expect("GET /metrics")
        });
        assert!(
            metrics.contains(
                "svc_tc_program_attached{device=\"eth0\",program=\"tc_ext_ingress\",mode=\"classic\"} 1"
            ),
            "{metrics}"
        );
        // Deleted under the agent (a clsact qdisc takes its filters with it): put back.
        run_in(&t.node1, &["tc", "qdisc", "del", "dev", "eth0", "clsact"]);
        poll(Duration::from_secs(10), || {
            let (i, e) = classic_filters(&t);
            Ok((i.len() == 1 && e.len() == 1).then_some(()))
        })
        .expect("the filters put back");
    } else if attach == Attach::Xdp {
        _peer = Some(xdp_ready(&t));
        t.start_agent_with(&[
            "--xdp-mode",
            "native",
            "--metrics-bind-address",
            "127.0.0.1:10249",
        ]);
    } else {
        t.start_agent();
    }
    let to = sa(NODE1, 30082);
    answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    let addrs_before = t.node1.ip(["-br", "addr", "show", "dev", "eth0"]).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let exchanges = Arc::new(AtomicU64::new(0));
    let connections = Arc::new(AtomicU64::new(0));
    let long_lived = {
        let (stop, exchanges) = (stop.clone(), exchanges.clone());
        spawn_in(&t.client, move || -> Result<(), String> {
            let c = TcpStream::connect_timeout(&to, ANSWER).map_err(|e| e.to_string())?;
            c.set_read_timeout(Some(ANSWER))
                .map_err(|e| e.to_string())?;
            let mut r = BufReader::new(&c);
            while !stop.load(Ordering::Relaxed) {
                (&c).write_all(b"x\n")
                    .map_err(|e| format!("after {exchanges:?}: {e}"))?;
                let mut line = String::new();
                r.read_line(&mut line)
                    .map_err(|e| format!("after {exchanges:?}: {e}"))?;
                let a = parse_answer(&line).map_err(|e| e.to_string())?;
                if a.backend != "pod2" || a.saw != ip(NODE1) {
                    return Err(format!("{a:?}"));
                }
                exchanges.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        })
    };
    // One UDP socket, as a long-lived UDP client (its flow SNATed too).
    let datagrams = Arc::new(AtomicU64::new(0));
    let udp_stream = {
        let (stop, datagrams) = (stop.clone(), datagrams.clone());
        spawn_in(&t.client, move || -> Result<(), String> {
            let s = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(ANSWER))
                .map_err(|e| e.to_string())?;
            let mut buf = [0u8; 512];
            while !stop.load(Ordering::Relaxed) {
                s.send_to(b"x", to).map_err(|e| e.to_string())?;
                let (n, from) = s
                    .recv_from(&mut buf)
                    .map_err(|e| format!("after {datagrams:?}: {e}"))?;
                let a =
                    parse_answer(&String::from_utf8_lossy(&buf[..n])).map_err(|e| e.to_string())?;
                if from != to || a.backend != "pod2" || a.saw != ip(NODE1) {
                    return Err(format!("{a:?} from {from}"));
                }
                datagrams.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        })
    };
    let new_connections = {
        let (stop, connections) = (stop.clone(), connections.clone());
        spawn_in(&t.client, move || {
            let mut failures = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let to = sa(NODE1, if i.is_multiple_of(2) { 30081 } else { 30082 });
                i += 1;
                match tcp_once(to, ANSWER) {
                    Ok(_) => {
                        connections.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => failures.push(format!("{to}: {e}")),
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            failures
        })
    };
    let xdp_counts = |t: &Topo| [XDP_NEW, XDP_CT_HIT, XDP_REPLY].map(|l| node1_metric(t, l));
    let xdp_before = (attach == Attach::Xdp).then(|| xdp_counts(&t));
    std::thread::sleep(Duration::from_millis(500));
    t.agent().kill().expect("SIGKILL");
    // The programs stay (their links are pinned) while no agent runs.
    std::thread::sleep(Duration::from_millis(1000));
    t.agent().restart().expect("restart");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("ready again");
    std::thread::sleep(Duration::from_millis(1000));
    stop.store(true, Ordering::Relaxed);
    let long_lived = long_lived.join().expect("long-lived client");
    let failures = new_connections.join().expect("connection loop");
    let udp_stream = udp_stream.join().expect("UDP stream");
    assert_eq!(long_lived, Ok(()), "the long-lived NodePort connection");
    assert_eq!(udp_stream, Ok(()), "the UDP stream through the NodePort");
    assert!(datagrams.load(Ordering::Relaxed) > 50, "{datagrams:?}");
    assert!(
        failures.is_empty(),
        "new connections failed across the restart: {failures:?}"
    );
    assert!(exchanges.load(Ordering::Relaxed) > 50, "{exchanges:?}");
    assert!(connections.load(Ordering::Relaxed) > 20, "{connections:?}");
    let log = t.agent().log();
    let swapped = if classic {
        "replaced the program of the classic filter"
    } else {
        "replaced the program of the pinned link"
    };
    assert!(
        log.contains(swapped),
        "the restarted agent swapped its programs into what the first attached:\n{log}"
    );
    if let Some(b) = xdp_before {
        assert!(
            log.contains("XDP: replaced the program of the pinned link"),
            "the restarted agent swapped its XDP program in:\n{log}"
        );
        // Counted across the kill: the counters are per-CPU map entries, pinned.
        let a = xdp_counts(&t);
        assert!(
            a[0] > b[0] && a[1] > b[1] && a[2] > b[2],
            "XDP started flows and served both ways: {b:?} -> {a:?}"
        );
    }

    // Uninstall: no program of ours on the device, the device and its addresses untouched,
    // and the NodePort is a closed port of node 1 again (its own stack answers RST).
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    if classic {
        // Filters are found by the namespace they are in: uninstall runs in node 1's.
        let out = run_in(
            &t.node1,
            &[
                &t.tools.agent.display().to_string(),
                "uninstall",
                "--bpffs",
                &t.bpffs.path().display().to_string(),
                "--cgroup",
                &t.cgroup.path().display().to_string(),
            ],
        );
        assert!(
            out.contains("removed the filter of tc_ext_ingress on eth0 (classic)"),
            "{out}"
        );
        assert_eq!(classic_filters(&t), (vec![], vec![]), "svc's filters left");
    } else {
        svc_tests::agent::uninstall(&t.tools.agent, t.bpffs.path(), Some(t.cgroup.path()))
            .expect("uninstall");
    }
    assert_eq!(t.node1_eth0_programs(), (0, 0), "programs left on eth0");
    let link = t.node1.ip(["-d", "link", "show", "dev", "eth0"]).unwrap();
    assert!(!link.contains("xdp"), "an XDP program left on eth0: {link}");
    let addrs_after = t.node1.ip(["-br", "addr", "show", "dev", "eth0"]).unwrap();
    assert_eq!(addrs_after, addrs_before);
    let to = sa(NODE1, 30082);
    let r = in_ns(&t.client, move || {
        tcp_once(to, ANSWER).map_err(|e| e.kind())
    });
    assert_eq!(r, Err(std::io::ErrorKind::ConnectionRefused));
    let pins: Vec<PathBuf> = std::fs::read_dir(t.bpffs.path())
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(pins.is_empty(), "pins left: {pins:?}");
}

/// One line and its answer on an open connection.
fn exchange(c: &TcpStream) -> std::io::Result<Answer> {
    c.set_read_timeout(Some(ANSWER))?;
    let mut w = c;
    w.write_all(b"x\n")?;
    let mut line = String::new();
    BufReader::new(c).read_line(&mut line)?;
    parse_answer(&line)
}

/// A Service deleted under open connections: they go on (as conntrack keeps them under
/// kube-proxy), through an ExternalIP to the remote backend (SNAT) and through a LoadBalancer
/// IP to the local one, across an agent SIGKILL and restart, although the tc ingress passes
/// untouched every packet to an address SVC_NODE_ADDRS lacks: both addresses linger there
/// while the flows live, new connections to them are no longer translated, and once the
/// connections close the agent lets the addresses go.
#[test]
fn a_deleted_services_connections_go_on_while_its_addresses_linger() {
    let mut t = Topo::new();
    t.service(
        "ext",
        service(
            "ext",
            "ClusterIP",
            51,
            0,
            json!({"externalIPs": [EXTERNAL_IP]}),
            json!({}),
        ),
    );
    t.endpoints("ext", &[REMOTE_POD]);
    t.service(
        "lb",
        service(
            "lb",
            "LoadBalancer",
            52,
            30052,
            json!({}),
            json!({"loadBalancer": {"ingress": [{"ip": LB_IP}]}}),
        ),
    );
    t.endpoints("lb", &[LOCAL_POD]);
    t.start_agent_with(&["--reconcile-interval-s", "1"]);
    let ext = sa(EXTERNAL_IP, 80);
    let lb = sa(LB_IP, 80);
    let via_ext = Answer {
        backend: "pod2".into(),
        saw: ip(NODE1),
    };
    let via_lb = Answer {
        backend: "pod1".into(),
        saw: ip(CLIENT),
    };
    assert_eq!(
        answered(&t.client, "ExternalIP", move || tcp_once(ext, ANSWER)),
        via_ext
    );
    assert_eq!(
        answered(&t.client, "LoadBalancer IP", move || tcp_once(lb, ANSWER)),
        via_lb
    );
    let conns = in_ns(&t.client, move || {
        [ext, lb].map(|to| TcpStream::connect_timeout(&to, ANSWER).expect("connecting"))
    });
    let check = |when: &str| {
        for (c, want) in conns.iter().zip([&via_ext, &via_lb]) {
            let got = exchange(c).unwrap_or_else(|e| panic!("{when}: {e}"));
            assert_eq!(&got, want, "{when}");
        }
    };
    check("before the Services are deleted");

    t.m.remove("svc-demo-ext.yaml").unwrap();
    t.m.remove("svc-demo-lb.yaml").unwrap();
    let gone = in_ns(&t.client, move || {
        poll(Duration::from_secs(10), || {
            let refused = [ext, lb].map(|to| tcp_once(to, Duration::from_millis(300)).is_err());
            Ok((refused == [true, true]).then_some(()))
        })
    });
    gone.expect("new connections to the deleted Services' addresses are no longer translated");
    let (bin, bpffs) = (t.tools.agent.clone(), t.bpffs.path().to_path_buf());
    let lingering = || {
        let mut l = svc_tests::agent::list(&bin, &bpffs)
            .expect("svc-agent list")
            .lingering_addresses;
        l.sort();
        l
    };
    let both = vec![EXTERNAL_IP.to_string(), LB_IP.to_string()];
    // Several drift checks and lingering-address passes (every second) go by.
    std::thread::sleep(Duration::from_secs(3));
    check("after the Services are deleted");
    assert_eq!(lingering(), both);

    t.agent().kill().expect("SIGKILL");
    t.agent().restart().expect("restart");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("ready again");
    std::thread::sleep(Duration::from_secs(3));
    check("after an agent restart");
    assert_eq!(lingering(), both);

    drop(conns);
    // Closed flows keep their entries for the closing timeout (10 s), then go.
    let released = poll(Duration::from_secs(30), || {
        Ok(lingering().is_empty().then_some(()))
    });
    released.expect("the addresses are let go once their connections closed");
}

/// The filter in front of SVC_NODE_ADDRS (SVC_NODE_ADDR_BITS, whose clear bit makes the tc
/// ingress pass an address's packets untranslated) cleared behind the agent's back: the
/// reconcile puts the bits back, says so and counts it as drift, and the NodePort answers.
/// Its pin removed while no agent runs: the next agent fills a new one before its programs
/// read it.
#[test]
fn a_cleared_node_address_filter_is_put_back() {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.start_agent_with(&[
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--reconcile-interval-s",
        "1",
    ]);
    let np = sa(NODE1, 30081);
    let want = Answer {
        backend: "pod1".into(),
        saw: ip(CLIENT),
    };
    assert_eq!(
        answered(&t.client, "NodePort", move || tcp_once(np, ANSWER)),
        want
    );
    let drift = metric(&t, "svc_drift_repaired_ops_total");
    let mut store = svc_agent::datapath::open_pinned(t.bpffs.path()).expect("the pinned maps");
    let IpAddr::V4(node) = ip(NODE1) else {
        unreachable!("node 1's address is IPv4")
    };
    let bit = svc_common::node_addr_bit(&svc_common::v4_mapped(node.octets()));
    for w in 0..svc_common::NODE_ADDR_BIT_WORDS {
        store
            .node_addr_bits
            .set(w, 0, 0)
            .expect("clearing the filter");
    }
    poll(Duration::from_secs(10), || {
        Ok(t.agent()
            .log()
            .contains("lost addresses' bits; put back")
            .then_some(()))
    })
    .unwrap_or_else(|e| {
        panic!(
            "no drift check put the filter back: {e:#}\n{}",
            t.agent().log()
        )
    });
    let word = store
        .node_addr_bits
        .get(&(bit / 64), 0)
        .expect("the filter");
    assert_ne!(
        word & 1 << (bit % 64),
        0,
        "node 1's address has its bit again"
    );
    assert_eq!(
        answered(&t.client, "NodePort", move || tcp_once(np, ANSWER)),
        want
    );
    assert!(metric(&t, "svc_drift_repaired_ops_total") > drift);

    // A new filter at a restart (its pin gone while no agent ran) is filled before the new
    // programs read it, not at a drift check (an hour away now).
    drop(store);
    t.agent().kill().expect("SIGKILL");
    let pin = svc_agent::datapath::map_pin(t.bpffs.path(), svc_common::map_names::NODE_ADDR_BITS);
    std::fs::remove_file(&pin).expect("removing the filter's pin");
    t.start_agent_with(&["--reconcile-interval-s", "3600"]);
    assert_eq!(
        answered(&t.client, "NodePort, after a restart", move || {
            tcp_once(np, ANSWER)
        }),
        want
    );
}

/// Traffic that starts on node 1 rather than outside it:
/// - a pod outside the agent's cgroup (its sockets unseen by the socket hooks, as a service
///   mesh's pods) behind a device named by `--packet-lb-devices`: its ClusterIP traffic is
///   translated per packet, its own address kept, and the answer comes from the ClusterIP;
/// - the same pod reaching a NodePort whose only endpoint is itself (hairpin): it answers
///   itself, seeing the connection come from the node;
/// - a process of node 1 inside the cgroup reaching a NodePort on the node's own address: the
///   socket hooks translate it, and it sees the NodePort as its peer;
/// - a pod inside the cgroup reaching a NodePort that selects itself (hairpin through the
///   socket hooks).
#[test]
fn pods_outside_the_cgroup_hairpin_and_the_node_itself() {
    let mut t = Topo::new();
    t.service(
        "cip",
        service("cip", "ClusterIP", 41, 0, json!({}), json!({})),
    );
    t.endpoints("cip", &[REMOTE_POD]);
    t.service("self", nodeport("self", 42, 30085));
    t.endpoints("self", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 43, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.start_agent_with(&["--packet-lb-devices", "podh"]);
    assert_eq!(svc_programs(&t.node1, "podh"), (1, 1));

    for (to, udp_to) in [
        (sa("10.96.0.41", 80), sa("10.96.0.41", 53)),
        (sa("fd00:96::41", 80), sa("fd00:96::41", 53)),
    ] {
        let want = Answer {
            backend: "pod2".into(),
            saw: if to.is_ipv4() { ip(POD1) } else { ip(POD1_6) },
        };
        let got = answered(&t.pod1, &format!("TCP to {to}"), move || {
            tcp_once(to, ANSWER)
        });
        assert_eq!(got, want, "pod1 -> {to}");
        let got = answered(&t.pod1, &format!("UDP to {udp_to}"), move || {
            udp_once(udp_to, ANSWER)
        });
        assert_eq!(got, want, "pod1 -> {udp_to}");
    }

    let to = sa(NODE1, 30085);
    let got = answered(&t.pod1, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!(got.backend, "pod1", "hairpin: {got:?}");
    assert_ne!(
        got.saw,
        ip(POD1),
        "hairpin: the pod must not see itself as the client"
    );

    let report: svc_tests::Report = svc_tests::ClientRun::spawn(
        &t.tools.probe,
        &t.cgroup,
        &t.node1,
        &["tcp".into(), "--to".into(), sa(NODE1, 30082).to_string()],
    )
    .expect("probe on node 1")
    .wait(Duration::from_secs(20))
    .expect("probe report");
    assert!(report.all_ok(), "{report:?}");
    let a = &report.results[0];
    assert_eq!(a.peer.as_deref(), Some("10.77.0.1:30082"), "{a:?}");
    assert_eq!(a.backend.as_deref(), Some("pod2"), "{a:?}");

    // A pod inside the cgroup reaching a NodePort that selects itself (hairpin): the socket
    // hooks send it to its own address, and it answers itself.
    let report: svc_tests::Report = svc_tests::ClientRun::spawn(
        &t.tools.probe,
        &t.cgroup,
        &t.pod1,
        &["tcp".into(), "--to".into(), sa(NODE1, 30085).to_string()],
    )
    .expect("probe in pod1")
    .wait(Duration::from_secs(20))
    .expect("probe report");
    assert!(report.all_ok(), "{report:?}");
    let a = &report.results[0];
    assert_eq!(a.peer.as_deref(), Some("10.77.0.1:30085"), "{a:?}");
    assert_eq!(a.backend.as_deref(), Some("pod1"), "{a:?}");
    assert_eq!(a.source.as_deref(), Some("10.244.1.2"), "{a:?}");
}

/// kube-proxy's conntrack timeout flags set the idle timeouts of svc's flows. With
/// `--conntrack-tcp-timeout-established=2s`, an established NodePort connection (to the remote
/// backend: DNAT and SNAT) idle for longer is forgotten, and its next segment, which no flow
/// knows, is the node's own: reset, as under kube-proxy once conntrack forgets it. By default
/// (kube-proxy's 24h) one idle as long carries on. A value kube-proxy would refuse is refused,
/// naming the flag.
/// Idle timeouts as `svc-agent list` shows them, seconds.
fn timeouts(
    tcp: u32,
    close_wait: u32,
    udp: u32,
    udp_stream: u32,
) -> svc_tests::agent::ListCtTimeouts {
    svc_tests::agent::ListCtTimeouts {
        tcp_established_s: tcp,
        tcp_close_wait_s: close_wait,
        udp_s: udp,
        udp_stream_s: udp_stream,
    }
}

#[test]
fn conntrack_timeouts_follow_kube_proxys_flags() {
    let mut t = Topo::new();
    t.service("web", nodeport("web", 44, 30086));
    t.endpoints("web", &[REMOTE_POD]);
    let to = sa(NODE1, 30086);
    let idle = Duration::from_millis(4500);
    let connect = |t: &Topo| {
        in_ns(&t.client, move || {
            TcpStream::connect_timeout(&to, ANSWER).expect("connecting")
        })
    };
    let via_node = Answer {
        backend: "pod2".into(),
        saw: ip(NODE1),
    };

    t.start_agent_with(&[
        "--conntrack-tcp-timeout-established",
        "2s",
        "--conntrack-udp-timeout-stream=1m30s",
    ]);
    assert_eq!(
        t.agent().list().expect("svc-agent list").ct_timeouts,
        timeouts(2, 3_600, 30, 90)
    );
    let c = connect(&t);
    assert_eq!(exchange(&c).expect("first exchange"), via_node);
    std::thread::sleep(idle);
    let after = exchange(&c);
    let reset = matches!(&after, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset);
    assert!(
        reset,
        "idle past --conntrack-tcp-timeout-established, the flow is forgotten and the node \
         resets its next segment: {after:?}"
    );
    t.agent = None;

    t.start_agent();
    assert_eq!(
        t.agent().list().expect("svc-agent list").ct_timeouts,
        timeouts(86_400, 3_600, 30, 120)
    );
    let c = connect(&t);
    assert_eq!(exchange(&c).expect("first exchange"), via_node);
    std::thread::sleep(idle);
    assert_eq!(
        exchange(&c).expect("idle for less than the default 24h: the flow carries on"),
        via_node
    );

    for (flag, value) in [
        ("--conntrack-tcp-timeout-established", "5"),
        ("--conntrack-udp-timeout", "-30s"),
        ("--conntrack-tcp-timeout-close-wait", "1d"),
    ] {
        let out = std::process::Command::new(&t.tools.agent)
            .args(["devices".to_string(), format!("{flag}={value}")])
            .output()
            .expect("running svc-agent devices");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(flag),
            "{flag} {value}: {err}"
        );
    }
}

/// A value of node 1's /metrics (the agent's `--metrics-bind-address 127.0.0.1:10249`).
fn metric(t: &Topo, line: &str) -> u64 {
    let (status, metrics) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/metrics").expect("GET /metrics")
    });
    assert_eq!(status, 200);
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line} in /metrics:\n{metrics}"))
}

/// Dead flows are swept from connection tracking, and short flows do not push live ones out:
/// an idle TCP connection through a NodePort lives on while twice the table's room of short
/// UDP flows come and die around it, with the sweep or without it
/// (`--conntrack-sweep-interval=0`): those flows are unassured and turn over a table of their
/// own.
#[test]
fn a_live_idle_flow_outlives_a_table_turned_over_by_dead_ones() {
    let mut t = Topo::new();
    t.service("web", nodeport("web", 45, 30087));
    t.endpoints("web", &[LOCAL_POD]);
    const ROOM: u32 = 1024;
    let (tcp_to, udp_to) = (sa(NODE1, 30087), sa(NODE1, 30087));
    let via = || Answer {
        backend: "pod1".into(),
        saw: ip(CLIENT),
    };
    // The connection and the churn are sent from one CPU, so the node's ingress makes every
    // entry there. The LRU keeps a CPU's new entries on a list of its own until that CPU
    // next needs room: entries made on a CPU that makes no more would never be evicted, and
    // the per-CPU free lists (up to 128 entries each) take one CPU's share of the room, not
    // every possible CPU's.
    fn on_one_cpu() {
        // SAFETY: CPU sets of the size given, for this thread alone.
        let r = unsafe {
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let mut allowed: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(libc::sched_getaffinity(0, size, &mut allowed), 0);
            // The first CPU this test may run on (CPU 0 unless a cpuset leaves it out).
            let first = (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &allowed))
                .expect("a CPU to run on");
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(first, &mut set);
            libc::sched_setaffinity(0, size, &set)
        };
        assert_eq!(
            r,
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
    }
    // Twice the room in UDP flows, each from a port of its own, dead 1 s after its reply. At
    // 80 a second the live ones (flows of the last ~2 s: timeout, sweep interval) hold at most
    // about 340 entries: with a free list's 128, well within the room.
    let churn = |t: &Topo| {
        in_ns(&t.client, move || {
            on_one_cpu();
            // Each failure with when and how it failed: no answer in time (EAGAIN: the
            // request or its reply lost), a reply from the backend's own address (the reply
            // not translated back) and an answer from another backend are different faults.
            let begun = Instant::now();
            let mut failed = Vec::new();
            for i in 0..ROOM {
                let start = Instant::now();
                if let Err(e) = udp_once(udp_to, ANSWER) {
                    failed.push(format!(
                        "flow {i} at {:.3} s: {e}",
                        start.duration_since(begun).as_secs_f64()
                    ));
                }
                std::thread::sleep(Duration::from_millis(12).saturating_sub(start.elapsed()));
            }
            failed
        })
    };
    let connect = |t: &Topo| {
        in_ns(&t.client, move || {
            on_one_cpu();
            let c = TcpStream::connect_timeout(&tcp_to, ANSWER).expect("connecting");
            assert_eq!(exchange(&c).expect("first exchange"), via());
            c
        })
    };
    let room = ROOM.to_string();
    let flags = |sweep: &'static str| {
        vec![
            "--metrics-bind-address".to_string(),
            "127.0.0.1:10249".into(),
            "--max-ct".into(),
            room.clone(),
            "--conntrack-udp-timeout=1s".into(),
            "--conntrack-udp-timeout-stream=1s".into(),
            format!("--conntrack-sweep-interval={sweep}"),
        ]
    };

    // Without the sweep: the churn's flows (a request and its reply each, never a stream)
    // stay unassured and turn over a table of their own; the assured connection is in one
    // that nothing evicts. (Before the two tables, it was what the LRU gave up.)
    let f = flags("0");
    t.start_agent_with(&f.iter().map(String::as_str).collect::<Vec<_>>());
    let c = connect(&t);
    assert_eq!(churn(&t), Vec::<String>::new(), "every UDP flow answered");
    assert_eq!(
        exchange(&c).expect("without the sweep, the unassured flows go, not the connection"),
        via()
    );
    assert_eq!(metric(&t, "svc_conntrack_sweeps_total"), 0);
    drop(c);
    t.agent = None;

    // With it (every second): the same churn, and the connection carries on.
    let f = flags("1s");
    t.start_agent_with(&f.iter().map(String::as_str).collect::<Vec<_>>());
    let c = connect(&t);
    assert_eq!(churn(&t), Vec::<String>::new(), "every UDP flow answered");
    assert_eq!(
        exchange(&c).expect("the idle flow outlives the dead ones"),
        via()
    );
    // Dead flows of the previous agent and of this one, both entries of each: more than the
    // unassured table holds, so the sweep, not only its LRU, removed them (the LRU evicts
    // some of the dead ones first once the table is full).
    let swept = metric(&t, "svc_conntrack_swept_entries_total");
    let unassured_room = u64::from(svc_common::capacity::ct_new(ROOM));
    assert!(swept > unassured_room, "swept {swept} entries");
    assert!(metric(&t, "svc_conntrack_sweeps_total") >= 5);
}

/// Localhost NodePorts, as kube-proxy's iptables mode serves them (`--nodeport-addresses`
/// covering 127.0.0.0/8, `--iptables-localhost-nodeports`): a process of node 1 reaches a
/// NodePort on 127.0.0.1 over TCP and UDP, and sees 127.0.0.1:NodePort as its peer; IPv6
/// loopback never answers; a pod's loopback stays its own (pod 1 reaches what listens on its
/// own 127.0.0.1 at that port); the default (`primary`) and `--localhost-nodeports=false`
/// leave loopback alone.
#[test]
fn localhost_node_ports_answer_the_nodes_own_sockets_only() {
    let mut t = Topo::new();
    t.service("remote", nodeport("remote", 43, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    // What pod 1 runs on its own loopback at the NodePort's number.
    let _own = Echo::start(&t.pod1, "pod1-loopback", &["127.0.0.1"], 30082, 30082);
    let probe = |t: &Topo, ns: &NetNs, args: &[&str]| -> svc_tests::Report {
        svc_tests::ClientRun::spawn(
            &t.tools.probe,
            &t.cgroup,
            ns,
            &args.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        )
        .expect("probe")
        .wait(Duration::from_secs(20))
        .expect("probe report")
    };
    let refused = |r: &svc_tests::Report, what: &str| {
        assert!(
            !r.results.is_empty() && r.results.iter().all(|a| !a.ok),
            "{what}: nothing listens there, the agent must not answer: {r:?}"
        );
    };

    t.start_agent();
    let r = probe(&t, &t.node1, &["tcp", "--to", "127.0.0.1:30082"]);
    refused(&r, "default --nodeport-addresses (primary)");
    t.agent = None;

    t.start_agent_with(&["--nodeport-addresses", "primary,localhost"]);
    let r = probe(&t, &t.node1, &["tcp", "--to", "127.0.0.1:30082"]);
    assert!(r.all_ok(), "{r:?}");
    let a = &r.results[0];
    assert_eq!(a.backend.as_deref(), Some("pod2"), "{a:?}");
    assert_eq!(a.peer.as_deref(), Some("127.0.0.1:30082"), "{a:?}");
    let r = probe(&t, &t.node1, &["udp", "--to", "127.0.0.1:30082"]);
    assert!(r.all_ok(), "{r:?}");
    let a = &r.results[0];
    assert_eq!(a.backend.as_deref(), Some("pod2"), "{a:?}");
    assert_eq!(a.from.as_deref(), Some("127.0.0.1:30082"), "{a:?}");
    let r = probe(&t, &t.pod1, &["tcp", "--to", "127.0.0.1:30082"]);
    assert!(r.all_ok(), "{r:?}");
    assert_eq!(
        r.results[0].backend.as_deref(),
        Some("pod1-loopback"),
        "a pod's loopback is its own: {r:?}"
    );
    let r = probe(&t, &t.node1, &["tcp", "--to", "[::1]:30082"]);
    refused(&r, "IPv6 loopback");
    // `localhost` names lo's addresses, as kube-proxy's rule per node IP: 127.0.0.2 is local
    // but none of them.
    let r = probe(&t, &t.node1, &["tcp", "--to", "127.0.0.2:30082"]);
    refused(
        &r,
        "a loopback address lo does not carry, under `localhost`",
    );
    // The node address itself answers as before, from the node and from pods.
    let r = probe(
        &t,
        &t.node1,
        &["tcp", "--to", &sa(NODE1, 30082).to_string()],
    );
    assert!(r.all_ok(), "{r:?}");
    let listing = t.agent().list().expect("svc-agent list");
    let lo: Vec<_> = listing
        .node_addresses
        .iter()
        .filter(|a| a.address.starts_with("127.") || a.address == "::1")
        .collect();
    assert!(
        matches!(lo[..], [a] if a.address == "127.0.0.1" && a.localhost_nodeport && !a.nodeport),
        "{listing:?}"
    );
    t.agent = None;

    // Every IPv4 address chosen (`all`): kube-proxy's rule matches any local destination,
    // all of 127.0.0.0/8.
    t.start_agent_with(&["--nodeport-addresses", "all"]);
    let r = probe(&t, &t.node1, &["tcp", "--to", "127.0.0.2:30082"]);
    assert!(r.all_ok(), "{r:?}");
    assert_eq!(r.results[0].backend.as_deref(), Some("pod2"), "{r:?}");
    assert_eq!(
        r.results[0].peer.as_deref(),
        Some("127.0.0.2:30082"),
        "{r:?}"
    );
    let r = probe(&t, &t.pod1, &["tcp", "--to", "127.0.0.1:30082"]);
    assert_eq!(
        r.results[0].backend.as_deref(),
        Some("pod1-loopback"),
        "{r:?}"
    );
    t.agent = None;

    t.start_agent_with(&[
        "--nodeport-addresses",
        "primary,localhost",
        "--localhost-nodeports=false",
    ]);
    let r = probe(&t, &t.node1, &["tcp", "--to", "127.0.0.1:30082"]);
    refused(&r, "--localhost-nodeports=false");
    // The address the previous run wrote lingers only while a flow might go to it (none
    // does), then leaves SVC_NODE_ADDRS.
    let gone = poll(Duration::from_secs(15), || {
        let l = t.agent().list()?;
        let lo = |a: &str| a.starts_with("127.");
        let left = l.node_addresses.iter().any(|a| lo(&a.address))
            || l.lingering_addresses.iter().any(|a| lo(a));
        Ok((!left).then_some(()))
    });
    gone.expect("127.0.0.1 leaves SVC_NODE_ADDRS once localhost NodePorts are off");
}

/// The node's part of the packet datapath's state (SVC_NODE_ADDRS: the node's addresses,
/// the ExternalIPs', and those that linger for flows) is written as it changes, a handful of
/// entries one after the other. An agent SIGKILLed between two of them (a pause after each
/// write, `SVC_TEST_NODE_WRITE_PAUSE_MS`, widens the window; the kill comes once the first
/// write of a change has landed) while a node address comes or goes and an ExternalIP moves,
/// and sometimes killed again during its successor's first sync, leaves the next agent
/// something to repair: after each restart the map holds exactly the node addresses
/// `svc-agent devices` names, with their flags, and the ExternalIP where it is now, and
/// nothing else but lingering entries for the addresses this test used. SVC_CONFIG is one
/// entry, written whole; each run has settings of its own, and after its restart they are
/// the ones in effect. NodePorts, on the added address too, and the ExternalIP answer.
/// `SVC_NODE_CRASH_SEED` replays the kill delays.
#[test]
fn node_addresses_and_settings_are_exact_after_kills_while_they_change() {
    // `KILLS` kills, and more until `DAMAGED` of them left the node's state mid-change, at
    // most `MAX_KILLS`: whether a kill lands among the writes is chance, and eight kills gave
    // only three such in one CI run (2026-12-07).
    const KILLS: u32 = 8;
    const DAMAGED: u32 = 4;
    const MAX_KILLS: u32 = 24;
    const PAUSE_MS: u64 = 150;
    const SECONDARY: &str = "10.77.0.50";
    const EXT: [&str; 2] = ["10.77.100.61", "10.77.100.62"];
    let mut rng = svc_tests::rng::Rng::from_env("SVC_NODE_CRASH_SEED");
    eprintln!("SVC_NODE_CRASH_SEED={}", rng.0);
    let mut t = Topo::new();
    t.service("np", nodeport("np", 53, 30093));
    t.endpoints("np", &[LOCAL_POD]);
    let ext = |k: u32| {
        service(
            "ext",
            "ClusterIP",
            54,
            0,
            json!({"externalIPs": [EXT[(k % 2) as usize]]}),
            json!({}),
        )
    };
    t.service("ext", ext(0));
    t.endpoints("ext", &[LOCAL_POD]);
    // Each run's own settings, so a run that kept its predecessor's would show.
    let flags = |k: u32| -> Vec<String> {
        vec![
            "--nodeport-addresses".into(),
            "10.77.0.0/24".into(),
            format!("--conntrack-tcp-timeout-established={}s", 3600 + k),
            "--snat-port-range".into(),
            format!("61000-{}", 62000 + k),
        ]
    };
    // What `svc-agent devices` says of node 1 with these flags, as SVC_NODE_ADDRS flags.
    let node_addrs = |t: &Topo, k: u32| -> BTreeMap<IpAddr, u32> {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", t.node1.path().display()))
            .arg(&t.tools.agent)
            .args(["devices", "--devices", "eth0"])
            .args(flags(k))
            .output()
            .expect("svc-agent devices");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("devices JSON");
        let listed: Vec<svc_tests::agent::ListNodeAddr> =
            serde_json::from_value(v["node_addresses"].clone()).expect("node_addresses");
        listed
            .iter()
            .map(|a| (ip(&a.address), listed_flags(a)))
            .collect()
    };
    let want = |t: &Topo, k: u32| {
        let mut w = node_addrs(t, k);
        *w.entry(ip(EXT[(k % 2) as usize])).or_default() |= node_addr_flags::EXTERNAL;
        w
    };
    // SVC_NODE_ADDRS as pinned, by address; lingering entries apart.
    let pinned = |t: &Topo| -> (BTreeMap<IpAddr, u32>, BTreeSet<IpAddr>) {
        use svc_agent::store::Store as _;
        let snap = svc_agent::datapath::open_pinned(t.bpffs.path())
            .and_then(|s| s.snapshot())
            .expect("reading the pinned maps");
        let mut live = BTreeMap::new();
        let mut lingering = BTreeSet::new();
        for (k, v) in &snap.node_addrs {
            let a = IpAddr::from(*k).to_canonical();
            if v.flags == node_addr_flags::LINGER {
                lingering.insert(a);
            } else {
                live.insert(a, v.flags);
            }
        }
        (live, lingering)
    };
    let pause = vec![format!("SVC_TEST_NODE_WRITE_PAUSE_MS={PAUSE_MS}")];
    let f0 = flags(0);
    t.start_agent_with(&args(&f0));
    assert_eq!(pinned(&t).0, want(&t, 0), "the first agent's state");

    let mut damaged = 0;
    let mut kills = 0;
    for k in 1..=MAX_KILLS {
        if k > KILLS && damaged >= DAMAGED {
            break;
        }
        kills = k;
        // The agent that will be killed pauses after each write of the node's state.
        let fk = flags(k - 1);
        t.agent = None;
        t.agent_env = pause.clone();
        t.start_agent_with(&args(&fk));
        let before = want(&t, k - 1);
        if k % 2 == 1 {
            t.node1
                .add_addr("eth0", &format!("{SECONDARY}/24"))
                .unwrap();
        } else {
            t.node1
                .ip(["addr", "del", &format!("{SECONDARY}/24"), "dev", "eth0"])
                .unwrap();
        }
        t.service("ext", ext(k));
        // Its writes, each followed by the pause: the address (once the node settles), the
        // new ExternalIP, the old one lingering (once the manifest poll sees the change). The
        // kill comes among them, timed from the first.
        poll(Duration::from_secs(10), || {
            Ok((pinned(&t).0 != before).then_some(()))
        })
        .expect("the change reaches SVC_NODE_ADDRS");
        std::thread::sleep(rng.below(Duration::from_millis(2 * PAUSE_MS)));
        t.agent().kill().expect("SIGKILL");
        if rng.next_u64().is_multiple_of(3) {
            // Its successor killed during its own first sync, the pause slowing it too.
            t.launch_agent(&args(&flags(k)));
            std::thread::sleep(rng.below(Duration::from_millis(1500)));
            t.agent().kill().expect("SIGKILL");
        }
        t.agent_env.clear();
        let after = want(&t, k);
        let (left, _) = pinned(&t);
        if left != before && left != after {
            damaged += 1;
        }
        let fk = flags(k);
        t.agent = None;
        t.start_agent_with(&args(&fk));
        let exact = poll(Duration::from_secs(10), || {
            let (live, lingering) = pinned(&t);
            let l = t.agent().list()?;
            let stray: Vec<_> = lingering
                .iter()
                .filter(|a| **a != ip(SECONDARY) && !EXT.iter().any(|e| ip(e) == **a))
                .collect();
            if live == after
                && stray.is_empty()
                && l.ct_timeouts.tcp_established_s == 3600 + k
                && l.snat_ports == format!("61000-{}", 62000 + k)
            {
                return Ok(Some(()));
            }
            anyhow::bail!(
                "SVC_NODE_ADDRS {live:?} (lingering {lingering:?}), want {after:?}; \
                 timeouts {:?}, SNAT ports {}",
                l.ct_timeouts,
                l.snat_ports
            )
        });
        if let Err(e) = exact {
            panic!(
                "after kill {k} (SVC_NODE_CRASH_SEED replays it): {e:#}\n{}",
                t.agent().all_logs()
            );
        }
        let mut at = vec![
            (sa(NODE1, 30093), "NodePort"),
            (sa(EXT[(k % 2) as usize], 80), "ExternalIP"),
        ];
        if k % 2 == 1 {
            at.push((sa(SECONDARY, 30093), "NodePort on the added address"));
        }
        for (to, what) in at {
            let a = answered(
                &t.client,
                &format!("{what} {to} after kill {k}"),
                move || tcp_once(to, ANSWER),
            );
            assert_eq!(a.backend, "pod1", "{what} after kill {k}: {a:?}");
        }
    }
    eprintln!("{damaged} of {kills} kills left the node's state mid-change");
    // Kills that only ever hit an agent at rest would prove nothing.
    assert!(
        damaged >= DAMAGED,
        "only {damaged} of {kills} kills left damage to repair"
    );
}

/// Owned arguments as `Topo::start_agent_with` takes them.
fn args(f: &[String]) -> Vec<&str> {
    f.iter().map(String::as_str).collect()
}

/// `svc-agent list`'s view of a node address as SVC_NODE_ADDRS flags.
fn listed_flags(a: &svc_tests::agent::ListNodeAddr) -> u32 {
    let mut f = 0;
    if a.nodeport {
        f |= node_addr_flags::NODEPORT;
    }
    if a.snat {
        f |= node_addr_flags::SNAT;
    }
    if a.localhost_nodeport {
        f |= node_addr_flags::LOCALHOST;
    }
    f
}

/// Forwards TCP connections made in `ns` to `at` (127.0.0.1:port there) to the same address
/// in this process's own namespace: how an agent inside node 1 reaches the test's
/// kube-apiserver on the host's loopback (the kubeconfig stays as it is, TLS passes through).
struct LoopbackForward {
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl LoopbackForward {
    fn start(ns: &NetNs, at: SocketAddr) -> LoopbackForward {
        let listener = in_ns(ns, move || {
            let l = TcpListener::bind(at).unwrap_or_else(|e| panic!("binding {at}: {e}"));
            l.set_nonblocking(true).unwrap();
            l
        });
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        // This thread, and those it starts, stay in the test's own namespace: they connect
        // to the real apiserver.
        let accept = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let Ok((inside, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = inside.set_nonblocking(false);
                let Ok(outside) = TcpStream::connect(at) else {
                    continue;
                };
                let (Ok(a), Ok(b)) = (inside.try_clone(), outside.try_clone()) else {
                    continue;
                };
                // Each direction copies until its source closes, then closes its sink: the
                // threads end with the agent's or the apiserver's connection.
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut &inside, &mut &outside);
                    let _ = outside.shutdown(Shutdown::Both);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut &b, &mut &a);
                    let _ = a.shutdown(Shutdown::Both);
                });
            }
        });
        LoopbackForward {
            stop,
            accept: Some(accept),
        }
    }
}

impl Drop for LoopbackForward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Against a real kube-apiserver (`SVC_KUBE_APISERVER`, `SVC_KUBECTL`, `SVC_ETCD`, as `cargo
/// xtask test` sets them): a NodePort Service on the ports the API server allocated and a
/// LoadBalancer Service whose status.loadBalancer the test writes (as a cloud controller
/// would) are reachable from the external client; node 1's addresses come from its Node.
#[test]
fn kube_api_nodeport_and_load_balancer() {
    let mut t = Topo::new();
    let cp = svc_tests::control_plane::ControlPlane::start().expect("control plane");
    let apiserver: SocketAddr = cp
        .server_url()
        .trim_start_matches("https://")
        .parse()
        .expect("apiserver address");
    let _forward = LoopbackForward::start(&t.node1, apiserver);

    let apply = |objects: &[Value]| {
        let yaml: Vec<String> = objects.iter().map(Value::to_string).collect();
        cp.apply_yaml(&yaml.join("\n---\n")).expect("kubectl apply")
    };
    apply(&[
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}}),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}}),
    ]);
    cp.kubectl(&[
        "patch",
        "node",
        "node-1",
        "--subresource=status",
        "--type=merge",
        "-p",
        &json!({"status": {"addresses": [
            {"type": "InternalIP", "address": NODE1},
            {"type": "InternalIP", "address": NODE1_6},
        ]}})
        .to_string(),
    ])
    .expect("Node addresses");
    let svc = |name: &str, kind: &str| {
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": "demo"},
            "spec": {
                "type": kind,
                "selector": {"app": name},
                "ports": [
                    {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
                ],
            },
        })
    };
    let slice = |service: &str, pod: &str, node: &str| {
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{service}-1"),
                "namespace": "demo",
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "ports": [
                {"name": "http", "port": 8080, "protocol": "TCP"},
                {"name": "dns", "port": 5353, "protocol": "UDP"},
            ],
            "endpoints": [{
                "addresses": [pod],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node,
            }],
        })
    };
    let stored = apply(&[
        svc("np", "NodePort"),
        slice("np", POD2, "node-2"),
        svc("lb", "LoadBalancer"),
        slice("lb", POD1, "node-1"),
    ]);
    let node_ports = |name: &str| -> (u16, u16) {
        let s = stored
            .iter()
            .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == name)
            .expect("stored Service");
        let port = |i: usize| {
            s["spec"]["ports"][i]["nodePort"]
                .as_u64()
                .expect("nodePort") as u16
        };
        (port(0), port(1))
    };
    let (np_tcp, np_udp) = node_ports("np");
    let (lb_tcp, _) = node_ports("lb");
    cp.kubectl(&[
        "patch",
        "service",
        "lb",
        "-n",
        "demo",
        "--subresource=status",
        "--type=merge",
        "-p",
        &json!({"status": {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}}).to_string(),
    ])
    .expect("LoadBalancer status");

    let kubeconfig = cp.kubeconfig_path().to_path_buf();
    t.start_agent_from(["--kubeconfig".into(), kubeconfig.into()], &[]);

    let remote = Answer {
        backend: "pod2".into(),
        saw: ip(NODE1),
    };
    let local = Answer {
        backend: "pod1".into(),
        saw: ip(CLIENT),
    };
    let to = sa(NODE1, np_tcp);
    let got = answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!(got, remote, "NodePort {to}");
    let to = sa(NODE1, np_udp);
    let got = answered(&t.client, &format!("UDP to {to}"), move || {
        udp_once(to, ANSWER)
    });
    assert_eq!(got, remote, "NodePort {to}");
    let to = sa(LB_IP, 80);
    let got = answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!(got, local, "LoadBalancer IP {to}");
    let to = sa(LB_IP, 53);
    let got = answered(&t.client, &format!("UDP to {to}"), move || {
        udp_once(to, ANSWER)
    });
    assert_eq!(got, local, "LoadBalancer IP {to}");
    let to = sa(NODE1, lb_tcp);
    let got = answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!(got, local, "the LoadBalancer's NodePort {to}");
    // The agent stops before the control plane does (locals drop in reverse order).
    t.agent = None;
}

/// Path MTU discovery through a NodePort: the link from node 2 to its pod is narrower (1280)
/// than the rest, so node 2 answers the client's full-size segments, which reach it SNATed,
/// with ICMP fragmentation needed / ICMPv6 packet too big addressed to node 1. Node 1 must
/// translate those back to the client (from the NodePort's address, about the client's own
/// flow) or the client never shrinks its segments and a large request stalls.
#[test]
fn path_mtu_discovery_through_a_nodeport() {
    let mut t = Topo::new();
    t.service("remote", nodeport("remote", 51, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.node2
        .ip(["link", "set", "podh", "mtu", "1280"])
        .expect("narrowing node 2's pod link");
    t.start_agent();
    for node in [NODE1, NODE1_6] {
        let to = sa(node, 30082);
        answered(&t.client, &format!("TCP to {to}"), move || {
            tcp_once(to, ANSWER)
        });
        let got = in_ns(&t.client, move || -> std::io::Result<Answer> {
            let c = TcpStream::connect_timeout(&to, ANSWER)?;
            c.set_read_timeout(Some(Duration::from_secs(10)))?;
            // Far more than one segment: most of them full-size.
            let mut request = vec![b'a'; 64 * 1024];
            request.push(b'\n');
            (&c).write_all(&request)?;
            let mut line = String::new();
            BufReader::new(&c).read_line(&mut line)?;
            parse_answer(&line)
        });
        let got = got.unwrap_or_else(|e| panic!("a 64 KiB request to {to}: {e}"));
        assert_eq!(got.backend, "pod2", "{to}");
        // The client learned the narrower path to the NodePort's address.
        let route = t.client.ip(["route", "get", node]).expect("ip route get");
        assert!(route.contains("mtu 1280"), "{node}: {route}");
    }
}

/// One exchange of a `size`-byte datagram with `to` from `s`: the answer must come from `to`
/// and be `size` bytes long too.
fn udp_sized(s: &UdpSocket, to: SocketAddr, size: usize) -> std::io::Result<Answer> {
    s.send_to(&vec![b'x'; size], to)?;
    let mut buf = vec![0u8; 65536];
    let (n, from) = s.recv_from(&mut buf)?;
    if from != to || n != size {
        return Err(std::io::Error::other(format!(
            "{n} bytes from {from}, not {size} from {to}"
        )));
    }
    parse_answer(&String::from_utf8_lossy(&buf[..n]))
}

/// `udp_sized` from a socket of its own.
fn udp_sized_once(to: SocketAddr, size: usize, timeout: Duration) -> std::io::Result<Answer> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let s = UdpSocket::bind(any)?;
    s.set_read_timeout(Some(timeout))?;
    udp_sized(&s, to, size)
}

/// 3,000-byte UDP requests and replies, above every link's MTU (1,500): the client sends its
/// request in fragments, the backend its reply, and node 1 (which reassembles nothing) must
/// translate every fragment, not the first alone, or the datagram is never completed. Through
/// a NodePort to a backend on node 1 (DNAT only; the reply translated leaving eth0) and to one
/// on node 2 (SNATed and routed both ways by the programs), IPv4 and IPv6; a small datagram of
/// the same flow works before and after.
#[test]
fn fragmented_udp_through_a_nodeport() {
    let mut t = Topo::new();
    t.service("fraglocal", nodeport("fraglocal", 71, 30071));
    t.endpoints("fraglocal", &[LOCAL_POD]);
    t.service("fragremote", nodeport("fragremote", 72, 30072));
    t.endpoints("fragremote", &[REMOTE_POD]);
    t.start_agent();
    let mut failures = Vec::new();
    for node in [NODE1, NODE1_6] {
        for (port, backend) in [(30071, "pod1"), (30072, "pod2")] {
            let to = sa(node, port);
            answered(&t.client, &format!("UDP to {to}"), move || {
                udp_once(to, ANSWER)
            });
            let got = in_ns(&t.client, move || udp_sized_once(to, 3000, ANSWER));
            match got {
                Ok(a) if a.backend == backend => {}
                other => failures.push(format!("3,000 bytes to {to}: {other:?}")),
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// An ICMP fragmentation needed (IPv4, MTU 576) or packet too big (IPv6, MTU 1280), forged by
/// a third party (client 2) about a client's UDP flow through a NodePort: svc translates it
/// for the backend (as it must, for real path MTU discovery), whose kernel then fragments
/// its replies to the client for the next 10 minutes. The flow must go on: its 1,400-byte
/// replies now come in fragments, and node 1 translates each.
#[test]
fn a_forged_path_mtu_error_does_not_stop_a_udp_flow() {
    let mut t = Topo::new();
    t.service("pmtu", nodeport("pmtu", 73, 30073));
    t.endpoints("pmtu", &[LOCAL_POD]);
    t.start_agent();
    for (node, client, pod) in [(NODE1, CLIENT, POD1), (NODE1_6, CLIENT6, POD1_6)] {
        let to = sa(node, 30073);
        answered(&t.client, &format!("UDP to {to}"), move || {
            udp_once(to, ANSWER)
        });
        let s = in_ns(&t.client, move || {
            let any = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let s = UdpSocket::bind(any.parse::<SocketAddr>().unwrap()).expect("bind");
            s.set_read_timeout(Some(ANSWER)).unwrap();
            s
        });
        let got = udp_sized(&s, to, 1400).unwrap_or_else(|e| panic!("before, {to}: {e}"));
        assert_eq!(got.backend, "pod1");
        let cport = s.local_addr().expect("local address").port();
        in_ns(&t.client2, move || forge_mtu_error(to, sa(client, cport)))
            .unwrap_or_else(|e| panic!("sending the forged error: {e}"));
        // The backend took it: its route to the client now has the small MTU.
        let want = if to.is_ipv4() { "mtu 576" } else { "mtu 1280" };
        poll(Duration::from_secs(5), || {
            let route = t.pod1.ip(["route", "get", client])?;
            Ok(route.contains(want).then_some(()))
        })
        .unwrap_or_else(|e| panic!("{pod}'s route to {client} never got {want}: {e:#}"));
        let mut answers = 0;
        for _ in 0..3 {
            match udp_sized(&s, to, 1400) {
                Ok(a) if a.backend == "pod1" => answers += 1,
                _ => {}
            }
        }
        assert_eq!(
            answers, 3,
            "1,400-byte exchanges with {to} after the forged error"
        );
    }
}

/// Sends from this namespace to the NodePort address of `frontend` an ICMP fragmentation
/// needed (MTU 576) / ICMPv6 packet too big (MTU 1280) quoting the flow's reply, as it left
/// node 1: from `frontend` to `client`, 1,400 bytes of UDP.
fn forge_mtu_error(frontend: SocketAddr, client: SocketAddr) -> std::io::Result<()> {
    let udp_len: u16 = 1408;
    let mut quote = Vec::new();
    match (frontend.ip(), client.ip()) {
        (IpAddr::V4(f), IpAddr::V4(c)) => {
            let mut h = vec![0x45, 0];
            h.extend_from_slice(&(20 + udp_len).to_be_bytes());
            h.extend_from_slice(&[0, 0, 0x40, 0, 63, 17, 0, 0]);
            h.extend_from_slice(&f.octets());
            h.extend_from_slice(&c.octets());
            let c = inet_checksum(&h);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            quote.extend_from_slice(&h);
        }
        (IpAddr::V6(f), IpAddr::V6(c)) => {
            quote.extend_from_slice(&[0x60, 0, 0, 0]);
            quote.extend_from_slice(&udp_len.to_be_bytes());
            quote.extend_from_slice(&[17, 63]);
            quote.extend_from_slice(&f.octets());
            quote.extend_from_slice(&c.octets());
        }
        _ => return Err(std::io::Error::other("mixed families")),
    }
    quote.extend_from_slice(&frontend.port().to_be_bytes());
    quote.extend_from_slice(&client.port().to_be_bytes());
    quote.extend_from_slice(&udp_len.to_be_bytes());
    quote.extend_from_slice(&[0, 0]);
    let (domain, proto, mut msg) = if frontend.is_ipv4() {
        // Type 3 code 4, next-hop MTU 576.
        (
            libc::AF_INET,
            libc::IPPROTO_ICMP,
            vec![3, 4, 0, 0, 0, 0, 2, 64],
        )
    } else {
        // Type 2, MTU 1280; the kernel fills in an ICMPv6 raw socket's checksum.
        (
            libc::AF_INET6,
            libc::IPPROTO_ICMPV6,
            vec![2, 0, 0, 0, 0, 0, 5, 0],
        )
    };
    msg.extend_from_slice(&quote);
    if frontend.is_ipv4() {
        let c = inet_checksum(&msg);
        msg[2..4].copy_from_slice(&c.to_be_bytes());
    }
    // SAFETY: plain socket calls on a descriptor owned here; the buffers outlive them.
    unsafe {
        let fd = libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let sent = match frontend.ip() {
            IpAddr::V4(a) => {
                let mut sin: libc::sockaddr_in = std::mem::zeroed();
                sin.sin_family = libc::AF_INET as libc::sa_family_t;
                sin.sin_addr.s_addr = u32::from_ne_bytes(a.octets());
                libc::sendto(
                    fd.as_raw_fd(),
                    msg.as_ptr().cast(),
                    msg.len(),
                    0,
                    (&sin as *const libc::sockaddr_in).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            }
            IpAddr::V6(a) => {
                let mut sin6: libc::sockaddr_in6 = std::mem::zeroed();
                sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sin6.sin6_addr.s6_addr = a.octets();
                libc::sendto(
                    fd.as_raw_fd(),
                    msg.as_ptr().cast(),
                    msg.len(),
                    0,
                    (&sin6 as *const libc::sockaddr_in6).cast(),
                    std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                )
            }
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The Internet checksum (RFC 1071) of `b`.
fn inet_checksum(b: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in b.chunks(2) {
        sum += u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// What came back for a datagram sent with a given TTL: the backend's answer, or an ICMP
/// error (type, code, and the address that sent it).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Hop {
    Answered(String),
    Icmp(u8, u8, IpAddr),
}

/// One datagram to `to` from a connected socket with a TTL (IPv6: hop limit) of `hops` and
/// IP_RECVERR, as traceroute sends it: the answer, or the ICMP error the socket was given
/// about its own datagram (which the kernel matches to it by the tuple the error quotes).
fn udp_with_hops(to: SocketAddr, hops: u32, timeout: Duration) -> std::io::Result<Hop> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let s = UdpSocket::bind(any)?;
    s.connect(to)?;
    let fd = s.as_raw_fd();
    let (level, ttl_opt, recverr) = if to.is_ipv4() {
        (libc::SOL_IP, libc::IP_TTL, libc::IP_RECVERR)
    } else {
        (libc::SOL_IPV6, libc::IPV6_UNICAST_HOPS, libc::IPV6_RECVERR)
    };
    for (opt, value) in [(ttl_opt, hops as libc::c_int), (recverr, 1)] {
        // SAFETY: an int option of this socket.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    s.set_read_timeout(Some(timeout))?;
    s.send(b"x")?;
    let mut buf = [0u8; 512];
    let first = match s.recv(&mut buf) {
        Ok(n) => {
            return Ok(Hop::Answered(
                parse_answer(&String::from_utf8_lossy(&buf[..n]))?.backend,
            ))
        }
        Err(e) if is_timeout(&e) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("neither an answer nor an ICMP error within {timeout:?}"),
            ))
        }
        // The error the ICMP message set; its details wait in the error queue.
        Err(e) => e,
    };
    let mut control = [0u64; 64];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is valid; the buffers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg points at valid buffers.
    if unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) } < 0 {
        return Err(std::io::Error::other(format!(
            "recv: {first}, and nothing in the error queue: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: walking the control messages recvmsg wrote, within msg_controllen.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !c.is_null() {
        // SAFETY: c is a control message header within the buffer.
        let (cl, ct) = unsafe { ((*c).cmsg_level, (*c).cmsg_type) };
        if cl == level && ct == recverr {
            // SAFETY: IP(V6)_RECVERR data: a sock_extended_err, then the offender's sockaddr
            // (SO_EE_OFFENDER).
            let (ee, offender) = unsafe {
                let data = libc::CMSG_DATA(c);
                let ee = std::ptr::read_unaligned(data.cast::<libc::sock_extended_err>());
                let at = data.add(std::mem::size_of::<libc::sock_extended_err>());
                let from = if to.is_ipv4() {
                    let sin = std::ptr::read_unaligned(at.cast::<libc::sockaddr_in>());
                    IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
                } else {
                    let sin6 = std::ptr::read_unaligned(at.cast::<libc::sockaddr_in6>());
                    IpAddr::from(sin6.sin6_addr.s6_addr)
                };
                (ee, from)
            };
            let icmp = if to.is_ipv4() {
                libc::SO_EE_ORIGIN_ICMP
            } else {
                libc::SO_EE_ORIGIN_ICMP6
            };
            if ee.ee_origin != icmp {
                return Err(std::io::Error::other(format!(
                    "a local error, not an ICMP message: errno {}",
                    ee.ee_errno
                )));
            }
            return Ok(Hop::Icmp(ee.ee_type, ee.ee_code, offender));
        }
        // SAFETY: the next header within msg_controllen, or null.
        c = unsafe { libc::CMSG_NXTHDR(&msg, c) };
    }
    Err(std::io::Error::other(
        "an error without an extended error message",
    ))
}

/// traceroute through a NodePort shows the node: a datagram that reaches node 1 with a TTL
/// (IPv6: hop limit) of 1 is answered with an ICMP time exceeded (ICMPv6 type 3) from node
/// 1's address, about the client's own datagram, as a router answers. To the remote backend
/// svc forwards the datagram itself and answers it; to the local one it hands the datagram to
/// node 1's stack, whose forwarding answers, and the answer's quote is translated back to the
/// NodePort on its way out. With a TTL of 2 the local backend answers; the remote one is a hop
/// further, and node 2's time exceeded comes back translated from the NodePort's address, as
/// conntrack's NAT translates it behind kube-proxy; with 3 it answers.
#[test]
fn traceroute_through_a_nodeport_shows_the_node() {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.start_agent();
    for (node, time_exceeded) in [(NODE1, 11), (NODE1_6, 3)] {
        let from_node = Hop::Icmp(time_exceeded, 0, ip(node));
        let answer = |backend: &str| Hop::Answered(backend.into());
        for (port, hops) in [
            (30081, vec![from_node.clone(), answer("pod1")]),
            (
                30082,
                vec![from_node.clone(), from_node.clone(), answer("pod2")],
            ),
        ] {
            let to = sa(node, port);
            answered(&t.client, &format!("UDP to {to}"), move || {
                udp_once(to, ANSWER)
            });
            for (ttl, want) in (1..).zip(hops) {
                let got = in_ns(&t.client, move || udp_with_hops(to, ttl, ANSWER))
                    .unwrap_or_else(|e| panic!("UDP with TTL {ttl} to {to}: {e}"));
                assert_eq!(got, want, "UDP with TTL {ttl} to {to}");
            }
        }
    }
}

/// The agent follows devices as they come and go: a second uplink named by `--devices` that
/// appears after the agent started gets the programs (and serves NodePorts on its own
/// address, which `--nodeport-addresses` covers), and when it goes, the agent's link for it
/// goes too.
#[test]
fn devices_that_appear_and_disappear_are_followed() {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 61, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    // NodePorts on every node address in these ranges (kube-proxy's CIDR form), so also on
    // the new uplink's address; `primary` would be node 1's primary address only.
    t.start_agent_with(&[
        "--devices",
        "eth0,up*",
        "--nodeport-addresses",
        "10.77.0.0/16,10.78.0.0/16",
    ]);
    assert_eq!(t.node1_eth0_programs(), (1, 1));

    // A second uplink towards the client, on a network of its own.
    veth_pair(&t.client, "eth1", &t.node1, "up1").expect("second uplink");
    t.client.add_addr("eth1", "10.78.0.100/24").unwrap();
    t.node1.add_addr("up1", "10.78.0.1/24").unwrap();
    poll(Duration::from_secs(10), || {
        Ok((svc_programs(&t.node1, "up1") == (1, 1)).then_some(()))
    })
    .expect("the programs on the new device");
    let to = sa("10.78.0.1", 30081);
    let got = answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    assert_eq!(
        got,
        Answer {
            backend: "pod1".into(),
            saw: ip("10.78.0.100")
        }
    );

    t.node1
        .ip(["link", "del", "up1"])
        .expect("removing the uplink");
    // tcx links are pinned, per device; classic filters are not (they go with the device).
    if !classic_by_default() {
        let pin = t.bpffs.path().join("link_tc_tc_ext_ingress_up1");
        poll(
            Duration::from_secs(10),
            || Ok((!pin.exists()).then_some(())),
        )
        .expect("the link of the removed device unpinned");
        assert!(t.bpffs.path().join("link_tc_tc_ext_ingress_eth0").exists());
    }
    assert_eq!(t.node1_eth0_programs(), (1, 1));
}

// ---------------------------------------------------------------------------------------
// Attacks from outside: spoofed segments from client 2's namespace, with sources of the
// node network's own range that no namespace holds (the answers to them go nowhere).

/// Sends `segments` from client 2's namespace through a raw socket.
fn send_raw(t: &Topo, segments: Vec<svc_tests::raw::Segment>) {
    in_ns(&t.client2, move || {
        let sender = svc_tests::raw::Sender::new().expect("a raw socket");
        for s in &segments {
            sender.send(s).expect("sending a crafted segment");
        }
    });
}

/// An address of the node network no namespace holds.
fn spoofed(i: u32) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(10, 77, 0, 150 + (i % 100) as u8)
}

/// Spoofed SYNs to a NodePort whose backend is on node 2 each take a SNAT port, and the
/// backend answers each with a SYN-ACK that goes nowhere. Those flows stay unassured (the
/// SYN timeout, 60 s) and a real client's new flow takes their ports: with 10 SNAT ports, 200
/// spoofed SYNs do not keep 20 real connections out. Before, a SYN-ACK made a flow
/// established (24 h) and every real connection timed out.
#[test]
fn spoofed_syns_do_not_hold_a_remote_backends_snat_ports() {
    spoofed_syns_do_not_hold_snat_ports(Attach::Tcx);
}

/// The same with native XDP in front: the spoofed SYNs' flows are started at XDP (counted
/// `xdp_new`), with the ports and timeouts tc gives them.
#[test]
fn spoofed_syns_do_not_hold_a_remote_backends_snat_ports_at_xdp() {
    spoofed_syns_do_not_hold_snat_ports(Attach::Xdp);
}

/// The flags that put node 1's native XDP program in front when `attach` asks for it, with
/// /metrics to read its counters from, and the XDP_PASS program its peer needs.
fn flood_agent_flags(
    t: &Topo,
    attach: Attach,
    extra: &[&'static str],
) -> (Vec<&'static str>, Option<svc_tests::xdp::XdpPass>) {
    let mut flags = extra.to_vec();
    let peer = (attach == Attach::Xdp).then(|| {
        flags.extend([
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--xdp-mode",
            "native",
        ]);
        xdp_ready(t)
    });
    (flags, peer)
}

/// With XDP in front, at least `min` more flows were started at XDP since `before` (so the
/// flood met XDP's new-flow path, not tc's alone).
fn assert_xdp_started(t: &Topo, attach: Attach, before: u64, min: u64) {
    if attach == Attach::Xdp {
        let started = node1_metric(t, XDP_NEW) - before;
        assert!(
            started >= min,
            "only {started} flows started at XDP (at least {min} expected)"
        );
    }
}

fn spoofed_syns_do_not_hold_snat_ports(attach: Attach) {
    let mut t = Topo::new();
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    let (flags, _peer) = flood_agent_flags(&t, attach, &["--snat-port-range", "61000-61009"]);
    t.start_agent_with(&flags);
    let to = sa(NODE1, 30082);
    let want = Answer {
        backend: "pod2".into(),
        saw: ip(NODE1),
    };
    assert_eq!(
        answered(&t.client, "TCP before", move || tcp_once(to, ANSWER)),
        want
    );

    let node = std::net::SocketAddrV4::new(NODE1.parse().unwrap(), 30082);
    let syns = (0..200u32)
        .map(|i| {
            let src = std::net::SocketAddrV4::new(spoofed(i), 40000 + i as u16);
            svc_tests::raw::Segment::new(src, node, svc_tests::raw::SYN, 0x1000_0000 + i, 0)
        })
        .collect();
    let xdp_before = (attach == Attach::Xdp).then(|| node1_metric(&t, XDP_NEW));
    send_raw(&t, syns);
    // The backend's SYN-ACKs have come back through node 1 by now: every port is held.
    std::thread::sleep(Duration::from_millis(500));
    // Each SYN's flow takes the port of an older unassured one (of ten), at XDP as at tc.
    assert_xdp_started(&t, attach, xdp_before.unwrap_or(0), 200);

    let failures = in_ns(&t.client, move || {
        (0..20)
            .filter_map(|_| tcp_once(to, ANSWER).err().map(|e| e.to_string()))
            .collect::<Vec<_>>()
    });
    assert!(
        failures.is_empty(),
        "real connections failed after spoofed SYNs: {failures:?}"
    );
}

/// Every connection-tracking entry of the pinned tables (assured and unassured).
fn ct_entries(t: &Topo) -> Vec<(svc_common::CtKey, svc_common::CtValue)> {
    use std::os::fd::AsFd;
    let store = svc_agent::datapath::open_pinned(t.bpffs.path()).expect("the pinned maps");
    let ct = store.ct.as_ref().expect("the connection-tracking map");
    let mut all: Vec<_> = svc_agent::sys::dump_hash(ct.fd().as_fd()).expect("reading SVC_CT");
    if let Some(new) = &store.ct_new {
        all.extend(
            svc_agent::sys::dump_hash::<svc_common::CtKey, svc_common::CtValue>(new.fd().as_fd())
                .expect("reading SVC_CT_NEW"),
        );
    }
    all
}

/// A flood of spoofed SYNs against a small table evicts no established connection: with
/// `--max-ct 1024`, three idle connections (two to a local backend, one to a remote, SNATed
/// one) exchange data after 3,000 spoofed SYNs to the remote backend's NodePort (which the
/// backend answers), and new connections to both connect. Before, one LRU table held every flow, the flood's flows
/// evicted the idle connections, and their next segments were reset (issue 33, finding 3).
#[test]
fn a_syn_flood_evicts_no_idle_established_connection() {
    a_syn_flood_evicts_no_idle_connection(Attach::Tcx);
}

/// The same with native XDP in front: the remote connection and the flood's flows are
/// started at XDP and share the tables with tc's.
#[test]
fn a_syn_flood_through_xdp_evicts_no_idle_established_connection() {
    a_syn_flood_evicts_no_idle_connection(Attach::Xdp);
}

fn a_syn_flood_evicts_no_idle_connection(attach: Attach) {
    let mut t = Topo::new();
    t.service("web", nodeport("web", 46, 30088));
    t.endpoints("web", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 47, 30089));
    t.endpoints("remote", &[REMOTE_POD]);
    let (flags, _peer) = flood_agent_flags(&t, attach, &["--max-ct", "1024"]);
    t.start_agent_with(&flags);
    let (local, remote) = (sa(NODE1, 30088), sa(NODE1, 30089));
    // The connections and the flood are sent from one CPU, so the node's ingress makes every
    // entry there: an LRU evicts from the per-CPU lists of the CPU that needs room, and
    // entries made on a CPU that makes no more would never be evicted (see
    // `a_live_idle_flow_outlives_a_table_turned_over_by_dead_ones`).
    fn on_first_cpu() {
        // SAFETY: CPU sets of the size given, for this thread alone.
        let r = unsafe {
            let size = std::mem::size_of::<libc::cpu_set_t>();
            let mut allowed: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(libc::sched_getaffinity(0, size, &mut allowed), 0);
            let first = (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &allowed))
                .expect("a CPU to run on");
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(first, &mut set);
            libc::sched_setaffinity(0, size, &set)
        };
        assert_eq!(
            r,
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
    }
    let conns = in_ns(&t.client, move || {
        on_first_cpu();
        [local, local, remote].map(|to| {
            let c = TcpStream::connect_timeout(&to, ANSWER).expect("connecting");
            exchange(&c).expect("the first exchange");
            c
        })
    });
    // Idle a while, as the connections the issue saw reset were.
    std::thread::sleep(Duration::from_secs(2));

    // Against the remote backend's NodePort: its SYN-ACKs come back through node 1's
    // ingress and are translated (to addresses no namespace holds), so the flood's flows are
    // used as much as a real handshake's and the kernel's LRU cannot tell them apart.
    let node = std::net::SocketAddrV4::new(NODE1.parse().unwrap(), 30089);
    let syns = (0..3000u32)
        .map(|i| {
            let src = std::net::SocketAddrV4::new(spoofed(i), 20000 + (i / 100) as u16);
            svc_tests::raw::Segment::new(src, node, svc_tests::raw::SYN, 0x2000_0000 + i, 0)
        })
        .collect::<Vec<_>>();
    let xdp_before = (attach == Attach::Xdp).then(|| node1_metric(&t, XDP_NEW));
    in_ns(&t.client2, move || {
        on_first_cpu();
        let sender = svc_tests::raw::Sender::new().expect("a raw socket");
        for s in &syns {
            sender.send(s).expect("sending a spoofed SYN");
        }
    });
    // The backend's SYN-ACKs have gone out (to addresses no namespace holds) by now.
    std::thread::sleep(Duration::from_millis(500));
    // Spoofed sources repeat every 100 SYNs with new ports: every SYN is a new flow.
    assert_xdp_started(&t, attach, xdp_before.unwrap_or(0), 3_000);

    for (i, c) in conns.iter().enumerate() {
        let to = c.peer_addr().expect("the connection's peer");
        let after = exchange(c);
        assert!(
            after.is_ok(),
            "idle connection {i} to {to} after 3,000 spoofed SYNs: {after:?}"
        );
    }
    for to in [local, remote] {
        let failures = in_ns(&t.client, move || {
            (0..5)
                .filter_map(|_| tcp_once(to, ANSWER).err().map(|e| e.to_string()))
                .collect::<Vec<_>>()
        });
        assert!(
            failures.is_empty(),
            "new connections to {to} after the flood: {failures:?}"
        );
    }
}

/// The entry of the flow whose packets carry `(src, dst)` in direction `dir`.
fn ct_entry(t: &Topo, src: SocketAddr, dst: SocketAddr, dir: u8) -> Option<svc_common::CtValue> {
    let a16 = |a: IpAddr| match a {
        IpAddr::V4(v4) => svc_common::v4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    };
    ct_entries(t).into_iter().find_map(|(k, v)| {
        (k.saddr == a16(src.ip())
            && k.daddr == a16(dst.ip())
            && k.sport_be == src.port().to_be()
            && k.dport_be == dst.port().to_be()
            && k.proto == svc_common::IPPROTO_TCP
            && k.dir == dir)
            .then_some(v)
    })
}

/// 64 sequence numbers spread over the space and none within 2 MiB of `at` (where the
/// datapath says the sender is): what a blind attacker sends, with no lucky guess.
fn blind_seqs(at: u32) -> Vec<u32> {
    (1..=64u32)
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .filter(|s| s.wrapping_sub(at).wrapping_add(1 << 21) > 1 << 22)
        .collect()
}

/// Forged RSTs and FINs with sequence numbers a blind attacker would use close nothing: from
/// a local backend's client's own tuple, RST+SYN pairs against a remote backend's flow (before,
/// the SYN then took the closed tuple over and the backend reset the client), and RSTs from
/// the remote backend's address to every SNAT port. Both idle connections go on, their
/// entries stay open, no forged RST reaches a client, and each is counted. The clients' own
/// RSTs still close their flows.
#[test]
fn forged_rsts_and_fins_close_no_connection() {
    forged_rsts_and_fins_close_nothing(Attach::Tcx);
}

/// The same with native XDP in front, which serves the remote connection's packets and
/// replies: a forged segment outside the window is passed to tc, which drops and counts it.
#[test]
fn forged_rsts_and_fins_close_no_connection_through_xdp() {
    forged_rsts_and_fins_close_nothing(Attach::Xdp);
}

fn forged_rsts_and_fins_close_nothing(attach: Attach) {
    use svc_tests::raw::{Segment, ACK, FIN, RST, SYN};
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    let mut flags = vec!["--snat-port-range", "61000-61063"];
    let _peer = (attach == Attach::Xdp).then(|| {
        flags.extend(["--xdp-mode", "native"]);
        xdp_ready(&t)
    });
    flags.extend(["--metrics-bind-address", "127.0.0.1:10249"]);
    t.start_agent_with(&flags);
    let (np_local, np_remote) = (sa(NODE1, 30081), sa(NODE1, 30082));
    for to in [np_local, np_remote] {
        answered(&t.client, "NodePort", move || tcp_once(to, ANSWER));
    }
    let (a, b) = in_ns(&t.client, move || {
        let a = TcpStream::connect_timeout(&np_local, ANSWER).expect("connection A");
        let b = TcpStream::connect_timeout(&np_remote, ANSWER).expect("connection B");
        exchange(&a).expect("A's first exchange");
        exchange(&b).expect("B's first exchange");
        (a, b)
    });
    let (a_src, b_src) = (a.local_addr().unwrap(), b.local_addr().unwrap());
    let v4 = |s: SocketAddr| match s {
        SocketAddr::V4(s) => s,
        SocketAddr::V6(_) => unreachable!("IPv4"),
    };
    let a_fwd = ct_entry(&t, a_src, np_local, 0).expect("A's FORWARD entry");
    let b_fwd = ct_entry(&t, b_src, np_remote, 0).expect("B's FORWARD entry");
    assert_ne!(
        a_fwd.flags & svc_common::ct_flags::TRACKED,
        0,
        "A is tracked"
    );
    let b_snat = SocketAddr::new(ip(NODE1), u16::from_be(b_fwd.snat_port_be));
    let pod2 = std::net::SocketAddrV4::new(POD2.parse().unwrap(), 8080);
    let b_rep = ct_entry(&t, SocketAddr::V4(pod2), b_snat, 1).expect("B's REPLY entry");

    let mut forged = Vec::new();
    for seq in blind_seqs(a_fwd.seq_end) {
        forged.push(Segment::new(v4(a_src), v4(np_local), RST, seq, 0));
        forged.push(Segment::new(v4(a_src), v4(np_local), FIN | ACK, seq, 1));
    }
    for seq in blind_seqs(b_fwd.seq_end) {
        forged.push(Segment::new(v4(b_src), v4(np_remote), RST | ACK, seq, 1));
        forged.push(Segment::new(v4(b_src), v4(np_remote), SYN, seq, 0));
    }
    for port in 61000..=61063u16 {
        let to = std::net::SocketAddrV4::new(NODE1.parse().unwrap(), port);
        for seq in blind_seqs(b_rep.seq_end).into_iter().take(4) {
            forged.push(Segment::new(pod2, to, RST | ACK, seq, 1));
        }
    }
    // The RSTs on the two flows' own tuples: each is dropped and counted (the others meet
    // no flow, and the FINs and SYNs go on to the endpoints, which judge them).
    let on_flows = forged
        .iter()
        .filter(|s| {
            s.flags & RST != 0
                && (s.src == v4(a_src) || s.src == v4(b_src) || s.dst.port() == b_snat.port())
        })
        .count();
    send_raw(&t, forged);
    std::thread::sleep(Duration::from_millis(300));

    let a_fwd = ct_entry(&t, a_src, np_local, 0).expect("A's FORWARD entry");
    let b_fwd = ct_entry(&t, b_src, np_remote, 0).expect("B's FORWARD entry");
    let closing = svc_common::ct_flags::RST | svc_common::ct_flags::FIN;
    assert_eq!(
        a_fwd.flags & closing,
        0,
        "A marked closing: {:#x}",
        a_fwd.flags
    );
    assert_eq!(
        b_fwd.flags & closing,
        0,
        "B marked closing: {:#x}",
        b_fwd.flags
    );
    let served = |t: &Topo| [XDP_CT_HIT, XDP_REPLY].map(|l| node1_metric(t, l));
    let xdp_before = served(&t);
    let (a, b) = in_ns(&t.client, move || {
        assert_eq!(exchange(&a).expect("A after the attack").backend, "pod1");
        assert_eq!(exchange(&b).expect("B after the attack").backend, "pod2");
        (a, b)
    });
    if attach == Attach::Xdp {
        let after = served(&t);
        assert!(
            after[0] > xdp_before[0] && after[1] > xdp_before[1],
            "B's exchange after the attack was not served at XDP: {xdp_before:?} -> {after:?}"
        );
    }
    let dropped = metric(
        &t,
        "svc_packet_decisions_total{device=\"eth0\",reason=\"drop_tcp_window\"}",
    );
    assert!(
        dropped as usize >= on_flows,
        "{dropped} of the {on_flows} forged RSTs on the flows counted as outside their window"
    );

    // The clients' own RSTs close their flows.
    in_ns(&t.client, move || {
        exchange_and_reset(a, ANSWER).expect("A's last exchange");
        exchange_and_reset(b, ANSWER).expect("B's last exchange");
    });
    std::thread::sleep(Duration::from_millis(200));
    for (src, to) in [(a_src, np_local), (b_src, np_remote)] {
        let fwd = ct_entry(&t, src, to, 0).expect("the FORWARD entry");
        assert_ne!(
            fwd.flags & svc_common::ct_flags::RST,
            0,
            "{src}: the client's RST closes its flow"
        );
    }
}

/// How many TCP segments `ns`'s stack received (`Tcp: InSegs` of its /proc/net/snmp, which the
/// kernel counts before it checks a segment's checksum): what reached a backend, sound or not.
fn tcp_in_segs(ns: &NetNs) -> u64 {
    in_ns(ns, || {
        // thread-self: /proc/self/net is the namespace of the process's first thread.
        let snmp = std::fs::read_to_string("/proc/thread-self/net/snmp")
            .expect("reading /proc/thread-self/net/snmp");
        let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
        let (names, values) = (tcp.next(), tcp.next());
        names
            .zip(values)
            .and_then(|(n, v)| {
                n.split_whitespace()
                    .zip(v.split_whitespace())
                    .find(|(n, _)| *n == "InSegs")
                    .and_then(|(_, v)| v.parse().ok())
            })
            .unwrap_or_else(|| panic!("no Tcp InSegs in /proc/net/snmp:\n{snmp}"))
    })
}

/// A value of node 1's /metrics, 0 when the line is absent (a per-device reason not counted
/// yet).
fn metric_or_zero(t: &Topo, line: &str) -> u64 {
    metrics_text(t)
        .lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or(0)
}

/// How many connection-tracking entries name one of `addrs` (either end of their key).
/// Reading the map goes through `ct_entries` alone.
fn ct_entries_of(t: &Topo, addrs: &[std::net::Ipv4Addr]) -> usize {
    let mapped: Vec<[u8; 16]> = addrs
        .iter()
        .map(|a| svc_common::v4_mapped(a.octets()))
        .collect();
    ct_entries(t)
        .iter()
        .filter(|(k, _)| mapped.contains(&k.saddr) || mapped.contains(&k.daddr))
        .count()
}

/// Connection-tracking lines of node 1's kernel (`conntrack -L`) that name `addr`.
fn kernel_ct_lines(t: &Topo, addr: std::net::Ipv4Addr) -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            t.node1.name(),
            "conntrack",
            "-L",
            "-p",
            "tcp",
        ])
        .output()
        .expect("running conntrack -L");
    let needle = format!("src={addr} ");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&needle))
        .map(str::to_string)
        .collect()
}

/// The malformed set, as an attacker sends it to a NodePort from spoofed sources: SYNs with a
/// wrong and with a zero TCP checksum, SYN+FIN, SYN+RST, every flag, and a SYN-ACK that
/// answers no SYN. `n` of each from the spoofed sources `first..first + 6n`, to `to`.
fn malformed_set(first: u32, n: u32, to: std::net::SocketAddrV4) -> Vec<svc_tests::raw::Segment> {
    use svc_tests::raw::{Check, Segment, ACK, FIN, PSH, RST, SYN};
    let kinds: [(u8, Check); 6] = [
        (SYN, Check::Wrong),
        (SYN, Check::Zero),
        (SYN | FIN, Check::Right),
        (SYN | RST, Check::Right),
        (FIN | SYN | RST | PSH | ACK | 0x20, Check::Right),
        (SYN | ACK, Check::Right),
    ];
    let mut out = Vec::new();
    for (k, (flags, check)) in kinds.into_iter().enumerate() {
        for j in 0..n {
            let i = first + k as u32 * n + j;
            let src = std::net::SocketAddrV4::new(spoofed(i), 42000 + i as u16);
            let ack = if flags & ACK != 0 { 0x5000_0000 + i } else { 0 };
            out.push(Segment::new(src, to, flags, 0x3000_0000 + i, ack).check(check));
        }
    }
    out
}

/// The malformed set (`malformed_set`) from spoofed sources reaches no backend and makes no
/// connection-tracking entry, and each kind is counted in /metrics (`drop_bad_checksum`,
/// `drop_invalid_tcp`, and `pass_midstream` for the SYN-ACK, which the node's own stack gets
/// untouched). A sound SYN from a spoofed source does both, so the observables can fail. The
/// same set against kernel NAT (an nft dnat rule, kube-proxy's mechanism, before the agent
/// runs) reaches the backend no more, and conntrack tracks none of it. Before: each segment
/// of the set was translated to the backend and made two entries; the bad checksums were
/// the last of them.
#[test]
fn the_malformed_set_reaches_no_backend_and_makes_no_state() {
    use svc_tests::raw::Segment;
    const N: u32 = 5;
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    let node = |port| std::net::SocketAddrV4::new(NODE1.parse().unwrap(), port);
    // Spoofed sources 0..6N for svc, 6N..12N for kernel NAT, then one sound SYN each.
    let (svc_ok, nat_ok) = (12 * N, 12 * N + 1);
    let sources = |r: std::ops::Range<u32>| r.map(spoofed).collect::<Vec<_>>();

    // The control: kernel NAT to the same backend, before the agent attaches anything.
    let ctl = "add table ip svc_test_ctl; \
               add chain ip svc_test_ctl pre { type nat hook prerouting priority -100; }; \
               add rule ip svc_test_ctl pre tcp dport 30099 dnat to 10.244.1.2:8080";
    let nft = |script: &str| {
        let st = std::process::Command::new("ip")
            .args(["netns", "exec", t.node1.name(), "nft", script])
            .status()
            .expect("running nft");
        assert!(st.success(), "nft {script}: {st}");
    };
    nft(ctl);
    let to = SocketAddr::V4(node(30099));
    answered(&t.client, "kernel NAT", move || tcp_once(to, ANSWER));
    std::thread::sleep(Duration::from_millis(300));
    let before = tcp_in_segs(&t.pod1);
    send_raw(&t, malformed_set(6 * N, N, node(30099)));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        tcp_in_segs(&t.pod1) - before,
        0,
        "kernel NAT: segments of the malformed set reached the backend"
    );
    for a in sources(6 * N..12 * N) {
        let lines = kernel_ct_lines(&t, a);
        assert!(lines.is_empty(), "kernel NAT tracked {a}: {lines:?}");
    }
    let sound = |i: u32, port| {
        let src = std::net::SocketAddrV4::new(spoofed(i), 42000 + i as u16);
        Segment::new(src, node(port), svc_tests::raw::SYN, 0x3000_0000 + i, 0)
    };
    send_raw(&t, vec![sound(nat_ok, 30099)]);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        tcp_in_segs(&t.pod1) - before,
        1,
        "kernel NAT: the sound SYN reaches the backend"
    );
    assert!(!kernel_ct_lines(&t, spoofed(nat_ok)).is_empty());
    nft("delete table ip svc_test_ctl");

    t.start_agent_with(&["--metrics-bind-address", "127.0.0.1:10249"]);
    let to = SocketAddr::V4(node(30081));
    answered(&t.client, "NodePort", move || tcp_once(to, ANSWER));
    std::thread::sleep(Duration::from_millis(300));
    let count = |reason: &str| {
        metric_or_zero(
            &t,
            &format!("svc_packet_decisions_total{{device=\"eth0\",reason=\"{reason}\"}}"),
        )
    };
    let reasons = ["drop_bad_checksum", "drop_invalid_tcp", "pass_midstream"];
    let counted: Vec<u64> = reasons.iter().map(|r| count(r)).collect();
    let before = tcp_in_segs(&t.pod1);
    let set = malformed_set(0, N, node(30081));
    // The bad checksums first, on their own: what this change is about.
    let (bad_sums, rest) = set.split_at(2 * N as usize);
    send_raw(&t, bad_sums.to_vec());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        tcp_in_segs(&t.pod1) - before,
        0,
        "SYNs with a wrong or zero checksum reached the backend"
    );
    assert_eq!(
        ct_entries_of(&t, &sources(0..2 * N)),
        0,
        "entries for SYNs with a wrong or zero checksum"
    );
    send_raw(&t, rest.to_vec());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        tcp_in_segs(&t.pod1) - before,
        0,
        "segments of the malformed set reached the backend"
    );
    assert_eq!(
        ct_entries_of(&t, &sources(0..6 * N)),
        0,
        "entries for the malformed set"
    );
    let moved: Vec<u64> = reasons
        .iter()
        .zip(&counted)
        .map(|(r, was)| count(r) - was)
        .collect();
    assert_eq!(
        moved,
        [2 * N as u64, 3 * N as u64, N as u64],
        "counted as {reasons:?}"
    );

    // A sound SYN from a spoofed source: to the backend, with its entries.
    send_raw(&t, vec![sound(svc_ok, 30081)]);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        tcp_in_segs(&t.pod1) - before,
        1,
        "the sound SYN reaches the backend"
    );
    assert_eq!(
        ct_entries_of(&t, &[spoofed(svc_ok)]),
        2,
        "the sound SYN's entries"
    );
}

/// A bounded flood of spoofed IPv4 fragments against a UDP NodePort: later fragments with no
/// first fragment (random ids), and first fragments of 3,000-byte datagrams whose rest never
/// comes. Later fragments without a record pass untouched, counted `fragment`; each first
/// fragment starts a UDP flow, as any datagram does (kernel NAT, which reassembles first,
/// would track none). Meanwhile and after, a real client's fragmented 3,000-byte exchange
/// through the same NodePort works, and the flood's flows are gone once the UDP timeout
/// (2 s here) has passed: nothing holds them.
#[test]
fn a_spoofed_fragment_flood_leaves_fragmented_udp_working() {
    const N: u32 = 1000;
    let mut t = Topo::new();
    t.service("fragflood", nodeport("fragflood", 74, 30074));
    t.endpoints("fragflood", &[LOCAL_POD]);
    t.start_agent_with(&[
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--conntrack-udp-timeout",
        "2s",
        "--conntrack-sweep-interval",
        "1s",
    ]);
    let to = sa(NODE1, 30074);
    answered(&t.client, "UDP", move || udp_once(to, ANSWER));
    let big = |t: &Topo, when: &str| {
        let got = in_ns(&t.client, move || udp_sized_once(to, 3000, ANSWER));
        match got {
            Ok(a) if a.backend == "pod1" => {}
            other => panic!("3,000 bytes to {to} {when}: {other:?}"),
        }
    };
    big(&t, "before the flood");
    let count = |reason: &str| {
        metric_or_zero(
            &t,
            &format!("svc_packet_decisions_total{{device=\"eth0\",reason=\"{reason}\"}}"),
        )
    };
    let (fragments, new) = (count("fragment"), count("new"));

    let node: std::net::Ipv4Addr = NODE1.parse().unwrap();
    // Ids from a fixed sequence that looks random (and is the same each run).
    let id = |i: u32| (i.wrapping_mul(0x9e37_79b9) >> 16) as u16;
    let mut packets = Vec::new();
    for i in 0..N {
        let src = spoofed(i);
        // The last piece of some datagram: 200 bytes at 1,480.
        packets.push(svc_tests::raw::ipv4_fragment(
            src,
            node,
            17,
            id(i),
            1480,
            false,
            &[0x55; 200],
        ));
        // The first of a 3,000-byte datagram to the NodePort, no UDP checksum.
        let mut udp = Vec::new();
        udp.extend_from_slice(&(43000 + i as u16).to_be_bytes());
        udp.extend_from_slice(&30074u16.to_be_bytes());
        udp.extend_from_slice(&3008u16.to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(&[0xaa; 192]);
        packets.push(svc_tests::raw::ipv4_fragment(
            src,
            node,
            17,
            id(i + N),
            0,
            true,
            &udp,
        ));
    }
    let flood = {
        let ns = t.client2.path();
        std::thread::spawn(move || {
            enter(&ns).expect("entering client 2");
            let sender = svc_tests::raw::Sender::new().expect("a raw socket");
            for p in &packets {
                sender.send_packet(node, p).expect("sending a fragment");
            }
        })
    };
    big(&t, "during the flood");
    flood.join().expect("the flood's sender");
    std::thread::sleep(Duration::from_millis(300));
    big(&t, "after the flood");
    assert!(
        count("fragment") - fragments >= N as u64,
        "later fragments without a record counted `fragment`"
    );
    assert!(
        count("new") - new >= N as u64,
        "each first fragment starts a flow"
    );
    let sources: Vec<_> = (0..N).map(spoofed).collect();
    poll(Duration::from_secs(15), || {
        let left = ct_entries_of(&t, &sources);
        Ok((left == 0).then_some(()))
    })
    .unwrap_or_else(|e| {
        panic!(
            "the flood's flows outlived the UDP timeout: {} entries left ({e:#})",
            ct_entries_of(&t, &sources)
        )
    });
    big(&t, "once the flood's flows are gone");
}

/// A NodePort Service of a local backend, a connection through it that exchanged once, and
/// the agent stopped, its pins left: what an upgrade's carry of flows starts from.
fn a_connection_held_through_a_stopped_agent() -> (Topo, TcpStream) {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.start_agent();
    let np = sa(NODE1, 30081);
    let c = in_ns(&t.client, move || {
        let c = TcpStream::connect_timeout(&np, ANSWER).expect("a connection");
        exchange(&c).expect("its first exchange");
        c
    });
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    (t, c)
}

/// Restarts the agent of `t` and checks that it carried the flows of `SVC_CT`'s `layout`.
fn restarted_carrying_the_flows_of(t: &mut Topo, layout: u32) {
    t.agent().restart().expect("restart");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("ready again");
    let said = format!("carried the flows of layout {layout} over");
    assert!(t.agent().log().contains(&said), "{}", t.agent().log());
}

/// After an upgrade: connection `c` still exchanges with its backend, and the pin of
/// `SVC_CT`'s older `layout` under `dir` is removed once the new programs are attached.
fn goes_on_and_the_old_pin_goes(t: &Topo, c: TcpStream, dir: &std::path::Path, layout: u32) {
    let c = in_ns(&t.client, move || {
        let a = exchange(&c).expect("the connection after the upgrade");
        assert_eq!(a.backend, "pod1");
        c
    });
    drop(c);
    let old = dir.join(format!("SVC_CT_v{layout}"));
    poll(
        Duration::from_secs(10),
        || Ok((!old.exists()).then_some(())),
    )
    .unwrap_or_else(|e| panic!("layout {layout}'s pin removed once the programs switched: {e}"));
}

/// An agent taking over from one whose connection-tracking map is of layout 1 (before
/// sequence tracking) carries its flows over: a connection held open through a NodePort goes
/// on. Layout 1's map is made here from what the running datapath holds, pinned where such an
/// agent left it, and the newer pin removed, as an upgrade from that agent finds them.
/// Without the carry the connection's next segment meets no flow, and the node resets it.
#[test]
fn flows_of_the_layout_before_sequence_tracking_are_carried_over() {
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.start_agent();
    let np = sa(NODE1, 30081);
    answered(&t.client, "NodePort", move || tcp_once(np, ANSWER));
    let c = in_ns(&t.client, move || {
        let c = TcpStream::connect_timeout(&np, ANSWER).expect("a connection");
        exchange(&c).expect("its first exchange");
        c
    });
    t.agent().terminate(Duration::from_secs(10)).expect("stop");

    let entries = ct_entries(&t);
    assert!(!entries.is_empty());
    let old: Vec<(svc_common::CtKey, svc_common::CtValueV1)> = entries
        .iter()
        .map(|(k, v)| {
            let old = svc_common::CtValueV1 {
                nat_addr: v.nat_addr,
                snat_addr: v.snat_addr,
                nat_port_be: v.nat_port_be,
                snat_port_be: v.snat_port_be,
                flags: v.flags & !(svc_common::ct_flags::TRACKED | svc_common::ct_flags::UNASSURED),
                handing_s: v.handing_s,
                id: v.id,
                ifindex: v.ifindex,
                last_seen_ns: v.last_seen_ns,
            };
            (*k, old)
        })
        .collect();
    let dir = t.bpffs.path().to_path_buf();
    pins::pin_old_ct(&dir, 1, pins::LRU_HASH, &old).expect("layout 1's table");
    std::fs::remove_file(ct_pin(&dir)).expect("removing this layout's pin");
    std::fs::remove_file(dir.join("SVC_CT_NEW_v1")).expect("removing the unassured table's pin");

    restarted_carrying_the_flows_of(&mut t, 1);
    goes_on_and_the_old_pin_goes(&t, c, &dir, 1);
}

/// An agent taking over from one whose connection-tracking map is of layout 2 (one LRU of
/// every flow, before the assured table) carries its flows over, each into the table its
/// `UNASSURED` bit says: a connection held open through a NodePort goes on, and its entries
/// are in the assured table, where a flood cannot evict them. Layout 2's map is made here from
/// what the running datapath holds, pinned where such an agent left it, and the newer pins
/// removed, as an upgrade from that agent finds them.
#[test]
fn flows_of_the_layout_with_one_table_are_carried_into_the_assured_one() {
    use std::os::fd::AsFd;
    let (mut t, c) = a_connection_held_through_a_stopped_agent();
    let client = c.local_addr().expect("the client's address");

    let entries = ct_entries(&t);
    assert!(!entries.is_empty());
    let dir = t.bpffs.path().to_path_buf();
    pins::pin_old_ct(&dir, 2, pins::LRU_HASH, &entries).expect("layout 2's table");
    std::fs::remove_file(ct_pin(&dir)).expect("removing this layout's pin");
    std::fs::remove_file(dir.join("SVC_CT_NEW_v1")).expect("removing the unassured table's pin");

    restarted_carrying_the_flows_of(&mut t, 2);
    // The connection's FORWARD entry, assured, in the assured table.
    let store = svc_agent::datapath::open_pinned(&dir).expect("the pinned maps");
    let assured: Vec<(svc_common::CtKey, svc_common::CtValue)> =
        svc_agent::sys::dump_hash(store.ct.as_ref().expect("the assured table").fd().as_fd())
            .expect("reading SVC_CT");
    assert!(
        assured
            .iter()
            .any(|(k, v)| k.dir == svc_common::ct_dir::FORWARD
                && k.sport_be == client.port().to_be()
                && v.flags & svc_common::ct_flags::UNASSURED == 0),
        "the connection is in the assured table: {assured:?}"
    );
    goes_on_and_the_old_pin_goes(&t, c, &dir, 2);
}

/// This layout's pin of `SVC_CT` under `dir`.
fn ct_pin(dir: &std::path::Path) -> std::path::PathBuf {
    svc_agent::datapath::map_pin(dir, svc_common::map_names::CT)
}

/// An agent taking over from one whose assured table is of layout 3 (the same hash, allocated
/// in full) carries its flows into a table allocated as flows come: a connection held open
/// through a NodePort goes on, its entry is in the new assured table, and the table a node
/// holds is one the kernel allocates entries of as used (`BPF_F_NO_PREALLOC`). Layout 3's map is
/// made here from what the running datapath holds, pinned where such an agent left it, and
/// the newer pin removed, as an upgrade from that agent finds them.
#[test]
fn flows_of_the_table_allocated_in_full_are_carried_into_one_allocated_as_used() {
    use std::os::fd::AsFd;
    let (mut t, c) = a_connection_held_through_a_stopped_agent();
    let client = c.local_addr().expect("the client's address");

    let dir = t.bpffs.path().to_path_buf();
    let assured: Vec<(svc_common::CtKey, svc_common::CtValue)> = {
        let store = svc_agent::datapath::open_pinned(&dir).expect("the pinned maps");
        let ct = store.ct.as_ref().expect("the assured table");
        let info = ct.info().expect("its info");
        assert_eq!(
            info.map_flags() & svc_common::BPF_F_NO_PREALLOC,
            svc_common::BPF_F_NO_PREALLOC,
            "this layout's table is allocated as used"
        );
        svc_agent::sys::dump_hash(ct.fd().as_fd()).expect("reading SVC_CT")
    };
    assert!(!assured.is_empty(), "the connection is assured");
    pins::pin_old_ct(&dir, 3, pins::HASH, &assured).expect("layout 3's table");
    std::fs::remove_file(ct_pin(&dir)).expect("removing this layout's pin");

    restarted_carrying_the_flows_of(&mut t, 3);
    let store = svc_agent::datapath::open_pinned(&dir).expect("the pinned maps");
    let ct = store.ct.as_ref().expect("the assured table");
    assert_eq!(
        ct.info().expect("its info").map_flags() & svc_common::BPF_F_NO_PREALLOC,
        svc_common::BPF_F_NO_PREALLOC
    );
    let now: Vec<(svc_common::CtKey, svc_common::CtValue)> =
        svc_agent::sys::dump_hash(ct.fd().as_fd()).expect("reading SVC_CT");
    assert!(
        now.iter().any(|(k, v)| k.dir == svc_common::ct_dir::FORWARD
            && k.sport_be == client.port().to_be()
            && v.flags & svc_common::ct_flags::UNASSURED == 0),
        "the connection is in the new assured table: {now:?}"
    );
    goes_on_and_the_old_pin_goes(&t, c, &dir, 3);
}

/// An upgrade from a real agent of the previous layout (one connection-tracking table,
/// `SVC_PREVIOUS_AGENT_BIN`; skipped without it) keeps a connection it made: the new agent
/// carries the flow into its assured table, and the connection, to a local and to a remote
/// (SNATed) backend, exchanges data after the switch.
#[test]
fn connections_survive_an_upgrade_from_the_agent_with_one_table() {
    use std::os::fd::AsFd;
    let Some(old) = std::env::var_os("SVC_PREVIOUS_AGENT_BIN") else {
        eprintln!("skipped: set SVC_PREVIOUS_AGENT_BIN to a svc-agent of layout 2's SVC_CT");
        return;
    };
    let mut t = Topo::new();
    t.service("local", nodeport("local", 11, 30081));
    t.endpoints("local", &[LOCAL_POD]);
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.start_agent();
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    let new = t.tools.agent.clone();
    t.agent().set_bin(std::path::Path::new(&old));
    t.agent().restart().expect("the previous agent");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("the previous agent ready");
    let dir = t.bpffs.path().to_path_buf();
    assert!(dir.join("SVC_CT_v2").exists(), "the previous layout serves");
    let (local, remote) = (sa(NODE1, 30081), sa(NODE1, 30082));
    let conns = in_ns(&t.client, move || {
        [local, remote].map(|to| {
            let c = TcpStream::connect_timeout(&to, ANSWER).expect("a connection");
            exchange(&c).expect("its first exchange");
            c
        })
    });
    let client_ports: Vec<u16> = conns
        .iter()
        .map(|c| c.local_addr().expect("the client's address").port())
        .collect();

    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent().set_bin(&new);
    t.agent().restart().expect("the new agent");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("the new agent ready");
    assert!(
        t.agent()
            .log()
            .contains("carried the flows of layout 2 over"),
        "{}",
        t.agent().log()
    );
    for (c, want) in conns.iter().zip(["pod1", "pod2"]) {
        let a = exchange(c).expect("the connection after the upgrade");
        assert_eq!(a.backend, want);
    }
    let store = svc_agent::datapath::open_pinned(&dir).expect("the pinned maps");
    let assured: Vec<(svc_common::CtKey, svc_common::CtValue)> =
        svc_agent::sys::dump_hash(store.ct.as_ref().expect("the assured table").fd().as_fd())
            .expect("reading SVC_CT");
    for port in client_ports {
        assert!(
            assured
                .iter()
                .any(|(k, v)| k.dir == svc_common::ct_dir::FORWARD
                    && k.sport_be == port.to_be()
                    && v.flags & svc_common::ct_flags::UNASSURED == 0),
            "the connection from port {port} is in the assured table: {assured:?}"
        );
    }
    poll(Duration::from_secs(10), || {
        Ok((!dir.join("SVC_CT_v2").exists()).then_some(()))
    })
    .expect("layout 2's pin removed once the programs switched");
}

/// `/metrics` of node 1 (the agent's `--metrics-bind-address 127.0.0.1:10249`), whole.
fn metrics_text(t: &Topo) -> String {
    let (status, text) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/metrics").expect("GET /metrics")
    });
    assert_eq!(status, 200);
    text
}

/// A remote backend reached through a device without svc's programs: node 1 gets a second
/// link to node 2 (`eth1`, not in `--devices`) and routes pod 2 over it, and node 2 routes
/// node 1's address back over it, so pod 2's replies to a SNATed NodePort flow come back on
/// `eth1`, where nothing translates them, and the client's connection hangs. The agent's drift
/// check counts the flow under `eth1` in /metrics, lists it in /healthz (still 200), and warns
/// once, naming the device and `--devices`. Flows leaving by `eth0` are not counted. With
/// `--devices eth0,eth1`, as the warning advises, the NodePort answers and nothing is counted.
#[test]
fn flows_leaving_by_a_device_without_svc_programs_are_counted_and_warned_about() {
    let mut t = Topo::new();
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    let flags = [
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--reconcile-interval-s",
        "1",
    ];
    t.start_agent_with(&flags);
    let np = sa(NODE1, 30082);
    let want = Answer {
        backend: "pod2".into(),
        saw: ip(NODE1),
    };
    // Through eth0, which has the programs: answered, and nothing counted.
    assert_eq!(
        answered(&t.client, "NodePort via eth0", move || tcp_once(np, ANSWER)),
        want
    );
    std::thread::sleep(Duration::from_millis(2500));
    let text = metrics_text(&t);
    assert!(
        !text.contains("svc_flows_via_unmanaged_device{"),
        "a flow through eth0 counted:\n{text}"
    );

    // node 1 -- eth1 -- node 2, a more specific route each way: pod 2 from node 1, and node
    // 1's address from node 2.
    veth_pair(&t.node1, "eth1", &t.node2, "eth1").expect("a second link between the nodes");
    t.node1.add_addr("eth1", "10.79.0.1/24").unwrap();
    t.node2.add_addr("eth1", "10.79.0.2/24").unwrap();
    t.node1
        .ip(["route", "add", &format!("{POD2}/32"), "via", "10.79.0.2"])
        .expect("pod 2 over eth1");
    t.node2
        .ip(["route", "add", &format!("{NODE1}/32"), "via", "10.79.0.1"])
        .expect("node 1 over eth1");
    assert_eq!(svc_programs(&t.node1, "eth1"), (0, 0));

    // The bug itself: the replies come back untranslated, the connection never opens.
    let lost = in_ns(&t.client, move || tcp_once(np, Duration::from_millis(1500)));
    assert!(
        lost.is_err(),
        "answered through eth1 untranslated: {lost:?}"
    );

    let warning = "flows to remote backends leave by eth1, which has no svc programs";
    poll(Duration::from_secs(10), || {
        Ok(t.agent().log().contains(warning).then_some(()))
    })
    .unwrap_or_else(|e| panic!("no warning about eth1: {e:#}\n{}", t.agent().log()));
    let log = t.agent().log();
    let line = log
        .lines()
        .find(|l| l.contains(warning))
        .expect("the warning");
    assert!(line.contains("--devices eth0,eth1"), "{line}");
    let counted = metric(&t, "svc_flows_via_unmanaged_device{device=\"eth1\"}");
    assert!(counted >= 1, "counted {counted}");
    assert!(!metrics_text(&t).contains("svc_flows_via_unmanaged_device{device=\"eth0\"}"));
    let (status, body) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/healthz").expect("GET /healthz")
    });
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("leave by eth1"), "{body}");
    // Once per device: the next checks count it again without warning again.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(t.agent().log().matches(warning).count(), 1);

    // As the warning advises: the replies coming back on eth1 are translated there.
    t.agent().kill().expect("SIGKILL");
    let mut with = flags.to_vec();
    with.extend(["--devices", "eth0,eth1"]);
    t.start_agent_with(&with);
    assert_eq!(svc_programs(&t.node1, "eth1"), (1, 1));
    // SNATed to a node address (which one is the SNAT choice's business, not this test's).
    let got = answered(&t.client, "NodePort via eth1", move || tcp_once(np, ANSWER));
    assert_eq!(got.backend, "pod2", "{got:?}");
    assert_ne!(got.saw, ip(CLIENT), "{got:?}");
    std::thread::sleep(Duration::from_millis(2500));
    let text = metrics_text(&t);
    assert!(
        !text.contains("svc_flows_via_unmanaged_device{"),
        "counted with eth1 in --devices:\n{text}"
    );
    assert!(!t.agent().log().contains(warning), "{}", t.agent().log());
}

// ---------------------------------------------------------------------------------------
// XDP (docs/design/xdp.md).

/// `ethtool ARGS` inside `ns` (Debian's `ethtool` package).
fn ethtool(ns: &NetNs, args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "ethtool"])
        .args(args)
        .output()
        .expect("running ethtool (install Debian's ethtool package)");
    assert!(
        out.status.success(),
        "ethtool {args:?} in {}: {}",
        ns.name(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What native XDP on node 1's veth needs of the test's topology: XDP cannot see a packet's
/// checksum state, so the senders on veths finish their checksums themselves, as packets from
/// a wire have them; and eth0's peer on the bridge runs an XDP program, without which its
/// XDP_TX frames are not picked up (docs/design/xdp.md, "Known problems"). Detached when the
/// guard drops.
fn xdp_ready(t: &Topo) -> svc_tests::xdp::XdpPass {
    ethtool(&t.client, &["-K", "eth0", "tx", "off"]);
    ethtool(&t._pod2, &["-K", "eth0", "tx", "off"]);
    svc_tests::xdp::XdpPass::attach(&t._lan, "n1").expect("XDP on eth0's peer")
}

/// The value of the /metrics sample `line` on node 1 (0 when absent: a counter not moved yet).
fn node1_metric(t: &Topo, line: &'static str) -> u64 {
    let (status, metrics) = in_ns(&t.node1, || {
        http_get_path(sa("127.0.0.1", 10249), "/metrics").expect("GET /metrics")
    });
    assert_eq!(status, 200);
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or(0)
}

const XDP_CT_HIT: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_ct_hit\"}";
const XDP_REPLY: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_reply\"}";
const TC_CT_HIT: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"ct_hit\"}";
const TC_REPLY: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"reply\"}";
const XDP_NEW: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_new\"}";
const TC_NEW: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"new\"}";

/// `n` exchanges on each open connection, every one answered by pod 2 seeing node 1's address
/// of the connection's family (SNATed).
fn talk(conns: &[(TcpStream, &'static str)], n: usize, when: &str) {
    for (c, node) in conns {
        for i in 0..n {
            let a = exchange(c).unwrap_or_else(|e| panic!("{when}: exchange {i} via {node}: {e}"));
            assert_eq!(
                (a.backend.as_str(), a.saw),
                ("pod2", ip(node)),
                "{when}: exchange {i}"
            );
        }
    }
}

/// A new NodePort TCP connection and UDP flow to a remote backend (IPv4 and IPv6) is served
/// by XDP (the driver's hook) on node 1's veth from its first packet on (its XDP counters
/// move, tc's do not), a connection XDP began goes on when the agent is restarted without XDP
/// (tc serves it from the same connection-tracking entries, the XDP link gone), and at XDP
/// again when XDP comes back.
#[test]
fn a_nodeport_flow_served_at_xdp_goes_on_through_tc_and_back() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    let metrics = ["--metrics-bind-address", "127.0.0.1:10249"];
    // The driver's hook.
    let mode = "native";
    let with_xdp = [metrics[0], metrics[1], "--xdp-mode", mode];
    t.start_agent_with(&with_xdp);
    let pin = t.bpffs.path().join(format!("link_xdp_{mode}_eth0"));
    assert!(pin.exists(), "native XDP on eth0: {:?}", t.bpffs.entries());
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"eth0\",mode=\"native\"}"),
        1
    );
    // The first flows may find node 2 or the client without a neighbour entry yet (tc
    // resolves it): not counted below.
    for node in [NODE1, NODE1_6] {
        let to = sa(node, 30082);
        answered(&t.client, &format!("TCP to {to}"), move || {
            tcp_once(to, ANSWER)
        });
        answered(&t.client, &format!("UDP to {to}"), move || {
            udp_once(to, ANSWER)
        });
    }
    let new = |t: &Topo| [XDP_NEW, TC_NEW].map(|l| node1_metric(t, l));
    let b = new(&t);
    for node in [NODE1, NODE1_6] {
        let to = sa(node, 30082);
        let got = in_ns(&t.client, move || udp_once(to, ANSWER))
            .unwrap_or_else(|e| panic!("a new UDP flow to {to}: {e}"));
        assert_eq!((got.backend.as_str(), got.saw), ("pod2", ip(node)), "UDP");
    }
    let conns: Vec<(TcpStream, &'static str)> = [NODE1, NODE1_6]
        .into_iter()
        .map(|node| {
            let to = sa(node, 30082);
            let c = in_ns(&t.client, move || {
                TcpStream::connect_timeout(&to, ANSWER).expect("a connection")
            });
            (c, node)
        })
        .collect();

    let before =
        |t: &Topo| [XDP_CT_HIT, XDP_REPLY, TC_CT_HIT, TC_REPLY].map(|l| node1_metric(t, l));
    talk(&conns, 1, "first exchange");
    let a = new(&t);
    assert!(
        a[0] - b[0] >= 4 && a[1] == b[1],
        "XDP started the UDP flows and the connections, tc none: {b:?} -> {a:?}"
    );
    let b = before(&t);
    talk(&conns, 20, "at XDP");
    let a = before(&t);
    // Each exchange is a segment each way at least (data, its answer), both families.
    assert!(
        a[0] - b[0] >= 40,
        "XDP served the client's segments: {b:?} -> {a:?}"
    );
    assert!(
        a[1] - b[1] >= 40,
        "XDP served the backend's replies: {b:?} -> {a:?}"
    );
    assert!(
        a[2] - b[2] < 4 && a[3] - b[3] < 4,
        "tc saw (nearly) none of them: {b:?} -> {a:?}"
    );

    // tc alone: the agent restarted without XDP detaches it; the connections go on.
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&metrics);
    assert!(!pin.exists(), "the XDP link stays without --xdp-mode");
    let b = before(&t);
    talk(&conns, 10, "tc alone");
    let a = before(&t);
    assert_eq!((a[0], a[1]), (b[0], b[1]), "XDP detached, yet counting");
    assert!(
        a[2] - b[2] >= 20 && a[3] - b[3] >= 20,
        "tc served them: {b:?} -> {a:?}"
    );

    // And back to XDP.
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&with_xdp);
    assert!(pin.exists(), "native XDP on eth0 again");
    let b = before(&t);
    talk(&conns, 10, "at XDP again");
    let a = before(&t);
    assert!(
        a[0] - b[0] >= 20 && a[1] - b[1] >= 20,
        "XDP served them again: {b:?} -> {a:?}"
    );

    // Uninstall removes the XDP link with the others.
    drop(conns);
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    svc_tests::agent::uninstall(&t.tools.agent, t.bpffs.path(), Some(t.cgroup.path()))
        .expect("uninstall");
    assert!(!pin.exists());
    let link = t.node1.ip(["-d", "link", "show", "dev", "eth0"]).unwrap();
    assert!(!link.contains("xdp"), "an XDP program left on eth0: {link}");
}

/// The id of the bpf link pinned at `pin`.
fn pinned_link_id(pin: &std::path::Path) -> Option<u64> {
    let out = std::process::Command::new("bpftool")
        .args(["-j", "link", "show", "pinned"])
        .arg(pin)
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v["id"].as_u64()
}

/// svc's XDP link removed under a running agent, by unpinning it (its last reference) or by
/// `bpftool link detach`, is put back by the agent's pin check, and XDP serves the device's
/// flows again: an open connection goes on through tc meanwhile and at XDP after.
#[test]
fn a_removed_xdp_link_is_put_back() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.start_agent_with(&[
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--xdp-mode",
        "native",
        "--check-interval-ms",
        "100",
    ]);
    let pin = t.bpffs.path().join("link_xdp_native_eth0");
    let to = sa(NODE1, 30082);
    answered(&t.client, &format!("TCP to {to}"), move || {
        tcp_once(to, ANSWER)
    });
    let c = in_ns(&t.client, move || {
        TcpStream::connect_timeout(&to, ANSWER).expect("a connection")
    });
    let conns = [(c, NODE1)];
    talk(&conns, 5, "before");

    let first = pinned_link_id(&pin).expect("the XDP link");
    std::fs::remove_file(&pin).expect("unpinning the XDP link");
    talk(&conns, 5, "unpinned");
    let second = poll(Duration::from_secs(5), || {
        Ok(pinned_link_id(&pin).filter(|id| *id != first))
    })
    .unwrap_or_else(|e| panic!("not put back after the unpin: {e:#}\n{}", t.agent().log()));
    let b = node1_metric(&t, XDP_CT_HIT);
    talk(&conns, 10, "put back after the unpin");
    assert!(node1_metric(&t, XDP_CT_HIT) >= b + 10, "XDP serves again");

    let out = std::process::Command::new("bpftool")
        .args(["link", "detach", "id", &second.to_string()])
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    talk(&conns, 5, "detached");
    poll(Duration::from_secs(5), || {
        Ok(pinned_link_id(&pin).filter(|id| *id != second))
    })
    .unwrap_or_else(|e| panic!("not put back after the detach: {e:#}\n{}", t.agent().log()));
    let b = node1_metric(&t, XDP_CT_HIT);
    talk(&conns, 10, "put back after the detach");
    assert!(node1_metric(&t, XDP_CT_HIT) >= b + 10, "XDP serves again");
    let log = t.agent().log();
    assert!(
        log.contains("link_xdp_native_eth0 had disappeared; put back"),
        "{log}"
    );
    assert_eq!(
        node1_metric(&t, "svc_datapath_repairs_total{what=\"pin\"}"),
        2
    );
}

/// `--xdp-mode native` on an external device whose driver has no native XDP (a macvlan, on a
/// link of its own between the client and node 1) leaves it to tc, and says so: one warning
/// naming the device and the kernel's error (not repeated by the pin check, repeated by the
/// next agent, which tries again), `list` ("mv0 (tc: driver has no native XDP)") and /metrics
/// (`svc_xdp_device{device="mv0",mode="tc"} 1`); no XDP program is on the device, the generic
/// link a previous agent (`--xdp-mode generic`) left there included, and a NodePort connection
/// in by it is served by tc. XDP off takes the record away, and `uninstall` removes it.
#[test]
fn a_device_whose_driver_refuses_native_xdp_is_left_to_tc() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    // client eth9 -- low9 (node 1) carrying macvlan mv0, which holds node 1's address on the
    // link. low9 answers no ARP for it, so the client's packets come in by mv0.
    veth_pair(&t.client, "eth9", &t.node1, "low9").expect("a link from the client to node 1");
    t.node1
        .sysctl("net.ipv4.conf.low9.arp_ignore=1")
        .expect("arp_ignore");
    t.node1
        .ip([
            "link", "add", "mv0", "link", "low9", "type", "macvlan", "mode", "bridge",
        ])
        .expect("a macvlan");
    t.node1.ip(["link", "set", "mv0", "up"]).unwrap();
    t.node1.add_addr("mv0", "10.80.0.1/24").unwrap();
    t.client.add_addr("eth9", "10.80.0.100/24").unwrap();
    ethtool(&t.client, &["-K", "eth9", "tx", "off"]);
    let args = |mode: &'static str| -> Vec<&'static str> {
        let mut a = vec![
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--devices",
            "eth0,mv0",
            "--nodeport-addresses",
            "primary,10.80.0.0/24",
            "--check-interval-ms",
            "100",
        ];
        if mode != "off" {
            a.extend(["--xdp-mode", mode]);
        }
        a
    };
    let dir = t.bpffs.path().to_path_buf();
    let pin = |mode: &str, dev: &str| dir.join(format!("link_xdp_{mode}_{dev}"));
    let refusals = |t: &mut Topo| {
        let log = t.agent().log();
        log.lines()
            .filter(|l| l.contains("native XDP refused") && l.contains("mv0"))
            .count()
    };
    let restart = |t: &mut Topo, mode: &'static str| {
        if t.agent.is_some() {
            t.agent().terminate(Duration::from_secs(10)).expect("stop");
            t.agent = None;
        }
        t.start_agent_with(&args(mode));
    };

    // A previous agent's generic links: `generic` still attaches everywhere.
    restart(&mut t, "generic");
    for dev in ["eth0", "mv0"] {
        assert!(
            pin("generic", dev).exists(),
            "generic XDP on {dev}: {:?}",
            t.bpffs.entries()
        );
    }

    restart(&mut t, "native");
    assert!(pin("native", "eth0").exists(), "{:?}", t.bpffs.entries());
    assert!(
        !pin("generic", "mv0").exists() && !pin("native", "mv0").exists(),
        "an XDP link on mv0: {:?}",
        t.bpffs.entries()
    );
    let link = t.node1.ip(["-d", "link", "show", "dev", "mv0"]).unwrap();
    assert!(!link.contains("xdp"), "an XDP program on mv0: {link}");
    let net = run_in(&t.node1, &["bpftool", "net", "show", "dev", "mv0"]);
    let xdp_section: Vec<&str> = net
        .lines()
        .skip_while(|l| !l.starts_with("xdp:"))
        .skip(1)
        .take_while(|l| !l.ends_with(':'))
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert!(xdp_section.is_empty(), "bpftool net show dev mv0:\n{net}");
    let log = t.agent().log();
    let warning = log
        .lines()
        .find(|l| l.contains("native XDP refused") && l.contains("mv0"))
        .unwrap_or_else(|| panic!("no warning about mv0:\n{log}"));
    assert!(
        warning.contains("Operation not supported") && warning.contains("tc serves it"),
        "{warning}"
    );
    let listed = t.list(&[]);
    assert!(
        listed.contains("XDP: eth0 (native), mv0 (tc: driver has no native XDP)"),
        "{listed}"
    );
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"mv0\",mode=\"tc\"}"),
        1
    );
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"eth0\",mode=\"native\"}"),
        1
    );
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"mv0\",mode=\"generic\"}"),
        0
    );

    // tc serves a NodePort connection in by mv0.
    const TC_NEW_MV0: &str = "svc_packet_decisions_total{device=\"mv0\",reason=\"new\"}";
    const XDP_NEW_MV0: &str = "svc_packet_decisions_total{device=\"mv0\",reason=\"xdp_new\"}";
    let np = sa("10.80.0.1", 30082);
    let b = node1_metric(&t, TC_NEW_MV0);
    let got = answered(&t.client, "NodePort via mv0", move || tcp_once(np, ANSWER));
    assert_eq!(
        (got.backend.as_str(), got.saw),
        ("pod2", ip(NODE1)),
        "{got:?}"
    );
    let c = in_ns(&t.client, move || {
        TcpStream::connect_timeout(&np, ANSWER).expect("a connection")
    });
    talk(&[(c, NODE1)], 5, "via mv0");
    assert!(node1_metric(&t, TC_NEW_MV0) > b, "tc started the flows");
    assert_eq!(node1_metric(&t, XDP_NEW_MV0), 0);

    // Remembered: the pin check (every 100 ms) neither tries again nor warns again.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(refusals(&mut t), 1, "{}", t.agent().log());
    assert!(!pin("generic", "mv0").exists() && !pin("native", "mv0").exists());

    // XDP off: the record goes with the links.
    restart(&mut t, "off");
    let listed = t.list(&[]);
    assert!(!listed.contains("XDP:"), "{listed}");
    assert!(
        !t.bpffs.entries().iter().any(|e| e.contains("xdp_")),
        "{:?}",
        t.bpffs.entries()
    );

    // A new agent tries again (a new driver may have come), and says so again.
    restart(&mut t, "native");
    assert_eq!(refusals(&mut t), 1, "{}", t.agent().log());
    let listed = t.list(&[]);
    assert!(
        listed.contains("mv0 (tc: driver has no native XDP)"),
        "{listed}"
    );

    // `uninstall` removes the record with the pins (else the directory would stay).
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    svc_tests::agent::uninstall(&t.tools.agent, t.bpffs.path(), Some(t.cgroup.path()))
        .expect("uninstall");
    assert!(!t.bpffs.path().exists(), "{:?}", t.bpffs.entries());
}

/// A kernel that refuses the XDP program itself (Debian 12's 6.1: "BPF program is too
/// large"; here `SVC_TEST_XDP_REFUSED`, which makes the agent take it as refused) does not
/// stop the agent under `--xdp-mode native`: one warning naming the refusal, every device
/// left to tc (`list`: "eth0 (tc: kernel refused the XDP program)", /metrics
/// `svc_xdp_device{device="eth0",mode="tc"} 1`), the native link an earlier agent pinned
/// detached rather than kept, and NodePort flows served by tc. `--xdp-mode off` does not
/// load the program at all (no refusal to warn about) and takes the record away.
#[test]
fn a_kernel_refusing_the_xdp_program_leaves_every_device_to_tc() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    let pin = t.bpffs.path().join("link_xdp_native_eth0");
    let refusals = |t: &mut Topo| {
        let log = t.agent().log();
        log.lines()
            .filter(|l| l.contains("xdp_ext: refused by the kernel"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // An earlier agent's native link on eth0.
    t.start_agent_with(&["--xdp-mode", "native"]);
    assert!(pin.exists(), "native XDP on eth0: {:?}", t.bpffs.entries());
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;

    t.agent_env = vec!["SVC_TEST_XDP_REFUSED=1".into()];
    let args = |mode: &'static str| {
        vec![
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--check-interval-ms",
            "100",
            "--xdp-mode",
            mode,
        ]
    };
    t.start_agent_with(&args("native"));
    let warned = refusals(&mut t);
    assert!(
        warned.len() == 1
            && warned[0].contains("SVC_TEST_XDP_REFUSED")
            && warned[0].contains("every device left to tc"),
        "{warned:?}\n{}",
        t.agent().log()
    );
    assert!(
        !pin.exists(),
        "the native link kept: {:?}",
        t.bpffs.entries()
    );
    let link = t.node1.ip(["-d", "link", "show", "dev", "eth0"]).unwrap();
    assert!(!link.contains("xdp"), "an XDP program on eth0: {link}");
    let listed = t.list(&[]);
    assert!(
        listed.contains("XDP: eth0 (tc: kernel refused the XDP program)"),
        "{listed}"
    );
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"eth0\",mode=\"tc\"}"),
        1
    );
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"eth0\",mode=\"native\"}"),
        0
    );
    // tc serves new NodePort flows, XDP none.
    let np = sa(NODE1, 30082);
    answered(&t.client, "NodePort", move || tcp_once(np, ANSWER));
    let b = [XDP_NEW, TC_NEW].map(|l| node1_metric(&t, l));
    for _ in 0..3 {
        let got = in_ns(&t.client, move || tcp_once(np, ANSWER))
            .unwrap_or_else(|e| panic!("a NodePort connection: {e}"));
        assert_eq!((got.backend.as_str(), got.saw), ("pod2", ip(NODE1)));
    }
    let a = [XDP_NEW, TC_NEW].map(|l| node1_metric(&t, l));
    assert!(
        a[0] == b[0] && a[1] - b[1] >= 3,
        "tc served the flows, XDP none: {b:?} -> {a:?}"
    );
    // The pin check neither puts a link back nor warns again.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!pin.exists(), "a link put back: {:?}", t.bpffs.entries());
    assert_eq!(refusals(&mut t).len(), 1, "{}", t.agent().log());

    // XDP off: the program is not loaded (no refusal), the record goes.
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&args("off"));
    assert!(refusals(&mut t).is_empty(), "{}", t.agent().log());
    let listed = t.list(&[]);
    assert!(
        !listed.contains("kernel refused the XDP program"),
        "{listed}"
    );
    assert_eq!(
        node1_metric(&t, "svc_xdp_device{device=\"eth0\",mode=\"tc\"}"),
        0
    );
    let got = in_ns(&t.client, move || tcp_once(np, ANSWER))
        .unwrap_or_else(|e| panic!("a NodePort connection with XDP off: {e}"));
    assert_eq!(got.backend, "pod2");
}

/// Starts node 1's agent (metrics on 127.0.0.1:10249) with XDP in `mode` on eth0 and eth1,
/// `extra` flags after, and checks that each device carries a link of that mode.
fn start_xdp_agent(t: &mut Topo, mode: &str, extra: &[&str]) {
    let mut flags = vec![
        "--metrics-bind-address",
        "127.0.0.1:10249",
        "--xdp-mode",
        mode,
        "--devices",
        "eth0,eth1",
    ];
    flags.extend(extra);
    t.start_agent_with(&flags);
    for dev in ["eth0", "eth1"] {
        let pin = t.bpffs.path().join(format!("link_xdp_{mode}_{dev}"));
        assert!(pin.exists(), "{mode} XDP on {dev}: {:?}", t.bpffs.entries());
    }
}

/// Stops node 1's agent and starts it again as `start_xdp_agent` does.
fn restart_xdp_agent(t: &mut Topo, mode: &str, extra: &[&str]) {
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    start_xdp_agent(t, mode, extra);
}

/// A NodePort flow that comes in by node 1's `eth0` and whose backend (pod 2) is routed through
/// `eth1` is sent on at XDP with a redirect into `eth1`, and pod 2's replies coming back on
/// `eth1` are redirected into `eth0`, when both devices carry svc's XDP program natively
/// (`--devices eth0,eth1 --xdp-mode native`): the connection works, pod 2 sees node 1's
/// `eth1` address (the route's source, SNATed), and the redirects are counted under the device
/// each packet came in on, tc seeing (nearly) none of the flow's packets. Each veth's far end
/// runs an XDP program, without which the redirected frames are not picked up
/// (docs/design/xdp.md). With `--xdp-mode generic` every device is a target (the skb path
/// takes the redirect), a veth whose far end has no XDP program too; switching modes across
/// restarts leaves no device of the other mode a target.
#[test]
fn a_nodeport_flow_leaving_by_another_device_is_redirected_at_xdp() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    // node 1 -- eth1 -- node 2, a more specific route each way: pod 2 from node 1, and node
    // 1's eth1 address is on node 2's link.
    veth_pair(&t.node1, "eth1", &t.node2, "eth1").expect("a second link between the nodes");
    t.node1.add_addr("eth1", "10.79.0.1/24").unwrap();
    t.node2.add_addr("eth1", "10.79.0.2/24").unwrap();
    t.node1
        .ip(["route", "add", &format!("{POD2}/32"), "via", "10.79.0.2"])
        .expect("pod 2 over eth1");
    let peer2 = svc_tests::xdp::XdpPass::attach(&t.node2, "eth1").expect("XDP on eth1's peer");
    start_xdp_agent(&mut t, "native", &[]);
    let np = sa(NODE1, 30082);
    let via_eth1 = ip("10.79.0.1");
    // The first flows may find a neighbour entry missing (tc resolves it): not counted below.
    for _ in 0..2 {
        let got = answered(&t.client, "NodePort via eth1", move || tcp_once(np, ANSWER));
        assert_eq!(
            (got.backend.as_str(), got.saw),
            ("pod2", via_eth1),
            "{got:?}"
        );
    }
    const REDIRECT: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_redirect\"}";
    const REDIRECT_REPLY: &str =
        "svc_packet_decisions_total{device=\"eth1\",reason=\"xdp_redirect_reply\"}";
    const PASS_ROUTE: &str =
        "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_pass_route\"}";
    const TC_REPLY_ETH1: &str = "svc_packet_decisions_total{device=\"eth1\",reason=\"reply\"}";
    let counts = |t: &Topo| {
        [
            REDIRECT,
            REDIRECT_REPLY,
            PASS_ROUTE,
            TC_CT_HIT,
            TC_REPLY_ETH1,
            XDP_NEW,
        ]
        .map(|l| node1_metric(t, l))
    };
    let b = counts(&t);
    let c = in_ns(&t.client, move || {
        TcpStream::connect_timeout(&np, ANSWER).expect("a connection")
    });
    for i in 0..20 {
        let a = exchange(&c).unwrap_or_else(|e| panic!("exchange {i}: {e}"));
        assert_eq!(
            (a.backend.as_str(), a.saw),
            ("pod2", via_eth1),
            "exchange {i}"
        );
    }
    let a = counts(&t);
    assert!(
        a[5] - b[5] >= 1 && a[0] - b[0] >= 21,
        "the SYN and the client's segments redirected into eth1 at XDP: {b:?} -> {a:?}"
    );
    assert!(
        a[1] - b[1] >= 21,
        "pod 2's replies redirected into eth0 at XDP: {b:?} -> {a:?}"
    );
    assert!(
        a[2] - b[2] < 4 && a[3] - b[3] < 4 && a[4] - b[4] < 4,
        "passed to tc (nearly) never: {b:?} -> {a:?}"
    );
    let talk_via_eth1 = |n: usize, when: &str| {
        for i in 0..n {
            let a = exchange(&c).unwrap_or_else(|e| panic!("{when}: exchange {i}: {e}"));
            assert_eq!(
                (a.backend.as_str(), a.saw),
                ("pod2", via_eth1),
                "{when}: exchange {i}"
            );
        }
    };

    // A restarted agent swaps its program into the pinned links and keeps the pinned map of
    // redirect targets: the open connection goes on at XDP.
    restart_xdp_agent(&mut t, "native", &["--check-interval-ms", "100"]);
    let b = counts(&t);
    talk_via_eth1(10, "after a restart");
    let a = counts(&t);
    assert!(
        a[0] - b[0] >= 10 && a[1] - b[1] >= 10,
        "redirected at XDP after the restart: {b:?} -> {a:?}"
    );

    // eth1's peer loses its XDP program: eth1 no longer takes redirected frames (the kernel
    // would drop them), so the agent's check takes it out of the targets, and the client's
    // packets go on through tc; the replies, in on eth1, are still redirected into eth0.
    drop(peer2);
    let warning = "the device does not take redirected XDP frames";
    poll(Duration::from_secs(5), || {
        Ok(t.agent().log().contains(warning).then_some(()))
    })
    .unwrap_or_else(|e| panic!("no warning about eth1: {e:#}\n{}", t.agent().log()));
    let b = counts(&t);
    talk_via_eth1(10, "eth1's peer without XDP");
    let a = counts(&t);
    assert!(
        a[0] == b[0] && a[2] - b[2] >= 10 && a[1] - b[1] >= 10,
        "the client's packets through tc, the replies redirected: {b:?} -> {a:?}"
    );

    // The generic hook: every device running it is a target, eth1 without an XDP program on
    // its peer too (a generic redirect goes through the skb path, which any device takes).
    // The open connection and a new one are redirected each way at XDP, tc sees (nearly) none
    // of their packets, and the frames leave by eth1 (its transmit counter moves with them).
    restart_xdp_agent(&mut t, "generic", &["--check-interval-ms", "100"]);
    let eth1_tx = |t: &Topo| -> u64 {
        let out = t
            .node1
            .ip(["-j", "-s", "link", "show", "dev", "eth1"])
            .unwrap();
        let v: Value = serde_json::from_str(&out).expect("ip -j");
        v[0]["stats64"]["tx"]["packets"]
            .as_u64()
            .expect("tx packets")
    };
    let (b, tx) = (counts(&t), eth1_tx(&t));
    talk_via_eth1(10, "generic");
    let c2 = in_ns(&t.client, move || {
        TcpStream::connect_timeout(&np, ANSWER).expect("a connection")
    });
    for i in 0..10 {
        let a = exchange(&c2).unwrap_or_else(|e| panic!("generic, new connection: {i}: {e}"));
        assert_eq!(
            (a.backend.as_str(), a.saw),
            ("pod2", via_eth1),
            "exchange {i}"
        );
    }
    let (a, tx2) = (counts(&t), eth1_tx(&t));
    assert!(
        a[0] - b[0] >= 21 && a[1] - b[1] >= 21 && a[5] - b[5] >= 1,
        "redirected with the generic hook, the new connection's SYN too: {b:?} -> {a:?}"
    );
    assert!(
        a[2] - b[2] < 4 && a[3] - b[3] < 4 && a[4] - b[4] < 4,
        "passed to tc (nearly) never: {b:?} -> {a:?}"
    );
    assert!(
        tx2 - tx >= a[0] - b[0],
        "eth1 sent the redirected frames: {tx} -> {tx2}, {b:?} -> {a:?}"
    );
    eprintln!(
        "generic: {} client packets redirected into eth1, {} replies into eth0; eth1 sent {} \
         frames",
        a[0] - b[0],
        a[1] - b[1],
        tx2 - tx
    );

    // The pin check puts a removed generic link back, and eth1 is a target again.
    let pin = t.bpffs.path().join("link_xdp_generic_eth1");
    let first = pinned_link_id(&pin).expect("the XDP link");
    std::fs::remove_file(&pin).expect("unpinning the XDP link");
    poll(Duration::from_secs(5), || {
        Ok(pinned_link_id(&pin).filter(|id| *id != first))
    })
    .unwrap_or_else(|e| panic!("not put back: {e:#}\n{}", t.agent().log()));
    let b = counts(&t);
    talk_via_eth1(10, "generic, put back");
    let a = counts(&t);
    assert!(
        a[0] - b[0] >= 10 && a[1] - b[1] >= 10,
        "redirected after the repair: {b:?} -> {a:?}"
    );

    // Back to native: the generic devices leave the targets before their links change, so
    // eth1, whose peer has no XDP program, is none (a native redirect into it would be
    // dropped): the client's packets go through tc, the replies into eth0 at XDP.
    restart_xdp_agent(&mut t, "native", &[]);
    let b = counts(&t);
    talk_via_eth1(10, "native again");
    let a = counts(&t);
    assert!(
        a[0] == b[0] && a[2] - b[2] >= 10 && a[1] - b[1] >= 10,
        "the client's packets through tc, the replies redirected: {b:?} -> {a:?}"
    );
}

/// A second link between the nodes, `dev` on both (node 1 10.`net`.0.1/24 and fd`net`::1/64,
/// node 2 .2 and ::2), over which node 1 routes pod 2 in both families when `to_pod2` (more
/// specific routes than the lan's); node 2 reaches node 1's addresses there on the link, so
/// pod 2's replies to them come back by it.
fn link_nodes(t: &Topo, dev: &str, net: u8, to_pod2: bool) {
    veth_pair(&t.node1, dev, &t.node2, dev).expect("a second link between the nodes");
    for (ns, host) in [(&t.node1, 1), (&t.node2, 2)] {
        ns.add_addr(dev, &format!("10.{net}.0.{host}/24")).unwrap();
        ns.add_addr(dev, &format!("fd{net}::{host}/64")).unwrap();
    }
    if to_pod2 {
        t.node1
            .ip([
                "route",
                "add",
                &format!("{POD2}/32"),
                "via",
                &format!("10.{net}.0.2"),
            ])
            .expect("pod 2 over the second link");
        t.node1
            .ip([
                "-6",
                "route",
                "add",
                &format!("{POD2_6}/128"),
                "via",
                &format!("fd{net}::2"),
            ])
            .expect("pod 2 over the second link, IPv6");
    }
}

/// The counters of a flow that comes in by node 1's eth0 and leaves by eth1.
const REDIRECT_ETH0: &str = "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_redirect\"}";
const REDIRECT_REPLY_ETH1: &str =
    "svc_packet_decisions_total{device=\"eth1\",reason=\"xdp_redirect_reply\"}";
const XDP_REPLY_ETH1: &str = "svc_packet_decisions_total{device=\"eth1\",reason=\"xdp_reply\"}";
const PASS_ROUTE_ETH0: &str =
    "svc_packet_decisions_total{device=\"eth0\",reason=\"xdp_pass_route\"}";
const TC_REPLY_ETH1_: &str = "svc_packet_decisions_total{device=\"eth1\",reason=\"reply\"}";

/// A UDP socket of `to`'s family in the client's namespace, connected to `to`.
fn udp_connected(ns: &NetNs, to: SocketAddr) -> UdpSocket {
    in_ns(ns, move || {
        let any: SocketAddr = if to.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let s = UdpSocket::bind(any).expect("bind");
        s.connect(to).expect("connect");
        s.set_read_timeout(Some(ANSWER)).expect("timeout");
        s
    })
}

/// The IPv6 and UDP sides of `a_nodeport_flow_leaving_by_another_device_is_redirected_at_xdp`
/// (IPv4 TCP): a NodePort TCP connection over IPv6, and a UDP flow over IPv4 and over IPv6,
/// coming in by node 1's `eth0` with pod 2 routed through `eth1`, are sent on at XDP with a
/// redirect into `eth1` from their first packet, and pod 2's replies coming back on `eth1` are
/// redirected into `eth0` (`--devices eth0,eth1 --xdp-mode native`, each veth's far end
/// running an XDP program): every exchange is answered, pod 2 sees node 1's `eth1` address of
/// the family (the route's source, SNATed), and each flow's packets move `xdp_new`,
/// `xdp_ct_hit` and `xdp_redirect` under eth0 and `xdp_reply` and `xdp_redirect_reply` under
/// eth1 by at least the packets exchanged, tc seeing (nearly) none of them.
#[test]
fn ipv6_and_udp_nodeport_flows_leaving_by_another_device_are_redirected_at_xdp() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    link_nodes(&t, "eth1", 79, true);
    let _peer2 = svc_tests::xdp::XdpPass::attach(&t.node2, "eth1").expect("XDP on eth1's peer");
    start_xdp_agent(&mut t, "native", &[]);
    let families = [(NODE1, ip("10.79.0.1")), (NODE1_6, ip("fd79::1"))];
    // The first flows may find a neighbour entry missing (tc resolves it): not counted below.
    for (node, snat) in families {
        let np = sa(node, 30082);
        for _ in 0..2 {
            let got = answered(&t.client, &format!("TCP to {np}"), move || {
                tcp_once(np, ANSWER)
            });
            assert_eq!((got.backend.as_str(), got.saw), ("pod2", snat), "{got:?}");
            let got = answered(&t.client, &format!("UDP to {np}"), move || {
                udp_once(np, ANSWER)
            });
            assert_eq!((got.backend.as_str(), got.saw), ("pod2", snat), "{got:?}");
        }
    }
    let counts = |t: &Topo| {
        [
            XDP_NEW,
            XDP_CT_HIT,
            REDIRECT_ETH0,
            XDP_REPLY_ETH1,
            REDIRECT_REPLY_ETH1,
            PASS_ROUTE_ETH0,
            TC_NEW,
            TC_CT_HIT,
            TC_REPLY_ETH1_,
        ]
        .map(|l| node1_metric(t, l))
    };
    const N: u64 = 20;
    for (what, node, snat, tcp) in [
        ("TCP over IPv6", NODE1_6, families[1].1, true),
        ("UDP over IPv4", NODE1, families[0].1, false),
        ("UDP over IPv6", NODE1_6, families[1].1, false),
    ] {
        let np = sa(node, 30082);
        let b = counts(&t);
        if tcp {
            let c = in_ns(&t.client, move || {
                TcpStream::connect_timeout(&np, ANSWER).expect("a connection")
            });
            for i in 0..N {
                let a = exchange(&c).unwrap_or_else(|e| panic!("{what}: exchange {i}: {e}"));
                assert_eq!((a.backend.as_str(), a.saw), ("pod2", snat), "{what}: {i}");
            }
        } else {
            let s = udp_connected(&t.client, np);
            for i in 0..N {
                let a = ask_udp(&s).unwrap_or_else(|e| panic!("{what}: datagram {i}: {e}"));
                assert_eq!((a.backend.as_str(), a.saw), ("pod2", snat), "{what}: {i}");
            }
        }
        let a = counts(&t);
        let d: Vec<u64> = a.iter().zip(&b).map(|(a, b)| a - b).collect();
        // The client's packets: TCP's SYN and N data segments (its ACKs on top), UDP's N
        // datagrams, the first of them starting the flow. Pod 2's: TCP's SYN-ACK and N
        // answers, UDP's N answers.
        let (sent, known) = if tcp { (N + 1, N) } else { (N, N - 1) };
        assert!(
            d[0] >= 1 && d[1] >= known && d[2] >= sent,
            "{what}: the flow started at XDP and its {sent} client packets redirected into \
             eth1 (xdp_new, xdp_ct_hit, xdp_redirect): {b:?} -> {a:?}"
        );
        assert!(
            d[3] >= sent && d[4] >= sent,
            "{what}: pod 2's {sent} replies redirected into eth0 (xdp_reply, \
             xdp_redirect_reply): {b:?} -> {a:?}"
        );
        assert!(
            d[5] < 4 && d[6] == 0 && d[7] < 4 && d[8] < 4,
            "{what}: passed to tc (nearly) never: {b:?} -> {a:?}"
        );
    }
}

/// The redirect targets pinned in `SVC_XDP_DEVS` (ifindexes), each checked to name itself as
/// the kernel's `struct bpf_devmap_val` it holds; None while the map is not pinned.
fn xdp_targets(t: &Topo) -> Option<BTreeSet<u32>> {
    let pin = svc_agent::datapath::map_pin(t.bpffs.path(), svc_common::map_names::XDP_DEVS);
    if !pin.exists() {
        return None;
    }
    let data =
        aya::maps::MapData::from_pin(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
    let map = aya::maps::DevMapHash::<_>::try_from(aya::maps::Map::DevMapHash(data))
        .expect("SVC_XDP_DEVS is a DEVMAP_HASH");
    let mut out = BTreeSet::new();
    for key in map.keys() {
        let key = key.expect("a key of SVC_XDP_DEVS");
        let value = map.get(key, 0).expect("its value");
        assert_eq!(
            value.if_index, key,
            "SVC_XDP_DEVS [{key}] redirects elsewhere"
        );
        assert!(
            value.prog_id.is_none(),
            "SVC_XDP_DEVS [{key}] chains a program"
        );
        out.insert(key);
    }
    Some(out)
}

/// The ifindexes of `devs` in node 1.
fn node1_ifindexes(t: &Topo, devs: &[&'static str]) -> BTreeSet<u32> {
    let devs = devs.to_vec();
    t.node1
        .run_in(move || {
            devs.iter()
                .map(|d| svc_tests::xdp::ifindex(d).expect("a device of node 1"))
                .collect()
        })
        .expect("node 1")
}

/// Whether node 1's `dev` takes redirected XDP frames (`ndo-xmit` in its `xdp-features`).
fn takes_redirects(t: &Topo, dev: &'static str) -> bool {
    t.node1
        .run_in(move || {
            let i = svc_tests::xdp::ifindex(dev).expect("a device of node 1");
            svc_agent::netdev::xdp_features(i).expect("xdp-features")
                & svc_agent::netdev::XDP_ACT_NDO_XMIT
                != 0
        })
        .expect("node 1")
}

/// `SVC_XDP_DEVS` as pinned names exactly `want` (node 1's devices), within a few of the
/// agent's checks; the agent's log on failure.
fn assert_targets(t: &mut Topo, want: &[&'static str], when: &str) {
    let want = node1_ifindexes(t, want);
    let got = poll(Duration::from_secs(5), || {
        Ok(xdp_targets(t).filter(|got| *got == want))
    });
    if let Err(e) = got {
        panic!(
            "{when}: SVC_XDP_DEVS holds {:?}, not {want:?} ({e:#})\n{}",
            xdp_targets(t),
            t.agent().log()
        );
    }
}

/// The XDP link pins in node 1's bpffs directory, as `<mode>_<device>`.
fn xdp_link_pins(t: &Topo) -> BTreeSet<String> {
    svc_agent::datapath::xdp_pins(t.bpffs.path())
        .into_iter()
        .map(|(_, mode, dev)| format!("{mode}_{dev}"))
        .collect()
}

/// The pinned map of XDP redirect targets (`SVC_XDP_DEVS`, docs/design/xdp.md, "Another
/// device") names exactly the devices that carry svc's XDP program natively and take
/// redirected frames (`ndo-xmit`): eth0 and eth1, whose veth far ends run an XDP program, not
/// eth2, native too but whose far end runs none. It stays so while the agent is SIGKILLed and
/// after it restarts; it follows eth1's far end losing and regaining its program within the
/// agent's checks; it is empty with `--xdp-mode off` and right again when native comes back;
/// under `generic` it names every device (generic redirects need no `ndo-xmit`), and native
/// after generic narrows it again; and `uninstall` removes it.
#[test]
fn the_pinned_xdp_redirect_targets_follow_kills_and_mode_switches() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 31, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    link_nodes(&t, "eth1", 79, true);
    link_nodes(&t, "eth2", 80, false);
    let peer2 = svc_tests::xdp::XdpPass::attach(&t.node2, "eth1").expect("XDP on eth1's peer");
    let devices = ["--devices", "eth0,eth1,eth2", "--check-interval-ms", "100"];
    let with_mode = |mode: &'static str| {
        let mut flags = devices.to_vec();
        flags.extend(["--xdp-mode", mode]);
        flags
    };
    let all_native: BTreeSet<String> = ["native_eth0", "native_eth1", "native_eth2"]
        .map(String::from)
        .into();

    t.start_agent_with(&with_mode("native"));
    assert_eq!(xdp_link_pins(&t), all_native);
    // What the test relies on: the far ends' programs give eth0 and eth1 ndo-xmit, and eth2
    // has none (svc's own program on a veth does not give it: the far end's does).
    assert!(takes_redirects(&t, "eth0") && takes_redirects(&t, "eth1"));
    assert!(!takes_redirects(&t, "eth2"), "eth2 takes redirects");
    assert_targets(&mut t, &["eth0", "eth1"], "native");

    // SIGKILL: nothing takes the map down, the links and their program stay, and the
    // restarted agent adopts both as they are.
    t.agent().kill().expect("SIGKILL");
    assert_eq!(
        xdp_targets(&t),
        Some(node1_ifindexes(&t, &["eth0", "eth1"])),
        "SVC_XDP_DEVS with the agent killed"
    );
    t.agent = None;
    t.start_agent_with(&with_mode("native"));
    assert_eq!(xdp_link_pins(&t), all_native);
    assert_targets(&mut t, &["eth0", "eth1"], "native after a SIGKILL");

    // eth1's far end loses its program, eth1 its ndo-xmit: out within a check, and back in
    // when the far end has one again.
    drop(peer2);
    assert_targets(&mut t, &["eth0"], "eth1's peer without XDP");
    let _peer2 = svc_tests::xdp::XdpPass::attach(&t.node2, "eth1").expect("XDP on eth1's peer");
    assert_targets(&mut t, &["eth0", "eth1"], "eth1's peer with XDP again");

    // Off (after a SIGKILL): no XDP link, no target.
    t.agent().kill().expect("SIGKILL");
    t.agent = None;
    t.start_agent_with(&with_mode("off"));
    assert_eq!(xdp_link_pins(&t), BTreeSet::new());
    assert_targets(&mut t, &[], "off");

    // Native again.
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&with_mode("native"));
    assert_eq!(xdp_link_pins(&t), all_native);
    assert_targets(&mut t, &["eth0", "eth1"], "native after off");

    // Generic: every device whose generic link holds is a target, eth2 too (a generic
    // redirect goes through the skb path, which any device takes).
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&with_mode("generic"));
    let all_generic: BTreeSet<String> = ["generic_eth0", "generic_eth1", "generic_eth2"]
        .map(String::from)
        .into();
    assert_eq!(xdp_link_pins(&t), all_generic);
    assert_targets(&mut t, &["eth0", "eth1", "eth2"], "generic");

    // Straight back to native: the generic links go, and only the native devices that take
    // redirected frames are targets again.
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&with_mode("native"));
    assert_eq!(xdp_link_pins(&t), all_native);
    assert_targets(&mut t, &["eth0", "eth1"], "native after generic");

    // Off, then uninstall: the map's pin goes with the others.
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    t.agent = None;
    t.start_agent_with(&with_mode("off"));
    assert_eq!(xdp_link_pins(&t), BTreeSet::new());
    assert_targets(&mut t, &[], "off after native");
    t.agent().terminate(Duration::from_secs(10)).expect("stop");
    svc_tests::agent::uninstall(&t.tools.agent, t.bpffs.path(), Some(t.cgroup.path()))
        .expect("uninstall");
    assert_eq!(xdp_targets(&t), None, "SVC_XDP_DEVS pinned after uninstall");
}

// Maglev across nodes (issue 35, docs/design/maglev.md).

/// The backend each flow (client address, client port) to `ip`:`port`/TCP gets through the
/// Maglev table of the external frontend pinned in `bpffs`, taken as the kernel's
/// `lb::pick_slot` takes it (`maglev_flow_hash` of the 5-tuple mod the table's size, the
/// entry mod the slot count, the slot's backend); with the frontend's backend count. None
/// while the frontend has no table.
fn maglev_choices(
    bpffs: &std::path::Path,
    ip: &str,
    port: u16,
    flows: &[([u8; 16], u16)],
) -> Option<(u16, Vec<SocketAddr>)> {
    use svc_agent::store::Store;
    let store = svc_agent::datapath::open_pinned(bpffs).ok()?;
    let snap = store.snapshot().ok()?;
    let ip: std::net::Ipv4Addr = ip.parse().unwrap();
    let daddr = svc_common::v4_mapped(ip.octets());
    let key = svc_common::ServiceKey {
        addr: daddr,
        port_be: port.to_be(),
        proto: svc_common::IPPROTO_TCP,
        scope: svc_common::scope::EXTERNAL,
    };
    let (_, v) = snap.services.iter().find(|(k, _)| *k == key)?;
    if v.flags & svc_common::svc_flags::MAGLEV == 0 {
        return None;
    }
    let (_, index) =
        (snap.maglev_index.iter()).find(|(k, _)| (k.id, k.rev, k.slot) == (v.id, v.rev, 0))?;
    let table = store
        .read_maglev(
            index.offset / svc_common::MAGLEV_BLOCK,
            svc_agent::maglev::blocks(index.size),
        )
        .ok()?;
    let seed = u64::from(index.seed[0]) | u64::from(index.seed[1]) << 32;
    let slots: BTreeMap<svc_common::SlotKey, svc_common::SlotGroup> =
        snap.slots.iter().copied().collect();
    let backends: BTreeMap<u32, svc_common::Backend> = snap.backends.iter().copied().collect();
    let choices = flows
        .iter()
        .map(|(saddr, sport)| {
            let h = svc_common::maglev_flow_hash(
                saddr,
                &daddr,
                sport.to_be(),
                port.to_be(),
                svc_common::IPPROTO_TCP,
                seed,
            );
            let pos = h % index.size;
            let e = table[(pos / svc_common::MAGLEV_BLOCK) as usize].entries
                [(pos % svc_common::MAGLEV_BLOCK) as usize];
            let (k, i) =
                svc_common::SlotKey::of_slot(v.id, v.rev, u32::from(e) % u32::from(v.count));
            let b = backends[&slots[&k].backends[i]];
            SocketAddr::new(
                svc_agent::reconcile::ip_from16(b.addr),
                u16::from_be(b.port_be),
            )
        })
        .collect();
    Some((v.count, choices))
}

/// `bpftool -j map dump pinned` of `map`'s pin under `bpffs`: its entries.
fn bpftool_dump(bpffs: &std::path::Path, map: &str) -> Vec<Value> {
    let pin = svc_agent::datapath::map_pin(bpffs, map);
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&pin)
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "bpftool map dump {}: {out:?}",
        pin.display()
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool's JSON");
    v.as_array().expect("a list of entries").clone()
}

/// `bpftool -j map dump pinned SVC_MAGLEV_INDEX`: each generation (id, rev) with the offset
/// and size of its table, as bpftool prints the BTF map (field names, not raw bytes).
fn bpftool_maglev_index(bpffs: &std::path::Path) -> BTreeMap<(u32, u16), (u64, u64)> {
    (bpftool_dump(bpffs, svc_common::map_names::MAGLEV_INDEX).iter())
        .map(|e| {
            // With BTF, bpftool -j prints the raw bytes and the fields under "formatted".
            let (k, v) = (&e["formatted"]["key"], &e["formatted"]["value"]);
            let field = |o: &Value, f: &str| {
                o[f].as_u64()
                    .unwrap_or_else(|| panic!("no field {f} in {e} (bpftool without BTF?)"))
            };
            (
                (field(k, "id") as u32, field(k, "rev") as u16),
                (field(v, "offset"), field(v, "size")),
            )
        })
        .collect()
}

/// The master entries (id, rev, count) of the IPv4 ExternalIP frontend `EXTERNAL_IP`:`port`
/// and the IPv4 NodePort `node_port` of one Service port (TCP), when both carry the Maglev
/// flag.
fn external_pair(
    bpffs: &std::path::Path,
    port: u16,
    node_port: u16,
) -> Option<[(u32, u16, u16); 2]> {
    use svc_agent::store::Store;
    let snap = svc_agent::datapath::open_pinned(bpffs)
        .ok()?
        .snapshot()
        .ok()?;
    let eip: std::net::Ipv4Addr = EXTERNAL_IP.parse().unwrap();
    let find = |addr: Option<[u8; 16]>, port: u16| {
        let (_, v) = snap.services.iter().find(|(k, v)| {
            k.port_be == port.to_be()
                && k.proto == svc_common::IPPROTO_TCP
                && k.scope == svc_common::scope::EXTERNAL
                && v.flags & svc_common::svc_flags::MAGLEV != 0
                && match addr {
                    Some(a) => k.addr == a,
                    None => svc_common::is_v4_mapped(&k.addr),
                }
        })?;
        Some((v.id, v.rev, v.count))
    };
    Some([
        find(Some(svc_common::v4_mapped(eip.octets())), port)?,
        find(None, node_port)?,
    ])
}

/// Service "ms": a NodePort (30141) with the ExternalIP `EXTERNAL_IP`, port 80, whose external
/// frontends get Maglev tables.
fn maglev_service() -> Value {
    service(
        "ms",
        "NodePort",
        41,
        30141,
        json!({"externalIPs": [EXTERNAL_IP]}),
        json!({}),
    )
}

/// The external frontends of one Service port, its ExternalIP and its NodePort (one family),
/// share one Maglev table: their index entries, as bpftool prints them, name the same offset.
/// A new endpoint moves both to one new table together (each by its own master entry), and
/// the old one's region, named by both old generations, goes with them after the grace
/// period.
#[test]
fn the_external_frontends_of_a_service_port_share_one_maglev_table() {
    let mut t = Topo::new();
    let pods = |n: u8| -> Vec<(String, String, &'static str)> {
        (1..=n)
            .map(|i| {
                (
                    format!("10.244.1.{}", 10 + i),
                    format!("fd00:244:1::{}", 10 + i),
                    "node-1",
                )
            })
            .collect()
    };
    let endpoints = |t: &Topo, n: u8| {
        let p = pods(n);
        let refs: Vec<(&str, &str, &str)> = p
            .iter()
            .map(|(a, b, c)| (a.as_str(), b.as_str(), *c))
            .collect();
        t.endpoints("ms", &refs);
    };
    t.service("ms", maglev_service());
    endpoints(&t, 3);
    t.start_agent_with(&["--retire-grace-ms", "500"]);
    let shared = |count: u16| {
        poll(Duration::from_secs(20), || {
            let Some([eip, np]) = external_pair(t.bpffs.path(), 80, 30141) else {
                return Ok(None);
            };
            if eip.2 != count || np.2 != count {
                return Ok(None);
            }
            let index = bpftool_maglev_index(t.bpffs.path());
            let (Some(a), Some(b)) = (index.get(&(eip.0, eip.1)), index.get(&(np.0, np.1))) else {
                return Ok(None);
            };
            Ok(Some((*a, *b, index)))
        })
        .unwrap_or_else(|e| panic!("both frontends with tables of {count} backends: {e}"))
    };
    let (eip3, np3, index) = shared(3);
    assert_eq!(eip3, np3, "one table for both: {index:?}");
    assert_eq!(eip3.1, 509, "a table of 3 backends");

    endpoints(&t, 4);
    let (eip4, np4, index) = shared(4);
    assert_eq!(eip4, np4, "one new table for both: {index:?}");
    assert_ne!(eip4.0, eip3.0, "written beside the old one");
    // The old generations go after the grace period, and nothing names the old table then.
    let gone = poll(Duration::from_secs(20), || {
        let index = bpftool_maglev_index(t.bpffs.path());
        Ok((!index.values().any(|(o, _)| *o == eip3.0)).then_some(index))
    })
    .unwrap_or_else(|e| panic!("the old table retired: {e}"));
    assert!(gone.values().any(|(o, _)| *o == eip4.0), "{gone:?}");
    // The pages of SVC_MAGLEV are those of the tables in use (this family's and the other's):
    // the old table's own went with it (bpftool prints them by field).
    let in_use = |index: &BTreeMap<(u32, u16), (u64, u64)>| -> Vec<u32> {
        let pages: std::collections::BTreeSet<u32> = (index.values())
            .flat_map(|(o, n)| maglev_pages_of(*o as u32, *n as u32))
            .collect();
        pages.into_iter().collect()
    };
    let tables = in_use(&gone);
    assert!(
        maglev_pages_of(eip3.0 as u32, eip3.1 as u32)
            .iter()
            .any(|p| !tables.contains(p)),
        "the old table had a page no table in use shares: {gone:?}"
    );
    poll(Duration::from_secs(10), || {
        let pages = bpftool_maglev_pages(t.bpffs.path());
        let index = bpftool_maglev_index(t.bpffs.path());
        Ok((pages.keys().copied().collect::<Vec<u32>>() == in_use(&index)).then_some(()))
    })
    .unwrap_or_else(|e| {
        panic!(
            "pages {:?} alone, not {:?}: {e}",
            in_use(&bpftool_maglev_index(t.bpffs.path())),
            bpftool_maglev_pages(t.bpffs.path()).keys()
        )
    });
}

/// The pages of `SVC_MAGLEV` a table of `size` entries at entry `offset` lies in.
fn maglev_pages_of(offset: u32, size: u32) -> Vec<u32> {
    let start = offset / svc_common::MAGLEV_BLOCK;
    let end = start + svc_agent::maglev::blocks(size);
    (start / svc_common::MAGLEV_PAGE..end.div_ceil(svc_common::MAGLEV_PAGE)).collect()
}

/// `bpftool -j map dump pinned SVC_MAGLEV`: each page by number, with its entries in order,
/// as bpftool prints the BTF map (blocks of entries by field name).
fn bpftool_maglev_pages(bpffs: &std::path::Path) -> BTreeMap<u32, Vec<u64>> {
    (bpftool_dump(bpffs, svc_common::map_names::MAGLEV).iter())
        .map(|e| {
            let (k, v) = (&e["formatted"]["key"], &e["formatted"]["value"]);
            let page = k
                .as_u64()
                .unwrap_or_else(|| panic!("no page number in {e}"));
            let blocks = v["blocks"]
                .as_array()
                .unwrap_or_else(|| panic!("no field blocks in {e} (bpftool without BTF?)"));
            let entries = (blocks.iter())
                .flat_map(|b| b["entries"].as_array().expect("a block's entries").clone())
                .map(|x| x.as_u64().expect("an entry"))
                .collect();
            (page as u32, entries)
        })
        .collect()
}

/// An agent taking over from one whose Maglev tables are in an array allocated in full
/// (`SVC_MAGLEV` of layout 1) carries them into pages allocated as written, where they were:
/// every flow to the external frontend gets the backend it got before, the new map is a hash
/// allocated as used with pages only where the tables are, and the old pin goes once the new
/// programs are attached. Layout 1's array is made here from the tables the running
/// datapath holds, pinned where such an agent left it, and the newer pin removed, as an
/// upgrade from that agent finds them. Without the carry the frontend has no table until
/// its next change: its flows are spread at random.
#[test]
fn maglev_tables_of_the_array_are_carried_into_pages() {
    use svc_agent::store::Store;
    let mut t = Topo::new();
    t.service("ms", maglev_service());
    t.endpoints(
        "ms",
        &[
            ("10.244.1.11", "fd00:244:1::11", "node-1"),
            ("10.244.1.12", "fd00:244:1::12", "node-1"),
            ("10.244.1.13", "fd00:244:1::13", "node-1"),
        ],
    );
    t.start_agent();
    // Flows of the test's own client range, hashed only.
    let flows: Vec<([u8; 16], u16)> = (0..400u16)
        .map(|i| {
            (
                svc_common::v4_mapped([192, 0, 2, (i % 50) as u8 + 1]),
                40_000 + i,
            )
        })
        .collect();
    let before = poll(Duration::from_secs(20), || {
        Ok(maglev_choices(t.bpffs.path(), EXTERNAL_IP, 80, &flows).filter(|(n, _)| *n == 3))
    })
    .unwrap_or_else(|e| panic!("a table of 3 backends: {e}"));
    let spread: std::collections::BTreeSet<&SocketAddr> = before.1.iter().collect();
    assert_eq!(spread.len(), 3, "every backend has flows: {spread:?}");
    t.agent().terminate(Duration::from_secs(10)).expect("stop");

    let dir = t.bpffs.path().to_path_buf();
    let tables: BTreeMap<u32, Vec<svc_common::MaglevBlock>> = {
        let store = svc_agent::datapath::open_pinned(&dir).expect("the pinned maps");
        let snap = store.snapshot().expect("a snapshot");
        (snap.maglev_index.iter())
            .map(|(_, v)| {
                let start = v.offset / svc_common::MAGLEV_BLOCK;
                let len = svc_agent::maglev::blocks(v.size);
                (start, store.read_maglev(start, len).expect("a table"))
            })
            .collect()
    };
    assert!(!tables.is_empty());
    let old: Vec<(u32, Vec<svc_common::MaglevBlock>)> = tables.clone().into_iter().collect();
    pins::pin_old_maglev(&dir, 4_096, &old).expect("layout 1's array");
    let pin = svc_agent::datapath::map_pin(&dir, svc_common::map_names::MAGLEV);
    std::fs::remove_file(&pin).expect("removing this layout's pin");

    t.agent().restart().expect("restart");
    t.agent()
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("ready again");
    let said = "carried the Maglev tables of layout 1 (an array) over into pages";
    assert!(t.agent().log().contains(said), "{}", t.agent().log());
    let after = maglev_choices(&dir, EXTERNAL_IP, 80, &flows).expect("a table after the upgrade");
    assert_eq!(after, before, "every flow keeps its backend");

    let store = svc_agent::datapath::open_pinned(&dir).expect("the pinned maps");
    let m = store.maglev.as_ref().expect("the Maglev map");
    let info = aya::maps::IterableMap::map(m).info().expect("its info");
    assert_eq!(
        info.map_flags() & svc_common::BPF_F_NO_PREALLOC,
        svc_common::BPF_F_NO_PREALLOC,
        "allocated as written"
    );
    let want: std::collections::BTreeSet<u32> = (store.snapshot().expect("a snapshot"))
        .maglev_index
        .iter()
        .flat_map(|(_, v)| maglev_pages_of(v.offset, v.size))
        .collect();
    let pages = bpftool_maglev_pages(&dir);
    assert_eq!(
        pages.keys().copied().collect::<Vec<u32>>(),
        want.into_iter().collect::<Vec<u32>>()
    );
    let old = dir.join("SVC_MAGLEV_v1");
    poll(
        Duration::from_secs(10),
        || Ok((!old.exists()).then_some(())),
    )
    .unwrap_or_else(|e| panic!("layout 1's pin removed once the programs switched: {e}"));
}

/// Two nodes, each with an agent of its own (its namespace, cgroup, pins), given the same
/// Services, build the same Maglev table for the same external frontend: 4,000 flows (50
/// client addresses of the test's own range, 80 ports each) choose the same backend through
/// either node's maps, though their backend entries differ (each marks its own pods local).
/// A fifth backend then moves about a fifth of the flows, alike on both.
/// Compared in each node's pinned maps with the kernel's function (the fixture row
/// `two_nodes_with_one_seed_choose_alike` sends packets through the kernel's choice), and as
/// packets: 400 UDP flows sent through one node and then the other get the same backend.
#[test]
fn two_agents_given_the_same_services_choose_the_same_backends() {
    let mut t = Topo::new();
    let pods = |n: u8| -> Vec<(String, String, &'static str)> {
        (1..=n)
            .map(|i| {
                let node = if i % 2 == 1 { "node-1" } else { "node-2" };
                let net = if i % 2 == 1 { 1 } else { 2 };
                (
                    format!("10.244.{net}.{}", 10 + i),
                    format!("fd00:244:{net}::{}", 10 + i),
                    node,
                )
            })
            .collect()
    };
    let endpoints = |t: &Topo, n: u8| {
        let p = pods(n);
        let refs: Vec<(&str, &str, &str)> = p
            .iter()
            .map(|(a, b, c)| (a.as_str(), b.as_str(), *c))
            .collect();
        t.endpoints("mg", &refs);
    };
    t.service(
        "mg",
        service(
            "mg",
            "NodePort",
            40,
            30140,
            json!({"externalIPs": [EXTERNAL_IP]}),
            json!({}),
        ),
    );
    endpoints(&t, 4);
    t.start_agent();
    // Node 2's agent: dropped before its pins and its cgroup.
    let cgroup2 = TestCgroup::new().expect("cgroup");
    let bpffs2 = Bpffs::new(&t.tools.agent, cgroup2.path()).expect("bpffs");
    let args: Vec<std::ffi::OsString> = [
        "run",
        "--manifests",
        t.m.dir().to_str().unwrap(),
        "--cgroup",
        cgroup2.path().to_str().unwrap(),
        "--bpffs",
        bpffs2.path().to_str().unwrap(),
        "--node-name",
        "node-2",
        "--devices",
        "eth0",
    ]
    .iter()
    .map(Into::into)
    .collect();
    let launcher: Vec<std::ffi::OsString> = vec![
        "nsenter".into(),
        format!("--net={}", t.node2.path().display()).into(),
    ];
    let mut agent2 = Agent::start_launched(
        &launcher,
        &t.tools.agent,
        args,
        bpffs2.path(),
        t.m.scratch(),
    )
    .expect("starting node 2's agent");
    agent2
        .wait_ready(AGENT_READY_TIMEOUT)
        .expect("node 2's agent ready");

    let flows: Vec<([u8; 16], u16)> = (0..4000u32)
        .map(|i| {
            let a = svc_common::v4_mapped([10, 77, 0, 150 + (i % 50) as u8]);
            (a, 40000 + (i / 50) as u16)
        })
        .collect();
    let both = |count: u16| {
        poll(Duration::from_secs(20), || {
            let one = maglev_choices(t.bpffs.path(), EXTERNAL_IP, 80, &flows);
            let two = maglev_choices(bpffs2.path(), EXTERNAL_IP, 80, &flows);
            Ok(match (one, two) {
                (Some((c1, one)), Some((c2, two))) if c1 == count && c2 == count => {
                    Some((one, two))
                }
                _ => None,
            })
        })
        .unwrap_or_else(|e| panic!("both nodes' tables for {count} backends: {e}"))
    };
    let (one, two) = both(4);
    let differ = one.iter().zip(&two).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "of {} flows", flows.len());
    let used: BTreeSet<&SocketAddr> = one.iter().collect();
    assert_eq!(used.len(), 4, "every backend takes flows: {used:?}");

    // The same as packets: UDP flows sent through node 1, then, the client's route to the
    // ExternalIP moved, through node 2, as a load balancer spraying one flow over two nodes
    // would. Each backend answers with its own name; every flow's two answers must agree.
    let _echoes: Vec<Echo> = pods(4)
        .iter()
        .enumerate()
        .map(|(i, (v4, _, node))| {
            let ns = if *node == "node-1" { &t.pod1 } else { &t._pod2 };
            ns.add_addr("eth0", &format!("{v4}/24"))
                .expect("a backend address");
            Echo::start(ns, &format!("b{}", i + 1), &[v4.as_str()], 8080, 5353)
        })
        .collect();
    // Each flow's answer, one client port a flow, from the client to the ExternalIP's UDP port.
    let answers = |t: &Topo, ports: Vec<u16>| -> Vec<String> {
        in_ns(&t.client, move || {
            ports
                .iter()
                .map(|p| {
                    let s = UdpSocket::bind(sa(CLIENT, *p)).expect("a client port");
                    s.set_read_timeout(Some(Duration::from_millis(500)))
                        .unwrap();
                    let mut buf = [0u8; 512];
                    // The first datagrams may wait for a neighbour: asked again.
                    for _ in 0..6 {
                        s.send_to(b"x", sa(EXTERNAL_IP, 53)).expect("send");
                        if let Ok((n, _)) = s.recv_from(&mut buf) {
                            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                            return parse_answer(&text).expect("an answer").backend;
                        }
                    }
                    panic!("flow from port {p} unanswered")
                })
                .collect()
        })
    };
    let ask = |t: &Topo, via: &str| -> Vec<String> {
        t.client
            .ip(["route", "replace", "10.77.100.0/24", "via", via])
            .expect("the client's route");
        answers(t, (41000..41400).collect())
    };
    let via1 = ask(&t, NODE1);
    let via2 = ask(&t, NODE2);
    let differ = via1.iter().zip(&via2).filter(|(a, b)| a != b).count();
    let named: BTreeSet<&String> = via1.iter().collect();
    eprintln!(
        "maglev across two nodes, as packets: {differ} of 400 UDP flows differ; backends {named:?}"
    );
    assert_eq!(differ, 0, "of 400 UDP flows sent through both nodes");
    assert_eq!(
        named.len(),
        4,
        "every backend answers some flows: {named:?}"
    );
    t.client
        .ip(["route", "replace", "10.77.100.0/24", "via", NODE1])
        .expect("the client's route back");

    // `svc-agent explain` names the one backend the table gives a flow not yet sent (no
    // conntrack entry answers for it), on either node's pins: what the flow then reaches.
    let name_of = |addr: &str| -> String {
        let i = pods(4)
            .iter()
            .position(|(v4, _, _)| addr == format!("{v4}:5353"))
            .unwrap_or_else(|| panic!("explain named {addr}, no backend of the Service"));
        format!("b{}", i + 1)
    };
    let explained = |bpffs: &std::path::Path, port: u16| -> String {
        let out = std::process::Command::new(&t.tools.agent)
            .arg("explain")
            .arg("--bpffs")
            .arg(bpffs)
            .args(["--dst", &format!("{EXTERNAL_IP}:53"), "--proto", "udp"])
            .args(["--from", "outside", "--src", &format!("{CLIENT}:{port}")])
            .args(["-o", "json"])
            .output()
            .expect("running svc-agent explain");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let e: Value = serde_json::from_slice(&out.stdout).expect("explain's JSON");
        let reason = e["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("Maglev table"), "port {port}: {e:#}");
        let b = e["backends"].as_array().expect("backends");
        assert_eq!(b.len(), 1, "port {port}: one backend, {e:#}");
        name_of(b[0].as_str().unwrap())
    };
    let ports: Vec<u16> = (43000..43030).collect();
    let said: Vec<String> = ports
        .iter()
        .map(|p| explained(t.bpffs.path(), *p))
        .collect();
    let said2: Vec<String> = ports.iter().map(|p| explained(bpffs2.path(), *p)).collect();
    assert_eq!(said, said2, "explain on node 1 and node 2");
    let got = answers(&t, ports);
    assert_eq!(
        said, got,
        "explain's backend per flow, then what each flow reached"
    );
    let distinct: BTreeSet<&String> = said.iter().collect();
    assert!(distinct.len() > 1, "30 flows over 4 backends: {distinct:?}");

    endpoints(&t, 5);
    let (one5, two5) = both(5);
    let differ = one5.iter().zip(&two5).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "of {} flows after the change", flows.len());
    let moved = one.iter().zip(&one5).filter(|(a, b)| a != b).count();
    let new: SocketAddr = "10.244.1.15:8080".parse().unwrap();
    let to_new = one5.iter().filter(|b| **b == new).count();
    let n = flows.len() as f64;
    let share = 1.0 / 5.0;
    eprintln!(
        "maglev across two agents: 0 of {} flows differ; a 5th backend moved {moved} ({:.1} %), {to_new} to it",
        flows.len(),
        100.0 * moved as f64 / n
    );
    // Bounds: the builder's (1/(N+1) plus Maglev's extra between old backends, 2.5 % on
    // average over seeds) and the sample's spread (4,000 flows: about 0.6 % one sigma).
    assert!(
        (moved as f64 / n) < share + 0.045,
        "{moved} of {n} moved: more than 1/(N+1) + 4.5 %"
    );
    assert!(
        (to_new as f64 / n) > share - 0.03,
        "{to_new} of {n} went to the new backend: less than 1/(N+1) - 3 %"
    );
    agent2
        .terminate(Duration::from_secs(30))
        .expect("node 2's agent stops");
}

/// Linux 5.15's fallbacks, forced on this kernel (`--kernel-as 5.15`, README "Kernel
/// requirements"): the agent starts with `--xdp-mode native`, says once per helper what it
/// does without it, loads no XDP program (none on the device, no link pinned) and runs as
/// `off`, and a NodePort connection to a remote backend is served by tc, SNATed.
#[test]
fn linux_5_15_fallbacks_serve_a_nodeport_without_xdp() {
    let mut t = Topo::new();
    let _peer = xdp_ready(&t);
    t.service("remote", nodeport("remote", 12, 30082));
    t.endpoints("remote", &[REMOTE_POD]);
    t.start_agent_with(&[
        "--kernel-as",
        "5.15",
        "--xdp-mode",
        "native",
        "--snat-port-range",
        "61000-61063",
    ]);
    let np = sa(NODE1, 30082);
    answered(&t.client, "NodePort", move || tcp_once(np, ANSWER));
    let stream = in_ns(&t.client, move || {
        let s = TcpStream::connect_timeout(&np, ANSWER).expect("a connection");
        exchange(&s).expect("an exchange");
        s
    });
    let fwd = ct_entry(&t, stream.local_addr().unwrap(), np, 0).expect("its FORWARD entry");
    let port = u16::from_be(fwd.snat_port_be);
    assert!((61000..=61063).contains(&port), "SNAT port {port}");
    let pins = t.bpffs.entries();
    assert!(
        !pins.iter().any(|p| p.contains("link_xdp_")),
        "an XDP link: {pins:?}"
    );
    let link = t.node1.ip(["-d", "link", "show", "dev", "eth0"]).unwrap();
    assert!(!link.contains("prog/xdp"), "an XDP program on eth0: {link}");
    let log = t.agent().log();
    for said in [
        "taking the kernel for Linux 5.15",
        "lacks helper bpf_set_retval in cgroup sock_addr programs (Linux 5.18)",
        "lacks helper bpf_xdp_load_bytes in xdp programs (Linux 5.18)",
        "--xdp-mode native: this kernel cannot load the XDP program",
    ] {
        assert_eq!(
            log.lines().filter(|l| l.contains(said)).count(),
            1,
            "once: {said}\n{log}"
        );
    }
}
