//! The agent as a child process, its CLI (`list`, `uninstall`) and its bpffs directory.

use std::{
    ffi::OsString,
    fs::File,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::sys::{die_with_parent, ensure_bpffs, run, signal, unique_name, TempDir};

/// The line the agent prints once after its first full sync.
pub const READY_LINE: &str = "svc-agent: ready";
/// The line the agent prints once after its first full sync, when its socket programs are
/// attached (ClusterIPs answer); `READY_LINE` follows when the rest is (the tc and XDP
/// programs), at once on a restart.
pub const SERVING_LINE: &str = "svc-agent: serving";
/// The line the agent prints after each sync that changed the maps.
pub const SYNCED_LINE: &str = "svc-agent: synced";

/// The environment variable that makes every agent the harness starts attach its tc programs
/// this way (`--tc-attach VALUE`), unless the test names a mode itself. `cargo xtask test` runs
/// the packet tests a second time with it set to `classic` (docs/design/test-tiers.md).
pub const TC_ATTACH_ENV: &str = "SVC_TEST_TC_ATTACH";

/// The agent flags a test pass forces on every `run` the harness starts, from the environment:
/// `(variable, flag)`. One place, so a pass that forces more (an old kernel's fallbacks) adds a
/// row here and its variable in xtask's second pass. A flag the test's own arguments already
/// name is left to the test: it chose that mode on purpose.
const FORCED_FLAGS: &[(&str, &str)] = &[(TC_ATTACH_ENV, "--tc-attach")];

/// The tc attach mode forced on this run's agents (`SVC_TEST_TC_ATTACH`), if any.
pub fn forced_tc_attach() -> Option<String> {
    forced_value(TC_ATTACH_ENV)
}

fn forced_value(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.is_empty())
}

/// The flags `FORCED_FLAGS` adds to `args` (an agent's command line after the binary): only
/// for the commands that run the datapath (`run`, or kube-proxy's `--config=FILE` line), and
/// only those `args` does not name itself (`--flag V` or `--flag=V`).
pub fn forced_args(args: &[OsString]) -> Vec<OsString> {
    forced_args_with(args, forced_value)
}

fn forced_args_with(args: &[OsString], env: impl Fn(&str) -> Option<String>) -> Vec<OsString> {
    let runs = args.first().is_some_and(|a| a == "run")
        || args
            .iter()
            .any(|a| a.to_string_lossy().starts_with("--config"));
    if !runs {
        return Vec::new();
    }
    let named = |flag: &str| {
        args.iter().any(|a| {
            let a = a.to_string_lossy();
            a == flag || a.starts_with(&format!("{flag}="))
        })
    };
    FORCED_FLAGS
        .iter()
        .filter(|(_, flag)| !named(flag))
        .filter_map(|(var, flag)| env(var).map(|v| format!("{flag}={v}").into()))
        .collect()
}

fn check_bin(bin: &Path) -> Result<()> {
    if !bin.is_file() {
        bail!(
            "svc-agent binary not found at {}: build it (`cargo build -p svc-agent`) or set \
             SVC_AGENT_BIN",
            bin.display()
        );
    }
    Ok(())
}

/// `svc-agent list -o json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ListOutput {
    pub services: Vec<ListService>,
    #[serde(default)]
    pub cluster_ips: Vec<String>,
    /// Addresses kept for flows of removed frontends (SVC_NODE_ADDRS, LINGER).
    #[serde(default)]
    pub lingering_addresses: Vec<String>,
    #[serde(default)]
    pub node_addresses: Vec<ListNodeAddr>,
    #[serde(default)]
    pub ct_timeouts: ListCtTimeouts,
    /// "MIN-MAX" of SVC_CONFIG.
    #[serde(default)]
    pub snat_ports: String,
}

/// The idle timeouts in effect, seconds, of `svc-agent list -o json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ListCtTimeouts {
    pub tcp_established_s: u32,
    pub tcp_close_wait_s: u32,
    pub udp_s: u32,
    pub udp_stream_s: u32,
}

/// A node address of `svc-agent list -o json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ListNodeAddr {
    pub address: String,
    pub nodeport: bool,
    #[serde(default)]
    pub localhost_nodeport: bool,
    pub snat: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ListService {
    /// "10.96.0.10:80/TCP".
    pub frontend: String,
    pub ip: String,
    pub port: u16,
    pub protocol: String,
    #[serde(default)]
    pub name: Option<String>,
    pub backends: Vec<String>,
    #[serde(default)]
    pub affinity_timeout_s: Option<u32>,
}

impl ListOutput {
    pub fn frontend(&self, frontend: &str) -> Option<&ListService> {
        self.services.iter().find(|s| s.frontend == frontend)
    }
}

