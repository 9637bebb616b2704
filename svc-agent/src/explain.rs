//! `svc-agent explain`: what the datapath does with one destination, read from the pinned
//! maps alone, following the kernel's own resolution order (svc-ebpf/src/lb.rs `resolve`,
//! the socket hooks' and the external ingress's `Via`).
//!
//! The decision is made over a `View` (the frontends, ClusterIP markers and node addresses
//! as the maps hold them) and a `Live` source of the entries the datapath itself writes
//! (affinity, conntrack), so it can be checked without maps.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use serde::Serialize;
use svc_common::{
    ct_dir, ct_flags, node_addr_flags, svc_flags, AffinityKey, AffinityValue, CtKey, CtValue,
    DatapathConfig, MAGLEV_BLOCK, MAGLEV_PAGE,
};

use crate::error::Result;
use crate::model::{Cidr, Frontend, Kind, Protocol, Scope};
use crate::reconcile::{addr16, ip_from16, Programmed, DEFAULT_GRACE};
use crate::store::BpfStore;

/// Where the traffic starts, which picks the datapath path that decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum From {
    /// A pod's socket: connect()/sendmsg() hooks.
    Pod,
    /// A socket of the node's own network namespace: the socket hooks, where loopback
    /// addresses may answer NodePorts.
    Node,
    /// A packet from outside on an external device: the external ingress.
    Outside,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn protocol(self) -> Protocol {
        match self {
            Proto::Tcp => Protocol::Tcp,
            Proto::Udp => Protocol::Udp,
        }
    }
}

/// `--src`: an address, or an address and port (`1.2.3.4:5678`, `[::1]:5678`).
pub fn parse_src(s: &str) -> std::result::Result<(IpAddr, Option<u16>), String> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok((sa.ip(), Some(sa.port())));
    }
    s.parse::<IpAddr>()
        .map(|ip| (ip, None))
        .map_err(|_| format!("{s:?} is neither an address nor address:port"))
}

#[derive(Clone, Copy, Debug)]
pub struct Query {
    pub dst: SocketAddr,
    pub src: Option<(IpAddr, Option<u16>)>,
    pub proto: Proto,
    pub from: From,
}

/// One frontend as its master entry and slots hold it.
#[derive(Clone, Debug, Default)]
pub struct ViewFrontend {
    pub name: String,
    pub id: u32,
    pub rev: u16,
    /// Slots the master entry names (`ServiceValue::count`).
    pub count: u16,
    pub flags: u16,
    pub affinity_timeout_s: u32,
    pub affinity_id: u32,
    /// Backend id of each slot of the current generation, in slot order.
    pub slots: Vec<u32>,
    /// Backends with a membership entry (AFFINITY_MATCH): a remembered choice is honoured
    /// only for those.
    pub members: Vec<u32>,
    pub ranges: Vec<Cidr>,
    /// The generation's Maglev table as its index entry names it: (first entry, entries,
    /// seed).
    pub maglev: Option<(u32, u32, u64)>,
}

/// The maps the agent writes, as read.
#[derive(Clone, Debug, Default)]
pub struct View {
    pub frontends: BTreeMap<Frontend, ViewFrontend>,
    /// ClusterIPs whose undefined ports are refused.
    pub markers: BTreeSet<IpAddr>,
    /// SVC_NODE_ADDRS flags by address.
    pub node_addrs: BTreeMap<IpAddr, u32>,
    /// Backends by id: address and whether local (`backend_flags::LOCAL`).
    pub backends: HashMap<u32, (SocketAddr, bool)>,
    pub config: DatapathConfig,
}

impl View {
    pub fn from_programmed(p: &Programmed) -> View {
        View {
            frontends: p
                .frontends
                .iter()
                .map(|(fe, f)| {
                    (
                        *fe,
                        ViewFrontend {
                            name: f.name.clone(),
                            id: f.id,
                            rev: f.rev,
                            count: f.count,
                            // As the master entry holds them: the mirror keeps the
                            // Maglev flag as the table's presence.
                            flags: f.flags
                                | if f.maglev.is_some() {
                                    svc_flags::MAGLEV
                                } else {
                                    0
                                },
                            affinity_timeout_s: f.affinity_timeout_s,
                            affinity_id: f.affinity_id,
                            slots: f.backends.clone(),
                            members: f.matches.clone(),
                            ranges: f.ranges.to_vec(),
                            maglev: f.maglev.map(|t| (t.start * MAGLEV_BLOCK, t.size, t.seed)),
                        },
                    )
                })
                .collect(),
            markers: p.markers.clone(),
            node_addrs: p
                .node_addrs
                .iter()
                .map(|(a, v)| (ip_from16(*a), v.flags))
                .collect(),
            backends: p
                .backends
                .iter()
                .map(|(id, k)| (id, (k.socket_addr(), k.local)))
                .collect(),
            config: p.config.unwrap_or_default(),
        }
    }
}

