//! svc agent: turns Services and EndpointSlices into the BPF maps of the socket datapath.

pub mod agent;
pub mod controller;
pub mod datapath;
pub mod desired;
pub mod error;
pub mod fault;
pub mod handover;
pub mod healthcheck;
pub mod http;
pub mod list;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod names;
pub mod netdev;
pub mod packet;
pub mod retry;
pub mod source;
pub mod stale;
pub mod store;
pub mod sweep;
pub mod sync;
pub mod sys;
pub mod translate;
pub mod verify;

pub use error::{Error, Result};
