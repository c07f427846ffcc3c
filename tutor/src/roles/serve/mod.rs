//! `tutor serve`: an OpenAI-compatible chat-completions API over the policy's generation
//! engine, so that a Tutor checkpoint can act as a teacher or be evaluated by any client;
//! and SGLang's engine control plane (token-in/token-out `/generate`, weight reloads with a
//! weight version), so that rollout workers use it as their external student engine
//! (`[worker.student] kind = "engine"`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use tch::Device;
use tutor_policy::{spawn_engine, ChatTokenizer, EngineConfig, ModelConfig, Policy};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Checkpoint directory in Hugging Face layout: config.json, model.safetensors (or
    /// shards with their index) and tokenizer.json, e.g. a run's published checkpoint.
    #[arg(long)]
    model: PathBuf,
    /// The name clients pass as `model` (default: the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Write the bound address here once listening (use with --port 0).
    #[arg(long, value_name = "PATH")]
    addr_file: Option<PathBuf>,
    /// Most requests decoded together.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Key/value cache budget in tokens (rows × slots); requests that do not fit wait.
    #[arg(long, default_value_t = 32_768)]
    max_cached_tokens: usize,
    /// Tokens of finished generations whose keys and values are kept, so that a prompt
    /// that starts with one of them (a conversation's next turn) prefills only what is
    /// new; 0 turns it off.
    #[arg(long, default_value_t = 32_768)]
    prefix_cache_tokens: usize,
    /// Requests waiting for the engine before new ones are held back.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// libtorch threads of the engine's decoding (0: libtorch's default, one per core of
    /// the machine; in a container, set it to the CPU limit).
    #[arg(long, default_value_t = 0)]
    torch_threads: u32,
    /// `cpu`, `cuda`, or `auto` (CUDA when available). Weights are bf16 on CUDA.
    #[arg(long, default_value = "auto")]
    device: String,
    /// File holding the API key clients must send as `Authorization: Bearer KEY` (what
    /// the `openai` client sends as `api_key`). The key can also come from the
    /// TUTOR_SERVE_API_KEY environment variable. Without either, only a loopback --host is
    /// allowed (or --insecure). `/health` never needs the key. The key is never logged.
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// `auto`: the weights are read from --model's safetensors files. `dummy`: only its
    /// config.json is read and the weights are placeholders (zero matrices: every token
    /// equally likely; vLLM's `--load-format dummy` draws random ones), made at once
    /// whatever the model's size, for an engine whose every version comes from the learner
    /// (`[worker.student] loaded_by = "learner"`, or workers that load each version before
    /// using it): it starts from a run directory `tutor prepare` made, before any
    /// checkpoint exists. Until a client loads a version its answers are noise, served
    /// under --weight-version.
    #[arg(long, value_enum, default_value = "auto")]
    load_format: LoadFormat,
    /// The weight version the starting weights are served as (`/generate` answers and
    /// `/get_weight_version` name it); each `/update_weights_from_disk` names its own.
    #[arg(long, default_value = "default")]
    weight_version: String,
    /// Let clients load checkpoints from this directory (`POST /update_weights_from_disk`
    /// with a `model_path` inside it), as rollout workers do when this server is their
    /// student engine (`[worker.student] kind = "engine"`, `weights_dir`). Without it
    /// reloads are refused: anyone holding the API key could swap the model otherwise.
    #[arg(long, value_name = "DIR")]
    weights_root: Option<PathBuf>,
    /// Let clients send weights over Tutor's CPU collective (`POST
    /// /init_weights_update_group` with backend "tutor-cpu", then
    /// `/update_weights_from_distributed`, SGLang's routes), as rollout workers do with
    /// `[worker.student] reload = "distributed"`: no shared directory needed. This server
    /// then connects to the address a client names. Without it these routes are refused.
    #[arg(long)]
    distributed_updates: bool,
    /// Serve on a non-loopback --host without an API key. Without this flag that is
    /// refused: anyone who can reach the port could use the model.
    #[arg(long)]
    insecure: bool,
}

/// `tutor serve --load-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFormat {
    Auto,
    Dummy,
}

/// Environment variable holding `tutor serve`'s API key (alternative to --api-key-file).
pub const SERVE_API_KEY_ENV: &str = "TUTOR_SERVE_API_KEY";

/// The API key of `tutor serve`: from `file`, else from the environment value `env`.
/// Errors name the file or the variable, never the key.
fn load_api_key(file: Option<&std::path::Path>, env: Option<&str>) -> Result<Option<String>> {
    let (raw, source) = match (file, env) {
        (Some(path), _) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the API key file {}", path.display()))?,
            format!("the API key file {}", path.display()),
        ),
        (None, Some(v)) => (v.to_string(), SERVE_API_KEY_ENV.to_string()),
        (None, None) => return Ok(None),
    };
    let key = raw.trim();
    if key.is_empty() {
        anyhow::bail!(
            "{source} is empty: put the key in it (or leave it out to serve without one)"
        );
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        anyhow::bail!("{source} holds characters an HTTP header cannot carry: use printable ASCII without spaces");
    }
    Ok(Some(key.to_string()))
}

mod native;
mod openai;
mod state;
mod update_groups;
mod vllm;

use openai::{now, router};
use state::{AppState, Weights};

