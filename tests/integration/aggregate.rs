//! The aggregate tables (docs/schema.md, "Aggregates") and `--aggregate`:
//! on a full trace they hold what SQL over its events finds; an aggregate
//! trace of the same program holds the same, without a row per call, in a
//! size bounded by its stacks.

use std::collections::BTreeMap;

use crate::support::{Trace, Variant, memptrace, run, trace, trace_program, tracee};

/// Rows of a query of text keys and integer values, in order.
fn rows(t: &Trace, sql: &str) -> Vec<(String, Vec<i64>)> {
    let mut stmt = t.db.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    let n = stmt.column_count();
    stmt.query_map([], |r| {
        let key: String = r.get(0)?;
        let values = (1..n).map(|i| r.get(i)).collect::<Result<Vec<i64>, _>>()?;
        Ok((key, values))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// `inner` gives rows (s: a stack id, tag, v1..vN): their values summed by
/// the stack's functions, innermost first, and the tag, a key that two runs
/// share (stack ids and addresses may differ between them). The stack's
/// text is looked up once per row of `inner`: group there.
fn by_stack(t: &Trace, inner: &str, values: usize) -> Vec<(String, Vec<i64>)> {
    let sums: Vec<String> = (1..=values).map(|i| format!("sum(v{i})")).collect();
    rows(
        t,
        &format!(
            "SELECT coalesce((SELECT text FROM stack_text WHERE stack_id = x.s), '-') || ' ' || x.tag,
                    {}
             FROM ({inner}) x GROUP BY 1 ORDER BY 1",
            sums.join(", "),
        ),
    )
}

type Figures = BTreeMap<&'static str, Vec<(String, Vec<i64>)>>;

/// The aggregates of a trace by stack text: totals per (stack, op), the
/// blocks live at the end and at the peak per stack, and the peak.
fn aggregates(t: &Trace) -> Figures {
    let mut out = BTreeMap::new();
    out.insert(
        "calls",
        by_stack(
            t,
            "SELECT stack_id AS s, op AS tag, sum(calls) AS v1, sum(failed) AS v2,
                    sum(blocks) AS v3, sum(bytes) AS v4, sum(releases) AS v5,
                    sum(temporary) AS v6
             FROM agg_calls GROUP BY 1, 2",
            6,
        ),
    );
    out.insert(
        "live",
        by_stack(
            t,
            "SELECT stack_id AS s, op AS tag, count(*) AS v1, sum(size) AS v2
             FROM agg_live GROUP BY 1, 2",
            2,
        ),
    );
    out.insert(
        "peak",
        by_stack(
            t,
            "SELECT stack_id AS s, '' AS tag, sum(blocks) AS v1, sum(bytes) AS v2
             FROM agg_peak GROUP BY 1",
            2,
        ),
    );
    out.insert(
        "totals",
        rows(
            t,
            "SELECT 'totals', events, peak_bytes, peak_blocks, peak_event,
                    exec_released_blocks, exec_released_bytes FROM agg_totals",
        ),
    );
    out
}

/// The same figures, found by SQL over the events of a full trace.
fn from_events(t: &Trace) -> Figures {
    let mut out = BTreeMap::new();
    // A call released a traced block when its alloc_id names an
    // allocation; a temporary block is counted for its allocation.
    out.insert(
        "calls",
        by_stack(
            t,
            "SELECT c.stack_id AS s, c.op AS tag, count(*) AS v1,
                    sum(c.op <> 'free' AND c.ptr = 0 AND coalesce(c.size, -1) <> 0
                        AND c.alloc_id IS NULL) AS v2,
                    sum(c.op <> 'free' AND c.ptr <> 0) AS v3,
                    sum(CASE WHEN c.op <> 'free' AND c.ptr <> 0 THEN c.size ELSE 0 END) AS v4,
                    sum(c.alloc_id IS NOT NULL) AS v5,
                    sum(c.id IN (SELECT alloc_id FROM temporary)) AS v6
             FROM events c GROUP BY 1, 2",
            6,
        ),
    );
    out.insert(
        "live",
        by_stack(
            t,
            "SELECT alloc_stack_id AS s, op AS tag, count(*) AS v1, sum(size) AS v2
             FROM leaks GROUP BY 1, 2",
            2,
        ),
    );
    // The peak: the first event after which heap_over_time is largest;
    // the blocks live then, by stack.
    let (peak_event, peak_bytes, peak_blocks): (i64, i64, i64) =
        t.db.query_row(
            "SELECT id, bytes, blocks FROM heap_over_time ORDER BY bytes DESC, id LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    out.insert(
        "peak",
        by_stack(
            t,
            &format!(
                "SELECT alloc_stack_id AS s, '' AS tag, count(*) AS v1, sum(size) AS v2
                 FROM allocations
                 WHERE alloc_id <= {peak_event} AND (free_id IS NULL OR free_id > {peak_event})
                 GROUP BY 1"
            ),
            2,
        ),
    );
    let exec: (i64, i64) =
        t.db.query_row(
            "SELECT count(*), coalesce(sum(size), 0) FROM allocations WHERE free_op = 'exec'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    out.insert(
        "totals",
        vec![(
            "totals".to_string(),
            vec![
                t.int("SELECT count(*) FROM events"),
                peak_bytes,
                peak_blocks,
                peak_event,
                exec.0,
                exec.1,
            ],
        )],
    );
    out
}

/// A full trace, which keeps the aggregates beside its events: its
/// aggregate tables hold exactly what SQL over its events finds: phases.c
/// (several stacks, temporary blocks, leaks, a known peak) and threads.c
/// (eight threads).
fn full_with_aggregates(name: &str, args: &[&str]) -> Trace {
    trace(Variant::Dynamic, name, args, &[])
}

#[test]
fn aggregate_tables_equal_sql_over_the_events() {
    for (name, args) in [("phases", &[][..]), ("threads", &["4", "500"][..])] {
        let t = full_with_aggregates(name, args);
        assert_eq!(t.run.code(), 0, "{name}: {}", t.run.stderr);
        assert_eq!(t.meta("trace_mode").as_deref(), Some("full"));
        assert_eq!(t.meta("agg_resolution_ns").as_deref(), Some("100000000"));
        let kept = aggregates(&t);
        let found = from_events(&t);
        assert_eq!(kept, found, "{name}");
        // Threads: calls per thread as the events give them.
        let per_thread = "SELECT e.tid || '', count(*) FROM events e GROUP BY 1 ORDER BY 1";
        let agg_per_thread = "SELECT t.tid || '', sum(calls) FROM agg_calls a
                              JOIN event_threads t ON t.code = a.thread GROUP BY 1 ORDER BY 1";
        assert_eq!(rows(&t, agg_per_thread), rows(&t, per_thread), "{name}");
        // The heap over time ends, for each stack, with what it leaked.
        let last = "SELECT coalesce(stack_id, -1) || '', bytes, blocks FROM agg_over_time o
                    WHERE bucket_ns = (SELECT max(bucket_ns) FROM agg_over_time p
                                       WHERE p.stack_id IS o.stack_id)
                      AND bytes > 0 ORDER BY 1";
        let leaked = "SELECT coalesce(alloc_stack_id, -1) || '', sum(size), count(*) FROM leaks
                      GROUP BY 1 ORDER BY 1";
        assert_eq!(rows(&t, last), rows(&t, leaked), "{name}");
        // And `leaks_by_stack`, summed at the end, is `leaks` by stack.
        let by_stack = "SELECT coalesce(stack_id, -1) || '', bytes, blocks FROM leaks_by_stack
                        ORDER BY 1";
        assert_eq!(rows(&t, by_stack), rows(&t, leaked), "{name}");
    }
    // phases.c's own truth: the peak.
    let t = full_with_aggregates("phases", &[]);
    let peak: i64 = t
        .run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("peak "))
        .expect("phases prints its peak")
        .trim()
        .parse()
        .unwrap();
    assert_eq!(t.int("SELECT peak_bytes FROM agg_totals"), peak);
}

/// The test: an aggregate trace and a full trace of the same
/// program give identical per-stack totals, leaks and peak; the aggregate
/// one has no row per call.
#[test]
fn aggregate_trace_matches_the_full_trace() {
    let full = trace(Variant::Dynamic, "phases", &[], &[]);
    let agg = trace_program(&tracee(Variant::Dynamic, "phases"), &[], &["--aggregate"]);
    assert_eq!(agg.run.code(), 0, "{}", agg.run.stderr);
    assert_eq!(agg.run.stderr, "");
    assert_eq!(agg.run.stdout, full.run.stdout);
    assert_eq!(agg.meta("trace_mode").as_deref(), Some("aggregate"));
    // What the aggregate trace kept is what SQL finds over the full
    // trace's events, and what the full trace kept beside them.
    let a = aggregates(&agg);
    assert_eq!(a, from_events(&full));
    assert_eq!(a, aggregates(&full));
    assert!(a["calls"].len() >= 8, "{:?}", a["calls"]);
    assert!(!a["live"].is_empty() && !a["peak"].is_empty());
    for view in ["events", "allocations", "leaks", "temporary"] {
        assert_eq!(
            agg.int(&format!("SELECT count(*) FROM {view}")),
            0,
            "{view}"
        );
    }
    // Leaks by stack are kept without a row per call.
    let by_stack =
        "SELECT coalesce(stack_id, -1) || '', bytes, blocks FROM leaks_by_stack ORDER BY 1";
    assert!(!rows(&full, by_stack).is_empty());
    assert_eq!(rows(&agg, by_stack), rows(&full, by_stack));
    assert!(agg.int("SELECT count(*) FROM agg_over_time") > 0);
    assert!(agg.int("SELECT count(*) FROM stacks") > 0);
    // The reports agree: every figure of the JSON report, but when the
    // peak was, addresses (ASLR) and the ids of stacks and threads.
    let json = |t: &Trace| -> serde_json::Value {
        let r = run(
            memptrace()
                .args(["report", "--format", "json"])
                .arg(&t.path),
            b"",
        );
        assert_eq!(r.code(), 0, "{}", r.stderr);
        let mut v = serde_json::from_str(&r.stdout).unwrap();
        forget(&mut v);
        v
    };
    let (jf, ja) = (json(&full), json(&agg));
    for key in ["functions", "heap", "top", "callers", "modules"] {
        assert_eq!(ja[key], jf[key], "{key}");
    }
    assert!(!ja["top"]["leaked"].as_array().unwrap().is_empty());
    assert_eq!(ja["trace"]["events"], jf["trace"]["events"]);
    assert_eq!(ja["trace"]["aggregate_resolution_ns"], 100_000_000);
    assert!(jf["trace"].get("aggregate_resolution_ns").is_none());
    // The text says which kind of trace it is, in one line.
    let text = |t: &Trace| {
        let r = run(memptrace().arg("report").arg(&t.path), b"");
        assert_eq!(r.code(), 0, "{}", r.stderr);
        r.stdout
    };
    let line = "  aggregate  recorded with --aggregate: totals, leaks and peak exact, heap over time \
                by 0.100 s; no row per call (the events views are empty)";
    let ta = text(&agg);
    assert!(ta.lines().any(|l| l == line), "{ta}");
    assert!(!text(&full).contains("--aggregate"));
    // plot draws the heap from the buckets over time, with the same peak
    // and sizes; window needs single calls and says so.
    let svg = agg.path.with_extension("svg");
    let r = run(
        memptrace().arg("plot").arg(&agg.path).arg("-o").arg(&svg),
        b"",
    );
    assert_eq!((r.code(), r.stderr.as_str()), (0, ""));
    let texts = crate::support::svg_texts(&svg);
    for want in [
        "Heap in use (bytes requested): peak 297.2 KiB in ",
        "peak 297.2 KiB at ",
        "Requested sizes of ",
    ] {
        assert!(
            texts.iter().any(|t| t.starts_with(want)),
            "no {want:?} in {texts:#?}"
        );
    }
    let r = run(
        memptrace()
            .arg("window")
            .arg(&agg.path)
            .args(["--from", "0", "--to", "1"]),
        b"",
    );
    assert_eq!(r.code(), 1);
    assert_eq!(
        r.stderr,
        format!(
            "memptrace: {}: recorded with --aggregate: a window needs the single calls, which the trace does not have (its heap over time per stack is in agg_over_time)\n",
            agg.path.display()
        )
    );
}

/// Leave out of a JSON report what differs between two runs of a program.
fn forget(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            for key in ["stack_ids", "peak_ns", "tid", "pid", "address"] {
                map.remove(key);
            }
            map.values_mut().for_each(forget);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(forget),
        _ => {}
    }
}

/// A million calls: the aggregate trace's size follows the stacks, not the
/// calls. What is stored does not depend on how calls are caught (the
/// tests above check both probe modes): jump probes always, as a million
/// int3 stops take minutes on a loaded machine.
#[test]
fn aggregate_trace_is_bounded_by_stacks_not_calls() {
    let program = tracee(Variant::Dynamic, "filler");
    let full = trace_program(&program, &["100"], &["--probes", "jump"]);
    let agg = trace_program(&program, &["100"], &["--probes", "jump", "--aggregate"]);
    for t in [&full, &agg] {
        assert_eq!(t.run.code(), 3, "filler exits 3: {}", t.run.stderr);
    }
    let calls: i64 = agg
        .run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("done "))
        .expect("filler prints its calls")
        .trim()
        .parse()
        .unwrap();
    assert!(calls >= 1_000_000, "{calls} calls");
    assert!(agg.int("SELECT events FROM agg_totals") >= calls);
    assert_eq!(agg.int("SELECT count(*) FROM event_log"), 0);
    let size = |t: &Trace| std::fs::metadata(&t.path).unwrap().len();
    let (full_size, agg_size) = (size(&full), size(&agg));
    let stacks = agg.int("SELECT count(*) FROM stacks");
    eprintln!(
        "filler 100: {calls} calls, {stacks} stack nodes: full trace {full_size} bytes, aggregate {agg_size} bytes"
    );
    assert!(
        agg_size * 20 < full_size,
        "aggregate {agg_size} bytes against full {full_size} bytes"
    );
    // Ten times fewer calls from the same stacks: the same size, but for
    // the heap over time, which grows with the trace's length (a row per
    // stack and bucket at most; a loaded machine makes the run longer).
    let small = trace_program(&program, &["10"], &["--probes", "jump", "--aggregate"]);
    assert_eq!(small.run.code(), 3, "{}", small.run.stderr);
    let small_size = size(&small);
    let over_time = |t: &Trace| t.int("SELECT count(*) FROM agg_over_time") as u64;
    let (rows, small_rows) = (over_time(&agg), over_time(&small));
    eprintln!(
        "filler 10: aggregate {small_size} bytes; agg_over_time rows {rows} and {small_rows}"
    );
    assert!(
        agg_size <= small_size + rows.saturating_sub(small_rows) * 40 + (128 << 10),
        "aggregate of {calls} calls {agg_size} bytes, of a tenth of them {small_size} bytes"
    );
}

