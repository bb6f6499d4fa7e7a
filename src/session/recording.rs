//! A trace being recorded: the recorder, the namer, the sampler and the
//! progress line, and the end's rows.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::cli::TraceConfig;
use crate::error::Error;
use crate::heap::Facts;
use crate::namer::Namer;
use crate::os::procfs;
use crate::os::signals;
use crate::progress::{Progress, ProgressLine};
use crate::sampler::{Sampler, Watchlist};
use crate::sink::{Record, RecordSender, Recorder, SqliteSink};
use crate::symbols::debuginfod::Debuginfod;
use crate::tracer::{Ending, TraceStats, Tracer, signal_name};
use crate::unwind::UnwinderKind;
use crate::unwind::pipeline::PipelineHandle;
use crate::wrappers::Wrappers;

use super::TICK;
use super::output::{discard, end_reason, meta_record, numbered_rows};

/// A trace being recorded: the recorder thread and what the session needs
/// to end it.
///
/// Fields drop in order: every sender (the sampler holds one) before the
/// recorder, which waits for them all.
pub(super) struct Recording {
    /// Samples resident memory (`--rss-interval`), unless it is 0.
    sampler: Option<Sampler>,
    /// Names the frames the pipeline hands it, as the trace goes.
    namer: Namer,
    /// The debuginfod servers the namer asks (for their warning).
    debuginfod: Option<Debuginfod>,
    pub(super) records: RecordSender,
    recorder: Recorder,
    pub(super) clock: Instant,
    pub(super) progress: Arc<Progress>,
    /// What heap maps need of C libraries: the namer reads it ahead for
    /// the tracer.
    pub(super) heap_facts: Facts,
    /// Progress may be drawn: on a terminal the program does not write to.
    draw: bool,
}

impl Recording {
    pub(super) fn start(
        sink: SqliteSink,
        pid: i32,
        config: &TraceConfig,
        wrappers: Wrappers,
    ) -> Result<Recording, Error> {
        let interval = Duration::from_millis(config.rss_interval_ms);
        let watchlist = (!interval.is_zero()).then(Watchlist::new);
        let recorder = match &watchlist {
            // The sampler learns the processes (-f children too) from the
            // thread records the trace writes.
            Some(list) => Recorder::spawn_observed(Box::new(sink), list.observer()),
            None => Recorder::spawn(Box::new(sink)),
        };
        let records = recorder.sender();
        records.send(vec![meta_record("pid", pid.to_string())])?;
        let clock = Instant::now();
        let sampler = watchlist.map(|list| {
            // A launched program is sampled from its exec on (see sampler).
            list.watch(pid as u32);
            Sampler::start(list, interval, clock, records.clone())
        });
        let debuginfod = Debuginfod::from_env();
        let progress = Arc::new(Progress {
            halt: recorder.halt(),
            ..Progress::default()
        });
        let heap_facts = Facts::default();
        Ok(Recording {
            namer: Namer::spawn(
                records.clone(),
                wrappers,
                debuginfod.clone(),
                heap_facts.clone(),
            ),
            heap_facts,
            debuginfod,
            recorder,
            records,
            clock,
            progress,
            draw: terminal_free(pid),
            sampler,
        })
    }

    /// The pipeline thread between the tracer and the recorder.
    pub(super) fn pipeline(&self, config: &TraceConfig) -> PipelineHandle {
        PipelineHandle::spawn(
            self.records.clone(),
            config.stacks && config.unwinder == UnwinderKind::Framehop,
            config.stacks,
            config.max_depth,
            Some(self.namer.sender()),
        )
    }

    /// Run the tracer to its end, with the progress line and memptrace's own
    /// signals live meanwhile.
    pub(super) fn trace(
        &self,
        tracer: Tracer,
    ) -> Result<(Ending, TraceStats, PipelineHandle), Error> {
        let line = ProgressLine::start(self.progress.clone(), self.draw);
        signals::unblock_here(TICK)?;
        let traced = tracer.run();
        signals::quiesce();
        line.finish();
        Ok(traced?)
    }

    /// Why the trace ended because its database could not grow, if it did.
    pub(super) fn halted(&self, ending: &Ending) -> Option<String> {
        let reason = self.progress.halt.get()?;
        matches!(ending, Ending::Detached { .. }).then(|| reason.clone())
    }

