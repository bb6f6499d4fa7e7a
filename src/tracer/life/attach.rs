//! Attaching to a running process: seize every thread, including the ones
//! created while memptrace is seizing, stop them all, hook the images while
//! they stand still, and let each go exactly as it was.
//!
//! What must not happen (`ptrace(2)`): a stopped process woken up (a thread
//! found in group-stop is answered with PTRACE_LISTEN, never CONT), a signal
//! lost (a thread that reports a signal-delivery-stop instead of the
//! interrupt gets that signal back when resumed), a system call failing with
//! EINTR (PTRACE_INTERRUPT stops are not signals to the program: an
//! interrupted call restarts when the thread resumes with its registers as
//! they were).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::os::pidfd::Pidfd;
use crate::os::ptrace::{self, Tid};
use crate::tracer::life::Life;
use crate::tracer::life::pauses::PauseClock;
use crate::tracer::life::stopping::Stopping;
use crate::tracer::process::{Process, Role};
use crate::tracer::space::Space;
use crate::tracer::space::images::Ahead;
use crate::tracer::stop::Stopped;
use crate::tracer::target::{Live, Target};
use crate::tracer::{Control, Progress, TraceError, TraceOptions, Tracer};
use crate::unwind::pipeline::PipelineHandle;

/// How a thread stopped by the attach goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resume {
    /// Continue, delivering this signal (0 for none).
    Cont(i32),
    /// It is in group-stop: stay stopped (PTRACE_LISTEN).
    Listen,
}

/// Attach to the running process `pid` and hook it (see
/// [`Tracer::attach`]). On return every thread runs again (or stays in the
/// group-stop it was found in) and the wait loop takes over. On error
/// nothing of the process was changed and every thread seized is detached.
/// `origin`: the process `pid` named when the user's command was checked.
pub(in crate::tracer) fn attach(
    opts: TraceOptions,
    pipeline: PipelineHandle,
    pid: Tid,
    origin: Option<&Pidfd>,
    clock: Instant,
    progress: Arc<Progress>,
    heap_facts: crate::heap::Facts,
) -> Result<Tracer, TraceError> {
    let mut target = Live;
    match target.tgid(pid) {
        None => return Err(TraceError::NoSuchProcess(pid)),
        Some(tgid) if tgid != pid => {
            return Err(TraceError::NotAProcess {
                tid: pid,
                pid: tgid,
            });
        }
        Some(_) => {}
    }
    // Before a thread stops: the heap map at attach then finds its
    // allocator's layout ready.
    crate::heap::prepare_process(pid, &heap_facts);
    // Memory to copy its heap into, faulted in while it runs: a fresh
    // buffer's page faults were most of the copy's time.
    let buffers = crate::heap::reserve_copy(pid, &heap_facts);
    let mut tracer = Tracer::blank(opts, pipeline, pid, clock, progress, heap_facts);
    tracer.control.attached = true;
    // Its images too (and the jump probes' unwind tables of them).
    let ahead = Ahead::read(pid, tracer.jumps());
    tracer
        .family
        .processes
        .insert(pid, Process::new(Role::Traced, None));
    let seized = seize_all(&mut target, pid, origin)?;
    for &tid in &seized {
        tracer.add_thread(tid, pid);
    }
    match hook_stopped(&mut tracer, pid, &seized, buffers, ahead) {
        Ok(()) => {
            // `--duration` is the time traced: it starts now. (It also
            // bounded the attach itself.)
            tracer.control.deadline = tracer.opts.duration.map(|d| Instant::now() + d);
            Ok(tracer)
        }
        Err(err) => {
            // Let go of what was seized: the threads that stopped are
            // detached (what was planted is put back first); those that
            // never stopped are released by the kernel when memptrace
            // exits (no thread of an attached process has EXITKILL).
            if let Err(detach) = tracer.let_go_held() {
                eprintln!("memptrace: warning: letting process {pid} go: {detach}");
            }
            Err(err)
        }
    }
}

