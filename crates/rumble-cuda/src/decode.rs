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
//!   two waves of blocks, each run holding at least a number of keys timed once per shape
//!   (`split_keys`: shorter runs put more blocks on a step of few groups, longer ones leave
//!   less to combine). A decode step's attention is latency-bound, so the kernel issues a
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

use crate::compile::{Module, Options};
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
    let sfx = suffix(op, at[0].dtype)?;
    let ints = at.iter().skip(1).filter(|t| t.dtype.is_int());
    if let Some(t) = ints.clone().find(|t| t.dtype != DType::I64) {
        return unsupported(&format!("{} positions or keys (kernels take i64)", t.dtype));
    }
    let m = dev.module(KernelFile::Decode.name(), &source(), Options { fmad: false })?;
    let mut steps = Vec::new();
    let mut kernel = |name: &str, grid: u32, block: u32, args: Vec<Arg>| -> Result<()> {
        steps.push(kernel_step(&m, sfx, name, grid, block, args)?);
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
            if t >= FLASH_MIN_ROWS
                && let Some(r) = crate::flash::cached_recipe(dev, at, *scale)
            {
                return match rope {
                    None => r,
                    // A prefill chunk on the flash kernels: rope_at's kernel rotates the queries
                    // into scratch first, and the flash kernels read them there.
                    Some(rope) => {
                        let freqs =
                            crate::recipe::rope_freqs("attention_cached", &rope.scaling.inv_freq(rope.theta, d))?;
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
            let shape = [b, t, hq, hkv, s, d];
            let keys = split_keys(dev, op, at, shape)?;
            return cached_attention(dev, op, at, AttentionSplit::with_min_keys(shape, dev.multiprocessors, keys));
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
    Ok(Recipe { op: op.name(), steps, scratch: 0, node_scratch: 0 })
}

/// How the recipe of `attention_cached` on `at` splits its work on `dev` (the split timed per
/// shape, `split_keys`), or `None` where it runs on the flash forward (a prefill chunk of
/// `FLASH_MIN_ROWS` rows or more that the flash kernels take).
pub fn attention_split(dev: &Device, op: &Op, at: &[&TensorType]) -> Result<Option<AttentionSplit>> {
    let Op::AttentionCached { scale, .. } = op else {
        return Err(CudaError::usage(format!("{}: not attention_cached", op.name())));
    };
    let (q, k) = (at[0].dims(), at[1].dims());
    let shape = [q[0], q[1], q[2], k[2], k[1], q[3]];
    if q[1] >= FLASH_MIN_ROWS && crate::flash::cached_recipe(dev, at, *scale).is_some() {
        return Ok(None);
    }
    head_size_fits(q[3])?;
    Ok(Some(AttentionSplit::with_min_keys(shape, dev.multiprocessors, split_keys(dev, op, at, shape)?)))
}

/// The decode kernels' name suffix for operands of `dt`.
fn suffix(op: &Op, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        d => Err(CudaError::Unsupported(format!("{} on {d} (kernels take f32, bf16, f16)", op.name()))),
    }
}

/// A step launching `<name>_<sfx>` of the decode module `m`.
fn kernel_step(m: &Module, sfx: &str, name: &str, grid: u32, block: u32, args: Vec<Arg>) -> Result<Step> {
    let name = format!("{name}_{sfx}");
    Ok(Step::Kernel { func: m.function(&name)?, name, grid: (grid.max(1), 1, 1), block, smem: 0, args })
}

/// The decode attention kernel takes head sizes up to a block's threads.
fn head_size_fits(d: usize) -> Result<()> {
    if d > THREADS as usize {
        return Err(CudaError::Unsupported(format!("attention_cached on head size {d} (at most {THREADS})")));
    }
    Ok(())
}

/// `attention_cached`'s recipe on the decode kernel, split as `plan` says.
fn cached_attention(dev: &Device, op: &Op, at: &[&TensorType], plan: AttentionSplit) -> Result<Recipe> {
    let Op::AttentionCached { scale, rope } = op else {
        return Err(CudaError::usage(format!("{}: not attention_cached", op.name())));
    };
    let (q, k) = (at[0].dims(), at[1].dims());
    let ([b, t, hq, d], [s, hkv]) = ([q[0], q[1], q[2], q[3]], [k[1], k[2]]);
    head_size_fits(d)?;
    let sfx = suffix(op, at[0].dtype)?;
    let freqs = match rope {
        Some(r) => crate::recipe::rope_freqs("attention_cached", &r.scaling.inv_freq(r.theta, d))?,
        None => crate::recipe::rope_freqs("attention_cached", &[])?,
    };
    let m = dev.module(KernelFile::Decode.name(), &source(), Options { fmad: false })?;
    let mut steps = Vec::new();
    let mut scratch = 0;
    let mut kernel = |name: &str, grid: u32, block: u32, args: Vec<Arg>| -> Result<()> {
        steps.push(kernel_step(&m, sfx, name, grid, block, args)?);
        Ok(())
    };
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
        let args =
            vec![Arg::Scratch(0), Arg::Scratch(ml_at), Arg::Out(0), Arg::I64(d as i64), Arg::I64(plan.splits as i64)];
        kernel("attention_cached_combine", rows as u32, (d as u32).next_multiple_of(32).min(THREADS), args)?;
        scratch = part_bytes;
    }
    Ok(Recipe { op: op.name(), steps, scratch, node_scratch: 0 })
}

/// The least keys a split of `attention_cached` holds on the decode kernel, for q `[b, t, hq,
/// d]` over a cache of `s` positions and `hkv` heads: each of [`SPLIT_KEYS`] that gives a
/// split of its own is timed once per shape on the device, over a full cache, and the fastest
/// is kept (remembered in `attention-cached-<gpu>-1.txt` in the kernel cache folder where there
/// is one, like the matmul tuner's choices). More, shorter splits put more blocks on a
/// latency-bound step; fewer leave less for the combine. [`MIN_SPLIT_KEYS`] where nothing can
/// be timed (a graph being captured, every timing failed).
fn split_keys(dev: &Device, op: &Op, at: &[&TensorType], shape: [usize; 6]) -> Result<usize> {
    let mut plans: Vec<(usize, AttentionSplit)> = Vec::new();
    for keys in SPLIT_KEYS {
        let p = AttentionSplit::with_min_keys(shape, dev.multiprocessors, keys);
        if !plans.iter().any(|(_, q)| q.splits == p.splits) {
            plans.push((keys, p));
        }
    }
    if plans.len() < 2 {
        return Ok(MIN_SPLIT_KEYS);
    }
    let key = format!("{op:?} {shape:?} {}", at[0].dtype);
    let cache = dev.cache::<SplitCache>();
    if let Some(&k) = cache.lock().unwrap_or_else(|e| e.into_inner()).0.get(&key) {
        return Ok(k);
    }
    let file = crate::tune::cache_file(dev, "attention-cached", 1);
    let remembered = file.as_ref().and_then(|f| crate::tune::remembered(f, &key)).and_then(|v| v.parse().ok());
    let keys = match remembered {
        Some(k) => k,
        None if crate::tune::capturing(dev) => return Ok(MIN_SPLIT_KEYS),
        None => {
            let mut times: Vec<(usize, f64)> = Vec::new();
            for (keys, plan) in &plans {
                // A candidate that fails to build or to time (scratch that does not fit, say) is
                // left out.
                if let Ok(r) = cached_attention(dev, op, at, *plan)
                    && let Ok(ms) = time_split(dev, &r, op, at, shape)
                {
                    times.push((*keys, ms));
                }
            }
            let keys = pick_split(&times);
            // A choice made without every candidate's time holds for this process only.
            if let Some(f) = file.as_ref().filter(|_| times.len() == plans.len()) {
                crate::tune::remember(f, &key, &keys.to_string());
            }
            keys
        }
    };
    cache.lock().unwrap_or_else(|e| e.into_inner()).0.insert(key, keys);
    Ok(keys)
}

/// The split length kept among timed `(keys, ms)`: [`MIN_SPLIT_KEYS`] unless another is faster
/// by more than [`SPLIT_MARGIN`] (a gain inside the timing's noise changes nothing), then the
/// fastest; [`MIN_SPLIT_KEYS`] too where it was not timed.
fn pick_split(times: &[(usize, f64)]) -> usize {
    let Some(&(_, base)) = times.iter().find(|t| t.0 == MIN_SPLIT_KEYS) else { return MIN_SPLIT_KEYS };
    match times.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
        Some(&(k, ms)) if ms < SPLIT_MARGIN * base => k,
        _ => MIN_SPLIT_KEYS,
    }
}

