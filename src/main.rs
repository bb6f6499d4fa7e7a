use std::process::ExitCode;

use memptrace::cli::Cli;

fn main() -> ExitCode {
    let config = Cli::config_from_args();
    match memptrace::session::run(config) {
        Ok(status) => ExitCode::from(status.clamp(0, 255) as u8),
        Err(err) => {
            let status = err.exit_status();
            eprintln!("memptrace: {:#}", anyhow::Error::new(err));
            ExitCode::from(status)
        }
    }
}
