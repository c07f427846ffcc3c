//! `tutor eval --agent endpoint` against an OpenAI-compatible server on loopback (a
//! scripted one, so the test knows what a good answer is): the agent's replies are run,
//! the key is sent as a bearer token and never printed, 429/500 are retried, and a server
//! that keeps failing, hangs, or answers without a command block ends in a clear status
//! while the other tasks carry on.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::tutor_bin;

const KEY: &str = "sk-test-never-printed-4242";

struct Mock {
    addr: String,
    auth_headers: Arc<Mutex<Vec<String>>>,
}

/// Serves /{mode}/v1/chat/completions. `patches` maps a problem statement to the gold
/// patch the scripted agent applies.
fn mock(patches: HashMap<String, String>) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let auth_headers: Arc<Mutex<Vec<String>>> = Default::default();
    let flaky = Arc::new(AtomicUsize::new(0));
    let (auth, patches) = (auth_headers.clone(), Arc::new(patches));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let (auth, patches, flaky) = (auth.clone(), patches.clone(), flaky.clone());
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                let mut len = 0usize;
                loop {
                    let mut h = String::new();
                    reader.read_line(&mut h).unwrap();
                    let h = h.trim_end();
                    if h.is_empty() {
                        break;
                    }
                    let lower = h.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap();
                    }
                    if lower.starts_with("authorization:") {
                        auth.lock()
                            .unwrap()
                            .push(h["authorization:".len()..].trim().to_string());
                    }
                }
                let mut body = vec![0u8; len];
                reader.read_exact(&mut body).unwrap();
                let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
                let msgs = req["messages"].as_array().unwrap();
                let mode = path.trim_start_matches('/').split('/').next().unwrap_or("");
                let reply = |content: &str| {
                    serde_json::json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}).to_string()
                };
                let (code, text) = match mode {
                    "down" => (500, "{\"error\": \"overloaded\"}".to_string()),
                    "slow" => {
                        std::thread::sleep(Duration::from_secs(30));
                        (200, reply("late"))
                    }
                    "nocmd" => (200, reply("I think the bug is in the parser.")),
                    "flaky" if flaky.fetch_add(1, Ordering::SeqCst) % 3 < 2 => {
                        if flaky.load(Ordering::SeqCst) % 2 == 0 {
                            (429, "{\"error\": \"rate limited\"}".to_string())
                        } else {
                            (503, "{\"error\": \"warming up\"}".to_string())
                        }
                    }
                    _ => {
                        // The scripted agent: apply the gold patch, then submit.
                        assert_eq!(msgs[0]["role"], "system");
                        assert!(msgs[0]["content"].as_str().unwrap().contains("search_file"));
                        let problem = msgs[1]["content"].as_str().unwrap();
                        if msgs.len() == 2 {
                            let patch = &patches[problem];
                            (200, reply(&format!("I apply the fix.\n```command\ngit apply <<'TUTOR_PATCH'\n{patch}TUTOR_PATCH\n```")))
                        } else {
                            // The observation of the previous command is in the history.
                            let obs = msgs.last().unwrap()["content"].as_str().unwrap();
                            assert!(
                                obs.contains("(Current directory: /testbed")
                                    || obs.contains("(Current directory: ~/repo"),
                                "{obs}"
                            );
                            (200, reply("Done.\n```command\nsubmit\n```"))
                        }
                    }
                };
                let status = match code {
                    200 => "200 OK",
                    429 => "429 Too Many Requests",
                    500 => "500 Internal Server Error",
                    _ => "503 Service Unavailable",
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nRetry-After: 0\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
            });
        }
    });
    Mock { addr, auth_headers }
}

fn eval(dir: &std::path::Path, base_url: &str, extra: &[&str]) -> (String, Vec<serde_json::Value>) {
    let out = dir.join("results.jsonl");
    let _ = std::fs::remove_file(&out);
    let mut args = vec![
        "eval".to_string(),
        "--tasks".into(),
        dir.join("tasks.jsonl").display().to_string(),
        "--agent".into(),
        "endpoint".into(),
        "--base-url".into(),
        base_url.into(),
        "--model".into(),
        "scripted".into(),
        "--api-key-env".into(),
        "TUTOR_TEST_ENDPOINT_KEY".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = std::process::Command::new(tutor_bin())
        .args(&args)
        .env("TUTOR_TEST_ENDPOINT_KEY", KEY)
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    let all = format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{all}");
    assert!(!all.contains(KEY), "the API key was printed:\n{all}");
    let results = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (all, results)
}

#[test]
fn endpoint_agent_runs_retries_and_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let tasks_path = dir.path().join("tasks.jsonl");
    let o = common::tutor(&[
        "tasks",
        "toy",
        "--n",
        "3",
        "--seed",
        "8",
        "--out",
        tasks_path.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let mut patches = HashMap::new();
    for line in std::fs::read_to_string(&tasks_path).unwrap().lines() {
        let t: serde_json::Value = serde_json::from_str(line).unwrap();
        patches.insert(
            t["problem_statement"].as_str().unwrap().to_string(),
            t["patch"].as_str().unwrap().to_string(),
        );
    }
    let m = mock(patches);

    // A good endpoint: every task resolved in two turns, the key sent as a bearer token.
    let (_, r) = eval(dir.path(), &format!("{}/good/v1", m.addr), &[]);
    assert_eq!(r.len(), 3);
    for x in &r {
        assert_eq!(x["status"], "RESOLVED", "{x}");
        assert_eq!(x["turns"], 2, "{x}");
    }
    assert!(m
        .auth_headers
        .lock()
        .unwrap()
        .iter()
        .all(|h| h == &format!("Bearer {KEY}")));

    // 429 and 503 twice in every three requests: retried, same result.
    let (_, r) = eval(
        dir.path(),
        &format!("{}/flaky/v1", m.addr),
        &["--jobs", "1"],
    );
    for x in &r {
        assert_eq!(x["status"], "RESOLVED", "{x}");
    }

    // Always 500: each task ends in SANDBOX_ERROR naming the HTTP status; all tasks ran.
    let (_, r) = eval(
        dir.path(),
        &format!("{}/down/v1", m.addr),
        &["--max-retries", "1"],
    );
    assert_eq!(r.len(), 3);
    for x in &r {
        assert_eq!(x["status"], "SANDBOX_ERROR", "{x}");
        let e = x["error"].as_str().unwrap();
        assert!(e.contains("500") && e.contains("failed 2 times"), "{e}");
    }

    // Hangs: the request deadline ends it.
    let started = std::time::Instant::now();
    let (_, r) = eval(
        dir.path(),
        &format!("{}/slow/v1", m.addr),
        &[
            "--max-retries",
            "0",
            "--request-timeout",
            "1",
            "--limit",
            "1",
        ],
    );
    assert_eq!(r[0]["status"], "SANDBOX_ERROR");
    assert!(
        r[0]["error"].as_str().unwrap().contains("no answer within"),
        "{}",
        r[0]
    );
    assert!(started.elapsed() < Duration::from_secs(25));

    // No command block: format errors shown to the agent, turn after turn; unresolved.
    let (_, r) = eval(
        dir.path(),
        &format!("{}/nocmd/v1", m.addr),
        &["--max-turns", "3", "--limit", "1"],
    );
    assert_eq!(r[0]["status"], "UNRESOLVED", "{}", r[0]);
    assert_eq!(r[0]["format_errors"], 3);
}
