//! Mutual TLS across processes: `tutor learner`, `tutor coordinator` and one `tutor
//! worker` started with --tls-cert/--tls-key/--tls-ca (certificates made here by
//! rcgen) and the token finish a tiny run over https://; a plaintext client and one
//! without a client certificate are turned away by the same coordinator.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{coordinator_state, wait_until, Role};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use tutor_proto::rollout_client::RolloutClient;
use tutor_proto::RegisterRequest;

const CONFIG: &str = r#"
[run]
name = "tls"
workers = 1

[tasks]
source = "toy"
toy_train = 2
toy_heldout = 1
seed = 11

[model]
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16

[coordinator]
iterations = 1
episodes_per_iteration = 2
heldout_episodes = 0
max_turns = 3
max_new_tokens = 8
epochs_per_iteration = 1
max_steps_per_iteration = 2
shutdown_grace_s = 1.0

[coordinator.beta]
kind = "constant"
start = 0.5
"#;

/// A CA and one certificate for 127.0.0.1 (no extended key usage: it serves and it
/// connects), as PEM files in `dir`: (ca, cert, key).
fn certificates(dir: &Path, ca_name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, ca_name);
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut leaf = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, format!("{ca_name} member"));
    let key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    let w = |name: &str, text: &str| {
        let p = dir.join(format!("{ca_name}-{name}"));
        std::fs::write(&p, text).unwrap();
        p
    };
    (
        w("ca.pem", &ca_pem),
        w("cert.pem", &cert.pem()),
        w("key.pem", &key.serialize_pem()),
    )
}

/// The log text without terminal colour codes (`ESC [ ... m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn register(name: &str) -> RegisterRequest {
    RegisterRequest {
        worker_name: name.into(),
        capacity: 1,
    }
}

