//! DAPO's reward side, free of tensors: the turn-count length penalty, the trajectory
//! reward, group-normalised advantages and the dynamic-sampling filter (docs/architecture.md,
//! "Objectives"). The coordinator computes them and sends the advantages in its
//! examples; the learner's losses are in `tutor_learner::loss`.

/// Mean and population standard deviation (divides by n) of a non-empty slice.
fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Group-normalised advantages Â_i = (R_i − mean_G)/(std_G + δ), over consecutive groups
/// of `group_size` rewards (the G samples of one task are adjacent).
///
/// std_G is the *population* standard deviation (divides by G, `unbiased=False` in
/// PyTorch terms): it is defined for every G ≥ 1 and a group of identical rewards gets
/// Â = 0 exactly. (The sample std would scale every Â by √((G−1)/G), a constant factor
/// the optimizer's learning rate absorbs.) A trailing partial group is normalised on its
/// own; `group_size == 0` means one group holding all rewards.
pub fn group_advantages(rewards: &[f64], group_size: usize, delta: f64) -> Vec<f64> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let g = if group_size == 0 {
        rewards.len()
    } else {
        group_size
    };
    let mut out = Vec::with_capacity(rewards.len());
    for group in rewards.chunks(g) {
        let (mean, std) = mean_std(group);
        out.extend(group.iter().map(|r| (r - mean) / (std + delta)));
    }
    out
}

/// Dynamic sampling: a group is kept only if its rewards are not all equal (otherwise
/// every advantage is 0 and the group carries no gradient). An empty group is dropped.
pub fn keep_group(rewards: &[f64]) -> bool {
    match rewards.first() {
        None => false,
        Some(first) => rewards.iter().any(|r| r != first),
    }
}

/// Indices (0-based, in order) of the consecutive groups of `group_size` rewards that
/// `keep_group` keeps. Grouping as in `group_advantages`.
pub fn kept_groups(rewards: &[f64], group_size: usize) -> Vec<usize> {
    let g = if group_size == 0 {
        rewards.len().max(1)
    } else {
        group_size
    };
    rewards
        .chunks(g)
        .enumerate()
        .filter(|(_, group)| keep_group(group))
        .map(|(i, _)| i)
        .collect()
}

/// Dynamic-sampling filter over samples and their rewards (consecutive groups of
/// `group_size`): returns the samples and rewards of the groups `keep_group` keeps, in
/// order. The caller refills the batch by sampling more groups.
pub fn filter_groups<T: Clone>(
    samples: &[T],
    rewards: &[f64],
    group_size: usize,
) -> (Vec<T>, Vec<f64>) {
    assert_eq!(
        samples.len(),
        rewards.len(),
        "one reward per sample is required"
    );
    let g = if group_size == 0 {
        rewards.len().max(1)
    } else {
        group_size
    };
    let mut kept_samples = Vec::new();
    let mut kept_rewards = Vec::new();
    for k in kept_groups(rewards, g) {
        let range = k * g..((k + 1) * g).min(rewards.len());
        kept_samples.extend_from_slice(&samples[range.clone()]);
        kept_rewards.extend_from_slice(&rewards[range]);
    }
    (kept_samples, kept_rewards)
}

/// Turn-count length penalty: P = 0 if T < L_thr, else (L_thr − T)/(T_max − L_thr), i.e.
/// 0 at L_thr falling linearly to −1 at T_max. Never below −1: an episode longer than
/// T_max (which the step cap should prevent) gets −1.
///
/// Degenerate ramp (`t_max <= l_thr`): the ramp has no width, so the penalty is a step,
/// 0 for T ≤ L_thr and −1 for T > L_thr (the limit of the ramp as T_max → L_thr). No
/// division by zero, no panic.
pub fn turn_penalty(turns: u32, l_thr: u32, t_max: u32) -> f64 {
    if turns < l_thr {
        return 0.0;
    }
    if t_max <= l_thr {
        return if turns > l_thr { -1.0 } else { 0.0 };
    }
    let p = (l_thr as f64 - turns as f64) / (t_max as f64 - l_thr as f64);
    p.max(-1.0)
}

