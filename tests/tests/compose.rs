//! The docker-compose stack (deploy/compose/docker-compose.yml) on the real Docker engine:
//! a coordinator, a learner and three rollout workers, each its own container of the
//! `tutor/tutor` image on a private network, running the stack's short DAgger run on toy
//! tasks with every episode in a Docker sandbox started through the host's socket. Mid-run
//! the test `docker kill`s one worker container and starts it again, and adds a fourth
//! worker. Then it checks what an operator relies on: the run finishes; the store holds
//! every planned episode exactly once, complete; the learner published a version per
//! iteration and the workers rolled out with them; and after `down -v` no container
//! (sandboxes included), network or volume of the run is left.
//!
//! A second test runs the same stack with deploy/compose/engine.yml on top: the workers'
//! student on one `tutor serve` container that the learner loads each version into.
//!
//! Needs the images: the tutor image (`make image`, from the release binary, or
//! `TUTOR_TEST_IMAGE`: `make test` builds `tutor/tutor:test` from its debug binary) and
//! `make images` (the sandbox image); `make compose-test` and `make test` build both first.
//! Where no Docker engine answers, it says SKIPPED, like the other Docker tests.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The tutor image the stacks run: `TUTOR_TEST_IMAGE` where set (`make test` sets
/// `tutor/tutor:test`, made from the debug binary its other tests start), else the release
/// image of `make image`.
fn image() -> String {
    std::env::var("TUTOR_TEST_IMAGE").unwrap_or_else(|_| "tutor/tutor:latest".into())
}
const SANDBOX_IMAGE: &str = "tutor/python-task:latest";

fn compose_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/compose")
        .canonicalize()
        .expect("deploy/compose")
}

/// A `[coordinator]` number of deploy/compose/config.toml (`key = N` on its own line),
/// so the checks follow the stack's config.
fn config_number(key: &str) -> u64 {
    let path = compose_dir().join("config.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    text.lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{}: no `{key} = N` line", path.display()))
}

fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("starting {shown}: {e}"));
    out
}

