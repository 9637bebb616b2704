//! Test packets built from scratch: Ethernet, IPv4 (options, fragments), IPv6 (extension
//! headers), TCP, UDP, ICMP(v6), with checksums computed independently of the kernel code.

use crate::prelude::*;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

/// Checksums from scratch (RFC 1071), big-endian words.
pub fn sum16(data: &[u8], mut sum: u64) -> u64 {
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += w as u64;
    }
    sum
}

pub fn finish(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

pub fn pseudo(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u64 {
    let mut b = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            b.extend_from_slice(&s.octets());
            b.extend_from_slice(&d.octets());
            b.extend_from_slice(&[0, proto]);
            b.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            b.extend_from_slice(&s.octets());
            b.extend_from_slice(&d.octets());
            b.extend_from_slice(&(len as u32).to_be_bytes());
            b.extend_from_slice(&[0, 0, 0, proto]);
        }
        _ => panic!("mixed families"),
    }
    sum16(&b, 0)
}

#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        seq: u32,
        ack: u32,
        flags: u8,
        win: u16,
        payload: Vec<u8>,
    },
    /// `no_csum`: an IPv4 datagram sent without a checksum (0).
    Udp {
        sport: u16,
        dport: u16,
        payload: Vec<u8>,
        no_csum: bool,
    },
    /// ICMP (IPv4) or ICMPv6, by the packet's family.
    Icmp {
        typ: u8,
        code: u8,
        rest: [u8; 4],
        body: Vec<u8>,
    },
    /// Bytes after the IP header as they are (a later fragment, a protocol we do not parse).
    Raw { proto: u8, bytes: Vec<u8> },
}

/// IPv6 extension headers.
#[derive(Clone, Debug)]
pub enum Ext {
    /// Hop-by-hop (0) or destination options (60) of `len` bytes (a multiple of 8), PadN.
    Opts(u8, usize),
    /// A fragment header.
    Frag { offset: u16, more: bool },
}

#[derive(Clone, Debug)]
pub struct P {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub ttl: u8,
    pub id: u16,
    pub df: bool,
    /// IPv4 fragment: offset (8-byte units) and more-fragments.
    pub frag: Option<(u16, bool)>,
    /// A fragment carries only the first `cut` bytes of its transport data.
    pub cut: Option<usize>,
    /// IPv4 options (a multiple of 4 bytes).
    pub options: Vec<u8>,
    pub ext: Vec<Ext>,
    pub l4: L4,
    /// TCP: the checksum field as a sender may leave it, instead of the right sum.
    pub tcp_check: Option<Check>,
}

/// A TCP checksum field other than the right sum.
#[derive(Clone, Copy, Debug)]
pub enum Check {
    /// The right sum plus one.
    Wrong,
    /// 0 (the right sum is not 0: asserted).
    Zero,
    /// What a local sender leaves for the device to finish (CHECKSUM_PARTIAL): the folded sum
    /// of the pseudo-header, not complemented.
    Partial,
}

pub fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

impl P {
    pub fn new(src: &str, dst: &str, l4: L4) -> P {
        let (s, d) = (sa(src), sa(dst));
        let mut l4 = l4;
        match &mut l4 {
            L4::Tcp { sport, dport, .. } | L4::Udp { sport, dport, .. } => {
                *sport = s.port();
                *dport = d.port();
            }
            _ => {}
        }
        P {
            dmac: EXT_MAC,
            smac: GW_MAC,
            src: s.ip(),
            dst: d.ip(),
            ttl: 64,
            id: 0x1234,
            df: true,
            frag: None,
            cut: None,
            options: vec![],
            ext: vec![],
            l4,
            tcp_check: None,
        }
    }

    pub fn check(mut self, c: Check) -> P {
        self.tcp_check = Some(c);
        self
    }

    pub fn v6(&self) -> bool {
        self.src.is_ipv6()
    }

    pub fn macs(mut self, dmac: [u8; 6], smac: [u8; 6]) -> P {
        self.dmac = dmac;
        self.smac = smac;
        self
    }

