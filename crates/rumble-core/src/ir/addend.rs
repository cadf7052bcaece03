//! What a matmul adds to its products: [`Addend`], the `acc` attribute of `matmul` and
//! `matmul_pre`, with its type rule and its text form.

use super::dtype::TensorType;

/// What a matmul (`Op::Matmul`, `Op::MatmulPre`) adds to its products, the sum taken with the
/// products' accumulation and rounded once to the result's dtype. Set by the folds
/// (`passes::fold_addends`, `passes::fold_row_addends`), never by model code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Addend {
    /// Nothing: `op(a) op(b)`. Written as no attribute.
    #[default]
    None,
    /// An operand `c` of the result's type: `op(a) op(b) + c` (cuBLAS's `beta = 1`); the
    /// result may be computed over `c`. Written `acc=true`.
    Full,
    /// An operand `c [N]` (or `[1, .., 1, N]`) of the result's dtype added to every row of the
    /// `[.., M, N]` result: `op(a) op(b) + broadcast(c)` without the broadcast (a linear
    /// layer's bias; cuBLASLt's `BIAS` epilogue, the gemv kernels' addend read with row stride
    /// 0). The result is never computed over `c` (it is smaller). Written `acc=row`.
    Row,
}

impl Addend {
    /// Whether there is an addend (one more operand).
    pub fn is_some(self) -> bool {
        self != Addend::None
    }

    /// The operands it adds to the op's: 1 with an addend, else 0.
    pub fn operands(self) -> usize {
        self.is_some() as usize
    }

    /// The value of the `acc` attribute in the text form (`None`: no attribute).
    pub fn text(self) -> Option<&'static str> {
        match self {
            Addend::None => None,
            Addend::Full => Some("true"),
            Addend::Row => Some("row"),
        }
    }

    /// The addend an `acc` attribute's value names (`false`, `true`, `row`).
    pub fn parse(s: &str) -> Result<Addend, String> {
        match s {
            "false" => Ok(Addend::None),
            "true" => Ok(Addend::Full),
            "row" => Ok(Addend::Row),
            v => Err(format!("bad value `{v}` for attribute `acc` (true, row or false)")),
        }
    }

    /// Whether `c` may be this addend of a result of type `res`: its type (`Full`), or a row of
    /// its last dim and dtype (`Row`: every other dim 1, rank at most the result's).
    pub fn check(self, c: &TensorType, res: &TensorType) -> Result<(), String> {
        match self {
            Addend::None => Ok(()),
            Addend::Full if c == res => Ok(()),
            Addend::Full => Err(format!("the addend {c} must be the result's type {res}")),
            Addend::Row => {
                let n = res.shape.last();
                let row = c.dtype == res.dtype
                    && c.rank() >= 1
                    && c.rank() <= res.rank()
                    && c.shape.last() == n
                    && c.dims()[..c.rank() - 1].iter().all(|&d| d == 1);
                if row { Ok(()) } else { Err(format!("the row addend {c} must be {}[{n}] (or [1, {n}])", res.dtype)) }
            }
        }
    }
}
