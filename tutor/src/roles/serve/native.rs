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
//! - `POST /init_weights_update_group`, `POST /update_weights_from_distributed`, `POST
//!   /destroy_weights_update_group` (with `--distributed-updates`): weights sent by the
//!   client over Tutor's CPU collective (backend "tutor-cpu", `tutor_collective::
//!   engine_update`), loaded from memory as a file's would be, under `weight_version`.
//! - `GET /model_info` (SGLang's newer name), `GET /get_model_info`, `GET /get_weight_version`.
//!
//! The weight version a `/generate` answer reports is the one its request was queued
//! under: submitting holds the version's read lock, a reload holds its write lock while it
//! queues the swap, and the engine runs requests and swaps in queue order. While a client
//! of vLLM's control plane has paused the server (`vllm.rs`), `/generate` waits too.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tutor_collective::{engine_update, CollectiveSecret, CpuCollective, CpuCollectiveTimeouts};
use tutor_policy::{
    EngineHandle, EngineRequest, FinishReason, LoadError, PolicyError, RequestError, WeightsSource,
};

use super::state::{sampling, unpaused, AppState, Neutral, Weights};

/// The control plane's routes, for [`super::openai::router`] to put behind the API key.
pub(super) fn routes() -> axum::Router<Arc<AppState>> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/generate", post(generate))
        .route("/update_weights_from_disk", post(update_weights_from_disk))
        .route(
            "/init_weights_update_group",
            post(init_weights_update_group),
        )
        .route(
            "/update_weights_from_distributed",
            post(update_weights_from_distributed),
        )
        .route(
            "/destroy_weights_update_group",
            post(destroy_weights_update_group),
        )
        .route("/get_weight_version", get(get_weight_version))
        .route("/model_info", get(get_model_info))
        .route("/get_model_info", get(get_model_info))
}

/// An error as SGLang answers one: `{"error": {"message", "code"}}` with the status.
pub(super) fn error(status: StatusCode, message: impl Into<String>) -> Response {
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
    let neutral = Neutral {
        top_k: p.top_k,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        min_new_tokens: p.min_new_tokens,
    };
    let params = match sampling(
        &s,
        "sampling_params.",
        neutral,
        p.temperature,
        p.top_p,
        p.max_new_tokens,
        p.sampling_seed,
        &p.stop_token_ids,
        p.ignore_eos,
    ) {
        Ok(params) => params,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
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
    unpaused(&s).await;
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
/// checkpoints inside `--weights-root` may be loaded; without it reloads are refused. A
/// reload that names no version gets a new one (`reload-N`), never the old name.
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
    let path = match checkpoint_in_root(&s, "model_path", &req.model_path) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let n = s.reloads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    let label = req.weight_version.unwrap_or_else(|| format!("reload-{n}"));
    swap(
        &s,
        WeightsSource::Path(path),
        label,
        req.model_path.clone(),
        n,
    )
    .await
}

/// The checkpoint at `path` (the request's field `field`), if clients may load it: only
/// with `--weights-root`, and only inside it. Canonical, so that neither `..` nor a
/// symbolic link leads out of the root; the same answer whether the path is missing or
/// outside: nothing to learn about other paths.
pub(super) fn checkpoint_in_root(
    s: &AppState,
    field: &str,
    path: &str,
) -> Result<std::path::PathBuf, Box<Response>> {
    let Some(root) = s.weights_root.clone() else {
        return Err(Box::new(error(
            StatusCode::FORBIDDEN,
            "weight reloads are off: start tutor serve with --weights-root DIR, the directory \
             whose checkpoints clients may load",
        )));
    };
    match std::fs::canonicalize(path) {
        Ok(p) if p.starts_with(&root) && p != root => Ok(p),
        _ => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            format!(
                "{field} {path:?} is not a checkpoint inside --weights-root {}",
                root.display()
            ),
        ))),
    }
}

