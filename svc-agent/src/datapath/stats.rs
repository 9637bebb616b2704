//! Counters and flow counts read from the pinned maps, for `/metrics`.

use std::os::fd::AsFd;
use std::path::Path;

use aya::maps::{Array, Map, MapData, PerCpuHashMap};
use svc_common::{map_names, DevStatKey, Reason};

use super::load::pinned;
use super::load_err;
use super::pins::map_pin;
use crate::error::Result;
use crate::sys;

/// What the packet datapath's maps say, for `/metrics`.
#[derive(Debug, Default)]
pub struct PacketStats {
    /// (ifindex, `Reason` name, total over the CPUs), from `DEV_STATS`: the tc programs'
    /// counters (device 0, the socket hooks', is `read_stats`'s).
    pub devices: Vec<(u32, &'static str, u64)>,
    /// Entries of `CT`, the assured flows' table (two per flow, dead ones included until the
    /// next sweep).
    pub ct_entries: u64,
    pub ct_capacity: u32,
    /// Entries of `CT_NEW`, the unassured flows' table (an LRU a flood churns), and its size.
    pub ct_new_entries: u64,
    pub ct_new_capacity: u32,
    /// Live flows (`FlowCount`), SNATed or not.
    pub flows: u64,
    pub snat_flows: u64,
    /// The most SNAT ports one (SNAT address, backend) pair holds for live flows that are
    /// not closed nor idle both ways for the reclaim bound (a closed, dead or long-idle
    /// flow's port goes to the next new flow that needs it): a new flow to that backend is
    /// dropped once this reaches the size of the SNAT port range.
    pub snat_ports_max: u64,
}

/// Counts the live flows of a walk of `CT`, as the datapath judges them: a flow is alive while
/// a packet of either direction came within its entry's timeout (the FORWARD entry, or the
/// entry at its partner key while that is still this flow's). Nothing removes a dead flow's entries but the need for room, so
/// a full table is the steady state; counting its entries would report a node that has been
/// busy once as busy for good, and its SNAT ports as nearly exhausted.
pub struct FlowCount {
    now_ns: u64,
    config: svc_common::DatapathConfig,
    flows: u64,
    snat_flows: u64,
    /// Per (SNAT address, backend address, backend port, protocol): as many entries as there
    /// are such pairs, not flows.
    ports: std::collections::HashMap<([u8; 16], [u8; 16], u16, u8), u64>,
    /// FORWARD entries past their timeout, with their partner key: alive if that entry is
    /// not, and leads back to them.
    stale: Vec<(svc_common::CtKey, svc_common::CtKey, svc_common::CtValue)>,
    /// REPLY entries within their timeout, to the FORWARD key they lead to.
    fresh_replies: std::collections::HashMap<svc_common::CtKey, svc_common::CtKey>,
    /// Live SNATed flows not closed (FORWARD key and entry): their ports are counted at the
    /// end, when both directions' last packets are known.
    snat_open: Vec<(svc_common::CtKey, svc_common::CtValue)>,
    /// SNATed REPLY entries: the FORWARD key they lead to and their last packet.
    snat_replies: std::collections::HashMap<svc_common::CtKey, (svc_common::CtKey, u64)>,
}

impl FlowCount {
    pub fn new(now_ns: u64, config: svc_common::DatapathConfig) -> Self {
        FlowCount {
            now_ns,
            config,
            flows: 0,
            snat_flows: 0,
            ports: Default::default(),
            stale: Default::default(),
            fresh_replies: Default::default(),
            snat_open: Default::default(),
            snat_replies: Default::default(),
        }
    }

    pub fn add(&mut self, k: &svc_common::CtKey, v: &svc_common::CtValue) {
        let timeout_ns = u64::from(svc_common::ct_timeout::seconds(
            &self.config,
            k.proto,
            v.flags,
        )) * 1_000_000_000;
        let fresh = self.now_ns.saturating_sub(v.last_seen_ns) <= timeout_ns;
        if k.dir == svc_common::ct_dir::REPLY && v.flags & svc_common::ct_flags::SNAT != 0 {
            self.snat_replies.insert(*k, (k.partner(v), v.last_seen_ns));
        }
        match (k.dir == svc_common::ct_dir::FORWARD, fresh) {
            (true, true) => self.live(k, v),
            (true, false) => self.stale.push((*k, k.partner(v), *v)),
            (false, true) => {
                self.fresh_replies.insert(*k, k.partner(v));
            }
            (false, false) => {}
        }
    }

