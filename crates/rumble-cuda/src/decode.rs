//! Recipes of the decoding ops (`rope_at`, `cache_write`, `cache_write_kv`, `attention_cached`,
//! `sample`), whose kernels are in `kernels/decode.cu`. All are graph-capturable: positions and
//! the sampling key are read from device memory, so one captured decode step serves every token.
//!
//! - `rope_at` takes `rope`'s inverse-frequency table (`RopeScaling::inv_freq`, packed by
//!   `recipe::rope_freqs`), so a scaled RoPE rotates a decode step's token as training did.
//! - `cache_write` copies the cache to its result first unless the plan put them in one buffer
//!   (the planner does, `Op::may_overwrite`), then writes the new rows only; `cache_write_kv`
//!   does so for a layer's two caches, their rows written by one launch (the keys rotated with
//!   `rope`).
//! - `attention_cached` is flash-decoding: a block takes all query heads of one kv head (so K
//!   and V are read once) and one run of the visible keys, a tile at a time with an online
//!   softmax in f32; the run count ([`AttentionSplit`]) brings a decode step's few groups to
//!   two waves of blocks. A decode step's attention is latency-bound, so the kernel issues a
//!   tile's K and V loads together, before it reads the queries. With several runs each leaves
//!   its (max, sum, p.v) in the recipe's scratch and the last block of its group to finish
//!   rescales and sums them (counting in the device's counters; `attention_cached_combine`, a
//!   block per row, where the groups outnumber the counters). A prefill
//!   chunk (at least `FLASH_MIN_ROWS` query rows, bf16 or f16) runs on the flash forward
//!   instead (`flash::cached_recipe`: causal at each sequence's cache position).
//! - `sample`: one block of 1024 threads per row; greedy is one argmax pass, top-k and top-p
//!   each a 32-step search over the logits' float keys, the draw one pass in index order.
//!
//! f64 operands, positions or keys other than i64, and head sizes over 256 (512 for `rope_at`)
//! have no kernel: those nodes run on the host (the CPU reference), like any op without one.

use rumble_core::ir::{DType, HeadLayout, Op, TensorType};

use crate::compile::Options;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::KernelFile;
use crate::launch::{Arg, Recipe, Step};

const THREADS: u32 = 256;
/// Query rows from which `attention_cached` runs on the flash forward (one tensor-core m-tile):
/// fewer rows leave its tiles mostly empty, where the decode kernel shares each K and V row
/// among a kv head's query heads.
const FLASH_MIN_ROWS: usize = 16;

/// The kernel file as NVRTC compiles it (prelude included), for compile checks.
pub fn source() -> String {
    KernelFile::Decode.source()
}

