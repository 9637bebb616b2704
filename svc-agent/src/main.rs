#[cfg(test)]
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;

use svc_agent::{agent, controller, datapath, list, metrics, source::kube, translate::NodeContext};

/// svc: Kubernetes Services through eBPF socket hooks, in place of kube-proxy.
#[derive(Parser)]
#[command(
    version = svc_agent::VERSION,
    after_help = "A command line that begins with a flag is run's, as kube-proxy's is: \
                  `svc-agent --config FILE --hostname-override NODE` is `svc-agent run ...`, \
                  and `--cleanup` anywhere in it is `svc-agent uninstall`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// The log's shape: tracing's lines, kube-proxy's klog lines, or JSON (one object a line).
    #[arg(long, global = true, value_enum, default_value = "text")]
    logging_format: svc_agent::logging::Format,
    /// kube-proxy's verbosity: 0-1 info, 2-3 the agent's debug lines, 4-5 its trace lines,
    /// 6 and above everything, the API client's included. Without it or --log-level:
    /// $RUST_LOG, else info.
    #[arg(short = 'v', long = "v", global = true)]
    v: Option<u8>,
    /// error, warn, info, debug, trace, or a directive such as `info,svc_agent=debug`
    /// (beats --v).
    #[arg(long, global = true)]
    log_level: Option<String>,
    /// A testing aid, left out of the help: take the kernel for this release (`5.15`), as the
    /// start check sees it: what came after it is reported missing and its fallbacks run
    /// (README "Kernel requirements"). It only ever takes features away.
    #[arg(long, global = true, hide = true, env = "SVC_KERNEL_AS")]
    kernel_as: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

// Parsed once at start: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Attach the datapath to a cgroup and keep it in sync with the Kubernetes API, or with
    /// manifest files.
    Run {
        /// kube-proxy's configuration file (a kubeproxy.config.k8s.io/v1alpha1
        /// KubeProxyConfiguration, as kubeadm's kube-proxy ConfigMap holds): the fields with a
        /// flag here set it, flags given on the command line (or their variables) win; the
        /// fields that do not apply are named in one warning.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Serve the Services in these files instead of the Kubernetes API: a YAML file
        /// (several documents allowed) or a directory of them, holding v1 Service and
        /// discovery.k8s.io/v1 EndpointSlice objects.
        #[arg(long, conflicts_with_all = ["kubeconfig", "service_proxy_name"])]
        manifests: Option<PathBuf>,
        /// Kubernetes client configuration; without it, in-cluster configuration, then
        /// $KUBECONFIG and ~/.kube/config.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// The cgroup (v2) whose sockets are served: by default the root of the cgroup2
        /// mount, so every pod's sockets are (on a hybrid hierarchy, the cgroup2 mount, such as
        /// /sys/fs/cgroup/unified).
        #[arg(long, default_value = DEFAULT_CGROUP)]
        cgroup: PathBuf,
        /// kube-proxy's `--cleanup`: do what `svc-agent uninstall` does with this `--bpffs`
        /// (and `--cgroup`, when given) and exit, instead of running.
        #[arg(
            long,
            default_value_t = false,
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "true",
            action = clap::ArgAction::Set
        )]
        cleanup: bool,
        /// kube-proxy's bindAddress: unless it is 0.0.0.0 or ::, the node's primary address of
        /// its family (`--nodeport-addresses primary`), over the Node's.
        #[arg(long)]
        bind_address: Option<std::net::IpAddr>,
        /// Where maps and links are pinned.
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// This node's name: its Node gives the zone for topology hints, and
        /// internalTrafficPolicy: Local keeps endpoints on it. Required with the Kubernetes API.
        #[arg(long, env = "NODE_NAME", alias = "hostname-override")]
        node_name: Option<String>,
        /// Serve only Services labelled service.kubernetes.io/service-proxy-name=NAME.
        #[arg(long)]
        service_proxy_name: Option<String>,
        /// kube-proxy compatible /healthz and /livez (not /metrics): IP:PORT, or IP for port
        /// 10256. Default with the Kubernetes API: 0.0.0.0:10256 ([::]:10256 when --config's
        /// bindAddress is IPv6); with manifests: off.
        #[arg(long, value_parser = parse_healthz)]
        healthz_bind_address: Option<SocketAddr>,
        /// Prometheus /metrics (and /healthz, /livez): IP:PORT, or IP for port 10249. Default
        /// with the Kubernetes API: 127.0.0.1:10249 ([::1]:10249 when --config's bindAddress
        /// is IPv6); with manifests: off.
        #[arg(long, value_parser = parse_metrics)]
        metrics_bind_address: Option<SocketAddr>,
        /// /healthz fails when a change has waited longer than this to be programmed (seconds).
        #[arg(long, default_value_t = 60)]
        health_timeout_s: u64,
        /// How often manifest files are checked for changes, in milliseconds.
        #[arg(long, default_value_t = 200)]
        poll_ms: u64,
        /// With the Kubernetes API: how long a burst of events is gathered before a sync, in
        /// milliseconds.
        #[arg(long, default_value_t = 5)]
        coalesce_ms: u64,
        /// With the Kubernetes API: receive the first lists as a watch that sends the
        /// existing objects first (Kubernetes' WatchList, sendInitialEvents), rather than as
        /// paged lists. The API server must support it (its WatchList feature). The watch
        /// asks for resourceVersion 0 (the API server's cache as it is), so the first sync,
        /// and `ready`, may miss the latest writes, which follow as changes.
        #[arg(long, env = "SVC_WATCH_LIST")]
        watch_list: bool,
        /// The API server's own address (https://HOST:PORT), replacing the configured one. In
        /// a cluster without kube-proxy the in-cluster address is a ClusterIP that only svc
        /// serves, so a node that boots with empty pins needs this (as Cilium's
        /// k8sServiceHost/k8sServicePort).
        #[arg(long, env = "SVC_K8S_API_SERVER", alias = "master")]
        k8s_api_server: Option<String>,
        /// The cluster's Service IP ranges (CIDRs, comma separated): an API server address in
        /// them that nothing serves yet is reported at start instead of retried forever.
        #[arg(long, env = "SVC_SERVICE_CIDR", value_delimiter = ',')]
        service_cidr: Vec<String>,
        /// With the Kubernetes API: the DaemonSet this agent runs in (NAMESPACE/NAME). When
        /// the agent is stopped and that DaemonSet is gone, being deleted, or no longer selects
        /// this node (nodeSelector, required node affinity), it hands its flows over and
        /// uninstalls, as `svc-agent uninstall` does, instead of leaving a datapath nothing
        /// updates; any other stop (a restart, an upgrade) keeps the datapath.
        #[arg(long, env = "SVC_DAEMONSET")]
        daemonset: Option<String>,
        #[command(flatten)]
        capacity: CapacityArgs,
        /// How long entries a change made unreachable (old backend sets, removed frontends'
        /// entries) stay before deletion, for connect() calls that read them just before, in
        /// milliseconds.
        #[arg(long, default_value_t = 1000)]
        retire_grace_ms: u64,
        /// How often the maps are read back and compared with what should be programmed
        /// (drift is repaired), in seconds.
        #[arg(long, default_value_t = 60)]
        reconcile_interval_s: u64,
        /// How often pinned maps and links are checked (and put back if removed), in
        /// milliseconds.
        #[arg(long, default_value_t = 2000)]
        check_interval_ms: u64,
        #[command(flatten)]
        packet: PacketArgs,
        #[command(flatten)]
        maglev: MaglevArgs,
        /// Print what the first sync would write to the maps, one line per write, and exit:
        /// the manifests (or the Kubernetes API's Services, EndpointSlices and Node, listed
        /// once), the pinned maps (none: empty) and the node's addresses are read, nothing is
        /// written, attached or pinned.
        #[arg(long)]
        dry_run: bool,
    },
    /// Print the devices and node addresses the packet datapath would use here, as `run`
    /// chooses them with the same flags (and, with --node-ip, a Node's addresses).
    Devices {
        #[command(flatten)]
        packet: PacketArgs,
        /// The Node's addresses (InternalIP first), as the Kubernetes API would give them.
        #[arg(long, value_delimiter = ',')]
        node_ip: Vec<std::net::IpAddr>,
    },
    /// Mount a bpf filesystem at PATH unless one is there (mode 0700, nosuid, nodev, noexec,
    /// as systemd mounts it): the DaemonSet's init container, so the image needs no shell.
    MountBpffs {
        #[arg(default_value = "/sys/fs/bpf")]
        path: PathBuf,
    },
    /// Print a completion script for a shell (`source <(svc-agent completion bash)`).
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print each service frontend with its backends, from the pinned maps.
    List {
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        #[arg(short, long, value_enum, default_value = "text")]
        output: Output,
    },
    /// What the datapath does with a destination now (frontend, Service, backends, verdict),
    /// from the pinned maps; with `--api` or `--kubeconfig`, also what the agent intends from
    /// the Kubernetes API (the Service port, its EndpointSlices, each endpoint used or left
    /// out and why) and where the kernel differs from it.
    Explain {
        /// Read the agent's intent from the Kubernetes API (in-cluster configuration, then
        /// $KUBECONFIG and ~/.kube/config).
        #[arg(long)]
        api: bool,
        /// Read the agent's intent from the Kubernetes API with this kubeconfig.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// With the API: the node whose view to take (its zone, its endpoints for Local
        /// policies).
        #[arg(long, env = "NODE_NAME", alias = "hostname-override")]
        node_name: Option<String>,
        /// With the API: the agent's --service-proxy-name.
        #[arg(long)]
        service_proxy_name: Option<String>,
        /// With the API: the API server's own address (https://HOST:PORT).
        #[arg(long, env = "SVC_K8S_API_SERVER", alias = "master")]
        k8s_api_server: Option<String>,
        /// The destination, ADDR:PORT.
        #[arg(long)]
        dst: SocketAddr,
        /// The client: ADDR, or ADDR:PORT to find the flow's conntrack entry.
        #[arg(long, value_parser = svc_agent::explain::parse_src)]
        src: Option<(std::net::IpAddr, Option<u16>)>,
        #[arg(long, value_enum, default_value = "tcp")]
        proto: svc_agent::explain::Proto,
        /// Where the traffic starts: a pod's or the node's socket, or a packet from outside.
        #[arg(long, value_enum, default_value = "pod")]
        from: svc_agent::explain::From,
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        #[arg(short, long, value_enum, default_value = "text")]
        output: Output,
    },
    /// Print the datapath's decisions as they happen (both datapaths): translated to which
    /// backend, refused or dropped and why. The programs write them only while a monitor
    /// listens (up to 4 at once, each with its own filters); at high rates they are sampled,
    /// and what was not shown is counted.
    Monitor {
        /// Only this Service's decisions: NAMESPACE/NAME.
        #[arg(long)]
        service: Option<String>,
        /// Only decisions about this destination (as sent, or its backend), ADDR:PORT; and
        /// the replies and ICMP errors shown coming from it.
        #[arg(long)]
        dst: Option<SocketAddr>,
        /// Every packet of a known flow (tc, XDP), not only those that change its state (a
        /// FIN, the second FIN, an RST).
        #[arg(long)]
        packets: bool,
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        #[arg(short, long, value_enum, default_value = "text")]
        output: Output,
    },
    /// Detach the programs and remove every pinned map and link.
    Uninstall {
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// Also check that none of svc's programs is left attached to this cgroup (programs of
        /// others there are left alone, and listed).
        #[arg(long)]
        cgroup: Option<PathBuf>,
    },
}

