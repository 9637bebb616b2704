//! Ending UDP flows and closing connected UDP sockets whose backend no longer serves the
//! frontend they were translated for.
//!
//! # Which ones
//! Stateless, as kube-proxy's CleanStaleEntries: [`UdpServing`] says, per UDP frontend id,
//! which backends serve it now (kube-proxy's serving endpoints), and every flow of the packet
//! datapath and every connected UDP socket svc translated is judged by it, whoever saw the
//! backend leave: after the first full sync of a run, what left while no agent ran (or after a
//! sync whose cleanup a crash cut short) goes too.
//!
//! Only sockets svc translated, and only for the Service the backend left: the connect hook
//! records every translation in `SVC_SOCK_REV` (socket cookie + backend → frontend id), so a
//! connected socket is closed only when the frontend that entry names is gone or no longer
//! served by the socket's peer. A socket connected to the pod's address directly has no entry
//! and is never touched; a socket translated for Service T survives when its backend leaves
//! only Service S. A socket whose entry is gone (evicted from the LRU map) is left alone
//! rather than guessed about.
//!
//! # Off the sync path
//! The namespace walk takes a millisecond or more per namespace, the connection-tracking walk
//! reads the whole map: they run on a thread of their own ([`StaleWorker`]), woken through a
//! channel, so a sync never waits for them; requests that come while they run are merged
//! into the next run.
//!
//! The cgroup `connect4/6` hooks translate a ClusterIP:port to one backend when the application
//! calls `connect()`; from then on the kernel sends every datagram of that socket straight to
//! the backend, and no hook runs again. A long-lived connected UDP socket (a resolver talking to
//! CoreDNS, a statsd client, ...) therefore keeps sending to a backend that is gone, forever,
//! because UDP has no connection that could fail on its own. This module closes such sockets
//! from the outside so the application notices and reconnects — and the reconnect runs through
//! the hook again, which picks a live backend.
//!
//! # Mechanism
//! `SOCK_DESTROY` over `NETLINK_SOCK_DIAG` (what `ss -K` does; needs CONFIG_INET_DIAG_DESTROY).
//! sock_diag only sees the network namespace the netlink socket was created in, so for every
//! network namespace with a process in the given cgroup tree, a short-lived OS thread joins
//! that namespace with `setns(2)`, dumps the connected UDP sockets of both families, and
//! destroys the stale ones. The thread exists only so the agent's other threads stay in the
//! host namespace; it exits afterwards, taking its namespace with it.
//!
//! # What the application sees (kernel 6.18, observed by `tests/stale_udp.rs`)
//! The kernel's `udp_abort()` records `ECONNABORTED` as the socket's pending error, wakes its
//! waiters and disconnects it (peer cleared; an auto-bound local port is released). So:
//! - a `recv()` blocked on the socket returns at once with `ECONNABORTED` (errno 103), and so
//!   does the next `recv()` — once, as with any pending socket error (by the kernel source,
//!   `SO_ERROR` and `poll()`'s `POLLERR` show it too; the test does not exercise those);
//! - `send()` fails with `EDESTADDRREQ` (89, "Destination address required") from the first call
//!   on, every time, because the socket is no longer connected — note that it is *not*
//!   `ECONNABORTED`: `udp_sendmsg` checks the connected state before the pending error;
//! - datagrams that were already queued on the socket stay readable (the abort does not purge
//!   the receive queue: the test saw a reply that was in flight at the destroy returned by the
//!   `recv()` after the `ECONNABORTED` one); after that `recv()` only times out, as nothing
//!   can reach the unhashed socket any more.
//!
//! So an application cannot keep talking to the old backend: it has to `connect()` again
//! (same socket or a new one), and that goes through the connect hook, which picks a live
//! backend. In the test every affected socket failed within a few tens of milliseconds of the
//! call, which itself took under a millisecond.
//!
//! # Privileges (measured by `tests/tests/privileges.rs`)
//! - the host PID namespace: `cgroup.procs` shows 0 for a process outside the reader's, so an
//!   agent in a PID namespace of its own finds no pod (reported as an error, not silently);
//! - `CAP_SYS_PTRACE` to open `/proc/<pid>/ns/net` of a process of another user or with
//!   capabilities the agent lacks (any root container with the runtime's default set);
//! - `CAP_SYS_ADMIN` for `setns`;
//! - `CAP_NET_ADMIN` for `SOCK_DESTROY` (checked in the socket's namespace; `CAP_SYS_ADMIN`
//!   does not stand in for it).
//!
//! Each missing one shows as a warning per walk (the first sync of a run, and every sync that
//! may have left a UDP flow or socket stale), and the socket stays.
//!
//! # Limits
//! - Only sockets of namespaces that currently have a process in the cgroup tree are found. A
//!   socket created in one namespace and used by a process that moved to another (or received
//!   over a Unix socket) lives in its creator's namespace and is missed when no process of the
//!   cgroup tree is left there.
//! - UDP-Lite and unconnected sockets (which are translated per `sendmsg()` anyway) are not
//!   touched.
//! - The kernel finds the socket to destroy by a 4-tuple lookup and then checks the cookie. Should
//!   the lookup return another socket with the same 4-tuple (only possible with `SO_REUSEADDR`
//!   or `SO_REUSEPORT` on the client side), the kernel answers `ENOENT` and the socket is
//!   counted as already gone, not destroyed.
//! - Sockets are closed, not moved to a live backend: the application has to reconnect.
//! - Namespaces are handled one after another (about a millisecond each in the test).

