//! One episode, turn by turn, from the lease to the graded outcome.
//!
//! At every visited state the teacher labels the best action, the student proposes its own
//! when it may act, and the executed action is the one whoever acts chose
//! ([`crate::mixing`] decides). Every turn is streamed as it happens, with its tokens
//! exactly as generated; at the end the submission is graded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use tokio::sync::mpsc;
use tutor_policy::{ChatTokenizer, GenParams};
use tutor_proto::{
    episode_event, Actor, EpisodeEvent, EpisodeLease, EpisodeOutcome, OutcomeStatus, TurnRecord,
};

use crate::action::{parse_action, Action, FormatError};
use crate::context::{elision_note, Context};
use crate::grade::{grade_fresh, GradingMode};
use crate::mixing::Mixing;
use crate::observation::format_observation;
use crate::sandbox::{Sandbox, SandboxFactory};
use crate::student::StudentHost;
use crate::tasks::TaskRecord;
use crate::teacher::{ExecutedStep, OracleTeacher, Teacher, TeacherState};

/// The default system prompt: the tools and the action format. `{repo}` becomes the
/// sandbox's repository path, `{tools}` the tool documentation (crate::tools).
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a software engineer fixing an issue in the repository at \
{repo} (the current directory). Look at the code before you change it. Each reply is one short thought followed by exactly \
one command in a fenced block:\n```command\nTHE COMMAND\n```\n{tools}\nTest with python -m pytest -q. When the fix \
is complete, reply with the command `submit`.";

/// The system prompt for a sandbox: `{repo}` and `{tools}` filled in.
pub fn render_system_prompt(template: &str, repo: &str) -> String {
    template
        .replace("{repo}", repo)
        .replace("{tools}", crate::tools::TOOLS_DOC)
}

/// Makes the teacher of each episode.
#[derive(Clone)]
pub enum TeacherSource {
    Oracle,
    /// Shared by every episode of the worker (one connection pool, one concurrency limit).
    Endpoint(
        Arc<crate::teacher::endpoint::ChatEndpoint>,
        tokio::runtime::Handle,
    ),
}

impl TeacherSource {
    pub fn make(&self, seed: u64) -> Box<dyn Teacher> {
        match self {
            TeacherSource::Oracle => Box::new(OracleTeacher::new()),
            TeacherSource::Endpoint(e, rt) => Box::new(
                crate::teacher::endpoint::EndpointTeacher::new(e.clone(), rt.clone(), Some(seed)),
            ),
        }
    }
}

/// What an episode needs from the worker around it.
#[derive(Clone)]
pub struct EpisodeEnv {
    pub worker_id: String,
    pub tokenizer: Arc<ChatTokenizer>,
    pub student: StudentHost,
    pub events: mpsc::Sender<EpisodeEvent>,
    pub system_prompt: String,
    /// Where episodes (and their grading) run: local temp dirs or Docker containers.
    pub sandboxes: SandboxFactory,
    pub grade_timeout: Duration,
    /// How submissions are graded (rewards: strict by default).
    pub grading: GradingMode,
    /// Who labels states: the gold-patch oracle or an OpenAI-compatible endpoint.
    pub teacher: TeacherSource,
    /// Set on shutdown: the episode stops after the current turn.
    pub cancel: Arc<AtomicBool>,
}

