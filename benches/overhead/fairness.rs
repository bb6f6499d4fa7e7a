//! Fairness (issue #10, item 3): threads allocating flat out for a fixed
//! time, each counting its iterations, untraced and under memptrace with
//! both probe kinds. A tracer that serves its stopped threads unfairly
//! shows as a max/min far above the untraced one.

use std::path::Path;

use crate::loops;
use crate::runs::{self, Load, Tool};
use crate::tables::FairRow;

/// One fixed-time run untraced and one under each probe kind; each trace
/// checked to hold every call the threads counted, with its whole stack.
pub fn measure(tracee: &Path, load: Load, dir: &Path) -> Result<Vec<FairRow>, String> {
    let mut rows = Vec::new();
    for (i, tool) in [Tool::Plain, loops::jump(), loops::int3()]
        .iter()
        .enumerate()
    {
        let outcome = runs::run(tracee, load, tool, &dir.join(format!("fair{i}")))?;
        let iterations = outcome.own.map(|o| o.iterations).unwrap_or_default();
        let Load::Fair { threads, .. } = load else {
            return Err("fairness needs a fixed-time load".into());
        };
        if iterations.len() != threads as usize {
            return Err(format!(
                "{}: {} thread counts printed, {threads} threads",
                tool.label(),
                iterations.len()
            ));
        }
        let pairs: u64 = iterations.iter().sum();
        let recorded = match &outcome.db {
            Some(db) => {
                let facts = runs::check_trace(db, pairs)?;
                if facts.full_stacks != 2 * pairs || facts.min_frames.unwrap_or(0) < load.frames() {
                    return Err(format!(
                        "{}: {} of {} calls with a whole stack (≥ {} frames; fewest {:?})",
                        tool.label(),
                        facts.full_stacks,
                        2 * pairs,
                        load.frames(),
                        facts.min_frames
                    ));
                }
                Some(2 * pairs)
            }
            None => None,
        };
        rows.push(FairRow {
            label: tool.label().into(),
            iterations,
            recorded,
        });
    }
    Ok(rows)
}
