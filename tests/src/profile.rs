//! `svc-nodeport-bench --profile DIR`: where the CPU time of a measure goes. Around each measure
//! it reads the run count and run time (bpf_stats) of svc's attached programs (none in the
//! other setups), the machine's CPU time from /proc/stat, and records a
//! `perf record -a -g` profile (software cpu-clock: this machine has no hardware counters).

use std::fs::File;
use std::io::Write as _;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// Run-time statistics of every BPF program while this lives. BPF_ENABLE_STATS rather than the
/// sysctl: the kernel counts holders, and the fd closes with the process however it ends, so
/// nothing is left to restore and another holder is never switched off.
pub struct BpfStats {
    _fd: OwnedFd,
}

impl BpfStats {
    pub fn enable() -> Result<BpfStats> {
        const BPF_ENABLE_STATS: libc::c_long = 32;
        // union bpf_attr { struct { __u32 type; } enable_stats; }, BPF_STATS_RUN_TIME = 0.
        let attr = [0u8; 8];
        // SAFETY: a bpf(2) call with a zeroed attribute buffer of the size given.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_ENABLE_STATS,
                attr.as_ptr(),
                attr.len() as libc::c_uint,
            )
        };
        if fd < 0 {
            bail!("BPF_ENABLE_STATS: {}", std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us alone.
        Ok(BpfStats {
            _fd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
        })
    }
}

/// (run_cnt, run_time_ns) summed over the programs of the links pinned under `pins` (svc's
/// bpffs directory), and their names. bpftool 7.1 lists no tcx attachments in `net show`, so
/// the programs are found through svc's own link pins.
fn prog_stats(pins: Option<&Path>) -> Result<(u64, u64, Vec<String>)> {
    let mut files = Vec::new();
    let mut dirs: Vec<PathBuf> = pins.into_iter().map(Path::to_path_buf).collect();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)?.flatten() {
            if e.file_type()?.is_dir() {
                dirs.push(e.path());
            } else {
                files.push(e.path());
            }
        }
    }
    let (mut cnt, mut ns, mut names) = (0, 0, Vec::new());
    for f in files {
        let out = Command::new("bpftool")
            .args(["-j", "link", "show", "pinned"])
            .arg(&f)
            .output()?;
        let Ok(link) = serde_json::from_slice::<Value>(&out.stdout) else {
            continue; // a map pin, not a link
        };
        let Some(id) = link["prog_id"].as_u64() else {
            continue;
        };
        let out = Command::new("bpftool")
            .args(["-j", "prog", "show", "id", &id.to_string()])
            .output()?;
        let p: Value = serde_json::from_slice(&out.stdout).context("bpftool prog show output")?;
        cnt += p["run_cnt"].as_u64().unwrap_or(0);
        ns += p["run_time_ns"].as_u64().unwrap_or(0);
        names.push(p["name"].as_str().unwrap_or("?").to_string());
    }
    Ok((cnt, ns, names))
}

/// (run_cnt, run_time_ns) of svc's programs linked under `pins` (both 0 unless `BpfStats`
/// is held): what a measure reads before and after itself.
pub fn program_time(pins: &Path) -> Result<(u64, u64)> {
    let (cnt, ns, _) = prog_stats(Some(pins))?;
    Ok((cnt, ns))
}

/// /proc/stat: the jiffies of all CPUs (user nice system idle iowait irq softirq steal ...),
/// and the number of CPUs.
pub(crate) fn cpu_stat() -> Result<(Vec<u64>, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    if f.len() < 8 {
        bail!("/proc/stat: a cpu line of {} fields", f.len());
    }
    let cpus = stat
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count() as u64;
    Ok((f, cpus.max(1)))
}

/// Softirq jiffies of all CPUs (sampled at the tick: a share, not an exact time).
fn softirq_jiffies() -> Result<u64> {
    Ok(cpu_stat()?.0[6])
}

/// CPU time all CPUs spend busy between `CpuClock::start` and `CpuClock::busy_s`: the
/// wall-clock time times the CPUs, less what /proc/stat counts idle, iowait and steal (time
/// the hypervisor gave to others). Not /proc/stat's user, system and softirq counts: they are
/// sampled at the timer tick, and a load paced by timers of its own (`svc-probe loop
/// --rate`) aliases with it (measures of one path spread over 28-175 µs a connection); idle
/// time is measured at each entry to and exit from idle (NO_HZ).
pub struct CpuClock {
    wall: Instant,
    idle: u64,
    cpus: u64,
}

