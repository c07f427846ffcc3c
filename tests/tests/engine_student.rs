//! The student on an external engine, as a worker drives it (`[worker.student] kind =
//! "engine"`, tutor_rollout_worker::student_engine) against a real `tutor serve` process:
//! token ids in, sampled ids and log-probabilities out, every answer under a checked weight
//! version; reloads from disk; an engine that refuses a reload, answers for another
//! version, or goes away, each a clear error naming the engine and the version.

mod common;

use std::path::Path;
use std::time::Duration;

use tutor_policy::{ChatTokenizer, GenParams, ModelConfig, Policy};
use tutor_rollout_worker::student_engine::{
    stage_version, version_label, EngineApi, EngineError, ReloadKind, RemoteEngine, StudentConfig,
    StudentKind,
};

/// ℓ(token j | tokens < j) of `tokens[from..]` by one forward pass over the sequence.
fn fresh_logprobs(policy: &Policy, tokens: &[u32], from: usize) -> Vec<f64> {
    use tch::{Device, Kind, Tensor};
    let _g = tch::no_grad_guard();
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let n = ids.len() as i64;
    let input = Tensor::from_slice(&ids).reshape([1, n]);
    let logits = policy.forward(&input, &Tensor::ones([1, n], (Kind::Int64, Device::Cpu)));
    let lsm = logits.log_softmax(-1, Kind::Double);
    (from..tokens.len())
        .map(|j| lsm.double_value(&[0, j as i64 - 1, tokens[j] as i64]))
        .collect()
}

/// Every sampled token's log-prob in `g` equals a fresh forward pass of `policy` over
/// `prompt` and the reply, within 1e-4.
fn assert_logprobs_of(policy: &Policy, prompt: &[u32], g: &tutor_policy::Generation, what: &str) {
    let whole: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
    let fresh = fresh_logprobs(policy, &whole, prompt.len());
    for (i, (a, b)) in g.logprobs.iter().zip(&fresh).enumerate() {
        assert!(
            (*a as f64 - b).abs() < 1e-4,
            "token {i}: the engine's log-prob {a} vs {what}'s {b}"
        );
    }
}

