//! Parquet task files: each row as the JSON object a JSONL line would hold.
//!
//! SWE-bench, SWE-Gym and SWE-rebench are published on the Hub this way.
//!
//! A task file is untrusted input, and the `parquet` crate's row reader panics on some
//! corrupt files (a negative column-chunk offset in the footer asserts in
//! `ColumnChunkMetaData::byte_range`). So the footer's byte ranges are checked before any
//! row is read, and the reader runs under `catch_unwind` as well, so that a corruption
//! not checked here is an error naming the file, not a crashed worker.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value;

/// Why a Parquet file could not be opened.
pub(super) enum OpenError {
    Io(std::io::Error),
    /// The message for the user.
    Format(String),
}

/// The text of a caught panic.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown failure".into())
}

/// Every column chunk the footer names must lie inside the file (the reader asserts that
/// offsets and sizes are not negative, and would seek past the end otherwise).
fn check_byte_ranges(meta: &ParquetMetaData, file_len: u64) -> Result<(), String> {
    for (g, group) in meta.row_groups().iter().enumerate() {
        for column in group.columns() {
            let start = column
                .dictionary_page_offset()
                .unwrap_or(column.data_page_offset());
            let len = column.compressed_size();
            let inside = u64::try_from(start)
                .ok()
                .zip(u64::try_from(len).ok())
                .and_then(|(s, l)| s.checked_add(l))
                .is_some_and(|end| end <= file_len);
            if !inside {
                return Err(format!(
                    "not a readable Parquet file: the footer puts column `{}` of row group {} \
                     at bytes {start}..+{len}, outside the {file_len}-byte file (corrupt file?)",
                    column.column_path(),
                    g + 1
                ));
            }
        }
    }
    Ok(())
}

/// The rows of the file at `path`, in order, each as a JSON object or the message saying
/// why it could not be read. Never panics on a corrupt file.
pub(super) fn rows(path: &Path) -> Result<impl Iterator<Item = Result<Value, String>>, OpenError> {
    let file = std::fs::File::open(path).map_err(OpenError::Io)?;
    let file_len = file.metadata().map_err(OpenError::Io)?.len();
    let reader = catch_unwind(AssertUnwindSafe(|| SerializedFileReader::new(file)))
        .map_err(|p| {
            OpenError::Format(format!(
                "not a readable Parquet file (corrupt?): {}",
                panic_text(p.as_ref())
            ))
        })?
        .map_err(|e| OpenError::Format(format!("not a readable Parquet file: {e}")))?;
    check_byte_ranges(reader.metadata(), file_len).map_err(OpenError::Format)?;
    let mut iter = Some(reader.into_iter());
    Ok(std::iter::from_fn(move || {
        let rows = iter.as_mut()?;
        match catch_unwind(AssertUnwindSafe(|| rows.next())) {
            Ok(row) => row.map(|row| {
                row.map(|r| r.to_json_value())
                    .map_err(|e| format!("reading the row: {e}"))
            }),
            Err(p) => {
                // The reader's state is unknown after a panic: stop here.
                iter = None;
                Some(Err(format!(
                    "reading the row: the Parquet reader failed on a corrupt file: {}",
                    panic_text(p.as_ref())
                )))
            }
        }
    }))
}