/// DAPO reward of one trajectory: resolved ∈ {0, 1} plus the turn penalty.
pub fn trajectory_reward(resolved: bool, turns: u32, l_thr: u32, t_max: u32) -> f64 {
    let base = if resolved { 1.0 } else { 0.0 };
    base + turn_penalty(turns, l_thr, t_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) {
        assert!((a - b).abs() <= tol, "{a} vs {b}");
    }

    #[test]
    fn group_advantages_hand_computed() {
        // Group [1, 0, 0, 1]: mean 0.5, population std 0.5, δ = 0 → [1, −1, −1, 1].
        // Group [1, 0, 0, 0]: mean 0.25, var = (0.5625 + 3·0.0625)/4 = 0.1875,
        //   std = 0.4330127…; Â = [0.75/std, −0.25/std ×3] = [1.7320508, −0.5773503 ×3].
        // Group [0.5, 0.5, 0.5, 0.5]: all equal → 0 (δ keeps the division finite).
        let r = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5];
        let a = group_advantages(&r, 4, 0.0);
        let s = 0.1875f64.sqrt();
        let want = [
            1.0,
            -1.0,
            -1.0,
            1.0,
            0.75 / s,
            -0.25 / s,
            -0.25 / s,
            -0.25 / s,
        ];
        for (x, y) in a[..8].iter().zip(want) {
            close(*x, y, 1e-12);
        }
        close(a[4], 3f64.sqrt(), 1e-12);
        let a = group_advantages(&r, 4, 1e-6);
        assert!(a[8..].iter().all(|x| *x == 0.0));
        // δ = 1 on the first group: (1 − 0.5)/(0.5 + 1) = 1/3.
        close(group_advantages(&r[..4], 4, 1.0)[0], 1.0 / 3.0, 1e-12);
        // Partial trailing group [1, 0] of size 2 normalised alone: ±1 with δ = 0.
        let p = group_advantages(&[1.0, 1.0, 0.0, 1.0, 0.0], 3, 0.0);
        close(p[3], 1.0, 1e-12);
        close(p[4], -1.0, 1e-12);
        // group_size 0: one group.
        assert_eq!(
            group_advantages(&[1.0, 0.0], 0, 0.0),
            group_advantages(&[1.0, 0.0], 2, 0.0)
        );
        assert!(group_advantages(&[], 4, 1e-6).is_empty());
    }

    #[test]
    fn dynamic_sampling_filter() {
        assert!(!keep_group(&[1.0, 1.0, 1.0]));
        assert!(!keep_group(&[0.0, 0.0]));
        assert!(!keep_group(&[]));
        assert!(keep_group(&[1.0, 0.0, 1.0]));
        // Penalties make otherwise equal outcomes different: kept.
        assert!(keep_group(&[1.0, 1.0 - 0.25]));
        // Groups of 2: [0, 0] dropped, [1, 0] kept, [1, 1] dropped, [0.5, 0.25] kept.
        let rewards = [0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 0.25];
        assert_eq!(kept_groups(&rewards, 2), vec![1, 3]);
        let samples = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let (s, r) = filter_groups(&samples, &rewards, 2);
        assert_eq!(s, vec!["c", "d", "g", "h"]);
        assert_eq!(r, vec![1.0, 0.0, 0.5, 0.25]);
        // Groups of 4: [0, 0, 1, 0] and [1, 1, 0.5, 0.25] both kept.
        assert_eq!(kept_groups(&rewards, 4), vec![0, 1]);
        // Groups of 3 (last one partial): [0, 0, 1] kept, [0, 1, 1] kept, [0.5, 0.25] kept;
        // [1, 1, 1] | [0, 0, 0] | [2]: nothing kept.
        assert_eq!(kept_groups(&rewards, 3), vec![0, 1, 2]);
        assert!(kept_groups(&[1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0], 3).is_empty());
        let (s, r) = filter_groups(&samples[..6], &[1.0, 1.0, 1.0, 0.0, 0.5, 0.0], 3);
        assert_eq!(s, vec!["d", "e", "f"]);
        assert_eq!(r, vec![0.0, 0.5, 0.0]);
    }

    #[test]
    fn turn_penalty_hand_computed() {
        // L_thr = 30, T_max = 40: 0 below 30, (30 − T)/10 from 30 on, −1 at 40.
        assert_eq!(turn_penalty(0, 30, 40), 0.0);
        assert_eq!(turn_penalty(29, 30, 40), 0.0);
        assert_eq!(turn_penalty(30, 30, 40), 0.0);
        close(turn_penalty(35, 30, 40), -0.5, 1e-12);
        close(turn_penalty(33, 30, 40), -0.3, 1e-12);
        assert_eq!(turn_penalty(40, 30, 40), -1.0);
        assert_eq!(turn_penalty(55, 30, 40), -1.0);
        // Degenerate ramps: a step at L_thr, never NaN or infinite.
        assert_eq!(turn_penalty(40, 40, 40), 0.0);
        assert_eq!(turn_penalty(41, 40, 40), -1.0);
        assert_eq!(turn_penalty(10, 40, 20), 0.0);
        assert_eq!(turn_penalty(45, 40, 20), -1.0);
        // reward = resolved + penalty: 1 + (30 − 35)/10 = 0.5.
        close(trajectory_reward(true, 35, 30, 40), 0.5, 1e-12);
        assert_eq!(trajectory_reward(false, 10, 30, 40), 0.0);
        assert_eq!(trajectory_reward(true, 10, 30, 40), 1.0);
    }
}
