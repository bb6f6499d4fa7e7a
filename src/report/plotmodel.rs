//! What `memptrace plot` draws, decided before anything is drawn: panels,
//! their axes and lines, the peak's mark and where its label goes. The
//! drawing ([`super::plot`]) only renders this model, so tests read the
//! picture's content here, not in pixels.
//!
//! - The heap has a panel and an axis of its own: beside a process's RSS
//!   (megabytes of code and libraries) a heap of kilobytes would be a flat
//!   line at 0. Its line runs to the end of the time axis: the heap holds
//!   its last value after the last call.
//! - Resident and mapped memory, when the trace sampled them, share a panel
//!   below it. Mapped memory that dwarfs the rest (a thread's stack reserves
//!   8 MiB, a glibc arena 64 MiB) gets the right axis, and is then dashed and
//!   named so, since it may lie right over RSS where the two axes' scales
//!   meet.
//! - The peak's label sits above the heap's highest point, in a panel with
//!   no other line, so nothing crosses it; left of the mark when the peak is
//!   late in the trace.

use plotters::style::RGBColor;

use super::plot::Resident;
use super::scan::Analysis;
use super::text::{bytes, count, seconds};

/// Mapped memory shares the left axis with RSS while its peak is at most
/// this many times the largest of RSS and the heap's peak.
pub const SHARED_AXIS_RATIO: u64 = 4;

/// Head room above the highest line of a panel, as a factor of it: the
/// legend (top left) sits in it.
const HEADROOM: f64 = 1.6;

pub const BLUE: RGBColor = RGBColor(31, 119, 180);
pub const ORANGE: RGBColor = RGBColor(255, 127, 14);
pub const GREEN: RGBColor = RGBColor(44, 160, 44);
pub const GREY: RGBColor = RGBColor(110, 110, 110);

/// The whole picture.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub title: String,
    /// The time axis, shared by the time panels: 0 to `x_max` seconds.
    pub x_max: f64,
    /// Over time: the heap's, then resident and mapped memory's when sampled.
    pub panels: Vec<Panel>,
    pub sizes: Sizes,
}

/// One panel over time.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub caption: String,
    pub left: Axis,
    /// A second scale, on the right, for the lines marked `right`.
    pub right: Option<Axis>,
    pub lines: Vec<Line>,
    pub peak: Option<PeakMark>,
    /// A legend naming the lines (top left, in the head room).
    pub legend: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub desc: String,
    pub max: f64,
}

/// A line over time, in its axis's unit.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub colour: RGBColor,
    pub width: u32,
    pub dashed: bool,
    /// The area below it is shaded.
    pub filled: bool,
    /// Against the right axis.
    pub right: bool,
}

/// The heap's peak: a dot and its label.
#[derive(Clone, Debug, PartialEq)]
pub struct PeakMark {
    pub at: (f64, f64),
    pub text: String,
    /// The label's top left corner, in pixels from the dot: above it,
    /// right of it or (late peaks) left.
    pub offset: (i32, i32),
}

/// The histogram of requested sizes, log-log: bucket i holds
/// [2^(i-1), 2^i).
#[derive(Clone, Debug, PartialEq)]
pub struct Sizes {
    pub caption: String,
    /// (bucket, blocks), non-empty buckets only, 0 bytes left out.
    pub buckets: Vec<(usize, u64)>,
}

/// A unit for an axis: the largest that keeps `peak` at 1 or more.
pub fn unit(peak: u64) -> (f64, &'static str) {
    match peak {
        p if p >= 1 << 30 => ((1u64 << 30) as f64, "GiB"),
        p if p >= 1 << 20 => ((1u64 << 20) as f64, "MiB"),
        p if p >= 1 << 10 => (1024.0, "KiB"),
        _ => (1.0, "bytes"),
    }
}

/// Where mapped memory is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappedAxis {
    /// No samples: not drawn.
    None,
    /// With RSS, on the left.
    Shared,
    /// Against an axis of its own, on the right.
    Own,
}