/// Runs `svc-agent list --bpffs DIR -o json`.
pub fn list(bin: &Path, bpffs: &Path) -> Result<ListOutput> {
    check_bin(bin)?;
    let out = run(
        &bin.to_string_lossy(),
        [
            OsString::from("list"),
            "--bpffs".into(),
            bpffs.into(),
            "-o".into(),
            "json".into(),
        ],
    )?;
    serde_json::from_str(&out).with_context(|| format!("parsing `svc-agent list`: {out:?}"))
}

/// `GET PATH` over plain HTTP/1.1 (what the agent's `/healthz` and `/metrics` speak):
/// the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let reply = http_get_reply(addr, path)?;
    Ok((reply.status, reply.body))
}

/// An HTTP reply as it came: status line, headers in their order, body.
#[derive(Clone, Debug)]
pub struct HttpReply {
    /// `HTTP/1.1 200 OK`.
    pub status_line: String,
    pub status: u16,
    /// Names as sent, values trimmed.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpReply {
    /// The value of header `name` (case-insensitive), the first if it came twice.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// `GET PATH` with `Connection: close`: the whole reply, headers too.
pub fn http_get_reply(addr: SocketAddr, path: &str) -> Result<HttpReply> {
    use std::io::{Read, Write};
    let timeout = Duration::from_secs(5);
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    s.read_to_string(&mut response)
        .with_context(|| format!("reading the reply to GET {path}"))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("no end of headers in {response:?}"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default().to_string();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status code in {head:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.to_string(), v.trim().to_string()))
        .collect();
    Ok(HttpReply {
        status_line,
        status,
        headers,
        body: body.to_owned(),
    })
}

/// Runs `svc-agent uninstall --bpffs DIR [--cgroup CG]`.
pub fn uninstall(bin: &Path, bpffs: &Path, cgroup: Option<&Path>) -> Result<String> {
    check_bin(bin)?;
    let mut args = vec![OsString::from("uninstall"), "--bpffs".into(), bpffs.into()];
    if let Some(cg) = cgroup {
        args.push("--cgroup".into());
        args.push(cg.into());
    }
    run(&bin.to_string_lossy(), args)
}

/// A private directory under /sys/fs/bpf for one agent's pins. Not created here: the agent
/// creates it and `uninstall` removes it. On drop: `svc-agent uninstall`, then whatever is
/// still there is removed by hand so no pin (and so no attached program) outlives the test.
#[derive(Debug)]
pub struct Bpffs {
    dir: PathBuf,
    agent_bin: PathBuf,
    cgroup: PathBuf,
}

impl Bpffs {
    pub fn new(agent_bin: &Path, cgroup: &Path) -> Result<Self> {
        let dir = ensure_bpffs()?.join(unique_name("svc-test"));
        if dir.exists() {
            bail!("{} already exists", dir.display());
        }
        Ok(Self {
            dir,
            agent_bin: agent_bin.to_owned(),
            cgroup: cgroup.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Names directly under the directory (empty when it does not exist).
    pub fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        if !self.dir.exists() {
            return;
        }
        if self.agent_bin.is_file() {
            if let Err(e) = uninstall(&self.agent_bin, &self.dir, Some(&self.cgroup)) {
                eprintln!("svc-tests: {e:#}");
            }
        }
        if self.dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                eprintln!("svc-tests: removing {}: {e}", self.dir.display());
            }
        }
    }
}

/// A running `svc-agent run ...`. Its stderr goes to a file per start (`agent-N.log` in the
/// log directory) so tests can assert on it. On drop the logs are printed to stderr, which the
/// test runner captures and shows only for a failed test (`quiet` turns that off).
#[derive(Debug)]
pub struct Agent {
    /// A command that runs the agent (`setpriv ...`, `unshare ...`): `LAUNCHER... BIN ARGS...`.
    launcher: Vec<OsString>,
    bin: PathBuf,
    args: Vec<OsString>,
    log_dir: PathBuf,
    child: Option<Child>,
    starts: usize,
    bpffs: PathBuf,
    print_logs: bool,
    /// `/healthz` and `/livez` (only) of an agent started with `start_kube`.
    healthz: Option<SocketAddr>,
    /// `/metrics` (and `/healthz`) of an agent started with `start_kube`.
    metrics: Option<SocketAddr>,
    /// The log directory when the agent owns it (`start_kube`); removed after the agent stops.
    own_logs: Option<TempDir>,
}

/// `run --kubeconfig K --node-name N --cgroup CG --bpffs DIR`: the agent against the
/// Kubernetes API; more flags go after these.
pub fn kube_run_args(
    kubeconfig: &Path,
    node_name: &str,
    cgroup: &Path,
    bpffs: &Path,
) -> Vec<OsString> {
    vec![
        "run".into(),
        "--kubeconfig".into(),
        kubeconfig.into(),
        "--node-name".into(),
        node_name.into(),
        "--cgroup".into(),
        cgroup.into(),
        "--bpffs".into(),
        bpffs.into(),
    ]
}

/// A loopback port nothing listens on now (the agent binds it a moment later).
pub fn free_loopback_port() -> Result<SocketAddr> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

impl Agent {
    /// Starts `svc-agent run --manifests M --cgroup CG --bpffs DIR EXTRA...` (does not wait
    /// for it to be ready; see `wait_ready`).
    pub fn start(
        bin: &Path,
        manifests: &Path,
        cgroup: &Path,
        bpffs: &Path,
        extra: &[&str],
        log_dir: &Path,
    ) -> Result<Self> {
        check_bin(bin)?;
        let mut args: Vec<OsString> = vec![
            "run".into(),
            "--manifests".into(),
            manifests.into(),
            "--cgroup".into(),
            cgroup.into(),
            "--bpffs".into(),
            bpffs.into(),
        ];
        args.extend(extra.iter().map(OsString::from));
        Self::start_with_args(bin, args, bpffs, log_dir)
    }

