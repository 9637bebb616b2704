//! Loading the object with its maps adopted, created or migrated, and the store over them.

use std::os::fd::AsFd;
use std::path::Path;

use aya::maps::{Array, HashMap, IterableMap, LpmTrie, Map, MapData};
use aya::programs::{CgroupSock, CgroupSockAddr, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use svc_common::{catalogue, map_names};
use tracing::info;

use super::cgroup::{check_cgroup, check_other_svc};
use super::lock::{lock_dir, own_dir};
use super::migrate::{
    carry_backends_v1, carry_ct_of_layout, carry_ct_v1, carry_maglev_v1, carry_slots_v1, clone_map,
    migrate, CT_LAYOUTS_OF_THIS_VALUE,
};
use super::pins::{
    adopt_unversioned, create_own, inspect_pin, map_pin, max_entries, other_versions, pinned_maps,
    staged_pin, Pinned,
};
use super::{
    load_err, xdp, Datapath, TcMode, XdpMode, OBJECT, PROGRAMS, SWEEP_PROGRAM, TC_PROGRAMS,
};
use crate::error::Result;
use crate::store::{BpfStore, Capacity};
use crate::sys;

impl Datapath {
    /// Takes ownership of `dir`, adopts (or creates, or migrates) the maps, and starts the
    /// programs' verification on a thread (`Programs::verify`). Nothing is attached yet: see
    /// [`Datapath::attach`]. On error the pins of the programs and maps already attached
    /// are as they were (the programs keep serving what they served), but maps this call
    /// created may stay pinned, some entries in them (a carry of an older layout that
    /// failed); the next start adopts them. `kernel`: the fallbacks the programs are loaded with
    /// (`features::Report::fit`). `xdp` is `--xdp-mode`: the XDP program is loaded only if
    /// it asks for XDP.
    pub fn open(
        dir: &Path,
        cgroup: &Path,
        capacity: Capacity,
        kernel: crate::features::Fit,
        xdp: XdpMode,
    ) -> Result<Datapath> {
        let started = std::time::Instant::now();
        let cgroup_id = check_cgroup(cgroup)?;
        sys::ensure_bpffs(dir).map_err(|e| load_err("mounting bpffs at /sys/fs/bpf", e))?;
        own_dir(dir)?;
        let (lock, dir_ino) = lock_dir(dir)?;
        // Before anything is loaded: the lock covers this directory alone, and an agent with
        // another directory on the same cgroup would attach beside the first and serve
        // nothing, the first's programs answering every connect().
        check_other_svc(dir, cgroup, cgroup_id)?;
        adopt_unversioned(dir);

        let mut plans = Vec::new();
        for map in pinned_maps() {
            let want = max_entries(map, &capacity);
            plans.push((map, inspect_pin(map, &map_pin(dir, map.name), want)?));
        }
        let globals = kernel.globals();
        let mut loader = EbpfLoader::new();
        for (name, value) in &globals {
            loader.override_global(name, value, true);
        }
        // The index of a backend id is the id modulo the map's size, which the programs must
        // know as the agent does: the map is made (or migrated to) this size.
        let backends = capacity.backends;
        loader.override_global(svc_common::kernel_globals::BACKENDS, &backends, true);
        for (map, plan) in &plans {
            if matches!(plan, Pinned::Adopt) {
                loader.map_pin_path(map.name, map_pin(dir, map.name));
            }
            if let Some(n) = capacity.of(map.name) {
                loader.map_max_entries(map.name, n);
            }
        }
        let mut ebpf = loader
            .load(OBJECT)
            .map_err(|e| load_err("loading the eBPF object", e))?;
        let object_ms = started.elapsed().as_millis();
        // Maps this object does not declare: those the agent writes are its own (created or
        // adopted here, and filled by the first sync before any program could read them);
        // the others (the packet datapath's, read only) wait for an object that has them.
        let mut own: Vec<(&'static str, MapData)> = Vec::new();
        for (map, plan) in plans.iter_mut() {
            let name = map.name;
            if ebpf.map(name).is_some() {
                continue;
            }
            let plan = std::mem::replace(plan, Pinned::Adopt);
            if !map.owned {
                continue;
            }
            let path = map_pin(dir, name);
            let data = match plan {
                Pinned::Adopt => {
                    MapData::from_pin(&path).map_err(|e| load_err(path.display(), e))?
                }
                Pinned::Create | Pinned::Migrate(_) => {
                    // A resized map of its own: no program reads it, so a new empty one takes
                    // the pin at once; the first sync writes its entries.
                    let data = create_own(map, &capacity)?;
                    let _ = std::fs::remove_file(&path);
                    data.pin(&path).map_err(|e| load_err(path.display(), e))?;
                    info!(
                        map = name,
                        "created (the loaded object does not declare it)"
                    );
                    data
                }
            };
            own.push((name, data));
        }
        // Programs missing from the object are refused here, before anything is written;
        // the kernel's verdict on the rest comes from the verifying thread.
        for name in PROGRAMS {
            ebpf.program(name)
                .ok_or_else(|| load_err(name, "program missing from the object"))?;
        }
        let mut tc_loaded = Vec::new();
        for (name, _, _) in TC_PROGRAMS {
            if ebpf.program(name).is_none() {
                info!(
                    program = name,
                    "not in the eBPF object: the packet datapath (NodePort, ExternalIP, \
                     LoadBalancer, per-packet ClusterIP) is not attached; its maps are kept \
                     up to date for an object that has it"
                );
                continue;
            }
            tc_loaded.push(name);
        }
        // Verified with the tc programs, on their thread (`load_tc`): it attaches with them,
        // and its verification (tc's frontend code, shared) must not delay the socket path.
        // Only when the mode asks for it: `off` never attaches it (a link an earlier agent
        // pinned is detached without it), and a kernel's verifier may refuse it (Debian 12's
        // 6.1: too large) where the tc programs serve.
        let xdp_loaded =
            kernel.xdp && xdp != XdpMode::Off && ebpf.program(xdp::XDP_PROGRAM).is_some();
        let mut store = store_from(&mut ebpf, own, capacity)?;

        let mut staged = Vec::new();
        // A resized SVC_MAGLEV copies the regions the index names: the index first.
        plans.sort_by_key(|(map, _)| map.name == map_names::MAGLEV);
        for (map, plan) in plans {
            let name = map.name;
            match plan {
                Pinned::Adopt => {}
                Pinned::Create => {
                    let path = map_pin(dir, name);
                    let pinned = match store_map(&store, name) {
                        Some(map) => map.pin(&path),
                        // Kept in the object (SVC_XDP_DEVS, which the XDP attachment writes).
                        None => match ebpf.map(name) {
                            Some(map) => map.pin(&path),
                            None => continue,
                        },
                    };
                    pinned.map_err(|e| load_err(path.display(), e))?;
                }
                Pinned::Migrate(old) => {
                    let n = migrate(&mut store, name, &old, false)?;
                    info!(map = name, entries = n, "copied into the resized map");
                    let path = staged_pin(dir, name);
                    let _ = std::fs::remove_file(&path);
                    held(&store, name)?
                        .pin(&path)
                        .map_err(|e| load_err(path.display(), e))?;
                    staged.push(name);
                }
            }
        }
        // The verifier's work is most of a start, and nothing reads the programs before they
        // are attached: they are verified on a thread of their own while the first sync is
        // listed, translated and written into the maps (created already). The socket programs
        // first, which attach after that sync (`attach_sockets` waits for them), then the tc
        // programs, which attach once they are done.
        let (programs, verified, sockets) =
            Programs::verify(ebpf, tc_loaded.clone(), xdp_loaded, started);
        let carried = carry_ct_v1(&mut store, dir)?;
        if carried > 0 {
            info!(
                map = map_names::CT,
                entries = carried,
                "carried the flows of layout 1 over (untracked: their RSTs and FINs are taken \
                 as before)"
            );
        }
        for layout in CT_LAYOUTS_OF_THIS_VALUE {
            let carried = carry_ct_of_layout(&mut store, dir, layout)?;
            if carried > 0 {
                info!(
                    map = map_names::CT,
                    entries = carried,
                    "carried the flows of layout {layout} over (assured ones to the assured table)"
                );
            }
        }
        let (carried, collided) = carry_backends_v1(&mut store, dir)?;
        if carried > 0 || collided > 0 {
            info!(
                map = map_names::BACKENDS,
                entries = carried,
                collided,
                "carried the backends of layout 1 (a hash) over into the array; those whose \
                 index another took are written again by the first sync"
            );
        }
        let carried = carry_maglev_v1(&mut store, dir)?;
        if carried > 0 {
            info!(
                map = map_names::MAGLEV,
                blocks = carried,
                "carried the Maglev tables of layout 1 (an array) over into pages"
            );
        }
        let carried = carry_slots_v1(&mut store, dir)?;
        if carried > 0 {
            info!(
                map = map_names::SLOTS,
                entries = carried,
                "carried the frontends of the slots map of layout 1 over, eight slots an entry"
            );
        }
        // Before any program of this object reads the filter: it may be new, or the
        // addresses may have been carried into a resized map. Bits are only added: the
        // programs still attached may read it beside another map of addresses.
        store.sync_node_addr_bits(false)?;
        // Before the first sync, which counts on every named frontend having its counters
        // (and, with per-Service counting off, none having any).
        // Not fatal: a burst of allocations can fail for a moment (ENOMEM) until the kernel's
        // caches refill; the agent's periodic check creates what is missing.
        match store.sync_service_stats() {
            Ok((0, 0)) => {}
            Ok((created, deleted)) => info!(
                map = map_names::SERVICE_STATS,
                created, deleted, "per-Service counters brought in line with the names"
            ),
            Err(e) => tracing::warn!("per-Service counters: {e}; completed later"),
        }
        // A kernel that cannot be asked is taken as having tcx: attaching then says why not.
        let kernel_tcx = crate::features::has_tcx().unwrap_or_else(|e| {
            tracing::warn!("asking the kernel for tcx: {e}; trying tcx");
            true
        });
        info!(
            object_ms = object_ms as u64,
            maps_ms = started.elapsed().as_millis() as u64,
            "loaded the maps; the programs are being verified"
        );
        Ok(Datapath {
            dir: dir.to_path_buf(),
            lock,
            dir_ino,
            programs,
            verified,
            sockets,
            store,
            cgroup: cgroup.to_path_buf(),
            cgroup_id,
            attached: false,
            packet_attached: false,
            staged,
            obsolete: other_versions(dir),
            tc_loaded,
            tc_devices: (Vec::new(), Vec::new()),
            tc_current: Default::default(),
            xdp_mode: xdp,
            xdp_loaded,
            xdp_current: Default::default(),
            xdp_no_xmit: Default::default(),
            xdp_refused: Default::default(),
            tc_mode: if kernel_tcx {
                TcMode::Tcx
            } else {
                TcMode::Classic
            },
            kernel_tcx,
            tc_classic: None,
            sweep: None,
        })
    }

    /// A descriptor of the connection-tracking sweep, loaded on the first call, for a thread
    /// of its own; None when the object has none. Loaded only when asked for: a kernel that
    /// refuses it leaves the datapath running unswept (the start check refuses a kernel
    /// before bpf_for_each_map_elem, 5.13, for the sweep's callback: features.rs).
    pub fn ct_sweep(&mut self) -> Result<Option<std::os::fd::OwnedFd>> {
        if self.sweep.is_none() {
            let Some(prog) = ebpf(&mut self.programs)?.program_mut(SWEEP_PROGRAM) else {
                return Ok(None);
            };
            let prog =
                <&mut SchedClassifier>::try_from(prog).map_err(|e| load_err(SWEEP_PROGRAM, e))?;
            prog.load().map_err(|e| load_err(SWEEP_PROGRAM, e))?;
            let fd = prog.fd().map_err(|e| load_err(SWEEP_PROGRAM, e))?;
            self.sweep = Some(
                fd.as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| load_err(SWEEP_PROGRAM, e))?,
            );
        }
        match &self.sweep {
            Some(fd) => fd
                .try_clone()
                .map(Some)
                .map_err(|e| load_err(SWEEP_PROGRAM, e)),
            None => Ok(None),
        }
    }

    /// A second handle on one of the agent's maps, for a thread of its own.
    pub fn reopen(&self, name: &'static str) -> Result<Map> {
        let data = clone_map(held(&self.store, name)?)?;
        Map::from_map_data(data).map_err(|e| load_err(name, e))
    }
}

/// The object's programs: being verified on a thread (the socket programs, then the tc and
/// XDP programs), or all loaded, or refused.
pub(super) enum Programs {
    Verifying(std::thread::JoinHandle<(Ebpf, Result<()>)>),
    Loaded(Ebpf),
    /// A program failed to load (the error's message and errno): nothing more of this object
    /// may be attached.
    Failed(Refusal),
}

/// Why a program cannot be attached: the kernel's refusal, or a verifying thread that ended
/// without an answer. Kept to be told again whenever asked, as `Error` is not `Clone`.
pub(super) struct Refusal {
    message: String,
    errno: Option<crate::error::Errno>,
}

impl Refusal {
    fn of(e: &crate::Error) -> Refusal {
        match e {
            crate::Error::Load { message, errno } => Refusal {
                message: message.clone(),
                errno: *errno,
            },
            other => Refusal::new(other.to_string()),
        }
    }

    fn new(message: String) -> Refusal {
        Refusal {
            message,
            errno: None,
        }
    }

    fn error(&self) -> crate::Error {
        crate::Error::Load {
            message: self.message.clone(),
            errno: self.errno,
        }
    }
}

impl Programs {
    /// The object once every program is loaded; None while they are verified or after one
    /// failed (`ebpf` waits for them and says why).
    pub(super) fn loaded(&self) -> Option<&Ebpf> {
        match self {
            Programs::Loaded(ebpf) => Some(ebpf),
            _ => None,
        }
    }

    /// Starts verifying on a thread the socket programs of `ebpf`, then its tc programs `tc`,
    /// then the XDP program if `xdp`. The receiver turns true once that thread is done
    /// (whether they loaded or not), for a caller that must not wait for it; the socket
    /// programs' descriptors come as soon as they are loaded. A socket program the kernel
    /// refuses ends the thread with that refusal: nothing more is loaded.
    fn verify(
        mut ebpf: Ebpf,
        tc: Vec<&'static str>,
        xdp: bool,
        started: std::time::Instant,
    ) -> (Programs, tokio::sync::watch::Receiver<bool>, Sockets) {
        let (done, verified) = tokio::sync::watch::channel(false);
        let (sockets_tx, sockets_rx) = std::sync::mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("svc-verify".into())
            .spawn(move || {
                // Set however the thread ends, a panic included (which `ebpf` then reports):
                // the controller stops the agent on what it finds then.
                let _done = Done(done);
                fail::fail_point!(crate::fault::SOCKET_VERIFY_PAUSE);
                let r = match load_sockets(&mut ebpf) {
                    Ok(fds) => {
                        info!(
                            ms = started.elapsed().as_millis() as u64,
                            "loaded the socket programs"
                        );
                        let _ = sockets_tx.send(Ok(fds));
                        load_tc(&mut ebpf, &tc)
                    }
                    Err(e) => {
                        let _ = sockets_tx.send(Err(Refusal::of(&e)));
                        Err(e)
                    }
                };
                if r.is_ok() && xdp {
                    load_xdp(&mut ebpf);
                }
                if r.is_ok() && !tc.is_empty() {
                    info!(
                        ms = started.elapsed().as_millis() as u64,
                        "loaded the tc programs"
                    );
                }
                fail::fail_point!(crate::fault::TC_VERIFY_PAUSE);
                #[cfg(feature = "failpoints")]
                let r = match fail::eval(crate::fault::TC_REFUSED, |v| v) {
                    Some(Some(name)) if r.is_ok() => Err(load_err(
                        name,
                        "refused by the kernel (SVC_TEST_TC_REFUSED, a test's fault)",
                    )),
                    _ => r,
                };
                (ebpf, r)
            });
        let sockets = Sockets::Verifying(sockets_rx);
        match spawned {
            Ok(handle) => (Programs::Verifying(handle), verified, sockets),
            Err(e) => (
                Programs::Failed(Refusal::new(format!("starting the verifying thread: {e}"))),
                tokio::sync::watch::channel(true).1,
                sockets,
            ),
        }
    }
}

/// Turns the verifying thread's `watch` true when dropped.
struct Done(tokio::sync::watch::Sender<bool>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// The socket programs' own descriptors by name (each of `PROGRAMS`), so that they attach
/// while the object is still on the verifying thread.
pub(super) type SocketFds = Vec<(&'static str, std::os::fd::OwnedFd)>;

/// The socket programs: being verified (their descriptors come from the verifying thread),
/// loaded, or refused.
pub(super) enum Sockets {
    Verifying(std::sync::mpsc::Receiver<std::result::Result<SocketFds, Refusal>>),
    Loaded(SocketFds),
    Failed(Refusal),
}

impl Sockets {
    /// Their descriptors, once the kernel has verified them: waits for that.
    pub(super) fn wait(&mut self) -> Result<&SocketFds> {
        if let Sockets::Verifying(rx) = self {
            *self = match rx.recv() {
                Ok(Ok(fds)) => Sockets::Loaded(fds),
                Ok(Err(refusal)) => Sockets::Failed(refusal),
                Err(_) => Sockets::Failed(Refusal::new(
                    "the verifying thread ended before the socket programs were loaded".into(),
                )),
            };
        }
        match self {
            Sockets::Loaded(fds) => Ok(fds),
            Sockets::Failed(refusal) => Err(refusal.error()),
            Sockets::Verifying(_) => Err(crate::Error::load(
                "the socket programs: still verifying".into(),
            )),
        }
    }
}

/// Loads the socket programs: their descriptors.
fn load_sockets(ebpf: &mut Ebpf) -> Result<SocketFds> {
    let mut fds = Vec::new();
    for name in PROGRAMS {
        let prog = ebpf
            .program_mut(name)
            .ok_or_else(|| load_err(name, "program missing from the object"))?;
        if name == sys::SOCK_RELEASE {
            <&mut CgroupSock>::try_from(&mut *prog)
                .map_err(|e| load_err(name, e))?
                .load()
        } else {
            <&mut CgroupSockAddr>::try_from(&mut *prog)
                .map_err(|e| load_err(name, e))?
                .load()
        }
        .map_err(|e| load_err(name, e))?;
        let fd = prog
            .fd()
            .map_err(|e| load_err(name, e))?
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| load_err(name, e))?;
        #[cfg(feature = "failpoints")]
        if let Some(Some(refused)) = fail::eval(crate::fault::SOCKET_REFUSED, |v| v) {
            if refused == name {
                return Err(load_err(
                    name,
                    "refused by the kernel (SVC_TEST_SOCKET_REFUSED, a test's fault)",
                ));
            }
        }
        fds.push((name, fd));
    }
    Ok(fds)
}

/// Loads the tc programs `names`.
fn load_tc(ebpf: &mut Ebpf, names: &[&'static str]) -> Result<()> {
    for &name in names {
        let prog = ebpf
            .program_mut(name)
            .ok_or_else(|| load_err(name, "program missing from the object"))?;
        <&mut SchedClassifier>::try_from(prog)
            .map_err(|e| load_err(name, e))?
            .load()
            .map_err(|e| load_err(name, e))?;
    }
    Ok(())
}

/// Loads the XDP program. A kernel that refuses it leaves it unloaded, which leaves every
/// device to tc (`Datapath::attach_xdp_one`), warned about here, once, with the verifier's
/// words: the tc programs serve the same flows, so the agent goes on.
fn load_xdp(ebpf: &mut Ebpf) {
    #[cfg(feature = "failpoints")]
    if fail::eval(crate::fault::XDP_REFUSED, |_| ()).is_some() {
        tracing::warn!(
            "{}: refused by the kernel (SVC_TEST_XDP_REFUSED, a test's fault): every device \
             left to tc",
            xdp::XDP_PROGRAM
        );
        return;
    }
    let Some(prog) = ebpf.program_mut(xdp::XDP_PROGRAM) else {
        return;
    };
    let loaded = match <&mut aya::programs::Xdp>::try_from(prog) {
        Ok(prog) => prog.load(),
        Err(e) => Err(e),
    };
    if let Err(e) = loaded {
        tracing::warn!(
            "{}: refused by the kernel ({}): every device left to tc",
            xdp::XDP_PROGRAM,
            xdp::refusal(&e)
        );
    }
}

/// The loaded object, once its programs are verified; the error of one that failed. A
/// function of the field alone, so the datapath's other fields stay free to borrow.
pub(super) fn ebpf(programs: &mut Programs) -> Result<&mut Ebpf> {
    if matches!(programs, Programs::Verifying(_)) {
        let taken = std::mem::replace(programs, Programs::Failed(Refusal::new(String::new())));
        if let Programs::Verifying(handle) = taken {
            *programs = match handle.join() {
                Ok((ebpf, Ok(()))) => Programs::Loaded(ebpf),
                Ok((_, Err(e))) => Programs::Failed(Refusal::of(&e)),
                Err(_) => Programs::Failed(Refusal::new(
                    "the thread verifying the programs panicked".into(),
                )),
            };
        }
    }
    match programs {
        Programs::Loaded(ebpf) => Ok(ebpf),
        Programs::Failed(refusal) => Err(refusal.error()),
        Programs::Verifying(_) => Err(crate::Error::load(
            "the tc programs: still verifying".into(),
        )),
    }
}

impl Datapath {
    /// The error of a program the kernel refused, once the tc programs' verification has
    /// ended (None before: this never waits for it): this agent can never attach them.
    pub fn load_failed(&mut self) -> Option<crate::Error> {
        if !self.programs_verified() {
            return None;
        }
        ebpf(&mut self.programs).err()
    }

    /// Whether the tc programs' verification has ended, loaded or refused: `attach` then
    /// does not wait.
    pub fn programs_verified(&self) -> bool {
        *self.verified.borrow()
    }

    /// Turns true when the tc programs' verification ends, for a loop that waits on it.
    pub fn verified_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.verified.clone()
    }
}

/// The store's map of that name; None for a name the store does not hold.
pub(super) fn store_map<'a>(store: &'a BpfStore, name: &str) -> Option<&'a MapData> {
    Some(match name {
        map_names::SERVICES => store.services.map(),
        map_names::SLOTS => store.slots.map(),
        map_names::BACKENDS => store.backends.map(),
        map_names::REV_NAT => store.rev_nat.map(),
        map_names::NAMES => store.names.map(),
        map_names::AFFINITY => store.affinity.map(),
        map_names::SOCK_REV => store.sock_rev.map(),
        map_names::AFFINITY_MATCH => store.affinity_match.map(),
        map_names::SOCK_STATE => &store.sock_state,
        map_names::META => store.meta.map(),
        map_names::SRC_RANGES => store.src_ranges.map(),
        map_names::NODE_ADDRS => store.node_addrs.map(),
        map_names::NODE_ADDR_BITS => store.node_addr_bits.map(),
        map_names::CONFIG => store.config.map(),
        map_names::CT => store.ct.as_ref()?,
        map_names::CT_NEW => store.ct_new.as_ref()?,
        map_names::DEV_STATS => store.dev_stats.as_ref()?,
        map_names::MAGLEV => store.maglev.as_ref()?.map(),
        map_names::MAGLEV_INDEX => store.maglev_index.as_ref()?.map(),
        map_names::MON_RING_0 => store.mon_rings[0].as_ref()?,
        map_names::MON_RING_1 => store.mon_rings[1].as_ref()?,
        map_names::MON_RING_2 => store.mon_rings[2].as_ref()?,
        map_names::MON_RING_3 => store.mon_rings[3].as_ref()?,
        map_names::MON_CTL => store.mon_ctl.as_ref()?,
        map_names::MON_ON => store.mon_on.as_ref()?,
        map_names::MON_STATS => store.mon_stats.as_ref()?,
        map_names::SERVICE_STATS => store.service_stats.as_ref()?.map(),
        _ => return None,
    })
}

