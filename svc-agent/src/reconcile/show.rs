//! How a [`Plan`] reads: one line per write, grouped by what it is for, in the order the
//! executor writes. Stable, so scripts and tests may match lines (`svc-agent run --dry-run`).

use std::fmt::{self, Display, Formatter};
use std::net::{IpAddr, SocketAddr};

use svc_common::{node_addr_flags, svc_flags, NodeAddrValue, ServiceKey};

use super::plan::{Plan, UnitPlan};
use super::{decode_name, ip_from16, range_of, Retire, Strays};
use crate::model::{Protocol, Scope};
use crate::store::Op;

/// "10.96.0.10:80/TCP" with " (external)" for the external scope, as `Frontend` shows.
struct Key<'a>(&'a ServiceKey);

impl Display for Key<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let k = self.0;
        let addr = SocketAddr::new(ip_from16(k.addr), u16::from_be(k.port_be));
        match Protocol::from_ipproto(k.proto) {
            Some(p) => write!(f, "{addr}/{p}")?,
            None => write!(f, "{addr}/{}", k.proto)?,
        }
        if Scope::from_value(k.scope) == Some(Scope::External) {
            f.write_str(" (external)")?;
        }
        Ok(())
    }
}

/// The names of `node_addr_flags` set in `flags`.
struct AddrFlags(u32);

impl Display for AddrFlags {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        use node_addr_flags as a;
        let names = [
            (a::NODEPORT, "NODEPORT"),
            (a::SNAT, "SNAT"),
            (a::EXTERNAL, "EXTERNAL"),
            (a::LINGER, "LINGER"),
            (a::LOCALHOST, "LOCALHOST"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(bit, _)| self.0 & bit != 0)
            .map(|(_, n)| *n)
            .collect();
        if set.is_empty() {
            write!(f, "{:#x}", self.0)
        } else {
            f.write_str(&set.join("|"))
        }
    }
}

struct Line<'a>(&'a Op);

