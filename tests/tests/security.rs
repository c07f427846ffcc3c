//! The services as a deployment sees them: a real coordinator and a real learner
//! process with a token file, called over loopback with no, a wrong and the right token;
//! unauthenticated health probes; metrics; oversized messages.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;
use tonic::{Code, Request};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tutor_proto::control_client::ControlClient;
use tutor_proto::learner_client::LearnerClient;
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::weights_client::WeightsClient;
use tutor_proto::{FetchWeightsRequest, LearnerStatusRequest, RegisterRequest, WatchRunRequest};

const TOKEN: &str = "9f3c1e0b7a52d4c8e6f1a3b5c7d9e0f2a4b6c8d0e2f4a6b8c0d2e4f6a8b0c2d4";

/// A `tutor` server process, stopped when dropped; its log is kept for assertions.
struct Server {
    child: Child,
    log: PathBuf,
    addr: String,
}

impl Server {
    /// Starts `tutor <args> --addr-file DIR/addr` and waits for the address.
    fn start(dir: &Path, name: &str, args: &[String]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let addr_file = dir.join(format!("{name}.addr"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(common::tutor_bin())
            .args(args)
            .arg("--addr-file")
            .arg(&addr_file)
            .env("RUST_LOG", "info")
            .env_remove("TUTOR_AUTH_TOKEN")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let mut server = Server {
            child,
            log,
            addr: String::new(),
        };
        server.addr = server.wait_file(&addr_file);
        server
    }

    fn wait_file(&mut self, path: &Path) -> String {
        let end = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(s) = std::fs::read_to_string(path) {
                return s.trim().to_string();
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "the server exited ({status}) before listening:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < end,
                "no {} after 120 s:\n{}",
                path.display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn token_file(dir: &Path) -> PathBuf {
    let p = dir.join("auth-token");
    std::fs::write(&p, format!("{TOKEN}\n")).unwrap();
    p
}

/// A request carrying `token` the way every Tutor client sends it.
fn with_token<T>(msg: T, token: Option<&str>) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

fn register(name: &str) -> RegisterRequest {
    RegisterRequest {
        worker_name: name.into(),
        capacity: 1,
    }
}

/// A coordinator with a token, tasks and metrics, pointed at a learner that does not
/// exist: its gRPC services answer without one (only its driver task needs a learner).
fn start_coordinator(dir: &Path) -> (Server, String) {
    let p = |n: &str| dir.join(n).display().to_string();
    let out = common::tutor(&["tasks", "toy", "--n", "2", "--out", &p("tasks.jsonl")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(dir.join("run.toml"), "").unwrap();
    let tok = token_file(dir).display().to_string();
    let args: Vec<String> = [
        "coordinator",
        "--config",
        &p("run.toml"),
        "--run-dir",
        &p("run"),
        "--learner",
        "http://127.0.0.1:9",
        "--train-tasks",
        &p("tasks.jsonl"),
        "--listen",
        "127.0.0.1:0",
        "--auth-token-file",
        &tok,
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-addr-file",
        &p("metrics.addr"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut server = Server::start(dir, "coordinator", &args);
    let metrics = server.wait_file(&dir.join("metrics.addr"));
    (server, metrics)
}

async fn http_get(addr: &str, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

fn metric(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

async fn health(channel: Channel, service: &str) -> i32 {
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap_or_else(|s| panic!("health check of {service:?} failed: {s}"))
        .into_inner()
        .status
}

#[tokio::test]
async fn coordinator_requires_the_token_counts_rejections_and_probes_need_none() {
    let dir = tempfile::tempdir().unwrap();
    let (coord, metrics_addr) = start_coordinator(dir.path());
    let mut rollout = RolloutClient::new(coord.channel().await);

    let status = rollout
        .register(with_token(register("anon"), None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let status = rollout
        .register(with_token(register("guess"), Some("not-the-token")))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(!status.message().contains(TOKEN));
    let reg = rollout
        .register(with_token(register("w"), Some(TOKEN)))
        .await
        .expect("the right token is accepted")
        .into_inner();
    assert!(!reg.worker_id.is_empty());

    // The two rejected calls are counted; the registered worker is live.
    let page = http_get(&metrics_addr, "/metrics").await;
    assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
    assert_eq!(
        metric(&page, "tutor_coordinator_unauthenticated_requests_total"),
        Some(2),
        "{page}"
    );
    assert_eq!(
        metric(&page, "tutor_coordinator_live_workers"),
        Some(1),
        "{page}"
    );
    assert!(!page.contains(TOKEN));

    // The Control service is guarded the same way.
    let mut control = ControlClient::new(coord.channel().await);
    let status = control
        .watch_run(with_token(WatchRunRequest {}, None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    control
        .watch_run(with_token(WatchRunRequest {}, Some(TOKEN)))
        .await
        .expect("the right token opens the run stream");

    // Probes carry no token and are not counted as rejections.
    let serving = ServingStatus::Serving as i32;
    assert_eq!(health(coord.channel().await, "").await, serving);
    assert_eq!(
        health(coord.channel().await, "tutor.v1.Rollout").await,
        serving
    );
    assert_eq!(
        health(coord.channel().await, "tutor.v1.Control").await,
        serving
    );
    let page = http_get(&metrics_addr, "/metrics").await;
    assert_eq!(
        metric(&page, "tutor_coordinator_unauthenticated_requests_total"),
        Some(3),
        "{page}"
    );
    assert!(
        !coord.log().contains(TOKEN),
        "the token leaked into the log"
    );
}

#[tokio::test]
async fn oversized_message_is_refused_and_the_coordinator_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (coord, _) = start_coordinator(dir.path());
    let mut rollout = RolloutClient::new(coord.channel().await);
    let huge = "w".repeat(tutor_proto::MAX_ROLLOUT_REQUEST_BYTES + 1);
    let status = rollout
        .register(with_token(register(&huge), Some(TOKEN)))
        .await
        .unwrap_err();
    assert!(
        matches!(status.code(), Code::OutOfRange | Code::ResourceExhausted),
        "an oversized message is refused by size, not by the handler: {:?} {}",
        status.code(),
        status.message()
    );
    // The same connection and a new one both still work.
    rollout
        .register(with_token(register("after"), Some(TOKEN)))
        .await
        .expect("the coordinator answers after an oversized message");
    RolloutClient::new(coord.channel().await)
        .register(with_token(register("fresh"), Some(TOKEN)))
        .await
        .expect("a new connection is served too");
}

/// A tiny learner process on `dir` (model, out dir, token) with a fresh port.
/// The flags of a learner on a tiny model of its own in `dir`, with the token file.
fn learner_args(dir: &Path) -> Vec<String> {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        r#"{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 300,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "max_position_embeddings": 256}"#,
    )
    .unwrap();
    std::fs::write(dir.join("run.toml"), "").unwrap();
    let p = |n: &Path| n.display().to_string();
    vec![
        "learner".into(),
        "--config".into(),
        p(&dir.join("run.toml")),
        "--model-dir".into(),
        p(&model),
        "--out-dir".into(),
        p(&dir.join("learner")),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--auth-token-file".into(),
        p(&token_file(dir)),
    ]
}

fn start_learner(dir: &Path) -> Server {
    Server::start(dir, "learner", &learner_args(dir))
}

#[tokio::test]
async fn learner_requires_the_token_on_learner_and_weights_and_probes_need_none() {
    let dir = tempfile::tempdir().unwrap();
    let learner = start_learner(dir.path());

    let mut client = LearnerClient::new(learner.channel().await);
    for token in [None, Some("not-the-token")] {
        let status = client
            .status(with_token(LearnerStatusRequest {}, token))
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
    }
    let st = client
        .status(with_token(LearnerStatusRequest {}, Some(TOKEN)))
        .await
        .expect("the right token is accepted")
        .into_inner();
    assert!(!st.latest_sha256.is_empty(), "version 0 is published");

    // Weights: refused without the token, streamed whole with it.
    let mut weights = WeightsClient::new(learner.channel().await);
    let status = weights
        .fetch(with_token(FetchWeightsRequest { version: 0 }, None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let mut stream = weights
        .fetch(with_token(FetchWeightsRequest { version: 0 }, Some(TOKEN)))
        .await
        .expect("the right token opens the weights stream")
        .into_inner();
    let (mut bytes, mut total, mut last) = (0u64, 0u64, false);
    while let Some(chunk) = stream.message().await.unwrap() {
        if chunk.offset == 0 {
            total = chunk.total_bytes;
        }
        bytes += chunk.data.len() as u64;
        last = chunk.last;
    }
    assert!(last && bytes == total && total > 0, "{bytes} of {total}");

    let serving = ServingStatus::Serving as i32;
    for service in ["", "tutor.v1.Learner", "tutor.v1.Weights"] {
        assert_eq!(health(learner.channel().await, service).await, serving);
    }
    assert!(
        !learner.log().contains(TOKEN),
        "the token leaked into the log"
    );
}

#[test]
fn a_server_without_a_token_warns_in_json_logs_and_a_bad_token_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("run.toml"), "").unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let out = common::tutor(&["tasks", "toy", "--n", "1", "--out", &p("tasks.jsonl")]);
    assert!(out.status.success());
    let base = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "coordinator",
            "--config",
            &p("run.toml"),
            "--run-dir",
            &p("run"),
            "--learner",
            "http://127.0.0.1:9",
            "--train-tasks",
            &p("tasks.jsonl"),
            "--listen",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    // Logged as JSON lines when asked, so collectors can parse the warning.
    let open = Server::start(dir.path(), "open", &base(&["--log-format", "json"]));
    let warning = || {
        open.log().lines().find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let msg = v["fields"]["message"].as_str()?;
            (v["level"] == "WARN" && msg.contains("no auth token")).then_some(v)
        })
    };
    let end = Instant::now() + Duration::from_secs(10);
    while warning().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(warning().is_some(), "no JSON warning in\n{}", open.log());
    drop(open);

    let missing = p("no-such-token-file");
    let args = base(&["--auth-token-file", &missing]);
    let out = Command::new(common::tutor_bin())
        .args(&args)
        .env_remove("TUTOR_AUTH_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no-such-token-file"), "{err}");
}

/// A worker's token (derived from the run's) reaches what a worker needs — Register,
/// the weights, fetching a rendezvous — and nothing else: Control (watching, shutting
/// the run down), publishing a rendezvous and the learner's training and status answer
/// PERMISSION_DENIED. Before, any process's token was the operator's (and, until session
/// 28, a worker's token could publish the learner ranks' rendezvous).
#[tokio::test]
async fn a_worker_token_reaches_rollout_and_weights_only() {
    let worker_token = tutor_proto::auth::AuthToken::new(TOKEN)
        .unwrap()
        .derive(tutor_proto::auth::Role::Worker);
    let worker = Some(worker_token.expose());
    assert!(worker_token.expose().starts_with("worker."));

    let dir = tempfile::tempdir().unwrap();
    let (coord, _metrics) = start_coordinator(dir.path());
    let mut rollout = RolloutClient::new(coord.channel().await);
    rollout
        .register(with_token(register("w"), worker))
        .await
        .expect("a worker's token may register");
    let mut control = ControlClient::new(coord.channel().await);
    let status = control
        .watch_run(with_token(WatchRunRequest {}, worker))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let status = control
        .shutdown(with_token(tutor_proto::ShutdownRequest {}, worker))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    // The rendezvous: a worker fetches one (the weights broadcast's receivers), but
    // publishing one would point the learner's ranks or the other receivers at its own
    // address; with the learner's token it is published.
    let mut group =
        tutor_proto::learner_group_client::LearnerGroupClient::new(coord.channel().await);
    let rendezvous = |group: &str| tutor_proto::PublishRendezvousRequest {
        rendezvous: Some(tutor_proto::Rendezvous {
            group: group.into(),
            world_size: 2,
            kind: tutor_proto::CollectiveKind::Cpu as i32,
            cpu_address: "127.0.0.1:9".into(),
            ..Default::default()
        }),
    };
    for g in ["", "weights"] {
        let status = group
            .publish_rendezvous(with_token(rendezvous(g), worker))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(status.message().contains("learner rank 0"), "{status:?}");
    }
    let fetched = group
        .get_rendezvous(with_token(
            tutor_proto::GetRendezvousRequest {
                after_generation: 0,
                wait_ms: 10,
                group: "weights".into(),
            },
            worker,
        ))
        .await
        .unwrap_err();
    assert_eq!(
        fetched.code(),
        Code::NotFound,
        "nothing was published: {fetched:?}"
    );
    let learner_token = tutor_proto::auth::AuthToken::new(TOKEN)
        .unwrap()
        .derive(tutor_proto::auth::Role::Learner);
    group
        .publish_rendezvous(with_token(
            rendezvous("weights"),
            Some(learner_token.expose()),
        ))
        .await
        .expect("the learner's token publishes");
    // A made-up "worker." token is no token at all.
    let forged = format!("worker.{}", "0".repeat(64));
    let status = rollout
        .register(with_token(register("f"), Some(&forged)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    let ldir = tempfile::tempdir().unwrap();
    let learner = start_learner(ldir.path());
    let mut client = LearnerClient::new(learner.channel().await);
    let status = client
        .status(with_token(LearnerStatusRequest {}, worker))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let mut weights = WeightsClient::new(learner.channel().await);
    let mut stream = weights
        .fetch(with_token(FetchWeightsRequest { version: 0 }, worker))
        .await
        .expect("a worker's token may download the weights")
        .into_inner();
    assert!(stream.message().await.unwrap().is_some());
    assert!(!learner.log().contains(worker_token.expose()));
}

/// The learner ranks' token (what `tutor run`, the compose stack and the manifests give
/// the learner) reaches the learner's services and the coordinator's rendezvous, and is
/// refused by Control (watching, shutting down) and Rollout (leases, events); a learner
/// serving with it takes the coordinator's calls (which carry it) and the workers'
/// downloads, and refuses a worker's call to train. A learner given a worker's token
/// refuses to start.
#[tokio::test]
async fn a_learner_token_reaches_the_learner_and_the_rendezvous_only() {
    use tutor_proto::auth::{AuthToken, Role};
    use tutor_proto::learner_group_client::LearnerGroupClient;
    let run = AuthToken::new(TOKEN).unwrap();
    let learner_token = run.derive(Role::Learner);
    let worker_token = run.derive(Role::Worker);
    let learner_tok = Some(learner_token.expose());

    let dir = tempfile::tempdir().unwrap();
    let (coord, _metrics) = start_coordinator(dir.path());
    let mut control = ControlClient::new(coord.channel().await);
    let status = control
        .shutdown(with_token(tutor_proto::ShutdownRequest {}, learner_tok))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let mut rollout = RolloutClient::new(coord.channel().await);
    let status = rollout
        .register(with_token(register("l"), learner_tok))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let mut group = LearnerGroupClient::new(coord.channel().await);
    let answer = group
        .get_rendezvous(with_token(
            tutor_proto::GetRendezvousRequest {
                after_generation: 0,
                wait_ms: 10,
                group: String::new(),
            },
            learner_tok,
        ))
        .await;
    // No rank has published one: whatever the answer, it is not a refusal of the token.
    if let Err(status) = &answer {
        assert!(
            !matches!(
                status.code(),
                Code::PermissionDenied | Code::Unauthenticated
            ),
            "{status:?}"
        );
    }

    // A learner serving with the learner's token.
    let ldir = tempfile::tempdir().unwrap();
    let mut args = learner_args(ldir.path());
    let own = ldir.path().join("learner-token");
    std::fs::write(&own, learner_token.expose()).unwrap();
    *args.last_mut().unwrap() = own.display().to_string();
    let learner = Server::start(ldir.path(), "learner", &args);
    let mut client = LearnerClient::new(learner.channel().await);
    client
        .status(with_token(LearnerStatusRequest {}, learner_tok))
        .await
        .expect("the coordinator's calls carry the learner's token");
    let status = client
        .status(with_token(
            LearnerStatusRequest {},
            Some(worker_token.expose()),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let mut weights = WeightsClient::new(learner.channel().await);
    let mut stream = weights
        .fetch(with_token(
            FetchWeightsRequest { version: 0 },
            Some(worker_token.expose()),
        ))
        .await
        .expect("a worker's token may download the weights from it")
        .into_inner();
    assert!(stream.message().await.unwrap().is_some());
    assert!(!learner.log().contains(learner_token.expose()));

    // Given a worker's token, a learner says so and stops.
    let wdir = tempfile::tempdir().unwrap();
    let mut args = learner_args(wdir.path());
    let wrong = wdir.path().join("worker-token");
    std::fs::write(&wrong, worker_token.expose()).unwrap();
    *args.last_mut().unwrap() = wrong.display().to_string();
    let log = wdir.path().join("refused.log");
    let mut child = Command::new(common::tutor_bin())
        .args(&args)
        .env_remove("TUTOR_AUTH_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "a learner given a worker's token kept running\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("worker token") && stderr.contains("learner-token"),
        "{stderr}"
    );
}

/// Fail closed: a coordinator on an address other machines can reach, with no token and
/// no client certificates, refuses to start and says how to start safely; `--insecure`
/// is the operator's explicit "yes". Before, it served anyone with a warning.
#[test]
fn an_exposed_coordinator_without_a_token_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("run.toml"), "").unwrap();
    let p = |n: &str| dir.path().join(n).display().to_string();
    let out = common::tutor(&["tasks", "toy", "--n", "1", "--out", &p("tasks.jsonl")]);
    assert!(out.status.success());
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "coordinator",
            "--config",
            &p("run.toml"),
            "--run-dir",
            &p("run"),
            "--learner",
            "http://127.0.0.1:9",
            "--train-tasks",
            &p("tasks.jsonl"),
            "--listen",
            "0.0.0.0:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let out = Command::new(common::tutor_bin())
        .args(args(&[]))
        .env_remove("TUTOR_AUTH_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success(), "an exposed coordinator started");
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["0.0.0.0", "--auth-token-file", "--insecure"] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    // The operator's explicit --insecure, or a token, lets it start.
    let open = Server::start(dir.path(), "insecure", &args(&["--insecure"]));
    drop(open);
    let tok = token_file(dir.path()).display().to_string();
    let guarded = Server::start(dir.path(), "token", &args(&["--auth-token-file", &tok]));
    drop(guarded);

    // The learner too (it holds the weights and takes training batches).
    let exposed: Vec<String> = learner_args(dir.path())
        .into_iter()
        .map(|a| {
            if a == "127.0.0.1:0" {
                "0.0.0.0:0".into()
            } else {
                a
            }
        })
        .take_while(|a| a != "--auth-token-file")
        .collect();
    let out = Command::new(common::tutor_bin())
        .args(&exposed)
        .env_remove("TUTOR_AUTH_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success(), "an exposed learner started");
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["learner", "0.0.0.0", "--insecure"] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

/// One Train stream with one empty batch of `run_id`: the learner's reply.
async fn train_one(
    learner: &Server,
    run_id: &str,
    step: u32,
) -> Result<tutor_proto::TrainProgress, tonic::Status> {
    let batch = tutor_proto::TrainBatch {
        iteration: 0,
        step,
        examples: Vec::new(),
        publish: false,
        run_id: run_id.into(),
    };
    let mut client = LearnerClient::new(learner.channel().await);
    let mut replies = client
        .train(with_token(tokio_stream::iter(vec![batch]), Some(TOKEN)))
        .await?
        .into_inner();
    replies
        .message()
        .await?
        .ok_or_else(|| tonic::Status::unknown("the train stream ended without a reply"))
}

#[tokio::test]
async fn learner_refuses_batches_of_another_run_even_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let learner = start_learner(dir.path());
    let first = train_one(&learner, "run-a-0123", 0).await.unwrap();
    assert!(!first.already_applied);

    let refused = |s: tonic::Status| {
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
        assert!(
            s.message().contains("run-a-0123") && s.message().contains("run-b-4567"),
            "the message names both runs: {}",
            s.message()
        );
    };
    refused(train_one(&learner, "run-b-4567", 1).await.unwrap_err());
    let s = train_one(&learner, "", 1).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");

    // Killed and started again on its out dir: still run-a's learner.
    drop(learner);
    std::fs::remove_file(dir.path().join("learner.addr")).unwrap();
    let learner = start_learner(dir.path());
    assert!(learner.log().contains("resumed"), "{}", learner.log());
    refused(train_one(&learner, "run-b-4567", 1).await.unwrap_err());
    // The stranger's batch 0 is not "already applied" for it; run-a's is.
    refused(train_one(&learner, "run-b-4567", 0).await.unwrap_err());
    assert!(
        train_one(&learner, "run-a-0123", 0)
            .await
            .unwrap()
            .already_applied
    );
    assert!(
        !train_one(&learner, "run-a-0123", 1)
            .await
            .unwrap()
            .already_applied
    );
}
