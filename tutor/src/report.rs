//! `tutor report`: what a run directory holds, readable at 3 a.m. — the iteration table
//! from metrics.jsonl, its plots (`plots.rs`) and, on request, one line per stored
//! episode; for an experiment directory, the per-arm table and plots.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use tutor_proto::episode_event::Event;
use tutor_proto::{Actor, OutcomeStatus};

use crate::run::{final_row, header, row};

pub fn report(run_dir: &Path, episodes: bool) -> Result<()> {
    if crate::plots::is_experiment(run_dir) {
        return crate::plots::experiment_report(run_dir);
    }
    let metrics = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics)
        .with_context(|| format!("reading {}", metrics.display()))?;
    println!("{}", header());
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", metrics.display(), i + 1))?;
        let s = tutor_coordinator::driver::summary_from_row(&v);
        println!("{}", row(&s));
    }
    let final_eval = tutor_coordinator::driver::read_final_eval(&run_dir.join("final_eval.json"));
    if let Some(f) = final_eval {
        println!("{}", final_row(&f));
    }
    for path in crate::plots::write_run_plots(run_dir)? {
        println!("plot: {}", path.display());
    }
    if !episodes {
        return Ok(());
    }
    let store = run_dir.join("trajectories").join("events.log");
    let (events, _) = tutor_coordinator::store::scan(&store)?;
    #[derive(Default)]
    struct Ep {
        instance: String,
        status: String,
        turns: u32,
        teacher_acted: u32,
        student_acted: u32,
        student_format_errors: u32,
        seconds: f64,
        /// The coordinator recorded its lease.
        leased: bool,
    }
    let mut eps: BTreeMap<String, Ep> = BTreeMap::new();
    for ev in events {
        let e = eps.entry(ev.episode_id.clone()).or_default();
        match ev.event {
            Some(Event::Turn(t)) => {
                if t.executed == Actor::Student as i32 {
                    e.student_acted += 1;
                    e.student_format_errors += t.student_format_error as u32;
                } else {
                    e.teacher_acted += 1;
                }
            }
            Some(Event::Outcome(o)) => {
                e.instance = o.instance_id;
                e.turns = o.num_turns;
                e.seconds = o.duration_s;
                e.status = OutcomeStatus::try_from(o.status)
                    .map(|s| {
                        s.as_str_name()
                            .trim_start_matches("OUTCOME_STATUS_")
                            .to_string()
                    })
                    .unwrap_or_else(|_| format!("status {}", o.status));
            }
            // The attempt never finished: the coordinator took its lease back.
            Some(Event::LeaseExpired(_)) => e.status = "LEASE_EXPIRED".into(),
            Some(Event::LeaseGranted(_)) => e.leased = true,
            None => {}
        }
    }
    println!(
        "\n{:<22} {:<36} {:<16} {:>5} {:>7} {:>7} {:>8} {:>7}",
        "episode", "task", "status", "turns", "teacher", "student", "fmt_err", "seconds"
    );
    for (id, e) in eps {
        let status = if !e.status.is_empty() {
            e.status
        } else if e.leased && e.teacher_acted + e.student_acted == 0 {
            // Leased, and nothing stored since: not started yet, or lost with its worker.
            "LEASED".to_string()
        } else {
            "INCOMPLETE".to_string()
        };
        println!(
            "{id:<22} {:<36} {status:<16} {:>5} {:>7} {:>7} {:>8} {:>7.1}",
            e.instance,
            e.turns,
            e.teacher_acted,
            e.student_acted,
            e.student_format_errors,
            e.seconds
        );
    }
    Ok(())
}

