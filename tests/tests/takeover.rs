//! Taking over from a running kube-proxy, and handing back, without breaking a connection.
//!
//! A node (a sandbox's client namespace) runs kube-proxy; clients there hold long-lived TCP
//! connections and UDP streams (one connected socket, one unconnected socket with a fixed source
//! port) through ClusterIPs, while another client opens new connections back to back the whole
//! time. Then the README's steps for replacing kube-proxy, exactly as written there:
//!
//! 1. svc-agent starts beside kube-proxy and becomes ready; new connections go through svc
//!    from then on (its hook rewrites connect() before kube-proxy's rules see the packet);
//! 2. kube-proxy stops (its DaemonSet deleted) and `kube-proxy --cleanup` removes its rules;
//!
//! and the way back:
//!
//! 3. kube-proxy starts again and syncs its rules (while svc still serves every new socket);
//! 4. svc-agent stops (its DaemonSet deleted) and `svc-agent uninstall` detaches its programs
//!    and removes its maps; new connections go through kube-proxy again.
//!
//! Every connection made before or between the steps must survive all of them, every new
//! connection must succeed, and new connections must be shown to go through svc (its
//! `translated` counter) after step 1 and through kube-proxy (conntrack entries NATed from the
//! ClusterIP) after step 4. The machine's own firewall is checked before and after.
//!
//! One test per kube-proxy mode: iptables (on Debian's default iptables-nft) and nftables.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use svc_tests::{
    agent::{http_get, uninstall},
    control_plane::ControlPlane,
    kube_proxy::{self, HostFirewallGuard, IptablesBackend, KubeProxy, KubeProxyConfig, Mode},
    probe::{HoldReport, StreamReport},
    require_root, Agent, Sandbox, Tools,
};

const NODE: &str = "takeover-node";

#[test]
fn takeover_from_kube_proxy_iptables_and_back() {
    run(Mode::Iptables(IptablesBackend::Nft)).unwrap();
}

#[test]
fn takeover_from_kube_proxy_nftables_and_back() {
    run(Mode::Nftables).unwrap();
}

fn log(t0: Instant, what: &str) -> u64 {
    let now = unix_ms();
    eprintln!("[{:>6.2} s] {what}", t0.elapsed().as_secs_f64());
    now
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn objects(sb: &Sandbox) -> Vec<Value> {
    let ns = "takeover";
    let b =
        |i: u8| json!({"addresses": [sb.backend_v4(i).to_string()], "conditions": {"ready": true}});
    vec![
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": ns},
               "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "web-1", "namespace": ns,
                            "labels": {"kubernetes.io/service-name": "web"}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": [b(1), b(2)]}),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dns", "namespace": ns},
               "spec": {"ports": [{"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "dns-1", "namespace": ns,
                            "labels": {"kubernetes.io/service-name": "dns"}},
               "addressType": "IPv4", "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"}],
               "endpoints": [b(1), b(2)]}),
    ]
}

fn cluster_ip(stored: &[Value], name: &str) -> Result<IpAddr> {
    let svc = stored
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == name)
        .with_context(|| format!("no Service {name}"))?;
    Ok(svc["spec"]["clusterIP"]
        .as_str()
        .context("clusterIP")?
        .parse()?)
}

/// New connections (TCP, connected UDP, unconnected UDP) all answered.
fn new_connections_work(sb: &Sandbox, web: SocketAddr, dns: SocketAddr) -> Result<()> {
    let r = sb.tcp(web, 5, &["--timeout-ms", "1000"])?;
    ensure!(
        r.all_ok(),
        "new TCP connections to {web} failed: {:?}",
        r.failures()
    );
    let r = sb.udp(dns, 3, true)?;
    ensure!(
        r.all_ok(),
        "new connected UDP sockets to {dns} failed: {:?}",
        r.failures()
    );
    let r = sb.udp(dns, 3, false)?;
    ensure!(
        r.all_ok(),
        "new unconnected UDP exchanges with {dns} failed: {:?}",
        r.failures()
    );
    Ok(())
}

fn eventually(within: Duration, mut f: impl FnMut() -> Result<()>) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        match f() {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// svc's count of connect()/sendmsg() calls it translated.
fn translated(agent: &Agent) -> Result<u64> {
    let (_, body) = http_get(agent.metrics_addr().context("metrics address")?, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix("svc_datapath_decisions_total{reason=\"translated\"} "))
        .and_then(|v| v.trim().parse().ok())
        .context("no translated counter in /metrics")
}

/// conntrack entries in the node's namespace whose original destination is `vip`: flows
/// kube-proxy NATed (svc's sockets are connected to the backend itself).
fn natted_flows(sb: &Sandbox, vip: IpAddr) -> Result<BTreeSet<String>> {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", sb.client_ns().path().display()))
        .args(["--", "conntrack", "-L", "-d", &vip.to_string()])
        .stdin(Stdio::null())
        .output()
        .context("running conntrack")?;
    ensure!(
        out.status.success(),
        "conntrack -L: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(flows(&out.stdout))
}

/// `conntrack -L`'s entries by their original tuple (protocol, addresses, ports), so that
/// entries made between two listings are told apart from entries that timed out between
/// them (a count alone can stay level while closed flows expire).
fn flows(listing: &[u8]) -> BTreeSet<String> {
    String::from_utf8_lossy(listing)
        .lines()
        .map(|l| {
            let mut words = l.split_whitespace();
            let proto = words.next().unwrap_or("").to_string();
            let tuple: Vec<&str> = words
                .filter(|w| {
                    ["src=", "dst=", "sport=", "dport="]
                        .iter()
                        .any(|k| w.starts_with(k))
                })
                .take(4)
                .collect();
            format!("{proto} {}", tuple.join(" "))
        })
        .collect()
}

/// The README's section on replacing kube-proxy: the steps this test performs. Fails if it
/// no longer names a command the test runs.
fn readme_steps() -> Result<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))?;
    let start = readme
        .find("To replace kube-proxy:")
        .context("README.md: no \"To replace kube-proxy:\" section")?;
    let end = readme[start..]
        .find("\n## ")
        .map_or(readme.len(), |e| start + e);
    let section = readme[start..end].to_string();
    for command in [
        "kubectl -n kube-system delete daemonset kube-proxy",
        "kube-proxy --cleanup",
        "nft delete table ip svc-keep-nat; nft delete table ip6 svc-keep-nat",
        "kubectl -n kube-system delete daemonset svc-agent",
        "svc-agent uninstall",
    ] {
        ensure!(
            section.contains(command),
            "README.md's steps for replacing kube-proxy no longer say `{command}`, which this \
             test performs: update one or the other"
        );
    }
    Ok(section)
}

