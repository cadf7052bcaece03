//! `rumble generate --bench --profile`: one prefill and one decode step on random weights,
//! each timed launch by launch on its own planned executor
//! (`rumble_models::generate::profile`), summed by op and kernel family as `rumble bench
//! --profile` does for a training step. For the decode step it also gives the bandwidth its
//! device time alone would reach: launch gaps, which a graph replay shortens but does not
//! remove, are not in it.

use rumble_core::cpu::HostTensor;
use rumble_models::cuda::NodeTime;
use rumble_models::generate::{self, GenConfig};
use rumble_models::{Config, Result};
use serde_json::json;

use crate::bench::{kernel_family, round3};

/// Launches summed by (op, kernel family), the largest first: `(op, family, launches, ms)`.
fn by_family(times: &[NodeTime]) -> Vec<(&'static str, String, usize, f64)> {
    let mut sums: std::collections::BTreeMap<(&'static str, String), (usize, f64)> = Default::default();
    for t in times {
        let e = sums.entry((t.op, kernel_family(&t.kernel))).or_default();
        e.0 += 1;
        e.1 += t.ms;
    }
    let mut rows: Vec<_> = sums.into_iter().map(|((op, k), (n, ms))| (op, k, n, ms)).collect();
    rows.sort_by(|x, y| y.3.total_cmp(&x.3));
    rows
}

/// Profiles `opts`' two traces with prompts of `prompt_len` tokens and prints a table each (or
/// one JSON line); `read` is the bytes the decode step must read (weights and cache).
pub(crate) fn run(
    name: &str,
    cfg: &Config,
    weights: &[(String, HostTensor)],
    opts: &GenConfig,
    prompt_len: usize,
    read: f64,
    as_json: bool,
) -> Result<()> {
    let steps = generate::profile(cfg, weights, opts, prompt_len)?;
    let mut out = Vec::new();
    for (phase, times) in &steps {
        let total: f64 = times.iter().map(|t| t.ms).sum();
        let hbm = (*phase == "decode").then(|| read / (total.max(1e-9) / 1e3) / 4.8e12);
        out.push((*phase, total, hbm, by_family(times), times.len()));
    }
    if as_json {
        let steps: Vec<_> = out
            .iter()
            .map(|(phase, total, hbm, rows, launches)| {
                let ops: Vec<_> = rows
                    .iter()
                    .map(|(op, k, n, ms)| json!({"op": op, "kernel": k, "launches": n, "ms": round3(*ms)}))
                    .collect();
                json!({"step": phase, "device_ms": round3(*total), "launches": launches,
                       "hbm_fraction_of_device_time": hbm, "by_kernel": ops})
            })
            .collect();
        let line = json!({"event": "generate_profile", "config": name, "batch": opts.batch, "prompt_len": prompt_len,
                          "max_length": opts.max_length, "decode_bytes_read": read, "steps": steps});
        return crate::output::line(line);
    }
    for (phase, total, hbm, rows, launches) in &out {
        crate::outln!(
            "{name} {phase} (batch {}, prompt {prompt_len}, cache {}): {total:.3} ms of device time over {launches} launches",
            opts.batch,
            opts.max_length
        )?;
        if let Some(f) = hbm {
            crate::outln!("  {:.2} GB to read: {:.1}% of 4.8 TB/s over the device time alone", read / 1e9, 100.0 * f)?;
        }
        crate::outln!("{:<22} {:<44} {:>8} {:>10} {:>6}", "op", "kernel", "launches", "ms", "%")?;
        for (op, k, n, ms) in rows {
            crate::outln!("{op:<22} {k:<44} {n:>8} {ms:>10.3} {:>5.1}%", 100.0 * ms / total.max(1e-9))?;
        }
        crate::outln!("")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_sum_by_op_and_family_largest_first() {
        let t = |op, kernel: &str, ms| NodeTime {
            node: 0,
            op,
            kernel: kernel.into(),
            out: String::new(),
            phase: "Forward".into(),
            ms,
        };
        let times = [
            t("fused", "ew_1a2b", 0.5),
            t("attention_cached", "attention_cached4_bf16", 2.0),
            t("fused", "ew_ffff", 0.25),
            t("attention_cached", "attention_cached_combine_bf16", 0.125),
        ];
        let rows = by_family(&times);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0], ("attention_cached", "attention_cached4_bf16".into(), 1, 2.0));
        assert_eq!(rows[1], ("fused", "generated elementwise".into(), 2, 0.75));
        assert_eq!(rows[2].3, 0.125);
    }
}
