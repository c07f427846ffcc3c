//! A teacher (or an evaluated agent) behind any OpenAI-compatible chat-completions
//! endpoint: vLLM, SGLang, `tutor serve`, hosted APIs. The conversation it sees is the
//! student's: the system prompt, the issue, then each executed reply and its observation.
//!
//! Requests carry a deadline, are retried with exponential backoff on 429, 5xx, timeouts
//! and connection errors (honouring `Retry-After`), and are limited per worker by a
//! semaphore. The API key comes from an environment variable or a file and is never
//! logged: it lives in a [`Secret`] whose `Debug` prints `***`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;

use crate::teacher::{Teacher, TeacherError, TeacherReply, TeacherState};

/// `[worker.teacher]`: which teacher labels states.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherConfig {
    /// `oracle` (reads the task's gold patch) or `endpoint` (a model behind an
    /// OpenAI-compatible chat-completions API).
    pub kind: TeacherKind,
    /// Endpoint base URL, up to and including `/v1`, e.g. `http://vllm:8000/v1`.
    pub base_url: String,
    /// Model name sent with every request.
    pub model: String,
    /// Environment variable holding the API key (checked first).
    pub api_key_env: String,
    /// File holding the API key (used when the variable is unset or empty).
    pub api_key_file: Option<PathBuf>,
    /// Deadline of one request, seconds.
    pub timeout_s: f64,
    /// Retries after the first attempt on 429, 5xx, timeouts and connection errors.
    pub max_retries: u32,
    /// Requests in flight at once from one worker.
    pub concurrency: u32,
    pub temperature: f64,
    pub top_p: f64,
    pub max_tokens: u32,
    /// Ask for the log-probability of each generated token (kept with the turn).
    pub logprobs: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TeacherKind {
    #[default]
    Oracle,
    Endpoint,
}

impl Default for TeacherConfig {
    fn default() -> Self {
        Self {
            kind: TeacherKind::Oracle,
            base_url: String::new(),
            model: String::new(),
            api_key_env: "TUTOR_TEACHER_API_KEY".into(),
            api_key_file: None,
            timeout_s: 120.0,
            max_retries: 4,
            concurrency: 8,
            temperature: 0.0,
            top_p: 1.0,
            max_tokens: 2048,
            logprobs: false,
        }
    }
}

/// A string that never shows in logs.
#[derive(Clone, Default)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "(none)" } else { "***" })
    }
}

/// The shared client of one worker: connection pool, concurrency limit, settings.
#[derive(Debug)]
pub struct ChatEndpoint {
    http: reqwest::Client,
    url: String,
    key: Secret,
    config: TeacherConfig,
    slots: Arc<Semaphore>,
}

/// Backoff before retry `attempt` (0-based): 0.5 s doubling, at most 8 s.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((500u64 << attempt.min(4)).min(8_000))
}

/// Why [`ChatEndpoint::new`] refused the settings; each names the field to fix.
#[derive(Debug, thiserror::Error)]
pub enum EndpointConfigError {
    #[error("worker.teacher.base_url is empty (e.g. http://127.0.0.1:8000/v1)")]
    NoBaseUrl,
    #[error("worker.teacher.base_url = {0:?}: must start with http:// or https://")]
    BadScheme(String),
    #[error("worker.teacher.model is empty: name the served model")]
    NoModel,
    #[error("worker.teacher.timeout_s must be positive")]
    BadTimeout,
    #[error("worker.teacher.api_key_file = {}: {source}", .path.display())]
    KeyFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("building the HTTP client: {0}")]
    Http(#[source] reqwest::Error),
}

