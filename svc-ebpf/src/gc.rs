//! Removes dead flows from connection tracking (`SVC_CT`, then `SVC_CT_NEW`): run by the
//! agent every `--conntrack-sweep-interval` through BPF_PROG_TEST_RUN, never attached.
//!
//! The assured table is no LRU: nothing but the sweep (and a new flow stored over a dead
//! entry, or a closed flow taken over) removes a flow's entries after it has died (idle past
//! its timeout, which is the 10 s closing timeout once it is closed); unswept, it would fill
//! with dead flows and refuse to assure new ones. The unassured table is an LRU, which
//! evicts dead flows on its own, but only once it is full, and by last use (approximately:
//! per-CPU lists), so a handshake in flight may go before a flow that died a minute ago.
//! Swept, each holds live flows, flows still within their timeouts, and flows dead for less
//! than one interval only.
//!
//! In the kernel rather than from userspace, so that an entry is checked and removed under
//! one claim within one program run (`sweep_one`), where a walk by syscalls would remove by
//! key what it read a syscall earlier.

use core::ffi::c_void;

use aya_ebpf::helpers::generated::bpf_for_each_map_elem;
use svc_common::{ct_dir, CtKey, CtValue};

use crate::{
    ct, lb,
    maps::{SVC_CT, SVC_CT_NEW},
    monitor,
};

/// The sweep's state, on the program's stack (bpf_for_each_map_elem's context).
#[repr(C)]
struct Sweep {
    now: u64,
    removed: u32,
    /// 0 while the walk is of `SVC_CT`, 1 of `SVC_CT_NEW`.
    table: u32,
}

/// Removes every entry of `SVC_CT` and `SVC_CT_NEW` whose flow is dead (`ct::alive`: neither
/// direction seen within its timeout); the number removed.
#[inline(always)]
pub fn sweep() -> u32 {
    let mut s = Sweep {
        now: lb::clock_ns(),
        removed: 0,
        table: 0,
    };
    // SAFETY: the maps are this object's (their definitions' addresses, as aya-ebpf passes
    // them to every map helper); the callback has the signature bpf_for_each_map_elem calls;
    // its context is `s`, on this stack for the whole walk.
    unsafe {
        bpf_for_each_map_elem(
            core::ptr::from_ref(&SVC_CT).cast_mut().cast(),
            sweep_one as *mut c_void,
            (&raw mut s).cast(),
            0,
        );
        // Volatile: the callback writes through a pointer the compiler cannot see.
        core::ptr::write_volatile(&raw mut s.table, 1);
        bpf_for_each_map_elem(
            core::ptr::from_ref(&SVC_CT_NEW).cast_mut().cast(),
            sweep_one as *mut c_void,
            (&raw mut s).cast(),
            0,
        );
        core::ptr::read_volatile(&raw const s.removed)
    }
}

/// One entry: removed when its flow is dead. Each direction's entry is judged on its own, as
/// `ct::alive` judges it (the partner's freshness counts while the partner is still this
/// flow's), so a dead flow's second entry goes when the walk meets it.
///
/// Checked again under the key's claim (`ct::claim`), which a new flow's store over an entry
/// takes too (`ct::store`): a store over the dead entry is either refused while the sweep
/// holds the claim or seen by the second check (a new element, a fresh time). Not closed: a
/// packet that removes a closed flow without a claim (`ct::ANSWER`, `syn_on_reply_tuple`,
/// whether it is alive or not) and a new flow stored at the then free key, both between the
/// second check and the removal, which removes the new entry; that flow's next packets pass
/// untranslated. The window is the removal's own call (longer if the sweep's thread is
/// interrupted there). A key claimed by another CPU is left to the next sweep.
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
        if ct::alive(&key, &*v, now) || !ct::claim(&key) {
            return 0;
        }
        let new = core::ptr::read_volatile(&raw const (*s).table) != 0;
        let cur = if new {
            SVC_CT_NEW.get_ptr(key)
        } else {
            SVC_CT.get_ptr(key)
        };
        if let Some(cur) = cur {
            // Its own time only: a dead flow's partner stays dead (a packet on its tuple is a
            // miss that refreshes nothing), or goes to a new flow, which then needs this key
            // for its other entry: refused under the claim (the flow fails, counted) or
            // stored once this entry is gone.
            if core::ptr::eq(cur, v.cast_const()) && !ct::fresh(&key, &*cur, now) {
                // A listening monitor is told of the flow once, by its FORWARD entry, before
                // the entry goes (its memory may serve another flow once removed). Told in
                // vain only when a packet removed the closed flow without the claim (above)
                // just now: gone all the same.
                if key.dir == ct_dir::FORWARD && monitor::listening() {
                    monitor::emit_swept(&key, &*cur, now);
                }
                let removed = if new {
                    SVC_CT_NEW.remove(key)
                } else {
                    SVC_CT.remove(key)
                };
                if removed.is_ok() {
                    (*s).removed += 1;
                }
            }
        }
        ct::unclaim(&key);
    }
    0
}
