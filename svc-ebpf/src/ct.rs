//! Connection tracking of the packet datapath: two entries per flow, one per direction (see
//! svc-common's `CtKey`/`CtValue`), in one of two tables: `SVC_CT_NEW` (an LRU) while the
//! flow is unassured (`ct_flags::UNASSURED`), `SVC_CT` (a hash nothing evicts) once it is
//! assured (`assure` moves both entries). Each direction's packets find their own entry with
//! one lookup of their own tuple in `SVC_CT` (`find`; a second in `SVC_CT_NEW` for a
//! handshake's packets and misses), and carry its translation. A key is in one table at most:
//! a new flow's store removes what the assured table holds at its keys (`store`, `create`).
//!
//! So a flood of new flows (spoofed SYNs) evicts only unassured flows, never an idle
//! established connection, as conntrack drops unassured entries first and never an assured
//! one for a new flow.
//!
//! An entry older than its timeout is treated as absent, unless its partner (the other
//! direction's entry, while it is still this flow's) is fresh: a flow whose packets go one
//! way only (a UDP stream, a long download's ACK-less tail) stays alive as long as either
//! direction speaks.
//!
//! A closed TCP flow (an RST, or a FIN each way: `ct_flags::closed`) keeps its entries for
//! the closing timeout, but gives them up to a new connection on its tuples, as conntrack does
//! for a SYN in TIME_WAIT or CLOSE: a SYN that meets them (`lookup`, `syn_on_reply_tuple`), the
//! answer to a SYN through the node leaving by the external egress (`ANSWER`), a new flow whose
//! reply tuple they hold (`create`), and a SNAT port search (`create_snat`).

use core::intrinsics::{atomic_and, atomic_or, AtomicOrdering};

use aya_ebpf::{
    bindings::BPF_NOEXIST, btf_maps::HashMap, helpers::bpf_get_prandom_u32, macros::btf_map,
};
use svc_common::{
    ct_dir, ct_flags, ct_timeout, CtKey, CtValue, DatapathConfig, Reason, IPPROTO_TCP,
};