/// The packet datapath: NodePorts, ExternalIPs and LoadBalancer IPs on the node's devices.
#[derive(clap::Args)]
struct PacketArgs {
    /// External devices the tc programs attach to: names or patterns (`eth*`, Cilium's
    /// `eth+`), comma separated; `none` turns the packet datapath off. Default: the devices
    /// that carry the node's addresses or the default route, as Cilium picks them. Followed
    /// as devices appear and disappear.
    #[arg(long, env = "SVC_DEVICES", value_delimiter = ',')]
    devices: Vec<String>,
    /// Host sides of pod devices (patterns) whose pods' ClusterIP traffic is translated per
    /// packet (pods outside the served cgroup, as service meshes need). Default: none.
    #[arg(long, value_delimiter = ',')]
    packet_lb_devices: Vec<String>,
    /// The node addresses NodePorts answer on (loopback only as `--localhost-nodeports` says)
    /// and healthCheckNodePort servers
    /// listen on, as kube-proxy's flag: CIDRs and the keywords `primary` (the node's primary
    /// address per family: the Node's InternalIP with the Kubernetes API, the devices' with
    /// manifests), `all` and `localhost`, comma separated. A family none of them covers has
    /// every address chosen (health check servers on its wildcard address), as under
    /// 0.0.0.0/0 or ::/0.
    #[arg(long, value_delimiter = ',', default_value = "primary")]
    nodeport_addresses: Vec<String>,
    /// Whether the IPv4 loopback addresses `--nodeport-addresses` covers (`localhost`, `all`,
    /// 127.0.0.0/8) answer NodePorts for processes of the node's own network namespace, as
    /// kube-proxy's --iptables-localhost-nodeports. IPv6 loopback never does; nor does a
    /// pod's loopback, nor loopback from outside the node.
    #[arg(
        long,
        alias = "iptables-localhost-nodeports",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    localhost_nodeports: bool,
    /// Idle timeout of established TCP flows through NodePorts, ExternalIPs and LoadBalancer
    /// IPs (and per-packet ClusterIP flows), as kube-proxy's flag of that name sets it for
    /// conntrack: a Go duration. 0 leaves it as the node's conntrack has it (kube-proxy's
    /// "leave as-is"), or the built-in 24h where conntrack is not loaded.
    #[arg(long, default_value = "24h0m0s")]
    conntrack_tcp_timeout_established: String,
    /// Idle timeout of a TCP flow closed one way (a FIN from one side only: conntrack's
    /// CLOSE_WAIT), as kube-proxy's flag; 0 as the node's conntrack has it, else 1h.
    #[arg(long, default_value = "1h0m0s")]
    conntrack_tcp_timeout_close_wait: String,
    /// Idle timeout of a UDP flow that has had no reply, as kube-proxy's flag; 0 (its
    /// default) as the node's conntrack has it, else the kernel's 30s.
    #[arg(long, default_value = "0")]
    conntrack_udp_timeout: String,
    /// Idle timeout of a UDP flow with replies, as kube-proxy's flag; 0 (its default) as
    /// the node's conntrack has it, else the kernel's 120s.
    #[arg(long, default_value = "0")]
    conntrack_udp_timeout_stream: String,
    /// How often the flows that have died (idle past their timeout, the 10s closing timeout
    /// once closed) are removed from connection tracking, a Go duration; 0 never: a table
    /// full of dead flows then evicts about the least recently used, an idle live connection
    /// before flows that died seconds ago.
    #[arg(long, default_value = "10s")]
    conntrack_sweep_interval: String,
    /// Source ports of flows SNATed to another node's endpoint, MIN-MAX. Default: above the
    /// node's ephemeral ports (net.ipv4.ip_local_port_range), else below them, else
    /// 61001-65535. A range that overlaps the ephemeral ports is added to
    /// net.ipv4.ip_local_reserved_ports (if that fails, SNAT is off and /healthz says so).
    #[arg(long)]
    snat_port_range: Option<String>,
    /// The XDP program on the external devices, next to the tc programs: `off` (tc alone),
    /// `native` (the driver's hook; where a driver refuses it, no XDP program: tc serves the
    /// device, which the log, `list` and /metrics say per device) or `generic` (the kernel's
    /// skb-based hook everywhere). XDP finishes flows to and from remote backends and passes
    /// everything else to tc untouched (docs/design/xdp.md).
    #[arg(long, default_value = "off")]
    xdp_mode: String,
    /// How the tc programs attach to the devices: `tcx` (pinned tcx links, Linux 6.6 and
    /// later), `classic` (a clsact qdisc and direct-action cls_bpf filters at pref 1 handle
    /// 0x5356, as `tc filter add ... bpf da` makes them; every kernel svc runs on), or `auto`:
    /// tcx where the kernel has it, else classic. Either way a restarted agent replaces its
    /// programs in place, and an agent started in the other mode moves them over.
    #[arg(long, value_enum, default_value_t = datapath::TcAttach::Auto)]
    tc_attach: datapath::TcAttach,
}

