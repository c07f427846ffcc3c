//! A tiny DAPO run through the real service boundaries: `tutor run` with
//! `algorithm = "dapo"` starts the learner, the coordinator and two workers as separate
//! processes; the student samples groups, dynamic sampling drops and refills groups, the
//! learner trains with the clipped objective.
//!
//! The untrained student never fixes a bug, so every group would have equal rewards and
//! be dropped. The tasks here carry a coin-flip `conftest.py`: in each grading session,
//! with probability 1/2, every failing test is reported as passed. Outcomes (and rewards)
//! then vary within groups whatever the student does.

mod common;

use std::collections::BTreeMap;

use tutor_proto::episode_event::Event;
use tutor_proto::{Actor, OutcomeStatus};

const COIN_CONFTEST: &str = r#"import os

import pytest

# tutor's DAPO smoke test: with probability 1/2 per grading session, failures pass.
_PASS_ALL = os.urandom(1)[0] % 2 == 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _PASS_ALL and report.failed:
        report.outcome = "passed"
"#;

/// The student of the in-process runs: a model made for the run.
const OWN_MODEL: &str = r#"
[model]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 32
"#;

/// The run's config: `model` is its `[model]` section, `extra` goes at the end.
fn config(
    train_path: &std::path::Path,
    heldout_path: &std::path::Path,
    model: &str,
    extra: &str,
) -> String {
    format!(
        r#"
[run]
name = "dapo-itest"
workers = 2

[tasks]
source = "file"
train_path = "{}"
heldout_path = "{}"

{model}

[coordinator]
algorithm = "dapo"
iterations = 2
group_size = 3
tasks_per_iteration = 2
max_refill_rounds = 3
heldout_episodes = 0
max_turns = 2
max_new_tokens = 8
temperature = 0.5            # ignored: dapo samples unbiased (temperature 1)
# The random student only writes malformed replies; train on them so the kept groups
# carry gradient (the default masks them, as docs/architecture.md ("Objectives") asks).
mask_format_errors = false
batch_tokens = 1000000
max_seq_len = 4096
epochs_per_iteration = 1
max_steps_per_iteration = 2

[learner]
learning_rate = 1e-3
warmup_steps = 0
clip_eps_low = 0.2
clip_eps_high = 0.28

{extra}
"#,
        train_path.display(),
        heldout_path.display()
    )
}

#[test]
fn dapo_run_across_processes_reports_groups_and_a_finite_loss() {
    let dir = tempfile::tempdir().unwrap();
    dapo_run(dir.path(), OWN_MODEL, "");
}

/// The same run with `tutor serve` as the workers' student engine (`[worker.student] kind
/// = "engine"`): both workers drive one engine and send it each policy version as tensors
/// over the CPU collective (`reload = "distributed"`: no directory shared with the
/// engine); every turn comes from the episode's version, and the learner's first step
/// sees ratio 1 on every token (the engine's log-probs are the learner's). Loading from
/// disk is tested against the same server in engine_student.rs.
#[test]
fn dapo_run_with_tutor_serve_as_the_student_engine() {
    run_on_tutor_serve("sglang", "");
}

/// The same run with the workers speaking vLLM's API to `tutor serve` (`api = "vllm"`):
/// turns on `/v1/completions`, each version through vLLM's weight-transfer control plane.
/// Both workers reload each version at once; the engine takes one update at a time, so
/// one of them waits (409) and then finds the version served.
#[test]
fn dapo_run_with_tutor_serve_speaking_vllms_api() {
    run_on_tutor_serve("vllm", "");
}

