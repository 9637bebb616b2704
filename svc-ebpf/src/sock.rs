//! The cgroup socket hooks: connect()/sendmsg() translate a frontend into a backend,
//! recvmsg()/getpeername() report the frontend again, sock_release forgets the socket.

use core::ptr::read_volatile;

use aya_ebpf::{
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, generated::bpf_sk_storage_get},
    programs::{SockAddrContext, SockContext},
};
use svc_common::{
    is_v4_mapped, monitor_source, node_addr_flags, scope, v4_mapped, AffinityKey, Reason,
    RevNatValue, ServiceKey, ServiceValue, SockRevKey, SockRevValue, SockState, ECONNREFUSED,
    IPPROTO_TCP, IPPROTO_UDP, NODEPORT_ADDR_V4, NODEPORT_ADDR_V6,
};

use crate::{
    lb,
    maps::{count, count_service, SVC_CONFIG, SVC_REV_NAT, SVC_SOCK_REV, SVC_SOCK_STATE},
    monitor,
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

/// The socket hook as the decision's caller.
struct Hook<'a> {
    ctx: &'a SockAddrContext,
    /// sendmsg() on an unconnected UDP socket.
    sticky: bool,
}

impl lb::Caller for Hook<'_> {
    #[inline(always)]
    fn now(&self) -> u64 {
        lb::clock_ns()
    }

    #[inline(always)]
    fn cookie(&self) -> u64 {
        // SAFETY: the context is the kernel's bpf_sock_addr.
        unsafe { bpf_get_socket_cookie(self.ctx.sock_addr.cast()) }
    }

    #[inline(always)]
    fn affinity_client(&self, id: u32, v6: bool) -> AffinityKey {
        // SAFETY: as above.
        lb::netns_client(
            unsafe { bpf_get_netns_cookie(self.ctx.sock_addr.cast()) },
            id,
            v6,
        )
    }

    #[inline(always)]
    fn sticky(&self) -> bool {
        self.sticky
    }

    #[inline(always)]
    fn sock_state(&self) -> *mut SockState {
        // Zeroed on creation: no choice yet. Created only for a socket that sends to a
        // frontend, and freed with it.
        // SAFETY: the context's socket is the kernel's.
        unsafe { SVC_SOCK_STATE.get_or_insert_ptr_mut(self.ctx, None) }
    }
}

/// Which call asks for a translation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Connect,
    Sendmsg,
}

/// connect() and sendmsg(): rewrite a frontend into a backend. `Err` carries the errno that
/// fails the call.
#[inline(always)]
pub fn try_forward(ctx: &SockAddrContext, family: Family, call: Call) -> Result<(), i32> {
    let dst = read_addr(ctx, family);
    let proto = protocol(ctx);
    let mut key = ServiceKey {
        addr: dst.addr,
        port_be: dst.port_be,
        proto,
        scope: scope::CLUSTER,
    };
    let mut svc = ServiceValue::default();
    let source = match call {
        Call::Connect => monitor_source::CONNECT,
        Call::Sendmsg => monitor_source::SENDMSG,
    };
    match lb::resolve(&mut key, &mut svc, &Socket(ctx)) {
        lb::FOUND => {}
        lb::NOT_SERVICE => return Ok(()),
        refused => return Err(refuse_seen(ctx, refusal(refused), source, &dst, svc.id)),
    }
    let hook = Hook {
        ctx,
        sticky: call == Call::Sendmsg && proto == IPPROTO_UDP,
    };
    let mut decision = lb::Decision::default();
    match lb::decide_with(&key, svc, &hook, &mut decision) {
        lb::FOUND => {}
        lb::NOT_SERVICE => return Ok(()),
        refused => return Err(refuse_seen(ctx, refusal(refused), source, &dst, svc.id)),
    }
    let to = SockAddr {
        addr: decision.backend.addr,
        port_be: decision.backend.port_be,
    };
    if write_addr(ctx, family, &to).is_none() {
        return Err(refuse_seen(
            ctx,
            Reason::ErrMissingEntry,
            source,
            &dst,
            svc.id,
        ));
    }
    if monitor::listening() {
        monitor::emit_sock(
            ctx,
            monitor::sock_what(Reason::Translated, source, decision.how, decision.svc.id),
            &(dst.addr, dst.port_be),
            Some(&(to.addr, to.port_be)),
            decision.backend_id,
        );
    }
    // A connected socket's reverse entry is found at release through its peer; an
    // unconnected one's through the choices in its state.
    let tracked = call == Call::Connect || decision.recorded != 0;
    remember(ctx, &to, &dst, decision.svc.id, tracked);
    if decision.moved != 0 {
        // The entry for the backend the socket left stays, so a late reply from it still
        // reads as the ClusterIP; no choice names it any more.
        count(Reason::SockRevUntracked, 0);
    }
    count(Reason::Translated, 0);
    count_service(Reason::Translated, decision.svc.id);
    Ok(())
}

