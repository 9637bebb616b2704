//! The test object: `lb_test`, a classifier never attached anywhere, runs the decision of
//! `lb.rs` (lookup, choice, retry, affinity, a socket's remembered backends) on a request
//! carried in the packet and writes the answer back, so the decision is tested through
//! BPF_PROG_TEST_RUN in milliseconds, without namespaces, cgroups or sockets. The cgroup
//! sock_addr programs have no test run (ENOTSUPP on kernel 6.18).
#![no_std]
#![no_main]
// maps.rs counts per Service with an atomic add.
#![feature(core_intrinsics)]
#![allow(internal_features)]

// The packet datapath's helpers of the decision are unused here.
#[allow(dead_code)]
mod lb;
// The socket-only maps are declared there too; this object leaves them unused.
#[allow(dead_code)]
mod maps;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    btf_maps::PerCpuArray,
    helpers::generated::{bpf_skb_load_bytes, bpf_skb_store_bytes},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use svc_common::{LbTestIo, SockState, LB_TEST_SENDMSG};

/// The request being answered: too large for the 512-byte stack with the decision's own
/// locals.
#[btf_map]
static SVC_TEST_IO: PerCpuArray<LbTestIo, 1> = PerCpuArray::new();

const IO_LEN: u32 = core::mem::size_of::<LbTestIo>() as u32;

/// The request as the caller: its clock, cookies and socket state instead of the helpers'.
struct Given(*mut LbTestIo);

impl lb::Caller for Given {
    #[inline(always)]
    fn now(&self) -> u64 {
        // SAFETY: the map value `answer` checked.
        unsafe { (*self.0).now_ns }
    }

    #[inline(always)]
    fn cookie(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (*self.0).cookie }
    }

    #[inline(always)]
    fn affinity_client(&self, id: u32, v6: bool) -> svc_common::AffinityKey {
        // SAFETY: as above.
        lb::netns_client(unsafe { (*self.0).netns_cookie }, id, v6)
    }

    #[inline(always)]
    fn sticky(&self) -> bool {
        // SAFETY: as above.
        unsafe { (*self.0).mode == LB_TEST_SENDMSG }
    }

    #[inline(always)]
    fn sock_state(&self) -> *mut SockState {
        // SAFETY: as above; the state travels in the packet, in and out.
        unsafe { core::ptr::addr_of_mut!((*self.0).sock) }
    }
}

#[classifier]
pub fn lb_test(ctx: TcContext) -> i32 {
    match answer(&ctx) {
        Some(()) => TC_ACT_OK,
        None => TC_ACT_SHOT,
    }
}

#[inline(always)]
fn answer(ctx: &TcContext) -> Option<()> {
    let io = SVC_TEST_IO.get_ptr_mut(0)?;
    // SAFETY: io points at a map value of IO_LEN bytes; the helpers check the packet bounds.
    unsafe {
        if bpf_skb_load_bytes(ctx.skb.skb.cast(), 0, io.cast(), IO_LEN) != 0 {
            return None;
        }
        let key = (*io).key;
        let mut decision = lb::Decision::default();
        let outcome = lb::decide(&key, &Given(io), &mut decision);
        let req = &mut *io;
        req.outcome = outcome as u32;
        req.how = decision.how;
        req.frontend_id = decision.svc.id;
        req.backend_id = decision.backend_id;
        req.backend = decision.backend;
        if bpf_skb_store_bytes(ctx.skb.skb.cast(), 0, io.cast(), IO_LEN, 0) != 0 {
            return None;
        }
    }
    Some(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
