//! The cgroup socket hooks: connect()/sendmsg() translate a frontend into a backend,
//! recvmsg()/getpeername() report the frontend again.

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use svc_common::{
    is_v4_mapped, stat, v4_mapped, AffinityKey, Backend, RevNatValue, ServiceKey, ServiceValue,
    SockRevKey, SockRevValue, AFFINITY_CLIENT_NETNS, ECONNREFUSED,
};

use crate::{
    lb,
    maps::{count, SVC_REV_NAT, SVC_SOCK_REV},
};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// An address as the maps hold it: 16 bytes (IPv4 mapped) and a port, both network order.
#[derive(Clone, Copy)]
struct SockAddr {
    addr: [u8; 16],
    port_be: u16,
}

#[inline(always)]
fn read_addr(ctx: &SockAddrContext, family: Family) -> SockAddr {
    let sa = ctx.sock_addr;
    // SAFETY: the kernel hands a valid bpf_sock_addr; each field is read with its own 4-byte
    // load, the only width the verifier accepts for user_ip6.
    unsafe {
        let addr = match family {
            Family::V4 => v4_mapped((*sa).user_ip4.to_ne_bytes()),
            Family::V6 => {
                let mut a = [0u8; 16];
                a[0..4].copy_from_slice(&(*sa).user_ip6[0].to_ne_bytes());
                a[4..8].copy_from_slice(&(*sa).user_ip6[1].to_ne_bytes());
                a[8..12].copy_from_slice(&(*sa).user_ip6[2].to_ne_bytes());
                a[12..16].copy_from_slice(&(*sa).user_ip6[3].to_ne_bytes());
                a
            }
        };
        SockAddr {
            addr,
            port_be: (*sa).user_port as u16,
        }
    }
}

/// `None` when the address cannot be expressed in the socket's family (an IPv6 backend for
/// an IPv4 socket); the agent never programs that, so it is treated as a missing entry.
#[inline(always)]
fn write_addr(ctx: &SockAddrContext, family: Family, to: &SockAddr) -> Option<()> {
    let sa = ctx.sock_addr;
    let a = &to.addr;
    // SAFETY: as in read_addr; writes are 4 bytes wide as the verifier requires.
    unsafe {
        match family {
            Family::V4 => {
                if !is_v4_mapped(a) {
                    return None;
                }
                (*sa).user_ip4 = u32::from_ne_bytes([a[12], a[13], a[14], a[15]]);
            }
            Family::V6 => {
                (*sa).user_ip6[0] = u32::from_ne_bytes([a[0], a[1], a[2], a[3]]);
                (*sa).user_ip6[1] = u32::from_ne_bytes([a[4], a[5], a[6], a[7]]);
                (*sa).user_ip6[2] = u32::from_ne_bytes([a[8], a[9], a[10], a[11]]);
                (*sa).user_ip6[3] = u32::from_ne_bytes([a[12], a[13], a[14], a[15]]);
            }
        }
        (*sa).user_port = to.port_be as u32;
    }
    Some(())
}

#[inline(always)]
fn protocol(ctx: &SockAddrContext) -> u8 {
    // SAFETY: readable field of bpf_sock_addr.
    unsafe { (*ctx.sock_addr).protocol as u8 }
}

#[inline(always)]
fn netns_client(ctx: &SockAddrContext, id: u32) -> AffinityKey {
    let cookie = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    let mut client = [0u8; 16];
    client[0..8].copy_from_slice(&cookie.to_ne_bytes());
    AffinityKey {
        client,
        id,
        kind: AFFINITY_CLIENT_NETNS,
        _pad0: [0; 3],
    }
}

/// connect() and sendmsg(): rewrite a frontend into a backend. `Err` carries the errno that
/// fails the call.
#[inline(always)]
pub fn try_forward(ctx: &SockAddrContext, family: Family) -> Result<(), i32> {
    let dst = read_addr(ctx, family);
    let key = ServiceKey {
        addr: dst.addr,
        port_be: dst.port_be,
        proto: protocol(ctx),
        scope: 0,
    };
    let mut svc = ServiceValue::default();
    match lb::lookup(&key, &mut svc) {
        lb::FOUND => {}
        lb::NOT_SERVICE => return Ok(()),
        refused => return Err(refuse(refused)),
    }
    let mut backend = Backend::default();
    let mut outcome = lb::choose(&svc, || netns_client(ctx, svc.id), &mut backend);
    if outcome == stat::ERR_MISSING_ENTRY {
        // The agent switched this frontend to a new generation between our two lookups (it
        // retires the old one only after a grace period, so this is rare): read it again once.
        count(stat::RETRIED_MISSING_ENTRY);
        outcome = match lb::lookup(&key, &mut svc) {
            lb::FOUND => lb::choose(&svc, || netns_client(ctx, svc.id), &mut backend),
            lb::NOT_SERVICE => return Ok(()),
            refused => refused,
        };
    }
    if outcome != lb::FOUND {
        return Err(refuse(outcome));
    }
    let to = SockAddr {
        addr: backend.addr,
        port_be: backend.port_be,
    };
    if write_addr(ctx, family, &to).is_none() {
        return Err(refuse(stat::ERR_MISSING_ENTRY));
    }
    remember(ctx, &to, &dst, svc.id);
    count(stat::TRANSLATED);
    Ok(())
}

/// Counts why a connection is refused; the caller sees ECONNREFUSED, as with kube-proxy's
/// REJECT.
#[inline(always)]
fn refuse(stat: u32) -> i32 {
    count(stat);
    ECONNREFUSED
}

#[inline(always)]
fn remember(ctx: &SockAddrContext, backend: &SockAddr, frontend: &SockAddr, id: u32) {
    let key = SockRevKey {
        cookie: unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) },
        addr: backend.addr,
        port_be: backend.port_be,
        _pad0: [0; 6],
    };
    let value = SockRevValue {
        addr: frontend.addr,
        port_be: frontend.port_be,
        _pad0: 0,
        id,
    };
    if SVC_SOCK_REV.insert(key, value, 0).is_err() {
        count(stat::ERR_SOCK_REV_UPDATE);
    }
}

/// recvmsg() and getpeername(): report the frontend the socket asked for, not the backend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, family: Family) {
    let src = read_addr(ctx, family);
    let key = SockRevKey {
        cookie: unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) },
        addr: src.addr,
        port_be: src.port_be,
        _pad0: [0; 6],
    };
    // SAFETY: copied out at once.
    let Some(rev) = (unsafe { SVC_SOCK_REV.get(key) }).copied() else {
        return;
    };
    // SAFETY: copied out at once.
    let Some(current) = (unsafe { SVC_REV_NAT.get(rev.id) }).copied() else {
        return;
    };
    if !same_frontend(&current, &rev) {
        return;
    }
    let to = SockAddr {
        addr: rev.addr,
        port_be: rev.port_be,
    };
    if write_addr(ctx, family, &to).is_some() {
        count(stat::REV_TRANSLATED);
    }
}

#[inline(always)]
fn same_frontend(current: &RevNatValue, rev: &SockRevValue) -> bool {
    current.addr == rev.addr && current.port_be == rev.port_be
}
