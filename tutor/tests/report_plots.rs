//! `tutor report DIR` writes PNG plots into DIR/plots/, for a run directory and for an
//! experiment directory (results.json), and old metrics rows do not stop it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::json;

const PLOTS: [&str; 3] = ["solve_rate.png", "loss.png", "disagreement.png"];
const WIDTH: u32 = 900;
const HEIGHT: u32 = 600;

fn report(dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tutor"))
        .arg("report")
        .arg(dir)
        .env_remove("TUTOR_PLOT_FONT")
        .output()
        .expect("running tutor report")
}

fn assert_success(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tutor report failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Each plot is a PNG of the expected size, with more in it than a blank canvas, and its
/// path is printed.
fn assert_plots(dir: &Path, stdout: &str) {
    for name in PLOTS {
        let path = dir.join("plots").join(name);
        assert!(
            stdout.contains(&format!("plot: {}", path.display())),
            "{} not printed:\n{stdout}",
            path.display()
        );
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            &bytes[..8],
            b"\x89PNG\r\n\x1a\n",
            "{}: not a PNG",
            path.display()
        );
        assert_eq!(&bytes[12..16], b"IHDR", "{}: no IHDR first", path.display());
        let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((width, height), (WIDTH, HEIGHT), "{}", path.display());
        // A blank 900x600 canvas compresses to about 3 KB; axes, text and curves take more.
        assert!(
            bytes.len() > 8_000,
            "{}: only {} bytes",
            path.display(),
            bytes.len()
        );
    }
}

fn write_rows(run_dir: &Path, rows: &[serde_json::Value]) {
    std::fs::create_dir_all(run_dir).unwrap();
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(run_dir.join("metrics.jsonl"), text).unwrap();
}

/// A run of three iterations whose solve rate rises with `skill` and whose loss falls.
fn synthetic_run(run_dir: &Path, skill: f64, reverse_kl: bool) {
    let rows: Vec<_> = (0..3u32)
        .map(|i| {
            let i_f = f64::from(i);
            let steps: Vec<f64> = (0..4)
                .map(|s| 2.0 / (1.0 + i_f + 0.25 * f64::from(s)))
                .collect();
            let mut row = json!({
                "iteration": i,
                "beta": 1.0 - 0.5 * i_f,
                "algorithm": "dagger",
                "train_loss": steps.iter().sum::<f64>() / steps.len() as f64,
                "step_losses": steps,
                "heldout_solve_rate": (skill * (i_f + 1.0) / 4.0).min(1.0),
                "heldout_episodes": 8,
                "heldout_submit_rate": 0.9,
                "heldout_mean_turns": 6.5,
                "train_submit_rate": 0.8,
                "train_mean_turns": 7.0,
                "student_turn_share": 0.5 * i_f,
                "disagreement_rate": if i == 0 { 0.0 } else { 0.6 / i_f },
                "agreement_rate": if i == 0 { 0.0 } else { 1.0 - 0.6 / i_f },
                "student_format_error_rate": 0.05,
                "teacher_labels_total": 100 * (i + 1),
            });
            if reverse_kl {
                row["reverse_kl"] = json!(1.5 / (1.0 + i_f));
            }
            row
        })
        .collect();
    write_rows(run_dir, &rows);
    let final_eval = json!({"iteration": 3, "heldout_solve_rate": skill.min(1.0),
        "heldout_episodes": 8, "train_loss": 0.0});
    std::fs::write(run_dir.join("final_eval.json"), final_eval.to_string()).unwrap();
}

#[test]
fn a_run_directory_gets_its_three_plots() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path(), 0.8, true);
    let stdout = assert_success(&report(dir.path()));
    assert_plots(dir.path(), &stdout);
}

#[test]
fn rows_older_than_the_new_fields_still_plot() {
    let dir = tempfile::tempdir().unwrap();
    // What a run wrote before step_losses, disagreement_rate and friends existed; no
    // final_eval.json.
    let rows = [
        json!({"iteration": 0, "beta": 1.0, "train_loss": 1.2, "heldout_solve_rate": 0.1}),
        json!({"iteration": 1, "beta": 0.5, "train_loss": 0.9, "heldout_solve_rate": 0.2,
               "agreement_rate": 0.4}),
        json!({"iteration": 2, "beta": 0.25, "train_loss": 0.7}),
    ];
    write_rows(dir.path(), &rows);
    let stdout = assert_success(&report(dir.path()));
    assert_plots(dir.path(), &stdout);
}

#[test]
fn an_experiment_directory_gets_one_curve_per_arm() {
    let exp = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for (arm, skill) in [("bc", 0.4), ("dagger", 0.8)] {
        for seed in 0..2u64 {
            let rel = PathBuf::from("runs").join(format!("{arm}-s{seed}"));
            let s = skill + 0.1 * seed as f64;
            synthetic_run(&exp.path().join(&rel), s, arm == "dagger");
            runs.push(
                json!({"arm": arm, "seed": seed, "run_dir": rel, "status": "ok",
                "error": "", "final_heldout_solve_rate": s, "final_heldout_episodes": 8,
                "teacher_labels": 300, "wall_seconds": 100.0 + seed as f64}),
            );
        }
    }
    // A failed run, whose directory holds nothing: in the table, not in the plots.
    runs.push(
        json!({"arm": "dagger", "seed": 2, "run_dir": "runs/dagger-s2",
        "status": "failed", "error": "learner exited", "final_heldout_solve_rate": null,
        "final_heldout_episodes": 0, "teacher_labels": 0, "wall_seconds": 3.0}),
    );
    let results = json!({"experiment": "dagger-vs-bc",
        "command": "tutor experiment configs/experiments/dagger-vs-bc.toml", "runs": runs});
    std::fs::write(exp.path().join("results.json"), results.to_string()).unwrap();

    let stdout = assert_success(&report(exp.path()));
    assert_plots(exp.path(), &stdout);
    let line = |arm: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(arm))
            .unwrap_or_else(|| panic!("no table line for {arm}:\n{stdout}"))
            .to_string()
    };
    let bc = line("bc ");
    assert!(bc.contains("2/2") && bc.contains("0.450 ± 0.071"), "{bc}");
    let dagger = line("dagger ");
    assert!(
        dagger.contains("2/3") && dagger.contains("0.850 ± 0.071"),
        "{dagger}"
    );
    assert!(
        stdout.contains("left out: dagger seed 2") && stdout.contains("learner exited"),
        "{stdout}"
    );
}

#[test]
fn a_missing_font_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path(), 0.5, false);
    let out = Command::new(env!("CARGO_BIN_EXE_tutor"))
        .arg("report")
        .arg(dir.path())
        .env("TUTOR_PLOT_FONT", dir.path().join("no-such-font.ttf"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no-such-font.ttf") && stderr.contains("TUTOR_PLOT_FONT"),
        "{stderr}"
    );
}
