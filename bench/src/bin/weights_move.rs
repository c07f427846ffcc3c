//! Moving a policy version from the learner into a rollout worker's engine: seconds for a
//! 0.5B-parameter model (Qwen2.5-0.5B's shapes, bf16 as a GPU learner publishes it, made
//! here with random weights), by each path a worker can take, against a plain copy of the
//! same bytes as the limit.
//!
//! `cargo run --release -p tutor-bench --bin weights_move [-- --repeat 3]`
//!
//! Paths, each from the published safetensors file to the weights in a running engine
//! (`tutor_policy::engine`, f32 on the CPU, so every load also converts bf16 → f32 and
//! repacks the decode layout):
//! - `broadcast, in memory`: learner rank 0 sends the file's bytes over the CPU collective
//!   (loopback, one receiver); the receiver checks the sha256 and the engine loads the
//!   bytes as they are (what workers do now: no file, no re-read).
//! - `broadcast, via a file`: the same, but the receiver writes the file and the engine
//!   reads it back (what workers did before).
//! - `tensors in buckets`: the file's tensors over the CPU collective in buckets of up to
//!   64 MiB (`tutor_collective::engine_update`, what `reload = "distributed"` sends to
//!   `tutor serve`), written into a safetensors file in memory that the engine loads.
//! - `broadcast transfer alone`: the first path without the engine's load, in parts (each
//!   hashed by the receiver while the next arrives) and in one part (hashed after).
//! - `gRPC`: the learner's Weights service streams the file, the worker writes it to disk
//!   as it arrives (sha256 checked) and the engine loads the file.
//!
//! Reference rows: the bytes copied in memory (one `memcpy` of the file's size), the file
//! copied on disk, and the engine's load alone (from memory).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use sha2::{Digest, Sha256};
use tutor_bench::median;
use tutor_collective::broadcast::{receive_one, send_version, send_version_in_parts};
use tutor_collective::engine_update;
use tutor_collective::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
use tutor_learner::weights::WeightsStore;
use tutor_policy::{spawn_engine, ChatTokenizer, EngineHandle, ModelConfig, Policy, WeightsSource};

#[derive(Parser, Debug)]
#[command(about = "Seconds to move a policy version into a worker's engine, by each path")]
struct Args {
    /// Measurements of each path (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long, default_value_t = 896)]
    hidden: usize,
    #[arg(long, default_value_t = 4864)]
    intermediate: usize,
    #[arg(long, default_value_t = 24)]
    layers: usize,
    #[arg(long, default_value_t = 151_936)]
    vocab: usize,
    /// Where the receiving engine runs: `cpu` (f32, so every load converts from bf16) or
    /// `cuda`/`cuda:N` (bf16, as a worker's GPU engine: every load is a host-to-GPU copy).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = tutor_policy::parse_device(&args.device, 0)
        .with_context(|| format!("--device {:?}: expected cpu, cuda or cuda:N", args.device))?;
    tutor_policy::check_device(device)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let mut mc = ModelConfig::tiny(args.vocab);
    mc.hidden_size = args.hidden;
    mc.intermediate_size = args.intermediate;
    mc.num_hidden_layers = args.layers;
    mc.num_attention_heads = 14;
    mc.num_key_value_heads = 2;
    mc.head_dim = args.hidden / 14;
    mc.tie_word_embeddings = true;
    mc.max_position_embeddings = 4096;

    // The published version: bf16, as a GPU learner writes it.
    let store = WeightsStore::new(&dir.path().join("learner"))?;
    {
        let mut policy = Policy::new(mc.clone(), tch::Device::Cpu, 0);
        policy.var_store_mut().bfloat16();
        policy.save_weights(&store.path_for(1))?;
    }
    let pv = store.register(1)?;
    println!(
        "model: {} parameters (hidden {}, {} layers, vocab {}); version file {:.1} MB (bf16)",
        mc.num_parameters(),
        args.hidden,
        args.layers,
        args.vocab,
        pv.bytes as f64 / 1e6
    );