/// Runs one leased episode to its outcome. Blocking (sandbox commands, tests, model
/// calls): run it on a blocking thread. Never panics on model output.
pub fn run_episode(env: &EpisodeEnv, lease: &EpisodeLease) -> EpisodeOutcome {
    let start = Instant::now();
    let mut outcome = EpisodeOutcome {
        purpose: lease.purpose,
        iteration: lease.iteration,
        policy_version: lease.policy.as_ref().map(|p| p.version).unwrap_or(0),
        ..Default::default()
    };
    let Some(task_proto) = lease.task.as_ref() else {
        fail(&mut outcome, "lease carries no task".into());
        return finish(env, lease, outcome, start);
    };
    let task = TaskRecord::from_proto(task_proto);
    outcome.instance_id = task.instance_id.clone();
    let mut sandbox = match env.sandboxes.create(&task, &lease.episode_id) {
        Ok(s) => s,
        Err(e) => {
            fail(&mut outcome, format!("creating the sandbox: {e}"));
            return finish(env, lease, outcome, start);
        }
    };
    let tok = &env.tokenizer;
    let turn_end = tok.turn_end_id();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(lease.seed);
    let mut teacher = env.teacher.make(lease.seed);
    let settings = TurnSettings::from_lease(lease);
    let mixing = Mixing::from_lease(lease);

    let system = render_system_prompt(&env.system_prompt, sandbox.repo_display());
    let prompt = match tok.render_prompt(&system, &task.problem_statement) {
        Ok(ids) => ids,
        Err(e) => {
            let e = format!("rendering the prompt with the chat template: {e}");
            fail(&mut outcome, e);
            drop(sandbox);
            return finish(env, lease, outcome, start);
        }
    };
    let mut context = Context::new(prompt, context_budget(env, lease, &settings));
    let mut steps: Vec<ExecutedStep> = Vec::new();
    let mut submitted = false;
    let mut turns = 0u32;
    // Why the sandbox stopped running commands, if it did (`Sandbox::stopped`).
    let mut stopped: Option<crate::sandbox::Stopped> = None;

    for t in 0..lease.max_turns {
        if env.cancel.load(Ordering::SeqCst) {
            outcome.error = "worker shutting down".into();
            break;
        }

        // 1. Who acts this turn (crate::mixing). The student proposes whenever it may be
        // executed.
        let roles = mixing.roles(t, &mut rng);

        // 2. The teacher labels this state when something trains on the label or its
        // action is executed; a lease whose labels nothing uses (evaluation, rft, dapo,
        // distill) does not pay for the others, nor fail on them.
        let label = if lease.labels_unused && roles.executes == Actor::Student {
            None
        } else {
            match teacher.next_action(&TeacherState {
                task: &task,
                system_prompt: &system,
                sandbox: sandbox.as_ref(),
                history: &steps,
                turn: t as usize,
                max_turns: lease.max_turns as usize,
            }) {
                Ok(reply) => Some(Proposal {
                    tokens: tok.encode_assistant(&reply.text),
                    logprobs: reply.logprobs,
                    action: parse_action(&reply.text),
                    text: reply.text,
                }),
                Err(e) => {
                    fail(&mut outcome, e.to_string());
                    break;
                }
            }
        };

        // For on-policy distillation the teacher scores the student's tokens.
        let (student, teacher_logprobs_of_student) = if roles.student_generates {
            let score = lease.score_student;
            match student_turn(env, &settings, teacher.as_mut(), context.tokens(), t, score) {
                Ok((p, lps)) => (Some(p), lps),
                Err(e) => {
                    fail(&mut outcome, e);
                    break;
                }
            }
        } else {
            (None, Vec::new())
        };

        // 3. Execute the action of whoever acts.
        let actor = match &student {
            Some(_) if roles.executes == Actor::Student => Actor::Student,
            _ => Actor::Teacher,
        };
        if actor == Actor::Teacher && label.is_none() {
            // Mixing makes the student act whenever it generates and is chosen; a label
            // is asked for every other turn. Unreachable, but never run a missing action.
            fail(&mut outcome, format!("turn {t}: no action to execute"));
            break;
        }
        let turn = TurnMessages {
            label,
            student,
            teacher_logprobs_of_student,
            actor,
        };
        let mut done = execute(sandbox.as_mut(), turn.executed(), &settings);
        submitted = done.submitted;
        steps.extend(done.step.take());
        let executed_tokens = turn.executed().tokens.clone();

        // 4. Record the turn, as it happened.
        let (delta_tokens, rebuilt) = context.take_delta();
        let delta = (delta_tokens, rebuilt);
        let record = turn.record(t, delta, &done, &settings, outcome.policy_version);
        send(env, lease, episode_event::Event::Turn(record));
        turns = t + 1;
        context.push_executed(&executed_tokens);
        if submitted {
            break;
        }
        if let Some(stop) = sandbox.stopped() {
            tracing::warn!(episode = %lease.episode_id, "{}", stop.why);
            stopped = Some(stop);
            break;
        }
        // A message cut at max_new_tokens, or ended by another stop id (the model's end
        // of sequence), is closed here with the turn end, as context, so the tokens the
        // student generated stay exactly as generated and the observation follows a
        // turn end as the template renders it.
        let close = if executed_tokens.last() != Some(&turn_end) {
            vec![turn_end]
        } else {
            Vec::new()
        };
        let rendered = tok.render_observation(&done.observation).and_then(|full| {
            let note = tok.render_observation(&elision_note(&done.observation))?;
            Ok((full, note))
        });
        match rendered {
            Ok((full, note)) => context.push_observation(close, full, note),
            Err(e) => {
                let e = format!("rendering the observation with the chat template: {e}");
                fail(&mut outcome, e);
                break;
            }
        }
    }
    if context.elided() > 0 {
        tracing::debug!(
            episode = %lease.episode_id,
            elided = context.elided(),
            "old observations elided to keep the context within its budget"
        );
    }

    outcome.num_turns = turns;
    outcome.submitted = submitted;
    // At the disk floor (`Sandbox::stopped`): no tests, no patch. The disk crossed it
    // during this sandbox's own command: unresolved (filling the disk costs the reward, as
    // any failure); already under it: ungraded (someone else's doing, as far as this
    // episode knows).
    let ended = crate::sandbox::final_submission(sandbox.as_mut(), stopped);
    drop(sandbox);
    let submission = match ended {
        Err(stop) => {
            outcome.status = stop.outcome_status() as i32;
            add_error(&mut outcome, stop.why);
            Default::default()
        }
        Ok(submission) => {
            if let Some(note) = submission.too_large_note() {
                // Not graded: an unresolved outcome (reward as for any), with no patch to
                // store.
                tracing::warn!(episode = %lease.episode_id, "{note}");
                if outcome.status != OutcomeStatus::SandboxError as i32 {
                    outcome.status = OutcomeStatus::PatchTooLarge as i32;
                }
                add_error(&mut outcome, note);
            } else if outcome.status != OutcomeStatus::SandboxError as i32 {
                grade_submission(env, lease, &task, &submission.patch, &mut outcome);
            }
            submission
        }
    };
    if let Some(note) = submission.left_out_note() {
        tracing::info!(episode = %lease.episode_id, "{note}");
        add_error(&mut outcome, note);
    }
    outcome.patch = submission.patch;
    finish(env, lease, outcome, start)
}