/// The entries the datapath writes itself, looked up one key at a time.
pub trait Live {
    /// The datapath clock now (CLOCK_MONOTONIC_COARSE).
    fn now_ns(&self) -> u64;
    fn affinity(&self, key: &AffinityKey) -> Option<AffinityValue>;
    /// The flow's entry and the table that holds it.
    fn ct(&self, key: &CtKey) -> Option<(&'static str, CtValue)>;
    /// Entry `pos` of `SVC_MAGLEV` (counted in entries, as `MaglevIndex::offset`).
    fn maglev_entry(&self, pos: u32) -> Option<u16>;
    /// The index entry of generation `rev` of frontend `id` as the kernel reads it: (first
    /// entry, entries, seed). Read whole: an entry the agent would not adopt (a torn state)
    /// is still the one the kernel follows.
    fn maglev_index(&self, id: u32, rev: u16) -> Option<(u32, u32, u64)>;
}

#[derive(Debug, Serialize)]
pub struct Explanation {
    /// "pinned maps", or "pinned maps and the Kubernetes API" with the agent's intent.
    pub read_from: &'static str,
    pub destination: SocketAddr,
    pub source: Option<String>,
    pub protocol: Proto,
    pub from: From,
    /// SVC_NODE_ADDRS flags of the destination, when it is there.
    pub node_address: Option<NodeAddress>,
    /// How the frontend was found: "own address", "nodeport" (the node address's NodePort
    /// wildcard), "clusterip without this port", "none".
    pub matched: &'static str,
    pub frontend: Option<Explained>,
    /// "admitted", "not admitted", "unknown (no --src)"; absent when the frontend has no
    /// source ranges or the path does not check them.
    pub source_range: Option<&'static str>,
    pub affinity: Option<ExplainedAffinity>,
    pub conntrack: Option<ExplainedCt>,
    /// "backend", "tracked flow", "refused", "dropped", "passed".
    pub verdict: &'static str,
    pub reason: String,
    /// The backends the verdict may reach: one (affinity, tracked flow) or the slots.
    pub backends: Vec<SocketAddr>,
    /// What the agent intends for the frontend, from the Kubernetes API (`--kubeconfig`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intent: Option<crate::translate::Intent>,
    /// Where the kernel's maps and the intent differ.
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
    /// The frontend keys the destination may be, the one found first.
    #[serde(skip)]
    pub keys: Vec<Frontend>,
}

#[derive(Debug, Serialize)]
pub struct NodeAddress {
    pub nodeport: bool,
    pub localhost_nodeport: bool,
    pub external: bool,
    pub of_node: bool,
}

#[derive(Debug, Serialize)]
pub struct Explained {
    pub frontend: String,
    pub kind: Kind,
    pub scope: Scope,
    pub service: Option<String>,
    pub id: u32,
    pub generation: u16,
    pub internal_traffic_local: bool,
    pub external_traffic_local: bool,
    pub affinity_timeout_s: Option<u32>,
    pub source_ranges: Option<Vec<String>>,
    pub slots: Vec<ExplainedBackend>,
    /// Slots the master entry names that the maps do not hold (an update in flight).
    pub missing_slots: u16,
}

#[derive(Debug, Serialize)]
pub struct ExplainedBackend {
    pub address: SocketAddr,
    pub local: bool,
}

#[derive(Debug, Serialize)]
pub struct ExplainedAffinity {
    pub backend: Option<SocketAddr>,
    pub idle_s: u64,
    pub fresh: bool,
    pub member: bool,
    /// Whether the next connection takes it.
    pub used: bool,
}

#[derive(Debug, Serialize)]
pub struct ExplainedCt {
    pub table: &'static str,
    /// Where the flow's packets go (the FORWARD entry's translated destination).
    pub backend: SocketAddr,
    pub frontend_id: u32,
    pub idle_s: u64,
    pub expired: bool,
    pub flags: Vec<&'static str>,
}

fn ct_flag_names(f: u16) -> Vec<&'static str> {
    [
        (ct_flags::SNAT, "snat"),
        (ct_flags::SEEN_REPLY, "seen_reply"),
        (ct_flags::UNASSURED, "unassured"),
        (ct_flags::POD, "pod"),
    ]
    .into_iter()
    .filter(|(b, _)| f & b != 0)
    .map(|(_, n)| n)
    .collect()
}

/// lb.rs `lookup`: the frontend of `fe`, else (cluster scope only) the ClusterIP marker
/// that refuses its undefined port.
enum Lookup {
    Found(Frontend),
    NoPort,
    NotService,
}

fn lookup(view: &View, fe: Frontend) -> Lookup {
    if view.frontends.contains_key(&fe) {
        return Lookup::Found(fe);
    }
    if fe.scope == Scope::Cluster && view.markers.contains(&fe.ip) {
        return Lookup::NoPort;
    }
    Lookup::NotService
}

fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    }
}

