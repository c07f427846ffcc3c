//! The worker side of the Weights stream: download a policy version, verify it.

use std::path::Path;

use sha2::{Digest, Sha256};
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
    WrongOffset { offset: u64, received: usize },
    #[error("weights stream for version {version} ended after {received} of {total} bytes")]
    Short {
        version: u64,
        received: usize,
        total: u64,
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

/// Downloads version `version` from a Weights endpoint into `dest`, verifying offsets,
/// size and sha256 before the file is renamed into place. Returns the checksum.
pub async fn download_weights(
    endpoint: &str,
    version: u64,
    expected_sha: &str,
    dest: &Path,
    auth: &ClientAuth,
) -> Result<String, WeightsError> {
    let channel = auth
        .endpoint(endpoint)
        .map_err(WeightsError::Endpoint)?
        .connect()
        .await
        .map_err(|source| WeightsError::Connect {
            endpoint: endpoint.to_string(),
            source,
        })?;
    let mut client = tutor_proto::weights_client::WeightsClient::new(auth.channel(channel))
        .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES);
    let mut req = Request::new(FetchWeightsRequest { version });
    req.set_timeout(std::time::Duration::from_secs(300));
    let mut stream = client
        .fetch(req)
        .await
        .map_err(WeightsError::Start)?
        .into_inner();
    let mut data = Vec::new();
    let mut stream_sha = String::new();
    let mut total = 0u64;
    while let Some(chunk) = stream.message().await.map_err(WeightsError::Read)? {
        if chunk.version != version {
            return Err(WeightsError::WrongVersion {
                got: chunk.version,
                asked: version,
            });
        }
        if chunk.offset != data.len() as u64 {
            return Err(WeightsError::WrongOffset {
                offset: chunk.offset,
                received: data.len(),
            });
        }
        if chunk.offset == 0 {
            stream_sha = chunk.sha256.clone();
            total = chunk.total_bytes;
        }
        data.extend_from_slice(&chunk.data);
        if chunk.last {
            break;
        }
    }
    if data.len() as u64 != total {
        return Err(WeightsError::Short {
            version,
            received: data.len(),
            total,
        });
    }
    let sha = hex::encode(Sha256::digest(&data));
    if sha != stream_sha || (!expected_sha.is_empty() && sha != expected_sha) {
        return Err(WeightsError::Checksum {
            version,
            got: sha,
            stream: stream_sha,
            lease: expected_sha.to_string(),
        });
    }
    if let Some(dir) = dest.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(io_err(format!("creating {}", dir.display())))?;
    }
    let tmp = dest.with_extension("partial");
    tokio::fs::write(&tmp, &data)
        .await
        .map_err(io_err(format!("writing {}", tmp.display())))?;
    tokio::fs::rename(&tmp, dest)
        .await
        .map_err(io_err(format!("renaming to {}", dest.display())))?;
    Ok(sha)
}
