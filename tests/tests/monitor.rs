//! Issue 36: `svc-agent monitor -o json` shows each connection to a Service as it is decided
//! (the backend it got, or the refusal and why) under the Service's name; with nobody
//! listening the programs write nothing, also after a monitor was killed without a word.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{sa, web_service, web_slice, World, VIP};
use serde_json::{json, Value};
use svc_agent::monitor::{monotonic_ns, Maps, LEASE};
use svc_common::{MonitorOn, MONITOR_SLOTS};
use svc_tests::{
    require_root,
    topology::{Nodes, CLIENT, NODE1, POD1, POD2},
    Agent, Bpffs, Manifests, NetNs, Service, ServicePort, TestCgroup, Tools,
};

/// A running `svc-agent monitor -o json`; killed when dropped.
struct Monitor {
    child: Child,
    lines: mpsc::Receiver<Value>,
}

impl Monitor {
    fn start(bin: &Path, bpffs: &Path, args: &[&str]) -> Monitor {
        let mut child = Command::new(bin)
            .arg("monitor")
            .arg("--bpffs")
            .arg(bpffs)
            .args(args)
            .args(["-o", "json"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting svc-agent monitor");
        let out: ChildStdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("monitor printed no JSON ({e}): {line}"));
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Monitor { child, lines }
    }

    /// Every line printed until `until` holds for the lines so far (or 10 s pass).
    fn collect_until(&self, until: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = Vec::new();
        while !until(&got) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) => got.push(v),
                Err(_) => break,
            }
        }
        got
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a process this test started and has not reaped.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until a monitor holds a slot's lease (it reads the ring only after taking it).
fn wait_listening(bpffs: &Path) {
    wait_slots(bpffs, 1);
}

/// Waits until `n` monitors hold a slot's lease each, and the summary says so.
fn wait_slots(bpffs: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let now = monotonic_ns();
        let held = leases(bpffs).iter().filter(|&&u| u > now).count();
        if held >= n && summary(bpffs).slots.count_ones() as usize >= n {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{n} monitors never took their leases: {:?}", leases(bpffs));
}

/// Each slot's lease (`until_ns`), by slot.
fn leases(bpffs: &Path) -> Vec<u64> {
    let m = Maps::open(bpffs).unwrap();
    m.slots().unwrap().iter().map(|c| c.until_ns).collect()
}

/// The summary the programs read.
fn summary(bpffs: &Path) -> MonitorOn {
    Maps::open(bpffs).unwrap().on().unwrap()
}

/// Events seen, all slots.
fn seen(bpffs: &Path) -> u64 {
    Maps::open(bpffs).unwrap().stats_all().unwrap().seen
}

/// `demo/web` with two backends, and `demo/empty` (10.96.0.20:80) with none.
fn web_and_empty() -> World {
    World::start(2, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
        m.apply_service(
            &Service::new("demo", "empty", "10.96.0.20")
                .port(ServicePort::tcp(80).name("http").target(8080)),
        )
        .unwrap();
    })
}

