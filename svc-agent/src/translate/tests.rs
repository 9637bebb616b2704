//! Each test states a kube-proxy rule in terms of what a user would observe: which backends
//! a frontend gets, and which errors name which objects.

use super::*;
use crate::model::{Kind, Protocol};

/// Read as manifests are: YAML (1.2 booleans only, so a name `y` stays a string) to a JSON
/// value, then the typed object.
fn object<T: serde::de::DeserializeOwned>(header: &str, yaml: &str) -> T {
    let value: serde_json::Value = serde_saphyr::from_str_with_options(
        &format!("{header}\n{yaml}"),
        serde_saphyr::options! { strict_booleans: true },
    )
    .expect("test object must parse");
    serde_json::from_value(value).expect("test object must be valid")
}

/// A Service from YAML (apiVersion and kind are added).
fn service(yaml: &str) -> Service {
    object("apiVersion: v1\nkind: Service", yaml)
}

/// The common case: `ns/name` with one clusterIP and the given ports (YAML flow list).
fn cluster_ip(key: &str, ip: &str, ports: &str) -> Service {
    let (ns, name) = key.split_once('/').expect("ns/name");
    service(&format!(
        "metadata: {{namespace: {ns}, name: {name}}}\nspec: {{clusterIP: '{ip}', ports: {ports}}}"
    ))
}

/// An EndpointSlice from YAML (apiVersion and kind are added).
fn slice(yaml: &str) -> EndpointSlice {
    object("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice", yaml)
}

/// Slice `ns/name` of Service `service`, with ports and endpoints as YAML flow lists.
fn slice_of(
    key: &str,
    service: &str,
    address_type: &str,
    ports: &str,
    endpoints: &str,
) -> EndpointSlice {
    let (ns, name) = key.split_once('/').expect("ns/name");
    slice(&format!(
        "metadata: {{namespace: {ns}, name: {name}, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: {address_type}
ports: {ports}
endpoints: {endpoints}"
    ))
}

fn run(services: &[Service], slices: &[EndpointSlice]) -> Translated {
    translate(services, slices, &NodeContext::default())
}

fn on_node(
    services: &[Service],
    slices: &[EndpointSlice],
    node: &str,
    zone: Option<&str>,
) -> Translated {
    let node = NodeContext {
        node_name: Some(node.to_string()),
        zone: zone.map(str::to_string),
        service_proxy_name: None,
        node_ips: Vec::new(),
    };
    translate(services, slices, &node)
}

/// The frontend written as it is displayed, e.g. "10.96.0.1:80/TCP".
fn frontend<'a>(t: &'a Translated, which: &str) -> &'a DesiredFrontend {
    t.state
        .frontends
        .values()
        .find(|f| f.frontend.to_string() == which)
        .unwrap_or_else(|| panic!("no frontend {which}; have {:?}", frontends(t)))
}

fn backends(t: &Translated, which: &str) -> Vec<String> {
    frontend(t, which)
        .backends
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn frontends(t: &Translated) -> Vec<String> {
    t.state.frontends.keys().map(ToString::to_string).collect()
}

fn errors(t: &Translated) -> Vec<String> {
    t.errors.iter().map(ToString::to_string).collect()
}

fn assert_no_errors(t: &Translated) {
    assert!(t.errors.is_empty(), "unexpected errors: {:?}", errors(t));
}

const NONE: &[String] = &[];

#[test]
fn multi_port_service_gets_one_frontend_per_port_named_after_it() {
    let t = run(
        &[cluster_ip(
            "shop/web",
            "10.96.0.10",
            "[{name: http, port: 80}, {name: https, port: 443}]",
        )],
        &[slice_of(
            "shop/web-1",
            "web",
            "IPv4",
            "[{name: http, port: 8080}, {name: https, port: 8443}]",
            "[{addresses: [10.0.0.2]}, {addresses: [10.0.0.1]}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(frontends(&t), ["10.96.0.10:80/TCP", "10.96.0.10:443/TCP"]);
    assert_eq!(
        backends(&t, "10.96.0.10:80/TCP"),
        ["10.0.0.1:8080", "10.0.0.2:8080"]
    );
    assert_eq!(
        backends(&t, "10.96.0.10:443/TCP"),
        ["10.0.0.1:8443", "10.0.0.2:8443"]
    );
    let http = frontend(&t, "10.96.0.10:80/TCP");
    assert_eq!(http.service, "shop/web:http");
    assert_eq!(http.affinity_timeout_s, None);
    assert!(!http.internal_local);
    assert_eq!(
        t.state
            .cluster_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.96.0.10"]
    );
}

#[test]
fn unnamed_port_matches_unnamed_slice_port_and_is_named_after_the_service() {
    let t = run(
        &[cluster_ip("default/db", "10.96.0.5", "[{port: 5432}]")],
        &[slice_of(
            "default/db-x",
            "db",
            "IPv4",
            "[{port: 5432, name: ''}]",
            "[{addresses: [10.0.1.1]}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(frontend(&t, "10.96.0.5:5432/TCP").service, "default/db");
    assert_eq!(backends(&t, "10.96.0.5:5432/TCP"), ["10.0.1.1:5432"]);
}

#[test]
fn same_port_number_with_two_protocols_are_separate_frontends() {
    let t = run(
        &[cluster_ip(
            "kube-system/dns",
            "10.96.0.53",
            "[{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]",
        )],
        &[slice_of(
            "kube-system/dns-1",
            "dns",
            "IPv4",
            "[{name: dns, port: 1053, protocol: UDP}, {name: dns-tcp, port: 2053}]",
            "[{addresses: [10.0.0.7]}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.53:53/UDP"), ["10.0.0.7:1053"]);
    assert_eq!(backends(&t, "10.96.0.53:53/TCP"), ["10.0.0.7:2053"]);
    assert_eq!(
        frontend(&t, "10.96.0.53:53/UDP").frontend.protocol,
        Protocol::Udp
    );
}

#[test]
fn port_matching_needs_both_name_and_protocol() {
    let t = run(
        &[cluster_ip("a/s", "10.96.0.1", "[{name: p, port: 80}]")],
        &[slice_of(
            "a/s-1",
            "s",
            "IPv4",
            "[{name: p, port: 8080, protocol: UDP}, {name: other, port: 9090}, {name: p}]",
            "[{addresses: [10.0.0.1]}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), NONE);
}

#[test]
fn named_target_port_may_differ_per_slice() {
    // Pods of two versions mid-rollout expose "http" on different container ports.
    let t = run(
        &[cluster_ip(
            "a/web",
            "10.96.0.1",
            "[{name: http, port: 80, targetPort: http}]",
        )],
        &[
            slice_of(
                "a/web-old",
                "web",
                "IPv4",
                "[{name: http, port: 8080}]",
                "[{addresses: [10.0.0.1]}]",
            ),
            slice_of(
                "a/web-new",
                "web",
                "IPv4",
                "[{name: http, port: 9090}]",
                "[{addresses: [10.0.0.2]}]",
            ),
        ],
    );
    assert_no_errors(&t);
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:8080", "10.0.0.2:9090"]
    );
}

#[test]
fn endpoint_in_two_slices_appears_once_and_the_non_terminating_copy_wins() {
    let svc = cluster_ip("a/web", "10.96.0.1", "[{port: 80}]");
    let terminating =
        "[{addresses: [10.0.0.1], conditions: {ready: false, serving: true, terminating: true}},
                        {addresses: [10.0.0.2]}]";
    let ready = "[{addresses: [10.0.0.1], conditions: {ready: true}}, {addresses: [10.0.0.2]}]";
    // Whichever slice sorts first, the ready copy of 10.0.0.1 is used; had the terminating
    // copy won, 10.0.0.1 would be dropped in favour of the ready 10.0.0.2.
    for (first, second) in [(terminating, ready), (ready, terminating)] {
        let t = run(
            std::slice::from_ref(&svc),
            &[
                slice_of("a/web-a", "web", "IPv4", "[{port: 80}]", first),
                slice_of("a/web-b", "web", "IPv4", "[{port: 80}]", second),
            ],
        );
        assert_no_errors(&t);
        assert_eq!(
            backends(&t, "10.96.0.1:80/TCP"),
            ["10.0.0.1:80", "10.0.0.2:80"]
        );
    }
}

#[test]
fn dual_stack_each_cluster_ip_gets_endpoints_of_its_own_family() {
    let svc = service(
        "metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.1, clusterIPs: [10.96.0.1, 'fd00::1'], ports: [{name: http, port: 80}]}",
    );
    let t = run(
        &[svc],
        &[
            slice_of(
                "a/web-v4",
                "web",
                "IPv4",
                "[{name: http, port: 8080}]",
                "[{addresses: [10.0.0.1]}]",
            ),
            slice_of(
                "a/web-v6",
                "web",
                "IPv6",
                "[{name: http, port: 8080}]",
                "[{addresses: ['fd00:1::1']}]",
            ),
        ],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:8080"]);
    assert_eq!(backends(&t, "[fd00::1]:80/TCP"), ["[fd00:1::1]:8080"]);
    let ips: Vec<String> = t
        .state
        .cluster_ips
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ips, ["10.96.0.1", "fd00::1"]);
}

#[test]
fn single_stack_service_ignores_slices_of_the_other_family() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[slice_of(
            "a/web-v6",
            "web",
            "IPv6",
            "[{port: 80}]",
            "[{addresses: ['fd00::5']}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), NONE);
}

#[test]
fn fqdn_slices_are_ignored_silently() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[slice_of(
            "a/web-dns",
            "web",
            "FQDN",
            "[{port: 80}]",
            "[{addresses: [example.com]}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), NONE);
}

#[test]
fn slices_join_only_their_own_service_in_their_own_namespace() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[
            slice_of("b/web-1", "web", "IPv4", "[{port: 80}]", "[{addresses: [10.0.0.1]}]"),
            slice_of("a/api-1", "api", "IPv4", "[{port: 80}]", "[{addresses: [10.0.0.2]}]"),
            slice("metadata: {name: orphan, namespace: a}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: [10.0.0.3]}]"),
        ],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), NONE);
}

#[test]
fn conditions_default_to_ready_and_not_terminating() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[slice_of(
            "a/web-1",
            "web",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.1]}, {addresses: [10.0.0.2], conditions: {}},
              {addresses: [10.0.0.3], conditions: {ready: false}}]",
        )],
    );
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.2:80"]
    );
}

#[test]
fn ready_endpoints_are_preferred_over_serving_terminating_ones() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[slice_of(
            "a/web-1",
            "web",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.1], conditions: {ready: true}},
              {addresses: [10.0.0.2], conditions: {ready: false, serving: true, terminating: true}}]",
        )],
    );
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:80"]);
}

