//! `memptrace export --parquet DIR` on real traces: the files read back
//! with the parquet crate's Arrow reader hold every row of the trace, the
//! trace's id in each, and give the same totals as SQL on the database and
//! as the truth the tracee states; and its bad input, with exact stderr.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::{Int64Type, UInt64Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::support::{Trace, Variant, memptrace, run, scratch, trace};

fn path_str(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

/// Every row of a Parquet file, as one batch.
fn read(path: &Path) -> RecordBatch {
    let file = File::open(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    let rows = builder.metadata().file_metadata().num_rows();
    assert!(rows > 0, "{path:?} has no rows");
    // A batch reads on across row groups: one batch of every row.
    let mut reader = builder.with_batch_size(rows as usize).build().unwrap();
    let batch = reader.next().unwrap().unwrap();
    assert_eq!(batch.num_rows() as i64, rows);
    assert!(reader.next().is_none());
    batch
}

fn ints(b: &RecordBatch, name: &str) -> Vec<Option<i64>> {
    let c = b
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no {name}"));
    c.as_primitive::<Int64Type>().iter().collect()
}

fn texts(b: &RecordBatch, name: &str) -> Vec<Option<String>> {
    let c = b
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no {name}"));
    c.as_string::<i32>()
        .iter()
        .map(|s| s.map(str::to_string))
        .collect()
}

/// The four files of an export.
struct Files {
    events: RecordBatch,
    stacks: RecordBatch,
    frames: RecordBatch,
    meta: RecordBatch,
}

fn export(t: &Trace, dir: &Path) -> Files {
    let r = run(
        memptrace().args(["export", path_str(&t.path), "--parquet", path_str(dir)]),
        b"",
    );
    assert_eq!((r.code(), r.stderr.as_str()), (0, ""), "export --parquet");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "events.parquet",
            "frames.parquet",
            "meta.parquet",
            "stacks.parquet"
        ],
        "the files, and nothing left .partial"
    );
    Files {
        events: read(&dir.join("events.parquet")),
        stacks: read(&dir.join("stacks.parquet")),
        frames: read(&dir.join("frames.parquet")),
        meta: read(&dir.join("meta.parquet")),
    }
}

/// (function, op) -> (calls, bytes) from the files: events joined with the
/// stack row that `pick` chooses (the call site, or the innermost frame),
/// and that row's frame joined with `frames` for its name.
fn totals_by_function(
    f: &Files,
    pick: impl Fn(i64, bool) -> bool,
) -> BTreeMap<(String, String), (i64, i64)> {
    let names: HashMap<i64, Option<String>> = ints(&f.frames, "frame_id")
        .into_iter()
        .map(Option::unwrap)
        .zip(texts(&f.frames, "function"))
        .collect();
    let mut frame_of: HashMap<i64, i64> = HashMap::new();
    let (stack, position, frame) = (
        ints(&f.stacks, "stack_id"),
        ints(&f.stacks, "position"),
        ints(&f.stacks, "frame_id"),
    );
    let call_site: Vec<bool> = f
        .stacks
        .column_by_name("call_site")
        .unwrap()
        .as_boolean()
        .iter()
        .map(Option::unwrap)
        .collect();
    let function = texts(&f.stacks, "function");
    for i in 0..stack.len() {
        if pick(position[i].unwrap(), call_site[i]) {
            let frame = frame[i].unwrap();
            let previous = frame_of.insert(stack[i].unwrap(), frame);
            assert_eq!(previous, None, "one row picked per stack");
            // The name a stack row repeats is its frame's.
            assert_eq!(
                function[i], names[&frame],
                "stacks.function of frame {frame}"
            );
        }
    }
    let sizes: Vec<Option<u64>> = f
        .events
        .column_by_name("size")
        .unwrap()
        .as_primitive::<UInt64Type>()
        .iter()
        .collect();
    let mut totals = BTreeMap::new();
    for ((stack, op), size) in ints(&f.events, "stack_id")
        .into_iter()
        .zip(texts(&f.events, "op"))
        .zip(sizes)
    {
        let frame = frame_of[&stack.expect("every event has a stack")];
        let name = names[&frame].clone().unwrap_or_default();
        let entry = totals.entry((name, op.unwrap())).or_insert((0, 0));
        entry.0 += 1;
        entry.1 += size.unwrap_or(0) as i64;
    }
    totals
}

