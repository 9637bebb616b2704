//! Service lookup and backend choice: the load-balancing decision, independent of the hook
//! that asks for it, so the packet datapath can share it.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use svc_common::{
    stat, svc_flags, AffinityKey, AffinityValue, Backend, BackendId, ServiceKey, ServiceValue,
    SlotKey, PROTO_ANY,
};

use crate::maps::{count, SVC_AFFINITY, SVC_BACKENDS, SVC_SERVICES, SVC_SLOTS};

/// Outcome of a lookup or a choice: `FOUND`, `NOT_SERVICE`, or the `svc_common::stat` index
/// that says why the connection is refused.
///
/// Plain codes with out-parameters rather than `Result<Option<T>, E>`: LLVM merges the
/// payloads of such enums into stores of registers that are undefined on some paths, and the
/// verifier rejects reading them.
pub type Outcome = u32;
pub const FOUND: Outcome = 0x100;
pub const NOT_SERVICE: Outcome = 0x101;

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
    let marker = ServiceKey {
        addr: key.addr,
        port_be: 0,
        proto: PROTO_ANY,
        scope: key.scope,
    };
    // SAFETY: only the presence of the entry is used.
    if unsafe { SVC_SERVICES.get(marker) }.is_some() {
        return stat::REFUSED_NO_PORT;
    }
    NOT_SERVICE
}

/// Copies backend `id` into `out`.
#[inline(always)]
fn backend(id: BackendId, out: &mut Backend) -> Outcome {
    // SAFETY: copied out at once.
    match unsafe { SVC_BACKENDS.get(id) } {
        Some(b) => {
            *out = *b;
            FOUND
        }
        None => stat::ERR_MISSING_ENTRY,
    }
}

/// A uniformly random slot of the frontend's current generation, as a backend id; 0 if the
/// slot is missing (an update raced this lookup).
#[inline(always)]
fn random_slot(svc: &ServiceValue) -> BackendId {
    let slot = (unsafe { bpf_get_prandom_u32() } % svc.count as u32) as u16 + 1;
    let key = SlotKey {
        id: svc.id,
        rev: svc.rev,
        slot,
    };
    // SAFETY: copied out at once.
    match unsafe { SVC_SLOTS.get(key) } {
        Some(id) => *id,
        None => 0,
    }
}

/// Picks a backend for `svc` into `out`, honouring sessionAffinity for the client `client`
/// names. `client` is called only for a Service with affinity, so connections to the others
/// do not pay for identifying the client.
#[inline(always)]
pub fn choose(
    svc: &ServiceValue,
    client: impl FnOnce() -> AffinityKey,
    out: &mut Backend,
) -> Outcome {
    if svc.count == 0 {
        return stat::REFUSED_NO_BACKEND;
    }
    if !has_flag(svc, svc_flags::AFFINITY) {
        return backend(random_slot(svc), out);
    }

    let client = &client();
    let now = unsafe { bpf_ktime_get_ns() };
    let timeout_ns = svc.affinity_timeout_s as u64 * 1_000_000_000;
    // SAFETY: copied out at once.
    if let Some(prev) = unsafe { SVC_AFFINITY.get(client) } {
        let (last_used_ns, prev_backend) = (prev.last_used_ns, prev.backend);
        // The agent purges entries whose backend left the service; a backend that is gone
        // altogether is caught by the lookup.
        if now.wrapping_sub(last_used_ns) <= timeout_ns && backend(prev_backend, out) == FOUND {
            refresh(client, prev_backend, now);
            count(stat::AFFINITY_HIT);
            return FOUND;
        }
    }
    let id = random_slot(svc);
    let outcome = backend(id, out);
    if outcome == FOUND {
        refresh(client, id, now);
    }
    outcome
}

#[inline(always)]
fn refresh(client: &AffinityKey, backend: BackendId, now: u64) {
    let value = AffinityValue {
        last_used_ns: now,
        backend,
        _pad0: 0,
    };
    // A lost update only costs stickiness, never the connection.
    let _ = SVC_AFFINITY.insert(client, value, 0);
}