#[test]
fn without_ready_endpoints_serving_terminating_ones_are_used() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[slice_of(
            "a/web-1",
            "web",
            "IPv4",
            "[{port: 80}]",
            // Only .2 and .4 are both serving and terminating: .4 has serving unset, which
            // means serving (see serving_unset_counts_as_serving).
            "[{addresses: [10.0.0.1], conditions: {ready: false}},
              {addresses: [10.0.0.2], conditions: {ready: false, serving: true, terminating: true}},
              {addresses: [10.0.0.3], conditions: {ready: false, serving: false, terminating: true}},
              {addresses: [10.0.0.4], conditions: {ready: false, terminating: true}},
              {addresses: [10.0.0.5], conditions: {ready: false, serving: true}}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.2:80", "10.0.0.4:80"]
    );
}

/// `serving` unset means serving, as the API says ("A nil value should be interpreted as
/// true") and kube-proxy reads it (endpointslicecache.go): a terminating endpoint whose
/// controller sets only `ready` and `terminating` still takes the traffic when nothing is
/// ready, instead of every connection being refused.
#[test]
fn serving_unset_counts_as_serving() {
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[slice_of(
            "a/web-1",
            "web",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.1], conditions: {ready: false}},
              {addresses: [10.0.0.4], conditions: {ready: false, terminating: true}}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.4:80"]);
}

#[test]
fn no_endpoints_means_a_frontend_with_empty_backends() {
    let t = run(
        &[
            cluster_ip("a/lonely", "10.96.0.1", "[{port: 80}]"),
            cluster_ip("a/down", "10.96.0.2", "[{port: 80}]"),
        ],
        &[slice_of(
            "a/down-1",
            "down",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.1], conditions: {ready: false}}]",
        )],
    );
    assert_no_errors(&t);
    // Still programmed, so the datapath refuses connections instead of letting them leak.
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), NONE);
    assert_eq!(backends(&t, "10.96.0.2:80/TCP"), NONE);
    assert_eq!(t.state.cluster_ips.len(), 2);
}

fn local_service() -> Service {
    service(
        "metadata: {name: agent, namespace: mon}
spec: {clusterIP: 10.96.0.9, internalTrafficPolicy: Local, ports: [{port: 9100}]}",
    )
}

#[test]
fn internal_traffic_policy_local_uses_only_this_nodes_endpoints() {
    let slices = [slice_of(
        "mon/agent-1",
        "agent",
        "IPv4",
        "[{port: 9100}]",
        "[{addresses: [10.0.1.1], nodeName: n1}, {addresses: [10.0.2.1], nodeName: n2},
          {addresses: [10.0.3.1]}]",
    )];
    let t = on_node(&[local_service()], &slices, "n1", None);
    assert_no_errors(&t);
    let fe = frontend(&t, "10.96.0.9:9100/TCP");
    assert!(fe.internal_local);
    assert_eq!(backends(&t, "10.96.0.9:9100/TCP"), ["10.0.1.1:9100"]);

    // No local endpoint: traffic is dropped rather than sent to another node.
    let t = on_node(&[local_service()], &slices, "n3", None);
    assert_eq!(backends(&t, "10.96.0.9:9100/TCP"), NONE);
    assert!(frontend(&t, "10.96.0.9:9100/TCP").internal_local);

    // Without a node name nothing is local.
    let t = run(&[local_service()], &slices);
    assert_eq!(backends(&t, "10.96.0.9:9100/TCP"), NONE);
}

#[test]
fn internal_traffic_policy_local_falls_back_to_local_terminating_endpoints() {
    let slices = [slice_of(
        "mon/agent-1",
        "agent",
        "IPv4",
        "[{port: 9100}]",
        "[{addresses: [10.0.1.1], nodeName: n1, conditions: {ready: false, serving: true, terminating: true}},
          {addresses: [10.0.2.1], nodeName: n2}]",
    )];
    let t = on_node(&[local_service()], &slices, "n1", None);
    assert_eq!(backends(&t, "10.96.0.9:9100/TCP"), ["10.0.1.1:9100"]);
}

fn hinted_slice(endpoints: &str) -> EndpointSlice {
    slice_of("a/web-1", "web", "IPv4", "[{port: 80}]", endpoints)
}

fn web() -> Service {
    cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")
}

#[test]
fn zone_hints_restrict_to_endpoints_hinted_for_this_zone() {
    let slices = [hinted_slice(
        "[{addresses: [10.0.0.1], hints: {forZones: [{name: zone-a}]}},
          {addresses: [10.0.0.2], hints: {forZones: [{name: zone-b}]}},
          {addresses: [10.0.0.3], hints: {forZones: [{name: zone-a}, {name: zone-b}]}},
          {addresses: [10.0.0.9], conditions: {ready: false}}]",
    )];
    let t = on_node(&[web()], &slices, "n1", Some("zone-a"));
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.3:80"]
    );

    // Node zone unknown (the manifest source): hints cannot be used.
    let t = on_node(&[web()], &slices, "n1", None);
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
    );

    // No endpoint hinted for this zone: all of them rather than none.
    let t = on_node(&[web()], &slices, "n1", Some("zone-c"));
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
    );
}

#[test]
fn hints_are_ignored_when_one_ready_endpoint_lacks_them() {
    let slices = [hinted_slice(
        "[{addresses: [10.0.0.1], hints: {forZones: [{name: zone-a}]}},
          {addresses: [10.0.0.2], hints: {forZones: [{name: zone-b}]}},
          {addresses: [10.0.0.3]}]",
    )];
    let t = on_node(&[web()], &slices, "n1", Some("zone-a"));
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]
    );
}

#[test]
fn node_hints_are_preferred_over_zone_hints() {
    let slices = [hinted_slice(
        "[{addresses: [10.0.0.1], hints: {forNodes: [{name: n1}], forZones: [{name: zone-a}]}},
          {addresses: [10.0.0.2], hints: {forNodes: [{name: n2}], forZones: [{name: zone-a}]}},
          {addresses: [10.0.0.3], hints: {forNodes: [{name: n3}], forZones: [{name: zone-b}]}}]",
    )];
    let t = on_node(&[web()], &slices, "n1", Some("zone-a"));
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:80"]);

    // No endpoint for this node: zone hints decide.
    let t = on_node(&[web()], &slices, "n4", Some("zone-a"));
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.2:80"]
    );
}

#[test]
fn hints_do_not_apply_to_internal_traffic_policy_local() {
    let svc = service(
        "metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.1, internalTrafficPolicy: Local, ports: [{port: 80}]}",
    );
    let slices = [hinted_slice(
        "[{addresses: [10.0.0.1], nodeName: n1, hints: {forZones: [{name: zone-b}]}},
          {addresses: [10.0.0.2], nodeName: n2, hints: {forZones: [{name: zone-a}]}}]",
    )];
    let t = on_node(&[svc], &slices, "n1", Some("zone-a"));
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:80"]);
}

