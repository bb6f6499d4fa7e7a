//! `--stack-every N`: every call is still recorded, exactly as in a full
//! trace; only every Nth call of each call site is unwound, the others keep
//! their caller as a one-frame stack.

use crate::support::{Trace, Variant, trace};

/// (op, calls, bytes) of a whole trace.
fn totals(t: &Trace) -> Vec<(String, i64, i64)> {
    let mut stmt = t
        .db
        .prepare("SELECT op, count(*), coalesce(sum(size), 0) FROM events GROUP BY op ORDER BY op")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// Calls from `function` (the innermost frame), and how many of them have a
/// stack of more than that one frame.
fn site(t: &Trace, function: &str) -> (i64, i64) {
    t.db.query_row(
        "SELECT count(*), count(*) FILTER (WHERE s.depth > 0) FROM events e
         JOIN stacks s ON s.id = e.stack_id JOIN frames f ON f.id = s.frame_id
         WHERE f.function = ?1",
        [function],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .unwrap()
}

fn stack_every(variant: Variant) {
    let full = trace(variant, "threads", &[], &[]);
    let sampled = trace(variant, "threads", &[], &["--stack-every", "10"]);
    assert_eq!(sampled.run.code(), 0);
    assert_eq!(sampled.meta("stack_every").as_deref(), Some("10"));
    assert_eq!(full.meta("stack_every").as_deref(), Some("1"));
    // Every call, by op, exactly as in the full trace; and the truth by
    // calling function, which a one-frame stack still names.
    assert_eq!(totals(&sampled), totals(&full), "{variant:?}");
    sampled.assert_truth();

    // One call site each, 40 000 calls each: the 1st, 11th, 21st... have
    // their whole stack.
    for function in ["thread_alloc", "thread_release"] {
        let (calls, stacked) = site(&sampled, function);
        assert_eq!(calls, 40_000, "{variant:?} {function}");
        assert_eq!(
            stacked, 4_000,
            "{variant:?} {function}: 1 in 10 calls unwound"
        );
        let (_, all) = site(&full, function);
        assert_eq!(
            all, calls,
            "{variant:?} {function}: a full trace unwinds every call"
        );
    }
    // The stacks kept are whole: the worker called thread_alloc.
    for stack in sampled.stacks_from("thread_alloc", "malloc") {
        let functions = sampled.stack_functions(stack);
        if functions.len() > 1 {
            assert_eq!(functions[..2], ["thread_alloc", "worker"], "{variant:?}");
        }
    }
}

#[test]
fn stack_every_dynamic() {
    stack_every(Variant::Dynamic);
}

#[test]
fn stack_every_static() {
    stack_every(Variant::Static);
}
