//! Issue 36: `svc-agent explain` against a serving agent's pins says what a connection
//! actually gets: the Service and the backends it reaches, or a refusal and why, or that the
//! address is no Service's; and it still explains once the agent has stopped.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use common::{names, sa, web_service, web_slice, World, VIP};
use serde_json::Value;
use svc_tests::{Service, ServicePort};

/// Runs `svc-agent explain --bpffs DIR --dst DST [ARGS] -o json`.
fn explain(bin: &Path, bpffs: &Path, dst: SocketAddr, args: &[&str]) -> Value {
    let out = Command::new(bin)
        .arg("explain")
        .arg("--bpffs")
        .arg(bpffs)
        .arg("--dst")
        .arg(dst.to_string())
        .args(args)
        .args(["-o", "json"])
        .output()
        .expect("running svc-agent explain");
    assert!(
        out.status.success(),
        "svc-agent explain --dst {dst} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "parsing explain's output ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn backends(e: &Value) -> BTreeSet<String> {
    e["backends"]
        .as_array()
        .unwrap_or_else(|| panic!("no backends array: {e}"))
        .iter()
        .map(|b| b.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn explain_matches_what_connections_get() {
    let w = World::start(3, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        // b3 serves too, but is not ready: not a backend, and never reached.
        m.apply_slice(&web_slice(sb, &[1, 2], &[3])).unwrap();
        m.apply_service(
            &Service::new("demo", "empty", "10.96.0.20")
                .port(ServicePort::tcp(80).name("http").target(8080)),
        )
        .unwrap();
    });
    let (bin, bpffs) = (&w.sb.tools.agent, w.bpffs.path());
    let addr_of = |name: &str| {
        let i: u8 = name.trim_start_matches('b').parse().unwrap();
        sa(w.sb.backend_v4(i), 8080).to_string()
    };

    // The ClusterIP port: its Service, and exactly the backends connections reach.
    let e = explain(bin, bpffs, sa(VIP, 80), &[]);
    assert_eq!(e["read_from"], "pinned maps", "{e:#}");
    assert_eq!(e["verdict"], "backend", "{e:#}");
    assert_eq!(e["matched"], "own address", "{e:#}");
    assert_eq!(e["frontend"]["service"], "demo/web:http", "{e:#}");
    assert_eq!(e["frontend"]["kind"], "ClusterIP", "{e:#}");
    let listed = backends(&e);
    let want: BTreeSet<String> = [1, 2].iter().map(|i| addr_of(&format!("b{i}"))).collect();
    assert_eq!(listed, want, "{e:#}");
    let r = w.sb.tcp(sa(VIP, 80), 40, &[]).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures());
    let reached: BTreeSet<String> = names(&r).iter().map(|n| addr_of(n)).collect();
    assert_eq!(
        reached, listed,
        "explain listed {listed:?}, connections reached {reached:?}"
    );

    // A Service without endpoints, and a port the ClusterIP does not define: refused, as
    // connect() is.
    let e = explain(bin, bpffs, sa([10, 96, 0, 20], 80), &[]);
    assert_eq!(e["verdict"], "refused", "{e:#}");
    assert_eq!(e["frontend"]["service"], "demo/empty:http", "{e:#}");
    assert!(
        e["reason"].as_str().unwrap().contains("no endpoints"),
        "{e:#}"
    );
    assert!(backends(&e).is_empty(), "{e:#}");
    let e = explain(bin, bpffs, sa(VIP, 81), &[]);
    assert_eq!(e["verdict"], "refused", "{e:#}");
    assert_eq!(e["matched"], "clusterip without this port", "{e:#}");
    for to in [sa([10, 96, 0, 20], 80), sa(VIP, 81)] {
        let r = w.sb.tcp(to, 2, &[]).unwrap();
        for a in &r.results {
            assert_eq!(a.errno, Some(libc::ECONNREFUSED), "{to}: {a:?}");
        }
    }

    // No Service's address: passed untouched. A packet from outside to the ClusterIP is no
    // frontend's either (ClusterIPs are the socket hooks' alone).
    let e = explain(bin, bpffs, sa([10, 96, 0, 99], 80), &[]);
    assert_eq!(e["verdict"], "passed", "{e:#}");
    assert!(e["frontend"].is_null(), "{e:#}");
    let e = explain(
        bin,
        bpffs,
        sa(VIP, 80),
        &["--from", "outside", "--src", "192.0.2.1:40000"],
    );
    assert_eq!(e["verdict"], "passed", "{e:#}");

    // Without the agent, the pins alone still explain.
    let mut w = w;
    w.agent
        .terminate(std::time::Duration::from_secs(10))
        .unwrap();
    let e = explain(&w.sb.tools.agent, w.bpffs.path(), sa(VIP, 80), &[]);
    assert_eq!(e["verdict"], "backend", "{e:#}");
    assert_eq!(backends(&e), want, "{e:#}");
}
