//! The service over real gRPC: batches the learner cannot train on are refused and
//! counted, non-finite steps are skipped without touching the weights or publishing, and
//! a panic of the trainer thread reaches the callers and ends `serve`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tch::Device;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::Code;
use tutor_policy::{ModelConfig, Policy};
use tutor_proto::learner_client::LearnerClient;
use tutor_proto::{LossKind, TrainExample, TrainProgress};

use super::*;

/// A batch of this run id makes the trainer thread panic (`TrainerHost::step`, tests only).
pub(super) const PANIC_RUN_ID: &str = "test: the trainer thread panics";
pub(super) const PANIC_MESSAGE: &str = "injected trainer panic (test)";

/// Every wait of these tests is bounded by this: a broken learner fails them, never hangs.
const LIMIT: Duration = Duration::from_secs(60);

const VOCAB: usize = 64;

/// A tiny model (vocabulary of `VOCAB`) in `root/model`.
fn model_dir(root: &Path) -> PathBuf {
    let mut mc = ModelConfig::tiny(VOCAB);
    mc.hidden_size = 32;
    mc.intermediate_size = 64;
    mc.head_dim = 8;
    let dir = root.join("model");
    Policy::new(mc, Device::Cpu, 3).save_dir(&dir).unwrap();
    dir
}

fn config() -> LearnerConfig {
    LearnerConfig {
        learning_rate: 1e-2,
        warmup_steps: 0,
        ..Default::default()
    }
}

/// A learner handle behind a Learner server on a free port: the test keeps the handle.
async fn start_handle(root: &Path) -> (LearnerHandle, LearnerClient<Channel>) {
    let out_dir = root.join("out");
    let store = WeightsStore::new(&out_dir.join("versions")).unwrap();
    let handle = LearnerHandle::start(&model_dir(root), &out_dir, config(), store).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .add_service(LearnerServer::new(handle.clone()))
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    (handle, connect(addr).await)
}

async fn connect(addr: SocketAddr) -> LearnerClient<Channel> {
    tokio::time::timeout(LIMIT, LearnerClient::connect(format!("http://{addr}")))
        .await
        .expect("connecting in time")
        .unwrap()
}

/// Sends one batch on a Train stream of its own: its progress or the stream's error.
async fn train(
    client: &mut LearnerClient<Channel>,
    batch: TrainBatch,
) -> Result<TrainProgress, Status> {
    let call = async {
        let mut progress = client
            .train(tokio_stream::iter(vec![batch]))
            .await?
            .into_inner();
        progress
            .message()
            .await?
            .ok_or_else(|| Status::unknown("the train stream ended without a reply"))
    };
    tokio::time::timeout(LIMIT, call)
        .await
        .expect("the learner answers the batch in time")
}

async fn status(client: &mut LearnerClient<Channel>) -> Result<LearnerStatus, Status> {
    tokio::time::timeout(LIMIT, client.status(LearnerStatusRequest {}))
        .await
        .expect("the learner answers Status in time")
        .map(Response::into_inner)
}

fn batch(iteration: u32, step: u32, publish: bool, examples: Vec<TrainExample>) -> TrainBatch {
    TrainBatch {
        iteration,
        step,
        examples,
        publish,
        run_id: "run-a".into(),
    }
}

fn cross_entropy(episode: &str, turn: u32, tokens: Vec<u32>) -> TrainExample {
    let n = tokens.len();
    TrainExample {
        episode_id: episode.into(),
        turn_index: turn,
        tokens,
        loss_mask: (0..n).map(|j| j >= n / 2).collect(),
        ..Default::default()
    }
}

/// A DAPO example whose ratio overflows: its old log-probs (−200, finite, so the batch is
/// taken) make r = exp(ℓ_θ + 200) infinite in f32, and with Â < 0 the unclipped term
/// −∞ is the surrogate's minimum: the loss is +∞ and the gradients are not finite.
fn overflowing_dapo(episode: &str) -> TrainExample {
    let tokens = vec![1u32, 5, 9, 13, 17, 21];
    let trained = |j: usize| j >= 3;
    TrainExample {
        episode_id: episode.into(),
        turn_index: 0,
        loss_mask: (0..tokens.len()).map(trained).collect(),
        advantages: (0..tokens.len())
            .map(|j| if trained(j) { -1.0 } else { 0.0 })
            .collect(),
        old_logprobs: (0..tokens.len())
            .map(|j| if trained(j) { -200.0 } else { 0.0 })
            .collect(),
        tokens,
        loss_kind: LossKind::Dapo as i32,
    }
}

