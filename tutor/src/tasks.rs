//! `tutor tasks`: task files (the toy generator, split into training and held-out).

use std::path::Path;

use anyhow::{Context, Result};

/// `tutor tasks toy`: `n` toy tasks from `seed` into `out`, and with `heldout_out` a
/// held-out share of them there (no task on both sides).
pub fn toy(
    n: usize,
    seed: u64,
    out: &Path,
    heldout_out: Option<&Path>,
    heldout_fraction: f64,
) -> Result<()> {
    if n == 0 {
        anyhow::bail!("--n must be at least 1");
    }
    if !(0.0..1.0).contains(&heldout_fraction) {
        anyhow::bail!("--heldout-fraction must lie in [0, 1)");
    }
    let tasks = tutor_rollout_worker::toy::generate(n, seed);
    match heldout_out {
        Some(h) => {
            let (train, heldout) = tutor_rollout_worker::toy::split(tasks, heldout_fraction);
            tutor_rollout_worker::tasks::write_tasks(out, &train)
                .with_context(|| format!("writing {}", out.display()))?;
            tutor_rollout_worker::tasks::write_tasks(h, &heldout)
                .with_context(|| format!("writing {}", h.display()))?;
            println!(
                "{} training tasks → {}, {} held-out → {}",
                train.len(),
                out.display(),
                heldout.len(),
                h.display()
            );
        }
        None => {
            tutor_rollout_worker::tasks::write_tasks(out, &tasks)
                .with_context(|| format!("writing {}", out.display()))?;
            println!("{} tasks → {}", tasks.len(), out.display());
        }
    }
    Ok(())
}