/// The same run with the learner loading each version into `tutor serve` itself, through
/// vLLM's control plane (`[worker.student] loaded_by = "learner"`; `[learner] engines`
/// defaults to the workers' base_url): the weights go once, straight from the learner;
/// the workers never load a version, they wait for the engine to serve the leased one. The
/// engine starts from placeholder weights (`--load-format dummy`, as the Kubernetes overlay
/// `engine` starts it, from a prepared run directory with no checkpoint): the learner's
/// first step still sees ratio 1 on every token, so every turn came from the learner's
/// weights, none from the engine's own.
#[test]
fn dapo_run_with_the_learner_loading_tutor_serve() {
    run_on_tutor_serve("vllm", "loaded_by = \"learner\"\n");
}

/// `dapo_run` with both workers' student on one `tutor serve`, speaking `api`, each
/// version sent as tensors over the CPU collective (`student` adds to `[worker.student]`);
/// checks what such a run must show.
fn run_on_tutor_serve(api: &str, student: &str) {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("student"), &["4096"]);
    let mut serve_args = vec!["--max-batch", "4", "--distributed-updates"];
    if student.contains("loaded_by = \"learner\"") {
        serve_args.extend(["--load-format", "dummy"]);
    }
    let served = common::serve(&model, "student", dir.path(), &serve_args);
    let run = dapo_run(
        dir.path(),
        &format!("[model]\ninit_from = \"{}\"\n", model.display()),
        &format!(
            "[worker.student]\nkind = \"engine\"\napi = \"{api}\"\nbase_url = \"http://{}\"\nreload = \"distributed\"\n{student}",
            served.addr
        ),
    );
    // The engine loaded every version an episode ran on, under its version, and nothing
    // was generated in-process by the workers.
    let serve_log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    let (events, _) = tutor_coordinator::store::scan(&run.join("trajectories/events.log")).unwrap();
    let mut versions = std::collections::BTreeSet::new();
    for ev in &events {
        if let Some(Event::Outcome(o)) = ev.event.as_ref() {
            versions.insert(o.policy_version);
            // No turn failed on the engine (down, refused, another version's answer).
            assert_ne!(
                o.status,
                OutcomeStatus::SandboxError as i32,
                "{}: {}",
                ev.episode_id,
                o.error
            );
            assert!(
                !o.error.contains("student"),
                "{}: {}",
                ev.episode_id,
                o.error
            );
        }
    }
    assert!(!versions.is_empty());
    for v in &versions {
        assert!(
            serve_log.contains(&format!("version=tutor-v{v}-")),
            "the engine never loaded version {v}:\n{serve_log}"
        );
    }
    let logs = common::role_logs(&run, "worker");
    assert!(logs.contains("student engine answers"), "{logs}");
    if student.contains("loaded_by = \"learner\"") {
        assert!(
            serve_log.contains("--load-format dummy: serving placeholder weights"),
            "{serve_log}"
        );
        // The learner loaded every version, once each; no worker loaded one.
        let learner_log = common::role_logs(&run, "learner");
        common::assert_the_learner_loaded_each_version_once(
            &versions,
            &learner_log,
            &logs,
            &serve_log,
        );
    }
    assert!(
        serve_log.contains("received weights over the collective"),
        "{serve_log}"
    );
    if api == "vllm" {
        // Through vLLM's control plane, which pauses the engine around each update.
        assert!(
            serve_log.contains("paused: new generation requests wait"),
            "{serve_log}"
        );
    }
}

