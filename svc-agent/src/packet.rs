//! Settings of the packet datapath (tc programs on the node's devices): which devices, which
//! node addresses answer NodePorts, which ports SNATed flows use.

use std::net::IpAddr;

use svc_common::DatapathConfig;

use crate::netdev::{self, Device, DeviceSpec, NetState, NodePortAddresses};

/// What the operator chose (flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PacketConfig {
    /// `--devices`.
    pub devices: DeviceSpec,
    /// `--packet-lb-devices`: host sides of pod devices whose pods get per-packet ClusterIP
    /// translation.
    pub pod_devices: Vec<String>,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    /// `--snat-port-range`, or the default beside the node's ephemeral ports
    /// ([`snat_ports`]).
    pub snat_ports: (u16, u16),
    /// Why SNAT is off: the range overlaps the ephemeral ports and could not be reserved.
    /// Flows to remote backends are then dropped (no address is a SNAT address), local ones
    /// served; /healthz, a metric and the log say so.
    pub snat_degraded: Option<String>,
    /// `--localhost-nodeports`: the IPv4 loopback addresses `--nodeport-addresses` covers
    /// answer NodePorts for the node's own sockets.
    pub localhost_nodeports: bool,
    /// The node's network namespace cookie (the agent's); 0 when unknown.
    pub host_netns: u64,
    /// Connection-tracking idle timeouts (kube-proxy's --conntrack-* flags).
    pub ct_timeouts: CtTimeouts,
    /// `--conntrack-sweep-interval`: how often dead flows are removed from connection
    /// tracking; None: never (the LRU alone makes room).
    pub ct_sweep_every: Option<std::time::Duration>,
    /// `--xdp-mode`: the XDP program on the external devices (docs/design/xdp.md).
    pub xdp_mode: crate::datapath::XdpMode,
    /// `--tc-attach`: tcx links, classic cls_bpf filters, or whichever the kernel has.
    pub tc_attach: crate::datapath::TcAttach,
    /// `--bind-address` (kube-proxy's bindAddress): unless it is 0.0.0.0 or ::, the node's
    /// primary address of its family, over the Node's and the devices', as kube-proxy's
    /// detectNodeIPs takes it (for `--nodeport-addresses primary`).
    pub bind_address: Option<IpAddr>,
}

/// Idle timeouts of the packet datapath's flows, seconds; 0 leaves the programs' built-in
/// default (`svc_common::ct_timeout`, the kernel's for UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtTimeouts {
    pub tcp_established_s: u32,
    /// A TCP flow with a FIN one way (conntrack's CLOSE_WAIT).
    pub tcp_close_wait_s: u32,
    pub udp_s: u32,
    pub udp_stream_s: u32,
}

impl Default for CtTimeouts {
    /// kube-proxy's defaults: 24 h established, 1 h close-wait, UDP left to the built-in.
    fn default() -> Self {
        CtTimeouts {
            tcp_established_s: svc_common::ct_timeout::TCP_ESTABLISHED_S,
            tcp_close_wait_s: svc_common::ct_timeout::TCP_HALF_CLOSED_S,
            udp_s: 0,
            udp_stream_s: 0,
        }
    }
}

impl Default for PacketConfig {
    /// No devices at all: the socket path alone (tools and tests of it).
    fn default() -> Self {
        PacketConfig {
            devices: DeviceSpec::None,
            pod_devices: Vec::new(),
            nodeport_addresses: NodePortAddresses::primary(),
            snat_ports: (61000, 65535),
            snat_degraded: None,
            localhost_nodeports: true,
            host_netns: 0,
            ct_timeouts: CtTimeouts::default(),
            ct_sweep_every: None,
            xdp_mode: crate::datapath::XdpMode::Off,
            tc_attach: crate::datapath::TcAttach::Auto,
            bind_address: None,
        }
    }
}

impl PacketConfig {
    /// The one entry of SVC_CONFIG: SNAT ports, connection-tracking timeouts and the node's
    /// network namespace.
    pub fn datapath_config(&self) -> DatapathConfig {
        let t = self.ct_timeouts;
        let mut c = DatapathConfig {
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            ct_tcp_established_s: t.tcp_established_s,
            ct_tcp_half_closed_s: t.tcp_close_wait_s,
            ct_udp_s: t.udp_s,
            ct_udp_stream_s: t.udp_stream_s,
            ..Default::default()
        };
        c.set_host_netns_cookie(self.host_netns);
        c.localhost_net = u32::from(
            self.localhost_nodeports && self.nodeport_addresses.covers_all_v4_statically(),
        );
        c
    }
}