/// Swaps `source` in as weight version `label` (`origin` says where it came from, for
/// `/model_info` and the logs) and answers as SGLang does (`success`, `message`; 400 with
/// the old weights kept when it does not load).
///
/// The load runs in a task of its own that holds the version's write lock until the swap
/// is done and the version set: a client that goes away mid-reload cannot leave new
/// weights served under the old version's name.
pub(super) async fn swap(
    s: &Arc<AppState>,
    source: WeightsSource,
    label: String,
    origin: String,
    n: u64,
) -> Response {
    let state = s.clone();
    let task = tokio::spawn(async move {
        let mut w = state.weights.clone().write_owned().await;
        let t = std::time::Instant::now();
        let result = state.engine.load(source).await;
        match &result {
            Ok(()) => {
                tracing::info!(
                    version = %label,
                    from = %origin,
                    seconds = t.elapsed().as_secs_f64(),
                    "loaded weights"
                );
                w.version = label;
                w.path = origin;
                state
                    .swaps
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            // Checked tensors are copied one by one: a copy that fails leaves a mix.
            Err(LoadError::Weights {
                error: PolicyError::Torch { .. },
                ..
            }) => {
                w.version = format!("{}+failed-reload-{n}", w.version);
                state
                    .swaps
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tracing::error!(from = %origin, version = %w.version, "a reload failed while copying tensors: the weights are a mix, served as a version of their own");
            }
            Err(e) => {
                tracing::warn!(from = %origin, error = %e, "refused weights: the old ones stay")
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

/// SGLang's failure answer for the weight-update routes: `success: false` and why.
fn failed(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"success": false, "message": message.into()})),
    )
        .into_response()
}

/// The key of a weight-update group's hello: the API key, bound to the group's name
/// (namespaced apart from any group of a run).
fn group_secret(api_key: &str, group: &str) -> CollectiveSecret {
    CollectiveSecret::from_token(
        api_key.as_bytes(),
        &format!("{}{group}", engine_update::SECRET_CONTEXT),
    )
}

fn default_group() -> String {
    "weight_update_group".into()
}

#[derive(Deserialize)]
pub(super) struct InitGroup {
    pub(super) master_address: String,
    pub(super) master_port: u16,
    pub(super) rank_offset: usize,
    pub(super) world_size: usize,
    #[serde(default = "default_group")]
    pub(super) group_name: String,
    #[serde(default)]
    pub(super) backend: Option<String>,
}

/// A weight-update route's request: its body parsed, or the answer refusing it (a body
/// that does not parse; updates over a collective off without `--distributed-updates`).
fn update_request<T: serde::de::DeserializeOwned>(
    s: &AppState,
    body: &[u8],
) -> Result<T, Box<Response>> {
    let req = serde_json::from_slice(body).map_err(|e| {
        Box::new(failed(
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}"),
        ))
    })?;
    if !s.distributed_updates {
        return Err(Box::new(failed(
            StatusCode::FORBIDDEN,
            "weight updates over a collective are off: start tutor serve with \
             --distributed-updates to take them",
        )));
    }
    Ok(req)
}

/// SGLang's `/init_weights_update_group`: joins the client's group as rank
/// `rank_offset` of `world_size`, connecting to rank 0 at `master_address:master_port`
/// over Tutor's CPU collective (backend "tutor-cpu"; SGLang's "nccl" is not spoken here).
/// With an API key, the group's hello is keyed by it (and the group's name), so only a
/// client holding the key can form a group with this server. Answers once joined.
async fn init_weights_update_group(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: InitGroup = match update_request(&s, &body) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    match join_group(&s, req).await {
        Ok(()) => Json(
            json!({"success": true, "message": "Succeeded to initialize custom process group."}),
        )
        .into_response(),
        Err(refused) => *refused,
    }
}

/// Joins the client's group `req` names and keeps it among the update groups; the
/// answer refusing it otherwise (a backend other than Tutor's CPU collective, ranks that
/// do not make this engine one rank after rank 0, a group of that name, too many groups,
/// no rank 0 to join).
pub(super) async fn join_group(s: &AppState, req: InitGroup) -> Result<(), Box<Response>> {
    let refuse = |status, message: String| Err(Box::new(failed(status, message)));
    let backend = req.backend.as_deref().unwrap_or("nccl");
    if backend != engine_update::BACKEND {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "backend {backend:?} is not served: this engine's data plane is Tutor's CPU \
                 collective (backend {:?}); load weights from disk otherwise",
                engine_update::BACKEND
            ),
        );
    }
    if req.world_size < 2 || req.rank_offset == 0 || req.rank_offset >= req.world_size {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "rank_offset {} of world_size {}: this engine is one rank, 1..world_size \
                 (rank 0 sends)",
                req.rank_offset, req.world_size
            ),
        );
    }
    {
        let mut groups = s.update_groups.lock().await;
        if groups.contains(&req.group_name) {
            return refuse(
                StatusCode::CONFLICT,
                format!("group {:?} exists: destroy it first", req.group_name),
            );
        }
        if let Err(why) = groups.make_room() {
            return refuse(StatusCode::TOO_MANY_REQUESTS, why);
        }
    }
    let secret = s.api_key.as_ref().map(|k| group_secret(k, &req.group_name));
    // An IPv6 literal needs brackets to be joined with its port.
    let addr = match req.master_address.parse::<std::net::IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, req.master_port).to_string(),
        Err(_) => format!("{}:{}", req.master_address, req.master_port),
    };
    let master = addr.clone();
    let (rank, world) = (req.rank_offset, req.world_size);
    let joined = tokio::task::spawn_blocking(move || {
        CpuCollective::connect_with_secret(
            addr.as_str(),
            rank,
            world,
            CpuCollectiveTimeouts {
                connect: std::time::Duration::from_secs(60),
                io: std::time::Duration::from_secs(300),
            },
            secret.as_ref(),
        )
    })
    .await;
    let collective = match joined {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("could not join group {:?}: {e}", req.group_name),
            )
        }
        Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let mut groups = s.update_groups.lock().await;
    if groups.contains(&req.group_name) {
        return refuse(
            StatusCode::CONFLICT,
            format!("group {:?} was formed meanwhile", req.group_name),
        );
    }
    if let Err(why) = groups.make_room() {
        return refuse(StatusCode::TOO_MANY_REQUESTS, why);
    }
    tracing::info!(group = %req.group_name, %master, "joined a weight-update group");
    groups.insert(req.group_name, collective);
    Ok(())
}

