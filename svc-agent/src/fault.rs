//! Fault injection for the tests: pauses that widen a window between two steps of the agent
//! so that a test can kill it, or send a packet, inside. Inert unless the test sets the
//! variable.

use std::time::Duration;

/// The pause the environment variable `var` asks for, in milliseconds; none when it is unset
/// or not a number.
pub fn pause(var: &str) -> Option<Duration> {
    let ms: u64 = std::env::var(var).ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}
