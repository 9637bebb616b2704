//! A Service reduced to what the datapath needs, validated the way the API server would have
//! (manifests never went through the API server).

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use tracing::debug;

use super::{invalid, ObjectKey};
use crate::error::Error;
use crate::model::{Cidr, Protocol};

/// Services carrying this label belong to another proxy (kube-proxy's informers filter them).
const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Set by the EndpointSlice controller on slices of headless Services; kube-proxy filters
/// slices carrying it (not Services).
const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";

/// The API server's default for sessionAffinityConfig.clientIP.timeoutSeconds.
const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
const MAX_AFFINITY_TIMEOUT_S: i32 = 86_400;
/// The API server's limit for a port name (IANA_SVC_NAME).
const MAX_PORT_NAME_LEN: usize = 15;

pub(super) struct ServiceInfo {
    pub key: ObjectKey,
    /// metadata.creationTimestamp: of two Services claiming one frontend, the API server
    /// would have refused the younger.
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    /// At most one address per family, in spec order.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePortInfo>,
    /// Ports svc cannot serve (SCTP), as "namespace/name:port 3868/SCTP": named on /healthz
    /// for as long as the Service has them. Empty for nearly every Service, so boxed.
    pub unserved: Box<[String]>,
    pub affinity_timeout_s: Option<u32>,
    pub internal_local: bool,
    /// externalTrafficPolicy: Local, for a Service reachable from outside (kube-proxy's
    /// ExternalPolicyLocal: type NodePort or LoadBalancer, or ClusterIP with externalIPs).
    pub external_local: bool,
    /// spec.healthCheckNodePort of a LoadBalancer Service with externalTrafficPolicy Local
    /// (kube-proxy's NeedsHealthCheck); 0: none.
    pub health_check_node_port: u16,
    /// What makes the Service reachable from outside the cluster network (besides NodePorts,
    /// which are per port): most Services have none, so it costs one pointer.
    pub external: Option<Box<ExternalInfo>>,
    /// The `svc.dev/lb-algorithm` annotation, valid; None: absent or invalid (the flag's
    /// choice applies).
    pub lb_algorithm: Option<crate::maglev::Algorithm>,
}

/// ExternalIPs, LoadBalancer ingress IPs and their policies (kube-proxy's serviceport.go).
#[derive(Debug, Default)]
pub(super) struct ExternalInfo {
    /// spec.externalIPs, valid and unique, in spec order.
    pub external_ips: Vec<IpAddr>,
    /// status.loadBalancer.ingress[].ip whose ipMode is unset or VIP, unique, in order.
    pub lb_ips: Vec<IpAddr>,
    /// spec.loadBalancerSourceRanges, valid, both families (filtered per family later).
    pub source_ranges: Vec<Cidr>,
    /// Some entry of loadBalancerSourceRanges was given (even if none was valid).
    pub source_ranges_given: bool,
}

pub(super) struct ServicePortInfo {
    /// "" for an unnamed port, which is how EndpointSlices name it too.
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    /// spec.ports[].nodePort; 0: none.
    pub node_port: u16,
}

/// True for a Service labelled for another proxy: kube-proxy selects Services without
/// `service-proxy-name` (svc's --service-proxy-name selects that name instead). The headless
/// label does not count here: kube-proxy drops headless Services by `clusterIP: None` and
/// filters the label on EndpointSlices only, so a labelled Service with a ClusterIP is served.
pub(super) fn is_foreign_service(
    labels: Option<&std::collections::BTreeMap<String, String>>,
    ours: Option<&str>,
) -> bool {
    labels
        .and_then(|l| l.get(LABEL_SERVICE_PROXY_NAME))
        .map(String::as_str)
        != ours
}

