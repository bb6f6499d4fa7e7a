//! The bare cost of a ptrace stop on this machine: the tracee executes `int3`
//! in a loop; the tracer waits for the stop, reads the registers
//! (PTRACE_GETREGS), writes them back (PTRACE_SETREGS) and resumes the thread
//! (PTRACE_CONT). Nothing else: this is the floor any ptrace-based tracer
//! stands on, and memptrace's per-stop cost is compared with it.
//!
//! The tracee is started the way memptrace starts one (`os::launch::spawn`,
//! PTRACE_SEIZE with memptrace's options) and the stops are handled with the
//! same `os::ptrace` functions.

use std::path::Path;
use std::time::{Duration, Instant};

use memptrace::os::ptrace::{self, Stop};
use memptrace::os::{launch, mem};

/// How the tracer waits for the next stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// waitpid without WNOHANG: the tracer sleeps until the tracee stops.
    Block,
    /// What memptrace does: poll with WNOHANG for up to 200 µs, then block.
    Spin,
}

/// The same budget memptrace's wait loop polls for (`tracer::SPIN`).
const SPIN: Duration = Duration::from_micros(200);

fn next(wait: Wait) -> Option<(i32, Stop)> {
    if wait == Wait::Spin {
        let deadline = Instant::now() + SPIN;
        loop {
            match ptrace::poll_any() {
                Ok(Some(found)) => return Some(found),
                Ok(None) if Instant::now() < deadline => std::hint::spin_loop(),
                Ok(None) => break,
                Err(_) => return None,
            }
        }
    }
    loop {
        match ptrace::wait_any() {
            Ok(Some(found)) => return Some(found),
            Ok(None) => continue,
            Err(_) => return None,
        }
    }
}

/// Work added to each bare stop, to price the parts of memptrace's stop path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extra {
    /// Copy this many bytes of stack from rsp up (one process_vm_readv).
    pub read: usize,
    /// Write one stack word (one process_vm_writev of 8 bytes), as memptrace
    /// does to redirect a return.
    pub write: bool,
}

/// Run `tracee int3 stops` under the bare loop; returns the tracee's own
/// `loop_ns` divided by the number of stops.
pub fn stop_cost(tracee: &Path, stops: u64, wait: Wait, extra: Extra) -> Result<f64, String> {
    let out = tracee.with_file_name(format!("bare-{wait:?}.out"));
    let _ = std::fs::remove_file(&out);
    let args = [
        tracee.as_os_str().to_owned(),
        "int3".into(),
        stops.to_string().into(),
        out.as_os_str().to_owned(),
    ];
    let launched =
        launch::spawn(tracee, &args).map_err(|e| format!("launching {}: {e}", tracee.display()))?;
    let child = launched.pid;
    let mut counted = 0u64;
    let mut buf: Vec<u8> = Vec::new();
    let mut code = None;
    while code.is_none() {
        let Some((tid, stop)) = next(wait) else {
            break;
        };
        match stop {
            Stop::Signal(libc::SIGTRAP) => {
                counted += 1;
                let regs = ptrace::get_regs(tid).map_err(|e| e.to_string())?;
                if extra.read > 0 {
                    // As memptrace copies a stack: one iovec, no zeroing.
                    mem::read_mapped_into(tid, regs.rsp, extra.read, &mut buf)
                        .map_err(|e| e.to_string())?;
                }
                if extra.write {
                    // Into the middle of the 40 KiB the tracee keeps unused
                    // above its int3 loop (tracee.c, int3_deep).
                    mem::write_data(tid, regs.rsp + (16 << 10), &counted.to_le_bytes())
                        .map_err(|e| e.to_string())?;
                }
                ptrace::set_regs(tid, &regs).map_err(|e| e.to_string())?;
                ptrace::cont(tid, 0).map_err(|e| e.to_string())?;
            }
            Stop::Signal(sig) => ptrace::cont(tid, sig).map_err(|e| e.to_string())?,
            Stop::Exited(c) if tid == child => code = Some(c),
            Stop::Killed { sig, .. } if tid == child => {
                return Err(format!("the bare tracee was killed by signal {sig}"));
            }
            Stop::Exited(_) | Stop::Killed { .. } => {}
            _ => ptrace::cont(tid, 0).map_err(|e| e.to_string())?,
        }
    }
    if code != Some(0) {
        return Err(format!("the bare tracee ended with {code:?}"));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&out);
    let loop_ns = crate::loop_ns(&text).ok_or("the bare tracee printed no loop_ns")?;
    if counted != stops {
        return Err(format!("{counted} stops seen, {stops} expected"));
    }
    Ok(loop_ns as f64 / stops as f64)
}

