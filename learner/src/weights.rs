//! Published policy versions on disk, and the chunked Weights stream that serves them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tutor_proto::weights_server::Weights;
use tutor_proto::{FetchWeightsRequest, WeightsChunk, WEIGHTS_CHUNK_BYTES};

/// A published version: its safetensors file and checksum (the same record the weights
/// broadcast sends).
pub use tutor_collective::broadcast::VersionFile as PublishedVersion;

/// The versions this learner has published. Shared read-mostly between the trainer
/// (which adds versions) and the Weights service (which streams them).
#[derive(Clone)]
pub struct WeightsStore {
    dir: PathBuf,
    versions: Arc<RwLock<BTreeMap<u64, PublishedVersion>>>,
    /// The newest version, for those who act on each one as it is published.
    newest: Arc<tokio::sync::watch::Sender<Option<PublishedVersion>>>,
}

impl WeightsStore {
    pub fn new(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            versions: Default::default(),
            newest: Arc::new(tokio::sync::watch::Sender::new(None)),
        })
    }

    /// The newest registered version, now and as each newer one is registered.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Option<PublishedVersion>> {
        self.newest.subscribe()
    }

    /// Where version `v` is written before `register` makes it visible.
    pub fn path_for(&self, version: u64) -> PathBuf {
        self.dir.join(format!("policy-v{version:06}.safetensors"))
    }

    /// Makes a written version visible: checksums the file.
    pub fn register(&self, version: u64) -> Result<PublishedVersion> {
        let path = self.path_for(version);
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let sha256 = hex::encode(Sha256::digest(&data));
        let pv = PublishedVersion {
            version,
            path,
            sha256,
            bytes: data.len() as u64,
        };
        self.versions
            .write()
            .expect("weights store lock")
            .insert(version, pv.clone());
        self.newest.send_if_modified(|newest| {
            let newer = newest.as_ref().is_none_or(|n| n.version <= version);
            if newer {
                *newest = Some(pv.clone());
            }
            newer
        });
        Ok(pv)
    }

    pub fn get(&self, version: u64) -> Option<PublishedVersion> {
        self.versions
            .read()
            .expect("weights store lock")
            .get(&version)
            .cloned()
    }

    pub fn latest(&self) -> Option<PublishedVersion> {
        self.versions
            .read()
            .expect("weights store lock")
            .values()
            .next_back()
            .cloned()
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<WeightsChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Weights for WeightsStore {
    type FetchStream = ChunkStream;

    async fn fetch(
        &self,
        request: Request<FetchWeightsRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let version = request.into_inner().version;
        let pv = self.get(version).ok_or_else(|| {
            Status::not_found(format!("policy version {version} is not published"))
        })?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let result: Result<(), Status> = async {
                let mut file = tokio::fs::File::open(&pv.path)
                    .await
                    .map_err(|e| Status::internal(format!("opening {}: {e}", pv.path.display())))?;
                let mut offset = 0u64;
                loop {
                    // Never more than was published, whatever the file holds now.
                    let want = (pv.bytes - offset).min(WEIGHTS_CHUNK_BYTES as u64) as usize;
                    let mut buf = vec![0u8; want];
                    let mut filled = 0;
                    while filled < buf.len() {
                        let n = file
                            .read(&mut buf[filled..])
                            .await
                            .map_err(|e| Status::internal(format!("reading weights: {e}")))?;
                        if n == 0 {
                            // A file cut short after it was published: an error, not an
                            // endless stream of empty chunks.
                            return Err(Status::data_loss(format!(
                                "{} is shorter than policy version {} as published: it ends \
                                 at byte {} of {}",
                                pv.path.display(),
                                pv.version,
                                offset + filled as u64,
                                pv.bytes
                            )));
                        }
                        filled += n;
                    }
                    let last = offset + filled as u64 >= pv.bytes;
                    let chunk = WeightsChunk {
                        version: pv.version,
                        offset,
                        data: buf,
                        total_bytes: pv.bytes,
                        sha256: if offset == 0 {
                            pv.sha256.clone()
                        } else {
                            String::new()
                        },
                        last,
                    };
                    offset += filled as u64;
                    if tx.send(Ok(chunk)).await.is_err() {
                        return Ok(()); // the client went away
                    }
                    if last {
                        return Ok(());
                    }
                }
            }
            .await;
            if let Err(status) = result {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_stream::StreamExt;

    use super::*;

    /// A subscriber sees the newest version at once and each newer one as it is
    /// registered; registering an older one again (a resume re-registers them all) does
    /// not take it back.
    #[tokio::test]
    async fn subscribers_see_the_newest_version_and_never_an_older_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = WeightsStore::new(dir.path()).unwrap();
        let mut newest = store.subscribe();
        assert!(newest.borrow().is_none());
        for v in [0, 1, 2] {
            std::fs::write(store.path_for(v), vec![v as u8; 10]).unwrap();
        }
        store.register(0).unwrap();
        store.register(2).unwrap();
        assert!(newest.has_changed().unwrap());
        assert_eq!(newest.borrow_and_update().as_ref().unwrap().version, 2);
        store.register(1).unwrap();
        assert!(!newest.has_changed().unwrap());
        let late = store.subscribe();
        let seen = late.borrow().clone().unwrap();
        assert_eq!((seen.version, seen.bytes), (2, 10));
        assert_eq!(seen.sha256, store.get(2).unwrap().sha256);
    }

    /// A published file cut short afterwards (a full disk, an operator's cleanup) makes
    /// the stream end with an error naming the file and where it ends. Before, the
    /// server sent empty chunks forever and the worker waited on them.
    #[tokio::test]
    async fn a_file_shorter_than_published_is_an_error_not_an_endless_stream() {
        let dir = tempfile::tempdir().unwrap();
        let store = WeightsStore::new(dir.path()).unwrap();
        let size = WEIGHTS_CHUNK_BYTES + 1000;
        std::fs::write(store.path_for(3), vec![7u8; size]).unwrap();
        let pv = store.register(3).unwrap();
        assert_eq!(pv.bytes, size as u64);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(store.path_for(3))
            .unwrap();
        f.set_len(WEIGHTS_CHUNK_BYTES as u64 + 10).unwrap();

        let mut stream = store
            .fetch(Request::new(FetchWeightsRequest { version: 3 }))
            .await
            .unwrap()
            .into_inner();
        let mut chunks = 0;
        let err = loop {
            let item = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .expect("the stream answers")
                .expect("the stream ends with an error, not silently");
            match item {
                Ok(c) => {
                    chunks += 1;
                    assert!(!c.last, "a short file is never sent as complete");
                    assert!(chunks < 10, "an endless stream of chunks");
                }
                Err(status) => break status,
            }
        };
        assert_eq!(err.code(), tonic::Code::DataLoss);
        assert!(
            err.message().contains("shorter than policy version 3")
                && err
                    .message()
                    .contains(&format!("byte {}", WEIGHTS_CHUNK_BYTES + 10)),
            "{}",
            err.message()
        );
    }
}
