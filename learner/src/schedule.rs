//! Learning-rate schedules: linear warmup, then constant or cosine decay to a floor.

use serde::{Deserialize, Serialize};

/// What follows the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// The peak learning rate until the end.
    #[default]
    Constant,
    /// Cosine decay from the peak to `min_lr_ratio × peak` at `total_steps`.
    Cosine,
}

/// A learning-rate schedule over 0-based optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub peak: f64,
    /// Linear warmup: step s < warmup_steps uses peak × (s + 1)/warmup_steps (so the first
    /// step already moves the weights); 0 disables it.
    pub warmup_steps: u64,
    pub kind: ScheduleKind,
    /// Floor of the cosine as a fraction of the peak, clamped to [0, 1].
    pub min_lr_ratio: f64,
}

impl LrSchedule {
    /// The learning rate at step `step` of a run of `total_steps` optimizer steps.
    ///
    /// Cosine: with p = (step − warmup)/(total_steps − warmup) clamped to [0, 1],
    /// lr = peak × (m + (1 − m) × (1 + cos πp)/2), m = min_lr_ratio: the peak right after
    /// the warmup, the floor at step `total_steps` (the convention of Hugging Face's
    /// `get_cosine_schedule_with_warmup`) and after it. If `total_steps <= warmup_steps`
    /// (a misconfiguration `LearnerConfig::validate` rejects) the decay has no room: the
    /// step after the warmup is already at the floor. `total_steps` is ignored by
    /// `Constant`.
    pub fn lr_at(&self, step: u64, total_steps: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.peak,
            ScheduleKind::Cosine => {
                let floor = self.min_lr_ratio.clamp(0.0, 1.0);
                let span = total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let p = ((step - self.warmup_steps) as f64 / span).clamp(0.0, 1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * p).cos());
                self.peak * (floor + (1.0 - floor) * cos)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} vs {b}");
    }

    #[test]
    fn constant_after_warmup() {
        let s = LrSchedule {
            peak: 1e-3,
            warmup_steps: 4,
            kind: ScheduleKind::Constant,
            min_lr_ratio: 0.5,
        };
        // Warmup: 1e-3 × [1, 2, 3, 4]/4.
        close(s.lr_at(0, 10), 2.5e-4);
        close(s.lr_at(1, 10), 5e-4);
        close(s.lr_at(3, 10), 1e-3);
        close(s.lr_at(4, 10), 1e-3);
        close(s.lr_at(1000, 10), 1e-3);
        let no_warmup = LrSchedule {
            warmup_steps: 0,
            ..s
        };
        close(no_warmup.lr_at(0, 0), 1e-3);
    }

    #[test]
    fn cosine_hand_computed() {
        // peak 1, warmup 2, total 10, floor 0.1: p = (step − 2)/8.
        let s = LrSchedule {
            peak: 1.0,
            warmup_steps: 2,
            kind: ScheduleKind::Cosine,
            min_lr_ratio: 0.1,
        };
        close(s.lr_at(0, 10), 0.5); // warmup 1/2
        close(s.lr_at(1, 10), 1.0); // warmup 2/2
        close(s.lr_at(2, 10), 1.0); // p = 0: cos term 1
                                    // p = 1/4: (1 + cos π/4)/2 = 0.8535534; 0.1 + 0.9 × 0.8535534 = 0.8681981
        close(
            s.lr_at(4, 10),
            0.1 + 0.9 * 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2),
        );
        close(s.lr_at(6, 10), 0.1 + 0.9 * 0.5); // p = 1/2: cos π/2 = 0 → 0.55
        close(s.lr_at(10, 10), 0.1); // p = 1: the floor
        close(s.lr_at(50, 10), 0.1); // past the end: stays at the floor
                                     // Monotone non-increasing after the warmup.
        let lrs: Vec<f64> = (2..=12).map(|k| s.lr_at(k, 10)).collect();
        assert!(lrs.windows(2).all(|w| w[1] <= w[0]), "{lrs:?}");
        // Floor 0 (the RFT recipe: cosine to 0).
        let to_zero = LrSchedule {
            min_lr_ratio: 0.0,
            ..s
        };
        close(to_zero.lr_at(10, 10), 0.0);
        close(to_zero.lr_at(6, 10), 0.5);
    }

    #[test]
    fn cosine_degenerate_total_is_finite() {
        let s = LrSchedule {
            peak: 2.0,
            warmup_steps: 3,
            kind: ScheduleKind::Cosine,
            min_lr_ratio: 0.25,
        };
        // total ≤ warmup: peak right after the warmup, floor from the next step.
        close(s.lr_at(3, 0), 2.0);
        close(s.lr_at(4, 0), 0.5);
        close(s.lr_at(4, 3), 0.5);
        // Out-of-range floor is clamped.
        let bad = LrSchedule {
            min_lr_ratio: 7.0,
            ..s
        };
        close(bad.lr_at(100, 10), 2.0);
    }
}
