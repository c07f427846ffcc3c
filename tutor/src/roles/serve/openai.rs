//! The OpenAI-compatible HTTP API of `tutor serve`: routes, the API key check, request
//! parsing (chat messages, stop strings, logprobs), non-streaming and streaming (server-sent
//! events) answers, and errors in OpenAI's shape.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tutor_policy::{
    ChatTokenizer, DoneEvent, EngineEvent, EngineHandle, EngineRequest, FinishReason, GenParams,
    RequestError, TokenEvent,
};

use super::state::{sampling, unpaused, AppState, Neutral};

/// The routes, `more` among them, behind the API key check (all but `/health`).
pub(super) fn router(state: Arc<AppState>, more: Router<Arc<AppState>>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .merge(more)
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "no such route; this server has GET /v1/models, POST /v1/chat/completions, \
                 POST /v1/completions, SGLang's engine control plane (POST /generate, POST \
                 /update_weights_from_disk, POST /init_weights_update_group, POST \
                 /update_weights_from_distributed, POST /destroy_weights_update_group, GET \
                 /model_info, GET /get_model_info, GET /get_weight_version) and vLLM's (GET \
                 /weight_info, POST /pause, POST /resume, GET /is_paused, POST \
                 /init_weight_transfer_engine, POST /start_weight_update, POST \
                 /update_weights, POST /finish_weight_update, GET /get_world_size)",
            )
        })
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        // After the layer: probes need no key.
        .route("/health", get(|| async { "ok" }))
        .with_state(state)
}

/// Lets a request through when the server has no API key or the request carries it as a
/// bearer token (compared in constant time); otherwise 401 in OpenAI's error shape.
async fn require_api_key(
    State(s): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use subtle::ConstantTimeEq;
    let Some(key) = &s.api_key else {
        return next.run(request).await;
    };
    let sent = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match sent {
        Some(sent) if bool::from(sent.as_bytes().ct_eq(key.as_bytes())) => next.run(request).await,
        Some(_) => ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(StatusCode::UNAUTHORIZED, "incorrect API key provided")
        }
        .into_response(),
        None => ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "this server requires an API key: send it as `Authorization: Bearer KEY`",
            )
        }
        .into_response(),
    }
}

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    fn bad(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param),
            ..Self::new(StatusCode::BAD_REQUEST, message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.code,
        }});
        (self.status, Json(body)).into_response()
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Stopped => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the generation engine has stopped",
            ),
            RequestError::Interrupted => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the generation engine dropped the request",
            ),
            RequestError::EmptyPrompt | RequestError::BadToken { .. } => {
                ApiError::bad("messages", e.to_string())
            }
            _ => ApiError::bad("max_tokens", e.to_string()),
        }
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model,
            "object": "model",
            "created": s.created,
            "owned_by": "tutor",
            "max_model_len": s.engine.context(),
        }],
    }))
}

#[derive(Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<Message>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stop: Option<Stop>,
    seed: Option<i64>,
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<u64>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// A validated request, ready for the engine.
struct Prepared {
    prompt: Vec<u32>,
    params: GenParams,
    stop: Vec<String>,
    logprobs: bool,
    top_logprobs: usize,
    stream: bool,
    include_usage: bool,
}

