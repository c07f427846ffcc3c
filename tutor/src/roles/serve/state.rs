//! What `tutor serve`'s request handlers share: the server's state, the pause (vLLM's
//! `/pause`, which every generation route waits on), and the checked sampling parameters
//! of token-in/token-out requests (SGLang's `/generate`, vLLM's `/v1/completions`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tutor_policy::{ChatTokenizer, EngineHandle, GenParams, WeightsSource};

/// What every request handler shares.
pub(super) struct AppState {
    pub(super) engine: EngineHandle,
    /// Clients must send `Authorization: Bearer <key>` when set.
    pub(super) api_key: Option<String>,
    pub(super) tokenizer: ChatTokenizer,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) next_id: AtomicU64,
    /// The weight version served (`/generate` answers name it) and where it came from.
    /// `/generate` queues under its read lock, a reload swaps under its write lock: the
    /// version a `/generate` answer names is that of the weights it ran on.
    pub(super) weights: Arc<tokio::sync::RwLock<Weights>>,
    /// The same, for reads that must not wait for a reload (model info).
    pub(super) served: std::sync::Mutex<Weights>,
    /// Checkpoints clients may load (`--weights-root`, canonical); reloads are off without.
    pub(super) weights_root: Option<std::path::PathBuf>,
    /// Reloads so far (names a reload that names no version).
    pub(super) reloads: AtomicU64,
    /// Whether clients may send weights over the CPU collective (`--distributed-updates`).
    pub(super) distributed_updates: bool,
    /// The most bytes one update over the collective may announce.
    pub(super) max_update_bytes: usize,
    /// The model's parameters and their shapes: an update over the collective must
    /// announce each with its shape before anything is received.
    pub(super) parameter_shapes: std::collections::HashMap<String, Vec<usize>>,
    /// Weight-update groups by name.
    pub(super) update_groups: tokio::sync::Mutex<super::update_groups::UpdateGroups>,
    /// One update over a collective at a time, from its first byte to its swap: what
    /// updates hold in memory is one model's worth, however many clients send.
    pub(super) update_permit: tokio::sync::Semaphore,
    /// Until when generation is paused (vLLM's `/pause`, a lease `/resume` ends early):
    /// new requests wait for it.
    pub(super) paused: tokio::sync::watch::Sender<Option<tokio::time::Instant>>,
    /// Requests waiting for the resume now.
    pub(super) waiting: std::sync::atomic::AtomicUsize,
    /// Weight swaps so far: with the version, what `/weight_info` reports, so that a
    /// version loaded, replaced and loaded again between two reads shows.
    pub(super) swaps: AtomicU64,
    /// The weight transfer driven through vLLM's routes (`vllm.rs`); never locked across
    /// an await.
    pub(super) transfer: std::sync::Mutex<Transfer>,
}

/// What the served weights are: the version clients named when they loaded them
/// (`/update_weights_from_disk`), and where they came from.
#[derive(Clone)]
pub(super) struct Weights {
    pub(super) version: String,
    pub(super) path: String,
}

/// The weight transfer clients drive through vLLM's routes: the group formed by the last
/// init, and the update started and not finished.
#[derive(Default)]
pub(super) struct Transfer {
    pub(super) group: Option<String>,
    pub(super) started: Option<Started>,
}

pub(super) struct Started {
    /// The last call on this update.
    pub(super) last: Instant,
    /// Whether `/update_weights` is receiving over the group now.
    pub(super) receiving: bool,
    /// What `/update_weights` received or named, for `/finish_weight_update` to swap in,
    /// and where it came from.
    pub(super) staged: Option<(WeightsSource, String)>,
}

/// How long a pause holds without a resume (or another pause).
pub(super) const PAUSE_LEASE: Duration = Duration::from_secs(120);

/// Counts a request held by a pause while it waits (however its wait ends).
struct Held<'a>(&'a AppState);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits while the server is paused (`POST /pause`, until `/resume` or the pause's lease
/// ends): every generation route calls it before queueing a request.
pub(super) async fn unpaused(s: &AppState) {
    let mut rx = s.paused.subscribe();
    let mut held = None;
    loop {
        let Some(until) = *rx.borrow_and_update() else {
            return;
        };
        if tokio::time::Instant::now() >= until {
            tracing::warn!(
                lease_s = PAUSE_LEASE.as_secs(),
                "a pause was never resumed: its lease is over, requests run"
            );
            return;
        }
        if held.is_none() {
            s.waiting.fetch_add(1, Ordering::SeqCst);
            held = Some(Held(s));
        }
        tokio::select! {
            _ = rx.changed() => {}
            () = tokio::time::sleep_until(until) => {}
        }
    }
}

pub(super) fn paused_now(s: &AppState) -> bool {
    matches!(*s.paused.borrow(), Some(until) if tokio::time::Instant::now() < until)
}

/// What sampling parameters must be to be served: their neutral values (the
/// log-probabilities returned are those of the distribution sampled from).
pub(super) struct Neutral {
    pub(super) top_k: i64,
    pub(super) min_p: f32,
    pub(super) repetition_penalty: f32,
    pub(super) frequency_penalty: f32,
    pub(super) presence_penalty: f32,
    pub(super) min_new_tokens: usize,
}

/// The engine's parameters of a token-in/token-out request, checked (`prefix` names the
/// fields in errors): truncations and penalties at their neutral values only, temperature
/// in [0, 2], top-p in (0, 1]; the stop ids asked for, and the tokenizer's unless
/// `ignore_eos`; a random seed when none is given.
#[allow(clippy::too_many_arguments)]
pub(super) fn sampling(
    s: &AppState,
    prefix: &str,
    n: Neutral,
    temperature: f32,
    top_p: f32,
    max_new_tokens: usize,
    seed: Option<u64>,
    stop_token_ids: &[u32],
    ignore_eos: bool,
) -> Result<GenParams, String> {
    let vocab = s.engine.vocab() as i64;
    if !(n.top_k == -1 || n.top_k == 0 || n.top_k >= vocab)
        || n.min_p != 0.0
        || n.repetition_penalty != 1.0
        || n.frequency_penalty != 0.0
        || n.presence_penalty != 0.0
        || n.min_new_tokens != 0
    {
        return Err(format!(
            "{prefix}top_k, min_p, penalties and minimum tokens are served at their neutral \
             values only (the log-probabilities returned are those of the distribution sampled \
             from)"
        ));
    }
    if !(0.0..=2.0).contains(&temperature) {
        return Err(format!(
            "{prefix}temperature {temperature} is outside [0, 2]"
        ));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(format!("{prefix}top_p {top_p} is outside (0, 1]"));
    }
    let mut stops = stop_token_ids.to_vec();
    if !ignore_eos {
        stops.extend(s.tokenizer.stop_ids());
    }
    stops.sort_unstable();
    stops.dedup();
    Ok(GenParams {
        temperature,
        top_p,
        max_new_tokens,
        seed: seed.unwrap_or_else(rand::random::<u64>),
        stop_token_ids: stops,
    })
}
