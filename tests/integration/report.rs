//! The report commands on real traces: `report` (golden text, JSON against
//! the truth of tracee-tests/phases.c), `window`, `flamegraph`, `plot`,
//! `export`, and queries on a trace while it is being recorded.
//!
//! Golden files are in tests/integration/golden/; after a deliberate change
//! of the report's text, regenerate them with
//! `MEMPTRACE_BLESS=1 cargo test --test integration report_`.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regex::Regex;
use rusqlite::{Connection, OpenFlags};
use serde_json::Value;

use crate::support::{
    Background, Run, Trace, VARIANTS, Variant, count_events, memptrace, run, scratch, trace,
    trace_program, tracee, wait_until,
};

/// Run `memptrace ARGS` to its end; it must succeed and say nothing on stderr.
fn memptrace_ok(args: &[&str]) -> Run {
    let r = run(memptrace().args(args), b"");
    assert_eq!(r.code(), 0, "memptrace {args:?}: {}", r.stderr);
    assert_eq!(r.stderr, "", "memptrace {args:?} on a pipe says nothing");
    r
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

/// `report --format json` of a trace.
fn report_json(t: &Trace, extra: &[&str]) -> Value {
    let mut args = vec!["report", path_str(&t.path), "--format", "json"];
    args.extend_from_slice(extra);
    serde_json::from_str(&memptrace_ok(&args).stdout).expect("the report is JSON")
}

/// The innermost function of a stack row of the JSON report.
fn leaf(row: &Value) -> &str {
    row["frames"][0]["function"].as_str().unwrap_or("")
}

/// Lines `<prefix> <fields...>` of the tracee's output.
fn stated<'a>(t: &'a Trace, prefix: &str) -> Vec<Vec<&'a str>> {
    t.run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(|l| l.split_whitespace().collect())
        .collect()
}

fn phases(variant: Variant) -> Trace {
    let t = trace(variant, "phases", &[], &[]);
    assert_eq!(t.run.code(), 0);
    t.assert_truth();
    t
}

