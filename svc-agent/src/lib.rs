//! svc agent: turns Services and EndpointSlices into the BPF maps of the socket datapath.

pub mod agent;
pub mod controller;
pub mod datapath;
pub mod desired;
pub mod error;
pub mod explain;
pub mod fault;
pub mod features;
pub mod handover;
pub mod http;
pub mod kubeproxy_config;
pub mod list;
pub mod logging;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod monitor;
pub mod names;
pub mod netdev;
pub mod netlink;
pub mod node;
pub mod packet;
pub mod reconcile;
pub mod retry;
pub mod source;
pub mod store;
pub mod sys;
pub mod tasks;
pub mod translate;
pub mod verify;

pub use error::{Error, Result};

/// `svc-agent --version`: the release and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SVC_GIT_COMMIT"),
    ")"
);
