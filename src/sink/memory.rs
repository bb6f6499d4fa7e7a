//! A sink that keeps every record in memory, for tests of the layers above.

use std::sync::{Arc, Mutex};

use super::{EventSink, Record, SinkError};

/// Collects records; clone it before handing it to a recorder to read them back.
#[derive(Clone, Default)]
pub struct MemorySink {
    records: Arc<Mutex<Vec<Record>>>,
    finished: Arc<Mutex<bool>>,
}

impl MemorySink {
    pub fn new() -> MemorySink {
        MemorySink::default()
    }

    pub fn records(&self) -> Vec<Record> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    pub fn is_finished(&self) -> bool {
        self.finished.lock().map(|f| *f).unwrap_or(false)
    }
}

impl EventSink for MemorySink {
    fn write(&mut self, record: &Record) -> Result<(), SinkError> {
        self.records
            .lock()
            .map_err(|_| SinkError::Stopped("memory sink poisoned".into()))?
            .push(record.clone());
        Ok(())
    }

    fn commit(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    fn finish(&mut self) -> Result<(), SinkError> {
        *self
            .finished
            .lock()
            .map_err(|_| SinkError::Stopped("memory sink poisoned".into()))? = true;
        Ok(())
    }
}
