//! Data-parallel learner ranks as separate processes: one tiny DAgger run with a single
//! learner and the same run with two CPU ranks (`tutor learner --rank R --world-size 2`,
//! meeting through the coordinator's rendezvous) train the same weights, also when rank 1
//! and later rank 0 are killed with SIGKILL mid-run and restarted; a rank whose rank 0
//! never comes fails with a clear error within its deadline.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{coordinator_state, wait_until, Role};

/// β = 1: the oracle teacher acts on every turn, so the episodes (and the batches) do not
/// depend on the student's weights; one worker running one episode at a time, so they
/// reach the dataset in the same order in both runs.
fn config(sandboxes: &Path, iterations: u32, shard: &str) -> String {
    format!(
        r#"
[run]
name = "dp"
workers = 1

[tasks]
source = "toy"
toy_train = 3
toy_heldout = 1
seed = 11

[model]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 32

[coordinator]
iterations = {iterations}
episodes_per_iteration = 3
heldout_episodes = 0
max_turns = 4
max_new_tokens = 8
batch_tokens = 4000
epochs_per_iteration = 1
max_steps_per_iteration = 4
sync_timeout_s = 60.0
shutdown_grace_s = 2.0

[coordinator.beta]
kind = "constant"
start = 1.0

[learner]
learning_rate = 5e-3
warmup_steps = 0
# Adam divides each update by its own gradient's size: with a tiny eps, a weight whose
# gradient nearly cancels gets a full-size step whose sign follows f32 rounding (measured
# with the default 1e-8: 20% of the weights off by more than 1e-5 of their tensor's scale
# after 4 steps, though every loss agreed to 4e-7). A larger eps keeps the comparison
# about the data-parallel sums, not about that amplification.
eps = 1e-3
rendezvous_timeout_s = 60.0
collective_timeout_s = 60.0
shard = "{shard}"
# "full" gathers each layer while it runs, under activation checkpointing.
checkpoint_activations = {checkpointed}

[worker]
capacity = 1
sandbox_root = {:?}
"#,
        sandboxes.display().to_string(),
        checkpointed = shard == "full",
    )
}

/// pytest ends its summary with the wall-clock time (`2 passed in 0.01s`), and that line
/// reaches the episodes' observations: wherever it differs between the two runs (it did on
/// a slower machine, by 0.01 s), they train on different tokens and their losses differ by
/// ~1e-5 for a reason that has nothing to do with the learner. This conftest, added to
/// every task's repository, leaves the summary line out (as `-qq` does; the per-test lines
/// the grader reads stay), so both runs see the same episodes.
const DETERMINISTIC_CONFTEST: &str = "\
def pytest_configure(config):
    config.option.verbose = min(config.option.verbose, -2)
";

fn deterministic_pytest(tasks: &Path) {
    let text = std::fs::read_to_string(tasks).unwrap();
    let mut out = String::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut task: serde_json::Value = serde_json::from_str(line).unwrap();
        task["files"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "path": "conftest.py",
                "content": DETERMINISTIC_CONFTEST,
            }));
        out.push_str(&serde_json::to_string(&task).unwrap());
        out.push('\n');
    }
    std::fs::write(tasks, out).unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Prepared {
    root: PathBuf,
    logs: PathBuf,
    token: String,
    paths: serde_json::Value,
}

impl Prepared {
    fn new(root: &Path, iterations: u32, shard: &str) -> Self {
        let sandboxes = root.join("sandboxes");
        let logs = root.join("logs");
        std::fs::create_dir_all(&sandboxes).unwrap();
        std::fs::create_dir_all(&logs).unwrap();
        let cfg = root.join("dp.toml");
        std::fs::write(&cfg, config(&sandboxes, iterations, shard)).unwrap();
        let paths = common::prepare(&cfg, &root.join("runs"));
        deterministic_pytest(Path::new(paths["train_tasks"].as_str().unwrap()));
        let token = root.join("token");
        std::fs::write(&token, "dp-test-token-0b9e2c47d1a3").unwrap();
        std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        Self {
            root: root.to_path_buf(),
            logs,
            token: token.display().to_string(),
            paths,
        }
    }

    fn p(&self, k: &str) -> String {
        self.paths[k].as_str().unwrap().to_string()
    }