fn docker(args: &[&str]) -> Output {
    run(Command::new("docker").args(args))
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn lines(s: &str) -> Vec<String> {
    s.lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The compose tool installed: `docker compose` (the plugin) or `docker-compose` (1.x),
/// as the Makefile picks it.
fn compose_tool() -> Vec<String> {
    let plugin = Command::new("docker").args(["compose", "version"]).output();
    if plugin.is_ok_and(|o| o.status.success()) {
        return vec!["docker".into(), "compose".into()];
    }
    let v1 = Command::new("docker-compose").arg("version").output();
    assert!(
        v1.is_ok_and(|o| o.status.success()),
        "neither `docker compose` nor `docker-compose` is installed"
    );
    vec!["docker-compose".into()]
}

/// One run of the stack under its own compose project; `down` on drop (a failing test
/// leaves nothing behind either).
struct Stack {
    tool: Vec<String>,
    /// The compose files, in deploy/compose, in order (later ones override).
    files: Vec<&'static str>,
    project: String,
    env: Vec<(String, String)>,
    down: bool,
    /// One stack at a time (held until after `down`: fields drop after `Drop::drop`).
    _one: std::sync::MutexGuard<'static, ()>,
}

impl Stack {
    fn compose(&self, args: &[&str]) -> Output {
        let dir = compose_dir();
        let mut cmd = Command::new(&self.tool[0]);
        cmd.args(&self.tool[1..]);
        for file in &self.files {
            cmd.arg("-f").arg(dir.join(file));
        }
        cmd.args(["-p", &self.project]).args(args).current_dir(&dir);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        run(&mut cmd)
    }

    /// `up -d` with `workers` workers; the coordinator's metrics address on the host.
    fn up(&self, workers: usize) -> String {
        let scale = format!("worker={workers}");
        ok(
            &self.compose(&["up", "-d", "--scale", &scale]),
            "compose up",
        );
        let port = ok(
            &self.compose(&["port", "coordinator", "9300"]),
            "compose port",
        );
        let addr = port.trim().to_string();
        assert!(
            addr.starts_with("127.0.0.1:"),
            "metrics published at {addr}"
        );
        addr
    }

    /// The coordinator's run directory (its volume), copied out: `run/` in the
    /// directory returned.
    fn copy_run_dir(&self) -> tempfile::TempDir {
        let coordinator = self.containers("coordinator");
        let copy = tempfile::tempdir().unwrap();
        ok(
            &docker(&[
                "cp",
                &format!("{}:/var/lib/tutor/run", coordinator[0]),
                &copy.path().display().to_string(),
            ]),
            "docker cp of the run directory",
        );
        copy
    }

    fn containers(&self, service: &str) -> Vec<String> {
        let out = docker(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=com.docker.compose.project={}", self.project),
            "--filter",
            &format!("label=com.docker.compose.service={service}"),
        ]);
        let mut ids = lines(&ok(&out, "docker ps"));
        ids.sort();
        ids
    }

    fn logs(&self) -> String {
        let out = self.compose(&["logs", "--no-color", "--tail", "40"]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if !self.down {
            let _ = self.compose(&["down", "-v", "--remove-orphans", "-t", "5"]);
        }
        // Sandboxes of a failed run: the workers that would have removed them are gone.
        let out = docker(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=tutor.run={}", self.project),
        ]);
        for id in lines(&String::from_utf8_lossy(&out.stdout)) {
            let _ = docker(&["rm", "-f", &id]);
        }
    }
}

/// The coordinator's Prometheus metrics as name → value (a family's labelled series summed).
fn metrics(addr: &str) -> Option<BTreeMap<String, f64>> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let mut m = BTreeMap::new();
    for l in body.lines().filter(|l| !l.starts_with('#')) {
        // Labelled series (`name{purpose="train"} 12`) add up under their name.
        if let Some((k, v)) = l.rsplit_once(' ') {
            if let Ok(v) = v.trim().parse::<f64>() {
                let name = k.split('{').next().unwrap_or(k).to_string();
                *m.entry(name).or_insert(0.0) += v;
            }
        }
    }
    (!m.is_empty()).then_some(m)
}

/// The whole test's deadline: under nextest's kill (8 × 120 s, .config/nextest.toml), so
/// a hung stack ends in a panic, whose unwinding runs `Stack::drop` (`down -v`), rather
/// than in a SIGKILL that would leave the stack behind.
const DEADLINE: Duration = Duration::from_secs(840);

