//! A channel bounded by the weight of what it holds, not by how many
//! messages: between the tracer, the pipeline and the recorder a message is
//! a batch of anything from one record to tens of thousands of calls, and a
//! queue of 32 or 64 batches held from a few kilobytes to hundreds of
//! megabytes (`-f -- make -j2`: about 1 GB of calls waiting, issue 19).
//!
//! Each item is weighed (about the bytes it holds) when it is sent. A send
//! waits while the queue holds its bound; nothing is ever dropped. What the
//! receiver took counts until it lets go of the [`Permit`] it came with, so
//! the bound covers the batch being worked on too. An item heavier than the
//! whole bound goes through alone, when the queue is empty.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// What the two sides share: the weight held, and whether the receiver is
/// gone (a waiting sender must not wait for room that will never come).
struct Room {
    state: Mutex<State>,
    freed: Condvar,
    bound: u64,
}

#[derive(Default)]
struct State {
    held: u64,
    closed: bool,
}

impl Room {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue has room for `weight` more (an empty queue always has).
    fn fits(&self, state: &State, weight: u64) -> bool {
        state.held == 0 || state.held.saturating_add(weight) <= self.bound
    }

    fn release(&self, weight: u64) {
        let mut state = self.lock();
        state.held = state.held.saturating_sub(weight);
        drop(state);
        self.freed.notify_all();
    }
}

/// A new queue holding at most `bound` of weight, as `weigh` weighs items.
pub fn bounded<T>(bound: u64, weigh: fn(&T) -> u64) -> (Sender<T>, Receiver<T>) {
    let (tx, rx) = mpsc::channel();
    let room = Arc::new(Room {
        state: Mutex::new(State::default()),
        freed: Condvar::new(),
        bound,
    });
    let sender = Sender {
        tx,
        room: room.clone(),
        weigh,
    };
    (sender, Receiver { rx, room })
}

/// The sending side; clones share the bound.
pub struct Sender<T> {
    tx: mpsc::Sender<(T, u64)>,
    room: Arc<Room>,
    weigh: fn(&T) -> u64,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            tx: self.tx.clone(),
            room: self.room.clone(),
            weigh: self.weigh,
        }
    }
}

/// Why an item came back from [`Sender::try_send`].
#[derive(Debug, PartialEq, Eq)]
pub enum TrySendError<T> {
    /// No room now.
    Full(T),
    /// The receiver is gone.
    Disconnected(T),
}

impl<T> Sender<T> {
    /// Send `item`, waiting for room; `Err(item)` when the receiver is gone.
    pub fn send(&self, item: T) -> Result<(), T> {
        let weight = (self.weigh)(&item);
        let mut state = self.room.lock();
        while !state.closed && !self.room.fits(&state, weight) {
            state = self
                .room
                .freed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
        if state.closed {
            return Err(item);
        }
        state.held += weight;
        drop(state);
        self.post(item, weight)
    }

    /// Send `item` only if the queue has room for it now.
    pub fn try_send(&self, item: T) -> Result<(), TrySendError<T>> {
        let weight = (self.weigh)(&item);
        let mut state = self.room.lock();
        if state.closed {
            return Err(TrySendError::Disconnected(item));
        }
        if !self.room.fits(&state, weight) {
            return Err(TrySendError::Full(item));
        }
        state.held += weight;
        drop(state);
        self.post(item, weight).map_err(TrySendError::Disconnected)
    }

    fn post(&self, item: T, weight: u64) -> Result<(), T> {
        self.tx
            .send((item, weight))
            .map_err(|mpsc::SendError((item, _))| {
                self.room.release(weight);
                item
            })
    }
}

/// The receiving side.
pub struct Receiver<T> {
    rx: mpsc::Receiver<(T, u64)>,
    room: Arc<Room>,
}

/// The weight of an item taken from the queue, given back when dropped.
pub struct Permit {
    room: Arc<Room>,
    weight: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.room.release(self.weight);
    }
}

impl<T> Receiver<T> {
    /// The next item and its permit; `None` once every sender is gone and
    /// the queue is empty.
    pub fn recv(&self) -> Option<(T, Permit)> {
        self.rx
            .recv()
            .ok()
            .map(|(item, weight)| self.permit(item, weight))
    }