impl PacketArgs {
    /// The packet datapath's settings; `reserve`: reserve the SNAT ports where they need it
    /// (`run`; `devices` only prints).
    fn config(&self, reserve: bool) -> anyhow::Result<svc_agent::packet::PacketConfig> {
        use svc_agent::{netdev, packet};
        let nodeport_addresses = netdev::NodePortAddresses::parse(&self.nodeport_addresses)
            .map_err(|e| anyhow::anyhow!("--nodeport-addresses: {e}"))?;
        let devices = netdev::DeviceSpec::parse(&self.devices);
        let (snat_ports, snat_degraded) =
            self.snat(matches!(devices, netdev::DeviceSpec::None), reserve)?;
        let xdp_mode = self.xdp_mode.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(packet::PacketConfig {
            xdp_mode,
            devices,
            pod_devices: self
                .packet_lb_devices
                .iter()
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect(),
            nodeport_addresses,
            snat_ports,
            snat_degraded,
            localhost_nodeports: self.localhost_nodeports,
            ct_timeouts: {
                let t = |flag: &str, value: &str, sysctl: &str| {
                    packet::parse_timeout(flag, value)
                        .map(|v| {
                            if v == 0 {
                                packet::node_conntrack_timeout(sysctl)
                            } else {
                                v
                            }
                        })
                        .map_err(anyhow::Error::msg)
                };
                packet::CtTimeouts {
                    tcp_established_s: t(
                        "--conntrack-tcp-timeout-established",
                        &self.conntrack_tcp_timeout_established,
                        "tcp_timeout_established",
                    )?,
                    tcp_close_wait_s: t(
                        "--conntrack-tcp-timeout-close-wait",
                        &self.conntrack_tcp_timeout_close_wait,
                        "tcp_timeout_close_wait",
                    )?,
                    udp_s: t(
                        "--conntrack-udp-timeout",
                        &self.conntrack_udp_timeout,
                        "udp_timeout",
                    )?,
                    udp_stream_s: t(
                        "--conntrack-udp-timeout-stream",
                        &self.conntrack_udp_timeout_stream,
                        "udp_timeout_stream",
                    )?,
                }
            },
            ct_sweep_every: match packet::parse_timeout(
                "--conntrack-sweep-interval",
                &self.conntrack_sweep_interval,
            )
            .map_err(anyhow::Error::msg)?
            {
                0 => None,
                s => Some(std::time::Duration::from_secs(s.into())),
            },
            tc_attach: self.tc_attach,
            bind_address: None,
            host_netns: svc_agent::sys::netns_cookie().unwrap_or_else(|e| {
                tracing::warn!(
                    "no localhost NodePorts: reading this network namespace's cookie: {e}"
                );
                0
            }),
        })
    }
}

impl PacketArgs {
    /// The SNAT port range, and why SNAT is off if it is. Nothing here stops the agent but a
    /// malformed flag: the socket datapath must not be held hostage by a setting only the
    /// packet datapath needs.
    fn snat(
        &self,
        no_devices: bool,
        reserve: bool,
    ) -> anyhow::Result<((u16, u16), Option<String>)> {
        use svc_agent::packet;
        let given = self.snat_port_range.as_deref();
        if no_devices {
            // No packet datapath, no SNAT: the node's ports are not looked at.
            let plan = packet::snat_ports(given, None).map_err(anyhow::Error::msg)?;
            return Ok((plan.range, None));
        }
        let ephemeral = packet::ephemeral_ports()
            .map_err(|e| {
                tracing::warn!(
                    "reading net.ipv4.ip_local_port_range: {e}; the SNAT ports are reserved \
                     instead"
                )
            })
            .ok();
        let plan = packet::snat_ports(given, ephemeral).map_err(anyhow::Error::msg)?;
        let (a, b) = plan.range;
        if !plan.reserve || !reserve {
            return Ok((plan.range, None));
        }
        let eph = ephemeral.map_or("unknown".to_string(), |(lo, hi)| format!("{lo}-{hi}"));
        match packet::reserve_ports(plan.range) {
            Ok(wrote) => {
                tracing::info!(
                    snat_ports = %format!("{a}-{b}"),
                    ephemeral = %eph,
                    "SNAT ports {} net.ipv4.ip_local_reserved_ports: they overlap the node's \
                     ephemeral ports (net.ipv4.ip_local_port_range), which now pass over them",
                    if wrote { "added to" } else { "already in" }
                );
                Ok((plan.range, None))
            }
            Err(e) => {
                let why = format!(
                    "SNAT off: SNAT ports {a}-{b} overlap the node's ephemeral ports {eph} \
                     (net.ipv4.ip_local_port_range) and cannot be reserved ({e}); flows to \
                     remote backends through NodePorts, ExternalIPs and LoadBalancer IPs are \
                     dropped, local backends and the socket datapath serve"
                );
                tracing::warn!("{why}");
                Ok((plan.range, Some(why)))
            }
        }
    }
}

