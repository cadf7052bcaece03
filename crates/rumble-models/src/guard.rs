//! Guards against bad input and bad numbers, used wherever user data comes in:
//!
//! - **Bounded reads** ([`open_regular`], [`read_limited`]): user files are read only when they
//!   are regular files (a FIFO, a device such as `/dev/zero`, a socket or a folder is refused with
//!   its path, never read until memory runs out nor waited on), and only up to a limit: small
//!   metadata files ([`METADATA_LIMIT`]: config.json, tokenizer.json, an index) by a fixed
//!   ceiling, files held whole in memory (data, checkpoints) by the memory this machine has free.
//! - **Memory before allocation** ([`check_host_memory`]): a need compared with the host's
//!   `MemAvailable` (`/proc/meminfo`), refused as "needs X, Y free" instead of an abort or the
//!   OOM killer. The CUDA executor does the same with the device's free memory.
//! - **Finite values** ([`first_non_finite`]): the first NaN or infinity of a float tensor, so a
//!   checkpoint or a diverged run can name the tensor and the element.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rumble_core::DType;

use crate::error::{ModelError, Result};
use crate::host::HostTensor;

/// The most bytes read from a JSON metadata file (config.json, tokenizer.json,
/// tokenizer_config.json, a safetensors index). The largest real ones are tokenizers of a
/// few MB; anything past this is not such a file.
pub const METADATA_LIMIT: u64 = 64 << 20;

/// Opens `path` for reading if it is a regular file (symbolic links followed), returning the
/// file and its length. `what` names the file's role in errors ("config", "data").
pub fn open_regular(path: &Path, what: &str) -> Result<(File, u64)> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    refuse_special(path, &meta, what)?;
    // O_NONBLOCK: should the path have been swapped for a FIFO since the check, opening it
    // does not wait for a writer (the type is checked again on the open file below).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| ModelError::io(path, e))?;
    let meta = f.metadata().map_err(|e| ModelError::io(path, e))?;
    refuse_special(path, &meta, what)?;
    Ok((f, meta.len()))
}

fn refuse_special(path: &Path, meta: &std::fs::Metadata, what: &str) -> Result<()> {
    if meta.is_dir() {
        return Err(ModelError::BadFile { path: path.into(), msg: format!("is a folder, not a {what} file") });
    }
    if !meta.is_file() {
        return Err(ModelError::BadFile {
            path: path.into(),
            msg: format!(
                "is not a regular file (a device, FIFO or socket): rumble reads a {what} file only from a regular file"
            ),
        });
    }
    Ok(())
}

