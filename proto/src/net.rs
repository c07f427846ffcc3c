//! Small pieces every server shares.

use std::net::SocketAddr;
use std::path::Path;

/// Writes `addr` to `path` atomically (temp file + rename), so a watcher polling for the
/// file never reads half an address. Used with `--addr-file` when binding port 0.
pub fn write_addr_file(path: &Path, addr: SocketAddr) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, addr.to_string())?;
    std::fs::rename(&tmp, path)
}

/// Why a server could not start listening.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("binding the {role} to {addr}: {error} (is another process listening there? pick another address or port 0)")]
    Bind {
        role: &'static str,
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error(
        "the {role} would listen on {addr}, reachable from other machines, with no \
         authentication: give it the run's token (--auth-token-file or TUTOR_AUTH_TOKEN) or \
         client certificates (--tls-ca), listen on a loopback address, or pass --insecure to \
         take calls from anyone who can reach it"
    )]
    Unprotected {
        role: &'static str,
        addr: SocketAddr,
    },
    #[error("writing the {role}'s address file {}: {error}", path.display())]
    AddrFile {
        role: &'static str,
        path: std::path::PathBuf,
        error: std::io::Error,
    },
}

/// Fail closed: a server (`role`) on a non-loopback address must authenticate its
/// callers (`protected`: a token, or client certificates) unless the operator said
/// `--insecure`. On a loopback address anything goes (the single-machine default), with
/// the warning of [`GrpcListener::warn_if_unauthenticated`].
pub fn refuse_unprotected(
    role: &'static str,
    addr: SocketAddr,
    protected: bool,
    insecure: bool,
) -> Result<(), ListenError> {
    if protected || insecure || addr.ip().is_loopback() {
        return Ok(());
    }
    Err(ListenError::Unprotected { role, addr })
}

/// A gRPC server's socket, bound before its services are assembled, so the address
/// (port 0 included) is known and can be announced. Every Tutor gRPC server starts the
/// same way: bind, announce (log line, the missing-auth warning, the address file), then
/// serve [`GrpcListener::incoming`] until shutdown, its health service turned to
/// NOT_SERVING first ([`not_serving_after`]).
pub struct GrpcListener {
    role: &'static str,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
}

impl GrpcListener {
    /// Binds `addr` for the server named `role` in messages ("coordinator", "learner").
    pub async fn bind(role: &'static str, addr: SocketAddr) -> Result<Self, ListenError> {
        let bind_error = |error| ListenError::Bind { role, addr, error };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        Ok(GrpcListener {
            role,
            listener,
            addr,
        })
    }

    /// The bound address (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Writes the bound address to `path` (`--addr-file`): what tells a watcher such as
    /// `tutor run` that the server is up, so it is the last step before serving.
    pub fn write_addr_file(&self, path: Option<&Path>) -> Result<(), ListenError> {
        match path {
            Some(p) => write_addr_file(p, self.addr).map_err(|error| ListenError::AddrFile {
                role: self.role,
                path: p.to_path_buf(),
                error,
            }),
            None => Ok(()),
        }
    }

    /// [`refuse_unprotected`] for this socket: `auth` and whether TLS requires client
    /// certificates decide whether it is protected.
    pub fn refuse_unprotected(
        &self,
        auth: &crate::auth::ServerAuth,
        client_certificates: bool,
        insecure: bool,
    ) -> Result<(), ListenError> {
        refuse_unprotected(
            self.role,
            self.addr,
            auth.is_enabled() || client_certificates,
            insecure,
        )
    }

    /// Warns, once at start, when the server takes calls from anyone.
    pub fn warn_if_unauthenticated(&self, auth: &crate::auth::ServerAuth) {
        if !auth.is_enabled() {
            tracing::warn!(
                addr = %self.addr,
                "no auth token (--auth-token-file or TUTOR_AUTH_TOKEN): the {} accepts \
                 gRPC calls from anyone who can reach it",
                self.role
            );
        }
    }

    /// The connections to serve. tonic sets TCP_NODELAY only on listeners it binds
    /// itself; without it small replies wait on delayed ACKs (~40 ms each).
    pub fn incoming(self) -> tonic::transport::server::TcpIncoming {
        tonic::transport::server::TcpIncoming::from(self.listener).with_nodelay(Some(true))
    }
}

/// Resolves when `shutdown` does, after marking every service of `health` NOT_SERVING:
/// probes see the server going before its connections close.
pub async fn not_serving_after(
    shutdown: impl std::future::Future<Output = ()>,
    health: tonic_health::server::HealthReporter,
) {
    shutdown.await;
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server reachable from other machines without authentication refuses to start,
    /// naming the ways out; loopback, a token, client certificates or --insecure let it.
    #[test]
    fn an_exposed_server_without_authentication_refuses_to_start() {
        let open: SocketAddr = "0.0.0.0:50051".parse().unwrap();
        let e = refuse_unprotected("coordinator", open, false, false).unwrap_err();
        let text = e.to_string();
        for needle in [
            "coordinator",
            "0.0.0.0:50051",
            "--auth-token-file",
            "--insecure",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        let public: SocketAddr = "10.1.2.3:7000".parse().unwrap();
        assert!(refuse_unprotected("learner", public, false, false).is_err());
        let v6: SocketAddr = "[::]:7000".parse().unwrap();
        assert!(refuse_unprotected("learner", v6, false, false).is_err());

        assert!(refuse_unprotected("coordinator", open, true, false).is_ok());
        assert!(refuse_unprotected("coordinator", open, false, true).is_ok());
        for local in ["127.0.0.1:0", "[::1]:9000", "127.0.0.5:1"] {
            let addr: SocketAddr = local.parse().unwrap();
            assert!(refuse_unprotected("coordinator", addr, false, false).is_ok());
        }
    }
}
