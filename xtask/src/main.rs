//! Project tasks: `cargo xtask <task>`. Each task installs what it needs first, idempotently.

mod control_plane;
mod image;
mod kernel_smoke;
mod toolchain;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the eBPF toolchain where missing, then build the kernel programs with BTF.
    BuildEbpf,
    /// Build the kernel programs, the agent and the test binaries.
    Build {
        #[arg(long)]
        release: bool,
    },
    /// The demo: a sandbox of network namespaces, real backends, real traffic through a ClusterIP.
    Demo,
    /// Every test: unit tests and the privileged integration tests (needs root).
    Test {
        /// Only the unit and model tests: no root, no control plane, no eBPF program loaded
        /// (under 2 minutes on 2 cores).
        #[arg(long)]
        quick: bool,
        /// Extra arguments for the test binaries, after `--` (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Only the differential parity suite against the real kube-proxy (needs root; `cargo xtask
    /// test` runs it too): prints the scenario x proxy table.
    Parity {
        /// Also write the table to docs/parity.md.
        #[arg(long)]
        write: bool,
        /// Extra arguments for the suite, after `--` (e.g. a scenario name).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build (or find cached) kube-apiserver, kubectl, etcd and kube-proxy for the tests; prints
    /// their paths.
    ControlPlane,
    /// The node image, with buildah and no registry or base image: the agent and the shared
    /// libraries it loads, as an OCI archive (target/image/svc-agent.oci.tar) for `podman
    /// load`, `docker load` or `ctr -n k8s.io images import`.
    Image {
        /// The agent to put in (default: a release build, built first).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// The image's name.
        #[arg(long, default_value = "localhost/svc-agent:dev")]
        tag: String,
        /// Where the archive, the root file system and buildah's storage go.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// rustfmt and clippy (warnings denied) for the userspace crates and the kernel crate.
    Lint,
    /// svc on Debian 12's own kernel (6.1, no tcx) and on Ubuntu 22.04's (5.15: no tcx, no
    /// bpf_set_retval), each in a qemu VM (needs root for apt-get): the agent's start check, a
    /// ClusterIP from its cgroup, a Service without endpoints refused, and NodePorts from
    /// another namespace to a local and a remote (SNATed) backend through classic tc filters.
    /// The kernel packages are downloaded once, into target/kernel-smoke.
    KernelSmoke {
        /// Only this kernel (repeatable); all of them by default.
        #[arg(long = "kernel", value_enum)]
        kernels: Vec<kernel_smoke::Guest>,
        /// Give up (and kill the VM) after this many seconds.
        #[arg(long, default_value_t = 900)]
        timeout_s: u64,
        /// qemu with KVM. Without it qemu emulates the CPU (TCG): on this project's machines
        /// /dev/kvm exists, but a VM under it hangs while the kernel unpacks (nested
        /// virtualisation), and `-cpu host` aborts on an MSR.
        #[arg(long)]
        kvm: bool,
    },
    /// Benchmarks (both unless one is named): the socket datapath, direct vs ClusterIP with 1
    /// and 100,000 services; the agent against a real API server with 10,000 Services.
    Bench {
        /// Rewrite each benchmark's section of docs/benchmarks.md.
        #[arg(long)]
        write: bool,
        /// Only the socket datapath benchmark (svc-bench).
        #[arg(long)]
        socket: bool,
        /// Only the control-plane benchmark (svc-kube-bench).
        #[arg(long)]
        kube: bool,
        /// Only the scale benchmarks: 100,000 Services of 3 endpoints from manifests
        /// (svc-scale-bench) and from the API server (svc-kube-bench): time and memory.
        #[arg(long)]
        scale: bool,
        /// Only svc beside the real kube-proxy (iptables mode on iptables-nft and on
        /// iptables-legacy, nftables mode) with 1,000, 10,000 and 30,000 Services
        /// (svc-vs-kube-proxy-bench); JSON and PNG charts in target/bench/, or with --write
        /// in docs/bench/ next to the table.
        #[arg(long)]
        vs_kube_proxy: bool,
        /// Only the packet datapath through a NodePort: connections and packets per second
        /// with svc's tc programs, kube-proxy's rules (iptables-nft, iptables-legacy,
        /// nftables) and no translation, at 1 and 10,000 Services (svc-nodeport-bench), and
        /// the per-packet cost of each tc path (BPF_PROG_TEST_RUN); JSON in
        /// target/bench/nodeport.json.
        #[arg(long)]
        nodeport: bool,
        /// With --vs-kube-proxy: 1,000 Services only, 3 rounds, 10 changes. With --nodeport: 1
        /// and 1,000 Services, 3 rounds of 1 s measures.
        #[arg(long)]
        quick: bool,
    },
}

pub fn root() -> PathBuf {
    // `cargo xtask` (`cargo run -p xtask`) sets it for this checkout; the compiled-in one names
    // the checkout the binary was built in, which a target directory copied from another
    // checkout still holds. Only xtask's own: another package's run (a test that starts
    // xtask) passes its own directory down.
    let own = std::env::var_os("CARGO_PKG_NAME").is_some_and(|n| n == "xtask");
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .filter(|_| own)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let child = forward::spawn(cmd).with_context(|| format!("running {:?}", cmd.get_program()))?;
    let status = forward::wait(child).with_context(|| format!("waiting for {cmd:?}"))?;
    forward::stop_if_signalled()?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// SIGTERM and SIGHUP sent to xtask reach the command it is running, so a bench stops through
/// its own teardown instead of running on, orphaned, after xtask has died. SIGINT is not
/// passed on: Ctrl-C reaches the terminal's whole foreground group, the command included,
/// and a second copy would only read as an impatient second Ctrl-C.
mod forward {
    use std::{
        io,
        process::{Child, Command, ExitStatus},
        sync::{
            atomic::{AtomicI32, Ordering},
            Mutex, MutexGuard, Once,
        },
    };

    use signal_hook::{
        consts::{SIGHUP, SIGINT, SIGTERM},
        iterator::Signals,
    };

    /// The children being run (a test phase may run some side by side): each signalled only
    /// while it has not been reaped, so its pid cannot have gone to another process.
    static CHILDREN: Mutex<Vec<i32>> = Mutex::new(Vec::new());

    /// The first signal xtask got (0: none): after the command it reached, xtask stops too,
    /// with status 128 + its number, as the command does.
    static RECEIVED: AtomicI32 = AtomicI32::new(0);

    pub fn received() -> Option<i32> {
        Some(RECEIVED.load(Ordering::SeqCst)).filter(|s| *s != 0)
    }

    /// An error once a signal came: no further command is started.
    pub fn stop_if_signalled() -> anyhow::Result<()> {
        match received() {
            Some(signal) => anyhow::bail!("stopped by signal {signal}"),
            None => Ok(()),
        }
    }

    fn children() -> MutexGuard<'static, Vec<i32>> {
        CHILDREN.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn install() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let Ok(mut signals) = Signals::new([SIGTERM, SIGINT, SIGHUP]) else {
                eprintln!("xtask: signals are not forwarded to its commands");
                return;
            };
            std::thread::spawn(move || {
                for signal in signals.forever() {
                    let _ =
                        RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
                    let running = children();
                    if running.is_empty() {
                        // Between commands: what the signal would have done.
                        std::process::exit(128 + signal);
                    }
                    if signal != SIGINT {
                        for &pid in running.iter() {
                            // SAFETY: a plain syscall on our own unreaped child.
                            unsafe {
                                libc::kill(pid, signal);
                            }
                        }
                    }
                }
            });
        });
    }

    /// Starts `cmd`; the signals xtask gets go to it from the moment it exists (the handler
    /// waits for the registration) until `wait` has reaped it.
    pub fn spawn(cmd: &mut Command) -> io::Result<Child> {
        install();
        let mut running = children();
        let c = cmd.spawn()?;
        running.push(c.id() as i32);
        Ok(c)
    }

    /// Waits for `c`, which `spawn` started.
    pub fn wait(mut c: Child) -> io::Result<ExitStatus> {
        let pid = c.id();
        // Waits for the exit without reaping (WNOWAIT): until `c.wait()` below, the pid is a
        // zombie of ours, so a signal forwarded in between reaches no other process.
        let waited = loop {
            // SAFETY: `info` is a plain struct the call fills; all-zero bytes are a valid one.
            let r = unsafe {
                let mut info: libc::siginfo_t = std::mem::zeroed();
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT,
                )
            };
            if r == 0 {
                break Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                break Err(e);
            }
        };
        children().retain(|p| *p != pid as i32);
        waited?;
        c.wait()
    }
}

