//! svc agent: turns Services and EndpointSlices into the BPF maps of the socket datapath.

pub mod error;
pub mod model;
pub mod source;
pub mod translate;

pub use error::{Error, Result};
