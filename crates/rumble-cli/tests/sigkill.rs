//! SIGKILL at random times during short training runs into one folder (50 trials; every other
//! one aimed at the final save, which starts when the last step's line is printed): every
//! checkpoint that survives loads, the loss log reads to its last full line, and the next run
//! removes the temporary files a killed save left behind.

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rumble_core::cpu::Rng;
use rumble_models::{Config, Weights, preset};

fn start(out: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_rumble"))
        .args(["train", "--device", "cpu", "--steps", "3", "--batch", "2", "--seq", "16", "--json", "--overwrite"])
        .arg("--out")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Reads the run's stdout on a thread; sends once the last step's line is out (the save starts).
fn watch(child: &mut std::process::Child) -> mpsc::Receiver<()> {
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if line.contains("\"event\":\"step\"") && line.contains("\"step\":3") {
                let _ = tx.send(());
            }
        }
    });
    rx
}

fn temps(out: &Path) -> Vec<String> {
    std::fs::read_dir(out)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Whatever a killed run left in `out` must be usable.
fn check_survivors(out: &Path, cfg: &Config, trial: usize) {
    let model = out.join("model.safetensors");
    if model.exists() {
        Weights::load(&model, cfg).unwrap_or_else(|e| panic!("trial {trial}: checkpoint unreadable: {e}"));
    }
    if out.join("config.json").exists() {
        Config::from_file(&out.join("config.json")).unwrap_or_else(|e| panic!("trial {trial}: config.json: {e}"));
    }
    if let Ok(log) = std::fs::read_to_string(out.join("loss.jsonl")) {
        let whole = &log[..log.rfind('\n').map_or(0, |i| i + 1)];
        for l in whole.lines() {
            serde_json::from_str::<serde_json::Value>(l)
                .unwrap_or_else(|e| panic!("trial {trial}: log line {l:?}: {e}"));
        }
    }
}

#[test]
fn sigkill_during_runs_and_saves_loses_nothing_saved() {
    let out = std::env::temp_dir().join(format!("rumble-sigkill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let cfg = preset("tiny").unwrap().config;

    // A whole run sets the time scale: the run, and the save after its last step. The second of
    // two: the first pays for cold caches (on a loaded machine it ran several times longer than
    // the trials, which then mostly finished before their kill).
    let (mut full, mut save) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..2 {
        let t0 = Instant::now();
        let mut child = start(&out);
        let saving = watch(&mut child);
        saving.recv_timeout(Duration::from_secs(300)).expect("the last step's line");
        let t_save = Instant::now();
        assert!(child.wait().unwrap().success());
        (full, save) = (t0.elapsed(), t_save.elapsed());
    }

    let mut rng = Rng::new(17);
    let (mut killed, mut left_temps) = (0, 0);
    for trial in 0..50 {
        let before = temps(&out);
        let started = Instant::now();
        let mut child = start(&out);
        let saving = watch(&mut child);
        let at = if trial % 2 == 0 {
            full.mul_f64(rng.uniform() * 1.2)
        } else {
            // Aimed at the save: wait for the last step's line, then a moment into the save.
            let _ = saving.recv_timeout(Duration::from_secs(300));
            save.mul_f64(rng.uniform())
        };
        let t = Instant::now();
        let mut done = false;
        while t.elapsed() < at {
            if child.try_wait().unwrap().is_some() {
                done = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if !done {
            child.kill().unwrap(); // SIGKILL
            killed += 1;
        }
        let status = child.wait().unwrap();
        if done {
            assert!(status.success(), "trial {trial}: a run that was not killed failed");
            // A run that finished before its kill sets a shorter time scale: on a machine whose
            // load falls after the calibration runs, the trials would otherwise mostly finish.
            if trial % 2 == 0 {
                full = full.min(started.elapsed());
            } else {
                save = save.min(t.elapsed());
            }
        }
        // Temporary files of earlier killed runs are gone once a run got past its start.
        let now = temps(&out);
        if status.success() {
            assert!(now.is_empty(), "trial {trial}: {now:?} left after a whole run (before: {before:?})");
        }
        left_temps += usize::from(!now.is_empty());
        check_survivors(&out, &cfg, trial);
    }
    // The next run cleans up whatever the last kill left.
    assert!(start(&out).wait().unwrap().success());
    assert!(temps(&out).is_empty(), "{:?}", temps(&out));
    check_survivors(&out, &cfg, 50);
    eprintln!("sigkill: 50 trials, {killed} killed, {left_temps} left a temporary file; run {full:?}, save {save:?}");
    assert!(killed >= 25, "too few kills ({killed}) to mean anything");
    std::fs::remove_dir_all(&out).unwrap();
}