    /// Rank 0 listens on `port` (fixed, so a restarted rank 0 is where the coordinator
    /// looks for it).
    fn learner_rank(&self, rank: usize, world: usize, coordinator: &str, port: u16) -> Role {
        let mut args: Vec<String> = vec![
            "learner".into(),
            "--config".into(),
            self.p("config"),
            "--auth-token-file".into(),
            self.token.clone(),
        ];
        if rank == 0 {
            args.extend([
                "--model-dir".into(),
                self.p("model_dir"),
                "--out-dir".into(),
                self.p("learner_out_dir"),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--addr-file".into(),
                self.root.join("learner.addr").display().to_string(),
            ]);
        }
        if world > 1 {
            args.extend([
                "--rank".into(),
                rank.to_string(),
                "--world-size".into(),
                world.to_string(),
                "--coordinator".into(),
                coordinator.into(),
            ]);
        }
        Role::new(&format!("learner{rank}"), args, &self.logs)
    }
}

/// One line of train-log.jsonl: what the learner trained at (iteration, step): examples,
/// label tokens, loss and the batch's digest.
type TrainLog = BTreeMap<(u64, u64), (u64, u64, f64, String)>;

fn read_train_log(learner_dir: &Path) -> TrainLog {
    let text = std::fs::read_to_string(learner_dir.join("train-log.jsonl")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let n = |k: &str| v[k].as_u64().unwrap();
            (
                (n("iteration"), n("step")),
                (
                    n("examples"),
                    n("label_tokens"),
                    v["loss"].as_f64().unwrap(),
                    v["batch_sha256"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect()
}

/// The f32 tensors of a safetensors file, by name (read here so this test binary does not
/// link libtorch).
fn read_safetensors(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, info) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(info["dtype"], "F32", "{name}");
        let off = info["data_offsets"].as_array().unwrap();
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let v = data[a..b]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), v);
    }
    out
}

/// Runs the tiny run with `world` learner ranks for `iterations` iterations; `kills`
/// lists (iteration, rank): once that iteration's rollouts have begun (the earlier
/// iterations trained and checkpointed), the rank is killed with SIGKILL and started
/// again. Returns the learner's out dir after every process has stopped.
fn run(root: &Path, world: usize, iterations: u32, kills: &[(u64, usize)]) -> PathBuf {
    run_sharded(root, world, iterations, kills, "none")
}

