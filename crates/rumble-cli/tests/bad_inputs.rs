//! The bad-input corpus: configs in `tests/bad_inputs/`, plus files made here (a checkpoint
//! holding NaN, a truncated one, a FIFO, a folder, a linked log, a locked run folder) and
//! option values at 2^31, 2^32, 2^62 and 2^64-1. Every case runs the `rumble` binary under a
//! time limit and must end with status 1 (or clap's 2), an `error:` line naming the culprit,
//! no panic or abort, and the files already in `--out` byte-identical afterwards. A step whose
//! loss is not finite (weights so large the forward overflows) is one of them: the run stops
//! before any checkpoint, naming the first non-finite parameter.
//!
//! Also here: a closed or full stdout (`| head -1`, `> /dev/full`) never panics and keeps the
//! checkpoint, and a file called `tiny` in the working folder does not shadow the preset.

use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rumble_models::{Weights, host, preset};

const LIMIT: Duration = Duration::from_secs(120);

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rumble-bad-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn corpus(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad_inputs").join(name).to_string_lossy().into_owned()
}

/// Runs `rumble args` in `cwd` with a time limit: (exit code, stderr). A hang fails the test.
fn run(args: &[String], cwd: &Path, stdout: Stdio) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rumble"))
        .args(args)
        .current_dir(cwd)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status.code(), err);
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("rumble {args:?} hung (over {LIMIT:?})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What `--out` holds before each case.
const SENTINELS: [(&str, &[u8]); 3] = [
    ("model.safetensors", b"sentinel model bytes"),
    ("config.json", b"{\"sentinel\": true}"),
    ("loss.jsonl", b"{\"step\": 1, \"loss\": 5.5}\n"),
];

fn fill(out: &Path) {
    std::fs::create_dir_all(out).unwrap();
    for (name, bytes) in SENTINELS {
        std::fs::write(out.join(name), bytes).unwrap();
    }
}

/// `train` on the CPU into `out` with `--overwrite`, unless the case sets those itself.
fn train(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--device", "cpu"].iter().map(|s| s.to_string()).collect();
    if !extra.contains(&"--steps") {
        a.extend(["--steps".into(), "2".into()]);
    }
    if !extra.contains(&"--out") {
        a.extend(["--out".into(), out.to_string_lossy().into_owned(), "--overwrite".into()]);
    }
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn every_bad_input_is_one_named_error_and_changes_nothing() {
    let root = tmp("corpus");
    let out = root.join("out");
    let o = out.to_string_lossy().into_owned();
    let p = |name: &str| root.join(name).to_string_lossy().into_owned();

    // Made here: a checkpoint of the tiny preset with one NaN, a truncated one, a FIFO, a folder.
    let cfg = preset("tiny").unwrap().config;
    let mut w = Weights::init(&cfg, 0).unwrap();
    let bad = "model.layers.1.mlp.down_proj.weight";
    let t = &mut w.tensors.iter_mut().find(|(n, _)| n == bad).unwrap().1;
    let mut vals = host::to_f32s(t).unwrap();
    vals[7] = f32::NAN;
    *t = host::from_f32s(t.ty.dtype, t.ty.dims(), &vals).unwrap();
    w.save(&root.join("nan.safetensors")).unwrap();
    let good = Weights::init(&cfg, 0).unwrap();
    good.save(&root.join("good.safetensors")).unwrap();
    let bytes = std::fs::read(root.join("good.safetensors")).unwrap();
    std::fs::write(root.join("truncated.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    // Finite weights so large that the first forward overflows: the step's loss is NaN.
    let mut huge = good.clone();
    for (_, t) in huge.tensors.iter_mut().filter(|(n, _)| n.contains("embed_tokens")) {
        let n = t.ty.numel();
        *t = host::from_f32s(t.ty.dtype, t.ty.dims(), &vec![1e30; n]).unwrap();
    }
    huge.save(&root.join("huge.safetensors")).unwrap();
    let fifo = root.join("fifo");
    let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::create_dir_all(root.join("folder")).unwrap();
    std::fs::write(root.join("a_file"), b"not a folder").unwrap();

    let mut cases: Vec<(&str, Vec<String>, Vec<String>)> = vec![];
    let mut case = |name: &'static str, a: Vec<String>, want: &[&str]| {
        cases.push((name, a, want.iter().map(|s| s.to_string()).collect()));
    };
    // Configs: sizes at 2^31, 2^32, 2^62, 2^64-1 and 10^9, 10^12; bad values; bad files.
    for (file, want) in [
        ("config_vocab_2p62.json", &["config_vocab_2p62.json", "`vocab_size`"][..]),
        ("config_hidden_2p64.json", &["config_hidden_2p64.json", "`hidden_size`"]),
        ("config_vocab_hidden_2p31.json", &["config_vocab_hidden_2p31.json", "2147483648"]),
        ("config_layers_2p32.json", &["config_layers_2p32", "needs", "free"]),
        ("config_layers_1e9.json", &["config_layers_1e9", "needs", "free"]),
        ("config_vocab_1e12.json", &["config_vocab_1e12", "needs", "free"]),
        ("config_rope_theta_negative.json", &["config_rope_theta_negative.json", "`rope_theta`"]),
        ("config_rope_scaling_yarn.json", &["config_rope_scaling_yarn.json", "`rope_scaling.type`", "yarn"]),
        ("config_kv_heads_zero.json", &["config_kv_heads_zero.json", "`num_key_value_heads`"]),
        ("config_truncated.json", &["config_truncated.json", "JSON"]),
        ("config_binary.json", &["config_binary.json", "UTF-8"]),
    ] {
        case("config", train(&out, &["--config", &corpus(file)]), want);
    }
    case("plan 10^9 layers", args(&["plan", &corpus("config_layers_1e9.json")]), &["config_layers_1e9", "needs"]);
    case(
        "bench 10^12 vocab",
        args(&["bench", &corpus("config_vocab_1e12.json"), "--device", "cpu", "--steps", "1"]),
        &["config_vocab_1e12", "needs"],
    );
    case("empty config folder", train(&out, &["--config", &p("folder")]), &["folder/config.json"]);
    // Data files.
    case("empty data", train(&out, &["--data", &corpus("data_empty.txt")]), &["data_empty.txt", "0 bytes"]);
    case("short data", train(&out, &["--data", &corpus("data_short.txt")]), &["data_short.txt", "5 bytes"]);
    case("device as data", train(&out, &["--data", "/dev/zero"]), &["/dev/zero", "regular file"]);
    case("device as config", train(&out, &["--config", "/dev/zero"]), &["/dev/zero", "regular file"]);
    case("device as checkpoint", train(&out, &["--init-from", "/dev/zero"]), &["/dev/zero", "regular file"]);
    case("fifo as data", train(&out, &["--data", &p("fifo")]), &["fifo", "regular file"]);
    case("folder as data", train(&out, &["--data", &p("folder")]), &["folder", "folder"]);
    case(
        "buckets past the data",
        train(&out, &["--data", &corpus("data_short.txt"), "--buckets", "2,64"]),
        &["data_short.txt", "64 tokens"],
    );
    case("seq past the data", train(&out, &["--seq", "1000000000"]), &["1000000000 tokens"]);
    // Checkpoints.
    case("NaN weights", train(&out, &["--init-from", &p("nan.safetensors")]), &["nan.safetensors", bad, "NaN"]);
    case(
        "truncated checkpoint",
        train(&out, &["--init-from", &p("truncated.safetensors")]),
        &["truncated.safetensors", "safetensors"],
    );
    // Hyper-parameters.
    for (flag, v) in [
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--lr", "-1"),
        ("--weight-decay", "-0.1"),
        ("--weight-decay", "nan"),
        ("--clip", "0"),
        ("--clip", "-1"),
    ] {
        case("hyper", train(&out, &[&format!("{flag}={v}")]), &[flag]);
    }
    case("momentum", train(&out, &["--optimizer", "sgd", "--momentum", "1.5"]), &["--momentum"]);
    case("steps 0", train(&out, &["--steps", "0"]), &["--steps"]);
    case("warmup past the run", train(&out, &["--steps", "5", "--warmup", "10"]), &["warmup"]);
    // Sizes from options, in train, plan and bench.
    for (b, t) in [
        ("4294967296", "4294967296"),
        ("2147483648", "2147483648"),
        ("1", "4611686018427387904"),
        ("18446744073709551615", "2"),
    ] {
        let want = format!("batch {b} x seq {t}");
        case("sizes", train(&out, &["--batch", b, "--seq", t]), &[&want]);
        case("sizes", args(&["plan", "--batch", b, "--seq", t, "--memory-budget", "12GB"]), &[&want]);
        case("sizes", args(&["bench", "--batch", b, "--seq", t, "--device", "cpu"]), &[&want]);
    }
    case("batch 2^64", train(&out, &["--batch", "18446744073709551616"]), &["--batch"]);
    case("grad-accum 2^32", train(&out, &["--grad-accum", "4294967296"]), &["4294967296 micro-batch", "needs"]);
    case("bench seq 10^9", args(&["bench", "--seq", "1000000000", "--device", "cpu", "--steps", "1"]), &["needs"]);
    // The run folder.
    case("out is a file", train(&out, &["--out", &p("a_file")]), &["a_file", "folder"]);
    case("out not empty", train(&out, &["--out", &o]), &[&o, "not empty", "--overwrite"]);
    case(
        "init-from in out",
        train(&out, &["--config", "tiny", "--init-from", &format!("{o}/model.safetensors")]),
        &["--init-from"],
    );
    case("svg into nowhere", args(&["plan", "--svg", "/nonexistent/plan.svg"]), &["/nonexistent/plan.svg"]);

    for (name, a, want) in &cases {
        let _ = std::fs::remove_dir_all(&out);
        fill(&out);
        let (code, err) = run(a, &root, Stdio::null());
        assert!(
            matches!(code, Some(1) | Some(2)),
            "{name} {a:?}: exit {code:?} (a panic is 101, a signal None)\n{err}"
        );
        assert!(err.starts_with("error: ") && !err.contains("panicked"), "{name} {a:?}: {err}");
        for w in want {
            assert!(err.contains(w.as_str()), "{name} {a:?}: `{w}` not named in: {err}");
        }
        for (file, bytes) in SENTINELS {
            assert_eq!(std::fs::read(out.join(file)).unwrap(), bytes, "{name} {a:?} changed {file}");
        }
        let left: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !SENTINELS.iter().any(|(s, _)| s == n) && n != ".rumble.lock")
            .collect();
        assert!(left.is_empty(), "{name} {a:?} left {left:?} in --out");
    }

    // A linked log and a folder held by another run.
    let linked = root.join("linked");
    fill(&linked);
    std::fs::remove_file(linked.join("loss.jsonl")).unwrap();
    std::fs::write(root.join("precious.txt"), b"keep").unwrap();
    std::os::unix::fs::symlink(root.join("precious.txt"), linked.join("loss.jsonl")).unwrap();
    let (code, err) = run(&train(&linked, &["--out", &linked.to_string_lossy(), "--overwrite"]), &root, Stdio::null());
    assert!(code == Some(1) && err.contains("loss.jsonl") && err.contains("symbolic link"), "{err}");
    assert_eq!(std::fs::read(root.join("precious.txt")).unwrap(), b"keep");

    fill(&out);
    let lock =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(out.join(".rumble.lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let (code, err) = run(&train(&out, &[]), &root, Stdio::null());
    assert!(code == Some(1) && err.contains("another rumble run"), "{err}");
    for (file, bytes) in SENTINELS {
        assert_eq!(std::fs::read(out.join(file)).unwrap(), bytes);
    }
    drop(lock);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_closed_or_full_stdout_never_panics_and_keeps_the_checkpoint() {
    let root = tmp("stdout");
    // `| head -1`: the reader closes the pipe after the first line.
    let out = root.join("pipe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rumble"))
        .args(train(&out, &["--json", "--steps", "50", "--batch", "2", "--seq", "16"]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    use std::io::Read;
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked") && err.contains("stopped after step"), "{err}");
    Weights::load(&out.join("model.safetensors"), &preset("tiny").unwrap().config).unwrap();
    let log = std::fs::read_to_string(out.join("loss.jsonl")).unwrap();
    assert!(log.ends_with('\n') && log.lines().all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()), "{log}");

    // `rumble plan --trace | head -1`.
    let mut child = Command::new(env!("CARGO_BIN_EXE_rumble"))
        .args(["plan", "--trace"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.code() == Some(0) && !err.contains("panicked"), "{:?} {err}", res.status);

    // `> /dev/full`: an error naming stdout, the checkpoint kept.
    if Path::new("/dev/full").exists() {
        let out = root.join("full");
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let (code, err) =
            run(&train(&out, &["--json", "--steps", "3", "--batch", "2", "--seq", "16"]), &root, full.into());
        assert!(code == Some(1) && err.contains("<stdout>") && !err.contains("panicked"), "{code:?} {err}");
        // The start line fails before any step: nothing to save; the folder's log is untouched.
        assert!(
            !out.join("model.safetensors").exists()
                || Weights::load(&out.join("model.safetensors"), &preset("tiny").unwrap().config).is_ok()
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_file_called_like_a_preset_does_not_shadow_it() {
    let root = tmp("shadow");
    std::fs::write(root.join("tiny"), b"not a config").unwrap();
    let (code, err) = run(&args(&["plan", "tiny", "--json"]), &root, Stdio::null());
    assert_eq!(code, Some(0), "{err}");
    // `./tiny` means the file.
    let (code, err) = run(&args(&["plan", "./tiny"]), &root, Stdio::null());
    assert!(code == Some(1) && err.contains("./tiny"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}
