//! Make a signature set from a `libc.a`, as `scripts/signatures` does for
//! the sets memptrace ships (`src/symbols/signatures/*.sig`).
//!
//! ```text
//! cargo run --example signatures -- /usr/lib/x86_64-linux-gnu/libc.a > glibc.sig
//! cargo run --example signatures -- libc.a --label "glibc 2.36 (Debian libc6-dev)" > glibc.sig
//! cargo run --example signatures -- libc.a --find /bin/busybox   # what it finds there
//! ```

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use memptrace::symbols::elf::ElfImage;
use memptrace::symbols::signatures::{Library, extract, matcher};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(archive) = args.first() else {
        eprintln!("usage: signatures LIBC.A [--label TEXT | --find BINARY]");
        return ExitCode::from(2);
    };
    let mut lib = match std::fs::read(archive)
        .map_err(|e| e.to_string())
        .and_then(|b| extract::from_archive(&b, Path::new(archive)).map_err(|e| e.to_string()))
    {
        Ok(lib) => lib,
        Err(err) => {
            eprintln!("signatures: {archive}: {err}");
            return ExitCode::FAILURE;
        }
    };
    match args.get(1).map(String::as_str) {
        Some("--label") => {
            lib.label = args.get(2).cloned().unwrap_or_default();
            let _ = std::io::stdout().write_all(lib.to_text().as_bytes());
            ExitCode::SUCCESS
        }
        Some("--find") => find(&lib, args.get(2).map(String::as_str).unwrap_or("")),
        _ => {
            let _ = std::io::stdout().write_all(lib.to_text().as_bytes());
            ExitCode::SUCCESS
        }
    }
}

fn find(lib: &Library, binary: &str) -> ExitCode {
    let Ok(bytes) = std::fs::read(binary) else {
        eprintln!("signatures: cannot read {binary}");
        return ExitCode::FAILURE;
    };
    let Ok(image) = ElfImage::parse(binary, &bytes) else {
        eprintln!("signatures: {binary}: not an ELF image");
        return ExitCode::FAILURE;
    };
    let segments = image.code_segments();
    let start = std::time::Instant::now();
    let m = matcher::find(lib, &segments);
    let elapsed = start.elapsed();
    let mut out = String::new();
    let _ = writeln!(out, "{}: {elapsed:?}", lib.label);
    for (name, at) in &m.identified {
        let _ = writeln!(out, "  found {name} at {at:#x}");
    }
    for h in &m.hooks {
        let _ = writeln!(
            out,
            "  hook {} at {:#x} ({}{})",
            h.op,
            h.svma,
            h.function,
            h.via
                .as_ref()
                .map(|v| format!(", via {v}"))
                .unwrap_or_default()
        );
    }
    for map in &m.maps {
        let _ = writeln!(
            out,
            "  mapping {} at {:#x} ({})",
            map.op, map.svma, map.function
        );
    }
    for range in &m.housekeeping {
        let _ = writeln!(out, "  housekeeping {range:#x?}");
    }
    let _ = writeln!(
        out,
        "  {} of {} functions found",
        m.identified.len(),
        m.searched
    );
    // A closed pipe (`| head`) is no error worth a panic.
    let _ = std::io::stdout().write_all(out.as_bytes());
    ExitCode::SUCCESS
}
