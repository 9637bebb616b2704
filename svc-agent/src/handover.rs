//! The way back to kube-proxy for the packet datapath's flows: `svc-agent uninstall` hands
//! each live flow of svc's tc programs (NodePort-type flows of the external path, and
//! per-packet ClusterIP flows of pod devices) over to the node's conntrack, as conntrackd does
//! on failover, so that once svc's tc programs are gone netfilter (kube-proxy's NAT hooks)
//! translates the flow's next packet as svc did instead of taking it for a new connection.
//! A pod device's hairpin flows (a pod reaching itself, SNATed from the frontend and sent
//! straight back into its device) are handed over too: their entry NATs both ways, as svc
//! translated them (to the pod itself, and from the frontend on svc's SNAT port).
//!
//! Per flow, while svc's programs still translate:
//! 1. the un-NATed entry netfilter made for it (client -> backend, once kube-proxy's rules
//!    brought conntrack into the namespace) is deleted: it holds the reply tuple;
//! 2. a kernel entry is made: client -> frontend as the client sent it, its reply the plain
//!    inverse, NAT to the backend (and from the SNAT address and port svc chose), TCP
//!    established (or closing) with window tracking off (a pickup in the middle of a stream);
//!    nf_nat_setup_info derives the NATed reply tuple and sets the NAT status bits. An entry
//!    already on the client's tuples (either of its own: the one an uninstall killed before
//!    3 made, or one netfilter made before svc's programs ran) refuses it: it is deleted and
//!    the new one made again, as svc's entry is the flow as svc translated it;
//! 3. the flow's FORWARD entry is marked `HANDED` at once: svc's programs pass the client's
//!    packets untranslated.
//!
//! A flow whose packets go through the node's stack (to a local backend, and every pod
//! device's flow but a hairpin one) is marked `HANDING` before 1 and until 3: svc's
//! programs drop the client's packets meanwhile (TCP sends them again; a UDP datagram is
//! lost). One that svc translated between 2 and 3 would meet netfilter beside the new
//! kernel entry, be taken for a new connection whose reply tuple is taken, get its source
//! port remapped, and the backend would reset the connection
//! (`nodeport_flows_across_a_widened_handover_window`).
//! External flows to a remote backend are redirected past netfilter, and a pod's hairpin
//! flows are sent back into its device past it: they have no such window.
//!
//! ctnetlink attributes from netlink-packet-netfilter (tuples, status, timeout, TCP state) in
//! netlink-packet-core's framing. The crate has no NAT attributes (`CTA_NAT_DST`/`SRC` are
//! netlink-packet-core's plain attributes here), and its message type cannot carry them with
//! the nested flag, so the message is a small type of our own.

use std::{
    collections::{BTreeMap, HashMap},
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsFd,
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use svc_common::{ct_dir, ct_flags, ct_timeout, CtKey, CtValue, DatapathConfig, IPPROTO_TCP};

use netlink_packet_core::{
    DefaultNla, Emitable, NetlinkSerializable, Nla, NLA_F_NESTED, NLMSG_ERROR, NLM_F_ACK,
};
use netlink_packet_netfilter::{
    conntrack::{
        ConntrackAttribute, ConntrackMessageType, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple,
        Status, TCPFlags, Tuple as CtTuple,
    },
    NetfilterHeader, NetfilterSubsystem,
};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

use crate::{netlink::Messages, sys};

// linux/netfilter/nfnetlink_conntrack.h: what netlink-packet-netfilter does not name.
/// Tries of a mark's write (`mark`).
const MARK_TRIES: u32 = 3;

const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_DST: u16 = 13;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_NAT_V6_MINIP: u16 = 4;
const CTA_NAT_V6_MAXIP: u16 = 5;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;
// netlink.h (NLM_F_CREATE and NLM_F_EXCL as the kernel reads them on a new request).
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
// nf_conntrack_tcp.h
const TCP_CONNTRACK_SYN_SENT: u8 = 1;
const TCP_CONNTRACK_SYN_RECV: u8 = 2;
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
const TCP_CONNTRACK_FIN_WAIT: u8 = 4;
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;

/// What the handover did.
#[derive(Debug, Default)]
pub struct Handover {
    /// Flows the node's conntrack now carries.
    pub handed: u64,
    /// Flows it refused, by reason.
    pub failed: BTreeMap<String, u64>,
    /// Of `handed`, flows whose new entry replaced one already on the client's tuples (one
    /// an uninstall killed in the middle leaves).
    pub replaced: u64,
}

impl Handover {
    pub fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }

    /// Adds what the handover of another table did (the assured and unassured flows').
    pub fn add(&mut self, other: Handover) {
        self.handed += other.handed;
        self.replaced += other.replaced;
        for (reason, n) in other.failed {
            *self.failed.entry(reason).or_default() += n;
        }
    }
}