/// A full trace's reports read its aggregates; what they print is what the
/// pass over its events prints (`MEMPTRACE_REPORT_FROM_EVENTS`, a debug
/// knob, forces the pass): `report` in text and JSON, the folded stacks of
/// `flamegraph` and `export --collapsed` for every metric, and the pprof
/// profile. phases.c (peak, temporary blocks, leaks), threads.c (eight
/// threads), execs.c (blocks released by an exec).
#[test]
fn full_trace_reports_from_aggregates_equal_reports_from_events() {
    for (name, args) in [
        ("phases", &[][..]),
        ("threads", &["4", "500"][..]),
        ("execs", &[][..]),
    ] {
        let t = trace(Variant::Dynamic, name, args, &[]);
        assert_eq!(t.int("SELECT count(*) FROM agg_totals"), 1, "{name}");
        let out = |args: &[&str], scan: bool| -> Vec<u8> {
            let mut cmd = memptrace();
            cmd.args(args).arg(&t.path);
            if scan {
                cmd.env("MEMPTRACE_REPORT_FROM_EVENTS", "1");
            }
            let r = run(&mut cmd, b"");
            assert_eq!((r.code(), r.stderr.as_str()), (0, ""), "{name} {args:?}");
            r.stdout.into_bytes()
        };
        for args in [&["report"][..], &["report", "--format", "json"][..]] {
            let (kept, scanned) = (out(args, false), out(args, true));
            assert!(!kept.is_empty());
            assert_eq!(
                String::from_utf8_lossy(&kept),
                String::from_utf8_lossy(&scanned),
                "{name} {args:?}"
            );
        }
        let file = |args: &[&str], ext: &str, scan: bool| -> Vec<u8> {
            let path = t.path.with_extension(format!("{}.{ext}", u8::from(scan)));
            let mut cmd = memptrace();
            cmd.args(args).arg(&path).arg(&t.path);
            if scan {
                cmd.env("MEMPTRACE_REPORT_FROM_EVENTS", "1");
            }
            let r = run(&mut cmd, b"");
            assert_eq!((r.code(), r.stderr.as_str()), (0, ""), "{name} {args:?}");
            std::fs::read(&path).unwrap()
        };
        for metric in ["peak", "leaked", "allocated", "calls"] {
            let args = ["export", "--metric", metric, "--collapsed"];
            let (kept, scanned) = (file(&args, "txt", false), file(&args, "txt", true));
            assert!(!kept.is_empty(), "{name} {metric}");
            assert_eq!(
                String::from_utf8_lossy(&kept),
                String::from_utf8_lossy(&scanned),
                "{name} {metric}"
            );
        }
        let args = ["flamegraph", "--metric", "peak", "-o"];
        assert_eq!(
            file(&args, "svg", false),
            file(&args, "svg", true),
            "{name}"
        );
        let args = ["export", "--pprof"];
        assert_eq!(file(&args, "pb", false), file(&args, "pb", true), "{name}");
    }
}
