//! `tutor serve` as a client sees it: a tiny Qwen3 checkpoint made by `transformers`
//! (tests/serve/make_model.py) served on a loopback port, spoken to over raw HTTP/1.1 and
//! with the official `openai` Python client (tests/serve/openai_client.py).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

const MODEL: &str = "tiny-qwen3";

/// A running `tutor serve` on a model of its own (both gone on drop).
struct Server {
    _served: common::Served,
    addr: String,
    _dir: tempfile::TempDir,
}

fn start(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &[]);
    let served = common::serve(&model, MODEL, dir.path(), extra);
    Server {
        addr: served.addr.clone(),
        _served: served,
        _dir: dir,
    }
}

/// One HTTP/1.1 exchange (Connection: close): status and body, de-chunked.
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    http_with(addr, method, path, body, "")
}

/// [`http`] with extra header lines (each ending in `\r\n`).
fn http_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &str,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    if !chunked {
        return (status, rest.to_string());
    }
    let (mut out, mut rest) = (String::new(), rest);
    loop {
        let (size, after) = rest.split_once("\r\n").unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            return (status, out);
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
}

fn post(addr: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    );
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": content},
        ],
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn chat_completions_over_http() {
    let server = start(&["--max-batch", "4", "--max-cached-tokens", "4096"]);
    let addr = server.addr.as_str();

    // The model list names the served model.
    let (status, models) = http(addr, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{models}");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);

    // A greedy completion: exactly max_tokens tokens (no stop token is likely in 12
    // steps, but a stop must then be reported as such), the same twice.
    let greedy = chat(
        "the quick brown fox",
        json!({"temperature": 0, "max_tokens": 12}),
    );
    let (status, a) = post(addr, &greedy);
    assert_eq!(status, 200, "{a}");
    let choice = &a["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    let n = a["usage"]["completion_tokens"].as_u64().unwrap();
    match choice["finish_reason"].as_str().unwrap() {
        "length" => assert_eq!(n, 12),
        "stop" => assert!(n < 12),
        other => panic!("finish_reason {other}"),
    }
    assert!(a["usage"]["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(a["object"], "chat.completion");
    let (_, b) = post(addr, &greedy);
    assert_eq!(
        b["choices"][0]["message"]["content"],
        text.as_str(),
        "greedy is not deterministic"
    );

    // Streaming the same request gives the same text in chunks, then [DONE].
    let mut streamed = greedy.clone();
    streamed["stream"] = json!(true);
    let (status, body) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&streamed.to_string()),
    );
    assert_eq!(status, 200, "{body}");
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.len() >= 3, "{body}");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, text);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        choice["finish_reason"]
    );

    // Logprobs: one entry per generated token; under greedy decoding the chosen token is
    // the most likely alternative.
    let (_, lp) = post(
        addr,
        &chat(
            "the quick brown fox",
            json!({"temperature": 0, "max_tokens": 12, "logprobs": true, "top_logprobs": 3}),
        ),
    );
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, n);
    for c in content {
        let l = c["logprob"].as_f64().unwrap();
        assert!(l <= 0.0);
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], c["token"]);
        assert!((top[0]["logprob"].as_f64().unwrap() - l).abs() < 1e-6);
        assert!(top[1]["logprob"].as_f64().unwrap() <= l);
    }

    // Sampling with a seed is reproducible; another seed differs.
    let sampled = |seed: u64| {
        let (status, v) = post(
            addr,
            &chat(
                "line 3: def f(x)",
                json!({"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "seed": seed}),
            ),
        );
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(sampled(7), sampled(7));
    assert_ne!(sampled(7), sampled(8));

    // A stop string taken from the greedy text ends the completion just before it.
    // (A printable ASCII character from the second half: the random model also emits
    // control characters and bytes of unfinished UTF-8 characters.)
    let chars: Vec<char> = text.chars().collect();
    let stop = chars[chars.len() / 2..]
        .iter()
        .chain(&chars)
        .find(|c| c.is_ascii_graphic())
        .unwrap_or_else(|| panic!("no printable character in {text:?}"))
        .to_string();
    let (_, stopped) = post(
        addr,
        &chat(
            "the quick brown fox",
            json!({"temperature": 0, "max_tokens": 12, "stop": [stop]}),
        ),
    );
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    assert_eq!(
        stopped["choices"][0]["message"]["content"],
        text[..text.find(&stop).unwrap()],
        "stop {stop:?} in {text:?}"
    );

    // Concurrent requests (batched together by the engine) get what they get alone.
    let prompts = [
        "a",
        "the lazy dog jumps over the quick brown fox",
        "line 7",
        "x * 3",
    ];
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| post(addr, &chat(p, json!({"temperature": 0, "max_tokens": 10}))).1)
        .collect();
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                s.spawn(move || post(addr, &chat(p, json!({"temperature": 0, "max_tokens": 10}))).1)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a["choices"][0]["message"], t["choices"][0]["message"]);
    }
}