#[derive(Deserialize)]
struct UpdateDistributed {
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<usize>>,
    #[serde(default = "default_group")]
    group_name: String,
    weight_version: Option<String>,
}

/// SGLang's `/update_weights_from_distributed`: receives the announced tensors from rank
/// 0 of the group, in order, and serves them as `weight_version`. Before a byte is
/// received, the announcement is checked (names, dtypes, sizes up to what this model can
/// take); the tensors are then checked against the model as a file's would be, and a set
/// that does not fit is refused with the old weights kept. A group whose update failed
/// midway is closed (rank 0 sees its sends fail) and must be formed again.
async fn update_weights_from_distributed(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: UpdateDistributed = match update_request(&s, &body) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let n = s.reloads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    let label = req.weight_version.unwrap_or_else(|| format!("reload-{n}"));
    // One update at a time, from its first byte to its swap.
    let Ok(_permit) = s.update_permit.acquire().await else {
        return failed(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping");
    };
    let source = match receive_update(
        &s,
        &req.group_name,
        req.names,
        req.dtypes,
        req.shapes,
        &label,
    )
    .await
    {
        Ok(source) => source,
        Err(refused) => return *refused,
    };
    let origin = format!("group {}", req.group_name);
    swap(&s, source, label, origin, n).await
}

/// Receives the announced tensors (`names`, `dtypes`, `shapes`) from rank 0 of group
/// `group`, for weight version `label`: the announcement is checked first (one dtype and
/// shape per name, every parameter of the model with its shape), then the bytes (up to
/// what this model can take). Hold `update_permit` around it. A group whose update
/// failed is closed (rank 0's sends fail); the answer refusing it says so.
pub(super) async fn receive_update(
    s: &Arc<AppState>,
    group: &str,
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<usize>>,
    label: &str,
) -> Result<WeightsSource, Box<Response>> {
    // In a task of its own: a client that goes away mid-update does not leave the group
    // marked busy (the task ends, closing or giving it back, however the request ends).
    let (s, group, label) = (s.clone(), group.to_string(), label.to_string());
    tokio::spawn(
        async move { receive_update_task(&s, &group, names, dtypes, shapes, &label).await },
    )
    .await
    .unwrap_or_else(|e| {
        Err(Box::new(failed(
            StatusCode::INTERNAL_SERVER_ERROR,
            e.to_string(),
        )))
    })
}

async fn receive_update_task(
    s: &AppState,
    group: &str,
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<usize>>,
    label: &str,
) -> Result<WeightsSource, Box<Response>> {
    let refuse = |status, message: String| Err(Box::new(failed(status, message)));
    if names.len() != dtypes.len() || names.len() != shapes.len() {
        s.update_groups.lock().await.destroy(group);
        return refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "{} names, {} dtypes and {} shapes: one of each per tensor",
                names.len(),
                dtypes.len(),
                shapes.len()
            ),
        );
    }
    let metas: Vec<engine_update::TensorMeta> = names
        .into_iter()
        .zip(dtypes)
        .zip(shapes)
        .map(|((name, dtype), shape)| engine_update::TensorMeta {
            name,
            dtype: dtype.trim_start_matches("torch.").to_string(),
            shape,
        })
        .collect();
    let Some(mut collective) = s.update_groups.lock().await.take(group) else {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!("no weight-update group {group:?}: form one first"),
        );
    };
    if let Some(why) = announced_mismatch(&s.parameter_shapes, &metas) {
        // Closing the group fails rank 0's sends at once.
        drop(collective);
        s.update_groups.lock().await.lose(group);
        tracing::warn!(
            group,
            version = label,
            "a weight update was refused before receiving: {why}"
        );
        return refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "{why}: refused before receiving anything; the group {group:?} is closed and the \
                 old weights stay"
            ),
        );
    }
    let max = s.max_update_bytes;
    let t = std::time::Instant::now();
    let received = tokio::task::spawn_blocking(move || {
        let r = engine_update::receive(&mut collective, &metas, max);
        (r, collective)
    })
    .await;
    let file = match received {
        Ok((Ok(file), collective)) => {
            s.update_groups.lock().await.give_back(group, collective);
            file
        }
        Ok((Err(e), _closed)) => {
            s.update_groups.lock().await.lose(group);
            tracing::warn!(group, version = label, error = %e, "a weight update failed: the group is closed");
            return refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "Failed to receive the weights over group {group:?}: {e}; the group is \
                     closed and the old weights stay"
                ),
            );
        }
        Err(e) => {
            s.update_groups.lock().await.lose(group);
            return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
    };
    tracing::info!(
        group,
        bytes = file.len(),
        seconds = t.elapsed().as_secs_f64(),
        "received weights over the collective"
    );
    Ok(WeightsSource::Bytes {
        bytes: Arc::new(file),
        name: format!("weights received over group {group:?}"),
    })
}

