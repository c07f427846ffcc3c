//! Property tests for what a model directory hands the policy crate, all of it untrusted
//! (a directory from the Hub, or any `model.init_from`): the chat template (Jinja), the
//! safetensors headers, and `model.safetensors.index.json`'s shard names.
//!
//! Each property says what a user relies on: no panic, no hang, no unbounded allocation;
//! an error naming the file and the problem. Case counts are small so the file runs in
//! seconds in a debug build; regressions are not persisted to files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, RngSeed};
use tch::Device;

use tutor_policy::{weight_files, ChatTemplate, ModelConfig, Policy, INDEX_FILE};

/// `cases` per property, from a fixed seed so every run (CI's too) tries the same
/// inputs and a failure reproduces; `PROPTEST_CASES` and `PROPTEST_RNG_SEED` override
/// both for a longer hunt.
fn config(cases: u32) -> ProptestConfig {
    let defaults = ProptestConfig::default();
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(cases),
        rng_seed: match std::env::var_os("PROPTEST_RNG_SEED") {
            Some(_) => defaults.rng_seed,
            None => RngSeed::Fixed(0x74_7574_6f72),
        },
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..defaults
    }
}

// ---------------------------------------------------------------------------------------
// Chat templates.
// ---------------------------------------------------------------------------------------

const SOURCE: &str = "models/evil/chat_template.jinja";

fn template(src: &str) -> Result<ChatTemplate, String> {
    ChatTemplate::new(src.to_string(), SOURCE.to_string(), BTreeMap::new())
        .map_err(|e| e.to_string())
}

/// Renders `src` with two messages; the error text, or the output.
fn render(src: &str) -> Result<String, String> {
    template(src)?
        .render([("system", "be brief"), ("user", "hi")], true)
        .map_err(|e| e.to_string())
}

/// The Qwen3 template of the transformers reference test (tests/reference).
fn qwen3_template() -> String {
    let py = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference/chat_templates.py"),
    )
    .unwrap();
    let start = py.find("QWEN3 = r\"\"\"").expect("QWEN3 template") + "QWEN3 = r\"\"\"".len();
    let end = start + py[start..].find("\"\"\"").unwrap();
    py[start..end].to_string()
}