/// A Register call with the run's token over `endpoint`; the error as text.
async fn try_register(endpoint: Endpoint, token: &str) -> Result<(), String> {
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let mut req = tonic::Request::new(register("probe"));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    RolloutClient::new(channel)
        .register(req)
        .await
        .map(|_| ())
        .map_err(|s| format!("{s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learner_coordinator_and_worker_finish_a_run_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let logs = root.join("logs");
    let sandboxes = root.join("sandboxes");
    std::fs::create_dir_all(&logs).unwrap();
    std::fs::create_dir_all(&sandboxes).unwrap();
    let cfg_path = root.join("tls.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "{CONFIG}\n[worker]\nsandbox_root = {:?}\n",
            sandboxes.display().to_string()
        ),
    )
    .unwrap();
    let prep = common::prepare(&cfg_path, &root.join("runs"));
    let p = |k: &str| prep[k].as_str().unwrap().to_string();
    let run_dir = PathBuf::from(p("run_dir"));
    let token = "tls-test-token-8d2e4f6a0b1c3e5d";
    std::fs::write(root.join("token"), token).unwrap();
    let (ca, cert, key) = certificates(&root, "deployment");
    let s = |p: &Path| p.display().to_string();
    let common_flags = |mut v: Vec<String>| {
        v.extend([
            "--auth-token-file".into(),
            s(&root.join("token")),
            "--tls-cert".into(),
            s(&cert),
            "--tls-key".into(),
            s(&key),
            "--tls-ca".into(),
            s(&ca),
        ]);
        v
    };
    let addr = |n: &str| root.join(format!("{n}.addr"));
    let mut learner = Role::new(
        "learner",
        common_flags(vec![
            "learner".into(),
            "--config".into(),
            p("config"),
            "--model-dir".into(),
            p("model_dir"),
            "--out-dir".into(),
            p("learner_out_dir"),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--addr-file".into(),
            s(&addr("learner")),
        ]),
        &logs,
    );
    learner.start();
    wait_until(
        "the learner to listen",
        Duration::from_secs(60),
        &mut [&mut learner],
        || addr("learner").exists(),
    );
    let learner_addr = std::fs::read_to_string(addr("learner")).unwrap();
    let mut coordinator = Role::new(
        "coordinator",
        common_flags(vec![
            "coordinator".into(),
            "--config".into(),
            p("config"),
            "--run-dir".into(),
            s(&run_dir),
            "--learner".into(),
            format!("https://{}", learner_addr.trim()),
            "--train-tasks".into(),
            p("train_tasks"),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--addr-file".into(),
            s(&addr("coordinator")),
        ]),
        &logs,
    );
    coordinator.start();
    wait_until(
        "the coordinator to listen",
        Duration::from_secs(60),
        &mut [&mut learner, &mut coordinator],
        || addr("coordinator").exists(),
    );
    let coord_addr = std::fs::read_to_string(addr("coordinator"))
        .unwrap()
        .trim()
        .to_string();

    // Turned away before the worker starts, so no registration of theirs gets counted.
    let plain = Endpoint::from_shared(format!("http://{coord_addr}")).unwrap();
    let e = try_register(plain, token).await.unwrap_err();
    assert!(
        !e.contains("Unauthenticated"),
        "refused by TLS, not the token: {e}"
    );
    let ca_pem = std::fs::read_to_string(&ca).unwrap();
    let no_client_cert = Endpoint::from_shared(format!("https://{coord_addr}"))
        .unwrap()
        .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca_pem)))
        .unwrap();
    let e = try_register(no_client_cert, token).await.unwrap_err();
    // (The alert, CertificateRequired, may or may not arrive before the connection closes.)
    assert!(!e.contains("Unauthenticated"), "refused by TLS: {e}");
    let (_, other_cert, other_key) = certificates(&root, "other");
    let other = Endpoint::from_shared(format!("https://{coord_addr}"))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&ca_pem))
                .identity(tonic::transport::Identity::from_pem(
                    std::fs::read(&other_cert).unwrap(),
                    std::fs::read(&other_key).unwrap(),
                )),
        )
        .unwrap();
    let e = try_register(other, token).await.unwrap_err();
    assert!(!e.contains("Unauthenticated"), "refused by TLS: {e}");

    let mut worker = Role::new(
        "worker",
        common_flags(vec![
            "worker".into(),
            "--config".into(),
            p("config"),
            "--coordinator".into(),
            format!("https://{coord_addr}"),
            "--model-dir".into(),
            p("model_dir"),
            "--name".into(),
            "w0".into(),
            "--run".into(),
            "tls".into(),
            "--cache-dir".into(),
            s(&root.join("cache")),
        ]),
        &logs,
    );
    worker.start();
    wait_until(
        "the run to finish over TLS",
        Duration::from_secs(120),
        &mut [&mut learner, &mut coordinator, &mut worker],
        || coordinator_state(&run_dir)["phase"] == "finished",
    );
    let status = worker.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "the worker did not leave on its own ({status:?})\n{}",
        worker.log_tail()
    );
    // The policy went through the learner (trained, published, fetched over TLS).
    let state = coordinator_state(&run_dir);
    assert!(
        state["policy_version"].as_u64().unwrap_or(0) >= 1,
        "{state}"
    );
    for r in [&mut coordinator, &mut learner] {
        r.signal_term();
        let status = r.wait_exit(Duration::from_secs(30));
        assert!(
            status.is_some_and(|s| s.success()),
            "{} did not stop cleanly ({status:?})\n{}",
            r.name,
            r.log_tail()
        );
    }
    let log = strip_ansi(&std::fs::read_to_string(logs.join("coordinator.log")).unwrap());
    assert!(
        log.contains("tls=true") && log.contains("client_certificates=true"),
        "{log}"
    );
    assert!(!log.contains(token), "the token leaked into the log");
}

#[test]
fn tutor_run_with_a_tls_section_runs_every_role_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (ca, cert, key) = certificates(&root, "run");
    let cfg = root.join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "{CONFIG}\n[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\n",
            cert.display().to_string(),
            key.display().to_string(),
            ca.display().to_string()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_PYTHON", common::python())
        .env("TUTOR_RUN__OUT_DIR", root.join("runs"))
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let run = std::fs::read_dir(root.join("runs"))
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    let log = |role: &str| {
        strip_ansi(
            &std::fs::read_to_string(run.join("logs").join(format!("{role}.log")))
                .unwrap_or_default(),
        )
    };
    assert!(
        out.status.success(),
        "{}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        log("coordinator"),
        log("worker-0")
    );
    for role in ["learner", "coordinator"] {
        assert!(
            log(role).contains("client_certificates=true"),
            "{role}:\n{}",
            log(role)
        );
    }
    assert!(log("coordinator").contains("learner=https://127.0.0.1:"));

    // A [tls] section naming a file that is not there fails before anything starts.
    std::fs::write(
        &cfg,
        format!(
            "{CONFIG}\n[tls]\ncert = {:?}\nkey = {:?}\nca = \"no-such-ca.pem\"\n",
            cert.display().to_string(),
            key.display().to_string()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(common::tutor_bin())
        .args(["run", "--config", cfg.to_str().unwrap()])
        .env("TUTOR_RUN__OUT_DIR", root.join("runs2"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no-such-ca.pem") && err.contains("[tls]"),
        "{err}"
    );
}
