//! Fine-tuning a Hugging Face model folder with `rumble train`, as a user would. The fixture
//! (`finetune/`, made by `finetune/make_fixture.py` with transformers and tokenizers) is a
//! small LLaMA written by `save_pretrained` in two shards with their index, a byte-level BPE
//! tokenizer.json, and JSONL data (prompt/response pairs and text records). The run must read
//! the folder, tokenize and pack the data, lower the loss, and write a folder that rumble and
//! transformers read back (the transformers check runs where `RUMBLE_PYTHON`, default
//! `python3`, imports torch and transformers: `finetune/check_load.py`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{lines, log_lines, rumble, tmp};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/finetune")
}

/// Runs `rumble train ARGS --json` and returns its JSON lines.
fn train(args: &[&str]) -> Vec<Value> {
    let (ok, stdout, stderr) = rumble(&[&["train"], args, &["--json"]].concat());
    assert!(ok, "rumble train {args:?} failed:\n{stderr}");
    lines(&stdout)
}

fn losses(lines: &[Value]) -> Vec<f64> {
    lines.iter().filter(|l| l["event"] == "step").map(|l| l["loss"].as_f64().unwrap()).collect()
}

#[test]
fn a_sharded_hugging_face_folder_fine_tunes_on_jsonl_and_loads_back() {
    let fx = fixture();
    let (model, data, val) = (fx.join("model"), fx.join("data.jsonl"), fx.join("val.jsonl"));
    assert!(model.join("model.safetensors.index.json").is_file() && !model.join("model.safetensors").exists());
    let out = tmp("finetune", "run");
    let common = ["--batch", "4", "--seq", "32", "--lr", "3e-3", "--device", "cpu", "--seed", "1"];
    let lines = train(
        &[
            &["--init-from", model.to_str().unwrap(), "--data", data.to_str().unwrap()][..],
            &["--val-data", val.to_str().unwrap(), "--steps", "60", "--out", out.to_str().unwrap()],
            &common,
        ]
        .concat(),
    );
    let start = &lines[0];
    assert!(start["tokenizer"].as_str().unwrap().ends_with("tokenizer.json"), "{start}");
    assert!(start["data_windows"].as_u64().unwrap() > 100 && start["val_windows"].as_u64().unwrap() > 5, "{start}");
    let l = losses(&lines);
    let (first, last5) = (l[0], l[l.len() - 5..].iter().sum::<f64>() / 5.0);
    eprintln!("loss {first:.3} -> {last5:.3} (mean of the last 5 steps)");
    // From about ln 320 = 5.77 (a random model) to well below.
    assert!(first > 5.0 && last5 < 0.6 * first, "loss {first} -> {last5}");

    // The checkpoint is a model folder with the tokenizer files copied along.
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(out.join(f).is_file(), "{f} missing in {}", out.display());
    }
    // It trains on from where the run ended.
    let out2 = tmp("finetune", "again");
    let again = train(
        &[
            &["--init-from", out.to_str().unwrap(), "--data", data.to_str().unwrap()][..],
            &["--steps", "2", "--warmup", "0", "--lr", "1e-6", "--out", out2.to_str().unwrap()],
            &common[..4],
            &common[6..],
        ]
        .concat(),
    );
    let resumed = losses(&again)[0];
    assert!(resumed < 0.7 * first, "a fine-tuned folder starts at loss {resumed}");

    // transformers reads the result (where it is installed).
    let python = std::env::var("RUMBLE_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_hf =
        Command::new(&python).args(["-c", "import torch, transformers"]).output().is_ok_and(|o| o.status.success());
    if !has_hf {
        eprintln!("transformers check skipped: `{python}` cannot import torch and transformers (set RUMBLE_PYTHON)");
        return;
    }
    let check = Command::new(&python).arg(fx.join("check_load.py")).arg(&out).arg(&fx).output().unwrap();
    let report = String::from_utf8_lossy(&check.stdout);
    eprintln!("transformers: {report}");
    assert!(check.status.success(), "{report}\n{}", String::from_utf8_lossy(&check.stderr));
}

#[test]
fn data_flags_give_clear_errors() {
    let fx = fixture();
    let model = fx.join("model");
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_rumble"))
            .args(["train", "--init-from", model.to_str().unwrap(), "--steps", "1", "--device", "cpu", "--seq", "16"])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let bad = tmp("finetune", "bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"prompt\": 1, \"response\": \"r\"}\n").unwrap();
    let e = run(&["--data", bad.to_str().unwrap()]);
    assert!(e.contains("bad.jsonl") && e.contains("line 2") && e.contains("`prompt` must be a string"), "{e}");
    let data = fx.join("data.jsonl");
    let e = run(&["--data", data.to_str().unwrap(), "--val-fraction", "1.5"]);
    assert!(e.contains("--val-fraction 1.5"), "{e}");
    let e = run(&["--data", fx.join("nope.jsonl").to_str().unwrap()]);
    assert!(e.contains("nope.jsonl"), "{e}");
}

/// A fine-tune of a model folder resumes bit for bit: 8 steps in one run and 4 + 4 with
/// `--resume` (without `--init-from`: the run's folder holds the model now) give the same loss
/// lines, validation included (every 4 steps: a run also validates at its last step, so the
/// cut is at a multiple), at bf16-mixed. What `scripts/gpu finetune` checks on the GPU.
#[test]
fn a_folder_fine_tune_resumes_bit_for_bit() {
    let fx = fixture();
    let (model, data) = (fx.join("model"), fx.join("data.jsonl"));
    let flags = |out: &Path, steps: &str| -> Vec<String> {
        let s = format!(
            "--data {} --val-fraction 0.1 --eval-every 4 --precision bf16-mixed --device cpu --batch 2 --seq 32 \
             --lr 1e-3 --clip 1 --schedule constant --warmup 2 --steps {steps} --out {}",
            data.display(),
            out.display()
        );
        s.split_whitespace().map(String::from).collect()
    };
    let run = |args: Vec<String>| train(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let init = ["--init-from".to_string(), model.display().to_string()];
    let (one, two) = (tmp("finetune", "whole"), tmp("finetune", "halves"));
    run([&init[..], &flags(&one, "8")].concat());
    run([&init[..], &flags(&two, "4")].concat());
    let resumed = run([flags(&two, "8"), vec!["--resume".into(), two.display().to_string()]].concat());
    assert_eq!(resumed[0]["start_step"], 4, "{}", resumed[0]);
    assert_eq!(resumed[0]["model"], "model", "the name the run started with: {}", resumed[0]);
    let (a, b) = (log_lines(&one), log_lines(&two));
    assert_eq!(a.len(), 8);
    assert!(a.iter().filter(|l| !l.ends_with("null")).count() >= 2, "validation logged: {a:?}");
    assert_eq!(a, b, "8 steps vs 4 + 4 resumed");
    for d in [&one, &two] {
        let _ = std::fs::remove_dir_all(d);
    }
}
