//! Progress on a terminal: the live line of a trace (events recorded, events
//! per second, live heap) and bars for long work after it (symbolization,
//! reports). Drawn on a terminal only; memptrace is silent on a pipe.
//!
//! A trace's line must never touch the traced program's output. indicatif
//! redraws by moving the cursor up over the lines it drew last and erasing
//! them (`ESC[1A ESC[2K`): a line the program printed meanwhile on the same
//! terminal is erased in its place, or a stale progress line is left between
//! the program's lines. So during a trace (and the naming of addresses after
//! it, while the program may run on) progress is drawn only on a terminal the
//! program's stdout and stderr do not write to ([`may_draw`]): in practice,
//! an attach to a process whose output goes elsewhere; a launched program
//! shares memptrace's stderr, so nothing is drawn. Lines are never wider than
//! the terminal (a wrapped line is one indicatif cannot erase).

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, HumanCount, ProgressBar, ProgressStyle};

/// Counters the progress line reads while the trace runs (written by the
/// tracer).
#[derive(Default)]
pub struct Progress {
    pub events: AtomicU64,
    pub live_bytes: AtomicU64,
    /// Set by the recorder when the database cannot grow: the trace ends.
    pub halt: crate::sink::Halt,
}

impl Progress {
    /// The tracer's counts now: calls recorded, bytes live.
    pub fn update(&self, events: u64, live_bytes: u64) {
        self.events.store(events, Ordering::Relaxed);
        self.live_bytes.store(live_bytes, Ordering::Relaxed);
    }
}

pub struct ProgressLine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// True when a trace's progress may be drawn on memptrace's stderr:
/// `ours` is the terminal it writes to (`None`: not a terminal), and
/// `program` what the traced program's stdout and stderr write to (a
/// terminal's device, `None` for anything else, an error when unknown). A
/// terminal the program may write to is never drawn on.
pub fn may_draw(ours: Option<u64>, program: &[std::io::Result<Option<u64>>]) -> bool {
    let Some(ours) = ours else {
        return false;
    };
    program.iter().all(|stream| match stream {
        Ok(Some(terminal)) => *terminal != ours,
        Ok(None) => true,
        Err(_) => false,
    })
}

impl ProgressLine {
    /// Start drawing when `draw` (see [`may_draw`]); otherwise do nothing.
    pub fn start(progress: Arc<Progress>, draw: bool) -> ProgressLine {
        let stop = Arc::new(AtomicBool::new(false));
        if !draw {
            return ProgressLine { stop, thread: None };
        }
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("memptrace-progress".into())
            .spawn(move || draw_line(progress, flag))
            .ok();
        ProgressLine { stop, thread }
    }

    pub fn finish(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ProgressLine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn draw_line(progress: Arc<Progress>, stop: Arc<AtomicBool>) {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        // wide_msg: the message is cut to the terminal's width.
        ProgressStyle::with_template("{spinner} memptrace: {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let started = Instant::now();
    let (mut last_events, mut last_time) = (0u64, started);
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200));
        let events = progress.events.load(Ordering::Relaxed);
        let live = progress.live_bytes.load(Ordering::Relaxed);
        let now = Instant::now();
        let rate = (events - last_events.min(events)) as f64
            / now.duration_since(last_time).as_secs_f64().max(1e-3);
        (last_events, last_time) = (events, now);
        bar.set_message(format!(
            "{} events, {}/s, {} live",
            HumanCount(events),
            HumanCount(rate as u64),
            HumanBytes(live)
        ));
        bar.tick();
    }
    bar.finish_and_clear();
}

/// A bar for work of known length (the passes of a report): drawn on a
/// terminal, hidden (and free) when stderr is not one. Call
/// `finish_and_clear` when done.
pub fn bar(len: u64, message: &str) -> ProgressBar {
    bar_if(std::io::stderr().is_terminal(), len, message)
}

/// A bar drawn only when `draw`, at most as wide as the terminal.
pub fn bar_if(draw: bool, len: u64, message: &str) -> ProgressBar {
    if !draw {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("memptrace: {wide_msg} [{bar:20}] {percent:>3}%")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_on_the_programs_terminal() {
        let unknown = || Err(std::io::Error::from_raw_os_error(libc::EACCES));
        // A launched program writes where memptrace does.
        assert!(!may_draw(Some(7), &[Ok(Some(7)), Ok(Some(7))]));
        // Its stdout redirected, its stderr still the terminal.
        assert!(!may_draw(Some(7), &[Ok(None), Ok(Some(7))]));
        // An attached process writing to files, pipes or another terminal.
        assert!(may_draw(Some(7), &[Ok(None), Ok(None)]));
        assert!(may_draw(Some(7), &[Ok(Some(8)), Ok(None)]));
        // Not known: not drawn. Not a terminal: nothing to draw on.
        assert!(!may_draw(Some(7), &[Ok(None), unknown()]));
        assert!(!may_draw(None, &[Ok(None), Ok(None)]));
    }
}
