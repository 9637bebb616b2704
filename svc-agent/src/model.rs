//! The desired state: what the datapath should do, independent of where it came from
//! (manifest files, the Kubernetes API) and of how it is stored (BPF maps).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn ipproto(self) -> u8 {
        match self {
            Protocol::Tcp => svc_common::IPPROTO_TCP,
            Protocol::Udp => svc_common::IPPROTO_UDP,
        }
    }

    pub fn from_ipproto(p: u8) -> Option<Self> {
        match p {
            svc_common::IPPROTO_TCP => Some(Protocol::Tcp),
            svc_common::IPPROTO_UDP => Some(Protocol::Udp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

/// `ServiceKey::scope`: who a frontend is for (see docs/design/packet-datapath.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Traffic that starts on this node: ClusterIPs, and the node-local view of NodePorts,
    /// ExternalIPs and LoadBalancer IPs (socket hooks, per-packet ClusterIP).
    Cluster,
    /// Packets from outside on the external devices: NodePorts, ExternalIPs, LoadBalancer IPs,
    /// with externalTrafficPolicy and loadBalancerSourceRanges applied.
    External,
}

impl Scope {
    pub fn value(self) -> u8 {
        match self {
            Scope::Cluster => svc_common::scope::CLUSTER,
            Scope::External => svc_common::scope::EXTERNAL,
        }
    }

    pub fn from_value(v: u8) -> Option<Scope> {
        match v {
            svc_common::scope::CLUSTER => Some(Scope::Cluster),
            svc_common::scope::EXTERNAL => Some(Scope::External),
            _ => None,
        }
    }
}

/// What kind of Service address a frontend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Kind {
    ClusterIP,
    NodePort,
    ExternalIP,
    LoadBalancer,
}

impl Kind {
    /// The `svc_flags` bits that say so in the maps.
    pub fn flags(self) -> u16 {
        use svc_common::svc_flags;
        match self {
            Kind::ClusterIP => 0,
            Kind::NodePort => svc_flags::NODEPORT,
            Kind::ExternalIP => svc_flags::EXTERNAL_IP,
            Kind::LoadBalancer => svc_flags::LOAD_BALANCER,
        }
    }

    /// The kind a master entry's flags say.
    pub fn from_flags(flags: u16) -> Kind {
        use svc_common::svc_flags;
        if flags & svc_flags::NODEPORT != 0 {
            Kind::NodePort
        } else if flags & svc_flags::LOAD_BALANCER != 0 {
            Kind::LoadBalancer
        } else if flags & svc_flags::EXTERNAL_IP != 0 {
            Kind::ExternalIP
        } else {
            Kind::ClusterIP
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::ClusterIP => "ClusterIP",
            Kind::NodePort => "NodePort",
            Kind::ExternalIP => "ExternalIP",
            Kind::LoadBalancer => "LoadBalancer",
        })
    }
}

/// A service frontend: what a client connects to. A NodePort's address is the unspecified
/// address of its family (`NODEPORT_ADDR_V4`/`_V6`): it answers on every node address with
/// `node_addr_flags::NODEPORT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

impl Frontend {
    /// A ClusterIP-scope frontend (what every frontend was before the packet datapath).
    pub fn cluster(ip: IpAddr, port: u16, protocol: Protocol) -> Frontend {
        Frontend {
            ip,
            port,
            protocol,
            scope: Scope::Cluster,
        }
    }

    /// The NodePort frontend of `family_of`'s family.
    pub fn node_port(family_of: IpAddr, port: u16, protocol: Protocol, scope: Scope) -> Frontend {
        let ip = match family_of {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        };
        Frontend {
            ip,
            port,
            protocol,
            scope,
        }
    }

    /// Keyed by the NodePort wildcard address.
    pub fn is_node_port(&self) -> bool {
        self.ip.is_unspecified()
    }
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.ip, self.port),
            self.protocol
        )?;
        if self.scope == Scope::External {
            f.write_str(" (external)")?;
        }
        Ok(())
    }
}

