//! `svc-agent monitor`'s events: one per decision, into the ring of each monitor slot that
//! listens, only while one does (docs/design/monitor.md).
//!
//! Nobody listening costs each decision point one array load and a branch (`listening`: the
//! summary word `SVC_MON_ON`, whose lookup the verifier inlines). The writing itself is out
//! of line (`emit_sock`, `emit_swept`, `#[inline(never)]`; tc's and XDP's `svc_mon_tc`, a
//! global function the verifier checks once), so its locals never
//! join the frames of the callers, whose chain is near the 512-byte stack limit; the event is
//! built once in a per-CPU map value (`SVC_MON_EVENT`, one per context), never on the stack, and copied into
//! the ring of each slot that takes it (`bpf_ringbuf_output`).

use core::intrinsics::{atomic_and, AtomicOrdering};

use aya_ebpf::{
    btf_maps::{Array, PerCpuArray, RingBuf},
    helpers::{bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::btf_map,
    programs::SockAddrContext,
};
use svc_common::{
    ct_flags, monitor_flags, monitor_source, CtKey, CtValue, MonitorCtl, MonitorEvent, MonitorOn,
    MonitorStats, Reason, MONITOR_RING_BYTES, MONITOR_SLOTS,
};

use crate::{ct, lb, scratch::Scratch};

/// `bpf_ringbuf_output` without waking the reader: the monitor reads every 100 ms instead. A
/// wakeup per event charges the reader's scheduling to the deciding program (measured with
/// wakeups: 24 µs more a connection, of two events, on a busy 2-core machine;
/// docs/benchmarks.md).
const BPF_RB_NO_WAKEUP: u64 = 1;

const RING: usize = MONITOR_RING_BYTES as usize;
const SLOTS: usize = MONITOR_SLOTS as usize;

// One ring per slot: a ring buffer has one consumer position, so monitors sharing one would
// each get some of the events.
#[btf_map]
static SVC_MON_RING_0: RingBuf<MonitorEvent, RING> = RingBuf::new();
#[btf_map]
static SVC_MON_RING_1: RingBuf<MonitorEvent, RING> = RingBuf::new();
#[btf_map]
static SVC_MON_RING_2: RingBuf<MonitorEvent, RING> = RingBuf::new();
#[btf_map]
static SVC_MON_RING_3: RingBuf<MonitorEvent, RING> = RingBuf::new();
const _: () = assert!(SLOTS == 4, "one ring static per slot");

#[btf_map]
static SVC_MON_CTL: Array<MonitorCtl, SLOTS> = Array::new();

#[btf_map]
static SVC_MON_ON: Array<MonitorOn, 1> = Array::new();

#[btf_map]
static SVC_MON_STATS: PerCpuArray<MonitorStats, SLOTS> = PerCpuArray::new();

/// One event being written per CPU and context: a tc program (softirq) may interrupt a
/// socket hook or the sweep (process context) on their CPU mid-event, and must not write over
/// its half-built event. tc and XDP run with bottom halves off, so they never interrupt
/// each other.
#[btf_map]
static SVC_MON_EVENT: PerCpuArray<MonitorEvent, 3> = PerCpuArray::new();

/// `SVC_MON_EVENT`'s entries: the socket hooks', tc's and XDP's, the sweep's.
const EVENT_SOCK: u32 = 0;
const EVENT_TC: u32 = 1;
const EVENT_SWEEP: u32 = 2;

/// Whether a monitor may be listening: some slot's bit is set in the summary (not whether
/// its lease is still valid; the out-of-line writer checks that, so that the common case
/// reads no clock).
#[inline(always)]
pub fn listening() -> bool {
    SVC_MON_ON.get(0).is_some_and(|o| o.slots != 0)
}

/// The slots the event goes to (bit i: slot i), each counted and sampled on this CPU
/// (`slot`): those whose bit the summary has, whose lease is current, and, for a known flow's
/// packet that changed nothing shown (`packet`), that asked for every packet. A call of the
/// global function `svc_mon_slots`.
#[inline(always)]
fn slots(now: u64, packet: bool) -> u32 {
    svc_mon_slots(now, packet as u64) as u32
}

/// `slots`, a global function (BTF linkage global, as a `no_mangle` public function gets),
/// as `publish`'s `svc_mon_publish`: the verifier checks each once for each program, with its
/// arguments unknown, and then takes each call for its type alone. As static functions they
/// were checked again at every writer's call with the caller's state: making them global took
/// 63–91 % off what the verifier processed for each socket program, 84 % for the sweep
/// (docs/design/packet-datapath.md, "What the verifier costs"). Its own locals stay off the
/// writers' frames, as `slot`'s.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn svc_mon_slots(now: u64, packet: u64) -> i64 {
    let packet = packet != 0;
    let Some(on) = SVC_MON_ON.get(0) else {
        return 0;
    };
    // A plain read of a value the monitors rewrite: a stale one costs a slot the events until
    // its monitor sets its bit again (it checks every 100 ms).
    let bits = on.slots;
    let mut to = 0u32;
    for i in 0..MONITOR_SLOTS {
        if bits & (1 << i) != 0 {
            to |= slot(i, now, packet);
        }
    }
    to as i64
}

