//! Static binaries as they ship: stripped (the allocator found by its
//! machine code, or through the debug file beside the binary), and built
//! without unwind tables (stacks from `.debug_frame`, the binary's own or
//! its debug file's). Glibc and musl; exact counts against each tracee's
//! truth, stacks checked frame by frame.

use std::path::Path;

use memptrace::symbols::symbolize::Symbolizer;

use crate::support::{Trace, Variant, trace_program, tracee};

const STATIC: [Variant; 3] = [Variant::Static, Variant::StaticPie, Variant::Musl];

fn trace_path(variant: Variant, path: &str, args: &[&str]) -> Trace {
    let program = tracee(variant, "leaks").with_file_name(path);
    let t = trace_program(&program, args, &[]);
    t.assert_sound();
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    t
}

/// Name the frames of a stripped binary's trace from the unstripped build
/// it was stripped from (the same code at the same addresses).
fn name_from(t: &Trace, unstripped: &Path) {
    let mut stmt =
        t.db.prepare(
            "SELECT f.id, f.ip - m.base FROM frames f JOIN modules m ON m.id = f.module_id
             WHERE m.path LIKE '%/stripped-%'",
        )
        .unwrap();
    let frames: Vec<(i64, i64)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!frames.is_empty(), "no frame in the stripped binary");
    let probes: Vec<u64> = frames.iter().map(|&(_, ip)| ip as u64 - 1).collect();
    let names = Symbolizer::with_debug_roots(Vec::new()).symbolize(unstripped, None, &probes);
    for ((id, _), lines) in frames.iter().zip(names) {
        let name = lines.last().and_then(|l| l.function.clone());
        t.db.execute(
            "UPDATE frames SET function = ?1 WHERE id = ?2",
            rusqlite::params![name, id],
        )
        .unwrap();
    }
}

/// Every `allocator.*` row of `meta` for the program: (op, how found).
fn found_by(t: &Trace, program: &str) -> Vec<(String, String)> {
    let mut stmt =
        t.db.prepare("SELECT key, value FROM meta WHERE key LIKE 'allocator.%' ORDER BY key")
            .unwrap();
    stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix("allocator.")?;
            let (path, op) = rest.rsplit_once('.')?;
            path.ends_with(program).then(|| (op.to_string(), v))
        })
        .collect()
}

/// `strip -s`: no symbol, no debug file; the allocator is found by its
/// code, and every call is recorded as from the unstripped build.
#[test]
fn stripped_static_binaries_by_signature() {
    for variant in STATIC {
        let libc = if variant.glibc() {
            "glibc 2."
        } else {
            "musl 1."
        };
        for (name, unstripped) in [("stripped-leaks", "leaks"), ("stripped-deep", "deep")] {
            let t = trace_path(variant, name, &[]);
            let found = found_by(&t, name);
            // musl links only what the program uses; glibc's malloc.o has them all.
            let ops: &[&str] = if variant.glibc() {
                &[
                    "malloc",
                    "free",
                    "calloc",
                    "realloc",
                    "memalign",
                    "posix_memalign",
                ]
            } else {
                &["malloc", "free"]
            };
            for op in ops {
                let (_, how) = found
                    .iter()
                    .find(|(o, _)| o == op)
                    .unwrap_or_else(|| panic!("{variant:?} {name}: {op} not found: {found:?}"));
                assert!(
                    how.starts_with("signature ") && how.contains(libc),
                    "{variant:?} {op}: {how}"
                );
            }
            name_from(&t, &tracee(variant, unstripped));
            t.assert_truth();
            if unstripped == "deep" {
                t.assert_deep_stacks(&format!("{variant:?} {name}"));
            }
        }
    }
}

/// The debug file beside the stripped binary (`.gnu_debuglink`) names the
/// allocator, and the frames.
#[test]
fn stripped_static_binaries_with_a_debug_file() {
    for variant in STATIC {
        for name in ["leaks", "deep"] {
            let t = trace_path(variant, &format!("split/{name}"), &[]);
            let found = found_by(&t, &format!("split/{name}"));
            let (_, how) = found.iter().find(|(o, _)| o == "malloc").unwrap();
            assert!(
                how.starts_with("debug file ") && how.contains(&format!("{name}.debug")),
                "{variant:?}: {how}"
            );
            t.assert_truth();
            if name == "deep" {
                t.assert_deep_stacks(&format!("{variant:?} {name}"));
            }
        }
    }
}

/// Built without unwind tables and without frame pointers: the CFI is only
/// in `.debug_frame`, the binary's own or, stripped, its debug file's. Both
/// unwinders give the whole chain.
#[test]
fn stacks_from_debug_frame() {
    for variant in STATIC {
        for path in ["nounwind", "split/nounwind"] {
            for unwinder in ["framehop", "libunwind"] {
                let program = tracee(variant, "leaks").with_file_name(path);
                let t = trace_program(&program, &[], &["--unwinder", unwinder]);
                t.assert_sound();
                t.assert_truth();
                t.assert_deep_stacks(&format!("{variant:?} {path} {unwinder}"));
            }
        }
    }
}

/// No CFI at all and no frame pointers (`nounwind` stripped of its
/// `.debug_frame`, no debug file): the stack ends at the caller of the
/// allocator, counted as truncated, instead of going on with whatever the
/// frame-pointer register held (argv bytes, in busybox).
#[test]
fn no_rule_no_invented_frame() {
    for variant in STATIC {
        for unwinder in ["framehop", "libunwind"] {
            let program = tracee(variant, "leaks").with_file_name("stripped-nounwind");
            let t = trace_program(&program, &[], &["--unwinder", unwinder]);
            t.assert_sound();
            name_from(&t, &tracee(variant, "nounwind"));
            t.assert_truth();
            let truncated: i64 = t.meta("truncated_stacks").unwrap().parse().unwrap();
            assert!(truncated > 0, "{variant:?} {unwinder}");
            for stack in t.stacks_from("deep_inner", "malloc") {
                let functions = t.stack_functions(stack);
                assert_eq!(functions[0], "deep_inner", "{variant:?} {unwinder}");
                // Any frame after it was found by the frame-pointer register
                // and says so; it is a real function of the program.
                let trust = t.stack_trust(stack);
                let marked = trust[1..].iter().filter(|t| *t != "frame pointer").count();
                assert_eq!(marked, 0, "{variant:?} {unwinder}: {functions:?}");
                assert!(!functions.iter().any(|f| f == "?"), "{functions:?}");
            }
        }
    }
}