use crate::{Error, Result};
use std::{
    collections::HashMap,
    fmt, fs, io,
    net::{IpAddr, SocketAddr},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
    time::Duration,
};

use netlink_packet_core::{Parseable, NLMSG_DONE, NLMSG_ERROR, NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_sock_diag::{
    inet::{ExtensionFlags, InetRequest, InetResponseHeader, SocketId, StateFlags},
    SockDiagDestroy, SockDiagMessage, SOCK_DIAG_BY_FAMILY,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket};

use crate::netlink::Messages;

/// A receive that takes this long means the kernel is not answering; better an error than an
/// agent thread stuck in a namespace.
const RECV_TIMEOUT: Duration = Duration::from_secs(1);
/// A dump part is at most 32 KiB (netlink caps its dump buffers there); twice that leaves room.
const RECV_BUF: usize = 64 * 1024;

/// A network namespace, as `ls -l /proc/PID/ns/net` identifies it (nsfs device and inode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl fmt::Display for NetnsId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "net:[{}]", self.ino)
    }
}

/// One socket that was destroyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestroyedSocket {
    pub netns: NetnsId,
    pub local: SocketAddr,
    /// The backend it was connected to (as the kernel reports it; a v6 socket connected to a
    /// v4 backend shows `::ffff:a.b.c.d`).
    pub remote: SocketAddr,
    /// The kernel's socket cookie, as `bpf_get_socket_cookie` and `ss -e` show it.
    pub cookie: u64,
}

/// What [`destroy_udp_sockets`] did. Failures confined to one namespace land in `errors` so the
/// other namespaces are still handled.
#[derive(Debug, Default)]
pub struct DestroyReport {
    /// Network namespaces searched.
    pub namespaces: usize,
    pub sockets: Vec<DestroyedSocket>,
    pub errors: Vec<Error>,
}

impl DestroyReport {
    /// How many sockets were destroyed.
    pub fn destroyed(&self) -> usize {
        self.sockets.len()
    }
}

/// Closes the connected UDP sockets that `doomed` picks (given the socket's cookie and its peer,
/// a v4-mapped peer as the IPv4 address it is), in every network namespace that has a process
/// in `cgroup` (recursively, including child cgroups). Errors name the namespace/cgroup; one
/// failing netns does not stop others.
///
/// The call is an `Err` only when `cgroup` itself cannot be read; everything after that is
/// reported per namespace or per cgroup in [`DestroyReport::errors`].
pub fn destroy_udp_sockets(
    cgroup: &Path,
    doomed: &(dyn Fn(u64, SocketAddr) -> bool + Sync),
) -> Result<DestroyReport> {
    let mut report = DestroyReport::default();
    let namespaces = cgroup_namespaces(cgroup, &mut report.errors)?;
    report.namespaces = namespaces.len();
    for ns in &namespaces {
        let outcome = in_netns(ns, |diag| diag.destroy_connected(doomed));
        let describe = |message: String| Error::Netns {
            netns: format!("{} (pid {}, cgroup {})", ns.id, ns.pid, ns.cgroup.display()),
            message,
        };
        match outcome {
            Ok(out) => {
                report
                    .sockets
                    .extend(out.destroyed.into_iter().map(|(local, remote, cookie)| {
                        DestroyedSocket {
                            netns: ns.id,
                            local,
                            remote,
                            cookie,
                        }
                    }));
                report.errors.extend(out.errors.into_iter().map(describe));
            }
            Err(message) => report.errors.push(describe(message)),
        }
    }
    Ok(report)
}

