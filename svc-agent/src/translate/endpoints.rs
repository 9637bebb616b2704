//! EndpointSlices reduced to what the datapath needs, and kube-proxy's choice of which
//! endpoints a Service port uses (pkg/proxy endpointslicecache.go and topology.go).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use tracing::debug;

use super::service::{is_foreign_slice, parse_ip, parse_protocol};
use super::{invalid, NodeContext, ObjectKey};
use crate::error::Error;
use crate::model::{Backend, Protocol};

/// Links a slice to its Service (same namespace).
const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

#[derive(Debug)]
pub(super) struct SliceInfo {
    pub key: ObjectKey,
    /// metadata.creationTimestamp: of two manifests defining one slice, the older serves.
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    /// The Service this slice belongs to, in `key.namespace`.
    pub service: String,
    pub family: Family,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<EndpointInfo>,
}

#[derive(Debug)]
pub(super) struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// 32 bytes (on 64-bit targets): a cache of a cluster's endpoints holds hundreds of thousands
/// (1,000,000 at 100,000 Services of 10), and the node and the hints behind one pointer are 8
/// bytes an endpoint less than a pointer each.
#[derive(Clone, Debug)]
pub(super) struct EndpointInfo {
    pub ip: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub place: Option<Arc<Place>>,
}

/// Where an endpoint is: its node, shared with every endpoint of that node without hints
/// (`node_named`), and its topology hints, which most endpoints have none of (one of its own
/// for an endpoint that has them).
#[derive(Debug, Default)]
pub(super) struct Place {
    pub node: Option<String>,
    pub hints: Option<Hints>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct Hints {
    pub zones: Vec<String>,
    pub nodes: Vec<String>,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(size_of::<EndpointInfo>() == 32);

impl EndpointInfo {
    fn hints(&self) -> Option<&Hints> {
        self.place.as_ref()?.hints.as_ref()
    }

    pub fn zone_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.zones)
    }

    pub fn node_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.nodes)
    }

    fn serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    /// Which copy of an endpoint listed twice (typically while it moves between slices) to
    /// keep: the higher one. Non-terminating first, as kube-proxy prefers; then the more
    /// usable; then the one on this node, as kube-proxy's dedup favours local copies.
    fn rank(&self, node: &NodeContext) -> (bool, bool, bool, bool) {
        (
            !self.terminating,
            self.ready,
            self.serving,
            self.is_local(node),
        )
    }

    /// The node it runs on (its `nodeName`).
    pub fn node(&self) -> Option<&str> {
        self.place.as_ref()?.node.as_deref()
    }

    pub fn is_local(&self, node: &NodeContext) -> bool {
        match (node.node_name(), self.node()) {
            (Some(here), Some(there)) => here == there,
            _ => false,
        }
    }
}

/// The node names endpoints carry, one copy each: a cluster has far fewer nodes than
/// endpoints, and a name of its own cost every endpoint a heap allocation (about 48 bytes for
/// a cloud's `ip-10-0-12-34.ec2.internal`, 46 MiB at 1,000,000 endpoints). Names no endpoint
/// holds any more are dropped once the set has doubled since it was last pruned.
struct NodeNames {
    names: BTreeSet<Named>,
    prune_above: usize,
}

static NODE_NAMES: Mutex<NodeNames> = Mutex::new(NodeNames {
    names: BTreeSet::new(),
    prune_above: 1024,
});

/// A place of `NodeNames` (a node, no hints), ordered by its node's name, so the set is
/// searched by `&str`.
struct Named(Arc<Place>);

impl Named {
    fn name(&self) -> &str {
        self.0.node.as_deref().unwrap_or_default()
    }
}