use crate::{
    maps::{count, SVC_CONFIG, SVC_CT, SVC_CT_NEW},
    nat::Endpoint,
    pkt::{Pkt, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    scratch::Flow,
};

const SEC: u64 = 1_000_000_000;

/// Keys claimed for a check of the entry there followed by its removal or replacement: the
/// REPLY keys of SNAT ports being reclaimed from a dead or closed flow (`reclaim`), dead
/// entries the sweep removes (gc.rs), and entries a new flow is stored over (`store`). A
/// claim is stored with BPF_NOEXIST, so of two holders at one key one goes on and the other
/// gives the key up (another port, the next sweep, a failed new flow). Without it the sweep,
/// having found an entry dead, could remove a new flow a CPU stored over it a moment later.
/// Held from before the check until the removal or the store, by a program run each: a few
/// per CPU at most (the sweep's, and a packet's in a softirq on the same CPU). Not pinned: a
/// claim never outlives the program's run. Its room is far beyond that; a claim that finds it
/// full gives the key up. A claim whose removal fails (a nested program holding the map's
/// bucket lock) would stay and hold its key until the programs are replaced; none is known
/// to.
#[btf_map]
static SVC_CT_CLAIMS: HashMap<CtKey, u32, 4096> = HashMap::new();

/// Claims `key` (`SVC_CT_CLAIMS`); false when another CPU holds it.
#[inline(always)]
pub fn claim(key: &CtKey) -> bool {
    SVC_CT_CLAIMS.insert(key, 0, BPF_NOEXIST as u64).is_ok()
}

#[inline(always)]
pub fn unclaim(key: &CtKey) {
    let _ = SVC_CT_CLAIMS.remove(key);
}

/// The entry at `key`, in whichever table holds it: the assured one first, which holds
/// nearly every packet's.
#[inline(always)]
pub fn find(key: &CtKey) -> Option<*mut CtValue> {
    match SVC_CT.get_ptr_mut(key) {
        Some(e) => Some(e),
        None => SVC_CT_NEW.get_ptr_mut(key),
    }
}

/// Removes the entry at `key` from whichever table holds it.
#[inline(always)]
fn remove(key: &CtKey) {
    if SVC_CT.remove(key).is_err() {
        let _ = SVC_CT_NEW.remove(key);
    }
}

/// Stores the new (unassured) flow's entry `v` at `key` in `SVC_CT_NEW`: at once when the key
/// is free, else over the entry there under a claim, as the sweep removes a dead entry under
/// one. An entry at the key in the assured table (the other path's, or a dead one: `lookup`
/// missed it) goes under the same claim, as it would have been stored over. False when the
/// store failed or the key is claimed right now: the caller fails the new flow, counted as
/// `err_ct_update` (a TCP client sends its SYN again a second later).
#[inline(always)]
fn store(key: &CtKey, v: &CtValue) -> bool {
    if SVC_CT.get_ptr(key).is_none() && SVC_CT_NEW.insert(key, v, BPF_NOEXIST as u64).is_ok() {
        return true;
    }
    if !claim(key) {
        return false;
    }
    let _ = SVC_CT.remove(key);
    let stored = SVC_CT_NEW.insert(key, v, 0).is_ok();
    unclaim(key);
    stored
}

/// How many ports a new SNATed flow tries before it is dropped as exhausted. Each try is a
/// random port of the range; with a range a few thousand wide, 32 failures in a row means it
/// is nearly full of open flows for that backend.
pub const SNAT_TRIES: u32 = 32;

/// The first tries take only a free port (or a dead flow's); from then on a closed flow's
/// port is taken too (its entries removed). A range held by closed flows (a high rate of short
/// connections to one backend) then costs at most 5 tries per new flow, not 32 and a drop; a
/// free port is preferred while one is found within 4 tries, so a closed flow's tuple, which
/// the backend may still hold in TIME_WAIT, is reused only when the range is busy. A flow
/// closed by an RST waits the same: an RST within the window may still be a stale one, and
/// a flow carried over untracked (`ct_flags::TRACKED` unset) takes any RST. An unassured
/// flow's port (`ct_flags::UNASSURED`: a SYN whose client never acknowledged the SYN-ACK,
/// such as a spoofed one) is taken from the fifth try on too, as conntrack drops unassured
/// entries first.
///
/// While the range is busy (this CPU's last search took a closed flow's port, or found
/// none: `Scratch::snat_busy`), a search takes a closed flow's port from its first try: the
/// free tries would in all likelihood find none, and each is a cache miss (a third of the
/// external ingress's time per new remote TCP connection went to the search in a loop of
/// short connections). A stale RST is then as exposed as it is to the fifth try of a search
/// in a busy range anyway. A free port drawn ends the busy spell.
pub const SNAT_FREE_TRIES: u32 = 4;

/// A last-seen time is refreshed at most this often: a write per packet would make every
/// CPU that serves a flow fight over its entry's cache line.
const REFRESH_NS: u64 = SEC;

/// A setting of the agent's (`DatapathConfig`), 0 when it wrote none. Read field by field
/// from the map value: a copy of the whole entry would sit on the stack.
#[inline(always)]
fn setting(f: fn(&DatapathConfig) -> u32) -> u32 {
    match SVC_CONFIG.get(0) {
        Some(c) => f(c),
        None => 0,
    }
}

#[inline(always)]
fn secs(v: u32, default: u32) -> u64 {
    (if v == 0 { default } else { v }) as u64 * SEC
}

/// How long an entry with `flags` of protocol `proto` lives without a packet.
#[inline(always)]
pub fn timeout_ns(proto: u8, flags: u16) -> u64 {
    let k = ct_timeout::of(proto, flags);
    // Read in place from the map value, as `setting` does: a copy would sit on the stack.
    let v = match SVC_CONFIG.get(0) {
        Some(c) => k.setting(c),
        None => 0,
    };
    secs(v, k.default_s())
}

/// SNAT port range (host order), inclusive.
#[inline(always)]
pub fn snat_range() -> (u16, u16) {
    let min = setting(|c| c.snat_port_min as u32) as u16;
    let max = setting(|c| c.snat_port_max as u32) as u16;
    svc_common::snat_range_of(min, max)
}

/// The key of the packet's own tuple in direction `dir`.
#[inline(always)]
pub fn key_of(p: &Pkt, dir: u8) -> CtKey {
    CtKey {
        saddr: p.saddr,
        daddr: p.daddr,
        sport_be: p.sport_be,
        dport_be: p.dport_be,
        proto: p.proto,
        dir,
        _pad0: [0; 2],
    }
}

/// The key of the other direction's entry of the flow `key`/`v` belongs to.
#[inline(always)]
pub fn partner_key(key: &CtKey, v: &CtValue) -> CtKey {
    key.partner(v)
}

/// What a packet brings to its flow in `lookup`: the `ct_flags` it adds (the low 16 bits, the
/// only ones stored), and marks above them that steer `lookup` and are never stored (`SYN`,
/// `ACKS`, `ANSWER`, `OUT_OF_WINDOW`). A type of its own, so neither a `ct_flags` set nor a
/// `Found` passes for it.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PacketFlags(u32);

impl PacketFlags {
    pub const NONE: Self = Self(0);

    #[inline(always)]
    fn of(flags: u16) -> Self {
        Self(flags as u32)
    }

    #[inline(always)]
    fn has(self, mark: Self) -> bool {
        self.0 & mark.0 != 0
    }

    #[inline(always)]
    fn without(self, marks: Self) -> Self {
        Self(self.0 & !marks.0)
    }

    /// The `ct_flags` it adds.
    #[inline(always)]
    fn stored(self) -> u16 {
        self.0 as u16
    }
}

impl core::ops::BitOr for PacketFlags {
    type Output = Self;

    #[inline(always)]
    fn bitor(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

/// `packet_flags`' mark of a TCP SYN without ACK (a connection's first segment); above the
/// 16 bits of `CtValue::flags`, never stored.
pub const SYN: PacketFlags = PacketFlags(1 << 30);

/// `packet_flags`' mark of a TCP segment that acknowledges (ACK without SYN or RST): from the
/// client, after the backend's SYN-ACK, it completes the handshake (`ct_flags::UNASSURED`
/// cleared). Never stored.
pub const ACKS: PacketFlags = PacketFlags(1 << 28);

/// The flags a packet adds to its flow: SEEN_REPLY for a reply, FIN (and its direction's
/// FIN_FORWARD or FIN_REPLY) and RST as TCP says; plus `SYN` for a SYN without ACK.
#[inline(always)]
pub fn packet_flags(p: &Pkt, dir: u8) -> PacketFlags {
    let mut f: u16 = 0;
    if dir == ct_dir::REPLY {
        f |= ct_flags::SEEN_REPLY;
    }
    if p.proto != IPPROTO_TCP {
        return PacketFlags::of(f);
    }
    if p.tcp_flags & TCP_FIN != 0 {
        f |= ct_flags::FIN;
        f |= if dir == ct_dir::REPLY {
            ct_flags::FIN_REPLY
        } else {
            ct_flags::FIN_FORWARD
        };
    }
    if p.tcp_flags & TCP_RST != 0 {
        f |= ct_flags::RST;
    }
    if p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        return PacketFlags::of(f) | SYN;
    }
    if p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_ACK {
        return PacketFlags::of(f) | ACKS;
    }
    PacketFlags::of(f)
}

/// Whether a TCP segment's flags are a combination TCP sends (conntrack's `tcp_valid_flags`,
/// PSH, URG, ECE and CWR aside): SYN, SYN-ACK, RST, RST-ACK, FIN-ACK, ACK. Anything else
/// (SYN+FIN, SYN+RST, FIN without ACK, no flag at all, ...) is a probe or an attack, and
/// creates or changes no state.
#[inline(always)]
pub fn valid_tcp_flags(flags: u8) -> bool {
    let f = flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK);
    f == TCP_SYN
        || f == TCP_SYN | TCP_ACK
        || f == TCP_RST
        || f == TCP_RST | TCP_ACK
        || f == TCP_FIN | TCP_ACK
        || f == TCP_ACK
}

/// `track`'s mark in `add`: the segment is `Found::Invalid`. Never stored.
const OUT_OF_WINDOW: PacketFlags = PacketFlags(1 << 27);

/// What of `add` a segment records in its flow: its flags, and the handshake's completion.
const RECORDED: PacketFlags = PacketFlags(0xffff | ACKS.0);

/// How far behind the highest sequence number seen from its sender an RST or a FIN may lie
/// and be taken, and how far below what the backend sent the ACK that completes the
/// handshake may acknowledge: a legitimate one lies at it (a sender's RST carries its next
/// sequence number; one answering a segment carries what that segment acknowledged). A
/// blind guess lands within it once in 65,536.
const BEHIND: u32 = 1 << 16;

/// How far ahead of the highest sequence number seen from its sender a segment may start and
/// still move it (data lost or reordered before this node leaves such a gap), and an RST go
/// on without closing anything. A blind guess moves it once in 4,096, and by at most this
/// much plus its length (a FIN is taken only within `BEHIND` either way).
const AHEAD: u32 = 1 << 20;

/// Whether `x` lies in `lo..=lo + span`, sequence numbers wrapping.
#[inline(always)]
fn within(x: u32, lo: u32, span: u32) -> bool {
    x.wrapping_sub(lo) <= span
}

/// Whether sequence number `a` comes after `b`, wrapping.
#[inline(always)]
fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The sequence number the partner of entry `key`/`v` records (`CtValue::seq_end`), if the
/// partner is still this flow's.
#[inline(always)]
fn partner_seq_end(key: &CtKey, v: &CtValue) -> Option<u32> {
    let found = partner_seq_end_of(key, v);
    (found & PARTNER_FOUND != 0).then_some(found as u32)
}

/// `partner_seq_end`'s answer, as a plain u64 (`PARTNER_FOUND` set when found): an `Option`
/// returned from a subprogram leaves its unused half undefined, which the compiler may fill
/// with a stack pointer the verifier refuses to see returned. A function of its own: its keys
/// would grow `track`'s frame, on the external ingress's deepest chain.
#[inline(never)]
fn partner_seq_end_of(key: &CtKey, v: &CtValue) -> u64 {
    let pk = partner_key(key, v);
    let Some(pe) = find(&pk) else {
        return 0;
    };
    // SAFETY: a map value, read in place.
    unsafe {
        if partner_key(&pk, &*pe) == *key {
            PARTNER_FOUND | (*pe).seq_end as u64
        } else {
            0
        }
    }
}

const PARTNER_FOUND: u64 = 1 << 32;

/// Checks a TCP segment of a tracked flow (`ct_flags::TRACKED`) against where its sender is,
/// records where it got to, and returns `add` as the segment may change the flow:
/// `OUT_OF_WINDOW` (dropped, nothing recorded) for a SYN-ACK that does not acknowledge the
/// client's SYN, and for an RST outside the window once the flow is assured; the segment
/// passed with nothing recorded for such an RST while the flow is unassured (see `ignored`),
/// for an RST ahead of the window or of a closed flow, for a FIN outside it, and for a first
/// reply without SYN that does not acknowledge the client's SYN; without `ACKS` for a
/// handshake's last ACK that does not acknowledge the backend's SYN-ACK. Each entry
/// tracks its own direction's sender only, so a segment costs no lookup of the other entry
/// but twice per flow (the first reply, the ACK that completes the handshake). Conntrack
/// also bounds each side by the other's window and acknowledgments; this check is narrower
/// and cheaper: a blind guess lands once in 65,536 tries, and a forged segment can move the
/// recorded position by at most `AHEAD` once in 4,096.
///
/// The segment's numbers are read from the scratch space, whose packet every caller of
/// `lookup` made its key from (an ICMP error's quoted flow is looked up by `peek`).
#[inline(never)]
fn track(key: &CtKey, e: *mut CtValue, out: &mut CtValue, add: PacketFlags) -> PacketFlags {
    let Some(s) = crate::scratch::get() else {
        return add;
    };
    let (flags, seq, ack, len) = (s.p.tcp_flags, s.p.seq(), s.p.ack(), s.p.seq_len());
    let forward = key.dir == ct_dir::FORWARD;
    let end = seq.wrapping_add(len);
    let mut add = add;
    // Out of its window, a segment of an unassured flow still goes on, recording nothing:
    // the endpoints judge it. A backend may hold a half-open connection on a reclaimed SNAT
    // port's tuple (a spoofed SYN's), which it answers with an ACK for the old sequence; the
    // client's RST to that ACK is what clears it, and the client's next SYN connects.
    let passed = add.without(RECORDED);
    let ignored = if out.flags & ct_flags::UNASSURED != 0 {
        passed
    } else {
        add | OUT_OF_WINDOW
    };
    if !forward && out.flags & ct_flags::SEEN_REPLY == 0 {
        // The first reply: the backend's SYN-ACK, or its RST refusing the SYN. It must
        // acknowledge the client's SYN, as conntrack checks in SYN_SENT (the SYN alone, or
        // with the data a TCP Fast Open SYN carried). A SYN-ACK that does not is dropped:
        // forwarded, it would leave the flow unanswered for good.
        let acks_syn = flags & TCP_ACK != 0
            && match partner_seq_end(key, out) {
                Some(syn_end) => within(ack, syn_end.wrapping_sub(BEHIND), BEHIND),
                None => false,
            };
        if !acks_syn {
            if flags & TCP_SYN != 0 {
                return add | OUT_OF_WINDOW;
            }
            return ignored;
        }
        out.seq_end = end;
        // SAFETY: a map value; only this direction's packets write its position.
        unsafe { (*e).seq_end = end };
        return add;
    }
    let at = out.seq_end;
    if flags & TCP_RST != 0 && !within(seq, at.wrapping_sub(BEHIND), BEHIND) {
        // Ahead of what its sender was seen to send (data lost or reordered before this
        // node), or of a flow already closed: the endpoints judge it, it closes nothing here.
        if ct_flags::closed(out.flags) || within(seq, at, AHEAD) {
            return passed;
        }
        return ignored;
    }
    // By where the segment starts, as the RST: a FIN carrying data (a BIG TCP segment may
    // carry more than `BEHIND`) ends far ahead of where its sender was.
    if flags & TCP_FIN != 0 && !within(seq, at.wrapping_sub(BEHIND), 2 * BEHIND) {
        // Forwarded, as the endpoints judge it themselves, but it changes nothing here (nor
        // completes a handshake: a spoofed flow's forged FIN-ACK must not assure it).
        return passed;
    }
    if add.has(ACKS)
        && forward
        && out.flags & (ct_flags::UNASSURED | ct_flags::SEEN_REPLY)
            == ct_flags::UNASSURED | ct_flags::SEEN_REPLY
    {
        let acked = match partner_seq_end(key, out) {
            Some(rep_end) => within(ack, rep_end.wrapping_sub(BEHIND), BEHIND),
            None => false,
        };
        if !acked {
            add = add.without(ACKS);
        }
    }
    // A SYN before any reply with a new initial sequence number (a client that retried its
    // connect) starts over, as conntrack re-reads it in SYN_SENT; a retransmitted one (a TCP
    // Fast Open SYN again without its data) does not move the recorded position back.
    let resync = forward
        && flags & (TCP_SYN | TCP_ACK) == TCP_SYN
        && out.flags & ct_flags::SEEN_REPLY == 0
        && !within(seq, at.wrapping_sub(BEHIND), BEHIND);
    if resync || after(end, at) && within(seq, at.wrapping_sub(BEHIND), BEHIND + AHEAD) {
        out.seq_end = end;
        // SAFETY: as above.
        unsafe { (*e).seq_end = end };
    }
    add
}

/// Where `flags` lies in the 64-bit word of a `CtValue` at `FLAGS_WORD` (little-endian BPF).
const FLAGS_WORD: usize = core::mem::offset_of!(CtValue, nat_port_be);
const FLAGS_SHIFT: u32 = ((core::mem::offset_of!(CtValue, flags) - FLAGS_WORD) * 8) as u32;
const _: () = assert!(FLAGS_WORD.is_multiple_of(8) && FLAGS_SHIFT + 16 <= 64);

/// The aligned 64-bit word of entry `e` that holds `flags` (with the ports and `handing_s`):
/// flags change by atomic operations on it, so two CPUs that add or clear flags at once (a
/// FIN each way, a handshake's ACK beside a reply's flag) never lose one's change, as two
/// read-modify-writes of the copy would. 64 bits: the BPF target's generic CPU has atomic
/// AND and OR of 64-bit words only. The masks leave the other fields as they are.
///
/// # Safety
/// `e` is a map value pointer (map values are 8-byte aligned).
#[inline(always)]
unsafe fn flags_word(e: *mut CtValue) -> *mut u64 {
    // SAFETY: aligned (checked above), within the value.
    unsafe { e.cast::<u8>().add(FLAGS_WORD).cast() }
}

/// ORs `add` into the flags of entry `e`, atomically (`flags_word`).
///
/// # Safety
/// As `flags_word`.
#[inline(always)]
unsafe fn add_flags(e: *mut CtValue, add: u16) {
    // SAFETY: the caller's; the result unused, a BPF atomic OR without fetch.
    unsafe {
        atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(
            flags_word(e),
            (add as u64) << FLAGS_SHIFT,
        )
    };
}

/// Clears `clear` of the flags of entry `e`, atomically (`flags_word`).
///
/// # Safety
/// As `flags_word`.
#[inline(always)]
unsafe fn clear_flags(e: *mut CtValue, clear: u16) {
    // SAFETY: as `add_flags`.
    unsafe {
        atomic_and::<u64, u64, { AtomicOrdering::Relaxed }>(
            flags_word(e),
            !((clear as u64) << FLAGS_SHIFT),
        )
    };
}

/// `bpf_map_update_elem`'s answer when BPF_NOEXIST finds the key taken.
const EEXIST: i32 = -17;

/// Assures the flow of entry `key` (`e`, copied in `out`): clears `ct_flags::UNASSURED` on it
/// and on its partner (while that is still this flow's), then moves both to the assured
/// table: the client acknowledged the backend's SYN-ACK, or (UDP, ICMP echo) spoke again after
/// a reply. Once per flow, so lookups of its own; `e` may be gone after it (`lookup` finds
/// the entry again).
///
/// Each entry is copied into `SVC_CT` (BPF_NOEXIST: one there already stays, a taken-over
/// flow's or another CPU's move) before it is removed from `SVC_CT_NEW`, so another CPU's
/// packet of the flow finds one or the other throughout; what such a packet records in the
/// old copy between the two (a refresh, a flag, a sequence position) is lost, as if it came
/// a moment earlier. When the assured table is full the flow stays where it is, assured, and
/// is counted (`Reason::CtAssuredFull`, under the device the flow came in on): a flood of new
/// flows may evict it there, as it may evict any flow of a full LRU table. A flow whose partner is gone (evicted mid-handshake)
/// is not moved: the LRU takes the rest of it. 1 when an entry moved (`e` may be gone). (A
/// value the caller uses: the verifier refuses a subprogram that leaves a stack pointer in R0,
/// which the compiler may do in one whose result is unused.)
#[inline(never)]
fn assure(key: &CtKey, e: *mut CtValue, out: &mut CtValue) -> u32 {
    out.flags &= !ct_flags::UNASSURED;
    // SAFETY: a map value.
    unsafe { clear_flags(e, ct_flags::UNASSURED) };
    let pk = partner_key(key, out);
    let Some(pe) = find(&pk) else {
        return 0;
    };
    // SAFETY: map values; inserts read them in place (a reference, not a copy on the stack,
    // which clippy's suggestion would make: 64 bytes on the lookup's chain).
    #[allow(clippy::needless_borrows_for_generic_args)]
    unsafe {
        if partner_key(&pk, &*pe) != *key {
            return 0;
        }
        clear_flags(pe, ct_flags::UNASSURED);
        let partner_moved = match SVC_CT.insert(pk, &*pe, BPF_NOEXIST as u64) {
            Ok(()) => true,
            Err(EEXIST) => false,
            Err(_) => {
                count(Reason::CtAssuredFull, out.ifindex);
                return 0;
            }
        };
        let moved = match SVC_CT.insert(key, &*e, BPF_NOEXIST as u64) {
            Ok(()) => true,
            Err(EEXIST) => false,
            Err(_) => {
                if partner_moved {
                    let _ = SVC_CT.remove(pk);
                }
                count(Reason::CtAssuredFull, out.ifindex);
                return 0;
            }
        };
        if partner_moved {
            let _ = SVC_CT_NEW.remove(pk);
        }
        if moved {
            let _ = SVC_CT_NEW.remove(key);
        }
        (partner_moved || moved) as u32
    }
}

/// Removes the entries of the flow of `key`/`v`: its partner if it is still this flow's (a
/// partner key may already belong to a newer flow), then `key`'s.
#[inline(always)]
fn forget(key: &CtKey, v: &CtValue) {
    forget_partner(key, v);
    remove(key);
}

/// Removes the entry at the partner key of `key`/`v` if it is still this flow's.
#[inline(always)]
fn forget_partner(key: &CtKey, v: &CtValue) {
    let pk = partner_key(key, v);
    if let Some(pe) = find(&pk) {
        // SAFETY: a map value, read in place.
        if partner_key(&pk, unsafe { &*pe }) == *key {
            remove(&pk);
        }
    }
}

/// Claims the port of the REPLY entry `key`, read as `seen` a moment ago by a dead or closed
/// flow: removes that flow's entries and stores `rep` in its place. Nothing is done if
/// another CPU is reclaiming the port (its claim in `SVC_CT_CLAIMS`), or if the entry is no
/// longer `seen` (another CPU reclaimed the port since it was read, and its new flow must
/// stay). The claim is held from before the check until `rep` is stored, so no other
/// reclaim of the port runs between them; a CPU that finds the port free (the old entry
/// removed) and stores its own flow first makes this store, a BPF_NOEXIST one, fail. True
/// when `rep` was stored.
#[inline(always)]
fn reclaim(key: &CtKey, seen: &CtValue, rep: &CtValue) -> bool {
    if !claim(key) {
        return false;
    }
    let stored = match find(key) {
        // SAFETY: a map value, compared in place.
        Some(e) if unsafe { &*e } != seen => false,
        found => {
            if found.is_some() {
                remove(key);
                forget_partner(key, seen);
            }
            SVC_CT_NEW.insert(key, rep, BPF_NOEXIST as u64).is_ok()
        }
    };
    unclaim(key);
    stored
}

/// Whether entry `key`/`v` itself was seen within its timeout at `now`.
#[inline(always)]
pub fn fresh(key: &CtKey, v: &CtValue, now: u64) -> bool {
    now.saturating_sub(v.last_seen_ns) <= timeout_ns(key.proto, v.flags)
}

/// Whether the flow of entry `key`/`v` is alive: this direction is fresh, or the other.
/// The other only while it is still this flow's: a dead flow's tuple may have gone to a newer
/// flow (its reply tuple to a flow from the client's port to another frontend of the
/// backend, its client tuple to the client's next flow there), whose freshness would
/// otherwise revive the dead entry (a stale FORWARD entry sends a new connection onto the
/// live flow's tuple; a stale REPLY entry holds its SNAT port while the newer flow lives).
#[inline(always)]
pub fn alive(key: &CtKey, v: &CtValue, now: u64) -> bool {
    if fresh(key, v, now) {
        return true;
    }
    let pk = partner_key(key, v);
    match find(&pk) {
        // SAFETY: a map value, read in place.
        Some(pe) => unsafe {
            partner_key(&pk, &*pe) == *key
                && now.saturating_sub((*pe).last_seen_ns) <= timeout_ns(pk.proto, (*pe).flags)
        },
        None => false,
    }
}

/// Whether the flow of entry `key`/`v` has been idle both ways for the SNAT reclaim bound
/// (`DatapathConfig::snat_reclaim_idle_s`): its port may go to a new flow that finds the range
/// full. The other direction counts only while it is still this flow's, as in `alive`.
/// Inlined: a frame of its own put `svc_snat_try`'s chain past the verifier's stack limit.
#[inline(always)]
fn idle(key: &CtKey, v: &CtValue, now: u64) -> bool {
    let bound = match SVC_CONFIG.get(0) {
        Some(c) => ct_timeout::snat_reclaim_idle_s(c),
        None => ct_timeout::SNAT_RECLAIM_IDLE_S,
    } as u64
        * SEC;
    if now.saturating_sub(v.last_seen_ns) <= bound {
        return false;
    }
    let pk = partner_key(key, v);
    match find(&pk) {
        // SAFETY: a map value, read in place.
        Some(pe) => unsafe {
            partner_key(&pk, &*pe) != *key || now.saturating_sub((*pe).last_seen_ns) > bound
        },
        None => true,
    }
}

/// Whether the `HANDING` mark of `v` still holds at `now`. Signed: a stamp a moment ahead of
/// this packet's clock reading holds too. A lapsed mark is cleared by the next packet
/// (`lapse_handing`), so the 16-bit seconds never come round to holding again.
#[inline(always)]
pub fn handing_holds(v: &CtValue, now: u64) -> bool {
    (((now / SEC) as u16).wrapping_sub(v.handing_s) as i16) < ct_flags::HANDING_HOLD_S as i16
}

/// Clears a lapsed `HANDING` mark of the packet's FORWARD entry: one left by an uninstall
/// that did not finish; the flow is svc's again. Rare, so a lookup of its own.
#[inline(never)]
pub fn lapse_handing(p: &Pkt) {
    let key = key_of(p, ct_dir::FORWARD);
    if let Some(e) = find(&key) {
        // SAFETY: a map value.
        unsafe { clear_flags(e, ct_flags::HANDING) };
    }
}

/// `lookup`'s mark for a packet leaving by the external egress that answers a TCP SYN: a
/// SYN-ACK, an RST (a refusal), or an ICMP error about it (`icmp::ANSWERS`). A closed flow's
/// REPLY entry it meets is the reply tuple of a direct connection from the closed flow's
/// client port to its backend (`syn_on_reply_tuple` says when): the flow's entries are
/// removed, whether it is still within its closing timeout or not, and the packet leaves
/// untranslated. A closed flow's own RST (a second one, or one answering a late segment) is
/// taken the same way: it leaves untranslated, and the flow's entries go before their
/// timeout. Checked here rather than by a lookup of the SYN's reversed tuple at the ingress:
/// the egress looks this tuple up anyway, and nearly every SYN through the node is no flow of
/// svc's. Not marked: the ACK of a backend that still holds the tuple in TIME_WAIT, which is
/// translated as the closed flow's (the client, which has no such connection, resets it).
pub const ANSWER: PacketFlags = PacketFlags(1 << 29);

/// `lookup`'s and `peek`'s answers. A field-less enum: a plain u32 in R0, as the verifier
/// wants a subprogram's answer (the numbers are those of the constants it replaced).
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Miss = 0,
    Hit = 1,
    /// A SYN on the FORWARD entry of a closed flow that is neither SNATed nor handed over to
    /// the node's conntrack (a client reusing its port for a new connection to the same
    /// frontend): a miss, but the flow's entries are left in place, copied in `out`. The new
    /// flow takes them over in place when it goes to the same backend (`create`); the caller
    /// removes them (`forget_closed`) whatever else the SYN becomes. A removal and an insert
    /// of each entry cost an LRU table far more than a rewrite in place, and a client that
    /// reuses ports fast (a load generator, a load balancer SNATing to a few addresses) does
    /// so for nearly every connection.
    Closed = 2,
    /// A segment of a tracked flow (`ct_flags::TRACKED`) that is not where its sender is: an
    /// RST outside the window of an assured flow, or a SYN-ACK that does not acknowledge the
    /// client's SYN (a forged or stale one). Nothing was changed; the caller drops it, as
    /// conntrack marks it INVALID and kube-proxy's rules drop such packets.
    Invalid = 3,
}

