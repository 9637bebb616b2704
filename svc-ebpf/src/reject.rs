//! Answers built from the packet itself and sent back out of the device it came in on: a TCP
//! RST or an ICMP/ICMPv6 port unreachable when a frontend has no usable backend (as
//! kube-proxy's REJECT), ICMP fragmentation needed / ICMPv6 packet too big when a packet the
//! program would forward does not fit the route's MTU, and ICMP time exceeded when its hop
//! would spend its TTL (as the kernel's forwarding answers, so traceroute shows the node).
//!
//! The packet is turned into the answer in place: cut or grown to the answer's length
//! (bpf_skb_change_tail), headers written afresh, checksums computed from scratch. The answer
//! comes from the address the client sent to. ICMP errors other than fragmentation needed are
//! rate-limited per CPU, as the kernel limits its own (`icmp_allowed`); a TCP RST is not.

use aya_ebpf::{
    bindings::{BPF_F_RECOMPUTE_CSUM, TC_ACT_SHOT},
    helpers::generated::{bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use svc_common::{Reason, IPPROTO_TCP};

use crate::{
    csum, fwd,
    maps::count,
    nat::store,
    pkt::{
        load, Pkt, ICMPV6_PKT_TOOBIG, ICMPV6_PORT_UNREACH, ICMPV6_TIME_EXCEED, ICMP_DEST_UNREACH,
        ICMP_FRAG_NEEDED, ICMP_PORT_UNREACH, ICMP_TIME_EXCEEDED, IPPROTO_ICMP, IPPROTO_ICMPV6,
        IPV4_HLEN, IPV6_HLEN, L3, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
    },
    scratch::{IcmpBucket, Scratch, QUOTE_MAX},
};

const TTL: u8 = 64;

/// ICMP errors a CPU sends per second at most, and at once after a quiet spell: the kernel's
/// defaults for the errors it sends itself (`net.ipv4.icmp_msgs_per_sec`, `icmp_msgs_burst`;
/// the kernel counts them for the whole node). A flood of packets svc must answer does not
/// become a flood of answers. Fragmentation needed / packet too big is not limited, as in the
/// kernel: PMTU discovery needs every one.
const ICMP_RATE_PER_S: u64 = 1000;
const ICMP_BURST: u64 = 50;

/// Whether this CPU may send an ICMP error at `now` (coarse clock, ns): a token bucket,
/// `ICMP_RATE_PER_S` tokens a second up to `ICMP_BURST`. It starts full: the first call
/// finds a long time since `at_ns` (0).
#[inline(always)]
fn icmp_allowed(b: &mut IcmpBucket, now: u64) -> bool {
    const NS_PER_TOKEN: u64 = 1_000_000_000 / ICMP_RATE_PER_S;
    let earned = now.saturating_sub(b.at_ns) / NS_PER_TOKEN;
    if earned > 0 {
        b.tokens = b.tokens.saturating_add(earned).min(ICMP_BURST);
        b.at_ns = now;
    }
    if b.tokens == 0 {
        return false;
    }
    b.tokens -= 1;
    true
}

/// What the ICMP error says.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    PortUnreachable,
    /// Fragmentation needed / packet too big, with the MTU that fits.
    TooBig(u32),
    /// Time exceeded in transit (TTL or hop limit).
    TimeExceeded,
}

/// Rejects the packet `s.p`: an RST for TCP (none for an RST), an ICMP port unreachable for
/// UDP.
#[inline(never)]
pub fn reject(ctx: &TcContext, s: &mut Scratch) -> i32 {
    if !answerable(ctx, &s.p) {
        return TC_ACT_SHOT;
    }
    if s.p.proto == IPPROTO_TCP {
        rst(ctx, &s.p)
    } else {
        icmp_error(ctx, s, Kind::PortUnreachable)
    }
}

/// Whether `p` may be answered at all: it came to this host's own link-layer address (not as
/// a broadcast or multicast frame), from an address an answer can go to (not unspecified,
/// loopback, multicast or IPv4's broadcast and reserved range), as RFC 1812 (4.3.2.7) and RFC
/// 4443 (2.4 e) require of ICMP errors and the kernel checks before it sends one or an RST.
/// Otherwise the packet is dropped unanswered.
#[inline(always)]
fn answerable(ctx: &TcContext, p: &Pkt) -> bool {
    const PACKET_HOST: u32 = 0;
    // SAFETY: the kernel's __sk_buff; a single field load.
    if unsafe { (*ctx.skb.skb).pkt_type } != PACKET_HOST {
        return false;
    }
    let a = &p.saddr;
    if p.v6 == 0 {
        // ::ffff:a.b.c.d: 0.0.0.0/8, 127.0.0.0/8, and 224.0.0.0 upwards (multicast, reserved,
        // the broadcast address).
        return !matches!(a[12], 0 | 127 | 224..=255);
    }
    let unspecified_or_loopback = a[..15].iter().all(|b| *b == 0) && a[15] <= 1;
    !(unspecified_or_loopback || a[0] == 0xff)
}

#[inline(always)]
fn opaque(v: u32) -> u32 {
    // SAFETY: reads a local.
    unsafe { core::ptr::read_volatile(&v) }
}

/// Resizes the packet to `len` bytes.
#[inline(always)]
fn resize(ctx: &TcContext, len: u32) -> bool {
    // SAFETY: the helper checks the length.
    unsafe { bpf_skb_change_tail(ctx.skb.skb.cast(), len, 0) == 0 }
}

/// The IPv4 header of an answer carrying `payload` bytes of `proto`, checksum included.
#[inline(always)]
fn ipv4_header(p: &Pkt, proto: u8, payload: u32) -> [u8; 20] {
    let tot = ((IPV4_HLEN + payload) as u16).to_be_bytes();
    let mut h = [
        0x45, 0, tot[0], tot[1], 0, 0, 0, 0, TTL, proto, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    h[12..16].copy_from_slice(&p.daddr[12..]);
    h[16..20].copy_from_slice(&p.saddr[12..]);
    // SAFETY: a local of 20 bytes.
    let s = unsafe { csum::sum(h.as_ptr(), 20, 0) };
    let c = (!csum::fold(s as u32)).to_ne_bytes();
    h[10] = c[0];
    h[11] = c[1];
    h
}

/// The IPv6 header of an answer carrying `payload` bytes of `next`.
#[inline(always)]
fn ipv6_header(p: &Pkt, next: u8, payload: u32) -> [u8; 40] {
    let len = (payload as u16).to_be_bytes();
    let mut h = [0u8; 40];
    h[0] = 0x60;
    h[4] = len[0];
    h[5] = len[1];
    h[6] = next;
    h[7] = TTL;
    h[8..24].copy_from_slice(&p.daddr);
    h[24..40].copy_from_slice(&p.saddr);
    h
}

/// The partial sum of the pseudo-header of an answer to `p` carrying `len` bytes of `proto`.
#[inline(always)]
fn pseudo_sum(p: &Pkt, proto: u8, len: u32) -> u32 {
    if p.v6 != 0 {
        let mut ph = [0u8; 40];
        ph[0..16].copy_from_slice(&p.daddr);
        ph[16..32].copy_from_slice(&p.saddr);
        ph[32..36].copy_from_slice(&len.to_be_bytes());
        ph[39] = proto;
        // SAFETY: a local of 40 bytes.
        unsafe { csum::sum(ph.as_ptr(), 40, 0) as u32 }
    } else {
        let mut ph = [0u8; 12];
        ph[0..4].copy_from_slice(&p.daddr[12..]);
        ph[4..8].copy_from_slice(&p.saddr[12..]);
        ph[9] = proto;
        ph[10..12].copy_from_slice(&(len as u16).to_be_bytes());
        // SAFETY: a local of 12 bytes.
        unsafe { csum::sum(ph.as_ptr(), 12, 0) as u32 }
    }
}

/// Writes the answer's IP header for `payload` bytes of `proto`; the answer's L4 header
/// follows at the returned offset.
#[inline(always)]
fn write_ip(ctx: &TcContext, p: &Pkt, proto: u8, payload: u32) -> Option<u32> {
    let flags = BPF_F_RECOMPUTE_CSUM as u64;
    if p.v6 != 0 {
        let h = ipv6_header(p, proto, payload);
        store(ctx, L3, h.as_ptr(), IPV6_HLEN, flags).then_some(L3 + IPV6_HLEN)
    } else {
        let h = ipv4_header(p, proto, payload);
        store(ctx, L3, h.as_ptr(), IPV4_HLEN, flags).then_some(L3 + IPV4_HLEN)
    }
}

#[inline(always)]
fn ip_hlen(p: &Pkt) -> u32 {
    if p.v6 != 0 {
        IPV6_HLEN
    } else {
        IPV4_HLEN
    }
}

/// A TCP RST answering `p`, as a TCP stack answers a segment for a closed port (RFC 793):
/// acknowledging what the segment carried, or with the sequence number it acknowledged.
#[inline(always)]
pub fn rst(ctx: &TcContext, p: &Pkt) -> i32 {
    if p.tcp_flags & TCP_RST != 0 {
        return TC_ACT_SHOT;
    }
    let mut t = [0u8; 20];
    if !load(ctx, p.l4_off, &mut t) {
        return TC_ACT_SHOT;
    }
    let doff = (t[12] >> 4) as u32 * 4;
    let seg_len = (L3 + p.ip_len).saturating_sub(p.l4_off + doff)
        + (p.tcp_flags & TCP_SYN != 0) as u32
        + (p.tcp_flags & TCP_FIN != 0) as u32;
    let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
    let mut h = [0u8; 20];
    h[0..2].copy_from_slice(&t[2..4]);
    h[2..4].copy_from_slice(&t[0..2]);
    h[12] = 5 << 4;
    if p.tcp_flags & TCP_ACK != 0 {
        h[4..8].copy_from_slice(&t[8..12]);
        h[13] = TCP_RST;
    } else {
        h[8..12].copy_from_slice(&seq.wrapping_add(seg_len).to_be_bytes());
        h[13] = TCP_RST | TCP_ACK;
    }
    let seed = pseudo_sum(p, IPPROTO_TCP, 20);
    // SAFETY: a local of 20 bytes.
    let s = unsafe { csum::sum(h.as_ptr(), 20, seed) };
    let c = (!csum::fold(s as u32)).to_ne_bytes();
    h[16] = c[0];
    h[17] = c[1];
    if !resize(ctx, L3 + ip_hlen(p) + 20) {
        return TC_ACT_SHOT;
    }
    let Some(l4) = write_ip(ctx, p, IPPROTO_TCP, 20) else {
        return TC_ACT_SHOT;
    };
    if !store(ctx, l4, h.as_ptr(), 20, BPF_F_RECOMPUTE_CSUM as u64) {
        return TC_ACT_SHOT;
    }
    fwd::bounce(ctx, p.ifindex)
}

/// An ICMP (IPv4) or ICMPv6 error about `s.p`, quoting its IP header, extension headers and
/// the first 8 bytes of its transport header.
#[inline(always)]
pub fn icmp_error(ctx: &TcContext, s: &mut Scratch, kind: Kind) -> i32 {
    if !answerable(ctx, &s.p) {
        return TC_ACT_SHOT;
    }
    if !matches!(kind, Kind::TooBig(_)) && !icmp_allowed(&mut s.icmp, crate::lb::clock_ns()) {
        count(Reason::IcmpRateLimited, s.p.ifindex);
        return TC_ACT_SHOT;
    }
    let p = &s.p;
    let buf = s.quote.as_mut_ptr();
    // IP header, extension headers and 8 bytes of L4: at least 28 bytes, a multiple of 4
    // (as the checksum helper wants). The helpers want a length the verifier knows is within
    // 1..=QUOTE_MAX: built by arithmetic alone (a mask, then +4), as LLVM turns range checks
    // into a test of a copy the verifier does not connect to the value.
    let quote = (p.l4_off - L3 + 8).min(QUOTE_MAX);
    let quote = (opaque(quote - 4) & (QUOTE_MAX - 4)) + 4;
    // SAFETY: buf is a map value of QUOTE_MAX bytes; quote is at most that.
    if unsafe { bpf_skb_load_bytes(ctx.skb.skb.cast(), L3, buf.cast(), quote) } != 0 {
        return TC_ACT_SHOT;
    }
    let v6 = p.v6 != 0;
    let (proto, typ, code, rest) = match (v6, kind) {
        (false, Kind::PortUnreachable) => (IPPROTO_ICMP, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0),
        (false, Kind::TooBig(mtu)) => (IPPROTO_ICMP, ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, mtu),
        (true, Kind::PortUnreachable) => (IPPROTO_ICMPV6, 1, ICMPV6_PORT_UNREACH, 0),
        (true, Kind::TooBig(mtu)) => (IPPROTO_ICMPV6, ICMPV6_PKT_TOOBIG, 0, mtu),
        (false, Kind::TimeExceeded) => (IPPROTO_ICMP, ICMP_TIME_EXCEEDED, 0, 0),
        (true, Kind::TimeExceeded) => (IPPROTO_ICMPV6, ICMPV6_TIME_EXCEED, 0, 0),
    };
    let len = 8 + quote;
    let mut h = [0u8; 8];
    h[0] = typ;
    h[1] = code;
    h[4..8].copy_from_slice(&rest.to_be_bytes());
    let seed = if v6 { pseudo_sum(p, proto, len) } else { 0 };
    // SAFETY: a local of 8 bytes; buf holds `quote` bytes the load above wrote.
    let s = unsafe { csum::sum(buf.cast(), quote, csum::sum(h.as_ptr(), 8, seed) as u32) };
    let c = (!csum::fold(s as u32)).to_ne_bytes();
    h[2] = c[0];
    h[3] = c[1];
    if !resize(ctx, L3 + ip_hlen(p) + len) {
        return TC_ACT_SHOT;
    }
    let Some(l4) = write_ip(ctx, p, proto, len) else {
        return TC_ACT_SHOT;
    };
    let flags = BPF_F_RECOMPUTE_CSUM as u64;
    if !store(ctx, l4, h.as_ptr(), 8, flags) || !store(ctx, l4 + 8, buf.cast(), quote, flags) {
        return TC_ACT_SHOT;
    }
    fwd::bounce(ctx, p.ifindex)
}
