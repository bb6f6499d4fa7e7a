use std::process::ExitCode;

use clap::Parser;
use memptrace::cli::Cli;

fn main() -> ExitCode {
    let config = Cli::parse().into_config();
    match memptrace::session::run(config) {
        Ok(status) => ExitCode::from(status.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("memptrace: {:#}", anyhow::Error::new(err));
            ExitCode::from(1)
        }
    }
}