/// The flags the packet `lookup` copied `v` for added to its flow (0: none, or `v` is no
/// copy of a hit). `lookup` leaves them in the copy's `_pad0`, which is 0 in the maps and
/// which its copy of the entry (`live`) resets on every hit, so a packet that adds nothing
/// pays nothing for it; no copy is ever stored after `lookup` has set it. What the monitor
/// tells a known flow's packet that changed the flow's state by (`monitor::tc_known`).
#[inline(always)]
pub fn added(v: &CtValue) -> u16 {
    v._pad0 as u16
}

/// `lookup`'s `now` for a caller that needs the time only if the entry exists: the clock is
/// read on a hit. Most packets leaving by an egress are no flow of svc's, and they need no
/// time. The monotonic clock is never 0 once the machine runs.
pub const NOW_ON_HIT: u64 = 0;

/// Looks up the live entry of `key` and copies it into `out`. `pod`: the entry must belong
/// to the per-packet ClusterIP path (flag POD), else it must not; the two paths never act on
/// each other's flows. With `ANSWER` in `add`, a closed flow's entry is removed and missed,
/// alive or not. A hit is refreshed by the packet: its last-seen time, and the flags it adds
/// (`packet_flags`) on both entries of the flow (they are rare: the first reply, a FIN, an
/// RST), once a tracked TCP flow's segment is found where its sender is (`track`). A SYN
/// (`add` has `SYN`) on a closed flow's entry starts a new connection: a miss, and the flow's
/// entries are removed, except `Found::Closed`'s case. A call of the global function
/// `svc_ct_lookup`.
#[inline(always)]
pub fn lookup(key: &CtKey, pod: bool, add: PacketFlags, now: u64, out: &mut CtValue) -> Found {
    match svc_ct_lookup(key, pod as u64, add.0 as u64, now, out) {
        1 => Found::Hit,
        2 => Found::Closed,
        3 => Found::Invalid,
        _ => Found::Miss,
    }
}

