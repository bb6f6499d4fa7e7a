//! The symbolizer on real files: C and C++ programs built here with the
//! system's gcc/g++ (with and without DWARF, stripped with a debug file beside
//! them or under a debug root, dwz-compressed), the system's libc, and this
//! test binary itself (Rust). Probes are found the way a trace finds them: the
//! return address of a call instruction, minus one.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Command;

use goblin::elf::{Elf, sym};
use iced_x86::{Decoder, DecoderOptions, Mnemonic};

use super::*;

mod dwz;

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";

/// A temporary directory, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("memptrace-symbolize-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(program: &str, args: &[&str], dir: &Path) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `source` to `dir/file` and builds `dir/output` from it.
pub(crate) fn build(
    dir: &TempDir,
    compiler: &str,
    file: &str,
    source: &str,
    flags: &[&str],
    output: &str,
) {
    std::fs::write(dir.path(file), source).unwrap();
    let mut args = flags.to_vec();
    args.extend(["-o", output, file]);
    run(compiler, &args, &dir.0);
}

/// The 1-based line of `source` that contains `marker`.
fn line_of(source: &str, marker: &str) -> u32 {
    let index = source.lines().position(|l| l.contains(marker)).unwrap();
    index as u32 + 1
}

/// The address range of function `name` (as the symbol table spells it).
fn function_range(binary: &Path, name: &str) -> Range<u64> {
    let bytes = std::fs::read(binary).unwrap();
    let elf = Elf::parse(&bytes).unwrap();
    let tables = [(&elf.syms, &elf.strtab), (&elf.dynsyms, &elf.dynstrtab)];
    for (syms, strtab) in tables {
        for s in syms.iter() {
            if s.st_type() == sym::STT_FUNC && strtab.get_at(s.st_name) == Some(name) {
                return s.st_value..s.st_value + s.st_size;
            }
        }
    }
    panic!("{name} not in {}", binary.display());
}

/// The probe a trace would make for the first call instruction in function
/// `name`: its return address minus one.
pub(crate) fn first_call_in(binary: &Path, name: &str) -> u64 {
    let range = function_range(binary, name);
    let bytes = std::fs::read(binary).unwrap();
    let elf = Elf::parse(&bytes).unwrap();
    let text = elf
        .section_headers
        .iter()
        .find(|sh| (sh.sh_addr..sh.sh_addr + sh.sh_size).contains(&range.start))
        .unwrap();
    let offset = (text.sh_offset + range.start - text.sh_addr) as usize;
    let code = &bytes[offset..offset + (range.end - range.start) as usize];
    let mut decoder = Decoder::with_ip(64, code, range.start, DecoderOptions::NONE);
    let call = decoder
        .iter()
        .find(|i| i.mnemonic() == Mnemonic::Call)
        .unwrap_or_else(|| panic!("no call in {name}"));
    call.next_ip() - 1
}

fn build_id_of(binary: &Path) -> String {
    let info = ObjectInfo::parse(&std::fs::read(binary).unwrap()).unwrap();
    info.build_id.unwrap()
}

fn file_name(line: &SourceLine) -> Option<&str> {
    Path::new(line.file.as_deref()?).file_name()?.to_str()
}

fn one(symbolizer: &mut Symbolizer, binary: &Path, probe: u64) -> Vec<SourceLine> {
    let mut lines = symbolizer.symbolize(binary, None, &[probe]);
    assert_eq!(lines.len(), 1);
    lines.remove(0)
}

pub(crate) const CHAIN_C: &str = include_str!("fixtures/chain.c");

/// `level_two`'s call to `level_three`: function, file and line.
fn assert_level_two(lines: &[SourceLine]) {
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0].function.as_deref(), Some("level_two"));
    assert_eq!(file_name(&lines[0]), Some("chain.c"));
    assert_eq!(lines[0].line, Some(line_of(CHAIN_C, "CALL level_three")));
}

#[test]
fn names_a_call_from_dwarf() {
    let dir = TempDir::new("dwarf");
    build(&dir, "gcc", "chain.c", CHAIN_C, &["-g", "-O1"], "chain");
    let binary = dir.path("chain");
    let probe = first_call_in(&binary, "level_two");
    let lines = one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe);
    assert_level_two(&lines);
    // DWARF's file name is a full path: the compilation directory joined.
    assert!(lines[0].file.as_deref().unwrap().starts_with('/'));
}

