//! The return paths of the allocator probes, as unwind rows: a mapping call
//! made inside an allocator call (malloc's mmap) is recorded by its own
//! probe while the allocator function runs, called by its probe's `call`
//! (see `probes::jump::code`). Its stack walk meets that probe's return
//! path, where no image's CFI says anything; these rows tell it that the
//! caller's return address is the word above the slot's address there
//! (CFA = rsp + 16, rbp unchanged), so the stack goes on to the program's
//! frames, as an int3 probe's would. memptrace leaves the return path's own
//! address out of the stack (see `Booking::book_map`).

use super::Space;
use crate::tracer::probes::Probe;
use crate::unwind::tables::{UnwindTable, rule};

impl Space {
    /// Publish the return paths of the jump probes in each trampoline area
    /// as that area's unwind table, in a launch as in an attach: the walk of
    /// a mapping call made inside an allocator call goes through them.
    pub(super) fn publish_return_paths(&mut self) {
        let areas = self.area_ranges();
        let mut returns: Vec<u64> = self
            .hooks
            .iter()
            .filter_map(|h| match &h.probe {
                Probe::Jump { code, .. } => code.ret_path,
                _ => None,
            })
            .collect();
        returns.sort_unstable();
        let Some(control) = self.probing.control_mut() else {
            return;
        };
        for area in areas {
            let mut table = UnwindTable::default();
            for &r in returns.iter().filter(|r| area.contains(r)) {
                // The row of the call before the return path (the walk
                // looks up ip - 1), then nothing past it.
                let Ok(at) = u32::try_from(r - area.start) else {
                    continue;
                };
                let Some(call) = at.checked_sub(1) else {
                    continue;
                };
                if table.keys.last().is_none_or(|&k| k < call) {
                    if table.keys.is_empty() && call > 0 {
                        table.keys.push(0);
                        table.rules.push(rule::UNSUPPORTED);
                    }
                    table.keys.push(call);
                    table.rules.push(16);
                    table.keys.push(at);
                    table.rules.push(rule::UNSUPPORTED);
                }
            }
            // Published again only when it changed: a directory is
            // rewritten `DIR_COUNT` changes later, under a probe that may
            // still walk it.
            let start = area.start;
            if table.is_empty() || self.return_rows.get(&start) == Some(&table.len()) {
                continue;
            }
            self.return_rows.insert(start, table.len());
            control.add_image(area, start, &table);
        }
    }
}
