//! Bad input gets one clear line on stderr and a non-zero exit, never a
//! panic, and leaves no database behind (or, for an existing file, leaves it
//! untouched).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::support::{Run, Variant, memptrace, run, scratch, tracee};

/// Run memptrace on `program` writing `db`; check the one-line refusal.
fn refused(db: &Path, program: &Path, says: &str) -> Run {
    let out = run(memptrace().arg("-o").arg(db).arg("--").arg(program), b"");
    assert_eq!(out.code(), 1, "{}", out.stderr);
    assert_eq!(out.stderr.lines().count(), 1, "one line: {:?}", out.stderr);
    assert!(out.stderr.starts_with("memptrace: "), "{}", out.stderr);
    assert!(
        out.stderr.contains(says),
        "{:?} does not say {says:?}",
        out.stderr
    );
    assert!(!out.stderr.contains("panicked"));
    out
}

fn executable(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn missing_program() {
    let dir = scratch("missing");
    let db = dir.join("trace.db");
    refused(&db, &dir.join("no-such-program"), "no such program");
    refused(&db, Path::new("no-such-program-in-path"), "no such program");
    assert!(!db.exists());
}

#[test]
fn not_executable() {
    let dir = scratch("noexec");
    let db = dir.join("trace.db");
    let file = dir.join("data");
    std::fs::write(&file, "just text\n").unwrap();
    refused(&db, &file, "not executable");
    refused(&db, &dir, "not executable");
    assert!(!db.exists());
}

#[test]
fn not_an_elf() {
    let dir = scratch("notelf");
    let db = dir.join("trace.db");
    let file = dir.join("text");
    executable(&file, b"this is not a program\n");
    refused(&db, &file, "not an ELF");
    assert!(!db.exists());
}

#[test]
fn a_32_bit_program() {
    let dir = scratch("elf32");
    let db = dir.join("trace.db");
    // The identification of an i386 executable: ELFCLASS32, little-endian, EM_386.
    let mut elf = vec![0u8; 52];
    elf[..7].copy_from_slice(b"\x7fELF\x01\x01\x01");
    elf[16] = 2; // ET_EXEC
    elf[18] = 3; // EM_386
    executable(&dir.join("prog32"), &elf);
    refused(&db, &dir.join("prog32"), "32-bit");
    assert!(!db.exists());
}

/// A stripped static binary whose allocator cannot be found (it has no C
/// library at all): refused, naming the C libraries its code was matched
/// against.
#[test]
fn static_binary_without_an_allocator() {
    for variant in [Variant::Static, Variant::Musl] {
        let dir = scratch("nolibc");
        let db = dir.join("trace.db");
        let out = refused(
            &db,
            &tracee(variant, "nolibc"),
            "allocator (malloc, free, ...) was not found",
        );
        for tried in ["glibc 2.", "musl 1."] {
            assert!(out.stderr.contains(tried), "names {tried}: {}", out.stderr);
        }
        assert!(
            out.stderr.contains("debug file"),
            "says what to do: {}",
            out.stderr
        );
        assert!(!db.exists());
    }
}

#[test]
fn existing_output_needs_force() {
    let dir = scratch("exists");
    let db = dir.join("trace.db");
    std::fs::write(&db, "precious").unwrap();
    refused(&db, &tracee(Variant::Dynamic, "leaks"), "already exists");
    assert_eq!(std::fs::read_to_string(&db).unwrap(), "precious");

    let out = run(
        memptrace()
            .arg("-o")
            .arg(&db)
            .arg("--force")
            .arg("--")
            .arg(tracee(Variant::Dynamic, "leaks")),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let mode: String = conn
        .query_row("SELECT value FROM meta WHERE key = 'mode'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(mode, "launch");
}

#[test]
fn unwritable_output() {
    let db = Path::new("/dev/null/trace.db");
    refused(db, &tracee(Variant::Dynamic, "leaks"), "cannot create");
}

#[test]
fn ptrace_not_permitted() {
    let dir = scratch("noptrace");
    let db = dir.join("trace.db");
    // noptrace runs memptrace under a seccomp filter that fails ptrace(2)
    // with EPERM, as a container's default profile may.
    let out = run(
        std::process::Command::new(tracee(Variant::Dynamic, "noptrace"))
            .arg(env!("CARGO_BIN_EXE_memptrace"))
            .arg("-o")
            .arg(&db)
            .arg("--")
            .arg(tracee(Variant::Dynamic, "leaks")),
        b"",
    );
    assert_eq!(out.code(), 1);
    assert_eq!(out.stderr.lines().count(), 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("ptrace is not permitted"),
        "{}",
        out.stderr
    );
    assert!(!db.exists(), "no database for a trace that never started");
}

#[test]
fn usage_errors_come_from_clap() {
    let out = run(&mut memptrace(), b"");
    assert_eq!(out.code(), 2);
    assert!(out.stderr.contains("Usage"), "{}", out.stderr);
}
