//! One episode with turn-level mixing (DAgger): at every visited state the teacher
//! labels the best action; the student proposes its own; the executed action is the
//! teacher's with probability β, else the student's. Every turn is streamed as it
//! happens; tokens are kept exactly as generated.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tutor_policy::{ChatTokenizer, GenParams};
use tutor_proto::{
    episode_event, Actor, EpisodeEvent, EpisodeLease, EpisodeOutcome, OutcomeStatus, TurnRecord,
};

use crate::action::{parse_action, Action};
use crate::backend::SandboxFactory;
use crate::grade::grade_fresh;
use crate::observation::format_observation;
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
    Endpoint(Arc<crate::endpoint::ChatEndpoint>, tokio::runtime::Handle),
}

impl TeacherSource {
    pub fn make(&self, seed: u64) -> Box<dyn Teacher> {
        match self {
            TeacherSource::Oracle => Box::new(OracleTeacher::new()),
            TeacherSource::Endpoint(e, rt) => Box::new(crate::endpoint::EndpointTeacher::new(
                e.clone(),
                rt.clone(),
                Some(seed),
            )),
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
        outcome.status = OutcomeStatus::SandboxError as i32;
        outcome.error = "lease carries no task".into();
        return finish(env, lease, outcome, start);
    };
    let task = TaskRecord::from_proto(task_proto);
    outcome.instance_id = task.instance_id.clone();
    let mut sandbox = match env.sandboxes.create(&task, &lease.episode_id) {
        Ok(s) => s,
        Err(e) => {
            outcome.status = OutcomeStatus::SandboxError as i32;
            outcome.error = format!("creating the sandbox: {e}");
            return finish(env, lease, outcome, start);
        }
    };
    let tok = &env.tokenizer;
    let im_end = tok.im_end_id();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(lease.seed);
    let mut teacher = env.teacher.make(lease.seed);
    let sampling = lease.sampling.unwrap_or_default();
    // Unbiased mode: the policy's own distribution, whatever the temperature says.
    let temperature = if sampling.unbiased {
        1.0
    } else {
        sampling.temperature
    };
    let timeout = Duration::from_millis(lease.command_timeout_ms.max(1000) as u64);
    let max_obs = lease.observation_max_chars.max(200) as usize;
    let beta = lease.beta.clamp(0.0, 1.0);
    // Trajectory-level mixing: the student acts for the first κ turns, the teacher after.
    let student_turns = lease.student_turns;
    let version = outcome.policy_version;

    let mut history: Vec<u32> = Vec::new();
    let system = render_system_prompt(&env.system_prompt, sandbox.repo_display());
    let mut delta = match tok.render_prompt(&system, &task.problem_statement) {
        Ok(ids) => ids,
        Err(e) => {
            outcome.status = OutcomeStatus::SandboxError as i32;
            outcome.error = format!("rendering the prompt with the chat template: {e}");
            drop(sandbox);
            return finish(env, lease, outcome, start);
        }
    };
    let mut steps: Vec<ExecutedStep> = Vec::new();
    let mut submitted = false;
    let mut turns = 0u32;

    for t in 0..lease.max_turns {
        if env.cancel.load(Ordering::SeqCst) {
            outcome.error = "worker shutting down".into();
            break;
        }
        history.extend_from_slice(&delta);

        // 1. The teacher labels this state, always.
        let teacher_reply = match teacher.next_action(&TeacherState {
            task: &task,
            system_prompt: &system,
            sandbox: sandbox.as_ref(),
            history: &steps,
            turn: t as usize,
            max_turns: lease.max_turns as usize,
        }) {
            Ok(r) => r,
            Err(e) => {
                outcome.status = OutcomeStatus::SandboxError as i32;
                outcome.error = e.to_string();
                break;
            }
        };
        let teacher_text = teacher_reply.text;
        let teacher_action = parse_action(&teacher_text);
        let teacher_tokens = tok.encode_assistant(&teacher_text);

        // 2. The student proposes, whenever it may be executed.
        let student_may_act = match student_turns {
            Some(kappa) => t < kappa,
            None => beta < 1.0,
        };
        let student = if student_may_act {
            let params = GenParams {
                temperature,
                // No truncation: the recorded log-probs are the policy's (RL needs them).
                top_p: 1.0,
                max_new_tokens: sampling.max_new_tokens.max(1) as usize,
                seed: sampling.seed.wrapping_add(t as u64),
                stop_token_ids: vec![im_end],
            };
            match env.student.generate_blocking(history.clone(), params) {
                Ok(g) => Some(g),
                Err(e) => {
                    outcome.status = OutcomeStatus::SandboxError as i32;
                    outcome.error = format!("student generation failed: {e:#}");
                    break;
                }
            }
        } else {
            None
        };
        let (student_tokens, student_logprobs, student_text, student_action) = match &student {
            Some(g) => {
                let text = tok.decode(&g.tokens);
                let action = parse_action(&text);
                (g.tokens.clone(), g.logprobs.clone(), text, Some(action))
            }
            None => (Vec::new(), Vec::new(), String::new(), None),
        };

        // 2b. On-policy distillation: the teacher scores the student's tokens.
        let mut teacher_logprobs_of_student = Vec::new();
        if lease.score_student && !student_tokens.is_empty() {
            let scored = match teacher.score(&history, &student_tokens) {
                Some(Ok(lps)) if lps.len() == student_tokens.len() => Ok(lps),
                Some(Ok(lps)) => Err(format!(
                    "the teacher scored {} of the student's {} tokens",
                    lps.len(),
                    student_tokens.len()
                )),
                Some(Err(e)) => Err(format!("the teacher could not score the student: {e}")),
                None => Err(format!(
                    "the lease asks for teacher log-probs of the student's tokens, which the \
                     {} teacher cannot give (use [worker.teacher] kind = \"endpoint\")",
                    teacher.name()
                )),
            };
            match scored {
                Ok(lps) => teacher_logprobs_of_student = lps,
                Err(e) => {
                    outcome.status = OutcomeStatus::SandboxError as i32;
                    outcome.error = e;
                    break;
                }
            }
        }

        // 3. Mix: the teacher's action with probability β (turn level), or the student's
        // within its κ turns (trajectory level).
        let teacher_executes =
            student.is_none() || (student_turns.is_none() && rng.gen::<f64>() < beta);
        let (executed_actor, executed_tokens, executed_action) = if teacher_executes {
            (Actor::Teacher, &teacher_tokens, &teacher_action)
        } else {
            (
                Actor::Student,
                &student_tokens,
                student_action.as_ref().expect("student generated"),
            )
        };
        let executed_text = if teacher_executes {
            teacher_text.clone()
        } else {
            student_text.clone()
        };
        let agreement = match (&teacher_action, &student_action) {
            (Ok(a), Some(Ok(b))) => a == b,
            _ => false,
        };

        // 4. Execute.
        let (command, observation, exit_code, timed_out) = match executed_action {
            Ok(Action::Submit) => {
                submitted = true;
                ("submit".to_string(), "Submitted.".to_string(), 0, false)
            }
            Ok(Action::Shell(cmd)) => {
                let out = sandbox.run(&crate::tools::prepare_command(cmd), timeout);
                let current = sandbox.current_file();
                let obs = format_observation(
                    &out.output,
                    out.exit_code,
                    out.timed_out,
                    &sandbox.cwd(),
                    current.as_deref(),
                    max_obs,
                );
                steps.push(ExecutedStep {
                    command: Some(cmd.clone()),
                    output: out.output,
                    exit_code: out.exit_code,
                    reply: executed_text.clone(),
                    observation: obs.clone(),
                });
                (cmd.clone(), obs, out.exit_code, out.timed_out)
            }
            Err(e) => {
                let current = sandbox.current_file();
                let obs = format_observation(
                    &e.to_string(),
                    1,
                    false,
                    &sandbox.cwd(),
                    current.as_deref(),
                    max_obs,
                );
                steps.push(ExecutedStep {
                    command: None,
                    output: e.to_string(),
                    exit_code: 1,
                    reply: executed_text.clone(),
                    observation: obs.clone(),
                });
                (String::new(), obs, 1, false)
            }
        };

        let record = TurnRecord {
            turn_index: t,
            context_delta_tokens: std::mem::take(&mut delta),
            teacher_tokens: teacher_tokens.clone(),
            teacher_text,
            teacher_format_error: teacher_action.is_err(),
            teacher_endpoint_logprobs: teacher_reply.logprobs,
            sampling_temperature: if student.is_some() { temperature } else { 0.0 },
            unbiased_sampling: student.is_some() && sampling.unbiased,
            student_tokens: student_tokens.clone(),
            student_logprobs,
            teacher_logprobs_of_student,
            student_text,
            student_format_error: matches!(student_action, Some(Err(_))),
            student_generated: student.is_some(),
            executed: executed_actor as i32,
            command,
            observation: observation.clone(),
            exit_code,
            timed_out,
            policy_version: version,
            agreement,
        };
        let executed_tokens = executed_tokens.clone();
        send(env, lease, episode_event::Event::Turn(record));
        turns = t + 1;
        history.extend_from_slice(&executed_tokens);
        if submitted {
            break;
        }
        // A message cut at max_new_tokens is closed here, as context, so the tokens the
        // student generated stay exactly as generated.
        if executed_tokens.last() != Some(&im_end) {
            delta.push(im_end);
        }
        match tok.render_observation(&observation) {
            Ok(ids) => delta.extend(ids),
            Err(e) => {
                outcome.status = OutcomeStatus::SandboxError as i32;
                outcome.error = format!("rendering the observation with the chat template: {e}");
                break;
            }
        }
    }

    outcome.num_turns = turns;
    outcome.submitted = submitted;
    let patch = sandbox.diff();
    drop(sandbox);
    if outcome.status != OutcomeStatus::SandboxError as i32 {
        let g = grade_fresh(
            &task,
            &patch,
            env.grade_timeout,
            &env.sandboxes,
            &format!("{}-grade", lease.episode_id),
        );
        outcome.status = g.status as i32;
        outcome.test_statuses = g.test_statuses.into_iter().collect();
    }
    outcome.patch = patch;
    finish(env, lease, outcome, start)
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