fn json_report_matches_the_truth(variant: Variant) {
    let t = phases(variant);
    let r = report_json(&t, &["--top", "1000"]);
    let heap = &r["heap"];
    let int = |v: &Value| v.as_u64().expect("a number");
    let sql = |q: &str| t.int(q) as u64;
    assert_eq!(int(&heap["calls"]), sql("SELECT count(*) FROM events"));
    assert_eq!(
        int(&heap["leaked_bytes"]),
        sql("SELECT sum(size) FROM leaks")
    );
    assert_eq!(
        int(&heap["leaked_blocks"]),
        sql("SELECT count(*) FROM leaks")
    );
    assert_eq!(
        int(&heap["temporary"]),
        sql("SELECT count(*) FROM temporary")
    );
    assert_eq!(
        int(&heap["peak_bytes"]),
        sql("SELECT max(bytes) FROM heap_over_time")
    );
    assert!(r["trace"]["finished"].as_bool().unwrap());

    // The peak: the tracee's blocks live then are the truth; whatever else
    // was live (static glibc's own start-up blocks) is in the ranking too.
    let peak: u64 = stated(&t, "peak ")[0][0].parse().unwrap();
    let at_peak = |f: &dyn Fn(&str) -> bool| -> u64 {
        r["top"]["peak"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|row| f(leaf(row)))
            .map(|row| int(&row["peak_bytes"]))
            .sum()
    };
    assert_eq!(at_peak(&|f| f.starts_with("phase_")), peak, "{variant:?}");
    assert_eq!(at_peak(&|_| true), int(&heap["peak_bytes"]));

    // A function's blocks may come from several call sites (an unrolled
    // loop): sum its stacks.
    let sum = |ranking: &str, function: &str, field: &str| -> u64 {
        r["top"][ranking]
            .as_array()
            .unwrap()
            .iter()
            .filter(|row| leaf(row) == function)
            .map(|row| int(&row[field]))
            .sum()
    };
    for fields in stated(&t, "temporary ") {
        let want: u64 = fields[1].parse().unwrap();
        assert_eq!(sum("temporary", fields[0], "temporary"), want, "{fields:?}");
    }
    for leak in t.truth_leaks() {
        assert_eq!(
            sum("leaked", &leak.function, "leaked_bytes"),
            leak.bytes as u64,
            "{leak:?}"
        );
        assert_eq!(
            sum("leaked", &leak.function, "leaked_blocks"),
            leak.blocks as u64,
            "{leak:?}"
        );
    }
    // Calls per function and the one thread.
    let malloc = r["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["function"] == "malloc")
        .unwrap();
    assert_eq!(
        int(&malloc["calls"]),
        sql("SELECT count(*) FROM events WHERE op = 'malloc'")
    );
    assert_eq!(r["threads"].as_array().unwrap().len(), 1);
    // Every allocation is charged to the program: libc allocating for
    // printf is charged to main, which called it.
    let modules = r["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 1, "{variant:?}: {modules:?}");
    assert_eq!(modules[0]["module"], "phases");
    assert_eq!(modules[0]["bytes"], heap["bytes"]);
}

#[test]
fn report_json_matches_the_truth() {
    for variant in VARIANTS {
        json_report_matches_the_truth(variant);
    }
}

/// Replace what changes from run to run: paths, dates, times, thread ids.
fn normalise(text: &str, t: &Trace, program: &Path) -> String {
    let mut text = text
        .replace(path_str(&t.path), "TRACE")
        .replace(path_str(program), "PROGRAM");
    for (pattern, by) in [
        (r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", "DATE"),
        (r"\d+\.\d{3} s\b", "T s"),
    ] {
        text = Regex::new(pattern)
            .unwrap()
            .replace_all(&text, by)
            .into_owned();
    }
    let tid = t.int("SELECT tid FROM threads LIMIT 1");
    let text = Regex::new(&format!(r"(?m)^(\s+){tid}\b"))
        .unwrap()
        .replace_all(&text, "${1}TID")
        .into_owned();
    // The thread table's columns are as wide as the thread id: in that
    // table, any run of spaces is two (tables_align checks alignment).
    let spaces = Regex::new(r"(\S)  +").unwrap();
    let mut in_threads = false;
    // The frames of a stack below `main` are the C library's start-up code:
    // their names, files, lines and number depend on the C library's build,
    // so they are left out (the lines of a stack are indented by 7).
    let mut below_main = false;
    let mut out = String::new();
    for line in text.lines() {
        in_threads = (in_threads && !line.is_empty()) || line == "Threads";
        let frame = line.starts_with("       ");
        below_main = frame && (below_main || line.starts_with("       main ("));
        if below_main && !line.starts_with("       main (") {
            continue;
        }
        if in_threads {
            out.push_str(&spaces.replace_all(line, "$1  "));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The lines of the section of a report that starts with the line `title`,
/// up to the next blank line.
fn section<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| *l == title)
        .unwrap_or_else(|| panic!("no section {title:?} in\n{text}"));
    lines[start..]
        .iter()
        .take_while(|l| !l.is_empty())
        .copied()
        .collect()
}

/// Compare with a golden file, or write it when MEMPTRACE_BLESS is set.
fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/integration/golden")
        .join(name);
    if std::env::var_os("MEMPTRACE_BLESS").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; create it with MEMPTRACE_BLESS=1 cargo test --test integration report_",
            path.display()
        )
    });
    if expected != actual {
        let first = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(expected.lines().count().min(actual.lines().count()));
        panic!(
            "{} differs from the output, first at line {}:\n--- expected\n{}\n--- actual\n{}\n\
             (after a deliberate change: MEMPTRACE_BLESS=1 cargo test --test integration report_)",
            path.display(),
            first + 1,
            expected.lines().nth(first).unwrap_or("<end>"),
            actual.lines().nth(first).unwrap_or("<end>"),
        );
    }
}