pub async fn serve(
    args: ServeArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    if args.max_batch == 0 || args.max_cached_tokens == 0 {
        anyhow::bail!("--max-batch and --max-cached-tokens must be at least 1");
    }
    let env_key = std::env::var(SERVE_API_KEY_ENV).ok();
    let api_key = load_api_key(args.api_key_file.as_deref(), env_key.as_deref())?;
    // Fail closed: reachable from other machines means a key, unless said otherwise.
    if api_key.is_none() && !args.host.is_loopback() {
        if !args.insecure {
            anyhow::bail!(
                "tutor serve would listen on {}:{}, reachable from other machines, with no API \
                 key: give it one (--api-key-file or {SERVE_API_KEY_ENV}), listen on 127.0.0.1, \
                 or pass --insecure to let anyone who can reach the port use the model",
                args.host,
                args.port
            );
        }
        tracing::warn!(
            host = %args.host,
            "--insecure: serving on a non-loopback address without an API key; anyone who can \
             reach the port may use the model"
        );
    }
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        "auto" => Device::cuda_if_available(),
        other => anyhow::bail!("--device {other:?}: expected cpu, cuda or auto"),
    };
    let mut policy = match args.load_format {
        LoadFormat::Auto => Policy::load_dir(&args.model, device).with_context(|| {
            let weightless = args.model.join("config.json").is_file()
                && !args.model.join("model.safetensors").exists()
                && !args.model.join("model.safetensors.index.json").exists();
            let hint = if weightless {
                " (it has no weights: --load-format dummy starts from its config.json alone, \
                 for an engine into which the learner or the workers load every version)"
            } else {
                ""
            };
            format!("loading the model from {}{hint}", args.model.display())
        })?,
        LoadFormat::Dummy => {
            let config = ModelConfig::load(&args.model.join("config.json")).with_context(|| {
                format!("--load-format dummy: reading {}", args.model.display())
            })?;
            tracing::warn!(
                version = %args.weight_version,
                "--load-format dummy: serving placeholder weights until a client loads a \
                 version"
            );
            Policy::zeroed(config, device)
        }
    };
    if device.is_cuda() {
        policy.var_store_mut().bfloat16();
    }
    let tok_path = args.model.join("tokenizer.json");
    // tokenizer.json, and the directory's chat template when it has one (else ChatML).
    let tokenizer = ChatTokenizer::from_dir(&args.model)?;
    if tokenizer.vocab_size() > policy.config().vocab_size {
        anyhow::bail!(
            "{} has {} tokens but config.json's vocab_size is {}: the tokenizer does not belong to this model",
            tok_path.display(),
            tokenizer.vocab_size(),
            policy.config().vocab_size
        );
    }
    let model = match args.served_model_name {
        Some(n) => n,
        None => args
            .model
            .canonicalize()
            .unwrap_or(args.model.clone())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "tutor".into()),
    };
    // What a weight update over the collective may announce: the model's parameters in
    // f32 (the widest dtype a checkpoint of it has), and 1 MiB for small tensors the
    // model does not hold (a checkpoint may carry buffers the loader skips).
    let max_update_bytes: usize = policy
        .var_store()
        .variables()
        .values()
        .map(|t| t.numel() * 4)
        .sum::<usize>()
        + (1 << 20);
    let parameter_shapes = policy
        .var_store()
        .variables()
        .into_iter()
        .map(|(name, t)| (name, t.size().iter().map(|&d| d as usize).collect()))
        .collect();
    if args.distributed_updates && api_key.is_none() {
        tracing::warn!(
            "--distributed-updates without an API key: any process that can reach this port \
             may replace the served weights and make this server connect where it names"
        );
    }
    let (engine, _thread) = spawn_engine(
        policy,
        tokenizer.clone(),
        EngineConfig {
            max_batch: args.max_batch,
            max_cached_tokens: args.max_cached_tokens,
            torch_threads: args.torch_threads,
            queue: args.queue,
            prefix_cache_tokens: args.prefix_cache_tokens,
        },
    );
    let start = Weights {
        version: args.weight_version.clone(),
        path: args.model.display().to_string(),
    };
    let weights_root = match &args.weights_root {
        Some(root) => Some(
            std::fs::canonicalize(root)
                .with_context(|| format!("--weights-root {}: no such directory", root.display()))?,
        ),
        None => None,
    };
    let state = Arc::new(AppState {
        engine,
        api_key,
        tokenizer,
        model,
        created: now(),
        next_id: AtomicU64::new(0),
        weights: Arc::new(tokio::sync::RwLock::new(start.clone())),
        served: std::sync::Mutex::new(start),
        weights_root,
        reloads: AtomicU64::new(0),
        distributed_updates: args.distributed_updates,
        max_update_bytes,
        parameter_shapes,
        update_groups: tokio::sync::Mutex::new(Default::default()),
        update_permit: tokio::sync::Semaphore::new(1),
        paused: tokio::sync::watch::Sender::new(None),
        waiting: std::sync::atomic::AtomicUsize::new(0),
        swaps: AtomicU64::new(0),
        transfer: std::sync::Mutex::new(Default::default()),
    });
    let app = router(state.clone(), native::routes().merge(vllm::routes()));
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let local = listener.local_addr()?;
    if let Some(f) = &args.addr_file {
        tutor_proto::net::write_addr_file(f, local)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    eprintln!(
        "serving {} at http://{local}/v1 ({:?}, batch ≤ {}, cache ≤ {} tokens)",
        state.model, device, args.max_batch, args.max_cached_tokens
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving HTTP")
}
