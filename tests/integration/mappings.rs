//! Mapping calls (mmap, munmap, mremap, brk/sbrk, madvise, mprotect) as
//! events, with their stacks, the program's own told apart from those the
//! allocator makes inside its calls: against the tracee's own truth, on
//! every build, launched, under `-f` and attached.

use std::process::Command;

use crate::attach::trampoline_pages;
use crate::support::{
    Background, Trace, VARIANTS, Variant, memptrace, open_trace, probes, run, scratch, trace,
    tracee, wait_until,
};

/// Calls of `op` whose stack's innermost frame is `function`, made by the
/// program itself.
fn own_calls(t: &Trace, function: &str, op: &str) -> i64 {
    t.db.query_row(
        "SELECT count(*) FROM map_events m JOIN stacks s ON s.id = m.stack_id
         JOIN frames f ON f.id = s.frame_id
         WHERE f.function = ?1 AND m.op = ?2 AND m.by_allocator IS NULL",
        [function, op],
        |r| r.get(0),
    )
    .unwrap()
}

/// Calls of `op` of at least 1 MiB the allocator made inside `allocator`
/// calls (smaller ones are its own housekeeping: musl maps a page of
/// metadata on the first big block).
fn allocator_calls(t: &Trace, op: &str, allocator: &str) -> i64 {
    t.db.query_row(
        "SELECT count(*) FROM map_events WHERE op = ?1 AND by_allocator = ?2
         AND len >= 1048576",
        [op, allocator],
        |r| r.get(0),
    )
    .unwrap()
}

/// The allocator's mmap calls of big blocks whose stack goes on, through
/// malloc (and, with jump probes, through malloc's probe), to the program;
/// musl's malloc, which has no unwind tables, by the frames memptrace
/// describes from its machine code (`symbols::height`).
fn big_allocs_through(t: &Trace) -> i64 {
    t.int(
        "SELECT count(*) FROM map_events m JOIN stack_text s ON s.stack_id = m.stack_id
         WHERE m.op = 'mmap' AND m.by_allocator = 'malloc' AND m.len >= 1048576
         AND s.text LIKE '%big_alloc%'",
    )
}

/// The `map <function> <op> <calls>` lines of the tracee's output.
fn stated(stdout: &str) -> Vec<(String, String, i64)> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("map ")?.split_whitespace();
            Some((w.next()?.into(), w.next()?.into(), w.next()?.parse().ok()?))
        })
        .collect()
}

