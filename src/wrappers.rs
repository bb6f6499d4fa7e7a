//! The allocator's wrappers: frames that allocate on behalf of their caller.
//!
//! "Who calls the allocator" is answered by the first frame of a stack,
//! innermost first, that is not part of the allocator (the *call site*).
//! A frame is part of the allocator when
//! - its module is the allocator's own library: a C library (`libc.so.6`,
//!   `libc-2.*.so`, musl's `ld-musl-*.so.1` / `libc.musl-*.so.1`) or a malloc
//!   replacement (`libjemalloc`, `libtcmalloc*`, `libmimalloc`), recognised
//!   by file name, since a trace can be read where the program's files are
//!   not; so `strdup`, `fopen` or `printf` allocating for a caller charge the
//!   caller; or
//! - its function (the one whose machine code holds the call) is a wrapper:
//!   one of [`BUILTIN`], or matches a regular expression the user gave
//!   (`--wrapper`, searched in the demangled name: `^xmalloc$`).
//!
//! A static executable has the C library linked in, so its module says
//! nothing: there a frame is the C library's, as one of `libc.so.6` is,
//! when its function is one of the C library's ([`CLIB_FUNCTIONS`]: every
//! function of glibc's and musl's `libc.a` and `crt1.o`) and it has no
//! source line (those archives carry no debug information; the program's
//! own code built with `-g` does). So `puts` allocating its stdout buffer
//! is charged to the function that called `puts`, static or dynamic.
//!
//! Inlined lines of a frame are wrappers by the same names (a C++
//! `std::__new_allocator<T>::allocate` inlined into the caller's code): they
//! do not make the frame a wrapper, since the frame's code is the caller's,
//! but a report need not show them.
//!
//! The trace marks frames once, when it names them (`frames.wrapper`); a
//! report applies the same rule to the names it reads, with the regular
//! expressions given to the trace (`meta` rows `wrapper.N`) and its own.

use std::collections::HashSet;
use std::sync::OnceLock;

use regex::RegexSet;

/// The functions of Debian's static C libraries, one name a line (`#`
/// lines are comments), made by `scripts/signatures`.
pub const CLIB_FUNCTIONS: &str = include_str!("symbols/signatures/clib.names");

/// True when `function` is one of [`CLIB_FUNCTIONS`], or a part of one that
/// the compiler split off (`_IO_new_file_overflow.cold`).
pub fn is_c_library_function(function: &str) -> bool {
    static NAMES: OnceLock<HashSet<&'static str>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        CLIB_FUNCTIONS
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect()
    });
    names.contains(function)
        || function
            .split_once('.')
            .is_some_and(|(base, _)| names.contains(base))
}

/// Names of the allocator's entry points and wrappers, as regular
/// expressions over demangled names. Anchored: `operator new` matches
/// `operator new(unsigned long)` but `std::vector<...>` does not match the
/// `std::allocator` of its template arguments.
pub const BUILTIN: &[&str] = &[
    // The hooked functions (a static binary's allocator calls them itself)
    // and glibc's internal names for them.
    r"^(malloc|calloc|realloc|free|posix_memalign|aligned_alloc|memalign|valloc|pvalloc|reallocarray)$",
    r"^__libc_(malloc|calloc|realloc|free|memalign|valloc|pvalloc|reallocarray)$",
    r"^(__posix_memalign|_int_malloc|_int_realloc|_int_memalign|_mid_memalign)$",
    // C++: operator new/new[]/delete/delete[], with their nothrow, aligned
    // (std::align_val_t) and sized forms.
    r"^operator (new|delete)(\[\])? ?\(",
    // The standard allocators' code, usually inlined into the caller:
    // libstdc++ (std::__new_allocator, older __gnu_cxx::new_allocator,
    // std::allocator, std::allocator_traits, make_shared's
    // std::__allocate_guarded) and libc++ (std::__1::...).
    r"^([^(<]* )?(std::(__1::)?|__gnu_cxx::)(__new_allocator|new_allocator|allocator|allocator_traits|__allocate_guarded\w*|__allocated_ptr|__libcpp_allocate|__libcpp_deallocate|__libcpp_operator_new|__libcpp_operator_delete)\b",
    // Rust: the global allocator's shims, std's System allocator, and the
    // allocation layer of Vec (RawVec: finish_grow and friends, shared by
    // every Vec, so it says nothing about the caller).
    r"^(__rustc::)?__rust_(alloc|alloc_zeroed|realloc|dealloc)$",
    r"^(__rustc::)?(__rdl_|__rg_)",
    r"^alloc::alloc::",
    r"^<alloc::alloc::Global as core::alloc::",
    r"^<std::alloc::System as core::alloc::",
    r"^std::sys::(pal::\w+::)?alloc::",
    r"^alloc::raw_vec::",
    r"^<alloc::raw_vec::",
];

