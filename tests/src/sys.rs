//! Small system helpers: unique names, running commands, finding mounts and binaries.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicU32, Ordering},
        Mutex,
    },
};

use anyhow::{bail, Context, Result};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A number unique within this process; combined with the pid it is unique on the machine.
pub fn next_id() -> u32 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// `PREFIX-PID-N`, unique on the machine while this process lives.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), next_id())
}

/// Fails loudly when not root: these tests need CAP_BPF, CAP_NET_ADMIN and cgroup writes, and
/// a test that skips itself silently would report a pass it never earned.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "svc integration tests must run as root (they create network namespaces, cgroups and \
         attach BPF programs); euid is {euid}"
    );
}

/// Runs a command to completion; its stdout on success, an error naming the command and its
/// stderr otherwise.
pub fn run<I, S>(program: &str, args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let out = Command::new(program)
        .args(&args)
        .output()
        .with_context(|| format!("spawning {program}"))?;
    let shown = || {
        let a: Vec<_> = args.iter().map(|a| a.to_string_lossy()).collect();
        format!("{program} {}", a.join(" "))
    };
    if !out.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            shown(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `(device, mount point, fstype)` of every line of /proc/mounts.
fn mounts() -> Result<Vec<(String, String, String)>> {
    let text = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.into(), f.next()?.into(), f.next()?.into()))
        })
        .collect())
}

/// Where cgroup v2 is mounted. On this project's machines it is /sys/fs/cgroup/unified (a
/// hybrid hierarchy), elsewhere usually /sys/fs/cgroup, so it is looked up, not assumed.
pub fn cgroup2_mount() -> Result<PathBuf> {
    mounts()?
        .into_iter()
        .find(|(_, _, fstype)| fstype == "cgroup2")
        .map(|(_, dir, _)| PathBuf::from(dir))
        .context("no cgroup2 mount in /proc/mounts")
}

pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// Makes sure a bpf filesystem is mounted at /sys/fs/bpf (it is not at boot on these
/// machines). Serialized so parallel tests do not stack two mounts.
pub fn ensure_bpffs() -> Result<PathBuf> {
    static LOCK: Mutex<()> = Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mounted = mounts()?
        .iter()
        .any(|(_, dir, fstype)| dir == BPFFS_ROOT && fstype == "bpf");
    if !mounted {
        // As systemd and deploy/daemonset.yaml mount it (a bare mount is 1777).
        run(
            "mount",
            [
                "-t",
                "bpf",
                "-o",
                "mode=0700,nosuid,nodev,noexec",
                "bpf",
                BPFFS_ROOT,
            ],
        )?;
    }
    Ok(PathBuf::from(BPFFS_ROOT))
}

/// A directory under /tmp removed with its content on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            eprintln!("svc-tests: removing {}: {e}", self.path.display());
        }
    }
}

/// Paths of the binaries the harness runs.
#[derive(Clone, Debug)]
pub struct Tools {
    /// `svc-probe`.
    pub probe: PathBuf,
    /// `svc-agent`; need not exist until an agent is started.
    pub agent: PathBuf,
}

impl Tools {
    /// Finds the binaries: `SVC_PROBE_BIN` / `SVC_AGENT_BIN` when set, else next to the running
    /// executable (cargo puts test executables in `target/<profile>/deps` and binaries in
    /// `target/<profile>`), else `<workspace>/target/debug`.
    pub fn locate() -> Self {
        Self {
            probe: find_bin("SVC_PROBE_BIN", "svc-probe"),
            agent: find_bin("SVC_AGENT_BIN", "svc-agent"),
        }
    }

    /// Like `locate`, with the probe known exactly (integration tests get it from
    /// `env!("CARGO_BIN_EXE_svc-probe")`).
    pub fn with_probe(probe: impl Into<PathBuf>) -> Self {
        Self {
            probe: probe.into(),
            agent: find_bin("SVC_AGENT_BIN", "svc-agent"),
        }
    }
}

fn find_bin(env: &str, name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1).take(2) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/debug")
        .join(name)
}

/// User plus system CPU time of every thread of `pid` so far, from /proc/PID/stat.
pub fn cpu_time(pid: u32) -> Result<std::time::Duration> {
    // utime and stime: fields 14 and 15 of stat(5).
    stat_time(pid, 14..16)
}

/// The same, with the children `pid` has reaped (kube-proxy's iptables-restore and nft).
pub fn cpu_time_with_children(pid: u32) -> Result<std::time::Duration> {
    // utime, stime, cutime, cstime: fields 14 to 17 of stat(5).
    stat_time(pid, 14..18)
}