/// The split choices this process made or read, by shape.
#[derive(Default)]
struct SplitCache(std::collections::HashMap<String, usize>);

impl crate::device::DeviceCache for SplitCache {
    fn release(&mut self) {}
}

/// Milliseconds per run of `r` on buffers of the op's shapes: small values everywhere, every
/// sequence's position at the end of the cache (the most keys a step reads).
fn time_split(dev: &Device, r: &Recipe, op: &Op, at: &[&TensorType], [b, t, _, _, s, _]: [usize; 6]) -> Result<f64> {
    use crate::memory::DeviceBuffer;
    let outs = op.infer(at).map_err(|e| CudaError::usage(format!("timing attention_cached: {e}")))?;
    let mut bufs = Vec::new();
    for ty in at.iter().copied().chain(outs.iter()) {
        let buf = DeviceBuffer::new(dev, ty.size_in_bytes().max(1), "timing attention_cached")?;
        crate::memory::fill(dev, buf.ptr, 0x3c, ty.size_in_bytes())?;
        bufs.push(buf);
    }
    let pos: Vec<u8> = (0..b).flat_map(|_| (s.saturating_sub(t) as i64).to_le_bytes()).collect();
    crate::memory::upload(dev, bufs[3].ptr, &pos)?;
    let scratch = DeviceBuffer::new(dev, r.scratch.max(1), "timing attention_cached")?;
    let ptrs: Vec<_> = bufs.iter().map(|x| x.ptr).collect();
    let (args, outp) = ptrs.split_at(at.len());
    let bb = crate::launch::Buffers { args, outs: outp, scratch: scratch.ptr, scratch_bytes: scratch.bytes, node: 0 };
    crate::tune::graph_time_ms(dev, SPLIT_RUNS, "attention_cached split timing", || unsafe { r.launch(dev, 0, &bb) })
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

/// Keys a split holds at least where the split is not timed ([`split_keys`]): one tile of the
/// kernel (`AC_TK` keys at bf16 head sizes up to 64), so a block's fixed costs (its query rows,
/// the combine's partials) stay small beside its reads.
const MIN_SPLIT_KEYS: usize = 64;
/// The least keys a split may hold, each timed per shape ([`split_keys`]).
const SPLIT_KEYS: [usize; 4] = [16, 32, 64, 128];
/// Runs of each candidate split captured in the graph that times it.
const SPLIT_RUNS: usize = 20;
/// Another split length is kept only if it takes less than this fraction of the default's time.
const SPLIT_MARGIN: f64 = 0.98;
/// Slots (query rows times heads) a block takes at most (`AC_H` in `decode.cu`).
const MAX_SLOTS: usize = 16;
/// Splits at most (the combine reads every split's partial; `AC_MAX_SPLITS` in `decode.cu`).
const MAX_SPLITS: usize = 64;

impl AttentionSplit {
    /// For q `[b, t, hq, d]` over a cache of `s` positions and `hkv` heads on a device of `sms`
    /// multiprocessors: as many splits as bring the blocks to two waves, each of at least
    /// `MIN_SPLIT_KEYS` keys; one split when the groups alone fill the device (prefill).
    pub fn new(shape: [usize; 6], sms: usize) -> Self {
        Self::with_min_keys(shape, sms, MIN_SPLIT_KEYS)
    }

    /// As [`AttentionSplit::new`], each split holding at least `min_keys` keys.
    pub fn with_min_keys([b, t, hq, hkv, s, d]: [usize; 6], sms: usize, min_keys: usize) -> Self {
        let g = hq / hkv.max(1);
        let heads = g.min(MAX_SLOTS).min(2048 / d.max(1)).max(1);
        let rows = t.min(MAX_SLOTS / heads).min(2048 / (heads * d.max(1))).max(1);
        let groups = b * t.div_ceil(rows) * hkv * g.div_ceil(heads);
        let want = (2 * sms.max(1)).div_ceil(groups.max(1));
        let splits = want.min(s.div_ceil(min_keys.max(1))).clamp(1, MAX_SPLITS);
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
        // The split lengths the recipe times: Qwen2.5-0.5B's batch-1 step has two groups, so
        // shorter splits put more blocks on the device (at most MAX_SPLITS of them a group).
        let qwen = [1, 1, 14, 2, 768, 64];
        let splits = super::SPLIT_KEYS.map(|k| AttentionSplit::with_min_keys(qwen, 132, k).splits);
        assert_eq!(splits, [48, 24, 12, 6]);
        assert_eq!(AttentionSplit::new(qwen, 132), AttentionSplit::with_min_keys(qwen, 132, super::MIN_SPLIT_KEYS));
        // The default stays unless another length is faster by more than the margin.
        use super::pick_split;
        assert_eq!(pick_split(&[(16, 9.0), (32, 9.5), (64, 10.0), (128, 12.0)]), 16);
        assert_eq!(pick_split(&[(16, 9.9), (64, 10.0)]), 64);
        assert_eq!(pick_split(&[(16, 5.0)]), 64, "the default untimed: nothing to compare with");
        assert_eq!(pick_split(&[]), 64);
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
