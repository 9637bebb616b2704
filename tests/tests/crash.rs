//! Issue 6, item 1: the agent SIGKILLed at random points while 100,000 Services appear,
//! change and disappear, and restarted each time. After each restart's first sync (and the
//! grace period it gives what it retires) the pinned maps equal the desired state exactly:
//! every master entry has all its slots, backends, reverse-NAT and name entries, the UDP and
//! sessionAffinity frontends (one Service in four each) their membership entries, and nothing
//! stray is left. A Service with real backends in the sandbox is probed after every restart.
//!
//! `SVC_CRASH_SERVICES`, `SVC_CRASH_KILLS` and `SVC_CRASH_SEED` change the size, the number of
//! kills and the random kill points (the seed is printed, so a failure can be replayed).

mod common;

use std::time::{Duration, Instant};

use std::net::{Ipv4Addr, SocketAddr};

use common::{names, sa, sandbox, web_service, web_slice, VIP};
use svc_agent::model::{DesiredFrontend, Frontend, Protocol};
use svc_tests::rng::Rng;
use svc_tests::scale::{desired_of, pinned_vs, pinned_vs_each, write_services, GenService};
use svc_tests::{Agent, Manifests};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What `common::web_service` with one ready endpoint should give.
fn web_desired(backend: Ipv4Addr) -> (Frontend, DesiredFrontend) {
    let fe = Frontend::cluster(VIP.into(), 80, Protocol::Tcp);
    (
        fe,
        DesiredFrontend::cluster_ip(
            fe,
            "demo/web:http",
            vec![SocketAddr::new(backend.into(), 8080).into()],
        ),
    )
}

/// Round `k`: Services [k·2000, k·2000 + n) (2,000 appear and 2,000 disappear per round), and
/// every eighth block of 2,000 gets new endpoints; TCP, UDP and sessionAffinity mixed.
fn round(k: u32, n: u32) -> Vec<GenService> {
    let first = k * 2000;
    (first..first + n)
        .map(|i| {
            let block = (i / 2000) % 8;
            let epoch = (k + 8 - block) / 8;
            GenService::varied(i, 3, epoch)
        })
        .collect()
}

/// The longest a restarted agent may take to retire what its first sync left unreachable,
/// beyond the grace period: generous, as the machine may be running other tests.
const RETIRED_WITHIN: Duration = Duration::from_secs(120);

