//! Prefix-shared DAgger rows: one trajectory and all its teacher labels in one row.
//!
//! The DAgger examples of a trajectory (`tutor_coordinator::dataset::dagger_examples`)
//! are context h_t + teacher label y*_t for every labelled turn t. Every h_t is a prefix
//! of the executed trajectory, so as separate sequences a trajectory of T turns costs
//! O(T × context) tokens. A [`PackedRow`] lays the executed trajectory out once (the
//! trunk) and attaches each label where it belongs:
//! - where the executed action *is* the teacher's label (the teacher acted), the label is
//!   the trunk's own continuation and is trained in place (loss mask on those tokens);
//! - where it is not (the student acted), the label is a branch: extra slots that attend
//!   to the trunk up to the end of h_t and to themselves causally; nothing attends to a
//!   branch.
//!
//! Every slot records its RoPE position (its index in the plain example) and its parent
//! (the slot of the previous token of its sequence). A query attends exactly to its
//! ancestors and itself ([`PackedRow::allowed_mask`]), and label token j is predicted from
//! the logits at its parent slot, so the row computes exactly the per-token losses of the
//! separate examples: tokens processed = trajectory tokens + branch label tokens.
//!
//! Turns whose example `dagger_examples` cuts (context + label longer than
//! `max_seq_len`: the oldest context tokens are dropped, so positions no longer match the
//! trunk) are appended to the row as separate chains with their own positions, so the
//! (context, label) pairs of a row are always exactly those of `dagger_examples`.

use tch::{Device, Tensor};
use tutor_proto::{Actor, TurnRecord};

/// One trajectory with its labels, as a tree of token sequences in one row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackedRow {
    pub tokens: Vec<u32>,
    /// RoPE position of each slot: the token's index in the plain example it belongs to.
    pub positions: Vec<u32>,
    /// Slot of the previous token of the same sequence; `None` for a sequence's first
    /// token. Always smaller than the slot itself.
    pub parent: Vec<Option<u32>>,
    /// True on label tokens (each predicted from the logits at its parent slot).
    pub loss_mask: Vec<bool>,
    /// The labels represented, in turn order.
    pub labels: Vec<LabelSpan>,
    /// Slots holding the executed trajectory (the trunk), branch labels, and separate
    /// (cut) examples: `tokens.len()` is their sum.
    pub trunk_tokens: usize,
    pub branch_tokens: usize,
    pub separate_tokens: usize,
}

/// Where one turn's teacher label lies in a [`PackedRow`]: slots `start .. start + len`
/// (contiguous), each the parent of the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelSpan {
    pub turn_index: u32,
    pub start: usize,
    pub len: usize,
    pub kind: LabelKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelKind {
    /// The executed continuation (trained on the trunk).
    InPlace,
    /// A branch off the trunk at the end of h_t.
    Branch,
    /// A whole separate example (its context was cut to `max_seq_len`).
    Separate,
}

struct Branch {
    /// Number of trunk tokens in its context (h_t).
    fork: usize,
    turn_index: u32,
    label: Vec<u32>,
}

