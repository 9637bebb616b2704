//! Many Services at once: manifests of tens of thousands of Services written fast (JSON
//! streams, split into files the agent's per-file limits accept), and an exact comparison of
//! what an agent pinned with what those manifests should give.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::json;

use svc_agent::model::{Backend, DesiredFrontend, DesiredState, Frontend, Protocol};
use svc_agent::source::manifest::ManifestSource;
use svc_agent::store::Store;
use svc_agent::translate::{self, NodeContext};

/// Objects per file: well inside the agent's limits on documents and bytes per file.
const PER_FILE: usize = 2_000;

/// One generated Service: `namespace/name`, a ClusterIP, port 80/TCP (or 53/UDP) →
/// `target`, optional sessionAffinity, and its ready endpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct GenService {
    /// Its number in the generated set; decides its file.
    pub index: u32,
    pub namespace: String,
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub target: u16,
    pub endpoints: Vec<Ipv4Addr>,
    /// 53/UDP instead of 80/TCP.
    pub udp: bool,
    /// sessionAffinity: ClientIP with this timeout.
    pub affinity_s: Option<u32>,
}

impl GenService {
    /// Service `i` of a generated set: ClusterIPs from 10.100.0.0/14 (never a sandbox's own
    /// addresses), endpoints from 10.120.0.0/14, `n_endpoints` of them, shifted by `epoch` so a
    /// new epoch changes every endpoint set.
    pub fn nth(i: u32, n_endpoints: u32, epoch: u32) -> GenService {
        let ip = |base: u32, n: u32| Ipv4Addr::from(base + (n % (1 << 18)));
        GenService {
            index: i,
            namespace: "scale".into(),
            name: format!("s{i}"),
            cluster_ip: ip(u32::from(Ipv4Addr::new(10, 100, 0, 0)), i + 1),
            target: 8080,
            endpoints: (0..n_endpoints)
                .map(|e| {
                    ip(
                        u32::from(Ipv4Addr::new(10, 120, 0, 0)),
                        i.wrapping_mul(7) + e * 65_537 + epoch * 31 + 1,
                    )
                })
                .collect(),
            udp: false,
            affinity_s: None,
        }
    }

    /// `nth`, with every fourth Service (from 1) on 53/UDP and every fourth (from 2) with
    /// sessionAffinity: the frontends whose membership entries the agent keeps.
    pub fn varied(i: u32, n_endpoints: u32, epoch: u32) -> GenService {
        GenService {
            udp: i % 4 == 1,
            affinity_s: (i % 4 == 2).then_some(10_800),
            ..GenService::nth(i, n_endpoints, epoch)
        }
    }

    fn port(&self) -> (u16, &'static str) {
        if self.udp {
            (53, "UDP")
        } else {
            (80, "TCP")
        }
    }

    fn service_json(&self) -> serde_json::Value {
        let (port, protocol) = self.port();
        let mut v = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": self.namespace, "name": self.name},
            "spec": {"clusterIP": self.cluster_ip.to_string(),
                     "ports": [{"port": port, "protocol": protocol, "targetPort": self.target}]},
        });
        if let Some(t) = self.affinity_s {
            v["spec"]["sessionAffinity"] = "ClientIP".into();
            v["spec"]["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
        }
        v
    }

    fn slice_json(&self) -> serde_json::Value {
        let endpoints: Vec<_> = self
            .endpoints
            .iter()
            .map(|e| json!({"addresses": [e.to_string()], "conditions": {"ready": true}}))
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": self.namespace, "name": format!("{}-1", self.name),
                         "labels": {"kubernetes.io/service-name": self.name}},
            "addressType": "IPv4",
            "ports": [{"port": self.target, "protocol": self.port().1}],
            "endpoints": endpoints,
        })
    }
}

/// Writes `services` into `dir` as JSON streams, Service `i` into file `scale-(i / 2000)`:
/// a change to a few Services rewrites a few files. Files are replaced atomically through
/// `staging`, only when their contents change; files no Service lands in are removed.
pub fn write_services(dir: &Path, staging: &Path, services: &[GenService]) -> Result<()> {
    let mut files: std::collections::BTreeMap<String, String> = Default::default();
    for s in services {
        let file = format!("scale-{:04}.json", s.index / PER_FILE as u32);
        let text = files.entry(file).or_default();
        text.push_str(&s.service_json().to_string());
        text.push('\n');
        text.push_str(&s.slice_json().to_string());
        text.push('\n');
    }
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("scale-") && !files.contains_key(&name) {
            std::fs::remove_file(dir.join(&name))?;
        }
    }
    for (file, text) in files {
        let path = dir.join(&file);
        if std::fs::read(&path).is_ok_and(|old| old == text.as_bytes()) {
            continue;
        }
        let tmp = staging.join(&file);
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(())
}

/// The frontends `services` should give, by kube-proxy's rules read independently of the
/// agent: one frontend per Service (ClusterIP:80/TCP or 53/UDP) with its endpoints on the
/// target port.
pub fn desired_of(services: &[GenService]) -> DesiredState {
    let mut state = DesiredState::default();
    for s in services {
        let fe = Frontend::cluster(
            s.cluster_ip.into(),
            s.port().0,
            if s.udp { Protocol::Udp } else { Protocol::Tcp },
        );
        let owner = format!("{}/{}", s.namespace, s.name);
        let mut backends: Vec<Backend> = s
            .endpoints
            .iter()
            .map(|e| Backend::remote(SocketAddr::new((*e).into(), s.target)))
            .collect();
        backends.sort();
        backends.dedup();
        state.cluster_ips.insert(fe.ip);
        state.frontends.insert(
            fe,
            DesiredFrontend {
                affinity_timeout_s: s.affinity_s,
                ..DesiredFrontend::cluster_ip(fe, &owner, backends)
            },
        );
    }
    state
}

/// Every difference between the maps pinned under `bpffs` and `desired`.
pub fn pinned_vs(bpffs: &Path, desired: &DesiredState) -> Result<Vec<String>> {
    Ok(pinned_vs_each(bpffs, &[desired])?.remove(0))
}

/// `pinned_vs` for each of `desired`, from one reading of the maps.
pub fn pinned_vs_each(bpffs: &Path, desired: &[&DesiredState]) -> Result<Vec<Vec<String>>> {
    let store = svc_agent::datapath::open_pinned(bpffs)?;
    let snap = store.snapshot()?;
    Ok(desired
        .iter()
        .map(|d| svc_agent::verify::check(&snap, d))
        .collect())
}

/// Every difference between what the agent pinned under `bpffs` and what the manifests in
/// `manifests` should give (the agent's own translation, run here): empty when they agree
/// exactly, with nothing missing and nothing stray.
pub fn pinned_vs_manifests(bpffs: &Path, manifests: &Path) -> Result<Vec<String>> {
    let mut source = ManifestSource::open(manifests)?;
    let loaded = source.load();
    anyhow::ensure!(
        loaded.errors.is_empty(),
        "the test's own manifests do not load: {:?}",
        loaded.errors.first()
    );
    let translated = translate::assemble(
        loaded.services.iter().map(|n| &n.object),
        loaded.slices.iter().map(|n| &n.object),
        &NodeContext::default(),
    );
    let store = svc_agent::datapath::open_pinned(bpffs)?;
    let snap = store.snapshot()?;
    Ok(svc_agent::verify::check(&snap, &translated.state))
}
