//! `svc-agent list`: what the datapath will do, read from the pinned maps alone.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use serde::Serialize;
use svc_common::{node_addr_flags, svc_flags};

use crate::error::Result;
use crate::model::{Kind, Scope};
use crate::reconcile::{ip_from16, Programmed, DEFAULT_GRACE};
use crate::store::BpfStore;

#[derive(Debug, Serialize)]
pub struct Listing {
    pub services: Vec<ListedFrontend>,
    /// ClusterIPs whose undefined ports are refused.
    pub cluster_ips: Vec<IpAddr>,
    /// Decisions of the socket programs since they were loaded, by reason.
    pub stats: HashMap<&'static str, u64>,
    /// The node's addresses as the packet datapath knows them (SVC_NODE_ADDRS).
    pub node_addresses: Vec<ListedNodeAddr>,
    /// Addresses that are no node's or frontend's any more, kept in SVC_NODE_ADDRS while
    /// flows svc translates may go to them (a deleted Service's established connections).
    pub lingering_addresses: Vec<IpAddr>,
    /// SNAT source ports of the packet datapath (SVC_CONFIG); 0-0 when not configured.
    pub snat_ports: String,
    /// Idle timeouts of the packet datapath's flows in effect (SVC_CONFIG, or the built-in
    /// defaults), seconds.
    pub ct_timeouts: ListedCtTimeouts,
    /// External devices with the XDP program, and its mode on each ("native" or "generic"),
    /// or "tc" where `--xdp-mode native` found the driver refusing native XDP, from the pins
    /// (docs/design/xdp.md).
    pub xdp_devices: Vec<ListedXdpDevice>,
    /// svc's tc programs attached in this network namespace, by device, with how (tcx link
    /// or classic filter). Filled by the caller (`datapath::tc_attachments`): the maps do not
    /// say.
    pub tc_programs: Vec<crate::datapath::TcAttachment>,
}

#[derive(Debug, Serialize)]
pub struct ListedXdpDevice {
    pub device: String,
    pub mode: &'static str,
    /// Why a device runs tc alone ("driver has no native XDP").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ListedCtTimeouts {
    pub tcp_established_s: u32,
    pub tcp_close_wait_s: u32,
    pub udp_s: u32,
    pub udp_stream_s: u32,
}

#[derive(Debug, Serialize)]
pub struct ListedNodeAddr {
    pub address: IpAddr,
    /// NodePorts answer on it.
    pub nodeport: bool,
    /// NodePorts answer on it (loopback) for the node's own sockets only.
    pub localhost_nodeport: bool,
    /// Usable as the source of SNATed flows.
    pub snat: bool,
    pub ifindex: u32,
}

#[derive(Debug, Serialize)]
pub struct ListedFrontend {
    pub frontend: String,
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: String,
    pub name: Option<String>,
    pub id: u32,
    pub backends: Vec<SocketAddr>,
    pub affinity_timeout_s: Option<u32>,
    pub internal_traffic_local: bool,
    /// ClusterIP, NodePort (keyed by the unspecified address: any node address), ExternalIP,
    /// LoadBalancer.
    pub kind: Kind,
    /// "cluster" (socket hooks: traffic from the node and its pods) or "external" (packets
    /// on the external devices).
    pub scope: Scope,
    pub external_traffic_local: bool,
    /// loadBalancerSourceRanges enforced (with the node's own admission); absent when any
    /// client is admitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_ranges: Option<Vec<String>>,
    /// Backends on this node (DNAT only; others are also SNATed by the packet datapath).
    pub local_backends: Vec<SocketAddr>,
}