    /// Starts `svc-agent ARGS` exactly as given (`ARGS` begins with the subcommand); `bpffs`
    /// is only where `list` looks.
    pub fn start_with_args(
        bin: &Path,
        args: Vec<OsString>,
        bpffs: &Path,
        log_dir: &Path,
    ) -> Result<Self> {
        Self::start_launched(&[], bin, args, bpffs, log_dir)
    }

    /// Like `start_with_args`, through `launcher`: runs `LAUNCHER... BIN ARGS...`, for instance
    /// `setpriv --bounding-set=... --inh-caps=...` to run the agent with fewer capabilities.
    /// The launcher must end by exec'ing the agent (or keep running as long as it does, passing
    /// SIGTERM on), as `pid`, `terminate` and `kill` act on the process it starts.
    pub fn start_launched(
        launcher: &[OsString],
        bin: &Path,
        args: Vec<OsString>,
        bpffs: &Path,
        log_dir: &Path,
    ) -> Result<Self> {
        check_bin(bin)?;
        let mut agent = Self {
            launcher: launcher.to_vec(),
            bin: bin.to_owned(),
            args,
            log_dir: log_dir.to_owned(),
            child: None,
            starts: 0,
            bpffs: bpffs.to_owned(),
            print_logs: true,
            healthz: None,
            metrics: None,
            own_logs: None,
        };
        agent.spawn()?;
        Ok(agent)
    }

    /// Starts `svc-agent run --kubeconfig K --node-name N --cgroup CG --bpffs DIR EXTRA...`
    /// against the Kubernetes API (does not wait for it to be ready). `/healthz` and
    /// `/metrics` are put on free loopback ports (the defaults would bind 0.0.0.0:10256 and
    /// collide between agents) unless `extra` names them; see `healthz_addr`/`metrics_addr`.
    /// The logs go to a directory of the agent's own.
    pub fn start_kube(
        bin: &Path,
        kubeconfig: &Path,
        node_name: &str,
        cgroup: &Path,
        bpffs: &Path,
        extra: &[&str],
    ) -> Result<Self> {
        Self::start_kube_launched(&[], bin, kubeconfig, node_name, cgroup, bpffs, extra)
    }

    /// `start_kube` through `launcher` (`nsenter --net=NS`: the agent of a node namespace).
    pub fn start_kube_launched(
        launcher: &[OsString],
        bin: &Path,
        kubeconfig: &Path,
        node_name: &str,
        cgroup: &Path,
        bpffs: &Path,
        extra: &[&str],
    ) -> Result<Self> {
        let logs = TempDir::new("svc-agent-logs")?;
        let mut args = kube_run_args(kubeconfig, node_name, cgroup, bpffs);
        let mut healthz = None;
        let mut metrics = None;
        let given = |flag: &str| extra.iter().any(|a| a.starts_with(flag));
        if !given("--healthz-bind-address") {
            let a = free_loopback_port()?;
            args.push(format!("--healthz-bind-address={a}").into());
            healthz = Some(a);
        }
        if !given("--metrics-bind-address") {
            let a = free_loopback_port()?;
            args.push(format!("--metrics-bind-address={a}").into());
            metrics = Some(a);
        }
        args.extend(extra.iter().map(OsString::from));
        let mut agent = Self::start_launched(launcher, bin, args, bpffs, logs.path())?;
        agent.healthz = healthz;
        agent.metrics = metrics;
        agent.own_logs = Some(logs);
        Ok(agent)
    }

