//! The agent on manifest files at cluster scale (default 100,000 Services of 3 endpoints): time
//! to ready on empty maps and on its own pinned maps, one change, the agent's peak memory, and
//! the kernel memory its maps hold, idle and full.
//!
//! Runs the release agent (`SVC_AGENT_BIN`) as a process on a test cgroup, as root.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use svc_tests::scale::{write_services, GenService};
use svc_tests::{interrupt, report, require_root, Agent, Bpffs, Manifests, TestCgroup, Tools};

#[derive(Parser)]
struct Args {
    /// Services, one TCP port and one EndpointSlice each.
    #[arg(long, default_value_t = 100_000)]
    services: u32,
    /// Ready endpoints per EndpointSlice.
    #[arg(long, default_value_t = 3)]
    endpoints: u32,
    /// Replace this benchmark's section of this markdown file (docs/benchmarks.md).
    #[arg(long)]
    write: Option<std::path::PathBuf>,
}

const TARGET_PEAK_MIB: f64 = 256.0;

fn status(pid: u32, field: &str) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("{field} of {pid}"))?;
    Ok(kib / 1024.0)
}

/// Kernel memory of the pinned maps (bpftool's `bytes_memlock`), in MiB.
fn maps_mib(dir: &Path) -> Result<f64> {
    let mut total = 0u64;
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        if !path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("SVC_"))
        {
            continue;
        }
        let v = svc_tests::sys::pinned_map_info(&path)?;
        total += v["bytes_memlock"].as_u64().unwrap_or(0);
    }
    Ok(total as f64 / (1 << 20) as f64)
}

fn ready(agent: &mut Agent) -> Result<(Duration, f64, f64)> {
    let t = Instant::now();
    agent.wait_ready(Duration::from_secs(600))?;
    let took = t.elapsed();
    let pid = agent.pid().context("no pid")?;
    Ok((took, status(pid, "VmRSS:")?, status(pid, "VmHWM:")?))
}

fn main() -> ExitCode {
    interrupt::run(bench)
}

