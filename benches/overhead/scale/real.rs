//! Real programs of issue 19 item 6, side by side in the same minutes:
//! python3, perl, node and java making many allocator calls, untraced,
//! under heaptrack and under memptrace; and `make -j2` of a small C project
//! (every tracee-tests/*.c compiled), untraced and under `memptrace -f`.
//! Medians of the rounds, rounds interleaved.

use std::path::{Path, PathBuf};

use rusqlite::Connection;

use super::measure::timed;
use crate::{median, runs};

#[derive(Clone, Debug, Default)]
pub struct RealRow {
    pub label: String,
    pub untraced_s: f64,
    pub heaptrack_s: Option<f64>,
    pub memptrace_s: f64,
    /// memptrace's own peak resident set (meta `peak_rss_kib`), largest of the rounds.
    pub memptrace_rss_kib: u64,
    pub events: u64,
    pub processes: u64,
}

struct Program {
    label: &'static str,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(&'static str, &'static str)>,
    /// `make`: memptrace follows the forks (`-f`), heaptrack does not run.
    make: bool,
}

const PYTHON: &str = include_str!("../programs/objects.py");
const PERL: &str = "my %h; for my $i (1..400000) { $h{\"k$i\"} = \"v\" x ($i % 97); } \
     my @k = sort keys %h; my $s = join(',', @k); print length($s), \"\\n\";";
const NODE: &str = "const a = []; for (let i = 0; i < 300000; i++) a.push({ id: i, s: 'x' + i }); \
     const m = new Map(a.map((o) => [o.s, o])); console.log(m.size, JSON.stringify(a).length);";
const JAVA: &str = "class Alloc { public static void main(String[] a) { \
     java.util.HashMap<String, String> m = new java.util.HashMap<>(); \
     for (int i = 0; i < 300000; i++) m.put(\"k\" + i, \"v\" + i); \
     System.out.println(m.size()); } }";

/// A Makefile compiling every tracee-tests/*.c of the repository to an object.
fn make_project(dir: &Path) -> Result<(), String> {
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("tracee-tests");
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut objects = Vec::new();
    for entry in std::fs::read_dir(&sources).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".c") || name.ends_with(".h") {
            std::fs::copy(&path, dir.join(&name)).map_err(|e| e.to_string())?;
        }
        if let Some(stem) = name.strip_suffix(".c") {
            objects.push(format!("{stem}.o"));
        }
    }
    objects.sort();
    let makefile = format!(
        "all: {}\n%.o: %.c\n\tgcc -O1 -g -pthread -c -I. $< -o $@\nclean:\n\trm -f *.o\n",
        objects.join(" ")
    );
    std::fs::write(dir.join("Makefile"), makefile).map_err(|e| e.to_string())
}

fn programs(dir: &Path) -> Result<Vec<Program>, String> {
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| e.to_string())?;
        Ok::<_, String>(path.to_string_lossy().into_owned())
    };
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut list = Vec::new();
    if let Some(python) = runs::which("python3") {
        list.push(Program {
            label: "python3 (PYTHONMALLOC=malloc), 300 000 records",
            program: python,
            args: vec![
                "-S".into(),
                "-s".into(),
                "-B".into(),
                write("objects.py", PYTHON)?,
                "300000".into(),
            ],
            env: vec![("PYTHONMALLOC", "malloc"), ("PYTHONHASHSEED", "0")],
            make: false,
        });
    }
    if let Some(perl) = runs::which("perl") {
        list.push(Program {
            label: "perl, a hash of 400 000 keys",
            program: perl,
            args: vec![write("hash.pl", PERL)?],
            env: vec![("PERL_HASH_SEED", "0")],
            make: false,
        });
    }
    if let Some(node) = runs::which("node") {
        list.push(Program {
            label: "node, 300 000 objects",
            program: node,
            args: vec![write("objects.js", NODE)?],
            env: vec![],
            make: false,
        });
    }
    if let Some(java) = runs::which("java") {
        list.push(Program {
            label: "java, a HashMap of 300 000 (source launcher)",
            program: java,
            args: vec!["-XX:+UseSerialGC".into(), write("Alloc.java", JAVA)?],
            env: vec![],
            make: false,
        });
    }
    if let Some(make) = runs::which("make") {
        let project = dir.join("project");
        make_project(&project)?;
        list.push(Program {
            label: "make -j2 of tracee-tests/*.c (gcc -c each)",
            program: make,
            args: vec![
                "-C".into(),
                project.to_string_lossy().into_owned(),
                "-j2".into(),
                "-s".into(),
            ],
            env: vec![],
            make: true,
        });
    }
    Ok(list)
}

