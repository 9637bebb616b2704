//! The services every test sees, and the names the tables read with.

use crate::prelude::*;

pub const EXT: u8 = scope::EXTERNAL;
pub const NP: u16 = svc_flags::NODEPORT;
pub const LOCAL: u8 = backend_flags::LOCAL;

/// Backends (L: on this node):
/// - 11 10.244.1.5:8080 L, 12 10.244.2.7:8080, 13 10.244.2.7:5353/UDP, 14 10.244.1.5:5353/UDP L
/// - 15 [fd00:244:1::5]:8080 L, 16 [fd00:244:2::7]:8080, 17 [fd00:244:2::7]:5353/UDP,
///   42 [fd00:244:1::5]:5353/UDP L
/// - 18 10.244.2.8:8080, 19 10.244.2.9:8080 (not marked local)
/// - 40 10.244.3.9:8080 and 41 [fd00:244:3::9]:8080, behind the 1280-byte link ext1
///
/// Frontends (external scope unless said; NodePorts on every node address):
/// - NodePort 30080/TCP (1) -> 11; 30081/TCP (2) -> 12; 30053/UDP (3) -> 13; 30054/UDP (4) -> 14
/// - IPv6 NodePort 30080/TCP (5) -> 15; 30081/TCP (6) -> 16; 30053/UDP (7) -> 17;
///   30054/UDP (29) -> 42
/// - ExternalIP 198.51.100.10:80 (8) -> 18
/// - LoadBalancer 198.51.100.20:80 (9) -> 11, loadBalancerSourceRanges 203.0.113.0/24; its
///   NodePort 30082 (10) -> 11
/// - eTP Local: NodePort 30090 (20) -> 19; NodePort 30091 (21): no local endpoint
/// - no endpoints: NodePort 30099 TCP (22), UDP (23), IPv6 TCP (24), UDP (25)
/// - sessionAffinity (60 s): NodePort 30070 (26) -> 12, 18
/// - behind ext1: NodePort 30083 (27) -> 40, IPv6 (28) -> 41
/// - cluster scope: ClusterIP 10.96.0.10:80 (30) -> 12; ClusterIP 10.96.0.11:80 (31) -> 11
///   (the pod 10.244.1.5 reaching itself); NodePort 30080 seen from the node (32) -> 11
pub fn world() -> Dp {
    world_with(Dp::new())
}

