//! Ingest throughput of the coordinator: a real coordinator (`tutor_coordinator::serve`)
//! in this process on 127.0.0.1:0 with a temporary run directory, and N synthetic
//! workers, each with its own gRPC connection and `Rollout.StreamEvents` stream, streaming
//! M episodes × T turns of realistic size (plus one outcome per episode) with at most
//! `window` unacknowledged events in flight. Measures turns/s over the whole stream and
//! the ack latency of every event (handed to the stream → its ack received).
//!
//! No learner runs: the coordinator's driver is given a learner address where nothing
//! listens (127.0.0.1:9, refused at once; it retries every 300 ms, negligible beside the
//! measured traffic) and never starts an iteration. That only stops leasing; the Rollout
//! service stores and acknowledges events exactly as in a run (the scheduler keeps them
//! in memory for an iteration that never starts, as a run keeps turns for its dataset).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use prost::Message;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, Barrier};
use tutor_coordinator::store::StoreOptions;
use tutor_coordinator::{CoordinatorConfig, ServeOptions};
use tutor_proto::auth::{AuthToken, ClientAuth};
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::{
    episode_event, Actor, EpisodeEvent, EpisodeOutcome, EpisodePurpose, OutcomeStatus,
    RegisterRequest, TurnRecord, TURN_INDEX_OUTCOME,
};

/// The driver cannot parse this, so it ends at once without touching the network.
const NO_LEARNER: &str = "http://127.0.0.1:9";

#[derive(Debug, Clone, Parser)]
#[command(
    name = "ingest",
    about = "Coordinator ingest throughput: synthetic workers stream turns over loopback"
)]
pub struct Args {
    /// Synthetic workers (one gRPC connection and one StreamEvents stream each).
    #[arg(long, default_value_t = 16)]
    pub workers: u32,
    /// Episodes per worker.
    #[arg(long, default_value_t = 256)]
    pub episodes: u32,
    /// Turns per episode (each episode also streams one outcome event).
    #[arg(long, default_value_t = 30)]
    pub turns: u32,
    /// Unacknowledged events a worker keeps in flight at most.
    #[arg(long, default_value_t = 32)]
    pub window: u32,
    /// fsync each group commit before acking (the coordinator's only durable setting).
    /// `--fsync false` measures what the fsync costs.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub fsync: bool,
    /// Token ids in each turn's context delta.
    #[arg(long, default_value_t = 300)]
    pub context_tokens: usize,
    /// Token ids of the teacher's and of the student's action (the student's with log-probs).
    #[arg(long, default_value_t = 80)]
    pub action_tokens: usize,
    /// Characters of each turn's observation.
    #[arg(long, default_value_t = 1500)]
    pub observation_chars: usize,
    /// Directory in which the temporary run directory is made (its filesystem decides
    /// what an fsync costs); default: the system's temp directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Give up (and fail) after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub max_seconds: u64,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Report {
    pub args: Args,
    pub turns: u64,
    pub events: u64,
    pub elapsed: Duration,
    /// Bytes of the encoded events sent (protobuf, without gRPC framing).
    pub bytes_sent: u64,
    pub latency_p50: Duration,
    pub latency_p99: Duration,
    pub latency_max: Duration,
    /// The store's group commits during the run (one write + one fsync each).
    pub store_commits: u64,
    pub store_bytes: u64,
    /// CPUs and the 1-minute load average when the run started: other work on the
    /// machine shares the CPUs with the coordinator and the workers.
    pub cpus: usize,
    pub load_at_start: Option<f64>,
}

impl Report {
    pub fn turns_per_s(&self) -> f64 {
        self.turns as f64 / self.elapsed.as_secs_f64()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.args;
        let secs = self.elapsed.as_secs_f64();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        writeln!(
            f,
            "ingest: {} workers x {} episodes x {} turns (+1 outcome per episode), window {}, fsync {}",
            a.workers,
            a.episodes,
            a.turns,
            a.window,
            if a.fsync { "on" } else { "OFF" }
        )?;
        writeln!(
            f,
            "  turns/s      {:>10.0}   ({} turns, {} events in {:.2} s; {:.0} events/s)",
            self.turns_per_s(),
            self.turns,
            self.events,
            secs,
            self.events as f64 / secs
        )?;
        writeln!(
            f,
            "  ack latency  p50 {:.2} ms   p99 {:.2} ms   max {:.2} ms",
            ms(self.latency_p50),
            ms(self.latency_p99),
            ms(self.latency_max)
        )?;
        writeln!(
            f,
            "  sent         {:>10.1} MB/s  ({:.0} B per event, protobuf)",
            self.bytes_sent as f64 / secs / 1e6,
            self.bytes_sent as f64 / self.events.max(1) as f64
        )?;
        writeln!(
            f,
            "  machine      {} CPUs, load average {} at start (coordinator and workers share them)",
            self.cpus,
            self.load_at_start
                .map_or("unknown".to_string(), |l| format!("{l:.2}"))
        )?;
        write!(
            f,
            "  store        {} group commits ({:.0}/s, {:.1} events each), {:.1} MB written",
            self.store_commits,
            self.store_commits as f64 / secs,
            self.events as f64 / self.store_commits.max(1) as f64,
            self.store_bytes as f64 / 1e6
        )
    }
}

