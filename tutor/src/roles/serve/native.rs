//! The engine control plane of `tutor serve`, in SGLang's native shape, so that rollout
//! workers drive it as they drive SGLang (`[worker.student] kind = "engine"`):
//!
//! - `POST /generate`: token ids in, sampled token ids and their log-probabilities out,
//!   nothing re-tokenized; every answer names the weight version that produced it
//!   (`meta_info.weight_version`).
//! - `POST /update_weights_from_disk`: load a checkpoint (a Hugging Face directory or one
//!   safetensors file) and serve it under `weight_version`. Requests queued before it finish
//!   under the old weights; later ones wait for the swap. A checkpoint that does not fit
//!   the model is refused and the old weights stay. Only with `--weights-root`, and only
//!   checkpoints inside it.
//! - `GET /model_info` (SGLang's newer name), `GET /get_model_info`, `GET /get_weight_version`.
//!
//! The weight version a `/generate` answer reports is the one its request was queued
//! under: submitting holds the version's read lock, a reload holds its write lock while it
//! queues the swap, and the engine runs requests and swaps in queue order.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tutor_policy::{
    EngineHandle, EngineRequest, FinishReason, GenParams, LoadError, PolicyError, RequestError,
};

use super::openai::{AppState, Weights};

/// The control plane's routes, for [`super::openai::router`] to put behind the API key.
pub(super) fn routes() -> axum::Router<Arc<AppState>> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/generate", post(generate))
        .route("/update_weights_from_disk", post(update_weights_from_disk))
        .route("/get_weight_version", get(get_weight_version))
        .route("/model_info", get(get_model_info))
        .route("/get_model_info", get(get_model_info))
}

/// An error as SGLang answers one: `{"error": {"message", "code"}}` with the status.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    (
        status,
        Json(json!({"error": {"message": message, "code": status.as_u16()}})),
    )
        .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateRequest {
    input_ids: Vec<u32>,
    #[serde(default)]
    sampling_params: SamplingParams,
    #[serde(default)]
    return_logprob: bool,
    #[serde(default)]
    stream: bool,
    /// Accepted as SGLang accepts them; only the default (-1: logprobs of the output) is
    /// served.
    logprob_start_len: Option<i64>,
    rid: Option<String>,
}

/// The sampling parameters `/generate` serves. Truncating ones (`top_k`, `min_p`) are
/// accepted only at their "off" values: the log-probabilities returned are those of the
/// distribution sampled from, which training needs unbiased.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct SamplingParams {
    temperature: f32,
    top_p: f32,
    top_k: i64,
    min_p: f32,
    max_new_tokens: usize,
    stop_token_ids: Vec<u32>,
    skip_special_tokens: bool,
    /// Accepted as SGLang takes it: here the stop token always stays in `output_ids`, and
    /// `text` is the decoded `output_ids`.
    #[allow(dead_code)]
    no_stop_trim: bool,
    ignore_eos: bool,
    sampling_seed: Option<u64>,
    repetition_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
    min_new_tokens: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            max_new_tokens: 128,
            stop_token_ids: Vec::new(),
            skip_special_tokens: true,
            no_stop_trim: false,
            ignore_eos: false,
            sampling_seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            min_new_tokens: 0,
        }
    }
}

async fn generate(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: GenerateRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        }
    };
    let p = &req.sampling_params;
    if req.stream {
        return error(
            StatusCode::BAD_REQUEST,
            "stream: /generate does not stream here",
        );
    }
    if req.logprob_start_len.is_some_and(|n| n != -1) {
        return error(
            StatusCode::BAD_REQUEST,
            "logprob_start_len: only -1 (log-probabilities of the output) is served",
        );
    }
    let vocab = s.engine.vocab() as i64;
    if !(p.top_k == -1 || p.top_k == 0 || p.top_k >= vocab)
        || p.min_p != 0.0
        || p.repetition_penalty != 1.0
        || p.frequency_penalty != 0.0
        || p.presence_penalty != 0.0
        || p.min_new_tokens != 0
    {
        return error(
            StatusCode::BAD_REQUEST,
            "sampling_params: top_k, min_p, penalties and min_new_tokens are served at their \
             neutral values only (the log-probabilities returned are those of the distribution \
             sampled from)",
        );
    }
    if !(0.0..=2.0).contains(&p.temperature) {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "sampling_params.temperature {} is outside [0, 2]",
                p.temperature
            ),
        );
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("sampling_params.top_p {} is outside (0, 1]", p.top_p),
        );
    }
    let mut stops = p.stop_token_ids.clone();
    if !p.ignore_eos {
        stops.extend(s.tokenizer.stop_ids());
    }
    stops.sort_unstable();
    stops.dedup();
    let params = GenParams {
        temperature: p.temperature,
        top_p: p.top_p,
        max_new_tokens: p.max_new_tokens,
        seed: p.sampling_seed.unwrap_or_else(rand::random::<u64>),
        stop_token_ids: stops,
    };
    let prompt_tokens = req.input_ids.len();
    let (tx, rx) = mpsc::unbounded_channel();
    let request = EngineRequest {
        prompt: req.input_ids,
        params,
        stop: vec![],
        top_logprobs: 0,
        prompt_logprobs: false,
        text: false,
        events: tx,
    };
    // Queued under the version's read lock: a reload queues its swap under the write
    // lock, so this request runs on the weights of the version it reports.
    let version = {
        let weights = s.weights.read().await;
        // `submit` checks the request first (prompt, vocabulary, context): those are 400s.
        if let Err(e) = s.engine.submit(request).await {
            let status = match e {
                RequestError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::BAD_REQUEST,
            };
            return error(status, e.to_string());
        }
        weights.version.clone()
    };
    let done = match EngineHandle::collect(rx).await {
        Ok(d) => d,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let ids: Vec<u32> = done.tokens.iter().map(|t| t.id).collect();
    let finish = match done.done.finish {
        FinishReason::Stop => json!({"type": "stop", "matched": ids.last()}),
        FinishReason::Length => json!({"type": "length", "length": ids.len()}),
    };
    let mut meta = json!({
        "id": req.rid.unwrap_or_else(|| format!("{:032x}", rand::random::<u128>())),
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": ids.len(),
        "cached_tokens": 0,
        "weight_version": version,
    });
    if req.return_logprob {
        // [logprob, token id, text]: SGLang's shape (text only with return_text_in_logprobs).
        meta["output_token_logprobs"] = done
            .tokens
            .iter()
            .map(|t| json!([t.logprob, t.id, Value::Null]))
            .collect();
    }
    let text = if p.skip_special_tokens {
        s.tokenizer.decode(&ids)
    } else {
        s.tokenizer.render_text(&ids)
    };
    Json(json!({"text": text, "output_ids": ids, "meta_info": meta})).into_response()
}