/// The C libraries and malloc replacements whose frames are the allocator's.
pub fn is_allocator_library(file_name: &str) -> bool {
    const PREFIXES: [&str; 8] = [
        "libc.so",
        "libc-2.",
        "ld-musl-",
        "libc.musl-",
        "libjemalloc.so",
        "libtcmalloc",
        "libmimalloc.so",
        "libmimalloc-",
    ];
    PREFIXES.iter().any(|p| file_name.starts_with(p))
}

/// The built-in wrappers and the user's.
#[derive(Clone, Debug)]
pub struct Wrappers {
    set: RegexSet,
    /// The user's expressions, as given.
    extra: Vec<String>,
}

impl Wrappers {
    /// The built-in list, extended by `extra` (the user's `--wrapper`
    /// expressions). Fails on an expression that is not one.
    pub fn new(extra: &[String]) -> Result<Wrappers, regex::Error> {
        for e in extra {
            // Checked one by one, to name the bad one.
            regex::Regex::new(e)?;
        }
        let set = RegexSet::new(
            BUILTIN
                .iter()
                .copied()
                .chain(extra.iter().map(String::as_str)),
        )?;
        Ok(Wrappers {
            set,
            extra: extra.to_vec(),
        })
    }

    /// The built-in list alone.
    pub fn builtin() -> Wrappers {
        Wrappers::new(&[]).expect("the built-in expressions compile")
    }

    /// The user's expressions.
    pub fn extra(&self) -> &[String] {
        &self.extra
    }

    /// True when `function` (demangled) is one of the allocator's wrappers.
    pub fn is_wrapper(&self, function: &str) -> bool {
        self.set.is_match(function)
    }

    /// True when a frame is part of the allocator: its module (file name) is
    /// the allocator's library, or its function is a wrapper.
    pub fn is_allocator_frame(&self, module: Option<&str>, function: Option<&str>) -> bool {
        module.is_some_and(is_allocator_library) || function.is_some_and(|f| self.is_wrapper(f))
    }

    /// The same for a frame of a static executable, whose C library is in
    /// the module: also when its function is the C library's and it has
    /// no source file (`file`, of the function whose code holds the call).
    pub fn is_allocator_frame_of_static(
        &self,
        module: Option<&str>,
        function: Option<&str>,
        file: Option<&str>,
    ) -> bool {
        self.is_allocator_frame(module, function)
            || (file.is_none() && function.is_some_and(is_c_library_function))
    }
}

/// A `--wrapper` value that is not a regular expression. clap prints the
/// message alone, so it carries the regex crate's words.
#[derive(Debug, thiserror::Error)]
#[error("not a regular expression: {0}")]
pub struct NotARegex(regex::Error);

