//! Privileged test of `stale::destroy_udp_sockets` on the real kernel: a client in a test cgroup
//! and a test network namespace has UDP sockets connected to a "backend" that leaves; they must
//! fail within 1 s, while a socket connected to another backend keeps working.
//!
//! Needs root. Everything it creates (network namespace, cgroups, processes) has a name with
//! this process's pid and is removed by `Fixture`'s Drop, on failure too. It never touches the
//! root cgroup or an interface outside its own namespace.

use std::{
    fs,
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    thread,
    time::{Duration, Instant},
};

use svc_agent::tasks::stale::destroy_udp_sockets;

const SERVER_IP: &str = "10.250.0.2";
/// The backend that leaves.
const GONE_PORT: u16 = 5353;
/// A backend that stays.
const KEPT_PORT: u16 = 5354;

/// UDP echo server: the backend. Its socket is bound, not connected, so destroying sockets
/// connected *to* port 5353 must leave it alone (the reconnect below proves it is still there).
const SERVER: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("READY", flush=True)
while True:
    d, a = s.recvfrom(64)
    s.sendto(d, a)
"#;

/// The application. Sockets:
///   a  AF_INET  connected to ip:gone   — must be destroyed
///   m  AF_INET6 connected to ::ffff:ip:gone (v4-mapped) — must be destroyed
///   b  AF_INET  connected to ip:kept   — must keep working
///   w  AF_INET  connected to ip:gone, a thread blocked in recv() for 10 s — must wake up
/// Each loop round sends on a, m, b and receives with a 200 ms timeout, printing one line per
/// call: "START END NAME send|recv ok|timeout|err ERRNO ERRNAME", START and END being
/// CLOCK_MONOTONIC seconds around the call (Python's time.monotonic), so the test can tell
/// calls made after the destroy from lines that were merely still in the pipe. After its third
/// error a socket connects again ("... NAME reconnected"), as a resolver would.
const CLIENT: &str = r#"
import errno, socket, sys, threading, time
ip, gone, kept = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = threading.Lock()
def emit(line):
    # One write per line under a lock: print() from two threads can interleave its pieces.
    with out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
def call(name, what, f):
    t = time.monotonic()
    try:
        f()
        res = "ok"
    except socket.timeout:
        res = "timeout"
    except OSError as e:
        res = "err %d %s" % (e.errno, errno.errorcode.get(e.errno, "?"))
    emit("%.6f %.6f %s %s %s" % (t, time.monotonic(), name, what, res))
    return res
def mk(fam, addr):
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.settimeout(0.2)
    s.connect(addr)
    return s
addrs = {"a": (ip, gone), "m": ("::ffff:" + ip, gone), "b": (ip, kept)}
socks = {"a": mk(socket.AF_INET, addrs["a"]),
         "m": mk(socket.AF_INET6, addrs["m"]),
         "b": mk(socket.AF_INET, addrs["b"])}
w = mk(socket.AF_INET, (ip, gone))
w.settimeout(10)
threading.Thread(target=lambda: call("w", "recv", lambda: w.recv(64)), daemon=True).start()
errors = {n: 0 for n in socks}
ready = False
while True:
    ok = 0
    for n, s in socks.items():
        for what, f in (("send", lambda: s.send(b"ping")), ("recv", lambda: s.recv(64))):
            res = call(n, what, f)
            if res.startswith("err"):
                errors[n] += 1
            elif what == "recv" and res == "ok":
                ok += 1
        if errors[n] >= 3:
            t = time.monotonic()
            s.connect(addrs[n])
            errors[n] = 0
            emit("%.6f %.6f %s reconnected" % (t, time.monotonic(), n))
    if not ready and ok == len(socks):
        emit("READY")
        ready = True
    time.sleep(0.02)
"#;

/// Everything the test created; Drop removes it in dependency order: processes (by the pids
/// we spawned), then cgroups (which must be empty), then the namespace.
struct Fixture {
    netns: String,
    netns_created: bool,
    /// Created cgroups, parents first.
    cgroups: Vec<PathBuf>,
    children: Vec<Child>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for child in &mut self.children {
            // Child::kill signals exactly the pid we spawned (the client `exec`s into python).
            let _ = child.kill();
            let _ = child.wait();
        }
        for cg in self.cgroups.iter().rev() {
            // A killed process can take a moment to leave its cgroup.
            for _ in 0..100 {
                if fs::remove_dir(cg).is_ok() || !cg.exists() {
                    break;
                }
                thread::sleep(Duration::from_millis(10));
            }
            if cg.exists() {
                eprintln!("warning: could not remove test cgroup {}", cg.display());
            }
        }
        if self.netns_created {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.netns])
                .status();
        }
    }
}

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("running {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn cgroup2_mount() -> PathBuf {
    let mounts = fs::read_to_string("/proc/mounts").expect("reading /proc/mounts");
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
        })
        .expect("no cgroup2 mount in /proc/mounts")
}

