//! vLLM's weight-transfer control plane in `tutor serve` (the routes vLLM serves with
//! `VLLM_SERVER_DEV_MODE=1`), so that rollout workers drive it as they drive vLLM
//! (`[worker.student] api = "vllm"`); the turns themselves go to `/v1/completions`
//! (openai.rs), which takes vLLM's token-in/token-out fields.
//!
//! - `GET /weight_info`: the weight version served, and Tutor's `weight_generation`, the
//!   number of swaps so far (a version loaded, replaced and loaded again shows). Read under
//!   the version's lock, so a reload in progress is waited for: a request queued after a
//!   swap is never reported under the version before it.
//! - `POST /pause` (`mode=wait`, the default here: running requests finish; vLLM's
//!   `abort` and `keep` are refused), `POST /resume`, `GET /is_paused` (and Tutor's
//!   `waiting`: requests held). While paused, new generation requests (every route) wait
//!   for the resume. Unlike vLLM's, a pause here is a lease of `PAUSE_LEASE`: a client
//!   that died between its pause and its resume does not stop the server for good.
//! - `POST /init_weight_transfer_engine {init_info}`: with `master_address`,
//!   `master_port`, `rank_offset`, `world_size` (and Tutor's `backend: "tutor-cpu"`,
//!   `group_name`), joins the client's group over Tutor's CPU collective (with
//!   `--distributed-updates`); with no address, readies loads from disk (vLLM's `disk`
//!   backend; with `--weights-root`). One group at a time: a new one replaces it.
//! - `POST /start_weight_update`, `POST /update_weights {update_info}` (`path`: a
//!   checkpoint inside `--weights-root`; or `names`, `dtype_names`, `shapes`: tensors
//!   received over the group, which is then closed), `POST /finish_weight_update
//!   {weight_version}`. The weights are staged by the update and swapped in by the finish,
//!   under the version it names, so no request ever runs on new weights under the old
//!   name. A checkpoint that does not fit is refused at the finish with the old weights
//!   kept; an update refused, or whose client went away while it was received, ends the
//!   transfer and closes its group (the client's sends fail at once). One update at a
//!   time: an init or a start while another update is under way is refused (409) until
//!   that one has been idle for `STALE_TRANSFER` (never while it receives), and an update
//!   naming a group (Tutor's `group_name`) that another client's init replaced is refused
//!   (409): clients retry (vLLM's control plane is meant for one trainer; several
//!   workers share a `tutor serve` this way).
//! - `GET /get_world_size`: 1.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tutor_policy::WeightsSource;

use super::native::{checkpoint_in_root, error, join_group, receive_update, swap, InitGroup};
use super::state::{paused_now, AppState, Started, Transfer, PAUSE_LEASE};

/// An update under way that has been idle (not receiving) this long may be taken over
/// by another client (its client crashed, or its finish was lost). Shorter than a
/// worker's reload deadline, so that waiting workers get their turn.
const STALE_TRANSFER: Duration = Duration::from_secs(60);

impl Transfer {
    /// The answer refusing another client's init or start while an update is under way;
    /// None when there is none (or it went stale, then it is dropped).
    fn busy(&mut self) -> Option<Response> {
        let started = self.started.as_ref()?;
        let idle = started.last.elapsed();
        if started.receiving || idle < STALE_TRANSFER {
            tracing::info!("refused another client's weight update: one is under way");
            return Some(error(
                StatusCode::CONFLICT,
                format!(
                    "a weight update is under way (its last call {:.0} s ago): one update at a \
                     time (POST /finish_weight_update ends it)",
                    idle.as_secs_f64()
                ),
            ));
        }
        tracing::warn!(
            idle_s = idle.as_secs_f64(),
            "a weight update was never finished: a new one takes over"
        );
        self.started = None;
        None
    }
}

/// The control plane's routes, for [`super::openai::router`] to put behind the API key.
pub(super) fn routes() -> axum::Router<Arc<AppState>> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/weight_info", get(weight_info))
        .route(
            "/get_world_size",
            get(|| async { Json(json!({"world_size": 1})) }),
        )
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/init_weight_transfer_engine", post(init_transfer))
        .route("/start_weight_update", post(start_update))
        .route("/update_weights", post(update_weights))
        .route("/finish_weight_update", post(finish_update))
}

async fn weight_info(State(s): State<Arc<AppState>>) -> Json<Value> {
    let w = s.weights.read().await;
    Json(json!({
        "weight_version": w.version,
        "weight_generation": s.swaps.load(Ordering::SeqCst),
    }))
}

