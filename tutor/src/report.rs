//! `tutor report`: what a run directory holds, readable at 3 a.m. — the iteration table
//! from metrics.jsonl and, on request, one line per stored episode.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use tutor_proto::episode_event::Event;
use tutor_proto::{Actor, OutcomeStatus};

use crate::run::{header, row};

pub fn report(run_dir: &Path, episodes: bool) -> Result<()> {
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
            None => {}
        }
    }
    println!(
        "\n{:<22} {:<36} {:<16} {:>5} {:>7} {:>7} {:>8} {:>7}",
        "episode", "task", "status", "turns", "teacher", "student", "fmt_err", "seconds"
    );
    for (id, e) in eps {
        let status = if e.status.is_empty() {
            "INCOMPLETE".to_string()
        } else {
            e.status
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