/// A loop far longer than any conversation needs: without fuel it runs ~10^8
/// instructions (seconds to minutes); with fuel it stops with an error naming the
/// template and the limit.
#[test]
fn template_that_loops_runs_out_of_fuel() {
    let start = Instant::now();
    let err = render(
        "{% for i in range(100000) %}{% for j in range(1000) %}{% if i == -1 %}x{% endif %}{% endfor %}{% endfor %}",
    )
    .unwrap_err();
    assert!(err.contains(SOURCE) && err.contains("RENDER_FUEL"), "{err}");
    // Recursion is bounded too (minijinja's recursion limit).
    let err = render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").unwrap_err();
    assert!(err.contains(SOURCE), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// A template that prints ~100 MB: the render stops at the output cap, with an error
/// naming the template and the limit, instead of building the whole string.
#[test]
fn template_output_is_capped() {
    let err = render("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}").unwrap_err();
    assert!(
        err.contains(SOURCE) && err.contains("MAX_RENDER_BYTES"),
        "{err}"
    );
    // Just under the cap renders.
    let ok = render("{% for i in range(100) %}{{ 'x' * 100000 }}{% endfor %}").unwrap();
    assert_eq!(ok.len(), 10_000_000);
}

/// `tojson` with an absurd indent or a value nested without end: an error, not a
/// terabyte allocation or a stack overflow (both abort the process).
#[test]
fn tojson_limits_indent_and_depth() {
    let err = render("{{ messages | tojson(indent=1000000000000) }}").unwrap_err();
    assert!(err.contains("indent") && err.contains(SOURCE), "{err}");
    let err = render(
        "{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}",
    )
    .unwrap_err();
    assert!(err.contains("deeper") && err.contains(SOURCE), "{err}");
    assert!(render("{{ messages | tojson(indent=4) }}").is_ok());
}

/// The example of the issue: `set` inside a `for` is scoped to the iteration (as in
/// Jinja), so `s` never grows; the render ends at once.
#[test]
fn set_inside_a_loop_does_not_accumulate() {
    let out = render(
        "{% set s = 'a' %}{% for i in range(100) %}{% set s = s ~ s %}{% endfor %}{{ s | length }}",
    )
    .unwrap();
    assert_eq!(out, "1");
}

const JINJA_ATOMS: &[&str] = &[
    "{{ ",
    " }}",
    "{% ",
    " %}",
    "{%- ",
    " -%}",
    "{# ",
    " #}",
    "for m in messages",
    "endfor",
    "if ",
    "endif",
    "else",
    "set x = ",
    "macro f(a)",
    "endmacro",
    "f(1)",
    "raw",
    "endraw",
    "m.content",
    "m['role']",
    "messages[-1]",
    "messages[::-1]",
    "loop.index",
    "x",
    "'a'",
    "\"b\"",
    "1",
    "99999999999999999999",
    "-1",
    " ~ ",
    " + ",
    " * ",
    " / ",
    " // ",
    " % ",
    " ** ",
    "|",
    "tojson",
    "tojson(indent=2)",
    "trim",
    "length",
    "join(',')",
    "replace('a', 'bb')",
    "indent(4)",
    ".strip()",
    ".split('x')",
    ".startswith('a')",
    "range(10)",
    "namespace(y=1)",
    "raise_exception('no')",
    "bos_token",
    "add_generation_prompt",
    "tools",
    "(",
    ")",
    "[",
    "]",
    ",",
    ":",
    "\n",
    " ",
    "é",
    "\u{0}",
];

proptest! {
    #![proptest_config(config(256))]

    /// Any template source (Jinja-shaped noise): compiling and rendering never panic,
    /// and every error names the template.
    #[test]
    fn template_noise_never_panics(
        src in proptest::collection::vec(proptest::sample::select(JINJA_ATOMS), 0..40)
            .prop_map(|v| v.concat()),
    ) {
        match template(&src) {
            Err(e) => prop_assert!(e.contains(SOURCE), "{}", e),
            Ok(t) => match t.render([("user", "hi {{ x }}"), ("assistant", "")], true) {
                Ok(out) => prop_assert!(out.len() <= tutor_policy::MAX_RENDER_BYTES),
                Err(e) => {
                    let e = e.to_string();
                    prop_assert!(e.contains(SOURCE), "{}", e);
                }
            },
        }
    }

    /// Any message contents through a real template (Qwen3's): never a panic, and a user's
    /// content appears verbatim (it is data, never template code: `{{ 7 * 7 }}` stays).
    #[test]
    fn template_renders_any_content_verbatim(
        contents in proptest::collection::vec(
            prop_oneof![
                any::<String>(),
                "(\\{\\{ 7 \\* 7 \\}\\}|\\{% raw %\\}|<think>|</think>|<\\|im_end\\|>|\u{0}|\n){0,6}",
            ],
            1..5,
        ),
    ) {
        static TEMPLATE: std::sync::OnceLock<ChatTemplate> = std::sync::OnceLock::new();
        let t = TEMPLATE.get_or_init(|| {
            ChatTemplate::new(qwen3_template(), "qwen3".into(), BTreeMap::new()).unwrap()
        });
        let messages: Vec<(&str, &str)> = contents.iter().map(|c| ("user", c.as_str())).collect();
        let out = t.render(messages, true).unwrap();
        for c in &contents {
            prop_assert!(out.contains(c.trim()), "{:?} missing from {:?}", c, out);
        }
    }
}

// ---------------------------------------------------------------------------------------
// safetensors headers.
// ---------------------------------------------------------------------------------------

fn tiny_policy() -> Policy {
    let mut c = ModelConfig::tiny(64);
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.head_dim = 16;
    c.max_position_embeddings = 256;
    Policy::new(c, Device::Cpu, 0)
}

/// A safetensors file: the 8-byte header length (as given, or the real one), the header,
/// then `data_len` bytes.
fn safetensors_bytes(claimed_len: Option<u64>, header: &str, data_len: usize) -> Vec<u8> {
    let mut bytes = claimed_len
        .unwrap_or(header.len() as u64)
        .to_le_bytes()
        .to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data_len, 0x3f);
    bytes
}

thread_local! {
    /// One model per test thread: the loads below all fail before copying anything.
    static POLICY: std::rc::Rc<std::cell::RefCell<Policy>> =
        std::rc::Rc::new(std::cell::RefCell::new(tiny_policy()));
}

fn check_load_error(msg: &str, path: &Path) {
    assert!(
        msg.contains(&path.display().to_string()),
        "file not named: {msg}"
    );
}

/// Headers built from the fields safetensors reads: names of the model's tensors and
/// others, every dtype, absurd shapes and offsets (reversed, overlapping, past the end,
/// `u64::MAX`), and metadata.
fn header_json() -> impl Strategy<Value = String> {
    let name = prop_oneof![
        Just("model.norm.weight".to_string()),
        Just("model.embed_tokens.weight".to_string()),
        Just("__metadata__".to_string()),
        "[a-z.]{1,8}",
    ];
    let dtype = proptest::sample::select(
        &[
            "F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "Q4", "",
        ][..],
    );
    let dim = prop_oneof![
        0u64..200,
        Just(u64::MAX),
        Just(1u64 << 32),
        Just(1u64 << 62)
    ];
    let offset = prop_oneof![
        0u64..5000,
        Just(u64::MAX),
        Just(u64::MAX - 7),
        Just(1u64 << 63)
    ];
    let tensor = (
        name,
        dtype,
        proptest::collection::vec(dim, 0..4),
        (offset.clone(), offset),
    )
        .prop_map(|(name, dtype, shape, (s, e))| {
            format!(
                "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{s},{e}]}}"
            )
        });
    (proptest::collection::vec(tensor, 0..4), any::<bool>()).prop_map(|(tensors, meta)| {
        let mut parts = tensors;
        if meta {
            parts.push("\"__metadata__\":{\"format\":\"pt\"}".to_string());
        }
        format!("{{{}}}", parts.join(","))
    })
}

proptest! {
    #![proptest_config(config(128))]

    /// Arbitrary bytes as a checkpoint: an error naming the file, never a panic.
    #[test]
    fn safetensors_arbitrary_bytes_are_errors(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let policy = POLICY.with(|p| p.clone());
        let mut policy = policy.borrow_mut();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let msg = policy.load_weights(&path).unwrap_err().to_string();
        check_load_error(&msg, &path);
    }

    /// Structured headers with hostile lengths, shapes and offsets: an error naming the
    /// file (the model's tensors cannot all be there), never a panic or an allocation of
    /// what the header claims.
    #[test]
    fn safetensors_hostile_headers_are_errors(
        header in header_json(),
        claimed in prop_oneof![
            3 => Just(None),
            1 => prop_oneof![Just(u64::MAX), Just(u64::MAX - 7), Just(100_000_001u64), 0u64..600]
                .prop_map(Some),
        ],
        data_len in prop_oneof![0usize..64, Just(4096usize)],
    ) {
        let policy = POLICY.with(|p| p.clone());
        let mut policy = policy.borrow_mut();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, safetensors_bytes(claimed, &header, data_len)).unwrap();
        let msg = policy.load_weights(&path).unwrap_err().to_string();
        check_load_error(&msg, &path);
    }
}

