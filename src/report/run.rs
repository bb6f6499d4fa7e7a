//! The report commands, start to end: open the trace, analyse it, write
//! what was asked. `session` calls these; they print to stdout (reports)
//! or write the files named (pictures, profiles).

use std::path::Path;

use super::aggregated::TraceMode;
use super::scan::Analysis;
use super::stacks::StackTable;
use super::summary::Summary;
use super::text::Style;
use super::{
    ExportOptions, FlamegraphOptions, Format, PlotOptions, ReportError, ReportOptions, Trace,
    WindowOptions, check_output, flame, open, parquet, plot, pprof, print, text, window,
    write_file,
};

fn json(value: &impl serde::Serialize) -> Result<String, ReportError> {
    let mut text = serde_json::to_string_pretty(value).map_err(ReportError::Json)?;
    text.push('\n');
    Ok(text)
}

/// The traced command, for titles.
fn command(trace: &Trace) -> Result<String, ReportError> {
    Ok(trace
        .meta("command")?
        .unwrap_or_else(|| trace.path.display().to_string()))
}

/// The analysis of a trace: from its aggregate tables when it has them,
/// else by a pass over the events (and a second up to the peak when
/// `peak` is needed).
fn analysis_for(trace: &Trace, peak: bool) -> Result<Analysis, ReportError> {
    if let Some(a) = Analysis::from_aggregates(trace)? {
        return Ok(a);
    }
    let mut a = Analysis::run(trace)?;
    if peak {
        a.add_peak(trace)?;
    }
    Ok(a)
}

/// `memptrace report`.
pub fn run_report(path: &Path, options: &ReportOptions) -> Result<(), ReportError> {
    let trace = open(path)?;
    let analysis = Analysis::load(&trace)?;
    let table = StackTable::load(&trace, &options.wrappers)?;
    let summary = Summary::build(&trace, &analysis, &table, options.top)?;
    let out = match options.format {
        Format::Json => json(&summary)?,
        Format::Text => text::render(
            &summary,
            Style::new(options.color),
            options.frames,
            options.top,
        ),
    };
    print(&out)
}

/// `memptrace flamegraph`.
pub fn run_flamegraph(path: &Path, options: &FlamegraphOptions) -> Result<(), ReportError> {
    check_output(path, &options.output)?;
    let trace = open(path)?;
    let analysis = analysis_for(&trace, options.metric == super::Metric::Peak)?;
    let table = StackTable::load(&trace, &options.wrappers)?;
    let lines = flame::folded(&analysis, &table, options.metric);
    let title = format!(
        "memptrace: {} of {}",
        options.metric.describe(),
        command(&trace)?
    );
    let svg = flame::svg(&lines, options.metric, &title)?;
    write_file(&options.output, &svg)
}

/// `memptrace plot`.
pub fn run_plot(path: &Path, options: &PlotOptions) -> Result<(), ReportError> {
    check_output(path, &options.output)?;
    plot::Picture::of(&options.output)?;
    let trace = open(path)?;
    // An aggregate trace has no events: its heap over time is by bucket.
    let analysis = match TraceMode::of(&trace)? {
        TraceMode::Aggregate { resolution_ns } => match Analysis::from_aggregates(&trace)? {
            Some(mut a) => {
                a.add_timeline(&trace, resolution_ns)?;
                a
            }
            None => Analysis::run(&trace)?,
        },
        TraceMode::Full => Analysis::run(&trace)?,
    };
    let memory = plot::resident(&trace)?;
    let title = format!("memptrace: {}", command(&trace)?);
    plot::draw(
        &options.output,
        &analysis,
        &memory,
        &title,
        (options.width, options.height),
    )
}