#[test]
fn topology_does_not_block_the_terminating_fallback() {
    let slices = [hinted_slice(
        "[{addresses: [10.0.0.1], conditions: {ready: false, serving: true, terminating: true},
           hints: {forZones: [{name: zone-b}]}}]",
    )];
    let t = on_node(&[web()], &slices, "n1", Some("zone-a"));
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:80"]);
}

fn with_affinity(affinity: &str) -> Service {
    service(&format!(
        "metadata: {{name: web, namespace: a}}\nspec: {{clusterIP: 10.96.0.1, ports: [{{port: 80}}], {affinity}}}"
    ))
}

#[test]
fn session_affinity_client_ip_sets_the_timeout() {
    let t = run(&[with_affinity("sessionAffinity: ClientIP")], &[]);
    assert_no_errors(&t);
    assert_eq!(
        frontend(&t, "10.96.0.1:80/TCP").affinity_timeout_s,
        Some(10_800)
    );

    let t = run(
        &[with_affinity(
            "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
        )],
        &[],
    );
    assert_no_errors(&t);
    assert_eq!(
        frontend(&t, "10.96.0.1:80/TCP").affinity_timeout_s,
        Some(60)
    );

    let t = run(&[with_affinity("sessionAffinity: None")], &[]);
    assert_no_errors(&t);
    assert_eq!(frontend(&t, "10.96.0.1:80/TCP").affinity_timeout_s, None);
}

#[test]
fn session_affinity_timeout_out_of_range_is_an_error_and_the_default_is_used() {
    for bad in [0, -5, 86_401] {
        let t = run(
            &[with_affinity(&format!(
                "sessionAffinity: ClientIP, sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {bad}}}}}"
            ))],
            &[],
        );
        assert_eq!(
            frontend(&t, "10.96.0.1:80/TCP").affinity_timeout_s,
            Some(10_800)
        );
        let errors = errors(&t);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("Service a/web: sessionAffinityConfig.clientIP.timeoutSeconds"),
            "{errors:?}"
        );
    }
    let t = run(
        &[with_affinity(
            "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 86400}}",
        )],
        &[],
    );
    assert_no_errors(&t);
    assert_eq!(
        frontend(&t, "10.96.0.1:80/TCP").affinity_timeout_s,
        Some(86_400)
    );
}

#[test]
fn services_not_proxied_are_skipped_without_errors() {
    let skipped = [
        service("metadata: {name: headless, namespace: a}\nspec: {clusterIP: None, ports: [{port: 80}]}"),
        service(
            "metadata: {name: headless2, namespace: a}\nspec: {clusterIPs: [None], ports: [{port: 80}]}",
        ),
        service(
            "metadata: {name: ext, namespace: a}
spec: {type: ExternalName, externalName: example.com, clusterIP: 10.96.0.7, ports: [{port: 80}]}",
        ),
        service("metadata: {name: pending, namespace: a}\nspec: {ports: [{port: 80}]}"),
        service("metadata: {name: nospec, namespace: a}"),
        service(
            "metadata: {name: other, namespace: a, labels: {service.kubernetes.io/service-proxy-name: cilium}}
spec: {clusterIP: 10.96.0.8, ports: [{port: 80}]}",
        ),
    ];
    let t = run(&skipped, &[]);
    assert_no_errors(&t);
    assert!(t.state.frontends.is_empty() && t.state.cluster_ips.is_empty());
}

/// kube-proxy filters the headless label on EndpointSlices only, and the service proxy name on
/// Services only (cmd/kube-proxy/app/server.go): a labelled-headless Service with a ClusterIP is
/// served, a slice labelled for another proxy still gives its Service endpoints, and a slice
/// labelled headless gives none.
#[test]
fn labels_count_where_kube_proxy_reads_them() {
    let services = [
        service(
            "metadata: {name: h, namespace: a, labels: {service.kubernetes.io/headless: ''}}
spec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}",
        ),
        service(
            "metadata: {name: p, namespace: a}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}",
        ),
        service(
            "metadata: {name: s, namespace: a}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}",
        ),
    ];
    let slices = [
        slice(
            "metadata: {name: h-1, namespace: a, labels: {kubernetes.io/service-name: h}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.0.1]}]",
        ),
        slice(
            "metadata: {name: p-1, namespace: a, labels: {kubernetes.io/service-name: p, service.kubernetes.io/service-proxy-name: cilium}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.0.2]}]",
        ),
        slice(
            "metadata: {name: s-1, namespace: a, labels: {kubernetes.io/service-name: s, service.kubernetes.io/headless: ''}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.0.3]}]",
        ),
    ];
    let t = run(&services, &slices);
    assert_no_errors(&t);
    assert_eq!(backends(&t, "10.96.0.9:80/TCP"), ["10.0.0.1:8080"]);
    assert_eq!(backends(&t, "10.96.0.10:80/TCP"), ["10.0.0.2:8080"]);
    assert_eq!(backends(&t, "10.96.0.11:80/TCP"), NONE);
}

/// With --service-proxy-name, the objects labelled with that name are exactly the ones served
/// (the watch selects them; translation must not then drop them as another proxy's).
#[test]
fn a_named_proxy_serves_its_labelled_objects_only() {
    let labelled = |name: &str, ip: &str, proxy: Option<&str>| {
        let labels = proxy
            .map(|p| format!(", labels: {{service.kubernetes.io/service-proxy-name: {p}}}"))
            .unwrap_or_default();
        (
            service(&format!(
                "metadata: {{name: {name}, namespace: a{labels}}}
spec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}"
            )),
            slice(&format!(
                "metadata: {{name: {name}-1, namespace: a, labels: {{kubernetes.io/service-name: {name}{}}}}}
addressType: IPv4
ports: [{{port: 8080}}]
endpoints: [{{addresses: [10.0.0.1]}}]",
                proxy
                    .map(|p| format!(", service.kubernetes.io/service-proxy-name: {p}"))
                    .unwrap_or_default()
            )),
        )
    };
    let (ours, ours_slice) = labelled("ours", "10.96.0.1", Some("svc"));
    let (other, other_slice) = labelled("other", "10.96.0.2", Some("cilium"));
    let (plain, plain_slice) = labelled("plain", "10.96.0.3", None);
    let services = [ours, other, plain];
    let slices = [ours_slice, other_slice, plain_slice];
    let node = NodeContext {
        service_proxy_name: Some("svc".into()),
        ..Default::default()
    };
    let t = translate(&services, &slices, &node);
    assert_no_errors(&t);
    assert_eq!(frontends(&t), ["10.96.0.1:80/TCP"]);
    let fe = t.state.frontends.values().next().unwrap();
    assert_eq!(fe.backends, ["10.0.0.1:8080".parse().unwrap()]);
    // Without the flag, only the unlabelled one.
    let t = run(&services, &slices);
    assert_eq!(frontends(&t), ["10.96.0.3:80/TCP"]);
}

#[test]
fn node_port_and_load_balancer_services_get_their_cluster_ip_frontends() {
    let t = run(
        &[
            service(
                "metadata: {name: np, namespace: a}
spec: {type: NodePort, clusterIP: 10.96.0.1, ports: [{port: 80, nodePort: 30080}]}",
            ),
            service(
                "metadata: {name: lb, namespace: a}
spec: {type: LoadBalancer, clusterIP: 10.96.0.2, ports: [{port: 443, nodePort: 30443}]}",
            ),
        ],
        &[],
    );
    assert_no_errors(&t);
    assert_eq!(
        frontends(&t),
        [
            "0.0.0.0:30080/TCP",
            "0.0.0.0:30080/TCP (external)",
            "0.0.0.0:30443/TCP",
            "0.0.0.0:30443/TCP (external)",
            "10.96.0.1:80/TCP",
            "10.96.0.2:443/TCP"
        ]
    );
    // NodePorts answer on node addresses: no ClusterIP marker for them.
    assert_eq!(
        t.state
            .cluster_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.96.0.1", "10.96.0.2"]
    );
}

#[test]
fn bad_ports_are_errors_for_that_port_only() {
    let t = run(
        &[cluster_ip(
            "a/web",
            "10.96.0.1",
            "[{name: ok, port: 80}, {name: zero, port: 0}, {name: big, port: 70000},
              {name: sctp, port: 90, protocol: SCTP}, {name: icmp, port: 91, protocol: ICMP},
              {name: dup, port: 80}, {name: ok, port: 81}, {name: udp, port: 80, protocol: UDP}]",
        )],
        &[],
    );
    assert_eq!(frontends(&t), ["10.96.0.1:80/TCP", "10.96.0.1:80/UDP"]);
    assert_eq!(
        errors(&t),
        [
            "Service a/web: port \"zero\" 0/TCP: port must be 1-65535; skipped",
            "Service a/web: port \"big\" 70000/TCP: port must be 1-65535; skipped",
            "Service a/web: port \"sctp\" 90/SCTP: SCTP is not supported yet; skipped",
            "Service a/web: port \"icmp\" 91/ICMP: unknown protocol \"ICMP\"; skipped",
            "Service a/web: port \"dup\" 80/TCP: duplicate port and protocol; skipped",
            "Service a/web: port \"ok\" 81/TCP: duplicate port name; skipped",
        ]
    );
}

