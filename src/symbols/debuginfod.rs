//! Debug files from debuginfod servers, as gdb and elfutils' tools get them:
//! the last place the symbolizer looks for an image's DWARF, after the
//! build-id directories and `.gnu_debuglink` found nothing on disk.
//!
//! Only when `DEBUGINFOD_URLS` names a server; then elfutils' client library
//! ([`crate::os::debuginfod`], loaded with `dlopen`) does the download, by
//! elfutils' rules for the cache, timeouts and the rest, so that memptrace,
//! gdb and `debuginfod-find` share one cache. Lookups run on the naming
//! thread (or the end of the trace), never while the target waits.
//!
//! A lookup waits for a server to start sending at most
//! [`FIRST_BYTE_LIMIT`], unless `DEBUGINFOD_TIMEOUT` is set: elfutils' own
//! default (90 s an attempt, three attempts) would hold the end of a trace
//! four and a half minutes behind a server that takes connections and
//! never answers. A download under way is not cut (`DEBUGINFOD_MAXTIME`
//! does that).
//!
//! A server that cannot be reached costs one warning and no more: the first
//! failure other than "no server has it" ends the downloads of the run, and
//! later lookups read the client cache alone ([`cache_dir`]), so that what an
//! earlier run downloaded still names frames while the server is down. So
//! does a machine without the library. The warning is the session's to
//! give, with the trace's others ([`Debuginfod::warning`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::os::debuginfod::{Client, Library, SONAME};

/// How long a lookup waits for a server to start sending, retries
/// included, when `DEBUGINFOD_TIMEOUT` is not set.
pub const FIRST_BYTE_LIMIT: Duration = Duration::from_secs(10);

/// The servers of this run, shared by the threads that name frames: each
/// takes its own [`Fetcher`].
#[derive(Clone)]
pub struct Debuginfod {
    shared: Arc<Shared>,
}

struct Shared {
    /// `DEBUGINFOD_URLS`, for the warning.
    urls: String,
    /// `None` when it cannot be loaded.
    library: Option<&'static Library>,
    /// Where elfutils' client caches what it downloads.
    cache: Option<PathBuf>,
    /// [`FIRST_BYTE_LIMIT`], or `None` when `DEBUGINFOD_TIMEOUT` rules.
    first_byte: Option<Duration>,
    /// A server failed, or there is no library: no more downloads, the
    /// cache only.
    down: AtomicBool,
    /// Why, the first time.
    warning: Mutex<Option<String>>,
}

impl Shared {
    /// No more downloads, for `why` (the first reason is kept).
    fn give_up(&self, why: String) {
        if !self.down.swap(true, Ordering::Relaxed) {
            *self.warning.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        }
    }
}

impl Debuginfod {
    /// The servers `DEBUGINFOD_URLS` names, or `None` when it is unset or
    /// blank (the library is then not even loaded).
    pub fn from_env() -> Option<Debuginfod> {
        let urls = std::env::var("DEBUGINFOD_URLS").ok()?;
        if urls.trim().is_empty() {
            return None;
        }
        let library = Library::get();
        let shared = Shared {
            urls,
            library: library.as_ref().ok().copied(),
            cache: cache_dir(&|name| std::env::var_os(name).map(PathBuf::from)),
            first_byte: std::env::var_os("DEBUGINFOD_TIMEOUT")
                .is_none_or(|t| t.is_empty())
                .then_some(FIRST_BYTE_LIMIT),
            down: AtomicBool::new(false),
            warning: Mutex::new(None),
        };
        if let Err(why) = library {
            shared.give_up(format!(
                "DEBUGINFOD_URLS is set but {SONAME} cannot be loaded ({why}): no debug file was downloaded, the client cache was read (Debian: apt install libdebuginfod1)"
            ));
        }
        Some(Debuginfod {
            shared: Arc::new(shared),
        })
    }

