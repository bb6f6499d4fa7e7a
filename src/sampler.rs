//! Resident memory over time: a thread that reads, at a fixed interval, the
//! resident and mapped memory of every traced process (`os::resident`) and
//! records it as [`Record::Rss`] rows (the `rss` table).
//!
//! It learns the processes from the records the trace writes: the thread
//! record of a process's main thread (tid = pid) starts sampling it, and
//! its end stops it, after one more sample if the process can still be
//! read. So children traced with `-f` are sampled as soon as the recorder
//! sees them, and nothing here talks to the tracer. It only reads /proc:
//! it never stops a process, and a process it cannot read is not an error
//! (it is gone, or a zombie whose memory is freed).
//!
//! A round reads every process once and stamps all its rows with one
//! `ts_ns`, on the trace's clock (the [`Instant`] events are timed from).
//! Rounds run every interval, once at once when a process is learned (its
//! first sample, as early as the trace knows of it), and once when the
//! trace ends (the last, after a detach the process's memory then).

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::os::resident::{self, Resident};
use crate::sink::{Observer, Record, RecordSender, RssSample};

/// The processes to sample, shared by the recorder's thread (which learns
/// them) and the sampler's.
#[derive(Clone, Default)]
pub struct Watchlist {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<Watch>,
    wake: Condvar,
}

/// What the sampler knows of the traced processes.
#[derive(Debug, Default, PartialEq, Eq)]
struct Watch {
    /// Processes sampled every round.
    live: BTreeSet<u32>,
    /// Processes whose end the trace saw: sampled once more, then dropped.
    ending: BTreeSet<u32>,
    /// A process was learned since the last round: sample now.
    fresh: bool,
    /// The trace is over: one last round, then the thread ends.
    stop: bool,
}

impl Watch {
    /// Learn from a record on its way to the database.
    fn observe(&mut self, record: &Record) {
        let Record::Thread(t) = record else { return };
        if t.tid != t.pid {
            return;
        }
        match t.end_ns {
            // Sent when a process is first seen, and again after its exec.
            None => {
                self.live.insert(t.pid);
                self.ending.remove(&t.pid);
                self.fresh = true;
            }
            Some(_) => {
                if self.live.remove(&t.pid) {
                    self.ending.insert(t.pid);
                }
            }
        }
    }

    /// The processes of the next round; the ending ones are sampled once.
    fn take_round(&mut self) -> Vec<u32> {
        self.fresh = false;
        let mut pids: Vec<u32> = self.live.iter().copied().collect();
        pids.extend(std::mem::take(&mut self.ending));
        pids.sort_unstable();
        pids
    }
}

/// What reading one process gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    Figures(Resident),
    /// Not the program yet (a launched one before its exec): try again.
    NotYet,
    /// Gone, or a zombie: stop sampling it.
    Gone,
}

/// Read a live process.
fn read(pid: u32) -> Reading {
    let pid = pid as i32;
    if resident::runs_our_executable(pid) {
        return Reading::NotYet;
    }
    match resident::resident(pid) {
        Some(figures) => Reading::Figures(figures),
        None => Reading::Gone,
    }
}

/// One round: a row for each process read, stamped `ts_ns`, and the
/// processes found gone.
fn round(
    pids: &[u32],
    ts_ns: u64,
    mut read: impl FnMut(u32) -> Reading,
) -> (Vec<Record>, Vec<u32>) {
    let mut rows = Vec::with_capacity(pids.len());
    let mut gone = Vec::new();
    for &pid in pids {
        match read(pid) {
            Reading::Figures(r) => rows.push(Record::Rss(RssSample {
                ts_ns,
                pid,
                rss: r.rss,
                anon: r.anon,
                file: r.file,
                shmem: r.shmem,
                mapped: r.mapped,
            })),
            Reading::NotYet => {}
            Reading::Gone => gone.push(pid),
        }
    }
    (rows, gone)
}

impl Watchlist {
    pub fn new() -> Watchlist {
        Watchlist::default()
    }

    fn lock(&self) -> MutexGuard<'_, Watch> {
        // A panic while holding the lock leaves the sets as they were.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sample process `pid` from now on (the process launched or attached to).
    pub fn watch(&self, pid: u32) {
        let mut watch = self.lock();
        watch.live.insert(pid);
        watch.fresh = true;
        self.shared.wake.notify_one();
    }

    /// The recorder's observer: learns processes from the thread records.
    pub fn observer(&self) -> Observer {
        let list = self.clone();
        Box::new(move |record| {
            if let Record::Thread(_) = record {
                let mut watch = list.lock();
                watch.observe(record);
                if watch.fresh {
                    list.shared.wake.notify_one();
                }
            }
        })
    }
}

/// The sampling thread. [`Sampler::finish`] takes the last sample and ends it;
/// dropping it does the same.
pub struct Sampler {
    list: Watchlist,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Sample the processes of `list` every `interval`, timed on `clock`,
    /// into `records`.
    pub fn start(
        list: Watchlist,
        interval: Duration,
        clock: Instant,
        records: RecordSender,
    ) -> Sampler {
        Sampler::spawn(list, interval, clock, records, read)
    }