#[test]
fn sigkill_at_random_points_while_services_change_leaves_exact_state() {
    let n = env_or("SVC_CRASH_SERVICES", 100_000) as u32;
    let kills = env_or("SVC_CRASH_KILLS", 20) as u32;
    let mut rng = Rng::from_env("SVC_CRASH_SEED");
    let seed = rng.0;
    eprintln!("crash test: {n} services, {kills} kills, SVC_CRASH_SEED={seed}");

    let sb = sandbox();
    let m = Manifests::new().unwrap();
    let _backends = sb.backends(2, &[8080]).unwrap();
    m.apply_service(&web_service()).unwrap();
    let canary = |k: u32| -> &'static [u8] {
        if k.is_multiple_of(2) {
            &[1]
        } else {
            &[2]
        }
    };
    let want = |k: u32| {
        let mut d = desired_of(&round(k, n));
        let (fe, df) = web_desired(sb.backend_v4(canary(k)[0]));
        d.cluster_ips.insert(fe.ip);
        d.frontends.insert(fe, df);
        d
    };
    let write = |k: u32| {
        write_services(m.dir(), m.scratch(), &round(k, n)).unwrap();
        m.apply_slice(&web_slice(&sb, canary(k), &[])).unwrap();
    };
    write(0);
    let bpffs = sb.bpffs().unwrap();
    let mut agent = Agent::start(
        &sb.tools.agent,
        m.dir(),
        sb.cgroup().path(),
        bpffs.path(),
        &["--poll-ms", "20"],
        m.scratch(),
    )
    .unwrap();
    agent.quiet();
    let t0 = Instant::now();
    agent.wait_ready(Duration::from_secs(300)).unwrap();
    let startup = t0.elapsed();

    // One change without a kill, to time a sync.
    write(1);
    let t0 = Instant::now();
    agent
        .wait_for_lines(svc_tests::agent::SYNCED_LINE, 2, Duration::from_secs(120))
        .unwrap();
    let sync = t0.elapsed();
    eprintln!("start-up to ready: {startup:?}; one change: {sync:?}");

    let grace = Duration::from_millis(1500);
    let mut damaged = 0;
    let mut k = 1;
    let mut killed = 0;
    // 100,000 Services' desired state: made once per round, and the previous round's kept.
    let mut wanted = want(k);
    // Where after a write the kills land, [earliest, latest), learnt as the rounds go: a kill
    // that found the old state whole came before the agent wrote anything (the window moves
    // up, as wide), one that found the new state whole came after it was done (the window
    // ends there). The machine's load stretches and shrinks a sync between the one timed
    // above and the later ones; without this, a loaded run put most kills before the writing
    // began. The width is the change timed above only at first: a CI run's start timed it at
    // 7.1 s where its later rounds took 1–2, and widening the window by that much again
    // after each kill too early left 1 of 13 restarts with damage to repair.
    let mut earliest = Duration::ZERO;
    let mut latest = sync + grace;
    // Restarts with a change cut short to repair: at least this many, with up to twice the
    // kills asked for to find them.
    let damage_wanted = (kills / 4).max(1);
    let mut outcomes = Vec::new();
    while killed < kills || (damaged < damage_wanted && killed < 2 * kills) {
        k += 1;
        let before = std::mem::replace(&mut wanted, want(k));
        write(k);
        // Kill while it notices the change, syncs it, retires what the sync made
        // unreachable, or idles.
        let at = earliest + rng.below(latest.saturating_sub(earliest));
        std::thread::sleep(at);
        agent.kill().unwrap();
        killed += 1;
        // Sometimes also kill the next agent during its own start and first sync.
        let twice = killed < kills && rng.next_u64().is_multiple_of(3);
        if twice {
            agent.restart().unwrap();
            std::thread::sleep(rng.below(startup));
            agent.kill().unwrap();
            killed += 1;
        }
        // Neither the old state nor the new one (nor either with its retirements done): the
        // kill cut a change short, and the next agent has something to repair.
        let [to_new, to_old]: [Vec<String>; 2] = pinned_vs_each(bpffs.path(), &[&wanted, &before])
            .unwrap()
            .try_into()
            .unwrap();
        let cut_short = !to_new.is_empty() && !to_old.is_empty();
        if cut_short {
            damaged += 1;
        }
        let outcome = if twice {
            "killed twice"
        } else if cut_short {
            "cut short"
        } else if to_old.is_empty() {
            // Too early: the writing began after `at`.
            let width = latest.saturating_sub(earliest);
            earliest = at.mul_f64(0.75);
            latest = latest.max(earliest + width);
            "too early"
        } else {
            // Too late: the writing (and its retirements) ended before `at`.
            latest = at;
            earliest = earliest.min(latest / 2);
            "too late"
        };
        outcomes.push(format!("{at:.2?} {outcome}"));
        agent.restart().unwrap();
        agent
            .wait_ready(Duration::from_secs(300))
            .unwrap_or_else(|e| panic!("restart after kill {killed}: {e:#}"));
        // Entries the sync made unreachable are retired a grace period after it (1 s), on a
        // loaded machine later: those alone are waited for; anything a reader reaches is
        // checked at once.
        std::thread::sleep(grace);
        let waited = Instant::now();
        let mut checks = 0;
        let problems = loop {
            checks += 1;
            let problems = pinned_vs(bpffs.path(), &wanted).unwrap();
            let unreachable_only = problems
                .iter()
                .all(|p| p.contains(" stray ") && p.ends_with(" entries"));
            if problems.is_empty() || !unreachable_only || waited.elapsed() > RETIRED_WITHIN {
                break problems;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        assert!(
            problems.is_empty(),
            "after kill {killed} (round {k}, SVC_CRASH_SEED={seed}), {} problems: {:#?}\n{}",
            problems.len(),
            &problems[..problems.len().min(20)],
            agent.all_logs()
        );
        let r = sb.tcp(sa(VIP, 80), 3, &[]).unwrap();
        assert!(r.all_ok(), "after kill {killed}: {r:?}");
        assert_eq!(
            names(&r),
            [format!("b{}", canary(k)[0])].into_iter().collect(),
            "after kill {killed}"
        );
        eprintln!(
            "kill {killed} ({}): the maps {} before the restart; exact after it{}",
            outcomes.last().map_or("", String::as_str),
            if cut_short {
                "were left mid-change"
            } else {
                "were whole"
            },
            if checks > 1 {
                format!(" (leftovers retired after {checks} checks)")
            } else {
                String::new()
            }
        );
    }
    eprintln!("{damaged} of {} restarts found a change cut short", k - 1);
    // Kills that only ever hit an idle agent would prove nothing.
    assert!(
        damaged >= damage_wanted,
        "only {damaged} restarts found damage to repair; the kills (after the write, what \
         they found): {outcomes:?}"
    );
}
