//! Forwarding a translated packet ourselves: a route lookup (bpf_fib_lookup) and a redirect
//! to the device it names.
//!
//! Which packets take this way and which take the stack:
//! - redirected: packets whose source became a node address or a frontend (SNATed packets to
//!   remote backends, and their replies restored towards the client). The stack's forwarding
//!   would drop them as martians (a local address as the source of a packet it receives).
//!   Also ICMP errors translated for such flows.
//! - the stack: packets DNATed to a local backend (the client's address is kept, the route to
//!   the pod is the stack's), replies of local backends (they are already leaving: egress),
//!   and the per-packet ClusterIP path (source preserved).
//! - straight back out of the device they came in on (bpf_redirect to its egress, MACs
//!   swapped): rejects and ICMP errors the programs answer with, and hairpinned pod flows.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, bpf_redir_neigh, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK,
    },
    helpers::generated::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use crate::{nat::store, pkt::load};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// BPF_FIB_LOOKUP_SRC (kernel 6.7+): the lookup also names the source address the route
/// prefers, as MASQUERADE picks it.
pub const LOOKUP_SRC: u32 = 1 << 4;

/// A route: what `lookup` answered.
#[derive(Clone, Copy)]
pub struct Route {
    /// A BPF_FIB_LKUP_RET_* code (negative: the helper failed).
    pub ret: i64,
    pub params: FibParams,
}

#[inline(always)]
fn words(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// Looks up the route from `src` to `dst` (mapped addresses) for a packet that came in on
/// `ifindex`; with `LOOKUP_SRC` in `flags` `src` may be zero and the route's preferred
/// source is returned in `src_out`. No MTU is given: the helper checks the packet against
/// the egress device's MTU itself (GSO packets by their segments).
#[inline(always)]
pub fn lookup<C: crate::ctx::Ctx>(
    ctx: &C,
    v6: bool,
    src: &[u8; 16],
    dst: &[u8; 16],
    ifindex: u32,
    flags: u32,
    route: &mut Route,
) {
    // Built in place in `route` (the scratch space), not on the stack: a 64-byte local here
    // sat in the frame of every caller, one of which is on the external ingress's deepest
    // call chain.
    // SAFETY: a plain C struct; all-zero is its neutral value.
    unsafe { crate::mem::clear(&mut route.params) };
    let params = &mut route.params;
    params.ifindex = ifindex;
    params.__bindgen_anon_1.tot_len = ctx.fib_len();
    if v6 {
        params.family = AF_INET6;
        params.__bindgen_anon_3.ipv6_src = words(src);
        params.__bindgen_anon_4.ipv6_dst = words(dst);
    } else {
        params.family = AF_INET;
        params.__bindgen_anon_3.ipv4_src = words(src)[3];
        params.__bindgen_anon_4.ipv4_dst = words(dst)[3];
    }
    // SAFETY: params is memory of the size given (a map value).
    route.ret = unsafe {
        bpf_fib_lookup(
            ctx.raw(),
            params,
            core::mem::size_of::<FibParams>() as i32,
            flags,
        )
    };
}

/// The preferred source the lookup named (mapped), for `LOOKUP_SRC`.
#[inline(always)]
pub fn route_src(route: &Route, v6: bool, out: &mut [u8; 16]) {
    // SAFETY: reading the union member of the family that was looked up.
    unsafe {
        if v6 {
            let w = route.params.__bindgen_anon_3.ipv6_src;
            out[0..4].copy_from_slice(&w[0].to_ne_bytes());
            out[4..8].copy_from_slice(&w[1].to_ne_bytes());
            out[8..12].copy_from_slice(&w[2].to_ne_bytes());
            out[12..16].copy_from_slice(&w[3].to_ne_bytes());
        } else {
            *out = svc_common::v4_mapped(route.params.__bindgen_anon_3.ipv4_src.to_ne_bytes());
        }
    }
}

/// Whether the route can be followed by a redirect.
#[inline(always)]
pub fn usable(route: &Route) -> bool {
    route.ret == BPF_FIB_LKUP_RET_SUCCESS as i64 || route.ret == BPF_FIB_LKUP_RET_NO_NEIGH as i64
}

/// Sends the packet where `route` says: with the neighbour's MAC when the lookup knew it,
/// else through bpf_redirect_neigh, which resolves it. A route that cannot be followed
/// leaves the packet to the stack.
#[inline(always)]
pub fn redirect(ctx: &TcContext, v6: bool, route: &Route) -> i32 {
    let params = &route.params;
    if route.ret == BPF_FIB_LKUP_RET_SUCCESS as i64 {
        let macs = MacPair {
            dst: params.dmac,
            src: params.smac,
        };
        if !store(ctx, 0, (&macs as *const MacPair).cast(), 12, 0) {
            return TC_ACT_OK;
        }
        // SAFETY: a helper without memory arguments.
        return unsafe { bpf_redirect(params.ifindex, 0) } as i32;
    }
    if route.ret == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        // The lookup left the next hop (the gateway, or the destination itself when on
        // link) in the destination fields.
        let mut nh = core::mem::MaybeUninit::<bpf_redir_neigh>::uninit();
        crate::mem::zero(&mut nh);
        // SAFETY: a plain C struct, zeroed; the union member of the family is written below.
        let nh = unsafe { nh.assume_init_mut() };
        // SAFETY: union members of the family that was looked up.
        unsafe {
            if v6 {
                nh.nh_family = AF_INET6 as u32;
                nh.__bindgen_anon_1.ipv6_nh = params.__bindgen_anon_4.ipv6_dst;
            } else {
                nh.nh_family = AF_INET as u32;
                nh.__bindgen_anon_1.ipv4_nh = params.__bindgen_anon_4.ipv4_dst;
            }
        }
        // SAFETY: nh is a local of the size given.
        return unsafe {
            bpf_redirect_neigh(
                params.ifindex,
                nh,
                core::mem::size_of::<bpf_redir_neigh>() as i32,
                0,
            )
        } as i32;
    }
    TC_ACT_OK
}

/// An Ethernet header's two addresses, as they lie in the packet. A struct of two arrays, not
/// one 12-byte array filled in two halves: LLVM zeroes such an array first with a call to the
/// object's `memset`, a byte loop (`mem`).
#[repr(C)]
struct MacPair {
    dst: [u8; 6],
    src: [u8; 6],
}

/// Sends the packet back out of the device it came in on, MAC addresses swapped.
#[inline(always)]
pub fn bounce(ctx: &TcContext, ifindex: u32) -> i32 {
    let mut macs = [0u8; 12];
    if !load(ctx, 0, &mut macs) {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    if !store(ctx, 0, swapped.as_ptr(), 12, 0) {
        return aya_ebpf::bindings::TC_ACT_SHOT;
    }
    // SAFETY: a helper without memory arguments.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