pub fn world_with(mut dp: Dp) -> Dp {
    let t = IPPROTO_TCP;
    let u = IPPROTO_UDP;
    for (id, at, proto, flags) in [
        (11, "10.244.1.5:8080", t, LOCAL),
        (12, "10.244.2.7:8080", t, 0),
        (13, "10.244.2.7:5353", u, 0),
        (14, "10.244.1.5:5353", u, LOCAL),
        (15, "[fd00:244:1::5]:8080", t, LOCAL),
        (16, "[fd00:244:2::7]:8080", t, 0),
        (17, "[fd00:244:2::7]:5353", u, 0),
        (42, "[fd00:244:1::5]:5353", u, LOCAL),
        (18, "10.244.2.8:8080", t, 0),
        (19, "10.244.2.9:8080", t, 0),
        (40, "10.244.3.9:8080", t, 0),
        (41, "[fd00:244:3::9]:8080", t, 0),
    ] {
        dp.backend(id, at, proto, flags);
    }
    let lb = svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES;
    let etp = NP | svc_flags::EXTERNAL_LOCAL;
    // (frontend, protocol, scope, id, backends, flags, affinity timeout)
    type FeRow<'a> = (&'a str, u8, u8, u32, &'a [BackendId], u16, u32);
    let fes: [FeRow<'_>; 29] = [
        ("0.0.0.0:30080", t, EXT, 1, &[11], NP, 0),
        ("0.0.0.0:30081", t, EXT, 2, &[12], NP, 0),
        ("0.0.0.0:30053", u, EXT, 3, &[13], NP, 0),
        ("0.0.0.0:30054", u, EXT, 4, &[14], NP, 0),
        ("[::]:30080", t, EXT, 5, &[15], NP, 0),
        ("[::]:30081", t, EXT, 6, &[16], NP, 0),
        ("[::]:30053", u, EXT, 7, &[17], NP, 0),
        ("[::]:30054", u, EXT, 29, &[42], NP, 0),
        (
            "198.51.100.10:80",
            t,
            EXT,
            8,
            &[18],
            svc_flags::EXTERNAL_IP,
            0,
        ),
        ("198.51.100.20:80", t, EXT, 9, &[11], lb, 0),
        ("0.0.0.0:30082", t, EXT, 10, &[11], NP, 0),
        ("0.0.0.0:30090", t, EXT, 20, &[19], etp, 0),
        ("0.0.0.0:30091", t, EXT, 21, &[], etp, 0),
        ("0.0.0.0:30099", t, EXT, 22, &[], NP, 0),
        ("0.0.0.0:30099", u, EXT, 23, &[], NP, 0),
        ("[::]:30099", t, EXT, 24, &[], NP, 0),
        ("[::]:30099", u, EXT, 25, &[], NP, 0),
        // A minute, not the default 3 hours: the monotonic clock starts at boot, so a
        // choice older than the timeout can be stamped only on a machine up for longer.
        ("0.0.0.0:30070", t, EXT, 26, &[12, 18], NP, 60),
        ("0.0.0.0:30083", t, EXT, 27, &[40], NP, 0),
        ("[::]:30083", t, EXT, 28, &[41], NP, 0),
        ("10.96.0.10:80", t, scope::CLUSTER, 30, &[12], 0, 0),
        ("10.96.0.11:80", t, scope::CLUSTER, 31, &[11], 0, 0),
        ("0.0.0.0:30080", t, scope::CLUSTER, 32, &[11], NP, 0),
        // Not used by the rows below, but present as on a node: they must not disturb.
        ("10.96.0.12:53", u, scope::CLUSTER, 33, &[13], 0, 0),
        ("[fd00:96::10]:80", t, scope::CLUSTER, 34, &[16], 0, 0),
        (
            "198.51.100.10:80",
            t,
            scope::CLUSTER,
            35,
            &[18],
            svc_flags::EXTERNAL_IP,
            0,
        ),
        (
            "198.51.100.20:80",
            t,
            scope::CLUSTER,
            36,
            &[11],
            svc_flags::LOAD_BALANCER,
            0,
        ),
        ("0.0.0.0:30081", t, scope::CLUSTER, 37, &[12], NP, 0),
        ("[::]:30080", t, scope::CLUSTER, 38, &[15], NP, 0),
    ];
    for (at, proto, sc, id, backends, flags, affinity_s) in fes {
        dp.frontend(Fe {
            affinity_s,
            ..Fe::new(at, proto, sc, id, backends, flags)
        });
    }
    dp.src_range(9, "203.0.113.0/24");
    dp
}

/// CLOCK_MONOTONIC_COARSE: the datapath's clock itself.
pub fn coarse_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}

/// CLOCK_MONOTONIC: the datapath's clock (the coarse one) runs behind it by up to a tick, so
/// a time read here and written to a map is one a little ahead of the programs' own.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub use Out::{Any, Dropped, Packet, Untouched};
pub use Prog::{ExtEgress, ExtIngress, PodEgress, PodIngress};

pub const OK: u32 = TC_ACT_OK;
pub const SHOT: u32 = TC_ACT_SHOT;
pub const REDIRECT: u32 = TC_ACT_REDIRECT;

pub const C: &str = "203.0.113.7";

/// The flags of a new TCP flow's entries until its client acknowledges the SYN-ACK.
pub const NEW_TCP: u16 = ct_flags::UNASSURED | ct_flags::TRACKED;

/// A packet as the node sends it to the gateway (towards a client), out of ext0.
pub fn to_gateway(p: P) -> P {
    p.macs(GW_MAC, EXT_MAC)
}

/// A client's packet as the gateway hands it to the node.
pub fn from_client(p: P) -> P {
    p.macs(EXT_MAC, GW_MAC)
}
