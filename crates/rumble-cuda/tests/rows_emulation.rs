//! RMSNorm's backward in one pass (`rms_norm_bwd` of src/kernels/rows.cu: a block per row group,
//! dx written and the dw partials kept a thread's columns; then `rms_norm_bwd_dw_sum`) on the
//! CPU emulator of tests/flash_emu/ against the gradients in double precision: bf16 and f32,
//! one chunk a thread (the next row's loads issued before this row's reductions) and the
//! `_wide` kernels' four, 16-byte loads and the element-by-element
//! path (a width they do not divide, a misaligned operand), groups of one row to many and
//! groups past the last row, an addend beside dx and dx written over it. No GPU needed; needs
//! `g++` (C++20), else prints "skipped: no g++".

mod common;

use std::process::Command;

use rumble_cuda::kernels::KernelFile;

#[test]
fn rms_norm_backward_matches_exact_gradients_on_the_cpu_emulator() {
    let Some((here, dir)) = common::emulator("rows_emu", "rows_main.cpp") else { return };
    let src = KernelFile::Rows.source();
    let marks = ["// RMSNorm backward in one pass", "// Rotate-half RoPE"];
    let bin = common::build_emulator(&here, &dir, &src, marks, "rows.cuh", "rows_main.cpp");
    // dtype, rows, d, groups, wide, acc, misalign
    let cases: [[&str; 7]; 13] = [
        ["bf16", "40", "576", "5", "0", "0", "0"],
        ["bf16", "37", "576", "37", "0", "1", "0"],
        ["bf16", "30", "1030", "4", "0", "2", "0"],
        ["f32", "33", "96", "5", "0", "0", "0"],
        ["f32", "20", "100", "3", "0", "1", "1"],
        ["bf16", "9", "200", "2", "0", "0", "1"],
        ["bf16", "3", "64", "8", "0", "0", "0"],
        ["f32", "6", "4104", "2", "1", "0", "0"],
        ["f32", "5", "4099", "2", "1", "2", "0"],
        ["bf16", "4", "8200", "1", "1", "1", "0"],
        ["f32", "7", "300", "3", "1", "0", "0"],
        ["bf16", "1", "2048", "1", "0", "2", "1"],
        ["f32", "25", "512", "4", "0", "2", "0"],
    ];
    for args in cases {
        let out = Command::new(&bin).args(args).output().expect("running the emulator");
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        assert!(out.status.success(), "{args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
