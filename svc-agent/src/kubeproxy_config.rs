//! `svc-agent run --config FILE`: kube-proxy's own configuration file, a
//! `kubeproxy.config.k8s.io/v1alpha1` KubeProxyConfiguration (what kubeadm writes into the
//! `kube-proxy` ConfigMap as `config.conf`), so a node's kube-proxy settings carry over.
//!
//! Each field either sets what the flag of the same meaning sets (flags given on the command
//! line win, as with kube-proxy), or does not apply to svc; the latter, when set to anything
//! but its empty value, are named in one warning with the reason, never dropped silently.
//! Unknown fields are warned about too, as kube-proxy's lenient decoding does after its strict
//! one fails; a wrong apiVersion or kind, or a value of the wrong shape, stops the agent.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's health port (pkg/cluster/ports ProxyHealthzPort), added to a
/// healthzBindAddress (or `--healthz-bind-address`) given without one.
pub const HEALTHZ_PORT: u16 = 10256;
/// kube-proxy's metrics port (ProxyStatusPort), likewise.
pub const METRICS_PORT: u16 = 10249;

/// An address with a port, or an address alone, which gets `port`: kube-proxy's
/// AppendPortIfNeeded, which its defaulting applies to healthzBindAddress and
/// metricsBindAddress and its flags to `--healthz-bind-address` and `--metrics-bind-address`.
pub fn bind_address(text: &str, port: u16) -> std::result::Result<SocketAddr, String> {
    let t = text.trim();
    if let Ok(a) = t.parse::<SocketAddr>() {
        return Ok(a);
    }
    t.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, port))
        .map_err(|_| format!("{t:?} is neither an IP address nor IP:PORT"))
}

/// The health and metrics addresses when none is given, by the family of `bindAddress` as
/// kube-proxy's defaulting (getDefaultAddresses) picks them: 0.0.0.0:10256 and 127.0.0.1:10249
/// for IPv4 (and no bindAddress), [::]:10256 and [::1]:10249 for IPv6.
pub fn default_addresses(bind: Option<IpAddr>) -> (SocketAddr, SocketAddr) {
    match bind {
        Some(IpAddr::V6(_)) => (
            SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), HEALTHZ_PORT),
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), METRICS_PORT),
        ),
        _ => (
            SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), HEALTHZ_PORT),
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), METRICS_PORT),
        ),
    }
}