/// Lines of a child's stdout, as they come (the scripts flush per line).
fn lines(child: &mut Child) -> Receiver<String> {
    let out = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        // Keep reading after the receiver is gone: a closed pipe would kill the script with
        // EPIPE before the fixture stops it.
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

fn wait_for(rx: &Receiver<String>, what: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l == what => return,
            Ok(_) => {}
            Err(RecvTimeoutError::Timeout) => panic!("no {what:?} within {within:?}"),
            Err(RecvTimeoutError::Disconnected) => panic!("process exited before {what:?}"),
        }
    }
}

fn spawn_server(fx: &mut Fixture, port: u16) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &fx.netns, "python3", "-c", SERVER])
        .args([SERVER_IP, &port.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the server");
    let rx = lines(&mut child);
    fx.children.push(child);
    wait_for(&rx, "READY", Duration::from_secs(10));
}

#[test]
fn destroys_connected_udp_sockets_of_a_departed_backend() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (network namespaces, cgroups, SOCK_DESTROY); run it as root"
    );

    let pid = std::process::id();
    let mut fx = Fixture {
        netns: format!("svc-stale-{pid}"),
        netns_created: false,
        cgroups: Vec::new(),
        children: Vec::new(),
    };

    run(&["ip", "netns", "add", &fx.netns]);
    fx.netns_created = true;
    run(&["ip", "-n", &fx.netns, "link", "set", "lo", "up"]);
    run(&[
        "ip",
        "-n",
        &fx.netns,
        "addr",
        "add",
        &format!("{SERVER_IP}/32"),
        "dev",
        "lo",
    ]);

    // A cgroup with the client one level down, so the search must recurse.
    let cg = cgroup2_mount().join(format!("svc-stale-test-{pid}"));
    fs::create_dir(&cg).unwrap_or_else(|e| panic!("creating {}: {e}", cg.display()));
    fx.cgroups.push(cg.clone());
    let pod = cg.join("pod");
    fs::create_dir(&pod).unwrap_or_else(|e| panic!("creating {}: {e}", pod.display()));
    fx.cgroups.push(pod.clone());

    spawn_server(&mut fx, GONE_PORT);
    spawn_server(&mut fx, KEPT_PORT);

    // Join the cgroup before the namespace: `ip netns exec` remounts /sys, which would hide
    // the cgroup path.
    let procs = pod.join("cgroup.procs");
    let mut client = Command::new("sh")
        .args([
            "-c",
            r#"echo $$ > "$1" && exec ip netns exec "$2" python3 -c "$3" "$4" "$5" "$6""#,
            "sh",
        ])
        .arg(&procs)
        .args([
            fx.netns.as_str(),
            CLIENT,
            SERVER_IP,
            &GONE_PORT.to_string(),
            &KEPT_PORT.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the client");
    let rx = lines(&mut client);
    fx.children.push(client);
    wait_for(&rx, "READY", Duration::from_secs(10));
    // Let some steady traffic through so "b keeps working" is compared against a baseline.
    thread::sleep(Duration::from_millis(200));
    while rx.try_recv().is_ok() {}

    let gone: SocketAddr = format!("{SERVER_IP}:{GONE_PORT}").parse().unwrap();
    let t0 = monotonic();
    let report = destroy_udp_sockets(&cg, &|_, peer| peer == gone).expect("destroy_udp_sockets");
    let t1 = monotonic();
    println!(
        "destroy_udp_sockets took {:.3} ms: {report:#?}",
        (t1 - t0) * 1e3
    );

    assert!(report.errors.is_empty(), "errors: {:?}", report.errors);
    assert_eq!(
        report.namespaces, 1,
        "only the client's namespace is in the cgroup"
    );
    // a, m and w; not b, not the servers.
    assert_eq!(report.destroyed(), 3, "{report:#?}");
    for s in &report.sockets {
        assert_eq!(s.remote.port(), GONE_PORT);
        assert_eq!(s.remote.ip().to_canonical(), gone.ip());
    }
    assert!(
        report.sockets.iter().any(|s| s.remote.is_ipv6()),
        "the v4-mapped IPv6 socket was not destroyed: {report:#?}"
    );

    // Watch the application for 2 s after the destroy.
    let mut calls: Vec<Call> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(2);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => {
                let c = Call::parse(&l).unwrap_or_else(|| panic!("bad client line {l:?}"));
                // Lines of calls that ended before the destroy were just late in the pipe.
                if c.end >= t0 {
                    calls.push(c);
                }
            }
            Err(RecvTimeoutError::Timeout) => break,
            Err(RecvTimeoutError::Disconnected) => panic!("client exited: {calls:#?}"),
        }
    }
    let of = |name: &str| -> Vec<&Call> { calls.iter().filter(|c| c.name == name).collect() };
    for name in ["a", "m", "w", "b"] {
        println!("--- {name} (ms since the destroy began: start..end call result):");
        let (mut oks, mut quiet) = (0, false);
        for c in of(name) {
            // Print everything but runs of successful calls, which are only counted.
            let ok = c.result == "ok";
            if !(ok && quiet) {
                println!(
                    "{:>8.1}..{:<8.1} {} {}",
                    (c.start - t0) * 1e3,
                    (c.end - t0) * 1e3,
                    c.what,
                    c.result
                );
            } else {
                oks += 1;
            }
            quiet = ok;
        }
        println!("    (and {oks} more successful calls)");
    }

    let within = t0 + 1.0;
    for name in ["a", "m"] {
        let events = of(name);
        let before_reconnect: Vec<_> = events
            .iter()
            .take_while(|c| c.what != "reconnected")
            .collect();
        let first_err = before_reconnect
            .iter()
            .find(|c| c.result.starts_with("err"))
            .unwrap_or_else(|| panic!("{name}: no error after the destroy: {events:#?}"));
        assert!(
            first_err.end < within,
            "{name}: first error only {:.3} s after the destroy",
            first_err.end - t0
        );
        // The pending abort error is reported once, by a recv(); send() on the disconnected
        // socket fails with EDESTADDRREQ.
        assert!(
            before_reconnect
                .iter()
                .any(|c| c.what == "recv" && c.result == "err 103 ECONNABORTED" && c.end < within),
            "{name}: no ECONNABORTED from recv within 1 s: {before_reconnect:#?}"
        );
        // No send made after the destroy returned reaches the old backend. A recv may still
        // return the one echo that was already queued on the socket when it was destroyed
        // (the abort does not purge the receive queue; seen in about 1 of 25 runs).
        let after: Vec<_> = before_reconnect.iter().filter(|c| c.start >= t1).collect();
        for c in &after {
            assert!(
                (c.what == "send" && c.result == "err 89 EDESTADDRREQ")
                    || (c.what == "recv"
                        && matches!(c.result.as_str(), "err 103 ECONNABORTED" | "timeout" | "ok")),
                "{name}: unexpected {c:?} after the destroy: {before_reconnect:#?}"
            );
        }
        assert!(
            after
                .iter()
                .filter(|c| c.what == "recv" && c.result == "ok")
                .count()
                <= 1,
            "{name}: more replies than echoes in flight: {before_reconnect:#?}"
        );
        // The application reconnects (through the connect hook, in production) and talks again.
        let re = events
            .iter()
            .position(|c| c.what == "reconnected")
            .unwrap_or_else(|| panic!("{name} never reconnected: {events:#?}"));
        assert!(
            events[re..]
                .iter()
                .any(|c| c.what == "recv" && c.result == "ok"),
            "{name}: no reply after reconnecting: {events:#?}"
        );
    }
    // The blocked recv() wakes up at once instead of sitting out its 10 s timeout.
    let w = of("w");
    assert!(
        matches!(w.as_slice(), [c] if c.result == "err 103 ECONNABORTED" && c.end < within),
        "blocked recv: {w:#?}"
    );
    // The socket to the backend that stays never noticed anything.
    let b = of("b");
    assert!(
        b.iter().filter(|c| c.start >= t1).count() > 20,
        "too little traffic on b: {b:#?}"
    );
    assert!(
        b.iter().all(|c| c.result == "ok"),
        "b was disturbed: {b:#?}"
    );
}

/// One line of the client: a call with its CLOCK_MONOTONIC start and end, in seconds.
#[derive(Debug)]
struct Call {
    start: f64,
    end: f64,
    name: String,
    what: String,
    result: String,
}

impl Call {
    fn parse(line: &str) -> Option<Call> {
        let mut f = line.splitn(5, ' ');
        Some(Call {
            start: f.next()?.parse().ok()?,
            end: f.next()?.parse().ok()?,
            name: f.next()?.to_string(),
            what: f.next()?.to_string(),
            result: f.next().unwrap_or("").to_string(),
        })
    }
}

/// CLOCK_MONOTONIC in seconds, the clock of the client's time.monotonic().
fn monotonic() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec for clock_gettime to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
