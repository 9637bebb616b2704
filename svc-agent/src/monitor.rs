//! `svc-agent monitor`: the datapath's decisions as they happen, read from the ring buffer of
//! the slot whose lease the monitor holds; up to `MONITOR_SLOTS` monitors at once, each
//! with every event (docs/design/monitor.md).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aya::maps::{Array, MapData, PerCpuArray, RingBuf};
use serde::Serialize;
use svc_common::{
    how, map_names, monitor_flags, monitor_source, MonitorCtl, MonitorEvent, MonitorOn,
    MonitorStats, Reason, ServiceName, MONITOR_SLOTS, MON_RINGS,
};

use crate::datapath::map_pin;
use crate::error::{Error, Result};
use crate::reconcile::{decode_name, ip_from16};

/// How long a lease lasts past its last renewal: a monitor killed without a word stops the
/// writing into its slot's ring at most this long after (the first decision after that
/// clears the lease).
pub const LEASE: Duration = Duration::from_secs(3);
/// How often a listening monitor renews its lease.
const RENEW: Duration = Duration::from_secs(1);
/// Events a second above which the monitor asks the programs to sample (one in 2, 4, ...):
/// a terminal or a JSON consumer cannot use more, and the ring would overflow.
pub const MAX_RATE: u64 = 5_000;

/// What to show.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    /// "NAMESPACE/NAME": events of that Service's frontends only.
    pub service: Option<String>,
    /// Events whose destination (as sent, or as translated) is this address and port; and
    /// the replies and ICMP errors that are shown coming from it (their translated source).
    pub dst: Option<SocketAddr>,
}

/// One decision, as printed.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct Decision {
    /// Wall-clock time the monitor computed from the kernel's monotonic stamp, RFC 3339-like
    /// seconds since the epoch with microseconds.
    pub time: String,
    /// connect, sendmsg, reverse (recvmsg/getpeername), tc, sweep (the connection-tracking
    /// sweep).
    pub source: &'static str,
    /// The datapath's reason (the `reason` label of svc_datapath_decisions_total).
    pub reason: &'static str,
    /// translated, refused, dropped, rejected, reverse, swept.
    pub verdict: &'static str,
    /// "namespace/name:port" of the frontend, when the names map has it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    pub frontend_id: u32,
    /// What the client sent to (for an ICMP error, the flow's packet that travels the error's
    /// way: from the backend, for an error a backend sent).
    pub dst: SocketAddr,
    /// The backend (or, for `reverse`, the frontend the socket is shown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<SocketAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_id: Option<u32>,
    /// The client (tc and sweep only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<SocketAddr>,
    /// The SNAT address and port a tc flow took, when it is SNATed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat: Option<SocketAddr>,
    pub protocol: String,
    /// random, affinity, sticky, hashed, maglev: how the backend was chosen (socket hooks,
    /// and a new flow at tc).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub how: Option<&'static str>,
    /// A known flow's packet (tc, XDP): closing, closed or reset as it went by; absent while
    /// the flow is open. A swept flow: closed or reset, or idle (open, and silent past its
    /// timeout).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow: Option<&'static str>,
    /// An ICMP error that was translated: what it says ("port unreachable", "fragmentation
    /// needed", ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub icmp: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ifindex: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_cookie: Option<u64>,
}

/// Events the monitor did not show, since it started.
#[derive(Debug, Default, Serialize, PartialEq, Eq, Clone, Copy)]
pub struct Dropped {
    /// The ring was full.
    pub ring_full: u64,
    /// Sampled out at high rates.
    pub sampled_out: u64,
    /// One event in `sample` is written now.
    pub sample: u32,
}

fn map_err(map: &'static str, e: impl std::fmt::Display) -> Error {
    Error::map(map, e.to_string())
}

/// The monitor's maps, opened from their pins (a slot's ring by `Maps::ring`).
pub struct Maps {
    dir: std::path::PathBuf,
    ctl: Array<MapData, MonitorCtl>,
    on: Array<MapData, MonitorOn>,
    stats: PerCpuArray<MapData, MonitorStats>,
    names: aya::maps::HashMap<MapData, u32, ServiceName>,
}

