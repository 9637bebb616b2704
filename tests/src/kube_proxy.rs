//! The real kube-proxy beside svc: run in a network namespace the test created, in iptables mode
//! (on either iptables backend) or nftables mode, against the test's kube-apiserver.
//!
//! kube-proxy's rules act in the network namespace it runs in (the OUTPUT chain for locally
//! originated traffic), so it runs in a sandbox's *client* namespace, and a client there is
//! proxied by it: the namespace plays the node. It is started with `nsenter --net=NS` (which,
//! unlike `ip netns exec`, leaves /sys as it is), so nothing it writes (iptables, nftables,
//! sysctls of the namespace) can reach the machine's own firewall. Everything it runs
//! (`iptables-restore`, `nft`, ...) inherits the namespace.
//!
//! The namespace has no route to the host's loopback, where the API server listens: an
//! [`ApiRelay`] listens on the namespace's own 127.0.0.1 and forwards each connection to the API
//! server, from the test process (TLS passes through untouched; the serving certificate is for
//! 127.0.0.1, which is also the relay's address).
//!
//! kube-proxy authenticates as `system:kube-proxy` with a client certificate from the cluster's
//! CA, the identity kubeadm gives it: the API server's bootstrap ClusterRoleBinding
//! `system:node-proxier` binds that user to kube-proxy's own ClusterRole.
//!
//! The iptables backend is chosen as the official kube-proxy image's iptables-wrapper does, by
//! what `iptables` on PATH is: kube-proxy runs with a directory of links first on its PATH,
//! `iptables`, `iptables-save`, `iptables-restore` and their ip6tables twins pointing at
//! `xtables-nft-multi` (Debian's default, iptables-nft) or `xtables-legacy-multi`
//! (iptables-legacy), which dispatch on the name they are called by.

use std::{
    ffi::OsString,
    fs::File,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{
    agent::http_get,
    control_plane::ControlPlane,
    netns::{run_in_netns, NetNs},
    sys::{die_with_parent, signal, TempDir},
};

/// The user kube-proxy authenticates as, and the group kubeadm's certificates give it.
pub const KUBE_PROXY_USER: &str = "system:kube-proxy";

/// Where kube-proxy serves `/healthz` and `/metrics` inside its namespace (each namespace has
/// ports of its own, so the defaults never collide between tests).
pub const HEALTHZ: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);
pub const METRICS: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);

/// How long kube-proxy may take from start to its first sync of the rules (`/healthz` 200).
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// `SVC_KUBE_PROXY`, set by `cargo xtask test` (and printed by `cargo xtask control-plane`).
pub fn binary_from_env() -> Result<PathBuf> {
    let how = "the kube-proxy parity tests need kube-proxy built by `cargo xtask control-plane` \
               (about a minute once kube-apiserver is built): run them with `cargo xtask test`, \
               or `export $(cargo xtask control-plane)` in the shell first";
    let path = std::env::var_os("SVC_KUBE_PROXY")
        .map(PathBuf::from)
        .with_context(|| format!("SVC_KUBE_PROXY is not set: {how}"))?;
    if !path.is_file() {
        bail!("SVC_KUBE_PROXY={} does not exist: {how}", path.display());
    }
    Ok(path)
}

/// The iptables implementation behind `iptables` in iptables mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IptablesBackend {
    /// iptables-nft: iptables rules kept as nf_tables objects (Debian's default `iptables`).
    Nft,
    /// iptables-legacy: the x_tables kernel interface, a whole table replaced per restore.
    Legacy,
}

impl IptablesBackend {
    fn multi(self) -> &'static str {
        match self {
            IptablesBackend::Nft => "xtables-nft-multi",
            IptablesBackend::Legacy => "xtables-legacy-multi",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            IptablesBackend::Nft => "iptables-nft",
            IptablesBackend::Legacy => "iptables-legacy",
        }
    }
}

/// kube-proxy's proxy mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    Iptables(IptablesBackend),
    Nftables,
}

