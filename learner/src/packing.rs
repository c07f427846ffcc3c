//! Prefix-shared DAgger rows and sequence packing: examples as trees of token sequences.
//!
//! The DAgger examples of a trajectory (`tutor_coordinator::dataset::dagger_examples`)
//! are context h_t + teacher label y*_t for every labelled turn t. Every h_t is a prefix
//! of the executed trajectory, so as separate sequences a trajectory of T turns costs
//! O(T × context) tokens. [`pack_examples`] lays examples out as a trie: a prefix that
//! several examples share gets one slot, so one trajectory's examples cost about its
//! executed tokens (up to the last label) plus the label tokens that branch off it.
//!
//! Every slot records its RoPE position (its index in the plain example) and its parent
//! (the slot of the previous token of its sequence). A query attends exactly to its
//! ancestors and itself ([`PackedRow::allowed_mask`]), and label token j is predicted from
//! the logits at its parent slot, so a row computes exactly the per-token losses of the
//! separate examples.

use tch::{Device, Tensor};

/// Examples as trees of token sequences in one row.
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
}

impl PackedRow {
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

/// `pack_trunks`'s branch depth for training: a branch off a trunk at most this many
/// tokens deep (a teacher label is at most `max_new_tokens` plus its end token) is
/// computed in the trunk's row, attending under an explicit mask; a deeper one (another
/// trajectory, or a context the worker rebuilt) gets a row and a causal trunk of its
/// own, repeating the prefix it shares.
pub const TRUNK_BRANCH_DEPTH: usize = 256;

/// Examples as one trunk (a plain causal sequence) and the tokens that branch off it,
/// for `Policy::forward_trunk`. Every predicted token of the examples is owned by
/// exactly one slot of one row: `label_weight` and `context_weight` say how many
/// examples predict it as a label and as context. A prefix repeated at the start of a
/// row (shared with a trunk computed in another row) owns nothing there.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrunkRow {
    pub tokens: Vec<u32>,
    /// RoPE position: the token's index in the plain examples it belongs to.
    pub positions: Vec<u32>,
    /// Slot of the previous token; `None` for a first token. Trunk slot `i > 0` has
    /// parent `i - 1`; every parent precedes its child.
    pub parent: Vec<Option<u32>>,
    /// Slots `0 .. trunk` are the trunk.
    pub trunk: usize,
    /// Per slot: how many examples have this token (predicted from its parent) as a
    /// label, and as a context token (not a label, not the first token).
    pub label_weight: Vec<u32>,
    pub context_weight: Vec<u32>,
}

impl TrunkRow {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The label tokens this row trains (with multiplicity), as `PaddedBatch` counts them.
    pub fn label_tokens(&self) -> u64 {
        self.label_weight.iter().map(|&w| w as u64).sum()
    }

    /// The context tokens this row trains (with multiplicity).
    pub fn context_tokens(&self) -> u64 {
        self.context_weight.iter().map(|&w| w as u64).sum()
    }

    /// The `[S - trunk, S]` attention rows of the branch slots, row-major: slot
    /// `trunk + i` may attend slot `j` where `j` is it or one of its ancestors.
    pub fn branch_mask(&self) -> Vec<bool> {
        let (s, t) = (self.len(), self.trunk);
        let mut allowed = vec![false; (s - t) * s];
        for i in t..s {
            let row = (i - t) * s;
            let mut j = Some(i as u32);
            while let Some(k) = j {
                let k = k as usize;
                if k < t {
                    // The trunk is a chain: every trunk slot up to k is an ancestor.
                    allowed[row..row + k + 1].fill(true);
                    break;
                }
                allowed[row + k] = true;
                j = self.parent[k];
            }
        }
        allowed
    }
}

