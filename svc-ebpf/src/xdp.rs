//! The XDP program of the external devices (docs/design/xdp.md): flows to and from remote
//! backends, new and known, translated and sent back out of the device they came in on before
//! the kernel builds an skb for them. Everything else goes on to the tc programs untouched
//! (XDP_PASS), which then do what they always did.
//!
//! It shares the tc datapath's parser (pkt.rs), connection tracking (ct.rs, the same entries,
//! refreshed and tracked the same way), frontend lookup and backend choice (tc.rs
//! `ext_frontend`, lb.rs), the new flow's entries and SNAT port (tc.rs `commit_snat`) and route
//! lookup (fwd.rs); only the rewrite is its own, in place, as XDP has no skb helpers: every
//! header it changes lies in the linear data, so its checksums are updated by the same
//! arithmetic the helpers use (csum.rs).
//!
//! What it finishes: a client's packet of a SNATed flow (FORWARD entry), a remote backend's
//! reply to a SNAT address (REPLY entry), and the first packet of a new flow to an external
//! frontend whose backend is remote, when the route to the translated destination has a
//! known neighbour and leaves by the same device (XDP_TX) or by another one that carries this
//! program in the agent's mode (`SVC_XDP_DEVS`, XDP_REDIRECT). What it passes: anything
//! else, among it a flow to a local backend (the stack delivers it), a route needing the stack
//! (a neighbour to resolve, another device not in `SVC_XDP_DEVS`, a packet too big, a hop that
//! would spend the TTL; counted
//! `XdpPassRoute`), what tc refuses, drops or answers (no backend, a bad checksum),
//! fragments, ICMP errors, what it cannot parse, packets of flows being handed over
//! or out of their TCP window (tc drops them, counted there). A new flow is passed before
//! anything is stored. What its frontend alone drops (a client outside its source ranges, no
//! local backend under externalTrafficPolicy Local) it drops itself, counted as tc counts it.
//! A packet passed after its entry was found is looked up again by tc:
//! what the lookup recorded (flags ORed in, a sequence position) it records again, unchanged.

use aya_ebpf::{
    bindings::{xdp_action, BPF_FIB_LKUP_RET_SUCCESS},
    programs::XdpContext,
};
use svc_common::{ct_dir, ct_flags, node_addr_flags, Reason, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    csum, ct,
    ctx::Ctx,
    fwd, lb,
    maps::{count, count_service, SVC_XDP_DEVS},
    monitor,
    pkt::{self, parsed, L3},
    scratch::{self, Scratch},
    tc::{self, in_snat_range, Next},
};

const PASS: u32 = xdp_action::XDP_PASS;
const TX: u32 = xdp_action::XDP_TX;
const DROP: u32 = xdp_action::XDP_DROP;
const REDIRECT: u32 = xdp_action::XDP_REDIRECT;

/// Offsets past this are not written in place (the verifier needs a bound on a variable
/// offset); only a TCP or UDP header after long IPv6 extension headers lies there, and such a
/// packet goes on to tc.
const DIRECT_MAX: u32 = 1024;