/// The sum of stat(5) fields `fields` (numbered from 1, clock ticks) of `pid`.
fn stat_time(pid: u32, fields: std::ops::Range<usize>) -> Result<std::time::Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces and parentheses: fields count from the last ')', and
    // what follows it starts at field 3.
    let rest = &stat[stat.rfind(')').context("malformed stat")? + 2..];
    let all: Vec<&str> = rest.split_whitespace().collect();
    let mut ticks = 0u64;
    for f in fields {
        // cutime and cstime are signed in stat(5).
        let v: i64 = all.get(f - 3).context("short stat")?.parse()?;
        ticks += v.max(0) as u64;
    }
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(std::time::Duration::from_micros(ticks * 1_000_000 / hz))
}

/// How `settle` ended.
#[derive(Debug, Clone, Copy)]
pub struct Settled {
    pub waited: std::time::Duration,
    /// False: `max` passed first.
    pub quiet: bool,
}

impl std::fmt::Display for Settled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "after {:.1} s waiting for a quiet machine{}",
            self.waited.as_secs_f64(),
            if self.quiet { "" } else { ", which it was not" }
        )
    }
}

/// Waits until processes `pids` together use less than a tenth of a core, and the machine as
/// a whole less than 15 % of its CPUs, over two one-second windows in a row, or until `max`
/// has passed. For benches: the API server digesting a bulk write, or the kernel freeing the
/// maps of an agent just stopped (a workqueue, no process of ours), would otherwise share the
/// cores with what is measured next.
pub fn settle(pids: &[u32], max: std::time::Duration) -> Result<Settled> {
    const WINDOW: std::time::Duration = std::time::Duration::from_secs(1);
    let sample = || -> Result<(std::time::Duration, u64, u64)> {
        let used = pids.iter().map(|&p| cpu_time(p)).sum::<Result<_>>()?;
        let (jiffies, _) = crate::profile::cpu_stat()?;
        // Of user nice system idle iowait irq softirq steal: all but idle and iowait are
        // busy. iowait may go backwards (proc(5)): the total is counted without it.
        let busy: u64 = [0, 1, 2, 5, 6, 7].iter().map(|&i| jiffies[i]).sum();
        Ok((used, busy, busy + jiffies[3]))
    };
    let started = std::time::Instant::now();
    let mut quiet = 0;
    let mut before = sample()?;
    while started.elapsed() < max {
        crate::interrupt::sleep(WINDOW)?;
        let now = sample()?;
        let ours = now.0.saturating_sub(before.0) < WINDOW / 10;
        let busy =
            now.1.saturating_sub(before.1) as f64 / now.2.saturating_sub(before.2).max(1) as f64;
        quiet = if ours && busy < 0.15 { quiet + 1 } else { 0 };
        before = now;
        if quiet == 2 {
            return Ok(Settled {
                waited: started.elapsed(),
                quiet: true,
            });
        }
    }
    Ok(Settled {
        waited: started.elapsed(),
        quiet: false,
    })
}

/// Sends `sig` to one process we started.
pub fn signal(pid: u32, sig: libc::c_int) -> std::io::Result<()> {
    // 0 would signal our whole process group: never.
    let pid = match libc::pid_t::try_from(pid) {
        Ok(p) if p > 0 => p,
        _ => return Err(std::io::Error::from_raw_os_error(libc::ESRCH)),
    };
    // SAFETY: kill has no memory arguments; pid is a specific process, never 0 or -1.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The pid in a harness name `PREFIX-PID-N`, if `name` is one with this prefix.
fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?.strip_prefix('-')?;
    let (pid, n) = rest.split_once('-')?;
    n.parse::<u32>().ok()?;
    pid.parse().ok()
}

/// The pid in any harness name under the temporary directory, `svc-…-PID-N` (every
/// `TempDir`, the control plane's and the manifests' directories).
fn temp_owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("svc-")?;
    let (rest, n) = rest.rsplit_once('-')?;
    let (prefix, pid) = rest.rsplit_once('-')?;
    if prefix.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes what harness runs that were killed outright (SIGKILL, a CI timeout: no drop guard
/// ran) left behind: namespaces, test cgroups, pin directories and manifest directories whose
/// owning process no longer exists. Anything whose owner is alive (another run in progress, or
/// a reused pid) is left alone, and so is a cgroup that still has processes. Returns what was
/// removed.
pub fn clean_stale(agent_bin: &Path) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    let netns = run("ip", ["netns", "list"])?;
    for name in netns.lines().filter_map(|l| l.split_whitespace().next()) {
        let pid = owner_pid(name, "svc-c").or_else(|| owner_pid(name, "svc-b"));
        if pid.is_some_and(|p| !alive(p)) && run("ip", ["netns", "del", name]).is_ok() {
            removed.push(format!("netns {name}"));
        }
    }
    let cg2 = cgroup2_mount()?;
    let bpffs_mounted = mounts()?
        .iter()
        .any(|(_, dir, fstype)| dir == BPFFS_ROOT && fstype == "bpf");
    if bpffs_mounted {
        for e in std::fs::read_dir(BPFFS_ROOT)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if owner_pid(&name, "svc-test").is_some_and(|p| !alive(p)) {
                let dir = e.path();
                if agent_bin.is_file() {
                    let _ = run(
                        &agent_bin.to_string_lossy(),
                        [
                            OsStr::new("uninstall"),
                            OsStr::new("--bpffs"),
                            dir.as_os_str(),
                        ],
                    );
                }
                if !dir.exists() || std::fs::remove_dir_all(&dir).is_ok() {
                    removed.push(format!("pins {}", dir.display()));
                }
            }
        }
    }
    // Test cgroups, and memory cgroups (memcg.rs: on cgroup v1's `memory` hierarchy where it
    // is mounted). A cgroup that still has processes is not removed (rmdir refuses it).
    let v1_memory = Path::new("/sys/fs/cgroup/memory");
    let roots = [cg2.as_path(), v1_memory];
    for root in roots.iter().filter(|r| r.join("cgroup.procs").exists()) {
        for e in std::fs::read_dir(root)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let owner = owner_pid(&name, "svc-test").or_else(|| owner_pid(&name, "svc-memcg"));
            if owner.is_some_and(|p| !alive(p)) && std::fs::remove_dir(e.path()).is_ok() {
                removed.push(format!("cgroup {}", e.path().display()));
            }
        }
    }
    for e in std::fs::read_dir(std::env::temp_dir())?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if temp_owner_pid(&name).is_some_and(|p| !alive(p))
            && std::fs::remove_dir_all(e.path()).is_ok()
        {
            removed.push(format!("dir {}", e.path().display()));
        }
    }
    Ok(removed)
}

