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
//! Hand-written ctnetlink (two message kinds, a few attributes): no crate in this workspace's
//! dependencies builds conntrack entries with NAT, and netlink-packet-netfilter, the one
//! candidate, was taken to cover nflog only (not checked against its latest release).

use std::{
    collections::{BTreeMap, HashMap},
    io,
    os::fd::{AsFd, AsRawFd, OwnedFd},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use svc_common::{ct_dir, ct_flags, ct_timeout, CtKey, CtValue, DatapathConfig, IPPROTO_TCP};

use crate::sys;

const NETLINK_NETFILTER: i32 = 12;
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLA_F_NESTED: u16 = 0x8000;
const NLMSG_ERROR: u16 = 2;

// linux/netfilter/nfnetlink_conntrack.h
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_NAT_SRC: u16 = 6;
const CTA_TIMEOUT: u16 = 7;
const CTA_NAT_DST: u16 = 13;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_NAT_V6_MINIP: u16 = 4;
const CTA_NAT_V6_MAXIP: u16 = 5;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;
// nf_conntrack_common.h, nf_conntrack_tcp.h
const IPS_SEEN_REPLY: u32 = 1 << 1;
const IPS_ASSURED: u32 = 1 << 2;
const IPS_CONFIRMED: u32 = 1 << 3;
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
        let _ = ct.insert(key, v, BPF_EXIST);
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
            IPCTNL_MSG_CT_NEW,
            NLM_F_CREATE | NLM_F_EXCL,
            flow.family(),
            &flow.new_attrs(),
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

    fn new_attrs(&self) -> Vec<u8> {
        let family = self.family();
        let orig = self.own();
        let reply = Tuple {
            family,
            proto: self.proto,
            src: self.frontend,
            dst: self.client,
        };
        let mut a = Vec::new();
        nest(&mut a, CTA_TUPLE_ORIG, &orig.attrs());
        nest(&mut a, CTA_TUPLE_REPLY, &reply.attrs());
        nest(&mut a, CTA_NAT_DST, &nat(family, self.backend));
        if let Some(s) = self.snat {
            nest(&mut a, CTA_NAT_SRC, &nat(family, s));
        }
        attr(&mut a, CTA_TIMEOUT, &self.timeout_s.to_be_bytes());
        let seen = self.flags & ct_flags::SEEN_REPLY != 0;
        // A TCP flow whose handshake has not completed is no more assured for conntrack than
        // for svc: SYN_RECV, which the kernel drops first when its table fills.
        let assured = seen && self.flags & ct_flags::UNASSURED == 0;
        // The kernel marks a new entry confirmed before it applies CTA_STATUS, and refuses a
        // status that would clear that bit (EBUSY).
        let status = IPS_CONFIRMED
            | if seen { IPS_SEEN_REPLY } else { 0 }
            | if assured { IPS_ASSURED } else { 0 };
        attr(&mut a, CTA_STATUS, &status.to_be_bytes());
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
            let liberal = [IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL];
            let mut tcp = Vec::new();
            attr(&mut tcp, CTA_PROTOINFO_TCP_STATE, &[state]);
            attr(&mut tcp, CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, &liberal);
            attr(&mut tcp, CTA_PROTOINFO_TCP_FLAGS_REPLY, &liberal);
            let mut info = Vec::new();
            nest(&mut info, CTA_PROTOINFO_TCP, &tcp);
            nest(&mut a, CTA_PROTOINFO, &info);
        }
        a
    }
}

impl Tuple {
    fn attrs(&self) -> Vec<u8> {
        let mut ip = Vec::new();
        if self.family == libc::AF_INET as u8 {
            attr(&mut ip, CTA_IP_V4_SRC, &v4(&self.src.0).unwrap_or_default());
            attr(&mut ip, CTA_IP_V4_DST, &v4(&self.dst.0).unwrap_or_default());
        } else {
            attr(&mut ip, CTA_IP_V6_SRC, &self.src.0);
            attr(&mut ip, CTA_IP_V6_DST, &self.dst.0);
        }
        let mut proto = Vec::new();
        attr(&mut proto, CTA_PROTO_NUM, &[self.proto]);
        // Ports are kept in network order already.
        attr(&mut proto, CTA_PROTO_SRC_PORT, &self.src.1.to_ne_bytes());
        attr(&mut proto, CTA_PROTO_DST_PORT, &self.dst.1.to_ne_bytes());
        let mut t = Vec::new();
        nest(&mut t, CTA_TUPLE_IP, &ip);
        nest(&mut t, CTA_TUPLE_PROTO, &proto);
        t
    }

    fn delete_attrs(&self) -> Vec<u8> {
        let mut a = Vec::new();
        nest(&mut a, CTA_TUPLE_ORIG, &self.attrs());
        a
    }
}

/// A NAT range of one address and one port.
fn nat(family: u8, to: ([u8; 16], u16)) -> Vec<u8> {
    let mut a = Vec::new();
    if family == libc::AF_INET as u8 {
        let ip = v4(&to.0).unwrap_or_default();
        attr(&mut a, CTA_NAT_V4_MINIP, &ip);
        attr(&mut a, CTA_NAT_V4_MAXIP, &ip);
    } else {
        attr(&mut a, CTA_NAT_V6_MINIP, &to.0);
        attr(&mut a, CTA_NAT_V6_MAXIP, &to.0);
    }
    let mut p = Vec::new();
    attr(&mut p, CTA_PROTONAT_PORT_MIN, &to.1.to_ne_bytes());
    attr(&mut p, CTA_PROTONAT_PORT_MAX, &to.1.to_ne_bytes());
    nest(&mut a, CTA_NAT_PROTO, &p);
    a
}

fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len() + (4 - len % 4) % 4, 0);
}

fn nest(buf: &mut Vec<u8>, kind: u16, inner: &[u8]) {
    attr(buf, kind | NLA_F_NESTED, inner);
}

/// A NETLINK_NETFILTER socket, in the calling thread's network namespace.
struct Ctnetlink {
    fd: OwnedFd,
}

impl Ctnetlink {
    fn open() -> io::Result<Ctnetlink> {
        Ok(Ctnetlink {
            fd: sys::netlink_socket(NETLINK_NETFILTER)?,
        })
    }

    /// Deletes the entry conntrack finds by tuple `t`, if there is one: whether there was.
    fn delete(&self, family: u8, t: &Tuple) -> io::Result<bool> {
        match self.request(IPCTNL_MSG_CT_DELETE, 0, family, &t.delete_attrs()) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sends one ctnetlink request and waits for its acknowledgement.
    fn request(&self, msg: u16, flags: u16, family: u8, attrs: &[u8]) -> io::Result<()> {
        let len = 16 + 4 + attrs.len();
        let mut m = Vec::with_capacity(len);
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | msg).to_ne_bytes());
        m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK | flags).to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        // struct nfgenmsg { u8 family; u8 version; be16 res_id; }
        m.extend_from_slice(&[family, 0, 0, 0]);
        m.extend_from_slice(attrs);
        // SAFETY: m is a buffer of len bytes; the kernel is the destination (zeroed address).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                m.as_ptr().cast(),
                m.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: buf is writable for its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let n = n as usize;
            if n < 20 {
                return Err(io::Error::other("short netlink answer"));
            }
            let kind = u16::from_ne_bytes([buf[4], buf[5]]);
            if kind != NLMSG_ERROR {
                continue;
            }
            let errno = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            return if errno == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(-errno))
            };
        }
    }
}