/// Packs one episode's turns (sorted by turn index) into one row representing exactly the
/// (context, label) examples `dagger_examples(_, turns, max_seq_len)` builds: format-error
/// and empty teacher labels are skipped, and examples longer than `max_seq_len` are cut the
/// same way (and stored as separate chains). The trunk ends where the last label needs it;
/// executed tokens after that are not laid out.
pub fn pack_trajectory(turns: &[TurnRecord], max_seq_len: usize) -> PackedRow {
    let mut history: Vec<u32> = Vec::new();
    let mut in_place: Vec<(usize, usize, u32)> = Vec::new(); // (start, len, turn)
    let mut branches: Vec<Branch> = Vec::new();
    let mut separate: Vec<(u32, Vec<u32>, usize)> = Vec::new(); // (turn, tokens, ctx len)
    let mut trunk_len = 0usize;
    for t in turns {
        history.extend_from_slice(&t.context_delta_tokens);
        let executed = if t.executed == Actor::Student as i32 {
            &t.student_tokens
        } else {
            &t.teacher_tokens
        };
        if !t.teacher_format_error && !t.teacher_tokens.is_empty() {
            let label = &t.teacher_tokens;
            if history.len() + label.len() <= max_seq_len {
                let h = history.len();
                if executed == label {
                    in_place.push((h, label.len(), t.turn_index));
                    trunk_len = trunk_len.max(h + label.len());
                } else {
                    branches.push(Branch {
                        fork: h,
                        turn_index: t.turn_index,
                        label: label.clone(),
                    });
                    trunk_len = trunk_len.max(h);
                }
            } else {
                // The same cut as `dagger_examples`.
                let room = max_seq_len.saturating_sub(label.len()).max(1);
                let ctx = &history[history.len().saturating_sub(room)..];
                let label = &label[..label
                    .len()
                    .min(max_seq_len.saturating_sub(ctx.len()).max(1))];
                let mut tokens = ctx.to_vec();
                tokens.extend_from_slice(label);
                separate.push((t.turn_index, tokens, ctx.len()));
            }
        }
        history.extend_from_slice(executed);
    }

    let mut row = PackedRow {
        trunk_tokens: trunk_len,
        ..Default::default()
    };
    let mut trunk_mask = vec![false; trunk_len];
    for &(start, len, _) in &in_place {
        trunk_mask[start..start + len].fill(true);
    }
    // Slot of each trunk token; branches are laid out right after their fork point.
    let mut trunk_slot: Vec<u32> = Vec::with_capacity(trunk_len);
    let mut next_branch = branches.iter().peekable();
    let mut spans: Vec<LabelSpan> = Vec::new();
    for k in 0..=trunk_len {
        while let Some(b) = next_branch.next_if(|b| b.fork == k) {
            let parent = k.checked_sub(1).map(|p| trunk_slot[p]);
            let start = row.tokens.len();
            row.push_chain(&b.label, k, parent, |_| true);
            row.branch_tokens += b.label.len();
            spans.push(LabelSpan {
                turn_index: b.turn_index,
                start,
                len: b.label.len(),
                kind: LabelKind::Branch,
            });
        }
        if k == trunk_len {
            break;
        }
        let parent = k.checked_sub(1).map(|p| trunk_slot[p]);
        trunk_slot.push(row.tokens.len() as u32);
        row.push_chain(&history[k..k + 1], k, parent, |_| trunk_mask[k]);
    }
    for &(start, len, turn_index) in &in_place {
        spans.push(LabelSpan {
            turn_index,
            start: trunk_slot[start] as usize,
            len,
            kind: LabelKind::InPlace,
        });
    }
    for (turn_index, tokens, ctx_len) in &separate {
        let start = row.tokens.len();
        row.push_chain(tokens, 0, None, |i| i >= *ctx_len);
        row.separate_tokens += tokens.len();
        spans.push(LabelSpan {
            turn_index: *turn_index,
            start: start + ctx_len,
            len: tokens.len() - ctx_len,
            kind: LabelKind::Separate,
        });
    }
    spans.sort_by_key(|s| s.turn_index);
    row.labels = spans;
    row
}

