//! The student's context within its budget: the prompt (system prompt and problem
//! statement) always whole, then per turn the executed message and the observation that
//! answered it. When the context outgrows the budget, the oldest observations are replaced
//! by a one-line note saying how much was elided (as SWE-agent collapses old
//! observations), keeping the prompt, every action and the most recent observations.
//!
//! What the student is given and what it is trained on are the same tokens: each turn is
//! recorded as the tokens added since the previous record (`context_delta_tokens`) or,
//! right after an elision, as the whole rebuilt context with `context_rebuilt` set, which
//! the coordinator's dataset builders take as a fresh history.

/// Observations kept whole when older ones are elided (the newest ones).
pub const KEEP_RECENT_OBSERVATIONS: usize = 3;

enum Part {
    /// Never elided: the prompt, an executed message, the turn end (`<|im_end|>`, ...)
    /// closing a message cut at `max_new_tokens`.
    Fixed(Vec<u32>),
    /// An observation as rendered, and the note that replaces it when elided.
    Observation {
        full: Vec<u32>,
        note: Vec<u32>,
        elided: bool,
    },
}

impl Part {
    fn tokens(&self) -> &[u32] {
        match self {
            Part::Fixed(t) => t,
            Part::Observation { full, note, elided } => {
                if *elided {
                    note
                } else {
                    full
                }
            }
        }
    }
}

/// One episode's context, turn by turn.
pub struct Context {
    parts: Vec<Part>,
    tokens: Vec<u32>,
    /// Most tokens the context may hold before a generation (the limit less the room for
    /// the reply); `usize::MAX`: no limit.
    budget: usize,
    /// `tokens[..known]` is what the coordinator has been sent (context deltas and
    /// executed messages), unless `rebuilt`.
    known: usize,
    /// An elision changed tokens the coordinator already has: the next record carries the
    /// whole context.
    rebuilt: bool,
    elided: usize,
}

impl Context {
    /// A context holding `prompt`, kept within `budget` tokens where eliding observations
    /// can do it.
    pub fn new(prompt: Vec<u32>, budget: usize) -> Self {
        let tokens = prompt.clone();
        Context {
            parts: vec![Part::Fixed(prompt)],
            tokens,
            budget: budget.max(1),
            known: 0,
            rebuilt: false,
            elided: 0,
        }
    }

    /// The context as the student is given it now.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Observations elided so far.
    pub fn elided(&self) -> usize {
        self.elided
    }

    /// What this turn's record carries: the tokens added since the last record, or the
    /// whole context with `true` when an elision rebuilt it. Marks them as sent.
    pub fn take_delta(&mut self) -> (Vec<u32>, bool) {
        let out = if self.rebuilt {
            (self.tokens.clone(), true)
        } else {
            (self.tokens[self.known..].to_vec(), false)
        };
        self.rebuilt = false;
        self.known = self.tokens.len();
        out
    }

    /// Appends the executed message (the record carries it: it counts as sent).
    pub fn push_executed(&mut self, tokens: &[u32]) {
        self.push(Part::Fixed(tokens.to_vec()));
        if !self.rebuilt {
            self.known = self.tokens.len();
        }
    }

    /// Appends context the next record carries: `close` (the turn end of a message cut
    /// at `max_new_tokens`, or nothing), then the rendered observation, with the note that
    /// stands for it once elided. Elides old observations if the budget needs it.
    pub fn push_observation(&mut self, close: Vec<u32>, full: Vec<u32>, note: Vec<u32>) {
        if !close.is_empty() {
            self.push(Part::Fixed(close));
        }
        self.push(Part::Observation {
            full,
            note,
            elided: false,
        });
        self.fit();
    }

    fn push(&mut self, part: Part) {
        self.tokens.extend_from_slice(part.tokens());
        self.parts.push(part);
    }

    /// Over the budget: elides observations oldest first, keeping the newest
    /// `KEEP_RECENT_OBSERVATIONS`, then all but the newest, down to three quarters of the
    /// budget (so that elisions, each of which makes the next record carry the whole
    /// context, come in batches rather than every turn). Whatever still does not fit is
    /// left to the model's cut (oldest tokens), which training applies alike.
    fn fit(&mut self) {
        if self.tokens.len() <= self.budget {
            return;
        }
        let target = self.budget - self.budget / 4;
        let mut len = self.tokens.len();
        let observations: Vec<usize> = (0..self.parts.len())
            .filter(|&i| matches!(self.parts[i], Part::Observation { .. }))
            .collect();
        let mut changed = false;
        for keep in [KEEP_RECENT_OBSERVATIONS, 1] {
            let elidable = observations.len().saturating_sub(keep);
            for &i in &observations[..elidable] {
                if len <= target {
                    break;
                }
                if let Part::Observation { full, note, elided } = &mut self.parts[i] {
                    if !*elided && note.len() < full.len() {
                        *elided = true;
                        len = len - full.len() + note.len();
                        self.elided += 1;
                        changed = true;
                    }
                }
            }
        }
        if changed {
            self.tokens = self
                .parts
                .iter()
                .flat_map(|p| p.tokens())
                .copied()
                .collect();
            self.rebuilt = true;
        }
    }
}

