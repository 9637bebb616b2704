//! client-go's `rest_client_requests_total` and `rest_client_request_duration_seconds` for the
//! agent's own Kubernetes client, under client-go's names, labels and buckets
//! (k8s.io/component-base/metrics/prometheus/restclient), so that the panels and alerts kept
//! for kube-proxy's API traffic read svc's.
//!
//! A tower layer on kube-rs' client stack: it sees each request as the client sends it and
//! its answer (the status line) or the transport's failure. client-go counts an answer by
//! its status code and a failure without one as `<error>`, by the HTTP method, and by the
//! host of the client's base URL (`host:port` as configured). It times a request from its
//! start to the end of its answer's body, and leaves watches out of the histogram (a watch
//! lasts as long as it is open): the same here, the end being when the body is read to its
//! end or dropped.
//!
//! Where kube-rs differs: its retries (of 429, 503 and 504, `RetryPolicy::server_retry`) run
//! inside the stack, beneath this layer, so a request it retried is counted once, by its last
//! answer, where client-go counts every attempt (and each retry again in
//! `rest_client_request_retries_total`, which svc does not export).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use hyper::body::{Body, Frame, SizeHint};
use hyper::{Request, Response, Uri};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// client-go's rest_client_request_duration_seconds buckets, seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
];

/// client-go's code for a request that got no answer (connection refused, TLS, timeout).
pub const TRANSPORT_ERROR: &str = "<error>";

type Requests = Family<[(&'static str, String); 3], Counter>;
type Latency = Family<[(&'static str, String); 2], Histogram, fn() -> Histogram>;

/// The two metrics, shared by every client the agent builds (clones share the counts).
#[derive(Clone, Debug)]
pub struct RestClientMetrics {
    requests: Requests,
    latency: Latency,
}

impl Default for RestClientMetrics {
    fn default() -> Self {
        RestClientMetrics {
            requests: Requests::default(),
            latency: Latency::new_with_constructor(|| {
                Histogram::new(LATENCY_BUCKETS.iter().copied())
            }),
        }
    }
}

impl RestClientMetrics {
    /// Registers both in `r`, with client-go's help texts (prometheus-client adds `_total`
    /// to the counter's name).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host",
            self.requests.clone(),
        );
        r.register(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host",
            self.latency.clone(),
        );
    }

    /// The layer that counts the requests of a client whose base URL is `cluster_url`.
    pub fn layer(&self, cluster_url: &Uri) -> RestClientLayer {
        RestClientLayer {
            metrics: self.clone(),
            host: host_label(cluster_url),
        }
    }

    fn count(&self, code: String, method: &str, host: &str) {
        self.requests
            .get_or_create(&[
                ("code", code),
                ("method", method.to_string()),
                ("host", host.to_string()),
            ])
            .inc();
    }

    fn histogram(&self, verb: &str, host: &str) -> Histogram {
        self.latency
            .get_or_create(&[("verb", verb.to_string()), ("host", host.to_string())])
            .clone()
    }
}

/// client-go's host label: the base URL's host and port as written (Go's `url.URL.Host`),
/// without credentials; "none" when it has none.
fn host_label(url: &Uri) -> String {
    match url.authority() {
        Some(a) => {
            let a = a.as_str();
            a.rsplit_once('@').map_or(a, |(_, host)| host).to_string()
        }
        None => "none".to_string(),
    }
}

/// A watch (`?watch=true` or `watch=1`): counted, but not timed.
fn is_watch(uri: &Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&').any(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            k == "watch" && matches!(v, "true" | "1")
        })
    })
}

#[derive(Clone, Debug)]
pub struct RestClientLayer {
    metrics: RestClientMetrics,
    host: String,
}

impl<S> tower_layer::Layer<S> for RestClientLayer {
    type Service = RestClientService<S>;

    fn layer(&self, inner: S) -> RestClientService<S> {
        RestClientService {
            inner,
            metrics: self.metrics.clone(),
            host: self.host.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct RestClientService<S> {
    inner: S,
    metrics: RestClientMetrics,
    host: String,
}

impl<S, ReqBody, B> tower_service::Service<Request<ReqBody>> for RestClientService<S>
where
    S: tower_service::Service<Request<ReqBody>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: Body + Unpin,
{
    type Response = Response<TimedBody<B>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<TimedBody<B>>, S::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let method = req.method().as_str().to_string();
        let timer = (!is_watch(req.uri())).then(|| Timer {
            histogram: self.metrics.histogram(&method, &self.host),
            start: Instant::now(),
        });
        let metrics = self.metrics.clone();
        let host = self.host.clone();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let answer = answer.await;
            let code = match &answer {
                Ok(r) => r.status().as_u16().to_string(),
                Err(_) => TRANSPORT_ERROR.to_string(),
            };
            metrics.count(code, &method, &host);
            // A failure is timed now (its timer dropped), an answer once its body is read.
            answer.map(|r| r.map(|inner| TimedBody { inner, timer }))
        })
    }
}

