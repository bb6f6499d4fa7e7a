//! Usage errors: a command line memptrace cannot act on. As is the custom
//! (clap's, and most tools'), they exit with status 2 and show the error,
//! the usage of the command it is about, and one hint: ours where the
//! mistake is a known habit (`memptrace ./prog`, heaptrack's way of
//! launching), clap's suggestion ("a similar argument exists"), or else
//! "For more information, try '--help'". Refusals of the input itself (a
//! program that is not there, a process that is gone) are errors of the
//! run, not of the command line: one line and status 1 (`main`).
//!
//! Nothing here reads the environment; the arguments are given.

use std::ffi::{OsStr, OsString};
use std::fmt::Display;

use clap::CommandFactory;
use clap::error::{ContextKind, ContextValue, ErrorKind};

use super::Cli;

/// The exit status of a usage error.
pub const USAGE_STATUS: i32 = 2;

/// A usage error about `command` (a subcommand's name, or `None` for
/// memptrace itself, whose usage it then shows), with a hint.
pub(super) fn error(
    command: Option<&str>,
    kind: ErrorKind,
    message: impl Display,
    hint: Option<String>,
) -> clap::Error {
    let mut root = Cli::command();
    root.build();
    let cmd = match command.and_then(|name| root.find_subcommand_mut(name)) {
        Some(sub) => sub,
        None => &mut root,
    };
    let mut err = cmd.error(kind, message);
    if let Some(hint) = hint {
        // An error with a message of its own is printed from that message:
        // clap does not show this context, `render` does.
        err.insert(
            ContextKind::Suggested,
            ContextValue::StyledStrs(vec![hint.into()]),
        );
    }
    err
}

/// Give clap's error for `args` the hint a user needs: a program given
/// without `--` (`memptrace ./prog arg`) gets the command line with it.
pub fn with_hint(mut err: clap::Error, args: &[OsString]) -> clap::Error {
    if err.kind() != ErrorKind::UnknownArgument {
        return err;
    }
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return err;
    };
    if arg.starts_with('-') {
        return err;
    }
    let Some(at) = args
        .iter()
        .skip(1)
        .position(|a| a.to_str() == Some(arg.as_str()))
        .map(|i| i + 1)
    else {
        return err;
    };
    // Only where a program could start: not after `--` (then it would be
    // one), nor inside a subcommand's arguments (`report a.db b.db`).
    let commands: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .chain(["help".to_string()])
        .collect();
    if args[1..at]
        .iter()
        .any(|a| a == "--" || commands.iter().any(|c| a == c.as_str()))
    {
        return err;
    }
    // A command misspelt (`reprot`) is not a program; a path is.
    let similar = commands
        .iter()
        .filter(|c| c.as_str() != "help" && !arg.contains('/'))
        .find(|c| distance(c, arg) <= c.len() / 3);
    let hint = match similar {
        Some(command) => format!("a similar command exists: '{command}'"),
        None => launch_line(&args[1..at], &args[at..]),
    };
    for kind in [
        ContextKind::SuggestedArg,
        ContextKind::SuggestedSubcommand,
        ContextKind::SuggestedValue,
    ] {
        err.remove(kind);
    }
    err.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![hint.into()]),
    );
    err
}

/// `memptrace OPTIONS -- PROGRAM...`, as a hint.
fn launch_line(options: &[OsString], program: &[OsString]) -> String {
    let line: Vec<String> = std::iter::once("memptrace".to_string())
        .chain(options.iter().map(|a| quoted(a)))
        .chain(["--".to_string()])
        .chain(program.iter().map(|a| quoted(a)))
        .collect();
    format!("to trace a program, put -- before it: {}", line.join(" "))
}

