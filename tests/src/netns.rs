//! Network namespaces made with `ip netns`, deleted on drop.

use std::{os::unix::fs::MetadataExt, path::PathBuf};

use anyhow::{Context, Result};

use crate::sys::{run, unique_name};

#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates `PREFIX-PID-N` and brings its loopback up.
    pub fn new(prefix: &str) -> Result<Self> {
        let name = unique_name(prefix);
        run("ip", ["netns", "add", &name])?;
        // The guard exists from here on, so a failure below still deletes the namespace.
        let ns = Self { name };
        ns.ip(["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n NAME ARGS...`: only ever configures this namespace.
    pub fn ip<'a>(&self, args: impl IntoIterator<Item = &'a str>) -> Result<String> {
        let mut all: Vec<&str> = vec!["-n", &self.name];
        all.extend(args.into_iter().map(|a| -> &str { a }));
        run("ip", all)
    }

    /// Adds an address: IPv6 ones with `nodad`, so they are usable (bindable) at once instead
    /// of staying tentative for a second or two.
    pub fn add_addr(&self, dev: &str, cidr: &str) -> Result<()> {
        if cidr.contains(':') {
            self.ip(["addr", "add", cidr, "dev", dev, "nodad"])?;
        } else {
            self.ip(["addr", "add", cidr, "dev", dev])?;
        }
        Ok(())
    }

    /// `sysctl -w SETTING` (`net.ipv4.ip_forward=1`) inside this namespace: the namespace's
    /// own network sysctls, never the machine's.
    pub fn sysctl(&self, setting: &str) -> Result<()> {
        run(
            "ip",
            ["netns", "exec", &self.name, "sysctl", "-qw", setting],
        )
        .with_context(|| format!("sysctl {setting} in {}", self.name))?;
        Ok(())
    }

    /// Makes this namespace a router, as a node is: IPv4 and IPv6 forwarding on, and no
    /// reverse-path filtering (inherited from the machine's defaults) to drop what it forwards
    /// between its devices.
    pub fn forward(&self) -> Result<()> {
        for s in [
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            self.sysctl(s)?;
        }
        Ok(())
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Inode of the namespace, as `/proc/PID/ns/net` of a process inside it shows.
    pub fn inode(&self) -> Result<u64> {
        Ok(std::fs::metadata(self.path())
            .with_context(|| format!("stat {}", self.path().display()))?
            .ino())
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Err(e) = run("ip", ["netns", "del", &self.name]) {
            eprintln!("svc-tests: {e:#}");
        }
    }
}

/// A veth pair between two of our namespaces, created inside `a` with its peer placed in `b`
/// directly, so no interface ever appears in the root namespace. Both ends are brought up.
pub fn veth_pair(a: &NetNs, a_dev: &str, b: &NetNs, b_dev: &str) -> Result<()> {
    a.ip([
        "link",
        "add",
        a_dev,
        "type",
        "veth",
        "peer",
        "name",
        b_dev,
        "netns",
        b.name(),
    ])?;
    a.ip(["link", "set", a_dev, "up"])?;
    b.ip(["link", "set", b_dev, "up"])?;
    Ok(())
}

impl NetNs {
    /// Runs `f` on a thread of its own that has entered this namespace (setns), and returns
    /// what it returns. Sockets `f` creates belong to this namespace for their whole life, also
    /// once the thread is gone: a listener made here accepts connections made inside the
    /// namespace while the rest of the process stays where it is. Nothing else of the process
    /// moves.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        run_in_netns(&self.path(), f)
    }
}

/// [`NetNs::run_in`] for a namespace known by its path (`/run/netns/NAME`).
pub fn run_in_netns<T: Send>(path: &std::path::Path, f: impl FnOnce() -> T + Send) -> Result<T> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns on a namespace file we hold open; it moves only this thread,
                // which ends with this closure.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(anyhow::anyhow!(
                        "setns into {}: {}",
                        path.display(),
                        std::io::Error::last_os_error()
                    ));
                }
                Ok(f())
            })
            .join()
            // A panic in `f` is the caller's own failure: raised again, with its message.
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}
