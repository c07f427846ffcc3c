//! `ingest`: the coordinator's ingest throughput (see `tutor_bench::ingest`).

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // The driver fails by design (no learner) and the scheduler warns about every
        // outcome of an episode it never leased: both expected here.
        .unwrap_or_else(|_| {
            "warn,tutor_coordinator::driver=off,tutor_coordinator::scheduler=error".into()
        });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let args = tutor_bench::ingest::Args::parse();
    let report = tutor_bench::ingest::run(args).await?;
    println!("{report}");
    Ok(())
}
