//! What `report` calls the blocks live at the end of a trace: live at
//! detach (not leaked) when memptrace let the program go, the blocks live
//! since the attach apart; and the blocks an exec released.

use std::process::Command;

use crate::support::{
    Background, Variant, memptrace, open_trace, run, scratch, tracee, wait_until,
    without_death_warning,
};

/// An attach to a program that allocates nothing while traced (heapmap,
/// waiting for its line), then a detach: every block live at detach was
/// live at attach, and none is called leaked.
#[test]
fn report_of_a_detached_trace_says_live_at_detach() {
    for variant in [Variant::Dynamic, Variant::Static] {
        let mut target = Background::interactive(
            Command::new(tracee(variant, "heapmap"))
                .arg("wait")
                .env_remove("LD_LIBRARY_PATH"),
        );
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let db = scratch("live-at-detach").join("trace.db");
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(&db),
        );
        wait_until("memptrace hooked the process", || {
            !crate::attach::trampoline_pages(pid).is_empty()
        });
        tracer.signal(libc::SIGINT);
        let out = tracer.finish();
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        assert_eq!(without_death_warning(&out.stderr), "", "{variant:?}");
        // Let go unharmed: it frees its blocks and exits 0.
        target.send("go\n");
        assert_eq!(target.finish().code(), 0, "{variant:?}");
        let t = open_trace(&db, out);
        assert!(t.meta("end_reason").unwrap().starts_with("detached: "));
        assert_eq!(
            t.int("SELECT count(*) FROM events WHERE op <> 'inventory'"),
            0,
            "{variant:?}: no call while attached"
        );
        let (blocks, bytes) = (
            t.int("SELECT count(*) FROM leaks WHERE op = 'inventory'"),
            t.int("SELECT sum(size) FROM leaks WHERE op = 'inventory'"),
        );
        assert!(blocks > 0, "{variant:?}");
        let report = run(memptrace().arg("report").arg(&db), b"");
        assert_eq!(report.code(), 0, "{}", report.stderr);
        let text = &report.stdout;
        let human = |b: i64| memptrace::report::text::bytes(b as u64);
        for line in [
            "  live at detach 0 B in 0 blocks allocated while traced, the program runs on: not leaks"
                .to_string(),
            format!(
                "             {} in {blocks} blocks live since the attach (the inventory)",
                human(bytes)
            ),
            "Top 5 stacks by bytes live at detach".to_string(),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{variant:?}: {line:?} not in\n{text}"
            );
        }
        assert!(!text.contains("leaked"), "{variant:?}: {text}");
        let json = run(
            memptrace()
                .arg("report")
                .arg(&db)
                .args(["--format", "json"]),
            b"",
        );
        let json: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
        let heap = &json["heap"];
        assert_eq!(heap["live_at_end"], "at_detach");
        assert_eq!(heap["inventory_live_blocks"], blocks);
        assert_eq!(heap["inventory_live_bytes"], bytes);
        assert_eq!(heap["leaked_blocks"], blocks);
    }
}
