//! svc-probe: the traffic end of the harness.
//!
//! `serve` is a backend: it answers every TCP line and every UDP datagram with its name; a
//! line or datagram `who` is answered with `NAME SOURCE LOCAL`, the client's address as the
//! backend sees it and the backend's own address it arrived at (clients ask with `--who`).
//! `tcp`, `udp` and `loop` are clients: they report, as JSON on stdout, which backend answered
//! and what the socket API showed (getpeername, recvfrom source), so a test asserts exactly
//! what an application in a pod would see.

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use svc_tests::{
    probe::{HeldConnection, HoldReport, SweepReport},
    Attempt, LoopReport, Report, StreamExchange, StreamReport,
};

#[derive(Parser)]
#[command(about = "Backend server and client probe for svc tests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer every TCP line and UDP datagram with NAME; prints `ready` once bound.
    Serve {
        #[arg(long)]
        name: String,
        #[arg(long, required = true)]
        listen: Vec<SocketAddr>,
        #[arg(long)]
        tcp: bool,
        #[arg(long)]
        udp: bool,
        /// Threads per socket: each TCP listener is served by this many threads that accept
        /// and answer a connection each, in turn, and each UDP socket by this many receivers.
        /// Without it a TCP connection gets a new thread of its own, which costs more than the
        /// connection itself once many arrive back to back.
        #[arg(long)]
        threads: Option<u32>,
    },
    /// COUNT sequential new TCP connections, one request/reply each.
    Tcp {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        /// Alternate attempts between --to (even results) and this address (odd results), so
        /// two targets are measured under the same conditions.
        #[arg(long)]
        alternate_with: Option<SocketAddr>,
    },
    /// COUNT UDP exchanges, each from a new socket.
    Udp {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        /// connect() the socket and use send/recv instead of sendto/recvfrom.
        #[arg(long)]
        connected: bool,
        /// Bind every socket to this source port (SO_REUSEADDR), so that every exchange is
        /// the same flow (5-tuple) as far as conntrack is concerned.
        #[arg(long)]
        source_port: Option<u16>,
    },
    /// One connected UDP socket exchanging a datagram every INTERVAL_MS for DURATION_MS, as a
    /// long-lived UDP client does; after an error the socket is closed and a new one connected.
    /// Every exchange is reported with its wall-clock time.
    UdpStream {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long, default_value_t = 20)]
        interval_ms: u64,
        /// SOCKETS unconnected sockets (sendto/recvfrom) used in turn for the whole run, as
        /// QUIC, DNS or WireGuard clients use one socket; never replaced.
        #[arg(long, conflicts_with = "v6_mapped")]
        unconnected: Option<u32>,
        /// With --unconnected: each round sends on every socket before it reads any reply, so
        /// other sockets' datagrams come between a socket's send and its reply.
        #[arg(long, requires = "unconnected")]
        pipelined: bool,
    },
    /// CONNECTIONS TCP connections opened at once and kept for DURATION_MS, each exchanging a
    /// line every INTERVAL_MS: long-lived connections, as a client pool keeps them. Reports
    /// every connection's exchanges and first failure.
    Hold {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 4)]
        connections: u32,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long, default_value_t = 50)]
        interval_ms: u64,
    },
    /// One TCP connection (and line) to each address of TARGETS (a file, one IP:PORT a line),
    /// in turn: whether every Service of a large set answers. Totals and the first failures.
    Sweep {
        #[arg(long)]
        targets: std::path::PathBuf,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// Threads probing at once, each taking the next target in turn.
        #[arg(long, default_value_t = 1)]
        workers: u32,
    },
    /// New TCP connections back to back for DURATION_MS; totals only.
    Loop {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        duration_ms: u64,
        #[arg(long, default_value_t = 1)]
        interval_ms: u64,
        /// Threads, each running the loop on its own; the report sums them.
        #[arg(long, default_value_t = 1)]
        workers: u32,
        /// UDP exchanges instead of TCP connections: each worker keeps one unconnected socket
        /// (one flow) for the whole run and sends a datagram once the last one was answered.
        #[arg(long)]
        udp: bool,
        /// Alternate between --to and this address (with --udp: a socket, one flow, for
        /// each): attempt by attempt, each worker starting on a different one, or with
        /// --block-ms in blocks, every worker on the same one at a time. The report's
        /// `alternate` holds this target's counts.
        #[arg(long)]
        alternate_with: Option<SocketAddr>,
        /// With --alternate-with: blocks of this many milliseconds instead of attempt by
        /// attempt (0).
        #[arg(long, default_value_t = 0)]
        block_ms: u64,
        /// Attempts per second over all workers (0: back to back): each worker starts its
        /// attempts on a schedule of its own, staggered from the others', and catches up
        /// without pause when it falls behind. A load below the machine's capacity, for
        /// measuring CPU time per attempt.
        #[arg(long, default_value_t = 0)]
        rate: u64,
    },
}

