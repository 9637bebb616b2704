//! The packet datapath's topology, in network namespaces made here:
//!
//! ```text
//!  client  10.77.0.100 fd77::100 ─┐
//!  client2 10.77.0.101 fd77::101 ─┤  lan (a bridge: the node network)
//!  node 1  10.77.0.1   fd77::1   ─┤  eth0 (the agent's device in the tests and the demo)
//!  node 2  10.77.0.2   fd77::2   ─┘
//!  node 1 ── podh ── pod1 10.244.1.2 fd00:244:1::2   (a backend on node 1)
//!  node 2 ── podh ── pod2 10.244.2.2 fd00:244:2::2   (a backend on node 2)
//! ```
//!
//! The clients route 10.77.100.0/24 and fd77:100::/64 (ExternalIPs, LoadBalancer IPs) to node
//! 1, as a router or a cloud load balancer would; nothing else is routed anywhere, so no
//! packet leaves the namespaces. The nodes forward, and each routes the other's pod network
//! through it. Every namespace is deleted on drop.

use anyhow::Result;

use crate::netns::{veth_pair, NetNs};

pub const CLIENT: &str = "10.77.0.100";
pub const CLIENT2: &str = "10.77.0.101";
pub const CLIENT6: &str = "fd77::100";
pub const NODE1: &str = "10.77.0.1";
pub const NODE1_6: &str = "fd77::1";
pub const NODE2: &str = "10.77.0.2";
pub const POD1: &str = "10.244.1.2";
pub const POD1_6: &str = "fd00:244:1::2";
pub const POD2: &str = "10.244.2.2";
pub const POD2_6: &str = "fd00:244:2::2";

/// The second node network of [`Nodes::add_second_network`]: the client's, node 1's and node
/// 2's addresses on it, and the pods' second addresses, which the client reaches through it.
pub const CLIENT_B: &str = "10.78.0.100";
pub const NODE1_B: &str = "10.78.0.1";
pub const NODE2_B: &str = "10.78.0.2";
pub const POD1_B: &str = "10.245.1.2";
pub const POD2_B: &str = "10.245.2.2";

/// The namespaces, as fields so that a test can reach each; all are deleted on drop.
pub struct Nodes {
    pub lan: NetNs,
    pub client: NetNs,
    pub client2: NetNs,
    pub node1: NetNs,
    pub node2: NetNs,
    pub pod1: NetNs,
    pub pod2: NetNs,
}

impl Nodes {
    pub fn new() -> Result<Nodes> {
        // Prefixes `svc-c`/`svc-b` are the ones `sys::clean_stale` removes after a killed run.
        let nodes = Nodes {
            lan: NetNs::new("svc-b")?,
            client: NetNs::new("svc-c")?,
            client2: NetNs::new("svc-c")?,
            node1: NetNs::new("svc-b")?,
            node2: NetNs::new("svc-b")?,
            pod1: NetNs::new("svc-b")?,
            pod2: NetNs::new("svc-b")?,
        };
        let n = &nodes;
        n.lan.ip(["link", "add", "br0", "type", "bridge"])?;
        n.lan.ip(["link", "set", "br0", "up"])?;
        client_ns(&n.lan, "c1", &n.client, CLIENT, CLIENT6)?;
        client_ns(&n.lan, "c2", &n.client2, CLIENT2, "fd77::101")?;
        node(&n.lan, "n1", &n.node1, NODE1, NODE1_6, &n.pod1, 1)?;
        node(&n.lan, "n2", &n.node2, NODE2, "fd77::2", &n.pod2, 2)?;
        n.node1
            .ip(["route", "add", "10.244.2.0/24", "via", NODE2])?;
        n.node1
            .ip(["-6", "route", "add", "fd00:244:2::/64", "via", "fd77::2"])?;
        n.node2
            .ip(["route", "add", "10.244.1.0/24", "via", NODE1])?;
        n.node2
            .ip(["-6", "route", "add", "fd00:244:1::/64", "via", NODE1_6])?;
        Ok(nodes)
    }

