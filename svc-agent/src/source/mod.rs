//! Where Services and EndpointSlices come from.

pub mod kube;
pub mod manifest;