/// The whole decision, as the datapath path `q.from` makes it.
pub fn explain(view: &View, live: &impl Live, q: &Query) -> Explanation {
    let protocol = q.proto.protocol();
    let dst_ip = q.dst.ip();
    let node = view.node_addrs.get(&dst_ip).copied();
    let mut notes = vec![
        "read from the pinned maps: the agent's intent, EndpointSlices and per-endpoint \
         reasons are not shown"
            .to_string(),
    ];
    let mut e = Explanation {
        read_from: "pinned maps",
        destination: q.dst,
        source: q.src.map(|(ip, port)| match port {
            Some(p) => SocketAddr::new(ip, p).to_string(),
            None => ip.to_string(),
        }),
        protocol: q.proto,
        from: q.from,
        node_address: node.map(|f| NodeAddress {
            nodeport: f & node_addr_flags::NODEPORT != 0,
            localhost_nodeport: f & node_addr_flags::LOCALHOST != 0,
            external: f & node_addr_flags::EXTERNAL != 0,
            of_node: f & node_addr_flags::OF_NODE != 0,
        }),
        matched: "none",
        frontend: None,
        source_range: None,
        affinity: None,
        conntrack: None,
        verdict: "passed",
        reason: String::new(),
        backends: Vec::new(),
        intent: None,
        warnings: Vec::new(),
        notes: Vec::new(),
        keys: Vec::new(),
    };

    // A tracked flow (the packet datapath's) goes on to its backend before any lookup.
    if let Some((src, Some(sport))) = q.src {
        let key = CtKey {
            saddr: addr16(src),
            daddr: addr16(dst_ip),
            sport_be: sport.to_be(),
            dport_be: q.dst.port().to_be(),
            proto: protocol.ipproto(),
            dir: ct_dir::FORWARD,
            _pad0: [0; 2],
        };
        if let Some((table, v)) = live.ct(&key) {
            let idle_ns = live.now_ns().saturating_sub(v.last_seen_ns);
            let timeout = svc_common::ct_timeout::seconds(&view.config, key.proto, v.flags) as u64;
            e.conntrack = Some(ExplainedCt {
                table,
                backend: SocketAddr::new(ip_from16(v.nat_addr), u16::from_be(v.nat_port_be)),
                frontend_id: v.id,
                idle_s: idle_ns / 1_000_000_000,
                expired: idle_ns > timeout * 1_000_000_000,
                flags: ct_flag_names(v.flags),
            });
        }
    }
    if q.from != From::Outside {
        notes.push(
            "a socket's connection is translated at connect() and keeps no conntrack entry; \
             its sessionAffinity client is its network namespace, which --src cannot name"
                .to_string(),
        );
    }

    // lb.rs `resolve` under the caller's `Via`.
    let (scope, own_key, node_flags) = match q.from {
        From::Pod | From::Node => {
            let mut f = node.unwrap_or(0);
            let loopback = matches!(dst_ip, IpAddr::V4(v4) if v4.is_loopback());
            let localhost =
                f & node_addr_flags::LOCALHOST != 0 || (f == 0 && view.config.localhost_net != 0);
            if q.from == From::Node && loopback && localhost {
                f |= node_addr_flags::NODEPORT;
            }
            (Scope::Cluster, true, f)
        }
        From::Outside => {
            let f = node.unwrap_or(0);
            (Scope::External, f & node_addr_flags::EXTERNAL != 0, f)
        }
    };
    let own = Frontend {
        ip: dst_ip,
        port: q.dst.port(),
        protocol,
        scope,
    };
    e.keys = vec![
        own,
        Frontend {
            ip: unspecified(dst_ip),
            ..own
        },
    ];
    let mut found = Lookup::NotService;
    if own_key {
        found = lookup(view, own);
        if !matches!(found, Lookup::NotService) {
            e.matched = "own address";
        }
    }
    if matches!(found, Lookup::NotService) && node_flags & node_addr_flags::NODEPORT != 0 {
        found = lookup(
            view,
            Frontend {
                ip: unspecified(dst_ip),
                ..own
            },
        );
        e.matched = "nodeport";
    }
    let fe = match found {
        Lookup::NotService => {
            e.matched = "none";
            e.verdict = "passed";
            e.reason = match q.from {
                From::Outside => "not a Service address for packets from outside: \
                                  passed untouched"
                    .into(),
                _ => "not a Service address: passed untouched".into(),
            };
            e.notes = notes;
            return e;
        }
        Lookup::NoPort => {
            e.matched = "clusterip without this port";
            e.verdict = "refused";
            e.reason = format!(
                "{dst_ip} is a ClusterIP that defines no {protocol} port {}: refused",
                q.dst.port()
            );
            e.notes = notes;
            return e;
        }
        Lookup::Found(fe) => fe,
    };
    e.keys.retain(|k| *k != fe);
    e.keys.insert(0, fe);
    let f = &view.frontends[&fe];
    let slots: Vec<ExplainedBackend> = f
        .slots
        .iter()
        .filter_map(|id| view.backends.get(id))
        .map(|(a, local)| ExplainedBackend {
            address: *a,
            local: *local,
        })
        .collect();
    e.backends = slots.iter().map(|b| b.address).collect();
    e.backends.sort();
    e.backends.dedup();
    let affinity_on = f.flags & svc_flags::AFFINITY != 0;
    e.frontend = Some(Explained {
        frontend: fe.to_string(),
        kind: Kind::from_flags(f.flags),
        scope: fe.scope,
        service: Some(f.name.clone()).filter(|n| !n.is_empty()),
        id: f.id,
        generation: f.rev,
        internal_traffic_local: f.flags & svc_flags::INTERNAL_LOCAL != 0,
        external_traffic_local: f.flags & svc_flags::EXTERNAL_LOCAL != 0,
        affinity_timeout_s: affinity_on.then_some(f.affinity_timeout_s),
        source_ranges: (f.flags & svc_flags::SOURCE_RANGES != 0)
            .then(|| f.ranges.iter().map(ToString::to_string).collect()),
        missing_slots: f.count.saturating_sub(slots.len() as u16),
        slots,
    });
    let ext_local = f.flags & svc_flags::EXTERNAL_LOCAL != 0;

    if let Some(ct) = e.conntrack.as_ref().filter(|c| !c.expired) {
        if q.from == From::Outside {
            e.verdict = "tracked flow";
            e.reason = format!(
                "a live conntrack entry ({}) carries this flow to {}",
                ct.table, ct.backend
            );
            e.backends = vec![ct.backend];
            e.notes = notes;
            return e;
        }
    }

    if scope == Scope::External && f.flags & svc_flags::SOURCE_RANGES != 0 {
        match q.src {
            None => {
                e.source_range = Some("unknown (no --src)");
                notes.push(
                    "loadBalancerSourceRanges apply: clients outside them are dropped".to_string(),
                );
            }
            Some((src, _)) => {
                if f.ranges.iter().any(|c| c.contains(src)) {
                    e.source_range = Some("admitted");
                } else {
                    e.source_range = Some("not admitted");
                    e.verdict = "dropped";
                    e.reason = format!(
                        "{src} is outside the frontend's loadBalancerSourceRanges: dropped"
                    );
                    e.backends.clear();
                    e.notes = notes;
                    return e;
                }
            }
        }
    }

    if f.count == 0 {
        e.backends.clear();
        if scope == Scope::External && ext_local {
            e.verdict = "dropped";
            e.reason = "externalTrafficPolicy Local and no backend on this node: dropped".into();
        } else {
            e.verdict = "refused";
            e.reason = "the Service has no endpoints: refused".into();
        }
        e.notes = notes;
        return e;
    }

    if affinity_on {
        if let (From::Outside, Some((src, _))) = (q.from, q.src) {
            let key = AffinityKey {
                client: addr16(src),
                affinity_id: f.affinity_id,
                kind: svc_common::AFFINITY_CLIENT_IP,
                _pad0: [0; 3],
            };
            if let Some(v) = live.affinity(&key) {
                let idle_ns = live.now_ns().saturating_sub(v.last_used_ns);
                let fresh = idle_ns <= f.affinity_timeout_s as u64 * 1_000_000_000;
                let member = f.members.contains(&v.backend);
                let backend = view.backends.get(&v.backend).map(|(a, _)| *a);
                let used = fresh && member && backend.is_some();
                e.affinity = Some(ExplainedAffinity {
                    backend,
                    idle_s: idle_ns / 1_000_000_000,
                    fresh,
                    member,
                    used,
                });
                if let (true, Some(b)) = (used, backend) {
                    e.verdict = "backend";
                    e.reason = format!("sessionAffinity: {src} keeps {b}");
                    e.backends = vec![b];
                    e.notes = notes;
                    return e;
                }
            }
        }
    }
    e.verdict = "backend";
    e.reason = format!(
        "one of {} slot(s) of generation {}, at random",
        f.count, f.rev
    );
    if f.flags & svc_flags::MAGLEV != 0 && scope == Scope::External {
        e.reason = format!(
            "one of {} slot(s) of generation {}, by the flow's Maglev hash",
            f.count, f.rev
        );
        maglev_choice(&mut e, &mut notes, view, live, q, f);
    }
    e.notes = notes;
    e
}

