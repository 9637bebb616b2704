//! Many Services and EndpointSlices in a real API server, for the benchmarks: Service `i` has
//! one TCP port, a ClusterIP of its own and one EndpointSlice of ready endpoints, and all are
//! written many requests at a time, with the retries a loaded API server needs.

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::PostParams;
use kube::{Api, Client};
use svc_agent::source::kube::SERVICE_NAME_LABEL;

/// ClusterIP of Service `i`: 10.96.1.1 onwards, 250 per /24, inside the API server's
/// 10.96.0.0/12 and clear of 10.96.0.1 (the `kubernetes` Service).
pub fn cluster_ip(i: u32) -> Ipv4Addr {
    let block = 1 + i / 250;
    Ipv4Addr::new(
        10,
        96 + (block / 256) as u8,
        (block % 256) as u8,
        (1 + i % 250) as u8,
    )
}

pub fn service_name(i: u32) -> String {
    format!("svc-{i}")
}

/// Service `i` in `namespace`: ClusterIP [`cluster_ip`]`(i)`, `port`/TCP to `target`.
pub fn service(namespace: &str, i: u32, port: u16, target: u16) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(service_name(i)),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some(cluster_ip(i).to_string()),
            ports: Some(vec![ServicePort {
                port: port.into(),
                target_port: Some(IntOrString::Int(target.into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Service `i`'s one slice: every address in `ips` ready, port `target`/TCP, unnamed.
pub fn slice(
    namespace: &str,
    i: u32,
    ips: impl IntoIterator<Item = Ipv4Addr>,
    target: u16,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{}-0", service_name(i))),
            namespace: Some(namespace.into()),
            labels: Some([(SERVICE_NAME_LABEL.to_string(), service_name(i))].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: ips.into_iter().map(ready_endpoint).collect(),
        ports: Some(vec![EndpointPort {
            name: Some(String::new()),
            port: Some(target.into()),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    }
}

pub fn ready_endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        addresses: vec![ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(true),
            serving: Some(true),
            terminating: Some(false),
        }),
        ..Default::default()
    }
}

/// `ready_endpoint` on node `node` (its `nodeName`), as the EndpointSlice controller writes
/// every endpoint of a scheduled pod.
pub fn ready_endpoint_on(ip: Ipv4Addr, node: Option<String>) -> Endpoint {
    Endpoint {
        node_name: node,
        ..ready_endpoint(ip)
    }
}

/// A cloud-style node name (`ip-10-1-2-3.ec2.internal`) of node `n`.
pub fn node_name(n: u32) -> String {
    let [_, a, b, c] = n.to_be_bytes();
    format!("ip-10-{a}-{b}-{c}.ec2.internal")
}

async fn create_namespace(client: Client, namespace: &str) -> Result<Namespace> {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(namespace.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    create(&Api::all(client), &ns).await
}

/// Creates, retrying what a loaded API server refuses for a moment; an object that already
/// exists (a retried request that had succeeded) is read back instead.
pub async fn create<K>(api: &Api<K>, obj: &K) -> Result<K>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match api.create(&PostParams::default(), obj).await {
            Ok(o) => return Ok(o),
            Err(kube::Error::Api(s)) if s.is_already_exists() => return Ok(api.get(&name).await?),
            Err(e) if attempt < 5 => {
                eprintln!("creating {name} (attempt {attempt}): {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("creating {name}")),
        }
    }
}

/// Creates `namespace` through the API, then writes Services `0..n` with their slices from
/// `objects` straight into etcd, with the IPAddress objects that the apiserver's ClusterIP
/// allocator would have made (so its repair loop finds nothing to do). Returns the slices as
/// written, by index (no resourceVersion: replace them unconditionally).
///
/// Why not through the API: kube-apiserver v1.37's ClusterIP allocator lists every IPAddress
/// on each allocation (`ipallocator.go`: `metrics.setAllocated(a.Used())`, evaluated even with
/// metrics off), so creating N Services costs O(N²): on 2 cores 30,000 took 8 minutes and the
/// next 10,000 another 12. Written here, 100,000 take seconds, and every object is still read
/// through the API server (its storage is JSON for this: `--storage-media-type`).
pub async fn populate_via_etcd(
    cp: &crate::control_plane::ControlPlane,
    client: Client,
    namespace: &str,
    n: u32,
    objects: impl Fn(u32) -> (Service, EndpointSlice),
) -> Result<Vec<EndpointSlice>> {
    create_namespace(client.clone(), namespace).await?;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut out = Vec::with_capacity(n as usize);
    let mut batch: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..n {
        let (svc, slice) = objects(i);
        let name = svc.metadata.name.clone().unwrap_or_default();
        let uid = |k: u32| {
            format!(
                "00000000-0000-4000-8000-{:012x}",
                u64::from(i) * 2 + u64::from(k)
            )
        };
        let mut sv = serde_json::to_value(&svc)?;
        let ip = sv["spec"]["clusterIP"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        // What the apiserver's defaulting and allocation would have stored.
        sv["metadata"]["uid"] = uid(0).into();
        sv["metadata"]["creationTimestamp"] = now.clone().into();
        let spec = &mut sv["spec"];
        spec["clusterIPs"] = serde_json::json!([ip]);
        spec["ipFamilies"] = serde_json::json!(["IPv4"]);
        spec["ipFamilyPolicy"] = "SingleStack".into();
        spec["sessionAffinity"] = "None".into();
        spec["internalTrafficPolicy"] = "Cluster".into();
        sv["status"] = serde_json::json!({"loadBalancer": {}});
        let mut sl = serde_json::to_value(&slice)?;
        sl["metadata"]["uid"] = uid(1).into();
        sl["metadata"]["creationTimestamp"] = now.clone().into();
        let slice_name = slice.metadata.name.clone().unwrap_or_default();
        let address = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "IPAddress",
            "metadata": {
                "name": ip,
                "uid": format!("00000000-0000-4000-9000-{:012x}", i),
                "creationTimestamp": now,
                "labels": {
                    "ipaddress.kubernetes.io/ip-family": "IPv4",
                    "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                },
            },
            "spec": {"parentRef": {"group": "", "resource": "services",
                                   "namespace": namespace, "name": name}},
        });
        batch.push((
            format!("/registry/ipaddresses/{ip}"),
            serde_json::to_vec(&address)?,
        ));
        batch.push((
            format!("/registry/services/specs/{namespace}/{name}"),
            serde_json::to_vec(&sv)?,
        ));
        batch.push((
            format!("/registry/endpointslices/{namespace}/{slice_name}"),
            serde_json::to_vec(&sl)?,
        ));
        out.push(slice);
        if batch.len() >= 3 * 2000 || i + 1 == n {
            cp.etcd_put(&batch)?;
            batch.clear();
            eprintln!("  {}/{n} services and slices written", i + 1);
        }
    }
    caught_up(client, namespace).await?;
    // Digesting the writes keeps the API server busy for a while after it serves lists.
    let pids = cp.pids();
    let settled =
        tokio::task::spawn_blocking(move || crate::sys::settle(&pids, Duration::from_secs(300)))
            .await??;
    eprintln!(
        "the API server and etcd {} after {:.1} s more",
        if settled.quiet {
            "went quiet"
        } else {
            "were still busy"
        },
        settled.waited.as_secs_f64()
    );
    Ok(out)
}

/// Waits until the API server serves a consistent list of both kinds: written straight into
/// etcd, the objects reach its watch cache as events, and until the cache has caught up a
/// consistent list waits for it and then fails with 504 (kube-rs retries those). A proxy
/// started before then measures that catching up, which a cluster whose objects came through
/// the API server never has.
async fn caught_up(client: Client, namespace: &str) -> Result<()> {
    let started = std::time::Instant::now();
    let one = kube::api::ListParams::default().limit(1);
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let slices: Api<EndpointSlice> = Api::namespaced(client, namespace);
    loop {
        let s = services.list_metadata(&one).await;
        let e = slices.list_metadata(&one).await;
        if s.is_ok() && e.is_ok() {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("the API server's cache did not catch up with etcd in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "the API server's cache caught up with etcd after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Creates `namespace`, then Services `0..n` with their slices from `objects`, `concurrency`
/// requests at a time; returns the slices as stored (with their resourceVersions), by index.
pub async fn populate(
    client: Client,
    namespace: &str,
    n: u32,
    concurrency: usize,
    objects: impl Fn(u32) -> (Service, EndpointSlice),
) -> Result<Vec<EndpointSlice>> {
    create_namespace(client.clone(), namespace).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let slices: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let mut created = futures::stream::iter(0..n)
        .map(|i| {
            let (services, slices) = (services.clone(), slices.clone());
            let (service, slice) = objects(i);
            async move {
                create(&services, &service).await?;
                let s = create(&slices, &slice).await?;
                Ok::<_, anyhow::Error>((i, s))
            }
        })
        .buffer_unordered(concurrency);
    let mut out: Vec<Option<EndpointSlice>> = vec![None; n as usize];
    let mut done = 0;
    while let Some(r) = created.next().await {
        let (i, s) = r?;
        out[i as usize] = Some(s);
        done += 1;
        if done % 2000 == 0 {
            eprintln!("  {done}/{n} services and slices created");
        }
    }
    Ok(out.into_iter().flatten().collect())
}
