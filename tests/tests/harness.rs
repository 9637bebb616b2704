//! Tests of the harness itself, with no agent: clients in the test cgroup and the client
//! namespace reach the backends directly, and everything is gone after the guards drop.

mod common;

use std::{net::IpAddr, path::Path};

use common::{sa, sandbox};

#[test]
fn tcp_direct_to_backends_v4_and_v6() {
    let sb = sandbox();
    let _b = sb.backends(2, &[8080]).unwrap();
    for (i, name) in [(1, "b1"), (2, "b2")] {
        for ip in [IpAddr::V4(sb.backend_v4(i)), IpAddr::V6(sb.backend_v6(i))] {
            let to = sa(ip, 8080);
            let r = sb.tcp(to, 3, &[]).unwrap();
            assert!(r.all_ok(), "{to}: {r:?}");
            for a in &r.results {
                assert_eq!(a.backend.as_deref(), Some(name));
                assert_eq!(a.peer.as_deref(), Some(to.to_string().as_str()));
            }
        }
    }
}

#[test]
fn udp_direct_connected_and_unconnected() {
    let sb = sandbox();
    let _b = sb.backends(1, &[5353]).unwrap();
    for ip in [IpAddr::V4(sb.backend_v4(1)), IpAddr::V6(sb.backend_v6(1))] {
        let to = sa(ip, 5353);
        let r = sb.udp(to, 2, false).unwrap();
        assert!(r.all_ok(), "{to}: {r:?}");
        assert!(r
            .results
            .iter()
            .all(|a| a.from.as_deref() == Some(to.to_string().as_str())));
        let r = sb.udp(to, 2, true).unwrap();
        assert!(r.all_ok(), "{to}: {r:?}");
        assert!(r
            .results
            .iter()
            .all(|a| a.peer.as_deref() == Some(to.to_string().as_str())
                && a.backend.as_deref() == Some("b1")));
    }
}

/// The client namespace has no route beyond the sandbox: an address nobody owns fails at once
/// (this is also what a client sees for a ClusterIP the agent does not know).
#[test]
fn unknown_address_is_unreachable_not_sent() {
    let sb = sandbox();
    let r = sb.tcp(sa([10, 96, 0, 10], 80), 1, &[]).unwrap();
    let a = &r.results[0];
    assert!(!a.ok);
    assert_eq!(a.errno, Some(libc::ENETUNREACH), "{a:?}");
    assert!(a.elapsed_us < 1_000_000, "{a:?}");
}

/// A closed port on a backend address is refused (111) by the kernel: the probe reports errno
/// and elapsed time as the no-endpoint tests expect.
#[test]
fn refused_reports_errno() {
    let sb = sandbox();
    let _b = sb.backends(1, &[8080]).unwrap();
    let r = sb.tcp(sa(sb.backend_v4(1), 9), 1, &[]).unwrap();
    let a = &r.results[0];
    assert!(!a.ok);
    assert_eq!(a.errno, Some(libc::ECONNREFUSED), "{a:?}");
}

/// A v4-mapped target from an AF_INET6 socket reaches an IPv4 backend, and getpeername shows
/// the mapped form.
#[test]
fn v6_mapped_flag_uses_mapped_address() {
    let sb = sandbox();
    let _b = sb.backends(1, &[8080]).unwrap();
    let r = sb
        .tcp(sa(sb.backend_v4(1), 8080), 1, &["--v6-mapped"])
        .unwrap();
    assert!(r.all_ok(), "{r:?}");
    let want = format!("[::ffff:{}]:8080", sb.backend_v4(1));
    assert_eq!(r.results[0].peer.as_deref(), Some(want.as_str()));
}

#[test]
fn loop_counts_connections() {
    let sb = sandbox();
    let _b = sb.backends(2, &[8080]).unwrap();
    let run = sb
        .spawn_loop(
            sa(sb.backend_v4(2), 8080),
            std::time::Duration::from_millis(300),
        )
        .unwrap();
    let r = sb
        .finish_loop(run, std::time::Duration::from_secs(10))
        .unwrap();
    assert_eq!(r.failed, 0, "{r:?}");
    assert!(r.ok > 10, "{r:?}");
    assert_eq!(r.backends.keys().collect::<Vec<_>>(), ["b2"]);
}

/// Dropping the sandbox removes its namespaces and cgroup and kills its processes.
#[test]
fn teardown_leaves_nothing() {
    let sb = sandbox();
    let b = sb.backends(1, &[8080]).unwrap();
    let backend_pid = b[0].pid();
    let names = [
        sb.client_ns().name().to_owned(),
        sb.server_ns().name().to_owned(),
    ];
    let cg = sb.cgroup().path().to_owned();
    assert!(cg.is_dir());
    drop(b);
    drop(sb);
    let list = svc_tests::sys::run("ip", ["netns", "list"]).unwrap();
    for n in &names {
        assert!(!list.contains(n.as_str()), "{n} still listed: {list}");
    }
    assert!(!cg.exists(), "{} still exists", cg.display());
    assert!(
        !Path::new(&format!("/proc/{backend_pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{backend_pid}/cmdline"))
                .map(|c| !c.contains("svc-probe"))
                .unwrap_or(true),
        "backend {backend_pid} still alive"
    );
}

/// What a harness process killed outright leaves (its pins with a map in them, a namespace,
/// a test cgroup; no drop guard ran) is removed by `sys::clean_stale`, which `cargo xtask test`
/// runs before and after the tests; what a live process owns is kept.
#[test]
fn a_killed_runs_leftovers_are_swept_and_a_live_ones_kept() {
    use svc_tests::sys::{cgroup2_mount, clean_stale, run, Tools, BPFFS_ROOT};
    // A pid whose process is gone: a child that has exited and been reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let dead = child.id();
    let live = std::process::id();
    let pins = Path::new(BPFFS_ROOT).join(format!("svc-test-{dead}-0"));
    let kept = Path::new(BPFFS_ROOT).join(format!("svc-test-{live}-990"));
    let netns = format!("svc-c-{dead}-0");
    let cgroup = cgroup2_mount().unwrap().join(format!("svc-test-{dead}-0"));
    for dir in [&pins, &kept, &cgroup] {
        std::fs::create_dir(dir).unwrap();
    }
    let map = pins.join("SVC_STALE");
    run(
        "bpftool",
        [
            "map",
            "create",
            map.to_str().unwrap(),
            "type",
            "array",
            "key",
            "4",
            "value",
            "4",
            "entries",
            "1",
            "name",
            "svc_stale",
        ],
    )
    .unwrap();
    run("ip", ["netns", "add", &netns]).unwrap();

    let removed = clean_stale(&Tools::locate().agent);
    let kept_there = kept.exists();
    let _ = std::fs::remove_dir(&kept);
    let removed = removed.unwrap();
    assert!(!pins.exists(), "{} left: {removed:?}", pins.display());
    assert!(!cgroup.exists(), "{} left: {removed:?}", cgroup.display());
    let list = run("ip", ["netns", "list"]).unwrap();
    assert!(!list.contains(&netns), "{netns} left: {removed:?}");
    assert!(
        kept_there,
        "a live process's pins were removed: {removed:?}"
    );
}
