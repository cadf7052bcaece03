//! Batched matmul through the `gemm` crate, with the transposes as strides (no copies).
//! `gemm` splits work over output tiles only, so results do not depend on the thread count.

use super::convert::Real;
use super::layout::matrix_dims;
use crate::ir::TensorType;

pub fn matmul<A: Real>(at: &TensorType, a: &[A], bt: &TensorType, b: &[A], ta: bool, tb: bool) -> Vec<A> {
    let (batch, ar, ac) = matrix_dims(&at.shape);
    let (_, br, bc) = matrix_dims(&bt.shape);
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let n = if tb { br } else { bc };
    // Element (i, p) of op(A) sits at i*rs + p*cs.
    let (a_rs, a_cs) = if ta { (1, ac as isize) } else { (ac as isize, 1) };
    let (b_rs, b_cs) = if tb { (1, bc as isize) } else { (bc as isize, 1) };
    let mut c = vec![A::zero(); batch * m * n];
    let par = if m * n * k >= 1 << 18 { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    for i in 0..batch {
        let (ao, bo, co) = (i * ar * ac, i * br * bc, i * m * n);
        // SAFETY: the pointers cover `m*k`, `k*n` and `m*n` elements with the strides given,
        // inside slices whose lengths the type rule fixed; `dst` does not alias the inputs.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c[co..].as_mut_ptr(),
                1,
                n as isize,
                false,
                a[ao..].as_ptr(),
                a_cs,
                a_rs,
                b[bo..].as_ptr(),
                b_cs,
                b_rs,
                A::zero(),
                A::one(),
                false,
                false,
                false,
                par,
            );
        }
    }
    c
}
