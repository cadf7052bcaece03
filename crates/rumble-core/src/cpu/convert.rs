//! Little-endian host bytes <-> computation types. Every float dtype is computed in `f32`
//! except `f64`; storage rounds once per op (bf16/f16 round to nearest even).

use half::{bf16, f16};

use crate::ir::DType;

/// A float type the CPU computes in: `f32` (for f32, bf16, f16 storage) or `f64`.
pub trait Real:
    num_traits::Float + num_traits::FloatConst + Send + Sync + std::iter::Sum + Default + std::fmt::Debug + 'static
{
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
}

impl Real for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn f64(self) -> f64 {
        self
    }
}

/// Decodes float bytes of `dtype` into computation type `A`.
pub fn read_float<A: Real>(dtype: DType, bytes: &[u8]) -> Vec<A> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| A::of(f32::from_le_bytes(c.try_into().unwrap()) as f64)).collect(),
        DType::F64 => bytes.chunks_exact(8).map(|c| A::of(f64::from_le_bytes(c.try_into().unwrap()))).collect(),
        DType::BF16 => {
            bytes.chunks_exact(2).map(|c| A::of(bf16::from_le_bytes([c[0], c[1]]).to_f32() as f64)).collect()
        }
        DType::F16 => bytes.chunks_exact(2).map(|c| A::of(f16::from_le_bytes([c[0], c[1]]).to_f32() as f64)).collect(),
        DType::I32 | DType::I64 | DType::Bool => read_int(dtype, bytes).into_iter().map(|i| A::of(i as f64)).collect(),
    }
}

/// Encodes values of computation type `A` as `dtype` bytes (rounding to nearest even).
pub fn write_float<A: Real>(dtype: DType, vals: &[A]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size_in_bytes());
    match dtype {
        DType::F32 => vals.iter().for_each(|v| out.extend((v.f64() as f32).to_le_bytes())),
        DType::F64 => vals.iter().for_each(|v| out.extend(v.f64().to_le_bytes())),
        // One rounding from the computed value, as GPUs do.
        DType::BF16 => vals.iter().for_each(|v| out.extend(bf16::from_f64(v.f64()).to_le_bytes())),
        DType::F16 => vals.iter().for_each(|v| out.extend(f16::from_f64(v.f64()).to_le_bytes())),
        DType::I32 | DType::I64 | DType::Bool => {
            let ints: Vec<i64> = vals.iter().map(|v| v.f64() as i64).collect();
            return write_int(dtype, &ints);
        }
    }
    out
}

/// Decodes integer or bool bytes as i64.
pub fn read_int(dtype: DType, bytes: &[u8]) -> Vec<i64> {
    match dtype {
        DType::I32 => bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        DType::I64 => bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::Bool => bytes.iter().map(|&b| (b != 0) as i64).collect(),
        _ => read_float::<f64>(dtype, bytes).into_iter().map(|f| f as i64).collect(),
    }
}

/// Encodes i64 values as integer or bool bytes (i32 wraps, bool is `!= 0`).
pub fn write_int(dtype: DType, vals: &[i64]) -> Vec<u8> {
    match dtype {
        DType::I32 => vals.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
        DType::I64 => vals.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        DType::Bool => vals.iter().map(|&v| (v != 0) as u8).collect(),
        _ => write_float::<f64>(dtype, &vals.iter().map(|&v| v as f64).collect::<Vec<_>>()),
    }
}

/// Rounds a value the way storage in `dtype` would (identity for f32/f64 computation).
pub fn round_to<A: Real>(dtype: DType, x: A) -> A {
    match dtype {
        DType::BF16 => A::of(bf16::from_f32(x.f64() as f32).to_f32() as f64),
        DType::F16 => A::of(f16::from_f32(x.f64() as f32).to_f32() as f64),
        _ => x,
    }
}