    pub fn ttl(mut self, ttl: u8) -> P {
        self.ttl = ttl;
        self
    }

    /// IPv4 identification and DF, as an answer the programs build has them (0, no DF).
    pub fn fresh_ip(mut self) -> P {
        self.id = 0;
        self.df = false;
        self
    }

    pub fn options(mut self, o: &[u8]) -> P {
        self.options = o.to_vec();
        self
    }

    pub fn ext(mut self, e: Vec<Ext>) -> P {
        self.ext = e;
        self
    }

    pub fn frag(mut self, offset: u16, more: bool) -> P {
        self.frag = Some((offset, more));
        self
    }

    pub fn cut(mut self, n: usize) -> P {
        self.cut = Some(n);
        self
    }

    pub fn no_csum(mut self) -> P {
        if let L4::Udp { no_csum, .. } = &mut self.l4 {
            *no_csum = true;
        }
        self
    }

    pub fn payload(mut self, data: Vec<u8>) -> P {
        match &mut self.l4 {
            L4::Tcp { payload, .. } | L4::Udp { payload, .. } => *payload = data,
            _ => panic!("no payload"),
        }
        self
    }

    /// TCP sequence and acknowledgment numbers, flags and window.
    pub fn seg(mut self, s: u32, a: u32, f: u8, w: u16) -> P {
        if let L4::Tcp {
            seq,
            ack,
            flags,
            win,
            ..
        } = &mut self.l4
        {
            (*seq, *ack, *flags, *win) = (s, a, f, w);
        }
        self
    }

    pub fn proto(&self) -> u8 {
        match &self.l4 {
            L4::Tcp { .. } => 6,
            L4::Udp { .. } => 17,
            L4::Icmp { .. } => {
                if self.v6() {
                    58
                } else {
                    1
                }
            }
            L4::Raw { proto, .. } => *proto,
        }
    }

