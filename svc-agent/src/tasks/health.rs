//! kube-proxy's health check node ports: for each LoadBalancer Service with
//! externalTrafficPolicy Local, an HTTP server on the Service's healthCheckNodePort that tells
//! the cloud load balancer whether to send traffic to this node
//! (pkg/proxy/healthcheck/service_health.go): 200 while the node has a ready endpoint of the
//! Service and the proxy is healthy, else 503; its JSON names the Service and the count.
//! Terminating endpoints do not count, so a node draining its last pod is taken out first.
//!
//! Each port listens where kube-proxy's does ([`binds`]): on the node addresses
//! `--nodeport-addresses` chooses, one listener each, or on the wildcard address of a family it
//! chooses whole. Servers start and stop as Services come and go, and listeners as those
//! addresses do; the counts change without a restart.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::sync::{Arc, Mutex};

use hyper::StatusCode;
use svc_common::{node_addr_flags, NodeAddrValue};
use tracing::info;

use crate::error::Error;
use crate::http::Answer;
use crate::metrics::Metrics;
use crate::model::HealthCheck;
use crate::netdev::{NetState, NodePortAddresses};

/// The counts each server answers with, by Service.
type Counts = Arc<Mutex<HashMap<String, [Option<u32>; 2]>>>;

/// Where a health check port listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Bind {
    /// Every address of both families: `[::]` taking IPv4 too, or 0.0.0.0 on a node without
    /// IPv6.
    Any,
    /// Every address of one family: 0.0.0.0, or `[::]` taking IPv6 alone.
    AnyOf { v6: bool },
    /// One node address; `scope`: the device of a link-local IPv6 one, else 0.
    Addr { ip: IpAddr, scope: u32 },
}

impl std::fmt::Display for Bind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bind::Any => f.write_str("[::] (IPv4 too)"),
            Bind::AnyOf { v6: false } => f.write_str("0.0.0.0"),
            Bind::AnyOf { v6: true } => f.write_str("[::]"),
            Bind::Addr { ip, scope: 0 } => write!(f, "{ip}"),
            Bind::Addr { ip, scope } => write!(f, "{ip}%{scope}"),
        }
    }
}

/// Where the health check ports listen, as kube-proxy's servers (newServiceHealthServer, one
/// per family): on the wildcard address of a family `--nodeport-addresses` chooses whole, else
/// on each address of that family it chooses (`addrs`' NodePort addresses) that the node holds
/// and can bind (not an IPv6 address still in duplicate address detection). kube-proxy reads
/// those addresses once, at start; the agent asks again whenever they change.
pub fn binds(
    nodeport: &NodePortAddresses,
    primary: &[IpAddr],
    addrs: &BTreeMap<IpAddr, NodeAddrValue>,
    state: &NetState,
) -> BTreeSet<Bind> {
    let all = [
        nodeport.matches_all(false, primary),
        nodeport.matches_all(true, primary),
    ];
    if all == [true, true] {
        return BTreeSet::from([Bind::Any]);
    }
    let mut out: BTreeSet<Bind> = [false, true]
        .into_iter()
        .filter(|v6| all[usize::from(*v6)])
        .map(|v6| Bind::AnyOf { v6 })
        .collect();
    for (ip, v) in addrs {
        if v.flags & node_addr_flags::NODEPORT == 0 || all[usize::from(ip.is_ipv6())] {
            continue;
        }
        // A primary address from the Node object need not be on this node.
        let Some(a) = state.addrs.iter().find(|a| a.ip == *ip && !a.tentative) else {
            continue;
        };
        let scope = match ip {
            IpAddr::V6(v6) if v6.is_unicast_link_local() => a.index,
            _ => 0,
        };
        out.insert(Bind::Addr { ip: *ip, scope });
    }
    // Loopback answers no NodePort from outside, but kube-proxy's health check servers
    // listen on every address the flag names, 127.0.0.1 and ::1 included (`localhost`).
    for a in state
        .addrs
        .iter()
        .filter(|a| a.ip.is_loopback() && !a.tentative)
    {
        if !all[usize::from(a.ip.is_ipv6())] && nodeport.covers(a.ip, primary) {
            out.insert(Bind::Addr { ip: a.ip, scope: 0 });
        }
    }
    out
}

