//! An exact comparison of what the maps hold with what should be programmed: every master
//! entry leads to all its slots, backends, reverse-NAT and name entries, the backends are the
//! desired ones, the frontends that check remembered choices have a membership entry for
//! each of their backends and for nothing else, and nothing else is there. The crash tests judge recovery by it, and it
//! explains drift.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;

use svc_common::{
    backend_flags, checks_match, node_addr_flags, svc_flags, AffinityMatchKey, BackendId,
    DatapathConfig, NodeAddrValue, SlotKey, SrcRangeKey, PROTO_ANY,
};

use crate::model::{Backend, DesiredFrontend, DesiredState, Frontend};
use crate::reconcile::{
    addr16, decode_name, external_addr, flags_of, ip_from16, plan::rev_nat_value, range_key,
    ranges_of, service_key, stored_name, TableRef,
};
use crate::store::Snapshot;

/// Every difference between `snap` and `desired`, in words; empty when they agree exactly.
/// Maglev tables as an agent with the default flags writes them.
pub fn check(snap: &Snapshot, desired: &DesiredState) -> Vec<String> {
    check_with(snap, desired, &crate::maglev::Settings::default())
}

/// `check`, for an agent with the Maglev flags `maglev`: every external frontend with
/// backends whose algorithm is Maglev has its generation's table, of its size and seed,
/// clear of every other table, holding (when `snap` has the tables read) what the builder
/// makes of its backends in slot order; no other frontend has one, and no index entry is
/// left over.
pub fn check_with(
    snap: &Snapshot,
    desired: &DesiredState,
    maglev: &crate::maglev::Settings,
) -> Vec<String> {
    let mut problems = Vec::new();
    let index: HashMap<SlotKey, svc_common::MaglevIndex> =
        snap.maglev_index.iter().copied().collect();
    let mut used_index = HashSet::new();
    let mut regions: Vec<(u32, u32, Frontend)> = Vec::new();
    let services: HashMap<_, _> = snap.services.iter().copied().collect();
    let slots: HashMap<SlotKey, svc_common::SlotGroup> = snap.slots.iter().copied().collect();
    let backends: HashMap<BackendId, _> = snap.backends.iter().copied().collect();
    let rev_nat: HashMap<u32, _> = snap.rev_nat.iter().copied().collect();
    let names: HashMap<u32, _> = snap.names.iter().copied().collect();
    let matches: HashSet<AffinityMatchKey> = snap.matches.iter().copied().collect();
    let mut used_matches = HashSet::new();
    let ranges: HashSet<SrcRangeKey> = snap.ranges.iter().copied().collect();
    let mut used_ranges = HashSet::new();

    let mut used_slots = HashSet::new();
    let mut used_ids = HashSet::new();
    let mut used_backends = HashSet::new();
    let mut expected_keys = HashSet::new();
    // Affinity ids: one per Service port (name and protocol), never another port's.
    let mut port_of_affinity: HashMap<u32, (String, crate::model::Protocol)> = HashMap::new();
    let mut affinity_of_port: HashMap<(String, crate::model::Protocol), u32> = HashMap::new();
    for (fe, d) in &desired.frontends {
        let key = service_key(fe);
        expected_keys.insert(key);
        let Some(v) = services.get(&key) else {
            problems.push(format!("{fe} ({}): no master entry", d.service));
            continue;
        };
        if v.flags & svc_flags::ADDR_MARKER != 0 {
            problems.push(format!("{fe}: a marker where a frontend should be"));
            continue;
        }
        if !used_ids.insert(v.id) {
            problems.push(format!("{fe}: id {} shared with another frontend", v.id));
        }
        let (flags, timeout) = flags_of(d);
        let wants = fe.scope == crate::model::Scope::External
            && !d.backends.is_empty()
            && maglev.external(d.lb_algorithm) == crate::maglev::Algorithm::Maglev;
        match (wants, v.flags & svc_flags::MAGLEV != 0) {
            (true, false) => problems.push(format!("{fe}: no Maglev table")),
            (false, true) => problems.push(format!("{fe}: a Maglev table it does not want")),
            (true, true) => {
                let key = crate::reconcile::maglev_key(v.id, v.rev);
                used_index.insert(key);
                match index.get(&key).map(|i| (i, TableRef::of(i))) {
                    None => problems.push(format!("{fe}: Maglev index entry missing")),
                    Some((i, None)) => problems.push(format!("{fe}: Maglev index entry {i:?}")),
                    Some((_, Some(t))) => {
                        regions.push((t.start, t.start + t.blocks(), *fe));
                        check_table(snap, d, &t, maglev, &mut problems);
                    }
                }
            }
            (false, false) => {}
        }
        if v.flags & !svc_flags::MAGLEV != flags || v.affinity_timeout_s != timeout {
            problems.push(format!(
                "{fe}: flags {:#x}/{}s, want {flags:#x}/{timeout}s",
                v.flags, v.affinity_timeout_s
            ));
        }
        if flags & svc_flags::AFFINITY == 0 {
            if v.affinity_id != 0 {
                problems.push(format!(
                    "{fe}: affinity id {} without affinity",
                    v.affinity_id
                ));
            }
        } else if v.affinity_id == 0 {
            problems.push(format!("{fe}: sessionAffinity without an affinity id"));
        } else {
            let port = (stored_name(&d.service), fe.protocol);
            let id = *affinity_of_port
                .entry(port.clone())
                .or_insert(v.affinity_id);
            if id != v.affinity_id {
                problems.push(format!(
                    "{fe}: affinity id {}, another frontend of {} has {id}",
                    v.affinity_id, port.0
                ));
            }
            match port_of_affinity.get(&v.affinity_id) {
                Some(other) if *other != port => problems.push(format!(
                    "{fe}: affinity id {} shared by {}/{} and {}/{}",
                    v.affinity_id, other.0, other.1, port.0, port.1
                )),
                Some(_) => {}
                None => {
                    port_of_affinity.insert(v.affinity_id, port);
                }
            }
        }
        let mut got: Vec<Backend> = Vec::new();
        let check_members = checks_match(fe.protocol.ipproto(), v.flags);
        for slot in 1..=v.count {
            let (sk, i) = SlotKey::of_slot(v.id, v.rev, u32::from(slot) - 1);
            used_slots.insert(sk);
            let Some(b) = slots.get(&sk).map(|g| &g.backends[i]).filter(|b| **b != 0) else {
                problems.push(format!(
                    "{fe}: slot {slot} of id {} rev {} missing",
                    v.id, v.rev
                ));
                continue;
            };
            used_backends.insert(*b);
            if check_members {
                let k = AffinityMatchKey {
                    id: v.id,
                    backend: *b,
                };
                used_matches.insert(k);
                if !matches.contains(&k) {
                    problems.push(format!(
                        "{fe}: membership entry of backend {b} (id {}) missing",
                        v.id
                    ));
                }
            }
            match backends.get(b) {
                Some(be) if be.proto == fe.protocol.ipproto() => got.push(Backend::new(
                    SocketAddr::new(ip_from16(be.addr), u16::from_be(be.port_be)),
                    be.flags & backend_flags::LOCAL != 0,
                )),
                Some(_) => problems.push(format!("{fe}: backend {b} has another protocol")),
                None => problems.push(format!("{fe}: slot {slot} names missing backend {b}")),
            }
        }
        let (last, _) = SlotKey::of_slot(v.id, v.rev, u32::from(v.count.max(1)) - 1);
        let past = usize::from(v.count) % svc_common::SLOT_GROUP as usize;
        if let Some(g) = slots.get(&last).filter(|_| past != 0) {
            if g.backends[past..].iter().any(|b| *b != 0) {
                problems.push(format!(
                    "{fe}: a backend past slot {} of id {} rev {}",
                    v.count, v.id, v.rev
                ));
            }
        }
        if got != d.backends {
            problems.push(format!(
                "{fe} ({}): backends {got:?}, want {:?}",
                d.service, d.backends
            ));
        }
        for c in ranges_of(d).iter() {
            let k = range_key(v.id, c);
            used_ranges.insert(k);
            if !ranges.contains(&k) {
                problems.push(format!("{fe}: source range {c} (id {}) missing", v.id));
            }
        }
        match rev_nat.get(&v.id) {
            Some(r) if *r == rev_nat_value(fe) => {}
            Some(_) => problems.push(format!(
                "{fe}: reverse NAT of id {} names another frontend",
                v.id
            )),
            None => problems.push(format!("{fe}: reverse NAT of id {} missing", v.id)),
        }
        match names.get(&v.id) {
            Some(n) if decode_name(n) == stored_name(&d.service) => {}
            Some(n) => problems.push(format!(
                "{fe}: name {:?}, want {:?}",
                decode_name(n),
                d.service
            )),
            None => problems.push(format!("{fe}: name of id {} missing", v.id)),
        }
    }

    let mut markers = BTreeSet::new();
    for (k, v) in &snap.services {
        let marker = k.port_be == 0 && k.proto == PROTO_ANY && k.scope == 0;
        if marker && v.flags & svc_flags::ADDR_MARKER != 0 {
            markers.insert(ip_from16(k.addr));
        } else if !expected_keys.contains(k) {
            problems.push(format!(
                "stray master entry {}:{} proto {} (id {})",
                ip_from16(k.addr),
                u16::from_be(k.port_be),
                k.proto,
                v.id
            ));
        }
    }
    for ip in desired.cluster_ips.difference(&markers) {
        problems.push(format!("ClusterIP {ip}: marker missing"));
    }
    for ip in markers.difference(&desired.cluster_ips) {
        problems.push(format!("ClusterIP {ip}: stray marker"));
    }
    let strays = |what: &str, n: usize| (n > 0).then(|| format!("{n} stray {what} entries"));
    problems.extend(strays(
        "slot",
        slots.keys().filter(|k| !used_slots.contains(*k)).count(),
    ));
    problems.extend(strays(
        "reverse-NAT",
        rev_nat.keys().filter(|id| !used_ids.contains(*id)).count(),
    ));
    problems.extend(strays(
        "name",
        names.keys().filter(|id| !used_ids.contains(*id)).count(),
    ));
    problems.extend(strays(
        "membership",
        matches.difference(&used_matches).count(),
    ));
    problems.extend(strays(
        "source range",
        ranges.difference(&used_ranges).count(),
    ));
    problems.extend(strays(
        "Maglev index",
        index.keys().filter(|k| !used_index.contains(*k)).count(),
    ));
    regions.sort();
    // One region named by several frontends is a shared table (each checked above against
    // its own backends when the tables are read); any other overlap is a bookkeeping error.
    for w in regions.windows(2) {
        if w[0].1 > w[1].0 && (w[0].0, w[0].1) != (w[1].0, w[1].1) {
            problems.push(format!(
                "the Maglev tables of {} and {} overlap",
                w[0].2, w[1].2
            ));
        }
    }
    // NODE_ADDRS (reconcile/addrs.rs): every external frontend's address, flagged EXTERNAL; the
    // node's part is checked when the desired state has one (the agent's always does; a
    // desired state built from Services alone does not). An entry that only lingers is for
    // flows this check cannot see, never a stray.
    let node_addrs: HashMap<[u8; 16], NodeAddrValue> = snap.node_addrs.iter().copied().collect();
    let external: BTreeSet<[u8; 16]> = desired.frontends.keys().filter_map(external_addr).collect();
    for k in &external {
        if node_addrs
            .get(k)
            .is_none_or(|v| v.flags & node_addr_flags::EXTERNAL == 0)
        {
            problems.push(format!(
                "external frontend address {} missing from NODE_ADDRS",
                ip_from16(*k)
            ));
        }
    }
    if let Some(c) = &desired.node.config {
        // The mark of frontend ports in the SNAT range must be there for such a desired
        // frontend; without one it may stay while a removed one's flows live on.
        let c = &DatapathConfig {
            snat_range_frontends: if crate::reconcile::snat_range_frontends(
                c,
                desired.frontends.keys(),
            ) {
                1
            } else {
                snap.config.snat_range_frontends
            },
            ..*c
        };
        if *c != snap.config {
            problems.push(format!("datapath config {:?}, want {c:?}", snap.config));
        }
        for (ip, want) in &desired.node.addrs {
            let mut want = *want;
            if external.contains(&addr16(*ip)) {
                want.flags |= node_addr_flags::EXTERNAL;
            }
            match node_addrs.get(&addr16(*ip)) {
                Some(got) if *got == want => {}
                Some(got) => problems.push(format!("node address {ip}: {got:?}, want {want:?}")),
                None => problems.push(format!("node address {ip} missing")),
            }
        }
        for (k, v) in &node_addrs {
            let ip = ip_from16(*k);
            if desired.node.addrs.contains_key(&ip) {
                continue;
            }
            let want = if external.contains(k) {
                node_addr_flags::EXTERNAL
            } else {
                node_addr_flags::LINGER
            };
            if v.flags != want {
                problems.push(format!("stray node address {ip}: {v:?}"));
            }
        }
    }
    let max_f = snap.services.iter().map(|(_, v)| v.id).max().unwrap_or(0);
    let max_b = snap.backends.iter().map(|(id, _)| *id).max().unwrap_or(0);
    if max_f >= snap.meta.frontend_id_hwm && max_f > 0 {
        problems.push(format!(
            "frontend id {max_f} is not below the durable mark {}",
            snap.meta.frontend_id_hwm
        ));
    }
    if max_b >= snap.meta.backend_id_hwm && max_b > 0 {
        problems.push(format!(
            "backend id {max_b} is not below the durable mark {}",
            snap.meta.backend_id_hwm
        ));
    }
    problems
}