impl Display for Line<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let op = self.0;
        let map = op.map();
        match op {
            Op::PutService(k, v) if v.flags & svc_flags::ADDR_MARKER != 0 => {
                write!(f, "put {map} {} marker", ip_from16(k.addr))
            }
            Op::PutService(k, v) => write!(
                f,
                "put {map} {} -> id {} rev {} slots {} flags {:#x}",
                Key(k),
                v.id,
                v.rev,
                v.count,
                v.flags
            ),
            Op::DelService(k) if k.port_be == 0 && k.proto == svc_common::PROTO_ANY => {
                write!(f, "delete {map} {} marker", ip_from16(k.addr))
            }
            Op::DelService(k) => write!(f, "delete {map} {}", Key(k)),
            Op::PutSlot(k, b) => {
                let n = b.backends.iter().take_while(|b| **b != 0).count();
                let b = &b.backends[..n];
                write!(
                    f,
                    "put {map} {}/{}/{} -> backends {b:?}",
                    k.id, k.rev, k.slot
                )
            }
            Op::DelSlot(k) => write!(f, "delete {map} {}/{}/{}", k.id, k.rev, k.slot),
            Op::PutBackend(id, b) => {
                let addr = SocketAddr::new(ip_from16(b.addr), u16::from_be(b.port_be));
                let proto = Protocol::from_ipproto(b.proto).map_or("?", |p| match p {
                    Protocol::Tcp => "TCP",
                    Protocol::Udp => "UDP",
                });
                let local = if b.flags & svc_common::backend_flags::LOCAL != 0 {
                    " local"
                } else {
                    ""
                };
                write!(f, "put {map} {id} -> {addr}/{proto}{local}")
            }
            Op::DelBackend(id) => write!(f, "delete {map} {id}"),
            Op::PutRevNat(id, v) => {
                let addr = SocketAddr::new(ip_from16(v.addr), u16::from_be(v.port_be));
                write!(f, "put {map} {id} -> {addr}")
            }
            Op::DelRevNat(id) | Op::DelName(id) => write!(f, "delete {map} {id}"),
            Op::PutName(id, n) => write!(f, "put {map} {id} -> {}", decode_name(n)),
            Op::PutMatch(k) => write!(f, "put {map} {}/{}", k.id, k.backend),
            Op::DelMatch(k) => write!(f, "delete {map} {}/{}", k.id, k.backend),
            Op::PutMeta(m) => write!(
                f,
                "put {map} frontend ids below {}, backend ids below {}",
                m.frontend_id_hwm, m.backend_id_hwm
            ),
            Op::PutRange(k) | Op::DelRange(k) => {
                let verb = if matches!(op, Op::PutRange(_)) {
                    "put"
                } else {
                    "delete"
                };
                match range_of(k) {
                    Some((id, c)) => write!(f, "{verb} {map} {id} {c}"),
                    None => write!(f, "{verb} {map} {k:?}"),
                }
            }
            Op::PutNodeAddr(k, v) => write!(f, "put {map} {}", NodeAddr(*k, *v)),
            Op::DelNodeAddr(k) => write!(f, "delete {map} {}", ip_from16(*k)),
            Op::PutConfig(c) => {
                let (min, max) = c.snat_range();
                write!(
                    f,
                    "put {map} snat ports {min}-{max}, frontends in the snat range {}",
                    c.snat_range_frontends
                )
            }
            // One line a table, not a block.
            Op::PutMaglev(start, blocks) => write!(
                f,
                "put {map} blocks {start}..{} (a table of {} blocks)",
                *start as usize + blocks.len(),
                blocks.len()
            ),
            Op::PutMaglevIndex(k, v) => write!(
                f,
                "put {map} maglev {}/{}: {} entries at offset {} seed {:#x}",
                k.id,
                k.rev,
                v.size,
                v.offset,
                u64::from(v.seed[0]) | u64::from(v.seed[1]) << 32
            ),
            Op::DelMaglevIndex(k) => write!(f, "delete {map} maglev {}/{}", k.id, k.rev),
            Op::DelMaglevPage(p) => write!(f, "delete {map} page {p} (no table in it)"),
        }
    }
}

struct NodeAddr([u8; 16], NodeAddrValue);

impl Display for NodeAddr {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let NodeAddr(k, v) = self;
        write!(f, "{} {}", ip_from16(*k), AddrFlags(v.flags))?;
        if v.ifindex != 0 {
            write!(f, " ifindex {}", v.ifindex)?;
        }
        Ok(())
    }
}

/// A retirement, as the entries it deletes after the grace period.
struct Retirement<'a>(&'a Retire);

impl Display for Retirement<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        use svc_common::map_names as m;
        match self.0 {
            Retire::Slots {
                id,
                rev,
                count,
                table,
            } => {
                let groups = svc_common::slot_groups(*count);
                let s = if *count == 1 { "" } else { "s" };
                write!(
                    f,
                    "retire {} {id}/{rev}/1..={groups} ({count} slot{s})",
                    m::SLOTS
                )?;
                if let Some(t) = table {
                    write!(
                        f,
                        ", {} {id}/{rev} and its {} blocks at {}",
                        m::MAGLEV_INDEX,
                        t.blocks(),
                        t.start
                    )?;
                }
                Ok(())
            }
            Retire::Table { key, table } => write!(
                f,
                "retire {} blocks {}..{} (maglev {}/{})",
                m::MAGLEV,
                table.start,
                table.start + table.blocks(),
                key.id,
                key.rev
            ),
            Retire::Ids(id) => write!(f, "retire {} {id}, {} {id}", m::REV_NAT, m::NAMES),
            Retire::Backend(id) => write!(f, "retire {} {id}", m::BACKENDS),
            Retire::Del(op) => {
                let line = Line(op).to_string();
                let rest = line.strip_prefix("delete ").unwrap_or(&line);
                write!(f, "retire {rest}")
            }
        }
    }
}