/// `store_map`, for a name that must be there.
pub(super) fn held<'a>(store: &'a BpfStore, name: &str) -> Result<&'a MapData> {
    store_map(store, name).ok_or_else(|| load_err(name, "not a map the agent holds"))
}

fn store_from(
    ebpf: &mut Ebpf,
    mut own: Vec<(&'static str, MapData)>,
    capacity: Capacity,
) -> Result<BpfStore> {
    let mut take = |name: &'static str| match ebpf.take_map(name) {
        Some(m) => Ok(m),
        None => match own.iter().position(|(n, _)| *n == name) {
            Some(i) => Map::from_map_data(own.swap_remove(i).1).map_err(|e| load_err(name, e)),
            None => Err(load_err(name, "map missing from the object")),
        },
    };
    build_store(&mut take, capacity)
}

fn build_store(
    take: &mut dyn FnMut(&'static str) -> Result<Map>,
    capacity: Capacity,
) -> Result<BpfStore> {
    fn hash<K: aya::Pod, V: aya::Pod>(
        take: &mut dyn FnMut(&'static str) -> Result<Map>,
        name: &'static str,
    ) -> Result<HashMap<MapData, K, V>> {
        HashMap::try_from(take(name)?).map_err(|e| load_err(name, e))
    }
    Ok(BpfStore {
        services: hash(take, map_names::SERVICES)?,
        slots: hash(take, map_names::SLOTS)?,
        backends: Array::try_from(take(map_names::BACKENDS)?)
            .map_err(|e| load_err(map_names::BACKENDS, e))?,
        backends_v1: None,
        rev_nat: hash(take, map_names::REV_NAT)?,
        names: hash(take, map_names::NAMES)?,
        affinity: hash(take, map_names::AFFINITY)?,
        affinity_match: hash(take, map_names::AFFINITY_MATCH)?,
        sock_rev: hash(take, map_names::SOCK_REV)?,
        sock_state: match take(map_names::SOCK_STATE)? {
            Map::SkStorage(data) => data,
            other => {
                return Err(load_err(
                    map_names::SOCK_STATE,
                    format!("not socket storage: {other:?}"),
                ))
            }
        },
        meta: Array::try_from(take(map_names::META)?).map_err(|e| load_err(map_names::META, e))?,
        src_ranges: LpmTrie::try_from(take(map_names::SRC_RANGES)?)
            .map_err(|e| load_err(map_names::SRC_RANGES, e))?,
        node_addrs: hash(take, map_names::NODE_ADDRS)?,
        node_addr_bits: Array::try_from(take(map_names::NODE_ADDR_BITS)?)
            .map_err(|e| load_err(map_names::NODE_ADDR_BITS, e))?,
        addr_bits: Default::default(),
        config: Array::try_from(take(map_names::CONFIG)?)
            .map_err(|e| load_err(map_names::CONFIG, e))?,
        ct: take(map_names::CT).ok().and_then(map_data),
        ct_new: take(map_names::CT_NEW).ok().and_then(map_data),
        dev_stats: take(map_names::DEV_STATS).ok().and_then(map_data),
        maglev: take(map_names::MAGLEV)
            .ok()
            .and_then(|m| HashMap::try_from(m).ok()),
        maglev_v1: None,
        maglev_index: take(map_names::MAGLEV_INDEX)
            .ok()
            .and_then(|m| HashMap::try_from(m).ok()),
        mon_rings: svc_common::MON_RINGS.map(|name| take(name).ok().and_then(map_data)),
        mon_ctl: take(map_names::MON_CTL).ok().and_then(map_data),
        mon_on: take(map_names::MON_ON).ok().and_then(map_data),
        mon_stats: take(map_names::MON_STATS).ok().and_then(map_data),
        service_stats: take(map_names::SERVICE_STATS)
            .ok()
            .and_then(|m| HashMap::try_from(m).ok()),
        capacity,
        enomem_until: None,
        stats_pending: Vec::new(),
        batch_writes: true,
        dirty: None,
    })
}

/// The map behind the kinds of `Map` the agent keeps untyped.
fn map_data(m: Map) -> Option<MapData> {
    match m {
        Map::LruHashMap(d)
        | Map::PerCpuHashMap(d)
        | Map::HashMap(d)
        | Map::Array(d)
        | Map::PerCpuArray(d)
        | Map::RingBuf(d) => Some(d),
        _ => None,
    }
}

/// Opens the maps pinned under `dir`, for listing; loads and attaches nothing, takes no lock.
pub fn open_pinned(dir: &Path) -> Result<BpfStore> {
    let mut capacity = Capacity::default();
    for name in map_names::ALL {
        if let Ok(info) = MapData::from_pin(map_pin(dir, name)).and_then(|m| m.info()) {
            capacity.set(name, info.max_entries());
        }
    }
    build_store(
        &mut |name| match (pinned(dir, name), catalogue::find(name)) {
            // Pinned by an agent from before the packet datapath: nothing to list there.
            (Err(_), Some(map)) if map.owned => {
                Map::from_map_data(create_own(map, &capacity)?).map_err(|e| load_err(name, e))
            }
            (other, _) => other,
        },
        capacity,
    )
}

pub(super) fn pinned(dir: &Path, name: &'static str) -> Result<Map> {
    let path = map_pin(dir, name);
    let data = MapData::from_pin(&path).map_err(|e| {
        load_err(
            path.display(),
            format!("{e} (is svc-agent running with --bpffs {}?)", dir.display()),
        )
    })?;
    Map::from_map_data(data).map_err(|e| load_err(name, e))
}
