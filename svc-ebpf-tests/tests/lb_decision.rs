//! The load-balancing decision of the kernel programs (svc-ebpf/src/lb.rs), table-driven,
//! through BPF_PROG_TEST_RUN: each case programs a few map entries, hands a decision request
//! to the test-only `lb_test` classifier and reads its answer back. No namespace, cgroup or
//! socket is involved, and the whole file runs in milliseconds.
//!
//! Why a classifier: the cgroup sock_addr programs the agent attaches have no test run
//! (BPF_PROG_TEST_RUN answers ENOTSUPP for them on kernel 6.18; `sock_addr_has_no_test_run`
//! below keeps that finding honest). `lb_test` lives in an object of its own
//! (target/bpfel-unknown-none/release/svc-lb-test, built by `cargo xtask build-ebpf`; or
//! `$SVC_EBPF_TEST_OBJECT`), so the agent never loads it.
//!
//! Needs root (bpf(2)). Every case loads the object afresh: its maps are its own and are freed
//! when the case ends; nothing is pinned or attached.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use aya::maps::{HashMap, MapData, PerCpuHashMap};
use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use aya::{Ebpf, EbpfLoader};
use svc_common::{
    how, map_names, svc_flags, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendId,
    LbTestIo, Outcome, Reason, ServiceKey, ServiceValue, SlotKey, SockChoice, SockState,
    AFFINITY_CLIENT_NETNS, IPPROTO_TCP, IPPROTO_UDP, LB_TEST_CONNECT, LB_TEST_SENDMSG, PROTO_ANY,
    SOCK_CHOICES,
};

const SEC: u64 = 1_000_000_000;

/// `LbTestIo::outcome` of a decision that found a backend.
const FOUND: u32 = Outcome::Found as u32;

fn object() -> Vec<u8> {
    let path = std::env::var_os("SVC_EBPF_TEST_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/bpfel-unknown-none/release/svc-lb-test")
        });
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "the test object {} is missing ({e}): run `cargo xtask build-ebpf`",
            path.display()
        )
    })
}

fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => svc_common::v4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

fn key(sa: &str, proto: u8) -> ServiceKey {
    let sa: SocketAddr = sa.parse().unwrap();
    ServiceKey {
        addr: addr16(sa.ip()),
        port_be: sa.port().to_be(),
        proto,
        scope: 0,
    }
}

/// max_entries of the test object's maps.
const SMALL: u32 = 64;

fn backend_value(sa: &str, proto: u8) -> Backend {
    let sa: SocketAddr = sa.parse().unwrap();
    Backend {
        addr: addr16(sa.ip()),
        port_be: sa.port().to_be(),
        proto,
        flags: 0,
        id: 0,
    }
}

/// The test program and its own maps, programmed as the agent would.
struct Lb {
    ebpf: Ebpf,
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    slots: HashMap<MapData, SlotKey, svc_common::SlotGroup>,
    backends: aya::maps::Array<MapData, Backend>,
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    matches: HashMap<MapData, AffinityMatchKey, u32>,
    stats: Option<PerCpuHashMap<MapData, svc_common::DevStatKey, u64>>,
}

/// A frontend as a test programs it.
struct Fe<'a> {
    vip: &'a str,
    proto: u8,
    id: u32,
    rev: u16,
    backends: &'a [BackendId],
    affinity_s: Option<u32>,
    /// The Service port's affinity id (with `affinity_s`); 0: the frontend's own id.
    affinity_id: u32,
}

impl Lb {
    fn new() -> Lb {
        svc_agent_tests_require_root();
        let mut loader = EbpfLoader::new();
        // Small maps: a case needs a handful of entries, and LRU maps are allocated in full.
        for name in map_names::ALL {
            // The monitor's rings are sized in bytes, a multiple of the page size.
            if name != map_names::META
                && name != map_names::SOCK_STATE
                && !svc_common::MON_RINGS.contains(&name)
            {
                loader.map_max_entries(name, SMALL);
            }
        }
        loader.override_global(svc_common::kernel_globals::BACKENDS, &SMALL, true);
        let mut ebpf = loader.load(&object()).expect("loading the test object");
        let prog: &mut SchedClassifier = ebpf
            .program_mut("lb_test")
            .expect("lb_test in the test object")
            .try_into()
            .expect("a classifier");
        prog.load().expect("the verifier accepts lb_test");
        let mut take = |name: &str| ebpf.take_map(name).unwrap_or_else(|| panic!("map {name}"));
        let services = take(map_names::SERVICES).try_into().unwrap();
        let slots = take(map_names::SLOTS).try_into().unwrap();
        let backends = take(map_names::BACKENDS).try_into().unwrap();
        let affinity = take(map_names::AFFINITY).try_into().unwrap();
        let matches = take(map_names::AFFINITY_MATCH).try_into().unwrap();
        // Absent from an object of before the one counter map (`decision_cost` runs on one).
        let stats = ebpf
            .take_map(map_names::DEV_STATS)
            .map(|m| m.try_into().unwrap());
        Lb {
            ebpf,
            services,
            slots,
            backends,
            affinity,
            matches,
            stats,
        }
    }