fn clean(program: &Program) -> Result<(), String> {
    if program.make {
        let status = std::process::Command::new(&program.program)
            .args([&program.args[0], &program.args[1], "clean", "-s"])
            .status()
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err("make clean failed".into());
        }
    }
    Ok(())
}

pub fn run(rounds: usize, external: bool, dir: &Path) -> Result<Vec<RealRow>, String> {
    let list = programs(dir)?;
    let mut walls: Vec<[Vec<f64>; 3]> = list.iter().map(|_| Default::default()).collect();
    let mut rows: Vec<RealRow> = list
        .iter()
        .map(|p| RealRow {
            label: p.label.into(),
            ..RealRow::default()
        })
        .collect();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_memptrace"));
    for round in 0..rounds {
        for (i, program) in list.iter().enumerate() {
            crate::progress(&format!(
                "real programs, round {}: {}",
                round + 1,
                program.label
            ));
            let args: Vec<&str> = program.args.iter().map(String::as_str).collect();
            let scratch = dir.join(format!("p{i}"));
            clean(program)?;
            let plain = timed(&program.program, &args, &program.env, &scratch)?;
            walls[i][0].push(plain.wall_s);
            if external && !program.make && runs::which("heaptrack").is_some() {
                let out = scratch.join("h").to_string_lossy().into_owned();
                let mut with = vec!["-o", out.as_str(), program.program.to_str().unwrap_or("")];
                with.extend(&args);
                let run = timed(
                    Path::new("/usr/bin/heaptrack"),
                    &with,
                    &program.env,
                    &scratch,
                )?;
                walls[i][1].push(run.wall_s);
                for entry in std::fs::read_dir(&scratch)
                    .map_err(|e| e.to_string())?
                    .flatten()
                {
                    if entry.file_name().to_string_lossy().starts_with("h.") {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
            clean(program)?;
            let db = scratch.join("trace.db").to_string_lossy().into_owned();
            let mut with = vec!["-o", db.as_str(), "--force"];
            if program.make {
                with.push("-f");
            }
            with.push("--");
            with.push(program.program.to_str().unwrap_or(""));
            with.extend(&args);
            let run = timed(&bin, &with, &program.env, &scratch)?;
            if run.stdout != plain.stdout {
                return Err(format!(
                    "{} under memptrace: not the output of the untraced run",
                    program.label
                ));
            }
            walls[i][2].push(run.wall_s);
            let conn = Connection::open(&db).map_err(|e| e.to_string())?;
            let number = |sql: &str| {
                conn.query_row(sql, [], |r| r.get::<_, Option<String>>(0))
                    .ok()
                    .flatten()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            let row = &mut rows[i];
            row.memptrace_rss_kib = row
                .memptrace_rss_kib
                .max(number("SELECT value FROM meta WHERE key = 'peak_rss_kib'"));
            row.events = number("SELECT value FROM meta WHERE key = 'events'");
            row.processes = number("SELECT CAST(count(DISTINCT pid) AS TEXT) FROM threads");
            if row.events == 0 {
                return Err(format!("{}: no event recorded", program.label));
            }
        }
    }
    for (row, walls) in rows.iter_mut().zip(walls) {
        let [plain, heaptrack, traced] = walls;
        row.untraced_s = median(plain);
        row.heaptrack_s = (!heaptrack.is_empty()).then(|| median(heaptrack));
        row.memptrace_s = median(traced);
    }
    Ok(rows)
}
