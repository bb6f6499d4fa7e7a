//! /proc/PID files: memory maps, thread names, process status, open files.

use std::fs;
use std::io;
use std::path::PathBuf;

use super::ptrace::Tid;

/// One line of /proc/PID/maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    pub offset: u64,
    pub inode: u64,
    /// The file, `[stack]`-style pseudo name, or empty for anonymous memory.
    /// A deleted file keeps its " (deleted)" suffix.
    pub path: String,
}

impl Mapping {
    /// True for a mapping of a regular file (not `[heap]`, `[vdso]`, anonymous...).
    pub fn is_file(&self) -> bool {
        self.inode != 0 && self.path.starts_with('/')
    }
}

/// What file descriptor `fd` of process `pid` writes to, when it is a
/// terminal (a character device): its device number (`st_rdev`), the same
/// however the terminal was opened. `Ok(None)` for anything else, or a
/// descriptor that is not open; an error when it cannot be looked at (the
/// process is another user's).
pub fn terminal_of(pid: Tid, fd: i32) -> io::Result<Option<u64>> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    // /proc/PID/fd/N is a link to the open file: metadata follows it.
    match fs::metadata(format!("/proc/{pid}/fd/{fd}")) {
        Ok(meta) if meta.file_type().is_char_device() => Ok(Some(meta.rdev())),
        Ok(_) => Ok(None),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err),
    }
}

/// A /proc file that could not be read: which, and the system's words.
/// The message carries both (it has no `source`), so it reads the same
/// wherever it is printed, on its own or inside an `io::Error`.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {}: {error}", path.display())]
pub struct ReadError {
    pub path: PathBuf,
    pub error: io::Error,
}

impl ReadError {
    fn of(path: String) -> impl FnOnce(io::Error) -> ReadError {
        move |error| ReadError {
            path: path.into(),
            error,
        }
    }
}

/// Through an `io::Error` (of the same kind) the read error stays one:
/// `ReadError::from_io` finds it again.
impl From<ReadError> for io::Error {
    fn from(err: ReadError) -> io::Error {
        io::Error::new(err.error.kind(), err)
    }
}

impl ReadError {
    /// The read error `err` carries, if it is one (see `From<ReadError>`);
    /// otherwise `err` as it was.
    pub fn from_io(err: io::Error) -> Result<ReadError, io::Error> {
        super::carried(err)
    }
}

/// The memory map of process `pid` (`/proc/PID/maps`).
pub fn read_maps(pid: Tid) -> Result<Vec<Mapping>, ReadError> {
    let path = format!("/proc/{pid}/maps");
    let text = fs::read_to_string(&path).map_err(ReadError::of(path))?;
    Ok(parse_maps(&text))
}

/// Parse the text of /proc/PID/maps (`proc(5)`); malformed lines are skipped.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_map_line).collect()
}

fn parse_map_line(line: &str) -> Option<Mapping> {
    // address perms offset dev inode pathname; the path may contain spaces.
    let mut rest = line;
    let mut field = || {
        let trimmed = rest.trim_start();
        let end = trimmed.find(' ').unwrap_or(trimmed.len());
        let (f, r) = trimmed.split_at(end);
        rest = r;
        f
    };
    let range = field();
    let perms = field().as_bytes().to_vec();
    let offset = field();
    let _dev = field();
    let inode = field();
    let path = rest.trim_start().to_string();
    let (start, end) = range.split_once('-')?;
    if perms.len() < 3 {
        return None;
    }
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        read: perms[0] == b'r',
        write: perms[1] == b'w',
        exec: perms[2] == b'x',
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode: inode.parse().ok()?,
        path,
    })
}

