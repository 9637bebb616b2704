//! Service lookup and backend choice: the load-balancing decision, independent of the hook
//! that asks for it, so the packet datapath and the test program share it.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns};
use svc_common::{
    backend_index, how, node_addr_flags, scope, svc_flags, AffinityKey, AffinityMatchKey,
    AffinityValue, Backend, BackendId, Reason, ServiceKey, ServiceValue, SlotKey, SockChoice,
    SockState, MAGLEV_BLOCK, MAGLEV_PAGE, NODEPORT_ADDR_V4, NODEPORT_ADDR_V6, PROTO_ANY,
    SOCK_CHOICES,
};

use crate::maps::{
    count, SVC_AFFINITY, SVC_AFFINITY_MATCH, SVC_BACKENDS, SVC_MAGLEV, SVC_MAGLEV_INDEX,
    SVC_NODE_ADDRS, SVC_NODE_ADDR_BITS, SVC_SERVICES, SVC_SLOTS,
};

/// Outcome of a lookup or a choice (`svc_common::Outcome`): the caller's next step, which
/// each caller counts as the `Reason` it stands for there.
///
/// Plain codes with out-parameters rather than `Result<Option<T>, E>`: LLVM merges the
/// payloads of such enums into stores of registers that are undefined on some paths, and the
/// verifier rejects reading them.
pub use svc_common::Outcome;
pub const FOUND: Outcome = Outcome::Found;
pub const NOT_SERVICE: Outcome = Outcome::NotService;

/// The datapath's clock, for affinity and connection-tracking times alike: CLOCK_MONOTONIC_COARSE.
/// Their timeouts are seconds, and the coarse clock is a load of the last tick's time where
/// the fine one reads the clocksource on every packet. A time another CPU stored after this
/// one read the clock can be ahead of it by up to a tick, so ages saturate at 0
/// (`saturating_sub`): a wrapped difference would make a fresh entry look centuries old.
#[inline(always)]
pub fn clock_ns() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// Who asks for a decision, and when. Each is asked for only when the decision needs it, so
/// a connection to a Service without affinity does not pay for identifying its client.
pub trait Caller {
    /// `clock_ns()` of the decision.
    fn now(&self) -> u64;
    /// The socket cookie.
    fn cookie(&self) -> u64;
    /// Who the client is for sessionAffinity: its `AffinityKey` under affinity id `id` (the
    /// Service port's, `ServiceValue::affinity_id`) at a frontend of family `v6`. A socket's
    /// client is its network namespace (a pod is a network namespace, and at connect() its
    /// source address is not chosen yet), once per family; a packet's is its source address,
    /// of one family already.
    fn affinity_client(&self, id: u32, v6: bool) -> AffinityKey;
    /// Whether the socket keeps its backend per frontend: an unconnected UDP send.
    fn sticky(&self) -> bool;
    /// The socket's state (created if need be); null when it cannot be had.
    fn sock_state(&self) -> *mut SockState;
    /// Whether the caller has a flow to hash (`flow_hash`): a frontend's Maglev table
    /// (`svc_flags::MAGLEV`) is used only then.
    #[inline(always)]
    fn hashes_flows(&self) -> bool {
        false
    }
    /// `svc_common::maglev_flow_hash` of the caller's flow under `seed`.
    #[inline(always)]
    fn flow_hash(&self, _seed: u64) -> u32 {
        0
    }
}

/// What a decision answers (valid when the outcome is `FOUND`).
#[derive(Default)]
pub struct Decision {
    pub svc: ServiceValue,
    pub backend_id: BackendId,
    pub backend: Backend,
    /// A `svc_common::how` constant.
    pub how: u32,
    /// 1: the choice is recorded in the socket's state (sock_release finds its reverse
    /// entry there).
    pub recorded: u32,
    /// 1: the socket's previous backend for this frontend had left it.
    pub moved: u32,
}

#[inline(always)]
fn has_flag(svc: &ServiceValue, flag: u16) -> bool {
    svc.flags & flag != 0
}