/// Regression: a header whose one tensor claims `usize::MAX` bytes (a valid shape for
/// safetensors, `[18446744073709551615]` of U8) made safetensors 0.3 overflow `end +
/// 8 + header length` (a panic in debug builds) instead of reporting a short file.
#[test]
fn safetensors_tensor_of_usize_max_bytes_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let header = format!(
        "{{\"a\":{{\"dtype\":\"U8\",\"shape\":[{m}],\"data_offsets\":[0,{m}]}}}}",
        m = u64::MAX
    );
    std::fs::write(&path, safetensors_bytes(None, &header, 16)).unwrap();
    let msg = tiny_policy().load_weights(&path).unwrap_err().to_string();
    check_load_error(&msg, &path);
    assert!(msg.contains("`a`") && msg.contains("past the end"), "{msg}");
}

/// A real checkpoint with its header's numbers changed one at a time: loads or fails
/// naming the file; never a panic.
#[test]
fn safetensors_corrupted_real_header_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    let a = tiny_policy();
    a.save_weights(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap().to_string();
    let mut b = tiny_policy();
    let path = dir.path().join("bad.safetensors");
    // Every number in the header, replaced by a few hostile values.
    let digits: Vec<(usize, usize)> = {
        let mut spans = Vec::new();
        let mut i = 0;
        let hb = header.as_bytes();
        while i < hb.len() {
            if hb[i].is_ascii_digit() {
                let s = i;
                while i < hb.len() && hb[i].is_ascii_digit() {
                    i += 1;
                }
                spans.push((s, i));
            } else {
                i += 1;
            }
        }
        spans
    };
    for (k, &(s, e)) in digits.iter().enumerate().step_by(3) {
        let value = ["0", "18446744073709551615", "4294967296"][k % 3];
        let mut h = header.clone();
        h.replace_range(s..e, value);
        std::fs::write(&path, safetensors_bytes(None, &h, bytes.len() - 8 - n)).unwrap();
        match b.load_weights(&path) {
            Ok(()) => {}
            Err(e) => check_load_error(&e.to_string(), &path),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shard index paths.
// ---------------------------------------------------------------------------------------

fn index_dir(weight_map: serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
    dir
}

/// Regression: `weight_map` entries were joined to the directory as given, so an index
/// could point the loader (and `tutor`'s model copy) at any file on the machine.
#[test]
fn shard_paths_outside_the_directory_are_refused() {
    for evil in [
        "../../etc/passwd",
        "/etc/passwd",
        "shards/../../x.safetensors",
        "..",
        "",
        ".",
        "./..",
    ] {
        let dir = index_dir(serde_json::json!({
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": evil,
        }));
        let msg = weight_files(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains(INDEX_FILE) && msg.contains("lm_head.weight") && msg.contains("inside"),
            "{evil:?}: {msg}"
        );
    }
    // Plain names, and names in a subdirectory, stay inside: accepted.
    let dir = index_dir(serde_json::json!({
        "a": "model-00001-of-00002.safetensors",
        "b": "./shards/model-00002-of-00002.safetensors",
    }));
    let files = weight_files(dir.path()).unwrap();
    assert_eq!(files.len(), 2);
    assert!(files.iter().all(|f| f.starts_with(dir.path())));
}

proptest! {
    #![proptest_config(config(256))]

    /// Any `weight_map`: the shard files returned are all inside the directory, or the
    /// index is refused with an error naming it.
    #[test]
    fn shard_paths_stay_inside_the_directory(
        names in proptest::collection::vec(
            prop_oneof![
                "[a-z0-9._-]{0,12}",
                "(\\.\\.|\\.|[a-z]{1,3}|/|//)(/(\\.\\.|\\.|[a-z]{1,3}))*/?",
                any::<String>(),
            ],
            1..4,
        ),
        not_a_string in any::<bool>(),
    ) {
        let mut map = serde_json::Map::new();
        for (i, n) in names.iter().enumerate() {
            map.insert(format!("t{i}"), serde_json::Value::String(n.clone()));
        }
        if not_a_string {
            map.insert("odd".into(), serde_json::json!(7));
        }
        let dir = index_dir(serde_json::Value::Object(map));
        match weight_files(dir.path()) {
            Ok(files) => {
                prop_assert!(!not_a_string);
                for f in &files {
                    let rel = f.strip_prefix(dir.path()).unwrap();
                    prop_assert!(
                        rel.components().all(|c| matches!(c, std::path::Component::Normal(_))),
                        "{:?} escapes {:?}", f, dir.path()
                    );
                    prop_assert!(rel.components().next().is_some());
                }
            }
            Err(e) => {
                let e = e.to_string();
                prop_assert!(e.contains(INDEX_FILE), "{}", e);
            }
        }
    }
}

/// Arbitrary bytes as `model.safetensors.index.json`: an error naming it, never a panic.
#[test]
fn index_json_noise_is_an_error() {
    for text in [
        "",
        "{",
        "[]",
        "{\"weight_map\": 3}",
        "{\"weight_map\": {\"a\": null}}",
        "\u{0}",
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(INDEX_FILE), text).unwrap();
        let msg = weight_files(dir.path()).unwrap_err().to_string();
        assert!(msg.contains(INDEX_FILE), "{text:?}: {msg}");
    }
    // A real load through the index: shard names are checked before any is opened.
    let dir = index_dir(serde_json::json!({ "model.norm.weight": "/dev/zero" }));
    tiny_policy()
        .config()
        .save(&dir.path().join("config.json"))
        .unwrap();
    let msg = Policy::load_dir(dir.path(), Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("/dev/zero") && msg.contains("inside"), "{msg}");
}