    fn live(&mut self, k: &svc_common::CtKey, v: &svc_common::CtValue) {
        use svc_common::ct_flags;
        self.flows += 1;
        if v.flags & ct_flags::SNAT == 0 {
            return;
        }
        self.snat_flows += 1;
        // An unassured flow's port goes to a new flow that finds the range busy (from the
        // datapath's fifth try), as a closed one's: neither is a port in use.
        if !ct_flags::closed(v.flags) && v.flags & ct_flags::UNASSURED == 0 {
            self.snat_open.push((*k, *v));
        }
    }

    /// (flows, SNATed flows, the most SNAT ports in use towards one backend).
    pub fn finish(mut self) -> (u64, u64, u64) {
        let stale = std::mem::take(&mut self.stale);
        for (k, partner, v) in &stale {
            if self.fresh_replies.get(partner) == Some(k) {
                self.live(k, v);
            }
        }
        // A flow idle both ways for the reclaim bound gives its port to a new flow that needs
        // it, as the datapath's SNAT search does.
        let bound =
            u64::from(svc_common::ct_timeout::snat_reclaim_idle_s(&self.config)) * 1_000_000_000;
        for (k, v) in std::mem::take(&mut self.snat_open) {
            let reply = self
                .snat_replies
                .get(&k.partner(&v))
                .filter(|(to, _)| *to == k)
                .map_or(0, |(_, seen)| *seen);
            if self.now_ns.saturating_sub(v.last_seen_ns.max(reply)) > bound {
                continue;
            }
            *self
                .ports
                .entry((v.snat_addr, v.nat_addr, v.nat_port_be, k.proto))
                .or_default() += 1;
        }
        let most = self.ports.values().copied().max().unwrap_or(0);
        (self.flows, self.snat_flows, most)
    }
}

/// Reads `DEV_STATS` and `CT` from the pins in `dir`: the whole CT map, in batches of a few
/// hundred KB (a full 262,144-entry map is about 25 MB to read, never held at once).
pub fn read_packet_stats(dir: &Path) -> Result<PacketStats> {
    use svc_common::{CtKey, CtValue, DatapathConfig};
    let mut out = PacketStats {
        // Device 0 is the socket hooks' (`read_stats`).
        devices: counters(pinned(dir, map_names::DEV_STATS)?)?
            .into_iter()
            .filter(|(ifindex, _, _)| *ifindex != 0)
            .map(|(ifindex, reason, v)| (ifindex, reason.name(), v))
            .collect(),
        ..Default::default()
    };
    out.devices.sort();
    let ct =
        MapData::from_pin(map_pin(dir, map_names::CT)).map_err(|e| load_err(map_names::CT, e))?;
    out.ct_capacity = ct
        .info()
        .map_err(|e| load_err(map_names::CT, e))?
        .max_entries();
    // The timeouts the datapath judges by; the built-in ones when the agent wrote none.
    let config: Array<MapData, DatapathConfig> = Array::try_from(pinned(dir, map_names::CONFIG)?)
        .map_err(|e| load_err(map_names::CONFIG, e))?;
    let config = config.get(&0, 0).unwrap_or_default();
    let mut count = FlowCount::new(sys::coarse_now_ns(), config);
    sys::for_each_hash::<CtKey, CtValue>(ct.fd().as_fd(), |k, v| {
        out.ct_entries += 1;
        count.add(k, v);
    })
    .map_err(|e| load_err(map_names::CT, e))?;
    // Absent where an older agent's datapath serves (one table of every flow).
    if let Ok(new) = MapData::from_pin(map_pin(dir, map_names::CT_NEW)) {
        out.ct_new_capacity = new
            .info()
            .map_err(|e| load_err(map_names::CT_NEW, e))?
            .max_entries();
        sys::for_each_hash::<CtKey, CtValue>(new.fd().as_fd(), |k, v| {
            out.ct_new_entries += 1;
            count.add(k, v);
        })
        .map_err(|e| load_err(map_names::CT_NEW, e))?;
    }
    (out.flows, out.snat_flows, out.snat_ports_max) = count.finish();
    Ok(out)
}

/// The socket programs' decisions (`decision_totals`), from the pinned counter map alone.
pub fn read_stats(dir: &Path) -> Result<Vec<(&'static str, u64)>> {
    Ok(decision_totals(&counters(pinned(
        dir,
        map_names::DEV_STATS,
    )?)?))
}

/// `counters` of an open `DEV_STATS`.
pub fn counters_of(map: &MapData) -> Result<Vec<(u32, Reason, u64)>> {
    counters(Map::PerCpuHashMap(super::migrate::clone_map(map)?))
}

/// Every counter of `DEV_STATS` (the datapath's one counter map), summed over the CPUs:
/// (device ifindex, 0 for none; reason; total), sorted. A reason this agent does not know
/// (a newer agent's programs may count one) is left out.
fn counters(map: Map) -> Result<Vec<(u32, Reason, u64)>> {
    let err = |e| load_err(map_names::DEV_STATS, e);
    let map: PerCpuHashMap<MapData, DevStatKey, u64> = PerCpuHashMap::try_from(map).map_err(err)?;
    let mut out = Vec::new();
    for entry in map.iter() {
        let (k, per_cpu) = entry.map_err(err)?;
        if let Some(reason) = Reason::from_u32(k.reason) {
            out.push((k.ifindex, reason, per_cpu.iter().sum()));
        }
    }
    out.sort();
    Ok(out)
}

/// The socket programs' decisions (`svc_datapath_decisions`, `svc-agent list`), by reason:
/// each of `Reason::DECISIONS`, summed over every device, zeros included. Summed, not read at
/// device 0 alone: two of them are counted with a device since the datapath counts in one
/// map (`CtAssuredFull`, and the tc programs' `ErrMissingEntry`), and this series counted
/// them before.
pub fn decision_totals(counters: &[(u32, Reason, u64)]) -> Vec<(&'static str, u64)> {
    Reason::DECISIONS
        .iter()
        .map(|r| {
            let total = counters
                .iter()
                .filter(|(_, c, _)| c == r)
                .map(|(_, _, v)| v)
                .sum();
            (r.name(), total)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::FlowCount;
    use svc_common::{ct_dir, ct_flags, CtKey, CtValue, DatapathConfig, IPPROTO_TCP, IPPROTO_UDP};

    const S: u64 = 1_000_000_000;

    fn a(last: u8) -> [u8; 16] {
        let mut x = [0u8; 16];
        x[10] = 0xff;
        x[11] = 0xff;
        x[12..].copy_from_slice(&[198, 51, 100, last]);
        x
    }

    /// A flow from client port `port` to a remote backend, SNATed to the node's port
    /// `snat_port`, its two entries last seen at `fwd_s` and `rep_s` (seconds).
    fn flow(
        proto: u8,
        port: u16,
        snat_port: u16,
        flags: u16,
        fwd_s: u64,
        rep_s: u64,
    ) -> [(CtKey, CtValue); 2] {
        let forward = CtKey {
            saddr: a(7),
            daddr: a(1),
            sport_be: port.to_be(),
            dport_be: 30080u16.to_be(),
            proto,
            dir: ct_dir::FORWARD,
            _pad0: [0; 2],
        };
        let v = CtValue {
            nat_addr: a(20),
            nat_port_be: 8080u16.to_be(),
            snat_addr: a(1),
            snat_port_be: snat_port.to_be(),
            flags: ct_flags::SNAT | flags,
            last_seen_ns: fwd_s * S,
            ..Default::default()
        };
        let reply = forward.partner(&v);
        let rv = CtValue {
            nat_addr: a(1),
            nat_port_be: 30080u16.to_be(),
            snat_addr: a(7),
            snat_port_be: port.to_be(),
            last_seen_ns: rep_s * S,
            ..v
        };
        assert_eq!(reply.partner(&rv), forward);
        [(forward, v), (reply, rv)]
    }

    /// What `/metrics` reports of a full table: only the flows the datapath takes for alive
    /// (either direction within its timeout), and of their SNAT ports only those of flows not
    /// closed. Before, every FORWARD entry counted, dead or not: a node busy once showed its
    /// SNAT ports in use, towards exhaustion, for good.
    #[test]
    fn flows_and_snat_ports_count_only_live_flows() {
        let now = 100_000;
        // Older than established TCP's timeout.
        let stale = u64::from(svc_common::ct_timeout::TCP_ESTABLISHED_S) + 100;
        let closed = ct_flags::FIN | ct_flags::FIN_FORWARD | ct_flags::FIN_REPLY;
        let entries = [
            // Established TCP, both fresh.
            flow(
                IPPROTO_TCP,
                40001,
                61001,
                ct_flags::SEEN_REPLY,
                now - 5,
                now - 5,
            ),
            // A download's tail: only the reply direction speaks.
            flow(
                IPPROTO_TCP,
                40002,
                61002,
                ct_flags::SEEN_REPLY,
                now - stale,
                now - 1,
            ),
            // Closed a moment ago: alive for its closing timeout, its port reclaimable.
            flow(IPPROTO_TCP, 40003, 61003, closed, now - 1, now - 1),
            // Dead: UDP silent for longer than its timeout, TCP for longer than its established timeout.
            flow(IPPROTO_UDP, 40004, 61004, 0, now - 3_600, now - 3_600),
            flow(
                IPPROTO_TCP,
                40005,
                61005,
                ct_flags::SEEN_REPLY,
                now - stale,
                now - stale,
            ),
        ];
        // Alive (established TCP lives 24 h idle), but idle both ways past the SNAT reclaim
        // bound: its port is not counted in use.
        let idle = u64::from(svc_common::ct_timeout::SNAT_RECLAIM_IDLE_S) + 60;
        let long_idle = flow(
            IPPROTO_TCP,
            40007,
            61007,
            ct_flags::SEEN_REPLY,
            now - idle,
            now - idle,
        );
        // Dead, its reply tuple taken by the first flow (the same SNAT port): that flow's
        // freshness is not its own.
        let [old, _] = flow(
            IPPROTO_TCP,
            40006,
            61001,
            ct_flags::SEEN_REPLY,
            now - stale,
            0,
        );
        let mut count = FlowCount::new(now * S, DatapathConfig::default());
        for (k, v) in entries
            .iter()
            .flatten()
            .chain([old].iter())
            .chain(&long_idle)
        {
            count.add(k, v);
        }
        assert_eq!(count.finish(), (4, 4, 2));
    }

    /// An unassured flow (a spoofed SYN the backend answered, never acknowledged) is a live
    /// flow, but its SNAT port is not in use: a new flow takes it. Before, a flood of spoofed
    /// SYNs showed the range as nearly exhausted.
    #[test]
    fn snat_ports_in_use_leave_unassured_flows_out() {
        let now = 100_000;
        let assured = flow(
            IPPROTO_TCP,
            40001,
            61001,
            ct_flags::SEEN_REPLY,
            now - 1,
            now - 1,
        );
        let spoofed = flow(
            IPPROTO_TCP,
            40002,
            61002,
            ct_flags::SEEN_REPLY | ct_flags::UNASSURED,
            now - 1,
            now - 1,
        );
        let mut count = FlowCount::new(now * S, DatapathConfig::default());
        for (k, v) in assured.iter().chain(&spoofed) {
            count.add(k, v);
        }
        assert_eq!(count.finish(), (2, 2, 1));
    }
}

/// One Service port's counters (`SERVICE_STATS`), summed over the
/// frontends it has on this node (ClusterIPs, NodePort, external addresses): `counts` in the
/// order of `Reason::SERVICE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceCounts {
    /// "namespace/name:port" as the names map holds it, split by `parts` when encoded: one
    /// string a Service port rather than three copies (100,000 of them at each scrape).
    pub name: String,
    pub counts: [u64; svc_common::SERVICE_STAT_SLOTS],
}

impl ServiceCounts {
    /// Namespace, Service and port name (empty for an unnamed port).
    pub fn parts(&self) -> (&str, &str, &str) {
        split_name(&self.name)
    }
}

/// "namespace/name:port" (":port" absent for an unnamed port) as its three parts.
fn split_name(name: &str) -> (&str, &str, &str) {
    let (ns, rest) = name.split_once('/').unwrap_or(("", name));
    let (svc, port) = rest.split_once(':').unwrap_or((rest, ""));
    (ns, svc, port)
}

/// The per-Service counters of the frontends the datapath serves now, from the pins in `dir`,
/// by Service port, sorted. Only frontends a master entry names count: a removed frontend's
/// counters stay until its name is retired, and a Service made again under the same name in
/// the meantime must not start from them. Empty when the map is not pinned (an older
/// agent's datapath) or holds nothing (`--per-service-metrics=false`).
pub fn read_service_stats(dir: &Path) -> Result<Vec<ServiceCounts>> {
    use std::collections::{HashMap, HashSet};
    use svc_common::{svc_flags, ServiceKey, ServiceName, ServiceStats, ServiceValue};
    let name = map_names::SERVICE_STATS;
    let Ok(data) = MapData::from_pin(map_pin(dir, name)) else {
        return Ok(Vec::new());
    };
    let mut per_id: Vec<(u32, ServiceStats)> = Vec::new();
    sys::for_each_hash::<u32, ServiceStats>(data.fd().as_fd(), |id, v| per_id.push((*id, *v)))
        .map_err(|e| load_err(name, e))?;
    if per_id.is_empty() {
        return Ok(Vec::new());
    }
    let services = MapData::from_pin(map_pin(dir, map_names::SERVICES))
        .map_err(|e| load_err(map_names::SERVICES, e))?;
    let mut live = HashSet::new();
    sys::for_each_hash::<ServiceKey, ServiceValue>(services.fd().as_fd(), |_, v| {
        if v.flags & svc_flags::ADDR_MARKER == 0 {
            live.insert(v.id);
        }
    })
    .map_err(|e| load_err(map_names::SERVICES, e))?;
    let names = MapData::from_pin(map_pin(dir, map_names::NAMES))
        .map_err(|e| load_err(map_names::NAMES, e))?;
    let mut named: HashMap<u32, String> = HashMap::new();
    sys::for_each_hash::<u32, ServiceName>(names.fd().as_fd(), |id, n| {
        if live.contains(id) {
            named.insert(*id, crate::reconcile::decode_name(n));
        }
    })
    .map_err(|e| load_err(map_names::NAMES, e))?;
    drop(live);
    Ok(by_port(per_id, named))
}

/// The counts of `per_id` (by frontend id) by Service port, sorted by
/// (namespace, Service, port); ids without a name are left out.
fn by_port(
    per_id: Vec<(u32, svc_common::ServiceStats)>,
    mut named: std::collections::HashMap<u32, String>,
) -> Vec<ServiceCounts> {
    use std::collections::BTreeMap;
    // The frontends of one Service port (ClusterIPs, NodePort, external addresses) share its
    // name: their counts add up under it.
    let mut by_port: BTreeMap<String, [u64; svc_common::SERVICE_STAT_SLOTS]> = BTreeMap::new();
    for (id, sum) in per_id {
        let Some(full) = named.remove(&id) else {
            continue;
        };
        let counts = by_port.entry(full).or_default();
        for (t, c) in counts.iter_mut().zip(sum.counts) {
            *t = t.wrapping_add(c);
        }
    }
    // The names of frontends without counters go before the output is built.
    drop(named);
    let mut out: Vec<ServiceCounts> = (by_port.into_iter())
        .map(|(name, counts)| ServiceCounts { name, counts })
        .collect();
    out.sort_unstable_by(|a, b| a.parts().cmp(&b.parts()));
    // Two spellings of one port ("ns/web" and "ns/web:") would be two series of one label set.
    out.dedup_by(|later, kept| {
        let same = later.parts() == kept.parts();
        if same {
            for (t, c) in kept.counts.iter_mut().zip(later.counts) {
                *t = t.wrapping_add(c);
            }
        }
        same
    });
    out
}

#[cfg(test)]
mod service_name_tests {
    #[test]
    fn a_frontend_name_splits_into_namespace_service_and_port() {
        assert_eq!(super::split_name("demo/web:http"), ("demo", "web", "http"));
        assert_eq!(super::split_name("demo/web"), ("demo", "web", ""));
    }

    #[test]
    fn the_frontends_of_a_port_add_up_under_its_name_in_label_order() {
        use svc_common::ServiceStats;
        let stats = |n: u64| ServiceStats {
            counts: [n; svc_common::SERVICE_STAT_SLOTS],
        };
        let per_id = vec![
            (1, stats(1)),
            (2, stats(2)),
            (3, stats(4)),
            (4, stats(8)),
            (5, stats(16)),
        ];
        let named = [
            (1, "a/web:http"),
            (2, "a-b/web"),
            (3, "a/web:http"),
            (5, "a-b/web:"),
        ]
        .into_iter()
        .map(|(id, n)| (id, n.to_string()))
        .collect();
        let counts = super::by_port(per_id, named);
        let got: Vec<_> = counts
            .iter()
            .map(|s| {
                let (ns, svc, port) = s.parts();
                (ns, svc, port, s.counts[0])
            })
            .collect();
        // "a" before "a-b" (by namespace, not by the whole string); id 4 has no name.
        assert_eq!(got, vec![("a", "web", "http", 5), ("a-b", "web", "", 18)]);
    }
}
