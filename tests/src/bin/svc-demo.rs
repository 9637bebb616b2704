//! svc-demo: a ClusterIP Service served by svc, end to end, in a throwaway sandbox.
//!
//! Builds a client namespace (in a fresh test cgroup) and a backend namespace with four
//! backends, writes a Service `demo/web` (10.96.0.10, TCP 80 → 8080 and UDP 53 → 5353) and its
//! EndpointSlice (three ready endpoints, one not ready), runs `svc-agent run` on that cgroup,
//! sends requests through the ClusterIP and shows who answered, then shows what a Service is
//! made of: no interface, no namespace, no route, just map entries and cgroup hooks. Then
//! the packet datapath: a second agent inside node 1 of `svc_tests::topology` (its uplink
//! `eth0` named with `--devices`), a NodePort and a LoadBalancer IP with a backend on each
//! node, requests from an external client namespace, and what the tc programs and the
//! connection-tracking map hold. Every
//! resource is a guard, so the sandbox is gone when the demo exits, also on error, and on
//! Ctrl-C, SIGTERM or SIGHUP during a step (`svc_tests::interrupt`: the step fails, the guards
//! drop, and the status is 128 + the signal's number).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    time::Instant,
};

use anyhow::{Context, Result};
use clap::Parser;
use svc_tests::{
    require_root, sandbox::AGENT_READY_TIMEOUT, sys::run, Endpoint, EndpointSlice, Manifests,
    Sandbox, Service, ServicePort, SlicePort, Tools,
};

#[derive(Parser)]
#[command(about = "Show a ClusterIP Service served by svc-agent in a throwaway sandbox")]
struct Args {
    /// svc-agent binary (default: $SVC_AGENT_BIN, else next to this binary).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// svc-probe binary (default: $SVC_PROBE_BIN, else next to this binary).
    #[arg(long)]
    probe: Option<PathBuf>,
    /// TCP connections to send through the ClusterIP.
    #[arg(long, default_value_t = 30)]
    requests: u32,
    /// Only remove what killed harness runs left behind (namespaces, test and memory
    /// cgroups, pins, and their directories under /tmp, whose owning process is gone), then
    /// exit.
    #[arg(long)]
    clean_stale: bool,
}

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn section(title: &str) {
    use std::io::IsTerminal;
    if std::io::stdout().is_terminal() {
        println!("\n\x1b[1m=== {title} ===\x1b[0m");
    } else {
        println!("\n=== {title} ===");
    }
}