#[derive(clap::Args)]
struct Target {
    /// IP:PORT, IPv6 as [ADDR]:PORT.
    #[arg(long)]
    to: SocketAddr,
    /// Per-attempt timeout (connect, and waiting for the reply).
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// Use an AF_INET6 socket to the IPv4-mapped form (::ffff:a.b.c.d) of an IPv4 target.
    #[arg(long)]
    v6_mapped: bool,
    /// Ask the backend which source address it saw (and at which of its addresses).
    #[arg(long)]
    who: bool,
}

impl Target {
    fn addr(&self) -> SocketAddr {
        match (self.v6_mapped, self.to) {
            (true, SocketAddr::V4(a)) => {
                SocketAddr::new(IpAddr::V6(a.ip().to_ipv6_mapped()), a.port())
            }
            _ => self.to,
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.max(1))
    }
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve {
            name,
            listen,
            tcp,
            udp,
            threads,
        } => {
            // Neither flag means both.
            let (tcp, udp) = if tcp || udp { (tcp, udp) } else { (true, true) };
            serve(&name, &listen, tcp, udp, threads)
        }
        Cmd::Tcp {
            target,
            count,
            interval_ms,
            alternate_with,
        } => {
            let mut n = 0u64;
            let results = repeat(count, interval_ms, || {
                n += 1;
                let to = match alternate_with {
                    Some(other) if n.is_multiple_of(2) => other,
                    _ => target.addr(),
                };
                tcp_once(to, target.timeout(), target.who)
            });
            print_json(&Report {
                results,
                cgroup: own_cgroup(),
                netns_ino: own_netns(),
            })
        }
        Cmd::Udp {
            target,
            count,
            interval_ms,
            connected,
            source_port,
        } => {
            let results = repeat(count, interval_ms, || {
                udp_once(&target, connected, source_port)
            });
            print_json(&Report {
                results,
                cgroup: own_cgroup(),
                netns_ino: own_netns(),
            })
        }
        Cmd::Sweep {
            targets,
            timeout_ms,
            workers,
        } => print_json(&sweep(
            &targets,
            Duration::from_millis(timeout_ms.max(1)),
            workers,
        )?),
        Cmd::Loop {
            target,
            duration_ms,
            interval_ms,
            workers,
            udp,
            alternate_with,
            block_ms,
            rate,
        } => {
            let other = alternate_with.map(|to| Target {
                to,
                timeout_ms: target.timeout_ms,
                v6_mapped: target.v6_mapped,
                who: target.who,
            });
            let run = Run {
                duration_ms,
                interval_ms,
                udp,
                block: Duration::from_millis(block_ms),
                period: (rate > 0)
                    .then(|| Duration::from_secs_f64(f64::from(workers.max(1)) / rate as f64)),
            };
            print_json(&run_loops(&target, other.as_ref(), &run, workers))
        }
        Cmd::UdpStream {
            target,
            duration_ms,
            interval_ms,
            unconnected: None,
            ..
        } => print_json(&udp_stream(&target, duration_ms, interval_ms)),
        Cmd::UdpStream {
            target,
            duration_ms,
            interval_ms,
            unconnected: Some(sockets),
            pipelined,
        } => print_json(&udp_unconnected_stream(
            &target,
            duration_ms,
            interval_ms,
            sockets,
            pipelined,
        )),
        Cmd::Hold {
            target,
            connections,
            duration_ms,
            interval_ms,
        } => print_json(&hold(&target, connections, duration_ms, interval_ms)),
    }
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, v)?;
    writeln!(out)?;
    Ok(())
}

fn repeat(count: u32, interval_ms: u64, mut f: impl FnMut() -> Attempt) -> Vec<Attempt> {
    (0..count)
        .map(|i| {
            if i > 0 && interval_ms > 0 {
                std::thread::sleep(Duration::from_millis(interval_ms));
            }
            f()
        })
        .collect()
}