/// `lookup`, a global function (BTF linkage global, as a `no_mangle` public function gets):
/// the verifier checks it once for each program, with every argument unknown, and then takes
/// each call for its type alone. As a static function it was checked again for each path to
/// a call with its own known `add` (the packet's TCP flags): with its tracking of TCP
/// (`track`, `assure`) it was half to two thirds of the instructions the verifier processed
/// for each tc program (docs/design/packet-datapath.md, "What the verifier costs"). The key is
/// copied onto this frame: a global function's pointer arguments are memory of their BTF
/// type's size (Linux 5.12), which 5.15's and 6.1's map helpers do not take as a key. Returns
/// `Found` as a number.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn svc_ct_lookup(
    key: *const CtKey,
    pod: u64,
    add: u64,
    now: u64,
    out: *mut CtValue,
) -> i64 {
    if key.is_null() || out.is_null() {
        return Found::Miss as i64;
    }
    let mut copy = core::mem::MaybeUninit::<CtKey>::uninit();
    // SAFETY: the caller's key, of its type's size (the verifier checked each call for it).
    let key = unsafe { crate::mem::copy_words(&mut copy, key) };
    // SAFETY: the caller's scratch space's value, of its type's size, as above.
    let out = unsafe { &mut *out };
    lookup_in(key, pod != 0, PacketFlags(add as u32), now, out) as i64
}

