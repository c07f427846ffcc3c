//! Every GPU path of Tutor, checked in one go on a machine with a CUDA GPU, against
//! PyTorch on the same GPU; one report. `scripts/gpu-check.sh` builds this binary here and
//! runs it there (it needs only the binary, bench/reference/gpu_reference.py and a Python
//! with torch and transformers: the GPU machine's own).
//!
//! `gpu_check --out DIR [--device cuda] [--checks parity,nccl,sharded,train,generate,broadcast]`
//!
//! Checks, each independent (one that fails does not stop the others):
//! - `parity`: a small Qwen3 model (made by `transformers`, fp32) on the GPU: logits at
//!   every real position and every parameter's gradient of the masked cross-entropy, in
//!   fp32 against PyTorch's fp32 (TF32 off), and with the model cast to bf16: Tutor's
//!   bf16 error against the fp32 reference must be within twice PyTorch's own bf16 error.
//! - `nccl`: a one-rank NCCL communicator on GPU 0 (NCCL refuses two ranks on one GPU):
//!   all-reduce (f32, bf16), broadcast, a 64 MiB `broadcast_bytes`, barrier,
//!   reduce-scatter, all-gather; with more GPUs visible the report says which multi-GPU
//!   checks this binary does not run yet.
//! - `sharded`: two data-parallel ranks on the one GPU (threads over the CPU collective:
//!   NCCL refuses two ranks on one device) with `[learner] shard = "optimizer"` and
//!   `"gradients"`: in f32 the weights of one rank on the whole batches, in bf16 those of
//!   the unsharded pair; both ranks equal to the bit, each with half the AdamW moments.
//! - `train`: one training step of a Qwen3-0.6B-shaped model (bf16 parameters, fp32
//!   masters, AdamW), Tutor's `Trainer::step` against the same step in PyTorch eager;
//!   median step time, tokens/s and model FLOPs utilisation (MFU: 6·N·tokens plus causal
//!   attention, over `--peak-tflops`), for Tutor with full logits and within its logits
//!   budget (the default, chunked loss) and with activation checkpointing too, with the
//!   GPU memory in use after each. When
//!   PyTorch fails (out of memory at long contexts) Tutor's runs still go on.
//! - `generate`: greedy decoding with that model in bf16: `transformers`' `generate`
//!   against `Policy::generate` and the continuous-batching engine; tokens/s per batch
//!   size and how many tokens agree.
//! - `broadcast`: a policy file's bytes (the bf16 0.6B model) from rank 0 to a receiver
//!   over the CPU collective (loopback TCP), against a plain memory copy of the same
//!   bytes (an NCCL figure needs two GPUs: one rank's broadcast moves nothing).
//!
//! The report is DIR/gpu-report.md (a table, then each check's figures) and
//! DIR/gpu-report.json (the same, machine-readable); the exit status is non-zero when a
//! check fails. `--device cpu --small` runs the same code on the CPU with a tiny model (a
//! dry run of the script here).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use tutor_bench::{median, min, read_json};
use tutor_collective::{
    Collective, CpuCollective, CpuCollectiveTimeouts, CpuRendezvous, NcclCollective,
};
use tutor_learner::config::LearnerConfig;
use tutor_learner::trainer::Trainer;
use tutor_policy::{spawn_engine, ChatTokenizer, EngineConfig, GenParams, Policy};

#[derive(Debug, Parser)]
#[command(about = "Tutor's GPU paths against PyTorch on the same GPU, one report")]
struct Args {
    /// Where the report goes (gpu-report.md, gpu-report.json).
    #[arg(long)]
    out: PathBuf,
    /// Where the models, batches and reference results go (several GB for `train`);
    /// default OUT/work.
    #[arg(long)]
    work: Option<PathBuf>,
    /// The device to check: `cuda` (GPU 0) or `cpu` (a dry run).
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Which checks to run, in this order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "parity,nccl,sharded,train,generate,broadcast"
    )]
    checks: Vec<String>,
    /// A tiny model for `train`, `generate` and `broadcast` (CPU dry runs).
    #[arg(long)]
    small: bool,
    /// The Python with torch and transformers (default: TUTOR_PYTHON, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// bench/reference/gpu_reference.py (default: beside this binary's source tree,
    /// else ./bench/reference/gpu_reference.py).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Training: rows per step and the longest row (rows are 3/4 to all of it).
    #[arg(long, default_value_t = 8)]
    rows: usize,
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// Timed training steps per side (after 3 warm-up steps); the median counts.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Generation: batch sizes, new tokens per row, timed repeats (the best counts).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The GPU's dense bf16 peak, for MFU (H100 SXM and H200: 989 TFLOP/s).
    #[arg(long, default_value_t = 989.0)]
    peak_tflops: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Fail,
    /// Measured, with nothing to pass or fail (benchmarks).
    Measured,
    /// What this machine cannot run (too few GPUs) or this binary does not build yet.
    Skipped,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Measured => "MEASURED",
            Status::Skipped => "SKIPPED",
        }
    }
}

struct Check {
    name: String,
    status: Status,
    summary: String,
    lines: Vec<String>,
    data: Value,
}

impl Check {
    fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            status: Status::Pass,
            summary: String::new(),
            lines: Vec::new(),
            data: json!({}),
        }
    }

    fn line(&mut self, text: impl Into<String>) {
        let text = text.into();
        println!("  {text}");
        self.lines.push(text);
    }

    /// Records a condition: a failed one fails the check and says why.
    fn expect(&mut self, ok: bool, what: impl Into<String>) {
        let what = what.into();
        if ok {
            self.line(format!("ok: {what}"));
        } else {
            self.status = Status::Fail;
            self.line(format!("FAILED: {what}"));
        }
    }
}

struct Ctx {
    args: Args,
    work: PathBuf,
    device: Device,
    python: PathBuf,
    reference: PathBuf,
}