#[test]
fn monitor_shows_decisions_and_nothing_is_written_without_it() {
    let w = web_and_empty();
    let (bin, bpffs) = (&w.sb.tools.agent, w.bpffs.path());
    let empty = sa([10, 96, 0, 20], 80);
    let backend = |i: u8| sa(w.sb.backend_v4(i), 8080).to_string();

    // Nobody listening: connections are decided without a word written.
    let before = seen(bpffs);
    let r = w.sb.tcp(sa(VIP, 80), 5, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    assert_eq!(seen(bpffs), before, "events counted with nobody listening");
    assert_eq!(summary(bpffs), MonitorOn::default());

    let mon = Monitor::start(bin, bpffs, &[]);
    wait_listening(bpffs);
    let r = w.sb.tcp(sa(VIP, 80), 4, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    // In the order the connections were made, which is the order they were decided in.
    let reached: Vec<String> = r
        .results
        .iter()
        .map(|a| {
            let n = a.backend.as_deref().expect("a backend answered");
            backend(n.trim_start_matches('b').parse().unwrap())
        })
        .collect();
    let refused = w.sb.tcp(empty, 2, &[]).unwrap();
    for a in &refused.results {
        assert_eq!(a.errno, Some(libc::ECONNREFUSED), "{a:?}");
    }
    let of = |lines: &[Value], reason: &str| -> Vec<Value> {
        lines
            .iter()
            .filter(|l| l["reason"] == reason)
            .cloned()
            .collect()
    };
    let lines = mon.collect_until(|l| {
        of(l, "translated").len() >= 4 && of(l, "refused_no_backend").len() >= 2
    });
    let translated = of(&lines, "translated");
    assert_eq!(translated.len(), 4, "{lines:#?}");
    for (t, want) in translated.iter().zip(&reached) {
        assert_eq!(t["source"], "connect", "{t:#}");
        assert_eq!(t["verdict"], "translated", "{t:#}");
        assert_eq!(t["service"], "demo/web:http", "{t:#}");
        assert_eq!(t["dst"], sa(VIP, 80).to_string(), "{t:#}");
        assert_eq!(&t["to"], want, "the backend the connection reached: {t:#}");
        assert_eq!(t["protocol"], "tcp", "{t:#}");
    }
    let refusals = of(&lines, "refused_no_backend");
    assert_eq!(refusals.len(), 2, "{lines:#?}");
    for t in &refusals {
        assert_eq!(t["verdict"], "refused", "{t:#}");
        assert_eq!(t["service"], "demo/empty:http", "{t:#}");
        assert_eq!(t["dst"], empty.to_string(), "{t:#}");
        assert!(t.get("to").is_none(), "{t:#}");
    }

    // SIGTERM gives the slot back at once: nothing is written after.
    mon.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while leases(bpffs).iter().any(|&u| u != 0) || summary(bpffs) != MonitorOn::default() {
        assert!(Instant::now() < deadline, "SIGTERM left the lease");
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = seen(bpffs);
    w.sb.tcp(sa(VIP, 80), 3, &[]).unwrap();
    assert_eq!(seen(bpffs), before, "events counted after the monitor left");

    let mon = Monitor::start(bin, bpffs, &["--service", "demo/empty"]);
    wait_listening(bpffs);
    w.sb.tcp(sa(VIP, 80), 3, &[]).unwrap();
    w.sb.tcp(empty, 1, &[]).unwrap();
    let lines = mon.collect_until(|l| !of(l, "refused_no_backend").is_empty());
    assert!(
        lines.iter().all(|l| l["service"] == "demo/empty:http"),
        "{lines:#?}"
    );
    assert_eq!(of(&lines, "refused_no_backend").len(), 1, "{lines:#?}");

    // Killed without a word: its lease runs out, and the next decision turns the writing off.
    mon.signal(libc::SIGKILL);
    std::thread::sleep(LEASE + Duration::from_millis(500));
    w.sb.tcp(sa(VIP, 80), 1, &[]).unwrap();
    assert!(leases(bpffs).iter().all(|&u| u == 0), "{:?}", leases(bpffs));
    assert_eq!(summary(bpffs), MonitorOn::default());
    let before = seen(bpffs);
    w.sb.tcp(sa(VIP, 80), 3, &[]).unwrap();
    assert_eq!(
        seen(bpffs),
        before,
        "events counted after the lease ran out"
    );
}

/// Two monitors at once, each with its own filter, each see all of their events (neither
/// takes the other's); four fill the slots, and a fifth is refused naming the four pids. One
/// killed with SIGKILL keeps its slot until its lease runs out; then the next decision clears
/// it, the others go on, and a new monitor takes it.
#[test]
fn monitors_listen_side_by_side_and_a_fifth_is_refused() {
    let w = web_and_empty();
    let (bin, bpffs) = (&w.sb.tools.agent, w.bpffs.path());
    let empty = sa([10, 96, 0, 20], 80);
    let of = |lines: &[Value], reason: &str| -> usize {
        lines.iter().filter(|l| l["reason"] == reason).count()
    };
    let web = Monitor::start(bin, bpffs, &["--service", "demo/web"]);
    wait_slots(bpffs, 1);
    let refusals = Monitor::start(bin, bpffs, &["--dst", &empty.to_string()]);
    wait_slots(bpffs, 2);
    let r = w.sb.tcp(sa(VIP, 80), 4, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    w.sb.tcp(empty, 2, &[]).unwrap();
    let a = web.collect_until(|l| of(l, "translated") >= 4);
    let b = refusals.collect_until(|l| of(l, "refused_no_backend") >= 2);
    assert_eq!(of(&a, "translated"), 4, "{a:#?}");
    assert!(a.iter().all(|l| l["service"] == "demo/web:http"), "{a:#?}");
    assert_eq!(of(&b, "refused_no_backend"), 2, "{b:#?}");
    assert!(
        a.len() == 4 && b.len() == 2,
        "only their own: {a:#?} {b:#?}"
    );

    // All slots taken: a fifth is refused, and told who listens.
    let third = Monitor::start(bin, bpffs, &[]);
    let fourth = Monitor::start(bin, bpffs, &["--packets"]);
    wait_slots(bpffs, MONITOR_SLOTS as usize);
    let fifth = Command::new(bin)
        .args(["monitor", "--bpffs"])
        .arg(bpffs)
        .output()
        .expect("running a fifth monitor");
    let err = String::from_utf8_lossy(&fifth.stderr);
    assert!(!fifth.status.success(), "{err}");
    assert!(err.contains("4 monitors are listening already"), "{err}");
    for m in [&web, &refusals, &third, &fourth] {
        assert!(
            err.contains(&m.child.id().to_string()),
            "pid {}: {err}",
            m.child.id()
        );
    }
    drop(third);

    // Killed without a word (and not reaped: its pid still there): its slot is held until
    // its lease runs out, and the next decision clears it; the web monitor goes on.
    let killed = refusals.child.id();
    refusals.signal(libc::SIGKILL);
    let slot_of = |pid: u32| {
        let m = Maps::open(bpffs).unwrap();
        m.slots()
            .unwrap()
            .iter()
            .position(|c| c.pid == pid)
            .expect("the pid's slot") as u32
    };
    let slot = slot_of(killed);
    std::thread::sleep(LEASE + Duration::from_millis(500));
    w.sb.tcp(sa(VIP, 80), 1, &[]).unwrap();
    assert_eq!(
        leases(bpffs)[slot as usize],
        0,
        "the killed monitor's lease is cleared"
    );
    assert_eq!(
        summary(bpffs).slots & (1 << slot),
        0,
        "and its bit in the summary"
    );
    let a = web.collect_until(|l| of(l, "translated") >= 1);
    assert_eq!(of(&a, "translated"), 1, "{a:#?}");
    let before = seen(bpffs);
    w.sb.tcp(empty, 1, &[]).unwrap();
    // The web monitor's and the one with --packets' slots see the refusal, not the killed
    // one's.
    let after = seen(bpffs);
    assert_eq!(after - before, 2, "the refusal, for the two live monitors");

    // Its slot is free again (as the third monitor's is): two more start.
    let again = Monitor::start(bin, bpffs, &[]);
    let more = Monitor::start(bin, bpffs, &[]);
    let pids = [again.child.id(), more.child.id()];
    let deadline = Instant::now() + Duration::from_secs(10);
    let slots = loop {
        let m = Maps::open(bpffs).unwrap();
        let held: Vec<u32> = m.slots().unwrap().iter().map(|c| c.pid).collect();
        if pids.iter().all(|p| held.contains(p)) {
            break held;
        }
        assert!(
            Instant::now() < deadline,
            "{pids:?} never took slots: {held:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        pids.contains(&slots[slot as usize]),
        "the killed monitor's slot {slot} taken again: {slots:?}"
    );
}

/// Not a test: svc's program time per connection (connect(), getpeername(), release; by
/// bpf_stats) and the connection rate through a ClusterIP, with nobody listening and with a
/// monitor listening (it reads and discards). `SVC_COST_AGENTS` compares agents in one
/// interleaved run: `label=BINARY [FLAG...]` entries separated by `;` (for instance an agent
/// from before the monitor, and this one with `--per-service-metrics=false`); each round
/// starts every agent afresh, in turn, and an agent without the monitor's maps gets no
/// listening row. docs/benchmarks.md keeps the figures.
#[test]
#[ignore = "a measurement: cargo test -p svc-tests --test monitor monitor_cost -- --ignored --nocapture"]
fn monitor_cost() {
    use svc_tests::profile::{program_time, BpfStats};
    const N: u32 = 2_000;
    const ROUNDS: usize = 7;
    let agents: Vec<(String, Option<std::path::PathBuf>, Vec<String>)> =
        match std::env::var("SVC_COST_AGENTS") {
            Ok(list) => list
                .split(';')
                .filter(|e| !e.trim().is_empty())
                .map(|e| {
                    let (label, cmd) = e.split_once('=').expect("label=BINARY [FLAG...]");
                    let mut words = cmd.split_whitespace().map(String::from);
                    let bin = words.next().expect("a binary");
                    (label.trim().to_string(), Some(bin.into()), words.collect())
                })
                .collect(),
            Err(_) => vec![("this agent".into(), None, Vec::new())],
        };
    let _stats = BpfStats::enable().unwrap();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // Per round: ns per connection, program runs per connection, connections/s.
    type Rounds = Vec<(f64, f64, f64)>;
    let mut rows: Vec<(String, &str, Rounds)> = Vec::new();
    for _ in 0..ROUNDS {
        for (label, bin, flags) in &agents {
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let w = World::start_bin(bin.as_deref(), 1, &[8080], &flags, |sb, m| {
                m.apply_service(&web_service()).unwrap();
                m.apply_slice(&web_slice(sb, &[1], &[])).unwrap();
            });
            let (agent_bin, bpffs) = (
                bin.clone().unwrap_or(w.sb.tools.agent.clone()),
                w.bpffs.path(),
            );
            let measure = || {
                let (c0, ns0) = program_time(bpffs).unwrap();
                let t = Instant::now();
                let r = w.sb.tcp(sa(VIP, 80), N, &[]).unwrap();
                let secs = t.elapsed().as_secs_f64();
                assert!(r.all_ok(), "{:?}", r.failures());
                let (c1, ns1) = program_time(bpffs).unwrap();
                (
                    (ns1 - ns0) as f64 / N as f64,
                    (c1 - c0) as f64 / N as f64,
                    N as f64 / secs,
                )
            };
            let mut whats = vec!["nobody listening"];
            if Maps::open(bpffs).is_ok() {
                whats.push("a monitor listening");
            }
            for what in whats {
                let mon = (what == "a monitor listening").then(|| {
                    let m = Monitor::start(&agent_bin, bpffs, &[]);
                    wait_listening(bpffs);
                    m
                });
                let got = measure();
                drop(mon);
                match rows.iter_mut().find(|r| r.0 == *label && r.1 == what) {
                    Some(r) => r.2.push(got),
                    None => rows.push((label.clone(), what, vec![got])),
                }
            }
        }
    }
    // Each round's figure against the first row's of the same round: the machine's load
    // moves both alike.
    let first: Vec<f64> = rows[0].2.iter().map(|g| g.0).collect();
    println!("\n| agent | monitor | svc program ns per connection (median; min-max) | × the first row, per round (median; min-max) | program runs per connection | connections/s (probe, wall) |");
    println!("|---|---|---|---|---|---|");
    for (label, what, got) in &rows {
        let ns: Vec<f64> = got.iter().map(|g| g.0).collect();
        let range = |v: &[f64]| {
            v.iter()
                .fold((f64::MAX, 0f64), |(l, h), &x| (l.min(x), h.max(x)))
        };
        let (lo, hi) = range(&ns);
        let ratios: Vec<f64> = ns.iter().zip(&first).map(|(n, f)| n / f).collect();
        let (rlo, rhi) = range(&ratios);
        println!(
            "| {label} | {what} | {:.0} ({lo:.0}-{hi:.0}) | {:.3} ({rlo:.3}-{rhi:.3}) | {:.1} | {:.0} |",
            median(ns.clone()),
            median(ratios.clone()),
            median(got.iter().map(|g| g.1).collect()),
            median(got.iter().map(|g| g.2).collect()),
        );
    }
}

// ---------------------------------------------------------------------------------------
// The packet datapath, from outside: the topology of `svc_tests::topology` (an external
// client, node 1 whose `eth0` carries the tc programs, node 2, a pod on each), the agent in
// node 1's namespace, the monitor beside it. The client's threads sit outside the agent's
// cgroup: what they get is the tc programs' work.

/// Runs `f` in a thread inside `ns` and returns what it returned.
fn in_ns<T: Send>(ns: &NetNs, f: impl FnOnce() -> T + Send) -> T {
    ns.run_in(f).expect("entering the namespace")
}

/// Backends: on each pod, TCP 8080 answering the pod's name; UDP 5353 echoing the pod's name
/// where `udp` says so (elsewhere nothing listens: the pod answers ICMP port unreachable).
struct Pods {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Pods {
    fn start(pods: &[(&NetNs, &'static str, &'static str, bool)]) -> Pods {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for &(ns, name, addr, udp) in pods {
            let (tcp, dgram) = in_ns(ns, move || {
                let t = TcpListener::bind((addr, 8080)).expect("binding TCP 8080");
                t.set_nonblocking(true).unwrap();
                let u = udp.then(|| {
                    let u = UdpSocket::bind((addr, 5353)).expect("binding UDP 5353");
                    u.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                    u
                });
                (t, u)
            });
            let s = stop.clone();
            threads.push(std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    match tcp.accept() {
                        Ok((mut c, _)) => {
                            let _ = c.write_all(name.as_bytes());
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            }));
            if let Some(u) = dgram {
                let s = stop.clone();
                threads.push(std::thread::spawn(move || {
                    let mut buf = [0u8; 512];
                    while !s.load(Ordering::Relaxed) {
                        if let Ok((_, from)) = u.recv_from(&mut buf) {
                            let _ = u.send_to(name.as_bytes(), from);
                        }
                    }
                }));
            }
        }
        Pods { stop, threads }
    }
}

impl Drop for Pods {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A NodePort Service `demo/NAME` on `node_port` (http 80/TCP -> 8080, dns 53/UDP -> 5353,
/// both on the NodePort), `extra` merged into its spec, and its IPv4 EndpointSlice of `pods`
/// (address, node).
fn nodeport(
    m: &Manifests,
    name: &str,
    vip: u8,
    node_port: u16,
    extra: Value,
    pods: &[(&str, &str)],
) {
    let mut spec = json!({
        "type": "NodePort",
        "clusterIP": format!("10.96.0.{vip}"),
        "clusterIPs": [format!("10.96.0.{vip}")],
        "ipFamilies": ["IPv4"],
        "selector": {"app": name},
        "ports": [
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": node_port},
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353, "nodePort": node_port},
        ],
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        spec[k] = v.clone();
    }
    let svc = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": spec,
    });
    m.write_value(&format!("svc-demo-{name}.yaml"), &svc)
        .expect("writing a Service");
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|(addr, node)| {
            json!({
                "addresses": [addr],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node,
            })
        })
        .collect();
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{name}-ipv4"),
            "namespace": "demo",
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 5353, "protocol": "UDP"},
        ],
        "endpoints": endpoints,
    });
    m.write_value(&format!("eps-demo-{name}-ipv4.yaml"), &slice)
        .expect("writing an EndpointSlice");
}

/// The topology, its backends and an agent on node 1's `eth0`. Fields drop in declaration
/// order: the agent stops first, then its pins go, then the backends, the namespaces and the
/// cgroup last.
struct Outside {
    _agent: Agent,
    bpffs: Bpffs,
    _pods: Pods,
    _m: Manifests,
    tools: Tools,
    nodes: Nodes,
    _cgroup: TestCgroup,
}

const LOCAL: (&str, &str) = (POD1, "node-1");
const REMOTE: (&str, &str) = (POD2, "node-2");

impl Outside {
    /// Services written by `setup`; the agent run with `extra` flags.
    fn start(extra: &[&str], setup: impl FnOnce(&Manifests)) -> Outside {
        require_root();
        let tools = Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe"));
        let cgroup = TestCgroup::new().expect("cgroup");
        let nodes = Nodes::new().expect("building the topology");
        let pods = Pods::start(&[
            (&nodes.pod1, "pod1", POD1, true),
            (&nodes.pod2, "pod2", POD2, false),
        ]);
        let m = Manifests::new().expect("manifests");
        setup(&m);
        let bpffs = Bpffs::new(&tools.agent, cgroup.path()).expect("bpffs");
        let args: Vec<std::ffi::OsString> = [
            "run",
            "--manifests",
            m.dir().to_str().unwrap(),
            "--cgroup",
            cgroup.path().to_str().unwrap(),
            "--bpffs",
            bpffs.path().to_str().unwrap(),
            "--node-name",
            "node-1",
            "--devices",
            "eth0",
        ]
        .iter()
        .chain(extra)
        .map(Into::into)
        .collect();
        let launcher: Vec<std::ffi::OsString> = vec![
            "nsenter".into(),
            format!("--net={}", nodes.node1.path().display()).into(),
        ];
        let mut agent =
            Agent::start_launched(&launcher, &tools.agent, args, bpffs.path(), m.scratch())
                .expect("starting the agent");
        agent
            .wait_ready(svc_tests::sandbox::AGENT_READY_TIMEOUT)
            .expect("agent ready");
        Outside {
            _agent: agent,
            bpffs,
            _pods: pods,
            _m: m,
            tools,
            nodes,
            _cgroup: cgroup,
        }
    }

    fn monitor(&self, args: &[&str]) -> Monitor {
        let m = Monitor::start(&self.tools.agent, self.bpffs.path(), args);
        wait_listening(self.bpffs.path());
        m
    }

    /// A TCP connection from the client to `to` and the name of the pod that answered,
    /// retried for a few seconds (a first ARP exchange may be slow); with the client's port.
    fn connect(&self, to: SocketAddr) -> (u16, String) {
        in_ns(&self.nodes.client, move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let got = TcpStream::connect_timeout(&to, Duration::from_secs(2)).and_then(|c| {
                    c.set_read_timeout(Some(Duration::from_secs(3)))?;
                    let port = c.local_addr()?.port();
                    let mut name = String::new();
                    (&c).read_to_string(&mut name)?;
                    Ok((port, name))
                });
                match got {
                    Ok(a) => return a,
                    Err(e) if Instant::now() > deadline => panic!("connecting to {to}: {e}"),
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        })
    }

    /// One datagram from a connected UDP socket of the client to `to`, and what came back:
    /// the answer, or the error its receive got (ECONNREFUSED: an ICMP port unreachable).
    fn udp(&self, to: SocketAddr) -> (u16, std::io::Result<String>) {
        in_ns(&self.nodes.client, move || {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect(to).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let port = s.local_addr().unwrap().port();
            let mut buf = [0u8; 512];
            let got = s
                .send(b"x")
                .and_then(|_| s.recv(&mut buf))
                .map(|n| String::from_utf8_lossy(&buf[..n]).into_owned());
            (port, got)
        })
    }
}

fn of<'a>(lines: &'a [Value], reason: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["reason"] == reason).collect()
}