/// One worker's measurements.
struct WorkerResult {
    latencies: Vec<Duration>,
    turns: u64,
    events: u64,
    bytes: u64,
}

/// Starts a coordinator, runs the workers against it, stops it, and reports.
pub async fn run(args: Args) -> Result<Report> {
    ensure!(
        args.workers > 0 && args.episodes > 0 && args.window > 0,
        "--workers, --episodes and --window must be positive"
    );
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::Builder::new()
        .prefix("tutor-bench-ingest-")
        .tempdir_in(&parent)
        .with_context(|| format!("making a temp dir in {}", parent.display()))?;
    let token = AuthToken::new(&random_token())?;
    let addr_file = dir.path().join("addr/coordinator");
    let metrics_file = dir.path().join("addr/metrics");
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = ServeOptions {
        listen: "127.0.0.1:0".parse()?,
        run_dir: dir.path().join("run"),
        learner_endpoint: NO_LEARNER.into(),
        config: CoordinatorConfig::default(),
        train_tasks: Vec::new(),
        heldout_tasks: Vec::new(),
        addr_file: Some(addr_file.clone()),
        auth_token: Some(token.clone()),
        metrics_listen: Some("127.0.0.1:0".parse()?),
        metrics_addr_file: Some(metrics_file.clone()),
        store: StoreOptions { fsync: args.fsync },
        tls: Default::default(),
        insecure: false,
    };
    let server = tokio::spawn(tutor_coordinator::serve(opts, async move {
        let _ = stopped.await;
    }));
    let addr = wait_addr(&addr_file, &server).await?;
    let metrics_addr = wait_addr(&metrics_file, &server).await?;

    let result = tokio::time::timeout(
        Duration::from_secs(args.max_seconds),
        measure(&args, addr, metrics_addr, &token),
    )
    .await;
    let _ = stop.send(());
    match tokio::time::timeout(Duration::from_secs(10), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(e.context("the coordinator failed")),
        Ok(Err(e)) => bail!("the coordinator task panicked: {e}"),
        Err(_) => bail!("the coordinator did not stop within 10 s"),
    }
    match result {
        Ok(r) => r,
        Err(_) => bail!("not finished after --max-seconds {}", args.max_seconds),
    }
}

async fn measure(
    args: &Args,
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    token: &AuthToken,
) -> Result<Report> {
    let load_at_start = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok());
    let auth = ClientAuth::new(Some(token));
    // Everyone connects and opens the stream first; the clock starts when all are ready.
    let start = std::sync::Arc::new(Barrier::new(args.workers as usize + 1));
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let (args, auth, start) = (args.clone(), auth.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            worker(w, &args, addr, auth, start).await
        }));
    }
    let before = scrape(metrics_addr).await?;
    start.wait().await;
    let t0 = Instant::now();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.context("a worker panicked")??);
    }
    let elapsed = t0.elapsed();
    let after = scrape(metrics_addr).await?;

    let turns: u64 = results.iter().map(|r| r.turns).sum();
    let events: u64 = results.iter().map(|r| r.events).sum();
    let ingested = after.turns - before.turns;
    ensure!(
        ingested == turns,
        "the coordinator counts {ingested} turns stored, the workers had {turns} acked"
    );
    let mut lat: Vec<Duration> = results
        .iter_mut()
        .flat_map(|r| std::mem::take(&mut r.latencies))
        .collect();
    lat.sort_unstable();
    Ok(Report {
        args: args.clone(),
        turns,
        events,
        elapsed,
        bytes_sent: results.iter().map(|r| r.bytes).sum(),
        latency_p50: percentile(&lat, 0.50),
        latency_p99: percentile(&lat, 0.99),
        latency_max: lat.last().copied().unwrap_or_default(),
        store_commits: after.commits - before.commits,
        store_bytes: after.bytes - before.bytes,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_at_start,
    })
}

