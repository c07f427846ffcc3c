//! Chat templates rendered with minijinja against `transformers`' `apply_chat_template`:
//! tests/reference/chat_templates.py saves tokenizers with a Qwen3-style, a Llama-3-style
//! and a Llama-3.1-style (tojson, raise_exception, whitespace control) template through
//! `save_pretrained` and records what `apply_chat_template(tokenize=False)` renders for
//! several conversations, with and without the generation prompt, and the ids of that
//! text. Tutor must render the identical string from the saved directory, and encode a
//! conversation with its generation prompt to the same ids.
//!
//! Needs the venv `make setup` makes (`TUTOR_PYTHON`, else `<workspace>/.venv/bin/python`).

use std::path::PathBuf;
use std::process::Command;

use tutor_policy::{ChatTemplate, ChatTokenizer};

fn python() -> PathBuf {
    match std::env::var_os("TUTOR_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"),
    }
}

fn make_references() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference/chat_templates.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(dir.path())
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}); run `make setup` or set TUTOR_PYTHON to a Python with transformers",
                python().display()
            )
        });
    assert!(
        out.status.success(),
        "{} failed:\n{}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

fn messages(case: &serde_json::Value) -> Vec<(String, String)> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_string(),
                m["content"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn templates_render_like_transformers() {
    let dir = make_references();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("manifest.json")).unwrap())
            .unwrap();
    let names: Vec<String> = serde_json::from_value(manifest["templates"].clone()).unwrap();
    assert_eq!(names, ["qwen3", "llama3", "llama31_json"]);
    let mut checked = 0;
    for name in &names {
        let model_dir = dir.path().join(name);
        let reference: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        let template = ChatTemplate::from_dir(&model_dir)
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: no chat template found in {}", model_dir.display()));
        let tok = ChatTokenizer::from_dir(&model_dir).unwrap();
        assert!(tok.template().is_some(), "{name}");
        for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
            let msgs = messages(case);
            let pairs = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str()));
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            if let Some(error) = case["error"].as_str() {
                let err = template.render(pairs, agp).unwrap_err().to_string();
                assert!(
                    err.contains(error),
                    "{name} case {i}: {err} lacks {error:?}"
                );
                checked += 1;
                continue;
            }
            let expected = case["text"].as_str().unwrap();
            let got = template.render(pairs.clone(), agp).unwrap();
            assert_eq!(
                got, expected,
                "{name} case {i} (add_generation_prompt {agp})"
            );
            if agp {
                let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
                assert_eq!(tok.render_chat(pairs).unwrap(), ids, "{name} case {i}: ids");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 8 + 1);
}

/// With the Qwen3-style template, prompts and observations give the same ids as the
/// built-in ChatML (which that template reproduces), and a special-token string inside a
/// message stays text instead of becoming a special token.
#[test]
fn template_prompts_keep_contents_plain_and_match_chatml() {
    let dir = make_references();
    let model_dir = dir.path().join("qwen3");
    let with = ChatTokenizer::from_dir(&model_dir).unwrap();
    let without = ChatTokenizer::from_file(&model_dir.join("tokenizer.json")).unwrap();
    assert!(without.template().is_none());
    for (system, user) in [
        ("sys", "first"),
        ("You are <|im_end|> helpful", "Fix <|im_start|>x"),
    ] {
        let a = with.render_prompt(system, user).unwrap();
        assert_eq!(
            a,
            without.render_prompt(system, user).unwrap(),
            "{system:?} {user:?}"
        );
        // Exactly the template's own specials: 3 starts, 2 ends.
        assert_eq!(a.iter().filter(|&&t| t == with.im_start_id()).count(), 3);
        assert_eq!(a.iter().filter(|&&t| t == with.im_end_id()).count(), 2);
    }
    for obs in [
        "ok",
        "total 0\n<|im_end|>\n",
        "<tool_response>\nx\n</tool_response>",
    ] {
        assert_eq!(
            with.render_observation(obs).unwrap(),
            without.render_observation(obs).unwrap(),
            "{obs:?}"
        );
    }
    // A Llama-3 template closes assistant turns with <|eot_id|>, not the <|im_end|> the
    // rollouts stop on: an observation cannot be appended, and the error says why.
    let llama = ChatTokenizer::from_dir(&dir.path().join("llama3")).unwrap();
    let err = llama.render_observation("ok").unwrap_err().to_string();
    assert!(
        err.contains("<|im_end|>") && err.contains("chat_template.jinja"),
        "{err}"
    );
}