/// A token id at or above the model's vocabulary is refused when the batch is read
/// (INVALID_ARGUMENT naming episode, turn, id and vocabulary), counted, and the trainer
/// goes on: the same run's next batch trains. (Before, the id reached the embedding
/// lookup, whose error panicked the trainer thread.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_id_outside_the_vocabulary_is_refused_counted_and_the_learner_goes_on() {
    let root = tempfile::tempdir().unwrap();
    let (handle, mut client) = start_handle(root.path()).await;
    let bad = batch(
        0,
        0,
        false,
        vec![
            cross_entropy("it000-ok", 0, vec![1, 2, 3, 4]),
            cross_entropy("it000-train0007-g0a1", 2, vec![1, 2, VOCAB as u32, 4]),
        ],
    );
    let err = train(&mut client, bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let msg = err.message();
    for want in [
        "it000-train0007-g0a1",
        "turn 2",
        "token id 64",
        "vocabulary of 64",
    ] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    assert_eq!(
        handle.stats(),
        LearnerStats {
            refused_batches: 1,
            refused_examples: 2,
            skipped_steps: 0,
        }
    );
    // A DAPO batch is checked the same way.
    let mut dapo = overflowing_dapo("it000-train0008-g1a0");
    dapo.tokens[1] = u32::MAX;
    let err = train(&mut client, batch(0, 0, false, vec![dapo]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("it000-train0008-g1a0") && err.message().contains("4294967295"),
        "{}",
        err.message()
    );
    assert_eq!(handle.stats().refused_batches, 2);
    assert_eq!(handle.stats().refused_examples, 3);
    // Nothing was trained, and the trainer is alive: the highest id in the vocabulary
    // trains.
    assert_eq!(status(&mut client).await.unwrap().optimizer_steps, 0);
    let good = batch(
        0,
        0,
        true,
        vec![cross_entropy(
            "it000-ok",
            0,
            vec![1, 2, VOCAB as u32 - 1, 4],
        )],
    );
    let p = train(&mut client, good).await.unwrap();
    assert!(p.label_tokens > 0 && p.loss.is_finite(), "{p:?}");
    assert_eq!(p.published_version, 1);
    assert_eq!(status(&mut client).await.unwrap().optimizer_steps, 1);
}

/// The checkpoint's model and optimizer files, byte for byte.
fn weights_and_moments(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        std::fs::read(dir.join(checkpoint::OPTIMIZER_FILE)).unwrap(),
    )
}