/// One listener of a port, serving one Service.
struct Running {
    owner: String,
    task: tokio::task::JoinHandle<()>,
    /// Shared with the task: an aborted task closes its listener only when the runtime gets
    /// to it, so a port passed to another Service in the same sync is handed over instead of
    /// bound again.
    listener: Arc<tokio::net::TcpListener>,
}

pub struct HealthServers {
    counts: Counts,
    /// Where every port listens.
    binds: BTreeSet<Bind>,
    running: BTreeMap<(u16, Bind), Running>,
    metrics: Arc<Metrics>,
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for r in self.running.values() {
            r.task.abort();
        }
    }
}

impl HealthServers {
    /// Servers that will listen on `binds`.
    pub fn new(metrics: Arc<Metrics>, binds: BTreeSet<Bind>) -> HealthServers {
        HealthServers {
            counts: Arc::default(),
            binds,
            running: BTreeMap::new(),
            metrics,
        }
    }

    /// Where the ports listen from the next `sync` on.
    pub fn set_binds(&mut self, binds: BTreeSet<Bind>) {
        self.binds = binds;
    }

    /// Where the server of `owner` listens.
    pub fn addrs(&self, owner: &str) -> Vec<SocketAddr> {
        self.running
            .values()
            .filter(|r| r.owner == owner)
            .filter_map(|r| r.listener.local_addr().ok())
            .collect()
    }

    /// Makes the servers match `wanted`: each port listens on every bind for its Service,
    /// listeners no longer wanted (Service gone, moved to another port, address gone) close,
    /// counts are updated. A port that cannot be bound on an address is an error naming the
    /// Service, the port and the address, and leaves the other listeners alone; the next call
    /// tries again.
    pub fn sync(&mut self, wanted: &BTreeMap<String, HealthCheck>) -> Vec<Error> {
        {
            let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            counts.clear();
            for (owner, hc) in wanted {
                counts.insert(owner.clone(), hc.local_endpoints);
            }
        }
        let mut errors = Vec::new();
        // One Service per port (the first by name), as the API server allocates them.
        let mut ports: BTreeMap<u16, &str> = BTreeMap::new();
        for (owner, hc) in wanted {
            match ports.entry(hc.port) {
                Entry::Vacant(e) => {
                    e.insert(owner);
                }
                Entry::Occupied(e) => errors.push(Error::Invalid {
                    object: format!("Service {owner}"),
                    message: format!(
                        "healthCheckNodePort {} is Service {}'s too, which answers on it",
                        hc.port,
                        e.get()
                    ),
                }),
            }
        }
        let want: BTreeMap<(u16, Bind), &str> = ports
            .iter()
            .flat_map(|(port, owner)| self.binds.iter().map(move |b| ((*port, *b), *owner)))
            .collect();
        let keys: Vec<(u16, Bind)> = self.running.keys().copied().collect();
        for key in keys {
            let (port, bind) = key;
            match want.get(&key) {
                Some(owner) if self.running.get(&key).is_some_and(|r| r.owner == *owner) => {}
                Some(owner) => {
                    if let Some(r) = self.running.get_mut(&key) {
                        r.task.abort();
                        info!(service = %owner, from = %r.owner, port, addr = %bind, "health check node port handed over");
                        r.owner = owner.to_string();
                        r.task = tokio::spawn(serve(
                            r.listener.clone(),
                            r.owner.clone(),
                            self.counts.clone(),
                            self.metrics.clone(),
                        ));
                    }
                }
                None => {
                    if let Some(r) = self.running.remove(&key) {
                        r.task.abort();
                        info!(service = %r.owner, port, addr = %bind, "health check node port closed");
                    }
                }
            }
        }
        for (&(port, bind), owner) in &want {
            if self.running.contains_key(&(port, bind)) {
                continue;
            }
            match listen(port, bind) {
                Ok(listener) => {
                    let listener = Arc::new(listener);
                    let task = tokio::spawn(serve(
                        listener.clone(),
                        owner.to_string(),
                        self.counts.clone(),
                        self.metrics.clone(),
                    ));
                    info!(service = %owner, port, addr = %bind, "health check node port open");
                    self.running.insert(
                        (port, bind),
                        Running {
                            owner: owner.to_string(),
                            task,
                            listener,
                        },
                    );
                }
                Err(source) => errors.push(Error::HealthCheck {
                    service: owner.to_string(),
                    port,
                    addr: bind.to_string(),
                    source,
                }),
            }
        }
        errors
    }
}

