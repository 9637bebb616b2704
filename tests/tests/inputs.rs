//! Bad manifests never take the agent or the good services down, and the agent says which
//! file or object it rejected.

mod common;

use std::time::Duration;

use common::{names, poll, sa, set, web_service, web_slice, World, VIP};
use svc_tests::{Service, ServicePort};

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
