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
    let mut buf = Vec::new();
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
                    buf.resize(extra.read, 0);
                    mem::read(tid, regs.rsp, &mut buf).map_err(|e| e.to_string())?;
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