fn lines<T: Display>(f: &mut Formatter<'_>, items: impl IntoIterator<Item = T>) -> fmt::Result {
    items.into_iter().try_for_each(|l| writeln!(f, "  {l}"))
}

fn strays(f: &mut Formatter<'_>, s: &Strays) -> fmt::Result {
    if s.is_empty() {
        return Ok(());
    }
    writeln!(f, "leftovers:")?;
    lines(
        f,
        s.services
            .iter()
            .map(|k| Line(&Op::DelService(*k)).to_string()),
    )?;
    lines(
        f,
        s.ranges.iter().map(|k| Line(&Op::DelRange(*k)).to_string()),
    )?;
    lines(
        f,
        s.matches
            .iter()
            .map(|k| Line(&Op::DelMatch(*k)).to_string()),
    )?;
    let later = (s.slots.iter().map(|k| Retire::Del(Op::DelSlot(*k))))
        .chain(s.rev_nat.iter().map(|id| Retire::Del(Op::DelRevNat(*id))))
        .chain(s.names.iter().map(|id| Retire::Del(Op::DelName(*id))))
        .chain(s.backends.iter().map(|id| Retire::Backend(*id)))
        .chain(s.maglev.iter().map(|(key, t)| match t {
            Some(table) => Retire::Table {
                key: *key,
                table: *table,
            },
            None => Retire::Del(Op::DelMaglevIndex(*key)),
        }));
    later
        .into_iter()
        .try_for_each(|r| writeln!(f, "  {}", Retirement(&r)))
}

impl Display for UnitPlan {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let ops = self.ops();
        lines(f, ops.iter().map(Line))?;
        lines(f, self.retire.iter().map(Retirement))
    }
}

impl Display for Plan {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return writeln!(f, "nothing to write");
        }
        strays(f, &self.strays)?;
        let node_addrs = |v: &[([u8; 16], NodeAddrValue)]| {
            v.iter()
                .map(|(k, v)| Op::PutNodeAddr(*k, *v))
                .collect::<Vec<_>>()
        };
        if let Some(node) = self
            .node
            .as_ref()
            .filter(|n| !n.addrs.is_empty() || n.config.is_some())
        {
            writeln!(f, "node:")?;
            lines(f, node_addrs(&node.addrs).iter().map(Line))?;
            lines(f, node.config.map(Op::PutConfig).iter().map(Line))?;
        }
        if let Some(c) = self.snat_mark {
            writeln!(f, "snat range mark:")?;
            writeln!(f, "  {}", Line(&Op::PutConfig(c)))?;
        }
        if !self.external_addrs.is_empty() {
            writeln!(f, "external addresses:")?;
            lines(f, node_addrs(&self.external_addrs).iter().map(Line))?;
        }
        for s in &self.services {
            match s.plan.as_deref() {
                None => writeln!(
                    f,
                    "service {}: {} frontends to write, {} to remove (its writes are planned \
                     as they are made)",
                    s.owner,
                    s.upserts.len(),
                    s.gone.len()
                )?,
                Some(Ok(p)) if p.is_empty() => {}
                Some(Ok(p)) => write!(f, "service {}:\n{p}", s.owner)?,
                Some(Err(e)) => writeln!(f, "service {}: not programmed: {e}", s.owner)?,
            }
        }
        if !self.new_markers.is_empty() || !self.gone_markers.is_empty() {
            writeln!(f, "clusterip markers:")?;
            let marker = |ip: &IpAddr| super::marker_key(*ip);
            let put = |ip| Op::PutService(marker(ip), super::marker_value());
            let del = |ip| Op::DelService(marker(ip));
            let ops: Vec<Op> = (self.new_markers.iter().map(put))
                .chain(self.gone_markers.iter().map(del))
                .collect();
            lines(f, ops.iter().map(Line))?;
        }
        if !self.addrs_after.is_empty() {
            writeln!(f, "external addresses after the services:")?;
            lines(f, node_addrs(&self.addrs_after).iter().map(Line))?;
        }
        Ok(())
    }
}
