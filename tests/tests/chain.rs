//! Runs chained as the papers chain them (BC, then RFT from the BC result): `[model]
//! init_from` starts a run from an earlier run's last version, bit for bit, and `tutor
//! export` writes a version as a directory that transformers loads.

mod common;

use std::path::{Path, PathBuf};

const BC: &str = r#"
[run]
name = "bc"
workers = 1

[tasks]
source = "toy"
toy_train = 4
toy_heldout = 1
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
algorithm = "bc"
iterations = 1
episodes_per_iteration = 4
heldout_episodes = 1
max_turns = 5
max_new_tokens = 16
epochs_per_iteration = 2
max_steps_per_iteration = 2

[learner]
learning_rate = 5e-3
warmup_steps = 0
"#;

/// RFT from the BC run: the `[model]` section names only where the student comes from.
fn rft(init_from: &Path) -> String {
    format!(
        r#"
[run]
name = "rft"
workers = 1

[tasks]
source = "toy"
toy_train = 4
toy_heldout = 1
seed = 5

[model]
init_from = "{}"

[coordinator]
algorithm = "rft"
samples_per_task = 2
tasks_per_iteration = 2
iterations = 1
heldout_episodes = 1
max_turns = 4
max_new_tokens = 16
epochs_per_iteration = 1
max_steps_per_iteration = 1
"#,
        init_from.display()
    )
}