    /// Nothing worth keeping was traced: close and remove the database.
    /// Every sender goes before the recorder, which waits for them all.
    pub(super) fn abandon(self, output: &Path) {
        drop(self.sampler);
        drop(self.namer);
        drop(self.records);
        drop(self.recorder);
        discard(output);
    }

    /// Name the frames, write the `meta` rows of the end, close the database.
    pub(super) fn finish(
        self,
        ending: &Ending,
        status: i32,
        stats: &TraceStats,
        pipeline: PipelineHandle,
    ) -> Result<(), Error> {
        // The last sample, as near the end as the trace knows: a detached
        // process's memory as memptrace lets it go.
        if let Some(sampler) = self.sampler {
            sampler.finish();
        }
        // The pipeline's end lets the namer finish (it holds a sender).
        let result = pipeline.finish()?;
        self.namer.finish(self.draw)?;
        let mut end = vec![
            ("ended_at", crate::time::rfc3339(SystemTime::now())),
            ("exit_status", status.to_string()),
            ("end_reason", end_reason(ending)),
            ("events", result.events.to_string()),
            ("images", stats.images.to_string()),
            ("housekeeping_frees", result.housekeeping_frees.to_string()),
            ("truncated_stacks", result.truncated_stacks.to_string()),
            ("nested_calls", stats.nested_calls.to_string()),
            ("lost_returns", stats.lost_returns.to_string()),
            ("copy_faults", stats.copy_faults.to_string()),
            ("walk_faults", stats.walk_faults.to_string()),
            ("ring_waits", stats.ring_waits.to_string()),
            ("let_through_calls", stats.let_through.to_string()),
            ("skipped_records", stats.skipped_records.to_string()),
            ("damaged_records", stats.damaged.records.to_string()),
            ("damaged_slots", stats.damaged.slots.to_string()),
            ("dropped_slots", stats.damaged.dropped.to_string()),
            ("heap_walk_errors", stats.heap_walk_errors.to_string()),
            ("duration_ns", self.clock.elapsed().as_nanos().to_string()),
        ];
        if let Some(kib) = procfs::own_peak_rss_kib() {
            end.push(("peak_rss_kib", kib.to_string()));
        }
        if let Ending::Killed { sig, .. } = ending {
            end.push(("exit_signal", signal_name(*sig)));
        }
        let probes: Vec<(String, String)> = stats
            .probes
            .iter()
            .map(|(function, how)| (format!("probe.{function}"), how.clone()))
            .chain(crate::tracer::pauses::meta_rows(&stats.pauses))
            .chain(
                stats
                    .in_probes_at_detach
                    .map(|n| ("detach_threads_in_probes".to_string(), n.to_string())),
            )
            .collect();
        let mut warnings = Vec::new();
        if stats.hooked_functions == 0 {
            warnings
                .push("no allocator function found in any image; nothing was recorded".to_string());
        }
        warnings.extend(stats.warnings.iter().cloned());
        warnings.extend(stats.damaged.warning());
        warnings.extend(self.debuginfod.as_ref().and_then(Debuginfod::warning));
        for warning in &warnings {
            eprintln!("memptrace: warning: {warning}");
        }
        for left in &stats.detach_left {
            eprintln!(
                "memptrace: detach incomplete: {left}; it stays traced until memptrace exits, when the kernel lets it go"
            );
        }
        let rows = end
            .into_iter()
            .map(|(k, v)| meta_record(k, v))
            .chain(
                probes
                    .into_iter()
                    .map(|(k, v)| Record::Meta { key: k, value: v }),
            )
            .chain(numbered_rows("warning", &warnings))
            .chain(numbered_rows("detach_incomplete", &stats.detach_left))
            .collect();
        self.records.send(rows)?;
        drop(self.records);
        self.recorder.finish()?;
        Ok(())
    }
}

/// True when memptrace's stderr is a terminal that neither the stdout nor
/// the stderr of process `pid` writes to: progress drawn there cannot touch
/// the program's output (see `progress`). A launched program inherits
/// memptrace's stderr, so this is false for it whenever stderr is a terminal.
fn terminal_free(pid: i32) -> bool {
    use std::io::IsTerminal;
    let ours = if std::io::stderr().is_terminal() {
        procfs::terminal_of(std::process::id() as i32, 2)
            .ok()
            .flatten()
    } else {
        None
    };
    let program = [procfs::terminal_of(pid, 1), procfs::terminal_of(pid, 2)];
    crate::progress::may_draw(ours, &program)
}