    /// Why debug files stopped being downloaded, if they did: a warning
    /// for the end of the trace.
    pub fn warning(&self) -> Option<String> {
        self.shared
            .warning
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A fetcher for one thread (its client is made on first use).
    pub fn fetcher(&self) -> Fetcher {
        Fetcher {
            shared: self.shared.clone(),
            client: None,
        }
    }
}

/// One thread's way to the servers.
pub struct Fetcher {
    shared: Arc<Shared>,
    /// `None` until the first download; `Some(None)` when the library could
    /// not make a client.
    client: Option<Option<Client>>,
}

impl Fetcher {
    /// The path of the debug file of `build_id` in the client cache,
    /// downloaded when it is not there yet; `None` when no server has it or
    /// none can be reached. What a server sent is unchecked: the caller
    /// checks its build-id.
    pub fn debuginfo(&mut self, build_id: &str) -> Option<PathBuf> {
        let shared = &self.shared;
        let library = match shared.library {
            Some(library) if !shared.down.load(Ordering::Relaxed) => library,
            _ => return cached(shared.cache.as_deref()?, build_id),
        };
        let client = self.client.get_or_insert_with(|| library.client());
        let Some(client) = client.as_mut() else {
            shared.give_up(format!(
                "debuginfod: {SONAME} could not start a client: no debug file was downloaded after that, the client cache was read"
            ));
            return cached(shared.cache.as_deref()?, build_id);
        };
        match client.find_debuginfo(build_id, shared.first_byte) {
            Ok(path) => Some(path),
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => None,
            Err(err) => {
                shared.give_up(format!(
                    "debuginfod server {} failed ({}): no debug file was downloaded after that, the client cache was read",
                    shared.urls,
                    describe(&err)
                ));
                cached(shared.cache.as_deref()?, build_id)
            }
        }
    }
}

/// An errno's text, without Rust's "(os error N)".
fn describe(err: &std::io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// The cache directory of elfutils' debuginfod client (0.188,
/// `debuginfod-client.c`): `$DEBUGINFOD_CACHE_PATH`; else the legacy
/// `$HOME/.debuginfod_client_cache` when it exists; else
/// `$XDG_CACHE_HOME/debuginfod_client`, else `$HOME/.cache/debuginfod_client`.
/// `var` reads the environment.
pub fn cache_dir(var: &dyn Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.as_os_str().is_empty());
    if let Some(path) = set("DEBUGINFOD_CACHE_PATH") {
        return Some(path);
    }
    let home = set("HOME").unwrap_or_else(|| PathBuf::from("/"));
    let legacy = home.join(".debuginfod_client_cache");
    if legacy.is_dir() {
        return Some(legacy);
    }
    let base = set("XDG_CACHE_HOME").unwrap_or_else(|| home.join(".cache"));
    Some(base.join("debuginfod_client"))
}

/// `<cache>/<build-id>/debuginfo`, where the client keeps a download, when
/// it is there and not empty (an empty file records that no server had it).
fn cached(cache: &Path, build_id: &str) -> Option<PathBuf> {
    if build_id.is_empty() || !build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let path = cache.join(build_id.to_ascii_lowercase()).join("debuginfo");
    let meta = std::fs::metadata(&path).ok()?;
    (meta.is_file() && meta.len() > 0).then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<PathBuf> + 'a {
        move |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| PathBuf::from(v))
        }
    }

    #[test]
    fn cache_dir_follows_elfutils() {
        let home = "/nonexistent/memptrace-home";
        assert_eq!(
            cache_dir(&env(&[("DEBUGINFOD_CACHE_PATH", "/c"), ("HOME", home)])),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            cache_dir(&env(&[
                ("DEBUGINFOD_CACHE_PATH", ""),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", home)
            ])),
            Some(PathBuf::from("/x/debuginfod_client"))
        );
        assert_eq!(
            cache_dir(&env(&[("HOME", home)])),
            Some(PathBuf::from(
                "/nonexistent/memptrace-home/.cache/debuginfod_client"
            ))
        );
        assert_eq!(
            cache_dir(&env(&[])),
            Some(PathBuf::from("/.cache/debuginfod_client"))
        );
    }

    #[test]
    fn cached_files_only_when_there_and_not_empty() {
        let dir = std::env::temp_dir().join(format!("memptrace-dcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("abcd")).unwrap();
        std::fs::create_dir_all(dir.join("ef01")).unwrap();
        std::fs::write(dir.join("abcd/debuginfo"), b"\x7fELF").unwrap();
        std::fs::write(dir.join("ef01/debuginfo"), b"").unwrap();
        assert_eq!(cached(&dir, "ABCD"), Some(dir.join("abcd/debuginfo")));
        assert_eq!(cached(&dir, "ef01"), None);
        assert_eq!(cached(&dir, "2345"), None);
        assert_eq!(cached(&dir, "../abcd"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
