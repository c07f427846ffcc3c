//! Losses computed at the positions they train on only, the output head run on a chunk
//! of those positions at a time (`[learner] logits_budget_mb`): a pass never holds
//! full-vocabulary logits for the whole batch. At 32k tokens and a 152k vocabulary the
//! float32 logits of one sequence are 20 GB, and `log_softmax` and its backward as much
//! again; here a pass holds one chunk's logits (and their backward) at a time.
//!
//! How gradients stay exact without a custom autograd function: the losses here are
//! sums over positions of a function of that position's log-probability, so each chunk's
//! gradient with respect to its hidden rows and to the head's weight can be taken at
//! once (`Tensor::run_backward` on detached leaves) and its graph freed. The pass then
//! returns a surrogate `Σ h·∂h + Σ W·∂W` (constants ∂ detached), shifted to the loss's
//! value: its backward puts exactly those gradients on the hidden states (and from there
//! through the decoder) and on the head's parameter, in the one backward the step runs
//! per pass, as the full-logits loss would.

use tch::{Kind, Tensor};
use tutor_policy::Policy;

/// Rows of float32 full-vocabulary logits that fit in `budget_mb` MiB (at least 1).
pub fn chunk_rows(budget_mb: usize, vocab: i64) -> i64 {
    ((budget_mb as i64 * (1 << 20)) / (4 * vocab.max(1))).max(1)
}

/// Whether a pass over `positions` hidden rows (padding included) would hold more
/// float32 logits than `budget_mb` MiB, so that its loss should be chunked; a budget of
/// 0 means no limit (always the full logits).
pub fn over_budget(budget_mb: usize, positions: i64, vocab: i64) -> bool {
    budget_mb > 0 && positions > chunk_rows(budget_mb, vocab)
}

/// The chunk size (rows of logits) of a pass over `positions` hidden rows of `policy`
/// when it should be chunked under `budget_mb` (see [`over_budget`]), else `None` (the
/// full logits fit).
pub fn pass_chunk(budget_mb: usize, policy: &Policy, positions: i64) -> Option<i64> {
    let vocab = policy.config().vocab_size as i64;
    over_budget(budget_mb, positions, vocab).then(|| chunk_rows(budget_mb, vocab))
}

/// The loss `Σ_i f(ℓ_i)` over selected positions, with ℓ_i = log π(`targets[i]` |
/// hidden row `index[i]`): `hidden` is `[.., H]` from one of `Policy`'s `*_hidden`
/// forwards (any leading shape; rows are counted over all of them), `index` and
/// `targets` are `[N]` integer tensors. `loss_of(ℓ, start, len)` gives the summed loss of
/// the chunk of positions `start .. start + len` from their log-probabilities `ℓ`
/// (`[len]` float32) and must be a sum over positions (each term depending on its own
/// ℓ only). At most `chunk` positions' logits are alive at a time.
///
/// The value equals the full-logits loss and so does its gradient (with respect to every
/// parameter, through the hidden states and the head), up to summation order. Must run
/// with gradients enabled; the returned scalar is float32.
pub fn chunked_logprob_loss(
    policy: &Policy,
    hidden: &Tensor,
    index: &Tensor,
    targets: &Tensor,
    chunk: i64,
    loss_of: impl Fn(&Tensor, i64, i64) -> Tensor,
) -> Tensor {
    let device = hidden.device();
    let n = index.size()[0];
    if n == 0 {
        return Tensor::zeros([], (Kind::Float, device));
    }
    let width = *hidden.size().last().expect("hidden has a last dimension");
    let rows = hidden
        .reshape([-1, width])
        .index_select(0, &index.to_device(device).to_kind(Kind::Int64));
    let targets = targets.to_device(device).to_kind(Kind::Int64);
    let head = policy.head_weight();
    let head_leaf = head.detach().set_requires_grad(true);
    let detached = rows.detach();
    let chunk = chunk.max(1);
    let mut row_grads = Vec::with_capacity(((n + chunk - 1) / chunk) as usize);
    let mut head_grad = Tensor::zeros(head.size(), (Kind::Float, device));
    // Summed on the device: no host sync per chunk (the step reads the pass's sum once).
    let mut total = Tensor::zeros([], (Kind::Float, device));
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let leaf = detached
            .narrow(0, start, len)
            .detach()
            .set_requires_grad(true);
        let logprobs = leaf
            .linear(&head_leaf, None::<Tensor>)
            .to_kind(Kind::Float)
            .log_softmax(-1, Kind::Float)
            .gather(1, &targets.narrow(0, start, len).unsqueeze(1), false)
            .squeeze_dim(1);
        let loss = loss_of(&logprobs, start, len).to_kind(Kind::Float);
        total += loss.detach();
        let mut grads = Tensor::run_backward(&[&loss], &[&leaf, &head_leaf], false, false);
        let g_head = grads.pop().expect("two gradients");
        let g_rows = grads.pop().expect("two gradients");
        head_grad += g_head.to_kind(Kind::Float);
        row_grads.push(g_rows);
        start += len;
    }
    let row_grads = Tensor::cat(&row_grads, 0);
    let surrogate = (&rows * row_grads.to_kind(rows.kind())).sum(Kind::Float)
        + (&head * head_grad.to_kind(head.kind())).sum(Kind::Float);
    // Value: the loss's; gradient: the surrogate's (a NaN in either stays visible, so a
    // non-finite step is still skipped).
    &surrogate - surrogate.detach() + total
}