/// One backend of a frontend: 20 bytes where `(SocketAddr, bool)` takes 36; the desired state
/// holds one per endpoint of each frontend, a million at 100,000 Services of 10.
///
/// Ordered as `(SocketAddr, local)` is (IPv4 first, then address, port), the fields compared
/// in the order declared: `DesiredFrontend::backends` is sorted, in the order the translation
/// walks endpoints (by `SocketAddr`), and this order must agree with it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend {
    v6: bool,
    /// IPv4 as `::ffff:a.b.c.d` (`v6` false): the same 16 bytes the maps hold.
    ip: [u8; 16],
    port: u16,
    /// The endpoint runs on this node (its nodeName): `backend_flags::LOCAL`.
    pub local: bool,
}

const _: () = assert!(std::mem::size_of::<Backend>() == 20);

/// An address as the maps hold it: IPv4 as `::ffff:a.b.c.d`.
pub fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => svc_common::v4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// An address the maps hold: `::ffff:a.b.c.d` as IPv4.
pub fn ip_from16(a: [u8; 16]) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from(a);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

impl Backend {
    /// Flow information and scope of an IPv6 address are not kept: an endpoint has none.
    pub fn new(addr: SocketAddr, local: bool) -> Backend {
        Backend {
            v6: addr.is_ipv6(),
            ip: addr16(addr.ip()),
            port: addr.port(),
            local,
        }
    }

    pub fn remote(addr: SocketAddr) -> Backend {
        Backend::new(addr, false)
    }

    pub fn ip(&self) -> IpAddr {
        match self.v6 {
            true => IpAddr::V6(self.ip.into()),
            false => ip_from16(self.ip),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip(), self.port)
    }

    /// The address as the maps hold it (IPv4 as `::ffff:a.b.c.d`).
    pub fn addr16(&self) -> [u8; 16] {
        self.ip
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("addr", &self.addr())
            .field("local", &self.local)
            .finish()
    }
}

impl Serialize for Backend {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut st = s.serialize_struct("Backend", 2)?;
        st.serialize_field("addr", &self.addr())?;
        st.serialize_field("local", &self.local)?;
        st.end()
    }
}

impl From<SocketAddr> for Backend {
    fn from(addr: SocketAddr) -> Backend {
        Backend::remote(addr)
    }
}

/// "10.0.0.1:8080": a backend on another node (an IPv6 address's `%scope` is dropped).
impl std::str::FromStr for Backend {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Backend::remote)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.addr().fmt(f)
    }
}

/// An address range: "10.0.0.0/8", "fd00::/64".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Cidr {
    /// With the bits past the prefix cleared.
    pub addr: IpAddr,
    pub prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?}: expected ADDRESS/PREFIX"))?;
        let addr: IpAddr = a.parse().map_err(|e| format!("{s:?}: {e}"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = p
            .parse()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| format!("{s:?}: the prefix must be 0-{max}"))?;
        Ok(Cidr::new(addr, prefix))
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u32::from(v4) as u128,
        IpAddr::V6(v6) => u128::from(v6),
    }
}