/// Issue 33, item 12: SCTP ports are not served, and the desired state names them (for
/// /healthz), even on a Service with no other port.
#[test]
fn sctp_ports_are_named_as_not_served() {
    let t = run(
        &[
            cluster_ip(
                "a/web",
                "10.96.0.1",
                "[{name: http, port: 80}, {name: sig, port: 3868, protocol: SCTP}]",
            ),
            cluster_ip("a/only", "10.96.0.2", "[{port: 9, protocol: SCTP}]"),
        ],
        &[],
    );
    assert_eq!(frontends(&t), ["10.96.0.1:80/TCP"]);
    let unserved: Vec<(&str, Vec<&str>)> = t
        .state
        .unserved
        .iter()
        .map(|(k, v)| (k.as_str(), v.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        unserved,
        [
            ("a/only", vec!["a/only 9/SCTP"]),
            ("a/web", vec!["a/web:sig 3868/SCTP"])
        ]
    );
}

#[test]
fn bad_cluster_ips_are_errors_naming_the_service_and_others_still_work() {
    let t = run(
        &[
            cluster_ip("a/typo", "10.96.0.300", "[{port: 80}]"),
            cluster_ip("a/zero", "0.0.0.0", "[{port: 80}]"),
            service(
                "metadata: {name: three, namespace: a}
spec: {clusterIPs: [10.96.0.3, 10.96.0.4, 'nope', 'fd00::3'], ports: [{port: 80}]}",
            ),
            cluster_ip("a/good", "10.96.0.1", "[{port: 80}]"),
        ],
        &[],
    );
    assert_eq!(
        frontends(&t),
        ["10.96.0.1:80/TCP", "10.96.0.3:80/TCP", "[fd00::3]:80/TCP"]
    );
    assert_eq!(
        errors(&t),
        [
            "Service a/three: clusterIP 10.96.0.4 is a second address of the same family as 10.96.0.3; skipped",
            "Service a/three: clusterIP \"nope\" is not an IP address; skipped",
            "Service a/typo: clusterIP \"10.96.0.300\" is not an IP address; skipped",
            "Service a/zero: clusterIP \"0.0.0.0\" is not a unicast address; skipped",
        ]
    );
}

#[test]
fn bad_endpoints_are_errors_naming_the_slice_and_the_rest_are_used() {
    let t = run(
        &[web()],
        &[
            slice_of(
                "a/web-1",
                "web",
                "IPv4",
                "[{port: 80}, {name: x, port: 0}, {name: y}]",
                "[{addresses: [10.0.0.1]}, {addresses: ['fd00::1']}, {addresses: [not-an-ip]},
                  {addresses: []}, {addresses: [127.0.0.1]}, {addresses: ['::ffff:10.0.0.2']}]",
            ),
            slice_of(
                "a/web-2",
                "web",
                "IPv6",
                "[{port: 80}]",
                "[{addresses: [10.0.0.3]}]",
            ),
            slice_of(
                "a/web-3",
                "web",
                "Bogus",
                "[{port: 80}]",
                "[{addresses: [10.0.0.4]}]",
            ),
        ],
    );
    // An IPv4-mapped IPv6 address is IPv4, as Kubernetes parses it.
    assert_eq!(
        backends(&t, "10.96.0.1:80/TCP"),
        ["10.0.0.1:80", "10.0.0.2:80"]
    );
    assert_eq!(
        errors(&t),
        [
            "EndpointSlice a/web-1: port \"x\" 0/TCP: port must be 1-65535; skipped",
            "EndpointSlice a/web-1: endpoint \"fd00::1\" does not match addressType IPv4; skipped",
            "EndpointSlice a/web-1: endpoint \"not-an-ip\" is not an IP address; skipped",
            "EndpointSlice a/web-1: endpoint with no addresses; skipped",
            "EndpointSlice a/web-1: endpoint \"127.0.0.1\" is an unspecified, loopback, link-local or multicast address; skipped",
            "EndpointSlice a/web-2: endpoint \"10.0.0.3\" does not match addressType IPv6; skipped",
            "EndpointSlice a/web-3: unknown addressType \"Bogus\"; slice ignored",
        ]
    );
}

#[test]
fn slices_with_errors_are_reported_once_however_many_ports_use_them() {
    let t = run(
        &[cluster_ip(
            "a/web",
            "10.96.0.1",
            "[{name: a, port: 80}, {name: b, port: 81}]",
        )],
        &[slice_of(
            "a/web-1",
            "web",
            "IPv4",
            "[{name: a, port: 80}, {name: b, port: 81}]",
            "[{addresses: [bad]}, {addresses: [10.0.0.1]}]",
        )],
    );
    assert_eq!(errors(&t).len(), 1);
    assert_eq!(backends(&t, "10.96.0.1:81/TCP"), ["10.0.0.1:81"]);
}

#[test]
fn nameless_objects_are_errors() {
    let t = run(
        &[
            service("metadata: {namespace: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}"),
            web(),
        ],
        &[slice(
            "metadata: {namespace: a}\naddressType: IPv4\nendpoints: []",
        )],
    );
    assert_eq!(
        errors(&t),
        [
            "Service a/(unnamed): metadata.name is required",
            "EndpointSlice a/(unnamed): metadata.name is required",
        ]
    );
    assert_eq!(frontends(&t), ["10.96.0.1:80/TCP"]);
}

#[test]
fn two_services_claiming_one_frontend_first_by_name_wins() {
    let ports = "[{name: http, port: 80}, {name: alt, port: 8080}]";
    let services = [
        cluster_ip("b/second", "10.96.0.1", "[{name: http, port: 80}]"),
        cluster_ip("a/first", "10.96.0.1", ports),
    ];
    let t = run(&services, &[]);
    assert_eq!(frontend(&t, "10.96.0.1:80/TCP").service, "a/first:http");
    assert_eq!(frontend(&t, "10.96.0.1:8080/TCP").service, "a/first:alt");
    assert_eq!(
        errors(&t),
        ["Service b/second: frontend 10.96.0.1:80/TCP is already served by Service a/first; skipped"]
    );
}

#[test]
fn an_object_defined_twice_keeps_its_first_definition() {
    let t = run(
        &[
            cluster_ip("a/web", "10.96.0.1", "[{port: 80}]"),
            cluster_ip("a/web", "10.96.0.2", "[{port: 80}]"),
        ],
        &[
            slice_of(
                "a/web-1",
                "web",
                "IPv4",
                "[{port: 80}]",
                "[{addresses: [10.0.0.1]}]",
            ),
            slice_of(
                "a/web-1",
                "web",
                "IPv4",
                "[{port: 80}]",
                "[{addresses: [10.0.0.2]}]",
            ),
        ],
    );
    assert_eq!(frontends(&t), ["10.96.0.1:80/TCP"]);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:80"]);
    assert_eq!(
        errors(&t),
        [
            "Service a/web: defined more than once; later definition ignored",
            "EndpointSlice a/web-1: defined more than once; later definition ignored",
        ]
    );
}

#[test]
fn missing_namespace_means_default() {
    let t = run(
        &[service(
            "metadata: {name: web}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}",
        )],
        &[slice(
            "metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [10.0.0.1]}]",
        )],
    );
    assert_no_errors(&t);
    assert_eq!(frontend(&t, "10.96.0.1:80/TCP").service, "default/web");
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:80"]);
}

#[test]
fn output_does_not_depend_on_input_order() {
    let services = vec![
        cluster_ip("b/x", "10.96.0.50", "[{port: 80}, {port: 0}]"),
        cluster_ip("a/y", "10.96.0.50", "[{port: 80}]"),
        web(),
    ];
    let slices = vec![
        slice_of(
            "a/web-2",
            "web",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.9]}, {addresses: [x]}]",
        ),
        slice_of(
            "a/web-1",
            "web",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.1]}]",
        ),
        slice_of(
            "a/y-1",
            "y",
            "IPv4",
            "[{port: 80}]",
            "[{addresses: [10.0.0.5]}]",
        ),
    ];
    let forward = run(&services, &slices);
    let mut rev_services = services.clone();
    rev_services.reverse();
    let mut rev_slices = slices.clone();
    rev_slices.reverse();
    let backward = run(&rev_services, &rev_slices);
    assert_eq!(forward.state, backward.state);
    assert_eq!(errors(&forward), errors(&backward));
    assert_eq!(errors(&forward).len(), 3);
}

