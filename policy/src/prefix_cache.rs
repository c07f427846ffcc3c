//! The engine's cross-turn prefix cache: the keys and values of finished generations,
//! kept by their token ids so that a later prompt that starts with the same tokens (an
//! agent's next turn extends the previous turn's prompt and reply) prefills only what is
//! new. Entries are evicted least recently used first under a budget of tokens, and all
//! of them go when the weights change (keys and values belong to one set of weights).

use tch::Tensor;

/// One finished context: its tokens and, per layer, their keys and values
/// (`[kv_heads, len, head_dim]` each, post-rotary, as the cache holds them).
struct Entry {
    tokens: Vec<u32>,
    kv: Vec<(Tensor, Tensor)>,
    last_used: u64,
}

/// A reused prefix: the keys and values of a prompt's first `len` tokens.
pub(crate) struct Hit<'a> {
    pub(crate) len: usize,
    pub(crate) kv: &'a [(Tensor, Tensor)],
}

/// What the cache did since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens run through the model at admission.
    pub prefilled_tokens: u64,
    /// Prompt tokens whose keys and values came from the cache instead.
    pub reused_tokens: u64,
    /// Requests that reused a prefix.
    pub hits: u64,
    /// Requests admitted.
    pub requests: u64,
    /// Tokens of keys and values the cache holds now.
    pub cached_tokens: u64,
}

pub(crate) struct PrefixCache {
    entries: Vec<Entry>,
    /// Most tokens held over all entries (0: the cache is off).
    budget: usize,
    held: usize,
    clock: u64,
}

impl PrefixCache {
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            entries: Vec::new(),
            budget,
            held: 0,
            clock: 0,
        }
    }

    /// Whether a context of `len` tokens would be kept (so worth copying out).
    pub(crate) fn would_keep(&self, len: usize) -> bool {
        len > 0 && len <= self.budget
    }

    /// The longest cached prefix of `prompt`, leaving at least its last token to run
    /// (the model must produce the next-token logits). `None` when nothing is shared.
    pub(crate) fn lookup(&mut self, prompt: &[u32]) -> Option<Hit<'_>> {
        let most = prompt.len().saturating_sub(1);
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let shared = e
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (i, shared.min(most))
            })
            .max_by_key(|&(i, n)| (n, self.entries[i].last_used))?;
        if len == 0 {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        Some(Hit { len, kv: &e.kv })
    }

    /// Keeps a finished context. An entry that is a prefix of it is dropped (the new one
    /// covers it); then the least recently used go until the budget holds.
    pub(crate) fn insert(&mut self, tokens: Vec<u32>, kv: Vec<(Tensor, Tensor)>) {
        if !self.would_keep(tokens.len()) {
            return;
        }
        let mut held = self.held;
        self.entries.retain(|e| {
            let covered = e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens);
            if covered {
                held -= e.tokens.len();
            }
            !covered
        });
        self.clock += 1;
        held += tokens.len();
        self.entries.push(Entry {
            tokens,
            kv,
            last_used: self.clock,
        });
        while held > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("over budget with no entry");
            held -= self.entries.swap_remove(oldest).tokens.len();
        }
        self.held = held;
    }

    /// Forgets everything (new weights).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.held = 0;
    }

    /// Tokens held over all entries.
    pub(crate) fn held(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv() -> Vec<(Tensor, Tensor)> {
        Vec::new()
    }

    /// The longest shared prefix wins, never the whole prompt; a covered entry is
    /// replaced; the least recently used leaves first; clear empties it.
    #[test]
    fn lookup_insert_evict() {
        let mut c = PrefixCache::new(10);
        assert!(c.lookup(&[1, 2, 3]).is_none());
        c.insert(vec![1, 2, 3], kv());
        c.insert(vec![1, 2, 3, 4, 5], kv()); // covers [1, 2, 3]
        assert_eq!(c.held(), 5);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]).unwrap().len, 5);
        // The whole prompt is cached: its last token still runs.
        assert_eq!(c.lookup(&[1, 2, 3, 4]).unwrap().len, 3);
        assert!(c.lookup(&[9, 1, 2]).is_none());
        c.insert(vec![7, 8, 9], kv());
        assert_eq!(c.held(), 8);
        c.lookup(&[1, 2, 3, 4, 5, 6]); // [1..5] is now the most recent
        c.insert(vec![6, 6, 6], kv()); // 11 > 10: [7, 8, 9] goes
        assert_eq!(c.held(), 8);
        assert!(c.lookup(&[7, 8, 9, 1]).is_none());
        assert_eq!(c.lookup(&[1, 2, 9]).unwrap().len, 2);
        c.insert((0..11).collect(), kv()); // larger than the whole budget: not kept
        assert_eq!(c.held(), 8);
        c.clear();
        assert_eq!(c.held(), 0);
        assert!(c.lookup(&[1, 2, 3, 4]).is_none());
        let mut off = PrefixCache::new(0);
        off.insert(vec![1, 2], kv());
        assert!(off.lookup(&[1, 2, 3]).is_none());
    }
}
