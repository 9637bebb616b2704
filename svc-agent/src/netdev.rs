//! The node's network devices and addresses, as the packet datapath needs them: which devices
//! carry external traffic (`--devices`), which carry pods whose packets get per-packet
//! ClusterIP translation (`--packet-lb-devices`), and which addresses NodePorts answer on
//! (`--nodeport-addresses`) and SNATed flows leave from.
//!
//! Read from the kernel with rtnetlink dumps (links, addresses, routes) of the agent's own
//! network namespace, and followed: a thread listens to the kernel's link, address and route
//! notifications and wakes the agent, which reads everything again (a few dumps: cheap, and
//! never out of step the way applying deltas can be).
//!
//! The choice itself is a pure function of what was read ([`select`], [`node_addrs`]), so it
//! is tested without any device, and the same function runs in a test's network namespace.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::address::{
    AddressAttribute, AddressHeaderFlags, AddressMessage, AddressScope,
};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{RouteAttribute, RouteMessage};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use serde::Serialize;
use svc_common::{node_addr_flags, NodeAddrValue};

use crate::model::Cidr;

/// A network device of the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub up: bool,
    pub loopback: bool,
    /// Enslaved to a bridge or bond (IFLA_MASTER).
    pub enslaved: bool,
    /// IFLA_INFO_KIND: "veth", "bridge", "bond", ...; None for physical devices.
    pub kind: Option<String>,
}

/// An address of one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Addr {
    pub index: u32,
    pub ip: IpAddr,
    pub prefix: u8,
    /// Scope universe (not link-local, not host).
    pub global: bool,
    /// IPv6 duplicate address detection is not over (or failed): nothing can bind it yet.
    pub tentative: bool,
}

/// What the kernel says about the agent's network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NetState {
    pub links: Vec<Link>,
    pub addrs: Vec<Addr>,
    /// Devices of default routes (main table), IPv4 and IPv6.
    pub default_route_devices: BTreeSet<u32>,
}

/// `--devices`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// Cilium's and kube-proxy's choice: the devices that carry the node's addresses or the
    /// default route.
    Auto,
    /// No external device: the packet datapath is off (the socket path serves as before).
    None,
    /// Names, or patterns: `*` and `?` as in a shell, and a trailing `+` as Cilium's
    /// (`eth+`: every name starting with `eth`).
    Patterns(Vec<String>),
}

impl DeviceSpec {
    /// From the flag's values: empty is `Auto`, `none` is `None`.
    pub fn parse(values: &[String]) -> DeviceSpec {
        let values: Vec<String> = values
            .iter()
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect();
        match values.as_slice() {
            [] => DeviceSpec::Auto,
            [one] if one == "none" => DeviceSpec::None,
            _ => DeviceSpec::Patterns(values),
        }
    }
}

/// `--nodeport-addresses`, as kube-proxy reads it: CIDRs and the keywords `primary` (the node's
/// primary address of each family, unless it is loopback), `all` (0.0.0.0/0 and ::/0) and
/// `localhost` (127.0.0.0/8 and ::1/128; only IPv4 loopback answers, and only the node's own
/// sockets, see `node_addrs`), in any mix. A
/// family that ends up with no CIDR at all has every address chosen, as kube-proxy's
/// NewNodePortAddresses gives it the zero CIDR: `10.0.0.0/8` alone leaves IPv6 NodePorts on
/// every IPv6 address, and `primary` on a node without an IPv6 node IP does the same.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePortAddresses {
    pub primary: bool,
    pub cidrs: Vec<Cidr>,
}

impl NodePortAddresses {
    /// kube-proxy's default in nftables mode, and svc's.
    pub fn primary() -> NodePortAddresses {
        NodePortAddresses {
            primary: true,
            cidrs: Vec::new(),
        }
    }

