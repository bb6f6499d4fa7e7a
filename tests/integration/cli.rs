//! The command line as users type it, the trace file it writes (private:
//! it holds command lines and addresses of a process), and the warnings a
//! trace keeps; `--help`, the completions and man pages made from it, and
//! `scripts/test`.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use crate::support::{
    Background, Variant, count_events, memptrace, open_trace, run, scratch, trace_program, tracee,
    wait_until,
};

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{path:?}: {e}"))
        .permissions()
        .mode()
        & 0o777
}

fn side(db: &Path, suffix: &str) -> PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(suffix);
    PathBuf::from(path)
}

/// The database and its -wal and -shm files are 0600 from the moment they
/// exist, under the usual umask 022 (which would make them 0644), and also
/// when an existing file is replaced with --force.
#[test]
fn trace_files_are_private() {
    let dir = scratch("private");
    let db = dir.join("trace.db");
    for force in [false, true] {
        if force {
            // An existing, world-readable file is replaced by a private one.
            std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let mut cmd = memptrace();
        cmd.arg("-o").arg(&db);
        if force {
            cmd.arg("--force");
        }
        cmd.arg("--")
            .arg(tracee(Variant::Dynamic, "ticker"))
            .arg("stdin");
        // SAFETY: umask(2) in the child before exec; async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0o022);
                Ok(())
            });
        }
        let mut tracer = Background::interactive(&mut cmd);
        tracer.send("\n");
        assert_eq!(tracer.wait_for("step"), "1");
        // The trace is being written: its events reach readers, and the
        // write-ahead log and shared-memory index exist.
        wait_until("the first event is committed", || {
            count_events(&db).is_some_and(|n| n > 0)
        });
        for file in [db.clone(), side(&db, "-wal"), side(&db, "-shm")] {
            assert_eq!(
                mode(&file),
                0o600,
                "{file:?} while tracing (force: {force})"
            );
        }
        tracer.close_stdin();
        let run = tracer.finish();
        assert_eq!(run.code(), 0, "{}", run.stderr);
        assert_eq!(mode(&db), 0o600, "the finished trace (force: {force})");
        open_trace(&db, run).assert_truth();
    }
}