    fn backend(&mut self, id: BackendId, sa: &str, proto: u8) {
        let at = svc_common::backend_index(id, SMALL);
        let there = self.backends.get(&at, 0).unwrap().id;
        assert!(
            there == 0 || there == id,
            "backend {id}: index {at} holds {there}"
        );
        self.backends
            .set(at, backend_value(sa, proto).with_id(id), 0)
            .unwrap();
    }

    /// A frontend with its slots and, for those that check remembered choices, its match
    /// entries; plus the ClusterIP's marker.
    fn frontend(&mut self, f: Fe<'_>) {
        let k = key(f.vip, f.proto);
        let (flags, timeout) = match f.affinity_s {
            Some(t) => (svc_flags::AFFINITY, t),
            None => (0, 0),
        };
        for (k, g) in svc_agent::reconcile::slot_entries(f.id, f.rev, f.backends) {
            self.slots.insert(k, g, 0).unwrap();
        }
        for b in f.backends.iter() {
            if svc_common::checks_match(f.proto, flags) {
                self.add_match(f.id, *b);
            }
        }
        let v = ServiceValue {
            id: f.id,
            count: f.backends.len() as u16,
            rev: f.rev,
            flags,
            _pad0: 0,
            affinity_timeout_s: timeout,
            affinity_id: match (flags, f.affinity_id) {
                (0, _) => 0,
                (_, 0) => f.id,
                (_, a) => a,
            },
        };
        self.services.insert(k, v, 0).unwrap();
        let marker = ServiceKey {
            port_be: 0,
            proto: PROTO_ANY,
            ..k
        };
        let mv = ServiceValue {
            flags: svc_flags::ADDR_MARKER,
            ..Default::default()
        };
        self.services.insert(marker, mv, 0).unwrap();
    }

    fn add_match(&mut self, id: u32, backend: BackendId) {
        self.matches
            .insert(AffinityMatchKey { id, backend }, 0, 0)
            .unwrap();
    }

    fn del_match(&mut self, id: u32, backend: BackendId) {
        self.matches
            .remove(&AffinityMatchKey { id, backend })
            .unwrap();
    }

    fn affinity_key(netns: u64, id: u32) -> AffinityKey {
        let mut client = [0u8; 16];
        client[..8].copy_from_slice(&netns.to_ne_bytes());
        AffinityKey {
            client,
            affinity_id: id,
            kind: AFFINITY_CLIENT_NETNS,
            _pad0: [0; 3],
        }
    }

    fn remember(&mut self, netns: u64, id: u32, backend: BackendId, last_used_ns: u64) {
        let v = AffinityValue {
            last_used_ns,
            backend,
            _pad0: 0,
        };
        self.affinity
            .insert(Lb::affinity_key(netns, id), v, 0)
            .unwrap();
    }

    fn remembered(&self, netns: u64, id: u32) -> Option<AffinityValue> {
        self.affinity.get(&Lb::affinity_key(netns, id), 0).ok()
    }

    /// A counter of the decision, which knows no device (device 0).
    fn stat(&self, reason: Reason) -> u64 {
        let key = svc_common::DevStatKey {
            ifindex: 0,
            reason: reason as u32,
        };
        let stats = self
            .stats
            .as_ref()
            .expect("the object counts in SVC_DEV_STATS");
        stats.get(&key, 0).map_or(0, |v| v.iter().sum())
    }

    /// The mean time of one decision over `repeat` runs (ns), by BPF_PROG_TEST_RUN.
    fn time(&self, req: &LbTestIo, repeat: u32) -> f64 {
        let data_in = bytemuck::bytes_of(req);
        let mut data_out = vec![0u8; data_in.len() + 64];
        let prog: &SchedClassifier = self.ebpf.program("lb_test").unwrap().try_into().unwrap();
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(data_in),
                data_out: Some(&mut data_out),
                repeat,
                ..Default::default()
            })
            .expect("BPF_PROG_TEST_RUN");
        r.duration.as_nanos() as f64
    }

    /// One decision, answered by the kernel.
    fn run(&self, req: &LbTestIo) -> LbTestIo {
        let data_in = bytemuck::bytes_of(req);
        let mut data_out = vec![0u8; data_in.len() + 64];
        let prog: &SchedClassifier = self.ebpf.program("lb_test").unwrap().try_into().unwrap();
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(data_in),
                data_out: Some(&mut data_out),
                ..Default::default()
            })
            .expect("BPF_PROG_TEST_RUN");
        assert_eq!(
            r.return_value, 0,
            "lb_test failed to read or write the packet"
        );
        assert_eq!(r.data_size_out as usize, data_in.len());
        bytemuck::pod_read_unaligned(&data_out[..data_in.len()])
    }
}