/// `run` with `[learner] shard` set.
fn run_sharded(
    root: &Path,
    world: usize,
    iterations: u32,
    kills: &[(u64, usize)],
    shard: &str,
) -> PathBuf {
    let prep = Prepared::new(root, iterations, shard);
    let cport = free_port();
    let lport = free_port();
    let coordinator_url = format!("http://127.0.0.1:{cport}");
    let mut ranks: Vec<Role> = (0..world)
        .map(|r| prep.learner_rank(r, world, &coordinator_url, lport))
        .collect();
    ranks[0].start();
    let learner_addr = root.join("learner.addr");
    wait_until(
        "learner rank 0 to listen",
        Duration::from_secs(60),
        &mut [&mut ranks[0]],
        || learner_addr.exists(),
    );
    let learner = std::fs::read_to_string(&learner_addr).unwrap();
    let mut coordinator = Role::new(
        "coordinator",
        vec![
            "coordinator".into(),
            "--config".into(),
            prep.p("config"),
            "--run-dir".into(),
            prep.p("run_dir"),
            "--learner".into(),
            format!("http://{}", learner.trim()),
            "--train-tasks".into(),
            prep.p("train_tasks"),
            "--listen".into(),
            format!("127.0.0.1:{cport}"),
            "--auth-token-file".into(),
            prep.token.clone(),
        ],
        &prep.logs,
    );
    coordinator.start();
    for r in ranks.iter_mut().skip(1) {
        r.start();
    }
    let mut worker = Role::new(
        "worker",
        vec![
            "worker".into(),
            "--config".into(),
            prep.p("config"),
            "--coordinator".into(),
            coordinator_url.clone(),
            "--model-dir".into(),
            prep.p("model_dir"),
            "--name".into(),
            "w0".into(),
            "--cache-dir".into(),
            root.join("cache").display().to_string(),
            "--auth-token-file".into(),
            prep.token.clone(),
        ],
        &prep.logs,
    );
    worker.start();
    let run_dir = PathBuf::from(prep.p("run_dir"));
    for &(iteration, rank) in kills {
        {
            let mut roles: Vec<&mut Role> = vec![&mut coordinator, &mut worker];
            roles.extend(ranks.iter_mut());
            wait_until(
                &format!("iteration {iteration}'s rollouts"),
                Duration::from_secs(300),
                &mut roles,
                || {
                    let st = coordinator_state(&run_dir);
                    st["iteration"].as_u64().unwrap_or(0) >= iteration || st["phase"] == "finished"
                },
            );
        }
        assert_ne!(
            coordinator_state(&run_dir)["phase"],
            "finished",
            "the run ended before the kill of rank {rank}"
        );
        println!("kill -9 learner rank {rank} in iteration {iteration}; restarting it");
        ranks[rank].kill9();
        if rank != 0 && shard != "none" {
            // Sharded, rank 0 cannot go on without the lost rank's slice of the optimizer
            // state: it stops by itself, and restarted it resumes from its checkpoint.
            let status = ranks[0].wait_exit(Duration::from_secs(120));
            assert!(
                status.is_some_and(|s| !s.success()),
                "rank 0 did not stop after losing rank {rank} ({status:?})\n{}",
                ranks[0].log_tail()
            );
            let log = std::fs::read_to_string(prep.logs.join("learner0.log")).unwrap();
            assert!(
                log.contains("optimizer state of the lost ranks") && log.contains("--out-dir"),
                "rank 0's log does not say why it stopped:\n{}",
                ranks[0].log_tail()
            );
            ranks[0].start();
        }
        ranks[rank].start();
    }
    {
        let mut roles: Vec<&mut Role> = vec![&mut coordinator, &mut worker];
        roles.extend(ranks.iter_mut());
        wait_until(
            "the run to finish",
            // A guard against hangs, not a speed check.
            Duration::from_secs(300),
            &mut roles,
            || coordinator_state(&run_dir)["phase"] == "finished",
        );
    }
    let status = worker.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "the worker did not leave after the run ({status:?})\n{}",
        worker.log_tail()
    );
    coordinator.signal_term();
    let status = coordinator.wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}",
        coordinator.log_tail()
    );
    // Rank 0 stops on SIGTERM and tells the other ranks, which exit by themselves.
    ranks[0].signal_term();
    for r in ranks.iter_mut() {
        let status = r.wait_exit(Duration::from_secs(60));
        assert!(
            status.is_some_and(|s| s.success()),
            "{} did not stop cleanly ({status:?})\n{}",
            r.name,
            r.log_tail()
        );
    }
    // The episodes ran the tests, and pytest's timing stayed out of them.
    let events = std::fs::read(run_dir.join("trajectories/events.log")).unwrap();
    let has = |s: &[u8]| events.windows(s.len()).any(|w| w == s);
    assert!(has(b"[100%]"), "no episode ran the tests");
    assert!(
        !has(b" passed in "),
        "pytest's wall-clock time reached the episodes"
    );
    if world > 1 {
        let log = std::fs::read_to_string(prep.logs.join("learner1.log")).unwrap();
        assert!(log.contains("joined the learner group"), "{log}");
        assert!(log.contains("rank 0 ended the run"), "{log}");
    }
    PathBuf::from(prep.p("learner_out_dir"))
}

/// Both runs trained the same batches (the same tokens, by digest), with the losses of the
/// whole batch (not of a rank's share).
fn assert_same_batches(a: &TrainLog, b: &TrainLog) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, (ex_a, lab_a, loss_a, digest_a)) in a {
        let (ex_b, lab_b, loss_b, digest_b) = &b[k];
        assert_eq!((ex_a, lab_a), (ex_b, lab_b), "batch {k:?} differs");
        assert_eq!(
            digest_a, digest_b,
            "batch {k:?}: the two runs' learners got different tokens (their episodes differ)"
        );
        let loss_b = *loss_b;
        assert!(
            (loss_a - loss_b).abs() <= 1e-5 * loss_a.abs().max(1.0),
            "batch {k:?}: loss {loss_a} with one rank, {loss_b} with two"
        );
    }
}

