//! Stopping a bench on SIGTERM, SIGINT or SIGHUP through its normal teardown.
//!
//! The default action of those signals ends the process without unwinding, so no guard's Drop
//! runs: namespaces, cgroups, pins and temporary directories stay, and so may processes that
//! do not die with their parent. [`install`] replaces that action with a thread that records
//! the first signal; every wait of this crate (probe clients, backends, the agent, kube-proxy,
//! the control plane) polls [`requested`] and fails with [`Interrupted`], and the benches
//! check it between their steps, so the main flow returns an error and every guard drops on
//! the way out. [`run`] then ends the process with 128 + the signal's number.
//!
//! The signal thread only records: it never kills anything itself, so each child is ended by
//! the guard that owns it and has not reaped it yet, by its pid, which cannot have been reused.
//! A second signal during the teardown is reported and otherwise ignored; SIGKILL still ends
//! the process at once (`sys::clean_stale` removes what that leaves).
//!
//! Nothing changes where [`install`] was never called (the integration tests): the flag stays
//! unset.

use std::{
    future::Future,
    process::ExitCode,
    sync::{
        atomic::{AtomicI32, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use signal_hook::{
    consts::{SIGHUP, SIGINT, SIGTERM},
    iterator::Signals,
};

/// The first signal received, 0 before.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// How often the waits of [`sleep`] and [`block_on`] look at the flag: a stop within a tenth
/// of a second, for no measurable work.
const POLL: Duration = Duration::from_millis(50);

/// The error a wait returns once a stop was requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted(pub i32);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", name(self.0))
    }
}

impl std::error::Error for Interrupted {}

fn name(signal: i32) -> String {
    match signal {
        SIGTERM => "SIGTERM".into(),
        SIGINT => "SIGINT".into(),
        SIGHUP => "SIGHUP".into(),
        n => format!("signal {n}"),
    }
}

/// Handles SIGTERM, SIGINT and SIGHUP from now on (once per process; later calls do nothing).
pub fn install() -> Result<()> {
    static INSTALLED: Mutex<bool> = Mutex::new(false);
    let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    if *installed {
        return Ok(());
    }
    // Registered here, before returning: a signal right after `install` is already ours.
    let mut signals =
        Signals::new([SIGTERM, SIGINT, SIGHUP]).context("handling SIGTERM, SIGINT, SIGHUP")?;
    std::thread::Builder::new()
        .name("svc-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal == SIGHUP {
                    quiet_closed_terminal();
                }
                match SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => eprintln!(
                        "svc-tests: {}: stopping, tearing everything down first",
                        name(signal)
                    ),
                    Err(_) => eprintln!(
                        "svc-tests: {} ignored: still tearing down (SIGKILL would leave \
                         namespaces, cgroups and pins behind)",
                        name(signal)
                    ),
                }
            }
        })
        .context("starting the signal thread")?;
    *installed = true;
    Ok(())
}

/// After SIGHUP the terminal is likely gone, and `eprintln!` panics when a write fails: a
/// second panic in a guard's Drop while the first unwinds would abort the teardown. So output
/// to a terminal goes to /dev/null from then on; a file or pipe keeps it.
fn quiet_closed_terminal() {
    // SAFETY: plain fd calls on this process's own descriptors; no memory is shared.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if null < 0 {
            return;
        }
        for fd in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
            if libc::isatty(fd) == 1 || *libc::__errno_location() == libc::EIO {
                libc::dup2(null, fd);
            }
        }
        libc::close(null);
    }
}

/// The signal that asked the process to stop, if one did.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `Err(Interrupted)` once a stop was requested: `interrupt::check()?` between steps.
pub fn check() -> Result<()> {
    match requested() {
        Some(s) => Err(Interrupted(s).into()),
        None => Ok(()),
    }
}

/// `std::thread::sleep` that ends early, with `Err(Interrupted)`, when a stop is requested.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check()?;
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(POLL));
    }
}

/// `rt.block_on(work)`, dropping `work` when a stop is requested, at its next await: work that
/// runs long between awaits (`bulk`'s etcd writes after their one await) finishes first. `rt`
/// needs its timer enabled.
pub fn block_on<T>(
    rt: &tokio::runtime::Runtime,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    rt.block_on(async {
        tokio::select! {
            r = work => r,
            s = stop_requested() => Err(Interrupted(s).into()),
        }
    })
}

async fn stop_requested() -> i32 {
    loop {
        if let Some(s) = requested() {
            return s;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A bench's `main`: handles the signals, runs `body`, and ends with its outcome. By the time
/// `body` has returned its guards have dropped, so after a signal everything is torn down and
/// the status is 128 + the signal's number (143 for SIGTERM), as a shell reports a process the
/// signal killed.
pub fn run(body: impl FnOnce() -> Result<()>) -> ExitCode {
    if let Err(e) = install() {
        eprintln!("Error: {e:?}");
        return ExitCode::FAILURE;
    }
    let result = body();
    if requested().is_some() {
        if let Err(e) = &result {
            eprintln!("svc-tests: {e:#}");
        }
    }
    if let Some(code) = stopped() {
        return code;
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // As std reports an error `main` returns.
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}

/// For a `main` of its own after [`install`], once everything is dropped: after a signal, says
/// so and gives the status to end with, 128 + the signal's number.
pub fn stopped() -> Option<ExitCode> {
    let signal = requested()?;
    eprintln!(
        "svc-tests: stopped by {}; everything the run made is torn down",
        name(signal)
    );
    Some(ExitCode::from(
        u8::try_from(128 + signal).unwrap_or(u8::MAX),
    ))
}