/// Tests passed and failed over the phases of a run.
#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    /// Each phase's counts, in order, for the summary.
    phases: Vec<(String, u64, u64)>,
    /// The phases that failed, by what they ran.
    failures: Vec<String>,
}

impl Totals {
    fn add(&mut self, what: &str, (passed, failed): (u64, u64), outcome: Result<()>) {
        self.passed += passed;
        self.failed += failed;
        self.phases.push((what.to_string(), passed, failed));
        if let Err(e) = outcome {
            self.failures.push(format!("{what}: {e:#}"));
        }
    }

    /// Each phase's counts (so a failure names its pass), one total over every phase and test
    /// binary, then the run's outcome.
    fn finish(self) -> Result<()> {
        let panics = std::mem::take(&mut *PANICS.lock().unwrap_or_else(|e| e.into_inner()));
        if !panics.is_empty() && (self.failed > 0 || !self.failures.is_empty()) {
            // Here, next to the counts: a log cut short in the middle still shows why.
            println!("why tests failed (the first lines of each panic):");
            for p in &panics {
                println!("  {p}");
            }
        }
        if self.phases.len() > 1 {
            // Not shaped as a closing line (`N passed, N failed` alone): the total below is.
            for (what, passed, failed) in &self.phases {
                println!("  ({passed} passed, {failed} failed) {what}");
            }
        }
        println!("tests: {} passed, {} failed", self.passed, self.failed);
        forward::stop_if_signalled()?;
        if !self.failures.is_empty() {
            bail!("{}", self.failures.join("\n"));
        }
        Ok(())
    }
}