fn open(dir: &Path, name: &'static str) -> Result<MapData> {
    let path = map_pin(dir, name);
    MapData::from_pin(&path).map_err(|e| {
        map_err(
            name,
            format!(
                "{}: {e} (is an svc-agent that has the monitor running with --bpffs {}?)",
                path.display(),
                dir.display()
            ),
        )
    })
}

fn map(dir: &Path, name: &'static str) -> Result<aya::maps::Map> {
    aya::maps::Map::from_map_data(open(dir, name)?).map_err(|e| map_err(name, e))
}

impl Maps {
    pub fn open(dir: &Path) -> Result<Maps> {
        let m = |name| map(dir, name);
        Ok(Maps {
            dir: dir.to_path_buf(),
            ctl: Array::try_from(m(map_names::MON_CTL)?)
                .map_err(|e| map_err(map_names::MON_CTL, e))?,
            on: Array::try_from(m(map_names::MON_ON)?)
                .map_err(|e| map_err(map_names::MON_ON, e))?,
            stats: PerCpuArray::try_from(m(map_names::MON_STATS)?)
                .map_err(|e| map_err(map_names::MON_STATS, e))?,
            names: aya::maps::HashMap::try_from(m(map_names::NAMES)?)
                .map_err(|e| map_err(map_names::NAMES, e))?,
        })
    }

    /// Slot `slot`'s ring.
    fn ring(&self, slot: u32) -> Result<RingBuf<MapData>> {
        let name = MON_RINGS[slot as usize];
        RingBuf::try_from(map(&self.dir, name)?).map_err(|e| map_err(name, e))
    }

    /// Every slot, by index.
    pub fn slots(&self) -> Result<Vec<MonitorCtl>> {
        (0..MONITOR_SLOTS).map(|i| self.slot(i)).collect()
    }

    pub fn slot(&self, slot: u32) -> Result<MonitorCtl> {
        self.ctl
            .get(&slot, 0)
            .map_err(|e| map_err(map_names::MON_CTL, e))
    }

    fn set_slot(&mut self, slot: u32, c: MonitorCtl) -> Result<()> {
        self.ctl
            .set(slot, c, 0)
            .map_err(|e| map_err(map_names::MON_CTL, e))
    }

    /// The summary the programs read.
    pub fn on(&self) -> Result<MonitorOn> {
        self.on
            .get(&0, 0)
            .map_err(|e| map_err(map_names::MON_ON, e))
    }

    fn set_on(&mut self, o: MonitorOn) -> Result<()> {
        self.on
            .set(0, o, 0)
            .map_err(|e| map_err(map_names::MON_ON, e))
    }

    /// Slot `slot`'s counters, summed over the CPUs.
    pub fn stats(&self, slot: u32) -> Result<MonitorStats> {
        let per_cpu = self
            .stats
            .get(&slot, 0)
            .map_err(|e| map_err(map_names::MON_STATS, e))?;
        Ok(per_cpu.iter().fold(MonitorStats::default(), add_stats))
    }

    /// Every slot's counters, summed.
    pub fn stats_all(&self) -> Result<MonitorStats> {
        (0..MONITOR_SLOTS).try_fold(MonitorStats::default(), |a, i| {
            Ok(add_stats(a, &self.stats(i)?))
        })
    }

    fn names(&self) -> HashMap<u32, String> {
        self.names
            .iter()
            .flatten()
            .map(|(id, n)| (id, decode_name(&n)))
            .collect()
    }
}

fn add_stats(a: MonitorStats, s: &MonitorStats) -> MonitorStats {
    MonitorStats {
        seen: a.seen + s.seen,
        written: a.written + s.written,
        lost: a.lost + s.lost,
    }
}

/// CLOCK_MONOTONIC now, ns: the clock of `MonitorCtl::until_ns` and `MonitorEvent::ts_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Whether slot `c` is held by a monitor other than `pid`: its lease is current. A monitor
/// killed without a word holds its slot until its lease ends (3 s). Its process is not looked
/// for in /proc: a monitor in another PID namespace (one run with `kubectl exec` in the
/// agent's container, one on the node) has a pid this one cannot see, and taking its slot
/// would have the two share one ring, each getting part of the events.
fn held_by_other(c: &MonitorCtl, pid: u32, now: u64) -> bool {
    c.until_ns > now && c.pid != 0 && c.pid != pid
}

