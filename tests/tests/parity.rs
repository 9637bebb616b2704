//! Differential parity with the real kube-proxy: every scenario is written once and runs against
//! svc, svc with native XDP on its packet devices (`svc-xdp`), and kube-proxy (iptables mode on
//! both iptables backends, Debian's default iptables-nft and iptables-legacy, and nftables
//! mode; `SVC_PARITY_PROXIES` chooses fewer, e.g. `svc,svc-xdp,nftables`), all at once, on one
//! API server, with the same objects and the same client probes. See `svc_tests::parity` for
//! the topology, the XDP column and what an outcome is.
//!
//! Each scenario is a test of its own (libtest-mimic, as `kube.rs`): `cargo test -p svc-tests
//! --test parity -- topology` runs one. A scenario fails when svc's outcome differs from a
//! kube-proxy's and `tests/intended-differences.yaml` does not list that difference with its
//! reason. After the last scenario the whole table (scenario x proxy) is printed, and written
//! to `$SVC_PARITY_TABLE` when set (`cargo xtask parity --write` writes docs/parity.md); an
//! entry of the file that no longer matches what was seen fails the run, and so does any
//! change to the machine's own firewall (checked before and after).
//!
//! NodePort, ExternalIPs, LoadBalancer IPs, externalTrafficPolicy: Local, source ranges (IPv4
//! and IPv6), the health check node port (its status, headers and body) and sessionAffinity
//! for external traffic are probed from an external client in front of the node's uplink
//! (`Sandbox::add_uplink`), outside svc's cgroup: for svc that traffic meets its tc programs
//! (the packet datapath), for svc-xdp its XDP program first, for kube-proxy its PREROUTING
//! rules, as in a cluster. svc-xdp's outcomes must equal svc's in every row, and the run fails
//! when XDP sent on none of the packets of the checks from outside (the agent's counters,
//! read around each scenario and printed after the table).

use std::{
    net::{IpAddr, SocketAddr},
    process::ExitCode,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{json, Value};
use svc_tests::{
    control_plane::ControlPlane,
    kube_proxy::{self, HostFirewallGuard, IptablesBackend, Mode},
    parity::{
        self, each, judge, observe, observe_with, Cell, IntendedDifference, Origin, Outcome, Probe,
        Proxy, ProxyKind, Row, XdpCounters, NODE,
    },
    require_root, Backend, Tools,
};

/// First programming after objects appear, with kube-proxy's 1 s minimum sync period and a
/// loaded machine.
const SETTLE: Duration = Duration::from_secs(20);
/// A live change; the time each proxy took is shown in the table.
const LIVE: Duration = Duration::from_secs(10);
/// The third octet of every sandbox: the same addresses behind every proxy.
const X: u8 = 77;

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const HEADLESS: &str = "service.kubernetes.io/headless";
const SERVICE_NAME: &str = "kubernetes.io/service-name";
const ZONE: &str = "topology.kubernetes.io/zone";

/// Outcomes of a frontend nothing serves, whichever way a proxy says so.
const NOT_SERVED: &[&str] = &["refused", "timeout", "EPERM", "unreachable"];

type ScenarioFn = fn(&mut Ctx) -> Result<()>;

/// Every scenario, by name (also its Kubernetes namespace).
const SCENARIOS: &[(&str, ScenarioFn)] = &[
    ("ports", ports),
    ("named-ports", named_ports),
    ("merge", merge),
    ("dual-stack", dual_stack),
    ("no-endpoints", no_endpoints),
    ("undefined-port", undefined_port),
    ("conditions", conditions),
    ("local", internal_traffic_local),
    ("publish-not-ready", publish_not_ready),
    ("topology", topology),
    ("affinity", affinity),
    ("headless", headless),
    ("external-name", external_name),
    ("proxy-name", proxy_name),
    ("udp-replacement", udp_replacement),
    ("udp-stream", udp_stream),
    // The packet datapath: traffic from the external client, through the node's uplink.
    ("nodeport", nodeport),
    ("external-ips", external_ips),
    ("loadbalancer-ips", loadbalancer_ips),
    (
        "external-traffic-policy-local",
        external_traffic_policy_local,
    ),
    ("source-ranges", source_ranges),
    ("source-ranges-v6", source_ranges_v6),
    ("health-check-node-port", health_check_node_port),
    ("external-affinity", external_affinity),
];

fn proxies_wanted() -> Result<Vec<ProxyKind>> {
    match std::env::var("SVC_PARITY_PROXIES") {
        Ok(list) => list
            .split(',')
            .map(|id| {
                ProxyKind::parse(id.trim())
                    .with_context(|| format!("SVC_PARITY_PROXIES: unknown proxy {id:?}"))
            })
            .collect(),
        Err(_) => Ok(vec![
            ProxyKind::Svc,
            ProxyKind::SvcXdp,
            ProxyKind::KubeProxy(Mode::Iptables(IptablesBackend::Nft)),
            ProxyKind::KubeProxy(Mode::Iptables(IptablesBackend::Legacy)),
            ProxyKind::KubeProxy(Mode::Nftables),
        ]),
    }
}

fn intended_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("intended-differences.yaml")
}

/// The control plane and the proxies every scenario shares, started by the first scenario.
struct World {
    kinds: Vec<ProxyKind>,
    // Drop order: the proxies stop before the control plane.
    proxies: Vec<Proxy>,
    cp: ControlPlane,
}

impl World {
    fn start() -> Result<World> {
        let kinds = proxies_wanted()?;
        let cp = ControlPlane::start().context("starting the control plane")?;
        let tools = Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe"));
        let kube_proxy = if kinds.iter().any(|k| matches!(k, ProxyKind::KubeProxy(_))) {
            Some(kube_proxy::binary_from_env()?)
        } else {
            None
        };
        // The node every proxy plays: its InternalIPs are the client addresses of the sandboxes.
        let node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "labels": {ZONE: "zone-a"}},
            "status": {"addresses": [
                {"type": "InternalIP", "address": format!("10.201.{X}.1")},
                {"type": "InternalIP", "address": format!("fd00:201:{X}::1")},
            ]},
        });
        // Created, not applied: server-side apply cannot merge two addresses of one type.
        cp.kubectl_stdin(&["create", "-f", "-"], &node.to_string())?;
        // One after the other, from this thread: the proxies get SIGKILL when the thread that
        // spawned them ends (PR_SET_PDEATHSIG), and this one lasts as long as the run.
        let proxies = kinds
            .iter()
            .map(|&k| {
                Proxy::start(k, &cp, &tools, X, kube_proxy.as_deref())
                    .with_context(|| format!("starting {}", k.label()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(World { kinds, proxies, cp })
    }
}

/// What the run shares: the world (started once), the rows so far, the intended differences.
#[derive(Default)]
struct Run {
    world: Mutex<Option<World>>,
    started: OnceLock<Result<(), String>>,
    rows: Mutex<Vec<Row>>,
    intended: Vec<IntendedDifference>,
    /// Each failed scenario and why, without the proxies' logs: repeated as the run's last
    /// lines, where a CI log cut to its end still shows them.
    failures: Mutex<Vec<(String, String)>>,
    /// The XDP column's packets decided at XDP during each scenario, and how many of the
    /// scenario's observations came from outside (the ones XDP can serve).
    xdp: Mutex<Vec<XdpScenario>>,
}

/// What XDP did in the XDP column during one scenario.
#[derive(Clone, Debug)]
struct XdpScenario {
    name: String,
    counted: XdpCounters,
    external_checks: u32,
}

impl Run {
    fn scenario(&self, name: &str, f: ScenarioFn) -> Result<(), String> {
        require_root();
        self.started
            .get_or_init(|| match World::start() {
                Ok(w) => {
                    *self.world.lock().unwrap_or_else(PoisonError::into_inner) = Some(w);
                    Ok(())
                }
                Err(e) => Err(format!("{e:#}")),
            })
            .clone()?;
        let guard = self.world.lock().unwrap_or_else(PoisonError::into_inner);
        let world = guard.as_ref().expect("started");
        let mut ctx = Ctx {
            world,
            name: name.to_string(),
            rows: Vec::new(),
            backends: Vec::new(),
            dirty: Default::default(),
            sentinel: Default::default(),
            external_checks: 0,
        };
        let t = Instant::now();
        let xdp_proxy = world.proxies.iter().find(|p| p.kind == ProxyKind::SvcXdp);
        let xdp_before = xdp_proxy.map(Proxy::xdp_counters).transpose();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ctx.namespace()?;
            // The sentinel's two backends (see `Ctx::settle`).
            for p in &world.proxies {
                ctx.backends.push(p.sb.backend("s7", 7, &[9999])?);
                ctx.backends.push(p.sb.backend("s8", 8, &[9999])?);
            }
            f(&mut ctx)
        }));
        let result = match result {
            Ok(r) => r.map_err(|e| format!("{e:#}")),
            Err(_) => Err("panicked".to_string()),
        };
        ctx.clean_up();
        // The XDP column's counters over the scenario; failing to read them fails it.
        let result = match (result, xdp_before, xdp_proxy.map(Proxy::xdp_counters)) {
            (Err(e), _, _) => Err(e),
            (Ok(()), Ok(Some(before)), Some(Ok(after))) => {
                let counted = after.since(&before);
                if verbose() {
                    eprintln!("    {name}: XDP column counted {:?}", counted.0);
                }
                self.xdp
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(XdpScenario {
                        name: name.to_string(),
                        counted,
                        external_checks: ctx.external_checks,
                    });
                Ok(())
            }
            (Ok(()), Ok(None), None) => Ok(()),
            (Ok(()), Err(e), _) | (Ok(()), _, Some(Err(e))) => {
                Err(format!("reading the XDP column's counters: {e:#}"))
            }
            (Ok(()), _, _) => Err("the XDP column's counters: read once only".to_string()),
        };
        let rows = std::mem::take(&mut ctx.rows);
        let mut unexplained = Vec::new();
        for row in &rows {
            unexplained.extend(judge(row, &self.intended).0);
        }
        if verbose() {
            eprintln!("{}", parity::markdown(&rows, &world.kinds, &self.intended));
        }
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(rows);
        // Why it failed, and what only the full report shows: the proxies' logs.
        let failure = match (result, unexplained.is_empty()) {
            (Ok(()), true) => None,
            (Ok(()), false) => Some((
                format!(
                    "svc differs from kube-proxy (or its XDP column from svc), and \
                     tests/intended-differences.yaml does not say why:\n  {}",
                    unexplained.join("\n  ")
                ),
                String::new(),
            )),
            (Err(e), _) => {
                let logs: Vec<String> = world
                    .proxies
                    .iter()
                    .map(|p| {
                        format!(
                            "\n--- {} (end of log) ---\n{}",
                            p.kind.label(),
                            tail(&p.log(), 25)
                        )
                    })
                    .collect();
                Some((e, logs.concat()))
            }
        };
        let outcome = match failure {
            None => Ok(()),
            Some((why, logs)) => {
                self.failures
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((name.to_string(), why.clone()));
                Err(format!("{why}{logs}"))
            }
        };
        eprintln!(
            "=== {name}: {} ({:.1?})",
            if outcome.is_ok() { "ok" } else { "FAILED" },
            t.elapsed()
        );
        outcome
    }
}

/// Each check's outcomes as they come, with `--nocapture`; the table comes at the end anyway.
fn verbose() -> bool {
    VERBOSE.get().copied().unwrap_or(false)
}