/// Runs `cargo test`, passing its output through: passed and failed over its test binaries
/// (cargo's own last line is the (empty) doc-test run of the last crate), and its outcome.
fn run_tests(cmd: &mut Command) -> ((u64, u64), Result<()>) {
    run_counting(cmd, Stream::Stdout, result_counts)
}

/// Runs `cargo nextest run`, passing its output through: passed and failed from its summary,
/// and its outcome.
fn run_nextest(cmd: &mut Command) -> ((u64, u64), Result<()>) {
    run_counting(cmd, Stream::Stderr, nextest_counts)
}

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// Runs `cmd`, printing what it writes and adding up `counts` over the lines of `stream`.
fn run_counting(
    cmd: &mut Command,
    stream: Stream,
    counts: fn(&str) -> Option<(u64, u64)>,
) -> ((u64, u64), Result<()>) {
    run_counting_into(cmd, stream, counts, &mut |line| match stream {
        Stream::Stdout => println!("{line}"),
        Stream::Stderr => eprintln!("{line}"),
    })
}

/// Starts `cargo test` of a whole binary in a thread of its own, its output (both streams)
/// kept until `Alongside::finish`, so that it runs beside another phase without mixing its
/// lines into that phase's.
struct Alongside {
    what: String,
    run: std::thread::JoinHandle<Ran>,
}

/// What a command run in a thread gave: passed and failed, its outcome, its output.
type Ran = ((u64, u64), Result<()>, Vec<String>);

impl Alongside {
    fn start(what: String, mut cmd: Command) -> Alongside {
        let run = std::thread::spawn(move || {
            let mut lines = Vec::new();
            // Cargo's own lines (building, `Running`) go to stderr: into a file, read back
            // at the end, so neither pipe can fill while the other is read.
            let err = tempfile_for_stderr();
            if let Ok((_, f)) = &err {
                if let Ok(f) = f.try_clone() {
                    cmd.stderr(f);
                }
            }
            let (counts, outcome) =
                run_counting_into(&mut cmd, Stream::Stdout, result_counts, &mut |line| {
                    lines.push(line.to_string())
                });
            if let Ok((path, _)) = err {
                if let Ok(text) = std::fs::read_to_string(&path) {
                    lines.extend(text.lines().map(str::to_string));
                }
                let _ = std::fs::remove_file(&path);
            }
            (counts, outcome, lines)
        });
        Alongside { what, run }
    }

    /// Waits for it, prints its output, and adds its counts.
    fn finish(self, totals: &mut Totals) {
        match self.run.join() {
            Ok((counts, outcome, lines)) => {
                eprintln!("--- {} (ran alongside the nextest phase) ---", self.what);
                for line in lines {
                    println!("{line}");
                }
                totals.add(&self.what, counts, outcome);
            }
            Err(_) => totals.add(
                &self.what,
                (0, 0),
                Err(anyhow::anyhow!("its thread panicked")),
            ),
        }
    }
}

/// A file in target/tmp for a command's stderr, and a handle to write it.
fn tempfile_for_stderr() -> std::io::Result<(PathBuf, std::fs::File)> {
    let dir = root().join("target/tmp");
    std::fs::create_dir_all(&dir)?;
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("xtask-{}-{n}.stderr", std::process::id()));
    let f = std::fs::File::create(&path)?;
    Ok((path, f))
}

/// `run_counting` with each line of `stream` given to `sink`.
fn run_counting_into(
    cmd: &mut Command,
    stream: Stream,
    counts: fn(&str) -> Option<(u64, u64)>,
    sink: &mut dyn FnMut(&str),
) -> ((u64, u64), Result<()>) {
    use std::io::{BufRead, BufReader, Read};
    let mut total = (0u64, 0u64);
    let mut go = || -> Result<()> {
        // After a signal no further phase starts; each reports it and the run ends with it.
        forward::stop_if_signalled()?;
        sink(&format!("+ {cmd:?}"));
        match stream {
            Stream::Stdout => cmd.stdout(std::process::Stdio::piped()),
            Stream::Stderr => cmd.stderr(std::process::Stdio::piped()),
        };
        let mut child = forward::spawn(cmd).with_context(|| format!("running {cmd:?}"))?;
        let out: Box<dyn Read> = match stream {
            Stream::Stdout => Box::new(child.stdout.take().context("stdout")?),
            Stream::Stderr => Box::new(child.stderr.take().context("stderr")?),
        };
        let mut panics = Panics::default();
        for line in BufReader::new(out).lines() {
            let line = line.context("reading the test output")?;
            sink(&line);
            panics.see(&line);
            if let Some((p, f)) = counts(&line) {
                total.0 += p;
                total.1 += f;
            }
        }
        PANICS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(panics.lines);
        let status = forward::wait(child).with_context(|| format!("waiting for {cmd:?}"))?;
        if !status.success() {
            bail!("failed: {status}");
        }
        Ok(())
    };
    let outcome = go();
    (total, outcome)
}

