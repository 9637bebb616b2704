//! svc-demo: a ClusterIP Service served by svc, end to end, in a throwaway sandbox.
//!
//! Builds a client namespace (in a fresh test cgroup) and a backend namespace with four
//! backends, writes a Service `demo/web` (10.96.0.10, TCP 80 → 8080 and UDP 53 → 5353) and its
//! EndpointSlice (three ready endpoints, one not ready), runs `svc-agent run` on that cgroup,
//! sends requests through the ClusterIP and shows who answered, then shows what a Service is
//! made of: no interface, no namespace, no route, just map entries and cgroup hooks. Every
//! resource is a guard, so the sandbox is gone when the demo exits, also on error or Ctrl-C
//! during a step (the process then dies; guards run on the error paths).

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
    /// Only remove what killed harness runs left behind (namespaces, cgroups, pins and
    /// manifest dirs whose owning process is gone), then exit.
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
    match demo(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            println!("\nRESULT: FAILED (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("svc-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
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
    let services_map = bpffs.path().join("SVC_SERVICES_v1");
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

    section("7. Teardown");
    let status = agent.terminate(std::time::Duration::from_secs(10))?;
    println!("svc-agent stopped ({status}); removing pins, cgroup, namespaces, backends");
    drop(agent);
    drop(bpffs);
    drop(backends);
    drop(m);
    drop(sb);
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