/// `slots` for slot `i`: its bit if the event goes to it. A slot found with its lease over is
/// cleared (its `until_ns`, and its bits in the summary), so that later decisions read no
/// clock for it.
#[inline(never)]
fn slot(i: u32, now: u64, packet: bool) -> u32 {
    let Some(ctl) = SVC_MON_CTL.get_ptr_mut(i) else {
        return 0;
    };
    // SAFETY: the map's value; its monitor may rewrite it concurrently, and a torn read
    // costs one event at most.
    let (until, sample, flags) = unsafe { ((*ctl).until_ns, (*ctl).sample, (*ctl).flags) };
    if until == 0 || now > until {
        if until != 0 {
            // A monitor that renewed in between finds its slot cleared (it checks every
            // 100 ms) and writes it again: it loses the events until then.
            // SAFETY: as above.
            unsafe { (*ctl).until_ns = 0 };
        }
        if let Some(on) = SVC_MON_ON.get_ptr_mut(0) {
            // Atomically, so that another slot's bit a monitor or another CPU sets meanwhile
            // stays; `MonitorOn` is one aligned 64-bit word (`slots` low, `packets` high).
            let mine = (1u64 << i) | (1u64 << (32 + i));
            // SAFETY: a map value (8-aligned); the result unused, a BPF atomic AND.
            unsafe { atomic_and::<u64, u64, { AtomicOrdering::Relaxed }>(on.cast::<u64>(), !mine) };
        }
        return 0;
    }
    if packet && flags & monitor_flags::PACKETS == 0 {
        return 0;
    }
    let Some(stats) = SVC_MON_STATS.get_ptr_mut(i) else {
        return 0;
    };
    // SAFETY: this CPU's value, and a program runs to completion on one CPU.
    let stats = unsafe { &mut *stats };
    stats.seen += 1;
    if sample > 1 && !stats.seen.is_multiple_of(sample as u64) {
        return 0;
    }
    1 << i
}

/// This CPU's event being written in context `which` (`EVENT_*`): every field is the
/// writer's to set.
#[inline(always)]
fn event(which: u32) -> Option<*mut MonitorEvent> {
    SVC_MON_EVENT.get_ptr_mut(which)
}

/// Copies this CPU's event of context `which` (`EVENT_*`), written through the pointer
/// `event` gave, into the ring of each slot of `to` (`slots`), counting it written or lost
/// (ring full) there. A call of the global function `svc_mon_publish`.
#[inline(always)]
fn publish(which: u32, to: u32) {
    let _ = svc_mon_publish(which as u64, to as u64);
}