/// `--wrapper` values: each must be a regular expression.
pub fn check(expression: &str) -> Result<String, NotARegex> {
    regex::Regex::new(expression)
        .map(|_| expression.to_string())
        .map_err(NotARegex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_says_why_a_wrapper_is_not_a_regular_expression() {
        let text = check("my_alloc(").unwrap_err().to_string();
        assert!(
            text.starts_with("not a regular expression: regex parse error:"),
            "{text}"
        );
    }

    #[test]
    fn allocator_libraries_by_name() {
        for lib in [
            "libc.so.6",
            "libc-2.31.so",
            "ld-musl-x86_64.so.1",
            "libjemalloc.so.2",
            "libtcmalloc_minimal.so.4",
        ] {
            assert!(is_allocator_library(lib), "{lib}");
        }
        for other in [
            "libcrypto.so.3",
            "ld-linux-x86-64.so.2",
            "sqlite3",
            "libstdc++.so.6",
        ] {
            assert!(!is_allocator_library(other), "{other}");
        }
    }

    #[test]
    fn builtin_wrappers() {
        let w = Wrappers::builtin();
        for f in [
            "malloc",
            "posix_memalign",
            "__libc_malloc",
            "operator new(unsigned long)",
            "operator new[](unsigned long)",
            "operator new(unsigned long, std::nothrow_t const&)",
            "operator new[](unsigned long, std::align_val_t, std::nothrow_t const&)",
            "operator delete(void*, unsigned long)",
            "operator delete[](void*)",
            "std::__new_allocator<int>::allocate(unsigned long, void const*)",
            "__gnu_cxx::new_allocator<int>::allocate(unsigned long, void const*)",
            "std::allocator<int>::allocate(unsigned long)",
            "std::allocator_traits<std::allocator<int> >::allocate(std::allocator<int>&, unsigned long)",
            "std::__allocated_ptr<std::allocator<std::_Sp_counted_ptr_inplace<int, std::allocator<int>, (__gnu_cxx::_Lock_policy)2> > > std::__allocate_guarded<std::allocator<std::_Sp_counted_ptr_inplace<int, std::allocator<int>, (__gnu_cxx::_Lock_policy)2> > >(std::allocator<std::_Sp_counted_ptr_inplace<int, std::allocator<int>, (__gnu_cxx::_Lock_policy)2> >&)",
            "std::__1::allocator<int>::allocate[abi:ne180100](unsigned long)",
            "__rust_alloc",
            "__rustc::__rust_realloc",
            "__rdl_alloc",
            "alloc::alloc::exchange_malloc",
            "<alloc::alloc::Global as core::alloc::Allocator>::allocate",
            "alloc::raw_vec::finish_grow",
        ] {
            assert!(w.is_wrapper(f), "{f}");
        }
        for other in [
            "strdup",
            "main",
            "malloc_consolidate_user",
            "new_node",
            "operator<<(std::ostream&, int)",
            "std::vector<int, std::allocator<int> >::push_back(int const&)",
            "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int const&)",
            "shapes::make_widget(int)",
            "xmalloc",
        ] {
            assert!(!w.is_wrapper(other), "{other}");
        }
    }

    #[test]
    fn user_wrappers_extend_the_list() {
        let w = Wrappers::new(&["^xmalloc$".into(), "^g_malloc".into()]).unwrap();
        assert!(w.is_wrapper("xmalloc") && w.is_wrapper("g_malloc0"));
        assert!(!w.is_wrapper("xmalloc_stats") && w.is_wrapper("operator new(unsigned long)"));
        assert_eq!(w.extra(), ["^xmalloc$", "^g_malloc"]);
        assert!(Wrappers::new(&["(".into()]).is_err());
        assert!(check("(").is_err());
        assert_eq!(check("^x$").ok().as_deref(), Some("^x$"));
        assert!(w.is_allocator_frame(Some("libc.so.6"), Some("strdup")));
        assert!(w.is_allocator_frame(None, Some("xmalloc")));
        assert!(!w.is_allocator_frame(Some("app"), Some("main")));
        assert!(!w.is_allocator_frame(None, None));
    }

    #[test]
    fn c_library_functions_in_a_static_executable() {
        let w = Wrappers::builtin();
        // glibc's stdio, its start-up, musl's, and crt1.o's _start.
        for f in [
            "puts",
            "_IO_file_doallocate",
            "_IO_new_file_overflow",
            "_IO_new_file_overflow.cold",
            "__libc_start_call_main",
            "__fdopen",
            "_start",
        ] {
            assert!(is_c_library_function(f), "{f}");
            assert!(
                w.is_allocator_frame_of_static(Some("prog"), Some(f), None),
                "{f}"
            );
            // Not outside a static executable: libc.so's own are known by
            // their module, and a program's function of that name is its.
            assert!(!w.is_allocator_frame(Some("prog"), Some(f)), "{f}");
        }
        // The program's own code, with its source lines, is never the C
        // library's, whatever its name.
        assert!(!w.is_allocator_frame_of_static(Some("prog"), Some("puts"), Some("p.c")));
        for f in ["main", "leak_small", "say_hello", "", "#"] {
            assert!(!is_c_library_function(f), "{f}");
            assert!(
                !w.is_allocator_frame_of_static(Some("prog"), Some(f), None),
                "{f}"
            );
        }
        assert!(!w.is_allocator_frame_of_static(Some("prog"), None, None));
    }
}
