//! Call sites: each stack's first frame outside the allocator and its
//! wrappers (`call_sites`, `frames.wrapper`, `--wrapper`), in SQL, in
//! `report` and in flame graphs; on C++ (operator new, std::allocator and
//! make_shared through libstdc++) and on C wrappers of the program's own.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::support::{Trace, VARIANTS, Variant, memptrace, run, trace};

/// `site <function> <op> <calls> <bytes>` lines: (function, op) -> (calls,
/// bytes), bytes `None` where the program cannot know them.
fn sites(stdout: &str) -> BTreeMap<(String, String), (i64, Option<i64>)> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("site "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                (f[0].to_string(), f[1].to_string()),
                (f[2].parse().unwrap(), f[3].parse().ok()),
            )
        })
        .collect()
}

/// Calls and bytes per call site function, as the README's query has them.
fn by_call_site(t: &Trace) -> BTreeMap<(String, String), (i64, i64)> {
    t.db.prepare(
        "SELECT coalesce(f.function, '?'), e.op, count(*), coalesce(sum(e.size), 0)
         FROM events e JOIN call_sites c ON c.stack_id = e.stack_id
         JOIN frames f ON f.id = c.frame_id
         GROUP BY f.function, e.op",
    )
    .unwrap()
    .query_map([], |r| Ok(((r.get(0)?, r.get(1)?), (r.get(2)?, r.get(3)?))))
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Every stated site is found, with its calls and (when stated) bytes.
fn assert_sites(
    found: &BTreeMap<(String, String), (i64, i64)>,
    stated: &BTreeMap<(String, String), (i64, Option<i64>)>,
    what: &str,
) {
    assert!(!stated.is_empty(), "{what}: the tracee stated no site");
    for (key, &(calls, bytes)) in stated {
        let Some(&(got_calls, got_bytes)) = found.get(key) else {
            panic!("{what}: no call site {key:?} in {found:#?}");
        };
        assert_eq!(got_calls, calls, "{what}: {key:?}");
        if let Some(bytes) = bytes {
            assert_eq!(got_bytes, bytes, "{what}: {key:?}");
        }
    }
}

fn report_json(path: &Path, extra: &[&str]) -> Value {
    let out = run(
        memptrace()
            .arg("report")
            .arg(path)
            .args(["--format", "json", "--top", "1000"])
            .args(extra),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    serde_json::from_str(&out.stdout).unwrap()
}

/// The report's callers: (function, calls, bytes).
fn callers(report: &Value) -> BTreeMap<String, (u64, u64)> {
    report["callers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["function"].as_str().unwrap().to_string(),
                (c["calls"].as_u64().unwrap(), c["bytes"].as_u64().unwrap()),
            )
        })
        .collect()
}

const STD: &str = r"^(\S+ )?std::";

