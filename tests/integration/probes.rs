//! What the probes promise whatever catches the calls: every call of the
//! program recorded once, the ones made inside another call not at all,
//! a program faster than memptrace made to wait rather than lose calls,
//! and which function got which kind of probe said in `meta`.

use crate::support::{Variant, probes, trace};

/// The count of calls from `function` for `op`.
fn calls(t: &crate::support::Trace, function: &str, op: &str) -> i64 {
    t.recorded(function, op).calls
}

/// Signal handlers that allocate, landing inside allocator calls and
/// inside memptrace's code: the main thread's calls are each recorded; with
/// int3 probes each of the handler's calls is recorded too, and only the
/// calls realloc makes inside itself are nested; with jump probes a
/// handler's call is either recorded or counted as nested.
#[test]
fn signal_handlers_that_allocate() {
    // A stop per call makes each handler run long: a slower timer keeps
    // the program going.
    let (iterations, interval) = if probes() == "int3" {
        ("5000", "3000")
    } else {
        ("100000", "50")
    };
    for variant in [Variant::Dynamic, Variant::Musl] {
        let t = trace(variant, "sigalloc", &[iterations, interval], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        t.assert_truth();
        let printed = |key: &str| -> i64 {
            t.run
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .unwrap()
                .parse()
                .unwrap()
        };
        let (handler, inner) = (printed("handler_calls"), printed("handler_inner"));
        assert!(handler > 0, "{variant:?}: the timer never fired");
        assert_eq!(handler, 3 * inner, "{variant:?}: three calls, one realloc");
        let recorded = calls(&t, "handler_alloc", "malloc")
            + calls(&t, "handler_resize", "realloc")
            + calls(&t, "handler_release", "free");
        let nested: i64 = t.meta("nested_calls").unwrap().parse().unwrap();
        if probes() == "int3" {
            assert_eq!(
                (recorded, nested),
                (handler, inner),
                "{variant:?}: every handler call recorded, realloc's malloc nested"
            );
        } else {
            assert_eq!(
                recorded + nested,
                handler + inner,
                "{variant:?}: {recorded} + {nested}"
            );
        }
        for key in ["lost_returns", "skipped_records"] {
            assert_eq!(t.meta(key).as_deref(), Some("0"), "{variant:?} {key}");
        }
    }
}

/// A program that records calls faster than memptrace can store them: with
/// jump probes it waits for room (meta.ring_waits), and not one call is
/// missing.
#[test]
fn a_program_faster_than_memptrace_waits() {
    let jump = probes() == "jump";
    let n = if jump { "1000000" } else { "20000" };
    for variant in [Variant::Dynamic, Variant::Static] {
        let t = trace(variant, "outrun", &[n], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        t.assert_truth();
        let waits: i64 = t.meta("ring_waits").unwrap().parse().unwrap();
        if jump {
            assert!(waits > 0, "{variant:?}: the ring never filled");
        } else {
            assert_eq!(waits, 0, "{variant:?}: int3 probes have no ring");
        }
    }
}

/// `meta` says how each allocator function was hooked: with jump probes,
/// every function of Debian's C library takes a jump; with int3 probes,
/// every one an int3.
#[test]
fn meta_names_the_probe_of_each_function() {
    let t = trace(Variant::Dynamic, "api", &[], &[]);
    let rows: Vec<(String, String)> = {
        let mut stmt =
            t.db.prepare("SELECT key, value FROM meta WHERE key LIKE 'probe.libc.so.6:%'")
                .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let functions: Vec<&str> = rows
        .iter()
        .map(|(k, _)| k.trim_start_matches("probe.libc.so.6:"))
        .collect();
    for f in [
        "malloc",
        "free",
        "calloc",
        "realloc",
        "posix_memalign",
        "memalign",
    ] {
        assert!(functions.contains(&f), "{f} in {functions:?}");
    }
    let want = if probes() == "jump" { "jump" } else { "int3" };
    for (key, how) in &rows {
        assert_eq!(how, want, "{key}");
    }
    assert_eq!(t.meta("probes").as_deref(), Some(want));
}