impl ChatEndpoint {
    /// Checks the settings and reads the key. Errors name the field.
    pub fn new(config: &TeacherConfig) -> Result<Self, EndpointConfigError> {
        let base = config.base_url.trim().trim_end_matches('/');
        if base.is_empty() {
            return Err(EndpointConfigError::NoBaseUrl);
        }
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(EndpointConfigError::BadScheme(base.to_string()));
        }
        if config.model.trim().is_empty() {
            return Err(EndpointConfigError::NoModel);
        }
        if config.timeout_s.is_nan() || config.timeout_s <= 0.0 {
            return Err(EndpointConfigError::BadTimeout);
        }
        let mut key = std::env::var(&config.api_key_env).unwrap_or_default();
        if key.trim().is_empty() {
            if let Some(p) = &config.api_key_file {
                key =
                    std::fs::read_to_string(p).map_err(|source| EndpointConfigError::KeyFile {
                        path: p.clone(),
                        source,
                    })?;
            }
        }
        // rustls needs a process-wide crypto provider; a second install is a no-op error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(config.timeout_s))
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(EndpointConfigError::Http)?;
        Ok(Self {
            http,
            url: format!("{base}/chat/completions"),
            key: Secret(key.trim().to_string()),
            config: config.clone(),
            slots: Arc::new(Semaphore::new(config.concurrency.max(1) as usize)),
        })
    }

    /// One chat completion, retried as described in the module docs.
    pub async fn complete(
        &self,
        messages: &[Value],
        seed: Option<u64>,
    ) -> Result<TeacherReply, TeacherError> {
        let c = &self.config;
        let mut body = json!({
            "model": c.model,
            "messages": messages,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "max_tokens": c.max_tokens,
        });
        if c.logprobs {
            body["logprobs"] = json!(true);
        }
        if let Some(s) = seed {
            body["seed"] = json!(s);
        }
        let text = self.post(&self.url, &body).await?;
        parse_completion(&text).map_err(|e| TeacherError(format!("{} answered: {e}", self.url)))
    }

    /// The teacher's log-probability of each token of `continuation` after `prefix`
    /// (token ids of the student's tokenizer, which the teacher must share): one
    /// `/completions` request with vLLM's `prompt_logprobs`, retried as `complete` is.
    pub async fn score(
        &self,
        prefix: &[u32],
        continuation: &[u32],
    ) -> Result<Vec<f32>, TeacherError> {
        if continuation.is_empty() {
            return Ok(Vec::new());
        }
        let url = self.url.replace("/chat/completions", "/completions");
        let prompt: Vec<u32> = prefix.iter().chain(continuation).copied().collect();
        let body = json!({
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        });
        let text = self.post(&url, &body).await?;
        parse_prompt_logprobs(&text, &prompt, continuation.len())
            .map_err(|e| TeacherError(format!("{url} answered: {e}")))
    }

    /// POSTs `body` to `url` under the concurrency limit, retrying 429, 5xx, timeouts
    /// and connection errors with backoff (honouring Retry-After); the answer's text.
    async fn post(&self, url: &str, body: &Value) -> Result<String, TeacherError> {
        let c = &self.config;
        let _permit = self.slots.acquire().await.expect("semaphore open");
        let mut last = String::new();
        for attempt in 0..=c.max_retries {
            if attempt > 0 {
                tracing::warn!(url = %url, attempt, error = %last, "teacher request failed; retrying");
            }
            let mut req = self.http.post(url).json(body);
            if !self.key.0.is_empty() {
                req = req.bearer_auth(&self.key.0);
            }
            let resp = match req.send().await {
                Ok(r) => r,
                Err(e) => {
                    last = if e.is_timeout() {
                        format!("no answer within {} s", c.timeout_s)
                    } else {
                        format!("request failed: {e}")
                    };
                    tokio::time::sleep(backoff(attempt)).await;
                    continue;
                }
            };
            let status = resp.status();
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map(|s| Duration::from_secs_f64(s.clamp(0.0, 60.0)));
            let text = match resp.text().await {
                Ok(t) => t,
                Err(e) => {
                    last = if e.is_timeout() {
                        format!("no complete answer within {} s", c.timeout_s)
                    } else {
                        format!("reading the answer: {e}")
                    };
                    tokio::time::sleep(backoff(attempt)).await;
                    continue;
                }
            };
            if status.as_u16() == 429 || status.is_server_error() {
                last = format!("HTTP {status}: {}", excerpt(&text));
                tokio::time::sleep(retry_after.unwrap_or_else(|| backoff(attempt))).await;
                continue;
            }
            if !status.is_success() {
                return Err(TeacherError(format!(
                    "{url} answered HTTP {status}: {} (not retried)",
                    excerpt(&text)
                )));
            }
            return Ok(text);
        }
        Err(TeacherError(format!(
            "{url} failed {} times; last: {last}",
            c.max_retries + 1
        )))
    }
}

/// The first 300 characters of an answer, for error messages.
pub(crate) fn excerpt(s: &str) -> String {
    let s = s.trim();
    let cut: String = s.chars().take(300).collect();
    if cut.len() < s.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

/// The reply text (and token log-probs) of a chat-completions answer.
fn parse_completion(text: &str) -> Result<TeacherReply, String> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {}", excerpt(text)))?;
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| format!("no choices: {}", excerpt(text)))?;
    let content = choice
        .get("message")
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let logprobs = choice
        .get("logprobs")
        .and_then(|l| l.get("content"))
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(|t| t.get("logprob").and_then(Value::as_f64))
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default();
    Ok(TeacherReply {
        text: content,
        logprobs,
    })
}

/// The log-probs of the last `n` prompt tokens from a completions answer with vLLM's
/// `prompt_logprobs`: `choices[0].prompt_logprobs` lists, per prompt position (the first
/// `null`), an object keyed by token id whose entry for the actual token has `logprob`.
fn parse_prompt_logprobs(text: &str, prompt: &[u32], n: usize) -> Result<Vec<f32>, String> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {}", excerpt(text)))?;
    let entries = v
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("prompt_logprobs"))
        .and_then(Value::as_array)
        .ok_or_else(|| {
            format!(
                "no choices[0].prompt_logprobs (does the server support vLLM's prompt_logprobs?): {}",
                excerpt(text)
            )
        })?;
    if entries.len() != prompt.len() || n >= prompt.len() {
        return Err(format!(
            "prompt_logprobs has {} entries for a prompt of {} tokens",
            entries.len(),
            prompt.len()
        ));
    }
    let first = prompt.len() - n;
    (first..prompt.len())
        .map(|i| {
            entries[i]
                .get(prompt[i].to_string())
                .and_then(|e| e.get("logprob"))
                .and_then(Value::as_f64)
                .map(|x| x as f32)
                .ok_or_else(|| {
                    format!(
                        "prompt_logprobs[{i}] has no logprob for token {} (a different tokenizer?)",
                        prompt[i]
                    )
                })
        })
        .collect()
}

