//! Data-parallel training on the CPU, as torchrun starts it: one `rumble train` process per
//! rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. The ranks meet over
//! TCP and run their collectives through it; two ranks train to the one-process run's losses
//! and weights at the same global batch, only rank 0 writes, a checkpoint of two ranks resumes
//! in one process, a signal to one rank stops both after the same step, and a rank that fails
//! its checks ends the run instead of leaving the other waiting.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use common::{lines, rumble, tmp};
use rumble_models::weights::read_safetensors;
use serde_json::Value;

/// Starts rank `rank` of `world` of `rumble args` (rank 0 at `port`).
fn spawn_rank(args: &[String], rank: usize, world: usize, port: u16) -> Child {
    Command::new(env!("CARGO_BIN_EXE_rumble"))
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs `world` ranks of `rumble args` to the end: each rank's output, in rank order.
fn ranks(args: &[String], world: usize) -> Vec<Output> {
    let port = free_port();
    let children: Vec<Child> = (0..world).map(|r| spawn_rank(args, r, world, port)).collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The flags of a run of the tiny model on the CPU into `out`.
fn flags(out: &Path, extra: &str) -> Vec<String> {
    let s = format!(
        "train --seq 16 --clip 0.5 --grad-accum 2 --schedule constant --warmup 2 --device cpu --json --out {} {extra}",
        out.display()
    );
    s.split_whitespace().map(String::from).collect()
}

fn step_losses(stdout: &str) -> Vec<f64> {
    lines(stdout).iter().filter(|l| l["event"] == "step").map(|l| l["loss"].as_f64().unwrap()).collect()
}

/// Norm-wise relative difference of two checkpoints' tensors (all of them).
fn weights_rel_err(a: &Path, b: &Path) -> f64 {
    let (a, b) = (
        read_safetensors(&a.join("model.safetensors")).unwrap(),
        read_safetensors(&b.join("model.safetensors")).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    let (mut diff, mut norm) = (0.0, 0.0);
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        for (x, y) in ta.to_f64().iter().zip(tb.to_f64()) {
            diff += (x - y) * (x - y);
            norm += y * y;
        }
    }
    (diff / norm).sqrt()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// Two ranks (`mode`: extra flags) against one process at global batch 4: 4 steps with a
/// checkpoint at step 2, then a resume in one process (plain, without data parallelism) to
/// step 6.
fn two_ranks_equal_one_process(name: &str, mode: &str, want_mode: &str) {
    let one = tmp("dp", &format!("{name}-one"));
    let (ok, stdout, err) = rumble(&flags(&one, "--batch 4 --steps 6").iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{err}");
    let want = step_losses(&stdout);
    assert_eq!(want.len(), 6);

    let two = tmp("dp", &format!("{name}-two"));
    let outs = ranks(&flags(&two, &format!("--batch 4 --steps 4 --save-every 2 {mode}")), 2);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", text(&o.stderr));
    }
    // Rank 0 alone speaks and writes; every rank reports the global mean loss.
    assert!(outs[1].stdout.is_empty(), "rank 1 printed: {}", text(&outs[1].stdout));
    let ls = lines(&text(&outs[0].stdout));
    assert_eq!(ls[0]["data_parallel"], serde_json::json!({"world": 2, "rank": 0, "mode": want_mode}));
    assert_eq!((ls[0]["batch"].as_u64(), ls[0]["global_batch"].as_u64()), (Some(2), Some(4)));
    let got = step_losses(&text(&outs[0].stdout));
    assert_eq!(got.len(), 4);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(rel(*g, *w) <= 1e-6, "{name}, step {}: two ranks {g}, one process {w}", i + 1);
    }
    assert!(two.join("checkpoint-2").is_dir() && two.join("model.safetensors").is_file());
    assert_eq!(std::fs::read_to_string(two.join("loss.jsonl")).unwrap().lines().count(), 4);

    // The two-rank checkpoint (the whole optimizer state, gathered under ZeRO-1) resumes in
    // one process, to the one-process run's losses.
    let resume = flags(&two, &format!("--batch 4 --steps 6 --resume {}", two.display()));
    let (ok, stdout, err) = rumble(&resume.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{err}");
    let resumed = step_losses(&stdout);
    assert_eq!(resumed.len(), 2);
    for (i, (g, w)) in resumed.iter().zip(&want[4..]).enumerate() {
        assert!(rel(*g, *w) <= 1e-6, "{name}, step {}: resumed {g}, one process {w}", i + 5);
    }
    let e = weights_rel_err(&two, &one);
    assert!(e <= 1e-6, "{name}: weights after 6 steps: rel. err {e:e}");
    for d in [&one, &two] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn two_ddp_ranks_train_as_one_process_at_the_same_global_batch_and_resume_anywhere() {
    two_ranks_equal_one_process("ddp", "", "ddp");
}

#[test]
fn two_zero1_ranks_train_as_one_process_and_checkpoint_the_whole_state() {
    two_ranks_equal_one_process("zero1", "--zero1", "zero1");
}

#[test]
fn a_global_batch_must_split_and_a_failed_rank_ends_the_run() {
    let out = tmp("dp", "split");
    let outs = ranks(&flags(&out, "--batch 3 --steps 2"), 2);
    for (r, o) in outs.iter().enumerate() {
        let e = text(&o.stderr);
        assert!(
            !o.status.success()
                && e.contains(&format!("rank {r}: --batch 3 (the global batch) does not split over 2 ranks")),
            "{e}"
        );
    }
    // Rank 0 refuses a non-empty --out (only rank 0 checks it); rank 1 learns it at the
    // readiness agreement instead of waiting in the first step's collective.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let outs = ranks(&flags(&out, "--batch 2 --steps 2"), 2);
    let (e0, e1) = (text(&outs[0].stderr), text(&outs[1].stderr));
    assert!(!outs[0].status.success() && e0.contains("rank 0:") && e0.contains("--overwrite"), "{e0}");
    assert!(!outs[1].status.success() && e1.contains("rank 1: data-parallel group: rank 1 lost rank 0"), "{e1}");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    let _ = std::fs::remove_dir_all(&out);

    // Ranks started with different flags are refused by every rank, rank 0 naming them.
    let port = free_port();
    let r0 = spawn_rank(&flags(&out, "--batch 2 --steps 2"), 0, 2, port);
    let r1 = spawn_rank(&flags(&out, "--batch 2 --steps 2 --lr 0.5"), 1, 2, port);
    let (o0, o1) = (r0.wait_with_output().unwrap(), r1.wait_with_output().unwrap());
    let (e0, e1) = (text(&o0.stderr), text(&o1.stderr));
    assert!(!o0.status.success() && e0.contains("rank 1 was started with other flags than rank 0 (lr:"), "{e0}");
    assert!(!o1.status.success() && e1.contains("different flags"), "{e1}");
    assert!(!out.exists(), "nothing written");
}

#[test]
fn a_signal_to_one_rank_stops_both_after_the_same_step() {
    use std::io::{BufRead, BufReader};
    let out: PathBuf = tmp("dp", "sigint");
    let port = free_port();
    let args = flags(&out, "--batch 2 --steps 100000");
    let mut r0 = spawn_rank(&args, 0, 2, port);
    let r1 = spawn_rank(&args, 1, 2, port);
    // Once rank 0 has logged a step, interrupt rank 1 only.
    let mut seen = 0;
    for line in BufReader::new(r0.stdout.take().unwrap()).lines() {
        let l: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if l["event"] == "step" {
            seen += 1;
            if seen == 2 {
                // SAFETY: kill(2) on a child of this test.
                unsafe { libc::kill(r1.id() as libc::pid_t, libc::SIGINT) };
            }
        }
        if l["event"] == "interrupted" {
            assert_eq!(l["signal"], "SIGINT", "{l}");
            break;
        }
    }
    let (o0, o1) = (r0.wait_with_output().unwrap(), r1.wait_with_output().unwrap());
    assert_eq!(
        (o0.status.code(), o1.status.code()),
        (Some(130), Some(130)),
        "{}\n{}",
        text(&o0.stderr),
        text(&o1.stderr)
    );
    // Rank 0 saved the step both stopped after.
    let state: Value = serde_json::from_str(&std::fs::read_to_string(out.join("trainer_state.json")).unwrap()).unwrap();
    let logged = std::fs::read_to_string(out.join("loss.jsonl")).unwrap().lines().count() as u64;
    assert_eq!(state["step"].as_u64(), Some(logged));
    assert!((2..100000).contains(&logged));
    let _ = std::fs::remove_dir_all(&out);
}

/// `rumble plan --gpus N [--zero1]`: rank 0's share of the global batch; under ZeRO-1 its
/// persistent memory is the parameters and 1/N of the optimizer state (up to the shards'
/// padding and the persistent region's alignment).
#[test]
fn plan_shows_a_ranks_share_and_zero1_halves_the_optimizer_state() {
    let plan = |extra: &[&str]| {
        let mut args = vec!["plan", "tiny", "--batch", "4", "--json"];
        args.extend(extra);
        let (ok, stdout, err) = rumble(&args);
        assert!(ok, "{err}");
        lines(&stdout).remove(0)
    };
    let bytes = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k}: {v}"));
    let (one, ddp, zero) = (plan(&[]), plan(&["--gpus", "2"]), plan(&["--gpus", "2", "--zero1"]));
    assert_eq!(bytes(&one, "persistent_bytes"), bytes(&ddp, "persistent_bytes"));
    assert!(bytes(&ddp, "arena_bytes") < bytes(&one, "arena_bytes"), "half the rows: {ddp}");
    // The tiny preset: f32 parameters, AdamW's two moments of each.
    let params = bytes(&one, "persistent_bytes") / 3;
    let want = params + params;
    let got = bytes(&zero, "persistent_bytes");
    assert!(got >= want && got < want + 4096, "ZeRO-1 over 2 ranks keeps {got} bytes, want {want} and padding");
    let (ok, _, err) = rumble(&["plan", "tiny", "--batch", "3", "--gpus", "2"]);
    assert!(!ok && err.contains("does not split over 2 ranks"), "{err}");
}

/// Fine-tuning a Hugging Face folder on JSONL (the packed loader, a tokenizer, validation
/// data whose last batch is padded) on two ranks gives the one-process run's training and
/// validation losses.
#[test]
fn two_ranks_fine_tune_a_folder_with_validation_as_one_process() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/finetune");
    let args = |out: &Path| {
        format!(
            "train --init-from {} --data {} --val-data {} --eval-every 2 --eval-batches 8 --batch 4 --seq 32 \
             --steps 4 --lr 3e-3 --clip 1 --device cpu --seed 1 --json --out {}",
            fx.join("model").display(),
            fx.join("data.jsonl").display(),
            fx.join("val.jsonl").display(),
            out.display()
        )
        .split_whitespace()
        .map(String::from)
        .collect::<Vec<_>>()
    };
    let pick = |stdout: &str, key: &str| -> Vec<f64> {
        lines(stdout).iter().filter_map(|l| l.get(key).and_then(Value::as_f64)).collect()
    };
    let one = tmp("dp", "ft-one");
    let (ok, stdout, err) = rumble(&args(&one).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "{err}");
    let (loss, val) = (pick(&stdout, "loss"), pick(&stdout, "val_loss"));
    let two = tmp("dp", "ft-two");
    let outs = ranks(&args(&two), 2);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", text(&o.stderr));
    }
    let stdout = text(&outs[0].stdout);
    let (loss2, val2) = (pick(&stdout, "loss"), pick(&stdout, "val_loss"));
    assert_eq!((loss.len(), val.len()), (4, 3), "4 steps, validation at 2 and 4 and in the done line");
    assert_eq!((loss2.len(), val2.len()), (4, 3));
    for (a, b) in loss2.iter().zip(&loss).chain(val2.iter().zip(&val)) {
        assert!(rel(*a, *b) <= 1e-6, "two ranks {a}, one process {b}");
    }
    for d in [&one, &two] {
        let _ = std::fs::remove_dir_all(d);
    }
}