/// `svc_ct_lookup`'s work, a static function of its own: inlined there, its copies of keys
/// and values took a frame of 352 bytes, past the verifier's 512 on the chain to `track`'s
/// callees (apart: 40 bytes for the key's copy, 128 for this one).
#[inline(never)]
fn lookup_in(key: &CtKey, pod: bool, add: PacketFlags, now: u64, out: &mut CtValue) -> Found {
    let mut now = now;
    let Some(mut e) = live(key, pod, add.has(ANSWER), &mut now, out) else {
        return Found::Miss;
    };
    // A flow being handed over (`HANDING`): the caller drops the packet while the mark
    // holds (`handing_holds`), so it records nothing (a FIN or RST dropped here must not mark
    // closed a flow the backend never saw closing).
    if out.flags & ct_flags::HANDING != 0 {
        return Found::Hit;
    }
    if add.has(SYN) && ct_flags::closed(out.flags) {
        if key.dir == ct_dir::FORWARD && out.flags & (ct_flags::SNAT | ct_flags::HANDED) == 0 {
            return Found::Closed;
        }
        forget(key, out);
        return Found::Miss;
    }
    let add = if key.proto == IPPROTO_TCP && out.flags & ct_flags::TRACKED != 0 {
        track(key, e, out, add)
    } else {
        add
    };
    if add.has(OUT_OF_WINDOW) {
        return Found::Invalid;
    }
    // TCP: the client's ACK of the backend's SYN-ACK (`track` let `ACKS` through only for
    // one). UDP, ICMP echo: the client's packet after a reply, a stream.
    if (add.has(ACKS) || key.proto != IPPROTO_TCP)
        && key.dir == ct_dir::FORWARD
        && out.flags & (ct_flags::UNASSURED | ct_flags::SEEN_REPLY)
            == ct_flags::UNASSURED | ct_flags::SEEN_REPLY
        && assure(key, e, out) != 0
    {
        match find(key) {
            Some(moved) => e = moved,
            None => return Found::Hit,
        }
    }
    let add = add.stored() & !out.flags;
    if add != 0 {
        out.flags |= add;
        // For the monitor (`added`): the copy only, never stored.
        out._pad0 = add as u32;
        // SAFETY: as above. ORed in, not stored from the copy: a packet of a closed flow
        // racing a new flow's take-over (`take_over`) must not store the closed flow's flags
        // over the new flow's.
        unsafe {
            add_flags(e, add);
            (*e).last_seen_ns = now;
        }
        if let Some(pe) = find(&partner_key(key, out)) {
            // SAFETY: as above.
            unsafe { add_flags(pe, add) };
        }
    } else if now.saturating_sub(out.last_seen_ns) > REFRESH_NS {
        // SAFETY: as above.
        unsafe { (*e).last_seen_ns = now };
    }
    if out.flags & ct_flags::HANDED != 0 && key.dir == ct_dir::FORWARD {
        // The node's conntrack carries the flow now (`svc-agent uninstall` made its entry):
        // its packets go on untranslated, for netfilter to translate. As a translation to
        // the packet's own destination, so the tc programs need no branch (and no stack) of
        // their own for it.
        out.nat_addr = key.daddr;
        out.nat_port_be = key.dport_be;
        out.flags &= !ct_flags::SNAT;
    }
    Found::Hit
}

