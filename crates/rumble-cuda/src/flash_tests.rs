//! Unit tests of `flash`: the kernel choice, the tiles and launch shapes of every bucket, the
//! defines they put in the source, the causal grid pairing and the dK/dV split.

use super::*;

fn mma(dp: usize, wg: bool) -> Launch {
    Variant::Mma { dtype: DType::BF16, dp, wg }.shape()
}

#[test]
fn the_choice_covers_the_issue_matrix() {
    let (h100, k) = ((9, 0), Knobs::default());
    for d in [1, 64, 100, 128, 256] {
        assert!(matches!(choose(h100, DType::BF16, d, &k), Some(Variant::Mma { .. })), "bf16 d{d}");
        assert!(matches!(choose(h100, DType::F32, d, &k), Some(Variant::Fma { .. })), "f32 d{d}");
    }
    let mma = |dtype, dp, wg| Some(Variant::Mma { dtype, dp, wg });
    assert_eq!(choose(h100, DType::BF16, 1, &k), mma(DType::BF16, 16, true));
    assert_eq!(choose(h100, DType::BF16, 100, &k), mma(DType::BF16, 112, true));
    assert_eq!(choose(h100, DType::F16, 64, &k), mma(DType::F16, 64, true));
    // The wgmma kernels: sm_90 only, and not with RUMBLE_FLASH_WG=0.
    assert_eq!(choose((8, 0), DType::BF16, 128, &k), mma(DType::BF16, 128, false));
    assert_eq!(choose((10, 0), DType::BF16, 64, &k), mma(DType::BF16, 64, false));
    let no_wg = Knobs { flash_wgmma: false, ..Knobs::default() };
    assert_eq!(choose(h100, DType::BF16, 120, &no_wg), mma(DType::BF16, 128, false));
    assert_eq!(choose(h100, DType::F32, 100, &k), Some(Variant::Fma { dp: 128 }));
    assert_eq!(choose(h100, DType::F64, 64, &k), None);
    assert_eq!(choose(h100, DType::BF16, 257, &k), None);
    assert_eq!(choose((7, 5), DType::BF16, 64, &k), None);
    let naive = Knobs { attention: crate::knobs::AttentionImpl::Naive, ..Knobs::default() };
    assert_eq!(choose(h100, DType::BF16, 64, &naive), None);
}

#[test]
fn every_bucket_has_its_tiles() {
    assert_eq!(Tiles::of(16), D16);
    assert_eq!((Tiles::of(32), Tiles::of(64)), (D64, D64));
    assert_eq!((Tiles::of(80), Tiles::of(96), Tiles::of(128)), (D128, D128, D128));
    assert_eq!(Tiles::of(112), D112);
    assert_eq!((Tiles::of(144), Tiles::of(256)), (D256, D256));
    for dp in (16..=MAX_HEAD).step_by(16) {
        let t = Tiles::of(dp);
        assert!(t.fwd_keys.is_multiple_of(t.fwd_step) && 64 % t.dkdv_queries == 0, "d{dp}: {t:?}");
        assert!(t.fwd_rows.is_multiple_of(64) && t.dq_rows.is_multiple_of(64), "d{dp}: {t:?}");
    }
}

#[test]
fn every_variant_fits_an_h100_block() {
    // 227 KiB of opt-in shared memory per block on sm_90; every variant at every size.
    let mut all = Variant::all();
    all.extend((1..=16).map(|i| Variant::Mma { dtype: DType::BF16, dp: 16 * i, wg: true }));
    for v in all {
        let s = v.shape();
        for (what, bytes) in [("fwd", s.smem_fwd), ("dq", s.smem_dq), ("dkdv", s.smem_dkdv)] {
            assert!(bytes <= 227 * 1024, "{} {what}: {bytes} bytes", v.name());
        }
        for n in [s.fwd_threads, s.dq_threads, s.dkdv_threads] {
            assert!(n <= 1024 && n % 32 == 0, "{}", v.name());
        }
        assert!(s.nchunk * s.dkdv_dims >= v.dp(), "{}", v.name());
    }
}