const INLINE_C: &str = include_str!("fixtures/inline.c");

#[test]
fn names_inlined_frames_innermost_first() {
    let dir = TempDir::new("inline");
    build(&dir, "gcc", "inline.c", INLINE_C, &["-g", "-O2"], "inline");
    let binary = dir.path("inline");
    let probe = first_call_in(&binary, "outer_fn");
    let lines = one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe);
    let functions: Vec<_> = lines.iter().map(|l| l.function.as_deref()).collect();
    assert_eq!(
        functions,
        [Some("inner_alloc"), Some("outer_fn")],
        "{lines:?}"
    );
    assert_eq!(lines[0].line, Some(line_of(INLINE_C, "CALL malloc")));
    assert_eq!(lines[1].line, Some(line_of(INLINE_C, "INLINE SITE")));
    assert_eq!(file_name(&lines[1]), Some("inline.c"));
}

const WIDGET_CPP: &str = include_str!("fixtures/widget.cpp");

#[test]
fn demangles_cpp_from_dwarf_and_symbol_table() {
    let dir = TempDir::new("cpp");
    build(
        &dir,
        "g++",
        "widget.cpp",
        WIDGET_CPP,
        &["-g", "-O0"],
        "widget",
    );
    build(
        &dir,
        "g++",
        "widget.cpp",
        WIDGET_CPP,
        &["-O0"],
        "widget-nodebug",
    );
    let mut symbolizer = Symbolizer::with_debug_roots(vec![]);

    let binary = dir.path("widget");
    let probe = first_call_in(&binary, "_ZN2ns6widget4growEi");
    let lines = one(&mut symbolizer, &binary, probe);
    let function = lines.last().unwrap().function.as_deref().unwrap();
    assert!(function.contains("ns::widget::grow"), "{lines:?}");
    assert_eq!(file_name(lines.last().unwrap()), Some("widget.cpp"));

    let binary = dir.path("widget-nodebug");
    let probe = first_call_in(&binary, "_ZN2ns6widget4growEi");
    let lines = one(&mut symbolizer, &binary, probe);
    assert_eq!(
        lines,
        [SourceLine {
            function: Some("ns::widget::grow(int)".into()),
            file: None,
            line: None
        }]
    );
}

#[test]
fn finds_a_debug_file_by_build_id() {
    let dir = TempDir::new("build-id");
    build(&dir, "gcc", "chain.c", CHAIN_C, &["-g", "-O1"], "chain");
    let binary = dir.path("chain");
    let probe = first_call_in(&binary, "level_two");
    run(
        "objcopy",
        &["--only-keep-debug", "chain", "chain.debug"],
        &dir.0,
    );
    run("strip", &["-s", "chain"], &dir.0);

    // Stripped and no debug root: nothing to name level_two with.
    let lines = one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe);
    assert_eq!(lines, []);

    let id = build_id_of(&binary);
    let root = dir.path("debug-root");
    let placed = root.join(".build-id").join(&id[..2]);
    std::fs::create_dir_all(&placed).unwrap();
    std::fs::rename(
        dir.path("chain.debug"),
        placed.join(format!("{}.debug", &id[2..])),
    )
    .unwrap();
    let lines = one(
        &mut Symbolizer::with_debug_roots(vec![root]),
        &binary,
        probe,
    );
    assert_level_two(&lines);
}

