//! The options of the commands that read a trace: report, the pictures,
//! export and window.

use super::parse;
use crate::cli::*;

#[test]
fn report_options() {
    let Ok(Config::Report { trace, options }) = parse(&["memptrace", "report"]) else {
        panic!("not a report");
    };
    assert_eq!(trace, PathBuf::from("trace.db"));
    assert_eq!(
        options,
        ReportOptions {
            format: Format::Text,
            color: Color::Auto,
            top: 5,
            frames: 8,
            wrappers: Vec::new(),
        }
    );
    let Ok(Config::Report { trace, options }) = parse(&[
        "memptrace",
        "report",
        "x.db",
        "--format",
        "json",
        "--top",
        "3",
        "--frames",
        "2",
        "--color",
        "never",
    ]) else {
        panic!("not a report");
    };
    assert_eq!(trace, PathBuf::from("x.db"));
    assert_eq!(
        options,
        ReportOptions {
            format: Format::Json,
            color: Color::Never,
            top: 3,
            frames: 2,
            wrappers: Vec::new(),
        }
    );
    assert!(parse(&["memptrace", "report", "--top", "0"]).is_err());
    assert!(parse(&["memptrace", "report", "--format", "xml"]).is_err());
    // --wrapper, before the command or after it, repeatable.
    let Ok(Config::Report { options, .. }) = parse(&[
        "memptrace",
        "--wrapper",
        "^xmalloc$",
        "report",
        "--wrapper",
        "g_malloc",
    ]) else {
        panic!("not a report");
    };
    assert_eq!(options.wrappers, ["^xmalloc$", "g_malloc"]);
    assert!(parse(&["memptrace", "report", "--wrapper", "("]).is_err());
    assert!(parse(&["memptrace", "--wrapper", "x", "plot"]).is_err());
    let Ok(Config::Attach { trace, .. }) = parse(&[
        "memptrace",
        "--wrapper",
        "a",
        "attach",
        "1",
        "--wrapper",
        "b",
    ]) else {
        panic!("not an attach");
    };
    assert_eq!(trace.wrappers, ["a", "b"]);
    // A program called `report` is still a program after `--`.
    assert!(matches!(
        parse(&["memptrace", "--", "report"]),
        Ok(Config::Launch { .. })
    ));
}

#[test]
fn picture_options() {
    let Ok(Config::Flamegraph { trace, options }) = parse(&[
        "memptrace",
        "flamegraph",
        "t.db",
        "-o",
        "f.svg",
        "--metric",
        "leaked",
    ]) else {
        panic!("not a flamegraph");
    };
    assert_eq!(trace, PathBuf::from("t.db"));
    assert_eq!(options.output, PathBuf::from("f.svg"));
    assert_eq!(options.metric, Metric::Leaked);
    let Ok(Config::Flamegraph { options, .. }) = parse(&["memptrace", "flamegraph"]) else {
        panic!("not a flamegraph");
    };
    assert_eq!(
        (options.output, options.metric),
        (PathBuf::from("flamegraph.svg"), Metric::Allocated)
    );
    assert!(parse(&["memptrace", "flamegraph", "--metric", "speed"]).is_err());

    let Ok(Config::Plot { options, .. }) =
        parse(&["memptrace", "plot", "-o", "h.png", "--size", "800x600"])
    else {
        panic!("not a plot");
    };
    assert_eq!(
        options,
        PlotOptions {
            output: PathBuf::from("h.png"),
            width: 800,
            height: 600
        }
    );
    assert!(parse(&["memptrace", "plot", "--size", "800"]).is_err());
    assert!(parse(&["memptrace", "plot", "--size", "10x10"]).is_err());
}

#[test]
fn export_options() {
    let Ok(Config::Export { options, .. }) = parse(&[
        "memptrace",
        "export",
        "--pprof",
        "p.pb.gz",
        "--collapsed",
        "c.txt",
    ]) else {
        panic!("not an export");
    };
    assert_eq!(options.pprof, Some(PathBuf::from("p.pb.gz")));
    assert_eq!(options.collapsed, Some(PathBuf::from("c.txt")));
    assert_eq!(options.metric, Metric::Allocated);
    assert_eq!(options.parquet, None);
    let Ok(Config::Export { options, .. }) =
        parse(&["memptrace", "export", "t.db", "--parquet", "fleet/t1"])
    else {
        panic!("not an export");
    };
    assert_eq!(options.parquet, Some(PathBuf::from("fleet/t1")));
    assert_eq!((options.pprof, options.collapsed), (None, None));
    let err = parse(&["memptrace", "export", "t.db"]).expect_err("an output is required");
    assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
}

#[test]
fn window_options() {
    let Ok(Config::Window { trace, options }) = parse(&[
        "memptrace",
        "window",
        "t.db",
        "--from",
        "1.5",
        "--to",
        "2500ms",
        "--format",
        "json",
    ]) else {
        panic!("not a window");
    };
    assert_eq!(trace, PathBuf::from("t.db"));
    assert_eq!(
        (options.from_ns, options.to_ns),
        (1_500_000_000, 2_500_000_000)
    );
    assert_eq!(options.report.format, Format::Json);
    assert!(
        parse(&["memptrace", "window", "--from", "1"]).is_err(),
        "--to is required"
    );
    assert!(parse(&["memptrace", "window", "--from", "-1", "--to", "2"]).is_err());
}