/// The live entry of `key` of this path (`pod`) copied into `out`, and where it lies; None
/// for a miss. `answer`: a closed flow's entry is removed and missed, alive or not (`ANSWER`).
/// `now` may be `NOW_ON_HIT`: the clock is read on a hit, into `now`.
#[inline(always)]
fn live(
    key: &CtKey,
    pod: bool,
    answer: bool,
    now: &mut u64,
    out: &mut CtValue,
) -> Option<*mut CtValue> {
    let e = find(key)?;
    if *now == NOW_ON_HIT {
        *now = crate::lb::clock_ns();
    }
    // SAFETY: a map value; copied out at once. Concurrent writers only store times, flags
    // and a sequence position, which a racing reader may see old or new.
    *out = unsafe { *e };
    if (out.flags & ct_flags::POD != 0) != pod {
        return None;
    }
    if answer && ct_flags::closed(out.flags) {
        forget(key, out);
        return None;
    }
    if !alive(key, out, *now) {
        return None;
    }
    Some(e)
}

/// `lookup` for an ICMP error about a flow, which is no packet of it: the live entry of `key`
/// copied into `out`, nothing recorded (`answer` as `live` takes it). A function of its own,
/// without `lookup`'s tracking, whose frame the ICMP path's deeper chain could not carry.
#[inline(never)]
pub fn peek(key: &CtKey, pod: bool, answer: bool, now: u64, out: &mut CtValue) -> Found {
    let mut now = now;
    match live(key, pod, answer, &mut now, out) {
        Some(_) => Found::Hit,
        None => Found::Miss,
    }
}

/// A TCP SYN without ACK that no flow's FORWARD entry took and that starts no flow to a local
/// backend (it goes on untranslated, is answered by svc, or starts a remote or hairpin flow):
/// if its own reply tuple is a closed flow's REPLY entry of this path (`pod`), that flow's
/// entries are removed, or what comes back on that tuple would be translated as the closed
/// flow's. The case: a NodePort flow to a local backend keeps the client's address, so its
/// REPLY entry (backend -> client:port) is also the reply tuple of a direct connection from
/// that client port to the backend. A SYN through the node (to no node address) is not
/// looked up here: its answer does that at the egress (`ANSWER`).
#[inline(never)]
pub fn syn_on_reply_tuple(p: &Pkt, pod: bool) {
    if p.proto != IPPROTO_TCP || p.tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN {
        return;
    }
    let key = CtKey {
        saddr: p.daddr,
        daddr: p.saddr,
        sport_be: p.dport_be,
        dport_be: p.sport_be,
        proto: p.proto,
        dir: ct_dir::REPLY,
        _pad0: [0; 2],
    };
    let Some(e) = find(&key) else {
        return;
    };
    // SAFETY: a map value, copied out.
    let v = unsafe { *e };
    if (v.flags & ct_flags::POD != 0) == pod && ct_flags::closed(v.flags) {
        forget(&key, &v);
    }
}