pub fn read(store: &BpfStore) -> Result<Listing> {
    let p = Programmed::adopt(store, store.capacity, DEFAULT_GRACE)?;
    let services = p
        .frontends
        .iter()
        .map(|(fe, f)| ListedFrontend {
            frontend: fe.to_string(),
            ip: fe.ip,
            port: fe.port,
            protocol: fe.protocol.to_string(),
            name: Some(f.name.clone()).filter(|n| !n.is_empty()),
            id: f.id,
            backends: f
                .backends
                .iter()
                .filter_map(|b| p.backends.get(*b).map(|k| k.socket_addr()))
                .collect(),
            affinity_timeout_s: (f.flags & svc_flags::AFFINITY != 0)
                .then_some(f.affinity_timeout_s),
            internal_traffic_local: f.flags & svc_flags::INTERNAL_LOCAL != 0,
            kind: Kind::from_flags(f.flags),
            scope: fe.scope,
            external_traffic_local: f.flags & svc_flags::EXTERNAL_LOCAL != 0,
            source_ranges: (f.flags & svc_flags::SOURCE_RANGES != 0)
                .then(|| f.ranges.iter().map(ToString::to_string).collect()),
            local_backends: f
                .backends
                .iter()
                .filter_map(|b| {
                    p.backends
                        .get(*b)
                        .filter(|k| k.local)
                        .map(|k| k.socket_addr())
                })
                .collect(),
        })
        .collect();
    let stats = store.stats()?.into_iter().collect();
    let config = p.config.unwrap_or_default();
    Ok(Listing {
        services,
        cluster_ips: p.markers.iter().copied().collect(),
        stats,
        node_addresses: p
            .node_addrs
            .iter()
            .filter(|(_, v)| v.flags & node_addr_flags::OF_NODE != 0)
            .map(|(a, v)| ListedNodeAddr {
                address: ip_from16(*a),
                nodeport: v.flags & node_addr_flags::NODEPORT != 0,
                localhost_nodeport: v.flags & node_addr_flags::LOCALHOST != 0,
                snat: v.flags & node_addr_flags::SNAT != 0,
                ifindex: v.ifindex,
            })
            .collect(),
        lingering_addresses: p.lingering().into_iter().map(ip_from16).collect(),
        snat_ports: format!("{}-{}", config.snat_port_min, config.snat_port_max),
        ct_timeouts: {
            use svc_common::{ct_flags as f, ct_timeout::seconds, IPPROTO_TCP, IPPROTO_UDP};
            ListedCtTimeouts {
                tcp_established_s: seconds(&config, IPPROTO_TCP, f::SEEN_REPLY),
                tcp_close_wait_s: seconds(&config, IPPROTO_TCP, f::SEEN_REPLY | f::FIN),
                udp_s: seconds(&config, IPPROTO_UDP, 0),
                udp_stream_s: seconds(&config, IPPROTO_UDP, f::SEEN_REPLY),
            }
        },
        xdp_devices: Vec::new(),
        tc_programs: Vec::new(),
    })
}

