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
    /// What the worker proves its id with on its event stream; `None` for a worker
    /// known only from its heartbeats (registered with a coordinator before a restart):
    /// the first secret it presents is then taken as its own.
    secret: Option<String>,
}

/// Registered workers by id.
pub struct Workers {
    by_id: HashMap<String, WorkerInfo>,
    next: u32,
    /// The coordinator's generation, part of every id so ids stay unique across restarts.
    generation: u64,
}

impl Workers {
    pub fn new(generation: u64) -> Self {
        Self {
            by_id: HashMap::new(),
            next: 0,
            generation,
        }
    }

    /// Registers a worker and returns its id and secret (32 random bytes, hex).
    pub fn register(&mut self, name: String, capacity: u32) -> (String, String) {
        let id = format!("{name}-g{}-{}", self.generation, self.next);
        self.next += 1;
        let mut bytes = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut bytes);
        let secret = hex::encode(bytes);
        tracing::info!(worker = %id, capacity, "worker registered");
        self.by_id.insert(
            id.clone(),
            WorkerInfo {
                name,
                last_seen: Instant::now(),
                // Nothing loaded yet.
                loaded: u64::MAX,
                secret: Some(secret.clone()),
            },
        );
        (id, secret)
    }

    /// Whether `secret` proves `worker_id` (constant-time). A worker known only from
    /// its heartbeats (it registered before a restart) has no secret here yet: the
    /// first it presents becomes its own.
    pub fn authenticate(&mut self, worker_id: &str, secret: &str) -> bool {
        use subtle::ConstantTimeEq;
        let Some(w) = self.by_id.get_mut(worker_id) else {
            return false;
        };
        match &w.secret {
            Some(s) => bool::from(s.as_bytes().ct_eq(secret.as_bytes())),
            None if !secret.is_empty() => {
                tracing::info!(
                    worker = worker_id,
                    "worker from before a restart: its secret is taken as presented"
                );
                w.secret = Some(secret.to_string());
                true
            }
            None => false,
        }
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
                    secret: None,
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
                        secret: None,
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
