//! svc-vs-kube-proxy-bench: svc beside the real kube-proxy (iptables mode on iptables-nft and on
//! iptables-legacy, nftables mode), in one run on one machine, with N Services of 10 endpoints.
//!
//! One control plane holds N Services (one TCP port each) with one EndpointSlice of 10 ready
//! endpoints each: the same 10 real backends, `b1..b10`, for every Service, so every ClusterIP
//! answers. Each proxy in turn gets a sandbox of its own (`svc_tests::parity::Proxy`: the same
//! addresses every time, kube-proxy in the client namespace, svc on the sandbox's cgroup), and
//! only one proxy runs at a time, so CPU and memory are its own. Per proxy:
//!
//! 1. start: from spawning the proxy to its ready signal (svc: `svc-agent: ready`; kube-proxy:
//!    its first rules sync), and to the end of the first sweep in which every one of the N
//!    ClusterIPs answered a TCP connection (`svc-probe sweep`, one connection each, in turn);
//!    the sweeps start at svc's first signal (`svc-agent: serving`: its socket programs
//!    attached, which may precede its tc programs' and `ready`), at kube-proxy's ready signal;
//! 2. change latency: sequential EndpointSlice writes, each moving one Service between its 10
//!    endpoints and an 11th backend, `b11`, timed from just before the API write to the end of
//!    the first client probe answered by the new side (a probe is a process: it adds a few
//!    milliseconds to every sample, for every proxy alike);
//! 3. CPU seconds (the proxy's own and its reaped children's: kube-proxy's iptables-restore
//!    runs) and peak RSS (VmHWM, the proxy's process alone) at the end of its turn;
//! 4. new TCP connections, back to back for a few seconds, through a ClusterIP and straight to
//!    a backend: the direct rate is the cost the proxy puts on connections to no Service, next
//!    to a sandbox with no proxy at all.
//!
//! Rounds interleave the proxies (the order rotates each round); every figure is the median
//! over rounds with min and max; ratios are taken round by round against svc. Results go to
//! JSON (`--json`), PNG charts (`--plots`: each measure against N, a line per proxy) and, with
//! `--write`, to the `vs-kube-proxy` section of docs/benchmarks.md. `--from-json` draws the
//! table and the charts again from a saved run, without measuring.
//!
//! Nothing leaves the sandboxes: kube-proxy's rules live in the client namespace it runs in,
//! and the machine's own firewall is checked before and after.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::PostParams;
use kube::{Api, Client};
use serde::{Deserialize, Serialize};
use svc_tests::control_plane::ControlPlane;
use svc_tests::kube_proxy::{self, HostFirewallGuard, IptablesBackend, Mode};
use svc_tests::parity::{Proxy, ProxyKind, NODE};
use svc_tests::report::{fmt3, median};
use svc_tests::{bulk, interrupt, report, require_root, Sandbox, TempDir, Tools};

const NAMESPACE: &str = "bench";
const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
const ENDPOINTS: u8 = 10;
/// The backend a change moves a Service to, and back from.
const OTHER: u8 = 11;
/// Third octet of every sandbox: the same backend addresses behind every proxy.
const X: u8 = 78;