/// A slot no other live monitor holds, its ring emptied, and its counters as they are; an
/// error naming the pids that hold them all when there is none.
fn free_slot(maps: &Maps, pid: u32) -> Result<(u32, RingBuf<MapData>, MonitorStats)> {
    let now = monotonic_ns();
    let slots = maps.slots()?;
    let Some(slot) = slots.iter().position(|c| !held_by_other(c, pid, now)) else {
        let pids: Vec<String> = slots.iter().map(|c| c.pid.to_string()).collect();
        return Err(Error::Invalid {
            object: format!("{}", map_pin(&maps.dir, map_names::MON_CTL).display()),
            message: format!(
                "{MONITOR_SLOTS} monitors are listening already (pids {}); at most \
                 {MONITOR_SLOTS} at a time",
                pids.join(", ")
            ),
        });
    };
    let slot = slot as u32;
    let mut ring = maps.ring(slot)?;
    let base = maps.stats(slot)?;
    // Events a dead monitor left in the slot's ring are not this one's.
    while ring.next().is_some() {}
    Ok((slot, ring, base))
}

/// The listening side: holds a slot's lease while it lives, gives it back when dropped.
pub struct Listener {
    maps: Maps,
    slot: u32,
    ring: RingBuf<MapData>,
    pid: u32,
    sample: u32,
    /// `monitor_flags` of the slot.
    flags: u32,
    renewed: Instant,
    base: MonitorStats,
    names: HashMap<u32, String>,
    names_read: Instant,
    /// CLOCK_REALTIME minus CLOCK_MONOTONIC, ns.
    wall_offset: i128,
}

impl Listener {
    /// Takes a free slot (`packets`: every packet of known flows is an event for it); fails
    /// when live monitors hold all `MONITOR_SLOTS`, naming their pids.
    pub fn start(dir: &Path, packets: bool) -> Result<Listener> {
        let maps = Maps::open(dir)?;
        let pid = std::process::id();
        let (slot, ring, base) = free_slot(&maps, pid)?;
        let mut l = Listener {
            names: maps.names(),
            maps,
            slot,
            ring,
            pid,
            sample: 1,
            flags: if packets { monitor_flags::PACKETS } else { 0 },
            renewed: Instant::now(),
            base,
            names_read: Instant::now(),
            wall_offset: {
                let wall = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos() as i128;
                wall - monotonic_ns() as i128
            },
        };
        l.renew()?;
        Ok(l)
    }

    /// The slot this monitor holds.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Writes the slot's lease, then its bits in the summary (in that order: a program that
    /// finds a bit without a current lease clears it).
    fn renew(&mut self) -> Result<()> {
        self.renewed = Instant::now();
        self.maps.set_slot(
            self.slot,
            MonitorCtl {
                until_ns: monotonic_ns() + LEASE.as_nanos() as u64,
                sample: self.sample,
                pid: self.pid,
                flags: self.flags,
                _pad0: 0,
            },
        )?;
        self.summary()
    }

    /// Sets the slot's bits in the summary if they are not there: two monitors that change
    /// it at once (a read and a write each) may lose one's change, and a program clears the
    /// bits of a slot whose lease it found over.
    fn summary(&mut self) -> Result<()> {
        let o = self.maps.on()?;
        let bit = 1 << self.slot;
        let packets = if self.flags & monitor_flags::PACKETS != 0 {
            o.packets | bit
        } else {
            o.packets & !bit
        };
        let want = MonitorOn {
            slots: o.slots | bit,
            packets,
        };
        if want != o {
            self.maps.set_on(want)?;
        }
        Ok(())
    }

    /// Checks the slot is still this monitor's and set, renewing it when a program cleared
    /// it (its lease read as over while the renewal raced) or a renewal is due. Another
    /// monitor that took it (two started at once and chose the same free slot) makes this
    /// one move to another free slot, or stop when there is none.
    fn check(&mut self) -> Result<()> {
        let c = self.maps.slot(self.slot)?;
        if c.pid != self.pid && held_by_other(&c, self.pid, monotonic_ns()) {
            (self.slot, self.ring, self.base) = free_slot(&self.maps, self.pid)?;
            return self.renew();
        }
        if c.pid != self.pid || c.until_ns == 0 || self.renewed.elapsed() >= RENEW {
            return self.renew();
        }
        self.summary()
    }