/// Fills `out` with the frontend `key` names. `NOT_SERVICE`: leave the connection alone.
#[inline(always)]
pub fn lookup(key: &ServiceKey, out: &mut ServiceValue) -> Outcome {
    // SAFETY: the value is copied out at once; the agent may replace it concurrently.
    if let Some(svc) = unsafe { SVC_SERVICES.get(key) } {
        if !has_flag(svc, svc_flags::ADDR_MARKER) {
            *out = *svc;
            return FOUND;
        }
    }
    // Markers exist for ClusterIPs only, which are frontends of the cluster scope: an
    // external lookup that missed costs no second lookup.
    if key.scope != scope::CLUSTER {
        return NOT_SERVICE;
    }
    let marker = ServiceKey {
        addr: key.addr,
        port_be: 0,
        proto: PROTO_ANY,
        scope: key.scope,
    };
    // SAFETY: only the presence of the entry is used.
    if unsafe { SVC_SERVICES.get(marker) }.is_some() {
        return Outcome::NoPort;
    }
    NOT_SERVICE
}

/// Copies backend `id` into `out`; missing unless its entry holds that id (a free entry
/// holds 0, a reused one a later id).
#[inline(always)]
fn backend(id: BackendId, out: &mut Backend) -> Outcome {
    if id == 0 {
        return Outcome::MissingEntry;
    }
    // Copied before the id is checked: the check then holds for what was copied.
    match SVC_BACKENDS.get(backend_index(id, crate::maps::backend_entries())) {
        Some(b) => {
            *out = *b;
            if out.id == id {
                FOUND
            } else {
                *out = Backend::default();
                Outcome::MissingEntry
            }
        }
        None => Outcome::MissingEntry,
    }
}

/// Whether `backend` is still a backend of frontend `id`: a remembered choice is honoured
/// only then. The agent writes the entry before a master entry names the backend and deletes
/// it right after the switch that drops it, so a departed backend is never chosen again (even
/// while it serves another Service), and a reader that raced the switch only chooses anew.
#[inline(always)]
fn is_member(id: u32, backend: BackendId) -> bool {
    SVC_AFFINITY_MATCH
        .get_ptr(AffinityMatchKey { id, backend })
        .is_some()
}

/// How a slot is picked when nothing remembered applies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pick {
    /// Uniformly at random: each connection on its own.
    Random,
    /// From the socket cookie: the same slot for every datagram of a socket that cannot
    /// remember its choice.
    Hashed,
    /// From the frontend's Maglev table, by the flow's hash; at random without a table.
    Maglev,
}

/// `maglev_entry`: the generation has no table the map holds.
const NO_TABLE: u32 = u32::MAX;

/// The 0-based slot the frontend generation's Maglev table gives the caller's flow, or
/// `NO_TABLE`. The agent writes a table into a free region before the index entry that names
/// it, and frees a region only after a grace period, so an entry read here is whole.
#[inline(always)]
fn maglev_entry(svc: &ServiceValue, caller: &impl Caller) -> u32 {
    let key = SlotKey {
        id: svc.id,
        rev: svc.rev,
        slot: 0,
    };
    // SAFETY: the fields are copied out at once; the agent replaces the entry whole.
    let (offset, size, seed) = match unsafe { SVC_MAGLEV_INDEX.get(key) } {
        Some(i) => (
            i.offset,
            i.size,
            i.seed[0] as u64 | (i.seed[1] as u64) << 32,
        ),
        None => return NO_TABLE,
    };
    if size == 0 {
        return NO_TABLE;
    }
    let pos = offset.wrapping_add(caller.flow_hash(seed) % size);
    let block = pos / MAGLEV_BLOCK;
    // SAFETY: one entry is copied out of an element the kernel keeps while this program
    // runs. The agent replaces a page whole, the tables it holds besides the one it writes
    // as they were; where the kernel reuses a freed element at once, the entry read may be
    // another page's (docs/design/maglev.md), which the slot count bounds below.
    match unsafe { SVC_MAGLEV.get(block / MAGLEV_PAGE) } {
        Some(p) => match p.blocks.get(opaque((block % MAGLEV_PAGE) as usize)) {
            Some(b) => b.entries[(pos % MAGLEV_BLOCK) as usize] as u32,
            None => NO_TABLE,
        },
        None => NO_TABLE,
    }
}

