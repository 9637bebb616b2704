//! Crafted TCP segments and IPv4 fragments, as an attacker outside the cluster sends them: any
//! source address (spoofed), any sequence number and flags, written whole (IPv4 header
//! included) to a raw socket. Tests open the socket inside a network namespace of their own and spoof only
//! addresses of the test's own ranges.
//!
//! Hand-written rather than a packet crate: an IPv4 header and a TCP header with their two
//! checksums are all it takes, and the fixture tests keep their own independent builder.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

/// What a segment carries in its TCP checksum field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// The right sum.
    Right,
    /// The right sum plus one: a corrupted or forged segment.
    Wrong,
    /// 0, which is not the right sum (a segment whose right sum is 0 cannot be built so).
    Zero,
}

/// One TCP segment in an IPv4 packet.
#[derive(Clone, Debug)]
pub struct Segment {
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    pub window: u16,
    pub payload: Vec<u8>,
    pub check: Check,
}

impl Segment {
    pub fn new(src: SocketAddrV4, dst: SocketAddrV4, flags: u8, seq: u32, ack: u32) -> Segment {
        Segment {
            src,
            dst,
            seq,
            ack,
            flags,
            window: 64240,
            payload: Vec::new(),
            check: Check::Right,
        }
    }

    /// The same segment with `check` in its TCP checksum field.
    pub fn check(mut self, check: Check) -> Segment {
        self.check = check;
        self
    }

    /// The IPv4 packet, its checksums right unless `check` says otherwise.
    pub fn bytes(&self) -> Vec<u8> {
        let mut tcp = Vec::with_capacity(20 + self.payload.len());
        tcp.extend_from_slice(&self.src.port().to_be_bytes());
        tcp.extend_from_slice(&self.dst.port().to_be_bytes());
        tcp.extend_from_slice(&self.seq.to_be_bytes());
        tcp.extend_from_slice(&self.ack.to_be_bytes());
        tcp.extend_from_slice(&[5 << 4, self.flags]);
        tcp.extend_from_slice(&self.window.to_be_bytes());
        tcp.extend_from_slice(&[0, 0, 0, 0]);
        tcp.extend_from_slice(&self.payload);
        let mut pseudo = Vec::with_capacity(12);
        pseudo.extend_from_slice(&self.src.ip().octets());
        pseudo.extend_from_slice(&self.dst.ip().octets());
        pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8]);
        pseudo.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
        let right = checksum(&[&pseudo, &tcp]);
        let c = match self.check {
            Check::Right => right,
            Check::Wrong => right.wrapping_add(1),
            Check::Zero => {
                assert_ne!(right, 0, "{self:?}: its right checksum is 0");
                0
            }
        };
        tcp[16..18].copy_from_slice(&c.to_be_bytes());

        let mut ip = vec![0x45, 0];
        ip.extend_from_slice(&((20 + tcp.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&[0, 0, 0x40, 0, 64, libc::IPPROTO_TCP as u8, 0, 0]);
        ip.extend_from_slice(&self.src.ip().octets());
        ip.extend_from_slice(&self.dst.ip().octets());
        let c = checksum(&[&ip]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        ip.extend_from_slice(&tcp);
        ip
    }
}

/// An IPv4 fragment from `src` to `dst` of a datagram of protocol `proto` with identification
/// `id`: `data` at `offset` bytes into the datagram (a multiple of 8), more to come or not.
/// Only the IPv4 header's checksum is right; what `data` holds is the caller's.
pub fn ipv4_fragment(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    id: u16,
    offset: u16,
    more: bool,
    data: &[u8],
) -> Vec<u8> {
    assert_eq!(offset % 8, 0, "a fragment offset is in 8-byte units");
    let flags = (offset / 8) | if more { 0x2000 } else { 0 };
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + data.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&id.to_be_bytes());
    ip.extend_from_slice(&flags.to_be_bytes());
    ip.extend_from_slice(&[64, proto, 0, 0]);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend_from_slice(data);
    ip
}

/// RFC 1071 over the concatenation of `parts` (each of even length but the last).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        for c in part.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A raw IPv4 socket whose packets are sent as written (IP_HDRINCL), source included. Opened
/// in the calling thread's network namespace.
pub struct Sender {
    fd: OwnedFd,
}

impl Sender {
    pub fn new() -> io::Result<Sender> {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to us.
        Ok(Sender {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn send(&self, s: &Segment) -> io::Result<()> {
        self.send_packet(*s.dst.ip(), &s.bytes())
    }

    /// Sends the IPv4 packet `bytes` (header included) to `dst`.
    pub fn send_packet(&self, dst: Ipv4Addr, bytes: &[u8]) -> io::Result<()> {
        // SAFETY: a zeroed sockaddr_in, filled below.
        let mut to: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        to.sin_family = libc::AF_INET as libc::sa_family_t;
        to.sin_addr.s_addr = u32::from_ne_bytes(dst.octets());
        // SAFETY: a valid buffer and address of the sizes given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