/// The note an elided observation becomes: what kind of output it was and how long.
pub fn elision_note(observation: &str) -> String {
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let lines = observation.lines().count();
    let chars = observation.chars().count();
    format!(
        "[output elided to keep the context short: {lines} line{}, {chars} character{}]",
        plural(lines),
        plural(chars)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays the records the way the coordinator does (`context_rebuilt` restarts the
    /// history) and returns the context rebuilt before each turn.
    fn replay(records: &[(Vec<u32>, bool, Vec<u32>)]) -> Vec<Vec<u32>> {
        let mut history = Vec::new();
        let mut out = Vec::new();
        for (delta, rebuilt, executed) in records {
            if *rebuilt {
                history.clear();
            }
            history.extend_from_slice(delta);
            out.push(history.clone());
            history.extend_from_slice(executed);
        }
        out
    }

    #[test]
    fn within_the_budget_nothing_changes() {
        let mut c = Context::new(vec![1, 2, 3], 100);
        assert_eq!(c.take_delta(), (vec![1, 2, 3], false));
        c.push_executed(&[10, 11]);
        c.push_observation(vec![99], vec![20, 21, 22], vec![5]);
        assert_eq!(c.take_delta(), (vec![99, 20, 21, 22], false));
        assert_eq!(c.tokens(), &[1, 2, 3, 10, 11, 99, 20, 21, 22]);
        assert_eq!(c.elided(), 0);
    }

    /// Past the budget the oldest observations become notes; the prompt, every action and
    /// the newest observations stay; the record after an elision is the whole context,
    /// flagged, and replaying the records gives exactly what the student was given.
    #[test]
    fn old_observations_are_elided_and_records_replay_to_the_student_context() {
        let prompt: Vec<u32> = (1000..1040).collect();
        let mut c = Context::new(prompt.clone(), 120);
        let mut records = Vec::new();
        let mut given = Vec::new();
        for turn in 0..8u32 {
            given.push(c.tokens().to_vec());
            let (delta, rebuilt) = c.take_delta();
            let action = vec![2000 + turn, 2100 + turn];
            c.push_executed(&action);
            records.push((delta, rebuilt, action));
            let obs: Vec<u32> = (0..25).map(|k| 3000 + turn * 100 + k).collect();
            c.push_observation(Vec::new(), obs, vec![9000 + turn]);
        }
        assert_eq!(replay(&records), given);
        assert!(records.iter().any(|r| r.1), "no record was rebuilt");
        assert!(c.elided() >= 3, "{}", c.elided());
        for ctx in &given {
            assert!(ctx.len() <= 120, "{} tokens", ctx.len());
            assert_eq!(&ctx[..40], &prompt[..], "the prompt is kept whole");
        }
        let last = c.tokens();
        // Every action is still there; the newest observations whole, the oldest a note.
        for turn in 0..8u32 {
            assert!(last.contains(&(2000 + turn)), "action {turn} lost");
        }
        assert!(last.contains(&(3000 + 7 * 100)) && last.contains(&(3000 + 7 * 100 + 24)));
        assert!(last.contains(&9000) && !last.contains(&3000));
    }

    /// Observations that cannot be elided enough (a huge newest one) leave the context
    /// over the budget: the model's cut of the oldest tokens applies then, as before.
    #[test]
    fn a_context_that_cannot_fit_is_left_over_budget() {
        let mut c = Context::new(vec![1; 10], 20);
        c.take_delta();
        c.push_executed(&[2]);
        c.push_observation(Vec::new(), vec![3; 50], vec![4]);
        // The only observation is the newest: kept.
        assert_eq!(c.tokens().len(), 61);
        let (delta, rebuilt) = c.take_delta();
        assert!(!rebuilt);
        assert_eq!(delta.len(), 50);
    }

    #[test]
    fn the_note_says_what_was_elided() {
        assert_eq!(
            elision_note("a\nb\nc"),
            "[output elided to keep the context short: 3 lines, 5 characters]"
        );
        assert_eq!(
            elision_note("x"),
            "[output elided to keep the context short: 1 line, 1 character]"
        );
    }
}