/// A 64-bit finalizer (MurmurHash3's): a cookie and a frontend id spread over the slots.
#[inline(always)]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A slot of the frontend's current generation, as a backend id; 0 if the slot is missing
/// (an update raced this lookup).
#[inline(always)]
fn pick_slot(svc: &ServiceValue, pick: Pick, caller: &impl Caller) -> BackendId {
    let mut r = match pick {
        Pick::Random => NO_TABLE,
        Pick::Hashed => mix(caller.cookie() ^ ((svc.id as u64) << 32)) as u32,
        Pick::Maglev => {
            let e = maglev_entry(svc, caller);
            if e == NO_TABLE {
                // A flow is never refused for a missing table: the slots alone answer.
                count(Reason::MaglevMissing, 0);
            }
            e
        }
    };
    if r == NO_TABLE && pick != Pick::Hashed {
        // SAFETY: a helper with no arguments.
        r = unsafe { bpf_get_prandom_u32() };
    }
    let (key, i) = SlotKey::of_slot(svc.id, svc.rev, r % svc.count as u32);
    // SAFETY: copied out at once.
    match unsafe { SVC_SLOTS.get(key) } {
        Some(g) => g.backends[i],
        None => 0,
    }
}

/// The affinity key of a socket's client: its network namespace cookie, and the family of
/// the frontend (`v6`). One choice per family, as kube-proxy runs one proxier per family:
/// the IPv4 and IPv6 ClusterIPs of a Service port have no backend in common, so a choice
/// shared by both would be replaced whenever the pod changed family.
#[inline(always)]
pub fn netns_client(netns_cookie: u64, affinity_id: u32, v6: bool) -> AffinityKey {
    let mut client = [0u8; 16];
    client[0..8].copy_from_slice(&netns_cookie.to_ne_bytes());
    client[8] = v6 as u8;
    AffinityKey {
        client,
        affinity_id,
        kind: svc_common::AFFINITY_CLIENT_NETNS,
        _pad0: [0; 3],
    }
}

/// The affinity key of a packet's client: its source address.
#[inline(always)]
pub fn ip_client(addr: &[u8; 16], affinity_id: u32) -> AffinityKey {
    AffinityKey {
        client: *addr,
        affinity_id,
        kind: svc_common::AFFINITY_CLIENT_IP,
        _pad0: [0; 3],
    }
}

/// Picks a backend for `svc` into `out`: the client's remembered one (sessionAffinity) while
/// it is fresh and still a backend of the frontend, else a slot as `pick` says.
///
/// The choice is remembered per Service port and family (`affinity_id`, shared by all its
/// frontends, as kube-proxy's affinity sits behind the Service port's chain, one per
/// family's proxier; `key`'s address gives the family), but checked per frontend
/// (`svc.id`): a backend remembered at the ClusterIP that this frontend does not have
/// (externalTrafficPolicy Local) is not used, and the one chosen here replaces it, as
/// kube-proxy's local-endpoints chain records the endpoint it picks.
#[inline(always)]
fn choose(
    key: &ServiceKey,
    svc: &ServiceValue,
    caller: &impl Caller,
    pick: Pick,
    out: &mut Decision,
) -> Outcome {
    if svc.count == 0 {
        return Outcome::NoBackend;
    }
    let pick = if pick == Pick::Random && has_flag(svc, svc_flags::MAGLEV) && caller.hashes_flows()
    {
        Pick::Maglev
    } else {
        pick
    };
    out.how = match pick {
        Pick::Random => how::RANDOM,
        Pick::Hashed => how::HASHED,
        Pick::Maglev => how::MAGLEV,
    };
    if !has_flag(svc, svc_flags::AFFINITY) {
        let id = pick_slot(svc, pick, caller);
        out.backend_id = id;
        return backend(id, &mut out.backend);
    }

    let v6 = !svc_common::is_v4_mapped(&key.addr);
    let client = &caller.affinity_client(svc.affinity_id, v6);
    let now = caller.now();
    let timeout_ns = svc.affinity_timeout_s as u64 * 1_000_000_000;
    if let Some(prev) = SVC_AFFINITY.get_ptr_mut(client) {
        // SAFETY: a map value; the fields are read once each (the agent never writes them).
        let (last_used_ns, prev_backend) = unsafe { ((*prev).last_used_ns, (*prev).backend) };
        if now.saturating_sub(last_used_ns) <= timeout_ns
            && is_member(svc.id, prev_backend)
            && backend(prev_backend, &mut out.backend) == FOUND
        {
            // In place, never re-inserted: an entry deleted meanwhile (LRU) stays deleted
            // instead of coming back with a backend that may have left.
            // SAFETY: as above; a concurrent writer can only store another time.
            unsafe { (*prev).last_used_ns = now };
            count(Reason::AffinityHit, 0);
            out.backend_id = prev_backend;
            out.how = how::AFFINITY;
            return FOUND;
        }
        count(Reason::AffinityStale, 0);
    }
    let id = pick_slot(svc, pick, caller);
    let outcome = backend(id, &mut out.backend);
    if outcome == FOUND {
        let value = AffinityValue {
            last_used_ns: now,
            backend: id,
            _pad0: 0,
        };
        // A lost update only costs stickiness, never the connection.
        let _ = SVC_AFFINITY.insert(client, value, 0);
    }
    out.backend_id = id;
    outcome
}

