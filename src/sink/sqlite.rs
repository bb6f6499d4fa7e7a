//! SQLite storage (placeholder; being written).

use std::path::Path;

use super::{EventSink, Record, SinkError};

pub struct SqliteSink {
    conn: rusqlite::Connection,
}

impl SqliteSink {
    pub fn create(path: &Path) -> Result<SqliteSink, SinkError> {
        Ok(SqliteSink {
            conn: rusqlite::Connection::open(path)?,
        })
    }
}

impl EventSink for SqliteSink {
    fn write(&mut self, _record: &Record) -> Result<(), SinkError> {
        let _ = &self.conn;
        Ok(())
    }
    fn commit(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
    fn finish(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}
