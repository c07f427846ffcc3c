//! The loop teaches: a shortened experiment (configs/experiments/learning-check.toml, the
//! quickstart's DAgger run with a smaller final evaluation) trains the student from scratch, and the
//! final held-out evaluation of the trained policy solves clearly more tasks than the
//! untrained student (which solves none). Judged by held-out solve rates, not the loss.

mod common;

#[test]
fn a_shortened_dagger_experiment_raises_the_held_out_solve_rate() {
    let dir = tempfile::tempdir().unwrap();
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs/experiments/learning-check.toml");
    let out = std::process::Command::new(common::tutor_bin())
        .args(["experiment", file.to_str().unwrap(), "--out-dir"])
        .arg(dir.path())
        .env("TUTOR_PYTHON", common::python())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let exp = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("results.json").exists())
        .unwrap_or_else(|| panic!("no results.json\nstdout:\n{stdout}\nstderr:\n{stderr}"));
    let logs: String = std::fs::read_dir(exp.join("logs"))
        .map(|d| {
            d.flatten()
                .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        out.status.success(),
        "the experiment failed\nstdout:\n{stdout}\nstderr:\n{stderr}\nrun log:\n{logs}"
    );
    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exp.join("results.json")).unwrap()).unwrap();
    let run = &results["runs"][0];
    assert_eq!(run["status"], "ok", "{results}");
    let initial = run["initial_heldout_solve_rate"].as_f64().unwrap();
    let last = run["final_heldout_solve_rate"].as_f64().unwrap();
    assert_eq!(run["final_heldout_episodes"], 32, "{results}");
    // The untrained student solves nothing; 8 iterations of the quickstart reach about
    // half on average, but one seed's runs differ (which episodes each worker runs
    // depends on timing): DAgger finals of 10–20 of 32 in docs/RESULTS.md's runs, and a
    // run of this test ended at 3 of 16. 5 of 32 is clearly above the untrained
    // student and below every run seen.
    assert_eq!(
        initial, 0.0,
        "the untrained student solved something: {results}"
    );
    assert!(
        last >= 5.0 / 32.0,
        "the trained student solved {last} of the held-out tasks (untrained: {initial})\n{logs}"
    );
}