    pub fn parse(values: &[String]) -> Result<NodePortAddresses, String> {
        let mut out = NodePortAddresses::default();
        let mut cidrs = |list: &[&str]| -> Result<(), String> {
            for c in list {
                out.cidrs.push(c.parse::<Cidr>()?);
            }
            Ok(())
        };
        let mut primary = false;
        for v in values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()) {
            match v {
                "primary" => primary = true,
                "all" => cidrs(&["0.0.0.0/0", "::/0"])?,
                "localhost" => cidrs(&["127.0.0.0/8", "::1/128"])?,
                v => cidrs(&[v])?,
            }
        }
        out.primary = primary || out.cidrs.is_empty();
        Ok(out)
    }

    /// The CIDRs of family `v6`, `primary` (the node's primary addresses) resolved; `None`:
    /// every address of the family.
    fn of_family(&self, v6: bool, primary: &[IpAddr]) -> Option<Vec<Cidr>> {
        let mut out: Vec<Cidr> = self
            .cidrs
            .iter()
            .filter(|c| c.addr.is_ipv6() == v6)
            .copied()
            .collect();
        if self.primary {
            for ip in primary.iter().map(|ip| ip.to_canonical()) {
                if ip.is_ipv6() == v6 && !ip.is_loopback() {
                    out.push(Cidr {
                        addr: ip,
                        prefix: if v6 { 128 } else { 32 },
                    });
                }
            }
        }
        if out.is_empty() || out.iter().any(|c| c.prefix == 0) {
            return None;
        }
        Some(out)
    }

    /// Whether `ip` is one the flag names (loopback included: what kube-proxy's GetNodeIPs
    /// returns for its health check servers), `primary` resolved.
    pub fn covers(&self, ip: IpAddr, primary: &[IpAddr]) -> bool {
        let ip = ip.to_canonical();
        match self.of_family(ip.is_ipv6(), primary) {
            None => true,
            Some(cidrs) => cidrs.iter().any(|c| c.contains(ip)),
        }
    }

    /// Whether every IPv4 address is chosen whatever the node's primary addresses: a /0, or
    /// no IPv4 CIDR and no `primary`. (`primary` on a node without an IPv4 primary address
    /// chooses every IPv4 address too, which only the node's addresses tell.)
    pub fn covers_all_v4_statically(&self) -> bool {
        let v4: Vec<&Cidr> = self.cidrs.iter().filter(|c| c.addr.is_ipv4()).collect();
        v4.iter().any(|c| c.prefix == 0) || (v4.is_empty() && !self.primary)
    }

    /// Whether every address of the family is chosen: kube-proxy's MatchAll, where its health
    /// check servers listen on the wildcard address.
    pub fn matches_all(&self, v6: bool, primary: &[IpAddr]) -> bool {
        self.of_family(v6, primary).is_none()
    }
}

/// A chosen device.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Device {
    pub index: u32,
    pub name: String,
}

/// Names Cilium never picks by itself: its own and container runtimes' devices.
const EXCLUDED_PREFIXES: [&str; 6] = ["lo", "lxc", "cni", "docker", "cilium_", "svc"];

/// Whether `name` matches `pattern` (`*`, `?`, or a trailing `+`).
pub fn matches(pattern: &str, name: &str) -> bool {
    if let Some(prefix) = pattern.strip_suffix('+') {
        return name.starts_with(prefix);
    }
    fn glob(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => glob(&p[1..], n) || (!n.is_empty() && glob(p, &n[1..])),
            (Some(b'?'), Some(_)) => glob(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => glob(&p[1..], &n[1..]),
            _ => false,
        }
    }
    glob(pattern.as_bytes(), name.as_bytes())
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

/// The external devices `spec` names in `state`. `node_ips`: the node's own addresses (its
/// Node object's, when known), which make the device that carries them a node device whatever
/// its kind. The automatic choice follows Cilium's device detection: up, not loopback, not
/// enslaved to a bridge or bond, not one of the container devices, and carrying a global
/// unicast address; veth and bridge devices only when they carry the default route or a node
/// address (a node in a VM or a kind cluster has its address on a veth).
pub fn select(spec: &DeviceSpec, state: &NetState, node_ips: &[IpAddr]) -> Vec<Device> {
    let carries = |l: &Link, pred: &dyn Fn(&Addr) -> bool| {
        state.addrs.iter().any(|a| a.index == l.index && pred(a))
    };
    let mut out: Vec<Device> = state
        .links
        .iter()
        .filter(|l| !l.loopback)
        .filter(|l| match spec {
            DeviceSpec::None => false,
            DeviceSpec::Patterns(p) => p.iter().any(|p| matches(p, &l.name)),
            DeviceSpec::Auto => {
                let routed = state.default_route_devices.contains(&l.index)
                    || carries(l, &|a| node_ips.contains(&a.ip));
                let virtual_kind =
                    matches!(l.kind.as_deref(), Some("veth" | "bridge" | "openvswitch"));
                l.up && !l.enslaved
                    && !EXCLUDED_PREFIXES.iter().any(|p| l.name.starts_with(p))
                    && carries(l, &|a| a.global && !is_link_local(a.ip))
                    && (routed || !virtual_kind)
            }
        })
        .map(|l| Device {
            index: l.index,
            name: l.name.clone(),
        })
        .collect();
    out.sort();
    out
}

/// Devices named by `patterns` (`--packet-lb-devices`): the host side of pod devices.
pub fn select_pod_devices(patterns: &[String], state: &NetState) -> Vec<Device> {
    let mut out: Vec<Device> = state
        .links
        .iter()
        .filter(|l| !l.loopback && patterns.iter().any(|p| matches(p, &l.name)))
        .map(|l| Device {
            index: l.index,
            name: l.name.clone(),
        })
        .collect();
    out.sort();
    out
}

/// The node's primary address of each family as the devices show it (for manifests, where no
/// Node object says): on the device of that family's default route if it has one, else on the
/// first chosen device that has one; never loopback or link-local.
pub fn primary_ips(state: &NetState, devices: &[Device]) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for v4 in [true, false] {
        let usable = |a: &&Addr| {
            a.ip.is_ipv4() == v4 && a.global && !a.ip.is_loopback() && !is_link_local(a.ip)
        };
        let on = |index: u32| state.addrs.iter().filter(usable).find(|a| a.index == index);
        let routed = devices
            .iter()
            .filter(|d| state.default_route_devices.contains(&d.index))
            .find_map(|d| on(d.index));
        if let Some(a) = routed.or_else(|| devices.iter().find_map(|d| on(d.index))) {
            out.push(a.ip);
        }
    }
    out
}

