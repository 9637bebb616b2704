//! Parsing: Ethernet (no VLAN), IPv4 with options, IPv6 with a bounded walk over its
//! extension headers, then TCP, UDP, ICMP and ICMPv6.
//!
//! The EtherType, the IP header and the TCP or UDP header are read in place (direct packet
//! access) when they lie in the packet's linear part, as they nearly always do, else with
//! bpf_skb_load_bytes (a helper call per header was a large part of a non-service packet's
//! cost). Offsets vary (options, extension headers), so an in-place read is bounded first
//! (`DIRECT_MAX`) and checked against the end of the linear data. IPv6 extension headers, the
//! ICMP header and everything the other modules read go through the helper.
//!
//! What the parser cannot read (truncated, inconsistent lengths, too many extension headers)
//! is `UNPARSED`: the packet passes untouched and is counted, never dropped: it is not ours to
//! judge.

use crate::ctx::Ctx;
use svc_common::{IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HLEN: u32 = 14;
/// The IP header starts right after Ethernet.
pub const L3: u32 = ETH_HLEN;
pub const IPV4_HLEN: u32 = 20;
pub const IPV6_HLEN: u32 = 40;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;

/// How many IPv6 extension headers the walk reads before it gives up (`UNPARSED`). Real
/// traffic carries one or two; the bound keeps the verifier's walk short.
const MAX_EXT_HEADERS: usize = 6;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
pub const ICMP_PORT_UNREACH: u8 = 3;
pub const ICMP_FRAG_NEEDED: u8 = 4;
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PKT_TOOBIG: u8 = 2;
pub const ICMPV6_TIME_EXCEED: u8 = 3;
pub const ICMPV6_PORT_UNREACH: u8 = 4;
/// Parameter problem (IPv4 12, ICMPv6 4): its pointer is an offset into the quoted packet,
/// which the translation does not move, so it is translated as the other errors are.
pub const ICMP_PARAMETERPROB: u8 = 12;
pub const ICMPV6_PARAMPROB: u8 = 4;

/// What `parse` found.
pub mod parsed {
    /// TCP or UDP with ports: a candidate for translation.
    pub const L4: u32 = 0;
    /// Not IP (ARP, VLAN-tagged, ...): none of ours.
    pub const NOT_IP: u32 = 1;
    /// IP, but a protocol without ports (other than an ICMP error): none of ours.
    pub const OTHER: u32 = 2;
    /// Truncated or malformed: passed untouched, counted.
    pub const UNPARSED: u32 = 3;
    /// A non-first fragment: no ports of its own; its addresses, protocol and fragment id
    /// are parsed (frag.rs finds the ports its first fragment carried, if translated).
    pub const FRAGMENT: u32 = 4;
    /// An ICMP or ICMPv6 error: what it quotes may be a translated flow.
    pub const ICMP_ERROR: u32 = 5;
}

/// A parsed packet: its tuple and where its headers are.
#[derive(Clone, Copy, Default)]
pub struct Pkt {
    /// Network byte order; IPv4 as `::ffff:a.b.c.d`.
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Network byte order.
    pub sport_be: u16,
    pub dport_be: u16,
    /// Offset of the TCP/UDP/ICMP header.
    pub l4_off: u32,
    /// Length of the IP packet from its header's fields (header included).
    pub ip_len: u32,
    /// 1: IPv6.
    pub v6: u8,
    pub proto: u8,
    /// TCP flags; ICMP type for an ICMP error.
    pub tcp_flags: u8,
    /// 1: the first fragment of a fragmented datagram (translated like any packet).
    pub first_frag: u8,
    /// 1: the packet must not be fragmented (IPv4 DF; IPv6 always).
    pub df: u8,
    /// 1: a non-first fragment (`parsed::FRAGMENT`): no L4 header at `l4_off`, and ports
    /// only once frag.rs has found them.
    pub later_frag: u8,
    /// The device the program runs on.
    pub ifindex: u32,
    /// IPv4 TTL or IPv6 hop limit.
    pub ttl: u8,
    /// The IPv4 header checksum, as it lies in the packet.
    pub ip_check: u16,
    /// TCP: the sequence and acknowledgment numbers as the header has them, and the header's
    /// length in bytes; read through `seq`, `ack` and `seq_len`, which only connection
    /// tracking needs (computed in the parser, they grew its frame past the deepest chain's
    /// stack).
    pub tcp_seq_ack: [u8; 8],
    pub tcp_hlen: u8,
}

impl Pkt {
    /// TCP: the sequence number (host order).
    #[inline(always)]
    pub fn seq(&self) -> u32 {
        let b = &self.tcp_seq_ack;
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    /// TCP: the acknowledgment number (host order).
    #[inline(always)]
    pub fn ack(&self) -> u32 {
        let b = &self.tcp_seq_ack;
        u32::from_be_bytes([b[4], b[5], b[6], b[7]])
    }

    /// TCP: the segment's length in sequence space: its payload, plus one each for SYN and
    /// FIN.
    #[inline(always)]
    pub fn seq_len(&self) -> u32 {
        (L3 + self.ip_len).saturating_sub(self.l4_off + self.tcp_hlen as u32)
            + (self.tcp_flags & TCP_SYN != 0) as u32
            + (self.tcp_flags & TCP_FIN != 0) as u32
    }

    /// Offset of the L4 checksum field.
    #[inline(always)]
    pub fn csum_off(&self) -> u32 {
        match self.proto {
            IPPROTO_TCP => self.l4_off + 16,
            IPPROTO_UDP => self.l4_off + 6,
            _ => self.l4_off + 2,
        }
    }
}

/// Reads `N` bytes at `off` into `buf`; false when the packet is shorter.
#[inline(always)]
pub fn load<const N: usize>(ctx: &impl Ctx, off: u32, buf: &mut [u8; N]) -> bool {
    // SAFETY: the helper writes at most N bytes into buf and checks the packet bounds.
    unsafe { ctx.load_bytes(off, buf.as_mut_ptr(), N as u32) }
}

#[inline(always)]
pub fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// `*p = Pkt::default()` in word stores (`mem::zero`): LLVM made that assignment a call to
/// the object's `memset`, a byte loop, on every packet.
#[inline(always)]
fn clear(p: &mut Pkt) {
    // SAFETY: a `Pkt` is plain bytes; every bit pattern, all zero included, is one.
    unsafe { crate::mem::clear(p) };
}

/// Headers that start this far into the packet or further are read through the helper: the
/// verifier needs a bound on an in-place read's offset. Only a TCP or UDP header after a long
/// chain of IPv6 extension headers starts there.
const DIRECT_MAX: u32 = 1024;

/// `N` bytes at `off`: in place when they lie in the linear data, else read by the helper into
/// a buffer that is not zeroed first (zeroing it was a byte loop too); `None` when the packet
/// is shorter.
#[inline(always)]
pub fn header<const N: usize>(ctx: &impl Ctx, off: u32) -> Option<[u8; N]> {
    if off < DIRECT_MAX {
        let at = ctx.data() + off as usize;
        if at + N <= ctx.data_end() {
            // SAFETY: `at..at + N` lies within the packet's linear data, checked just above.
            return Some(unsafe { core::ptr::read_unaligned(at as *const [u8; N]) });
        }
    }
    let mut buf = core::mem::MaybeUninit::<[u8; N]>::uninit();
    // SAFETY: the helper writes at most N bytes into buf and checks the packet bounds.
    let r = unsafe { ctx.load_bytes(off, buf.as_mut_ptr().cast(), N as u32) };
    // SAFETY: on success the helper wrote all N bytes.
    r.then(|| unsafe { buf.assume_init() })
}

/// Parses the packet into `p`; returns a `parsed` code. A function of its own (a BPF-to-BPF
/// call): its header buffers then live in its frame, not in every caller's.
#[inline(never)]
pub fn parse<C: Ctx>(ctx: &C, p: &mut Pkt) -> u32 {
    let (ifindex, len) = (ctx.ifindex(), ctx.len());
    // `p` may hold the previous packet's fields.
    clear(p);
    p.ifindex = ifindex;
    let Some(eth_proto) = header::<2>(ctx, 12) else {
        return parsed::NOT_IP;
    };
    let outcome = match be16(eth_proto) {
        ETH_P_IP => parse_v4(ctx, len, p),
        ETH_P_IPV6 => parse_v6(ctx, len, p),
        _ => return parsed::NOT_IP,
    };
    if outcome != parsed::L4 {
        return outcome;
    }
    parse_l4(ctx, p)
}

#[inline(always)]
fn parse_v4(ctx: &impl Ctx, skb_len: u32, p: &mut Pkt) -> u32 {
    let Some(h) = header::<{ IPV4_HLEN as usize }>(ctx, L3) else {
        return parsed::UNPARSED;
    };
    let ihl = (h[0] & 0x0f) as u32 * 4;
    if h[0] >> 4 != 4 || ihl < IPV4_HLEN {
        return parsed::UNPARSED;
    }
    let mut tot_len = be16([h[2], h[3]]) as u32;
    // IPv4 BIG TCP leaves the field 0 on packets beyond 64 KiB: the skb knows the length.
    if tot_len == 0 && h[9] == IPPROTO_TCP {
        tot_len = skb_len.saturating_sub(L3);
    }
    if tot_len < ihl || L3 + tot_len > skb_len {
        return parsed::UNPARSED;
    }
    let frag = be16([h[6], h[7]]);
    let later = frag & 0x1fff != 0;
    p.first_frag = (!later && frag & 0x2000 != 0) as u8;
    p.df = (frag & 0x4000 != 0) as u8;
    p.v6 = 0;
    p.proto = h[9];
    p.ttl = h[8];
    p.ip_check = u16::from_ne_bytes([h[10], h[11]]);
    // `v4_mapped` into the cleared `p`: only its last six bytes need writing (the whole
    // address built apart is another memset call).
    p.saddr[10] = 0xff;
    p.saddr[11] = 0xff;
    p.saddr[12..].copy_from_slice(&h[12..16]);
    p.daddr[10] = 0xff;
    p.daddr[11] = 0xff;
    p.daddr[12..].copy_from_slice(&h[16..20]);
    p.ip_len = tot_len;
    p.l4_off = L3 + ihl;
    if later {
        p.later_frag = 1;
        return parsed::FRAGMENT;
    }
    match p.proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_ICMP => parsed::L4,
        _ => parsed::OTHER,
    }
}

#[inline(always)]
fn parse_v6(ctx: &impl Ctx, skb_len: u32, p: &mut Pkt) -> u32 {
    let Some(h) = header::<{ IPV6_HLEN as usize }>(ctx, L3) else {
        return parsed::UNPARSED;
    };
    if h[0] >> 4 != 6 {
        return parsed::UNPARSED;
    }
    let payload = be16([h[4], h[5]]) as u32;
    // 0 is a jumbogram (or IPv6 BIG TCP): the skb knows the length.
    let ip_len = if payload == 0 {
        skb_len.saturating_sub(L3)
    } else {
        IPV6_HLEN + payload
    };
    if L3 + ip_len > skb_len {
        return parsed::UNPARSED;
    }
    p.v6 = 1;
    p.df = 1;
    p.ttl = h[7];
    p.saddr.copy_from_slice(&h[8..24]);
    p.daddr.copy_from_slice(&h[24..40]);
    p.ip_len = ip_len;
    let mut upper = Upper::default();
    let outcome = ipv6_upper(ctx, L3 + IPV6_HLEN, h[6], &mut upper);
    if outcome != parsed::L4 && outcome != parsed::FRAGMENT {
        return outcome;
    }
    p.first_frag = upper.first_frag;
    p.proto = upper.proto;
    p.l4_off = upper.off;
    if outcome == parsed::FRAGMENT {
        p.later_frag = 1;
        return outcome;
    }
    match p.proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_ICMPV6 => parsed::L4,
        _ => parsed::OTHER,
    }
}

