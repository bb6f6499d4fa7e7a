//! One Parquet file of an export being written: Snappy, row groups of
//! [`ROWS_PER_GROUP`] rows, the trace's id as its first column, written as
//! `NAME.parquet.partial` and given its name only when the export is whole.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;

use super::{ROWS_PER_GROUP, field};
use crate::report::ReportError;

/// One Parquet file being written: `trace_id` first, then the table's
/// columns; `NAME.parquet.partial` until [`Sheet::publish`] renames it, and
/// removed if dropped before.
pub(super) struct Sheet {
    path: PathBuf,
    partial: PathBuf,
    writer: Option<ArrowWriter<File>>,
    schema: SchemaRef,
    pub(super) trace_id: String,
    rows: u64,
    published: bool,
}

impl Sheet {
    /// `delta`: integer columns that mostly grow (ids, times, addresses),
    /// stored as differences (DELTA_BINARY_PACKED) rather than in a
    /// dictionary.
    pub(super) fn create(
        dir: &Path,
        name: &str,
        id: &str,
        fields: Vec<Field>,
        delta: &[&str],
    ) -> Result<Sheet, ReportError> {
        let path = dir.join(format!("{name}.parquet"));
        let partial = dir.join(format!("{name}.parquet.partial"));
        let all: Vec<Field> = std::iter::once(field("trace_id", DataType::Utf8, false))
            .chain(fields)
            .collect();
        let schema = Arc::new(Schema::new(all));
        let mut props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_row_count(Some(ROWS_PER_GROUP))
            .set_created_by(format!("memptrace {}", env!("CARGO_PKG_VERSION")));
        for column in delta {
            let path = ColumnPath::from(*column);
            props = props
                .set_column_dictionary_enabled(path.clone(), false)
                .set_column_encoding(path, Encoding::DELTA_BINARY_PACKED);
        }
        let props = props.build();
        // Owner only, as the trace itself (docs/schema.md, "Who may read it").
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&partial)
            .map_err(|source| ReportError::Write {
                path: partial.clone(),
                source,
            })?;
        let writer = ArrowWriter::try_new(file, schema.clone(), Some(props))
            .map_err(|e| parquet_error(&partial, e))?;
        Ok(Sheet {
            path,
            partial,
            writer: Some(writer),
            schema,
            trace_id: id.to_string(),
            rows: 0,
            published: false,
        })
    }

    /// Write one batch of the table's columns (all of one length; none is
    /// written when it is 0).
    pub(super) fn write(&mut self, columns: Vec<ArrayRef>) -> Result<(), ReportError> {
        let len = columns.first().map_or(0, |c| c.len());
        if len == 0 {
            return Ok(());
        }
        let ids: ArrayRef = Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            self.trace_id.as_str(),
            len,
        )));
        let all: Vec<ArrayRef> = std::iter::once(ids).chain(columns).collect();
        let batch = RecordBatch::try_new(self.schema.clone(), all)
            .map_err(|e| parquet_error(&self.partial, e.into()))?;
        if let Some(writer) = self.writer.as_mut() {
            writer
                .write(&batch)
                .map_err(|e| parquet_error(&self.partial, e))?;
        }
        self.rows += len as u64;
        Ok(())
    }

    /// Close the file (still `.partial`); the rows it holds.
    pub(super) fn close(&mut self) -> Result<u64, ReportError> {
        if let Some(writer) = self.writer.take() {
            writer
                .close()
                .map_err(|e| parquet_error(&self.partial, e))?;
        }
        Ok(self.rows)
    }

    /// Give the closed file its name.
    pub(super) fn publish(&mut self) -> Result<(), ReportError> {
        std::fs::rename(&self.partial, &self.path).map_err(|source| ReportError::Write {
            path: self.path.clone(),
            source,
        })?;
        self.published = true;
        Ok(())
    }
}

impl Drop for Sheet {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

fn parquet_error(path: &Path, e: parquet::errors::ParquetError) -> ReportError {
    ReportError::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    }
}