#[test]
fn finds_a_debug_file_by_debuglink_and_checks_its_crc() {
    let dir = TempDir::new("debuglink");
    build(&dir, "gcc", "chain.c", CHAIN_C, &["-g", "-O1"], "chain");
    let binary = dir.path("chain");
    let probe = first_call_in(&binary, "level_two");
    run(
        "objcopy",
        &["--only-keep-debug", "chain", "chain.debug"],
        &dir.0,
    );
    run("strip", &["-s", "chain"], &dir.0);
    run(
        "objcopy",
        &["--add-gnu-debuglink=chain.debug", "chain"],
        &dir.0,
    );
    assert_level_two(&one(
        &mut Symbolizer::with_debug_roots(vec![]),
        &binary,
        probe,
    ));

    // In the .debug subdirectory too.
    std::fs::create_dir(dir.path(".debug")).unwrap();
    std::fs::rename(dir.path("chain.debug"), dir.path(".debug/chain.debug")).unwrap();
    assert_level_two(&one(
        &mut Symbolizer::with_debug_roots(vec![]),
        &binary,
        probe,
    ));

    // A debug file whose CRC does not match the link is some other build's.
    let mut debug = std::fs::read(dir.path(".debug/chain.debug")).unwrap();
    debug.push(0);
    std::fs::write(dir.path(".debug/chain.debug"), debug).unwrap();
    assert_eq!(
        one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe),
        []
    );
}

#[test]
fn falls_back_to_the_symbol_table() {
    let dir = TempDir::new("symtab");
    build(&dir, "gcc", "chain.c", CHAIN_C, &["-O1"], "chain");
    let binary = dir.path("chain");
    let probe = first_call_in(&binary, "level_two");
    let lines = one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe);
    assert_eq!(
        lines,
        [SourceLine {
            function: Some("level_two".into()),
            file: None,
            line: None
        }]
    );
}

#[test]
fn names_nothing_in_what_is_not_an_image() {
    let dir = TempDir::new("garbage");
    std::fs::write(dir.path("script"), "#!/bin/sh\necho hi\n").unwrap();
    let libc = std::fs::read(LIBC).unwrap();
    std::fs::write(dir.path("truncated.so"), &libc[..4096]).unwrap();
    let probes = [0, 0x1000, u64::MAX];
    let mut symbolizer = Symbolizer::new();
    for path in [
        PathBuf::from("/nonexistent/memptrace/libfoo.so"),
        dir.path("script"),
        dir.path("truncated.so"),
        dir.0.clone(),
        PathBuf::from("/dev/zero"),
        PathBuf::from(""),
    ] {
        let names = symbolizer.symbolize(&path, Some("00ff"), &probes);
        assert_eq!(names, vec![Vec::new(); probes.len()], "{}", path.display());
        let names = symbolizer.symbolize(&path, None, &probes);
        assert_eq!(names, vec![Vec::new(); probes.len()], "{}", path.display());
    }
}

#[test]
fn names_libc_functions_by_their_public_alias() {
    let mut symbolizer = Symbolizer::with_debug_roots(vec![]);
    let libc = Path::new(LIBC);
    for (public, alias) in [
        ("malloc", "__libc_malloc"),
        ("free", "cfree"),
        ("open", "__open64"),
    ] {
        let range = function_range(libc, alias);
        assert_eq!(range, function_range(libc, public));
        let probe = range.start + (range.end - range.start) / 2;
        let lines = one(&mut symbolizer, libc, probe);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert_eq!(lines[0].function.as_deref(), Some(public));
    }
}

const ALIAS_C: &str = include_str!("fixtures/alias.c");

#[test]
fn dwarf_internal_names_give_way_to_public_aliases() {
    let dir = TempDir::new("alias");
    build(&dir, "gcc", "alias.c", ALIAS_C, &["-g", "-O1"], "alias");
    let binary = dir.path("alias");
    let probe = first_call_in(&binary, "__GI_make_buffer");
    let lines = one(&mut Symbolizer::with_debug_roots(vec![]), &binary, probe);
    assert_eq!(
        lines,
        [SourceLine {
            function: Some("make_buffer".into()),
            file: lines[0].file.clone(),
            line: Some(line_of(ALIAS_C, "CALL malloc")),
        }]
    );
    assert_eq!(file_name(&lines[0]), Some("alias.c"));
}

/// Debian's own debug package for libc, where it is installed: found by
/// build-id under /usr/lib/debug, compressed DWARF sections, internal names.
#[test]
fn names_libc_from_its_debug_package() {
    let libc = Path::new(LIBC);
    let id = build_id_of(libc);
    let debug = format!(
        "{DEFAULT_DEBUG_ROOT}/.build-id/{}/{}.debug",
        &id[..2],
        &id[2..]
    );
    assert!(
        Path::new(&debug).exists(),
        "{debug} is missing: install libc6-dbg (scripts/deps does)"
    );
    let probe = first_call_in(libc, "_IO_puts");
    let lines = one(&mut Symbolizer::new(), libc, probe);
    let outer = lines.last().unwrap();
    assert_eq!(outer.function.as_deref(), Some("puts"), "{lines:?}");
    assert_eq!(file_name(outer), Some("ioputs.c"));
    assert!(outer.line.is_some());
}

