//! The tc programs' logic (entries in main.rs): per-packet translation of traffic that does
//! not start at a local socket.
//!
//! - `ext_ingress` (external devices, ingress): known flows from their FORWARD entry; replies
//!   of remote backends to a SNAT address from their REPLY entry; new flows to EXTERNAL
//!   frontends (ExternalIPs and LoadBalancer IPs by their own key, NodePorts by the wildcard
//!   key when the destination is a NodePort address); ICMP errors about all of these.
//! - `ext_egress` (external devices, egress): replies of local backends leaving towards the
//!   client, and their ICMP errors.
//! - `pod_ingress` / `pod_egress` (host side of pod devices): per-packet ClusterIP for pods
//!   the socket hooks do not see, CLUSTER frontends, DNAT only (a pod reaching itself through
//!   a frontend is SNATed to that frontend, or its own replies would never leave it).
//!
//! Non-service traffic pays a parse and hash lookups. On the external ingress, `NODE_ADDRS`
//! of its destination first: traffic through the node to an address that is neither the
//! node's nor an external frontend's (nor one svc may still have flows to) stops there. A
//! packet to an address `NODE_ADDRS` holds pays the FORWARD entry of its tuple, the frontend
//! key of its destination if the address is marked `EXTERNAL` (an ExternalIP or LoadBalancer
//! IP is there), and the NodePort wildcard key for a NodePort address;
//! the REPLY lookup runs only for packets to a SNAT address within the SNAT port range (before
//! the FORWARD one: they are mostly remote backends' replies). The other programs pay the
//! FORWARD or REPLY entry and, on pod devices, the frontend key. A SYN without ACK to a node
//! address or on a pod device that is no known flow and does not start one to a local backend
//! adds one lookup: the REPLY entry of its reversed tuple (`ct::syn_on_reply_tuple`). A SYN
//! through the node adds none: the egress's lookup of its answer does that work
//! (`ct::ANSWER`). A packet the
//! external ingress redirected to an external egress is not looked up there again
//! (`scratch::Sent`).
//!
//! Working state lives in the per-CPU scratch space (scratch.rs), and each decision is a
//! function of its own (a BPF-to-BPF call), so no chain of frames exceeds the 512-byte stack.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_FRAG_NEEDED, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
    programs::TcContext,
};
use svc_common::{
    backend_flags, ct_dir, ct_flags, node_addr_flags, scope, svc_flags, AffinityKey, CtValue,
    Outcome, Reason, ServiceKey, ServiceValue, SockState, IPPROTO_TCP,
};

use crate::{
    ct,
    ctx::Ctx,
    frag, fwd, icmp, lb,
    maps::{count, count_service, src_range_key, SVC_SRC_RANGES},
    monitor,
    nat::{self, Endpoint},
    pkt::{self, parsed, Pkt, TCP_ACK, TCP_RST, TCP_SYN},
    reject,
    scratch::{self, Flow, Scratch, Sent},
    tcpsum,
};

const OK: i32 = TC_ACT_OK;
const SHOT: i32 = TC_ACT_SHOT;

/// A packet as the decision's caller: its client is its source address.
struct Packet {
    client: [u8; 16],
    now: u64,
}

impl lb::Caller for Packet {
    #[inline(always)]
    fn now(&self) -> u64 {
        self.now
    }

    /// Only asked for by sticky callers.
    #[inline(always)]
    fn cookie(&self) -> u64 {
        0
    }

    /// The source address is of the frontend's family already.
    #[inline(always)]
    fn affinity_client(&self, id: u32, _v6: bool) -> AffinityKey {
        lb::ip_client(&self.client, id)
    }

    /// A flow keeps its backend through its connection-tracking entries, not a socket.
    #[inline(always)]
    fn sticky(&self) -> bool {
        false
    }

    #[inline(always)]
    fn sock_state(&self) -> *mut SockState {
        core::ptr::null_mut()
    }
}

/// A packet of the external ingress as the decision's caller: as `Packet`, and its 5-tuple
/// is hashed for a frontend's Maglev table (docs/design/maglev.md).
struct ExtPacket<'a> {
    p: &'a Pkt,
    now: u64,
}

impl lb::Caller for ExtPacket<'_> {
    #[inline(always)]
    fn now(&self) -> u64 {
        self.now
    }

    #[inline(always)]
    fn cookie(&self) -> u64 {
        0
    }

    #[inline(always)]
    fn affinity_client(&self, id: u32, _v6: bool) -> AffinityKey {
        lb::ip_client(&self.p.saddr, id)
    }

    #[inline(always)]
    fn sticky(&self) -> bool {
        false
    }

    #[inline(always)]
    fn sock_state(&self) -> *mut SockState {
        core::ptr::null_mut()
    }

    #[inline(always)]
    fn hashes_flows(&self) -> bool {
        true
    }

    #[inline(always)]
    fn flow_hash(&self, seed: u64) -> u32 {
        let p = self.p;
        svc_common::maglev_flow_hash(&p.saddr, &p.daddr, p.sport_be, p.dport_be, p.proto, seed)
    }
}

#[inline(always)]
fn now() -> u64 {
    lb::clock_ns()
}

/// Which program parses: what its ICMP errors are looked up as, and whether it forwards
/// them itself.
#[derive(Clone, Copy)]
struct Hook {
    /// `icmp::FORWARD`, `icmp::REPLY`, `icmp::HAIRPIN`.
    icmp_dirs: u32,
    pod: bool,
    /// The external ingress forwards an error whose source became a frontend or SNAT
    /// address itself, as it does the flow's packets.
    routes: bool,
    /// The external egress: a packet the ingress redirected here is translated already
    /// (`scratch::Sent`).
    sent: bool,
}

