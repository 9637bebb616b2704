//! Issue 36: `svc-agent monitor -o json` shows each connection to a Service as it is decided
//! (the backend it got, or the refusal and why) under the Service's name; with nobody
//! listening the programs write nothing, also after a monitor was killed without a word.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{sa, web_service, web_slice, World, VIP};
use serde_json::Value;
use svc_agent::monitor::{monotonic_ns, Maps, LEASE};
use svc_tests::{Service, ServicePort};

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

/// Waits until the monitor holds its lease (it reads the ring only after taking it).
fn wait_listening(bpffs: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if Maps::open(bpffs)
            .and_then(|m| m.ctl())
            .is_ok_and(|c| c.until_ns > monotonic_ns())
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the monitor never took its lease");
}

fn seen(bpffs: &Path) -> u64 {
    Maps::open(bpffs).unwrap().stats().unwrap().seen
}

#[test]
fn monitor_shows_decisions_and_nothing_is_written_without_it() {
    let w = World::start(2, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
        m.apply_service(
            &Service::new("demo", "empty", "10.96.0.20")
                .port(ServicePort::tcp(80).name("http").target(8080)),
        )
        .unwrap();
    });
    let (bin, bpffs) = (&w.sb.tools.agent, w.bpffs.path());
    let empty = sa([10, 96, 0, 20], 80);
    let backend = |i: u8| sa(w.sb.backend_v4(i), 8080).to_string();

    // Nobody listening: connections are decided without a word written.
    let before = seen(bpffs);
    let r = w.sb.tcp(sa(VIP, 80), 5, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    assert_eq!(seen(bpffs), before, "events counted with nobody listening");
    assert_eq!(Maps::open(bpffs).unwrap().ctl().unwrap().until_ns, 0);

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

    // A filtered monitor shows only its Service: the lease is one monitor's, so this one
    // waits for the first to leave; SIGTERM gives the lease back at once.
    mon.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Maps::open(bpffs).unwrap().ctl().unwrap().until_ns != 0 {
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
    assert_eq!(Maps::open(bpffs).unwrap().ctl().unwrap().until_ns, 0);
    let before = seen(bpffs);
    w.sb.tcp(sa(VIP, 80), 3, &[]).unwrap();
    assert_eq!(
        seen(bpffs),
        before,
        "events counted after the lease ran out"
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
