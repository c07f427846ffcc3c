//! Parity with Hugging Face `transformers`, generated at test time by the project's own
//! set-up: tests/reference/make_models.py makes tiny random Qwen3 (GQA and MHA, tied and
//! untied, with biases, linear and YaRN RoPE scaling), Llama (plain; biases + tied + Llama 3
//! RoPE) and Qwen2 models with the venv's `transformers` and records what they compute.
//! Every model must load here and give the same logits, per-token log-probs and 32 greedy
//! tokens; every model saved back by Tutor must load in `transformers` with the same logits
//! (tests/reference/check_reload.py).
//!
//! Needs the venv `make setup` makes (torch + transformers, pinned in requirements-dev.txt):
//! `TUTOR_PYTHON`, else `<workspace>/.venv/bin/python`. Without it the tests fail and say so.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};
use tutor_policy::{GenParams, ModelConfig, Policy};

const TOL: f64 = 1e-4;

/// Every configuration make_models.py must produce (so a configuration cannot silently drop out).
const EXPECTED: [&str; 7] = [
    "qwen3_gqa2_untied",
    "qwen3_mha_tied_bias",
    "qwen3_rope_linear",
    "qwen3_rope_yarn",
    "llama_gqa2",
    "llama_bias_tied_llama3rope",
    "qwen2_gqa2_tied",
];

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference")
}

fn python() -> PathBuf {
    match std::env::var_os("TUTOR_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"),
    }
}

fn run_python(args: &[&std::ffi::OsStr], what: &str) -> String {
    let py = python();
    let out = Command::new(&py)
        .args(args)
        .env("PYTHONHASHSEED", "0")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the Python interpreter {} ({e}) for {what}; run `make setup` (it \
                 installs torch and transformers into .venv) or set TUTOR_PYTHON to a Python \
                 with torch and transformers",
                py.display()
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}) with {}:\n{stdout}\n{stderr}",
        out.status,
        py.display()
    );
    stdout
}

/// Runs make_models.py once per test process into a temporary directory. (All checks that
/// need it are one `#[test]`, because nextest runs every test in its own process.)
fn models() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        // A clear failure first when transformers is missing, instead of a Python traceback.
        let probe = Command::new(python())
            .args(["-c", "import torch, transformers, safetensors"])
            .output();
        match probe {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "{} cannot import torch, transformers and safetensors (needed to make the \
                 reference models); run `make setup` or set TUTOR_PYTHON:\n{}",
                python().display(),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!(
                "cannot run {} ({e}); run `make setup` (it creates .venv with torch and \
                 transformers) or set TUTOR_PYTHON",
                python().display()
            ),
        }
        let dir = tempfile::tempdir().unwrap();
        let script = reference_dir().join("make_models.py");
        let log = run_python(
            &[script.as_os_str(), dir.path().as_os_str()],
            "make_models.py",
        );
        eprintln!("{log}");
        dir
    })
    .path()
}

struct Reference {
    name: String,
    json: serde_json::Value,
}

impl Reference {
    fn get<T: serde::de::DeserializeOwned>(&self, key: &str) -> T {
        serde_json::from_value(self.json[key].clone())
            .unwrap_or_else(|e| panic!("{}: reference field {key}: {e}", self.name))
    }

    fn dir(&self) -> PathBuf {
        models().join(&self.name)
    }

    fn json_path(&self) -> PathBuf {
        models().join(format!("{}.json", self.name))
    }
}

