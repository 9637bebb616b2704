//! SVC_NODE_ADDRS: the addresses the external ingress looks at. A packet to any other
//! address passes it after one small lookup, without the connection-tracking and frontend
//! lookups, so the map must hold every address a flow or a frontend of svc is addressed to:
//! - the node's addresses (`node_addr_flags::OF_NODE`), as the node sync reads them;
//! - the address of every programmed EXTERNAL frontend but the NodePort wildcard (ExternalIPs,
//!   LoadBalancer IPs: `EXTERNAL`), written before the frontend's master entry, so its first
//!   packet is looked at;
//! - an address that was one of those and is no more (`LINGER`): svc goes on translating an
//!   established flow after its Service or node address is gone, as conntrack does under
//!   kube-proxy, so the address stays until a walk of the connection-tracking map finds no
//!   live flow to it (`check_flow_addrs`, which also puts back an address a flow goes to that
//!   the map lacks). Nothing else deletes an entry.

use std::collections::BTreeSet;

use svc_common::{node_addr_flags, NodeAddrValue};

use super::{addr16, ip_from16, name_object, Programmed, Writer};
use crate::error::Error;
use crate::model::{Frontend, Scope};
use crate::store::{Op, Store};

/// The address `fe` puts in NODE_ADDRS by itself: an external frontend's own address.
pub fn external_addr(fe: &Frontend) -> Option<[u8; 16]> {
    (fe.scope == Scope::External && !fe.ip.is_unspecified()).then(|| addr16(fe.ip))
}

/// What one check of NODE_ADDRS against the live flows did.
#[derive(Debug, Default)]
pub struct FlowAddrsReport {
    /// Addresses live flows go to that NODE_ADDRS lacked, put back as lingering.
    pub added: usize,
    /// Lingering addresses no live flow was addressed to, deleted.
    pub deleted: usize,
    /// Lingering addresses kept for the live flows addressed to them.
    pub kept: usize,
    pub errors: Vec<Error>,
    /// Live SNATed flows per backend address (`FlowWalk::snat_backends`), from the same walk;
    /// None when the map could not be walked.
    pub snat_backends: Option<std::collections::BTreeMap<[u8; 16], u64>>,
}

impl Programmed {
    /// Brings address `k`'s entry to the value `plan::addr_target` gives it.
    pub(super) fn write_addr<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        k: [u8; 16],
        external: bool,
        errors: &mut Vec<Error>,
    ) {
        let target = super::plan::addr_target(
            &self.node_want,
            &self.external_refs,
            &self.node_addrs,
            &k,
            external,
        );
        let Some(v) = target else {
            return;
        };
        if self.node_addrs.get(&k) == Some(&v) {
            return;
        }
        self.put_addr(w, k, v, errors);
    }

    /// Puts `k` with `v` in NODE_ADDRS and the mirror, a new address only while the map has
    /// room; false, with the error, when it did not.
    pub(super) fn put_addr<S: Store>(
        &mut self,
        w: &mut Writer<'_, S>,
        k: [u8; 16],
        v: NodeAddrValue,
        errors: &mut Vec<Error>,
    ) -> bool {
        let object = describe(k, v.flags);
        let new = !self.node_addrs.contains_key(&k);
        if new && self.usage.node_addrs >= u64::from(self.capacity.node_addrs) {
            errors.push(Error::MapFull {
                map: svc_common::map_names::NODE_ADDRS,
                capacity: self.capacity.node_addrs,
                object,
            });
            return false;
        }
        match w.op(&Op::PutNodeAddr(k, v)) {
            Ok(_) => {
                if new {
                    self.usage.node_addrs += 1;
                }
                self.node_addrs.insert(k, v);
                true
            }
            Err(e) => {
                errors.push(name_object(e, &object));
                false
            }
        }
    }

    /// The addresses that are in NODE_ADDRS only for flows that may still go to them.
    pub fn lingering(&self) -> BTreeSet<[u8; 16]> {
        self.node_addrs
            .iter()
            .filter(|(_, v)| v.flags == node_addr_flags::LINGER)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Walks the connection-tracking map once and brings the lingering addresses to the live
    /// flows: an address a flow goes to that NODE_ADDRS lacks (the state of an agent from
    /// before this rule, or an entry someone deleted) is put back as `LINGER`; a lingering
    /// address no live flow goes to any more is deleted. A lingering address has no programmed
    /// frontend and answers no NodePort, so no new flow is made to one the walk does not find
    /// (one still wanted, whose flag update failed, is kept). Run before the agent first attaches its programs, and at every drift
    /// check.
    pub fn check_flow_addrs<S: Store>(&mut self, store: &mut S) -> FlowAddrsReport {
        let mut report = FlowAddrsReport::default();
        let config = self.config.unwrap_or_default();
        let walk = match store.flow_destinations(&config) {
            Ok(Some(u)) => u,
            Ok(None) => return report,
            Err(e) => {
                report.errors.push(e);
                return report;
            }
        };
        let used = walk.destinations;
        report.snat_backends = Some(walk.snat_backends);
        let mut w = Writer { store, ops: 0 };
        self.clear_snat_range_mark(&mut w, walk.snat_range_ports, &mut report.errors);
        let linger = NodeAddrValue {
            flags: node_addr_flags::LINGER,
            ifindex: 0,
        };
        let missing: Vec<[u8; 16]> = used
            .iter()
            .filter(|k| !self.node_addrs.contains_key(*k))
            .copied()
            .collect();
        for k in missing {
            if self.put_addr(&mut w, k, linger, &mut report.errors) {
                report.added += 1;
            }
        }
        for k in self.lingering() {
            // A write that would have taken it out of LINGER may have failed: it is wanted.
            let wanted = self.node_want.contains_key(&k) || self.external_refs.contains_key(&k);
            if used.contains(&k) || wanted {
                report.kept += 1;
                continue;
            }
            match w.op(&Op::DelNodeAddr(k)) {
                Ok(found) => {
                    self.node_addrs.remove(&k);
                    if found {
                        self.usage.node_addrs = self.usage.node_addrs.saturating_sub(1);
                    }
                    report.deleted += 1;
                }
                Err(e) => report
                    .errors
                    .push(name_object(e, &describe(k, linger.flags))),
            }
        }
        report
    }
}

/// How an error names address `k` with `flags`.
fn describe(k: [u8; 16], flags: u32) -> String {
    let ip = ip_from16(k);
    if flags & node_addr_flags::OF_NODE != 0 {
        format!("node address {ip}")
    } else if flags & node_addr_flags::EXTERNAL != 0 {
        format!("external frontend address {ip}")
    } else {
        format!("lingering address {ip}")
    }
}
