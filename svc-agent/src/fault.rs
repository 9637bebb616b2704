//! Fault injection for the tests: pauses that widen a window between two steps of the agent
//! so that a test can kill it, or send a packet, inside. Fail points (the `fail` crate),
//! compiled in with the `failpoints` feature only, which the test build turns on (xtask's
//! `USERSPACE` selection); without it each point is nothing and nothing here reads the
//! environment.

/// Between a flow's kernel entry and svc's mark on it at a handover (`handover.rs`).
pub const HANDOVER_PAUSE: &str = "handover-pause";
/// Before each run of the stale-UDP thread, between a sync and its cleanup.
pub const STALE_UDP_PAUSE: &str = "stale-udp-pause";
/// After each write of SVC_NODE_ADDRS or SVC_CONFIG (a handful of entries written in
/// microseconds), between two of them.
pub const NODE_WRITE_PAUSE: &str = "node-write-pause";
/// On the verifying thread, before it loads the socket programs: a first sync that is surely
/// written before the kernel's verdict on them.
pub const SOCKET_VERIFY_PAUSE: &str = "socket-verify-pause";
/// On the thread verifying the tc programs, once they are loaded: the window between the
/// socket programs' attach (after the first sync) and the tc programs'.
pub const TC_VERIFY_PAUSE: &str = "tc-verify-pause";

/// The tc program named by this point's value (`SVC_TEST_TC_REFUSED`) is taken as refused by
/// the kernel, after `TC_VERIFY_PAUSE`: what a verifier that rejects it would answer.
pub const TC_REFUSED: &str = "tc-refused";

/// The socket program named by this point's value (`SVC_TEST_SOCKET_REFUSED`) is taken as
/// refused by the kernel once loaded: what a verifier that rejects it would answer (while
/// the first sync is written, as the verifying thread begins with the socket programs).
pub const SOCKET_REFUSED: &str = "socket-refused";

/// With this point set (`SVC_TEST_XDP_REFUSED`, any value) the XDP program is taken as
/// refused by the kernel and left unloaded: what Debian 12's 6.1 answers (too large).
pub const XDP_REFUSED: &str = "xdp-refused";

/// The start check (`features.rs`) takes the feature whose name contains this point's value
/// (`SVC_TEST_KERNEL_LACKS`) as missing: what an older kernel would answer.
pub const KERNEL_LACKS: &str = "kernel-lacks";

/// Each point and the variable the tests set to its pause, in milliseconds.
#[cfg(feature = "failpoints")]
const PAUSES: [(&str, &str); 5] = [
    (HANDOVER_PAUSE, "SVC_TEST_HANDOVER_PAUSE_MS"),
    (STALE_UDP_PAUSE, "SVC_TEST_STALE_UDP_PAUSE_MS"),
    (NODE_WRITE_PAUSE, "SVC_TEST_NODE_WRITE_PAUSE_MS"),
    (TC_VERIFY_PAUSE, "SVC_TEST_TC_VERIFY_PAUSE_MS"),
    (SOCKET_VERIFY_PAUSE, "SVC_TEST_SOCKET_VERIFY_PAUSE_MS"),
];

/// Turns on the pauses the environment asks for (a variable that is not a number is
/// ignored); at the start of the process, before any point is reached.
#[cfg(feature = "failpoints")]
pub fn setup() {
    for (point, var) in PAUSES {
        let Some(ms) = std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok()) else {
            continue;
        };
        if let Err(e) = fail::cfg(point, &format!("sleep({ms})")) {
            tracing::warn!("fail point {point}: {e}");
        }
    }
    for (point, var) in [
        (KERNEL_LACKS, "SVC_TEST_KERNEL_LACKS"),
        (TC_REFUSED, "SVC_TEST_TC_REFUSED"),
        (SOCKET_REFUSED, "SVC_TEST_SOCKET_REFUSED"),
        (XDP_REFUSED, "SVC_TEST_XDP_REFUSED"),
    ] {
        if let Ok(name) = std::env::var(var) {
            if let Err(e) = fail::cfg(point, &format!("return({name})")) {
                tracing::warn!("fail point {point}: {e}");
            }
        }
    }
}

#[cfg(not(feature = "failpoints"))]
pub fn setup() {}
