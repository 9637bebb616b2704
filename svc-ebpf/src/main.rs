//! svc kernel programs. Each entry is `fn hook(ctx)` calling the shared logic once and mapping
//! its result to the verdict the kernel expects.
#![no_std]
#![no_main]
// The BPF target has no atomic types; its atomic instructions are reached through the
// intrinsics (ct.rs, `add_flags`). The build sets RUSTC_BOOTSTRAP for build-std already.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod csum;
mod ct;
mod ctx;
mod frag;
mod fwd;
mod gc;
mod icmp;
mod kernel;
mod lb;
mod maps;
mod mem;
mod monitor;
mod nat;
mod pkt;
mod reject;
mod scratch;
mod sock;
mod tc;
mod tcpsum;
mod xdp;

use aya_ebpf::{
    helpers::generated::bpf_set_retval,
    macros::{cgroup_sock, cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, SockContext, TcContext, XdpContext},
};
use sock::{Call, Family};

/// sock_addr verdicts: 1 lets the call proceed, 0 fails it (with the errno set by
/// bpf_set_retval, EPERM otherwise: on kernels before 5.18, which lack the helper).
const ALLOW: i32 = 1;
const DENY: i32 = 0;

#[inline(always)]
fn forward_verdict(ctx: &SockAddrContext, family: Family, call: Call) -> i32 {
    match sock::try_forward(ctx, family, call) {
        Ok(()) => ALLOW,
        Err(errno) => {
            // Without the helper the call fails with EPERM, as under Cilium on such kernels.
            if kernel::has_set_retval() {
                // SAFETY: a helper with no memory arguments.
                unsafe { bpf_set_retval(-errno) };
            }
            DENY
        }
    }
}

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    forward_verdict(&ctx, Family::V4, Call::Connect)
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    forward_verdict(&ctx, Family::V6, Call::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    forward_verdict(&ctx, Family::V4, Call::Sendmsg)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    forward_verdict(&ctx, Family::V6, Call::Sendmsg)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, Family::V4);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, Family::V6);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, Family::V4);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, Family::V6);
    ALLOW
}

/// A socket is closed: its reverse entries go. Never refuses (a release cannot fail).
#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    sock::release(&ctx);
    ALLOW
}

/// tc, ingress of an external device: NodePorts, ExternalIPs, LoadBalancer IPs; replies of
/// remote backends. Verdicts are TC_ACT_* codes (OK, SHOT, REDIRECT).
#[classifier]
pub fn tc_ext_ingress(ctx: TcContext) -> i32 {
    tc::ext_ingress(&ctx)
}

/// tc, egress of an external device: replies of local backends.
#[classifier]
pub fn tc_ext_egress(ctx: TcContext) -> i32 {
    tc::ext_egress(&ctx)
}

/// tc, ingress of the host side of a pod device: per-packet ClusterIP.
#[classifier]
pub fn tc_pod_ingress(ctx: TcContext) -> i32 {
    tc::pod_ingress(&ctx)
}

/// tc, egress of the host side of a pod device: replies to the pod.
#[classifier]
pub fn tc_pod_egress(ctx: TcContext) -> i32 {
    tc::pod_egress(&ctx)
}

/// XDP, external devices: known flows to and from remote backends, sent back out from the
/// driver; everything else goes on to `tc_ext_ingress` untouched (docs/design/xdp.md).
/// Verdicts are XDP_* codes (PASS, TX).
#[xdp]
pub fn xdp_ext(ctx: XdpContext) -> u32 {
    xdp::ext(&ctx)
}

/// Never attached: the agent runs it through BPF_PROG_TEST_RUN every few seconds to remove
/// dead flows from connection tracking (gc.rs). Its return value is how many entries went.
#[classifier]
pub fn tc_ct_sweep(_ctx: TcContext) -> i32 {
    gc::sweep() as i32
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