/// `sorted[ceil(p·n) − 1]`: the smallest value at least a fraction `p` of them reach.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

async fn worker(
    w: u32,
    args: &Args,
    addr: SocketAddr,
    auth: ClientAuth,
    start: std::sync::Arc<Barrier>,
) -> Result<WorkerResult> {
    // One connection per worker, as separate worker processes would have.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await
        .context("connecting to the coordinator")?;
    let mut client = RolloutClient::new(auth.channel(channel));
    let worker_id = client
        .register(RegisterRequest {
            worker_name: format!("bench-{w}"),
            capacity: 1,
        })
        .await
        .context("registering")?
        .into_inner()
        .worker_id;
    let window = args.window as usize;
    let (tx, rx) = mpsc::channel::<EpisodeEvent>(window + 1);
    let mut acks = client
        .stream_events(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .context("opening the event stream")?
        .into_inner();
    let template = turn_template(w as u64, args);
    let total_events = args.episodes as u64 * (args.turns as u64 + 1);
    let mut out = WorkerResult {
        latencies: Vec::with_capacity(total_events as usize),
        turns: 0,
        events: 0,
        bytes: 0,
    };
    let mut in_flight: HashMap<(String, u32), Instant> = HashMap::with_capacity(window * 2);
    let mut next = (0u32, 0u32); // (episode, turn); turn == args.turns: the outcome
    let mut sent = 0u64;
    start.wait().await;
    while out.events < total_events {
        let can_send = sent < total_events && in_flight.len() < window;
        tokio::select! {
            // Acks first; send whenever none is waiting and the window has room.
            biased;
            ack = acks.message() => handle_ack(ack, &mut in_flight, &mut out)?,
            _ = std::future::ready(()), if can_send => {
                let (e, t) = next;
                let episode_id = format!("bench-w{w}-e{e}");
                let (ev, index) = if t < args.turns {
                    let mut turn = template.clone();
                    turn.turn_index = t;
                    let ev = EpisodeEvent {
                        episode_id: episode_id.clone(),
                        worker_id: worker_id.clone(),
                        event: Some(episode_event::Event::Turn(turn)),
                    };
                    (ev, t)
                } else {
                    (outcome(&episode_id, &worker_id, args.turns), TURN_INDEX_OUTCOME)
                };
                out.bytes += ev.encoded_len() as u64;
                in_flight.insert((episode_id, index), Instant::now());
                tx.send(ev)
                    .await
                    .map_err(|_| anyhow::anyhow!("the event stream closed"))?;
                sent += 1;
                next = if t < args.turns { (e, t + 1) } else { (e + 1, 0) };
            }
        }
    }
    drop(tx);
    Ok(out)
}

fn handle_ack(
    ack: Result<Option<tutor_proto::EventAck>, tonic::Status>,
    in_flight: &mut HashMap<(String, u32), Instant>,
    out: &mut WorkerResult,
) -> Result<()> {
    let ack = ack
        .context("the event stream failed")?
        .context("the coordinator ended the event stream early")?;
    let now = Instant::now();
    ensure!(
        !ack.duplicate,
        "a fresh event acked as a duplicate: {ack:?}"
    );
    let Some(sent) = in_flight.remove(&(ack.episode_id.clone(), ack.turn_index)) else {
        bail!("an ack for an event not in flight: {ack:?}");
    };
    out.latencies.push(now - sent);
    out.events += 1;
    out.turns += !ack.is_outcome as u64;
    Ok(())
}

/// A turn of the sizes a real episode has: the token ids appended to the history, the
/// teacher's and the student's action (with log-probs), their texts, the command and a
/// truncated observation.
pub fn turn_template(seed: u64, args: &Args) -> TurnRecord {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.gen_range(0..151_000)).collect() };
    let context = ids(args.context_tokens);
    let teacher = ids(args.action_tokens);
    let student = ids(args.action_tokens);
    let logprobs = (0..args.action_tokens)
        .map(|i| -((i % 17) as f32) * 0.173)
        .collect();
    let text = |n: usize, salt: usize| -> String {
        const WORDS: [&str; 12] = [
            "def ", "return ", "self.", "assert ", "src/", "test_", "==", "None", "(x)", "\n",
            "import ", "value",
        ];
        let mut s = String::with_capacity(n + 8);
        let mut i = salt;
        while s.len() < n {
            s.push_str(WORDS[i % WORDS.len()]);
            i = i.wrapping_mul(31).wrapping_add(7);
        }
        s.truncate(n);
        s
    };
    TurnRecord {
        turn_index: 0,
        context_delta_tokens: context,
        teacher_tokens: teacher,
        teacher_text: text(args.action_tokens * 3, 1),
        teacher_format_error: false,
        student_tokens: student,
        student_logprobs: logprobs,
        student_text: text(args.action_tokens * 3, 2),
        student_format_error: false,
        student_generated: true,
        executed: Actor::Teacher as i32,
        command: "grep -rn \"def parse_config\" src/ tests/ | head -20".into(),
        observation: text(args.observation_chars, 3),
        exit_code: 0,
        timed_out: false,
        policy_version: 1,
        agreement: false,
        teacher_endpoint_logprobs: Vec::new(),
        sampling_temperature: 1.0,
        unbiased_sampling: false,
        teacher_logprobs_of_student: Vec::new(),
        context_rebuilt: false,
        teacher_asked: true,
    }
}

