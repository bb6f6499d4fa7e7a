//! Pictures of a trace with plotters: the heap in use over time with the
//! peak marked, with the processes' resident set (all of it, and its
//! anonymous part) and mapped memory on the same time axis when the trace
//! sampled them (table `rss`), above a log-log histogram of the sizes
//! requested. SVG or PNG, by the output file's extension.
//!
//! Mapped memory often dwarfs the rest (a thread's stack reserves 8 MiB, a
//! glibc arena 64 MiB, before a byte is used): when its peak is more than
//! [`SHARED_AXIS_RATIO`] times the largest of the others, it is drawn
//! against an axis of its own, on the right, so heap and RSS stay readable.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (plotters'
//! `ab_glyph` backend), so a PNG needs no fontconfig and no system fonts.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::scan::Analysis;
use super::text::{bytes, count, seconds};
use super::{ReportError, Trace};

/// The picture formats, by extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Picture {
    Svg,
    Png,
}

impl Picture {
    pub fn of(path: &Path) -> Result<Picture, ReportError> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("svg") => Ok(Picture::Svg),
            Some("png") => Ok(Picture::Png),
            _ => Err(ReportError::Output {
                path: path.to_path_buf(),
                what: "unknown picture format; name the file .svg or .png".to_string(),
            }),
        }
    }
}

pub(super) const FONT: &str = "sans-serif";

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is compiled in and known to parse: a failure here would
        // show as missing text, never as a crash.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Mapped memory shares the left axis with heap and RSS while its peak is
/// at most this many times theirs.
pub const SHARED_AXIS_RATIO: u64 = 4;

/// The memory of the traced processes at one sample, summed over them
/// (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    pub ts_ns: i64,
    pub rss: u64,
    pub anon: u64,
    pub mapped: u64,
}

/// The `rss` samples of a trace, each round's processes summed; none for a
/// trace without the table (older) or sampling (`--rss-interval 0`).
pub fn resident(trace: &Trace) -> Result<Vec<Resident>, ReportError> {
    let exists: i64 = trace
        .conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'rss'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| trace.err(e))?;
    if exists == 0 {
        return Ok(Vec::new());
    }
    // The rows of one round share ts_ns (see sampler).
    let mut stmt = trace
        .conn
        .prepare(
            "SELECT ts_ns, sum(rss), sum(anon), sum(mapped) FROM rss
             GROUP BY ts_ns ORDER BY ts_ns",
        )
        .map_err(|e| trace.err(e))?;
    let rows = stmt
        .query_map([], |r| {
            let bytes = |i| r.get::<_, i64>(i).map(|v| v.max(0) as u64);
            Ok(Resident {
                ts_ns: r.get(0)?,
                rss: bytes(1)?,
                anon: bytes(2)?,
                mapped: bytes(3)?,
            })
        })
        .map_err(|e| trace.err(e))?;
    rows.collect::<Result<_, _>>().map_err(|e| trace.err(e))
}

/// Draw the plot into `path`.
pub fn draw(
    path: &Path,
    analysis: &Analysis,
    memory: &[Resident],
    title: &str,
    size: (u32, u32),
) -> Result<(), ReportError> {
    render(
        path,
        size,
        &Plot {
            analysis,
            memory,
            title,
        },
    )
}

/// The plot as a [`Drawing`].
struct Plot<'a> {
    analysis: &'a Analysis,
    memory: &'a [Resident],
    title: &'a str,
}

impl Drawing for Plot<'_> {
    fn draw_on<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_on(root, self.analysis, self.memory, self.title)
    }
}

/// A picture drawn the same way on either backend.
pub(super) trait Drawing {
    fn draw_on<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String>;
}

