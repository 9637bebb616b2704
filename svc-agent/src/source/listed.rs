//! EndpointSlices as the watch decodes them: only the fields the agent reads.
//!
//! A list page holds its objects decoded until each is parsed into the cache. Decoded as
//! k8s-openapi's `EndpointSlice`, a slice of 10 endpoints took about 8.6 KB (an `Endpoint` is
//! 352 bytes, most of them a `targetRef` and fields kube-proxy never reads), so a page of
//! 5,000 held about 43 MB beside the cache; a cluster's slices, with their `targetRef`s,
//! `managedFields` and owner references, hold several times more. `ListedSlice` keeps the
//! metadata the agent reads, each endpoint's first address (the only one kube-proxy uses),
//! its conditions, node and hints, and the ports; each is made an `EndpointSlice` again
//! (`From`) one at a time, as the watcher hands it over, for the parser every source shares.
//! Hand-written: no crate decodes a Kubernetes object partially.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::runtime::watcher::Event;
use serde::de::{Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;

/// An EndpointSlice of the API, decoded only as far as the agent reads it.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSlice {
    #[serde(default, deserialize_with = "listed_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub address_type: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub endpoints: Vec<ListedEndpoint>,
    #[serde(default)]
    pub ports: Option<Vec<EndpointPort>>,
}

/// An endpoint of a `ListedSlice`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedEndpoint {
    /// The first of `addresses`: the API defines them as fungible, and kube-proxy (and the
    /// parser) use the first alone.
    #[serde(default, rename = "addresses", deserialize_with = "first_address")]
    pub address: Option<String>,
    #[serde(default)]
    pub conditions: Option<EndpointConditions>,
    #[serde(default)]
    pub node_name: Option<String>,
    /// Boxed: rare (topology-aware routing), and 48 bytes inline.
    #[serde(default)]
    pub hints: Option<Box<EndpointHints>>,
}

/// The metadata the agent reads: no managedFields, owner references or finalizers.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListedMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    generation: Option<i64>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

fn listed_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = Option::<ListedMeta>::deserialize(d)?;
    Ok(m.map(|m| ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        generation: m.generation,
        creation_timestamp: m.creation_timestamp,
        deletion_timestamp: m.deletion_timestamp,
        labels: m.labels,
        annotations: m.annotations,
        ..ObjectMeta::default()
    })
    .unwrap_or_default())
}

/// `null` as an empty list, as k8s-openapi reads a required list.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The first string of a list (or `null`), the rest read and dropped.
fn first_address<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct First;
    impl<'de> Visitor<'de> for First {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of addresses")
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(First)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let first = seq.next_element::<String>()?;
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    d.deserialize_option(First)
}