impl Ctx {
    fn python(&self, command: &str, extra: &[String]) -> Result<()> {
        let mut c = Command::new(&self.python);
        c.arg(&self.reference)
            .arg(command)
            .arg("--out")
            .arg(&self.work)
            .arg("--device")
            .arg(device_name(self.device))
            .args(extra)
            .env("TOKENIZERS_PARALLELISM", "false")
            .env("PYTHONUNBUFFERED", "1");
        let t0 = Instant::now();
        let status = c.status().with_context(|| {
            format!(
                "cannot run {} {} (set --python or TUTOR_PYTHON to a Python with torch and transformers)",
                self.python.display(),
                self.reference.display()
            )
        })?;
        if !status.success() {
            bail!(
                "{} {command} failed ({status}) after {:.0} s",
                self.reference.display(),
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    fn sync(&self) {
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
    }
}

fn device_name(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

fn field<T: serde::de::DeserializeOwned>(v: &Value, key: &str, file: &Path) -> Result<T> {
    serde_json::from_value(v[key].clone())
        .with_context(|| format!("{}: field `{key}`", file.display()))
}

/// ‖a − b‖ / ‖b‖ over all elements (f64 on the CPU).
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(Kind::Double);
    let b = b.to_device(Device::Cpu).to_kind(Kind::Double);
    let num = (&a - &b).norm().double_value(&[]);
    let den = b.norm().double_value(&[]).max(1e-30);
    num / den
}

/// Right-padded ids, attention mask and loss mask (the mask of each row's token j at j,
/// the first token never a label), as the learner and the reference build them.
fn padded(
    examples: &[Vec<u32>],
    masks: &[Vec<u8>],
    device: Device,
) -> (Tensor, Tensor, Tensor, Vec<i64>) {
    let width = examples.iter().map(Vec::len).max().unwrap_or(0);
    let b = examples.len();
    let mut ids = vec![0i64; b * width];
    let mut attn = vec![0i64; b * width];
    let mut loss = vec![0f32; b * width];
    let mut valid = Vec::new();
    for (i, (e, m)) in examples.iter().zip(masks).enumerate() {
        for (j, &t) in e.iter().enumerate() {
            ids[i * width + j] = t as i64;
            attn[i * width + j] = 1;
            if j > 0 {
                loss[i * width + j] = m[j] as f32;
            }
            valid.push((i * width + j) as i64);
        }
    }
    let shape = [b as i64, width as i64];
    (
        Tensor::from_slice(&ids).view(shape).to_device(device),
        Tensor::from_slice(&attn).view(shape).to_device(device),
        Tensor::from_slice(&loss).view(shape).to_device(device),
        valid,
    )
}

// ---------------------------------------------------------------------------------------
// parity

fn check_parity(ctx: &Ctx, c: &mut Check) -> Result<()> {
    ctx.python("parity", &[])?;
    let dir = ctx.work.join("parity");
    let json_path = dir.join("reference.json");
    let spec = read_json(&json_path)?;
    let examples: Vec<Vec<u32>> = field(&spec, "examples", &json_path)?;
    let masks: Vec<Vec<u8>> = field(&spec, "loss_masks", &json_path)?;
    let ref_losses: Value = spec["losses"].clone();
    let reference: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("reference.safetensors"))?
            .into_iter()
            .collect();
    let get = |k: &str| {
        reference
            .get(k)
            .with_context(|| format!("reference.safetensors has no {k}"))
    };
    let (ids, attn, loss_mask, valid) = padded(&examples, &masks, ctx.device);
    let valid = Tensor::from_slice(&valid).to_device(ctx.device);
    let mut ours = std::collections::HashMap::new();
    for kind in ["f32", "bf16"] {
        let mut policy = Policy::load_dir(&dir.join("model"), ctx.device)?;
        if kind == "bf16" {
            policy.var_store_mut().bfloat16();
        }
        let logits = policy.forward(&ids, &attn);
        let vocab = logits.size()[2];
        let logp = logits
            .narrow(1, 0, logits.size()[1] - 1)
            .to_kind(Kind::Float)
            .log_softmax(-1, Kind::Float);
        let next = ids.narrow(1, 1, ids.size()[1] - 1).unsqueeze(-1);
        let nll = -logp.gather(-1, &next, false).squeeze_dim(-1);
        let lm = loss_mask.narrow(1, 1, loss_mask.size()[1] - 1);
        let loss = (nll * &lm).sum(Kind::Float) / lm.sum(Kind::Float);
        loss.backward();
        let loss_value = loss.double_value(&[]);
        let flat = logits.to_kind(Kind::Float).view([-1, vocab]);
        let at_valid = flat.index_select(0, &valid).detach();
        let mut grads = Vec::new();
        for (name, var) in policy.var_store().variables() {
            grads.push((name, var.grad().to_kind(Kind::Float).to_device(Device::Cpu)));
        }
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        ours.insert(kind, (loss_value, at_valid, grads));
    }

    // Gradients as one vector per side, in our parameter order (names must match).
    let mut table = Vec::new();
    let mut missing = Vec::new();
    let cat = |side: &str, grads: &[(String, Tensor)]| -> Result<(Tensor, Tensor)> {
        let mut a = Vec::new();
        let mut b = Vec::new();
        for (name, g) in grads {
            a.push(g.flatten(0, -1));
            b.push(get(&format!("grad.{side}.{name}"))?.flatten(0, -1));
        }
        Ok((Tensor::cat(&a, 0), Tensor::cat(&b, 0)))
    };
    for kind in ["f32", "bf16"] {
        let (_, _, grads) = &ours[kind];
        for (name, _) in grads {
            if !reference.contains_key(&format!("grad.{kind}.{name}")) {
                missing.push(name.clone());
            }
        }
    }
    if !missing.is_empty() {
        bail!("the reference has no gradient for {missing:?} (parameter names differ)");
    }
    let ref_logits32 = get("logits.f32")?;
    let ref_logits16 = get("logits.bf16")?;
    let (loss32, logits32, grads32) = &ours["f32"];
    let (loss16, logits16, grads16) = &ours["bf16"];
    let (g32, ref_g32) = cat("f32", grads32)?;
    let (g16, ref_g16_ours_order) = cat("bf16", grads16)?;
    // The fp32 reference's gradients in the bf16 list's order (same names, same order).
    let (_, ref_g32_for16) = cat("f32", grads16)?;
    let torch_loss32 = ref_losses["f32"].as_f64().unwrap_or(f64::NAN);
    let torch_loss16 = ref_losses["bf16"].as_f64().unwrap_or(f64::NAN);

    let l32 = rel_err(logits32, ref_logits32);
    let gr32 = rel_err(&g32, &ref_g32);
    let worst32 = grads32
        .iter()
        .map(|(n, g)| {
            let r = get(&format!("grad.f32.{n}"))
                .map(|r| rel_err(g, r))
                .unwrap_or(f64::NAN);
            (n.clone(), r)
        })
        .fold(
            (String::new(), 0.0f64),
            |acc, x| if x.1 > acc.1 { x } else { acc },
        );
    c.line(format!(
        "fp32: loss tutor {loss32:.6} torch {torch_loss32:.6}; logits rel. error {l32:.2e}; gradients rel. error {gr32:.2e} (worst tensor {} {:.2e})",
        worst32.0, worst32.1
    ));
    c.expect(
        (loss32 - torch_loss32).abs() < 1e-4,
        "fp32 loss within 1e-4 of PyTorch's",
    );
    c.expect(
        l32 < 1e-4,
        "fp32 logits within 1e-4 (relative) of PyTorch's",
    );
    c.expect(
        gr32 < 1e-3,
        "fp32 gradients within 1e-3 (relative) of PyTorch's",
    );

    let ours16_logits = rel_err(logits16, ref_logits32);
    let torch16_logits = rel_err(ref_logits16, ref_logits32);
    let ours16_grads = rel_err(&g16, &ref_g32_for16);
    let torch16_grads = rel_err(&ref_g16_ours_order, &ref_g32_for16);
    let ours_vs_torch16 = rel_err(logits16, ref_logits16);
    table.push(json!({
        "fp32": {"loss": loss32, "torch_loss": torch_loss32, "logits_rel_err": l32, "grads_rel_err": gr32},
        "bf16": {"loss": loss16, "torch_loss": torch_loss16,
                 "logits_rel_err_vs_fp32": {"tutor": ours16_logits, "torch": torch16_logits},
                 "grads_rel_err_vs_fp32": {"tutor": ours16_grads, "torch": torch16_grads},
                 "logits_rel_err_tutor_vs_torch_bf16": ours_vs_torch16},
    }));
    c.line(format!(
        "bf16: loss tutor {loss16:.6} torch {torch_loss16:.6}; error against the fp32 reference: logits tutor {ours16_logits:.2e} torch {torch16_logits:.2e}; gradients tutor {ours16_grads:.2e} torch {torch16_grads:.2e}; tutor vs torch bf16 logits {ours_vs_torch16:.2e}"
    ));
    c.expect(
        ours16_logits <= 2.0 * torch16_logits + 1e-3,
        "bf16 logits: Tutor's error at most twice PyTorch's bf16 error",
    );
    c.expect(
        ours16_grads <= 2.0 * torch16_grads + 1e-3,
        "bf16 gradients: Tutor's error at most twice PyTorch's bf16 error",
    );
    c.expect(
        (loss16 - torch_loss32).abs() <= 2.0 * (torch_loss16 - torch_loss32).abs() + 2e-3,
        "bf16 loss: as close to the fp32 loss as PyTorch's bf16 loss (2x + 2e-3)",
    );
    c.summary = format!(
        "fp32 logits {l32:.1e}, grads {gr32:.1e}; bf16 error vs fp32: tutor {ours16_logits:.1e}/{ours16_grads:.1e}, torch {torch16_logits:.1e}/{torch16_grads:.1e} (logits/grads)"
    );
    c.data = json!({ "parity": table, "device": spec["device"], "torch": spec["torch"] });
    Ok(())
}

// ---------------------------------------------------------------------------------------
// nccl

fn check_nccl(ctx: &Ctx, c: &mut Check) -> Result<()> {
    let Device::Cuda(ordinal) = ctx.device else {
        c.status = Status::Skipped;
        c.summary = "no GPU (--device cpu)".into();
        return Ok(());
    };
    let gpus = tch::Cuda::device_count();
    let id = NcclCollective::unique_id()?;
    let t0 = Instant::now();
    let mut nccl = NcclCollective::new(&id, 0, 1, ordinal)?;
    c.line(format!(
        "one-rank communicator on cuda:{ordinal} in {:.2} s ({gpus} GPU(s) visible)",
        t0.elapsed().as_secs_f64()
    ));
    let gpu = ctx.device;
    let a = Tensor::randn([1 << 20], (Kind::Float, gpu));
    let b = Tensor::randn([4096, 128], (Kind::Float, gpu)).to_kind(Kind::BFloat16);
    let mut ts = [a.copy(), b.copy()];
    nccl.all_reduce_sum(&mut ts)?;
    c.expect(
        ts[0].equal(&a) && ts[1].equal(&b),
        "all_reduce_sum (f32 and bf16) of one rank returns its input",
    );
    let mut ts = [a.copy(), b.copy()];
    nccl.all_reduce_mean(&mut ts)?;
    c.expect(
        ts[0].equal(&a),
        "all_reduce_mean of one rank returns its input",
    );
    let mut ts = [a.copy()];
    nccl.broadcast(&mut ts)?;
    c.expect(ts[0].equal(&a), "broadcast from rank 0");
    let payload: Vec<u8> = (0..64usize << 20).map(|i| (i * 31 % 251) as u8).collect();
    let mut data = payload.clone();
    nccl.broadcast_bytes_max(&mut data, payload.len())?;
    c.expect(data == payload, "broadcast_bytes of 64 MiB arrives intact");
    nccl.barrier()?;
    c.expect(true, "barrier");
    let mut sums = [1.5f64, -2.0];
    nccl.all_reduce_sum_f64(&mut sums)?;
    c.expect(sums == [1.5, -2.0], "all_reduce_sum_f64");
    let whole = Tensor::randn([3, 4096], (Kind::Float, gpu));
    let mut share = Tensor::zeros([3, 4096], (Kind::Float, gpu));
    nccl.reduce_scatter_sum(&whole, &mut share)?;
    c.expect(
        share.equal(&whole),
        "reduce_scatter_sum of one rank returns its input (on the GPU)",
    );
    let host = b.to_device(Device::Cpu);
    let mut gathered = Tensor::zeros_like(&host);
    nccl.all_gather(&host, &mut gathered)?;
    c.expect(
        gathered.equal(&host),
        "all_gather of one rank returns its input (bf16, staged from the host)",
    );
    if gpus < 2 {
        c.line(format!(
            "not run: multi-rank NCCL, a sharded 2-rank training run and the weights broadcast to a worker on another GPU need 2 GPUs; {gpus} visible"
        ));
    } else {
        c.line(format!(
            "not run: multi-rank NCCL across the {gpus} visible GPUs (this binary runs one rank; `cargo test -p tutor-learner --features nccl` on such a machine runs the multi-rank tests)"
        ));
    }
    c.summary = format!(
        "one rank on cuda:{ordinal}: all-reduce, broadcast, bytes, barrier, reduce-scatter, all-gather"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// train

/// Bytes in use on the GPU (total − free, all processes), from the CUDA driver.
fn gpu_memory_used(device: Device) -> Option<u64> {
    let Device::Cuda(ordinal) = device else {
        return None;
    };
    let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
    ctx.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some((total - free) as u64)
}

fn check_train(ctx: &Ctx, c: &mut Check) -> Result<()> {
    let a = &ctx.args;
    let mut extra = vec![
        "--steps".into(),
        a.steps.to_string(),
        "--rows".into(),
        a.rows.to_string(),
        "--tokens".into(),
        a.tokens.to_string(),
    ];
    if a.small {
        extra.push("--small".into());
    }
    println!("[reference] PyTorch eager training step ...");
    let dir = ctx.work.join("train");
    let _ = std::fs::remove_file(dir.join("torch.json"));
    let _ = std::fs::remove_file(dir.join("batch.json"));
    let reference = ctx.python("train", &extra);
    let path = dir.join("batch.json");
    let spec_json = read_json(&path).context("the reference wrote no batch")?;
    let examples: Vec<Vec<u32>> = field(&spec_json, "examples", &path)?;
    let masks: Vec<Vec<u8>> = field(&spec_json, "loss_masks", &path)?;
    let params: u64 = field(&spec_json, "params", &path)?;
    let model_config = tutor_policy::ModelConfig::load(&dir.join("model/config.json"))?;
    let batch: Vec<(Vec<u32>, Vec<bool>)> = examples
        .iter()
        .zip(&masks)
        .map(|(e, m)| (e.clone(), m.iter().map(|&x| x != 0).collect()))
        .collect();
    let rows: Vec<usize> = examples.iter().map(Vec::len).collect();
    let tokens: usize = rows.iter().sum();
    let flops: f64 = rows
        .iter()
        .map(|&t| tutor_learner::plan::sequence_flops(&model_config, t as f64))
        .sum();
    let peak = a.peak_tflops * 1e12;
    c.line(format!(
        "model: {params} parameters ({}), {} rows, {tokens} tokens (rows of {}..{}), {:.2} TFLOP per step",
        if a.small { "tiny" } else { "Qwen3-0.6B's shape" },
        rows.len(),
        rows.iter().min().unwrap_or(&0),
        rows.iter().max().unwrap_or(&0),
        flops / 1e12
    ));
    // PyTorch's figures, unless it failed (out of memory at long contexts, say).
    let mut theirs = None;
    let mut torch_losses: Vec<f64> = Vec::new();
    let mut torch_peak = 0u64;
    match reference {
        Ok(()) => {
            let path = dir.join("torch.json");
            let torch = read_json(&path)?;
            let torch_seconds: Vec<f64> = field(&torch, "seconds", &path)?;
            torch_losses = field(&torch, "losses", &path)?;
            torch_peak = field(&torch, "peak_bytes", &path)?;
            let t = median(torch_seconds);
            c.line(format!(
                "pytorch eager: median {:.1} ms, {:.0} tokens/s, MFU {:.1}% (peak memory allocated {:.2} GiB)",
                t * 1e3,
                tokens as f64 / t,
                100.0 * flops / t / peak,
                torch_peak as f64 / (1u64 << 30) as f64
            ));
            theirs = Some(t);
        }
        Err(e) => c.line(format!(
            "pytorch eager: failed ({e:#}; its output above says why, e.g. CUDA out of memory)"
        )),
    }
    let spec = |k: &str| spec_json[k].as_f64().unwrap_or(0.0);
    let mut results = Vec::new();
    // The leanest run first: the caching allocator keeps what a run reserved, so the GPU
    // memory in use after each run is the largest peak so far (checkpointed activations
    // with the chunked loss, then the chunked loss alone, then full logits).
    for (label, budget, checkpoint) in [
        (
            "logits budget 1024 MiB, checkpointed activations",
            1024usize,
            true,
        ),
        ("logits budget 1024 MiB", 1024, false),
        ("full logits", 0, false),
    ] {
        let config = LearnerConfig {
            device: device_name(ctx.device),
            learning_rate: spec("lr"),
            warmup_steps: 0,
            weight_decay: spec("weight_decay"),
            beta1: spec("beta1"),
            beta2: spec("beta2"),
            eps: spec("eps"),
            grad_clip: spec("grad_clip"),
            logits_budget_mb: budget,
            checkpoint_activations: checkpoint,
            ..LearnerConfig::default()
        };
        let run = || -> Result<(f64, f64)> {
            let policy = Policy::load_dir(&dir.join("model"), ctx.device)?;
            let mut trainer = Trainer::new(policy, config)?;
            let first = trainer.step(&batch)?.loss;
            for _ in 1..3 {
                trainer.step(&batch)?;
            }
            ctx.sync();
            let mut seconds = Vec::new();
            for _ in 0..a.steps {
                let t0 = Instant::now();
                trainer.step(&batch)?;
                ctx.sync();
                seconds.push(t0.elapsed().as_secs_f64());
            }
            Ok((median(seconds), first))
        };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
        let used = gpu_memory_used(ctx.device);
        let (ours, first) = match outcome {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let m = first_line(&format!("{e:#}"));
                c.line(format!("tutor ({label}): failed: {m}"));
                results.push(json!({"label": label, "error": m}));
                continue;
            }
            Err(p) => {
                // libtorch's errors carry a C++ backtrace: its first line says what failed.
                let m = first_line(&panic_message(&*p));
                c.line(format!("tutor ({label}): failed: {m}"));
                results.push(json!({"label": label, "error": m}));
                continue;
            }
        };
        let mfu = flops / ours / peak;
        if let Some(u) = used {
            c.line(format!(
                "GPU memory in use after tutor ({label}): {:.2} GiB (the process's high-water mark so far)",
                u as f64 / (1u64 << 30) as f64
            ));
        }
        c.line(format!(
            "tutor ({label}): median {:.1} ms, {:.0} tokens/s, MFU {:.1}%{}; first-step loss {first:.4}",
            ours * 1e3,
            tokens as f64 / ours,
            100.0 * mfu,
            theirs
                .map(|t| format!(", time ratio tutor/pytorch {:.2}", ours / t))
                .unwrap_or_default()
        ));
        results.push(json!({"label": label, "median_s": ours, "mfu": mfu, "first_loss": first, "gpu_used_bytes": used}));
    }
    c.line(format!(
        "pytorch losses after the warm-up: {:?}",
        torch_losses
            .iter()
            .map(|l| format!("{l:.4}"))
            .collect::<Vec<_>>()
    ));
    c.status = Status::Measured;
    let best = results
        .iter()
        .filter_map(|r| r["median_s"].as_f64())
        .fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        bail!("no Tutor run finished");
    }
    c.summary = format!(
        "MFU tutor {:.1}% vs pytorch eager {} ({} tokens/step)",
        100.0 * flops / best / peak,
        theirs.map_or("failed".to_string(), |t| format!(
            "{:.1}%",
            100.0 * flops / t / peak
        )),
        tokens
    );
    c.data = json!({
        "params": params, "tokens": tokens, "flops": flops, "peak_tflops": a.peak_tflops,
        "torch": theirs.map(|t| json!({"median_s": t, "mfu": flops / t / peak, "peak_bytes": torch_peak})),
        "tutor": results,
    });
    Ok(())
}

fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or("");
    // A Torch error's message is escaped inside one line: cut at its first "\n".
    line.split("\\n").next().unwrap_or(line).to_string()
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// generate

/// Tokens of `ours` equal to `theirs` before the first difference, summed over rows.
fn agreeing(ours: &[Vec<u32>], theirs: &[Vec<u32>]) -> usize {
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count())
        .sum()
}

fn check_generate(ctx: &Ctx, c: &mut Check) -> Result<()> {
    let a = &ctx.args;
    let model = ctx.work.join("train/model");
    if !model.join("config.json").exists() {
        bail!("{} is missing: run the train check first", model.display());
    }
    let batches: Vec<String> = a.batches.iter().map(|b| b.to_string()).collect();
    println!("[reference] transformers generate ...");
    ctx.python(
        "generate",
        &[
            "--batches".into(),
            batches.join(","),
            "--new-tokens".into(),
            a.new_tokens.to_string(),
            "--repeats".into(),
            a.repeats.to_string(),
        ],
    )?;
    let path = ctx.work.join("generate/torch.json");
    let torch = read_json(&path)?;
    let prompts: Vec<Vec<u32>> = field(&torch, "prompts", &path)?;
    let params = GenParams {
        temperature: 0.0,
        max_new_tokens: a.new_tokens,
        ..GenParams::default()
    };
    let load = || -> Result<Policy> {
        let mut p = Policy::load_dir(&model, ctx.device)?;
        if ctx.device.is_cuda() {
            p.var_store_mut().bfloat16();
        }
        Ok(p)
    };
    let policy = load()?;
    let corpus: Vec<String> = (0..20).map(|i| format!("gpu check line {i}")).collect();
    let tokenizer = ChatTokenizer::train(&corpus, 300)?;
    let (engine, engine_thread) = spawn_engine(
        load()?,
        tokenizer,
        EngineConfig {
            max_batch: a.batches.iter().copied().max().unwrap_or(1),
            max_cached_tokens: 1 << 20,
            queue: 64,
            torch_threads: 4,
            // Repeats send the same prompts: no prefix reuse, as transformers has none.
            prefix_cache_tokens: 0,
        },
    );
    let mut rows = Vec::new();
    for &b in &a.batches {
        let run: Value = torch["runs"][b.to_string()].clone();
        let their_secs: Vec<f64> = field(&run, "seconds", &path)?;
        let their_tokens: Vec<Vec<u32>> = field(&run, "tokens", &path)?;
        let batch = &prompts[..b];
        let new = (b * a.new_tokens) as f64;
        let their_rate = new / min(&their_secs);
        c.line(format!("batch {b}: transformers {their_rate:.0} tokens/s"));
        let ps = vec![params.clone(); b];
        let timed = |f: &dyn Fn() -> Result<Vec<Vec<u32>>>| -> Result<(f64, Vec<Vec<u32>>)> {
            f()?; // warm-up
            let mut best = f64::INFINITY;
            let mut tokens = Vec::new();
            for _ in 0..a.repeats {
                ctx.sync();
                let t0 = Instant::now();
                tokens = f()?;
                ctx.sync();
                best = best.min(t0.elapsed().as_secs_f64());
            }
            Ok((best, tokens))
        };
        let (g_secs, g_tokens) = timed(&|| {
            Ok(policy
                .generate(batch, &ps)
                .into_iter()
                .map(|g| g.tokens)
                .collect())
        })?;
        let (e_secs, e_tokens) = timed(&|| tutor_bench::engine_generate(&engine, batch, &params))?;
        let total = b * a.new_tokens;
        for (label, secs, tokens) in [
            ("Policy::generate", g_secs, &g_tokens),
            ("engine", e_secs, &e_tokens),
        ] {
            let lengths_ok = tokens.iter().all(|t| t.len() == a.new_tokens);
            c.expect(
                lengths_ok,
                format!("batch {b} {label}: {} new tokens per row", a.new_tokens),
            );
            c.line(format!(
                "batch {b}: tutor {label} {:.0} tokens/s (ratio to transformers {:.2}); {}/{total} tokens agree with transformers' before the first difference",
                new / secs,
                (new / secs) / their_rate,
                agreeing(tokens, &their_tokens)
            ));
            rows.push(
                json!({"batch": b, "side": label, "tokens_per_s": new / secs,
                             "transformers_tokens_per_s": their_rate,
                             "agree": agreeing(tokens, &their_tokens), "total": total}),
            );
        }
    }
    drop(engine);
    let _ = engine_thread.join();
    if c.status == Status::Pass {
        c.status = Status::Measured;
    }
    c.summary = rows
        .iter()
        .filter(|r| r["side"] == "engine")
        .map(|r| {
            format!(
                "batch {}: engine {:.0} vs transformers {:.0} tokens/s",
                r["batch"],
                r["tokens_per_s"].as_f64().unwrap_or(0.0),
                r["transformers_tokens_per_s"].as_f64().unwrap_or(0.0)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    c.data = json!({ "generate": rows });
    Ok(())
}

// ---------------------------------------------------------------------------------------
// sharded

type Snapshot = Vec<(String, Vec<f32>)>;

fn snapshot(t: &Trainer) -> Result<Snapshot> {
    t.named_parameters()
        .map(|(n, p)| {
            let v = p.to_device(Device::Cpu).to_kind(Kind::Float).reshape([-1]);
            let values = Vec::<f32>::try_from(v).with_context(|| format!("reading {n}"))?;
            Ok((n.to_string(), values))
        })
        .collect()
}

/// Largest over tensors of max|a − b| / max|b| (infinite where the snapshots do not
/// name the same tensors of the same sizes).
fn max_rel_diff(a: &Snapshot, b: &Snapshot) -> f64 {
    if a.len() != b.len()
        || a.iter()
            .zip(b)
            .any(|((na, va), (nb, vb))| na != nb || va.len() != vb.len())
    {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    for ((_, va), (_, vb)) in a.iter().zip(b) {
        let scale = vb
            .iter()
            .fold(0f64, |m, x| m.max(x.abs() as f64))
            .max(1e-12);
        let diff = va
            .iter()
            .zip(vb)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
        worst = worst.max(diff / scale);
    }
    worst
}

/// Two data-parallel ranks on the one GPU (threads, the CPU collective over loopback:
/// NCCL refuses two ranks on one device) with each `[learner] shard` mode, against one
/// rank on the whole batches (f32) and against the unsharded pair (bf16, mixed
/// precision): the CUDA side of the sharded step (slices, reduce-scatter and all-gather
/// staged through the host, the masters' slices) that `make test` checks on the CPU.
fn check_sharded(ctx: &Ctx, c: &mut Check) -> Result<()> {
    use tutor_learner::config::{Precision, Shard};
    use tutor_learner::trainer::rank_shard;
    let device = ctx.device;
    let mut mc = tutor_policy::ModelConfig::tiny(8192);
    mc.hidden_size = 256;
    mc.intermediate_size = 768;
    mc.num_hidden_layers = 4;
    mc.num_attention_heads = 4;
    mc.num_key_value_heads = 2;
    mc.head_dim = 64;
    mc.max_position_embeddings = 1024;
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(5);
    let batches: Vec<Vec<(Vec<u32>, Vec<bool>)>> = (0..3)
        .map(|_| {
            (0..7)
                .map(|_| {
                    let len = rand::Rng::gen_range(&mut rng, 64..300);
                    let start = rand::Rng::gen_range(&mut rng, 1..len / 2);
                    let tokens = (0..len)
                        .map(|_| rand::Rng::gen_range(&mut rng, 3..8192u32))
                        .collect();
                    (tokens, (0..len).map(|j| j >= start).collect())
                })
                .collect()
        })
        .collect();
    let config = |shard: Shard, precision: Precision| LearnerConfig {
        learning_rate: 1e-3,
        warmup_steps: 1,
        weight_decay: 0.01,
        grad_clip: 0.5,
        // Small enough that the two ranks run different numbers of passes.
        micro_batch_tokens: 600,
        eps: 1e-3,
        shard,
        precision,
        ..Default::default()
    };
    let policy = |seed: i64| Policy::new(mc.clone(), device, seed);
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(30),
        io: Duration::from_secs(120),
    };
    // Two ranks; rank 1 starts from other weights (the first broadcast makes them rank 0's).
    let pair = |cfg: LearnerConfig| -> Result<Vec<(Snapshot, tutor_learner::trainer::StateBytes)>> {
        let rdv = CpuRendezvous::bind("127.0.0.1:0")?;
        let addr = rdv.local_addr();
        let run = |rank: usize, coll: Box<dyn Collective>| -> Result<_> {
            let mut t = Trainer::with_collective(policy(3 + 10 * rank as i64), cfg.clone(), coll)?;
            for b in &batches {
                let r = t.step(&rank_shard(b, rank, 2))?;
                if let Some(why) = r.skipped {
                    bail!("rank {rank}: the step was skipped: {why:?}");
                }
            }
            Ok((snapshot(&t)?, t.state_bytes()))
        };
        std::thread::scope(|s| {
            let other = s.spawn(|| -> Result<_> {
                run(1, Box::new(CpuCollective::connect(addr, 1, 2, timeouts)?))
            });
            let root = run(0, Box::new(rdv.accept(2, timeouts)?));
            let other = other
                .join()
                .map_err(|_| anyhow::anyhow!("rank 1 panicked"))?;
            Ok(vec![root?, other?])
        })
    };
    let mut rows = Vec::new();
    // f32: the pair in each mode against one rank on the whole batches.
    let mut single = Trainer::new(policy(3), config(Shard::None, Precision::F32))?;
    for b in &batches {
        single.step(b)?;
    }
    let want = snapshot(&single)?;
    let full = single.state_bytes();
    c.line(format!(
        "model: {} parameters on {}; one rank f32: {full:?}",
        mc.num_parameters(),
        device_name(device)
    ));
    let start = snapshot(&Trainer::new(
        policy(3),
        config(Shard::None, Precision::F32),
    )?)?;
    c.expect(
        max_rel_diff(&want, &start) > 1e-4,
        "the weights moved in three steps",
    );
    for precision in [Precision::F32, Precision::Bf16] {
        let plain = pair(config(Shard::None, precision))?;
        let (reference, tolerance) = match precision {
            Precision::F32 => (want.clone(), 1e-4),
            // Mixed precision: against the unsharded pair (same bf16 passes, fp32 sums in
            // another order): a weight whose masters differ in the last bits may round to
            // the next bf16 value, one step of 2⁻⁷ of its size at most (measured on the
            // CPU: 5.9e-3).
            _ => (plain[0].0.clone(), 8e-3),
        };
        if precision == Precision::F32 {
            let d = max_rel_diff(&plain[0].0, &want);
            c.line(format!(
                "f32 unsharded pair vs one rank: max relative diff {d:.2e}"
            ));
            c.expect(
                d <= tolerance,
                "f32: the unsharded pair trains the weights of one rank (1e-4)",
            );
        }
        for mode in [Shard::Optimizer, Shard::Gradients, Shard::Full] {
            let ranks = pair(LearnerConfig {
                // "full" gathers each layer while it runs: under checkpointing.
                checkpoint_activations: mode == Shard::Full,
                ..config(mode, precision)
            })?;
            let d = max_rel_diff(&ranks[0].0, &reference);
            let base = &plain[0].1;
            let (got, _) = &ranks[0];
            let bytes = ranks[0].1;
            c.line(format!(
                "{precision:?} {mode:?}: max relative diff {d:.2e} to {}; rank 0 state {bytes:?} (unsharded {base:?})",
                if precision == Precision::F32 { "one rank" } else { "the unsharded pair" }
            ));
            c.expect(
                d <= tolerance,
                format!("{precision:?} {mode:?}: within {tolerance:e} of the reference"),
            );
            if mode == Shard::Full {
                c.expect(
                    ranks[1].1.parameters == 0
                        && bytes.parameters == 0
                        && bytes.parameters_in_passes < bytes.host_parameters,
                    format!(
                        "{precision:?} full: no rank keeps parameters on its device between \
                         steps (rank 0 a host copy), and a pass held the embedding/head and \
                         one layer at a time, not all of them"
                    ),
                );
            } else {
                c.expect(
                    ranks[1].0 == *got,
                    format!("{precision:?} {mode:?}: both ranks hold the same weights to the bit"),
                );
            }
            c.expect(
                bytes.moments * 2 <= base.moments + 8 * 2,
                format!("{precision:?} {mode:?}: each rank holds half the AdamW moments"),
            );
            rows.push(json!({
                "precision": format!("{precision:?}"), "shard": mode.name(), "max_rel_diff": d,
                "moments": bytes.moments, "masters": bytes.masters, "grad_sums": bytes.grad_sums,
                "parameters_in_passes": bytes.parameters_in_passes,
                "unsharded_moments": base.moments, "unsharded_masters": base.masters,
            }));
        }
    }
    c.summary = rows
        .iter()
        .map(|r| {
            format!(
                "{} {}: {:.1e}",
                r["precision"].as_str().unwrap_or(""),
                r["shard"].as_str().unwrap_or(""),
                r["max_rel_diff"].as_f64().unwrap_or(f64::NAN)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    c.data = json!({ "sharded": rows });
    Ok(())
}

// ---------------------------------------------------------------------------------------
// broadcast

fn check_broadcast(ctx: &Ctx, c: &mut Check) -> Result<()> {
    let dir = ctx.work.join("train/model");
    let file = std::fs::read_dir(&dir)
        .with_context(|| format!("{} (run the train check first)", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .with_context(|| format!("no .safetensors file in {}", dir.display()))?;
    let bytes = std::fs::read(&file)?;
    let n = bytes.len();
    let gb = n as f64 / 1e9;
    c.line(format!("payload: {} ({:.2} GB)", file.display(), gb));

    // Into memory already touched, so that page faults are not counted as copying.
    let mut copy = vec![1u8; n];
    let t0 = Instant::now();
    copy.copy_from_slice(&bytes);
    let copy_secs = t0.elapsed().as_secs_f64();
    drop(copy);
    c.line(format!(
        "plain memory copy: {:.3} s, {:.1} GB/s (the limit)",
        copy_secs,
        gb / copy_secs
    ));

    // Two ranks of the CPU collective over loopback TCP, in this process.
    let rdv = CpuRendezvous::bind("127.0.0.1:0")?;
    let addr = rdv.local_addr();
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(30),
        io: Duration::from_secs(120),
    };
    let receiver = std::thread::spawn(move || -> Result<(Vec<u8>, f64)> {
        let mut leaf = CpuCollective::connect(addr, 1, 2, timeouts)?;
        let mut data = Vec::new();
        leaf.barrier()?;
        let t0 = Instant::now();
        leaf.broadcast_bytes_max(&mut data, n)?;
        Ok((data, t0.elapsed().as_secs_f64()))
    });
    let mut root = rdv.accept(2, timeouts)?;
    root.barrier()?;
    let mut data = bytes.clone();
    let t0 = Instant::now();
    root.broadcast_bytes_max(&mut data, n)?;
    let send_secs = t0.elapsed().as_secs_f64();
    let (got, recv_secs) = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the receiver thread panicked"))??;
    c.expect(
        got == bytes,
        "the CPU collective's receiver got the file intact",
    );
    let cpu_secs = send_secs.max(recv_secs);
    c.line(format!(
        "CPU collective (2 ranks, loopback TCP): {cpu_secs:.3} s, {:.2} GB/s ({:.0}% of the copy)",
        gb / cpu_secs,
        100.0 * copy_secs / cpu_secs
    ));
    let gpus = tch::Cuda::device_count();
    if gpus < 2 {
        c.line(format!(
            "not run: an NCCL broadcast figure needs 2 GPUs (one rank's broadcast moves nothing); {gpus} visible"
        ));
    }
    if c.status == Status::Pass {
        c.status = Status::Measured;
    }
    c.summary = format!(
        "{gb:.2} GB: CPU collective {:.2} GB/s, plain copy {:.1} GB/s",
        gb / cpu_secs,
        gb / copy_secs,
    );
    c.data = json!({"bytes": n, "copy_s": copy_secs, "cpu_collective_s": cpu_secs});
    Ok(())
}

// ---------------------------------------------------------------------------------------

fn machine() -> String {
    let mut s = String::new();
    if let Ok(out) = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,memory.total,driver_version",
            "--format=csv,noheader",
        ])
        .output()
    {
        s.push_str(String::from_utf8_lossy(&out.stdout).trim());
    }
    if s.is_empty() {
        s = "no nvidia-smi".into();
    }
    format!(
        "{s}; libtorch sees {} CUDA device(s); {} CPU threads",
        tch::Cuda::device_count(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
}

fn report(ctx: &Ctx, checks: &[Check], seconds: f64) -> Result<()> {
    let mut md = String::new();
    writeln!(md, "# Tutor GPU check")?;
    writeln!(md)?;
    writeln!(md, "- machine: {}", machine())?;
    writeln!(md, "- device: {}", device_name(ctx.device))?;
    writeln!(md, "- total time: {seconds:.0} s")?;
    writeln!(
        md,
        "- cuDNN attention: {} (Tutor turns it off on the first CUDA attention; {}=1 keeps it)",
        match tutor_policy::cudnn_attention_enabled() {
            Some(true) => "on",
            Some(false) => "off",
            None => "unknown (this libtorch does not export the flag)",
        },
        tutor_policy::CUDNN_ATTENTION_ENV
    )?;
    writeln!(md)?;
    writeln!(md, "| check | status | summary |")?;
    writeln!(md, "| --- | --- | --- |")?;
    for c in checks {
        writeln!(
            md,
            "| {} | {} | {} |",
            c.name,
            c.status.label(),
            c.summary.replace('|', "/")
        )?;
    }
    for c in checks {
        writeln!(md)?;
        writeln!(md, "## {} — {}", c.name, c.status.label())?;
        writeln!(md)?;
        for l in &c.lines {
            writeln!(md, "- {l}")?;
        }
    }
    std::fs::write(ctx.args.out.join("gpu-report.md"), &md)?;
    let json = json!({
        "machine": machine(),
        "device": device_name(ctx.device),
        "seconds": seconds,
        "checks": checks.iter().map(|c| json!({
            "name": c.name, "status": c.status.label(), "summary": c.summary,
            "lines": c.lines, "data": c.data,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(
        ctx.args.out.join("gpu-report.json"),
        serde_json::to_vec_pretty(&json)?,
    )?;
    println!("\n{md}");
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = tutor_policy::parse_device(&args.device, 0)
        .with_context(|| format!("--device {:?}: expected cpu, cuda or cuda:N", args.device))?;
    tutor_policy::check_device(device)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let python = args.python.clone().unwrap_or_else(|| {
        std::env::var_os("TUTOR_PYTHON")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| "python3".into())
    });
    let reference = args.reference.clone().unwrap_or_else(|| {
        let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("reference/gpu_reference.py");
        if beside.exists() {
            beside
        } else {
            PathBuf::from("bench/reference/gpu_reference.py")
        }
    });
    let work = args.work.clone().unwrap_or_else(|| args.out.join("work"));
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let ctx = Ctx {
        args,
        work,
        device,
        python,
        reference,
    };
    let start = Instant::now();
    let mut checks = Vec::new();
    for name in ctx.args.checks.clone() {
        println!("== {name}");
        let mut c = Check::new(&name);
        let t0 = Instant::now();
        let run = |c: &mut Check| -> Result<()> {
            match name.as_str() {
                "parity" => check_parity(&ctx, c),
                "nccl" => check_nccl(&ctx, c),
                "train" => check_train(&ctx, c),
                "generate" => check_generate(&ctx, c),
                "broadcast" => check_broadcast(&ctx, c),
                "sharded" => check_sharded(&ctx, c),
                other => bail!(
                    "unknown check {other:?} (parity, nccl, train, generate, broadcast, sharded)"
                ),
            }
        };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&mut c)));
        let error = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(p) => Some(format!("panicked: {}", panic_message(&*p))),
        };
        if let Some(e) = error {
            c.status = Status::Fail;
            c.summary = format!("error: {}", e.lines().next().unwrap_or(""));
            c.line(format!("error: {e}"));
        }
        c.line(format!("took {:.1} s", t0.elapsed().as_secs_f64()));
        println!("== {name}: {}", c.status.label());
        checks.push(c);
        // Each check's report is written as it ends: a run cut short keeps what it did.
        report(&ctx, &checks, start.elapsed().as_secs_f64())?;
    }
    if checks.iter().any(|c| c.status == Status::Fail) {
        std::process::exit(1);
    }
    Ok(())
}
