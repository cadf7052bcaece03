//! The `RUMBLE_*` environment variables the CUDA backend reads, read once into [`Knobs`].
//!
//! [`process`] reads them the first time anything asks (a bad value is an error naming the
//! variable, never a silent default); every [`Device`](crate::Device) starts from a copy,
//! which [`Device::set_knobs`](crate::Device::set_knobs) may change for the programs prepared
//! after it (tests switch the wgmma kernels or the per-row attention that way, without touching
//! the process environment). Library code reads the struct, never the environment. The table
//! in ARCHITECTURE.md ("Environment variables") lists every variable; a test keeps it complete.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{CudaError, Result};

/// Every setting the CUDA backend takes from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Knobs {
    /// `RUMBLE_ATTENTION`: which kernels run attention (bf16/f16; see [`AttentionImpl`]).
    pub attention: AttentionImpl,
    /// `RUMBLE_DETERMINISTIC=1`: only kernels that give the same bits on every run (keeps out
    /// cuDNN's attention backward, whose dQ is summed with atomics).
    pub deterministic: bool,
    /// `RUMBLE_FLASH_WG=0` turns off the wgmma flash kernels (sm_90: the forward at head size 128,
    /// dQ at 64 and 128), leaving their mma.sync counterparts.
    pub flash_wgmma: bool,
    /// `RUMBLE_FLASH_SPLIT=n`: the dK/dV kernel splits each kv head's group of query heads into
    /// n block rows (clamped to the group) instead of `flash::dkdv_split`'s choice.
    pub flash_split: Option<usize>,
    /// `RUMBLE_CUDA_TF32=1`: f32 matmuls may use TF32 tensor cores (faster, ~10 mantissa bits).
    pub tf32: bool,
    /// `RUMBLE_CUDA_SYNC=1`: the eager executor synchronises after every node (errors then name
    /// the node that failed).
    pub sync_each: bool,
    /// `RUMBLE_CUDA_CACHE`: where compiled kernels (CUBINs) are kept, `off` for nowhere; unset:
    /// `$XDG_CACHE_HOME/rumble/cuda` or `~/.cache/rumble/cuda`.
    pub cache: Option<PathBuf>,
    /// `RUMBLE_CUDA_LINEINFO=1`: kernels compiled with line information (for profilers).
    pub lineinfo: bool,
    /// `RUMBLE_HOST_OPS=name,name`: ops whose nodes run on the host (the CPU reference).
    pub host_ops: Vec<String>,
    /// `RUMBLE_MATMUL_WORKSPACE_MB`: the cuBLASLt workspace cap per matmul (MiB; 0: none).
    pub matmul_workspace_mb: Option<usize>,
    /// `RUMBLE_MATMUL_CANDIDATES`: how many cuBLASLt heuristics the matmul tuner times (at most
    /// `matmul::MAX_CANDIDATES`).
    pub matmul_candidates: Option<usize>,
    /// `RUMBLE_MATMUL_CLASSIC=0`: leave classic cuBLAS out of the matmul candidates.
    pub matmul_classic: bool,
    /// `RUMBLE_MATMUL_TUNE=0`: take cuBLASLt's first heuristic instead of timing candidates.
    pub matmul_tune: bool,
    /// `RUMBLE_PDL=0`: rumble's kernels launch plainly, each after the one before it has
    /// finished, instead of with programmatic dependent launch (sm_90 on; `launch::kernel`).
    pub pdl: bool,
}

/// Which kernels run `Op::Attention` and its backward (`RUMBLE_ATTENTION`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionImpl {
    /// `auto` (the default): per shape, cuDNN's fused attention where it runs faster than the
    /// flash kernels (timed once, `crate::cudnn`), the flash kernels otherwise.
    Auto,
    /// `flash`: always the flash kernels.
    Flash,
    /// `cudnn`: cuDNN wherever it has an engine for the shape.
    Cudnn,
    /// `naive`: the simple per-row kernels, never the flash ones nor cuDNN.
    Naive,
}

impl Default for Knobs {
    /// Every variable unset.
    fn default() -> Knobs {
        Knobs {
            attention: AttentionImpl::Auto,
            deterministic: false,
            flash_wgmma: true,
            flash_split: None,
            tf32: false,
            sync_each: false,
            cache: default_cache(),
            lineinfo: false,
            host_ops: Vec::new(),
            matmul_workspace_mb: None,
            matmul_candidates: None,
            matmul_classic: true,
            matmul_tune: true,
            pdl: true,
        }
    }
}

/// Every `RUMBLE_*` variable [`Knobs::from_env`] reads (ARCHITECTURE.md's table lists these
/// and the ones tests and benches read).
pub const VARIABLES: [&str; 14] = [
    "RUMBLE_ATTENTION",
    "RUMBLE_DETERMINISTIC",
    "RUMBLE_FLASH_WG",
    "RUMBLE_FLASH_SPLIT",
    "RUMBLE_CUDA_TF32",
    "RUMBLE_CUDA_SYNC",
    "RUMBLE_CUDA_CACHE",
    "RUMBLE_CUDA_LINEINFO",
    "RUMBLE_HOST_OPS",
    "RUMBLE_MATMUL_WORKSPACE_MB",
    "RUMBLE_MATMUL_CANDIDATES",
    "RUMBLE_MATMUL_CLASSIC",
    "RUMBLE_MATMUL_TUNE",
    "RUMBLE_PDL",
];

fn default_cache() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(x).join("rumble/cuda"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rumble/cuda"))
}

