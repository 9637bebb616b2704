//! kube-proxy's rules: Services and EndpointSlices to the desired state. (Placeholder.)

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::error::Error;
use crate::model::DesiredState;

#[derive(Clone, Debug, Default)]
pub struct NodeContext {
    pub node_name: Option<String>,
    pub zone: Option<String>,
}

pub struct Translated {
    pub state: DesiredState,
    pub errors: Vec<Error>,
}

pub fn translate(
    _services: &[Service],
    _slices: &[EndpointSlice],
    _node: &NodeContext,
) -> Translated {
    Translated {
        state: DesiredState::default(),
        errors: vec![],
    }
}