/// `publish`, a global function, as `svc_mon_slots` is. It finds the event again by
/// `which`, as `svc_mon_tc` finds the packet, rather than taking its pointer: only scalars
/// cross the call. 0 always (a global function returns a scalar).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn svc_mon_publish(which: u64, to: u64) -> i64 {
    let Some(e) = event(which as u32) else {
        return 0;
    };
    let to = to as u32;
    // SAFETY: this CPU's event, written; read only here until the program returns.
    let e = unsafe { &*e };
    out(&SVC_MON_RING_0, 0, e, to);
    out(&SVC_MON_RING_1, 1, e, to);
    out(&SVC_MON_RING_2, 2, e, to);
    out(&SVC_MON_RING_3, 3, e, to);
    0
}

#[inline(always)]
fn out(ring: &RingBuf<MonitorEvent, RING>, slot: u32, e: &MonitorEvent, to: u32) {
    if to & (1 << slot) == 0 {
        return;
    }
    let written = ring.output(e, BPF_RB_NO_WAKEUP).is_ok();
    if let Some(stats) = SVC_MON_STATS.get_ptr_mut(slot) {
        // SAFETY: this CPU's value.
        unsafe {
            if written {
                (*stats).written += 1;
            } else {
                (*stats).lost += 1;
            }
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
    let rings = slots(now, false);
    if rings == 0 {
        return;
    }
    // Written through the pointer, field by field, so that no event is built on the stack.
    let Some(e) = event(EVENT_SOCK) else {
        return;
    };
    // SAFETY: `e` is this CPU's event; the context is the kernel's.
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
    publish(EVENT_SOCK, rings);
}

/// `emit_sock`'s `what`.
#[inline(always)]
pub fn sock_what(reason: Reason, source: u8, how: u32, id: u32) -> u64 {
    reason as u64 | (source as u64) << 8 | ((how & 0xff) as u64) << 16 | (id as u64) << 32
}

/// `emit_tc`'s `what`, second byte: `s.src`/`s.dst` hold the packet's translation.
const TRANSLATED: u64 = 1 << 8;
/// `emit_tc`'s `what`, second byte: a known flow's packet that changed nothing the monitor
/// shows, for the slots that asked for every packet only (`monitor_flags::PACKETS`).
const PACKET: u64 = 4 << 8;
/// `emit_tc`'s `what`, second byte: the packet is an ICMP error (`s.p`, whose type the
/// parser left in `tcp_flags`) about the flow whose packet `s.flow` is; the event names that
/// flow, and the error's code is `what`'s fourth byte.
const ICMP: u64 = 2 << 8;

/// What a tc or XDP program decided about the packet in its scratch space's `p`: `what`
/// packs the `Reason` (low byte), `TRANSLATED`, `ICMP` and `PACKET` (second byte), the event's
/// `how` (third byte: the low byte of a known flow's `ct_flags`, or a new flow's `how`
/// constant; 0 otherwise), an ICMP error's code (fourth byte) and the frontend id (high 32
/// bits).
#[inline(always)]
pub fn emit_tc(what: u64) {
    let _ = svc_mon_tc(what);
}

/// `emit_tc`, a global function (BTF linkage global, as a `no_mangle` public function gets):
/// the verifier checks it once for each program, with `what` unknown, and then takes each
/// call for its type alone. As a static function it was checked again at every call site
/// with the caller's state: the four slots' checks added 131,000 instructions (+23 %) to the
/// external ingress's verification when they came, which showed as a slower `ready`; making
/// the writer global took 104,000 off (measured at c7bfc33 on 6.18).
/// It finds the packet in the scratch space itself: a global function's pointer arguments
/// are checked for their BTF type only, not as the map value they are. It only reads the
/// scratch space, which its callers hold a reference to: they write nothing of it the event
/// needs after the call, so the compiler's assumption that the call leaves their reference's
/// data alone holds. 0 always (a global function returns a scalar).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn svc_mon_tc(what: u64) -> i64 {
    let Some(s) = crate::scratch::get() else {
        return 0;
    };
    let now = lb::clock_ns();
    let to = slots(now, what & PACKET != 0);
    if to == 0 {
        return 0;
    }
    // Written through the pointer, field by field, so that no event is built on the stack.
    let Some(e) = event(EVENT_TC) else {
        return 0;
    };
    let icmp = what & ICMP != 0;
    let p = if icmp { &s.flow } else { &s.p };
    // SAFETY: `e` is this CPU's event.
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
    publish(EVENT_TC, to);
    0
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
        emit_tc(tc_what(Reason::New, true, s.new.fwd.id) | (s.how & 0xff) << 16);
    }
}