    /// What was not shown since the start.
    pub fn dropped(&self) -> Result<Dropped> {
        let s = self.maps.stats(self.slot)?;
        let seen = s.seen.saturating_sub(self.base.seen);
        let written = s.written.saturating_sub(self.base.written);
        let lost = s.lost.saturating_sub(self.base.lost);
        Ok(Dropped {
            ring_full: lost,
            sampled_out: seen.saturating_sub(written).saturating_sub(lost),
            sample: self.sample,
        })
    }

    /// Reads what the slot's ring holds, each event through `f`.
    pub fn drain(&mut self, f: &mut dyn FnMut(&MonitorEvent)) -> Result<usize> {
        let mut n = 0;
        while let Some(item) = self.ring.next() {
            if item.len() >= size_of::<MonitorEvent>() {
                let e: MonitorEvent =
                    bytemuck::pod_read_unaligned(&item[..size_of::<MonitorEvent>()]);
                f(&e);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Checks the slot (`check`), with the sampling for `rate` events a second when a rate
    /// was measured (once a second).
    pub fn tick(&mut self, rate: Option<u64>) -> Result<()> {
        let want = rate.map_or(self.sample, |r| sample_for(self.sample, r));
        if want != self.sample {
            self.sample = want;
            return self.renew();
        }
        self.check()
    }

    /// Waits `timeout` (less when a signal comes): the programs submit without waking the
    /// reader (svc-ebpf's `BPF_RB_NO_WAKEUP`), so the ring is read in batches.
    pub fn wait(&self, timeout: Duration) {
        let mut fds = [libc::pollfd {
            fd: self.ring.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout.as_millis() as i32) };
    }

    /// The frontend's name; the names map is read again (at most once a second) for an id
    /// not seen yet.
    fn name(&mut self, id: u32) -> Option<String> {
        if id == 0 {
            return None;
        }
        if !self.names.contains_key(&id) && self.names_read.elapsed() >= Duration::from_secs(1) {
            self.names = self.maps.names();
            self.names_read = Instant::now();
        }
        self.names.get(&id).cloned()
    }

    /// The event as printed.
    pub fn decision(&mut self, e: &MonitorEvent) -> Decision {
        let service = self.name(e.id);
        decision(e, service, self.wall_offset)
    }
}

/// `e` as printed, its frontend named `service`; `wall_offset` is CLOCK_REALTIME minus
/// CLOCK_MONOTONIC, ns.
fn decision(e: &MonitorEvent, service: Option<String>, wall_offset: i128) -> Decision {
    let reason = Reason::from_u32(e.reason);
    let addr = |a: [u8; 16], p: u16| SocketAddr::new(ip_from16(a), u16::from_be(p));
    let set = |a: [u8; 16], p: u16| (a != [0; 16] || p != 0).then(|| addr(a, p));
    // The packet datapath's events, and the sweep's: flows with a client address.
    let tc = e.source == monitor_source::TC || e.source == monitor_source::SWEEP;
    // Where `how` holds a known flow's `ct_flags` rather than a choice.
    let flags_in_how = matches!(
        reason,
        Some(
            Reason::CtHit
                | Reason::Reply
                | Reason::XdpCtHit
                | Reason::XdpReply
                | Reason::XdpRedirect
                | Reason::XdpRedirectReply
        )
    );
    let swept = reason == Some(Reason::CtSwept);
    let client = tc.then(|| addr(e.saddr, e.sport_be));
    let snat = if tc {
        set(e.nat_saddr, e.nat_sport_be).filter(|s| Some(*s) != client)
    } else {
        None
    };
    let ns = e.ts_ns as i128 + wall_offset;
    Decision {
        time: format!(
            "{}.{:06}",
            ns.div_euclid(1_000_000_000),
            ns.rem_euclid(1_000_000_000) / 1_000
        ),
        source: match e.source {
            monitor_source::CONNECT => "connect",
            monitor_source::SENDMSG => "sendmsg",
            monitor_source::REVERSE => "reverse",
            monitor_source::TC => "tc",
            monitor_source::SWEEP => "sweep",
            _ => "unknown",
        },
        reason: reason.map_or("unknown", Reason::name),
        verdict: reason.map_or("unknown", verdict),
        service,
        frontend_id: e.id,
        dst: addr(e.daddr, e.dport_be),
        to: set(e.nat_daddr, e.nat_dport_be),
        backend_id: (e.backend_id != 0).then_some(e.backend_id),
        client,
        snat,
        protocol: match e.proto {
            svc_common::IPPROTO_TCP => "tcp".to_string(),
            svc_common::IPPROTO_UDP => "udp".to_string(),
            132 => "sctp".to_string(),
            n => n.to_string(),
        },
        flow: if swept {
            Some(flow_state(e.how).unwrap_or("idle"))
        } else if flags_in_how {
            flow_state(e.how)
        } else {
            None
        },
        how: match e.how as u32 {
            _ if flags_in_how || swept => None,
            how::RANDOM => Some("random"),
            how::AFFINITY => Some("affinity"),
            how::STICKY => Some("sticky"),
            how::HASHED => Some("hashed"),
            how::MAGLEV => Some("maglev"),
            _ => None,
        },
        icmp: (reason == Some(Reason::IcmpError)).then(|| {
            icmp_name(
                !svc_common::is_v4_mapped(&e.daddr),
                e.icmp_type,
                e.icmp_code,
            )
        }),
        ifindex: (e.ifindex != 0).then_some(e.ifindex),
        socket_cookie: (e.cookie != 0).then_some(e.cookie),
    }
}

/// What an ICMP (`v6`: ICMPv6) error of `type_` and `code` says, as the errors svc translates
/// (destination unreachable, fragmentation needed / packet too big, time exceeded, parameter
/// problem) are named; others by number.
fn icmp_name(v6: bool, type_: u8, code: u8) -> String {
    let name = match (v6, type_, code) {
        (false, 3, 0) => "network unreachable",
        (false, 3, 1) => "host unreachable",
        (false, 3, 2) => "protocol unreachable",
        (false, 3, 3) => "port unreachable",
        (false, 3, 4) => "fragmentation needed",
        (false, 3, 9 | 10 | 13) => "administratively prohibited",
        (false, 3, _) => "destination unreachable",
        (false, 11, _) => "time exceeded",
        (false, 12, _) => "parameter problem",
        (true, 1, 0) => "no route",
        (true, 1, 1) => "administratively prohibited",
        (true, 1, 3) => "address unreachable",
        (true, 1, 4) => "port unreachable",
        (true, 1, _) => "destination unreachable",
        (true, 2, _) => "packet too big",
        (true, 3, _) => "time exceeded",
        (true, 4, _) => "parameter problem",
        _ => return format!("type {type_} code {code}"),
    };
    name.to_string()
}

impl Drop for Listener {
    /// Gives the slot back, unless another monitor took it meanwhile, and its bits in the
    /// summary.
    fn drop(&mut self) {
        if self.maps.slot(self.slot).is_ok_and(|c| c.pid == self.pid) {
            let _ = self.maps.set_slot(self.slot, MonitorCtl::default());
            if let Ok(o) = self.maps.on() {
                let bit = 1 << self.slot;
                let _ = self.maps.set_on(MonitorOn {
                    slots: o.slots & !bit,
                    packets: o.packets & !bit,
                });
            }
        }
    }
}

/// The sampling after a second of `rate` events (estimated before sampling) at `sample`:
/// doubled above `MAX_RATE`, halved well below it.
pub fn sample_for(sample: u32, rate: u64) -> u32 {
    if rate > MAX_RATE {
        sample.saturating_mul(2).min(1 << 20)
    } else if rate < MAX_RATE / 4 && sample > 1 {
        sample / 2
    } else {
        sample.max(1)
    }
}

/// A known flow's state after its packet, from the `ct_flags` a tc or XDP event carries:
/// reset, closed (a FIN each way), closing (a FIN), or None while it is open.
fn flow_state(flags: u8) -> Option<&'static str> {
    use svc_common::ct_flags::{FIN, FIN_FORWARD, FIN_REPLY, RST};
    let flags = u16::from(flags);
    if flags & RST != 0 {
        Some("reset")
    } else if flags & (FIN_FORWARD | FIN_REPLY) == FIN_FORWARD | FIN_REPLY {
        Some("closed")
    } else if flags & FIN != 0 {
        Some("closing")
    } else {
        None
    }
}

/// What the decision came to, in a word.
fn verdict(r: Reason) -> &'static str {
    use Reason::*;
    match r {
        New | Translated | CtHit | FragmentTranslated | IcmpError | XdpNew | XdpCtHit
        | XdpRedirect => "translated",
        Reply | RevTranslated | XdpReply | XdpRedirectReply => "reverse",
        CtSwept => "swept",
        RefusedNoBackend | RefusedNoPort => "refused",
        RejectNoBackend => "rejected",
        _ if r.name().starts_with("drop") || r.name().starts_with("err") => "dropped",
        _ => "passed",
    }
}

impl Filter {
    pub fn matches(&self, d: &Decision) -> bool {
        if let Some(s) = &self.service {
            let Some(name) = &d.service else {
                return false;
            };
            let svc = name.split_once(':').map_or(name.as_str(), |(s, _)| s);
            if svc != s {
                return false;
            }
        }
        if let Some(dst) = self.dst {
            let same =
                |a: &SocketAddr| a.port() == dst.port() && canonical(a.ip()) == canonical(dst.ip());
            // A reply, or an ICMP error about a flow, leaves from the frontend: its way back.
            let back = (d.verdict == "reverse" || d.reason == Reason::IcmpError.name())
                && d.snat.as_ref().is_some_and(same);
            if !same(&d.dst) && !d.to.as_ref().is_some_and(same) && !back {
                return false;
            }
        }
        true
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// One line of text for `d`.
pub fn render_text(d: &Decision) -> String {
    let esc = |s: &str| crate::names::escape(s).into_owned();
    let mut line = format!(
        "{} {:<8} {:<10} {} {}",
        d.time,
        d.source,
        d.verdict,
        d.protocol,
        d.client.map_or(String::new(), |c| format!("{c} -> ")) + &d.dst.to_string()
    );
    if let Some(to) = d.to {
        line.push_str(&format!(" => {to}"));
    }
    if let Some(s) = d.snat {
        line.push_str(&format!(" snat {s}"));
    }
    line.push_str(&format!(
        " [{}] {}",
        d.reason,
        d.service.as_deref().map_or("-".to_string(), esc)
    ));
    if let Some(h) = d.how {
        line.push_str(&format!(" ({h})"));
    }
    if let Some(f) = d.flow {
        line.push_str(&format!(" flow {f}"));
    }
    if let Some(i) = &d.icmp {
        line.push_str(&format!(" icmp {i}"));
    }
    if let Some(i) = d.ifindex {
        line.push_str(&format!(" dev {i}"));
    }
    line
}

/// Set by SIGINT and SIGTERM: the monitor gives its lease back and exits.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Runs the monitor until SIGINT or SIGTERM (or the output is closed), each shown decision
/// through `out` (false: stop), and each change of the not-shown counts through `lost`;
/// `packets`: every packet of known flows, not only those that change their state.
pub fn run(
    dir: &Path,
    filter: &Filter,
    packets: bool,
    out: &mut dyn FnMut(&Decision) -> bool,
    lost: &mut dyn FnMut(&Dropped) -> bool,
) -> Result<()> {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut l = Listener::start(dir, packets)?;
    let mut last = Dropped {
        sample: 1,
        ..Default::default()
    };
    let mut second = Instant::now();
    let mut in_second = 0u64;
    while !STOP.load(Ordering::Relaxed) {
        l.wait(Duration::from_millis(100));
        let mut events = Vec::new();
        in_second += l.drain(&mut |e| events.push(*e))? as u64;
        for e in &events {
            let d = l.decision(e);
            if filter.matches(&d) && !out(&d) {
                return Ok(());
            }
        }
        let mut rate = None;
        if second.elapsed() >= Duration::from_secs(1) {
            rate = Some(in_second * l.sample.max(1) as u64);
            in_second = 0;
            second = Instant::now();
        }
        l.tick(rate)?;
        let now = l.dropped()?;
        if now != last {
            last = now;
            if !lost(&now) {
                return Ok(());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(service: Option<&str>, dst: &str, to: Option<&str>) -> Decision {
        Decision {
            time: "0.000000".into(),
            source: "connect",
            reason: "translated",
            verdict: "translated",
            service: service.map(str::to_string),
            frontend_id: 1,
            dst: dst.parse().unwrap(),
            to: to.map(|t| t.parse().unwrap()),
            backend_id: Some(7),
            client: None,
            snat: None,
            protocol: "tcp".into(),
            how: Some("random"),
            flow: None,
            icmp: None,
            ifindex: None,
            socket_cookie: None,
        }
    }

    fn v4(a: [u8; 4], port: u16) -> ([u8; 16], u16) {
        (svc_common::v4_mapped(a), port.to_be())
    }

    /// A tc event of `reason` from 203.0.113.7:40000 to 192.0.2.10:30080, translated to
    /// 10.244.2.8:8080 from 192.0.2.10:61000 (SNATed).
    fn tc_event(reason: Reason, source: u8, how: u8) -> MonitorEvent {
        let (saddr, sport_be) = v4([203, 0, 113, 7], 40000);
        let (daddr, dport_be) = v4([192, 0, 2, 10], 30080);
        let (nat_saddr, nat_sport_be) = v4([192, 0, 2, 10], 61000);
        let (nat_daddr, nat_dport_be) = v4([10, 244, 2, 8], 8080);
        MonitorEvent {
            reason: reason as u32,
            source,
            how,
            id: 8,
            ifindex: 2,
            saddr,
            sport_be,
            daddr,
            dport_be,
            nat_saddr,
            nat_sport_be,
            nat_daddr,
            nat_dport_be,
            proto: svc_common::IPPROTO_TCP,
            ..Default::default()
        }
    }

    /// A new tc flow names its choice (a sessionAffinity hit), a swept flow its state
    /// (idle when it was open), an ICMP error what it says; each line as a user reads it.
    #[test]
    fn affinity_sweeps_and_icmp_errors_are_named() {
        let name = || Some("demo/web:http".to_string());
        let d = super::decision(
            &tc_event(Reason::New, monitor_source::TC, how::AFFINITY as u8),
            name(),
            0,
        );
        assert_eq!((d.how, d.flow), (Some("affinity"), None));
        assert!(
            render_text(&d).ends_with(
                "tc       translated tcp 203.0.113.7:40000 -> 192.0.2.10:30080 => \
                 10.244.2.8:8080 snat 192.0.2.10:61000 [new] demo/web:http (affinity) dev 2"
            ),
            "{}",
            render_text(&d)
        );

        let closed = (svc_common::ct_flags::FIN
            | svc_common::ct_flags::FIN_FORWARD
            | svc_common::ct_flags::FIN_REPLY) as u8;
        // A known flow's packet redirected at XDP carries the flow's flags, not a choice.
        for redirected in [Reason::XdpRedirect, Reason::XdpRedirectReply] {
            let d = super::decision(&tc_event(redirected, monitor_source::TC, closed), name(), 0);
            assert_eq!((d.how, d.flow), (None, Some("closed")), "{redirected:?}");
        }
        let d = super::decision(
            &tc_event(Reason::CtSwept, monitor_source::SWEEP, closed),
            name(),
            0,
        );
        assert_eq!(
            (d.source, d.verdict, d.how, d.flow),
            ("sweep", "swept", None, Some("closed"))
        );
        let open = svc_common::ct_flags::SEEN_REPLY as u8;
        let d = super::decision(
            &tc_event(Reason::CtSwept, monitor_source::SWEEP, open),
            name(),
            0,
        );
        assert_eq!(d.flow, Some("idle"));
        assert!(
            render_text(&d).ends_with("[ct_swept] demo/web:http flow idle dev 2"),
            "{}",
            render_text(&d)
        );

        let mut e = tc_event(Reason::IcmpError, monitor_source::TC, 0);
        (e.icmp_type, e.icmp_code) = (3, 4);
        let d = super::decision(&e, name(), 0);
        assert_eq!(d.icmp.as_deref(), Some("fragmentation needed"));
        assert_eq!(d.verdict, "translated");
        assert!(
            render_text(&d).ends_with("[icmp_error] demo/web:http icmp fragmentation needed dev 2"),
            "{}",
            render_text(&d)
        );
        assert_eq!(icmp_name(true, 2, 0), "packet too big");
        assert_eq!(icmp_name(true, 1, 4), "port unreachable");
        assert_eq!(icmp_name(false, 5, 1), "type 5 code 1");
        assert!(super::decision(&tc_event(Reason::New, 4, 0), None, 0)
            .icmp
            .is_none());
    }

    #[test]
    fn a_known_flows_state_is_named_from_its_flags() {
        use svc_common::ct_flags::*;
        let low = |f: u16| f as u8;
        assert_eq!(flow_state(low(SNAT | SEEN_REPLY)), None);
        assert_eq!(flow_state(low(FIN | FIN_FORWARD)), Some("closing"));
        let both = FIN | FIN_FORWARD | FIN_REPLY;
        assert_eq!(flow_state(low(both)), Some("closed"));
        assert_eq!(flow_state(low(RST | FIN)), Some("reset"));
        assert_eq!(verdict(Reason::XdpNew), "translated");
        assert_eq!(verdict(Reason::XdpReply), "reverse");
        assert_eq!(verdict(Reason::XdpRedirect), "translated");
        assert_eq!(verdict(Reason::XdpRedirectReply), "reverse");
    }

    /// --service matches the Service whatever the port, and not another whose name starts
    /// alike; --dst matches the destination as sent or as translated, IPv4 given either way.
    #[test]
    fn filters_match_the_service_and_either_destination() {
        let d = decision(
            Some("demo/web:http"),
            "10.96.0.10:80",
            Some("10.244.1.5:8080"),
        );
        let svc = |s: &str| Filter {
            service: Some(s.into()),
            dst: None,
        };
        let dst = |s: &str| Filter {
            service: None,
            dst: Some(s.parse().unwrap()),
        };
        assert!(svc("demo/web").matches(&d));
        assert!(!svc("demo/we").matches(&d));
        assert!(!svc("other/web").matches(&d));
        assert!(!svc("demo/web").matches(&decision(None, "10.96.0.10:80", None)));
        assert!(dst("10.96.0.10:80").matches(&d));
        assert!(dst("[::ffff:10.96.0.10]:80").matches(&d));
        assert!(dst("10.244.1.5:8080").matches(&d));
        assert!(!dst("10.96.0.10:81").matches(&d));
        assert!(Filter::default().matches(&d));
        // A backend's reply and an ICMP error about the flow leave from the frontend (their
        // translated source): shown for it; a new flow's SNAT address is no destination.
        let mut back = decision(
            Some("demo/web:http"),
            "10.77.0.100:40000",
            Some("10.77.0.100:40000"),
        );
        back.snat = Some("10.77.0.1:30080".parse().unwrap());
        for (verdict, reason) in [("reverse", "reply"), ("translated", "icmp_error")] {
            back.verdict = verdict;
            back.reason = reason;
            assert!(dst("10.77.0.1:30080").matches(&back), "{reason}");
        }
        back.reason = "new";
        assert!(!dst("10.77.0.1:30080").matches(&back));
    }

    #[test]
    fn sampling_doubles_above_the_rate_and_comes_back() {
        assert_eq!(sample_for(1, MAX_RATE), 1);
        assert_eq!(sample_for(1, MAX_RATE + 1), 2);
        assert_eq!(sample_for(2, MAX_RATE + 1), 4);
        assert_eq!(sample_for(4, MAX_RATE / 2), 4, "between the marks: kept");
        assert_eq!(sample_for(4, MAX_RATE / 4 - 1), 2);
        assert_eq!(sample_for(1, 0), 1);
        assert_eq!(sample_for(1 << 20, u64::MAX), 1 << 20, "bounded");
    }

    #[test]
    fn a_line_names_the_backend_the_reason_and_the_service_escaped() {
        let d = decision(
            Some("demo/we\nb:http"),
            "10.96.0.10:80",
            Some("10.244.1.5:8080"),
        );
        let line = render_text(&d);
        assert!(
            line.ends_with(
                "connect  translated tcp 10.96.0.10:80 => 10.244.1.5:8080 [translated] \
                 demo/we\\nb:http (random)"
            ),
            "{line}"
        );
    }
}
