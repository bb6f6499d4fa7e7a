use std::io::IsTerminal;
use std::process::ExitCode;

use memptrace::cli::usage::quoted;
use memptrace::cli::{Cli, Config};

fn main() -> ExitCode {
    let config = Cli::config_from_args();
    // A launch tells the person at the terminal where its trace went (after
    // the program's own output, which it never interleaves with).
    let launched = match &config {
        Config::Launch { trace, .. } => Some(trace.output.clone()),
        _ => None,
    };
    match memptrace::session::run(config) {
        Ok(status) => {
            if let Some(path) = launched.filter(|_| std::io::stderr().is_terminal()) {
                eprintln!(
                    "memptrace: trace written to {}; read it with: memptrace report {}",
                    path.display(),
                    quoted(path.as_os_str())
                );
            }
            ExitCode::from(status.clamp(0, 255) as u8)
        }
        Err(err) => {
            let status = err.exit_status();
            eprintln!("memptrace: {:#}", anyhow::Error::new(err));
            ExitCode::from(status)
        }
    }
}
