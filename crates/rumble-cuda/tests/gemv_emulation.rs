//! `gemv_tn` and `gemv_wr` (src/kernels/gemv.cu, decoding's matmuls) on the CPU emulator of
//! tests/flash_emu/ against the product in double precision: each row bucket (M of 1 to 16,
//! `gemv_wr` at most 4) and each rows-a-warp of `gemv_wr`, K ending in and past an unrolled
//! group of chunks, bf16 operands giving bf16 or f32 and f32 operands, ragged N (a block's last
//! rows absent) and K (a warp with no chunk), an addend read beside the result, in place, or as
//! a row added to every row (row stride 0: a bias), and a misaligned operand (the
//! element-by-element path); and `matmul_pre`'s kernels (`gemv_pre`: a row's rms_norm or swiglu
//! of a packed row made into shared memory, then a grid of 3 blocks looping over the blocks of
//! weight rows, and a set of three projections) against the product of the rows the unfolded op
//! would store. No GPU needed; needs `g++` (C++20), else prints "skipped: no g++".

mod common;

use std::process::Command;

use rumble_cuda::kernels::KernelFile;

#[test]
fn gemv_matches_the_exact_product_on_the_cpu_emulator() {
    let Some((here, dir)) = common::emulator("gemv_emu", "gemv_main.cpp") else { return };
    let src = KernelFile::Gemv.source();
    let marks = ["// Matrix times a few vectors", "#define GEMV("];
    let bin = common::build_emulator(&here, &dir, &src, marks, "gemv.cuh", "gemv_main.cpp");
    // dtype, out, m, n, k, beta, addend (1: in place, 2: a row), misaligned
    let cases: [[&str; 8]; 16] = [
        ["bf16", "bf16", "1", "37", "2048", "0", "0", "0"],
        ["bf16", "bf16", "1", "64", "512", "1", "1", "0"],
        ["bf16", "f32", "3", "21", "1000", "1", "0", "0"],
        ["bf16", "bf16", "8", "16", "264", "0", "0", "0"],
        ["bf16", "bf16", "16", "9", "3000", "1", "0", "0"],
        ["bf16", "bf16", "5", "13", "100", "0", "0", "1"],
        ["f32", "f32", "2", "30", "777", "1", "1", "0"],
        ["f32", "f32", "16", "8", "4096", "0", "0", "0"],
        ["f32", "f32", "1", "5", "64", "0", "0", "1"],
        ["bf16", "bf16", "1", "515", "8192", "0", "0", "0"],
        ["bf16", "bf16", "4", "77", "1544", "1", "1", "0"],
        ["bf16", "f32", "2", "9", "4104", "1", "0", "0"],
        ["bf16", "bf16", "1", "37", "2048", "1", "2", "0"],
        ["bf16", "f32", "3", "21", "1000", "1", "2", "0"],
        ["f32", "f32", "16", "8", "4096", "1", "2", "0"],
        ["bf16", "bf16", "5", "13", "100", "1", "2", "1"],
    ];
    // matmul_pre's prologues: dtype, m, n, k, beta, addend, misaligned, prologue.
    let pre: [[&str; 8]; 11] = [
        ["bf16", "1", "37", "2048", "0", "0", "0", "norm"],
        ["bf16", "3", "21", "1000", "1", "1", "0", "norm"],
        ["f32", "1", "30", "777", "1", "0", "0", "norm"],
        ["bf16", "1", "9", "200", "0", "0", "1", "norm"],
        ["bf16", "1", "64", "8192", "1", "1", "0", "swiglu"],
        ["bf16", "4", "13", "1544", "0", "0", "0", "swiglu"],
        ["f32", "2", "17", "333", "1", "0", "0", "swiglu"],
        ["bf16", "1", "5", "100", "0", "0", "1", "swiglu"],
        ["bf16", "1", "37", "2048", "1", "2", "0", "norm"],
        ["bf16", "4", "13", "1544", "1", "2", "0", "swiglu"],
        ["f32", "3", "30", "777", "1", "2", "0", "norm"],
    ];
    let pre = pre.map(|[t, m, n, k, b, i, mis, p]| [t, t, m, n, k, b, i, mis, p]);
    for args in cases.iter().map(|c| c.to_vec()).chain(pre.iter().map(|c| c.to_vec())) {
        let out = Command::new(&bin).args(&args).output().expect("running the emulator");
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        assert!(out.status.success(), "{args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