/// The node as the packet datapath sees it, computed from the kernel's view and the Node
/// object (with the Kubernetes API).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    pub external: Vec<Device>,
    pub pods: Vec<Device>,
    /// The primary address per family: the Node's (InternalIP first, as kube-proxy's
    /// GetNodeHostIPs), else the devices'.
    pub primary: Vec<IpAddr>,
    pub addrs: std::collections::BTreeMap<IpAddr, svc_common::NodeAddrValue>,
    /// Where the healthCheckNodePort servers listen.
    pub health_checks: std::collections::BTreeSet<crate::tasks::health::Bind>,
}

/// kube-proxy's detectNodeIPs: a bindAddress other than 0.0.0.0 or :: replaces the primary
/// address of its family, and its family comes first.
fn with_bind_address(mut primary: Vec<IpAddr>, bind: Option<IpAddr>) -> Vec<IpAddr> {
    if let Some(ip) = bind.filter(|ip| !ip.is_unspecified()) {
        primary.retain(|p| p.is_ipv4() != ip.is_ipv4());
        primary.insert(0, ip);
    }
    primary
}

/// Everything the packet datapath needs to know about the node.
pub fn view(cfg: &PacketConfig, state: &NetState, api_node_ips: Option<&[IpAddr]>) -> NodeView {
    let external = netdev::select(&cfg.devices, state, api_node_ips.unwrap_or_default());
    let pods = netdev::select_pod_devices(&cfg.pod_devices, state);
    let primary = match api_node_ips {
        Some(ips) => ips.to_vec(),
        None => {
            // Without a Node object, the devices say; with `--devices none`, the ones Cilium
            // would pick.
            let candidates = match cfg.devices {
                DeviceSpec::None => netdev::select(&DeviceSpec::Auto, state, &[]),
                _ => external.clone(),
            };
            netdev::primary_ips(state, &candidates)
        }
    };
    let primary = with_bind_address(primary, cfg.bind_address);
    let mut addrs = netdev::node_addrs(
        state,
        &external,
        &cfg.nodeport_addresses,
        &primary,
        cfg.localhost_nodeports,
    );
    if cfg.snat_degraded.is_some() {
        // Without a SNAT address the programs drop a new flow to a remote backend rather
        // than take a port the node's own connections may hold.
        for v in addrs.values_mut() {
            v.flags &= !svc_common::node_addr_flags::SNAT;
        }
    }
    let health_checks =
        crate::tasks::health::binds(&cfg.nodeport_addresses, &primary, &addrs, state);
    NodeView {
        external,
        pods,
        primary,
        addrs,
        health_checks,
    }
}

/// kube-proxy's node IPs from a Node's status.addresses (pkg/util/node GetNodeHostIPs): the
/// first InternalIP (else ExternalIP), then the first address of the other family.
pub fn node_host_ips(addresses: &[(String, String)]) -> Vec<IpAddr> {
    let parse = |t: &str| {
        addresses
            .iter()
            .filter(|(ty, _)| ty == t)
            .filter_map(|(_, a)| a.trim().parse::<IpAddr>().ok())
            .map(|ip| ip.to_canonical())
            .collect::<Vec<_>>()
    };
    let all: Vec<IpAddr> = parse("InternalIP")
        .into_iter()
        .chain(parse("ExternalIP"))
        .collect();
    let Some(first) = all.first().copied() else {
        return Vec::new();
    };
    let mut out = vec![first];
    if let Some(other) = all.iter().find(|ip| ip.is_ipv4() != first.is_ipv4()) {
        out.push(*other);
    }
    out
}

/// net.ipv4.ip_local_port_range of the agent's network namespace.
pub fn ephemeral_ports() -> std::io::Result<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?;
    parse_range(&text.split_whitespace().collect::<Vec<_>>().join("-"))
        .map_err(std::io::Error::other)
}

fn parse_range(text: &str) -> Result<(u16, u16), String> {
    let (a, b) = text
        .split_once('-')
        .ok_or_else(|| format!("{text:?}: expected MIN-MAX"))?;
    let a: u16 = a
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: {a:?} is not a port"))?;
    let b: u16 = b
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: {b:?} is not a port"))?;
    if a == 0 || a > b {
        return Err(format!("{text:?}: expected 1 <= MIN <= MAX <= 65535"));
    }
    Ok((a, b))
}

