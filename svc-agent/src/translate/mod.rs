//! kube-proxy's rules: Services and EndpointSlices to the desired state.
//!
//! Pure and deterministic: the same objects, in any order, give the same state and the same
//! errors. Anything wrong with an object costs that object (or just the offending port or
//! endpoint) and is reported; it never costs other Services.

mod endpoints;
mod service;

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use k8s_openapi::Metadata;
use tracing::{debug, instrument};

use crate::error::Error;
use crate::model::{
    Backend, Cidr, DesiredFrontend, DesiredState, Frontend, HealthCheck, Kind, NoLocalEndpoints,
    Protocol, Scope, Served,
};

use endpoints::{Family, SliceInfo};
use service::{ServiceInfo, ServicePortInfo};

const DEFAULT_NAMESPACE: &str = "default";

/// Facts about the node the agent runs on, for the node-dependent parts of kube-proxy's rules
/// (traffic policies, topology hints, which endpoints are local, source ranges).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub node_name: Option<String>,
    /// The node's topology.kubernetes.io/zone label.
    pub zone: Option<String>,
    /// This proxy's `--service-proxy-name`: objects labelled
    /// service.kubernetes.io/service-proxy-name with exactly this name are ours; None: only
    /// unlabelled objects are (kube-proxy's default).
    pub service_proxy_name: Option<String>,
    /// The node's primary address per family (kube-proxy's node IPs: the Node's first
    /// InternalIP of each family, or with manifests the chosen devices' first addresses).
    /// A loadBalancerSourceRanges entry that contains one admits the LoadBalancer IPs
    /// themselves as clients, as kube-proxy does.
    pub node_ips: Vec<std::net::IpAddr>,
}

impl NodeContext {
    /// An empty name is as good as none: it must never match an endpoint without one.
    fn node_name(&self) -> Option<&str> {
        self.node_name.as_deref().filter(|n| !n.is_empty())
    }

    fn zone(&self) -> Option<&str> {
        self.zone.as_deref().filter(|z| !z.is_empty())
    }

    fn service_proxy_name(&self) -> Option<&str> {
        self.service_proxy_name.as_deref()
    }

    fn node_ip(&self, family: Family) -> Option<std::net::IpAddr> {
        self.node_ips
            .iter()
            .copied()
            .find(|ip| Family::of(*ip) == family)
    }
}

/// The desired state, and what was wrong with the input.
#[derive(Debug, Default)]
pub struct Translated {
    pub state: DesiredState,
    pub errors: Vec<Error>,
}

/// namespace/name of an object, in one allocation: a cache of 100,000 objects holds one per
/// object.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ObjectKey {
    /// "namespace/name"; namespaces hold no '/'.
    full: Box<str>,
    /// Where the '/' is.
    slash: u32,
}

impl ObjectKey {
    fn new(namespace: &str, name: &str) -> ObjectKey {
        ObjectKey {
            full: format!("{namespace}/{name}").into_boxed_str(),
            slash: namespace.len() as u32,
        }
    }

    fn of(meta: &ObjectMeta) -> ObjectKey {
        let namespace = meta
            .namespace
            .as_deref()
            .filter(|ns| !ns.is_empty())
            .unwrap_or(DEFAULT_NAMESPACE);
        ObjectKey::new(namespace, meta.name.as_deref().unwrap_or_default())
    }

    fn namespace(&self) -> &str {
        &self.full[..self.slash as usize]
    }

    fn name(&self) -> &str {
        &self.full[self.slash as usize + 1..]
    }

    /// "Service ns/name": how errors name objects.
    fn describe(&self, kind: &str) -> String {
        format!("{kind} {self}")
    }
}

impl Ord for ObjectKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.namespace(), self.name()).cmp(&(other.namespace(), other.name()))
    }
}

impl PartialOrd for ObjectKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.name().is_empty() {
            write!(f, "{}/(unnamed)", self.namespace())
        } else {
            f.write_str(&self.full)
        }
    }
}

