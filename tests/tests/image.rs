//! The node image (`cargo xtask image`): built with buildah, without a registry or a base
//! image, it holds the agent and the libraries it loads, nothing else, and the agent runs from
//! the image's own root file system as a container would run it. No container runtime runs
//! here, so the image is mounted (buildah) and the agent run chrooted into it, in a mount
//! namespace of its own where it mounts anything.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use common::{web_service, web_slice, World};

const IN_IMAGE: &str = "/usr/local/bin/svc-agent";

fn output(cmd: &mut Command) -> Result<String> {
    let out: Output = cmd
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// buildah on the image's own storage, as `cargo xtask image` made it.
struct Buildah {
    storage: Vec<String>,
}

impl Buildah {
    fn run(&self, args: &[&str]) -> Result<String> {
        Ok(
            output(Command::new("buildah").args(&self.storage).args(args))?
                .trim()
                .to_string(),
        )
    }
}

/// A working container of the image, mounted; removed on drop, also on failure.
struct Mounted<'a> {
    buildah: &'a Buildah,
    container: String,
    root: PathBuf,
}

impl<'a> Mounted<'a> {
    fn new(buildah: &'a Buildah, image: &str) -> Result<Self> {
        let container = buildah.run(&["from", image])?;
        let root = match buildah.run(&["mount", &container]) {
            Ok(root) => PathBuf::from(root),
            Err(e) => {
                let _ = buildah.run(&["rm", &container]);
                return Err(e);
            }
        };
        Ok(Mounted {
            buildah,
            container,
            root,
        })
    }

    /// `sh -c script` in a mount namespace of its own (what it mounts goes with it), with
    /// `$ROOT` the image's root, where /sys and /proc are mounted as a container runtime
    /// mounts them (aya sizes per-CPU values from /sys/devices/system/cpu/possible).
    fn in_own_mounts(&self, script: &str) -> Result<String> {
        for dir in ["sys", "proc"] {
            std::fs::create_dir_all(self.root.join(dir))?;
        }
        let script = format!(
            "mount --rbind /sys \"$ROOT/sys\" && mount -t proc proc \"$ROOT/proc\" && {script}"
        );
        output(
            Command::new("unshare")
                .args(["--mount", "--propagation", "private", "sh", "-c", &script])
                .env("ROOT", &self.root),
        )
    }
}

impl Drop for Mounted<'_> {
    fn drop(&mut self) {
        let _ = self.buildah.run(&["umount", &self.container]);
        let _ = self.buildah.run(&["rm", &self.container]);
    }
}

/// Every file under `root`, relative to it (directories left out).
fn files(root: &Path) -> Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir)? {
            let e = e?;
            let path = e.path();
            if e.file_type()?.is_dir() {
                todo.push(path);
            } else {
                let rel = path.strip_prefix(root)?;
                out.insert(format!("/{}", rel.display()));
            }
        }
    }
    Ok(out)
}

/// The files `ldd` says the binary loads.
fn loaded_libraries(binary: &Path) -> Result<BTreeSet<String>> {
    let text = output(Command::new("ldd").arg(binary))?;
    Ok(text
        .lines()
        .filter_map(|l| match l.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => l.split_whitespace().next(),
        })
        .filter(|p| p.starts_with('/'))
        .map(String::from)
        .collect())
}

