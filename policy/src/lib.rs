//! The student model of Tutor: a Qwen3-style transformer in `tch` (also reading and writing
//! Qwen2 and Llama checkpoints, see `config.rs`), its Hugging Face checkpoint format, a
//! byte-level BPE tokenizer with the ChatML template or the model directory's own Jinja chat template, and batched KV-cache generation with
//! per-token logprobs, and the continuous-batching engine behind `tutor serve`. Used by the learner (training forward)
//! and the rollout workers (generation).

mod attention_backend;
mod chat_template;
mod checkpoint;
mod config;
mod engine;
mod error;
mod generate;
mod model;
mod packed;
mod panels;
mod prefix_cache;
mod tokenizer;

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

pub use attention_backend::{avoid_cudnn_attention, cudnn_attention_enabled, CUDNN_ATTENTION_ENV};
pub use chat_template::{
    ChatTemplate, CHAT_TEMPLATE_FILE, MAX_RENDER_BYTES, RENDER_FUEL, TOKENIZER_CONFIG_FILE,
};
pub use checkpoint::{weight_files, HF_EXTRAS, INDEX_FILE};
pub use config::{Family, ModelConfig, RopeScaling, SUPPORTED_MODELS};
pub use engine::{
    spawn_engine, Completion, DoneEvent, EngineConfig, EngineEvent, EngineHandle, EngineRequest,
    EventSender, LoadError, RequestError, TokenEvent, WeightsSource,
};
pub use error::PolicyError;
pub use generate::{fit_context, FinishReason, GenParams, Generation};
pub use model::{param_unit, ParamGate, Policy};
pub use prefix_cache::PrefixStats;

/// The device a setting names: `"cpu"`, `"cuda"` (GPU `default_gpu`) or `"cuda:N"`;
/// `None` for anything else (the caller names its setting in the error).
pub fn parse_device(text: &str, default_gpu: usize) -> Option<tch::Device> {
    match text.trim() {
        "cpu" => Some(tch::Device::Cpu),
        "cuda" => Some(tch::Device::Cuda(default_gpu)),
        d => d
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(tch::Device::Cuda),
    }
}

/// A CUDA device libtorch does not see.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cuda:{index} is not there: libtorch sees {count} CUDA device(s) (a CPU-only libtorch, \
     no driver, or CUDA_VISIBLE_DEVICES hides it)"
)]
pub struct MissingDevice {
    pub index: usize,
    pub count: i64,
}

/// Checks that libtorch sees `device` (a CUDA index below the device count); the error
/// says how many it sees.
pub fn check_device(device: tch::Device) -> Result<(), MissingDevice> {
    if let tch::Device::Cuda(index) = device {
        let count = tch::Cuda::device_count();
        if index as i64 >= count {
            return Err(MissingDevice { index, count });
        }
    }
    Ok(())
}
pub use tokenizer::{ChatTokenizer, ENDOFTEXT, IM_END, IM_START};

/// Hex SHA-256 of a file (e.g. a weights file, to identify a policy version).
pub fn weights_sha256(path: &Path) -> Result<String, PolicyError> {
    let mut file = std::fs::File::open(path).map_err(|e| PolicyError::io(path, e))?;
    let mut hasher = Sha256::new();
    // Streamed: weight files can be many gigabytes.
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| PolicyError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_can_move_between_threads() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<Policy>();
        send_sync::<ChatTokenizer>();
        send_sync::<ModelConfig>();
        send_sync::<PolicyError>();
    }

    #[test]
    fn sha256_of_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(
            weights_sha256(&path).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let err = weights_sha256(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
    }
}