pub fn render_text(l: &Listing) -> String {
    let mut out = String::new();
    // Names come from the pinned maps, which an older agent may have filled with names no API
    // server would accept: a control character in one must not act on the terminal.
    fn name(s: &ListedFrontend) -> std::borrow::Cow<'_, str> {
        crate::names::escape(s.name.as_deref().unwrap_or("-"))
    }
    let w = l
        .services
        .iter()
        .map(|s| s.frontend.len())
        .max()
        .unwrap_or(0)
        .max("FRONTEND".len());
    let nw = l
        .services
        .iter()
        .map(|s| name(s).chars().count())
        .max()
        .unwrap_or(0)
        .max("SERVICE".len());
    let _ = writeln!(
        out,
        "{:w$}  {:12}  {:nw$}  {:9}  BACKENDS",
        "FRONTEND", "KIND", "SERVICE", "AFFINITY"
    );
    for s in &l.services {
        let affinity = s
            .affinity_timeout_s
            .map(|t| format!("{t}s"))
            .unwrap_or_else(|| "-".into());
        let backends = if s.backends.is_empty() && s.external_traffic_local {
            "(none on this node: packets dropped)".to_string()
        } else if s.backends.is_empty() {
            "(none: connections refused)".to_string()
        } else {
            s.backends
                .iter()
                .map(|b| {
                    if s.local_backends.contains(b) {
                        format!("{b} (local)")
                    } else {
                        b.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut notes = Vec::new();
        if s.external_traffic_local {
            notes.push("externalTrafficPolicy: Local".to_string());
        }
        if let Some(r) = &s.source_ranges {
            notes.push(format!(
                "sources: {}",
                if r.is_empty() {
                    "none".to_string()
                } else {
                    r.join(", ")
                }
            ));
        }
        let notes = if notes.is_empty() {
            String::new()
        } else {
            format!("  [{}]", notes.join("; "))
        };
        let _ = writeln!(
            out,
            "{:w$}  {:12}  {:nw$}  {:9}  {}{notes}",
            s.frontend,
            s.kind.to_string(),
            name(s),
            affinity,
            backends
        );
    }
    let ips: Vec<String> = l.cluster_ips.iter().map(|i| i.to_string()).collect();
    let _ = writeln!(
        out,
        "\nClusterIPs (ports they do not define are refused): {}",
        if ips.is_empty() {
            "-".into()
        } else {
            ips.join(", ")
        }
    );
    let mut stats: Vec<_> = l.stats.iter().collect();
    stats.sort();
    let stats: Vec<String> = stats.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "Socket decisions: {}", stats.join(" "));
    let tc: Vec<String> = l
        .tc_programs
        .iter()
        .map(|a| format!("{} on {} ({})", a.program, a.device, a.mode))
        .collect();
    let _ = writeln!(
        out,
        "tc programs: {}",
        if tc.is_empty() {
            "-".into()
        } else {
            tc.join(", ")
        }
    );
    let addrs: Vec<String> = l
        .node_addresses
        .iter()
        .map(|a| {
            let mut what = Vec::new();
            if a.nodeport {
                what.push("nodeport");
            }
            if a.localhost_nodeport {
                what.push("nodeport from the node only");
            }
            if a.snat {
                what.push("snat");
            }
            format!("{} ({}, ifindex {})", a.address, what.join("+"), a.ifindex)
        })
        .collect();
    let _ = writeln!(
        out,
        "Node addresses: {}\nSNAT ports: {}\nIdle timeouts: TCP established {}s, close-wait {}s; \
         UDP {}s, with replies {}s",
        if addrs.is_empty() {
            "-".to_string()
        } else {
            addrs.join(", ")
        },
        l.snat_ports,
        l.ct_timeouts.tcp_established_s,
        l.ct_timeouts.tcp_close_wait_s,
        l.ct_timeouts.udp_s,
        l.ct_timeouts.udp_stream_s,
    );
    if !l.lingering_addresses.is_empty() {
        let lingering: Vec<String> = l
            .lingering_addresses
            .iter()
            .map(|a| a.to_string())
            .collect();
        let _ = writeln!(
            out,
            "Lingering addresses (flows of removed frontends may still go to them): {}",
            lingering.join(", ")
        );
    }
    if !l.xdp_devices.is_empty() {
        let xdp: Vec<String> = l
            .xdp_devices
            .iter()
            .map(|d| match &d.why {
                Some(why) => format!(
                    "{} ({}: {})",
                    crate::names::escape(&d.device),
                    d.mode,
                    crate::names::escape(why)
                ),
                None => format!("{} ({})", crate::names::escape(&d.device), d.mode),
            })
            .collect();
        let _ = writeln!(out, "XDP: {}", xdp.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33, item 10: a name read back from the pinned maps (an older agent wrote what it
    /// was given) is shown escaped: it neither clears the terminal nor starts a line.
    #[test]
    fn names_from_the_maps_are_listed_without_control_characters() {
        let listing = Listing {
            services: vec![ListedFrontend {
                frontend: "10.96.0.10:80/TCP".into(),
                ip: "10.96.0.10".parse().unwrap(),
                port: 80,
                protocol: "TCP".into(),
                name: Some("evil\u{1b}[2J\u{1b}[31m/web\nforged\u{202e}:http".into()),
                id: 1,
                backends: vec!["10.0.0.1:8080".parse().unwrap()],
                affinity_timeout_s: None,
                internal_traffic_local: false,
                kind: Kind::ClusterIP,
                scope: Scope::Cluster,
                external_traffic_local: false,
                source_ranges: None,
                local_backends: Vec::new(),
            }],
            cluster_ips: Vec::new(),
            stats: HashMap::new(),
            node_addresses: Vec::new(),
            lingering_addresses: Vec::new(),
            snat_ports: "0-0".into(),
            xdp_devices: Vec::new(),
            ct_timeouts: ListedCtTimeouts {
                tcp_established_s: 1,
                tcp_close_wait_s: 1,
                udp_s: 1,
                udp_stream_s: 1,
            },
            tc_programs: Vec::new(),
        };
        let text = render_text(&listing);
        assert!(
            !text
                .chars()
                .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
            "{text:?}"
        );
        assert!(!text.lines().any(|l| l.starts_with("forged")), "{text}");
        assert!(
            text.contains("evil\\u{1b}[2J\\u{1b}[31m/web\\nforged\\u{202e}:http"),
            "{text}"
        );
    }
}
