//! Time what a process's set-up costs per image: reading and parsing it
//! (`symbols::locate::load`) and building the jump probes' unwind table
//! (`unwind::tables::build`), and print a hash of the table's rows, so that
//! a faster build can be checked to give the same table. Each time is the
//! least of the rounds' (on a loaded machine, the rounds that ran alone)
//! and their median.
//!
//! ```text
//! cargo run --release --example unwind_tables -- $(gcc -print-prog-name=cc1) /lib/x86_64-linux-gnu/libc.so.6
//! cargo run --release --example unwind_tables -- --rounds 20 target/release/memptrace
//! ```

use std::hash::{DefaultHasher, Hash, Hasher};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use memptrace::symbols::locate;
use memptrace::unwind::tables;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut rounds = 10;
    if let Some(i) = args.iter().position(|a| a == "--rounds") {
        let Some(n) = args
            .get(i + 1)
            .and_then(|n| n.parse().ok())
            .filter(|&n| n > 0)
        else {
            eprintln!("unwind_tables: --rounds takes a number above 0");
            return ExitCode::from(2);
        };
        rounds = n;
        args.drain(i..i + 2);
    }
    if args.is_empty() {
        eprintln!("usage: unwind_tables [--rounds N] ELF...");
        return ExitCode::from(2);
    }
    for path in &args {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(err) => {
                eprintln!("unwind_tables: {path}: {err}");
                return ExitCode::FAILURE;
            }
        };
        let mut load = Vec::new();
        let mut build = Vec::new();
        let mut table = tables::UnwindTable::default();
        for _ in 0..rounds {
            let start = Instant::now();
            let image = match locate::load(path, &bytes) {
                Ok(image) => image,
                Err(err) => {
                    eprintln!("unwind_tables: {path}: {err}");
                    return ExitCode::FAILURE;
                }
            };
            load.push(start.elapsed());
            let start = Instant::now();
            table = tables::build(&image);
            build.push(start.elapsed());
        }
        let mut hasher = DefaultHasher::new();
        table.keys.hash(&mut hasher);
        table.rules.hash(&mut hasher);
        println!(
            "{path}: load {}, build {} ms (least/median of {rounds}), {} rows, hash {:016x}",
            least_median(&mut load),
            least_median(&mut build),
            table.len(),
            hasher.finish()
        );
    }
    ExitCode::SUCCESS
}

fn least_median(times: &mut [Duration]) -> String {
    times.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!("{:.1}/{:.1}", ms(times[0]), ms(times[times.len() / 2]))
}
