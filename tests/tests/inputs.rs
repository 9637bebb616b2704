//! Bad manifests never take the agent or the good services down, and the agent says which
//! file or object it rejected.

mod common;

use std::time::Duration;

use anyhow::{ensure, Result};
use common::{names, poll, sa, set, web_service, web_slice, World, VIP};
use svc_tests::{Manifests, Service, ServicePort};

#[test]
fn bad_input_is_reported_and_isolated() {
    let mut w = World::start(2, &[8080], |sb, m| {
        m.write_raw("garbage.yaml", "{{{ this: is: not [yaml\n\t-")
            .unwrap();
        // A Service whose only port is out of range, next to a good one.
        let mut bad = Service::new("demo", "broken", "10.96.0.40")
            .port(ServicePort::tcp(80).target(8080))
            .to_value();
        bad["spec"]["ports"][0]["port"] = 70000.into();
        m.write_value("svc-demo-broken.yaml", &bad).unwrap();
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    assert!(
        w.agent.exited().unwrap().is_none(),
        "agent died:\n{}",
        w.agent.log()
    );
    let r = w.sb.tcp(sa(VIP, 80), 20, &[]).unwrap();
    assert!(r.all_ok(), "failures: {:?}", r.failures());
    assert_eq!(names(&r), set(&["b1", "b2"]));
    let log = w.agent.log();
    assert!(
        log.contains("garbage.yaml"),
        "log does not name the bad file:\n{log}"
    );
    assert!(
        log.contains("broken"),
        "log does not name the bad Service:\n{log}"
    );
    let list = w.agent.list().unwrap();
    assert!(list.frontend("10.96.0.40:80/TCP").is_none(), "{list:?}");

    // Garbage arriving while the agent runs: still alive, still serving, and named.
    w.m.write_raw("later.yaml", "kind: [unterminated\n")
        .unwrap();
    w.m.apply_slice(&web_slice(&w.sb, &[2], &[])).unwrap();
    poll(Duration::from_secs(1), || {
        let r = w.sb.tcp(sa(VIP, 80), 5, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b2"])).then_some(()))
    })
    .unwrap_or_else(|e| panic!("good change not applied beside bad file: {e:#}"));
    poll(Duration::from_secs(2), || {
        Ok(w.agent.log().contains("later.yaml").then_some(()))
    })
    .unwrap_or_else(|e| {
        panic!(
            "later.yaml never named in the log: {e:#}\n{}",
            w.agent.log()
        )
    });
    assert!(
        w.agent.exited().unwrap().is_none(),
        "agent died:\n{}",
        w.agent.log()
    );
}

/// `demo/web` answers from both backends.
fn web_answers(w: &World) -> Result<()> {
    let r = w.sb.tcp(sa(VIP, 80), 24, &[])?;
    ensure!(r.all_ok(), "failures: {:?}", r.failures());
    ensure!(names(&r) == set(&["b1", "b2"]), "answered: {:?}", names(&r));
    Ok(())
}

/// Waits until the agent's log holds `text`.
fn logged(w: &World, text: &str) {
    poll(Duration::from_secs(3), || {
        Ok(w.agent.log().contains(text).then_some(()))
    })
    .unwrap_or_else(|e| panic!("`{text}` never logged: {e:#}\n{}", w.agent.log()));
}

#[test]
fn manifests_that_cannot_be_read_keep_their_services() {
    let mut w = World::start(2, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
    });
    web_answers(&w).unwrap();

    // The Service's file becomes a symlink loop (renamed in, as a whole).
    let file = web_service().file_name();
    let staged = w.m.scratch().join(&file);
    std::os::unix::fs::symlink(&file, &staged).unwrap();
    std::fs::rename(&staged, w.m.dir().join(&file)).unwrap();
    logged(
        &w,
        &format!("{file}: Too many levels of symbolic links (os error 40); keeping"),
    );
    web_answers(&w).unwrap();

    // The whole directory moves away: nothing is withdrawn.
    let moved = w.m.scratch().join("moved-away");
    std::fs::rename(w.m.dir(), &moved).unwrap();
    logged(
        &w,
        &format!(
            "reading {}: No such file or directory (os error 2); keeping",
            w.m.dir().display()
        ),
    );
    web_answers(&w).unwrap();
    assert!(
        w.agent.exited().unwrap().is_none(),
        "agent died:\n{}",
        w.agent.log()
    );

    // Back, and readable again: changes apply as before, and the served objects are the
    // files' new contents.
    std::fs::rename(&moved, w.m.dir()).unwrap();
    w.m.apply_service(&web_service()).unwrap();
    w.m.apply_slice(&web_slice(&w.sb, &[2], &[])).unwrap();
    poll(Duration::from_secs(2), || {
        let r = w.sb.tcp(sa(VIP, 80), 5, &[])?;
        Ok((r.all_ok() && names(&r) == set(&["b2"])).then_some(()))
    })
    .unwrap_or_else(|e| {
        panic!(
            "change after recovery not applied: {e:#}\n{}",
            w.agent.log()
        )
    });
}

#[test]
fn a_missing_manifests_path_is_an_error_at_start() {
    let sb = common::sandbox();
    let m = Manifests::new().unwrap();
    std::fs::remove_dir(m.dir()).unwrap();
    let bpffs = sb.bpffs().unwrap();
    let mut agent = sb.agent_no_wait(&bpffs, &m).unwrap();
    let status = poll(Duration::from_secs(10), || agent.exited())
        .unwrap_or_else(|e| panic!("agent still running: {e:#}\n{}", agent.log()));
    let log = agent.log();
    assert!(!status.success(), "exited with {status}:\n{log}");
    assert!(
        log.contains(&format!(
            "reading {}: No such file or directory",
            m.dir().display()
        )),
        "the message does not name the path:\n{log}"
    );
    assert!(!log.contains("svc-agent: ready"), "{log}");
    assert!(
        bpffs.entries().is_empty(),
        "pinned before the input was checked: {:?}",
        bpffs.entries()
    );
}

/// Issue 7: `svc-agent list | head` ends quietly when the reader goes away, rather than
/// panicking on the closed pipe.
#[test]
fn list_into_a_closed_pipe_does_not_panic() {
    use std::io::{BufRead, BufReader};
    let w = World::start(1, &[8080], |_, m| {
        let services: Vec<_> = (0..3000)
            .map(|i| svc_tests::scale::GenService::nth(i, 1, 0))
            .collect();
        svc_tests::scale::write_services(m.dir(), m.scratch(), &services).unwrap();
    });
    let mut child = std::process::Command::new(&w.sb.tools.agent)
        .args(["list", "--bpffs"])
        .arg(w.bpffs.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is gone: the rest of the listing (far more than a pipe holds) has nowhere
    // to go.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(first.starts_with("FRONTEND"), "{first}");
    assert!(out.status.success(), "{}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Issue 33, item 9: a file added later that defines the serving EndpointSlice again (with
/// another backend, in a file whose name sorts first) does not take it over: the Service keeps
/// its backend, and the log says which definition serves.
#[test]
fn a_new_file_cannot_take_over_a_serving_endpoint_slice() {
    let w = World::start(2, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1], &[])).unwrap();
    });
    assert_eq!(names(&w.sb.tcp(sa(VIP, 80), 5, &[]).unwrap()), set(&["b1"]));
    let again = web_slice(&w.sb, &[2], &[]);
    w.m.write_value("00-again.yaml", &again.to_value()).unwrap();
    logged(
        &w,
        &format!(
            "EndpointSlice demo/{}: defined again in {}: document 1; the definition in {}",
            again.name,
            w.m.dir().join("00-again.yaml").display(),
            w.m.dir().join(again.file_name()).display()
        ),
    );
    for _ in 0..3 {
        let r = w.sb.tcp(sa(VIP, 80), 10, &[]).unwrap();
        assert!(r.all_ok(), "{r:?}");
        assert_eq!(names(&r), set(&["b1"]), "{}", w.agent.log());
    }
}

/// Issue 33, item 10: names the API server would refuse are refused: a namespace of terminal
/// escape sequences and a name with a newline that would forge a log line. The good Service
/// still serves; the log names the bad ones escaped; `svc-agent list` never shows them.
#[test]
fn hostile_names_are_refused_and_never_printed_raw() {
    let w = World::start(2, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
        let mut ns = Service::new("demo", "x", "10.96.0.41")
            .port(ServicePort::tcp(80).target(8080))
            .to_value();
        ns["metadata"]["namespace"] = "evil\u{1b}[2J\u{1b}[31m".into();
        m.write_value("evil-namespace.yaml", &ns).unwrap();
        let mut name = Service::new("demo", "x", "10.96.0.42")
            .port(ServicePort::tcp(80).target(8080))
            .to_value();
        name["metadata"]["name"] = "x\nFORGED ERROR all Services deleted".into();
        m.write_value("evil-name.yaml", &name).unwrap();
    });
    web_answers(&w).unwrap();
    let dir = w.m.dir().display().to_string();
    logged(
        &w,
        &format!(
            "skipped: Service evil\\u{{1b}}[2J\\u{{1b}}[31m/x ({dir}/evil-namespace.yaml: \
             document 1): metadata.namespace is not a DNS-1123 label"
        ),
    );
    logged(
        &w,
        &format!(
            "skipped: Service demo/x\\nFORGED ERROR all Services deleted ({dir}/evil-name.yaml: \
             document 1): metadata.name is not a DNS-1123 label"
        ),
    );
    let log = w.agent.log();
    assert!(!log.contains('\u{1b}'), "{log:?}");
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a forged line:\n{log}"
    );
    let list = w.agent.list().unwrap();
    assert!(list.frontend("10.96.0.41:80/TCP").is_none(), "{list:?}");
    assert!(list.frontend("10.96.0.42:80/TCP").is_none(), "{list:?}");
    let out = std::process::Command::new(&w.sb.tools.agent)
        .args(["list", "--bpffs"])
        .arg(w.bpffs.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("demo/web:http"), "{text}");
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "{text:?}"
    );
    assert!(!text.contains("FORGED"), "{text}");
}