/// The nftables script the README runs before `kube-proxy --cleanup` in nftables mode (the
/// lines of its `nft -f - <<'EOF'` block): one NAT base chain and one conntrack match, IPv4
/// and IPv6 (see step 2 in `run`).
fn readme_keep_nat(section: &str) -> Result<String> {
    let lines: Vec<&str> = section.lines().map(str::trim).collect();
    let from = lines
        .iter()
        .position(|l| *l == "nft -f - <<'EOF'")
        .context("README.md: no `nft -f - <<'EOF'` block in the steps")?;
    let to = lines[from..]
        .iter()
        .position(|l| *l == "EOF")
        .context("README.md: the nft block has no EOF")?;
    Ok(lines[from + 1..from + to].join("\n") + "\n")
}

/// `nft -f -` in the node's namespace.
fn nft(sb: &Sandbox, script: &str) -> Result<()> {
    use std::io::Write;
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", sb.client_ns().path().display()))
        .args(["--", "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft")?;
    child
        .stdin
        .take()
        .context("nft stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "nft -f: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn check_hold(what: &str, r: &HoldReport, n: u32) -> Result<()> {
    ensure!(
        r.connections.len() == n as usize,
        "{what}: {} connections",
        r.connections.len()
    );
    for (i, c) in r.connections.iter().enumerate() {
        ensure!(
            c.failures == 0 && c.exchanges > 0 && !c.switched,
            "{what}: connection {i} broke: {c:?}"
        );
    }
    eprintln!(
        "    {what}: {} connections, {} exchanges, none failed",
        n,
        r.connections.iter().map(|c| c.exchanges).sum::<u64>()
    );
    Ok(())
}

fn check_stream(what: &str, r: &StreamReport, t0_ms: u64) -> Result<()> {
    let failed: Vec<_> = r.exchanges.iter().filter(|e| !e.ok).collect();
    let sockets = r.exchanges.iter().map(|e| e.socket).max().unwrap_or(0) + 1;
    if !failed.is_empty() || sockets != 1 {
        let summary: Vec<String> = failed
            .iter()
            .take(8)
            .map(|e| {
                format!(
                    "{:+.2} s {}",
                    (e.at_ms as f64 - t0_ms as f64) / 1e3,
                    e.error.clone().unwrap_or_default()
                )
            })
            .collect();
        bail!(
            "{what}: {} of {} exchanges failed, {sockets} sockets; first failures (since the \
             start): {summary:?}",
            failed.len(),
            r.exchanges.len()
        );
    }
    eprintln!(
        "    {what}: {} exchanges on one socket, none failed",
        r.exchanges.len()
    );
    Ok(())
}

fn run(mode: Mode) -> Result<()> {
    require_root();
    let steps = readme_steps()?;
    let keep_nat = readme_keep_nat(&steps)?;
    ensure!(
        keep_nat.contains("svc-keep-nat"),
        "README.md's nft block: {keep_nat}"
    );
    let mut firewall = HostFirewallGuard::new()?;
    let t0 = Instant::now();
    let t0_ms = unix_ms();
    let cp = ControlPlane::start()?;
    let sb = Sandbox::new(Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe")))?;
    sb.add_default_route()?;
    let _backends = sb.backends(2, &[8080, 5353])?;
    let node = json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "status": {"addresses": [{"type": "InternalIP", "address": sb.client_v4().to_string()}]},
    });
    cp.kubectl_stdin(&["create", "-f", "-"], &node.to_string())?;
    cp.apply_yaml(
        &json!({"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": "takeover"}})
        .to_string(),
    )?;
    let yaml: Vec<String> = objects(&sb).iter().map(Value::to_string).collect();
    let stored = cp.apply_yaml(&yaml.join("\n---\n"))?;
    let web = SocketAddr::new(cluster_ip(&stored, "web")?, 80);
    let dns = SocketAddr::new(cluster_ip(&stored, "dns")?, 53);

    // The node as it is before: kube-proxy serves it.
    let bin = kube_proxy::binary_from_env()?;
    let mut kp = KubeProxy::start(KubeProxyConfig::new(&bin, mode, NODE), &cp, sb.client_ns())?;
    kp.wait_ready(kube_proxy::READY_TIMEOUT)?;
    eventually(Duration::from_secs(20), || {
        new_connections_work(&sb, web, dns)
    })?;
    log(t0, &format!("{} serves the node", mode.label()));

    // Clients that live through everything; and new connections back to back all along.
    let whole = Duration::from_secs(30);
    let hold_a = sb.spawn_hold(web, 4, whole, 50)?;
    let udp_a = sb.spawn_udp_stream(dns, whole, 50, 1000)?;
    let udp_unconnected_a = sb.spawn_udp_unconnected(dns, 1, whole, 50, 1000)?;
    let new_all_along = sb.spawn_loop(web, whole)?;
    let clients_started = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    log(
        t0,
        "long-lived TCP connections and UDP streams through kube-proxy",
    );

    // Step 1: svc-agent starts beside kube-proxy.
    let bpffs = sb.bpffs()?;
    let mut agent = sb.agent_kube(&bpffs, &cp, NODE, &[])?;
    log(t0, "step 1: svc-agent ready beside kube-proxy");
    let before = translated(&agent)?;
    new_connections_work(&sb, web, dns)?;
    let after = translated(&agent)?;
    ensure!(
        after >= before + 11,
        "new connections did not go through svc (translated {before} -> {after})"
    );

    // Step 2: kube-proxy stops, its rules are cleaned away. In nftables mode kube-proxy's table
    // holds the namespace's only NAT chains and its only conntrack expressions: deleting it
    // unregisters the NAT hooks and conntrack's own, and every flow kube-proxy NATed (an
    // established TCP connection or a connected UDP socket to a ClusterIP) breaks: its
    // packets leave with the ClusterIP as destination. A table with one NAT chain and one
    // conntrack match keeps both registered until those flows are gone (measured: without the
    // NAT chain, or without the conntrack match, they break). iptables mode leaves its base
    // chains behind, which keeps both.
    if mode == Mode::Nftables {
        nft(&sb, &keep_nat)?;
    }
    kp.stop(Duration::from_secs(10))?;
    kp.cleanup()?;
    let rules = kp.rules()?;
    // iptables mode leaves an empty KUBE-FIREWALL chain (shared with the kubelet) behind.
    let left: Vec<&str> = rules
        .lines()
        .filter(|l| {
            l.contains("kube-proxy") || (l.contains("KUBE-") && !l.contains("KUBE-FIREWALL"))
        })
        .collect();
    ensure!(
        left.is_empty(),
        "kube-proxy --cleanup left rules behind: {left:?}\n{rules}"
    );
    log(
        t0,
        "step 2: kube-proxy stopped, `kube-proxy --cleanup` removed its rules",
    );
    new_connections_work(&sb, web, dns)?;
    ensure!(
        translated(&agent)? >= after + 11,
        "new connections did not go through svc"
    );

    // Clients made under svc, which must survive the way back.
    // Ending a few seconds before the first clients, so that they see all of the way back.
    let rest = whole
        .saturating_sub(clients_started.elapsed())
        .saturating_sub(Duration::from_secs(5));
    ensure!(
        rest > Duration::from_secs(10),
        "steps 1 and 2 took too long: {:?}",
        t0.elapsed()
    );
    let hold_b = sb.spawn_hold(web, 4, rest, 50)?;
    let udp_b = sb.spawn_udp_stream(dns, rest, 50, 1000)?;
    std::thread::sleep(Duration::from_secs(3));
    log(
        t0,
        "long-lived TCP connections and a UDP stream through svc",
    );

    // Step 3: kube-proxy back.
    kp.restart()?;
    kp.wait_ready(kube_proxy::READY_TIMEOUT)?;
    log(t0, "step 3: kube-proxy started again and synced");

    // Step 4: svc-agent stops and is uninstalled.
    let status = agent.terminate(Duration::from_secs(10))?;
    ensure!(status.success(), "svc-agent exited with {status}");
    uninstall(&sb.tools.agent, bpffs.path(), Some(sb.cgroup().path()))?;
    ensure!(
        !bpffs.path().exists(),
        "uninstall left {}",
        bpffs.path().display()
    );
    log(t0, "step 4: svc-agent stopped and uninstalled");
    if mode == Mode::Nftables {
        // kube-proxy's own NAT chains are back: the keeper goes.
        nft(
            &sb,
            "delete table ip svc-keep-nat\ndelete table ip6 svc-keep-nat\n",
        )?;
    }
    let natted = natted_flows(&sb, web.ip())?;
    new_connections_work(&sb, web, dns)?;
    ensure!(
        natted_flows(&sb, web.ip())?.difference(&natted).count() > 0,
        "new connections were not NATed by kube-proxy"
    );

    let loop_report = sb.finish_loop(new_all_along, whole + Duration::from_secs(20))?;
    let hold_a = sb.finish_hold(hold_a, whole + Duration::from_secs(20))?;
    let hold_b = sb.finish_hold(hold_b, whole)?;
    let udp_a = sb.finish_udp_stream(udp_a, whole + Duration::from_secs(20))?;
    let udp_unconnected_a =
        sb.finish_udp_stream(udp_unconnected_a, whole + Duration::from_secs(20))?;
    let udp_b = sb.finish_udp_stream(udp_b, whole)?;
    log(t0, "clients done");
    let mut failures = Vec::new();
    eprintln!(
        "    new connections all along: {} ok, {} failed {:?}",
        loop_report.ok, loop_report.failed, loop_report.errors
    );
    if loop_report.failed != 0 || loop_report.ok == 0 {
        failures.push(format!("new connections failed: {loop_report:?}"));
    }
    for r in [
        check_hold("TCP connections made under kube-proxy", &hold_a, 4),
        check_hold("TCP connections made under svc", &hold_b, 4),
        check_stream("connected UDP socket made under kube-proxy", &udp_a, t0_ms),
        check_stream(
            "unconnected UDP socket (one source port) made under kube-proxy",
            &udp_unconnected_a,
            t0_ms,
        ),
        check_stream("connected UDP socket made under svc", &udp_b, t0_ms),
    ] {
        if let Err(e) = r {
            failures.push(format!("{e:#}"));
        }
    }
    drop(kp);
    drop(bpffs);
    drop(sb);
    drop(cp);
    firewall.check()?;
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// Step 1 alone, for a NodePort: an external client holds TCP connections through a NodePort
/// served by kube-proxy (nftables mode), and svc-agent starts beside it with its tc programs on
/// the node's devices (the uplink and the device towards the backends); the connections live on.
///
/// Before svc passed them on, they were reset as the agent became ready: its tc program on the
/// uplink had no flow for a connection's next packet, took it for a new one to the NodePort and
/// sent it to a backend with a SNAT port of its own, which reset it. Now a TCP packet other than
/// a SYN that no flow of svc's knows goes to the stack, whose conntrack carries the connection
/// on (`pass_midstream`). The way back: `nodeport_flows_across_svc_uninstall`.
#[test]
fn nodeport_flows_across_svc_start() {
    nodeport_step1(Mode::Nftables).unwrap();
}

fn nodeport_step1(mode: Mode) -> Result<()> {
    require_root();
    let mut firewall = HostFirewallGuard::new()?;
    let t0 = Instant::now();
    let cp = ControlPlane::start()?;
    let mut sb = Sandbox::new(Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe")))?;
    sb.add_default_route()?;
    sb.add_uplink()?;
    let _backends = sb.backends(2, &[8080])?;
    let node = json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "status": {"addresses": [{"type": "InternalIP", "address": sb.client_v4().to_string()}]},
    });
    cp.kubectl_stdin(&["create", "-f", "-"], &node.to_string())?;
    let ns = "takeover";
    let b =
        |i: u8| json!({"addresses": [sb.backend_v4(i).to_string()], "conditions": {"ready": true}});
    let objects = [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "np", "namespace": ns},
               "spec": {"type": "NodePort",
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "np-1", "namespace": ns,
                            "labels": {"kubernetes.io/service-name": "np"}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": [b(1), b(2)]}),
    ];
    let yaml: Vec<String> = objects.iter().map(Value::to_string).collect();
    let stored = cp.apply_yaml(&yaml.join("\n---\n"))?;
    let np = stored
        .iter()
        .find(|o| o["kind"] == "Service")
        .and_then(|s| s["spec"]["ports"][0]["nodePort"].as_u64())
        .context("no nodePort")?;
    let to = SocketAddr::new(IpAddr::V4(sb.client_v4()), np as u16);
    let bin = kube_proxy::binary_from_env()?;
    let mut kp = KubeProxy::start(KubeProxyConfig::new(&bin, mode, NODE), &cp, sb.client_ns())?;
    kp.wait_ready(kube_proxy::READY_TIMEOUT)?;
    eventually(Duration::from_secs(20), || {
        let r = sb.probe_external(
            &[
                "tcp",
                "--to",
                &to.to_string(),
                "--count",
                "3",
                "--timeout-ms",
                "1000",
                "--who",
            ]
            .map(String::from),
            Duration::from_secs(10),
        )?;
        ensure!(r.all_ok(), "{:?}", r.failures());
        Ok(())
    })?;
    log(t0, "kube-proxy serves the NodePort");
    let whole = Duration::from_secs(15);
    let hold = sb.spawn_hold_external(to, 4, whole, 50)?;
    std::thread::sleep(Duration::from_secs(2));
    let bpffs = sb.bpffs()?;
    let relay = kube_proxy::ApiRelay::to_api_server(sb.client_ns(), &cp)?;
    let dir = svc_tests::TempDir::new("svc-takeover-agent")?;
    let kubeconfig = relay.kubeconfig(&cp, cp.kubeconfig_path(), dir.path())?;
    let launcher: [std::ffi::OsString; 2] = [
        "nsenter".into(),
        format!("--net={}", sb.client_ns().path().display()).into(),
    ];
    let mut agent = Agent::start_kube_launched(
        &launcher,
        &sb.tools.agent,
        &kubeconfig,
        NODE,
        sb.cgroup().path(),
        bpffs.path(),
        &["--devices", &format!("{},vc", svc_tests::sandbox::UPLINK)],
    )?;
    agent.wait_ready(svc_tests::sandbox::AGENT_READY_TIMEOUT)?;
    log(t0, "svc-agent ready beside kube-proxy, tc on the uplink");
    let report = sb.finish_hold_external(hold, whole + Duration::from_secs(20))?;
    let result = check_hold("NodePort connections made under kube-proxy", &report, 4);
    drop(agent);
    drop(kp);
    drop(bpffs);
    drop(relay);
    drop(sb);
    drop(cp);
    firewall.check()?;
    result
}

/// The way back, for NodePorts: an external client holds TCP connections and a UDP stream
/// through NodePorts served by svc's tc programs (kube-proxy not running), to a backend svc
/// takes for local (DNAT only, through the stack) and one it takes for remote (SNATed to the
/// node, redirected past netfilter); kube-proxy (nftables mode) starts in the node's
/// namespace; svc-agent stops and `svc-agent uninstall` runs there. Every held connection and
/// stream must live on (svc hands its flows over to the node's conntrack), and new connections
/// must go through kube-proxy. The same for ExternalIPs and LoadBalancer IPs:
/// `externalip_flows_across_svc_uninstall`, `loadbalancer_flows_across_svc_uninstall`.
#[test]
fn nodeport_flows_across_svc_uninstall() {
    way_back(Via::NodePort, Mode::Nftables, false, 0, None).unwrap();
}

/// The same way back to kube-proxy in iptables mode (Debian's default iptables-nft): its NAT
/// rules, not nftables mode's, must take the handed-over flows as established.
#[test]
fn nodeport_flows_across_svc_uninstall_to_iptables_mode() {
    way_back(
        Via::NodePort,
        Mode::Iptables(IptablesBackend::Nft),
        false,
        0,
        None,
    )
    .unwrap();
}

/// The way back for IPv6 NodePort flows (the node dual-stack, the Services IPv6 only),
/// kube-proxy in nftables mode.
#[test]
fn nodeport_flows_across_svc_uninstall_ipv6() {
    way_back(Via::NodePort, Mode::Nftables, true, 0, None).unwrap();
}

/// The window between a flow's kernel entry and svc's mark on it, widened to 300 ms per flow
/// (`SVC_TEST_HANDOVER_PAUSE_MS`, fault injection): the held TCP connections send into it
/// every 50 ms. A segment of a flow to the local backend that svc translated in the window met
/// netfilter beside the new entry, was taken for a new connection with its source port
/// remapped, and the backend reset the connection; svc now drops the client's packets of a
/// flow being handed over (the client retransmits). The local UDP stream loses the datagrams
/// sent into the window either way, so it is not checked; the remote one (redirected past
/// netfilter, never marked) is.
#[test]
fn nodeport_flows_across_a_widened_handover_window() {
    way_back(Via::NodePort, Mode::Nftables, false, 300, None).unwrap();
}

/// `svc-agent uninstall` killed (SIGKILL) in the middle of its handover, 1.2 s into it, with
/// the handover slowed to 400 ms per flow (`SVC_TEST_HANDOVER_PAUSE_MS`, a pause after each
/// flow's kernel entry is made): a few flows handed over, one with its kernel entry made but
/// not yet marked HANDED, the rest not begun. The operator runs it again at once: it hands
/// over every flow the first run did not finish (the one in the middle included: it reports
/// the kernel entry the first run made on its tuples replaced), none fails, and every held
/// connection and the remote UDP stream live on. Before, the rerun reported that flow failed
/// (the kernel entry existed).
#[test]
fn nodeport_flows_across_an_uninstall_killed_mid_handover() {
    way_back(
        Via::NodePort,
        Mode::Nftables,
        false,
        400,
        Some(Duration::from_millis(1200)),
    )
    .unwrap();
}

/// The way back from a node whose assured flows are in `SVC_CT` of layout 3 (a hash allocated
/// in full, before 2026-12-07), uninstalled by this agent: it hands those flows over, every
/// held connection and stream lives on. Before, it looked for this layout's pin alone and
/// handed over none of them.
#[test]
fn nodeport_flows_across_an_uninstall_of_the_older_connection_table() {
    way_back_from(Via::NodePort, Mode::Nftables, false, 0, None, true).unwrap();
}

/// Moves the entries of this layout's `SVC_CT` pin under `dir` into a map of layout 3 (the same
/// hash, preallocated), pinned as `SVC_CT_v3`, and removes this layout's pin.
fn as_ct_layout_3(dir: &std::path::Path) -> Result<()> {
    use std::os::fd::AsFd;
    let entries: Vec<(svc_common::CtKey, svc_common::CtValue)> = {
        let store = svc_agent::datapath::open_pinned(dir)?;
        let ct = store.ct.as_ref().context("no SVC_CT")?;
        svc_agent::sys::dump_hash(ct.fd().as_fd())?
    };
    ensure!(!entries.is_empty(), "no assured flow to move");
    svc_tests::pins::pin_old_ct(dir, 3, svc_tests::pins::HASH, &entries)?;
    std::fs::remove_file(svc_agent::datapath::map_pin(dir, svc_common::map_names::CT))?;
    Ok(())
}

/// The same way back for flows to ExternalIPs (one per Service, routed to the node), to
/// kube-proxy in iptables mode.
#[test]
fn externalip_flows_across_svc_uninstall() {
    way_back(
        Via::ExternalIp,
        Mode::Iptables(IptablesBackend::Nft),
        false,
        0,
        None,
    )
    .unwrap();
}

/// The same way back for flows to LoadBalancer IPs (status.loadBalancer written by the test,
/// as a cloud's controller would), to kube-proxy in nftables mode.
#[test]
fn loadbalancer_flows_across_svc_uninstall() {
    way_back(Via::LoadBalancer, Mode::Nftables, false, 0, None).unwrap();
}

/// `svc-agent uninstall --bpffs BPFFS` in network namespace `ns` (where svc's tc devices
/// are), with `SVC_TEST_HANDOVER_PAUSE_MS` = `pause_ms`. nsenter execs it in place: the
/// command's process is the agent's.
fn uninstall_command(
    ns: &svc_tests::NetNs,
    agent: &std::path::Path,
    bpffs: &std::path::Path,
    pause_ms: u64,
) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net={}", ns.path().display()))
        .arg("--")
        .arg(agent)
        .args(["uninstall", "--bpffs"])
        .arg(bpffs)
        .env("SVC_TEST_HANDOVER_PAUSE_MS", pause_ms.to_string())
        .stdin(Stdio::null());
    c
}

