//! Where Services and EndpointSlices come from, and what else tells the controller to act.
//!
//! A source only produces [`Event`]s; the controller owns the one loop that takes them.
//! What a source of Services has received is kept in its [`Tracker`], which the controller
//! asks, when a sync is due, for a [`Batch`]: from there on, Kubernetes and manifests take
//! the same path. Nothing here knows the controller or the agent.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Instant;

use k8s_openapi::jiff::Timestamp;

use crate::error::Error;
use crate::translate::{Holders, ParsedService, ParsedSlice};

pub mod kube;
pub mod listed;
pub mod manifest;
pub mod manifest_tracker;
pub mod node;
pub mod rest_client;

/// Something happened that the controller may have to act on.
// Moved from its source to the controller and into a tracker, never stored: the size of the
// largest variant costs a copy, not memory (as `kube::Update`'s).
#[allow(clippy::large_enum_variant)]
pub enum Event {
    /// A Kubernetes watcher's update (Service, EndpointSlice, this Node).
    Api(kube::Update),
    /// A watcher failed; it retries by itself, and what is programmed keeps serving.
    WatchError(&'static str, String),
    /// Time to look at the manifest files again.
    Poll,
    /// The node's devices or addresses changed (a burst of changes is one event).
    NodeChanged,
}

/// What a source of Services has received, and what of it changed since the last sync.
pub trait Tracker {
    /// Takes in an event of its own source (the controller handles the others).
    fn apply(&mut self, event: Event);
    /// When the changes it holds are to be synced; None: nothing to sync yet.
    fn due(&self) -> Option<Instant>;
    /// Whether changes wait to be synced in a way kube-proxy's /healthz counts: from the
    /// first of them, the sync is late once the health timeout has passed.
    fn queued(&self) -> bool;
    /// The node changed in a way every Service's translation depends on.
    fn retranslate_all(&mut self);
    /// The node's addresses as the source states them, when they changed.
    fn take_node_ips(&mut self) -> Option<Vec<IpAddr>> {
        None
    }
    /// Whether the node may take load balancer traffic, when that changed: not while it is
    /// being deleted (a deletionTimestamp, or the cluster autoscaler's
    /// `ToBeDeletedByClusterAutoscaler` taint), as kube-proxy's /healthz says.
    fn take_node_eligible(&mut self) -> Option<bool> {
        None
    }
    /// The changes seen since the last call, as kube-proxy counts them
    /// (`kubeproxy_sync_proxy_rules_*_changes_total` and `_pending`); a source that does not
    /// count them reports none.
    fn take_changes(&mut self) -> Changes {
        Changes::default()
    }
    /// What is to be synced now; `holders` says who serves each frontend, for the sources
    /// that must choose between definitions of one object.
    fn take(&mut self, holders: &dyn Holders) -> Batch<'_>;
    /// Whether syncs after the first come Service by Service (`Batch::owners`), so that the
    /// desired state's index by Service is worth building right after a full sync.
    fn syncs_by_service(&self) -> bool {
        false
    }
}

/// kube-proxy's change counters: changes to Services and to their endpoints (EndpointSlices)
/// the proxy saw since they were last taken, and what waits for a sync: Services with a
/// change of their own (ServiceChangeTracker's items), EndpointSlice changes (kube-proxy's
/// EndpointChangesPending counts changes, not Services).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub services: u64,
    pub endpoints: u64,
    pub services_pending: usize,
    pub endpoints_pending: usize,
}

/// The objects a sync translates, with what the source found wrong in them.
pub struct Batch<'a> {
    /// None: everything the source holds, which replaces the desired state; else only these
    /// Services ("namespace/name"), and `services` and `slices` are theirs.
    pub owners: Option<BTreeSet<String>>,
    pub services: Vec<&'a ParsedService>,
    pub slices: Vec<&'a ParsedSlice>,
    /// Problems found while reading or parsing, reported before the translation's.
    pub errors: Vec<Error>,
    /// The node's topology zone as the source states it.
    pub zone: Option<String>,
    /// When the oldest change of the batch arrived.
    pub since: Instant,
    /// When each changed Service's change happened at its origin, for network programming
    /// latency: only the changes that land have one.
    pub triggers: Vec<(String, Timestamp)>,
    /// How many Services the source marked changed.
    pub changed: usize,
}
