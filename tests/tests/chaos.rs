//! Chaos: a tiny multi-iteration DAgger run with its roles started one by one (so each can
//! be killed alone), while the test `kill -9`s random workers several times (restarting
//! them under the same name), the learner once (resumed from its checkpoint) and the
//! coordinator once (restarted on the same run directory). The run must finish with every
//! episode stored once and complete, the learner having trained each batch of the
//! schedule exactly once, and nothing left running or on disk.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{coordinator_state, wait_until, Role};

const ITERATIONS: u32 = 3;
const EPISODES: u32 = 6;
const EPOCHS: u64 = 2;

fn config(sandboxes: &Path) -> String {
    format!(
        r#"
[run]
name = "chaos"
workers = 2

[tasks]
source = "toy"
toy_train = 6
toy_heldout = 2
seed = 5

[model]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 32

[coordinator]
iterations = {ITERATIONS}
episodes_per_iteration = {EPISODES}
heldout_episodes = 0
max_turns = 5
max_new_tokens = 16
batch_tokens = 1500
epochs_per_iteration = {EPOCHS}
max_steps_per_iteration = 1000
lease_timeout_s = 3.0
sync_timeout_s = 30.0
shutdown_grace_s = 2.0

[coordinator.beta]
kind = "constant"
start = 0.5

[learner]
learning_rate = 5e-3
warmup_steps = 0

[worker]
sandbox_root = {:?}
"#,
        sandboxes.display().to_string()
    )
}

/// Two distinct free loopback ports (a restarted role must come back on the same
/// address, so the roles get fixed ports).
fn free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

/// One line of the learner's `train-log.jsonl` (see `tutor_learner::service`; read as
/// JSON here so this test binary does not link libtorch).
#[derive(Debug, Clone)]
struct Applied {
    step: u32,
    examples: u64,
    label_tokens: u64,
    episodes: Vec<String>,
    published_version: u64,
}

/// The learner's train log, one entry per (iteration, step) (a line repeated after a
/// crash between the log and the checkpoint counts once).
fn read_train_log(learner_dir: &Path) -> BTreeMap<(u32, u32), Applied> {
    let text = std::fs::read_to_string(learner_dir.join("train-log.jsonl")).unwrap_or_default();
    // A last line without its newline is an append cut short by the kill, not an entry
    // (the learner cuts it before its next append).
    let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
    let mut out = BTreeMap::new();
    for line in whole.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {line}"));
        out.insert(
            (n("iteration") as u32, n("step") as u32),
            Applied {
                step: n("step") as u32,
                examples: n("examples"),
                label_tokens: n("label_tokens"),
                episodes: v["episodes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| e.as_str().unwrap().to_string())
                    .collect(),
                published_version: n("published_version"),
            },
        );
    }
    out
}

/// A small deterministic generator (the seed is printed, so a failure can be replayed).
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn store_len(run_dir: &Path) -> u64 {
    std::fs::metadata(run_dir.join("trajectories/events.log"))
        .map(|m| m.len())
        .unwrap_or(0)
}

