//! Source-level names for code addresses, found once per unique address (as
//! the trace runs: see the `namer` module).
//!
//! For each image the symbolizer looks for DWARF in the image itself, else in
//! a separate debug file (by build-id, then by `.gnu_debuglink`: see
//! `debug_file`; last, when `DEBUGINFOD_URLS` is set, from a debuginfod
//! server: [`crate::symbols::debuginfod`]), together with the `dwz`
//! supplementary file that `.gnu_debugaltlink` names (found the same ways). addr2line reads that DWARF, inlined frames
//! included. Where DWARF names no function, the symbol tables of the image and
//! its debug file do (`symtab`); where DWARF names a function by an internal
//! alias (glibc's `__GI__IO_puts`, `__libc_malloc`), the public alias is shown,
//! so that a frame reads the same with or without a debug package. C++ and
//! Rust names are demangled on every path.
//!
//! It must never fail the trace: a file that is missing, replaced since the
//! trace, unreadable or malformed yields fewer names, never an error. The
//! parsers are third-party code fed whatever file the target mapped, so each
//! image load and each lookup also runs under `catch_unwind`: a parser's panic
//! costs that image's or that address's names, not the trace.

pub(crate) mod debug_file;
mod objinfo;
mod symtab;
#[cfg(test)]
pub(crate) mod tests;

use std::borrow::Cow;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use addr2line::Loader;
use addr2line::gimli::DwLang;

use self::debug_file::same_build;
pub use self::objinfo::DebugLink;
pub(crate) use self::objinfo::parse_debuglink;
use self::objinfo::{AltLink, ObjectInfo, read_for_info};
use self::symtab::SymbolIndex;
use super::debuginfod::{Debuginfod, Fetcher};

/// A source location of a frame. One frame can have several: the function whose
/// code it is (index 0, possibly inlined) and the functions it was inlined into.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceLine {
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
}

/// Where Debian's `-dbgsym` and `-dbg` packages put debug files.
pub const DEFAULT_DEBUG_ROOT: &str = "/usr/lib/debug";

/// Names addresses of ELF images; keeps each image's debug data loaded while
/// it lives, so that each file is read once.
pub struct Symbolizer {
    debug_roots: Vec<PathBuf>,
    debuginfod: Option<Fetcher>,
    images: HashMap<(PathBuf, Option<String>), ImageDebug>,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Symbolizer::new()
    }
}

impl Symbolizer {
    /// A symbolizer that looks for separate debug files under
    /// [`DEFAULT_DEBUG_ROOT`].
    pub fn new() -> Symbolizer {
        Symbolizer::with_debug_roots(vec![PathBuf::from(DEFAULT_DEBUG_ROOT)])
    }

    /// A symbolizer that looks for separate debug files under `debug_roots`
    /// (each laid out like `/usr/lib/debug`), in order.
    pub fn with_debug_roots(debug_roots: Vec<PathBuf>) -> Symbolizer {
        Symbolizer {
            debug_roots,
            debuginfod: None,
            images: HashMap::new(),
        }
    }

    /// Also ask `servers` (when some) for the debug files found nowhere
    /// on disk.
    pub fn with_debuginfod(mut self, servers: Option<&Debuginfod>) -> Symbolizer {
        self.debuginfod = servers.map(Debuginfod::fetcher);
        self
    }

    /// The source lines of each probe (an SVMA of `path`), innermost first:
    /// the function the probe is in, with the probe's file and line; then each
    /// function that code was inlined into, with the file and line of the
    /// inlined call; the last is the function the code really belongs to. An
    /// empty list where nothing is known.
    ///
    /// `build_id` is the image's as seen during the trace: a file at `path`
    /// with another build-id (a library upgraded since) is not used, but a
    /// debug file with the right build-id still is.
    pub fn symbolize(
        &mut self,
        path: &Path,
        build_id: Option<&str>,
        probes: &[u64],
    ) -> Vec<Vec<SourceLine>> {
        let key = (path.to_path_buf(), build_id.map(str::to_ascii_lowercase));
        let roots = &self.debug_roots;
        let remote = self.debuginfod.as_mut();
        let image = self
            .images
            .entry(key)
            .or_insert_with(|| ImageDebug::load(path, build_id, roots, remote));
        probes.iter().map(|&probe| image.lookup(probe)).collect()
    }
}