/// The first lines of the tests' panics, over every phase, for the summary.
static PANICS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The first lines of each panic in a command's output (`panicked at` and the message's
/// first lines), at most `Panics::KEPT` of them.
#[derive(Default)]
struct Panics {
    lines: Vec<String>,
    /// How many lines after the last `panicked at` are still to keep.
    following: usize,
    count: usize,
}

impl Panics {
    const LINES: usize = 6;
    const KEPT: usize = 20;

    fn see(&mut self, line: &str) {
        let short = || line.chars().take(300).collect::<String>();
        if line.contains("panicked at") {
            self.following = 0;
            if self.count < Self::KEPT {
                self.count += 1;
                self.lines.push(short());
                self.following = Self::LINES - 1;
            }
        } else if line.trim_start().starts_with("stack backtrace:") {
            // The frames say where, which the first line said already.
            self.following = 0;
        } else if self.following > 0 {
            self.following -= 1;
            self.lines.push(format!("  {}", short()));
        }
    }
}

/// Passed and failed from nextest's closing line, `Summary [ 12.3s] 40 tests run: 39 passed,
/// 1 failed, 2 skipped` (a test that timed out or failed to start counts as failed).
fn nextest_counts(line: &str) -> Option<(u64, u64)> {
    let (_, rest) = line
        .trim_start()
        .strip_prefix("Summary ")?
        .split_once(" run: ")?;
    let count = |words: &[&str]| -> u64 {
        rest.split(',')
            .filter_map(|part| {
                let (n, word) = part.trim().split_once(' ')?;
                words
                    .iter()
                    .any(|w| word.starts_with(w))
                    .then(|| n.parse::<u64>().ok())?
            })
            .sum()
    };
    Some((
        count(&["passed"]),
        count(&["failed", "timed out", "exec fail"]),
    ))
}