/// Hands every live flow of svc's tc programs in the CT map `ct` (either table: a flow's two
/// entries are in one) over to the conntrack of the
/// calling thread's network namespace; `config` is the datapath's (its timeouts). A flow the
/// kernel refuses stays svc's (and dies with svc's programs); nothing here fails the caller
/// but a map or socket it cannot use.
pub fn hand_over(ct: MapData, config: &DatapathConfig) -> io::Result<Handover> {
    let entries: HashMap<CtKey, CtValue> = sys::dump_hash::<CtKey, CtValue>(ct.fd().as_fd())?
        .into_iter()
        .collect();
    let mut ct: BpfHashMap<MapData, CtKey, CtValue> =
        BpfHashMap::try_from(Map::LruHashMap(ct)).map_err(io::Error::other)?;
    let nl = Ctnetlink::open()?;
    let now = sys::coarse_now_ns();
    let mut done = Handover::default();
    for (key, fwd) in &entries {
        if key.dir != ct_dir::FORWARD
            || ct_flags::closed(fwd.flags)
            || fwd.flags & ct_flags::HANDED != 0
        {
            continue;
        }
        let rkey = key.partner(fwd);
        let rep = entries.get(&rkey).filter(|r| {
            // A reply key may already belong to a newer flow.
            r.nat_addr == key.daddr && r.nat_port_be == key.dport_be
        });
        let flags = fwd.flags | rep.map_or(0, |r| r.flags);
        let last = fwd.last_seen_ns.max(rep.map_or(0, |r| r.last_seen_ns));
        let idle_s = now.saturating_sub(last) / 1_000_000_000;
        let life = u64::from(ct_timeout::seconds(config, key.proto, flags));
        if idle_s > life {
            continue;
        }
        let flow = Flow::of(key, fwd, flags, (life - idle_s).max(1));
        match hand_over_one(&nl, &mut ct, key, fwd, &flow) {
            Ok(replaced) => {
                done.handed += 1;
                done.replaced += u64::from(replaced);
            }
            Err(e) => *done.failed.entry(reason(&e)).or_default() += 1,
        }
    }
    Ok(done)
}

fn reason(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EEXIST) => "the node's conntrack holds another entry on its tuples".into(),
        Some(libc::EOPNOTSUPP) => "no NAT in the node's netfilter".into(),
        _ => e.to_string(),
    }
}

/// BPF_EXIST: only an entry that is there is written (one the LRU evicted stays gone).
const BPF_EXIST: u64 = 2;

/// Adds `set` to the flags of `key`'s entry as it is now, not as the dump saw it (the kernel
/// may have recorded a FIN or a newer time since), and takes `HANDING` off unless it is in
/// `set`, stamped with the clock's seconds then. Only while the entry is still the flow the
/// dump saw as `fwd` (the same backend and source): a new flow on the same tuples is not
/// the one handed over.
fn mark(ct: &mut BpfHashMap<MapData, CtKey, CtValue>, key: &CtKey, fwd: &CtValue, set: u16) {
    // The LRU may have evicted it meanwhile: then there is nothing to mark.
    if let Ok(mut v) = ct.get(key, 0) {
        let same = (v.nat_addr, v.nat_port_be, v.snat_addr, v.snat_port_be)
            == (
                fwd.nat_addr,
                fwd.nat_port_be,
                fwd.snat_addr,
                fwd.snat_port_be,
            );
        if !same {
            return;
        }
        v.flags = (v.flags & !ct_flags::HANDING) | set;
        v.handing_s = if set & ct_flags::HANDING != 0 {
            (sys::coarse_now_ns() / 1_000_000_000) as u16
        } else {
            0
        };
        // Replacing an entry of a table allocated as used (`SVC_CT`) allocates one: the
        // kernel's caches may be empty for a moment. Twice more at most (0.3 ms): a late mark
        // holds the flow's packets, and under lasting memory pressure every flow of the
        // handover would wait.
        let _ = crate::store::retry_enomem(MARK_TRIES, || ct.insert(key, v, BPF_EXIST));
    }
}