#[test]
fn the_image_holds_the_agent_alone_and_runs_it_from_its_own_root() {
    svc_tests::require_root();
    let xtask = std::env::var_os("SVC_XTASK")
        .expect("SVC_XTASK is not set: `cargo xtask test` sets it to the xtask that builds images");
    let mut w = World::start(1, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1], &[])).unwrap();
    });
    let agent = w.sb.tools.agent.clone();
    let out = svc_tests::TempDir::new("svc-image").unwrap();
    let tag = format!("localhost/svc-agent:test-{}", std::process::id());
    output(Command::new(&xtask).args([
        "image",
        "--agent",
        &agent.display().to_string(),
        "--tag",
        &tag,
        "--out",
        &out.path().display().to_string(),
    ]))
    .expect("cargo xtask image");

    // An OCI archive that `podman load` / `ctr images import` take.
    let archive = out.path().join("svc-agent.oci.tar");
    let listing = output(Command::new("tar").arg("-tf").arg(&archive)).unwrap();
    for entry in ["oci-layout", "index.json"] {
        assert!(
            listing.lines().any(|l| l.trim_start_matches("./") == entry),
            "{} lacks {entry}:\n{listing}",
            archive.display()
        );
    }

    let buildah = Buildah {
        storage: vec![
            format!("--root={}", out.path().join("storage").display()),
            format!("--runroot={}", out.path().join("run").display()),
            "--storage-driver=vfs".into(),
        ],
    };
    let inspect = buildah
        .run(&[
            "inspect",
            "--type",
            "image",
            "--format",
            "{{.OCIv1.Config.Entrypoint}}",
            &tag,
        ])
        .unwrap();
    assert_eq!(inspect, format!("[{IN_IMAGE}]"));
    let image = Mounted::new(&buildah, &tag).unwrap();

    // The agent and what its loader maps, nothing else: no shell, no package manager.
    let mut want = loaded_libraries(&agent).unwrap();
    want.insert(IN_IMAGE.to_string());
    let have = files(&image.root).unwrap();
    assert!(
        !image.root.join("sys").exists(),
        "the image has its own /sys"
    );
    assert_eq!(have, want, "the image's files");

    // It runs from there, and says what it is: the commit this checkout is at.
    let version = image
        .in_own_mounts(&format!("chroot \"$ROOT\" {IN_IMAGE} --version"))
        .unwrap();
    let head = Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short=12",
            "HEAD",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let commit = head.unwrap_or_else(|| "unknown".into());
    assert!(
        version.starts_with("svc-agent ") && version.contains(&format!("(commit {commit})")),
        "--version says {version:?}; HEAD is {commit}"
    );

    // `list` from the image reads the pins of a serving agent as the node's own binary does.
    let pins = w.bpffs.path().to_path_buf();
    let host = output(Command::new(&agent).args(["list", "--bpffs"]).arg(&pins)).unwrap();
    assert!(host.contains("10.96.0.10:80"), "{host}");
    std::fs::create_dir_all(image.root.join("pins")).unwrap();
    let from_image = image
        .in_own_mounts(&format!(
            "mount --bind '{}' \"$ROOT/pins\" && chroot \"$ROOT\" {IN_IMAGE} list --bpffs /pins",
            pins.display()
        ))
        .unwrap();
    assert_eq!(from_image, host, "`list` from the image");

    // The init container's job: bpffs mounted once, owner only, then left alone (at a path
    // the host's /sys does not already hold one, as the chart's bpffs.hostPath may be).
    let mounted = image
        .in_own_mounts(&format!(
            "chroot \"$ROOT\" {IN_IMAGE} mount-bpffs /run/bpf && \
             chroot \"$ROOT\" {IN_IMAGE} mount-bpffs /run/bpf && \
             stat -f -c %T \"$ROOT/run/bpf\" && stat -c %a \"$ROOT/run/bpf\""
        ))
        .unwrap();
    let lines: Vec<&str> = mounted.lines().collect();
    assert_eq!(
        lines,
        [
            "/run/bpf: bpffs mounted",
            "/run/bpf: bpffs was mounted already",
            "bpf_fs",
            // Owner only; bpffs sets the sticky bit on its root whatever the mode says.
            "1700"
        ],
        "mount-bpffs"
    );
    drop(image);
    let _ = buildah.run(&["rmi", "--force", &tag]);
    w.agent
        .terminate(std::time::Duration::from_secs(10))
        .unwrap();
}
