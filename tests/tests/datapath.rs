//! What a client sees through a ClusterIP once the agent has synced: which backends answer,
//! which addresses the socket API reports, and how unknown ports and empty services fail.

mod common;

use std::collections::BTreeSet;
use std::net::Ipv6Addr;
use std::time::Duration;

use common::{names, poll, sa, set, web_service, web_slice, World, VIP};
use svc_tests::{Endpoint, EndpointSlice, Service, ServicePort, SlicePort};

/// 60 connections over 3 ready endpoints and 1 not-ready one (whose server runs and would
/// answer): every ready backend is seen, the not-ready one never, and getpeername() shows the
/// ClusterIP.
#[test]
fn reaches_every_ready_backend_and_only_ready_ones() {
    let w = World::start(4, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[4])).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 60, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1", "b2", "b3"]), "{:?}", r.backends());
    for a in &r.results {
        assert_eq!(a.peer.as_deref(), Some("10.96.0.10:80"), "{a:?}");
    }

    let list = w.agent.list().unwrap();
    let svc = list
        .frontend("10.96.0.10:80/TCP")
        .unwrap_or_else(|| panic!("no frontend in {list:?}"));
    let mut backends = svc.backends.clone();
    backends.sort();
    let want: Vec<String> = (1..=3)
        .map(|i| format!("{}:8080", w.sb.backend_v4(i)))
        .collect();
    assert_eq!(backends, want);
    assert!(
        list.cluster_ips.contains(&"10.96.0.10".to_string()),
        "{list:?}"
    );
}

/// A dual-stack service: the IPv6 ClusterIP reaches the IPv6 endpoints (TCP and UDP) and
/// reports itself as the peer; the IPv4 one keeps working beside it.
#[test]
fn dual_stack_service() {
    let vip6: Ipv6Addr = "fd00:96::10".parse().unwrap();
    let w = World::start(3, &[8080, 5353], |sb, m| {
        let svc = Service::new("demo", "ds", "fd00:96::10")
            .also_ip("10.96.0.11")
            .port(ServicePort::tcp(80).name("http").target(8080))
            .port(ServicePort::udp(53).name("dns").target(5353));
        m.apply_service(&svc).unwrap();
        for (family, v6) in [("IPv4", false), ("IPv6", true)] {
            let mut s = EndpointSlice::new("demo", "ds", &family.to_lowercase(), family)
                .port(SlicePort::tcp(8080).name("http"))
                .port(SlicePort::udp(5353).name("dns"));
            for i in 1..=3 {
                let ip = if v6 {
                    sb.backend_v6(i).to_string()
                } else {
                    sb.backend_v4(i).to_string()
                };
                s = s.endpoint(Endpoint::ready(&ip));
            }
            m.apply_slice(&s).unwrap();
        }
    });
    let r = w.sb.tcp(sa(vip6, 80), 30, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1", "b2", "b3"]));
    assert!(r
        .results
        .iter()
        .all(|a| a.peer.as_deref() == Some("[fd00:96::10]:80")));

    let r = w.sb.udp(sa(vip6, 53), 10, false).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert!(r
        .results
        .iter()
        .all(|a| a.from.as_deref() == Some("[fd00:96::10]:53")));

    let r = w.sb.tcp(sa([10, 96, 0, 11], 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert!(names(&r).is_subset(&set(&["b1", "b2", "b3"])));
}

/// An AF_INET6 socket connecting to ::ffff:VIP is load balanced like an IPv4 one, and its
/// peer is the mapped ClusterIP.
#[test]
fn v4_mapped_ipv6_socket() {
    let w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 30, &["--v6-mapped"]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1", "b2", "b3"]));
    assert!(
        r.results
            .iter()
            .all(|a| a.peer.as_deref() == Some("[::ffff:10.96.0.10]:80")),
        "{:?}",
        r.results
    );
}

/// UDP: an unconnected socket's replies come "from" the ClusterIP (recvmsg rewriting), a
/// connected socket's peer is the ClusterIP, and only ready backends answer.
#[test]
fn udp_replies_come_from_the_cluster_ip() {
    let w = World::start(3, &[5353], |sb, m| {
        m.apply_service(
            &Service::new("demo", "dns", &VIP.to_string())
                .port(ServicePort::udp(53).name("dns").target(5353)),
        )
        .unwrap();
        m.apply_slice(
            &EndpointSlice::ipv4("demo", "dns")
                .port(SlicePort::udp(5353).name("dns"))
                .endpoint(Endpoint::ready(&sb.backend_v4(1).to_string()))
                .endpoint(Endpoint::ready(&sb.backend_v4(2).to_string()))
                .endpoint(Endpoint::not_ready(&sb.backend_v4(3).to_string())),
        )
        .unwrap();
    });
    let r = w.sb.udp(sa(VIP, 53), 20, false).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    for a in &r.results {
        assert_eq!(a.from.as_deref(), Some("10.96.0.10:53"), "{a:?}");
    }
    assert!(
        names(&r).is_subset(&set(&["b1", "b2"])),
        "{:?}",
        r.backends()
    );

    let r = w.sb.udp(sa(VIP, 53), 20, true).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    for a in &r.results {
        assert_eq!(a.peer.as_deref(), Some("10.96.0.10:53"), "{a:?}");
    }
    assert!(
        names(&r).is_subset(&set(&["b1", "b2"])),
        "{:?}",
        r.backends()
    );
}

/// Two service ports resolved by name against slice ports listed in the other order, with
/// numbers unlike the service ports (and a targetPort name that matches neither): each
/// service port reaches only the servers on its own slice port.
#[test]
fn multiple_and_named_ports() {
    let w = World::start(0, &[], |sb, m| {
        m.apply_service(
            &Service::new("demo", "multi", &VIP.to_string())
                .port(ServicePort::tcp(80).name("http").target_name("web"))
                .port(ServicePort::tcp(9090).name("metrics").target_name("prom")),
        )
        .unwrap();
        m.apply_slice(
            &EndpointSlice::ipv4("demo", "multi")
                .port(SlicePort::tcp(9100).name("metrics"))
                .port(SlicePort::tcp(8080).name("http"))
                .endpoint(Endpoint::ready(&sb.backend_v4(1).to_string()))
                .endpoint(Endpoint::ready(&sb.backend_v4(2).to_string())),
        )
        .unwrap();
    });
    // One server per (address, port), named after the port it serves.
    let _servers: Vec<_> = (1..=2)
        .flat_map(|i| {
            [
                w.sb.backend(&format!("web{i}"), i, &[8080]).unwrap(),
                w.sb.backend(&format!("metrics{i}"), i, &[9100]).unwrap(),
            ]
        })
        .collect();
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["web1", "web2"]));
    let r = w.sb.tcp(sa(VIP, 9090), 20, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["metrics1", "metrics2"]));
    assert!(r
        .results
        .iter()
        .all(|a| a.peer.as_deref() == Some("10.96.0.10:9090")));
}