/// Starts `svc-agent uninstall` (`uninstall_command`) and SIGKILLs it `after` its start;
/// fails if it ended before.
fn uninstall_killed_in(
    ns: &svc_tests::NetNs,
    agent: &std::path::Path,
    bpffs: &std::path::Path,
    pause_ms: u64,
    after: Duration,
) -> Result<()> {
    let mut child = uninstall_command(ns, agent, bpffs, pause_ms)
        .stdout(Stdio::null())
        .spawn()
        .context("starting svc-agent uninstall")?;
    std::thread::sleep(after);
    let early = child.try_wait();
    // Killed and reaped whatever `try_wait` said: our own child, by its handle.
    let _ = child.kill();
    let _ = child.wait();
    let early = early.context("polling svc-agent uninstall")?;
    ensure!(
        early.is_none(),
        "svc-agent uninstall ended ({early:?}) before it could be killed"
    );
    Ok(())
}

/// Runs `svc-agent uninstall` (`uninstall_command`); prints its report and returns it
/// (stdout). Fails if it fails.
fn uninstall_in(
    ns: &svc_tests::NetNs,
    agent: &std::path::Path,
    bpffs: &std::path::Path,
    pause_ms: u64,
) -> Result<String> {
    let out = uninstall_command(ns, agent, bpffs, pause_ms)
        .output()
        .context("running svc-agent uninstall")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "    svc-agent uninstall: {}\n    {}",
        text.lines()
            .filter(|l| !l.starts_with("removed "))
            .collect::<Vec<_>>()
            .join("\n    "),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "svc-agent uninstall failed");
    Ok(text)
}