/// Where the packet goes, and where it comes from, after the translation of entry `v` of
/// direction `dir`: a FORWARD entry sends it to the backend (from the SNAT address when
/// SNATed), a REPLY entry makes it come from the frontend (to the client when SNATed).
#[inline(always)]
pub fn translated(p: &Pkt, dir: u8, v: &CtValue, src: &mut Endpoint, dst: &mut Endpoint) {
    let snat = v.flags & ct_flags::SNAT != 0;
    let nat = Endpoint {
        addr: v.nat_addr,
        port_be: v.nat_port_be,
    };
    let snat_end = Endpoint {
        addr: v.snat_addr,
        port_be: v.snat_port_be,
    };
    let own_src = Endpoint {
        addr: p.saddr,
        port_be: p.sport_be,
    };
    let own_dst = Endpoint {
        addr: p.daddr,
        port_be: p.dport_be,
    };
    if dir == ct_dir::FORWARD {
        *dst = nat;
        *src = if snat { snat_end } else { own_src };
    } else {
        *src = nat;
        *dst = if snat { snat_end } else { own_dst };
    }
}

/// Outcome of `create` (numbered as the constants it replaced).
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Create {
    Stored = 0,
    /// The map refused.
    Failed = 1,
    /// The reply tuple belongs to another live flow that is not closed: the same client
    /// address and port reaching the same backend through another frontend. Storing this
    /// flow's entry over it would give that flow's replies this flow's frontend.
    Clash = 2,
}

/// Removes the closed flow whose FORWARD entry `v` the packet's SYN found (`Found::Closed`), when
/// the SYN starts no flow that takes it over.
#[inline(never)]
pub fn forget_closed(p: &Pkt, v: &CtValue) {
    forget(&key_of(p, ct_dir::FORWARD), v);
}

/// Stores the two entries of a new flow that is not SNATed: `fwd` under the packet's tuple,
/// and its reply (backend to client). `closed`: the closed flow the packet's SYN found on the
/// tuple (`Found::Closed`), taken over in place when it went to the same backend, else removed
/// first. Nothing is left behind when it fails.
#[inline(always)]
pub fn create(fwd_key: &CtKey, fwd: &CtValue, rep: &CtValue, closed: Option<&CtValue>) -> Create {
    let rep_key = partner_key(fwd_key, fwd);
    if let Some(old) = closed {
        if old.nat_addr == fwd.nat_addr
            && old.nat_port_be == fwd.nat_port_be
            && take_over(fwd_key, &rep_key, fwd, rep)
        {
            return Create::Stored;
        }
        forget(fwd_key, old);
    }
    if SVC_CT.get_ptr(rep_key).is_some()
        || SVC_CT_NEW.insert(rep_key, rep, BPF_NOEXIST as u64).is_err()
    {
        // Taken, in either table. By this very flow (its FORWARD entry expired or was evicted
        // first), or by a dead one: replaced. By another closed flow: replaced, its FORWARD
        // entry removed. By another live flow: a clash. Checked and replaced under a claim,
        // as `store` does.
        if !claim(&rep_key) {
            return Create::Failed;
        }
        let mut clash = false;
        if let Some(e) = find(&rep_key) {
            // SAFETY: a map value, copied out.
            let e = unsafe { *e };
            if partner_key(&rep_key, &e) != *fwd_key {
                if ct_flags::closed(e.flags) {
                    forget(&rep_key, &e);
                } else if alive(&rep_key, &e, rep.last_seen_ns) {
                    clash = true;
                }
            }
        }
        if !clash {
            // What is left at the key in the assured table would shadow the new entry.
            let _ = SVC_CT.remove(rep_key);
        }
        let stored = !clash && SVC_CT_NEW.insert(rep_key, rep, 0).is_ok();
        unclaim(&rep_key);
        if clash {
            return Create::Clash;
        }
        if !stored {
            return Create::Failed;
        }
    }
    if !store(fwd_key, fwd) {
        let _ = SVC_CT_NEW.remove(rep_key);
        return Create::Failed;
    }
    Create::Stored
}

/// Rewrites the entries of a closed flow in place with the new flow's `fwd` and `rep`, which
/// translate alike (same backend, neither SNATed nor handed over: only flags, times, ids and
/// the device change, fields a racing reader may see old or new as it may any refresh; a
/// racing refresh ORs flags in, or clears `UNASSURED` (`assure`), and stores a sequence
/// position). The REPLY entry first: the FORWARD entry, written
/// last, is what makes the flow open to the client's packets. False, with nothing written,
/// when either entry is gone or no longer this closed flow's.
#[inline(always)]
fn take_over(fwd_key: &CtKey, rep_key: &CtKey, fwd: &CtValue, rep: &CtValue) -> bool {
    let (Some(fe), Some(re)) = (find(fwd_key), find(rep_key)) else {
        return false;
    };
    // SAFETY: map values, checked and written in place.
    unsafe {
        if !ct_flags::closed((*fe).flags)
            || (*fe).flags & (ct_flags::SNAT | ct_flags::HANDED | ct_flags::HANDING) != 0
            || !ct_flags::closed((*re).flags)
            || partner_key(rep_key, &*re) != *fwd_key
        {
            return false;
        }
        renew(re, rep);
        renew(fe, fwd);
    }
    true
}

/// Writes the fields of `v` that differ between a closed flow's entry and the new flow's that
/// takes it over: never the addresses and ports, so an element another CPU removed and
/// reused for another key meanwhile (as any refresh through a pointer may meet) keeps its own.
///
/// # Safety
/// `e` is a map value pointer.
#[inline(always)]
unsafe fn renew(e: *mut CtValue, v: &CtValue) {
    // SAFETY: the caller's.
    unsafe {
        (*e).flags = v.flags;
        (*e).seq_end = v.seq_end;
        (*e).handing_s = v.handing_s;
        (*e).id = v.id;
        (*e).ifindex = v.ifindex;
        (*e).last_seen_ns = v.last_seen_ns;
    }
}

/// Outcome of `create_snat` (numbered as the constants it replaced).
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Snat {
    Stored = 0,
    /// Every try met an open flow's port.
    Exhausted = 1,
    /// The map refused.
    Failed = 2,
}