/// Issue 33, item 12: an SCTP Service port is not served, and says so: the warning, a problem
/// on /healthz (which stays 200: every node lacks SCTP alike), and a gauge in /metrics; the
/// Service's TCP port and the other Services serve.
#[test]
fn sctp_ports_are_named_on_healthz_and_counted() {
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let (healthz, metrics) = (free(), free());
    let flags = [
        format!("--healthz-bind-address={healthz}"),
        format!("--metrics-bind-address={metrics}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let w = World::start_with(2, &[8080], &flags, |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1, 2], &[])).unwrap();
        let mut mixed = Service::new("demo", "dia", "10.96.0.43")
            .port(ServicePort::tcp(80).name("http").target(8080))
            .to_value();
        mixed["spec"]["ports"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"name": "dia", "port": 3868, "protocol": "SCTP"}));
        m.write_value("svc-demo-dia.yaml", &mixed).unwrap();
    });
    web_answers(&w).unwrap();
    logged(
        &w,
        "port \"dia\" 3868/SCTP: SCTP is not supported yet; skipped",
    );
    let list = w.agent.list().unwrap();
    assert!(list.frontend("10.96.0.43:80/TCP").is_some(), "{list:?}");
    assert!(list.frontend("10.96.0.43:3868/SCTP").is_none(), "{list:?}");
    let (status, body) = svc_tests::agent::http_get(healthz, "/healthz").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(
            "1 Service ports not served (svc does not serve SCTP): demo/dia:dia 3868/SCTP"
        ),
        "{body}"
    );
    let (status, body) = svc_tests::agent::http_get(metrics, "/metrics").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.lines()
            .any(|l| l == "svc_service_ports_not_served{protocol=\"SCTP\"} 1"),
        "{body}"
    );
}