/// The most tokens the student's context may hold before a generation: the lease's
/// training limit (`max_context_tokens`, the coordinator's max_seq_len) or the model's,
/// whichever is smaller, less the room for the reply. Keeping within it (by eliding old
/// observations) means the examples the coordinator builds are the contexts the student
/// was given, uncut.
fn context_budget(env: &EpisodeEnv, lease: &EpisodeLease, settings: &TurnSettings) -> usize {
    let model = env.student.max_request_tokens();
    let limit = match lease.max_context_tokens {
        0 => model,
        n => model.min(n as usize),
    };
    limit.saturating_sub(settings.max_new_tokens).max(1)
}

/// Adds `note` to the outcome's `error` text (after what is there).
fn add_error(outcome: &mut EpisodeOutcome, note: String) {
    if outcome.error.is_empty() {
        outcome.error = note;
    } else {
        outcome.error = format!("{}\n{note}", outcome.error);
    }
}

/// The lease's settings for every turn of its episode.
struct TurnSettings {
    /// The student's sampling temperature: 1 in unbiased mode (the policy's own
    /// distribution, whatever the lease's temperature says).
    temperature: f32,
    unbiased: bool,
    max_new_tokens: usize,
    sampling_seed: u64,
    command_timeout: Duration,
    observation_max_chars: usize,
    /// The policy version the episode runs on (and is reported under).
    policy_version: u64,
}

impl TurnSettings {
    fn from_lease(lease: &EpisodeLease) -> Self {
        let sampling = lease.sampling.unwrap_or_default();
        TurnSettings {
            temperature: if sampling.unbiased {
                1.0
            } else {
                sampling.temperature
            },
            unbiased: sampling.unbiased,
            max_new_tokens: sampling.max_new_tokens.max(1) as usize,
            sampling_seed: sampling.seed,
            command_timeout: Duration::from_millis(lease.command_timeout_ms.max(1000) as u64),
            observation_max_chars: lease.observation_max_chars.max(200) as usize,
            policy_version: lease.policy.as_ref().map(|p| p.version).unwrap_or(0),
        }
    }
}

/// One side's message at a turn: the teacher's label or the student's proposal.
struct Proposal {
    text: String,
    /// As generated (student) or as encoded from the text (teacher).
    tokens: Vec<u32>,
    /// The student's sampling log-probs; the teacher endpoint's, when it gives them.
    logprobs: Vec<f32>,
    action: Result<Action, FormatError>,
}

