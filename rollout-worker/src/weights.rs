//! The worker side of the Weights stream: download a policy version, verify it.

use std::path::Path;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use tonic::Request;
use tutor_proto::auth::ClientAuth;
use tutor_proto::FetchWeightsRequest;

/// Downloads version `version` from a Weights endpoint into `dest`, verifying offsets,
/// size and sha256 before the file is renamed into place. Returns the checksum.
pub async fn download_weights(
    endpoint: &str,
    version: u64,
    expected_sha: &str,
    dest: &Path,
    auth: &ClientAuth,
) -> Result<String> {
    let channel = auth
        .endpoint(endpoint)
        .context("the weights endpoint")?
        .connect()
        .await
        .with_context(|| format!("connecting to the weights endpoint {endpoint}"))?;
    let mut client = tutor_proto::weights_client::WeightsClient::new(auth.channel(channel))
        .max_decoding_message_size(tutor_proto::MAX_MESSAGE_BYTES);
    let mut req = Request::new(FetchWeightsRequest { version });
    req.set_timeout(std::time::Duration::from_secs(300));
    let mut stream = client
        .fetch(req)
        .await
        .context("starting the weights stream")?
        .into_inner();
    let mut data = Vec::new();
    let mut stream_sha = String::new();
    let mut total = 0u64;
    while let Some(chunk) = stream
        .message()
        .await
        .context("reading the weights stream")?
    {
        if chunk.version != version {
            anyhow::bail!(
                "weights stream sent version {} while {version} was asked",
                chunk.version
            );
        }
        if chunk.offset != data.len() as u64 {
            anyhow::bail!(
                "weights chunk at offset {} but {} bytes received",
                chunk.offset,
                data.len()
            );
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
        anyhow::bail!(
            "weights stream for version {version} ended after {} of {total} bytes",
            data.len()
        );
    }
    let sha = hex::encode(Sha256::digest(&data));
    if sha != stream_sha || (!expected_sha.is_empty() && sha != expected_sha) {
        anyhow::bail!(
            "weights checksum mismatch for version {version}: got {sha}, stream said {stream_sha}, lease said {expected_sha}"
        );
    }
    if let Some(dir) = dest.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = dest.with_extension("partial");
    tokio::fs::write(&tmp, &data)
        .await
        .with_context(|| format!("writing {}", tmp.display()))?;
    tokio::fs::rename(&tmp, dest)
        .await
        .with_context(|| format!("renaming to {}", dest.display()))?;
    Ok(sha)
}
