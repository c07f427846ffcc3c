//! The serving engine: one thread owns the model and decodes every admitted request in one
//! batch, with requests joining and leaving between decode steps (continuous batching).
//!
//! Requests arrive through a bounded channel (a full queue makes senders wait). Between
//! decode steps the engine admits waiting requests in arrival order while the batch stays
//! within `max_batch` rows and `max_cached_tokens` key/value slots, prefills them, and
//! drops rows that finished or whose client went away. A request that does not fit waits
//! (and the ones behind it too, so that a long request is not starved by short ones).
//!
//! Cache layout: every row's context is right-aligned at a shared slot `len`, as in
//! [`Policy::generate`], so that one decode step writes one column for all rows. When the
//! membership changes the cache is rebuilt around the rows that remain: the shared column
//! moves to the longest context present (prompts longer than `len` shift the others right,
//! departures of long rows shift them left), and the capacity is the most any row can
//! still reach. The physical cache is `rows × capacity` slots, and that product is what
//! `max_cached_tokens` bounds, so left padding counts against the budget as it costs
//! memory.
//!
//! Long on purpose (~770 lines of code, 340 of tests): the scheduling loop, the batch's
//! cache rebuilds and the per-row decoding share the engine thread's state.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};
use tokio::sync::mpsc;

use crate::generate::{sample, RowSampling, Sampled};
use crate::model::{AttnMask, KvCache};
use crate::prefix_cache::{PrefixCache, PrefixStats};
use crate::{ChatTokenizer, FinishReason, GenParams, Policy};

/// Limits of one engine; see `tutor serve --help`.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most requests decoded together.
    pub max_batch: usize,
    /// Key/value slots the batch's cache may hold (rows × capacity, per layer).
    pub max_cached_tokens: usize,
    /// Requests that may wait in the channel before senders block.
    pub queue: usize,
    /// libtorch intra-op threads of the engine thread (0: libtorch's default). Set on the
    /// thread that decodes, since OpenMP thread counts are per thread.
    pub torch_threads: u32,
    /// Tokens of finished generations whose keys and values the engine keeps, so that a
    /// prompt starting with one of them (an agent's next turn) prefills only what is new
    /// (`prefix_cache`); 0 turns it off. Memory besides `max_cached_tokens`: per token,
    /// 2 × layers × kv_heads × head_dim values.
    pub prefix_cache_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 8,
            max_cached_tokens: 32_768,
            queue: 64,
            torch_threads: 0,
            prefix_cache_tokens: 32_768,
        }
    }
}

/// One completion to run.
#[derive(Debug)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// Text that ends the generation when it appears; the returned text stops before it.
    pub stop: Vec<String>,
    /// Alternatives listed per generated token (0 = none).
    pub top_logprobs: usize,
    /// Also report the log-probability of every prompt token after the first under the
    /// model (`EngineEvent::Prompt`, before any token): scoring another policy's tokens,
    /// e.g. a teacher's log-probs of a student's action for on-policy distillation.
    pub prompt_logprobs: bool,
    /// Decode text as tokens arrive (`TokenEvent::text`, `DoneEvent::text`). Callers that
    /// only need token ids (the rollout worker) turn it off and save a detokenization per
    /// token; stop strings need the text, so a request with any keeps it on.
    pub text: bool,
    /// Where the engine reports; dropping the receiver cancels the request.
    pub events: EventSender,
}

/// What travels to the engine thread: a request, or new weights to swap in.
enum Msg {
    Request(EngineRequest),
    /// Swap weights once the rows admitted before it have finished; requests that arrive
    /// later wait and run under the new weights, so no generation mixes two versions.
    Load {
        source: WeightsSource,
        reply: tokio::sync::oneshot::Sender<Result<(), LoadError>>,
    },
}

/// Where new weights come from: a safetensors file or checkpoint directory, or one
/// safetensors file's bytes already in memory (a version received over the weights
/// broadcast, loaded without writing or reading a file).
#[derive(Clone)]
pub enum WeightsSource {
    Path(std::path::PathBuf),
    Bytes {
        bytes: std::sync::Arc<Vec<u8>>,
        /// Stands for the file in errors, e.g. "policy version 3 (in memory)".
        name: String,
    },
}

impl std::fmt::Debug for WeightsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightsSource::Path(p) => f.debug_tuple("Path").field(p).finish(),
            // Not the bytes: gigabytes.
            WeightsSource::Bytes { bytes, name } => f
                .debug_struct("Bytes")
                .field("name", name)
                .field("len", &bytes.len())
                .finish(),
        }
    }
}

impl WeightsSource {
    /// How errors name it.
    pub fn describe(&self) -> std::path::PathBuf {
        match self {
            WeightsSource::Path(p) => p.clone(),
            WeightsSource::Bytes { name, .. } => std::path::PathBuf::from(name),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// `log p(prompt[i] | prompt[..i])` for i = 1..len (unscaled: temperature 1), when
    /// the request asked for `prompt_logprobs`.
    Prompt(Vec<f32>),
    Token(TokenEvent),
    Done(DoneEvent),
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Log-probability under the distribution the token was drawn from.
    pub logprob: f32,
    /// The most likely tokens of that distribution, most likely first.
    pub top: Vec<(u32, f32)>,
    /// Text that became final with this token (may be empty: text that could still turn
    /// into a stop string, or an incomplete UTF-8 character, is held back).
    pub text: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DoneEvent {
    /// `Stop` for a stop token or a stop string, `Length` for `max_new_tokens`.
    pub finish: FinishReason,
    /// The text held back until the end (never part of a stop string).
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// Why a request cannot be served at all (as opposed to having to wait).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    NoNewTokens,
    #[error(
        "the prompt has {prompt} tokens and max_tokens is {max_new}: {} in all, more than the \
         model's context of {context} tokens; lower max_tokens or shorten the messages",
        prompt + max_new
    )]
    TooLongForContext {
        prompt: usize,
        max_new: usize,
        context: usize,
    },
    #[error(
        "the prompt has {prompt} tokens and max_tokens is {max_new}: {} in all, more than this \
         server's cache budget of {budget} tokens (--max-cached-tokens)",
        prompt + max_new
    )]
    OverBudget {
        prompt: usize,
        max_new: usize,
        budget: usize,
    },
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("the engine has stopped")]
    Stopped,
    #[error("the engine stopped in the middle of a generation")]
    Interrupted,
}

