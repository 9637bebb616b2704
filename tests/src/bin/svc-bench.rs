//! svc-bench: what a ClusterIP costs, measured side by side in one run.
//!
//! In one sandbox (client namespace in a test cgroup, one backend server), it measures new TCP
//! connections per second and the latency of one request (connect, send, reply) to the backend
//! directly and through a ClusterIP, first with 1 service in the maps and then with 100,000
//! more. Direct and ClusterIP rounds alternate, so drift of the machine hits both alike; the
//! result is given as ratios. The datapath is programmed in-process through the agent's own
//! library (the same code `svc-agent run` uses), so loading 100,000 services does not depend on
//! parsing 200,000 YAML documents.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use svc_agent::model::{DesiredFrontend, DesiredState, Frontend, Protocol};
use svc_agent::reconcile::Programmed;
use svc_agent::store::BpfStore;
use svc_tests::{interrupt, require_root, Report, Sandbox, Tools};

#[derive(Parser)]
struct Args {
    /// Replace this benchmark's section of this markdown file (docs/benchmarks.md).
    #[arg(long)]
    write: Option<PathBuf>,
    /// Connections per round, alternating direct and ClusterIP.
    #[arg(long, default_value_t = 4000)]
    connections: u32,
    /// Rounds per phase.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Other services loaded for the second phase.
    #[arg(long, default_value_t = 100_000)]
    services: u32,
}

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const PORT: u16 = 8080;

#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    /// New connections per second, back to back (connect, request, reply, close).
    conn_per_s: f64,
    /// Whole request, new connection included.
    p50_us: f64,
    p99_us: f64,
    /// connect() alone: where the ClusterIP translation happens.
    connect_p50_us: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

fn figures(attempts: &[&svc_tests::Attempt]) -> Figures {
    let mut us: Vec<u64> = attempts.iter().map(|a| a.elapsed_us).collect();
    us.sort_unstable();
    let mut connect: Vec<u64> = attempts.iter().filter_map(|a| a.connect_us).collect();
    connect.sort_unstable();
    let total: u64 = us.iter().sum();
    Figures {
        conn_per_s: us.len() as f64 * 1e6 / total.max(1) as f64,
        p50_us: percentile(&us, 0.5),
        p99_us: percentile(&us, 0.99),
        connect_p50_us: percentile(&connect, 0.5),
    }
}

fn frontend(ip: Ipv4Addr, port: u16, owner: &str, backends: Vec<SocketAddr>) -> DesiredFrontend {
    DesiredFrontend::cluster_ip(
        Frontend::cluster(IpAddr::V4(ip), port, Protocol::Tcp),
        owner,
        backends.into_iter().map(Into::into).collect(),
    )
}

fn state(frontends: Vec<DesiredFrontend>) -> DesiredState {
    let mut s = DesiredState::default();
    for f in frontends {
        s.cluster_ips.insert(f.frontend.ip);
        s.frontends.insert(f.frontend, f);
    }
    s
}

/// The bench service plus `n` others, each with one backend of its own, on addresses in
/// 10.100.0.0/14 that nothing listens on (they only fill the maps).
fn with_others(bench: &DesiredFrontend, n: u32) -> DesiredState {
    let mut all = vec![bench.clone()];
    for i in 0..n {
        let [_, b, c, d] = (0x0a64_0000u32 + i).to_be_bytes();
        let ip = Ipv4Addr::new(10, b, c, d);
        let backend = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, b + 4, c, d)), PORT);
        all.push(frontend(ip, 80, &format!("bench/other-{i}"), vec![backend]));
    }
    state(all)
}

/// One round of connections alternating between `direct` and the ClusterIP within one probe,
/// so both see the same machine at the same moment.
fn compare(sb: &Sandbox, direct: SocketAddr, args: &Args) -> Result<(Figures, Figures)> {
    let vip = SocketAddr::new(IpAddr::V4(VIP), 80);
    let alt = vip.to_string();
    {
        let report: Report = sb.tcp(direct, args.connections, &["--alternate-with", &alt])?;
        if !report.all_ok() {
            bail!("failed connections: {:?}", report.failures().first());
        }
        let (even, odd): (Vec<_>, Vec<_>) = report
            .results
            .iter()
            .enumerate()
            .partition(|(i, _)| i.is_multiple_of(2));
        let direct_attempts: Vec<_> = even.into_iter().map(|(_, a)| a).collect();
        let vip_attempts: Vec<_> = odd.into_iter().map(|(_, a)| a).collect();
        // The ClusterIP attempts must really have gone through the ClusterIP.
        if let Some(a) = vip_attempts
            .iter()
            .find(|a| a.peer.as_deref() != Some(&alt))
        {
            bail!("a ClusterIP attempt reports peer {:?}, not {alt}", a.peer);
        }
        Ok((figures(&direct_attempts), figures(&vip_attempts)))
    }
}

