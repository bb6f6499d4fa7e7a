//! Progress on a terminal: the live line of a trace (events recorded, events
//! per second, live heap) and bars for long work after it (symbolization,
//! reports). Drawn on a terminal only; memptrace is silent on a pipe.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{HumanBytes, HumanCount, ProgressBar, ProgressStyle};

use crate::tracer::Progress;

pub struct ProgressLine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressLine {
    /// Start drawing if stderr is a terminal; otherwise do nothing.
    pub fn start(progress: Arc<Progress>) -> ProgressLine {
        let stop = Arc::new(AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            return ProgressLine { stop, thread: None };
        }
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("memptrace-progress".into())
            .spawn(move || draw(progress, flag))
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

fn draw(progress: Arc<Progress>, stop: Arc<AtomicBool>) {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} memptrace: {msg}")
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

/// A bar for work of known length (the passes of a report, symbolization):
/// drawn on a terminal, hidden (and free) when stderr is not one. Call
/// `finish_and_clear` when done.
pub fn bar(len: u64, message: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("memptrace: {msg} [{bar:30}] {percent:>3}% {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}