/// Passed and failed from a test binary's closing line, `test result: ok. 3 passed; 0 failed;
/// ...`, as libtest and libtest-mimic (the kube test's harness) print it.
fn result_counts(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("test result: ")?;
    let count = |word: &str| {
        rest.split(';')
            .find_map(|part| part.trim().strip_suffix(word))
            .and_then(|n| n.trim().rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some((count(" passed"), count(" failed")))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    // `cargo xtask` is `cargo run`, which gives xtask the variables of its own package
    // (CARGO_PKG_NAME=xtask, CARGO_MANIFEST_DIR, ...). Passed on, they would differ from a
    // shell's, and build scripts that watch them (ring's, through cc) would run again, and
    // everything above them (rustls, kube, the agent) be compiled again, at every switch
    // between `cargo xtask` and a plain `cargo`.
    for (var, _) in std::env::vars_os() {
        let Some(var) = var.to_str() else { continue };
        if var.starts_with("CARGO_PKG_")
            || var.starts_with("CARGO_MANIFEST_")
            || matches!(
                var,
                "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
            )
        {
            c.env_remove(var);
        }
    }
    c
}

/// The userspace packages `lint` and `test` build, one selection for both: features are
/// resolved over the packages selected, so another selection could build the dependencies
/// again with other features. The kernel crate has its own target; svc-charts (the benches'
/// renderer and font) is built and tested on its own, as its dependencies would change the
/// features of some shared by the agent (bytemuck). The agent these builds make is the one the
/// tests run, with its fail points (`failpoints`: the tests' pauses); a release build has none.
const USERSPACE: &[&str] = &[
    "--workspace",
    "--exclude",
    "svc-ebpf",
    "--exclude",
    "svc-charts",
    "--features",
    "svc-agent/failpoints",
];

/// The test binaries whose tests share something per process: the kernel's packet fixtures a
/// loaded object, the kube scenarios a control plane, the parity scenarios the proxies of one run.
/// They run as whole binaries (`cargo test`), the rest through nextest, one process per test.
/// Those marked `Alongside` run beside the nextest phase (the fixtures take seconds, the kube
/// scenarios one thread); parity compares timing-sensitive behaviour of real proxies and runs
/// after it, with nothing else.
const WHOLE_BINARIES: &[(&str, &str, When)] = &[
    ("svc-ebpf-tests", "fixtures", When::Alongside),
    ("svc-tests", "kube", When::Alongside),
    ("svc-tests", "parity", When::Alone),
];

/// The second pass: these test binaries run again (through nextest, after the first pass)
/// with `SECOND_PASS_ENV` set, which makes every agent the harness starts behave as on an
/// older kernel (`svc_tests::agent::forced_args` turns each variable into agent flags). A
/// fallback forced the same way adds its variable here and a row there.
const SECOND_PASS: &str = "second pass, as on kernels before 6.6";
const SECOND_PASS_BINARIES: &[&str] = &["svc-tests::packet"];
const SECOND_PASS_ENV: &[(&str, &str)] = &[("SVC_TEST_TC_ATTACH", "classic")];

/// What the second pass is called in the summary: its name and its variables.
fn second_pass_name() -> String {
    let env: Vec<String> = SECOND_PASS_ENV
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    format!(
        "{} ({}, {})",
        SECOND_PASS,
        SECOND_PASS_BINARIES.join(" "),
        env.join(" ")
    )
}

#[derive(Clone, Copy, PartialEq)]
enum When {
    Alongside,
    Alone,
}

/// `cargo` for the dev profile: the workspace's own crates are compiled by clippy-driver (as
/// `cargo clippy` runs it), so `cargo xtask lint` lints while it builds, and `cargo xtask test`,
/// `demo` and `parity` find everything built: the workspace is compiled once for both. A plain
/// `cargo build` or `cargo test` (no wrapper) compiles the workspace's own crates again, not
/// their dependencies.
fn dev_cargo() -> Result<Command> {
    let mut c = cargo();
    c.env("RUSTC_WORKSPACE_WRAPPER", clippy_driver()?)
        // Lints at their default levels: the lint fails on any warning (`lint_build`), a
        // test run shows them and goes on. The same value for both, or each would rebuild.
        .env("CLIPPY_ARGS", "");
    Ok(c)
}

/// clippy-driver of the toolchain cargo compiles with (the driver must be that very compiler).
fn clippy_driver() -> Result<PathBuf> {
    let out = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args(["--print", "sysroot"])
        .output()
        .context("running rustc --print sysroot")?;
    if !out.status.success() {
        bail!(
            "rustc --print sysroot failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let driver =
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("bin/clippy-driver");
    if !driver.exists() {
        bail!(
            "{} is missing: `rustup component add clippy`",
            driver.display()
        );
    }
    Ok(driver)
}

/// Runs a dev-profile build of `cmd` (a `dev_cargo` command) and fails if the workspace's own
/// crates have any warning, rustc's or clippy's, including those cargo replays from an earlier
/// build of the same crates.
fn lint_build(cmd: &mut Command) -> Result<()> {
    use std::io::{BufRead, BufReader};
    cmd.arg("--message-format=json")
        .stdout(std::process::Stdio::piped());
    eprintln!("+ {cmd:?}");
    let mut child = forward::spawn(cmd).context("running cargo build")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut warnings = 0u64;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo's messages")?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            println!("{line}");
            continue;
        };
        if msg["reason"] != "compiler-message" {
            continue;
        }
        let m = &msg["message"];
        // rustc's closing "N warnings emitted" has no place in the code: not counted.
        let in_code = m["spans"].as_array().is_some_and(|s| !s.is_empty());
        if m["level"] == "warning" && in_code {
            warnings += 1;
        }
        if let Some(rendered) = m["rendered"].as_str() {
            eprint!("{rendered}");
        }
    }
    let status = forward::wait(child).context("waiting for cargo build")?;
    forward::stop_if_signalled()?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    if warnings > 0 {
        bail!("{warnings} warnings: the lint denies them");
    }
    Ok(())
}

/// The kernel crate through Debian's compiler, which ships the core source build-std needs.
fn ebpf_cargo(subcommand: &str) -> Command {
    let mut c = Command::new("cargo");
    c.current_dir(root())
        .arg(format!("+{}", toolchain::LINKED_TOOLCHAIN))
        .args([
            subcommand,
            "-p",
            "svc-ebpf",
            "--release",
            "-Z",
            "build-std=core",
            "--target",
            "bpfel-unknown-none",
            "--config",
            r#"target.bpfel-unknown-none.rustflags=["-C","debuginfo=2","-C","link-arg=--btf"]"#,
        ])
        .env("RUSTC_BOOTSTRAP", "1")
        // The userspace toolchain's variables must not leak into Debian's cargo.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    c
}

pub fn build_ebpf() -> Result<PathBuf> {
    toolchain::ensure()?;
    run(&mut ebpf_cargo("build"))?;
    let object = root().join("target/bpfel-unknown-none/release/svc");
    if !object.exists() {
        bail!("the build succeeded but {} is missing", object.display());
    }
    eprintln!("eBPF object: {}", object.display());
    Ok(object)
}

fn build(release: bool) -> Result<()> {
    build_ebpf()?;
    let mut c = if release {
        // The benches' builds: as users build, not through clippy-driver.
        let mut c = cargo();
        c.args(["build", "--release", "-p", "svc-agent", "-p", "svc-tests"]);
        c
    } else {
        // The lint's and the tests' selection, whose features are the same (svc-common's
        // `default`, for one, is on only where the package itself is selected).
        let mut c = dev_cargo()?;
        c.arg("build").args(USERSPACE);
        c
    };
    run(c.arg("--bins"))
}

/// This xtask's binary. The lint builds xtask again while an older one runs (`cargo xtask`
/// runs the binary it had): Linux then names the running one `PATH (deleted)`, and PATH holds
/// the new build of the same sources.
fn xtask_exe() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let text = exe.to_string_lossy();
    Ok(match text.strip_suffix(" (deleted)") {
        Some(path) => PathBuf::from(path),
        None => exe,
    })
}

/// Removes what killed harness processes left (namespaces, cgroups, pins, directories whose
/// owning process is gone: `svc_tests::sys::clean_stale`), through the binary `build` made. A
/// test process killed outright (SIGKILL, nextest's timeout or its forwarded SIGTERM) runs
/// none of its drop guards, and nothing else would ever remove its pins.
fn clean_stale() -> Result<()> {
    run(Command::new(root().join("target/debug/svc-demo"))
        .arg("--clean-stale")
        .current_dir(root())
        .env("SVC_AGENT_BIN", root().join("target/debug/svc-agent")))
}

fn require_root(task: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("`cargo xtask {task}` attaches eBPF programs and creates network namespaces: run it as root");
    }
    Ok(())
}