#[test]
fn launch_shapes_follow_the_tiles() {
    // d128: Q and two stages of 64 keys of K and V, (128 + 4 x 64) x 136 x 2 bytes; dK/dV with
    // 64-query tiles, (2 x 64 + 4 x 64) x 136 x 2 + 4 x 64 x 4; dQ 128 queries, 32-key tiles.
    let p = mma(128, false);
    assert_eq!((p.fwd_rows, p.fwd_keys, p.fwd_step, p.smem_fwd), (128, 64, 64, 104448));
    assert_eq!((p.dkdv_keys, p.dkdv_queries, p.smem_dkdv, p.nchunk), (64, 64, 105472, 1));
    assert_eq!((p.dq_rows, p.dq_keys, p.smem_dq), (128, 32, (2 * 128 + 4 * 32) * 136 * 2));
    assert_eq!((p.fwd_threads, p.dq_threads, p.dkdv_threads), (128, 128, 128));
    // d64: 128-key stages in 64-key steps, (128 + 4 x 128) x 72 x 2; d256: 64 queries, 32-key
    // stages, two dK/dV chunks of 128 dims.
    let s = mma(64, false);
    assert_eq!((s.fwd_keys, s.fwd_step, s.smem_fwd, s.dq_rows), (128, 64, 92160, 64));
    let s = mma(256, false);
    assert_eq!((s.fwd_rows, s.smem_fwd, s.nchunk, s.dkdv_dims, s.dkdv_queries), (64, 101376, 2, 128, 32));
    // d112: 32-key forward stages.
    assert_eq!((mma(112, false).fwd_keys, mma(112, false).fwd_step), (32, 32));
    // On wgmma at d128: 128 queries by 256 threads, (128 + 4 x 64) x 128 x 2 + 1024 bytes; and
    // dQ, (2 x 128 + 4 x 64) x 128 x 2 + 1024; dK/dV as on mma.sync.
    let w = mma(128, true);
    assert_eq!((w.fwd_rows, w.fwd_threads, w.smem_fwd, w.fwd_wg), (128, 256, 99328, true));
    assert_eq!((w.dq_rows, w.dq_threads, w.smem_dq, w.dq_wg), (128, 256, 132096, true));
    assert_eq!(w.smem_dkdv, p.smem_dkdv);
    // At d64 only dQ; at d112 (not whole 64-column rows) and d16 neither.
    let w = mma(64, true);
    assert_eq!((w.fwd_wg, w.dq_wg, w.fwd_rows, w.smem_fwd), (false, true, 128, 92160));
    assert_eq!(mma(112, true), mma(112, false));
    assert_eq!(mma(16, true), mma(16, false));
    // FMA, d 100 -> 128: 128 queries (fwd, dq), 64 keys (dkdv); the forward and dK/dV buffers
    // no longer fit twice.
    let s = Variant::Fma { dp: 128 }.shape();
    assert_eq!((s.fwd_rows, s.dq_rows, s.dkdv_keys, s.nchunk), (128, 128, 64, 1));
    assert_eq!((s.smem_fwd, s.smem_dq, s.smem_dkdv, s.stages), (172032, 223232, 176640, [1, 2, 1]));
    assert_eq!(Variant::Fma { dp: 256 }.shape().nchunk, 2);
}

#[test]
fn sources_carry_the_shape_as_defines() {
    let v = Variant::Mma { dtype: DType::BF16, dp: 128, wg: true };
    let (src, name) = (v.source(), v.name());
    assert_eq!(name, "flash_bf16_d128_wg");
    for line in ["#define FDP 128\n", "#define FA_FWD_WG 1\n", "#define FA_SMEM_FWD 99328\n", "#define FA_DQ_KEYS 64\n"]
    {
        assert!(src.contains(line), "{line}");
    }
    assert!(src.contains("fwd_wg(") && v.arch("sm_90") == "sm_90a");
    let v = Variant::Mma { dtype: DType::F16, dp: 96, wg: true };
    let src = v.source();
    assert!(src.contains("#define FLASH_F16 1\n") && !src.contains("fwd_wg(") && v.arch("sm_90") == "sm_90");
    assert_eq!(v.name(), "flash_f16_d96");
    let v = Variant::Fma { dp: 64 };
    assert!(v.source().contains("#define FDPF 64\n") && v.source().contains("#define FA_FWD_KEYS 64\n"));
    // Distinct modules have distinct names.
    let all = Variant::all();
    let mut names: Vec<String> = all.iter().map(|v| v.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), all.len());
}

#[test]
fn causal_grids_pair_blocks_while_the_device_stays_full() {
    // 32 query blocks x 32 heads on 132 multiprocessors: 16 CTA columns, two blocks each.
    assert_eq!(grid_columns(true, 32, 32, 132), 16);
    assert_eq!(grid_columns(true, 33, 32, 132), 17);
    // Without a mask every block does the same work; too few CTAs: keep them all.
    assert_eq!(grid_columns(false, 32, 32, 132), 32);
    assert_eq!(grid_columns(true, 8, 4, 132), 8);
    assert_eq!(grid_columns(true, 1, 1000, 132), 1);
}

#[test]
fn the_dkdv_split_fills_the_device_within_its_memory_cap() {
    let split = |group, blocks, plane, slots, causal| dkdv_split(group, blocks, plane, slots, causal, None);
    // GQA 4, 8 kv heads, seq 2048 (32 blocks of 64 keys): 256 blocks, 4 x 132 wanted.
    let plane = 8 * 2048 * 128;
    assert_eq!(split(4, 256, plane, 264, true), 4);
    // seq 4096: 512 blocks, enough without a split; 300 blocks: split in two.
    assert_eq!(split(4, 512, 2 * plane, 264, true), 1);
    assert_eq!(split(4, 300, 2 * plane, 264, true), 2);
    // Without a mask, one CTA per multiprocessor is enough.
    assert_eq!(split(4, 132, 2 * plane, 264, false), 1);
    assert_eq!(split(4, 100, 2 * plane, 264, false), 4);
    // Only divisors of the group: 7 heads split 7 ways (qwen2, head size 1), or not at all.
    assert_eq!(split(7, 256, 4 * 4096, 264, true), 7);
    assert_eq!(split(1, 16, plane, 264, true), 1);
    // The partial sums stay under the cap: 2 x 4 x 64 Mi elements x 4 bytes is too much.
    assert_eq!(split(4, 256, 64 << 20, 264, true), 1);
    assert_eq!(split(4, 256, 8 << 20, 264, true), 4);
    assert_eq!(split(4, 256, 16 << 20, 264, true), 2);
    // RUMBLE_FLASH_SPLIT forces a split, clamped to the group.
    assert_eq!(dkdv_split(4, 512, plane, 264, true, Some(3)), 3);
    assert_eq!(dkdv_split(4, 512, plane, 264, true, Some(9)), 4);
}