/// Map capacities (max_entries). Hash maps allocate entries as they are used; their bucket
/// arrays (about 16 bytes per entry of capacity), the LRU maps and the backends array are
/// allocated in full. A pinned map of another capacity is migrated into
/// one of the new size at start.
#[derive(clap::Args)]
struct CapacityArgs {
    /// Frontends plus ClusterIPs (also sizes the reverse-NAT and names maps).
    #[arg(long, default_value_t = svc_common::capacity::SERVICES)]
    max_services: u32,
    /// Backend slots, over all frontends (a changed backend set needs room for the old and
    /// the new set during the grace period), in groups of eight: each frontend takes its
    /// backend count rounded up to a multiple of 8.
    #[arg(long, default_value_t = svc_common::capacity::SLOTS * svc_common::SLOT_GROUP)]
    max_slots: u32,
    /// Membership entries: one per backend of each UDP or sessionAffinity frontend, against
    /// which the programs check a remembered choice.
    #[arg(long, default_value_t = svc_common::capacity::AFFINITY_MATCH)]
    max_affinity_match: u32,
    /// Distinct backends (address, port, protocol): an array, 24 bytes an entry allocated in
    /// full, where a backend's entry is at its id modulo this size.
    #[arg(long, default_value_t = svc_common::capacity::BACKENDS)]
    max_backends: u32,
    /// sessionAffinity entries (client, frontend); LRU.
    #[arg(long, default_value_t = svc_common::capacity::AFFINITY)]
    max_affinity: u32,
    /// Per-socket reverse translations; LRU.
    #[arg(long, default_value_t = svc_common::capacity::SOCK_REV)]
    max_sock_rev: u32,
    /// Connection tracking of the packet datapath's assured flows: two entries per flow; a
    /// hash that nothing evicts, allocated as flows are assured (192 bytes an entry, and 16
    /// bytes of buckets per entry of capacity). The unassured flows' table (an LRU a flood
    /// churns, allocated in full) is a quarter of it, at least 256 entries.
    #[arg(long, default_value_t = svc_common::capacity::CT)]
    max_ct: u32,
    /// loadBalancerSourceRanges entries over all LoadBalancer frontends.
    #[arg(long, default_value_t = svc_common::capacity::SRC_RANGES)]
    max_source_ranges: u32,
    /// Maglev table entries over all external frontends (2 bytes each, allocated as tables are
    /// written, in pages of 480; a table is 127 to 131,071 entries, about 100 per backend, and
    /// a changed backend set needs room for the old and the new table during the grace
    /// period). 0: no tables. The default, 35 MiB when full and 1 MiB while no table is
    /// written, holds 10,000 Services of 10 backends with one external frontend each, with
    /// room to spare (docs/design/maglev.md).
    #[arg(long, default_value_t = DEFAULT_MAGLEV_ENTRIES)]
    max_maglev_entries: u32,
    /// Count connections and new flows per Service port in the kernel and export them
    /// (svc_service_decisions_total, labelled by namespace, service and port). Off
    /// (`--per-service-metrics=false`) for clusters whose Service count would make the series
    /// too many: the kernel then counts nothing per Service and the map is one entry.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    per_service_metrics: bool,
}

/// `--max-maglev-entries`' default: 2^24 entries (docs/design/maglev.md, Memory).
const DEFAULT_MAGLEV_ENTRIES: u32 = 1 << 24;

/// How external frontends (NodePort, externalIPs, LoadBalancer IPs) choose a backend for a new
/// flow (docs/design/maglev.md).
#[derive(clap::Args)]
struct MaglevArgs {
    /// maglev: every node with the same seed and backends picks the same backend for a flow
    /// (a flow that moves between nodes keeps its backend); random: each node picks its own.
    /// A Service's `svc.dev/lb-algorithm` annotation overrides it. ClusterIPs from pods always
    /// choose at random.
    #[arg(long, default_value = "maglev", value_parser = parse_algorithm)]
    lb_algorithm_external: svc_agent::maglev::Algorithm,
    /// The seed of the Maglev tables and the flow hash: every node of a cluster needs the
    /// same one (decimal or 0x hexadecimal).
    #[arg(long, value_parser = parse_seed)]
    maglev_seed: Option<u64>,
}

fn parse_algorithm(s: &str) -> Result<svc_agent::maglev::Algorithm, String> {
    s.parse()
}

fn parse_seed(s: &str) -> Result<u64, String> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("{s:?} is not a u64: {e}"))
}

impl MaglevArgs {
    fn settings(&self) -> svc_agent::maglev::Settings {
        svc_agent::maglev::Settings {
            external: self.lb_algorithm_external,
            seed: self.maglev_seed.unwrap_or(svc_agent::maglev::DEFAULT_SEED),
        }
    }

    /// Whether Maglev runs with the seed left at its built-in default: other nodes of a
    /// cluster must agree on it, which the agent warns about once it sees more than one Node
    /// (`controller::RunConfig::default_seed`).
    fn default_seed(&self) -> bool {
        self.maglev_seed.is_none()
            && self.lb_algorithm_external == svc_agent::maglev::Algorithm::Maglev
    }
}

impl CapacityArgs {
    fn capacity(&self) -> anyhow::Result<svc_agent::store::Capacity> {
        for (flag, v) in [
            ("--max-services", self.max_services),
            ("--max-slots", self.max_slots),
            ("--max-affinity-match", self.max_affinity_match),
            ("--max-backends", self.max_backends),
            ("--max-affinity", self.max_affinity),
            ("--max-sock-rev", self.max_sock_rev),
            ("--max-ct", self.max_ct),
            ("--max-source-ranges", self.max_source_ranges),
        ] {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        Ok(svc_agent::store::Capacity {
            services: self.max_services,
            slots: self.max_slots.div_ceil(svc_common::SLOT_GROUP),
            backends: self.max_backends,
            rev_nat: self.max_services,
            names: self.max_services,
            sock_rev: self.max_sock_rev,
            affinity: self.max_affinity,
            affinity_match: self.max_affinity_match,
            src_ranges: self.max_source_ranges,
            node_addrs: svc_common::capacity::NODE_ADDRS,
            ct: self.max_ct,
            dev_stats: svc_common::capacity::DEV_STATS,
            // 0 entries: no room (a map of one page no table uses, `Capacity::of`). At most
            // what keeps an offset in entries within a u32 (`MaglevIndex::offset`).
            maglev: self
                .max_maglev_entries
                .div_ceil(svc_common::MAGLEV_BLOCK * svc_common::MAGLEV_PAGE)
                .min(u32::MAX / (svc_common::MAGLEV_BLOCK * svc_common::MAGLEV_PAGE)),
            maglev_index: self.max_services,
            service_stats: self.max_services,
            per_service: self.per_service_metrics,
        })
    }
}

/// Where `run` attaches by default: the cgroup2 mount of a node, whose root holds every pod.
const DEFAULT_CGROUP: &str = "/sys/fs/cgroup";

fn parse_healthz(s: &str) -> Result<SocketAddr, String> {
    svc_agent::kubeproxy_config::bind_address(s, svc_agent::kubeproxy_config::HEALTHZ_PORT)
}

fn parse_metrics(s: &str) -> Result<SocketAddr, String> {
    svc_agent::kubeproxy_config::bind_address(s, svc_agent::kubeproxy_config::METRICS_PORT)
}

/// The command line's grammar: `Cli`'s, with kube-proxy's flags that do not apply accepted by
/// `run` (they are named in one warning, `ignored_flags`).
fn command() -> clap::Command {
    use clap::{Arg, ArgAction};
    Cli::command().mut_subcommand("run", |run| {
        let mut run =
            run.next_help_heading("kube-proxy's flags that do not apply (named in a warning)");
        for (flag, takes_value, why) in svc_agent::kubeproxy_config::IGNORED_FLAGS {
            let arg = Arg::new(*flag).long(*flag).help(*why);
            run = run.arg(if *takes_value {
                arg.num_args(1)
                    .allow_hyphen_values(true)
                    .action(ArgAction::Append)
            } else {
                // pflag's booleans: `--flag` or `--flag=BOOL`, never `--flag BOOL`.
                arg.num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true")
                    .value_parser(clap::builder::BoolishValueParser::new())
                    .action(ArgAction::Set)
            });
        }
        run
    })
}

/// kube-proxy's flags that do not apply among those `run` was given.
fn ignored_flags(run: &ArgMatches) -> Vec<&'static str> {
    svc_agent::kubeproxy_config::IGNORED_FLAGS
        .iter()
        .map(|(flag, _, _)| *flag)
        .filter(|flag| run.value_source(flag) == Some(ValueSource::CommandLine))
        .collect()
}