impl CpuClock {
    pub fn start() -> Result<CpuClock> {
        let (idle, cpus) = idle_jiffies()?;
        Ok(CpuClock {
            wall: Instant::now(),
            idle,
            cpus,
        })
    }

    /// CPU seconds since `start`, busy or not: the wall-clock time times the CPUs.
    pub fn total_s(&self) -> f64 {
        self.wall.elapsed().as_secs_f64() * self.cpus as f64
    }

    /// Busy CPU seconds since `start`.
    pub fn busy_s(&self) -> Result<f64> {
        let wall = self.wall.elapsed().as_secs_f64();
        let (idle, _) = idle_jiffies()?;
        // USER_HZ: 100 jiffies a second.
        Ok((wall * self.cpus as f64 - (idle - self.idle) as f64 / 100.0).max(0.0))
    }
}

/// Idle, iowait and steal jiffies of all CPUs since boot, and the number of CPUs.
fn idle_jiffies() -> Result<(u64, u64)> {
    let (f, cpus) = cpu_stat()?;
    Ok((f[3] + f[4] + f[7], cpus))
}

pub struct Profile {
    dir: PathBuf,
    label: String,
    pins: Option<PathBuf>,
    stats: (u64, u64),
    clock: CpuClock,
    softirq: u64,
    perf: Option<Child>,
    started: Instant,
}

impl Profile {
    pub fn start(
        dir: &Path,
        label: String,
        pins: Option<PathBuf>,
        seconds: u64,
    ) -> Result<Profile> {
        std::fs::create_dir_all(dir)?;
        let (c, n, _) = prog_stats(pins.as_deref())?;
        let mut perf = Command::new("perf");
        crate::sys::die_with_parent(&mut perf);
        let perf = perf
            .args(["record", "-q", "-a", "-g", "-F", "499", "-o"])
            .arg(dir.join(format!("{label}.perf.data")))
            .args(["--", "sleep", &seconds.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        Ok(Profile {
            dir: dir.to_path_buf(),
            label,
            pins,
            stats: (c, n),
            clock: CpuClock::start()?,
            softirq: softirq_jiffies()?,
            perf,
            started: Instant::now(),
        })
    }

    /// Ends the profile of a measure that made `ok` exchanges; one line to print.
    pub fn finish(mut self, ok: u64) -> Result<String> {
        let wall = self.started.elapsed().as_secs_f64();
        let busy_s = self.clock.busy_s()?;
        let total_s = self.clock.total_s();
        let softirq = softirq_jiffies()?;
        let (c, n, names) = prog_stats(self.pins.as_deref())?;
        if let Some(p) = self.perf.as_mut() {
            p.wait()?;
        }
        let hz = 100.0; // USER_HZ
        let softirq_s = (softirq - self.softirq) as f64 / hz;
        let (runs, ns) = (c - self.stats.0, n - self.stats.1);
        let row = json!({
            "label": self.label,
            "ok": ok,
            "wall_s": wall,
            "cpu_total_s": total_s,
            "cpu_busy_s": busy_s,
            "cpu_softirq_s": softirq_s,
            "bpf_runs": runs,
            "bpf_ns": ns,
            "bpf_programs": names,
        });
        let mut f = File::options()
            .create(true)
            .append(true)
            .open(self.dir.join("profile.jsonl"))?;
        writeln!(f, "{row}")?;
        let per = |x: f64| if ok > 0 { x / ok as f64 } else { 0.0 };
        Ok(format!(
            "bpf {runs} runs {:.0} ns/run, {:.0} ns/exchange, {:.2}% of CPU; machine busy {:.1}% ({:.1} µs/exchange, softirq {:.1} µs/exchange)",
            if runs > 0 { ns as f64 / runs as f64 } else { 0.0 },
            per(ns as f64),
            100.0 * ns as f64 / 1e9 / total_s.max(1e-9),
            100.0 * busy_s / total_s.max(1e-9),
            per(busy_s * 1e6),
            per(softirq_s * 1e6),
        ))
    }
}

impl Drop for Profile {
    /// A measure that failed or was interrupted: perf is stopped now rather than at the end of
    /// its `sleep`. SIGINT, as to a perf in a terminal: it ends its workload and closes the file.
    fn drop(&mut self) {
        let Some(p) = self.perf.as_mut() else {
            return;
        };
        if let Ok(None) = p.try_wait() {
            let _ = crate::sys::signal(p.id(), libc::SIGINT);
            let deadline = Instant::now() + std::time::Duration::from_secs(5);
            while matches!(p.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}