#[derive(Parser)]
struct Args {
    /// Service counts, each measured on its own control plane.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,30000")]
    services: Vec<u32>,
    /// Rounds; each runs every proxy once, in an order that rotates.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// EndpointSlice changes timed per proxy and round.
    #[arg(long, default_value_t = 50)]
    changes: u32,
    /// Seconds of back-to-back connections per rate measure.
    #[arg(long, default_value_t = 3)]
    rate_seconds: u64,
    /// Which proxies (svc, kube-proxy-iptables-nft, kube-proxy-iptables-legacy,
    /// kube-proxy-nftables), comma-separated; all by default.
    #[arg(long, value_delimiter = ',')]
    proxies: Vec<String>,
    /// Longest a turn spends on changes, in seconds: the changes left are not made. A proxy
    /// that syncs for a minute would otherwise take its whole `--changes` minutes.
    #[arg(long, default_value_t = 180)]
    changes_budget_s: u64,
    /// A proxy whose turn needed longer than this, in seconds, from start to every Service
    /// answering (or that gave up) is not run again at this Service count or a larger one:
    /// one such turn says what it has to say, and its repeats would take the run's hours.
    #[arg(long, default_value_t = 300)]
    slow_s: u64,
    /// A turn gives up, with no figures, when its proxy has not had every Service answering
    /// this many seconds after its start.
    #[arg(long, default_value_t = 1200)]
    give_up_s: u64,
    /// No turn starts after this many minutes of the run; those left are listed as not run.
    #[arg(long)]
    stop_after_min: Option<u64>,
    /// Probe processes that sweep the ClusterIPs at once, each over its share: more of them
    /// find every Service answering sooner after it does (a sweep is the start measure's
    /// resolution). One by default, as the earlier runs.
    #[arg(long, default_value_t = 1)]
    sweep_shards: u32,
    /// Threads of each sweep process, probing at once (one target each at a time): the
    /// sweep's length is the start measure's resolution, and one connection at a time
    /// leaves the CPUs mostly waiting. One by default, as the earlier runs.
    #[arg(long, default_value_t = 1)]
    sweep_workers: u32,
    /// Threads each backend answers a listening socket with (`svc-probe serve --threads`);
    /// without it a connection gets a new thread of its own, as the earlier runs.
    #[arg(long)]
    backend_threads: Option<u32>,
    /// Quick: 1,000 Services, 3 rounds, 10 changes.
    #[arg(long)]
    quick: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw a PNG chart per measure into this directory (`vs-kube-proxy-<measure>.png`).
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Measure nothing: the table and the charts from the results a run saved with `--json`.
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// Replace the `vs-kube-proxy` section of this markdown file (docs/benchmarks.md).
    #[arg(long)]
    write: Option<PathBuf>,
}

/// A whole run, as `--json` saves it and `--from-json` reads it back.
#[derive(Debug, Serialize, Deserialize)]
struct Results {
    machine: String,
    date: String,
    load_before: String,
    quick: bool,
    services: Vec<u32>,
    rounds: u32,
    changes: u32,
    /// Proxy ids (`ProxyKind::id`), in table order.
    proxies: Vec<String>,
    samples: Vec<Sample>,
    /// New connections/s straight to a backend with no proxy at all, one per round.
    bare_direct_conn_per_s: Vec<f64>,
    failed_turns: Vec<String>,
    /// Turns not run, and why (a proxy too slow at this Service count or a smaller one).
    #[serde(default)]
    skipped: Vec<String>,
    /// The bench's own arguments that shape the measures (not where it writes), when the run
    /// was not plain `cargo xtask bench --vs-kube-proxy [--quick]`.
    #[serde(default)]
    arguments: Vec<String>,
}

/// One proxy's turn in one round.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Sample {
    services: u32,
    round: u32,
    proxy: String,
    ready_s: f64,
    /// svc: to its first signal, the socket programs attached (the sweeps start there);
    /// kube-proxy: its ready signal.
    #[serde(default)]
    serving_s: f64,
    all_answering_s: f64,
    /// How long the sweep that found every Service answering took: the resolution of
    /// `all_answering_s`.
    last_sweep_s: f64,
    change_p50_ms: f64,
    change_p99_ms: f64,
    /// Changes made; fewer than `--changes` when the turn's budget ran out.
    #[serde(default)]
    changes_made: u32,
    changes_not_followed: u32,
    cpu_s: f64,
    peak_rss_mib: f64,
    cluster_ip_conn_per_s: f64,
    direct_conn_per_s: f64,
    /// The turn began before the API server, etcd and the machine went quiet (`sys::settle`
    /// gave up).
    #[serde(default)]
    unsettled: bool,
}

/// Backend `b<k>`'s address: the sandbox plan's, the same in every sandbox with `X`.
fn backend_ip(k: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 201, X, 10 + k)
}

/// Service `i`'s slice: `b1..b10`, or `b11` alone when `moved`.
fn slice(i: u32, moved: bool) -> EndpointSlice {
    let ks = if moved { OTHER..=OTHER } else { 1..=ENDPOINTS };
    bulk::slice(NAMESPACE, i, ks.map(backend_ip), TARGET_PORT)
}

fn peak_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("VmHWM")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Connections per second, back to back for `secs`, from the sandbox's client.
fn rate(sb: &Sandbox, to: SocketAddr, secs: u64) -> Result<f64> {
    let d = Duration::from_secs(secs);
    let r = sb.finish_loop(sb.spawn_loop_flat_out(to, d)?, d + Duration::from_secs(30))?;
    if r.failed > 0 {
        bail!(
            "{} of {} connections to {to} failed: {:?}",
            r.failed,
            r.ok + r.failed,
            r.errors
        );
    }
    Ok(r.per_second())
}

