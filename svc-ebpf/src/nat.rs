//! Rewriting a packet's addresses and ports, with every checksum that covers them.

use crate::{
    csum,
    pkt::{Pkt, IPPROTO_ICMP, L3},
};
use aya_ebpf::{
    bindings::BPF_F_RECOMPUTE_CSUM, helpers::generated::bpf_skb_store_bytes, programs::TcContext,
};

/// Which end of the tuple.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum End {
    Src,
    Dst,
}

/// Writes `len` bytes from `from` at `off`.
#[inline(always)]
pub fn store(ctx: &TcContext, off: u32, from: *const u8, len: u32, flags: u64) -> bool {
    // SAFETY: `from` points at `len` initialized bytes (callers pass arrays); the helper
    // checks the packet bounds.
    unsafe { bpf_skb_store_bytes(ctx.skb.skb.cast(), off, from.cast(), len, flags) == 0 }
}

/// Offset of an address in the IP header at `l3`.
#[inline(always)]
fn addr_off(v6: bool, l3: u32, end: End) -> u32 {
    match (v6, end) {
        (false, End::Src) => l3 + 12,
        (false, End::Dst) => l3 + 16,
        (true, End::Src) => l3 + 8,
        (true, End::Dst) => l3 + 24,
    }
}

/// Replaces the source or destination address of the packet (`old` with `new`), updating
/// the IPv4 header checksum and the L4 checksum at `csum_off`, whose pseudo-header holds the
/// address (none for ICMPv4: its checksum does not cover the IP header).
#[inline(always)]
pub fn set_addr(
    ctx: &TcContext,
    p: &Pkt,
    end: End,
    old: &[u8; 16],
    new: &[u8; 16],
    csum_off: u32,
) -> bool {
    let v6 = p.v6 != 0;
    let off = addr_off(v6, L3, end);
    let pseudo = p.proto != IPPROTO_ICMP;
    if v6 {
        let later = p.later_frag != 0;
        let d = csum::diff_addr(old, new);
        // A later fragment has no L4 checksum here to take the change: skb->csum
        // (CHECKSUM_COMPLETE) must.
        (later || csum::l4_diff(ctx, csum_off, d, csum::l4_flags(p.proto, true, true)))
            && store(
                ctx,
                off,
                new.as_ptr(),
                16,
                if later {
                    BPF_F_RECOMPUTE_CSUM as u64
                } else {
                    0
                },
            )
    } else {
        let (from, to) = (v4_word(old), v4_word(new));
        (!pseudo
            || csum::l4_replace(
                ctx,
                csum_off,
                from,
                to,
                4,
                csum::l4_flags(p.proto, false, true),
            ))
            && csum::l3_replace(ctx, L3 + 10, from, to, 4)
            && store(ctx, off, new[12..].as_ptr(), 4, 0)
    }
}

/// Rewrites the packet's tuple: `saddr`/`sport` to `src`, `daddr`/`dport` to `dst` where
/// they differ, and with `hop` counts a hop (TTL or hop limit one less: the caller forwards
/// the packet itself, as a router; it checked that the TTL allows). Helper calls are most of
/// a translated packet's cost, so fields that lie side by side are changed together: both
/// ports (TCP, UDP), and in IPv4 the TTL, the header checksum and both addresses. A SNATed
/// IPv4 packet forwarded so takes 4 calls where one field at a time took 13. The L4 checksum
/// takes the addresses' change and the ports' apart: only a pseudo-header change also
/// updates skb->csum for CHECKSUM_COMPLETE, and only it is applied to a CHECKSUM_PARTIAL
/// packet's field. A later fragment (`Pkt::later_frag`) has its addresses rewritten alone:
/// its datagram's ports and L4 checksum lie in the first fragment, translated already.
#[inline(never)]
pub fn rewrite(ctx: &TcContext, p: &Pkt, src: &Endpoint, dst: &Endpoint, hop: bool) -> bool {
    let csum_off = p.csum_off();
    let addrs = if p.v6 != 0 {
        (src.addr == p.saddr || set_addr(ctx, p, End::Src, &p.saddr, &src.addr, csum_off))
            && (dst.addr == p.daddr || set_addr(ctx, p, End::Dst, &p.daddr, &dst.addr, csum_off))
            && (!hop || store(ctx, L3 + 7, &p.ttl.wrapping_sub(1), 1, 0))
    } else {
        set_addrs_v4(
            ctx,
            p,
            v4_word(&src.addr),
            v4_word(&dst.addr),
            csum_off,
            hop,
        )
    };
    if !addrs {
        return false;
    }
    if p.later_frag != 0 || (src.port_be == p.sport_be && dst.port_be == p.dport_be) {
        return true;
    }
    let d = csum::add(
        csum::diff16(p.sport_be, src.port_be),
        csum::diff16(p.dport_be, dst.port_be),
    );
    let ports = [src.port_be, dst.port_be];
    csum::l4_diff(ctx, csum_off, d, csum::l4_flags(p.proto, p.v6 != 0, false))
        && store(ctx, p.l4_off, ports.as_ptr().cast(), 4, 0)
}

/// The IPv4 header from the TTL to the destination address, as it lies in the packet.
#[repr(C)]
struct V4Tail {
    ttl: u8,
    proto: u8,
    check: u16,
    saddr: u32,
    daddr: u32,
}

/// Both IPv4 addresses and the TTL at once, the header checksum computed here (the helper
/// only applies the same difference to the field). IPv6 keeps one address at a time: both
/// families done so, as first written, grew `rewrite`'s frame from 104 to 176 bytes, past
/// the verifier's stack limit on the external ingress's deepest call chain.
#[inline(always)]
fn set_addrs_v4(ctx: &TcContext, p: &Pkt, s: u32, d: u32, csum_off: u32, hop: bool) -> bool {
    let (old_s, old_d) = (v4_word(&p.saddr), v4_word(&p.daddr));
    let moved = s != old_s || d != old_d;
    if !moved && !hop {
        return true;
    }
    let diff = csum::add(csum::diff32(old_s, s), csum::diff32(old_d, d));
    // ICMPv4's checksum covers no pseudo-header.
    if moved
        && p.proto != IPPROTO_ICMP
        && p.later_frag == 0
        && !csum::l4_diff(ctx, csum_off, diff, csum::l4_flags(p.proto, false, true))
    {
        return false;
    }
    // TTL and protocol share a 16-bit word of the header checksum.
    let ttl = p.ttl.wrapping_sub(hop as u8);
    let ttl_diff = csum::diff16(
        u16::from_ne_bytes([p.ttl, p.proto]),
        u16::from_ne_bytes([ttl, p.proto]),
    );
    let tail = V4Tail {
        ttl,
        proto: p.proto,
        check: csum::apply(p.ip_check, csum::add(diff, ttl_diff)),
        saddr: s,
        daddr: d,
    };
    store(ctx, L3 + 8, (&tail as *const V4Tail).cast(), 12, 0)
}

/// The IPv4 address of a mapped address, as it lies in memory.
#[inline(always)]
fn v4_word(a: &[u8; 16]) -> u32 {
    u32::from_ne_bytes([a[12], a[13], a[14], a[15]])
}

/// An address and a port, network byte order.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: [u8; 16],
    pub port_be: u16,
}
