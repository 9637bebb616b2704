//! Shared setup of the integration tests.
#![allow(dead_code)] // each test binary uses a different part

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use svc_tests::{require_root, Sandbox, Tools};

/// A fresh sandbox with the probe this package built; fails (never skips) without root.
pub fn sandbox() -> Sandbox {
    require_root();
    Sandbox::new(Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe"))).expect("creating sandbox")
}

pub fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// Calls `f` until it returns `Ok(Some(v))` or `within` has passed; the last error or "still
/// None" explains a timeout.
pub fn poll<T>(within: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let deadline = Instant::now() + within;
    loop {
        let last = match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => "condition not met".to_string(),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("not within {within:?}: {last}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