/// The "0::" line of /proc/self/cgroup: our cgroup v2 path.
fn own_cgroup() -> String {
    std::fs::read_to_string("/proc/self/cgroup")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        .unwrap_or_default()
}

fn own_netns() -> u64 {
    std::fs::metadata("/proc/self/ns/net")
        .map(|m| m.ino())
        .unwrap_or(0)
}

fn us(since: Instant) -> u64 {
    since.elapsed().as_micros() as u64
}

fn failed(e: &std::io::Error, start: Instant) -> Attempt {
    Attempt {
        ok: false,
        error: Some(e.to_string()),
        errno: e.raw_os_error(),
        elapsed_us: us(start),
        ..Default::default()
    }
}

/// What a backend answered: its name, and with `who` the source it saw and its own address.
fn parse_reply(reply: &str) -> (String, Option<String>, Option<String>) {
    let mut words = reply.split_whitespace();
    let name = words.next().unwrap_or_default().to_owned();
    (
        name,
        words.next().map(str::to_owned),
        words.next().map(str::to_owned),
    )
}

fn tcp_once(to: SocketAddr, timeout: Duration, who: bool) -> Attempt {
    let start = Instant::now();
    let stream = match TcpStream::connect_timeout(&to, timeout) {
        Ok(s) => s,
        Err(e) => return failed(&e, start),
    };
    let connect_us = us(start);
    let peer = stream.peer_addr().ok().map(|p| p.to_string());
    let reply = (|| -> std::io::Result<String> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        (&stream).write_all(if who { b"who\n" } else { b"x\n" })?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line)?;
        if line.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "connection closed without a reply",
            ));
        }
        Ok(line.trim_end().to_owned())
    })();
    // Reset instead of FIN: no TIME_WAIT, so thousands of back-to-back connections never
    // run out of ephemeral ports.
    set_linger_zero(&stream);
    match reply {
        Ok(reply) => {
            let (name, source, local) = parse_reply(&reply);
            Attempt {
                ok: true,
                backend: Some(name),
                peer,
                connect_us: Some(connect_us),
                elapsed_us: us(start),
                source,
                local,
                ..Default::default()
            }
        }
        Err(e) => Attempt {
            peer,
            connect_us: Some(connect_us),
            ..failed(&e, start)
        },
    }
}

fn set_linger_zero(s: &TcpStream) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket fd and a correctly sized linger struct.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

fn udp_once(target: &Target, connected: bool, source_port: Option<u16>) -> Attempt {
    let (to, timeout) = (target.addr(), target.timeout());
    let start = Instant::now();
    let message: &[u8] = if target.who { b"who" } else { b"x" };
    let run = || -> std::io::Result<Attempt> {
        let local: SocketAddr = match to {
            SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, source_port.unwrap_or(0)).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, source_port.unwrap_or(0)).into(),
        };
        let sock = match source_port {
            Some(_) => bind_reusable(local)?,
            None => UdpSocket::bind(local)?,
        };
        sock.set_read_timeout(Some(timeout))?;
        let mut buf = [0u8; 512];
        let answered = |buf: &[u8]| parse_reply(&String::from_utf8_lossy(buf));
        if connected {
            sock.connect(to)?;
            let peer = sock.peer_addr()?.to_string();
            sock.send(message)?;
            let n = sock.recv(&mut buf)?;
            let (name, source, local) = answered(&buf[..n]);
            Ok(Attempt {
                ok: true,
                backend: Some(name),
                peer: Some(peer),
                elapsed_us: us(start),
                source,
                local,
                ..Default::default()
            })
        } else {
            sock.send_to(message, to)?;
            let (n, from) = sock.recv_from(&mut buf)?;
            let (name, source, local) = answered(&buf[..n]);
            Ok(Attempt {
                ok: true,
                backend: Some(name),
                from: Some(from.to_string()),
                elapsed_us: us(start),
                source,
                local,
                ..Default::default()
            })
        }
    };
    run().unwrap_or_else(|e| failed(&e, start))
}