impl PackedRow {
    /// Appends `tokens` as a chain: the first token's parent is `parent`, its position
    /// `first_position`; `label(i)` says whether token i is a label token.
    fn push_chain(
        &mut self,
        tokens: &[u32],
        first_position: usize,
        parent: Option<u32>,
        label: impl Fn(usize) -> bool,
    ) {
        let mut parent = parent;
        for (i, &tok) in tokens.iter().enumerate() {
            let slot = self.tokens.len() as u32;
            self.tokens.push(tok);
            self.positions.push((first_position + i) as u32);
            self.parent.push(parent);
            self.loss_mask.push(label(i));
            parent = Some(slot);
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Label tokens that are predicted (those with a parent), as `PaddedBatch` counts them.
    pub fn label_tokens(&self) -> usize {
        self.loss_mask
            .iter()
            .zip(&self.parent)
            .filter(|(m, p)| **m && p.is_some())
            .count()
    }

    /// The `[L, L]` attention structure, row-major: `allowed[i * L + j]` is true where slot
    /// `i` may attend slot `j`, i.e. `j` is `i` or one of its ancestors.
    pub fn allowed_mask(&self) -> Vec<bool> {
        let l = self.len();
        let mut allowed = vec![false; l * l];
        for i in 0..l {
            if let Some(p) = self.parent[i] {
                let p = p as usize;
                debug_assert!(p < i, "a parent precedes its child");
                allowed.copy_within(p * l..p * l + p + 1, i * l);
            }
            allowed[i * l + i] = true;
        }
        allowed
    }

    /// The plain example behind each label, in turn order: (turn index, tokens, loss
    /// mask), rebuilt by walking parents from the label's last slot.
    pub fn examples(&self) -> Vec<(u32, Vec<u32>, Vec<bool>)> {
        self.labels
            .iter()
            .map(|s| {
                let mut slots = Vec::new();
                let mut cur = Some((s.start + s.len - 1) as u32);
                while let Some(c) = cur {
                    slots.push(c as usize);
                    cur = self.parent[c as usize];
                }
                slots.reverse();
                let tokens = slots.iter().map(|&i| self.tokens[i]).collect();
                let mask = slots
                    .iter()
                    .map(|&i| i >= s.start && i < s.start + s.len)
                    .collect();
                (s.turn_index, tokens, mask)
            })
            .collect()
    }
}

/// Packs plain examples (tokens, loss mask) into tree rows for `Policy::forward_tree`:
/// examples that share a prefix share its slots (a trie), so the DAgger examples of one
/// trajectory cost about its tokens plus the labels that branch off, whatever the batch
/// order; examples that share nothing sit side by side in a row with attention kept
/// inside each and positions restarting at 0 (sequence packing). Every label token of
/// every example keeps its own slot with exactly its own prefix as ancestors, so the
/// summed loss (and its gradient) equals that of the examples run separately; a label
/// token that would land on a slot already carrying a label (a duplicate example) gets a
/// slot of its own rather than being counted once.
///
/// Rows hold at most `row_tokens` slots, except a tree that is larger on its own (it gets
/// a row to itself). Tree order follows the first example of each tree.
pub fn pack_examples(examples: &[(Vec<u32>, Vec<bool>)], row_tokens: usize) -> Vec<PackedRow> {
    // The trie: node = (token, depth, parent, is label); children by token, with the
    // child that is still free of a label looked up first.
    struct Node {
        token: u32,
        depth: u32,
        parent: Option<usize>,
        label: bool,
        children: Vec<usize>,
    }
    let mut nodes: Vec<Node> = Vec::new();
    let mut roots: Vec<usize> = Vec::new();
    for (tokens, mask) in examples {
        let mut cur: Option<usize> = None;
        for (j, &t) in tokens.iter().enumerate() {
            // As `PaddedBatch`: the first token is never a label (nothing predicts it).
            let label = j > 0 && mask.get(j).copied().unwrap_or(false);
            let siblings = match cur {
                Some(c) => &nodes[c].children,
                None => &roots,
            };
            let found = siblings
                .iter()
                .copied()
                .find(|&n| nodes[n].token == t && !(label && nodes[n].label));
            let n = match found {
                Some(n) => {
                    nodes[n].label |= label;
                    n
                }
                None => {
                    let n = nodes.len();
                    nodes.push(Node {
                        token: t,
                        depth: j as u32,
                        parent: cur,
                        label,
                        children: Vec::new(),
                    });
                    match cur {
                        Some(c) => nodes[c].children.push(n),
                        None => roots.push(n),
                    }
                    n
                }
            };
            cur = Some(n);
        }
    }
    // Each root's tree in depth-first order (a parent before its children).
    let trees: Vec<Vec<usize>> = roots
        .iter()
        .map(|&r| {
            let mut order = Vec::new();
            let mut stack = vec![r];
            while let Some(n) = stack.pop() {
                order.push(n);
                stack.extend(nodes[n].children.iter().rev());
            }
            order
        })
        .collect();
    // First fit, in tree order.
    let mut rows: Vec<PackedRow> = Vec::new();
    let mut slot_of = vec![0u32; nodes.len()];
    for tree in trees {
        let fits = |r: &PackedRow| r.len() + tree.len() <= row_tokens;
        let row = match rows.iter().position(fits) {
            Some(i) => &mut rows[i],
            None => {
                rows.push(PackedRow::default());
                rows.last_mut().expect("just pushed")
            }
        };
        for &n in &tree {
            let node = &nodes[n];
            slot_of[n] = row.tokens.len() as u32;
            row.tokens.push(node.token);
            row.positions.push(node.depth);
            row.parent.push(node.parent.map(|p| slot_of[p]));
            row.loss_mask.push(node.label);
        }
        row.separate_tokens += tree.len();
    }
    rows
}

/// Packed rows ready for `Policy::forward_tree`: right-padded ids and positions, the
/// `[B, L, L]` attention structure, and the (slot to predict from, target) pairs of the
/// label tokens.
pub struct PackedBatch {
    pub input_ids: Tensor,
    pub position_ids: Tensor,
    pub allowed: Tensor,
    /// `[N]` flat index `b * L + parent slot` of each label token's prediction.
    pub pred_index: Tensor,
    /// `[N]` the label tokens.
    pub targets: Tensor,
    pub label_tokens: u64,
}

impl PackedBatch {
    pub fn new(rows: &[PackedRow], device: Device) -> Self {
        let l = rows.iter().map(|r| r.len()).max().unwrap_or(0).max(1);
        let n = rows.len();
        let mut ids = vec![0i64; n * l];
        let mut pos = vec![0i64; n * l];
        let mut allowed = vec![false; n * l * l];
        let mut pred = Vec::new();
        let mut targets = Vec::new();
        for (b, row) in rows.iter().enumerate() {
            let m = row.len();
            let mask = row.allowed_mask();
            for i in 0..m {
                ids[b * l + i] = row.tokens[i] as i64;
                pos[b * l + i] = row.positions[i] as i64;
                let dst = (b * l + i) * l;
                allowed[dst..dst + m].copy_from_slice(&mask[i * m..(i + 1) * m]);
                if let (true, Some(p)) = (row.loss_mask[i], row.parent[i]) {
                    pred.push((b * l) as i64 + p as i64);
                    targets.push(row.tokens[i] as i64);
                }
            }
            for i in m..l {
                allowed[(b * l + i) * l + i] = true; // padding sees itself only
            }
        }
        let (n, l) = (n as i64, l as i64);
        Self {
            input_ids: Tensor::from_slice(&ids).reshape([n, l]).to(device),
            position_ids: Tensor::from_slice(&pos).reshape([n, l]).to(device),
            allowed: Tensor::from_slice(&allowed).reshape([n, l, l]).to(device),
            pred_index: Tensor::from_slice(&pred).to(device),
            targets: Tensor::from_slice(&targets).to(device),
            label_tokens: targets.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{masked_cross_entropy, packed_nll_sum, PaddedBatch};
    use rand::{Rng, SeedableRng};
    use tch::Kind;
    use tutor_coordinator::dataset::dagger_examples;
    use tutor_policy::{ModelConfig, Policy};

    fn turn(
        i: u32,
        delta: &[u32],
        teacher: &[u32],
        student: &[u32],
        executed: Actor,
    ) -> TurnRecord {
        TurnRecord {
            turn_index: i,
            context_delta_tokens: delta.to_vec(),
            teacher_tokens: teacher.to_vec(),
            student_tokens: student.to_vec(),
            executed: executed as i32,
            ..Default::default()
        }
    }

    /// A seeded trajectory: prompt, then turns alternating at random between teacher and
    /// student execution, one teacher format error, ending with a teacher turn.
    fn random_turns(seed: u64, n: usize, vocab: u32) -> Vec<TurnRecord> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let toks = |rng: &mut rand_chacha::ChaCha8Rng, lo: usize, hi: usize| {
            let len = rng.gen_range(lo..=hi);
            (0..len)
                .map(|_| rng.gen_range(1..vocab))
                .collect::<Vec<u32>>()
        };
        (0..n)
            .map(|i| {
                let delta = if i == 0 {
                    toks(&mut rng, 8, 12)
                } else {
                    toks(&mut rng, 3, 6)
                };
                let teacher = toks(&mut rng, 2, 5);
                let student = toks(&mut rng, 1, 5);
                let actor = if i + 1 == n || rng.gen_bool(0.4) {
                    Actor::Teacher
                } else {
                    Actor::Student
                };
                let mut t = turn(i as u32, &delta, &teacher, &student, actor);
                t.teacher_format_error = i == 2;
                t.student_format_error = rng.gen_bool(0.2);
                t
            })
            .collect()
    }

    fn naive(turns: &[TurnRecord], max_seq_len: usize) -> Vec<(u32, Vec<u32>, Vec<bool>)> {
        dagger_examples("e", turns, max_seq_len)
            .into_iter()
            .map(|e| (e.turn_index, e.tokens, e.loss_mask))
            .collect()
    }

    #[test]
    fn packed_rows_represent_exactly_the_dagger_examples() {
        let turns = vec![
            turn(0, &[1, 2, 3], &[10, 11], &[20], Actor::Student),
            turn(1, &[4], &[12, 13], &[21, 22], Actor::Teacher),
            turn(2, &[5], &[14], &[], Actor::Teacher),
        ];
        let row = pack_trajectory(&turns, 100);
        // Trunk 1 2 3 | branch 10 11 | 20 4 12 13 5 14.
        assert_eq!(row.tokens, vec![1, 2, 3, 10, 11, 20, 4, 12, 13, 5, 14]);
        assert_eq!(row.positions, vec![0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8]);
        let parent: Vec<Option<u32>> = vec![
            None,
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            Some(2),
            Some(5),
            Some(6),
            Some(7),
            Some(8),
            Some(9),
        ];
        assert_eq!(row.parent, parent);
        let (f, t) = (false, true);
        assert_eq!(row.loss_mask, vec![f, f, f, t, t, f, f, t, t, f, t]);
        assert_eq!((row.trunk_tokens, row.branch_tokens), (9, 2));
        assert_eq!(row.label_tokens(), 5);
        assert_eq!(row.examples(), naive(&turns, 100));
        // Slot 5 (20, the executed student reply) sees the prompt, not the branch.
        let m = row.allowed_mask();
        let seen: Vec<usize> = (0..11).filter(|&j| m[5 * 11 + j]).collect();
        assert_eq!(seen, vec![0, 1, 2, 5]);
        let seen: Vec<usize> = (0..11).filter(|&j| m[4 * 11 + j]).collect();
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);

        for seed in 0..20 {
            let turns = random_turns(seed, 7, 50);
            for max in [1000, 30, 12, 5] {
                let row = pack_trajectory(&turns, max);
                assert_eq!(row.examples(), naive(&turns, max), "seed {seed} max {max}");
                assert!(row.positions.iter().all(|&p| (p as usize) < max));
            }
        }
    }

    #[test]
    fn packed_row_has_trajectory_plus_branch_label_tokens() {
        for seed in 0..10 {
            let turns = random_turns(seed, 8, 50);
            let row = pack_trajectory(&turns, 100_000);
            let trajectory: usize = turns
                .iter()
                .map(|t| {
                    let executed = if t.executed == Actor::Student as i32 {
                        &t.student_tokens
                    } else {
                        &t.teacher_tokens
                    };
                    t.context_delta_tokens.len() + executed.len()
                })
                .sum();
            let branch_labels: usize = turns
                .iter()
                .filter(|t| {
                    t.executed == Actor::Student as i32
                        && !t.teacher_format_error
                        && t.student_tokens != t.teacher_tokens
                })
                .map(|t| t.teacher_tokens.len())
                .sum();
            assert_eq!(row.len(), trajectory + branch_labels, "seed {seed}");
            assert_eq!(row.trunk_tokens, trajectory);
            assert_eq!(row.branch_tokens, branch_labels);
            assert_eq!(row.separate_tokens, 0);
            let naive_tokens: usize = naive(&turns, 100_000).iter().map(|e| e.1.len()).sum();
            assert!(row.len() < naive_tokens);
        }
    }

    fn tiny_policy(seed: i64) -> Policy {
        let mut c = ModelConfig::tiny(64);
        c.hidden_size = 32;
        c.intermediate_size = 64;
        c.head_dim = 8;
        c.max_position_embeddings = 256;
        let mut p = Policy::new(c, Device::Cpu, seed);
        p.var_store_mut().double();
        p
    }

    /// Label-token NLL sum and every parameter's gradient.
    fn loss_and_grads(p: &Policy, f: impl Fn(&Policy) -> Tensor) -> (f64, Vec<(String, Tensor)>) {
        let vars = p.var_store().variables();
        for v in vars.values() {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let loss = f(p);
        loss.backward();
        let mut grads: Vec<(String, Tensor)> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.grad().copy()))
            .collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        (loss.double_value(&[]), grads)
    }

    fn naive_loss(p: &Policy, turns: &[TurnRecord], max: usize) -> Tensor {
        let ex: Vec<(Vec<u32>, Vec<bool>)> =
            naive(turns, max).into_iter().map(|e| (e.1, e.2)).collect();
        let b = PaddedBatch::new(&ex, Device::Cpu);
        let logits = p.forward(&b.input_ids, &b.attention_mask);
        masked_cross_entropy(&logits, &b.input_ids, &b.loss_mask) * b.label_tokens as f64
    }

    fn packed_loss(p: &Policy, rows: &[PackedRow]) -> Tensor {
        let b = PackedBatch::new(rows, Device::Cpu);
        let logits = p.forward_tree(&b.input_ids, &b.position_ids, &b.allowed);
        packed_nll_sum(&logits, &b)
    }

    /// Largest |a - b| over the loss and all gradient entries, relative to the scale.
    fn max_diff(a: &(f64, Vec<(String, Tensor)>), b: &(f64, Vec<(String, Tensor)>)) -> f64 {
        let mut worst = (a.0 - b.0).abs() / b.0.abs().max(1.0);
        assert_eq!(a.1.len(), b.1.len());
        for ((na, ga), (nb, gb)) in a.1.iter().zip(&b.1) {
            assert_eq!(na, nb);
            let scale = gb.abs().max().double_value(&[]).max(1e-3);
            let d = (ga - gb).abs().max().double_value(&[]) / scale;
            worst = worst.max(d);
        }
        worst
    }

    #[test]
    fn packed_loss_and_gradients_equal_the_naive_examples() {
        let p = tiny_policy(11);
        let turns = random_turns(3, 6, 64);
        let executed_by_student = turns
            .iter()
            .filter(|t| t.executed == Actor::Student as i32)
            .count();
        assert!((2..=4).contains(&executed_by_student));
        let naive = loss_and_grads(&p, |p| naive_loss(p, &turns, 1000));
        let row = pack_trajectory(&turns, 1000);
        assert!(row.branch_tokens > 0);
        let packed = loss_and_grads(&p, |p| packed_loss(p, std::slice::from_ref(&row)));
        assert!(naive.0 > 10.0, "a real loss: {}", naive.0);
        let d = max_diff(&packed, &naive);
        eprintln!(
            "loss {} vs {}: max relative difference {d:e}",
            packed.0, naive.0
        );
        assert!(d < 1e-6, "packed vs naive differ by {d}");

        // Two rows in one batch (padding), one with cut examples: still equal.
        let other = random_turns(4, 6, 64);
        let naive2 = loss_and_grads(&p, |p| {
            naive_loss(p, &turns, 1000) + naive_loss(p, &other, 20)
        });
        let rows = [pack_trajectory(&turns, 1000), pack_trajectory(&other, 20)];
        assert!(rows[1].separate_tokens > 0);
        let packed2 = loss_and_grads(&p, |p| packed_loss(p, &rows));
        let d = max_diff(&packed2, &naive2);
        assert!(d < 1e-6, "two packed rows vs naive differ by {d}");

        // The comparison can fail: branches seeing each other (a plain causal mask over
        // the row), or slot indices as positions, change the loss and the gradients.
        let b = PackedBatch::new(std::slice::from_ref(&row), Device::Cpu);
        let l = row.len() as i64;
        let causal = Tensor::ones([l, l], (Kind::Bool, Device::Cpu))
            .tril(0)
            .unsqueeze(0);
        let wrong_mask = loss_and_grads(&p, |p| {
            packed_nll_sum(&p.forward_tree(&b.input_ids, &b.position_ids, &causal), &b)
        });
        let d_mask = max_diff(&wrong_mask, &naive);
        assert!(d_mask > 1e-3, "{d_mask}");
        let slots = Tensor::arange(l, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let wrong_pos = loss_and_grads(&p, |p| {
            packed_nll_sum(&p.forward_tree(&b.input_ids, &slots, &b.allowed), &b)
        });
        let d_pos = max_diff(&wrong_pos, &naive);
        assert!(d_pos > 1e-3, "{d_pos}");
        eprintln!("controls: causal mask {d_mask:e}, slot positions {d_pos:e}");
    }
}