impl PartialEq for Named {
    fn eq(&self, other: &Named) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Named {}

impl PartialOrd for Named {
    fn partial_cmp(&self, other: &Named) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Named {
    fn cmp(&self, other: &Named) -> std::cmp::Ordering {
        self.name().cmp(other.name())
    }
}

impl std::borrow::Borrow<str> for Named {
    fn borrow(&self) -> &str {
        self.name()
    }
}

/// Node `name` without hints, shared with every other endpoint on that node.
fn node_named(name: &str) -> Arc<Place> {
    // A panic elsewhere while holding the lock leaves the set as consistent as ever.
    let mut nodes = NODE_NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(n) = nodes.names.get(name) {
        return n.0.clone();
    }
    let n = Arc::new(Place {
        node: Some(name.to_owned()),
        hints: None,
    });
    nodes.names.insert(Named(n.clone()));
    if nodes.names.len() > nodes.prune_above {
        nodes.names.retain(|n| Arc::strong_count(&n.0) > 1);
        nodes.prune_above = (2 * nodes.names.len()).max(1024);
    }
    n
}

/// Parses one slice. `None` when it is not ours (silently) or unusable (with errors pushed);
/// a usable slice may still have pushed errors for skipped ports or endpoints.
pub(super) fn parse(
    slice: &EndpointSlice,
    proxy_name: Option<&str>,
    errors: &mut Vec<Error>,
) -> Option<SliceInfo> {
    let meta = &slice.metadata;
    let key = ObjectKey::of(meta);
    if key.name().is_empty() {
        errors.push(invalid(
            &key.describe("EndpointSlice"),
            "metadata.name is required",
        ));
        return None;
    }
    if let Some(e) = super::check_key(
        &key,
        "EndpointSlice",
        crate::names::is_dns1123_subdomain,
        "a DNS-1123 subdomain (at most 253 characters: labels of a-z, 0-9 and '-' joined by \
         '.')",
    ) {
        errors.push(e);
        return None;
    }
    let object = key.describe("EndpointSlice");
    let service_label = meta.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME));
    if let Some(value) = service_label.filter(|v| !crate::names::is_label_value(v)) {
        errors.push(invalid(
            &object,
            format!(
                "label {LABEL_SERVICE_NAME} \"{}\" is not a label value (at most 63 of \
                 A-Z, a-z, 0-9, '-', '_' and '.', starting and ending with a letter or digit); \
                 EndpointSlice ignored",
                crate::names::escape(value)
            ),
        ));
        return None;
    }
    if let Some(message) = slice
        .ports
        .iter()
        .flatten()
        .find_map(|p| super::check_port_name(p.name.as_deref(), "EndpointSlice"))
    {
        errors.push(invalid(&object, message));
        return None;
    }
    if is_foreign_slice(meta.labels.as_ref(), proxy_name) {
        debug!(slice = %key, "skipped: headless, or labelled for another proxy");
        return None;
    }
    let family = match slice.address_type.as_str() {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        "FQDN" => {
            debug!(slice = %key, "skipped: FQDN slices cannot be proxied");
            return None;
        }
        other => {
            errors.push(invalid(
                &object,
                format!("unknown addressType {other:?}; slice ignored"),
            ));
            return None;
        }
    };
    // Slices without the label belong to no Service; kube-proxy ignores them too.
    let service = match service_label {
        Some(service) if !service.is_empty() => service.clone(),
        _ => {
            debug!(slice = %key, "skipped: no {LABEL_SERVICE_NAME} label");
            return None;
        }
    };
    let ports = parse_ports(slice, &object, errors);
    let endpoints = parse_endpoints(slice, family, &object, errors);
    Some(SliceInfo {
        key,
        created: meta.creation_timestamp.as_ref().map(|t| t.0),
        service,
        family,
        ports,
        endpoints,
    })
}

fn parse_ports(slice: &EndpointSlice, object: &str, errors: &mut Vec<Error>) -> Vec<SlicePort> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    // Sized to the slice's ports: a vector grown from empty holds room for four, and the
    // cache keeps one per slice (9 MiB more at 100,000 slices of one port).
    let mut out: Vec<SlicePort> = Vec::with_capacity(ports.len());
    for port in ports {
        let name = port.name.clone().unwrap_or_default();
        let protocol = match parse_protocol(port.protocol.as_deref()) {
            Ok(protocol) => protocol,
            // No Service port can match it: the Service side already reported SCTP.
            Err(_) if port.protocol.as_deref() == Some("SCTP") => continue,
            Err(message) => {
                errors.push(invalid(
                    object,
                    format!("port {name:?}: {message}; skipped"),
                ));
                continue;
            }
        };
        let Some(number) = port.port else {
            continue;
        };
        let number = match u16::try_from(number) {
            Ok(n) if n != 0 => n,
            _ => {
                errors.push(invalid(
                    object,
                    format!("port {name:?} {number}/{protocol}: port must be 1-65535; skipped"),
                ));
                continue;
            }
        };
        if out.iter().any(|p| p.name == name && p.protocol == protocol) {
            errors.push(invalid(
                object,
                format!("port {name:?} {number}/{protocol}: duplicate port name; skipped"),
            ));
            continue;
        }
        out.push(SlicePort {
            name,
            protocol,
            port: number,
        });
    }
    out
}

