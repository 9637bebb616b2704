//! Privileged test harness for svc: network namespaces, a test cgroup, probe processes that
//! run inside both, the agent as a child process, a private bpffs directory and Kubernetes
//! manifests on disk.
//!
//! Every resource is a guard that removes itself on drop, so a failing or panicking test
//! leaves nothing behind. Names carry the process id and a counter, so tests in one binary
//! (threads) and in several binaries (processes) never share a namespace, cgroup or pin
//! directory. Declare guards in the order they depend on each other (sandbox first, then
//! bpffs, then agent): locals drop in reverse order, so the agent stops before its pins are
//! removed and those before the cgroup goes.

pub mod agent;
pub mod bulk;
pub mod cgroup;
pub mod control_plane;
pub mod interrupt;
pub mod kube_proxy;
pub mod manifest;
pub mod memcg;
pub mod netns;
pub mod parity;
pub mod pins;
#[cfg(feature = "charts")]
pub use svc_charts as plot;
pub mod probe;
pub mod procs;
pub mod profile;
pub mod raw;
pub mod report;
pub mod rng;
pub mod sandbox;
pub mod scale;
pub mod sys;
pub mod topology;
pub mod xdp;

pub use agent::{Agent, Bpffs, ListOutput, ListService};
pub use cgroup::TestCgroup;
pub use manifest::{Endpoint, EndpointSlice, Manifests, Service, ServicePort, SlicePort};
pub use netns::NetNs;
pub use probe::{Attempt, LoopReport, Report, StreamExchange, StreamReport};
pub use procs::{Backend, ClientRun};
pub use sandbox::Sandbox;
pub use sys::{require_root, TempDir, Tools};