/// Errors end the run with their chain of causes, without a backtrace: a CI log shows only its
/// last lines, and those should be the tests' own report.
fn main() -> std::process::ExitCode {
    match run_task(Cli::parse().task) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            match forward::received() {
                Some(signal) => std::process::ExitCode::from((128 + signal) as u8),
                None => std::process::ExitCode::FAILURE,
            }
        }
    }
}

fn run_task(task: Task) -> Result<()> {
    match task {
        Task::BuildEbpf => {
            build_ebpf()?;
        }
        Task::Build { release } => build(release)?,
        Task::Demo => {
            require_root("demo")?;
            build(false)?;
            // The binary `build` made: `cargo run -p svc-tests` would resolve other features
            // and build again.
            run(Command::new(root().join("target/debug/svc-demo"))
                .current_dir(root())
                .env("SVC_AGENT_BIN", root().join("target/debug/svc-agent")))?;
        }
        Task::Test { quick: true, args } => {
            // The kernel object is embedded in the agent (its build script copies it), so it
            // is built, never loaded.
            build_ebpf()?;
            toolchain::ensure_nextest()?;
            let mut totals = Totals::default();
            let (counts, outcome) = run_nextest(
                dev_cargo()?
                    .args(["nextest", "run", "--profile", "quick"])
                    .args(USERSPACE)
                    // The binaries' own tests are xtask's: the others have none, and linking
                    // them for a test harness would cost more than the unit tests themselves.
                    .args(["--lib", "--bin", "xtask", "--"])
                    .args(&args),
            );
            totals.add("unit tests", counts, outcome);
            totals.finish()?;
        }
        Task::Test { quick: false, args } => {
            require_root("test")?;
            build(false)?;
            clean_stale()?;
            let control_plane = control_plane::ensure()?;
            toolchain::ensure_nextest()?;
            let agent = root().join("target/debug/svc-agent");
            let mut totals = Totals::default();
            // Every test binary but the whole ones, a process per test, in parallel; the test
            // groups of .config/nextest.toml keep the heavy ones apart.
            let whole = WHOLE_BINARIES
                .iter()
                .map(|(package, test, _)| format!("binary_id({package}::{test})"))
                .collect::<Vec<_>>()
                .join(" | ");
            let whole_binary = |test: &str| -> Result<Command> {
                let mut c = dev_cargo()?;
                c.args(["test"])
                    .args(USERSPACE)
                    .args(["--test", test, "--"])
                    .args(&args)
                    .envs(control_plane.env())
                    .env("SVC_AGENT_BIN", &agent);
                Ok(c)
            };
            let mut alongside = Vec::new();
            for (package, test, when) in WHOLE_BINARIES {
                if *when == When::Alongside {
                    alongside.push(Alongside::start(
                        format!("{package} --test {test}"),
                        whole_binary(test)?,
                    ));
                }
            }
            let (counts, outcome) = run_nextest(
                dev_cargo()?
                    .args(["nextest", "run"])
                    .args(USERSPACE)
                    .args(["-E", &format!("not ({whole})"), "--"])
                    .args(&args)
                    .envs(control_plane.env())
                    .env("SVC_AGENT_BIN", &agent)
                    // tests/tests/image.rs builds the image as `cargo xtask image` does.
                    .env("SVC_XTASK", xtask_exe()?),
            );
            totals.add("nextest (first pass)", counts, outcome);
            for a in alongside {
                a.finish(&mut totals);
            }
            // The packet tests again, their agents attaching as on an older kernel.
            let again = SECOND_PASS_BINARIES
                .iter()
                .map(|b| format!("binary_id({b})"))
                .collect::<Vec<_>>()
                .join(" | ");
            eprintln!("--- {} ---", second_pass_name());
            let (counts, outcome) = run_nextest(
                dev_cargo()?
                    .args(["nextest", "run"])
                    .args(USERSPACE)
                    .args(["-E", &again, "--"])
                    .args(&args)
                    .envs(control_plane.env())
                    .envs(SECOND_PASS_ENV.iter().copied())
                    .env("SVC_AGENT_BIN", &agent),
            );
            totals.add(&second_pass_name(), counts, outcome);
            // Then each remaining whole binary alone, as `cargo test` runs it.
            for (package, test, when) in WHOLE_BINARIES {
                if *when == When::Alone {
                    let (counts, outcome) = run_tests(&mut whole_binary(test)?);
                    totals.add(&format!("{package} --test {test}"), counts, outcome);
                }
            }
            // The charts' own tests: svc-charts selected alone (see USERSPACE).
            let (counts, outcome) = run_tests(
                dev_cargo()?
                    .args(["test", "-p", "svc-charts", "--"])
                    .args(&args),
            );
            totals.add("svc-charts", counts, outcome);
            // A test that nextest ended (its timeout, a signal) ran no guard: what it made
            // is gone once the run is. The totals are printed either way.
            let swept = clean_stale();
            totals.finish()?;
            swept?;
        }
        Task::Parity { write, args } => {
            require_root("parity")?;
            build(false)?;
            clean_stale()?;
            let control_plane = control_plane::ensure()?;
            let mut c = dev_cargo()?;
            c.args(["test"])
                .args(USERSPACE)
                .args(["--test", "parity", "--"])
                .args(&args)
                .envs(control_plane.env())
                .env("SVC_AGENT_BIN", root().join("target/debug/svc-agent"));
            if write {
                c.env("SVC_PARITY_TABLE", root().join("docs/parity.md"));
            }
            let mut totals = Totals::default();
            let (counts, outcome) = run_tests(&mut c);
            totals.add("parity", counts, outcome);
            let swept = clean_stale();
            totals.finish()?;
            swept?;
        }
        Task::Image { agent, tag, out } => {
            if agent.is_none() {
                build(true)?;
            }
            let defaults = image::Options::default();
            image::build(&image::Options {
                agent,
                tag,
                out: out.unwrap_or(defaults.out),
            })?;
        }
        Task::KernelSmoke {
            kernels,
            timeout_s,
            kvm,
        } => {
            require_root("kernel-smoke")?;
            build(false)?;
            kernel_smoke::run(
                &root().join("target/debug/svc-agent"),
                &root().join("target/debug/svc-probe"),
                std::time::Duration::from_secs(timeout_s),
                kvm,
                if kernels.is_empty() {
                    kernel_smoke::Guest::ALL
                } else {
                    &kernels
                },
            )?;
        }
        Task::ControlPlane => {
            for (var, path) in control_plane::ensure()?.env() {
                println!("{var}={}", path.display());
            }
        }
        Task::Lint => {
            build_ebpf()?;
            run(cargo().args(["fmt", "--all", "--check"]))?;
            // Built, not only checked: `cargo xtask test` then compiles nothing of the
            // workspace again (see `dev_cargo`).
            lint_build(
                dev_cargo()?
                    .args(["build", "--all-targets"])
                    .args(USERSPACE),
            )?;
            lint_build(dev_cargo()?.args(["build", "--all-targets", "-p", "svc-charts"]))?;
            run(ebpf_cargo("clippy").args(["--", "-D", "warnings"]))?;
        }
        Task::Bench {
            write,
            socket,
            kube,
            scale,
            vs_kube_proxy,
            nodeport,
            quick,
        } => {
            require_root("bench")?;
            if quick && !vs_kube_proxy && !nodeport {
                bail!("--quick goes with --vs-kube-proxy or --nodeport");
            }
            // The kube-proxy comparisons take long (Service counts, four proxies, rounds):
            // only when asked for.
            let both = !socket && !kube && !scale && !vs_kube_proxy && !nodeport;
            build(true)?;
            // Built first, so a cold control-plane build does not fall between the two benches.
            let control_plane = if both || kube || scale || vs_kube_proxy || nodeport {
                Some(control_plane::ensure()?)
            } else {
                None
            };
            let doc = root().join("docs/benchmarks.md");
            let bench_with = |bin: &str, cargo_args: &[&str]| {
                let mut c = cargo();
                c.args(["run", "-q", "--release", "-p", "svc-tests"])
                    .args(cargo_args)
                    .args(["--bin", bin, "--"])
                    .env("SVC_AGENT_BIN", root().join("target/release/svc-agent"));
                if write {
                    c.args(["--write", &doc.display().to_string()]);
                }
                c
            };
            let bench = |bin: &str| bench_with(bin, &[]);
            if both || socket {
                run(&mut bench("svc-bench"))?;
            }
            if let Some(cp) = &control_plane {
                if both || kube {
                    run(bench("svc-kube-bench").envs(cp.env()))?;
                }
            }
            if both || scale {
                run(&mut bench("svc-scale-bench"))?;
                if let Some(cp) = &control_plane {
                    run(bench("svc-kube-bench").envs(cp.env()).args([
                        "--services",
                        "100000",
                        "--endpoints",
                        "3",
                        "--cold-starts",
                        "1",
                        "--changes",
                        "200",
                        "--rss-target-mib",
                        "256",
                        "--section",
                        "kube-scale",
                        // Through the API, creating 100,000 Services takes hours here.
                        "--via-etcd",
                    ]))?;
                }
            }
            if let (true, Some(cp)) = (vs_kube_proxy, &control_plane) {
                let out = root().join(if write { "docs/bench" } else { "target/bench" });
                std::fs::create_dir_all(&out)?;
                // The renderer and font are built for this bench alone.
                let mut c = bench_with("svc-vs-kube-proxy-bench", &["--features", "charts"]);
                c.envs(cp.env())
                    .arg("--json")
                    .arg(out.join("vs-kube-proxy.json"))
                    .arg("--plots")
                    .arg(&out);
                if quick {
                    c.arg("--quick");
                }
                run(&mut c)?;
            }
            if let (true, Some(cp)) = (nodeport, &control_plane) {
                let out = root().join("target/bench");
                std::fs::create_dir_all(&out)?;
                // The per-packet table first, on a machine the traffic has not warmed yet; the
                // bench puts it in its section.
                let table = out.join("per-packet.md");
                run(cargo()
                    .args([
                        "test",
                        "-q",
                        "--release",
                        "-p",
                        "svc-ebpf-tests",
                        "--test",
                        "fixtures",
                        "per_packet_cost",
                        "--",
                        "--ignored",
                        "--nocapture",
                    ])
                    .env("SVC_PACKET_COST_TABLE", &table))?;
                let mut c = bench("svc-nodeport-bench");
                c.envs(cp.env())
                    .arg("--json")
                    .arg(out.join("nodeport.json"))
                    .arg("--per-packet")
                    .arg(&table);
                if quick {
                    c.arg("--quick");
                }
                run(&mut c)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{nextest_counts, result_counts};

    #[test]
    fn the_first_lines_of_each_panic_are_kept() {
        let mut p = super::Panics::default();
        for line in [
            "        PASS [   0.011s] xtask tests::x",
            "thread 'a' panicked at tests/tests/crash.rs:168:9:",
            "after kill 3 (round 4), 2 problems: [",
            "    \"x\",",
            "    \"y\",",
            "]",
            "agent log 1",
            "agent log 2",
            "thread 'b' panicked at src/lib.rs:1:1:",
            "boom",
            "stack backtrace:",
            "   0: __rustc::rust_begin_unwind",
        ] {
            p.see(line);
        }
        assert_eq!(
            p.lines,
            [
                "thread 'a' panicked at tests/tests/crash.rs:168:9:",
                "  after kill 3 (round 4), 2 problems: [",
                "      \"x\",",
                "      \"y\",",
                "  ]",
                "  agent log 1",
                "thread 'b' panicked at src/lib.rs:1:1:",
                "  boom",
            ]
        );
    }

    #[test]
    fn nextest_summaries_are_counted() {
        assert_eq!(
            nextest_counts("     Summary [ 355.123s] 349 tests run: 349 passed, 2 skipped"),
            Some((349, 0))
        );
        assert_eq!(
            nextest_counts(
                "     Summary [  61.020s] 14 tests run: 11 passed (1 slow), 2 failed, 1 timed \
                 out, 0 skipped"
            ),
            Some((11, 3))
        );
        assert_eq!(
            nextest_counts("        PASS [   0.011s] xtask tests::x"),
            None
        );
        assert_eq!(nextest_counts("tests: 3 passed, 0 failed"), None);
    }

    #[test]
    fn closing_lines_of_libtest_and_libtest_mimic_are_counted() {
        // libtest
        assert_eq!(
            result_counts(
                "test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; \
                 finished in 0.20s"
            ),
            Some((12, 0))
        );
        // libtest-mimic (tests/tests/kube.rs), a failed run
        assert_eq!(
            result_counts(
                "test result: FAILED. 13 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; \
                 finished in 61.02s"
            ),
            Some((13, 1))
        );
        assert_eq!(result_counts("test s05-conditions ... ok"), None);
        assert_eq!(result_counts("tests: 3 passed, 0 failed"), None);
    }
}