/// Draw `drawing` into `path`, SVG or PNG by its extension.
pub(super) fn render(
    path: &Path,
    (width, height): (u32, u32),
    drawing: &impl Drawing,
) -> Result<(), ReportError> {
    register_font();
    let failed = |e: String| ReportError::Output {
        path: path.to_path_buf(),
        what: format!("drawing failed: {e}"),
    };
    match Picture::of(path)? {
        Picture::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
                drawing.draw_on(&root).map_err(failed)?;
                root.present().map_err(|e| failed(e.to_string()))?;
            }
            super::write_file(path, svg.as_bytes())
        }
        Picture::Png => {
            // plotters writes the file itself when the area is presented.
            let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
            drawing.draw_on(&root).map_err(failed)?;
            root.present().map_err(|e| failed(e.to_string()))
        }
    }
}

/// A unit for the heap axis: the largest that keeps the peak above 1.
fn unit(peak: u64) -> (f64, &'static str) {
    match peak {
        p if p >= 1 << 30 => ((1u64 << 30) as f64, "GiB"),
        p if p >= 1 << 20 => ((1u64 << 20) as f64, "MiB"),
        p if p >= 1 << 10 => (1024.0, "KiB"),
        _ => (1.0, "bytes"),
    }
}

/// The heap in use as a step line: each slice of the timeline rises to
/// its largest value and ends at its last.
fn heap_points(analysis: &Analysis, scale: f64) -> Vec<(f64, f64)> {
    let s = |ns: i64| ns as f64 / 1e9;
    let mut points = vec![(0.0, 0.0)];
    let mut last = 0.0;
    for slice in &analysis.timeline {
        points.push((s(slice.first_ns), last));
        points.push((s(slice.first_ns), slice.max_bytes as f64 / scale));
        last = slice.last_bytes as f64 / scale;
        points.push((s(slice.last_ns), last));
    }
    points.push((s(analysis.last_ns), last));
    points
}

/// Where mapped memory is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MappedAxis {
    /// No samples: not drawn.
    None,
    /// With heap and RSS, on the left.
    Shared,
    /// Against an axis of its own, on the right.
    Own,
}

fn mapped_axis(heap_peak: u64, memory: &[Resident]) -> MappedAxis {
    let Some(mapped) = memory.iter().map(|m| m.mapped).max() else {
        return MappedAxis::None;
    };
    let others = memory
        .iter()
        .map(|m| m.rss)
        .max()
        .unwrap_or(0)
        .max(heap_peak);
    if mapped <= others.saturating_mul(SHARED_AXIS_RATIO) {
        MappedAxis::Shared
    } else {
        MappedAxis::Own
    }
}

/// One sampled quantity as a line, in `scale` units.
fn sampled(memory: &[Resident], scale: f64, value: fn(&Resident) -> u64) -> Vec<(f64, f64)> {
    memory
        .iter()
        .map(|m| (m.ts_ns as f64 / 1e9, value(m) as f64 / scale))
        .collect()
}

/// The largest RSS sample: (bytes, ts_ns).
fn rss_peak(memory: &[Resident]) -> Option<(u64, i64)> {
    memory
        .iter()
        .max_by_key(|m| (m.rss, -m.ts_ns))
        .map(|m| (m.rss, m.ts_ns))
}

/// The legend's sample of a line drawn in `style`.
fn swatch(style: ShapeStyle) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style)
}

/// Draw `points` as a line against the left axis, with a legend entry.
fn line<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    points: Vec<(f64, f64)>,
    style: ShapeStyle,
    legend: ShapeStyle,
    label: &str,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .draw_series(LineSeries::new(points, style))?
        .label(label)
        .legend(swatch(legend));
    Ok(())
}