/// The recipe of a decoding op.
pub fn recipe(dev: &Device, op: &Op, at: &[&TensorType], ot: &[&TensorType]) -> Result<Recipe> {
    let unsupported = |what: &str| Err(CudaError::Unsupported(format!("{} on {what}", op.name())));
    let dt = at[0].dtype;
    let sfx = match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => return unsupported(&format!("{d} (kernels take f32, bf16, f16)")),
    };
    let ints = at.iter().skip(1).filter(|t| t.dtype.is_int());
    if let Some(t) = ints.clone().find(|t| t.dtype != DType::I64) {
        return unsupported(&format!("{} positions or keys (kernels take i64)", t.dtype));
    }
    let m = dev.module(KernelFile::Decode.name(), &source(), Options { fmad: false })?;
    let mut steps = Vec::new();
    let mut scratch = 0;
    let mut kernel = |name: &str, grid: u32, block: u32, args: Vec<Arg>| -> Result<()> {
        let name = format!("{name}_{sfx}");
        steps.push(Step::Kernel { func: m.function(&name)?, name, grid: (grid.max(1), 1, 1), block, smem: 0, args });
        Ok(())
    };
    let blocks = |n: usize| n.div_ceil(THREADS as usize).clamp(1, dev.multiprocessors.max(1) * 32) as u32;
    match op {
        Op::RopeAt { theta, layout, scaling } => {
            let x = at[0].dims();
            let (rows, d) = (at[0].numel() / x[3].max(1), x[3]);
            let seq_first = matches!(layout, HeadLayout::Bthd) as i32;
            // The inverse frequencies as `rope`'s recipe passes them (rescaled on the host).
            let freqs = crate::recipe::rope_freqs("rope_at", &scaling.inv_freq(*theta, d))?;
            let args = rope_at_args([Arg::In(0), Arg::In(1), Arg::Out(0)], rows, [x[1], x[2]], seq_first, d, freqs);
            kernel("rope_at", blocks(rows * d / 2), THREADS, args)?;
        }
        Op::CacheWrite { rope } => {
            let (c, n) = (at[0].dims(), at[1].dims());
            let r = c[2] * c[3];
            let mut s = vec![Step::Copy { src: 0, dst: 0, bytes: at[0].size_in_bytes() }];
            let mut args = vec![
                Arg::Out(0),
                Arg::In(1),
                Arg::In(2),
                Arg::I64(c[0] as i64),
                Arg::I64(c[1] as i64),
                Arg::I64(n[1] as i64),
                Arg::I64(r as i64),
            ];
            match rope {
                // The new rows rotated as they are written: a thread a pair of elements.
                Some(rope) => {
                    let freqs = crate::recipe::rope_freqs("cache_write", &rope.scaling.inv_freq(rope.theta, c[3]))?;
                    args.extend([Arg::I64(c[3] as i64), Arg::Blob(freqs), Arg::Status, Arg::Tag]);
                    kernel("cache_write_rope", blocks(at[1].numel() / 2), THREADS, args)?;
                }
                None => {
                    args.extend([Arg::Status, Arg::Tag]);
                    kernel("cache_write", blocks(at[1].numel()), THREADS, args)?;
                }
            }
            s.append(&mut steps);
            steps = s;
        }
        Op::CacheWriteKv { rope } => {
            // Each cache copied to its result unless planned over it, then both caches' new
            // rows written by one kernel: a thread an element of each, or with `rope` a pair.
            let (c, n) = (at[0].dims(), at[2].dims());
            let bytes = at[0].size_in_bytes();
            let mut s = vec![Step::Copy { src: 0, dst: 0, bytes }, Step::Copy { src: 1, dst: 1, bytes }];
            let freqs = match rope {
                Some(r) => crate::recipe::rope_freqs("cache_write_kv", &r.scaling.inv_freq(r.theta, c[3]))?,
                None => crate::recipe::rope_freqs("cache_write_kv", &[])?,
            };
            let args = vec![
                Arg::Out(0),
                Arg::Out(1),
                Arg::In(2),
                Arg::In(3),
                Arg::In(4),
                Arg::I64(c[0] as i64),
                Arg::I64(c[1] as i64),
                Arg::I64(n[1] as i64),
                Arg::I64((c[2] * c[3]) as i64),
                Arg::I64(c[3] as i64),
                Arg::Blob(freqs),
                Arg::I32(rope.is_some() as i32),
                Arg::Status,
                Arg::Tag,
            ];
            let units = if rope.is_some() { at[2].numel() / 2 } else { at[2].numel() };
            kernel("cache_write_kv", blocks(units), THREADS, args)?;
            s.append(&mut steps);
            steps = s;
        }
        Op::AttentionCached { scale, rope } => {
            let (q, k) = (at[0].dims(), at[1].dims());
            let ([b, t, hq, d], [s, hkv]) = ([q[0], q[1], q[2], q[3]], [k[1], k[2]]);
            // The rotation's frequencies (`rope`), or none: the kernel reads them only with it.
            let freqs = match rope {
                Some(r) => crate::recipe::rope_freqs("attention_cached", &r.scaling.inv_freq(r.theta, d))?,
                None => crate::recipe::rope_freqs("attention_cached", &[])?,
            };
            if t >= FLASH_MIN_ROWS
                && let Some(r) = crate::flash::cached_recipe(dev, at, *scale)
            {
                return match rope {
                    None => r,
                    // A prefill chunk on the flash kernels: rope_at's kernel rotates the queries
                    // into scratch first, and the flash kernels read them there.
                    Some(_) => {
                        let mut r = r?;
                        let at_q = r.scratch.next_multiple_of(256);
                        for step in &mut r.steps {
                            if let Step::Kernel { args, .. } = step {
                                for a in args.iter_mut().filter(|a| matches!(a, Arg::In(0))) {
                                    *a = Arg::Scratch(at_q);
                                }
                            }
                        }
                        let rows = at[0].numel() / d.max(1);
                        let io = [Arg::In(0), Arg::In(3), Arg::Scratch(at_q)];
                        let args = rope_at_args(io, rows, [t, hq], 1, d, freqs);
                        let name = format!("rope_at_{sfx}");
                        let rotate = Step::Kernel {
                            func: m.function(&name)?,
                            name,
                            grid: (blocks(rows * d / 2), 1, 1),
                            block: THREADS,
                            smem: 0,
                            args,
                        };
                        r.steps.insert(0, rotate);
                        r.scratch = at_q + at[0].size_in_bytes();
                        Ok(r)
                    }
                };
            }
            if d > THREADS as usize {
                return unsupported(&format!("head size {d} (at most {THREADS})"));
            }
            let plan = AttentionSplit::new([b, t, hq, hkv, s, d], dev.multiprocessors);
            let rows = b * t * hq;
            let (part_bytes, ml_at) = plan.scratch(rows, d);
            let grid = u32::try_from(plan.groups * plan.splits)
                .map_err(|_| CudaError::usage(format!("attention_cached: {} blocks", plan.groups * plan.splits)))?;
            let mut args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::In(2),
                Arg::In(3),
                Arg::Out(0),
                Arg::Scratch(0),
                Arg::Scratch(ml_at),
                Arg::I64(t as i64),
                Arg::I64(hq as i64),
                Arg::I64(s as i64),
                Arg::I64(hkv as i64),
                Arg::I64(d as i64),
                Arg::I64(plan.heads as i64),
                Arg::I64(plan.rows as i64),
                Arg::I64(plan.splits as i64),
                Arg::I64(plan.chunk as i64),
                Arg::F64(*scale),
                Arg::Blob(freqs),
                Arg::I32(rope.is_some() as i32),
            ];
            // The last block of each group combines the splits where the device's counters
            // hold one per group; otherwise a combine kernel of its own does.
            let counted = plan.splits > 1 && plan.groups <= crate::device::COUNTERS;
            args.push(if counted { Arg::Counters } else { Arg::I64(0) });
            // The instance of the least slot bound holding the block's slots (`AC_KERNEL`).
            let slots = plan.heads * plan.rows;
            let ns = [4, 8].into_iter().find(|&n| slots <= n).unwrap_or(MAX_SLOTS);
            kernel(&format!("attention_cached{ns}"), grid, THREADS, args)?;
            if counted {
                scratch = part_bytes;
            } else if plan.splits > 1 {
                let args = vec![
                    Arg::Scratch(0),
                    Arg::Scratch(ml_at),
                    Arg::Out(0),
                    Arg::I64(d as i64),
                    Arg::I64(plan.splits as i64),
                ];
                kernel("attention_cached_combine", rows as u32, (d as u32).next_multiple_of(32).min(THREADS), args)?;
                scratch = part_bytes;
            }
        }
        Op::Sample { temperature, top_k, top_p } => {
            let (rows, v) = (at[0].dims()[0], at[0].dims()[1]);
            let args = vec![
                Arg::In(0),
                Arg::In(1),
                Arg::Out(0),
                Arg::I64(v as i64),
                Arg::F64(*temperature),
                Arg::I64(*top_k as i64),
                Arg::F64(*top_p),
            ];
            kernel("sample", rows as u32, 1024, args)?;
        }
        _ => return unsupported("this op (not a decoding op)"),
    }
    let _ = ot;
    Ok(Recipe { op: op.name(), steps, scratch, node_scratch: 0 })
}