static VERBOSE: OnceLock<bool> = OnceLock::new();

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    // One scenario at a time, on this thread: the proxies started by the first one must live
    // as long as the run (their processes die with the thread that spawned them).
    args.test_threads = Some(1);
    let _ = VERBOSE.set(args.nocapture);
    let intended = match parity::load_intended(&intended_path()) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    };
    let listing = args.list;
    let firewall = if listing {
        None
    } else {
        require_root();
        match HostFirewallGuard::new() {
            Ok(g) => Some(g),
            Err(e) => {
                eprintln!("reading the machine's firewall: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    };
    let run = Arc::new(Run {
        intended,
        ..Default::default()
    });
    let trials = SCENARIOS
        .iter()
        .map(|&(name, f)| {
            let run = run.clone();
            Trial::test(name, move || run.scenario(name, f).map_err(Failed::from))
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if listing {
        return conclusion.exit_code();
    }
    let mut failed = false;
    let world = run
        .world
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    let kinds = world.as_ref().map(|w| w.kinds.clone()).unwrap_or_default();
    drop(world);
    let rows = std::mem::take(&mut *run.rows.lock().unwrap_or_else(PoisonError::into_inner));
    if !rows.is_empty() {
        let table = parity::markdown(&rows, &kinds, &run.intended);
        println!("\n{table}");
        // Entries for checks that ran and matched nothing: the file says something that is no
        // longer true.
        let mut used = std::collections::BTreeSet::new();
        for row in &rows {
            used.extend(judge(row, &run.intended).1);
        }
        for (i, d) in run.intended.iter().enumerate() {
            let ran = rows.iter().any(|r| r.check == d.check);
            let proxy_ran = kinds.iter().any(|k| k.id().starts_with(&d.proxy));
            if ran && proxy_ran && !used.contains(&i) {
                eprintln!(
                    "tests/intended-differences.yaml: `{}` vs {} (svc `{}`, kube-proxy `{}`) \
                     no longer happens: remove or correct the entry",
                    d.check, d.proxy, d.svc, d.kube_proxy
                );
                failed = true;
            }
        }
        let xdp = std::mem::take(&mut *run.xdp.lock().unwrap_or_else(PoisonError::into_inner));
        let xdp_table = xdp_markdown(&xdp);
        if !xdp.is_empty() {
            println!("\n{xdp_table}");
        }
        if let Err(e) = xdp_served(&xdp) {
            eprintln!("{e:#}");
            failed = true;
        }
        if let Ok(path) = std::env::var("SVC_PARITY_TABLE") {
            if let Err(e) = write_table(std::path::Path::new(&path), &table, &xdp_table, &kinds) {
                eprintln!("writing {path}: {e:#}");
                failed = true;
            }
        }
    }
    if let Some(mut fw) = firewall {
        if let Err(e) = fw.check() {
            eprintln!("{e:#}");
            failed = true;
        }
    }
    let failures =
        std::mem::take(&mut *run.failures.lock().unwrap_or_else(PoisonError::into_inner));
    for (name, why) in &failures {
        eprintln!("parity: scenario {name} failed: {why}");
    }
    if failed {
        return ExitCode::FAILURE;
    }
    conclusion.exit_code()
}

/// The XDP column must have been served by XDP: a column whose traffic from outside all went
/// through tc would show tc's outcomes under XDP's name, and could never fail for XDP. So over
/// the scenarios with observations from outside, XDP must have sent packets on itself
/// (`xdp_new`, `xdp_ct_hit`, `xdp_reply`).
fn xdp_served(xdp: &[XdpScenario]) -> Result<()> {
    let external: u32 = xdp.iter().map(|s| s.external_checks).sum();
    if external == 0 {
        return Ok(());
    }
    let mut total = XdpCounters::default();
    for s in xdp.iter().filter(|s| s.external_checks > 0) {
        total.add(&s.counted);
    }
    ensure!(
        total.served() > 0,
        "the XDP column: XDP sent none of the packets of {external} observations from outside \
         (counted at XDP: {:?}); tc served them all, so the column says nothing about XDP",
        total.0
    );
    Ok(())
}

/// What XDP did in the XDP column, scenario by scenario, as Markdown.
fn xdp_markdown(xdp: &[XdpScenario]) -> String {
    let mut reasons: std::collections::BTreeSet<&str> = XdpCounters::SERVED.into();
    for s in xdp {
        reasons.extend(s.counted.0.keys().map(String::as_str));
    }
    let mut out = String::from("| scenario | checks from outside |");
    for r in &reasons {
        out += &format!(" `{r}` |");
    }
    out += "\n|---|---|";
    for _ in &reasons {
        out += "---|";
    }
    out += "\n";
    let mut total = XdpCounters::default();
    for s in xdp {
        total.add(&s.counted);
        // Scenarios from the node alone: nothing for XDP, nothing to show.
        if s.external_checks == 0 && s.counted.0.is_empty() {
            continue;
        }
        out += &format!("| `{}` | {} |", s.name, s.external_checks);
        for r in &reasons {
            out += &format!(" {} |", s.counted.get(r));
        }
        out += "\n";
    }
    let external: u32 = xdp.iter().map(|s| s.external_checks).sum();
    out += &format!("| all | {external} |");
    for r in &reasons {
        out += &format!(" {} |", total.get(r));
    }
    out += "\n";
    out
}

fn write_table(
    path: &std::path::Path,
    table: &str,
    xdp_table: &str,
    kinds: &[ProxyKind],
) -> Result<()> {
    let proxies: Vec<String> = kinds.iter().map(|k| k.label()).collect();
    let (xdp_intro, xdp_after) = if kinds.contains(&ProxyKind::SvcXdp) {
        (
            "The column svc (XDP native) is svc again, in a sandbox of its own, with \
             `--xdp-mode native` on both packet devices (the uplink and the device towards the \
             backends), as on a node whose NICs run XDP: traffic from outside meets svc's XDP \
             program first, which finishes what it can (new flows to another node's endpoint, \
             packets of the flows it knows, their replies) and passes the rest to the tc \
             programs untouched (docs/design/xdp.md). The checks from the node itself run there \
             too, through the same socket programs as svc's. Its outcomes must equal svc's in \
             every row (a difference fails the test, whatever kube-proxy saw); where they differ \
             from kube-proxy's, svc's entries in `tests/intended-differences.yaml` cover it. \
             What XDP did in that column is in the table after the notes; the run fails when \
             XDP sent on none of the packets of the checks from outside, as a column served by \
             tc alone would.\n\n"
                .to_string(),
            format!(
                "\nWhat XDP did in the svc (XDP native) column, scenario by scenario (the \
                 agent's `svc_packet_decisions_total`, summed over both devices, read before \
                 and after each scenario): packets sent on at XDP (`xdp_new` a new flow's \
                 first, `xdp_ct_hit` a known flow's, `xdp_reply` a backend's reply; \
                 `xdp_redirect`, `xdp_redirect_reply` those of them sent out of the other \
                 device) and packets passed to tc (`xdp_pass_new`: a new flow tc decides, \
                 such as a sessionAffinity's or a refusal; `xdp_pass_local`: to an \
                 endpoint on this node; `xdp_pass_route`: a route XDP cannot take). A scenario \
                 with checks from the node alone is left out when XDP counted nothing in \
                 it.\n\n\
                 {xdp_table}"
            ),
        )
    } else {
        (String::new(), String::new())
    };
    let text = format!(
        "# svc and kube-proxy side by side\n\n\
         Written by `cargo xtask parity --write` (`tests/tests/parity.rs`) on {machine}, {date}: \
         kube-proxy v1.37.2 built from the pinned modules, {proxies}, all against one \
         kube-apiserver with the same Services and EndpointSlices and the same client probes. \
         How the proxies and the clients are placed, and what an outcome is: \
         `tests/src/parity.rs`. A cell is what the client saw: the backends that answered \
         (`b1,b2`), or how its attempts failed (`refused`: ECONNREFUSED; `EPERM`: the packet \
         was rejected on its way out; `timeout`: no answer); `peer=` means getpeername() or \
         the reply's source was not the ClusterIP the client addressed, and `src=` that the \
         backend saw another source address than the client's own (neither happened where \
         they are not shown). For a live change, the time from the API write to the first \
         probe that saw the outcome follows in parentheses (kube-proxy's minimum sync period \
         is its default, 1 s). The last column: `=` all agree; `intended` svc differs from a \
         kube-proxy as `tests/intended-differences.yaml` says, for the reason given below; \
         **differs** would fail the test.\n\n\
         NodePort, ExternalIPs, LoadBalancer IPs, externalTrafficPolicy: Local, \
         loadBalancerSourceRanges (IPv4 and IPv6), sessionAffinity for external traffic and \
         the health check node port are probed \
         (\"from outside\") by an external client in front of the node's uplink, outside svc's \
         cgroup, so svc serves them with its tc programs (on the uplink and on the device \
         towards the backends) and kube-proxy with its PREROUTING rules; there `src=` shows \
         the address a backend saw instead of the external client's (masquerade, SNAT), and \
         an endpoint without this node's name is another node's. A health check cell is the \
         HTTP status and the fields of the JSON answer; a `-head` row shows the status line, \
         the values of the headers kube-proxy sets and the names of the others, a `-body` row \
         every field of the JSON body and whether the body is, byte for byte, kube-proxy's \
         template for those fields.\n\n{xdp_intro}{table}{xdp_after}",
        machine = svc_tests::report::machine(),
        date = svc_tests::report::today(),
        proxies = proxies.join(", "),
    );
    std::fs::write(path, text)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A scenario's context.

struct Ctx<'a> {
    world: &'a World,
    /// The scenario's name, Kubernetes namespace and row prefix.
    name: String,
    rows: Vec<Row>,
    /// Backends of this scenario, in every proxy's backend namespace.
    backends: Vec<Backend>,
    /// Objects were written since the proxies were last seen to follow the API.
    dirty: std::cell::Cell<bool>,
    /// Times the sentinel Service was moved (see `settle`), and its ClusterIP.
    sentinel: std::cell::Cell<(u32, Option<IpAddr>)>,
    /// Checks of this scenario probed from outside (for the XDP column's counters).
    external_checks: u32,
}

impl Ctx<'_> {
    fn cp(&self) -> &ControlPlane {
        &self.world.cp
    }

    /// Applies the objects (server-side); returns them as stored.
    fn apply(&self, objects: &[Value]) -> Result<Vec<Value>> {
        self.dirty.set(true);
        apply(self.cp(), objects)
    }

    /// Applies and returns the moment `kubectl apply` returned: the write is in the API then.
    fn write(&self, objects: &[Value]) -> Result<Instant> {
        self.apply(objects)?;
        Ok(Instant::now())
    }

    /// Waits until every proxy has followed the API up to now. A first look at a frontend must
    /// not catch a proxy that has not programmed it yet: an unprogrammed ClusterIP times out,
    /// which is also an outcome. So a sentinel Service of the scenario is moved from one
    /// backend (`s7`) to another (`s8`) and back, and every proxy must answer from the new
    /// one: kube-proxy applies all pending changes in one sync, and svc follows the API's
    /// events in order, so what was written before is programmed by then.
    fn settle(&self) -> Result<()> {
        let (n, ip) = self.sentinel.get();
        let n = n + 1;
        let (i, name) = if n % 2 == 1 { (7, "s7") } else { (8, "s8") };
        let stored = apply(
            self.cp(),
            &[
                self.service("sentinel", json!({"ports": [{"name": "s", "port": 9999}]})),
                self.slice(
                    "sentinel-1",
                    "sentinel",
                    "IPv4",
                    json!([port("s", 9999, "TCP")]),
                    json!([ep(&self.v4(i))]),
                ),
            ],
        )?;
        let ip = match ip {
            Some(ip) => ip,
            None => cluster_ip(&stored)?,
        };
        self.sentinel.set((n, Some(ip)));
        let cells = observe(
            &self.world.proxies,
            &Probe::tcp(sa(ip, 9999), 2),
            &[name],
            Instant::now(),
            SETTLE,
        )?;
        for (proxy, cell) in cells {
            ensure!(
                cell.expected,
                "{proxy} did not follow the API within {SETTLE:?}: the sentinel Service answered `{}`, not {name}",
                cell.outcome.text
            );
        }
        self.dirty.set(false);
        Ok(())
    }

    fn namespace(&self) -> Result<()> {
        apply(
            self.cp(),
            &[json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.name}})],
        )?;
        Ok(())
    }

    /// Backend `b<i>` on `ports` behind every proxy.
    fn serve(&mut self, i: u8, ports: &[u16]) -> Result<()> {
        for p in &self.world.proxies {
            self.backends.push(p.serve(i, ports)?);
        }
        Ok(())
    }

    fn v4(&self, i: u8) -> String {
        self.world.proxies[0].sb.backend_v4(i).to_string()
    }

    fn v6(&self, i: u8) -> String {
        self.world.proxies[0].sb.backend_v6(i).to_string()
    }

    fn service(&self, name: &str, spec: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": self.name}, "spec": spec})
    }

    fn slice(&self, name: &str, service: &str, family: &str, ports: Value, eps: Value) -> Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": self.name,
                         "labels": { SERVICE_NAME: service }},
            "addressType": family, "ports": ports, "endpoints": eps,
        })
    }

    /// The node's own addresses (its InternalIPs, where NodePorts answer), the same in every
    /// sandbox.
    fn node_ips(&self) -> (IpAddr, IpAddr) {
        let sb = &self.world.proxies[0].sb;
        (sb.client_v4().into(), sb.client_v6().into())
    }

    /// External frontend address `i` (ExternalIPs, LoadBalancer IPs), IPv4 and IPv6, routed
    /// to the node by the external client.
    fn frontend(&self, i: u8) -> (IpAddr, IpAddr) {
        let sb = &self.world.proxies[0].sb;
        (sb.frontend_v4(i).into(), sb.frontend_v6(i).into())
    }

    /// A dual-stack Service of `kind` with http 80 → 8080/TCP and dns 53 → 5353/UDP; `extra`
    /// is merged into its spec.
    fn packet_service(&self, name: &str, kind: &str, extra: Value) -> Value {
        let mut spec = json!({
            "type": kind, "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv6"],
            "ports": [
                {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"},
            ],
        });
        if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        self.service(name, spec)
    }

    /// The IPv4 and IPv6 slices of a `packet_service`: backends `(i, node)` (node: the
    /// endpoint's nodeName), each with `conditions`.
    fn packet_slices(
        &self,
        service: &str,
        eps: &[(u8, Option<&str>)],
        conditions: Value,
    ) -> [Value; 2] {
        let ports = json!([port("http", 8080, "TCP"), port("dns", 5353, "UDP")]);
        let slice = |family: &str, addr: &dyn Fn(u8) -> String| {
            let eps: Vec<Value> = eps
                .iter()
                .map(|&(i, node)| {
                    let mut e = json!({"addresses": [addr(i)], "conditions": conditions});
                    if let Some(n) = node {
                        e["nodeName"] = n.into();
                    }
                    e
                })
                .collect();
            let name = format!("{service}-{}", family.to_lowercase());
            self.slice(&name, service, family, ports.clone(), json!(eps))
        };
        [
            slice("IPv4", &|i| self.v4(i)),
            slice("IPv6", &|i| self.v6(i)),
        ]
    }

    /// Writes `status.loadBalancer.ingress` of Service `name`, as a cloud's controller would.
    fn lb_status(&self, name: &str, ingress: Value) -> Result<Instant> {
        self.dirty.set(true);
        let patch = json!({"status": {"loadBalancer": {"ingress": ingress}}});
        self.cp().kubectl(&[
            "patch",
            "service",
            name,
            "-n",
            &self.name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch.to_string(),
        ])?;
        Ok(Instant::now())
    }

    /// Probes through every proxy until each saw one of `expect` (or the deadline: `SETTLE`
    /// for a first look, `LIVE` after a change written at `since`), and records the row.
    fn check(
        &mut self,
        check: &str,
        what: &str,
        probe: Probe,
        expect: &[&str],
        since: Option<Instant>,
    ) -> Result<()> {
        if probe.from == Origin::External {
            self.external_checks += 1;
        }
        self.check_with(check, what, |p| probe.run(p), expect, since)
    }

    /// `check` with any way of looking (`look`, for each proxy) instead of a probe.
    fn check_with(
        &mut self,
        check: &str,
        what: &str,
        look: impl Fn(&Proxy) -> Result<Outcome> + Sync,
        expect: &[&str],
        since: Option<Instant>,
    ) -> Result<()> {
        let (start, within) = match since {
            Some(t) => (t, LIVE),
            None => {
                if self.dirty.get() {
                    self.settle()?;
                }
                (Instant::now(), SETTLE)
            }
        };
        let cells = observe_with(&self.world.proxies, look, expect, start, within)?;
        self.record(check, what, since.is_some(), cells);
        Ok(())
    }

    fn record(
        &mut self,
        check: &str,
        what: &str,
        timed: bool,
        cells: std::collections::BTreeMap<String, Cell>,
    ) {
        let row = Row {
            check: format!("{}/{check}", self.name),
            what: what.to_string(),
            timed,
            cells,
        };
        for (p, c) in row.cells.iter().filter(|_| verbose()) {
            eprintln!(
                "    {:<28} {:<26} {}{}",
                row.check,
                p,
                c.outcome.text,
                c.after
                    .map(|d| format!("  ({:.0?})", d))
                    .unwrap_or_else(|| "  (not as expected)".into())
            );
        }
        self.rows.push(row);
    }

    /// Deletes the scenario's Services and EndpointSlices (no controller-manager would), so the
    /// proxies carry nothing of it into the next scenario; its backends stop.
    fn clean_up(&mut self) {
        let _ = self.cp().kubectl(&[
            "delete",
            "services,endpointslices",
            "--all",
            "-n",
            &self.name,
            "--wait=false",
        ]);
        self.backends.clear();
    }
}