/// Parses the command line. One that begins with a flag and is not another subcommand's is
/// `run`'s, as a kube-proxy command line (kubeadm's DaemonSet runs `kube-proxy --config=FILE
/// --hostname-override=NODE`) has no subcommand.
fn parse_args(args: Vec<std::ffi::OsString>) -> Result<ArgMatches, clap::Error> {
    let begins_with_flag = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| a.starts_with('-'));
    let names_subcommand = {
        let c = command();
        let names: Vec<String> = c
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .chain(["help".to_string()])
            .collect();
        args.iter()
            .skip(1)
            .any(|a| a.to_str().is_some_and(|a| names.iter().any(|n| n == a)))
    };
    match command().try_get_matches_from(&args) {
        Err(e)
            if begins_with_flag
                && !matches!(
                    e.kind(),
                    clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
                ) =>
        {
            let mut run = args;
            run.insert(1, "run".into());
            // A command line that names a subcommand and is not run's either is told the
            // first parse's error (`--bogus list`: list's, not run's).
            command().try_get_matches_from(run).map_err(|run_error| {
                if names_subcommand {
                    e
                } else {
                    run_error
                }
            })
        }
        parsed => parsed,
    }
}

/// Where /healthz and /metrics are served: the addresses given, else (with the Kubernetes
/// API) kube-proxy's defaults for the family of `--config`'s bindAddress.
fn listen(
    from_api: bool,
    healthz: Option<SocketAddr>,
    metrics: Option<SocketAddr>,
    config_bind: Option<std::net::IpAddr>,
) -> Vec<(SocketAddr, metrics::Port)> {
    let (default_healthz, default_metrics) =
        svc_agent::kubeproxy_config::default_addresses(config_bind);
    [
        (healthz, default_healthz, metrics::Port::Health),
        (metrics, default_metrics, metrics::Port::Metrics),
    ]
    .into_iter()
    .filter_map(|(given, default, port)| {
        given
            .or_else(|| from_api.then_some(default))
            .map(|a| (a, port))
    })
    .collect()
}

