//! Static binaries as they ship: stripped (the allocator found by its
//! machine code, or through the debug file beside the binary), and built
//! without unwind tables (stacks from `.debug_frame`, the binary's own or
//! its debug file's). Glibc and musl; exact counts against each tracee's
//! truth, stacks checked frame by frame.

use std::path::Path;

use memptrace::symbols::elf::ElfImage;
use memptrace::symbols::locate;
use memptrace::symbols::symbolize::Symbolizer;

use crate::support::{Trace, Variant, trace, trace_program, tracee};

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

/// The image as memptrace loads it (symbols, or signatures when stripped).
fn load(path: &Path) -> ElfImage {
    let bytes = std::fs::read(path).unwrap();
    locate::load(path.to_str().unwrap(), &bytes).unwrap()
}

/// Stripped, a static binary is hooked where its unstripped build is: the
/// signature sets give each function found its extent, and hold the
/// mapping functions and glibc's thread-exit frees (housekeeping) too.
#[test]
fn stripped_static_binaries_hooked_as_built() {
    for variant in STATIC {
        for name in ["leaks", "threads", "mapping"] {
            let built = load(&tracee(variant, name));
            let stripped = load(&tracee(variant, name).with_file_name(format!("stripped-{name}")));
            let what = format!("{variant:?} {name}");
            assert!(built.has_symtab && !stripped.has_symtab, "{what}");
            assert!(built.mappings.len() >= 4, "{what}: {:?}", built.mappings);
            assert_eq!(stripped.mappings, built.mappings, "{what}");
            // musl's `__libc_malloc` is a jump (no return address is ever
            // inside it): its symbol names it, its code does not.
            let bodies = |image: &ElfImage| {
                let mut v = image.allocator_bodies.clone();
                v.retain(|(range, _)| range.end - range.start > 5);
                v.sort_by_key(|(range, _)| range.start);
                v
            };
            assert_eq!(bodies(&stripped), bodies(&built), "{what}");
            let mut housekeeping = stripped.housekeeping.clone();
            housekeeping.sort_by_key(|r| r.start);
            assert_eq!(housekeeping, built.housekeeping, "{what}");
            assert_eq!(stripped.signature_gaps, Vec::<String>::new(), "{what}");
            if variant.glibc() {
                assert!(!built.housekeeping.is_empty(), "{what}");
                // musl's `malloc` is a jump hooked at its target when stripped.
                let entries = |image: &ElfImage| -> Vec<(u64, Vec<memptrace::event::Op>, u64)> {
                    let e = image.allocators.iter();
                    e.map(|a| (a.svma.0, a.ops.clone(), a.size)).collect()
                };
                assert_eq!(entries(&stripped), entries(&built), "{what}");
            }
        }
    }
}

/// What stripping must not change in a trace: calls per op, the frees
/// told apart as the allocator's housekeeping, and (`maps`) the mapping
/// calls per function, the program's and the allocator's apart.
fn counts(t: &Trace, maps: bool) -> Vec<(String, i64)> {
    let mut sql = "SELECT 'event ' || op, count(*) FROM events GROUP BY op
         UNION ALL SELECT key, CAST(value AS INTEGER) FROM meta WHERE key = 'housekeeping_frees'"
        .to_string();
    if maps {
        sql += " UNION ALL SELECT 'map ' || op || ' ' || coalesce(by_allocator, 'program'),
                 count(*) FROM map_events GROUP BY op, by_allocator";
    }
    let mut stmt = t.db.prepare(&format!("{sql} ORDER BY 1")).unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// Traced, a stripped static binary gives the counts of its unstripped
/// build: glibc's frees of a dead thread's cached blocks are housekeeping
/// in both (threads.c, 4 threads), and the mapping calls are all there,
/// the allocator's told apart (mapping.c). The threads' mapping calls are
/// not compared: which thread gets a new arena depends on timing.
#[test]
fn stripped_static_binaries_count_as_built() {
    for variant in STATIC {
        for (name, args, maps) in [
            ("threads", &["4", "5000"][..], false),
            ("mapping", &[], true),
        ] {
            let what = format!("{variant:?} {name}");
            let built = trace(variant, name, args, &[]);
            assert_eq!(built.run.code(), 0, "{what}: {}", built.run.stderr);
            let stripped = trace_path(variant, &format!("stripped-{name}"), args);
            let want = counts(&built, maps);
            assert_eq!(counts(&stripped, maps), want, "{what}");
            let housekeeping = want.iter().find(|(k, _)| k == "housekeeping_frees");
            let expected = if variant.glibc() && name == "threads" {
                // Each thread's tcache at its exit, and the tcache itself.
                assert!(
                    housekeeping.is_some_and(|&(_, n)| n > 4),
                    "{what}: {want:?}"
                );
                housekeeping.map(|&(_, n)| n)
            } else {
                Some(0)
            };
            assert_eq!(housekeeping.map(|&(_, n)| n), expected, "{what}");
            assert_eq!(stripped.run.stderr, "", "{what}");
            name_from(&stripped, &tracee(variant, name));
            stripped.assert_truth();
        }
    }
}

/// Debian's busybox-static, stripped: its mapping functions are found by
/// signature. `echo` makes three mapping calls: glibc's start-up makes its
/// relocated data read-only (mprotect), and the first malloc grows the
/// heap (sbrk, asking the break, then moving it).
#[test]
fn busybox_mapping_calls_by_signature() {
    let t = trace_program(Path::new("/bin/busybox"), &["echo", "hi"], &[]);
    t.assert_sound();
    assert_eq!(t.run.code(), 0, "{}", t.run.stderr);
    assert_eq!(t.run.stdout, "hi\n");
    assert_eq!(t.run.stderr, "");
    let maps: Vec<(String, i64)> = counts(&t, true)
        .into_iter()
        .filter(|(k, _)| k.starts_with("map "))
        .collect();
    let want = [("map mprotect program", 1), ("map sbrk malloc", 2)];
    let want: Vec<(String, i64)> = want.iter().map(|&(k, n)| (k.to_string(), n)).collect();
    assert_eq!(maps, want);
}