/// The socket hooks' `lb::Via`: a NodePort reached through a node address (nodeIP:nodePort)
/// is found under its wildcard key, as kube-proxy serves it to local clients; through a
/// loopback address (localhost NodePorts) only for a socket of the node's own network
/// namespace.
struct Socket<'a>(&'a SockAddrContext);

impl lb::Via for Socket<'_> {
    #[inline(always)]
    fn own_key(&self) -> bool {
        true
    }

    #[inline(always)]
    fn node_flags(&self, addr: &[u8; 16]) -> u32 {
        let node = lb::node_addr_flags(addr);
        if is_v4_loopback(addr) && localhost_answers(self.0, node) {
            return node | node_addr_flags::NODEPORT;
        }
        node
    }
}

/// Whether `a` is in 127.0.0.0/8 (IPv4, mapped).
#[inline(always)]
fn is_v4_loopback(a: &[u8; 16]) -> bool {
    is_v4_mapped(a) && a[12] == 127
}

/// Whether a loopback destination with `NODE_ADDRS` flags `node` answers NodePorts for this
/// socket: the address is `LOCALHOST` (or all of 127.0.0.0/8 does,
/// `DatapathConfig::localhost_net`), and the socket lives in the node's network namespace,
/// as the agent wrote it.
#[inline(always)]
fn localhost_answers(ctx: &SockAddrContext, node: u32) -> bool {
    let Some(c) = SVC_CONFIG.get(0) else {
        return false;
    };
    let named = node & node_addr_flags::LOCALHOST != 0 || (node == 0 && c.localhost_net != 0);
    let host = c.host_netns_cookie();
    // SAFETY: the context is the kernel's bpf_sock_addr.
    named && host != 0 && host == unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) }
}

/// Counts why a connection is refused; the caller sees ECONNREFUSED, as with kube-proxy's
/// REJECT.
#[inline(always)]
fn refuse(reason: Reason) -> i32 {
    count(reason, 0);
    ECONNREFUSED
}

/// `refuse`, and the monitor told (frontend `id`, 0 if none) if one listens.
#[inline(always)]
fn refuse_seen(ctx: &SockAddrContext, reason: Reason, source: u8, dst: &SockAddr, id: u32) -> i32 {
    if monitor::listening() {
        monitor::emit_sock(
            ctx,
            monitor::sock_what(reason, source, 0, id),
            &(dst.addr, dst.port_be),
            None,
            0,
        );
    }
    count_service(reason, id);
    refuse(reason)
}

/// The reason a socket hook counts for a refusing `outcome`.
#[inline(always)]
fn refusal(outcome: lb::Outcome) -> Reason {
    match outcome {
        lb::Outcome::NoPort => Reason::RefusedNoPort,
        lb::Outcome::NoBackend => Reason::RefusedNoBackend,
        _ => Reason::ErrMissingEntry,
    }
}

/// Records which frontend the socket meant when it reached `backend`. Looked up first: an
/// unconnected socket sends many datagrams through one entry, and a write per datagram would
/// cost more than the lookup.
#[inline(always)]
fn remember(
    ctx: &SockAddrContext,
    backend: &SockAddr,
    frontend: &SockAddr,
    id: u32,
    tracked: bool,
) {
    let key = SockRevKey {
        // SAFETY: the context is the kernel's bpf_sock_addr.
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
    // SAFETY: compared at once.
    if unsafe { SVC_SOCK_REV.get(key) }.is_some_and(|v| *v == value) {
        return;
    }
    if SVC_SOCK_REV.insert(key, value, 0).is_err() {
        count(Reason::ErrSockRevUpdate, 0);
    } else if !tracked {
        count(Reason::SockRevUntracked, 0);
    }
}

/// recvmsg() and getpeername(): report the frontend the socket asked for, not the backend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, family: Family) {
    let src = read_addr(ctx, family);
    let key = SockRevKey {
        // SAFETY: the context is the kernel's bpf_sock_addr.
        cookie: unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) },
        addr: src.addr,
        port_be: src.port_be,
        _pad0: [0; 6],
    };
    // SAFETY: copied out at once.
    let to = match unsafe { SVC_SOCK_REV.get(key) }.copied() {
        Some(rev) => {
            // SAFETY: copied out at once.
            let Some(current) = (unsafe { SVC_REV_NAT.get(rev.id) }).copied() else {
                return;
            };
            if !same_frontend(&current, &rev) {
                return;
            }
            // What the socket asked for: for a NodePort, the node address it used (the
            // frontend's own entry holds only the wildcard).
            RevNatValue {
                addr: rev.addr,
                port_be: rev.port_be,
                ..current
            }
        }
        // Not there (evicted, or its write failed): an unconnected socket's own state still
        // says which frontend it reached this backend through, so the reply never shows an
        // address the application did not send to.
        None => {
            let id = chosen_for(ctx, &src);
            if id == 0 {
                return;
            }
            // SAFETY: copied out at once.
            match unsafe { SVC_REV_NAT.get(id) } {
                // A NodePort's entry does not say which node address the socket used.
                Some(frontend) if is_nodeport_wildcard(&frontend.addr) => return,
                Some(frontend) => *frontend,
                None => return,
            }
        }
    };
    let to = SockAddr {
        addr: to.addr,
        port_be: to.port_be,
    };
    if write_addr(ctx, family, &to).is_some() {
        count(Reason::RevTranslated, 0);
        if monitor::listening() {
            monitor::emit_sock(
                ctx,
                monitor::sock_what(Reason::RevTranslated, monitor_source::REVERSE, 0, 0),
                &(src.addr, src.port_be),
                Some(&(to.addr, to.port_be)),
                0,
            );
        }
    }
}

