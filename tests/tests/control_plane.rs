//! The control-plane harness against real kube-apiserver and etcd: objects go in and come back
//! as the apiserver stores them, server-side dry runs store nothing, RBAC is enforced, and the
//! data outlives an apiserver restart.
//!
//! Needs the binaries of `cargo xtask control-plane` (`cargo xtask test` builds them); without
//! them these tests fail, saying how to build them. They need no root.

use std::net::IpAddr;

use anyhow::{ensure, Context, Result};
use serde_json::Value;
use svc_tests::control_plane::ControlPlane;

const NAMESPACE: &str = "
apiVersion: v1
kind: Namespace
metadata:
  name: svc-test
";

// No clusterIP: the apiserver allocates one of each family.
const SERVICE: &str = "
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: svc-test
spec:
  ipFamilyPolicy: RequireDualStack
  selector:
    app: web
  ports:
  - name: http
    port: 80
    targetPort: 8080
    protocol: TCP
";

const SLICE: &str = "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: svc-test
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
- addresses: [10.201.0.11]
  conditions: {ready: true}
- addresses: [10.201.0.12]
  conditions: {ready: false}
";

const DAEMONSET: &str = "
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: svc-agent
  namespace: kube-system
spec:
  selector:
    matchLabels:
      app: svc-agent
  template:
    metadata:
      labels:
        app: svc-agent
    spec:
      hostNetwork: true
      containers:
      - name: agent
        image: svc-agent:test
";

fn str_at<'a>(v: &'a Value, pointer: &str) -> Result<&'a str> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .with_context(|| format!("no string at {pointer} in {v}"))
}

fn cluster_ips(service: &Value) -> Result<Vec<IpAddr>> {
    service["spec"]["clusterIPs"]
        .as_array()
        .context("no spec.clusterIPs")?
        .iter()
        .map(|ip| Ok(ip.as_str().context("clusterIP not a string")?.parse()?))
        .collect()
}

fn slice_addresses(slice: &Value) -> Vec<String> {
    slice["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["addresses"][0].as_str().map(String::from))
        .collect()
}

#[test]
fn objects_round_trip_and_survive_an_apiserver_restart() -> Result<()> {
    let mut cp = ControlPlane::start()?;
    assert!(cp.server_url().starts_with("https://127.0.0.1:"));
    assert!(cp.kubeconfig_path().is_file());

    cp.apply_yaml(NAMESPACE)?;
    let applied = cp.apply_yaml(&format!("{SERVICE}---{SLICE}"))?;
    ensure!(applied.len() == 2, "applied {applied:?}");

    // Read back: the ClusterIPs were allocated from the configured ranges, one per family.
    let service = cp.get_json(&["service", "web", "-n", "svc-test"])?;
    let ips = cluster_ips(&service)?;
    ensure!(ips.len() == 2, "dual-stack Service got {ips:?}");
    match (ips[0], ips[1]) {
        (IpAddr::V4(v4), IpAddr::V6(v6)) => {
            let o = v4.octets();
            ensure!(o[0] == 10 && o[1] & 0xf0 == 96, "{v4} outside 10.96.0.0/12");
            ensure!(
                v6.segments()[..7] == [0xfd00, 0x96, 0, 0, 0, 0, 0],
                "{v6} outside fd00:96::/112"
            );
        }
        other => anyhow::bail!("expected IPv4 then IPv6 ClusterIPs, got {other:?}"),
    }
    ensure!(str_at(&service, "/spec/clusterIP")? == ips[0].to_string());

    let slice = cp.get_json(&["endpointslice", "web-1", "-n", "svc-test"])?;
    ensure!(slice_addresses(&slice) == ["10.201.0.11", "10.201.0.12"]);
    ensure!(str_at(&slice, "/metadata/labels/kubernetes.io~1service-name")? == "web");
    // No controller manager runs: nothing else created slices for the Service.
    let slices = cp.get_json(&["endpointslices", "-n", "svc-test"])?;
    ensure!(
        slices["items"].as_array().map(Vec::len) == Some(1),
        "{slices}"
    );

    // A server-side dry run defaults and validates like a real write, and stores nothing.
    let dry = cp.dry_run_server_side(DAEMONSET)?;
    ensure!(dry.len() == 1);
    ensure!(
        str_at(&dry[0], "/spec/updateStrategy/type")? == "RollingUpdate",
        "not defaulted: {}",
        dry[0]
    );
    let missing = cp.kubectl(&["get", "daemonset", "svc-agent", "-n", "kube-system"]);
    ensure!(
        format!("{:#}", missing.as_ref().unwrap_err()).contains("NotFound"),
        "the dry run stored the DaemonSet: {missing:?}"
    );
    // An invalid object is refused by the dry run too.
    let invalid = cp.dry_run_server_side(&DAEMONSET.replace("app: svc-agent", "app: \"-bad-\""));
    ensure!(invalid.is_err(), "invalid DaemonSet accepted: {invalid:?}");

    let before = str_at(&service, "/metadata/uid")?.to_owned();
    cp.restart_apiserver()?;

    // Everything is still there, as it was, and the restarted apiserver takes writes.
    let service = cp.get_json(&["service", "web", "-n", "svc-test"])?;
    ensure!(str_at(&service, "/metadata/uid")? == before);
    ensure!(cluster_ips(&service)? == ips);
    let slice = cp.get_json(&["endpointslice", "web-1", "-n", "svc-test"])?;
    ensure!(slice_addresses(&slice) == ["10.201.0.11", "10.201.0.12"]);
    let updated = cp.apply_yaml(&SLICE.replace("10.201.0.12", "10.201.0.13"))?;
    ensure!(slice_addresses(&updated[0]) == ["10.201.0.11", "10.201.0.13"]);

    cp.stop()
}

#[test]
fn rbac_is_enforced_for_service_accounts() -> Result<()> {
    let cp = ControlPlane::start()?;
    cp.apply_yaml(
        "
apiVersion: v1
kind: ServiceAccount
metadata:
  name: svc-agent
  namespace: kube-system
",
    )?;
    let kubeconfig = cp.service_account_kubeconfig("kube-system", "svc-agent")?;
    let list = ["get", "endpointslices", "--all-namespaces"];

    let denied = cp.kubectl_as(&kubeconfig, &list, None);
    ensure!(
        format!("{:#}", denied.as_ref().unwrap_err()).contains("Forbidden"),
        "a service account with no role listed EndpointSlices: {denied:?}"
    );

    cp.apply_yaml(
        "
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: svc-agent
rules:
- apiGroups: ['']
  resources: [services]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: svc-agent
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: svc-agent
subjects:
- kind: ServiceAccount
  name: svc-agent
  namespace: kube-system
",
    )?;
    // RBAC decisions follow the binding as soon as the apiserver's informers see it: poll.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while cp.kubectl_as(&kubeconfig, &list, None).is_err() {
        ensure!(
            std::time::Instant::now() < deadline,
            "the ClusterRoleBinding never took effect"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Granted exactly that: no writes.
    let write = cp.kubectl_as(&kubeconfig, &["create", "namespace", "not-granted"], None);
    ensure!(
        format!("{:#}", write.as_ref().unwrap_err()).contains("Forbidden"),
        "a write was allowed: {write:?}"
    );
    cp.stop()
}
