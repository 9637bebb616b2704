//! The bpffs directory: made and owned by the agent alone, locked while an agent runs.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::Path;

use super::io_err;
use crate::error::{Error, Result};
use crate::sys;

/// Creates `dir` (0700) or checks that an existing one is ours alone: a directory (not a
/// link), owned by our user, writable by nobody else, on bpffs.
pub(super) fn own_dir(dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Checked first, so a wrong --bpffs leaves no directory behind.
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
            if let Some(parent) = parent.filter(|p| p.exists()) {
                if !sys::is_bpffs(parent).map_err(|e| io_err(parent, e))? {
                    return Err(Error::load(format!(
                        "--bpffs {} is not on a bpf filesystem (mount -t bpf bpf DIR): pins \
                         elsewhere are impossible",
                        dir.display()
                    )));
                }
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| io_err(dir, e))?;
        }
        Err(e) => return Err(io_err(dir, e)),
        Ok(_) => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| io_err(dir, e))?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let mode = meta.permissions().mode();
    let problem = if !meta.file_type().is_dir() {
        Some("is not a directory".to_string())
    } else if meta.uid() != euid {
        Some(format!(
            "is owned by uid {}, not by us (uid {euid})",
            meta.uid()
        ))
    } else if mode & 0o022 != 0 {
        Some(format!("is writable by others (mode {:o})", mode & 0o7777))
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(Error::load(format!(
            "--bpffs {} {problem}: whoever can write there can unpin the datapath; remove it \
             (or choose another directory) and let svc-agent create its own",
            dir.display()
        )));
    }
    if !sys::is_bpffs(dir).map_err(|e| io_err(dir, e))? {
        return Err(Error::load(format!(
            "--bpffs {} is not on a bpf filesystem (mount -t bpf bpf DIR): pins elsewhere are \
             impossible",
            dir.display()
        )));
    }
    Ok(())
}

/// Locks `dir` for this process, naming the holder when another process has it.
pub(super) fn lock_dir(dir: &Path) -> Result<(File, u64)> {
    let f = File::open(dir).map_err(|e| io_err(dir, e))?;
    let meta = f.metadata().map_err(|e| io_err(dir, e))?;
    if !sys::try_lock(f.as_fd()).map_err(|e| io_err(dir, e))? {
        return Err(Error::Locked {
            dir: dir.to_path_buf(),
            holder: describe_holders(meta.dev(), meta.ino()),
        });
    }
    Ok((f, meta.ino()))
}

fn describe_holders(dev: u64, ino: u64) -> String {
    let holders: Vec<String> = sys::flock_holders(dev, ino)
        .into_iter()
        .map(|pid| format!("pid {pid} ({})", sys::process_name(pid)))
        .collect();
    if holders.is_empty() {
        "another process".into()
    } else {
        holders.join(", ")
    }
}