/// One turn's messages before its action runs: the teacher's label (when it was asked),
/// the student's proposal when it was asked, the teacher's scores of that proposal, and
/// who acts.
struct TurnMessages {
    label: Option<Proposal>,
    student: Option<Proposal>,
    teacher_logprobs_of_student: Vec<f32>,
    /// The student only when it generated.
    actor: Actor,
}

impl TurnMessages {
    /// The message whose action is executed (the episode loop makes sure the teacher's
    /// label exists whenever the teacher acts).
    fn executed(&self) -> &Proposal {
        match (&self.student, &self.label) {
            (Some(s), _) if self.actor == Actor::Student => s,
            (_, Some(label)) => label,
            (Some(s), None) => s,
            (None, None) => unreachable!("a turn without any action"),
        }
    }

    /// The turn as streamed to the coordinator; `delta` is the context added since the
    /// previous turn, or the whole context with `true` when it was rebuilt (elided).
    fn record(
        self,
        turn_index: u32,
        (delta, context_rebuilt): (Vec<u32>, bool),
        done: &Executed,
        settings: &TurnSettings,
        policy_version: u64,
    ) -> TurnRecord {
        let agreement = match (
            self.label.as_ref().map(|l| &l.action),
            self.student.as_ref().map(|s| &s.action),
        ) {
            (Some(Ok(a)), Some(Ok(b))) => a == b,
            _ => false,
        };
        let teacher_asked = self.label.is_some();
        let (teacher_tokens, teacher_text, teacher_format_error, teacher_endpoint_logprobs) =
            match self.label {
                Some(l) => (l.tokens, l.text, l.action.is_err(), l.logprobs),
                None => (Vec::new(), String::new(), false, Vec::new()),
            };
        let generated = self.student.is_some();
        let (student_tokens, student_logprobs, student_text, student_format_error) =
            match self.student {
                Some(s) => (s.tokens, s.logprobs, s.text, s.action.is_err()),
                None => (Vec::new(), Vec::new(), String::new(), false),
            };
        TurnRecord {
            turn_index,
            context_delta_tokens: delta,
            context_rebuilt,
            teacher_tokens,
            teacher_text,
            teacher_format_error,
            teacher_endpoint_logprobs,
            teacher_asked,
            sampling_temperature: if generated { settings.temperature } else { 0.0 },
            unbiased_sampling: generated && settings.unbiased,
            student_tokens,
            student_logprobs,
            teacher_logprobs_of_student: self.teacher_logprobs_of_student,
            student_text,
            student_format_error,
            student_generated: generated,
            executed: self.actor as i32,
            command: done.command.clone(),
            observation: done.observation.clone(),
            exit_code: done.exit_code,
            timed_out: done.timed_out,
            policy_version,
            agreement,
        }
    }
}

/// The student's message for the state `history` at turn `t`.
fn student_proposal(
    env: &EpisodeEnv,
    settings: &TurnSettings,
    history: &[u32],
    t: u32,
) -> Result<Proposal, String> {
    let params = GenParams {
        temperature: settings.temperature,
        // No truncation: the recorded log-probs are the policy's (RL needs them).
        top_p: 1.0,
        max_new_tokens: settings.max_new_tokens,
        seed: settings.sampling_seed.wrapping_add(t as u64),
        stop_token_ids: env.tokenizer.stop_ids().to_vec(),
    };
    let g = env
        .student
        .generate_as(
            history.to_vec(),
            params,
            settings.policy_version,
            Some(&env.cancel),
        )
        .map_err(|e| format!("student generation failed: {e:#}"))?;
    let text = env.tokenizer.decode(&g.tokens);
    Ok(Proposal {
        action: parse_action(&text),
        text,
        tokens: g.tokens,
        logprobs: g.logprobs,
    })
}

/// The student's proposal at turn `t` and, when the lease asks for them (`score`), the
/// teacher's log-probs of its tokens.
fn student_turn(
    env: &EpisodeEnv,
    settings: &TurnSettings,
    teacher: &mut dyn Teacher,
    history: &[u32],
    t: u32,
    score: bool,
) -> Result<(Proposal, Vec<f32>), String> {
    let proposal = student_proposal(env, settings, history, t)?;
    let scores = if score && !proposal.tokens.is_empty() {
        score_student(teacher, history, &proposal.tokens)?
    } else {
        Vec::new()
    };
    Ok((proposal, scores))
}

