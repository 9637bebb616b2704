//! Kubernetes manifests on disk: v1 Service and discovery.k8s.io/v1 EndpointSlice builders,
//! and a directory the agent watches, written atomically.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

use crate::sys::TempDir;

#[derive(Clone, Debug)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

#[derive(Clone, Debug)]
pub struct ServicePort {
    pub name: Option<String>,
    pub port: u16,
    pub protocol: String,
    pub target_port: Option<TargetPort>,
}

impl ServicePort {
    pub fn tcp(port: u16) -> Self {
        Self {
            name: None,
            port,
            protocol: "TCP".into(),
            target_port: None,
        }
    }

    pub fn udp(port: u16) -> Self {
        Self {
            protocol: "UDP".into(),
            ..Self::tcp(port)
        }
    }

    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.into());
        self
    }

    pub fn target(mut self, port: u16) -> Self {
        self.target_port = Some(TargetPort::Number(port));
        self
    }

    pub fn target_name(mut self, name: &str) -> Self {
        self.target_port = Some(TargetPort::Name(name.into()));
        self
    }

    fn to_value(&self) -> Value {
        let mut m = Map::new();
        if let Some(n) = &self.name {
            m.insert("name".into(), n.clone().into());
        }
        m.insert("port".into(), self.port.into());
        m.insert("protocol".into(), self.protocol.clone().into());
        match &self.target_port {
            Some(TargetPort::Number(p)) => {
                m.insert("targetPort".into(), (*p).into());
            }
            Some(TargetPort::Name(n)) => {
                m.insert("targetPort".into(), n.clone().into());
            }
            None => {}
        }
        Value::Object(m)
    }
}

/// A ClusterIP Service.
#[derive(Clone, Debug)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    /// First is `clusterIP`, all are `clusterIPs`.
    pub cluster_ips: Vec<String>,
    pub ports: Vec<ServicePort>,
    /// sessionAffinity ClientIP with this timeout.
    pub affinity_timeout_s: Option<u32>,
}

impl Service {
    pub fn new(namespace: &str, name: &str, cluster_ip: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            cluster_ips: vec![cluster_ip.into()],
            ports: Vec::new(),
            affinity_timeout_s: None,
        }
    }

    /// Adds a second cluster IP of the other family (dual-stack).
    pub fn also_ip(mut self, ip: &str) -> Self {
        self.cluster_ips.push(ip.into());
        self
    }

    pub fn port(mut self, p: ServicePort) -> Self {
        self.ports.push(p);
        self
    }

    pub fn affinity(mut self, timeout_s: u32) -> Self {
        self.affinity_timeout_s = Some(timeout_s);
        self
    }

    pub fn file_name(&self) -> String {
        format!("svc-{}-{}.yaml", self.namespace, self.name)
    }

    pub fn to_value(&self) -> Value {
        let families: Vec<&str> = self
            .cluster_ips
            .iter()
            .map(|ip| if ip.contains(':') { "IPv6" } else { "IPv4" })
            .collect();
        let policy = if families.len() > 1 {
            "RequireDualStack"
        } else {
            "SingleStack"
        };
        let mut spec = json!({
            "type": "ClusterIP",
            "clusterIP": self.cluster_ips[0],
            "clusterIPs": self.cluster_ips,
            "ipFamilies": families,
            "ipFamilyPolicy": policy,
            "selector": { "app": self.name },
            "ports": self.ports.iter().map(ServicePort::to_value).collect::<Vec<_>>(),
        });
        match self.affinity_timeout_s {
            Some(t) => {
                spec["sessionAffinity"] = "ClientIP".into();
                spec["sessionAffinityConfig"] = json!({ "clientIP": { "timeoutSeconds": t } });
            }
            None => spec["sessionAffinity"] = "None".into(),
        }
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": { "name": self.name, "namespace": self.namespace },
            "spec": spec,
        })
    }
}

#[derive(Clone, Debug)]
pub struct SlicePort {
    pub name: Option<String>,
    pub port: u16,
    pub protocol: String,
}

impl SlicePort {
    pub fn tcp(port: u16) -> Self {
        Self {
            name: None,
            port,
            protocol: "TCP".into(),
        }
    }

    pub fn udp(port: u16) -> Self {
        Self {
            protocol: "UDP".into(),
            ..Self::tcp(port)
        }
    }

    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.into());
        self
    }
}

#[derive(Clone, Debug)]
pub struct Endpoint {
    pub addresses: Vec<String>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Endpoint {
    pub fn ready(addr: &str) -> Self {
        Self {
            addresses: vec![addr.into()],
            ready: true,
            serving: true,
            terminating: false,
        }
    }

    pub fn not_ready(addr: &str) -> Self {
        Self {
            ready: false,
            serving: false,
            ..Self::ready(addr)
        }
    }

    /// A terminating endpoint (ready is false while terminating, per the API).
    pub fn terminating(addr: &str, serving: bool) -> Self {
        Self {
            ready: false,
            serving,
            terminating: true,
            ..Self::ready(addr)
        }
    }
}

#[derive(Clone, Debug)]
pub struct EndpointSlice {
    pub namespace: String,
    pub name: String,
    pub service: String,
    /// "IPv4" or "IPv6".
    pub address_type: String,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<Endpoint>,
}

impl EndpointSlice {
    /// A slice of `service` in `namespace`, named `<service>-<suffix>`.
    pub fn new(namespace: &str, service: &str, suffix: &str, address_type: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: format!("{service}-{suffix}"),
            service: service.into(),
            address_type: address_type.into(),
            ports: Vec::new(),
            endpoints: Vec::new(),
        }
    }

    pub fn ipv4(namespace: &str, service: &str) -> Self {
        Self::new(namespace, service, "v4", "IPv4")
    }