impl Mode {
    /// `--proxy-mode` / the configuration's `mode`.
    pub fn proxy_mode(self) -> &'static str {
        match self {
            Mode::Iptables(_) => "iptables",
            Mode::Nftables => "nftables",
        }
    }

    /// A short name for tables and file names: `kube-proxy-iptables-nft`,
    /// `kube-proxy-iptables-legacy`, `kube-proxy-nftables`.
    pub fn id(self) -> &'static str {
        match self {
            Mode::Iptables(IptablesBackend::Nft) => "kube-proxy-iptables-nft",
            Mode::Iptables(IptablesBackend::Legacy) => "kube-proxy-iptables-legacy",
            Mode::Nftables => "kube-proxy-nftables",
        }
    }

    /// What a reader should see: `kube-proxy iptables (iptables-nft)`.
    pub fn label(self) -> String {
        match self {
            Mode::Iptables(b) => format!("kube-proxy iptables ({})", b.name()),
            Mode::Nftables => "kube-proxy nftables".into(),
        }
    }

    pub fn parse(id: &str) -> Option<Mode> {
        [
            Mode::Iptables(IptablesBackend::Nft),
            Mode::Iptables(IptablesBackend::Legacy),
            Mode::Nftables,
        ]
        .into_iter()
        .find(|m| m.id() == id || m.id().strip_prefix("kube-proxy-") == Some(id))
    }
}

