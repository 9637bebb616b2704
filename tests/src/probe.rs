//! What `svc-probe` prints, shared by the probe (which writes it) and the tests (which read it).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One connection or datagram exchange.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Attempt {
    pub ok: bool,
    /// Name of the backend that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// getpeername() of the socket (TCP, connected UDP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// Source address of the reply (unconnected UDP: recvfrom()).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Time connect() took (TCP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errno: Option<i32>,
    /// Time from the start of the attempt to its end (success or failure).
    pub elapsed_us: u64,
    /// With `--who`: the client's address as the backend saw it (the connection's or
    /// datagram's source at the backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// With `--who`: the backend's own address the connection or datagram arrived at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<String>,
}

/// Output of `svc-probe tcp` and `svc-probe udp`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub results: Vec<Attempt>,
    /// The probe's cgroup v2 path ("0::" line of /proc/self/cgroup): proves it ran in the
    /// test cgroup, without which the agent's programs never see it.
    #[serde(default)]
    pub cgroup: String,
    /// Inode of the probe's network namespace: proves it ran in the client namespace.
    #[serde(default)]
    pub netns_ino: u64,
}

impl Report {
    /// How many times each backend answered.
    pub fn backends(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for r in &self.results {
            if let Some(b) = &r.backend {
                *m.entry(b.clone()).or_default() += 1;
            }
        }
        m
    }

    pub fn failures(&self) -> Vec<&Attempt> {
        self.results.iter().filter(|r| !r.ok).collect()
    }

    pub fn all_ok(&self) -> bool {
        !self.results.is_empty() && self.results.iter().all(|r| r.ok)
    }
}

/// Output of `svc-probe loop`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoopReport {
    pub ok: u64,
    pub failed: u64,
    /// Failure message → count.
    pub errors: BTreeMap<String, u64>,
    /// Backend name → successful connections.
    pub backends: BTreeMap<String, u64>,
    /// Longest single attempt, successful or not.
    pub max_us: u64,
    pub duration_ms: u64,
    #[serde(default)]
    pub cgroup: String,
    #[serde(default)]
    pub netns_ino: u64,
    /// Time the workers spent in this target's successful attempts, summed over them.
    #[serde(default)]
    pub busy_us: u64,
    /// Workers that ran the loop.
    #[serde(default)]
    pub workers: u32,
    /// `loop --alternate-with`: the other target's counts (this report's own are `--to`'s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alternate: Option<Box<LoopReport>>,
}

impl LoopReport {
    /// Successful connections (or exchanges) per second of the run.
    pub fn per_second(&self) -> f64 {
        self.ok as f64 / (self.duration_ms.max(1) as f64 / 1e3)
    }

    /// Successful attempts per second of the time spent on this target, as if every worker
    /// had spent the whole run on it. With `--alternate-with`, where the run is split between
    /// two targets in short blocks, the two targets' figures compare them moments apart.
    pub fn per_busy_second(&self) -> f64 {
        self.ok as f64 * f64::from(self.workers.max(1)) / (self.busy_us.max(1) as f64 / 1e6)
    }
}

/// One exchange of `svc-probe udp-stream`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StreamExchange {
    /// When the exchange started: milliseconds since the Unix epoch (wall clock, so the test
    /// can line it up with when it wrote to the API).
    pub at_ms: u64,
    /// Which socket (0 for the first; +1 after each reconnect).
    pub socket: u32,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// getpeername() of the connected socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// Source address of the reply (recvfrom() of an unconnected socket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errno: Option<i32>,
}

/// Output of `svc-probe udp-stream`: one connected UDP socket used for the whole run, replaced
/// by a new one (connected again) after any error; or, with `--unconnected N`, N unconnected
/// sockets used in turn (`socket` is then the socket's index).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StreamReport {
    pub exchanges: Vec<StreamExchange>,
    #[serde(default)]
    pub cgroup: String,
    #[serde(default)]
    pub netns_ino: u64,
}

/// One connection of `svc-probe hold`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HeldConnection {
    /// When it was established (Unix milliseconds); 0 if it never was.
    pub connected_at_ms: u64,
    /// getpeername().
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The backend that answered (the last one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Whether another backend answered than before (a TCP connection cannot move: this
    /// would mean its packets were sent elsewhere).
    #[serde(default)]
    pub switched: bool,
    pub exchanges: u64,
    pub failures: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_ok_at_ms: Option<u64>,
}

/// Output of `svc-probe hold`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HoldReport {
    pub connections: Vec<HeldConnection>,
    #[serde(default)]
    pub cgroup: String,
    #[serde(default)]
    pub netns_ino: u64,
}

/// Output of `svc-probe sweep`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SweepReport {
    pub ok: u64,
    pub failed: u64,
    /// `ADDR: error` of the first few failures.
    pub first_failures: Vec<String>,
    pub elapsed_us: u64,
    #[serde(default)]
    pub cgroup: String,
    #[serde(default)]
    pub netns_ino: u64,
}
