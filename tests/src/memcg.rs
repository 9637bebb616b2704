//! A memory cgroup of our own, as a pod's: what a container's memory limit applies to is the
//! cgroup's usage, which counts the kernel memory the agent's BPF maps take (charged to the
//! cgroup of the process that creates them) on top of its resident memory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::sys::{cgroup2_mount, unique_name};

#[derive(Debug)]
pub struct MemCgroup {
    path: PathBuf,
    /// cgroup v1's memory hierarchy (memory.max_usage_in_bytes), else v2 (memory.peak).
    v1: bool,
}

/// Memory of the cgroup, bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemUsage {
    pub usage: u64,
    pub peak: u64,
    /// Kernel memory in `usage` (the maps, programs, BTF; page tables, sockets).
    pub kernel: u64,
}

impl MemCgroup {
    /// A new memory cgroup: v1's `memory` hierarchy where it is mounted, else the v2 one.
    pub fn new() -> Result<Self> {
        let v1 = Path::new("/sys/fs/cgroup/memory/cgroup.procs").exists();
        let root = if v1 {
            PathBuf::from("/sys/fs/cgroup/memory")
        } else {
            let root = cgroup2_mount()?;
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers"))?;
            if !controllers.split_whitespace().any(|c| c == "memory") {
                bail!("no memory controller in {}", root.display());
            }
            root
        };
        let path = root.join(unique_name("svc-memcg"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path, v1 })
    }

    /// A launcher (`Agent::start_launched`) that moves the process into this cgroup before it
    /// execs the agent: the agent's first allocation, and every map it creates, is charged here.
    pub fn launcher(&self) -> Vec<OsString> {
        let procs = self.path.join("cgroup.procs");
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo $$ > '{}' && exec \"$@\"", procs.display()).into(),
            "sh".into(),
        ]
    }

    fn read(&self, file: &str) -> Result<u64> {
        let p = self.path.join(file);
        let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        s.trim()
            .parse()
            .with_context(|| format!("{}: {s:?}", p.display()))
    }

    fn stat(&self, key: &str) -> Result<u64> {
        let p = self.path.join("memory.stat");
        let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        s.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
            .with_context(|| format!("no {key} in {}", p.display()))
    }

    pub fn usage(&self) -> Result<MemUsage> {
        if self.v1 {
            Ok(MemUsage {
                usage: self.read("memory.usage_in_bytes")?,
                peak: self.read("memory.max_usage_in_bytes")?,
                kernel: self.read("memory.kmem.usage_in_bytes")?,
            })
        } else {
            Ok(MemUsage {
                usage: self.read("memory.current")?,
                peak: self.read("memory.peak")?,
                kernel: self.stat("kernel")?,
            })
        }
    }
}

impl MemCgroup {
    /// Caps the cgroup's memory, as a container's limit does (`None`: no limit).
    pub fn set_limit(&self, bytes: Option<u64>) -> Result<()> {
        let (file, value) = match (self.v1, bytes) {
            (true, Some(b)) => ("memory.limit_in_bytes", b.to_string()),
            (true, None) => ("memory.limit_in_bytes", "-1".to_string()),
            (false, Some(b)) => ("memory.max", b.to_string()),
            (false, None) => ("memory.max", "max".to_string()),
        };
        let p = self.path.join(file);
        std::fs::write(&p, &value).with_context(|| format!("writing {value} to {}", p.display()))
    }

    /// How many processes the cgroup's OOM killer has killed.
    pub fn oom_kills(&self) -> Result<u64> {
        let file = if self.v1 {
            "memory.oom_control"
        } else {
            "memory.events"
        };
        let p = self.path.join(file);
        let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        // Kernels before 4.19 (v1) have no such line: no kill was counted.
        Ok(s.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0))
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        // Its one process is the agent, whose own guard ends it; removal waits for that.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.path).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
