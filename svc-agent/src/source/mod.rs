//! Where Services and EndpointSlices come from.

pub mod manifest;