const EXT_INGRESS: Hook = Hook {
    icmp_dirs: icmp::FORWARD | icmp::REPLY,
    pod: false,
    routes: true,
    sent: false,
};
const EXT_EGRESS: Hook = Hook {
    icmp_dirs: icmp::REPLY | icmp::ANSWERS,
    pod: false,
    routes: false,
    sent: true,
};
const POD_INGRESS: Hook = Hook {
    icmp_dirs: icmp::FORWARD | icmp::HAIRPIN,
    pod: true,
    routes: false,
    sent: false,
};
const POD_EGRESS: Hook = Hook {
    icmp_dirs: icmp::REPLY,
    pod: true,
    routes: false,
    sent: false,
};

/// Parses the packet into `s.p`; `None` when it is a TCP or UDP packet to consider,
/// otherwise the verdict: ICMP errors are translated when they are about our flows; what
/// cannot be parsed, and later fragments, pass and are counted.
#[inline(always)]
fn parse_or_pass(ctx: &TcContext, s: &mut Scratch, hook: Hook) -> Option<i32> {
    match pkt::parse(ctx, &mut s.p) {
        parsed::L4 => None,
        parsed::ICMP_ERROR => Some(icmp_error(ctx, s, hook)),
        parsed::UNPARSED => {
            count(Reason::PassUnparsed, s.p.ifindex);
            Some(OK)
        }
        parsed::FRAGMENT => later_fragment(ctx, s, hook),
        _ => Some(OK),
    }
}

/// A non-first fragment: `None` when its first fragment was translated (its ports are then in
/// `s.p`), to go the way of its flow's packets; else passed (frag.rs).
#[inline(always)]
fn later_fragment(ctx: &TcContext, s: &mut Scratch, hook: Hook) -> Option<i32> {
    // On the external ingress only a packet to a node address can be a flow's, as below.
    if (!hook.routes || lb::node_addr_flags(&s.p.daddr) != 0) && frag::resume(ctx, &mut s.p) {
        return None;
    }
    if hook.sent {
        if let Some(t) = scratch::sent() {
            // Ports 0 on both sides: `note_sent` of a later fragment.
            if t.ifindex == s.p.ifindex && is_sent(t, &s.p) {
                t.ifindex = 0;
                return Some(OK);
            }
        }
    }
    count(Reason::Fragment, s.p.ifindex);
    Some(OK)
}

/// A later fragment that is no known flow's (its flow gone since its first fragment) starts
/// none: passed, counted as one without a record.
#[inline(always)]
fn later_fragment_unknown(s: &Scratch) -> Option<i32> {
    if s.p.later_frag == 0 {
        return None;
    }
    count(Reason::Fragment, s.p.ifindex);
    Some(OK)
}

/// An ICMP error: translated when it is about one of our flows. Only the external ingress
/// forwards one itself (when its source became a frontend or SNAT address), and a pod device
/// sends one about the pod's hairpin flow back into it; elsewhere the stack, or the device it
/// is leaving by, takes it.
#[inline(never)]
fn icmp_error(ctx: &TcContext, s: &mut Scratch, hook: Hook) -> i32 {
    let ifindex = s.p.ifindex;
    match icmp::translate(ctx, s, hook.icmp_dirs, hook.pod, now()) {
        icmp::Translated::Dst => {
            icmp_translated(ctx, s);
            OK
        }
        icmp::Translated::Src => {
            icmp_translated(ctx, s);
            if !hook.routes {
                return OK;
            }
            route_icmp(ctx, s)
        }
        icmp::Translated::Back => {
            // From the frontend: straight back, as the hairpin flow's own packets go.
            icmp_translated(ctx, s);
            fwd::bounce(ctx, ifindex)
        }
        icmp::Translated::Unparsed => {
            count(Reason::PassUnparsed, ifindex);
            OK
        }
        icmp::Translated::Failed => {
            count(Reason::ErrRewrite, ifindex);
            SHOT
        }
        icmp::Translated::NotOurs => OK,
    }
}

/// Counts a translated ICMP error, and tells a listening monitor (with the error's code,
/// read only then). A function of its own: `icmp_error` is on the external ingress's deepest
/// chain, at the stack limit, and its frame must not grow; this one's is beside that chain's
/// callees, not on top of them.
#[inline(never)]
fn icmp_translated(ctx: &TcContext, s: &Scratch) {
    count(Reason::IcmpError, s.p.ifindex);
    if monitor::listening() {
        let mut code = [0u8; 1];
        let code = if pkt::load(ctx, s.p.l4_off + 1, &mut code) {
            code[0]
        } else {
            0
        };
        monitor::tc_icmp(s, code);
    }
}

/// Forwards a translated ICMP error whose source became a frontend or SNAT address.
#[inline(never)]
fn route_icmp(ctx: &TcContext, s: &mut Scratch) -> i32 {
    // The outer header as translated: read again rather than carried back.
    if pkt::parse(ctx, &mut s.p) != parsed::ICMP_ERROR {
        return OK;
    }
    let p = &s.p;
    let v6 = p.v6 != 0;
    fwd::lookup(ctx, v6, &p.saddr, &p.daddr, p.ifindex, 0, &mut s.route);
    // Its hop counted by the rewrite every routed packet takes, its tuple kept.
    s.src = Endpoint {
        addr: s.p.saddr,
        port_be: s.p.sport_be,
    };
    s.dst = Endpoint {
        addr: s.p.daddr,
        port_be: s.p.dport_be,
    };
    if !fwd::usable(&s.route) || s.p.ttl <= 1 || !nat::rewrite(ctx, &s.p, &s.src, &s.dst, true) {
        return OK;
    }
    fwd::redirect(ctx, v6, &s.route)
}