    /// As [`Receiver::recv`], waiting at most `wait`.
    pub fn recv_timeout(&self, wait: Duration) -> Result<(T, Permit), RecvTimeoutError> {
        self.rx
            .recv_timeout(wait)
            .map(|(item, weight)| self.permit(item, weight))
    }

    fn permit(&self, item: T, weight: u64) -> (T, Permit) {
        let permit = Permit {
            room: self.room.clone(),
            weight,
        };
        (item, permit)
    }
}

impl<T> Iterator for &Receiver<T> {
    type Item = (T, Permit);

    fn next(&mut self) -> Option<(T, Permit)> {
        self.recv()
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.room.lock().closed = true;
        self.room.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::thread;

    #[allow(clippy::ptr_arg)] // the items are `Vec`s
    fn weight(item: &Vec<u64>) -> u64 {
        item.len() as u64
    }

    #[test]
    fn a_sender_waits_at_the_bound_and_nothing_is_lost() {
        let (tx, rx) = bounded(10, weight);
        // The producer sends 100 batches of 4; the queue holds 10 at most,
        // counting the batch the consumer is working on.
        let most = Arc::new(AtomicU64::new(0));
        let seen = most.clone();
        let room = rx.room.clone();
        let producer = thread::spawn(move || {
            for n in 0..100u64 {
                tx.send(vec![n; 4]).unwrap();
                let held = room.lock().held;
                seen.fetch_max(held, Ordering::SeqCst);
            }
        });
        let mut got = Vec::new();
        for (batch, _permit) in &rx {
            thread::sleep(Duration::from_micros(200));
            got.push(batch[0]);
            assert_eq!(batch.len(), 4);
        }
        producer.join().unwrap();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert!(most.load(Ordering::SeqCst) <= 10, "held {most:?}");
        assert_eq!(rx.room.lock().held, 0);
    }

    #[test]
    fn try_send_says_full_and_gives_the_item_back() {
        let (tx, rx) = bounded(10, weight);
        tx.try_send(vec![1; 6]).unwrap();
        assert_eq!(tx.try_send(vec![2; 6]), Err(TrySendError::Full(vec![2; 6])));
        // Taken but still held: no room yet.
        let (first, permit) = rx.recv().unwrap();
        assert_eq!(first, vec![1; 6]);
        assert_eq!(tx.try_send(vec![2; 6]), Err(TrySendError::Full(vec![2; 6])));
        drop(permit);
        tx.try_send(vec![2; 6]).unwrap();
        assert_eq!(rx.recv().unwrap().0, vec![2; 6]);
    }

    #[test]
    fn an_item_over_the_bound_goes_alone_into_an_empty_queue() {
        let (tx, rx) = bounded(10, weight);
        tx.send(vec![0; 50]).unwrap();
        assert_eq!(tx.try_send(vec![1]), Err(TrySendError::Full(vec![1])));
        let (big, permit) = rx.recv().unwrap();
        drop(permit);
        assert_eq!(big.len(), 50);
        tx.try_send(vec![1]).unwrap();
    }

    #[test]
    fn a_sender_at_the_bound_goes_on_when_the_receiver_lets_go() {
        let (tx, rx) = bounded(10, weight);
        tx.send(vec![0; 8]).unwrap();
        let (_, permit) = rx.recv().unwrap();
        let sender = thread::spawn(move || tx.send(vec![1; 8]));
        thread::sleep(Duration::from_millis(50));
        assert!(!sender.is_finished(), "sent past the bound");
        drop(permit);
        sender.join().unwrap().unwrap();
        assert_eq!(rx.recv().unwrap().0, vec![1; 8]);
    }

    #[test]
    fn a_waiting_sender_gets_its_item_back_when_the_receiver_goes() {
        let (tx, rx) = bounded(10, weight);
        tx.send(vec![0; 10]).unwrap();
        let waiting = thread::spawn(move || tx.send(vec![1; 5]));
        thread::sleep(Duration::from_millis(50));
        drop(rx);
        assert_eq!(waiting.join().unwrap(), Err(vec![1; 5]));
    }
}
