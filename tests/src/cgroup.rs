//! A cgroup v2 directory of our own, for the agent to attach to and the clients to run in.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::sys::{cgroup2_mount, signal, unique_name};

#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup2 mount>/svc-test-PID-N`.
    pub fn new() -> Result<Self> {
        let path = cgroup2_mount()?.join(unique_name("svc-test"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file a process writes its pid to in order to join.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// The path as `/proc/PID/cgroup` shows it for a member ("0::/svc-test-...").
    pub fn relative(&self) -> String {
        format!(
            "/{}",
            self.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        )
    }

    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.procs_file())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Every process in this cgroup is one the harness put there (clients we spawned), and
        // their own guards have normally reaped them already; anything left is killed by pid
        // so the directory can go.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids();
            for pid in &pids {
                let _ = signal(*pid, libc::SIGKILL);
            }
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e) if Instant::now() >= deadline => {
                    eprintln!(
                        "svc-tests: removing cgroup {} (pids {pids:?}): {e}",
                        self.path.display()
                    );
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}
