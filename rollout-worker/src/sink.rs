//! Delivering episode events to the coordinator at least once: each event is kept until
//! its ack (sent after the coordinator's durable write) and replayed on a new stream
//! when one breaks. An event is made to fit under `tutor_proto::MAX_EVENT_BYTES` before
//! it is sent, and one the coordinator refuses (its ack says why) is dropped, so no
//! single event can wedge the stream by being replayed first on every reconnect.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tutor_proto::auth::AuthChannel;
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::{episode_event, EpisodeEvent, OutcomeStatus, MAX_EVENT_BYTES};

/// Longest text a turn keeps of each of its observation, teacher and student texts
/// when the turn would otherwise be over [`MAX_EVENT_BYTES`] (the tokens, which are what
/// is trained on, are kept whole).
const CUT_TEXT_BYTES: usize = 64 * 1024;

/// Events the sink gave up on, for the worker's logs and tests.
#[derive(Debug, Default)]
pub struct SinkCounters {
    /// Events too large to send even after shrinking: dropped before sending.
    pub dropped: AtomicU64,
    /// Events the coordinator acknowledged as refused: dropped, not replayed.
    pub refused: AtomicU64,
}

/// Who a worker is to the coordinator: the id and secret its Register answer gave it.
#[derive(Clone)]
pub struct WorkerIdentity {
    pub worker_id: String,
    pub secret: String,
}

impl WorkerIdentity {
    /// `request` carrying this identity in its metadata.
    fn attach<T>(&self, mut request: tonic::Request<T>) -> tonic::Request<T> {
        for (key, value) in [
            (tutor_proto::WORKER_ID_METADATA, &self.worker_id),
            (tutor_proto::WORKER_SECRET_METADATA, &self.secret),
        ] {
            match value.parse() {
                Ok(v) => {
                    request.metadata_mut().insert(key, v);
                }
                Err(_) => tracing::error!(key, "the worker identity cannot travel as metadata"),
            }
        }
        request
    }
}

/// The sending side of the worker's event stream.
pub struct EventSink {
    pub events: mpsc::Sender<EpisodeEvent>,
    flush: mpsc::Sender<oneshot::Sender<()>>,
    pub counters: Arc<SinkCounters>,
}

impl EventSink {
    /// Starts the task that streams events to the coordinator through `client`, as
    /// `worker`: the worker id and secret of its Register answer, which the coordinator
    /// requires for the events of the episodes it leased to this worker.
    pub fn spawn(client: RolloutClient<AuthChannel>, worker: Option<WorkerIdentity>) -> Self {
        let (events, rx) = mpsc::channel(256);
        let (flush, flush_rx) = mpsc::channel(4);
        let counters = Arc::new(SinkCounters::default());
        tokio::spawn(sink_loop(client, worker, rx, flush_rx, counters.clone()));
        Self {
            events,
            flush,
            counters,
        }
    }

    /// Waits until every event sent so far is acknowledged (or dropped as refused), at
    /// most `timeout`; false (and an error logged) if some are still unacknowledged.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.flush.send(tx).await.is_err() {
            return false;
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(())) => true,
            _ => {
                tracing::error!("events still unacknowledged after {timeout:?}: they may be lost");
                false
            }
        }
    }
}

