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

/// A program that execs itself with blocks live: the exec released them.
/// They are `allocations` with `free_op` `exec`, not `leaks`, and the report
/// counts them apart; the new image's leaks are leaks.
#[test]
fn blocks_live_at_an_exec_are_released_by_it() {
    for variant in [Variant::Dynamic, Variant::Static, Variant::Musl] {
        let t = crate::support::trace(variant, "execs", &[], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        t.assert_truth();
        let by_function = |what: &str, function: &str| -> (i64, i64) {
            t.db.query_row(
                &format!(
                    "SELECT count(*), coalesce(sum(a.size), 0) FROM {what} a
                     JOIN stacks s ON s.id = a.alloc_stack_id JOIN frames f ON f.id = s.frame_id
                     WHERE f.function = ?1"
                ),
                [function],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        let execd = "(SELECT * FROM allocations WHERE free_op = 'exec')";
        assert_eq!(by_function(execd, "before_exec"), (5, 5000), "{variant:?}");
        assert_eq!(by_function("leaks", "before_exec"), (0, 0), "{variant:?}");
        assert_eq!(by_function(execd, "after_exec"), (0, 0), "{variant:?}");
        assert_eq!(by_function("leaks", "after_exec"), (2, 400), "{variant:?}");
        // Every block of the first image live at the exec, and only those.
        let released = t.int("SELECT count(*) FROM exec_releases");
        let pid = t.int("SELECT pid FROM exec_releases LIMIT 1");
        assert_eq!(
            t.int(&format!(
                "SELECT count(*) FROM allocations WHERE free_op = 'exec' AND pid = {pid}"
            )),
            released
        );
        assert_eq!(
            t.int("SELECT count(*) FROM leaks l JOIN exec_releases x ON x.alloc_id = l.alloc_id"),
            0
        );
        let bytes = t.int("SELECT sum(size) FROM allocations WHERE free_op = 'exec'");
        // Where the C library allocates nothing for itself at start-up, the
        // tracee's blocks are all there is.
        if matches!(variant, Variant::Dynamic | Variant::Musl) {
            assert_eq!((released, bytes), (5, 5000), "{variant:?}");
            assert_eq!(t.int("SELECT count(*) FROM leaks"), 2, "{variant:?}");
        }
        let report = run(memptrace().arg("report").arg(&t.path), b"");
        assert_eq!(report.code(), 0, "{}", report.stderr);
        let line = format!(
            "  exec'd     {} in {released} blocks, released by an exec (their program image was replaced)",
            memptrace::report::text::bytes(bytes as u64)
        );
        assert!(
            report.stdout.lines().any(|l| l == line),
            "{variant:?}: {line:?} not in\n{}",
            report.stdout
        );
        let leaked = t.int("SELECT count(*) FROM leaks");
        assert!(
            report
                .stdout
                .contains(&format!(" in {leaked} blocks, never freed while traced")),
            "{variant:?}: {}",
            report.stdout
        );
    }
}