/// True for an EndpointSlice kube-proxy ignores: labelled headless. kube-proxy does not look
/// at a slice's `service-proxy-name` (its Service's decides), so neither does svc by default;
/// with --service-proxy-name the slices must carry that name too, as the EndpointSlice
/// controller copies it from their Service, so that agents of different names do not each
/// hold every slice of the cluster.
pub(super) fn is_foreign_slice(
    labels: Option<&std::collections::BTreeMap<String, String>>,
    ours: Option<&str>,
) -> bool {
    labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS))
        || (ours.is_some() && is_foreign_service(labels, ours))
}

/// Parses one Service. `None` when it is not ours to proxy (silently) or too broken to use
/// (with errors pushed); a usable Service may still have pushed errors for parts of it.
pub(super) fn parse(
    service: &Service,
    proxy_name: Option<&str>,
    errors: &mut Vec<Error>,
) -> Option<ServiceInfo> {
    let meta = &service.metadata;
    let key = ObjectKey::of(meta);
    if key.name().is_empty() {
        errors.push(invalid(
            &key.describe("Service"),
            "metadata.name is required",
        ));
        return None;
    }
    // A DNS-1123 label, as KEP-5311's relaxed rule (RelaxedServiceNameValidation) lets newer
    // API servers accept: the older DNS-1035 rule would refuse Services they serve. Either
    // keeps ':' and '/' out, which the names map ("namespace/name:port") relies on.
    if let Some(e) = super::check_key(
        &key,
        "Service",
        crate::names::is_dns1123_label,
        "a DNS-1123 label (at most 63 of a-z, 0-9 and '-', starting and ending with a letter \
         or digit)",
    ) {
        errors.push(e);
        return None;
    }
    let object = key.describe("Service");
    if let Some(message) = service
        .spec
        .iter()
        .flat_map(|s| s.ports.as_deref().unwrap_or_default())
        .find_map(|p| super::check_port_name(p.name.as_deref(), "Service"))
    {
        errors.push(invalid(&object, message));
        return None;
    }
    if is_foreign_service(meta.labels.as_ref(), proxy_name) {
        debug!(service = %key, "skipped: labelled for another proxy");
        return None;
    }
    let Some(spec) = service.spec.as_ref() else {
        debug!(service = %key, "skipped: no spec");
        return None;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        debug!(service = %key, "skipped: ExternalName");
        return None;
    }
    // clusterIPs is authoritative when set; clusterIP alone is what older manifests carry.
    let raw_ips: Vec<&str> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec.cluster_ip.as_deref().into_iter().collect(),
    };
    match raw_ips.first() {
        None | Some(&"") => {
            debug!(service = %key, "skipped: no clusterIP");
            return None;
        }
        Some(&"None") => {
            debug!(service = %key, "skipped: headless");
            return None;
        }
        Some(_) => {}
    }
    let cluster_ips = parse_cluster_ips(&raw_ips, &object, errors);
    if cluster_ips.is_empty() {
        return None;
    }
    let kind = match spec.type_.as_deref() {
        None | Some("ClusterIP") => ServiceType::ClusterIP,
        Some("NodePort") => ServiceType::NodePort,
        Some("LoadBalancer") => ServiceType::LoadBalancer,
        Some(other) => {
            errors.push(invalid(
                &object,
                format!("unknown type {other:?}; served as ClusterIP"),
            ));
            ServiceType::ClusterIP
        }
    };
    let unserved = spec
        .ports
        .iter()
        .flatten()
        .filter(|p| p.protocol.as_deref() == Some("SCTP"))
        .map(|p| match p.name.as_deref().filter(|n| !n.is_empty()) {
            Some(name) => format!("{key}:{name} {}/SCTP", p.port),
            None => format!("{key} {}/SCTP", p.port),
        })
        .collect();
    let ports = parse_ports(
        spec.ports.as_deref().unwrap_or_default(),
        kind,
        &object,
        errors,
    );
    let affinity_timeout_s = parse_affinity(spec, &object, errors);
    let internal_local = match spec.internal_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            errors.push(invalid(
                &object,
                format!("unknown internalTrafficPolicy {other:?}; using Cluster"),
            ));
            false
        }
    };
    let external = parse_external(service, &object, errors);
    let lb_algorithm = parse_lb_algorithm(meta, &object, errors);
    // kube-proxy's ExternallyAccessible: what externalTrafficPolicy applies to.
    let externally_accessible = kind != ServiceType::ClusterIP
        || external
            .as_ref()
            .is_some_and(|e| !e.external_ips.is_empty());
    let external_local = match spec.external_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => externally_accessible,
        Some(other) => {
            errors.push(invalid(
                &object,
                format!("unknown externalTrafficPolicy {other:?}; using Cluster"),
            ));
            false
        }
    };
    // kube-proxy's NeedsHealthCheck: a LoadBalancer with externalTrafficPolicy Local.
    let needs_health_check = kind == ServiceType::LoadBalancer && external_local;
    let health_check_node_port = match spec.health_check_node_port.filter(|p| *p != 0) {
        _ if !needs_health_check => 0,
        None => {
            errors.push(invalid(
                &object,
                "type LoadBalancer with externalTrafficPolicy Local has no healthCheckNodePort \
                 (the API server allocates one); no health check",
            ));
            0
        }
        Some(p) => u16::try_from(p).unwrap_or_else(|_| {
            errors.push(invalid(
                &object,
                format!("healthCheckNodePort {p} is not 1-65535; no health check"),
            ));
            0
        }),
    };
    Some(ServiceInfo {
        key,
        created: meta.creation_timestamp.as_ref().map(|t| t.0),
        cluster_ips,
        ports,
        unserved,
        affinity_timeout_s,
        internal_local,
        external_local,
        health_check_node_port,
        external: external.map(Box::new),
        lb_algorithm,
    })
}