fn apply(cp: &ControlPlane, objects: &[Value]) -> Result<Vec<Value>> {
    let yaml: Vec<String> = objects.iter().map(Value::to_string).collect();
    cp.apply_yaml(&yaml.join("\n---\n"))
}

fn cluster_ips(stored: &[Value]) -> Result<Vec<IpAddr>> {
    let svc = stored
        .iter()
        .find(|o| o["kind"] == "Service")
        .context("no Service among the applied objects")?;
    svc["spec"]["clusterIPs"]
        .as_array()
        .context("Service has no clusterIPs")?
        .iter()
        .map(|ip| Ok(ip.as_str().context("clusterIP")?.parse::<IpAddr>()?))
        .collect()
}

fn cluster_ip(stored: &[Value]) -> Result<IpAddr> {
    cluster_ips(stored)?
        .first()
        .copied()
        .context("no clusterIP allocated")
}

fn sa(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

fn port(name: &str, port: u16, protocol: &str) -> Value {
    json!({"name": name, "port": port, "protocol": protocol})
}

fn ep_cond(addr: &str, ready: bool, serving: bool, terminating: bool) -> Value {
    json!({"addresses": [addr],
           "conditions": {"ready": ready, "serving": serving, "terminating": terminating}})
}

/// The nodePort the API server gave port `port` of Service `service` among `stored`.
fn node_port(stored: &[Value], service: &str, port: &str) -> Result<u16> {
    node_port_field(stored, service, port, "nodePort")
}

/// A port number of Service `service` among `stored`: `field` of its port named `port`, or of
/// its spec when `port` is empty (`healthCheckNodePort`).
fn node_port_field(stored: &[Value], service: &str, port: &str, field: &str) -> Result<u16> {
    let svc = stored
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == service)
        .with_context(|| format!("no Service {service} among the applied objects"))?;
    let value = if port.is_empty() {
        &svc["spec"][field]
    } else {
        svc["spec"]["ports"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == port))
            .map(|p| &p[field])
            .with_context(|| format!("Service {service} has no port {port}"))?
    };
    value
        .as_u64()
        .and_then(|n| u16::try_from(n).ok())
        .with_context(|| format!("Service {service}: no {field} for {port:?}"))
}

fn ep(addr: &str) -> Value {
    ep_cond(addr, true, true, false)
}

fn with(mut v: Value, key: &str, value: Value) -> Value {
    v[key] = value;
    v
}

// ---------------------------------------------------------------------------------------------
// Scenarios.

/// Several ports with numeric targetPorts, and port 53 over both TCP and UDP, each protocol
/// with its own endpoints.
fn ports(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 9090, 5353])?;
    ctx.serve(2, &[5353])?;
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"ports": [
                {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                {"name": "metrics", "port": 9090, "targetPort": 9090, "protocol": "TCP"},
                {"name": "dns-tcp", "port": 53, "targetPort": 5353, "protocol": "TCP"},
                {"name": "dns-udp", "port": 53, "targetPort": 5353, "protocol": "UDP"},
            ]}),
        ),
        ctx.slice(
            "web-tcp",
            "web",
            "IPv4",
            json!([
                port("http", 8080, "TCP"),
                port("metrics", 9090, "TCP"),
                port("dns-tcp", 5353, "TCP")
            ]),
            json!([ep(&ctx.v4(1))]),
        ),
        ctx.slice(
            "web-udp",
            "web",
            "IPv4",
            json!([port("dns-udp", 5353, "UDP")]),
            json!([ep(&ctx.v4(2))]),
        ),
    ])?;
    let vip = cluster_ip(&stored)?;
    ctx.check(
        "tcp-80",
        "TCP to port 80 (targetPort 8080)",
        Probe::tcp(sa(vip, 80), 5),
        &["b1"],
        None,
    )?;
    ctx.check(
        "tcp-9090",
        "TCP to a second port",
        Probe::tcp(sa(vip, 9090), 5),
        &["b1"],
        None,
    )?;
    ctx.check(
        "tcp-53",
        "TCP to port 53, which UDP also has",
        Probe::tcp(sa(vip, 53), 5),
        &["b1"],
        None,
    )?;
    ctx.check(
        "udp-53",
        "UDP to port 53, sendto/recvfrom",
        Probe::udp(sa(vip, 53), 5),
        &["b2"],
        None,
    )?;
    ctx.check(
        "udp-53-connected",
        "UDP to port 53, connected socket",
        Probe::udp_connected(sa(vip, 53), 5),
        &["b2"],
        None,
    )?;
    Ok(())
}

