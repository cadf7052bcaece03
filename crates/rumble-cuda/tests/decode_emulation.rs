//! `attention_cached`'s flash-decoding kernels (src/kernels/decode.cu, cut from its rotation
//! helper to the sampler) run in f32 on the CPU emulator of tests/flash_emu/ against attention
//! in double precision, with the split plans
//! `AttentionSplit` makes for devices of several SM counts: one to many runs of keys, empty
//! runs (a position before the last run), positions past the cache, grouped heads in one block
//! or two, head sizes 1 to 256, several query rows; the splits combined by each group's last
//! block (counting in the device's counters, which it leaves at zero); five cases also by the
//! combine kernel, and with the queries rotated by the kernel (`Op::AttentionCached`'s `rope`);
//! a decode shape with the other split lengths the recipe may time (`decode::split_keys`: 16,
//! 32 and 128 keys a split beside the default 64 of the cases above), combined by the last
//! blocks.
//! Also the cache writes, plain and rotated, one cache or a layer's keys and values in one
//! launch (`cache_write_kv`), on a grid whose threads take several elements, against the rows
//! copied by hand (a row past the cache skipped). No GPU needed; needs `g++` (C++20), else prints "skipped: no g++".

mod common;

use std::process::Command;

use rumble_cuda::decode::{AttentionSplit, source};

#[test]
fn attention_cached_matches_exact_attention_on_the_cpu_emulator() {
    let Some((here, dir)) = common::emulator("decode_emu", "ac_main.cpp") else { return };
    let bin = common::build_emulator(
        &here,
        &dir,
        &source(),
        ["// rope_at's rotation of one pair", "// SplitMix64"],
        "ac.cuh",
        "ac_main.cpp",
    );
    // ([b, t, hq, hkv, s, d], SMs, positions)
    let cases: [([usize; 6], usize, &[i64]); 12] = [
        ([1, 1, 32, 8, 300, 64], 132, &[200]),
        ([1, 1, 32, 8, 1000, 64], 132, &[999]),
        ([2, 1, 14, 2, 1000, 64], 132, &[5, 640]),
        ([2, 1, 32, 1, 500, 32], 8, &[499, 12]),
        ([1, 1, 8, 1, 600, 256], 16, &[450]),
        ([2, 3, 6, 2, 300, 64], 1, &[296, 5]),
        ([1, 1, 4, 4, 130, 16], 4, &[129]),
        ([2, 1, 4, 2, 300, 1], 132, &[0, 299]),
        ([1, 1, 4, 2, 200, 64], 132, &[5000]),
        // Prefill chunks: several query rows a block, each seeing keys up to its own position.
        ([2, 9, 8, 2, 300, 64], 132, &[0, 100]),
        ([2, 5, 14, 2, 400, 64], 8, &[64, 390]),
        ([1, 16, 4, 4, 200, 32], 132, &[150]),
    ];
    let (mut splits, mut rows) = (std::collections::BTreeSet::new(), Vec::new());
    // These cases also run with the combine kernel and with the queries rotated by the kernel.
    const FEW_CASES: [usize; 5] = [0, 4, 5, 9, 11];
    for (case_index, (dims, sms, pos)) in cases.into_iter().enumerate() {
        let p = AttentionSplit::new(dims, sms);
        splits.insert(p.splits);
        rows.push(p.rows);
        let mut args: Vec<String> = dims.iter().map(|x| x.to_string()).collect();
        args.extend([p.heads, p.rows, p.splits, p.chunk].map(|x| x.to_string()));
        args.extend(pos.iter().map(|x| x.to_string()));
        // Combined by the groups' last blocks (the device's counters); for a few cases (splits,
        // head sizes, several rows) also by the combine kernel, and rotating the queries itself
        // (`rope`).
        let runs: &[(bool, Option<&str>)] = if FEW_CASES.contains(&case_index) {
            &[(true, None), (false, None), (true, Some("10000"))]
        } else {
            &[(true, None)]
        };
        for &(counted, rope) in runs {
            let mut cmd = Command::new(&bin);
            if counted {
                cmd.env("AC_COUNTERS", "1");
            }
            if let Some(theta) = rope {
                cmd.env("AC_ROPE_THETA", theta);
            }
            let out = cmd.args(&args).output().expect("running the emulator");
            let text = String::from_utf8_lossy(&out.stdout);
            print!("{text}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{dims:?} on {sms} SMs ({p:?}, counted {counted}, rope {rope:?}): {text}{err}"
            );
        }
    }
    // The split lengths the recipe times per shape (`decode::split_keys`), down to 16 keys a
    // split, on a Qwen2.5-0.5B-like step (two groups of seven query heads, up to 48 splits).
    for (dims, pos) in [([1, 1, 14, 2, 768, 64], &[767i64][..])] {
        for keys in [16, 32, 128] {
            let p = AttentionSplit::with_min_keys(dims, 132, keys);
            splits.insert(p.splits);
            let mut args: Vec<String> = dims.iter().map(|x| x.to_string()).collect();
            args.extend([p.heads, p.rows, p.splits, p.chunk].map(|x| x.to_string()));
            args.extend(pos.iter().map(|x| x.to_string()));
            let out = Command::new(&bin).env("AC_COUNTERS", "1").args(&args).output().expect("running the emulator");
            let text = String::from_utf8_lossy(&out.stdout);
            print!("{text}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{dims:?}, {keys} keys a split ({p:?}): {text}{err}");
        }
    }
    // The cache writes (`cw B T S H D POS...`), single and joined (`cache_write_kv`): one row a
    // sequence, a prefill chunk, a row past the cache (skipped), an odd head size (plain only).
    for args in [
        ["1", "1", "40", "8", "64", "17"],
        ["2", "5", "30", "2", "16", "0"],
        ["2", "3", "9", "4", "8", "7"],
        ["2", "2", "6", "3", "5", "1"],
    ] {
        let mut all = vec!["cw"];
        all.extend(args);
        all.push("4");
        let out = Command::new(&bin).args(&all).output().expect("running the emulator");
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        assert!(out.status.success(), "{all:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(splits.len() >= 4 && splits.contains(&1), "split counts covered: {splits:?}");
    assert!(rows.iter().any(|&r| r > 1), "no case put several query rows in a block: {rows:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
