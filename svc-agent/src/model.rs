//! The desired state: what the datapath should do, independent of where it came from
//! (manifest files, the Kubernetes API) and of how it is stored (BPF maps).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};

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

/// A service frontend: what a client connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Frontend {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.ip, self.port),
            self.protocol
        )
    }
}

/// One frontend as it should be programmed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DesiredFrontend {
    pub frontend: Frontend,
    /// "namespace/name" of the Service this frontend belongs to: the unit of incremental
    /// updates.
    pub owner: String,
    /// "namespace/name:portname" (":portname" omitted for an unnamed port): names the object
    /// in listings and errors.
    pub service: String,
    /// Usable backends, sorted and deduplicated. Empty means connections are refused.
    pub backends: Vec<SocketAddr>,
    /// sessionAffinity ClientIP timeout, when affinity is on.
    pub affinity_timeout_s: Option<u32>,
    /// internalTrafficPolicy: Local was applied to `backends`.
    pub internal_local: bool,
}

/// Everything the datapath should serve.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<Frontend, DesiredFrontend>,
    /// Every ClusterIP with at least one frontend: ports and protocols it does not define are
    /// refused.
    pub cluster_ips: BTreeSet<IpAddr>,
}