/// Connections that no backend can serve are refused at once (ECONNREFUSED from connect(),
/// not a timeout): a service without endpoints, one whose endpoints are all not ready, and a
/// port the ClusterIP does not define.
#[test]
fn no_backend_is_refused_immediately() {
    refused_immediately(&[], libc::ECONNREFUSED);
}

/// The same on a kernel without bpf_set_retval (before 5.18; `--kernel-as 5.15` forces its
/// fallback here): refused as at once, with EPERM, which the agent said it would, once.
#[test]
fn no_backend_is_refused_with_eperm_without_bpf_set_retval() {
    let w = refused_immediately(&["--kernel-as", "5.15"], libc::EPERM);
    let log = w.agent.log();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("lacks helper bpf_set_retval"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains("fails with EPERM"), "{}", said[0]);
}

/// Three frontends no backend serves, with the agent run with `extra` flags: each
/// connect() fails with `errno` at once.
fn refused_immediately(extra: &[&str], errno: i32) -> World {
    let w = World::start_with(1, &[8080], extra, |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1], &[])).unwrap();
        // No EndpointSlice at all.
        m.apply_service(
            &Service::new("demo", "empty", "10.96.0.20").port(ServicePort::tcp(80).target(8080)),
        )
        .unwrap();
        // A slice with only a not-ready endpoint.
        m.apply_service(
            &Service::new("demo", "down", "10.96.0.21").port(ServicePort::tcp(80).target(8080)),
        )
        .unwrap();
        m.apply_slice(
            &EndpointSlice::ipv4("demo", "down")
                .port(SlicePort::tcp(8080))
                .endpoint(Endpoint::not_ready(&sb.backend_v4(1).to_string())),
        )
        .unwrap();
    });
    // The served port works, so the refusals below are about the frontends, not the agent.
    assert!(w.sb.tcp(sa(VIP, 80), 3, &[]).unwrap().all_ok());
    for to in [
        sa([10, 96, 0, 20], 80),
        sa([10, 96, 0, 21], 80),
        sa(VIP, 81),
    ] {
        let r = w.sb.tcp(to, 3, &[]).unwrap();
        for a in &r.results {
            assert!(!a.ok, "{to}: {a:?}");
            assert_eq!(a.errno, Some(errno), "{to}: {a:?}");
            // An immediate refusal takes microseconds; 1 s only absorbs a loaded machine, and
            // is still half the probe's 2 s connect timeout, so a timeout cannot pass.
            assert!(a.elapsed_us < 1_000_000, "{to}: {a:?}");
        }
    }
    w
}

