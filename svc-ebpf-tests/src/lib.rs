//! The harness of the packet fixture tables for the tc programs of the packet datapath
//! (svc-ebpf/src/tc.rs) through BPF_PROG_TEST_RUN: each row is an input packet (built here,
//! checksums computed independently of the kernel code), run through one program against the
//! map state the test programmed (and the flows earlier rows created); the verdict, the output
//! packet (byte for byte, and its checksums verified on their own) and the per-device counter
//! the row should move are checked. The tables are in `tests/fixtures/`, one file per feature.
//!
//! The programs are the agent's own (the `svc` object), loaded but never attached. They are
//! loaded and verified once per test running at the same time, not once per test: a test takes
//! a loaded object from a pool, every map is put back as loaded (hash maps emptied, arrays to
//! their first contents) before its first row, and the object goes back to the pool when the
//! test's `Dp` drops. Run the binary as one process (`cargo test`, as `cargo xtask test` does):
//! one process per test loads the object in each.
//!
//! Route lookups (bpf_fib_lookup) must answer the same on every machine, so each test first
//! moves its thread into a network namespace of its own (unshare(CLONE_NEWNET)) with a few
//! veth devices, addresses, routes and permanent neighbours: no traffic is sent, and nothing
//! of the machine's own network is seen or touched. The namespace goes with the thread.
//!
//! Needs root (bpf(2), CAP_NET_ADMIN in the namespace) and the object built by
//! `cargo xtask build-ebpf` (or `$SVC_EBPF_OBJECT`).

pub mod datapath;
pub mod flows;
pub mod netns;
pub mod packet;
mod reset;
pub mod rows;
pub mod world;

/// What a table reads with: the harness, and the datapath's types and numbers.
pub mod prelude {
    pub use std::collections::BTreeMap;
    pub use std::net::{IpAddr, SocketAddr};
    pub use std::time::{Duration, Instant};

    pub use svc_common::{
        backend_flags, ct_dir, ct_flags, ct_timeout, maglev_flow_hash, map_names, node_addr_flags,
        scope, svc_flags, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendId, CtKey,
        CtValue, DatapathConfig, DevStatKey, MaglevBlock, MaglevIndex, NodeAddrValue, Reason,
        ServiceKey, ServiceValue, SlotKey, AFFINITY_CLIENT_IP, IPPROTO_TCP, IPPROTO_UDP,
        MAGLEV_BLOCK, MAGLEV_PAGE, PROTO_ANY,
    };

    pub use crate::datapath::*;
    pub use crate::flows::*;
    pub use crate::netns::*;
    pub use crate::packet::*;
    pub use crate::rows::*;
    pub use crate::world::*;
    pub use svc_agent::features::Fit;
}