struct Turn<'a> {
    cp: &'a ControlPlane,
    client: &'a Client,
    rt: &'a tokio::runtime::Runtime,
    tools: &'a Tools,
    kube_proxy: &'a Path,
    /// The ClusterIPs, in `--sweep-shards` files.
    targets: &'a [PathBuf],
    args: &'a Args,
    n: u32,
    /// Which Services a change has moved to b11, kept across turns.
    moved: &'a mut Vec<bool>,
    /// The next Service to change.
    next: &'a mut u32,
}

fn turn(t: &mut Turn, kind: ProxyKind, round: u32) -> Result<Sample> {
    // The API server after the last proxy's lists, the kernel freeing its maps or rules.
    let settled = svc_tests::sys::settle(&t.cp.pids(), Duration::from_secs(120))?;
    eprintln!(
        "  {} ({} Services), round {} ({settled})",
        kind.label(),
        t.n,
        round + 1,
    );
    let started = Instant::now();
    // svc: from its first signal (the socket programs attached), which may come before its
    // ready signal (the tc programs attached too); that one is watched for meanwhile.
    let proxy = Proxy::start_until(
        kind,
        t.cp,
        t.tools,
        X,
        Some(t.kube_proxy),
        Duration::from_secs(t.args.give_up_s),
        false,
        svc_tests::agent::SERVING_LINE,
    )?;
    let serving = started.elapsed();
    let ready_watch = proxy.agent().map(|a| {
        let log = a.log_path();
        let give_up = Duration::from_secs(t.args.give_up_s);
        std::thread::spawn(move || loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text
                .lines()
                .any(|l| l.trim() == svc_tests::agent::READY_LINE)
            {
                return Some(started.elapsed());
            }
            if started.elapsed() > give_up {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        })
    });
    let threads = t.args.backend_threads.map(|n| n.to_string());
    let extra: Vec<&str> = match &threads {
        Some(n) => vec!["--threads", n],
        None => Vec::new(),
    };
    let _backends: Vec<_> = (1..=OTHER)
        .map(|k| proxy.serve_with(k, &[TARGET_PORT], &extra))
        .collect::<Result<_>>()?;
    let pid = match (proxy.agent(), proxy.kube_proxy()) {
        (Some(a), _) => a.pid(),
        (_, Some(kp)) => kp.pid(),
        _ => None,
    }
    .context("no proxy pid")?;
    // The Services a change moved to b11 answer from b11; a sweep only needs an answer.
    let (all_answering, last_sweep) = loop {
        interrupt::check()?;
        let r = proxy.sb.sweep_shards(
            t.targets,
            t.args.sweep_workers,
            1000,
            Duration::from_secs(30 + u64::from(t.n) / 10),
        )?;
        if r.failed == 0 && r.ok == u64::from(t.n) {
            break (started.elapsed(), Duration::from_micros(r.elapsed_us));
        }
        if started.elapsed() > Duration::from_secs(t.args.give_up_s) {
            bail!(
                "{}: {} of {} Services still not answering {} s after its start: {:?}",
                kind.label(),
                r.failed,
                t.n,
                t.args.give_up_s,
                r.first_failures
            );
        }
    };
    let ready = match ready_watch {
        Some(w) => w
            .join()
            .map_err(|_| anyhow::anyhow!("the ready watch panicked"))?
            .context("no ready signal")?,
        None => serving,
    };
    eprintln!(
        "    serving {:.2} s, ready {:.2} s, every Service answering {:.2} s (last sweep {:.2} s)",
        serving.as_secs_f64(),
        ready.as_secs_f64(),
        all_answering.as_secs_f64(),
        last_sweep.as_secs_f64()
    );

    let api: Api<EndpointSlice> = Api::namespaced(t.client.clone(), NAMESPACE);
    let mut latencies = Vec::new();
    let mut not_followed = 0;
    let mut made = 0;
    let changes_started = Instant::now();
    for _ in 0..t.args.changes {
        interrupt::check()?;
        if changes_started.elapsed() > Duration::from_secs(t.args.changes_budget_s) {
            break;
        }
        made += 1;
        let i = *t.next % t.n;
        *t.next += 1;
        let moved = !t.moved[i as usize];
        t.moved[i as usize] = moved;
        let vip = SocketAddr::new(IpAddr::V4(bulk::cluster_ip(i)), PORT);
        let name = format!("{}-0", bulk::service_name(i));
        let t0 = Instant::now();
        t.rt.block_on(api.replace(&name, &PostParams::default(), &{
            let mut s = slice(i, moved);
            s.metadata.resource_version = t.rt.block_on(api.get(&name))?.metadata.resource_version;
            s
        }))
        .with_context(|| format!("replacing {name}"))?;
        let followed = loop {
            let r = proxy.sb.tcp(vip, 1, &["--timeout-ms", "500"])?;
            let answered = r.results.first().and_then(|a| a.backend.clone());
            let on_new_side = match answered.as_deref() {
                Some(b) => (b == format!("b{OTHER}")) == moved,
                None => false,
            };
            if on_new_side {
                break Some(t0.elapsed());
            }
            if t0.elapsed() > Duration::from_secs(30) {
                break None;
            }
        };
        match followed {
            Some(d) => latencies.push(d),
            None => not_followed += 1,
        }
    }
    latencies.sort_unstable();

    let vip = SocketAddr::new(IpAddr::V4(bulk::cluster_ip(0)), PORT);
    let direct = SocketAddr::new(IpAddr::V4(backend_ip(1)), TARGET_PORT);
    let cluster_ip_rate = rate(&proxy.sb, vip, t.args.rate_seconds)?;
    let direct_rate = rate(&proxy.sb, direct, t.args.rate_seconds)?;
    let cpu = svc_tests::sys::cpu_time_with_children(pid)?;
    let rss = peak_rss_kib(pid)?;
    drop(proxy);
    Ok(Sample {
        services: t.n,
        round,
        proxy: kind.id().into(),
        ready_s: ready.as_secs_f64(),
        serving_s: serving.as_secs_f64(),
        all_answering_s: all_answering.as_secs_f64(),
        last_sweep_s: last_sweep.as_secs_f64(),
        change_p50_ms: percentile(&latencies, 0.5).as_secs_f64() * 1e3,
        change_p99_ms: percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        changes_made: made,
        changes_not_followed: not_followed,
        cpu_s: cpu.as_secs_f64(),
        peak_rss_mib: rss as f64 / 1024.0,
        cluster_ip_conn_per_s: cluster_ip_rate,
        direct_conn_per_s: direct_rate,
        unsettled: !settled.quiet,
    })
}

