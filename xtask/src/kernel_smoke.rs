//! `cargo xtask kernel-smoke`: svc on the kernels of the distributions people run, each in a
//! qemu VM: Debian 12's own (6.1: no tcx, so `--tc-attach auto` attaches classic cls_bpf
//! filters) and Ubuntu 22.04's GA kernel (5.15: no tcx, no `bpf_set_retval`, no
//! `bpf_xdp_load_bytes`, so the start check's fallbacks run on the kernel they were written
//! for).
//!
//! Debian's kernel package comes from Debian's archive (`apt-get download`), Ubuntu's two
//! (image and modules) from Ubuntu's, pinned with their SHA256 (this machine's apt has no
//! Ubuntu keyring); both are cached under `target/kernel-smoke/GUEST`. The VM boots the kernel
//! with an initramfs made here: busybox-static,
//! iproute2's `ip` and `tc`, the agent and svc-probe with the shared libraries they load, the
//! kernel modules the datapath needs, a manifest of three Services and `kernel_smoke/init.sh`,
//! which builds the network inside the VM, runs the agent and checks a ClusterIP, a refusal's
//! errno, a NodePort to a local backend and one to a remote backend (SNATed), with what the
//! host expects of this kernel on the kernel command line (`Guest::append`). The host only
//! reads the verdict line from the serial console. Nothing touches the host's network; the VM
//! has no network device at all.

use std::{
    collections::BTreeSet,
    fs,
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{root, toolchain};

/// A kernel the smoke test boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Guest {
    /// Debian 12's cloud kernel, 6.1.
    #[value(name = "debian-12")]
    Debian12,
    /// Ubuntu 22.04's GA kernel, 5.15 (generic).
    #[value(name = "ubuntu-22.04")]
    Ubuntu2204,
}

impl Guest {
    pub const ALL: &[Guest] = &[Guest::Debian12, Guest::Ubuntu2204];

    fn name(self) -> &'static str {
        match self {
            Guest::Debian12 => "debian-12",
            Guest::Ubuntu2204 => "ubuntu-22.04",
        }
    }

    /// What init.sh is told on the kernel command line: the agent's `--xdp-mode`, and what
    /// this kernel must give, known here rather than taken from the agent's own log (a start
    /// check wrong about the kernel would otherwise set the test's expectations too).
    /// - `svc.xdp`: 5.15 lacks `bpf_xdp_load_bytes`, so `native` there checks that the agent
    ///   says it runs as `off` (`svc.xdp_off=1`). 6.1's verifier refuses the program after
    ///   1,000,000 instructions (85 s emulated, which the tc attach waits for): `off`.
    /// - `svc.errno`: a connect() to a Service without endpoints fails with ECONNREFUSED
    ///   (111), or EPERM (1) before `bpf_set_retval` (5.18).
    fn append(self) -> &'static str {
        match self {
            Guest::Debian12 => "svc.xdp=off svc.errno=111",
            Guest::Ubuntu2204 => "svc.xdp=native svc.xdp_off=1 svc.errno=1",
        }
    }
}

/// The kernel flavour: Debian 12's cloud kernel has veth, sch_ingress and cls_bpf as modules,
/// bpf, cgroup bpf and BTF built in, and boots in a few seconds.
const FLAVOUR: &str = "cloud-amd64";
/// Debian 12's kernel series.
const SERIES: &str = "linux-image-6.1.0-";
/// Ubuntu's archive, plain HTTP as apt uses it: what it serves is checked against `UBUNTU_DEBS`.
const UBUNTU_ARCHIVE: &str = "http://archive.ubuntu.com/ubuntu/";
/// Ubuntu 22.04's GA kernel, 5.15.0-208.218 (jammy-updates on 2026-12-06; the archive keeps
/// every ABI's packages): the image (unsigned: the same kernel, not wrapped for Secure Boot)
/// and its modules, with the SHA256 that jammy-updates' Packages index gave them on that day
/// (fetched over plain HTTP, as apt does, but without checking the index's signature: no
/// Ubuntu keyring here). A changed pin or a partial download leaves no stamp: the next run
/// fetches again.
const UBUNTU_DEBS: &[(&str, &str)] = &[
    (
        "pool/main/l/linux/linux-image-unsigned-5.15.0-208-generic_5.15.0-208.218_amd64.deb",
        "dfcb46169cf058ac7b83fba89e2a9adbb3841fb63ba91c9d99418638ec6a4a8b",
    ),
    (
        "pool/main/l/linux/linux-modules-5.15.0-208-generic_5.15.0-208.218_amd64.deb",
        "1afd062d1e68a1fd76c3baf9e2e5b09ff7b87c7f92f6df2e406639537a60d54f",
    ),
];
/// What the datapath needs that both kernels build as modules (their dependencies come along).
const MODULES: &[&str] = &["veth", "sch_ingress", "cls_bpf"];
/// The Debian packages the smoke test runs with.
const PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static", "iproute2", "curl"];
/// The line `init.sh` ends with.
const VERDICT: &str = "svc-kernel-smoke: ";