    /// A second node network beside the lan, built like it (bridge `br1`; `eth1` in the
    /// client and both nodes, on 10.78.0.0/24), and a second address on each pod (10.245.1.2,
    /// 10.245.2.2) that the client reaches through node 1's `eth1` and that node 1 routes to
    /// node 2 over it; node 2 sends its pod's replies to the client back through node 1, on
    /// this network too. Traffic between the client's 10.78.0.100 and these addresses takes
    /// the hops the lan's takes, through devices no program is attached to (the agent is given
    /// `eth0` only): a baseline without svc, at the same moments as traffic through it. IPv4
    /// only.
    pub fn add_second_network(&self) -> Result<()> {
        self.lan.ip(["link", "add", "br1", "type", "bridge"])?;
        self.lan.ip(["link", "set", "br1", "up"])?;
        for (port, ns, addr) in [
            ("c1b", &self.client, CLIENT_B),
            ("n1b", &self.node1, NODE1_B),
            ("n2b", &self.node2, NODE2_B),
        ] {
            veth_pair(&self.lan, port, ns, "eth1")?;
            self.lan.ip(["link", "set", port, "master", "br1"])?;
            ns.add_addr("eth1", &format!("{addr}/24"))?;
        }
        for (node, pod, net) in [(&self.node1, &self.pod1, 1), (&self.node2, &self.pod2, 2)] {
            node.add_addr("podh", &format!("10.245.{net}.1/24"))?;
            pod.add_addr("eth0", &format!("10.245.{net}.2/24"))?;
        }
        self.client
            .ip(["route", "add", "10.245.0.0/16", "via", NODE1_B])?;
        self.node1
            .ip(["route", "add", "10.245.2.0/24", "via", NODE2_B])?;
        self.node2
            .ip(["route", "add", &format!("{CLIENT_B}/32"), "via", NODE1_B])?;
        // Node 1 forwards the client's packets to pod 2, and pod 2's replies, out of the
        // device they came in on: an ICMP redirect would teach the client and node 2 to skip
        // it. The kernel sends one unless both `all` and the device say no.
        for setting in [
            "net.ipv4.conf.all.send_redirects=0",
            "net.ipv4.conf.eth1.send_redirects=0",
        ] {
            self.node1.sysctl(setting)?;
        }
        Ok(())
    }
}

/// A node: its uplink `eth0` on the lan bridge, a pod behind `podh`, forwarding on.
fn node(
    lan: &NetNs,
    port: &str,
    node_ns: &NetNs,
    v4: &str,
    v6: &str,
    pod: &NetNs,
    pod_net: u8,
) -> Result<()> {
    veth_pair(lan, port, node_ns, "eth0")?;
    lan.ip(["link", "set", port, "master", "br0"])?;
    node_ns.add_addr("eth0", &format!("{v4}/24"))?;
    node_ns.add_addr("eth0", &format!("{v6}/64"))?;
    veth_pair(node_ns, "podh", pod, "eth0")?;
    node_ns.add_addr("podh", &format!("10.244.{pod_net}.1/24"))?;
    node_ns.add_addr("podh", &format!("fd00:244:{pod_net}::1/64"))?;
    pod.add_addr("eth0", &format!("10.244.{pod_net}.2/24"))?;
    pod.add_addr("eth0", &format!("fd00:244:{pod_net}::2/64"))?;
    pod.ip([
        "route",
        "add",
        "default",
        "via",
        &format!("10.244.{pod_net}.1"),
    ])?;
    pod.ip([
        "-6",
        "route",
        "add",
        "default",
        "via",
        &format!("fd00:244:{pod_net}::1"),
    ])?;
    node_ns.forward()
}

fn client_ns(lan: &NetNs, port: &str, ns: &NetNs, v4: &str, v6: &str) -> Result<()> {
    veth_pair(lan, port, ns, "eth0")?;
    lan.ip(["link", "set", port, "master", "br0"])?;
    ns.add_addr("eth0", &format!("{v4}/24"))?;
    ns.add_addr("eth0", &format!("{v6}/64"))?;
    // ExternalIPs and LoadBalancer IPs are routed to node 1 (a router's or a cloud load
    // balancer's job); nothing else is routed anywhere.
    ns.ip(["route", "add", "10.77.100.0/24", "via", NODE1])?;
    ns.ip(["-6", "route", "add", "fd77:100::/64", "via", NODE1_6])?;
    Ok(())
}