#[test]
fn a_replaced_file_is_not_used() {
    let libc = Path::new(LIBC);
    let probe = function_range(libc, "malloc").start;
    let mut symbolizer = Symbolizer::with_debug_roots(vec![]);
    let traced = build_id_of(libc);
    assert!(!one(&mut symbolizer, libc, probe).is_empty());
    let names = symbolizer.symbolize(libc, Some(&traced.to_uppercase()), &[probe]);
    assert!(!names[0].is_empty());
    let names = symbolizer.symbolize(libc, Some("0123456789abcdef"), &[probe]);
    assert_eq!(names, [[]]);
}

#[inline(never)]
fn rust_marker_function(n: u64) -> Vec<u64> {
    vec![n; n as usize % 7 + 1]
}

#[test]
fn names_rust_functions_without_hashes() {
    assert!(!rust_marker_function(std::hint::black_box(3)).is_empty());
    let exe = std::env::current_exe().unwrap();
    let bytes = std::fs::read(&exe).unwrap();
    let elf = Elf::parse(&bytes).unwrap();
    let marker = elf
        .syms
        .iter()
        .find(|s| {
            elf.strtab
                .get_at(s.st_name)
                .is_some_and(|n| n.contains("rust_marker_function"))
        })
        .expect("the marker function is in the test binary's symbol table");
    let lines = one(&mut Symbolizer::new(), &exe, marker.st_value + 1);
    let outer = lines.last().unwrap();
    assert_eq!(
        outer.function.as_deref(),
        Some("memptrace::symbols::symbolize::tests::rust_marker_function"),
        "{lines:?}"
    );
    assert_eq!(file_name(outer), Some("tests.rs"));
}

#[test]
fn demangles_every_kind_of_name() {
    let legacy = "_ZN4core3ptr85drop_in_place$LT$std..rt..lang_start$LT$$LP$$RP$$GT$..$u7b$$u7b$closure$u7d$$u7d$$GT$17h0123456789abcdefE";
    assert_eq!(
        demangle(legacy, None),
        "core::ptr::drop_in_place<std::rt::lang_start<()>::{{closure}}>"
    );
    assert_eq!(
        demangle("_RNvNtCs1234_7mycrate3foo3bar", None),
        "mycrate::foo::bar"
    );
    assert_eq!(
        demangle("_ZN2ns6widget4growEi", None),
        "ns::widget::grow(int)"
    );
    assert_eq!(
        demangle(
            "_ZN2ns6widget4growEd",
            Some(addr2line::gimli::DW_LANG_C_plus_plus_14)
        ),
        "ns::widget::grow(double)"
    );
    assert_eq!(demangle("malloc", None), "malloc");
    assert_eq!(
        demangle("main", Some(addr2line::gimli::DW_LANG_C11)),
        "main"
    );
    assert_eq!(demangle("_Znot a name", None), "_Znot a name");
    // C functions named like type codes keep their names, whatever the
    // unit's language says.
    for name in ["h", "i", "Pc", "f", "x", "St", "Dn", "Sa", "v"] {
        assert_eq!(demangle(name, None), name);
        for language in [
            addr2line::gimli::DW_LANG_C11,
            addr2line::gimli::DW_LANG_C_plus_plus_14,
            addr2line::gimli::DW_LANG_Rust,
        ] {
            assert_eq!(demangle(name, Some(language)), name);
        }
    }
}