    // The receiving engine, as a worker's: f32 on the CPU, bf16 on a GPU.
    let tokenizer = ChatTokenizer::train(&["a tokenizer for the engine".to_string()], 300)?;
    let mut receiving = Policy::new(mc.clone(), device, 1);
    if device.is_cuda() {
        receiving.var_store_mut().bfloat16();
    }
    let (engine, _thread) = spawn_engine(receiving, tokenizer, Default::default());
    println!("receiving engine on {}", args.device);

    let file_bytes = std::fs::read(&pv.path)?;
    let mut rows: Vec<(&str, f64)> = Vec::new();

    // References.
    let mut t = Vec::new();
    for _ in 0..args.repeat {
        let s = Instant::now();
        let copy = file_bytes.clone();
        std::hint::black_box(&copy);
        t.push(s.elapsed().as_secs_f64());
    }
    rows.push(("plain copy in memory (memcpy)", median(t)));
    let mut t = Vec::new();
    for i in 0..args.repeat {
        let s = Instant::now();
        std::fs::copy(&pv.path, dir.path().join(format!("copy-{i}")))?;
        t.push(s.elapsed().as_secs_f64());
        let _ = std::fs::remove_file(dir.path().join(format!("copy-{i}")));
    }
    rows.push(("plain copy on disk (fs::copy)", median(t)));
    if let tch::Device::Cuda(ordinal) = device {
        // The bytes to the GPU in one copy: the floor of any load into a GPU engine.
        let host = tch::Tensor::from_slice(&file_bytes);
        let mut t = Vec::new();
        for _ in 0..args.repeat {
            let s = Instant::now();
            let on_gpu = host.to_device(device);
            tch::Cuda::synchronize(ordinal as i64);
            t.push(s.elapsed().as_secs_f64());
            drop(on_gpu);
        }
        rows.push(("plain copy host to GPU (one tensor)", median(t)));
    }
    let shared = Arc::new(file_bytes);
    let mut t = Vec::new();
    for _ in 0..args.repeat {
        let s = Instant::now();
        load(&rt, &engine, bytes_source(&shared))?;
        t.push(s.elapsed().as_secs_f64());
    }
    rows.push(("engine load alone, from memory", median(t)));

    // Broadcast over the CPU collective, loopback, one receiver.
    let (mut sender, mut receiver) = pair()?;
    // The transfer alone (header, bytes, the receiver's sha256 check): in parts, as
    // workers receive a version (each part hashed while the next arrives), and in one
    // part, where the hash follows the transfer (as before parts).
    for (label, part) in [
        (
            "broadcast transfer alone, in parts (sha256 overlapped)",
            None,
        ),
        (
            "broadcast transfer alone, one part (sha256 after)",
            Some(usize::MAX),
        ),
    ] {
        let mut t = Vec::new();
        for _ in 0..args.repeat {
            let s = Instant::now();
            let pv2 = pv.clone();
            let send = std::thread::spawn(move || {
                match part {
                    Some(p) => send_version_in_parts(&mut sender, &pv2, p),
                    None => send_version(&mut sender, &pv2),
                }
                .map(|_| sender)
            });
            let arrived =
                receive_one(&mut receiver)?.context("a keepalive instead of a version")?;
            sender = send
                .join()
                .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
            t.push(s.elapsed().as_secs_f64());
            drop(arrived);
        }
        rows.push((label, median(t)));
    }
    for via_file in [false, true] {
        let mut t = Vec::new();
        for i in 0..args.repeat {
            let s = Instant::now();
            let pv2 = pv.clone();
            let send = std::thread::spawn(move || send_version(&mut sender, &pv2).map(|_| sender));
            let arrived =
                receive_one(&mut receiver)?.context("a keepalive instead of a version")?;
            sender = send
                .join()
                .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
            if via_file {
                let path = dir.path().join(format!("received-{i}.safetensors"));
                std::fs::write(&path, &arrived.bytes[..])?;
                drop(arrived);
                load(&rt, &engine, WeightsSource::Path(path.clone()))?;
                let _ = std::fs::remove_file(path);
            } else {
                load(&rt, &engine, bytes_source(&arrived.bytes))?;
            }
            t.push(s.elapsed().as_secs_f64());
        }
        rows.push((
            if via_file {
                "broadcast (CPU collective), via a file"
            } else {
                "broadcast (CPU collective), in memory"
            },
            median(t),
        ));
    }