impl k8s_openapi::Resource for ListedSlice {
    const API_VERSION: &'static str = <EndpointSlice as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <EndpointSlice as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <EndpointSlice as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <EndpointSlice as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str =
        <EndpointSlice as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <EndpointSlice as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::ListableResource for ListedSlice {
    const LIST_KIND: &'static str = <EndpointSlice as k8s_openapi::ListableResource>::LIST_KIND;
}

impl k8s_openapi::Metadata for ListedSlice {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<ListedEndpoint> for Endpoint {
    fn from(e: ListedEndpoint) -> Endpoint {
        Endpoint {
            addresses: e.address.into_iter().collect(),
            conditions: e.conditions,
            node_name: e.node_name,
            hints: e.hints.map(|h| *h),
            ..Endpoint::default()
        }
    }
}

impl From<ListedSlice> for EndpointSlice {
    fn from(s: ListedSlice) -> EndpointSlice {
        EndpointSlice {
            metadata: s.metadata,
            address_type: s.address_type,
            endpoints: s.endpoints.into_iter().map(Endpoint::from).collect(),
            ports: s.ports,
        }
    }
}

/// A watcher's event of a `ListedSlice`, as one of an `EndpointSlice`.
pub fn slice_event(e: Event<ListedSlice>) -> Event<EndpointSlice> {
    match e {
        Event::Apply(s) => Event::Apply(s.into()),
        Event::Delete(s) => Event::Delete(s.into()),
        Event::Init => Event::Init,
        Event::InitApply(s) => Event::InitApply(s.into()),
        Event::InitDone => Event::InitDone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice as a cluster's API server serves it, with every field the agent does not read.
    const SLICE: &str = r#"{
      "metadata": {
        "name": "web-abc12", "namespace": "shop", "uid": "5b0c3f5e-0000-4000-8000-000000000001",
        "resourceVersion": "4242", "generation": 3,
        "creationTimestamp": "2026-12-01T10:00:00Z",
        "labels": {"kubernetes.io/service-name": "web",
                   "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-01T10:00:01Z"},
        "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web",
                             "uid": "5b0c3f5e-0000-4000-8000-000000000000",
                             "controller": true, "blockOwnerDeletion": true}],
        "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                           "apiVersion": "discovery.k8s.io/v1", "time": "2026-12-01T10:00:01Z",
                           "fieldsType": "FieldsV1",
                           "fieldsV1": {"f:addressType": {}, "f:endpoints": {}}}]
      },
      "addressType": "IPv4",
      "endpoints": [
        {"addresses": ["10.1.0.5", "10.1.0.6"],
         "conditions": {"ready": true, "serving": true, "terminating": false},
         "hostname": "web-0", "nodeName": "ip-10-0-3-231.ec2.internal", "zone": "eu-west-1a",
         "deprecatedTopology": {"topology.kubernetes.io/zone": "eu-west-1a"},
         "hints": {"forZones": [{"name": "eu-west-1a"}]},
         "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-0",
                       "uid": "5b0c3f5e-0000-4000-8000-000000000002"}},
        {"addresses": ["10.1.0.7"], "conditions": {"ready": false, "terminating": true}},
        {"addresses": []},
        {"conditions": {"ready": true}}
      ],
      "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]
    }"#;

    /// What the parser reads of a slice decoded whole: the rest cleared, addresses cut to
    /// the first.
    fn as_read(mut s: EndpointSlice) -> EndpointSlice {
        let m = s.metadata;
        s.metadata = ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            resource_version: m.resource_version,
            generation: m.generation,
            creation_timestamp: m.creation_timestamp,
            deletion_timestamp: m.deletion_timestamp,
            labels: m.labels,
            annotations: m.annotations,
            ..ObjectMeta::default()
        };
        for e in &mut s.endpoints {
            e.addresses.truncate(1);
            e.hostname = None;
            e.zone = None;
            e.deprecated_topology = None;
            e.target_ref = None;
        }
        s
    }

    #[test]
    fn a_listed_slice_is_what_the_parser_reads_of_the_whole_one() {
        let whole: EndpointSlice = serde_json::from_str(SLICE).expect("decoded whole");
        let listed: ListedSlice = serde_json::from_str(SLICE).expect("decoded as listed");
        assert_eq!(EndpointSlice::from(listed), as_read(whole.clone()));
        // And the parser makes the same of both.
        let node = crate::translate::NodeContext::default();
        let (mut e1, mut e2) = (Vec::new(), Vec::new());
        let a = crate::translate::parse_slice(&whole, &node, &mut e1).expect("parsed whole");
        let listed: ListedSlice = serde_json::from_str(SLICE).expect("decoded as listed");
        let b = crate::translate::parse_slice(&listed.into(), &node, &mut e2).expect("parsed");
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_eq!(
            e1.iter().map(ToString::to_string).collect::<Vec<_>>(),
            e2.iter().map(ToString::to_string).collect::<Vec<_>>()
        );
        assert_eq!(
            e1.len(),
            2,
            "both endpoints without addresses are named: {e1:?}"
        );
    }

    #[test]
    fn a_slice_without_endpoints_or_metadata_decodes_for_the_parser_to_refuse() {
        let s: ListedSlice =
            serde_json::from_str(r#"{"addressType": "IPv4", "endpoints": null}"#).unwrap();
        assert!(s.endpoints.is_empty());
        let node = crate::translate::NodeContext::default();
        let mut errors = Vec::new();
        assert!(crate::translate::parse_slice(&s.into(), &node, &mut errors).is_none());
        assert!(
            errors[0].to_string().contains("metadata.name is required"),
            "{errors:?}"
        );
        // A list element that is no string fails as k8s-openapi's decoding fails.
        assert!(
            serde_json::from_str::<ListedSlice>(r#"{"endpoints": [{"addresses": [1]}]}"#).is_err()
        );
    }
}
