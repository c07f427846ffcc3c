//! Where an aggregating run keeps its training examples: DAgger's dataset D = ∪ D_i grows
//! with every iteration, so its examples go to an unnamed file in the run directory as
//! they arrive, and memory keeps only what batching needs of each (`DatasetExample`:
//! lengths, episode, encoded size, the example's place in the file). A step's examples
//! are read back as the step is sent to the learner.
//!
//! The file is a cache, not a record: the trajectory store holds the episodes, and a
//! restarted coordinator rebuilds the dataset from it (and a new file). The file has no
//! name (`tempfile::tempfile_in`), so it goes when the coordinator ends, however it ends.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use prost::Message;
use tutor_proto::TrainExample;

/// The append-only file of encoded examples. One owner appends (the scheduler); any
/// number of `SpillReader`s read concurrently (positional reads, no shared cursor).
pub struct ExampleSpill {
    file: Arc<File>,
    len: u64,
}

impl ExampleSpill {
    /// An unnamed file in `dir` (removed by the kernel when the last handle closes).
    pub fn create_in(dir: &Path) -> io::Result<Self> {
        let file = tempfile::tempfile_in(dir).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "creating the training examples' file in {}: {e}",
                    dir.display()
                ),
            )
        })?;
        Ok(Self {
            file: Arc::new(file),
            len: 0,
        })
    }

    /// A spill over an open file (tests: one opened read-only refuses every write).
    #[cfg(test)]
    pub(crate) fn from_file(file: File) -> Self {
        Self {
            file: Arc::new(file),
            len: 0,
        }
    }

    /// Writes `example` at the end of the file; its place. On an error (a full disk)
    /// the file's length is unchanged for later appends: a torn write is overwritten.
    pub fn append(&mut self, example: &TrainExample) -> io::Result<DatasetExample> {
        let bytes = example.encode_to_vec();
        self.file.write_all_at(&bytes, self.len)?;
        let at = Body::Spilled {
            reader: SpillReader {
                file: self.file.clone(),
            },
            offset: self.len,
        };
        self.len += bytes.len() as u64;
        Ok(DatasetExample::with_body(example, bytes.len(), at))
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A reader of the examples' file.
#[derive(Clone)]
pub struct SpillReader {
    file: Arc<File>,
}

impl SpillReader {
    fn read(&self, offset: u64, len: usize) -> io::Result<TrainExample> {
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, offset)?;
        TrainExample::decode(buf.as_slice()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the training example at byte {offset} of the examples' file: {e}"),
            )
        })
    }
}

#[derive(Clone)]
enum Body {
    Memory(Arc<TrainExample>),
    Spilled { reader: SpillReader, offset: u64 },
}

/// One example of a dataset, in memory or in the examples' file, with what batching
/// needs to know of it without reading it.
#[derive(Clone)]
pub struct DatasetExample {
    episode_id: Arc<str>,
    turn_index: u32,
    tokens: u32,
    labels: u32,
    /// Bytes of the encoded example (`TrainExample::encoded_len`).
    encoded: u32,
    body: Body,
}

impl DatasetExample {
    /// An example kept in memory.
    pub fn in_memory(example: TrainExample) -> Self {
        let encoded = example.encoded_len();
        let example = Arc::new(example);
        Self::with_body(&example, encoded, Body::Memory(example.clone()))
    }

    fn with_body(example: &TrainExample, encoded: usize, body: Body) -> Self {
        Self {
            episode_id: example.episode_id.as_str().into(),
            turn_index: example.turn_index,
            tokens: example.tokens.len() as u32,
            labels: example.loss_mask.iter().filter(|m| **m).count() as u32,
            encoded: encoded as u32,
            body,
        }
    }

    /// Whether the example is in the examples' file rather than in memory.
    pub fn is_spilled(&self) -> bool {
        matches!(self.body, Body::Spilled { .. })
    }

    /// The example itself: a copy, or read from the examples' file (blocking).
    pub fn load(&self) -> io::Result<TrainExample> {
        match &self.body {
            Body::Memory(e) => Ok(TrainExample::clone(e)),
            Body::Spilled { reader, offset } => reader.read(*offset, self.encoded as usize),
        }
    }
}

/// What batching needs of an example: `make_batches` and `make_episode_batches` plan
/// with it, `split_oversized` sizes messages with it; `TrainExample` and
/// `DatasetExample` both have it.
pub trait BatchItem: Clone {
    fn token_count(&self) -> usize;
    fn label_count(&self) -> usize;
    fn episode(&self) -> &str;
    fn turn(&self) -> u32;
    /// Bytes of the encoded example (without its field tag and length).
    fn encoded_bytes(&self) -> usize;
}

impl BatchItem for TrainExample {
    fn token_count(&self) -> usize {
        self.tokens.len()
    }
    fn label_count(&self) -> usize {
        self.loss_mask.iter().filter(|m| **m).count()
    }
    fn episode(&self) -> &str {
        &self.episode_id
    }
    fn turn(&self) -> u32 {
        self.turn_index
    }
    fn encoded_bytes(&self) -> usize {
        self.encoded_len()
    }
}

impl BatchItem for DatasetExample {
    fn token_count(&self) -> usize {
        self.tokens as usize
    }
    fn label_count(&self) -> usize {
        self.labels as usize
    }
    fn episode(&self) -> &str {
        &self.episode_id
    }
    fn turn(&self) -> u32 {
        self.turn_index
    }
    fn encoded_bytes(&self) -> usize {
        self.encoded as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(n: usize, turn: u32) -> TrainExample {
        TrainExample {
            tokens: (0..n as u32).collect(),
            loss_mask: (0..n).map(|i| i % 3 == 0).collect(),
            episode_id: "ep-1".into(),
            turn_index: turn,
            old_logprobs: vec![-0.5; n],
            ..Default::default()
        }
    }

    /// Examples read back from the file equal those written, in any order, from
    /// clones of their handles, and their metadata is the example's.
    #[test]
    fn spilled_examples_read_back_equal() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = ExampleSpill::create_in(dir.path()).unwrap();
        let examples: Vec<TrainExample> = (0..5).map(|t| example(10 + 7 * t, t as u32)).collect();
        let refs: Vec<DatasetExample> = examples.iter().map(|e| spill.append(e).unwrap()).collect();
        assert_eq!(
            spill.len(),
            examples.iter().map(|e| e.encoded_len() as u64).sum::<u64>()
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the file has no name"
        );
        for (r, e) in refs.iter().zip(&examples).rev() {
            assert!(r.is_spilled());
            assert_eq!(r.clone().load().unwrap(), *e);
            assert_eq!(
                (
                    r.token_count(),
                    r.label_count(),
                    r.episode(),
                    r.turn(),
                    r.encoded_bytes()
                ),
                (
                    e.token_count(),
                    e.label_count(),
                    e.episode(),
                    e.turn(),
                    e.encoded_bytes()
                )
            );
        }
        let kept = DatasetExample::in_memory(examples[2].clone());
        assert!(!kept.is_spilled());
        assert_eq!(kept.load().unwrap(), examples[2]);
        assert_eq!(kept.encoded_bytes(), examples[2].encoded_len());
    }
}
