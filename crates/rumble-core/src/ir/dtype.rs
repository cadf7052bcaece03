//! Element types and static tensor types (`f32[2,16,64]`).
//!
//! Sizes are checked: [`Shape::checked_numel`] and [`TensorType::checked_size_in_bytes`] refuse
//! a shape whose element or byte count does not fit (a byte count must fit in `isize::MAX`, as
//! every Rust allocation must), with a [`SizeOverflow`] naming the type. The builder and the
//! verifier check every value with them, so inside a trace that built or verified the plain
//! [`Shape::numel`] and [`TensorType::size_in_bytes`] cannot wrap; [`total_bytes`] does the same
//! for sums of sizes (the planner's arena and persistent region).

use std::fmt;
use std::str::FromStr;

/// The element type of a value. There is no implicit promotion anywhere in rumble:
/// an op that mixes dtypes must say so with an explicit `cast`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
    I32,
    I64,
    Bool,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::Bool];

    /// Bytes one element takes in memory (bool is one byte).
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// The name used in the text form and in error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype `{s}` (expected one of f32, f64, bf16, f16, i32, i64, bool)"))
    }
}

/// A size computation that does not fit: the elements or bytes of `ty` (or a sum of sizes)
/// exceed `isize::MAX`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeOverflow {
    /// What overflowed: a type such as `f32[4294967296,4294967296]`, or a description.
    pub what: String,
}

impl fmt::Display for SizeOverflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: the size overflows (more than {} bytes)", self.what, isize::MAX)
    }
}

impl std::error::Error for SizeOverflow {}

/// The largest byte count of one tensor or one region (what one allocation may hold).
pub const MAX_BYTES: usize = isize::MAX as usize;

/// `a * b` for sizes, or `None` past [`MAX_BYTES`].
pub fn mul_size(a: usize, b: usize) -> Option<usize> {
    a.checked_mul(b).filter(|&x| x <= MAX_BYTES)
}

/// The sum of `sizes` (bytes), or the overflow naming `what`.
pub fn total_bytes(sizes: impl IntoIterator<Item = usize>, what: &str) -> Result<usize, SizeOverflow> {
    let mut total: usize = 0;
    for s in sizes {
        total = total.checked_add(s).filter(|&x| x <= MAX_BYTES).ok_or_else(|| SizeOverflow { what: what.into() })?;
    }
    Ok(total)
}

/// A static shape: a list of dimension sizes. `[]` is a scalar.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// The element count. Wraps for shapes that overflow: code that may meet an unchecked
    /// shape (one not from a built or verified trace) calls [`Shape::checked_numel`].
    pub fn numel(&self) -> usize {
        self.0.iter().fold(1usize, |n, &d| n.wrapping_mul(d))
    }
    /// The element count, or an overflow when it exceeds `isize::MAX`.
    pub fn checked_numel(&self) -> Result<usize, SizeOverflow> {
        self.0
            .iter()
            .try_fold(1usize, |n, &d| mul_size(n, d))
            .ok_or_else(|| SizeOverflow { what: format!("shape {self}") })
    }
    /// Row-major (C order) strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }
    /// The last dimension (1 for a scalar).
    pub fn last(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(d)
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape(d.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The static type of a value: dtype and shape, printed `f32[2,16,64]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType { dtype, shape: shape.into() }
    }
    pub fn scalar(dtype: DType) -> Self {
        TensorType { dtype, shape: Shape::scalar() }
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
    /// Bytes of the value. Wraps for types that overflow: see [`TensorType::checked_size_in_bytes`].
    pub fn size_in_bytes(&self) -> usize {
        self.numel().wrapping_mul(self.dtype.size_in_bytes())
    }
    /// Bytes of the value, or an overflow naming the type when it exceeds `isize::MAX`.
    pub fn checked_size_in_bytes(&self) -> Result<usize, SizeOverflow> {
        self.shape
            .checked_numel()
            .ok()
            .and_then(|n| mul_size(n, self.dtype.size_in_bytes()))
            .ok_or_else(|| SizeOverflow { what: self.to_string() })
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }
    pub fn with_shape(&self, shape: impl Into<Shape>) -> Self {
        TensorType { dtype: self.dtype, shape: shape.into() }
    }
    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType { dtype, shape: self.shape.clone() }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

impl FromStr for TensorType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let open = s.find('[').ok_or_else(|| format!("type `{s}` lacks a shape `[...]`"))?;
        if !s.ends_with(']') {
            return Err(format!("type `{s}` lacks a closing `]`"));
        }
        let dtype: DType = s[..open].parse()?;
        let inner = &s[open + 1..s.len() - 1];
        let dims = if inner.trim().is_empty() {
            Vec::new()
        } else {
            inner
                .split(',')
                .map(|d| d.trim().parse::<usize>().map_err(|_| format!("bad dimension `{d}` in type `{s}`")))
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(TensorType::new(dtype, dims))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_round_trips_through_text() {
        for t in [
            TensorType::new(DType::BF16, [2, 16, 64]),
            TensorType::scalar(DType::F32),
            TensorType::new(DType::Bool, [1]),
        ] {
            assert_eq!(t.to_string().parse::<TensorType>().unwrap(), t);
        }
        assert!("f33[2]".parse::<TensorType>().unwrap_err().contains("f33"));
    }

    #[test]
    fn sizes_refuse_overflow() {
        let f32s = |dims: Vec<usize>| TensorType::new(DType::F32, dims).checked_size_in_bytes();
        assert_eq!(f32s(vec![1 << 31, 1 << 29]), Ok(1 << 62));
        assert_eq!(f32s(vec![1 << 40, 0]), Ok(0));
        assert_eq!(f32s(vec![]), Ok(4));
        for dims in [vec![1usize << 31, 1 << 31], vec![1 << 32, 1 << 32], vec![1 << 62, 2], vec![usize::MAX]] {
            let t = TensorType::new(DType::F32, dims);
            let e = t.checked_size_in_bytes().unwrap_err();
            assert!(e.to_string().contains(&t.to_string()), "{e}");
        }
        // 2^62 two-byte elements: 2^63 bytes, one past isize::MAX.
        assert!(TensorType::new(DType::BF16, [1 << 31, 1 << 31]).checked_size_in_bytes().is_err());
        assert_eq!(Shape::new([1usize << 62, 1]).checked_numel(), Ok(1 << 62));
        assert!(Shape::new([1usize << 62, 4]).checked_numel().is_err());
        assert!(total_bytes([MAX_BYTES, 1], "arena").unwrap_err().to_string().contains("arena"));
        assert_eq!(total_bytes([3, 4], "x"), Ok(7));
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(Shape::new([2, 3, 4]).strides(), vec![12, 4, 1]);
        assert_eq!(Shape::scalar().strides(), Vec::<usize>::new());
    }
}