/// The Levenshtein distance of two short words.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// An argument as a shell would need it typed: as it is when it is plain,
/// else in single quotes.
pub fn quoted(arg: &OsStr) -> String {
    let text = arg.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%^".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.into_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// The text of a usage error: the error, the usage, one hint.
pub fn render(err: &clap::Error) -> String {
    let text = err.render().to_string();
    let mut error = Vec::new();
    let (mut tip, mut usage, mut more) = (None, None, None);
    for paragraph in text.trim_end().split("\n\n") {
        let start = paragraph.trim_start();
        if start.starts_with("tip:") {
            // clap may give several; the first is the best it has.
            tip = tip.or(paragraph.lines().next().map(str::to_string));
        } else if start.starts_with("Usage:") {
            usage = Some(paragraph);
        } else if start.starts_with("For more information") {
            more = Some(paragraph);
        } else {
            error.push(paragraph);
        }
    }
    let ours = match err.get(ContextKind::Suggested) {
        Some(ContextValue::StyledStrs(hints)) => hints.first().map(|h| format!("  tip: {h}")),
        _ => None,
    };
    let mut out = error.join("\n\n");
    match tip.or(ours) {
        Some(tip) => {
            out.push_str("\n\n");
            out.push_str(&tip);
            if let Some(usage) = usage {
                out.push_str("\n\n");
                out.push_str(usage);
            }
        }
        None => {
            for paragraph in usage.into_iter().chain(more) {
                out.push_str("\n\n");
                out.push_str(paragraph);
            }
        }
    }
    out.push('\n');
    out
}

/// Print a usage error and exit 2; help and version go to stdout, exit 0.
pub fn exit(err: clap::Error) -> ! {
    if !err.use_stderr() {
        err.exit();
    }
    eprint!("{}", render(&err));
    std::process::exit(USAGE_STATUS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The text memptrace prints for `args`, as `config_from_args` makes it.
    fn printed(args: &[&str], env_probes: Option<&str>) -> String {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let err = Cli::try_parse_from(&args)
            .map_err(|err| with_hint(err, &args))
            .and_then(|cli| cli.into_config(env_probes))
            .expect_err("a usage error");
        assert!(err.use_stderr());
        render(&err)
    }

    const USAGE: &str =
        "Usage: memptrace [OPTIONS] -- <PROGRAM>...\n       memptrace [OPTIONS] <COMMAND>\n";

    /// heaptrack's habit, `memptrace ./prog args`: the command line with
    /// `--`, the options kept, each argument as a shell needs it.
    #[test]
    fn a_program_without_dashes_gets_them() {
        assert_eq!(
            printed(&["memptrace", "./prog"], None),
            format!(
                "error: unexpected argument './prog' found\n\n  tip: to trace a program, put -- before it: memptrace -- ./prog\n\n{USAGE}"
            )
        );
        assert_eq!(
            printed(
                &["memptrace", "-o", "x.db", "ls", "-l", "my dir", "it's"],
                None
            ),
            format!(
                "error: unexpected argument 'ls' found\n\n  tip: to trace a program, put -- before it: memptrace -o x.db -- ls -l 'my dir' 'it'\\''s'\n\n{USAGE}"
            )
        );
        // A command misspelt is not a program; a command's own extra
        // argument is not one either.
        assert_eq!(
            printed(&["memptrace", "reprot", "t.db"], None),
            format!(
                "error: unexpected argument 'reprot' found\n\n  tip: a similar command exists: 'report'\n\n{USAGE}"
            )
        );
        assert_eq!(
            printed(&["memptrace", "report", "a.db", "b.db"], None),
            "error: unexpected argument 'b.db' found\n\nUsage: memptrace report [OPTIONS] [TRACE]\n\nFor more information, try '--help'.\n"
        );
    }

    /// `--duration` belongs to `attach`; one hint, no "--help" besides it.
    #[test]
    fn duration_on_a_launch_points_to_attach() {
        assert_eq!(
            printed(&["memptrace", "--duration", "2.5", "--", "ls"], None),
            format!(
                "error: --duration applies to `attach` (a launched program is traced until it exits)\n\n  tip: to trace a running process for 2.5 s: memptrace attach PID --duration 2.5\n\n{USAGE}"
            )
        );
    }

    /// The usage shown is the command's, with `[TRACE]` as `--help` has it.
    #[test]
    fn usage_of_the_command_at_fault() {
        assert_eq!(
            printed(&["memptrace", "export", "t.db"], None),
            "error: nothing to export: give --pprof PATH, --collapsed PATH, --parquet DIR, or several\n\n  tip: memptrace export t.db --pprof heap.pb.gz\n\nUsage: memptrace export [OPTIONS] [TRACE]\n"
        );
        assert_eq!(
            printed(&["memptrace", "-o", "x.svg", "flamegraph"], None),
            "error: --output before `flamegraph`: options of a trace go with `memptrace [OPTIONS] -- PROGRAM` or `memptrace attach PID [OPTIONS]`\n\n  tip: the options of `flamegraph` go after it: memptrace flamegraph --help lists them\n\nUsage: memptrace flamegraph [OPTIONS] [TRACE]\n"
        );
        assert_eq!(
            printed(&["memptrace", "heapmap", "12", "--snapshot", "1"], None),
            "error: --snapshot reads a trace, not a process\n\nUsage: memptrace heapmap [OPTIONS] [PID|TRACE]\n\nFor more information, try '--help'.\n"
        );
        // clap's own suggestion is the one hint.
        assert_eq!(
            printed(&["memptrace", "--ouput", "x.db", "--", "ls"], None),
            "error: unexpected argument '--ouput' found\n\n  tip: a similar argument exists: '--output'\n\nUsage: memptrace --output <PATH> -- <PROGRAM>...\n"
        );
        assert_eq!(
            printed(&["memptrace", "--", "ls"], Some("magic")),
            format!(
                "error: MEMPTRACE_PROBES=\"magic\": give jump or int3\n\n{USAGE}\nFor more information, try '--help'.\n"
            )
        );
    }

    #[test]
    fn quoting_and_distance() {
        assert_eq!(quoted(OsStr::new("./a-b_c.d=1")), "./a-b_c.d=1");
        assert_eq!(quoted(OsStr::new("")), "''");
        assert_eq!(quoted(OsStr::new("a;b")), "'a;b'");
        assert_eq!(distance("report", "reprot"), 2);
        assert_eq!(distance("plot", "plot"), 0);
        assert_eq!(distance("man", "cat"), 2);
        assert_eq!(distance("", "ab"), 2);
    }
}
