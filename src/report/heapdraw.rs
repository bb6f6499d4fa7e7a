//! The picture of `heapmap -o`: the pages of the arenas' heaps and of the
//! mmapped blocks, in address order, one square per page (or per few pages
//! on a large heap), coloured by what most of its bytes hold; a page not
//! resident in RAM is drawn pale. Regions apart in memory, or of another
//! arena, are drawn apart, each named at its first row (`main arena`,
//! `arena 0x…`, `mmapped blocks`). The legend shows every colour drawn,
//! resident and not.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::ReportError;
use super::heapmap::{ArenaHeap, HeapReport};
use super::plot::{Drawing, render};
use crate::heap::{PageRun, PageState};

const COLUMNS: u64 = 128;
const MARGIN: i32 = 20;
/// The column of the regions' names, left of the squares.
const LABELS: i32 = 170;
/// Each square's side, in pixels.
const CELL: i32 = 9;
const WIDTH: u32 = (2 * MARGIN + LABELS + COLUMNS as i32 * CELL) as u32;
/// The title and the legend's two rows, above the squares.
const LEGEND: i32 = 96;
/// Most rows of squares drawn; beyond, a square stands for several pages.
const MAX_ROWS: u64 = 600;
const STATES: [PageState; 4] = [
    PageState::InUse,
    PageState::Free,
    PageState::Top,
    PageState::Mmapped,
];

/// Draw `report`'s pages into `path` (.png or .svg).
pub fn draw(path: &Path, report: &HeapReport) -> Result<(), ReportError> {
    if report.pages.is_empty() {
        return Err(ReportError::Empty(
            "the heap map has no pages (no arena was read)".to_string(),
        ));
    }
    let picture = Picture::of(report);
    let height = (LEGEND + MARGIN + picture.layout.rows as i32 * CELL).max(200) as u32;
    render(path, (WIDTH, height), &picture)
}

/// Whose pages a run is: the arena whose heap it overlaps, or the mmapped
/// blocks.
fn owner(run: &PageRun, heaps: &[ArenaHeap]) -> String {
    if run.state == PageState::Mmapped {
        return "mmapped blocks".to_string();
    }
    let end = run.addr.saturating_add(run.pages.saturating_mul(4096));
    heaps
        .iter()
        .find(|h| h.start < end && run.addr < h.end)
        .map_or_else(|| "no arena known".to_string(), ArenaHeap::label)
}

/// Where each square goes: regions (runs that touch, of one owner) start on
/// a new row, after an empty one, with their owner's name.
struct Layout {
    /// (row, column, state, resident)
    cells: Vec<(u64, u64, PageState, Option<bool>)>,
    /// (row, name): the first row of each region.
    labels: Vec<(u64, String)>,
    rows: u64,
    per_cell: u64,
}

impl Layout {
    fn of(runs: &[PageRun], heaps: &[ArenaHeap]) -> Layout {
        let owners: Vec<String> = runs.iter().map(|r| owner(r, heaps)).collect();
        let starts = |i: usize| {
            i == 0
                || runs[i - 1].addr + runs[i - 1].pages * 4096 != runs[i].addr
                || owners[i - 1] != owners[i]
        };
        let total: u64 = runs.iter().map(|r| r.pages).sum();
        let regions = (0..runs.len()).filter(|&i| starts(i)).count() as u64;
        let per_cell = (total / (COLUMNS * MAX_ROWS.saturating_sub(2 * regions).max(1)) + 1).max(1);
        let mut cells = Vec::new();
        let mut labels = Vec::new();
        let (mut row, mut col) = (0u64, 0u64);
        // Pages of the current square: the state with most pages wins.
        let mut pending: Vec<(PageState, Option<bool>)> = Vec::new();
        let mut flush =
            |pending: &mut Vec<(PageState, Option<bool>)>, row: &mut u64, col: &mut u64| {
                if pending.is_empty() {
                    return;
                }
                let mut best = pending[0];
                let mut best_n = 0;
                for p in pending.iter() {
                    let n = pending.iter().filter(|q| *q == p).count();
                    if n > best_n {
                        best = *p;
                        best_n = n;
                    }
                }
                cells.push((*row, *col, best.0, best.1));
                pending.clear();
                *col += 1;
                if *col == COLUMNS {
                    *col = 0;
                    *row += 1;
                }
            };
        for (i, r) in runs.iter().enumerate() {
            if starts(i) {
                if i > 0 {
                    flush(&mut pending, &mut row, &mut col);
                    row += if col == 0 { 1 } else { 2 };
                    col = 0;
                }
                labels.push((row, owners[i].clone()));
            }
            for _ in 0..r.pages {
                pending.push((r.state, r.resident));
                if pending.len() as u64 == per_cell {
                    flush(&mut pending, &mut row, &mut col);
                }
            }
        }
        flush(&mut pending, &mut row, &mut col);
        Layout {
            cells,
            labels,
            rows: row + 1,
            per_cell,
        }
    }
}