fn parse_endpoints(
    slice: &EndpointSlice,
    family: Family,
    object: &str,
    errors: &mut Vec<Error>,
) -> Vec<EndpointInfo> {
    let mut out = Vec::with_capacity(slice.endpoints.len());
    for endpoint in &slice.endpoints {
        // The API defines all addresses of an endpoint as fungible; kube-proxy uses the first.
        let Some(text) = endpoint.addresses.first() else {
            errors.push(invalid(object, "endpoint with no addresses; skipped"));
            continue;
        };
        let Some(ip) = parse_ip(text) else {
            errors.push(invalid(
                object,
                format!("endpoint {text:?} is not an IP address; skipped"),
            ));
            continue;
        };
        if Family::of(ip) != family {
            errors.push(invalid(
                object,
                format!(
                    "endpoint {text:?} does not match addressType {}; skipped",
                    slice.address_type
                ),
            ));
            continue;
        }
        if !is_usable_endpoint_ip(ip) {
            errors.push(invalid(
                object,
                format!(
                    "endpoint {text:?} is an unspecified, loopback, link-local or multicast \
                     address; skipped"
                ),
            ));
            continue;
        }
        let conditions = endpoint.conditions.as_ref();
        let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
        let node = (endpoint.node_name.as_deref()).filter(|n| !n.is_empty());
        let hints = (endpoint.hints.as_ref())
            .map(|h| Hints {
                zones: h
                    .for_zones
                    .iter()
                    .flatten()
                    .map(|z| z.name.clone())
                    .collect(),
                nodes: h
                    .for_nodes
                    .iter()
                    .flatten()
                    .map(|n| n.name.clone())
                    .collect(),
            })
            .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty());
        let place = match (node, hints) {
            (node, Some(hints)) => Some(Arc::new(Place {
                node: node.map(str::to_owned),
                hints: Some(hints),
            })),
            (Some(node), None) => Some(node_named(node)),
            (None, None) => None,
        };
        out.push(EndpointInfo {
            ip,
            ready,
            // Unset is serving, as the API defines it and kube-proxy reads it, not "as ready":
            // a terminating endpoint then still drains traffic when nothing is ready.
            serving: conditions.and_then(|c| c.serving).unwrap_or(true),
            terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
            place,
        });
    }
    out
}

/// The API server refuses these as endpoint addresses (ValidateEndpointIP); a manifest can
/// still contain them, and sending Service traffic there would misdirect it on every node.
fn is_usable_endpoint_ip(ip: IpAddr) -> bool {
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    !(ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || link_local)
}

/// The endpoints of one Service port for one address family, merged across slices (which
/// must be in name order, for a stable choice between equal duplicates).
pub(super) fn merge<'a>(
    slices: &[&'a SliceInfo],
    family: Family,
    port_name: &str,
    protocol: Protocol,
    node: &NodeContext,
) -> BTreeMap<SocketAddr, &'a EndpointInfo> {
    let mut merged: BTreeMap<SocketAddr, &EndpointInfo> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.family == family) {
        let Some(port) = slice
            .ports
            .iter()
            .find(|p| p.name == port_name && p.protocol == protocol)
        else {
            continue;
        };
        for endpoint in &slice.endpoints {
            let addr = SocketAddr::new(endpoint.ip, port.port);
            merged
                .entry(addr)
                .and_modify(|kept| {
                    if endpoint.rank(node) > kept.rank(node) {
                        *kept = endpoint;
                    }
                })
                .or_insert(endpoint);
        }
    }
    merged
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology {
    /// No usable hints: every endpoint is a candidate.
    Any,
    SameNode,
    SameZone,
}