/// Everything known about one image's code.
#[derive(Default)]
struct ImageDebug {
    dwarf: Option<Loader>,
    symbols: SymbolIndex,
}

impl ImageDebug {
    fn load(
        path: &Path,
        build_id: Option<&str>,
        roots: &[PathBuf],
        remote: Option<&mut Fetcher>,
    ) -> ImageDebug {
        catch_unwind(AssertUnwindSafe(|| {
            ImageDebug::try_load(path, build_id, roots, remote)
        }))
        .unwrap_or_default()
    }

    fn try_load(
        path: &Path,
        build_id: Option<&str>,
        roots: &[PathBuf],
        mut remote: Option<&mut Fetcher>,
    ) -> ImageDebug {
        let image = read_for_info(path)
            .and_then(|bytes| ObjectInfo::parse(&bytes))
            .filter(|info| same_build(info.build_id.as_deref(), build_id));
        let build_id = build_id
            .map(str::to_owned)
            .or_else(|| image.as_ref()?.build_id.clone());

        let mut symbols = Vec::new();
        let mut dwarf_file = None;
        let mut debuglink = None;
        if let Some(info) = image {
            if info.has_dwarf {
                dwarf_file = Some((path.to_path_buf(), info.altlink));
            }
            debuglink = info.debuglink;
            symbols = info.symbols;
        }
        if dwarf_file.is_none() {
            let debug = debug_file::find(path, build_id.as_deref(), debuglink.as_ref(), roots)
                .or_else(|| debug_file::from_server(remote.as_deref_mut()?, build_id.as_deref()?));
            if let Some(debug) = debug {
                // `objcopy --only-keep-debug` keeps .symtab: the stripped
                // image's missing symbols are here.
                symbols.extend(debug.info.symbols);
                if debug.info.has_dwarf {
                    dwarf_file = Some((debug.path, debug.info.altlink));
                }
            }
        }
        ImageDebug {
            dwarf: dwarf_file
                .and_then(|(file, alt)| load_dwarf(&file, alt.as_ref(), roots, remote)),
            symbols: SymbolIndex::new(symbols),
        }
    }

    fn lookup(&self, probe: u64) -> Vec<SourceLine> {
        catch_unwind(AssertUnwindSafe(|| self.try_lookup(probe))).unwrap_or_default()
    }

    fn try_lookup(&self, probe: u64) -> Vec<SourceLine> {
        let (mut lines, outer_name) = self.dwarf_lines(probe);
        if let (Some(name), Some(line)) = (outer_name, lines.last_mut()) {
            if let Some(alias) = self.symbols.public_alias(probe, &name) {
                line.function = Some(demangle(&alias.name, None));
            }
        }
        if lines.last().is_none_or(|line| line.function.is_none()) {
            if let Some(symbol) = self.symbols.find(probe) {
                let function = Some(demangle(&symbol.name, None));
                match lines.last_mut() {
                    Some(line) => line.function = function,
                    None => lines.push(SourceLine {
                        function,
                        file: None,
                        line: None,
                    }),
                }
            }
        }
        if lines.iter().all(|l| l == &SourceLine::default()) {
            lines.clear();
        }
        lines
    }

    /// The probe's frames from DWARF, innermost first, and the outermost
    /// function's name as DWARF spells it (mangled); only the probe's file and
    /// line when the function DIEs cannot be read.
    fn dwarf_lines(&self, probe: u64) -> (Vec<SourceLine>, Option<String>) {
        let Some(loader) = &self.dwarf else {
            return (Vec::new(), None);
        };
        let frames = (|| {
            let mut frames = loader.find_frames(probe).ok()?;
            let mut lines = Vec::new();
            let mut outer_name = None;
            while let Some(frame) = frames.next().ok()? {
                let location = frame.location.as_ref();
                let name = frame.function.as_ref().and_then(|f| {
                    let raw = f.raw_name().ok()?;
                    Some((demangle(&raw, f.language), raw.into_owned()))
                });
                let (function, raw) = name.unzip();
                outer_name = raw;
                lines.push(SourceLine {
                    function,
                    file: location.and_then(|l| l.file).map(str::to_owned),
                    line: location.and_then(|l| l.line),
                });
            }
            Some((lines, outer_name))
        })();
        frames.unwrap_or_else(|| match loader.find_location(probe) {
            Ok(Some(location)) => (
                vec![SourceLine {
                    function: None,
                    file: location.file.map(str::to_owned),
                    line: location.line,
                }],
                None,
            ),
            _ => (Vec::new(), None),
        })
    }
}

