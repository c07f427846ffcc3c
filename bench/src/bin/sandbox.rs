//! `sandbox`: command round-trip latency of the sandboxes, and container start-up.
//!
//! `cargo run --release -p tutor-bench --bin sandbox [-- --commands 1000]`
//!
//! For the same trivial command (`true`), p50/p99 over N runs of: the Docker sandbox's
//! persistent shell, one `docker exec` per command (how mini-swe-agent runs commands:
//! create exec, start, read to the end, inspect the exit code), and the local sandbox.
//! Then how long an episode waits for its sandbox: container create+start+repository
//! set-up on demand, and the same sandbox taken from a warm pool (`--pool` containers
//! created ahead; each acquisition waits, untimed, until the pool is full again, so this is
//! the pool's best case: episodes that arrive faster than it refills wait as on demand).
//! Needs `make images`; everything talks to the local Docker engine only.

use std::time::{Duration, Instant};

use bollard::models::ExecConfig;
use clap::Parser;
use futures::StreamExt;
use tutor_rollout_worker::sandbox::docker::{self, ContainerSpec, DockerSandbox};
use tutor_rollout_worker::sandbox::pool::WarmPool;
use tutor_rollout_worker::sandbox::LocalSandbox;

#[derive(Parser)]
struct Args {
    /// Commands per method.
    #[arg(long, default_value_t = 1000)]
    commands: usize,
    /// Containers created for the start-up figure.
    #[arg(long, default_value_t = 5)]
    containers: usize,
    #[arg(long, default_value = "tutor/python-task:latest")]
    image: String,
    /// Warm-pool size for the acquisition figure (0 skips it).
    #[arg(long, default_value_t = 2)]
    pool: usize,
}

fn summary(name: &str, mut v: Vec<Duration>) -> f64 {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize].as_secs_f64() * 1e3;
    println!(
        "{name:<40} n={:<5} p50 {:>8.3} ms   p99 {:>8.3} ms   max {:>8.3} ms",
        v.len(),
        p(0.5),
        p(0.99),
        p(1.0)
    );
    p(0.5)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let d = docker::connect().await?;
    let task = tutor_rollout_worker::toy::generate(1, 0).remove(0);
    let run = format!("bench-{}", std::process::id());
    let timeout = Duration::from_secs(10);

    // Persistent shell in Docker.
    let mut sb = DockerSandbox::create(
        &d,
        &ContainerSpec::new(&args.image, &run, "bench", "shell"),
        &task,
    )
    .await?;
    for _ in 0..20 {
        sb.run("true", timeout).await;
    }
    let mut shell = Vec::with_capacity(args.commands);
    for _ in 0..args.commands {
        let t = Instant::now();
        let out = sb.run("true", timeout).await;
        shell.push(t.elapsed());
        anyhow::ensure!(out.exit_code == 0, "persistent shell: {out:?}");
    }

    // One `docker exec` per command, in the same container.
    let mut exec = Vec::with_capacity(args.commands);
    for i in 0..args.commands + 20 {
        let t = Instant::now();
        let e = d
            .create_exec(
                sb.id(),
                ExecConfig {
                    attach_stdout: Some(true),
                    attach_stderr: Some(true),
                    cmd: Some(vec![
                        "bash".into(),
                        "-c".into(),
                        "cd /testbed && true".into(),
                    ]),
                    ..Default::default()
                },
            )
            .await?;
        if let bollard::exec::StartExecResults::Attached { mut output, .. } =
            d.start_exec(&e.id, None).await?
        {
            while output.next().await.is_some() {}
        }
        let code = d.inspect_exec(&e.id).await?.exit_code;
        if i >= 20 {
            exec.push(t.elapsed());
        }
        anyhow::ensure!(code == Some(0), "docker exec exit code {code:?}");
    }
    sb.remove().await;

    // The local sandbox (bash per command in its own process group).
    let local = tokio::task::spawn_blocking({
        let task = task.clone();
        let n = args.commands;
        move || -> anyhow::Result<Vec<Duration>> {
            let mut sb = LocalSandbox::create(&task, None)?;
            let mut v = Vec::with_capacity(n);
            for i in 0..n + 20 {
                let t = Instant::now();
                let out = sb.run("true", Duration::from_secs(10));
                if i >= 20 {
                    v.push(t.elapsed());
                }
                anyhow::ensure!(out.exit_code == 0, "local: {out:?}");
            }
            Ok(v)
        }
    })
    .await??;

    // Container create + start + repository set-up.
    let mut startup = Vec::new();
    for k in 0..args.containers {
        let t = Instant::now();
        let mut c = DockerSandbox::create(
            &d,
            &ContainerSpec::new(&args.image, &run, "bench", &format!("s{k}")),
            &task,
        )
        .await?;
        startup.push(t.elapsed());
        c.remove().await;
    }

    // The same sandbox taken from a warm pool.
    let mut pooled = Vec::new();
    if args.pool > 0 {
        let spec = ContainerSpec::new(&args.image, &run, "bench", "");
        let pool = WarmPool::start(&d, &spec, args.pool);
        pool.warm(&args.image).await;
        for k in 0..args.containers {
            let ready = pool.wait_ready(&args.image, Duration::from_secs(300)).await;
            anyhow::ensure!(ready == args.pool, "the pool did not fill ({ready} ready)");
            let t = Instant::now();
            let mut c = pool
                .acquire(
                    &ContainerSpec::new(&args.image, &run, "bench", &format!("p{k}")),
                    &task,
                )
                .await?;
            pooled.push(t.elapsed());
            anyhow::ensure!(c.pooled(), "the pool handed out no warm container");
            c.remove().await;
        }
        pool.shutdown().await;
    }
    docker::remove_orphans(&d, &run, None).await?;

    println!("command round trip of `true` ({} each):", args.commands);
    let s = summary("docker persistent shell", shell);
    let e = summary("docker exec per command", exec);
    summary("local sandbox", local);
    summary("sandbox on demand (create+start+setup)", startup);
    if !pooled.is_empty() {
        summary(
            &format!("sandbox from a warm pool of {}", args.pool),
            pooled,
        );
    }
    println!("persistent shell / docker exec (p50): {:.3}", s / e);
    Ok(())
}