fn prepare(s: &AppState, body: &[u8]) -> Result<Prepared, ApiError> {
    let req: ChatRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("invalid request body: {e}")))?;
    if req.model != s.model {
        return Err(ApiError {
            code: Some("model_not_found"),
            ..ApiError {
                status: StatusCode::NOT_FOUND,
                ..ApiError::bad(
                    "model",
                    format!(
                        "the model `{}` does not exist; this server serves `{}`",
                        req.model, s.model
                    ),
                )
            }
        });
    }
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut turns: Vec<(&str, String)> = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::bad(
                    "messages",
                    format!("messages[{i}].role is {other:?}; expected system, user or assistant"),
                ))
            }
        };
        let text = match &m.content {
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::bad(
                                "messages",
                                format!(
                                    "messages[{i}].content[{j}] is of type {:?}; only text parts are supported",
                                    p.kind
                                ),
                            ))
                        }
                    }
                }
                text
            }
            None => {
                return Err(ApiError::bad(
                    "messages",
                    format!("messages[{i}] has no content"),
                ))
            }
        };
        turns.push((role, text));
    }
    if req.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad("n", "only n = 1 is supported"));
    }
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("temperature {temperature} is outside [0, 2]"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("top_p {top_p} is outside (0, 1]"),
        ));
    }
    let stop = match req.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad(
            "stop",
            "stop takes at most 4 non-empty strings",
        ));
    }
    let logprobs = req.logprobs.unwrap_or(false);
    let top_logprobs = req.top_logprobs.unwrap_or(0);
    if top_logprobs > 20 {
        return Err(ApiError::bad(
            "top_logprobs",
            format!("top_logprobs {top_logprobs} is above 20"),
        ));
    }
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::bad(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let prompt = s
        .tokenizer
        .render_chat(turns.iter().map(|(r, t)| (*r, t.as_str())))
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    let limit = s.engine.max_request_tokens();
    let max_new = match req.max_completion_tokens.or(req.max_tokens) {
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => {
            if prompt.len() >= limit {
                return Err(ApiError::bad(
                    "messages",
                    format!(
                        "the messages are {} tokens, which leaves no room to generate within {limit} tokens (the model's context, or --max-cached-tokens)",
                        prompt.len()
                    ),
                ));
            }
            limit - prompt.len()
        }
    };
    let params = GenParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        max_new_tokens: max_new,
        seed: req.seed.map_or_else(rand::random::<u64>, |s| s as u64),
        stop_token_ids: s.tokenizer.stop_ids().to_vec(),
    };
    s.engine.check(&prompt, max_new)?;
    Ok(Prepared {
        prompt,
        params,
        stop,
        logprobs,
        top_logprobs: if logprobs { top_logprobs as usize } else { 0 },
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    })
}

/// OpenAI's `usage` object of a finished request.
fn usage(d: &DoneEvent) -> Value {
    json!({
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
    })
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// JSON has no -inf; OpenAI reports impossible alternatives as -9999.
fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

fn token_entry(tok: &ChatTokenizer, id: u32, logprob: f32) -> Value {
    let text = tok.token_text(id);
    json!({"token": text, "logprob": finite(logprob), "bytes": text.as_bytes()})
}

/// One element of `logprobs.content`: the sampled token and its alternatives.
fn logprob_content(tok: &ChatTokenizer, t: &TokenEvent) -> Value {
    let mut entry = token_entry(tok, t.id, t.logprob);
    entry["top_logprobs"] = Value::Array(
        t.top
            .iter()
            .map(|&(id, lp)| token_entry(tok, id, lp))
            .collect(),
    );
    entry
}

async fn chat_completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    match run_chat(s, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run_chat(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let p = prepare(&s, body)?;
    unpaused(&s).await;
    // Used once, by whichever of the two paths below runs: the prompt is moved, not copied.
    let request = move |events| EngineRequest {
        prompt: p.prompt,
        params: p.params,
        stop: p.stop,
        top_logprobs: p.top_logprobs,
        prompt_logprobs: false,
        text: true,
        events,
    };
    let id = format!(
        "chatcmpl-{:x}{:04x}",
        now(),
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let created = now();
    if p.stream {
        let (tx, rx) = mpsc::unbounded_channel();
        s.engine.submit(request(tx)).await?;
        return Ok(stream_response(
            s,
            rx,
            id,
            created,
            p.logprobs,
            p.include_usage,
        ));
    }
    let done = s.engine.generate(request).await?;
    let logprobs = if p.logprobs {
        json!({"content": done.tokens.iter().map(|t| logprob_content(&s.tokenizer, t)).collect::<Vec<_>>()})
    } else {
        Value::Null
    };
    let d = done.done;
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": s.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": done.text},
            "logprobs": logprobs,
            "finish_reason": finish_reason(d.finish),
        }],
        "usage": usage(&d),
    }))
    .into_response())
}