/// The frontend, then a backend, reading the frontend again once if an update raced the
/// first try.
#[inline(always)]
fn choose_with_retry(
    key: &ServiceKey,
    svc: &mut ServiceValue,
    caller: &impl Caller,
    pick: Pick,
    out: &mut Decision,
) -> Outcome {
    let outcome = choose(key, svc, caller, pick, out);
    if outcome != Outcome::MissingEntry {
        return outcome;
    }
    // The agent switched this frontend to a new generation between our two lookups (it
    // retires the old one only after a grace period, so this is rare): read it again once.
    count(Reason::RetriedMissingEntry, 0);
    match lookup(key, svc) {
        FOUND => {
            out.svc = *svc;
            choose(key, svc, caller, pick, out)
        }
        other => other,
    }
}

/// `i`, hidden from the optimizer: LLVM proves the index in range from the loop that found it
/// and drops the bounds check, in a form the verifier cannot follow; a value it cannot see
/// through keeps the check next to the access.
#[inline(always)]
fn opaque(i: usize) -> usize {
    // SAFETY: reads a local.
    unsafe { core::ptr::read_volatile(&i) }
}

/// The whole decision for a connect() or sendmsg() to `key`.
///
/// An unconnected UDP socket (`caller.sticky()`) keeps the backend it chose for a frontend
/// for as long as that backend stays a backend of the frontend, as conntrack keeps a 5-tuple
/// on one backend: every datagram of one socket reaches one backend. The choice is made once
/// per socket and frontend, honouring sessionAffinity (so a pod's new sockets land on its
/// remembered backend); a socket that already uses a backend keeps it even when the client's
/// affinity later points elsewhere (kube-proxy too applies affinity to new flows only), and
/// its datagrams do not refresh the affinity entry. A socket that sends to more frontends than
/// it can remember, or whose state cannot be created, takes its slot from its cookie.
#[inline(always)]
#[allow(
    dead_code,
    reason = "the test object decides by key; the programs resolve first"
)]
pub fn decide(key: &ServiceKey, caller: &impl Caller, out: &mut Decision) -> Outcome {
    let mut svc = ServiceValue::default();
    match lookup(key, &mut svc) {
        FOUND => {}
        other => return other,
    }
    decide_with(key, svc, caller, out)
}

/// The flags `NODE_ADDRS` has for `addr`; 0 when it is not an address there, or its bit in
/// the filter in front (`SVC_NODE_ADDR_BITS`) is clear.
#[inline(always)]
pub fn node_addr_flags(addr: &[u8; 16]) -> u32 {
    let bit = svc_common::node_addr_bit(addr);
    match SVC_NODE_ADDR_BITS.get(bit / 64) {
        Some(word) if *word & (1 << (bit % 64)) != 0 => {}
        _ => return 0,
    }
    // SAFETY: copied out at once.
    match unsafe { SVC_NODE_ADDRS.get(addr) } {
        Some(v) => v.flags,
        None => 0,
    }
}

/// The NodePort frontend `key` reaches when its address is a node address that answers
/// NodePorts (`node_flags`, from `Via::node_flags`): the same port and protocol under the
/// family's wildcard address. `false`: it is no NodePort address.
#[inline(always)]
fn nodeport_key(key: &mut ServiceKey, node_flags: u32) -> bool {
    if node_flags & node_addr_flags::NODEPORT == 0 {
        return false;
    }
    key.addr = if svc_common::is_v4_mapped(&key.addr) {
        NODEPORT_ADDR_V4
    } else {
        NODEPORT_ADDR_V6
    };
    true
}

/// What differs between the callers of `resolve` (the socket hooks, the pod ingress, the
/// external ingress): whether the key's own frontend is looked up, and which destination
/// addresses answer NodePorts.
pub trait Via {
    /// Whether a frontend may be under the key's own address.
    fn own_key(&self) -> bool;
    /// The `NODE_ADDRS` flags that say whether `addr` answers NodePorts for this caller.
    fn node_flags(&self, addr: &[u8; 16]) -> u32;
}