/// Stores the new SNATed flow of the scratch space (`Flow`): picks a port for
/// `fwd.snat_addr` from the range whose reply tuple (backend to SNAT address:port) no open
/// flow holds, claims it by storing the REPLY entry, then stores `fwd` (its `snat_port_be`
/// filled in). A port is taken when its REPLY entry is absent or its flow is dead, and after
/// the first `SNAT_FREE_TRIES` tries also when its flow is closed (`ct_flags::closed`; conntrack
/// lets a new connection reuse a tuple in TIME_WAIT or CLOSE too) or open but idle both ways
/// for `ct_timeout::SNAT_RECLAIM_IDLE_S` (`idle`). A dead or closed flow's
/// entries are removed first, under a claim of the port that no other CPU's reclaim can hold
/// at the same time (`reclaim`: nothing is removed if another CPU has reclaimed the port since
/// they were read). Every store of a REPLY entry is a BPF_NOEXIST insert, so of two CPUs that
/// find one port free, or one finds it free while the other reclaims it, one stores; the
/// other tries on. All
/// `SNAT_TRIES` meeting open flows: exhausted.
///
/// The tries are calls of a global function (`svc_snat_try`), which the verifier checks
/// once; a static function is explored try by try (8 tries took the external ingress past the
/// 1,000,000 instructions the verifier may process for it, on 6.18).
///
/// `f` is a raw pointer, and what the tries leave is read back with volatile loads: the tries
/// write the flow through a pointer of their own (the scratch space, looked up again), which
/// the compiler cannot see. Through a `&mut Flow` it may assume nothing else writes the flow
/// during the calls, and then it may fold `claimed` to the 0 stored before them (with
/// bpf_loop's callback it did: every flow was dropped as exhausted).
#[inline(never)]
pub fn create_snat(f: *mut Flow) -> Snat {
    let (min, max) = snat_range();
    // SAFETY: `f` is this CPU's scratch space (scratch.rs), valid while the program runs.
    unsafe {
        (*f).port_min = min as u32;
        (*f).port_span = (max - min) as u32 + 1;
        (*f).try_key = partner_key(&(*f).key, &(*f).fwd);
        (*f).claimed = 0;
        (*f).frontends_in_range = setting(|c| c.snat_range_frontends);
    }
    let mut index = 0;
    while index < SNAT_TRIES {
        if svc_snat_try(index) != 0 {
            break;
        }
        index += 1;
    }
    // SAFETY: as above; volatile, as said.
    unsafe {
        if core::ptr::read_volatile(&(*f).claimed) == 0 {
            if let Some(s) = crate::scratch::get() {
                s.snat_busy = 1;
            }
            return Snat::Exhausted;
        }
        (*f).fwd.snat_port_be = core::ptr::read_volatile(&(*f).try_key.dport_be);
        if !store(&(*f).key, &(*f).fwd) {
            let _ = SVC_CT_NEW.remove((*f).try_key);
            return Snat::Failed;
        }
    }
    Snat::Stored
}

/// `mem::copy` of an entry, a function of its own: inlined, it grew `svc_snat_try`'s frame past
/// the verifier's stack limit on the external ingress's deepest call chain.
///
/// # Safety
/// As `mem::copy`.
#[inline(never)]
unsafe fn copy_value(dst: &mut CtValue, src: *const CtValue) {
    // SAFETY: as the caller promises.
    unsafe { crate::mem::copy(dst, src) }
}

/// Whether the reply tuple `f.try_key` names is also a live flow's FORWARD tuple (a flow to a
/// frontend whose port lies in the SNAT range, `DatapathConfig::snat_range_frontends`):
/// packets of one would be taken for the other's. The key is turned FORWARD for the lookup
/// and back after it, in place in the scratch space: no second key is built. Inlined: a frame
/// of its own put `svc_snat_try`'s chain past the verifier's stack limit.
#[inline(always)]
fn forward_tuple_taken(f: &mut Flow) -> bool {
    if f.frontends_in_range == 0 {
        return false;
    }
    f.try_key.dir = ct_dir::FORWARD;
    let taken = match find(&f.try_key) {
        Some(e) => {
            // SAFETY: a map value, copied out (as `svc_snat_try` does).
            unsafe { copy_value(&mut f.seen, e) };
            alive(&f.try_key, &f.seen, f.now)
        }
        None => false,
    };
    f.try_key.dir = ct_dir::REPLY;
    taken
}

/// One try of `create_snat`: 1 stops the tries (a port was claimed, or there is no scratch
/// space), 0 tries again. A global function (BTF linkage global, as a `no_mangle` public
/// function gets), which the verifier checks once on its own, with `index` unknown, and then
/// takes each call of for its type alone. A static function is checked again at each call
/// with the caller's state: called try after try from each path to `create_snat`, 8 tries
/// took the external ingress past the verifier's budget of 1,000,000 instructions. As
/// bpf_loop's callback (until c7bfc33) the external ingress cost the verifier 166,000
/// instructions more than with this function (692,481 against 526,449 on Linux 6.18, at
/// ed4f4dd), and it needed Linux 5.17.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn svc_snat_try(index: u32) -> i64 {
    let Some(s) = crate::scratch::get() else {
        return 1;
    };
    let f = &mut s.new;
    // SAFETY: a helper without arguments. (`checked_rem`: a `%` by a value read from memory
    // would carry a panic path, which the verifier refuses as a function that does not end.)
    let r = unsafe { bpf_get_prandom_u32() }.checked_rem(f.port_span);
    let port = f.port_min + r.unwrap_or(0);
    f.try_key.dport_be = (port as u16).to_be();
    if forward_tuple_taken(f) {
        return 0;
    }
    if let Some(e) = find(&f.try_key) {
        // SAFETY: a map value, copied out (into the scratch space, not the stack): another
        // CPU may reclaim the port and store its own flow in this very element meanwhile.
        unsafe { copy_value(&mut f.seen, e) };
        let dead = !alive(&f.try_key, &f.seen, f.now);
        let free_tries = if s.snat_busy != 0 { 0 } else { SNAT_FREE_TRIES };
        // An unassured flow's port only after the free tries, busy or not: a real client's
        // handshake may be in flight, and a closed flow's port is the better take.
        if !(dead
            || index >= free_tries
                && (ct_flags::closed(f.seen.flags) || idle(&f.try_key, &f.seen, f.now))
            || index >= SNAT_FREE_TRIES && f.seen.flags & ct_flags::UNASSURED != 0)
        {
            return 0;
        }
        // Written before the claim, which writes nothing if it fails (the next try's
        // outcome, or exhaustion, then sets it): no local lives across the calls below,
        // whose frames are on the external ingress's deepest chain.
        s.snat_busy = !dead as u64;
        if !reclaim(&f.try_key, &f.seen, &f.rep) {
            return 0;
        }
    } else {
        s.snat_busy = 0;
        // The claim: of two CPUs that found the port free, one stores.
        if SVC_CT_NEW
            .insert(f.try_key, f.rep, BPF_NOEXIST as u64)
            .is_err()
        {
            return 0;
        }
    }
    f.claimed = 1;
    1
}