const INIT: &str = include_str!("kernel_smoke/init.sh");

/// A Service `smoke/web` (ClusterIP 10.96.0.10:80, NodePort 30080) and its EndpointSlice: one
/// backend, the pod namespace's 10.1.0.2:8080 on this node; `smoke/far` (NodePort 30081),
/// whose one backend, 10.2.0.2:8080, is on another node (SNAT); and `smoke/empty`
/// (10.96.0.11:80) without endpoints, whose connections the socket hooks refuse.
const MANIFESTS: &str = r#"apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: smoke
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: 80
    targetPort: 8080
    nodePort: 30080
    protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: smoke
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
- addresses: ["10.1.0.2"]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: smoke
---
apiVersion: v1
kind: Service
metadata:
  name: far
  namespace: smoke
spec:
  type: NodePort
  clusterIP: 10.96.0.12
  ports:
  - name: http
    port: 80
    targetPort: 8080
    nodePort: 30081
    protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: far-1
  namespace: smoke
  labels:
    kubernetes.io/service-name: far
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
- addresses: ["10.2.0.2"]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: other
---
apiVersion: v1
kind: Service
metadata:
  name: empty
  namespace: smoke
spec:
  clusterIP: 10.96.0.11
  ports:
  - name: http
    port: 80
    protocol: TCP
"#;

fn cache_dir() -> PathBuf {
    std::env::var_os("SVC_KERNEL_SMOKE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/kernel-smoke"))
}

/// Runs the smoke test with `agent` and `probe` on each of `guests`, one VM after another;
/// fails unless every VM says PASS in time. `kvm`: qemu with KVM rather than software
/// emulation (TCG).
pub fn run(
    agent: &Path,
    probe: &Path,
    timeout: Duration,
    kvm: bool,
    guests: &[Guest],
) -> Result<()> {
    toolchain::ensure_packages(PACKAGES)?;
    let mut failed = Vec::new();
    for &guest in guests {
        let cache = cache_dir().join(guest.name());
        let kernel = match guest {
            Guest::Debian12 => debian_kernel(&cache)?,
            Guest::Ubuntu2204 => ubuntu_kernel(&cache)?,
        };
        let initramfs = cache.join("initramfs.cpio");
        build_initramfs(&kernel, agent, probe, &cache.join("initramfs"), &initramfs)?;
        let started = Instant::now();
        let verdict = boot(&kernel.vmlinuz, &initramfs, guest.append(), timeout, kvm)?;
        eprintln!(
            "kernel smoke test, {}: {verdict} ({:.0} s in the VM)",
            guest.name(),
            started.elapsed().as_secs_f64()
        );
        if !verdict.starts_with("PASS") {
            failed.push(format!("{} ({}): {verdict}", guest.name(), kernel.release));
        }
    }
    if !failed.is_empty() {
        bail!("kernel smoke test: {}", failed.join("; "));
    }
    Ok(())
}

/// An unpacked kernel package.
struct Kernel {
    release: String,
    vmlinuz: PathBuf,
    /// lib/modules/RELEASE of the package.
    modules: PathBuf,
}

