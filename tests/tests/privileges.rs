//! Which capabilities the agent needs, measured: the real agent (manifest mode) runs as root with
//! only the capabilities a test gives it (`setpriv --bounding-set --inh-caps`: root's exec then
//! gets exactly those, checked in /proc/PID/status), on a sandbox of its own, and a client shows
//! what works: a ClusterIP answered (maps created, programs loaded, attached, links and maps
//! pinned), and a connected UDP socket closed when its backend leaves the Service (pods'
//! processes found through the cgroup, `/proc/PID/ns/net` opened, `setns`, sock_diag
//! `SOCK_DESTROY`; svc-agent/src/tasks/stale.rs). The sandbox's client runs as root with every
//! capability, as a pod's root process with the container runtime's default set would be
//! outside the agent's set.
//!
//! The capability set under test is read from deploy/daemonset.yaml, so the manifest and this
//! test cannot drift apart. What was measured (kernel 6.18), and what the tests assert:
//! - CAP_SYS_ADMIN: `setns` into a pod's network namespace; it also passes every check of
//!   bpf(2) on its own (the kernel's bpf_capable() and perfmon_capable() accept it, and the
//!   cgroup program types' CAP_NET_ADMIN check too), so with it CAP_BPF and CAP_PERFMON are not
//!   needed. Without it (and without those) the agent exits: map creation is refused.
//! - CAP_NET_ADMIN: `SOCK_DESTROY` (sock_diag checks it in the socket's namespace, and
//!   CAP_SYS_ADMIN does not stand in). Without it the agent serves, stale sockets stay.
//! - CAP_SYS_PTRACE: opening `/proc/PID/ns/net` of a process that has capabilities the agent
//!   lacks, or another uid (the ptrace access check). Without it the agent serves, stale
//!   sockets stay.
//! - hostPID: cgroup.procs shows 0 for processes outside the agent's PID namespace, so without
//!   it no pod is found (the agent now says so). The agent serves, stale sockets stay.
//! - Without CAP_SYS_ADMIN, the datapath needs CAP_BPF (maps, BTF, program load), CAP_PERFMON
//!   (the verifier rejects the programs' pointer arithmetic and comparisons without it) and
//!   CAP_NET_ADMIN (loading cgroup sock_addr programs); attaching through links and pinning need
//!   nothing more than owning the bpffs directory, and neither does a restart that adopts the
//!   pinned maps and links (every run that serves is restarted and must serve again).

mod common;