/// `memptrace -o X.db attach PID`: the options of a trace before `attach`
/// work as well as after it.
#[test]
fn options_before_attach() {
    let mut victim =
        Background::start(std::process::Command::new(tracee(Variant::Dynamic, "victim")).arg("2"));
    let pid = victim.wait_for("ready");
    let dir = scratch("before-attach");
    let db = dir.join("x.db");
    let out = run(
        memptrace().arg("-o").arg(&db).args([
            "--duration",
            "0.2",
            "--max-depth",
            "7",
            "attach",
            &pid,
        ]),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert_eq!(crate::support::without_death_warning(&out.stderr), "");
    let t = open_trace(&db, out);
    assert_eq!(t.meta("mode").as_deref(), Some("attach"));
    assert_eq!(t.meta("pid"), Some(pid.clone()));
    assert_eq!(t.meta("max_depth").as_deref(), Some("7"));
    assert!(t.meta("end_reason").unwrap().contains("--duration"));
    assert!(t.int("SELECT count(*) FROM events") > 0);
    victim.signal(libc::SIGTERM);
    let end = victim.finish();
    assert_eq!(end.code(), 0, "{}{}", end.stdout, end.stderr);
}

/// Every warning memptrace prints is also a `meta` row (`warning.1`, ...)
/// and a line of `memptrace report`. Here: the program execs one with
/// nothing memptrace can hook (no C library at all), which runs until it is
/// killed.
#[test]
fn warnings_are_stored_and_reported() {
    let dir = scratch("warnings");
    let db = dir.join("trace.db");
    let program = tracee(Variant::Static, "nolibc");
    let mut traced = crate::support::Background::start(
        memptrace()
            .arg("-o")
            .arg(&db)
            .args(["--", "sh", "-c"])
            .arg(format!("exec {}", program.display())),
    );
    let pid: i32 = traced.wait_for("ready").parse().unwrap();
    crate::support::signal(pid, libc::SIGTERM);
    let out = traced.finish();
    assert_eq!(out.code(), 128 + libc::SIGTERM, "{}", out.stderr);
    let warning = format!(
        "process {pid} ({}): no allocator function (malloc, free, ...) found to hook in any of \
         its images; its calls are not recorded",
        program.display()
    );
    assert_eq!(out.stderr, format!("memptrace: warning: {warning}\n"));
    let t = open_trace(&db, out);
    assert_eq!(t.meta("warning.1").as_deref(), Some(warning.as_str()));
    assert_eq!(
        t.int("SELECT count(*) FROM meta WHERE key LIKE 'warning%'"),
        1
    );

    let text = run(memptrace().arg("report").arg(&db), b"");
    assert_eq!(text.code(), 0, "{}", text.stderr);
    assert!(
        text.stdout
            .lines()
            .any(|l| l == format!("  warning    {warning}")),
        "{}",
        text.stdout
    );
    let json = run(
        memptrace()
            .arg("report")
            .arg(&db)
            .args(["--format", "json"]),
        b"",
    );
    let json: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(json["trace"]["warnings"], serde_json::json!([warning]));

    // A trace without warnings has no such row and says nothing.
    let clean = trace_program(&tracee(Variant::Dynamic, "leaks"), &[], &[]);
    clean.assert_sound();
    assert_eq!(
        clean.int("SELECT count(*) FROM meta WHERE key LIKE 'warning%'"),
        0
    );
}

/// `memptrace --help`, word for word (tests/integration/golden/help.txt;
/// after a deliberate change: MEMPTRACE_BLESS=1 cargo test --test
/// integration help_). It says how calls are caught: by jump probes unless
/// `--probes int3`.
#[test]
fn help_says_how_calls_are_caught() {
    let out = run(memptrace().arg("--help"), b"");
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let golden =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/golden/help.txt");
    if std::env::var_os("MEMPTRACE_BLESS").is_some() {
        std::fs::write(&golden, &out.stdout).unwrap();
    }
    let expected = std::fs::read_to_string(&golden).unwrap_or_else(|e| panic!("{golden:?}: {e}"));
    assert_eq!(out.stdout, expected);
    assert!(!out.stdout.contains("breakpoints on"));
}

/// The bash completion script, loaded into a real bash, completes the
/// commands and their options; zsh's and fish's name them too. The man
/// page renders with `man -l`, and so does a command's own page.
#[test]
fn completions_and_man_pages() {
    let dir = scratch("completions");
    let script = dir.join("memptrace.bash");
    let bash = run(memptrace().args(["completions", "bash"]), b"");
    assert_eq!(bash.code(), 0, "{}", bash.stderr);
    std::fs::write(&script, &bash.stdout).unwrap();
    let complete = |words: &str| -> String {
        let out = run(
            std::process::Command::new("bash")
                .arg("--norc")
                .arg("-c")
                .arg(format!(
                    "source {}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); \
                     COMP_LINE=\"${{COMP_WORDS[*]}}\"; COMP_POINT=${{#COMP_LINE}}; \
                     _memptrace memptrace \"${{COMP_WORDS[-1]}}\" \"${{COMP_WORDS[-2]}}\"; echo \"${{COMPREPLY[*]}}\"",
                    script.display()
                )),
            b"",
        );
        assert_eq!(out.code(), 0, "{}", out.stderr);
        out.stdout.trim_end().to_string()
    };
    assert_eq!(complete("memptrace rep"), "report");
    assert_eq!(complete("memptrace fl"), "flamegraph");
    assert_eq!(complete("memptrace report --fo"), "--format");
    assert_eq!(complete("memptrace --probes ''"), "jump int3");
    for shell in ["zsh", "fish"] {
        let out = run(memptrace().args(["completions", shell]), b"");
        assert_eq!(out.code(), 0, "{}", out.stderr);
        for command in [
            "attach",
            "report",
            "flamegraph",
            "heapmap",
            "completions",
            "man",
        ] {
            assert!(out.stdout.contains(command), "{shell}: no {command}");
        }
    }

    // man marks bold and italics by overstriking (`x\bx`) on a pipe.
    let overstrike = regex::Regex::new(".\x08").unwrap();
    for (args, name, option) in [
        (&["man"][..], "memptrace", "-o, --output <PATH>"),
        (&["man", "report"], "memptrace-report", "--frames <N>"),
    ] {
        let out = run(memptrace().args(args), b"");
        assert_eq!(out.code(), 0, "{}", out.stderr);
        let page = dir.join(format!("{name}.1"));
        std::fs::write(&page, &out.stdout).unwrap();
        let shown = run(
            std::process::Command::new("man")
                .env("MANWIDTH", "100")
                .env_remove("MAN_KEEP_FORMATTING")
                .env("MANPAGER", "cat")
                .env("PAGER", "cat")
                .arg("-l")
                .arg(&page),
            b"",
        );
        assert_eq!(shown.code(), 0, "{}", shown.stderr);
        let text = overstrike.replace_all(&shown.stdout, "");
        // Justified: words apart by one space or more.
        let words = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            words.starts_with(&format!(
                "{name}(1) General Commands Manual {name}(1) NAME {name} - "
            )),
            "{text}"
        );
        assert!(words.contains(option), "{name}: no {option:?} in\n{text}");
    }
}