/// What the file sets that `run` takes; None where it is silent (or empty, which kube-proxy
/// reads as its default).
#[derive(Debug, Default, PartialEq)]
pub struct FromConfig {
    /// clientConnection.kubeconfig
    pub kubeconfig: Option<PathBuf>,
    /// hostnameOverride
    pub node_name: Option<String>,
    /// bindAddress: picks the default health and metrics addresses' family, and, unless it
    /// is 0.0.0.0 or ::, is the node's primary address of its family (as kube-proxy's
    /// detectNodeIPs takes it).
    pub bind_address: Option<IpAddr>,
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    pub nodeport_addresses: Option<Vec<String>>,
    /// iptables.localhostNodePorts
    pub localhost_nodeports: Option<bool>,
    /// conntrack.*Timeout, as Go durations.
    pub conntrack_tcp_timeout_established: Option<String>,
    pub conntrack_tcp_timeout_close_wait: Option<String>,
    pub conntrack_udp_timeout: Option<String>,
    pub conntrack_udp_timeout_stream: Option<String>,
    /// Fields set that svc does not use, each with why (`mode`, `clusterCIDR`, ...).
    pub not_applied: Vec<(String, &'static str)>,
    /// Fields kube-proxy's v1alpha1 does not have.
    pub unknown: Vec<String>,
}

impl FromConfig {
    /// The one warning the agent logs about what it leaves out, or None.
    pub fn warning(&self) -> Option<String> {
        let mut parts = Vec::new();
        if !self.not_applied.is_empty() {
            let fields: Vec<String> = self
                .not_applied
                .iter()
                .map(|(f, why)| format!("{f} ({why})"))
                .collect();
            parts.push(format!(
                "ignored, each for the reason given: {}",
                fields.join("; ")
            ));
        }
        if !self.unknown.is_empty() {
            parts.push(format!(
                "unknown to {API_VERSION}, ignored: {}",
                self.unknown.join(", ")
            ));
        }
        (!parts.is_empty()).then(|| parts.join(". "))
    }
}

/// Why svc needs no pod range nor any other rule to tell local traffic (kube-proxy's
/// clusterCIDR and detectLocalMode, which decide what it masquerades and which pods' traffic
/// to a LoadBalancer IP skips externalTrafficPolicy: Local).
const LOCAL_TRAFFIC: &str = "svc tells a pod's traffic by where it starts, not by its source \
     address: a socket in the served cgroup, or a packet from a --packet-lb-devices device; \
     neither needs a pod range";

/// Fields that do not apply, and why: the warning's wording.
const NOT_APPLIED: &[(&str, &str)] = &[
    (
        "bindAddressHardFail",
        "svc always stops when it cannot bind its health or metrics address",
    ),
    ("mode", "svc's datapath is eBPF whatever the mode"),
    ("clusterCIDR", LOCAL_TRAFFIC),
    ("detectLocalMode", LOCAL_TRAFFIC),
    ("detectLocal", LOCAL_TRAFFIC),
    ("iptables.masqueradeAll", "svc writes no iptables rules"),
    ("iptables.masqueradeBit", "svc writes no iptables rules"),
    (
        "iptables.minSyncPeriod",
        "svc programs each change as it comes (--coalesce-ms gathers bursts)",
    ),
    (
        "iptables.syncPeriod",
        "svc compares its maps with what it programmed every --reconcile-interval-s",
    ),
    ("ipvs", "svc writes no IPVS services"),
    ("nftables", "svc writes no nftables rules"),
    ("winkernel", "Windows only"),
    ("windowsRunAsService", "Windows only"),
    (
        "minSyncPeriod",
        "svc programs each change as it comes (--coalesce-ms gathers bursts)",
    ),
    (
        "syncPeriod",
        "svc compares its maps with what it programmed every --reconcile-interval-s",
    ),
    (
        "conntrack.maxPerCore",
        "svc does not size the node's conntrack; its own table is --max-ct",
    ),
    (
        "conntrack.min",
        "svc does not size the node's conntrack; its own table is --max-ct",
    ),
    (
        "conntrack.tcpBeLiberal",
        "svc's connection tracking has its own window checks (packet-datapath.md)",
    ),
    (
        "clientConnection.acceptContentTypes",
        "svc's API client settings are its own",
    ),
    (
        "clientConnection.contentType",
        "svc's API client settings are its own",
    ),
    (
        "clientConnection.qps",
        "svc's API client settings are its own",
    ),
    (
        "clientConnection.burst",
        "svc's API client settings are its own",
    ),
    (
        "configSyncPeriod",
        "svc's watches do not resync: a relist happens only when a watch ends",
    ),
    ("portRange", "unused by kube-proxy too"),
    (
        "oomScoreAdj",
        "svc leaves its OOM score to the kubelet, which sets it by the pod's QoS class",
    ),
    ("enableProfiling", "svc has no pprof endpoint"),
    ("featureGates", "svc has no feature gates"),
    (
        "logging",
        "svc's log is set by --logging-format, --v and --log-level",
    ),
    (
        "showHiddenMetricsForVersion",
        "svc hides no metric: every one it has is shown",
    ),
];

/// kube-proxy's (v1.37) command-line flags that do not apply to svc: accepted so that a
/// kube-proxy command line starts svc, and named, with why, in one warning. `true`: the flag
/// takes a value (`--flag V` or `--flag=V`); `false`: a boolean (`--flag` or `--flag=BOOL`, as
/// pflag takes them). The flags that apply are `run`'s own (or aliases of them).
pub const IGNORED_FLAGS: &[(&str, bool, &str)] = &[
    (
        "bind-address-hard-fail",
        false,
        "svc always stops when it cannot bind its health or metrics address",
    ),
    ("cluster-cidr", true, LOCAL_TRAFFIC),
    ("detect-local-mode", true, LOCAL_TRAFFIC),
    ("pod-bridge-interface", true, LOCAL_TRAFFIC),
    ("pod-interface-name-prefix", true, LOCAL_TRAFFIC),
    (
        "config-sync-period",
        true,
        "svc's watches do not resync: a relist happens only when a watch ends",
    ),
    (
        "conntrack-max-per-core",
        true,
        "svc does not size the node's conntrack; its own table is --max-ct",
    ),
    (
        "conntrack-min",
        true,
        "svc does not size the node's conntrack; its own table is --max-ct",
    ),
    (
        "conntrack-tcp-be-liberal",
        false,
        "svc's connection tracking has its own window checks (packet-datapath.md)",
    ),
    ("feature-gates", true, "svc has no feature gates"),
    ("masquerade-all", false, "svc writes no iptables rules"),
    (
        "iptables-masquerade-bit",
        true,
        "svc writes no iptables rules",
    ),
    (
        "iptables-min-sync-period",
        true,
        "svc programs each change as it comes (--coalesce-ms gathers bursts)",
    ),
    (
        "iptables-sync-period",
        true,
        "svc compares its maps with what it programmed every --reconcile-interval-s",
    ),
    ("ipvs-exclude-cidrs", true, "svc writes no IPVS services"),
    ("ipvs-min-sync-period", true, "svc writes no IPVS services"),
    ("ipvs-scheduler", true, "svc writes no IPVS services"),
    ("ipvs-strict-arp", false, "svc writes no IPVS services"),
    ("ipvs-sync-period", true, "svc writes no IPVS services"),
    ("ipvs-tcp-timeout", true, "svc writes no IPVS services"),
    ("ipvs-tcpfin-timeout", true, "svc writes no IPVS services"),
    ("ipvs-udp-timeout", true, "svc writes no IPVS services"),
    (
        "kube-api-burst",
        true,
        "svc's API client settings are its own",
    ),
    (
        "kube-api-content-type",
        true,
        "svc's API client settings are its own",
    ),
    (
        "kube-api-qps",
        true,
        "svc's API client settings are its own",
    ),
    (
        "log-flush-frequency",
        true,
        "svc writes each log line as it comes",
    ),
    (
        "log-json-info-buffer-size",
        true,
        "svc writes each log line as it comes, all to stderr",
    ),
    (
        "log-json-split-stream",
        false,
        "svc writes each log line as it comes, all to stderr",
    ),
    (
        "log-text-info-buffer-size",
        true,
        "svc writes each log line as it comes, all to stderr",
    ),
    (
        "log-text-split-stream",
        false,
        "svc writes each log line as it comes, all to stderr",
    ),
    ("vmodule", true, "svc's log is set by --v and --log-level"),
    (
        "oom-score-adj",
        true,
        "svc leaves its OOM score to the kubelet, which sets it by the pod's QoS class",
    ),
    ("profiling", false, "svc has no pprof endpoint"),
    (
        "proxy-mode",
        true,
        "svc's datapath is eBPF whatever the mode",
    ),
    (
        "show-hidden-metrics-for-version",
        true,
        "svc hides no metric: every one it has is shown",
    ),
];

/// The one warning about kube-proxy flags given that do not apply (`given`: their names
/// without dashes), or None.
pub fn ignored_flags_warning(given: &[&str]) -> Option<String> {
    let parts: Vec<String> = IGNORED_FLAGS
        .iter()
        .filter(|(f, _, _)| given.contains(f))
        .map(|(f, _, why)| format!("--{f} ({why})"))
        .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "kube-proxy flags ignored, each for the reason given: {}",
            parts.join("; ")
        )
    })
}