/// addr2line's loader for the DWARF in `file`, with its supplementary file
/// when one is linked and found, on disk or from a debuginfod server
/// (without it, names that dwz moved there are missing, the rest still
/// works).
fn load_dwarf(
    file: &Path,
    alt: Option<&AltLink>,
    roots: &[PathBuf],
    remote: Option<&mut Fetcher>,
) -> Option<Loader> {
    let sup = alt.and_then(|link| {
        debug_file::supplementary(file, link, roots).or_else(|| {
            let debug = debug_file::from_server(remote?, &link.build_id)?;
            debug.info.has_dwarf.then_some(debug.path)
        })
    });
    if let Some(sup) = sup {
        if let Ok(loader) = Loader::new_with_sup(file, Some(sup)) {
            return Some(loader);
        }
    }
    Loader::new(file).ok()
}

/// A C++ or Rust name as a programmer writes it (Rust's legacy `::h0123…`
/// hash dropped); any other name as it is. `language` is the compilation
/// unit's, when DWARF says; a name it cannot demangle is tried by its prefix.
/// A C++ name the demangler cannot read whole is named without its return
/// type and parameters (`cpp_name_only`) rather than left mangled.
///
/// Only a mangled name (`_Z...`, `_R...`) is demangled: the demanglers also
/// read a bare type code, so a C function named `h`, `Pc` or `St` (even in
/// a C++ unit, `extern "C"`) would otherwise become `unsigned char`,
/// `char*` or `std`.
pub fn demangle(name: &str, language: Option<DwLang>) -> String {
    if !(name.starts_with("_Z") || name.starts_with("_R")) {
        return name.to_string();
    }
    let text = language
        .and_then(|language| addr2line::demangle(name, language))
        .unwrap_or_else(|| addr2line::demangle_auto(Cow::Borrowed(name), None).into_owned());
    if text == name && name.starts_with("_Z") {
        if let Some(text) = cpp_name_only(name) {
            return text;
        }
    }
    text
}

/// Cut points tried by [`cpp_name_only`], at most: the work stays linear in
/// practice however long a name a template library makes.
const MAX_CUTS: usize = 64;

/// The name of a mangled C++ function that cpp_demangle cannot parse whole.
/// It fails on some of GCC's manglings (an `sr` scope in a template argument
/// of a SFINAE return type, as in `std::make_shared<T>`'s
/// `_ZSt11make_sharedI...EESt10shared_ptrINSt9enable_ifIXntsrSt8is_array...`;
/// gimli-rs/cpp_demangle#302), and on names nested deeper than its default
/// recursion limit. First the whole name with a higher limit; then the
/// function's name alone: a function's name ends with an `E` (of its nested
/// name or template arguments), so each prefix up to an `E`, longest first,
/// is completed with a `void` signature and parsed, and printed without
/// return type and parameters. The name part is parsed the same whatever
/// follows it, so any prefix that parses gives the same name.
fn cpp_name_only(mangled: &str) -> Option<String> {
    use cpp_demangle::{DemangleOptions, ParseOptions, Symbol};
    let deep = ParseOptions::default().recursion_limit(1024);
    if let Ok(text) = Symbol::new_with_options(mangled, &deep).map(|s| s.demangle()) {
        return text.ok();
    }
    let name_only = DemangleOptions::new().no_params().no_return_type();
    let cuts = mangled
        .char_indices()
        .rev()
        .filter(|&(_, c)| c == 'E')
        .take(MAX_CUTS);
    for (at, _) in cuts {
        // A template function's signature has a return type: `vv`.
        for signature in ["v", "vv"] {
            let candidate = format!("{}{signature}", &mangled[..=at]);
            if let Ok(Ok(text)) = Symbol::new_with_options(candidate.as_str(), &deep)
                .map(|s| s.demangle_with_options(&name_only))
            {
                return Some(text);
            }
        }
    }
    None
}
