//! The worker side of the Weights stream: download a policy version, verify it.

use std::path::Path;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tonic::Request;
use tutor_proto::auth::ClientAuth;
use tutor_proto::tls::TlsError;
use tutor_proto::FetchWeightsRequest;

/// Why a policy version could not be downloaded. The message is the step that failed; the
/// cause (transport, status, I/O) is its source.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("the weights endpoint")]
    Endpoint(#[source] TlsError),
    #[error("connecting to the weights endpoint {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("starting the weights stream")]
    Start(#[source] tonic::Status),
    #[error("reading the weights stream")]
    Read(#[source] tonic::Status),
    #[error("weights stream sent version {got} while {asked} was asked")]
    WrongVersion { got: u64, asked: u64 },
    #[error("weights chunk at offset {offset} but {received} bytes received")]
    WrongOffset { offset: u64, received: u64 },
    #[error("weights stream for version {version} ended after {received} of {total} bytes")]
    Short {
        version: u64,
        received: u64,
        total: u64,
    },
    #[error(
        "weights stream for version {version} sent an empty chunk at offset {offset} of \
         {total} bytes that is not the last: the learner's file is shorter than it published"
    )]
    EmptyChunk {
        version: u64,
        offset: u64,
        total: u64,
    },
    #[error("weights stream for version {version} sent more than the {total} bytes it announced")]
    Long { version: u64, total: u64 },
    #[error(
        "no weights chunk for {idle:?} (version {version}, {received} bytes received): the \
         learner stalled or the connection died"
    )]
    Idle {
        version: u64,
        received: u64,
        idle: Duration,
    },
    #[error("weights checksum mismatch for version {version}: got {got}, stream said {stream}, lease said {lease}")]
    Checksum {
        version: u64,
        got: String,
        stream: String,
        lease: String,
    },
    /// Writing the file: `context` names the step and the path.
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(context: String) -> impl FnOnce(std::io::Error) -> WeightsError {
    move |source| WeightsError::Io { context, source }
}

/// Longest wait for the next chunk of a download before it is given up (a stalled
/// learner, a dead connection). The whole download has no deadline: a large model over a
/// slow link takes as long as it takes while chunks keep coming.
pub const WEIGHTS_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Downloads version `version` from a Weights endpoint into `dest`, verifying offsets,
/// size and sha256 before the file is renamed into place. Returns the checksum. Chunks
/// are written to `dest.partial` as they arrive (memory stays at one chunk), and the
/// download fails if no chunk comes for [`WEIGHTS_IDLE_TIMEOUT`].
pub async fn download_weights(
    endpoint: &str,
    version: u64,
    expected_sha: &str,
    dest: &Path,
    auth: &ClientAuth,
) -> Result<String, WeightsError> {
    download_weights_with(
        endpoint,
        version,
        expected_sha,
        dest,
        auth,
        WEIGHTS_IDLE_TIMEOUT,
    )
    .await
}

/// [`download_weights`] with the idle timeout given.
pub async fn download_weights_with(
    endpoint: &str,
    version: u64,
    expected_sha: &str,
    dest: &Path,
    auth: &ClientAuth,
    idle: Duration,
) -> Result<String, WeightsError> {
    let channel = auth
        .endpoint(endpoint)
        .map_err(WeightsError::Endpoint)?
        .connect_timeout(idle)
        .connect()
        .await
        .map_err(|source| WeightsError::Connect {
            endpoint: endpoint.to_string(),
            source,
        })?;
    let mut client = tutor_proto::weights_client::WeightsClient::new(auth.channel(channel))
        .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES);
    let mut stream = tokio::time::timeout(
        idle,
        client.fetch(Request::new(FetchWeightsRequest { version })),
    )
    .await
    .map_err(|_| WeightsError::Idle {
        version,
        received: 0,
        idle,
    })?
    .map_err(WeightsError::Start)?
    .into_inner();
    if let Some(dir) = dest.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(io_err(format!("creating {}", dir.display())))?;
    }
    let tmp = dest.with_extension("partial");
    let result = async {
        let mut file = tokio::fs::File::create(&tmp)
            .await
            .map_err(io_err(format!("creating {}", tmp.display())))?;
        let mut hasher = Sha256::new();
        let mut received = 0u64;
        let mut stream_sha = String::new();
        let mut total = 0u64;
        loop {
            let next = tokio::time::timeout(idle, stream.message())
                .await
                .map_err(|_| WeightsError::Idle {
                    version,
                    received,
                    idle,
                })?
                .map_err(WeightsError::Read)?;
            let Some(chunk) = next else { break };
            if chunk.version != version {
                return Err(WeightsError::WrongVersion {
                    got: chunk.version,
                    asked: version,
                });
            }
            if chunk.offset != received {
                return Err(WeightsError::WrongOffset {
                    offset: chunk.offset,
                    received,
                });
            }
            if chunk.offset == 0 {
                stream_sha = chunk.sha256.clone();
                total = chunk.total_bytes;
            }
            if chunk.data.is_empty() && !chunk.last {
                return Err(WeightsError::EmptyChunk {
                    version,
                    offset: received,
                    total,
                });
            }
            if received + chunk.data.len() as u64 > total {
                return Err(WeightsError::Long { version, total });
            }
            hasher.update(&chunk.data);
            file.write_all(&chunk.data)
                .await
                .map_err(io_err(format!("writing {}", tmp.display())))?;
            received += chunk.data.len() as u64;
            if chunk.last {
                break;
            }
        }
        if received != total {
            return Err(WeightsError::Short {
                version,
                received,
                total,
            });
        }
        let sha = hex::encode(hasher.finalize());
        if sha != stream_sha || (!expected_sha.is_empty() && sha != expected_sha) {
            return Err(WeightsError::Checksum {
                version,
                got: sha,
                stream: stream_sha,
                lease: expected_sha.to_string(),
            });
        }
        file.sync_all()
            .await
            .map_err(io_err(format!("writing {}", tmp.display())))?;
        Ok(sha)
    }
    .await;
    match result {
        Ok(sha) => {
            tokio::fs::rename(&tmp, dest)
                .await
                .map_err(io_err(format!("renaming to {}", dest.display())))?;
            Ok(sha)
        }
        Err(e) => {
            let _ = tokio::fs::remove_file(&tmp).await;
            Err(e)
        }
    }
}