fn sql_totals(t: &Trace, sql: &str) -> BTreeMap<(String, String), (i64, i64)> {
    let mut stmt = t.db.prepare(sql).unwrap();
    stmt.query_map([], |r| {
        Ok((
            (
                r.get::<_, Option<String>>(0)?.unwrap_or_default(),
                r.get(1)?,
            ),
            (r.get(2)?, r.get(3)?),
        ))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

#[test]
fn export_parquet_gives_the_totals_of_the_trace() {
    let t = trace(Variant::Dynamic, "leaks", &[], &[]);
    t.assert_truth();
    // A directory that does not exist yet, two levels down.
    let dir = t.path.parent().unwrap().join("fleet/one");
    let f = export(&t, &dir);

    // Every row of the trace, no more.
    assert_eq!(
        f.events.num_rows() as i64,
        t.int("SELECT count(*) FROM events")
    );
    assert_eq!(
        f.frames.num_rows() as i64,
        t.int("SELECT count(*) FROM frames")
    );
    assert_eq!(f.meta.num_rows() as i64, t.int("SELECT count(*) FROM meta"));
    assert_eq!(
        f.stacks.num_rows() as i64,
        t.int(
            "SELECT sum(depth + 1) FROM stacks
             WHERE id IN (SELECT stack_id FROM events)"
        ),
        "a row per frame of every stack the events name"
    );
    assert_eq!(
        ints(&f.events, "id"),
        {
            let mut stmt = t.db.prepare("SELECT id FROM events ORDER BY id").unwrap();
            stmt.query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect::<Vec<Option<i64>>>()
        },
        "the events in order"
    );

    // The trace's id in every row of every file, as meta has it.
    let id = t.meta("trace_id").expect("meta.trace_id");
    assert_eq!(id.len(), 32);
    assert!(id.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
    for (name, batch) in [
        ("events", &f.events),
        ("stacks", &f.stacks),
        ("frames", &f.frames),
        ("meta", &f.meta),
    ] {
        let ids = texts(batch, "trace_id");
        assert!(
            ids.iter().all(|v| v.as_deref() == Some(id.as_str())),
            "{name}.trace_id"
        );
    }
    let meta: HashMap<String, Option<String>> = texts(&f.meta, "key")
        .into_iter()
        .map(Option::unwrap)
        .zip(texts(&f.meta, "value"))
        .collect();
    assert_eq!(meta["trace_id"].as_deref(), Some(id.as_str()));
    assert_eq!(meta["events"], t.meta("events"));

    // Calls and bytes per op, as SQL counts them.
    let by_op = |f: &Files| {
        let mut m: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        let sizes = f
            .events
            .column_by_name("size")
            .unwrap()
            .as_primitive::<UInt64Type>();
        for (op, size) in texts(&f.events, "op").into_iter().zip(sizes.iter()) {
            let e = m.entry(op.unwrap()).or_default();
            e.0 += 1;
            e.1 += size.unwrap_or(0) as i64;
        }
        m
    };
    let mut stmt =
        t.db.prepare("SELECT op, count(*), coalesce(sum(size), 0) FROM events GROUP BY op")
            .unwrap();
    let want: BTreeMap<String, (i64, i64)> = stmt
        .query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(by_op(&f), want);

    // events -> stacks (the call site) -> frames: the per-function totals
    // of the `call_sites` table.
    let by_caller = totals_by_function(&f, |_, call_site| call_site);
    let want = sql_totals(
        &t,
        "SELECT fr.function, e.op, count(*), coalesce(sum(e.size), 0)
         FROM events e JOIN call_sites c ON c.stack_id = e.stack_id
         JOIN frames fr ON fr.id = c.frame_id GROUP BY fr.function, e.op",
    );
    assert_eq!(by_caller, want);
    assert!(by_caller.contains_key(&("leak_big".into(), "malloc".into())));

    // By the innermost frame (position 0): the truth the tracee states.
    let by_leaf = totals_by_function(&f, |position, _| position == 0);
    for truth in t.truth() {
        assert_eq!(
            by_leaf.get(&(truth.function.clone(), truth.op.clone())),
            Some(&(truth.calls, truth.bytes)),
            "{truth:?}"
        );
    }
}

/// A trace of an older memptrace, without `meta.trace_id`: the export
/// derives one, the same each time, says so, and puts it in `meta`.
#[test]
fn export_parquet_of_a_trace_without_an_id_derives_one() {
    let t = trace(Variant::Dynamic, "leaks", &[], &[]);
    t.db.execute("DELETE FROM meta WHERE key = 'trace_id'", [])
        .unwrap();
    let base = t.path.parent().unwrap();
    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let dir = base.join(name);
        let r = run(
            memptrace().args(["export", path_str(&t.path), "--parquet", path_str(&dir)]),
            b"",
        );
        assert_eq!(r.code(), 0, "{}", r.stderr);
        let meta = read(&dir.join("meta.parquet"));
        let keys = texts(&meta, "key");
        let at = keys
            .iter()
            .position(|k| k.as_deref() == Some("trace_id"))
            .expect("a trace_id row in meta.parquet");
        let id = texts(&meta, "value")[at].clone().unwrap();
        assert_eq!(
            r.stderr,
            format!(
                "memptrace: {}: the trace has no trace_id (an older memptrace wrote it): \
                 exported as {id}, derived from its pid, started_at and command\n",
                t.path.display()
            )
        );
        let events = read(&dir.join("events.parquet"));
        assert!(
            texts(&events, "trace_id")
                .iter()
                .all(|v| v.as_ref() == Some(&id))
        );
        ids.push(id);
    }
    assert_eq!(ids[0], ids[1], "the same trace, the same id");
    assert_eq!(ids[0].len(), 32);
}

#[test]
fn export_parquet_refuses_bad_input() {
    let t = trace(Variant::Dynamic, "leaks", &[], &[]);
    let dir = scratch("parquet-bad");
    let file = dir.join("notes.txt");
    std::fs::write(&file, "not a directory").unwrap();
    let (sub, out) = (file.join("sub"), dir.join("out"));
    let cases = [
        // The directory is a file.
        (
            vec!["export", path_str(&t.path), "--parquet", path_str(&file)],
            format!(
                "memptrace: {}: not a directory: --parquet names the directory to write the files into\n",
                file.display()
            ),
        ),
        // It cannot be made: a file is in the way.
        (
            vec!["export", path_str(&t.path), "--parquet", path_str(&sub)],
            format!(
                "memptrace: cannot write {}/sub: Not a directory (os error 20)\n",
                file.display()
            ),
        ),
        // The database is not a trace (and no directory is made for it).
        (
            vec!["export", path_str(&file), "--parquet", path_str(&out)],
            format!(
                "memptrace: {}: not a memptrace trace (file is not a database)\n",
                file.display()
            ),
        ),
    ];
    for (args, stderr) in cases {
        let r = run(memptrace().args(&args), b"");
        assert_eq!((r.code(), r.stderr), (1, stderr), "{args:?}");
    }
    assert!(!out.exists());
}
