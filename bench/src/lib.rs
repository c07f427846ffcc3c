//! Benchmarks of Tutor's services, run over loopback against real servers started in
//! process. `ingest`: how many turns per second the coordinator stores durably;
//! `engine_generate` and the small helpers the `policy`, `packing` and `gpu_check`
//! benchmarks share.

pub mod ingest;

use std::path::Path;

use anyhow::{bail, Context, Result};
use tutor_policy::{EngineEvent, EngineRequest, GenParams};

/// A JSON file (the Python references' results), errors naming it.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// A field of `/proc/self/status` in KiB (`"VmRSS:"`, `"VmHWM:"`), for the benchmarks
/// that measure peak memory in a child process (reset through `/proc/self/clear_refs`).
pub fn status_kib(field: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/self/status"))
}

/// Runs `command` (a benchmark's own binary measuring one case in a child process) and
/// parses the JSON it prints; `what` names the case in the error when it fails.
pub fn child_json(command: &mut std::process::Command, what: &str) -> Result<serde_json::Value> {
    let out = command.output()?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| String::from_utf8_lossy(&out.stdout).to_string())
}

/// The middle value (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The least value (infinity for none).
pub fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Submits every prompt to the engine at once and collects each one's tokens.
pub fn engine_generate(
    engine: &tutor_policy::EngineHandle,
    prompts: &[Vec<u32>],
    params: &GenParams,
) -> Result<Vec<Vec<u32>>> {
    let mut streams = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        engine
            .submit_blocking(EngineRequest {
                prompt: prompt.clone(),
                params: params.clone(),
                stop: Vec::new(),
                top_logprobs: 0,
                prompt_logprobs: false,
                text: false,
                events: tx,
            })
            .map_err(|e| anyhow::anyhow!("the engine refused a prompt: {e}"))?;
        streams.push(rx);
    }
    streams
        .into_iter()
        .map(|mut rx| {
            let mut tokens = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(EngineEvent::Token(t)) => tokens.push(t.id),
                    Some(EngineEvent::Done(_)) => return Ok(tokens),
                    Some(_) => {}
                    None => bail!("the engine stopped in the middle of a generation"),
                }
            }
        })
        .collect()
}