/// The final weights of two runs agree to f32 rounding of the split sums (1e-5 of each
/// tensor's scale), and training moved them far more than that.
fn assert_same_weights(single: &Path, double: &Path) {
    let w1 = read_safetensors(&single.join("checkpoint/model.safetensors"));
    let w2 = read_safetensors(&double.join("checkpoint/model.safetensors"));
    let w0 = read_safetensors(&single.join("versions/policy-v000000.safetensors"));
    assert_eq!(w1.keys().collect::<Vec<_>>(), w2.keys().collect::<Vec<_>>());
    let (mut num, mut den, mut moved) = (0f64, 0f64, 0f64);
    let (mut total, mut off, mut worst_all) = (0usize, 0usize, 0f32);
    for (name, x) in &w1 {
        let y = &w2[name];
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        let mut worst = 0f32;
        for ((p, q), z) in x.iter().zip(y).zip(&w0[name]) {
            num += ((p - q) as f64).powi(2);
            den += (*p as f64).powi(2);
            moved += ((p - z) as f64).powi(2);
            total += 1;
            if (p - q).abs() > 1e-5 * scale {
                off += 1;
            }
            worst = worst.max((p - q).abs() / scale);
        }
        worst_all = worst_all.max(worst);
    }
    println!(
        "{off} of {total} weights differ by more than 1e-5 of their tensor's scale; \
         the largest difference is {worst_all:e} of its tensor's scale"
    );
    let rel = (num / den).sqrt();
    let rel_moved = (moved / den).sqrt();
    // Training moved the weights far more than the two runs differ (f32 rounding of the
    // split sums: ~1e-7 relative per step).
    assert!(rel_moved > 1e-3, "the run barely trained: {rel_moved}");
    // Measured: 1.7e-7 of the tensor's scale at most (f32 rounding of the split sums).
    assert_eq!(
        off, 0,
        "weights differ beyond f32 rounding (worst {worst_all:e})"
    );
    assert!(
        rel <= 1e-5,
        "final weights differ between 1 and 2 learner ranks: relative error {rel}"
    );
}

#[test]
fn two_cpu_learner_processes_train_the_same_weights_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let single = run(&root.join("one"), 1, 1, &[]);
    let double = run(&root.join("two"), 2, 1, &[]);

    // The same batches reached the learner in both runs (else the comparison below says
    // nothing about the learner), and the losses rank 0 reported are those of the whole
    // batch, not of its share.
    let (a, b) = (read_train_log(&single), read_train_log(&double));
    assert!(a.len() >= 2, "too few steps to compare: {a:?}");
    println!("train log, one rank: {a:?}\ntwo ranks: {b:?}");
    // Rank 1 really trained a share: batches of one example would leave it nothing.
    assert!(
        a.values().filter(|(examples, ..)| *examples >= 2).count() >= 2,
        "batches too small to split: {a:?}"
    );
    assert_same_batches(&a, &b);

    assert_same_weights(&single, &double);
}

/// Rank 1 dies (SIGKILL) between two iterations and is restarted: rank 0 forms the group
/// again and the restarted rank joins with rank 0's state. Later rank 0 dies and is
/// restarted: it resumes from its checkpoint and rank 1, whose collective broke, joins the
/// new group. The run ends with the weights of one uninterrupted learner.
#[test]
fn killed_and_restarted_ranks_rejoin_and_train_the_same_weights_as_one() {
    killed_ranks_train_the_weights_of_one_learner("none");
}

/// Three iterations with one learner, then with two ranks under `shard` where rank 1 is
/// killed (SIGKILL) in iteration 1 and rank 0 in iteration 2, each restarted: the same
/// batches and final weights. Returns the directory (`two/logs` has the ranks' logs).
fn killed_ranks_train_the_weights_of_one_learner(shard: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let single = run(&root.join("one"), 1, 3, &[]);
    let double = run_sharded(&root.join("two"), 2, 3, &[(1, 1), (2, 0)], shard);
    let (a, b) = (read_train_log(&single), read_train_log(&double));
    assert!(
        a.keys().any(|(i, _)| *i == 2),
        "the last iteration trained: {a:?}"
    );
    assert_same_batches(&a, &b);
    assert_same_weights(&single, &double);
    dir
}