use std::{
    ffi::OsString,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use common::{names, sa, sandbox, set, VIP};
use serde_json::Value;
use svc_tests::{
    sandbox::AGENT_READY_TIMEOUT, Agent, Endpoint, EndpointSlice, Manifests, Sandbox, Service,
    ServicePort, SlicePort,
};

/// Capabilities as a Pod's securityContext names them, with their numbers
/// (linux/capability.h). The ones the agent could plausibly want.
const CAPABILITIES: &[(&str, u32)] = &[
    ("NET_ADMIN", 12),
    ("SYS_PTRACE", 19),
    ("SYS_ADMIN", 21),
    ("PERFMON", 38),
    ("BPF", 39),
];

fn bit(cap: &str) -> u64 {
    let (_, n) = CAPABILITIES
        .iter()
        .find(|(name, _)| *name == cap)
        .unwrap_or_else(|| panic!("capability {cap} is not in CAPABILITIES"));
    1 << n
}

/// The agent container of deploy/daemonset.yaml: its added capabilities (it drops ALL) and
/// whether the pod shares the host's PID namespace.
struct DaemonSet {
    caps: Vec<String>,
    host_pid: bool,
}

fn daemonset() -> DaemonSet {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/daemonset.yaml");
    let ds: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let agent = pod["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "svc-agent"))
        .expect("the svc-agent container");
    let caps = &agent["securityContext"]["capabilities"];
    let list = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|s| {
                s.iter()
                    .filter_map(|c| c.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        list(&caps["drop"]),
        ["ALL"],
        "the agent should drop ALL first"
    );
    assert_eq!(agent["securityContext"]["privileged"], Value::Bool(false));
    DaemonSet {
        caps: list(&caps["add"]),
        host_pid: pod["hostPID"] == Value::Bool(true),
    }
}

/// How the agent is run.
struct Setup<'a> {
    caps: &'a [&'a str],
    /// In a PID namespace of its own, with its own /proc (a pod without hostPID).
    own_pid_namespace: bool,
}

/// What a user sees.
#[derive(Debug)]
enum Seen {
    /// The agent exited before it was ready; its log.
    Exited(String),
    /// It served the ClusterIP over TCP; whether the connected UDP socket left the deleted
    /// backend; the log.
    Serving { stale_closed: bool, log: String },
}

impl Seen {
    fn log(&self) -> &str {
        match self {
            Seen::Exited(log) | Seen::Serving { log, .. } => log,
        }
    }
}

/// `setpriv` (and `unshare`) before the agent: root's exec gets exactly `caps` (bounding set
/// and inheritable set both reduced to them).
fn launcher(setup: &Setup) -> Vec<OsString> {
    let list: String = setup
        .caps
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    let mut v: Vec<OsString> = Vec::new();
    if setup.own_pid_namespace {
        // The agent gets SIGTERM when unshare (the process the harness stops) dies.
        for a in [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child=SIGTERM",
        ] {
            v.push(a.into());
        }
    }
    v.push("setpriv".into());
    v.push(format!("--bounding-set=-all{list}").into());
    v.push(format!("--inh-caps=-all{list}").into());
    v
}

/// The agent's own process: `pid` itself, or (through unshare) a descendant running `exe`.
fn agent_process(pid: u32, exe: &Path) -> Option<u32> {
    if std::fs::read_link(format!("/proc/{pid}/exe")).ok()? == exe {
        return Some(pid);
    }
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    children
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .find_map(|c| agent_process(c, exe))
}

fn status_field(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    Ok(u64::from_str_radix(hex.trim(), 16)?)
}

/// Waits until the agent runs the agent binary (not setpriv or unshare any more) and checks that
/// it has exactly `caps`, effective and permitted. Returns the agent's pid.
fn check_capabilities(agent: &Agent, exe: &Path, caps: &[&str]) -> Result<u32> {
    let want: u64 = caps.iter().map(|c| bit(c)).fold(0, |a, b| a | b);
    let launched = agent.pid().context("agent not started")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid = loop {
        if let Some(pid) = agent_process(launched, exe) {
            break pid;
        }
        ensure!(
            Instant::now() < deadline,
            "no process of {} under pid {launched}",
            exe.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    for field in ["CapEff:", "CapPrm:"] {
        let have = status_field(pid, field)?;
        ensure!(
            have == want,
            "the agent (pid {pid}) has {field} {have:#x}, want {want:#x} ({caps:?})"
        );
    }
    Ok(pid)
}

/// Stops the agent (process `pid`) with SIGTERM and waits until it is gone. unshare blocks
/// SIGTERM while it waits for its child, so an agent under unshare gets it through
/// `--kill-child=SIGTERM` when unshare is killed.
fn stop(agent: &mut Agent, pid: u32, setup: &Setup) -> Result<()> {
    if setup.own_pid_namespace {
        agent.kill()?;
    } else {
        agent.terminate(Duration::from_secs(10))?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        ensure!(
            Instant::now() < deadline,
            "the agent (pid {pid}) did not stop"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Runs the agent as `setup` says on a sandbox of its own and records what a client sees; an
/// agent that serves is then restarted with the same capabilities and must serve again.
fn observe(setup: &Setup) -> Result<Seen> {
    let sb = sandbox();
    let m = Manifests::new()?;
    let service = Service::new("demo", "web", &VIP.to_string())
        .port(ServicePort::tcp(80).name("http").target(8080))
        .port(ServicePort::udp(53).name("dns").target(5353));
    let slice = |sb: &Sandbox, i: u8| {
        EndpointSlice::ipv4("demo", "web")
            .port(SlicePort::tcp(8080).name("http"))
            .port(SlicePort::udp(5353).name("dns"))
            .endpoint(Endpoint::ready(&sb.backend_v4(i).to_string()))
    };
    m.apply_service(&service)?;
    m.apply_slice(&slice(&sb, 1))?;
    let _backends = sb.backends(2, &[8080, 5353])?;
    let bpffs = sb.bpffs()?;
    let args: Vec<OsString> = vec![
        "run".into(),
        "--manifests".into(),
        m.dir().into(),
        "--cgroup".into(),
        sb.cgroup().path().into(),
        "--bpffs".into(),
        bpffs.path().into(),
    ];
    let exe = std::fs::canonicalize(&sb.tools.agent)?;
    let mut agent = Agent::start_launched(
        &launcher(setup),
        &sb.tools.agent,
        args,
        bpffs.path(),
        m.scratch(),
    )?;
    // The log is returned; printed only if the test fails on it.
    agent.quiet();
    let ready = agent.wait_ready(AGENT_READY_TIMEOUT);
    if ready.is_err() && agent.exited()?.is_some() {
        return Ok(Seen::Exited(agent.log()));
    }
    ready?;
    let pid = check_capabilities(&agent, &exe, setup.caps)?;

    let r = sb.tcp(sa(VIP, 80), 3, &[])?;
    ensure!(
        r.all_ok() && names(&r) == set(&["b1"]),
        "ClusterIP not served by b1: {:?}\n{}",
        r.results,
        agent.log()
    );

    // A connected UDP socket on b1; then b1 leaves the Service (b2 replaces it) while b1 keeps
    // answering, so only the agent can end the socket's flow.
    let stream = sb.spawn_udp_stream(sa(VIP, 53), Duration::from_millis(4000), 20, 300)?;
    std::thread::sleep(Duration::from_millis(1000));
    m.apply_slice(&slice(&sb, 2))?;
    agent.wait_for_lines("svc-agent: synced", 2, Duration::from_secs(5))?;
    let synced = unix_ms();
    let report = sb.finish_udp_stream(stream, Duration::from_secs(15))?;
    let ex = &report.exchanges;
    let first_error = ex.iter().find(|e| !e.ok).map(|e| e.at_ms);
    let stale_closed = match first_error {
        Some(at) => {
            let after: Vec<_> = ex.iter().filter(|e| e.at_ms > at && e.ok).collect();
            ensure!(
                !after.is_empty() && after.iter().all(|e| e.backend.as_deref() == Some("b2")),
                "after the socket was closed it should reach b2: {ex:?}"
            );
            true
        }
        None => {
            // Nothing closed it: it still talked to b1 well after the agent had synced.
            ensure!(
                ex.iter().all(|e| e.backend.as_deref() == Some("b1"))
                    && ex.last().is_some_and(|e| e.at_ms > synced + 500),
                "an unclosed socket should stay with b1 past the sync: {ex:?}"
            );
            false
        }
    };
    let log = agent.log();

    // A restart (an upgrade, a crash) with the same capabilities adopts the pinned maps and
    // swaps its programs into the pinned links (BPF_OBJ_GET, BPF_LINK_UPDATE).
    stop(&mut agent, pid, setup)?;
    agent.restart()?;
    agent.wait_ready(AGENT_READY_TIMEOUT)?;
    let pid = check_capabilities(&agent, &exe, setup.caps)?;
    ensure!(
        agent
            .log()
            .contains("replaced the program of the pinned link"),
        "the restarted agent did not adopt the pinned links:\n{}",
        agent.log()
    );
    let r = sb.tcp(sa(VIP, 80), 3, &[])?;
    ensure!(
        r.all_ok() && names(&r) == set(&["b2"]),
        "ClusterIP not served by b2 after a restart: {:?}\n{}",
        r.results,
        agent.log()
    );
    stop(&mut agent, pid, setup)?;
    Ok(Seen::Serving { stale_closed, log })
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// What a run must show, as measured.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// Serves, and closes the stale socket, with no warning.
    Everything,
    /// Serves; the stale socket stays, and the log has a warning with these words.
    ServesWithoutClosing(&'static [&'static str]),
    /// Exits before ready, with a log holding these words.
    Exits(&'static [&'static str]),
}

fn check(setup: &Setup, want: Want) -> Result<()> {
    let seen = observe(setup).with_context(|| format!("caps {:?}", setup.caps))?;
    let log = seen.log();
    let words_in_log = |words: &[&str]| {
        for w in words {
            ensure!(log.contains(w), "want {w:?} in the agent's log:\n{log}");
        }
        Ok(())
    };
    match (want, &seen) {
        (Want::Everything, Seen::Serving { stale_closed, .. }) => {
            ensure!(*stale_closed, "the stale UDP socket was not closed:\n{log}");
            ensure!(!log.contains(" WARN "), "warnings:\n{log}");
        }
        (Want::ServesWithoutClosing(words), Seen::Serving { stale_closed, .. }) => {
            ensure!(!*stale_closed, "the stale UDP socket was closed:\n{log}");
            words_in_log(&["closing stale UDP sockets"])?;
            words_in_log(words)?;
        }
        (Want::Exits(words), Seen::Exited(_)) => words_in_log(words)?,
        (want, seen) => bail!("want {want:?}, saw {seen:?}"),
    }
    eprintln!(
        "caps {:?}{}: {want:?} as measured",
        setup.caps,
        if setup.own_pid_namespace {
            ", own PID namespace"
        } else {
            ""
        }
    );
    Ok(())
}

/// Runs every check, then fails listing every mismatch.
fn check_all(cases: &[(Vec<&str>, bool, Want)]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(caps, own_pid_namespace, want)| {
            let setup = Setup {
                caps,
                own_pid_namespace: *own_pid_namespace,
            };
            check(&setup, *want).err().map(|e| format!("{e:#}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The DaemonSet's capabilities (from deploy/daemonset.yaml, hostPID included) are enough for
/// everything: the ClusterIP is served and the stale UDP socket closed.
#[test]
fn the_daemonsets_capabilities_serve_and_close_stale_udp_sockets() {
    let ds = daemonset();
    assert!(ds.host_pid, "closing stale UDP sockets needs hostPID");
    let caps: Vec<&str> = ds.caps.iter().map(String::as_str).collect();
    check_all(&[(caps, false, Want::Everything)]);
}

/// Each capability of the DaemonSet is needed: without it, this (as measured) fails.
#[test]
fn each_capability_of_the_daemonset_is_needed() {
    let ds = daemonset();
    let cases: Vec<(Vec<&str>, bool, Want)> = ds
        .caps
        .iter()
        .map(|without| {
            let want = match without.as_str() {
                // Nothing else passes bpf(2)'s checks.
                "SYS_ADMIN" => Want::Exits(&[
                    "the kernel refused the eBPF datapath",
                    "failed to create map",
                    "Operation not permitted",
                ]),
                "NET_ADMIN" => {
                    Want::ServesWithoutClosing(&["SOCK_DESTROY", "Operation not permitted"])
                }
                "SYS_PTRACE" => Want::ServesWithoutClosing(&["/ns/net: Permission denied"]),
                other => panic!(
                    "deploy/daemonset.yaml adds {other}: measure what it is needed for, and add \
                     it here"
                ),
            };
            let caps = ds
                .caps
                .iter()
                .map(String::as_str)
                .filter(|c| c != without)
                .collect();
            (caps, false, want)
        })
        .collect();
    check_all(&cases);
}

/// hostPID is needed for closing stale UDP sockets only: in a PID namespace of its own the
/// agent serves, finds no pod, and says why.
#[test]
fn without_the_host_pid_namespace_stale_udp_sockets_stay_and_the_agent_says_why() {
    let ds = daemonset();
    let caps: Vec<&str> = ds.caps.iter().map(String::as_str).collect();
    check_all(&[(
        caps,
        true,
        Want::ServesWithoutClosing(&["outside the agent's PID namespace", "hostPID"]),
    )]);
}

/// Without CAP_SYS_ADMIN (so without closing stale UDP sockets), the datapath alone needs
/// CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN, each for its own reason.
#[test]
fn without_sys_admin_the_datapath_needs_bpf_perfmon_and_net_admin() {
    let datapath = ["BPF", "PERFMON", "NET_ADMIN"];
    let without =
        |cap: &str| -> Vec<&str> { datapath.iter().copied().filter(|c| *c != cap).collect() };
    check_all(&[
        (
            datapath.to_vec(),
            false,
            // The first step of closing that fails: opening the pod's namespace.
            Want::ServesWithoutClosing(&["/ns/net: Permission denied"]),
        ),
        (
            without("BPF"),
            false,
            Want::Exits(&["failed to create map", "Operation not permitted"]),
        ),
        (
            without("PERFMON"),
            false,
            // Without it the verifier refuses what only a "root" program may do: pointer
            // arithmetic ("... prohibited for !root") or comparisons ("pointer comparison
            // prohibited"), whichever the first program reaches first.
            Want::Exits(&["BPF_PROG_LOAD", "prohibited"]),
        ),
        (
            without("NET_ADMIN"),
            false,
            // A device map (the XDP redirect targets, created with the object) needs it
            // before any program loads.
            Want::Exits(&[
                "failed to create map `SVC_XDP_DEVS`",
                "Operation not permitted",
            ]),
        ),
    ]);
}