    pub fn l4_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match &self.l4 {
            L4::Tcp {
                sport,
                dport,
                seq,
                ack,
                flags,
                win,
                payload,
            } => {
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(&ack.to_be_bytes());
                b.extend_from_slice(&[5 << 4, *flags]);
                b.extend_from_slice(&win.to_be_bytes());
                b.extend_from_slice(&[0, 0, 0, 0]);
                b.extend_from_slice(payload);
                let seed = pseudo(self.src, self.dst, 6, b.len());
                let right = finish(sum16(&b, seed));
                let c = match self.tcp_check {
                    None => right,
                    Some(Check::Wrong) => right.wrapping_add(1),
                    Some(Check::Zero) => {
                        assert_ne!(right, 0, "a segment whose right checksum is 0");
                        0
                    }
                    Some(Check::Partial) => !finish(seed),
                };
                b[16..18].copy_from_slice(&c.to_be_bytes());
            }
            L4::Udp {
                sport,
                dport,
                payload,
                no_csum,
            } => {
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                b.extend_from_slice(&[0, 0]);
                b.extend_from_slice(payload);
                if !no_csum {
                    let mut c = finish(sum16(&b, pseudo(self.src, self.dst, 17, b.len())));
                    if c == 0 {
                        c = 0xffff;
                    }
                    b[6..8].copy_from_slice(&c.to_be_bytes());
                }
            }
            L4::Icmp {
                typ,
                code,
                rest,
                body,
            } => {
                b.extend_from_slice(&[*typ, *code, 0, 0]);
                b.extend_from_slice(rest);
                b.extend_from_slice(body);
                let seed = if self.v6() {
                    pseudo(self.src, self.dst, 58, b.len())
                } else {
                    0
                };
                let c = finish(sum16(&b, seed));
                b[2..4].copy_from_slice(&c.to_be_bytes());
            }
            L4::Raw { bytes, .. } => b.extend_from_slice(bytes),
        }
        if let Some(n) = self.cut {
            b.truncate(n);
        }
        b
    }

    /// The IP packet (no Ethernet header).
    pub fn ip_bytes(&self) -> Vec<u8> {
        let l4 = self.l4_bytes();
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let ihl = 20 + self.options.len();
                let mut h = vec![(4 << 4) | (ihl / 4) as u8, 0];
                h.extend_from_slice(&((ihl + l4.len()) as u16).to_be_bytes());
                h.extend_from_slice(&self.id.to_be_bytes());
                let (off, more) = self.frag.unwrap_or((0, false));
                let flags = off | if self.df { 0x4000 } else { 0 } | if more { 0x2000 } else { 0 };
                h.extend_from_slice(&flags.to_be_bytes());
                h.extend_from_slice(&[self.ttl, self.proto(), 0, 0]);
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                h.extend_from_slice(&self.options);
                let c = finish(sum16(&h, 0));
                h[10..12].copy_from_slice(&c.to_be_bytes());
                h.extend_from_slice(&l4);
                h
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut ext = Vec::new();
                for (i, e) in self.ext.iter().enumerate() {
                    let next = match self.ext.get(i + 1) {
                        Some(Ext::Opts(t, _)) => *t,
                        Some(Ext::Frag { .. }) => 44,
                        None => self.proto(),
                    };
                    match e {
                        Ext::Opts(_, len) => {
                            let mut b = vec![next, (len / 8 - 1) as u8, 1, (len - 4) as u8];
                            b.resize(*len, 0);
                            ext.extend_from_slice(&b);
                        }
                        Ext::Frag { offset, more } => {
                            ext.extend_from_slice(&[next, 0]);
                            ext.extend_from_slice(&((offset << 3) | *more as u16).to_be_bytes());
                            // Its id from the IPv4 field's: one knob for both families.
                            ext.extend_from_slice(&(0x0bad_0000 | self.id as u32).to_be_bytes());
                        }
                    }
                }
                let first = match self.ext.first() {
                    Some(Ext::Opts(t, _)) => *t,
                    Some(Ext::Frag { .. }) => 44,
                    None => self.proto(),
                };
                let mut h = vec![0x60, 0, 0, 0];
                h.extend_from_slice(&((ext.len() + l4.len()) as u16).to_be_bytes());
                h.extend_from_slice(&[first, self.ttl]);
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                h.extend_from_slice(&ext);
                h.extend_from_slice(&l4);
                h
            }
            _ => panic!("mixed families"),
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.dmac);
        b.extend_from_slice(&self.smac);
        b.extend_from_slice(if self.v6() {
            &[0x86, 0xdd]
        } else {
            &[0x08, 0x00]
        });
        b.extend_from_slice(&self.ip_bytes());
        b
    }
}

pub fn tcp(src: &str, dst: &str, flags: u8) -> P {
    P::new(
        src,
        dst,
        L4::Tcp {
            sport: 0,
            dport: 0,
            seq: 1000,
            // Every segment starts at 1000 and acknowledges 1001, either way: a SYN's
            // acknowledgment (the client's is 1000 + 1, as a SYN counts one), and within
            // the window of what each side was seen to send, as the datapath tracks it.
            ack: if flags & TCP_ACK != 0 { 1001 } else { 0 },
            flags,
            win: 64240,
            payload: if flags & TCP_SYN != 0 {
                vec![]
            } else {
                b"GET / HTTP/1.1\r\n".to_vec()
            },
        },
    )
}

pub fn udp(src: &str, dst: &str) -> P {
    P::new(
        src,
        dst,
        L4::Udp {
            sport: 0,
            dport: 0,
            payload: b"a datagram".to_vec(),
            no_csum: false,
        },
    )
}