/// A step whose loss and gradients are not finite (a DAPO ratio that overflows) is
/// skipped: the weights and the AdamW state are bit-identical after it, no version is
/// published for it (a `publish` batch repeats the latest), no checkpoint is written for
/// it, it is counted and has a train-log line saying why; a good step after it trains
/// and publishes. A skipped `publish` batch after steps that did train publishes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_loss_is_not_finite_is_skipped_and_publishes_nothing() {
    let root = tempfile::tempdir().unwrap();
    let (handle, mut client) = start_handle(root.path()).await;
    let out = root.path().join("out");
    let ckpt = out.join(CHECKPOINT_DIR);
    let good = |it, step, publish| {
        batch(
            it,
            step,
            publish,
            vec![cross_entropy("good", 0, vec![1, 5, 9, 13, 17, 21, 25, 2])],
        )
    };
    let p = train(&mut client, good(0, 0, true)).await.unwrap();
    assert_eq!((p.published_version, p.label_tokens), (1, 4));
    let v1 = p.published_sha256.clone();
    let at_v1 = weights_and_moments(&ckpt);
    let state_at_v1 = std::fs::read(ckpt.join(checkpoint::STATE_FILE)).unwrap();

    let p = train(
        &mut client,
        batch(1, 0, true, vec![overflowing_dapo("it001-overflow")]),
    )
    .await
    .unwrap();
    assert!(!p.already_applied);
    assert_eq!(
        (p.label_tokens, p.loss, p.grad_norm),
        (0, 0.0, 0.0),
        "nothing trained"
    );
    assert_eq!(
        (p.published_version, p.published_sha256.as_str()),
        (1, v1.as_str()),
        "the latest version repeated, no new one"
    );
    let s = status(&mut client).await.unwrap();
    assert_eq!((s.latest_version, s.optimizer_steps), (1, 1));
    assert_eq!(handle.stats().skipped_steps, 1);
    assert!(!WeightsStore::new(&out.join("versions"))
        .unwrap()
        .path_for(2)
        .exists());
    // No checkpoint was written for it...
    assert_eq!(
        std::fs::read(ckpt.join(checkpoint::STATE_FILE)).unwrap(),
        state_at_v1
    );
    // ... and the trainer's weights and AdamW moments are those of version 1, to the bit.
    let now = root.path().join("now");
    client
        .save_checkpoint(SaveCheckpointRequest {
            dir: now.to_string_lossy().into_owned(),
        })
        .await
        .unwrap();
    assert!(
        weights_and_moments(&now) == at_v1,
        "the skipped step moved the weights"
    );
    let log = read_train_log(&out).unwrap();
    let entry = &log[&(1, 0)];
    let why = entry
        .skipped
        .as_deref()
        .expect("the log says it was skipped");
    assert!(
        why.contains("loss (inf)") && why.contains("not finite"),
        "{why}"
    );
    assert_eq!((entry.label_tokens, entry.published_version), (0, 1));
    // Sent again (a reconnecting coordinator), it is not trained again.
    let again = train(
        &mut client,
        batch(1, 0, true, vec![overflowing_dapo("it001-overflow")]),
    )
    .await
    .unwrap();
    assert!(again.already_applied && again.published_version == 1);

    // A good step trains and publishes version 2.
    let p = train(&mut client, good(2, 0, true)).await.unwrap();
    assert_eq!(p.published_version, 2);
    assert!(p.label_tokens > 0 && p.grad_norm > 0.0);
    assert_ne!(weights_and_moments(&ckpt), at_v1);

    // A good step without publish, then a skipped publish batch: the good step's weights
    // become version 3 (checkpointed with it), the skipped one adds nothing.
    train(&mut client, good(3, 0, false)).await.unwrap();
    let p = train(
        &mut client,
        batch(3, 1, true, vec![overflowing_dapo("it003-overflow")]),
    )
    .await
    .unwrap();
    assert_eq!((p.published_version, p.label_tokens), (3, 0));
    let s = status(&mut client).await.unwrap();
    assert_eq!((s.latest_version, s.optimizer_steps), (3, 3));
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join(checkpoint::STATE_FILE)).unwrap()).unwrap();
    assert_eq!(state["data_cursor"]["published"]["3"], 3, "{state}");
    assert_eq!(handle.stats().skipped_steps, 2);
}

/// A panic in the trainer thread: the call in flight and every later one get
/// UNAVAILABLE "the trainer thread panicked: <message>", none hangs. (Before: INTERNAL
/// "the trainer thread dropped a request", then "the trainer thread has stopped".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_panic_is_the_answer_of_the_call_in_flight_and_of_later_calls() {
    let root = tempfile::tempdir().unwrap();
    let (handle, mut client) = start_handle(root.path()).await;
    let mut b = batch(0, 0, true, vec![cross_entropy("e", 0, vec![1, 2, 3, 4])]);
    b.run_id = PANIC_RUN_ID.into();
    let err = train(&mut client, b).await.unwrap_err();
    let clear = |e: &Status| {
        e.code() == Code::Unavailable
            && e.message().contains("the trainer thread panicked")
            && e.message().contains(PANIC_MESSAGE)
    };
    assert!(clear(&err), "{err:?}");
    assert_eq!(handle.panic_message().as_deref(), Some(PANIC_MESSAGE));
    let err = status(&mut client).await.unwrap_err();
    assert!(clear(&err), "{err:?}");
    let err = train(&mut client, batch(0, 0, true, vec![]))
        .await
        .unwrap_err();
    assert!(clear(&err), "{err:?}");
}