/// `tutor run` on `config` with runs under `out_dir`; returns the run directory.
fn run(dir: &Path, name: &str, config: &str) -> PathBuf {
    let cfg = dir.join(format!("{name}.toml"));
    let out_dir = dir.join(name);
    std::fs::write(&cfg, config).unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_PYTHON", common::python())
        .env("TUTOR_RUN__OUT_DIR", &out_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tutor run ({name}) failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: Vec<PathBuf> = std::fs::read_dir(&out_dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    runs.into_iter().next().unwrap()
}

fn version_file(run: &Path, v: u64) -> PathBuf {
    run.join(format!("learner/versions/policy-v{v:06}.safetensors"))
}

fn final_version(run: &Path) -> u64 {
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    summary["final_version"].as_u64().unwrap()
}

#[test]
fn rft_starts_from_the_bc_result_and_exports_load_in_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let bc = run(dir.path(), "bc", BC);
    let bc_final = final_version(&bc);
    assert!(bc_final >= 1, "BC trained");

    let rft_run = run(dir.path(), "rft", &rft(&bc));
    // Version 0 of the RFT run is the BC run's last version, byte for byte, and the
    // tokenizer is the one BC trained with.
    assert_eq!(
        std::fs::read(version_file(&rft_run, 0)).unwrap(),
        std::fs::read(version_file(&bc, bc_final)).unwrap(),
        "the RFT run did not start from the BC result"
    );
    assert_eq!(
        std::fs::read(rft_run.join("model/tokenizer.json")).unwrap(),
        std::fs::read(bc.join("model/tokenizer.json")).unwrap()
    );

    // The RFT result, exported, loads in transformers: model, tokenizer and chat template.
    let export = dir.path().join("export");
    let out = common::tutor(&[
        "export",
        rft_run.to_str().unwrap(),
        "--out",
        export.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = r#"
import sys, torch, transformers
d = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(d)
tok = transformers.AutoTokenizer.from_pretrained(d)
msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}]
text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
assert text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nfix it<|im_end|>\n<|im_start|>assistant\n", repr(text)
ids = tok(text, return_tensors="pt").input_ids
assert ids[0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>"), ids
with torch.no_grad():
    logits = model(ids).logits
assert torch.isfinite(logits).all()
out = model.generate(ids, max_new_tokens=4, do_sample=False)
print("ok", model.config.model_type, out.shape[1] - ids.shape[1])
"#;
    let py = std::process::Command::new(common::python())
        .args(["-c", script, export.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "transformers could not load the export:\n{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let said = String::from_utf8_lossy(&py.stdout);
    assert!(said.starts_with("ok qwen3"), "{said}");
}

#[test]
fn init_from_a_directory_that_is_no_model_is_a_clear_error_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    let out_dir = dir.path().join("runs");
    std::fs::write(&cfg, rft(dir.path())).unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_PYTHON", common::python())
        .env("TUTOR_RUN__OUT_DIR", &out_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("model.init_from") && stderr.contains("neither a run directory"),
        "{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&out_dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}

/// On-policy distillation with the teacher behind `tutor serve` (OpenAI-compatible, vLLM's
/// `prompt_logprobs`): student and teacher both start from the BC result, so at version 0
/// the teacher's log-prob of every student token equals the student's own sampling
/// log-prob (temperature 1, unbiased) and the reverse-KL advantage is 0 everywhere.
#[test]
fn distillation_scores_student_tokens_with_the_teacher_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let bc = run(dir.path(), "bc", BC);
    let teacher_dir = dir.path().join("teacher");
    let out = common::tutor(&[
        "export",
        bc.to_str().unwrap(),
        "--out",
        teacher_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let teacher = common::serve(&teacher_dir, "teacher", dir.path(), &[]);
    let addr = &teacher.addr;
    let config = format!(
        r#"
[run]
name = "distill"
workers = 1

[tasks]
source = "toy"
toy_train = 4
toy_heldout = 1
seed = 5

[model]
init_from = "{}"

[coordinator]
algorithm = "distill"
iterations = 1
episodes_per_iteration = 3
heldout_episodes = 1
max_turns = 3
max_new_tokens = 12
epochs_per_iteration = 1
max_steps_per_iteration = 1

[worker.teacher]
kind = "endpoint"
base_url = "http://{addr}/v1"
model = "teacher"
max_tokens = 24
"#,
        bc.display()
    );
    let run_dir = run(dir.path(), "distill", &config);
    let (events, _) =
        tutor_coordinator::store::scan(&run_dir.join("trajectories/events.log")).unwrap();
    let mut scored = 0;
    for ev in &events {
        let Some(tutor_proto::episode_event::Event::Turn(t)) = &ev.event else {
            continue;
        };
        if !ev.episode_id.contains("train") || !t.student_generated {
            assert!(
                t.teacher_logprobs_of_student.is_empty(),
                "{}",
                ev.episode_id
            );
            continue;
        }
        assert!(t.unbiased_sampling, "distillation samples unbiased");
        assert_eq!(
            t.teacher_logprobs_of_student.len(),
            t.student_tokens.len(),
            "{} turn {}",
            ev.episode_id,
            t.turn_index
        );
        for (teacher, student) in t
            .teacher_logprobs_of_student
            .iter()
            .zip(&t.student_logprobs)
        {
            assert!(
                (teacher - student).abs() < 2e-3,
                "same weights, different log-probs: teacher {teacher} vs student {student}"
            );
        }
        scored += t.student_tokens.len();
    }
    assert!(scored > 0, "no student token was scored");
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert_eq!(row["algorithm"], "distill", "{row}");
    // The metrics' reverse KL is the mean of log π_student − log π_teacher over the
    // scored tokens: 0 up to float noise when both are the same weights.
    let kl = row["reverse_kl"]
        .as_f64()
        .unwrap_or_else(|| panic!("no reverse_kl in the distillation's metrics row: {row}"));
    assert!(kl.abs() < 2e-3, "reverse KL {kl} between identical weights");
}

/// BC from a student of another family: a Llama-3-style directory (tests/fixtures/
/// llama3-student/make.py: Llama weights, a tokenizer with Llama-3's special tokens and no
/// ChatML token, Meta's chat template, two end-of-sequence ids in generation_config.json).
fn bc_from(init_from: &Path) -> String {
    format!(
        r#"
[run]
name = "llama"
workers = 1

[tasks]
source = "toy"
toy_train = 4
toy_heldout = 1
seed = 5

[model]
init_from = "{}"

[coordinator]
algorithm = "bc"
iterations = 1
episodes_per_iteration = 3
heldout_episodes = 1
max_turns = 3
max_new_tokens = 12
epochs_per_iteration = 1
max_steps_per_iteration = 2

[learner]
learning_rate = 5e-3
warmup_steps = 0
"#,
        init_from.display()
    )
}

/// A student without ChatML tokens rolls out in its own chat format, trains and exports:
/// every stored context reads as the Llama-3 template renders the conversation (checked
/// with transformers' tokenizer of the same directory), teacher messages close with
/// `<|eot_id|>`, student messages end on a stop id of the model or at max_new_tokens, and
/// the export renders chats with the model's template in transformers.
#[test]
fn a_llama3_student_rolls_out_in_its_own_chat_format_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let student = dir.path().join("llama3");
    let maker = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/llama3-student/make.py");
    let made = std::process::Command::new(common::python())
        .arg(&maker)
        .arg(&student)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let run_dir = run(dir.path(), "llama", &bc_from(&student));
    assert!(final_version(&run_dir) >= 1, "BC trained the Llama student");

    // Every stored turn, for transformers to read.
    let (events, _) =
        tutor_coordinator::store::scan(&run_dir.join("trajectories/events.log")).unwrap();
    let mut turns = Vec::new();
    for ev in &events {
        let Some(tutor_proto::episode_event::Event::Turn(t)) = &ev.event else {
            continue;
        };
        let student_acted = t.executed == tutor_proto::Actor::Student as i32;
        let executed = if student_acted {
            &t.student_tokens
        } else {
            &t.teacher_tokens
        };
        turns.push(serde_json::json!({
            "episode": ev.episode_id,
            "turn": t.turn_index,
            "delta": t.context_delta_tokens,
            "executed": executed,
            "student": student_acted,
            "rebuilt": t.context_rebuilt,
        }));
    }
    assert!(
        turns.iter().any(|t| t["student"] == true),
        "no student turn"
    );
    assert!(
        turns.iter().any(|t| t["student"] == false),
        "no teacher turn"
    );
    let turns_file = dir.path().join("turns.json");
    std::fs::write(&turns_file, serde_json::to_string(&turns).unwrap()).unwrap();
    let check = r#"
import json, re, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
turns = json.load(open(sys.argv[2]))
max_new = int(sys.argv[3])
eot, eos = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
H = "<|start_header_id|>{}<|end_header_id|>\n\n"
prompt = re.compile(re.escape("<|begin_of_text|>" + H.format("system")) + "(.*)<\\|eot_id\\|>"
                    + re.escape(H.format("user")) + "(.*)<\\|eot_id\\|>" + re.escape(H.format("assistant")), re.S)
prev = {}
for t in sorted(turns, key=lambda t: (t["episode"], t["turn"])):
    text = tok.decode(t["delta"], skip_special_tokens=False)
    assert "<|im_" not in text, text
    if t["turn"] == 0:
        m = prompt.fullmatch(text)
        assert m, repr(text)
        msgs = [{"role": "system", "content": m[1]}, {"role": "user", "content": m[2]}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ids == t["delta"], "the prompt's ids differ from apply_chat_template's"
    elif t["rebuilt"]:
        # The whole context again, old observations elided: the same format throughout.
        assert text.startswith("<|begin_of_text|>" + H.format("system")), repr(text)
        assert text.endswith("<|eot_id|>" + H.format("assistant")), repr(text)
    else:
        closed = prev[t["episode"]][-1] == eot
        body = text if closed else text.removeprefix("<|eot_id|>")
        assert closed or text.startswith("<|eot_id|>"), repr(text)
        assert body.startswith(H.format("user")) and body.endswith(H.format("assistant")), repr(text)
    ex = t["executed"]
    if t["student"]:
        assert ex[-1] in (eot, eos) or len(ex) == max_new, (ex, max_new)
        assert eot not in ex[:-1] and eos not in ex[:-1], ex
    else:
        assert ex[-1] == eot and eot not in ex[:-1], ex
    prev[t["episode"]] = ex
print("checked", len(turns))
"#;
    let py = std::process::Command::new(common::python())
        .args(["-c", check])
        .arg(&student)
        .arg(&turns_file)
        .arg("12")
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "the stored contexts are not the Llama-3 chat format:\n{}\n{}",
        String::from_utf8_lossy(&py.stdout),
        String::from_utf8_lossy(&py.stderr)
    );

    // The export keeps the model's own template and generation config.
    let export = dir.path().join("export");
    let out = common::tutor(&[
        "export",
        run_dir.to_str().unwrap(),
        "--out",
        export.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = r#"
import sys, transformers
d = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(d)
tok = transformers.AutoTokenizer.from_pretrained(d)
text = tok.apply_chat_template([{"role": "user", "content": "fix it"}], tokenize=False, add_generation_prompt=True)
assert text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nfix it<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", repr(text)
assert model.generation_config.eos_token_id == [1, 4], model.generation_config.eos_token_id
print("ok", model.config.model_type)
"#;
    let py = std::process::Command::new(common::python())
        .args(["-c", script, export.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "transformers could not load the export:\n{}",
        String::from_utf8_lossy(&py.stderr)
    );
    assert!(String::from_utf8_lossy(&py.stdout).starts_with("ok llama"));
}
