//! The roles one process can play (`tutor coordinator|learner|worker|serve|eval`), each
//! its flags and the code that turns them into its crate's options; and what they share
//! (TLS flags, the shutdown signal, loading a task file).

pub mod coordinator;
pub mod eval;
pub mod learner;
pub mod serve;
pub mod worker;

use std::path::PathBuf;

use anyhow::Result;

/// TLS files of one role (see `tutor_proto::tls`): PEM, one set per process.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// This process's certificate (PEM chain, leaf first). With --tls-key, servers
    /// serve TLS and clients present it (mutual TLS).
    #[arg(
        long,
        env = "TUTOR_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "TUTOR_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    tls_key: Option<PathBuf>,
    /// The CA (PEM) that signed the peers' certificates: clients verify servers with
    /// it, servers require client certificates signed by it. Endpoints then use https://.
    #[arg(long, env = "TUTOR_TLS_CA", value_name = "PATH")]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    pub fn files(self) -> tutor_proto::tls::TlsFiles {
        tutor_proto::tls::TlsFiles {
            cert: self.tls_cert,
            key: self.tls_key,
            ca: self.tls_ca,
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutdown signal received");
}

pub fn load_proto_tasks(path: &std::path::Path) -> Result<Vec<tutor_proto::Task>> {
    let tasks = tutor_rollout_worker::tasks::load_tasks(path)?;
    Ok(tasks.iter().map(tutor_proto::Task::from).collect())
}