/// The newest `linux-image-6.1.0-N-cloud-amd64` Debian has, downloaded and unpacked into the
/// cache once; later runs use what the cache holds.
fn debian_kernel(cache: &Path) -> Result<Kernel> {
    fs::create_dir_all(cache)?;
    let unpacked = cache.join("kernel");
    let stamp = unpacked.join("stamp");
    if !stamp.exists() {
        let mut package = newest_kernel_package()?;
        if package.is_none() {
            crate::run(Command::new("apt-get").args(["update", "-q"]))?;
            package = newest_kernel_package()?;
        }
        let package = package.with_context(|| {
            format!("Debian's archive has no {SERIES}N-{FLAVOUR} package (apt-cache pkgnames)")
        })?;
        let debs = cache.join("deb");
        let _ = fs::remove_dir_all(&debs);
        fs::create_dir_all(&debs)?;
        eprintln!(
            "downloading {package} (Debian 12's kernel) into {}",
            debs.display()
        );
        // As root apt warns that its sandbox user cannot write here; the download works.
        crate::run(
            Command::new("apt-get")
                .args(["download", "-q", &package])
                .current_dir(&debs),
        )?;
        let deb = fs::read_dir(&debs)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .context("apt-get download left no .deb")?;
        let _ = fs::remove_dir_all(&unpacked);
        crate::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&unpacked))?;
        fs::write(&stamp, &package)?;
    }
    unpacked_kernel(&unpacked)
}

/// Ubuntu 22.04's kernel (`UBUNTU_DEBS`), downloaded, checked and unpacked into the cache
/// once.
fn ubuntu_kernel(cache: &Path) -> Result<Kernel> {
    fs::create_dir_all(cache)?;
    let unpacked = cache.join("kernel");
    let stamp = unpacked.join("stamp");
    let want: String = UBUNTU_DEBS.iter().map(|(_, sha)| *sha).collect();
    if fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        let debs = cache.join("deb");
        let _ = fs::remove_dir_all(&debs);
        fs::create_dir_all(&debs)?;
        let _ = fs::remove_dir_all(&unpacked);
        for (path, sha) in UBUNTU_DEBS {
            let file = debs.join(path.rsplit('/').next().unwrap_or(path));
            let url = format!("{UBUNTU_ARCHIVE}{path}");
            eprintln!("downloading {url}");
            crate::run(
                Command::new("curl")
                    .args(["-fsSL", "--retry", "3", "-o"])
                    .arg(&file)
                    .arg(&url),
            )?;
            let got = sha256(&file)?;
            if got != *sha {
                bail!(
                    "{} has SHA256 {got}, not the {sha} Ubuntu's index gives",
                    file.display()
                );
            }
            crate::run(Command::new("dpkg").arg("-x").arg(&file).arg(&unpacked))?;
        }
        fs::write(&stamp, want)?;
    }
    unpacked_kernel(&unpacked)
}

