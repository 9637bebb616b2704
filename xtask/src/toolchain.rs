//! Installs the eBPF toolchain this project builds with, where it is missing. Idempotent: a
//! machine that has everything is only checked.
//!
//! Debian's `rustc-web` ships the core library source that `-Z build-std=core` needs (rustup's
//! toolchains here have no rust-src), and Debian's LLVM 22 matches its LLVM for bpf-linker.

use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::run;

pub const LINKED_TOOLCHAIN: &str = "debian";
const BPF_LINKER_VERSION: &str = "0.13.0";
/// The test runner of `cargo xtask test`; 0.9.151 builds with rustc 1.91 or newer.
const NEXTEST_VERSION: &str = "0.9.151";
const LLVM_MAJOR: &str = "22";
/// Compiler and its source, clippy for the kernel crate, LLVM for bpf-linker, and the tools the
/// demo and the tests use.
const PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "rust-web-clippy",
    "llvm-22-dev",
    "bpftool",
    "iproute2",
];

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

fn missing_packages(packages: &[&'static str]) -> Vec<&'static str> {
    packages
        .iter()
        .filter(|p| {
            !output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .is_some_and(|s| s.contains("install ok installed"))
        })
        .copied()
        .collect()
}

/// Installs those of `packages` (Debian's) that are missing.
pub fn ensure_packages(packages: &[&'static str]) -> Result<()> {
    let missing = missing_packages(packages);
    if !missing.is_empty() {
        if !is_root() {
            bail!(
                "Debian packages are missing: {}; run as root (apt-get install) or install \
                 them yourself",
                missing.join(" ")
            );
        }
        eprintln!("installing Debian packages: {}", missing.join(" "));
        run(Command::new("apt-get").args(["update", "-q"]))
            .context("apt-get update failed: is the Debian mirror reachable?")?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))
        .context("apt-get install failed")?;
    }
    Ok(())
}

pub fn ensure() -> Result<()> {
    ensure_packages(PACKAGES)?;
    let verbose = output(Command::new("/usr/bin/rustc").args(["--version", "--verbose"]))
        .context("/usr/bin/rustc (Debian's rustc-web) does not run")?;
    if !verbose.contains(&format!("LLVM version: {LLVM_MAJOR}.")) {
        bail!("/usr/bin/rustc is not built on LLVM {LLVM_MAJOR}:\n{verbose}");
    }

    let toolchains = output(Command::new("rustup").args(["toolchain", "list"]))
        .context("rustup is not installed")?;
    if !toolchains
        .lines()
        .any(|l| l.split_whitespace().next() == Some(LINKED_TOOLCHAIN))
    {
        run(Command::new("rustup").args(["toolchain", "link", LINKED_TOOLCHAIN, "/usr"]))?;
    }

    let have_linker = output(Command::new("bpf-linker").arg("--version"))
        .is_some_and(|v| v.contains(BPF_LINKER_VERSION));
    if !have_linker {
        eprintln!("installing bpf-linker {BPF_LINKER_VERSION} (a few minutes on 2 cores)");
        run(Command::new("cargo")
            .args([
                "install",
                &format!("bpf-linker@{BPF_LINKER_VERSION}"),
                "--no-default-features",
                "--features",
                &format!("llvm-{LLVM_MAJOR}"),
            ])
            // bpf-linker's build script finds LLVM through LLVM_PREFIX only.
            .env("LLVM_PREFIX", format!("/usr/lib/llvm-{LLVM_MAJOR}"))
            .env_remove("RUSTUP_TOOLCHAIN"))
        .context("installing bpf-linker failed: is crates.io reachable?")?;
    }
    Ok(())
}

/// cargo-nextest, from crates.io where missing or of another version (a few minutes on 2
/// cores, once).
pub fn ensure_nextest() -> Result<()> {
    let have = output(Command::new("cargo").args(["nextest", "--version"]))
        .is_some_and(|v| v.split_whitespace().nth(1) == Some(NEXTEST_VERSION));
    if !have {
        eprintln!("installing cargo-nextest {NEXTEST_VERSION} (a few minutes on 2 cores)");
        run(Command::new("cargo").args([
            "install",
            &format!("cargo-nextest@{NEXTEST_VERSION}"),
            "--locked",
            // No self-update: the version is this file's.
            "--no-default-features",
            "--features",
            "default-no-update",
        ]))
        .context("installing cargo-nextest failed: is crates.io reachable?")?;
    }
    Ok(())
}