/// The weights of `model` times `factor`: another version that differs everywhere.
fn scaled(model: &Path, factor: f64) -> Policy {
    let mut policy = Policy::load_dir(model, tch::Device::Cpu).unwrap();
    tch::no_grad(|| {
        for (_, mut t) in policy.var_store_mut().variables() {
            let _ = t.g_mul_scalar_(factor);
        }
    });
    policy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tutor_serve_is_a_student_engine_with_checked_versions() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &["512", "64"]);
    let staging = dir.path().join("engine-weights");
    std::fs::create_dir_all(&staging).unwrap();
    let served = common::serve(
        &model,
        "student",
        dir.path(),
        &["--weights-root", staging.to_str().unwrap()],
    );
    let url = format!("http://{}", served.addr);
    let config = StudentConfig {
        kind: StudentKind::Engine,
        base_url: url.clone(),
        timeout_s: 60.0,
        max_retries: 1,
        down_s: 2.0,
        ..Default::default()
    };
    let vocab = ModelConfig::load(&model.join("config.json"))
        .unwrap()
        .vocab_size;
    let engine = RemoteEngine::new(&config, vocab).unwrap();
    assert_eq!(engine.served_version().await.unwrap(), "default");

    // Policy version 5: the starting weights scaled, so that they differ.
    let policy = scaled(&model, 1.5);
    let file = dir.path().join("v5.safetensors");
    policy.save_weights(&file).unwrap();
    let v5 = version_label(5, "0123456789abcdef");
    assert_eq!(v5, "tutor-v5-0123456789ab");
    let name = stage_version(&staging, &model, &file, &v5, true).unwrap().0;
    engine
        .load_from_disk(&staging.join(&name), 5, &v5)
        .await
        .unwrap();
    assert_eq!(engine.served_version().await.unwrap(), v5);

    // A turn: the prompt as token ids, the sampled ids and their log-probabilities back,
    // equal to a fresh forward pass of version 5 on the same tokens.
    let (prompt, params) = a_turn(&model, 1);
    let g = engine.generate(&prompt, &params, &v5).await.unwrap();
    assert!(!g.tokens.is_empty() && g.tokens.len() <= 12, "{g:?}");
    assert_eq!(g.logprobs.len(), g.tokens.len());
    let whole: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
    let fresh = fresh_logprobs(&policy, &whole, prompt.len());
    for (i, (a, b)) in g.logprobs.iter().zip(&fresh).enumerate() {
        assert!(
            (*a as f64 - b).abs() < 1e-4,
            "token {i}: the engine's log-prob {a} vs a fresh forward's {b}"
        );
    }

    // An episode of another version never gets this engine's turn.
    match engine.generate(&prompt, &params, "tutor-v4-aaaa").await {
        Err(EngineError::WrongVersion {
            served, expected, ..
        }) => assert_eq!((served, expected.as_str()), (v5.clone(), "tutor-v4-aaaa")),
        other => panic!("expected a wrong-version error, got {other:?}"),
    }

    // A checkpoint of another shape is refused, naming the engine and the version; the
    // engine keeps serving version 5.
    let other = common::make_model(&dir.path().join("other"), &["512", "32"]);
    let other_file = dir.path().join("v6.safetensors");
    std::fs::copy(other.join("model.safetensors"), &other_file).unwrap();
    let name6 = stage_version(&staging, &model, &other_file, "tutor-v6", false)
        .unwrap()
        .0;
    let err = engine
        .load_from_disk(&staging.join(&name6), 6, "tutor-v6")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&url) && err.contains("refused to load policy version 6"),
        "{err}"
    );
    assert_eq!(engine.served_version().await.unwrap(), v5);
    assert!(engine.generate(&prompt, &params, &v5).await.is_ok());

    // Only checkpoints inside --weights-root load: not the model's own directory, not a
    // way out of the root by `..` or by a symbolic link.
    std::os::unix::fs::symlink(&model, staging.join("escape")).unwrap();
    for outside in [
        model.clone(),
        staging.join("..").join("model"),
        staging.join("escape"),
    ] {
        let err = engine
            .load_from_disk(&outside, 7, "tutor-v7")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not a checkpoint inside --weights-root"),
            "{}: {err}",
            outside.display()
        );
    }
    assert_eq!(engine.served_version().await.unwrap(), v5);

    // A reload while turns run. Turns queued before it run on version 5 and say so (their
    // log-probs are version 5's); the reload waits for them; turns after it run on
    // version 7 and say so (their log-probs are version 7's).
    let v7_policy = scaled(&model, 0.5);
    let file7 = dir.path().join("v7.safetensors");
    v7_policy.save_weights(&file7).unwrap();
    let v7 = version_label(7, "77777777777777");
    let name7 = stage_version(&staging, &model, &file7, &v7, true)
        .unwrap()
        .0;
    let engine = std::sync::Arc::new(engine);
    let long = GenParams {
        max_new_tokens: 160,
        stop_token_ids: Vec::new(),
        ..params.clone()
    };
    let spawn_turns = |n: usize, label: &str| -> Vec<_> {
        (0..n)
            .map(|_| {
                let (engine, prompt, long, label) = (
                    engine.clone(),
                    prompt.clone(),
                    long.clone(),
                    label.to_string(),
                );
                tokio::spawn(async move { engine.generate(&prompt, &long, &label).await })
            })
            .collect()
    };
    let check = |g: &tutor_policy::Generation, policy: &Policy, version: &str| {
        let whole: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
        let fresh = fresh_logprobs(policy, &whole, prompt.len());
        for (a, b) in g.logprobs.iter().zip(&fresh) {
            assert!(
                (*a as f64 - b).abs() < 1e-4,
                "an answer named {version}: {a} vs {b}"
            );
        }
    };
    let before = spawn_turns(4, &v5);
    tokio::time::sleep(Duration::from_millis(300)).await;
    engine
        .load_from_disk(&staging.join(&name7), 7, &v7)
        .await
        .unwrap();
    let after = spawn_turns(2, &v7);
    let mut on_v5 = 0;
    for turn in before {
        match turn.await.unwrap() {
            Ok(g) => {
                on_v5 += 1;
                check(&g, &policy, &v5);
            }
            // Only a turn that reached the engine after the reload.
            Err(EngineError::WrongVersion { served, .. }) => assert_eq!(served, v7),
            Err(e) => panic!("{e}"),
        }
    }
    assert!(on_v5 >= 1, "no turn was queued before the reload");
    for turn in after {
        let g = turn
            .await
            .unwrap()
            .expect("a turn after the reload runs on v7");
        check(&g, &v7_policy, &v7);
    }
    assert_eq!(engine.served_version().await.unwrap(), v7);
    let v5 = v7;

    // Without --weights-root a server loads nothing.
    let closed_dir = dir.path().join("closed");
    std::fs::create_dir_all(&closed_dir).unwrap();
    let closed = common::serve(&model, "student", &closed_dir, &[]);
    let closed_engine = RemoteEngine::new(
        &StudentConfig {
            base_url: format!("http://{}", closed.addr),
            ..config.clone()
        },
        vocab,
    )
    .unwrap();
    let err = closed_engine
        .load_from_disk(&staging.join(&name7), 7, &v5)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight reloads are off"), "{err}");
    drop(closed);

    // The engine goes away: a clear error, and waiting for it gives up after down_s.
    drop(served);
    let err = engine.generate(&prompt, &params, &v5).await.unwrap_err();
    assert!(
        matches!(err, EngineError::Down { .. }) && err.to_string().contains(&url),
        "{err}"
    );
    assert!(!engine.seems_up());
    let t = std::time::Instant::now();
    let err = engine.wait_up().await.unwrap_err().to_string();
    assert!(
        err.contains("worker.student.down_s") && err.contains(&url),
        "{err}"
    );
    assert!(t.elapsed() >= Duration::from_secs(2));
}