    /// Starts `svc-agent --config=FILE --cgroup CG --bpffs DIR EXTRA...`, kube-proxy's command
    /// line as kubeadm's DaemonSet has it (no subcommand): what the Kubernetes API source needs
    /// (kubeconfig, node name) comes from kube-proxy's configuration file;
    /// `healthz`/`metrics`: where it or `extra` puts them.
    pub fn start_kube_config(
        bin: &Path,
        config: &Path,
        cgroup: &Path,
        bpffs: &Path,
        extra: &[&str],
        healthz: SocketAddr,
        metrics: SocketAddr,
    ) -> Result<Self> {
        let logs = TempDir::new("svc-agent-logs")?;
        let mut config_flag = OsString::from("--config=");
        config_flag.push(config);
        let mut args: Vec<OsString> = vec![
            config_flag,
            "--cgroup".into(),
            cgroup.into(),
            "--bpffs".into(),
            bpffs.into(),
        ];
        args.extend(extra.iter().map(OsString::from));
        let mut agent = Self::start_launched(&[], bin, args, bpffs, logs.path())?;
        agent.healthz = Some(healthz);
        agent.metrics = Some(metrics);
        agent.own_logs = Some(logs);
        Ok(agent)
    }

    /// Where `/healthz` is served (and `/metrics` is not), when `start_kube` chose the address.
    pub fn healthz_addr(&self) -> Option<SocketAddr> {
        self.healthz
    }