/// C++ through libstdc++: no call is charged to operator new; the call
/// sites are the program's functions (std::vector's growth is charged to
/// its own code until the standard library is named a wrapper too); every
/// inlined name is demangled, make_shared's included.
#[test]
fn cxx_calls_are_charged_to_their_callers() {
    let t = trace(Variant::Dynamic, "cxx", &[], &[]);
    assert_eq!(t.run.code(), 0);
    let stated = sites(&t.run.stdout);
    let found = by_call_site(&t);
    assert!(
        !found.keys().any(|(f, _)| f.starts_with("operator new")),
        "operator new is no call site: {found:#?}"
    );
    let grow = (
        "shapes::widget::grow(int)".to_string(),
        "malloc".to_string(),
    );
    let without_std: BTreeMap<_, _> = stated
        .clone()
        .into_iter()
        .filter(|(k, _)| *k != grow)
        .collect();
    assert_sites(&found, &without_std, "built-in wrappers");
    // operator new's frames are marked, the callers' are not.
    assert!(
        t.int("SELECT count(*) FROM frames WHERE wrapper = 1 AND function LIKE 'operator new%'")
            > 0
    );
    assert_eq!(
        t.int("SELECT count(*) FROM frames WHERE wrapper = 1 AND function LIKE 'shapes::%'"),
        0
    );
    // Demangled, inlined frames included.
    assert_eq!(
        t.int("SELECT count(*) FROM frame_lines WHERE function LIKE '\\_Z%' ESCAPE '\\'"),
        0,
        "a mangled name"
    );
    assert!(t.int("SELECT count(*) FROM frame_lines WHERE function LIKE 'std::make_shared<%'") > 0);

    // The report: callers, and the caller among the frames of each stack.
    let r = report_json(&t.path, &[]);
    let c = callers(&r);
    assert_eq!(c.get("shapes::make_widget(int)"), Some(&(1, 24)), "{c:#?}");
    assert_eq!(c["shapes::make_samples(int)"].0, 2);
    assert!(!c.keys().any(|f| f.starts_with("operator new")), "{c:#?}");
    let text = run(
        memptrace()
            .arg("report")
            .arg(&t.path)
            .args(["--top", "1000"]),
        b"",
    );
    let listing = text.stdout;
    assert!(
        listing.contains("       via operator new(unsigned long)"),
        "{listing}"
    );
    // Each stack of the ranking by calls, as text: its lines up to the next.
    let section: Vec<&str> = listing
        .lines()
        .skip_while(|l| !l.starts_with("Top 1000 stacks by allocation calls"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    let mut entries: Vec<Vec<&str>> = Vec::new();
    for line in section {
        if line.starts_with("       ") {
            entries.last_mut().unwrap().push(line.trim_start());
        } else {
            entries.push(Vec::new());
        }
    }
    let rows = r["top"]["calls"].as_array().unwrap();
    assert_eq!(entries.len(), rows.len());
    for (row, lines) in rows.iter().zip(&entries) {
        let frames = row["frames"].as_array().unwrap();
        let caller = frames.iter().find(|f| f["caller"] == true).unwrap();
        let name = caller["function"].as_str().unwrap();
        // Shown whatever was inlined into it (8 lines a stack by default).
        assert!(
            lines.iter().any(|l| l.starts_with(name)),
            "{name} not among {lines:#?}"
        );
    }

    // The standard library as wrappers too, given to the report only.
    let r = report_json(&t.path, &["--wrapper", STD]);
    assert_eq!(
        callers(&r).get("shapes::widget::grow(int)"),
        Some(&(8, 1020))
    );
}

/// The same, given to the trace: stored (meta, frames.wrapper), used by the
/// view and by every report of the trace.
#[test]
fn cxx_wrappers_given_to_the_trace() {
    let t = trace(Variant::Dynamic, "cxx", &[], &["--wrapper", STD]);
    assert_eq!(t.run.code(), 0);
    assert_eq!(t.meta("wrapper.1").as_deref(), Some(STD));
    assert_sites(&by_call_site(&t), &sites(&t.run.stdout), "--wrapper std");
    let r = report_json(&t.path, &[]);
    assert_eq!(
        callers(&r).get("shapes::widget::grow(int)"),
        Some(&(8, 1020))
    );

    // Flame graph leaves are the callers: no operator new, no std:: leaf.
    let svg = t.path.with_extension("svg");
    let out = run(
        memptrace()
            .arg("flamegraph")
            .arg(&t.path)
            .arg("-o")
            .arg(&svg)
            .args(["--metric", "calls"]),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.contains("shapes::widget::grow(int) (8 calls"),
        "no grow leaf"
    );
    assert!(
        !text.contains("operator new"),
        "operator new in the flame graph"
    );
}

/// C wrappers of the program's own, on every build: charged to their
/// callers with --wrapper at trace time, or at report time.
#[test]
fn c_wrappers_on_every_variant() {
    let wrappers = [
        "--wrapper",
        "^xmalloc$",
        "--wrapper",
        "^xcalloc$",
        "--wrapper",
        "^pool_alloc$",
    ];
    for variant in VARIANTS {
        let t = trace(variant, "wrappers", &[], &wrappers);
        assert_eq!(t.run.code(), 0, "{variant:?}");
        // The innermost frames are the wrappers themselves, as stated.
        t.assert_truth();
        let stated = sites(&t.run.stdout);
        assert_sites(&by_call_site(&t), &stated, variant.name());
        assert_eq!(
            t.int("SELECT count(*) FROM meta WHERE key GLOB 'wrapper.[0-9]*'"),
            3
        );
        assert_eq!(
            t.int("SELECT count(DISTINCT function) FROM frames WHERE wrapper = 1 AND function IN ('xmalloc', 'xcalloc', 'pool_alloc')"),
            3,
            "{variant:?}"
        );

        // Traced without them, the report takes them.
        let plain = trace(variant, "wrappers", &[], &[]);
        let found = by_call_site(&plain);
        assert_eq!(
            found.get(&("xmalloc".to_string(), "malloc".to_string())),
            Some(&(15, 820)),
            "{variant:?}: without --wrapper, xmalloc called malloc"
        );
        let r = report_json(&plain.path, &wrappers);
        let c = callers(&r);
        for ((function, _), (calls, bytes)) in &stated {
            assert_eq!(
                c.get(function),
                Some(&(*calls as u64, bytes.unwrap() as u64)),
                "{variant:?}: {c:#?}"
            );
        }
    }
}

/// Each leak as (its stack from the call site out to `main`, size), for the
/// leaks whose stack passes through `main` (not the C library's start-up),
/// sorted.
fn leaks_from_main(t: &Trace) -> Vec<(Vec<String>, i64)> {
    let leaks: Vec<(i64, i64)> = t
        .db
        .prepare(
            "SELECT c.site_id, l.size FROM leaks l JOIN call_sites c ON c.stack_id = l.alloc_stack_id",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut out: Vec<(Vec<String>, i64)> = leaks
        .into_iter()
        .filter_map(|(site, size)| {
            let mut stack = t.stack_functions(site);
            let main = stack.iter().position(|f| f == "main")?;
            stack.truncate(main + 1);
            Some((stack, size))
        })
        .collect();
    out.sort();
    out
}

/// The C library allocating for the program (stdout's buffer, strdup,
/// fopen) is charged to the program's function that called it, with the
/// same stack from there out, whether the C library is a module of its own
/// (dynamic) or linked into the program (static, static-pie): in
/// `call_sites` and in the report. (musl: see the next test.)
/// The `clib` tracee's calls as it states them: each C-library call's
/// blocks charged to the tracee's function that made it (call sites, the
/// report's callers), and its leaks with `stacks` from there to `main`.
/// Returns the leaks, sizes included, to compare builds.
fn charged_to_callers(t: &Trace, what: &str, stacks: &[[&str; 2]]) -> Vec<(Vec<String>, i64)> {
    assert_eq!(t.run.code(), 0, "{what}: {}", t.run.stderr);
    let stated = sites(&t.run.stdout);
    assert_eq!(stated.len(), stacks.len(), "{what}: {stated:?}");
    assert_sites(&by_call_site(t), &stated, what);
    let c = callers(&report_json(&t.path, &[]));
    for ((function, _), (calls, _)) in &stated {
        assert_eq!(
            c.get(function).map(|c| c.0),
            Some(*calls as u64),
            "{what}: {c:#?}"
        );
    }
    let leaks = leaks_from_main(t);
    let found: Vec<Vec<&str>> = leaks
        .iter()
        .map(|(s, _)| s.iter().map(String::as_str).collect())
        .collect();
    assert_eq!(found, stacks, "{what}: {leaks:?}");
    leaks
}

#[test]
fn c_library_calls_are_charged_alike_static_and_dynamic() {
    let mut builds = Vec::new();
    for variant in [Variant::Dynamic, Variant::Static, Variant::StaticPie] {
        let leaks = charged_to_callers(
            &trace(variant, "clib", &[], &[]),
            variant.name(),
            &[
                ["copy_name", "main"],
                ["open_self", "main"],
                ["say_hello", "main"],
            ],
        );
        builds.push((variant, leaks));
    }
    // The same leaks, sizes included (the same C library).
    let (_, dynamic) = &builds[0];
    for (variant, leaks) in &builds[1..] {
        assert_eq!(leaks, dynamic, "{variant:?} against the dynamic build");
    }
}

/// musl's C library has no unwind tables (`libc.a`, and `libc.so` but for
/// a few entries): its functions' frames are described from their machine
/// code (`symbols::height`), so the blocks `strdup` and `fopen` allocate
/// are charged to their callers, with the stack from there out to `main`,
/// alike in the static and the dynamic build. musl's stdout buffer is
/// static: no `say_hello` line.
#[test]
fn musl_c_library_calls_are_charged_to_their_callers() {
    let mut builds = Vec::new();
    for name in ["clib", "clib-dynamic"] {
        let leaks = charged_to_callers(
            &trace(Variant::Musl, name, &[], &[]),
            name,
            &[["copy_name", "main"], ["open_self", "main"]],
        );
        builds.push(leaks);
    }
    assert_eq!(builds[0], builds[1], "static against dynamic");
}
