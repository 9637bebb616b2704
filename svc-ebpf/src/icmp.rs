//! ICMP and ICMPv6 errors about translated flows (destination unreachable, fragmentation
//! needed / packet too big, time exceeded), translated as netfilter's NAT translates
//! "related" packets: the quoted packet is one of the flow's, so the flow's entry says how
//! the error must look on the other side of the translation.
//!
//! The error travels opposite to the packet it quotes: reversed, the quoted tuple is the
//! tuple of the flow's packets that travel the error's way, and that direction's entry
//! translates it. The outer header changes as such a packet would (its source where the
//! translation changes sources, its destination where it changes destinations), and the
//! quoted packet the other way round, with its IPv4 header checksum, its TCP/UDP checksum
//! when the quote holds it, and the ICMP checksum over all of it. So a client behind a
//! NodePort learns the path MTU to a remote backend, and a backend learns the client's.

use aya_ebpf::programs::TcContext;
use svc_common::{ct_dir, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    csum, ct,
    nat::{self, store, End, Endpoint},
    pkt::{self, load, parsed, Pkt, Upper, IPV4_HLEN, IPV6_HLEN, L3},
    scratch::Scratch,
};

/// Outcome of `translate` (numbered as the constants it replaced).
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Translated {
    NotOurs = 0,
    /// Translated; the outer destination changed only (the stack can deliver it).
    Dst = 1,
    /// Translated and its outer source changed: it leaves from a frontend or SNAT address, so
    /// the caller forwards it itself.
    Src = 2,
    /// The quoted packet could not be read.
    Unparsed = 3,
    /// A helper failed half way: drop it.
    Failed = 4,
    /// Translated, about a pod's hairpin flow (`HAIRPIN`): it goes back to the pod that sent
    /// it, into its device.
    Back = 5,
}

/// `parse_inner`'s answer: the quote read, or why `translate` stops there.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quote {
    Read,
    /// Neither TCP nor UDP: no flow of svc's.
    NotOurs,
    Unparsed,
}

/// Directions `translate` looks the flow up in (bits).
pub const FORWARD: u32 = 1;
pub const REPLY: u32 = 2;
/// The REPLY direction, for an error whose sender is the flow's client too: a pod that
/// reached itself through a frontend (hairpin) answers its own packet, which came from the
/// frontend on a SNAT port, and the error goes back to it as the error about the packet it
/// sent.
pub const HAIRPIN: u32 = 4;
/// With `REPLY`, at the external egress: the error answers a packet sent to a local backend.
/// A closed flow's REPLY entry is not its flow: it is the quote's only for a direct
/// connection from the closed flow's client port to its backend, refused with this error
/// (`ct::ANSWER`, as for a refusal's RST). The flow's entries go and the error leaves
/// untranslated, so the client's connect learns of it.
pub const ANSWERS: u32 = 8;

/// The packet an ICMP error quotes. C layout with its padding named: `svc_icmp_rewrite`
/// takes it by pointer, and the verifier checks that every byte of its size is written.
#[repr(C)]
#[derive(Default)]
pub struct Inner {
    l3: u32,
    l4: u32,
    saddr: [u8; 16],
    daddr: [u8; 16],
    sport_be: u16,
    dport_be: u16,
    proto: u8,
    _pad: [u8; 3],
}

// Every byte named: a byte of padding left unwritten is one 5.15's and 6.1's verifiers refuse
// to let `svc_icmp_rewrite` read.
const _: () = assert!(core::mem::size_of::<Inner>() == 48);

