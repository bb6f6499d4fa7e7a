//! Parse tests: the command line as users type it, into the plain config.

use super::*;
use crate::tracer::ProbeMode;
use crate::unwind::UnwinderKind;
use clap::CommandFactory;

mod outputs;

fn parse(args: &[&str]) -> Result<Config, clap::Error> {
    Cli::try_parse_from(args).and_then(|cli| cli.into_config(None))
}

#[test]
fn clap_definition_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn launch_defaults() {
    let Ok(Config::Launch { trace, program }) = parse(&["memptrace", "--", "ls", "-l"]) else {
        panic!("not a launch");
    };
    assert_eq!(program, vec![OsString::from("ls"), OsString::from("-l")]);
    assert_eq!(trace.output, PathBuf::from("trace.db"));
    assert!(!trace.force);
    assert_eq!(trace.max_depth, 128);
    assert_eq!(trace.unwinder, UnwinderKind::Framehop);
    assert!(trace.stacks);
    assert_eq!(trace.stack_every, 1);
    assert_eq!(trace.rss_interval_ms, 100);
}

#[test]
fn aggregate_and_its_resolution() {
    let mode = |args: &[&str]| match parse(args) {
        Ok(Config::Launch { trace, .. } | Config::Attach { trace, .. }) => {
            (trace.aggregate, trace.resolution_ns)
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(mode(&["memptrace", "--", "ls"]), (false, 100_000_000));
    assert_eq!(
        mode(&["memptrace", "--aggregate", "--", "ls"]),
        (true, 100_000_000)
    );
    assert_eq!(
        mode(&[
            "memptrace",
            "attach",
            "1",
            "--aggregate",
            "--resolution",
            "10"
        ]),
        (true, 10_000_000)
    );
    assert_eq!(
        mode(&["memptrace", "--resolution", "250", "attach", "1"]),
        (false, 250_000_000)
    );
    for bad in ["0", "-1", "x"] {
        assert!(
            parse(&["memptrace", "--resolution", bad, "--", "ls"]).is_err(),
            "{bad}"
        );
    }
    assert!(parse(&["memptrace", "--aggregate", "report", "t.db"]).is_err());
}

#[test]
fn max_size() {
    let size = |args: &[&str]| match parse(args) {
        Ok(Config::Launch { trace, .. } | Config::Attach { trace, .. }) => trace.max_size,
        other => panic!("{other:?}"),
    };
    assert_eq!(size(&["memptrace", "--", "ls"]), None);
    assert_eq!(
        size(&["memptrace", "--max-size", "1000", "--", "ls"]),
        Some(1000)
    );
    assert_eq!(
        size(&["memptrace", "--max-size", "64K", "--", "ls"]),
        Some(64 << 10)
    );
    assert_eq!(
        size(&["memptrace", "--max-size", "2M", "--", "ls"]),
        Some(2 << 20)
    );
    assert_eq!(
        size(&["memptrace", "attach", "1", "--max-size", "3g"]),
        Some(3 << 30)
    );
    for bad in ["0", "-1", "1T", "M", "99999999999999G"] {
        assert!(
            parse(&["memptrace", "--max-size", bad, "--", "ls"]).is_err(),
            "{bad}"
        );
    }
    assert!(parse(&["memptrace", "--max-size", "1M", "report", "t.db"]).is_err());
}

#[test]
fn rss_interval() {
    let Ok(Config::Launch { trace, .. }) = parse(&["memptrace", "--rss-interval", "0", "--", "ls"])
    else {
        panic!("not a launch");
    };
    assert_eq!(trace.rss_interval_ms, 0);
    let Ok(Config::Attach { trace, .. }) =
        parse(&["memptrace", "--rss-interval", "250", "attach", "1"])
    else {
        panic!("not an attach");
    };
    assert_eq!(trace.rss_interval_ms, 250);
    assert!(parse(&["memptrace", "--rss-interval", "-1", "--", "ls"]).is_err());
    assert!(
        parse(&[
            "memptrace",
            "--rss-interval",
            "1",
            "attach",
            "1",
            "--rss-interval",
            "2"
        ])
        .is_err()
    );
    assert!(parse(&["memptrace", "--rss-interval", "1", "report", "t.db"]).is_err());
}

#[test]
fn stack_every() {
    let Ok(Config::Launch { trace, .. }) = parse(&["memptrace", "--stack-every", "10", "--", "ls"])
    else {
        panic!("not a launch");
    };
    assert_eq!(trace.stack_every, 10);
    assert!(trace.stacks);
    let Ok(Config::Attach { trace, .. }) =
        parse(&["memptrace", "attach", "1", "--stack-every", "3"])
    else {
        panic!("not an attach");
    };
    assert_eq!(trace.stack_every, 3);
    for bad in ["0", "-1", "ten", ""] {
        assert!(
            parse(&["memptrace", "--stack-every", bad, "--", "ls"]).is_err(),
            "--stack-every {bad:?}"
        );
    }
    assert!(
        parse(&[
            "memptrace",
            "--stack-every",
            "10",
            "--no-stacks",
            "--",
            "ls"
        ])
        .is_err(),
        "no stacks and some stacks at once"
    );
}

#[test]
fn launch_options() {
    let Ok(Config::Launch { trace, program }) = parse(&[
        "memptrace",
        "-o",
        "x.db",
        "--force",
        "--max-depth",
        "16",
        "--unwinder",
        "libunwind",
        "--no-stacks",
        "--",
        "./prog",
        "--its-own-flag",
    ]) else {
        panic!("not a launch");
    };
    assert_eq!(trace.output, PathBuf::from("x.db"));
    assert!(trace.force);
    assert_eq!(trace.max_depth, 16);
    assert_eq!(trace.unwinder, UnwinderKind::Libunwind);
    assert!(!trace.stacks);
    assert_eq!(program[1], OsString::from("--its-own-flag"));
}

#[test]
fn attach_options() {
    let config = parse(&[
        "memptrace",
        "attach",
        "1234",
        "--duration",
        "2.5",
        "-o",
        "a.db",
    ]);
    let Ok(Config::Attach {
        trace,
        pid,
        duration,
    }) = config
    else {
        panic!("not an attach: {config:?}");
    };
    assert_eq!(pid, 1234);
    assert_eq!(duration, Some(Duration::from_millis(2500)));
    assert_eq!(trace.output, PathBuf::from("a.db"));
    // A program called `attach` is still a program after `--`.
    assert!(matches!(
        parse(&["memptrace", "--", "attach", "1"]),
        Ok(Config::Launch { .. })
    ));
    assert!(
        parse(&["memptrace", "attach"]).is_err(),
        "a pid is required"
    );
    assert!(parse(&["memptrace", "attach", "1", "--duration", "-1"]).is_err());
    assert!(parse(&["memptrace", "attach", "1", "--", "ls"]).is_err());
}

/// Options as users type them: before `attach` or after it.
#[test]
fn trace_options_before_attach() {
    for args in [
        &["memptrace", "-o", "x.db", "attach", "42"][..],
        &["memptrace", "attach", "42", "-o", "x.db"],
        &["memptrace", "--output", "x.db", "attach", "42"],
    ] {
        let Ok(Config::Attach { trace, pid, .. }) = parse(args) else {
            panic!("{args:?}: not an attach");
        };
        assert_eq!((trace.output, pid), (PathBuf::from("x.db"), 42), "{args:?}");
    }
    let Ok(Config::Attach {
        trace, duration, ..
    }) = parse(&[
        "memptrace",
        "-o",
        "x.db",
        "--duration",
        "3",
        "--no-stacks",
        "attach",
        "42",
        "--force",
        "-f",
    ])
    else {
        panic!("not an attach");
    };
    assert_eq!(duration, Some(Duration::from_secs(3)));
    assert!(trace.force && trace.follow_forks && !trace.stacks);
    assert_eq!(trace.output, PathBuf::from("x.db"));
    // Given on both sides, or contradicting across them: refused.
    for args in [
        &["memptrace", "-o", "a.db", "attach", "1", "-o", "b.db"][..],
        &[
            "memptrace",
            "--duration",
            "1",
            "attach",
            "1",
            "--duration",
            "2",
        ],
        &[
            "memptrace",
            "--no-stacks",
            "attach",
            "1",
            "--stack-every",
            "3",
        ],
        &[
            "memptrace",
            "--max-depth",
            "8",
            "attach",
            "1",
            "--max-depth",
            "8",
        ],
    ] {
        let err = parse(args).expect_err(&format!("{args:?}"));
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::ArgumentConflict,
            "{args:?}"
        );
    }
    // Trace options do not belong to the report commands, nor --duration
    // to a launch.
    for args in [
        &["memptrace", "-o", "x.svg", "flamegraph"][..],
        &["memptrace", "--force", "report"],
        &["memptrace", "--duration", "1", "report"],
        &["memptrace", "--duration", "5", "--", "ls"],
    ] {
        assert!(parse(args).is_err(), "{args:?}");
    }
    // Launch keeps its options before `--`.
    let Ok(Config::Launch { trace, program }) =
        parse(&["memptrace", "-o", "x.db", "--", "attach", "42"])
    else {
        panic!("not a launch");
    };
    assert_eq!(trace.output, PathBuf::from("x.db"));
    assert_eq!(program, [OsString::from("attach"), OsString::from("42")]);
}

/// --probes on either side of `attach`, MEMPTRACE_PROBES when it is not
/// given (read once, not on both sides).
#[test]
fn probes_from_the_command_line_or_the_environment() {
    let probes = |args: &[&str], env: Option<&str>| -> Result<ProbeMode, clap::Error> {
        match Cli::try_parse_from(args)?.into_config(env)? {
            Config::Launch { trace, .. } | Config::Attach { trace, .. } => Ok(trace.probes),
            other => panic!("not a trace: {other:?}"),
        }
    };
    let launch = ["memptrace", "--", "ls"];
    assert_eq!(probes(&launch, None).unwrap(), ProbeMode::Jump);
    assert_eq!(probes(&launch, Some("int3")).unwrap(), ProbeMode::Int3);
    let explicit = ["memptrace", "--probes", "jump", "--", "ls"];
    assert_eq!(probes(&explicit, Some("int3")).unwrap(), ProbeMode::Jump);
    for args in [
        &["memptrace", "--probes", "int3", "attach", "1"][..],
        &["memptrace", "attach", "1", "--probes", "int3"],
    ] {
        assert_eq!(
            probes(args, Some("jump")).unwrap(),
            ProbeMode::Int3,
            "{args:?}"
        );
        assert_eq!(probes(args, None).unwrap(), ProbeMode::Int3, "{args:?}");
    }
    assert_eq!(
        probes(&["memptrace", "attach", "1"], Some("int3")).unwrap(),
        ProbeMode::Int3
    );
    assert!(
        probes(
            &[
                "memptrace",
                "--probes",
                "int3",
                "attach",
                "1",
                "--probes",
                "jump"
            ],
            None
        )
        .is_err()
    );
    assert!(probes(&launch, Some("magic")).is_err());
}

#[test]
fn times_with_units() {
    assert_eq!(parse_time("2"), Ok(2_000_000_000));
    assert_eq!(parse_time("0.25s"), Ok(250_000_000));
    assert_eq!(parse_time("250ms"), Ok(250_000_000));
    assert_eq!(parse_time("300us"), Ok(300_000));
    assert_eq!(parse_time("300µs"), Ok(300_000));
    assert_eq!(parse_time("42ns"), Ok(42));
    assert!(parse_time("soon").is_err());
    assert!(parse_time("-1s").is_err());
    assert!(parse_time("infs").is_err());
}

#[test]
fn rejects_bad_input() {
    assert!(parse(&["memptrace"]).is_err(), "a program is required");
    assert!(parse(&["memptrace", "--max-depth", "0", "--", "ls"]).is_err());
    assert!(parse(&["memptrace", "--unwinder", "magic", "--", "ls"]).is_err());
}

#[test]
fn heapmap_of_a_process_or_a_trace() {
    use crate::report::heapmap::{HeapSource, HeapmapOptions};
    let Ok(Config::Heapmap { source, options }) =
        parse(&["memptrace", "heapmap", "1234", "-o", "map.png"])
    else {
        panic!("not a heapmap");
    };
    assert_eq!(source, HeapSource::Pid(1234));
    assert_eq!(
        options,
        HeapmapOptions {
            format: Format::Text,
            output: Some(PathBuf::from("map.png")),
        }
    );
    let Ok(Config::Heapmap { source, options }) = parse(&[
        "memptrace",
        "heapmap",
        "t.db",
        "--snapshot",
        "2",
        "--format",
        "json",
    ]) else {
        panic!("not a heapmap");
    };
    assert_eq!(
        source,
        HeapSource::Trace {
            path: PathBuf::from("t.db"),
            snapshot: Some(2)
        }
    );
    assert_eq!(options.format, Format::Json);
    assert!(
        parse(&["memptrace", "heapmap", "12", "--snapshot", "1"]).is_err(),
        "--snapshot reads a trace"
    );
    // As every command that reads a trace: trace.db by default.
    let Ok(Config::Heapmap { source, .. }) = parse(&["memptrace", "heapmap"]) else {
        panic!("not a heapmap");
    };
    assert_eq!(
        source,
        HeapSource::Trace {
            path: PathBuf::from("trace.db"),
            snapshot: None
        }
    );
}