/// A named targetPort that each slice numbers differently (pods of two versions).
fn named_ports(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080])?;
    ctx.serve(2, &[8081])?;
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"ports": [{"name": "http", "port": 80, "targetPort": "web"}]}),
        ),
        ctx.slice(
            "web-v1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([ep(&ctx.v4(1))]),
        ),
        ctx.slice(
            "web-v2",
            "web",
            "IPv4",
            json!([port("http", 8081, "TCP")]),
            json!([ep(&ctx.v4(2))]),
        ),
    ])?;
    let vip = cluster_ip(&stored)?;
    ctx.check(
        "per-slice-numbers",
        "named targetPort, 8080 in one slice and 8081 in the other",
        Probe::tcp(sa(vip, 80), 30),
        &["b1,b2"],
        None,
    )
}

/// Endpoints merged across slices; one listed twice, terminating in one slice and ready in the
/// other (as while it moves between slices).
fn merge(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=3 {
        ctx.serve(i, &[8080])?;
    }
    let http = json!([port("http", 8080, "TCP")]);
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        ctx.slice(
            "web-a",
            "web",
            "IPv4",
            http.clone(),
            json!([ep(&ctx.v4(1)), ep_cond(&ctx.v4(2), false, true, true)]),
        ),
        ctx.slice(
            "web-b",
            "web",
            "IPv4",
            http,
            json!([ep(&ctx.v4(2)), ep(&ctx.v4(3))]),
        ),
    ])?;
    let vip = cluster_ip(&stored)?;
    ctx.check(
        "two-slices",
        "three endpoints over two slices, b2 in both (terminating in one, ready in the other)",
        Probe::tcp(sa(vip, 80), 30),
        &["b1,b2,b3"],
        None,
    )
}

/// A dual-stack Service (IPv6 first): each ClusterIP reaches its own family's endpoints; an
/// FQDN slice is ignored.
fn dual_stack(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    ctx.serve(2, &[8080, 5353])?;
    let ports = json!([port("http", 8080, "TCP"), port("dns", 5353, "UDP")]);
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({
                "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6", "IPv4"],
                "ports": [
                    {"name": "http", "port": 80, "targetPort": 8080},
                    {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"},
                ],
            }),
        ),
        ctx.slice(
            "web-v4",
            "web",
            "IPv4",
            ports.clone(),
            json!([ep(&ctx.v4(1))]),
        ),
        ctx.slice(
            "web-v6",
            "web",
            "IPv6",
            ports.clone(),
            json!([ep(&ctx.v6(2))]),
        ),
        ctx.slice(
            "web-fqdn",
            "web",
            "FQDN",
            ports,
            json!([ep("backend.example.com")]),
        ),
    ])?;
    let ips = cluster_ips(&stored)?;
    let v4 = *ips
        .iter()
        .find(|ip| ip.is_ipv4())
        .context("no IPv4 clusterIP")?;
    let v6 = *ips
        .iter()
        .find(|ip| ip.is_ipv6())
        .context("no IPv6 clusterIP")?;
    ctx.check(
        "tcp-v4",
        "TCP to the IPv4 ClusterIP",
        Probe::tcp(sa(v4, 80), 5),
        &["b1"],
        None,
    )?;
    ctx.check(
        "tcp-v6",
        "TCP to the IPv6 ClusterIP",
        Probe::tcp(sa(v6, 80), 5),
        &["b2"],
        None,
    )?;
    ctx.check(
        "tcp-v4-mapped",
        "TCP from an IPv6 socket to ::ffff:(IPv4 ClusterIP)",
        Probe::tcp(sa(v4, 80), 5).v6_mapped(),
        &["b1"],
        None,
    )?;
    ctx.check(
        "udp-v6",
        "UDP (sendto) to the IPv6 ClusterIP",
        Probe::udp(sa(v6, 53), 5),
        &["b2"],
        None,
    )?;
    ctx.check(
        "udp-connected-v6",
        "UDP from a connected socket to the IPv6 ClusterIP",
        Probe::udp_connected(sa(v6, 53), 5),
        &["b2"],
        None,
    )?;
    ctx.check(
        "udp-v4-mapped",
        "UDP (sendto) from an IPv6 socket to ::ffff:(IPv4 ClusterIP)",
        Probe::udp(sa(v4, 53), 5).v6_mapped(),
        &["b1"],
        None,
    )?;
    Ok(())
}

/// A Service without endpoints.
fn no_endpoints(ctx: &mut Ctx) -> Result<()> {
    let stored = ctx.apply(&[ctx.service(
        "web",
        json!({"ports": [
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
        ]}),
    )])?;
    let vip = cluster_ip(&stored)?;
    ctx.check(
        "tcp",
        "TCP to a Service with no endpoints",
        Probe::tcp(sa(vip, 80), 3).short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "udp",
        "UDP (sendto) to it",
        Probe::udp(sa(vip, 53), 3).short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "udp-connected",
        "UDP, connected socket",
        Probe::udp_connected(sa(vip, 53), 3).short(),
        NOT_SERVED,
        None,
    )?;
    // Endpoints arrive: served at once.
    ctx.serve(1, &[8080])?;
    let t = ctx.write(&[ctx.slice(
        "web-1",
        "web",
        "IPv4",
        json!([port("http", 8080, "TCP")]),
        json!([ep(&ctx.v4(1))]),
    )])?;
    ctx.check(
        "endpoints-arrive",
        "an endpoint appears",
        Probe::tcp(sa(vip, 80), 3),
        &["b1"],
        Some(t),
    )?;
    Ok(())
}

/// A port the ClusterIP does not define, over TCP and UDP.
fn undefined_port(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 81])?;
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([ep(&ctx.v4(1))]),
        ),
    ])?;
    let vip = cluster_ip(&stored)?;
    ctx.check(
        "defined",
        "TCP to the defined port",
        Probe::tcp(sa(vip, 80), 3),
        &["b1"],
        None,
    )?;
    ctx.check(
        "tcp-81",
        "TCP to port 81, which the Service does not define",
        Probe::tcp(sa(vip, 81), 3).short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "udp-80",
        "UDP (sendto) to port 80, defined for TCP only",
        Probe::udp(sa(vip, 80), 3).short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "udp-connected-80",
        "UDP, connected socket, to port 80",
        Probe::udp_connected(sa(vip, 80), 3).short(),
        NOT_SERVED,
        None,
    )?;
    Ok(())
}

/// internalTrafficPolicy: Cluster: ready endpoints only; with none ready, those serving while
/// terminating; with neither, none. An endpoint without conditions counts as ready.
fn conditions(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=4 {
        ctx.serve(i, &[8080])?;
    }
    let slice = |ctx: &Ctx, eps: Value| {
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            eps,
        )
    };
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        slice(
            ctx,
            json!([
                ep(&ctx.v4(1)),
                ep_cond(&ctx.v4(2), false, true, true),
                ep_cond(&ctx.v4(3), false, false, false),
                {"addresses": [ctx.v4(4)]},
            ]),
        ),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.check(
        "ready",
        "b1 ready, b2 serving and terminating, b3 neither, b4 without conditions",
        Probe::tcp(vip, 30),
        &["b1,b4"],
        None,
    )?;
    let t = ctx.write(&[slice(
        ctx,
        json!([
            ep_cond(&ctx.v4(1), false, false, true),
            ep_cond(&ctx.v4(2), false, true, true),
            ep_cond(&ctx.v4(3), false, false, false),
        ]),
    )])?;
    ctx.check(
        "serving-terminating",
        "none ready: b2 is serving while terminating",
        Probe::tcp(vip, 20),
        &["b2"],
        Some(t),
    )?;
    let t = ctx.write(&[slice(
        ctx,
        json!([
            ep_cond(&ctx.v4(1), false, false, true),
            ep_cond(&ctx.v4(2), false, false, true),
            ep_cond(&ctx.v4(3), false, true, false),
        ]),
    )])?;
    ctx.check(
        "none",
        "none ready, none serving and terminating (b3 serving but not terminating)",
        Probe::tcp(vip, 3).short(),
        NOT_SERVED,
        Some(t),
    )?;
    Ok(())
}

/// internalTrafficPolicy: Local: only this node's endpoints; its serving terminating ones when
/// none of its own is ready; none of its own: nothing, even with ready endpoints elsewhere.
fn internal_traffic_local(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=3 {
        ctx.serve(i, &[8080])?;
    }
    let slice = |ctx: &Ctx, b1: Value| {
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([
                with(b1, "nodeName", NODE.into()),
                with(ep(&ctx.v4(2)), "nodeName", "elsewhere".into()),
                ep(&ctx.v4(3)),
            ]),
        )
    };
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"internalTrafficPolicy": "Local",
                                      "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        slice(ctx, ep(&ctx.v4(1))),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.check(
        "local-ready",
        "b1 on this node, b2 on another, b3 on none",
        Probe::tcp(vip, 20),
        &["b1"],
        None,
    )?;
    let t = ctx.write(&[slice(ctx, ep_cond(&ctx.v4(1), false, true, true))])?;
    ctx.check(
        "local-terminating",
        "this node's b1 serving while terminating, others ready",
        Probe::tcp(vip, 20),
        &["b1"],
        Some(t),
    )?;
    let t = ctx.write(&[slice(ctx, ep_cond(&ctx.v4(1), false, false, true))])?;
    ctx.check(
        "no-local",
        "no usable endpoint on this node, ready ones elsewhere",
        Probe::tcp(vip, 3).short(),
        NOT_SERVED,
        Some(t),
    )?;
    Ok(())
}

/// publishNotReadyAddresses is the EndpointSlice controller's business (it then marks every
/// endpoint ready): a proxy goes by the slice's conditions alone.
fn publish_not_ready(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=2 {
        ctx.serve(i, &[8080])?;
    }
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"publishNotReadyAddresses": true,
                                      "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([ep(&ctx.v4(1)), ep_cond(&ctx.v4(2), false, false, false)]),
        ),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.check(
        "not-ready-endpoint",
        "publishNotReadyAddresses, b1 ready, b2 not ready in the slice",
        Probe::tcp(vip, 20),
        &["b1"],
        None,
    )
}