/// SVC_NODE_ADDRS: the addresses NodePorts answer on (`nodeport`), and those of the external
/// devices, usable as the source of SNATed flows. `primary`: the node's primary addresses
/// (for `--nodeport-addresses primary`). Loopback never answers NodePorts from a device; with
/// `localhost` (kube-proxy's --iptables-localhost-nodeports) the IPv4 loopback addresses
/// `nodeport` covers answer them for the node's own sockets (`LOCALHOST`), as in kube-proxy's
/// iptables mode. IPv6 loopback never does, as in kube-proxy.
pub fn node_addrs(
    state: &NetState,
    devices: &[Device],
    nodeport: &NodePortAddresses,
    primary: &[IpAddr],
    localhost: bool,
) -> BTreeMap<IpAddr, NodeAddrValue> {
    let mut out: BTreeMap<IpAddr, NodeAddrValue> = BTreeMap::new();
    let device_of = |ip: IpAddr| {
        state
            .addrs
            .iter()
            .find(|a| a.ip == ip)
            .map_or(0, |a| a.index)
    };
    let mut add = |ip: IpAddr, flag: u32, index: u32| {
        let e = out.entry(ip.to_canonical()).or_default();
        e.flags |= flag;
        if e.ifindex == 0 {
            e.ifindex = index;
        }
    };
    if nodeport.primary {
        // A primary address from the Node object need not be on a device this node shows.
        for ip in primary.iter().filter(|ip| !ip.is_loopback()) {
            add(*ip, node_addr_flags::NODEPORT, device_of(*ip));
        }
    }
    for a in &state.addrs {
        let chosen = nodeport.covers(a.ip, primary);
        if chosen && !a.ip.is_loopback() {
            add(a.ip, node_addr_flags::NODEPORT, a.index);
        } else if chosen && localhost && a.ip.is_ipv4() {
            add(a.ip, node_addr_flags::LOCALHOST, a.index);
        }
    }
    for a in &state.addrs {
        let usable = a.global && !a.ip.is_loopback() && !is_link_local(a.ip);
        if usable && devices.iter().any(|d| d.index == a.index) {
            add(a.ip, node_addr_flags::SNAT, a.index);
        }
    }
    out
}

