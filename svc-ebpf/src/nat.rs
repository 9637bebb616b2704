//! Rewriting a packet's addresses and ports, with every checksum that covers them.

use crate::{
    csum,
    pkt::{Pkt, IPPROTO_ICMP, L3},
};
use aya_ebpf::{helpers::generated::bpf_skb_store_bytes, programs::TcContext};

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
        let d = csum::diff_addr(old, new);
        csum::l4_diff(ctx, csum_off, d, csum::l4_flags(p.proto, true, true))
            && store(ctx, off, new.as_ptr(), 16, 0)
    } else {
        let from = u32::from_ne_bytes([old[12], old[13], old[14], old[15]]);
        let to = u32::from_ne_bytes([new[12], new[13], new[14], new[15]]);
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

/// Replaces the source or destination port of a TCP or UDP packet whose header is at
/// `l4_off`.
#[inline(always)]
pub fn set_port(ctx: &TcContext, p: &Pkt, end: End, old_be: u16, new_be: u16) -> bool {
    if old_be == new_be {
        return true;
    }
    let off = match end {
        End::Src => p.l4_off,
        End::Dst => p.l4_off + 2,
    };
    let flags = csum::l4_flags(p.proto, p.v6 != 0, false);
    csum::l4_replace(ctx, p.csum_off(), old_be as u32, new_be as u32, 2, flags)
        && store(ctx, off, (&new_be as *const u16).cast(), 2, 0)
}

/// Rewrites the packet's tuple: `saddr`/`sport` to `src`, `daddr`/`dport` to `dst` where
/// they differ.
#[inline(never)]
pub fn rewrite(ctx: &TcContext, p: &Pkt, src: &Endpoint, dst: &Endpoint) -> bool {
    let csum_off = p.csum_off();
    if src.addr != p.saddr && !set_addr(ctx, p, End::Src, &p.saddr, &src.addr, csum_off) {
        return false;
    }
    if dst.addr != p.daddr && !set_addr(ctx, p, End::Dst, &p.daddr, &dst.addr, csum_off) {
        return false;
    }
    set_port(ctx, p, End::Src, p.sport_be, src.port_be)
        && set_port(ctx, p, End::Dst, p.dport_be, dst.port_be)
}

/// An address and a port, network byte order.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: [u8; 16],
    pub port_be: u16,
}

/// Counts a hop for a packet the program forwards itself (the stack would have): false when
/// its TTL or hop limit is spent.
#[inline(always)]
pub fn dec_ttl(ctx: &TcContext, v6: bool) -> bool {
    if v6 {
        let mut hl = [0u8; 1];
        if !crate::pkt::load(ctx, L3 + 7, &mut hl) || hl[0] <= 1 {
            return false;
        }
        hl[0] -= 1;
        return store(ctx, L3 + 7, hl.as_ptr(), 1, 0);
    }
    // TTL and protocol share a 16-bit word of the header checksum.
    let mut w = [0u8; 2];
    if !crate::pkt::load(ctx, L3 + 8, &mut w) || w[0] <= 1 {
        return false;
    }
    let from = u16::from_ne_bytes(w);
    w[0] -= 1;
    let to = u16::from_ne_bytes(w);
    csum::l3_replace(ctx, L3 + 10, from as u32, to as u32, 2)
        && store(ctx, L3 + 8, w.as_ptr(), 2, 0)
}