fn main() -> anyhow::Result<()> {
    let matches = parse_args(std::env::args_os().collect()).unwrap_or_else(|e| e.exit());
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    svc_agent::logging::init(
        cli.logging_format,
        svc_agent::logging::filter(cli.log_level.as_deref(), cli.v),
    );
    svc_agent::fault::setup();
    if let Some(release) = &cli.kernel_as {
        svc_agent::features::assume_release(release)
            .map_err(|e| anyhow::anyhow!("--kernel-as (SVC_KERNEL_AS): {e}"))?;
    }
    let mut config_bind = None;
    let mut cgroup_given = false;
    if let Some(run) = matches.subcommand_matches("run") {
        if let Some(w) = svc_agent::kubeproxy_config::ignored_flags_warning(&ignored_flags(run)) {
            tracing::warn!("{w}");
        }
        config_bind = apply_config(&mut cli.command, run)?;
        cgroup_given = matches!(
            run.value_source("cgroup"),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
    }
    match cli.command {
        Command::Run {
            cleanup: true,
            bpffs,
            cgroup,
            ..
        } => {
            // kube-proxy's --cleanup; the cgroup is looked at only when named, as with
            // `uninstall`.
            print_out(&uninstall(
                &bpffs,
                cgroup_given.then_some(cgroup.as_path()),
            )?)?;
        }
        Command::Run {
            config: _,
            cleanup: _,
            bind_address,
            manifests,
            kubeconfig,
            cgroup,
            bpffs,
            node_name,
            service_proxy_name,
            healthz_bind_address,
            metrics_bind_address,
            health_timeout_s,
            poll_ms,
            coalesce_ms,
            watch_list,
            k8s_api_server,
            service_cidr,
            daemonset,
            capacity,
            retire_grace_ms,
            reconcile_interval_s,
            check_interval_ms,
            packet,
            maglev,
            dry_run,
        } => {
            raise_nofile_limit();
            let from_api = manifests.is_none();
            let cfg = controller::RunConfig {
                cgroup,
                bpffs,
                node: NodeContext {
                    node_name: node_name.clone(),
                    zone: None,
                    service_proxy_name: service_proxy_name.clone(),
                    node_ips: Vec::new(),
                },
                listen: listen(
                    from_api,
                    healthz_bind_address,
                    metrics_bind_address,
                    config_bind,
                ),
                health_timeout: Duration::from_secs(health_timeout_s),
                capacity: capacity.capacity()?,
                upkeep: agent::Upkeep {
                    grace: Duration::from_millis(retire_grace_ms),
                    reconcile_every: Duration::from_secs(reconcile_interval_s.max(1)),
                    check_every: Duration::from_millis(check_interval_ms.max(10)),
                    ..Default::default()
                },
                packet: svc_agent::packet::PacketConfig {
                    bind_address,
                    ..packet.config(!dry_run)?
                },
                maglev: maglev.settings(),
                default_seed: maglev.default_seed(),
            };
            let input = match manifests {
                Some(path) => controller::Input::Manifests {
                    path,
                    poll: Duration::from_millis(poll_ms.max(10)),
                },
                None => {
                    let Some(node_name) = node_name else {
                        bail!("--node-name (or $NODE_NAME) is required with the Kubernetes API");
                    };
                    controller::Input::Kube(kube::KubeOptions {
                        kubeconfig,
                        node_name,
                        service_proxy_name,
                        coalesce: Duration::from_millis(coalesce_ms),
                        watch_list,
                        // An empty setting (a ConfigMap key left blank) is no setting.
                        api_server: k8s_api_server.filter(|s| !s.trim().is_empty()),
                        daemonset: daemonset
                            .as_deref()
                            .map(str::trim)
                            .filter(|d| !d.is_empty())
                            .map(|d| {
                                d.split_once('/')
                                    .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
                                    .map(|(ns, name)| (ns.to_string(), name.to_string()))
                                    .ok_or_else(|| {
                                        anyhow::anyhow!(
                                            "--daemonset {d:?}: expected NAMESPACE/NAME"
                                        )
                                    })
                            })
                            .transpose()?,
                        service_cidrs: service_cidr
                            .iter()
                            .map(|c| c.trim())
                            .filter(|c| !c.is_empty())
                            .map(|c| {
                                c.parse::<kube::Cidr>()
                                    .map_err(|e| anyhow::anyhow!("--service-cidr {e}"))
                            })
                            .collect::<anyhow::Result<_>>()?,
                    })
                }
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            if dry_run {
                let (plan, errors) = rt.block_on(controller::dry_run(&cfg, input))?;
                for e in &errors {
                    eprintln!("skipped: {}", svc_agent::names::Escaped(&e.to_string()));
                }
                print_out(&plan.to_string())?;
                return Ok(());
            }
            let (bpffs, cgroup) = (cfg.bpffs.clone(), cfg.cgroup.clone());
            let stop = rt
                .block_on(controller::run(cfg, input))
                .map_err(privilege_hint)?;
            if let controller::Stop::Removed(why) = stop {
                tracing::warn!(%why, "stopped for good on this node: uninstalling");
                print_out(&uninstall(&bpffs, Some(&cgroup))?)?;
            }
        }
        Command::Devices { packet, node_ip } => {
            let cfg = packet.config(false)?;
            let state = svc_agent::netdev::read().context("reading devices over rtnetlink")?;
            let api = (!node_ip.is_empty()).then_some(node_ip.as_slice());
            let view = svc_agent::packet::view(&cfg, &state, api);
            let addrs: Vec<serde_json::Value> = view
                .addrs
                .iter()
                .map(|(ip, v)| {
                    serde_json::json!({
                        "address": ip,
                        "nodeport": v.flags & svc_common::node_addr_flags::NODEPORT != 0,
                        "localhost_nodeport":
                            v.flags & svc_common::node_addr_flags::LOCALHOST != 0,
                        "snat": v.flags & svc_common::node_addr_flags::SNAT != 0,
                        "ifindex": v.ifindex,
                    })
                })
                .collect();
            let out = serde_json::json!({
                "external_devices": view.external,
                "pod_devices": view.pods,
                "primary_addresses": view.primary,
                "node_addresses": addrs,
                "snat_ports": format!("{}-{}", cfg.snat_ports.0, cfg.snat_ports.1),
            });
            print_out(&format!("{}\n", serde_json::to_string_pretty(&out)?))?;
        }
        Command::Completion { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut command(), "svc-agent", &mut out);
            print_out(&String::from_utf8_lossy(&out))?;
        }
        Command::MountBpffs { path } => {
            let mounted = svc_agent::sys::mount_bpffs(&path)
                .with_context(|| format!("mounting bpffs at {}", path.display()))?;
            print_out(&match mounted {
                true => format!("{}: bpffs mounted\n", path.display()),
                false => format!("{}: bpffs was mounted already\n", path.display()),
            })?;
        }
        Command::List { bpffs, output } => {
            let store = datapath::open_pinned(&bpffs)?;
            let mut listing = list::read(&store)?;
            listing.xdp_devices = datapath::xdp_listing(&bpffs);
            listing.tc_programs = datapath::tc_attachments(&bpffs);
            match output {
                Output::Json => {
                    print_out(&format!("{}\n", serde_json::to_string_pretty(&listing)?))?
                }
                Output::Text => print_out(&list::render_text(&listing))?,
            }
        }
        Command::Explain {
            api,
            kubeconfig,
            node_name,
            service_proxy_name,
            k8s_api_server,
            dst,
            src,
            proto,
            from,
            bpffs,
            output,
        } => {
            let store = datapath::open_pinned(&bpffs)?;
            let query = svc_agent::explain::Query {
                dst,
                src,
                proto,
                from,
            };
            let mut e = svc_agent::explain::read(&store, &query)?;
            if api || kubeconfig.is_some() {
                let Some(node_name) = node_name else {
                    bail!("explain with the API needs --node-name (or $NODE_NAME)");
                };
                let opts = kube::KubeOptions {
                    kubeconfig,
                    node_name,
                    service_proxy_name,
                    coalesce: Duration::ZERO,
                    api_server: k8s_api_server.filter(|s| !s.trim().is_empty()),
                    service_cidrs: Vec::new(),
                    daemonset: None,
                    watch_list: false,
                };
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let (services, slices, node) = rt.block_on(async {
                    kube::ApiServer::connect(&opts, None)
                        .await?
                        .objects(&opts)
                        .await
                })?;
                let context = kube::node_context(&opts, node.as_ref());
                svc_agent::explain::add_intent(&mut e, |fe| {
                    svc_agent::translate::intent(&services, &slices, &context, fe)
                });
            }
            match output {
                Output::Json => print_out(&format!("{}\n", serde_json::to_string_pretty(&e)?))?,
                Output::Text => print_out(&svc_agent::explain::render_text(&e))?,
            }
        }
        Command::Monitor {
            service,
            dst,
            packets,
            bpffs,
            output,
        } => {
            use svc_agent::monitor;
            if let Some(s) = &service {
                anyhow::ensure!(
                    s.split_once('/')
                        .is_some_and(|(ns, n)| !ns.is_empty() && !n.is_empty()),
                    "--service {s}: not NAMESPACE/NAME"
                );
            }
            let filter = monitor::Filter { service, dst };
            let json = matches!(output, Output::Json);
            let write = |line: String| print_line(&line);
            monitor::run(
                &bpffs,
                &filter,
                packets,
                &mut |d| {
                    write(if json {
                        serde_json::to_string(d).unwrap_or_default()
                    } else {
                        monitor::render_text(d)
                    })
                },
                &mut |lost| {
                    if json {
                        write(
                            serde_json::json!({ "type": "not_shown", "not_shown": lost })
                                .to_string(),
                        )
                    } else {
                        eprintln!(
                            "not shown so far: {} (ring full), {} (sampled out; now 1 in {})",
                            lost.ring_full, lost.sampled_out, lost.sample
                        );
                        true
                    }
                },
            )?;
        }
        Command::Uninstall { bpffs, cgroup } => {
            print_out(&uninstall(&bpffs, cgroup.as_deref())?)?;
        }
    }
    Ok(())
}

/// `svc-agent uninstall`, and a removed agent's last step: what was done, as lines.
fn uninstall(bpffs: &std::path::Path, cgroup: Option<&std::path::Path>) -> anyhow::Result<String> {
    let done = datapath::uninstall(bpffs, cgroup)?;
    let mut text = String::new();
    for p in &done.removed {
        text.push_str(&format!("removed {}\n", p.display()));
    }
    for f in &done.removed_filters {
        text.push_str(&format!("removed the filter of {f}\n"));
    }
    if let Some(h) = &done.handover {
        text.push_str(&format!(
            "handed over to the node's conntrack: {} flows, {} failed\n",
            h.handed,
            h.failed_total()
        ));
        if h.replaced > 0 {
            text.push_str(&format!(
                "  {} of them in place of a kernel entry already on their tuples (as an \
                 uninstall killed in the middle leaves)\n",
                h.replaced
            ));
        }
        for (why, n) in &h.failed {
            text.push_str(&format!("  {n} not handed over: {why}\n"));
        }
        tracing::info!(
            handed = h.handed,
            replaced = h.replaced,
            failed = h.failed_total(),
            "handover"
        );
    }
    if let Some(e) = &done.handover_error {
        text.push_str(&format!(
            "no flow handed over to the node's conntrack: {e}\n"
        ));
    }
    if let Some(cg) = cgroup {
        text.push_str(&format!(
            "no svc socket program attached to {}\n",
            cg.display()
        ));
        for f in &done.foreign {
            text.push_str(&format!("left alone (not svc's): {f}\n"));
        }
    }
    Ok(text)
}

/// `run --config`: the KubeProxyConfiguration's settings, under the flags given. Returns the
/// file's bindAddress, whose family picks the default health and metrics addresses.
fn apply_config(command: &mut Command, m: &ArgMatches) -> anyhow::Result<Option<std::net::IpAddr>> {
    let Command::Run {
        config: Some(path),
        kubeconfig,
        node_name,
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        packet,
        ..
    } = command
    else {
        return Ok(None);
    };
    let c = svc_agent::kubeproxy_config::read(path)?;
    let warning = c.warning();
    // A flag or its variable beats the file, as kube-proxy's flags do.
    let given = |id: &str| {
        matches!(
            m.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    fn set<T>(given: bool, to: &mut T, from: Option<T>) {
        if let (false, Some(v)) = (given, from) {
            *to = v;
        }
    }
    set(given("kubeconfig"), kubeconfig, c.kubeconfig.map(Some));
    set(given("node_name"), node_name, c.node_name.map(Some));
    set(
        given("bind_address"),
        bind_address,
        c.bind_address.map(Some),
    );
    set(
        given("healthz_bind_address"),
        healthz_bind_address,
        c.healthz_bind_address.map(Some),
    );
    set(
        given("metrics_bind_address"),
        metrics_bind_address,
        c.metrics_bind_address.map(Some),
    );
    set(
        given("nodeport_addresses"),
        &mut packet.nodeport_addresses,
        c.nodeport_addresses,
    );
    set(
        given("localhost_nodeports"),
        &mut packet.localhost_nodeports,
        c.localhost_nodeports,
    );
    set(
        given("conntrack_tcp_timeout_established"),
        &mut packet.conntrack_tcp_timeout_established,
        c.conntrack_tcp_timeout_established,
    );
    set(
        given("conntrack_tcp_timeout_close_wait"),
        &mut packet.conntrack_tcp_timeout_close_wait,
        c.conntrack_tcp_timeout_close_wait,
    );
    set(
        given("conntrack_udp_timeout"),
        &mut packet.conntrack_udp_timeout,
        c.conntrack_udp_timeout,
    );
    set(
        given("conntrack_udp_timeout_stream"),
        &mut packet.conntrack_udp_timeout_stream,
        c.conntrack_udp_timeout_stream,
    );
    tracing::info!(config = %path.display(), "read kube-proxy's configuration");
    if let Some(w) = warning {
        tracing::warn!(config = %path.display(), "{w}");
    }
    Ok(c.bind_address)
}

/// A datapath the kernel refused to load for want of privilege: say which capabilities the
/// agent needs (measured by tests/tests/privileges.rs) above the kernel's answer, which may be a
/// bare EPERM or a verifier message such as "pointer arithmetic ... prohibited for !root".
fn privilege_hint(e: svc_agent::Error) -> anyhow::Error {
    let refused = matches!(&e, svc_agent::Error::Load { .. })
        && matches!(
            e.errno(),
            Some(svc_agent::error::Errno(libc::EPERM | libc::EACCES))
        );
    // With CAP_SYS_ADMIN nothing is refused for want of privilege: an EACCES then is the
    // verifier's refusal of a program (as Debian 12's 6.1 refused one), which its message says.
    if !refused || has_cap_sys_admin() {
        return e.into();
    }
    anyhow::Error::new(e).context(
        "the kernel refused the eBPF datapath: svc-agent needs CAP_SYS_ADMIN, or CAP_BPF, \
         CAP_PERFMON and CAP_NET_ADMIN (kernel 5.8 and later), to create the maps and load the \
         cgroup socket programs",
    )
}

/// Whether this process has CAP_SYS_ADMIN in its effective set (`CapEff` of
/// /proc/self/status).
fn has_cap_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_ADMIN) != 0)
}