/// The conversation so far, as the student sees it.
pub fn messages(state: &TeacherState<'_>) -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": state.system_prompt}),
        json!({"role": "user", "content": state.task.problem_statement}),
    ];
    for step in state.history {
        m.push(json!({"role": "assistant", "content": step.reply}));
        m.push(json!({"role": "user", "content": step.observation}));
    }
    m
}

/// A [`Teacher`] that asks the endpoint. Blocking: call it from a blocking thread.
pub struct EndpointTeacher {
    endpoint: Arc<ChatEndpoint>,
    rt: Handle,
    seed: Option<u64>,
}

impl EndpointTeacher {
    pub fn new(endpoint: Arc<ChatEndpoint>, rt: Handle, seed: Option<u64>) -> Self {
        Self { endpoint, rt, seed }
    }
}

impl Teacher for EndpointTeacher {
    fn next_action(&mut self, state: &TeacherState<'_>) -> Result<TeacherReply, TeacherError> {
        let msgs = messages(state);
        let seed = self.seed.map(|s| s.wrapping_add(state.turn as u64));
        self.rt.block_on(self.endpoint.complete(&msgs, seed))
    }

    fn name(&self) -> &str {
        "endpoint"
    }

    fn score(
        &mut self,
        prefix: &[u32],
        continuation: &[u32],
    ) -> Option<Result<Vec<f32>, TeacherError>> {
        Some(self.rt.block_on(self.endpoint.score(prefix, continuation)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_parse_with_and_without_logprobs() {
        let r = parse_completion(
            r#"{"choices":[{"message":{"role":"assistant","content":"hi"},"logprobs":{"content":[{"token":"h","logprob":-0.5},{"token":"i","logprob":-1.25}]}}]}"#,
        )
        .unwrap();
        assert_eq!(r.text, "hi");
        assert_eq!(r.logprobs, vec![-0.5, -1.25]);
        let r = parse_completion(r#"{"choices":[{"message":{"content":null}}]}"#).unwrap();
        assert_eq!(r.text, "");
        assert!(parse_completion("<html>").unwrap_err().contains("not JSON"));
        assert!(parse_completion("{}").unwrap_err().contains("no choices"));
    }

    #[test]
    fn prompt_logprobs_parse_the_actual_tokens_and_name_what_is_missing() {
        let text = r#"{"choices":[{"text":"x","prompt_logprobs":[null,{"7":{"logprob":-0.5},"3":{"logprob":-0.1}},{"9":{"logprob":-2.0}}]}]}"#;
        assert_eq!(
            parse_prompt_logprobs(text, &[1, 7, 9], 2).unwrap(),
            vec![-0.5, -2.0]
        );
        assert_eq!(
            parse_prompt_logprobs(text, &[1, 7, 9], 1).unwrap(),
            vec![-2.0]
        );
        let e = parse_prompt_logprobs(text, &[1, 8, 9], 2).unwrap_err();
        assert!(e.contains("no logprob for token 8"), "{e}");
        let e = parse_prompt_logprobs(text, &[1, 7], 1).unwrap_err();
        assert!(e.contains("3 entries for a prompt of 2"), "{e}");
        let e = parse_prompt_logprobs(r#"{"choices":[{"text":""}]}"#, &[1, 2], 1).unwrap_err();
        assert!(e.contains("prompt_logprobs"), "{e}");
    }

    #[test]
    fn the_key_never_prints() {
        std::env::set_var("TUTOR_TEST_KEY_NEVER_PRINTS", "sk-secret-123");
        let e = ChatEndpoint::new(&TeacherConfig {
            kind: TeacherKind::Endpoint,
            base_url: "http://127.0.0.1:9/v1".into(),
            model: "m".into(),
            api_key_env: "TUTOR_TEST_KEY_NEVER_PRINTS".into(),
            ..Default::default()
        })
        .unwrap();
        let shown = format!("{e:?}");
        assert!(!shown.contains("sk-secret"), "{shown}");
        assert!(shown.contains("***"), "{shown}");
    }

    #[test]
    fn bad_settings_name_the_field() {
        let cfg = |url: &str, model: &str| TeacherConfig {
            kind: TeacherKind::Endpoint,
            base_url: url.into(),
            model: model.into(),
            ..Default::default()
        };
        assert!(ChatEndpoint::new(&cfg("", "m"))
            .unwrap_err()
            .to_string()
            .contains("base_url"));
        assert!(ChatEndpoint::new(&cfg("ftp://x", "m"))
            .unwrap_err()
            .to_string()
            .contains("http://"));
        assert!(ChatEndpoint::new(&cfg("http://x/v1", " "))
            .unwrap_err()
            .to_string()
            .contains("model"));
        assert_eq!(backoff(0), Duration::from_millis(500));
        assert_eq!(backoff(10), Duration::from_secs(8));
    }
}