/// Makes the child get SIGKILL when the thread that spawned it dies, so a harness killed
/// outright (no drop guard runs) leaves no backend, client or agent running. Kept across
/// the `sh` → `ip netns exec` → probe execs. The spawning thread is the test's own, which
/// outlives every guard it creates.
pub fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
    // syscalls (prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// `bpftool -j map show pinned PATH`: a pinned map's kernel view (max_entries, bytes_memlock).
pub fn pinned_map_info(path: &Path) -> Result<serde_json::Value> {
    let out = run(
        "bpftool",
        [
            "-j".as_ref(),
            "map".as_ref(),
            "show".as_ref(),
            "pinned".as_ref(),
            path.as_os_str(),
        ],
    )?;
    serde_json::from_str(&out).with_context(|| format!("bpftool's answer {out:?}"))
}

#[cfg(test)]
mod tests {

    /// The fields read are this process's CPU time: a spin of 200 ms shows, and a count read
    /// by mistake (page faults) would not stay under a minute.
    #[test]
    fn cpu_time_reads_the_cpu_fields() {
        // Spins until the process has used 300 ms of CPU by the kernel's own clock, however
        // long a loaded machine takes to give it that (CI once gave 200 ms of spinning less
        // than 100 ms of CPU).
        let process_cpu = || {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: ts is a valid timespec to write.
            assert_eq!(
                unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) },
                0
            );
            std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
        };
        let mut x = 0u64;
        while process_cpu() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let own = cpu_time(std::process::id()).unwrap();
        let with_children = cpu_time_with_children(std::process::id()).unwrap();
        let after = process_cpu();
        // stat(5) counts in clock ticks: a tick or two behind the clock at most.
        assert!(own >= std::time::Duration::from_millis(250), "{own:?}");
        assert!(
            own <= after + std::time::Duration::from_millis(50),
            "{own:?} > {after:?}"
        );
        assert!(with_children >= own, "{with_children:?} < {own:?}");
    }
    use super::{cpu_time, cpu_time_with_children, owner_pid, temp_owner_pid};

    #[test]
    fn temp_owner_pid_parses_every_harness_directory_name() {
        assert_eq!(temp_owner_pid("svc-nodeport-agent-123-4"), Some(123));
        assert_eq!(temp_owner_pid("svc-test-manifests-5-1"), Some(5));
        assert_eq!(temp_owner_pid("svc-control-plane-77-0"), Some(77));
        assert_eq!(temp_owner_pid("svc-kubeconfig-9-12"), Some(9));
        assert_eq!(temp_owner_pid("svc-123-4"), None);
        assert_eq!(temp_owner_pid("svc-agent-x-4"), None);
        assert_eq!(temp_owner_pid("svc-agent-1-x"), None);
        assert_eq!(temp_owner_pid("other-agent-1-2"), None);
        assert_eq!(temp_owner_pid("svc-agent-1-"), None);
    }

    #[test]
    fn owner_pid_parses_only_harness_names() {
        assert_eq!(owner_pid("svc-c-123-4", "svc-c"), Some(123));
        assert_eq!(owner_pid("svc-test-77-0", "svc-test"), Some(77));
        assert_eq!(owner_pid("svc-test-manifests-5-1", "svc-test"), None);
        assert_eq!(owner_pid("svc", "svc-test"), None);
        assert_eq!(owner_pid("svc-test-x-1", "svc-test"), None);
        assert_eq!(owner_pid("svc-c-1", "svc-c"), None);
    }
}
