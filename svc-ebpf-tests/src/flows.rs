//! Helpers more than one feature's table uses: flows planted or run, fragments, pinning to a CPU.

use crate::prelude::*;

/// A datagram's fragments, as `fragmented` cuts them: the first carries the UDP header and
/// the first 48 bytes of the payload; the later one the rest, from offset 56 (7 units of 8).
pub const FRAG_PAYLOAD: usize = 100;

/// The first fragment of a UDP datagram of `FRAG_PAYLOAD` bytes (IPv4 without DF, as a
/// datagram that had to be fragmented is sent), and its later fragment with the same
/// addresses and id (IPv4 identification 0x1234, IPv6 Fragment id 0x0bad1234).
pub fn fragmented(p: P) -> (P, P) {
    let big = vec![0x5a; FRAG_PAYLOAD];
    let mut first = p.payload(big.clone()).cut(56);
    first.df = false;
    let mut later = P {
        l4: L4::Raw {
            proto: 17,
            bytes: big[48..].to_vec(),
        },
        ..first.clone()
    };
    later.cut = None;
    if first.v6() {
        first.ext = vec![Ext::Frag {
            offset: 0,
            more: true,
        }];
        later.ext = vec![Ext::Frag {
            offset: 7,
            more: false,
        }];
        (first, later)
    } else {
        (first.frag(0, true), later.frag(7, false))
    }
}

/// `fragmented`'s later fragment with another id: a datagram whose first fragment was not
/// seen.
pub fn other_datagram(mut later: P) -> P {
    later.id ^= 0x0101;
    later
}

/// Client `c`'s new flow to NodePort 30080's local backend.
pub fn new_local_flow(dp: &Dp, c: &str) {
    run_rows(
        dp,
        vec![row(
            "a new flow to the local backend",
            ExtIngress,
            tcp(c, "192.0.2.10:30080", TCP_SYN),
            OK,
            Packet(tcp(c, "10.244.1.5:8080", TCP_SYN)),
            Some(Reason::New),
        )],
    );
}

/// Stamps both entries of the flow of FORWARD entry `fkey` last seen at `ns`.
pub fn stamp_flow(dp: &mut Dp, fkey: &CtKey, ns: u64) {
    let fwd = dp.ct_entry(fkey).expect("the flow's FORWARD entry");
    for key in [*fkey, fkey.partner(&fwd)] {
        let mut e = dp.ct_entry(&key).expect("both entries of the flow");
        e.last_seen_ns = ns;
        dp.ct_put(key, e);
    }
}

/// A router's fragmentation needed (MTU 1400) about the reply of client `c`'s flow through
/// NodePort 30080 to the local backend 10.244.1.5:8080, as the reply left (from the NodePort):
/// the external ingress sends it on to the backend, about the backend's own segment.
pub fn frag_needed_about_local_reply(what: &'static str, c: &str) -> Row {
    let mtu = 1400u32.to_be_bytes();
    let reply = tcp("192.0.2.10:30080", c, TCP_ACK).ttl(63);
    let reply_was = tcp("10.244.1.5:8080", c, TCP_ACK).ttl(63);
    row(
        what,
        ExtIngress,
        icmp_error("192.0.2.1", "192.0.2.10", 3, 4, mtu, &reply, 40),
        OK,
        Packet(icmp_error(
            "192.0.2.1",
            "10.244.1.5",
            3,
            4,
            mtu,
            &reply_was,
            40,
        )),
        Some(Reason::IcmpError),
    )
}

/// Keeps the calling thread on the CPU it runs on until dropped: per-CPU state that one
/// program run leaves for the next is then the same CPU's.
pub struct OnThisCpu {
    pub before: libc::cpu_set_t,
}

pub fn stay_on_this_cpu() -> OnThisCpu {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    let err = std::io::Error::last_os_error;
    // SAFETY: plain libc calls on cpu_set_t values of the size given, for the calling thread.
    unsafe {
        let mut before: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, size, &mut before),
            0,
            "{}",
            err()
        );
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0, "sched_getcpu: {}", err());
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        assert_eq!(libc::sched_setaffinity(0, size, &set), 0, "{}", err());
        OnThisCpu { before }
    }
}

impl Drop for OnThisCpu {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.before) };
    }
}

/// The number of connection-tracking entries.
pub fn ct_entries(dp: &Dp) -> usize {
    dp.ct_all().len()
}