/// sessionAffinity ClientIP for traffic from outside: the client's second connection to the
/// NodePort is a new tc flow whose backend is the remembered one, and the monitor says so
/// (`how: affinity`) beside the backend it reached; the first was chosen at random.
/// `--service` shows that Service only.
#[test]
fn monitor_shows_tc_affinity_hits() {
    let o = Outside::start(&[], |m| {
        let affinity = json!({
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
        });
        nodeport(m, "sticky", 30, 30095, affinity, &[LOCAL, REMOTE]);
        nodeport(m, "other", 31, 30096, json!({}), &[LOCAL]);
    });
    let to = sa(NODE1.parse::<std::net::Ipv4Addr>().unwrap(), 30095);
    // A first connection before the monitor: the topology's first ARP exchanges.
    let (_, first) = o.connect(to);
    let mon = o.monitor(&["--service", "demo/sticky"]);
    let other = sa(NODE1.parse::<std::net::Ipv4Addr>().unwrap(), 30096);
    o.connect(other);
    let (port, second) = o.connect(to);
    assert_eq!(second, first, "affinity: the same pod");
    let lines = mon.collect_until(|l| !of(l, "new").is_empty());
    let new = of(&lines, "new");
    assert_eq!(new.len(), 1, "{lines:#?}");
    let n = new[0];
    let client = format!("{CLIENT}:{port}");
    let backend = format!("{}:8080", if second == "pod1" { POD1 } else { POD2 });
    assert_eq!(
        (
            &n["source"],
            &n["verdict"],
            &n["service"],
            &n["client"],
            &n["dst"],
            &n["to"],
            &n["how"]
        ),
        (
            &json!("tc"),
            &json!("translated"),
            &json!("demo/sticky:http"),
            &json!(client),
            &json!(to.to_string()),
            &json!(backend),
            &json!("affinity")
        ),
        "{n:#}"
    );
    assert!(
        lines.iter().all(|l| l["service"] == "demo/sticky:http"),
        "--service shows that Service only: {lines:#?}"
    );
}

