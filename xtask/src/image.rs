//! `cargo xtask image`: the node image, built without a registry or a base image.
//!
//! The image holds the agent and the shared libraries its ELF interpreter loads, nothing else:
//! no shell, no package manager (the DaemonSet's init container runs `svc-agent mount-bpffs`).
//! The libraries are the build machine's, found by `ldd` (a static musl build would need a
//! second toolchain for the kernel object's build script and the whole dependency tree).
//! buildah assembles it `FROM scratch` in a storage of its own under the output directory
//! (vfs: works in containers and VMs without overlayfs, and touches no store of the machine),
//! and writes it as an OCI archive that `podman load`, `docker load` and
//! `ctr -n k8s.io images import` take.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

use crate::{root, run};

pub struct Options {
    /// The agent to put in; None: the release build.
    pub agent: Option<PathBuf>,
    pub tag: String,
    pub out: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            agent: None,
            tag: "localhost/svc-agent:dev".into(),
            out: root().join("target/image"),
        }
    }
}

/// buildah's storage for the image, under `out` (tests/tests/image.rs reads it the same way).
fn storage_args(out: &Path) -> Vec<String> {
    vec![
        format!("--root={}", out.join("storage").display()),
        format!("--runroot={}", out.join("run").display()),
        "--storage-driver=vfs".into(),
    ]
}

/// Builds the image and writes its OCI archive; returns the archive's path.
pub fn build(o: &Options) -> Result<PathBuf> {
    ensure_buildah()?;
    let agent = o
        .agent
        .clone()
        .unwrap_or_else(|| root().join("target/release/svc-agent"));
    ensure!(agent.is_file(), "{} is missing", agent.display());
    fs::create_dir_all(&o.out)?;
    let rootfs = o.out.join("rootfs");
    let _ = fs::remove_dir_all(&rootfs);
    let bin = rootfs.join("usr/local/bin");
    fs::create_dir_all(&bin)?;
    fs::copy(&agent, bin.join("svc-agent"))
        .with_context(|| format!("copying {}", agent.display()))?;
    for lib in shared_libraries(&agent)? {
        let to = rootfs.join(lib.strip_prefix("/").unwrap_or(&lib));
        fs::create_dir_all(to.parent().context("a library path has a directory")?)?;
        // The file, not the symlink: the image has no link targets.
        fs::copy(&lib, &to).with_context(|| format!("copying {}", lib.display()))?;
    }

    let buildah = |args: &[&str]| -> Result<String> {
        let out = Command::new("buildah")
            .args(storage_args(&o.out))
            .args(args)
            .output()
            .context("running buildah")?;
        ensure!(
            out.status.success(),
            "buildah {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let version = version(&agent)?;
    let container = buildah(&["from", "scratch"])?;
    let made = (|| -> Result<()> {
        buildah(&["copy", &container, &rootfs.display().to_string(), "/"])?;
        buildah(&[
            "config",
            "--entrypoint",
            r#"["/usr/local/bin/svc-agent"]"#,
            "--cmd",
            "",
            "--label",
            &format!("org.opencontainers.image.version={version}"),
            "--label",
            "org.opencontainers.image.title=svc-agent",
            &container,
        ])?;
        buildah(&["commit", "--quiet", &container, &o.tag])?;
        Ok(())
    })();
    let _ = buildah(&["rm", &container]);
    made?;
    let archive = o.out.join("svc-agent.oci.tar");
    let _ = fs::remove_file(&archive);
    buildah(&[
        "push",
        &o.tag,
        &format!("oci-archive:{}:{}", archive.display(), o.tag),
    ])?;
    eprintln!(
        "built {} ({version}) from {}: {}",
        o.tag,
        agent.display(),
        archive.display()
    );
    Ok(archive)
}

/// The agent's own `--version` line.
fn version(agent: &Path) -> Result<String> {
    let out = Command::new(agent).arg("--version").output()?;
    ensure!(out.status.success(), "{} --version failed", agent.display());
    Ok(String::from_utf8_lossy(&out.stdout)
        .trim()
        .trim_start_matches("svc-agent ")
        .to_string())
}

/// The files the dynamic loader maps for `binary`, the loader itself included (`ldd`'s
/// `name => /path (addr)` and `/path (addr)` lines; the vDSO has no file).
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // A static binary: "not a dynamic executable".
        return Ok(Vec::new());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        } else if line.contains("not found") {
            bail!("{}: {line}", binary.display());
        }
    }
    Ok(libs)
}

fn ensure_buildah() -> Result<()> {
    if Command::new("buildah").arg("--version").output().is_ok() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("buildah is missing: `apt-get install buildah` (or run as root to install it)");
    }
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends", "buildah"])
        .env("DEBIAN_FRONTEND", "noninteractive"))
}
