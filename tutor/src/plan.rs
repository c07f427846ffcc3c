//! `tutor plan --config F`: what a run's learner needs on each rank before it starts
//! (`tutor_learner::plan`): memory per sharding mode, the largest pass that fits, FLOPs.
//! It refuses (exit status 1) a configuration that cannot fit; the learner makes the same
//! check when it starts on a GPU whose memory the config names.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use tutor_learner::plan::{plan, Plan, PlanInput, Shard, USABLE_FRACTION};
use tutor_policy::ModelConfig;

use crate::config::RunConfig;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Run config (TOML); its `[model]` (or the model `[model] init_from` names),
    /// `[coordinator] max_seq_len` and `batch_tokens`, and `[learner]` device,
    /// precision, micro_batch_tokens, world_size, logits_budget_mb,
    /// checkpoint_activations and gpu_memory_gib are what the plan is for.
    #[arg(long, env = "TUTOR_CONFIG")]
    config: PathBuf,
    /// A Hugging Face config.json to plan for instead of the config's model (e.g. the
    /// model `init_from` will name, before it is downloaded).
    #[arg(long, value_name = "PATH")]
    model_config: Option<PathBuf>,
    /// Each rank's GPU memory in GiB (overrides `[learner] gpu_memory_gib`).
    #[arg(long)]
    gpu_memory_gib: Option<f64>,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The model a run trains: `--model-config`, else what `[model] init_from` names (a
/// Hugging Face directory's config.json, or a run directory's student), else the
/// `[model]` sizes. Returns it and where it came from.
pub fn run_model(cfg: &RunConfig, over: Option<&Path>) -> Result<(ModelConfig, String)> {
    let load = |p: &Path, what: &str| -> Result<(ModelConfig, String)> {
        let m = ModelConfig::load(p).with_context(|| format!("{what}: reading {}", p.display()))?;
        Ok((m, format!("{what} {}", p.display())))
    };
    if let Some(p) = over {
        return load(p, "--model-config");
    }
    if let Some(dir) = &cfg.model.init_from {
        // The run directory's student, as `tutor prepare` would install it.
        if crate::export::is_run_dir(dir) {
            return load(
                &dir.join("model").join("config.json"),
                "model.init_from (a run directory)",
            );
        }
        let hf = dir.join("config.json");
        if hf.is_file() {
            return load(&hf, "model.init_from");
        }
        bail!(
            "model.init_from = {}: no config.json there (nor model/config.json of a run \
             directory); download the model first or pass --model-config with its config.json",
            dir.display()
        );
    }
    Ok((
        cfg.model.model_config(cfg.model.vocab_size),
        "[model] (vocab_size at most; the tokenizer may make it smaller)".into(),
    ))
}

/// The plan of a run's learner for `model`; `gpu_memory_gib` overrides the config's.
pub fn run_plan(cfg: &RunConfig, model: ModelConfig, gpu_memory_gib: Option<f64>) -> Result<Plan> {
    let l = &cfg.learner;
    let device = l.device(0)?;
    let world_size = l.world_size.max(1);
    let seq_len = cfg.coordinator.max_seq_len;
    let step_tokens = cfg.coordinator.batch_tokens.div_ceil(world_size);
    let pass_tokens = if l.micro_batch_tokens > 0 {
        l.micro_batch_tokens.min(step_tokens)
    } else {
        step_tokens
    }
    .max(seq_len);
    let gib = gpu_memory_gib.unwrap_or(l.gpu_memory_gib);
    Ok(plan(&PlanInput {
        model,
        seq_len,
        pass_tokens,
        step_tokens,
        world_size,
        mixed_precision: l.mixed_precision(device),
        checkpoint_activations: l.checkpoint_activations,
        logits_budget_mb: l.logits_budget_mb,
        gpu_memory: (gib > 0.0).then_some((gib * (1u64 << 30) as f64) as u64),
        shard: l.shard,
        bucket_mb: l.bucket_mb,
        // The learner prefetches over the CPU collective, on the CPU, only (see
        // `[learner] prefetch`).
        prefetch: l.prefetch
            && l.collective == tutor_learner::config::CollectiveChoice::Cpu
            && device == tch::Device::Cpu,
    }))
}

/// Why a run cannot start as configured (`None`: it can, or nothing is known to say
/// otherwise): a context longer than the model's positions, or a plan over the GPU.
pub fn refusal(cfg: &RunConfig, model: &ModelConfig, plan: &Plan) -> Option<String> {
    if cfg.coordinator.max_seq_len > model.max_position_embeddings {
        return Some(format!(
            "coordinator.max_seq_len = {} is longer than the model's max_position_embeddings \
             ({}): lower max_seq_len",
            cfg.coordinator.max_seq_len, model.max_position_embeddings
        ));
    }
    memory_refusal(plan)
}

/// Why the learner's plan, in its `[learner] shard` mode, cannot fit the GPU (`None`: it
/// fits, or the GPU's memory is not known).
pub fn memory_refusal(plan: &Plan) -> Option<String> {
    let m = plan.configured();
    let sharding = match plan.shard {
        Shard::None | Shard::Optimizer => {
            " or shard the training state ([learner] shard = \"optimizer\" or \"gradients\"; \
             tutor plan lists the modes)"
        }
        Shard::Gradients => {
            " or shard the parameters too ([learner] shard = \"full\", with \
             checkpoint_activations = true), or train on more GPUs"
        }
        Shard::Full => " or train on more GPUs (the state is sharded over them)",
    };
    if let (Some(gpu), Shard::Optimizer | Shard::Gradients | Shard::Full) =
        (plan.gpu_memory, plan.shard)
    {
        let usable = gpu as f64 * USABLE_FRACTION;
        if plan.world_size > 1 && plan.group_start > usable {
            return Some(format!(
                "with shard = \"{}\" rank 0 needs {} on its GPU while its group forms (a \
                 bucket of the fp32 weights it sends the other ranks, its slices and the model \
                 the mode keeps) but {} are usable: use GPUs with more memory, a smaller model, or \
                 a smaller [learner] bucket_mb",
                plan.shard.name(),
                gib(plan.group_start),
                gib(usable)
            ));
        }
    }
    if m.fits == Some(false) {
        let gpu = plan.gpu_memory.unwrap_or(0) as f64;
        let fix = match m.max_pass_tokens {
            Some(t) if t >= plan.seq_len => format!(
                "passes of at most {t} tokens fit: set [learner] micro_batch_tokens = {}",
                t / plan.seq_len.max(1) * plan.seq_len.max(1)
            ),
            Some(t) => format!(
                "not even one sequence of {} tokens fits (at most {t}): turn on \
                 [learner] checkpoint_activations, lower max_seq_len{sharding}",
                plan.seq_len
            ),
            None => {
                format!("the training state alone does not fit: train a smaller model{sharding}")
            }
        };
        return Some(format!(
            "the learner needs {} per rank (shard = \"{}\") but {} of the GPU's {} are usable; {fix}",
            gib(m.total),
            plan.shard.name(),
            gib(gpu * USABLE_FRACTION),
            gib(gpu)
        ));
    }
    None
}

fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
}