/// Topology hints: zones and nodes, complete and partial.
fn topology(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=3 {
        ctx.serve(i, &[8080])?;
    }
    let zone = |ctx: &Ctx, i: u8, zone: &str, hint: Option<&str>| {
        let e = with(ep(&ctx.v4(i)), "zone", zone.into());
        match hint {
            Some(h) => with(e, "hints", json!({"forZones": [{"name": h}]})),
            None => e,
        }
    };
    let slice = |ctx: &Ctx, eps: Value| {
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            eps,
        )
    };
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"trafficDistribution": "PreferClose",
                                      "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        slice(
            ctx,
            json!([
                zone(ctx, 1, "zone-a", Some("zone-a")),
                zone(ctx, 2, "zone-b", Some("zone-b")),
                zone(ctx, 3, "zone-a", Some("zone-a")),
            ]),
        ),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.check(
        "zone-hints",
        "every endpoint hinted; this node is in zone-a",
        Probe::tcp(vip, 30),
        &["b1,b3"],
        None,
    )?;
    let t = ctx.write(&[slice(
        ctx,
        json!([
            zone(ctx, 1, "zone-a", Some("zone-a")),
            zone(ctx, 2, "zone-b", None),
            zone(ctx, 3, "zone-a", Some("zone-a")),
        ]),
    )])?;
    ctx.check(
        "partial-zone-hints",
        "b2 without hints: hints ignored",
        Probe::tcp(vip, 30),
        &["b1,b2,b3"],
        Some(t),
    )?;
    let t = ctx.write(&[slice(
        ctx,
        json!([
            zone(ctx, 1, "zone-b", Some("zone-b")),
            zone(ctx, 2, "zone-b", Some("zone-b")),
            zone(ctx, 3, "zone-c", Some("zone-c")),
        ]),
    )])?;
    ctx.check(
        "no-hint-for-zone",
        "every endpoint hinted, none for zone-a",
        Probe::tcp(vip, 30),
        &["b1,b2,b3"],
        Some(t),
    )?;
    let node = |ctx: &Ctx, i: u8, zone_hint: &str, node: Option<&str>| {
        let mut hints = json!({"forZones": [{"name": zone_hint}]});
        if let Some(n) = node {
            hints["forNodes"] = json!([{"name": n}]);
        }
        with(ep(&ctx.v4(i)), "hints", hints)
    };
    let t = ctx.write(&[slice(
        ctx,
        json!([
            node(ctx, 1, "zone-a", Some(NODE)),
            node(ctx, 2, "zone-a", Some("other-node")),
            node(ctx, 3, "zone-a", Some("other-node")),
        ]),
    )])?;
    ctx.check(
        "node-hints",
        "every endpoint hinted for a node, b1 for this one",
        Probe::tcp(vip, 30),
        &["b1"],
        Some(t),
    )?;
    let t = ctx.write(&[slice(
        ctx,
        json!([
            node(ctx, 1, "zone-a", Some(NODE)),
            node(ctx, 2, "zone-b", None),
            node(ctx, 3, "zone-a", Some("other-node")),
        ]),
    )])?;
    ctx.check(
        "partial-node-hints",
        "b2 without a node hint: zone hints (b1, b3 for zone-a) apply",
        Probe::tcp(vip, 30),
        &["b1,b3"],
        Some(t),
    )?;
    // The node leaves zone-a for zone-b: the zone hints now pick b2.
    let t = Instant::now();
    ctx.cp().kubectl(&[
        "label",
        "node",
        NODE,
        &format!("{ZONE}=zone-b"),
        "--overwrite",
    ])?;
    let result = ctx.check(
        "node-changes-zone",
        "the Node's zone label changes to zone-b",
        Probe::tcp(vip, 30),
        &["b2"],
        Some(t),
    );
    ctx.cp().kubectl(&[
        "label",
        "node",
        NODE,
        &format!("{ZONE}=zone-a"),
        "--overwrite",
    ])?;
    result
}

/// sessionAffinity: ClientIP with its timeout, switched on and off live.
fn affinity(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=8 {
        ctx.serve(i, &[8080])?;
    }
    let eps: Vec<Value> = (1..=8).map(|i| ep(&ctx.v4(i))).collect();
    let ports = json!([{"name": "http", "port": 80, "targetPort": 8080}]);
    let stored = ctx.apply(&[
        ctx.service("web", json!({"ports": ports})),
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!(eps),
        ),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.check(
        "off",
        "no affinity: 20 connections",
        Probe::tcp(vip, 20).distinct(),
        &["several backends"],
        None,
    )?;
    let timeout_s = 2;
    let t = ctx.write(&[ctx.service(
        "web",
        json!({
            "ports": ports, "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout_s}},
        }),
    )])?;
    ctx.check(
        "on",
        "ClientIP affinity switched on: 20 connections",
        Probe::tcp(vip, 20).distinct(),
        &["1 backend"],
        Some(t),
    )?;
    // After the timeout passes without a connection, the choice is made afresh: over up to
    // six idle periods, 8 backends, a proxy that re-chooses shows another backend with
    // probability 1 - (1/8)^6.
    let start = Instant::now();
    let rechosen = each(&ctx.world.proxies, |p| {
        let first = Probe::tcp(vip, 3).distinct();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..7 {
            let r = p.sb.probe(&first.args(), first.run_timeout())?;
            ensure!(r.all_ok(), "failures: {:?}", r.failures());
            let names: std::collections::BTreeSet<String> =
                r.results.iter().filter_map(|a| a.backend.clone()).collect();
            ensure!(
                names.len() == 1,
                "within the timeout the backend changed: {names:?}"
            );
            seen.extend(names);
            if seen.len() > 1 {
                return Ok((
                    Outcome {
                        text: "chosen afresh".into(),
                    },
                    start.elapsed(),
                ));
            }
            std::thread::sleep(Duration::from_millis(timeout_s * 1000 + 1000));
        }
        Ok((
            Outcome {
                text: "kept".into(),
            },
            start.elapsed(),
        ))
    });
    let mut cells = std::collections::BTreeMap::new();
    for (p, r) in ctx.world.proxies.iter().zip(rechosen) {
        let (outcome, after) = r.with_context(|| format!("affinity through {}", p.kind.label()))?;
        let expected = outcome.text == "chosen afresh";
        cells.insert(
            p.kind.id().to_string(),
            Cell {
                outcome,
                after: Some(after),
                expected,
            },
        );
    }
    ctx.record(
        "timeout",
        "idle for timeoutSeconds (2) + 1 s between connections: the backend is chosen afresh",
        false,
        cells,
    );
    let t = ctx.write(&[ctx.service("web", json!({"ports": ports, "sessionAffinity": "None"}))])?;
    ctx.check(
        "off-again",
        "affinity switched off",
        Probe::tcp(vip, 20).distinct(),
        &["several backends"],
        Some(t),
    )?;
    Ok(())
}

/// Headless: kube-proxy reads the headless label on EndpointSlices only (a labelled slice gives
/// no endpoints, a labelled Service with a ClusterIP is served); a headless Service
/// (clusterIP: None) has nothing to proxy.
fn headless(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080])?;
    let http = json!([port("http", 8080, "TCP")]);
    let mut labelled = ctx.service(
        "labelled",
        json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
    );
    labelled["metadata"]["labels"] = json!({ HEADLESS: "" });
    let stored = ctx.apply(&[
        labelled,
        ctx.slice(
            "labelled-1",
            "labelled",
            "IPv4",
            http.clone(),
            json!([ep(&ctx.v4(1))]),
        ),
    ])?;
    let labelled_vip = sa(cluster_ip(&stored)?, 80);
    let mut slice = ctx.slice(
        "web-1",
        "web",
        "IPv4",
        http.clone(),
        json!([ep(&ctx.v4(1))]),
    );
    slice["metadata"]["labels"][HEADLESS] = "".into();
    let stored = ctx.apply(&[
        ctx.service(
            "web",
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        ),
        slice,
    ])?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.apply(
        &[
            ctx.service("none", json!({"clusterIP": "None", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]})),
            ctx.slice("none-1", "none", "IPv4", http, json!([ep(&ctx.v4(1))])),
        ],
    )?;
    ctx.check(
        "service-label",
        "a Service labelled service.kubernetes.io/headless, with a ClusterIP and endpoints",
        Probe::tcp(labelled_vip, 3).short(),
        // kube-proxy reads that label on EndpointSlices only.
        &["b1"],
        None,
    )?;
    ctx.check(
        "slice-label",
        "a Service whose only slice is labelled service.kubernetes.io/headless",
        Probe::tcp(vip, 3).short(),
        NOT_SERVED,
        None,
    )?;
    let direct = sa(ctx.world.proxies[0].sb.backend_v4(1).into(), 8080);
    ctx.check(
        "cluster-ip-none",
        "clusterIP: None: clients connect to the endpoint itself",
        Probe::tcp(direct, 3),
        &["b1"],
        None,
    )?;
    Ok(())
}

/// type: ClusterIP → ExternalName (the ClusterIP is released) → ClusterIP again.
fn external_name(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080])?;
    let ip: IpAddr = "10.96.90.9".parse()?;
    let vip = sa(ip, 80);
    let cluster = json!({"type": "ClusterIP", "clusterIP": ip.to_string(),
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]});
    ctx.apply(&[
        ctx.service("web", cluster.clone()),
        ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([ep(&ctx.v4(1))]),
        ),
    ])?;
    ctx.check(
        "cluster-ip",
        "type ClusterIP",
        Probe::tcp(vip, 3),
        &["b1"],
        None,
    )?;
    let t = ctx.write(&[ctx.service(
        "web",
        json!({"type": "ExternalName",
        "externalName": "web.example.com", "ports": [{"name": "http", "port": 80}]}),
    )])?;
    ctx.check(
        "external-name",
        "changed to type ExternalName: the old ClusterIP",
        Probe::tcp(vip, 3).short(),
        NOT_SERVED,
        Some(t),
    )?;
    let t = ctx.write(&[ctx.service("web", cluster)])?;
    ctx.check(
        "back",
        "back to type ClusterIP, same address",
        Probe::tcp(vip, 3),
        &["b1"],
        Some(t),
    )?;
    Ok(())
}

/// The service-proxy-name label hands a Service to another proxy, live.
fn proxy_name(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080])?;
    let objects = |ctx: &Ctx, label: Option<&str>| {
        let mut svc = ctx.service(
            "web",
            json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}),
        );
        let mut slice = ctx.slice(
            "web-1",
            "web",
            "IPv4",
            json!([port("http", 8080, "TCP")]),
            json!([ep(&ctx.v4(1))]),
        );
        // Without it, server-side apply drops the label the previous apply set.
        if let Some(l) = label {
            svc["metadata"]["labels"] = json!({ PROXY_NAME: l });
            slice["metadata"]["labels"][PROXY_NAME] = l.into();
        }
        vec![svc, slice]
    };
    let stored = ctx.apply(&objects(ctx, None))?;
    let vip = sa(cluster_ip(&stored)?, 80);
    ctx.check(
        "unlabelled",
        "no service-proxy-name label",
        Probe::tcp(vip, 3),
        &["b1"],
        None,
    )?;
    let t = ctx.write(&objects(ctx, Some("another-proxy")))?;
    ctx.check(
        "another-proxy",
        "labelled for another proxy (Service and slice)",
        Probe::tcp(vip, 3).short(),
        NOT_SERVED,
        Some(t),
    )?;
    let t = ctx.write(&objects(ctx, None))?;
    ctx.check(
        "label-removed",
        "the label removed",
        Probe::tcp(vip, 3),
        &["b1"],
        Some(t),
    )?;
    // Only the slice labelled (the EndpointSlice controller copies the Service's labels, so
    // this takes a hand-written slice): kube-proxy reads the label on Services only.
    let mut objs = objects(ctx, None);
    objs[1]["metadata"]["labels"][PROXY_NAME] = "another-proxy".into();
    let t = ctx.write(&objs)?;
    ctx.check(
        "slice-only-label",
        "only the EndpointSlice labelled for another proxy",
        Probe::tcp(vip, 3).short(),
        &["b1"],
        Some(t),
    )?;
    Ok(())
}