/// Runs stale-socket work on a thread of its own: [`StaleWorker::submit`] never blocks, and
/// what is submitted while a run is under way is merged into the next run.
pub struct StaleWorker<J: Send + 'static> {
    tx: Option<std::sync::mpsc::Sender<Vec<J>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<J: Send + 'static> StaleWorker<J> {
    /// Starts the thread; `run` gets each batch of work.
    pub fn spawn(mut run: impl FnMut(Vec<J>) + Send + 'static) -> io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<J>>();
        let thread = std::thread::Builder::new()
            .name("svc-stale-udp".into())
            .spawn(move || {
                while let Ok(mut batch) = rx.recv() {
                    while let Ok(more) = rx.try_recv() {
                        batch.extend(more);
                    }
                    run(batch);
                }
            })?;
        Ok(StaleWorker {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues `work`; returns at once.
    pub fn submit(&self, work: Vec<J>) {
        if work.is_empty() {
            return;
        }
        if let Some(tx) = &self.tx {
            // The thread only ends when we drop the sender, so this cannot fail but in a
            // panic of `run`, after which nothing is closed any more.
            let _ = tx.send(work);
        }
    }
}

impl<J: Send + 'static> Drop for StaleWorker<J> {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has finished what it has.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A network namespace held open through its nsfs file, so it stays valid (and cannot be
/// replaced by another namespace with a recycled pid) after the process that showed it exits.
struct Netns {
    id: NetnsId,
    fd: OwnedFd,
    /// The process and cgroup that showed it, for error messages.
    pid: u32,
    cgroup: PathBuf,
}

/// Network namespaces of all processes in `root` and its descendant cgroups, one per namespace.
fn cgroup_namespaces(root: &Path, errors: &mut Vec<Error>) -> Result<Vec<Netns>> {
    let mut found: HashMap<NetnsId, Netns> = HashMap::new();
    // cgroup.procs shows 0 for a process outside the reader's PID namespace.
    let mut hidden = 0usize;
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let is_root = dir == root;
        let procs = dir.join("cgroup.procs");
        let text = match fs::read_to_string(&procs) {
            Ok(t) => t,
            Err(source) => {
                let e = Error::Io {
                    path: procs,
                    source,
                };
                if is_root {
                    return Err(e);
                }
                // A child cgroup removed while we walk (pod deleted) is not an error.
                if !is_not_found(&e) {
                    errors.push(e);
                }
                continue;
            }
        };
        for line in text.lines() {
            let Ok(pid) = line.trim().parse::<u32>() else {
                errors.push(Error::Invalid {
                    object: procs.display().to_string(),
                    message: format!("not a pid: {line:?}"),
                });
                continue;
            };
            if pid == 0 {
                hidden += 1;
                continue;
            }
            match open_netns(pid, &found) {
                Ok(Some((id, fd))) => {
                    found.insert(
                        id,
                        Netns {
                            id,
                            fd,
                            pid,
                            cgroup: dir.clone(),
                        },
                    );
                }
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        match fs::read_dir(&dir) {
            Ok(entries) => {
                for entry in entries.flatten() {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        pending.push(entry.path());
                    }
                }
            }
            Err(source) => {
                let e = Error::Io { path: dir, source };
                if !is_not_found(&e) {
                    errors.push(e);
                }
            }
        }
    }
    if hidden > 0 {
        // Without this, an agent in a PID namespace of its own would find no socket, silently.
        errors.push(Error::Netns {
            netns: format!("of {hidden} processes in {}", root.display()),
            message: "not found: the processes are outside the agent's PID namespace \
                      (run the agent in the host's: hostPID)"
                .into(),
        });
    }
    Ok(found.into_values().collect())
}

fn is_not_found(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

/// Opens the network namespace of `pid` unless it is one of `known`. `None` when the process
/// is gone (or a zombie, whose namespaces are no longer reachable) or its namespace is known.
fn open_netns(pid: u32, known: &HashMap<NetnsId, Netns>) -> Result<Option<(NetnsId, OwnedFd)>> {
    let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
    let gone = |e: &io::Error| {
        e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
    };
    let io_err = |path: &Path, source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    // stat first: most pods have several processes in one namespace, and a stat is cheaper than
    // an open plus a close.
    match fs::metadata(&path) {
        Ok(m)
            if known.contains_key(&NetnsId {
                dev: m.dev(),
                ino: m.ino(),
            }) =>
        {
            return Ok(None)
        }
        Ok(_) => {}
        Err(e) if gone(&e) => return Ok(None),
        Err(e) => return Err(io_err(&path, e)),
    }
    let file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if gone(&e) => return Ok(None),
        Err(e) => return Err(io_err(&path, e)),
    };
    // The pid may have been reused between stat and open: identify what we actually hold.
    let m = file.metadata().map_err(|e| io_err(&path, e))?;
    let id = NetnsId {
        dev: m.dev(),
        ino: m.ino(),
    };
    if known.contains_key(&id) {
        return Ok(None);
    }
    Ok(Some((id, OwnedFd::from(file))))
}

/// Runs `f` with a sock_diag socket of namespace `ns`, on a thread of its own that joins the
/// namespace and then exits, so no other thread of the agent changes namespace.
fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce(&mut SockDiag) -> T + Send) -> Result<T, String> {
    std::thread::scope(|s| {
        let handle = std::thread::Builder::new()
            .name("svc-sockdestroy".into())
            .spawn_scoped(s, || {
                // SAFETY: setns only reads the descriptor, which `ns` keeps open for the whole
                // scope. It changes the namespace of this thread alone (CLONE_NEWNET is allowed
                // in a multithreaded process), and the thread ends when this closure returns.
                if unsafe { libc::setns(ns.fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    // Never fall through to the dump: it would run in the host namespace.
                    return Err(format!("setns: {}", io::Error::last_os_error()));
                }
                let mut diag = SockDiag::open().map_err(|e| format!("sock_diag socket: {e}"))?;
                Ok(f(&mut diag))
            })
            .map_err(|e| format!("spawning a thread: {e}"))?;
        handle
            .join()
            .map_err(|_| "the namespace thread panicked".to_string())?
    })
}

/// Result of the work in one namespace: what was destroyed, and per-socket failures.
#[derive(Debug, Default)]
struct NsOutcome {
    destroyed: Vec<(SocketAddr, SocketAddr, u64)>,
    errors: Vec<String>,
}

/// A UDP socket as a sock_diag dump reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct UdpSock {
    family: u8,
    /// The `inet_diag_sockid` as the dump reported it, echoed back in `SOCK_DESTROY` so the
    /// kernel finds exactly this socket (its cookie included). The kernel zeroes an IPv4
    /// address's unused twelve bytes, which is what the crate's encoder sends there too.
    id: SocketId,
    local: SocketAddr,
    remote: SocketAddr,
    cookie: u64,
}

impl UdpSock {
    /// The peer as the connect hook chose it: a v6 socket connected to `::ffff:a.b.c.d` talks
    /// to the v4 backend a.b.c.d.
    fn peer(&self) -> (IpAddr, u16) {
        (self.remote.ip().to_canonical(), self.remote.port())
    }
}

/// A `NETLINK_SOCK_DIAG` socket, in the namespace of the thread that opened it.
struct SockDiag {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl SockDiag {
    fn open() -> io::Result<Self> {
        let socket = Socket::new(NETLINK_SOCK_DIAG)?;
        socket2::SockRef::from(&socket).set_read_timeout(Some(RECV_TIMEOUT))?;
        Ok(SockDiag {
            socket,
            seq: 0,
            buf: vec![0; RECV_BUF],
        })
    }

    fn destroy_connected(
        &mut self,
        doomed: &(dyn Fn(u64, SocketAddr) -> bool + Sync),
    ) -> NsOutcome {
        let mut out = NsOutcome::default();
        let mut matches = Vec::new();
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            match self.dump_udp(family) {
                Ok(socks) => matches.extend(socks.into_iter().filter(|s| {
                    let (ip, port) = s.peer();
                    doomed(s.cookie, SocketAddr::new(ip, port))
                })),
                Err(e) => out.errors.push(format!(
                    "dumping UDP sockets ({}): {e}",
                    family_name(family)
                )),
            }
        }
        for sock in matches {
            match self.destroy(&sock) {
                Ok(true) => out.destroyed.push((sock.local, sock.remote, sock.cookie)),
                // Closed by its owner between dump and destroy: nothing left to do.
                Ok(false) => {}
                Err(e) => out.errors.push(format!(
                    "SOCK_DESTROY {} -> {} (cookie {}): {e}",
                    sock.local, sock.remote, sock.cookie
                )),
            }
        }
        out
    }

    /// All connected UDP sockets of one family.
    fn dump_udp(&mut self, family: u8) -> io::Result<Vec<UdpSock>> {
        let seq = self.next_seq();
        self.send(&dump_request(family, seq))?;
        let mut socks = Vec::new();
        loop {
            let n = self.recv()?;
            for msg in Messages::new(&self.buf[..n]) {
                let msg = msg?;
                if msg.seq != seq {
                    continue; // a late answer to an earlier request
                }
                match msg.kind {
                    SOCK_DIAG_BY_FAMILY => {
                        if let Some(s) = udp_sock(msg.payload())? {
                            socks.push(s);
                        }
                    }
                    NLMSG_DONE => {
                        // The payload is the dump's status: 0 or a negative errno.
                        return match msg.done_code() {
                            code if code < 0 => Err(io::Error::from_raw_os_error(-code)),
                            _ => Ok(socks),
                        };
                    }
                    NLMSG_ERROR => {
                        let code = msg.error_code()?;
                        return Err(io::Error::from_raw_os_error(if code < 0 {
                            -code
                        } else {
                            libc::EPROTO
                        }));
                    }
                    _ => {}
                }
            }
        }
    }

    /// Destroys one socket. `Ok(false)` when the kernel no longer has it.
    fn destroy(&mut self, sock: &UdpSock) -> io::Result<bool> {
        let seq = self.next_seq();
        self.send(&destroy_request(sock, seq))?;
        loop {
            let n = self.recv()?;
            for msg in Messages::new(&self.buf[..n]) {
                let msg = msg?;
                if msg.seq != seq || msg.kind != NLMSG_ERROR {
                    continue;
                }
                return match msg.error_code()? {
                    0 => Ok(true),
                    e if e == -libc::ENOENT => Ok(false),
                    e if e < 0 => Err(io::Error::from_raw_os_error(-e)),
                    e => Err(io::Error::other(format!("positive netlink error {e}"))),
                };
            }
        }
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // An unconnected netlink socket sends to the kernel (port 0) without an address.
        let n = self.socket.send(msg, 0)?;
        if n != msg.len() {
            return Err(io::Error::other("short netlink send"));
        }
        Ok(())
    }

    fn recv(&mut self) -> io::Result<usize> {
        loop {
            // MSG_TRUNC makes recv return the real length, so a datagram larger than the
            // buffer is detected instead of parsed cut short.
            let n = match self.socket.recv(&mut &mut self.buf[..], libc::MSG_TRUNC) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no netlink reply within {RECV_TIMEOUT:?}"),
                    ));
                }
                Err(e) => return Err(e),
            };
            if n > self.buf.len() {
                return Err(io::Error::other(format!(
                    "netlink datagram of {n} bytes does not fit the {} byte buffer",
                    self.buf.len()
                )));
            }
            return Ok(n);
        }
    }
}