/// Rewrites the packet to `s.src` -> `s.dst` and hands it to the stack. `reason` is counted
/// on success.
#[inline(always)]
fn to_stack(ctx: &TcContext, s: &Scratch, reason: Reason) -> i32 {
    rewritten(ctx, s, reason, false)
}

/// `to_stack`, with `hop` a hop counted too (`nat::rewrite`).
#[inline(always)]
fn rewritten(ctx: &TcContext, s: &Scratch, reason: Reason, hop: bool) -> i32 {
    if !nat::rewrite(ctx, &s.p, &s.src, &s.dst, hop) {
        count(Reason::ErrRewrite, s.p.ifindex);
        return SHOT;
    }
    if s.p.first_frag != 0 {
        frag::record(ctx, &s.p);
    }
    let reason = if s.p.later_frag != 0 {
        Reason::FragmentTranslated
    } else {
        reason
    };
    count(reason, s.p.ifindex);
    if reason as u32 == Reason::New as u32 {
        // The new flow's first packet, as it leaves: its backend, and its SNAT port if any.
        monitor::tc_new(s);
        count_service(Reason::New, s.new.fwd.id);
    } else if reason as u32 == Reason::CtHit as u32 || reason as u32 == Reason::Reply as u32 {
        monitor::tc_known(s, reason);
    }
    OK
}

/// Rewrites the packet to `s.src` -> `s.dst` and sends it where `s.route` says, as a
/// forwarding router would (TTL counted). A route that cannot be followed leaves it to the
/// stack. Its callers have dropped a packet whose hop would spend its TTL.
#[inline(always)]
fn to_route(ctx: &TcContext, s: &mut Scratch, reason: Reason) -> i32 {
    let routed = fwd::usable(&s.route);
    let verdict = rewritten(ctx, s, reason, routed);
    if verdict != OK || !routed {
        return verdict;
    }
    let verdict = fwd::redirect(ctx, s.p.v6 != 0, &s.route);
    if verdict == TC_ACT_REDIRECT {
        note_sent(s);
    }
    verdict
}

/// Whether the packet is to be forwarded here (`s.route` usable, or the packet too big for
/// it) and its hop would leave it no TTL: a router drops it, and counts the hop before it
/// measures the packet against the route's MTU.
#[inline(always)]
fn spent(s: &Scratch) -> bool {
    s.p.ttl <= 1 && (fwd::usable(&s.route) || too_big(s))
}

/// Drops a packet whose hop would spend its TTL, as a router does: counted, and answered with
/// an ICMP time exceeded from the address it was sent to (the node's, for a NodePort), so
/// traceroute shows the node. A function of its own: the answer's code is not copied into
/// every caller.
#[inline(never)]
fn drop_ttl(ctx: &TcContext, s: &mut Scratch) -> i32 {
    count(Reason::DropTtl, s.p.ifindex);
    reject::icmp_error(ctx, s, reject::Kind::TimeExceeded)
}

/// Records the packet `to_route` redirected as `scratch::Sent`. A function of its own: inlined,
/// its copies grow the frames of `to_route`'s callers, one of which is on the external
/// ingress's deepest call chain.
#[inline(never)]
fn note_sent(s: &Scratch) {
    if let Some(t) = scratch::sent() {
        t.ifindex = s.route.params.ifindex;
        t.proto = s.p.proto as u32;
        t.src = s.src;
        t.dst = s.dst;
        if s.p.later_frag != 0 {
            // The egress sees no ports in it either.
            t.src.port_be = 0;
            t.dst.port_be = 0;
        }
    }
}

/// Whether the route lookup found the packet too large for the route, and it may not be
/// fragmented: then its sender gets an ICMP fragmentation needed / packet too big instead
/// (from the address it sent to), so PMTU discovery works through the translation.
#[inline(always)]
fn too_big(s: &Scratch) -> bool {
    s.route.ret == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64 && s.p.df != 0
}

#[inline(always)]
fn send_too_big(ctx: &TcContext, s: &mut Scratch) -> i32 {
    count(Reason::TooBig, s.p.ifindex);
    // SAFETY: the lookup wrote the MTU into the union's output member.
    let mtu = unsafe { s.route.params.__bindgen_anon_1.mtu_result } as u32;
    reject::icmp_error(ctx, s, reject::Kind::TooBig(mtu))
}

/// A packet that must leave from a node address or a frontend: routed to `s.dst` here (the
/// stack's forwarding would drop it as a martian).
#[inline(never)]
fn send_routed(ctx: &TcContext, s: &mut Scratch, reason: Reason) -> i32 {
    let p = &s.p;
    fwd::lookup(
        ctx,
        p.v6 != 0,
        &s.src.addr,
        &s.dst.addr,
        p.ifindex,
        0,
        &mut s.route,
    );
    if spent(s) {
        return drop_ttl(ctx, s);
    }
    if too_big(s) {
        return send_too_big(ctx, s);
    }
    to_route(ctx, s, reason)
}

#[inline(always)]
pub(crate) fn in_snat_range(port_be: u16) -> bool {
    let (min, max) = ct::snat_range();
    let port = u16::from_be(port_be);
    port >= min && port <= max
}