/// `ev` shrunk to fit under [`MAX_EVENT_BYTES`]: an outcome loses its patch (its status
/// becomes `PATCH_TOO_LARGE`, which is never graded as solved), a turn has its texts cut.
/// `Err` says why it still does not fit.
pub fn fit_event(mut ev: EpisodeEvent) -> Result<EpisodeEvent, String> {
    let size = ev.encoded_len();
    if size <= MAX_EVENT_BYTES {
        return Ok(ev);
    }
    match ev.event.as_mut() {
        Some(episode_event::Event::Outcome(o)) => {
            let patch = std::mem::take(&mut o.patch);
            o.status = OutcomeStatus::PatchTooLarge as i32;
            o.error = format!(
                "the outcome was {size} bytes, over the {MAX_EVENT_BYTES} an event may be; its \
                 patch ({} bytes) was left out. {}",
                patch.len(),
                cut(&o.error, CUT_TEXT_BYTES)
            );
            if ev.encoded_len() > MAX_EVENT_BYTES {
                if let Some(episode_event::Event::Outcome(o)) = ev.event.as_mut() {
                    o.test_statuses.clear();
                }
            }
        }
        Some(episode_event::Event::Turn(t)) => {
            for text in [
                &mut t.observation,
                &mut t.teacher_text,
                &mut t.student_text,
                &mut t.command,
            ] {
                *text = cut(text, CUT_TEXT_BYTES);
            }
        }
        // The coordinator's own record, never sent by a worker; nothing to cut.
        Some(episode_event::Event::LeaseExpired(_) | episode_event::Event::LeaseGranted(_))
        | None => {}
    }
    let now = ev.encoded_len();
    if now <= MAX_EVENT_BYTES {
        tracing::warn!(episode = %ev.episode_id, from = size, to = now, "an event over MAX_EVENT_BYTES was shrunk before sending");
        Ok(ev)
    } else {
        Err(format!(
            "the event is {now} bytes even with its patch and texts cut, over the \
             {MAX_EVENT_BYTES} an event may be"
        ))
    }
}

/// The first `max` bytes of `s` (on a character boundary) and a note of what was cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n[... {} bytes cut]", &s[..end], s.len() - end)
}

async fn sink_loop(
    mut client: RolloutClient<AuthChannel>,
    worker: Option<WorkerIdentity>,
    mut events: mpsc::Receiver<EpisodeEvent>,
    mut flush_rx: mpsc::Receiver<oneshot::Sender<()>>,
    counters: Arc<SinkCounters>,
) {
    let mut pending: BTreeMap<u64, EpisodeEvent> = BTreeMap::new();
    let mut seq_of: BTreeMap<(String, u32), u64> = BTreeMap::new();
    let mut next_seq = 0u64;
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    let mut events_open = true;
    loop {
        let (stx, srx) = mpsc::channel::<EpisodeEvent>(256);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(srx));
        if let Some(w) = &worker {
            request = w.attach(request);
        }
        let mut acks = match client.stream_events(request).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                tracing::warn!(%status, "event stream to the coordinator failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let mut ok = true;
        for ev in pending.values() {
            if stx.send(ev.clone()).await.is_err() {
                ok = false;
                break;
            }
        }
        while ok {
            if pending.is_empty() {
                for w in waiters.drain(..) {
                    let _ = w.send(());
                }
            }
            tokio::select! {
                // Events first: a flush must not be answered while events sent before it
                // still wait in the channel (it would report them delivered, and a worker
                // shutting down would exit without them).
                biased;
                ev = events.recv(), if events_open => match ev {
                    Some(ev) => {
                        let Some(key) = tutor_proto::event_key(&ev) else { continue };
                        let ev = match fit_event(ev) {
                            Ok(ev) => ev,
                            Err(why) => {
                                counters.dropped.fetch_add(1, Ordering::Relaxed);
                                tracing::error!(episode = %key.0, turn = key.1, %why, "event dropped before sending");
                                continue;
                            }
                        };
                        seq_of.insert(key, next_seq);
                        pending.insert(next_seq, ev.clone());
                        next_seq += 1;
                        if stx.send(ev).await.is_err() {
                            ok = false;
                        }
                    }
                    None => events_open = false,
                },
                w = flush_rx.recv() => match w {
                    Some(w) => waiters.push(w),
                    None => return,
                },
                ack = acks.message() => match ack {
                    Ok(Some(ack)) => {
                        if !ack.refused.is_empty() {
                            counters.refused.fetch_add(1, Ordering::Relaxed);
                            tracing::error!(episode = %ack.episode_id, turn = ack.turn_index, reason = %ack.refused, "the coordinator refused an event: dropped, not replayed");
                        }
                        if let Some(seq) = seq_of.remove(&(ack.episode_id, ack.turn_index)) {
                            pending.remove(&seq);
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::warn!(unacked = pending.len(), "event stream broke; reconnecting and replaying");
                        ok = false;
                    }
                },
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
