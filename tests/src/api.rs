//! Writing many objects to a test's API server through kube-rs, as the benchmarks do: creation
//! that rides out the API server's short refusals under load, and the addresses generated
//! Services take.

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};

/// Creates `obj`, or returns the stored one when it exists already. Retried a few times: an API
/// server taking tens of thousands of objects in a row now and then answers 429 or times out.
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
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                eprintln!("creating {name} (attempt {attempt}): {e}; retrying");
            }
            Err(e) => return Err(e).with_context(|| format!("creating {name}")),
        }
    }
}

/// Creates the namespace `name` (or finds it).
pub async fn namespace(client: Client, name: &str) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client);
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    create(&namespaces, &ns).await.map(drop)
}

/// Creates namespace `namespace` and, 32 requests at a time, the Service and EndpointSlice
/// `objects(i)` gives for each `i` of `indexes`.
pub async fn create_services(
    client: Client,
    namespace: &str,
    indexes: impl Iterator<Item = u32>,
    objects: impl Fn(u32) -> (Service, EndpointSlice),
) -> Result<()> {
    self::namespace(client.clone(), namespace).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    let slices: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let mut created = futures::stream::iter(indexes)
        .map(|i| {
            let (services, slices) = (services.clone(), slices.clone());
            let (service, slice) = objects(i);
            async move {
                create(&services, &service).await?;
                create(&slices, &slice).await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(32);
    while let Some(r) = created.next().await {
        r?;
    }
    Ok(())
}

/// ClusterIP of generated Service `i`: 10.96.1.1 onwards, 250 per /24, inside the test API
/// server's 10.96.0.0/12 and clear of the `kubernetes` Service.
pub fn cluster_ip(i: u32) -> Ipv4Addr {
    let block = 1 + i / 250;
    Ipv4Addr::new(
        10,
        96 + (block / 256) as u8,
        (block % 256) as u8,
        (1 + i % 250) as u8,
    )
}