#[test]
fn bad_requests_get_openai_errors() {
    let server = start(&[]);
    let addr = server.addr.as_str();
    let expect = |body: &str, status: u16, param: &str, says: &str| {
        let (got, text) = http(addr, "POST", "/v1/chat/completions", Some(body));
        assert_eq!(got, status, "{body} → {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let err = &v["error"];
        assert_eq!(err["type"], "invalid_request_error", "{text}");
        assert_eq!(err["param"], param, "{text}");
        let message = err["message"].as_str().unwrap();
        assert!(message.contains(says), "{message:?} lacks {says:?}");
    };
    let ok = chat("hi", json!({}));
    let with = |k: &str, v: Value| {
        let mut b = ok.clone();
        b[k] = v;
        b.to_string()
    };
    expect(
        &with("model", json!("gpt-4")),
        404,
        "model",
        "does not exist",
    );
    expect(
        &with("messages", json!([])),
        400,
        "messages",
        "must not be empty",
    );
    expect(
        &with("messages", json!([{"role": "tool", "content": "x"}])),
        400,
        "messages",
        "role",
    );
    expect(
        &with("messages", json!([{"role": "user"}])),
        400,
        "messages",
        "no content",
    );
    expect(
        &with("max_tokens", json!(100_000)),
        400,
        "max_tokens",
        "context of 256",
    );
    expect(
        &with("temperature", json!(3)),
        400,
        "temperature",
        "outside",
    );
    expect(&with("top_p", json!(0)), 400, "top_p", "outside");
    expect(
        &with("top_logprobs", json!(2)),
        400,
        "top_logprobs",
        "logprobs",
    );
    expect("{\"model\": ", 400, "body", "invalid request body");
    expect(
        &with("messages", json!("hello")),
        400,
        "body",
        "invalid request body",
    );
    // A prompt that fills the whole context leaves nothing to generate.
    let long = "the quick brown fox jumps over the lazy dog ".repeat(60);
    expect(
        &chat(&long, json!({})).to_string(),
        400,
        "messages",
        "no room",
    );
    // The server still works after all that.
    let (status, v) = post(addr, &chat("hi", json!({"max_tokens": 3})));
    assert_eq!(status, 200, "{v}");
}

#[test]
fn an_api_key_is_required_when_configured_and_never_logged() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &[]);
    let key = "sk-tutor-test-0123456789abcdef";
    let key_file = dir.path().join("api-key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let served = common::serve(
        &model,
        MODEL,
        dir.path(),
        &["--api-key-file", key_file.to_str().unwrap()],
    );
    let addr = served.addr.clone();
    let body = chat("hi", json!({"max_tokens": 2})).to_string();
    let call =
        |headers: &str| http_with(&addr, "POST", "/v1/chat/completions", Some(&body), headers);
    // No key, a wrong key, a key without the Bearer scheme: 401 in OpenAI's shape.
    for headers in [
        "",
        "Authorization: Bearer sk-wrong\r\n",
        &format!("Authorization: {key}\r\n"),
    ] {
        let (status, text) = call(headers);
        assert_eq!(status, 401, "{headers:?}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        assert!(!text.contains(key), "the error echoes the key: {text}");
    }
    let (status, _) = http_with(&addr, "GET", "/v1/models", None, "");
    assert_eq!(status, 401);
    // The right key works; probes need none.
    let (status, text) = call(&format!("Authorization: Bearer {key}\r\n"));
    assert_eq!(status, 200, "{text}");
    let (status, text) = http(&addr, "GET", "/health", None);
    assert_eq!((status, text.as_str()), (200, "ok"));
    drop(served);
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(!log.contains(key), "the key is in the server's log:\n{log}");

    // An empty key file is refused at start, naming the file.
    std::fs::write(&key_file, "\n").unwrap();
    let out = Command::new(common::tutor_bin())
        .args(["serve", "--device", "cpu", "--port", "0", "--model"])
        .arg(&model)
        .arg("--api-key-file")
        .arg(&key_file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("api-key") && err.contains("empty"),
        "the error should name the empty file: {err}"
    );

    // Fail closed: a non-loopback host without a key is refused at start, naming the
    // ways out (before, it served anyone with a warning).
    let out = Command::new(common::tutor_bin())
        .args([
            "serve", "--device", "cpu", "--host", "0.0.0.0", "--port", "0", "--model",
        ])
        .arg(&model)
        .env_remove("TUTOR_SERVE_API_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("0.0.0.0") && err.contains("--api-key-file") && err.contains("--insecure"),
        "the error should say how to serve safely: {err}"
    );
}

/// A directory with a config.json and no weights (as `tutor prepare` makes it) is refused,
/// pointing at `--load-format dummy`; with it the server starts from placeholder weights (an
/// engine the learner loads, as deploy/k8s/overlays/engine starts it). A directory without
/// config.json is refused either way, naming it.
#[test]
fn a_directory_without_weights_starts_only_with_load_format_dummy() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::make_model(&dir.path().join("model"), &[]);
    let weightless = dir.path().join("weightless");
    std::fs::create_dir_all(&weightless).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(model.join(f), weightless.join(f)).unwrap();
    }
    let out = Command::new(common::tutor_bin())
        .args(["serve", "--device", "cpu", "--port", "0", "--model"])
        .arg(&weightless)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("weightless") && err.contains("--load-format dummy"),
        "the error should name the directory and the way out: {err}"
    );
    let served = common::serve(&weightless, MODEL, dir.path(), &["--load-format", "dummy"]);
    let (status, answer) = post(&served.addr, &chat("hi", json!({"max_tokens": 4})));
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["usage"]["completion_tokens"].as_u64().unwrap() <= 4,
        "{answer}"
    );
    drop(served);
    let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap();
    assert!(log.contains("serving placeholder weights"), "{log}");
    let out = Command::new(common::tutor_bin())
        .args([
            "serve",
            "--device",
            "cpu",
            "--port",
            "0",
            "--load-format",
            "dummy",
            "--model",
        ])
        .arg(dir.path().join("nowhere"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--load-format dummy") && err.contains("nowhere"),
        "the error should name the directory: {err}"
    );
}

#[test]
fn official_openai_python_client() {
    let server = start(&["--max-batch", "2"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("serve/openai_client.py");
    let out = Command::new(common::python())
        .arg(&script)
        .arg(format!("http://{}/v1", server.addr))
        .arg(MODEL)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{} failed (is `openai` installed? it is in requirements-dev.txt):\n{stdout}\n{stderr}",
        script.display()
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
