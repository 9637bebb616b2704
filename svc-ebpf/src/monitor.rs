//! `svc-agent monitor`'s events: one per decision, into a ring buffer, only while a monitor
//! listens (docs/design/monitor.md).
//!
//! Nobody listening costs each decision point one array load and a branch (`listening`): the
//! array lookup is inlined by the verifier. The writing itself is out of line (`emit_sock`,
//! `emit_tc`, `#[inline(never)]`), so its locals never join the frames of the callers, whose
//! chain is at the 512-byte stack limit; the event is written straight into the ring's memory
//! (`bpf_ringbuf_reserve`), never built on the stack.

use aya_ebpf::{
    btf_maps::{Array, PerCpuArray, RingBuf},
    helpers::{bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::btf_map,
    maps::ring_buf::RingBufEntry,
    programs::SockAddrContext,
};
use svc_common::{
    ct_flags, monitor_source, CtKey, CtValue, MonitorCtl, MonitorEvent, MonitorStats, Reason,
    MONITOR_RING_BYTES,
};

use crate::{lb, scratch::Scratch};

/// `bpf_ringbuf_submit` without waking the reader: the monitor reads every 100 ms instead. A
/// wakeup per event charges the reader's scheduling to the deciding program (measured with
/// wakeups: 24 µs more a connection, of two events, on a busy 2-core machine;
/// docs/benchmarks.md).
const BPF_RB_NO_WAKEUP: u64 = 1;

#[btf_map]
static SVC_MONITOR: RingBuf<MonitorEvent, { MONITOR_RING_BYTES as usize }> = RingBuf::new();

#[btf_map]
static SVC_MON_CTL: Array<MonitorCtl, 1> = Array::new();

#[btf_map]
static SVC_MON_STATS: PerCpuArray<MonitorStats, 1> = PerCpuArray::new();

/// Whether a monitor may be listening: its lease is set (not whether it is still valid; the
/// out-of-line writer checks that, so that the common case reads no clock).
#[inline(always)]
pub fn listening() -> bool {
    SVC_MON_CTL.get(0).is_some_and(|c| c.until_ns != 0)
}

/// Counts the event and reserves its place in the ring: `None` when the lease is over (then
/// cleared, so later decisions read no clock), the event is sampled out, or the ring is full.
/// Every field of the returned event is the caller's to write: the ring's memory is not
/// zeroed.
#[inline(always)]
fn reserve(now: u64) -> Option<RingBufEntry<MonitorEvent>> {
    let ctl = SVC_MON_CTL.get_ptr_mut(0)?;
    // SAFETY: the map's value; the monitor may rewrite it concurrently, and a torn read costs
    // one event at most.
    let (until, sample) = unsafe { ((*ctl).until_ns, (*ctl).sample) };
    if until == 0 {
        return None;
    }
    if now > until {
        // A monitor that renewed in between loses the events until its next renewal.
        // SAFETY: as above.
        unsafe { (*ctl).until_ns = 0 };
        return None;
    }
    let stats = SVC_MON_STATS.get_ptr_mut(0)?;
    // SAFETY: this CPU's value, and a program runs to completion on one CPU.
    let stats = unsafe { &mut *stats };
    stats.seen += 1;
    if sample > 1 && !stats.seen.is_multiple_of(sample as u64) {
        return None;
    }
    match SVC_MONITOR.reserve(0) {
        Some(e) => {
            stats.written += 1;
            Some(e)
        }
        None => {
            stats.lost += 1;
            None
        }
    }
}

/// What a socket hook decided: `what` packs the `Reason` (low byte), the `monitor_source`
/// (second byte), the `how` (third) and the frontend id (high 32 bits); `dst` is what the
/// socket asked for, `to` what it got (none when refused), with its backend id.
#[inline(never)]
pub fn emit_sock(
    ctx: &SockAddrContext,
    what: u64,
    dst: &([u8; 16], u16),
    to: Option<&([u8; 16], u16)>,
    backend_id: u32,
) {
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(mut entry) = reserve(now) else {
        return;
    };
    // Written through the pointer, field by field, so that no event is built on the stack.
    let e = entry.as_mut_ptr();
    // SAFETY: `e` is a reserved, writable event of the ring; the context is the kernel's.
    unsafe {
        (*e).ts_ns = now;
        (*e).cookie = bpf_get_socket_cookie(ctx.sock_addr.cast());
        (*e).reason = (what & 0xff) as u32;
        (*e).source = ((what >> 8) & 0xff) as u8;
        (*e).how = ((what >> 16) & 0xff) as u8;
        (*e).id = (what >> 32) as u32;
        (*e).backend_id = backend_id;
        (*e).ifindex = 0;
        zero16(&raw mut (*e).saddr);
        (*e).sport_be = 0;
        (*e).daddr = dst.0;
        (*e).dport_be = dst.1;
        (*e).proto = (*ctx.sock_addr).protocol as u8;
        match to {
            Some(to) => {
                (*e).nat_daddr = to.0;
                (*e).nat_dport_be = to.1;
            }
            None => {
                zero16(&raw mut (*e).nat_daddr);
                (*e).nat_dport_be = 0;
            }
        }
        zero16(&raw mut (*e).nat_saddr);
        (*e).nat_sport_be = 0;
        (*e).icmp_type = 0;
        (*e).icmp_code = 0;
        zero_pad(&raw mut (*e)._pad0);
    }
    entry.submit(BPF_RB_NO_WAKEUP);
}

/// `emit_sock`'s `what`.
#[inline(always)]
pub fn sock_what(reason: Reason, source: u8, how: u32, id: u32) -> u64 {
    reason as u64 | (source as u64) << 8 | ((how & 0xff) as u64) << 16 | (id as u64) << 32
}

/// `emit_tc`'s `what`, second byte: `s.src`/`s.dst` hold the packet's translation.
const TRANSLATED: u64 = 1 << 8;
/// `emit_tc`'s `what`, second byte: the packet is an ICMP error (`s.p`, whose type the
/// parser left in `tcp_flags`) about the flow whose packet `s.flow` is; the event names that
/// flow, and the error's code is `what`'s fourth byte.
const ICMP: u64 = 2 << 8;

/// What a tc program decided about the packet in `s.p`: `what` packs the `Reason` (low
/// byte), `TRANSLATED` and `ICMP` (second byte), the event's `how` (third byte: the low byte
/// of a known flow's `ct_flags`, or a new flow's `how` constant; 0 otherwise), an ICMP
/// error's code (fourth byte) and the frontend id (high 32 bits).
#[inline(never)]
pub fn emit_tc(s: &Scratch, what: u64) {
    let now = lb::clock_ns();
    let Some(mut entry) = reserve(now) else {
        return;
    };
    // Written through the pointer, field by field, so that no event is built on the stack.
    let e = entry.as_mut_ptr();
    let icmp = what & ICMP != 0;
    let p = if icmp { &s.flow } else { &s.p };
    // SAFETY: `e` is a reserved, writable event of the ring.
    unsafe {
        (*e).ts_ns = now;
        (*e).cookie = 0;
        (*e).reason = (what & 0xff) as u32;
        (*e).source = monitor_source::TC;
        (*e).how = ((what >> 16) & 0xff) as u8;
        (*e).id = (what >> 32) as u32;
        (*e).backend_id = 0;
        (*e).ifindex = p.ifindex;
        (*e).saddr = p.saddr;
        (*e).sport_be = p.sport_be;
        (*e).daddr = p.daddr;
        (*e).dport_be = p.dport_be;
        (*e).proto = p.proto;
        if icmp {
            (*e).icmp_type = s.p.tcp_flags;
            (*e).icmp_code = ((what >> 24) & 0xff) as u8;
        } else {
            (*e).icmp_type = 0;
            (*e).icmp_code = 0;
        }
        if what & TRANSLATED != 0 {
            (*e).nat_saddr = s.src.addr;
            (*e).nat_sport_be = s.src.port_be;
            (*e).nat_daddr = s.dst.addr;
            (*e).nat_dport_be = s.dst.port_be;
        } else {
            zero16(&raw mut (*e).nat_saddr);
            (*e).nat_sport_be = 0;
            zero16(&raw mut (*e).nat_daddr);
            (*e).nat_dport_be = 0;
        }
        zero_pad(&raw mut (*e)._pad0);
    }
    entry.submit(BPF_RB_NO_WAKEUP);
}

/// `emit_tc`'s `what`.
#[inline(always)]
pub fn tc_what(reason: Reason, translated: bool, id: u32) -> u64 {
    reason as u64 | if translated { TRANSLATED } else { 0 } | (id as u64) << 32
}

/// A new flow's first packet, translated (`New`), if a monitor listens: with the `how` of
/// its backend's choice (`Scratch::how`), so a sessionAffinity hit shows as one.
#[inline(always)]
pub fn tc_new(s: &Scratch) {
    if listening() {
        emit_tc(
            s,
            tc_what(Reason::New, true, s.new.fwd.id) | (s.how & 0xff) << 16,
        );
    }
}

/// An ICMP error about the flow `s.flow` (its packet that travels the error's way) was
/// translated to `s.src` -> `s.dst` (icmp.rs); `code` is the error's ICMP code. Its caller
/// has asked `listening` (and read the code only then). The error's own addresses are not in
/// the event: the flow's are what a user knows.
#[inline(always)]
pub fn tc_icmp(s: &Scratch, code: u8) {
    emit_tc(
        s,
        tc_what(Reason::IcmpError, true, s.v.id) | ICMP | (code as u64) << 24,
    );
}

/// The sweep (gc.rs) is removing the dead flow whose FORWARD entry is `key` -> `v`: the
/// flow as its client sent it, its backend and SNAT address and port, the low byte of its
/// `ct_flags` (closed, reset, or idle past its timeout) in `how`.
#[inline(never)]
pub fn emit_swept(key: &CtKey, v: &CtValue, now: u64) {
    let Some(mut entry) = reserve(now) else {
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: `e` is a reserved, writable event of the ring.
    unsafe {
        (*e).ts_ns = now;
        (*e).cookie = 0;
        (*e).reason = Reason::CtSwept as u32;
        (*e).source = monitor_source::SWEEP;
        (*e).how = (v.flags & 0xff) as u8;
        (*e).id = v.id;
        (*e).backend_id = 0;
        (*e).ifindex = v.ifindex;
        (*e).saddr = key.saddr;
        (*e).sport_be = key.sport_be;
        (*e).daddr = key.daddr;
        (*e).dport_be = key.dport_be;
        (*e).proto = key.proto;
        (*e).icmp_type = 0;
        (*e).icmp_code = 0;
        if v.flags & ct_flags::SNAT != 0 {
            (*e).nat_saddr = v.snat_addr;
            (*e).nat_sport_be = v.snat_port_be;
        } else {
            (*e).nat_saddr = key.saddr;
            (*e).nat_sport_be = key.sport_be;
        }
        (*e).nat_daddr = v.nat_addr;
        (*e).nat_dport_be = v.nat_port_be;
        zero_pad(&raw mut (*e)._pad0);
    }
    entry.submit(BPF_RB_NO_WAKEUP);
}

/// A known flow's packet translated by tc or XDP (`CtHit`, `Reply` and their XDP twins),
/// if a monitor listens: the frontend and the low byte of the flow's `ct_flags` as its lookup
/// left them (in the event's `how`; FIN, RST and their directions are there), so a monitor
/// sees a flow's FIN or RST go by.
#[inline(always)]
pub fn tc_known(s: &Scratch, reason: Reason) {
    if listening() {
        emit_tc(
            s,
            tc_what(reason, true, s.v.id) | (s.v.flags as u64 & 0xff) << 16,
        );
    }
}

/// A tc decision about `s.p`, if a monitor listens.
#[inline(always)]
pub fn tc(s: &Scratch, reason: Reason, translated: bool, id: u32) {
    if listening() {
        emit_tc(s, tc_what(reason, translated, id));
    }
}

/// Zeroes an address of the event in two 8-byte stores (`[0; 16]` is a call of the object's
/// byte-loop memset).
///
/// # Safety
/// `a` is 8-aligned and writable: an address field of a reserved `MonitorEvent`.
#[inline(always)]
unsafe fn zero16(a: *mut [u8; 16]) {
    let w = a.cast::<u64>();
    // SAFETY: as the caller vouches; volatile, so that LLVM does not fold them into memset.
    unsafe {
        core::ptr::write_volatile(w, 0);
        core::ptr::write_volatile(w.add(1), 0);
    }
}

/// Zeroes the event's padding, byte by byte (see `zero16`).
///
/// # Safety
/// `a` is the `_pad0` of a reserved `MonitorEvent`.
#[inline(always)]
unsafe fn zero_pad(a: *mut [u8; 3]) {
    let b = a.cast::<u8>();
    for i in 0..3 {
        // SAFETY: within the field.
        unsafe { core::ptr::write_volatile(b.add(i), 0) };
    }
}