/// kube-proxy's topologyModeFromHints: hints are honoured only when every ready endpoint
/// carries them and at least one names this node (or zone), so a half-rolled-out hinting
/// controller can never blackhole traffic. Node hints win over zone hints.
fn topology(endpoints: &[&EndpointInfo], node: &NodeContext) -> Topology {
    let ready: Vec<&&EndpointInfo> = endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return Topology::Any;
    }
    if let Some(here) = node.node_name() {
        if ready.iter().all(|e| !e.node_hints().is_empty())
            && ready
                .iter()
                .any(|e| e.node_hints().iter().any(|n| n == here))
        {
            return Topology::SameNode;
        }
    }
    if let Some(zone) = node.zone() {
        if ready.iter().all(|e| !e.zone_hints().is_empty())
            && ready
                .iter()
                .any(|e| e.zone_hints().iter().any(|z| z == zone))
        {
            return Topology::SameZone;
        }
    }
    Topology::Any
}

fn fits_topology(endpoint: &EndpointInfo, topology: Topology, node: &NodeContext) -> bool {
    match topology {
        Topology::Any => true,
        Topology::SameNode => node
            .node_name()
            .is_some_and(|here| endpoint.node_hints().iter().any(|n| n == here)),
        Topology::SameZone => node
            .zone()
            .is_some_and(|zone| endpoint.zone_hints().iter().any(|z| z == zone)),
    }
}

/// kube-proxy's CategorizeEndpoints (pkg/proxy/topology.go): with `local`, its
/// localEndpoints (this node's ready endpoints, else this node's serving-terminating ones);
/// without, its clusterEndpoints (ready endpoints fitting the topology hints, else every
/// serving-terminating one, so connections drain instead of failing during a rollout).
/// Sorted by address; each backend says whether it runs on this node.
pub(super) fn select(
    merged: &BTreeMap<SocketAddr, &EndpointInfo>,
    local: bool,
    node: &NodeContext,
) -> Vec<Backend> {
    let candidates: Vec<(SocketAddr, &EndpointInfo)> = if local {
        merged
            .iter()
            .filter(|(_, e)| e.is_local(node))
            .map(|(a, e)| (*a, *e))
            .collect()
    } else {
        merged.iter().map(|(a, e)| (*a, *e)).collect()
    };
    // Topology only applies to Cluster policy; Local is already as close as it gets.
    let topology = if local {
        Topology::Any
    } else {
        let endpoints: Vec<&EndpointInfo> = candidates.iter().map(|(_, e)| *e).collect();
        topology(&endpoints, node)
    };
    let backend = |(a, e): &(SocketAddr, &EndpointInfo)| Backend::new(*a, e.is_local(node));
    let ready: Vec<Backend> = candidates
        .iter()
        .filter(|(_, e)| e.ready && fits_topology(e, topology, node))
        .map(backend)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    candidates
        .iter()
        .filter(|(_, e)| e.serving_terminating())
        .map(backend)
        .collect()
}

/// Why `select` keeps or leaves out each endpoint of `merged`, in its order: (used, reason).
/// The same rules as `select`, said in words for `explain`.
pub(super) fn judge(
    merged: &BTreeMap<SocketAddr, &EndpointInfo>,
    local: bool,
    node: &NodeContext,
) -> Vec<(SocketAddr, bool, String)> {
    let candidates: Vec<&EndpointInfo> = merged
        .values()
        .filter(|e| !local || e.is_local(node))
        .copied()
        .collect();
    let topology = if local {
        Topology::Any
    } else {
        topology(&candidates, node)
    };
    let any_ready = candidates
        .iter()
        .any(|e| e.ready && fits_topology(e, topology, node));
    merged
        .iter()
        .map(|(a, e)| {
            let (used, why) = if local && !e.is_local(node) {
                let there = e.node().unwrap_or("no node named");
                (
                    false,
                    format!("on another node ({there}) under a Local traffic policy"),
                )
            } else if e.ready && fits_topology(e, topology, node) {
                let how = match topology {
                    Topology::Any => "ready".to_string(),
                    Topology::SameNode => "ready, hinted for this node".to_string(),
                    Topology::SameZone => "ready, hinted for this zone".to_string(),
                };
                (true, how)
            } else if e.ready {
                let hinted = match topology {
                    Topology::SameNode => format!("other nodes {:?}", e.node_hints()),
                    _ => format!("other zones {:?}", e.zone_hints()),
                };
                (
                    false,
                    format!("ready, but its topology hints are for {hinted}"),
                )
            } else if e.serving_terminating() && !any_ready {
                (
                    true,
                    "serving and terminating: no endpoint is ready, so it takes the traffic"
                        .to_string(),
                )
            } else if e.serving_terminating() {
                (
                    false,
                    "serving and terminating: used only while no endpoint is ready".to_string(),
                )
            } else if e.terminating {
                (false, "terminating and not serving".to_string())
            } else {
                (false, "not ready".to_string())
            };
            (*a, used, why)
        })
        .collect()
}

