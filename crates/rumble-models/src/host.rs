//! Host-side tensors: small conversions on top of `rumble_core::cpu::HostTensor` (a type and
//! little-endian bytes), which is what executors take and return.

use rumble_core::{DType, TensorType};

pub use rumble_core::cpu::HostTensor;

use crate::error::{ModelError, Result};

/// A float tensor of `dtype` and `dims` holding `vals` (rounded to nearest even for bf16/f16).
pub fn from_f32s(dtype: DType, dims: &[usize], vals: &[f32]) -> Result<HostTensor> {
    if !dtype.is_float() {
        return Err(ModelError::Usage(format!("from_f32s: {dtype} is not a float dtype")));
    }
    let wide: Vec<f64> = vals.iter().map(|&v| v as f64).collect();
    Ok(HostTensor::from_f64(dtype, dims, &wide)?)
}

/// The elements of a float tensor as f32.
pub fn to_f32s(t: &HostTensor) -> Result<Vec<f32>> {
    if !t.ty.dtype.is_float() || t.bytes.len() != t.ty.size_in_bytes() {
        return Err(ModelError::Usage(format!("expected float data, got {} in {} bytes", t.ty, t.bytes.len())));
    }
    Ok(t.to_f32())
}

/// An i64 tensor.
pub fn from_i64s(dims: &[usize], vals: &[i64]) -> Result<HostTensor> {
    Ok(HostTensor::from_i64(DType::I64, dims, vals)?)
}

/// An f32 scalar `[]`.
pub fn scalar_f32(v: f32) -> HostTensor {
    HostTensor::scalar(DType::F32, v as f64)
}

/// The value of a one-element float tensor.
pub fn item(t: &HostTensor) -> Result<f32> {
    match to_f32s(t)?.as_slice() {
        [v] => Ok(*v),
        _ => Err(ModelError::Usage(format!("expected one element, got {}", t.ty))),
    }
}

/// All zeros of type `ty`.
pub fn zeros(ty: &TensorType) -> HostTensor {
    HostTensor::zeros(ty.clone())
}
