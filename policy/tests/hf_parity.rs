//! Parity with Hugging Face `transformers`: a tiny random Qwen3ForCausalLM saved by
//! `transformers` (tests/fixtures/qwen3_tiny, made by make_qwen3_tiny.py) must load here and
//! give the logits and greedy tokens `transformers` computed. This pins down what a
//! self-consistent implementation could still get wrong: parameter names and layouts, the
//! RoPE convention and theta, the q/k norms, GQA head grouping and the RMSNorm details.

use std::path::PathBuf;

use tch::{Device, Kind, Tensor};
use tutor_policy::{GenParams, Policy};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_tiny")
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn int_rows(v: &serde_json::Value) -> Vec<Vec<i64>> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn logits_match_transformers() {
    let policy = Policy::load_dir(&fixture(), Device::Cpu).unwrap();
    assert_eq!(
        policy.config().rope_theta,
        1000.0,
        "rope_theta is read from rope_parameters"
    );
    let e = expected();
    let ids = int_rows(&e["input_ids"]);
    let mask = int_rows(&e["attention_mask"]);
    let (b, t) = (ids.len() as i64, ids[0].len() as i64);
    let ids = Tensor::from_slice(&ids.concat()).view([b, t]);
    let mask = Tensor::from_slice(&mask.concat()).view([b, t]);
    let logits = policy.forward(&ids, &mask);
    let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(e["logits"].clone()).unwrap();
    for (row, want_row) in want.iter().enumerate() {
        let n = want_row.len() as i64;
        let want = Tensor::from_slice(&want_row.concat()).view([n, -1]);
        let got = logits.get(row as i64).narrow(0, 0, n);
        let diff = f64::try_from((&got - &want).abs().max()).unwrap();
        assert!(diff < 1e-4, "row {row}: max |logit diff| {diff}");
    }
    assert_eq!(logits.kind(), Kind::Float);
}

#[test]
fn greedy_generation_matches_transformers() {
    let policy = Policy::load_dir(&fixture(), Device::Cpu).unwrap();
    let e = expected();
    let prompt: Vec<u32> = serde_json::from_value(e["greedy_prompt"].clone()).unwrap();
    let want: Vec<u32> = serde_json::from_value(e["greedy_tokens"].clone()).unwrap();
    let params = GenParams {
        temperature: 0.0,
        max_new_tokens: want.len(),
        seed: 0,
        stop_token_ids: vec![],
    };
    // Also as the shorter row of a batch, so left padding is exercised against the reference.
    let other = vec![1u32; prompt.len() + 3];
    let out = policy.generate(&[other, prompt], &[params.clone(), params]);
    assert_eq!(out[1].tokens, want);
}