/// Reads and maps the file.
pub fn read(path: &Path) -> Result<FromConfig> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|message| Error::Invalid {
        object: format!("--config {}", path.display()),
        message,
    })
}

/// Maps a KubeProxyConfiguration (YAML or JSON).
pub fn parse(text: &str) -> std::result::Result<FromConfig, String> {
    let doc: Value =
        serde_saphyr::from_str(text).map_err(|e| format!("not a YAML document: {e}"))?;
    let Value::Object(top) = &doc else {
        return Err("not a mapping".into());
    };
    let api = top.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let kind = top.get("kind").and_then(Value::as_str).unwrap_or("");
    if api != API_VERSION || kind != KIND {
        return Err(format!(
            "apiVersion {api:?}, kind {kind:?}: svc reads {API_VERSION} {KIND}"
        ));
    }
    let mut out = FromConfig::default();
    let mut fields = Vec::new();
    flatten("", &doc, &mut fields);
    for (name, value) in fields {
        // `iptables.localhostNodePorts: false` says something (its default is true): only
        // null is silence there; elsewhere every empty value is.
        let silent = match name.as_str() {
            "iptables.localhostNodePorts" => value.is_null(),
            _ => !is_set(value),
        };
        if silent {
            continue;
        }
        let text = || -> std::result::Result<String, String> {
            value
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{name}: a string, not {value}"))
        };
        let addr = |port| -> std::result::Result<SocketAddr, String> {
            bind_address(&text()?, port).map_err(|e| format!("{name}: {e}"))
        };
        match name.as_str() {
            "apiVersion" | "kind" => {}
            "clientConnection.kubeconfig" => out.kubeconfig = Some(text()?.into()),
            "hostnameOverride" => out.node_name = Some(text()?),
            "bindAddress" => {
                let t = text()?;
                out.bind_address = Some(
                    t.trim()
                        .parse()
                        .map_err(|_| format!("{name}: {t:?} is not an IP address"))?,
                )
            }
            "healthzBindAddress" => out.healthz_bind_address = Some(addr(HEALTHZ_PORT)?),
            "metricsBindAddress" => out.metrics_bind_address = Some(addr(METRICS_PORT)?),
            "nodePortAddresses" => {
                let list = value
                    .as_array()
                    .ok_or_else(|| format!("{name}: a list, not {value}"))?;
                out.nodeport_addresses = Some(
                    list.iter()
                        .map(|v| {
                            v.as_str()
                                .map(str::to_string)
                                .ok_or_else(|| format!("{name}: {v} is not a string"))
                        })
                        .collect::<std::result::Result<_, _>>()?,
                );
            }
            "iptables.localhostNodePorts" => {
                out.localhost_nodeports = Some(
                    value
                        .as_bool()
                        .ok_or_else(|| format!("{name}: true or false, not {value}"))?,
                )
            }
            "conntrack.tcpEstablishedTimeout" => {
                out.conntrack_tcp_timeout_established = Some(text()?)
            }
            "conntrack.tcpCloseWaitTimeout" => out.conntrack_tcp_timeout_close_wait = Some(text()?),
            "conntrack.udpTimeout" => out.conntrack_udp_timeout = Some(text()?),
            "conntrack.udpStreamTimeout" => out.conntrack_udp_timeout_stream = Some(text()?),
            other => match not_applied(other) {
                Some(why) => out.not_applied.push((other.to_string(), why)),
                None => out.unknown.push(other.to_string()),
            },
        }
    }
    Ok(out)
}