fn med(f: &[Figures]) -> Figures {
    Figures {
        conn_per_s: median(f.iter().map(|x| x.conn_per_s).collect()),
        p50_us: median(f.iter().map(|x| x.p50_us).collect()),
        p99_us: median(f.iter().map(|x| x.p99_us).collect()),
        connect_p50_us: median(f.iter().map(|x| x.connect_p50_us).collect()),
    }
}

/// A full sync, and the deletions it defers (as if the grace period had passed at once): what
/// programming a state costs in all.
fn apply(store: &mut BpfStore, p: &mut Programmed, desired: &DesiredState) -> Result<Duration> {
    let started = Instant::now();
    let report = p.apply(store, desired);
    if let Some(e) = report.errors.first() {
        bail!("programming the maps: {e} ({} errors)", report.errors.len());
    }
    let retired = p.retire_due(store, Instant::now() + Duration::from_secs(3600));
    if let Some(e) = retired.errors.first() {
        bail!("deleting retired entries: {e}");
    }
    Ok(started.elapsed())
}

fn main() -> ExitCode {
    interrupt::run(bench)
}

fn bench() -> Result<()> {
    let args = Args::parse();
    require_root();
    let sb = Sandbox::new(Tools::locate())?;
    let backend = sb.backend("b1", 1, &[PORT])?;
    let direct = SocketAddr::new(IpAddr::V4(sb.backend_v4(1)), PORT);
    let bpffs = sb.bpffs()?;
    let mut dp = svc_agent::datapath::Datapath::open_attached(
        bpffs.path(),
        sb.cgroup().path(),
        Default::default(),
    )
    .context("attaching the datapath")?;
    let store = &mut dp.store;
    let mut programmed =
        Programmed::adopt(&*store, store.capacity, svc_agent::reconcile::DEFAULT_GRACE)?;
    let bench = frontend(VIP, 80, "bench/target", vec![direct]);

    let one = state(vec![bench.clone()]);
    let many = with_others(&bench, args.services);
    // Phases alternate within every round (1 service, then all of them), so machine drift
    // between phases does not pose as a cost of the map size.
    let (mut d1, mut v1, mut dn, mut vn) = (vec![], vec![], vec![], vec![]);
    let (mut load_time, mut resync_time) = (Duration::ZERO, Duration::ZERO);
    for round in 0..args.rounds {
        interrupt::check()?;
        eprintln!("round {}/{}: 1 service", round + 1, args.rounds);
        apply(store, &mut programmed, &one)?;
        let (d, v) = compare(&sb, direct, &args)?;
        d1.push(d);
        v1.push(v);
        eprintln!(
            "round {}/{}: {} more services",
            round + 1,
            args.rounds,
            args.services
        );
        interrupt::check()?;
        load_time = apply(store, &mut programmed, &many)?;
        // A second pass over the same state must write nothing: the cost of a resync.
        resync_time = apply(store, &mut programmed, &many)?;
        let (d, v) = compare(&sb, direct, &args)?;
        dn.push(d);
        vn.push(v);
    }
    let services_in_map = programmed.frontends.len();
    let (d1, v1, dn, vn) = (med(&d1), med(&v1), med(&dn), med(&vn));

    // One service changing among 100,001: the cost of an incremental update.
    let scope: BTreeSet<Frontend> = [bench.frontend].into_iter().collect();
    let mut changed = many.clone();
    if let Some(f) = changed.frontends.get_mut(&bench.frontend) {
        f.backends
            .push(SocketAddr::new(IpAddr::V4(sb.backend_v4(2)), PORT).into());
    }
    let started = Instant::now();
    let r = programmed.apply_scoped(
        store,
        &changed,
        svc_agent::reconcile::Scope::Only(&scope),
        Instant::now(),
    );
    let one_change = started.elapsed();
    if !r.errors.is_empty() {
        bail!("incremental update: {:?}", r.errors);
    }
    drop(backend);

    let ratio = |a: f64, b: f64| a / b;
    let row = |label: &str, d: Figures, v: Figures| {
        format!(
            "| {label} | {:.0} | {:.0} | {:.3} | {:.0} | {:.0} | {:.3} | {:.0} | {:.0} | {:.3} | {:.0} | {:.0} | {:.3} |",
            d.conn_per_s,
            v.conn_per_s,
            ratio(v.conn_per_s, d.conn_per_s),
            d.p50_us,
            v.p50_us,
            ratio(v.p50_us, d.p50_us),
            d.p99_us,
            v.p99_us,
            ratio(v.p99_us, d.p99_us),
            d.connect_p50_us,
            v.connect_p50_us,
            ratio(v.connect_p50_us, d.connect_p50_us),
        )
    };
    let table = [
        "| services in maps | direct conn/s | ClusterIP conn/s | ratio | direct request p50 µs | ClusterIP request p50 µs | ratio | direct request p99 µs | ClusterIP request p99 µs | ratio | direct connect() p50 µs | ClusterIP connect() p50 µs | ratio |".to_string(),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|".to_string(),
        row("1", d1, v1),
        row(&services_in_map.to_string(), dn, vn),
    ]
    .join("\n");
    let scale = format!(
        "ClusterIP with {services_in_map} services vs with 1: connection rate x{:.3}, request p50 x{:.3}, request p99 x{:.3}, connect() p50 x{:.3}.",
        ratio(vn.conn_per_s, v1.conn_per_s),
        ratio(vn.p50_us, v1.p50_us),
        ratio(vn.p99_us, v1.p99_us),
        ratio(vn.connect_p50_us, v1.connect_p50_us)
    );
    let programming = format!(
        "Programming {} services into empty maps: {:.2} s; a full resync of all of them with nothing changed: {:.1} ms; one service's backend set changed among them (scoped sync): {:.3} ms.",
        args.services,
        load_time.as_secs_f64(),
        resync_time.as_secs_f64() * 1e3,
        one_change.as_secs_f64() * 1e3
    );
    println!("{table}\n\n{scale}\n{programming}");

    if let Some(path) = args.write {
        let body = format!(
            "## ClusterIP vs direct, socket-level datapath\n\n\
             Measured with `cargo xtask bench --write` (release build, as root) on {machine}, \
             {date}; load average {load} (1, 5, 15 min) at the end.\n\n\
             One client network namespace in a test cgroup, one backend server in another \
             namespace, joined by a veth pair. A round is {conns} new TCP connections back to \
             back from one probe process, alternating between the backend's own address and \
             the ClusterIP, so both targets see the same machine at the same moment; each \
             connection is connect(), send a line, read the reply, close. Connection rate is \
             connections per second of time spent on that target; request latency is one whole \
             connection; connect() is the system call alone, where the cgroup hook rewrites the \
             ClusterIP. The table shows the medians over {rounds} rounds; every round measures both map sizes, one after the other. Ratios are ClusterIP / \
             direct: 1.000 means no cost. Every ClusterIP connection is checked to report the \
             ClusterIP from getpeername(). Packets pay nothing after connect(): the socket \
             is connected to the backend itself.\n\n\
             {table}\n\n{scale}\n\n{programming}\n\n\
             The other services each have one backend of their own (addresses nothing listens \
             on); the maps are hash maps, so the lookup cost does not depend on how many \
             entries they hold. Figures on a 2-core machine with both cores shared by client, \
             server and kernel move by a few percent between runs; compare ratios, not \
             absolute numbers.\n\n\
             Reproduce: `cargo xtask bench --socket` (prints the table), `cargo xtask bench \
             --socket --write` (rewrites this section).",
            machine = svc_tests::report::machine(),
            date = svc_tests::report::today(),
            load = svc_tests::report::load_average(),
            conns = args.connections,
            rounds = args.rounds,
        );
        svc_tests::report::write_section(&path, "socket", &body)?;
        eprintln!("wrote the socket section of {}", path.display());
    }
    Ok(())
}