/// The picture as drawn: title, legend, names and squares.
struct Picture {
    layout: Layout,
    title: String,
    /// The legend's rows: a heading, then each state's name and colour.
    legend: Vec<(&'static str, Vec<(&'static str, RGBColor)>)>,
}

impl Picture {
    fn of(report: &HeapReport) -> Picture {
        let layout = Layout::of(&report.pages, &report.heaps);
        let title = format!(
            "glibc heap of process {}: {} arenas, {} page{} per square",
            report.pid,
            report.arenas.len(),
            layout.per_cell,
            if layout.per_cell == 1 { "" } else { "s" }
        );
        let row = |resident| {
            STATES
                .iter()
                .map(|&s| (s.name(), color(s, Some(resident))))
                .collect()
        };
        Picture {
            layout,
            title,
            legend: vec![("resident", row(true)), ("not resident", row(false))],
        }
    }
}

/// A state's colour: pale when the page is not resident (as resident when
/// that is unknown).
fn color(state: PageState, resident: Option<bool>) -> RGBColor {
    let base = match state {
        PageState::InUse => RGBColor(31, 119, 180),
        PageState::Free => RGBColor(44, 160, 44),
        PageState::Top => RGBColor(150, 150, 150),
        PageState::Mmapped => RGBColor(148, 103, 189),
    };
    if resident == Some(false) {
        let pale = |c: u8| (c as u16 + 2 * 255).div_ceil(3) as u8;
        RGBColor(pale(base.0), pale(base.1), pale(base.2))
    } else {
        base
    }
}

