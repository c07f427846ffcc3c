//! Shared helpers for the rollout-worker integration tests.
#![allow(dead_code)]

use std::time::Duration;

use tutor_rollout_worker::action::{parse_action, Action};
use tutor_rollout_worker::sandbox::LocalSandbox;
use tutor_rollout_worker::tasks::TaskRecord;
use tutor_rollout_worker::teacher::{ExecutedStep, Teacher, TeacherState};

pub const CMD_TIMEOUT: Duration = Duration::from_secs(60);
pub const GRADE_TIMEOUT: Duration = Duration::from_secs(120);

/// Points `TUTOR_PYTHON` at the workspace venv (which has pytest) when it exists.
pub fn init_python() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("TUTOR_PYTHON").is_none() {
            let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
            if venv.exists() {
                std::env::set_var("TUTOR_PYTHON", venv);
            }
        }
    });
}

/// The project's Python (torch, pyarrow: requirements-dev.txt) for the tests' own
/// helper scripts: `TUTOR_PYTHON`, else the workspace venv, else `python3`. Not the
/// sandboxes' interpreter, which `make` points at the pytest-only `.venv-sandbox`.
pub fn project_python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("TUTOR_PYTHON").filter(|v| !v.is_empty()) {
        return p.into();
    }
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if venv.exists() {
        venv
    } else {
        "python3".into()
    }
}

/// Runs `command` as a history step.
pub fn exec(sb: &mut LocalSandbox, history: &mut Vec<ExecutedStep>, command: &str) {
    let out = sb.run(command, CMD_TIMEOUT);
    history.push(ExecutedStep {
        command: Some(command.to_string()),
        output: out.output,
        exit_code: out.exit_code,
        ..Default::default()
    });
}

/// Lets `teacher` act until it submits or `max_turns` pass; returns (submitted, turns used).
pub fn drive(
    teacher: &mut dyn Teacher,
    task: &TaskRecord,
    sb: &mut LocalSandbox,
    history: &mut Vec<ExecutedStep>,
    max_turns: usize,
) -> (bool, usize) {
    for turn in 0..max_turns {
        let reply = {
            let state = TeacherState {
                task,
                system_prompt: "",
                sandbox: sb,
                history,
                turn,
                max_turns,
            };
            teacher
                .next_action(&state)
                .expect("the teacher answers")
                .text
        };
        match parse_action(&reply) {
            Ok(Action::Submit) => return (true, turn + 1),
            Ok(Action::Shell(cmd)) => {
                let out = sb.run(&cmd, CMD_TIMEOUT);
                history.push(ExecutedStep {
                    command: Some(cmd),
                    output: out.output,
                    exit_code: out.exit_code,
                    ..Default::default()
                });
            }
            Err(e) => panic!("teacher reply does not parse ({e}):\n{reply}"),
        }
    }
    (false, max_turns)
}

/// An episode's surroundings for tests: a tokenizer trained on the task's texts, a tiny
/// random student, local sandboxes under a temporary directory, and `teacher`.
pub struct EpisodeSetup {
    pub dir: tempfile::TempDir,
    pub env: tutor_rollout_worker::episode::EpisodeEnv,
    pub events: tokio::sync::mpsc::Receiver<tutor_proto::EpisodeEvent>,
    pub task: tutor_proto::Task,
}

pub fn episode_setup(
    task: TaskRecord,
    teacher: tutor_rollout_worker::episode::TeacherSource,
) -> EpisodeSetup {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use tutor_policy::{ChatTokenizer, ModelConfig};
    use tutor_rollout_worker::episode::{EpisodeEnv, DEFAULT_SYSTEM_PROMPT};

    init_python();
    let dir = tempfile::tempdir().unwrap();
    let corpus = vec![
        DEFAULT_SYSTEM_PROMPT.to_string(),
        task.problem_statement.clone(),
        task.patch.clone(),
    ];
    let tokenizer = ChatTokenizer::train(&corpus, 400).unwrap();
    tokenizer.save(&dir.path().join("tokenizer.json")).unwrap();
    ModelConfig::tiny(tokenizer.vocab_size())
        .save(&dir.path().join("config.json"))
        .unwrap();
    let student = tutor_rollout_worker::student::StudentHost::start(
        dir.path(),
        dir.path(),
        tokenizer.clone(),
        tutor_rollout_worker::worker::WorkerConfig::default().student_engine(),
        tutor_proto::auth::ClientAuth::default(),
    )
    .unwrap();
    let (tx, events) = tokio::sync::mpsc::channel(1024);
    let env = EpisodeEnv {
        worker_id: "w-test".into(),
        tokenizer: Arc::new(tokenizer),
        student,
        events: tx,
        system_prompt: DEFAULT_SYSTEM_PROMPT.to_string(),
        sandboxes: tutor_rollout_worker::sandbox::SandboxFactory::Local {
            root: Some(dir.path().to_path_buf()),
            owner: None,
        },
        grade_timeout: Duration::from_secs(120),
        grading: tutor_rollout_worker::grade::GradingMode::Strict,
        teacher,
        cancel: Arc::new(AtomicBool::new(false)),
    };
    EpisodeSetup {
        dir,
        env,
        events,
        task: (&task).into(),
    }
}
