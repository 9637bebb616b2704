//! A real Kubernetes control plane for tests: etcd and kube-apiserver on loopback, with their
//! own CA, TLS certificates, an admin client certificate and service-account keys, in a
//! temporary directory. No kube-controller-manager runs, so nothing rewrites the Services and
//! EndpointSlices a test writes: they stay exactly as written, which is what an agent test wants.
//!
//! Binaries come from `cargo xtask control-plane` (built from pinned upstream modules) through
//! `SVC_KUBE_APISERVER`, `SVC_KUBECTL` and `SVC_ETCD`; `cargo xtask test` sets them.
//! Certificates are made in process with `rcgen`; requests go through `kubectl`.
//!
//! Everything listens on 127.0.0.1 only, on ports the kernel picked as free. The processes are
//! stopped by pid (SIGTERM, then SIGKILL) and the directory removed on drop, also when a test
//! panics; and they get SIGKILL if the test process dies without unwinding.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, PKCS_ECDSA_P256_SHA256,
};
use serde_json::Value;

/// IPv4 and IPv6 ClusterIP ranges: the apiserver allocates dual-stack ClusterIPs from these.
pub const SERVICE_CIDRS: &str = "10.96.0.0/12,fd00:96::/112";
/// The field manager of every server-side apply from the harness.
pub const FIELD_MANAGER: &str = "svc-test";

/// etcd answers health within a second or two; kube-apiserver is ready after its post-start
/// hooks (RBAC bootstrap, system namespaces, the default ServiceCIDR) ran, a few seconds on an
/// idle machine. The deadlines are generous for a loaded 2-core CI machine.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(60);
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// A graceful stop is quick; past this the process gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(100);
/// Attempts when a port the kernel called free was taken before the server bound it.
const PORT_ATTEMPTS: usize = 3;

/// Paths of the binaries the control plane runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub kube_apiserver: PathBuf,
    pub kubectl: PathBuf,
    pub etcd: PathBuf,
}

impl Binaries {
    /// From `SVC_KUBE_APISERVER`, `SVC_KUBECTL` and `SVC_ETCD`; an error says how to build them,
    /// so that a test without them fails instead of passing vacuously.
    pub fn from_env() -> Result<Self> {
        Ok(Self {
            kube_apiserver: binary("SVC_KUBE_APISERVER")?,
            kubectl: binary("SVC_KUBECTL")?,
            etcd: binary("SVC_ETCD")?,
        })
    }
}

fn binary(var: &str) -> Result<PathBuf> {
    let how = "the control-plane tests need kube-apiserver, kubectl and etcd built by \
               `cargo xtask control-plane` (a cold build takes about 8 minutes on 2 cores, later ones \
               under a second): run the tests with `cargo xtask test`, or \
               `export $(cargo xtask control-plane)` in the shell first";
    let path = std::env::var_os(var).with_context(|| format!("{var} is not set: {how}"))?;
    let path = PathBuf::from(path);
    if !path.is_file() {
        bail!("{var}={} does not exist: {how}", path.display());
    }
    Ok(path)
}

/// A running etcd and kube-apiserver. Drop stops both and removes the directory. Set
/// `SVC_CONTROL_PLANE_KEEP=1` to keep the directory (logs, certificates, kubeconfig).
///
/// The processes die with the test process (PR_SET_PDEATHSIG, from a thread that lives as long
/// as the process), not with the thread that started or restarted them: tests on several
/// threads may share one `ControlPlane`.
#[derive(Debug)]
pub struct ControlPlane {
    bins: Binaries,
    dir: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    etcd_url: String,
    port: u16,
    kubeconfig: PathBuf,
    /// Flags added to kube-apiserver's own, after them.
    extra_args: Vec<String>,
    /// Set by the first shutdown (`stop`, then Drop, would run it twice).
    stopped: bool,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver with the binaries from the environment, and returns once
    /// the apiserver is ready to serve (see [`ControlPlane::start_with`]).
    pub fn start() -> Result<Self> {
        Self::start_with(Binaries::from_env()?)
    }

    /// Starts etcd, waits for its health, starts kube-apiserver and waits until `/readyz` says ok,
    /// the `default` namespace exists and Service IPs can be allocated.
    pub fn start_with(bins: Binaries) -> Result<Self> {
        Self::start_with_args(bins, &[])
    }