/// An ICMP (or ICMPv6) error from `src` to `dst` quoting `quoted` (its first `n` bytes).
pub fn icmp_error(
    src: &str,
    dst: &str,
    typ: u8,
    code: u8,
    rest: [u8; 4],
    quoted: &P,
    n: usize,
) -> P {
    let mut body = quoted.ip_bytes();
    body.truncate(n);
    // Port 0: ICMP has none; IPv6 addresses need brackets to be read as socket addresses.
    let at = |a: &str| {
        if a.contains(':') {
            format!("[{a}]:0")
        } else {
            format!("{a}:0")
        }
    };
    P::new(
        &at(src),
        &at(dst),
        L4::Icmp {
            typ,
            code,
            rest,
            body,
        },
    )
}

/// Verifies every checksum of a packet on its own: IPv4 header, TCP/UDP/ICMP(v6) (unless a
/// fragment), and inside an ICMP error the quoted IPv4 header. etherparse reads and sums
/// it, so a mistake in this file's builder cannot hide the same mistake in what the programs
/// wrote; a packet it cannot read is an error too.
pub fn verify_checksums(b: &[u8]) -> Result<(), String> {
    use etherparse::{Icmpv4Type, Ipv4HeaderSlice, NetSlice, SlicedPacket, TransportSlice};
    if b.len() < 14 || !matches!(u16::from_be_bytes([b[12], b[13]]), 0x0800 | 0x86dd) {
        return Ok(());
    }
    let p = SlicedPacket::from_ethernet(b).map_err(|e| format!("packet ({e})"))?;
    let (src, dst, fragmented): ([u8; 16], [u8; 16], bool) = match &p.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header();
            if h.to_header().calc_header_checksum() != h.header_checksum() {
                return Err("IPv4 header checksum".into());
            }
            let mapped = |a: [u8; 4]| std::net::Ipv4Addr::from(a).to_ipv6_mapped().octets();
            (
                mapped(h.source()),
                mapped(h.destination()),
                ip.payload().fragmented,
            )
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header();
            (h.source(), h.destination(), ip.payload().fragmented)
        }
        _ => return Ok(()),
    };
    if fragmented {
        return Ok(());
    }
    let v4 = |a: [u8; 16]| -> [u8; 4] { a[12..].try_into().expect("16 bytes") };
    let is_v4 = matches!(p.net, Some(NetSlice::Ipv4(_)));
    let bad = |what: &str| Err(format!("{what} checksum"));
    match &p.transport {
        Some(TransportSlice::Tcp(t)) => {
            let sum = if is_v4 {
                t.calc_checksum_ipv4(v4(src), v4(dst))
            } else {
                t.calc_checksum_ipv6(src, dst)
            }
            .map_err(|e| e.to_string())?;
            if sum != t.checksum() {
                return bad("L4 (proto 6)");
            }
        }
        Some(TransportSlice::Udp(u)) => {
            if is_v4 && u.checksum() == 0 {
                return Ok(());
            }
            let h = u.to_header();
            let sum = if is_v4 {
                h.calc_checksum_ipv4_raw(v4(src), v4(dst), u.payload())
            } else {
                h.calc_checksum_ipv6_raw(src, dst, u.payload())
            }
            .map_err(|e| e.to_string())?;
            if sum != u.checksum() {
                return bad("L4 (proto 17)");
            }
        }
        Some(TransportSlice::Icmpv4(i)) => {
            if i.icmp_type().calc_checksum(i.payload()) != i.checksum() {
                return bad("ICMP");
            }
            // Destination unreachable and time exceeded quote the packet's IPv4 header.
            if matches!(
                i.icmp_type(),
                Icmpv4Type::DestinationUnreachable(_) | Icmpv4Type::TimeExceeded(_)
            ) {
                if let Ok(inner) = Ipv4HeaderSlice::from_slice(i.payload()) {
                    if inner.to_header().calc_header_checksum() != inner.header_checksum() {
                        return bad("quoted IPv4 header");
                    }
                }
            }
        }
        Some(TransportSlice::Icmpv6(i)) => {
            let sum = i
                .icmp_type()
                .calc_checksum(src, dst, i.payload())
                .map_err(|e| e.to_string())?;
            if sum != i.checksum() {
                return bad("ICMPv6");
            }
        }
        _ => {}
    }
    Ok(())
}