/// An ICMP error about a flow from outside, translated: a remote backend that does not listen
/// on the UDP port answers the client's datagram with port unreachable, which comes back to
/// node 1 addressed to the flow's SNAT address and leaves towards the client from the
/// NodePort. The client's connected socket is refused, and the monitor shows the error, what
/// it says, and the flow it was about as translated; `--dst` the NodePort selects it.
#[test]
fn monitor_shows_icmp_errors_translated() {
    let o = Outside::start(&[], |m| {
        nodeport(m, "silent", 32, 30097, json!({}), &[REMOTE]);
    });
    let node1 = NODE1.parse::<std::net::Ipv4Addr>().unwrap();
    let to = sa(node1, 30097);
    // The topology's first ARP exchanges, before the monitor: a TCP connection (pod 2 serves
    // TCP).
    o.connect(to);
    // `--dst` the NodePort: the error is shown coming from it.
    let mon = o.monitor(&["--dst", &to.to_string()]);
    let (port, got) = o.udp(to);
    let refused = matches!(&got, Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED));
    assert!(
        refused,
        "the backend's port unreachable reached the client: {got:?}"
    );
    let lines = mon.collect_until(|l| !of(l, "icmp_error").is_empty());
    let errors = of(&lines, "icmp_error");
    assert_eq!(errors.len(), 1, "{lines:#?}");
    let e = errors[0];
    assert_eq!(
        (
            &e["source"],
            &e["verdict"],
            &e["service"],
            &e["protocol"],
            &e["icmp"]
        ),
        (
            &json!("tc"),
            &json!("translated"),
            &json!("demo/silent:dns"),
            &json!("udp"),
            &json!("port unreachable")
        ),
        "{e:#}"
    );
    // The flow's packet the error travels with: from the backend, to the client from the
    // NodePort once translated.
    assert_eq!(e["client"], json!(format!("{POD2}:5353")), "{e:#}");
    assert_eq!(e["to"], json!(format!("{CLIENT}:{port}")), "{e:#}");
    assert_eq!(e["snat"], json!(to.to_string()), "{e:#}");
    assert_eq!(
        of(&lines, "new").len(),
        1,
        "the flow's own start: {lines:#?}"
    );
}

