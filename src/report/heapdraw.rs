//! The picture of `heapmap -o`: the pages of the arenas' heaps and of the
//! mmapped blocks, in address order, one square per page (or per few pages
//! on a large heap), coloured by what most of its bytes hold; a page not
//! resident in RAM is drawn pale. Regions apart in memory are drawn apart.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::ReportError;
use super::heapmap::HeapReport;
use super::plot::{Drawing, render};
use crate::heap::{PageRun, PageState};

const WIDTH: u32 = 1200;
const COLUMNS: u64 = 128;
const MARGIN: i32 = 20;
const LEGEND: i32 = 70;
/// Most rows of squares drawn; beyond, a square stands for several pages.
const MAX_ROWS: u64 = 600;

/// Draw `report`'s pages into `path` (.png or .svg).
pub fn draw(path: &Path, report: &HeapReport) -> Result<(), ReportError> {
    if report.pages.is_empty() {
        return Err(ReportError::Empty(
            "the heap map has no pages (no arena was read)".to_string(),
        ));
    }
    let layout = Layout::of(&report.pages);
    let cell = ((WIDTH as i32 - 2 * MARGIN) / COLUMNS as i32).max(2);
    let height = (LEGEND + MARGIN + layout.rows as i32 * cell).max(200) as u32;
    let title = format!(
        "glibc heap of process {}: {} arenas, {} page{} per square",
        report.pid,
        report.arenas.len(),
        layout.per_cell,
        if layout.per_cell == 1 { "" } else { "s" }
    );
    render(
        path,
        (WIDTH, height),
        &Picture {
            layout,
            cell,
            title,
        },
    )
}

/// Where each square goes: regions (runs that touch) start on a new row,
/// after an empty one.
struct Layout {
    /// (row, column, state, resident)
    cells: Vec<(u64, u64, PageState, Option<bool>)>,
    rows: u64,
    per_cell: u64,
}

impl Layout {
    fn of(runs: &[PageRun]) -> Layout {
        let total: u64 = runs.iter().map(|r| r.pages).sum();
        let regions = 1 + runs
            .windows(2)
            .filter(|w| w[0].addr + w[0].pages * 4096 != w[1].addr)
            .count() as u64;
        let per_cell = (total / (COLUMNS * MAX_ROWS.saturating_sub(2 * regions).max(1)) + 1).max(1);
        let mut cells = Vec::new();
        let (mut row, mut col) = (0u64, 0u64);
        let mut end = None;
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
        for r in runs {
            if end.is_some() && end != Some(r.addr) {
                flush(&mut pending, &mut row, &mut col);
                row += if col == 0 { 1 } else { 2 };
                col = 0;
            }
            for _ in 0..r.pages {
                pending.push((r.state, r.resident));
                if pending.len() as u64 == per_cell {
                    flush(&mut pending, &mut row, &mut col);
                }
            }
            end = Some(r.addr + r.pages * 4096);
        }
        flush(&mut pending, &mut row, &mut col);
        Layout {
            cells,
            rows: row + 1,
            per_cell,
        }
    }
}

struct Picture {
    layout: Layout,
    cell: i32,
    title: String,
}

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
        let legend = [
            ("in use", PageState::InUse, None),
            ("free", PageState::Free, None),
            ("top", PageState::Top, None),
            ("mmapped", PageState::Mmapped, None),
            ("not resident (pale)", PageState::InUse, Some(false)),
        ];
        let small = (super::plot::FONT, 14).into_font();
        for (i, (name, state, resident)) in legend.into_iter().enumerate() {
            let x = MARGIN + i as i32 * 170;
            root.draw(&Rectangle::new(
                [(x, 38), (x + 14, 52)],
                color(state, resident).filled(),
            ))
            .map_err(e)?;
            root.draw(&Text::new(name, (x + 20, 38), small.clone()))
                .map_err(e)?;
        }
        let c = self.cell;
        for &(row, col, state, resident) in &self.layout.cells {
            let x = MARGIN + col as i32 * c;
            let y = LEGEND + row as i32 * c;
            root.draw(&Rectangle::new(
                [(x, y), (x + c - 1, y + c - 1)],
                color(state, resident).filled(),
            ))
            .map_err(e)?;
        }
        Ok(())
    }
}
