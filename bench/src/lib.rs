//! Benchmarks of Tutor's services, run over loopback against real servers started in
//! process. `ingest`: how many turns per second the coordinator stores durably;
//! `engine_generate`: a batch of prompts through the policy's engine (the `policy` and
//! `gpu_check` benchmarks).

pub mod ingest;

use anyhow::{bail, Result};
use tutor_policy::{EngineEvent, EngineRequest, GenParams};

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