#[inline(always)]
pub fn ext(ctx: &XdpContext) -> u32 {
    let Some(s) = scratch::get() else {
        return PASS;
    };
    // Fragments (the first one included: frag.rs records its ports from tc), ICMP errors,
    // other protocols and what does not parse are tc's, untouched and counted there.
    if pkt::parse(ctx, &mut s.p) != parsed::L4 || s.p.first_frag != 0 {
        return PASS;
    }
    if s.p.proto != IPPROTO_TCP && s.p.proto != IPPROTO_UDP {
        return PASS;
    }
    let node = lb::node_addr_flags(&s.p.daddr);
    if node == 0 {
        return PASS;
    }
    if s.p.proto == IPPROTO_TCP && !ct::valid_tcp_flags(s.p.tcp_flags) {
        // tc drops it, counted.
        return PASS;
    }
    let now = lb::clock_ns();
    // As the tc ingress: a packet to a SNAT address and port is a remote backend's reply.
    if in_snat_range(s.p.dport_be) && node & node_addr_flags::SNAT != 0 {
        match found(s, ct_dir::REPLY, now) {
            ct::Found::Hit => return send(ctx, s, Reason::XdpReply),
            ct::Found::Miss => {}
            _ => return PASS,
        }
    }
    match found(s, ct_dir::FORWARD, now) {
        ct::Found::Hit => {}
        ct::Found::Miss => return new_flow(ctx, s, node, now),
        ct::Found::Closed => {
            // A SYN on a closed flow's tuple: tc takes it over or removes it.
            count(Reason::XdpPassNew, s.p.ifindex);
            return PASS;
        }
        ct::Found::Invalid => return PASS,
    }
    // Being handed over: tc drops it while the mark holds, or lapses the mark.
    if s.v.flags & ct_flags::HANDING != 0 {
        return PASS;
    }
    // A local backend (or a client port remapped for one): the stack delivers it.
    if s.v.flags & ct_flags::SNAT == 0 || s.v.snat_addr == s.p.saddr {
        return PASS;
    }
    send(ctx, s, Reason::XdpCtHit)
}

/// The packet's entry of direction `dir` into `s.v`, refreshed, and its translation into
/// `s.src`/`s.dst` (as tc.rs's `found`).
#[inline(always)]
fn found(s: &mut Scratch, dir: u8, now: u64) -> ct::Found {
    let key = ct::key_of(&s.p, dir);
    let add = ct::packet_flags(&s.p, dir);
    let found = ct::lookup(&key, false, add, now, &mut s.v);
    if found == ct::Found::Hit {
        ct::translated(&s.p, dir, &s.v, &mut s.src, &mut s.dst);
    }
    found
}

/// A packet of no known flow: the first of a new one if its destination is an external
/// frontend (tc.rs `ext_frontend`, which leaves to tc what only it finishes, `Next::Tc`).
#[inline(never)]
fn new_flow(ctx: &XdpContext, s: &mut Scratch, node: u32, now: u64) -> u32 {
    let ifindex = s.p.ifindex;
    match tc::ext_frontend(ctx, s, node, now) {
        Next::NewSnat => new_snat(ctx, s),
        Next::NewLocal => {
            count(Reason::XdpPassLocal, ifindex);
            PASS
        }
        Next::Tc => {
            count(Reason::XdpPassNew, ifindex);
            PASS
        }
        // Outside the source ranges, or no local backend under externalTrafficPolicy Local:
        // counted as tc counts it.
        Next::Drop => DROP,
        // No frontend's; the middle of a connection svc has no flow for (tc counts it).
        _ => PASS,
    }
}

/// A new flow to a remote backend (`s.dst`, its entries in `s.new`), as tc's `ext_new_snat`
/// makes it: stored with a SNAT port and sent on, when its route has a known neighbour and
/// leaves by this device or by one of `SVC_XDP_DEVS`; else passed before anything is stored
/// (`XdpPassRoute`). Its entries are
/// those tc would store, so either program carries the flow on.
#[inline(never)]
fn new_snat(ctx: &XdpContext, s: &mut Scratch) -> u32 {
    let ifindex = s.p.ifindex;
    tc::route_to_backend(ctx, s);
    // Before anything is stored: a route XDP cannot take leaves the flow to tc whole.
    let action = exit(s);
    if action == PASS {
        count(Reason::XdpPassRoute, ifindex);
        return PASS;
    }
    let mut snat = [0u8; 16];
    if !tc::snat_addr(s, true, &mut snat) {
        // tc drops it (`err_rewrite`).
        count(Reason::XdpPassNew, ifindex);
        return PASS;
    }
    tc::settle_closed(s, false, Next::NewSnat, false);
    if !tc::commit_snat(s, &snat) {
        // Counted there, as tc counts it: tc would drop it too.
        return DROP;
    }
    // The flow is made: the Service's new flow, whoever sends its first packet.
    count_service(Reason::New, s.new.fwd.id);
    if !rewrite(ctx, s) {
        // Stored, not written (a header past `DIRECT_MAX`): tc finds the flow's FORWARD entry
        // and translates the packet as the flow's (`ct_hit`).
        count(Reason::XdpPassRoute, ifindex);
        return PASS;
    }
    let shown = sent(action, Reason::XdpNew, ifindex);
    monitor::tc(shown, true, s.new.fwd.id);
    action
}

