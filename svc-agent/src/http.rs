//! The agent's HTTP servers (health, metrics, health check node ports), on hyper.
//!
//! Each server answers one request per connection and closes it, as kube-proxy's answers a
//! client that asks so; what it answers is an [`Answer`], a plain value its handler makes.
//! This module owns what every server shares: the accept loop, the bounds on slow and
//! oversized requests, and the cap on connections ([`ConnLimit`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use http_body_util::Full;
use hyper::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE};
use hyper::{Method, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::error::Error;

/// How long a client may take to send its request, and to take the reply: a client that
/// stalls must not hold a connection (a file descriptor) for long.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest request head a server reads (hyper's smallest buffer); a larger one is
/// answered 431 and closed, not buffered.
const MAX_HEAD: usize = 8192;

/// What a server answers to one request; the HTTP framing (status line, Content-Length,
/// Date, Connection) is this module's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: StatusCode,
    pub content_type: &'static str,
    /// A header of the server's own, after Content-Type and X-Content-Type-Options.
    pub extra: Option<(&'static str, String)>,
    pub body: String,
}

impl Answer {
    pub fn new(status: StatusCode, content_type: &'static str, body: impl Into<String>) -> Self {
        Answer {
            status,
            content_type,
            extra: None,
            body: body.into(),
        }
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let mut r = Response::new(Full::new(Bytes::from(self.body)));
        *r.status_mut() = self.status;
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static(self.content_type));
        h.insert(
            HeaderName::from_static("x-content-type-options"),
            HeaderValue::from_static("nosniff"),
        );
        if let Some((name, value)) = self.extra {
            if let Ok(value) = HeaderValue::try_from(value) {
                h.insert(HeaderName::from_static(name), value);
            }
        }
        h.insert(CONNECTION, HeaderValue::from_static("close"));
        r
    }
}

/// A server's answers: of the method, the path and the address the client reached.
type Handler = Arc<dyn Fn(Method, String, SocketAddr) -> BoxFuture<'static, Answer> + Send + Sync>;

/// Binds an address for `serve`, naming it in the error.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Other(format!("binding {addr}: {e}")))
}

/// Serves `listener` until the task is dropped: each request is answered by
/// `answer(method, path, the address the client reached)`. `what` names the server in logs.
pub async fn serve<F, Fut>(
    listener: Arc<TcpListener>,
    conns: Arc<ConnLimit>,
    what: String,
    answer: F,
) where
    F: Fn(Method, String, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Answer> + Send + 'static,
{
    let answer: Handler = Arc::new(move |method, path, local| answer(method, path, local).boxed());
    loop {
        conns.room().await;
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                conns.accept_failed(&what, &e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slot = Arc::new(conns.admit());
        tokio::spawn(connection(stream, peer, slot, what.clone(), answer.clone()));
    }
}

/// One connection: its request answered, unless its slot is taken back before the request
/// came; `IO_TIMEOUT` for the request's head, `2 * IO_TIMEOUT` for the whole connection.
async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    slot: Arc<ConnSlot>,
    what: String,
    answer: Handler,
) {
    let Ok(local) = stream.local_addr() else {
        return;
    };
    let close = slot.close.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        // The request has come: it is answered at once, so it leaves the cap.
        slot.uncount();
        let reply = answer(req.method().clone(), req.uri().path().to_owned(), local);
        async move { Ok::<_, Infallible>(reply.await.into_response()) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(IO_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .keep_alive(false)
        .title_case_headers(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        biased;
        done = tokio::time::timeout(2 * IO_TIMEOUT, conn) => match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(%peer, "{what}: {e}"),
            Err(_) => debug!(%peer, "{what}: timed out"),
        },
        () = close.notified() => {}
    }
}

/// File descriptors kept from the HTTP servers for the agent's own work: its maps, programs
/// and links, netlink, the API connection, manifest files, a datapath repair.
const FD_RESERVE: u64 = 256;
/// More connections than a node's health checkers ever hold at once.
const CONN_CAP_MAX: u64 = 1024;

/// RLIMIT_NOFILE's soft limit now (1,024 if it cannot be read).
pub fn nofile_soft() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 1024;
    }
    r.rlim_cur
}

/// How many connections the HTTP servers keep open under a soft file limit of `soft`: what
/// the limit leaves beside `FD_RESERVE`, at most `CONN_CAP_MAX`, at least 16.
pub fn conn_cap(soft: u64) -> usize {
    soft.saturating_sub(FD_RESERVE).clamp(16, CONN_CAP_MAX) as usize
}