/// The window around phase B: from the middle of the pause between the
/// last call of phase A and the first of phase B to the middle of the pause
/// between the last call of phase B and the first of phase C. The phases
/// are told apart by the functions that made the calls (`phase_a_*`,
/// `phase_b_*`), not by how long the pauses took.
fn phase_b(t: &Trace) -> (u64, u64) {
    let boundary = |phase: &str| -> u64 {
        t.db.query_row(
            "WITH last AS (
                 SELECT max(e.id) AS id FROM events e
                 JOIN stacks s ON s.id = e.stack_id JOIN frames f ON f.id = s.frame_id
                 WHERE f.function GLOB ?1)
             SELECT (a.ts_ns + b.ts_ns) / 2 FROM last
             JOIN events a ON a.id = last.id
             JOIN events b ON b.id = (SELECT min(id) FROM events WHERE id > last.id)",
            [format!("phase_{phase}_*")],
            |r| r.get::<_, i64>(0),
        )
        .unwrap_or_else(|e| panic!("the end of phase {phase}: {e}")) as u64
    };
    let (from, to) = (boundary("a"), boundary("b"));
    assert!(from < to, "{from} {to}");
    (from, to)
}

/// `memptrace window` around phase B, with `extra` options.
fn window_of_phase_b(t: &Trace, extra: &[&str]) -> Run {
    let (from, to) = phase_b(t);
    let (from, to) = (format!("{from}ns"), format!("{to}ns"));
    let mut args = vec!["window", path_str(&t.path), "--from", &from, "--to", &to];
    args.extend_from_slice(extra);
    memptrace_ok(&args)
}

/// A copy of a tracee at a path of the same length on every machine and
/// checkout: static glibc allocates a copy of the program's directory at
/// start-up (`_dl_get_origin`), so byte counts depend on its length.
fn fixed_length_copy(variant: Variant, name: &str) -> PathBuf {
    let dir = fixed_length_dir().join(variant.name());
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join(name);
    std::fs::copy(tracee(variant, name), &copy).unwrap();
    copy
}

fn fixed_length_dir() -> PathBuf {
    Path::new("/tmp").join(format!("memptrace-golden-{:010}", std::process::id()))
}

/// The report's text, golden. A dynamic build's trace holds the program's
/// own calls only (phases.c gives stdout a buffer of its own), so with the
/// C library's start-up frames left out (`normalise`) the text is the same
/// whatever the C library's build. A static build's trace also holds the C
/// library's start-up allocations, which differ between its builds: its
/// rankings of the program's own stacks (by calls, by temporary blocks)
/// must read exactly as the dynamic build's.
#[test]
fn report_text_golden() {
    let mut dynamic = String::new();
    for variant in [Variant::Dynamic, Variant::Static] {
        let program = fixed_length_copy(variant, "phases");
        let t = trace_program(&program, &[], &[]);
        assert_eq!(t.run.code(), 0);
        t.assert_sound();
        t.assert_truth();
        let out = memptrace_ok(&["report", path_str(&t.path)]);
        assert!(!out.stdout.contains('\x1b'), "no colour on a pipe");
        let text = normalise(&out.stdout, &t, &program);
        if variant == Variant::Static {
            for title in [
                "Top 5 stacks by allocation calls",
                "Top 5 stacks by temporary blocks",
            ] {
                assert_eq!(section(&text, title), section(&dynamic, title));
            }
            continue;
        }
        golden("report-phases-dynamic.txt", &text);
        dynamic = text;
        let out = window_of_phase_b(&t, &[]);
        golden(
            "window-phases-dynamic.txt",
            &normalise(&out.stdout, &t, &program),
        );
        let coloured = memptrace_ok(&["report", path_str(&t.path), "--color", "always"]);
        assert!(coloured.stdout.contains("\x1b[1m"), "colour when asked");
    }
    std::fs::remove_dir_all(fixed_length_dir()).unwrap();
}