    // Tensors in buckets over the CPU collective into a safetensors file in memory that
    // the engine loads (what `reload = "distributed"` does into `tutor serve`): a bucket
    // is one contiguous slice of the file; no sha256 of the whole file.
    let mut t = Vec::new();
    for _ in 0..args.repeat {
        let s = Instant::now();
        let metas = engine_update::tensors_of(&shared)?;
        let file = shared.clone();
        let send =
            std::thread::spawn(move || engine_update::send(&mut sender, &file).map(|_| sender));
        let got = engine_update::receive(&mut receiver, &metas, usize::MAX)?;
        sender = send
            .join()
            .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
        load(&rt, &engine, bytes_source(&Arc::new(got)))?;
        t.push(s.elapsed().as_secs_f64());
    }
    drop(sender);
    rows.push((
        "tensors in buckets (CPU collective), into the engine",
        median(t),
    ));

    // gRPC: the learner's Weights service, streamed to disk, then loaded.
    let endpoint = rt.block_on(serve_weights(store.clone()))?;
    let mut t = Vec::new();
    for i in 0..args.repeat {
        let s = Instant::now();
        let dest = dir.path().join(format!("download-{i}.safetensors"));
        rt.block_on(tutor_rollout_worker::weights::download_weights(
            &endpoint,
            1,
            &pv.sha256,
            &dest,
            &Default::default(),
        ))?;
        load(&rt, &engine, WeightsSource::Path(dest.clone()))?;
        let _ = std::fs::remove_file(dest);
        t.push(s.elapsed().as_secs_f64());
    }
    rows.push(("gRPC (Weights stream to disk), then load", median(t)));

    let gb = pv.bytes as f64 / 1e9;
    println!();
    println!(
        "| path | seconds (median of {}) | GB/s of the file |",
        args.repeat
    );
    println!("|---|---|---|");
    for (name, s) in &rows {
        println!("| {name} | {s:.3} | {:.2} |", gb / s);
    }
    // The checksum every path keeps.
    let s = Instant::now();
    let sha = format!("{:x}", Sha256::digest(&shared[..]));
    assert_eq!(sha, pv.sha256);
    println!(
        "\n(sha256 of the file alone: {:.3} s, part of every broadcast and gRPC row)",
        s.elapsed().as_secs_f64()
    );
    Ok(())
}

fn bytes_source(bytes: &Arc<Vec<u8>>) -> WeightsSource {
    WeightsSource::Bytes {
        bytes: bytes.clone(),
        name: "policy version 1 (in memory)".into(),
    }
}

fn load(rt: &tokio::runtime::Runtime, engine: &EngineHandle, source: WeightsSource) -> Result<()> {
    rt.block_on(engine.load(source))?;
    Ok(())
}

/// Rank 0 and rank 1 of a CPU collective on loopback.
fn pair() -> Result<(CpuCollective, CpuCollective)> {
    let rdv = CpuRendezvous::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let addr = rdv.local_addr();
    let join = std::thread::spawn(move || {
        CpuCollective::connect(addr, 1, 2, CpuCollectiveTimeouts::default())
    });
    let root = rdv.accept(2, CpuCollectiveTimeouts::default())?;
    let leaf = join
        .join()
        .map_err(|_| anyhow::anyhow!("rank 1 panicked"))??;
    Ok((root, leaf))
}

/// Serves `store` as the learner's Weights service on loopback; its endpoint.
async fn serve_weights(store: WeightsStore) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                tutor_proto::weights_server::WeightsServer::new(store)
                    .max_encoding_message_size(tutor_proto::MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Ok(format!("http://{addr}"))
}
