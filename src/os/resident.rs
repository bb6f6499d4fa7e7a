//! How much memory a process has: resident (from /proc/PID/status) and
//! mapped (from /proc/PID/maps), without what memptrace itself maps into
//! it.
//!
//! Reads only; never stops or touches the process. A process that is gone,
//! or a zombie (its memory released: no `VmRSS` line), has no figures.

use std::fs;
use std::os::unix::fs::MetadataExt;

use super::procfs::{Mapping, parse_maps};
use super::ptrace::Tid;

/// A process's memory at one moment, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    /// Resident set: `VmRSS`, the sum of the three below.
    pub rss: u64,
    /// Resident anonymous memory (`RssAnon`): heap, stacks, private
    /// mappings written to.
    pub anon: u64,
    /// Resident pages of mapped files (`RssFile`): code, data files.
    pub file: u64,
    /// Resident shared memory (`RssShmem`): tmpfs, shared anonymous
    /// mappings, memfds (memptrace's own among them, see `docs/schema.md`).
    pub shmem: u64,
    /// Address space mapped, without memptrace's shared areas.
    pub mapped: u64,
}

/// The memory of process `pid`, or `None` when it is gone or a zombie.
pub fn resident(pid: Tid) -> Option<Resident> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut figures = parse_status(&status)?;
    figures.mapped = mapped(&parse_maps(&maps));
    Some(figures)
}

/// True when process `pid` still runs memptrace's own executable: a
/// launched program between fork and exec, whose memory is a copy of
/// memptrace's, not yet the program's.
pub fn runs_our_executable(pid: Tid) -> bool {
    let ours = fs::metadata("/proc/self/exe");
    let theirs = fs::metadata(format!("/proc/{pid}/exe"));
    match (ours, theirs) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The resident figures of /proc/PID/status (`proc(5)`: `VmRSS`,
/// `RssAnon`, `RssFile`, `RssShmem`, in kB); `None` without `VmRSS` (a
/// zombie or a kernel thread). `mapped` is left 0.
pub fn parse_status(text: &str) -> Option<Resident> {
    let mut figures = Resident::default();
    let mut rss = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let field = match key {
            "VmRSS" => &mut figures.rss,
            "RssAnon" => &mut figures.anon,
            "RssFile" => &mut figures.file,
            "RssShmem" => &mut figures.shmem,
            _ => continue,
        };
        let kib: u64 = value.trim().trim_end_matches("kB").trim().parse().ok()?;
        *field = kib * 1024;
        if key == "VmRSS" {
            rss = Some(());
        }
    }
    rss.map(|()| figures)
}

/// The memfds memptrace makes in a traced process are all named
/// `memptrace` (see `tracer::space`): /proc/PID/maps shows them as
/// `/memfd:memptrace (deleted)`.
const OUR_MEMFD: &str = "/memfd:memptrace";

/// Bytes of address space mapped, memptrace's shared areas (rings, control
/// area, stack buffers) left out. Its trampoline areas (a few pages next to
/// each hooked image, anonymous) cannot be told apart and are counted.
pub fn mapped(maps: &[Mapping]) -> u64 {
    maps.iter()
        .filter(|m| !m.path.starts_with(OUR_MEMFD))
        // [vsyscall] is in every process's maps but not in its VmSize.
        .filter(|m| m.path != "[vsyscall]")
        .map(|m| m.end.saturating_sub(m.start))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tcat\nVmPeak:\t    8192 kB\nVmSize:\t    8000 kB\n\
        VmRSS:\t    1800 kB\nRssAnon:\t     100 kB\nRssFile:\t    1600 kB\n\
        RssShmem:\t     100 kB\nThreads:\t1\n";

    #[test]
    fn reads_the_resident_figures_in_bytes() {
        let r = parse_status(STATUS).unwrap();
        assert_eq!(
            r,
            Resident {
                rss: 1800 << 10,
                anon: 100 << 10,
                file: 1600 << 10,
                shmem: 100 << 10,
                mapped: 0
            }
        );
    }

    #[test]
    fn a_zombie_has_no_figures() {
        assert_eq!(
            parse_status("Name:\tx\nState:\tZ (zombie)\nThreads:\t1\n"),
            None
        );
        assert_eq!(parse_status("VmRSS:\tlots kB\n"), None);
    }

    #[test]
    fn mapped_leaves_out_memptrace_areas() {
        let maps = parse_maps(
            "5555a000-5555b000 r-xp 00000000 08:01 42 /usr/bin/cat\n\
             7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n\
             7f1000000000-7f1008000000 rw-s 00000000 00:01 77 /memfd:memptrace (deleted)\n\
             7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n\
             ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]\n",
        );
        assert_eq!(mapped(&maps), 0x1000 + 0x100000 + 0x21000);
    }

    #[test]
    fn reads_this_process() {
        let me = resident(std::process::id() as Tid).unwrap();
        assert!(me.rss > 0 && me.mapped >= me.rss, "{me:?}");
        assert!(runs_our_executable(std::process::id() as Tid));
    }
}