/// Lays examples (tokens, loss mask) out as trunk rows: a trie over their token
/// sequences, cut into rows along its longest paths. A row's trunk is one root-to-leaf
/// path (a trajectory's executed tokens up to its last label); the subtrees off it at
/// most `branch_depth` tokens deep (the teacher labels where the student acted) are its
/// branches; a deeper subtree becomes a row of its own whose trunk starts with the
/// prefix it shares (computed again there, trained once). So one trajectory's DAgger
/// examples cost its tokens once plus their labels, with the trunk's attention under the
/// fused causal kernel, and the weighted per-token losses of the rows sum to those of
/// the examples run separately.
pub fn pack_trunks(examples: &[(Vec<u32>, Vec<bool>)], branch_depth: usize) -> Vec<TrunkRow> {
    struct Node {
        token: u32,
        depth: u32,
        parent: Option<usize>,
        children: Vec<usize>,
        label: u32,
        context: u32,
        height: usize,
    }
    let mut nodes: Vec<Node> = Vec::new();
    let mut roots: Vec<usize> = Vec::new();
    let mut index: std::collections::HashMap<(usize, u32), usize> = Default::default();
    for (tokens, mask) in examples {
        let mut cur: Option<usize> = None;
        for (j, &t) in tokens.iter().enumerate() {
            let key = (cur.unwrap_or(usize::MAX), t);
            let n = match index.get(&key) {
                Some(&n) => n,
                None => {
                    let n = nodes.len();
                    nodes.push(Node {
                        token: t,
                        depth: j as u32,
                        parent: cur,
                        children: Vec::new(),
                        label: 0,
                        context: 0,
                        height: 1,
                    });
                    match cur {
                        Some(c) => nodes[c].children.push(n),
                        None => roots.push(n),
                    }
                    index.insert(key, n);
                    n
                }
            };
            // As `PaddedBatch`: the first token is predicted from nothing.
            if j > 0 {
                if mask.get(j).copied().unwrap_or(false) {
                    nodes[n].label += 1;
                } else {
                    nodes[n].context += 1;
                }
            }
            cur = Some(n);
        }
    }
    // Children are created after their parents: heights bottom-up in reverse order.
    for n in (0..nodes.len()).rev() {
        if let Some(p) = nodes[n].parent {
            nodes[p].height = nodes[p].height.max(nodes[n].height + 1);
        }
    }
    let heavy = |n: usize| -> Option<usize> {
        let mut best: Option<usize> = None;
        for &c in &nodes[n].children {
            if best.is_none_or(|b| nodes[c].height > nodes[b].height) {
                best = Some(c);
            }
        }
        best
    };
    let mut rows = Vec::new();
    let mut slot_of = vec![0u32; nodes.len()];
    // (the repeated prefix: its nodes, root first; the node the owned trunk starts at)
    let mut work: Vec<(Vec<usize>, usize)> = roots.iter().rev().map(|&r| (Vec::new(), r)).collect();
    while let Some((prefix, start)) = work.pop() {
        let mut trunk = prefix.clone();
        let mut cur = Some(start);
        while let Some(n) = cur {
            trunk.push(n);
            cur = heavy(n);
        }
        let mut row = TrunkRow {
            trunk: trunk.len(),
            ..Default::default()
        };
        // Slots of this row's nodes (a node repeated in a later row's prefix gets that
        // row's slot when it is laid out there).
        let push = |row: &mut TrunkRow,
                    slot_of: &mut [u32],
                    n: usize,
                    parent: Option<u32>,
                    owned: bool| {
            let node = &nodes[n];
            slot_of[n] = row.tokens.len() as u32;
            row.tokens.push(node.token);
            row.positions.push(node.depth);
            row.parent.push(parent);
            row.label_weight.push(if owned { node.label } else { 0 });
            row.context_weight
                .push(if owned { node.context } else { 0 });
        };
        for (i, &n) in trunk.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| p as u32);
            push(&mut row, &mut slot_of, n, parent, i >= prefix.len());
        }
        let mut new_rows = Vec::new();
        for i in prefix.len()..trunk.len() {
            let n = trunk[i];
            let next = trunk.get(i + 1).copied();
            for &c in &nodes[n].children {
                if Some(c) == next {
                    continue;
                }
                if nodes[c].height > branch_depth {
                    new_rows.push((trunk[..=i].to_vec(), c));
                    continue;
                }
                // The whole subtree as branch slots, parents first.
                let mut stack = vec![c];
                while let Some(b) = stack.pop() {
                    let parent = nodes[b].parent.map(|p| slot_of[p]);
                    push(&mut row, &mut slot_of, b, parent, true);
                    stack.extend(nodes[b].children.iter().rev());
                }
            }
        }
        rows.push(row);
        work.extend(new_rows.into_iter().rev());
    }
    rows
}

