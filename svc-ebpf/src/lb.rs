//! Service lookup and backend choice: the load-balancing decision, independent of the hook
//! that asks for it, so the packet datapath can share it.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns};
use svc_common::{
    stat, svc_flags, AffinityKey, AffinityValue, Backend, BackendId, ServiceKey, ServiceValue,
    SlotKey, ECONNREFUSED, PROTO_ANY,
};

use crate::maps::{count, SVC_AFFINITY, SVC_BACKENDS, SVC_SERVICES, SVC_SLOTS};

/// Why a connection was refused: the errno the caller sees and the counter it bumps.
pub struct Refused {
    pub errno: i32,
    pub stat: u32,
}

const fn refused(stat: u32) -> Refused {
    Refused {
        errno: ECONNREFUSED,
        stat,
    }
}

/// The frontend a connection asked for, and the backend it gets.
pub struct Choice {
    pub svc_id: u32,
    pub backend: Backend,
}

#[inline(always)]
fn has_flag(svc: &ServiceValue, flag: u16) -> bool {
    svc.flags & flag != 0
}

/// `Ok(None)`: not a service address, leave the connection alone.
#[inline(always)]
pub fn lookup(key: &ServiceKey) -> Result<Option<ServiceValue>, Refused> {
    // SAFETY: the value is copied out at once; the agent may replace it concurrently.
    if let Some(svc) = unsafe { SVC_SERVICES.get(key) } {
        let svc = *svc;
        if !has_flag(&svc, svc_flags::ADDR_MARKER) {
            return Ok(Some(svc));
        }
    }
    let marker = ServiceKey {
        addr: key.addr,
        port_be: 0,
        proto: PROTO_ANY,
        scope: key.scope,
    };
    // SAFETY: only the presence of the entry is used.
    if unsafe { SVC_SERVICES.get(&marker) }.is_some() {
        return Err(refused(stat::REFUSED_NO_PORT));
    }
    Ok(None)
}

#[inline(always)]
fn backend(id: BackendId) -> Option<Backend> {
    // SAFETY: copied out at once.
    unsafe { SVC_BACKENDS.get(id) }.copied()
}

#[inline(always)]
fn random_slot(svc: &ServiceValue) -> Result<BackendId, Refused> {
    let slot = (unsafe { bpf_get_prandom_u32() } % svc.count as u32) as u16 + 1;
    let key = SlotKey {
        id: svc.id,
        rev: svc.rev,
        slot,
    };
    // SAFETY: copied out at once.
    match unsafe { SVC_SLOTS.get(&key) } {
        Some(id) => Ok(*id),
        None => Err(refused(stat::ERR_MISSING_ENTRY)),
    }
}

/// Picks a backend for `svc`, honouring sessionAffinity for `client`.
#[inline(always)]
pub fn choose(svc: &ServiceValue, client: &AffinityKey) -> Result<Choice, Refused> {
    if svc.count == 0 {
        return Err(refused(stat::REFUSED_NO_BACKEND));
    }
    if !has_flag(svc, svc_flags::AFFINITY) {
        let id = random_slot(svc)?;
        let backend = backend(id).ok_or(refused(stat::ERR_MISSING_ENTRY))?;
        return Ok(Choice {
            svc_id: svc.id,
            backend,
        });
    }

    let now = unsafe { bpf_ktime_get_ns() };
    let timeout_ns = svc.affinity_timeout_s as u64 * 1_000_000_000;
    // SAFETY: copied out at once.
    if let Some(prev) = unsafe { SVC_AFFINITY.get(client) }.copied() {
        if now.wrapping_sub(prev.last_used_ns) <= timeout_ns {
            // The agent purges entries whose backend left the service; a backend that is gone
            // altogether is caught here.
            if let Some(backend) = backend(prev.backend) {
                refresh(client, prev.backend, now);
                count(stat::AFFINITY_HIT);
                return Ok(Choice {
                    svc_id: svc.id,
                    backend,
                });
            }
        }
    }
    let id = random_slot(svc)?;
    let backend = backend(id).ok_or(refused(stat::ERR_MISSING_ENTRY))?;
    refresh(client, id, now);
    Ok(Choice {
        svc_id: svc.id,
        backend,
    })
}

#[inline(always)]
fn refresh(client: &AffinityKey, backend: BackendId, now: u64) {
    let value = AffinityValue {
        last_used_ns: now,
        backend,
        _pad0: 0,
    };
    // A lost update only costs stickiness, never the connection.
    let _ = SVC_AFFINITY.insert(client, &value, 0);
}
