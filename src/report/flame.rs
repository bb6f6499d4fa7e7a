//! Folded stacks (`outer;...;inner value`, the input of every flame graph
//! tool) weighed by a [`Metric`], and flame graphs drawn from them with
//! inferno.

use std::collections::BTreeMap;

use inferno::flamegraph::{self, Palette, color::BasicPalette};

use super::scan::{Analysis, StackStats};
use super::stacks::StackTable;
use super::{Metric, ReportError};

/// A stack's weight under a metric.
pub fn weight(metric: Metric, s: &StackStats) -> u64 {
    match metric {
        Metric::Leaked => s.leaked_bytes,
        Metric::Allocated => s.bytes,
        Metric::Calls => s.calls,
        Metric::Peak => s.peak_bytes,
    }
}

/// The folded stacks with a non-zero weight, sorted; stacks whose function
/// names are the same (different call sites in the same functions) are
/// merged. Calls without a stack are one frame, `[no stack]`.
pub fn folded(analysis: &Analysis, table: &StackTable, metric: Metric) -> Vec<(String, u64)> {
    let mut lines: BTreeMap<String, u64> = BTreeMap::new();
    for (stack, s) in &analysis.stacks {
        let value = weight(metric, s);
        if value == 0 {
            continue;
        }
        let names = match stack {
            Some(id) => table.flame_names(*id),
            None => vec!["[no stack]".to_string()],
        };
        // `;` separates frames in the format: a name must not contain one.
        let key = names
            .iter()
            .map(|n| n.replace(';', ":"))
            .collect::<Vec<_>>()
            .join(";");
        let key = if key.is_empty() {
            "[empty stack]".to_string()
        } else {
            key
        };
        *lines.entry(key).or_default() += value;
    }
    lines.into_iter().collect()
}

/// The folded stacks as the text of a `.folded` file.
pub fn folded_text(lines: &[(String, u64)]) -> String {
    let mut text = String::new();
    for (stack, value) in lines {
        text.push_str(stack);
        text.push(' ');
        text.push_str(&value.to_string());
        text.push('\n');
    }
    text
}

/// An interactive SVG flame graph of the folded stacks.
pub fn svg(lines: &[(String, u64)], metric: Metric, title: &str) -> Result<Vec<u8>, ReportError> {
    if lines.is_empty() {
        return Err(ReportError::Empty(format!(
            "no stack has any {}; try another --metric",
            metric.describe()
        )));
    }
    let mut options = flamegraph::Options::default();
    options.title = title.to_string();
    options.count_name = metric.unit().to_string();
    options.colors = Palette::Basic(BasicPalette::Mem);
    // Colours from the function names: the same input, the same picture.
    options.hash = true;
    let text = folded_text(lines);
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut options, text.lines(), &mut svg)
        .map_err(|e| ReportError::Empty(format!("inferno could not draw the flame graph: {e}")))?;
    Ok(svg)
}