/// A UDP socket bound to `addr` with SO_REUSEADDR, so that back-to-back sockets can take the
/// same source port.
fn bind_reusable(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    use std::os::fd::FromRawFd;
    let family = match addr {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain socket(2); the descriptor is owned by the UdpSocket below.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket that nothing else owns.
    let sock = unsafe { UdpSocket::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: a valid socket and a correctly sized int option.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
    let (storage, len) = sockaddr(addr);
    // SAFETY: storage holds a sockaddr of `len` bytes for this family.
    if unsafe { libc::bind(fd, (&storage as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sock)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data, valid when zeroed.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn udp_stream(target: &Target, duration_ms: u64, interval_ms: u64) -> StreamReport {
    let to = target.addr();
    let connect = || -> std::io::Result<UdpSocket> {
        let local: SocketAddr = match to {
            SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap(),
            SocketAddr::V6(_) => "[::]:0".parse().unwrap(),
        };
        let sock = UdpSocket::bind(local)?;
        sock.set_read_timeout(Some(target.timeout()))?;
        sock.connect(to)?;
        Ok(sock)
    };
    let start = Instant::now();
    let duration = Duration::from_millis(duration_ms);
    let mut report = StreamReport::default();
    let mut sock: Option<UdpSocket> = None;
    let mut socket = 0u32;
    let mut buf = [0u8; 512];
    while start.elapsed() < duration {
        let at_ms = unix_ms();
        let result = (|| -> std::io::Result<(String, String)> {
            if sock.is_none() {
                sock = Some(connect()?);
            }
            let s = sock.as_ref().expect("connected above");
            let peer = s.peer_addr()?.to_string();
            s.send(b"x")?;
            let n = s.recv(&mut buf)?;
            Ok((
                String::from_utf8_lossy(&buf[..n]).trim_end().to_owned(),
                peer,
            ))
        })();
        report.exchanges.push(match result {
            Ok((backend, peer)) => StreamExchange {
                at_ms,
                socket,
                ok: true,
                backend: Some(backend),
                peer: Some(peer),
                ..Default::default()
            },
            Err(e) => {
                let used = socket;
                // Reconnect: a new socket, connected again, at the next exchange.
                if sock.take().is_some() {
                    socket += 1;
                }
                StreamExchange {
                    at_ms,
                    socket: used,
                    ok: false,
                    error: Some(e.to_string()),
                    errno: e.raw_os_error(),
                    ..Default::default()
                }
            }
        });
        std::thread::sleep(Duration::from_millis(interval_ms));
    }
    report.cgroup = own_cgroup();
    report.netns_ino = own_netns();
    report
}

fn hold(target: &Target, connections: u32, duration_ms: u64, interval_ms: u64) -> HoldReport {
    let to = target.addr();
    let timeout = target.timeout();
    let end = Instant::now() + Duration::from_millis(duration_ms);
    let threads: Vec<_> = (0..connections)
        .map(|_| {
            std::thread::spawn(move || {
                let mut held = HeldConnection::default();
                let stream = match TcpStream::connect_timeout(&to, timeout) {
                    Ok(s) => s,
                    Err(e) => {
                        held.failures = 1;
                        held.first_error = Some(e.to_string());
                        held.first_error_at_ms = Some(unix_ms());
                        return held;
                    }
                };
                held.connected_at_ms = unix_ms();
                held.peer = stream.peer_addr().ok().map(|p| p.to_string());
                let _ = stream.set_read_timeout(Some(timeout));
                let _ = stream.set_write_timeout(Some(timeout));
                let mut reader = BufReader::new(&stream);
                while Instant::now() < end {
                    let mut line = String::new();
                    let r = (&stream)
                        .write_all(b"x\n")
                        .and_then(|()| reader.read_line(&mut line));
                    match r {
                        Ok(n) if n > 0 => {
                            let name = line.trim_end().to_owned();
                            if held.backend.as_ref().is_some_and(|b| *b != name) {
                                held.switched = true;
                            }
                            held.backend = Some(name);
                            held.exchanges += 1;
                            held.last_ok_at_ms = Some(unix_ms());
                        }
                        other => {
                            held.failures += 1;
                            held.first_error_at_ms = Some(unix_ms());
                            held.first_error = Some(match other {
                                Err(e) => e.to_string(),
                                _ => "connection closed".into(),
                            });
                            // A TCP connection that failed once is gone.
                            break;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(interval_ms));
                }
                held
            })
        })
        .collect();
    HoldReport {
        connections: threads
            .into_iter()
            .map(|t| t.join().unwrap_or_default())
            .collect(),
        cgroup: own_cgroup(),
        netns_ino: own_netns(),
    }
}

fn udp_unconnected_stream(
    target: &Target,
    duration_ms: u64,
    interval_ms: u64,
    sockets: u32,
    pipelined: bool,
) -> StreamReport {
    let to = target.addr();
    let local: SocketAddr = match to {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap(),
        SocketAddr::V6(_) => "[::]:0".parse().unwrap(),
    };
    let mut report = StreamReport::default();
    let socks: Vec<std::io::Result<UdpSocket>> = (0..sockets.max(1))
        .map(|_| {
            let s = UdpSocket::bind(local)?;
            s.set_read_timeout(Some(target.timeout()))?;
            Ok(s)
        })
        .collect();
    let start = Instant::now();
    let duration = Duration::from_millis(duration_ms);
    let mut buf = [0u8; 512];
    let sock_of = |i: usize| {
        socks[i]
            .as_ref()
            .map_err(|e| std::io::Error::new(e.kind(), e.to_string()))
    };
    let exchange = |i: usize, at_ms: u64, result: std::io::Result<(String, String)>| match result {
        Ok((backend, from)) => StreamExchange {
            at_ms,
            socket: i as u32,
            ok: true,
            backend: Some(backend),
            from: Some(from),
            ..Default::default()
        },
        Err(e) => StreamExchange {
            at_ms,
            socket: i as u32,
            ok: false,
            error: Some(e.to_string()),
            errno: e.raw_os_error(),
            ..Default::default()
        },
    };
    'run: while start.elapsed() < duration {
        // Pipelined: every socket sends, then every socket reads its reply.
        let mut sent: Vec<(u64, std::io::Result<()>)> = Vec::new();
        if pipelined {
            for i in 0..socks.len() {
                let at_ms = unix_ms();
                sent.push((
                    at_ms,
                    sock_of(i).and_then(|s| s.send_to(b"x", to).map(drop)),
                ));
            }
        }
        for i in 0..socks.len() {
            let (at_ms, sent_ok) = match sent.get_mut(i) {
                Some((at, r)) => (*at, std::mem::replace(r, Ok(()))),
                None => (unix_ms(), Ok(())),
            };
            let result = (|| -> std::io::Result<(String, String)> {
                sent_ok?;
                let s = sock_of(i)?;
                if !pipelined {
                    s.send_to(b"x", to)?;
                }
                let (n, from) = s.recv_from(&mut buf)?;
                Ok((
                    String::from_utf8_lossy(&buf[..n]).trim_end().to_owned(),
                    from.to_string(),
                ))
            })();
            report.exchanges.push(exchange(i, at_ms, result));
            if start.elapsed() >= duration {
                break 'run;
            }
        }
        std::thread::sleep(Duration::from_millis(interval_ms));
    }
    report.cgroup = own_cgroup();
    report.netns_ino = own_netns();
    report
}

fn sweep(targets: &std::path::Path, timeout: Duration, workers: u32) -> Result<SweepReport> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let text = std::fs::read_to_string(targets)
        .with_context(|| format!("reading {}", targets.display()))?;
    let to: Vec<SocketAddr> = (text.lines())
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.trim().parse().with_context(|| format!("{l:?}")))
        .collect::<Result<_>>()?;
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let parts: Vec<SweepReport> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..workers.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut part = SweepReport::default();
                    while let Some(&to) = to.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let a = tcp_once(to, timeout, false);
                        if a.ok {
                            part.ok += 1;
                        } else {
                            part.failed += 1;
                            if part.first_failures.len() < 10 {
                                (part.first_failures)
                                    .push(format!("{to}: {}", a.error.unwrap_or_default()));
                            }
                        }
                    }
                    part
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_default())
            .collect()
    });
    let mut report = SweepReport::default();
    for part in parts {
        report.ok += part.ok;
        report.failed += part.failed;
        report.first_failures.extend(part.first_failures);
    }
    report.first_failures.truncate(10);
    // A worker that panicked took its counts with it: what it probed counts as failed.
    let unaccounted = (to.len() as u64).saturating_sub(report.ok + report.failed);
    if unaccounted > 0 {
        report.failed += unaccounted;
        (report.first_failures).push(format!(
            "{unaccounted} targets unaccounted for: a worker panicked"
        ));
    }
    report.elapsed_us = us(start);
    report.cgroup = own_cgroup();
    report.netns_ino = own_netns();
    Ok(report)
}