/// The objects sorted by namespace/name, without repeated definitions (the first one in
/// input order is kept; a manifest directory can easily define an object twice).
fn in_name_order<'a, T>(objects: &'a [T], kind: &str, errors: &mut Vec<Error>) -> Vec<&'a T>
where
    T: Metadata<Ty = ObjectMeta>,
{
    let mut keyed: Vec<(ObjectKey, &T)> = objects
        .iter()
        .map(|o| (ObjectKey::of(o.metadata()), o))
        .collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    keyed.dedup_by(|later, first| {
        // Nameless objects are not duplicates of each other; parsing reports each.
        let duplicate = later.0 == first.0 && !later.0.name().is_empty();
        if duplicate {
            errors.push(invalid(
                &later.0.describe(kind),
                "defined more than once; later definition ignored",
            ));
        }
        duplicate
    });
    keyed.into_iter().map(|(_, o)| o).collect()
}

/// The API server's rules for a Service's or an EndpointSlice's namespace and name: an object
/// that breaks them never reaches kube-proxy, and a manifest's must not reach the maps, `svc-agent
/// list` or the logs either (a name with a newline would forge a log line). The error names
/// the object escaped.
fn check_key(key: &ObjectKey, kind: &str, name_ok: fn(&str) -> bool, rule: &str) -> Option<Error> {
    let object = || format!("{kind} {}", crate::names::escape(&key.to_string()));
    if !crate::names::is_dns1123_label(key.namespace()) {
        return Some(invalid(
            &object(),
            format!(
                "metadata.namespace is not a DNS-1123 label ({DNS_LABEL_RULE}); {kind} ignored"
            ),
        ));
    }
    if !name_ok(key.name()) {
        return Some(invalid(
            &object(),
            format!("metadata.name is not {rule}; {kind} ignored"),
        ));
    }
    None
}

/// What a DNS-1123 label is, for error messages.
const DNS_LABEL_RULE: &str =
    "at most 63 of a-z, 0-9 and '-', starting and ending with a letter or digit";

/// A port name the API server would refuse (DNS-1123 label), or None.
fn check_port_name(name: Option<&str>, kind: &str) -> Option<String> {
    let name = name.filter(|n| !n.is_empty())?;
    (!crate::names::is_dns1123_label(name)).then(|| {
        format!(
            "port \"{}\": name is not a DNS-1123 label ({DNS_LABEL_RULE}); {kind} ignored",
            crate::names::escape(name)
        )
    })
}

fn invalid(object: &str, message: impl Into<String>) -> Error {
    Error::Invalid {
        object: object.to_string(),
        message: message.into(),
    }
}

/// A Service reduced to what kube-proxy's rules read: what a long-lived cache keeps instead of
/// the API object, which is many times larger.
pub struct ParsedService(ServiceInfo);

/// An EndpointSlice reduced to what kube-proxy's rules read.
#[derive(Debug)]
pub struct ParsedSlice(SliceInfo);

/// "namespace/name" of a parsed object, and its creationTimestamp.
pub trait Keyed {
    fn namespace(&self) -> &str;
    fn name(&self) -> &str;
    fn created(&self) -> Option<k8s_openapi::jiff::Timestamp>;
}

impl Keyed for ParsedService {
    fn namespace(&self) -> &str {
        self.0.key.namespace()
    }
    fn name(&self) -> &str {
        self.0.key.name()
    }
    fn created(&self) -> Option<k8s_openapi::jiff::Timestamp> {
        self.0.created
    }
}

impl Keyed for ParsedSlice {
    fn namespace(&self) -> &str {
        self.0.key.namespace()
    }
    fn name(&self) -> &str {
        self.0.key.name()
    }
    fn created(&self) -> Option<k8s_openapi::jiff::Timestamp> {
        self.0.created
    }
}

