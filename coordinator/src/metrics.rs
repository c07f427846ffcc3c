//! The coordinator's Prometheus metrics: the event counters, everything the scheduler
//! owns read from its snapshot and the newest iteration's gauges, served as text at
//! `GET /metrics` (axum).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::header::{CONNECTION, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tutor_proto::auth::ServerAuth;

use crate::counters::EventCounters;
use crate::run_events::EventLog;
use crate::scheduler::{SchedulerHandle, SchedulerSnapshot};

/// What `/metrics` reads on each scrape.
#[derive(Clone)]
pub struct MetricsSource {
    pub scheduler: SchedulerHandle,
    pub events: Arc<EventCounters>,
    pub auth: ServerAuth,
    /// Iteration summaries (solve rates, training throughput, phase times).
    pub run_events: EventLog,
    /// Scrapes must carry `Authorization: Bearer <token>` (the run's token, which `auth`
    /// checks); others get 401 and are counted with the rejected gRPC calls.
    pub require_token: bool,
}

impl MetricsSource {
    async fn render(&self) -> String {
        let snapshot = self.scheduler.snapshot().await;
        let mut text = render(snapshot.as_ref(), &self.events, self.auth.rejected_count());
        if let Some(s) = self.run_events.last_iteration() {
            text.push_str(&render_iteration(&s));
        }
        text
    }
}

/// The Prometheus text exposition (format 0.0.4). Without a snapshot (the scheduler
/// has stopped) only the counters kept outside it are shown.
pub fn render(
    snapshot: Option<&SchedulerSnapshot>,
    events: &EventCounters,
    rejected: u64,
) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    metric(
        "tutor_coordinator_turns_ingested_total",
        "counter",
        "Turn events stored for the first time.",
        &[("", load(&events.turns_ingested))],
    );
    metric(
        "tutor_coordinator_outcomes_ingested_total",
        "counter",
        "Episode outcome events stored for the first time.",
        &[("", load(&events.outcomes_ingested))],
    );
    metric(
        "tutor_coordinator_duplicate_events_total",
        "counter",
        "Replayed events that were already stored (acknowledged, not stored again).",
        &[("", load(&events.duplicate_events))],
    );
    metric(
        "tutor_coordinator_refused_events_total",
        "counter",
        "Events refused with a reason in their ack (no payload, too large): never stored.",
        &[("", load(&events.refused_events))],
    );
    metric(
        "tutor_coordinator_store_commits_total",
        "counter",
        "Group commits of the trajectory store (one write and one fsync each).",
        &[("", load(&events.store_commits))],
    );
    metric(
        "tutor_coordinator_store_bytes_total",
        "counter",
        "Bytes appended to the trajectory store.",
        &[("", load(&events.store_bytes))],
    );
    metric(
        "tutor_coordinator_unauthenticated_requests_total",
        "counter",
        "gRPC calls rejected for a missing or wrong bearer token.",
        &[("", rejected)],
    );
    let Some(s) = snapshot else {
        return out;
    };
    metric(
        "tutor_coordinator_episodes_completed_total",
        "counter",
        "Episodes whose outcome counted for their iteration, by purpose.",
        &[
            ("{purpose=\"train\"}", s.train_episodes_completed_total),
            ("{purpose=\"eval\"}", s.eval_episodes_completed_total),
        ],
    );
    metric(
        "tutor_coordinator_lease_expiries_total",
        "counter",
        "Leases not renewed in time, whose episode went to another worker.",
        &[("", s.lease_expiries_total)],
    );
    metric(
        "tutor_coordinator_stale_episodes_total",
        "counter",
        "Training episodes not trained on: their policy version lagged the learner by more \
         than max_staleness (async mode).",
        &[("", s.stale_episodes_total)],
    );
    metric(
        "tutor_coordinator_draining",
        "gauge",
        "1 while the coordinator shuts down: no new leases.",
        &[("", s.draining as u64)],
    );
    metric(
        "tutor_coordinator_policy_version",
        "gauge",
        "The current policy version leased to workers.",
        &[("", s.policy_version)],
    );
    metric(
        "tutor_coordinator_iteration",
        "gauge",
        "The current DAgger iteration (0-based).",
        &[("", s.iteration as u64)],
    );
    metric(
        "tutor_coordinator_queue_depth",
        "gauge",
        "Episodes of the current iteration waiting for a lease.",
        &[("", s.pending_episodes)],
    );
    metric(
        "tutor_coordinator_outstanding_leases",
        "gauge",
        "Leased episodes not yet finished or expired.",
        &[("", s.outstanding_leases)],
    );
    metric(
        "tutor_coordinator_live_workers",
        "gauge",
        "Workers heard from within three heartbeat intervals.",
        &[("", s.live_workers)],
    );
    metric(
        "tutor_coordinator_run_finished",
        "gauge",
        "1 once the run is finished.",
        &[("", s.run_finished as u64)],
    );
    out
}

