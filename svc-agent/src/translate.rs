//! kube-proxy's rules: Services and EndpointSlices to the desired state.