#[inline(never)]
fn parse_inner(ctx: &TcContext, p: &Pkt, inner: &mut Inner) -> Quote {
    inner.l3 = p.l4_off + 8;
    if p.v6 != 0 {
        let mut h = [0u8; IPV6_HLEN as usize];
        if !load(ctx, inner.l3, &mut h) {
            return Quote::Unparsed;
        }
        inner.saddr.copy_from_slice(&h[8..24]);
        inner.daddr.copy_from_slice(&h[24..40]);
        let mut up = Upper::default();
        if pkt::ipv6_upper(ctx, inner.l3 + IPV6_HLEN, h[6], &mut up) != parsed::L4 {
            return Quote::Unparsed;
        }
        inner.l4 = up.off;
        inner.proto = up.proto;
    } else {
        let mut h = [0u8; IPV4_HLEN as usize];
        if !load(ctx, inner.l3, &mut h) {
            return Quote::Unparsed;
        }
        let ihl = (h[0] & 0x0f) as u32 * 4;
        // A quoted later fragment has no ports.
        if ihl < IPV4_HLEN || pkt::be16([h[6], h[7]]) & 0x1fff != 0 {
            return Quote::Unparsed;
        }
        inner.saddr = svc_common::v4_mapped([h[12], h[13], h[14], h[15]]);
        inner.daddr = svc_common::v4_mapped([h[16], h[17], h[18], h[19]]);
        inner.l4 = inner.l3 + ihl;
        inner.proto = h[9];
    }
    if inner.proto != IPPROTO_TCP && inner.proto != IPPROTO_UDP {
        return Quote::NotOurs;
    }
    let mut ports = [0u8; 4];
    if !load(ctx, inner.l4, &mut ports) {
        return Quote::Unparsed;
    }
    inner.sport_be = u16::from_ne_bytes([ports[0], ports[1]]);
    inner.dport_be = u16::from_ne_bytes([ports[2], ports[3]]);
    Quote::Read
}

/// Translates the ICMP error `s.p` if it quotes a packet of a flow this path (`pod`) tracks,
/// in one of the directions `dirs`.
#[inline(always)]
pub fn translate(ctx: &TcContext, s: &mut Scratch, dirs: u32, pod: bool, now: u64) -> Translated {
    let p = &s.p;
    let mut inner = Inner::default();
    match parse_inner(ctx, p, &mut inner) {
        Quote::Read => {}
        Quote::NotOurs => return Translated::NotOurs,
        Quote::Unparsed => return Translated::Unparsed,
    }
    // The flow's packets that travel the way the error does: the quoted tuple reversed.
    let flow = &mut s.flow;
    *flow = *p;
    flow.saddr = inner.daddr;
    flow.daddr = inner.saddr;
    flow.sport_be = inner.dport_be;
    flow.dport_be = inner.sport_be;
    flow.proto = inner.proto;
    let mut dir = ct_dir::FORWARD;
    let mut found = dirs & FORWARD != 0
        && ct::peek(&ct::key_of(flow, dir), pod, false, now, &mut s.v) == ct::Found::Hit;
    if !found && dirs & (REPLY | HAIRPIN) != 0 {
        dir = ct_dir::REPLY;
        let answers = dirs & ANSWERS != 0;
        found = ct::peek(&ct::key_of(flow, dir), pod, answers, now, &mut s.v) == ct::Found::Hit;
    }
    if !found {
        return Translated::NotOurs;
    }
    let (src, dst) = (&mut s.src, &mut s.dst);
    ct::translated(flow, dir, &s.v, src, dst);
    // Any other reply's error is translated where the flow's replies are, on the way to
    // its client.
    let back = dir == ct_dir::REPLY && dirs & REPLY == 0;
    if back && dst.addr != p.saddr {
        return Translated::NotOurs;
    }
    let src_changed = src.addr != flow.saddr || src.port_be != flow.sport_be;
    let dst_changed = dst.addr != flow.daddr || dst.port_be != flow.dport_be;

    // The quoted packet: its source becomes the flow's new destination and the other way
    // round.
    if svc_icmp_rewrite(ctx.skb.skb, p, &inner, dst, src) == 0 {
        return Translated::Failed;
    }
    // The outer header.
    let icmp_csum = p.l4_off + 2;
    if src_changed && !nat::set_addr(ctx, p, End::Src, &p.saddr, &src.addr, icmp_csum) {
        return Translated::Failed;
    }
    if dst_changed && !nat::set_addr(ctx, p, End::Dst, &p.daddr, &dst.addr, icmp_csum) {
        return Translated::Failed;
    }
    if back {
        Translated::Back
    } else if src_changed {
        Translated::Src
    } else {
        Translated::Dst
    }
}

