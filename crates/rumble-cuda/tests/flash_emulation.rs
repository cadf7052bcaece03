//! The flash-attention kernel sources (src/kernels/flash_attn.cu and flash_fma.cu) run on the
//! CPU emulator of tests/flash_emu/ (every CUDA thread a host thread; shuffles, ldmatrix,
//! mma.sync and cp.async emulated by the PTX fragment layouts) against exact double-precision
//! attention: indexing, partial tiles, causal masks, GQA, both operand layouts, the dK/dV split
//! and the shared-memory pipeline are checked with no GPU. Each module is built with g++ from
//! the same `#define`s the library compiles it with (`flash::Variant::defines`). Needs `g++`
//! (C++20); prints "skipped: no g++" without it. (The wgmma kernels have no emulation: only
//! the GPU tests run them.)
//!
//! The quick run (the default, under a minute on two idle cores) covers every head-size bucket
//! of the tensor-core kernels and three of the f32 ones on a few small shapes;
//! `RUMBLE_FLASH_EMU=full` runs the whole matrix (larger shapes, head sizes up to 256, f16).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use rumble_core::ir::DType;
use rumble_cuda::flash::Variant;

/// One run of the emulator: `B HQ HKV T S D CAUSAL SEED SCALE_MUL LAYOUT SPLIT [POS]`.
struct Case {
    variant: Variant,
    shape: [usize; 6],
    causal: bool,
    seed: u64,
    scale_mul: f64,
    bthd: bool,
    split: usize,
    /// Cache positions, one a sequence: the forward over a KV cache (`flash_fwd_cached`).
    pos: &'static [i64],
}

fn mma(dtype: DType, dp: usize) -> Variant {
    Variant::Mma { dtype, dp, wg: false }
}

/// `(variant, [b, hq, hkv, t, s, d], causal, seed)` with the usual scale, bhtd, no split.
fn case(variant: Variant, shape: [usize; 6], causal: bool, seed: u64) -> Case {
    Case { variant, shape, causal, seed, scale_mul: 1.0, bthd: false, split: 1, pos: &[] }
}

fn quick() -> Vec<Case> {
    let (b16, f32) = (DType::BF16, |dp| Variant::Fma { dp });
    vec![
        // GQA 2, causal, partial tiles, two query blocks (a paired grid).
        case(mma(b16, 64), [1, 2, 1, 130, 130, 64], true, 4),
        // A negative scale, fewer keys than queries, no mask.
        Case { scale_mul: -1.0, ..case(mma(b16, 64), [1, 2, 2, 45, 19, 64], false, 5) },
        // Sequence-major, the group of 3 split over 3 dK/dV block rows.
        Case { bthd: true, split: 3, ..case(mma(b16, 64), [1, 3, 1, 77, 77, 64], true, 32) },
        Case { bthd: true, split: 2, ..case(mma(b16, 128), [1, 2, 1, 100, 100, 128], true, 9) },
        // Head size 1 (element-wise loads), 100 (the d112 bucket), 136 (two dK/dV chunks).
        case(mma(b16, 16), [1, 2, 1, 77, 77, 1], true, 1),
        Case { bthd: true, ..case(mma(b16, 112), [1, 2, 1, 70, 70, 100], false, 8) },
        case(mma(b16, 144), [1, 2, 1, 40, 40, 136], true, 11),
        case(f32(32), [1, 2, 1, 70, 70, 1], true, 15),
        Case { bthd: true, ..case(f32(128), [1, 2, 1, 70, 45, 100], false, 18) },
        // Prefill chunks over a KV cache: a chunk at the start, one mid-cache (keys past its
        // last row unseen), one whose rows run past the cache's end, GQA 3.
        Case { bthd: true, pos: &[0, 37, 200], ..case(mma(b16, 64), [3, 6, 2, 70, 230, 64], true, 61) },
        Case { bthd: true, pos: &[150, 5], ..case(mma(b16, 128), [2, 3, 1, 40, 180, 128], true, 62) },
    ]
}

