//! A process's images: found at exec and at every stop on the dynamic
//! linker's hook, hooked, announced to the unwinders and the pipeline, and
//! forgotten when unmapped or replaced by an exec.
//!
//! [`Images`] borrows, for one stop, what that needs of the tracer: the
//! traced processes (their spaces and libunwind states), the booking (to
//! number modules and send their rows) and the counts (images, hooks,
//! warnings). It never stops or resumes a thread, except that an exec's
//! stop ends here ([`Images::exec`], through the target it is handed).

use super::booking::Booking;
use super::process::{Family, Process, Role};
use super::space::images::LoadedModule;
use super::space::{Catch, Changes, Planted, Space};
use super::target::Target;
use super::{TraceError, TraceOptions, TraceStats};
use crate::os::ptrace::{self, Tid};
use crate::sink::Record;
use crate::trace_msg::TraceMsg;
use crate::unwind::libunwind::LibunwindUnwinder;
use crate::unwind::{Unwinder, UnwinderKind};

/// The tracer's parts that images concern, borrowed for one stop.
pub(super) struct Images<'a> {
    pub opts: &'a TraceOptions,
    pub family: &'a mut Family,
    pub book: &'a mut Booking,
    pub stats: &'a mut TraceStats,
}

impl Images<'_> {
    /// Thread `tid` exec'd: the old program's images and blocks go, a new
    /// space is made (its calls caught as `catch` says) and hooked, and
    /// the thread is resumed. A vfork child is let go instead.
    pub fn exec<T: Target>(
        &mut self,
        target: &mut T,
        tid: Tid,
        catch: Catch,
    ) -> Result<(), TraceError> {
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        // Every other thread of the process is gone (`ptrace(2)`, "execve(2)
        // under ptrace"); the exec'ing thread now has the leader's tid.
        for t in self.family.threads_of(pid) {
            if t != tid {
                self.book.settle_copy(self.family, target, t, false);
                self.family.threads.remove(&t);
            }
        }
        if let Some(thread) = self.family.threads.get_mut(&tid) {
            thread.take_calls();
            thread.stepping = false;
            thread.in_map = None;
            thread.stack = None;
        }
        let role = self.family.processes.get(&pid).map(|p| p.role);
        match role {
            Some(Role::Shares { .. }) if !self.opts.follow_forks => {
                // A vfork child now has its own, clean, address space.
                self.family.end_sharing(pid);
                self.family.processes.remove(&pid);
                self.family.threads.remove(&tid);
                return Ok(ptrace::unless_gone(target.detach(tid, 0))?);
            }
            Some(Role::Traced) => {
                self.book.drain_process(self.family, self.stats, pid, true);
                self.stats.count_probes(self.family, pid);
                self.forget(pid);
                // The exec released the old image's blocks: not leaks.
                let alloc_ids = self.book.ledger.forget_process(pid as u32);
                if !alloc_ids.is_empty() {
                    let ts_ns = self.book.now_ns();
                    self.book.out.push(TraceMsg::Record(Record::ExecReleased {
                        pid: pid as u32,
                        ts_ns,
                        alloc_ids,
                    }));
                }
            }
            Some(Role::Shares { .. }) => self.family.end_sharing(pid),
            _ => {}
        }
        // A new address space: what was known of the old one goes.
        let space = Space::new(pid, catch)?;
        self.family
            .processes
            .entry(pid)
            .or_insert_with(|| Process::new(Role::Traced, None))
            .exec(space);
        self.book.send_thread(self.family, tid, None);
        let signals = self.refresh(pid, tid)?;
        // A static executable has all its code now: nothing to hook is
        // nothing to record, and the user must hear of it. (A dynamic one
        // is judged when it ends, its libraries loaded.)
        let is_static = self
            .family
            .space_of(tid)
            .and_then(|s| s.modules.values().find(|m| m.is_main))
            .is_some_and(|m| m.image.interpreter.is_none());
        if is_static {
            self.warn_if_unhooked(pid);
        }
        Ok(self.family.resume_with(target, tid, &signals)?)
    }

    /// Warn, once per process, when a traced process has no allocator
    /// function memptrace could hook: its calls are not recorded.
    pub fn warn_if_unhooked(&mut self, pid: Tid) {
        let Some(process) = self.family.processes.get_mut(&pid) else {
            return;
        };
        let Some(space) = process.space.as_ref() else {
            return;
        };
        if process.role != Role::Traced || process.warned || space.hooks.allocators() > 0 {
            return;
        }
        process.warned = true;
        let program = space.modules.values().find(|m| m.is_main).map_or_else(
            || format!("process {pid}"),
            |m| format!("process {pid} ({})", m.path),
        );
        let warning = match &space.refused {
            Some(why) => format!(
                "{program}: its allocator functions cannot be hooked without a system call its \
                 seccomp filter may refuse ({why}); its calls are not recorded"
            ),
            None => format!(
                "{program}: no allocator function (malloc, free, ...) found to hook in any of \
                 its images; its calls are not recorded"
            ),
        };
        self.stats.warnings.push(warning);
    }

    /// Re-read the process's images, hook new ones and tell the pipeline.
    /// Returns signals that arrived while system calls were injected.
    pub fn refresh(&mut self, pid: Tid, tid: Tid) -> Result<Vec<i32>, TraceError> {
        let Some(space) = self.family.space_mut(pid) else {
            return Ok(Vec::new());
        };
        let changes = space.refresh(tid, &mut self.book.next_module_id)?;
        let hooked = space.hooks.allocators() as u64;
        let areas = space.area_ranges();
        self.apply(pid, changes, hooked, areas)
    }

    /// Tell the pipeline and the unwinders what a refresh changed
    /// (`hooked`: the space's allocator functions hooked now; `areas`: its
    /// trampoline areas).
    fn apply(
        &mut self,
        pid: Tid,
        changes: Changes,
        hooked: u64,
        areas: Vec<std::ops::Range<u64>>,
    ) -> Result<Vec<i32>, TraceError> {
        let Changes {
            added,
            removed,
            signals,
            warnings,
            planted,
        } = changes;
        self.stats.note_planted(pid, planted);
        self.book.send(TraceMsg::Trampolines {
            pid: pid as u32,
            areas,
        });
        let now = self.book.now_ns();
        for module in removed {
            self.book.send(TraceMsg::ImageGone {
                pid: pid as u32,
                module_id: module.id,
                range: module.range.clone(),
                ts_ns: now,
            });
            let libunwind = self
                .family
                .processes
                .get_mut(&pid)
                .and_then(|p| p.libunwind.as_mut());
            if let Some(lu) = libunwind {
                lu.remove_image(module.range);
            }
        }
        for module in added {
            self.stats.images += 1;
            self.announce(pid, &module, now);
        }
        self.stats.hooked_functions = self.stats.hooked_functions.max(hooked);
        // Once per run: a child forked or exec'd maps the same images.
        for warning in warnings {
            if !self.stats.warnings.contains(&warning) {
                self.stats.warnings.push(warning);
            }
        }
        Ok(signals)
    }

    /// Tell the unwinders and the pipeline about an image of process `pid`.
    pub fn announce(&mut self, pid: Tid, module: &LoadedModule, now: u64) {
        let mapped = module.mapped();
        if let Some(lu) = self.libunwind_of(pid) {
            lu.add_image(&mapped);
        }
        self.book.send(TraceMsg::Image {
            pid: pid as u32,
            mapped,
            record: module.record(pid, now),
        });
    }

    /// Every image of process `pid` is gone (an exec replaced them).
    fn forget(&mut self, pid: Tid) {
        let Some(space) = self
            .family
            .processes
            .get(&pid)
            .and_then(|p| p.space.as_ref())
        else {
            return;
        };
        let now = self.book.now_ns();
        let gone: Vec<TraceMsg> = space
            .modules
            .values()
            .map(|m| TraceMsg::ImageGone {
                pid: pid as u32,
                module_id: m.id,
                range: m.range.clone(),
                ts_ns: now,
            })
            .collect();
        self.book.out.extend(gone);
    }

    /// libunwind's state for process `pid`, made on first use; `None` when
    /// stacks are not unwound with libunwind, or libunwind failed to start
    /// (the trace goes on without those stacks).
    fn libunwind_of(&mut self, pid: Tid) -> Option<&mut LibunwindUnwinder> {
        if !(self.opts.stacks && self.opts.unwinder == UnwinderKind::Libunwind) {
            return None;
        }
        let process = self.family.processes.get_mut(&pid)?;
        if process.libunwind.is_none() {
            match LibunwindUnwinder::new() {
                Ok(lu) => process.libunwind = Some(lu),
                Err(err) => {
                    self.stats
                        .warnings
                        .push(format!("process {pid}: libunwind: {err}"));
                    return None;
                }
            }
        }
        process.libunwind.as_mut()
    }
}