fn check(t: &Trace, variant: Variant) {
    let truth = stated(&t.run.stdout);
    assert_eq!(truth.len(), 6, "{variant:?}: {}", t.run.stdout);
    for (function, op, calls) in truth {
        assert_eq!(
            own_calls(t, &function, &op),
            calls,
            "{variant:?}: {function} {op}"
        );
    }
    // Each big block was mapped by malloc and unmapped by free.
    let big: i64 = t
        .run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("big "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(allocator_calls(t, "mmap", "malloc"), big, "{variant:?}");
    assert_eq!(allocator_calls(t, "munmap", "free"), big, "{variant:?}");
    if variant == Variant::Musl {
        // And the page of metadata musl's malloc maps for the first one,
        // from a helper of malloc's (`__malloc_alloc_meta`).
        let all =
            t.int("SELECT count(*) FROM map_events WHERE op = 'mmap' AND by_allocator = 'malloc'");
        assert_eq!(all, big + 1, "{variant:?}");
    }
    // The results are the program's: every mmap it made succeeded and
    // returned a page-aligned address, which its munmap released.
    let failed: i64 = t.int("SELECT count(*) FROM map_events WHERE op = 'mmap' AND result = -1");
    assert_eq!(failed, 0, "{variant:?}");
    let unaligned: i64 =
        t.int("SELECT count(*) FROM map_events WHERE op = 'mmap' AND result % 4096 <> 0");
    assert_eq!(unaligned, 0, "{variant:?}");
    t.assert_truth();
}

/// Launched with jump probes, a glibc build's mapping functions get jump
/// probes too (no stop per call) where threads read their fs base with
/// `rdfsbase`; musl's `libc.a`, built without unwind tables, keeps int3
/// probes on them (not listed in `meta`), whose unwinder walks out of its
/// allocator's helpers.
#[test]
fn mapping_calls_on_every_build() {
    for variant in VARIANTS {
        let t = trace(variant, "mapping", &[], &[]);
        assert_eq!(t.run.code(), 0, "{variant:?}: {}", t.run.stderr);
        check(&t, variant);
        assert_eq!(big_allocs_through(&t), 8, "{variant:?}");
        // sbrk's own brk is left out by design: no call counted as lost.
        assert_eq!(t.meta("nested_calls").as_deref(), Some("0"), "{variant:?}");
        if probes() == "jump" {
            let hows = mapping_probes(&t);
            let rdfsbase = memptrace::os::procfs::fsgsbase(std::process::id() as i32);
            if variant.glibc() && rdfsbase {
                assert!(hows.len() >= 6, "{variant:?}: {hows:?}");
                assert!(hows.iter().all(|(_, how)| how == "jump"), "{hows:?}");
            } else {
                assert_eq!(hows, [], "{variant:?}");
            }
        }
    }
}

/// Under `-f`, a child's mapping calls are its own process's.
#[test]
fn mapping_calls_of_a_forked_child() {
    let dir = scratch("mapping-f");
    let db = dir.join("trace.db");
    let program = tracee(Variant::Dynamic, "mapping");
    let out = run(
        memptrace()
            .arg("-o")
            .arg(&db)
            .args(["-f", "--", "sh", "-c"])
            .arg(format!("{}; true", program.display())),
        b"",
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let t = open_trace(&db, out);
    let child: i64 = t.int("SELECT pid FROM map_events WHERE op = 'mremap' GROUP BY pid");
    assert_ne!(
        child.to_string(),
        t.meta("pid").unwrap(),
        "the child's own pid"
    );
    check(&t, Variant::Dynamic);
}

/// Attached to a running process before it makes any of its mapping calls:
/// every one of them is recorded, the allocator's told apart, on every
/// build, in both probe modes. With jump probes (attach) mapping functions
/// get jump probes too, as `meta` says: no int3 that memptrace's death
/// would make fatal (see README, "memptrace's death").
#[test]
fn mapping_calls_while_attached() {
    for variant in VARIANTS {
        let mut target =
            Background::interactive(Command::new(tracee(variant, "mapping")).arg("wait"));
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let db = scratch("mapping-attach").join("trace.db");
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(&db),
        );
        wait_until("memptrace hooked the process", || {
            !trampoline_pages(pid).is_empty()
        });
        target.send("go\n");
        let end = target.finish();
        assert_eq!(end.code(), 0, "{variant:?}: {}", end.stderr);
        let out = tracer.finish();
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        let mut t = open_trace(&db, out);
        t.run.stdout = end.stdout;
        check(&t, variant);
        assert_eq!(big_allocs_through(&t), 8, "{variant:?}");
        if probes() == "jump" {
            assert_eq!(
                t.meta("on_memptrace_death").as_deref(),
                Some("runs on: the probes let calls through unrecorded"),
                "{variant:?}"
            );
            let hows = mapping_probes(&t);
            assert!(!hows.is_empty(), "{variant:?}");
            for (key, how) in hows {
                assert_eq!(how, "jump", "{variant:?}: {key}");
            }
        }
    }
}

/// The `meta` rows saying how each mapping function was hooked.
fn mapping_probes(t: &Trace) -> Vec<(String, String)> {
    let mut stmt =
        t.db.prepare(
            "SELECT key, value FROM meta WHERE key LIKE 'probe.%' AND (key LIKE '%:mmap'
             OR key LIKE '%:munmap' OR key LIKE '%:mremap' OR key LIKE '%:brk'
             OR key LIKE '%:sbrk' OR key LIKE '%:madvise' OR key LIKE '%:mprotect')",
        )
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// The runs of bytes of the program's code (every file-backed executable
/// mapping of process `pid`) that differ from its file: each run's address
/// and bytes in memory.
fn patched_text(pid: i32) -> Vec<(u64, Vec<u8>)> {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut runs = Vec::new();
    for line in maps.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() < 6 || w[1] != "r-xp" || !w[5].starts_with('/') {
            continue;
        }
        let (start, end) = w[0].split_once('-').unwrap();
        let start = u64::from_str_radix(start, 16).unwrap();
        let end = u64::from_str_radix(end, 16).unwrap();
        let offset = u64::from_str_radix(w[2], 16).unwrap();
        let file = std::fs::read(w[5]).unwrap();
        let mut here = vec![0u8; (end - start) as usize];
        mem.seek(SeekFrom::Start(start)).unwrap();
        mem.read_exact(&mut here).unwrap();
        let there = &file[offset as usize..];
        let mut run: Option<(u64, Vec<u8>)> = None;
        for (i, &b) in here.iter().enumerate() {
            // Past the file's end the mapping is zeros, as in memory.
            let want = there.get(i).copied().unwrap_or(0);
            match (&mut run, b != want) {
                (Some((_, bytes)), true) => bytes.push(b),
                (None, true) => run = Some((start + i as u64, vec![b])),
                (_, false) => runs.extend(run.take()),
            }
        }
        runs.extend(run);
    }
    runs
}

