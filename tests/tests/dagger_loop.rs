//! One tiny DAgger run through the real service boundaries: `tutor run` starts two
//! data-parallel learner ranks, the coordinator and two workers as separate processes on
//! 127.0.0.1; learner rank 0 pushes the policy versions to the workers over the weights
//! broadcast (CPU collective).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use tutor_proto::episode_event::Event;

const CONFIG: &str = r#"
[run]
name = "itest"
workers = 2

[tasks]
source = "toy"
toy_train = 6
toy_heldout = 2
seed = 3

[model]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 32

[coordinator]
iterations = 1
episodes_per_iteration = 6
heldout_episodes = 2
max_turns = 5
max_new_tokens = 16
batch_tokens = 1000000   # one batch per epoch: every step sees the same data
epochs_per_iteration = 6
max_steps_per_iteration = 6

[coordinator.beta]
kind = "constant"
start = 0.5

[learner]
learning_rate = 5e-3
warmup_steps = 0
# The DAgger batches train as prefix-shared tree rows across the process boundary.
packing = "tree"
# Two learner ranks (CPU collective), meeting through the coordinator's rendezvous.
world_size = 2
# Every version also goes to the two workers over a collective.
weight_receivers = 2

[worker]
weights_from = "broadcast"
"#;

#[test]
fn dagger_iteration_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("itest.toml");
    let out_dir = dir.path().join("runs");
    std::fs::write(&cfg, format!("{CONFIG}\n")).unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_PYTHON", common::python())
        .env("TUTOR_RUN__OUT_DIR", &out_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let runs: Vec<_> = std::fs::read_dir(&out_dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let logs = runs.first().map(|r| {
        std::fs::read_dir(r.join("logs"))
            .unwrap()
            .flatten()
            .map(|e| {
                format!(
                    "== {}\n{}",
                    e.path().display(),
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    assert!(
        out.status.success(),
        "tutor run failed\nstdout:\n{stdout}\nstderr:\n{stderr}\nlogs:\n{}",
        logs.unwrap_or_default()
    );
    assert_eq!(runs.len(), 1, "one run directory");
    let run = &runs[0];
    assert!(
        stdout.contains("heldout_solve"),
        "the table header is printed:\n{stdout}"
    );

    // Every leased episode's turns reached the store exactly once, with its outcome.
    let (events, _) = tutor_coordinator::store::scan(&run.join("trajectories/events.log")).unwrap();
    let mut keys = BTreeSet::new();
    let mut turns: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut outcomes: BTreeMap<String, u32> = BTreeMap::new();
    // The coordinator recorded whom it leased each episode to before its first event, and
    // that worker sent every event of it.
    let mut granted: BTreeMap<String, String> = BTreeMap::new();
    for ev in &events {
        if let Some(Event::Turn(_) | Event::Outcome(_)) = &ev.event {
            assert_eq!(
                granted.get(&ev.episode_id),
                Some(&ev.worker_id),
                "{}: its events come from the worker its lease record names",
                ev.episode_id
            );
        }
        match ev.event.as_ref().unwrap() {
            Event::LeaseGranted(g) => {
                assert_eq!(ev.worker_id, "coordinator");
                assert!(
                    granted
                        .insert(ev.episode_id.clone(), g.worker_id.clone())
                        .is_none(),
                    "lease recorded twice: {}",
                    ev.episode_id
                );
            }
            Event::Turn(t) => {
                assert!(
                    keys.insert((ev.episode_id.clone(), t.turn_index)),
                    "turn stored twice: {} {}",
                    ev.episode_id,
                    t.turn_index
                );
                turns
                    .entry(ev.episode_id.clone())
                    .or_default()
                    .push(t.turn_index);
            }
            Event::Outcome(o) => {
                assert!(
                    outcomes
                        .insert(ev.episode_id.clone(), o.num_turns)
                        .is_none(),
                    "outcome stored twice"
                );
            }
            Event::LeaseExpired(e) => {
                panic!("no lease expires in this run: {} {e:?}", ev.episode_id)
            }
        }
    }
    assert_eq!(
        outcomes.len(),
        10,
        "6 training + 2 held-out episodes, then 2 of the final evaluation: {outcomes:?}"
    );
    // The final evaluation runs the trained policy (version 1) on the held-out tasks only,
    // as the iteration after the last.
    let finals: Vec<&String> = outcomes
        .keys()
        .filter(|k| k.starts_with("it001-"))
        .collect();
    assert_eq!(finals.len(), 2, "{outcomes:?}");
    assert!(finals.iter().all(|k| k.contains("-eval")), "{finals:?}");
    let final_eval: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("final_eval.json")).unwrap())
            .unwrap();
    assert_eq!(final_eval["iteration"], 1, "{final_eval}");
    assert_eq!(final_eval["heldout_episodes"], 2, "{final_eval}");
    assert_eq!(final_eval["policy_version"], 1, "{final_eval}");
    assert!(
        stdout.contains("\nfinal ") || stdout.contains(" final "),
        "{stdout}"
    );
    for (ep, n) in &outcomes {
        let mut got = turns.get(ep).cloned().unwrap_or_default();
        got.sort();
        assert_eq!(
            got,
            (0..*n).collect::<Vec<_>>(),
            "episode {ep}: turns 0..{n} each exactly once"
        );
        assert!(*n >= 1);
    }
    assert_eq!(
        turns.keys().collect::<BTreeSet<_>>(),
        outcomes.keys().collect::<BTreeSet<_>>()
    );

    // The learner's loss goes down on repeated data (one identical batch per epoch).
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let losses: Vec<f64> = row["step_losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 6, "{row}");
    assert!(
        losses.last().unwrap() < &(losses[0] * 0.9),
        "loss did not go down: {losses:?}"
    );
    assert!(row["teacher_labels_total"].as_u64().unwrap() > 0);

    // Every process got the run's token from a file only its owner can read.
    {
        use std::os::unix::fs::PermissionsExt;
        let token = std::fs::metadata(run.join("auth-token")).unwrap();
        assert_eq!(token.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read_to_string(run.join("auth-token"))
                .unwrap()
                .len(),
            64
        );
        assert!(
            run.join("addr/metrics").exists(),
            "the metrics address is written"
        );
    }

    // Rank 1 trained with rank 0 and ended when rank 0 did.
    let rank1 = std::fs::read_to_string(run.join("logs/learner-1.log")).unwrap();
    assert!(rank1.contains("joined the learner group"), "{rank1}");
    assert!(rank1.contains("rank 0 ended the run"), "{rank1}");

    // Both workers got version 1 over the broadcast, not over gRPC.
    for w in ["worker-0", "worker-1"] {
        let log = std::fs::read_to_string(run.join(format!("logs/{w}.log"))).unwrap();
        let loaded: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("loaded policy version"))
            .collect();
        assert!(
            loaded
                .iter()
                .any(|l| l.contains("version=1") && l.contains("via=\"broadcast\"")),
            "{w} did not load version 1 from the broadcast:\n{log}"
        );
        // Version 0 may come either way (a worker's first lease can come before both
        // workers have joined the group); version 1 comes long after.
        assert!(
            !log.lines()
                .any(|l| l.contains("downloading it over gRPC") && l.contains("version=1")),
            "{log}"
        );
    }
    let learner = std::fs::read_to_string(run.join("logs/learner.log")).unwrap();
    assert!(
        learner.contains("sent policy version to the weight receivers"),
        "{learner}"
    );

    // The workers end on the new policy version.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["final_version"], 1, "{summary}");
    let versions = summary["worker_versions"].as_object().unwrap();
    assert_eq!(versions.len(), 2, "{summary}");
    assert!(versions.values().all(|v| v == 1), "{summary}");
    assert_eq!(summary["final_eval"]["heldout_episodes"], 2, "{summary}");
    assert_eq!(summary["final_eval"]["policy_version"], 1, "{summary}");
    // `tutor report` reads the run back: the table and one line per stored episode.
    let report = common::tutor(&["report", run.to_str().unwrap(), "--episodes"]);
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(
        report.status.success(),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );
    assert!(text.contains("heldout_solve"), "{text}");
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("final ")),
        "the final evaluation's row: {text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("it000-")).count(),
        8,
        "{text}"
    );
    assert!(!text.contains("INCOMPLETE"), "{text}");
    // The final checkpoint is a loadable model directory.
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(run.join("checkpoint").join(f).exists(), "checkpoint/{f}");
    }
}