/// An ICMP error about the flow `s.flow` (its packet that travels the error's way) was
/// translated to `s.src` -> `s.dst` (icmp.rs); `code` is the error's ICMP code. Its caller
/// has asked `listening` (and read the code only then). The error's own addresses are not in
/// the event: the flow's are what a user knows.
#[inline(always)]
pub fn tc_icmp(s: &Scratch, code: u8) {
    emit_tc(tc_what(Reason::IcmpError, true, s.v.id) | ICMP | (code as u64) << 24);
}

/// The sweep (gc.rs) is removing the dead flow whose FORWARD entry is `key` -> `v`: the
/// flow as its client sent it, its backend and SNAT address and port, the low byte of its
/// `ct_flags` (closed, reset, or idle past its timeout) in `how`.
#[inline(never)]
pub fn emit_swept(key: &CtKey, v: &CtValue, now: u64) {
    let to = slots(now, false);
    if to == 0 {
        return;
    }
    let Some(e) = event(EVENT_SWEEP) else {
        return;
    };
    // SAFETY: `e` is this CPU's event.
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
    publish(EVENT_SWEEP, to);
}

/// The flags of a known flow the monitor names its state from (`flow closing`, `closed`,
/// `reset`).
const SHOWN: u16 = ct_flags::FIN | ct_flags::FIN_FORWARD | ct_flags::FIN_REPLY | ct_flags::RST;

/// A known flow's packet translated by tc or XDP (`CtHit`, `Reply` and their XDP twins),
/// if a monitor listens: the frontend and the low byte of the flow's `ct_flags` as its lookup
/// left them (in the event's `how`; FIN, RST and their directions are there). An event for
/// every monitor when the packet changed the flow's state (`ct::added`: its first FIN either
/// way, the second FIN, an RST), else only for those that asked for every packet (the
/// summary's `packets`). Nobody listening, the same load and branch as every decision.
#[inline(always)]
pub fn tc_known(s: &Scratch, reason: Reason) {
    let Some(on) = SVC_MON_ON.get(0) else {
        return;
    };
    if on.slots == 0 {
        return;
    }
    let changed = ct::added(&s.v) & SHOWN != 0;
    if changed || on.packets != 0 {
        emit_tc(
            tc_what(reason, true, s.v.id)
                | (s.v.flags as u64 & 0xff) << 16
                | if changed { 0 } else { PACKET },
        );
    }
}

/// A tc or XDP decision about the scratch space's packet, if a monitor listens.
#[inline(always)]
pub fn tc(reason: Reason, translated: bool, id: u32) {
    if listening() {
        emit_tc(tc_what(reason, translated, id));
    }
}

/// Zeroes an address of the event in two 8-byte stores (`[0; 16]` is a call of the object's
/// byte-loop memset).
///
/// # Safety
/// `a` is 8-aligned and writable: an address field of the `MonitorEvent` being written.
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
/// `a` is the `_pad0` of the `MonitorEvent` being written.
#[inline(always)]
unsafe fn zero_pad(a: *mut [u8; 3]) {
    let b = a.cast::<u8>();
    for i in 0..3 {
        // SAFETY: within the field.
        unsafe { core::ptr::write_volatile(b.add(i), 0) };
    }
}