/// lb.rs `maglev_entry` and `pick_slot` for the one flow `q` names: the backend a new flow
/// of that 5-tuple gets from the frontend's table, which every node with the same seed and
/// backends gives it too.
fn maglev_choice(
    e: &mut Explanation,
    notes: &mut Vec<String>,
    view: &View,
    live: &impl Live,
    q: &Query,
    f: &ViewFrontend,
) {
    let Some((src, Some(sport))) = q.src else {
        notes.push(
            "--src ADDR:PORT names the one backend the Maglev table gives that flow".to_string(),
        );
        return;
    };
    let random = "so the kernel chooses at random (counted maglev_missing)";
    let index = live.maglev_index(f.id, f.rev).or(f.maglev);
    let Some((offset, size, seed)) = index.filter(|t| t.1 != 0) else {
        e.warnings.push(format!(
            "the frontend is marked for Maglev but generation {} has no table index entry, {random}",
            f.rev
        ));
        return;
    };
    let h = svc_common::maglev_flow_hash(
        &addr16(src),
        &addr16(q.dst.ip()),
        sport.to_be(),
        q.dst.port().to_be(),
        q.proto.protocol().ipproto(),
        seed,
    ) % size;
    let Some(entry) = live.maglev_entry(offset.wrapping_add(h)) else {
        e.warnings.push(format!(
            "entry {} of the Maglev tables (the table's {h}) is not there, {random}",
            offset.wrapping_add(h)
        ));
        return;
    };
    let slot = entry as usize % f.count as usize;
    match f.slots.get(slot).and_then(|id| view.backends.get(id)) {
        Some((b, _)) => {
            e.reason = format!(
                "slot {} of {} of generation {}: entry {h} of its {size}-entry Maglev table \
                 for this flow's hash",
                slot + 1,
                f.count,
                f.rev
            );
            e.backends = vec![*b];
        }
        None => e.warnings.push(format!(
            "the Maglev table gives slot {} of generation {}, which the maps do not hold (an \
             update in flight): the kernel would retry or refuse",
            slot + 1,
            f.rev
        )),
    }
}