impl ParsedService {
    /// The frontends this Service claims, before conflicts with other Services are resolved.
    pub fn frontends(&self) -> impl Iterator<Item = Frontend> + '_ {
        claims(&self.0).into_iter().map(|c| c.frontend)
    }

    /// The Service's healthCheckNodePort, if kube-proxy would serve one (0: none).
    pub fn health_check_node_port(&self) -> u16 {
        self.0.health_check_node_port
    }
}

/// One frontend a Service claims: what it is, and for which clusterIP (family) and port.
struct Claim {
    frontend: Frontend,
    kind: Kind,
    cluster_ip: usize,
    port: usize,
}

/// Every frontend of a Service, in a stable order: per clusterIP (one per family) and port,
/// the ClusterIP, then the NodePort, the ExternalIPs and the LoadBalancer IPs of that family,
/// each at external scope and as the node-local view (cluster scope). kube-proxy's per-family
/// proxiers serve a family only where the Service has a clusterIP of it.
fn claims(svc: &ServiceInfo) -> Vec<Claim> {
    let mut out = Vec::with_capacity(svc.cluster_ips.len() * svc.ports.len());
    for (ci, &cip) in svc.cluster_ips.iter().enumerate() {
        let family = Family::of(cip);
        for (pi, port) in svc.ports.iter().enumerate() {
            let mut push = |frontend: Frontend, kind: Kind| {
                out.push(Claim {
                    frontend,
                    kind,
                    cluster_ip: ci,
                    port: pi,
                })
            };
            push(
                Frontend::cluster(cip, port.port, port.protocol),
                Kind::ClusterIP,
            );
            let both = [Scope::External, Scope::Cluster];
            if port.node_port != 0 {
                for scope in both {
                    push(
                        Frontend::node_port(cip, port.node_port, port.protocol, scope),
                        Kind::NodePort,
                    );
                }
            }
            let Some(ext) = svc.external.as_deref() else {
                continue;
            };
            let of_family = |ips: &[std::net::IpAddr]| -> Vec<std::net::IpAddr> {
                ips.iter()
                    .copied()
                    .filter(|ip| Family::of(*ip) == family)
                    .collect()
            };
            for (ips, kind) in [
                (of_family(&ext.external_ips), Kind::ExternalIP),
                (of_family(&ext.lb_ips), Kind::LoadBalancer),
            ] {
                for ip in ips {
                    for scope in both {
                        push(
                            Frontend {
                                ip,
                                port: port.port,
                                protocol: port.protocol,
                                scope,
                            },
                            kind,
                        );
                    }
                }
            }
        }
    }
    // An address listed twice (an ExternalIP that is also a LoadBalancer IP) is one frontend:
    // the first claim keeps it.
    let mut seen = std::collections::HashSet::with_capacity(out.len());
    out.retain(|c| seen.insert(c.frontend));
    out
}

/// The loadBalancerSourceRanges a LoadBalancer frontend of `family` enforces (kube-proxy's
/// serviceport.go and nftables proxier): the ranges of that family; none when one of them is
/// 0.0.0.0/0 (or ::/0) or the family has none; plus the Service's LoadBalancer IPs of the
/// family when a range contains the node's own address, since a node reaching its own
/// LoadBalancer IP may loop back with that IP as source. Given ranges of which none was valid
/// restrict to nothing (the errors say why) rather than open the Service to everyone.
fn source_ranges(svc: &ServiceInfo, family: Family, node: &NodeContext) -> Option<Box<[Cidr]>> {
    let ext = svc.external.as_deref()?;
    if !ext.source_ranges_given {
        return None;
    }
    if ext.source_ranges.is_empty() {
        return Some(Box::new([]));
    }
    let ranges: Vec<Cidr> = ext
        .source_ranges
        .iter()
        .copied()
        .filter(|c| Family::of(c.addr) == family)
        .collect();
    if ranges.is_empty() || ranges.iter().any(Cidr::is_zero) {
        return None;
    }
    let allow_node = node
        .node_ip(family)
        .is_some_and(|ip| ranges.iter().any(|c| c.contains(ip)));
    let mut out = ranges;
    if allow_node {
        for ip in ext.lb_ips.iter().filter(|ip| Family::of(**ip) == family) {
            let host = Cidr::host(*ip);
            if !out.contains(&host) {
                out.push(host);
            }
        }
    }
    out.sort();
    Some(out.into_boxed_slice())
}

