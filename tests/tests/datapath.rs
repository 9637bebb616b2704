//! What a client sees through a ClusterIP once the agent has synced: which backends answer,
//! which addresses the socket API reports, and how unknown ports and empty services fail.

mod common;

use std::net::Ipv6Addr;

use common::{names, sa, set, web_service, web_slice, World, VIP};
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
    let w = World::start(1, &[8080], |sb, m| {
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
            assert_eq!(a.errno, Some(libc::ECONNREFUSED), "{to}: {a:?}");
            // An immediate refusal takes microseconds; 1 s only absorbs a loaded machine, and
            // is still half the probe's 2 s connect timeout, so a timeout cannot pass.
            assert!(a.elapsed_us < 1_000_000, "{to}: {a:?}");
        }
    }
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
    common::poll(std::time::Duration::from_secs(1), || {
        let r = w.sb.tcp(sa(VIP, 80), 10, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b2"])).then_some(()))
    })
    .unwrap_or_else(|e| panic!("no fallback to serving terminating endpoint: {e:#}"));
}