/// True when the kernel lets process `pid` read its fs base itself
/// (`rdfsbase`): `AT_HWCAP2` has `HWCAP2_FSGSBASE` (bit 1) in its auxiliary
/// vector (`getauxval(3)`).
pub fn fsgsbase(pid: Tid) -> bool {
    const AT_HWCAP2: u64 = 26;
    const HWCAP2_FSGSBASE: u64 = 1 << 1;
    let Ok(auxv) = fs::read(format!("/proc/{pid}/auxv")) else {
        return false;
    };
    auxv.chunks_exact(16)
        .map(|pair| {
            let word = |i: usize| u64::from_le_bytes(pair[i..i + 8].try_into().expect("8 bytes"));
            (word(0), word(8))
        })
        .find(|&(key, _)| key == AT_HWCAP2)
        .is_some_and(|(_, value)| value & HWCAP2_FSGSBASE != 0)
}

/// The name of a thread (`/proc/PID/task/TID/comm`), without the newline.
pub fn thread_name(pid: Tid, tid: Tid) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end_matches('\n').to_string())
}

/// The thread-group id of a thread (the `Tgid:` line of its status file).
pub fn tgid(tid: Tid) -> Option<Tid> {
    let status = fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    field(&status, "Tgid:")?.parse().ok()
}

/// The seccomp mode of thread `tid` (`Seccomp:` of its status file): 0
/// none, 1 strict, 2 filter.
pub fn seccomp_mode(tid: Tid) -> io::Result<u8> {
    let status = fs::read_to_string(format!("/proc/{tid}/status"))?;
    parse_seccomp_mode(&status)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a bad Seccomp: line"))
}

/// A kernel built without seccomp has no `Seccomp:` line: mode 0.
fn parse_seccomp_mode(status: &str) -> Option<u8> {
    match field(status, "Seccomp:") {
        None => Some(0),
        Some(mode) => mode.parse().ok(),
    }
}

/// memptrace's own peak resident set size in KiB (`VmHWM:` of
/// /proc/self/status).
pub fn own_peak_rss_kib() -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    field(&status, "VmHWM:")?
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

fn field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(str::trim)
}

/// The threads of a process (`/proc/PID/task`).
pub fn threads(pid: Tid) -> io::Result<Vec<Tid>> {
    let mut tids = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Some(tid) = entry?.file_name().to_str().and_then(|s| s.parse().ok()) {
            tids.push(tid);
        }
    }
    tids.sort_unstable();
    Ok(tids)
}

/// True when thread `tid` of `pid` is gone or dying (`State:` Z or X, or no
/// status file): the kernel refuses to attach to it (EPERM), and it will
/// make no more calls.
pub fn thread_ending(pid: Tid, tid: Tid) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")) else {
        return true;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .map(str::trim_start)
        .is_some_and(|state| state.starts_with('Z') || state.starts_with('X'))
}

/// Thread `tid` of `pid` has signal `sig` pending (`SigPnd:`, the
/// thread's own queue); false when its status cannot be read.
pub fn signal_pending(pid: Tid, tid: Tid, sig: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")) else {
        return false;
    };
    let Some(bit) = u32::try_from(sig).ok().and_then(|s| s.checked_sub(1)) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigPnd:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .and_then(|mask| mask.checked_shr(bit))
        .is_some_and(|mask| mask & 1 != 0)
}

/// The tracer of thread `tid` of `pid` (`TracerPid:`, 0 for none).
pub fn thread_tracer(pid: Tid, tid: Tid) -> Option<Tid> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The command line of a process, arguments joined by spaces.
pub fn cmdline(pid: Tid) -> Option<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Some(args.join(" "))
}

/// The executable of a process (`/proc/PID/exe`).
pub fn exe(pid: Tid) -> Option<PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// A path that opens the file behind a mapping even when it was deleted or
/// lives in another mount namespace (`/proc/PID/map_files/START-END`).
pub fn map_file(pid: Tid, start: u64, end: u64) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{start:x}-{end:x}"))
}

/// `vm.mmap_min_addr`: nothing can be mapped below it.
pub fn mmap_min_addr() -> u64 {
    fs::read_to_string("/proc/sys/vm/mmap_min_addr")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65536)
}