/// The direct connection rate with no proxy at all: the baseline for the cost on connections
/// to no Service.
fn bare_rate(tools: &Tools, secs: u64) -> Result<f64> {
    let sb = Sandbox::with_x(tools.clone(), X)?;
    sb.add_default_route()?;
    let _b = sb.backend("b1", 1, &[TARGET_PORT])?;
    rate(
        &sb,
        SocketAddr::new(IpAddr::V4(backend_ip(1)), TARGET_PORT),
        secs,
    )
}

/// `median (min–max)` of `f` over the samples of `proxy` at `n`.
fn spread(samples: &[Sample], n: u32, proxy: &str, f: impl Fn(&Sample) -> f64) -> Option<[f64; 3]> {
    report::spread(
        samples
            .iter()
            .filter(|s| s.services == n && s.proxy == proxy)
            .map(f)
            .collect(),
    )
}

/// Median over rounds of `f(kube-proxy) / f(svc)`, pairing the two of each round.
fn ratio(samples: &[Sample], n: u32, proxy: &str, f: impl Fn(&Sample) -> f64) -> Option<f64> {
    let mut v: Vec<f64> = samples
        .iter()
        .filter(|s| s.services == n && s.proxy == proxy)
        .filter_map(|s| {
            let svc = samples
                .iter()
                .find(|o| o.services == n && o.round == s.round && o.proxy == "svc")?;
            let d = f(svc);
            (d > 0.0).then(|| f(s) / d)
        })
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(median(&v))
}

struct Measure {
    name: &'static str,
    /// The chart's file: `vs-kube-proxy-<file>.png`.
    file: &'static str,
    /// The chart's value axis.
    #[cfg_attr(not(feature = "charts"), allow(dead_code))]
    unit: &'static str,
    digits: usize,
    /// Whether more is better.
    higher_better: bool,
    get: fn(&Sample) -> f64,
}