/// How each worker of `loop` runs.
struct Run {
    duration_ms: u64,
    interval_ms: u64,
    udp: bool,
    /// With two targets: each one's turn; zero: one attempt.
    block: Duration,
    /// `--rate`: the time between one worker's attempts.
    period: Option<Duration>,
}

/// `workers` loops at once, each on a thread of its own; their counts are summed and the
/// duration is the whole run's.
fn run_loops(target: &Target, other: Option<&Target>, run: &Run, workers: u32) -> LoopReport {
    let start = Instant::now();
    let workers = workers.max(1);
    let parts: Vec<[LoopReport; 2]> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..workers)
            .map(|w| scope.spawn(move || run_loop(target, other, run, start, w, workers)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_default())
            .collect()
    });
    let mut lanes = [LoopReport::default(), LoopReport::default()];
    for part in parts {
        for (sum, p) in lanes.iter_mut().zip(part) {
            sum.ok += p.ok;
            sum.failed += p.failed;
            sum.busy_us += p.busy_us;
            sum.max_us = sum.max_us.max(p.max_us);
            for (k, v) in p.errors {
                *sum.errors.entry(k).or_default() += v;
            }
            for (k, v) in p.backends {
                *sum.backends.entry(k).or_default() += v;
            }
        }
    }
    let duration_ms = start.elapsed().as_millis() as u64;
    for lane in &mut lanes {
        lane.duration_ms = duration_ms;
        lane.workers = workers;
        lane.cgroup = own_cgroup();
        lane.netns_ino = own_netns();
    }
    let [mut report, alternate] = lanes;
    if other.is_some() {
        report.alternate = Some(Box::new(alternate));
    }
    report
}