/// Why new weights did not load; the old weights stay.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("loading {}: {error}", path.display())]
    Weights {
        path: std::path::PathBuf,
        error: crate::PolicyError,
    },
    #[error("the engine has stopped")]
    Stopped,
    #[error("the engine stopped before loading the weights")]
    Interrupted,
}

/// Where a request's events go.
pub type EventSender = mpsc::UnboundedSender<EngineEvent>;

/// Everything a request's events said, collected: what a caller that does not stream
/// waits for ([`EngineHandle::generate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// `EngineEvent::Prompt`, when the request asked for `prompt_logprobs`.
    pub prompt_logprobs: Option<Vec<f32>>,
    pub tokens: Vec<TokenEvent>,
    /// Every token's text and the held-back rest (empty when the request had `text` off).
    pub text: String,
    pub done: DoneEvent,
}

/// A request's events so far, folded into a [`Completion`] at `Done`.
#[derive(Default)]
struct Collector {
    prompt_logprobs: Option<Vec<f32>>,
    tokens: Vec<TokenEvent>,
}

impl Collector {
    /// Takes one event; the whole completion once it is `Done`.
    fn push(&mut self, event: EngineEvent) -> Option<Completion> {
        match event {
            EngineEvent::Prompt(lps) => self.prompt_logprobs = Some(lps),
            EngineEvent::Token(t) => self.tokens.push(t),
            EngineEvent::Done(done) => {
                let tokens = std::mem::take(&mut self.tokens);
                let mut text: String = tokens.iter().map(|t| t.text.as_str()).collect();
                text.push_str(&done.text);
                return Some(Completion {
                    prompt_logprobs: self.prompt_logprobs.take(),
                    tokens,
                    text,
                    done,
                });
            }
        }
        None
    }
}

/// The sending side: cheap to clone, one per HTTP handler.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Msg>,
    context: usize,
    budget: usize,
    vocab: usize,
    stats: Arc<Mutex<PrefixStats>>,
}

impl EngineHandle {
    /// Prompt tokens prefilled and reused from the prefix cache since the engine started.
    pub fn prefix_stats(&self) -> PrefixStats {
        *self.stats.lock().expect("engine stats")
    }

    /// The model's vocabulary size (`vocab_size`): every token id is below it.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The model's context length (`max_position_embeddings`).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Tokens the largest single request may occupy: prompt + max_new_tokens.
    pub fn max_request_tokens(&self) -> usize {
        self.context.min(self.budget)
    }

    /// Whether a request could ever run; checked before it is queued.
    pub fn check(&self, prompt: &[u32], max_new: usize) -> Result<(), RequestError> {
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if max_new == 0 {
            return Err(RequestError::NoNewTokens);
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(RequestError::BadToken {
                id,
                vocab: self.vocab,
            });
        }
        let total = prompt.len().saturating_add(max_new);
        if total > self.context {
            return Err(RequestError::TooLongForContext {
                prompt: prompt.len(),
                max_new,
                context: self.context,
            });
        }
        if total > self.budget {
            return Err(RequestError::OverBudget {
                prompt: prompt.len(),
                max_new,
                budget: self.budget,
            });
        }
        Ok(())
    }

    /// Queues a request, waiting while the queue is full.
    pub async fn submit(&self, request: EngineRequest) -> Result<(), RequestError> {
        self.check(&request.prompt, request.params.max_new_tokens)?;
        self.tx
            .send(Msg::Request(request))
            .await
            .map_err(|_| RequestError::Stopped)
    }

    /// [`EngineHandle::submit`] for threads outside an async runtime.
    pub fn submit_blocking(&self, request: EngineRequest) -> Result<(), RequestError> {
        self.check(&request.prompt, request.params.max_new_tokens)?;
        self.tx
            .blocking_send(Msg::Request(request))
            .map_err(|_| RequestError::Stopped)
    }

    /// Loads weights from a safetensors file (or a checkpoint directory) into the engine's model. The engine lets the
    /// requests admitted before this call finish, swaps, then admits the ones behind it:
    /// every generation runs under one set of weights. A file that does not fit the model
    /// is an error and the old weights stay.
    pub async fn load_weights(&self, path: &std::path::Path) -> Result<(), LoadError> {
        self.load(WeightsSource::Path(path.to_path_buf())).await
    }