const MEASURES: &[Measure] = &[
    Measure {
        name: "start → every Service answering (s)",
        file: "all-answering",
        unit: "seconds",
        digits: 2,
        higher_better: false,
        get: |s| s.all_answering_s,
    },
    Measure {
        name: "start → ready signal (s)",
        file: "ready",
        unit: "seconds",
        digits: 2,
        higher_better: false,
        get: |s| s.ready_s,
    },
    Measure {
        name: "start → serving signal (s) (svc: socket programs attached)",
        file: "serving",
        unit: "seconds",
        digits: 2,
        higher_better: false,
        get: |s| s.serving_s,
    },
    Measure {
        name: "endpoint change followed, p50 (ms)",
        file: "change-p50",
        unit: "milliseconds",
        digits: 0,
        higher_better: false,
        get: |s| s.change_p50_ms,
    },
    Measure {
        name: "endpoint change followed, p99 (ms)",
        file: "change-p99",
        unit: "milliseconds",
        digits: 0,
        higher_better: false,
        get: |s| s.change_p99_ms,
    },
    Measure {
        name: "CPU (s), start to end of the turn",
        file: "cpu",
        unit: "CPU seconds",
        digits: 2,
        higher_better: false,
        get: |s| s.cpu_s,
    },
    Measure {
        name: "peak RSS (MiB)",
        file: "peak-rss",
        unit: "MiB",
        digits: 1,
        higher_better: false,
        get: |s| s.peak_rss_mib,
    },
    Measure {
        name: "new connections/s through a ClusterIP",
        file: "cluster-ip-conn-rate",
        unit: "connections/s",
        digits: 0,
        higher_better: true,
        get: |s| s.cluster_ip_conn_per_s,
    },
    Measure {
        name: "new connections/s to a backend directly (no Service)",
        file: "direct-conn-rate",
        unit: "connections/s",
        digits: 0,
        higher_better: true,
        get: |s| s.direct_conn_per_s,
    },
];

