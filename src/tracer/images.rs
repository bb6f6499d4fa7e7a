//! A process's images: found at exec and at every stop on the dynamic
//! linker's hook, hooked, announced to the unwinders and the pipeline, and
//! forgotten when unmapped or replaced by an exec.

use super::process::{Process, Role};
use super::space::images::LoadedModule;
use super::space::{Changes, Planted, Space};
use super::{TraceError, Tracer};
use crate::os::ptrace::{self, Tid};
use crate::sink::Record;
use crate::trace_msg::TraceMsg;
use crate::unwind::libunwind::LibunwindUnwinder;
use crate::unwind::{Unwinder, UnwinderKind};

impl Tracer {
    pub(super) fn exec(&mut self, tid: Tid) -> Result<(), TraceError> {
        let pid = self.family.pid_of(tid).unwrap_or(tid);
        // Every other thread of the process is gone (`ptrace(2)`, "execve(2)
        // under ptrace"); the exec'ing thread now has the leader's tid.
        for t in self.family.threads_of(pid) {
            if t != tid {
                self.book
                    .settle_copy(&mut self.family, &mut self.target, t, false);
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
                self.end_sharing(pid);
                self.family.processes.remove(&pid);
                self.family.threads.remove(&tid);
                return Ok(ptrace::unless_gone(ptrace::detach(tid, 0))?);
            }
            Some(Role::Traced) => {
                self.book
                    .drain_process(&mut self.family, &mut self.stats, pid, true);
                self.stats.count_probes(&mut self.family, pid);
                self.forget_images(pid);
                // The exec released the old image's blocks: not leaks.
                let alloc_ids = self.book.ledger.forget_process(pid as u32);
                if !alloc_ids.is_empty() {
                    let ts_ns = self.now_ns();
                    self.book.out.push(TraceMsg::Record(Record::ExecReleased {
                        pid: pid as u32,
                        ts_ns,
                        alloc_ids,
                    }));
                }
            }
            Some(Role::Shares { .. }) => self.end_sharing(pid),
            _ => {}
        }
        // A new address space: what was known of the old one goes.
        let space = Space::new(pid, self.catch())?;
        self.family
            .processes
            .entry(pid)
            .or_insert_with(|| Process::new(Role::Traced, None))
            .exec(space);
        self.send_thread(tid, None);
        let signals = self.refresh_images(pid, tid)?;
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
        self.resume_with(tid, signals)
    }

    /// Warn, once per process, when a traced process has no allocator
    /// function memptrace could hook: its calls are not recorded.
    pub(super) fn warn_if_unhooked(&mut self, pid: Tid) {
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
    pub(super) fn refresh_images(&mut self, pid: Tid, tid: Tid) -> Result<Vec<i32>, TraceError> {
        let Some(space) = self
            .family
            .processes
            .get_mut(&pid)
            .and_then(|p| p.space.as_mut())
        else {
            return Ok(Vec::new());
        };
        let changes = space.refresh(tid, &mut self.book.next_module_id)?;
        let hooked = space.hooks.allocators() as u64;
        let areas = space.area_ranges();
        let Changes {
            added,
            removed,
            signals,
            warnings,
            planted,
        } = changes;
        self.note_planted(pid, planted);
        self.send(TraceMsg::Trampolines {
            pid: pid as u32,
            areas,
        });
        let now = self.now_ns();
        for module in removed {
            self.send(TraceMsg::ImageGone {
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
            self.announce_image(pid, &module, now);
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

    /// Keep how process `pid` hooked its allocator functions, for `meta`:
    /// where another process hooked the same function another way (an
    /// exec'd program, a child), the row says both.
    pub(super) fn note_planted(&mut self, pid: Tid, planted: Vec<Planted>) {
        for p in planted {
            let image = crate::util::file_name(&p.module).to_string();
            let this = p.how.to_string();
            for op in p.ops {
                let key = format!("{image}:{op}");
                match self.stats.probes.iter_mut().find(|(k, _)| *k == key) {
                    None => self.stats.probes.push((key, this.clone())),
                    Some((_, how)) if noted(how, &this) => {}
                    Some((_, how)) => *how = format!("{how}; in process {pid}: {this}"),
                }
            }
        }
    }

    /// Tell the unwinders and the pipeline about an image of process `pid`.
    pub(super) fn announce_image(&mut self, pid: Tid, module: &LoadedModule, now: u64) {
        let mapped = module.mapped();
        if let Some(lu) = self.libunwind_of(pid) {
            lu.add_image(&mapped);
        }
        self.send(TraceMsg::Image {
            pid: pid as u32,
            mapped,
            record: module.record(pid, now),
        });
    }

    fn forget_images(&mut self, pid: Tid) {
        let Some(space) = self
            .family
            .processes
            .get(&pid)
            .and_then(|p| p.space.as_ref())
        else {
            return;
        };
        let now = self.now_ns();
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

/// True when the `meta` value `how` says `this` already (see
/// [`Tracer::note_planted`]).
fn noted(how: &str, this: &str) -> bool {
    how.split("; ")
        .any(|part| part == this || part.ends_with(&format!(": {this}")))
}

#[cfg(test)]
mod tests {
    use super::noted;

    #[test]
    fn a_way_of_hooking_is_noted_once() {
        let how = "jump; in process 7: int3: no memory shared with memptrace";
        assert!(noted(how, "jump"));
        assert!(noted(how, "int3: no memory shared with memptrace"));
        assert!(!noted(how, "int3"));
        assert!(!noted("jump", "int3"));
    }
}
