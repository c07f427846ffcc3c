//! Evaluation episodes (`tutor eval`): one agent acts on every turn, no mixing and no
//! coordinator; the submission is graded in a fresh sandbox. Used to check a sandbox and
//! a task set end to end (the gold-patch oracle must resolve everything, an agent that
//! submits nothing must resolve nothing) and to measure external agents.

use std::time::{Duration, Instant};

use serde::Serialize;
use tutor_proto::OutcomeStatus;

use crate::action::{parse_action, Action};
use crate::episode::render_system_prompt;
use crate::grade::{grade_fresh, GradingMode};
use crate::observation::format_observation;
use crate::sandbox::SandboxFactory;
use crate::tasks::TaskRecord;
use crate::teacher::{
    format_reply, ExecutedStep, Teacher, TeacherError, TeacherReply, TeacherState,
};

/// An agent that submits at once without changing anything: the floor of every task set
/// (it must resolve nothing, or the tasks are broken).
#[derive(Debug, Default)]
pub struct SubmitNothing;

impl Teacher for SubmitNothing {
    fn next_action(&mut self, _state: &TeacherState<'_>) -> Result<TeacherReply, TeacherError> {
        Ok(TeacherReply::text(format_reply(
            "I will submit without changes.",
            "submit",
        )))
    }
    fn name(&self) -> &str {
        "noop"
    }
}

/// Limits of one evaluation episode.
#[derive(Debug, Clone)]
pub struct EvalSettings {
    pub max_turns: u32,
    pub command_timeout: Duration,
    pub grade_timeout: Duration,
    pub observation_max_chars: usize,
    /// System prompt template (`{repo}`, `{tools}`), sent to endpoint agents.
    pub system_prompt: String,
    /// How submissions are graded (default: exactly as the SWE-bench harness).
    pub grading: GradingMode,
}

impl Default for EvalSettings {
    fn default() -> Self {
        Self {
            max_turns: 30,
            command_timeout: Duration::from_secs(60),
            grade_timeout: Duration::from_secs(300),
            observation_max_chars: 10_000,
            system_prompt: crate::episode::DEFAULT_SYSTEM_PROMPT.to_string(),
            grading: GradingMode::Harness,
        }
    }
}

/// One evaluated task.
#[derive(Debug, Clone, Serialize)]
pub struct EvalResult {
    pub instance_id: String,
    /// RESOLVED, UNRESOLVED, APPLY_PATCH_FAIL, TESTS_TIMEOUT, TESTS_ERROR, SANDBOX_ERROR,
    /// PATCH_TOO_LARGE, TEST_PATCH_FAIL, NO_TEST_SPEC, ENVIRONMENT_ERROR.
    pub status: String,
    pub resolved: bool,
    /// The SWE-bench harness's resolution (RESOLVED_FULL, RESOLVED_PARTIAL, RESOLVED_NO)
    /// where a harness log parser read the tests; empty otherwise.
    pub resolution: String,
    /// The spec that graded: its source, test command and log parser.
    pub grading: String,
    /// `harness` or `strict`.
    pub grading_mode: String,
    /// Strict grading: the harness's status for the same submission, when they differ.
    pub harness_status: String,
    pub submitted: bool,
    pub turns: u32,
    pub format_errors: u32,
    pub duration_s: f64,
    pub sandbox: String,
    pub agent: String,
    /// The submitted diff.
    pub patch: String,
    /// Empty unless something went wrong outside the agent's reasoning (sandbox, an
    /// endpoint that kept failing).
    pub error: String,
    /// Every turn: the command and its exit code.
    pub commands: Vec<(String, i32)>,
}

/// The SWE-bench spelling of a status.
pub fn status_name(s: OutcomeStatus) -> &'static str {
    match s {
        OutcomeStatus::Resolved => "RESOLVED",
        OutcomeStatus::Unresolved => "UNRESOLVED",
        OutcomeStatus::ApplyPatchFail => "APPLY_PATCH_FAIL",
        OutcomeStatus::TestsTimeout => "TESTS_TIMEOUT",
        OutcomeStatus::TestsError => "TESTS_ERROR",
        OutcomeStatus::SandboxError => "SANDBOX_ERROR",
        OutcomeStatus::PatchTooLarge => "PATCH_TOO_LARGE",
        OutcomeStatus::TestPatchFail => "TEST_PATCH_FAIL",
        OutcomeStatus::NoTestSpec => "NO_TEST_SPEC",
        OutcomeStatus::EnvironmentError => "ENVIRONMENT_ERROR",
        OutcomeStatus::Unspecified => "UNSPECIFIED",
    }
}

