//! What the sock_diag (`stale`) and ctnetlink (`handover`) requests share: messages framed by
//! netlink-packet-core, sent on netlink-sys sockets, and a reply datagram split into its
//! messages (netlink-packet-core parses one message, and a dump's datagram holds several).

use std::io;

use netlink_packet_core::{
    DoneBuffer, ErrorBuffer, ErrorMessage, NetlinkBuffer, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, NetlinkSerializable, Parseable,
};

/// One request, framed: `flags` besides `NLM_F_REQUEST`, port id 0 (the kernel fills in the
/// socket's).
pub fn request<T: NetlinkSerializable>(inner: T, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = netlink_packet_core::NLM_F_REQUEST | flags;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner));
    msg.finalize();
    let mut buf = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut buf);
    buf
}

pub fn malformed(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed netlink reply: {what}"),
    )
}

/// One message of a reply datagram, its header read but its payload not yet parsed: a reply
/// to another request is skipped without parsing it, and the caller parses what it expects
/// (netlink-packet-core's `NetlinkMessage::deserialize` would fail on a message type its inner
/// type does not know, where an unknown message is to be skipped).
#[derive(Debug)]
pub struct Message<'a> {
    pub kind: u16,
    pub seq: u32,
    /// The whole message, header included.
    bytes: &'a [u8],
}

impl<'a> Message<'a> {
    /// The payload after the netlink header.
    pub fn payload(&self) -> &'a [u8] {
        NetlinkBuffer::new(self.bytes).payload()
    }

    /// The code of an `NLMSG_ERROR` message: 0 for an ack, else a negative errno.
    pub fn error_code(&self) -> io::Result<i32> {
        let payload = self.payload();
        let buf = ErrorBuffer::new_checked(&payload).map_err(malformed)?;
        ErrorMessage::parse(&buf)
            .map(|e| e.raw_code())
            .map_err(malformed)
    }

    /// The status of a dump that an `NLMSG_DONE` message ends: 0 or a negative errno. An empty
    /// payload (the kernel allows one) counts as 0, and so does one cut short.
    pub fn done_code(&self) -> i32 {
        DoneBuffer::new_checked(self.payload()).map_or(0, |b| b.code())
    }
}

/// The messages of one netlink datagram; a malformed header ends the iteration with an error.
pub struct Messages<'a> {
    rest: &'a [u8],
}

impl<'a> Messages<'a> {
    pub fn new(datagram: &'a [u8]) -> Self {
        Messages { rest: datagram }
    }
}

impl<'a> Iterator for Messages<'a> {
    type Item = io::Result<Message<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let buf = match NetlinkBuffer::new_checked(self.rest) {
            Ok(b) => b,
            Err(e) => {
                self.rest = &[];
                return Some(Err(malformed(e)));
            }
        };
        let len = buf.length() as usize;
        let msg = Message {
            kind: buf.message_type(),
            seq: buf.sequence_number(),
            bytes: &self.rest[..len],
        };
        // Messages are 4-byte aligned; the last one may end without padding.
        let next = (len + 3) & !3;
        self.rest = self.rest.get(next..).unwrap_or(&[]);
        Some(Ok(msg))
    }
}
