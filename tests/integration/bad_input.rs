//! Bad input gets one clear line on stderr, exactly as written here, and a
//! non-zero exit (127 for a program that cannot be found and 126 for one
//! that cannot be run, as a shell would say; 1 for everything memptrace
//! refuses), never a panic, and leaves no database behind (or, for an
//! existing file, leaves it untouched). A command line that cannot be
//! parsed is a usage error: exit 2, the error, the usage and one hint.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::support::{Run, Variant, memptrace, run, scratch, tracee};

/// Run memptrace on `program` writing `db`; check the refusal, to the byte.
fn refused(db: &Path, program: &Path, status: i32, says: &str) -> Run {
    let out = run(memptrace().arg("-o").arg(db).arg("--").arg(program), b"");
    assert_eq!(out.stderr, format!("memptrace: {says}\n"));
    assert_eq!(out.code(), status, "{}", out.stderr);
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
    let path = dir.join("no-such-program");
    refused(
        &db,
        &path,
        127,
        &format!("{}: no such file", path.display()),
    );
    // A relative path is a path too (`./prog`), and so is an absolute one.
    let out = run(
        memptrace()
            .current_dir(&dir)
            .args(["-o", "trace.db", "--", "./nosuch"]),
        b"",
    );
    assert_eq!(
        (out.code(), out.stderr.as_str()),
        (127, "memptrace: ./nosuch: no such file\n")
    );
    refused(
        &db,
        Path::new("/no/such/prog"),
        127,
        "/no/such/prog: no such file",
    );
    refused(
        &db,
        Path::new("no-such-program-in-path"),
        127,
        "no-such-program-in-path: no such program (not a path, and not found in PATH)",
    );
    assert!(!db.exists());
}

#[test]
fn not_executable() {
    let dir = scratch("noexec");
    let db = dir.join("trace.db");
    let file = dir.join("data");
    std::fs::write(&file, "just text\n").unwrap();
    refused(
        &db,
        &file,
        126,
        &format!("{}: not executable (no execute permission)", file.display()),
    );
    refused(
        &db,
        &dir,
        126,
        &format!("{}: not executable (it is a directory)", dir.display()),
    );
    assert!(!db.exists());
}

/// A script whose `#!` names an interpreter that does not exist: the
/// system's reason comes once, with the interpreter named.
#[test]
fn script_with_a_missing_interpreter() {
    let dir = scratch("shebang");
    let db = dir.join("trace.db");
    let script = dir.join("script");
    executable(&script, b"#!/no/such/interpreter -e\necho hi\n");
    refused(
        &db,
        &script,
        126,
        &format!(
            "cannot execute {}: its #! line names the interpreter /no/such/interpreter: No such file or directory (os error 2)",
            script.display()
        ),
    );
    assert!(!db.exists());
}

#[test]
fn not_an_elf() {
    let dir = scratch("notelf");
    let db = dir.join("trace.db");
    let file = dir.join("text");
    executable(&file, b"this is not a program\n");
    refused(
        &db,
        &file,
        1,
        &format!(
            "{}: not an ELF executable (memptrace runs ELF programs and #! scripts)",
            file.display()
        ),
    );
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
    let program = dir.join("prog32");
    executable(&program, &elf);
    refused(
        &db,
        &program,
        1,
        &format!(
            "{}: a 32-bit program; memptrace traces x86-64 programs only",
            program.display()
        ),
    );
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
        let program = tracee(variant, "nolibc");
        let out = run(memptrace().arg("-o").arg(&db).arg("--").arg(&program), b"");
        assert_eq!(out.code(), 1, "{}", out.stderr);
        // Word for word, but for the C libraries tried (those this machine
        // has, besides the shipped signature sets).
        let head = format!(
            "memptrace: {}: statically linked and stripped, and its allocator (malloc, free, ...) \
             was not found: no symbol, no debug file, and its code matches none of the C \
             libraries tried (",
            program.display()
        );
        let tail = "); trace an unstripped build, put its debug file beside it, or install the \
                    libc.a it was linked with
";
        let tried = out
            .stderr
            .strip_prefix(&head)
            .and_then(|rest| rest.strip_suffix(tail))
            .unwrap_or_else(|| panic!("{:?}", out.stderr));
        for library in ["glibc 2.", "musl 1."] {
            assert!(tried.contains(library), "names {library}: {tried}");
        }
        assert!(!db.exists());
    }
}

#[test]
fn existing_output_needs_force() {
    let dir = scratch("exists");
    let db = dir.join("trace.db");
    std::fs::write(&db, "precious").unwrap();
    refused(
        &db,
        &tracee(Variant::Dynamic, "leaks"),
        1,
        &format!(
            "{}: already exists; choose another file with -o, or replace it with --force",
            db.display()
        ),
    );
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

/// The system's reason once, not twice.
#[test]
fn unwritable_output() {
    let db = Path::new("/dev/null/trace.db");
    refused(
        db,
        &tracee(Variant::Dynamic, "leaks"),
        1,
        "cannot create /dev/null/trace.db: Not a directory (os error 20)",
    );
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
    assert_eq!(
        out.stderr,
        "memptrace: ptrace is not permitted here (run memptrace as root, or allow it: sysctl kernel.yama.ptrace_scope=0, or the CAP_SYS_PTRACE capability; in a container, a seccomp profile that allows ptrace): Operation not permitted (os error 1)\n"
    );
    assert_eq!(out.code(), 1);
    assert!(!db.exists(), "no database for a trace that never started");
}

#[test]
fn usage_errors_come_from_clap() {
    let out = run(&mut memptrace(), b"");
    assert_eq!(out.code(), 2);
    assert!(out.stderr.contains("Usage"), "{}", out.stderr);
    // heaptrack's way, `memptrace ./prog`, and --duration on a launch: the
    // error, one hint, the usage; nothing is created.
    let usage =
        "Usage: memptrace [OPTIONS] -- <PROGRAM>...\n       memptrace [OPTIONS] <COMMAND>\n";
    let dir = scratch("usage");
    for (args, says) in [
        (
            &["./prog", "--its-flag"][..],
            "error: unexpected argument './prog' found\n\n  \
             tip: to trace a program, put -- before it: memptrace -- ./prog --its-flag\n\n",
        ),
        (
            &["--duration", "30", "--", "./prog"],
            "error: --duration applies to `attach` (a launched program is traced until it exits)\n\n  \
             tip: to trace a running process for 30 s: memptrace attach PID --duration 30\n\n",
        ),
    ] {
        let out = run(memptrace().current_dir(&dir).args(args), b"");
        assert_eq!(
            (out.code(), out.stderr.as_str()),
            (2, format!("{says}{usage}").as_str()),
            "{args:?}"
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{args:?}");
    }
    // Options of a trace before a report command, or given twice.
    for (args, says) in [
        (
            &["-o", "x.svg", "flamegraph"][..],
            "error: --output before `flamegraph`: options of a trace go with `memptrace [OPTIONS] -- PROGRAM` or `memptrace attach PID [OPTIONS]`",
        ),
        (
            &["-o", "a.db", "attach", "1", "-o", "b.db"],
            "error: --output is given twice",
        ),
    ] {
        let out = run(memptrace().args(args), b"");
        assert_eq!(out.code(), 2, "{args:?}");
        assert_eq!(out.stderr.lines().next(), Some(says), "{args:?}");
    }
}
