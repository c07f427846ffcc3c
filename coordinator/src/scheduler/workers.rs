//! The worker registry: ids handed out at registration, when each worker was last heard
//! from, which policy version it has loaded, and forgetting the ones gone silent.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

/// How often workers heartbeat; a worker silent for three intervals counts as gone.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(1000);

struct WorkerInfo {
    name: String,
    last_seen: Instant,
    loaded: u64,
}

/// The key every worker's secret is derived from: `hex(HMAC-SHA256(key, worker id))`.
/// The run state keeps it (`RunState::worker_key`), so a coordinator restarted on the
/// run directory checks the secrets its predecessor handed out, and a worker registered
/// before the restart is told apart from anyone else presenting its id. (Before, a
/// restarted coordinator took the first secret presented for such an id as its own.)
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerKey([u8; 32]);

impl std::fmt::Debug for WorkerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerKey(<redacted>)")
    }
}

impl Default for WorkerKey {
    /// A new random key (a fresh run; tests).
    fn default() -> Self {
        let mut bytes = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut bytes);
        Self(bytes)
    }
}

impl WorkerKey {
    /// The key from its hex form in the run state; `None` unless 64 hex digits.
    pub fn from_hex(text: &str) -> Option<Self> {
        let bytes = hex::decode(text).ok()?;
        Some(Self(bytes.try_into().ok()?))
    }

    /// The hex form the run state keeps. A secret: never log it.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The secret of `worker_id`.
    fn secret_for(&self, worker_id: &str) -> String {
        use hmac::Mac;
        let mut mac = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.0)
            .expect("HMAC takes a key of any length");
        mac.update(b"tutor worker secret v1: ");
        mac.update(worker_id.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }
}

/// Registered workers by id.
pub struct Workers {
    by_id: HashMap<String, WorkerInfo>,
    next: u32,
    /// The coordinator's generation, part of every id so ids stay unique across restarts.
    generation: u64,
    key: WorkerKey,
}

impl Workers {
    pub fn new(generation: u64, key: WorkerKey) -> Self {
        Self {
            by_id: HashMap::new(),
            next: 0,
            generation,
            key,
        }
    }

    /// Registers a worker and returns its id and secret (see [`WorkerKey`]).
    pub fn register(&mut self, name: String, capacity: u32) -> (String, String) {
        let id = format!("{name}-g{}-{}", self.generation, self.next);
        self.next += 1;
        let secret = self.key.secret_for(&id);
        tracing::info!(worker = %id, capacity, "worker registered");
        self.by_id.insert(
            id.clone(),
            WorkerInfo {
                name,
                last_seen: Instant::now(),
                // Nothing loaded yet.
                loaded: u64::MAX,
            },
        );
        (id, secret)
    }

    /// Whether `secret` proves `worker_id` (constant-time): the secret the run's key gives
    /// its id. Only the coordinators of this run can make one, so a worker registered
    /// before a restart is proven (and known again from then on) by its first event,
    /// even when it comes before the worker's first heartbeat.
    pub fn authenticate(&mut self, worker_id: &str, secret: &str) -> bool {
        use subtle::ConstantTimeEq;
        let want = self.key.secret_for(worker_id);
        let proven = bool::from(want.as_bytes().ct_eq(secret.as_bytes()));
        if proven && !self.by_id.contains_key(worker_id) {
            self.seen(worker_id);
        }
        proven
    }

    /// A lease request from `worker_id`: it is alive. A worker this coordinator does not
    /// know (registered before a restart) is registered under the id it sends, as a
    /// heartbeat does, so that its event stream can prove it.
    pub fn seen(&mut self, worker_id: &str) {
        if let Some(w) = self.by_id.get_mut(worker_id) {
            w.last_seen = Instant::now();
        } else {
            tracing::warn!(
                worker = worker_id,
                "lease request from an unknown worker: registering it"
            );
            self.by_id.insert(
                worker_id.to_string(),
                WorkerInfo {
                    name: worker_id.to_string(),
                    last_seen: Instant::now(),
                    loaded: u64::MAX,
                },
            );
        }
    }

    /// A heartbeat from `worker_id` with the version it has loaded. A worker this
    /// coordinator does not know (registered before a restart, or forgotten) is
    /// registered under the id it sends.
    pub fn heartbeat(&mut self, worker_id: &str, loaded: u64) {
        match self.by_id.get_mut(worker_id) {
            Some(w) => {
                w.last_seen = Instant::now();
                w.loaded = loaded;
            }
            None => {
                tracing::warn!(
                    worker = worker_id,
                    "heartbeat from an unknown worker: registering it"
                );
                self.by_id.insert(
                    worker_id.to_string(),
                    WorkerInfo {
                        name: worker_id.to_string(),
                        last_seen: Instant::now(),
                        loaded,
                    },
                );
            }
        }
    }

    /// Workers heard from within three heartbeat intervals.
    fn live(&self) -> impl Iterator<Item = (&String, &WorkerInfo)> {
        let live = HEARTBEAT_INTERVAL * 3;
        self.by_id
            .iter()
            .filter(move |(_, w)| w.last_seen.elapsed() < live)
    }

    pub fn live_ids(&self) -> HashSet<&String> {
        self.live().map(|(id, _)| id).collect()
    }

    pub fn live_count(&self) -> usize {
        self.live().count()
    }

    /// The loaded policy version of every live worker.
    pub fn live_versions(&self) -> BTreeMap<String, u64> {
        self.live().map(|(id, w)| (id.clone(), w.loaded)).collect()
    }

    /// Forgets workers silent for thirty heartbeat intervals.
    pub fn forget_silent(&mut self) {
        let live = HEARTBEAT_INTERVAL * 30;
        self.by_id.retain(|id, w| {
            let keep = w.last_seen.elapsed() < live;
            if !keep {
                tracing::warn!(worker = %id, name = %w.name, "worker silent: forgotten");
            }
            keep
        });
    }
}