#[test]
fn run_survives_killed_workers_learner_and_coordinator() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let sandboxes = root.join("sandboxes");
    std::fs::create_dir_all(&sandboxes).unwrap();
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let cfg_path = root.join("chaos.toml");
    std::fs::write(&cfg_path, config(&sandboxes)).unwrap();
    let prep = common::prepare(&cfg_path, &root.join("runs"));
    let p = |k: &str| prep[k].as_str().unwrap().to_string();
    let run_dir = PathBuf::from(p("run_dir"));
    let learner_dir = PathBuf::from(p("learner_out_dir"));
    let token = root.join("token");
    std::fs::write(&token, "chaos-test-token-5f1c0a9e7b3d4c2a").unwrap();
    let tok = token.display().to_string();
    let (lport, cport) = free_ports();
    let addr = |n: &str| root.join(format!("{n}.addr")).display().to_string();
    let s = |p: &Path| p.display().to_string();

    let mut learner = Role::new(
        "learner",
        vec![
            "learner".into(),
            "--config".into(),
            p("config"),
            "--model-dir".into(),
            p("model_dir"),
            "--out-dir".into(),
            s(&learner_dir),
            "--listen".into(),
            format!("127.0.0.1:{lport}"),
            "--addr-file".into(),
            addr("learner"),
            "--auth-token-file".into(),
            tok.clone(),
        ],
        &logs,
    );
    let mut coordinator = Role::new(
        "coordinator",
        vec![
            "coordinator".into(),
            "--config".into(),
            p("config"),
            "--run-dir".into(),
            s(&run_dir),
            "--learner".into(),
            format!("http://127.0.0.1:{lport}"),
            "--train-tasks".into(),
            p("train_tasks"),
            "--listen".into(),
            format!("127.0.0.1:{cport}"),
            "--addr-file".into(),
            addr("coordinator"),
            "--auth-token-file".into(),
            tok.clone(),
        ],
        &logs,
    );
    let mut workers: Vec<Role> = (0..2)
        .map(|i| {
            let name = format!("w{i}");
            Role::new(
                &name,
                vec![
                    "worker".into(),
                    "--config".into(),
                    p("config"),
                    "--coordinator".into(),
                    format!("http://127.0.0.1:{cport}"),
                    "--model-dir".into(),
                    p("model_dir"),
                    "--name".into(),
                    name.clone(),
                    "--run".into(),
                    "chaos".into(),
                    "--cache-dir".into(),
                    s(&root.join("cache").join(&name)),
                    "--auth-token-file".into(),
                    tok.clone(),
                ],
                &logs,
            )
        })
        .collect();

    learner.start();
    wait_until(
        "the learner to listen",
        Duration::from_secs(60),
        &mut [&mut learner],
        || Path::new(&addr("learner")).exists(),
    );
    coordinator.start();
    wait_until(
        "the coordinator to listen",
        Duration::from_secs(60),
        &mut [&mut learner, &mut coordinator],
        || Path::new(&addr("coordinator")).exists(),
    );
    for w in workers.iter_mut() {
        w.start();
    }

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("chaos seed {seed}");
    let mut rng = Lcg(seed);
    let mut worker_kills = 0;
    let kill_worker = |workers: &mut Vec<Role>, rng: &mut Lcg, kills: &mut u32| {
        let i = rng.below(workers.len() as u64) as usize;
        workers[i].kill9();
        workers[i].start();
        *kills += 1;
        println!(
            "[{:>5.1}s] kill -9 worker {} (restarted)",
            started.elapsed().as_secs_f64(),
            workers[i].name
        );
    };
    let limit = Duration::from_secs(90);

    // Workers die while iteration 0's episodes stream into the store.
    for _ in 0..2 {
        let before = store_len(&run_dir);
        let [w0, w1] = &mut workers[..] else {
            unreachable!()
        };
        wait_until(
            "more episode events in the store",
            limit,
            &mut [&mut learner, &mut coordinator, w0, w1],
            || store_len(&run_dir) > before,
        );
        kill_worker(&mut workers, &mut rng, &mut worker_kills);
    }

    // The learner dies while it trains (after its second batch of some iteration).
    let log_path = learner_dir.join("train-log.jsonl");
    {
        let [w0, w1] = &mut workers[..] else {
            unreachable!()
        };
        wait_until(
            "the learner to train a second batch",
            limit,
            &mut [&mut learner, &mut coordinator, w0, w1],
            || {
                std::fs::read_to_string(&log_path)
                    .unwrap_or_default()
                    .lines()
                    .any(|l| l.contains("\"step\":1,"))
            },
        );
    }
    learner.kill9();
    let applied = read_train_log(&learner_dir);
    let (last_i, last_s) = *applied.keys().next_back().unwrap();
    let mid_iteration = applied[&(last_i, last_s)].published_version == 0;
    println!(
        "[{:>5.1}s] kill -9 learner after batch {last_i}/{last_s} ({}); restarting it",
        started.elapsed().as_secs_f64(),
        if mid_iteration {
            "in the middle of the iteration"
        } else {
            "right after publishing"
        }
    );
    learner.start();

    // The coordinator dies during a later iteration's rollouts.
    {
        let before = store_len(&run_dir);
        let [w0, w1] = &mut workers[..] else {
            unreachable!()
        };
        wait_until(
            "rollouts of iteration 1 or later",
            limit,
            &mut [&mut learner, &mut coordinator, w0, w1],
            || {
                let st = coordinator_state(&run_dir);
                st["iteration"].as_u64().unwrap_or(0) >= 1
                    && st["phase"] == "rollout"
                    && store_len(&run_dir) > before
            },
        );
    }
    let st = coordinator_state(&run_dir);
    coordinator.kill9();
    println!(
        "[{:>5.1}s] kill -9 coordinator at iteration {} ({}); restarting it",
        started.elapsed().as_secs_f64(),
        st["iteration"],
        st["phase"]
    );
    coordinator.start();

    // One more worker death after the coordinator came back.
    {
        let before = store_len(&run_dir);
        let [w0, w1] = &mut workers[..] else {
            unreachable!()
        };
        wait_until(
            "episode events after the coordinator restart",
            limit,
            &mut [&mut learner, &mut coordinator, w0, w1],
            || store_len(&run_dir) > before,
        );
    }
    kill_worker(&mut workers, &mut rng, &mut worker_kills);

    // The run finishes: the coordinator records it, and the workers leave on their own.
    {
        let [w0, w1] = &mut workers[..] else {
            unreachable!()
        };
        wait_until(
            "the run to finish",
            // A guard against hangs, not a speed check: on a loaded 2-core machine the
            // remaining iterations' training alone takes minutes.
            Duration::from_secs(300),
            &mut [&mut learner, &mut coordinator, w0, w1],
            || coordinator_state(&run_dir)["phase"] == "finished",
        );
    }
    for w in workers.iter_mut() {
        let status = w.wait_exit(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| s.success()),
            "worker {} did not leave on its own after the run finished ({status:?})\n{}",
            w.name,
            w.log_tail()
        );
    }
    for r in [&mut coordinator, &mut learner] {
        r.signal_term();
        let status = r.wait_exit(Duration::from_secs(30));
        assert!(
            status.is_some_and(|s| s.success()),
            "{} did not stop cleanly on SIGTERM ({status:?})\n{}",
            r.name,
            r.log_tail()
        );
    }

    // The store: every (episode, turn) once; every episode that has an outcome has all its
    // turns; each planned episode slot has exactly one complete episode; the only
    // incomplete episodes are attempts abandoned by a killed worker, whose slot was
    // completed by another attempt.
    let stored = common::check_store(&run_dir);
    assert_eq!(
        stored.completed_slots.len() as u32,
        ITERATIONS * EPISODES,
        "planned episodes with a complete attempt: {:?}",
        stored.completed_slots
    );
    let complete: BTreeSet<String> = stored.outcomes.keys().cloned().collect();

    // The learner: every batch of every iteration applied (steps 0..n, the last one
    // publishing), none twice (its optimizer step count equals the distinct batches with
    // labels); the episodes trained at iteration i are exactly the stored episodes of
    // iterations 0..=i (the aggregated DAgger dataset); the examples per iteration are the
    // coordinator's dataset size times the epochs.
    let applied = read_train_log(&learner_dir);
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        metrics
            .iter()
            .map(|m| m["iteration"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        (0..ITERATIONS as u64).collect::<Vec<_>>(),
        "one metrics row per iteration"
    );
    let mut trained_episodes = BTreeSet::new();
    let mut batches_total = 0;
    for i in 0..ITERATIONS {
        let steps: Vec<&Applied> = applied
            .range((i, 0)..(i, u32::MAX))
            .map(|(_, e)| e)
            .collect();
        assert!(!steps.is_empty(), "iteration {i} was never trained");
        for (k, e) in steps.iter().enumerate() {
            assert_eq!(e.step, k as u32, "iteration {i}: a batch is missing");
            assert_eq!(
                e.published_version != 0,
                k + 1 == steps.len(),
                "iteration {i}: only its last batch publishes"
            );
        }
        batches_total += steps.len();
        let episodes: BTreeSet<String> = steps.iter().flat_map(|e| e.episodes.clone()).collect();
        let expected: BTreeSet<String> = complete
            .iter()
            .filter(|id| {
                let it: u32 = id[2..5].parse().unwrap();
                it <= i
            })
            .cloned()
            .collect();
        assert_eq!(
            episodes, expected,
            "iteration {i}: the episodes trained on are not the stored episodes so far"
        );
        assert_eq!(episodes.len() as u32, (i + 1) * EPISODES);
        let examples: u64 = steps.iter().map(|e| e.examples).sum();
        assert_eq!(
            examples,
            metrics[i as usize]["train_examples"].as_u64().unwrap() * EPOCHS,
            "iteration {i}: examples trained"
        );
        trained_episodes = episodes;
    }
    let with_labels = applied.values().filter(|e| e.label_tokens > 0).count() as u64;
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(learner_dir.join("checkpoint/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        state["steps"].as_u64(),
        Some(with_labels),
        "the learner's optimizer steps equal the batches trained: none lost, none twice"
    );
    let final_state = coordinator_state(&run_dir);
    assert_eq!(final_state["generation"], 1, "{final_state}");
    assert_eq!(
        final_state["policy_version"], ITERATIONS as u64,
        "{final_state}"
    );

    // Nothing left behind: processes, sandboxes.
    let needle = root.display().to_string();
    let end = Instant::now() + Duration::from_secs(10);
    let mut left = common::processes_mentioning(&needle);
    while !left.is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        left = common::processes_mentioning(&needle);
    }
    assert!(left.is_empty(), "processes left behind: {left:?}");
    let leftover: Vec<PathBuf> = std::fs::read_dir(&sandboxes)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(leftover.is_empty(), "sandboxes left behind: {leftover:?}");

    println!(
        "chaos: {:.1}s; kills: {worker_kills} workers, 1 learner ({}), 1 coordinator; \
         store: {} events, {} turns, {} complete episodes ({} planned), {} abandoned attempts; \
         learner: {} batches over {ITERATIONS} iterations, {} optimizer steps, {} episodes \
         trained on",
        started.elapsed().as_secs_f64(),
        if mid_iteration {
            "mid-iteration"
        } else {
            "after a publish"
        },
        stored.events,
        stored.turn_events,
        complete.len(),
        ITERATIONS * EPISODES,
        stored.abandoned.len(),
        batches_total,
        with_labels,
        trained_episodes.len()
    );
    drop(dir);
    assert!(!root.exists(), "the test's temp directory is removed");
}