/// The table; `plots`, where the charts are as seen from the markdown file, adds their links.
fn markdown(r: &Results, kinds: &[ProxyKind], plots: Option<&str>) -> String {
    let samples = &r.samples[..];
    let bare = &r.bare_direct_conn_per_s[..];
    let mut out = String::from("## svc beside the real kube-proxy\n\n");
    let _ = writeln!(
        out,
        "Measured with `{}` on {}, {}; load average before: {}. \
         kube-proxy v1.37.2 (built from the pinned modules) with its default configuration \
         (minSyncPeriod 1 s), svc-agent release build. {} round(s), proxies interleaved; each \
         cell is the median over rounds with (min–max); `×svc` is that kube-proxy's figure \
         divided by svc's, round by round, median over rounds. Each turn starts once the API \
         server, etcd and the machine are quiet (`sys::settle`). {} EndpointSlice changes per \
         turn, each timed from the \
         API write to the first client probe (a process spawn, a few ms) that the new endpoint \
         answered. CPU counts kube-proxy's reaped iptables-restore/nft children, RSS does not. \
         How it is measured: `tests/src/bin/svc-vs-kube-proxy-bench.rs`.\n",
        if r.arguments.is_empty() || r.arguments == ["--quick"] {
            format!(
                "cargo xtask bench --vs-kube-proxy{}",
                if r.quick { " --quick" } else { "" }
            )
        } else {
            format!(
                "cargo run --release -p svc-tests --bin svc-vs-kube-proxy-bench -- {}",
                r.arguments.join(" ")
            )
        },
        r.machine,
        r.date,
        r.load_before,
        r.rounds,
        r.changes,
    );
    let unsettled: Vec<String> = (samples.iter().filter(|s| s.unsettled))
        .map(|s| {
            format!(
                "{} at {} Services in round {}",
                s.proxy,
                s.services,
                s.round + 1
            )
        })
        .collect();
    if !unsettled.is_empty() {
        let _ = writeln!(
            out,
            "**Began on a machine that had not gone quiet in 120 s**: {}.\n",
            unsettled.join(", ")
        );
    }
    if !bare.is_empty() {
        let mut b = bare.to_vec();
        b.sort_by(f64::total_cmp);
        let _ = writeln!(
            out,
            "With no proxy at all, new connections/s to a backend directly: {:.0} ({:.0}–{:.0}).\n",
            median(&b),
            b[0],
            b[b.len() - 1]
        );
    }
    let mut losses = Vec::new();
    // Where svc loses but the rounds of either side spread by more than half their median:
    // on a shared machine that says more about the neighbours than about the proxies.
    let mut unsure = Vec::new();
    for &n in &r.services {
        let _ = writeln!(out, "### {n} Services of {ENDPOINTS} endpoints\n");
        out += &report::table_header(
            kinds
                .iter()
                .map(|k| (k.label(), (*k != ProxyKind::Svc).then_some("×svc"))),
        );
        for m in MEASURES {
            out += &format!("| {} |", m.name);
            let svc = spread(samples, n, "svc", m.get);
            for k in kinds {
                let v = spread(samples, n, k.id(), m.get);
                out += &format!(" {} |", fmt3(v, m.digits));
                if *k != ProxyKind::Svc {
                    let r = ratio(samples, n, k.id(), m.get);
                    out += &format!(" {} |", r.map_or("—".into(), |r| format!("{r:.2}")));
                    if let (Some([s, ..]), Some([o, ..])) = (svc, v) {
                        // Behind by the medians or by the round-by-round ratio the table
                        // shows: either one is a loss to report.
                        // As the table prints it: 0.996 shows as 1.00, no loss.
                        let by_ratio = r.map(|r| (r * 100.0).round() / 100.0).is_some_and(|r| {
                            if m.higher_better {
                                r > 1.0
                            } else {
                                r < 1.0
                            }
                        });
                        let by_median = if m.higher_better { s < o } else { s > o };
                        let svc_loses = by_median || by_ratio;
                        if svc_loses && (noisy(svc) || noisy(v)) {
                            unsure.push(format!("{n} Services, {}: {}", m.name, k.label()));
                            continue;
                        }
                        if svc_loses {
                            losses.push(format!(
                                "{n} Services, {}: svc {s:.d$}, {} {o:.d$} (×svc {})",
                                m.name,
                                k.label(),
                                r.map_or("—".into(), |r| format!("{r:.2}")),
                                d = m.digits
                            ));
                        }
                    }
                }
            }
            out += "\n";
        }
        for k in kinds {
            let failed: u32 = samples
                .iter()
                .filter(|s| s.services == n && s.proxy == k.id())
                .map(|s| s.changes_not_followed)
                .sum();
            if failed > 0 {
                let _ = writeln!(
                    out,
                    "\n{}: {failed} change(s) were not followed within 30 s (left out of the \
                     percentiles).",
                    k.label()
                );
            }
        }
        for k in kinds {
            // Runs saved before the budget existed record 0: every change was made.
            let short: Vec<String> = samples
                .iter()
                .filter(|s| s.services == n && s.proxy == k.id())
                .filter(|s| s.changes_made > 0 && s.changes_made < r.changes)
                .map(|s| format!("{} in round {}", s.changes_made, s.round + 1))
                .collect();
            if !short.is_empty() {
                let _ = writeln!(
                    out,
                    "\n{}: the turn's time for changes ran out after {} of {} changes.",
                    k.label(),
                    short.join(", "),
                    r.changes
                );
            }
        }
        out += "\n";
    }
    let every_kube_proxy_measured = r.services.iter().all(|&n| {
        kinds
            .iter()
            .filter(|k| **k != ProxyKind::Svc)
            .all(|k| samples.iter().any(|s| s.services == n && s.proxy == k.id()))
    });
    if losses.is_empty() && unsure.is_empty() && !every_kube_proxy_measured {
        out += "svc is ahead on every measure above where a kube-proxy gave figures.\n";
    } else if losses.is_empty() && unsure.is_empty() {
        out += "svc is ahead of every kube-proxy on every measure above.\n";
    } else if losses.is_empty() {
        out += "svc is not behind any kube-proxy on any measure whose rounds agree.\n";
    } else {
        out += "**Where svc loses** (by the medians or by the round-by-round ×svc):\n\n";
        for l in &losses {
            let _ = writeln!(out, "- {l}");
        }
    }
    if !unsure.is_empty() {
        out += "\nsvc is behind by the median or by ×svc, but the rounds of one side spread by \
                more than half their median, so this run does not say which is faster (the machine was shared; \
                more rounds, `--rounds`, narrow it):\n\n";
        for u in &unsure {
            let _ = writeln!(out, "- {u}");
        }
    }
    if !r.failed_turns.is_empty() {
        out += "\nTurns that gave no figures (left out above):\n\n";
        for f in &r.failed_turns {
            let _ = writeln!(out, "- {f}");
        }
    }
    if !r.skipped.is_empty() {
        out += "\nTurns not run (a proxy that took longer than the run's limit is measured once at that \
                Service count and not at a larger one):\n\n";
        for f in &r.skipped {
            let _ = writeln!(out, "- {f}");
        }
    }
    if let Some(dir) = plots {
        out += "\nEach measure against the Service count (median, bar from min to max):\n\n";
        for m in MEASURES {
            let _ = writeln!(out, "![{}]({dir}/vs-kube-proxy-{}.png)", m.name, m.file);
        }
    }
    out
}