/// One worker: attempts back to back until the run's `duration_ms` from `start` (the same
/// for every worker), to `target`, or with `other` alternating between the two: attempt by
/// attempt starting on lane `first` (then the two targets share each other's waits for the
/// CPU, which pulls their ratio towards 1), or, with `run.block`, to whichever has this
/// block since `start`, every worker on the same target at a time. The counts of each; a
/// failed attempt's time is left out of `busy_us` (one timeout is seconds, far more than the
/// difference measured), and the failure is reported. With `run.period`, worker `w` of
/// `workers` starts its attempts at `start` + `w` × period / `workers` + k × period.
fn run_loop(
    target: &Target,
    other: Option<&Target>,
    run: &Run,
    start: Instant,
    w: u32,
    workers: u32,
) -> [LoopReport; 2] {
    let duration = Duration::from_millis(run.duration_ms);
    let mut lanes = [LoopReport::default(), LoopReport::default()];
    let mut udp_sockets = [None, None];
    let mut attempt = (w % 2) as usize;
    // (When this worker's next attempt is due, the period.)
    let mut pace = run.period.map(|p| (start + p * w / workers, p));
    while start.elapsed() < duration {
        if let Some((at, period)) = &mut pace {
            let now = Instant::now();
            if *at > now {
                std::thread::sleep(*at - now);
            }
            *at += *period;
            if start.elapsed() >= duration {
                break;
            }
        }
        let lane = match other {
            None => 0,
            Some(_) if run.block.is_zero() => attempt % 2,
            Some(_) => (start.elapsed().as_nanos() / run.block.as_nanos() % 2) as usize,
        };
        attempt += 1;
        let to = if lane == 0 {
            target
        } else {
            other.unwrap_or(target)
        };
        // Around the whole attempt, the close (and its RST) included.
        let began = Instant::now();
        let a = if run.udp {
            udp_exchange(to, &mut udp_sockets[lane])
        } else {
            tcp_once(to.addr(), to.timeout(), to.who)
        };
        let report = &mut lanes[lane];
        report.max_us = report.max_us.max(a.elapsed_us);
        if a.ok {
            report.busy_us += us(began);
            report.ok += 1;
            *report
                .backends
                .entry(a.backend.unwrap_or_default())
                .or_default() += 1;
        } else {
            report.failed += 1;
            *report
                .errors
                .entry(a.error.unwrap_or_default())
                .or_default() += 1;
        }
        if run.interval_ms > 0 {
            std::thread::sleep(Duration::from_millis(run.interval_ms));
        }
    }
    lanes
}