/// Stop every seized thread, hook the images, copy the heap while they
/// stand still, resume them; the copy is walked once they run.
fn hook_stopped(
    tracer: &mut Tracer,
    pid: Tid,
    seized: &[Tid],
    buffers: crate::heap::Buffers,
    ahead: Ahead,
) -> Result<(), TraceError> {
    let mut pause = PauseClock::start("attach");
    let resume = tracer
        .life()
        .stop_all(pid, seized, crate::tracer::PATIENCE)?;
    pause.lap("stop");
    let worker = tracer.life().worker(pid, &resume)?;
    let mut space = Space::new(pid, tracer.life().catch())?;
    space.ahead = ahead;
    let arrived = tracer.life().hook(pid, worker, space)?;
    pause.lap("hook");
    // Only the copy of the heap needs the program stopped: the walk of
    // the copy and the inventory come once it runs again.
    let heap = tracer.heaps.copy_heap(&tracer.book, pid, buffers);
    pause.lap("heap_copy");
    tracer.life().resume_all(pid, resume, worker, arrived)?;
    pause.lap("resume");
    let pause = pause.finish();
    tracer
        .heaps
        .take_inventory(&mut tracer.book, &mut tracer.stats, heap, pause);
    Ok(())
}

impl<T: Target> Life<'_, T> {
    /// The stopped thread that runs the injected mmap calls that map the
    /// trampoline pages: the leader if it can, a thread in group-stop last.
    /// A thread of the process itself (a vfork child born meanwhile shares
    /// its memory but not its file descriptors, and the memfd must be the
    /// process's), and not a vfork parent: it cannot run a call before its
    /// child execs or exits (see `inject::leave_system_call`). If the
    /// process's only thread is that vfork parent, its child, which runs in
    /// the same memory from a clean first stop, does it.
    fn worker(&mut self, pid: Tid, resume: &HashMap<Tid, Resume>) -> Result<Tid, TraceError> {
        let vforking: HashSet<Tid> = [pid]
            .into_iter()
            .chain(resume.keys().copied())
            .filter(|&t| self.target.event_of(t) == Some(libc::PTRACE_EVENT_VFORK))
            .collect();
        let family = &*self.family;
        let free = |tid: &Tid| !vforking.contains(tid);
        let runs = |tid: &Tid| matches!(resume.get(tid), Some(Resume::Cont(_))) && free(tid);
        let ours = |tid: &Tid| family.pid_of(*tid) == Some(pid);
        let shares = |tid: &Tid| {
            family.processes.get(tid).is_some_and(|p| {
                p.role == Role::Shares { parent: pid } && family.pid_of(*tid) == Some(*tid)
            })
        };
        [pid]
            .into_iter()
            .chain(resume.keys().copied())
            .find(|t| runs(t) && ours(t))
            .or_else(|| resume.keys().copied().find(|t| runs(t) && shares(t)))
            .or_else(|| resume.keys().copied().find(|t| ours(t) && free(t)))
            .ok_or(TraceError::NoSuchProcess(pid))
    }

    /// Hook process `pid`'s images in `space`, made for it (its calls
    /// caught as [`Life::catch`] says), `worker` running the injected
    /// calls: the signals it received meanwhile, to be delivered when it
    /// resumes.
    fn hook(&mut self, pid: Tid, worker: Tid, space: Space) -> Result<Vec<i32>, TraceError> {
        if let Some(process) = self.family.processes.get_mut(&pid) {
            process.space = Some(space);
        }
        let arrived = self.images().refresh(pid, worker)?;
        if self.stats.hooked_functions == 0 {
            let refused = self.family.space_of(pid).and_then(|s| s.refused.clone());
            return Err(match refused {
                Some(why) => TraceError::AttachAbandoned {
                    pid,
                    reason: format!(
                        "its allocator functions cannot be hooked without a system call its seccomp filter may refuse: {why}"
                    ),
                },
                None => TraceError::NoAllocator(pid),
            });
        }
        Ok(arrived)
    }

    /// Let every thread the attach stopped go on as it was (`resume`),
    /// `worker` with the signals that `arrived` while it ran injected
    /// calls. Each gets its slot first (an int3 stop for one is fatal if
    /// memptrace dies in it), and a thread stopped inside the bytes a jump
    /// now covers goes on in the probe's displaced copy of them.
    fn resume_all(
        &mut self,
        pid: Tid,
        resume: HashMap<Tid, Resume>,
        worker: Tid,
        mut arrived: Vec<i32>,
    ) -> Result<(), TraceError> {
        let alive_ticks = self.alive_ticks();
        for &tid in resume.keys() {
            self.family.register_early(self.target, tid, alive_ticks);
        }
        for &tid in resume.keys() {
            self.family.step_over_patch(self.target, tid)?;
        }
        for (tid, how) in resume {
            match how {
                Resume::Listen => {
                    if tid == worker {
                        for sig in arrived.drain(..) {
                            let _ = self.target.tgkill(pid, tid, sig);
                        }
                    }
                    self.control.held.remove(&tid);
                    ptrace::unless_gone(self.target.listen(tid))?;
                }
                Resume::Cont(sig) => {
                    let mut signals: Vec<i32> = (sig != 0).then_some(sig).into_iter().collect();
                    if tid == worker {
                        signals.append(&mut arrived);
                    }
                    self.control.held.remove(&tid);
                    self.family.resume_with(self.target, tid, &signals)?;
                }
            }
        }
        Ok(())
    }

    /// PTRACE_INTERRUPT every thread and wait until each has reported a stop.
    /// Threads born meanwhile are adopted stopped. Returns how each stopped
    /// thread must be resumed. Given up when no thread stopped for
    /// `patience`, or memptrace is told to stop.
    fn stop_all(
        &mut self,
        pid: Tid,
        seized: &[Tid],
        patience: Duration,
    ) -> Result<HashMap<Tid, Resume>, TraceError> {
        let mut waiting: HashSet<Tid> = HashSet::new();
        for &tid in seized {
            if self.target.interrupt(tid).is_ok() {
                waiting.insert(tid);
            }
        }
        let mut resume = HashMap::new();
        let mut progress = Instant::now();
        // Children announced by a birth are waited for too: a vfork child
        // must be held (and may have to run the injected calls).
        while !waiting.is_empty() || !self.family.announced.is_empty() {
            self.control.hold(&resume);
            let (tid, stop) = match self.next_stop_while_stopping()? {
                Stopping::Known(tid, stop) => (tid, stop),
                Stopping::Adopted(tid) => {
                    resume.insert(tid, Resume::Cont(0));
                    continue;
                }
                Stopping::Nothing => {
                    let reason = self.control.stop_requested(self.book).or_else(|| {
                        (progress.elapsed() >= patience).then(|| {
                            format!(
                                "threads {:?} did not stop within {} s",
                                sorted(&waiting),
                                patience.as_secs()
                            )
                        })
                    });
                    if let Some(reason) = reason {
                        return Err(TraceError::AttachAbandoned { pid, reason });
                    }
                    continue;
                }
                Stopping::NoneLeft => break,
            };
            progress = Instant::now();
            waiting.remove(&tid);
            match Stopped::of(stop) {
                Stopped::Gone => {
                    resume.remove(&tid);
                    self.thread_gone(tid, stop)?;
                    if tid == pid {
                        return Err(TraceError::NoSuchProcess(pid));
                    }
                }
                Stopped::GroupStop(_) => {
                    resume.insert(tid, Resume::Listen);
                }
                Stopped::Trap => {
                    // The signal came first; the interrupt is still pending and
                    // is reported (and ignored) once the thread runs again.
                    resume.insert(tid, Resume::Cont(libc::SIGTRAP));
                }
                Stopped::Fault(sig) | Stopped::Signal(sig) => {
                    resume.insert(tid, Resume::Cont(sig));
                }
                Stopped::Birth(event) => {
                    let before: HashSet<Tid> = self.family.threads.keys().copied().collect();
                    self.announce_child(tid, event, true)?;
                    for new in self.family.threads.keys() {
                        if !before.contains(new) {
                            resume.insert(*new, Resume::Cont(0));
                        }
                    }
                    resume.insert(tid, Resume::Cont(0));
                }
                Stopped::Exec | Stopped::Exiting | Stopped::Interrupt | Stopped::VforkDone => {
                    resume.insert(tid, Resume::Cont(0));
                }
            }
        }
        self.control.hold(&resume);
        Ok(resume)
    }
}