/// The reports read `trace.db` by default (heapmap too); what a trace
/// lacks is said as such (not "nothing to draw"); a flame graph's title
/// says what it weighs; a window past the end of the trace is cut there,
/// with a warning, and one that starts after it is refused.
#[test]
fn reports_say_what_they_read_and_what_is_missing() {
    let t = trace_program(&tracee(Variant::Dynamic, "leaks"), &[], &[]);
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    let dir = t.path.parent().unwrap();
    let here = |args: &[&str]| run(memptrace().current_dir(dir).args(args), b"");

    let map = here(&["heapmap"]);
    assert_eq!(map.code(), 0, "{}", map.stderr);
    assert!(
        map.stdout.starts_with("glibc heap of process "),
        "{}",
        map.stdout
    );
    let missing = here(&["heapmap", "--snapshot", "7"]);
    assert_eq!(
        (
            missing.code(),
            missing.stderr.as_str(),
            missing.stdout.as_str()
        ),
        (
            1,
            "memptrace: trace.db: no heap snapshot 7; its snapshots: 1 at exit\n",
            ""
        )
    );

    let export = here(&["export"]);
    assert_eq!(export.code(), 2);
    assert_eq!(
        export.stderr,
        "error: nothing to export: give --pprof PATH, --collapsed PATH, --parquet DIR, or several\n\n  \
         tip: memptrace export trace.db --pprof heap.pb.gz\n\n\
         Usage: memptrace export [OPTIONS] [TRACE]\n"
    );

    for (metric, title) in [
        ("calls", "allocator calls"),
        ("leaked", "leaked bytes"),
        ("allocated", "allocated bytes"),
        ("peak", "bytes in use at the peak"),
    ] {
        let svg = dir.join(format!("{metric}.svg"));
        let out = here(&[
            "flamegraph",
            "--metric",
            metric,
            "-o",
            svg.to_str().unwrap(),
        ]);
        assert_eq!(out.code(), 0, "{}", out.stderr);
        let text = std::fs::read_to_string(&svg).unwrap();
        // inferno's SVG starts with a DOCTYPE.
        let options = roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        };
        let doc = roxmltree::Document::parse_with_options(&text, options).unwrap();
        let shown = doc
            .descendants()
            .find(|n| n.attribute("id") == Some("title"))
            .and_then(|n| n.text())
            .unwrap();
        assert_eq!(
            shown,
            format!(
                "memptrace: {title} of {}",
                tracee(Variant::Dynamic, "leaks").display()
            )
        );
    }

    let end_ns: i64 = t.meta("duration_ns").unwrap().parse().unwrap();
    let end = format!("{:.3} s", end_ns as f64 / 1e9);
    let past = here(&["window", "--from", "0", "--to", "1000s", "--format", "json"]);
    assert_eq!(past.code(), 0, "{}", past.stderr);
    assert_eq!(
        past.stderr,
        format!(
            "memptrace: warning: the trace ends at {end}, before --to 1000.000 s: the window ends there\n"
        )
    );
    let json: serde_json::Value = serde_json::from_str(&past.stdout).unwrap();
    assert_eq!(json["to_ns"], end_ns);
    let after = here(&["window", "--from", "900s", "--to", "1000s"]);
    assert_eq!(
        (after.code(), after.stderr.as_str(), after.stdout.as_str()),
        (
            1,
            format!(
                "memptrace: trace.db: the trace ends at {end}, before --from 900.000 s: the window holds nothing\n"
            )
            .as_str(),
            ""
        )
    );
}

/// `scripts/test` runs both probe modes even when the first fails, reports
/// both, and fails at the end; here with a `cargo` that records its calls
/// and fails the one asked to.
#[test]
fn scripts_test_runs_both_modes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for fail in ["--all-targets", "MEMPTRACE_PROBES=int3", "nothing"] {
        let bin = scratch("fake-cargo");
        let log = bin.join("calls");
        let cargo = bin.join("cargo");
        std::fs::write(
            &cargo,
            format!(
                "#!/bin/sh\necho \"${{MEMPTRACE_PROBES:-jump}} $*\" >> {log}\n\
                 case \"MEMPTRACE_PROBES=${{MEMPTRACE_PROBES:-}} $*\" in *{fail}*) exit 3;; esac\n",
                log = log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
        let out = run(
            std::process::Command::new(root.join("scripts/test"))
                .env("PATH", path)
                .env_remove("MEMPTRACE_PROBES"),
            b"",
        );
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "jump test --all-targets --no-fail-fast\n\
             int3 test --test integration --no-fail-fast\n",
            "failing: {fail}"
        );
        let (jump, int3) = match fail {
            "--all-targets" => ("FAILED", "passed"),
            "MEMPTRACE_PROBES=int3" => ("passed", "FAILED"),
            _ => ("passed", "passed"),
        };
        let status = |word: &str| {
            if word == "FAILED" {
                " (exit status 3)"
            } else {
                ""
            }
        };
        let summary = format!(
            "\nscripts/test:\n  {jump}  jump probes (unit and integration tests){}\n  \
             {int3}  int3 probes (integration tests){}\n",
            status(jump),
            status(int3)
        );
        assert!(
            out.stderr.ends_with(&summary),
            "failing {fail}: {}",
            out.stderr
        );
        assert_eq!(out.code(), i32::from(fail != "nothing"), "failing {fail}");
    }
}