async fn pause(State(s): State<Arc<AppState>>, uri: Uri) -> Response {
    let mode = uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("mode="));
    match mode {
        None | Some("wait") => {}
        Some(other) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "mode={other}: tutor serve pauses with mode=wait only (running requests \
                     finish on the weights they started on; new ones wait for the resume)"
                ),
            )
        }
    }
    s.paused
        .send_replace(Some(tokio::time::Instant::now() + PAUSE_LEASE));
    tracing::info!(
        lease_s = PAUSE_LEASE.as_secs(),
        "paused: new generation requests wait for the resume"
    );
    Json(json!({"status": "paused"})).into_response()
}

async fn resume(State(s): State<Arc<AppState>>) -> Json<Value> {
    if s.paused.send_replace(None).is_some() {
        tracing::info!("resumed");
    }
    Json(json!({"status": "resumed"}))
}

async fn is_paused(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "is_paused": paused_now(&s),
        "waiting": s.waiting.load(Ordering::SeqCst),
    }))
}

/// A route's body, parsed; the refusing answer otherwise.
fn body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Box<Response>> {
    let body: &[u8] = if body.is_empty() { b"{}" } else { body };
    serde_json::from_slice(body).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}"),
        ))
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InitTransfer {
    #[serde(default)]
    init_info: serde_json::Map<String, Value>,
}

async fn init_transfer(State(s): State<Arc<AppState>>, raw: Bytes) -> Response {
    let req: InitTransfer = match body(&raw) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    if !req.init_info.contains_key("master_address") {
        // vLLM's `disk` backend: updates name a checkpoint.
        if s.weights_root.is_none() {
            return error(
                StatusCode::FORBIDDEN,
                "weight reloads from disk are off: start tutor serve with --weights-root DIR, \
                 the directory whose checkpoints clients may load",
            );
        }
        return Json(json!({"message": "Weight transfer initialized"})).into_response();
    }
    if !s.distributed_updates {
        return error(
            StatusCode::FORBIDDEN,
            "weight updates over a collective are off: start tutor serve with \
             --distributed-updates to take them",
        );
    }
    let group: InitGroup = match serde_json::from_value(Value::Object(req.init_info)) {
        Ok(g) => g,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("init_info: {e}")),
    };
    let name = group.group_name.clone();
    if let Some(refused) = s.transfer.lock().expect("transfer").busy() {
        return refused;
    }
    if let Err(refused) = join_group(&s, group).await {
        return *refused;
    }
    // One group at a time: this one replaces the last, unless an update started
    // meanwhile (then this one is closed).
    let closed = {
        let mut transfer = s.transfer.lock().expect("transfer");
        match transfer.busy() {
            Some(refused) => Err((name.clone(), refused)),
            None => Ok(transfer.group.replace(name)),
        }
    };
    match closed {
        Ok(previous) => {
            if let Some(previous) = previous {
                s.update_groups.lock().await.destroy(&previous);
            }
            Json(json!({"message": "Weight transfer initialized"})).into_response()
        }
        Err((own, refused)) => {
            s.update_groups.lock().await.destroy(&own);
            refused
        }
    }
}