    pub fn ipv6(namespace: &str, service: &str) -> Self {
        Self::new(namespace, service, "v6", "IPv6")
    }

    pub fn port(mut self, p: SlicePort) -> Self {
        self.ports.push(p);
        self
    }

    pub fn endpoint(mut self, e: Endpoint) -> Self {
        self.endpoints.push(e);
        self
    }

    pub fn file_name(&self) -> String {
        format!("eps-{}-{}.yaml", self.namespace, self.name)
    }

    pub fn to_value(&self) -> Value {
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|p| {
                let mut m = Map::new();
                if let Some(n) = &p.name {
                    m.insert("name".into(), n.clone().into());
                }
                m.insert("port".into(), p.port.into());
                m.insert("protocol".into(), p.protocol.clone().into());
                Value::Object(m)
            })
            .collect();
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|e| {
                json!({
                    "addresses": e.addresses,
                    "conditions": {
                        "ready": e.ready,
                        "serving": e.serving,
                        "terminating": e.terminating,
                    },
                })
            })
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": { "kubernetes.io/service-name": self.service },
            },
            "addressType": self.address_type,
            "ports": ports,
            "endpoints": endpoints,
        })
    }
}

/// A manifests directory. Files are written to a staging directory beside it and renamed in,
/// so the agent never reads a half-written file (rename within one filesystem is atomic).
#[derive(Debug)]
pub struct Manifests {
    root: TempDir,
    dir: PathBuf,
    staging: PathBuf,
}

impl Manifests {
    pub fn new() -> Result<Self> {
        let root = TempDir::new("svc-test-manifests")?;
        let dir = root.path().join("manifests");
        let staging = root.path().join("staging");
        std::fs::create_dir(&dir)?;
        std::fs::create_dir(&staging)?;
        Ok(Self { root, dir, staging })
    }

    /// The directory to give the agent.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A scratch directory beside the manifests (agent logs go there).
    pub fn scratch(&self) -> &Path {
        self.root.path()
    }

    /// Writes `contents` as `dir/file`, atomically.
    pub fn write_raw(&self, file: &str, contents: &str) -> Result<()> {
        let tmp = self.staging.join(file);
        std::fs::write(&tmp, contents).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, self.dir.join(file))
            .with_context(|| format!("renaming {file} into place"))?;
        Ok(())
    }

    /// Writes a JSON value as a YAML document.
    pub fn write_value(&self, file: &str, value: &Value) -> Result<()> {
        self.write_raw(file, &serde_saphyr::to_string(value)?)
    }

    pub fn remove(&self, file: &str) -> Result<()> {
        std::fs::remove_file(self.dir.join(file)).with_context(|| format!("removing {file}"))
    }

    pub fn apply_service(&self, s: &Service) -> Result<()> {
        self.write_value(&s.file_name(), &s.to_value())
    }

    pub fn apply_slice(&self, s: &EndpointSlice) -> Result<()> {
        self.write_value(&s.file_name(), &s.to_value())
    }

    pub fn delete_service(&self, s: &Service) -> Result<()> {
        self.remove(&s.file_name())
    }

    pub fn delete_slice(&self, s: &EndpointSlice) -> Result<()> {
        self.remove(&s.file_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written as YAML, read back as the agent reads it.
    fn round_trip(value: &Value) -> Value {
        let yaml = serde_saphyr::to_string(value).unwrap();
        serde_saphyr::from_str_with_options(&yaml, serde_saphyr::options! { strict_booleans: true })
            .unwrap()
    }

    /// The YAML the agent reads carries the fields the builders were given.
    #[test]
    fn service_and_slice_yaml() {
        let svc = Service::new("demo", "web", "10.96.0.10")
            .also_ip("fd00:96::10")
            .port(ServicePort::tcp(80).name("http").target_name("web"))
            .affinity(30);
        let v = round_trip(&svc.to_value());
        assert_eq!(
            v["spec"]["clusterIPs"],
            json!(["10.96.0.10", "fd00:96::10"])
        );
        assert_eq!(v["spec"]["ipFamilies"], json!(["IPv4", "IPv6"]));
        assert_eq!(v["spec"]["ipFamilyPolicy"], "RequireDualStack");
        assert_eq!(v["spec"]["ports"][0]["targetPort"], "web");
        assert_eq!(v["spec"]["sessionAffinity"], "ClientIP");
        assert_eq!(
            v["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"],
            30
        );

        let slice = EndpointSlice::ipv6("demo", "web")
            .port(SlicePort::udp(5353).name("dns"))
            .endpoint(Endpoint::terminating("fd00::1", true));
        let v = round_trip(&slice.to_value());
        assert_eq!(v["metadata"]["labels"]["kubernetes.io/service-name"], "web");
        assert_eq!(v["addressType"], "IPv6");
        assert_eq!(
            v["ports"][0],
            json!({"name": "dns", "port": 5353, "protocol": "UDP"})
        );
        assert_eq!(
            v["endpoints"][0]["conditions"],
            json!({"ready": false, "serving": true, "terminating": true})
        );
    }

    #[test]
    fn writes_are_atomic_renames() {
        let m = Manifests::new().unwrap();
        m.write_raw("a.yaml", "x: 1\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(m.dir().join("a.yaml")).unwrap(),
            "x: 1\n"
        );
        // Nothing is left in the staging directory, and nothing else appears in the
        // watched one.
        assert_eq!(std::fs::read_dir(&m.staging).unwrap().count(), 0);
        assert_eq!(std::fs::read_dir(m.dir()).unwrap().count(), 1);
        let root = m.scratch().to_owned();
        drop(m);
        assert!(!root.exists());
    }
}