fn hand_over_one(
    nl: &Ctnetlink,
    ct: &mut BpfHashMap<MapData, CtKey, CtValue>,
    key: &CtKey,
    fwd: &CtValue,
    flow: &Flow,
) -> io::Result<bool> {
    let via_stack = fwd.flags & ct_flags::SNAT == 0 || fwd.snat_addr == key.saddr;
    if via_stack {
        // From here until the mark HANDED the client's packets are dropped: none meets
        // netfilter translated beside the kernel entry.
        mark(ct, key, fwd, ct_flags::HANDING);
    }
    let mut result = Err(io::Error::from_raw_os_error(libc::EEXIST));
    let mut replaced = false;
    for attempt in 0..3 {
        // What netfilter saw of the flow: the packets svc translated (either orientation:
        // conntrack finds an entry by either of its tuples).
        if via_stack {
            if let Err(e) = nl.delete(flow.family(), &flow.translated()) {
                result = Err(e);
                break;
            }
        }
        // Once the new entry was refused: an entry on the flow's own tuples as the client
        // sends them (by either of its tuples), such as the one an earlier uninstall made
        // before it was killed, before it could mark the flow HANDED. svc's entry is the flow
        // as its packets have been translated, and replaces it.
        if attempt > 0 {
            match nl.delete(flow.family(), &flow.own()) {
                Ok(deleted) => replaced |= deleted,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        result = nl.request(
            CtRequest::new(ConntrackMessageType::New, flow.family(), flow.new_attrs()),
            NLM_F_CREATE | NLM_F_EXCL,
        );
        // A reply in flight may have made the un-NATed entry again: once more.
        if !matches!(&result, Err(e) if e.raw_os_error() == Some(libc::EEXIST)) {
            break;
        }
    }
    match result {
        Ok(()) => {
            // Past `HANDING_HOLD_S` the mark lapses and svc translates the flow again, so a
            // pause of a second or more tests nothing.
            fail::fail_point!(crate::fault::HANDOVER_PAUSE);
            mark(ct, key, fwd, ct_flags::HANDED);
            Ok(replaced)
        }
        Err(e) => {
            // svc keeps the flow.
            if via_stack {
                mark(ct, key, fwd, 0);
            }
            Err(e)
        }
    }
}

/// An address, v4 when mapped.
fn v4(a: &[u8; 16]) -> Option<[u8; 4]> {
    (a[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]).then(|| [a[12], a[13], a[14], a[15]])
}

/// A flow as the kernel entry describes it.
struct Flow {
    proto: u8,
    client: ([u8; 16], u16),
    frontend: ([u8; 16], u16),
    backend: ([u8; 16], u16),
    snat: Option<([u8; 16], u16)>,
    flags: u16,
    timeout_s: u32,
}

/// A bare tuple.
struct Tuple {
    family: u8,
    proto: u8,
    src: ([u8; 16], u16),
    dst: ([u8; 16], u16),
}

impl Flow {
    fn of(key: &CtKey, fwd: &CtValue, flags: u16, timeout_s: u64) -> Flow {
        Flow {
            proto: key.proto,
            client: (key.saddr, key.sport_be),
            frontend: (key.daddr, key.dport_be),
            backend: (fwd.nat_addr, fwd.nat_port_be),
            snat: (fwd.flags & ct_flags::SNAT != 0).then_some((fwd.snat_addr, fwd.snat_port_be)),
            flags,
            timeout_s: timeout_s.min(u32::MAX as u64) as u32,
        }
    }

    fn family(&self) -> u8 {
        if v4(&self.client.0).is_some() {
            libc::AF_INET as u8
        } else {
            libc::AF_INET6 as u8
        }
    }

    /// The tuple the client sends on (the new entry's original one).
    fn own(&self) -> Tuple {
        Tuple {
            family: self.family(),
            proto: self.proto,
            src: self.client,
            dst: self.frontend,
        }
    }

    fn translated(&self) -> Tuple {
        Tuple {
            family: self.family(),
            proto: self.proto,
            src: self.snat.unwrap_or(self.client),
            dst: self.backend,
        }
    }

    fn new_attrs(&self) -> Vec<CtAttr> {
        let family = self.family();
        let orig = self.own();
        let reply = Tuple {
            family,
            proto: self.proto,
            src: self.frontend,
            dst: self.client,
        };
        let mut a = vec![
            CtAttr::Ct(ConntrackAttribute::CtaTupleOrig(orig.attrs())),
            CtAttr::Ct(ConntrackAttribute::CtaTupleReply(reply.attrs())),
            nat(CTA_NAT_DST, family, self.backend),
        ];
        if let Some(s) = self.snat {
            a.push(nat(CTA_NAT_SRC, family, s));
        }
        a.push(CtAttr::Ct(ConntrackAttribute::CtaTimeout(self.timeout_s)));
        let seen = self.flags & ct_flags::SEEN_REPLY != 0;
        // A TCP flow whose handshake has not completed is no more assured for conntrack than
        // for svc: SYN_RECV, which the kernel drops first when its table fills.
        let assured = seen && self.flags & ct_flags::UNASSURED == 0;
        // The kernel marks a new entry confirmed before it applies CTA_STATUS, and refuses a
        // status that would clear that bit (EBUSY).
        let mut status = Status::Confirmed;
        status.set(Status::SeenReply, seen);
        status.set(Status::Assured, assured);
        a.push(CtAttr::Ct(ConntrackAttribute::CtaStatus(status)));
        if self.proto == IPPROTO_TCP {
            let state = if !seen {
                TCP_CONNTRACK_SYN_SENT
            } else if !assured {
                TCP_CONNTRACK_SYN_RECV
            } else if self.flags & ct_flags::FIN != 0 {
                TCP_CONNTRACK_FIN_WAIT
            } else {
                TCP_CONNTRACK_ESTABLISHED
            };
            a.push(CtAttr::Ct(ConntrackAttribute::CtaProtoInfo(vec![
                ProtoInfo::TCP(vec![
                    ProtoInfoTCP::State(state),
                    ProtoInfoTCP::OriginalFlags(liberal()),
                    ProtoInfoTCP::ReplyFlags(liberal()),
                ]),
            ])));
        }
        a
    }
}

/// Window tracking off, for the flag and in the mask.
fn liberal() -> TCPFlags {
    // The crate's TCPFlags has no constructor but its parser, which takes any two bytes.
    TCPFlags::parse(&[IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL])
        .expect("two bytes are a TCPFlags")
}

/// An address of `family` (v4 when the flow is, from its mapped form).
fn ip(family: u8, a: &[u8; 16]) -> IpAddr {
    if family == libc::AF_INET as u8 {
        IpAddr::V4(Ipv4Addr::from(v4(a).unwrap_or_default()))
    } else {
        IpAddr::V6(Ipv6Addr::from(*a))
    }
}

impl Tuple {
    fn attrs(&self) -> Vec<CtTuple> {
        vec![
            CtTuple::Ip(vec![
                IPTuple::SourceAddress(ip(self.family, &self.src.0)),
                IPTuple::DestinationAddress(ip(self.family, &self.dst.0)),
            ]),
            CtTuple::Proto(vec![
                ProtoTuple::Protocol(self.proto.into()),
                // Ports are kept in network order.
                ProtoTuple::SourcePort(u16::from_be(self.src.1)),
                ProtoTuple::DestinationPort(u16::from_be(self.dst.1)),
            ]),
        ]
    }
}

/// `CTA_NAT_DST` or `CTA_NAT_SRC`: a range of one address and one port.
fn nat(kind: u16, family: u8, to: ([u8; 16], u16)) -> CtAttr {
    let (min, max, addr) = match ip(family, &to.0) {
        IpAddr::V4(a) => (CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP, a.octets().to_vec()),
        IpAddr::V6(a) => (CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP, a.octets().to_vec()),
    };
    // The port is kept in network order.
    let port = to.1.to_ne_bytes().to_vec();
    let ports = [
        DefaultNla::new(CTA_PROTONAT_PORT_MIN, port.clone()),
        DefaultNla::new(CTA_PROTONAT_PORT_MAX, port),
    ];
    let range = [
        DefaultNla::new(min, addr.clone()),
        DefaultNla::new(max, addr),
        nested(CTA_NAT_PROTO, &ports),
    ];
    CtAttr::Raw(nested(kind, &range))
}

/// An attribute holding `inner`, flagged nested (as the crate's own nested attributes are).
fn nested(kind: u16, inner: &[DefaultNla]) -> DefaultNla {
    let mut value = vec![0; inner.buffer_len()];
    inner.emit(&mut value);
    DefaultNla::new(kind | NLA_F_NESTED, value)
}

/// A ctnetlink request: `struct nfgenmsg` and its attributes.
struct CtRequest {
    kind: ConntrackMessageType,
    family: u8,
    attrs: Vec<CtAttr>,
}

impl CtRequest {
    fn new(kind: ConntrackMessageType, family: u8, attrs: Vec<CtAttr>) -> CtRequest {
        CtRequest {
            kind,
            family,
            attrs,
        }
    }

    fn header(&self) -> NetfilterHeader {
        NetfilterHeader::new(self.family.into(), 0, 0)
    }
}

impl NetlinkSerializable for CtRequest {
    fn message_type(&self) -> u16 {
        (u16::from(u8::from(NetfilterSubsystem::Conntrack)) << 8) | u16::from(u8::from(self.kind))
    }

    fn buffer_len(&self) -> usize {
        self.header().buffer_len() + self.attrs.as_slice().buffer_len()
    }

    fn serialize(&self, buffer: &mut [u8]) {
        let header = self.header();
        header.emit(buffer);
        self.attrs
            .as_slice()
            .emit(&mut buffer[header.buffer_len()..]);
    }
}

/// A top-level attribute of a ctnetlink request. Not the crate's `ConntrackAttribute::Other`
/// for what it lacks: that one is never flagged nested.
enum CtAttr {
    Ct(ConntrackAttribute),
    Raw(DefaultNla),
}

impl Nla for CtAttr {
    fn value_len(&self) -> usize {
        match self {
            CtAttr::Ct(a) => a.value_len(),
            CtAttr::Raw(a) => a.value_len(),
        }
    }

    fn kind(&self) -> u16 {
        match self {
            CtAttr::Ct(a) => a.kind(),
            CtAttr::Raw(a) => a.kind(),
        }
    }

    fn emit_value(&self, buffer: &mut [u8]) {
        match self {
            CtAttr::Ct(a) => a.emit_value(buffer),
            CtAttr::Raw(a) => a.emit_value(buffer),
        }
    }

    fn is_nested(&self) -> bool {
        match self {
            CtAttr::Ct(a) => a.is_nested(),
            CtAttr::Raw(a) => a.is_nested(),
        }
    }
}

/// A NETLINK_NETFILTER socket, in the calling thread's network namespace.
struct Ctnetlink {
    socket: Socket,
}

impl Ctnetlink {
    fn open() -> io::Result<Ctnetlink> {
        Ok(Ctnetlink {
            socket: Socket::new(NETLINK_NETFILTER)?,
        })
    }

    /// Deletes the entry conntrack finds by tuple `t`, if there is one: whether there was.
    fn delete(&self, family: u8, t: &Tuple) -> io::Result<bool> {
        let orig = CtAttr::Ct(ConntrackAttribute::CtaTupleOrig(t.attrs()));
        let msg = CtRequest::new(ConntrackMessageType::Delete, family, vec![orig]);
        match self.request(msg, 0) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sends one ctnetlink request and waits for its acknowledgement.
    fn request(&self, msg: CtRequest, flags: u16) -> io::Result<()> {
        let m = ctnetlink_request(msg, flags);
        self.socket.send_to(&m, &SocketAddr::new(0, 0), 0)?;
        let mut buf = [0u8; 4096];
        loop {
            let n = self.socket.recv(&mut &mut buf[..], 0)?;
            for msg in Messages::new(&buf[..n]) {
                let msg = msg?;
                if msg.kind != NLMSG_ERROR {
                    continue;
                }
                return match msg.error_code()? {
                    0 => Ok(()),
                    errno => Err(io::Error::from_raw_os_error(-errno)),
                };
            }
        }
    }
}

/// One ctnetlink request, acknowledged; sequence number 1, as one request is in flight at a
/// time.
fn ctnetlink_request(msg: CtRequest, flags: u16) -> Vec<u8> {
    crate::netlink::request(msg, NLM_F_ACK | flags, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn mapped(a: [u8; 4]) -> [u8; 16] {
        let mut m = [0u8; 16];
        m[10] = 0xff;
        m[11] = 0xff;
        m[12..].copy_from_slice(&a);
        m
    }

    /// The requests are the bytes the hand-written framing this replaced sent (recorded from
    /// it on x86_64): new entries of either family with and without SNAT, TCP in each state,
    /// and both deletes.
    #[cfg(target_endian = "little")]
    #[test]
    fn requests_are_the_bytes_sent_before() {
        let v6 = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap().octets();
        let flows = [
            // v4 TCP, SNAT, established
            Flow {
                proto: 6,
                client: (mapped([10, 0, 0, 7]), 40000u16.to_be()),
                frontend: (mapped([10, 96, 0, 10]), 80u16.to_be()),
                backend: (mapped([10, 1, 0, 5]), 8080u16.to_be()),
                snat: Some((mapped([10, 0, 0, 1]), 61000u16.to_be())),
                flags: ct_flags::SEEN_REPLY,
                timeout_s: 7200,
            },
            // v4 UDP, no SNAT, no reply yet
            Flow {
                proto: 17,
                client: (mapped([10, 0, 0, 7]), 5353u16.to_be()),
                frontend: (mapped([10, 96, 0, 53]), 53u16.to_be()),
                backend: (mapped([10, 1, 0, 6]), 5353u16.to_be()),
                snat: None,
                flags: 0,
                timeout_s: 30,
            },
            // v6 TCP FIN, SNAT
            Flow {
                proto: 6,
                client: (v6("fd00::7"), 40001u16.to_be()),
                frontend: (v6("fd00:96::10"), 443u16.to_be()),
                backend: (v6("fd00:1::5"), 8443u16.to_be()),
                snat: Some((v6("fd00::1"), 61001u16.to_be())),
                flags: ct_flags::SEEN_REPLY | ct_flags::FIN,
                timeout_s: 120,
            },
            // v6 TCP unassured
            Flow {
                proto: 6,
                client: (v6("fd00::8"), 40002u16.to_be()),
                frontend: (v6("fd00:96::11"), 80u16.to_be()),
                backend: (v6("fd00:1::6"), 80u16.to_be()),
                snat: None,
                flags: ct_flags::SEEN_REPLY | ct_flags::UNASSURED,
                timeout_s: 60,
            },
        ];
        let expected: [(&Flow, &str, &str, &str); 4] = [
            (
                &flows[0],
                "fc00000000010506010000000000000002000000340001801400018008000100\
                0a000007080002000a60000a1c0002800500010006000000060002009c400000\
                06000300005000003400028014000180080001000a60000a080002000a000007\
                1c00028005000100060000000600020000500000060003009c40000028000d80\
                080001000a010005080002000a01000514000380060001001f90000006000200\
                1f90000028000680080001000a000001080002000a0000011400038006000100\
                ee48000006000200ee4800000800070000001c20080003000000000e20000480\
                1c000180050001000300000006000400080800000600050008080000",
                "4800000002010500010000000000000002000000340001801400018008000100\
                0a000001080002000a0100051c000280050001000600000006000200ee480000\
                060003001f900000",
                "4800000002010500010000000000000002000000340001801400018008000100\
                0a000007080002000a60000a1c0002800500010006000000060002009c400000\
                0600030000500000",
            ),
            (
                &flows[1],
                "b400000000010506010000000000000002000000340001801400018008000100\
                0a000007080002000a6000351c00028005000100110000000600020014e90000\
                06000300003500003400028014000180080001000a600035080002000a000007\
                1c000280050001001100000006000200003500000600030014e9000028000d80\
                080001000a010006080002000a010006140003800600010014e9000006000200\
                14e90000080007000000001e0800030000000008",
                "4800000002010500010000000000000002000000340001801400018008000100\
                0a000007080002000a0100061c00028005000100110000000600020014e90000\
                0600030014e90000",
                "4800000002010500010000000000000002000000340001801400018008000100\
                0a000007080002000a6000351c00028005000100110000000600020014e90000\
                0600030000350000",
            ),
            (
                &flows[2],
                "5c0100000001050601000000000000000a0000004c0001802c00018014000300\
                fd00000000000000000000000000000714000400fd0000960000000000000000\
                000000101c0002800500010006000000060002009c4100000600030001bb0000\
                4c0002802c00018014000300fd00009600000000000000000000001014000400\
                fd0000000000000000000000000000071c000280050001000600000006000200\
                01bb0000060003009c41000040000d8014000400fd0000010000000000000000\
                0000000514000500fd0000010000000000000000000000051400038006000100\
                20fb00000600020020fb00004000068014000400fd0000000000000000000000\
                0000000114000500fd0000000000000000000000000000011400038006000100\
                ee49000006000200ee4900000800070000000078080003000000000e20000480\
                1c000180050001000400000006000400080800000600050008080000",
                "600000000201050001000000000000000a0000004c0001802c00018014000300\
                fd00000000000000000000000000000114000400fd0000010000000000000000\
                000000051c000280050001000600000006000200ee4900000600030020fb0000",
                "600000000201050001000000000000000a0000004c0001802c00018014000300\
                fd00000000000000000000000000000714000400fd0000960000000000000000\
                000000101c0002800500010006000000060002009c4100000600030001bb0000",
            ),
            (
                &flows[3],
                "1c0100000001050601000000000000000a0000004c0001802c00018014000300\
                fd00000000000000000000000000000814000400fd0000960000000000000000\
                000000111c0002800500010006000000060002009c4200000600030000500000\
                4c0002802c00018014000300fd00009600000000000000000000001114000400\
                fd0000000000000000000000000000081c000280050001000600000006000200\
                00500000060003009c42000040000d8014000400fd0000010000000000000000\
                0000000614000500fd0000010000000000000000000000061400038006000100\
                005000000600020000500000080007000000003c080003000000000a20000480\
                1c000180050001000200000006000400080800000600050008080000",
                "600000000201050001000000000000000a0000004c0001802c00018014000300\
                fd00000000000000000000000000000814000400fd0000010000000000000000\
                000000061c0002800500010006000000060002009c4200000600030000500000",
                "600000000201050001000000000000000a0000004c0001802c00018014000300\
                fd00000000000000000000000000000814000400fd0000960000000000000000\
                000000111c0002800500010006000000060002009c4200000600030000500000",
            ),
        ];
        for (i, (f, new, translated, own)) in expected.into_iter().enumerate() {
            let new_entry = CtRequest::new(ConntrackMessageType::New, f.family(), f.new_attrs());
            let m = ctnetlink_request(new_entry, NLM_F_CREATE | NLM_F_EXCL);
            assert_eq!(m, unhex(new), "new entry of flow {i}");
            for (t, want) in [(f.translated(), translated), (f.own(), own)] {
                let orig = CtAttr::Ct(ConntrackAttribute::CtaTupleOrig(t.attrs()));
                let del = CtRequest::new(ConntrackMessageType::Delete, f.family(), vec![orig]);
                assert_eq!(ctnetlink_request(del, 0), unhex(want), "delete, flow {i}");
            }
        }
    }
}