/// The name of device `ifindex` in this network namespace, if it exists.
pub fn ifname(ifindex: u32) -> Option<String> {
    let mut buf = [0u8; libc::IF_NAMESIZE];
    // SAFETY: buf has the IF_NAMESIZE bytes if_indextoname writes at most.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr().cast()) };
    if p.is_null() {
        return None;
    }
    let len = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// `NETDEV_XDP_ACT_NDO_XMIT` (uapi linux/netdev.h): the device's driver transmits XDP frames
/// redirected to it from another device (`ndo_xdp_xmit`); without it the kernel drops them.
pub const XDP_ACT_NDO_XMIT: u64 = 1 << 2;

/// The `xdp-features` of device `ifindex` (`NETDEV_XDP_ACT_*` bits), from the kernel's netdev
/// generic netlink family (6.3+): what `ynl --family netdev --do dev-get` prints. A veth's
/// change with its peer (an XDP program or GRO there gives it `NDO_XMIT`).
pub fn xdp_features(ifindex: u32) -> std::io::Result<u64> {
    use netlink_sys::protocols::NETLINK_GENERIC;
    const GENL_ID_CTRL: u16 = 0x10;
    const CTRL_CMD_GETFAMILY: u8 = 3;
    const CTRL_ATTR_FAMILY_ID: u16 = 1;
    const CTRL_ATTR_FAMILY_NAME: u16 = 2;
    const NETDEV_CMD_DEV_GET: u8 = 1;
    const NETDEV_A_DEV_IFINDEX: u16 = 1;
    const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
    const NLMSG_ERROR: u16 = 2;

    let mut socket = Socket::new(NETLINK_GENERIC)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    // One request (a genl header and one attribute), its answer's attributes.
    let ask =
        |family: u16, cmd: u8, attr: u16, data: &[u8]| -> std::io::Result<Vec<(u16, Vec<u8>)>> {
            let alen = 4 + data.len();
            let padded = alen.div_ceil(4) * 4;
            let len = 16 + 4 + padded;
            let mut buf = Vec::with_capacity(len);
            buf.extend_from_slice(&(len as u32).to_ne_bytes());
            buf.extend_from_slice(&family.to_ne_bytes());
            buf.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
            buf.extend_from_slice(&1u32.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
            buf.extend_from_slice(&[cmd, 1, 0, 0]);
            buf.extend_from_slice(&(alen as u16).to_ne_bytes());
            buf.extend_from_slice(&attr.to_ne_bytes());
            buf.extend_from_slice(data);
            buf.resize(len, 0);
            socket.send(&buf, 0)?;
            let mut rx = vec![0u8; 1 << 13];
            let n = socket.recv(&mut &mut rx[..], 0)?;
            let rx = &rx[..n];
            if n < 20 {
                return Err(netlink_err("genl", "a short answer"));
            }
            if u16::from_ne_bytes([rx[4], rx[5]]) == NLMSG_ERROR {
                let code = i32::from_ne_bytes([rx[16], rx[17], rx[18], rx[19]]);
                return Err(std::io::Error::from_raw_os_error(code.unsigned_abs() as i32));
            }
            let end = (u32::from_ne_bytes([rx[0], rx[1], rx[2], rx[3]]) as usize).min(n);
            let mut attrs = Vec::new();
            let mut i = 20;
            while i + 4 <= end {
                let l = u16::from_ne_bytes([rx[i], rx[i + 1]]) as usize;
                let t = u16::from_ne_bytes([rx[i + 2], rx[i + 3]]) & 0x3fff;
                if l < 4 || i + l > end {
                    break;
                }
                attrs.push((t, rx[i + 4..i + l].to_vec()));
                i += l.div_ceil(4) * 4;
            }
            Ok(attrs)
        };
    let family = ask(
        GENL_ID_CTRL,
        CTRL_CMD_GETFAMILY,
        CTRL_ATTR_FAMILY_NAME,
        b"netdev\0",
    )
    .map_err(|e| netlink_err("the netdev family (kernel 6.3+)", e))?
    .into_iter()
    .find_map(|(t, v)| {
        (t == CTRL_ATTR_FAMILY_ID && v.len() >= 2).then(|| u16::from_ne_bytes([v[0], v[1]]))
    })
    .ok_or_else(|| netlink_err("the netdev family", "no id in the answer"))?;
    ask(
        family,
        NETDEV_CMD_DEV_GET,
        NETDEV_A_DEV_IFINDEX,
        &ifindex.to_ne_bytes(),
    )
    .map_err(|e| netlink_err(&format!("netdev dev-get of device {ifindex}"), e))?
    .into_iter()
    .find_map(|(t, v)| {
        if t != NETDEV_A_DEV_XDP_FEATURES {
            return None;
        }
        <[u8; 8]>::try_from(v.as_slice())
            .ok()
            .map(u64::from_ne_bytes)
    })
    .ok_or_else(|| netlink_err("netdev dev-get", "no xdp-features in the answer"))
}

fn netlink_err(what: &str, e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("netlink {what}: {e}"))
}

/// One rtnetlink dump.
pub(crate) fn dump(
    socket: &Socket,
    request: RouteNetlinkMessage,
) -> std::io::Result<Vec<RouteNetlinkMessage>> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(request));
    packet.finalize();
    let mut buf = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut buf[..]);
    socket.send(&buf, 0)?;
    let mut out = Vec::new();
    let mut rx = vec![0u8; 1 << 16];
    loop {
        let size = socket.recv(&mut &mut rx[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let msg = <NetlinkMessage<RouteNetlinkMessage>>::deserialize(&rx[offset..size])
                .map_err(|e| netlink_err("reply", e))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(out),
                NetlinkPayload::Error(e) => return Err(netlink_err("dump", format!("{e:?}"))),
                NetlinkPayload::InnerMessage(m) => out.push(m),
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += len;
        }
    }
}

