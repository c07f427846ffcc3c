//! The student engine over vLLM's API (`[worker.student] api = "vllm"`): its
//! OpenAI-compatible server and its weight-transfer control plane (routes served with
//! `VLLM_SERVER_DEV_MODE=1`), which `tutor serve` also serves.
//!
//! - A turn is `POST /v1/completions` with the prompt as token ids, `logprobs: 0`,
//!   `return_token_ids` and `return_tokens_as_token_ids`: the sampled ids come back as
//!   `choices[0].token_ids`, each one's log-probability as `logprobs.token_logprobs`
//!   (and its id as `"token_id:N"` in `logprobs.tokens`, checked). Sampling is neutral
//!   whatever the server's defaults (`top_k: -1`, `min_p: 0`, no penalties), with the
//!   episode's seed. vLLM returns the log-probabilities before temperature by default
//!   (`--logprobs-mode raw_logprobs`): at the temperature 1 that training samples with,
//!   they are those of the distribution sampled from.
//! - vLLM's answers name no weight version, so the version is checked around the turn:
//!   `GET /weight_info` must report the episode's version before the request is sent and
//!   after its answer came. A reload in between changes it (vLLM's `/pause` lets running
//!   requests finish before an update, and requests sent while paused run after it), so
//!   a turn from another version's weights is refused, never used. `tutor serve` also
//!   reports its swap count (`weight_generation`), which must not change either: a
//!   version replaced and loaded again while the turn ran shows. vLLM has no such count:
//!   workers sharing one vLLM server must not reload an older version meanwhile.
//! - A new version goes through vLLM's control plane: `POST /init_weight_transfer_engine`,
//!   `/pause?mode=wait`, `/start_weight_update`, `/update_weights`,
//!   `/finish_weight_update` (which names the version), `/resume` (whatever happened once
//!   paused); then `/weight_info` must report it. From disk (`reload = "disk"`): vLLM's
//!   `disk` weight-transfer backend, `update_info: {path}`. As tensors (`reload =
//!   "distributed"`): `init_info` names this worker's group (rank 0) and `update_info` the
//!   tensors (`names`, `dtype_names`, `shapes`) sent while the update runs. The data plane
//!   is Tutor's CPU collective (`backend: "tutor-cpu"`), which `tutor serve` speaks; vLLM's
//!   own is NCCL through its Python rendezvous, which a worker does not join: with vLLM
//!   itself, load from disk.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use tutor_collective::engine_update;
use tutor_policy::{FinishReason, GenParams, Generation};

use super::{EngineError, RemoteEngine, UpdateGroup};
use crate::teacher::endpoint::excerpt;

/// vLLM clamps impossible log-probabilities to this (JSON has no -inf).
const CLAMPED_LOGPROB: f64 = -9999.0;

/// Why one attempt at a reload through vLLM's control plane did not load the version.
enum Attempt {
    /// Another client's update is under way (409): try again once it is done.
    Conflict(String),
    Failed(EngineError),
}

impl From<EngineError> for Attempt {
    fn from(e: EngineError) -> Self {
        Attempt::Failed(e)
    }
}