/// `None` when the Service is not ours to proxy or too broken to use (with `errors` saying
/// why); a usable one may still have reported errors for some of its ports.
pub fn parse_service(
    service: &Service,
    node: &NodeContext,
    errors: &mut Vec<Error>,
) -> Option<ParsedService> {
    service::parse(service, node.service_proxy_name(), errors).map(ParsedService)
}

/// As `parse_service`, for an EndpointSlice.
pub fn parse_slice(
    slice: &EndpointSlice,
    node: &NodeContext,
    errors: &mut Vec<Error>,
) -> Option<ParsedSlice> {
    endpoints::parse(slice, node.service_proxy_name(), errors).map(ParsedSlice)
}

/// Who serves each frontend now, so that a conflict leaves it with its current holder.
pub trait Holders {
    /// "namespace/name" of the Service programmed for `fe`, if any.
    fn holder(&self, fe: &Frontend) -> Option<&str>;
}

/// No frontend is served yet.
pub struct NoHolders;

impl Holders for NoHolders {
    fn holder(&self, _: &Frontend) -> Option<&str> {
        None
    }
}

/// The previous desired state: who was to serve each frontend.
impl Holders for DesiredState {
    fn holder(&self, fe: &Frontend) -> Option<&str> {
        self.frontends.get(fe).map(|d| d.owner())
    }
}

impl Holders for Served {
    fn holder(&self, fe: &Frontend) -> Option<&str> {
        self.owner(fe)
    }
}

/// Which of the Services claiming one frontend serves it, the way the API server would have
/// it: the one that holds it now (`holder`), else the oldest (one without a creation time
/// counts as newest), else the first by namespace and name. `claimants`: each Service's
/// "namespace/name" and creation time. The one rule for a full translation and for a
/// frontend its holder gives up (`Desired::replace`).
pub fn rightful<'a>(
    claimants: impl IntoIterator<Item = (&'a str, Option<Timestamp>)>,
    holder: Option<&str>,
) -> Option<usize> {
    let claimants: Vec<(&str, Option<Timestamp>)> = claimants.into_iter().collect();
    if let Some(i) = holder.and_then(|h| claimants.iter().position(|(o, _)| *o == h)) {
        return Some(i);
    }
    (0..claimants.len()).min_by_key(|&i| {
        let (owner, created) = claimants[i];
        let name = owner.split_once('/').unwrap_or((owner, ""));
        (created.is_none(), created, name)
    })
}

/// Every object parsed, in name order. Parsing everything up front reports each problem
/// once, however many ports see it.
fn parse_all(
    services: &[Service],
    slices: &[EndpointSlice],
    node: &NodeContext,
    errors: &mut Vec<Error>,
) -> (Vec<ParsedService>, Vec<ParsedSlice>) {
    let parsed_services = in_name_order(services, "Service", errors)
        .into_iter()
        .filter_map(|s| parse_service(s, node, errors))
        .collect();
    let parsed_slices = in_name_order(slices, "EndpointSlice", errors)
        .into_iter()
        .filter_map(|s| parse_slice(s, node, errors))
        .collect();
    (parsed_services, parsed_slices)
}

/// Turns Services and their EndpointSlices into the frontends this node should serve,
/// following kube-proxy's semantics for ClusterIP traffic.
pub fn translate(services: &[Service], slices: &[EndpointSlice], node: &NodeContext) -> Translated {
    translate_with(services, slices, node, &NoHolders)
}