fn svc_agent_tests_require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "BPF_PROG_TEST_RUN needs root (CAP_BPF, CAP_NET_ADMIN): run as root"
    );
}

fn connect(to: &str, proto: u8, now_ns: u64, netns: u64) -> LbTestIo {
    LbTestIo {
        key: key(to, proto),
        mode: LB_TEST_CONNECT,
        now_ns,
        cookie: 1,
        netns_cookie: netns,
        ..Default::default()
    }
}

fn sendmsg(to: &str, cookie: u64, now_ns: u64, netns: u64, sock: SockState) -> LbTestIo {
    LbTestIo {
        key: key(to, IPPROTO_UDP),
        mode: LB_TEST_SENDMSG,
        now_ns,
        cookie,
        netns_cookie: netns,
        sock,
        ..Default::default()
    }
}

/// The world most cases share: backends 11, 12, 13 (TCP) and 21, 22, 23 (UDP).
/// - 10.96.0.10:80/TCP, id 1: backends 11, 12
/// - 10.96.0.20:80/TCP, id 2: no backend
/// - 10.96.0.30:80/TCP, id 3: backends 11, 12, sessionAffinity 10 s
/// - 10.96.0.40:53/UDP, id 4: backends 21, 22
/// - 10.96.0.50:80/TCP, id 5: two slots named, none written (an update racing the lookup)
/// - 10.96.0.60:53/UDP, id 6: backends 21, 22, sessionAffinity 10 s
/// - 10.96.0.70:80/TCP, id 7: backend 13 (so 13 exists, as a backend of another Service)
fn world() -> Lb {
    let mut lb = Lb::new();
    for (id, ip) in [(11, "10.0.0.11"), (12, "10.0.0.12"), (13, "10.0.0.13")] {
        lb.backend(id, &format!("{ip}:8080"), IPPROTO_TCP);
    }
    for (id, ip) in [(21, "10.0.0.21"), (22, "10.0.0.22"), (23, "10.0.0.23")] {
        lb.backend(id, &format!("{ip}:5353"), IPPROTO_UDP);
    }
    let fes = [
        ("10.96.0.10:80", IPPROTO_TCP, 1, &[11, 12][..], None),
        ("10.96.0.20:80", IPPROTO_TCP, 2, &[][..], None),
        ("10.96.0.30:80", IPPROTO_TCP, 3, &[11, 12][..], Some(10)),
        ("10.96.0.40:53", IPPROTO_UDP, 4, &[21, 22][..], None),
        ("10.96.0.60:53", IPPROTO_UDP, 6, &[21, 22][..], Some(10)),
        ("10.96.0.70:80", IPPROTO_TCP, 7, &[13][..], None),
    ];
    for (vip, proto, id, backends, affinity_s) in fes {
        lb.frontend(Fe {
            vip,
            proto,
            id,
            rev: 1,
            backends,
            affinity_s,
            affinity_id: 0,
        });
    }
    // id 5: the master entry names two slots that are not there.
    lb.services
        .insert(
            key("10.96.0.50:80", IPPROTO_TCP),
            ServiceValue {
                id: 5,
                count: 2,
                rev: 1,
                ..Default::default()
            },
            0,
        )
        .unwrap();
    lb
}

const NETNS_A: u64 = 0xa;
const NETNS_B: u64 = 0xb;
const T0: u64 = 1_000 * SEC;

fn seen(lb: &Lb, req: &LbTestIo, n: usize) -> std::collections::BTreeSet<BackendId> {
    (0..n)
        .map(|_| {
            let a = lb.run(req);
            assert_eq!(a.outcome, FOUND, "{a:?}");
            a.backend_id
        })
        .collect()
}