/// A directory whose `iptables*`/`ip6tables*` are the chosen backend's, first on kube-proxy's
/// PATH. nftables mode gets one too (Debian's default, iptables-nft): kube-proxy calls iptables
/// in that mode only to clean up what iptables mode may have left.
fn iptables_shim(dir: &Path, backend: IptablesBackend) -> Result<PathBuf> {
    let shim = dir.join("bin");
    std::fs::create_dir_all(&shim)?;
    let multi = ["/usr/sbin", "/sbin", "/usr/bin"]
        .iter()
        .map(|d| Path::new(d).join(backend.multi()))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{} not found: install Debian's iptables package (`cargo xtask control-plane` does)",
                backend.multi()
            )
        })?;
    for family in ["iptables", "ip6tables"] {
        for suffix in ["", "-save", "-restore"] {
            let link = shim.join(format!("{family}{suffix}"));
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&multi, &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    Ok(shim)
}

fn path_with(shim: &Path) -> OsString {
    let mut path = OsString::from(shim);
    path.push(":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    path
}

/// A TCP relay: listens on 127.0.0.1 of a network namespace and forwards every connection to
/// `upstream` (reached from the test process's own namespace). Stops accepting on drop;
/// connections in flight end when either side closes.
#[derive(Debug)]
pub struct ApiRelay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ApiRelay {
    pub fn start(ns: &NetNs, upstream: SocketAddr) -> Result<Self> {
        // Bound by a thread inside the namespace; the socket stays there, the process does not.
        let listener = ns.run_in(|| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))??;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("svc-api-relay".into())
            .spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((inside, _)) => {
                            let _ = inside.set_nonblocking(false);
                            if let Ok(outside) =
                                TcpStream::connect_timeout(&upstream, Duration::from_secs(5))
                            {
                                splice(inside, outside);
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// A relay to `cp`'s API server.
    pub fn to_api_server(ns: &NetNs, cp: &ControlPlane) -> Result<Self> {
        let upstream: SocketAddr = cp
            .server_url()
            .trim_start_matches("https://")
            .parse()
            .context("the API server's address")?;
        Self::start(ns, upstream)
    }

    /// The relay's address inside the namespace.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `kubeconfig` (one of `cp`'s) with the API server reached through this relay, written
    /// to `dir/kubeconfig`: for a process inside the relay's namespace.
    pub fn kubeconfig(&self, cp: &ControlPlane, kubeconfig: &Path, dir: &Path) -> Result<PathBuf> {
        let text = std::fs::read_to_string(kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?;
        if !text.contains(&cp.server_url()) {
            bail!("{} does not name {}", kubeconfig.display(), cp.server_url());
        }
        let text = text.replace(&cp.server_url(), &format!("https://{}", self.addr));
        let path = dir.join("kubeconfig");
        std::fs::write(&path, text)?;
        Ok(path)
    }
}

impl Drop for ApiRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Copies both ways between two connections until either side closes.
fn splice(a: TcpStream, b: TcpStream) {
    let pump = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Write);
            let _ = from.shutdown(std::net::Shutdown::Read);
        });
    };
    match (a.try_clone(), b.try_clone()) {
        (Ok(a2), Ok(b2)) => {
            pump(a, b2);
            pump(b, a2);
        }
        _ => {
            let _ = a.shutdown(std::net::Shutdown::Both);
            let _ = b.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Runs a command inside `ns` with `nsenter --net` (the command's own /sys and /proc stay the
/// host's, its network is the namespace's).
fn in_ns(ns: &Path, program: &Path) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", ns.display()))
        .arg("--")
        .arg(program);
    cmd
}

/// What kube-proxy needs to run: its binary, the cluster, the namespace, the node it plays.
#[derive(Clone, Debug)]
pub struct KubeProxyConfig {
    pub bin: PathBuf,
    pub mode: Mode,
    /// `hostnameOverride`: the Node object kube-proxy reads (its IPs, its zone).
    pub node_name: String,
    /// `minSyncPeriod`; kube-proxy's default is 1 s.
    pub min_sync_period: Option<Duration>,
    /// More lines for the KubeProxyConfiguration (top-level YAML).
    pub extra_config: String,
}

impl KubeProxyConfig {
    pub fn new(bin: &Path, mode: Mode, node_name: &str) -> Self {
        Self {
            bin: bin.to_owned(),
            mode,
            node_name: node_name.into(),
            min_sync_period: None,
            extra_config: String::new(),
        }
    }

    /// The KubeProxyConfiguration file: kube-proxy's defaults except where a namespace that is
    /// not a whole node needs otherwise. conntrack's global table size (`maxPerCore: 0`) and
    /// timeouts (`0s`) are left as they are: the machine's, not the test's.
    fn yaml(&self, kubeconfig: &Path) -> String {
        let mode_section = match self.mode {
            Mode::Iptables(_) => "iptables",
            Mode::Nftables => "nftables",
        };
        let min_sync = self
            .min_sync_period
            .map(|d| format!("  minSyncPeriod: {}ms\n", d.as_millis()))
            .unwrap_or_default();
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
             kind: KubeProxyConfiguration\n\
             mode: {mode}\n\
             hostnameOverride: {node}\n\
             clientConnection:\n  kubeconfig: {kubeconfig}\n\
             healthzBindAddress: {HEALTHZ}\n\
             metricsBindAddress: {METRICS}\n\
             conntrack:\n  maxPerCore: 0\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n\
             {mode_section}:\n{min_sync}  syncPeriod: 30s\n\
             {extra}",
            mode = self.mode.proxy_mode(),
            node = self.node_name,
            kubeconfig = kubeconfig.display(),
            extra = self.extra_config,
        )
    }
}

/// A running kube-proxy in a namespace of the test's. Drop stops it (SIGTERM, then SIGKILL):
/// its rules stay in the namespace, as kube-proxy leaves them on exit, until [`cleanup`] or
/// the namespace's end removes them.
#[derive(Debug)]
pub struct KubeProxy {
    config: KubeProxyConfig,
    ns_name: String,
    ns_path: PathBuf,
    child: Option<Child>,
    starts: usize,
    dir: TempDir,
    kubeconfig: PathBuf,
    shim: PathBuf,
    print_logs: bool,
    // Last: the relay outlives the process that uses it.
    relay: ApiRelay,
}

impl KubeProxy {
    /// Starts kube-proxy in `ns` (does not wait for its first sync; see `wait_ready`).
    pub fn start(config: KubeProxyConfig, cp: &ControlPlane, ns: &NetNs) -> Result<Self> {
        let dir = TempDir::new("svc-kube-proxy")?;
        let relay = ApiRelay::to_api_server(ns, cp)?;
        let cert_kubeconfig = cp.client_cert_kubeconfig(KUBE_PROXY_USER, KUBE_PROXY_USER)?;
        let kubeconfig = relay.kubeconfig(cp, &cert_kubeconfig, dir.path())?;
        let backend = match config.mode {
            Mode::Iptables(b) => b,
            Mode::Nftables => IptablesBackend::Nft,
        };
        let shim = iptables_shim(dir.path(), backend)?;
        std::fs::write(dir.path().join("config.yaml"), config.yaml(&kubeconfig))?;
        let mut kp = Self {
            config,
            ns_name: ns.name().to_owned(),
            ns_path: ns.path(),
            child: None,
            starts: 0,
            dir,
            kubeconfig,
            shim,
            print_logs: true,
            relay,
        };
        kp.spawn()?;
        Ok(kp)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.ns_path.display()))
            .arg("--")
            .arg(&self.config.bin)
            .args(args)
            .env_clear()
            .env("PATH", path_with(&self.shim))
            .env("HOME", self.dir.path());
        cmd
    }

    fn spawn(&mut self) -> Result<()> {
        self.starts += 1;
        let log = File::create(self.log_path())?;
        let config = self.dir.path().join("config.yaml");
        let mut cmd = self.command(&[&format!("--config={}", config.display()), "--v=2"]);
        die_with_parent(&mut cmd);
        // nsenter execs kube-proxy (no fork for --net alone): the child's pid is kube-proxy's.
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning nsenter ... kube-proxy")?;
        self.child = Some(child);
        Ok(())
    }

    fn log_path(&self) -> PathBuf {
        self.dir
            .path()
            .join(format!("kube-proxy-{}.log", self.starts))
    }

    pub fn mode(&self) -> Mode {
        self.config.mode
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The current run's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// GET `path` from kube-proxy's health (`/healthz`, `/livez`) or metrics port, from inside
    /// its namespace.
    pub fn http(&self, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
        run_in_netns(&self.ns_path, || http_get(addr, path))?
    }

    /// `/metrics`. In iptables mode kube-proxy also collects nfacct counters, which exist only
    /// when the kernel has nfnetlink_acct: without it the page comes with status 500 and the
    /// error, and every other metric as usual, which is what is returned then.
    pub fn metrics(&self) -> Result<String> {
        let (status, body) = self.http(METRICS, "/metrics")?;
        if status != 200 && !body.contains("\nkubeproxy_") {
            bail!("kube-proxy /metrics: {status}: {body}");
        }
        Ok(body)
    }

    /// One value of a metric without labels, e.g. `kubeproxy_sync_proxy_rules_last_timestamp_seconds`.
    pub fn metric(&self, name: &str) -> Result<Option<f64>> {
        let body = self.metrics()?;
        Ok(body
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok()))
    }

    /// How many times kube-proxy has synced each IP family's rules
    /// (`kubeproxy_sync_proxy_rules_duration_seconds_count`), by family.
    pub fn last_syncs(&self) -> Result<Vec<(String, f64)>> {
        let body = self.metrics()?;
        Ok(body
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("kubeproxy_sync_proxy_rules_duration_seconds_count")?;
                let (labels, value) = rest.rsplit_once(' ')?;
                Some((labels.to_string(), value.parse().ok()?))
            })
            .collect())
    }

    /// Waits until kube-proxy has synced the rules of every IP family at least once (its
    /// `/healthz` answers 200 from the start, before any rule is written, so it cannot tell).
    /// Returns how long that took.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        let mut last;
        loop {
            if let Some(child) = &mut self.child {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "{} exited ({status}) before it was ready; log:\n{}",
                        self.config.mode.label(),
                        tail(&self.log(), 40)
                    );
                }
            }
            match self.last_syncs() {
                // Dual-stack: one proxier per family, each with its own first sync.
                Ok(syncs) if syncs.len() >= 2 && syncs.iter().all(|(_, t)| *t > 0.0) => {
                    return Ok(started.elapsed());
                }
                Ok(syncs) => last = format!("last syncs {syncs:?}"),
                Err(e) => last = format!("{e:#}"),
            }
            crate::interrupt::check()?;
            if started.elapsed() > timeout {
                bail!(
                    "{} did not sync its rules within {timeout:?} ({last}); log:\n{}",
                    self.config.mode.label(),
                    tail(&self.log(), 40)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM (as a DaemonSet's pod is stopped), then SIGKILL after `timeout`. Its rules stay.
    pub fn stop(&mut self, timeout: Duration) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if child.try_wait()?.is_none() {
            signal(child.id(), libc::SIGTERM)?;
            let deadline = Instant::now() + timeout;
            while child.try_wait()?.is_none() {
                if Instant::now() >= deadline {
                    let _ = child.kill();
                    child.wait()?;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Starts it again with the same configuration (after `stop`).
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("kube-proxy is still running");
        }
        self.spawn()
    }

    /// `kube-proxy --cleanup` in this namespace, with the same iptables backend: removes every
    /// rule kube-proxy made, in every mode, and exits.
    pub fn cleanup(&self) -> Result<String> {
        let out = self
            .command(&["--cleanup", "--v=2"])
            .stdin(Stdio::null())
            .output()
            .context("running kube-proxy --cleanup")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            bail!("kube-proxy --cleanup failed ({}): {text}", out.status);
        }
        Ok(text)
    }

    /// The rules in the namespace, as `iptables-save`/`ip6tables-save` of this backend and
    /// `nft list ruleset` show them.
    pub fn rules(&self) -> Result<String> {
        namespace_rules(&self.ns_path, Some(&self.shim))
    }

    /// The namespace kube-proxy runs in.
    pub fn namespace(&self) -> &str {
        &self.ns_name
    }

    /// The API relay's address inside the namespace.
    pub fn api_relay(&self) -> SocketAddr {
        self.relay.addr()
    }

    /// Where kube-proxy's kubeconfig (client certificate, through the relay) is.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Do not print the logs on drop.
    pub fn quiet(&mut self) {
        self.print_logs = false;
    }
}

/// Logs kept so far (`SVC_KEEP_KUBE_PROXY_LOGS`), for their names.
static KEPT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Drop for KubeProxy {
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(5));
        // A bench's runs are compared by these logs (kube-proxy's own sync times): kept when
        // asked, as the temporary directory goes with this.
        if let Some(dir) = std::env::var_os("SVC_KEEP_KUBE_PROXY_LOGS") {
            let _ = std::fs::create_dir_all(&dir);
            // Each start's log (`log_path`), the restarts' too.
            for start in 1..=self.starts {
                let from = self.dir.path().join(format!("kube-proxy-{start}.log"));
                let to = Path::new(&dir).join(format!(
                    "{}-{}-{}.log",
                    self.config.mode.label().replace(' ', "-"),
                    std::process::id(),
                    KEPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ));
                let _ = std::fs::copy(from, to);
            }
        }
        if self.print_logs && std::thread::panicking() {
            eprintln!(
                "--- {} log (end) ---\n{}",
                self.config.mode.label(),
                tail(&self.log(), 60)
            );
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Every rule of a namespace: nftables (`nft list ruleset`, which also shows iptables-nft's
/// tables) and iptables-legacy's tables (`iptables-legacy-save`, which lists only tables that
/// exist and so creates none). With `shim`, the iptables commands are that backend's.
pub fn namespace_rules(ns: &Path, shim: Option<&Path>) -> Result<String> {
    let mut out = String::new();
    for (program, args) in [
        ("nft", &["list", "ruleset"][..]),
        ("iptables-legacy-save", &[][..]),
        ("ip6tables-legacy-save", &[][..]),
    ] {
        let mut cmd = in_ns(ns, Path::new(program));
        if let Some(shim) = shim {
            cmd.env("PATH", path_with(shim));
        }
        let o = cmd
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {program} in {}", ns.display()))?;
        if !o.status.success() {
            bail!(
                "{program} in {} failed: {}",
                ns.display(),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        out += &format!("### {program} {}\n", args.join(" "));
        out += &strip_comments(&String::from_utf8_lossy(&o.stdout));
    }
    Ok(out)
}

/// `*-save` output without its `# Generated by ... on DATE` lines and packet counters, so that
/// two dumps of the same rules compare equal.
fn strip_comments(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            // `:CHAIN POLICY [packets:bytes]`
            match l.rfind(" [") {
                Some(i) if l.starts_with(':') => &l[..i],
                _ => l,
            }
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The machine's own firewall, as the tests must leave it: `nft list ruleset` (nftables and
/// iptables-nft) and iptables-legacy's tables, of the host's network namespace. Read only
/// (`*-save` lists tables that exist; nothing is created).
pub fn host_rules() -> Result<String> {
    let mut out = String::new();
    for (program, args) in [
        ("nft", &["list", "ruleset"][..]),
        ("iptables-legacy-save", &[][..]),
        ("ip6tables-legacy-save", &[][..]),
    ] {
        let o = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {program}"))?;
        if !o.status.success() {
            bail!("{program} failed: {}", String::from_utf8_lossy(&o.stderr));
        }
        out += &format!("### {program} {}\n", args.join(" "));
        out += &strip_comments(&String::from_utf8_lossy(&o.stdout));
    }
    Ok(out)
}

/// Takes a snapshot of the machine's own firewall when made, and checks that it is unchanged
/// when `check`ed (and, loudly, on drop, also when a test fails).
#[derive(Debug)]
pub struct HostFirewallGuard {
    before: String,
    checked: bool,
}

impl HostFirewallGuard {
    pub fn new() -> Result<Self> {
        Ok(Self {
            before: host_rules()?,
            checked: false,
        })
    }

    /// Fails, showing the difference, if the host's rules changed since `new`.
    pub fn check(&mut self) -> Result<()> {
        self.checked = true;
        let after = host_rules()?;
        if after != self.before {
            bail!(
                "THE MACHINE'S OWN FIREWALL CHANGED during the test.\nbefore:\n{}\nafter:\n{}",
                self.before,
                after
            );
        }
        Ok(())
    }
}

impl Drop for HostFirewallGuard {
    fn drop(&mut self) {
        if !self.checked {
            if let Err(e) = self.check() {
                eprintln!("svc-tests: {e:#}");
            }
        }
    }
}
