//! Non-first fragments of translated UDP datagrams.
//!
//! Only a datagram's first fragment carries its ports; the others carry its addresses, its
//! protocol and its fragment id (IPv4's 16-bit identification, IPv6's 32-bit Fragment header
//! id). When the programs translate a first fragment, they record the ports it came with under
//! (source, destination, id, protocol) as it came, before translation (`record`). A later
//! fragment of the datagram finds them there (`resume`) and goes the way of a packet of its
//! flow with those ports: the connection-tracking lookup, the route where the program forwards
//! the flow itself, the rewrite of its addresses alone (nat.rs: the ports and the UDP checksum,
//! pseudo-header included, lie in the first fragment). Cilium keeps the same record
//! (IPV4_FRAG_DATAGRAMS) rather than reassembling, which a tc program cannot do.
//!
//! Only what svc translates is recorded, so other fragmented traffic pays one lookup per later
//! fragment (none on the external ingress for traffic to no address of `NODE_ADDRS`). Only
//! UDP: a TCP sender sizes its segments to the path and sets DF, and a later TCP fragment has
//! no flags or sequence number for connection tracking to judge.
//!
//! A later fragment without a record (it came before its first fragment, or the record was
//! evicted or is too old) passes untouched, counted `Reason::Fragment`, as before: it cannot
//! be told from the fragments of the node's own traffic or of traffic through it, which must
//! pass. Its datagram is lost (the receiver never completes it), as it would be dropped.

use aya_ebpf::{btf_maps::LruHashMap, macros::btf_map, programs::TcContext};
use svc_common::IPPROTO_UDP;

use crate::pkt::{load, Pkt, L3};

/// A datagram's fragments, as they come in (before translation).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FragKey {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// The fragment id as it lies in the packet (`frag_id`).
    pub id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// The ports the first fragment came with, and when (the coarse clock, ns).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FragValue {
    pub sport_be: u16,
    pub dport_be: u16,
    pub _pad: u32,
    pub at_ns: u64,
}

/// Datagrams whose later fragments may still come. Fragments of one datagram follow each other
/// within microseconds; the room is for many datagrams in flight at once (Cilium's default).
/// LRU: an old record gives way to new ones. Not pinned: a datagram in flight across an agent
/// restart loses its later fragments, as one the network loses (UDP retries).
#[btf_map]
static SVC_FRAGS: LruHashMap<FragKey, FragValue, 8192> = LruHashMap::new();

/// A record older than this is not used: IPv4's 16-bit ids come round, and a datagram of the
/// node's own traffic, or a later one of the client's, may carry a recorded key again. The
/// kernel's reassembly timeout (net.ipv4.ipfrag_time).
const TIMEOUT_NS: u64 = 30_000_000_000;

/// The fragment id of `p`, a fragment: IPv4's identification; the id of the IPv6 Fragment
/// header, which lies right before the transport header or a later fragment's data, unless
/// another extension header follows it in a first fragment (rare: then the bytes there are not
/// a first fragment's Fragment header, and the datagram is not recorded). Read here rather
/// than kept by the parser: a field more in `Pkt` grew a frame of the external ingress's
/// deepest call chain past the verifier's 512 bytes.
#[inline(always)]
fn frag_id(ctx: &TcContext, p: &Pkt) -> Option<u32> {
    if p.v6 == 0 {
        let mut id = [0u8; 2];
        return load(ctx, L3 + 4, &mut id).then(|| u16::from_ne_bytes(id) as u32);
    }
    let mut h = [0u8; 8];
    if !load(ctx, p.l4_off - 8, &mut h) || h[0] != p.proto || h[1] != 0 {
        return None;
    }
    // A first fragment's: offset 0 and more to come; a later one's offset is not 0.
    let frag = u16::from_be_bytes([h[2], h[3]]);
    let fits = if p.later_frag != 0 {
        frag & 0xfff8 != 0
    } else {
        frag & 0xfff9 == 1
    };
    fits.then(|| u32::from_ne_bytes([h[4], h[5], h[6], h[7]]))
}

#[inline(always)]
fn key_of(p: &Pkt, id: u32) -> FragKey {
    FragKey {
        saddr: p.saddr,
        daddr: p.daddr,
        id,
        proto: p.proto,
        _pad: [0; 3],
    }
}

/// The first fragment `p`, as it came, is being translated: records its ports.
#[inline(never)]
pub fn record(ctx: &TcContext, p: &Pkt) {
    if p.proto != IPPROTO_UDP {
        return;
    }
    let Some(id) = frag_id(ctx, p) else {
        return;
    };
    let v = FragValue {
        sport_be: p.sport_be,
        dport_be: p.dport_be,
        _pad: 0,
        at_ns: crate::lb::clock_ns(),
    };
    // A full map evicts; a failed store leaves the later fragments to pass, counted.
    let _ = SVC_FRAGS.insert(key_of(p, id), v, 0);
}

/// The later fragment `p`: true with its datagram's ports filled in when its first fragment
/// was translated.
#[inline(never)]
pub fn resume(ctx: &TcContext, p: &mut Pkt) -> bool {
    if p.proto != IPPROTO_UDP {
        return false;
    }
    let Some(id) = frag_id(ctx, p) else {
        return false;
    };
    let Some(v) = SVC_FRAGS.get_ptr(key_of(p, id)) else {
        return false;
    };
    // SAFETY: a map value, copied at once.
    let v = unsafe { *v };
    if crate::lb::clock_ns().saturating_sub(v.at_ns) > TIMEOUT_NS {
        return false;
    }
    p.sport_be = v.sport_be;
    p.dport_be = v.dport_be;
    true
}
