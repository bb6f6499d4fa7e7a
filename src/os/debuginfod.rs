//! elfutils' debuginfod client library, loaded with `dlopen` as elfutils'
//! own libdw loads it (`debuginfod-client.c`): memptrace neither links it nor
//! needs it installed; without it, debug files are simply not downloaded.
//!
//! The library does everything by elfutils' conventions, which users of gdb
//! and `debuginfod-find` already configured: the servers in
//! `DEBUGINFOD_URLS`, the cache (`DEBUGINFOD_CACHE_PATH`, else
//! `$XDG_CACHE_HOME/debuginfod_client`, else `~/.cache/debuginfod_client`),
//! looked at before any server and cleaned by its own rules, negative
//! caching of files no server has, `DEBUGINFOD_TIMEOUT`, `DEBUGINFOD_MAXTIME`,
//! `DEBUGINFOD_MAXSIZE`, `.netrc` and `DEBUGINFOD_HEADERS_FILE`
//! (debuginfod-find(1), "Environment variables").
//!
//! The library is never closed: libcurl, which it starts in a constructor,
//! does not expect to be unloaded.

use std::cell::Cell;
use std::ffi::{CStr, CString, OsStr, c_void};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libc::{c_char, c_int, c_long};

/// The soname elfutils' libdw opens (Debian: package `libdebuginfod1`).
pub const SONAME: &str = "libdebuginfod.so.1";

/// `debuginfod.h`: `debuginfod_client *debuginfod_begin (void)`.
type Begin = unsafe extern "C" fn() -> *mut c_void;
/// `debuginfod.h`: `void debuginfod_end (debuginfod_client *)`.
type End = unsafe extern "C" fn(*mut c_void);
/// `debuginfod.h`: `int debuginfod_find_debuginfo (debuginfod_client *,
/// const unsigned char *build_id, int build_id_len, char **path)`: a file
/// descriptor on the cached file, or a negative errno.
type FindDebuginfo = unsafe extern "C" fn(*mut c_void, *const u8, c_int, *mut *mut c_char) -> c_int;
/// `debuginfod.h`: `int (*debuginfod_progressfn_t) (debuginfod_client *,
/// long a, long b)`: called now and then while a lookup waits or
/// downloads; a non-zero return cancels it. `b` is the size of the file a
/// server has started to send, 0 until one does (elfutils 0.188: `a`
/// counts loops until then, bytes after).
type ProgressFn = unsafe extern "C" fn(*mut c_void, c_long, c_long) -> c_int;
/// `debuginfod.h`: `void debuginfod_set_progressfn (debuginfod_client *,
/// debuginfod_progressfn_t)`.
type SetProgressFn = unsafe extern "C" fn(*mut c_void, Option<ProgressFn>);

/// Why the library could not be loaded (`dlerror`'s words).
#[derive(Clone, Debug, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(String);

/// The loaded library: the functions memptrace calls.
pub struct Library {
    begin: Begin,
    end: End,
    find_debuginfo: FindDebuginfo,
    set_progressfn: SetProgressFn,
}

impl Library {
    /// The library, loaded on the first call; the error says why it could
    /// not be (`dlerror`).
    pub fn get() -> Result<&'static Library, LoadError> {
        static LIBRARY: OnceLock<Result<Library, LoadError>> = OnceLock::new();
        LIBRARY
            .get_or_init(Library::open)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open() -> Result<Library, LoadError> {
        let name = CString::new(SONAME).map_err(|e| LoadError(e.to_string()))?;
        // SAFETY: `name` is a NUL-terminated string; dlopen has no other
        // precondition. The handle is never closed (see the module docs).
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dl_error());
        }
        let symbol = |name: &CStr| {
            // SAFETY: `handle` is a live handle from dlopen and `name` a
            // NUL-terminated string.
            let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
            NonNull::new(address).ok_or_else(dl_error)
        };
        let begin = symbol(c"debuginfod_begin")?;
        let end = symbol(c"debuginfod_end")?;
        let find_debuginfo = symbol(c"debuginfod_find_debuginfo")?;
        let set_progressfn = symbol(c"debuginfod_set_progressfn")?;
        // SAFETY: these symbols of libdebuginfod.so.1 have had these C
        // signatures since the library's first release (elfutils 0.178,
        // `debuginfod.h`); a function pointer and a data pointer have the
        // same size and representation on x86-64 Linux.
        unsafe {
            Ok(Library {
                begin: std::mem::transmute::<*mut c_void, Begin>(begin.as_ptr()),
                end: std::mem::transmute::<*mut c_void, End>(end.as_ptr()),
                find_debuginfo: std::mem::transmute::<*mut c_void, FindDebuginfo>(
                    find_debuginfo.as_ptr(),
                ),
                set_progressfn: std::mem::transmute::<*mut c_void, SetProgressFn>(
                    set_progressfn.as_ptr(),
                ),
            })
        }
    }

    /// A new client (one per thread: a client is not to be used by two
    /// threads at once), or `None` when the library cannot make one.
    pub fn client(&'static self) -> Option<Client> {
        // SAFETY: debuginfod_begin takes no argument; it returns NULL on
        // failure, checked here.
        let raw = NonNull::new(unsafe { (self.begin)() })?;
        // SAFETY: `raw` is a live client; `progress` has the C signature
        // the library calls, and never unwinds.
        unsafe { (self.set_progressfn)(raw.as_ptr(), Some(progress)) };
        Some(Client { library: self, raw })
    }
}

