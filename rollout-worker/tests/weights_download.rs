//! Downloading a policy version from a Weights server that misbehaves: it must end with
//! a clear error in bounded time, leaving no partial file in place of the weights.

use std::pin::Pin;
use std::time::{Duration, Instant};

use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tutor_proto::auth::ClientAuth;
use tutor_proto::weights_server::{Weights, WeightsServer};
use tutor_proto::{FetchWeightsRequest, WeightsChunk};
use tutor_rollout_worker::weights::{download_weights_with, WeightsError};

/// How the fake learner misbehaves after its first chunk.
#[derive(Clone, Copy)]
enum After {
    /// Sends nothing more and keeps the stream open.
    Stall,
    /// Sends empty chunks, never the last (the old server with a file cut short).
    EmptyChunks,
}

#[derive(Clone, Copy)]
struct BadLearner(After);

type ChunkStream = Pin<Box<dyn Stream<Item = Result<WeightsChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Weights for BadLearner {
    type FetchStream = ChunkStream;

    async fn fetch(
        &self,
        request: Request<FetchWeightsRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let version = request.into_inner().version;
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let after = self.0;
        tokio::spawn(async move {
            let first = WeightsChunk {
                version,
                offset: 0,
                data: vec![1u8; 1000],
                total_bytes: 3000,
                sha256: "0".repeat(64),
                last: false,
            };
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            match after {
                After::Stall => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    drop(tx);
                }
                After::EmptyChunks => loop {
                    let empty = WeightsChunk {
                        version,
                        offset: 1000,
                        total_bytes: 3000,
                        ..Default::default()
                    };
                    if tx.send(Ok(empty)).await.is_err() {
                        return;
                    }
                },
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

async fn serve(learner: BadLearner) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WeightsServer::new(learner))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

/// A learner that stops sending mid-file fails the download after the idle timeout,
/// naming how much arrived. Before, the download waited for the call's 300 s deadline
/// with the whole file buffered in memory.
#[tokio::test]
async fn a_stalled_download_ends_after_the_idle_timeout() {
    let endpoint = serve(BadLearner(After::Stall)).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("policy-v000004.safetensors");
    let start = Instant::now();
    let err = download_weights_with(
        &endpoint,
        4,
        "",
        &dest,
        &ClientAuth::new(None),
        Duration::from_secs(1),
    )
    .await
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(
            err,
            WeightsError::Idle {
                version: 4,
                received: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("1000 bytes received"), "{err}");
    assert!(!dest.exists());
    assert!(
        !dest.with_extension("partial").exists(),
        "the partial file is removed"
    );
}

/// Empty chunks that are not the last are an error at once, not an endless wait.
#[tokio::test]
async fn empty_chunks_that_never_end_are_an_error() {
    let endpoint = serve(BadLearner(After::EmptyChunks)).await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("policy-v000005.safetensors");
    let err = tokio::time::timeout(
        Duration::from_secs(20),
        download_weights_with(
            &endpoint,
            5,
            "",
            &dest,
            &ClientAuth::new(None),
            Duration::from_secs(5),
        ),
    )
    .await
    .expect("the download ends")
    .unwrap_err();
    assert!(
        matches!(
            err,
            WeightsError::EmptyChunk {
                version: 5,
                offset: 1000,
                total: 3000
            }
        ),
        "{err}"
    );
    assert!(!dest.exists());
}