impl Knobs {
    /// The knobs as `get` gives the variables (`get(name)`: the value, `None` when unset);
    /// an error names the variable and its value where one makes no sense.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Knobs> {
        let mut k = Knobs::default();
        let get = |name: &str| get(name).filter(|v| !v.is_empty());
        let bad = |name: &str, v: &str, want: &str| CudaError::usage(format!("{name}={v:?}: expected {want}"));
        // A 0/1 switch: `Some(true)` for 1, `Some(false)` for 0, `None` when unset.
        let switch = |name: &str| -> Result<Option<bool>> {
            match get(name).as_deref() {
                None => Ok(None),
                Some("1") => Ok(Some(true)),
                Some("0") => Ok(Some(false)),
                Some(v) => Err(bad(name, v, "0 or 1")),
            }
        };
        // A whole number at least `min`.
        let count = |name: &str, min: usize| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n >= min => Ok(Some(n)),
                    _ => Err(bad(name, &v, &format!("a whole number, at least {min}"))),
                },
            }
        };
        match get("RUMBLE_ATTENTION").as_deref() {
            None | Some("auto") => {}
            Some("flash") => k.attention = AttentionImpl::Flash,
            Some("cudnn") => k.attention = AttentionImpl::Cudnn,
            Some("naive") => k.attention = AttentionImpl::Naive,
            Some(v) => return Err(bad("RUMBLE_ATTENTION", v, "auto, flash, cudnn or naive")),
        }
        k.deterministic = switch("RUMBLE_DETERMINISTIC")?.unwrap_or(false);
        k.flash_wgmma = switch("RUMBLE_FLASH_WG")?.unwrap_or(true);
        k.flash_split = count("RUMBLE_FLASH_SPLIT", 1)?;
        k.tf32 = switch("RUMBLE_CUDA_TF32")?.unwrap_or(false);
        k.sync_each = switch("RUMBLE_CUDA_SYNC")?.unwrap_or(false);
        k.lineinfo = switch("RUMBLE_CUDA_LINEINFO")?.unwrap_or(false);
        match get("RUMBLE_CUDA_CACHE").as_deref() {
            None => {}
            Some("off") => k.cache = None,
            Some(dir) => k.cache = Some(PathBuf::from(dir)),
        }
        if let Some(v) = get("RUMBLE_HOST_OPS") {
            k.host_ops = v.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect();
        }
        k.matmul_workspace_mb = count("RUMBLE_MATMUL_WORKSPACE_MB", 0)?;
        k.matmul_candidates = count("RUMBLE_MATMUL_CANDIDATES", 1)?;
        k.matmul_classic = switch("RUMBLE_MATMUL_CLASSIC")?.unwrap_or(true);
        k.matmul_tune = switch("RUMBLE_MATMUL_TUNE")?.unwrap_or(true);
        k.pdl = switch("RUMBLE_PDL")?.unwrap_or(true);
        Ok(k)
    }

    /// The knobs of this process's environment.
    pub fn from_env() -> Result<Knobs> {
        Knobs::from_lookup(|name| std::env::var(name).ok())
    }
}

/// The process's knobs, read from the environment once (the first call).
pub fn process() -> Result<&'static Knobs> {
    static KNOBS: OnceLock<std::result::Result<Knobs, String>> = OnceLock::new();
    KNOBS.get_or_init(|| Knobs::from_env().map_err(|e| e.to_string())).as_ref().map_err(|e| CudaError::usage(e.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Knobs> {
        Knobs::from_lookup(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn unset_variables_give_the_defaults() {
        assert_eq!(with(&[]).unwrap(), Knobs::default());
        let k = Knobs::default();
        assert!(
            k.flash_wgmma
                && k.attention == AttentionImpl::Auto
                && !k.deterministic
                && !k.tf32
                && k.matmul_tune
                && k.pdl
                && k.flash_split.is_none()
        );
    }

    #[test]
    fn variables_set_their_knobs() {
        let k = with(&[
            ("RUMBLE_ATTENTION", "naive"),
            ("RUMBLE_FLASH_WG", "0"),
            ("RUMBLE_FLASH_SPLIT", "3"),
            ("RUMBLE_CUDA_TF32", "1"),
            ("RUMBLE_CUDA_CACHE", "off"),
            ("RUMBLE_HOST_OPS", "rms_norm, rope,"),
            ("RUMBLE_MATMUL_CANDIDATES", "4"),
            ("RUMBLE_PDL", "0"),
            ("RUMBLE_DETERMINISTIC", "1"),
        ])
        .unwrap();
        assert!(k.attention == AttentionImpl::Naive && k.deterministic && !k.flash_wgmma && k.tf32 && !k.pdl);
        assert_eq!((k.flash_split, k.cache, k.matmul_candidates), (Some(3), None, Some(4)));
        assert_eq!(k.host_ops, ["rms_norm", "rope"]);
        assert_eq!(with(&[("RUMBLE_CUDA_CACHE", "/tmp/k")]).unwrap().cache, Some(PathBuf::from("/tmp/k")));
        assert_eq!(with(&[("RUMBLE_ATTENTION", "cudnn")]).unwrap().attention, AttentionImpl::Cudnn);
        assert_eq!(with(&[("RUMBLE_ATTENTION", "flash")]).unwrap().attention, AttentionImpl::Flash);
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (name, v) in [
            ("RUMBLE_FLASH_SPLIT", "two"),
            ("RUMBLE_FLASH_SPLIT", "0"),
            ("RUMBLE_CUDA_TF32", "yes"),
            ("RUMBLE_ATTENTION", "fast"),
            ("RUMBLE_MATMUL_WORKSPACE_MB", "-1"),
        ] {
            let e = with(&[(name, v)]).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(v), "{e}");
        }
    }
}
