//! Embeds the kernel object so one `svc-agent` binary is all a node needs.
//! `cargo xtask build-ebpf` builds it (installing the eBPF toolchain first where missing).

use std::{env, fs, path::PathBuf};

fn main() {
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