/// One trunk row ready for `Policy::forward_trunk` (batch of one): ids, positions, the
/// branch slots' attention rows, and every owned prediction (the slot it is made from,
/// its target, its label and context multiplicities).
pub struct TrunkBatch {
    pub input_ids: Tensor,
    pub position_ids: Tensor,
    pub trunk: i64,
    pub branch_allowed: Tensor,
    /// `[N]` slot whose logits predict each owned token (its parent).
    pub pred_index: Tensor,
    pub targets: Tensor,
    /// `[N]` float: label and context multiplicity of each prediction.
    pub label_weight: Tensor,
    pub context_weight: Tensor,
    pub label_tokens: u64,
    pub context_tokens: u64,
}

impl TrunkBatch {
    pub fn new(row: &TrunkRow, device: Device) -> Self {
        let s = row.len() as i64;
        let ids: Vec<i64> = row.tokens.iter().map(|&t| t as i64).collect();
        let pos: Vec<i64> = row.positions.iter().map(|&p| p as i64).collect();
        let (mut pred, mut targets, mut lw, mut cw) = (vec![], vec![], vec![], vec![]);
        for i in 0..row.len() {
            let (l, c) = (row.label_weight[i], row.context_weight[i]);
            if let (Some(p), true) = (row.parent[i], l + c > 0) {
                pred.push(p as i64);
                targets.push(row.tokens[i] as i64);
                lw.push(l as f32);
                cw.push(c as f32);
            }
        }
        let t = row.trunk as i64;
        Self {
            input_ids: Tensor::from_slice(&ids).reshape([1, s]).to(device),
            position_ids: Tensor::from_slice(&pos).reshape([1, s]).to(device),
            trunk: t,
            branch_allowed: Tensor::from_slice(&row.branch_mask())
                .reshape([1, s - t, s])
                .to(device),
            pred_index: Tensor::from_slice(&pred).to(device),
            targets: Tensor::from_slice(&targets).to(device),
            label_weight: Tensor::from_slice(&lw).to(device),
            context_weight: Tensor::from_slice(&cw).to(device),
            label_tokens: row.label_tokens(),
            context_tokens: row.context_tokens(),
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
    use tutor_proto::{Actor, TurnRecord};

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

    /// The examples `dagger_examples` builds, as (tokens, loss mask).
    fn examples(turns: &[TurnRecord], max_seq_len: usize) -> Vec<(Vec<u32>, Vec<bool>)> {
        dagger_examples("e", turns, max_seq_len)
            .into_iter()
            .map(|e| (e.tokens, e.loss_mask))
            .collect()
    }

    /// Every predicted label token with its whole context: the plain sequence up to and
    /// including it, sorted. From rows: walk `parent` from each label slot that has one
    /// (checking on the way that each slot's position is its depth); from examples: each
    /// label position j > 0 (position 0 is never predicted, as in `PaddedBatch`).
    fn label_contexts_of_rows(rows: &[PackedRow]) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for row in rows {
            for i in 0..row.len() {
                let mut path = vec![i];
                while let Some(p) = row.parent[*path.last().unwrap()] {
                    path.push(p as usize);
                }
                assert_eq!(row.positions[i] as usize, path.len() - 1, "slot {i}");
                if row.loss_mask[i] && path.len() > 1 {
                    out.push(path.iter().rev().map(|&s| row.tokens[s]).collect());
                }
            }
        }
        out.sort();
        out
    }

    fn label_contexts_of_examples(examples: &[(Vec<u32>, Vec<bool>)]) -> Vec<Vec<u32>> {
        let mut out: Vec<Vec<u32>> = examples
            .iter()
            .flat_map(|(tokens, mask)| {
                (1..tokens.len())
                    .filter(|&j| mask[j])
                    .map(|j| tokens[..=j].to_vec())
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn packed_rows_represent_exactly_the_dagger_examples() {
        let turns = vec![
            turn(0, &[1, 2, 3], &[10, 11], &[20], Actor::Student),
            turn(1, &[4], &[12, 13], &[21, 22], Actor::Teacher),
            turn(2, &[5], &[14], &[], Actor::Teacher),
        ];
        let rows = pack_examples(&examples(&turns, 100), 100);
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
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
        assert_eq!(row.label_tokens(), 5);
        assert_eq!(
            label_contexts_of_rows(&rows),
            label_contexts_of_examples(&examples(&turns, 100))
        );
        // Slot 5 (20, the executed student reply) sees the prompt, not the branch.
        let m = row.allowed_mask();
        let seen: Vec<usize> = (0..11).filter(|&j| m[5 * 11 + j]).collect();
        assert_eq!(seen, vec![0, 1, 2, 5]);
        let seen: Vec<usize> = (0..11).filter(|&j| m[4 * 11 + j]).collect();
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);

        // The check fails on a wrong label or a wrong context.
        let mut wrong = rows.clone();
        wrong[0].tokens[4] = 99; // a label token
        assert_ne!(
            label_contexts_of_rows(&wrong),
            label_contexts_of_rows(&rows)
        );
        let mut wrong = rows.clone();
        wrong[0].parent[7] = Some(4); // label 12 hangs off the branch
        wrong[0].positions[7] = 5;
        assert_ne!(
            label_contexts_of_rows(&wrong),
            label_contexts_of_rows(&rows)
        );

        // Random trajectories, examples cut at several lengths (cut examples share no
        // positions with the trunk and become trees of their own, side by side).
        for seed in 0..20 {
            let turns = random_turns(seed, 7, 50);
            for max in [1000, 30, 12, 5] {
                let ex = examples(&turns, max);
                for row_tokens in [100_000, 40] {
                    let rows = pack_examples(&ex, row_tokens);
                    assert_eq!(
                        label_contexts_of_rows(&rows),
                        label_contexts_of_examples(&ex),
                        "seed {seed} max {max} row tokens {row_tokens}"
                    );
                    assert!(rows
                        .iter()
                        .all(|r| r.positions.iter().all(|&p| (p as usize) < max)));
                }
            }
        }
    }

    #[test]
    fn packed_row_has_trajectory_plus_branch_label_tokens() {
        for seed in 0..10 {
            let turns = random_turns(seed, 8, 50);
            let ex = examples(&turns, 100_000);
            let rows = pack_examples(&ex, 100_000);
            assert_eq!(rows.len(), 1, "one trajectory, one tree, one row");
            let row = &rows[0];
            // The executed trajectory; the last turn is a teacher turn with a label, so
            // the trunk runs to its end.
            let mut trajectory: Vec<u32> = Vec::new();
            let mut forks: Vec<(usize, &[u32])> = Vec::new(); // (|h_t|, y*_t)
            for t in &turns {
                trajectory.extend_from_slice(&t.context_delta_tokens);
                if !t.teacher_format_error && !t.teacher_tokens.is_empty() {
                    forks.push((trajectory.len(), &t.teacher_tokens));
                }
                let executed = if t.executed == Actor::Student as i32 {
                    &t.student_tokens
                } else {
                    &t.teacher_tokens
                };
                trajectory.extend_from_slice(executed);
            }
            // A label takes slots of its own from where it leaves the trunk on: none where
            // the teacher acted (trained in place), its tokens past the first that differs
            // from the executed ones where the student acted (a branch).
            let branch_labels: usize = forks
                .iter()
                .map(|&(h, label)| {
                    let shared = label
                        .iter()
                        .zip(&trajectory[h..])
                        .take_while(|(a, b)| a == b)
                        .count();
                    label.len() - shared
                })
                .sum();
            assert!(branch_labels > 0, "seed {seed}");
            assert_eq!(row.len(), trajectory.len() + branch_labels, "seed {seed}");
            // Equivalently: one slot per distinct prefix of the examples.
            let prefixes: std::collections::HashSet<&[u32]> = ex
                .iter()
                .flat_map(|(tokens, _)| (1..=tokens.len()).map(|j| &tokens[..j]))
                .collect();
            assert_eq!(row.len(), prefixes.len(), "seed {seed}");
            assert_eq!(row.label_tokens(), label_contexts_of_examples(&ex).len());
            let naive_tokens: usize = ex.iter().map(|e| e.0.len()).sum();
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
        let b = PaddedBatch::new(&examples(turns, max), Device::Cpu);
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
        let rows = pack_examples(&examples(&turns, 1000), 100_000);
        assert_eq!(rows.len(), 1);
        let row = rows[0].clone();
        // The tree branches: some slot is the parent of two (a student-branch label).
        let mut parents: Vec<u32> = row.parent.iter().flatten().copied().collect();
        parents.sort();
        assert!(parents.windows(2).any(|w| w[0] == w[1]));
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
        let mut rows = pack_examples(&examples(&turns, 1000), 100_000);
        rows.extend(pack_examples(&examples(&other, 20), 100_000));
        assert_eq!(rows.len(), 2);
        // The cut examples share no prefix with each other: trees side by side.
        assert!(rows[1].parent.iter().filter(|p| p.is_none()).count() > 1);
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

    /// Every owned prediction of trunk rows with its whole context (the path to it),
    /// repeated by its label and by its context multiplicity, sorted.
    fn owned_contexts_of_trunks(rows: &[TrunkRow]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
        let (mut labels, mut contexts) = (Vec::new(), Vec::new());
        for row in rows {
            assert!(row.trunk <= row.len());
            for i in 0..row.len() {
                let mut path = vec![i];
                while let Some(p) = row.parent[*path.last().unwrap()] {
                    assert!((p as usize) < *path.last().unwrap(), "a parent comes first");
                    path.push(p as usize);
                }
                assert_eq!(row.positions[i] as usize, path.len() - 1, "slot {i}");
                if i < row.trunk {
                    assert_eq!(path.len(), i + 1, "the trunk is one chain from slot 0");
                }
                let seq: Vec<u32> = path.iter().rev().map(|&s| row.tokens[s]).collect();
                labels.extend(std::iter::repeat_n(
                    seq.clone(),
                    row.label_weight[i] as usize,
                ));
                contexts.extend(std::iter::repeat_n(seq, row.context_weight[i] as usize));
            }
        }
        labels.sort();
        contexts.sort();
        (labels, contexts)
    }

    fn context_contexts_of_examples(examples: &[(Vec<u32>, Vec<bool>)]) -> Vec<Vec<u32>> {
        let mut out: Vec<Vec<u32>> = examples
            .iter()
            .flat_map(|(tokens, mask)| {
                (1..tokens.len())
                    .filter(|&j| !mask[j])
                    .map(|j| tokens[..=j].to_vec())
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn trunk_rows_own_every_prediction_of_the_examples_once() {
        for seed in 0..10 {
            let mut ex = examples(&random_turns(seed, 8, 50), 100_000);
            // Another trajectory in the batch, a duplicate example and cut contexts.
            ex.extend(examples(&random_turns(seed + 100, 6, 50), 100_000));
            ex.push(ex[2].clone());
            ex.extend(examples(&random_turns(seed + 200, 6, 50), 25));
            for depth in [0, 4, 10_000] {
                let rows = pack_trunks(&ex, depth);
                let (labels, contexts) = owned_contexts_of_trunks(&rows);
                assert_eq!(
                    labels,
                    label_contexts_of_examples(&ex),
                    "seed {seed} depth {depth}"
                );
                assert_eq!(contexts, context_contexts_of_examples(&ex), "seed {seed}");
                // Branches are never deeper than allowed.
                for row in &rows {
                    for i in row.trunk..row.len() {
                        let mut d = 0;
                        let mut j = Some(i as u32);
                        while let Some(k) = j.filter(|&k| k as usize >= row.trunk) {
                            d += 1;
                            j = row.parent[k as usize];
                        }
                        assert!(d <= depth, "a branch {d} deep at depth {depth}");
                    }
                }
            }
            // One trajectory alone, shallow branches allowed: one row, its trunk the
            // executed trajectory, the student-branch labels off it.
            let one = examples(&random_turns(seed, 8, 50), 100_000);
            let rows = pack_trunks(&one, 64);
            assert_eq!(rows.len(), 1, "seed {seed}");
            assert!(rows[0].trunk < rows[0].len(), "labels branch off");
            let plain: usize = one.iter().map(|e| e.0.len()).sum();
            assert!(rows[0].len() * 2 < plain, "{} vs {plain}", rows[0].len());
        }
    }

    #[test]
    fn branch_masks_are_the_ancestors() {
        // Trunk 1 2 3 4; off slot 1: 7 8; off slot 3: 9; off 7: 6.
        let ex = vec![
            (vec![1, 2, 3, 4], vec![false, false, true, true]),
            (vec![1, 2, 7, 8], vec![false, false, true, true]),
            (vec![1, 2, 7, 6], vec![false, false, false, true]),
            (vec![1, 2, 3, 4, 9], vec![false; 5]),
        ];
        let rows = pack_trunks(&ex, 8);
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        assert_eq!(row.trunk, 5);
        assert_eq!(row.tokens, vec![1, 2, 3, 4, 9, 7, 8, 6]);
        assert_eq!(row.positions, vec![0, 1, 2, 3, 4, 2, 3, 3]);
        assert_eq!(row.label_weight, vec![0, 0, 1, 1, 0, 1, 1, 1]);
        assert_eq!(row.context_weight, vec![0, 4, 1, 1, 1, 1, 0, 0]);
        let m = row.branch_mask();
        let rows_of = |i: usize| -> Vec<usize> { (0..8).filter(|&j| m[(i - 5) * 8 + j]).collect() };
        assert_eq!(rows_of(5), vec![0, 1, 5]);
        assert_eq!(rows_of(6), vec![0, 1, 5, 6]);
        assert_eq!(rows_of(7), vec![0, 1, 5, 7]);
        // A branch deeper than allowed gets its own row, repeating the shared prefix
        // (owning nothing there).
        let rows = pack_trunks(&ex, 1);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].tokens, vec![1, 2, 7, 8, 6]);
        assert_eq!(rows[1].trunk, 4);
        assert_eq!(rows[1].label_weight, vec![0, 0, 1, 1, 1]);
        assert_eq!(rows[1].context_weight, vec![0, 0, 1, 0, 0]);
    }

    fn trunk_loss(p: &Policy, rows: &[TrunkRow], context_scale: f64) -> Tensor {
        let sums: Vec<Tensor> = rows
            .iter()
            .map(|row| {
                let b = TrunkBatch::new(row, Device::Cpu);
                let logits =
                    p.forward_trunk(&b.input_ids, &b.position_ids, b.trunk, &b.branch_allowed);
                crate::loss::trunk_nll_sum(&logits, &b, context_scale)
            })
            .collect();
        Tensor::stack(&sums, 0).sum(Kind::Double)
    }

    #[test]
    fn trunk_loss_and_gradients_equal_the_naive_examples() {
        let p = tiny_policy(11);
        let turns = random_turns(3, 6, 64);
        let other = random_turns(4, 6, 64);
        let naive = loss_and_grads(&p, |p| {
            naive_loss(p, &turns, 1000) + naive_loss(p, &other, 20)
        });
        let mut ex = examples(&turns, 1000);
        ex.extend(examples(&other, 20));
        for depth in [1, TRUNK_BRANCH_DEPTH] {
            let rows = pack_trunks(&ex, depth);
            let trunk = loss_and_grads(&p, |p| trunk_loss(p, &rows, 0.0));
            let d = max_diff(&trunk, &naive);
            assert!(
                d < 1e-6,
                "trunk rows (branch depth {depth}) vs naive differ by {d}"
            );
        }
        // With context multiplicities: label sum + scale × context sum, as the plain
        // batch computes it.
        let b = PaddedBatch::new(&ex, Device::Cpu);
        let context = b.attention_mask.to_kind(Kind::Float) - &b.loss_mask;
        let plain = loss_and_grads(&p, |p| {
            let logits = p.forward(&b.input_ids, &b.attention_mask);
            crate::loss::masked_nll_sum(&logits, &b.input_ids, &b.loss_mask)
                + crate::loss::masked_nll_sum(&logits, &b.input_ids, &context) * 0.25
        });
        let rows = pack_trunks(&ex, TRUNK_BRANCH_DEPTH);
        let trunk = loss_and_grads(&p, |p| trunk_loss(p, &rows, 0.25));
        let d = max_diff(&trunk, &plain);
        assert!(d < 1e-6, "with context: {d}");
        // The comparison can fail: without the branch rows' trunk columns.
        let wrong = loss_and_grads(&p, |p| {
            let sums: Vec<Tensor> = rows
                .iter()
                .map(|row| {
                    let b = TrunkBatch::new(row, Device::Cpu);
                    let blind = b.branch_allowed.zeros_like();
                    let logits = p.forward_trunk(&b.input_ids, &b.position_ids, b.trunk, &blind);
                    crate::loss::trunk_nll_sum(&logits, &b, 0.25)
                })
                .collect();
            Tensor::stack(&sums, 0).sum(Kind::Double)
        });
        assert!(max_diff(&wrong, &plain) > 1e-3);
    }
}