/// Runs `agent` on `task` in a sandbox from `factory`, then grades the diff in a fresh
/// one. Blocking; never panics on agent output. `label` names the containers.
pub fn eval_task(
    task: &TaskRecord,
    agent: &mut dyn Teacher,
    factory: &SandboxFactory,
    settings: &EvalSettings,
    label: &str,
) -> EvalResult {
    let start = Instant::now();
    let mut result = EvalResult {
        instance_id: task.instance_id.clone(),
        status: status_name(OutcomeStatus::SandboxError).into(),
        resolved: false,
        resolution: String::new(),
        grading: String::new(),
        grading_mode: settings.grading.name().into(),
        harness_status: String::new(),
        submitted: false,
        turns: 0,
        format_errors: 0,
        duration_s: 0.0,
        sandbox: factory.kind().into(),
        agent: agent.name().to_string(),
        patch: String::new(),
        error: String::new(),
        commands: Vec::new(),
    };
    let mut sandbox = match factory.create(task, label) {
        Ok(s) => s,
        Err(e) => {
            result.error = format!("creating the sandbox: {e}");
            result.duration_s = start.elapsed().as_secs_f64();
            return result;
        }
    };
    let system = render_system_prompt(&settings.system_prompt, sandbox.repo_display());
    let mut history: Vec<ExecutedStep> = Vec::new();
    for t in 0..settings.max_turns {
        let reply = agent.next_action(&TeacherState {
            task,
            system_prompt: &system,
            sandbox: sandbox.as_ref(),
            history: &history,
            turn: t as usize,
            max_turns: settings.max_turns as usize,
        });
        let reply = match reply {
            Ok(r) => r.text,
            Err(e) => {
                // The agent could not answer: nothing to grade.
                result.error = e.to_string();
                result.duration_s = start.elapsed().as_secs_f64();
                return result;
            }
        };
        result.turns = t + 1;
        let (command, output, exit_code, timed_out) = match parse_action(&reply) {
            Ok(Action::Submit) => {
                result.submitted = true;
                result.commands.push(("submit".into(), 0));
                break;
            }
            Ok(Action::Shell(cmd)) => {
                let out = sandbox.run(
                    &crate::tools::prepare_command(&cmd),
                    settings.command_timeout,
                );
                result.commands.push((cmd.clone(), out.exit_code));
                (Some(cmd), out.output, out.exit_code, out.timed_out)
            }
            Err(e) => {
                result.format_errors += 1;
                (None, e.to_string(), 1, false)
            }
        };
        let observation = format_observation(
            &output,
            exit_code,
            timed_out,
            &sandbox.cwd(),
            sandbox.current_file().as_deref(),
            settings.observation_max_chars,
        );
        history.push(ExecutedStep {
            command,
            output,
            exit_code,
            reply,
            observation,
        });
        if sandbox.stopped().is_some() {
            break; // the disk floor: nothing more runs here (below)
        }
    }
    // As an episode does (episode.rs): at the disk floor, no submission, no tests.
    let ended = crate::sandbox::final_submission(sandbox.as_mut(), None);
    drop(sandbox);
    let submission = match ended {
        Ok(submission) => submission,
        Err(stop) => {
            result.status = status_name(stop.outcome_status()).into();
            result.error = stop.why;
            result.duration_s = start.elapsed().as_secs_f64();
            return result;
        }
    };
    if let Some(note) = submission.too_large_note() {
        result.status = status_name(OutcomeStatus::PatchTooLarge).into();
        result.error = note;
        result.duration_s = start.elapsed().as_secs_f64();
        return result;
    }
    result.patch = submission.patch;
    let g = grade_fresh(
        task,
        &result.patch,
        settings.grade_timeout,
        factory,
        &format!("{label}-grade"),
        settings.grading,
    );
    result.status = status_name(g.status).into();
    result.resolved = g.resolved();
    result.resolution = g
        .resolution
        .map(|r| r.name().to_string())
        .unwrap_or_default();
    result.grading = g.spec;
    if !g.disagreement.is_empty() {
        result.harness_status = g.harness_status.map(status_name).unwrap_or_default().into();
    }
    if g.status == OutcomeStatus::SandboxError {
        result.error = g.log;
    } else if !g.reason.is_empty() {
        result.error = g.reason;
    }
    result.duration_s = start.elapsed().as_secs_f64();
    result
}