/// A UDP flow from outside that goes quiet expires (`--conntrack-udp-timeout=1s`), and the
/// sweep that removes it (every second here) shows it to the monitor: as its client sent it,
/// with its backend, idle. `--dst` (the NodePort) selects it.
#[test]
fn monitor_shows_flows_swept() {
    let o = Outside::start(
        &[
            "--conntrack-udp-timeout=1s",
            "--conntrack-udp-timeout-stream=1s",
            "--conntrack-sweep-interval=1s",
        ],
        |m| {
            nodeport(m, "echo", 33, 30098, json!({}), &[LOCAL]);
        },
    );
    let to = sa(NODE1.parse::<std::net::Ipv4Addr>().unwrap(), 30098);
    o.connect(to);
    let mon = o.monitor(&["--dst", &to.to_string()]);
    let (port, got) = o.udp(to);
    assert_eq!(got.expect("an answer"), "pod1");
    let client = json!(format!("{CLIENT}:{port}"));
    let lines = mon.collect_until(|l| of(l, "ct_swept").iter().any(|s| s["client"] == client));
    let swept: Vec<_> = of(&lines, "ct_swept")
        .into_iter()
        .filter(|s| s["client"] == client)
        .collect();
    assert_eq!(swept.len(), 1, "{lines:#?}");
    let s = swept[0];
    assert_eq!(
        (
            &s["source"],
            &s["verdict"],
            &s["service"],
            &s["protocol"],
            &s["dst"],
            &s["to"],
            &s["flow"]
        ),
        (
            &json!("sweep"),
            &json!("swept"),
            &json!("demo/echo:dns"),
            &json!("udp"),
            &json!(to.to_string()),
            &json!(format!("{POD1}:5353")),
            &json!("idle")
        ),
        "{s:#}"
    );
}