/// Which of `pages` pages from `start` are resident in RAM
/// (/proc/PID/pagemap, `proc(5)`: bit 63 of each page's entry is "page
/// present"; the bit is readable without privileges, unlike the frame
/// number).
pub fn resident_pages(pid: Tid, start: u64, pages: u64) -> io::Result<Vec<bool>> {
    use std::os::unix::fs::FileExt;
    let file = fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut bytes = vec![0u8; pages as usize * 8];
    file.read_exact_at(&mut bytes, start / 4096 * 8)?;
    Ok(bytes.chunks_exact(8).map(|e| e[7] & 0x80 != 0).collect())
}

/// Nanoseconds thread `tid` has spent waiting on a run queue for a CPU
/// (`/proc/TID/schedstat`, second field; `None` for `tid` 0: memptrace's
/// own calling thread, `/proc/thread-self/schedstat`).
pub fn run_queue_wait_ns(tid: Option<Tid>) -> Option<u64> {
    let path = match tid {
        Some(tid) => format!("/proc/{tid}/schedstat"),
        None => "/proc/thread-self/schedstat".to_string(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_error_says_what_was_read_and_survives_an_io_error() {
        let err = read_maps(i32::MAX).unwrap_err();
        assert_eq!(err.path, PathBuf::from(format!("/proc/{}/maps", i32::MAX)));
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("cannot read /proc/{}/maps: ", i32::MAX)),
            "{text}"
        );
        let kind = err.error.kind();
        let through = io::Error::from(err);
        assert_eq!((through.kind(), through.to_string()), (kind, text.clone()));
        let back = ReadError::from_io(through).unwrap();
        assert_eq!(back.to_string(), text);
        let other = ReadError::from_io(io::Error::from_raw_os_error(libc::EPERM)).unwrap_err();
        assert_eq!(other.raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn reads_run_queue_waits_that_only_grow() {
        let tid = crate::os::local::thread_id();
        let before = run_queue_wait_ns(None).expect("own schedstat");
        let by_tid = run_queue_wait_ns(Some(tid)).expect("schedstat by tid");
        std::thread::yield_now();
        let after = run_queue_wait_ns(None).expect("own schedstat");
        assert!(
            before <= by_tid && by_tid <= after,
            "{before} {by_tid} {after}"
        );
        assert_eq!(run_queue_wait_ns(Some(i32::MAX)), None);
    }

    #[test]
    fn reads_the_seccomp_mode() {
        let status = "Name:\tcat\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\n";
        assert_eq!(parse_seccomp_mode(status), Some(2));
        assert_eq!(parse_seccomp_mode("Name:\tcat\n"), Some(0));
        assert_eq!(parse_seccomp_mode("Seccomp:\tx\n"), None);
        assert!(seccomp_mode(std::process::id() as Tid).is_ok());
    }

    #[test]
    fn parses_maps_lines() {
        let text = "\
55d0c4a00000-55d0c4a02000 r--p 00000000 fe:01 1234   /usr/bin/my prog
7f1e2c000000-7f1e2c021000 rw-p 00000000 00:00 0 
7ffc1a2b3000-7ffc1a2d4000 rw-p 00000000 00:00 0                          [stack]
7f1e2d028000-7f1e2d1bd000 r-xp 00028000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
garbage
";
        let maps = parse_maps(text);
        assert_eq!(maps.len(), 4);
        assert_eq!(maps[0].path, "/usr/bin/my prog");
        assert!(maps[0].is_file() && maps[0].read && !maps[0].exec);
        assert_eq!(maps[1].path, "");
        assert!(!maps[1].is_file());
        assert_eq!(maps[2].path, "[stack]");
        assert_eq!(maps[3].offset, 0x28000);
        assert!(maps[3].exec);
        assert_eq!(maps[3].start, 0x7f1e2d028000);
    }

    #[test]
    fn reads_own_process() {
        let me = std::process::id() as Tid;
        let maps = read_maps(me).unwrap();
        assert!(maps.iter().any(|m| m.path == "[stack]"));
        assert_eq!(tgid(me), Some(me));
        assert!(threads(me).unwrap().contains(&me));
        assert!(own_peak_rss_kib().is_some_and(|kib| kib > 0));
    }
}