/// The Service's `svc.dev/lb-algorithm` annotation. A bad value is reported and the flag's
/// choice used: the Service is served either way, and every node reads the same annotation,
/// so they still agree.
fn parse_lb_algorithm(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    object: &str,
    errors: &mut Vec<Error>,
) -> Option<crate::maglev::Algorithm> {
    let value = meta.annotations.as_ref()?.get(crate::maglev::ANNOTATION)?;
    match value.trim().parse() {
        Ok(a) => Some(a),
        Err(e) => {
            errors.push(invalid(
                object,
                format!(
                    "annotation {}: {e}; using --lb-algorithm-external",
                    crate::maglev::ANNOTATION
                ),
            ));
            None
        }
    }
}

/// spec.type, as far as the datapath cares (ExternalName is skipped before).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ServiceType {
    ClusterIP,
    NodePort,
    LoadBalancer,
}

/// externalIPs, LoadBalancer ingress IPs and loadBalancerSourceRanges; None when the Service
/// has none of them.
fn parse_external(
    service: &Service,
    object: &str,
    errors: &mut Vec<Error>,
) -> Option<ExternalInfo> {
    let spec = service.spec.as_ref()?;
    let mut out = ExternalInfo::default();
    for text in spec.external_ips.iter().flatten() {
        match parse_ip(text) {
            Some(ip) if is_usable_cluster_ip(ip) => {
                if !out.external_ips.contains(&ip) {
                    out.external_ips.push(ip);
                }
            }
            Some(_) => errors.push(invalid(
                object,
                format!("externalIP {text:?} is not a unicast address; skipped"),
            )),
            None => errors.push(invalid(
                object,
                format!("externalIP {text:?} is not an IP address; skipped"),
            )),
        }
    }
    let ingress = service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for ing in ingress.into_iter().flatten() {
        let Some(text) = ing.ip.as_deref().filter(|t| !t.is_empty()) else {
            continue;
        };
        // kube-proxy's IsVIPMode: ipMode Proxy means the load balancer proxies to the node,
        // which must not capture the address.
        match ing.ip_mode.as_deref() {
            None | Some("VIP") => {}
            Some("Proxy") => continue,
            Some(other) => {
                errors.push(invalid(
                    object,
                    format!("load balancer ingress {text}: unknown ipMode {other:?}; not captured"),
                ));
                continue;
            }
        }
        match parse_ip(text) {
            Some(ip) if is_usable_cluster_ip(ip) => {
                if !out.lb_ips.contains(&ip) {
                    out.lb_ips.push(ip);
                }
            }
            _ => errors.push(invalid(
                object,
                format!("load balancer ingress ip {text:?} is not a unicast address; skipped"),
            )),
        }
    }
    for text in spec.load_balancer_source_ranges.iter().flatten() {
        out.source_ranges_given = true;
        // The API server's validation lets whitespace through; kube-proxy trims it.
        match text.trim().parse::<Cidr>() {
            Ok(cidr) => {
                let cidr = Cidr::new(cidr.addr.to_canonical(), cidr.prefix);
                if !out.source_ranges.contains(&cidr) {
                    out.source_ranges.push(cidr);
                }
            }
            Err(e) => errors.push(invalid(
                object,
                format!("loadBalancerSourceRanges: {e}; skipped"),
            )),
        }
    }
    let empty = out.external_ips.is_empty() && out.lb_ips.is_empty() && !out.source_ranges_given;
    (!empty).then_some(out)
}