/// Checks `svc-agent uninstall`'s report (`text`, its stdout): `flows` flows handed over to
/// the node's conntrack, none failed.
fn ensure_handed(text: &str, flows: u64) -> Result<()> {
    let handed = handed_of(text)?;
    ensure!(
        handed == flows,
        "uninstall handed over {handed} flows, not {flows}"
    );
    Ok(())
}

/// The number of flows `svc-agent uninstall`'s report (`text`) says it handed over; fails
/// unless it says none failed.
fn handed_of(text: &str) -> Result<u64> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("handed over to the node's conntrack: "))
        .with_context(|| format!("uninstall reported no handover: {text:?}"))?;
    line.strip_suffix(" flows, 0 failed")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("uninstall handed over {line:?}: not every flow"))
}

/// The frontend the external client's flows go to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    NodePort,
    ExternalIp,
    LoadBalancer,
}

/// `pause_ms`: `SVC_TEST_HANDOVER_PAUSE_MS` for the uninstall (0: none); with a pause, the
/// local UDP stream is not checked. `kill_after`: a first uninstall is killed this long
/// after its start, and a second one, without a pause, finishes the way back.
fn way_back(
    via: Via,
    mode: Mode,
    v6: bool,
    pause_ms: u64,
    kill_after: Option<Duration>,
) -> Result<()> {
    way_back_from(via, mode, v6, pause_ms, kill_after, false)
}