/// Where the upper-layer header of an IPv6 packet is.
#[derive(Default)]
pub struct Upper {
    pub off: u32,
    pub proto: u8,
    pub first_frag: u8,
}

/// Walks IPv6 extension headers from `off`, whose type is `next`, to the upper-layer header.
/// `L4` with `out` filled, `FRAGMENT` for a non-first fragment (`out` names what follows its
/// Fragment header, which lies right before `out.off`), `UNPARSED` when a header cannot be
/// read or there are more than `MAX_EXT_HEADERS`.
#[inline(always)]
pub fn ipv6_upper(ctx: &impl Ctx, off: u32, next: u8, out: &mut Upper) -> u32 {
    let mut off = off;
    let mut next = next;
    for _ in 0..MAX_EXT_HEADERS {
        let mut h = [0u8; 4];
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                if !load(ctx, off, &mut h) {
                    return parsed::UNPARSED;
                }
                next = h[0];
                off += (h[1] as u32 + 1) * 8;
            }
            IPPROTO_AH => {
                if !load(ctx, off, &mut h) {
                    return parsed::UNPARSED;
                }
                next = h[0];
                off += (h[1] as u32 + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                if !load(ctx, off, &mut h) {
                    return parsed::UNPARSED;
                }
                let frag = be16([h[2], h[3]]);
                next = h[0];
                off += 8;
                if frag & 0xfff8 != 0 {
                    out.off = off;
                    out.proto = next;
                    return parsed::FRAGMENT;
                }
                out.first_frag = (frag & 1) as u8;
            }
            _ => {
                out.off = off;
                out.proto = next;
                return parsed::L4;
            }
        }
    }
    parsed::UNPARSED
}