fn draw_on<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    analysis: &Analysis,
    memory: &[Resident],
    title: &str,
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let root = root.titled(title, (FONT, 22).into_font()).map_err(e)?;
    let height = root.dim_in_pixel().1;
    let (upper, lower) = root.split_vertically((height as f64 * 0.58) as u32);

    // Heap in use over time, with resident and mapped memory when sampled.
    let peak = analysis.peak;
    let axis = mapped_axis(peak.bytes, memory);
    let max_mapped = memory.iter().map(|m| m.mapped).max().unwrap_or(0);
    let left_max = memory
        .iter()
        .map(|m| m.rss)
        .chain([peak.bytes])
        .chain((axis == MappedAxis::Shared).then_some(max_mapped))
        .max()
        .unwrap_or(0);
    let (scale, unit_name) = unit(left_max);
    let (right_scale, right_unit) = unit(max_mapped);
    let last_ns = memory
        .last()
        .map_or(analysis.last_ns, |m| m.ts_ns.max(analysis.last_ns));
    let x_max = (last_ns.max(1) as f64 / 1e9) * 1.02;
    let y_max = (left_max as f64 / scale).max(1.0) * 1.15;
    let caption = match rss_peak(memory) {
        Some((rss, at)) => format!(
            "Heap in use and memory over time: heap peak {} at {}, RSS peak {} at {}",
            bytes(peak.bytes),
            seconds(peak.ts_ns),
            bytes(rss),
            seconds(at)
        ),
        None => format!(
            "Heap in use over time: peak {} at {}",
            bytes(peak.bytes),
            seconds(peak.ts_ns)
        ),
    };
    let mut chart = ChartBuilder::on(&upper)
        .caption(caption, (FONT, 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .right_y_label_area_size(if axis == MappedAxis::Own { 64 } else { 0 })
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(e)?
        .set_secondary_coord(
            0f64..x_max,
            0f64..(max_mapped as f64 / right_scale).max(1.0) * 1.15,
        );
    chart
        .configure_mesh()
        .x_desc("seconds since the trace started")
        .y_desc(if memory.is_empty() {
            format!("in use ({unit_name})")
        } else {
            format!("bytes ({unit_name})")
        })
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()
        .map_err(e)?;
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(255, 127, 14);
    let green = RGBColor(44, 160, 44);
    let grey = RGBColor(110, 110, 110);
    chart
        .draw_series(AreaSeries::new(
            heap_points(analysis, scale),
            0.0,
            blue.mix(0.25),
        ))
        .map_err(e)?;
    let heap_line = blue.stroke_width(1);
    line(
        &mut chart,
        heap_points(analysis, scale),
        heap_line,
        blue.stroke_width(2),
        "heap in use (requested)",
    )
    .map_err(e)?;
    let mapped = grey.stroke_width(1);
    let mut lines = Vec::new();
    if !memory.is_empty() {
        let rss = orange.stroke_width(2);
        lines.push((sampled(memory, scale, |m| m.rss), rss, "resident (RSS)"));
        let anon = green.stroke_width(2);
        lines.push((
            sampled(memory, scale, |m| m.anon),
            anon,
            "resident anonymous",
        ));
    }
    if axis == MappedAxis::Shared {
        lines.push((sampled(memory, scale, |m| m.mapped), mapped, "mapped"));
    }
    for (points, style, label) in lines {
        line(&mut chart, points, style, style, label).map_err(e)?;
    }
    if axis == MappedAxis::Own {
        chart
            .configure_secondary_axes()
            .y_desc(format!("mapped ({right_unit})"))
            .label_style((FONT, 12))
            .axis_desc_style((FONT, 13))
            .draw()
            .map_err(e)?;
        chart
            .draw_secondary_series(LineSeries::new(
                sampled(memory, right_scale, |m| m.mapped),
                mapped,
            ))
            .map_err(e)?
            .label("mapped (right axis)")
            .legend(swatch(mapped));
    }
    if !memory.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(grey.mix(0.5))
            .label_font((FONT, 12))
            .draw()
            .map_err(e)?;
    }
    if peak.event > 0 {
        let at = (peak.ts_ns as f64 / 1e9, peak.bytes as f64 / scale);
        chart
            .draw_series(std::iter::once(Circle::new(at, 5, RED.filled())))
            .map_err(e)?;
        // The label goes left of the marker when the peak is near the end.
        let dx = if at.0 > x_max * 0.6 { -230 } else { 8 };
        chart
            .draw_series(std::iter::once(
                EmptyElement::at(at)
                    + Text::new(
                        format!("peak {} at {}", bytes(peak.bytes), seconds(peak.ts_ns)),
                        (dx, -18),
                        (FONT, 13).into_font().color(&RED),
                    ),
            ))
            .map_err(e)?;
    }

    // Request sizes, log-log: bucket i holds [2^(i-1), 2^i).
    let buckets: Vec<(usize, u64)> = analysis
        .sizes
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, n)| **n > 0)
        .map(|(i, n)| (i, *n))
        .collect();
    let lo = |i: usize| 2f64.powi(i as i32 - 1);
    let x_range = match (buckets.first(), buckets.last()) {
        (Some(first), Some(last)) => lo(first.0)..lo(last.0 + 1),
        _ => 1.0..2.0,
    };
    let y_top = buckets.iter().map(|b| b.1).max().unwrap_or(1) as f64 * 2.0;
    // The bars stand on half a decade below 1, so a size with one block
    // shows as a bar, not as a line on the axis.
    let floor = 0.3;
    let zero = analysis.sizes[0];
    let caption = if zero > 0 {
        format!(
            "Requested sizes of {} blocks ({} of 0 bytes not shown)",
            count(analysis.blocks),
            count(zero)
        )
    } else {
        format!("Requested sizes of {} blocks", count(analysis.blocks))
    };
    let mut chart = ChartBuilder::on(&lower)
        .caption(caption, (FONT, 16))
        .margin(12)
        // Room for the last size label, centred on the right edge.
        .margin_right(36)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range.log_scale().base(2.0), (floor..y_top).log_scale())
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("bytes requested")
        .y_desc("blocks")
        .x_label_formatter(&|v| bytes(v.round() as u64))
        .y_label_formatter(&|v| count(v.round() as u64))
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(buckets.iter().map(|&(i, n)| {
            Rectangle::new(
                [(lo(i), floor), (lo(i + 1), n as f64)],
                blue.mix(0.7).filled(),
            )
        }))
        .map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_by_extension() {
        assert_eq!(Picture::of(Path::new("a/heap.svg")).unwrap(), Picture::Svg);
        assert_eq!(Picture::of(Path::new("HEAP.PNG")).unwrap(), Picture::Png);
        assert!(Picture::of(Path::new("heap.jpg")).is_err());
        assert!(Picture::of(Path::new("heap")).is_err());
    }

    fn at(mapped: u64, rss: u64) -> Resident {
        Resident {
            ts_ns: 0,
            rss,
            anon: rss / 2,
            mapped,
        }
    }

    #[test]
    fn mapped_memory_gets_its_own_axis_when_it_dwarfs_the_rest() {
        assert_eq!(mapped_axis(10, &[]), MappedAxis::None);
        assert_eq!(mapped_axis(10, &[at(40, 10)]), MappedAxis::Shared);
        assert_eq!(mapped_axis(10, &[at(41, 10)]), MappedAxis::Own);
        // The heap's peak counts as much as RSS.
        assert_eq!(mapped_axis(100, &[at(400, 1)]), MappedAxis::Shared);
    }

    #[test]
    fn the_rss_peak_is_the_first_largest_sample() {
        let mut samples = vec![at(0, 5), at(0, 9), at(0, 9)];
        for (i, s) in samples.iter_mut().enumerate() {
            s.ts_ns = i as i64;
        }
        assert_eq!(rss_peak(&samples), Some((9, 1)));
        assert_eq!(rss_peak(&[]), None);
    }

    #[test]
    fn units_keep_the_peak_readable() {
        assert_eq!(unit(10).1, "bytes");
        assert_eq!(unit(5000).1, "KiB");
        assert_eq!(unit(3 << 20).1, "MiB");
    }
}