#[derive(Deserialize)]
struct CompletionRequest {
    /// Optional, as vLLM takes it; when given, this server's model.
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    /// The sampling seed (0 when none is given).
    seed: Option<i64>,
    /// vLLM's extension: the log-probability of every prompt token (the first has none),
    /// as `choices[0].prompt_logprobs`, each entry `{token_id: {logprob, decoded_token}}`.
    prompt_logprobs: Option<u64>,
    stream: Option<bool>,
    /// The sampled tokens' log-probabilities and up to this many alternatives each
    /// (`choices[0].logprobs`; at most 20).
    logprobs: Option<u64>,
    /// vLLM's token-in/token-out fields: the sampled ids (`choices[0].token_ids`) and the
    /// prompt's (`prompt_token_ids`); tokens named `"token_id:N"` in `logprobs.tokens`.
    #[serde(default)]
    return_token_ids: bool,
    #[serde(default)]
    return_tokens_as_token_ids: bool,
    /// Stop ids besides the tokenizer's (which `ignore_eos` leaves out).
    #[serde(default)]
    stop_token_ids: Vec<u32>,
    #[serde(default)]
    ignore_eos: bool,
    /// Accepted as vLLM takes them: the stop token always stays in `token_ids`.
    #[allow(dead_code)]
    include_stop_str_in_output: Option<bool>,
    #[allow(dead_code)]
    skip_special_tokens: Option<bool>,
    /// Served at their neutral values only (the log-probabilities returned are those of
    /// the distribution sampled from).
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    min_tokens: Option<usize>,
    n: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    match run_completion(s, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The legacy completions API over the same engine, without streaming: a prompt as text
/// or as token ids; with `prompt_logprobs` the model's log-probability of each prompt
/// token (how a teacher scores a student's tokens for on-policy distillation); with
/// vLLM's `logprobs`, `return_token_ids` and `return_tokens_as_token_ids`, the sampled
/// ids and their log-probabilities (how a worker's turn runs on this server as on vLLM,
/// `[worker.student] api = "vllm"`). Queued under the weight version's read lock, after
/// any pause, as `/generate` is.
async fn run_completion(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("invalid request body: {e}")))?;
    if let Some(model) = req.model.as_ref().filter(|m| **m != s.model) {
        return Err(ApiError {
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the model {model:?} does not exist; this server serves {:?}",
                    s.model
                ),
            )
        });
    }
    if req.stream == Some(true) {
        return Err(ApiError::bad(
            "stream",
            "/v1/completions does not stream here; use /v1/chat/completions",
        ));
    }
    if req.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad("n", "only n = 1 is supported"));
    }
    let top_logprobs = req.logprobs.unwrap_or(0);
    if top_logprobs > 20 {
        return Err(ApiError::bad(
            "logprobs",
            format!("logprobs {top_logprobs} is above 20"),
        ));
    }
    let prompt = match req.prompt {
        Prompt::Text(t) => s.tokenizer.encode(&t),
        Prompt::Ids(ids) => ids,
    };
    let neutral = Neutral {
        top_k: req.top_k.unwrap_or(-1),
        min_p: req.min_p.unwrap_or(0.0),
        repetition_penalty: req.repetition_penalty.unwrap_or(1.0),
        frequency_penalty: req.frequency_penalty.unwrap_or(0.0),
        presence_penalty: req.presence_penalty.unwrap_or(0.0),
        min_new_tokens: req.min_tokens.unwrap_or(0),
    };
    let params = sampling(
        &s,
        "",
        neutral,
        req.temperature.unwrap_or(1.0) as f32,
        req.top_p.unwrap_or(1.0) as f32,
        req.max_tokens.unwrap_or(16) as usize,
        Some(req.seed.unwrap_or(0) as u64),
        &req.stop_token_ids,
        req.ignore_eos,
    )
    .map_err(|why| ApiError::bad("body", why))?;
    let stops = params.stop_token_ids.clone();
    s.engine.check(&prompt, params.max_new_tokens)?;
    let want_prompt = req.prompt_logprobs.is_some();
    unpaused(&s).await;
    let (tx, rx) = mpsc::unbounded_channel();
    {
        // A reload queues its swap under the write lock: this request runs on the weights
        // `/weight_info` reports until the next swap.
        let _version = s.weights.read().await;
        s.engine
            .submit(EngineRequest {
                prompt: prompt.clone(),
                params,
                stop: vec![],
                top_logprobs: top_logprobs as usize,
                prompt_logprobs: want_prompt,
                text: true,
                events: tx,
            })
            .await?;
    }
    let done = EngineHandle::collect(rx).await?;
    let id = format!(
        "cmpl-{:x}{:04x}",
        now(),
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let scored = match done.prompt_logprobs {
        Some(lps) => {
            let mut entries = vec![Value::Null];
            for (id, lp) in prompt.iter().skip(1).zip(lps) {
                let mut one = serde_json::Map::new();
                one.insert(
                    id.to_string(),
                    json!({"logprob": finite(lp), "decoded_token": s.tokenizer.token_text(*id)}),
                );
                entries.push(Value::Object(one));
            }
            Value::Array(entries)
        }
        None => Value::Null,
    };
    let ids: Vec<u32> = done.tokens.iter().map(|t| t.id).collect();
    let name = |id: u32| {
        if req.return_tokens_as_token_ids {
            format!("token_id:{id}")
        } else {
            s.tokenizer.token_text(id)
        }
    };
    let logprobs = if req.logprobs.is_some() {
        json!({
            "text_offset": Vec::<u64>::new(),
            "token_logprobs": done.tokens.iter().map(|t| finite(t.logprob)).collect::<Vec<_>>(),
            "tokens": ids.iter().map(|&id| name(id)).collect::<Vec<_>>(),
            "top_logprobs": done.tokens.iter().map(|t| {
                let mut top = serde_json::Map::new();
                top.insert(name(t.id), json!(finite(t.logprob)));
                for &(id, lp) in &t.top {
                    top.insert(name(id), json!(finite(lp)));
                }
                Value::Object(top)
            }).collect::<Vec<_>>(),
        })
    } else {
        Value::Null
    };
    let d = done.done;
    let stop_reason = match (d.finish, ids.last()) {
        (FinishReason::Stop, Some(last)) if stops.contains(last) => json!(last),
        _ => Value::Null,
    };
    let (token_ids, prompt_token_ids) = if req.return_token_ids {
        (json!(ids), json!(prompt))
    } else {
        (Value::Null, Value::Null)
    };
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": now(),
        "model": s.model,
        "choices": [{
            "index": 0,
            "text": done.text,
            "logprobs": logprobs,
            "prompt_logprobs": scored,
            "finish_reason": finish_reason(d.finish),
            "stop_reason": stop_reason,
            "token_ids": token_ids,
            "prompt_token_ids": prompt_token_ids,
        }],
        "usage": usage(&d),
    }))
    .into_response())
}