fn count(n: f64) -> String {
    if n >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1}M", n / 1e6)
    } else {
        format!("{:.0}", n)
    }
}

/// The plan as the text `tutor plan` prints.
pub fn render(plan: &Plan, model_source: &str, model: &ModelConfig) -> String {
    let mut s = String::new();
    let gpu = plan
        .gpu_memory
        .map(|b| {
            format!(
                "{} ({} usable)",
                gib(b as f64),
                gib(b as f64 * USABLE_FRACTION)
            )
        })
        .unwrap_or_else(|| "unknown (set [learner] gpu_memory_gib or --gpu-memory-gib)".into());
    s += &format!(
        "model: {} parameters ({} in matrix products), {} layers, hidden {}, vocab {}; from {model_source}\n",
        count(plan.parameters as f64),
        count(plan.matmul_parameters as f64),
        model.num_hidden_layers,
        model.hidden_size,
        model.vocab_size
    );
    s += &format!(
        "training: {} ranks, {}, sequences up to {} tokens, {} tokens per pass, {} per step and rank\n",
        plan.world_size,
        if plan.mixed_precision {
            "bf16 with fp32 masters"
        } else {
            "fp32"
        },
        plan.seq_len,
        plan.pass_tokens,
        plan.step_tokens
    );
    s += &format!(
        "activations: {:.0} KiB per token ({:.0} KiB with checkpoint_activations; it is {}); logits budget {}\n",
        plan.activation_bytes_per_token / 1024.0,
        plan.checkpointed_bytes_per_token / 1024.0,
        if plan.checkpoint_activations { "on" } else { "off" },
        if plan.logits_budget_mb > 0 {
            format!("{} MiB", plan.logits_budget_mb)
        } else {
            "none (full logits)".into()
        }
    );
    s += &format!("GPU memory per rank: {gpu}\n\n");
    s += &format!(
        "{:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} {:>11} {:>9} | {:>9}  {:>4}  largest pass\n",
        "per rank", "weights", "grads", "grad sums", "masters", "AdamW", "gathered", "state",
        "activations", "logits", "total", "fits"
    );
    for m in &plan.memory {
        let mode = format!(
            "{}{}",
            m.shard.name(),
            if m.shard == plan.shard { " <" } else { "" }
        );
        s += &format!(
            "{mode:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} {:>11} {:>9} | {:>9}  {:>4}  {}\n",
            gib(m.weights),
            gib(m.grads),
            gib(m.grad_sums),
            gib(m.masters),
            gib(m.optimizer),
            gib(m.gathered),
            gib(m.state),
            gib(m.activations),
            gib(m.logits),
            gib(m.total),
            match m.fits {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "?",
            },
            m.max_pass_tokens
                .map(|t| format!("{t} tokens"))
                .unwrap_or_else(|| "-".into())
        );
    }
    s += &format!(
        "(< the run's [learner] shard = \"{}\"; full: no GPU holds the weights, a pass \
         gathers a layer at a time; rank 0 keeps them in host memory: {})\n\n",
        plan.shard.name(),
        gib(plan.mode(Shard::Full).host_weights)
    );
    if plan.world_size > 1 && plan.shard != Shard::None {
        s += &format!(
            "rank 0 while its group forms (its solo state waits in host memory; on the GPU one \
             bucket at a time of the fp32 weights it sends, then its slices): {}\n",
            gib(plan.group_start)
        );
    }
    s += &format!(
        "FLOPs: {:.3} TFLOP per pass, {:.3} TFLOP per step and rank ({:.3} executed with the recomputation)\n",
        plan.pass_flops / 1e12,
        plan.step_flops / 1e12,
        plan.step_flops_executed / 1e12
    );
    s
}