impl Cidr {
    /// `addr/prefix` with the host bits cleared (as Go's net.ParseCIDR returns the network).
    pub fn new(addr: IpAddr, prefix: u8) -> Cidr {
        let width: u32 = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = (prefix as u32).min(width);
        let keep = if prefix == 0 {
            0
        } else {
            (u128::MAX << (width - prefix)) & (u128::MAX >> (128 - width))
        };
        let masked = bits(addr) & keep;
        let addr = match addr {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::from(masked as u32)),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::from(masked)),
        };
        Cidr {
            addr,
            prefix: prefix as u8,
        }
    }

    /// One address.
    pub fn host(addr: IpAddr) -> Cidr {
        Cidr::new(addr, if addr.is_ipv4() { 32 } else { 128 })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        if self.addr.is_ipv4() != ip.is_ipv4() {
            return false;
        }
        Cidr::new(ip, self.prefix).addr == self.addr
    }

    /// 0.0.0.0/0 or ::/0: every address of the family.
    pub fn is_zero(&self) -> bool {
        self.prefix == 0
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One frontend as it should be programmed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DesiredFrontend {
    pub frontend: Frontend,
    /// "namespace/name:portname" (":portname" omitted for an unnamed port): names the object
    /// in listings and errors; its owner (`owner`) is the part before the ':'. Not kept apart:
    /// a copy of the owner costs 56 bytes a frontend at least (a `String` and its allocation).
    pub service: String,
    /// Usable backends, sorted and deduplicated. Empty means connections are refused (or, with
    /// `external_local`, dropped).
    pub backends: Vec<Backend>,
    /// sessionAffinity ClientIP timeout, when affinity is on.
    pub affinity_timeout_s: Option<u32>,
    /// internalTrafficPolicy: Local was applied to `backends`.
    pub internal_local: bool,
    pub kind: Kind,
    /// externalTrafficPolicy: Local was applied to `backends` (external scope only; only
    /// while the Service has usable endpoints somewhere, see the datapath contract).
    pub external_local: bool,
    /// loadBalancerSourceRanges of a LoadBalancer frontend (external scope), with the
    /// addresses kube-proxy admits for the node itself: clients outside them are dropped.
    /// None: no restriction.
    pub source_ranges: Option<Box<[Cidr]>>,
    /// The Service's creationTimestamp: a frontend its holder gives up goes to the older of
    /// the Services that also claim it, as a full translation would give it.
    #[serde(skip)]
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    /// UDP: the endpoints that serve its Service port (of its family), sorted, whatever the
    /// traffic policies, topology hints and terminating states leave in `backends`, and
    /// shared by the port's frontends. A UDP flow or connected socket translated for this
    /// frontend to any other address is stale (kube-proxy's CleanStaleEntries). None: only
    /// `backends` serve (TCP, and frontends built by hand). A vector behind the `Arc` keeps
    /// the field one pointer wide: it is in every frontend, TCP or not.
    #[serde(skip)]
    pub serving: Option<Arc<Vec<SocketAddr>>>,
    /// The Service's `svc.dev/lb-algorithm` annotation (external scope only): overrides
    /// `--lb-algorithm-external` for this frontend. None: the flag's choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lb_algorithm: Option<crate::maglev::Algorithm>,
}

/// "namespace/name" of a frontend's "namespace/name:port" (names and namespaces hold no ':').
pub fn owner_of(name: &str) -> &str {
    name.split_once(':').map_or(name, |(owner, _)| owner)
}

impl DesiredFrontend {
    /// "namespace/name" of the Service this frontend belongs to: the unit of incremental
    /// updates.
    pub fn owner(&self) -> &str {
        owner_of(&self.service)
    }

    /// A ClusterIP frontend with nothing but backends (tests, tools) of the Service port
    /// `service` ("namespace/name:port").
    pub fn cluster_ip(frontend: Frontend, service: &str, backends: Vec<Backend>) -> Self {
        DesiredFrontend {
            frontend,
            service: service.to_string(),
            backends,
            affinity_timeout_s: None,
            internal_local: false,
            kind: Kind::ClusterIP,
            external_local: false,
            source_ranges: None,
            created: None,
            serving: None,
            lb_algorithm: None,
        }
    }
}

/// What the node itself contributes to the packet datapath: its addresses and the datapath's
/// settings. Not per Service: written by a sync of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDesired {
    /// The node's addresses (`SVC_NODE_ADDRS`), by address.
    pub addrs: BTreeMap<IpAddr, svc_common::NodeAddrValue>,
    /// `SVC_CONFIG`; None: not written (no packet datapath configured, e.g. in tests of the
    /// socket path alone).
    pub config: Option<svc_common::DatapathConfig>,
}

/// The healthCheckNodePort server kube-proxy runs for a LoadBalancer Service with
/// externalTrafficPolicy Local.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HealthCheck {
    pub port: u16,
    /// Distinct addresses of this node's ready endpoints, per family (IPv4, IPv6); None for a
    /// family the Service has no clusterIP of.
    pub local_endpoints: [Option<u32>; 2],
}