/// Whether the packet's flow, its FORWARD entry in `s.v`, is being handed over to the node's
/// conntrack (`ct_flags::HANDING`, the mark still holding): the packet is to be dropped
/// (counted). A lapsed mark is cleared: the flow is svc's again.
#[inline(always)]
fn held_for_handover(s: &Scratch, now: u64) -> bool {
    if s.v.flags & ct_flags::HANDING == 0 {
        return false;
    }
    if ct::handing_holds(&s.v, now) {
        count(Reason::DropHanding, s.p.ifindex);
        return true;
    }
    ct::lapse_handing(&s.p);
    false
}

/// A segment of a known flow that is not where its sender is (`ct::Found::Invalid`): dropped,
/// counted, the flow unchanged.
#[inline(never)]
fn out_of_window(s: &Scratch) -> i32 {
    count(Reason::DropTcpWindow, s.p.ifindex);
    SHOT
}

/// Looks up the packet's entry in direction `dir` into `s.v`, refreshing it, and the
/// translation it gives into `s.src`/`s.dst`; `ct::lookup`'s answer. `ct::Found::Closed`
/// leaves the closed flow in `s.v` for the caller to take over or remove.
#[inline(always)]
fn found(s: &mut Scratch, dir: u8, pod: bool, now: u64) -> ct::Found {
    found_marked(s, dir, pod, now, ct::PacketFlags::NONE)
}

/// `found`, with `mark` (`ct::ANSWER`) added to the packet's flags.
#[inline(always)]
fn found_marked(s: &mut Scratch, dir: u8, pod: bool, now: u64, mark: ct::PacketFlags) -> ct::Found {
    let key = ct::key_of(&s.p, dir);
    let add = ct::packet_flags(&s.p, dir) | mark;
    let found = ct::lookup(&key, pod, add, now, &mut s.v);
    if found == ct::Found::Hit {
        ct::translated(&s.p, dir, &s.v, &mut s.src, &mut s.dst);
    }
    found
}

/// What is left of closed flows on the packet's tuples once the frontend lookup said what it
/// becomes (`next`). A new flow to a local backend (`new_local`) takes the closed flow its SYN
/// found (`closed`: `ct::Found::Closed`, in `s.v`) over or removes it, and skips the reversed
/// tuple: its replies are translated once, at the egress, by its own REPLY entry. Anything
/// else removes that closed flow here, and a closed flow on the reversed tuple
/// (`ct::syn_on_reply_tuple`): a direct connection from a client's port to the backend of its
/// closed flow (a backend on a node address, or a pod's ClusterIP backend); a frontend now on a
/// closed flow's backend address and port, which refuses the SYN or answers it with an ICMP
/// error that leaves by the egress; a remote or hairpin flow, whose ICMP errors or bounced
/// replies are looked up again by that tuple.
#[inline(always)]
pub(crate) fn settle_closed(s: &Scratch, closed: bool, next: Next, pod: bool) {
    if next == Next::NewLocal {
        return;
    }
    if closed {
        ct::forget_closed(&s.p, &s.v);
    }
    ct::syn_on_reply_tuple(&s.p, pod);
}

// ---------------------------------------------------------------------------------------
// External devices.

#[inline(always)]
pub fn ext_ingress(ctx: &TcContext) -> i32 {
    let Some(s) = scratch::get() else {
        return OK;
    };
    if let Some(verdict) = parse_or_pass(ctx, s, EXT_INGRESS) {
        return verdict;
    }
    let node = lb::node_addr_flags(&s.p.daddr);
    if node == 0 {
        // Every FORWARD entry and every frontend, and every SNAT address a reply comes back
        // to, is one of `NODE_ADDRS`: traffic through the node to anywhere else pays none of
        // the big lookups (nor the clock). A SYN's reply tuple may be a closed flow's
        // (`syn_on_reply_tuple`): the egress removes it when the answer leaves (`ct::ANSWER`).
        return OK;
    }
    if s.p.proto == IPPROTO_TCP && !ct::valid_tcp_flags(s.p.tcp_flags) {
        // To a node address or frontend: no TCP sends it, and no flow of svc's may take it.
        count(Reason::DropInvalidTcp, s.p.ifindex);
        return SHOT;
    }
    let now = now();
    // Looked up before the FORWARD entry: with the default ranges a packet to a SNAT address
    // and port is a remote backend's reply, not a client's packet to a frontend (NodePorts
    // lie below the SNAT range), and each lookup of the connection-tracking table is a cache
    // miss in busy traffic. A SNAT range that covers frontend ports on node addresses (the
    // agent's default when the node's ephemeral ports reach 65535 is 1024 up to them) makes
    // those frontends' packets pay a REPLY lookup that misses first.
    if in_snat_range(s.p.dport_be) && node & node_addr_flags::SNAT != 0 {
        match found(s, ct_dir::REPLY, false, now) {
            // A remote backend's reply, to the address and port its flow was SNATed to:
            // from the frontend to the client, forwarded here (its new source is a node
            // address or a frontend).
            ct::Found::Hit => return send_routed(ctx, s, Reason::Reply),
            ct::Found::Invalid => return out_of_window(s),
            _ => {}
        }
    }
    let fwd = found(s, ct_dir::FORWARD, false, now);
    if fwd == ct::Found::Invalid {
        return out_of_window(s);
    }
    if fwd == ct::Found::Hit {
        if held_for_handover(s, now) {
            return SHOT;
        }
        if s.v.flags & ct_flags::SNAT == 0 || s.v.snat_addr == s.p.saddr {
            // To a local backend, from the client itself (its port remapped, perhaps: see
            // `new_remapped`): the stack delivers it.
            return to_stack(ctx, s, Reason::CtHit);
        }
        return send_routed(ctx, s, Reason::CtHit);
    }
    if let Some(verdict) = later_fragment_unknown(s) {
        return verdict;
    }
    let closed = fwd == ct::Found::Closed;
    let next = ext_frontend(ctx, s, node, now);
    settle_closed(s, closed, next, false);
    match next {
        Next::Pass | Next::Tc => OK,
        Next::Drop => SHOT,
        Next::Midstream => {
            count(Reason::PassMidstream, s.p.ifindex);
            OK
        }
        Next::NewLocal => match new_local(ctx, s, closed) {
            Local::Pass => OK,
            Local::Drop => SHOT,
            Local::Remap => new_remapped(ctx, s),
        },
        Next::NewSnat => ext_new_snat(ctx, s),
        Next::Reject => reject::reject(ctx, s),
    }
}

