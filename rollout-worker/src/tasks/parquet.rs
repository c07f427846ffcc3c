//! Parquet task files: each row as the JSON object a JSONL line would hold.
//!
//! SWE-bench, SWE-Gym and SWE-rebench are published on the Hub this way.

use std::path::Path;

use parquet::file::reader::SerializedFileReader;
use serde_json::Value;

/// Why a Parquet file could not be opened.
pub(super) enum OpenError {
    Io(std::io::Error),
    /// The message for the user.
    Format(String),
}

/// The rows of the file at `path`, in order, each as a JSON object or the message saying
/// why it could not be read.
pub(super) fn rows(path: &Path) -> Result<impl Iterator<Item = Result<Value, String>>, OpenError> {
    let file = std::fs::File::open(path).map_err(OpenError::Io)?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| OpenError::Format(format!("not a readable Parquet file: {e}")))?;
    Ok(reader.into_iter().map(|row| {
        row.map(|r| r.to_json_value())
            .map_err(|e| format!("reading the row: {e}"))
    }))
}