async fn start_update(State(s): State<Arc<AppState>>) -> Response {
    let mut transfer = s.transfer.lock().expect("transfer");
    if let Some(refused) = transfer.busy() {
        return refused;
    }
    transfer.started = Some(Started {
        last: Instant::now(),
        receiving: false,
        staged: None,
    });
    Json(json!({"message": "Weight update started"})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateWeights {
    update_info: UpdateInfo,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateInfo {
    /// `disk`: the checkpoint to load.
    path: Option<String>,
    /// Over the group: the tensors, in the order they are sent.
    #[serde(default)]
    names: Vec<String>,
    #[serde(default)]
    dtype_names: Vec<String>,
    #[serde(default)]
    shapes: Vec<Vec<usize>>,
    /// vLLM's packed transfers are not spoken here.
    #[serde(default)]
    packed: bool,
    /// Tutor's extension: the group the client formed; refused when another client's
    /// init replaced it since.
    group_name: Option<String>,
}

/// Ends the update under way while `/update_weights` receives, unless disarmed: a
/// client that goes away mid-update does not leave it started.
struct Receiving {
    s: Arc<AppState>,
    armed: bool,
}

impl Drop for Receiving {
    fn drop(&mut self) {
        if self.armed {
            self.s.transfer.lock().expect("transfer").started = None;
        }
    }
}

/// Ends the update under way (and closes the groups named, so that a client sending
/// over one fails at once): the answer `refused` goes back.
async fn abandon(s: &AppState, groups: &[Option<&str>], refused: Response) -> Response {
    s.transfer.lock().expect("transfer").started = None;
    let mut update_groups = s.update_groups.lock().await;
    for g in groups.iter().flatten() {
        update_groups.destroy(g);
    }
    refused
}

async fn update_weights(State(s): State<Arc<AppState>>, raw: Bytes) -> Response {
    let req: UpdateWeights = match body(&raw) {
        Ok(r) => r,
        Err(refused) => {
            let group = s.transfer.lock().expect("transfer").group.clone();
            return abandon(&s, &[group.as_deref()], *refused).await;
        }
    };
    let info = req.update_info;
    let named = info.group_name.as_deref();
    let group = {
        let mut transfer = s.transfer.lock().expect("transfer");
        transfer
            .started
            .as_mut()
            .map(|started| {
                started.last = Instant::now();
            })
            .map(|()| transfer.group.clone())
    };
    let Some(group) = group else {
        let refused = error(
            StatusCode::BAD_REQUEST,
            "no weight update is started: POST /start_weight_update first",
        );
        return abandon(&s, &[named], refused).await;
    };
    let staged = if let Some(path) = info.path {
        match checkpoint_in_root(&s, "update_info.path", &path) {
            Ok(p) => (WeightsSource::Path(p), path),
            Err(refused) => return abandon(&s, &[], *refused).await,
        }
    } else {
        if info.packed {
            let refused = error(
                StatusCode::BAD_REQUEST,
                "update_info.packed: packed transfers are not served; send tensors one by one",
            );
            return abandon(&s, &[named, group.as_deref()], refused).await;
        }
        let Some(group) = group else {
            let refused = error(
                StatusCode::BAD_REQUEST,
                "no weight-transfer group: POST /init_weight_transfer_engine with init_info's \
                 master_address first (or name a checkpoint: update_info.path)",
            );
            return abandon(&s, &[named], refused).await;
        };
        if let Some(named) = named.filter(|n| *n != group) {
            let refused = error(
                StatusCode::CONFLICT,
                format!(
                    "group {named:?} was replaced by another client's (POST \
                     /init_weight_transfer_engine): form it again"
                ),
            );
            return abandon(&s, &[Some(named)], refused).await;
        }
        let mut receiving = Receiving {
            s: s.clone(),
            armed: true,
        };
        if let Some(started) = s.transfer.lock().expect("transfer").started.as_mut() {
            started.receiving = true;
        }
        // One update over a collective at a time, while it receives.
        let Ok(_permit) = s.update_permit.acquire().await else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping");
        };
        let received = receive_update(
            &s,
            &group,
            info.names,
            info.dtype_names,
            info.shapes,
            "(vLLM update)",
        )
        .await;
        // One update per group: it is closed whatever happened.
        s.update_groups.lock().await.destroy(&group);
        {
            let mut transfer = s.transfer.lock().expect("transfer");
            if transfer.group.as_deref() == Some(group.as_str()) {
                transfer.group = None;
            }
        }
        match received {
            Ok(source) => {
                receiving.armed = false;
                (source, format!("group {group}"))
            }
            // The guard ends the update.
            Err(refused) => return *refused,
        }
    };
    let mut transfer = s.transfer.lock().expect("transfer");
    match transfer.started.as_mut() {
        Some(started) => {
            started.staged = Some(staged);
            started.receiving = false;
            started.last = Instant::now();
        }
        None => {
            return error(
                StatusCode::CONFLICT,
                "the weight update ended while this one was received (taken over by another \
                 client)",
            )
        }
    }
    Json(json!({"message": "Weights updated"})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FinishUpdate {
    weight_version: Option<String>,
}

async fn finish_update(State(s): State<Arc<AppState>>, raw: Bytes) -> Response {
    let req: FinishUpdate = match body(&raw) {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    let started = s.transfer.lock().expect("transfer").started.take();
    let Some((source, origin)) = started.and_then(|st| st.staged) else {
        return error(
            StatusCode::BAD_REQUEST,
            "no weights were updated: POST /start_weight_update and /update_weights first",
        );
    };
    let n = s.reloads.fetch_add(1, Ordering::SeqCst) + 1;
    let label = req.weight_version.unwrap_or_else(|| format!("reload-{n}"));
    swap(&s, source, label, origin, n).await
}