/// `sha256sum`'s digest of `file`.
fn sha256(file: &Path) -> Result<String> {
    let out = Command::new("sha256sum")
        .arg(file)
        .output()
        .context("running sha256sum")?;
    if !out.status.success() {
        bail!("sha256sum {}: {}", file.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

/// The kernel in the unpacked packages at `unpacked`: its vmlinuz and modules.
fn unpacked_kernel(unpacked: &Path) -> Result<Kernel> {
    let boot = unpacked.join("boot");
    let vmlinuz = fs::read_dir(&boot)
        .with_context(|| format!("reading {}", boot.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .with_context(|| format!("no vmlinuz in {}", boot.display()))?;
    let release = vmlinuz
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .trim_start_matches("vmlinuz-")
        .to_string();
    let modules = unpacked.join("lib/modules").join(&release);
    Ok(Kernel {
        release,
        vmlinuz,
        modules,
    })
}

/// `linux-image-6.1.0-N-cloud-amd64` with the highest N in apt's lists (a local look-up).
fn newest_kernel_package() -> Result<Option<String>> {
    let out = Command::new("apt-cache")
        .args(["pkgnames", SERIES])
        .output()
        .context("running apt-cache")?;
    let suffix = format!("-{FLAVOUR}");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|name| {
            let abi = name.strip_prefix(SERIES)?.strip_suffix(&suffix)?;
            Some((abi.parse::<u32>().ok()?, name.to_string()))
        })
        .max()
        .map(|(_, name)| name))
}

/// The initramfs's tree in `dir` (made anew), archived as `out` (cpio, newc, uncompressed).
fn build_initramfs(
    kernel: &Kernel,
    agent: &Path,
    probe: &Path,
    dir: &Path,
    out: &Path,
) -> Result<()> {
    let _ = fs::remove_dir_all(dir);
    for d in [
        "bin",
        "usr/bin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "etc/svc-smoke/manifests",
        "lib/modules",
    ] {
        fs::create_dir_all(dir.join(d))?;
    }
    put(dir, "bin/busybox", Path::new("/bin/busybox"))?;
    let mut libs = BTreeSet::new();
    for (name, from) in [
        ("ip", PathBuf::from("/usr/sbin/ip")),
        ("tc", PathBuf::from("/usr/sbin/tc")),
        ("svc-agent", agent.to_owned()),
        ("svc-probe", probe.to_owned()),
    ] {
        // Not in bin/, where busybox installs its own `ip` and `tc`.
        let to = dir.join("usr/bin").join(name);
        put(dir, &format!("usr/bin/{name}"), &from)?;
        // The debug binaries' symbols are most of their size; the agent's kernel object is
        // data, which stripping keeps.
        let _ = Command::new("strip").arg("--strip-debug").arg(&to).status();
        libs.extend(shared_libraries(&from)?);
    }
    for lib in &libs {
        let rel = lib.strip_prefix("/").unwrap_or(lib);
        put(dir, &rel.to_string_lossy(), lib)?;
    }
    let mut load = Vec::new();
    for m in modules_in_order(&kernel.modules, MODULES)? {
        let name = Path::new(&m)
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        put(
            dir,
            &format!("lib/modules/{name}"),
            &kernel.modules.join(&m),
        )?;
        load.push(format!("/lib/modules/{name}"));
    }
    fs::write(dir.join("etc/svc-smoke/modules"), load.join("\n") + "\n")?;
    fs::write(dir.join("etc/svc-smoke/manifests/web.yaml"), MANIFESTS)?;
    fs::write(dir.join("init"), INIT)?;
    set_mode(&dir.join("init"), 0o755)?;
    let mut w = std::io::BufWriter::new(fs::File::create(out)?);
    cpio::write_tree(&mut w, dir)?;
    w.flush()?;
    Ok(())
}

/// Copies `from` to `rel` under `dir`, keeping its mode.
fn put(dir: &Path, rel: &str, from: &Path) -> Result<()> {
    let to = dir.join(rel);
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::copy(from, &to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The shared libraries `bin` loads, the dynamic loader included (`ldd`).
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .with_context(|| format!("ldd {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(parse_ldd(&text))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// The module files (relative to `dir`, lib/modules/RELEASE) that load `wanted`, each after
/// the ones it depends on. The package has no modules.dep (depmod makes it when the package is
/// installed): each module's own `depends=` (its .modinfo) says.
fn modules_in_order(dir: &Path, wanted: &[&str]) -> Result<Vec<String>> {
    let mut files = Vec::new();
    list_files(&dir.join("kernel"), &mut files)?;
    let mut order = Vec::new();
    for name in wanted {
        add_module(dir, &files, name, &mut order, 0)?;
    }
    Ok(order)
}

fn add_module(
    dir: &Path,
    files: &[PathBuf],
    name: &str,
    order: &mut Vec<String>,
    depth: usize,
) -> Result<()> {
    if depth > 16 {
        bail!("module dependencies nest deeper than 16 at {name}");
    }
    // Module names spell '-' and '_' alike.
    let want = format!("{}.ko", name.replace('-', "_"));
    let file = files
        .iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|f| f.to_string_lossy().replace('-', "_") == want)
        })
        .with_context(|| format!("{name}.ko is not in {}", dir.display()))?;
    let rel = file.strip_prefix(dir)?.to_string_lossy().into_owned();
    if order.contains(&rel) {
        return Ok(());
    }
    let bytes = fs::read(file)?;
    for dep in modinfo_depends(&bytes) {
        add_module(dir, files, &dep, order, depth + 1)?;
    }
    order.push(rel);
    Ok(())
}

/// The `depends=a,b` entry of a module's .modinfo.
fn modinfo_depends(ko: &[u8]) -> Vec<String> {
    let key = b"depends=";
    ko.windows(key.len())
        .position(|w| w == key)
        .map(|at| {
            let rest = &ko[at + key.len()..];
            let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
            String::from_utf8_lossy(&rest[..end])
                .split(',')
                .filter(|d| !d.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

fn list_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_dir() {
            list_files(&e.path(), out)?;
        } else {
            out.push(e.path());
        }
    }
    Ok(())
}

/// The VM's qemu, killed by its pid when this guard drops (also when the test fails or times
/// out), then reaped.
struct Vm {
    child: Child,
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Boots the VM and returns what follows `svc-kernel-smoke: ` on its verdict line (PASS ... or
/// FAIL ...), printing the console as it comes.
/// `append`: more of the kernel's command line, which init.sh reads (`Guest::append`).
fn boot(
    vmlinuz: &Path,
    initramfs: &Path,
    append: &str,
    timeout: Duration,
    kvm: bool,
) -> Result<String> {
    eprintln!(
        "booting {} in qemu ({})",
        vmlinuz.display(),
        if kvm {
            "KVM"
        } else {
            "software emulation, no KVM"
        }
    );
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-machine", "q35", "-m", "1024", "-smp", "2"]);
    if kvm {
        cmd.args(["-accel", "kvm"]);
    } else {
        cmd.args(["-accel", "tcg", "-cpu", "max"]);
    }
    // No network device, no disk, no display: the serial console is all the VM has.
    cmd.args([
        "-nodefaults",
        "-nographic",
        "-display",
        "none",
        "-no-reboot",
        "-nic",
        "none",
    ])
    .args(["-serial", "stdio", "-monitor", "none"])
    .arg("-kernel")
    .arg(vmlinuz)
    .arg("-initrd")
    .arg(initramfs)
    .arg("-append")
    .arg(format!(
        "console=ttyS0 panic=-1 oops=panic loglevel=4 rdinit=/init {append}"
    ))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    let mut vm = Vm {
        child: crate::forward::spawn(&mut cmd).context("starting qemu-system-x86_64")?,
    };
    let out = vm.child.stdout.take().context("qemu's stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let line = line.trim_end_matches('\r');
                println!("vm| {line}");
                if let Some(v) = line.strip_prefix(VERDICT) {
                    if v.starts_with("PASS") || v.starts_with("FAIL") {
                        return Ok(v.to_string());
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("no verdict from the VM within {} s", timeout.as_secs())
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = vm.child.wait()?;
                bail!("the VM stopped without a verdict ({status})")
            }
        }
    }
}

/// The initramfs archive: cpio's "newc" format, which the kernel unpacks.
mod cpio {
    use std::{fs, io::Write, os::unix::fs::MetadataExt, path::Path};

    use anyhow::Result;

    /// Every file, directory and symlink under `dir`, as the root of the archive.
    pub fn write_tree(w: &mut impl Write, dir: &Path) -> Result<()> {
        let mut ino = 1;
        walk(w, dir, dir, &mut ino)?;
        entry(w, "TRAILER!!!", 0, 0, &[], 0)?;
        Ok(())
    }

    fn walk(w: &mut impl Write, base: &Path, at: &Path, ino: &mut u32) -> Result<()> {
        let mut entries: Vec<_> = fs::read_dir(at)?.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let path = e.path();
            let name = path.strip_prefix(base)?.to_string_lossy().into_owned();
            let meta = fs::symlink_metadata(&path)?;
            *ino += 1;
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&path)?;
                let target = target.to_string_lossy();
                entry(w, &name, 0o120777, *ino, target.as_bytes(), 1)?;
            } else if meta.is_dir() {
                entry(w, &name, 0o040000 | (meta.mode() & 0o7777), *ino, &[], 2)?;
                walk(w, base, &path, ino)?;
            } else {
                let data = fs::read(&path)?;
                entry(w, &name, 0o100000 | (meta.mode() & 0o7777), *ino, &data, 1)?;
            }
        }
        Ok(())
    }

    fn entry(
        w: &mut impl Write,
        name: &str,
        mode: u32,
        ino: u32,
        data: &[u8],
        nlink: u32,
    ) -> Result<()> {
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0, // uid
            0, // gid
            0, // mtime
            data.len(),
            0, // devmajor
            0, // devminor
            0, // rdevmajor
            0, // rdevminor
            name.len() + 1,
            0, // check
        );
        w.write_all(header.as_bytes())?;
        w.write_all(name.as_bytes())?;
        w.write_all(&[0])?;
        pad(w, header.len() + name.len() + 1)?;
        w.write_all(data)?;
        pad(w, data.len())?;
        Ok(())
    }

    /// Zeros up to the next multiple of 4.
    fn pad(w: &mut impl Write, len: usize) -> Result<()> {
        w.write_all(&[0u8; 3][..(4 - len % 4) % 4])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::parse_ldd;
    use std::path::PathBuf;

    #[test]
    fn ldd_lines_give_the_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f9b)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f9b1fae0000)\n";
        assert_eq!(
            parse_ldd(text),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
    }
}