fn bench() -> Result<()> {
    let args = Args::parse();
    require_root();
    let tools = Tools::locate();
    let cgroup = TestCgroup::new()?;
    let m = Manifests::new()?;
    let n = args.services;
    let services: Vec<_> = (0..n)
        .map(|i| GenService::nth(i, args.endpoints, 0))
        .collect();
    write_services(m.dir(), m.scratch(), &services)?;
    interrupt::check()?;
    let bytes: u64 = std::fs::read_dir(m.dir())?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();

    // An idle agent: what the maps cost before anything is in them.
    let empty = Manifests::new()?;
    let idle_dir = Bpffs::new(&tools.agent, cgroup.path())?;
    let mut idle = Agent::start(
        &tools.agent,
        empty.dir(),
        cgroup.path(),
        idle_dir.path(),
        &[],
        empty.scratch(),
    )?;
    idle.quiet();
    let (_, idle_rss, _) = ready(&mut idle)?;
    let idle_maps = maps_mib(idle_dir.path())?;
    idle.terminate(Duration::from_secs(30))?;
    drop(idle);
    drop(idle_dir);

    let bpffs = Bpffs::new(&tools.agent, cgroup.path())?;
    let mut agent = Agent::start(
        &tools.agent,
        m.dir(),
        cgroup.path(),
        bpffs.path(),
        &[],
        m.scratch(),
    )?;
    agent.quiet();
    let (cold, cold_rss, cold_hwm) = ready(&mut agent)?;
    let full_maps = maps_mib(bpffs.path())?;
    eprintln!("cold start {cold:?}, RSS {cold_rss:.1} MiB, peak {cold_hwm:.1} MiB");

    // One Service's endpoints change: one file is read again, everything is translated again.
    let mut changed = services.clone();
    changed[n as usize / 2] = GenService::nth(n / 2, args.endpoints, 1);
    let t = Instant::now();
    write_services(m.dir(), m.scratch(), &changed)?;
    agent.wait_for_lines(svc_tests::agent::SYNCED_LINE, 2, Duration::from_secs(600))?;
    let change = t.elapsed();
    let pid = agent.pid().context("no pid")?;
    let change_hwm = status(pid, "VmHWM:")?;

    // A restart adopts the pinned maps and writes nothing.
    agent.kill()?;
    agent.restart()?;
    let (restart, restart_rss, restart_hwm) = ready(&mut agent)?;
    eprintln!("restart {restart:?}, RSS {restart_rss:.1} MiB, peak {restart_hwm:.1} MiB");
    // What the killed agent retired is deleted once the new one's grace period has passed.
    interrupt::sleep(Duration::from_millis(1500))?;
    let problems =
        svc_tests::scale::pinned_vs(bpffs.path(), &svc_tests::scale::desired_of(&changed))?;
    anyhow::ensure!(
        problems.is_empty(),
        "the maps are not what the manifests say: {:?}",
        &problems[..problems.len().min(5)]
    );
    agent.terminate(Duration::from_secs(30))?;

    let peak = cold_hwm.max(restart_hwm).max(change_hwm);
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let table = [
        "| measure | target | measured | |".to_string(),
        "|---|---|---|---|".to_string(),
        format!(
            "| spawn to ready on empty maps ({n} Services, {} backends) | | {:.2} s | |",
            n * args.endpoints,
            cold.as_secs_f64()
        ),
        format!(
            "| one Service changed: file written to maps synced | | {:.0} ms | |",
            change.as_secs_f64() * 1000.0
        ),
        format!(
            "| restart (SIGKILL) to ready on its own pinned maps | | {:.2} s | |",
            restart.as_secs_f64()
        ),
        format!(
            "| agent peak RSS (VmHWM): cold start / after the change / restart | < {TARGET_PEAK_MIB:.0} MiB | {cold_hwm:.1} / {change_hwm:.1} / {restart_hwm:.1} MiB | {} |",
            verdict(peak < TARGET_PEAK_MIB)
        ),
        format!("| agent RSS once ready (VmRSS): cold start / restart | | {cold_rss:.1} / {restart_rss:.1} MiB | |"),
        format!("| agent RSS idle (no Services) | | {idle_rss:.1} MiB | |"),
        format!("| kernel memory of the maps (bpftool bytes_memlock): idle / with {n} Services | | {idle_maps:.0} / {full_maps:.0} MiB | |"),
    ]
    .join("\n");
    println!("{table}");
    if let Some(path) = args.write {
        let body = format!(
            "## The agent on manifests: {n} Services of {e} endpoints\n\n\
             Measured with `cargo xtask bench --write` (release build, as root) on {machine}, \
             {date}; load average {load} (1, 5, 15 min) at the end.\n\n\
             {n} Services of one TCP port, each with one EndpointSlice of {e} ready endpoints on \
             made-up addresses, as JSON streams of 2,000 Services per file ({mib:.0} MiB in \
             all). `svc-agent run --manifests DIR` (the release binary, as a process, on a test \
             cgroup, default map capacities) is timed from spawn to `svc-agent: ready`; then \
             one Service's endpoints are changed (one file written) and the sync timed; then the \
             agent is SIGKILLed and started again on its own pinned maps, after which the maps \
             are compared entry by entry with what the manifests say. RSS is VmRSS and VmHWM of \
             /proc/PID/status. The DaemonSet's memory limit is set from the agent's memory \
             cgroup, which also counts the maps' kernel memory (\"kube-scale\" below).\n\n\
             {table}\n\n\
             Reproduce: `cargo xtask bench --scale`; the bench itself is `svc-scale-bench \
             --help` (services, endpoints).",
            e = args.endpoints,
            machine = report::machine(),
            date = report::today(),
            load = report::load_average(),
            mib = bytes as f64 / (1 << 20) as f64,
        );
        report::write_section(&path, "scale", &body)?;
        eprintln!("wrote the scale section of {}", path.display());
    }
    Ok(())
}
