//! AdamW over plain tensors, with its state open for checkpoints (tch's `nn::Optimizer`
//! keeps the moments inside libtorch, out of reach). Same arithmetic as PyTorch's AdamW
//! (decoupled weight decay, bias correction, eps outside the square root).

use tch::{Kind, Tensor};

/// AdamW hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// The optimizer state: first and second moments per parameter (fp32, whatever the
/// parameter's kind) and the number of updates taken.
pub struct AdamW {
    config: AdamWConfig,
    step: u64,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    /// Zero moments for parameters shaped like `params`.
    pub fn new(config: AdamWConfig, params: &[Tensor]) -> Self {
        let zeros = |p: &Tensor| Tensor::zeros(p.size(), (Kind::Float, p.device()));
        Self {
            config,
            step: 0,
            exp_avg: params.iter().map(zeros).collect(),
            exp_avg_sq: params.iter().map(zeros).collect(),
        }
    }

    /// Restores a saved state; shapes must match the parameters.
    pub fn from_state(
        config: AdamWConfig,
        step: u64,
        exp_avg: Vec<Tensor>,
        exp_avg_sq: Vec<Tensor>,
    ) -> Self {
        assert_eq!(exp_avg.len(), exp_avg_sq.len());
        Self {
            config,
            step,
            exp_avg,
            exp_avg_sq,
        }
    }

    /// Updates taken so far (the bias-correction step).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    pub fn exp_avg(&self) -> &[Tensor] {
        &self.exp_avg
    }

    pub fn exp_avg_sq(&self) -> &[Tensor] {
        &self.exp_avg_sq
    }

    /// One update of every parameter with its gradient, at learning rate `lr`:
    /// p ← p(1 − lr·wd); m ← β1 m + (1 − β1) g; v ← β2 v + (1 − β2) g²;
    /// p ← p − lr/(1 − β1ᵗ) · m / (√v/√(1 − β2ᵗ) + eps).
    pub fn step(&mut self, params: &mut [Tensor], grads: &[Tensor], lr: f64) {
        assert_eq!(params.len(), self.exp_avg.len(), "parameter count changed");
        assert_eq!(params.len(), grads.len(), "one gradient per parameter");
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.config;
        self.step += 1;
        let bias_correction1 = 1.0 - beta1.powi(self.step as i32);
        let bias_correction2 = 1.0 - beta2.powi(self.step as i32);
        let step_size = lr / bias_correction1;
        let bias_correction2_sqrt = bias_correction2.sqrt();
        tch::no_grad(|| {
            for ((p, g), (m, v)) in params
                .iter_mut()
                .zip(grads)
                .zip(self.exp_avg.iter_mut().zip(self.exp_avg_sq.iter_mut()))
            {
                let g = g.to_kind(Kind::Float);
                // The order of operations follows libtorch's AdamW, so the results match it
                // to the bit on the same device.
                let _ = p.g_mul_scalar_(1.0 - lr * weight_decay);
                let _ = m.g_mul_scalar_(beta1);
                let _ = m.g_add_(&(&g * (1.0 - beta1)));
                let _ = v.g_mul_scalar_(beta2);
                let _ = v.g_add_(&(&g * (1.0 - beta2) * &g));
                let denom = (v.sqrt() / bias_correction2_sqrt).g_add_scalar_(eps);
                let update = (&*m / &denom) * (-step_size);
                let _ = p.g_add_(&update.to_kind(p.kind()));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::OptimizerConfig;
    use tch::{nn, Device};

    /// Same gradients into tch's (libtorch's) AdamW and ours: same parameters after each
    /// of several steps with changing learning rates.
    #[test]
    fn matches_libtorch_adamw() {
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        tch::manual_seed(11);
        let init = Tensor::randn([4, 5], (Kind::Float, Device::Cpu));
        let vs = nn::VarStore::new(Device::Cpu);
        let w = vs.root().var_copy("w", &init);
        let mut reference = nn::AdamW {
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            wd: cfg.weight_decay,
            eps: cfg.eps,
            amsgrad: false,
        }
        .build(&vs, 1e-2)
        .unwrap();
        let mut ours_p = [init.copy()];
        let mut ours = AdamW::new(cfg, &ours_p);
        for (k, lr) in [1e-2, 3e-2, 5e-3, 2e-2, 1e-3].into_iter().enumerate() {
            let coeff = Tensor::randn([4, 5], (Kind::Float, Device::Cpu)) * (k as f64 + 1.0);
            // d/dw sum(w ⊙ c + w²/2) = c + w: depends on the current weights.
            let grad = tch::no_grad(|| &coeff + &w);
            reference.zero_grad();
            (&w * &coeff + &w * &w * 0.5).sum(Kind::Float).backward();
            reference.set_lr(lr);
            reference.step();
            ours.step(&mut ours_p, &[grad], lr);
            let diff = (&ours_p[0] - &w).abs().max().double_value(&[]);
            let scale = w.abs().max().double_value(&[]);
            assert!(
                diff <= 1e-6 * scale,
                "step {k}: max diff {diff} (scale {scale})"
            );
        }
        assert_eq!(ours.steps_taken(), 5);
        // And it moved: a test comparing two frozen tensors would pass trivially.
        assert!((&ours_p[0] - &init).abs().max().double_value(&[]) > 1e-3);
    }
}