/// A UDP client that keeps its source port (one flow for conntrack, as a DNS resolver with a
/// fixed port) while its backend is replaced; the old backend keeps running, so only the
/// proxy can move the flow.
fn udp_replacement(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[5353])?;
    ctx.serve(2, &[5353])?;
    let slice = |ctx: &Ctx, i: u8| {
        ctx.slice(
            "dns-1",
            "dns",
            "IPv4",
            json!([port("dns", 5353, "UDP")]),
            json!([ep(&ctx.v4(i))]),
        )
    };
    let stored = ctx.apply(&[
        ctx.service(
            "dns",
            json!({"ports": [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}),
        ),
        slice(ctx, 1),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 53);
    let probe = Probe::udp(vip, 3).source_port(40053);
    ctx.check(
        "before",
        "UDP from source port 40053",
        probe.clone(),
        &["b1"],
        None,
    )?;
    let t = ctx.write(&[slice(ctx, 2)])?;
    ctx.check(
        "replaced",
        "the endpoint replaced by b2, same source port",
        probe,
        &["b2"],
        Some(t),
    )?;
    Ok(())
}

/// One connected UDP socket, talking every 20 ms, while its backend is replaced (the old one
/// keeps running): what the application sees.
fn udp_stream(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[5353])?;
    ctx.serve(2, &[5353])?;
    let slice = |ctx: &Ctx, i: u8| {
        ctx.slice(
            "dns-1",
            "dns",
            "IPv4",
            json!([port("dns", 5353, "UDP")]),
            json!([ep(&ctx.v4(i))]),
        )
    };
    let stored = ctx.apply(&[
        ctx.service(
            "dns",
            json!({"ports": [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}),
        ),
        slice(ctx, 1),
    ])?;
    let vip = sa(cluster_ip(&stored)?, 53);
    ctx.check(
        "ready",
        "served by b1",
        Probe::udp_connected(vip, 3),
        &["b1"],
        None,
    )?;
    let streams: Vec<_> = ctx
        .world
        .proxies
        .iter()
        .map(|p| {
            p.sb.spawn_udp_stream(vip, Duration::from_millis(6000), 20, 300)
        })
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(1000));
    ctx.write(&[slice(ctx, 2)])?;
    let written = std::time::SystemTime::now();
    let mut cells = std::collections::BTreeMap::new();
    for (p, stream) in ctx.world.proxies.iter().zip(streams) {
        let report = p.sb.finish_udp_stream(stream, Duration::from_secs(20))?;
        let written_ms = written.duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
        // b1 → (errors) → b2, and whether the socket was replaced on the way.
        let mut story: Vec<String> = Vec::new();
        for e in &report.exchanges {
            let what = match (&e.backend, e.ok) {
                (Some(b), true) => b.clone(),
                _ => "error".into(),
            };
            if story.last() != Some(&what) {
                story.push(what);
            }
        }
        let sockets = report.exchanges.last().map(|e| e.socket + 1).unwrap_or(0);
        let text = format!(
            "{}, {} socket{}",
            story.join(" → "),
            sockets,
            if sockets == 1 { "" } else { "s" }
        );
        let first_b2 = report
            .exchanges
            .iter()
            .find(|e| e.ok && e.backend.as_deref() == Some("b2"))
            .map(|e| Duration::from_millis(e.at_ms.saturating_sub(written_ms)));
        cells.insert(
            p.kind.id().to_string(),
            Cell {
                expected: first_b2.is_some(),
                after: first_b2,
                outcome: Outcome { text },
            },
        );
    }
    ctx.record(
        "replaced",
        "one connected socket, an exchange every 20 ms; b1's endpoint replaced by b2",
        true,
        cells,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The packet datapath: probes from the external client, through the node's uplink.

/// The conditions of a ready endpoint.
fn ready() -> Value {
    json!({"ready": true, "serving": true, "terminating": false})
}

/// What a backend that saw the node's address (masquerade, SNAT) is shown as.
fn via_node(backend: &str, node: IpAddr) -> String {
    format!("{backend} src={node}")
}

/// TCP (to `tcp`) and UDP with sendto (to `udp`), IPv4 (`v4`) and IPv6 (`v6`), from the
/// external client to a frontend (`what`, with `{}` for the family's number) of a Service
/// whose endpoint b1 has no nodeName (another node's): answered by b1, through the node.
fn four_ways(
    ctx: &mut Ctx,
    what: &str,
    (v4, v6): (IpAddr, IpAddr),
    (tcp, udp): (u16, u16),
) -> Result<()> {
    let (n4, n6) = ctx.node_ips();
    for (family, ip, node) in [("4", v4, n4), ("6", v6, n6)] {
        let to = what.replace("{}", family);
        let expect = via_node("b1", node);
        ctx.check(
            &format!("tcp-v{family}"),
            &format!("TCP from outside to {to}"),
            Probe::tcp(sa(ip, tcp), 3).external(),
            &[&expect],
            None,
        )?;
        ctx.check(
            &format!("udp-v{family}"),
            &format!("UDP (sendto) from outside to {to}"),
            Probe::udp(sa(ip, udp), 3).external(),
            &[&expect],
            None,
        )?;
    }
    Ok(())
}

/// NodePort, externalTrafficPolicy Cluster: TCP and UDP, IPv4 and IPv6, from outside; an
/// endpoint on this node; the node itself as the client; the node's other address; no
/// endpoints.
fn nodeport(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    ctx.serve(2, &[8080, 5353])?;
    let [web4, web6] = ctx.packet_slices("web", &[(1, None)], ready());
    let [local4, local6] = ctx.packet_slices("local", &[(2, Some(NODE))], ready());
    let stored = ctx.apply(&[
        ctx.packet_service("web", "NodePort", json!({})),
        web4,
        web6,
        ctx.packet_service("local", "NodePort", json!({})),
        local4,
        local6,
        ctx.packet_service("empty", "NodePort", json!({})),
    ])?;
    let (n4, n6) = ctx.node_ips();
    let (http, dns) = (
        node_port(&stored, "web", "http")?,
        node_port(&stored, "web", "dns")?,
    );
    four_ways(
        ctx,
        "the node's IPv{} address:nodePort",
        (n4, n6),
        (http, dns),
    )?;
    let local = node_port(&stored, "local", "http")?;
    ctx.check(
        "local-endpoint",
        "TCP from outside to a nodePort whose endpoint (b2) runs on this node",
        Probe::tcp(sa(n4, local), 3).external(),
        &["b2", &via_node("b2", n4)],
        None,
    )?;
    ctx.check(
        "from-node",
        "TCP from the node itself to its own address:nodePort",
        Probe::tcp(sa(n4, http), 3),
        &["b1"],
        None,
    )?;
    ctx.check(
        "localhost",
        "TCP from the node itself to 127.0.0.1:nodePort (localhost NodePorts)",
        Probe::tcp(sa("127.0.0.1".parse()?, http), 3).short(),
        &["b1", &via_node("b1", n4), "refused", "timeout"],
        None,
    )?;
    let uplink: IpAddr = ctx.world.proxies[0].sb.uplink_v4().into();
    ctx.check(
        "other-address",
        "TCP from outside to nodePort on the node's uplink address, which is not a Node InternalIP",
        Probe::tcp(sa(uplink, http), 3).external().short(),
        &[&via_node("b1", n4), "refused", "timeout"],
        None,
    )?;
    let (http, dns) = (
        node_port(&stored, "empty", "http")?,
        node_port(&stored, "empty", "dns")?,
    );
    ctx.check(
        "no-endpoints-tcp",
        "TCP from outside to the nodePort of a Service without endpoints",
        Probe::tcp(sa(n4, http), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "no-endpoints-udp",
        "UDP (connected) from outside to the nodePort of a Service without endpoints",
        Probe::udp_connected(sa(n4, dns), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    Ok(())
}

/// ExternalIPs: an address routed to the node, on no device of it.
fn external_ips(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    let (e4, e6) = ctx.frontend(10);
    let [s4, s6] = ctx.packet_slices("web", &[(1, None)], ready());
    ctx.apply(&[
        ctx.packet_service(
            "web",
            "ClusterIP",
            json!({"externalIPs": [e4.to_string(), e6.to_string()]}),
        ),
        s4,
        s6,
    ])?;
    four_ways(ctx, "the IPv{} ExternalIP", (e4, e6), (80, 53))?;
    ctx.check(
        "from-node",
        "TCP from the node itself to the ExternalIP",
        Probe::tcp(sa(e4, 80), 3),
        &["b1"],
        None,
    )?;
    ctx.check(
        "undefined-port",
        "TCP from outside to a port the Service does not define on the ExternalIP",
        Probe::tcp(sa(e4, 81), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    Ok(())
}

/// LoadBalancer IPs from `status.loadBalancer.ingress` (written here, as a cloud controller
/// would), ipMode VIP and Proxy, and the ingress removed live.
fn loadbalancer_ips(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    let (l4, l6) = ctx.frontend(20);
    let (p4, _) = ctx.frontend(21);
    let [w4, w6] = ctx.packet_slices("web", &[(1, None)], ready());
    let [p4s, p6s] = ctx.packet_slices("proxied", &[(1, None)], ready());
    ctx.apply(&[
        ctx.packet_service("web", "LoadBalancer", json!({})),
        w4,
        w6,
        ctx.packet_service("proxied", "LoadBalancer", json!({})),
        p4s,
        p6s,
    ])?;
    ctx.lb_status(
        "web",
        json!([{"ip": l4.to_string(), "ipMode": "VIP"}, {"ip": l6.to_string(), "ipMode": "VIP"}]),
    )?;
    ctx.lb_status(
        "proxied",
        json!([{"ip": p4.to_string(), "ipMode": "Proxy"}]),
    )?;
    four_ways(
        ctx,
        "the IPv{} LoadBalancer IP (ipMode VIP)",
        (l4, l6),
        (80, 53),
    )?;
    ctx.check(
        "from-node",
        "TCP from the node itself to the LoadBalancer IP",
        Probe::tcp(sa(l4, 80), 3),
        &["b1"],
        None,
    )?;
    ctx.check(
        "ip-mode-proxy",
        "TCP from outside to a LoadBalancer IP with ipMode Proxy (the load balancer proxies; the node must not capture it)",
        Probe::tcp(sa(p4, 80), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "ip-mode-proxy-from-node",
        "TCP from the node itself to that ipMode Proxy address",
        Probe::tcp(sa(p4, 80), 3).short(),
        NOT_SERVED,
        None,
    )?;
    let t = ctx.lb_status("web", json!([]))?;
    ctx.check(
        "ingress-removed",
        "the load balancer's ingress removed from the status: TCP from outside to the old IPv4 address",
        Probe::tcp(sa(l4, 80), 3).external().short(),
        NOT_SERVED,
        Some(t),
    )?;
    Ok(())
}

/// externalTrafficPolicy Local: only this node's endpoints, the client's address kept; what
/// happens with none here but some elsewhere, and with none at all.
fn external_traffic_policy_local(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    ctx.serve(2, &[8080, 5353])?;
    let (l4, l6) = ctx.frontend(30);
    let [s4, s6] = ctx.packet_slices("web", &[(1, Some(NODE)), (2, Some("other-node"))], ready());
    let stored = ctx.apply(&[
        ctx.packet_service(
            "web",
            "LoadBalancer",
            json!({"externalTrafficPolicy": "Local"}),
        ),
        s4,
        s6,
    ])?;
    ctx.lb_status(
        "web",
        json!([{"ip": l4.to_string(), "ipMode": "VIP"}, {"ip": l6.to_string(), "ipMode": "VIP"}]),
    )?;
    let (n4, _) = ctx.node_ips();
    let http = node_port(&stored, "web", "http")?;
    let checks = [
        (
            "lb-tcp-v4",
            "TCP from outside to the IPv4 LoadBalancer IP (b1 on this node, b2 on another)",
            Probe::tcp(sa(l4, 80), 6),
        ),
        (
            "lb-udp-v4",
            "UDP (sendto) from outside to the IPv4 LoadBalancer IP",
            Probe::udp(sa(l4, 53), 6),
        ),
        (
            "lb-tcp-v6",
            "TCP from outside to the IPv6 LoadBalancer IP",
            Probe::tcp(sa(l6, 80), 6),
        ),
        (
            "nodeport",
            "TCP from outside to the node's address:nodePort",
            Probe::tcp(sa(n4, http), 6),
        ),
    ];
    for (check, what, probe) in checks {
        ctx.check(check, what, probe.external(), &["b1"], None)?;
    }
    ctx.check(
        "from-node",
        "TCP from the node itself to the LoadBalancer IP (12 connections)",
        Probe::tcp(sa(l4, 80), 12),
        &["b1,b2"],
        None,
    )?;
    let [s4, s6] = ctx.packet_slices("web", &[(2, Some("other-node"))], ready());
    let t = ctx.write(&[s4, s6])?;
    ctx.check(
        "no-local-endpoint",
        "b1 gone: the only endpoint (b2) is on another node; TCP from outside to the LoadBalancer IP",
        Probe::tcp(sa(l4, 80), 3).external().short(),
        NOT_SERVED,
        Some(t),
    )?;
    let [s4, s6] = ctx.packet_slices("web", &[], ready());
    let t = ctx.write(&[s4, s6])?;
    ctx.check(
        "no-endpoints",
        "no endpoint anywhere: TCP from outside to the LoadBalancer IP",
        Probe::tcp(sa(l4, 80), 3).external().short(),
        NOT_SERVED,
        Some(t),
    )?;
    Ok(())
}

/// loadBalancerSourceRanges: a client inside the ranges, one outside (the same client, two
/// Services), the Service's nodePort (not restricted), and the ranges changed live.
fn source_ranges(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    let (a4, _) = ctx.frontend(40);
    let (d4, _) = ctx.frontend(41);
    let client = format!("{}/32", ctx.world.proxies[0].sb.external_v4());
    let ranges = |r: &str| json!({"loadBalancerSourceRanges": [r]});
    let [s4, s6] = ctx.packet_slices("allowed", &[(1, None)], ready());
    let [t4, t6] = ctx.packet_slices("denied", &[(1, None)], ready());
    let stored = ctx.apply(&[
        ctx.packet_service("allowed", "LoadBalancer", ranges(&client)),
        s4,
        s6,
        ctx.packet_service("denied", "LoadBalancer", ranges("192.0.2.0/24")),
        t4,
        t6,
    ])?;
    ctx.lb_status("allowed", json!([{"ip": a4.to_string(), "ipMode": "VIP"}]))?;
    ctx.lb_status("denied", json!([{"ip": d4.to_string(), "ipMode": "VIP"}]))?;
    let (n4, _) = ctx.node_ips();
    let masq = via_node("b1", n4);
    ctx.check(
        "allowed",
        "TCP from outside to a LoadBalancer IP whose loadBalancerSourceRanges hold the client",
        Probe::tcp(sa(a4, 80), 3).external(),
        &[&masq],
        None,
    )?;
    ctx.check(
        "denied",
        "TCP from outside to a LoadBalancer IP whose ranges (192.0.2.0/24) leave the client out",
        Probe::tcp(sa(d4, 80), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    let np = node_port(&stored, "denied", "http")?;
    ctx.check(
        "denied-nodeport",
        "TCP from that client to the same Service's nodePort",
        Probe::tcp(sa(n4, np), 3).external(),
        &[&masq],
        None,
    )?;
    let t = ctx.write(&[ctx.packet_service(
        "denied",
        "LoadBalancer",
        json!({"loadBalancerSourceRanges": ["192.0.2.0/24", client]}),
    )])?;
    ctx.check(
        "range-added",
        "the client's address added to the ranges",
        Probe::tcp(sa(d4, 80), 3).external(),
        &[&masq],
        Some(t),
    )?;
    Ok(())
}

/// loadBalancerSourceRanges over IPv6: the external client's IPv6 address inside the ranges and
/// outside them (two Services), over TCP and UDP; the Service's nodePort (not restricted); its
/// IPv4 LoadBalancer IP, of a family the ranges name no network of; and the ranges changed
/// live both ways.
fn source_ranges_v6(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    let (a4, a6) = ctx.frontend(60);
    let (d4, d6) = ctx.frontend(61);
    let client = format!("{}/128", ctx.world.proxies[0].sb.external_v6());
    let doc = "2001:db8::/32";
    let ranges = |r: &[&str]| json!({"loadBalancerSourceRanges": r});
    let [s4, s6] = ctx.packet_slices("allowed", &[(1, None)], ready());
    let [t4, t6] = ctx.packet_slices("denied", &[(1, None)], ready());
    let stored = ctx.apply(&[
        ctx.packet_service("allowed", "LoadBalancer", ranges(&[client.as_str()])),
        s4,
        s6,
        ctx.packet_service("denied", "LoadBalancer", ranges(&[doc])),
        t4,
        t6,
    ])?;
    let both = |v4: IpAddr, v6: IpAddr| json!([{"ip": v4.to_string(), "ipMode": "VIP"}, {"ip": v6.to_string(), "ipMode": "VIP"}]);
    ctx.lb_status("allowed", both(a4, a6))?;
    ctx.lb_status("denied", both(d4, d6))?;
    let (n4, n6) = ctx.node_ips();
    let masq = via_node("b1", n6);
    ctx.check(
        "allowed",
        "TCP from outside to an IPv6 LoadBalancer IP whose loadBalancerSourceRanges hold the client's IPv6 address (/128)",
        Probe::tcp(sa(a6, 80), 3).external(),
        &[&masq],
        None,
    )?;
    ctx.check(
        "allowed-udp",
        "UDP (sendto) from outside to that address",
        Probe::udp(sa(a6, 53), 3).external(),
        &[&masq],
        None,
    )?;
    ctx.check(
        "denied",
        "TCP from outside to an IPv6 LoadBalancer IP whose ranges (2001:db8::/32) leave the client out",
        Probe::tcp(sa(d6, 80), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    ctx.check(
        "denied-udp",
        "UDP (sendto) from outside to that address",
        Probe::udp(sa(d6, 53), 3).external().short(),
        NOT_SERVED,
        None,
    )?;
    let np = node_port(&stored, "denied", "http")?;
    ctx.check(
        "denied-nodeport",
        "TCP from that client to the same Service's nodePort on the node's IPv6 address",
        Probe::tcp(sa(n6, np), 3).external(),
        &[&masq],
        None,
    )?;
    let mut v4_either = vec![via_node("b1", n4)];
    v4_either.extend(NOT_SERVED.iter().map(|s| s.to_string()));
    let v4_either: Vec<&str> = v4_either.iter().map(String::as_str).collect();
    ctx.check(
        "denied-v4",
        "TCP from outside to the same Service's IPv4 LoadBalancer IP: its ranges name no IPv4 network",
        Probe::tcp(sa(d4, 80), 3).external().short(),
        &v4_either,
        None,
    )?;
    let t = ctx.write(&[ctx.packet_service(
        "denied",
        "LoadBalancer",
        ranges(&[doc, client.as_str()]),
    )])?;
    ctx.check(
        "range-added",
        "the client's IPv6 address added to the ranges",
        Probe::tcp(sa(d6, 80), 3).external(),
        &[&masq],
        Some(t),
    )?;
    let t = ctx.write(&[ctx.packet_service(
        "allowed",
        "LoadBalancer",
        ranges(&[doc, "192.0.2.0/24"]),
    )])?;
    ctx.check(
        "range-removed",
        "the client's address removed from the first Service's ranges (2001:db8::/32 and 192.0.2.0/24 left)",
        Probe::tcp(sa(a6, 80), 3).external().short(),
        NOT_SERVED,
        Some(t),
    )?;
    Ok(())
}

/// What the external client gets from `GET /` at `to`: the status and the fields of
/// kube-proxy's health check answer, or how the request failed.
fn health(p: &Proxy, to: SocketAddr, service: &str) -> Result<Outcome> {
    let got =
        p.sb.external_ns()?
            .run_in(|| svc_tests::agent::http_get(to, "/"))?;
    let text = match got {
        Ok((status, body)) => match serde_json::from_str::<Value>(&body) {
            Ok(v) => {
                let mut text = format!(
                    "{status} localEndpoints={} serviceProxyHealthy={}",
                    v["localEndpoints"], v["serviceProxyHealthy"]
                );
                let named = format!(
                    "{}/{}",
                    v["service"]["namespace"].as_str().unwrap_or("?"),
                    v["service"]["name"].as_str().unwrap_or("?")
                );
                if named != service {
                    text += &format!(" service={named}");
                }
                text
            }
            Err(_) => format!("{status} body={body:?}"),
        },
        Err(e) => {
            let io = e.chain().find_map(|c| c.downcast_ref::<std::io::Error>());
            match io.map(std::io::Error::kind) {
                Some(std::io::ErrorKind::ConnectionRefused) => "refused".into(),
                Some(std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
                    "timeout".into()
                }
                _ => format!("failed: {e:#}"),
            }
        }
    };
    Ok(Outcome { text })
}

/// Which part of the health check's answer a look sums up.
#[derive(Clone, Copy)]
enum Answer {
    /// The status line, the headers kube-proxy sets with their values, and the names of the
    /// others (values that change, such as Date, are left out).
    Head,
    /// Every field of the JSON body (`path=value`, sorted), and whether the body is, byte for
    /// byte, what kube-proxy's template (hcHandler.ServeHTTP) makes of those fields.
    Body,
}

/// The headers whose values are compared; any other header is compared by name only.
const HEALTH_HEADERS: &[&str] = &[
    "content-type",
    "x-content-type-options",
    "x-load-balancing-endpoint-weight",
    "content-length",
    "connection",
];

/// kube-proxy's health check body for these fields (hcHandler.ServeHTTP: a dedented, tab
/// indented template, trimmed of newlines).
fn kube_proxy_health_body(namespace: &str, name: &str, count: u64, healthy: bool) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        Value::from(namespace),
        Value::from(name),
    )
}

/// `path=value` for every leaf of `v`, sorted by path.
fn json_fields(v: &Value, path: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                json_fields(v, &p, out);
            }
        }
        _ => out.push(format!("{path}={v}")),
    }
    out.sort();
}

/// What the external client gets from `GET /` at `to`, in detail: the `part` of kube-proxy's
/// health check answer, or how the request failed.
fn health_answer(p: &Proxy, to: SocketAddr, part: Answer) -> Result<Outcome> {
    let got =
        p.sb.external_ns()?
            .run_in(|| svc_tests::agent::http_get_reply(to, "/"))?;
    let reply = match got {
        Ok(r) => r,
        Err(e) => {
            return Ok(Outcome {
                text: format!("failed: {e:#}"),
            })
        }
    };
    let text = match part {
        Answer::Head => {
            let mut parts = vec![reply.status_line.clone()];
            for h in HEALTH_HEADERS {
                parts.push(match reply.header(h) {
                    Some(v) => format!("{h}: {v}"),
                    None => format!("no {h}"),
                });
            }
            let mut others: Vec<String> = reply
                .headers
                .iter()
                .map(|(n, _)| n.to_ascii_lowercase())
                .filter(|n| !HEALTH_HEADERS.contains(&n.as_str()))
                .collect();
            others.sort();
            parts.push(format!("also: {}", others.join(" ")));
            parts.join("; ")
        }
        Answer::Body => match serde_json::from_str::<Value>(&reply.body) {
            Ok(v) => {
                let mut fields = Vec::new();
                json_fields(&v, "", &mut fields);
                let template = kube_proxy_health_body(
                    v["service"]["namespace"].as_str().unwrap_or_default(),
                    v["service"]["name"].as_str().unwrap_or_default(),
                    v["localEndpoints"].as_u64().unwrap_or_default(),
                    v["serviceProxyHealthy"].as_bool().unwrap_or_default(),
                );
                let layout = if reply.body == template {
                    "kube-proxy's template".to_string()
                } else {
                    format!("other layout {:?}", reply.body)
                };
                format!("{}; {layout}", fields.join(" "))
            }
            Err(_) => format!("not JSON: {:?}", reply.body),
        },
    };
    Ok(Outcome { text })
}

/// What kube-proxy answers (`Answer::Head`) for `count` local endpoints, healthy.
fn kube_proxy_health_head(body: &str, count: u64) -> String {
    let status = if count > 0 {
        "HTTP/1.1 200 OK"
    } else {
        "HTTP/1.1 503 Service Unavailable"
    };
    format!(
        "{status}; content-type: application/json; x-content-type-options: nosniff; \
         x-load-balancing-endpoint-weight: {count}; content-length: {}; connection: close; \
         also: date",
        body.len()
    )
}

/// The health check node port of a LoadBalancer Service with externalTrafficPolicy Local, as
/// a cloud load balancer asks it: with a ready endpoint on this node, with none here, with a
/// terminating one here, and ready again.
fn health_check_node_port(ctx: &mut Ctx) -> Result<()> {
    ctx.serve(1, &[8080, 5353])?;
    let [s4, s6] = ctx.packet_slices("web", &[(1, Some(NODE))], ready());
    let stored = ctx.apply(&[
        ctx.packet_service(
            "web",
            "LoadBalancer",
            json!({"externalTrafficPolicy": "Local"}),
        ),
        s4,
        s6,
    ])?;
    let hc = node_port_field(&stored, "web", "", "healthCheckNodePort")?;
    let (n4, n6) = ctx.node_ips();
    let service = format!("{}/web", ctx.name);
    let ok = "200 localEndpoints=1 serviceProxyHealthy=true";
    let none = "503 localEndpoints=0 serviceProxyHealthy=true";
    let look = |to: IpAddr| {
        let service = service.clone();
        move |p: &Proxy| health(p, sa(to, hc), &service)
    };
    ctx.check_with(
        "ready-v4",
        "GET / from outside at the node's IPv4 address:healthCheckNodePort; b1 ready on this node",
        look(n4),
        &[ok],
        None,
    )?;
    ctx.check_with(
        "ready-v6",
        "the same at the node's IPv6 address",
        look(n6),
        &[ok],
        None,
    )?;
    answer_checks(ctx, "ready", "b1 ready on this node", n4, hc, 1)?;
    let [s4, s6] = ctx.packet_slices("web", &[(1, Some("other-node"))], ready());
    let t = ctx.write(&[s4, s6])?;
    ctx.check_with(
        "no-local-endpoint",
        "b1 moved to another node",
        look(n4),
        &[none],
        Some(t),
    )?;
    answer_checks(ctx, "no-local-endpoint", "no local endpoint", n4, hc, 0)?;
    let terminating = json!({"ready": false, "serving": true, "terminating": true});
    let [s4, s6] = ctx.packet_slices("web", &[(1, Some(NODE))], terminating);
    let t = ctx.write(&[s4, s6])?;
    ctx.check_with(
        "terminating",
        "b1 on this node again, terminating (still serving)",
        look(n4),
        &[none],
        Some(t),
    )?;
    let [s4, s6] = ctx.packet_slices("web", &[(1, Some(NODE))], ready());
    let t = ctx.write(&[s4, s6])?;
    ctx.check_with("ready-again", "b1 ready again", look(n4), &[ok], Some(t))?;
    Ok(())
}

/// The head and the body of the health check's answer at `node:hc`, `count` local endpoints
/// expected (`when` says so in the table).
fn answer_checks(
    ctx: &mut Ctx,
    state: &str,
    when: &str,
    node: IpAddr,
    hc: u16,
    count: u64,
) -> Result<()> {
    let body = kube_proxy_health_body(&ctx.name, "web", count, true);
    let mut fields = Vec::new();
    json_fields(&serde_json::from_str(&body)?, "", &mut fields);
    let expect_body = format!("{}; kube-proxy's template", fields.join(" "));
    let expect_head = kube_proxy_health_head(&body, count);
    ctx.check_with(
        &format!("{state}-head"),
        &format!("{when}: the reply's status line and headers (values of the ones kube-proxy sets; others by name)"),
        |p: &Proxy| health_answer(p, sa(node, hc), Answer::Head),
        &[&expect_head],
        None,
    )?;
    ctx.check_with(
        &format!("{state}-body"),
        &format!(
            "{when}: the JSON body's fields, and whether it is kube-proxy's template byte for byte"
        ),
        |p: &Proxy| health_answer(p, sa(node, hc), Answer::Body),
        &[&expect_body],
        None,
    )?;
    Ok(())
}

/// sessionAffinity ClientIP for traffic from outside the node: eight backends on another node;
/// the external client's new connections to a NodePort and to a LoadBalancer IP (IPv4 and
/// IPv6, TCP and UDP) all land on one backend, where a Service without affinity spreads them;
/// and whether the NodePort and the LoadBalancer IP of one Service port give the client the
/// same backend.
fn external_affinity(ctx: &mut Ctx) -> Result<()> {
    for i in 1..=8 {
        ctx.serve(i, &[8080, 5353])?;
    }
    let eps: Vec<(u8, Option<&str>)> = (1..=8).map(|i| (i, None)).collect();
    let (l4, l6) = ctx.frontend(50);
    let (s4, _) = ctx.frontend(51);
    let (o4, _) = ctx.frontend(52);
    let timeout_s = 2;
    let [a4, a6] = ctx.packet_slices("sticky", &eps, ready());
    let [b4, b6] = ctx.packet_slices("short", &eps, ready());
    let [c4, c6] = ctx.packet_slices("spread", &eps, ready());
    let stored = ctx.apply(&[
        ctx.packet_service(
            "sticky",
            "LoadBalancer",
            json!({"sessionAffinity": "ClientIP"}),
        ),
        a4,
        a6,
        ctx.packet_service(
            "short",
            "LoadBalancer",
            json!({"sessionAffinity": "ClientIP",
                   "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout_s}}}),
        ),
        b4,
        b6,
        ctx.packet_service("spread", "LoadBalancer", json!({})),
        c4,
        c6,
    ])?;
    ctx.lb_status(
        "sticky",
        json!([{"ip": l4.to_string(), "ipMode": "VIP"}, {"ip": l6.to_string(), "ipMode": "VIP"}]),
    )?;
    ctx.lb_status("short", json!([{"ip": s4.to_string(), "ipMode": "VIP"}]))?;
    ctx.lb_status("spread", json!([{"ip": o4.to_string(), "ipMode": "VIP"}]))?;
    let (n4, n6) = ctx.node_ips();
    let one = |node: IpAddr| format!("1 backend src={node}");
    let several = format!("several backends src={n4}");
    let spread = node_port(&stored, "spread", "http")?;
    ctx.check(
        "off-nodeport",
        "no affinity: 20 TCP connections from outside to the node's IPv4 address:nodePort (8 backends on another node)",
        Probe::tcp(sa(n4, spread), 20).distinct().external(),
        &[&several],
        None,
    )?;
    ctx.check(
        "off-lb",
        "no affinity: 20 TCP connections from outside to the IPv4 LoadBalancer IP",
        Probe::tcp(sa(o4, 80), 20).distinct().external(),
        &[&several],
        None,
    )?;
    let (http, dns) = (
        node_port(&stored, "sticky", "http")?,
        node_port(&stored, "sticky", "dns")?,
    );
    let checks = [
        (
            "nodeport-tcp-v4",
            "ClientIP affinity: 20 TCP connections from outside to the node's IPv4 address:nodePort",
            Probe::tcp(sa(n4, http), 20),
            n4,
        ),
        (
            "nodeport-udp-v4",
            "20 UDP exchanges (sendto, a new socket each) from outside to the node's IPv4 address:nodePort",
            Probe::udp(sa(n4, dns), 20),
            n4,
        ),
        (
            "nodeport-tcp-v6",
            "20 TCP connections from outside to the node's IPv6 address:nodePort",
            Probe::tcp(sa(n6, http), 20),
            n6,
        ),
        (
            "lb-tcp-v4",
            "20 TCP connections from outside to the IPv4 LoadBalancer IP",
            Probe::tcp(sa(l4, 80), 20),
            n4,
        ),
        (
            "lb-udp-v4",
            "20 UDP exchanges (sendto, a new socket each) from outside to the IPv4 LoadBalancer IP",
            Probe::udp(sa(l4, 53), 20),
            n4,
        ),
        (
            "lb-tcp-v6",
            "20 TCP connections from outside to the IPv6 LoadBalancer IP",
            Probe::tcp(sa(l6, 80), 20),
            n6,
        ),
    ];
    for (check, what, probe, node) in checks {
        ctx.check(
            check,
            what,
            probe.distinct().external(),
            &[&one(node)],
            None,
        )?;
    }
    // The client's backend at the nodePort, then at the LoadBalancer IP of the same Service
    // port; three rounds, each after the affinity (timeoutSeconds 2) has expired, so that a
    // proxy that keeps the two apart shows another backend with probability 1 - (1/8)^3.
    let np = node_port(&stored, "short", "http")?;
    let backend_of = |p: &Proxy, to: SocketAddr| -> Result<String> {
        let probe = Probe::tcp(to, 2).external();
        let r = p.sb.probe_external(&probe.args(), probe.run_timeout())?;
        ensure!(r.all_ok(), "{to}: failures: {:?}", r.failures());
        let names: std::collections::BTreeSet<String> =
            r.results.iter().filter_map(|a| a.backend.clone()).collect();
        ensure!(names.len() == 1, "{to}: affinity did not hold: {names:?}");
        Ok(names.into_iter().next().unwrap_or_default())
    };
    if ctx.dirty.get() {
        ctx.settle()?;
    }
    let start = Instant::now();
    let shared = each(&ctx.world.proxies, |p| {
        let mut same = true;
        for round in 0..3 {
            if round > 0 {
                std::thread::sleep(Duration::from_millis(timeout_s * 1000 + 1000));
            }
            let at_np = backend_of(p, sa(n4, np))?;
            let at_lb = backend_of(p, sa(s4, 80))?;
            same &= at_np == at_lb;
        }
        let text = if same {
            "same backend"
        } else {
            "another backend"
        };
        Ok((text.to_string(), start.elapsed()))
    });
    let mut cells = std::collections::BTreeMap::new();
    for (p, r) in ctx.world.proxies.iter().zip(shared) {
        let (text, after) = r.with_context(|| format!("affinity through {}", p.kind.label()))?;
        let expected = text == "same backend";
        cells.insert(
            p.kind.id().to_string(),
            Cell {
                outcome: Outcome { text },
                after: Some(after),
                expected,
            },
        );
    }
    ctx.record(
        "nodeport-then-lb",
        "a connection to the IPv4 nodePort, then one to the IPv4 LoadBalancer IP of the same Service port (affinity expired between 3 rounds): the same backend each time?",
        false,
        cells,
    );
    Ok(())
}