// ---------------------------------------------------------------------------------------------
// The packet datapath's frontends: NodePorts, ExternalIPs, LoadBalancer IPs. The reference is
// kube-proxy v1.37: pkg/proxy/serviceport.go (what a Service port exposes, per family),
// pkg/proxy/topology.go (CategorizeEndpoints: cluster and local endpoint sets),
// pkg/proxy/nftables/proxier.go (how each address kind is served, the firewall of
// loadBalancerSourceRanges, the short-circuit of node-local traffic) and
// pkg/proxy/healthcheck/service_health.go with endpointschangetracker.go (health checks).

/// On "node-1" (10.0.0.100, fd00::100) in zone "z1".
fn on_node_1(services: &[Service], slices: &[EndpointSlice]) -> Translated {
    let node = NodeContext {
        node_name: Some("node-1".into()),
        zone: Some("z1".into()),
        service_proxy_name: None,
        node_ips: vec!["10.0.0.100".parse().unwrap(), "fd00::100".parse().unwrap()],
    };
    translate(services, slices, &node)
}

/// Backends with their locality: "10.0.1.1:8080 local".
fn backends_local(t: &Translated, which: &str) -> Vec<String> {
    frontend(t, which)
        .backends
        .iter()
        .map(|b| format!("{}{}", b, if b.local { " local" } else { "" }))
        .collect()
}

/// Endpoints 10.0.1.1 on node-1 and 10.0.2.1 on node-2, both ready, port 8080.
fn two_nodes_slice(service: &str) -> EndpointSlice {
    slice_of(
        &format!("a/{service}-1"),
        service,
        "IPv4",
        "[{port: 8080}]",
        "[{addresses: [10.0.1.1], nodeName: node-1}, {addresses: [10.0.2.1], nodeName: node-2}]",
    )
}

#[test]
fn node_port_frontends_at_both_scopes_share_the_cluster_set_under_cluster_policy() {
    // serviceport.go: nodePort is taken as given (the API server allocated it);
    // nftables/proxier.go sends it to the external chain, and node-local traffic to the same
    // cluster endpoints.
    let t = on_node_1(
        &[service(
            "metadata: {name: np, namespace: a}
spec: {type: NodePort, clusterIP: 10.96.0.1, ports: [{port: 80, nodePort: 30080}]}",
        )],
        &[two_nodes_slice("np")],
    );
    assert_no_errors(&t);
    for which in [
        "0.0.0.0:30080/TCP (external)",
        "0.0.0.0:30080/TCP",
        "10.96.0.1:80/TCP",
    ] {
        assert_eq!(
            backends_local(&t, which),
            ["10.0.1.1:8080 local", "10.0.2.1:8080"],
            "{which}"
        );
    }
    let ext = frontend(&t, "0.0.0.0:30080/TCP (external)");
    assert_eq!(ext.kind, Kind::NodePort);
    assert!(!ext.external_local && ext.source_ranges.is_none());
    assert_eq!(frontend(&t, "0.0.0.0:30080/TCP").kind, Kind::NodePort);
    assert_eq!(frontend(&t, "10.96.0.1:80/TCP").kind, Kind::ClusterIP);
}

#[test]
fn dual_stack_node_ports_get_one_frontend_per_family() {
    let t = run(
        &[service(
            "metadata: {name: np, namespace: a}
spec: {type: NodePort, clusterIPs: [10.96.0.1, 'fd00:96::1'], ports: [{port: 80, nodePort: 30080}]}",
        )],
        &[],
    );
    assert_no_errors(&t);
    assert!(frontends(&t).contains(&"0.0.0.0:30080/TCP (external)".to_string()));
    assert!(frontends(&t).contains(&"[::]:30080/TCP (external)".to_string()));
}

#[test]
fn external_ips_of_the_services_families_get_frontends_but_no_marker() {
    // serviceport.go filters externalIPs to the proxier's family; a family the Service has
    // no clusterIP of is not served at all.
    let t = on_node_1(
        &[service(
            "metadata: {name: e, namespace: a}
spec: {clusterIP: 10.96.0.1, externalIPs: [192.0.2.10, '2001:db8::10'], ports: [{port: 80}]}",
        )],
        &[two_nodes_slice("e")],
    );
    assert_no_errors(&t);
    assert_eq!(
        frontends(&t),
        [
            "10.96.0.1:80/TCP",
            "192.0.2.10:80/TCP",
            "192.0.2.10:80/TCP (external)"
        ]
    );
    assert_eq!(
        frontend(&t, "192.0.2.10:80/TCP (external)").kind,
        Kind::ExternalIP
    );
    assert_eq!(frontend(&t, "192.0.2.10:80/TCP").kind, Kind::ExternalIP);
    // nftables/proxier.go: only ClusterIPs go into the "cluster-ips" set whose other ports
    // are dropped; an ExternalIP may be a real address with other ports in use.
    assert_eq!(
        t.state
            .cluster_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["10.96.0.1"]
    );
}

#[test]
fn load_balancer_ingress_ips_are_captured_unless_ip_mode_is_proxy() {
    // serviceport.go: IsVIPMode (ipMode unset or VIP); hostname-only ingress has no IP.
    let t = run(
        &[service(
            "metadata: {name: lb, namespace: a}
spec: {type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{port: 443, nodePort: 30443}]}
status: {loadBalancer: {ingress: [{ip: 198.51.100.1}, {ip: 198.51.100.2, ipMode: VIP},
  {ip: 198.51.100.3, ipMode: Proxy}, {hostname: lb.example.com}, {ip: '2001:db8::1'}]}}",
        )],
        &[],
    );
    assert_no_errors(&t);
    let lb: Vec<String> = t
        .state
        .frontends
        .values()
        .filter(|d| d.kind == Kind::LoadBalancer)
        .map(|d| d.frontend.to_string())
        .collect();
    assert_eq!(
        lb,
        [
            "198.51.100.1:443/TCP",
            "198.51.100.1:443/TCP (external)",
            "198.51.100.2:443/TCP",
            "198.51.100.2:443/TCP (external)"
        ]
    );
}

fn local_policy_lb(extra: &str) -> Service {
    service(&format!(
        "metadata: {{name: web, namespace: a}}
spec: {{type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32000,
  clusterIP: 10.96.0.1, ports: [{{port: 80, nodePort: 30080}}]{extra}}}
status: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}"
    ))
}

#[test]
fn external_traffic_policy_local_keeps_external_traffic_on_this_nodes_endpoints() {
    // topology.go: localEndpoints for the external policy; nftables/proxier.go: pods and the
    // node itself "short-circuit" to the cluster endpoints.
    let t = on_node_1(&[local_policy_lb("")], &[two_nodes_slice("web")]);
    assert_no_errors(&t);
    for which in [
        "0.0.0.0:30080/TCP (external)",
        "198.51.100.1:80/TCP (external)",
    ] {
        let d = frontend(&t, which);
        assert!(d.external_local, "{which}");
        assert_eq!(
            backends_local(&t, which),
            ["10.0.1.1:8080 local"],
            "{which}"
        );
    }
    for which in [
        "0.0.0.0:30080/TCP",
        "198.51.100.1:80/TCP",
        "10.96.0.1:80/TCP",
    ] {
        let d = frontend(&t, which);
        assert!(!d.external_local, "{which}");
        assert_eq!(
            backends_local(&t, which),
            ["10.0.1.1:8080 local", "10.0.2.1:8080"],
            "{which}"
        );
    }
}

#[test]
fn external_policy_local_without_a_local_endpoint_drops_and_without_any_rejects() {
    // nftables/proxier.go: no local endpoints but some elsewhere: "drop" for external
    // traffic; no endpoints at all: "reject".
    let remote_only = slice_of(
        "a/web-1",
        "web",
        "IPv4",
        "[{port: 8080}]",
        "[{addresses: [10.0.2.1], nodeName: node-2}]",
    );
    let t = on_node_1(&[local_policy_lb("")], &[remote_only]);
    let d = frontend(&t, "0.0.0.0:30080/TCP (external)");
    assert!(d.external_local && d.backends.is_empty());
    assert_eq!(backends(&t, "0.0.0.0:30080/TCP"), ["10.0.2.1:8080"]);

    let t = on_node_1(&[local_policy_lb("")], &[]);
    let d = frontend(&t, "0.0.0.0:30080/TCP (external)");
    assert!(
        !d.external_local && d.backends.is_empty(),
        "a reject, not a drop"
    );
}