/// Asks the kernel which device it routes an address through (RTM_GETROUTE, as `ip route
/// get ADDR` does), on one netlink socket of the calling thread's network namespace.
pub struct RouteQuery {
    socket: Socket,
}

impl RouteQuery {
    pub fn new() -> std::io::Result<RouteQuery> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(RouteQuery { socket })
    }

    /// The device the route to `ip` leaves by; None when the node has no route to it, or
    /// holds it itself (a local route: nothing leaves a device).
    pub fn device(&self, ip: IpAddr) -> std::io::Result<Option<u32>> {
        use netlink_packet_route::route::{RouteAddress, RouteType};
        use netlink_packet_route::AddressFamily;
        let mut msg = RouteMessage::default();
        (
            msg.header.address_family,
            msg.header.destination_prefix_length,
        ) = match ip {
            IpAddr::V4(_) => (AddressFamily::Inet, 32),
            IpAddr::V6(_) => (AddressFamily::Inet6, 128),
        };
        msg.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(ip)));
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST;
        let mut packet = NetlinkMessage::new(
            header,
            NetlinkPayload::from(RouteNetlinkMessage::GetRoute(msg)),
        );
        packet.finalize();
        let mut buf = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut buf[..]);
        self.socket.send(&buf, 0)?;
        let mut rx = vec![0u8; 1 << 13];
        let size = self.socket.recv(&mut &mut rx[..], 0)?;
        let msg = <NetlinkMessage<RouteNetlinkMessage>>::deserialize(&rx[..size])
            .map_err(|e| netlink_err("reply", e))?;
        match msg.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(r)) => {
                if r.header.kind == RouteType::Local {
                    return Ok(None);
                }
                Ok(r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                }))
            }
            NetlinkPayload::Error(e) => match e.raw_code().abs() {
                libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EINVAL => Ok(None),
                _ => Err(netlink_err("route get", e.to_io())),
            },
            other => Err(netlink_err("route get", format!("unexpected {other:?}"))),
        }
    }
}

/// The flows per device of `flows` (per destination address) whose route (`route`) leaves
/// by a device that is not one of `managed`: their replies come back on that device, where
/// no program of svc translates them. `route` is asked once per address.
pub fn unmanaged_devices(
    flows: &BTreeMap<IpAddr, u64>,
    managed: &[Device],
    mut route: impl FnMut(IpAddr) -> Option<u32>,
) -> BTreeMap<u32, u64> {
    let mut out = BTreeMap::new();
    for (ip, n) in flows {
        let Some(dev) = route(*ip) else {
            continue;
        };
        if !managed.iter().any(|d| d.index == dev) {
            *out.entry(dev).or_default() += n;
        }
    }
    out
}

/// Reads links, addresses and default routes of the calling thread's network namespace.
pub fn read() -> std::io::Result<NetState> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut state = NetState::default();
    for m in dump(
        &socket,
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
    )? {
        if let RouteNetlinkMessage::NewLink(l) = m {
            state.links.push(link(&l));
        }
    }
    for m in dump(
        &socket,
        RouteNetlinkMessage::GetAddress(AddressMessage::default()),
    )? {
        if let RouteNetlinkMessage::NewAddress(a) = m {
            if let Some(a) = addr(&a) {
                state.addrs.push(a);
            }
        }
    }
    for m in dump(
        &socket,
        RouteNetlinkMessage::GetRoute(RouteMessage::default()),
    )? {
        if let RouteNetlinkMessage::NewRoute(r) = m {
            const RT_TABLE_MAIN: u8 = 254;
            let main = r.header.table == RT_TABLE_MAIN
                || r.attributes
                    .contains(&RouteAttribute::Table(u32::from(RT_TABLE_MAIN)));
            let default = r.header.destination_prefix_length == 0;
            if main && default {
                for a in &r.attributes {
                    if let RouteAttribute::Oif(index) = a {
                        state.default_route_devices.insert(*index);
                    }
                }
            }
        }
    }
    state.links.sort_by_key(|l| l.index);
    Ok(state)
}

