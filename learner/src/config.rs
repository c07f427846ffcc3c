//! The learner's typed configuration (section `[learner]` of a run config).

use serde::{Deserialize, Serialize};

/// Optimizer and schedule settings. Defaults suit the single-machine CPU run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// Peak learning rate (AdamW).
    pub learning_rate: f64,
    /// Linear warmup steps from 0 to the peak learning rate.
    pub warmup_steps: u32,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Gradient clipping by global norm; 0 disables it.
    pub grad_clip: f64,
    /// Seed for the initial weights of version 0.
    pub seed: u64,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1e-3,
            warmup_steps: 5,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            seed: 0,
        }
    }
}

impl LearnerConfig {
    /// The learning rate at optimizer step `step` (0-based): linear warmup, then constant.
    pub fn lr_at(&self, step: u64) -> f64 {
        if self.warmup_steps == 0 || step >= self.warmup_steps as u64 {
            self.learning_rate
        } else {
            self.learning_rate * (step + 1) as f64 / self.warmup_steps as f64
        }
    }
}
