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
use k8s_openapi::Metadata;
use tracing::{debug, instrument};

use crate::error::Error;
use crate::model::{DesiredFrontend, DesiredState, Frontend};

use endpoints::{Family, SliceInfo};
use service::ServiceInfo;

const DEFAULT_NAMESPACE: &str = "default";

/// Facts about the node the agent runs on, for the node-dependent parts of kube-proxy's rules
/// (internalTrafficPolicy: Local and topology hints).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub node_name: Option<String>,
    /// The node's topology.kubernetes.io/zone label.
    pub zone: Option<String>,
    /// This proxy's `--service-proxy-name`: objects labelled
    /// service.kubernetes.io/service-proxy-name with exactly this name are ours; None: only
    /// unlabelled objects are (kube-proxy's default).
    pub service_proxy_name: Option<String>,
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
pub struct ParsedSlice(SliceInfo);

/// "namespace/name" of a parsed object.
pub trait Keyed {
    fn namespace(&self) -> &str;
    fn name(&self) -> &str;
}

impl Keyed for ParsedService {
    fn namespace(&self) -> &str {
        self.0.key.namespace()
    }
    fn name(&self) -> &str {
        self.0.key.name()
    }
}

impl Keyed for ParsedSlice {
    fn namespace(&self) -> &str {
        self.0.key.namespace()
    }
    fn name(&self) -> &str {
        self.0.key.name()
    }
}

impl ParsedService {
    /// The frontends this Service claims, before conflicts with other Services are resolved.
    pub fn frontends(&self) -> impl Iterator<Item = Frontend> + '_ {
        self.0.cluster_ips.iter().flat_map(move |ip| {
            self.0.ports.iter().map(move |p| Frontend {
                ip: *ip,
                port: p.port,
                protocol: p.protocol,
            })
        })
    }
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

impl Holders for crate::sync::Programmed {
    fn holder(&self, fe: &Frontend) -> Option<&str> {
        self.frontends.get(fe).map(|f| f.owner())
    }
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

    // Parsing everything up front reports each problem once, however many ports see it.
    let parsed_services: Vec<ParsedService> = in_name_order(services, "Service", &mut errors)
        .into_iter()
        .filter_map(|s| parse_service(s, node, &mut errors))
        .collect();
    let parsed_slices: Vec<ParsedSlice> = in_name_order(slices, "EndpointSlice", &mut errors)
        .into_iter()
        .filter_map(|s| parse_slice(s, node, &mut errors))
        .collect();
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
    let mut slices_by_service: BTreeMap<(&str, &str), Vec<&SliceInfo>> = BTreeMap::new();
    for ParsedSlice(slice) in slices {
        slices_by_service
            .entry((slice.key.namespace(), slice.service.as_str()))
            .or_default()
            .push(slice);
    }
    // Name order makes the result independent of input order: errors come out in a stable
    // order, and slices of one Service are merged in name order.
    for list in slices_by_service.values_mut() {
        list.sort_by(|a, b| a.key.cmp(&b.key));
    }
    let mut services: Vec<&ServiceInfo> = services.into_iter().map(|s| &s.0).collect();
    services.sort_by(|a, b| a.key.cmp(&b.key));

    // Who gets each frontend claimed by more than one Service. Claims are collected for
    // conflicts only: at 100,000 Services a list per frontend would cost megabytes.
    let mut claims: BTreeMap<Frontend, Vec<&ServiceInfo>> = BTreeMap::new();
    {
        let mut first: std::collections::HashMap<Frontend, &ServiceInfo> =
            std::collections::HashMap::with_capacity(services.len());
        for svc in &services {
            for port in &svc.ports {
                for &ip in &svc.cluster_ips {
                    let frontend = Frontend {
                        ip,
                        port: port.port,
                        protocol: port.protocol,
                    };
                    match first.entry(frontend) {
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert(svc);
                        }
                        std::collections::hash_map::Entry::Occupied(e) => {
                            claims
                                .entry(frontend)
                                .or_insert_with(|| vec![*e.get()])
                                .push(svc);
                        }
                    }
                }
            }
        }
    }
    let mut winners: BTreeMap<Frontend, &ObjectKey> = BTreeMap::new();
    for (fe, claimants) in &claims {
        let holder = holders.holder(fe);
        let winner = claimants
            .iter()
            .find(|s| holder.is_some_and(|h| h == s.key.to_string()))
            .or_else(|| {
                // Oldest first; a Service without a creation time (a manifest) counts as
                // newest; name order (the order of `claimants`) breaks ties.
                claimants
                    .iter()
                    .min_by_key(|s| (s.created.is_none(), s.created))
            })
            .expect("two claimants");
        winners.insert(*fe, &winner.key);
    }

    let mut state = DesiredState::default();
    for svc in services {
        let slices = slices_by_service
            .get(&(svc.key.namespace(), svc.key.name()))
            .map(Vec::as_slice)
            .unwrap_or_default();
        for port in &svc.ports {
            let service_name = if port.name.is_empty() {
                svc.key.to_string()
            } else {
                format!("{}:{}", svc.key, port.name)
            };
            for &ip in &svc.cluster_ips {
                let frontend = Frontend {
                    ip,
                    port: port.port,
                    protocol: port.protocol,
                };
                if let Some(winner) = winners.get(&frontend).filter(|w| **w != &svc.key) {
                    errors.push(invalid(
                        &svc.key.describe("Service"),
                        format!(
                            "frontend {frontend} is already served by Service {winner}; skipped"
                        ),
                    ));
                    continue;
                }
                let merged =
                    endpoints::merge(slices, Family::of(ip), &port.name, port.protocol, node);
                let backends = endpoints::select(&merged, svc.internal_local, node);
                debug!(%frontend, service = %service_name, backends = backends.len(), "frontend");
                state.cluster_ips.insert(ip);
                state.frontends.insert(
                    frontend,
                    DesiredFrontend {
                        frontend,
                        owner: svc.key.to_string(),
                        service: service_name.clone(),
                        backends,
                        affinity_timeout_s: svc.affinity_timeout_s,
                        internal_local: svc.internal_local,
                    },
                );
            }
        }
    }
    Translated { state, errors }
}

#[cfg(test)]
mod tests;