    /// [`EngineHandle::load_weights`] from a file or from bytes in memory.
    pub async fn load(&self, source: WeightsSource) -> Result<(), LoadError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Msg::Load { source, reply })
            .await
            .map_err(|_| LoadError::Stopped)?;
        rx.await.map_err(|_| LoadError::Interrupted)?
    }

    /// [`EngineHandle::load_weights`] for threads outside an async runtime.
    pub fn load_weights_blocking(&self, path: &std::path::Path) -> Result<(), LoadError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .blocking_send(Msg::Load {
                source: WeightsSource::Path(path.to_path_buf()),
                reply,
            })
            .map_err(|_| LoadError::Stopped)?;
        rx.blocking_recv().map_err(|_| LoadError::Interrupted)?
    }

    /// Runs the request `build` makes around a fresh event channel to its end, for callers
    /// that do not stream: `handle.generate(|events| EngineRequest { .., events })`.
    pub async fn generate(
        &self,
        build: impl FnOnce(EventSender) -> EngineRequest,
    ) -> Result<Completion, RequestError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.submit(build(tx)).await?;
        Self::collect(rx).await
    }

    /// A submitted request's events folded into its [`Completion`], for callers that
    /// submit (`submit`) and wait apart.
    pub async fn collect(
        mut rx: mpsc::UnboundedReceiver<EngineEvent>,
    ) -> Result<Completion, RequestError> {
        let mut collector = Collector::default();
        while let Some(event) = rx.recv().await {
            if let Some(done) = collector.push(event) {
                return Ok(done);
            }
        }
        Err(RequestError::Interrupted)
    }

    /// [`EngineHandle::generate`] for threads outside an async runtime.
    pub fn generate_blocking(
        &self,
        build: impl FnOnce(EventSender) -> EngineRequest,
    ) -> Result<Completion, RequestError> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.submit_blocking(build(tx))?;
        let mut collector = Collector::default();
        while let Some(event) = rx.blocking_recv() {
            if let Some(done) = collector.push(event) {
                return Ok(done);
            }
        }
        Err(RequestError::Interrupted)
    }
}