/// Counts `reason` for a packet sent with `action`, and the redirect when it is one; returns
/// the reason the monitor is shown.
#[inline(always)]
fn sent(action: u32, reason: Reason, ifindex: u32) -> Reason {
    count(reason, ifindex);
    if action != REDIRECT {
        return reason;
    }
    let redirected = if reason == Reason::XdpReply {
        Reason::XdpRedirectReply
    } else {
        Reason::XdpRedirect
    };
    count(redirected, ifindex);
    redirected
}

/// How the translated packet can leave, from what `s.route` says: `TX` back out of the device
/// it came in on, `REDIRECT` to another device of `SVC_XDP_DEVS` (the redirect is then set
/// up, and happens only if the program returns `REDIRECT`), or `PASS`: tc forwards it (a
/// neighbour to resolve, another device XDP may not send to) or answers it (time exceeded,
/// too big). Nothing is written to the packet here: a caller that then cannot rewrite it
/// passes it untouched.
#[inline(always)]
fn exit(s: &Scratch) -> u32 {
    if s.p.ttl <= 1 || s.route.ret != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return PASS;
    }
    let out = s.route.params.ifindex;
    if out == s.p.ifindex {
        return TX;
    }
    // The lookup and the redirect are one step: a device the agent removes from the map
    // between them cannot be sent to with the packet already rewritten.
    match SVC_XDP_DEVS.redirect(out, PASS as u64) {
        Ok(_) => REDIRECT,
        Err(_) => PASS,
    }
}

/// Sends the translated packet on when the route to `s.dst` has a known neighbour: back out of
/// its device (XDP_TX), or to another device of `SVC_XDP_DEVS` (XDP_REDIRECT, counted
/// `XdpRedirect` or `XdpRedirectReply` too, which the monitor is shown); else it goes on to tc
/// untouched, counted `XdpPassRoute`. `reason` is counted when sent.
#[inline(never)]
fn send(ctx: &XdpContext, s: &mut Scratch, reason: Reason) -> u32 {
    let ifindex = s.p.ifindex;
    let p = &s.p;
    fwd::lookup(
        ctx,
        p.v6 != 0,
        &s.src.addr,
        &s.dst.addr,
        ifindex,
        0,
        &mut s.route,
    );
    let action = exit(s);
    if action == PASS || !rewrite(ctx, s) {
        // Nothing was written: tc translates it.
        count(Reason::XdpPassRoute, ifindex);
        return PASS;
    }
    let shown = sent(action, reason, ifindex);
    monitor::tc_known(s, shown);
    action
}

/// `N` bytes at `off` of the packet, to be written in place; `None` when they are not all in
/// it.
#[inline(always)]
fn at(ctx: &XdpContext, off: u32, n: u32) -> Option<*mut u8> {
    if off >= DIRECT_MAX {
        return None;
    }
    let p = ctx.data() + off as usize;
    if p + n as usize > Ctx::data_end(ctx) {
        return None;
    }
    Some(p as *mut u8)
}

#[inline(always)]
fn rd16(p: *mut u8) -> u16 {
    // SAFETY: callers pass a pointer `at` checked for the bytes read.
    unsafe { core::ptr::read_unaligned(p as *const u16) }
}

#[inline(always)]
fn wr16(p: *mut u8, v: u16) {
    // SAFETY: callers pass a pointer `at` checked for the bytes written.
    unsafe { core::ptr::write_unaligned(p as *mut u16, v) }
}