/// A known flow's packets from outside: by default the monitor shows those that change the
/// flow's state (its FINs), not its handshake and data; with `--packets` it shows them all.
/// Two monitors at once, one each way.
#[test]
fn monitor_shows_known_flows_packets_only_with_packets() {
    let o = Outside::start(&[], |m| {
        nodeport(m, "known", 34, 30099, json!({}), &[REMOTE]);
    });
    let to = sa(NODE1.parse::<std::net::Ipv4Addr>().unwrap(), 30099);
    o.connect(to);
    let dst = to.to_string();
    let default = o.monitor(&["--dst", &dst]);
    let packets = Monitor::start(
        &o.tools.agent,
        o.bpffs.path(),
        &["--dst", &dst, "--packets"],
    );
    wait_slots(o.bpffs.path(), 2);
    let (port, name) = o.connect(to);
    assert_eq!(name, "pod2");
    let client = json!(format!("{CLIENT}:{port}"));
    // The flow's packets: its client's (`ct_hit`, from the client's port) and its backend's
    // replies (`reply`, to the client's port once translated).
    let mine = |l: &Value| {
        (l["reason"] == "ct_hit" && l["client"] == client)
            || (l["reason"] == "reply" && l["to"] == client)
    };
    let closed = |l: &[Value]| l.iter().any(|l| mine(l) && l["flow"] == "closed");
    let shown = default.collect_until(closed);
    let all = packets.collect_until(closed);
    let known =
        |lines: &[Value]| -> Vec<Value> { lines.iter().filter(|l| mine(l)).cloned().collect() };
    let (shown, all) = (known(&shown), known(&all));
    assert!(closed(&shown), "{shown:#?}");
    assert!(
        shown.iter().all(|l| l.get("flow").is_some()),
        "by default, only the packets that changed the flow's state: {shown:#?}"
    );
    assert!(
        all.iter()
            .any(|l| l.get("flow").is_none() && l["reason"] == "reply"),
        "--packets: the backend's SYN-ACK and data too: {all:#?}"
    );
    assert!(
        all.iter()
            .any(|l| l.get("flow").is_none() && l["reason"] == "ct_hit"),
        "--packets: the client's ACK too: {all:#?}"
    );
    assert!(all.len() > shown.len(), "{all:#?} {shown:#?}");
}