/// Everything the datapath should serve.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<Frontend, DesiredFrontend>,
    /// Every ClusterIP with at least one frontend: ports and protocols it does not define are
    /// refused. (ExternalIPs and LoadBalancer IPs get no marker.)
    pub cluster_ips: BTreeSet<IpAddr>,
    pub node: NodeDesired,
    /// Health check servers, by Service ("namespace/name").
    pub health_checks: BTreeMap<String, HealthCheck>,
    /// Claims of frontends another Service holds (two Services may list one ExternalIP and
    /// port), first in line first: when the holder gives its frontend up, the next claimant
    /// serves it, as under kube-proxy, without waiting for that Service to change.
    pub contested: BTreeMap<Frontend, Vec<DesiredFrontend>>,
    /// Ports of Services that svc does not serve (SCTP), by Service ("namespace/name"): not
    /// programmed, but named on /healthz and counted in /metrics.
    pub unserved: BTreeMap<String, Box<[String]>>,
    /// Service ports with a Local traffic policy and no local endpoint to apply it to, by
    /// Service ("namespace/name"; only Services that have some): kube-proxy's
    /// sync_proxy_rules_no_local_endpoints_total.
    pub no_local_endpoints: BTreeMap<String, NoLocalEndpoints>,
}

/// kube-proxy's count of Service ports (one per port and address family) whose traffic policy
/// is Local and that have no local endpoint, while they have usable endpoints elsewhere
/// (without any, traffic is rejected whatever the policy, and not counted): by
/// internalTrafficPolicy (ClusterIP traffic dropped) and externalTrafficPolicy (external
/// traffic dropped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    pub internal: u32,
    pub external: u32,
}

impl NoLocalEndpoints {
    pub fn is_zero(&self) -> bool {
        *self == NoLocalEndpoints::default()
    }
}

impl std::ops::AddAssign for NoLocalEndpoints {
    fn add_assign(&mut self, o: NoLocalEndpoints) {
        self.internal = self.internal.saturating_add(o.internal);
        self.external = self.external.saturating_add(o.external);
    }
}

/// Who served each frontend ("namespace/name") by a record of what was programmed, as the
/// agent adopts it from the pinned maps at start: who holds what before any desired state.
#[derive(Debug, Default)]
pub struct Served(BTreeMap<Frontend, String>);

impl Served {
    pub fn owner(&self, fe: &Frontend) -> Option<&str> {
        self.0.get(fe).map(String::as_str)
    }
}

impl FromIterator<(Frontend, String)> for Served {
    fn from_iter<I: IntoIterator<Item = (Frontend, String)>>(iter: I) -> Self {
        Served(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frontend's backends are sorted by address (the translation walks endpoints by
    /// `SocketAddr`): this order must be that one, as the earlier `(SocketAddr, bool)` was.
    #[test]
    fn backends_sort_and_read_back_as_socket_addresses_do() {
        let addrs = [
            "10.0.0.1:80",
            "10.0.0.1:8080",
            "10.0.0.2:80",
            "9.255.255.255:65535",
            "255.255.255.255:1",
            "0.0.0.0:0",
            "[::1]:80",
            "[::ffff:10.0.0.1]:80",
            "[::ffff:9.0.0.1]:443",
            "[2001:db8::1]:80",
            "[2001:db8::1]:79",
            "[fe80::1]:80",
            "[ffff::]:1",
            "[::]:0",
        ];
        let mut old: Vec<(SocketAddr, bool)> = Vec::new();
        for a in addrs {
            for local in [false, true] {
                old.push((a.parse().unwrap(), local));
            }
        }
        let mut new: Vec<Backend> = old.iter().map(|&(a, l)| Backend::new(a, l)).collect();
        old.sort();
        new.sort();
        let back: Vec<(SocketAddr, bool)> = new.iter().map(|b| (b.addr(), b.local)).collect();
        assert_eq!(back, old);
        // An IPv4-mapped IPv6 address stays IPv6, though the maps hold the same 16 bytes.
        let (v4, mapped) = (
            Backend::remote(old[0].0),
            "[::ffff:0.0.0.0]:0".parse().unwrap(),
        );
        let mapped = Backend::remote(mapped);
        assert_ne!(v4, mapped);
        assert_eq!(v4.addr16(), mapped.addr16());
        assert!(mapped.addr().is_ipv6() && v4.addr().is_ipv4());
        assert_eq!(
            serde_json::to_string(&Backend::new("10.0.0.1:80".parse().unwrap(), true)).unwrap(),
            r#"{"addr":"10.0.0.1:80","local":true}"#
        );
    }
}