fn wait_for(what: &str, started: Instant, stack: &Stack, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        if started.elapsed() > DEADLINE {
            panic!(
                "the test's {DEADLINE:?} ran out waiting for {what} (waited {:?})\n--- the stack's logs ---\n{}",
                t.elapsed(),
                stack.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    t.elapsed()
}

fn metric(addr: &str, name: &str) -> f64 {
    metrics(addr)
        .and_then(|m| m.get(name).copied())
        .unwrap_or(0.0)
}

/// Held by each stack for its life: two stacks at once (as `cargo test` would run
/// this file's tests) would share two cores and the first test's 10 s lease timeouts.
static ONE_STACK_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// 24 random bytes in hex: a token or an API key.
fn random_hex() -> String {
    let mut b = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A container's log, stdout and stderr.
fn container_log(id: &str) -> String {
    let out = docker(&["logs", id]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A stack of `files` (in deploy/compose) under a compose project of its own, with the
/// run's token and the learner's and the workers' made for it, and `extra` environment;
/// `None` (after saying SKIPPED) where no Docker engine answers.
fn new_stack(files: &[&'static str], extra: &[(&str, &str)]) -> Option<Stack> {
    let one = ONE_STACK_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !docker(&["info"]).status.success() {
        eprintln!("SKIPPED: no Docker engine reachable (`docker info` failed)");
        return None;
    }
    for image in [image().as_str(), SANDBOX_IMAGE] {
        assert!(
            docker(&["image", "inspect", image]).status.success(),
            "the image {image} is missing: `make image images` builds tutor/tutor:latest and the sandbox image, `make test-image` tutor/tutor:test"
        );
    }
    let socket = "/var/run/docker.sock";
    let gid = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(socket)
            .unwrap_or_else(|e| panic!("{socket}: {e}"))
            .gid()
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let project = format!("tutorct{}x{nanos}", std::process::id());
    let token = random_hex();
    // The learner and the workers get their own tokens, derived from the run's by the
    // image's binary (`tutor learner-token`, `tutor worker-token`).
    let role_token = |command: &str| {
        ok(
            &run(Command::new("docker")
                .args(["run", "--rm", "-e", "TUTOR_AUTH_TOKEN", &image(), command])
                .env("TUTOR_AUTH_TOKEN", &token)),
            &format!("tutor {command}"),
        )
        .trim()
        .to_string()
    };
    let learner_token = role_token("learner-token");
    let worker_token = role_token("worker-token");
    assert!(learner_token.starts_with("learner.") && worker_token.starts_with("worker."));
    let mut env: Vec<(String, String)> = vec![
        ("TUTOR_AUTH_TOKEN".into(), token),
        ("TUTOR_LEARNER_TOKEN".into(), learner_token),
        ("TUTOR_WORKER_TOKEN".into(), worker_token),
        ("DOCKER_GID".into(), gid.to_string()),
        ("TUTOR_RUN".into(), project.clone()),
        ("TUTOR_IMAGE".into(), image()),
        // The checks read the workers' info lines; the stack's own config and socket.
        ("RUST_LOG".into(), "info".into()),
        (
            "TUTOR_COMPOSE_CONFIG".into(),
            compose_dir().join("config.toml").display().to_string(),
        ),
        ("DOCKER_SOCKET".into(), socket.into()),
    ];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Some(Stack {
        tool: compose_tool(),
        files: files.to_vec(),
        env,
        project,
        down: false,
        _one: one,
    })
}

#[test]
fn compose_stack_survives_a_killed_worker_and_scales_up_mid_run() {
    let started = Instant::now();
    let Some(mut stack) = new_stack(&["docker-compose.yml"], &[]) else {
        return;
    };
    let project = stack.project.clone();
    let log = |what: &str| println!("[{:>6.1}s] {what}", started.elapsed().as_secs_f64());

    let addr = stack.up(3);
    log("stack up: coordinator, learner, 3 workers");

    // One worker dies while the first iteration's episodes stream in, and comes back.
    wait_for("the first stored episodes", started, &stack, || {
        metric(&addr, "tutor_coordinator_episodes_completed_total") >= 2.0
    });
    let workers = stack.containers("worker");
    assert_eq!(workers.len(), 3, "three worker containers: {workers:?}");
    // The victim is a worker in the middle of an episode (one of its sandboxes is up):
    // its lease must expire and the episode run again elsewhere.
    let mut victim = String::new();
    wait_for("a worker with a sandbox up", started, &stack, || {
        let busy = docker(&[
            "ps",
            "--filter",
            &format!("label=tutor.run={project}"),
            "--format",
            "{{.Label \"tutor.worker\"}}",
        ]);
        let names = lines(&String::from_utf8_lossy(&busy.stdout));
        // A worker's name is its container's host name: the short container id.
        match workers.iter().find(|w| {
            names
                .iter()
                .any(|n| !n.is_empty() && w.starts_with(n.as_str()))
        }) {
            Some(w) => {
                victim = w.clone();
                true
            }
            None => false,
        }
    });
    ok(&docker(&["kill", &victim]), "docker kill");
    log(&format!("docker kill worker {victim}"));
    ok(&docker(&["start", &victim]), "docker start");
    log("started it again");

    // A fourth worker joins during a later iteration.
    wait_for("iteration 1", started, &stack, || {
        metric(&addr, "tutor_coordinator_iteration") >= 1.0
    });
    ok(
        &stack.compose(&[
            "up",
            "-d",
            "--no-deps",
            "--no-recreate",
            "--scale",
            "worker=4",
            "worker",
        ]),
        "compose up --scale worker=4",
    );
    let workers = stack.containers("worker");
    assert_eq!(workers.len(), 4, "four worker containers: {workers:?}");
    log("scaled to 4 workers");

    let took = wait_for("the run to finish", started, &stack, || {
        metric(&addr, "tutor_coordinator_run_finished") >= 1.0
    });
    log(&format!(
        "run finished ({:.0}s after the scale-up)",
        took.as_secs_f64()
    ));
    let final_version = metric(&addr, "tutor_coordinator_policy_version");
    let iterations = config_number("iterations");
    assert!(
        final_version >= iterations as f64,
        "the learner published {final_version} versions for {iterations} iterations"
    );

    // Workers leave on their own when the run is over, successfully.
    wait_for("the workers to exit", started, &stack, || {
        workers.iter().all(|w| {
            let out = docker(&["inspect", "-f", "{{.State.Running}}", w]);
            String::from_utf8_lossy(&out.stdout).trim() == "false"
        })
    });
    for w in &workers {
        let code = ok(
            &docker(&["inspect", "-f", "{{.State.ExitCode}}", w]),
            "docker inspect",
        );
        assert_eq!(code.trim(), "0", "worker {w} exit code\n{}", stack.logs());
    }
    // Every worker loaded a published version (its last words say which), and the one
    // added mid-run registered and ran episodes.
    for w in &workers {
        let text = container_log(w);
        let stopped = text
            .lines()
            .rfind(|l| l.contains("worker stopped"))
            .unwrap_or_else(|| panic!("worker {w} never logged `worker stopped`:\n{text}"));
        let version: u64 = stopped
            .split("version=")
            .nth(1)
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no version in `{stopped}`"));
        assert!(
            version >= 1,
            "worker {w} ended on version {version}: it never loaded published weights\n{text}"
        );
    }
    let added = workers_added(&workers, &victim);
    let added_log = container_log(added);
    assert!(
        added_log.contains("registered") && added_log.contains("episode done"),
        "the worker added mid-run did not register and run an episode:\n{added_log}"
    );
    let victim_log = container_log(&victim);
    assert_eq!(
        victim_log.matches("registered").count(),
        2,
        "the killed worker registered once per start:\n{victim_log}"
    );

    // The store, read from the coordinator's volume.
    let copy = stack.copy_run_dir();
    let run_dir = copy.path().join("run");
    let abandoned = check_store(&run_dir).abandoned.len();
    // The killed worker held a lease (its sandbox was up); it expired and the episode
    // was leased again (the store check above saw its slot completed exactly once).
    assert!(
        metric(&addr, "tutor_coordinator_lease_expiries_total") >= 1.0,
        "the killed worker was mid-episode, yet no lease expired"
    );
    log(&format!(
        "store checked: every planned episode once, complete; {abandoned} abandoned attempt(s), {} lease expiries",
        metric(&addr, "tutor_coordinator_lease_expiries_total")
    ));

    // Down: nothing of the run is left, sandboxes included.
    ok(
        &stack.compose(&["down", "-v", "--remove-orphans", "-t", "30"]),
        "compose down",
    );
    stack.down = true;
    let left = |args: &[&str]| lines(&ok(&docker(args), "docker ls"));
    let label = format!("label=com.docker.compose.project={project}");
    assert_eq!(
        left(&["ps", "-aq", "--filter", &label]),
        Vec::<String>::new()
    );
    assert_eq!(
        left(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=tutor.run={project}")
        ]),
        Vec::<String>::new(),
        "sandbox containers of the run are left after down"
    );
    assert_eq!(
        left(&["network", "ls", "-q", "--filter", &label]),
        Vec::<String>::new()
    );
    assert_eq!(
        left(&["volume", "ls", "-q", "--filter", &label]),
        Vec::<String>::new()
    );
    log("down: no container, sandbox, network or volume left");
}

/// The stack with deploy/compose/engine.yml on top: every worker's student on one `tutor
/// serve` container, started from the prepared run directory with placeholder weights,
/// into which the learner loads each version it publishes, over the stack's network
/// (`[worker.student] loaded_by = "learner"`, tensors over Tutor's collective, the
/// engine's API key required). The run finishes; every version an episode ran on was
/// loaded into the engine by the learner, once; the workers' turns came from the engine
/// and no worker loaded a version; the store holds every planned episode once.
#[test]
fn compose_stack_with_the_student_on_an_engine_the_learner_loads() {
    let started = Instant::now();
    let key = random_hex();
    let files = ["docker-compose.yml", "engine.yml"];
    let Some(mut stack) = new_stack(&files, &[("TUTOR_ENGINE_API_KEY", &key)]) else {
        return;
    };
    let log = |what: &str| println!("[{:>6.1}s] {what}", started.elapsed().as_secs_f64());
    let addr = stack.up(2);
    log("stack up: coordinator, learner, engine, 2 workers");
    let took = wait_for("the run to finish", started, &stack, || {
        metric(&addr, "tutor_coordinator_run_finished") >= 1.0
    });
    log(&format!("run finished after {:.0}s", took.as_secs_f64()));

    let copy = stack.copy_run_dir();
    // Every planned episode once, complete, iteration i's on version i (sync mode); the
    // versions every episode ran on, the final evaluation's included.
    let stored = check_store(&copy.path().join("run"));
    let versions: std::collections::BTreeSet<u64> =
        stored.outcomes.values().map(|o| o.policy_version).collect();
    assert!(versions.len() >= 2, "episodes of versions {versions:?}");

    let engine_log = container_log(&stack.containers("engine")[0]);
    assert!(
        engine_log.contains("--load-format dummy: serving placeholder weights"),
        "{engine_log}"
    );
    let workers = stack.containers("worker");
    let worker_log: String = workers.iter().map(|w| container_log(w)).collect();
    for w in &workers {
        let text = container_log(w);
        assert!(
            text.contains("student engine answers"),
            "worker {w}:\n{text}"
        );
    }
    common::assert_the_learner_loaded_each_version_once(
        &versions,
        &container_log(&stack.containers("learner")[0]),
        &worker_log,
        &engine_log,
    );
    log(&format!(
        "the learner loaded versions {versions:?} into the engine, once each; no worker loaded one"
    ));
    ok(
        &stack.compose(&["down", "-v", "--remove-orphans", "-t", "30"]),
        "compose down",
    );
    stack.down = true;
}

/// The container of the worker added by the scale-up: the one that is neither of the
/// first three (the victim is among those).
fn workers_added<'a>(workers: &'a [String], victim: &str) -> &'a str {
    let created = |id: &str| {
        let out = docker(&["inspect", "-f", "{{.Created}}", id]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let newest = workers.iter().max_by_key(|w| created(w)).expect("workers");
    assert_ne!(newest, victim);
    newest
}

/// The store's invariants (`common::check_store`), every planned training slot
/// completed, and the episodes of iteration i rolled out with version i. Returns the
/// store as read (its abandoned attempts are a killed worker's).
fn check_store(run_dir: &Path) -> common::StoredRun {
    let stored = common::check_store(run_dir);
    let train: Vec<&String> = stored
        .completed_slots
        .keys()
        .filter(|s| s.contains("train"))
        .collect();
    assert_eq!(
        train.len() as u64,
        config_number("iterations") * config_number("episodes_per_iteration"),
        "planned training episodes with a complete attempt: {train:?}"
    );
    // Sync mode: iteration i rolls out with version i, the one the learner published
    // after training on iterations 0..i, which every worker had to load first.
    for (id, o) in &stored.outcomes {
        let iteration: u64 = id[2..5].parse().unwrap();
        assert_eq!(
            o.policy_version, iteration,
            "episode {id} of iteration {iteration} rolled out with version {}",
            o.policy_version
        );
    }
    stored
}