/// What is not a frontend is left alone; a known ClusterIP refuses the ports and protocols
/// it does not define; a frontend without backends refuses; a frontend's backends are all
/// chosen.
#[test]
fn lookups_and_refusals() {
    let lb = world();
    struct Case {
        what: &'static str,
        to: &'static str,
        proto: u8,
        want: u32,
    }
    let cases = [
        Case {
            what: "not a service",
            to: "10.1.2.3:80",
            proto: IPPROTO_TCP,
            want: Outcome::NotService as u32,
        },
        Case {
            what: "ClusterIP, undefined port",
            to: "10.96.0.10:81",
            proto: IPPROTO_TCP,
            want: Outcome::NoPort as u32,
        },
        Case {
            what: "ClusterIP, defined port, other protocol",
            to: "10.96.0.10:80",
            proto: IPPROTO_UDP,
            want: Outcome::NoPort as u32,
        },
        Case {
            what: "no backend (count 0)",
            to: "10.96.0.20:80",
            proto: IPPROTO_TCP,
            want: Outcome::NoBackend as u32,
        },
        Case {
            what: "a frontend",
            to: "10.96.0.10:80",
            proto: IPPROTO_TCP,
            want: FOUND,
        },
    ];
    for c in cases {
        let a = lb.run(&connect(c.to, c.proto, T0, NETNS_A));
        assert_eq!(a.outcome, c.want, "{}: {a:?}", c.what);
    }
    let all = seen(&lb, &connect("10.96.0.10:80", IPPROTO_TCP, T0, NETNS_A), 64);
    assert_eq!(all, [11, 12].into(), "uniform choice should reach both");
    let a = lb.run(&connect("10.96.0.10:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!(a.frontend_id, 1);
    assert_eq!(a.how, how::RANDOM);
    let want = format!("10.0.0.{}:8080", a.backend_id);
    assert_eq!(
        a.backend,
        backend_value(&want, IPPROTO_TCP).with_id(a.backend_id)
    );
}

/// A backend's entry is at its id modulo the array's size, and says which id it holds: a slot
/// that names an id whose index another id has taken (an id the agent retired, its index
/// handed on) finds no backend there, never the other one.
#[test]
fn an_entry_of_another_id_at_the_index_is_no_backend() {
    let mut lb = world();
    // Index 5: id 5 + SMALL.
    lb.backend(5 + SMALL, "10.0.0.69:8080", IPPROTO_TCP);
    for (vip, id, backends) in [
        ("10.96.0.91:80", 9, &[5][..]),
        ("10.96.0.92:80", 10, &[5, 11][..]),
        ("10.96.0.93:80", 11, &[5 + SMALL][..]),
    ] {
        lb.frontend(Fe {
            vip,
            proto: IPPROTO_TCP,
            id,
            rev: 1,
            backends,
            affinity_s: None,
            affinity_id: 0,
        });
    }
    let a = lb.run(&connect("10.96.0.91:80", IPPROTO_TCP, T0, NETNS_A));
    assert_ne!(a.outcome, FOUND, "{a:?}");
    let mut missing = 0;
    for _ in 0..64 {
        let a = lb.run(&connect("10.96.0.92:80", IPPROTO_TCP, T0, NETNS_A));
        match a.outcome {
            FOUND => assert_eq!(a.backend_id, 11, "{a:?}"),
            _ => missing += 1,
        }
    }
    assert!((1..64).contains(&missing), "{missing} of 64 missing");
    let a = lb.run(&connect("10.96.0.93:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!((a.outcome, a.backend_id), (FOUND, 5 + SMALL), "{a:?}");
    assert_eq!(
        a.backend,
        backend_value("10.0.0.69:8080", IPPROTO_TCP).with_id(5 + SMALL)
    );
}

/// Slots are read eight to an entry: a frontend of 19 backends (entries of 8, 8 and 3) has
/// each of them chosen, and an entry's places past the frontend's last slot never are.
#[test]
fn every_slot_of_every_group_is_chosen_and_none_past_the_last() {
    let mut lb = world();
    let ids: Vec<BackendId> = (31..50).collect();
    for id in &ids {
        lb.backend(*id, &format!("10.0.1.{id}:8080"), IPPROTO_TCP);
    }
    lb.frontend(Fe {
        vip: "10.96.0.80:80",
        proto: IPPROTO_TCP,
        id: 8,
        rev: 1,
        backends: &ids,
        affinity_s: None,
        affinity_id: 0,
    });
    let all = seen(
        &lb,
        &connect("10.96.0.80:80", IPPROTO_TCP, T0, NETNS_A),
        400,
    );
    assert_eq!(all, ids.iter().copied().collect());
    // The last entry holds slots 17 to 19; a backend written past them is not one.
    let last = SlotKey {
        id: 8,
        rev: 1,
        slot: 3,
    };
    let mut g = lb.slots.get(&last, 0).unwrap();
    assert_eq!(g.backends[..4], [47, 48, 49, 0]);
    g.backends[3..].fill(13);
    lb.slots.insert(last, g, 0).unwrap();
    let all = seen(
        &lb,
        &connect("10.96.0.80:80", IPPROTO_TCP, T0, NETNS_A),
        400,
    );
    assert_eq!(all, ids.iter().copied().collect());
}

/// A master entry whose slots are missing (an update raced the lookup): read again once,
/// counted, then refused as a missing entry.
#[test]
fn a_missing_slot_is_retried_once_then_refused() {
    let lb = world();
    let a = lb.run(&connect("10.96.0.50:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!(a.outcome, Outcome::MissingEntry as u32, "{a:?}");
    assert_eq!(lb.stat(Reason::RetriedMissingEntry), 1);
    // A healthy frontend is not retried.
    lb.run(&connect("10.96.0.10:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!(lb.stat(Reason::RetriedMissingEntry), 1);
}

/// sessionAffinity: the first connection chooses and remembers; later ones within the timeout
/// reuse the backend and update its last use in place; a client of another network namespace
/// chooses for itself.
#[test]
fn affinity_hit_reuses_and_refreshes() {
    let lb = world();
    let first = lb.run(&connect("10.96.0.30:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!(first.outcome, FOUND);
    assert_eq!(first.how, how::RANDOM);
    let remembered = lb.remembered(NETNS_A, 3).expect("choice remembered");
    assert_eq!(
        (remembered.backend, remembered.last_used_ns),
        (first.backend_id, T0)
    );
    for i in 1..=20 {
        let now = T0 + i * SEC / 2;
        let a = lb.run(&connect("10.96.0.30:80", IPPROTO_TCP, now, NETNS_A));
        assert_eq!(a.outcome, FOUND);
        assert_eq!(
            (a.how, a.backend_id),
            (how::AFFINITY, first.backend_id),
            "{a:?}"
        );
        assert_eq!(lb.remembered(NETNS_A, 3).unwrap().last_used_ns, now);
    }
    assert_eq!(lb.stat(Reason::AffinityHit), 20);
    let other = lb.run(&connect("10.96.0.30:80", IPPROTO_TCP, T0, NETNS_B));
    assert_eq!(other.how, how::RANDOM);
    // Without affinity nothing is remembered.
    lb.run(&connect("10.96.0.10:80", IPPROTO_TCP, T0, NETNS_A));
    assert!(lb.remembered(NETNS_A, 1).is_none());
}

/// A remembered backend is used up to the timeout, not after it.
#[test]
fn affinity_expires_after_the_timeout() {
    for (age, reused) in [(10 * SEC, true), (10 * SEC + 1, false), (3600 * SEC, false)] {
        let mut lb = world();
        lb.remember(NETNS_A, 3, 12, T0);
        let a = lb.run(&connect("10.96.0.30:80", IPPROTO_TCP, T0 + age, NETNS_A));
        assert_eq!(a.outcome, FOUND);
        assert_eq!(a.how == how::AFFINITY, reused, "age {age} ns: {a:?}");
        // Either way the entry now says this connection.
        assert_eq!(lb.remembered(NETNS_A, 3).unwrap().last_used_ns, T0 + age);
    }
}

/// A choice stamped a moment after the decision read the clock (by another CPU, or by a finer
/// clock than the datapath's coarse one) is fresh: its age is 0, not a wrapped difference of
/// centuries.
#[test]
fn affinity_stamped_after_the_decision_time_is_fresh() {
    for ahead in [1, 4_000_000, 10 * SEC] {
        let mut lb = world();
        lb.remember(NETNS_A, 3, 12, T0 + ahead);
        let a = lb.run(&connect("10.96.0.30:80", IPPROTO_TCP, T0, NETNS_A));
        assert_eq!(
            (a.how, a.backend_id),
            (how::AFFINITY, 12),
            "stamped {ahead} ns ahead: {a:?}"
        );
    }
}

/// A remembered backend that left the frontend is never used again, even while it is still a
/// backend of another Service (so it still exists) and the entry has not expired; a backend
/// that left and came back is used again.
#[test]
fn affinity_to_a_departed_backend_is_dropped() {
    let mut lb = world();
    // 13 was a backend of id 3 when the client chose it; it left id 3 but serves id 7.
    lb.remember(NETNS_A, 3, 13, T0);
    for i in 0..20 {
        let a = lb.run(&connect(
            "10.96.0.30:80",
            IPPROTO_TCP,
            T0 + SEC + i,
            NETNS_A,
        ));
        assert_eq!(a.outcome, FOUND);
        assert_ne!(
            a.backend_id, 13,
            "the client stayed on a departed backend: {a:?}"
        );
    }
    // The new choice is remembered and sticks.
    let now = lb.remembered(NETNS_A, 3).unwrap();
    assert_ne!(now.backend, 13);
    let a = lb.run(&connect(
        "10.96.0.30:80",
        IPPROTO_TCP,
        T0 + 2 * SEC,
        NETNS_A,
    ));
    assert_eq!((a.how, a.backend_id), (how::AFFINITY, now.backend));

    // It leaves too, as the agent does it: a new generation without it, then its match
    // entry goes; the next connection moves.
    let left = now.backend;
    let stays = if left == 11 { 12 } else { 11 };
    lb.frontend(Fe {
        vip: "10.96.0.30:80",
        proto: IPPROTO_TCP,
        id: 3,
        rev: 2,
        backends: &[stays],
        affinity_s: Some(10),
        affinity_id: 0,
    });
    lb.del_match(3, left);
    let a = lb.run(&connect(
        "10.96.0.30:80",
        IPPROTO_TCP,
        T0 + 3 * SEC,
        NETNS_A,
    ));
    assert_eq!((a.how, a.backend_id), (how::RANDOM, stays), "{a:?}");
    assert!(lb.stat(Reason::AffinityStale) >= 2);
}

/// An unconnected UDP socket keeps one backend for a frontend, datagram after datagram;
/// another socket chooses for itself.
#[test]
fn an_unconnected_udp_socket_keeps_its_backend() {
    let lb = world();
    let mut spread = std::collections::BTreeSet::new();
    for cookie in 1..=16u64 {
        let mut state = SockState::default();
        let first = lb.run(&sendmsg("10.96.0.40:53", cookie, T0, NETNS_A, state));
        assert_eq!(first.outcome, FOUND);
        state = first.sock;
        assert_eq!(state.choices[0].id, 4, "choice not remembered: {first:?}");
        assert_eq!(state.choices[0].backend, first.backend_id);
        assert_eq!(state.choices[0].addr, first.backend.addr);
        assert_eq!(state.choices[0].port_be, first.backend.port_be);
        for _ in 0..20 {
            let a = lb.run(&sendmsg("10.96.0.40:53", cookie, T0, NETNS_A, state));
            assert_eq!(
                (a.how, a.backend_id),
                (how::STICKY, first.backend_id),
                "{a:?}"
            );
            assert_eq!(a.sock, state, "a reuse writes nothing");
        }
        spread.insert(first.backend_id);
    }
    assert_eq!(
        spread,
        [21, 22].into(),
        "sockets should spread over backends"
    );
    assert_eq!(lb.stat(Reason::SockSticky), 16 * 20);
}

/// A socket whose backend left the frontend moves to a live one (and stays there); its
/// choices for other frontends are kept.
#[test]
fn a_udp_socket_moves_when_its_backend_leaves() {
    let mut lb = world();
    let mut state = SockState::default();
    let first = lb.run(&sendmsg("10.96.0.40:53", 7, T0, NETNS_A, state));
    state = first.sock;
    let other = lb.run(&sendmsg("10.96.0.60:53", 7, T0, NETNS_A, state));
    state = other.sock;
    assert_eq!(state.choices[1].id, 6);
    // The backend leaves the frontend as the agent makes it leave: a new generation without
    // it, and its match entry gone.
    let remaining = if first.backend_id == 21 { 22 } else { 21 };
    lb.frontend(Fe {
        vip: "10.96.0.40:53",
        proto: IPPROTO_UDP,
        id: 4,
        rev: 2,
        backends: &[remaining],
        affinity_s: None,
        affinity_id: 0,
    });
    lb.del_match(4, first.backend_id);
    let moved = lb.run(&sendmsg("10.96.0.40:53", 7, T0, NETNS_A, state));
    assert_eq!(moved.outcome, FOUND);
    assert_ne!(moved.backend_id, first.backend_id, "{moved:?}");
    assert_eq!(moved.how, how::RANDOM);
    assert_eq!(moved.sock.choices[0].id, 4);
    assert_eq!(moved.sock.choices[0].backend, moved.backend_id);
    assert_eq!(moved.sock.choices[1], state.choices[1]);
    assert_eq!(lb.stat(Reason::SockMoved), 1);
    let again = lb.run(&sendmsg("10.96.0.40:53", 7, T0, NETNS_A, moved.sock));
    assert_eq!(
        (again.how, again.backend_id),
        (how::STICKY, moved.backend_id)
    );
}

/// A socket that already remembers as many frontends as it can takes its backend from its
/// cookie: the same one every time, and different sockets spread.
#[test]
fn a_socket_with_no_room_hashes_its_cookie() {
    let lb = world();
    let mut full = SockState::default();
    for i in 0..SOCK_CHOICES {
        full.choices[i] = SockChoice {
            id: 100 + i as u32,
            backend: 23,
            ..Default::default()
        };
    }
    let mut spread = std::collections::BTreeSet::new();
    for cookie in 1..=32u64 {
        let req = sendmsg("10.96.0.40:53", cookie, T0, NETNS_A, full);
        let first = lb.run(&req);
        assert_eq!((first.outcome, first.how), (FOUND, how::HASHED));
        assert_eq!(first.sock, full, "nothing to remember it in");
        assert_eq!(seen(&lb, &req, 8), [first.backend_id].into());
        spread.insert(first.backend_id);
    }
    assert_eq!(spread, [21, 22].into());
    assert!(lb.stat(Reason::SockHashed) >= 32 * 9);
}

/// sessionAffinity and a UDP socket: a socket's first datagram to a frontend takes the
/// client's remembered backend, so every new socket of a pod lands where its affinity says;
/// after that the socket keeps its backend for its lifetime (as conntrack keeps a flow on
/// its backend in kube-proxy, where affinity only places new flows), even if the client's
/// affinity moves; its datagrams do not refresh the affinity entry (new flows do).
#[test]
fn udp_socket_and_affinity() {
    let mut lb = world();
    lb.remember(NETNS_A, 6, 22, T0);
    let first = lb.run(&sendmsg(
        "10.96.0.60:53",
        9,
        T0 + SEC,
        NETNS_A,
        SockState::default(),
    ));
    assert_eq!(
        (first.how, first.backend_id),
        (how::AFFINITY, 22),
        "{first:?}"
    );
    assert_eq!(first.sock.choices[0].backend, 22);
    assert_eq!(lb.remembered(NETNS_A, 6).unwrap().last_used_ns, T0 + SEC);
    // A second new socket of the pod: same backend.
    let second = lb.run(&sendmsg(
        "10.96.0.60:53",
        10,
        T0 + 2 * SEC,
        NETNS_A,
        SockState::default(),
    ));
    assert_eq!(second.backend_id, 22);
    // The client's affinity moves (another flow chose 21 after an expiry): the first socket
    // keeps 22, and its datagrams leave the entry alone.
    lb.remember(NETNS_A, 6, 21, T0 + 3 * SEC);
    for i in 0..5 {
        let a = lb.run(&sendmsg(
            "10.96.0.60:53",
            9,
            T0 + 4 * SEC + i,
            NETNS_A,
            first.sock,
        ));
        assert_eq!((a.how, a.backend_id), (how::STICKY, 22), "{a:?}");
    }
    assert_eq!(
        lb.remembered(NETNS_A, 6).unwrap(),
        AffinityValue {
            last_used_ns: T0 + 3 * SEC,
            backend: 21,
            _pad0: 0
        }
    );
    // Its backend leaves: it moves, through affinity (now 21), and remembers both.
    lb.del_match(6, 22);
    let moved = lb.run(&sendmsg(
        "10.96.0.60:53",
        9,
        T0 + 5 * SEC,
        NETNS_A,
        first.sock,
    ));
    assert_eq!(
        (moved.how, moved.backend_id),
        (how::AFFINITY, 21),
        "{moved:?}"
    );
    assert_eq!(moved.sock.choices[0].backend, 21);
}

/// What this file works around: the hooks the agent attaches cannot be test-run.
#[test]
fn sock_addr_has_no_test_run() {
    svc_agent_tests_require_root();
    let obj = svc_agent_object();
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(map_names::SOCK_REV, 64)
        .map_max_entries(map_names::AFFINITY, 64)
        .load(&obj)
        .expect("loading the agent's object");
    let prog: &mut aya::programs::CgroupSockAddr =
        ebpf.program_mut("connect4").unwrap().try_into().unwrap();
    prog.load().unwrap();
    let fd = prog.fd().unwrap();
    let err = raw_test_run(fd.as_fd()).expect_err("TEST_RUN of a sock_addr program");
    // ENOTSUPP (524), the kernel's "no test_run for this program type".
    assert_eq!(err.raw_os_error(), Some(524), "{err}");
}

fn svc_agent_object() -> Vec<u8> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bpfel-unknown-none/release/svc");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

/// BPF_PROG_TEST_RUN with 64 bytes of packet, for a program aya offers no test run for.
fn raw_test_run(prog: BorrowedFd<'_>) -> std::io::Result<()> {
    let data = [0u8; 64];
    let mut attr = [0u64; 16];
    // struct { u32 prog_fd; u32 retval; u32 data_size_in; u32 data_size_out;
    //          u64 data_in; u64 data_out; u32 repeat; u32 duration; ... } test;
    attr[0] = prog.as_raw_fd() as u64;
    attr[1] = data.len() as u64;
    attr[2] = data.as_ptr() as u64;
    // SAFETY: attr is a zeroed bpf_attr prefix of the size we pass; data outlives the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            10, // BPF_PROG_TEST_RUN
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr) as u32,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// sessionAffinity is kept per Service port (its affinity id), not per frontend: a pod's
/// choice at the IPv4 ClusterIP holds at the same port's IPv6 ClusterIP; another port over the
/// same backends keeps its own; a remembered backend that the frontend at hand does not have
/// is not used, and the new choice replaces it.
#[test]
fn affinity_is_shared_by_the_frontends_of_a_service_port() {
    let mut lb = world();
    for (id, ip) in [(31, "fd00::31"), (32, "fd00::32")] {
        lb.backend(id, &format!("[{ip}]:8080"), IPPROTO_TCP);
    }
    let fes = [
        // Port 90: two IPv4 frontends (a ClusterIP and an ExternalIP's view from the node),
        // and an IPv6 ClusterIP with IPv6 backends.
        ("10.96.1.10:80", 40, &[11, 12][..], 90),
        ("[fd00:96::1:10]:80", 41, &[31, 32][..], 90),
        ("192.0.2.10:80", 44, &[11, 12][..], 90),
        // Port 91, another Service over the same backends.
        ("10.96.1.20:80", 42, &[11, 12][..], 91),
        // Port 92: a frontend with backend 12 only.
        ("10.96.1.30:80", 43, &[12][..], 92),
    ];
    for (vip, id, backends, affinity_id) in fes {
        lb.frontend(Fe {
            vip,
            proto: IPPROTO_TCP,
            id,
            rev: 1,
            backends,
            affinity_s: Some(10),
            affinity_id,
        });
    }
    let first = lb.run(&connect("10.96.1.10:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!(first.outcome, FOUND);
    assert_eq!(
        lb.remembered(NETNS_A, 90).map(|v| v.backend),
        Some(first.backend_id)
    );
    assert!(lb.remembered(NETNS_A, 40).is_none());
    let first6 = lb.run(&connect("[fd00:96::1:10]:80", IPPROTO_TCP, T0, NETNS_A));
    assert_eq!(first6.outcome, FOUND);
    // The pod alternates families: each keeps its own choice (kube-proxy has one proxier,
    // and one affinity, per family), and IPv4 frontends of the port share theirs.
    for i in 1..=10 {
        let a = lb.run(&connect("192.0.2.10:80", IPPROTO_TCP, T0 + i, NETNS_A));
        assert_eq!(
            (a.how, a.backend_id),
            (how::AFFINITY, first.backend_id),
            "{a:?}"
        );
        let a = lb.run(&connect("[fd00:96::1:10]:80", IPPROTO_TCP, T0 + i, NETNS_A));
        assert_eq!(
            (a.how, a.backend_id),
            (how::AFFINITY, first6.backend_id),
            "{a:?}"
        );
    }
    assert_eq!(
        lb.remembered(NETNS_A, 90).map(|v| v.backend),
        Some(first.backend_id)
    );
    assert!(lb.remembered(NETNS_A, 41).is_none());
    assert!(lb.remembered(NETNS_A, 44).is_none());

    // Two ports never share a choice.
    lb.remember(NETNS_B, 90, 11, T0);
    lb.remember(NETNS_B, 91, 12, T0);
    for i in 0..5 {
        let a = lb.run(&connect("10.96.1.10:80", IPPROTO_TCP, T0 + i, NETNS_B));
        let b = lb.run(&connect("10.96.1.20:80", IPPROTO_TCP, T0 + i, NETNS_B));
        assert_eq!((a.how, a.backend_id), (how::AFFINITY, 11));
        assert_eq!((b.how, b.backend_id), (how::AFFINITY, 12));
    }

    // Not a backend of this frontend: chosen afresh, and remembered for the port.
    lb.remember(NETNS_B, 92, 11, T0);
    let stale = lb.stat(Reason::AffinityStale);
    let a = lb.run(&connect("10.96.1.30:80", IPPROTO_TCP, T0, NETNS_B));
    assert_eq!((a.how, a.backend_id), (how::RANDOM, 12));
    assert_eq!(lb.stat(Reason::AffinityStale), stale + 1);
    assert_eq!(lb.remembered(NETNS_B, 92).map(|v| v.backend), Some(12));
}

/// What a counter costs a socket hook: the mean time of a decision that counts once (an
/// affinity hit, `AffinityHit`) and of one that counts nothing (not a service), over many
/// runs. Run it on this object and on one built before the one counter map (the hit then
/// counted in a per-CPU array) with `SVC_EBPF_TEST_OBJECT`: the difference of the differences
/// is the per-CPU hash's price over the array's. docs/design/packet-datapath.md, "Counters".
#[test]
#[ignore = "a measurement: cargo test -p svc-ebpf-tests --test lb_decision decision_cost -- --ignored --nocapture"]
fn decision_cost() {
    let lb = world();
    let hit = connect("10.96.0.30:80", IPPROTO_TCP, T0, NETNS_A);
    lb.run(&hit);
    assert_eq!(lb.run(&hit).how, how::AFFINITY, "every run an affinity hit");
    let miss = connect("10.1.2.3:80", IPPROTO_TCP, T0, NETNS_A);
    let repeat = 1_000_000;
    for round in 0..5 {
        let (h, m) = (lb.time(&hit, repeat), lb.time(&miss, repeat));
        eprintln!(
            "round {round}: affinity hit {h:.1} ns, not a service {m:.1} ns, difference {:.1} ns",
            h - m
        );
    }
}
