//! Choosing among the candidate algorithms of one matmul shape (cuBLASLt's heuristic's
//! proposals, then cuBLAS's classic gemm) by timing them.
//!
//! The heuristic's first choice is not always the fastest (on the H200 its exact-f32 choices
//! ran at 41-49 TFLOP/s on the seed-llama shapes; the classic gemm ran their 3200x3200x2048
//! weight gradient 12% faster). Each candidate runs once to warm up and three times timed (CUDA
//! events) on scratch buffers of the shape, filled with small normal numbers; the fastest is
//! kept if it beats the first choice by more than 2% (timing noise must not flip choices
//! between runs), and a candidate needing less workspace within 1% of it is preferred (less
//! scratch in the plan). Nothing here is captured into a graph: while the stream is
//! capturing, or if the scratch buffers cannot be allocated, the first choice stands.
//!
//! Choices are remembered in `matmul-<gpu>-<cublasLt version>.txt` in the kernel cache folder
//! (`RUMBLE_CUDA_CACHE`), one `key<TAB>index` line each, so every later process on the machine
//! runs the same algorithm and gets the same bits. The chosen algorithm's time is recorded for
//! the cost model (`rumble_core::cost::record`, keyed by `cost::matmul_key`) in the same folder,
//! except a row addend's (`MatmulKey::row_addend`: that key does not tell it from the plain
//! shape's, whose time the cost model takes for it, adding the row's read).

use std::path::PathBuf;

use cudarc::cublaslt::sys;
use cudarc::driver::sys as dsys;

use crate::device::Device;
use crate::error::Result;
use crate::matmul::{Algo, Candidate, MatmulKey, Plan};
use crate::memory::DeviceBuffer;
use crate::tune;

/// How much faster a candidate must be than the heuristic's first choice to replace it.
const MARGIN: f64 = 0.98;
/// How much slower than the fastest a candidate needing less workspace may be and still win.
const SMALLER_WORKSPACE: f64 = 1.01;
/// Timed runs of each candidate (after one warm-up).
const RUNS: usize = 3;

/// Index into `cands` of the algorithm `key` should use (0: the heuristic's first choice).
/// `plan` holds the shape's descriptors; its algorithm and workspace are changed while timing.
pub(crate) fn choose(dev: &Device, key: &MatmulKey, plan: &mut Plan, cands: &[Candidate]) -> usize {
    let knobs = dev.knobs();
    if !knobs.matmul_tune {
        return 0;
    }
    let tf32 = knobs.tf32;
    let cap = crate::matmul::max_workspace(&knobs);
    let classic = cands.iter().filter(|c| matches!(c.algo, Algo::Classic)).count();
    let line_key = format!("{key:?} tf32={tf32} ws={cap} candidates={}+classic{classic}", cands.len() - classic);
    let file = cache_file(dev);
    if let Some(i) = file.as_ref().and_then(|f| tune::remembered(f, &line_key)?.parse::<usize>().ok())
        && i < cands.len()
    {
        return i;
    }
    if tune::capturing(dev) {
        return 0;
    }
    let pick = match time_all(dev, key, plan, cands) {
        Ok(times) => {
            let ws: Vec<usize> = cands.iter().map(|c| c.workspace).collect();
            let pick = smallest_near(&times, &ws, best(&times));
            if let (Some(ms), Some(dir)) = (times.get(pick).copied().flatten(), dev.knobs().cache)
                && !key.row_addend
            {
                let shape = rumble_core::cost::MatmulShape {
                    dtype: key.dtype,
                    out: key.out,
                    ta: key.ta,
                    tb: key.tb,
                    batch: key.batch as usize,
                    m: key.m as usize,
                    n: key.n as usize,
                    k: key.k as usize,
                };
                // A cache that cannot be written only loses the measurement.
                let _ =
                    rumble_core::cost::record(&dir, &dev.name, &[(rumble_core::cost::matmul_key(&shape), ms / 1e3)]);
            }
            pick
        }
        Err(_) => return 0,
    };
    if let Some(f) = file {
        tune::remember(&f, &line_key, &pick.to_string());
    }
    pick
}

/// The index to use given each candidate's time (`None`: it failed): the fastest, unless it
/// is within [`MARGIN`] of the first.
pub(crate) fn best(times: &[Option<f64>]) -> usize {
    let Some(first) = times.first().copied().flatten() else {
        // The first choice failed to run: the fastest that ran, if any.
        return times
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (i, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(0, |(i, _)| i);
    };
    let (i, t) = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, first));
    if t < MARGIN * first { i } else { 0 }
}