/// The frontend id of the socket's remembered choice for backend `src`; 0 if none.
#[inline(always)]
fn chosen_for(ctx: &SockAddrContext, src: &SockAddr) -> u32 {
    // SAFETY: the context's socket is the kernel's; no state is created here.
    let state = unsafe { SVC_SOCK_STATE.get_ptr_mut(ctx) };
    if state.is_null() {
        return 0;
    }
    // SAFETY: checked non-null; read only.
    for c in unsafe { (*state).choices.iter() } {
        if c.id != 0 && c.addr == src.addr && c.port_be == src.port_be {
            return c.id;
        }
    }
    0
}

/// Whether the frontend `rev` remembers is still the one its id names (ids are reused). A
/// NodePort's entry holds its wildcard key address, while `rev` holds the node address the
/// socket connected to: any address of the same family matches it.
#[inline(always)]
fn same_frontend(current: &RevNatValue, rev: &SockRevValue) -> bool {
    if current.port_be != rev.port_be {
        return false;
    }
    current.addr == rev.addr
        || (current.addr == NODEPORT_ADDR_V4 && is_v4_mapped(&rev.addr))
        || (current.addr == NODEPORT_ADDR_V6 && !is_v4_mapped(&rev.addr))
}

#[inline(always)]
fn is_nodeport_wildcard(a: &[u8; 16]) -> bool {
    *a == NODEPORT_ADDR_V4 || *a == NODEPORT_ADDR_V6
}

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// sock_release: delete the socket's reverse entries, so the LRU map holds live sockets only
/// (and never evicts one of theirs for a closed socket's). A connected socket's entry is
/// keyed by its peer; an unconnected UDP socket's by the choices in its state.
#[inline(always)]
pub fn release(ctx: &SockContext) {
    let sk = ctx.sock;
    // SAFETY: the kernel's bpf_sock; each field is a single load.
    let (family, proto) = unsafe { ((*sk).family, (*sk).protocol) };
    if proto != IPPROTO_TCP as u32 && proto != IPPROTO_UDP as u32 {
        return;
    }
    // SAFETY: as above.
    let cookie = unsafe { bpf_get_socket_cookie(sk.cast()) };
    // SAFETY: as above.
    let dst_port = unsafe { (*sk).dst_port };
    if dst_port != 0 {
        // Both families' fields are read (volatile: unconditionally, each at its own constant
        // offset), then one is picked: LLVM otherwise moves the loads into the branches and
        // shares one at a computed offset, which the verifier refuses for a context.
        // SAFETY: fields of the kernel's bpf_sock, each a 4-byte load.
        let (ip4, ip6) = unsafe {
            (
                read_volatile(&(*sk).dst_ip4),
                [
                    read_volatile(&(*sk).dst_ip6[0]),
                    read_volatile(&(*sk).dst_ip6[1]),
                    read_volatile(&(*sk).dst_ip6[2]),
                    read_volatile(&(*sk).dst_ip6[3]),
                ],
            )
        };
        let addr = match family {
            AF_INET => v4_mapped(ip4.to_ne_bytes()),
            AF_INET6 => {
                let mut a = [0u8; 16];
                a[0..4].copy_from_slice(&ip6[0].to_ne_bytes());
                a[4..8].copy_from_slice(&ip6[1].to_ne_bytes());
                a[8..12].copy_from_slice(&ip6[2].to_ne_bytes());
                a[12..16].copy_from_slice(&ip6[3].to_ne_bytes());
                a
            }
            _ => return,
        };
        forget(cookie, addr, dst_port);
    }
    let map = core::ptr::from_ref(&SVC_SOCK_STATE).cast_mut().cast();
    // SAFETY: the helper takes the program's context as the socket; no state is created.
    let state: *mut SockState =
        unsafe { bpf_sk_storage_get(map, sk.cast(), core::ptr::null_mut(), 0) }.cast();
    if state.is_null() {
        return;
    }
    // SAFETY: checked non-null; the socket is being released, nobody else writes it.
    for c in unsafe { (*state).choices.iter() } {
        if c.id != 0 {
            forget(cookie, c.addr, c.port_be);
        }
    }
}

#[inline(always)]
fn forget(cookie: u64, addr: [u8; 16], port_be: u16) {
    let key = SockRevKey {
        cookie,
        addr,
        port_be,
        _pad0: [0; 6],
    };
    if SVC_SOCK_REV.remove(key).is_ok() {
        count(Reason::SockRevReleased, 0);
    }
}
