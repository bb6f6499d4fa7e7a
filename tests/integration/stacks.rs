//! Stacks: the order of the functions along them, with both unwinders, on
//! every variant; the depth limit; threads.

use crate::support::{VARIANTS, Variant, trace};

fn deep(variant: Variant, unwinder: &str) {
    let t = trace(variant, "deep", &[], &["--unwinder", unwinder]);
    assert_eq!(t.run.code(), 0);
    assert_eq!(t.meta("unwinder").as_deref(), Some(unwinder));
    t.assert_truth();
    t.assert_deep_stacks(&format!("{variant:?} {unwinder}"));
}

#[test]
fn stacks_framehop() {
    for variant in VARIANTS {
        deep(variant, "framehop");
    }
}

#[test]
fn stacks_libunwind() {
    for variant in VARIANTS {
        deep(variant, "libunwind");
    }
}

/// A signal handler's allocation: its stack goes on through the signal
/// frame (the C library's `__restore_rt`) into the code the signal
/// interrupted, to `main`, whichever probes caught it (framehop over a
/// stack copy with int3 probes, the probes' own walk with jump probes);
/// the interrupted frame is read from the signal frame (`stacks.trust` =
/// `signal`).
#[test]
fn stacks_go_through_signal_frames() {
    for variant in VARIANTS {
        let t = trace(variant, "sigstack", &["5"], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        t.assert_truth();
        let stacks = t.stacks_from("handler_malloc", "malloc");
        assert_eq!(stacks.len(), 1, "{variant:?}: {stacks:?}");
        let functions = t.stack_functions(stacks[0]);
        assert_eq!(
            functions[..5],
            [
                "handler_malloc",
                "on_signal",
                "__restore_rt",
                "signal_here",
                "main"
            ],
            "{variant:?}: {functions:?}"
        );
        let trust = t.stack_trust(stacks[0]);
        assert_eq!(
            trust[..5],
            ["context", "cfi", "cfi", "signal", "cfi"],
            "{variant:?}"
        );
        // musl's C library has no CFI: its stacks end in it, truncated,
        // the handler's as the others (past main, not at the signal).
        let truncated = if variant.glibc() { 0 } else { 10 };
        assert_eq!(
            t.meta("truncated_stacks").as_deref(),
            Some(truncated.to_string().as_str()),
            "{variant:?}"
        );
    }
}

#[test]
fn max_depth_limits_stacks() {
    let t = trace(Variant::Dynamic, "deep", &[], &["--max-depth", "5"]);
    assert_eq!(
        t.int("SELECT max(depth) FROM stacks"),
        4,
        "depth counts from 0"
    );
    let stacks = t.stacks_from("deep_recurse", "malloc");
    assert_eq!(t.stack_functions(stacks[0]), ["deep_recurse"; 5]);
}

/// The `stack_text` of one stack.
fn stack_text(t: &crate::support::Trace, stack: i64) -> String {
    t.db.query_row(
        "SELECT text FROM stack_text WHERE stack_id = ?1",
        [stack],
        |r| r.get(0),
    )
    .unwrap()
}

/// stack_text names every frame, innermost first, with file and line.
#[test]
fn stack_text_reads_like_a_backtrace() {
    let t = trace(Variant::Dynamic, "deep", &[], &[]);
    let stack = t.stacks_from("deep_inner", "malloc")[0];
    let text = stack_text(&t, stack);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("deep_inner (") && lines[0].contains("deep.c:"),
        "{text}"
    );
    assert!(lines[1].starts_with("deep_middle ("), "{text}");
    assert!(lines[3].starts_with("main ("), "{text}");

    // A call made in inlined code: the frame is the function whose machine
    // code it is; stack_text shows the inlined function above it.
    let stack = t.stacks_from("deep_inlined_caller", "malloc")[0];
    let text = stack_text(&t, stack);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("deep_wrap (") && lines[0].contains("deep.c:"),
        "{text}"
    );
    assert!(lines[1].starts_with("deep_inlined_caller ("), "{text}");
    assert!(lines[2].starts_with("main ("), "{text}");
}

fn threads(variant: Variant) {
    let t = trace(variant, "threads", &[], &[]);
    assert_eq!(t.run.code(), 0);
    t.assert_truth();
    // Eight threads, each with exactly its 10 000 calls.
    let mut stmt =
        t.db.prepare(
            "SELECT e.tid, count(*) FROM events e JOIN stacks s ON s.id = e.stack_id
             JOIN frames f ON f.id = s.frame_id
             WHERE f.function IN ('thread_alloc', 'thread_release') GROUP BY e.tid",
        )
        .unwrap();
    let per_thread: Vec<(i64, i64)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(per_thread.len(), 8, "{variant:?}: {per_thread:?}");
    assert!(
        per_thread.iter().all(|&(_, n)| n == 10_000),
        "{per_thread:?}"
    );
    // Every thread that called is in `threads`, none is the main thread.
    let pid: i64 = t.meta("pid").unwrap().parse().unwrap();
    for (tid, _) in per_thread {
        assert_ne!(tid, pid);
        assert_eq!(
            t.int(&format!("SELECT count(*) FROM threads WHERE tid = {tid}")),
            1
        );
    }
    assert_eq!(
        t.int("SELECT count(*) FROM leaks"),
        t.int("SELECT count(*) FROM leaks WHERE alloc_ns IS NOT NULL")
    );
    let leaked_by_workers = t.int(
        "SELECT count(*) FROM leaks l JOIN stacks s ON s.id = l.alloc_stack_id
         JOIN frames f ON f.id = s.frame_id WHERE f.function = 'thread_alloc'",
    );
    assert_eq!(leaked_by_workers, 0);
}

