//! Removes dead flows from connection tracking (`SVC_CT`), run by the agent every few seconds
//! through BPF_PROG_TEST_RUN, never attached.
//!
//! The table is an LRU: without a sweep, a flow's entries stay after it has died (closed,
//! or idle past its timeout) until new flows evict them, so a busy node's table is always
//! full. Two things get worse when it is. Every packet the programs look up and find no
//! flow for (most packets leaving by an external egress: the node's own and its pods'
//! traffic) walks a bucket chain of about one foreign entry, a cache and TLB miss of its own:
//! svc's share of non-service connections was 1.7 % in a fresh table and 2.0-2.4 % in a
//! full one (docs/benchmarks.md). And the LRU evicts by last use, so an idle but live flow
//! (a connection idle for minutes, within its 24 h) goes before a flow closed seconds ago.
//!
//! In the kernel, not from userspace: a walk by syscalls costs two per entry, and the time
//! between an entry's check and its removal would be a syscall's, where here it is a few
//! instructions (see `sweep_one` for the race that is left).

use core::ffi::c_void;

use aya_ebpf::helpers::generated::bpf_for_each_map_elem;
use svc_common::{CtKey, CtValue};

use crate::{ct, lb, maps::SVC_CT};

/// The sweep's state, on the program's stack (bpf_for_each_map_elem's context).
#[repr(C)]
struct Sweep {
    now: u64,
    removed: u32,
    _pad0: u32,
}

/// Removes every entry of `SVC_CT` whose flow is dead (`ct::alive`: neither direction seen
/// within its timeout); the number removed.
#[inline(always)]
pub fn sweep() -> u32 {
    let mut s = Sweep {
        now: lb::clock_ns(),
        removed: 0,
        _pad0: 0,
    };
    // SAFETY: the map is this object's (its definition's address, as aya-ebpf passes it to
    // every map helper); the callback has the signature bpf_for_each_map_elem calls; its
    // context is `s`, on this stack for the whole walk.
    unsafe {
        bpf_for_each_map_elem(
            core::ptr::from_ref(&SVC_CT).cast_mut().cast(),
            sweep_one as *mut c_void,
            (&raw mut s).cast(),
            0,
        );
        // Volatile: written through the callback's pointer, which the compiler cannot see.
        core::ptr::read_volatile(&raw const s.removed)
    }
}

/// One entry: removed when its flow is dead. Each direction's entry is judged on its own, as
/// `ct::alive` judges it (the partner's freshness counts while the partner is still this
/// flow's), so a dead flow's second entry goes when the walk meets it.
///
/// The race that is left: a new flow that takes this tuple between the check and the
/// removal (a SYN on a dead closed flow's tuple rewriting its entries in place, or an insert
/// replacing the dead entry) loses that entry, and its next packet is passed as a
/// connection svc does not know. The check is repeated on the entry as it is in the table
/// just before the removal, so the window is the removal's own lookup; a sweep meets each
/// entry once, every few seconds.
extern "C" fn sweep_one(
    _map: *mut c_void,
    key: *const CtKey,
    v: *mut CtValue,
    s: *mut Sweep,
) -> i64 {
    // SAFETY: the map's key and value, valid during the callback; `s` is `sweep`'s.
    unsafe {
        let key = *key;
        let now = (*s).now;
        if ct::alive(&key, &*v, now) {
            return 0;
        }
        // The entry at the key now: the one just judged, or one a new flow put there since.
        let Some(cur) = SVC_CT.get_ptr(key) else {
            return 0;
        };
        if ct::alive(&key, &*cur, now) || !core::ptr::eq(cur, v.cast_const()) {
            return 0;
        }
        if SVC_CT.remove(key).is_ok() {
            (*s).removed += 1;
        }
    }
    0
}