/// A listener on `port` of `bind`.
fn listen(port: u16, bind: Bind) -> std::io::Result<tokio::net::TcpListener> {
    let listener = match bind {
        Bind::Any => bind_dual_stack(port).or_else(|e| match e.raw_os_error() {
            Some(libc::EAFNOSUPPORT) | Some(libc::EADDRNOTAVAIL) => {
                socket(SocketAddr::from(([0u8; 4], port)), None)
            }
            _ => Err(e),
        })?,
        Bind::AnyOf { v6: false } => socket(SocketAddr::from(([0u8; 4], port)), None)?,
        Bind::AnyOf { v6: true } => socket(SocketAddr::from(([0u16; 8], port)), Some(true))?,
        Bind::Addr {
            ip: IpAddr::V6(ip),
            scope,
        } => socket(SocketAddrV6::new(ip, port, 0, scope).into(), None)?,
        Bind::Addr { ip, .. } => socket(SocketAddr::new(ip, port), None)?,
    };
    listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(listener)
}

/// `[::]:port` taking IPv4 too whatever `net.ipv6.bindv6only` says, as Go's listener on
/// ":port" (kube-proxy's) does: a load balancer probes the node's IPv4 address.
fn bind_dual_stack(port: u16) -> std::io::Result<std::net::TcpListener> {
    socket(SocketAddr::from(([0u16; 8], port)), Some(false))
}

/// A listening socket on `addr`; `only_v6`: IPV6_V6ONLY, when the sysctl's default will not
/// do.
fn socket(addr: SocketAddr, only_v6: Option<bool>) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if let Some(only) = only_v6 {
        s.set_only_v6(only)?;
    }
    // As std's bind does: a port a closed server left in TIME_WAIT is bound again at once.
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(1024)?;
    Ok(s.into())
}

/// kube-proxy's answer (hcHandler.ServeHTTP), byte for byte in the body, with the headers Go's
/// HTTP server sends (the Date is the server's).
pub fn answer(owner: &str, count: u32, healthy: bool) -> Answer {
    let (namespace, name) = owner.split_once('/').unwrap_or(("", owner));
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        serde_json::Value::from(namespace),
        serde_json::Value::from(name),
    );
    let status = if count != 0 && healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Answer {
        status,
        content_type: "application/json",
        extra: Some(("x-load-balancing-endpoint-weight", count.to_string())),
        body,
    }
}