fn main() -> ExitCode {
    if let Err(e) = svc_tests::interrupt::install() {
        eprintln!("svc-demo: {e:#}");
        return ExitCode::FAILURE;
    }
    let code = match demo(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            println!("\nRESULT: FAILED (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("svc-demo: {e:#}");
            ExitCode::FAILURE
        }
    };
    svc_tests::interrupt::stopped().unwrap_or(code)
}

fn demo(args: Args) -> Result<bool> {
    require_root();
    let mut tools = Tools::locate();
    if let Some(p) = args.agent {
        tools.agent = p;
    }
    if let Some(p) = args.probe {
        tools.probe = p;
    }
    if args.clean_stale {
        for r in svc_tests::sys::clean_stale(&tools.agent)? {
            println!("removed {r}");
        }
        return Ok(true);
    }

    section("1. Sandbox");
    let sb = Sandbox::new(tools).context("building the sandbox")?;
    println!(
        "client namespace : {} ({}, {})",
        sb.client_ns().name(),
        sb.client_v4(),
        sb.client_v6()
    );
    println!("backend namespace: {}", sb.server_ns().name());
    println!("client cgroup    : {}", sb.cgroup().path().display());
    let ready = [1u8, 2, 3];
    let not_ready = 4u8;
    let backends = sb.backends(4, &[8080, 5353])?;
    for (b, i) in backends.iter().zip(1u8..) {
        println!(
            "backend {:3}      : {}  (TCP+UDP on :8080 and :5353){}",
            b.name(),
            sb.backend_v4(i),
            if i == not_ready {
                "  <- endpoint NOT ready"
            } else {
                ""
            }
        );
    }

    section("2. Manifests");
    let m = Manifests::new()?;
    let svc = Service::new("demo", "web", &VIP.to_string())
        .port(ServicePort::tcp(80).name("http").target(8080))
        .port(ServicePort::udp(53).name("dns").target(5353));
    let mut slice = EndpointSlice::ipv4("demo", "web")
        .port(SlicePort::tcp(8080).name("http"))
        .port(SlicePort::udp(5353).name("dns"));
    for &i in &ready {
        slice = slice.endpoint(Endpoint::ready(&sb.backend_v4(i).to_string()));
    }
    slice = slice.endpoint(Endpoint::not_ready(&sb.backend_v4(not_ready).to_string()));
    m.apply_service(&svc)?;
    m.apply_slice(&slice)?;
    for f in [svc.file_name(), slice.file_name()] {
        println!("--- {}/{f}", m.dir().display());
        print!("{}", std::fs::read_to_string(m.dir().join(&f))?);
    }

    section("3. Agent");
    let bpffs = sb.bpffs()?;
    println!(
        "$ {} run --manifests {} --cgroup {} --bpffs {}",
        sb.tools.agent.display(),
        m.dir().display(),
        sb.cgroup().path().display(),
        bpffs.path().display()
    );
    let t0 = Instant::now();
    let mut agent = sb.agent_no_wait(&bpffs, &m)?;
    agent.quiet();
    if let Err(e) = agent.wait_ready(AGENT_READY_TIMEOUT) {
        println!("{}", agent.log());
        return Err(e);
    }
    println!("svc-agent: ready after {:?}", t0.elapsed());

    section(&format!("4. Traffic from the client namespace to {VIP}"));
    let tcp = sb.tcp(SocketAddr::new(IpAddr::V4(VIP), 80), args.requests, &[])?;
    let udp = sb.udp(SocketAddr::new(IpAddr::V4(VIP), 53), 10, false)?;
    let tcp_count = tcp.backends();
    let udp_count = udp.backends();
    println!(
        "{:8} {:15} {:10} {:>12} {:>12}",
        "BACKEND", "ADDRESS", "ENDPOINT", "TCP :80", "UDP :53"
    );
    let mut ok = true;
    for (b, i) in backends.iter().zip(1u8..) {
        let t = tcp_count.get(b.name()).copied().unwrap_or(0);
        let u = udp_count.get(b.name()).copied().unwrap_or(0);
        let is_ready = ready.contains(&i);
        println!(
            "{:8} {:15} {:10} {:>12} {:>12}",
            b.name(),
            sb.backend_v4(i).to_string(),
            if is_ready { "ready" } else { "not ready" },
            t,
            u
        );
        // With 30 requests a ready backend is missed with probability ~3·(2/3)^30 ≈ 2e-5.
        if (is_ready && t == 0) || (!is_ready && (t > 0 || u > 0)) {
            ok = false;
        }
    }
    let failures = tcp.failures().len() + udp.failures().len();
    println!("failed requests: {failures}");
    ok &= failures == 0;
    let peers: BTreeMap<_, usize> = tcp.results.iter().fold(BTreeMap::new(), |mut m, a| {
        *m.entry(a.peer.clone().unwrap_or_default()).or_default() += 1;
        m
    });
    let froms: BTreeMap<_, usize> = udp.results.iter().fold(BTreeMap::new(), |mut m, a| {
        *m.entry(a.from.clone().unwrap_or_default()).or_default() += 1;
        m
    });
    println!("TCP getpeername() saw: {peers:?}   (the ClusterIP, not the backend)");
    println!("UDP recvfrom() source: {froms:?}");

    section("5. svc-agent list");
    println!(
        "{}",
        run(
            &sb.tools.agent.to_string_lossy(),
            [
                "list".as_ref(),
                "--bpffs".as_ref(),
                bpffs.path().as_os_str()
            ]
        )?
    );

    section("6. What a Service really is");
    let client = sb.client_ns().name();
    show(
        "ip",
        &["-n", client, "addr"],
        &format!("no interface holds {VIP}"),
    );
    show("ip", &["-n", client, "route"], "no route covers it either");
    show(
        "ip",
        &["netns", "list"],
        "the Service has no namespace of its own",
    );
    let services_map = svc_agent::datapath::map_pin(bpffs.path(), svc_common::map_names::SERVICES);
    show(
        "bpftool",
        &["map", "dump", "pinned", &services_map.to_string_lossy()],
        "it is an entry in a BPF hash map (addresses as ::ffff:a.b.c.d, ports big-endian)",
    );
    show(
        "bpftool",
        &["cgroup", "show", &sb.cgroup().path().to_string_lossy()],
        "and socket hooks on the client's cgroup that rewrite connect()/sendmsg() to a backend",
    );

    let status = agent.terminate(std::time::Duration::from_secs(10))?;
    println!("\nsvc-agent stopped ({status}); removing pins, cgroup, namespaces, backends");
    drop(agent);
    drop(bpffs);
    drop(backends);
    drop(m);
    let tools = sb.tools.clone();
    drop(sb);

    svc_tests::interrupt::check()?;
    ok &= packet_demo(&tools)?;

    section("12. Teardown");
    println!("done");
    println!("\nRESULT: {}", if ok { "OK" } else { "FAILED" });
    Ok(ok)
}

fn show(cmd: &str, args: &[&str], what: &str) {
    println!("\n$ {cmd} {}    # {what}", args.join(" "));
    match run(cmd, args) {
        Ok(out) => print!("{out}"),
        Err(e) => println!("({e:#})"),
    }
}

/// JSON of a dual-port Service `demo/NAME` of `kind` (NodePort 30080 for both protocols).
fn packet_service(
    name: &str,
    kind: &str,
    vip: &str,
    status: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "type": kind,
            "clusterIP": vip,
            "selector": {"app": name},
            "externalTrafficPolicy": "Cluster",
            "ports": [
                {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
            ],
        },
        "status": status,
    })
}

