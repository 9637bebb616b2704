//! The node as the agent sees it: its devices and addresses (read over rtnetlink), what the
//! packet datapath makes of them (`packet::view`: the devices the tc programs go on,
//! SVC_NODE_ADDRS, where health check ports listen), the Node's addresses and zone from the
//! source, and the node's desired state in the maps. It reads the kernel and says what
//! changed; the agent writes the maps and attaches.

mod egress;

use std::collections::BTreeSet;
use std::net::IpAddr;

use tracing::info;

use crate::metrics::Metrics;
use crate::model::NodeDesired;
use crate::netdev::Device;
use crate::packet::{NodeView, PacketConfig};
use crate::tasks::health::Bind;
use crate::translate::NodeContext;

pub struct Node {
    /// What translation needs to know of this node.
    context: NodeContext,
    /// The packet datapath's settings, and the node as it last saw it.
    packet: PacketConfig,
    view: NodeView,
    /// The Node's addresses (kube-proxy's node IPs), with the Kubernetes API; None with
    /// manifests (the devices say).
    api_ips: Option<Vec<IpAddr>>,
    /// What the maps should hold of the node: its addresses and the datapath settings.
    desired: NodeDesired,
    /// Devices without svc's programs that SNATed flows were found leaving by, warned about
    /// once each in this run (`check_unmanaged_egress`).
    unmanaged_warned: BTreeSet<String>,
}

/// What a `Node::refresh` found changed.
#[derive(Debug, Default)]
pub struct Changed {
    /// The devices the tc programs go on, external and pods', when they changed.
    pub devices: Option<(Vec<Device>, Vec<Device>)>,
    /// Where the health check ports listen, when it changed.
    pub health_binds: Option<BTreeSet<Bind>>,
    /// The node's primary addresses changed: the Services must be translated again
    /// (loadBalancerSourceRanges admit the node by them).
    pub primary: bool,
}

impl Node {
    /// A node with no device or address read yet: health check ports listen only on the
    /// wildcard address of a family `--nodeport-addresses` chooses whole, until the
    /// addresses are read.
    pub fn new(context: NodeContext, packet: PacketConfig) -> Node {
        let view = crate::packet::view(&packet, &crate::netdev::NetState::default(), None);
        let desired = NodeDesired {
            addrs: Default::default(),
            config: Some(packet.datapath_config()),
        };
        Node {
            context,
            packet,
            view,
            api_ips: None,
            desired,
            unmanaged_warned: BTreeSet::new(),
        }
    }

    /// Reads the node's devices and addresses again. None when nothing of the view changed
    /// (or they could not be read, reported); else what changed, the desired node state
    /// brought to it.
    pub fn refresh(&mut self, metrics: &Metrics) -> Option<Changed> {
        let state = match crate::netdev::read() {
            Ok(s) => s,
            Err(e) => {
                metrics.report_as("netlink", "reading the node's devices and addresses", &e);
                return None;
            }
        };
        let view = crate::packet::view(&self.packet, &state, self.api_ips.as_deref());
        if view == self.view {
            return None;
        }
        let mut changed = Changed::default();
        if view.external != self.view.external || view.pods != self.view.pods {
            let names = |d: &[Device]| {
                d.iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            info!(
                external = %names(&view.external),
                pods = %names(&view.pods),
                primary = ?view.primary,
                "packet datapath devices"
            );
            changed.devices = Some((view.external.clone(), view.pods.clone()));
        }
        self.desired.addrs = view.addrs.clone();
        if view.health_checks != self.view.health_checks {
            let binds: Vec<String> = view.health_checks.iter().map(|b| b.to_string()).collect();
            info!(addresses = %binds.join(","), "health check node ports listen");
            changed.health_binds = Some(view.health_checks.clone());
        }
        changed.primary = view.primary != self.context.node_ips;
        self.context.node_ips = view.primary.clone();
        self.view = view;
        Some(changed)
    }

    /// The Node's addresses (Kubernetes API): kube-proxy's node IPs. Returns whether they
    /// changed (then the view must be refreshed).
    pub fn set_api_ips(&mut self, ips: Vec<IpAddr>) -> bool {
        if self.api_ips.as_ref() == Some(&ips) {
            return false;
        }
        info!(node_ips = ?ips, "the Node's addresses");
        self.api_ips = Some(ips);
        true
    }

    /// What translation needs to know of this node: its name, zone and primary addresses.
    pub fn context(&self) -> &NodeContext {
        &self.context
    }

    /// The node's topology zone, as the source states it.
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.context.zone = zone;
    }

    /// What the maps should hold of the node.
    pub fn desired(&self) -> &NodeDesired {
        &self.desired
    }

    /// Where the health check ports listen now.
    pub fn health_binds(&self) -> &BTreeSet<Bind> {
        &self.view.health_checks
    }

    pub fn packet(&self) -> &PacketConfig {
        &self.packet
    }
}