/// A frontend's table: the size of its backend count, the seed of the flags, and (tables
/// read) the builder's table of its backends in slot order.
fn check_table(
    snap: &Snapshot,
    d: &DesiredFrontend,
    t: &TableRef,
    maglev: &crate::maglev::Settings,
    problems: &mut Vec<String>,
) {
    let fe = &d.frontend;
    let size = crate::maglev::table_size(d.backends.len());
    if t.size != size || t.seed != maglev.seed {
        problems.push(format!(
            "{fe}: Maglev table of {} entries, seed {:#x}; want {size}, {:#x}",
            t.size, t.seed, maglev.seed
        ));
        return;
    }
    let Some(tables) = &snap.maglev_tables else {
        return;
    };
    let proto = fe.protocol.ipproto();
    let idents: Vec<crate::maglev::Identity> = (d.backends.iter())
        .map(|b| crate::maglev::Identity::of(b.addr(), proto))
        .collect();
    let Ok(want) = crate::maglev::build(maglev.seed, &idents) else {
        return;
    };
    match tables.get(&t.start) {
        Some(got) if *got == want.to_blocks() => {}
        Some(got) => {
            let differ = (got.iter().flat_map(|b| b.entries))
                .zip(want.entries.iter())
                .filter(|(g, w)| g != *w)
                .count();
            problems.push(format!(
                "{fe}: Maglev table differs from its backends' in {differ} of {} entries",
                want.entries.len()
            ));
        }
        None => problems.push(format!("{fe}: Maglev table not read")),
    }
}