/// A PNG per measure in `dir`: the measure against N, a line per proxy.
#[cfg(feature = "charts")]
fn charts(r: &Results, kinds: &[ProxyKind], dir: &Path) -> Result<()> {
    use svc_tests::plot;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for m in MEASURES {
        let lines: Vec<plot::Line> = kinds
            .iter()
            .map(|k| plot::Line {
                label: k.label(),
                points: r
                    .services
                    .iter()
                    .filter_map(|&n| {
                        let [median, min, max] = spread(&r.samples, n, k.id(), m.get)?;
                        Some(plot::Point {
                            x: n.into(),
                            median,
                            min,
                            max,
                        })
                    })
                    .collect(),
            })
            .filter(|l| !l.points.is_empty())
            .collect();
        if lines.is_empty() {
            continue;
        }
        let title = format!("{}, Services of {ENDPOINTS} endpoints", m.name);
        plot::write_png(
            &dir.join(format!("vs-kube-proxy-{}.png", m.file)),
            &plot::Chart {
                title: &title,
                x_label: "Services",
                y_label: m.unit,
                lines: &lines,
            },
        )?;
    }
    eprintln!("wrote the charts to {}", dir.display());
    Ok(())
}

/// Without the renderer (the tests build this bench without it): `--plots` is refused before
/// anything is measured.
#[cfg(not(feature = "charts"))]
fn charts(_: &Results, _: &[ProxyKind], _: &Path) -> Result<()> {
    bail!("built without charts: build with `--features charts` for --plots")
}

/// `to` as a link from a file in `from_dir`: relative when below it.
fn link(from_dir: &Path, to: &Path) -> String {
    let (from, to) = (
        std::path::absolute(from_dir).unwrap_or_else(|_| from_dir.into()),
        std::path::absolute(to).unwrap_or_else(|_| to.into()),
    );
    to.strip_prefix(&from)
        .map_or_else(|_| to.display().to_string(), |p| p.display().to_string())
}

/// Whether a measure's rounds spread by more than half its median.
fn noisy(v: Option<[f64; 3]>) -> bool {
    v.is_some_and(|[m, lo, hi]| m > 0.0 && (hi - lo) / m > 0.5)
}

fn main() -> ExitCode {
    interrupt::run(bench)
}

fn bench() -> Result<()> {
    let mut args = Args::parse();
    if cfg!(not(feature = "charts")) && args.plots.is_some() {
        bail!("built without charts: build with `--features charts` for --plots");
    }
    let results = match &args.from_json {
        Some(path) => serde_json::from_slice(
            &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("{}: not the JSON of a run", path.display()))?,
        None => measure(&mut args)?,
    };
    let kinds: Vec<ProxyKind> = results
        .proxies
        .iter()
        .map(|p| ProxyKind::parse(p).with_context(|| format!("unknown proxy {p:?}")))
        .collect::<Result<_>>()?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plots {
        charts(&results, &kinds, dir)?;
    }
    let links = match (&args.plots, &args.write) {
        (Some(dir), Some(doc)) => Some(link(doc.parent().unwrap_or(Path::new(".")), dir)),
        _ => None,
    };
    let md = markdown(&results, &kinds, links.as_deref());
    println!("{md}");
    if let Some(path) = &args.write {
        report::write_section(path, "vs-kube-proxy", &md)?;
    }
    Ok(())
}

