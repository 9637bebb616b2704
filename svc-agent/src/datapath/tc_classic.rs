//! The classic tc attach, for kernels without tcx (before 6.6): a clsact qdisc on the device
//! and one direct-action cls_bpf filter per program, made over netlink. A filter is not a
//! pinned link: it outlives the agent on its own (it holds its program), so a new agent finds
//! svc's filters by their place (priority and handle, fixed below) and program name, and
//! replaces the program in place (`tc filter replace`: cls_bpf swaps it under RCU, the device
//! is never without one). docs/design/packet-datapath.md, "Attaching on kernels without tcx".

use std::ffi::CString;
use std::io;

use aya::programs::links::Link;
use aya::programs::tc::{SchedClassifierLink, TcHandle};
use aya::programs::TcAttachType;
use netlink_packet_route::tc::{self, TcAttribute, TcFilterBpfOption, TcMessage, TcOption};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::TC_PROGRAMS;

/// The filter priority (tc's `pref`) of svc's filters: 1, first, as the tcx path attaches
/// first.
pub const PRIORITY: u16 = 1;
/// The filter handle of svc's filters ("SV"): with the priority and the program name, what
/// tells svc's filters from others' on the same hook.
pub const HANDLE: u32 = 0x5356;

/// aya's form of [`HANDLE`].
pub fn handle() -> TcHandle {
    TcHandle::from(HANDLE)
}

/// One cls_bpf filter as the kernel dumps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    /// TCA_BPF_NAME: the program's name, as the loader gave it.
    pub name: Option<String>,
    pub prog_id: Option<u32>,
}

/// One of svc's filters.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ours {
    pub program: &'static str,
    pub ifindex: u32,
    pub ifname: String,
    pub prog_id: u32,
}

fn socket() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

/// clsact's parent handle of each hook (ffff:fff2 ingress, ffff:fff3 egress).
fn parent(at: TcAttachType) -> tc::TcHandle {
    tc::TcHandle {
        major: 0xffff,
        minor: match at {
            TcAttachType::Egress => tc::TcHandle::MIN_EGRESS,
            _ => tc::TcHandle::MIN_INGRESS,
        },
    }
}

/// The cls_bpf filters on hook `at` of device `ifindex` (none without a clsact qdisc).
pub fn filters(socket: &Socket, ifindex: u32, at: TcAttachType) -> io::Result<Vec<Filter>> {
    let mut msg = TcMessage::default();
    msg.header.index = ifindex as i32;
    msg.header.parent = parent(at);
    let mut out = Vec::new();
    for m in crate::netdev::dump(socket, RouteNetlinkMessage::GetTrafficFilter(msg))? {
        let RouteNetlinkMessage::NewTrafficFilter(f) = m else {
            continue;
        };
        let bpf = f
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(k) if k == "bpf"));
        // The message of each priority's chain has handle 0 and no program.
        let handle = u32::from(f.header.handle);
        if !bpf || handle == 0 {
            continue;
        }
        let mut filter = Filter {
            priority: (f.header.info >> 16) as u16,
            handle,
            name: None,
            prog_id: None,
        };
        for a in &f.attributes {
            let TcAttribute::Options(opts) = a else {
                continue;
            };
            for o in opts {
                match o {
                    TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => filter.name = Some(n.clone()),
                    TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => filter.prog_id = Some(*id),
                    _ => {}
                }
            }
        }
        out.push(filter);
    }
    Ok(out)
}

/// What sits at svc's place on hook `at` of `ifindex`: None when nothing does.
pub fn at_our_place(ifindex: u32, at: TcAttachType) -> io::Result<Option<Filter>> {
    let socket = socket()?;
    Ok(filters(&socket, ifindex, at)?
        .into_iter()
        .find(|f| f.priority == PRIORITY && f.handle == HANDLE))
}

/// svc's filters on every device of the calling thread's network namespace: at svc's place,
/// named as one of svc's tc programs on the hook that program belongs on.
pub fn scan() -> io::Result<Vec<Ours>> {
    let socket = socket()?;
    let state = crate::netdev::read()?;
    let mut out = Vec::new();
    for link in &state.links {
        for (program, at, _) in TC_PROGRAMS {
            // A device that went away between the two dumps: nothing of ours on it.
            let Ok(found) = filters(&socket, link.index, at) else {
                continue;
            };
            for f in found {
                if f.priority == PRIORITY
                    && f.handle == HANDLE
                    && f.name.as_deref() == Some(program)
                {
                    out.push(Ours {
                        program,
                        ifindex: link.index,
                        ifname: link.name.clone(),
                        prog_id: f.prog_id.unwrap_or(0),
                    });
                }
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Whether program `prog_id` uses one of `maps` (map ids): a filter named as svc's belongs to
/// the svc whose pinned maps its program reads, where two directories serve one namespace.
pub fn uses_maps(prog_id: u32, maps: &std::collections::BTreeSet<u32>) -> bool {
    aya::programs::loaded_programs()
        .flatten()
        .find(|p| p.id() == prog_id)
        .and_then(|p| p.map_ids().ok().flatten())
        .is_some_and(|ids| ids.iter().any(|id| maps.contains(id)))
}

/// Removes svc's filter of `program` from `ifname` (`tc filter del ... pref 1 handle 0x5356
/// bpf`); a device or filter already gone is not an error. The clsact qdisc stays: other
/// filters may hang on it, and an empty one costs nothing.
pub fn delete(program: &str, ifname: &str) -> io::Result<()> {
    let at = TC_PROGRAMS
        .iter()
        .find(|(p, _, _)| *p == program)
        .map(|(_, at, _)| *at)
        .ok_or_else(|| io::Error::other(format!("{program}: not a tc program of svc")))?;
    let Ok(cname) = CString::new(ifname) else {
        return Ok(());
    };
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    if ifindex == 0 {
        return Ok(());
    }
    // Only what is ours: another program at our place is not removed.
    match at_our_place(ifindex, at)? {
        Some(f) if f.name.as_deref() == Some(program) => {}
        _ => return Ok(()),
    }
    let link = SchedClassifierLink::attached(ifname, at, PRIORITY, handle(), None)?;
    match link.detach() {
        Ok(()) => Ok(()),
        Err(e) => {
            let os = errno_of(&e);
            if matches!(os, Some(libc::ENOENT) | Some(libc::ENODEV)) {
                Ok(())
            } else {
                Err(io::Error::other(e.to_string()))
            }
        }
    }
}

/// The errno an aya error carries somewhere in its source chain.
pub(super) fn errno_of(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = cur {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            if let Some(n) = io.raw_os_error() {
                return Some(n);
            }
        }
        if let Some(nl) = s.downcast_ref::<aya::sys::NetlinkError>() {
            if let Some(n) = nl.raw_os_error() {
                return Some(n);
            }
        }
        cur = s.source();
    }
    None
}