async fn serve(
    listener: Arc<tokio::net::TcpListener>,
    owner: String,
    counts: Counts,
    metrics: Arc<Metrics>,
) {
    let what = format!("the health check node port of Service {owner}");
    let conns = metrics.conns.clone();
    // kube-proxy answers any request the same: only that one arrived matters.
    crate::http::serve(listener, conns, what, move |_, _, local: SocketAddr| {
        // The state when the request came, not when the connection did. The family of the
        // address asked: kube-proxy runs one server per family, each counting that family's
        // endpoints.
        let v6 = local.ip().to_canonical().is_ipv6();
        let count = counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&owner)
            .and_then(|c| c[usize::from(v6)])
            .unwrap_or(0);
        let healthy = metrics.service_healthy(&owner);
        std::future::ready(answer(&owner, count, healthy))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// On a node with `net.ipv6.bindv6only=1` the port must still answer IPv4 health checks
    /// (a cloud load balancer probes the node's IPv4 address): kube-proxy's Go listener on
    /// ":port" is dual-stack whatever the sysctl says. In a network namespace of the test's
    /// own (a thread that unshares it), where the sysctl is set; needs root.
    #[test]
    fn the_port_answers_ipv4_where_ipv6_sockets_default_to_ipv6_only() {
        let outcome = std::thread::spawn(|| -> Result<(), String> {
            // SAFETY: moves this thread alone into a new network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(format!("unshare: {}", std::io::Error::last_os_error()));
            }
            // Per network namespace: the writer's, this thread's new one.
            std::fs::write("/proc/sys/net/ipv6/bindv6only", "1")
                .map_err(|e| format!("bindv6only: {e}"))?;
            let lo = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .map_err(|e| format!("ip: {e}"))?;
            if !lo.success() {
                return Err("ip link set lo up failed".into());
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let listener = listen(0, Bind::Any).map_err(|e| format!("bind: {e}"))?;
                let port = listener.local_addr().map_err(|e| e.to_string())?.port();
                let accept = tokio::spawn(async move { listener.accept().await.is_ok() });
                tokio::time::timeout(
                    Duration::from_secs(2),
                    tokio::net::TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port))),
                )
                .await
                .map_err(|_| "IPv4 connect timed out".to_string())?
                .map_err(|e| format!("IPv4 connect to port {port}: {e}"))?;
                accept.await.map_err(|e| e.to_string())?;
                Ok(())
            })
        })
        .join()
        .expect("the test thread");
        outcome.unwrap();
    }

    #[test]
    fn the_answer_is_kube_proxys() {
        let ok = answer("shop/web", 2, true);
        assert_eq!(ok.status, StatusCode::OK);
        assert_eq!(
            ok.extra,
            Some(("x-load-balancing-endpoint-weight", "2".to_string()))
        );
        assert_eq!(
            ok.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let v: serde_json::Value = serde_json::from_str(&ok.body).unwrap();
        assert_eq!(v["service"]["name"], "web");
        assert_eq!(
            answer("shop/web", 0, true).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            answer("shop/web", 3, false).status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    async fn get(addr: SocketAddr) -> String {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        c.read_to_string(&mut reply).await.unwrap();
        reply
    }

    /// Metrics of an agent that has synced with its programs attached, `failing` the Services
    /// it could not program.
    fn synced_metrics(failing: Vec<String>) -> Arc<Metrics> {
        let metrics = Metrics::new(
            std::path::PathBuf::from("/nonexistent"),
            Duration::from_secs(60),
        );
        metrics.synced(
            Duration::from_millis(1),
            true,
            crate::metrics::Programmed {
                attached: true,
                failing,
                ..Default::default()
            },
        );
        metrics
    }

    /// A free port, released for a server to take.
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Through real sockets on loopback: started, counts followed live, stopped.
    #[tokio::test]
    async fn servers_follow_the_services() {
        let mut servers =
            HealthServers::new(synced_metrics(Vec::new()), BTreeSet::from([Bind::Any]));
        let port = free_port();
        let mut wanted = BTreeMap::new();
        wanted.insert(
            "ns/web".to_string(),
            HealthCheck {
                port,
                local_endpoints: [Some(1), None],
            },
        );
        assert!(servers.sync(&wanted).is_empty());
        let at = SocketAddr::from(([127, 0, 0, 1], port));
        let reply = get(at).await;
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        // The headers kube-proxy's Go server sends.
        for h in [
            "Content-Type: application/json",
            "X-Content-Type-Options: nosniff",
            "X-Load-Balancing-Endpoint-Weight: 1",
            "Connection: close",
        ] {
            assert!(reply.contains(&format!("\r\n{h}\r\n")), "{h}: {reply}");
        }
        assert!(reply.contains("\r\nDate: "), "{reply}");
        wanted.get_mut("ns/web").unwrap().local_endpoints = [Some(0), None];
        assert!(servers.sync(&wanted).is_empty());
        let reply = get(at).await;
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("\"localEndpoints\": 0"));
        // Over IPv6 the IPv6 count (none: the Service has no IPv6 clusterIP) answers.
        if let Ok(mut c) =
            tokio::net::TcpStream::connect(SocketAddr::from(([0, 0, 0, 0, 0, 0, 0, 1], port))).await
        {
            c.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            let mut reply = String::new();
            c.read_to_string(&mut reply).await.unwrap();
            assert!(reply.starts_with("HTTP/1.1 503"));
        }
        assert!(servers.sync(&BTreeMap::new()).is_empty());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(tokio::net::TcpStream::connect(at).await.is_err(), "closed");
    }

    /// One sync stops a Service's server and starts another Service's on the same port (a
    /// Service renamed in a manifest, healthCheckNodePorts swapped): the port must answer for
    /// the new Service at once, as kube-proxy's (which closes before it listens), not be
    /// refused until the next retry.
    #[tokio::test]
    async fn a_port_handed_from_one_service_to_another_in_one_sync_answers_at_once() {
        let mut servers =
            HealthServers::new(synced_metrics(Vec::new()), BTreeSet::from([Bind::Any]));
        let port = free_port();
        let hc = HealthCheck {
            port,
            local_endpoints: [Some(1), None],
        };
        let wanted = BTreeMap::from([("ns/old".to_string(), hc)]);
        assert!(servers.sync(&wanted).is_empty());
        let wanted = BTreeMap::from([("ns/new".to_string(), hc)]);
        let errors: Vec<String> = servers
            .sync(&wanted)
            .iter()
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
        assert!(!servers.addrs("ns/new").is_empty());
        let reply = get(SocketAddr::from(([127, 0, 0, 1], port))).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.contains("\"name\": \"new\""), "{reply}");
    }

    /// One Service that cannot be programmed (more endpoints than a frontend holds, a map
    /// full) must not take every other LoadBalancer's health check down with it: each node
    /// fails the same way, so every cloud load balancer would drain every node. kube-proxy's
    /// serviceProxyHealthy says whether the proxy keeps up, not whether all of the cluster's
    /// Services fit.
    #[tokio::test]
    async fn another_service_that_cannot_be_programmed_leaves_this_one_healthy() {
        let mut servers = HealthServers::new(
            synced_metrics(vec!["tenant/huge".to_string()]),
            BTreeSet::from([Bind::Any]),
        );
        let port = free_port();
        let hc = HealthCheck {
            port,
            local_endpoints: [Some(1), None],
        };
        let wanted = BTreeMap::from([("shop/web".to_string(), hc)]);
        assert!(servers.sync(&wanted).is_empty());
        let reply = get(SocketAddr::from(([127, 0, 0, 1], port))).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.contains("\"serviceProxyHealthy\": true"), "{reply}");
    }

    /// kube-proxy's rule, per family: the addresses `--nodeport-addresses` chooses that the
    /// node holds, or the wildcard address of a family it chooses whole.
    #[test]
    fn ports_listen_where_kube_proxys_do() {
        let addr = |index: u32, ip: &str, tentative: bool| crate::netdev::Addr {
            index,
            ip: ip.parse().unwrap(),
            prefix: 24,
            global: !ip.starts_with("fe80") && !ip.starts_with("127") && ip != "::1",
            tentative,
        };
        let state = NetState {
            links: Vec::new(),
            addrs: vec![
                addr(1, "127.0.0.1", false),
                addr(1, "::1", false),
                addr(2, "10.0.0.5", false),
                addr(2, "2001:db8::5", false),
                addr(2, "fe80::5", false),
                // Duplicate address detection not over: not bindable yet.
                addr(2, "2001:db8::9", true),
                // The pod network's side of the node.
                addr(3, "10.244.0.1", false),
            ],
            default_route_devices: [2].into(),
        };
        let at = |flag: &[&str], primary: &[&str]| -> Vec<String> {
            let flag: Vec<String> = flag.iter().map(|s| s.to_string()).collect();
            let cfg = NodePortAddresses::parse(&flag).unwrap();
            let primary: Vec<IpAddr> = primary.iter().map(|p| p.parse().unwrap()).collect();
            let addrs = crate::netdev::node_addrs(&state, &[], &cfg, &primary, true);
            binds(&cfg, &primary, &addrs, &state)
                .iter()
                .map(|b| b.to_string())
                .collect()
        };
        assert_eq!(
            at(&["primary"], &["10.0.0.5", "2001:db8::5"]),
            ["10.0.0.5", "2001:db8::5"]
        );
        // A Node's address this node does not hold (kube-proxy matches the interfaces'); the
        // family without a node IP is chosen whole, as kube-proxy's zero CIDR.
        assert_eq!(at(&["primary"], &["192.0.2.1"]), ["[::]"]);
        assert_eq!(at(&["primary"], &["10.0.0.5"]), ["[::]", "10.0.0.5"]);
        assert_eq!(
            at(&["10.0.0.0/8", "2001:db8::/64", "fe80::/10"], &[]),
            ["10.0.0.5", "10.244.0.1", "2001:db8::5", "fe80::5%2"]
        );
        assert_eq!(at(&["10.0.0.0/24"], &[]), ["[::]", "10.0.0.5"]);
        assert_eq!(at(&["all"], &[]), ["[::] (IPv4 too)"]);
        assert_eq!(at(&["0.0.0.0/0", "::/0"], &[]), ["[::] (IPv4 too)"]);
        assert_eq!(
            at(&["0.0.0.0/0", "2001:db8::/64"], &[]),
            ["0.0.0.0", "2001:db8::5"]
        );
        assert_eq!(at(&["10.0.0.0/24", "::/0"], &[]), ["[::]", "10.0.0.5"]);
        // Loopback named: listened on, as kube-proxy's servers do, IPv6 too.
        assert_eq!(
            at(&["primary", "localhost"], &["10.0.0.5", "2001:db8::5"]),
            ["10.0.0.5", "127.0.0.1", "::1", "2001:db8::5"]
        );
        assert_eq!(
            at(&["10.0.0.0/8", "127.0.0.1/32"], &[]),
            ["[::]", "10.0.0.5", "10.244.0.1", "127.0.0.1"]
        );
    }

    fn addr_binds(ips: &[&str]) -> BTreeSet<Bind> {
        ips.iter()
            .map(|ip| Bind::Addr {
                ip: ip.parse().unwrap(),
                scope: 0,
            })
            .collect()
    }

    /// A port another socket holds on one address: an error naming the Service, the port and
    /// that address, while the port answers on the other address and other ports are not
    /// touched; the next sync binds it once it is free. An address that goes closes its
    /// listeners alone.
    #[tokio::test]
    async fn a_port_taken_on_one_address_fails_there_alone_and_is_retried() {
        let mut servers = HealthServers::new(
            synced_metrics(Vec::new()),
            addr_binds(&["127.0.0.1", "127.0.0.2"]),
        );
        let (port, other) = (free_port(), free_port());
        let hc = |port| HealthCheck {
            port,
            local_endpoints: [Some(1), None],
        };
        let wanted = BTreeMap::from([
            ("ns/web".to_string(), hc(port)),
            ("ns/api".to_string(), hc(other)),
        ]);
        let blocker = std::net::TcpListener::bind(("127.0.0.2", port)).unwrap();
        let errors = servers.sync(&wanted);
        let text: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(text.len(), 1, "{text:?}");
        assert!(
            text[0].starts_with(&format!(
                "Service ns/web: healthCheckNodePort {port} on 127.0.0.2: "
            )),
            "{text:?}"
        );
        assert_eq!(errors[0].kind(), "health_check");
        let web = |ip: [u8; 4]| SocketAddr::from((ip, port));
        let reply = get(web([127, 0, 0, 1])).await;
        assert!(reply.contains("\"name\": \"web\""), "{reply}");
        let reply = get(SocketAddr::from(([127, 0, 0, 2], other))).await;
        assert!(reply.contains("\"name\": \"api\""), "{reply}");

        drop(blocker);
        let errors: Vec<String> = servers
            .sync(&wanted)
            .iter()
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
        let reply = get(web([127, 0, 0, 2])).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");

        servers.set_binds(addr_binds(&["127.0.0.1"]));
        assert!(servers.sync(&wanted).is_empty());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            tokio::net::TcpStream::connect(web([127, 0, 0, 2]))
                .await
                .is_err(),
            "the address gone still listens"
        );
        assert!(get(web([127, 0, 0, 1])).await.starts_with("HTTP/1.1 200"));
    }

    /// Two Services naming one healthCheckNodePort (manifests; the API server never allocates
    /// one twice): the first by name answers, the other is an error.
    #[tokio::test]
    async fn a_port_two_services_claim_answers_for_one() {
        let mut servers =
            HealthServers::new(synced_metrics(Vec::new()), addr_binds(&["127.0.0.1"]));
        let port = free_port();
        let hc = HealthCheck {
            port,
            local_endpoints: [Some(1), None],
        };
        let wanted = BTreeMap::from([("ns/b".to_string(), hc), ("ns/a".to_string(), hc)]);
        let errors: Vec<String> = servers
            .sync(&wanted)
            .iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(
            errors,
            [format!(
                "Service ns/b: healthCheckNodePort {port} is Service ns/a's too, which answers on it"
            )]
        );
        let reply = get(SocketAddr::from(([127, 0, 0, 1], port))).await;
        assert!(reply.contains("\"name\": \"a\""), "{reply}");
    }
}