/// The transport header: ports (TCP, UDP) or the kind of ICMP message.
#[inline(always)]
fn parse_l4(ctx: &impl Ctx, p: &mut Pkt) -> u32 {
    let end = L3 + p.ip_len;
    match p.proto {
        IPPROTO_TCP => {
            if p.l4_off + 20 > end {
                return parsed::UNPARSED;
            }
            let Some(h) = header::<14>(ctx, p.l4_off) else {
                return parsed::UNPARSED;
            };
            let doff = (h[12] >> 4) as u32 * 4;
            if doff < 20 || p.l4_off + doff > end {
                return parsed::UNPARSED;
            }
            p.sport_be = u16::from_ne_bytes([h[0], h[1]]);
            p.dport_be = u16::from_ne_bytes([h[2], h[3]]);
            p.tcp_flags = h[13];
            p.tcp_seq_ack.copy_from_slice(&h[4..12]);
            p.tcp_hlen = doff as u8;
            parsed::L4
        }
        IPPROTO_UDP => {
            if p.l4_off + 8 > end {
                return parsed::UNPARSED;
            }
            let Some(h) = header::<8>(ctx, p.l4_off) else {
                return parsed::UNPARSED;
            };
            p.sport_be = u16::from_ne_bytes([h[0], h[1]]);
            p.dport_be = u16::from_ne_bytes([h[2], h[3]]);
            parsed::L4
        }
        _ => {
            // ICMP (IPv4) or ICMPv6: only errors matter, and only unfragmented ones (a
            // fragmented ICMP error is nothing a router sends).
            let mut h = [0u8; 4];
            if p.l4_off + 8 > end || !load(ctx, p.l4_off, &mut h) {
                return parsed::UNPARSED;
            }
            p.tcp_flags = h[0];
            let error = if p.v6 != 0 {
                matches!(
                    h[0],
                    ICMPV6_DEST_UNREACH | ICMPV6_PKT_TOOBIG | ICMPV6_TIME_EXCEED | ICMPV6_PARAMPROB
                )
            } else {
                matches!(
                    h[0],
                    ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETERPROB
                )
            };
            if error && p.first_frag == 0 {
                parsed::ICMP_ERROR
            } else {
                parsed::OTHER
            }
        }
    }
}
