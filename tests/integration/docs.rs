//! The queries the documentation shows run on a real trace: every ```sql
//! block of README.md, docs/queries.md and docs/schema.md, and the queries
//! of scripts/example on a trace of its example program; and every option
//! of `--help` is documented.

use std::collections::HashSet;

use crate::support::{Variant, scratch, trace, trace_program};

fn sql_blocks(text: &str) -> Vec<String> {
    text.split("```sql\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap().to_string())
        .collect()
}

#[test]
fn documented_queries_run() {
    let t = trace(Variant::Dynamic, "threads", &[], &[]);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut ran = 0;
    for doc in ["README.md", "docs/queries.md", "docs/schema.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        for block in sql_blocks(&text) {
            for statement in block.split(";\n").map(str::trim).filter(|s| !s.is_empty()) {
                let sql = statement.trim_end_matches(';');
                let mut stmt =
                    t.db.prepare(sql)
                        .unwrap_or_else(|e| panic!("{doc}: {e}\n{sql}"));
                let columns = stmt.column_count();
                // A documented parameter (`:stack`) gets the first stack.
                let params: Vec<i64> = vec![1; stmt.parameter_count()];
                let mut rows = stmt
                    .query(rusqlite::params_from_iter(params))
                    .unwrap_or_else(|e| panic!("{doc}: {e}\n{sql}"));
                while let Some(row) = rows.next().unwrap_or_else(|e| panic!("{doc}: {e}\n{sql}")) {
                    for i in 0..columns {
                        let _: rusqlite::types::Value = row.get(i).unwrap();
                    }
                }
                ran += 1;
            }
        }
    }
    assert!(ran >= 15, "only {ran} documented queries found");
}

/// Every option `--help` lists, of memptrace and of each command, is
/// documented in README.md or docs/reports.md (but --help and --version).
#[test]
fn every_option_is_documented() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs: String = ["README.md", "docs/reports.md"]
        .iter()
        .map(|doc| std::fs::read_to_string(root.join(doc)).unwrap())
        .collect();
    let option = regex::Regex::new(r"^\s+(?:-[a-zA-Z], )?(--[a-z][a-z-]+)").unwrap();
    let mut checked = 0;
    for command in [
        None,
        Some("attach"),
        Some("report"),
        Some("flamegraph"),
        Some("plot"),
        Some("export"),
        Some("window"),
        Some("heapmap"),
        Some("completions"),
        Some("man"),
    ] {
        let out = crate::support::run(crate::support::memptrace().args(command).arg("--help"), b"");
        assert_eq!(out.code(), 0, "{}", out.stderr);
        for line in out.stdout.lines() {
            let Some(name) = option.captures(line).map(|c| c[1].to_string()) else {
                continue;
            };
            if name != "--help" && name != "--version" {
                assert!(
                    docs.contains(&name),
                    "{command:?}: {name} is not documented"
                );
                checked += 1;
            }
        }
        if let Some(command) = command {
            assert!(
                docs.contains(&format!("memptrace {command}")),
                "`memptrace {command}` is not documented"
            );
        }
    }
    assert!(checked >= 30, "only {checked} options found");
}

/// scripts/example's queries on a trace of examples/leaky.c, built as the
/// script builds it: the leak table shows whole frames from the call site
/// out (never `leaky.c:6` for `leaky.c:65`), the program's two leaks first.
#[test]
fn example_queries_show_whole_frames() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let program = scratch("example").join("leaky");
    let built = std::process::Command::new("gcc")
        .args(["-g", "-O1", "-pthread", "-o"])
        .arg(&program)
        .arg(root.join("examples/leaky.c"))
        .status()
        .unwrap();
    assert!(built.success());
    let t = trace_program(&program, &[], &[]);
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    // Every line of every frame's text: what a whole frame reads.
    let mut stmt = t.db.prepare("SELECT text FROM frame_text").unwrap();
    let frames: HashSet<String> = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .flat_map(|text| {
            let text = text.unwrap();
            text.lines().map(str::to_string).collect::<Vec<_>>()
        })
        .collect();
    let script = std::fs::read_to_string(root.join("scripts/example")).unwrap();
    let queries: Vec<&str> = script
        .split("trace.db \"")
        .skip(1)
        .map(|rest| rest.split('"').next().unwrap())
        .collect();
    assert_eq!(queries.len(), 2, "{script}");
    let mut stmt = t.db.prepare(queries[1]).unwrap();
    let columns: Vec<&str> = stmt.column_names().collect();
    assert_eq!(columns, ["blocks", "bytes", "stack"]);
    let rows: Vec<(i64, i64, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for (_, _, stack) in &rows {
        let parts: Vec<&str> = stack.split(" <- ").collect();
        for part in &parts {
            assert!(
                frames.contains(*part),
                "{part:?} is not a whole frame: {stack}"
            );
        }
        let text: usize = parts.iter().map(|p| p.chars().count() + 1).sum();
        assert!(parts.len() == 1 || text <= 111, "{stack}");
    }
    let site =
        regex::Regex::new(r"^cache_insert \(\S*leaky\.c:\d+\)( <- main \(\S*leaky\.c:\d+\))?")
            .unwrap();
    assert_eq!((rows[0].0, rows[0].1), (1000, 16000), "{rows:?}");
    assert!(site.is_match(&rows[0].2), "{rows:?}");
    assert_eq!((rows[1].0, rows[1].1), (1000, 7890), "{rows:?}");
    assert!(rows[1].2.starts_with("copy_key ("), "{rows:?}");
    // The first query runs too.
    let mut stmt = t.db.prepare(queries[0]).unwrap();
    assert!(stmt.query([]).unwrap().next().unwrap().is_some());
}