/// What a frontend lookup (`ext_frontend`, `pod_frontend`) leaves the program to do. Not a tc
/// verdict: the program turns it into one. The steps that store a new flow are siblings of
/// the lookup rather than its callees, so their stack frames do not add up.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// No frontend's packet: it goes on untouched (`TC_ACT_OK`).
    Pass,
    /// Dropped, counted already (`TC_ACT_SHOT`).
    Drop,
    /// Store the new flow in `s.new` and send its first packet to `s.dst`, not SNATed
    /// (`new_local`).
    NewLocal,
    /// The same, SNATed: to a remote backend, or a pod's hairpin.
    NewSnat,
    /// Reject the packet (`reject::reject`).
    Reject,
    /// The middle of a TCP connection svc has no flow for, to a frontend with backends: one
    /// the node's own conntrack carries (made under kube-proxy before svc took over) and goes
    /// on translating. Taken for a new flow it would reach a backend that resets it; the
    /// stack gets it untouched, and no backend is chosen for it (a choice would be remembered
    /// for sessionAffinity, for a client that made no new connection).
    Midstream,
    /// XDP only (`Ctx::XDP`): tc decides (a refusal, a drop XDP cannot judge, an affinity
    /// choice): the packet goes on to it untouched, nothing stored (the XDP program counts
    /// `xdp_pass_new`).
    Tc,
}

/// A frontend's packet that tc refuses or drops, counted `reason` (`next`); at XDP left to tc
/// (`Next::Tc`), which counts it once.
#[inline(always)]
fn refused<C: Ctx>(s: &Scratch, reason: Reason, id: u32, next: Next) -> Next {
    if C::XDP {
        return Next::Tc;
    }
    dropped(s, reason, id);
    next
}

/// A frontend's packet dropped for what its frontend alone says (source ranges; no local
/// backend under externalTrafficPolicy Local), counted `reason`: both programs drop it
/// alike, XDP before the kernel builds an skb for it (a flood from outside the ranges).
#[inline(always)]
fn dropped(s: &Scratch, reason: Reason, id: u32) -> Next {
    count(reason, s.p.ifindex);
    monitor::tc(reason, false, id);
    count_service(reason, id);
    Next::Drop
}

/// A packet that is no known flow: the first of a new one if its destination is an external
/// frontend. Shared with the XDP program, where what tc refuses, drops for reasons XDP cannot
/// judge, or remembers (sessionAffinity) is `Next::Tc`, decided before anything is stored;
/// what the frontend alone drops is dropped by both (`dropped`).
#[inline(never)]
pub(crate) fn ext_frontend<C: Ctx>(ctx: &C, s: &mut Scratch, node: u32, now: u64) -> Next {
    let p = &s.p;
    let mut key = ServiceKey {
        addr: p.daddr,
        port_be: p.dport_be,
        proto: p.proto,
        scope: scope::EXTERNAL,
    };
    let mut svc = ServiceValue::default();
    if lb::resolve(&mut key, &mut svc, &lb::ExtIngress { node }) != lb::FOUND {
        return Next::Pass;
    }
    if svc.flags & svc_flags::SOURCE_RANGES != 0
        && SVC_SRC_RANGES
            .get(&src_range_key(svc.id, &p.saddr))
            .is_none()
    {
        return dropped(s, Reason::DropSourceRange, svc.id);
    }
    // A frontend without backends refuses it below as it refuses a SYN: a reject, or a drop
    // under externalTrafficPolicy Local.
    // A SYN-ACK that no flow knows is no connection's start either: taken for one, a
    // backend would answer a forged SYN-ACK, and the table would hold its entries.
    if p.proto == IPPROTO_TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN && svc.count != 0 {
        return Next::Midstream;
    }
    if p.proto == IPPROTO_TCP && !tcpsum::valid(ctx, p) {
        // A SYN, or a segment to be refused: what the backend's stack would drop takes no
        // backend, no flow and no answer.
        return refused::<C>(s, Reason::DropBadChecksum, svc.id, Next::Drop);
    }
    // A choice remembered for the client is state: made at XDP, it would outlive a packet
    // XDP then leaves to tc (a route it cannot take).
    if C::XDP && svc.flags & svc_flags::AFFINITY != 0 {
        return Next::Tc;
    }
    let caller = ExtPacket { p, now };
    let mut d = lb::Decision::default();
    let outcome = lb::decide_with(&key, svc, &caller, &mut d);
    s.how = d.how as u64;
    match outcome {
        lb::FOUND => {}
        Outcome::NoBackend => {
            if svc.flags & svc_flags::EXTERNAL_LOCAL != 0 {
                return dropped(s, Reason::DropNoLocalBackend, svc.id);
            }
            return refused::<C>(s, Reason::RejectNoBackend, svc.id, Next::Reject);
        }
        _ => return refused::<C>(s, Reason::ErrMissingEntry, svc.id, Next::Drop),
    }
    s.dst = Endpoint {
        addr: d.backend.addr,
        port_be: d.backend.port_be,
    };
    new_flow(&mut s.new, p, &s.dst, svc.id, 0, now);
    // Under externalTrafficPolicy Local every backend is local and the client is kept.
    if d.backend.flags & backend_flags::LOCAL != 0 || svc.flags & svc_flags::EXTERNAL_LOCAL != 0 {
        return Next::NewLocal;
    }
    Next::NewSnat
}