/// Runs DAPO on coin-flip toy tasks under `dir` and checks what every such run must show;
/// returns the run directory.
fn dapo_run(dir: &std::path::Path, model: &str, extra: &str) -> std::path::PathBuf {
    // Toy tasks (3 to train on, 1 held out), each with the coin-flip conftest.py in its repository.
    let toy = dir.join("toy.jsonl");
    let out = common::tutor(&[
        "tasks",
        "toy",
        "--n",
        "4",
        "--seed",
        "5",
        "--out",
        toy.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let train = dir.join("train.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&toy)
        .unwrap()
        .lines()
        .map(|l| {
            let mut task: serde_json::Value = serde_json::from_str(l).unwrap();
            task["files"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({"path": "conftest.py", "content": COIN_CONFTEST}));
            task.to_string()
        })
        .collect();
    assert_eq!(lines.len(), 4);
    std::fs::write(&train, lines[..3].join("\n") + "\n").unwrap();
    // A held-out file (never used: heldout_episodes = 0) with a task of its own.
    let heldout = dir.join("heldout.jsonl");
    std::fs::write(&heldout, format!("{}\n", lines[3])).unwrap();

    let cfg = dir.join("dapo.toml");
    let out_dir = dir.join("runs");
    std::fs::write(&cfg, config(&train, &heldout, model, extra)).unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_PYTHON", common::python())
        .env("TUTOR_RUN__OUT_DIR", &out_dir)
        .output()
        .unwrap();
    let runs: Vec<_> = std::fs::read_dir(&out_dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let logs = runs
        .first()
        .and_then(|r| std::fs::read_dir(r.join("logs")).ok())
        .map(|d| {
            d.flatten()
                .map(|e| {
                    format!(
                        "== {}\n{}",
                        e.path().display(),
                        std::fs::read_to_string(e.path()).unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default();
    assert!(
        out.status.success(),
        "tutor run failed\nstdout:\n{}\nstderr:\n{}\nlogs:\n{logs}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(runs.len(), 1);
    let run = &runs[0];

    // Every training episode: the student acted (β = 0) and sampled unbiased.
    let (events, _) = tutor_coordinator::store::scan(&run.join("trajectories/events.log")).unwrap();
    let mut statuses = std::collections::BTreeSet::new();
    let mut turns = 0;
    // Per episode: sampled tokens (all trained: mask_format_errors = false) and reward.
    let mut sampled: BTreeMap<String, usize> = BTreeMap::new();
    let mut rewards: BTreeMap<String, f64> = BTreeMap::new();
    for ev in &events {
        match ev.event.as_ref().unwrap() {
            Event::Turn(t) => {
                turns += 1;
                *sampled.entry(ev.episode_id.clone()).or_default() += t.student_tokens.len();
                assert_eq!(t.executed, Actor::Student as i32, "{}", ev.episode_id);
                assert!(t.unbiased_sampling && t.sampling_temperature == 1.0);
                assert_eq!(t.student_logprobs.len(), t.student_tokens.len());
            }
            Event::Outcome(o) => {
                statuses.insert(o.status);
                if tutor_coordinator::rollouts::is_ungraded(o) {
                    // No verdict (e.g. a sandbox that failed under load): the coordinator
                    // leaves it out of its group, so the expected loss must too.
                    eprintln!(
                        "ungraded episode {}: status {} error {:?}",
                        ev.episode_id, o.status, o.error
                    );
                    continue;
                }
                let resolved = o.status == OutcomeStatus::Resolved as i32;
                rewards.insert(ev.episode_id.clone(), if resolved { 1.0 } else { 0.0 });
            }
            Event::LeaseExpired(e) => {
                panic!("no lease expires in this run: {} {e:?}", ev.episode_id)
            }
            Event::LeaseGranted(_) => {}
        }
    }
    assert!(turns > 0);
    assert!(
        statuses.contains(&(OutcomeStatus::Resolved as i32))
            && statuses.contains(&(OutcomeStatus::Unresolved as i32)),
        "the coin-flip grader gives both outcomes: {statuses:?}\n{logs}"
    );

    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    eprintln!("metrics.jsonl:\n{metrics}");
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{metrics}");
    let mut trained_rows = 0;
    for row in &rows {
        assert_eq!(row["algorithm"], "dapo", "{row}");
        assert_eq!(row["beta"].as_f64(), Some(0.0), "{row}");
        let kept = row["groups_kept"].as_u64().unwrap();
        let dropped = row["groups_dropped"].as_u64().unwrap();
        let refills = row["refill_rounds"].as_u64().unwrap();
        let episodes = row["episodes"].as_u64().unwrap();
        // Every leased group finished with G = 3 episodes and was kept or dropped.
        assert_eq!(episodes, 3 * (kept + dropped), "{row}");
        assert!(
            kept <= 2,
            "refills ask for no more than the missing groups: {row}"
        );
        // Refill rounds run while groups are missing, up to the cap of 3.
        if kept < 2 {
            assert_eq!(refills, 3, "{row}");
        }
        assert!(refills <= 3, "{row}");
        // Each refill round leases the 1 or 2 groups still missing.
        assert!(
            kept + dropped >= 2 + refills && kept + dropped <= 2 + 2 * refills,
            "{row}"
        );
        let reward = row["mean_reward"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&reward), "{row}");
        let losses: Vec<f64> = row["step_losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!(losses.iter().all(|l| l.is_finite()), "{row}");
        assert!(row["train_loss"].as_f64().unwrap().is_finite(), "{row}");
        if kept > 0 {
            // Kept groups are trained on: one step (the batch fits in one), loss reported.
            assert_eq!(losses.len(), 1, "{row}");
            // The episodes were sampled with the weights the step starts from, so every
            // ratio is 1 if the learner's log-probs line up with the workers' token for
            // token, and the loss is −Σ_i n_i Â_i / Σ_i n_i over the kept groups' episodes
            // (n_i sampled tokens, Â_i from the stored outcomes).
            let iteration = row["iteration"].as_u64().unwrap();
            let (want, examples) = loss_at_ratio_one(iteration, &rewards, &sampled);
            assert!(
                (losses[0] - want).abs() < 1e-3,
                "learner loss {} vs {want} at ratio 1: {row}",
                losses[0]
            );
            // One example per graded episode of a kept group (3 each unless one had no
            // verdict).
            assert_eq!(row["train_examples"].as_u64(), Some(examples), "{row}");
            trained_rows += 1;
        } else {
            assert!(losses.is_empty(), "{row}");
            assert_eq!(row["train_examples"].as_u64(), Some(0), "{row}");
        }
    }
    // P(no group kept in an iteration) = (1/4)^5 with G = 3 and 5 groups leased.
    assert!(trained_rows >= 1, "{metrics}");
    run.to_path_buf()
}

/// DAPO's loss at r = 1 over the groups of `iteration` whose rewards differ, and the
/// number of episodes in those groups. `rewards` holds graded episodes only (an ungraded
/// one is out of its group). Episode ids are `it{iteration:03}-train{slot:04}-…`; with no
/// held-out slots, slot / G is the group.
fn loss_at_ratio_one(
    iteration: u64,
    rewards: &BTreeMap<String, f64>,
    sampled: &BTreeMap<String, usize>,
) -> (f64, u64) {
    let prefix = format!("it{iteration:03}-train");
    let mut groups: BTreeMap<usize, Vec<(f64, usize)>> = BTreeMap::new();
    for (id, r) in rewards {
        let Some(rest) = id.strip_prefix(&prefix) else {
            continue;
        };
        let slot: usize = rest[..4].parse().unwrap();
        groups
            .entry(slot / 3)
            .or_default()
            .push((*r, sampled.get(id).copied().unwrap_or(0)));
    }
    let (mut sum, mut n, mut examples) = (0.0, 0.0, 0);
    for members in groups.values() {
        let g = members.len() as f64;
        let mean = members.iter().map(|m| m.0).sum::<f64>() / g;
        let std = (members.iter().map(|m| (m.0 - mean).powi(2)).sum::<f64>() / g).sqrt();
        if members.iter().all(|m| m.0 == members[0].0) {
            continue;
        }
        for (r, tokens) in members {
            let adv = (r - mean) / (std + 1e-6);
            sum += adv * *tokens as f64;
            n += *tokens as f64;
            examples += 1;
        }
    }
    (-sum / n, examples)
}