/// The SNAT port range and whether the node's ephemeral ports must keep out of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnatPlan {
    pub range: (u16, u16),
    /// The range overlaps the ephemeral ports: it must go into
    /// net.ipv4.ip_local_reserved_ports ([`reserve_ports`]), else the node's own connections
    /// could take a SNATed flow's tuple.
    pub reserve: bool,
}

/// The SNAT port range: `given` (`--snat-port-range MIN-MAX`), or by default the ports above
/// the node's ephemeral range (at least 1,024 of them), else those below it down to 1024, else
/// svc's own range (`svc_common::SNAT_PORT_MIN`-`SNAT_PORT_MAX`). A range that overlaps the
/// ephemeral ports is kept and reserved, as Cilium reserves its ports, rather than refused: an
/// agent that replaces kube-proxy and refuses to start takes every Service of the node down
/// with it. `ephemeral`: None when it cannot be read (the range is then reserved, to be safe).
pub fn snat_ports(given: Option<&str>, ephemeral: Option<(u16, u16)>) -> Result<SnatPlan, String> {
    let overlaps = |(a, b): (u16, u16)| ephemeral.is_none_or(|(lo, hi)| a <= hi && lo <= b);
    if let Some(text) = given {
        let range = parse_range(text).map_err(|e| format!("--snat-port-range {e}"))?;
        return Ok(SnatPlan {
            range,
            reserve: overlaps(range),
        });
    }
    const ENOUGH: u32 = 1024;
    if let Some((lo, hi)) = ephemeral {
        if u32::from(u16::MAX - hi) >= ENOUGH {
            return Ok(SnatPlan {
                range: (hi + 1, u16::MAX),
                reserve: false,
            });
        }
        if lo > 1024 && u32::from(lo - 1024) >= ENOUGH {
            return Ok(SnatPlan {
                range: (1024, lo - 1),
                reserve: false,
            });
        }
    }
    let range = (svc_common::SNAT_PORT_MIN, svc_common::SNAT_PORT_MAX);
    Ok(SnatPlan {
        range,
        reserve: overlaps(range),
    })
}

const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Adds `range` to net.ipv4.ip_local_reserved_ports of the agent's network namespace (it
/// covers IPv6 too), keeping every entry already there. Returns whether it wrote anything
/// (false: already reserved). The error names the sysctl.
pub fn reserve_ports(range: (u16, u16)) -> Result<bool, String> {
    let text = std::fs::read_to_string(RESERVED_PORTS)
        .map_err(|e| format!("reading {RESERVED_PORTS}: {e}"))?;
    let mut ranges = parse_port_list(&text).map_err(|e| format!("{RESERVED_PORTS}: {e}"))?;
    if ranges.iter().any(|&(a, b)| a <= range.0 && range.1 <= b) {
        return Ok(false);
    }
    ranges.push(range);
    std::fs::write(RESERVED_PORTS, render_port_list(ranges))
        .map_err(|e| format!("writing {RESERVED_PORTS}: {e}"))?;
    // A partial write, or a kernel that took another meaning: read back.
    let now = std::fs::read_to_string(RESERVED_PORTS)
        .map_err(|e| format!("reading {RESERVED_PORTS}: {e}"))?;
    let now = parse_port_list(&now).map_err(|e| format!("{RESERVED_PORTS}: {e}"))?;
    if !now.iter().any(|&(a, b)| a <= range.0 && range.1 <= b) {
        return Err(format!(
            "{RESERVED_PORTS} does not hold {}-{} after writing it",
            range.0, range.1
        ));
    }
    Ok(true)
}

/// `ip_local_reserved_ports`' syntax: ports and ranges, comma separated (empty: none).
fn parse_port_list(text: &str) -> Result<Vec<(u16, u16)>, String> {
    text.trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            if p.contains('-') {
                parse_range(p)
            } else {
                let v: u16 = p.parse().map_err(|_| format!("{p:?} is not a port"))?;
                Ok((v, v))
            }
        })
        .collect()
}