/// Gauges of the newest finished iteration: solve rates, training throughput, policy
/// lag behind the learner, and how long each phase took.
pub fn render_iteration(s: &tutor_proto::IterationSummary) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, samples: &[(&str, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    gauge(
        "tutor_coordinator_solve_rate",
        "Resolved fraction of the newest finished iteration, by purpose (eval: student alone on held-out tasks).",
        &[
            ("{purpose=\"train\"}", s.train_solve_rate),
            ("{purpose=\"eval\"}", s.heldout_solve_rate),
        ],
    );
    let per_s = |n: f64, secs: f64| if secs > 0.0 { n / secs } else { 0.0 };
    gauge(
        "tutor_coordinator_train_examples_per_second",
        "Training examples per second of the newest training phase.",
        &[("", per_s(s.train_examples as f64, s.train_seconds))],
    );
    gauge(
        "tutor_coordinator_train_loss",
        "Mean training loss of the newest training phase.",
        &[("", s.train_loss)],
    );
    gauge(
        "tutor_coordinator_phase_seconds",
        "Duration of the newest iteration's phases.",
        &[
            ("{phase=\"rollout\"}", s.rollout_seconds),
            ("{phase=\"train\"}", s.train_seconds),
            ("{phase=\"sync\"}", s.sync_seconds),
        ],
    );
    gauge(
        "tutor_coordinator_episodes_per_second",
        "Training episodes per second of rollout in the newest iteration.",
        &[("", per_s(s.episodes as f64, s.rollout_seconds))],
    );
    out
}

/// Binds `addr`, writes the bound address to `addr_file`, and serves `/metrics` on a
/// task of its own (abort it to stop).
pub async fn start(
    addr: SocketAddr,
    addr_file: Option<&Path>,
    source: MetricsSource,
) -> Result<JoinHandle<()>> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics endpoint to {addr}"))?;
    let bound = listener.local_addr()?;
    if let Some(f) = addr_file {
        tutor_proto::net::write_addr_file(f, bound)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    tracing::info!(addr = %bound, "metrics at http://{bound}/metrics");
    Ok(tokio::spawn(serve(listener, source)))
}

/// The content type of the Prometheus text exposition, on every answer.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Serves `GET /metrics` on `listener` until the task is dropped. One request per
/// connection (`Connection: close`), which is all a Prometheus scrape needs.
pub async fn serve(listener: TcpListener, source: MetricsSource) {
    let app = Router::new()
        .route(
            "/metrics",
            get(scrape)
                .head(method_not_allowed)
                .fallback(method_not_allowed),
        )
        .fallback(not_found)
        .with_state(source)
        .layer(axum::middleware::map_response(close_connection));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(error = %e, "metrics endpoint stopped");
    }
}

async fn scrape(State(source): State<MetricsSource>, headers: axum::http::HeaderMap) -> Response {
    if source.require_token {
        let metadata = tonic::metadata::MetadataMap::from_headers(headers);
        if let Err(status) = source.auth.check(&metadata) {
            return text(StatusCode::UNAUTHORIZED, format!("{}\n", status.message()));
        }
    }
    // A scrape that cannot be answered in time is dropped rather than left hanging.
    match tokio::time::timeout(Duration::from_secs(10), source.render()).await {
        Ok(body) => text(StatusCode::OK, body),
        Err(_) => {
            tracing::debug!("metrics request timed out");
            text(StatusCode::SERVICE_UNAVAILABLE, String::new())
        }
    }
}

async fn method_not_allowed() -> Response {
    text(StatusCode::METHOD_NOT_ALLOWED, String::new())
}

async fn not_found() -> Response {
    text(
        StatusCode::NOT_FOUND,
        "the coordinator serves GET /metrics only\n".to_string(),
    )
}

fn text(status: StatusCode, body: String) -> Response {
    (status, [(CONTENT_TYPE, TEXT_FORMAT)], body).into_response()
}

