//! Embeds the kernel object so one `svc-agent` binary is all a node needs.
//! `cargo xtask build-ebpf` builds it (installing the eBPF toolchain first where missing).

use std::{env, fs, path::PathBuf, process::Command};

fn main() {
    commit();
    println!("cargo:rerun-if-env-changed=SVC_EBPF_OBJECT");
    let object = match env::var_os("SVC_EBPF_OBJECT") {
        Some(p) => PathBuf::from(p),
        None => {
            let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
            manifest.join("../target/bpfel-unknown-none/release/svc")
        }
    };
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it")).join("svc.bpf.o");
    if let Err(e) = fs::copy(&object, &out) {
        panic!(
            "the eBPF object {} is missing ({e}): run `cargo xtask build-ebpf` first",
            object.display()
        );
    }
}

/// `SVC_GIT_COMMIT` for `--version`: the commit checked out (uncommitted changes are not
/// told: the script runs again when HEAD moves, not on every edit), `unknown` outside a git
/// checkout (a source tarball).
fn commit() {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SVC_GIT_COMMIT={commit}");
    // HEAD, and the branch file it names: a commit changes the latter, a checkout the former.
    for path in ["HEAD", "refs/heads"] {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Some(p) = git(&["rev-parse", "--git-common-dir"]) {
        println!("cargo:rerun-if-changed={p}/packed-refs");
    }
}