fn references() -> Vec<Reference> {
    let dir = models();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let names: Vec<String> = serde_json::from_value(manifest["configs"].clone()).unwrap();
    assert_eq!(
        names, EXPECTED,
        "make_models.py made a different set of models"
    );
    names
        .into_iter()
        .map(|name| {
            let path = dir.join(format!("{name}.json"));
            let json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            Reference { name, json }
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

/// The whole comparison, in one test so that the reference models are made once.
#[test]
fn parity_with_transformers() {
    let refs = references();
    logits_and_logprobs_match_transformers(&refs);
    greedy_generation_matches_transformers(&refs);
    tutor_checkpoints_reload_in_transformers(&refs);
}

/// Logits of the real tokens and the log-prob of each next real token, for a right-padded
/// batch, within `TOL` for every model.
fn logits_and_logprobs_match_transformers(refs: &[Reference]) {
    let mut report = Vec::new();
    for r in refs {
        let policy = Policy::load_dir(&r.dir(), Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: load_dir: {e}", r.name));
        assert_eq!(policy.config().model_type, r.get::<String>("model_type"));
        assert_eq!(
            policy.config().architectures,
            vec![r.get::<String>("architecture")]
        );
        let ids: Vec<Vec<i64>> = r.get("input_ids");
        let mask: Vec<Vec<i64>> = r.get("attention_mask");
        let (b, t) = (ids.len() as i64, ids[0].len() as i64);
        let logits = policy.forward(
            &Tensor::from_slice(&ids.concat()).view([b, t]),
            &Tensor::from_slice(&mask.concat()).view([b, t]),
        );
        assert_eq!(logits.kind(), Kind::Float);
        let logp = logits.log_softmax(-1, Kind::Float);
        let want_logits: Vec<Vec<Vec<f32>>> = r.get("logits");
        let want_logprobs: Vec<Vec<f32>> = r.get("token_logprobs");
        let (mut logit_diff, mut logprob_diff) = (0.0f64, 0.0f64);
        for (row, (want_row, want_lp)) in want_logits.iter().zip(&want_logprobs).enumerate() {
            let n = want_row.len() as i64;
            let want = Tensor::from_slice(&want_row.concat()).view([n, -1]);
            let got = logits.get(row as i64).narrow(0, 0, n);
            logit_diff = logit_diff.max(max_abs_diff(&got, &want));
            // log p(ids[t + 1] | ids[..=t]) for each real next token.
            let next = Tensor::from_slice(&ids[row][1..n as usize]).unsqueeze(1);
            let got_lp = logp
                .get(row as i64)
                .narrow(0, 0, n - 1)
                .gather(1, &next, false)
                .squeeze_dim(1);
            logprob_diff = logprob_diff.max(max_abs_diff(&got_lp, &Tensor::from_slice(want_lp)));
        }
        assert!(
            logit_diff <= TOL,
            "{}: max |logit diff| {logit_diff} > {TOL}",
            r.name
        );
        assert!(
            logprob_diff <= TOL,
            "{}: max |logprob diff| {logprob_diff} > {TOL}",
            r.name
        );
        report.push(format!(
            "{}: max |logit diff| {logit_diff:.3e}, max |logprob diff| {logprob_diff:.3e}",
            r.name
        ));
    }
    eprintln!("{}", report.join("\n"));
}

/// 32 greedy tokens with the KV cache, and each token's log-prob, as `transformers`'
/// `generate`; the prompt is also run as the shorter row of a batch (left padding).
fn greedy_generation_matches_transformers(refs: &[Reference]) {
    for r in refs {
        let gap: f64 = r.get("greedy_min_top2_gap");
        assert!(
            gap > 1e-4,
            "{}: the reference's greedy steps have a near-tie (top-2 gap {gap}); pick another \
             seed in make_models.py",
            r.name
        );
        let prompt: Vec<u32> = r.get("greedy_prompt");
        let want: Vec<u32> = r.get("greedy_tokens");
        let want_lp: Vec<f32> = r.get("greedy_logprobs");
        assert_eq!(want.len(), 32);
        let params = GenParams {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: want.len(),
            seed: 0,
            stop_token_ids: vec![],
        };
        // As loaded, and prepared for decoding as the engine runs it (packed weights).
        let policy = Policy::load_dir(&r.dir(), Device::Cpu).unwrap();
        let mut prepared = Policy::load_dir(&r.dir(), Device::Cpu).unwrap();
        prepared.use_decode_layout();
        let other = vec![1u32; prompt.len() + 3];
        let mut runs = Vec::new();
        for (model, p) in [("as loaded", &policy), ("prepared for decoding", &prepared)] {
            let alone = p.generate(std::slice::from_ref(&prompt), std::slice::from_ref(&params));
            let batched = p.generate(
                &[other.clone(), prompt.clone()],
                &[params.clone(), params.clone()],
            );
            runs.push((format!("{model}, alone"), alone[0].clone()));
            runs.push((format!("{model}, batched"), batched[1].clone()));
        }
        for (how, g) in &runs {
            assert_eq!(g.tokens, want, "{} ({how}): greedy tokens differ", r.name);
            let diff = g
                .logprobs
                .iter()
                .zip(&want_lp)
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0.0, f64::max);
            assert!(
                diff <= TOL,
                "{} ({how}): max |greedy logprob diff| {diff} > {TOL}",
                r.name
            );
        }
    }
}

/// Tutor's `save_dir` output loads in `transformers` as the same architecture with the
/// same logits and greedy tokens.
fn tutor_checkpoints_reload_in_transformers(refs: &[Reference]) {
    let out = tempfile::tempdir().unwrap();
    let mut args: Vec<std::ffi::OsString> = vec![
        reference_dir().join("check_reload.py").into(),
        "--tol".into(),
        TOL.to_string().into(),
    ];
    for r in refs {
        let policy = Policy::load_dir(&r.dir(), Device::Cpu).unwrap();
        let saved = out.path().join(&r.name);
        policy.save_dir(&saved).unwrap();
        // The saved config must read back identically here too.
        let again = Policy::load_dir(&saved, Device::Cpu).unwrap();
        assert_eq!(again.config(), policy.config(), "{}", r.name);
        args.push(saved.into());
        args.push(r.json_path().into());
    }
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let log = run_python(&args, "check_reload.py");
    eprintln!("{log}");
    assert_eq!(
        log.lines().filter(|l| l.ends_with(": ok")).count(),
        EXPECTED.len(),
        "{log}"
    );
}

/// A checkpoint directory whose config.json names an architecture or RoPE type this crate
/// does not implement is refused with the file and field named. (No Python needed: the
/// directory is written by Tutor, in the layout `transformers` 5 writes.)
#[test]
fn unsupported_architecture_or_rope_type_is_a_clear_error() {
    let src_dir = tempfile::tempdir().unwrap();
    let src = src_dir.path();
    Policy::new(ModelConfig::tiny(64), Device::Cpu, 0)
        .save_dir(src)
        .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    // transformers 5 layout: RoPE settings under rope_parameters.
    let theta = config
        .as_object_mut()
        .unwrap()
        .remove("rope_theta")
        .unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta});
    std::fs::write(src.join("config.json"), config.to_string()).unwrap();
    Policy::load_dir(src, Device::Cpu).expect("the unedited directory loads");
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: [(&str, Edit, &[&str]); 4] = [
        (
            "architecture",
            Box::new(|c| c["architectures"] = serde_json::json!(["MistralForCausalLM"])),
            &["architectures", "MistralForCausalLM"],
        ),
        (
            "model_type",
            Box::new(|c| c["model_type"] = "gemma3".into()),
            &["model_type", "gemma3"],
        ),
        (
            "rope_type",
            Box::new(|c| {
                c["rope_parameters"] =
                    serde_json::json!({"rope_type": "longrope", "rope_theta": 1000.0})
            }),
            &["rope_parameters.rope_type", "longrope"],
        ),
        (
            "legacy rope_scaling type",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("rope_parameters");
                c["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
            }),
            &["rope_scaling.rope_type", "dynamic"],
        ),
    ];
    for (what, edit, needles) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            src.join("model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let mut c = config.clone();
        edit(&mut c);
        std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
        let msg = Policy::load_dir(dir.path(), Device::Cpu)
            .err()
            .unwrap_or_else(|| panic!("{what}: loaded"))
            .to_string();
        assert!(msg.contains("config.json"), "{what}: {msg}");
        for needle in needles {
            assert!(msg.contains(needle), "{what}: {msg}");
        }
    }
}