/// The arguments of `rope_at_<dtype>`: `[x, pos, y]`, then `rows` rows of `d` in `[B, n1, n2]`
/// (the position index is `n1`'s with `seq_first`, else `n2`'s) and the frequencies.
fn rope_at_args(
    [x, pos, y]: [Arg; 3],
    rows: usize,
    [n1, n2]: [usize; 2],
    seq_first: i32,
    d: usize,
    freqs: Vec<u64>,
) -> Vec<Arg> {
    vec![
        x,
        pos,
        y,
        Arg::I64(rows as i64),
        Arg::I64(n1 as i64),
        Arg::I64(n2 as i64),
        Arg::I32(seq_first),
        Arg::I64(d as i64),
        Arg::Blob(freqs),
    ]
}

/// How `attention_cached` splits its work (flash-decoding): blocks of `heads` query heads of
/// one kv head (all of a group's heads when they fit, so each K and V row is read once per
/// block) for `rows` query rows (a prefill chunk's rows share the keys too), each block one of
/// `splits` runs of `chunk` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSplit {
    /// Query heads a block takes (at most `AC_H` and `AC_Q / d` of the kernel).
    pub heads: usize,
    /// Query rows a block takes (`rows * heads` at most `AC_H`, times `d` at most `AC_Q`).
    pub rows: usize,
    /// Blocks before splitting: (sequence, run of query rows, kv head, chunk of its heads).
    pub groups: usize,
    pub splits: usize,
    /// Keys of one split; the last split may hold fewer.
    pub chunk: usize,
}