/// `−Σ_i weights[i] · ℓ_i` (a weighted negative log-likelihood sum) by
/// [`chunked_logprob_loss`]; `weights` `[N]`.
pub fn chunked_weighted_nll(
    policy: &Policy,
    hidden: &Tensor,
    index: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
    chunk: i64,
) -> Tensor {
    let weights = weights.to_device(hidden.device()).to_kind(Kind::Float);
    chunked_logprob_loss(policy, hidden, index, targets, chunk, |lp, start, len| {
        -(lp * weights.narrow(0, start, len)).sum(Kind::Float)
    })
}

/// The positions of a right-padded `[B, T]` batch whose next token a `[B, T − 1]` mask
/// (column j: token j + 1) selects: `(hidden rows in [B·T], shifted positions in
/// [B·(T − 1)], targets)`, all `[N]` Int64, in row-major order.
pub fn shifted_positions(input_ids: &Tensor, shifted_mask: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (_, t) = input_ids.size2().expect("input_ids must be [B, T]");
    let shifted = shifted_mask
        .reshape([-1])
        .ne(0)
        .nonzero()
        .squeeze_dim(1)
        .to_device(input_ids.device());
    let row = shifted.divide_scalar_mode(t - 1, "floor");
    let hidden = &shifted + &row;
    let targets = input_ids
        .to_kind(Kind::Int64)
        .reshape([-1])
        .index_select(0, &(&hidden + 1));
    (hidden, shifted, targets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;
    use tutor_policy::ModelConfig;

    fn policy(vocab: i64, tied: bool) -> Policy {
        let mut c = ModelConfig::tiny(vocab as usize);
        c.hidden_size = 32;
        c.intermediate_size = 64;
        c.head_dim = 8;
        c.num_hidden_layers = 2;
        c.tie_word_embeddings = tied;
        Policy::new(c, Device::Cpu, 7)
    }

    fn grads(p: &Policy) -> Vec<(String, Tensor)> {
        let mut v: Vec<_> = p
            .var_store()
            .variables()
            .into_iter()
            .map(|(n, t)| (n, t.grad().copy()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn zero_grads(p: &Policy) {
        for (_, mut t) in p.var_store().variables() {
            t.zero_grad();
        }
    }

    /// The chunked weighted NLL equals the full-logits one, value and every parameter's
    /// gradient, for chunk sizes that divide the positions, that do not, and of one row;
    /// tied and untied heads.
    #[test]
    fn chunked_nll_equals_the_full_logits_loss_and_its_gradients() {
        for tied in [false, true] {
            let p = policy(97, tied);
            let ids = Tensor::randint(97, [3, 11], (Kind::Int64, Device::Cpu));
            let attn = Tensor::ones([3, 11], (Kind::Int64, Device::Cpu));
            let mask = Tensor::rand([3, 10], (Kind::Float, Device::Cpu))
                .gt(0.5)
                .to_kind(Kind::Float);
            let weights_full = &mask * 1.5 + 0.25 * &mask * &mask;

            let logits = p.forward(&ids, &attn);
            let lp = logits
                .narrow(1, 0, 10)
                .log_softmax(-1, Kind::Float)
                .gather(2, &ids.narrow(1, 1, 10).unsqueeze(2), false)
                .squeeze_dim(2);
            let reference = -(lp * &weights_full).sum(Kind::Float);
            reference.backward();
            let want = grads(&p);
            let want_value = reference.double_value(&[]);

            let (rows, shifted, targets) = shifted_positions(&ids, &mask);
            let weights = weights_full.reshape([-1]).index_select(0, &shifted);
            for chunk in [1, 4, 1000] {
                zero_grads(&p);
                let hidden = p.forward_hidden(&ids, &attn);
                let loss = chunked_weighted_nll(&p, &hidden, &rows, &targets, &weights, chunk);
                let value = loss.double_value(&[]);
                assert!(
                    (value - want_value).abs() < 1e-4 * want_value.abs().max(1.0),
                    "tied {tied}, chunk {chunk}: {value} vs {want_value}"
                );
                loss.backward();
                for ((name, g), (_, w)) in grads(&p).iter().zip(&want) {
                    let diff = (g - w).abs().max().double_value(&[]);
                    let scale = w.abs().max().double_value(&[]).max(1e-6);
                    assert!(
                        diff <= 1e-4 * scale,
                        "tied {tied}, chunk {chunk}: gradient of {name} differs by {diff} (max {scale})"
                    );
                }
            }
        }
    }

    #[test]
    fn budgets_count_float32_rows_of_the_vocabulary() {
        // 1 MiB of a 1024-token vocabulary: 256 rows.
        assert_eq!(chunk_rows(1, 1024), 256);
        assert_eq!(chunk_rows(1, 1 << 30), 1, "at least one row");
        assert!(!over_budget(1, 256, 1024));
        assert!(over_budget(1, 257, 1024));
        assert!(!over_budget(0, 1 << 40, 152_064), "0: no limit");
        // 32k tokens of a 152k vocabulary are 19 GiB of logits: over the default 1 GiB.
        assert!(over_budget(1024, 32_768, 152_064));
    }

    /// Positions are mapped from the shifted mask to hidden rows and next tokens.
    #[test]
    fn shifted_positions_name_the_predicting_row_and_the_next_token() {
        let ids = Tensor::from_slice(&[10i64, 11, 12, 20, 21, 22]).reshape([2, 3]);
        let mask = Tensor::from_slice(&[0f32, 1., 1., 0.]).reshape([2, 2]);
        let (rows, shifted, targets) = shifted_positions(&ids, &mask);
        assert_eq!(Vec::<i64>::try_from(rows).unwrap(), vec![1, 3]);
        assert_eq!(Vec::<i64>::try_from(shifted).unwrap(), vec![1, 2]);
        assert_eq!(Vec::<i64>::try_from(targets).unwrap(), vec![12, 21]);
    }
}