/// The connections of every HTTP server of the agent (health, metrics, health check node
/// ports) that wait for their request; they share the agent's file descriptors. Past `cap`, a
/// new connection closes the oldest waiting one rather than wait or be refused: a health
/// checker sends its request at once and is answered in a moment, so slow or idle clients,
/// however many, are the ones that lose their slot, and a flood of them can starve neither
/// the checkers nor the agent's own work of descriptors.
#[derive(Debug)]
pub struct ConnLimit {
    pub cap: usize,
    /// Connections closed unanswered, for /metrics.
    pub evicted: prometheus_client::metrics::counter::Counter,
    inner: Mutex<Conns>,
}

#[derive(Debug, Default)]
struct Conns {
    next: u64,
    /// By age: each open connection's signal to close.
    open: BTreeMap<u64, Arc<tokio::sync::Notify>>,
    /// Connections told to close whose tasks have not dropped them yet: their descriptors
    /// are still held.
    closing: usize,
    /// The last accept error logged, and those not logged since.
    warned: Option<Instant>,
    unlogged: u64,
}

/// What `/metrics` shows of the connections.
pub struct ConnCounts {
    pub open: usize,
    pub evicted: u64,
}

impl ConnLimit {
    pub fn new(cap: usize) -> ConnLimit {
        ConnLimit {
            cap: cap.max(1),
            evicted: Default::default(),
            inner: Mutex::default(),
        }
    }

    /// The cap the process's file limit allows.
    pub fn for_this_process() -> ConnLimit {
        ConnLimit::new(conn_cap(nofile_soft()))
    }

    fn lock(&self) -> MutexGuard<'_, Conns> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns once the connections told to close have let go of their descriptors, before
    /// the next accept: on the runtime's one thread those closes wait for their tasks, and an
    /// accept loop that ran ahead of them would hold more descriptors than the cap.
    pub async fn room(&self) {
        loop {
            {
                let c = self.lock();
                if c.closing == 0 || c.open.len() + c.closing < self.cap {
                    return;
                }
            }
            tokio::task::yield_now().await;
        }
    }

    /// A slot for a connection just accepted, closing the oldest one when all are taken.
    pub fn admit(self: &Arc<Self>) -> ConnSlot {
        let mut c = self.lock();
        while c.open.len() >= self.cap {
            self.evict_oldest(&mut c);
        }
        let id = c.next;
        c.next += 1;
        let close = Arc::new(tokio::sync::Notify::new());
        c.open.insert(id, close.clone());
        ConnSlot {
            limit: self.clone(),
            id,
            close,
            counted: AtomicBool::new(true),
        }
    }

    fn evict_oldest(&self, c: &mut Conns) {
        if let Some((_, close)) = c.open.pop_first() {
            // A permit is kept if the connection's task has not started waiting yet.
            close.notify_one();
            c.closing += 1;
            self.evicted.inc();
        }
    }

    /// An accept that failed: when for want of descriptors, the oldest connection is closed
    /// to make room. Logged at most every 10 s, with how many went unlogged.
    pub fn accept_failed(&self, server: &str, e: &std::io::Error) {
        let mut c = self.lock();
        if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) {
            self.evict_oldest(&mut c);
        }
        if c.warned
            .is_some_and(|t| t.elapsed() < Duration::from_secs(10))
        {
            c.unlogged += 1;
            return;
        }
        let unlogged = std::mem::take(&mut c.unlogged);
        c.warned = Some(Instant::now());
        drop(c);
        warn!(
            open = self.counts().open,
            "accepting on {server}: {e} ({unlogged} more such errors since the last report)"
        );
    }

    pub fn counts(&self) -> ConnCounts {
        let c = self.lock();
        ConnCounts {
            open: c.open.len(),
            evicted: self.evicted.get(),
        }
    }
}

/// One connection's place among `ConnLimit`'s; freed when dropped.
pub struct ConnSlot {
    limit: Arc<ConnLimit>,
    id: u64,
    close: Arc<tokio::sync::Notify>,
    /// Still among `open`, or among `closing` once evicted.
    counted: AtomicBool,
}

