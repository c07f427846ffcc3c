//! Teachers: what labels a state with the action it would take.
//!
//! The [`Teacher`] trait, what a teacher sees ([`TeacherState`]) and answers
//! ([`TeacherReply`]), and the two kinds: the gold-patch [`OracleTeacher`] (`oracle`) and
//! the OpenAI-compatible [`EndpointTeacher`] (`endpoint`).

pub mod endpoint;
pub mod oracle;

pub use endpoint::{
    ChatEndpoint, EndpointConfigError, EndpointTeacher, TeacherConfig, TeacherKind,
};
pub use oracle::OracleTeacher;

use crate::sandbox::Sandbox;
use crate::tasks::TaskRecord;

/// One executed turn as teachers see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecutedStep {
    /// The shell command that ran; `None` when the reply was a format error.
    pub command: Option<String>,
    pub output: String,
    pub exit_code: i32,
    /// The assistant message that was executed (whoever wrote it).
    pub reply: String,
    /// The observation shown after it (output, notices, footer).
    pub observation: String,
}

/// A teacher's answer: the assistant message, and the log-probability of each of its
/// tokens when the teacher provides them (endpoints asked for `logprobs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TeacherReply {
    pub text: String,
    pub logprobs: Vec<f32>,
}

impl TeacherReply {
    pub fn text(text: String) -> Self {
        Self {
            text,
            logprobs: Vec::new(),
        }
    }
}

/// A teacher that could not answer (an endpoint that keeps failing). The episode ends
/// with SANDBOX_ERROR and this message; the worker carries on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("teacher: {0}")]
pub struct TeacherError(pub String);

/// What a teacher sees when asked for the next action.
pub struct TeacherState<'a> {
    pub task: &'a TaskRecord,
    /// The system prompt the student sees (rendered for this sandbox).
    pub system_prompt: &'a str,
    pub sandbox: &'a dyn Sandbox,
    /// Every executed turn so far, whoever acted.
    pub history: &'a [ExecutedStep],
    /// 0-based index of the turn being decided.
    pub turn: usize,
    pub max_turns: usize,
}

/// Something that returns the next assistant message (reasoning + one command block).
pub trait Teacher: Send {
    fn next_action(&mut self, state: &TeacherState<'_>) -> Result<TeacherReply, TeacherError>;
    fn name(&self) -> &str;
    /// The teacher's log-probability of each token of `continuation` after `prefix`
    /// (on-policy distillation). None: this teacher cannot score tokens (the oracle).
    fn score(
        &mut self,
        _prefix: &[u32],
        _continuation: &[u32],
    ) -> Option<Result<Vec<f32>, TeacherError>> {
        None
    }
}

/// Renders reasoning + one command block, with a fence longer than any backtick run that
/// starts a line of the command (heredocs may contain markdown).
pub fn format_reply(reason: &str, command: &str) -> String {
    let longest = command
        .lines()
        .map(|l| l.trim_start().bytes().take_while(|&b| b == b'`').count())
        .max()
        .unwrap_or(0);
    let fence = "`".repeat((longest + 1).max(3));
    format!("{reason}\n\n{fence}command\n{command}\n{fence}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_fence_outgrows_backticks_in_the_command() {
        let r = format_reply("x", "cat > a.md <<'EOF'\n```\ncode\n```\nEOF");
        match crate::action::parse_action(&r).unwrap() {
            crate::action::Action::Shell(c) => assert!(c.contains("```\ncode")),
            other => panic!("{other:?}"),
        }
    }
}