/// `serve` itself: a trainer panic ends it with an error naming the panic (so `tutor
/// learner` exits non-zero), after the Train call in flight got the clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_panic_ends_serve_with_an_error() {
    let root = tempfile::tempdir().unwrap();
    let addr_file = root.path().join("addr");
    let opts = ServeOptions {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        model_dir: model_dir(root.path()),
        out_dir: root.path().join("out"),
        config: config(),
        addr_file: Some(addr_file.clone()),
        auth_token: None,
        tls: Default::default(),
        group: None,
        broadcast: None,
        insecure: false,
        on_versions: None,
    };
    let served = tokio::spawn(serve(opts, std::future::pending()));
    let addr = tokio::time::timeout(LIMIT, async {
        loop {
            if let Ok(a) = std::fs::read_to_string(&addr_file) {
                if let Ok(a) = a.parse::<SocketAddr>() {
                    return a;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the learner listens in time");
    let mut client = connect(addr).await;
    let mut b = batch(0, 0, true, vec![cross_entropy("e", 0, vec![1, 2, 3, 4])]);
    b.run_id = PANIC_RUN_ID.into();
    let err = train(&mut client, b).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message()
            .contains(&format!("the trainer thread panicked: {PANIC_MESSAGE}")),
        "{err:?}"
    );
    let ended = tokio::time::timeout(PANIC_GRACE + LIMIT, served)
        .await
        .expect("serve returns after the trainer panicked")
        .unwrap();
    let e = format!("{:#}", ended.expect_err("serve ends with an error"));
    assert!(
        e.contains("the trainer thread panicked") && e.contains(PANIC_MESSAGE),
        "{e}"
    );
}

/// A libtorch error's panic carries its C++ stack (kilobytes): a status or `serve`'s error
/// gets its start, cut on a character boundary; a short message is kept whole.
#[test]
fn a_long_panic_message_is_cut_for_statuses() {
    assert_eq!(panic_summary("short"), "short");
    // Out of memory (as an H100 reported it) also says what to change.
    let oom = panic_summary(&format!(
        "called `Result::unwrap()` on an `Err` value: Torch(\"CUDA out of memory. Tried to \
         allocate 9.05 GiB.{}\")",
        " frame".repeat(500)
    ));
    assert!(
        oom.contains("CUDA out of memory")
            && oom.contains("tutor plan")
            && oom.contains("checkpoint_activations"),
        "{oom}"
    );
    let long = format!("Torch(\"index out of range in self{}\")", "é".repeat(2000));
    let cut = panic_summary(&long);
    assert!(
        cut.starts_with("Torch(\"index out of range in self"),
        "{cut}"
    );
    assert!(cut.ends_with("(cut; the log has it whole)"), "{cut}");
    assert!(
        cut.chars().count() < PANIC_SUMMARY_CHARS + 40,
        "{}",
        cut.len()
    );
}

/// A learner killed in the middle of an append leaves a line without its newline; the
/// next append (the step trained again after the restart) cuts it, so the log reads as
/// one entry per line instead of two entries run together.
#[test]
fn an_append_after_a_torn_line_cuts_it_and_the_log_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(TRAIN_LOG);
    let entry = |step: u32| TrainLogEntry {
        iteration: 0,
        step,
        optimizer_steps: u64::from(step) + 1,
        examples: 2,
        label_tokens: 8,
        loss: 1.5,
        episodes: vec!["it000-task-0".into()],
        published_version: 0,
        batch_sha256: format!("{step:064}"),
        skipped: None,
    };
    let json = |step| serde_json::to_string(&entry(step)).unwrap();
    append_log_line(&path, &json(0)).unwrap();
    // Killed after part of step 1's line.
    let torn = json(1);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&torn.as_bytes()[..torn.len() / 2]).unwrap();
    drop(f);
    let log = read_train_log(dir.path()).unwrap();
    assert_eq!(
        log.keys().copied().collect::<Vec<_>>(),
        [(0, 0)],
        "the torn line is no entry"
    );
    // Restarted: step 1 is trained and logged again, then step 2.
    append_log_line(&path, &json(1)).unwrap();
    append_log_line(&path, &json(2)).unwrap();
    let log = read_train_log(dir.path()).unwrap();
    assert_eq!(
        log.keys().copied().collect::<Vec<_>>(),
        [(0, 0), (0, 1), (0, 2)]
    );
    assert_eq!(log[&(0, 1)], entry(1));
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 3, "{text}");
    // A whole file with no newline at all (one torn line) is cut to nothing.
    let lone = dir.path().join("lone.jsonl");
    std::fs::write(&lone, &torn.as_bytes()[..10]).unwrap();
    append_log_line(&lone, &json(0)).unwrap();
    assert_eq!(std::fs::read_to_string(&lone).unwrap(), json(0) + "\n");
}