/// Ranges merged and sorted, in `ip_local_reserved_ports`' syntax.
fn render_port_list(mut ranges: Vec<(u16, u16)>) -> String {
    ranges.sort_unstable();
    let mut merged: Vec<(u16, u16)> = Vec::new();
    for (a, b) in ranges {
        match merged.last_mut() {
            Some(last) if u32::from(a) <= u32::from(last.1) + 1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    merged
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A timeout flag's value as kube-proxy takes it: a Go duration (`24h0m0s`, `1h`, `90s`,
/// `1.5h`), `0` for the built-in default; whole seconds, as conntrack keeps them. Hand-written:
/// no crate reads Go's duration syntax (signed, fractional, `µs`, units run together).
pub fn parse_timeout(flag: &str, text: &str) -> Result<u32, String> {
    let bad = |why: &str| format!("{flag} {text:?}: {why} (a duration such as 24h0m0s, 1h or 30s)");
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(bad("empty"));
    }
    // Integer nanoseconds, as Go computes them (a fraction's digits truncated, not rounded).
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| bad("a number without a unit"))?;
        let (int, frac) = rest[..n].split_once('.').unwrap_or((&rest[..n], ""));
        if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
            return Err(bad("not a number before a unit"));
        }
        rest = &rest[n..];
        let u = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale: u128 = match &rest[..u] {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(bad("unknown unit")),
        };
        rest = &rest[u..];
        let digits = |d: &str| -> Result<u128, String> {
            d.chars().try_fold(0u128, |acc, c| {
                acc.checked_mul(10)
                    .and_then(|a| a.checked_add(u128::from(c.to_digit(10).unwrap_or(0))))
                    .ok_or_else(|| bad("too long"))
            })
        };
        let whole = digits(int)?
            .checked_mul(scale)
            .ok_or_else(|| bad("too long"))?;
        // At most 30 fraction digits count; more cannot change whole nanoseconds here.
        let frac = &frac[..frac.len().min(30)];
        let part = digits(frac)?.saturating_mul(scale) / 10u128.pow(frac.len() as u32);
        nanos = nanos
            .checked_add(whole + part)
            .ok_or_else(|| bad("too long"))?;
    }
    if negative && nanos > 0 {
        return Err(bad("negative"));
    }
    let secs = nanos / 1_000_000_000;
    if secs > u128::from(u32::MAX) {
        return Err(bad("too long"));
    }
    if secs == 0 && nanos > 0 {
        return Err(bad(
            "shorter than the one-second resolution of connection tracking",
        ));
    }
    Ok(secs as u32)
}

