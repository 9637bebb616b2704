//! The agent over time: manifest edits, restarts, SIGTERM, uninstall.

mod common;

use std::time::{Duration, Instant};

use common::{names, poll, sa, set, web_service, web_slice, World, VIP};
use svc_tests::{Service, ServicePort};

/// The contract: a manifest change is in the datapath within 1 s.
const SYNC_WITHIN: Duration = Duration::from_secs(1);

/// Edits take effect within 1 s: a new backend set, a new service, and a deleted service
/// (whose ClusterIP is then unknown, so the client's connect goes to the kernel, which has no
/// route for it in the sandbox: not served by any backend).
#[test]
fn manifest_edits_apply_within_a_second() {
    let w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1", "b2"]));

    // Replace the backends with b3 alone.
    w.m.apply_slice(&web_slice(&w.sb, &[3], &[])).unwrap();
    let t0 = Instant::now();
    poll(SYNC_WITHIN, || {
        let r = w.sb.tcp(sa(VIP, 80), 5, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b3"])).then_some(()))
    })
    .unwrap_or_else(|e| panic!("new endpoints not in effect: {e:#}"));
    eprintln!("endpoint change in effect after {:?}", t0.elapsed());

    // A new service.
    w.m.apply_service(
        &Service::new("demo", "api", "10.96.0.30")
            .port(ServicePort::tcp(80).name("http").target(8080)),
    )
    .unwrap();
    let mut slice = web_slice(&w.sb, &[1], &[]);
    slice.service = "api".into();
    slice.name = "api-v4".into();
    w.m.apply_slice(&slice).unwrap();
    poll(SYNC_WITHIN, || {
        let r = w.sb.tcp(sa([10, 96, 0, 30], 80), 3, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b1"])).then_some(()))
    })
    .unwrap_or_else(|e| panic!("new service not in effect: {e:#}"));

    // Delete demo/web entirely.
    w.m.delete_slice(&web_slice(&w.sb, &[], &[])).unwrap();
    w.m.delete_service(&web_service()).unwrap();
    let gone = poll(SYNC_WITHIN, || {
        let r = w.sb.tcp(sa(VIP, 80), 3, &["--timeout-ms", "300"])?;
        Ok(r.results.iter().all(|a| !a.ok).then_some(r))
    })
    .unwrap_or_else(|e| panic!("deleted service still answers: {e:#}"));
    for a in &gone.results {
        assert!(a.backend.is_none(), "{a:?}");
    }
    // The other service is untouched.
    assert!(w.sb.tcp(sa([10, 96, 0, 30], 80), 3, &[]).unwrap().all_ok());
    let list = w.agent.list().unwrap();
    assert!(list.frontend("10.96.0.10:80/TCP").is_none(), "{list:?}");
    assert!(
        !list.cluster_ips.contains(&"10.96.0.10".to_string()),
        "{list:?}"
    );
}

/// SIGKILL the agent and start it again while a client opens new connections back to back:
/// not one connection fails, because the programs and maps stay pinned in the kernel.
#[test]
fn agent_sigkill_and_restart_drops_nothing() {
    let mut w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    // The loop must outlast kill + restart + ready (about 6 s on a loaded 2-core machine, most
    // of it the tc programs' verification); checked below, so a slower one makes the test fail
    // loudly, not pass vacuously.
    let loop_for = Duration::from_secs(12);
    let client = w.sb.spawn_loop(sa(VIP, 80), loop_for).unwrap();
    let started = Instant::now();
    // Let the loop get going before the kill, so traffic spans before/during/after.
    wait_until(started + Duration::from_millis(500));
    w.agent.kill().unwrap();
    wait_until(started + Duration::from_millis(1500));
    w.agent.restart().unwrap();
    w.agent.wait_ready(Duration::from_secs(30)).unwrap();
    let ready_at = started.elapsed();
    assert!(
        ready_at + Duration::from_millis(500) < loop_for,
        "restarted agent ready only after {ready_at:?}: the {loop_for:?} client loop did not \
         cover it"
    );
    let report = w.sb.finish_loop(client, Duration::from_secs(30)).unwrap();
    eprintln!("restart ready after {ready_at:?}; client loop: {report:?}");
    assert_eq!(report.failed, 0, "{report:?}");
    assert!(
        report.ok > 100,
        "too few connections to mean anything: {report:?}"
    );
    assert_eq!(
        report.backends.keys().cloned().collect::<Vec<_>>(),
        ["b1", "b2", "b3"],
        "{report:?}"
    );
    // The restarted agent still applies edits.
    w.m.apply_slice(&web_slice(&w.sb, &[2], &[])).unwrap();
    poll(SYNC_WITHIN, || {
        let r = w.sb.tcp(sa(VIP, 80), 5, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b2"])).then_some(()))
    })
    .unwrap_or_else(|e| panic!("restarted agent does not apply edits: {e:#}"));
}

/// What changed while the agent was down is applied when it comes back.
#[test]
fn restart_applies_changes_made_while_down() {
    let mut w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    w.agent.kill().unwrap();
    w.m.apply_slice(&web_slice(&w.sb, &[3], &[])).unwrap();
    // With the agent down the old state keeps serving.
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert!(
        names(&r).is_subset(&set(&["b1", "b2"])),
        "{:?}",
        r.backends()
    );
    w.agent.restart().unwrap();
    w.agent.wait_ready(Duration::from_secs(30)).unwrap();
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b3"]));
}

/// SIGTERM: the agent exits 0 and the datapath keeps serving from the pinned state.
#[test]
fn sigterm_exits_zero_and_leaves_datapath_serving() {
    let mut w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    let status = w.agent.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "exit status {status}");
    let r = w.sb.tcp(sa(VIP, 80), 30, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1", "b2", "b3"]));
    assert!(r
        .results
        .iter()
        .all(|a| a.peer.as_deref() == Some("10.96.0.10:80")));
    // `list` reads the pinned maps without a running agent.
    let list = w.agent.list().unwrap();
    assert!(list.frontend("10.96.0.10:80/TCP").is_some(), "{list:?}");
}

/// The kernel's verdict on the socket programs comes while the first sync is written: one it
/// refuses stops the agent with the kernel's words and attaches nothing, on a cold start as
/// after a restart, where the previous agent's programs go on serving the pinned maps.
#[test]
fn a_refused_socket_program_stops_the_agent_and_attaches_nothing() {
    // The verdict held back until the first sync is surely written: the attach after it
    // waits for the socket programs, and gets the refusal.
    let refusing = |w: &World| {
        let args: Vec<std::ffi::OsString> = vec![
            "run".into(),
            "--manifests".into(),
            w.m.dir().into(),
            "--cgroup".into(),
            w.sb.cgroup().path().into(),
            "--bpffs".into(),
            w.bpffs.path().into(),
        ];
        let mut agent = svc_tests::Agent::start_launched(
            &[
                "env".into(),
                "SVC_TEST_SOCKET_REFUSED=getpeername6".into(),
                "SVC_TEST_SOCKET_VERIFY_PAUSE_MS=2000".into(),
            ],
            &w.sb.tools.agent,
            args,
            w.bpffs.path(),
            w.m.scratch(),
        )
        .unwrap();
        agent.quiet();
        let status = poll(Duration::from_secs(60), || agent.exited()).unwrap();
        assert!(!status.success(), "exit status {status}");
        let log = agent.all_logs();
        assert!(log.contains("getpeername6: refused by the kernel"), "{log}");
        assert_eq!(
            agent.count_lines(svc_tests::agent::SERVING_LINE),
            0,
            "{log}"
        );
        (log, agent.count_lines(svc_tests::agent::SYNCED_LINE))
    };

    let mut w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    let before = cgroup_programs(w.sb.cgroup().path());
    assert_eq!(before.len(), 9, "{before:?}");
    assert!(w
        .agent
        .terminate(Duration::from_secs(10))
        .unwrap()
        .success());
    // A change while no agent runs, which the refusing agent's first sync writes.
    w.m.apply_slice(&web_slice(&w.sb, &[3], &[])).unwrap();
    let (log, synced) = refusing(&w);
    assert_eq!(synced, 1, "the first sync before the verdict: {log}");
    assert_eq!(cgroup_programs(w.sb.cgroup().path()), before);
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b3"]));

    // A cold start: the attach after the first sync waits for the verdict, and attaches
    // nothing.
    svc_tests::agent::uninstall(
        &w.sb.tools.agent,
        w.bpffs.path(),
        Some(w.sb.cgroup().path()),
    )
    .unwrap();
    let w = World {
        bpffs: w.sb.bpffs().unwrap(),
        ..w
    };
    let (log, _) = refusing(&w);
    assert!(
        log.lines()
            .any(|l| l.contains("attaching: ") && l.contains("getpeername6: refused by the kernel")),
        "{log}"
    );
    assert_eq!(
        cgroup_programs(w.sb.cgroup().path()),
        Vec::<serde_json::Value>::new()
    );
}

/// `svc-agent uninstall` leaves nothing: no pins, no directory, no program on the cgroup, and
/// the ClusterIP is no longer served.
#[test]
fn uninstall_removes_everything() {
    let mut w = World::start(2, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    assert!(w.sb.tcp(sa(VIP, 80), 3, &[]).unwrap().all_ok());
    let status = w.agent.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "exit status {status}");
    // Before: something is pinned and attached, so the checks below can fail.
    assert!(!w.bpffs.entries().is_empty());
    assert!(!cgroup_programs(w.sb.cgroup().path()).is_empty());

    svc_tests::agent::uninstall(
        &w.sb.tools.agent,
        w.bpffs.path(),
        Some(w.sb.cgroup().path()),
    )
    .unwrap();
    assert!(
        !w.bpffs.path().exists(),
        "{} still has {:?}",
        w.bpffs.path().display(),
        w.bpffs.entries()
    );
    let progs = cgroup_programs(w.sb.cgroup().path());
    assert!(progs.is_empty(), "still attached: {progs:?}");
    let r = w.sb.tcp(sa(VIP, 80), 3, &["--timeout-ms", "300"]).unwrap();
    assert!(
        r.results.iter().all(|a| !a.ok && a.backend.is_none()),
        "{r:?}"
    );
}

/// Programs attached to a cgroup, per `bpftool -j cgroup show`.
fn cgroup_programs(cg: &std::path::Path) -> Vec<serde_json::Value> {
    let out = svc_tests::sys::run(
        "bpftool",
        [
            "-j".as_ref(),
            "cgroup".as_ref(),
            "show".as_ref(),
            cg.as_os_str(),
        ],
    )
    .expect("bpftool (apt-get install bpftool)");
    if out.trim().is_empty() {
        return Vec::new();
    }
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("bpftool output {out:?}: {e}"))
}

/// Sleeps until `t`: used only to place events inside a running client loop, never to wait
/// for a condition.
fn wait_until(t: Instant) {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
}

/// Issue 7, item 3 (and 1): SIGKILL and restart keep clients where they were: a client with
/// sessionAffinity reaches the same backend after the restart, and unconnected UDP sockets
/// that live across the restart keep their backends.
#[test]
fn affinity_and_udp_sockets_survive_an_agent_restart() {
    let mut w = World::start(3, &[8080, 5353], |sb, m| {
        m.apply_service(&web_service().affinity(3600)).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
        m.apply_service(
            &Service::new("demo", "dns", "10.96.0.11")
                .port(ServicePort::udp(53).name("dns").target(5353)),
        )
        .unwrap();
        let mut s = svc_tests::EndpointSlice::ipv4("demo", "dns")
            .port(svc_tests::SlicePort::udp(5353).name("dns"));
        for i in 1..=3 {
            s = s.endpoint(svc_tests::Endpoint::ready(&sb.backend_v4(i).to_string()));
        }
        m.apply_slice(&s).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    let chosen = names(&r);
    assert_eq!(chosen.len(), 1, "{:?}", r.backends());
    let udp =
        w.sb.spawn_udp_unconnected(
            sa([10, 96, 0, 11], 53),
            8,
            Duration::from_millis(5000),
            20,
            500,
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    w.agent.kill().unwrap();
    w.agent.restart().unwrap();
    w.agent.wait_ready(Duration::from_secs(30)).unwrap();
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    assert_eq!(names(&r), chosen, "affinity lost in the restart");
    let report =
        w.sb.finish_udp_stream(udp, Duration::from_secs(20))
            .unwrap();
    for s in 0..8 {
        let seen: std::collections::BTreeSet<_> = report
            .exchanges
            .iter()
            .filter(|e| e.socket == s)
            .map(|e| {
                assert!(e.ok, "{e:?}");
                e.backend.clone().unwrap()
            })
            .collect();
        assert_eq!(seen.len(), 1, "socket {s} changed backend: {seen:?}");
    }
}

/// An upgrade over the previous map layout (`SVC_SLOTS` of layout 1, a slot an entry, and the
/// `SVC_SERVICES` of layout 2 that leads into it): the new agent builds its maps beside the
/// pinned older ones, carries the frontends over under their ids, swaps its programs in and
/// removes the older pins; the Service keeps answering all along, and the client keeps its
/// sessionAffinity backend, as the ids stayed. Needs a svc-agent of the previous layout in
/// `SVC_SLOTS_V1_AGENT_BIN`: CI builds no older agent, so it is ignored there; run by hand
/// (`--ignored`) with one built from 897cc75.
#[test]
#[ignore = "needs SVC_SLOTS_V1_AGENT_BIN, a svc-agent of SVC_SLOTS layout 1"]
fn an_agent_of_the_previous_map_layout_is_replaced_in_place() {
    use std::os::fd::AsFd;
    use svc_common::{svc_flags, ServiceKey, ServiceValue};
    let old = std::env::var_os("SVC_SLOTS_V1_AGENT_BIN")
        .expect("SVC_SLOTS_V1_AGENT_BIN: a svc-agent of SVC_SLOTS layout 1");
    // The frontend ids of the pinned services map `pin`.
    let ids = |w: &World, pin: &str| -> Vec<u32> {
        let m = aya::maps::MapData::from_pin(w.bpffs.path().join(pin)).expect(pin);
        let all: Vec<(ServiceKey, ServiceValue)> =
            svc_agent::sys::dump_hash(m.fd().as_fd()).expect(pin);
        let mut ids: Vec<u32> = (all.iter())
            .filter(|(_, v)| v.flags & svc_flags::ADDR_MARKER == 0)
            .map(|(_, v)| v.id)
            .collect();
        ids.sort();
        ids
    };
    let old = std::path::PathBuf::from(old);
    let mut w = World::start_bin(Some(&old), 3, &[8080], &[], |sb, m| {
        m.apply_service(&web_service().affinity(3600)).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    let pins = w.bpffs.entries();
    for pin in ["SVC_SERVICES_v2", "SVC_SLOTS_v1"] {
        assert!(pins.contains(&pin.to_string()), "{pins:?}");
    }
    let ids_before = ids(&w, "SVC_SERVICES_v2");
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    let chosen = names(&r);
    assert_eq!(chosen.len(), 1, "{:?}", r.backends());

    // New connections back to back across the upgrade: the older programs answer until the
    // new ones replace them, and not one connection fails in between.
    upgrade_under_a_loop(&mut w, |_| {});
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    assert_eq!(names(&r), chosen, "{:?}", r.backends());
    assert_eq!(ids(&w, "SVC_SERVICES_v3"), ids_before);
    let log = w.agent.log();
    assert!(
        log.contains("carried the frontends of the slots map of layout 1 over"),
        "{log}"
    );
    let pins = w.bpffs.entries();
    for (old, new) in [
        ("SVC_SERVICES_v2", "SVC_SERVICES_v3"),
        ("SVC_SLOTS_v1", "SVC_SLOTS_v2"),
    ] {
        assert!(pins.contains(&new.to_string()), "{pins:?}");
        assert!(!pins.contains(&old.to_string()), "{pins:?}");
    }
    assert!(log.contains("removed a pin of another map layout"), "{log}");
}

/// Replaces the running agent by this build's under a loop of new connections to the
/// Service, doing `meanwhile` while no agent runs: not one connection may fail.
fn upgrade_under_a_loop(w: &mut World, meanwhile: impl FnOnce(&World)) {
    let loop_for = Duration::from_secs(12);
    let client = w.sb.spawn_loop(sa(VIP, 80), loop_for).unwrap();
    let started = Instant::now();
    wait_until(started + Duration::from_millis(500));
    w.agent.kill().unwrap();
    meanwhile(w);
    w.agent.set_bin(&w.sb.tools.agent.clone());
    w.agent.restart().unwrap();
    w.agent.wait_ready(Duration::from_secs(30)).unwrap();
    let ready_at = started.elapsed();
    assert!(
        ready_at + Duration::from_millis(500) < loop_for,
        "upgraded agent ready only after {ready_at:?}: the client loop did not cover it"
    );
    let report = w.sb.finish_loop(client, Duration::from_secs(30)).unwrap();
    assert_eq!(report.failed, 0, "{report:?}\n{}", w.agent.log());
    assert!(
        report.ok > 100,
        "too few connections to mean anything: {report:?}"
    );
}

/// An upgrade over `SVC_BACKENDS` of layout 1 (a hash keyed by id): the new agent carries the
/// backends into its array under their ids and, until its programs are attached, writes
/// every backend into the older map too, which the programs still attached read. The
/// Service's backends are replaced while no agent runs, so the new agent's first sync
/// switches it to backends of new ids before its own programs are attached: not one
/// connection of a loop across the upgrade fails, and the older pin is gone after. Needs a
/// svc-agent of that layout in `SVC_BACKENDS_V1_AGENT_BIN`: CI builds no older agent, so it
/// is ignored there; run by hand (`--ignored`) with one built from b1cd40c.
#[test]
#[ignore = "needs SVC_BACKENDS_V1_AGENT_BIN, a svc-agent of SVC_BACKENDS layout 1"]
fn an_agent_of_the_backends_hash_is_replaced_in_place() {
    let old = std::env::var_os("SVC_BACKENDS_V1_AGENT_BIN")
        .expect("SVC_BACKENDS_V1_AGENT_BIN: a svc-agent of SVC_BACKENDS layout 1");
    let old = std::path::PathBuf::from(old);
    let mut w = World::start_bin(Some(&old), 6, &[8080], &[], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    let pins = w.bpffs.entries();
    assert!(pins.contains(&"SVC_BACKENDS_v1".to_string()), "{pins:?}");
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());

    upgrade_under_a_loop(&mut w, |w| {
        w.m.apply_slice(&web_slice(&w.sb, &[4, 5, 6], &[])).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    assert_eq!(names(&r), set(&["b4", "b5", "b6"]), "{:?}", r.backends());
    let log = w.agent.log();
    assert!(
        log.contains("carried the backends of layout 1 (a hash) over"),
        "{log}"
    );
    let pins = w.bpffs.entries();
    assert!(pins.contains(&"SVC_BACKENDS_v2".to_string()), "{pins:?}");
    assert!(!pins.contains(&"SVC_BACKENDS_v1".to_string()), "{pins:?}");
}

/// CPU time (user + system) of process `pid` so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After the command name in parentheses: field 3 on; utime and stime are 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let ticks = f[11] + f[12];
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// An agent whose API server cannot be reached yet (an outage as the node boots) waits for
/// its first lists with the watcher's backoff: it must not spin a core meanwhile, on a node
/// whose workloads need it. (The pin check is due every 2 s and waits for an attach that
/// only the first sync brings.)
#[test]
fn an_agent_waiting_for_an_unreachable_api_server_does_not_spin() {
    let sb = common::sandbox();
    let bpffs = sb.bpffs().unwrap();
    let dir = svc_tests::TempDir::new("svc-unreachable").unwrap();
    let kubeconfig = unreachable_kubeconfig(dir.path());
    let started = Instant::now();
    let agent = svc_tests::Agent::start_kube(
        &sb.tools.agent,
        &kubeconfig,
        "node-1",
        sb.cgroup().path(),
        bpffs.path(),
        &[],
    )
    .unwrap();
    let pid = agent.pid().unwrap();
    // Past the verifier's work (the object loads beside the lists, which fail here: on a
    // loaded machine that takes longer than the first seconds), the first pin check (2 s) and
    // the first failed lists.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !agent.log().contains("loaded the tc programs") {
        assert!(
            Instant::now() < deadline,
            "the programs not loaded in 60 s:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(3));
    let (t0, c0) = (Instant::now(), cpu_time(pid));
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_time(pid) - c0;
    let wall = t0.elapsed();
    assert!(
        used < wall / 4,
        "the waiting agent used {used:?} of CPU in {wall:?}"
    );
    // Three watches failing on their own backoff: one clear line with the address and the OS
    // error, then at most one every 10 s (the issue: "not five a second each logged twice").
    let running = started.elapsed();
    let log = agent.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("watch_"))
        .collect();
    let first = lines
        .first()
        .unwrap_or_else(|| panic!("no line about the failing watches:\n{log}"));
    assert!(
        first.contains("https://127.0.0.1:1") && first.contains("(os error 111)"),
        "the line does not name the address and the OS error: {first}"
    );
    eprintln!("{} lines in {running:?}; the first: {first}", lines.len());
    let bound = 1 + running.as_secs() as usize / 10 + 1;
    assert!(
        lines.len() <= bound,
        "{} lines about the failing watches in {running:?} (at most {bound}):\n{}",
        lines.len(),
        lines.join("\n")
    );
}

/// A kubeconfig whose API server nothing serves (port 1 of loopback).
fn unreachable_kubeconfig(dir: &std::path::Path) -> std::path::PathBuf {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \
         'https://127.0.0.1:1', insecure-skip-tls-verify: true}\nusers:\n- name: u\n  user: \
         {token: x}\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\n\
         current-context: c\n",
    )
    .unwrap();
    kubeconfig
}

/// Waits until the agent says `line`, failing if it exits first.
fn wait_for_line(agent: &mut svc_tests::Agent, line: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !agent.log().contains(line) {
        if let Some(status) = agent.exited().unwrap() {
            panic!("the agent exited ({status}):\n{}", agent.log());
        }
        assert!(
            Instant::now() < deadline,
            "no {line:?} in 60 s:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts the agent with kube-proxy's command line `line` (no subcommand), the test's own
/// cgroup and bpffs added, never the node's; with the directory of its logs.
fn start_kube_proxy_line(
    sb: &svc_tests::Sandbox,
    bpffs: &std::path::Path,
    mut line: Vec<String>,
) -> (svc_tests::Agent, svc_tests::TempDir) {
    line.push(format!("--cgroup={}", sb.cgroup().path().display()));
    line.push(format!("--bpffs={}", bpffs.display()));
    let logs = svc_tests::TempDir::new("svc-agent-logs").unwrap();
    let agent = svc_tests::Agent::start_with_args(
        &sb.tools.agent,
        line.iter().map(Into::into).collect(),
        bpffs,
        logs.path(),
    )
    .unwrap();
    (agent, logs)
}

/// kubeadm's kube-proxy DaemonSet runs `kube-proxy --config=/var/lib/kube-proxy/config.conf
/// --hostname-override=$(NODE_NAME)`: the same command line (no subcommand; the test's own
/// cgroup and bpffs added, never the node's) starts svc, which reads kubeadm's file.
#[test]
fn kubeadms_kube_proxy_command_line_starts_svc() {
    let sb = common::sandbox();
    let bpffs = sb.bpffs().unwrap();
    let dir = svc_tests::TempDir::new("svc-kubeadm-line").unwrap();
    let kubeconfig = unreachable_kubeconfig(dir.path());
    let healthz = svc_tests::agent::free_loopback_port().unwrap();
    let metrics = svc_tests::agent::free_loopback_port().unwrap();
    let config = dir.path().join("config.conf");
    // What kubeadm writes (`kubeadm config print init-defaults --component-configs
    // KubeProxyConfiguration`), but for the addresses of the test.
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             bindAddress: 0.0.0.0\nclientConnection:\n  acceptContentTypes: \"\"\n  burst: 0\n\
             \x20 contentType: \"\"\n  kubeconfig: {}\n  qps: 0\nclusterCIDR: \"\"\n\
             configSyncPeriod: 0s\nconntrack:\n  maxPerCore: null\n  min: null\n\
             \x20 tcpCloseWaitTimeout: null\n  tcpEstablishedTimeout: null\n\
             healthzBindAddress: {healthz}\nhostnameOverride: \"\"\n\
             metricsBindAddress: {metrics}\nmode: \"\"\nnodePortAddresses: null\n\
             oomScoreAdj: null\nportRange: \"\"\nshowHiddenMetricsForVersion: \"\"\n",
            kubeconfig.display()
        ),
    )
    .unwrap();
    let (mut agent, _logs) = start_kube_proxy_line(
        &sb,
        bpffs.path(),
        vec![
            format!("--config={}", config.display()),
            "--hostname-override=node-1".into(),
        ],
    );
    wait_for_line(&mut agent, "watching the Kubernetes API");
    wait_for_line(&mut agent, "loaded the tc programs");
    let (status, body) = svc_tests::agent::http_get(healthz, "/livez").unwrap();
    assert_eq!(
        status, 200,
        "/livez at the file's healthzBindAddress: {body}"
    );
}

/// A kube-proxy command line with its common flags starts svc: those that apply set what
/// they mean, the others are named, with why, in one warning.
#[test]
fn kube_proxys_common_flags_start_svc() {
    let sb = common::sandbox();
    let bpffs = sb.bpffs().unwrap();
    let dir = svc_tests::TempDir::new("svc-kube-proxy-flags").unwrap();
    let kubeconfig = unreachable_kubeconfig(dir.path());
    let healthz = svc_tests::agent::free_loopback_port().unwrap();
    let metrics = svc_tests::agent::free_loopback_port().unwrap();
    let line = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--hostname-override=node-1".into(),
        "--proxy-mode=iptables".into(),
        "--cluster-cidr=10.244.0.0/16".into(),
        "--bind-address=0.0.0.0".into(),
        "--oom-score-adj=-999".into(),
        "--conntrack-max-per-core=0".into(),
        "--feature-gates=SomeGate=true".into(),
        "--masquerade-all".into(),
        "--iptables-sync-period=30s".into(),
        format!("--healthz-bind-address={healthz}"),
        format!("--metrics-bind-address={metrics}"),
        "--conntrack-tcp-timeout-established=2h0m0s".into(),
        "--v=2".into(),
    ];
    let (mut agent, _logs) = start_kube_proxy_line(&sb, bpffs.path(), line);
    wait_for_line(&mut agent, "loaded the tc programs");
    let log = agent.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("kube-proxy flags ignored"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    for flag in [
        "--proxy-mode (",
        "--cluster-cidr (",
        "--oom-score-adj (",
        "--conntrack-max-per-core (",
        "--feature-gates (",
        "--masquerade-all (",
        "--iptables-sync-period (",
    ] {
        assert!(
            warnings[0].contains(flag),
            "{flag} not named: {}",
            warnings[0]
        );
    }
    assert!(
        !warnings[0].contains("--bind-address") && !warnings[0].contains("--conntrack-tcp"),
        "flags that apply named as ignored: {}",
        warnings[0]
    );
    let timeouts = poll(Duration::from_secs(30), || {
        let t = agent.list()?.ct_timeouts;
        Ok((t.tcp_established_s == 7200).then_some(t))
    });
    assert!(
        timeouts.is_ok(),
        "--conntrack-tcp-timeout-established=2h0m0s not in effect: {timeouts:?}"
    );
    let (status, _) = svc_tests::agent::http_get(healthz, "/livez").unwrap();
    assert_eq!(status, 200, "/livez at --healthz-bind-address");
}

/// kube-proxy takes `--cleanup` anywhere among its flags: `svc-agent --v=2 --bpffs DIR
/// --cleanup` is `svc-agent uninstall --bpffs DIR`.
#[test]
fn cleanup_anywhere_in_the_command_line_uninstalls() {
    let sb = common::sandbox();
    let bpffs = sb.bpffs().unwrap();
    let manifests = svc_tests::Manifests::new().unwrap();
    let mut agent = sb.agent(&bpffs, &manifests).unwrap();
    agent.terminate(Duration::from_secs(10)).unwrap();
    assert!(!bpffs.entries().is_empty(), "nothing pinned to clean up");
    let out = std::process::Command::new(&sb.tools.agent)
        .args(["--v=2", "--hostname-override=node-1", "--bpffs"])
        .arg(bpffs.path())
        .arg("--cleanup")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "svc-agent ... --cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        bpffs.entries().is_empty(),
        "pins left after --cleanup: {:?}",
        bpffs.entries()
    );
}
