//! The run's event log for `Control.WatchRun` watchers and the metrics endpoint: live
//! progress broadcast, iteration summaries and the end of the run kept for late watchers.

use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use tutor_proto::{run_event, RunEvent};

/// Run events for watchers. Iteration summaries and the final event are kept, so a
/// watcher that connects late still sees the whole table.
#[derive(Clone)]
pub struct EventLog {
    tx: broadcast::Sender<RunEvent>,
    kept: Arc<Mutex<Vec<RunEvent>>>,
}

impl Default for EventLog {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(1024).0,
            kept: Default::default(),
        }
    }
}

impl EventLog {
    /// Sends `ev` to every watcher. Iteration summaries and the end of the run are kept
    /// for later watchers; an iteration's summary is published once (a coordinator
    /// restarted between its metrics row and its state save finishes the iteration
    /// again, and the reloaded summary already stands for it).
    pub fn publish(&self, ev: RunEvent) {
        let mut kept = self.kept.lock().expect("event log lock");
        match &ev.event {
            Some(run_event::Event::Iteration(s)) => {
                let seen = kept.iter().any(|k| {
                    matches!(&k.event, Some(run_event::Event::Iteration(o)) if o.iteration == s.iteration)
                });
                if seen {
                    return;
                }
                kept.push(ev.clone());
            }
            Some(run_event::Event::Finished(_)) => kept.push(ev.clone()),
            _ => {}
        }
        let _ = self.tx.send(ev);
    }

    /// An event log holding the summaries of iterations finished before a restart
    /// (from metrics.jsonl), so a watcher sees the whole run.
    pub fn with_history(summaries: Vec<tutor_proto::IterationSummary>) -> Self {
        let log = Self::default();
        for s in summaries {
            log.publish(RunEvent {
                event: Some(run_event::Event::Iteration(s)),
            });
        }
        log
    }

    /// The newest iteration summary, if an iteration has finished.
    pub fn last_iteration(&self) -> Option<tutor_proto::IterationSummary> {
        let kept = self.kept.lock().expect("event log lock");
        kept.iter().rev().find_map(|e| match &e.event {
            Some(run_event::Event::Iteration(s)) => Some(*s),
            _ => None,
        })
    }

    /// The kept events and a receiver of every later one.
    pub fn subscribe(&self) -> (Vec<RunEvent>, broadcast::Receiver<RunEvent>) {
        let kept = self.kept.lock().expect("event log lock");
        (kept.clone(), self.tx.subscribe())
    }
}