fn parse_cluster_ips(raw: &[&str], object: &str, errors: &mut Vec<Error>) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = Vec::with_capacity(raw.len());
    for text in raw {
        let ip = match parse_ip(text) {
            Some(ip) if is_usable_cluster_ip(ip) => ip,
            Some(_) => {
                errors.push(invalid(
                    object,
                    format!("clusterIP {text:?} is not a unicast address; skipped"),
                ));
                continue;
            }
            None => {
                errors.push(invalid(
                    object,
                    format!("clusterIP {text:?} is not an IP address; skipped"),
                ));
                continue;
            }
        };
        // kube-proxy serves one clusterIP per family (GetClusterIPByFamily takes the first).
        if let Some(first) = ips.iter().find(|have| have.is_ipv4() == ip.is_ipv4()) {
            errors.push(invalid(
                object,
                format!(
                    "clusterIP {ip} is a second address of the same family as {first}; skipped"
                ),
            ));
            continue;
        }
        ips.push(ip);
    }
    ips
}

/// Parses an address as Kubernetes does: an IPv4-mapped IPv6 address counts as IPv4.
pub(super) fn parse_ip(text: &str) -> Option<IpAddr> {
    text.parse::<IpAddr>().ok().map(|ip| ip.to_canonical())
}

/// Capturing connections to these would break the node rather than balance a Service.
fn is_usable_cluster_ip(ip: IpAddr) -> bool {
    let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
    !(ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || broadcast)
}

pub(super) fn parse_protocol(text: Option<&str>) -> Result<Protocol, String> {
    match text.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Err("SCTP is not supported yet".to_string()),
        other => Err(format!("unknown protocol {other:?}")),
    }
}

/// "port \"http\" 80/TCP", or "port 80/TCP" for an unnamed one.
fn describe_port(name: &str, port: i32, protocol: Option<&str>) -> String {
    let protocol = protocol.unwrap_or("TCP");
    if name.is_empty() {
        format!("port {port}/{protocol}")
    } else {
        format!("port {name:?} {port}/{protocol}")
    }
}