/// `way_back`; `ct_layout_3`: the assured flows are moved into a pin of `SVC_CT`'s layout 3 (a
/// hash allocated in full) before the uninstall, as a node still run by such an agent holds
/// them.
fn way_back_from(
    via: Via,
    mode: Mode,
    v6: bool,
    pause_ms: u64,
    kill_after: Option<Duration>,
    ct_layout_3: bool,
) -> Result<()> {
    require_root();
    let mut firewall = HostFirewallGuard::new()?;
    let t0 = Instant::now();
    let t0_ms = unix_ms();
    let cp = ControlPlane::start()?;
    let mut sb = Sandbox::new(Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe")))?;
    sb.add_default_route()?;
    sb.add_uplink()?;
    let _backends = sb.backends(2, &[8080])?;
    let node = json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "status": {"addresses": [{"type": "InternalIP", "address": sb.client_v4().to_string()},
                                 {"type": "InternalIP", "address": sb.client_v6().to_string()}]},
    });
    cp.kubectl_stdin(&["create", "-f", "-"], &node.to_string())?;
    let ns = "takeover";
    let (family, node_ip): (&str, IpAddr) = if v6 {
        ("IPv6", sb.client_v6().into())
    } else {
        ("IPv4", sb.client_v4().into())
    };
    // Backend 1 on this node (svc: DNAT only), backend 2 on another (svc: SNAT).
    let ep = |i: u8, node: &str| {
        let addr: IpAddr = if v6 {
            sb.backend_v6(i).into()
        } else {
            sb.backend_v4(i).into()
        };
        json!({"addresses": [addr.to_string()], "conditions": {"ready": true},
               "nodeName": node})
    };
    // The frontend address of Service `i` (0: local backend, 1: remote) for ExternalIPs and
    // LoadBalancer IPs: one of the addresses the external client routes to the node.
    let frontend = |i: u8| -> IpAddr {
        if v6 {
            sb.frontend_v6(10 + i).into()
        } else {
            sb.frontend_v4(10 + i).into()
        }
    };
    let service = |name: &str, i: u8| {
        let mut spec = json!({"type": "NodePort", "ipFamilyPolicy": "SingleStack",
                              "ipFamilies": [family],
                              "ports": [{"name": "http", "port": 80, "targetPort": 8080},
                                        {"name": "dns", "port": 53, "targetPort": 8080,
                                         "protocol": "UDP"}]});
        match via {
            Via::NodePort => {}
            Via::ExternalIp => {
                spec["type"] = json!("ClusterIP");
                spec["externalIPs"] = json!([frontend(i).to_string()]);
            }
            Via::LoadBalancer => spec["type"] = json!("LoadBalancer"),
        }
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
               "spec": spec})
    };
    let slice = |name: &str, e: Value| {
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": format!("{name}-1"), "namespace": ns,
                            "labels": {"kubernetes.io/service-name": name}},
               "addressType": family,
               "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                         {"name": "dns", "port": 8080, "protocol": "UDP"}],
               "endpoints": [e]})
    };
    let objects = [
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        service("np-local", 0),
        slice("np-local", ep(1, NODE)),
        service("np-remote", 1),
        slice("np-remote", ep(2, "elsewhere")),
    ];
    let yaml: Vec<String> = objects.iter().map(Value::to_string).collect();
    let stored = cp.apply_yaml(&yaml.join("\n---\n"))?;
    if via == Via::LoadBalancer {
        for (name, i) in [("np-local", 0), ("np-remote", 1)] {
            let status = json!({"status": {"loadBalancer": {"ingress": [
                {"ip": frontend(i).to_string(), "ipMode": "VIP"}]}}});
            cp.kubectl(&[
                "patch",
                "service",
                name,
                "-n",
                ns,
                "--subresource=status",
                "--type=merge",
                "-p",
                &status.to_string(),
            ])?;
        }
    }
    let address = |name: &str, i: u8, port: usize| -> Result<SocketAddr> {
        if via != Via::NodePort {
            return Ok(SocketAddr::new(frontend(i), [80, 53][port]));
        }
        let np = stored
            .iter()
            .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == name)
            .and_then(|s| s["spec"]["ports"][port]["nodePort"].as_u64())
            .with_context(|| format!("no nodePort for {name}"))?;
        Ok(SocketAddr::new(node_ip, np as u16))
    };
    let (tcp_local, udp_local) = (address("np-local", 0, 0)?, address("np-local", 0, 1)?);
    let (tcp_remote, udp_remote) = (address("np-remote", 1, 0)?, address("np-remote", 1, 1)?);
    let probe_ok = |to: SocketAddr| -> Result<()> {
        let r = sb.probe_external(
            &[
                "tcp",
                "--to",
                &to.to_string(),
                "--count",
                "3",
                "--timeout-ms",
                "1000",
                "--who",
            ]
            .map(String::from),
            Duration::from_secs(10),
        )?;
        ensure!(r.all_ok(), "{to}: {:?}", r.failures());
        Ok(())
    };

    // svc alone serves the frontends.
    let bpffs = sb.bpffs()?;
    let relay = kube_proxy::ApiRelay::to_api_server(sb.client_ns(), &cp)?;
    let dir = svc_tests::TempDir::new("svc-wayback-agent")?;
    let kubeconfig = relay.kubeconfig(&cp, cp.kubeconfig_path(), dir.path())?;
    let launcher: [std::ffi::OsString; 2] = [
        "nsenter".into(),
        format!("--net={}", sb.client_ns().path().display()).into(),
    ];
    let mut agent = Agent::start_kube_launched(
        &launcher,
        &sb.tools.agent,
        &kubeconfig,
        NODE,
        sb.cgroup().path(),
        bpffs.path(),
        &["--devices", &format!("{},vc", svc_tests::sandbox::UPLINK)],
    )?;
    agent.wait_ready(svc_tests::sandbox::AGENT_READY_TIMEOUT)?;
    eventually(Duration::from_secs(20), || {
        probe_ok(tcp_local)?;
        probe_ok(tcp_remote)
    })?;
    log(
        t0,
        &format!("svc serves the {via:?} frontends (no kube-proxy)"),
    );

    let whole = Duration::from_secs(30);
    let held_since = Instant::now();
    let hold_local = sb.spawn_hold_external(tcp_local, 4, whole, 50)?;
    let hold_remote = sb.spawn_hold_external(tcp_remote, 4, whole, 50)?;
    let stream_local = sb.spawn_udp_stream_external(udp_local, whole, 50, 1000)?;
    let stream_remote = sb.spawn_udp_stream_external(udp_remote, whole, 50, 1000)?;
    std::thread::sleep(Duration::from_secs(2));
    log(t0, "external TCP connections and UDP streams through svc");

    // The way back: kube-proxy starts and syncs, then svc goes.
    let bin = kube_proxy::binary_from_env()?;
    let mut kp = KubeProxy::start(KubeProxyConfig::new(&bin, mode, NODE), &cp, sb.client_ns())?;
    kp.wait_ready(kube_proxy::READY_TIMEOUT)?;
    std::thread::sleep(Duration::from_secs(1));
    log(t0, "kube-proxy started beside svc and synced");
    let status = agent.terminate(Duration::from_secs(10))?;
    ensure!(status.success(), "svc-agent exited with {status}");
    if ct_layout_3 {
        as_ct_layout_3(bpffs.path())?;
        log(t0, "the assured flows moved into a pin of layout 3");
    }
    let uninstall_began = Instant::now();
    // Every held connection and stream is a live flow: 4 + 4 TCP connections, 2 UDP streams.
    if let Some(after) = kill_after {
        uninstall_killed_in(
            sb.client_ns(),
            &sb.tools.agent,
            bpffs.path(),
            pause_ms,
            after,
        )?;
        log(
            t0,
            "svc-agent uninstall killed in the middle of its handover",
        );
        let text = uninstall_in(sb.client_ns(), &sb.tools.agent, bpffs.path(), 0)?;
        // The first run finished some flows (the rerun skips them), not all, and was killed
        // in the pause after a flow's kernel entry: the rerun replaced that entry.
        let rest = handed_of(&text)?;
        ensure!(
            (1..10).contains(&rest),
            "the rerun handed over {rest} of the 10 flows: the kill did not land in the middle"
        );
        ensure!(
            text.contains("\n  1 of them in place of a kernel entry"),
            "the rerun replaced no kernel entry of the killed run's: the kill did not land in a flow's handover"
        );
    } else {
        let text = uninstall_in(sb.client_ns(), &sb.tools.agent, bpffs.path(), pause_ms)?;
        ensure_handed(&text, 10)?;
        // The pause comes once per flow handed over: 10 of them.
        ensure!(
            uninstall_began.elapsed() >= Duration::from_millis(10 * pause_ms),
            "the handover pause did not take effect: uninstall took {:?}",
            uninstall_began.elapsed()
        );
    }
    ensure!(
        !bpffs.path().exists(),
        "uninstall left {}",
        bpffs.path().display()
    );
    log(t0, "svc-agent stopped and uninstalled");
    ensure!(
        held_since.elapsed() + Duration::from_secs(5) < whole,
        "the way back took too long: the clients ended before it was over"
    );

    let mut failures = Vec::new();
    // New connections go through kube-proxy: its conntrack entries, NATed from the frontend.
    let natted = |to: SocketAddr| -> Result<BTreeSet<String>> {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", sb.client_ns().path().display()))
            .args([
                "--",
                "conntrack",
                "-L",
                "-f",
                if v6 { "ipv6" } else { "ipv4" },
            ])
            .args(["-p", "tcp", "--orig-dst"])
            .arg(to.ip().to_string())
            .arg("--orig-port-dst")
            .arg(to.port().to_string())
            .stdin(Stdio::null())
            .output()
            .context("running conntrack")?;
        Ok(flows(&out.stdout))
    };
    for to in [tcp_local, tcp_remote] {
        let before = natted(to)?;
        if let Err(e) = probe_ok(to) {
            failures.push(format!("new connections after uninstall: {e:#}"));
        }
        let new = natted(to)?.difference(&before).count();
        if new < 3 {
            failures.push(format!(
                "new connections to {to} after uninstall: {new} new conntrack entries"
            ));
        }
    }
    let t = whole + Duration::from_secs(20);
    let hold_local = sb.finish_hold_external(hold_local, t)?;
    let hold_remote = sb.finish_hold_external(hold_remote, t)?;
    let stream_local = sb.finish_udp_stream_external(stream_local, t)?;
    let stream_remote = sb.finish_udp_stream_external(stream_remote, t)?;
    log(t0, "clients done");
    for r in [
        check_hold(
            &format!("{via:?} connections made under svc (local backend)"),
            &hold_local,
            4,
        ),
        check_hold(
            &format!("{via:?} connections made under svc (remote backend, SNAT)"),
            &hold_remote,
            4,
        ),
        // With the flows moved into a pin of layout 3, the programs still attached read this
        // layout's map, which the handover's marks do not reach: a datagram translated beside
        // the new kernel entry is lost, as in a widened window (on a node of layout 3 the
        // programs read the pin the marks go to).
        if pause_ms == 0 && !ct_layout_3 {
            check_stream(
                &format!("{via:?} UDP stream made under svc (local backend)"),
                &stream_local,
                t0_ms,
            )
        } else {
            Ok(())
        },
        check_stream(
            &format!("{via:?} UDP stream made under svc (remote backend, SNAT)"),
            &stream_remote,
            t0_ms,
        ),
    ] {
        if let Err(e) = r {
            failures.push(format!("{e:#}"));
        }
    }
    drop(kp);
    drop(bpffs);
    drop(relay);
    drop(sb);
    drop(cp);
    firewall.check()?;
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// The way back for per-packet ClusterIP flows: a pod outside the served cgroup (its sockets
/// unseen by the socket hooks, as a service mesh's pods), behind a device of
/// `--packet-lb-devices`, holds TCP connections and a UDP stream through a ClusterIP whose
/// backend is a pod on another node (svc: DNAT per packet on the pod's device, the pod's
/// address kept), and TCP connections and a UDP stream to itself through other ClusterIPs,
/// IPv4 and IPv6 (hairpin: svc DNATs to the pod and SNATs from the ClusterIP on a port of its
/// SNAT range);
/// kube-proxy (nftables mode) starts in the node's namespace; svc-agent stops and `svc-agent
/// uninstall` runs there. Every held connection and both streams must live on (their flows
/// handed over to the node's conntrack), and the pod's new connections must go through
/// kube-proxy.
#[test]
fn pod_device_flows_across_svc_uninstall() {
    pod_device_way_back().unwrap();
}