/// The dump of one family's connected UDP sockets.
fn dump_request(family: u8, seq: u32) -> Vec<u8> {
    let socket_id = if family == libc::AF_INET as u8 {
        SocketId::new_v4()
    } else {
        SocketId::new_v6()
    };
    let req = InetRequest {
        family,
        protocol: libc::IPPROTO_UDP as u8,
        extensions: ExtensionFlags::empty(),
        // A connected UDP socket is in `TCP_ESTABLISHED`; unconnected ones are in `TCP_CLOSE`.
        states: StateFlags::ESTABLISHED,
        socket_id,
    };
    crate::netlink::request(SockDiagMessage::InetRequest(req), NLM_F_DUMP, seq)
}

/// `SOCK_DESTROY` of one socket as the dump reported it.
fn destroy_request(sock: &UdpSock, seq: u32) -> Vec<u8> {
    let req = InetRequest {
        family: sock.family,
        protocol: libc::IPPROTO_UDP as u8,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::from_bits_retain(u32::MAX),
        socket_id: sock.id.clone(),
    };
    let msg = SockDiagDestroy::new(SockDiagMessage::InetRequest(req));
    crate::netlink::request(msg, NLM_F_ACK, seq)
}

fn family_name(family: u8) -> &'static str {
    if family == libc::AF_INET as u8 {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// A connected socket from an `inet_diag_msg`; `None` for an unconnected one (the state filter
/// should leave none, but a zero peer can never be a backend). The attributes after the
/// message are not read: nothing here needs them.
fn udp_sock(p: &[u8]) -> io::Result<Option<UdpSock>> {
    let h = InetResponseHeader::parse(p).map_err(crate::netlink::malformed)?;
    let id = h.socket_id;
    if id.destination_port == 0 || id.destination_address.is_unspecified() {
        return Ok(None);
    }
    // The cookie is two host-order u32s, low word first (sock_diag_save_cookie).
    let c = id.cookie;
    let cookie = u64::from(u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        | (u64::from(u32::from_ne_bytes([c[4], c[5], c[6], c[7]])) << 32);
    Ok(Some(UdpSock {
        family: h.family,
        local: SocketAddr::new(id.source_address, id.source_port),
        remote: SocketAddr::new(id.destination_address, id.destination_port),
        cookie,
        id,
    }))
}

/// The packet datapath's UDP flows (`SVC_CT`: NodePorts, ExternalIPs, LoadBalancer IPs, and
/// per-packet ClusterIP on pod devices) that `doomed(frontend id, backend)` picks: their
/// entries are removed, so the client's next datagram starts a new flow to a live backend, as
/// kube-proxy deletes the conntrack entries of UDP flows to an endpoint that no longer serves.
/// A client that keeps sending on one socket would otherwise keep its flow, and its old
/// backend, for as long as it sends. `doomed` is asked again right before a flow goes, so a
/// backend that came back during the walk keeps its flows. Returns how many flows were
/// removed.
pub fn forget_udp_flows(
    ct: &mut aya::maps::HashMap<aya::maps::MapData, svc_common::CtKey, svc_common::CtValue>,
    doomed: impl Fn(u32, std::net::SocketAddr) -> bool,
) -> Result<usize> {
    use aya::maps::IterableMap;
    use std::os::fd::AsFd;
    use svc_common::{ct_dir, map_names, CtKey, CtValue, IPPROTO_UDP};
    let mut flows: Vec<(CtKey, CtKey, u32, SocketAddr)> = Vec::new();
    crate::sys::for_each_hash::<CtKey, CtValue>(ct.map().fd().as_fd(), |k, v| {
        // A FORWARD entry whose REPLY entry is gone (an agent killed between the two removals)
        // is found here like any other.
        if k.dir != ct_dir::FORWARD || k.proto != IPPROTO_UDP {
            return;
        }
        let backend = SocketAddr::new(
            crate::reconcile::ip_from16(v.nat_addr).to_canonical(),
            u16::from_be(v.nat_port_be),
        );
        if doomed(v.id, backend) {
            flows.push((*k, k.partner(v), v.id, backend));
        }
    })
    .map_err(|e| Error::map_io(map_names::CT, format!("reading the UDP flows: {e}"), &e))?;
    let mut removed = 0;
    for (k, pk, id, backend) in &flows {
        if !doomed(*id, *backend) {
            continue;
        }
        // The reply entry first, and only while it is still this flow's (its tuple may have
        // gone to a newer flow): the datapath forgets a flow in the same order.
        if ct.get(pk, 0).is_ok_and(|pv| pk.partner(&pv) == *k) {
            let _ = ct.remove(pk);
        }
        let _ = ct.remove(k);
        removed += 1;
    }
    Ok(removed)
}

/// What the UDP flows and connected UDP sockets svc translated may go on with: per UDP
/// frontend id, the backends that serve it. kube-proxy's rule (CleanStaleEntries): a UDP flow
/// to a Service address is stale when it is not DNATed to one of the serving endpoints of that
/// Service port; traffic policies, topology and terminating states do not count, so a
/// terminating endpoint that still serves keeps its flows. A flow of a frontend that is gone
/// is stale too. It is the agent's state as it is, not a list of what left: a restarted agent
/// judges the flows and sockets of its predecessor's time by it as well.
///
/// Kept up to date by the sync, read by the stale-UDP thread.
#[derive(Debug, Default)]
pub struct UdpServing {
    by_id: HashMap<u32, Keep>,
    /// The id each frontend in `by_id` has, to find the entry of a frontend that was removed.
    ids: HashMap<crate::model::Frontend, u32>,
}

/// What one UDP frontend's flows and sockets may keep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Its Service is not programmed as desired (its sync failed, and is retried): the
    /// datapath may still choose any backend it had, so none is judged.
    Any,
    /// The addresses that serve it, sorted.
    Only(std::sync::Arc<Vec<SocketAddr>>),
}

impl Keep {
    /// Whether what `self` keeps includes all that `old` kept.
    fn covers(&self, old: &Keep) -> bool {
        match (self, old) {
            (Keep::Any, _) => true,
            (Keep::Only(_), Keep::Any) => false,
            (Keep::Only(new), Keep::Only(old)) => {
                std::sync::Arc::ptr_eq(new, old) || old.iter().all(|b| new.binary_search(b).is_ok())
            }
        }
    }
}

impl UdpServing {
    /// Whether a flow or socket that frontend `id` translated to `backend` must end.
    pub fn stale(&self, id: u32, backend: SocketAddr) -> bool {
        let backend = SocketAddr::new(backend.ip().to_canonical(), backend.port());
        match self.by_id.get(&id) {
            None => true,
            Some(Keep::Any) => false,
            Some(Keep::Only(serving)) => serving.binary_search(&backend).is_err(),
        }
    }

    /// Sets what UDP frontend `fe` keeps: `now` is its id and what it keeps, None once it is
    /// not programmed. Returns whether something it kept before may be stale now.
    pub fn set(&mut self, fe: crate::model::Frontend, now: Option<(u32, Keep)>) -> bool {
        let old = match self.ids.remove(&fe) {
            Some(id) => self.by_id.remove(&id).map(|keep| (id, keep)),
            None => None,
        };
        let lost = match (&old, &now) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some((old_id, old)), Some((id, new))) => old_id != id || !new.covers(old),
        };
        if let Some((id, keep)) = now {
            self.ids.insert(fe, id);
            self.by_id.insert(id, keep);
        }
        lost
    }

    /// Replaces everything with `all` (every programmed UDP frontend: frontend, id, what it
    /// keeps). Returns whether something kept before may be stale now.
    pub fn replace(
        &mut self,
        all: impl IntoIterator<Item = (crate::model::Frontend, u32, Keep)>,
    ) -> bool {
        let mut next = UdpServing::default();
        for (fe, id, keep) in all {
            next.ids.insert(fe, id);
            next.by_id.insert(id, keep);
        }
        let lost = self
            .by_id
            .iter()
            .any(|(id, old)| next.by_id.get(id).is_none_or(|new| !new.covers(old)));
        *self = next;
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::Messages;
    use std::net::Ipv6Addr;

    fn header(len: u32, kind: u16, seq: u32) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&len.to_ne_bytes());
        h.extend_from_slice(&kind.to_ne_bytes());
        h.extend_from_slice(&0u16.to_ne_bytes());
        h.extend_from_slice(&seq.to_ne_bytes());
        h.extend_from_slice(&0u32.to_ne_bytes());
        h
    }

    fn diag_msg(
        family: u8,
        src: &[u8],
        sport: u16,
        dst: &[u8],
        dport: u16,
        cookie: u64,
    ) -> Vec<u8> {
        let mut m = vec![family, 1 /* TCP_ESTABLISHED */, 0, 0];
        m.extend_from_slice(&sport.to_be_bytes());
        m.extend_from_slice(&dport.to_be_bytes());
        let mut a = [0u8; 16];
        a[..src.len()].copy_from_slice(src);
        m.extend_from_slice(&a);
        let mut a = [0u8; 16];
        a[..dst.len()].copy_from_slice(dst);
        m.extend_from_slice(&a);
        m.extend_from_slice(&0u32.to_ne_bytes()); // if
        m.extend_from_slice(&(cookie as u32).to_ne_bytes());
        m.extend_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
        m.extend_from_slice(&[0; 20]);
        m
    }

    #[test]
    fn parses_v4_socket_and_keeps_sockid() {
        let m = diag_msg(
            libc::AF_INET as u8,
            &[10, 0, 0, 1],
            40000,
            &[10, 250, 0, 2],
            5353,
            0x1_0000_0002,
        );
        let s = udp_sock(&m).unwrap().unwrap();
        assert_eq!(s.local, "10.0.0.1:40000".parse().unwrap());
        assert_eq!(s.remote, "10.250.0.2:5353".parse().unwrap());
        assert_eq!(s.cookie, 0x1_0000_0002);
        // SOCK_DESTROY echoes the socket id: after the netlink header and the request's
        // family, protocol, extensions, pad and states.
        assert_eq!(&destroy_request(&s, 1)[24..], &m[4..52]);
        assert_eq!(s.peer(), ("10.250.0.2".parse().unwrap(), 5353));
    }

    #[test]
    fn v4_mapped_peer_counts_as_v4_backend() {
        let dst: Ipv6Addr = "::ffff:10.250.0.2".parse().unwrap();
        let src: Ipv6Addr = "::ffff:10.0.0.1".parse().unwrap();
        let m = diag_msg(
            libc::AF_INET6 as u8,
            &src.octets(),
            1,
            &dst.octets(),
            5353,
            7,
        );
        let s = udp_sock(&m).unwrap().unwrap();
        assert_eq!(s.peer(), ("10.250.0.2".parse().unwrap(), 5353));
    }

    #[test]
    fn unconnected_socket_is_skipped() {
        let m = diag_msg(
            libc::AF_INET as u8,
            &[0, 0, 0, 0],
            5353,
            &[0, 0, 0, 0],
            0,
            1,
        );
        assert_eq!(udp_sock(&m).unwrap(), None);
    }

    #[test]
    fn truncated_and_malformed_replies_are_errors() {
        let m = diag_msg(libc::AF_INET as u8, &[1, 2, 3, 4], 1, &[5, 6, 7, 8], 2, 3);
        for cut in 0..m.len() {
            assert!(udp_sock(&m[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad_family = m.clone();
        bad_family[0] = 99;
        assert!(udp_sock(&bad_family).is_err());
        let mut short_error = header(18, NLMSG_ERROR, 1);
        short_error.extend_from_slice(&[1, 2]);
        let msg = Messages::new(&short_error).next().unwrap().unwrap();
        assert!(msg.error_code().is_err());

        // Header length beyond the datagram, below the header size, and a stub header.
        let mut d = header(100, SOCK_DIAG_BY_FAMILY, 1);
        d.extend_from_slice(&[0; 8]);
        assert!(Messages::new(&d).next().unwrap().is_err());
        let d = header(8, SOCK_DIAG_BY_FAMILY, 1);
        assert!(Messages::new(&d).next().unwrap().is_err());
        assert!(Messages::new(&[1, 2, 3]).next().unwrap().is_err());
        // Every prefix of a valid two-message datagram parses or errors, never panics.
        let mut d = header((16 + m.len()) as u32, SOCK_DIAG_BY_FAMILY, 1);
        d.extend_from_slice(&m);
        d.extend_from_slice(&header(20, NLMSG_DONE, 1));
        d.extend_from_slice(&0i32.to_ne_bytes());
        for cut in 0..=d.len() {
            for msg in Messages::new(&d[..cut]).flatten() {
                let _ = udp_sock(msg.payload());
                let _ = msg.error_code();
                let _ = msg.done_code();
            }
        }
        let all: Vec<_> = Messages::new(&d).collect::<io::Result<_>>().unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].kind, NLMSG_DONE);
        assert_eq!(all[1].done_code(), 0);
    }

    #[test]
    fn processes_outside_our_pid_namespace_are_reported() {
        let dir = std::env::temp_dir().join(format!("svc-stale-test-{}", std::process::id()));
        fs::create_dir_all(dir.join("pod")).unwrap();
        // As a reader in another PID namespace sees the host's processes.
        fs::write(dir.join("cgroup.procs"), "0\n").unwrap();
        fs::write(dir.join("pod/cgroup.procs"), "0\n0\n").unwrap();
        let mut errors = Vec::new();
        let found = cgroup_namespaces(&dir, &mut errors).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert!(found.is_empty());
        assert_eq!(errors.len(), 1, "{errors:?}");
        let message = errors[0].to_string();
        assert!(
            message.contains("of 3 processes") && message.contains("hostPID"),
            "{message}"
        );
    }

    /// The sync hands work over and goes on: submitting never waits for a run under way, and
    /// what piles up meanwhile is done in one run.
    #[test]
    fn the_worker_never_blocks_the_submitter() {
        use std::sync::mpsc;
        use std::time::Instant;
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel();
        let worker = StaleWorker::spawn(move |batch: Vec<u32>| {
            started_tx.send(()).unwrap();
            // A namespace walk that takes as long as the test wants.
            release_rx.recv().unwrap();
            done_tx.send(batch).unwrap();
        })
        .unwrap();
        worker.submit(vec![1]);
        started_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let t = Instant::now();
        for i in 2..=50 {
            worker.submit(vec![i]);
        }
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "submitting waited for the run: {:?}",
            t.elapsed()
        );
        release_tx.send(()).unwrap();
        assert_eq!(
            done_rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            vec![1]
        );
        started_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        release_tx.send(()).unwrap();
        let merged = done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(
            merged,
            (2..=50).collect::<Vec<_>>(),
            "queued work is merged"
        );
        drop(worker);
    }

    fn udp(ip: &str) -> crate::model::Frontend {
        crate::model::Frontend::cluster(ip.parse().unwrap(), 53, crate::model::Protocol::Udp)
    }

    fn only(backends: &[&str]) -> Keep {
        let mut b: Vec<SocketAddr> = backends.iter().map(|b| b.parse().unwrap()).collect();
        b.sort();
        Keep::Only(std::sync::Arc::new(b))
    }

    /// A backend that leaves Service S but still serves T: S's flows and sockets to it are
    /// stale, T's are not; once T is removed, T's are stale too. What a frontend of unknown id
    /// translated is stale; nothing of a frontend kept `Any` (its Service failed) is.
    #[test]
    fn stale_is_per_frontend_and_follows_what_serves_now() {
        let (s_fe, t_fe, u_fe) = (udp("10.96.0.10"), udp("10.96.0.11"), udp("10.96.0.12"));
        let x: SocketAddr = "10.0.0.1:5353".parse().unwrap();
        let y: SocketAddr = "10.0.0.2:5353".parse().unwrap();
        let mut serving = UdpServing::default();
        let lost = serving.replace([
            (s_fe, 1, only(&["10.0.0.1:5353", "10.0.0.2:5353"])),
            (t_fe, 2, only(&["10.0.0.1:5353"])),
            (u_fe, 3, Keep::Any),
        ]);
        assert!(!lost, "nothing was kept before");
        assert!(!serving.stale(1, x) && !serving.stale(1, y) && !serving.stale(2, x));
        assert!(serving.stale(2, y), "y never served T");
        assert!(
            !serving.stale(3, y),
            "a failing Service's frontend judges nothing"
        );
        assert!(serving.stale(9, x), "a frontend that is gone");
        // The kernel reports a v4 peer of a v6 socket as v4-mapped.
        assert!(!serving.stale(1, "[::ffff:10.0.0.1]:5353".parse().unwrap()));

        assert!(serving.set(s_fe, Some((1, only(&["10.0.0.2:5353"])))));
        assert!(serving.stale(1, x));
        assert!(!serving.stale(2, x), "T keeps x");
        assert!(
            !serving.set(s_fe, Some((1, only(&["10.0.0.1:5353", "10.0.0.2:5353"])))),
            "a backend that comes back leaves nothing stale"
        );
        assert!(!serving.stale(1, x));
        assert!(serving.set(t_fe, None), "T removed");
        assert!(serving.stale(2, x));
        assert!(!serving.set(t_fe, None), "nothing left to lose");
        assert!(
            serving.set(u_fe, Some((3, only(&["10.0.0.1:5353"])))),
            "a failing Service programmed at last: its flows are judged again"
        );
        assert!(serving.stale(3, y));

        // A full sync: a frontend that kept a backend drops it, or goes.
        let s_keeps = only(&["10.0.0.1:5353", "10.0.0.2:5353"]);
        assert!(!serving.replace([(s_fe, 1, s_keeps.clone()), (u_fe, 3, Keep::Any)]));
        assert!(serving.replace([(s_fe, 1, s_keeps.clone())]), "U is gone");
        assert!(serving.stale(3, x));
        assert!(
            serving.replace([(s_fe, 4, s_keeps)]),
            "S under a new id: the old id's flows are the old frontend's"
        );
        assert!(serving.stale(1, x) && !serving.stale(4, x));
    }

    /// The requests are the bytes the hand-written framing this replaced sent (recorded from
    /// it on x86_64): both dumps, and the destroy of a socket of each family as the kernel
    /// reported it.
    #[cfg(target_endian = "little")]
    #[test]
    fn requests_are_the_bytes_sent_before() {
        let unhex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        assert_eq!(
            dump_request(libc::AF_INET as u8, 1),
            unhex(
                "4800000014000103010000000000000002110000020000000000000000000000\
                0000000000000000000000000000000000000000000000000000000000000000\
                0000000000000000"
            )
        );
        assert_eq!(
            dump_request(libc::AF_INET6 as u8, 2),
            unhex(
                "480000001400010302000000000000000a110000020000000000000000000000\
                0000000000000000000000000000000000000000000000000000000000000000\
                0000000000000000"
            )
        );
        let v4 = udp_sock(&unhex(
            "020100009c4014e90a0000010000000000000000000000000afa000200000000\
            00000000000000000300000078563412f0debc9a000000000000000000000000\
            0000000000000000",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(v4.cookie, 0x9abc_def0_1234_5678);
        assert_eq!(
            destroy_request(&v4, 3),
            unhex(
                "4800000015000500030000000000000002110000ffffffff9c4014e90a000001\
                0000000000000000000000000afa000200000000000000000000000003000000\
                78563412f0debc9a"
            )
        );
        let v6 = udp_sock(&unhex(
            "0a0100009c41003500000000000000000000ffff0a000001fd00000000000000\
            0000000000000053000000000700000001000000000000000000000000000000\
            0000000000000000",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            destroy_request(&v6, 4),
            unhex(
                "480000001500050004000000000000000a110000ffffffff9c41003500000000\
                000000000000ffff0a000001fd00000000000000000000000000005300000000\
                0700000001000000"
            )
        );
    }
}