/// While attached with jump probes, the program's code holds jumps and no
/// int3 (a lone 0xcc where the file has another byte): memptrace's death
/// would harm nothing. After the detach its code is its file's again, byte
/// for byte, and no trampoline page is left; the program then makes its
/// mapping calls untraced and exits as it should.
#[test]
fn attach_leaves_no_int3_and_detach_restores_the_code() {
    for variant in VARIANTS {
        let mut target =
            Background::interactive(Command::new(tracee(variant, "mapping")).arg("wait"));
        let pid: i32 = target.wait_for("ready").parse().unwrap();
        let db = scratch("mapping-text").join("trace.db");
        let tracer = Background::start(
            memptrace()
                .args(["attach", &pid.to_string(), "-o"])
                .arg(&db),
        );
        wait_until("memptrace hooked the process", || {
            !trampoline_pages(pid).is_empty()
        });
        // Planted, and the code memptrace injects while attaching (a run
        // beginning with its `syscall`, 0f 05) gone: the attach is done.
        let jump = probes() == "jump";
        wait_until("memptrace planted its probes", || {
            let patched = patched_text(pid);
            let probe = patched.iter().any(|(_, bytes)| {
                if jump {
                    bytes.first() == Some(&0xe9)
                } else {
                    bytes == &[0xcc]
                }
            });
            let injected = patched
                .iter()
                .any(|(_, bytes)| bytes.starts_with(&[0x0f, 0x05]));
            probe && !injected
        });
        let patched = patched_text(pid);
        let int3s: Vec<u64> = patched
            .iter()
            .filter(|(_, bytes)| bytes == &[0xcc])
            .map(|&(at, _)| at)
            .collect();
        if jump {
            assert_eq!(int3s, Vec::<u64>::new(), "{variant:?}: {patched:x?}");
        } else {
            assert!(!int3s.is_empty(), "{variant:?}: {patched:x?}");
        }
        tracer.signal(libc::SIGINT);
        let out = tracer.finish();
        assert_eq!(out.code(), 0, "{variant:?}: {}", out.stderr);
        assert_eq!(patched_text(pid), Vec::new(), "{variant:?}");
        assert_eq!(trampoline_pages(pid), Vec::<String>::new(), "{variant:?}");
        target.send("go\n");
        let end = target.finish();
        assert_eq!(end.code(), 0, "{variant:?}: {}", end.stderr);
        assert_eq!(stated(&end.stdout).len(), 6, "{variant:?}: {}", end.stdout);
        let t = open_trace(&db, out);
        assert_eq!(t.int("SELECT count(*) FROM map_events"), 0, "{variant:?}");
    }
}
