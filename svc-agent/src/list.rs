//! `svc-agent list`: what the datapath will do, read from the pinned maps alone.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use serde::Serialize;
use svc_common::svc_flags;

use crate::error::Result;
use crate::store::BpfStore;
use crate::sync::{Programmed, DEFAULT_GRACE};

#[derive(Debug, Serialize)]
pub struct Listing {
    pub services: Vec<ListedFrontend>,
    /// ClusterIPs whose undefined ports are refused.
    pub cluster_ips: Vec<IpAddr>,
    /// Decisions of the socket programs since they were loaded, by reason.
    pub stats: HashMap<&'static str, u64>,
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
                .filter_map(|b| p.backends.get(b).map(|k| k.socket_addr()))
                .collect(),
            affinity_timeout_s: (f.flags & svc_flags::AFFINITY != 0)
                .then_some(f.affinity_timeout_s),
            internal_traffic_local: f.flags & svc_flags::INTERNAL_LOCAL != 0,
        })
        .collect();
    let stats = store.stats()?.into_iter().collect();
    Ok(Listing {
        services,
        cluster_ips: p.markers.iter().copied().collect(),
        stats,
    })
}

pub fn render_text(l: &Listing) -> String {
    let mut out = String::new();
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
        .map(|s| s.name.as_deref().unwrap_or("-").len())
        .max()
        .unwrap_or(0)
        .max("SERVICE".len());
    let _ = writeln!(
        out,
        "{:w$}  {:nw$}  {:9}  BACKENDS",
        "FRONTEND", "SERVICE", "AFFINITY"
    );
    for s in &l.services {
        let affinity = s
            .affinity_timeout_s
            .map(|t| format!("{t}s"))
            .unwrap_or_else(|| "-".into());
        let backends = if s.backends.is_empty() {
            "(none: connections refused)".to_string()
        } else {
            s.backends
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "{:w$}  {:nw$}  {:9}  {}",
            s.frontend,
            s.name.as_deref().unwrap_or("-"),
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
    out
}