/// `[worker.student] reload = "distributed"` against `tutor serve --distributed-updates`:
/// a version goes to the engine as tensors over the CPU collective (no directory shared
/// with the engine), is served under its version, and its turns' log-probs are that
/// version's; a version that does not fit the model is refused with the old weights kept;
/// a server without the flag takes none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tutor_serve_takes_versions_as_tensors_over_the_collective() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &["512", "64"]);
    // With an API key: the group's hello is keyed by it.
    let key_file = dir.path().join("engine.key");
    std::fs::write(&key_file, "engine-key-123\n").unwrap();
    let served = common::serve(
        &model,
        "student",
        dir.path(),
        &[
            "--distributed-updates",
            "--api-key-file",
            key_file.to_str().unwrap(),
        ],
    );
    let url = format!("http://{}", served.addr);
    let config = StudentConfig {
        kind: StudentKind::Engine,
        base_url: url.clone(),
        api_key_file: Some(key_file.clone()),
        api_key_env: "TUTOR_TEST_UNSET_KEY_VARIABLE".into(),
        timeout_s: 60.0,
        reload_timeout_s: 60.0,
        max_retries: 1,
        down_s: 2.0,
        reload: ReloadKind::Distributed,
        ..Default::default()
    };
    let vocab = ModelConfig::load(&model.join("config.json"))
        .unwrap()
        .vocab_size;
    let engine = RemoteEngine::new(&config, vocab).unwrap();

    let policy = scaled(&model, 1.5);
    let file = dir.path().join("v5.safetensors");
    policy.save_weights(&file).unwrap();
    let bytes = std::sync::Arc::new(std::fs::read(&file).unwrap());
    let v5 = version_label(5, "5555555555555555");
    engine.load_distributed(bytes, 5, &v5).await.unwrap();
    assert_eq!(engine.served_version().await.unwrap(), v5);
    let (prompt, params) = a_turn(&model, 3);
    let g = engine.generate(&prompt, &params, &v5).await.unwrap();
    assert!(!g.tokens.is_empty());
    assert_logprobs_of(&policy, &prompt, &g, "version 5");
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(
        log.contains("received weights over the collective"),
        "{log}"
    );
    // The turn's seed goes with it: the same seed samples the same reply.
    let again = engine.generate(&prompt, &params, &v5).await.unwrap();
    assert_eq!(again.tokens, g.tokens);

    // A second version, over a group of its own.
    let v6_policy = scaled(&model, 0.5);
    let file6 = dir.path().join("v6.safetensors");
    v6_policy.save_weights(&file6).unwrap();
    let v6 = version_label(6, "6666666666666666");
    engine
        .load_distributed(std::sync::Arc::new(std::fs::read(&file6).unwrap()), 6, &v6)
        .await
        .unwrap();
    let g = engine.generate(&prompt, &params, &v6).await.unwrap();
    assert_logprobs_of(&v6_policy, &prompt, &g, "version 6");
    // Another client sharing the engine loading version 6 again sends nothing: the
    // engine serves it already.
    let received = || {
        std::fs::read_to_string(dir.path().join("serve.log"))
            .unwrap()
            .matches("received weights over the collective")
            .count()
    };
    let before = received();
    RemoteEngine::new(&config, vocab)
        .unwrap()
        .load_distributed(std::sync::Arc::new(std::fs::read(&file6).unwrap()), 6, &v6)
        .await
        .unwrap();
    assert_eq!(received(), before, "version 6 was sent again");

    // Weights of another shape: refused from the announcement, before a byte moves,
    // naming the engine, the version and the tensor; version 6 stays served and answers.
    let other = common::make_model(&dir.path().join("other"), &["512", "32"]);
    let other_bytes = std::sync::Arc::new(std::fs::read(other.join("model.safetensors")).unwrap());
    let err = engine
        .load_distributed(other_bytes, 7, "tutor-v7")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&url)
            && err.contains("policy version 7")
            && err.contains("announced with shape")
            && err.contains("refused before receiving anything"),
        "{err}"
    );
    assert_eq!(engine.served_version().await.unwrap(), v6);
    assert!(engine.generate(&prompt, &params, &v6).await.is_ok());

    // Bytes that are no safetensors file are refused before anything is sent.
    let err = engine
        .load_distributed(std::sync::Arc::new(b"not weights".to_vec()), 8, "tutor-v8")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("policy version 8 cannot be sent"), "{err}");

    // Without --distributed-updates a server takes no weights this way.
    let closed_dir = dir.path().join("closed");
    std::fs::create_dir_all(&closed_dir).unwrap();
    let closed = common::serve(&model, "student", &closed_dir, &[]);
    let closed_engine = RemoteEngine::new(
        &StudentConfig {
            base_url: format!("http://{}", closed.addr),
            api_key_file: None,
            ..config.clone()
        },
        vocab,
    )
    .unwrap();
    let err = closed_engine
        .load_distributed(std::sync::Arc::new(std::fs::read(&file6).unwrap()), 6, &v6)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("--distributed-updates"), "{err}");
    assert_eq!(closed_engine.served_version().await.unwrap(), "default");
}