async fn close_connection(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    fn value(text: &str, series: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    async fn http_get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn http_endpoint_serves_metrics_and_refuses_other_paths() {
        let d = tempfile::tempdir().unwrap();
        let addr_file = d.path().join("addr/metrics");
        let source = MetricsSource {
            scheduler: SchedulerHandle::spawn(Default::default(), vec![], vec![]),
            events: Default::default(),
            auth: ServerAuth::new(None),
            run_events: Default::default(),
            require_token: false,
        };
        let task = start("127.0.0.1:0".parse().unwrap(), Some(&addr_file), source)
            .await
            .unwrap();
        let addr: SocketAddr = std::fs::read_to_string(&addr_file)
            .unwrap()
            .parse()
            .unwrap();

        let ok = http_get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("text/plain; version=0.0.4"), "{ok}");
        let (head, body) = ok.split_once("\r\n\r\n").unwrap();
        // Header names are case-insensitive; hyper writes them in lower case.
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert!(body.contains("tutor_coordinator_live_workers 0"), "{body}");

        let missing = http_get(addr, "GET / HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let post = http_get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        task.abort();
    }

    /// With `[coordinator] metrics_require_token`, a scrape without the run's token (or
    /// with another) gets 401, the message never echoing what was sent; the right token
    /// gets the metrics. Before, /metrics answered anyone.
    #[tokio::test]
    async fn metrics_can_require_the_token() {
        let token = tutor_proto::auth::AuthToken::new("metrics-s3cret").unwrap();
        let source = MetricsSource {
            scheduler: SchedulerHandle::spawn(Default::default(), vec![], vec![]),
            events: Default::default(),
            auth: ServerAuth::new(Some(token)),
            run_events: Default::default(),
            require_token: true,
        };
        let d = tempfile::tempdir().unwrap();
        let addr_file = d.path().join("metrics");
        let task = start("127.0.0.1:0".parse().unwrap(), Some(&addr_file), source)
            .await
            .unwrap();
        let addr: SocketAddr = std::fs::read_to_string(&addr_file)
            .unwrap()
            .parse()
            .unwrap();
        let anonymous = http_get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous}");
        let wrong = http_get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess\r\n\r\n",
        )
        .await;
        assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
        assert!(
            !wrong.contains("guess") && !wrong.contains("s3cret"),
            "{wrong}"
        );
        let right = http_get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer metrics-s3cret\r\n\r\n",
        )
        .await;
        assert!(right.starts_with("HTTP/1.1 200"), "{right}");
        assert!(
            right.contains("tutor_coordinator_unauthenticated_requests_total 2"),
            "{right}"
        );
        task.abort();
    }

    #[test]
    fn exposition_has_every_series_with_help_and_type() {
        let events = EventCounters::default();
        EventCounters::bump(&events.turns_ingested);
        EventCounters::bump(&events.turns_ingested);
        EventCounters::bump(&events.duplicate_events);
        let snap = SchedulerSnapshot {
            policy_version: 3,
            iteration: 2,
            pending_episodes: 5,
            outstanding_leases: 4,
            live_workers: 2,
            train_episodes_completed_total: 11,
            eval_episodes_completed_total: 6,
            lease_expiries_total: 1,
            stale_episodes_total: 7,
            run_finished: false,
            ..Default::default()
        };
        let text = render(Some(&snap), &events, 9);
        for (series, want) in [
            ("tutor_coordinator_turns_ingested_total", 2),
            ("tutor_coordinator_duplicate_events_total", 1),
            ("tutor_coordinator_refused_events_total", 0),
            ("tutor_coordinator_outcomes_ingested_total", 0),
            ("tutor_coordinator_store_commits_total", 0),
            ("tutor_coordinator_store_bytes_total", 0),
            ("tutor_coordinator_unauthenticated_requests_total", 9),
            (
                "tutor_coordinator_episodes_completed_total{purpose=\"train\"}",
                11,
            ),
            (
                "tutor_coordinator_episodes_completed_total{purpose=\"eval\"}",
                6,
            ),
            ("tutor_coordinator_lease_expiries_total", 1),
            ("tutor_coordinator_stale_episodes_total", 7),
            ("tutor_coordinator_draining", 0),
            ("tutor_coordinator_policy_version", 3),
            ("tutor_coordinator_iteration", 2),
            ("tutor_coordinator_queue_depth", 5),
            ("tutor_coordinator_outstanding_leases", 4),
            ("tutor_coordinator_live_workers", 2),
            ("tutor_coordinator_run_finished", 0),
        ] {
            assert_eq!(value(&text, series), Some(want), "{series} in\n{text}");
        }
        // Every sample's metric has a TYPE line before it.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(text.contains(&format!("# TYPE {name} ")), "{name}");
        }
        // A stopped scheduler still leaves the counters kept outside it.
        let text = render(None, &events, 9);
        assert_eq!(
            value(&text, "tutor_coordinator_turns_ingested_total"),
            Some(2)
        );
        assert!(!text.contains("policy_version"));
    }
}

#[cfg(test)]
mod iteration_tests {
    use super::*;

    #[test]
    fn iteration_gauges_come_from_the_newest_summary() {
        let s = tutor_proto::IterationSummary {
            train_solve_rate: 0.5,
            heldout_solve_rate: 0.25,
            train_examples: 300,
            train_seconds: 3.0,
            train_loss: 1.5,
            rollout_seconds: 4.0,
            episodes: 8,
            ..Default::default()
        };
        let text = render_iteration(&s);
        for (series, want) in [
            ("tutor_coordinator_solve_rate{purpose=\"train\"} ", 0.5),
            ("tutor_coordinator_solve_rate{purpose=\"eval\"} ", 0.25),
            ("tutor_coordinator_train_examples_per_second ", 100.0),
            ("tutor_coordinator_train_loss ", 1.5),
            ("tutor_coordinator_episodes_per_second ", 2.0),
            ("tutor_coordinator_phase_seconds{phase=\"rollout\"} ", 4.0),
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(series))
                .unwrap_or_else(|| panic!("{series} missing in\n{text}"));
            let v: f64 = line[series.len()..].parse().unwrap();
            assert_eq!(v, want, "{line}");
        }
        // A phase of zero seconds gives zero, not NaN or inf.
        let text = render_iteration(&tutor_proto::IterationSummary::default());
        assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
    }
}
