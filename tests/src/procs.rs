//! Probe processes: backend servers in the backend namespace, clients in the test cgroup and
//! the client namespace. Each is a guard that kills its process (by pid) on drop.

use std::{
    io::{BufRead, BufReader, Read},
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;

use crate::{cgroup::TestCgroup, interrupt, netns::NetNs, sys::die_with_parent};

/// How long a backend may take to bind and say `ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// A `svc-probe serve` process.
#[derive(Debug)]
pub struct Backend {
    child: Child,
    name: String,
    listens: Vec<SocketAddr>,
}

impl Backend {
    /// Starts `svc-probe serve` in `ns` listening (TCP and UDP) on every address, and returns
    /// once it printed `ready`, that is once every socket is bound.
    pub fn start(probe: &Path, ns: &NetNs, name: &str, listens: &[SocketAddr]) -> Result<Self> {
        Self::start_with(probe, ns, name, listens, &[])
    }

    /// `start` with more `svc-probe serve` flags (`--threads N`).
    pub fn start_with(
        probe: &Path,
        ns: &NetNs,
        name: &str,
        listens: &[SocketAddr],
        extra: &[&str],
    ) -> Result<Self> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns.name()])
            .arg(probe)
            .args(["serve", "--name", name, "--tcp", "--udp"])
            .args(extra);
        for l in listens {
            cmd.arg("--listen").arg(l.to_string());
        }
        die_with_parent(&mut cmd);
        // `ip netns exec` execs the probe, so the child's pid is the probe's own.
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning svc-probe serve")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut backend = Self {
            child,
            name: name.to_owned(),
            listens: listens.to_vec(),
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let deadline = Instant::now() + READY_TIMEOUT;
        // In slices, so that a stop requested meanwhile ends the wait.
        let line = loop {
            interrupt::check()?;
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => break line,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => bail!("backend {name} not ready within {READY_TIMEOUT:?}"),
            }
        };
        if line.trim() == "ready" {
            return Ok(backend);
        }
        let status = backend.child.try_wait().ok().flatten();
        bail!("backend {name} did not start: said {line:?}, exit {status:?}")
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn listens(&self) -> &[SocketAddr] {
        &self.listens
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // Child::kill sends SIGKILL to exactly this pid.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A probe client running in the test cgroup and the client namespace.
#[derive(Debug)]
pub struct ClientRun {
    child: Option<Child>,
    stdout: mpsc::Receiver<Vec<u8>>,
    stderr: mpsc::Receiver<Vec<u8>>,
    what: String,
}

impl ClientRun {
    /// Spawns `svc-probe ARGS` in `cgroup` and `ns`. The process joins the cgroup first, then
    /// enters the namespace: `ip netns exec` remounts /sys, after which the cgroup directory is
    /// no longer reachable by path.
    pub fn spawn(probe: &Path, cgroup: &TestCgroup, ns: &NetNs, args: &[String]) -> Result<Self> {
        let script =
            r#"cg="$1"; ns="$2"; shift 2; echo $$ > "$cg" && exec ip netns exec "$ns" "$@""#;
        let mut cmd = Command::new("sh");
        die_with_parent(&mut cmd);
        let mut child = cmd
            .arg("-c")
            .arg(script)
            .arg("sh")
            .arg(cgroup.procs_file())
            .arg(ns.name())
            .arg(probe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning client probe")?;
        // Drain both pipes in threads so a chatty probe never blocks on a full pipe.
        let stdout = drain(child.stdout.take().context("no stdout")?);
        let stderr = drain(child.stderr.take().context("no stderr")?);
        Ok(Self {
            child: Some(child),
            stdout,
            stderr,
            what: format!("svc-probe {}", args.join(" ")),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Waits for the probe to exit (killing it after `timeout`) and returns its stdout.
    pub fn wait_raw(mut self, timeout: Duration) -> Result<Vec<u8>> {
        let mut child = self.child.take().context("already waited")?;
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if let Err(e) = interrupt::check() {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("`{}` still running after {timeout:?}; killed", self.what);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let out = self
            .stdout
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_default();
        let err = self
            .stderr
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_default();
        if !status.success() {
            bail!(
                "`{}` failed ({status}): {}",
                self.what,
                String::from_utf8_lossy(&err).trim()
            );
        }
        Ok(out)
    }

    /// Waits, then parses stdout as JSON.
    pub fn wait<T: DeserializeOwned>(self, timeout: Duration) -> Result<T> {
        let what = self.what.clone();
        let out = self.wait_raw(timeout)?;
        serde_json::from_slice(&out).with_context(|| {
            format!(
                "parsing output of `{what}`: {:?}",
                String::from_utf8_lossy(&out)
            )
        })
    }
}

impl Drop for ClientRun {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn drain(mut r: impl Read + Send + 'static) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        let _ = tx.send(buf);
    });
    rx
}