fn measure(args: &mut Args) -> Result<Results> {
    require_root();
    let load_before = report::load_average();
    if args.quick {
        args.services = vec![1000];
        args.rounds = 3;
        args.changes = 10;
    }
    let kinds: Vec<ProxyKind> = if args.proxies.is_empty() {
        vec![
            ProxyKind::Svc,
            ProxyKind::KubeProxy(Mode::Iptables(IptablesBackend::Nft)),
            ProxyKind::KubeProxy(Mode::Iptables(IptablesBackend::Legacy)),
            ProxyKind::KubeProxy(Mode::Nftables),
        ]
    } else {
        args.proxies
            .iter()
            .map(|p| ProxyKind::parse(p).with_context(|| format!("unknown proxy {p:?}")))
            .collect::<Result<_>>()?
    };
    let tools = Tools::locate();
    let kube_proxy_bin = kube_proxy::binary_from_env()?;
    let mut firewall = HostFirewallGuard::new()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let scratch = TempDir::new("svc-vs-kube-proxy")?;
    let mut samples = Vec::new();
    let mut bare = Vec::new();
    let mut failures = Vec::new();
    let mut skipped = Vec::new();
    // Proxies too slow at a Service count, with what they took: not run at a larger one.
    let mut too_slow: Vec<(ProxyKind, String)> = Vec::new();
    let run_started = Instant::now();
    for &n in &args.services {
        interrupt::check()?;
        if n == 0 || n > 250 * 4000 {
            bail!("--services {n}: between 1 and 1,000,000");
        }
        // Objects written into etcd are JSON; the API server must store (and read) JSON.
        let cp = ControlPlane::start_with_args(
            svc_tests::control_plane::Binaries::from_env()?,
            &["--storage-media-type=application/json"],
        )
        .context("starting the control plane")?;
        cp.create_node(NODE, &format!("10.201.{X}.1"))?;
        let client = rt.block_on(svc_agent::source::kube::client(Some(cp.kubeconfig_path())))?;
        let t = Instant::now();
        // Straight into etcd, at every N alike: through the API, creating 30,000 Services takes
        // 8 minutes here (`bulk::populate_via_etcd` says why). Every proxy still reads them
        // through the API server.
        interrupt::block_on(
            &rt,
            bulk::populate_via_etcd(&cp, client.clone(), NAMESPACE, n, |i| {
                (
                    bulk::service(NAMESPACE, i, PORT, TARGET_PORT),
                    slice(i, false),
                )
            }),
        )?;
        eprintln!(
            "{n} Services and slices created in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let shards = args.sweep_shards.max(1);
        let mut targets = Vec::new();
        for k in 0..shards {
            let path = scratch.path().join(format!("targets-{n}-{k}"));
            let mut list = String::new();
            for i in (0..n).filter(|i| i % shards == k) {
                let _ = writeln!(list, "{}:{PORT}", bulk::cluster_ip(i));
            }
            std::fs::write(&path, list)?;
            targets.push(path);
        }
        let mut moved = vec![false; n as usize];
        let mut next = 0;
        for round in 0..args.rounds {
            bare.push(bare_rate(&tools, args.rate_seconds)?);
            let k = kinds.len();
            for j in 0..k {
                interrupt::check()?;
                let kind = kinds[(j + round as usize) % k];
                let out_of_time = args
                    .stop_after_min
                    .is_some_and(|m| run_started.elapsed() > Duration::from_secs(m * 60));
                if out_of_time {
                    skipped.push(format!(
                        "{}, {n} Services, round {}: not run, the run's time limit \
                         (--stop-after-min) had passed",
                        kind.label(),
                        round + 1
                    ));
                    continue;
                }
                if let Some((_, why)) = too_slow.iter().find(|(s, _)| *s == kind) {
                    skipped.push(format!(
                        "{}, {n} Services, round {}: {why}",
                        kind.label(),
                        round + 1
                    ));
                    continue;
                }
                let mut t = Turn {
                    cp: &cp,
                    client: &client,
                    rt: &rt,
                    tools: &tools,
                    kube_proxy: &kube_proxy_bin,
                    targets: &targets,
                    args: &*args,
                    n,
                    moved: &mut moved,
                    next: &mut next,
                };
                // One proxy that cannot keep up (iptables-nft's first sync at 10,000
                // Services took longer than 13 minutes here) must not void the others' results.
                match turn(&mut t, kind, round) {
                    Ok(s) => {
                        eprintln!("    {s:?}");
                        if s.all_answering_s > args.slow_s as f64 {
                            too_slow.push((
                                kind,
                                format!(
                                    "not run again: at {n} Services every Service answered only \
                                     after {:.0} s",
                                    s.all_answering_s
                                ),
                            ));
                        }
                        samples.push(s);
                    }
                    // A turn failed by a stop is no result: the run ends.
                    Err(e) if interrupt::requested().is_some() => return Err(e),
                    Err(e) => {
                        eprintln!("    failed: {e:#}");
                        let text = format!("{e:#}");
                        // The reason, without the log that follows it.
                        let first = text.split("; log:").next().unwrap_or_default().trim();
                        failures.push(format!(
                            "{}, {n} Services, round {}: {first}",
                            kind.label(),
                            round + 1
                        ));
                        too_slow.push((
                            kind,
                            format!("not run again: its turn at {n} Services gave no figures"),
                        ));
                    }
                }
            }
        }
        drop(cp);
    }
    firewall.check()?;
    Ok(Results {
        machine: report::machine(),
        date: report::today(),
        load_before,
        quick: args.quick,
        services: args.services.clone(),
        rounds: args.rounds,
        changes: args.changes,
        proxies: kinds.iter().map(|k| k.id().to_string()).collect(),
        samples,
        bare_direct_conn_per_s: bare,
        failed_turns: failures,
        skipped,
        arguments: report::shaping_arguments(&["--json", "--plots", "--write", "--from-json"]),
    })
}
