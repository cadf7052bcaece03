//! Recipes of the decoding ops (`rope_at`, `cache_write`, `attention_cached`, `sample`).
//! Until their kernels land, they run as host nodes (the CPU reference between device work).

use rumble_core::ir::{Op, TensorType};

use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::launch::Recipe;

/// The recipe of a decoding op.
pub fn recipe(dev: &Device, op: &Op, at: &[&TensorType], ot: &[&TensorType]) -> Result<Recipe> {
    let _ = (dev, at, ot);
    Err(CudaError::Unsupported(format!("{} (no kernel yet)", op.name())))
}