#[test]
fn threads_dynamic() {
    threads(Variant::Dynamic);
}

#[test]
fn threads_static() {
    threads(Variant::Static);
}

#[test]
fn threads_static_pie() {
    threads(Variant::StaticPie);
}

#[test]
fn threads_musl() {
    threads(Variant::Musl);
}

#[test]
fn leaks_on_every_variant() {
    for variant in VARIANTS {
        let t = trace(variant, "leaks", &[], &[]);
        t.assert_truth();
    }
}

/// Where no CFI covers the code (built without unwind tables), both
/// unwinders follow the frame-pointer chain.
#[test]
fn frame_pointer_fallback() {
    for variant in [Variant::Dynamic, Variant::Static] {
        for unwinder in ["framehop", "libunwind"] {
            let t = trace(variant, "nocfi", &[], &["--unwinder", unwinder]);
            t.assert_truth();
            let stacks = t.stacks_from("nocfi_inner", "malloc");
            assert_eq!(stacks.len(), 1);
            let functions = t.stack_functions(stacks[0]);
            assert_eq!(
                functions[..4],
                ["nocfi_inner", "nocfi_middle", "nocfi_outer", "main"],
                "{variant:?} {unwinder}: {functions:?}"
            );
            // Those frames say how they were found, in stack_text too.
            let text = stack_text(&t, stacks[0]);
            let lines: Vec<&str> = text.lines().collect();
            assert!(!lines[0].contains("[found by"), "{text}");
            for line in &lines[1..4] {
                assert!(line.ends_with(" [found by frame pointer]"), "{text}");
            }
            let trust = t.stack_trust(stacks[0]);
            assert_eq!(
                trust[..4],
                ["context", "frame pointer", "frame pointer", "frame pointer"]
            );
        }
    }
}

/// C++: operator new reaches malloc through libstdc++, and every name along
/// the stack is demangled, inlined template code included.
#[test]
fn cxx_names_are_demangled() {
    let t = trace(Variant::Dynamic, "cxx", &[], &[]);
    assert_eq!(t.run.code(), 0);
    let stacks = t.stacks_from("operator new(unsigned long)", "malloc");
    let functions: Vec<Vec<String>> = stacks.iter().map(|&s| t.stack_functions(s)).collect();
    assert!(
        functions.iter().any(|f| f[..3]
            == [
                "operator new(unsigned long)",
                "shapes::make_widget(int)",
                "main"
            ]),
        "{functions:?}"
    );
    // push_back through the out-of-line _M_realloc_insert, from grow.
    assert!(
        functions.iter().any(|f| f[1]
            .contains("std::vector<int, std::allocator<int> >::_M_realloc_insert")
            && f[2] == "shapes::widget::grow(int)"),
        "{functions:?}"
    );
    // push_back of 100 ints reallocates for 1, 2, 4, ... 128 elements.
    assert_eq!(
        t.int(
            "SELECT count(*) FROM events e JOIN stack_text t ON t.stack_id = e.stack_id
             WHERE e.op = 'malloc' AND t.text LIKE '%shapes::widget::grow(int)%'"
        ),
        8
    );
    let text: String =
        t.db.query_row(
            "SELECT text FROM stack_text WHERE text LIKE '%push_back%' LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(
        text.contains("std::vector<int, std::allocator<int> >::push_back(int const&)"),
        "{text}"
    );
}

/// C functions named like C++ type codes (`h`, `i`, `Pc`, `f`, `x`, `St`,
/// `Dn`) keep their names in `frames.function` and in the report: only
/// mangled names are demangled.
#[test]
fn c_names_are_not_demangled() {
    const NAMES: [&str; 7] = ["h", "i", "Pc", "f", "x", "St", "Dn"];
    for variant in VARIANTS {
        let t = trace(variant, "cnames", &[], &[]);
        assert_eq!(t.run.code(), 0);
        t.assert_truth();
        let mut stmt =
            t.db.prepare(
                "SELECT f.function FROM events e JOIN stacks s ON s.id = e.stack_id
                 JOIN frames f ON f.id = s.frame_id
                 WHERE e.op = 'malloc' AND e.size BETWEEN 11 AND 17 ORDER BY e.size",
            )
            .unwrap();
        let found: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(found, NAMES, "{variant:?}");
        let report = crate::support::run(
            crate::support::memptrace().args(["report", t.path.to_str().unwrap(), "--top", "100"]),
            b"",
        );
        assert_eq!(report.code(), 0, "{}", report.stderr);
        // Each function's row in the callers table: 1 call, its bytes.
        for (n, name) in NAMES.iter().enumerate() {
            let row = regex::Regex::new(&format!(r"(?m)^  {name} +1 +{} B ", 11 + n)).unwrap();
            assert!(
                row.is_match(&report.stdout),
                "{variant:?}: no caller row {name:?} in\n{}",
                report.stdout
            );
        }
        for cxx in ["unsigned char", "long long", "std::nullptr_t", "char*"] {
            assert!(!report.stdout.contains(cxx), "{variant:?}: {cxx}");
        }
    }
}