impl ConnSlot {
    /// Leaves the count: `open` if still there, else `closing` (it was evicted).
    fn uncount(&self) {
        if self.counted.swap(false, Ordering::AcqRel) {
            let mut c = self.limit.lock();
            if c.open.remove(&self.id).is_none() {
                c.closing = c.closing.saturating_sub(1);
            }
        }
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.uncount();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The cap leaves the agent its reserve under a container's 1,024 and stays bounded under a
    /// raised limit.
    #[test]
    fn the_connection_cap_follows_the_file_limit() {
        assert_eq!(conn_cap(1024), 768);
        assert_eq!(conn_cap(65_536), 1024);
        assert_eq!(conn_cap(100), 16);
    }

    /// A server on loopback that answers every request with its path, under `limit`.
    async fn echo_server(limit: Arc<ConnLimit>) -> SocketAddr {
        let listener = Arc::new(bind("127.0.0.1:0".parse().unwrap()).await.unwrap());
        let at = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            limit,
            "test".into(),
            |_, path, _| async move { Answer::new(StatusCode::OK, "text/plain", path) },
        ));
        at
    }

    async fn get(at: SocketAddr, request: &[u8]) -> String {
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.write_all(request).await.unwrap();
        let mut reply = String::new();
        let _ = c.read_to_string(&mut reply).await;
        reply
    }

    /// The reply's framing: status line, the headers every server sends, a Date, the body,
    /// and the connection closed after it.
    #[tokio::test]
    async fn a_request_is_answered_and_the_connection_closed() {
        let at = echo_server(Arc::new(ConnLimit::new(4))).await;
        let reply = get(at, b"GET /x?y=1 HTTP/1.1\r\nHost: h\r\n\r\n").await;
        let (head, body) = reply.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        for h in [
            "Content-Type: text/plain",
            "X-Content-Type-Options: nosniff",
            "Content-Length: 2",
            "Connection: close",
        ] {
            assert!(head.contains(&format!("\r\n{h}")), "{h} in {head}");
        }
        assert!(head.contains("\r\nDate: "), "{head}");
        assert_eq!(body, "/x");
    }

    /// Past the cap the oldest waiting connection is told to close, and a connection whose
    /// request has come no longer counts.
    #[tokio::test]
    async fn past_the_cap_the_oldest_waiting_connection_goes() {
        let limit = Arc::new(ConnLimit::new(2));
        let oldest = limit.admit();
        let _second = limit.admit();
        let _third = limit.admit();
        tokio::time::timeout(Duration::from_secs(1), oldest.close.notified())
            .await
            .expect("the oldest connection is told to close");
        let c = limit.counts();
        assert_eq!((c.open, c.evicted), (2, 1));
        // Its descriptor is held until its task drops it: the next accept waits for that.
        assert_eq!(limit.lock().closing, 1);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), limit.room())
                .await
                .is_err()
        );
        drop(oldest);
        assert_eq!(limit.lock().closing, 0);
        assert_eq!(limit.counts().open, 2);
        limit.room().await;
    }

    /// Hostile clients: idle connections past the cap, one that sends its head a byte at a
    /// time and stalls, and one whose head is larger than a server reads. None of them keeps
    /// a client that asks properly from its answer, the idle ones are closed to make room,
    /// the oversized head is refused without being read whole, and an answered connection
    /// leaves the count.
    #[tokio::test]
    async fn slow_idle_and_oversized_clients_do_not_stall_the_server() {
        let limit = Arc::new(ConnLimit::new(8));
        let at = echo_server(limit.clone()).await;
        let mut idle = Vec::new();
        for _ in 0..20 {
            idle.push(tokio::net::TcpStream::connect(at).await.unwrap());
        }
        let mut slow = tokio::net::TcpStream::connect(at).await.unwrap();
        slow.write_all(b"GET /slow HT").await.unwrap();
        let reply =
            tokio::time::timeout(Duration::from_secs(2), get(at, b"GET /ok HTTP/1.1\r\n\r\n"))
                .await
                .expect("answered while the others wait");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.ends_with("/ok"), "{reply}");
        let c = limit.counts();
        assert!(c.open <= 8, "{}", c.open);
        assert!(c.evicted >= 13, "{}", c.evicted);

        let mut big = b"GET /big HTTP/1.1\r\nX-Pad: ".to_vec();
        big.resize(64 * 1024, b'a');
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        // The server may close before taking it all.
        let _ = c.write_all(&big).await;
        let mut reply = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), c.read_to_string(&mut reply))
            .await
            .expect("the oversized request is refused at once");
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 431"),
            "{reply}"
        );
        // Every connection evicted has let go of its slot; the answered ones count no more.
        drop(idle);
        drop(slow);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(limit.counts().open, 0);
    }

    /// A client that sends part of its head and stalls is closed after `IO_TIMEOUT`.
    #[tokio::test]
    async fn a_stalled_request_is_closed_after_the_timeout() {
        let limit = Arc::new(ConnLimit::new(8));
        let at = echo_server(limit.clone()).await;
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.write_all(b"GET / HT").await.unwrap();
        let mut buf = Vec::new();
        let start = Instant::now();
        let read = tokio::time::timeout(IO_TIMEOUT * 2, c.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "still open past the timeout");
        assert!(
            start.elapsed() >= IO_TIMEOUT / 2,
            "closed before the timeout"
        );
    }
}