impl Control {
    /// Remember the threads stopped so far, so that letting go of them on
    /// an error does not wait for stops already seen.
    fn hold(&mut self, resume: &HashMap<Tid, Resume>) {
        for (&tid, how) in resume {
            let sig = match how {
                Resume::Cont(sig) => *sig,
                Resume::Listen => 0,
            };
            self.held.insert(tid, sig);
        }
    }
}

fn sorted(tids: &HashSet<Tid>) -> Vec<Tid> {
    let mut tids: Vec<Tid> = tids.iter().copied().collect();
    tids.sort_unstable();
    tids
}

/// Seize every thread of `pid`, again and again until no new one appears:
/// a thread not yet seized can create threads that nobody auto-attaches.
/// If `origin`, the process `pid` named when it was checked, has been
/// reaped since, the number may name another process: its threads are let
/// go and the process is reported gone.
fn seize_all(
    target: &mut impl Target,
    pid: Tid,
    origin: Option<&Pidfd>,
) -> Result<Vec<Tid>, TraceError> {
    let mut seen = HashSet::new();
    let mut seized = Vec::new();
    loop {
        let tids = match target.threads(pid) {
            Ok(tids) => tids,
            Err(_) if seized.is_empty() => return Err(TraceError::NoSuchProcess(pid)),
            Err(_) => break,
        };
        let mut new = false;
        for tid in tids {
            if !seen.insert(tid) {
                continue;
            }
            new = true;
            // A thread id names a thread only while the thread lives: one
            // that exited since the listing may already name a thread of
            // another process (ids are reused as soon as the kernel's
            // counter wraps, within a second on a box whose threads come
            // and go). Seize only a thread still listed, and check whose
            // thread it is once seized (a seized thread's id stays its own).
            if tid != pid && target.thread_ending(pid, tid) {
                continue;
            }
            // Never EXITKILL: memptrace's death must not kill a process it
            // attached to (see `tracer::failopen`).
            match target.seize(tid, ptrace::ATTACH_OPTIONS) {
                Ok(()) if tid != pid && target.tgid(tid).is_some_and(|owner| owner != pid) => {
                    crate::tracer::life::detach::detach_running(target, tid);
                }
                Ok(()) => seized.push(tid),
                // It exited meanwhile, or is exiting (the kernel refuses a
                // thread whose exit has begun with EPERM), or it is already
                // memptrace's: made by a thread seized a moment ago, it was
                // attached with its birth (PTRACE_O_TRACECLONE) and is
                // adopted when that birth is reported.
                Err(err)
                    if tid != pid
                        && (err.raw_os_error() == Some(libc::ESRCH)
                            || target.thread_ending(pid, tid)
                            || target.thread_tracer(pid, tid)
                                == Some(std::process::id() as Tid)) => {}
                Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
                    release(target, &seized);
                    return Err(TraceError::NoSuchProcess(pid));
                }
                // The main thread has exited: the kernel refuses a thread
                // whose exit has begun, and the process cannot be traced
                // without it, whether its other threads run on or it is a
                // zombie its parent has not reaped.
                Err(_) if tid == pid && target.thread_ending(pid, pid) => {
                    release(target, &seized);
                    // Gone since (reaped): no such process any more.
                    let Ok(threads) = target.threads(pid) else {
                        return Err(TraceError::NoSuchProcess(pid));
                    };
                    let running = threads
                        .into_iter()
                        .filter(|&t| t != pid && !target.thread_ending(pid, t))
                        .count();
                    return Err(TraceError::Exited { pid, running });
                }
                Err(source) => {
                    release(target, &seized);
                    // The tracer that holds the thread refused, else the
                    // process's (the same for any debugger).
                    let tracer = [tid, pid]
                        .into_iter()
                        .find_map(|t| target.thread_tracer(pid, t).filter(|&t| t != 0));
                    return Err(TraceError::Denied {
                        pid,
                        source,
                        tracer,
                    });
                }
            }
        }
        if !new {
            break;
        }
    }
    // Unreaped now, it was all along: every thread seized is its own, and
    // what was read of the process before (its images, its heap's layout,
    // the checks of the command) was read of it.
    if origin.is_some_and(|origin| !origin.unreaped()) {
        release(target, &seized);
        return Err(TraceError::NoSuchProcess(pid));
    }
    Ok(seized)
}

/// Detach threads seized but never stopped (PTRACE_DETACH needs a stop).
fn release(target: &mut impl Target, seized: &[Tid]) {
    for &tid in seized {
        crate::tracer::life::detach::detach_running(target, tid);
    }
}

#[cfg(test)]
#[path = "attach_tests.rs"]
mod tests;