fn link(l: &LinkMessage) -> Link {
    let mut out = Link {
        index: l.header.index,
        name: String::new(),
        up: l.header.flags.contains(LinkFlags::Up),
        loopback: l.header.flags.contains(LinkFlags::Loopback),
        enslaved: false,
        kind: None,
    };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => out.name = n.clone(),
            LinkAttribute::Controller(m) => out.enslaved = *m != 0,
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        out.kind = Some(kind_name(k));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

fn kind_name(k: &InfoKind) -> String {
    match k {
        InfoKind::Veth => "veth".into(),
        InfoKind::Bridge => "bridge".into(),
        InfoKind::Bond => "bond".into(),
        InfoKind::Dummy => "dummy".into(),
        InfoKind::Vlan => "vlan".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

fn addr(a: &AddressMessage) -> Option<Addr> {
    // IFA_LOCAL is the address of a point-to-point link; IFA_ADDRESS otherwise.
    let local = a.attributes.iter().find_map(|x| match x {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let address = a.attributes.iter().find_map(|x| match x {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    });
    let ip = local.or(address)?;
    Some(Addr {
        index: a.header.index,
        ip: ip.to_canonical(),
        prefix: a.header.prefix_len,
        global: a.header.scope == AddressScope::Universe,
        tentative: a.header.flags.contains(AddressHeaderFlags::Tentative),
    })
}

/// rtnetlink multicast groups: links, IPv4 and IPv6 addresses and routes.
const GROUPS: u32 = 0x1 | 0x10 | 0x40 | 0x100 | 0x400;

/// Starts a thread that calls `changed` whenever the kernel reports a link, address or route
/// change in this network namespace (and once a read of the socket fails, so the caller
/// rereads). It ends when `changed` returns false.
pub fn watch(changed: impl Fn() -> bool + Send + 'static) -> std::io::Result<()> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind(&SocketAddr::new(0, GROUPS))?;
    std::thread::Builder::new()
        .name("svc-netlink".into())
        .spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                // ENOBUFS (events lost) is a change too: everything is read again anyway.
                let _ = socket.recv(&mut &mut buf[..], 0);
                if !changed() {
                    return;
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(index: u32, name: &str, kind: Option<&str>) -> Link {
        Link {
            index,
            name: name.into(),
            up: true,
            loopback: name == "lo",
            enslaved: false,
            kind: kind.map(str::to_string),
        }
    }

    fn a(index: u32, ip: &str) -> Addr {
        let ip: IpAddr = ip.parse().unwrap();
        Addr {
            index,
            ip,
            prefix: 24,
            global: !ip.is_loopback() && !is_link_local(ip),
            tentative: false,
        }
    }

    /// lo; eth0 (default route, 192.168.1.10, 2001:db8::10); eth1 (storage, 10.10.0.5);
    /// br0 (bridge, 172.17.0.1); veth pair of a pod; eth2 (down); bond slave eth3; docker0.
    fn node() -> NetState {
        let mut s = NetState {
            links: vec![
                l(1, "lo", None),
                l(2, "eth0", None),
                l(3, "eth1", None),
                l(4, "br0", Some("bridge")),
                l(5, "vethab12", Some("veth")),
                l(6, "eth2", None),
                l(7, "eth3", None),
                l(8, "docker0", Some("bridge")),
            ],
            addrs: vec![
                a(1, "127.0.0.1"),
                a(1, "::1"),
                a(2, "192.168.1.10"),
                a(2, "2001:db8::10"),
                a(2, "fe80::1"),
                a(3, "10.10.0.5"),
                a(4, "172.17.0.1"),
                a(5, "fe80::2"),
                a(6, "10.20.0.5"),
                a(7, "10.30.0.5"),
                a(8, "172.18.0.1"),
            ],
            default_route_devices: [2].into(),
        };
        s.links[5].up = false;
        s.links[6].enslaved = true;
        s
    }

    fn names(d: &[Device]) -> Vec<&str> {
        d.iter().map(|d| d.name.as_str()).collect()
    }

    #[test]
    fn the_default_choice_is_the_devices_with_global_addresses_as_cilium_picks_them() {
        let s = node();
        assert_eq!(names(&select(&DeviceSpec::Auto, &s, &[])), ["eth0", "eth1"]);
        // A node whose address sits on a veth (a VM, a kind node) with the default route.
        let mut s = node();
        s.addrs.push(a(5, "10.89.0.2"));
        s.default_route_devices = [5].into();
        assert_eq!(
            names(&select(&DeviceSpec::Auto, &s, &[])),
            ["eth0", "eth1", "vethab12"]
        );
        // Or its Node object names an address on a bridge (a container runtime's never).
        let s = node();
        let ips = ["172.17.0.1".parse().unwrap(), "172.18.0.1".parse().unwrap()];
        assert_eq!(
            names(&select(&DeviceSpec::Auto, &s, &ips)),
            ["eth0", "eth1", "br0"]
        );
    }

    #[test]
    fn patterns_name_devices_explicitly_and_none_turns_the_packet_path_off() {
        let s = node();
        let spec = DeviceSpec::parse(&["eth+".into()]);
        assert_eq!(
            names(&select(&spec, &s, &[])),
            ["eth0", "eth1", "eth2", "eth3"]
        );
        let spec = DeviceSpec::parse(&["veth*".into(), "eth1".into()]);
        assert_eq!(names(&select(&spec, &s, &[])), ["eth1", "vethab12"]);
        assert_eq!(DeviceSpec::parse(&["none".into()]), DeviceSpec::None);
        assert!(select(&DeviceSpec::None, &s, &[]).is_empty());
        assert_eq!(DeviceSpec::parse(&[" ".into()]), DeviceSpec::Auto);
        // Loopback never, even by name.
        assert!(select(&DeviceSpec::parse(&["lo".into()]), &s, &[]).is_empty());
        assert!(matches("eth?", "eth1") && !matches("eth?", "eth10"));
    }

    #[test]
    fn primary_addresses_come_from_the_default_route_device() {
        let s = node();
        let d = select(&DeviceSpec::Auto, &s, &[]);
        let p = primary_ips(&s, &d);
        assert_eq!(
            p,
            [
                "192.168.1.10".parse::<IpAddr>().unwrap(),
                "2001:db8::10".parse().unwrap()
            ]
        );
    }

    #[test]
    fn node_port_addresses_follow_kube_proxys_flag_and_loopback_only_for_the_nodes_sockets() {
        let s = node();
        let d = select(&DeviceSpec::Auto, &s, &[]);
        let p = primary_ips(&s, &d);
        let got = node_addrs(&s, &d, &NodePortAddresses::primary(), &p, true);
        let flagged = |m: &BTreeMap<IpAddr, NodeAddrValue>, flag: u32| -> Vec<String> {
            m.iter()
                .filter(|(_, v)| v.flags & flag != 0)
                .map(|(ip, _)| ip.to_string())
                .collect()
        };
        let np = |m: &BTreeMap<IpAddr, NodeAddrValue>| flagged(m, node_addr_flags::NODEPORT);
        assert_eq!(np(&got), ["192.168.1.10", "2001:db8::10"]);
        let snat: Vec<String> = got
            .iter()
            .filter(|(_, v)| v.flags & node_addr_flags::SNAT != 0)
            .map(|(ip, v)| format!("{ip}@{}", v.ifindex))
            .collect();
        assert_eq!(snat, ["10.10.0.5@3", "192.168.1.10@2", "2001:db8::10@2"]);

        let all = NodePortAddresses::parse(&["0.0.0.0/0".into(), "::/0".into()]).unwrap();
        let got = node_addrs(&s, &d, &all, &p, true);
        assert!(!np(&got).iter().any(|ip| ip == "127.0.0.1" || ip == "::1"));
        assert!(np(&got).contains(&"172.17.0.1".to_string()));
        let parse = |v: &[&str]| {
            NodePortAddresses::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
        };
        let v6: Vec<String> = s
            .addrs
            .iter()
            .filter(|a| a.ip.is_ipv6() && !a.ip.is_loopback())
            .map(|a| a.ip.to_string())
            .collect();
        assert!(!v6.is_empty());
        // A family no CIDR names has all its addresses chosen, as kube-proxy's zero CIDR.
        let some = np(&node_addrs(&s, &d, &parse(&["10.0.0.0/8"]), &p, true));
        let v4: Vec<&String> = some.iter().filter(|ip| !ip.contains(':')).collect();
        assert_eq!(v4, ["10.10.0.5", "10.20.0.5", "10.30.0.5"]);
        assert!(v6.iter().all(|ip| some.contains(ip)), "{some:?}");
        let some = np(&node_addrs(
            &s,
            &d,
            &parse(&["10.0.0.0/8", "fd00::/8"]),
            &p,
            true,
        ));
        assert_eq!(some, ["10.10.0.5", "10.20.0.5", "10.30.0.5"]);
        // Keywords, and keywords with CIDRs, as kube-proxy takes them.
        assert_eq!(parse(&["primary"]), NodePortAddresses::primary());
        assert_eq!(parse(&[]), NodePortAddresses::primary());
        let mixed = np(&node_addrs(
            &s,
            &d,
            &parse(&["primary", "10.20.0.0/16"]),
            &p,
            true,
        ));
        assert_eq!(mixed, ["10.20.0.5", "192.168.1.10", "2001:db8::10"]);
        assert_eq!(
            np(&node_addrs(&s, &d, &parse(&["all"]), &p, true)),
            np(&node_addrs(&s, &d, &all, &p, true))
        );
        // Loopback never answers from a device, named or not; IPv4 loopback answers the
        // node's own sockets when chosen (kube-proxy's iptables localhost NodePorts), IPv6
        // loopback never, and not with `--localhost-nodeports=false`.
        let lh = |m: &BTreeMap<IpAddr, NodeAddrValue>| -> Vec<String> {
            // Loopback is never a NodePort or SNAT address: LOCALHOST alone.
            assert!(m
                .iter()
                .all(|(ip, v)| !ip.is_loopback() || v.flags == node_addr_flags::LOCALHOST));
            flagged(m, node_addr_flags::LOCALHOST)
        };
        let got = node_addrs(&s, &d, &parse(&["localhost"]), &p, true);
        assert!(np(&got).is_empty());
        assert_eq!(lh(&got), ["127.0.0.1"]);
        assert_eq!(lh(&node_addrs(&s, &d, &all, &p, true)), ["127.0.0.1"]);
        assert_eq!(
            lh(&node_addrs(&s, &d, &parse(&["fd00::/8"]), &p, true)),
            ["127.0.0.1"]
        );
        assert!(lh(&node_addrs(&s, &d, &all, &p, false)).is_empty());
        assert!(lh(&node_addrs(&s, &d, &parse(&["localhost"]), &p, false)).is_empty());
        assert!(lh(&node_addrs(&s, &d, &NodePortAddresses::primary(), &p, true)).is_empty());
        assert!(lh(&node_addrs(&s, &d, &parse(&["10.0.0.0/8"]), &p, true)).is_empty());
        assert!(NodePortAddresses::parse(&["10.0.0.0/33".into()]).is_err());
        // "primary" with a loopback node IP (kube-proxy's fallback): that family has no
        // CIDR, so all of it is chosen, loopback still not.
        let lo = [
            "127.0.0.1".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
        ];
        let got = np(&node_addrs(
            &s,
            &d,
            &NodePortAddresses::primary(),
            &lo,
            true,
        ));
        assert!(got.contains(&"172.17.0.1".to_string()) && !got.contains(&"127.0.0.1".to_string()));
        assert_eq!(
            got.iter().filter(|ip| ip.contains(':')).count(),
            1,
            "{got:?}"
        );
    }

    /// The real thing, in this process's network namespace: whatever it holds, reading it
    /// works and finds loopback.
    /// Flows are counted under the device their backend's route names when svc's programs
    /// are not there; a managed device's and an unroutable backend's are not counted.
    #[test]
    fn flows_routed_out_of_a_device_without_svc_programs_are_counted_per_device() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let flows: BTreeMap<IpAddr, u64> = [
            (ip("10.0.0.2"), 3),
            (ip("10.0.1.2"), 2),
            (ip("10.0.2.2"), 1),
            (ip("10.0.3.2"), 4),
        ]
        .into();
        let managed = [Device {
            index: 2,
            name: "eth0".into(),
        }];
        let mut asked = Vec::new();
        let got = unmanaged_devices(&flows, &managed, |a| {
            asked.push(a);
            match a.to_string().as_str() {
                "10.0.0.2" => Some(2),
                "10.0.1.2" | "10.0.2.2" => Some(5),
                _ => None,
            }
        });
        assert_eq!(got, BTreeMap::from([(5, 3)]));
        assert_eq!(asked.len(), 4, "one route query per address");
    }

    /// The kernel's answer for loopback's address is a local route: no device to count.
    #[test]
    fn a_route_query_answers_local_addresses_with_no_device() {
        let q = RouteQuery::new().expect("netlink socket");
        assert_eq!(q.device(ip_local()).expect("route get"), None);
    }

    fn ip_local() -> IpAddr {
        IpAddr::from([127, 0, 0, 1])
    }

    #[test]
    fn reading_the_namespace_finds_loopback() {
        let s = read().expect("rtnetlink dumps");
        assert!(s.links.iter().any(|l| l.loopback), "{s:?}");
    }
}