    /// [`Sampler::start`] with the processes read by `read`.
    fn spawn(
        list: Watchlist,
        interval: Duration,
        clock: Instant,
        records: RecordSender,
        read: impl FnMut(u32) -> Reading + Send + 'static,
    ) -> Sampler {
        let thread_list = list.clone();
        let thread = std::thread::Builder::new()
            .name("memptrace-rss".into())
            .spawn(move || sample_loop(&thread_list, interval, clock, &records, read))
            .expect("spawning the RSS sampler thread");
        Sampler {
            list,
            thread: Some(thread),
        }
    }

    /// Take the last sample of the processes still there, and stop.
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.list.lock().stop = true;
        self.list.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop();
    }
}

fn sample_loop(
    list: &Watchlist,
    interval: Duration,
    clock: Instant,
    records: &RecordSender,
    mut read: impl FnMut(u32) -> Reading,
) {
    let mut next = Instant::now();
    loop {
        let (pids, last) = {
            let mut watch = list.lock();
            loop {
                let now = Instant::now();
                if watch.stop || watch.fresh || now >= next {
                    break;
                }
                watch = list
                    .shared
                    .wake
                    .wait_timeout(watch, next - now)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
            }
            (watch.take_round(), watch.stop)
        };
        let ts_ns = clock.elapsed().as_nanos() as u64;
        let (rows, gone) = round(&pids, ts_ns, &mut read);
        if !gone.is_empty() {
            let mut watch = list.lock();
            for pid in gone {
                watch.live.remove(&pid);
            }
        }
        // The recorder is gone only after an error it reports itself.
        if records.send(rows).is_err() || last {
            return;
        }
        // The next tick in the future: a round for a new process does not
        // move the ticks, and a slow one skips those it overran.
        let now = Instant::now();
        while next <= now {
            next += interval;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::ThreadRecord;

    fn thread(pid: u32, tid: u32, end_ns: Option<u64>) -> Record {
        Record::Thread(ThreadRecord {
            tid,
            pid,
            name: String::new(),
            start_ns: 0,
            end_ns,
        })
    }

    fn wait_until(mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "not within 10 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn processes_are_learned_from_their_main_thread() {
        let mut watch = Watch::default();
        watch.observe(&thread(10, 10, None));
        watch.observe(&thread(10, 11, None));
        watch.observe(&thread(20, 20, None));
        assert!(watch.fresh);
        assert_eq!(watch.take_round(), [10, 20]);
        assert!(!watch.fresh);
        // A thread's end is not its process's.
        watch.observe(&thread(10, 11, Some(5)));
        assert_eq!(watch.take_round(), [10, 20]);
        // A process's end: sampled once more, then no longer.
        watch.observe(&thread(20, 20, Some(9)));
        assert_eq!(watch.take_round(), [10, 20]);
        assert_eq!(watch.take_round(), [10]);
        // A pid used again by a new child is sampled again.
        watch.observe(&thread(20, 20, None));
        assert_eq!(watch.take_round(), [10, 20]);
    }

    #[test]
    fn a_round_stamps_every_row_alike_and_finds_the_gone() {
        let figures = Resident {
            rss: 5,
            anon: 3,
            file: 1,
            shmem: 1,
            mapped: 50,
        };
        let (rows, gone) = round(&[1, 2, 3], 77, |pid| match pid {
            1 => Reading::Figures(figures),
            2 => Reading::NotYet,
            _ => Reading::Gone,
        });
        assert_eq!(
            rows,
            [Record::Rss(RssSample {
                ts_ns: 77,
                pid: 1,
                rss: 5,
                anon: 3,
                file: 1,
                shmem: 1,
                mapped: 50
            })]
        );
        assert_eq!(gone, [3]);
    }

    #[test]
    fn samples_at_start_every_interval_and_once_after_the_end() {
        let sink = crate::sink::MemorySink::new();
        let list = Watchlist::new();
        let recorder =
            crate::sink::Recorder::spawn_observed(Box::new(sink.clone()), list.observer());
        let figures = Resident {
            rss: 4096,
            ..Resident::default()
        };
        // Process 7 is read normally; 8 is not the program yet, then is.
        let mut reads_of_8 = 0;
        let sampler = Sampler::spawn(
            list.clone(),
            Duration::from_millis(2),
            Instant::now(),
            recorder.sender(),
            move |pid| match pid {
                8 if reads_of_8 < 3 => {
                    reads_of_8 += 1;
                    Reading::NotYet
                }
                _ => Reading::Figures(figures),
            },
        );
        let records = recorder.sender();
        records.send(vec![thread(7, 7, None)]).unwrap();
        records.send(vec![thread(8, 8, None)]).unwrap();
        let rows_of = |pid: u32| {
            sink.records()
                .into_iter()
                .filter(|r| matches!(r, Record::Rss(s) if s.pid == pid))
                .count()
        };
        wait_until(|| rows_of(7) >= 5 && rows_of(8) >= 2);
        records.send(vec![thread(8, 8, Some(1))]).unwrap();
        let seven = rows_of(7);
        wait_until(|| rows_of(7) >= seven + 5);
        // Ended: no more samples of it.
        let (seven, eight) = (rows_of(7), rows_of(8));
        wait_until(|| rows_of(7) >= seven + 5);
        assert_eq!(rows_of(8), eight);
        sampler.finish();
        drop(records);
        recorder.finish().unwrap();
        let stamps: Vec<u64> = sink
            .records()
            .into_iter()
            .filter_map(|r| match r {
                Record::Rss(s) => Some(s.ts_ns),
                _ => None,
            })
            .collect();
        assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "{stamps:?}");
    }
}