/// The reason for `field` (or a field under one listed, `ipvs.scheduler` under `ipvs`).
fn not_applied(field: &str) -> Option<&'static str> {
    NOT_APPLIED.iter().find_map(|(name, why)| {
        (field == *name || field.starts_with(&format!("{name}."))).then_some(*why)
    })
}

/// The fields of a document by dotted name: the sections some of whose fields apply
/// (`clientConnection`, `iptables`, `conntrack`) field by field, any other field whole
/// (`ipvs`, `logging`, an unknown mapping: one field each).
fn flatten<'a>(prefix: &str, v: &'a Value, out: &mut Vec<(String, &'a Value)>) {
    let Value::Object(m) = v else {
        return;
    };
    for (k, v) in m {
        let name = match prefix {
            "" => k.clone(),
            p => format!("{p}.{k}"),
        };
        let section = matches!(name.as_str(), "clientConnection" | "iptables" | "conntrack");
        if section && v.is_object() {
            flatten(&name, v, out);
        } else {
            out.push((name, v));
        }
    }
}

/// Whether a value says anything: kube-proxy reads null, "", 0, "0s", false and empty lists
/// and mappings (all of whose values are unset) as "use the default".
fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !matches!(s.as_str(), "" | "0" | "0s"),
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => m.values().any(is_set),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applied_fields_map_to_flags_and_the_rest_is_named() {
        let c = parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
             kind: KubeProxyConfiguration\n\
             bindAddress: 0.0.0.0\n\
             clientConnection:\n  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf\n  qps: 0\n  burst: 10\n\
             clusterCIDR: 10.244.0.0/16\n\
             conntrack:\n  maxPerCore: null\n  tcpEstablishedTimeout: 1h0m0s\n  udpTimeout: 0s\n\
             hostnameOverride: node-1\n\
             healthzBindAddress: 0.0.0.0:10256\n\
             metricsBindAddress: ''\n\
             iptables:\n  localhostNodePorts: false\n  syncPeriod: 30s\n\
             ipvs:\n  scheduler: rr\n  strictARP: false\n\
             mode: nftables\n\
             nodePortAddresses: [primary, 10.0.0.0/8]\n\
             showHiddenMetricsForVersion: '1.36'\n\
             somethingNew: 3\n",
        )
        .unwrap();
        assert_eq!(
            c.kubeconfig.as_deref(),
            Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(c.node_name.as_deref(), Some("node-1"));
        assert_eq!(
            c.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            c.metrics_bind_address, None,
            "empty is kube-proxy's default"
        );
        assert_eq!(
            c.nodeport_addresses,
            Some(vec!["primary".to_string(), "10.0.0.0/8".to_string()])
        );
        assert_eq!(c.localhost_nodeports, Some(false));
        assert_eq!(
            c.conntrack_tcp_timeout_established.as_deref(),
            Some("1h0m0s")
        );
        assert_eq!(c.conntrack_udp_timeout, None);
        assert_eq!(c.bind_address, Some(Ipv4Addr::UNSPECIFIED.into()));
        let named: Vec<&str> = c.not_applied.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            named,
            [
                "clientConnection.burst",
                "clusterCIDR",
                "iptables.syncPeriod",
                "ipvs",
                "mode",
                "showHiddenMetricsForVersion"
            ]
        );
        assert_eq!(c.unknown, ["somethingNew"]);
        let warning = c.warning().unwrap();
        assert!(
            warning.contains("mode (svc's datapath is eBPF"),
            "{warning}"
        );
        assert!(
            warning.contains("unknown to kubeproxy.config.k8s.io/v1alpha1, ignored: somethingNew"),
            "{warning}"
        );
    }

    #[test]
    fn a_wrong_kind_or_shape_is_an_error_that_names_it() {
        let e = parse("apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n")
            .unwrap_err();
        assert!(
            e.contains("KubeletConfiguration") && e.contains(KIND),
            "{e}"
        );
        let e = parse(&format!(
            "apiVersion: {API_VERSION}\nkind: {KIND}\nhealthzBindAddress: node-1\n"
        ))
        .unwrap_err();
        assert!(
            e.contains("healthzBindAddress") && e.contains("IP:PORT"),
            "{e}"
        );
        let e = parse(&format!(
            "apiVersion: {API_VERSION}\nkind: {KIND}\nbindAddress: node-1\n"
        ))
        .unwrap_err();
        assert!(e.contains("bindAddress") && e.contains("not an IP"), "{e}");
        let e = parse(&format!(
            "apiVersion: {API_VERSION}\nkind: {KIND}\nnodePortAddresses: primary\n"
        ))
        .unwrap_err();
        assert!(e.contains("nodePortAddresses: a list"), "{e}");
        assert!(parse("[1, 2]").is_err());
        assert!(parse(": : :").is_err());
    }

    /// kube-proxy's defaulting appends the default port to an address given alone
    /// (AppendPortIfNeeded): kubeadm users write `healthzBindAddress: 0.0.0.0`.
    #[test]
    fn a_bind_address_without_a_port_gets_kube_proxys_port() {
        let c = parse(&format!(
            "apiVersion: {API_VERSION}\nkind: {KIND}\nhealthzBindAddress: 0.0.0.0\n\
             metricsBindAddress: '::'\n"
        ))
        .unwrap();
        assert_eq!(
            c.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(c.metrics_bind_address, Some("[::]:10249".parse().unwrap()));
        assert_eq!(
            bind_address("[fd00::1]", METRICS_PORT),
            Ok("[fd00::1]:10249".parse().unwrap())
        );
        assert_eq!(
            bind_address("127.0.0.1:9", METRICS_PORT),
            Ok("127.0.0.1:9".parse().unwrap())
        );
    }

    /// kube-proxy's getDefaultAddresses: the family of bindAddress.
    #[test]
    fn the_default_addresses_follow_the_bind_address_family() {
        let (h, m) = default_addresses(Some("fd00::1".parse().unwrap()));
        assert_eq!(
            (h.to_string(), m.to_string()),
            ("[::]:10256".into(), "[::1]:10249".into())
        );
        for bind in [None, Some("10.0.0.1".parse().unwrap())] {
            let (h, m) = default_addresses(bind);
            assert_eq!(
                (h.to_string(), m.to_string()),
                ("0.0.0.0:10256".into(), "127.0.0.1:10249".into())
            );
        }
    }

    #[test]
    fn an_empty_configuration_sets_nothing_and_warns_of_nothing() {
        let c = parse(&format!("apiVersion: {API_VERSION}\nkind: {KIND}\n")).unwrap();
        assert_eq!(c, FromConfig::default());
        assert_eq!(c.warning(), None);
    }
}