/// Raises RLIMIT_NOFILE's soft limit to the hard one, as Go programs (kube-proxy) do at start:
/// a container's soft 1,024 is soon spent by health check connections beside the agent's own
/// maps, links and files. The HTTP servers size their connection cap from what this leaves.
fn raise_nofile_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        tracing::warn!("reading RLIMIT_NOFILE: {}", std::io::Error::last_os_error());
        return;
    }
    if r.rlim_cur >= r.rlim_max {
        tracing::debug!(soft = r.rlim_cur, hard = r.rlim_max, "RLIMIT_NOFILE");
        return;
    }
    let old = r.rlim_cur;
    r.rlim_cur = r.rlim_max;
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } != 0 {
        tracing::warn!(
            soft = old,
            hard = r.rlim_max,
            "raising RLIMIT_NOFILE's soft limit to the hard one: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    tracing::info!(
        from = old,
        to = r.rlim_cur,
        "raised RLIMIT_NOFILE's soft limit to the hard one"
    );
}

/// Writes to stdout; a reader that went away (`svc-agent list | head`) is no error.
/// Writes one line and flushes it; false once stdout is gone (the reader left).
fn print_line(line: &str) -> bool {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<(ArgMatches, Cli), clap::Error> {
        let args = std::iter::once("svc-agent").chain(args.iter().copied());
        let m = parse_args(args.map(Into::into).collect())?;
        let cli = Cli::from_arg_matches(&m)?;
        Ok((m, cli))
    }

    /// What `run` was given, from the parsed command line (flags, then `--config`).
    fn run_of(args: &[&str]) -> (ArgMatches, Command) {
        let (m, mut cli) = parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let run = m
            .subcommand_matches("run")
            .unwrap_or_else(|| panic!("{args:?} is not run"))
            .clone();
        apply_config(&mut cli.command, &run).unwrap();
        (run, cli.command)
    }

    /// `f` given the path of a KubeProxyConfiguration file holding `fields`, removed after.
    fn with_config<R>(fields: &str, f: impl FnOnce(&str) -> R) -> R {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("svc-kp-config-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.conf");
        std::fs::write(
            &config,
            format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{fields}"
            ),
        )
        .unwrap();
        let r = f(&config.display().to_string());
        std::fs::remove_dir_all(&dir).unwrap();
        r
    }

    /// kubeadm's kube-proxy DaemonSet runs `kube-proxy --config=/var/lib/kube-proxy/config.conf
    /// --hostname-override=$(NODE_NAME)`: no subcommand, no --cgroup.
    #[test]
    fn kubeadms_kube_proxy_command_line_is_run_on_the_cgroup2_root() {
        let (_, run) = with_config(
            "bindAddress: 0.0.0.0\nclientConnection:\n  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf\n",
            |config| run_of(&[&format!("--config={config}"), "--hostname-override=node-1"]),
        );
        let Command::Run {
            cgroup,
            node_name,
            kubeconfig,
            cleanup,
            ..
        } = run
        else {
            panic!("not run")
        };
        assert_eq!(cgroup, Path::new("/sys/fs/cgroup"));
        assert_eq!(node_name.as_deref(), Some("node-1"));
        assert_eq!(
            kubeconfig.as_deref(),
            Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert!(!cleanup);
    }

    #[test]
    fn subcommands_help_and_version_are_as_before() {
        let (m, _) = parse(&["--v=2", "list", "--bpffs", "/x"]).unwrap();
        assert_eq!(m.subcommand_name(), Some("list"));
        let (m, _) = parse(&["run", "--manifests", "/m"]).unwrap();
        assert_eq!(m.subcommand_name(), Some("run"));
        for (args, kind) in [
            (&["--help"][..], clap::error::ErrorKind::DisplayHelp),
            (&["--version"][..], clap::error::ErrorKind::DisplayVersion),
        ] {
            assert_eq!(parse(args).err().map(|e| e.kind()), Some(kind), "{args:?}");
        }
        // A mistyped flag before a subcommand is that subcommand's error, not run's.
        let e = parse(&["--bogus", "list"]).err().unwrap();
        assert!(!e.to_string().contains("svc-agent run"), "{e}");
        // A flag's value that is a subcommand's name is a value.
        let (m, _) = parse(&["--hostname-override", "list", "--bpffs=/b"]).unwrap();
        assert_eq!(m.subcommand_name(), Some("run"));
        // And after a flag-first command line, run's own.
        let e = parse(&["--hostname-override=n", "--bogus"]).err().unwrap();
        assert!(e.to_string().contains("--bogus"), "{e}");
    }

    /// kube-proxy takes `--cleanup` anywhere in its command line, beside its other flags.
    #[test]
    fn cleanup_anywhere_is_uninstall() {
        for args in [
            &["--cleanup", "--bpffs", "/b"][..],
            &["--bpffs", "/b", "--cleanup"][..],
            &[
                "--v=2",
                "--hostname-override=n",
                "--bpffs=/b",
                "--cleanup=true",
            ][..],
            &[
                "run",
                "--bpffs",
                "/b",
                "--cleanup",
                "--proxy-mode",
                "iptables",
            ][..],
        ] {
            let (run, command) = run_of(args);
            let Command::Run { cleanup, bpffs, .. } = command else {
                panic!("{args:?}: not run")
            };
            assert!(cleanup, "{args:?}");
            assert_eq!(bpffs, Path::new("/b"), "{args:?}");
            // No --cgroup: uninstall does not look at the default cgroup.
            assert_eq!(run.value_source("cgroup"), Some(ValueSource::DefaultValue));
        }
        let (_, command) = run_of(&["--bpffs=/b", "--cleanup=false"]);
        assert!(matches!(command, Command::Run { cleanup: false, .. }));
    }

    /// kube-proxy's common flags: those that apply set what they mean, the others are named.
    #[test]
    fn kube_proxys_common_flags_are_taken_or_named() {
        let (run, command) = run_of(&[
            "--kubeconfig=/k",
            "--hostname-override",
            "node-1",
            "--master=https://10.0.0.1:6443",
            "--proxy-mode=iptables",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--bind-address=10.0.0.9",
            "--oom-score-adj",
            "-999",
            "--conntrack-max-per-core=0",
            "--conntrack-min=131072",
            "--feature-gates=A=true,B=false",
            "--masquerade-all",
            "--iptables-sync-period=30s",
            "--ipvs-scheduler=rr",
            "--ipvs-strict-arp=false",
            "--detect-local-mode=ClusterCIDR",
            "--healthz-bind-address=0.0.0.0",
            "--metrics-bind-address",
            "[::]",
            "--nodeport-addresses=primary,10.0.0.0/8",
            "--conntrack-tcp-timeout-established=2h",
            "--v=2",
        ]);
        let Command::Run {
            kubeconfig,
            node_name,
            k8s_api_server,
            bind_address,
            healthz_bind_address,
            metrics_bind_address,
            packet,
            ..
        } = command
        else {
            panic!("not run")
        };
        assert_eq!(kubeconfig.as_deref(), Some(Path::new("/k")));
        assert_eq!(node_name.as_deref(), Some("node-1"));
        assert_eq!(k8s_api_server.as_deref(), Some("https://10.0.0.1:6443"));
        assert_eq!(bind_address, Some("10.0.0.9".parse().unwrap()));
        assert_eq!(healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(metrics_bind_address, Some("[::]:10249".parse().unwrap()));
        assert_eq!(packet.nodeport_addresses, ["primary", "10.0.0.0/8"]);
        assert_eq!(packet.conntrack_tcp_timeout_established, "2h");
        let ignored = ignored_flags(&run);
        assert_eq!(
            ignored,
            [
                "cluster-cidr",
                "detect-local-mode",
                "conntrack-max-per-core",
                "conntrack-min",
                "feature-gates",
                "masquerade-all",
                "iptables-sync-period",
                "ipvs-scheduler",
                "ipvs-strict-arp",
                "oom-score-adj",
                "proxy-mode",
            ]
        );
        let w = svc_agent::kubeproxy_config::ignored_flags_warning(&ignored).unwrap();
        assert!(
            w.contains("--proxy-mode (svc's datapath is eBPF")
                && w.contains("--cluster-cidr (svc tells a pod's traffic by where it starts"),
            "{w}"
        );
        assert_eq!(
            svc_agent::kubeproxy_config::ignored_flags_warning(&[]),
            None
        );
    }

    /// kubeadm users write `healthzBindAddress: 0.0.0.0`; kube-proxy appends its port, and
    /// picks the default addresses by bindAddress's family.
    #[test]
    fn config_addresses_without_a_port_and_the_bind_address_family() {
        let (bind, cli) = with_config(
            "bindAddress: '::'\nhealthzBindAddress: 0.0.0.0\nhostnameOverride: n\n",
            |path| {
                let (m, mut cli) = parse(&["--config", path]).unwrap();
                let run = m.subcommand_matches("run").unwrap();
                (apply_config(&mut cli.command, run).unwrap(), cli)
            },
        );
        let Command::Run {
            healthz_bind_address,
            metrics_bind_address,
            ..
        } = cli.command
        else {
            panic!("not run")
        };
        assert_eq!(healthz_bind_address, Some("0.0.0.0:10256".parse().unwrap()));
        let at = |l: Vec<(SocketAddr, metrics::Port)>| -> Vec<String> {
            l.iter().map(|(a, _)| a.to_string()).collect()
        };
        assert_eq!(
            at(listen(
                true,
                healthz_bind_address,
                metrics_bind_address,
                bind
            )),
            ["0.0.0.0:10256", "[::1]:10249"]
        );
        assert_eq!(
            at(listen(true, None, None, None)),
            ["0.0.0.0:10256", "127.0.0.1:10249"]
        );
        assert!(listen(false, None, None, bind).is_empty());
    }
}