/// Prints one stored episode's conversation, decoded with the run's tokenizer
/// (`<run>/model`, with its chat template where it has one): the context each turn added,
/// then the executed reply, and the other side's reply where it differed.
pub fn transcript(run_dir: &Path, episode_id: &str) -> Result<()> {
    let model_dir = run_dir.join("model");
    let tok = tutor_policy::ChatTokenizer::from_dir(&model_dir)
        .with_context(|| format!("loading the run's tokenizer from {}", model_dir.display()))?;
    let store = run_dir.join("trajectories").join("events.log");
    let (events, _) = tutor_coordinator::store::scan(&store)?;
    let mut turns: BTreeMap<u32, tutor_proto::TurnRecord> = BTreeMap::new();
    let mut outcome = None;
    let mut expired = None;
    for ev in events.into_iter().filter(|e| e.episode_id == episode_id) {
        match ev.event {
            Some(Event::Turn(t)) => {
                turns.insert(t.turn_index, t);
            }
            Some(Event::Outcome(o)) => outcome = Some(o),
            Some(Event::LeaseExpired(e)) => expired = Some(e),
            Some(Event::LeaseGranted(_)) | None => {}
        }
    }
    if turns.is_empty() && outcome.is_none() && expired.is_none() {
        anyhow::bail!(
            "no episode {episode_id} in {} (`tutor report {} --episodes` lists them)",
            store.display(),
            run_dir.display()
        );
    }
    for (i, t) in &turns {
        if t.context_rebuilt {
            println!(
                "----- turn {i}: the context outgrew its budget and was rebuilt with older \
                 outputs elided; the model saw all of this -----"
            );
        }
        println!("{}", tok.decode(&t.context_delta_tokens));
        let student = t.executed == Actor::Student as i32;
        let (who, text, other_who, other) = if student {
            ("student", &t.student_text, "teacher", &t.teacher_text)
        } else {
            ("teacher", &t.teacher_text, "student", &t.student_text)
        };
        println!("----- turn {i}: executed the {who}'s reply -----\n{text}");
        if !other.is_empty() && other != text {
            println!("----- turn {i}: the {other_who} proposed -----\n{other}");
        }
        println!("----- turn {i}: end -----");
    }
    if let Some(o) = outcome {
        let status = OutcomeStatus::try_from(o.status)
            .map(|s| s.as_str_name().to_string())
            .unwrap_or_else(|_| format!("status {}", o.status));
        println!(
            "===== {} on {}: {status}, {} turns, submitted: {}, {:.1} s =====",
            episode_id, o.instance_id, o.num_turns, o.submitted, o.duration_s
        );
        if !o.patch.is_empty() {
            println!("{}", o.patch);
        }
    }
    if let Some(e) = expired {
        println!(
            "===== {episode_id}: lease expired ({}), attempt {} of its slot; the coordinator \
             gave the slot to another attempt or failed it =====",
            e.reason, e.attempts
        );
    }
    Ok(())
}

/// Writes the DAgger examples of every stored episode as JSON lines (see `--dump-examples`).
pub fn dump_examples(run_dir: &Path, out: &Path) -> Result<()> {
    use std::io::Write as _;
    let store = run_dir.join("trajectories").join("events.log");
    let (events, _) = tutor_coordinator::store::scan(&store)?;
    let mut turns: BTreeMap<String, Vec<tutor_proto::TurnRecord>> = BTreeMap::new();
    for ev in events {
        if let Some(Event::Turn(t)) = ev.event {
            turns.entry(ev.episode_id).or_default().push(t);
        }
    }
    let file = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    let mut n = 0usize;
    for (id, mut ts) in turns {
        ts.sort_by_key(|t| t.turn_index);
        for ex in tutor_coordinator::dataset::dagger_examples(&id, &ts, usize::MAX / 2) {
            let row = serde_json::json!({
                "episode_id": ex.episode_id,
                "turn_index": ex.turn_index,
                "tokens": ex.tokens,
                "loss_mask": ex.loss_mask,
            });
            writeln!(w, "{row}").with_context(|| format!("writing {}", out.display()))?;
            n += 1;
        }
    }
    w.flush()?;
    println!("{n} examples written to {}", out.display());
    Ok(())
}
