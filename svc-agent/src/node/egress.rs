//! Remote backends' flows that leave by a device without svc's programs.

use std::collections::BTreeMap;

use tracing::warn;

use super::Node;
use crate::metrics::Metrics;

impl Node {
    /// Finds the live SNATed flows (to remote backends) that the node routes out of a device
    /// without svc's programs (not in `--devices`): the backend's replies come back on that
    /// device, where nothing translates them, and the client's connection hangs. Counted per
    /// device for /metrics and /healthz, and warned about once per device in a run.
    /// Cost: the flows come from the walk of SVC_CT this check makes anyway, only SNATed
    /// FORWARD entries are counted (per backend address, no memory per flow), and the kernel
    /// is asked for one route per distinct backend address per check.
    pub fn check_unmanaged_egress(
        &mut self,
        backends: &BTreeMap<[u8; 16], u64>,
        metrics: &Metrics,
    ) {
        let flows: BTreeMap<std::net::IpAddr, u64> = backends
            .iter()
            .map(|(a, n)| (crate::reconcile::ip_from16(*a), *n))
            .collect();
        let mut devices = BTreeMap::new();
        if !flows.is_empty() {
            let query = match crate::netdev::RouteQuery::new() {
                Ok(q) => q,
                Err(e) => {
                    metrics.report_as("netlink", "asking for the routes to remote backends", &e);
                    return;
                }
            };
            let mut failed = None;
            let found = crate::netdev::unmanaged_devices(&flows, &self.view.external, |ip| {
                match query.device(ip) {
                    Ok(d) => d,
                    Err(e) => {
                        failed.get_or_insert(e);
                        None
                    }
                }
            });
            if let Some(e) = failed {
                metrics.report_as("netlink", "asking for the routes to remote backends", &e);
            }
            for (ifindex, n) in found {
                let name =
                    crate::netdev::ifname(ifindex).unwrap_or_else(|| format!("ifindex {ifindex}"));
                devices.insert(name, n);
            }
        }
        for (device, n) in &devices {
            if self.unmanaged_warned.insert(device.clone()) {
                let mut with: Vec<&str> =
                    self.view.external.iter().map(|d| d.name.as_str()).collect();
                with.push(device);
                warn!(
                    device = %device,
                    flows = n,
                    "flows to remote backends leave by {device}, which has no svc programs: their replies return untranslated; add it to --devices (e.g. --devices {})",
                    with.join(",")
                );
            }
        }
        metrics.unmanaged_devices(devices);
    }
}