/// The whole of the regular file `path`, refused when it holds more than `limit` bytes.
pub fn read_limited(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    let (f, len) = open_regular(path, what)?;
    let too_big = |n: u64| ModelError::BadFile {
        path: path.into(),
        msg: format!("{} is too large for a {what} file (rumble reads at most {})", fmt_bytes(n), fmt_bytes(limit)),
    };
    if len > limit {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // `take`: a file that grows while it is read still stops at the limit.
    f.take(limit + 1).read_to_end(&mut bytes).map_err(|e| ModelError::io(path, e))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// A small metadata file as text (UTF-8), at most [`METADATA_LIMIT`] bytes.
pub fn read_metadata(path: &Path, what: &str) -> Result<String> {
    let bytes = read_limited(path, METADATA_LIMIT, what)?;
    String::from_utf8(bytes)
        .map_err(|e| ModelError::BadFile { path: path.into(), msg: format!("is not UTF-8 text: {e}") })
}

/// A file held whole in host memory (data, a checkpoint): refused up front when `factor`
/// times its size is more than the memory free.
pub fn read_in_memory(path: &Path, what: &str, factor: u64) -> Result<Vec<u8>> {
    let (_, len) = open_regular(path, what)?;
    check_host_memory(&format!("{}: reading the {what} file", path.display()), len.saturating_mul(factor))?;
    read_limited(path, len.max(1).saturating_mul(2), what)
}

/// Bytes of host memory available now (`MemAvailable` of `/proc/meminfo`), when known.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Refuses `needed` bytes of host memory when more than `MemAvailable` is asked for.
pub fn check_host_memory(what: &str, needed: u64) -> Result<()> {
    match mem_available() {
        Some(free) if needed > free => {
            Err(ModelError::OutOfMemory { what: what.into(), device: "host memory".into(), needed, free })
        }
        _ => Ok(()),
    }
}

/// Host bytes the CPU executor needs for a step of `trace` beyond what is already allocated:
/// its copy of the inputs plus LOAD without in-place reuse (`cpu::eval` gives every result its
/// own allocation and drops each value after its last use).
pub fn cpu_step_bytes(trace: &rumble_core::Trace) -> u64 {
    use rumble_core::plan::{LifetimeOptions, lifetimes::lifetimes};
    let load = lifetimes(trace, LifetimeOptions { inplace: false }).load().0 as u64;
    let inputs = trace.inputs.iter().map(|i| trace.ty(i.value).size_in_bytes() as u64).fold(0, u64::saturating_add);
    load.saturating_add(inputs)
}

/// `1.50 GiB`-style sizes.
pub fn fmt_bytes(n: u64) -> String {
    let units =
        [("EiB", 1u64 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, k) in units {
        if n >= k {
            return format!("{:.2} {u}", n as f64 / k as f64);
        }
    }
    format!("{n} bytes")
}

/// [`fmt_bytes`] of a borrowed count (for error messages).
pub fn fmt_bytes_of(n: &u64) -> String {
    fmt_bytes(*n)
}

/// The first non-finite element of a float tensor: its index and value. `None` for finite
/// tensors and for integer ones.
pub fn first_non_finite(t: &HostTensor) -> Option<(usize, f64)> {
    let b = &t.bytes;
    let found = match t.ty.dtype {
        DType::F32 => b.chunks_exact(4).position(|c| {
            let bits = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            bits & 0x7f80_0000 == 0x7f80_0000
        }),
        DType::BF16 => b.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80),
        DType::F16 => b.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00),
        DType::F64 => b.chunks_exact(8).position(|c| {
            let bits = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            bits & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        }),
        DType::I32 | DType::I64 | DType::Bool => None,
    }?;
    let size = t.ty.dtype.size_in_bytes();
    let one =
        HostTensor { ty: rumble_core::TensorType::new(t.ty.dtype, [1]), bytes: b[found * size..][..size].to_vec() };
    Some((found, one.to_f32().first().copied().unwrap_or(f32::NAN) as f64))
}

/// The first tensor of `tensors` holding a non-finite value: name, element index and value.
pub fn first_non_finite_tensor<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a HostTensor)>,
) -> Option<(String, usize, f64)> {
    tensors.into_iter().find_map(|(name, t)| first_non_finite(t).map(|(i, v)| (name.to_string(), i, v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_non_finite_element() {
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let ok = HostTensor::from_f64(dt, &[3], &[1.0, -2.5, 65000.0]).unwrap();
            assert_eq!(first_non_finite(&ok), None, "{dt}");
            for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                let t = HostTensor::from_f64(dt, &[4], &[0.5, 1.0, bad, bad]).unwrap();
                let (i, v) = first_non_finite(&t).unwrap();
                assert_eq!(i, 2, "{dt} {bad}");
                assert!(!v.is_finite() && (v.is_nan() == bad.is_nan()), "{dt} {bad}: {v}");
            }
        }
    }

    #[test]
    fn special_files_are_refused_by_name() {
        for p in ["/dev/zero", "/dev/null", "/"] {
            let e = read_limited(Path::new(p), 1 << 20, "data").unwrap_err().to_string();
            assert!(e.starts_with(p) && (e.contains("regular file") || e.contains("folder")), "{e}");
        }
        let dir = std::env::temp_dir().join(format!("rumble-guard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("big.json");
        std::fs::write(&f, vec![b' '; 100]).unwrap();
        let e = read_limited(&f, 10, "config").unwrap_err().to_string();
        assert!(e.contains("big.json") && e.contains("too large"), "{e}");
        assert_eq!(read_limited(&f, 100, "config").unwrap().len(), 100);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn memory_needs_are_compared_with_what_is_free() {
        if mem_available().is_some() {
            let e = check_host_memory("a test", u64::MAX).unwrap_err().to_string();
            assert!(e.contains("a test") && e.contains("needs") && e.contains("free"), "{e}");
        }
        check_host_memory("nothing", 0).unwrap();
    }
}
