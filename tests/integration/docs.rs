//! The queries the documentation shows run on a real trace: every ```sql
//! block of README.md, docs/queries.md and docs/schema.md; and every option
//! of `--help` is documented.

use crate::support::{Variant, trace};

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