/// As `translate`, resolving frontend conflicts in favour of `holders`.
#[instrument(skip_all, fields(services = services.len(), slices = slices.len(), node = ?node.node_name))]
pub fn translate_with(
    services: &[Service],
    slices: &[EndpointSlice],
    node: &NodeContext,
    holders: &dyn Holders,
) -> Translated {
    let mut errors = Vec::new();
    let (parsed_services, parsed_slices) = parse_all(services, slices, node, &mut errors);
    let mut translated = assemble_with(&parsed_services, &parsed_slices, node, holders);
    errors.append(&mut translated.errors);
    translated.errors = errors;
    translated
}

/// The frontends of parsed Services, from their parsed slices (slices of other Services are
/// ignored). Node-dependent rules are applied here, so a change of the node's zone needs no
/// parsing again.
pub fn assemble<'a>(
    services: impl IntoIterator<Item = &'a ParsedService>,
    slices: impl IntoIterator<Item = &'a ParsedSlice>,
    node: &NodeContext,
) -> Translated {
    assemble_with(services, slices, node, &NoHolders)
}

/// As `assemble`, resolving frontend conflicts the way the API server would have: the Service
/// that holds the frontend now keeps it, else the older Service, else the first by name.
pub fn assemble_with<'a>(
    services: impl IntoIterator<Item = &'a ParsedService>,
    slices: impl IntoIterator<Item = &'a ParsedSlice>,
    node: &NodeContext,
    holders: &dyn Holders,
) -> Translated {
    let mut errors = Vec::new();
    // Each Service's slices are a run of one vector sorted by (namespace, Service, name),
    // found by binary search: a map of a vector per Service took about 10 MB at 100,000
    // Services, at the moment the assembly holds the most. Name order makes the result
    // independent of input order: errors come out in a stable order, and slices of one
    // Service are merged in name order.
    let mut slices: Vec<&SliceInfo> = slices.into_iter().map(|s| &s.0).collect();
    fn service_of(s: &SliceInfo) -> (&str, &str) {
        (s.key.namespace(), s.service.as_str())
    }
    slices.sort_by(|a, b| (service_of(a), &a.key).cmp(&(service_of(b), &b.key)));
    let slices_of = |svc: &ServiceInfo| {
        let want = (svc.key.namespace(), svc.key.name());
        let from = slices.partition_point(|s| service_of(s) < want);
        let to = from + slices[from..].partition_point(|s| service_of(s) == want);
        &slices[from..to]
    };
    let mut services: Vec<&ServiceInfo> = services.into_iter().map(|s| &s.0).collect();
    services.sort_by(|a, b| a.key.cmp(&b.key));

    // Who gets each frontend claimed by more than one Service. Claims are collected for
    // conflicts only: at 100,000 Services a list per frontend would cost megabytes.
    let mut claimed: BTreeMap<Frontend, Vec<&ServiceInfo>> = BTreeMap::new();
    {
        let mut first: std::collections::HashMap<Frontend, &ServiceInfo> =
            std::collections::HashMap::with_capacity(services.len());
        for svc in &services {
            for claim in claims(svc) {
                match first.entry(claim.frontend) {
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(svc);
                    }
                    std::collections::hash_map::Entry::Occupied(e) => {
                        claimed
                            .entry(claim.frontend)
                            .or_insert_with(|| vec![*e.get()])
                            .push(svc);
                    }
                }
            }
        }
    }
    let mut winners: BTreeMap<Frontend, &ObjectKey> = BTreeMap::new();
    for (fe, claimants) in &claimed {
        let owners: Vec<String> = claimants.iter().map(|s| s.key.to_string()).collect();
        let ranked = owners
            .iter()
            .zip(claimants)
            .map(|(o, s)| (o.as_str(), s.created));
        let winner = rightful(ranked, holders.holder(fe)).expect("two claimants");
        winners.insert(*fe, &claimants[winner].key);
    }

    let mut state = DesiredState::default();
    // Gathered, then made a tree in one go (packed: a tree filled in Service order leaves
    // its nodes partly empty, 14.8 MiB more at 100,000 frontends), where the tree was filled
    // and packed again afterwards. No frontend comes twice: `claims` has each once per
    // Service, and a frontend two Services claim goes to `contested` but for its winner's.
    // Sized for a ClusterIP frontend per port and address; NodePorts and external addresses
    // grow it.
    let ports: usize = (services.iter())
        .map(|s| s.ports.len() * s.cluster_ips.len().max(1))
        .sum();
    let mut frontends: Vec<(Frontend, DesiredFrontend)> = Vec::with_capacity(ports);
    for svc in services {
        let slices = slices_of(svc);
        let claims = claims(svc);
        let mut at = 0;
        while at < claims.len() {
            // The claims of one (clusterIP, port) are adjacent: their endpoints are merged
            // once.
            let (ci, pi) = (claims[at].cluster_ip, claims[at].port);
            let end = claims[at..]
                .iter()
                .position(|c| (c.cluster_ip, c.port) != (ci, pi))
                .map_or(claims.len(), |n| at + n);
            let family = Family::of(svc.cluster_ips[ci]);
            let port = &svc.ports[pi];
            let sets = BackendSets::new(svc, port, family, slices, node);
            let no_local = sets.no_local_endpoints(svc);
            if !no_local.is_zero() {
                *state
                    .no_local_endpoints
                    .entry(svc.key.to_string())
                    .or_default() += no_local;
            }
            for claim in &claims[at..end] {
                let frontend = claim.frontend;
                let d = sets.frontend(svc, port, claim, family, node);
                if let Some(winner) = winners.get(&frontend).filter(|w| **w != &svc.key) {
                    errors.push(invalid(
                        &svc.key.describe("Service"),
                        format!(
                            "frontend {frontend} is already served by Service {winner}; skipped"
                        ),
                    ));
                    state.contested.entry(frontend).or_default().push(d);
                    continue;
                }
                debug!(%frontend, service = %d.service, backends = d.backends.len(), "frontend");
                if claim.kind == Kind::ClusterIP {
                    state.cluster_ips.insert(frontend.ip);
                }
                frontends.push((frontend, d));
            }
            at = end;
        }
        if !svc.unserved.is_empty() {
            state
                .unserved
                .insert(svc.key.to_string(), svc.unserved.clone());
        }
        if svc.health_check_node_port != 0 {
            let mut local_endpoints = [None; 2];
            for ip in &svc.cluster_ips {
                let family = Family::of(*ip);
                let i = usize::from(family == Family::V6);
                local_endpoints[i] = Some(endpoints::local_ready_ips(slices, family, node));
            }
            state.health_checks.insert(
                svc.key.to_string(),
                HealthCheck {
                    port: svc.health_check_node_port,
                    local_endpoints,
                },
            );
        }
    }
    state.frontends = frontends.into_iter().collect();
    Translated { state, errors }
}