    /// `start`, with the API server's `--service-node-port-range` set to `range`
    /// (`"20000-32767"`): the default range holds 2,768 NodePorts, too few for a benchmark
    /// of tens of thousands of NodePort Services.
    pub fn start_with_node_port_range(range: &str) -> Result<Self> {
        let flag = format!("--service-node-port-range={range}");
        Self::start_with_args(Binaries::from_env()?, &[&flag])
    }

    /// As [`ControlPlane::start_with`], with `extra` flags for kube-apiserver (after its own:
    /// a flag given twice takes the later value).
    pub fn start_with_args(bins: Binaries, extra: &[&str]) -> Result<Self> {
        let dir = temp_dir()?;
        // Built before anything starts, so that Drop cleans up whatever fails part way.
        let mut cp = Self {
            bins,
            kubeconfig: dir.join("admin.kubeconfig"),
            dir,
            etcd: None,
            apiserver: None,
            etcd_url: String::new(),
            port: 0,
            extra_args: extra.iter().map(|a| a.to_string()).collect(),
            stopped: false,
        };
        cp.make_pki().context("making certificates")?;
        cp.start_etcd().context("starting etcd")?;
        cp.write_admin_kubeconfig()?;
        cp.start_apiserver().context("starting kube-apiserver")?;
        Ok(cp)
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// A kubeconfig for the admin user (group `system:masters`), certificates embedded.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The CA that signed the apiserver's serving certificate and the client certificates.
    pub fn ca_cert_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// `http://127.0.0.1:<port>`, etcd's client URL.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// Writes `entries` (key, value) straight into etcd, 128 to a transaction (etcd's default
    /// limit), through its JSON gateway. For objects kube-apiserver cannot create fast enough
    /// (see `bulk::populate_via_etcd`); the apiserver's watch sees them as any other write.
    pub fn etcd_put(&self, entries: &[(String, Vec<u8>)]) -> Result<()> {
        use base64::Engine as _;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let port: u16 = self
            .etcd_url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("etcd's port")?;
        for chunk in entries.chunks(128) {
            let ops: Vec<serde_json::Value> = chunk
                .iter()
                .map(|(k, v)| {
                    serde_json::json!({"requestPut": {"key": b64(k.as_bytes()), "value": b64(v)}})
                })
                .collect();
            let body = serde_json::json!({ "success": ops }).to_string();
            let mut conn = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
            conn.set_read_timeout(Some(Duration::from_secs(30)))?;
            write!(
                conn,
                "POST /v3/kv/txn HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )?;
            let mut response = String::new();
            conn.read_to_string(&mut response)?;
            if !response.starts_with("HTTP/1.1 200") || !response.contains(r#""succeeded":true"#) {
                bail!(
                    "etcd refused a write of {} keys from {}: {}",
                    chunk.len(),
                    chunk[0].0,
                    response.lines().last().unwrap_or_default()
                );
            }
        }
        Ok(())
    }

    /// The pids of etcd and kube-apiserver, while they run.
    pub fn pids(&self) -> Vec<u32> {
        [&self.etcd, &self.apiserver]
            .into_iter()
            .flatten()
            .map(Child::id)
            .collect()
    }

    /// The temporary directory: logs (`etcd.log`, `kube-apiserver.log`), certificates,
    /// kubeconfigs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn binaries(&self) -> &Binaries {
        &self.bins
    }

    /// Stops kube-apiserver (SIGTERM, as on a rolling restart) and starts it again on the same
    /// port with the same etcd, returning once it is ready again. Clients see refused
    /// connections in between, and their watches end.
    pub fn restart_apiserver(&mut self) -> Result<()> {
        if let Some(child) = self.apiserver.take() {
            stop(child, "kube-apiserver")?;
        }
        self.start_apiserver()
            .context("starting kube-apiserver again")
    }

    /// Stops both processes and removes the directory, reporting what went wrong (Drop can
    /// only ignore it).
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    /// Runs `kubectl` as the admin user; returns its standard output, or an error with its
    /// standard error.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_as(&self.kubeconfig, args, None)
    }

    /// Like [`ControlPlane::kubectl`], with `stdin` as standard input (for `-f -`).
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> Result<String> {
        self.kubectl_as(&self.kubeconfig, args, Some(stdin))
    }