/// Keys a split holds at least: one tile of the kernel (`AC_TK` keys at bf16 head sizes up to 64),
/// so a block's fixed costs (its query rows, the combine's partials) stay small beside its
/// reads.
const MIN_SPLIT_KEYS: usize = 64;
/// Slots (query rows times heads) a block takes at most (`AC_H` in `decode.cu`).
const MAX_SLOTS: usize = 16;
/// Splits at most (the combine reads every split's partial; `AC_MAX_SPLITS` in `decode.cu`).
const MAX_SPLITS: usize = 64;

impl AttentionSplit {
    /// For q `[b, t, hq, d]` over a cache of `s` positions and `hkv` heads on a device of `sms`
    /// multiprocessors: as many splits as bring the blocks to two waves, each of at least
    /// `MIN_SPLIT_KEYS` keys; one split when the groups alone fill the device (prefill).
    pub fn new([b, t, hq, hkv, s, d]: [usize; 6], sms: usize) -> Self {
        let g = hq / hkv.max(1);
        let heads = g.min(MAX_SLOTS).min(2048 / d.max(1)).max(1);
        let rows = t.min(MAX_SLOTS / heads).min(2048 / (heads * d.max(1))).max(1);
        let groups = b * t.div_ceil(rows) * hkv * g.div_ceil(heads);
        let want = (2 * sms.max(1)).div_ceil(groups.max(1));
        let splits = want.min(s.div_ceil(MIN_SPLIT_KEYS)).clamp(1, MAX_SPLITS);
        let chunk = s.div_ceil(splits).max(1);
        AttentionSplit { heads, rows, groups, splits: s.div_ceil(chunk).max(1), chunk }
    }

    /// Scratch bytes for `rows` query rows of `d` (0 with one split), and where the (max,
    /// sum) pairs start in it, after the partial p.v sums.
    pub fn scratch(&self, rows: usize, d: usize) -> (usize, usize) {
        if self.splits == 1 {
            return (0, 0);
        }
        let ml_at = (rows * self.splits * d * 4).next_multiple_of(256);
        (ml_at + rows * self.splits * 2 * 4, ml_at)
    }
}

#[cfg(test)]
mod tests {
    use super::AttentionSplit;

    #[test]
    fn attention_splits_fill_the_device_with_long_enough_runs() {
        // Llama-3.2-1B decode, one sequence: 8 kv heads of 4 query heads, 132 SMs.
        let p = AttentionSplit::new([1, 1, 32, 8, 4096, 64], 132);
        assert_eq!((p.heads, p.groups), (4, 8));
        assert_eq!((p.splits, p.chunk), (33, 125));
        // A short cache: no split under MIN_SPLIT_KEYS keys.
        let p = AttentionSplit::new([1, 1, 32, 8, 300, 64], 132);
        assert_eq!(p.splits, 5);
        assert!(p.chunk >= 60);
        // Batch 16 of Qwen2.5-0.5B (14 query heads over 2 kv heads): 32 groups want 9
        // splits, 768 keys allow 12.
        let p = AttentionSplit::new([16, 1, 14, 2, 768, 64], 132);
        assert_eq!((p.heads, p.groups, p.splits), (7, 32, 9));
        // A decode step's block takes one query row.
        assert_eq!(p.rows, 1);
        // Prefill fills the device on its own, its rows sharing a block's keys, as many as fit
        // the kernel's 16 slots (4 rows of 4 heads); a head size of 256 halves the heads a
        // block takes.
        let prefill = AttentionSplit::new([1, 512, 32, 8, 768, 64], 132);
        assert_eq!((prefill.rows, prefill.groups, prefill.splits), (4, 1024, 1));
        assert_eq!(AttentionSplit::new([16, 128, 14, 2, 768, 64], 132).rows, 2);
        assert_eq!(prefill.scratch(512 * 32, 64), (0, 0));
        assert_eq!(AttentionSplit::new([1, 1, 32, 2, 64, 256], 132).heads, 8);
        // Splits never exceed MAX_SPLITS, nor leave a split empty.
        let p = AttentionSplit::new([1, 1, 1, 1, 1 << 20, 64], 132);
        assert_eq!(p.splits, 64);
        for s in 1..600 {
            let p = AttentionSplit::new([1, 1, 4, 4, s, 32], 100);
            assert!((p.splits - 1) * p.chunk < s && p.splits * p.chunk >= s, "s {s}: {p:?}");
        }
        // The kernel's combine buffers hold MAX_SPLITS splits.
        assert!(super::source().contains(&format!("#define AC_MAX_SPLITS {}\n", super::MAX_SPLITS)));
        let p = AttentionSplit::new([1, 1, 4, 1, 4096, 64], 132);
        let (bytes, ml) = p.scratch(4, 64);
        assert!(ml >= 4 * p.splits * 64 * 4 && bytes == ml + 4 * p.splits * 8);
    }
}