/// sessionAffinity ClientIP: 15 consecutive connections land on one backend; a service
/// without affinity over the same backends spreads (the control that makes the first part
/// mean something).
#[test]
fn session_affinity_client_ip() {
    let w = World::start(3, &[8080], |sb, m| {
        m.apply_service(
            &Service::new("demo", "sticky", &VIP.to_string())
                .port(ServicePort::tcp(80).name("http").target(8080))
                .affinity(10800),
        )
        .unwrap();
        let mut s = web_slice(sb, &[1, 2, 3], &[]);
        s.service = "sticky".into();
        s.name = "sticky-v4".into();
        m.apply_slice(&s).unwrap();
        m.apply_service(
            &Service::new("demo", "web", "10.96.0.12")
                .port(ServicePort::tcp(80).name("http").target(8080)),
        )
        .unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 15, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r).len(), 1, "affinity broken: {:?}", r.backends());

    let r = w.sb.tcp(sa([10, 96, 0, 12], 80), 15, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert!(
        names(&r).len() > 1,
        "no spread without affinity: {:?}",
        r.backends()
    );

    let list = w.agent.list().unwrap();
    assert_eq!(
        list.frontend("10.96.0.10:80/TCP")
            .and_then(|s| s.affinity_timeout_s),
        Some(10800),
        "{list:?}"
    );
    assert_eq!(
        list.frontend("10.96.0.12:80/TCP")
            .and_then(|s| s.affinity_timeout_s),
        None,
        "{list:?}"
    );
}

/// A dual-stack Service with sessionAffinity, reached by one pod over both families in turn:
/// each family keeps its own backend, as kube-proxy's (one proxier per family, each with its
/// own affinity). An IPv4 choice is no backend of the IPv6 ClusterIP, and the other way
/// round, so a choice shared by both would be replaced at every change of family.
#[test]
fn dual_stack_affinity_is_kept_per_family() {
    let vip6: Ipv6Addr = "fd00:96::10".parse().unwrap();
    let w = World::start(3, &[8080], |sb, m| {
        let svc = Service::new("demo", "ds", "10.96.0.11")
            .also_ip("fd00:96::10")
            .port(ServicePort::tcp(80).name("http").target(8080))
            .affinity(10800);
        m.apply_service(&svc).unwrap();
        for (family, v6) in [("IPv4", false), ("IPv6", true)] {
            let mut s = EndpointSlice::new("demo", "ds", &family.to_lowercase(), family)
                .port(SlicePort::tcp(8080).name("http"));
            for i in 1..=3 {
                let ip = if v6 {
                    sb.backend_v6(i).to_string()
                } else {
                    sb.backend_v4(i).to_string()
                };
                s = s.endpoint(Endpoint::ready(&ip));
            }
            m.apply_slice(&s).unwrap();
        }
    });
    let (mut v4, mut v6) = (BTreeSet::new(), BTreeSet::new());
    for _ in 0..8 {
        let r = w.sb.tcp(sa([10, 96, 0, 11], 80), 1, &[]).unwrap();
        assert!(r.all_ok(), "failures: {:?}", r.failures());
        v4.extend(names(&r));
        let r = w.sb.tcp(sa(vip6, 80), 1, &[]).unwrap();
        assert!(r.all_ok(), "failures: {:?}", r.failures());
        v6.extend(names(&r));
    }
    // Eight IPv4 connections on one backend by chance: 3^-7.
    assert_eq!(v4.len(), 1, "IPv4 affinity broken: {v4:?}");
    assert_eq!(v6.len(), 1, "IPv6 affinity broken: {v6:?}");
}

/// Terminating endpoints: ignored while a ready one exists; when none is ready, those still
/// serving take the traffic (kube-proxy's fallback, so a rollout drains instead of refusing),
/// and a terminating endpoint that no longer serves never does.
#[test]
fn terminating_endpoints_are_a_fallback_only() {
    let slice = |sb: &svc_tests::Sandbox, with_ready: bool| {
        let mut s = EndpointSlice::ipv4("demo", "web").port(SlicePort::tcp(8080).name("http"));
        if with_ready {
            s = s.endpoint(Endpoint::ready(&sb.backend_v4(1).to_string()));
        }
        s.endpoint(Endpoint::terminating(&sb.backend_v4(2).to_string(), true))
            .endpoint(Endpoint::terminating(&sb.backend_v4(3).to_string(), false))
    };
    let w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&slice(sb, true)).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1"]));

    w.m.apply_slice(&slice(&w.sb, false)).unwrap();
    poll(Duration::from_secs(1), || {
        let r = w.sb.tcp(sa(VIP, 80), 10, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b2"])).then_some(()))
    })
    .unwrap_or_else(|e| panic!("no fallback to serving terminating endpoint: {e:#}"));
}

/// A UDP Service `demo/dns` on `vip`:53 → 5353, with sessionAffinity when `affinity_s` says.
fn dns_service(name: &str, vip: &str, affinity_s: Option<u32>) -> Service {
    let s = Service::new("demo", name, vip).port(ServicePort::udp(53).name("dns").target(5353));
    match affinity_s {
        Some(t) => s.affinity(t),
        None => s,
    }
}

/// The slice of UDP Service `name` with ready endpoints `ready`.
fn dns_slice(sb: &svc_tests::Sandbox, name: &str, ready: &[u8]) -> EndpointSlice {
    let mut s = EndpointSlice::ipv4("demo", name).port(SlicePort::udp(5353).name("dns"));
    for &i in ready {
        s = s.endpoint(Endpoint::ready(&sb.backend_v4(i).to_string()));
    }
    s
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Issue 7, items 1 and 2: unconnected UDP sockets (QUIC, DNS clients, WireGuard) each stay on
/// one backend, datagram after datagram, and every reply comes from the ClusterIP; when a
/// socket's backend leaves the Service (its server still answering), the socket moves to a
/// live backend and stays there, while sockets on a backend that stayed never move.
#[test]
fn unconnected_udp_sockets_keep_one_backend_and_move_when_it_leaves() {
    let w = World::start(3, &[5353], |sb, m| {
        m.apply_service(&dns_service("dns", &VIP.to_string(), None))
            .unwrap();
        m.apply_slice(&dns_slice(sb, "dns", &[1, 2])).unwrap();
    });
    let sockets = 12;
    let run =
        w.sb.spawn_udp_unconnected(sa(VIP, 53), sockets, Duration::from_millis(3500), 20, 500)
            .unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let changed = unix_ms();
    w.m.apply_slice(&dns_slice(&w.sb, "dns", &[2, 3])).unwrap();
    let report =
        w.sb.finish_udp_stream(run, Duration::from_secs(20))
            .unwrap();
    let ex = &report.exchanges;
    assert!(ex.len() > 100, "too few exchanges: {}", ex.len());
    for e in ex {
        assert!(e.ok, "failed exchange: {e:?}");
        assert_eq!(e.from.as_deref(), Some("10.96.0.10:53"), "{e:?}");
    }
    let mut moved = 0;
    for s in 0..sockets {
        let seq: Vec<(u64, &str)> = ex
            .iter()
            .filter(|e| e.socket == s)
            .map(|e| (e.at_ms, e.backend.as_deref().unwrap()))
            .collect();
        let before: BTreeSet<&str> = seq
            .iter()
            .filter(|(t, _)| *t < changed)
            .map(|(_, b)| *b)
            .collect();
        // The sync takes effect within a second.
        let after: BTreeSet<&str> = seq
            .iter()
            .filter(|(t, _)| *t > changed + 1000)
            .map(|(_, b)| *b)
            .collect();
        assert_eq!(
            before.len(),
            1,
            "socket {s} spread before the change: {seq:?}"
        );
        assert_eq!(
            after.len(),
            1,
            "socket {s} spread after the change: {seq:?}"
        );
        let (b, a) = (*before.first().unwrap(), *after.first().unwrap());
        match b {
            "b2" => assert_eq!(a, "b2", "socket {s} left a backend that stayed: {seq:?}"),
            "b1" => {
                assert!(a == "b2" || a == "b3", "socket {s}: {seq:?}");
                moved += 1;
            }
            other => panic!("socket {s} reached {other} before the change: {seq:?}"),
        }
        // At most one switch: the backend sequence is X..X Y..Y.
        let switches = seq.windows(2).filter(|w| w[0].1 != w[1].1).count();
        assert!(
            switches <= 1,
            "socket {s} switched {switches} times: {seq:?}"
        );
    }
    eprintln!("{moved} of {sockets} sockets were on b1 and moved");
    let stats: std::collections::BTreeMap<_, _> = svc_agent::datapath::read_stats(w.bpffs.path())
        .unwrap()
        .into_iter()
        .collect();
    assert!(stats["sock_sticky"] > 100, "{stats:?}");
    assert_eq!(stats["sock_moved"], moved, "{stats:?}");
}

/// The per-socket reverse entries of SVC_SOCK_REV: read back for the tests.
fn sock_rev_entries(
    bpffs: &std::path::Path,
) -> Vec<(svc_common::SockRevKey, svc_common::SockRevValue)> {
    let store = svc_agent::datapath::open_pinned(bpffs).unwrap();
    svc_agent::store::dump(svc_common::map_names::SOCK_REV, &store.sock_rev).unwrap()
}

/// Issue 7, item 2: the reverse entries of a socket go when the socket is closed (TCP,
/// connected UDP, unconnected UDP), instead of filling the LRU map until it evicts the entries
/// of live sockets.
#[test]
fn reverse_entries_go_with_their_sockets() {
    let w = World::start(2, &[8080, 5353], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
        m.apply_service(&dns_service("dns", "10.96.0.11", None))
            .unwrap();
        m.apply_slice(&dns_slice(sb, "dns", &[1, 2])).unwrap();
    });
    let dns = sa([10, 96, 0, 11], 53);
    assert!(w.sb.udp(dns, 10, false).unwrap().all_ok());
    assert!(w.sb.udp(dns, 10, true).unwrap().all_ok());
    assert!(w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap().all_ok());
    // The probes have exited: every socket is closed.
    let left = sock_rev_entries(w.bpffs.path());
    assert!(
        left.is_empty(),
        "{} entries outlived their sockets: {left:?}",
        left.len()
    );
    let stats: std::collections::BTreeMap<_, _> = svc_agent::datapath::read_stats(w.bpffs.path())
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(stats["sock_rev_released"], 30, "{stats:?}");
    assert_eq!(stats["sock_rev_untracked"], 0, "{stats:?}");
}

/// Issue 7, item 3: a client's remembered backend leaves its Service while it is still a
/// backend of another Service (so it still exists): the client moves at once, and stays on
/// its new backend; the other Service still reaches the backend.
#[test]
fn affinity_moves_a_client_whose_backend_left_the_service() {
    let w = World::start(2, &[8080], |sb, m| {
        m.apply_service(
            &Service::new("demo", "sticky", &VIP.to_string())
                .port(ServicePort::tcp(80).name("http").target(8080))
                .affinity(3600),
        )
        .unwrap();
        let mut s = web_slice(sb, &[1, 2], &[]);
        s.service = "sticky".into();
        s.name = "sticky-v4".into();
        m.apply_slice(&s).unwrap();
        m.apply_service(
            &Service::new("demo", "web", "10.96.0.12")
                .port(ServicePort::tcp(80).name("http").target(8080)),
        )
        .unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    let chosen = names(&r);
    assert_eq!(chosen.len(), 1, "{:?}", r.backends());
    let (gone, stays) = if chosen.contains("b1") {
        (1, 2)
    } else {
        (2, 1)
    };
    let mut s = web_slice(&w.sb, &[stays], &[]);
    s.service = "sticky".into();
    s.name = "sticky-v4".into();
    w.m.apply_slice(&s).unwrap();
    let want = set(&[&format!("b{stays}")]);
    poll(Duration::from_secs(1), || {
        let r = w.sb.tcp(sa(VIP, 80), 5, &[])?;
        Ok((r.all_ok() && names(&r) == want).then_some(()))
    })
    .unwrap_or_else(|e| panic!("the client did not move off b{gone}: {e:#}"));
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert_eq!(names(&r), want, "{:?}", r.backends());
    let r = w.sb.tcp(sa([10, 96, 0, 12], 80), 20, &[]).unwrap();
    assert!(
        names(&r).contains(&format!("b{gone}")),
        "the backend should still serve the other Service: {:?}",
        r.backends()
    );
}

/// Issue 7, item 3: with timeoutSeconds: 1, connections in quick succession stay on one
/// backend, and a client idle for longer than the timeout chooses again.
#[test]
fn affinity_expires_after_timeout_seconds() {
    let w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service().affinity(1)).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2, 3], &[])).unwrap();
    });
    let mut firsts = BTreeSet::new();
    for _ in 0..8 {
        let r = w.sb.tcp(sa(VIP, 80), 5, &[]).unwrap();
        assert!(r.all_ok(), "{:?}", r.failures());
        assert_eq!(names(&r).len(), 1, "within the timeout: {:?}", r.backends());
        firsts.extend(names(&r));
        std::thread::sleep(Duration::from_millis(1300));
    }
    // Eight independent choices over three backends: all equal with probability 3^-7.
    assert!(firsts.len() > 1, "the choice never expired: {firsts:?}");
}

