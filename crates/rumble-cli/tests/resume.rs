//! Runs that lose nothing, as a user runs them: 20 steps in one run equal 10 + 10 with
//! `--resume`, loss line for loss line; SIGINT finishes the step, saves and exits non-zero, and
//! the run resumes from there to the same losses; a resume with other flags is refused.
//! Validation losses land in the loss log every `--eval-every` steps.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use common::{log_lines, rumble, tmp};
use serde_json::Value;

/// Asserts that the runs in `a` and `b` logged the same lines (`what` says how they ran),
/// then removes both folders.
fn same_log_then_remove(a: &Path, b: &Path, what: &str) {
    assert_eq!(log_lines(a), log_lines(b), "{what}");
    for d in [a, b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The flags of a run of the tiny model on the CPU.
fn flags(out: &Path, steps: u32, extra: &str) -> Vec<String> {
    let s = format!("train --steps {steps} --clip 1 --warmup 3 --device cpu --json --out {} {extra}", out.display());
    s.split_whitespace().map(String::from).collect()
}

fn run(args: &[String]) -> (bool, String, String) {
    rumble(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn ten_plus_ten_resumed_equals_twenty() {
    // A constant schedule: the learning rate of a step does not depend on --steps, so a
    // 10-step run is the first half of the 20-step one.
    let shape = "--batch 2 --seq 16 --schedule constant";
    let one = tmp("resume", "one");
    let (ok, _, err) = run(&flags(&one, 20, shape));
    assert!(ok, "{err}");
    let two = tmp("resume", "two");
    let (ok, _, err) = run(&flags(&two, 10, &format!("{shape} --save-every 4 --keep-last 1")));
    assert!(ok, "{err}");
    assert!(two.join("checkpoint-8").is_dir() && !two.join("checkpoint-4").exists());
    assert_eq!(log_lines(&two).len(), 10);

    // Other flags than the run's are refused, naming what differs.
    let (ok, _, err) = run(&flags(&two, 20, &format!("{shape} --lr 0.1 --resume {}", two.display())));
    assert!(!ok && err.contains("lr: 0.003 -> 0.1"), "{err}");

    let (ok, stdout, err) = run(&flags(&two, 20, &format!("{shape} --resume {}", two.display())));
    assert!(ok, "{err}");
    assert!(stdout.contains("\"start_step\":10"), "{stdout}");
    same_log_then_remove(&one, &two, "20 steps vs 10 + 10 resumed");
}

#[test]
fn sigint_finishes_the_step_saves_and_the_run_resumes_to_the_same_losses() {
    // The cosine schedule over 40 steps; the tiny preset's batch shape.
    let one = tmp("resume", "whole");
    let (ok, _, err) = run(&flags(&one, 40, ""));
    assert!(ok, "{err}");

    let cut = tmp("resume", "cut");
    let args = flags(&cut, 40, "");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rumble"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Wait for the first step, then interrupt as Ctrl-C would.
    for l in lines.by_ref() {
        if l.unwrap().contains("\"event\":\"step\"") {
            break;
        }
    }
    let killed = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted by SIGINT after step") && err.contains("--resume"), "{err}");
    let stopped: Value = serde_json::from_str(rest.last().unwrap()).unwrap();
    assert_eq!(stopped["event"], "interrupted");
    let at = stopped["step"].as_u64().unwrap();
    assert!(at < 40 && log_lines(&cut).len() as u64 == at, "stopped at {at}");

    let (ok, _, err) = run(&flags(&cut, 40, &format!("--resume {}", cut.display())));
    assert!(ok, "{err}");
    same_log_then_remove(&one, &cut, &format!("interrupted at {at} and resumed"));
}

#[test]
fn eval_every_reports_validation_loss() {
    let out = tmp("resume", "eval");
    let (ok, stdout, err) = run(&flags(&out, 6, "--batch 2 --seq 16 --eval-every 3 --log-every 100"));
    assert!(ok, "{err}");
    let log: Vec<Value> = std::fs::read_to_string(out.join("loss.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let with_val: Vec<u64> =
        log.iter().filter(|l| l["val_loss"].is_number()).map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(with_val, vec![3, 6], "{log:?}");
    let v = log.last().unwrap()["val_loss"].as_f64().unwrap();
    assert!(v > 1.0 && v < 6.0, "{v}");
    assert!(stdout.contains("\"val_bytes\":") && stdout.contains("\"precision\":\"32-true\""), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}
