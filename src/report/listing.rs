//! A stack as text: one line per frame, `function (file:line)`, listed
//! from its call site out (the allocator's frames before it are one line),
//! with its caller always shown.

use std::fmt::Write as _;

use super::stacks::Location;
use super::text::Style;
use crate::util::file_name;

/// One line of a stack: `function (file:line)`, the file without its
/// directories (the JSON output has the whole path).
pub fn location(style: Style, l: &Location) -> String {
    let place = match (&l.file, l.line) {
        (Some(file), Some(line)) => format!(" ({}:{line})", file_name(file)),
        (Some(file), None) => format!(" ({})", file_name(file)),
        _ => String::new(),
    };
    let inlined = if l.inlined { " [inlined]" } else { "" };
    let found_by = match &l.found_by {
        Some(how) => format!(" [found by {how}]"),
        None => String::new(),
    };
    format!(
        "{}{}",
        l.function,
        style.dim(&format!("{place}{inlined}{found_by}"))
    )
}

/// The frames of a stack, indented, at most `frames` of them, from the
/// call site out: the allocator's frames before it are one line (`via
/// operator new(unsigned long)`), and the caller is always shown, with the
/// lines inlined into it cut short if they would push it out.
pub fn stack_lines(style: Style, locations: &[Location], frames: usize, out: &mut String) {
    if locations.is_empty() {
        let _ = writeln!(out, "       {}", style.dim("(no stack recorded)"));
        return;
    }
    let frames = frames.max(1);
    // The allocator's lines before the first that is not (none when the
    // whole stack is the allocator's).
    let skip = locations
        .iter()
        .position(|l| !l.wrapper)
        .unwrap_or_default();
    if skip > 0 {
        let more = match skip - 1 {
            0 => String::new(),
            1 => " and 1 more allocator frame".to_string(),
            n => format!(" and {n} more allocator frames"),
        };
        let _ = writeln!(
            out,
            "       {}",
            style.dim(&format!("via {}{more}", locations[0].function))
        );
    }
    let shown = &locations[skip..];
    let caller = shown.iter().position(|l| l.caller);
    let mut lines: Vec<String> = Vec::new();
    match caller {
        Some(c) if c >= frames => {
            lines.extend(shown[..frames - 1].iter().map(|l| location(style, l)));
            let cut = c - (frames - 1);
            lines.push(style.dim(&format!(
                "... {cut} more inlined frame{}",
                if cut == 1 { "" } else { "s" }
            )));
            lines.push(location(style, &shown[c]));
            emit(style, &lines, shown.len() - c - 1, out);
        }
        _ => {
            lines.extend(shown.iter().take(frames).map(|l| location(style, l)));
            emit(style, &lines, shown.len().saturating_sub(frames), out);
        }
    }
}

/// Lines of a stack, and how many more frames were left out.
fn emit(style: Style, lines: &[String], more: usize, out: &mut String) {
    for line in lines {
        let _ = writeln!(out, "       {line}");
    }
    if more > 0 {
        let _ = writeln!(
            out,
            "       {}",
            style.dim(&format!(
                "... {more} more frame{}",
                if more == 1 { "" } else { "s" }
            ))
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(function: &str, inlined: bool, wrapper: bool, caller: bool) -> Location {
        Location {
            function: function.to_string(),
            file: None,
            line: None,
            module: None,
            address: 0,
            inlined,
            found_by: None,
            wrapper,
            caller,
        }
    }

    /// The allocator's frames are one line; the caller is shown however
    /// many lines were inlined into it.
    #[test]
    fn stacks_start_at_the_call_site_and_show_the_caller() {
        let mut stack = vec![
            loc("operator new(unsigned long)", false, true, false),
            loc(
                "std::__new_allocator<int>::allocate(unsigned long, void const*)",
                true,
                true,
                false,
            ),
        ];
        for i in 0..6 {
            stack.push(loc(&format!("std::inlined_{i}()"), true, false, false));
        }
        stack.push(loc("user_function()", false, false, true));
        stack.push(loc("main", false, false, false));
        stack.push(loc("_start", false, false, false));
        let mut out = String::new();
        stack_lines(Style { color: false }, &stack, 4, &mut out);
        assert_eq!(
            out,
            [
                "via operator new(unsigned long) and 1 more allocator frame",
                "std::inlined_0() [inlined]",
                "std::inlined_1() [inlined]",
                "std::inlined_2() [inlined]",
                "... 3 more inlined frames",
                "user_function()",
                "... 2 more frames",
            ]
            .map(|l| format!("       {l}\n"))
            .concat()
        );
        // Enough room: the caller in its place, then the frames that fit.
        let mut out = String::new();
        stack_lines(Style { color: false }, &stack, 8, &mut out);
        assert!(
            out.contains("       user_function()\n       main\n       ... 1 more frame\n"),
            "{out}"
        );
        // All the allocator's (libc allocating for itself): all shown.
        let libc = [
            loc("_IO_file_doallocate", false, true, true),
            loc("puts", false, true, false),
        ];
        let mut out = String::new();
        stack_lines(Style { color: false }, &libc, 8, &mut out);
        assert_eq!(out, "       _IO_file_doallocate\n       puts\n");
    }
}
