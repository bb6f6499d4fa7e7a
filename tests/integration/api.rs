//! Every allocator function and its edge cases (tracee-tests/api.c).

use crate::support::{Trace, VARIANTS, Variant, trace};

/// The op memptrace records for what the tracee called. In static glibc,
/// aligned_alloc and memalign are one function at one address, called
/// directly: nothing tells them apart, and memptrace records `memalign`
/// (README, Limits).
fn op_known_as(variant: Variant) -> impl Fn(&str) -> String {
    move |op| match op {
        "aligned_alloc" if variant.glibc() && variant.is_static() => "memalign".into(),
        other => other.into(),
    }
}

/// An event's ptr, size, old_ptr, align and id.
type Row = (i64, Option<i64>, Option<i64>, Option<i64>, i64);

/// The events recorded from `function`, in order.
fn only_event(t: &Trace, function: &str) -> Vec<Row> {
    let mut stmt =
        t.db.prepare(
            "SELECT e.ptr, e.size, e.old_ptr, e.align, e.id
             FROM events e JOIN stacks s ON s.id = e.stack_id JOIN frames f ON f.id = s.frame_id
             WHERE f.function = ?1 ORDER BY e.id",
        )
        .unwrap();
    stmt.query_map([function], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

fn api(variant: Variant) {
    let t = trace(variant, "api", &[], &[]);
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    t.assert_truth_with(op_known_as(variant));

    // calloc(SIZE_MAX, 2) failed: no block, and no size (n*m overflows).
    let overflow = only_event(&t, "api_calloc_overflow");
    assert_eq!(overflow.len(), 1);
    assert_eq!((overflow[0].0, overflow[0].1), (0, None));

    // realloc(NULL, 64) is one realloc event (glibc's realloc enters malloc
    // inside: that inner call is not recorded).
    let null = only_event(&t, "api_realloc_null");
    assert_eq!(null.len(), 1);
    let block = null[0].0;
    assert_ne!(block, 0);
    assert_eq!(null[0].2, Some(0), "old_ptr of realloc(NULL, n)");
    // realloc(p, 0) received that block and released it.
    let zero = only_event(&t, "api_realloc_zero");
    assert_eq!(zero[0].2, Some(block));
    let released_by: String =
        t.db.query_row(
            "SELECT free_op FROM allocations WHERE alloc_id = ?1",
            [null[0].4],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(released_by, "realloc");
    if variant.glibc() {
        assert_eq!(
            zero[0].0, 0,
            "glibc's realloc(p, 0) frees p and returns NULL"
        );
    }

    // The realloc that moved the block names the block it received.
    let grow = only_event(&t, "api_realloc");
    assert_eq!(grow.len(), 2);
    assert_eq!(grow[1].2, Some(grow[0].0));

    let free_null = only_event(&t, "api_free_null");
    assert_eq!((free_null[0].0, free_null[0].1), (0, None));

    let aligned = only_event(&t, "api_posix_memalign");
    assert_ne!(
        aligned[0].0, 0,
        "posix_memalign's block is read through its first argument"
    );
    assert_eq!(aligned[0].0 % 64, 0);
    assert_eq!(aligned[0].3, Some(64));
    let aligned = only_event(&t, "api_aligned_alloc");
    assert_eq!((aligned[0].0 % 128, aligned[0].3), (0, Some(128)));

    // api.c frees everything it allocates.
    let leaked = t.int(
        "SELECT count(*) FROM leaks l JOIN stacks s ON s.id = l.alloc_stack_id
         JOIN frames f ON f.id = s.frame_id WHERE f.function LIKE 'api\\_%' ESCAPE '\\'",
    );
    assert_eq!(leaked, 0);
}

#[test]
fn api_dynamic() {
    api(Variant::Dynamic);
}

#[test]
fn api_static() {
    api(Variant::Static);
}

#[test]
fn api_static_pie() {
    api(Variant::StaticPie);
}

#[test]
fn api_musl() {
    api(Variant::Musl);
}

/// Only the outermost allocator call of a thread is an event: glibc's
/// realloc(NULL, n) enters malloc, musl's calloc calls malloc, and those
/// inner calls are seen (meta.nested_calls) but never recorded, so no event
/// has an allocator function as its caller.
#[test]
fn only_outermost_calls_are_events() {
    for variant in VARIANTS {
        let t = trace(variant, "api", &[], &[]);
        let inner = t.int(
            "SELECT count(*) FROM events e JOIN stacks s ON s.id = e.stack_id
             JOIN frames f ON f.id = s.frame_id
             WHERE f.function IN ('malloc', 'calloc', 'realloc', 'free', 'posix_memalign',
                 'aligned_alloc', 'memalign', 'valloc', 'pvalloc', 'reallocarray')",
        );
        assert_eq!(inner, 0, "{variant:?}");
        let nested: i64 = t.meta("nested_calls").unwrap().parse().unwrap();
        assert!(nested >= 1, "{variant:?}: nested calls seen: {nested}");
    }
}

/// `--no-stacks` records every call, with no stack.
#[test]
fn no_stacks_records_every_call() {
    let with = trace(Variant::Dynamic, "leaks", &[], &[]);
    let without = trace(Variant::Dynamic, "leaks", &[], &["--no-stacks"]);
    let by_op = |t: &Trace| -> Vec<(String, i64)> {
        let mut stmt =
            t.db.prepare("SELECT op, count(*) FROM events GROUP BY op ORDER BY op")
                .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    assert_eq!(by_op(&with), by_op(&without));
    assert_eq!(
        without.int("SELECT count(*) FROM events WHERE stack_id IS NOT NULL"),
        0
    );
    assert_eq!(without.meta("unwinder").as_deref(), Some("none"));
    assert_eq!(
        with.int("SELECT count(*) FROM events WHERE stack_id IS NULL"),
        0
    );
}