fn window_classes_match_the_truth(variant: Variant) {
    let t = phases(variant);
    let (from, to) = phase_b(&t);
    let r = window_of_phase_b(&t, &["--format", "json", "--top", "1000"]);
    let w: Value = serde_json::from_str(&r.stdout).unwrap();
    // (class, function) -> (blocks, bytes), from the report.
    let mut found: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for class in w["classes"].as_array().unwrap() {
        for stack in class["stacks"].as_array().unwrap() {
            let function = leaf(stack);
            if function.starts_with("phase_") {
                let e = found
                    .entry((class["class"].as_str().unwrap().into(), function.into()))
                    .or_default();
                e.0 += stack["blocks"].as_u64().unwrap();
                e.1 += stack["bytes"].as_u64().unwrap();
            }
        }
    }
    let truth: BTreeMap<(String, String), (u64, u64)> = stated(&t, "window ")
        .into_iter()
        .map(|f| {
            (
                (f[0].into(), f[1].into()),
                (f[2].parse().unwrap(), f[3].parse().unwrap()),
            )
        })
        .collect();
    assert_eq!(found, truth, "{variant:?}");

    // The query of docs/reports.md ("Time windows in SQL") agrees.
    let mut stmt =
        t.db.prepare(
            "SELECT CASE WHEN alloc_ns >= :t0 THEN 'allocated-inside' ELSE 'allocated-before' END
                    || '/' ||
                    CASE WHEN free_ns <= :t1 THEN 'freed-inside' ELSE 'outstanding' END AS class,
                    count(*) AS blocks, sum(size) AS bytes
             FROM allocations
             WHERE alloc_ns <= :t1 AND (free_ns IS NULL OR free_ns >= :t0)
             GROUP BY class ORDER BY class",
        )
        .unwrap();
    let by_sql: Vec<(String, u64, u64)> = stmt
        .query_map(
            rusqlite::named_params! {":t0": from as i64, ":t1": to as i64},
            |r| {
                Ok((
                    r.get(0)?,
                    r.get::<_, i64>(1)? as u64,
                    r.get::<_, i64>(2)? as u64,
                ))
            },
        )
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut by_command: Vec<(String, u64, u64)> = w["classes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["blocks"].as_u64().unwrap() > 0)
        .map(|c| {
            (
                c["class"].as_str().unwrap().to_string(),
                c["blocks"].as_u64().unwrap(),
                c["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    by_command.sort();
    assert_eq!(by_sql, by_command, "{variant:?}");
}

#[test]
fn window_classes_match_the_truth_on_every_variant() {
    for variant in VARIANTS {
        window_classes_match_the_truth(variant);
    }
}

/// Every `<title>` of an SVG.
fn svg_titles(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    // inferno's SVG starts with a DOCTYPE.
    let options = roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    };
    let doc = roxmltree::Document::parse_with_options(&text, options)
        .expect("the SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.tag_name().name() == "title")
        .filter_map(|n| n.text().map(str::to_string))
        .collect()
}

#[test]
fn flamegraph_names_the_functions() {
    for variant in [Variant::Dynamic, Variant::Musl] {
        let t = trace(variant, "leaks", &[], &[]);
        let dir = t.path.parent().unwrap();
        let svg = dir.join("leaks.svg");
        memptrace_ok(&[
            "flamegraph",
            path_str(&t.path),
            "-o",
            path_str(&svg),
            "--metric",
            "leaked",
        ]);
        let titles = svg_titles(&svg);
        for expected in [
            "leak_small (1,000 bytes",
            "leak_big (3,145,728 bytes",
            "main (",
        ] {
            assert!(
                titles.iter().any(|t| t.starts_with(expected)),
                "{variant:?}: no {expected:?} in {titles:?}"
            );
        }
        assert!(
            !titles.iter().any(|t| t.starts_with("churn_alloc")),
            "churn leaks nothing"
        );
        for metric in ["allocated", "calls", "peak"] {
            let out = dir.join(format!("{metric}.svg"));
            memptrace_ok(&[
                "flamegraph",
                path_str(&t.path),
                "-o",
                path_str(&out),
                "--metric",
                metric,
            ]);
            let titles = svg_titles(&out);
            assert!(
                titles.iter().any(|t| t.starts_with("leak_big (")),
                "{metric}: {titles:?}"
            );
        }
        let calls = svg_titles(&dir.join("calls.svg"));
        assert!(
            calls
                .iter()
                .any(|t| t.starts_with("churn_alloc (1,000 calls"))
        );
    }
}

#[test]
fn plot_writes_svg_and_png() {
    let t = phases(Variant::Dynamic);
    let dir = t.path.parent().unwrap();
    let svg = dir.join("heap.svg");
    memptrace_ok(&["plot", path_str(&t.path), "-o", path_str(&svg)]);
    // What the picture says: the heap in a panel and on an axis of its
    // own, its peak marked; the sampled memory in a second panel, with a
    // legend naming each line; the sizes.
    let texts = crate::support::svg_texts(&svg);
    let has = |want: &str| texts.iter().any(|t| t.starts_with(want));
    for want in [
        "Heap in use (bytes requested): peak 297.2 KiB in ",
        "heap in use (KiB)",
        "peak 297.2 KiB at ",
        "Memory of the process, sampled: RSS peak ",
        "resident (RSS)",
        "resident anonymous",
        "mapped",
        "Requested sizes of ",
    ] {
        assert!(has(want), "no {want:?} in {texts:#?}");
    }
    // The heap's axis is its own: no line of the memory panel is named on it.
    assert!(
        !texts.iter().any(|t| t.starts_with("bytes (")),
        "{texts:#?}"
    );

    let png = dir.join("heap.png");
    memptrace_ok(&[
        "plot",
        path_str(&t.path),
        "-o",
        path_str(&png),
        "--size",
        "800x600",
    ]);
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let reader = decoder.read_info().expect("a PNG");
    let info = reader.info();
    assert_eq!((info.width, info.height), (800, 600));

    let bad = run(
        memptrace().args(["plot", path_str(&t.path), "-o", "heap.jpg"]),
        b"",
    );
    assert_eq!(bad.code(), 1);
    assert!(
        bad.stderr.contains("name the file .svg or .png"),
        "{}",
        bad.stderr
    );
}

#[test]
fn export_pprof_and_folded_stacks() {
    use prost::Message;
    let t = trace(Variant::Dynamic, "leaks", &[], &[]);
    let dir = t.path.parent().unwrap();
    let (pb, folded) = (dir.join("heap.pb.gz"), dir.join("heap.folded"));
    memptrace_ok(&[
        "export",
        path_str(&t.path),
        "--pprof",
        path_str(&pb),
        "--collapsed",
        path_str(&folded),
    ]);
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&pb).unwrap())
        .read_to_end(&mut raw)
        .expect("gzip");
    let p = memptrace::report::pprof::Profile::decode(&raw[..]).expect("profile.proto");
    let types: Vec<&str> = p
        .sample_type
        .iter()
        .map(|v| p.string_table[v.r#type as usize].as_str())
        .collect();
    assert_eq!(
        types,
        [
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space"
        ]
    );
    let total = |i: usize| p.sample.iter().map(|s| s.value[i]).sum::<i64>();
    assert_eq!(
        total(0),
        t.int("SELECT count(*) FROM allocations WHERE alloc_id IS NOT NULL")
    );
    assert_eq!(
        total(1),
        t.int("SELECT sum(size) FROM allocations WHERE alloc_id IS NOT NULL")
    );
    assert_eq!(total(2), t.int("SELECT count(*) FROM leaks"));
    assert_eq!(total(3), t.int("SELECT sum(size) FROM leaks"));
    assert!(p.string_table.iter().any(|s| s == "leak_big"));

    let text = std::fs::read_to_string(&folded).unwrap();
    let sum: i64 = text
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<i64>().unwrap())
        .sum();
    assert_eq!(sum, total(1), "folded stacks weigh allocated bytes");
    assert!(
        text.lines()
            .any(|l| l.starts_with("_start;") && l.contains(";main;leak_small 1000")),
        "{text}"
    );
}

#[test]
fn reports_refuse_bad_input() {
    let dir = scratch("bad-report");
    let missing = dir.join("missing.db");
    let r = run(memptrace().args(["report", path_str(&missing)]), b"");
    assert_eq!(r.code(), 1);
    assert!(r.stderr.contains("no such file"), "{}", r.stderr);
    let text = dir.join("notes.db");
    std::fs::write(&text, "not sqlite").unwrap();
    let r = run(memptrace().args(["report", path_str(&text)]), b"");
    assert_eq!(r.code(), 1);
    assert!(r.stderr.contains("not a memptrace trace"), "{}", r.stderr);
    let r = run(
        memptrace().args(["window", "x.db", "--from", "2s", "--to", "1s"]),
        b"",
    );
    assert_eq!(r.code(), 1);
    assert!(r.stderr.contains("--from"), "{}", r.stderr);
}

/// `sqlite3 trace.db` while the trace runs: each call the program makes
/// reaches readers while the program still runs, although it then waits
/// (the recorder commits on a timer, not only when a batch fills), and a
/// report reads the unfinished trace. The program (ticker) makes one call
/// per line it reads and says when it has: the test waits for conditions,
/// never for a time.
#[test]
fn queries_work_while_tracing() {
    let dir = scratch("live");
    let path: PathBuf = dir.join("trace.db");
    let mut tracer = Background::interactive(
        memptrace()
            .arg("-o")
            .arg(&path)
            .arg("--")
            .arg(tracee(Variant::Dynamic, "ticker"))
            .arg("stdin"),
    );
    // Its blocks are the only 64-byte ones; frames get names only at the end.
    let steps_seen = || -> Option<i64> {
        let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).ok()?;
        conn.busy_timeout(Duration::from_secs(2)).ok()?;
        conn.query_row(
            "SELECT count(*) FROM events WHERE op = 'malloc' AND size = 64",
            [],
            |r| r.get(0),
        )
        .ok()
    };
    let mut events = 0;
    for step in 1..=4 {
        tracer.send("\n");
        assert_eq!(tracer.wait_for("step"), step.to_string());
        // The program now waits for its next line: the call it made must
        // reach readers all the same.
        wait_until(&format!("step {step} is readable while tracing"), || {
            steps_seen().is_some_and(|n| n >= step)
        });
        assert_eq!(steps_seen(), Some(step), "one block per step");
        let now = count_events(&path).unwrap();
        assert!(now > events, "the trace grew: {events} -> {now}");
        events = now;
        if step == 1 {
            let r = memptrace_ok(&["report", path_str(&path), "--format", "json"]);
            let report: Value = serde_json::from_str(&r.stdout).unwrap();
            assert_eq!(report["trace"]["finished"], false);
            assert_eq!(report["heap"]["live_at_end"], "now");
            assert!(report["heap"]["calls"].as_u64().unwrap() > 0);
        }
    }
    tracer.close_stdin();
    let run = tracer.finish();
    assert_eq!(run.code(), 0, "{}", run.stderr);
    let t = Trace {
        run,
        db: Connection::open(&path).unwrap(),
        path,
    };
    t.assert_sound();
    t.assert_truth();
    assert!(t.int("SELECT count(*) FROM events") >= events);
}