fn parse_ports(
    ports: &[k8s_openapi::api::core::v1::ServicePort],
    kind: ServiceType,
    object: &str,
    errors: &mut Vec<Error>,
) -> Vec<ServicePortInfo> {
    let mut out: Vec<ServicePortInfo> = Vec::with_capacity(ports.len());
    for port in ports {
        let name = port.name.clone().unwrap_or_default();
        let what = describe_port(&name, port.port, port.protocol.as_deref());
        let protocol = match parse_protocol(port.protocol.as_deref()) {
            Ok(protocol) => protocol,
            Err(message) => {
                errors.push(invalid(object, format!("{what}: {message}; skipped")));
                continue;
            }
        };
        // A port's affinity is filed under "namespace/name:port" as the names map keeps it
        // (159 bytes): two longer names could be cut to one and share it.
        if name.len() > MAX_PORT_NAME_LEN {
            errors.push(invalid(
                object,
                format!("{what}: name longer than {MAX_PORT_NAME_LEN} characters; skipped"),
            ));
            continue;
        }
        let number = match u16::try_from(port.port) {
            Ok(number) if number != 0 => number,
            _ => {
                errors.push(invalid(
                    object,
                    format!("{what}: port must be 1-65535; skipped"),
                ));
                continue;
            }
        };
        if out
            .iter()
            .any(|p| p.port == number && p.protocol == protocol)
        {
            errors.push(invalid(
                object,
                format!("{what}: duplicate port and protocol; skipped"),
            ));
            continue;
        }
        // Endpoints are matched to a port by name and protocol, so a second port of the same
        // name would silently receive the first one's endpoints.
        if out.iter().any(|p| p.name == name && p.protocol == protocol) {
            errors.push(invalid(
                object,
                format!("{what}: duplicate port name; skipped"),
            ));
            continue;
        }
        let node_port =
            parse_node_port(port.node_port, kind, &what, &out, protocol, object, errors);
        out.push(ServicePortInfo {
            name,
            port: number,
            protocol,
            node_port,
        });
    }
    out
}

/// A port's nodePort as the API server would have allowed it; 0 for none.
fn parse_node_port(
    node_port: Option<i32>,
    kind: ServiceType,
    what: &str,
    earlier: &[ServicePortInfo],
    protocol: Protocol,
    object: &str,
    errors: &mut Vec<Error>,
) -> u16 {
    let given = node_port.filter(|p| *p != 0);
    match (kind, given) {
        (ServiceType::ClusterIP, None) => 0,
        (ServiceType::ClusterIP, Some(p)) => {
            errors.push(invalid(
                object,
                format!("{what}: nodePort {p} on a Service of type ClusterIP; ignored"),
            ));
            0
        }
        (ServiceType::NodePort, None) => {
            // The API server allocates one; a manifest must say which.
            errors.push(invalid(
                object,
                format!("{what}: type NodePort without a nodePort; no NodePort frontend"),
            ));
            0
        }
        // allocateLoadBalancerNodePorts: false.
        (ServiceType::LoadBalancer, None) => 0,
        (_, Some(p)) => match u16::try_from(p) {
            Ok(p)
                if earlier
                    .iter()
                    .any(|e| e.node_port == p && e.protocol == protocol) =>
            {
                errors.push(invalid(
                    object,
                    format!("{what}: nodePort {p} is used by another port; ignored"),
                ));
                0
            }
            Ok(p) => p,
            Err(_) => {
                errors.push(invalid(
                    object,
                    format!("{what}: nodePort {p} is not 1-65535; ignored"),
                ));
                0
            }
        },
    }
}

fn parse_affinity(
    spec: &k8s_openapi::api::core::v1::ServiceSpec,
    object: &str,
    errors: &mut Vec<Error>,
) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            Some(match timeout {
                None => DEFAULT_AFFINITY_TIMEOUT_S,
                Some(t) if (1..=MAX_AFFINITY_TIMEOUT_S).contains(&t) => t.unsigned_abs(),
                Some(t) => {
                    errors.push(invalid(
                        object,
                        format!(
                            "sessionAffinityConfig.clientIP.timeoutSeconds {t} is outside \
                             1-{MAX_AFFINITY_TIMEOUT_S}; using {DEFAULT_AFFINITY_TIMEOUT_S}"
                        ),
                    ));
                    DEFAULT_AFFINITY_TIMEOUT_S
                }
            })
        }
        Some(other) => {
            errors.push(invalid(
                object,
                format!("unknown sessionAffinity {other:?}; using None"),
            ));
            None
        }
    }
}
