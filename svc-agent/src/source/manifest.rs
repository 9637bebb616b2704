//! Services and EndpointSlices from YAML manifest files.