/// Names cpp_demangle cannot parse whole (GCC's `sr` with template
/// arguments, gimli-rs/cpp_demangle#302) still come out readable: the
/// function's name, without return type and parameters.
#[test]
fn demangles_what_the_demangler_cannot_read_whole() {
    let make_shared = "_ZSt11make_sharedISt6vectorIdSaIdEEJRiEESt10shared_ptrINSt9enable_ifIXntsrSt8is_arrayIT_E5valueES7_E4typeEEDpOT0_";
    let want = "std::make_shared<std::vector<double, std::allocator<double> >, int&>";
    assert_eq!(demangle(make_shared, None), want);
    assert_eq!(
        demangle(make_shared, Some(addr2line::gimli::DW_LANG_C_plus_plus_14)),
        want
    );
    assert_eq!(
        demangle(
            "_ZN5FasTCmlIfNS_9Matrix4x4IfEEEENS_10MultSwitchIXsrNS_12VectorTraitsIT_EE11kVectorTypeEXsrNS4_IT0_EE11kVectorTypeES5_S7_E10ResultTypeERKS5_RKS7_",
            None
        ),
        "FasTC::operator*<float, FasTC::Matrix4x4<float> >"
    );
    // Garbage after _Z stays as it is.
    assert_eq!(demangle("_ZEEEE", None), "_ZEEEE");
}

/// Ten thousand addresses at once, as a trace's worth of unique addresses
/// comes: in libc (symbols only) and in this test binary (tens of megabytes
/// of DWARF), each named. How fast is the benchmarks' to say
/// (benches/, docs/performance.md), never a timed test's.
#[test]
fn symbolizes_ten_thousand_addresses() {
    let libc = Path::new(LIBC);
    let text = function_range(libc, "malloc");
    let start = text.start.saturating_sub(0x40000);
    let probes: Vec<u64> = (0..10_000u64).map(|i| start + i * 0x31).collect();
    let mut symbolizer = Symbolizer::with_debug_roots(vec![]);
    let names = symbolizer.symbolize(libc, None, &probes);
    assert_eq!(names.len(), probes.len());
    // Without its debug file, libc's symbols are the exported functions only:
    // about a quarter of its code.
    assert!(names.iter().filter(|n| !n.is_empty()).count() > 2_000);

    let exe = std::env::current_exe().unwrap();
    let code = text_range(&exe);
    let probes: Vec<u64> = (0..10_000u64)
        .map(|i| code.start + i * ((code.end - code.start) / 10_000))
        .collect();
    let names = symbolizer.symbolize(&exe, None, &probes);
    assert_eq!(names.len(), probes.len());
    assert!(names.iter().filter(|n| !n.is_empty()).count() > 9_000);
}

/// The `.text` section of `binary`.
fn text_range(binary: &Path) -> Range<u64> {
    let bytes = std::fs::read(binary).unwrap();
    let elf = Elf::parse(&bytes).unwrap();
    let text = elf
        .section_headers
        .iter()
        .find(|sh| elf.shdr_strtab.get_at(sh.sh_name) == Some(".text"))
        .unwrap();
    text.sh_addr..text.sh_addr + text.sh_size
}

/// What [`ObjectInfo::parse`] finds in the parts [`read_for_info`] reads
/// equals what it finds in the whole file: the test's own executable (with
/// DWARF), the C library, and the larger programs of this machine that are
/// there (stripped, with a debug link); at least two of them read sparsely.
#[test]
fn the_parts_read_for_names_say_what_the_whole_file_says() {
    use self::objinfo::read_for_info;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let libc = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("libc.so"))
        .map(PathBuf::from);
    let candidates = [std::env::current_exe().ok(), libc]
        .into_iter()
        .flatten()
        .chain(
            [
                "/usr/bin/perl",
                "/usr/bin/git",
                "/usr/bin/node",
                "/usr/bin/gdb",
            ]
            .map(PathBuf::from),
        )
        .filter(|p| p.exists());
    let mut sparse = 0;
    for path in candidates {
        let whole = std::fs::read(&path).unwrap();
        let parts = read_for_info(&path).unwrap();
        assert_eq!(parts.len(), whole.len());
        if parts != whole {
            sparse += 1;
        }
        let (a, b) = (ObjectInfo::parse(&whole), ObjectInfo::parse(&parts));
        assert!(a.is_some(), "{}", path.display());
        assert_eq!(format!("{a:?}"), format!("{b:?}"), "{}", path.display());
    }
    assert!(sparse >= 2, "{sparse}");
}