impl Drawing for Picture {
    fn draw_on<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let font = (super::plot::FONT, 18).into_font();
        root.draw(&Text::new(self.title.clone(), (MARGIN, 8), font))
            .map_err(e)?;
        // Texts centred on their squares' middles.
        let small = TextStyle::from((super::plot::FONT, 14).into_font())
            .pos(Pos::new(HPos::Left, VPos::Center));
        for (i, (heading, entries)) in self.legend.iter().enumerate() {
            let y = 38 + i as i32 * 24;
            root.draw(&Text::new(*heading, (MARGIN, y + 7), small.clone()))
                .map_err(e)?;
            for (j, (name, colour)) in entries.iter().enumerate() {
                let x = MARGIN + LABELS + j as i32 * 140;
                root.draw(&Rectangle::new([(x, y), (x + 14, y + 14)], colour.filled()))
                    .map_err(e)?;
                root.draw(&Text::new(*name, (x + 20, y + 7), small.clone()))
                    .map_err(e)?;
            }
        }
        let label = TextStyle::from((super::plot::FONT, 12).into_font())
            .pos(Pos::new(HPos::Left, VPos::Center));
        for (row, name) in &self.layout.labels {
            let y = LEGEND + *row as i32 * CELL + CELL / 2;
            root.draw(&Text::new(name.as_str(), (MARGIN, y), label.clone()))
                .map_err(e)?;
        }
        for &(row, col, state, resident) in &self.layout.cells {
            let x = MARGIN + LABELS + col as i32 * CELL;
            let y = LEGEND + row as i32 * CELL;
            root.draw(&Rectangle::new(
                [(x, y), (x + CELL - 1, y + CELL - 1)],
                color(state, resident).filled(),
            ))
            .map_err(e)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(addr: u64, pages: u64, state: PageState, resident: Option<bool>) -> PageRun {
        PageRun {
            addr,
            pages,
            state,
            resident,
        }
    }

    /// A main heap of 3 pages, a thread arena's heap of 2 right after it
    /// (another owner, though the addresses touch), an mmapped block far
    /// away: three regions, each named at its first row; every colour
    /// drawn is in the legend.
    #[test]
    fn regions_are_named_and_every_colour_is_in_the_legend() {
        let heaps = [
            ArenaHeap {
                start: 0x1000_0010,
                end: 0x1000_3000,
                arena: 0x7f00_0000_0c60,
                main: true,
            },
            ArenaHeap {
                start: 0x1000_38c0,
                end: 0x1000_5000,
                arena: 0x1000_3030,
                main: false,
            },
        ];
        let report = HeapReport {
            pid: 7,
            pages: vec![
                run(0x1000_0000, 2, PageState::InUse, Some(true)),
                run(0x1000_2000, 1, PageState::Top, Some(false)),
                run(0x1000_3000, 1, PageState::Free, None),
                run(0x1000_4000, 1, PageState::Top, Some(false)),
                run(0x2000_0000, 200, PageState::Mmapped, Some(false)),
            ],
            heaps: heaps.to_vec(),
            ..HeapReport::default()
        };
        let picture = Picture::of(&report);
        let layout = &picture.layout;
        assert_eq!(
            layout.labels,
            [
                (0, "main arena".to_string()),
                (2, "arena 0x10003030".to_string()),
                (4, "mmapped blocks".to_string())
            ]
        );
        // The main heap's 3 squares on row 0, the thread heap's 2 on row
        // 2, the block's 200 on rows 4 and 5.
        let rows: Vec<u64> = layout.cells.iter().map(|c| c.0).collect();
        assert_eq!(&rows[..5], [0, 0, 0, 2, 2]);
        assert_eq!(rows[5..].iter().filter(|&&r| r == 4).count(), 128);
        assert_eq!(rows[5..].iter().filter(|&&r| r == 5).count(), 72);
        assert_eq!(layout.rows, 6);
        let legend: Vec<RGBColor> = picture
            .legend
            .iter()
            .flat_map(|(_, entries)| entries.iter().map(|e| e.1))
            .collect();
        for &(_, _, state, resident) in &layout.cells {
            assert!(
                legend.contains(&color(state, resident)),
                "{state:?} {resident:?} is drawn in a colour the legend lacks"
            );
        }
        // The pale grey of a top page not resident is the legend's "top"
        // of "not resident", not a pale blue.
        let (heading, not_resident) = &picture.legend[1];
        assert_eq!(*heading, "not resident");
        assert_eq!(not_resident[2], ("top", color(PageState::Top, Some(false))));
        assert_eq!(
            picture.title,
            "glibc heap of process 7: 0 arenas, 1 page per square"
        );
    }

    /// A stored snapshot's heaps are its arenas' chunks that follow each
    /// other: a thread arena with two heaps has two.
    #[test]
    fn heaps_from_stored_chunks() {
        let heaps = super::super::heapmap::heaps_of_chunks([
            (1, true, 0x1000, 0x20),
            (1, true, 0x1020, 0xfe0),
            (2, false, 0x8000, 0x100),
            (2, false, 0x20000, 0x100),
        ]);
        let ranges: Vec<(u64, u64, String)> =
            heaps.iter().map(|h| (h.start, h.end, h.label())).collect();
        assert_eq!(
            ranges,
            [
                (0x1000, 0x2000, "main arena".to_string()),
                (0x8000, 0x8100, "arena 0x2".to_string()),
                (0x20000, 0x20100, "arena 0x2".to_string())
            ]
        );
    }

    #[test]
    fn pages_outside_every_heap_are_named_so() {
        let layout = Layout::of(&[run(0x5000, 1, PageState::InUse, None)], &[]);
        assert_eq!(layout.labels, [(0, "no arena known".to_string())]);
    }
}
