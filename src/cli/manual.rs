//! Shell completions (clap_complete) and man pages (clap_mangen), made
//! from the same clap definitions as `--help` when asked for
//! (`memptrace completions bash`, `memptrace man`): they cannot disagree
//! with the binary that prints them, and there is no build step to forget.

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::Cli;

/// The commands that have a page of their own (`memptrace-report(1)`).
const PAGES: [&str; 9] = [
    "attach",
    "report",
    "flamegraph",
    "plot",
    "export",
    "window",
    "heapmap",
    "completions",
    "man",
];

#[derive(Debug, Clone, Args)]
pub struct CompletionsArgs {
    /// The shell to complete memptrace's commands and options in.
    #[arg(value_name = "SHELL", value_enum)]
    pub shell: Shell,
}

#[derive(Debug, Clone, Args)]
pub struct ManArgs {
    /// A command's own page (its options); memptrace's page by default.
    #[arg(value_name = "COMMAND", value_parser = PAGES)]
    pub command: Option<String>,
}

/// The completion script of `shell`.
pub fn completions(shell: Shell) -> String {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "memptrace", &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// The man page (roff) of memptrace, or of one of its commands.
pub fn man_page(command: Option<&str>) -> std::io::Result<String> {
    let mut root = Cli::command();
    // Built, the commands know their full names (`memptrace-report`).
    root.build();
    let page = match command.and_then(|name| root.find_subcommand(name)) {
        Some(sub) => sub.clone(),
        None => root,
    };
    let mut out = Vec::new();
    clap_mangen::Man::new(page)
        .source(concat!("memptrace ", env!("CARGO_PKG_VERSION")))
        .render(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command is completed, in every shell asked for.
    #[test]
    fn completions_name_every_command() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            let script = completions(shell);
            for command in PAGES {
                assert!(script.contains(command), "{shell}: no {command}");
            }
            for option in ["--output", "--probes", "--follow-forks", "--metric"] {
                assert!(
                    script.contains(option.trim_start_matches('-')),
                    "{shell}: no {option}"
                );
            }
        }
        assert!(completions(Shell::Bash).contains("complete -F _memptrace"));
    }

    /// Each command's page exists and names its options (in roff, a `-`
    /// is `\-`).
    #[test]
    fn man_pages_name_the_options() {
        let page = man_page(None).unwrap();
        let version = env!("CARGO_PKG_VERSION");
        let head = |name: &str| {
            format!(
                ".ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n.TH {name} 1  \"memptrace {version}\" \n"
            )
        };
        assert!(page.starts_with(&head("memptrace")), "{page}");
        for text in ["\\-\\-output", "\\-\\-probes", "memptrace\\-report(1)"] {
            assert!(page.contains(text), "no {text} in\n{page}");
        }
        let report = man_page(Some("report")).unwrap();
        assert!(report.starts_with(&head("memptrace-report")), "{report}");
        assert!(report.contains("\\-\\-frames"), "{report}");
        for command in PAGES {
            assert!(man_page(Some(command)).is_ok(), "{command}");
        }
    }
}