/// A cgroup sock_addr program that allows everything: someone else's program on svc's hook.
struct ForeignProgram {
    prog: std::os::fd::OwnedFd,
    cgroup: std::fs::File,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_DETACH: libc::c_long = 9;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
const BPF_F_ALLOW_MULTI: u32 = 2;

fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<i64> {
    // SAFETY: a zero-padded bpf_attr of the size passed.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128u32) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl ForeignProgram {
    fn attach(cgroup: &std::path::Path) -> ForeignProgram {
        use std::os::fd::{AsRawFd, FromRawFd};
        // r0 = 1; exit
        let insns: [u64; 2] = [0x0000_0001_0000_00b7, 0x0000_0000_0000_0095];
        let license = c"GPL";
        let mut attr = [0u8; 128];
        let put32 =
            |a: &mut [u8; 128], at: usize, v: u32| a[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        let put64 =
            |a: &mut [u8; 128], at: usize, v: u64| a[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        // prog_type, insn_cnt, insns, license, ..., expected_attach_type at 68
        put32(&mut attr, 0, BPF_PROG_TYPE_CGROUP_SOCK_ADDR);
        put32(&mut attr, 4, insns.len() as u32);
        put64(&mut attr, 8, insns.as_ptr() as u64);
        put64(&mut attr, 16, license.as_ptr() as u64);
        put32(&mut attr, 68, BPF_CGROUP_INET4_CONNECT);
        let fd = bpf(BPF_PROG_LOAD, &mut attr).expect("loading a foreign program");
        // SAFETY: a new descriptor the kernel returned.
        let prog = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        let cg = std::fs::File::open(cgroup).unwrap();
        let mut attr = [0u8; 128];
        // target_fd, attach_bpf_fd, attach_type, attach_flags
        put32(&mut attr, 0, cg.as_raw_fd() as u32);
        put32(&mut attr, 4, prog.as_raw_fd() as u32);
        put32(&mut attr, 8, BPF_CGROUP_INET4_CONNECT);
        put32(&mut attr, 12, BPF_F_ALLOW_MULTI);
        bpf(BPF_PROG_ATTACH, &mut attr).expect("attaching a foreign program");
        ForeignProgram { prog, cgroup: cg }
    }
}

impl Drop for ForeignProgram {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&(self.cgroup.as_raw_fd() as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&(self.prog.as_raw_fd() as u32).to_ne_bytes());
        attr[8..12].copy_from_slice(&BPF_CGROUP_INET4_CONNECT.to_ne_bytes());
        let _ = bpf(BPF_PROG_DETACH, &mut attr);
    }
}

/// Issue 7: `uninstall --cgroup` judges only svc's own programs: a foreign program on the same
/// hook is left alone, named, and is no failure; svc's are detached.
#[test]
fn uninstall_leaves_foreign_programs_alone() {
    let mut w = World::start(1, &[8080], |sb, m| {
        m.apply_service(&web_service()).unwrap();
        m.apply_slice(&web_slice(sb, &[1], &[])).unwrap();
    });
    let foreign = ForeignProgram::attach(w.sb.cgroup().path());
    w.agent.terminate(Duration::from_secs(10)).unwrap();
    let out = svc_tests::agent::uninstall(
        &w.sb.tools.agent,
        w.bpffs.path(),
        Some(w.sb.cgroup().path()),
    )
    .unwrap();
    assert!(out.contains("left alone (not svc's): connect4"), "{out}");
    // svc's programs are gone: the ClusterIP is not translated any more.
    let r = w.sb.tcp(sa(VIP, 80), 2, &["--timeout-ms", "300"]).unwrap();
    assert!(r.results.iter().all(|a| a.backend.is_none()), "{r:?}");
    drop(foreign);
}