#[test]
fn external_policy_local_falls_back_to_this_nodes_terminating_endpoints() {
    // topology.go: hasLocalServingTerminatingEndpoints when no local endpoint is ready.
    let slices = [slice_of(
        "a/web-1",
        "web",
        "IPv4",
        "[{port: 8080}]",
        "[{addresses: [10.0.1.1], nodeName: node-1,
           conditions: {ready: false, serving: true, terminating: true}},
          {addresses: [10.0.1.2], nodeName: node-1,
           conditions: {ready: false, serving: false, terminating: true}},
          {addresses: [10.0.2.1], nodeName: node-2}]",
    )];
    let t = on_node_1(&[local_policy_lb("")], &slices);
    assert_eq!(
        backends_local(&t, "0.0.0.0:30080/TCP (external)"),
        ["10.0.1.1:8080 local"]
    );
    // The cluster set has a ready endpoint, so terminating ones stay out of it.
    assert_eq!(backends(&t, "0.0.0.0:30080/TCP"), ["10.0.2.1:8080"]);
}

/// cleanup.go (CleanStaleEntries): the UDP flows a Service port keeps are those to its serving
/// endpoints, whatever the traffic policy, topology or terminating state make of its
/// backends: every frontend of the port (both scopes, NodePort and LoadBalancer IP) names the
/// same set; one that no longer serves is not in it, nor is one of another family.
#[test]
fn udp_frontends_know_their_ports_serving_endpoints_whatever_the_policy() {
    let lb = service(
        "metadata: {name: dns, namespace: a}
spec: {type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 32000,
  clusterIP: 10.96.0.1, ports: [{name: dns, port: 53, protocol: UDP, nodePort: 30053},
                                {name: tcp, port: 53, protocol: TCP, nodePort: 30054}]}
status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}",
    );
    let slices = [slice_of(
        "a/dns-1",
        "dns",
        "IPv4",
        "[{name: dns, port: 5353, protocol: UDP}, {name: tcp, port: 5353, protocol: TCP}]",
        "[{addresses: [10.0.1.1], nodeName: node-1},
          {addresses: [10.0.2.1], nodeName: node-2},
          {addresses: [10.0.2.2], nodeName: node-2,
           conditions: {ready: false, serving: true, terminating: true}},
          {addresses: [10.0.2.3], nodeName: node-2,
           conditions: {ready: false, serving: false, terminating: true}},
          {addresses: [10.0.2.4], nodeName: node-2, conditions: {ready: false, serving: false}}]",
    )];
    let t = on_node_1(&[lb], &slices);
    assert_no_errors(&t);
    let serving = |which: &str| -> Option<Vec<String>> {
        let d = frontend(&t, which);
        d.serving
            .as_ref()
            .map(|s| s.iter().map(ToString::to_string).collect())
    };
    let want = ["10.0.1.1:5353", "10.0.2.1:5353", "10.0.2.2:5353"];
    for which in [
        "10.96.0.1:53/UDP",
        "0.0.0.0:30053/UDP (external)",
        "0.0.0.0:30053/UDP",
        "198.51.100.1:53/UDP (external)",
        "198.51.100.1:53/UDP",
    ] {
        assert_eq!(
            serving(which),
            Some(want.map(String::from).to_vec()),
            "{which}"
        );
    }
    // What the external frontend sends new flows to is narrower: Local policy.
    assert_eq!(
        backends(&t, "0.0.0.0:30053/UDP (external)"),
        ["10.0.1.1:5353"]
    );
    assert_eq!(serving("10.96.0.1:53/TCP"), None, "TCP keeps no such set");
}

#[test]
fn external_policy_local_needs_an_externally_accessible_service() {
    // api/v1/service/util.go ExternalPolicyLocal: type NodePort or LoadBalancer, or
    // ClusterIP with externalIPs.
    let t = on_node_1(
        &[service(
            "metadata: {name: web, namespace: a}
spec: {externalTrafficPolicy: Local, clusterIP: 10.96.0.1, externalIPs: [192.0.2.1],
  ports: [{port: 80}]}",
        )],
        &[two_nodes_slice("web")],
    );
    assert_no_errors(&t);
    assert_eq!(
        backends(&t, "192.0.2.1:80/TCP (external)"),
        ["10.0.1.1:8080"]
    );
    assert!(
        t.state.health_checks.is_empty(),
        "only LoadBalancers get one"
    );
}

#[test]
fn session_affinity_applies_to_every_frontend_kind() {
    let t = on_node_1(
        &[local_policy_lb(
            ", sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}",
        )],
        &[two_nodes_slice("web")],
    );
    assert_no_errors(&t);
    assert!(t
        .state
        .frontends
        .values()
        .all(|d| d.affinity_timeout_s == Some(60)));
}

fn ranges(t: &Translated, which: &str) -> Option<Vec<String>> {
    frontend(t, which)
        .source_ranges
        .as_ref()
        .map(|r| r.iter().map(ToString::to_string).collect())
}

#[test]
fn source_ranges_restrict_load_balancer_ips_only() {
    // nftables/proxier.go: the firewall chain holds the LoadBalancer IPs alone; "nodeports
    // are not subject to loadBalancerSourceRanges".
    let t = on_node_1(
        &[local_policy_lb(
            ", externalIPs: [192.0.2.1], loadBalancerSourceRanges: [' 203.0.113.0/24 ', 172.17.2.3/12]",
        )],
        &[two_nodes_slice("web")],
    );
    assert_no_errors(&t);
    assert_eq!(
        ranges(&t, "198.51.100.1:80/TCP (external)").unwrap(),
        ["172.16.0.0/12", "203.0.113.0/24"]
    );
    for which in [
        "198.51.100.1:80/TCP",
        "0.0.0.0:30080/TCP (external)",
        "192.0.2.1:80/TCP (external)",
        "10.96.0.1:80/TCP",
    ] {
        assert_eq!(ranges(&t, which), None, "{which}");
    }
}

#[test]
fn source_ranges_admit_the_load_balancer_ips_when_they_contain_the_node() {
    // nftables/proxier.go allowFromNode: a range containing the node's IP also admits the
    // LoadBalancer IPs as sources (a node reaching its own LB IP loops back from it).
    let with = |ranges: &str| {
        on_node_1(
            &[local_policy_lb(&format!(
                ", loadBalancerSourceRanges: [{ranges}]"
            ))],
            &[two_nodes_slice("web")],
        )
    };
    let t = with("10.0.0.0/24");
    assert_eq!(
        ranges(&t, "198.51.100.1:80/TCP (external)").unwrap(),
        ["10.0.0.0/24", "198.51.100.1/32"]
    );
    let t = with("10.9.0.0/24");
    assert_eq!(
        ranges(&t, "198.51.100.1:80/TCP (external)").unwrap(),
        ["10.9.0.0/24"]
    );
}

#[test]
fn source_ranges_are_per_family_and_a_zero_range_means_anyone() {
    // serviceport.go: MapCIDRsByIPFamily, and IsZeroCIDR clears the list.
    let t = run(
        &[local_policy_lb(
            ", loadBalancerSourceRanges: ['2001:db8::/32']",
        )],
        &[],
    );
    assert_eq!(ranges(&t, "198.51.100.1:80/TCP (external)"), None);
    let t = run(
        &[local_policy_lb(
            ", loadBalancerSourceRanges: [10.0.0.0/8, 0.0.0.0/0]",
        )],
        &[],
    );
    assert_eq!(ranges(&t, "198.51.100.1:80/TCP (external)"), None);
}

#[test]
fn invalid_source_ranges_are_errors_and_never_open_the_service() {
    let t = run(
        &[local_policy_lb(
            ", loadBalancerSourceRanges: [nonsense, 10.0.0.0/8]",
        )],
        &[],
    );
    assert_eq!(errors(&t).len(), 1);
    assert!(errors(&t)[0].contains("Service a/web") && errors(&t)[0].contains("nonsense"));
    assert_eq!(
        ranges(&t, "198.51.100.1:80/TCP (external)").unwrap(),
        ["10.0.0.0/8"]
    );
    // None valid: the LoadBalancer IP admits nobody rather than everybody.
    let t = run(
        &[local_policy_lb(", loadBalancerSourceRanges: [nonsense]")],
        &[],
    );
    assert_eq!(
        ranges(&t, "198.51.100.1:80/TCP (external)").unwrap(),
        Vec::<String>::new()
    );
}

#[test]
fn node_ports_are_validated_as_the_api_server_would() {
    let t = run(
        &[
            service(
                "metadata: {name: c, namespace: a}
spec: {clusterIP: 10.96.0.1, ports: [{port: 80, nodePort: 30080}]}",
            ),
            service(
                "metadata: {name: n, namespace: a}
spec: {type: NodePort, clusterIP: 10.96.0.2, ports: [{name: a, port: 80},
  {name: b, port: 81, nodePort: 30081}, {name: c, port: 82, nodePort: 30081}]}",
            ),
        ],
        &[],
    );
    let errs = errors(&t);
    assert_eq!(errs.len(), 3, "{errs:?}");
    assert!(errs[0].contains("Service a/c") && errs[0].contains("type ClusterIP"));
    assert!(errs[1].contains("Service a/n") && errs[1].contains("without a nodePort"));
    assert!(errs[2].contains("Service a/n") && errs[2].contains("used by another port"));
    let node_ports: Vec<String> = t
        .state
        .frontends
        .values()
        .filter(|d| d.kind == Kind::NodePort)
        .map(|d| d.frontend.to_string())
        .collect();
    assert_eq!(
        node_ports,
        ["0.0.0.0:30081/TCP", "0.0.0.0:30081/TCP (external)"]
    );
}

