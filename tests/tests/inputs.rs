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
    let r = w.sb.tcp(sa(VIP, 80), 10, &[])?;
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
