//! A thread's seccomp state: its mode (`Seccomp:` of its status file) and,
//! in filter mode, its filters (`PTRACE_SECCOMP_GET_FILTER`, `ptrace(2)`),
//! for [`crate::seccomp`] to run. Reading the filters needs
//! `CAP_SYS_ADMIN` and a thread in a ptrace stop; whatever keeps them from
//! being read is reported, never taken as "no filter".

use std::io;

use super::procfs;
use super::ptrace::Tid;
use crate::seccomp::Filters;
use crate::seccomp::bpf::{Insn, MAX_INSNS};

const PTRACE_SECCOMP_GET_FILTER: libc::c_uint = 0x420c;
/// Filters a thread can have: each takes at least 4 KiB of the kernel's
/// memory and all together at most `MAX_INSNS_PER_PATH` (32 K) instructions.
const MAX_FILTERS: u64 = 32 * 1024;

/// The seccomp state of the stopped thread `tid`.
pub fn filters(tid: Tid) -> Filters {
    match procfs::seccomp_mode(tid) {
        Ok(0) => Filters::Off,
        Ok(1) => Filters::Strict,
        Ok(2) => match read_filters(tid) {
            Ok(programs) => Filters::Filter(programs),
            Err(err) => Filters::Unreadable(err.to_string()),
        },
        Ok(mode) => Filters::Unreadable(format!("unknown seccomp mode {mode}")),
        Err(err) => Filters::Unreadable(format!("/proc/{tid}/status: {err}")),
    }
}

/// Every filter of the stopped thread `tid`, the most recent first.
fn read_filters(tid: Tid) -> io::Result<Vec<Vec<Insn>>> {
    let mut programs = Vec::new();
    for index in 0..MAX_FILTERS {
        // With no buffer, the call returns the filter's length.
        let len = match get_filter(tid, index, None) {
            Ok(len) => len,
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => return Ok(programs),
            Err(err) => return Err(err),
        };
        if len == 0 || len > MAX_INSNS {
            return Err(io::Error::other(format!("a filter of {len} instructions")));
        }
        let mut buf = vec![
            libc::sock_filter {
                code: 0,
                jt: 0,
                jf: 0,
                k: 0
            };
            len
        ];
        let got = get_filter(tid, index, Some(&mut buf))?;
        if got != len {
            return Err(io::Error::other("the filter changed while it was read"));
        }
        programs.push(
            buf.iter()
                .map(|f| Insn {
                    code: f.code,
                    jt: f.jt,
                    jf: f.jf,
                    k: f.k,
                })
                .collect(),
        );
    }
    Err(io::Error::other("more filters than a thread can have"))
}

fn get_filter(tid: Tid, index: u64, buf: Option<&mut [libc::sock_filter]>) -> io::Result<usize> {
    let data = buf.map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
    // SAFETY: PTRACE_SECCOMP_GET_FILTER writes at most as many instructions
    // as the filter has, which the caller asked for first and sized `buf` to
    // (checked against the result), or nothing when `data` is null.
    let ret = unsafe { libc::ptrace(PTRACE_SECCOMP_GET_FILTER, tid, index as usize, data) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    usize::try_from(ret).map_err(io::Error::other)
}