/// One exchange on a socket kept across calls (made at the first): the same flow every time.
/// A reply that never came is a failure; the socket stays, and a late reply to an earlier
/// request is told apart by its sequence number and skipped.
fn udp_exchange(target: &Target, socket: &mut Option<(UdpSocket, u64)>) -> Attempt {
    let (to, timeout) = (target.addr(), target.timeout());
    let start = Instant::now();
    let run = |socket: &mut Option<(UdpSocket, u64)>| -> std::io::Result<Attempt> {
        if socket.is_none() {
            let local: SocketAddr = match to {
                SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap(),
                SocketAddr::V6(_) => "[::]:0".parse().unwrap(),
            };
            let s = UdpSocket::bind(local)?;
            s.set_read_timeout(Some(timeout))?;
            *socket = Some((s, 0));
        }
        let (s, seq) = socket.as_mut().expect("made above");
        *seq += 1;
        let request = format!("{seq}");
        s.send_to(request.as_bytes(), to)?;
        let mut buf = [0u8; 512];
        loop {
            let (n, from) = s.recv_from(&mut buf)?;
            let reply = String::from_utf8_lossy(&buf[..n]);
            // `NAME SEQ`: the backend echoes what it got after its name.
            let (name, echoed, _) = parse_reply(&reply);
            if echoed.as_deref() == Some(request.as_str()) {
                return Ok(Attempt {
                    ok: true,
                    backend: Some(name),
                    from: Some(from.to_string()),
                    elapsed_us: us(start),
                    ..Default::default()
                });
            }
        }
    };
    run(socket).unwrap_or_else(|e| failed(&e, start))
}

fn serve(
    name: &str,
    listen: &[SocketAddr],
    tcp: bool,
    udp: bool,
    threads_per_socket: Option<u32>,
) -> Result<()> {
    let mut threads = Vec::new();
    for &addr in listen {
        if tcp {
            let l = TcpListener::bind(addr).with_context(|| format!("binding tcp {addr}"))?;
            let name = name.to_owned();
            match threads_per_socket {
                None => threads.push(std::thread::spawn(move || serve_tcp(l, name))),
                Some(n) => {
                    for _ in 0..n.max(1) {
                        let (l, name) = (l.try_clone()?, name.clone());
                        threads.push(std::thread::spawn(move || {
                            for conn in l.incoming() {
                                let Ok(conn) = conn else { continue };
                                answer_tcp(conn, &name);
                            }
                        }));
                    }
                }
            }
        }
        if udp {
            let s = UdpSocket::bind(addr).with_context(|| format!("binding udp {addr}"))?;
            for _ in 0..threads_per_socket.unwrap_or(1).max(1) {
                let (s, name) = (s.try_clone()?, name.to_owned());
                threads.push(std::thread::spawn(move || serve_udp(s, name)));
            }
        }
    }
    // Every socket is bound (and TCP listening) before this line: the harness waits for it.
    println!("ready");
    std::io::stdout().flush()?;
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn serve_tcp(l: TcpListener, name: String) {
    for conn in l.incoming() {
        let Ok(conn) = conn else { continue };
        let name = name.clone();
        std::thread::spawn(move || answer_tcp(conn, &name));
    }
}

/// Answers every line of one connection until the client closes it.
fn answer_tcp(conn: TcpStream, name: &str) {
    let reply = format!("{name}\n");
    let who = format!(
        "{name} {} {}\n",
        conn.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
        conn.local_addr().map(|a| a.to_string()).unwrap_or_default()
    );
    let mut reader = BufReader::new(&conn);
    let mut line = String::new();
    // One reply per line until EOF (or a reset from a client that lingers 0).
    while matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
        let answer = if line.trim_end() == "who" {
            &who
        } else {
            &reply
        };
        if (&conn).write_all(answer.as_bytes()).is_err() {
            break;
        }
        line.clear();
    }
}

fn serve_udp(s: UdpSocket, name: String) {
    let mut buf = [0u8; 2048];
    // The address the socket is bound to: with a wildcard bind, the datagram's own destination
    // is not known without IP_PKTINFO, and the bound address is reported as it is.
    let local = s.local_addr().map(|a| a.to_string()).unwrap_or_default();
    loop {
        if let Ok((n, from)) = s.recv_from(&mut buf) {
            let got = &buf[..n];
            let answer = if got == b"who" {
                format!("{name} {from} {local}")
            } else if !got.is_empty() && got.iter().all(u8::is_ascii_digit) {
                // A sequence number (`loop --udp`): echoed, so the client can tell a late
                // reply from the one it waits for.
                format!("{name} {}", String::from_utf8_lossy(got))
            } else {
                name.clone()
            };
            let _ = s.send_to(answer.as_bytes(), from);
        }
    }
}