pub fn mapped_axis(heap_peak: u64, memory: &[Resident]) -> MappedAxis {
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

/// The largest RSS sample: (bytes, ts_ns), the first of equals.
pub fn rss_peak(memory: &[Resident]) -> Option<(u64, i64)> {
    memory
        .iter()
        .max_by_key(|m| (m.rss, -m.ts_ns))
        .map(|m| (m.rss, m.ts_ns))
}

fn s(ns: i64) -> f64 {
    ns as f64 / 1e9
}

/// The heap in use as a step line: each slice of the timeline rises to
/// its largest value and ends at its last, which holds until `end_ns`.
fn heap_points(analysis: &Analysis, scale: f64, end_ns: i64) -> Vec<(f64, f64)> {
    let mut points = vec![(0.0, 0.0)];
    let mut last = 0.0;
    for slice in &analysis.timeline {
        points.push((s(slice.first_ns), last));
        points.push((s(slice.first_ns), slice.max_bytes as f64 / scale));
        last = slice.last_bytes as f64 / scale;
        points.push((s(slice.last_ns), last));
    }
    points.push((s(end_ns.max(analysis.last_ns)), last));
    points
}

/// One sampled quantity as a line, in `scale` units.
fn sampled(memory: &[Resident], scale: f64, value: fn(&Resident) -> u64) -> Vec<(f64, f64)> {
    memory
        .iter()
        .map(|m| (s(m.ts_ns), value(m) as f64 / scale))
        .collect()
}

fn line(label: &str, points: Vec<(f64, f64)>, colour: RGBColor, width: u32) -> Line {
    Line {
        label: label.to_string(),
        points,
        colour,
        width,
        dashed: false,
        filled: false,
        right: false,
    }
}

impl Model {
    pub fn of(analysis: &Analysis, memory: &[Resident], title: &str) -> Model {
        // The time axis runs to the last call or the last sample.
        let end_ns = memory
            .last()
            .map_or(analysis.last_ns, |m| m.ts_ns.max(analysis.last_ns));
        let x_max = s(end_ns.max(1)) * 1.02;
        let mut panels = vec![heap_panel(analysis, end_ns, x_max)];
        if !memory.is_empty() {
            panels.push(memory_panel(analysis, memory));
        }
        Model {
            title: title.to_string(),
            x_max,
            panels,
            sizes: sizes(analysis),
        }
    }
}

fn heap_panel(analysis: &Analysis, end_ns: i64, x_max: f64) -> Panel {
    let peak = analysis.peak;
    let (scale, unit_name) = unit(peak.bytes);
    let mut heap = line(
        "heap in use (requested)",
        heap_points(analysis, scale, end_ns),
        BLUE,
        2,
    );
    heap.filled = true;
    let mark = (peak.event > 0).then(|| {
        let at = (s(peak.ts_ns), peak.bytes as f64 / scale);
        // About 230 pixels of text: left of the dot when it would run off
        // the right of the panel.
        let dx = if at.0 > x_max * 0.6 { -236 } else { 8 };
        PeakMark {
            at,
            text: format!("peak {} at {}", bytes(peak.bytes), seconds(peak.ts_ns)),
            offset: (dx, -20),
        }
    });
    Panel {
        caption: format!(
            "Heap in use (bytes requested): peak {} in {} blocks at {}",
            bytes(peak.bytes),
            count(peak.blocks),
            seconds(peak.ts_ns)
        ),
        left: Axis {
            desc: format!("heap in use ({unit_name})"),
            max: (peak.bytes as f64 / scale).max(1.0) * 1.25,
        },
        right: None,
        lines: vec![heap],
        peak: mark,
        legend: false,
    }
}

fn memory_panel(analysis: &Analysis, memory: &[Resident]) -> Panel {
    let axis = mapped_axis(analysis.peak.bytes, memory);
    let max_rss = memory.iter().map(|m| m.rss).max().unwrap_or(0);
    let max_mapped = memory.iter().map(|m| m.mapped).max().unwrap_or(0);
    let left_max = if axis == MappedAxis::Shared {
        max_rss.max(max_mapped)
    } else {
        max_rss
    };
    let (scale, unit_name) = unit(left_max);
    let mut lines = vec![
        line(
            "resident (RSS)",
            sampled(memory, scale, |m| m.rss),
            ORANGE,
            2,
        ),
        line(
            "resident anonymous",
            sampled(memory, scale, |m| m.anon),
            GREEN,
            2,
        ),
    ];
    let mut right = None;
    if axis == MappedAxis::Own {
        let (right_scale, right_unit) = unit(max_mapped);
        let mut mapped = line(
            "mapped (dashed, right axis)",
            sampled(memory, right_scale, |m| m.mapped),
            GREY,
            2,
        );
        mapped.dashed = true;
        mapped.right = true;
        lines.push(mapped);
        right = Some(Axis {
            desc: format!("mapped, dashed ({right_unit})"),
            max: (max_mapped as f64 / right_scale).max(1.0) * HEADROOM,
        });
    } else {
        lines.push(line(
            "mapped",
            sampled(memory, scale, |m| m.mapped),
            GREY,
            1,
        ));
    }
    let caption = match rss_peak(memory) {
        Some((rss, at)) => format!(
            "Memory of the process, sampled: RSS peak {} at {}",
            bytes(rss),
            seconds(at)
        ),
        None => "Memory of the process, sampled".to_string(),
    };
    Panel {
        caption,
        left: Axis {
            desc: format!("resident ({unit_name})"),
            max: (left_max as f64 / scale).max(1.0) * HEADROOM,
        },
        right,
        lines,
        peak: None,
        legend: true,
    }
}

fn sizes(analysis: &Analysis) -> Sizes {
    let buckets = analysis
        .sizes
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, n)| **n > 0)
        .map(|(i, n)| (i, *n))
        .collect();
    let zero = analysis.sizes.first().copied().unwrap_or(0);
    let caption = if zero > 0 {
        format!(
            "Requested sizes of {} blocks ({} of 0 bytes not shown)",
            count(analysis.blocks),
            count(zero)
        )
    } else {
        format!("Requested sizes of {} blocks", count(analysis.blocks))
    };
    Sizes { caption, buckets }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::scan::{Peak, Slice};

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

    /// A 27 KiB heap whose calls end at 4.4 s, in a process of 4.5 MiB RSS
    /// sampled to 4.7 s and 300 MiB mapped (the case).
    fn small_heap_big_process() -> (Analysis, Vec<Resident>) {
        let analysis = Analysis {
            peak: Peak {
                bytes: 27 << 10,
                blocks: 3,
                event: 5,
                ts_ns: 4_000_000_000,
            },
            timeline: vec![
                Slice {
                    first_ns: 1_000_000_000,
                    last_ns: 2_000_000_000,
                    max_bytes: 10 << 10,
                    last_bytes: 10 << 10,
                },
                Slice {
                    first_ns: 4_000_000_000,
                    last_ns: 4_400_000_000,
                    max_bytes: 27 << 10,
                    last_bytes: 20 << 10,
                },
            ],
            last_ns: 4_400_000_000,
            sizes: vec![0; 65],
            ..Analysis::default()
        };
        let memory = (0..=47)
            .map(|i| Resident {
                ts_ns: i * 100_000_000,
                rss: 4_500 << 10,
                anon: 600 << 10,
                mapped: 300 << 20,
            })
            .collect();
        (analysis, memory)
    }

    #[test]
    fn the_heap_has_a_panel_and_an_axis_of_its_own_to_the_end() {
        let (analysis, memory) = small_heap_big_process();
        let model = Model::of(&analysis, &memory, "t");
        assert_eq!(model.panels.len(), 2);
        let heap = &model.panels[0];
        assert_eq!(heap.lines.len(), 1, "nothing but the heap in its panel");
        assert_eq!(heap.left.desc, "heap in use (KiB)");
        // 27 KiB fills most of its axis, not a sliver of 4.5 MiB.
        assert!(27.0 / heap.left.max > 0.75, "{}", heap.left.max);
        let points = &heap.lines[0].points;
        assert_eq!(points.last(), Some(&(4.7, 20.0)), "held to the last sample");
        assert!((model.x_max - 4.7 * 1.02).abs() < 1e-9);
        assert_eq!(
            heap.caption,
            "Heap in use (bytes requested): peak 27.0 KiB in 3 blocks at 4.000 s"
        );
        // The peak: on the heap's line, its label above the dot (nothing
        // in the panel is higher than the peak), left of it this late.
        let mark = heap.peak.as_ref().unwrap();
        assert_eq!(mark.at, (4.0, 27.0));
        assert_eq!(mark.text, "peak 27.0 KiB at 4.000 s");
        assert!(mark.offset.1 < 0 && mark.offset.0 < 0, "{:?}", mark.offset);
        assert!(points.iter().all(|p| p.1 <= mark.at.1));
        // Room for the label between the peak and the top of the axis.
        assert!(heap.left.max >= mark.at.1 * 1.2);
    }

    #[test]
    fn mapped_memory_on_its_own_axis_is_dashed_and_says_so() {
        let (analysis, memory) = small_heap_big_process();
        let model = Model::of(&analysis, &memory, "t");
        let panel = &model.panels[1];
        assert_eq!(
            panel.caption,
            "Memory of the process, sampled: RSS peak 4.4 MiB at 0.000 s"
        );
        assert_eq!(panel.left.desc, "resident (MiB)");
        assert_eq!(panel.right.as_ref().unwrap().desc, "mapped, dashed (MiB)");
        let labels: Vec<(&str, bool, bool)> = panel
            .lines
            .iter()
            .map(|l| (l.label.as_str(), l.dashed, l.right))
            .collect();
        assert_eq!(
            labels,
            [
                ("resident (RSS)", false, false),
                ("resident anonymous", false, false),
                ("mapped (dashed, right axis)", true, true)
            ]
        );
        // Each line a colour of its own; the legend in the head room above
        // the highest line.
        let mut colours: Vec<_> = panel.lines.iter().map(|l| l.colour).collect();
        colours.dedup();
        assert_eq!(colours.len(), 3);
        assert!(panel.legend);
        let highest = |l: &Line| l.points.iter().map(|p| p.1).fold(0.0, f64::max);
        let right_max = panel.right.as_ref().unwrap().max;
        for l in &panel.lines {
            let max = if l.right { right_max } else { panel.left.max };
            assert!(highest(l) / max <= 1.0 / HEADROOM + 1e-9, "{}", l.label);
        }
    }

    #[test]
    fn mapped_memory_near_rss_shares_its_axis() {
        let (analysis, mut memory) = small_heap_big_process();
        for m in &mut memory {
            m.mapped = 9 << 20;
        }
        let model = Model::of(&analysis, &memory, "t");
        let panel = &model.panels[1];
        assert_eq!(panel.right, None);
        assert!(panel.lines.iter().all(|l| !l.right && !l.dashed));
        assert_eq!(panel.lines[2].label, "mapped");
    }

    #[test]
    fn without_samples_the_heap_alone() {
        let (analysis, _) = small_heap_big_process();
        let model = Model::of(&analysis, &[], "t");
        assert_eq!(model.panels.len(), 1);
        let points = &model.panels[0].lines[0].points;
        assert_eq!(points.last(), Some(&(4.4, 20.0)));
        // An early peak is labelled right of its dot.
        let mut early = analysis.clone();
        early.peak.ts_ns = 1_000_000_000;
        let mark = Model::of(&early, &[], "t").panels[0].peak.clone().unwrap();
        assert!(mark.offset.0 > 0 && mark.offset.1 < 0);
        assert_eq!(
            Model::of(&analysis, &[], "t").sizes.caption,
            "Requested sizes of 0 blocks"
        );
    }
}