/// Observes the time since `start` once, when dropped.
struct Timer {
    histogram: Histogram,
    start: Instant,
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

/// An answer's body that stops its request's timer at its end, or when dropped unread.
pub struct TimedBody<B> {
    inner: B,
    timer: Option<Timer>,
}

impl<B: Body + Unpin> Body for TimedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = polled {
            self.timer = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use prometheus_client::encoding::text::encode;
    use tower_layer::Layer;
    use tower_service::Service;

    /// A server stand-in: answers `status`, or fails as a refused connection does.
    #[derive(Clone)]
    struct Stub(Option<u16>);

    impl Service<Request<()>> for Stub {
        type Response = Response<Full<bytes::Bytes>>;
        type Error = std::io::Error;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<()>) -> Self::Future {
            std::future::ready(match self.0 {
                Some(status) => Ok(Response::builder()
                    .status(status)
                    .body(Full::new(bytes::Bytes::from_static(b"{}")))
                    .expect("response")),
                None => Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
            })
        }
    }

    fn text(m: &RestClientMetrics) -> String {
        let mut r = Registry::default();
        m.register(&mut r);
        let mut out = String::new();
        encode(&mut out, &r).expect("encode");
        out
    }

    fn send(m: &RestClientMetrics, status: Option<u16>, method: &str, path: &str) {
        let url: Uri = "https://127.0.0.1:6443".parse().expect("url");
        let mut svc = m.layer(&url).layer(Stub(status));
        let req = Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .expect("request");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            if let Ok(r) = svc.call(req).await {
                r.into_body().collect().await.expect("body");
            }
        });
    }

    #[test]
    fn counts_by_code_method_and_host_and_times_all_but_watches() {
        let m = RestClientMetrics::default();
        send(&m, Some(200), "GET", "/api/v1/services?limit=500");
        send(
            &m,
            Some(200),
            "GET",
            "/api/v1/services?watch=true&resourceVersion=1",
        );
        send(&m, Some(403), "GET", "/api/v1/nodes");
        send(&m, None, "GET", "/api/v1/nodes");
        send(&m, Some(201), "POST", "/api/v1/namespaces/a/events");
        let out = text(&m);
        for line in [
            r#"rest_client_requests_total{code="200",method="GET",host="127.0.0.1:6443"} 2"#,
            r#"rest_client_requests_total{code="403",method="GET",host="127.0.0.1:6443"} 1"#,
            r#"rest_client_requests_total{code="<error>",method="GET",host="127.0.0.1:6443"} 1"#,
            r#"rest_client_requests_total{code="201",method="POST",host="127.0.0.1:6443"} 1"#,
            // The watch is not timed: 3 GETs of 4.
            r#"rest_client_request_duration_seconds_count{verb="GET",host="127.0.0.1:6443"} 3"#,
            r#"rest_client_request_duration_seconds_count{verb="POST",host="127.0.0.1:6443"} 1"#,
            r#"rest_client_request_duration_seconds_bucket{le="60.0",verb="GET",host="127.0.0.1:6443"} 3"#,
        ] {
            assert!(out.lines().any(|l| l == line), "no {line} in\n{out}");
        }
        let buckets: Vec<&str> = out
            .lines()
            .filter(|l| l.contains(r#"verb="POST""#) && l.contains("_bucket"))
            .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(
            buckets,
            [
                "0.005", "0.025", "0.1", "0.25", "0.5", "1.0", "2.0", "4.0", "8.0", "15.0", "30.0",
                "60.0", "+Inf"
            ]
        );
    }

    #[test]
    fn host_is_the_base_urls_host_and_port_as_written() {
        let host = |u: &str| host_label(&u.parse().expect("url"));
        assert_eq!(host("https://10.96.0.1:443"), "10.96.0.1:443");
        assert_eq!(host("https://[fd00::1]:6443/"), "[fd00::1]:6443");
        assert_eq!(
            host("https://kubernetes.default.svc"),
            "kubernetes.default.svc"
        );
        assert_eq!(host("https://u:p@api.example:6443"), "api.example:6443");
        assert_eq!(host("/relative"), "none");
    }

    #[test]
    fn watches_are_told_by_their_query() {
        let w = |u: &str| is_watch(&u.parse().expect("uri"));
        assert!(w("/api/v1/services?watch=true"));
        assert!(w(
            "/api/v1/services?labelSelector=a&watch=1&timeoutSeconds=290"
        ));
        assert!(!w("/api/v1/services?watch=false"));
        assert!(!w("/api/v1/services?watchful=true"));
        assert!(!w("/api/v1/services"));
    }
}