/// The prompt every test's turns take, as token ids, and unbiased sampling of up to 12
/// tokens with `seed`.
fn a_turn(model: &Path, seed: u64) -> (Vec<u32>, GenParams) {
    let tok = ChatTokenizer::from_dir(model).unwrap();
    let prompt = tok
        .render_prompt("You fix bugs.", "the test fails")
        .unwrap();
    let params = GenParams {
        temperature: 1.0,
        top_p: 1.0,
        max_new_tokens: 12,
        seed,
        stop_token_ids: tok.stop_ids().to_vec(),
    };
    (prompt, params)
}

/// Waits up to 60 s for `what` to hold.
async fn until<F: std::future::Future<Output = bool>>(what: &str, f: impl Fn() -> F) {
    let t = std::time::Instant::now();
    while !f().await {
        assert!(t.elapsed() < Duration::from_secs(60), "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `[worker.student] api = "vllm"` against `tutor serve`: turns on `/v1/completions` with
/// vLLM's token-in/token-out fields, their version checked on `/weight_info` around each
/// turn; versions loaded through vLLM's weight-transfer control plane (pause, start,
/// update, finish, resume), from disk and as tensors over the collective; a turn sent
/// while paused waits for the resume; a reload waits for another client's update; refused
/// weights leave the engine serving and not paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tutor_serve_is_a_student_engine_through_vllms_api() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &["512", "64"]);
    let staging = dir.path().join("engine-weights");
    std::fs::create_dir_all(&staging).unwrap();
    let served = common::serve(
        &model,
        "student",
        dir.path(),
        &[
            "--weights-root",
            staging.to_str().unwrap(),
            "--distributed-updates",
        ],
    );
    let url = format!("http://{}", served.addr);
    let config = StudentConfig {
        kind: StudentKind::Engine,
        api: EngineApi::Vllm,
        base_url: url.clone(),
        timeout_s: 60.0,
        reload_timeout_s: 60.0,
        max_retries: 1,
        down_s: 2.0,
        ..Default::default()
    };
    let vocab = ModelConfig::load(&model.join("config.json"))
        .unwrap()
        .vocab_size;
    let engine = std::sync::Arc::new(RemoteEngine::new(&config, vocab).unwrap());
    let tensors = RemoteEngine::new(
        &StudentConfig {
            reload: ReloadKind::Distributed,
            ..config.clone()
        },
        vocab,
    )
    .unwrap();
    assert_eq!(engine.served_version().await.unwrap(), "default");
    let http = reqwest::Client::new();
    let post = |path: &str, body: serde_json::Value| {
        let req = http.post(format!("{url}{path}")).json(&body);
        async move {
            let r = req.send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    // Whether the server is paused, and how many requests it holds.
    let paused = || {
        let req = http.get(format!("{url}/is_paused"));
        async move {
            let v: serde_json::Value = req.send().await.unwrap().json().await.unwrap();
            (
                v["is_paused"].as_bool().unwrap(),
                v["waiting"].as_u64().unwrap(),
            )
        }
    };
    let is_paused = || async { paused().await.0 };
    let serve_log = dir.path().join("serve.log");

    // Version 5 from disk.
    let policy = scaled(&model, 1.5);
    let file = dir.path().join("v5.safetensors");
    policy.save_weights(&file).unwrap();
    let v5 = version_label(5, "5555555555555555");
    let name = stage_version(&staging, &model, &file, &v5, true).unwrap().0;
    engine
        .load_from_disk(&staging.join(&name), 5, &v5)
        .await
        .unwrap();
    assert_eq!(engine.served_version().await.unwrap(), v5);
    assert!(!is_paused().await);
    let (prompt, params) = a_turn(&model, 1);
    let g = engine.generate(&prompt, &params, &v5).await.unwrap();
    assert!(!g.tokens.is_empty() && g.tokens.len() <= 12, "{g:?}");
    assert_logprobs_of(&policy, &prompt, &g, "version 5");
    let again = engine.generate(&prompt, &params, &v5).await.unwrap();
    assert_eq!(again.tokens, g.tokens, "the turn's seed goes with it");
    // The answer in vLLM's shape, as a vLLM client reads it.
    let (status, text) = post(
        "/v1/completions",
        serde_json::json!({
            "prompt": prompt, "max_tokens": 12, "seed": 1, "logprobs": 0,
            "return_token_ids": true, "return_tokens_as_token_ids": true,
            "stop_token_ids": params.stop_token_ids, "top_k": -1,
        }),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let a: serde_json::Value = serde_json::from_str(&text).unwrap();
    let choice = &a["choices"][0];
    let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    assert_eq!(ids, g.tokens);
    assert_eq!(choice["prompt_token_ids"], serde_json::json!(prompt));
    assert_eq!(
        choice["logprobs"]["tokens"][0],
        serde_json::json!(format!("token_id:{}", ids[0]))
    );
    assert_eq!(
        choice["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        ids.len()
    );
    // Truncated sampling would bias the log-probs: refused.
    let (status, text) = post(
        "/v1/completions",
        serde_json::json!({"prompt": prompt, "max_tokens": 4, "top_k": 5}),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("neutral values"), "{text}");

    // Version 6 as tensors over the collective: no directory.
    let v6_policy = scaled(&model, 0.5);
    let file6 = dir.path().join("v6.safetensors");
    v6_policy.save_weights(&file6).unwrap();
    let v6 = version_label(6, "6666666666666666");
    tensors
        .load_distributed(std::sync::Arc::new(std::fs::read(&file6).unwrap()), 6, &v6)
        .await
        .unwrap();
    assert_eq!(engine.served_version().await.unwrap(), v6);
    let g = engine.generate(&prompt, &params, &v6).await.unwrap();
    assert_logprobs_of(&v6_policy, &prompt, &g, "version 6");
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(
        log.contains("received weights over the collective"),
        "{log}"
    );
    // An episode of version 5 never gets this engine's turn now.
    match engine.generate(&prompt, &params, &v5).await {
        Err(EngineError::WrongVersion {
            served, expected, ..
        }) => assert_eq!((served, expected), (v6.clone(), v5.clone())),
        other => panic!("expected a wrong-version error, got {other:?}"),
    }

    // Paused: a turn waits for the resume, then runs. vLLM's abort mode is refused.
    let (status, text) = post("/pause?mode=abort", serde_json::json!({})).await;
    assert_eq!(status, 400, "{text}");
    assert!(!is_paused().await);
    assert_eq!(post("/pause?mode=wait", serde_json::json!({})).await.0, 200);
    assert!(is_paused().await);
    let waiting = {
        let (engine, prompt, params, v6) =
            (engine.clone(), prompt.clone(), params.clone(), v6.clone());
        tokio::spawn(async move { engine.generate(&prompt, &params, &v6).await })
    };
    until("the turn is held by the pause", || async {
        paused().await.1 == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a turn ran while paused");
    assert_eq!(post("/resume", serde_json::json!({})).await.0, 200);
    let g = waiting.await.unwrap().unwrap();
    assert_logprobs_of(&v6_policy, &prompt, &g, "version 6 after the resume");

    // Another client's update under way: a reload waits for it, then loads.
    let v7_policy = scaled(&model, 0.75);
    let file7 = dir.path().join("v7.safetensors");
    v7_policy.save_weights(&file7).unwrap();
    let v7 = version_label(7, "7777777777777777");
    let name7 = stage_version(&staging, &model, &file7, &v7, true)
        .unwrap()
        .0;
    assert_eq!(
        post("/start_weight_update", serde_json::json!({})).await.0,
        200
    );
    let reload = {
        let (engine, path, v7) = (engine.clone(), staging.join(&name7), v7.clone());
        tokio::spawn(async move { engine.load_from_disk(&path, 7, &v7).await })
    };
    until(
        "the reload is refused while the other update is under way",
        || async {
            std::fs::read_to_string(&serve_log)
                .unwrap_or_default()
                .contains("refused another client's weight update")
        },
    )
    .await;
    assert!(
        !reload.is_finished(),
        "a reload ran during another's update"
    );
    // That client finishes without weights: its update ends, the old weights stay.
    let (status, text) = post("/finish_weight_update", serde_json::json!({})).await;
    assert_eq!(status, 400, "{text}");
    reload.await.unwrap().unwrap();
    assert_eq!(engine.served_version().await.unwrap(), v7);
    let g = engine.generate(&prompt, &params, &v7).await.unwrap();
    assert_logprobs_of(&v7_policy, &prompt, &g, "version 7");

    // Weights of another shape: refused before a byte moves, naming the engine and the
    // version; version 7 stays, the engine is not left paused, turns run.
    let other = common::make_model(&dir.path().join("other"), &["512", "32"]);
    let other_bytes = std::sync::Arc::new(std::fs::read(other.join("model.safetensors")).unwrap());
    let err = tensors
        .load_distributed(other_bytes, 8, "tutor-v8")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&url)
            && err.contains("policy version 8")
            && err.contains("announced with shape"),
        "{err}"
    );
    // A checkpoint outside --weights-root: refused, naming the field.
    let err = engine
        .load_from_disk(&model, 9, "tutor-v9")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("update_info.path") && err.contains("--weights-root"),
        "{err}"
    );
    assert_eq!(engine.served_version().await.unwrap(), v7);
    assert!(!is_paused().await);
    assert!(engine.generate(&prompt, &params, &v7).await.is_ok());

    // Workers sharing the engine reload at once: each waits its turn or finds the version
    // loaded; all end with it served, the engine resumed, and /weight_info counting
    // every swap.
    let weight_info = || {
        let req = http.get(format!("{url}/weight_info"));
        async move {
            let v: serde_json::Value = req.send().await.unwrap().json().await.unwrap();
            v["weight_generation"].as_u64().unwrap()
        }
    };
    let swaps_before = weight_info().await;
    let v10 = version_label(10, "1010101010101010");
    let bytes6 = std::sync::Arc::new(std::fs::read(&file6).unwrap());
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let client = RemoteEngine::new(
                &StudentConfig {
                    reload: ReloadKind::Distributed,
                    ..config.clone()
                },
                vocab,
            )
            .unwrap();
            let (bytes, v10) = (bytes6.clone(), v10.clone());
            tokio::spawn(async move { client.load_distributed(bytes, 10, &v10).await })
        })
        .collect();
    for c in clients {
        c.await.unwrap().unwrap();
    }
    assert_eq!(engine.served_version().await.unwrap(), v10);
    assert!(!is_paused().await);
    let swaps = weight_info().await - swaps_before;
    assert!((1..=3).contains(&swaps), "{swaps} swaps");
    let g = engine.generate(&prompt, &params, &v10).await.unwrap();
    assert_logprobs_of(&v6_policy, &prompt, &g, "version 10 (version 6's weights)");
    // A worker that reloads the version the engine serves (another loaded it while it
    // was getting the bytes) swaps nothing: a swap would change the count under other
    // workers' turns of that version, which are then refused.
    let swaps_before = weight_info().await;
    let turn = {
        let (engine, prompt, params, v10) =
            (engine.clone(), prompt.clone(), params.clone(), v10.clone());
        tokio::spawn(async move { engine.generate(&prompt, &params, &v10).await })
    };
    tensors
        .load_distributed(bytes6.clone(), 10, &v10)
        .await
        .unwrap();
    engine
        .load_from_disk(&staging.join(&name7), 10, &v10)
        .await
        .unwrap();
    assert_eq!(
        weight_info().await,
        swaps_before,
        "version 10 was swapped in again"
    );
    turn.await.unwrap().unwrap();
    drop(served);
}

/// `[learner] engines` (workers: `[worker.student] loaded_by = "learner"`): the learner's
/// loader puts each published version into every engine, one taking tensors over SGLang's
/// routes, one reading a staged directory through vLLM's, and workers only wait for it. A
/// worker waiting for a version nobody loads gets an error naming the engine, the version
/// and the setting; an engine that lost the version (another client loaded other weights,
/// as after a restart) gets it back within the check interval; a newer version replaces
/// it everywhere; the loader ends when the learner drops its sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learner_loads_each_version_into_every_engine_and_workers_wait_for_it() {
    use tutor_rollout_worker::student_engine::push::{EnginePush, VersionFile};
    use tutor_rollout_worker::student_engine::LoadedBy;

    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &["512", "64"]);
    let staging = dir.path().join("engine-weights");
    let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
    for d in [&staging, &a_dir, &b_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    let a = common::serve(&model, "student", &a_dir, &["--distributed-updates"]);
    let b = common::serve(
        &model,
        "student",
        &b_dir,
        &["--weights-root", staging.to_str().unwrap()],
    );
    let vocab = ModelConfig::load(&model.join("config.json"))
        .unwrap()
        .vocab_size;
    let a_config = StudentConfig {
        kind: StudentKind::Engine,
        base_url: format!("http://{}", a.addr),
        timeout_s: 60.0,
        reload_timeout_s: 60.0,
        max_retries: 1,
        down_s: 2.0,
        reload: ReloadKind::Distributed,
        loaded_by: LoadedBy::Learner,
        ..Default::default()
    };
    let b_config = StudentConfig {
        api: EngineApi::Vllm,
        base_url: format!("http://{}", b.addr),
        reload: ReloadKind::Disk,
        ..a_config.clone()
    };
    let worker_a = RemoteEngine::new(&a_config, vocab).unwrap();
    let worker_b = RemoteEngine::new(&b_config, vocab).unwrap();

    let version = |v: u64, factor: f64| {
        let policy = scaled(&model, factor);
        let path = dir.path().join(format!("policy-v{v:06}.safetensors"));
        policy.save_weights(&path).unwrap();
        let sha256 = format!("{v}").repeat(64)[..64].to_string();
        let pv = VersionFile {
            version: v,
            bytes: std::fs::metadata(&path).unwrap().len(),
            sha256,
            path,
        };
        (policy, version_label(v, &pv.sha256), pv)
    };
    let (v5_policy, v5, pv5) = version(5, 1.5);

    // Nobody loads it: the worker's wait ends after reload_timeout_s with the reason.
    let impatient = RemoteEngine::new(
        &StudentConfig {
            reload_timeout_s: 1.0,
            ..a_config.clone()
        },
        vocab,
    )
    .unwrap();
    let err = impatient
        .await_version(5, &v5)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&a_config.base_url)
            && err.contains("policy version 5")
            && err.contains("[learner] engines"),
        "{err}"
    );

    // A worker's student on engine a, leased an episode of version 5 before the learner
    // loaded it: it waits (it never downloads: its weights endpoint leads nowhere).
    let host = tutor_rollout_worker::student::StudentHost::remote(
        &model,
        &dir.path().join("worker-cache"),
        &a_config,
        tutor_proto::auth::ClientAuth::new(None),
    )
    .await
    .unwrap();
    let leased = tutor_proto::PolicyVersion {
        version: 5,
        weights_endpoint: "http://127.0.0.1:9".into(),
        sha256: pv5.sha256.clone(),
    };
    let waiting = tokio::spawn(async move {
        let loaded = host.ensure(&leased).await.map(|()| host.loaded_version());
        (host, loaded)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "the worker did not wait for the learner"
    );

    let (tx, rx) = tokio::sync::watch::channel(Some(pv5));
    let push = EnginePush::new(
        vec![
            RemoteEngine::new(&a_config, vocab).unwrap(),
            RemoteEngine::new(&b_config, vocab).unwrap(),
        ],
        model.clone(),
        staging.clone(),
        staging.clone(),
    )
    .unwrap()
    .check_every(Duration::from_millis(200));
    let pushing = tokio::spawn(push.run(rx));
    worker_a.await_version(5, &v5).await.unwrap();
    worker_b.await_version(5, &v5).await.unwrap();
    let (host, loaded) = waiting.await.unwrap();
    assert_eq!(loaded.unwrap(), 5);
    let (prompt, params) = a_turn(&model, 5);
    for (engine, what) in [(&worker_a, "engine a"), (&worker_b, "engine b")] {
        let g = engine.generate(&prompt, &params, &v5).await.unwrap();
        assert_logprobs_of(&v5_policy, &prompt, &g, what);
    }
    let a_log = std::fs::read_to_string(a_dir.join("serve.log")).unwrap();
    assert!(
        a_log.contains("received weights over the collective"),
        "{a_log}"
    );

    // Another client loads other weights into engine a: the learner puts version 5 back.
    let (_, v6, pv6) = version(6, 0.5);
    RemoteEngine::new(
        &StudentConfig {
            loaded_by: LoadedBy::Worker,
            ..a_config.clone()
        },
        vocab,
    )
    .unwrap()
    .load_distributed(
        std::sync::Arc::new(std::fs::read(&pv6.path).unwrap()),
        6,
        &v6,
    )
    .await
    .unwrap();
    until("engine a serves version 5 again", || async {
        worker_a.served_version().await.unwrap() == v5
    })
    .await;

    // A newer version goes to both.
    let (v7_policy, v7, pv7) = version(7, 0.75);
    tx.send(Some(pv7)).unwrap();
    worker_a.await_version(7, &v7).await.unwrap();
    worker_b.await_version(7, &v7).await.unwrap();
    for (engine, what) in [(&worker_a, "engine a"), (&worker_b, "engine b")] {
        let g = engine.generate(&prompt, &params, &v7).await.unwrap();
        assert_logprobs_of(&v7_policy, &prompt, &g, what);
    }
    // A lease of version 5 now (an asynchronous run): the learner loads only the newest,
    // so the episode runs on version 7 at once and is reported under it; no reload failed.
    let old_lease = tutor_proto::PolicyVersion {
        version: 5,
        weights_endpoint: "http://127.0.0.1:9".into(),
        sha256: "5".repeat(64),
    };
    let err = tokio::time::timeout(Duration::from_secs(10), host.ensure(&old_lease))
        .await
        .expect("a superseded lease does not wait")
        .unwrap_err()
        .to_string();
    assert!(err.contains("newer policy version"), "{err}");
    assert_eq!((host.loaded_version(), host.reload_failures()), (7, 0));

    // Staged for the disk engine under each version's label; the learner's files stay.
    assert!(staging.join(&v7).join("model.safetensors").exists());
    assert!(dir.path().join("policy-v000007.safetensors").exists());

    drop(tx);
    tokio::time::timeout(Duration::from_secs(10), pushing)
        .await
        .expect("the loader ends when the learner drops its sender")
        .unwrap();
    drop((a, b));
}