/// Starts the engine thread. It runs until every [`EngineHandle`] is dropped and the
/// admitted requests have finished.
pub fn spawn_engine(
    mut policy: Policy,
    tokenizer: ChatTokenizer,
    config: EngineConfig,
) -> (EngineHandle, std::thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(config.queue.max(1));
    let stats = Arc::new(Mutex::new(PrefixStats::default()));
    let handle = EngineHandle {
        tx,
        context: policy.config.max_position_embeddings,
        budget: config.max_cached_tokens,
        vocab: policy.config.vocab_size,
        stats: stats.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("tutor-engine".into())
        .spawn(move || {
            if config.torch_threads > 0 {
                tch::set_num_threads(config.torch_threads as i32);
            }
            policy.use_decode_layout();
            let mut engine = Engine::new(policy, tokenizer, config, stats);
            tch::no_grad(|| engine.run(rx));
        })
        .expect("spawning the engine thread");
    (handle, thread)
}

/// One request in the batch.
struct Row {
    req: EngineRequest,
    rng: ChaCha8Rng,
    /// First cache slot holding this row's context.
    start: i64,
    prompt_len: usize,
    tokens: Vec<u32>,
    text: StopText,
    /// Set when the row finished or its client left; it leaves before the next step.
    gone: bool,
}

impl Row {
    /// New tokens this row may still sample.
    fn remaining(&self) -> usize {
        self.req.params.max_new_tokens - self.tokens.len()
    }

    fn wants_text(&self) -> bool {
        self.req.text || !self.req.stop.is_empty()
    }
}

struct Engine {
    policy: Policy,
    tokenizer: ChatTokenizer,
    config: EngineConfig,
    rows: Vec<Row>,
    cache: Option<KvCache>,
    capacity: i64,
    /// Next-token logits of every row, `[rows, V]`, float32.
    logits: Option<Tensor>,
    sampling: Option<RowSampling>,
    prefix: PrefixCache,
    stats: Arc<Mutex<PrefixStats>>,
}

impl Engine {
    fn new(
        policy: Policy,
        tokenizer: ChatTokenizer,
        config: EngineConfig,
        stats: Arc<Mutex<PrefixStats>>,
    ) -> Self {
        Engine {
            prefix: PrefixCache::new(config.prefix_cache_tokens),
            stats,
            policy,
            tokenizer,
            config,
            rows: Vec::new(),
            cache: None,
            capacity: 0,
            logits: None,
            sampling: None,
        }
    }

    fn len(&self) -> i64 {
        self.cache.as_ref().map_or(0, |c| c.len)
    }

    fn run(&mut self, mut rx: mpsc::Receiver<Msg>) {
        let mut waiting: VecDeque<Msg> = VecDeque::new();
        let mut open = true;
        loop {
            if self.rows.is_empty() && waiting.is_empty() {
                if !open {
                    return;
                }
                match rx.blocking_recv() {
                    Some(m) => waiting.push_back(m),
                    None => return,
                }
            }
            // Take from the channel only what could join soon, so that a full batch leaves
            // the backlog in the bounded channel, where it holds senders back.
            while open && waiting.len() < self.config.max_batch {
                match rx.try_recv() {
                    Ok(m) => waiting.push_back(m),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            waiting.retain(|m| match m {
                Msg::Request(r) => !r.events.is_closed(),
                Msg::Load { .. } => true,
            });
            self.admit(&mut waiting);
            if self.rows.is_empty() && matches!(waiting.front(), Some(Msg::Load { .. })) {
                if let Some(Msg::Load { source, reply }) = waiting.pop_front() {
                    let r = match &source {
                        WeightsSource::Path(path) => self.policy.load_path(path),
                        WeightsSource::Bytes { bytes, name } => {
                            self.policy.load_weight_bytes(bytes, name)
                        }
                    }
                    .map_err(|error| LoadError::Weights {
                        path: source.describe(),
                        error,
                    });
                    // Keys and values of the old weights would mix two versions (and a
                    // failed load may have replaced some tensors before it failed).
                    self.prefix.clear();
                    self.stats.lock().expect("engine stats").cached_tokens = 0;
                    let _ = reply.send(r);
                }
                continue;
            }
            if !self.rows.is_empty() {
                self.step();
            }
        }
    }

    /// Moves waiting requests into the batch, in order, while they fit; a weight swap in
    /// the queue stops admission until the batch has drained.
    fn admit(&mut self, waiting: &mut VecDeque<Msg>) {
        let len = self.len();
        let longest = self.rows.iter().map(|r| len - r.start).max().unwrap_or(0);
        let mut new_len = longest;
        let mut need = self
            .rows
            .iter()
            .map(|r| r.remaining() as i64)
            .max()
            .unwrap_or(0);
        let mut joining = 0;
        for msg in waiting.iter() {
            let Msg::Request(req) = msg else { break };
            let rows = self.rows.len() + joining + 1;
            let l = new_len.max(req.prompt.len() as i64);
            let n = need.max(req.params.max_new_tokens as i64);
            if rows > self.config.max_batch
                || rows as i64 * (l + n) > self.config.max_cached_tokens as i64
            {
                break;
            }
            new_len = l;
            need = n;
            joining += 1;
        }
        if joining == 0 {
            return;
        }
        let new: Vec<EngineRequest> = waiting
            .drain(..joining)
            .filter_map(|m| match m {
                Msg::Request(r) => Some(r),
                Msg::Load { .. } => None,
            })
            .collect();
        self.rebuild(new_len, new_len + need, new);
    }

    /// Lays the cache out again for the current rows plus `new` ones: every context
    /// right-aligned at `new_len`, `capacity` slots per row.
    fn rebuild(&mut self, new_len: i64, capacity: i64, new: Vec<EngineRequest>) {
        let device = self.policy.device();
        let kind = self.policy.model.compute_kind();
        let old_rows = self.rows.len() as i64;
        let total = old_rows + new.len() as i64;
        let mut cache = KvCache::new(&self.policy.config, total, capacity, kind, device);
        if let Some(old) = &self.cache {
            let len = old.len;
            let longest = self.rows.iter().map(|r| len - r.start).max().unwrap_or(0);
            cache.copy_block(old, len - longest, new_len - longest, longest);
            let shift = new_len - len;
            for r in &mut self.rows {
                r.start += shift;
            }
        }
        cache.len = new_len;
        let mut logits: Vec<Tensor> = self.logits.take().into_iter().collect();
        let prompts: Vec<&[u32]> = new.iter().map(|r| r.prompt.as_slice()).collect();
        let rows: Vec<i64> = (0..new.len() as i64).map(|i| old_rows + i).collect();
        let keep: Vec<bool> = new.iter().map(|r| r.prompt_logprobs).collect();
        // Prefixes kept from earlier generations go into their rows' first slots; only the
        // rest of each prompt runs. (A request that scores its prompt runs all of it.)
        let mut reused = Vec::with_capacity(new.len());
        for (req, &row) in new.iter().zip(&rows) {
            let hit = match req.prompt_logprobs {
                true => None,
                false => self.prefix.lookup(&req.prompt),
            };
            let m = hit.map_or(0, |hit| {
                let slot = new_len - req.prompt.len() as i64;
                cache.write_row(row, slot, hit.kv, hit.len as i64);
                hit.len
            });
            reused.push(m);
        }
        {
            let mut st = self.stats.lock().expect("engine stats");
            st.requests += new.len() as u64;
            st.hits += reused.iter().filter(|&&m| m > 0).count() as u64;
            st.reused_tokens += reused.iter().sum::<usize>() as u64;
            st.prefilled_tokens += new
                .iter()
                .zip(&reused)
                .map(|(r, m)| (r.prompt.len() - m) as u64)
                .sum::<u64>();
        }
        let done = self
            .policy
            .prefill_rows(&prompts, &rows, new_len, &keep, &reused, &mut cache);
        for (req, hidden) in new.into_iter().zip(done.hidden) {
            let p = req.prompt.len() as i64;
            if let Some(hidden) = hidden {
                // Each prompt token after the first, scored given the ones before it.
                let scored = if p > 1 {
                    let lp = self
                        .policy
                        .model
                        .logits(&hidden.narrow(0, 0, p - 1))
                        .log_softmax(-1, Kind::Float);
                    let next: Vec<i64> = req.prompt[1..].iter().map(|&t| t as i64).collect();
                    let next = Tensor::from_slice(&next).to_device(device).unsqueeze(-1);
                    Vec::<f32>::try_from(lp.gather(-1, &next, false).flatten(0, -1))
                        .unwrap_or_default()
                } else {
                    Vec::new()
                };
                let _ = req.events.send(EngineEvent::Prompt(scored));
            }
            self.rows.push(Row {
                rng: ChaCha8Rng::seed_from_u64(req.params.seed),
                start: new_len - p,
                prompt_len: req.prompt.len(),
                tokens: Vec::new(),
                text: StopText::new(req.stop.clone()),
                gone: false,
                req,
            });
        }
        logits.push(done.logits);
        self.logits = Some(Tensor::cat(&logits, 0));
        self.cache = Some(cache);
        self.capacity = capacity;
        self.resample_settings();
    }

    fn resample_settings(&mut self) {
        let params: Vec<&GenParams> = self.rows.iter().map(|r| &r.req.params).collect();
        self.sampling = Some(RowSampling::new(&params, self.policy.device()));
    }

    /// Samples one token for every row, reports it, drops finished rows, and runs the
    /// decode step that gives the remaining rows their next logits.
    fn step(&mut self) {
        let device = self.policy.device();
        let logits = self.logits.take().expect("rows have logits");
        let uniforms: Vec<f64> = self
            .rows
            .iter_mut()
            .map(|r| {
                if r.req.params.temperature > 0.0 {
                    r.rng.gen::<f64>()
                } else {
                    0.0
                }
            })
            .collect();
        let top_n = self
            .rows
            .iter()
            .map(|r| r.req.top_logprobs)
            .max()
            .unwrap_or(0);
        let Sampled {
            tokens,
            logprobs,
            top,
        } = sample(
            &logits,
            self.sampling.as_ref().expect("set with the rows"),
            &uniforms,
            top_n,
        );
        for (i, row) in self.rows.iter_mut().enumerate() {
            let tok = tokens[i] as u32;
            row.tokens.push(tok);
            let mut finish = None;
            let mut by_string = false;
            let text = if row.req.params.stop_token_ids.contains(&tok) {
                finish = Some(FinishReason::Stop);
                String::new()
            } else if !row.wants_text() {
                String::new()
            } else {
                let decoded = self.tokenizer.decode(&row.tokens);
                let (delta, stopped) = row.text.advance(&decoded);
                if stopped {
                    finish = Some(FinishReason::Stop);
                    by_string = true;
                }
                delta
            };
            if finish.is_none() && row.remaining() == 0 {
                finish = Some(FinishReason::Length);
            }
            let mut alternatives = top[i].clone();
            alternatives.truncate(row.req.top_logprobs);
            let sent = row.req.events.send(EngineEvent::Token(TokenEvent {
                id: tok,
                logprob: logprobs[i],
                top: alternatives,
                text,
            }));
            if sent.is_err() {
                row.gone = true; // the client went away
                continue;
            }
            if let Some(finish) = finish {
                // The row's context in the cache: its prompt and every sampled token but
                // this last one (not fed yet), kept for a later prompt (copied out only
                // when the cache would keep it).
                if let Some(cache) = &self.cache {
                    let n = cache.len - row.start;
                    if self.prefix.would_keep(n as usize) {
                        let fed = &row.tokens[..row.tokens.len() - 1];
                        if n == (row.req.prompt.len() + fed.len()) as i64 {
                            let mut tokens = row.req.prompt.clone();
                            tokens.extend_from_slice(fed);
                            let kv = cache.read_row(i as i64, row.start, n);
                            self.prefix.insert(tokens, kv);
                            let held = self.prefix.held() as u64;
                            self.stats.lock().expect("engine stats").cached_tokens = held;
                        }
                    }
                }
                // Text held back for a stop string that never completed (or a trailing
                // replacement character) is final now.
                let rest = if by_string || !row.wants_text() {
                    String::new()
                } else {
                    row.text.flush(&self.tokenizer.decode(&row.tokens))
                };
                let _ = row.req.events.send(EngineEvent::Done(DoneEvent {
                    finish,
                    text: rest,
                    prompt_tokens: row.prompt_len,
                    completion_tokens: row.tokens.len(),
                }));
                row.gone = true;
            }
        }
        let keep: Vec<i64> = (0..self.rows.len() as i64)
            .filter(|&i| !self.rows[i as usize].gone)
            .collect();
        if keep.len() < self.rows.len() {
            let mut i = 0;
            self.rows.retain(|_| {
                i += 1;
                keep.contains(&(i - 1))
            });
            if self.rows.is_empty() {
                self.cache = None;
                self.sampling = None;
                self.capacity = 0;
                return;
            }
            let idx = Tensor::from_slice(&keep).to_device(device);
            self.cache
                .as_mut()
                .expect("rows have a cache")
                .select_rows(&idx);
            self.resample_settings();
        }
        let next: Vec<i64> = keep.iter().map(|&i| tokens[i as usize]).collect();
        self.decode(&next);
    }

    /// Feeds each row's last token through the model at the shared slot `len`.
    fn decode(&mut self, next: &[i64]) {
        let device = self.policy.device();
        let b = self.rows.len() as i64;
        let cache = self.cache.as_mut().expect("rows have a cache");
        let slot = cache.len;
        assert!(
            slot < self.capacity,
            "cache slot {slot} beyond the reserved capacity {}",
            self.capacity
        );
        let starts: Vec<i64> = self.rows.iter().map(|r| r.start).collect();
        let starts = Tensor::from_slice(&starts).to_device(device).unsqueeze(1);
        let positions = (-&starts + slot).view([b, 1]);
        let mask = Tensor::arange(slot + 1, (Kind::Int64, device))
            .unsqueeze(0)
            .ge_tensor(&starts)
            .view([b, 1, 1, slot + 1]);
        let ids = Tensor::from_slice(next).view([b, 1]).to_device(device);
        let hidden = self.policy.model.hidden_states(
            &ids,
            &positions,
            &AttnMask::Explicit(mask),
            Some(cache),
        );
        self.logits = Some(self.policy.model.logits(&hidden.squeeze_dim(1)));
    }
}

/// Turns the decoded text of a growing generation into safe increments, finding stop
/// strings (which may span tokens) and holding back what could still become one.
#[derive(Debug)]
struct StopText {
    stops: Vec<String>,
    /// Bytes of the text already handed out.
    emitted: usize,
}

impl StopText {
    fn new(stops: Vec<String>) -> Self {
        StopText {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            emitted: 0,
        }
    }

    /// Given the whole text so far, returns the new text that is final, and whether a stop
    /// string appeared (then the text ends just before it).
    fn advance(&mut self, text: &str) -> (String, bool) {
        let mut full = text.len();
        // An incomplete UTF-8 character decodes as U+FFFD until its last byte arrives, so
        // the trailing ones are neither final nor matched against stop strings.
        while text[..full].ends_with(char::REPLACEMENT_CHARACTER) {
            full -= char::REPLACEMENT_CHARACTER.len_utf8();
        }
        let settled = &text[..full];
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| settled.find(s.as_str()))
            .min()
        {
            return (self.take(text, at), true);
        }
        let mut safe = full;
        for s in &self.stops {
            if let Some(k) = (1..s.len())
                .rev()
                .find(|&k| s.is_char_boundary(k) && text[..full].ends_with(&s[..k]))
            {
                safe = safe.min(full - k);
            }
        }
        (self.take(text, safe), false)
    }

    /// Everything not yet handed out (at the end of the generation).
    fn flush(&mut self, text: &str) -> String {
        self.take(text, text.len())
    }

    fn take(&mut self, text: &str, end: usize) -> String {
        if end <= self.emitted || !text.is_char_boundary(self.emitted) {
            return String::new();
        }
        let out = text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::tiny_policy;
    use tch::Device;

    #[test]
    fn stop_text_holds_back_partial_matches() {
        let mut s = StopText::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(s.advance("hello E"), ("hello ".into(), false));
        assert_eq!(s.advance("hello EN"), ("".into(), false));
        // The partial match did not complete: it becomes text.
        assert_eq!(s.advance("hello ENx"), ("ENx".into(), false));
        assert_eq!(s.advance("hello ENx\n"), ("".into(), false));
        assert_eq!(s.advance("hello ENx\n\nmore"), ("".into(), true));
        let mut s = StopText::new(vec!["END".into()]);
        assert_eq!(s.advance("abENDcd"), ("ab".into(), true));
        // An unfinished character is held back until complete.
        let mut s = StopText::new(vec![]);
        assert_eq!(s.advance("caf\u{FFFD}"), ("caf".into(), false));
        assert_eq!(s.advance("café"), ("é".into(), false));
        assert_eq!(s.flush("café!"), "!");
    }

    fn tokenizer() -> ChatTokenizer {
        let corpus: Vec<String> = (0..30)
            .map(|i| format!("line {i}: the quick brown fox {i} jumps"))
            .collect();
        ChatTokenizer::train(&corpus, 300).unwrap()
    }

    /// A tiny model whose vocabulary covers the trained tokenizer, in the layout the
    /// engine decodes with (so references computed with it match to the bit).
    fn policy(seed: i64) -> Policy {
        let p = tiny_policy(seed);
        let mut c = p.config().clone();
        c.vocab_size = 300;
        let mut p = Policy::new(c, Device::Cpu, seed);
        p.use_decode_layout();
        p
    }

    fn greedy(n: usize) -> GenParams {
        GenParams {
            temperature: 0.0,
            max_new_tokens: n,
            ..GenParams::default()
        }
    }

    struct Reply {
        tokens: Vec<u32>,
        logprobs: Vec<f32>,
        text: String,
        done: DoneEvent,
    }

    fn collect(mut rx: mpsc::UnboundedReceiver<EngineEvent>) -> Reply {
        let mut r = Reply {
            tokens: vec![],
            logprobs: vec![],
            text: String::new(),
            done: DoneEvent {
                finish: FinishReason::Length,
                text: String::new(),
                prompt_tokens: 0,
                completion_tokens: 0,
            },
        };
        while let Some(e) = rx.blocking_recv() {
            match e {
                EngineEvent::Prompt(_) => {}
                EngineEvent::Token(t) => {
                    r.tokens.push(t.id);
                    r.logprobs.push(t.logprob);
                    r.text.push_str(&t.text);
                }
                EngineEvent::Done(d) => {
                    r.text.push_str(&d.text);
                    r.done = d;
                    return r;
                }
            }
        }
        panic!("the engine dropped a request without finishing it");
    }

    fn request(
        prompt: Vec<u32>,
        params: GenParams,
    ) -> (EngineRequest, mpsc::UnboundedReceiver<EngineEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            EngineRequest {
                prompt,
                params,
                stop: vec![],
                top_logprobs: 0,
                prompt_logprobs: false,
                text: true,
                events: tx,
            },
            rx,
        )
    }

    #[test]
    fn prompt_logprobs_score_every_prompt_token_under_the_model() {
        let tok = tokenizer();
        let prompt: Vec<u32> = tok.render_prompt("s", "the quick brown fox jumps").unwrap();
        let reference = policy(4);
        let ids =
            Tensor::from_slice(&prompt.iter().map(|&t| t as i64).collect::<Vec<_>>()).unsqueeze(0);
        let logits = reference.forward(&ids, &ids.ones_like());
        let lp = logits.log_softmax(-1, Kind::Float);
        let want: Vec<f32> = (1..prompt.len())
            .map(|i| lp.double_value(&[0, i as i64 - 1, prompt[i] as i64]) as f32)
            .collect();
        let (handle, thread) = spawn_engine(policy(4), tok, EngineConfig::default());
        let (mut req, mut rx) = request(prompt.clone(), greedy(2));
        req.prompt_logprobs = true;
        handle.submit_blocking(req).unwrap();
        let Some(EngineEvent::Prompt(got)) = rx.blocking_recv() else {
            panic!("the prompt's log-probs come first");
        };
        assert_eq!(got.len(), prompt.len() - 1);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        assert_eq!(collect(rx).tokens.len(), 2, "and the completion follows");
        drop(handle);
        thread.join().unwrap();
    }

    #[test]
    fn engine_matches_generate_under_concurrent_joins() {
        // Requests of different lengths and budgets submitted at once and while others
        // decode: each gets what Policy::generate gives it alone.
        let tok = tokenizer();
        let prompts: Vec<Vec<u32>> = vec![
            tok.render_prompt("s", "the quick brown fox").unwrap(),
            tok.render_prompt("system text that is longer", "line 3: jumps")
                .unwrap(),
            vec![5, 6, 7],
            // Joins when the 3-token request leaves, while the others decode; the longest
            // prompt, so the rows already in the batch shift right to make room.
            (40u32..200).collect(),
        ];
        assert!(prompts[..3].iter().all(|p| p.len() < prompts[3].len()));
        let params = [greedy(9), greedy(3), greedy(14), greedy(6)];
        let reference = policy(3);
        let want: Vec<_> = prompts
            .iter()
            .zip(&params)
            .map(|(p, g)| {
                reference.generate(std::slice::from_ref(p), std::slice::from_ref(g))[0].clone()
            })
            .collect();
        let (handle, thread) = spawn_engine(
            policy(3),
            tok,
            EngineConfig {
                max_batch: 3,
                max_cached_tokens: 4096,
                queue: 8,
                ..Default::default()
            },
        );
        let mut rxs = Vec::new();
        for (p, g) in prompts.iter().zip(&params) {
            let (req, rx) = request(p.clone(), g.clone());
            handle.submit_blocking(req).unwrap();
            rxs.push(rx);
        }
        for (i, rx) in rxs.into_iter().enumerate() {
            let got = collect(rx);
            assert_eq!(got.tokens, want[i].tokens, "request {i}");
            for (a, b) in got.logprobs.iter().zip(&want[i].logprobs) {
                assert!((a - b).abs() < 1e-4, "request {i}: {a} vs {b}");
            }
            assert_eq!(got.done.completion_tokens, params[i].max_new_tokens);
            assert_eq!(got.done.prompt_tokens, prompts[i].len());
        }
        drop(handle);
        thread.join().unwrap();
    }

    #[test]
    fn a_weight_swap_waits_for_running_rows_and_applies_to_later_ones() {
        let tok = tokenizer();
        let dir = tempfile::tempdir().unwrap();
        let new_weights = dir.path().join("v1.safetensors");
        policy(22).save_weights(&new_weights).unwrap();
        let prompt: Vec<u32> = (10..30).collect();
        let old = policy(21).generate(std::slice::from_ref(&prompt), &[greedy(24)])[0].clone();
        let new = policy(22).generate(std::slice::from_ref(&prompt), &[greedy(24)])[0].clone();
        assert_ne!(
            old.tokens, new.tokens,
            "the two models must differ for this test"
        );

        let (handle, thread) = spawn_engine(policy(21), tok, EngineConfig::default());
        // In this order on the channel: A, the swap, B. A was admitted first and must
        // finish under the old weights; B, queued behind the swap, runs under the new.
        let (a, rx_a) = request(prompt.clone(), greedy(24));
        let (b, rx_b) = request(prompt.clone(), greedy(24));
        let (reply, loaded) = tokio::sync::oneshot::channel();
        handle.tx.blocking_send(Msg::Request(a)).unwrap();
        handle
            .tx
            .blocking_send(Msg::Load {
                source: WeightsSource::Path(new_weights.clone()),
                reply,
            })
            .unwrap();
        handle.tx.blocking_send(Msg::Request(b)).unwrap();
        let got_a = collect(rx_a);
        assert_eq!(got_a.tokens, old.tokens);
        assert_eq!(got_a.logprobs, old.logprobs);
        loaded.blocking_recv().unwrap().unwrap();
        assert_eq!(collect(rx_b).tokens, new.tokens);

        // A file that is not weights: an error naming it, and the weights stay.
        let junk = dir.path().join("junk.safetensors");
        std::fs::write(&junk, b"not safetensors").unwrap();
        let err = handle.load_weights_blocking(&junk).unwrap_err().to_string();
        assert!(err.contains("junk.safetensors"), "{err}");
        let (c, rx_c) = request(prompt, greedy(24));
        handle.submit_blocking(c).unwrap();
        assert_eq!(collect(rx_c).tokens, new.tokens);
        drop(handle);
        thread.join().unwrap();
    }

    #[test]
    fn requests_without_text_get_the_same_tokens_and_no_text() {
        let tok = tokenizer();
        let prompt: Vec<u32> = (10..30).collect();
        let (handle, thread) = spawn_engine(policy(23), tok, EngineConfig::default());
        let (with, rx_with) = request(prompt.clone(), greedy(16));
        let (mut without, rx_without) = request(prompt, greedy(16));
        without.text = false;
        handle.submit_blocking(with).unwrap();
        handle.submit_blocking(without).unwrap();
        let (with, without) = (collect(rx_with), collect(rx_without));
        assert_eq!(with.tokens, without.tokens);
        assert!(!with.text.is_empty());
        assert_eq!(without.text, "");
        drop(handle);
        thread.join().unwrap();
    }

    #[test]
    fn over_budget_requests_wait_instead_of_failing() {
        // Room for one 40-token request at a time: the second waits for the first.
        let tok = tokenizer();
        let reference = policy(4);
        let prompt: Vec<u32> = (10..30).collect();
        let want = reference.generate(std::slice::from_ref(&prompt), &[greedy(20)])[0].clone();
        let (handle, thread) = spawn_engine(
            policy(4),
            tok,
            EngineConfig {
                max_batch: 4,
                max_cached_tokens: 50,
                queue: 4,
                ..Default::default()
            },
        );
        let (a, rx_a) = request(prompt.clone(), greedy(20));
        let (b, rx_b) = request(prompt.clone(), greedy(20));
        handle.submit_blocking(a).unwrap();
        handle.submit_blocking(b).unwrap();
        assert_eq!(collect(rx_a).tokens, want.tokens);
        assert_eq!(collect(rx_b).tokens, want.tokens);
        let (c, _rx) = request(prompt.clone(), greedy(40));
        assert_eq!(
            handle.submit_blocking(c).unwrap_err(),
            RequestError::OverBudget {
                prompt: 20,
                max_new: 40,
                budget: 50
            }
        );
        let (d, _rx) = request(prompt, greedy(300));
        assert!(matches!(
            handle.submit_blocking(d).unwrap_err(),
            RequestError::TooLongForContext { context: 256, .. }
        ));
        drop(handle);
        thread.join().unwrap();
    }

    #[test]
    fn stop_strings_end_the_text_before_them() {
        let tok = tokenizer();
        let (handle, thread) = spawn_engine(policy(5), tok.clone(), EngineConfig::default());
        let prompt = tok.render_prompt("s", "u").unwrap();
        let (free, rx) = request(prompt.clone(), greedy(30));
        handle.submit_blocking(free).unwrap();
        let free = collect(rx);
        assert_eq!(free.text, tok.decode(&free.tokens));
        // Pick a stop string from the middle of the free text.
        let chars: Vec<char> = free.text.chars().collect();
        assert!(chars.len() >= 8, "{:?}", free.text);
        let stop: String = chars[5..7].iter().collect();
        let cut = free.text.find(&stop).unwrap();
        let (mut req, rx) = request(prompt, greedy(30));
        req.stop = vec![stop.clone()];
        handle.submit_blocking(req).unwrap();
        let stopped = collect(rx);
        assert_eq!(stopped.text, free.text[..cut], "stop {stop:?}");
        assert_eq!(stopped.done.finish, FinishReason::Stop);
        assert!(stopped.tokens.len() < free.tokens.len());
        assert_eq!(stopped.tokens[..], free.tokens[..stopped.tokens.len()]);
        drop(handle);
        thread.join().unwrap();
    }

    #[test]
    fn a_client_that_leaves_frees_its_row() {
        let tok = tokenizer();
        let (handle, thread) = spawn_engine(
            policy(6),
            tok,
            EngineConfig {
                max_batch: 1,
                max_cached_tokens: 4096,
                queue: 4,
                ..Default::default()
            },
        );
        let (a, rx_a) = request(vec![3, 4, 5], greedy(200));
        handle.submit_blocking(a).unwrap();
        drop(rx_a);
        // With one row, this completes only if the abandoned request left the batch.
        let (b, rx_b) = request(vec![3, 4, 5], greedy(5));
        handle.submit_blocking(b).unwrap();
        assert_eq!(collect(rx_b).tokens.len(), 5);
        drop(handle);
        thread.join().unwrap();
    }

    /// An agent's next turn: its prompt is the previous prompt, the reply and an
    /// observation. With the prefix cache the engine prefills only the tokens after the
    /// previous context it kept, and the turn's tokens and log-probs are those of a full
    /// prefill (an engine without the cache, and `Policy::generate`).
    #[test]
    fn a_next_turn_prefills_only_its_new_tokens_with_the_same_logprobs() {
        let tok = tokenizer();
        let first: Vec<u32> = tok
            .render_prompt("s", "line 3: the quick brown fox")
            .unwrap();
        let cached = EngineConfig {
            prefix_cache_tokens: 4096,
            ..Default::default()
        };
        let plain = EngineConfig {
            prefix_cache_tokens: 0,
            ..Default::default()
        };
        let (on, on_thread) = spawn_engine(policy(5), tok.clone(), cached);
        let (off, off_thread) = spawn_engine(policy(5), tok.clone(), plain);
        let run = |h: &EngineHandle, prompt: &[u32], n: usize| {
            let (req, rx) = request(prompt.to_vec(), greedy(n));
            h.submit_blocking(req).unwrap();
            collect(rx)
        };
        let reply = run(&on, &first, 6);
        assert_eq!(run(&off, &first, 6).tokens, reply.tokens);
        let mut second = first.clone();
        second.extend(&reply.tokens);
        second.extend(tok.render_prompt("", "line 7: jumps").unwrap());
        let before = on.prefix_stats();
        let got = run(&on, &second, 8);
        let after = on.prefix_stats();
        let want = run(&off, &second, 8);
        let reference = policy(5).generate(std::slice::from_ref(&second), &[greedy(8)])[0].clone();
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(got.tokens, reference.tokens);
        for (a, b) in got.logprobs.iter().zip(&want.logprobs) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        // Kept: the first prompt and every reply token but the last (never fed).
        let kept = first.len() + reply.tokens.len() - 1;
        assert_eq!(after.reused_tokens - before.reused_tokens, kept as u64);
        assert_eq!(
            after.prefilled_tokens - before.prefilled_tokens,
            (second.len() - kept) as u64
        );
        assert_eq!((after.hits - before.hits, after.requests), (1, 2));
        assert_eq!(off.prefix_stats().reused_tokens, 0);
        assert_eq!(
            off.prefix_stats().prefilled_tokens,
            (first.len() + second.len()) as u64
        );

        // New weights: nothing of the old ones is reused.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.safetensors");
        policy(6).save_weights(&path).unwrap();
        on.load_weights_blocking(&path).unwrap();
        let reused = on.prefix_stats().reused_tokens;
        let third = run(&on, &second, 8);
        assert_eq!(
            on.prefix_stats().reused_tokens,
            reused,
            "the cache was emptied"
        );
        assert_eq!(on.prefix_stats().cached_tokens, (second.len() + 7) as u64);
        let new_reference =
            policy(6).generate(std::slice::from_ref(&second), &[greedy(8)])[0].clone();
        assert_eq!(third.tokens, new_reference.tokens);
        drop((on, off));
        on_thread.join().unwrap();
        off_thread.join().unwrap();
    }
}
