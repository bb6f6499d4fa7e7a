//! Pictures of a trace with plotters: the heap in use over time with the
//! peak marked, in a panel of its own; the processes' resident set (all of
//! it, and its anonymous part) and mapped memory over the same time in a
//! second panel when the trace sampled them (table `rss`); and a log-log
//! histogram of the sizes requested. SVG or PNG, by the output file's
//! extension. What goes where is decided in `plotmodel`; this
//! module only draws it.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (plotters'
//! `ab_glyph` backend), so a PNG needs no fontconfig and no system fonts.

use std::path::Path;
use std::sync::Once;

use plotters::chart::DualCoordChartContext;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::plotmodel::{BLUE, GREY, Line, Model, Panel, Sizes};
use super::scan::Analysis;
use super::text::{bytes, count};
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
    render(path, size, &Model::of(analysis, memory, title))
}

impl Drawing for Model {
    fn draw_on<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_on(root, self)
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

/// The legend's sample of a line drawn in `style`.
fn swatch(style: ShapeStyle) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style)
}

/// Draw `line` on the chart's left or right axis, with a legend entry.
fn draw_line<DB: DrawingBackend>(
    chart: &mut DualCoordChartContext<
        '_,
        DB,
        Cartesian2d<RangedCoordf64, RangedCoordf64>,
        Cartesian2d<RangedCoordf64, RangedCoordf64>,
    >,
    line: &Line,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let style = line.colour.stroke_width(line.width);
    if line.filled {
        chart.draw_series(AreaSeries::new(
            line.points.clone(),
            0.0,
            line.colour.mix(0.25),
        ))?;
    }
    let points = line.points.clone();
    let annotation = match (line.right, line.dashed) {
        (false, false) => chart.draw_series(LineSeries::new(points, style))?,
        (false, true) => chart.draw_series(DashedLineSeries::new(points, 6, 4, style))?,
        (true, false) => chart.draw_secondary_series(LineSeries::new(points, style))?,
        (true, true) => chart.draw_secondary_series(DashedLineSeries::new(points, 6, 4, style))?,
    };
    annotation.label(line.label.as_str()).legend(swatch(style));
    Ok(())
}

/// Draw one panel over time into `area`.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    x_max: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let right_max = panel.right.as_ref().map_or(1.0, |a| a.max);
    let mut chart = ChartBuilder::on(area)
        .caption(panel.caption.as_str(), (FONT, 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .right_y_label_area_size(if panel.right.is_some() { 64 } else { 0 })
        .build_cartesian_2d(0f64..x_max, 0f64..panel.left.max)?
        .set_secondary_coord(0f64..x_max, 0f64..right_max);
    chart
        .configure_mesh()
        .x_desc("seconds since the trace started")
        .y_desc(panel.left.desc.as_str())
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()?;
    if let Some(right) = &panel.right {
        chart
            .configure_secondary_axes()
            .y_desc(right.desc.as_str())
            .label_style((FONT, 12))
            .axis_desc_style((FONT, 13))
            .draw()?;
    }
    for line in &panel.lines {
        draw_line(&mut chart, line)?;
    }
    if panel.legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(GREY.mix(0.5))
            .label_font((FONT, 12))
            .draw()?;
    }
    if let Some(mark) = &panel.peak {
        chart.draw_series(std::iter::once(Circle::new(mark.at, 5, RED.filled())))?;
        chart.draw_series(std::iter::once(
            EmptyElement::at(mark.at)
                + Text::new(
                    mark.text.clone(),
                    mark.offset,
                    (FONT, 13).into_font().color(&RED),
                ),
        ))?;
    }
    Ok(())
}

fn draw_on<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, model: &Model) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let root = root
        .titled(&model.title, (FONT, 22).into_font())
        .map_err(e)?;
    let height = root.dim_in_pixel().1 as f64;
    // The time panels take 58 % of the height with one panel, 68 % with
    // two; the sizes the rest.
    let time_share = if model.panels.len() > 1 { 0.68 } else { 0.58 };
    let (upper, lower) = root.split_vertically((height * time_share) as u32);
    let areas = upper.split_evenly((model.panels.len().max(1), 1));
    for (area, panel) in areas.iter().zip(&model.panels) {
        draw_panel(area, panel, model.x_max).map_err(e)?;
    }
    draw_sizes(&lower, &model.sizes).map_err(e)
}

/// The histogram of requested sizes.
fn draw_sizes<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    sizes: &Sizes,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let buckets = &sizes.buckets;
    let lo = |i: usize| 2f64.powi(i as i32 - 1);
    let x_range = match (buckets.first(), buckets.last()) {
        (Some(first), Some(last)) => lo(first.0)..lo(last.0 + 1),
        _ => 1.0..2.0,
    };
    let y_top = buckets.iter().map(|b| b.1).max().unwrap_or(1) as f64 * 2.0;
    // The bars stand on half a decade below 1, so a size with one block
    // shows as a bar, not as a line on the axis.
    let floor = 0.3;
    let mut chart = ChartBuilder::on(area)
        .caption(sizes.caption.as_str(), (FONT, 16))
        .margin(12)
        // Room for the last size label, centred on the right edge.
        .margin_right(36)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range.log_scale().base(2.0), (floor..y_top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("bytes requested")
        .y_desc("blocks")
        .x_label_formatter(&|v| bytes(v.round() as u64))
        .y_label_formatter(&|v| count(v.round() as u64))
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()?;
    chart.draw_series(buckets.iter().map(|&(i, n)| {
        Rectangle::new(
            [(lo(i), floor), (lo(i + 1), n as f64)],
            BLUE.mix(0.7).filled(),
        )
    }))?;
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
}