/// Per-packet ClusterIP on pod devices: the key's own frontend, else the NodePort of a node
/// address.
pub struct PodIngress;

impl Via for PodIngress {
    #[inline(always)]
    fn own_key(&self) -> bool {
        true
    }

    #[inline(always)]
    fn node_flags(&self, addr: &[u8; 16]) -> u32 {
        node_addr_flags(addr)
    }
}

/// The external ingress, which read the destination's `NODE_ADDRS` flags (`node`) before any
/// other lookup. Only an `EXTERNAL` address has frontends of its own key (the agent marks it
/// before it writes them): a node address without one is looked up as a NodePort alone, one
/// hash lookup less for each new NodePort flow.
pub struct ExtIngress {
    pub node: u32,
}

impl Via for ExtIngress {
    #[inline(always)]
    fn own_key(&self) -> bool {
        self.node & node_addr_flags::EXTERNAL != 0
    }

    #[inline(always)]
    fn node_flags(&self, _: &[u8; 16]) -> u32 {
        self.node
    }
}

/// The frontend `key` names: its own (where `via` allows one), else the NodePort wildcard of
/// its port when its address answers NodePorts for `via`; `key` becomes the key that was
/// found.
#[inline(always)]
pub fn resolve(key: &mut ServiceKey, out: &mut ServiceValue, via: &impl Via) -> Outcome {
    if via.own_key() {
        let outcome = lookup(key, out);
        if outcome != NOT_SERVICE {
            return outcome;
        }
    }
    if !nodeport_key(key, via.node_flags(&key.addr)) {
        return NOT_SERVICE;
    }
    lookup(key, out)
}

/// `decide` for a frontend its caller has looked up already (`key` names `svc`, and is read
/// again if an update races the choice).
#[inline(always)]
pub fn decide_with(
    key: &ServiceKey,
    svc: ServiceValue,
    caller: &impl Caller,
    out: &mut Decision,
) -> Outcome {
    let mut svc = svc;
    out.svc = svc;
    if svc.count == 0 {
        return Outcome::NoBackend;
    }
    if !caller.sticky() {
        return choose_with_retry(key, &mut svc, caller, Pick::Random, out);
    }

    let state = caller.sock_state();
    // Indexes into the state's choices (SOCK_CHOICES: none), not pointers: the verifier loses
    // track of a pointer that may be null by way of a loop.
    let mut slot = SOCK_CHOICES;
    let mut moved = false;
    if !state.is_null() {
        let mut free = SOCK_CHOICES;
        for i in 0..SOCK_CHOICES {
            // SAFETY: a socket storage value, owned by this socket; a concurrent sender on
            // the same socket can at worst make it choose again (a choice is checked against
            // the membership map before use).
            let id = unsafe { (*state).choices[i].id };
            if id == svc.id && slot == SOCK_CHOICES {
                slot = i;
            } else if id == 0 && free == SOCK_CHOICES {
                free = i;
            }
        }
        // SAFETY: as above.
        if let Some(c) = unsafe { (*state).choices.get(opaque(slot)) } {
            let c = *c;
            if is_member(svc.id, c.backend) {
                out.backend_id = c.backend;
                out.backend = Backend {
                    addr: c.addr,
                    port_be: c.port_be,
                    proto: key.proto,
                    flags: 0,
                    id: c.backend,
                };
                out.how = how::STICKY;
                out.recorded = 1;
                count(Reason::SockSticky, 0);
                return FOUND;
            }
            moved = true;
        } else {
            slot = free;
        }
    }
    let pick = if slot == SOCK_CHOICES {
        count(Reason::SockHashed, 0);
        Pick::Hashed
    } else {
        Pick::Random
    };
    let outcome = choose_with_retry(key, &mut svc, caller, pick, out);
    if outcome != FOUND || state.is_null() {
        return outcome;
    }
    // SAFETY: as above.
    if let Some(c) = unsafe { (*state).choices.get_mut(opaque(slot)) } {
        *c = SockChoice {
            id: out.svc.id,
            backend: out.backend_id,
            addr: out.backend.addr,
            port_be: out.backend.port_be,
            _pad0: 0,
        };
        out.recorded = 1;
        if moved {
            out.moved = 1;
            count(Reason::SockMoved, 0);
        }
    }
    outcome
}