fn outcome(episode_id: &str, worker_id: &str, turns: u32) -> EpisodeEvent {
    EpisodeEvent {
        episode_id: episode_id.into(),
        worker_id: worker_id.into(),
        event: Some(episode_event::Event::Outcome(EpisodeOutcome {
            num_turns: turns,
            status: OutcomeStatus::Resolved as i32,
            patch: "--- a/src/config.py\n+++ b/src/config.py\n@@ -10,3 +10,3 @@\n-    return None\n+    return value\n".repeat(4),
            test_statuses: [
                ("tests/test_config.py::test_parse".to_string(), "PASSED".to_string()),
                ("tests/test_config.py::test_default".to_string(), "PASSED".to_string()),
            ]
            .into(),
            submitted: true,
            duration_s: 12.5,
            purpose: EpisodePurpose::Train as i32,
            iteration: 0,
            instance_id: "bench__task-1".into(),
            policy_version: 1,
            error: String::new(),
            grading: "strict".into(),
            harness_status: OutcomeStatus::Resolved as i32,
        })),
    }
}

fn random_token() -> String {
    let mut rng = rand::thread_rng();
    (0..32)
        .map(|_| format!("{:02x}", rng.gen::<u8>()))
        .collect()
}

async fn wait_addr(
    file: &Path,
    server: &tokio::task::JoinHandle<Result<()>>,
) -> Result<SocketAddr> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(s) = std::fs::read_to_string(file) {
            return s.trim().parse().context("a bad address file");
        }
        ensure!(
            !server.is_finished(),
            "the coordinator stopped before listening"
        );
        ensure!(Instant::now() < end, "no {} after 30 s", file.display());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The counters the report needs, read from the coordinator's `/metrics`.
struct Counters {
    turns: u64,
    commits: u64,
    bytes: u64,
}

async fn scrape(addr: SocketAddr) -> Result<Counters> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut text = String::new();
    s.read_to_string(&mut text).await?;
    let value = |name: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .with_context(|| format!("no {name} in the coordinator's metrics"))
    };
    Ok(Counters {
        turns: value("tutor_coordinator_turns_ingested_total")?,
        commits: value("tutor_coordinator_store_commits_total")?,
        bytes: value("tutor_coordinator_store_bytes_total")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_value_a_fraction_reaches() {
        let d: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&d, 0.50), Duration::from_millis(50));
        assert_eq!(percentile(&d, 0.99), Duration::from_millis(99));
        assert_eq!(percentile(&d, 1.0), Duration::from_millis(100));
        assert_eq!(percentile(&d[..1], 0.99), Duration::from_millis(1));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }

    /// A tiny run end to end: every turn is stored once and acked, with fsync on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_small_run_acks_every_event() {
        let args = Args::parse_from([
            "ingest",
            "--workers",
            "2",
            "--episodes",
            "3",
            "--turns",
            "4",
            "--window",
            "4",
        ]);
        let r = run(args).await.unwrap();
        assert_eq!((r.turns, r.events), (24, 30));
        assert!(r.store_commits >= 1 && r.store_commits <= 30, "{r}");
        assert!(r.store_bytes > r.bytes_sent, "{r}");
        assert!(r.latency_p50 <= r.latency_p99 && r.latency_p99 <= r.latency_max);
        assert!(r.to_string().contains("turns/s"));
    }
}
