//! Helpers shared by the tests that run the `rumble` binary as a user does.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Runs `rumble args`: (exit status success, stdout, stderr).
pub fn rumble(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rumble")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// A fresh (removed) folder `rumble-{what}-{pid}-{name}` under the temporary folder.
pub fn tmp(what: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rumble-{what}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every line of `stdout` as JSON (a test failure names a line that is not).
pub fn lines(stdout: &str) -> Vec<Value> {
    stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect()
}

/// The loss log (`loss.jsonl`) of the run in `dir`, a line each without its timings: step,
/// loss, learning rate, gradient norm and validation loss as text (equal text: equal bits).
pub fn log_lines(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("loss.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            format!("{} {} {} {} {}", v["step"], v["loss"], v["lr"], v["grad_norm"], v["val_loss"])
        })
        .collect()
}