/// What the agent intends for one frontend, and why: the Service port it comes from, its
/// EndpointSlices, and each endpoint used or left out with the reason (`explain`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Intent {
    pub service: String,
    pub port_name: String,
    /// The Service's EndpointSlices.
    pub slices: Vec<SliceRef>,
    pub endpoints: Vec<EndpointVerdict>,
    /// The backends the agent programs for the frontend, as `translate` gives them.
    pub backends: Vec<std::net::SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SliceRef {
    /// "namespace/name".
    pub name: String,
    pub resource_version: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct EndpointVerdict {
    pub address: std::net::SocketAddr,
    pub used: bool,
    pub reason: String,
    /// The slice it was read from ("namespace/name"), for the ones of other families or ports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slice: Option<String>,
}

/// The agent's intent for `frontend`, from these objects as `translate` reads them; None
/// when no Service serves it.
pub fn intent(
    services: &[Service],
    slices: &[EndpointSlice],
    node: &NodeContext,
    frontend: &Frontend,
) -> Option<Intent> {
    let (parsed_services, parsed_slices) = parse_all(services, slices, node, &mut Vec::new());
    let translated = assemble(&parsed_services, &parsed_slices, node);
    let desired = translated.state.frontends.get(frontend)?;
    let svc = parsed_services
        .iter()
        .map(|s| &s.0)
        .find(|s| s.key.to_string() == desired.owner())?;
    let claim = claims(svc).into_iter().find(|c| c.frontend == *frontend)?;
    let family = Family::of(svc.cluster_ips[claim.cluster_ip]);
    let port = &svc.ports[claim.port];
    let own: Vec<&SliceInfo> = parsed_slices
        .iter()
        .map(|s| &s.0)
        .filter(|s| s.key.namespace() == svc.key.namespace() && s.service == svc.key.name())
        .collect();
    let merged = endpoints::merge(&own, family, &port.name, port.protocol, node);
    let local = match (claim.kind, claim.frontend.scope) {
        (Kind::ClusterIP, _) => svc.internal_local,
        (_, Scope::Cluster) => false,
        (_, Scope::External) => svc.external_local,
    };
    let mut verdicts: Vec<EndpointVerdict> = endpoints::judge(&merged, local, node)
        .into_iter()
        .map(|(address, used, reason)| EndpointVerdict {
            address,
            used,
            reason,
            slice: None,
        })
        .collect();
    // What merge passes over: slices of the other family, and slices without this port.
    for slice in &own {
        let why = if slice.family != family {
            Some(format!(
                "another address family than the frontend's {family:?}"
            ))
        } else if !slice
            .ports
            .iter()
            .any(|p| p.name == port.name && p.protocol == port.protocol)
        {
            Some(format!(
                "its slice has no port named {:?} for {}",
                port.name, port.protocol
            ))
        } else {
            None
        };
        let Some(why) = why else { continue };
        for e in &slice.endpoints {
            verdicts.push(EndpointVerdict {
                address: std::net::SocketAddr::new(e.ip, 0),
                used: false,
                reason: why.clone(),
                slice: Some(slice.key.to_string()),
            });
        }
    }
    Some(Intent {
        service: svc.key.to_string(),
        port_name: port.name.clone(),
        slices: own
            .iter()
            .map(|s| SliceRef {
                name: s.key.to_string(),
                resource_version: slices
                    .iter()
                    .find(|raw| {
                        raw.metadata.namespace.as_deref() == Some(s.key.namespace())
                            && raw.metadata.name.as_deref() == Some(s.key.name())
                    })
                    .and_then(|raw| raw.metadata.resource_version.clone()),
            })
            .collect(),
        endpoints: verdicts,
        backends: desired.backends.iter().map(|b| b.addr()).collect(),
    })
}

/// The backend sets of one Service port in one family, as kube-proxy's CategorizeEndpoints
/// makes them: the cluster set (topology applied) and this node's set, each computed only
/// if some frontend uses it.
struct BackendSets {
    cluster: Option<Vec<Backend>>,
    local: Option<Vec<Backend>>,
    /// UDP: what serves the port (see `DesiredFrontend::serving`).
    serving: Option<std::sync::Arc<Vec<std::net::SocketAddr>>>,
    /// Some endpoint anywhere is ready, or serving and terminating: kube-proxy's
    /// hasEndpoints, whichever sets were computed.
    has_endpoints: bool,
}

impl BackendSets {
    fn new(
        svc: &ServiceInfo,
        port: &ServicePortInfo,
        family: Family,
        slices: &[&SliceInfo],
        node: &NodeContext,
    ) -> BackendSets {
        let merged = endpoints::merge(slices, family, &port.name, port.protocol, node);
        // kube-proxy's ExternallyAccessible, per family as its proxiers are: a NodePort, or an
        // ExternalIP or LoadBalancer IP of this family (source ranges alone reach nothing).
        let reachable = port.node_port != 0
            || svc.external.as_ref().is_some_and(|x| {
                (x.external_ips.iter().chain(&x.lb_ips)).any(|ip| Family::of(*ip) == family)
            });
        let cluster =
            (!svc.internal_local || reachable).then(|| endpoints::select(&merged, false, node));
        let local = (svc.internal_local || (reachable && svc.external_local))
            .then(|| endpoints::select(&merged, true, node));
        let serving = (port.protocol == Protocol::Udp).then(|| endpoints::serving(&merged));
        let has_endpoints = merged
            .values()
            .any(|e| e.ready || (e.serving && e.terminating));
        BackendSets {
            cluster,
            local,
            serving,
            has_endpoints,
        }
    }

    /// This Service port's share of kube-proxy's no_local_endpoints gauge, as its iptables
    /// and nftables proxiers count it: a Local policy with no local endpoint while some
    /// endpoint is usable. `local()` is empty where the local set was not computed
    /// (externalTrafficPolicy Local with nothing external on this port), and such a port
    /// counts, as kube-proxy's nil localEndpoints do.
    fn no_local_endpoints(&self, svc: &ServiceInfo) -> NoLocalEndpoints {
        let none_here = self.has_endpoints && self.local().is_empty();
        NoLocalEndpoints {
            internal: u32::from(none_here && svc.internal_local),
            external: u32::from(none_here && svc.external_local),
        }
    }

    fn cluster(&self) -> &[Backend] {
        self.cluster.as_deref().unwrap_or_default()
    }

    fn local(&self) -> &[Backend] {
        self.local.as_deref().unwrap_or_default()
    }

    /// The desired state of one claimed frontend.
    fn frontend(
        &self,
        svc: &ServiceInfo,
        port: &ServicePortInfo,
        claim: &Claim,
        family: Family,
        node: &NodeContext,
    ) -> DesiredFrontend {
        let service = if port.name.is_empty() {
            svc.key.to_string()
        } else {
            format!("{}:{}", svc.key, port.name)
        };
        let mut d = DesiredFrontend {
            frontend: claim.frontend,
            service,
            backends: Vec::new(),
            affinity_timeout_s: svc.affinity_timeout_s,
            internal_local: false,
            kind: claim.kind,
            external_local: false,
            source_ranges: None,
            created: svc.created,
            serving: self.serving.clone(),
            lb_algorithm: None,
        };
        match (claim.kind, claim.frontend.scope) {
            (Kind::ClusterIP, _) => {
                d.internal_local = svc.internal_local;
                d.backends = if svc.internal_local {
                    self.local().to_vec()
                } else {
                    self.cluster().to_vec()
                };
            }
            // The node-local view: kube-proxy sends traffic from the node and its pods to the
            // cluster set whatever externalTrafficPolicy says ("short-circuit").
            (_, Scope::Cluster) => d.backends = self.cluster().to_vec(),
            (kind, Scope::External) => {
                // No usable endpoint anywhere: a reject (count 0 without EXTERNAL_LOCAL), as
                // kube-proxy rejects rather than drops.
                let has_endpoints = !self.cluster().is_empty();
                d.external_local = svc.external_local && has_endpoints;
                d.lb_algorithm = svc.lb_algorithm;
                d.backends = if svc.external_local {
                    self.local().to_vec()
                } else {
                    self.cluster().to_vec()
                };
                if kind == Kind::LoadBalancer {
                    d.source_ranges = source_ranges(svc, family, node);
                }
            }
        }
        d
    }
}

#[cfg(test)]
mod tests;