/// `tutor plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    let (cfg, _) = RunConfig::load(&args.config)?;
    let (model, source) = run_model(&cfg, args.model_config.as_deref())?;
    let p = run_plan(&cfg, model.clone(), args.gpu_memory_gib)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", render(&p, &source, &model));
    }
    if let Some(why) = refusal(&cfg, &model, &p) {
        bail!("{}: this run cannot start: {why}", args.config.display());
    }
    if !args.json {
        match p.configured().fits {
            Some(true) => println!("fits: the run can start as configured"),
            _ => println!("no GPU memory given: nothing to check it against"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configs() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs")
    }

    /// configs/paper-scale.toml (Qwen3-4B, 8 × H200, checkpointed activations, 32k
    /// tokens) fits; the same run on 80 GB GPUs is refused (the unsharded state alone is
    /// over them), and so is it without activation checkpointing, or with a context
    /// beyond the model's positions.
    #[test]
    fn the_paper_scale_plan_fits_and_impossible_ones_are_refused() {
        let (cfg, _) = RunConfig::load(&configs().join("paper-scale.toml")).unwrap();
        let qwen = configs().join("models/qwen3-4b/config.json");
        let (model, source) = run_model(&cfg, Some(&qwen)).unwrap();
        assert!(source.contains("--model-config"), "{source}");
        let p = run_plan(&cfg, model.clone(), None).unwrap();
        assert_eq!(p.pass_tokens, 32768);
        assert!(
            (4.0e9..4.1e9).contains(&(p.parameters as f64)),
            "{}",
            p.parameters
        );
        let none = p.mode(Shard::None);
        assert_eq!(none.fits, Some(true), "{}", render(&p, &source, &model));
        assert!(refusal(&cfg, &model, &p).is_none());
        assert!(none.max_pass_tokens.unwrap() >= 32768);
        let text = render(&p, &source, &model);
        for want in [
            "none <",
            "optimizer ",
            "gradients ",
            "full ",
            "TFLOP per pass",
            "yes",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }

        let h100 = run_plan(&cfg, model.clone(), Some(80.0)).unwrap();
        let why = refusal(&cfg, &model, &h100).expect("75 GiB of state on an 80 GB GPU");
        assert!(why.contains("training state alone"), "{why}");
        assert!(why.contains("shard = \"optimizer\""), "{why}");
        assert_eq!(
            h100.mode(Shard::Full).fits,
            Some(true),
            "sharded it would fit"
        );
        // With the optimizer state and gradient sums sharded over the 8 GPUs it fits,
        // the group's start included (rank 0 keeps its solo state on the host until the
        // group forms, then one bucket of the fp32 weights it sends and its slices).
        let mut sharded = cfg.clone();
        sharded.learner.shard = Shard::Gradients;
        let p = run_plan(&sharded, model.clone(), Some(80.0)).unwrap();
        assert_eq!(p.configured().fits, Some(true));
        assert!(p.group_start < 0.9 * 80.0 * (1u64 << 30) as f64);
        assert!(
            refusal(&sharded, &model, &p).is_none(),
            "{}",
            render(&p, &source, &model)
        );
        assert!(render(&p, &source, &model).contains("gradients <"));
        // The start holds one 64 MiB bucket of the weights (the embedding, 151,936 × 2,560
        // f32, larger than it, goes in runs of it), not all 15 GiB of them.
        let bucket = 64.0 * (1u64 << 20) as f64;
        let m = p.configured();
        assert!((p.group_start - (m.state - m.grads - m.gathered + bucket)).abs() < 1.0);
        // On a 24 GB GPU it does not fit: refused, pointing at "full".
        let p = run_plan(&sharded, model.clone(), Some(24.0)).unwrap();
        let why = refusal(&sharded, &model, &p).expect("24 GB is too small");
        assert!(why.contains("shard = \"full\""), "{why}");
        // A start that does not fit where the steps would is refused, naming it: with
        // "full" and 8k-token passes the steps need 18 GiB, and a bucket of 15 GiB (the
        // whole model) on top of the state does not fit.
        let mut huge_bucket = sharded.clone();
        huge_bucket.learner.shard = Shard::Full;
        huge_bucket.coordinator.max_seq_len = 8192;
        huge_bucket.learner.micro_batch_tokens = 8192;
        huge_bucket.learner.bucket_mb = 16.0 * 1024.0;
        let p = run_plan(&huge_bucket, model.clone(), Some(24.0)).unwrap();
        assert_eq!(
            p.configured().fits,
            Some(true),
            "{}",
            render(&p, &source, &model)
        );
        let why = refusal(&huge_bucket, &model, &p).expect("the start does not fit 24 GB");
        assert!(why.contains("while its group forms"), "{why}");

        let mut plain = cfg.clone();
        plain.learner.checkpoint_activations = false;
        let p = run_plan(&plain, model.clone(), None).unwrap();
        let why = refusal(&plain, &model, &p).expect("32k tokens of activations do not fit");
        assert!(why.contains("checkpoint_activations"), "{why}");

        let mut long = cfg.clone();
        long.coordinator.max_seq_len = 65536;
        let p = run_plan(&long, model.clone(), None).unwrap();
        let why = refusal(&long, &model, &p).unwrap();
        assert!(why.contains("max_position_embeddings"), "{why}");
    }

    /// Without --model-config the plan reads what `[model] init_from` names, and says
    /// which file is missing when the model is not there yet.
    #[test]
    fn the_model_comes_from_init_from_or_the_model_section() {
        let (mut cfg, _) = RunConfig::load(&configs().join("quickstart.toml")).unwrap();
        let (m, source) = run_model(&cfg, None).unwrap();
        assert_eq!(m.hidden_size, cfg.model.hidden_size);
        assert!(source.starts_with("[model]"), "{source}");
        cfg.model.init_from = Some(configs().join("models/qwen3-4b"));
        let (m, _) = run_model(&cfg, None).unwrap();
        assert_eq!(m.num_hidden_layers, 36);
        cfg.model.init_from = Some(PathBuf::from("/nonexistent/model"));
        let e = run_model(&cfg, None).unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/model") && e.contains("--model-config"),
            "{e}"
        );
        // The quickstart on the CPU: no GPU memory, no verdict, nothing refused.
        let (cfg, _) = RunConfig::load(&configs().join("quickstart.toml")).unwrap();
        let (m, _) = run_model(&cfg, None).unwrap();
        let p = run_plan(&cfg, m.clone(), None).unwrap();
        assert_eq!(p.mode(Shard::None).fits, None);
        assert!(refusal(&cfg, &m, &p).is_none());
    }
}
