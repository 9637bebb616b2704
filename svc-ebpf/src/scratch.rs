//! Per-packet working state of the tc programs, in a per-CPU map value instead of the stack.
//!
//! Why: the BPF stack is 512 bytes for a whole chain of BPF-to-BPF calls, and LLVM's BPF
//! backend shares few stack slots between the locals of inlined code, so a program that keeps
//! a parsed packet, a connection-tracking value, a new flow's two entries and a route lookup
//! on its stack runs out (the verifier's "combined stack size of N calls"). A per-CPU map
//! value is private to the program while it runs: a tc program runs to completion on one CPU,
//! and nothing here runs another tc program of ours before it returns (a redirect happens after
//! the program has returned; bpf_clone_redirect, which would transmit at once, is not used).

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use svc_common::{CtKey, CtValue};

use crate::{fwd::Route, nat::Endpoint, pkt::Pkt};

/// How much of the offending packet an ICMP error the programs send quotes at most: IPv4's
/// whole header with options and 8 bytes of what follows (RFC 792) always fit; IPv6's header,
/// its extension headers and the ports do unless the extension headers are unusually long.
pub const QUOTE_MAX: u32 = 128;

/// The two entries of a new flow, before they are stored, and the state of the search for
/// its SNAT port (`ct::create_snat`).
#[derive(Clone, Copy)]
pub struct Flow {
    pub key: CtKey,
    pub fwd: CtValue,
    pub rep: CtValue,
    pub now: u64,
    /// The REPLY key being tried.
    pub try_key: CtKey,
    pub port_min: u32,
    pub port_span: u32,
    /// 1: `try_key` is claimed.
    pub claimed: u32,
    /// `DatapathConfig::snat_range_frontends` as the search began: read once, not per try.
    pub frontends_in_range: u32,
    /// The entry a try found at `try_key`, as it read it.
    pub seen: CtValue,
}

/// The ICMP errors this CPU may still send at once, and when it last earned one
/// (`reject::icmp_allowed`). Kept across packets: the one field of the scratch space that is
/// not per packet.
#[derive(Clone, Copy)]
pub struct IcmpBucket {
    pub tokens: u64,
    /// The coarse clock, ns.
    pub at_ns: u64,
}

pub struct Scratch {
    /// The packet as parsed.
    pub p: Pkt,
    /// ICMP errors: the tuple of the flow the quoted packet belongs to.
    pub flow: Pkt,
    /// The connection-tracking entry the packet found.
    pub v: CtValue,
    /// A new flow's entries.
    pub new: Flow,
    pub route: Route,
    /// The packet's tuple after translation.
    pub src: Endpoint,
    pub dst: Endpoint,
    /// What an ICMP error the program sends quotes.
    pub quote: [u8; QUOTE_MAX as usize],
    pub icmp: IcmpBucket,
    /// 1 while this CPU's last SNAT port search took a closed flow's port (`ct::create_snat`)
    /// or found none: the range is busy. Kept across packets, and last: a field before the
    /// others would move their offsets, which has grown a frame of the external ingress past
    /// its stack before.
    pub snat_busy: u64,
    /// A new flow's `svc_common::how` (random, affinity, maglev), for the monitor's event of
    /// its first packet (`monitor::tc_new`); set with `new`. Last, as `snat_busy`.
    pub how: u64,
}

#[btf_map]
static SVC_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// This CPU's scratch space.
#[inline(always)]
pub fn get() -> Option<&'static mut Scratch> {
    this_cpu(&SVC_SCRATCH)
}

/// This CPU's entry of a one-entry per-CPU array; `None` never happens, but the verifier
/// wants the check.
#[inline(always)]
#[allow(
    clippy::mut_from_ref,
    reason = "the map's per-CPU value, not the map, is lent"
)]
fn this_cpu<T>(m: &'static PerCpuArray<T, 1>) -> Option<&'static mut T> {
    let p = m.get_ptr_mut(0)?;
    // SAFETY: per CPU, and only this program runs on this CPU until it returns.
    Some(unsafe { &mut *p })
}

/// The last packet this CPU's external ingress redirected to a device's egress, as it left
/// (its tuple after translation). A redirect to an egress runs that device's egress programs
/// at once, on this CPU, before the ingress program's next packet (or later, from another
/// context, when the neighbour is being resolved; then the tuple still names only that
/// packet's own flow). So the external egress knows the packet it sees is one svc has
/// translated already. Not in `Scratch`: it outlives a program's run, and a field there moves
/// the scratch space's layout, which grew a frame of the external ingress past its stack.
#[derive(Clone, Copy)]
pub struct Sent {
    /// The device it was redirected to; 0: none pending.
    pub ifindex: u32,
    pub proto: u32,
    pub src: Endpoint,
    pub dst: Endpoint,
}

#[btf_map]
static SVC_SENT: PerCpuArray<Sent, 1> = PerCpuArray::new();

/// This CPU's `Sent`.
#[inline(always)]
pub fn sent() -> Option<&'static mut Sent> {
    this_cpu(&SVC_SENT)
}
