//! One episode with turn-level mixing (DAgger): at every visited state the teacher
//! labels the best action; the student proposes its own; the executed action is the
//! teacher's with probability β, else the student's. Every turn is streamed as it
//! happens; tokens are kept exactly as generated.

use std::path::PathBuf;
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
use crate::grade::grade_in;
use crate::observation::format_observation;
use crate::sandbox::LocalSandbox;
use crate::student::StudentHost;
use crate::tasks::TaskRecord;
use crate::teacher::{ExecutedStep, OracleTeacher, Teacher, TeacherState};

/// The default system prompt: the tools and the action format.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a software engineer fixing an issue in the repository at \
~/repo (the current directory). Look at the code before you change it. Each reply is one short thought followed by exactly \
one command in a fenced block:\n```command\nTHE SHELL COMMAND\n```\nUse shell commands to read, search, edit \
and test (cat -n FILE, grep -rn TEXT ., sed -i, python -m pytest -q). When the fix is complete, reply with the \
command `submit`.";

/// What an episode needs from the worker around it.
#[derive(Clone)]
pub struct EpisodeEnv {
    pub worker_id: String,
    pub tokenizer: Arc<ChatTokenizer>,
    pub student: StudentHost,
    pub events: mpsc::Sender<EpisodeEvent>,
    pub system_prompt: String,
    pub sandbox_root: Option<PathBuf>,
    pub grade_timeout: Duration,
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
    let mut sandbox = match LocalSandbox::create(&task, env.sandbox_root.as_deref()) {
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
    let mut teacher = OracleTeacher::new();
    let sampling = lease.sampling.unwrap_or_default();
    let timeout = Duration::from_millis(lease.command_timeout_ms.max(1000) as u64);
    let max_obs = lease.observation_max_chars.max(200) as usize;
    let beta = lease.beta.clamp(0.0, 1.0);
    let version = outcome.policy_version;

    let mut history: Vec<u32> = Vec::new();
    let mut delta = tok.render_prompt(&env.system_prompt, &task.problem_statement);
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
        let teacher_text = teacher.next_action(&TeacherState {
            task: &task,
            sandbox: &sandbox,
            history: &steps,
            turn: t as usize,
            max_turns: lease.max_turns as usize,
        });
        let teacher_action = parse_action(&teacher_text);
        let teacher_tokens = tok.encode_assistant(&teacher_text);

        // 2. The student proposes, whenever it may be executed.
        let student = if beta < 1.0 {
            let params = GenParams {
                temperature: sampling.temperature,
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

        // 3. Mix: the teacher's action with probability β.
        let teacher_executes = student.is_none() || rng.gen::<f64>() < beta;
        let (executed_actor, executed_tokens, executed_action) = if teacher_executes {
            (Actor::Teacher, &teacher_tokens, &teacher_action)
        } else {
            (
                Actor::Student,
                &student_tokens,
                student_action.as_ref().expect("student generated"),
            )
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
                let out = sandbox.run(cmd, timeout);
                let obs = format_observation(
                    &out.output,
                    out.exit_code,
                    out.timed_out,
                    &sandbox.cwd(),
                    None,
                    max_obs,
                );
                steps.push(ExecutedStep {
                    command: Some(cmd.clone()),
                    output: out.output,
                    exit_code: out.exit_code,
                });
                (cmd.clone(), obs, out.exit_code, out.timed_out)
            }
            Err(e) => {
                let obs =
                    format_observation(&e.to_string(), 1, false, &sandbox.cwd(), None, max_obs);
                steps.push(ExecutedStep {
                    command: None,
                    output: e.to_string(),
                    exit_code: 1,
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
            student_tokens: student_tokens.clone(),
            student_logprobs,
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
        delta.extend(tok.render_observation(&observation));
    }

    outcome.num_turns = turns;
    outcome.submitted = submitted;
    let patch = sandbox.diff();
    drop(sandbox);
    if outcome.status != OutcomeStatus::SandboxError as i32 {
        let g = grade_in(
            &task,
            &patch,
            env.grade_timeout,
            env.sandbox_root.as_deref(),
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