/// A timeout flag of 0: kube-proxy then leaves the node's conntrack setting as it is, so the
/// node's `net.netfilter.nf_conntrack_NAME` (seconds) is taken when conntrack is loaded; else
/// 0, the built-in default.
pub fn node_conntrack_timeout(name: &str) -> u32 {
    std::fs::read_to_string(format!("/proc/sys/net/netfilter/nf_conntrack_{name}"))
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_address_is_the_primary_address_of_its_family() {
        let ips = |s: &[&str]| -> Vec<IpAddr> { s.iter().map(|a| a.parse().unwrap()).collect() };
        let node = ips(&["10.0.0.1", "fd00::1"]);
        assert_eq!(with_bind_address(node.clone(), None), node);
        assert_eq!(
            with_bind_address(node.clone(), Some("0.0.0.0".parse().unwrap())),
            node
        );
        assert_eq!(
            with_bind_address(node.clone(), Some("10.0.0.9".parse().unwrap())),
            ips(&["10.0.0.9", "fd00::1"])
        );
        assert_eq!(
            with_bind_address(node, Some("fd00::9".parse().unwrap())),
            ips(&["fd00::9", "10.0.0.1"])
        );
    }

    #[test]
    fn all_of_127_answers_localhost_node_ports_when_every_ipv4_address_is_chosen() {
        let net = |flag: &[&str], localhost: bool| {
            let flag: Vec<String> = flag.iter().map(|s| s.to_string()).collect();
            PacketConfig {
                nodeport_addresses: NodePortAddresses::parse(&flag).unwrap(),
                localhost_nodeports: localhost,
                ..PacketConfig::default()
            }
            .datapath_config()
            .localhost_net
        };
        assert_eq!(net(&["all"], true), 1);
        assert_eq!(net(&["0.0.0.0/0"], true), 1);
        assert_eq!(net(&["fd00::/8"], true), 1);
        assert_eq!(net(&["all"], false), 0);
        // Only the loopback addresses lo carries, as kube-proxy's `-d` per node IP.
        assert_eq!(net(&["primary", "localhost"], true), 0);
        assert_eq!(net(&["127.0.0.0/8"], true), 0);
        assert_eq!(net(&["primary"], true), 0);
    }

    #[test]
    fn timeouts_read_as_kube_proxy_reads_its_conntrack_flags() {
        let p = |t: &str| parse_timeout("--t", t);
        assert_eq!(p("24h0m0s"), Ok(86_400));
        assert_eq!(p("1h"), Ok(3_600));
        assert_eq!(p("1h30m"), Ok(5_400));
        assert_eq!(p("1.5h"), Ok(5_400));
        assert_eq!(p("90s"), Ok(90));
        assert_eq!(p("1500ms"), Ok(1));
        assert_eq!(p("0"), Ok(0));
        assert_eq!(p("0s"), Ok(0));
        for bad in [
            "", "-1h", "5", "1d", "h", "1h-2m", "500ms", "1.2.3s", "2000000h",
        ] {
            let e = p(bad).unwrap_err();
            assert!(e.starts_with("--t "), "{bad}: {e}");
        }
        let c = PacketConfig::default().datapath_config();
        assert_eq!(
            (c.ct_tcp_established_s, c.ct_tcp_half_closed_s),
            (86_400, 3_600)
        );
        assert_eq!((c.ct_udp_s, c.ct_udp_stream_s), (0, 0));
    }

    #[test]
    fn snat_ports_default_beside_the_ephemeral_range_else_svcs_own_range_reserved() {
        let plan = |given, eph| snat_ports(given, eph).map(|p| (p.range, p.reserve));
        assert_eq!(
            plan(None, Some((32768, 60999))),
            Ok(((61000, 65535), false))
        );
        assert_eq!(plan(None, Some((32768, 65000))), Ok(((1024, 32767), false)));
        // No room either side (a common tuning): svc's range, reserved, not a refusal.
        assert_eq!(plan(None, Some((1024, 65000))), Ok(((61001, 65535), true)));
        assert_eq!(plan(None, Some((1024, 65535))), Ok(((61001, 65535), true)));
        assert_eq!(plan(None, None), Ok(((61001, 65535), true)));
        assert_eq!(
            plan(Some("20000-29999"), Some((32768, 60999))),
            Ok(((20000, 29999), false))
        );
        assert_eq!(
            plan(Some("60000-62000"), Some((32768, 60999))),
            Ok(((60000, 62000), true))
        );
        assert!(snat_ports(Some("9-1"), Some((32768, 60999))).is_err());
        assert!(snat_ports(Some("x"), Some((32768, 60999))).is_err());
    }

    #[test]
    fn reserved_ports_merge_with_what_is_there() {
        let merged = |text: &str, add: (u16, u16)| {
            let mut r = parse_port_list(text).unwrap();
            r.push(add);
            render_port_list(r)
        };
        assert_eq!(merged("", (61001, 65535)), "61001-65535");
        assert_eq!(merged("\n", (61001, 65535)), "61001-65535");
        assert_eq!(
            merged("8080,10250-10260\n", (61001, 65535)),
            "8080,10250-10260,61001-65535"
        );
        assert_eq!(merged("61000,65535", (61001, 65534)), "61000-65535");
        assert_eq!(merged("62000-63000", (61001, 65535)), "61001-65535");
        assert!(parse_port_list("1-x").is_err());
    }

    #[test]
    fn node_host_ips_follow_kube_proxy() {
        let a = |t: &str, ip: &str| (t.to_string(), ip.to_string());
        let ips = node_host_ips(&[
            a("Hostname", "n1"),
            a("ExternalIP", "203.0.113.1"),
            a("InternalIP", "10.0.0.1"),
            a("InternalIP", "10.0.0.2"),
            a("ExternalIP", "2001:db8::1"),
        ]);
        assert_eq!(
            ips,
            [
                "10.0.0.1".parse::<IpAddr>().unwrap(),
                "2001:db8::1".parse().unwrap()
            ]
        );
        assert!(node_host_ips(&[a("Hostname", "n1")]).is_empty());
    }

    #[test]
    fn the_ephemeral_range_of_this_namespace_is_readable() {
        let (lo, hi) = ephemeral_ports().unwrap();
        assert!(lo <= hi);
    }
}
