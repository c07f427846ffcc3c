//! The training state: the student's weights and its AdamW optimizer. Owned by one
//! thread (tch tensors are not shared across tasks); the gRPC service talks to it
//! through `LearnerHandle`.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use tch::nn::OptimizerConfig;
use tch::{nn, Device};
use tutor_policy::{ModelConfig, Policy};

use crate::config::LearnerConfig;
use crate::loss::{masked_cross_entropy, PaddedBatch};

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    pub loss: f64,
    pub grad_norm: f64,
    pub label_tokens: u64,
    pub learning_rate: f64,
    pub seconds: f64,
}

pub struct Trainer {
    policy: Policy,
    optimizer: nn::Optimizer,
    config: LearnerConfig,
    steps: u64,
}

impl Trainer {
    /// Starts from `model_dir/model.safetensors` when present, else from random weights
    /// seeded by `config.seed` with the architecture in `model_dir/config.json`.
    pub fn from_model_dir(model_dir: &Path, config: LearnerConfig) -> Result<Self> {
        let device = Device::Cpu;
        let policy = if model_dir.join("model.safetensors").exists() {
            Policy::load_dir(model_dir, device).with_context(|| {
                format!("loading the initial model from {}", model_dir.display())
            })?
        } else {
            let cfg_path = model_dir.join("config.json");
            let mc = ModelConfig::load(&cfg_path)
                .with_context(|| format!("reading {}", cfg_path.display()))?;
            Policy::new(mc, device, config.seed as i64)
        };
        Self::new(policy, config)
    }

    pub fn new(policy: Policy, config: LearnerConfig) -> Result<Self> {
        let optimizer = nn::AdamW {
            beta1: config.beta1,
            beta2: config.beta2,
            wd: config.weight_decay,
            eps: config.eps,
            amsgrad: false,
        }
        .build(policy.var_store(), config.lr_at(0))
        .context("building the AdamW optimizer")?;
        Ok(Self {
            policy,
            optimizer,
            config,
            steps: 0,
        })
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Mean label-token cross-entropy of a batch under the current weights, no update.
    pub fn eval_loss(&self, examples: &[(Vec<u32>, Vec<bool>)]) -> f64 {
        let _guard = tch::no_grad_guard();
        let batch = PaddedBatch::new(examples, self.policy.device());
        let logits = self.policy.forward(&batch.input_ids, &batch.attention_mask);
        masked_cross_entropy(&logits, &batch.input_ids, &batch.loss_mask).double_value(&[])
    }

    /// One optimizer step on one batch: masked cross-entropy on label tokens, gradient
    /// clipping by global norm, AdamW.
    pub fn step(&mut self, examples: &[(Vec<u32>, Vec<bool>)]) -> StepReport {
        let start = Instant::now();
        let lr = self.config.lr_at(self.steps);
        if examples.is_empty() {
            // Nothing to learn from (e.g. only format-error labels): no update, no step.
            return StepReport {
                loss: 0.0,
                grad_norm: 0.0,
                label_tokens: 0,
                learning_rate: lr,
                seconds: 0.0,
            };
        }
        self.optimizer.set_lr(lr);
        let batch = PaddedBatch::new(examples, self.policy.device());
        let logits = self.policy.forward(&batch.input_ids, &batch.attention_mask);
        let loss = masked_cross_entropy(&logits, &batch.input_ids, &batch.loss_mask);
        self.optimizer.zero_grad();
        let loss_value = loss.double_value(&[]);
        let mut grad_norm = 0.0;
        if batch.label_tokens > 0 {
            loss.backward();
            grad_norm = global_grad_norm(self.policy.var_store());
            if self.config.grad_clip > 0.0 {
                self.optimizer.clip_grad_norm(self.config.grad_clip);
            }
            self.optimizer.step();
        }
        self.steps += 1;
        StepReport {
            loss: loss_value,
            grad_norm,
            label_tokens: batch.label_tokens,
            learning_rate: lr,
            seconds: start.elapsed().as_secs_f64(),
        }
    }

    pub fn save_weights(&self, path: &Path) -> Result<()> {
        self.policy
            .save_weights(path)
            .with_context(|| format!("saving weights to {}", path.display()))
    }

    pub fn save_dir(&self, dir: &Path) -> Result<()> {
        self.policy
            .save_dir(dir)
            .with_context(|| format!("saving the checkpoint to {}", dir.display()))
    }
}

fn global_grad_norm(vs: &nn::VarStore) -> f64 {
    let mut sq = 0.0;
    for v in vs.trainable_variables() {
        let g = v.grad();
        if g.defined() {
            let n = g.norm().double_value(&[]);
            sq += n * n;
        }
    }
    sq.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_trainer() -> Trainer {
        let mut mc = ModelConfig::tiny(64);
        mc.hidden_size = 32;
        mc.intermediate_size = 64;
        mc.head_dim = 8;
        let policy = Policy::new(mc, Device::Cpu, 3);
        Trainer::new(
            policy,
            LearnerConfig {
                learning_rate: 1e-2,
                warmup_steps: 0,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn loss_goes_down_on_repeated_data() {
        let mut t = tiny_trainer();
        let ex = vec![
            (
                vec![1u32, 5, 9, 13, 17, 21, 25, 2],
                vec![false, false, false, true, true, true, true, true],
            ),
            (
                vec![1u32, 7, 11, 3, 2],
                vec![false, false, true, true, true],
            ),
        ];
        let first = t.step(&ex);
        let mut last = first;
        for _ in 0..30 {
            last = t.step(&ex);
        }
        assert!(first.loss.is_finite() && first.grad_norm > 0.0);
        assert!(
            last.loss < first.loss * 0.5,
            "loss {} -> {}",
            first.loss,
            last.loss
        );
        assert_eq!(first.label_tokens, 5 + 3);
    }

    #[test]
    fn context_tokens_get_no_gradient_signal() {
        // Changing a context-only token target must not change the loss value.
        let t = tiny_trainer();
        let a = vec![(vec![1u32, 5, 9, 13], vec![false, false, false, true])];
        let b = vec![(vec![1u32, 5, 9, 13], vec![false, false, false, true])];
        assert_eq!(t.eval_loss(&a), t.eval_loss(&b));
        let c = vec![(vec![1u32, 5, 9, 13], vec![false, true, false, true])];
        assert_ne!(t.eval_loss(&a), t.eval_loss(&c));
    }
}