/// The two entries of a new flow from `p` to `backend` for frontend `id`, `flags` on both.
#[inline(always)]
fn new_flow(f: &mut Flow, p: &Pkt, backend: &Endpoint, id: u32, flags: u16, now: u64) {
    f.key = ct::key_of(p, ct_dir::FORWARD);
    // Every new flow is unassured (ct.rs, `assure`). A TCP flow's client sequence numbers
    // are tracked from its SYN (the reply's from the SYN-ACK).
    let (flags, seq_end) = if p.proto == IPPROTO_TCP {
        (
            flags | ct_flags::UNASSURED | ct_flags::TRACKED,
            p.seq().wrapping_add(p.seq_len()),
        )
    } else {
        (flags | ct_flags::UNASSURED, 0)
    };
    f.fwd = CtValue {
        nat_addr: backend.addr,
        nat_port_be: backend.port_be,
        flags,
        seq_end,
        id,
        ifindex: p.ifindex,
        last_seen_ns: now,
        ..Default::default()
    };
    f.rep = CtValue {
        nat_addr: p.daddr,
        nat_port_be: p.dport_be,
        flags,
        id,
        ifindex: p.ifindex,
        last_seen_ns: now,
        ..Default::default()
    };
    f.now = now;
}

/// The new flow is SNATed to `addr` (its port is chosen when it is stored): the reply goes
/// back to the client.
#[inline(always)]
fn snat_flow(f: &mut Flow, p: &Pkt, addr: &[u8; 16]) {
    f.fwd.flags |= ct_flags::SNAT;
    f.fwd.snat_addr = *addr;
    f.rep.flags |= ct_flags::SNAT;
    f.rep.snat_addr = p.saddr;
    f.rep.snat_port_be = p.sport_be;
}

/// `new_local`'s answer. Not a tc verdict: the program turns it into one.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Local {
    /// Stored and rewritten: to the stack (`TC_ACT_OK`).
    Pass,
    /// Dropped, counted already (`TC_ACT_SHOT`).
    Drop,
    /// The flow's reply tuple clashes (`ct::Create::Clash`): `new_remapped` takes the packet
    /// instead (a sibling call, not a callee, so the SNAT port search does not stack on this
    /// frame).
    Remap,
}

/// Stores a new flow that is not SNATed and sends its first packet to the stack, from the
/// client to `s.dst`; `Local::Remap` when its reply tuple clashes. Both device kinds.
#[inline(never)]
fn new_local(ctx: &TcContext, s: &mut Scratch, closed: bool) -> Local {
    match ct::create(&s.new.key, &s.new.fwd, &s.new.rep, closed.then_some(&s.v)) {
        ct::Create::Stored => {}
        ct::Create::Clash => return Local::Remap,
        ct::Create::Failed => {
            count(Reason::ErrCtUpdate, s.p.ifindex);
            return Local::Drop;
        }
    }
    s.src = Endpoint {
        addr: s.p.saddr,
        port_be: s.p.sport_be,
    };
    // `to_stack` answers TC_ACT_OK or TC_ACT_SHOT only.
    if to_stack(ctx, s, Reason::New) == OK {
        Local::Pass
    } else {
        Local::Drop
    }
}

/// A new flow whose reply tuple another live flow holds (the same client address and port to
/// the same backend, through another frontend): the client keeps its address and gets
/// another source port from the SNAT range, as conntrack's clash resolution does, so neither
/// flow's replies are taken for the other's.
#[inline(never)]
fn new_remapped(ctx: &TcContext, s: &mut Scratch) -> i32 {
    let client = s.p.saddr;
    if !commit_snat(s, &client) {
        return SHOT;
    }
    to_stack(ctx, s, Reason::New)
}

/// Stores the new flow SNATed to `addr` (its port chosen); false when it cannot be (counted:
/// the packet is dropped).
#[inline(always)]
pub(crate) fn commit_snat(s: &mut Scratch, addr: &[u8; 16]) -> bool {
    snat_flow(&mut s.new, &s.p, addr);
    match ct::create_snat(&mut s.new) {
        ct::Snat::Stored => {
            s.src = Endpoint {
                addr: s.new.fwd.snat_addr,
                port_be: s.new.fwd.snat_port_be,
            };
            true
        }
        ct::Snat::Exhausted => {
            count(Reason::DropSnatExhausted, s.p.ifindex);
            monitor::tc(Reason::DropSnatExhausted, false, s.new.fwd.id);
            count_service(Reason::DropSnatExhausted, s.new.fwd.id);
            false
        }
        ct::Snat::Failed => {
            count(Reason::ErrCtUpdate, s.p.ifindex);
            false
        }
    }
}