/// The teacher's log-prob of each of the student's `tokens` after `history`.
fn score_student(
    teacher: &mut dyn Teacher,
    history: &[u32],
    tokens: &[u32],
) -> Result<Vec<f32>, String> {
    match teacher.score(history, tokens) {
        Some(Ok(lps)) if lps.len() == tokens.len() => Ok(lps),
        Some(Ok(lps)) => Err(format!(
            "the teacher scored {} of the student's {} tokens",
            lps.len(),
            tokens.len()
        )),
        Some(Err(e)) => Err(format!("the teacher could not score the student: {e}")),
        None => Err(format!(
            "the lease asks for teacher log-probs of the student's tokens, which the \
             {} teacher cannot give (use [worker.teacher] kind = \"endpoint\")",
            teacher.name()
        )),
    }
}

/// What executing one message did.
struct Executed {
    /// `submit`, the shell command, or empty for a format error.
    command: String,
    observation: String,
    exit_code: i32,
    timed_out: bool,
    submitted: bool,
    /// What teachers see of it from the next turn on (none for `submit`).
    step: Option<ExecutedStep>,
}

/// Executes `message`'s action in the sandbox: `submit` ends the episode, a command runs,
/// a format error is shown as the observation.
fn execute(sandbox: &mut dyn Sandbox, message: &Proposal, settings: &TurnSettings) -> Executed {
    let (command, output, exit_code, timed_out) = match &message.action {
        Ok(Action::Submit) => {
            return Executed {
                command: "submit".into(),
                observation: "Submitted.".into(),
                exit_code: 0,
                timed_out: false,
                submitted: true,
                step: None,
            }
        }
        Ok(Action::Shell(cmd)) => {
            let prepared = crate::tools::prepare_command(cmd);
            let out = sandbox.run(&prepared, settings.command_timeout);
            (Some(cmd.clone()), out.output, out.exit_code, out.timed_out)
        }
        Err(e) => (None, e.to_string(), 1, false),
    };
    let current = sandbox.current_file();
    let observation = format_observation(
        &output,
        exit_code,
        timed_out,
        &sandbox.cwd(),
        current.as_deref(),
        settings.observation_max_chars,
    );
    Executed {
        command: command.clone().unwrap_or_default(),
        observation: observation.clone(),
        exit_code,
        timed_out,
        submitted: false,
        step: Some(ExecutedStep {
            command,
            output,
            exit_code,
            reply: message.text.clone(),
            observation,
        }),
    }
}

/// Grades `patch` in a fresh sandbox (SWE-bench rules) into the outcome's status and
/// test statuses.
fn grade_submission(
    env: &EpisodeEnv,
    lease: &EpisodeLease,
    task: &TaskRecord,
    patch: &str,
    outcome: &mut EpisodeOutcome,
) {
    let g = grade_fresh(
        task,
        patch,
        env.grade_timeout,
        &env.sandboxes,
        &format!("{}-grade", lease.episode_id),
        env.grading,
    );
    outcome.status = g.status as i32;
    outcome.test_statuses = g.test_statuses.into_iter().collect();
    outcome.grading = g.mode.name().to_string();
    outcome.harness_status = g.harness_status.map_or(0, |s| s as i32);
    if !g.reason.is_empty() {
        // Why the task could not be graded (its test patch, spec or image), for the
        // operator: the status alone does not say which task field to fix.
        tracing::warn!(episode = %lease.episode_id, "{}", g.reason);
        if outcome.error.is_empty() {
            outcome.error = g.reason;
        }
    }
}

/// Marks the episode failed before grading (the outcome is SANDBOX_ERROR with `error`).
fn fail(outcome: &mut EpisodeOutcome, error: String) {
    outcome.status = OutcomeStatus::SandboxError as i32;
    outcome.error = error;
}

fn finish(
    env: &EpisodeEnv,
    lease: &EpisodeLease,
    mut outcome: EpisodeOutcome,
    start: Instant,
) -> EpisodeOutcome {
    outcome.duration_s = start.elapsed().as_secs_f64();
    send(env, lease, episode_event::Event::Outcome(outcome.clone()));
    outcome
}

fn send(env: &EpisodeEnv, lease: &EpisodeLease, event: episode_event::Event) {
    let ev = EpisodeEvent {
        episode_id: lease.episode_id.clone(),
        worker_id: env.worker_id.clone(),
        event: Some(event),
    };
    if env.events.blocking_send(ev).is_err() {
        tracing::error!(episode = %lease.episode_id, "event sink stopped: event lost");
    }
}
