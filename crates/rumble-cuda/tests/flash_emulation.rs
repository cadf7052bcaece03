//! The flash-attention kernel sources (src/kernels/flash_attn.cu and flash_fma.cu) run on the
//! CPU emulator of tests/flash_emu/ (every CUDA thread a host thread; shuffles, ldmatrix,
//! mma.sync and cp.async emulated by the PTX fragment layouts) against exact double-precision
//! attention: indexing, partial tiles, causal masks, GQA and the shared-memory pipeline are
//! checked with no GPU. Needs `g++` (C++20); prints "skipped: no g++" without it.
//! `RUMBLE_FLASH_EMU=full` runs the whole matrix (head sizes up to 256, f16) instead of the
//! quick one.

use std::process::Command;

#[test]
fn flash_kernels_match_exact_attention_on_the_cpu_emulator() {
    if Command::new("g++").arg("--version").output().is_err() {
        println!("skipped: no g++");
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/flash_emu/run.sh");
    if !std::path::Path::new(script).exists() {
        println!("skipped: {script} is not on this machine (a test binary built elsewhere)");
        return;
    }
    let mode = if std::env::var("RUMBLE_FLASH_EMU").is_ok_and(|v| v == "full") { "full" } else { "quick" };
    let out = Command::new("bash").arg(script).arg(mode).output().expect("running tests/flash_emu/run.sh");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "flash emulation failed:\n{text}");
    assert!(text.lines().filter(|l| l.starts_with("ok ")).count() >= 10, "too few cases ran:\n{text}");
}