fn full() -> Vec<Case> {
    let (b16, f16, f32) = (DType::BF16, DType::F16, |dp| Variant::Fma { dp });
    let mut v = quick();
    v.extend([
        case(mma(b16, 64), [1, 7, 1, 130, 130, 64], true, 4),
        // Peaked rows: the forward's running maximum must move late.
        Case { scale_mul: 8.0, ..case(mma(b16, 64), [1, 2, 1, 130, 130, 64], true, 15) },
        case(mma(b16, 64), [1, 2, 1, 64, 64, 60], true, 6),
        case(mma(b16, 128), [1, 2, 2, 200, 200, 128], true, 9),
        case(mma(b16, 128), [2, 2, 1, 64, 64, 128], false, 10),
        case(mma(b16, 128), [1, 1, 1, 300, 300, 128], true, 22),
        case(mma(b16, 16), [1, 7, 1, 200, 200, 1], true, 1),
        case(mma(b16, 16), [1, 2, 2, 37, 100, 1], false, 2),
        Case { scale_mul: -0.5, ..case(mma(b16, 16), [2, 2, 1, 65, 65, 16], true, 3) },
        case(mma(b16, 112), [1, 2, 2, 130, 130, 100], true, 7),
        case(mma(b16, 112), [1, 7, 1, 70, 70, 100], false, 8),
        case(mma(b16, 256), [1, 2, 2, 70, 70, 256], true, 12),
        case(mma(b16, 256), [1, 1, 1, 33, 50, 250], false, 13),
        case(mma(f16, 64), [1, 7, 1, 100, 100, 64], true, 14),
        Case { bthd: true, ..case(mma(b16, 64), [2, 7, 1, 77, 77, 64], true, 32) },
        Case { bthd: true, scale_mul: -1.0, ..case(mma(b16, 64), [1, 7, 7, 45, 19, 64], false, 33) },
        Case { bthd: true, ..case(mma(b16, 16), [1, 7, 1, 77, 77, 1], true, 31) },
        Case { bthd: true, ..case(mma(b16, 112), [1, 7, 1, 70, 70, 100], true, 34) },
        Case { bthd: true, ..case(mma(b16, 128), [1, 7, 1, 100, 100, 128], true, 35) },
        // The dK/dV split: even and uneven, with empty block rows (5 of a group of 4).
        Case { split: 3, ..case(mma(b16, 64), [2, 7, 1, 130, 130, 64], true, 51) },
        Case { bthd: true, split: 7, ..case(mma(b16, 64), [1, 7, 1, 77, 77, 64], true, 52) },
        Case { split: 5, ..case(mma(b16, 128), [1, 4, 1, 70, 45, 120], false, 54) },
        Case { bthd: true, split: 4, ..case(mma(b16, 16), [1, 7, 1, 77, 77, 1], true, 55) },
        case(f32(32), [1, 7, 1, 100, 100, 1], true, 15),
        case(f32(32), [1, 2, 2, 37, 70, 32], false, 16),
        case(f32(64), [1, 7, 1, 130, 130, 64], true, 17),
        case(f32(128), [1, 2, 2, 100, 100, 100], true, 18),
        case(f32(128), [1, 2, 1, 70, 45, 128], false, 19),
        Case { bthd: true, ..case(f32(64), [2, 7, 1, 77, 77, 64], true, 37) },
        Case { bthd: true, scale_mul: -1.0, ..case(f32(64), [1, 7, 7, 45, 19, 64], false, 38) },
        Case { bthd: true, ..case(f32(128), [1, 7, 1, 100, 100, 100], true, 39) },
        case(f32(160), [1, 2, 1, 70, 70, 130], true, 20),
        case(f32(256), [1, 2, 2, 65, 65, 256], true, 21),
        Case { bthd: true, ..case(f32(256), [1, 7, 1, 65, 65, 250], true, 42) },
    ]);
    v
}

/// Builds the emulator for `v` into `dir` (its defines in a header g++ includes first).
fn build(here: &Path, dir: &Path, v: Variant) -> Result<PathBuf, String> {
    let name = v.name();
    let (defs, bin) = (dir.join(format!("{name}.h")), dir.join(&name));
    std::fs::write(&defs, v.defines()).map_err(|e| format!("{}: {e}", defs.display()))?;
    let fma = matches!(v, Variant::Fma { .. }) as i32;
    let out = Command::new("g++")
        .args(["-std=c++20", "-O1", "-pthread", "-include"])
        .arg(&defs)
        .arg(format!("-DFLASH_FMA={fma}"))
        .arg("-o")
        .arg(&bin)
        .arg(here.join("emu_main.cpp"))
        .output()
        .map_err(|e| format!("g++: {e}"))?;
    if !out.status.success() {
        return Err(format!("g++ for {name}:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(bin)
}

#[test]
fn flash_kernels_match_exact_attention_on_the_cpu_emulator() {
    let Some((here, dir)) = common::emulator("flash_emu", "emu_main.cpp") else { return };
    let full_run = std::env::var("RUMBLE_FLASH_EMU").is_ok_and(|v| v == "full");
    let cases = if full_run { full() } else { quick() };
    // Each module once, two at a time (g++ is the slow part).
    let mut variants: Vec<Variant> = Vec::new();
    for c in &cases {
        if !variants.contains(&c.variant) {
            variants.push(c.variant);
        }
    }
    let bins: Vec<(Variant, Result<PathBuf, String>)> = std::thread::scope(|s| {
        let halves: Vec<_> = variants
            .chunks(variants.len().div_ceil(2).max(1))
            .map(|part| {
                let (here, dir) = (&here, &dir);
                s.spawn(move || part.iter().map(|&v| (v, build(here, dir, v))).collect::<Vec<_>>())
            })
            .collect();
        halves.into_iter().flat_map(|h| h.join().expect("build thread")).collect()
    });
    let mut failures = Vec::new();
    let mut ran = 0;
    for c in &cases {
        let bin = match &bins.iter().find(|(v, _)| *v == c.variant).expect("built").1 {
            Ok(b) => b,
            Err(e) => {
                failures.push(e.clone());
                continue;
            }
        };
        let [b, hq, hkv, t, s, d] = c.shape;
        let args: Vec<String> = [b, hq, hkv, t, s, d, c.causal as usize]
            .iter()
            .map(|x| x.to_string())
            .chain([c.seed.to_string(), c.scale_mul.to_string(), if c.bthd { "bthd" } else { "bhtd" }.into()])
            .chain([c.split.to_string()])
            .chain((!c.pos.is_empty()).then(|| c.pos.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",")))
            .collect();
        let out = Command::new(bin).args(&args).output().expect("running the emulator");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        print!("{} {}: {text}", c.variant.name(), args.join(" "));
        ran += 1;
        if !out.status.success() {
            failures.push(format!("{} {}: {text}", c.variant.name(), args.join(" ")));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "flash emulation failed:\n{}", failures.join("\n"));
    assert_eq!(ran, cases.len());
    println!("flash emulation: {ran} cases of {} modules passed", variants.len());
}