/// Server-sent events: a role chunk, one chunk per token (text and logprobs), a final
/// chunk with the finish reason, optionally a usage chunk, then `data: [DONE]`.
fn stream_response(
    s: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<EngineEvent>,
    id: String,
    created: u64,
    logprobs: bool,
    include_usage: bool,
) -> Response {
    let (out, events) = mpsc::channel::<Result<Event, Infallible>>(16);
    tokio::spawn(async move {
        let chunk = |delta: Value, lp: Value, finish: Value| {
            let mut c = json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": s.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            });
            if include_usage {
                c["usage"] = Value::Null;
            }
            Event::default().data(c.to_string())
        };
        // A failed send means the client went away: returning drops `rx`, which cancels
        // the request in the engine.
        if out
            .send(Ok(chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                Value::Null,
            )))
            .await
            .is_err()
        {
            return;
        }
        while let Some(event) = rx.recv().await {
            match event {
                EngineEvent::Prompt(_) => {}
                EngineEvent::Token(t) => {
                    if t.text.is_empty() && !logprobs {
                        continue;
                    }
                    let lp = if logprobs {
                        json!({"content": [logprob_content(&s.tokenizer, &t)]})
                    } else {
                        Value::Null
                    };
                    if out
                        .send(Ok(chunk(json!({"content": t.text}), lp, Value::Null)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                EngineEvent::Done(d) => {
                    if !d.text.is_empty() {
                        let _ = out
                            .send(Ok(chunk(
                                json!({"content": d.text}),
                                Value::Null,
                                Value::Null,
                            )))
                            .await;
                    }
                    let _ = out
                        .send(Ok(chunk(
                            json!({}),
                            Value::Null,
                            json!(finish_reason(d.finish)),
                        )))
                        .await;
                    if include_usage {
                        let usage = json!({
                            "id": id,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": s.model,
                            "choices": [],
                            "usage": usage(&d),
                        });
                        let _ = out.send(Ok(Event::default().data(usage.to_string()))).await;
                    }
                    let _ = out.send(Ok(Event::default().data("[DONE]"))).await;
                    return;
                }
            }
        }
    });
    Sse::new(ReceiverStream::new(events))
        .keep_alive(KeepAlive::default())
        .into_response()
}