/// The pinned maps as a `Live`: the affinity map and both conntrack tables.
pub struct PinnedLive {
    affinity: HashMap<AffinityKey, AffinityValue>,
    maglev: Option<crate::store::MaglevPages>,
    maglev_index: Option<BpfHashMap<MapData, svc_common::SlotKey, svc_common::MaglevIndex>>,
    ct: Vec<(&'static str, BpfHashMap<MapData, CtKey, CtValue>)>,
    now_ns: u64,
}

fn reopen(m: &MapData) -> Option<MapData> {
    use std::os::fd::AsFd as _;
    let fd = m.fd().as_fd().try_clone_to_owned().ok()?;
    MapData::from_fd(fd).ok()
}

impl PinnedLive {
    fn open(store: &BpfStore) -> PinnedLive {
        let affinity = store
            .affinity
            .iter()
            .filter_map(|r| r.ok())
            .collect::<HashMap<_, _>>();
        let mut ct = Vec::new();
        if let Some(m) = store.ct.as_ref().and_then(reopen) {
            if let Ok(h) = BpfHashMap::try_from(Map::HashMap(m)) {
                ct.push((svc_common::map_names::CT, h));
            }
        }
        if let Some(m) = store.ct_new.as_ref().and_then(reopen) {
            if let Ok(h) = BpfHashMap::try_from(Map::LruHashMap(m)) {
                ct.push((svc_common::map_names::CT_NEW, h));
            }
        }
        let maglev = store
            .maglev
            .as_ref()
            .and_then(|h| reopen(aya::maps::IterableMap::map(h)))
            .and_then(|m| BpfHashMap::try_from(Map::HashMap(m)).ok());
        let maglev_index = store
            .maglev_index
            .as_ref()
            .and_then(|h| reopen(aya::maps::IterableMap::map(h)))
            .and_then(|m| BpfHashMap::try_from(Map::HashMap(m)).ok());
        PinnedLive {
            affinity,
            maglev,
            maglev_index,
            ct,
            now_ns: crate::sys::coarse_now_ns(),
        }
    }
}

impl Live for PinnedLive {
    fn now_ns(&self) -> u64 {
        self.now_ns
    }

    fn affinity(&self, key: &AffinityKey) -> Option<AffinityValue> {
        self.affinity.get(key).copied()
    }

    fn ct(&self, key: &CtKey) -> Option<(&'static str, CtValue)> {
        self.ct
            .iter()
            .find_map(|(name, m)| m.get(key, 0).ok().map(|v| (*name, v)))
    }

    fn maglev_entry(&self, pos: u32) -> Option<u16> {
        let block = pos / MAGLEV_BLOCK;
        let page = self.maglev.as_ref()?.get(&(block / MAGLEV_PAGE), 0).ok()?;
        let block = page.blocks.get((block % MAGLEV_PAGE) as usize)?;
        block.entries.get((pos % MAGLEV_BLOCK) as usize).copied()
    }

