//! Pictures of a trace with plotters: the heap in use over time with the
//! peak marked, above a log-log histogram of the sizes requested. SVG or
//! PNG, by the output file's extension.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (plotters'
//! `ab_glyph` backend), so a PNG needs no fontconfig and no system fonts.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::ReportError;
use super::scan::Analysis;
use super::text::{bytes, count, seconds};

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

/// Draw the plot into `path`.
pub fn draw(
    path: &Path,
    analysis: &Analysis,
    title: &str,
    size: (u32, u32),
) -> Result<(), ReportError> {
    render(path, size, &Plot { analysis, title })
}

/// The plot as a [`Drawing`].
struct Plot<'a> {
    analysis: &'a Analysis,
    title: &'a str,
}

impl Drawing for Plot<'_> {
    fn draw_on<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_on(root, self.analysis, self.title)
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

fn draw_on<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    analysis: &Analysis,
    title: &str,
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let root = root.titled(title, (FONT, 22).into_font()).map_err(e)?;
    let height = root.dim_in_pixel().1;
    let (upper, lower) = root.split_vertically((height as f64 * 0.58) as u32);

    // Heap in use over time.
    let peak = analysis.peak;
    let (scale, unit_name) = unit(peak.bytes);
    let x_max = (analysis.last_ns.max(1) as f64 / 1e9) * 1.02;
    let y_max = (peak.bytes as f64 / scale).max(1.0) * 1.15;
    let mut chart = ChartBuilder::on(&upper)
        .caption(
            format!(
                "Heap in use over time: peak {} at {}",
                bytes(peak.bytes),
                seconds(peak.ts_ns)
            ),
            (FONT, 16),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the trace started")
        .y_desc(format!("in use ({unit_name})"))
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()
        .map_err(e)?;
    let blue = RGBColor(31, 119, 180);
    chart
        .draw_series(AreaSeries::new(
            heap_points(analysis, scale),
            0.0,
            blue.mix(0.25),
        ))
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(
            heap_points(analysis, scale),
            blue.stroke_width(1),
        ))
        .map_err(e)?;
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

    #[test]
    fn units_keep_the_peak_readable() {
        assert_eq!(unit(10).1, "bytes");
        assert_eq!(unit(5000).1, "KiB");
        assert_eq!(unit(3 << 20).1, "MiB");
    }
}