fn pod_device_way_back() -> Result<()> {
    use svc_tests::topology::{Nodes, NODE1, NODE1_6, POD1, POD1_6, POD2};
    use svc_tests::{Backend, Bpffs, ClientRun, Report, TempDir, TestCgroup};
    require_root();
    let mut firewall = HostFirewallGuard::new()?;
    let t0 = Instant::now();
    let t0_ms = unix_ms();
    let cp = ControlPlane::start()?;
    let tools = Tools::with_probe(env!("CARGO_BIN_EXE_svc-probe"));
    let nodes = Nodes::new()?;
    // The agent's cgroup, and the pod's: outside it.
    let served = TestCgroup::new()?;
    let outside = TestCgroup::new()?;
    let backend_at: SocketAddr = format!("{POD2}:8080").parse()?;
    let _backend = Backend::start(&tools.probe, &nodes.pod2, "pod2", &[backend_at])?;
    let own_at: SocketAddr = format!("{POD1}:8081").parse()?;
    let own6_at: SocketAddr = format!("[{POD1_6}]:8081").parse()?;
    let _own = Backend::start(&tools.probe, &nodes.pod1, "pod1", &[own_at, own6_at])?;
    let node = json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE1},
                                 {"type": "InternalIP", "address": NODE1_6}]},
    });
    cp.kubectl_stdin(&["create", "-f", "-"], &node.to_string())?;
    let ns = "takeover";
    // A Service of one endpoint and its EndpointSlice; ports as (name, port, target port,
    // protocol).
    let service = |name: &str,
                   family: &str,
                   at: &str,
                   node: &str,
                   ports: &[(&str, u16, u16, &str)]| {
        let spec: Vec<Value> = ports
            .iter()
            .map(|(n, port, target, proto)| {
                json!({"name": n, "port": port, "targetPort": target, "protocol": proto})
            })
            .collect();
        let slice: Vec<Value> = ports
            .iter()
            .map(|(n, _, target, proto)| json!({"name": n, "port": target, "protocol": proto}))
            .collect();
        [
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
                   "spec": {"ipFamilyPolicy": "SingleStack", "ipFamilies": [family],
                            "ports": spec}}),
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": format!("{name}-1"), "namespace": ns,
                                "labels": {"kubernetes.io/service-name": name}},
                   "addressType": family,
                   "ports": slice,
                   "endpoints": [{"addresses": [at], "conditions": {"ready": true},
                                  "nodeName": node}]}),
        ]
    };
    let mesh_ports = [("http", 80, 8080, "TCP"), ("dns", 53, 8080, "UDP")];
    let own = [("http", 81, 8081, "TCP"), ("dns", 54, 8081, "UDP")];
    let objects: Vec<Value> =
        std::iter::once(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
            .chain(service("mesh", "IPv4", POD2, "node-2", &mesh_ports))
            .chain(service("own", "IPv4", POD1, "node-1", &own))
            .chain(service("own6", "IPv6", POD1_6, "node-1", &own[..1]))
            .collect();
    let yaml: Vec<String> = objects.iter().map(Value::to_string).collect();
    let stored = cp.apply_yaml(&yaml.join("\n---\n"))?;
    let cluster_ip_of = |name: &str| -> Result<IpAddr> {
        Ok(stored
            .iter()
            .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == name)
            .and_then(|s| s["spec"]["clusterIP"].as_str())
            .with_context(|| format!("{name}: no clusterIP"))?
            .parse()?)
    };
    let cluster_ip = cluster_ip_of("mesh")?;
    let (tcp_to, udp_to) = (
        SocketAddr::new(cluster_ip, 80),
        SocketAddr::new(cluster_ip, 53),
    );
    let own_ip = cluster_ip_of("own")?;
    let (own_to, own_udp_to) = (SocketAddr::new(own_ip, 81), SocketAddr::new(own_ip, 54));
    let own6_to = SocketAddr::new(cluster_ip_of("own6")?, 81);
    // The pod's clients: outside the served cgroup, in the pod's namespace.
    let pod_client = |args: &[String]| ClientRun::spawn(&tools.probe, &outside, &nodes.pod1, args);
    let probe = |to: SocketAddr| -> Result<()> {
        let r: Report = pod_client(
            &[
                "tcp",
                "--to",
                &to.to_string(),
                "--count",
                "3",
                "--timeout-ms",
                "1000",
                "--who",
            ]
            .map(String::from),
        )?
        .wait(Duration::from_secs(10))?;
        ensure!(r.all_ok(), "{to} from the pod: {:?}", r.failures());
        Ok(())
    };
    let probe_ok = || -> Result<()> {
        probe(tcp_to)?;
        probe(own_to)?;
        probe(own6_to)
    };

    // svc alone serves the ClusterIP, per packet on the pod's device.
    let bpffs = Bpffs::new(&tools.agent, served.path())?;
    let relay = kube_proxy::ApiRelay::to_api_server(&nodes.node1, &cp)?;
    let dir = TempDir::new("svc-wayback-agent")?;
    let kubeconfig = relay.kubeconfig(&cp, cp.kubeconfig_path(), dir.path())?;
    let launcher: [std::ffi::OsString; 2] = [
        "nsenter".into(),
        format!("--net={}", nodes.node1.path().display()).into(),
    ];
    let mut agent = Agent::start_kube_launched(
        &launcher,
        &tools.agent,
        &kubeconfig,
        "node-1",
        served.path(),
        bpffs.path(),
        &["--devices", "eth0", "--packet-lb-devices", "podh"],
    )?;
    agent.wait_ready(svc_tests::sandbox::AGENT_READY_TIMEOUT)?;
    eventually(Duration::from_secs(20), probe_ok)?;
    log(
        t0,
        "svc serves the ClusterIP on the pod's device (no kube-proxy)",
    );

    let whole = Duration::from_secs(30);
    let held_since = Instant::now();
    let hold_to = |to: SocketAddr, n: u32| {
        pod_client(&[
            "hold".into(),
            "--to".into(),
            to.to_string(),
            "--connections".into(),
            n.to_string(),
            "--duration-ms".into(),
            whole.as_millis().to_string(),
            "--interval-ms".into(),
            "50".into(),
        ])
    };
    let hold = hold_to(tcp_to, 4)?;
    let hairpin = hold_to(own_to, 2)?;
    let hairpin6 = hold_to(own6_to, 2)?;
    let udp_stream = |to: SocketAddr| {
        pod_client(&[
            "udp-stream".into(),
            "--to".into(),
            to.to_string(),
            "--duration-ms".into(),
            whole.as_millis().to_string(),
            "--interval-ms".into(),
            "50".into(),
            "--timeout-ms".into(),
            "1000".into(),
        ])
    };
    let own_stream = udp_stream(own_udp_to)?;
    let stream = udp_stream(udp_to)?;
    std::thread::sleep(Duration::from_secs(2));
    log(
        t0,
        "the pod's TCP connections (4 to itself, over IPv4 and IPv6) and UDP streams (1 to \
         itself) through svc",
    );

    let bin = kube_proxy::binary_from_env()?;
    let mut kp = KubeProxy::start(
        KubeProxyConfig::new(&bin, Mode::Nftables, "node-1"),
        &cp,
        &nodes.node1,
    )?;
    kp.wait_ready(kube_proxy::READY_TIMEOUT)?;
    std::thread::sleep(Duration::from_secs(1));
    log(t0, "kube-proxy started beside svc and synced");
    let status = agent.terminate(Duration::from_secs(10))?;
    ensure!(status.success(), "svc-agent exited with {status}");
    let text = uninstall_in(&nodes.node1, &tools.agent, bpffs.path(), 0)?;
    // 4 TCP connections to the other node's pod, 2 to the pod itself over each family, and
    // a UDP stream to each pod.
    ensure_handed(&text, 10)?;
    log(t0, "svc-agent stopped and uninstalled");
    ensure!(
        held_since.elapsed() + Duration::from_secs(5) < whole,
        "the way back took too long: the clients ended before it was over"
    );

    let mut failures = Vec::new();
    // The pod's new connections go through kube-proxy: conntrack entries NATed from the
    // ClusterIP.
    let natted = || -> Result<BTreeSet<String>> {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", nodes.node1.path().display()))
            .args(["--", "conntrack", "-L", "-p", "tcp", "--orig-dst"])
            .arg(cluster_ip.to_string())
            .args(["--reply-src", POD2])
            .stdin(Stdio::null())
            .output()
            .context("running conntrack")?;
        Ok(flows(&out.stdout))
    };
    let before = natted()?;
    if let Err(e) = probe_ok() {
        failures.push(format!("the pod's new connections after uninstall: {e:#}"));
    }
    let new = natted()?.difference(&before).count();
    if new < 3 {
        failures.push(format!(
            "the pod's new connections after uninstall: {new} new conntrack entries"
        ));
    }
    let t = whole + Duration::from_secs(20);
    let hold: HoldReport = hold.wait(t)?;
    let hairpin: HoldReport = hairpin.wait(t)?;
    let hairpin6: HoldReport = hairpin6.wait(t)?;
    let stream: StreamReport = stream.wait(t)?;
    let own_stream: StreamReport = own_stream.wait(t)?;
    log(t0, "clients done");
    for r in [
        check_hold("the pod's ClusterIP connections made under svc", &hold, 4),
        check_hold(
            "the pod's connections to itself through a ClusterIP made under svc",
            &hairpin,
            2,
        ),
        check_hold(
            "the pod's connections to itself through an IPv6 ClusterIP made under svc",
            &hairpin6,
            2,
        ),
        check_stream(
            "the pod's ClusterIP UDP stream made under svc",
            &stream,
            t0_ms,
        ),
        check_stream(
            "the pod's UDP stream to itself through a ClusterIP made under svc",
            &own_stream,
            t0_ms,
        ),
    ] {
        if let Err(e) = r {
            failures.push(format!("{e:#}"));
        }
    }
    drop(kp);
    drop(bpffs);
    drop(relay);
    drop(nodes);
    drop(cp);
    firewall.check()?;
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}