#[test]
fn two_services_claiming_one_node_port_keep_it_with_the_older() {
    let svc = |name: &str, created: &str| {
        service(&format!(
            "metadata: {{name: {name}, namespace: a, creationTimestamp: '{created}'}}
spec: {{type: NodePort, clusterIP: 10.96.0.{}, ports: [{{port: 80, nodePort: 30080}}]}}",
            name.len()
        ))
    };
    let t = run(
        &[
            svc("young", "2024-02-01T00:00:00Z"),
            svc("old", "2024-01-01T00:00:00Z"),
        ],
        &[],
    );
    assert_eq!(
        frontend(&t, "0.0.0.0:30080/TCP (external)").owner(),
        "a/old"
    );
    assert!(errors(&t)
        .iter()
        .all(|e| e.contains("a/young") && e.contains("a/old")));
    assert_eq!(errors(&t).len(), 2, "both scopes: {:?}", errors(&t));
}

#[test]
fn backends_on_this_node_are_flagged_local_for_every_frontend() {
    let t = on_node_1(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[two_nodes_slice("web")],
    );
    assert_eq!(
        backends_local(&t, "10.96.0.1:80/TCP"),
        ["10.0.1.1:8080 local", "10.0.2.1:8080"]
    );
    // Without a node name nothing is local.
    let t = run(
        &[cluster_ip("a/web", "10.96.0.1", "[{port: 80}]")],
        &[two_nodes_slice("web")],
    );
    assert_eq!(
        backends_local(&t, "10.96.0.1:80/TCP"),
        ["10.0.1.1:8080", "10.0.2.1:8080"]
    );
}

#[test]
fn health_check_counts_this_nodes_ready_endpoint_addresses() {
    // endpointschangetracker.go LocalReadyEndpoints: distinct IPs of local ready endpoints
    // over the Service's ports; terminating ones do not count.
    let slices = [slice_of(
        "a/web-1",
        "web",
        "IPv4",
        "[{name: http, port: 8080}, {name: admin, port: 9090}]",
        "[{addresses: [10.0.1.1], nodeName: node-1},
          {addresses: [10.0.1.2], nodeName: node-1,
           conditions: {ready: false, serving: true, terminating: true}},
          {addresses: [10.0.2.1], nodeName: node-2}]",
    )];
    let t = on_node_1(&[local_policy_lb("")], &slices);
    let hc = t.state.health_checks["a/web"];
    assert_eq!(hc.port, 32000);
    assert_eq!(hc.local_endpoints, [Some(1), None]);
    // A NodePort Service gets none, nor a LoadBalancer with externalTrafficPolicy Cluster.
    let t = on_node_1(
        &[service(
            "metadata: {name: web, namespace: a}
spec: {type: LoadBalancer, healthCheckNodePort: 32000, clusterIP: 10.96.0.1,
  ports: [{port: 80, nodePort: 30080}]}",
        )],
        &slices,
    );
    assert!(t.state.health_checks.is_empty());
}

/// Issue 33, item 10: names the API server would refuse are refused here too (manifests never
/// went through it), the rest is served, and the errors name the objects without a single
/// control character: a namespace that clears the terminal, a name that forges a log line.
#[test]
fn names_the_api_server_refuses_are_refused_and_reported_escaped() {
    let t = run(
        &[
            cluster_ip("a/web", "10.96.0.1", "[{name: http, port: 80}]"),
            cluster_ip("\"evil\\e[2J\\e[31m\"/web", "10.96.0.2", "[{port: 80}]"),
            cluster_ip(
                "a/\"web\\n2026-12-05T07:00:00Z  INFO forged\"",
                "10.96.0.3",
                "[{port: 80}]",
            ),
            cluster_ip("a/Web", "10.96.0.4", "[{port: 80}]"),
            cluster_ip("a/\"w\\u202Eb\"", "10.96.0.5", "[{port: 80}]"),
            cluster_ip("a/ports", "10.96.0.6", "[{name: \"h\\tttp\", port: 80}]"),
        ],
        &[
            slice_of(
                "a/web-1",
                "web",
                "IPv4",
                "[{name: http, port: 8080}]",
                "[{addresses: [10.0.0.1]}]",
            ),
            slice_of(
                "a/\"web-2\\n\"",
                "web",
                "IPv4",
                "[{name: http, port: 8080}]",
                "[{addresses: [10.0.0.2]}]",
            ),
            slice_of(
                "a/web-3",
                "\"web\\e]0;owned\\a\"",
                "IPv4",
                "[{name: http, port: 8080}]",
                "[{addresses: [10.0.0.3]}]",
            ),
            slice_of(
                "a/web-4",
                "web",
                "IPv4",
                "[{name: \"ht\\rtp\", port: 8080}]",
                "[{addresses: [10.0.0.4]}]",
            ),
        ],
    );
    assert_eq!(frontends(&t), ["10.96.0.1:80/TCP"]);
    assert_eq!(backends(&t, "10.96.0.1:80/TCP"), ["10.0.0.1:8080"]);
    let errors = errors(&t);
    for e in &errors {
        assert!(
            !e.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{e:?}"
        );
    }
    let label = "at most 63 of a-z, 0-9 and '-', starting and ending with a letter or digit";
    let name = |object: &str, rule: &str| {
        format!("Service {object}: metadata.name is not a DNS-1123 label ({rule}); Service ignored")
    };
    assert_eq!(
        errors,
        [
            name("a/Web", label),
            format!(
                "Service a/ports: port \"h\\tttp\": name is not a DNS-1123 label ({label}); \
                 Service ignored"
            ),
            name("a/web\\n2026-12-05T07:00:00Z  INFO forged", label),
            name("a/w\\u{202e}b", label),
            format!(
                "Service evil\\u{{1b}}[2J\\u{{1b}}[31m/web: metadata.namespace is not a DNS-1123 \
                 label ({label}); Service ignored"
            ),
            "EndpointSlice a/web-2\\n: metadata.name is not a DNS-1123 subdomain (at most \
             253 characters: labels of a-z, 0-9 and '-' joined by '.'); EndpointSlice ignored"
                .to_string(),
            "EndpointSlice a/web-3: label kubernetes.io/service-name \"web\\u{1b}]0;owned\\u{7}\" \
             is not a label value (at most 63 of A-Z, a-z, 0-9, '-', '_' and '.', starting and \
             ending with a letter or digit); EndpointSlice ignored"
                .to_string(),
            format!(
                "EndpointSlice a/web-4: port \"ht\\rtp\": name is not a DNS-1123 label \
                 ({label}); EndpointSlice ignored"
            ),
        ]
    );
}

/// A LoadBalancer Service `a/web` with a NodePort and an ingress IP, annotated.
fn annotated_lb(algorithm: &str) -> Service {
    service(&format!(
        "metadata: {{name: web, namespace: a, annotations: {{svc.dev/lb-algorithm: '{algorithm}'}}}}
spec: {{type: LoadBalancer, clusterIP: 10.96.0.1, ports: [{{port: 80, nodePort: 30080}}]}}
status: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}"
    ))
}

#[test]
fn lb_algorithm_annotation_chooses_for_external_frontends_only() {
    use crate::maglev::Algorithm;
    for (value, want) in [("random", Algorithm::Random), ("maglev", Algorithm::Maglev)] {
        let t = run(&[annotated_lb(value)], &[]);
        assert_no_errors(&t);
        for which in [
            "0.0.0.0:30080/TCP (external)",
            "198.51.100.1:80/TCP (external)",
        ] {
            assert_eq!(frontend(&t, which).lb_algorithm, Some(want), "{which}");
        }
        // The socket path and pods' ClusterIP keep the random choice whatever it says.
        assert_eq!(frontend(&t, "10.96.0.1:80/TCP").lb_algorithm, None);
    }
}

#[test]
fn unknown_lb_algorithm_is_an_error_naming_the_service_which_is_still_served() {
    let t = run(&[annotated_lb("round-robin")], &[]);
    let errors = errors(&t);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("Service a/web")
            && errors[0].contains("svc.dev/lb-algorithm")
            && errors[0].contains("round-robin"),
        "{}",
        errors[0]
    );
    // Served, with the flag's choice (no override).
    assert_eq!(
        frontend(&t, "198.51.100.1:80/TCP (external)").lb_algorithm,
        None
    );
    assert_eq!(
        frontend(&t, "0.0.0.0:30080/TCP (external)").lb_algorithm,
        None
    );
}

