//! The `rumble` binary as a user runs it: training writes JSON lines, a checkpoint and a loss
//! log; a checkpoint trains on; bad input gets a one-line error and a non-zero exit.

mod common;

use common::{lines, rumble, tmp};
use serde_json::Value;

#[test]
fn train_writes_json_lines_checkpoint_and_log_then_resumes() {
    let out = tmp("cli", "train");
    let o = out.to_str().unwrap();
    let args = [
        "train", "--steps", "6", "--batch", "2", "--seq", "16", "--json", "--out", o, "--device", "cpu", "--clip", "1",
    ];
    let (ok, stdout, stderr) = rumble(&args);
    assert!(ok, "{stderr}");
    let ls = lines(&stdout);
    assert_eq!(ls[0]["event"], "start");
    let steps: Vec<&Value> = ls.iter().filter(|l| l["event"] == "step").collect();
    assert_eq!(steps.len(), 6);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i + 1);
        assert!(s["loss"].as_f64().is_some_and(|l| l > 0.0 && l < 6.0), "{s}");
        assert!(s["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0) && s["grad_norm"].is_number(), "{s}");
    }
    let done = ls.last().unwrap();
    assert_eq!(done["event"], "done");
    // The throughput of steps 2..=6 (the first left out); no device memory or MFU on the CPU.
    assert!(done["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{done}");
    assert_eq!(done["timed_steps"], 5, "{done}");
    for key in ["peak_bytes", "mfu"] {
        assert!(done.get(key).is_some_and(Value::is_null), "`{key}` must be null on the CPU: {done}");
    }
    assert_eq!(std::fs::read_to_string(out.join("loss.jsonl")).unwrap().lines().count(), 6);
    assert!(out.join("model.safetensors").is_file() && out.join("config.json").is_file());

    // Resume from the checkpoint (its config.json is picked up) with SGD and accumulation.
    let ckpt = out.join("model.safetensors");
    let out2 = tmp("cli", "resume");
    let args = [
        "train",
        "--init-from",
        ckpt.to_str().unwrap(),
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--optimizer",
        "sgd",
        "--lr",
        "0.01",
        "--grad-accum",
        "2",
        "--json",
        "--out",
        out2.to_str().unwrap(),
    ];
    let (ok, stdout, stderr) = rumble(&args);
    assert!(ok, "{stderr}");
    let ls = lines(&stdout);
    // A checkpoint of the tiny preset keeps the preset's name (and its defaults, flags aside).
    assert_eq!(ls[0]["model"], "tiny");
    assert_eq!((ls[0]["batch"].as_u64(), ls[0]["seq"].as_u64(), ls[0]["lr"].as_f64()), (Some(2), Some(16), Some(0.01)));
    assert_eq!((ls[0]["grad_accum"].as_u64(), ls[0]["optimizer"].as_str()), (Some(2), Some("sgd")));
    // The resumed model starts where the first run ended, well below ln 256.
    let first = ls.iter().find(|l| l["event"] == "step").unwrap()["loss"].as_f64().unwrap();
    assert!(first < 5.3, "resumed loss {first}");
}

#[test]
fn bad_input_is_one_clear_error() {
    let cases: [(&[&str], &str); 4] = [
        (&["train", "--config", "huge"], "unknown preset `huge`"),
        (&["train", "--device", "tpu"], "unknown device `tpu`"),
        (&["train", "--device", "cuda", "--steps", "1"], "device `cuda` is not available"),
        (&["train", "--init-from", "/nonexistent/model.safetensors"], "/nonexistent/model.safetensors"),
    ];
    for (args, want) in cases {
        let (ok, _, stderr) = rumble(args);
        assert!(!ok && stderr.starts_with("error: ") && stderr.contains(want), "{args:?}: {stderr}");
    }
}

#[test]
fn plan_and_bench_print_json() {
    let (ok, stdout, stderr) = rumble(&["plan", "--config", "seed-qwen2", "--seq", "64", "--json"]);
    assert!(ok, "{stderr}");
    let p = &lines(&stdout)[0];
    assert_eq!(p["trace"], "qwen2_train_step");
    assert!(p["nodes"].as_u64().is_some_and(|n| n > 100), "{p}");
    let (load, arena) = (p["load_bytes"].as_u64().unwrap(), p["arena_bytes"].as_u64().unwrap());
    assert!(load > 0 && arena >= load, "{p}");
    // --layers plans fewer layers of the same model: fewer nodes, fewer bytes held.
    let (ok, stdout, stderr) = rumble(&["plan", "--config", "seed-qwen2", "--seq", "64", "--layers", "2", "--json"]);
    assert!(ok, "{stderr}");
    let q = &lines(&stdout)[0];
    assert!(q["nodes"].as_u64() < p["nodes"].as_u64(), "{q}");
    assert!(q["persistent_bytes"].as_u64() < p["persistent_bytes"].as_u64(), "{q}");
    let (ok, _, stderr) = rumble(&["plan", "--config", "seed-qwen2", "--layers", "0"]);
    assert!(!ok && stderr.contains("--layers"), "{stderr}");
    let (ok, stdout, stderr) =
        rumble(&["bench", "tiny", "--steps", "1", "--batch", "1", "--seq", "8", "--json", "--device", "cpu"]);
    assert!(ok, "{stderr}");
    let b = &lines(&stdout)[0];
    assert_eq!((b["workload"].as_str(), b["executor"].as_str()), (Some("tiny"), Some("rumble-cpu")));
    assert!(b["median_step_ms"].as_f64().is_some_and(|m| m > 0.0), "{b}");
}

/// `--data-parallel`: the step as a one-rank DDP program (its collectives identities on the
/// CPU) trains to the plain step's losses and weights, bit for bit, with clipping and
/// accumulation; the start line says so.
#[test]
fn a_one_rank_data_parallel_run_is_the_plain_run() {
    let run = |name: &str, extra: &[&str]| {
        let out = tmp("cli", name);
        let o = out.to_str().unwrap();
        let mut args =
            vec!["train", "--steps", "4", "--batch", "2", "--seq", "16", "--grad-accum", "2", "--clip", "0.5"];
        args.extend(["--json", "--out", o, "--device", "cpu"]);
        args.extend(extra);
        let (ok, stdout, stderr) = rumble(&args);
        assert!(ok, "{stderr}");
        let ls = lines(&stdout);
        let losses: Vec<String> = ls.iter().filter(|l| l["event"] == "step").map(|l| l["loss"].to_string()).collect();
        (ls[0]["data_parallel"].clone(), losses, std::fs::read(out.join("model.safetensors")).unwrap())
    };
    let (dp0, plain, w0) = run("plain", &[]);
    let (dp1, ranked, w1) = run("dp1", &["--data-parallel"]);
    assert!(dp0.is_null(), "{dp0}");
    assert_eq!(dp1, serde_json::json!({"world": 1, "rank": 0, "mode": "ddp"}));
    assert_eq!((plain.len(), &plain), (4, &ranked));
    assert!(w0 == w1, "the weights differ");
}

/// `rumble train` with `--gpus N` or under torchrun's environment: read into one launch, bad
/// values named before anything is written; one rank trains (`tests/data_parallel.rs` runs
/// several).
#[test]
fn gpus_and_the_torchrun_environment_are_checked() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_rumble"));
        for v in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            c.env_remove(v);
        }
        let out = c.args(args).envs(env.iter().copied()).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let out = tmp("cli", "gpus");
    let o = out.to_str().unwrap();
    let (ok, err) = run(&["train", "--gpus", "2", "--out", o], &[]);
    assert!(!ok && err.starts_with("error: "), "{err}");
    assert!(err.contains("--gpus 2 needs 2 CUDA devices"), "{err}");
    assert!(!out.exists(), "a refused run leaves no folder");
    let (ok, err) = run(&["train", "--gpus", "0", "--out", o], &[]);
    assert!(!ok && err.contains("--gpus must be at least 1"), "{err}");
    let (ok, err) = run(&["train", "--gpus", "2", "--device", "cpu", "--out", o], &[]);
    assert!(!ok && err.contains("starts a process per GPU") && err.contains("torchrun's variables"), "{err}");
    let torchrun = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let (ok, err) = run(&["train", "--gpus", "2", "--out", o], &torchrun);
    assert!(!ok && err.contains("leave --gpus out"), "{err}");
    let (ok, err) = run(&["train", "--out", o], &[("RANK", "0"), ("WORLD_SIZE", "two"), ("LOCAL_RANK", "0")]);
    assert!(!ok && err.contains("WORLD_SIZE=`two` is not a whole number"), "{err}");
    assert!(!out.exists());
    // One rank under torchrun is an ordinary run.
    let one = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
    let args = ["train", "--steps", "1", "--batch", "2", "--seq", "16", "--device", "cpu", "--json", "--out", o];
    let (ok, err) = run(&args, &one);
    assert!(ok, "{err}");
    assert!(out.join("model.safetensors").is_file());
    let _ = std::fs::remove_dir_all(&out);
}