thread_local! {
    /// When this thread's lookup must have a server sending, if it has a
    /// limit.
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
    /// This thread's lookup was cancelled at its deadline.
    static CANCELLED: Cell<bool> = const { Cell::new(false) };
}

/// The progress function of every client: cancels a lookup that no server
/// has started to send by its thread's deadline
/// ([`Client::find_debuginfo`]). The library calls it on the thread that
/// asked.
extern "C" fn progress(_client: *mut c_void, _a: c_long, size: c_long) -> c_int {
    match DEADLINE.with(Cell::get) {
        Some(deadline) if size <= 0 && Instant::now() > deadline => {
            CANCELLED.with(|c| c.set(true));
            1
        }
        _ => 0,
    }
}

/// The last `dlerror` message.
fn dl_error() -> LoadError {
    // SAFETY: dlerror returns NULL or a NUL-terminated string that stays
    // valid until the next dl* call of this thread; it is copied at once.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return LoadError("unknown dlopen error".to_string());
    }
    // SAFETY: non-null, NUL-terminated (above).
    let text = unsafe { CStr::from_ptr(text) };
    LoadError(text.to_string_lossy().into_owned())
}

/// One `debuginfod_client`, ended on drop.
pub struct Client {
    library: &'static Library,
    raw: NonNull<c_void>,
}

// SAFETY: a debuginfod_client may move between threads; it only must not be
// used by two at once, which `&mut self` on every use ensures.
unsafe impl Send for Client {}

impl Client {
    /// The path, in the client cache, of the debug file of `build_id` (hex
    /// digits, as the servers' `/buildid/<hex>/debuginfo` URLs take it),
    /// downloaded when it is not cached yet; the error is the library's
    /// errno (`ENOENT`: no server has it; `ENOSYS`: `DEBUGINFOD_URLS` names
    /// no server), or `TimedOut` when no server started sending within
    /// `limit` (when given; the library's own retries included). The file is the
    /// servers' word: the caller checks it.
    pub fn find_debuginfo(
        &mut self,
        build_id: &str,
        limit: Option<Duration>,
    ) -> io::Result<PathBuf> {
        if build_id.is_empty() || !build_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let id = CString::new(build_id).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut path: *mut c_char = std::ptr::null_mut();
        DEADLINE.with(|d| d.set(limit.and_then(|l| Instant::now().checked_add(l))));
        CANCELLED.with(|c| c.set(false));
        // SAFETY: `raw` is a live client used by this thread only; a
        // build-id length of 0 tells the library that `id` is a
        // NUL-terminated hex string; `path` receives NULL or a string the
        // library allocated with malloc, freed below.
        let fd = unsafe {
            (self.library.find_debuginfo)(self.raw.as_ptr(), id.as_ptr().cast(), 0, &mut path)
        };
        DEADLINE.with(|d| d.set(None));
        if fd < 0 {
            if !path.is_null() {
                // SAFETY: allocated by the library with malloc.
                unsafe { libc::free(path.cast()) };
            }
            if CANCELLED.with(Cell::get) {
                let limit = limit.unwrap_or_default().as_secs();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no answer within {limit} s"),
                ));
            }
            let errno = fd.checked_neg().unwrap_or(libc::EIO);
            return Err(io::Error::from_raw_os_error(errno));
        }
        // SAFETY: `fd` is a descriptor the library opened for the caller.
        unsafe { libc::close(fd) };
        if path.is_null() {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        // SAFETY: non-null, NUL-terminated, allocated with malloc by the
        // library; copied before it is freed.
        let found = PathBuf::from(OsStr::from_bytes(
            unsafe { CStr::from_ptr(path) }.to_bytes(),
        ));
        // SAFETY: as above; not used after this.
        unsafe { libc::free(path.cast()) };
        Ok(found)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // SAFETY: `raw` came from debuginfod_begin and is ended only here.
        unsafe { (self.library.end)(self.raw.as_ptr()) };
    }
}