/// Why announced tensors cannot load into a model with parameters `model` (name →
/// shape), said before a byte of them moves: a parameter announced with another shape,
/// or one not announced at all. Other names may come (a checkpoint may carry buffers the
/// loader skips); their bytes count against the update's limit.
fn announced_mismatch(
    model: &std::collections::HashMap<String, Vec<usize>>,
    metas: &[engine_update::TensorMeta],
) -> Option<String> {
    for m in metas {
        if let Some(want) = model.get(&m.name) {
            if *want != m.shape {
                return Some(format!(
                    "tensor {} is announced with shape {:?}; this model's is {want:?}",
                    m.name, m.shape
                ));
            }
        }
    }
    let announced: std::collections::HashSet<&str> =
        metas.iter().map(|m| m.name.as_str()).collect();
    let mut missing: Vec<&str> = model
        .keys()
        .map(String::as_str)
        .filter(|n| !announced.contains(n))
        .collect();
    missing.sort_unstable();
    missing.first().map(|first| {
        format!(
            "{} of this model's {} parameters are not announced ({first} first)",
            missing.len(),
            model.len()
        )
    })
}

#[derive(Deserialize)]
struct DestroyGroup {
    #[serde(default = "default_group")]
    group_name: String,
}

/// SGLang's `/destroy_weights_update_group`: leaves the group (closes this rank's
/// connection).
async fn destroy_weights_update_group(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: DestroyGroup = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return failed(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        }
    };
    match s.update_groups.lock().await.destroy(&req.group_name) {
        true => {
            Json(json!({"success": true, "message": "Succeeded to destroy custom process group."}))
                .into_response()
        }
        false => failed(
            StatusCode::BAD_REQUEST,
            format!("no weight-update group {:?}", req.group_name),
        ),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, shape: &[usize]) -> engine_update::TensorMeta {
        engine_update::TensorMeta {
            name: name.into(),
            dtype: "float32".into(),
            shape: shape.to_vec(),
        }
    }

    /// An announcement must hold every parameter with the model's shape; extra tensors
    /// may come.
    #[test]
    fn announcements_are_checked_against_the_model() {
        let model: std::collections::HashMap<String, Vec<usize>> = [
            ("a.weight".to_string(), vec![4, 2]),
            ("b.weight".to_string(), vec![3]),
        ]
        .into();
        let all = [meta("a.weight", &[4, 2]), meta("b.weight", &[3])];
        assert_eq!(announced_mismatch(&model, &all), None);
        let extra = [
            meta("b.weight", &[3]),
            meta("buf", &[1]),
            meta("a.weight", &[4, 2]),
        ];
        assert_eq!(announced_mismatch(&model, &extra), None);
        let shape = [meta("a.weight", &[2, 4]), meta("b.weight", &[3])];
        let why = announced_mismatch(&model, &shape).unwrap();
        assert!(why.contains("a.weight") && why.contains("[4, 2]"), "{why}");
        let missing = [meta("a.weight", &[4, 2])];
        let why = announced_mismatch(&model, &missing).unwrap();
        assert!(
            why.contains("1 of this model's 2") && why.contains("b.weight"),
            "{why}"
        );
    }
}