/// What each system call of a stop path costs by itself, on a thread that
/// stays stopped (so no wakeup or scheduling is in the figure): `calls`
/// repetitions each, in µs per call.
pub fn syscall_costs(tracee: &Path, calls: u32) -> Result<Vec<(String, f64)>, String> {
    let out = tracee.with_file_name("syscalls.out");
    let args = [
        tracee.as_os_str().to_owned(),
        "int3".into(),
        "1".into(),
        out.as_os_str().to_owned(),
    ];
    let launched =
        launch::spawn(tracee, &args).map_err(|e| format!("launching {}: {e}", tracee.display()))?;
    let child = launched.pid;
    let err = |e: std::io::Error| e.to_string();
    let mut costs = Vec::new();
    loop {
        let Some((tid, stop)) = next(Wait::Block) else {
            return Err("the tracee vanished".into());
        };
        match stop {
            Stop::Signal(libc::SIGTRAP) => {
                let regs = ptrace::get_regs(tid).map_err(err)?;
                let mut time = |label: &str, f: &mut dyn FnMut() -> std::io::Result<()>| {
                    let started = Instant::now();
                    for _ in 0..calls {
                        f()?;
                    }
                    let us = started.elapsed().as_secs_f64() * 1e6 / f64::from(calls);
                    costs.push((label.to_string(), us));
                    Ok::<(), std::io::Error>(())
                };
                time("PTRACE_GETREGS", &mut || ptrace::get_regs(tid).map(drop)).map_err(err)?;
                time("PTRACE_SETREGS", &mut || ptrace::set_regs(tid, &regs)).map_err(err)?;
                let mut buf = Vec::new();
                let mut page = vec![0u8; 32 << 10];
                for (label, len) in [
                    ("process_vm_readv, 8 bytes", 8),
                    ("process_vm_readv, 4 KiB", 4 << 10),
                    ("process_vm_readv, 32 KiB, one iovec (memptrace)", 32 << 10),
                ] {
                    time(label, &mut || {
                        mem::read_mapped_into(tid, regs.rsp, len, &mut buf)
                    })
                    .map_err(err)?;
                }
                time("process_vm_readv, 32 KiB split at pages", &mut || {
                    mem::read(tid, regs.rsp, &mut page).map(drop)
                })
                .map_err(err)?;
                let word = regs.rsp + (16 << 10);
                time("process_vm_writev, 8 bytes", &mut || {
                    mem::write_data(tid, word, &[0; 8])
                })
                .map_err(err)?;
                time("waitpid(WNOHANG), nothing to report", &mut || {
                    ptrace::poll_any().map(drop)
                })
                .map_err(err)?;
                ptrace::cont(tid, 0).map_err(err)?;
            }
            Stop::Exited(_) | Stop::Killed { .. } if tid == child => break,
            Stop::Exited(_) | Stop::Killed { .. } => {}
            Stop::Signal(sig) => ptrace::cont(tid, sig).map_err(err)?,
            _ => ptrace::cont(tid, 0).map_err(err)?,
        }
    }
    let _ = std::fs::remove_file(&out);
    Ok(costs)
}