/// `[learner] shard = "full"` (ZeRO-3: parameters sharded too, one layer gathered at a
/// time) over two learner processes: the same weights as one unsharded learner (rank 0
/// publishes them), also when rank 1 is killed (rank 0, without rank 1's slices, stops
/// and is restarted) and when rank 0 is killed and restarted: each time rank 0 resumes
/// from its checkpoint, which holds the whole state gathered from both ranks, and sends
/// rank 1 its slice again. (`"optimizer"` and `"gradients"` are tested in-process in
/// learner/tests/sharded.rs.)
#[test]
fn sharded_learner_processes_train_the_same_weights_and_survive_rank_zeros_restart() {
    let dir = killed_ranks_train_the_weights_of_one_learner("full");
    let root = dir.path().canonicalize().unwrap();
    let log = std::fs::read_to_string(root.join("two/logs/learner1.log")).unwrap();
    assert!(
        log.matches("joined the learner group").count() >= 2,
        "rank 1 joined rank 0's new group after the restart: {log}"
    );
    assert!(
        log.contains("sharded training state") && log.contains("full"),
        "rank 1 kept a slice: {log}"
    );
    // Rank 0 stopped once, when rank 1 was killed; the clean end of the run is no stop.
    let log0 = std::fs::read_to_string(root.join("two/logs/learner0.log")).unwrap();
    // Built for its group, rank 0 kept its state in host memory until the group formed
    // (the staged path ran; on a CPU learner the move itself moves nothing).
    assert!(
        log0.contains("the training state moved from host memory to its device"),
        "{log0}"
    );
    let stops = log0
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("the trainer thread panicked"))
        .count();
    assert_eq!(stops, 1, "{log0}");
}

/// `[learner] shard = "gradients"` (ZeRO-2) over two learner processes, killed and
/// restarted as above: the same weights as one unsharded learner.
#[test]
fn gradient_sharded_learner_processes_survive_restarts_with_the_weights_of_one() {
    let dir = killed_ranks_train_the_weights_of_one_learner("gradients");
    let log = std::fs::read_to_string(dir.path().join("two/logs/learner1.log")).unwrap();
    assert!(
        log.contains("sharded training state") && log.contains("gradients"),
        "rank 1 kept a slice: {log}"
    );
}

#[test]
fn a_rank_without_rank_zero_fails_clearly_within_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let prep = Prepared::new(&root, 1, "none");
    // A coordinator is up (it answers the rendezvous), but no learner rank 0 ever
    // publishes there.
    let cport = free_port();
    let coordinator_url = format!("http://127.0.0.1:{cport}");
    let mut coordinator = Role::new(
        "coordinator",
        vec![
            "coordinator".into(),
            "--config".into(),
            prep.p("config"),
            "--run-dir".into(),
            prep.p("run_dir"),
            "--learner".into(),
            format!("http://127.0.0.1:{}", free_port()),
            "--train-tasks".into(),
            prep.p("train_tasks"),
            "--listen".into(),
            format!("127.0.0.1:{cport}"),
            "--addr-file".into(),
            root.join("coordinator.addr").display().to_string(),
            "--auth-token-file".into(),
            prep.token.clone(),
        ],
        &prep.logs,
    );
    coordinator.start();
    wait_until(
        "the coordinator to listen",
        Duration::from_secs(60),
        &mut [&mut coordinator],
        || root.join("coordinator.addr").exists(),
    );
    let mut rank1 = prep
        .learner_rank(1, 2, &coordinator_url, 0)
        .with_env("TUTOR_LEARNER__RENDEZVOUS_TIMEOUT_S", "2");
    rank1.start();
    // Its deadline is 2 s; the bound here only guards against a hang.
    let status = rank1.wait_exit(Duration::from_secs(60));
    let stderr = std::fs::read_to_string(prep.logs.join("learner1.log")).unwrap();
    assert!(
        status.is_some_and(|s| !s.success()),
        "rank 1 did not fail ({status:?}):\n{stderr}"
    );
    for needle in [
        "rank 1 of 2",
        "rank 0 published no rendezvous",
        coordinator_url.as_str(),
        "NotFound",
    ] {
        assert!(
            stderr.contains(needle),
            "{needle:?} missing from:\n{stderr}"
        );
    }
}