/// `memptrace export`.
pub fn run_export(path: &Path, options: &ExportOptions) -> Result<(), ReportError> {
    for output in options.pprof.iter().chain(&options.collapsed) {
        check_output(path, output)?;
    }
    let trace = open(path)?;
    if options.pprof.is_some() || options.collapsed.is_some() {
        export_profiles(&trace, options)?;
    }
    if let Some(dir) = &options.parquet {
        let (id, derived) = parquet::trace_id(&trace)?;
        if derived {
            eprintln!(
                "memptrace: {}: the trace has no trace_id (an older memptrace wrote it): exported as {id}, derived from its pid, started_at and command",
                path.display()
            );
        }
        parquet::export(&trace, dir, &id)?;
    }
    Ok(())
}

/// `export --pprof` and `--collapsed`: from one analysis.
fn export_profiles(trace: &Trace, options: &ExportOptions) -> Result<(), ReportError> {
    let peak = options.collapsed.is_some() && options.metric == super::Metric::Peak;
    let analysis = analysis_for(trace, peak)?;
    let table = StackTable::load(trace, &options.wrappers)?;
    if let Some(out) = &options.pprof {
        let profile = pprof::profile(trace, &analysis, &table)?;
        let bytes = pprof::encode(&profile).map_err(|source| ReportError::Write {
            path: out.clone(),
            source,
        })?;
        write_file(out, &bytes)?;
    }
    if let Some(out) = &options.collapsed {
        let lines = flame::folded(&analysis, &table, options.metric);
        write_file(out, flame::folded_text(&lines).as_bytes())?;
    }
    Ok(())
}

/// `memptrace window`.
pub fn run_window(path: &Path, options: &WindowOptions) -> Result<(), ReportError> {
    let trace = open(path)?;
    if let TraceMode::Aggregate { .. } = TraceMode::of(&trace)? {
        return Err(ReportError::NotInTrace {
            path: trace.path.clone(),
            what: "recorded with --aggregate: a window needs the single calls, which the trace does not have (its heap over time per stack is in agg_over_time)".to_string(),
        });
    }
    let clamp = |ns: u64| ns.min(i64::MAX as u64) as i64;
    let (from_ns, to_ns) = (clamp(options.from_ns), clamp(options.to_ns));
    // A window past the end of the trace is cut there, and said so.
    let (end, finished) = window::trace_end(&trace)?;
    let reach = if finished {
        "ends at"
    } else {
        "reaches, so far,"
    };
    if from_ns > end {
        return Err(ReportError::NotInTrace {
            path: trace.path.clone(),
            what: format!(
                "the trace {reach} {}, before --from {}: the window holds nothing",
                text::seconds(end),
                text::seconds(from_ns)
            ),
        });
    }
    let to_ns = if to_ns > end {
        eprintln!(
            "memptrace: warning: the trace {reach} {}, before --to {}: the window ends there",
            text::seconds(end),
            text::seconds(to_ns)
        );
        end
    } else {
        to_ns
    };
    let table = StackTable::load(&trace, &options.report.wrappers)?;
    let report = window::analyse(&trace, &table, from_ns, to_ns, options.report.top)?;
    let out = match options.report.format {
        Format::Json => json(&report)?,
        Format::Text => window::render(
            &report,
            Style::new(options.report.color),
            options.report.frames,
        ),
    };
    print(&out)
}

/// `memptrace heapmap TRACE`: a stored snapshot. (A live process is read
/// by `session`, which hands the map to [`show_heapmap`].)
pub fn run_heapmap(
    path: &Path,
    snapshot: Option<i64>,
    options: &super::heapmap::HeapmapOptions,
) -> Result<(), ReportError> {
    if let Some(output) = &options.output {
        check_output(path, output)?;
    }
    let trace = open(path)?;
    let report = super::heapmap::HeapReport::load(&trace, snapshot)?;
    show_heapmap(&report, options)
}

/// Print a heap map, and draw it when asked.
pub fn show_heapmap(
    report: &super::heapmap::HeapReport,
    options: &super::heapmap::HeapmapOptions,
) -> Result<(), ReportError> {
    if let Some(output) = &options.output {
        super::heapdraw::draw(output, report)?;
    }
    print(&report.render(options.format)?)
}