/// A new flow to a backend on another node (`s.dst`): SNATed to a node address, so the reply
/// comes back through this node. The address is the source the route to the backend prefers
/// (as MASQUERADE picks it), if `NODE_ADDRS` allows it for SNAT; else the node address the
/// client sent to, if allowed; else the packet is dropped (counted `ERR_REWRITE`).
#[inline(never)]
fn ext_new_snat(ctx: &TcContext, s: &mut Scratch) -> i32 {
    let v6 = s.p.v6 != 0;
    let ifindex = s.p.ifindex;
    route_to_backend(ctx, s);
    // Before the flow is stored: a packet that cannot leave takes no SNAT port. Whatever the
    // lookup said: a packet to a remote backend is forwarded, by svc or, when the route
    // cannot be followed here, by the stack, and either counts the hop first.
    if s.p.ttl <= 1 {
        return drop_ttl(ctx, s);
    }
    if too_big(s) {
        return send_too_big(ctx, s);
    }
    let routed = fwd::usable(&s.route);
    let mut snat = [0u8; 16];
    if !snat_addr(s, routed, &mut snat) {
        count(Reason::ErrRewrite, ifindex);
        return SHOT;
    }
    if !commit_snat(s, &snat) {
        return SHOT;
    }
    if !routed {
        // The lookup with the source named no usable route: ask again, from the address the
        // packet now leaves with.
        fwd::lookup(ctx, v6, &s.src.addr, &s.dst.addr, ifindex, 0, &mut s.route);
    }
    to_route(ctx, s, Reason::New)
}

/// The route from this node to a new flow's remote backend `s.dst` into `s.route`, with the
/// source address it prefers (`fwd::LOOKUP_SRC`).
#[inline(always)]
pub(crate) fn route_to_backend<C: Ctx>(ctx: &C, s: &mut Scratch) {
    let zero = [0u8; 16];
    let p = &s.p;
    fwd::lookup(
        ctx,
        p.v6 != 0,
        &zero,
        &s.dst.addr,
        p.ifindex,
        fwd::LOOKUP_SRC,
        &mut s.route,
    );
}

/// The address a new flow to a remote backend is SNATed to, into `out`: the source the route
/// to it prefers (`route_to_backend`; `routed`: the route is usable), as MASQUERADE picks it,
/// if `NODE_ADDRS` allows it for SNAT; else the node address the client sent to, if allowed.
/// False: neither is.
#[inline(always)]
pub(crate) fn snat_addr(s: &Scratch, routed: bool, out: &mut [u8; 16]) -> bool {
    fwd::route_src(&s.route, s.p.v6 != 0, out);
    if routed && lb::node_addr_flags(out) & node_addr_flags::SNAT != 0 {
        return true;
    }
    if lb::node_addr_flags(&s.p.daddr) & node_addr_flags::SNAT == 0 {
        return false;
    }
    *out = s.p.daddr;
    true
}

#[inline(always)]
pub fn ext_egress(ctx: &TcContext) -> i32 {
    let Some(s) = scratch::get() else {
        return OK;
    };
    if let Some(verdict) = parse_or_pass(ctx, s, EXT_EGRESS) {
        return verdict;
    }
    if let Some(t) = scratch::sent() {
        if t.ifindex == s.p.ifindex && is_sent(t, &s.p) {
            // Translated already, by the ingress that redirected it here a moment ago: a
            // connection-tracking lookup would only miss (or, for a tuple that is also some
            // flow's reply, translate it twice).
            t.ifindex = 0;
            return OK;
        }
    }
    let mark = if answers_syn(&s.p) {
        ct::ANSWER
    } else {
        ct::PacketFlags::NONE
    };
    match found_marked(s, ct_dir::REPLY, false, ct::NOW_ON_HIT, mark) {
        ct::Found::Hit => {}
        ct::Found::Invalid => return out_of_window(s),
        _ => return OK,
    }
    // A local backend's reply, leaving: it comes from the frontend.
    to_stack(ctx, s, Reason::Reply)
}

/// Whether `p` is a TCP SYN-ACK or RST: what answers a SYN (an ICMP error too:
/// `icmp::ANSWERS`).
#[inline(always)]
fn answers_syn(p: &Pkt) -> bool {
    p.proto == IPPROTO_TCP
        && (p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK || p.tcp_flags & TCP_RST != 0)
}

/// Whether `p` is the packet `t` names.
#[inline(always)]
fn is_sent(t: &Sent, p: &Pkt) -> bool {
    t.proto == p.proto as u32
        && t.src.port_be == p.sport_be
        && t.dst.port_be == p.dport_be
        && t.src.addr == p.saddr
        && t.dst.addr == p.daddr
}

// ---------------------------------------------------------------------------------------
// Pod devices: per-packet ClusterIP.