    /// Where `/metrics` is served, when `start_kube` chose the address.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    fn spawn(&mut self) -> Result<()> {
        self.starts += 1;
        let log = File::create(self.log_path())?;
        let mut cmd = match self.launcher.split_first() {
            None => Command::new(&self.bin),
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&self.bin);
                c
            }
        };
        die_with_parent(&mut cmd);
        // An agent of the tests never picks the machine's own devices for the packet
        // datapath: a test that wants it names its own devices (`--devices`, which wins).
        if std::env::var_os("SVC_DEVICES").is_none() {
            cmd.env("SVC_DEVICES", "none");
        }
        let child = cmd
            .args(&self.args)
            .args(forced_args(&self.args))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// The file the current run logs to.
    pub fn log_path(&self) -> PathBuf {
        self.log_dir.join(format!("agent-{}.log", self.starts))
    }

    /// The log (stdout and stderr) of the current or last run.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The logs of every run so far, in order.
    pub fn all_logs(&self) -> String {
        (1..=self.starts)
            .map(|i| {
                let p = self.log_dir.join(format!("agent-{i}.log"));
                format!(
                    "--- agent run {i} ---\n{}",
                    std::fs::read_to_string(p).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `None` while running, the exit status once it exited.
    pub fn exited(&mut self) -> Result<Option<ExitStatus>> {
        match &mut self.child {
            Some(c) => Ok(c.try_wait()?),
            None => bail!("agent not started"),
        }
    }

    /// How many lines of the current run's log equal `line`.
    pub fn count_lines(&self, line: &str) -> usize {
        self.log().lines().filter(|l| l.trim() == line).count()
    }

    /// Waits until the current run has printed `svc-agent: ready`; fails at once if the agent
    /// exits, and with the log if it is not ready by `timeout`.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        self.wait_for_lines(READY_LINE, 1, timeout)
    }

    /// Waits until the current run's log holds `n` lines equal to `line`.
    pub fn wait_for_lines(&mut self, line: &str, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.count_lines(line) >= n {
                return Ok(());
            }
            if let Some(status) = self.exited()? {
                bail!(
                    "svc-agent exited ({status}) before `{line}`:\n{}",
                    self.log()
                );
            }
            crate::interrupt::check()?;
            if Instant::now() >= deadline {
                bail!(
                    "svc-agent: no {n}× `{line}` within {timeout:?}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then waits up to `timeout` for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let child = self.child.as_mut().context("agent not started")?;
        signal(child.id(), libc::SIGTERM)?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                bail!("svc-agent did not exit within {timeout:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL, and reaps it.
    pub fn kill(&mut self) -> Result<()> {
        let child = self.child.as_mut().context("agent not started")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Starts the agent again with the same arguments (after `kill` or `terminate`); its log
    /// goes to a new file.
    pub fn restart(&mut self) -> Result<()> {
        if self.exited()?.is_none() {
            bail!("agent still running");
        }
        self.spawn()
    }

    /// Runs `bin` from the next `restart` on (an upgrade).
    pub fn set_bin(&mut self, bin: &Path) {
        self.bin = bin.to_owned();
    }

    /// Do not print the logs on drop.
    pub fn quiet(&mut self) {
        self.print_logs = false;
    }

    /// `svc-agent list` on this agent's bpffs directory.
    pub fn list(&self) -> Result<ListOutput> {
        list(&self.bin, &self.bpffs)
    }
}

/// The lines of an agent log that tell of a request the API server refused: "forbidden" in any
/// case, or the status 403 as a number of its own (a substring would find it in
/// `13.854403Z`, as it did in CI). The timestamp each line starts with is left out: its
/// fields are numbers of their own, and one of them may be 403 (`20:18:13.403Z`).
pub fn refusals(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            let message = match line.split_once(' ') {
                Some((first, rest)) if is_timestamp(first) => rest,
                _ => line,
            };
            message.to_ascii_lowercase().contains("forbidden")
                || message
                    .split(|c: char| !c.is_ascii_digit())
                    .any(|number| number == "403")
        })
        .collect()
}

/// RFC 3339 in UTC as tracing writes it: 2026-12-01T20:18:13.854403Z.
fn is_timestamp(word: &str) -> bool {
    let b = word.as_bytes();
    b.len() >= 20 && b[10] == b'T' && word.ends_with('Z') && b[..4].iter().all(u8::is_ascii_digit)
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            if let Ok(None) = child.try_wait() {
                let _ = signal(child.id(), libc::SIGTERM);
                let deadline = Instant::now() + Duration::from_secs(5);
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if self.print_logs {
            eprintln!("{}", self.all_logs());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{forced_args_with, refusals, TC_ATTACH_ENV};
    use std::ffi::OsString;

    #[test]
    fn a_forced_tc_attach_goes_to_runs_that_name_no_mode() {
        let env = |var: &str| (var == TC_ATTACH_ENV).then(|| "classic".to_string());
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        let forced = vec![OsString::from("--tc-attach=classic")];
        assert_eq!(
            forced_args_with(&args(&["run", "--manifests", "m"]), env),
            forced
        );
        assert_eq!(
            forced_args_with(&args(&["--config=/c.yaml", "--cgroup", "cg"]), env),
            forced
        );
        // The test's own choice stands, in either spelling.
        for own in [
            &["run", "--tc-attach", "tcx"][..],
            &["run", "--tc-attach=tcx"],
        ] {
            assert!(forced_args_with(&args(own), env).is_empty(), "{own:?}");
        }
        // Commands that run no datapath take no such flag.
        assert!(forced_args_with(&args(&["list", "--bpffs", "b"]), env).is_empty());
        // Nothing forced without the variable.
        assert!(forced_args_with(&args(&["run"]), |_| None).is_empty());
    }

    #[test]
    fn a_timestamp_is_no_refusal() {
        // Seen in CI: the scenario took this line for a 403.
        let log = "2026-12-01T20:18:13.854403Z  INFO svc_agent::datapath: attached \
                   program=\"getpeername6\" cgroup=/sys/fs/cgroup/unified/svc-test-14588-93\n\
                   svc-agent: ready\n";
        assert!(refusals(log).is_empty(), "{:?}", refusals(log));
        // A timestamp field that is 403 by itself.
        let log = "2026-12-01T20:18:13.403Z  INFO svc_agent::agent: datapath attached\n\
                   2026-04-03T00:00:00.000403Z  INFO svc_agent::agent: ready\n";
        assert!(refusals(log).is_empty(), "{:?}", refusals(log));
        // A first word shaped like a timestamp, with a character across its 4th byte.
        assert_eq!(
            refusals("a\u{e9}\u{e9}\u{e9}\u{e9}bT\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}Z 403").len(),
            1
        );
    }

    #[test]
    fn a_refused_watch_is_found() {
        let forbidden = "2026-12-01T20:18:13.854403Z  WARN svc_agent::source::kube: Service: \
                         failed to perform initial object list: ApiError: services is \
                         forbidden: User \"system:serviceaccount:kube-system:svc-agent\" \
                         cannot list resource \"services\"";
        let code = "2026-12-01T20:18:14.000001Z  WARN svc_agent::source::kube: Node: \
                    ErrorResponse { code: 403 }";
        let log = format!("svc-agent: synced\n{forbidden}\n{code}\nsvc-agent: ready\n");
        assert_eq!(refusals(&log), vec![forbidden, code]);
        assert_eq!(refusals("HTTP 403\n"), vec!["HTTP 403"]);
        assert!(refusals("port 34031\n").is_empty());
    }
}