    /// Creates the Node `name` with the InternalIP `ip`: the node a proxy plays (kube-proxy
    /// reads its addresses from it).
    pub fn create_node(&self, name: &str, ip: &str) -> Result<()> {
        let node = serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]}});
        self.kubectl_stdin(&["create", "-f", "-"], &node.to_string())?;
        Ok(())
    }

    /// Runs `kubectl` with another kubeconfig (for instance one of
    /// [`ControlPlane::service_account_kubeconfig`]).
    pub fn kubectl_as(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String> {
        let mut cmd = Command::new(&self.bins.kubectl);
        cmd.arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            // kubectl caches discovery under $HOME/.kube: keep that in the temporary directory.
            .env("HOME", &self.dir)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("spawning kubectl")?;
        // Written from a thread, so that a large input cannot deadlock against kubectl's output.
        let writer = stdin.map(|input| {
            let mut pipe = child.stdin.take().expect("stdin is piped");
            let input = input.to_owned();
            std::thread::spawn(move || pipe.write_all(input.as_bytes()))
        });
        let out = child.wait_with_output().context("waiting for kubectl")?;
        if let Some(writer) = writer {
            // A kubectl that failed early may not have read its input; its stderr says why.
            let _ = writer.join();
        }
        if !out.status.success() {
            bail!(
                "kubectl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// `kubectl get <args> -o json`, parsed.
    pub fn get_json(&self, args: &[&str]) -> Result<Value> {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        Ok(serde_json::from_str(&self.kubectl(&all)?)?)
    }

    /// Server-side applies every object of a YAML stream (any kind): creates what is missing,
    /// updates what exists, owned by [`FIELD_MANAGER`]. Returns the objects as stored (with the
    /// ClusterIPs the apiserver allocated, for instance).
    pub fn apply_yaml(&self, yaml: &str) -> Result<Vec<Value>> {
        self.server_side_apply(yaml, false)
    }

    /// Server-side apply with `dryRun=All`: the apiserver defaults, validates and admits the
    /// objects as it would store them, and stores nothing. Returns them as they would be.
    pub fn dry_run_server_side(&self, yaml: &str) -> Result<Vec<Value>> {
        self.server_side_apply(yaml, true)
    }

    fn server_side_apply(&self, yaml: &str, dry_run: bool) -> Result<Vec<Value>> {
        let manager = format!("--field-manager={FIELD_MANAGER}");
        let mut args = vec![
            "apply",
            "--server-side",
            &manager,
            // A test re-applying a fixture it changed by hand means it.
            "--force-conflicts",
            "-o",
            "json",
            "-f",
            "-",
        ];
        if dry_run {
            args.push("--dry-run=server");
        }
        let out: Value = serde_json::from_str(&self.kubectl_stdin(&args, yaml)?)
            .context("parsing kubectl apply's output")?;
        // One object prints as itself, several as a List.
        Ok(match out.get("kind").and_then(Value::as_str) {
            Some("List") => out["items"].as_array().cloned().unwrap_or_default(),
            _ => vec![out],
        })
    }

    /// A kubeconfig authenticating as the service account `namespace/name` with a token from the
    /// TokenRequest API (valid for an hour), for testing what RBAC lets that account do. The
    /// account must exist.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let token = self.kubectl(&[
            "create",
            "token",
            name,
            "--namespace",
            namespace,
            "--duration=1h",
        ])?;
        let path = self.dir.join(format!("sa-{namespace}-{name}.kubeconfig"));
        let user = format!("    token: {}\n", token.trim());
        fs::write(
            &path,
            self.kubeconfig_text(&format!("{namespace}-{name}"), &user)?,
        )?;
        Ok(path)
    }

    /// A kubeconfig authenticating with a client certificate (issued by the cluster's CA, valid
    /// two days) as user `user` in `group`, as kubeadm gives kube-proxy (`system:kube-proxy`,
    /// which the bootstrap ClusterRoleBinding `system:node-proxier` binds to its role). One group
    /// only: rcgen's subject holds each attribute type once, and the apiserver reads the groups
    /// from the O attributes.
    pub fn client_cert_kubeconfig(&self, user: &str, group: &str) -> Result<PathBuf> {
        let file: String = user
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        // Numbered: kube-proxies started at once each get their own files.
        let name = format!("client-{file}-{}", crate::sys::next_id());
        let (cert, key) = issue_client_cert(&self.dir, user, group)?;
        write_cert(&self.dir, &name, &cert, &key)?;
        let user_entry = format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            base64(cert.as_bytes()),
            base64(key.as_bytes()),
        );
        let path = self.dir.join(format!("{name}.kubeconfig"));
        fs::write(&path, self.kubeconfig_text(&file, &user_entry)?)?;
        Ok(path)
    }

    fn kubeconfig_text(&self, user_name: &str, user: &str) -> Result<String> {
        let ca = base64(&fs::read(self.ca_cert_path())?);
        Ok(format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: svc-test\n  \
               cluster:\n    \
                 server: {server}\n    \
                 certificate-authority-data: {ca}\n\
             users:\n\
             - name: {user_name}\n  \
               user:\n{user}\
             contexts:\n\
             - name: svc-test\n  \
               context:\n    \
                 cluster: svc-test\n    \
                 user: {user_name}\n\
             current-context: svc-test\n",
            server = self.server_url(),
        ))
    }

    fn write_admin_kubeconfig(&self) -> Result<()> {
        // Written once the port is known; the port stays the same across apiserver restarts.
        let user = format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            base64(&fs::read(self.dir.join("admin.crt"))?),
            base64(&fs::read(self.dir.join("admin.key"))?),
        );
        fs::write(&self.kubeconfig, self.kubeconfig_text("admin", &user)?)?;
        Ok(())
    }

    /// A CA; a serving certificate for 127.0.0.1 and localhost; an admin client certificate in
    /// `system:masters`; a service-account signing key pair. P-256 keys: fast to make, and
    /// accepted everywhere Kubernetes takes a key. Files as the apiserver's flags name them:
    /// PEM certificates, PKCS#8 private keys, an SPKI public key.
    fn make_pki(&self) -> Result<()> {
        let d = &self.dir;
        let ca_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let ca = ca_params().self_signed(&ca_key)?;
        write_cert(d, "ca", &ca.pem(), &ca_key.serialize_pem())?;

        let issuer = Issuer::new(ca_params(), ca_key);
        let mut apiserver = leaf_params(ExtendedKeyUsagePurpose::ServerAuth);
        apiserver
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        apiserver.subject_alt_names = vec![
            SanType::IpAddress(Ipv4Addr::LOCALHOST.into()),
            SanType::DnsName("localhost".try_into()?),
        ];
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let cert = apiserver.signed_by(&key, &issuer)?;
        write_cert(d, "apiserver", &cert.pem(), &key.serialize_pem())?;

        let (cert, key) = issue_client_cert(d, "svc-admin", "system:masters")?;
        write_cert(d, "admin", &cert, &key)?;

        let sa = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        write_private(&d.join("sa.key"), &sa.serialize_pem())?;
        fs::write(d.join("sa.pub"), sa.public_key_pem())?;
        Ok(())
    }

    fn start_etcd(&mut self) -> Result<()> {
        let log = self.dir.join("etcd.log");
        for attempt in 1..=PORT_ATTEMPTS {
            let (client, peer) = (free_port()?, free_port()?);
            let client_url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let mut cmd = Command::new(&self.bins.etcd);
            cmd.arg("--name=svc-test")
                .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
                // Plain HTTP on loopback: only this test's processes can reach it.
                .arg(format!("--listen-client-urls={client_url}"))
                .arg(format!("--advertise-client-urls={client_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=svc-test={peer_url}"))
                .arg("--initial-cluster-state=new")
                // The data is thrown away with the test; fsync per write would only slow the
                // apiserver's start (it writes a few hundred bootstrap objects).
                .arg("--unsafe-no-fsync")
                .arg("--log-level=warn");
            let mut child = spawn(cmd, &log)?;
            let ready = wait_until(&mut child, "etcd", &log, ETCD_READY_TIMEOUT, || {
                etcd_healthy(client)
            });
            // Owned by self before anything can return, so that Drop stops it.
            self.etcd = Some(child);
            match ready {
                Ok(()) => {
                    self.etcd_url = client_url;
                    return Ok(());
                }
                Err(e) if attempt < PORT_ATTEMPTS && port_taken(&log) => {
                    eprintln!("etcd: a port was taken meanwhile, trying others: {e:#}");
                    if let Some(child) = self.etcd.take() {
                        stop(child, "etcd")?;
                    }
                    // A fresh data directory: the failed member may have written one.
                    let _ = fs::remove_dir_all(self.dir.join("etcd"));
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    fn apiserver_args(&self) -> Vec<OsString> {
        let d = &self.dir;
        let path = |name: &str| d.join(name).into_os_string();
        let mut args: Vec<OsString> = vec![
            format!("--secure-port={}", self.port).into(),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--etcd-servers={}", self.etcd_url).into(),
            format!("--service-cluster-ip-range={SERVICE_CIDRS}").into(),
            // RBAC only: what a user may do is what its roles grant, as on a real cluster
            // (no Node authorizer: no kubelets here).
            "--authorization-mode=RBAC".into(),
            // The issuer a cluster's service-account tokens usually carry.
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            // The endpoint reconciler would publish 127.0.0.1 as the `kubernetes` Service's
            // endpoint, which Endpoints validation rejects (loopback): it only logs errors.
            "--endpoint-reconciler-type=none".into(),
            "--profiling=false".into(),
            // As on every real cluster (kubeadm, kind, managed ones set it): node agents such
            // as kube-proxy and svc-agent's bpffs init container are privileged, and the
            // default (false) rejects their DaemonSets.
            "--allow-privileged=true".into(),
        ];
        for (flag, file) in [
            ("--client-ca-file", "ca.crt"),
            ("--tls-cert-file", "apiserver.crt"),
            ("--tls-private-key-file", "apiserver.key"),
            ("--service-account-key-file", "sa.pub"),
            ("--service-account-signing-key-file", "sa.key"),
            // Unused with the files above; named so that nothing is written outside `dir`.
            ("--cert-dir", "apiserver-certs"),
        ] {
            let mut arg = OsString::from(format!("{flag}="));
            arg.push(path(file));
            args.push(arg);
        }
        args.extend(self.extra_args.iter().map(OsString::from));
        args
    }

    fn start_apiserver(&mut self) -> Result<()> {
        let log = self.dir.join("kube-apiserver.log");
        // A restart keeps its port; a first start looks for a free one.
        let restart = self.port != 0;
        let deadline = Instant::now() + APISERVER_READY_TIMEOUT;
        for attempt in 1..=PORT_ATTEMPTS {
            if !restart {
                self.port = free_port()?;
                self.write_admin_kubeconfig()?;
            }
            let mut cmd = Command::new(&self.bins.kube_apiserver);
            cmd.args(self.apiserver_args());
            let mut child = spawn(cmd, &log)?;
            let ready = wait_until(
                &mut child,
                "kube-apiserver",
                &log,
                deadline.saturating_duration_since(Instant::now()),
                || self.apiserver_ready_probe(),
            );
            // Owned by self before anything can return, so that Drop stops it.
            self.apiserver = Some(child);
            match ready {
                Ok(()) => return self.wait_for_bootstrap(deadline),
                Err(e) if attempt < PORT_ATTEMPTS && port_taken(&log) => {
                    eprintln!("kube-apiserver: its port was taken meanwhile, retrying: {e:#}");
                    if let Some(child) = self.apiserver.take() {
                        stop(child, "kube-apiserver")?;
                    }
                    if restart {
                        // The port is ours to keep; whoever took it may let go soon.
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// `/readyz` through kubectl, with the admin certificate: ok once every post-start hook
    /// (RBAC bootstrap roles, system namespaces, ...) finished and etcd answers.
    fn apiserver_ready_probe(&self) -> bool {
        self.kubectl(&["get", "--raw=/readyz", "--request-timeout=5s"])
            .is_ok_and(|out| out.trim() == "ok")
    }

    /// What a test does first must not race the apiserver's own bootstrap, which `/readyz`
    /// does not cover: the `default` namespace, and the default ServiceCIDR object that
    /// ClusterIPs are allocated from.
    fn wait_for_bootstrap(&mut self, deadline: Instant) -> Result<()> {
        let log = self.dir.join("kube-apiserver.log");
        // Out of self while the probe borrows self; back before anything can return.
        let mut child = self
            .apiserver
            .take()
            .context("kube-apiserver is not running")?;
        let result = wait_until(
            &mut child,
            "kube-apiserver bootstrap",
            &log,
            deadline.saturating_duration_since(Instant::now()),
            || {
                self.get_json(&["namespace", "default"]).is_ok()
                    && self
                        .get_json(&["servicecidr", "kubernetes"])
                        .is_ok_and(|cidr| condition_true(&cidr, "Ready"))
            },
        );
        self.apiserver = Some(child);
        result
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        // The apiserver first: it would otherwise spend its stop retrying etcd.
        let apiserver = self.apiserver.take().map(|c| stop(c, "kube-apiserver"));
        let etcd = self.etcd.take().map(|c| stop(c, "etcd"));
        if std::env::var_os("SVC_CONTROL_PLANE_KEEP").is_some() {
            eprintln!("control plane directory kept: {}", self.dir.display());
        } else if self.dir.exists() {
            fs::remove_dir_all(&self.dir)
                .with_context(|| format!("removing {}", self.dir.display()))?;
        }
        apiserver.transpose()?;
        etcd.transpose()?;
        Ok(())
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The logs go with the directory: show their ends beside the failure.
            for name in ["kube-apiserver.log", "etcd.log"] {
                let path = self.dir.join(name);
                if path.exists() {
                    eprintln!("--- last lines of {name} ---\n{}", tail(&path, 30));
                }
            }
        }
        if let Err(e) = self.shutdown() {
            eprintln!("stopping the control plane: {e:#}");
        }
    }
}

fn condition_true(object: &Value, kind: &str) -> bool {
    object["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == kind && c["status"] == "True")
}

/// Certificates are good for two days from now: longer than any test run, short enough that a
/// leaked directory's keys soon open nothing.
const CERT_VALIDITY: time::Duration = time::Duration::days(2);

/// The CA's parameters. Issuing later (`client_cert_kubeconfig`) builds them again with the key
/// read back from `ca.key`: the issuer name and key identifier follow from these and the key.
fn ca_params() -> CertificateParams {
    let mut params = validity(CertificateParams::default());
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "svc-test-ca");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

/// An end-entity certificate's parameters for `usage`, with an empty subject: CA:FALSE (critical),
/// digitalSignature (critical), the key identifiers of the issuer and the subject.
fn leaf_params(usage: ExtendedKeyUsagePurpose) -> CertificateParams {
    let mut params = validity(CertificateParams::default());
    params.distinguished_name = DistinguishedName::new();
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    params
}

fn validity(mut params: CertificateParams) -> CertificateParams {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now;
    params.not_after = now + CERT_VALIDITY;
    params
}

/// A client certificate and its key (PEM) for `user` in `group`, issued by the CA in `dir`. The
/// apiserver takes O as the group and CN as the user name.
fn issue_client_cert(dir: &Path, user: &str, group: &str) -> Result<(String, String)> {
    let ca_key = fs::read_to_string(dir.join("ca.key")).context("reading ca.key")?;
    let issuer = Issuer::new(ca_params(), KeyPair::from_pem(&ca_key)?);
    let mut params = leaf_params(ExtendedKeyUsagePurpose::ClientAuth);
    params
        .distinguished_name
        .push(DnType::OrganizationName, group);
    params.distinguished_name.push(DnType::CommonName, user);
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// `NAME.crt` and `NAME.key` in `dir`.
fn write_cert(dir: &Path, name: &str, cert: &str, key: &str) -> Result<()> {
    fs::write(dir.join(format!("{name}.crt")), cert)?;
    write_private(&dir.join(format!("{name}.key")), key)
}

/// A file only its owner can read, created so from the start.
fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))
}

const DIR_PREFIX: &str = "svc-control-plane-";

/// A directory of our own under the system's temporary directory, private to its owner:
/// `svc-control-plane-<pid>-<n>`.
fn temp_dir() -> Result<PathBuf> {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    remove_stale_dirs();
    let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{n}", std::process::id()));
    // A leftover of an earlier process with the same pid is stale: nothing of ours uses it.
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

/// Removes the directories of test processes that were killed outright (their processes died
/// with them, see `sys::die_with_parent`; their directories stayed). Only directories whose owning
/// process is gone are touched.
fn remove_stale_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let owner = name
            .to_str()
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok());
        if owner.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// A port nothing listens on now. Another process may take it before the server binds it;
/// the callers retry then (see `port_taken`).
fn free_port() -> Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding a port on 127.0.0.1")?;
    Ok(listener.local_addr()?.port())
}

fn port_taken(log: &Path) -> bool {
    tail(log, 50).contains("address already in use")
}

fn spawn(mut cmd: Command, log: &Path) -> Result<Child> {
    let mut file = OpenOptions::new().create(true).append(true).open(log)?;
    // Appended, so that a restart's log follows the first run's.
    writeln!(file, "=== svc-tests: starting {:?}", cmd.get_program())?;
    let err = file.try_clone()?;
    cmd.stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        // Only what we pass: no ETCD_* or proxy variables from the test's environment.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default());
    crate::sys::die_with_parent(&mut cmd);
    let program = cmd.get_program().to_string_lossy().into_owned();
    spawn_from_lasting_thread(cmd).with_context(|| format!("spawning {program}"))
}

/// Spawns `cmd` from a thread that lives as long as this process. PR_SET_PDEATHSIG fires when
/// the *thread* that forked the child exits: spawned from a test's thread, etcd and
/// kube-apiserver would die when that thread ends, although the control plane may be shared
/// with tests still running on other threads (a test harness's worker threads end one by one
/// as the work runs out).
fn spawn_from_lasting_thread(cmd: Command) -> std::io::Result<Child> {
    use std::sync::{mpsc, OnceLock};
    type Job = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (jobs, incoming) = mpsc::channel::<Job>();
        // Never joined: the sender above is never dropped, so the loop never ends.
        std::thread::Builder::new()
            .name("svc-cp-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in incoming {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("starting the control plane's spawner thread");
        jobs
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .send((cmd, reply))
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?
}

/// Polls `ready` until it holds, failing early with the log's end if the process exits, or at
/// the timeout.
fn wait_until(
    child: &mut Child,
    what: &str,
    log: &Path,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "{what} exited ({status}); end of {}:\n{}",
                log.display(),
                tail(log, 30)
            );
        }
        if ready() {
            return Ok(());
        }
        crate::interrupt::check()?;
        if Instant::now() >= deadline {
            bail!(
                "{what} not ready within {timeout:?}; end of {}:\n{}",
                log.display(),
                tail(log, 30)
            );
        }
        std::thread::sleep(POLL);
    }
}

/// etcd's `/health` over plain HTTP/1.1 on loopback.
fn etcd_healthy(port: u16) -> bool {
    let probe = || -> std::io::Result<String> {
        let mut s = TcpStream::connect_timeout(
            &(Ipv4Addr::LOCALHOST, port).into(),
            Duration::from_secs(1),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
        let mut response = String::new();
        s.read_to_string(&mut response)?;
        Ok(response)
    };
    probe().is_ok_and(|r| r.starts_with("HTTP/1.1 200") && r.contains(r#""health":"true""#))
}

/// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]; reaps the process either way.
fn stop(mut child: Child, what: &str) -> Result<()> {
    if child.try_wait()?.is_some() {
        return Ok(());
    }
    let pid = libc::pid_t::try_from(child.id())?;
    // SAFETY: kill has no memory-safety preconditions; the pid is our unreaped child's, so it
    // cannot have been reused by another process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + STOP_TIMEOUT;
    while Instant::now() < deadline {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("{what} (pid {pid}) ignored SIGTERM for {STOP_TIMEOUT:?}: SIGKILL");
    child.kill()?;
    child.wait()?;
    Ok(())
}

/// The last `lines` lines of a file, or a note that it could not be read.
fn tail(path: &Path, lines: usize) -> String {
    let mut text = String::new();
    if File::open(path)
        .and_then(|mut f| f.read_to_string(&mut text))
        .is_err()
    {
        return format!("({} unreadable)", path.display());
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Standard base64 with padding, for the certificates embedded in kubeconfigs.
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected);
        }
    }

    #[test]
    fn missing_binaries_say_how_to_build_them() {
        let err = binary("SVC_TEST_SURELY_UNSET_VARIABLE").unwrap_err();
        assert!(format!("{err:#}").contains("cargo xtask control-plane"));
    }
}