/// Issue 7, item 3: sessionAffinity for an unconnected UDP client: new sockets of the pod
/// (one per exchange) and long-lived ones all reach one backend.
#[test]
fn affinity_applies_to_unconnected_udp() {
    let w = World::start(3, &[5353], |sb, m| {
        m.apply_service(&dns_service("dns", &VIP.to_string(), Some(600)))
            .unwrap();
        m.apply_slice(&dns_slice(sb, "dns", &[1, 2, 3])).unwrap();
    });
    let r = w.sb.udp(sa(VIP, 53), 15, false).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    let chosen = names(&r);
    assert_eq!(chosen.len(), 1, "{:?}", r.backends());
    let run =
        w.sb.spawn_udp_unconnected(sa(VIP, 53), 6, Duration::from_millis(600), 20, 500)
            .unwrap();
    let report =
        w.sb.finish_udp_stream(run, Duration::from_secs(10))
            .unwrap();
    let seen: BTreeSet<String> = report
        .exchanges
        .iter()
        .map(|e| {
            assert!(e.ok, "{e:?}");
            assert_eq!(e.from.as_deref(), Some("10.96.0.10:53"), "{e:?}");
            e.backend.clone().unwrap()
        })
        .collect();
    assert_eq!(seen, chosen);
}

/// Issue 7, item 4: when a backend leaves Service S but still serves Service T, connected UDP
/// sockets that svc translated for S are closed (their client reconnects to a live backend of
/// S), those translated for T are not; when it leaves T too, T's sockets are closed. A socket
/// connected to the pod's address directly is never touched.
#[test]
fn stale_udp_sockets_are_closed_per_service_and_only_if_translated() {
    let w = World::start(2, &[5353], |sb, m| {
        m.apply_service(&dns_service("s", &VIP.to_string(), None))
            .unwrap();
        m.apply_slice(&dns_slice(sb, "s", &[1])).unwrap();
        m.apply_service(&dns_service("t", "10.96.0.12", None))
            .unwrap();
        m.apply_slice(&dns_slice(sb, "t", &[1])).unwrap();
    });
    let (vip_s, vip_t) = (sa(VIP, 53), sa([10, 96, 0, 12], 53));
    let direct = sa(w.sb.backend_v4(1), 5353);
    let run = Duration::from_millis(5500);
    let via_s = w.sb.spawn_udp_stream(vip_s, run, 20, 300).unwrap();
    let via_t = w.sb.spawn_udp_stream(vip_t, run, 20, 300).unwrap();
    let to_pod = w.sb.spawn_udp_stream(direct, run, 20, 300).unwrap();
    std::thread::sleep(Duration::from_millis(1200));
    let left_s = unix_ms();
    w.m.apply_slice(&dns_slice(&w.sb, "s", &[2])).unwrap();
    std::thread::sleep(Duration::from_millis(1800));
    let left_t = unix_ms();
    w.m.apply_slice(&dns_slice(&w.sb, "t", &[2])).unwrap();
    let via_s =
        w.sb.finish_udp_stream(via_s, Duration::from_secs(20))
            .unwrap();
    let via_t =
        w.sb.finish_udp_stream(via_t, Duration::from_secs(20))
            .unwrap();
    let to_pod =
        w.sb.finish_udp_stream(to_pod, Duration::from_secs(20))
            .unwrap();

    let summary = |r: &svc_tests::StreamReport| {
        r.exchanges
            .iter()
            .map(|e| {
                format!(
                    "{:+}ms s{} {}",
                    e.at_ms as i64 - left_s as i64,
                    e.socket,
                    e.backend.clone().or(e.error.clone()).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    // Each translated socket: b1 until its Service lost b1, closed within a second of that,
    // then b2 through a new socket.
    for (what, r, left, vip) in [("S", &via_s, left_s, vip_s), ("T", &via_t, left_t, vip_t)] {
        let first_error = r
            .exchanges
            .iter()
            .find(|e| !e.ok)
            .unwrap_or_else(|| panic!("{what}: the socket was never closed: {}", summary(r)));
        assert!(
            first_error.at_ms >= left && first_error.at_ms <= left + 1000,
            "{what}: closed {}ms after the change: {}",
            first_error.at_ms as i64 - left as i64,
            summary(r)
        );
        for e in &r.exchanges {
            if e.at_ms < left {
                assert!(e.ok && e.socket == 0, "{what}: {}", summary(r));
                assert_eq!(e.backend.as_deref(), Some("b1"), "{what}: {}", summary(r));
            }
            if e.at_ms > first_error.at_ms && e.ok {
                assert_eq!(e.backend.as_deref(), Some("b2"), "{what}: {}", summary(r));
                assert_eq!(e.peer, Some(vip.to_string()), "{what}: {}", summary(r));
            }
        }
        assert!(
            r.exchanges.iter().filter(|e| !e.ok).count() <= 2,
            "{what}: {}",
            summary(r)
        );
    }
    // The socket connected to the pod itself: untouched throughout.
    for e in &to_pod.exchanges {
        assert!(
            e.ok && e.socket == 0 && e.backend.as_deref() == Some("b1"),
            "the direct socket was disturbed: {}",
            summary(&to_pod)
        );
    }
    assert!(to_pod.exchanges.last().unwrap().at_ms > left_t + 1000);
}

/// A Service whose change cannot be programmed (here the backends map is full) keeps what it
/// had, and the stale-UDP cleanup judges its sockets by nothing it cannot know: a connected UDP
/// socket svc translated to its old backend goes on there, undisturbed, while the agent
/// reports the Service by name and retries. Once there is room, the change lands and the
/// socket, whose backend left, is closed and its successor reaches the new backend.
#[test]
fn a_failing_services_udp_sockets_are_left_alone_until_its_change_lands() {
    let sb = common::sandbox();
    let m = svc_tests::Manifests::new().unwrap();
    m.apply_service(&dns_service("s", &VIP.to_string(), None))
        .unwrap();
    m.apply_slice(&dns_slice(&sb, "s", &[1])).unwrap();
    let _backends = sb.backends(3, &[5353]).unwrap();
    let bpffs = sb.bpffs().unwrap();
    // Room for two backends: b1, and one more during a change, not two.
    let agent = sb.agent_with(&bpffs, &m, &["--max-backends", "2"]).unwrap();

    let vip = sa(VIP, 53);
    let run = Duration::from_millis(9_000);
    let stream = sb.spawn_udp_stream(vip, run, 20, 300).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let changed = unix_ms();
    m.apply_slice(&dns_slice(&sb, "s", &[2, 3])).unwrap();
    let refusal = common::poll(Duration::from_secs(10), || {
        Ok(agent
            .log()
            .lines()
            .find(|l| l.contains("SVC_BACKENDS is full"))
            .map(str::to_string))
    })
    .expect("the change is refused for want of room");
    assert!(
        refusal.contains("Service demo/s not programmed"),
        "the error names the Service: {refusal}"
    );
    // Several retries and stale-UDP passes go by; then the room is made.
    std::thread::sleep(Duration::from_millis(3000));
    let roomy = unix_ms();
    m.apply_slice(&dns_slice(&sb, "s", &[2])).unwrap();
    let r = sb
        .finish_udp_stream(stream, Duration::from_secs(30))
        .unwrap();
    let at = |t: u64| t as i64 - changed as i64;
    let summary = r
        .exchanges
        .iter()
        .map(|e| {
            let what = e.backend.clone().or(e.error.clone()).unwrap_or_default();
            format!("{:+}ms s{} {what}", at(e.at_ms), e.socket)
        })
        .collect::<Vec<_>>()
        .join(", ");
    for e in r.exchanges.iter().filter(|e| e.at_ms < roomy) {
        assert!(
            e.ok && e.socket == 0 && e.backend.as_deref() == Some("b1"),
            "while the change failed, the socket must stay on b1 (change at +0ms, room at \
             +{}ms): {summary}",
            at(roomy)
        );
    }
    let last = r.exchanges.last().expect("exchanges");
    assert!(
        last.ok && last.socket > 0 && last.backend.as_deref() == Some("b2"),
        "once the change lands, a new socket reaches b2: {summary}"
    );
}

/// The same across a crash, whoever saw the backend leave: a backend that left Service S while
/// no agent ran, and one whose departure an agent synced but was SIGKILLed before it closed
/// the sockets (that window widened by fault injection), no longer keep the connected UDP
/// sockets svc translated for S once the agent is back; the socket translated for T, which
/// kept the backend, and the one connected to the pod directly are left alone.
#[test]
fn stale_udp_sockets_are_closed_across_a_crash() {
    let pause = Duration::from_millis(1500);
    let sb = common::sandbox();
    let m = svc_tests::Manifests::new().unwrap();
    m.apply_service(&dns_service("s", &VIP.to_string(), None))
        .unwrap();
    m.apply_slice(&dns_slice(&sb, "s", &[1])).unwrap();
    m.apply_service(&dns_service("t", "10.96.0.12", None))
        .unwrap();
    m.apply_slice(&dns_slice(&sb, "t", &[1])).unwrap();
    let _backends = sb.backends(2, &[5353]).unwrap();
    let bpffs = sb.bpffs().unwrap();
    let env: Vec<std::ffi::OsString> = vec![
        "env".into(),
        format!("SVC_TEST_STALE_UDP_PAUSE_MS={}", pause.as_millis()).into(),
    ];
    let args: Vec<std::ffi::OsString> = vec![
        "run".into(),
        "--manifests".into(),
        m.dir().into(),
        "--cgroup".into(),
        sb.cgroup().path().into(),
        "--bpffs".into(),
        bpffs.path().into(),
    ];
    let mut agent =
        svc_tests::Agent::start_launched(&env, &sb.tools.agent, args, bpffs.path(), m.scratch())
            .unwrap();
    let ready_within = svc_tests::sandbox::AGENT_READY_TIMEOUT;
    agent.wait_ready(ready_within).unwrap();

    let (vip_s, vip_t) = (sa(VIP, 53), sa([10, 96, 0, 12], 53));
    let direct = sa(sb.backend_v4(1), 5353);
    let run = Duration::from_millis(24_000);
    let via_s = sb.spawn_udp_stream(vip_s, run, 20, 300).unwrap();
    let via_t = sb.spawn_udp_stream(vip_t, run, 20, 300).unwrap();
    let to_pod = sb.spawn_udp_stream(direct, run, 20, 300).unwrap();
    std::thread::sleep(Duration::from_millis(1200));

    // S loses b1 while no agent runs.
    agent.kill().unwrap();
    m.apply_slice(&dns_slice(&sb, "s", &[2])).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let restarted1 = unix_ms();
    agent.restart().unwrap();
    agent.wait_ready(ready_within).unwrap();
    let ready1 = unix_ms();
    std::thread::sleep(pause + Duration::from_millis(1500));

    // S gets b1 back and loses b2 in a sync whose cleanup a SIGKILL cuts short.
    let synced = agent.count_lines("svc-agent: synced");
    let changed2 = unix_ms();
    m.apply_slice(&dns_slice(&sb, "s", &[1])).unwrap();
    agent
        .wait_for_lines("svc-agent: synced", synced + 1, Duration::from_secs(10))
        .unwrap();
    agent.kill().unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let restarted2 = unix_ms();
    agent.restart().unwrap();
    agent.wait_ready(ready_within).unwrap();
    let ready2 = unix_ms();

    let via_s = sb
        .finish_udp_stream(via_s, Duration::from_secs(30))
        .unwrap();
    let via_t = sb
        .finish_udp_stream(via_t, Duration::from_secs(30))
        .unwrap();
    let to_pod = sb
        .finish_udp_stream(to_pod, Duration::from_secs(30))
        .unwrap();

    let at = |t: u64| t as i64 - restarted1 as i64;
    // Runs of one socket and one outcome, as "+FROM..+TOms sN OUTCOME ×COUNT".
    let summary = |r: &svc_tests::StreamReport| {
        let mut runs: Vec<(u64, u64, u32, String, usize)> = Vec::new();
        for e in &r.exchanges {
            let what = e.backend.clone().or(e.error.clone()).unwrap_or_default();
            match runs.last_mut() {
                Some(run) if run.2 == e.socket && run.3 == what => {
                    run.1 = e.at_ms;
                    run.4 += 1;
                }
                _ => runs.push((e.at_ms, e.at_ms, e.socket, what, 1)),
            }
        }
        runs.iter()
            .map(|(from, to, socket, what, n)| {
                format!("{:+}..{:+}ms s{socket} {what} ×{n}", at(*from), at(*to))
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let times = format!(
        "restarts at +0ms and +{}ms, ready at +{}ms and +{}ms, b1 back at +{}ms",
        at(restarted2),
        at(ready1),
        at(ready2),
        at(changed2)
    );
    // S's socket: closed after each restart, within a moment of the agent being ready (and
    // its fault-injected pause), each time followed by a new socket to the backend S has.
    let first_error_after = |t: u64| {
        via_s
            .exchanges
            .iter()
            .find(|e| !e.ok && e.at_ms >= t)
            .map(|e| e.at_ms)
    };
    let window = pause.as_millis() as u64 + 1000;
    let closed1 = first_error_after(restarted1)
        .filter(|&t| t <= ready1 + window)
        .unwrap_or_else(|| {
            panic!(
                "S: not closed after the first restart ({times}): {}",
                summary(&via_s)
            )
        });
    let closed2 = first_error_after(restarted2)
        .filter(|&t| t <= ready2 + window)
        .unwrap_or_else(|| {
            panic!(
                "S: not closed after the second restart ({times}): {}",
                summary(&via_s)
            )
        });
    for e in &via_s.exchanges {
        let want = if e.at_ms < closed1 || e.at_ms > closed2 {
            "b1"
        } else {
            "b2"
        };
        if e.ok {
            assert_eq!(
                e.backend.as_deref(),
                Some(want),
                "S ({times}): {}",
                summary(&via_s)
            );
            assert_eq!(e.peer, Some(vip_s.to_string()), "S: {}", summary(&via_s));
        } else {
            assert!(
                (restarted1..closed1 + 1000).contains(&e.at_ms)
                    || (restarted2..closed2 + 1000).contains(&e.at_ms),
                "S: an error out of place ({times}): {}",
                summary(&via_s)
            );
        }
    }
    // T kept b1, and the direct socket is no Service's: both untouched throughout.
    for (what, r) in [("T", &via_t), ("the direct socket", &to_pod)] {
        for e in &r.exchanges {
            assert!(
                e.ok && e.socket == 0 && e.backend.as_deref() == Some("b1"),
                "{what} was disturbed ({times}): {}",
                summary(r)
            );
        }
        assert!(
            r.exchanges.last().unwrap().at_ms > ready2 + window,
            "{what} ended too early ({times}): {}",
            summary(r)
        );
    }
}

/// Issue 7, item 2: a client never gets a reply from an address it did not send to, even when
/// the reverse map is too small for its sockets (here 2 entries for 8 sockets): an unconnected
/// socket's own state says which frontend its backend answers for.
#[test]
fn replies_read_as_the_cluster_ip_when_reverse_entries_are_evicted() {
    let sb = common::sandbox();
    let m = svc_tests::Manifests::new().unwrap();
    m.apply_service(&dns_service("dns", &VIP.to_string(), None))
        .unwrap();
    m.apply_slice(&dns_slice(&sb, "dns", &[1, 2])).unwrap();
    let _backends = sb.backends(2, &[5353]).unwrap();
    let bpffs = sb.bpffs().unwrap();
    let _agent = sb.agent_with(&bpffs, &m, &["--max-sock-rev", "2"]).unwrap();
    // Every socket sends before any reads: the other sockets' entries push a socket's out of
    // the map between its datagram and the reply.
    let run = sb
        .spawn_udp_unconnected_with(
            sa(VIP, 53),
            8,
            Duration::from_millis(800),
            10,
            500,
            &["--pipelined"],
        )
        .unwrap();
    let report = sb.finish_udp_stream(run, Duration::from_secs(10)).unwrap();
    assert!(report.exchanges.len() > 40);
    for e in &report.exchanges {
        assert!(e.ok, "{e:?}");
        assert_eq!(e.from.as_deref(), Some("10.96.0.10:53"), "{e:?}");
    }
    assert!(sock_rev_entries(bpffs.path()).len() <= 2);
}