/// Its EndpointSlice: pod1 on node-1, pod2 on node-2.
fn packet_slice(service: &str) -> serde_json::Value {
    use svc_tests::topology::{POD1, POD2};
    let ep = |ip: &str, node: &str| {
        serde_json::json!({
            "addresses": [ip],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "nodeName": node,
        })
    };
    serde_json::json!({
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
        "endpoints": [ep(POD1, "node-1"), ep(POD2, "node-2")],
    })
}

/// The packet datapath: NodePort and LoadBalancer IP from outside the node.
fn packet_demo(tools: &Tools) -> Result<bool> {
    use svc_tests::topology::{Nodes, CLIENT, NODE1, POD1, POD2};
    use svc_tests::{Agent, Backend, Bpffs, ClientRun, TestCgroup};
    const LB_IP: &str = "10.77.100.20";

    section("7. From outside the node: a second topology");
    let nodes = Nodes::new().context("building the topology")?;
    // The agent's cgroup (its socket hooks go there; nothing runs in it) and the client's,
    // which no agent serves: the client's packets meet only the tc programs.
    let served = TestCgroup::new()?;
    let outside = TestCgroup::new()?;
    println!("external client : {} ({CLIENT})", nodes.client.name());
    println!("node 1          : {} ({NODE1} on eth0)", nodes.node1.name());
    println!("node 2          : {} (10.77.0.2)", nodes.node2.name());
    let mut backends = Vec::new();
    for (ns, name, ip) in [(&nodes.pod1, "pod1", POD1), (&nodes.pod2, "pod2", POD2)] {
        let listens = [format!("{ip}:8080").parse()?, format!("{ip}:5353").parse()?];
        backends.push(Backend::start(&tools.probe, ns, name, &listens)?);
    }
    println!("backend pod1    : {POD1} on node 1   backend pod2: {POD2} on node 2");

    let m = Manifests::new()?;
    m.write_value("eps-web-np.yaml", &packet_slice("web-np"))?;
    let mut lb = packet_service(
        "web-lb",
        "LoadBalancer",
        "10.96.0.21",
        serde_json::json!({"loadBalancer": {"ingress": [{"ip": LB_IP}]}}),
    );
    for p in lb["spec"]["ports"].as_array_mut().into_iter().flatten() {
        p["nodePort"] = 30081.into();
    }
    let mut np = packet_service("web-np", "NodePort", "10.96.0.20", serde_json::json!({}));
    for p in np["spec"]["ports"].as_array_mut().into_iter().flatten() {
        p["nodePort"] = 30080.into();
    }
    m.write_value("svc-web-np.yaml", &np)?;
    m.write_value("svc-web-lb.yaml", &lb)?;
    m.write_value("eps-web-lb.yaml", &packet_slice("web-lb"))?;
    println!(
        "Services: demo/web-np NodePort 30080 (TCP and UDP), demo/web-lb LoadBalancer {LB_IP}"
    );

    section("8. An agent on node 1");
    let bpffs = Bpffs::new(&tools.agent, served.path())?;
    let args: Vec<std::ffi::OsString> = vec![
        "run".into(),
        "--manifests".into(),
        m.dir().into(),
        "--cgroup".into(),
        served.path().into(),
        "--bpffs".into(),
        bpffs.path().into(),
        "--node-name".into(),
        "node-1".into(),
        "--devices".into(),
        "eth0".into(),
    ];
    let launcher = [
        "nsenter".into(),
        format!("--net={}", nodes.node1.path().display()).into(),
    ];
    println!(
        "$ nsenter --net={} {} {}",
        nodes.node1.path().display(),
        tools.agent.display(),
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut agent =
        Agent::start_launched(&launcher, &tools.agent, args, bpffs.path(), m.scratch())?;
    agent.quiet();
    if let Err(e) = agent.wait_ready(AGENT_READY_TIMEOUT) {
        println!("{}", agent.log());
        return Err(e);
    }
    for line in agent.log().lines().filter(|l| l.contains("device=")) {
        println!(
            "{}",
            line.split_once("svc_agent::").map_or(line, |(_, l)| l)
        );
    }

    section("9. Traffic from the external client");
    let mut ok = true;
    let probe = |args: &[&str]| -> Result<svc_tests::Report> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        ClientRun::spawn(&tools.probe, &outside, &nodes.client, &args)?
            .wait(std::time::Duration::from_secs(60))
    };
    for (what, args) in [
        (
            "TCP to the NodePort",
            ["tcp", "--to", "10.77.0.1:30080", "--count", "20"],
        ),
        (
            "UDP to the NodePort",
            ["udp", "--to", "10.77.0.1:30080", "--count", "20"],
        ),
        (
            "TCP to the LB IP",
            ["tcp", "--to", "10.77.100.20:80", "--count", "20"],
        ),
        (
            "UDP to the LB IP",
            ["udp", "--to", "10.77.100.20:53", "--count", "20"],
        ),
    ] {
        let r = probe(&args)?;
        let seen: BTreeMap<String, usize> = r.results.iter().fold(BTreeMap::new(), |mut m, a| {
            let from = a.peer.clone().or(a.from.clone()).unwrap_or_default();
            *m.entry(from).or_default() += 1;
            m
        });
        println!(
            "{what:22}: answered by {:?}, failed {}, reply from {seen:?}",
            r.backends(),
            r.failures().len()
        );
        ok &= r.all_ok() && r.backends().len() == 2;
    }

    section("10. What node 1 holds");
    println!(
        "{}",
        run(
            &tools.agent.to_string_lossy(),
            [
                "list".as_ref(),
                "--bpffs".as_ref(),
                bpffs.path().as_os_str()
            ]
        )?
    );
    let ct = svc_agent::datapath::map_pin(bpffs.path(), svc_common::map_names::CT);
    let ct_path = ct.to_string_lossy().into_owned();
    println!(
        "\n$ bpftool -j map dump pinned {ct_path}    # connection tracking of assured flows: two \
         entries per flow; flows to pod2 (node 2) are SNATed to 10.77.0.1 on ports above the node's \
         ephemeral range, flows to pod1 keep the client's address (the first two shown)"
    );
    match run("bpftool", ["-j", "map", "dump", "pinned", &ct_path]) {
        Ok(out) => {
            let entries: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap_or_default();
            let first: Vec<_> = entries.iter().take(2).collect();
            println!("{}", serde_json::to_string_pretty(&first)?);
            println!("... {} entries in all", entries.len());
        }
        Err(e) => println!("({e:#})"),
    }
    if let Ok(p) = svc_agent::datapath::read_packet_stats(bpffs.path()) {
        println!(
            "flows: {} ({} SNATed to a node address); eth0 decisions: {:?}",
            p.flows,
            p.snat_flows,
            p.devices
                .iter()
                .map(|(_, reason, n)| format!("{reason}={n}"))
                .collect::<Vec<_>>()
        );
    }
    show(
        "ls",
        &[&bpffs.path().to_string_lossy()],
        "the tc programs hang on pinned tcx links (link_tc_*), next to the cgroup links",
    );

    section("11. Uninstall");
    let status = agent.terminate(std::time::Duration::from_secs(10))?;
    println!("svc-agent stopped ({status})");
    drop(agent);
    println!(
        "{}",
        svc_tests::agent::uninstall(&tools.agent, bpffs.path(), Some(served.path()))?
    );
    drop(bpffs);
    drop(backends);
    drop(m);
    drop(nodes);
    Ok(ok)
}
