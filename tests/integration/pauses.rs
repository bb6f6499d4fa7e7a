//! How long memptrace stops the program at attach and detach: each pause
//! and its phases are in `meta`. Only that the rows are there and add up is
//! asserted (speed is never asserted by a test; the figures are in
//! docs/performance.md, measured with the `gaps` tracee).

use crate::support::{Background, Variant, memptrace, open_trace, scratch, tracee};

/// The value of `key` in milliseconds.
fn ms(t: &crate::support::Trace, key: &str) -> f64 {
    let value = t.meta(key).unwrap_or_else(|| panic!("meta has no {key}"));
    value
        .parse::<f64>()
        .unwrap_or_else(|_| panic!("{key} = {value:?}"))
}

#[test]
fn attach_and_detach_pauses_are_in_meta() {
    let mut target = Background::start(
        std::process::Command::new(tracee(Variant::Dynamic, "gaps"))
            .arg("2000")
            .env_remove("LD_LIBRARY_PATH"),
    );
    let pid: i32 = target.wait_for("ready").parse().unwrap();
    let db = scratch("pauses").join("trace.db");
    let tracer = Background::start(
        memptrace()
            .args(["attach", &pid.to_string(), "--duration", "1", "-o"])
            .arg(&db),
    );
    let out = tracer.finish();
    assert_eq!(out.code(), 0, "{}", out.stderr);
    // (With int3 probes, the one line on memptrace's death.)
    assert_eq!(crate::support::without_death_warning(&out.stderr), "");
    target.signal(libc::SIGTERM);
    let end = target.finish();
    assert_eq!(end.code(), 0, "{}", end.stderr);
    assert!(end.stdout.contains("\ngaps "), "{}", end.stdout);
    let t = open_trace(&db, out);
    for (kind, phases) in [
        ("attach", &["stop", "hook", "inventory", "resume"][..]),
        (
            "detach",
            &["stop", "settle", "leave_probes", "restore", "release"][..],
        ),
    ] {
        let total = ms(&t, &format!("{kind}_pause_ms"));
        let sum: f64 = phases
            .iter()
            .map(|p| ms(&t, &format!("{kind}_pause.{p}_ms")))
            .sum();
        assert!(total > 0.0, "{kind}: {total}");
        // Each value is rounded to a microsecond.
        assert!(
            (total - sum).abs() <= 0.001 * phases.len() as f64,
            "{kind}: {total} is not the sum of its phases, {sum}"
        );
        let rows = t.int(&format!(
            "SELECT count(*) FROM meta WHERE key LIKE '{kind}\\_pause%' ESCAPE '\\'"
        ));
        assert_eq!(rows as usize, 1 + phases.len(), "{kind}");
    }
    // The heap map of the detach is taken, once the program runs again.
    assert_eq!(
        t.int("SELECT count(*) FROM heap_snapshots WHERE moment = 'detach' AND error IS NULL"),
        1
    );
}