/// The addresses of the endpoints that serve, sorted: kube-proxy's `IsServing()` endpoints,
/// those whose UDP flows CleanStaleEntries keeps, whatever traffic policy, topology and
/// terminating state say. A ready endpoint counts too: the API makes ready imply serving, a
/// manifest need not, and an endpoint the datapath may choose is never stale. A v4-mapped
/// address is the IPv4 address it is, as the datapath reports its flows' backends.
pub(super) fn serving(merged: &BTreeMap<SocketAddr, &EndpointInfo>) -> Arc<Vec<SocketAddr>> {
    let mut serving: Vec<SocketAddr> = merged
        .iter()
        .filter(|(_, e)| e.serving || e.ready)
        .map(|(a, _)| SocketAddr::new(a.ip().to_canonical(), a.port()))
        .collect();
    serving.sort();
    Arc::new(serving)
}

/// kube-proxy's LocalReadyEndpoints (pkg/proxy/endpointschangetracker.go), what its health
/// check node port reports: the distinct addresses of this node's ready endpoints among the
/// slices of one family (terminating ones do not count, so a node draining its last pod
/// fails the check).
pub(super) fn local_ready_ips(slices: &[&SliceInfo], family: Family, node: &NodeContext) -> u32 {
    let mut ips: Vec<IpAddr> = slices
        .iter()
        .filter(|s| s.family == family && !s.ports.is_empty())
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.ready && e.is_local(node))
        .map(|e| e.ip)
        .collect();
    ips.sort_unstable();
    ips.dedup();
    ips.len() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort};

    fn on(ip: &str, node: &str) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            node_name: Some(node.into()),
            ..Default::default()
        }
    }

    /// Every endpoint of a node shares one copy of its name, also across slices; names no
    /// endpoint holds go once the set has doubled, and a held one stays the same copy.
    #[test]
    fn endpoints_of_one_node_share_its_name() {
        let node = "ip-10-9-8-7.names.test";
        let slice = |name: &str, ips: [&str; 2]| EndpointSlice {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                namespace: Some("ns".into()),
                name: Some(name.into()),
                labels: Some([(LABEL_SERVICE_NAME.to_string(), "web".to_string())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: ips.iter().map(|ip| on(ip, node)).collect(),
            ports: Some(vec![EndpointPort {
                port: Some(8080),
                ..Default::default()
            }]),
        };
        let mut errors = Vec::new();
        let a = parse(&slice("web-a", ["10.1.0.1", "10.1.0.2"]), None, &mut errors).unwrap();
        let b = parse(&slice("web-b", ["10.1.0.3", "10.1.0.4"]), None, &mut errors).unwrap();
        assert!(errors.is_empty(), "{errors:?}");
        let names: Vec<&Arc<Place>> = (a.endpoints.iter().chain(&b.endpoints))
            .map(|e| e.place.as_ref().expect("a node"))
            .collect();
        assert_eq!(names.len(), 4);
        assert!(names.iter().all(|n| Arc::ptr_eq(n, names[0])), "{names:?}");
        assert_eq!(names[0].node.as_deref(), Some(node));

        for i in 0..3_000 {
            let _ = node_named(&format!("ip-10-0-{i}.gone.test"));
        }
        let held = NODE_NAMES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .names
            .len();
        assert!(held < 3_000, "{held} names kept");
        assert!(Arc::ptr_eq(&node_named(node), names[0]));
    }
}
