//! Host-side tensors: building them from and reading them into Rust numbers.
//!
//! `HostTensor` (a type and little-endian bytes) is what executors take and return.

use half::{bf16, f16};
use rumble_core::{DType, TensorType};

use crate::error::{ModelError, Result};

pub use crate::exec::HostTensor;

/// A tensor of `dtype` and `dims` holding `vals` (rounded to nearest even for bf16/f16).
pub fn from_f32s(dtype: DType, dims: &[usize], vals: &[f32]) -> Result<HostTensor> {
    let ty = TensorType::new(dtype, dims.to_vec());
    if ty.numel() != vals.len() {
        return Err(ModelError::Usage(format!("{} values do not fill a {ty}", vals.len())));
    }
    let mut bytes = Vec::with_capacity(ty.size_in_bytes());
    match dtype {
        DType::F32 => vals.iter().for_each(|v| bytes.extend(v.to_le_bytes())),
        DType::F64 => vals.iter().for_each(|v| bytes.extend((*v as f64).to_le_bytes())),
        DType::BF16 => vals.iter().for_each(|v| bytes.extend(bf16::from_f32(*v).to_le_bytes())),
        DType::F16 => vals.iter().for_each(|v| bytes.extend(f16::from_f32(*v).to_le_bytes())),
        DType::I32 | DType::I64 | DType::Bool => {
            return Err(ModelError::Usage(format!("from_f32s: {dtype} is not a float dtype")));
        }
    }
    Ok(HostTensor { ty, bytes })
}

/// The elements of a float tensor as f32.
pub fn to_f32s(t: &HostTensor) -> Result<Vec<f32>> {
    let b = &t.bytes;
    if b.len() != t.ty.size_in_bytes() {
        return Err(ModelError::Usage(format!("{} bytes do not hold a {}", b.len(), t.ty)));
    }
    Ok(match t.ty.dtype {
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        d => return Err(ModelError::Usage(format!("to_f32s: {d} is not a float dtype"))),
    })
}

/// An i64 tensor.
pub fn from_i64s(dims: &[usize], vals: &[i64]) -> Result<HostTensor> {
    let ty = TensorType::new(DType::I64, dims.to_vec());
    if ty.numel() != vals.len() {
        return Err(ModelError::Usage(format!("{} values do not fill a {ty}", vals.len())));
    }
    Ok(HostTensor { ty, bytes: vals.iter().flat_map(|v| v.to_le_bytes()).collect() })
}

/// An f32 scalar `[]`.
pub fn scalar_f32(v: f32) -> HostTensor {
    HostTensor { ty: TensorType::scalar(DType::F32), bytes: v.to_le_bytes().to_vec() }
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
    HostTensor { ty: ty.clone(), bytes: vec![0; ty.size_in_bytes()] }
}