/// `explain`'s intent says, for each endpoint, what `translate` did with it.
#[test]
fn intent_gives_each_endpoint_its_reason_as_translate_decides() {
    let svc = service(
        "metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.1, clusterIPs: [10.96.0.1, 'fd00::1'], ports: [{name: http, port: 80}]}",
    );
    let slices = [
        slice_of(
            "a/web-v4",
            "web",
            "IPv4",
            "[{name: http, port: 8080}]",
            "[{addresses: [10.0.0.1], conditions: {ready: true}},
              {addresses: [10.0.0.2], conditions: {ready: false}},
              {addresses: [10.0.0.3], conditions: {ready: false, serving: true, terminating: true}}]",
        ),
        slice_of(
            "a/web-v6",
            "web",
            "IPv6",
            "[{name: http, port: 8080}]",
            "[{addresses: ['fd00::10']}]",
        ),
        slice_of(
            "a/web-other",
            "web",
            "IPv4",
            "[{name: metrics, port: 9090}]",
            "[{addresses: [10.0.0.9]}]",
        ),
    ];
    let node = NodeContext::default();
    let fe = Frontend::cluster("10.96.0.1".parse().unwrap(), 80, Protocol::Tcp);
    let i = intent(std::slice::from_ref(&svc), &slices, &node, &fe).expect("an intent");
    assert_eq!(i.service, "a/web");
    assert_eq!(i.port_name, "http");
    let names: Vec<&str> = i.slices.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a/web-other", "a/web-v4", "a/web-v6"]);
    assert_eq!(
        i.backends,
        ["10.0.0.1:8080".parse::<std::net::SocketAddr>().unwrap()]
    );
    let said: Vec<(String, bool, &str)> = i
        .endpoints
        .iter()
        .map(|v| (v.address.to_string(), v.used, v.reason.as_str()))
        .collect();
    assert_eq!(
        said,
        [
            ("10.0.0.1:8080".to_string(), true, "ready"),
            ("10.0.0.2:8080".to_string(), false, "not ready"),
            (
                "10.0.0.3:8080".to_string(),
                false,
                "serving and terminating: used only while no endpoint is ready"
            ),
            (
                "10.0.0.9:0".to_string(),
                false,
                "its slice has no port named \"http\" for TCP"
            ),
            (
                "[fd00::10]:0".to_string(),
                false,
                "another address family than the frontend's V4"
            ),
        ]
    );
    // The ready endpoint gone: the serving-terminating one takes the traffic, as translated.
    let mut only_terminating = slices.clone();
    only_terminating[0] = slice_of(
        "a/web-v4",
        "web",
        "IPv4",
        "[{name: http, port: 8080}]",
        "[{addresses: [10.0.0.3], conditions: {ready: false, serving: true, terminating: true}}]",
    );
    let i = intent(std::slice::from_ref(&svc), &only_terminating, &node, &fe).expect("an intent");
    assert_eq!(
        i.backends,
        ["10.0.0.3:8080".parse::<std::net::SocketAddr>().unwrap()]
    );
    assert!(i.endpoints[0].used && i.endpoints[0].reason.contains("no endpoint is ready"));
    // Under a Local internal policy, another node's endpoint is left out for that.
    let local = service(
        "metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.1, internalTrafficPolicy: Local, ports: [{name: http, port: 80}]}",
    );
    let there = [slice_of(
        "a/web-v4",
        "web",
        "IPv4",
        "[{name: http, port: 8080}]",
        "[{addresses: [10.0.0.1], nodeName: other}]",
    )];
    let here = NodeContext {
        node_name: Some("here".into()),
        ..Default::default()
    };
    let i = intent(&[local], &there, &here, &fe).expect("an intent");
    assert!(i.backends.is_empty());
    assert_eq!(
        i.endpoints[0].reason,
        "on another node (other) under a Local traffic policy"
    );
    // A frontend no Service has.
    let none = Frontend::cluster("10.96.0.2".parse().unwrap(), 80, Protocol::Tcp);
    assert!(intent(&[svc], &slices, &node, &none).is_none());
}

/// kube-proxy's sync_proxy_rules_no_local_endpoints_total (iptables and nftables proxiers):
/// per Service port and family, a Local policy without a local endpoint counts while some
/// endpoint elsewhere is usable; without any endpoint it is a reject, not counted.
#[test]
fn no_local_endpoints_counts_local_policies_left_without_a_local_endpoint() {
    let count = |t: &Translated, key: &str| {
        t.state
            .no_local_endpoints
            .get(key)
            .map(|n| (n.internal, n.external))
    };
    let remote = |service: &str, ports: &str| {
        slice_of(
            &format!("a/{service}-1"),
            service,
            "IPv4",
            ports,
            "[{addresses: [10.0.2.1], nodeName: node-2}]",
        )
    };
    let itp = service(
        "metadata: {name: itp, namespace: a}
spec: {clusterIP: 10.96.0.2, internalTrafficPolicy: Local,
  ports: [{name: a, port: 80}, {name: b, port: 81}]}",
    );
    let itp_slice = remote("itp", "[{name: a, port: 8080}, {name: b, port: 8081}]");

    // Local endpoints: nothing counted.
    let t = on_node_1(
        &[local_policy_lb(""), itp.clone()],
        &[two_nodes_slice("web"), two_nodes_slice("itp")],
    );
    assert!(t.state.no_local_endpoints.is_empty());

    // Remote endpoints only: each port of each policy.
    let t = on_node_1(
        &[local_policy_lb(""), itp.clone()],
        &[remote("web", "[{port: 8080}]"), itp_slice.clone()],
    );
    assert_no_errors(&t);
    assert_eq!(count(&t, "a/web"), Some((0, 1)));
    assert_eq!(count(&t, "a/itp"), Some((2, 0)));

    // No endpoints at all: rejected, not counted.
    let t = on_node_1(&[local_policy_lb(""), itp.clone()], &[]);
    assert!(t.state.no_local_endpoints.is_empty());

    // A not-ready remote endpoint is no usable endpoint; a serving, terminating one is.
    let slice = |conditions: &str| {
        slice_of(
            "a/itp-1",
            "itp",
            "IPv4",
            "[{name: a, port: 8080}]",
            &format!("[{{addresses: [10.0.2.1], nodeName: node-2, conditions: {conditions}}}]"),
        )
    };
    let t = on_node_1(
        std::slice::from_ref(&itp),
        &[slice("{ready: false, serving: false}")],
    );
    assert!(t.state.no_local_endpoints.is_empty());
    let t = on_node_1(
        std::slice::from_ref(&itp),
        &[slice("{ready: false, serving: true, terminating: true}")],
    );
    assert_eq!(count(&t, "a/itp"), Some((1, 0)));

    // A local serving, terminating endpoint serves the Local policy: nothing counted.
    let local_terminating = slice_of(
        "a/itp-1",
        "itp",
        "IPv4",
        "[{name: a, port: 8080}, {name: b, port: 8081}]",
        "[{addresses: [10.0.1.1], nodeName: node-1, conditions: {ready: false, serving: true, terminating: true}},
          {addresses: [10.0.2.1], nodeName: node-2}]",
    );
    let t = on_node_1(std::slice::from_ref(&itp), &[local_terminating]);
    assert!(t.state.no_local_endpoints.is_empty());

    // Both policies Local on one NodePort Service: one of each.
    let both = service(
        "metadata: {name: both, namespace: a}
spec: {type: NodePort, externalTrafficPolicy: Local, internalTrafficPolicy: Local,
  clusterIP: 10.96.0.3, ports: [{port: 80, nodePort: 30081}]}",
    );
    let t = on_node_1(&[both], &[remote("both", "[{port: 8080}]")]);
    assert_eq!(count(&t, "a/both"), Some((1, 1)));

    // externalTrafficPolicy Local does not apply to a plain ClusterIP Service (kube-proxy's
    // ExternalPolicyLocal wants it reachable from outside).
    let plain = service(
        "metadata: {name: plain, namespace: a}
spec: {externalTrafficPolicy: Local, clusterIP: 10.96.0.4, ports: [{port: 80}]}",
    );
    let t = on_node_1(&[plain], &[remote("plain", "[{port: 8080}]")]);
    assert!(t.state.no_local_endpoints.is_empty());

    // A dual-stack Service counts once per family, as kube-proxy's two ip_family series.
    let dual = service(
        "metadata: {name: dual, namespace: a}
spec: {clusterIPs: [10.96.0.5, 'fd00::5'], internalTrafficPolicy: Local, ports: [{port: 80}]}",
    );
    let slices = [
        remote("dual", "[{port: 8080}]"),
        slice_of(
            "a/dual-6",
            "dual",
            "IPv6",
            "[{port: 8080}]",
            "[{addresses: ['fd00:2::1'], nodeName: node-2}]",
        ),
    ];
    let t = on_node_1(&[dual], &slices);
    assert_eq!(count(&t, "a/dual"), Some((2, 0)));
}
