//! Project tasks: `cargo xtask <task>`. Each task installs what it needs first, idempotently.

mod control_plane;
mod toolchain;

use std::path::{Path, PathBuf};
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
        /// Extra arguments for `cargo test`, after `--` (e.g. a test name filter).
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
    /// rustfmt and clippy (warnings denied) for the userspace crates and the kernel crate.
    Lint,
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
    Path::new(env!("CARGO_MANIFEST_DIR"))
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

    /// The child being run: signalled only while it has not been reaped, so its pid cannot
    /// have gone to another process.
    static CHILD: Mutex<Option<i32>> = Mutex::new(None);

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

    fn child() -> MutexGuard<'static, Option<i32>> {
        CHILD.lock().unwrap_or_else(|e| e.into_inner())
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
                    match *child() {
                        Some(_) if signal == SIGINT => {}
                        // SAFETY: a plain syscall on our own unreaped child.
                        Some(pid) => unsafe {
                            libc::kill(pid, signal);
                        },
                        // Between commands: what the signal would have done.
                        None => std::process::exit(128 + signal),
                    }
                }
            });
        });
    }

    /// Starts `cmd`; the signals xtask gets go to it from the moment it exists (the handler
    /// waits for the registration) until `wait` has reaped it.
    pub fn spawn(cmd: &mut Command) -> io::Result<Child> {
        install();
        let mut slot = child();
        let c = cmd.spawn()?;
        *slot = Some(c.id() as i32);
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
        *child() = None;
        waited?;
        c.wait()
    }
}

/// Runs `cargo test`, passing its output through, and ends with one total over every test
/// binary: cargo's own last line is the (empty) doc-test run of the last crate.
fn run_tests(cmd: &mut Command) -> Result<()> {
    use std::io::{BufRead, BufReader};
    eprintln!("+ {cmd:?}");
    let mut child =
        forward::spawn(cmd.stdout(std::process::Stdio::piped())).context("running cargo test")?;
    let (mut passed, mut failed) = (0u64, 0u64);
    let stdout = child.stdout.take().context("cargo test stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo test output")?;
        println!("{line}");
        if let Some((p, f)) = result_counts(&line) {
            passed += p;
            failed += f;
        }
    }
    let status = forward::wait(child).context("waiting for cargo test")?;
    println!("tests: {passed} passed, {failed} failed");
    forward::stop_if_signalled()?;
    if !status.success() {
        bail!("cargo test failed: {status}");
    }
    Ok(())
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
    c
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
    let mut c = cargo();
    c.args(["build", "-p", "svc-agent", "-p", "svc-tests", "--bins"]);
    if release {
        c.arg("--release");
    }
    run(&mut c)
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
            run(cargo()
                .args(["run", "-q", "-p", "svc-tests", "--bin", "svc-demo"])
                .env("SVC_AGENT_BIN", root().join("target/debug/svc-agent")))?;
        }
        Task::Test { args } => {
            require_root("test")?;
            build(false)?;
            let control_plane = control_plane::ensure()?;
            run_tests(
                cargo()
                    .args(["test", "--workspace", "--exclude", "svc-ebpf", "--"])
                    .args(&args)
                    .envs(control_plane.env())
                    .env("SVC_AGENT_BIN", root().join("target/debug/svc-agent")),
            )?;
        }
        Task::Parity { write, args } => {
            require_root("parity")?;
            build(false)?;
            let control_plane = control_plane::ensure()?;
            let mut c = cargo();
            c.args(["test", "-p", "svc-tests", "--test", "parity", "--"])
                .args(&args)
                .envs(control_plane.env())
                .env("SVC_AGENT_BIN", root().join("target/debug/svc-agent"));
            if write {
                c.env("SVC_PARITY_TABLE", root().join("docs/parity.md"));
            }
            run_tests(&mut c)?;
        }
        Task::ControlPlane => {
            for (var, path) in control_plane::ensure()?.env() {
                println!("{var}={}", path.display());
            }
        }
        Task::Lint => {
            build_ebpf()?;
            run(cargo().args(["fmt", "--all", "--check"]))?;
            run(cargo().args([
                "clippy",
                "--workspace",
                "--exclude",
                "svc-ebpf",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]))?;
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
            let bench = |bin: &str| {
                let mut c = cargo();
                c.args([
                    "run",
                    "-q",
                    "--release",
                    "-p",
                    "svc-tests",
                    "--bin",
                    bin,
                    "--",
                ])
                .env("SVC_AGENT_BIN", root().join("target/release/svc-agent"));
                if write {
                    c.args(["--write", &doc.display().to_string()]);
                }
                c
            };
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
                let mut c = bench("svc-vs-kube-proxy-bench");
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
                        "svc-agent",
                        "--test",
                        "packet_fixtures",
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
    use super::result_counts;

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