#[inline(always)]
pub fn pod_ingress(ctx: &TcContext) -> i32 {
    let Some(s) = scratch::get() else {
        return OK;
    };
    if let Some(verdict) = parse_or_pass(ctx, s, POD_INGRESS) {
        return verdict;
    }
    let now = now();
    let fwd = found(s, ct_dir::FORWARD, true, now);
    if fwd == ct::Found::Invalid {
        return out_of_window(s);
    }
    if fwd == ct::Found::Hit {
        if held_for_handover(s, now) {
            return SHOT;
        }
        return pod_send(ctx, s, Reason::CtHit);
    }
    // A pod's reply to itself through a frontend (hairpin): to the frontend's address and a
    // SNAT port. Not a SYN that found a closed flow (no reply), whose entry `s.v` holds.
    let rep = if fwd != ct::Found::Closed && in_snat_range(s.p.dport_be) {
        found(s, ct_dir::REPLY, true, now)
    } else {
        ct::Found::Miss
    };
    if rep == ct::Found::Invalid {
        return out_of_window(s);
    }
    if rep == ct::Found::Hit {
        if s.dst.addr != s.p.saddr {
            // A backend pod's reply to another pod whose own port lies in the SNAT range: the
            // client's device restores the frontend, after the stack has forwarded the reply
            // as the reply of the connection it saw. Made to come from the frontend here, it
            // would enter the stack as a martian, and as no connection netfilter knows.
            return OK;
        }
        return pod_send(ctx, s, Reason::Reply);
    }
    if let Some(verdict) = later_fragment_unknown(s) {
        return verdict;
    }
    let closed = fwd == ct::Found::Closed;
    let next = pod_frontend(ctx, s, now);
    settle_closed(s, closed, next, true);
    match next {
        Next::Pass | Next::Midstream | Next::Tc => OK,
        Next::Drop => SHOT,
        Next::NewLocal => match new_local(ctx, s, closed) {
            Local::Pass => OK,
            Local::Drop => SHOT,
            Local::Remap => new_remapped(ctx, s),
        },
        Next::NewSnat => pod_new_hairpin(ctx, s),
        Next::Reject => reject::reject(ctx, s),
    }
}

/// Sends a pod flow's packet on: to the stack, or straight back into the pod's device when
/// the flow is a pod reaching itself, either way (its source is then the frontend, which the
/// stack would take as a martian). A flow whose port was remapped (`new_remapped`) is SNATed
/// too, but goes to another pod: to the stack.
#[inline(always)]
fn pod_send(ctx: &TcContext, s: &Scratch, reason: Reason) -> i32 {
    let verdict = to_stack(ctx, s, reason);
    if verdict != OK || s.dst.addr != s.p.saddr {
        return verdict;
    }
    fwd::bounce(ctx, s.p.ifindex)
}

/// A packet that is no known flow: the first of a new one if its destination is a
/// cluster frontend: `Next::NewLocal` is DNAT only, `Next::NewSnat` a hairpin. Never
/// `Next::Midstream`.
#[inline(never)]
fn pod_frontend(ctx: &TcContext, s: &mut Scratch, now: u64) -> Next {
    let p = &s.p;
    let mut key = ServiceKey {
        addr: p.daddr,
        port_be: p.dport_be,
        proto: p.proto,
        scope: scope::CLUSTER,
    };
    let mut svc = ServiceValue::default();
    let caller = Packet {
        client: p.saddr,
        now,
    };
    let mut d = lb::Decision::default();
    let mut outcome = lb::resolve(&mut key, &mut svc, &lb::PodIngress);
    // Only a SYN: a pod's first segment of a flow svc does not know otherwise is a
    // connection's middle, whose checksum a GSO sender leaves in forms not checked here.
    if outcome == lb::FOUND
        && p.proto == IPPROTO_TCP
        && p.tcp_flags & TCP_SYN != 0
        && !tcpsum::valid(ctx, p)
    {
        count(Reason::DropBadChecksum, p.ifindex);
        monitor::tc(Reason::DropBadChecksum, false, svc.id);
        return Next::Drop;
    }
    if outcome == lb::FOUND {
        outcome = lb::decide_with(&key, svc, &caller, &mut d);
    }
    match outcome {
        lb::FOUND => {}
        lb::NOT_SERVICE => return Next::Pass,
        Outcome::NoBackend | Outcome::NoPort => {
            // A ClusterIP's undefined port, or a frontend without backends: refused, as a
            // socket's connect() would be.
            count(Reason::RejectNoBackend, p.ifindex);
            monitor::tc(Reason::RejectNoBackend, false, svc.id);
            count_service(Reason::RejectNoBackend, svc.id);
            return Next::Reject;
        }
        _ => {
            count(Reason::ErrMissingEntry, p.ifindex);
            monitor::tc(Reason::ErrMissingEntry, false, svc.id);
            count_service(Reason::ErrMissingEntry, svc.id);
            return Next::Drop;
        }
    }
    s.dst = Endpoint {
        addr: d.backend.addr,
        port_be: d.backend.port_be,
    };
    new_flow(&mut s.new, p, &s.dst, svc.id, ct_flags::POD, now);
    s.how = d.how as u64;
    if d.backend.addr != p.saddr {
        return Next::NewLocal;
    }
    Next::NewSnat
}

/// The pod is its own backend: it must see the packet come from elsewhere, or it would
/// answer itself inside its own namespace. From the frontend, on a SNAT port; straight back
/// into its device.
#[inline(never)]
fn pod_new_hairpin(ctx: &TcContext, s: &mut Scratch) -> i32 {
    let frontend = s.p.daddr;
    if !commit_snat(s, &frontend) {
        return SHOT;
    }
    let verdict = to_stack(ctx, s, Reason::New);
    if verdict != OK {
        return verdict;
    }
    fwd::bounce(ctx, s.p.ifindex)
}

#[inline(always)]
pub fn pod_egress(ctx: &TcContext) -> i32 {
    let Some(s) = scratch::get() else {
        return OK;
    };
    if let Some(verdict) = parse_or_pass(ctx, s, POD_EGRESS) {
        return verdict;
    }
    match found(s, ct_dir::REPLY, true, ct::NOW_ON_HIT) {
        ct::Found::Hit => {}
        ct::Found::Invalid => return out_of_window(s),
        _ => return OK,
    }
    // A reply to a pod: it comes from the ClusterIP the pod sent to.
    to_stack(ctx, s, Reason::Reply)
}
