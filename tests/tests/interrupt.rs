//! A bench stopped by a signal tears down what it made, as on an error: the real
//! svc-nodeport-bench (its `none` setup: control plane, topology, backends, probe clients) gets
//! SIGTERM or SIGINT at a known point, must exit soon with 128 + the signal's number, and
//! leave no namespace, cgroup, pin directory, temporary directory or process of its own.
//! Everything it makes is named `PREFIX-PID-N` after its pid, which is how leftovers are found.
//!
//! Needs root and the control plane of `cargo xtask control-plane` (`cargo xtask test` sets
//! both up); fails without them, saying so.

use std::{
    ffi::OsStr,
    io::{BufRead, BufReader},
    os::unix::ffi::OsStrExt,
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use svc_tests::{control_plane::Binaries, require_root, sys};

/// One bench at a time: each takes the machine's 2 cores for its measures.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// From the signal to the exit: the control plane's stop (SIGTERM, then up to 15 s each) is
/// the longest part of the teardown, a few seconds on an idle machine.
const EXIT_WITHIN: Duration = Duration::from_secs(60);

/// How long the bench may take to reach a point: a control plane's start and a topology.
const REACH_WITHIN: Duration = Duration::from_secs(180);

struct Bench {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    /// Set when the bench's stderr has ended: every line it wrote has been read.
    stderr_ended: Arc<AtomicBool>,
}

impl Bench {
    fn start() -> Bench {
        require_root();
        Binaries::from_env().expect("the control plane's binaries");
        let mut child = Command::new(env!("CARGO_BIN_EXE_svc-nodeport-bench"))
            .args(["--setups", "none", "--services", "1", "--rounds", "1000"])
            .args(["--seconds", "2", "--measures", "tcp-local"])
            .env("SVC_PROBE_BIN", env!("CARGO_BIN_EXE_svc-probe"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting svc-nodeport-bench");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = stderr.clone();
        let stderr_ended = Arc::new(AtomicBool::new(false));
        let ended = stderr_ended.clone();
        let pipe = child.stderr.take().expect("piped stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                eprintln!("bench: {line}");
                lines.lock().unwrap().push(line);
            }
            ended.store(true, Ordering::SeqCst);
        });
        Bench {
            child,
            stderr,
            stderr_ended,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn said(&self, text: &str) -> bool {
        self.stderr.lock().unwrap().iter().any(|l| l.contains(text))
    }

    /// Waits until `reached` holds; panics if the bench exits or takes too long first.
    fn wait_for(&mut self, what: &str, reached: impl Fn(&Bench) -> bool) {
        let deadline = Instant::now() + REACH_WITHIN;
        while !reached(self) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the bench exited ({status}) before {what}");
            }
            assert!(Instant::now() < deadline, "the bench did not reach {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` and checks the exit and what is left; `made` is what the bench had made
    /// by then (so that the test cannot pass by looking in the wrong place).
    fn interrupt(mut self, signal: libc::c_int, made: &[&str]) {
        let before = leftovers(self.pid());
        for kind in made {
            assert!(
                before.iter().any(|l| l.starts_with(kind)),
                "no {kind} of the bench's before the signal: {before:?}"
            );
        }
        let children = descendants(self.pid());
        assert!(!children.is_empty(), "the bench has no child processes");
        let sent = Instant::now();
        sys::signal(self.pid(), signal).unwrap();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break Some(s);
            }
            if sent.elapsed() > EXIT_WITHIN {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let took = sent.elapsed();
        // The reader thread has every line once the pipe ends; a process of the bench's that
        // still holds it open is reported below as one still running.
        let read_by = Instant::now() + Duration::from_secs(10);
        while !self.stderr_ended.load(Ordering::SeqCst) && Instant::now() < read_by {
            std::thread::sleep(Duration::from_millis(20));
        }
        let alive: Vec<_> = children.iter().filter(|p| p.alive()).collect();
        let left = leftovers(self.pid());
        // Whatever failed below, nothing of this run stays on the machine.
        for p in &alive {
            let _ = sys::signal(p.pid, libc::SIGKILL);
        }
        remove(&left);
        assert!(left.is_empty(), "left behind: {left:?}");
        assert!(alive.is_empty(), "processes still running: {alive:?}");
        let status = status.unwrap_or_else(|| panic!("still running {EXIT_WITHIN:?} after it"));
        assert_eq!(
            status.code(),
            Some(128 + signal),
            "the bench should exit with 128 + {signal} ({status})"
        );
        assert!(self.said("stopped by"), "no word of the stop on stderr");
        eprintln!("exited {took:?} after the signal; nothing left");
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        // A test that panicked before `interrupt`: the bench's own guards clean up on SIGTERM.
        if let Ok(None) = self.child.try_wait() {
            let _ = sys::signal(self.child.id(), libc::SIGTERM);
            let deadline = Instant::now() + EXIT_WITHIN;
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            // A teardown that hangs must not hang the test run with it.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[derive(Clone, Debug)]
struct Proc {
    pid: u32,
    parent: u32,
    /// Start time: a reused pid is another process.
    start: u64,
    zombie: bool,
}

impl Proc {
    fn of(pid: u32) -> Option<Proc> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The fields after the command name, which is in parentheses and may hold spaces.
        let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        Some(Proc {
            pid,
            parent: f.get(1)?.parse().ok()?,
            start: f.get(19)?.parse().ok()?,
            zombie: *f.first()? == "Z",
        })
    }

    fn alive(&self) -> bool {
        Proc::of(self.pid).is_some_and(|now| now.start == self.start && !now.zombie)
    }
}

/// Every process below `pid`.
fn descendants(pid: u32) -> Vec<Proc> {
    let all: Vec<Proc> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter_map(Proc::of)
        .collect();
    let mut found: Vec<Proc> = Vec::new();
    let mut parents = vec![pid];
    while let Some(parent) = parents.pop() {
        for p in all.iter().filter(|p| p.parent == parent) {
            parents.push(p.pid);
            found.push(p.clone());
        }
    }
    found
}

/// Whether a process below `pid` has a command line (its arguments, the program first) that
/// `matches`.
fn runs(pid: u32, matches: impl Fn(&[&[u8]]) -> bool) -> bool {
    descendants(pid).iter().any(|p| {
        std::fs::read(format!("/proc/{}/cmdline", p.pid))
            .is_ok_and(|c| matches(&c.split(|&b| b == 0).collect::<Vec<_>>()))
    })
}

/// What carries the bench's pid in its name (`PREFIX-PID-N`), as `KIND PATH`: namespaces,
/// cgroups, pin directories, temporary directories.
fn leftovers(pid: u32) -> Vec<String> {
    let mine = |name: &str| name.contains(&format!("-{pid}-"));
    let mut out = Vec::new();
    let netns = sys::run("ip", ["netns", "list"]).unwrap();
    for name in netns.lines().filter_map(|l| l.split_whitespace().next()) {
        if mine(name) {
            out.push(format!("netns {name}"));
        }
    }
    for (kind, dir) in [
        ("cgroup", sys::cgroup2_mount().unwrap()),
        ("pins", sys::BPFFS_ROOT.into()),
        ("dir", std::env::temp_dir()),
    ] {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if mine(&e.file_name().to_string_lossy()) {
                out.push(format!("{kind} {}", e.path().display()));
            }
        }
    }
    out
}

/// Removes what `leftovers` found (all of it this test's bench's).
fn remove(left: &[String]) {
    for l in left {
        let (kind, what) = l.split_once(' ').unwrap();
        let result = match kind {
            "netns" => sys::run("ip", ["netns", "del", what]).map(drop),
            "cgroup" => std::fs::remove_dir(what).map_err(Into::into),
            _ => std::fs::remove_dir_all(Path::new(what)).map_err(Into::into),
        };
        if let Err(e) = result {
            eprintln!("removing {l}: {e:#}");
        }
    }
}

#[test]
fn sigterm_during_a_measure_tears_everything_down() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut bench = Bench::start();
    // Inside the measure: a probe client (`svc-probe loop`) is running.
    bench.wait_for("a probe client's loop", |b| {
        b.said("round 1") && runs(b.pid(), |args| args.iter().any(|a| *a == b"loop"))
    });
    bench.interrupt(libc::SIGTERM, &["netns", "cgroup"]);
}

#[test]
fn sigint_while_setting_up_tears_everything_down() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut bench = Bench::start();
    // The topology's namespaces are being made.
    bench.wait_for("its first namespace", |b| {
        b.said("setting up") && leftovers(b.pid()).iter().any(|l| l.starts_with("netns"))
    });
    bench.interrupt(libc::SIGINT, &["netns", "dir"]);
}

#[test]
fn sigterm_while_the_control_plane_starts_tears_everything_down() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut bench = Bench::start();
    bench.wait_for("etcd's start", |b| {
        runs(b.pid(), |args| {
            args.first()
                .is_some_and(|a| Path::new(OsStr::from_bytes(a)).ends_with("etcd"))
        })
    });
    bench.interrupt(libc::SIGTERM, &["dir"]);
}
