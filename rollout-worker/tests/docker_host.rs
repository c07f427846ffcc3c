//! The worker finds the Docker engine `DOCKER_HOST` names, TCP included (a Kubernetes
//! worker pod's Docker sidecar listens on tcp://127.0.0.1:2375): an engine address that
//! answers nothing is an error, not a silent fallback to the local socket. Its own test
//! binary, since it sets the process's environment.

use tutor_rollout_worker::sandbox::docker::{self, DockerError};

#[tokio::test]
async fn docker_host_is_honoured_for_tcp_and_unix() {
    let socket = "/var/run/docker.sock";
    if !std::path::Path::new(socket).exists() {
        eprintln!("SKIPPED: no Docker engine socket at {socket}");
        return;
    }
    // Port 9 (discard) on loopback: nothing answers there.
    std::env::set_var("DOCKER_HOST", "tcp://127.0.0.1:9");
    match docker::connect().await {
        Err(DockerError::Unreachable(_)) => {}
        Err(e) => panic!("expected Unreachable, got {e}"),
        Ok(_) => panic!("DOCKER_HOST=tcp://127.0.0.1:9 was ignored: connected elsewhere"),
    }
    std::env::set_var("DOCKER_HOST", format!("unix://{socket}"));
    if let Err(e) = docker::connect().await {
        panic!("DOCKER_HOST=unix://{socket}: {e}");
    }
}
