//! Helpers shared by the cross-process tests: find the `tutor` binary, run it.
// Each test binary uses a subset of these.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `tutor` binary: $TUTOR_BIN, else target/debug/tutor of this workspace (built by
/// `make test` before the suite runs).
pub fn tutor_bin() -> PathBuf {
    if let Ok(p) = std::env::var("TUTOR_BIN") {
        return PathBuf::from(p);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    let bin = target.join("debug").join("tutor");
    assert!(
        bin.exists(),
        "{} is missing: build it first with `cargo build --bin tutor` (make test does)",
        bin.display()
    );
    bin
}

/// The venv interpreter with pytest, as the Makefile exports it.
pub fn python() -> String {
    std::env::var("TUTOR_PYTHON").unwrap_or_else(|_| {
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
        if venv.exists() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    })
}

pub fn tutor(args: &[&str]) -> Output {
    Command::new(tutor_bin())
        .args(args)
        .env("TUTOR_PYTHON", python())
        .output()
        .expect("running tutor")
}