impl TraceStats {
    /// Keep how process `pid` hooked its allocator functions, for `meta`:
    /// where another process hooked the same function another way (an
    /// exec'd program, a child), the row says both.
    pub(super) fn note_planted(&mut self, pid: Tid, planted: Vec<Planted>) {
        for p in planted {
            let image = crate::util::file_name(&p.module).to_string();
            let this = p.how.to_string();
            for op in p.ops {
                let key = format!("{image}:{op}");
                match self.probes.iter_mut().find(|(k, _)| *k == key) {
                    None => self.probes.push((key, this.clone())),
                    Some((_, how)) if noted(how, &this) => {}
                    Some((_, how)) => *how = format!("{how}; in process {pid}: {this}"),
                }
            }
        }
    }
}

/// True when the `meta` value `how` says `this` already (see
/// [`TraceStats::note_planted`]).
fn noted(how: &str, this: &str) -> bool {
    how.split("; ")
        .any(|part| part == this || part.ends_with(&format!(": {this}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::Receiver;
    use crate::tracer::space::How;
    use crate::tracer::space::fake::{AREA, AREA_LEN, FakeSpace, PID};

    /// The fake space's process, traced, with what images need of the
    /// tracer.
    struct Rig {
        opts: TraceOptions,
        family: Family,
        book: Booking,
        rx: Receiver<Vec<TraceMsg>>,
        stats: TraceStats,
    }

    impl Rig {
        fn new(fake: FakeSpace) -> Rig {
            let (book, rx) = Booking::for_tests(None);
            Rig {
                opts: TraceOptions::for_tests(true),
                family: Family::of_one(PID, fake.space, &[]),
                book,
                rx,
                stats: TraceStats::default(),
            }
        }

        fn images(&mut self) -> Images<'_> {
            Images {
                opts: &self.opts,
                family: &mut self.family,
                book: &mut self.book,
                stats: &mut self.stats,
            }
        }

        fn sent(&mut self) -> Vec<TraceMsg> {
            self.book.out.send_ready(true).unwrap();
            self.rx.recv().expect("a batch").0
        }
    }

    #[test]
    fn a_refresh_is_sent_counted_and_noted() {
        let mut fake = FakeSpace::libc(true);
        let mut changes = fake.hook();
        let module = fake.module.clone();
        let planted = changes.planted.len() as u64;
        changes.added.push(module.clone());
        changes.signals.push(libc::SIGUSR1);
        changes.warnings = vec!["w".to_string(), "w".to_string()];
        let areas = fake.space.area_ranges();
        let mut rig = Rig::new(fake);
        let mut images = rig.images();
        let signals = images.apply(PID, changes, planted, areas).unwrap();
        assert_eq!(signals, [libc::SIGUSR1]);
        assert_eq!((rig.stats.images, rig.stats.hooked_functions), (1, planted));
        assert_eq!(rig.stats.warnings, ["w"]);
        let malloc = rig
            .stats
            .probes
            .iter()
            .find(|(k, _)| k == "libc.so.6:malloc");
        assert_eq!(malloc.map(|(_, how)| how.as_str()), Some("int3"));
        let msgs = rig.sent();
        assert!(matches!(
            &msgs[..],
            [TraceMsg::Trampolines { pid, areas }, TraceMsg::Image { record, .. }]
                if *pid == PID as u32 && areas[0] == (AREA..AREA + AREA_LEN) && record.id == module.id
        ));
    }

    #[test]
    fn a_removed_image_is_said_gone() {
        let fake = FakeSpace::libc(false);
        let module = fake.module.clone();
        let changes = Changes {
            removed: vec![module.clone()],
            ..Changes::default()
        };
        let mut rig = Rig::new(fake);
        let mut images = rig.images();
        images.apply(PID, changes, 0, Vec::new()).unwrap();
        // And every image at once, when the program execs.
        images.forget(PID);
        let gone: Vec<u64> = rig
            .sent()
            .iter()
            .filter_map(|m| match m {
                TraceMsg::ImageGone {
                    module_id, range, ..
                } if *range == module.range => Some(*module_id),
                _ => None,
            })
            .collect();
        assert_eq!(gone, [module.id, module.id]);
        assert_eq!(rig.stats.images, 0);
    }

    #[test]
    fn a_program_with_nothing_hooked_is_warned_of_once() {
        let mut rig = Rig::new(FakeSpace::libc(false));
        let mut images = rig.images();
        images.warn_if_unhooked(PID);
        images.warn_if_unhooked(PID);
        // Nor a process memptrace does not know.
        images.warn_if_unhooked(PID + 1);
        assert_eq!(rig.stats.warnings.len(), 1);
        assert!(
            rig.stats.warnings[0].starts_with(&format!("process {PID}: no allocator function"))
        );
    }

    #[test]
    fn a_seccomp_refusal_is_the_reason_given() {
        let mut fake = FakeSpace::libc(false);
        fake.space.refused = Some("mmap".to_string());
        let mut rig = Rig::new(fake);
        rig.images().warn_if_unhooked(PID);
        assert_eq!(rig.stats.warnings.len(), 1);
        assert!(rig.stats.warnings[0].contains("seccomp filter may refuse (mmap)"));
    }

    #[test]
    fn a_hooked_program_or_a_vfork_child_is_not_warned_of() {
        let mut fake = FakeSpace::libc(true);
        fake.hook();
        let mut rig = Rig::new(fake);
        rig.family
            .processes
            .insert(PID + 1, Process::new(Role::Shares { parent: PID }, None));
        let mut images = rig.images();
        images.warn_if_unhooked(PID);
        images.warn_if_unhooked(PID + 1);
        assert!(rig.stats.warnings.is_empty());
    }

    #[test]
    fn a_function_hooked_another_way_elsewhere_says_both() {
        let planted = |how: How| Planted {
            module: "/lib/libc.so.6".to_string(),
            ops: vec!["malloc"],
            how,
        };
        let mut stats = TraceStats::default();
        stats.note_planted(7, vec![planted(How::Jump)]);
        stats.note_planted(8, vec![planted(How::Jump)]);
        stats.note_planted(9, vec![planted(How::Int3(None))]);
        stats.note_planted(10, vec![planted(How::Int3(None))]);
        assert_eq!(
            stats.probes,
            [(
                "libc.so.6:malloc".to_string(),
                "jump; in process 9: int3".to_string()
            )]
        );
    }

    #[test]
    fn a_way_of_hooking_is_noted_once() {
        let how = "jump; in process 7: int3: no memory shared with memptrace";
        assert!(noted(how, "jump"));
        assert!(noted(how, "int3: no memory shared with memptrace"));
        assert!(!noted(how, "int3"));
        assert!(!noted("jump", "int3"));
    }
}