#[derive(Deserialize)]
struct UpdateFromDisk {
    model_path: String,
    weight_version: Option<String>,
}

/// Loads `model_path` and serves it as `weight_version`: SGLang's answer shape
/// (`success`, `message`), 400 with the old weights kept when it does not load. Only
/// checkpoints inside `--weights-root` may be loaded; without it reloads are refused.
///
/// The load runs in a task of its own that holds the version's write lock until the swap
/// is done and the version set: a client that goes away mid-reload cannot leave new
/// weights served under the old version's name. A reload that names no version gets a
/// new one (`reload-N`), never the old name.
async fn update_weights_from_disk(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: UpdateFromDisk = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        }
    };
    let Some(root) = s.weights_root.clone() else {
        return error(
            StatusCode::FORBIDDEN,
            "weight reloads are off: start tutor serve with --weights-root DIR, the directory \
             whose checkpoints clients may load",
        );
    };
    // Canonical, so that neither `..` nor a symbolic link leads out of the root. The same
    // answer whether the path is missing or outside: nothing to learn about other paths.
    let path = match std::fs::canonicalize(&req.model_path) {
        Ok(p) if p.starts_with(&root) && p != root => p,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "model_path {:?} is not a checkpoint inside --weights-root {}",
                    req.model_path,
                    root.display()
                ),
            )
        }
    };
    let n = s.reloads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    let label = req.weight_version.unwrap_or_else(|| format!("reload-{n}"));
    let state = s.clone();
    let model_path = req.model_path.clone();
    let task = tokio::spawn(async move {
        let mut w = state.weights.clone().write_owned().await;
        let t = std::time::Instant::now();
        let result = state.engine.load_weights(&path).await;
        match &result {
            Ok(()) => {
                tracing::info!(
                    version = %label,
                    path = %model_path,
                    seconds = t.elapsed().as_secs_f64(),
                    "loaded weights from disk"
                );
                w.version = label;
                w.path = model_path;
            }
            // Checked tensors are copied one by one: a copy that fails leaves a mix.
            Err(LoadError::Weights {
                error: PolicyError::Torch { .. },
                ..
            }) => {
                w.version = format!("{}+failed-reload-{n}", w.version);
                tracing::error!(path = %model_path, version = %w.version, "a reload failed while copying tensors: the weights are a mix, served as a version of their own");
            }
            Err(e) => {
                tracing::warn!(path = %model_path, error = %e, "refused weights: the old ones stay")
            }
        }
        *state.served.lock().expect("served") = Weights {
            version: w.version.clone(),
            path: w.path.clone(),
        };
        (result, w.version.clone())
    });
    let (result, version) = match task.await {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the reload failed: {e}"),
            )
        }
    };
    match result {
        Ok(()) => Json(json!({
            "success": true,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }))
        .into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            Json(json!({
                "success": false,
                "message": format!("Failed to update weights: {e}; serving weight version {version:?}"),
                "num_paused_requests": 0,
            })),
        )
            .into_response(),
    }
}

async fn get_weight_version(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"weight_version": s.served.lock().expect("served").version}))
}

/// SGLang's `/model_info` (and its older `/get_model_info`): read without waiting for a
/// reload in progress.
async fn get_model_info(State(s): State<Arc<AppState>>) -> Json<Value> {
    let w = s.served.lock().expect("served");
    Json(json!({
        "model_path": w.path,
        "tokenizer_path": w.path,
        "is_generation": true,
        "preferred_sampling_params": Value::Null,
        "weight_version": w.version,
        "served_model_name": s.model,
        "max_model_len": s.engine.context(),
        "vocab_size": s.engine.vocab(),
    }))
}