/// `pick`, or the candidate with the least workspace among those (`pick` included) that ran
/// within [`SMALLER_WORKSPACE`] of its time.
pub(crate) fn smallest_near(times: &[Option<f64>], workspace: &[usize], pick: usize) -> usize {
    let Some(t) = times.get(pick).copied().flatten() else { return pick };
    times
        .iter()
        .enumerate()
        .filter(|(_, x)| x.is_some_and(|x| x <= t * SMALLER_WORKSPACE))
        .min_by_key(|(i, _)| (workspace[*i], *i != pick))
        .map_or(pick, |(i, _)| i)
}

/// Milliseconds per run of each candidate (`None` where it failed to launch).
fn time_all(dev: &Device, key: &MatmulKey, plan: &mut Plan, cands: &[Candidate]) -> Result<Vec<Option<f64>>> {
    let el = |d: rumble_core::ir::DType| d.size_in_bytes() as u64;
    let (m, n, k, bt) = (key.m, key.n, key.k, key.batch.max(1));
    let row = if key.row_addend { n * el(key.out) } else { 0 };
    let bytes = [bt * m * k * el(key.dtype), bt * k * n * el(key.dtype), bt * m * n * el(key.out), row];
    let ws_bytes = cands.iter().map(|h| h.workspace).max().unwrap_or(0).max(256);
    let a = DeviceBuffer::new(dev, bytes[0] as usize, "matmul tuning")?;
    let b = DeviceBuffer::new(dev, bytes[1] as usize, "matmul tuning")?;
    let c = DeviceBuffer::new(dev, bytes[2] as usize, "matmul tuning")?;
    let r = DeviceBuffer::new(dev, bytes[3].max(256) as usize, "matmul tuning")?;
    let ws = DeviceBuffer::new(dev, ws_bytes, "matmul tuning")?;
    for (buf, len) in [(&a, bytes[0]), (&b, bytes[1]), (&c, bytes[2]), (&r, bytes[3])] {
        // 0x3c bytes: about 0.0115 in f32, bf16, f16 and f64 alike.
        crate::memory::fill(dev, buf.ptr, 0x3c, len as usize)?;
    }
    // A row addend is read from its own buffer, as it runs; other matmuls are timed without one.
    let (add, beta) = if key.row_addend { (r.ptr, 1.0) } else { (c.ptr, 0.0) };
    let mut times = Vec::with_capacity(cands.len());
    for h in cands {
        plan.algo = h.algo;
        plan.workspace = h.workspace;
        times.push(time_one(dev, key, plan, [a.ptr, b.ptr, add, c.ptr, ws.ptr], beta).ok());
    }
    dev.synchronize()?;
    Ok(times)
}

fn time_one(dev: &Device, key: &MatmulKey, plan: &Plan, p: [dsys::CUdeviceptr; 5], beta: f64) -> Result<f64> {
    tune::time_ms(dev, RUNS, "matmul tuning", || unsafe { dev.launch_plan(key, plan, p, beta) })
}

fn cache_file(dev: &Device) -> Option<PathBuf> {
    tune::cache_file(dev, "matmul", unsafe { sys::cublasLtGetVersion() })
}

#[cfg(test)]
mod tests {
    use super::{best, smallest_near};

    #[test]
    fn a_candidate_replaces_the_first_choice_only_when_clearly_faster() {
        assert_eq!(best(&[Some(1.0), Some(0.99), Some(0.98)]), 0);
        assert_eq!(best(&[Some(1.0), Some(0.9), Some(0.95)]), 1);
        assert_eq!(best(&[Some(1.0), None, Some(0.5)]), 2);
        assert_eq!(best(&[None, Some(2.0), Some(1.5)]), 2);
        assert_eq!(best(&[None, None]), 0);
        assert_eq!(best(&[]), 0);
    }

    #[test]
    fn less_workspace_wins_a_near_tie() {
        let t = [Some(1.0), Some(0.90), Some(0.905), Some(0.95)];
        // Candidate 2 needs no workspace and is within 1% of the fastest (1).
        assert_eq!(smallest_near(&t, &[0, 32, 0, 0], 1), 2);
        // Equal workspace: the fastest stays.
        assert_eq!(smallest_near(&t, &[0, 32, 32, 0], 1), 1);
        // Candidate 3 needs less but is 5% slower.
        assert_eq!(smallest_near(&t, &[32, 32, 32, 0], 1), 1);
        // A failed pick stays as it is.
        assert_eq!(smallest_near(&[None, Some(1.0)], &[8, 0], 0), 0);
    }
}
