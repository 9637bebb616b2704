//! The network the programs see: a namespace of the test thread's own, and the object.

use std::path::PathBuf;
use std::process::Command;

use crate::prelude::*;

/// ext0: the node's uplink. The node is 192.0.2.10 / 2001:db8::10; the gateway to clients
/// (203.0.113.0/24, 2001:db8:c::/64 and the rest) is 192.0.2.1 / 2001:db8::1; node 2
/// (192.0.2.20 / 2001:db8::20) routes the remote pods 10.244.2.0/24 / fd00:244:2::/64.
pub const EXT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x0a];
pub const GW_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x01];
pub const NODE2_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x14];
/// ext1: a small-MTU link (1280) to 10.244.3.0/24 / fd00:244:3::/64 via 192.0.2.30-like
/// neighbours 198.18.0.1 / 2001:db8:1::1.
pub const EXT1_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x0b];
pub const SMALL_GW_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0x21];
/// pod0: the host side of a local pod's veth (the pod: 10.244.1.5 / fd00:244:1::5).
pub const POD_HOST_MAC: [u8; 6] = [2, 0, 0, 0, 1, 0];
pub const POD_MAC: [u8; 6] = [2, 0, 0, 0, 1, 5];

pub const NETWORK: &str = "
set -e
ip link set lo up
ip link add ext0 address 02:00:00:00:00:0a type veth peer name ext0p address 02:00:00:00:00:fe
ip link add ext1 address 02:00:00:00:00:0b mtu 1280 type veth peer name ext1p mtu 1280
ip link add pod0 address 02:00:00:00:01:00 type veth peer name pod0p address 02:00:00:00:01:05
for d in ext0 ext0p ext1 ext1p pod0 pod0p; do ip link set $d up; done
ip addr add 192.0.2.10/24 dev ext0
ip -6 addr add 2001:db8::10/64 dev ext0 nodad
ip addr add 198.18.0.10/24 dev ext1
ip -6 addr add 2001:db8:1::10/64 dev ext1 nodad
ip neigh add 192.0.2.1 lladdr 02:00:00:00:00:01 dev ext0 nud permanent
ip neigh add 192.0.2.20 lladdr 02:00:00:00:00:14 dev ext0 nud permanent
ip -6 neigh add 2001:db8::1 lladdr 02:00:00:00:00:01 dev ext0 nud permanent
ip -6 neigh add 2001:db8::20 lladdr 02:00:00:00:00:14 dev ext0 nud permanent
ip neigh add 198.18.0.1 lladdr 02:00:00:00:00:21 dev ext1 nud permanent
ip -6 neigh add 2001:db8:1::1 lladdr 02:00:00:00:00:21 dev ext1 nud permanent
ip route add default via 192.0.2.1
ip -6 route add default via 2001:db8::1
ip route add 10.244.2.0/24 via 192.0.2.20
ip -6 route add fd00:244:2::/64 via 2001:db8::20
ip route add 10.244.3.0/24 via 198.18.0.1
ip -6 route add fd00:244:3::/64 via 2001:db8:1::1
ip route add 10.244.1.0/24 dev pod0
ip -6 route add fd00:244:1::/64 dev pod0
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/ipv6/conf/all/forwarding
";

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "BPF_PROG_TEST_RUN and network namespaces need root: run as root"
    );
}

/// Moves this thread into a new network namespace holding `NETWORK`.
pub fn private_network() {
    // SAFETY: affects the calling thread only; the test's own thread.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(
        r,
        0,
        "unshare(CLONE_NEWNET): {}",
        std::io::Error::last_os_error()
    );
    // Children inherit the namespace of the thread that spawns them.
    let out = Command::new("sh")
        .args(["-c", NETWORK])
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "setting up the test network: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn ifindex(name: &str) -> u32 {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: a NUL-terminated name.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(i, 0, "{name}");
    i
}

pub fn object() -> Vec<u8> {
    let path = std::env::var_os("SVC_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/bpfel-unknown-none/release/svc")
        });
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "the eBPF object {} is missing ({e}): run `cargo xtask build-ebpf`",
            path.display()
        )
    })
}

pub fn addr16(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => svc_common::v4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

pub fn ip16(s: &str) -> [u8; 16] {
    addr16(s.parse().unwrap_or_else(|e| panic!("{s}: {e}")))
}