/// `rewrite_inner` of the packet `skb` (its context), a global function (BTF linkage global,
/// as a `no_mangle` public function gets): the verifier checks it once for each program, with
/// its arguments unknown, and then takes each call for its type alone. As a static function it
/// was checked again for each way `translate` reached it (the quote's family and protocol, the
/// direction its flow was found in, which ends changed): making it global took 17 % off the
/// external ingress's count and 36–38 % off the other tc programs' (docs/design/packet-datapath.md,
/// "What the verifier costs"). Its pointers are the caller's, passed rather than found again,
/// so the compiler sees the call read what the caller wrote there. It changes the packet:
/// verifiers before 6.13 do not see that a global function may, and keep the caller's direct
/// packet pointers valid across the call, so the callers reach the packet through helpers
/// only after it. 1: rewritten; 0: a helper failed.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn svc_icmp_rewrite(
    skb: *mut aya_ebpf::bindings::__sk_buff,
    p: *const Pkt,
    inner: *const Inner,
    src: *const Endpoint,
    dst: *const Endpoint,
) -> i64 {
    if p.is_null() || inner.is_null() || src.is_null() || dst.is_null() {
        return 0;
    }
    let ctx = TcContext::new(skb);
    // SAFETY: the caller's packet, quote and translation, each of its type's size (the
    // verifier checked each call for it), read only.
    let (p, inner, src, dst) = unsafe { (&*p, &*inner, &*src, &*dst) };
    rewrite_inner(&ctx, p, inner, src, dst) as i64
}

/// Rewrites the quoted packet's tuple to `src` -> `dst`, with its checksums and the ICMP
/// checksum that covers them. Called by `svc_icmp_rewrite` alone, inlined there: the checksum
/// arithmetic keeps many values alive, which LLVM spills to the stack of that frame.
#[inline(always)]
fn rewrite_inner(ctx: &TcContext, p: &Pkt, inner: &Inner, src: &Endpoint, dst: &Endpoint) -> bool {
    let v6 = p.v6 != 0;
    let d_addrs = csum::add(
        csum::diff_addr(&inner.saddr, &src.addr),
        csum::diff_addr(&inner.daddr, &dst.addr),
    );
    let d_ports = csum::add(
        csum::diff16(inner.sport_be, src.port_be),
        csum::diff16(inner.dport_be, dst.port_be),
    );
    // Everything the ICMP checksum must absorb.
    let mut d_icmp = csum::add(d_addrs, d_ports);

    let stored = if v6 {
        store(ctx, inner.l3 + 8, src.addr.as_ptr(), 16, 0)
            && store(ctx, inner.l3 + 24, dst.addr.as_ptr(), 16, 0)
    } else {
        store(ctx, inner.l3 + 12, src.addr[12..].as_ptr(), 4, 0)
            && store(ctx, inner.l3 + 16, dst.addr[12..].as_ptr(), 4, 0)
    };
    if !stored {
        return false;
    }
    let ports = [src.port_be, dst.port_be];
    if !store(ctx, inner.l4, ports.as_ptr().cast(), 4, 0) {
        return false;
    }
    if !v6 {
        let mut c = [0u8; 2];
        if !load(ctx, inner.l3 + 10, &mut c) {
            return false;
        }
        let old = u16::from_ne_bytes(c);
        let new = csum::apply(old, d_addrs);
        if !store(ctx, inner.l3 + 10, (&new as *const u16).cast(), 2, 0) {
            return false;
        }
        d_icmp = csum::add(d_icmp, csum::diff16(old, new));
    }
    // The quoted TCP/UDP checksum, when the quote reaches it (UDP's always, TCP's when more
    // than the 8 bytes IPv4 requires were quoted).
    let l4_csum = if inner.proto == IPPROTO_TCP {
        inner.l4 + 16
    } else {
        inner.l4 + 6
    };
    let mut c = [0u8; 2];
    if l4_csum + 2 <= L3 + p.ip_len && load(ctx, l4_csum, &mut c) {
        let old = u16::from_ne_bytes(c);
        // An IPv4 UDP checksum of 0 means none: it stays 0.
        if !(old == 0 && inner.proto == IPPROTO_UDP && !v6) {
            let mut new = csum::apply(old, csum::add(d_addrs, d_ports));
            if new == 0 && inner.proto == IPPROTO_UDP {
                new = 0xffff;
            }
            if !store(ctx, l4_csum, (&new as *const u16).cast(), 2, 0) {
                return false;
            }
            d_icmp = csum::add(d_icmp, csum::diff16(old, new));
        }
    }
    csum::l4_diff(ctx, p.l4_off + 2, d_icmp, 0)
}