    fn maglev_index(&self, id: u32, rev: u16) -> Option<(u32, u32, u64)> {
        let key = svc_common::SlotKey { id, rev, slot: 0 };
        let i = self.maglev_index.as_ref()?.get(&key, 0).ok()?;
        Some((
            i.offset,
            i.size,
            u64::from(i.seed[0]) | u64::from(i.seed[1]) << 32,
        ))
    }
}

/// `explain` over the pinned maps of `store`.
pub fn read(store: &BpfStore, q: &Query) -> Result<Explanation> {
    let p = Programmed::adopt(store, store.capacity, DEFAULT_GRACE)?;
    let view = View::from_programmed(&p);
    Ok(explain(&view, &PinnedLive::open(store), q))
}

/// The agent's intent for the destination (from `intent_of`, which tries each key the
/// destination may be) beside what the kernel holds: the first key with an intent is used,
/// and every difference between its backends and the kernel's slots is a warning.
pub fn add_intent(
    e: &mut Explanation,
    intent_of: impl Fn(&Frontend) -> Option<crate::translate::Intent>,
) {
    e.read_from = "pinned maps and the Kubernetes API";
    e.notes
        .retain(|n| !n.starts_with("read from the pinned maps"));
    let intent = e.keys.iter().find_map(&intent_of);
    let kernel: BTreeSet<SocketAddr> = e.backends.iter().copied().collect();
    match (&intent, &e.frontend) {
        (None, None) => {}
        (None, Some(f)) => e.warnings.push(format!(
            "the kernel serves {} but no Service of the API does now (a change not \
             programmed yet, or pins of another source)",
            f.frontend
        )),
        (Some(i), None) => e.warnings.push(format!(
            "Service {} has this frontend in the API, but the kernel has none for it",
            i.service
        )),
        (Some(i), Some(_)) => {
            let intended: BTreeSet<SocketAddr> = i.backends.iter().copied().collect();
            for b in intended.difference(&kernel) {
                e.warnings
                    .push(format!("{b} is intended but not in the kernel's slots"));
            }
            for b in kernel.difference(&intended) {
                e.warnings
                    .push(format!("{b} is in the kernel's slots but not intended"));
            }
        }
    }
    e.intent = intent;
}

pub fn render_text(e: &Explanation) -> String {
    let esc = |s: &str| crate::names::escape(s).into_owned();
    let mut out = String::new();
    let from = match e.from {
        From::Pod => "a pod",
        From::Node => "the node",
        From::Outside => "outside",
    };
    let _ = writeln!(
        out,
        "{} {} from {from}{}",
        e.destination,
        match e.protocol {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        },
        e.source
            .as_ref()
            .map(|s| format!(" (source {s})"))
            .unwrap_or_default()
    );
    if let Some(n) = &e.node_address {
        let mut what = Vec::new();
        if n.of_node {
            what.push("the node's");
        }
        if n.nodeport {
            what.push("answers NodePorts");
        }
        if n.localhost_nodeport {
            what.push("answers NodePorts for the node's sockets");
        }
        if n.external {
            what.push("has external frontends");
        }
        let _ = writeln!(out, "Node address:  {}", what.join(", "));
    }
    if let Some(f) = &e.frontend {
        let _ = writeln!(
            out,
            "Frontend:      {} ({}, {}, found by {})",
            f.frontend, f.kind, f.id, e.matched
        );
        let _ = writeln!(
            out,
            "Service:       {}",
            esc(f.service.as_deref().unwrap_or("-"))
        );
        let mut policy = Vec::new();
        if f.internal_traffic_local {
            policy.push("internalTrafficPolicy: Local".to_string());
        }
        if f.external_traffic_local {
            policy.push("externalTrafficPolicy: Local".to_string());
        }
        if let Some(t) = f.affinity_timeout_s {
            policy.push(format!("sessionAffinity: ClientIP {t}s"));
        }
        if let Some(r) = &f.source_ranges {
            policy.push(format!("sourceRanges: {}", r.join(", ")));
        }
        if !policy.is_empty() {
            let _ = writeln!(out, "Policy:        {}", policy.join("; "));
        }
        let slots: Vec<String> = f
            .slots
            .iter()
            .map(|b| match b.local {
                true => format!("{} (local)", b.address),
                false => b.address.to_string(),
            })
            .collect();
        let _ = writeln!(
            out,
            "Slots (gen {}): {}{}",
            f.generation,
            if slots.is_empty() {
                "none".to_string()
            } else {
                slots.join(", ")
            },
            if f.missing_slots > 0 {
                format!(" ({} missing: an update in flight)", f.missing_slots)
            } else {
                String::new()
            }
        );
    }
    if let Some(r) = e.source_range {
        let _ = writeln!(out, "Source range:  {r}");
    }
    if let Some(a) = &e.affinity {
        let _ = writeln!(
            out,
            "Affinity:      {} idle {}s{}{}",
            a.backend
                .map(|b| b.to_string())
                .unwrap_or_else(|| "(backend gone)".into()),
            a.idle_s,
            if a.fresh { "" } else { ", expired" },
            if a.member {
                ""
            } else {
                ", no longer a backend"
            }
        );
    }
    if let Some(c) = &e.conntrack {
        let _ = writeln!(
            out,
            "Conntrack:     {} -> {} (frontend {}, idle {}s{}{})",
            c.table,
            c.backend,
            c.frontend_id,
            c.idle_s,
            if c.expired { ", expired" } else { "" },
            if c.flags.is_empty() {
                String::new()
            } else {
                format!(", {}", c.flags.join(" "))
            }
        );
    }
    let _ = writeln!(out, "Verdict:       {}: {}", e.verdict, e.reason);
    if let Some(i) = &e.intent {
        let port = if i.port_name.is_empty() {
            String::new()
        } else {
            format!(" port {}", esc(&i.port_name))
        };
        let _ = writeln!(out, "Intent:        Service {}{port}", esc(&i.service));
        let _ = writeln!(
            out,
            "Slices:        {}",
            if i.slices.is_empty() {
                "none".to_string()
            } else {
                i.slices
                    .iter()
                    .map(|s| match &s.resource_version {
                        Some(rv) => format!("{} (resourceVersion {rv})", esc(&s.name)),
                        None => esc(&s.name),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        for v in &i.endpoints {
            let _ = writeln!(
                out,
                "  {} {}: {}{}",
                if v.used { "used    " } else { "left out" },
                v.address,
                v.reason,
                v.slice
                    .as_ref()
                    .map(|s| format!(" (slice {})", esc(s)))
                    .unwrap_or_default()
            );
        }
    }
    for w in &e.warnings {
        let _ = writeln!(out, "Warning:       {w}");
    }
    for n in &e.notes {
        let _ = writeln!(out, "Note:          {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    /// What the datapath holds for a test: at most one affinity entry, and a Maglev array
    /// whose every entry is `table`'s value but at the positions it lists.
    #[derive(Default)]
    struct Fake {
        affinity: Option<(AffinityKey, AffinityValue)>,
        table: Option<(u16, Vec<u32>)>,
    }
    const NO_LIVE: Fake = Fake {
        affinity: None,
        table: None,
    };
    impl Live for Fake {
        fn now_ns(&self) -> u64 {
            100_000_000_000
        }
        fn affinity(&self, k: &AffinityKey) -> Option<AffinityValue> {
            self.affinity.filter(|(key, _)| key == k).map(|(_, v)| v)
        }
        fn ct(&self, _: &CtKey) -> Option<(&'static str, CtValue)> {
            None
        }
        fn maglev_entry(&self, pos: u32) -> Option<u16> {
            let (entry, holes) = self.table.as_ref()?;
            (!holes.contains(&pos)).then_some(*entry)
        }
        fn maglev_index(&self, _: u32, _: u16) -> Option<(u32, u32, u64)> {
            None
        }
    }
    fn table(entry: u16, holes: Vec<u32>) -> Fake {
        Fake {
            table: Some((entry, holes)),
            ..Fake::default()
        }
    }

    #[test]
    fn maglev_names_the_one_backend_of_a_flow() {
        let mut v = view();
        let lb = fe("203.0.113.8", 80, Scope::External);
        v.node_addrs
            .insert(ip("203.0.113.8"), node_addr_flags::EXTERNAL);
        v.frontends.insert(
            lb,
            ViewFrontend {
                name: "default/mg:http".into(),
                id: 6,
                rev: 2,
                count: 2,
                flags: svc_flags::LOAD_BALANCER | svc_flags::MAGLEV,
                slots: vec![1, 2],
                maglev: Some((64, 13, 7)),
                ..Default::default()
            },
        );
        let query = |src| q("203.0.113.8:80", src, From::Outside);
        // Entry 3: slot 2 (3 % 2 + 1), backend 2, whatever the flow's hash.
        let e = explain(&v, &table(3, vec![]), &query(Some("198.51.100.4:40000")));
        assert_eq!(e.verdict, "backend");
        assert_eq!(e.backends, vec!["10.1.0.2:8080".parse().unwrap()]);
        assert!(
            e.reason.starts_with("slot 2 of 2 of generation 2"),
            "{}",
            e.reason
        );
        let e = explain(&v, &table(4, vec![]), &query(Some("198.51.100.4:40000")));
        assert_eq!(e.backends, vec!["10.1.0.1:8080".parse().unwrap()]);
        // Without a source port: both slots, and how to ask for the one.
        let e = explain(&v, &table(3, vec![]), &query(Some("198.51.100.4")));
        assert_eq!(e.backends.len(), 2);
        assert!(
            e.notes.iter().any(|n| n.contains("--src ADDR:PORT")),
            "{:?}",
            e.notes
        );
        // The flow's entry missing: the kernel's random choice, said as a warning.
        let h = svc_common::maglev_flow_hash(
            &addr16(ip("198.51.100.4")),
            &addr16(ip("203.0.113.8")),
            40000u16.to_be(),
            80u16.to_be(),
            Protocol::Tcp.ipproto(),
            7,
        ) % 13;
        let e = explain(
            &v,
            &table(3, vec![64 + h]),
            &query(Some("198.51.100.4:40000")),
        );
        assert_eq!(e.backends.len(), 2);
        assert!(
            e.warnings.iter().any(|w| w.contains("at random")),
            "{:?}",
            e.warnings
        );
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn fe(addr: &str, port: u16, scope: Scope) -> Frontend {
        Frontend {
            ip: ip(addr),
            port,
            protocol: Protocol::Tcp,
            scope,
        }
    }

    fn view() -> View {
        let mut v = View::default();
        v.backends
            .insert(1, ("10.1.0.1:8080".parse().unwrap(), true));
        v.backends
            .insert(2, ("10.1.0.2:8080".parse().unwrap(), false));
        v.frontends.insert(
            fe("10.96.0.10", 80, Scope::Cluster),
            ViewFrontend {
                name: "default/web:http".into(),
                id: 1,
                rev: 3,
                count: 2,
                slots: vec![1, 2],
                ..Default::default()
            },
        );
        v.frontends.insert(
            fe("10.96.0.11", 80, Scope::Cluster),
            ViewFrontend {
                name: "default/empty:http".into(),
                id: 2,
                ..Default::default()
            },
        );
        v.markers.insert(ip("10.96.0.10"));
        v.markers.insert(ip("10.96.0.11"));
        v.node_addrs.insert(
            ip("192.168.1.5"),
            node_addr_flags::NODEPORT | node_addr_flags::SNAT,
        );
        v.node_addrs
            .insert(ip("203.0.113.7"), node_addr_flags::EXTERNAL);
        v.frontends.insert(
            fe("0.0.0.0", 30080, Scope::External),
            ViewFrontend {
                name: "default/web:http".into(),
                id: 3,
                count: 0,
                flags: svc_flags::NODEPORT | svc_flags::EXTERNAL_LOCAL,
                ..Default::default()
            },
        );
        v.frontends.insert(
            fe("0.0.0.0", 30080, Scope::Cluster),
            ViewFrontend {
                name: "default/web:http".into(),
                id: 4,
                count: 2,
                flags: svc_flags::NODEPORT,
                slots: vec![1, 2],
                ..Default::default()
            },
        );
        v.frontends.insert(
            fe("203.0.113.7", 443, Scope::External),
            ViewFrontend {
                name: "default/lb:https".into(),
                id: 5,
                count: 1,
                flags: svc_flags::LOAD_BALANCER | svc_flags::SOURCE_RANGES | svc_flags::AFFINITY,
                affinity_timeout_s: 60,
                affinity_id: 9,
                slots: vec![2],
                members: vec![2],
                ranges: vec![Cidr {
                    addr: ip("198.51.100.0"),
                    prefix: 24,
                }],
                ..Default::default()
            },
        );
        v
    }

    fn q(dst: &str, src: Option<&str>, from: From) -> Query {
        Query {
            dst: dst.parse().unwrap(),
            src: src.map(|s| parse_src(s).unwrap()),
            proto: Proto::Tcp,
            from,
        }
    }

    #[test]
    fn cluster_ip_port_has_its_service_and_backends() {
        let e = explain(&view(), &NO_LIVE, &q("10.96.0.10:80", None, From::Pod));
        assert_eq!(e.verdict, "backend");
        let f = e.frontend.unwrap();
        assert_eq!(f.service.as_deref(), Some("default/web:http"));
        assert_eq!(
            e.backends,
            vec![
                "10.1.0.1:8080".parse::<SocketAddr>().unwrap(),
                "10.1.0.2:8080".parse().unwrap()
            ]
        );
    }

    #[test]
    fn text_names_the_service_the_slots_the_verdict_and_the_source() {
        let e = explain(&view(), &NO_LIVE, &q("10.96.0.10:80", None, From::Pod));
        let t = render_text(&e);
        for want in [
            "Service:       default/web:http",
            "Slots (gen 3): 10.1.0.1:8080 (local), 10.1.0.2:8080",
            "Verdict:       backend: one of 2 slot(s)",
            "read from the pinned maps",
        ] {
            assert!(t.contains(want), "{want:?} not in:\n{t}");
        }
    }

    #[test]
    fn undefined_port_of_a_cluster_ip_is_refused() {
        let e = explain(&view(), &NO_LIVE, &q("10.96.0.10:81", None, From::Pod));
        assert_eq!(e.verdict, "refused");
        assert_eq!(e.matched, "clusterip without this port");
        assert!(e.frontend.is_none());
    }

    #[test]
    fn service_without_endpoints_is_refused() {
        let e = explain(&view(), &NO_LIVE, &q("10.96.0.11:80", None, From::Pod));
        assert_eq!(e.verdict, "refused");
        assert!(e.reason.contains("no endpoints"), "{}", e.reason);
        assert!(e.backends.is_empty());
    }

    #[test]
    fn unknown_address_passes() {
        let e = explain(&view(), &NO_LIVE, &q("10.200.0.1:80", None, From::Pod));
        assert_eq!(e.verdict, "passed");
        // A ClusterIP is no frontend for packets from outside.
        let e = explain(&view(), &NO_LIVE, &q("10.96.0.10:80", None, From::Outside));
        assert_eq!(e.verdict, "passed");
    }

    #[test]
    fn nodeport_resolves_per_path() {
        // From a pod: the cluster-scope NodePort, with backends.
        let e = explain(&view(), &NO_LIVE, &q("192.168.1.5:30080", None, From::Pod));
        assert_eq!(e.matched, "nodeport");
        assert_eq!(e.verdict, "backend");
        assert_eq!(e.frontend.as_ref().unwrap().id, 4);
        // From outside: the external one, Local with no backend here: dropped, not refused.
        let e = explain(
            &view(),
            &NO_LIVE,
            &q("192.168.1.5:30080", Some("198.51.100.9"), From::Outside),
        );
        assert_eq!(e.frontend.as_ref().unwrap().id, 3);
        assert_eq!(e.verdict, "dropped");
        // Not a node address: no NodePort.
        let e = explain(
            &view(),
            &NO_LIVE,
            &q("192.168.1.6:30080", None, From::Outside),
        );
        assert_eq!(e.verdict, "passed");
    }

    #[test]
    fn localhost_nodeport_only_for_the_node() {
        let mut v = view();
        v.node_addrs
            .insert(ip("127.0.0.1"), node_addr_flags::LOCALHOST);
        let e = explain(&v, &NO_LIVE, &q("127.0.0.1:30080", None, From::Node));
        assert_eq!(e.verdict, "backend");
        let e = explain(&v, &NO_LIVE, &q("127.0.0.1:30080", None, From::Pod));
        assert_eq!(e.verdict, "passed");
    }

    #[test]
    fn source_ranges_drop_outsiders() {
        let e = explain(
            &view(),
            &NO_LIVE,
            &q("203.0.113.7:443", Some("192.0.2.1"), From::Outside),
        );
        assert_eq!(e.verdict, "dropped");
        assert_eq!(e.source_range, Some("not admitted"));
        let e = explain(
            &view(),
            &NO_LIVE,
            &q("203.0.113.7:443", Some("198.51.100.9"), From::Outside),
        );
        assert_eq!(e.verdict, "backend");
        assert_eq!(e.source_range, Some("admitted"));
        let e = explain(
            &view(),
            &NO_LIVE,
            &q("203.0.113.7:443", None, From::Outside),
        );
        assert_eq!(e.source_range, Some("unknown (no --src)"));
    }

    #[test]
    fn fresh_affinity_of_a_member_is_used_and_a_stale_one_is_not() {
        let key = AffinityKey {
            client: addr16(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 9))),
            affinity_id: 9,
            kind: svc_common::AFFINITY_CLIENT_IP,
            _pad0: [0; 3],
        };
        let fresh = Fake {
            affinity: Some((
                key,
                AffinityValue {
                    last_used_ns: 90_000_000_000,
                    backend: 2,
                    _pad0: 0,
                },
            )),
            ..Fake::default()
        };
        let query = q("203.0.113.7:443", Some("198.51.100.9"), From::Outside);
        let e = explain(&view(), &fresh, &query);
        assert!(e.affinity.as_ref().unwrap().used);
        assert!(e.reason.contains("sessionAffinity"), "{}", e.reason);
        let stale = Fake {
            affinity: Some((
                key,
                AffinityValue {
                    last_used_ns: 1_000_000_000,
                    backend: 2,
                    _pad0: 0,
                },
            )),
            ..Fake::default()
        };
        let e = explain(&view(), &stale, &query);
        let a = e.affinity.as_ref().unwrap();
        assert!(!a.fresh && !a.used);
        assert!(e.reason.contains("slot"), "{}", e.reason);
    }
}