/// The IPv4 address of a mapped address, as it lies in memory.
#[inline(always)]
fn v4_word(a: &[u8; 16]) -> u32 {
    u32::from_ne_bytes([a[12], a[13], a[14], a[15]])
}

/// Rewrites the packet in place to `s.src` -> `s.dst`, one hop counted, with the MAC
/// addresses of `s.route`; the L4 and IPv4 header checksums updated incrementally. Every
/// bound is checked before the first write: false leaves the packet as it was.
#[inline(never)]
fn rewrite(ctx: &XdpContext, s: &Scratch) -> bool {
    let p = &s.p;
    let v6 = p.v6 != 0;
    let Some(eth) = at(ctx, 0, 12) else {
        return false;
    };
    // Checked here, taken again where written: each family's bound must be a constant the
    // verifier sees on the path that writes.
    let ip_fits = if v6 {
        at(ctx, L3, 40).is_some()
    } else {
        at(ctx, L3, 20).is_some()
    };
    if !ip_fits {
        return false;
    }
    let Some(ports) = at(ctx, p.l4_off, 4) else {
        return false;
    };
    let Some(check) = at(ctx, p.csum_off(), 2) else {
        return false;
    };
    let (src, dst) = (&s.src, &s.dst);
    let addr_diff = if v6 {
        csum::add(
            csum::diff_addr(&p.saddr, &src.addr),
            csum::diff_addr(&p.daddr, &dst.addr),
        )
    } else {
        csum::add(
            csum::diff32(v4_word(&p.saddr), v4_word(&src.addr)),
            csum::diff32(v4_word(&p.daddr), v4_word(&dst.addr)),
        )
    };
    let port_diff = csum::add(
        csum::diff16(p.sport_be, src.port_be),
        csum::diff16(p.dport_be, dst.port_be),
    );
    let old = rd16(check);
    // IPv4 UDP without a checksum (0) keeps none; a computed 0 is sent as 0xffff.
    if !(p.proto == IPPROTO_UDP && !v6 && old == 0) {
        let mut new = csum::apply(old, csum::add(addr_diff, port_diff));
        if p.proto == IPPROTO_UDP && new == 0 {
            new = 0xffff;
        }
        wr16(check, new);
    }
    wr16(ports, src.port_be);
    // SAFETY: `ports` was checked for 4 bytes.
    wr16(unsafe { ports.add(2) }, dst.port_be);
    // SAFETY: `ip` is checked for the whole fixed header of its family.
    unsafe {
        if v6 {
            let Some(ip) = at(ctx, L3, 40) else {
                return true;
            };
            *ip.add(7) = p.ttl.wrapping_sub(1);
            core::ptr::write_unaligned(ip.add(8) as *mut [u8; 16], src.addr);
            core::ptr::write_unaligned(ip.add(24) as *mut [u8; 16], dst.addr);
        } else {
            let Some(ip) = at(ctx, L3, 20) else {
                return true;
            };
            let ttl = p.ttl.wrapping_sub(1);
            // TTL and protocol share a 16-bit word of the header checksum.
            let ttl_diff = csum::diff16(
                u16::from_ne_bytes([p.ttl, p.proto]),
                u16::from_ne_bytes([ttl, p.proto]),
            );
            *ip.add(8) = ttl;
            wr16(
                ip.add(10),
                csum::apply(p.ip_check, csum::add(addr_diff, ttl_diff)),
            );
            core::ptr::write_unaligned(ip.add(12) as *mut u32, v4_word(&src.addr));
            core::ptr::write_unaligned(ip.add(16) as *mut u32, v4_word(&dst.addr));
        }
        let params = &s.route.params;
        core::ptr::write_unaligned(eth as *mut [u8; 6], params.dmac);
        core::ptr::write_unaligned(eth.add(6) as *mut [u8; 6], params.smac);
    }
    true
}