impl RemoteEngine {
    /// A control-plane route's answer: `Ok(Err((status, message)))` when the engine
    /// answered with an error status (vLLM's `{"error": ...}`, FastAPI's `{"detail":
    /// ...}`, or a `message`).
    async fn vllm_post(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Result<(), (u16, String)>, EngineError> {
        let (status, text) = self
            .send(reqwest::Method::POST, path, Some(body), timeout)
            .await?;
        if status.is_success() {
            return Ok(Ok(()));
        }
        let answer: Option<Value> = serde_json::from_str(&text).ok();
        let message = answer
            .as_ref()
            .and_then(|v| {
                let e = v
                    .get("error")
                    .or_else(|| v.get("detail"))
                    .or_else(|| v.get("message"))?;
                e.as_str()
                    .or_else(|| e.get("message").and_then(Value::as_str))
                    .map(str::to_string)
            })
            .unwrap_or_else(|| excerpt(&text));
        Ok(Err((
            status.as_u16(),
            format!("{path}: HTTP {status}: {message}"),
        )))
    }

    /// `vllm_post` for one step of a reload of policy version `version`: a 409 is a
    /// conflict with another client's update; another refusal fails the reload, saying
    /// what was refused (`what`).
    async fn vllm_step(
        &self,
        path: &str,
        body: &Value,
        version: u64,
        what: &str,
    ) -> Result<(), Attempt> {
        let t = Duration::from_secs_f64(self.config.reload_timeout_s);
        match self.vllm_post(path, body, t).await? {
            Ok(()) => Ok(()),
            Err((409, m)) => Err(Attempt::Conflict(m)),
            Err((_, m)) => Err(Attempt::Failed(self.refused(format!(
                "refused to {what} for policy version {version} ({m})"
            )))),
        }
    }

    /// Runs `attempt` until it loads the version, or another client did (the engine
    /// serves `label`: checked before every attempt, so a reload that waited for another
    /// client's update of the same version does not swap it in again), retrying after
    /// conflicts with other clients' updates for up to `reload_timeout_s`; then checks that
    /// the engine serves `label`.
    async fn vllm_reload<F, Fut>(
        &self,
        version: u64,
        label: &str,
        attempt: F,
    ) -> Result<(), EngineError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<(), Attempt>>,
    {
        let limit = Duration::from_secs_f64(self.config.reload_timeout_s);
        let start = Instant::now();
        loop {
            if self.serves(label, version).await {
                return Ok(());
            }
            match attempt().await {
                Ok(()) => break,
                Err(Attempt::Failed(e)) => return Err(e),
                Err(Attempt::Conflict(m)) => {
                    if start.elapsed() >= limit {
                        return Err(self.refused(format!(
                            "other clients kept updating its weights for {:.0} s \
                             (worker.student.reload_timeout_s); policy version {version} was \
                             not loaded ({m})",
                            start.elapsed().as_secs_f64()
                        )));
                    }
                    tracing::info!(version, conflict = %m, "another client is updating the student engine's weights: waiting");
                    let jitter = rand::random::<u64>() % 500;
                    tokio::time::sleep(Duration::from_millis(500 + jitter)).await;
                }
            }
        }
        self.check_served(version, label).await
    }

    /// Loads the checkpoint directory `engine_path` (as the engine sees it) through
    /// vLLM's `disk` weight transfer, as weight version `label`.
    pub(super) async fn vllm_load_from_disk(
        &self,
        engine_path: &Path,
        version: u64,
        label: &str,
    ) -> Result<(), EngineError> {
        let update = json!({"path": engine_path.display().to_string()});
        self.vllm_reload(version, label, || async {
            let init = json!({"init_info": {}});
            self.vllm_step(
                "/init_weight_transfer_engine",
                &init,
                version,
                &format!("load from disk ({})", engine_path.display()),
            )
            .await?;
            self.vllm_transfer(version, label, update.clone(), None)
                .await
        })
        .await
    }

    /// Sends `file`'s tensors (`metas`) over a weight-update group this worker forms
    /// (rank 0), through vLLM's control plane, as weight version `label`.
    pub(super) async fn vllm_load_distributed(
        &self,
        file: std::sync::Arc<Vec<u8>>,
        metas: Vec<engine_update::TensorMeta>,
        version: u64,
        label: &str,
    ) -> Result<(), EngineError> {
        self.vllm_reload(version, label, || {
            self.vllm_send_once(file.clone(), &metas, version, label)
        })
        .await
    }

    /// One attempt of `vllm_load_distributed`, over a group of its own.
    async fn vllm_send_once(
        &self,
        file: std::sync::Arc<Vec<u8>>,
        metas: &[engine_update::TensorMeta],
        version: u64,
        label: &str,
    ) -> Result<(), Attempt> {
        let update_group = self.update_group(version, label)?;
        let init = json!({"init_info": update_group.init_fields()});
        let UpdateGroup {
            group,
            host,
            port,
            joined,
            abandon,
        } = update_group;
        // The engine answers once it joined (or gave up).
        let answer = self
            .vllm_step(
                "/init_weight_transfer_engine",
                &init,
                version,
                &format!("form a weight-update group with this worker at {host}:{port}"),
            )
            .await;
        if answer.is_err() {
            abandon.set();
        }
        answer?;
        let collective = self.joined(joined, &group, version).await?;
        abandon.set();
        let update = json!({
            "names": metas.iter().map(|m| &m.name).collect::<Vec<_>>(),
            "dtype_names": metas.iter().map(|m| &m.dtype).collect::<Vec<_>>(),
            "shapes": metas.iter().map(|m| &m.shape).collect::<Vec<_>>(),
            "group_name": group,
        });
        self.vllm_transfer(version, label, update, Some((collective, file)))
            .await
    }

    /// Pause, start, update (sending over `send`'s collective meanwhile), finish as
    /// `label`, and resume: whatever happened once paused, except when the start was
    /// refused because another client's update is under way (that client resumes; a
    /// resume now would let turns run while vLLM updates its weights in place).
    async fn vllm_transfer(
        &self,
        version: u64,
        label: &str,
        update_info: Value,
        send: Option<(tutor_collective::CpuCollective, std::sync::Arc<Vec<u8>>)>,
    ) -> Result<(), Attempt> {
        // `wait`: requests running now finish on the old weights; new ones wait.
        self.vllm_step("/pause?mode=wait", &json!({}), version, "pause")
            .await?;
        if let Err(e) = self
            .vllm_step(
                "/start_weight_update",
                &json!({}),
                version,
                "start an update",
            )
            .await
        {
            if !matches!(e, Attempt::Conflict(_)) {
                self.vllm_resume(version).await?;
            }
            return Err(e);
        }
        let result = async {
            let started = Instant::now();
            let sending = send.map(|(mut collective, file)| {
                tokio::task::spawn_blocking(move || engine_update::send(&mut collective, &file))
            });
            let body = json!({"update_info": update_info});
            // Refused: the engine closed the group and the sends end on their own; the
            // reload does not wait for them (a request that never arrived would leave them
            // waiting out their timeout).
            self.vllm_step("/update_weights", &body, version, "take the weights")
                .await?;
            if let Some(sending) = sending {
                match sending.await {
                    Ok(Ok(bytes)) => tracing::debug!(
                        version,
                        bytes,
                        seconds = started.elapsed().as_secs_f64(),
                        "sent the version to the student engine over the collective"
                    ),
                    Ok(Err(e)) => {
                        return Err(self
                            .refused(format!(
                                "took policy version {version} though sending it failed: {e}"
                            ))
                            .into())
                    }
                    Err(e) => {
                        return Err(self
                            .refused(format!("sending policy version {version}: {e}"))
                            .into())
                    }
                }
            }
            let finish = json!({"weight_version": label});
            self.vllm_step(
                "/finish_weight_update",
                &finish,
                version,
                "finish the update",
            )
            .await
        }
        .await;
        let resumed = self.vllm_resume(version).await;
        result?;
        resumed.map_err(Attempt::from)
    }

    /// `/resume`, tried three times: an engine left paused serves nobody.
    async fn vllm_resume(&self, version: u64) -> Result<(), EngineError> {
        let mut last = String::new();
        for attempt in 0..3u64 {
            match self
                .vllm_post("/resume", &json!({}), Duration::from_secs(30))
                .await
            {
                Ok(Ok(())) => return Ok(()),
                Ok(Err((_, m))) => last = m,
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
        }
        Err(self.refused(format!(
            "did not resume after the reload of policy version {version} ({last})"
        )))
    }

    /// The engine must serve `label` now (`/weight_info`); otherwise the turn is not
    /// for this episode. Returns the swap count when the engine reports one.
    async fn vllm_expect_version(&self, label: &str) -> Result<Option<u64>, EngineError> {
        let (served, generation) = self.weight_info().await?;
        if served != label {
            return Err(EngineError::WrongVersion {
                url: self.base.clone(),
                served,
                expected: label.to_string(),
            });
        }
        Ok(generation)
    }

    /// One turn on vLLM's `/v1/completions`, between two checks of the served version.
    pub(super) async fn vllm_generate(
        &self,
        prompt: &[u32],
        params: &GenParams,
        label: &str,
    ) -> Result<Generation, EngineError> {
        let before = self.vllm_expect_version(label).await?;
        let body = json!({
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            // Neutral, whatever the server's defaults (vLLM takes them from the model's
            // generation_config.json unless started with --generation-config vllm).
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "min_tokens": 0,
            "seed": params.seed & (i64::MAX as u64),
            "stop_token_ids": params.stop_token_ids,
            "skip_special_tokens": false,
            "include_stop_str_in_output": true,
            "logprobs": 0,
            "return_token_ids": true,
            "return_tokens_as_token_ids": true,
            "n": 1,
            "stream": false,
        });
        let text = self.post_turn("/v1/completions", &body).await?;
        let generation = self.parse_completion(&text, params.max_new_tokens)?;
        let after = self.vllm_expect_version(label).await?;
        // The same version, and (where the engine counts its swaps) no swap in between:
        // a version replaced and loaded again while the turn ran shows.
        if before != after {
            return Err(self.refused(format!(
                "swapped its weights while the turn ran (swap {before:?}, then {after:?}), \
                 though it serves {label:?} again: the turn is not used"
            )));
        }
        Ok(generation)
    }

    /// Reads and checks a `/v1/completions` answer.
    pub(super) fn parse_completion(
        &self,
        text: &str,
        max_new: usize,
    ) -> Result<Generation, EngineError> {
        #[derive(Deserialize)]
        struct Answer {
            choices: Vec<Choice>,
        }
        #[derive(Deserialize)]
        struct Choice {
            token_ids: Option<Vec<i64>>,
            logprobs: Option<Logprobs>,
            finish_reason: Option<String>,
        }
        #[derive(Deserialize)]
        struct Logprobs {
            token_logprobs: Option<Vec<Option<f64>>>,
            tokens: Option<Vec<String>>,
        }
        let path = "/v1/completions";
        let bad = |m: String| self.refused(format!("{path} answered {m}"));
        let a: Answer = serde_json::from_str(text)
            .map_err(|e| bad(format!("an unreadable answer ({e}): {}", excerpt(text))))?;
        let [choice] = <[Choice; 1]>::try_from(a.choices)
            .map_err(|c| bad(format!("{} choices where one was asked for", c.len())))?;
        let ids = choice.token_ids.ok_or_else(|| {
            bad("no choices[0].token_ids: the server does not take return_token_ids".into())
        })?;
        let lp = choice
            .logprobs
            .ok_or_else(|| bad("no choices[0].logprobs".into()))?;
        let values = lp
            .token_logprobs
            .ok_or_else(|| bad("no choices[0].logprobs.token_logprobs".into()))?;
        // "token_id:N" when the server takes return_tokens_as_token_ids; text otherwise
        // (then only the count is checked).
        let named: Vec<Option<i64>> = match lp.tokens {
            Some(tokens) if tokens.len() == values.len() => tokens
                .iter()
                .map(|t| t.strip_prefix("token_id:").and_then(|n| n.parse().ok()))
                .collect(),
            _ => vec![None; values.len()],
        };
        let lps: Vec<(Option<f64>, Option<i64>)> = values
            .into_iter()
            .map(|v| v.filter(|&v| v > CLAMPED_LOGPROB))
            .zip(named)
            .collect();
        let (tokens, logprobs) = self.checked_tokens(path, &ids, &lps, max_new)?;
        let finish = match choice.finish_reason.as_deref() {
            Some("stop") => FinishReason::Stop,
            Some("length") => FinishReason::Length,
            other => {
                return Err(bad(format!(
                    "finish_reason {other:?}: the generation did not finish"
                )))
            }
        };
        Ok(Generation {
            tokens,
            logprobs,
            finish,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{EngineApi, StudentConfig, StudentKind};
    use super::*;

    fn engine() -> RemoteEngine {
        let config = StudentConfig {
            kind: StudentKind::Engine,
            api: EngineApi::Vllm,
            base_url: "http://127.0.0.1:9".into(),
            ..Default::default()
        };
        RemoteEngine::new(&config, 100).unwrap()
    }

    /// A `/v1/completions` answer as vLLM gives it with `logprobs: 0`,
    /// `return_token_ids` and `return_tokens_as_token_ids`.
    fn answer(ids: &[i64], lps: Value) -> Value {
        json!({
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{
                "index": 0,
                "text": "",
                "logprobs": {
                    "text_offset": [],
                    "token_logprobs": lps,
                    "tokens": ids.iter().map(|i| format!("token_id:{i}")).collect::<Vec<_>>(),
                    "top_logprobs": null,
                },
                "finish_reason": "stop",
                "stop_reason": 7,
                "token_ids": ids,
                "prompt_token_ids": [1, 2],
            }],
        })
    }

    /// vLLM's answers are read from the fields its token-in/token-out options fill, and
    /// checked as SGLang's are: a wrong count, another token's log-probability, a clamped
    /// (impossible) one, ids outside the vocabulary, an aborted generation, several
    /// choices or none of the fields: refused, naming the engine.
    #[test]
    fn vllm_answers_are_checked_before_they_become_turns() {
        let e = engine();
        let ok = answer(&[5, 7], json!([-0.5, -0.25]));
        let g = e.parse_completion(&ok.to_string(), 8).unwrap();
        assert_eq!(g.tokens, vec![5, 7]);
        assert_eq!(g.logprobs, vec![-0.5, -0.25]);
        assert_eq!(g.finish, FinishReason::Stop);
        // Tokens named by text (a server without return_tokens_as_token_ids): the count
        // is checked, the ids come from token_ids.
        let mut texts = ok.clone();
        texts["choices"][0]["logprobs"]["tokens"] = json!(["a", "b"]);
        assert_eq!(
            e.parse_completion(&texts.to_string(), 8).unwrap().tokens,
            vec![5, 7]
        );
        let mut length = ok.clone();
        length["choices"][0]["finish_reason"] = json!("length");
        assert_eq!(
            e.parse_completion(&length.to_string(), 8).unwrap().finish,
            FinishReason::Length
        );

        let refused = |v: Value, want: &str| {
            let err = e
                .parse_completion(&v.to_string(), 8)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(want)
                    && err.contains("127.0.0.1:9")
                    && err.contains("/v1/completions"),
                "{err}"
            );
        };
        refused(
            answer(&[5, 7], json!([-0.5])),
            "1 log-probabilities for 2 sampled tokens",
        );
        let mut other = answer(&[5], json!([-0.5]));
        other["choices"][0]["logprobs"]["tokens"] = json!(["token_id:6"]);
        refused(other, "for token 6, but token 5");
        refused(answer(&[5], json!([-9999.0])), "None");
        refused(answer(&[5], json!([null])), "None");
        refused(answer(&[5], json!([0.7])), "0.7");
        refused(answer(&[100], json!([-0.5])), "outside the vocabulary");
        refused(answer(&[1; 9], json!(vec![-0.1; 9])), "at most 8");
        let mut aborted = ok.clone();
        aborted["choices"][0]["finish_reason"] = json!("abort");
        refused(aborted, "did not finish");
        let mut two = ok.clone();
        two["choices"] = json!([ok["choices"][0], ok["choices"][0]]);
        refused(two, "2 choices");
        let mut no_ids = ok.clone();
        no_ids["choices"][0]
            .as_object_mut()
            .unwrap()
            .remove("token_ids");
        refused(no_ids, "return_token_ids");
        let mut no_lps = ok.clone();
        no_lps["choices"][0]["logprobs"] = Value::Null;
        refused(no_lps, "logprobs");
        refused(json!("<html>"), "unreadable");
    }
}
