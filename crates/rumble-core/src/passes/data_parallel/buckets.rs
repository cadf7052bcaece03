//! The bucket plan of data-parallel training: which gradients are reduced together.
//!
//! Gradients come in the order the backward produces them (the last layer's first, as
//! PyTorch's DDP orders its buckets), so a bucket's collective can start as soon as its last
//! gradient exists, while the backward of earlier layers still runs. Each dtype has its own
//! open bucket (a collective moves one dtype); a gradient joins its dtype's open bucket unless
//! that would pass `bucket_bytes`, which closes the bucket first. A gradient larger than the
//! limit is a bucket of its own. Buckets are listed in the order they become ready (their last
//! gradient produced), the order their collectives run in.
//!
//! A bucket is one flat buffer: its gradients flattened and laid end to end, then padded with
//! zeros to a multiple of `world`, so a reduce-scatter cuts it into `world` equal shards.

use crate::ir::DType;
use crate::{Error, Result};

/// One gradient as the planner sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradSpec {
    pub name: String,
    pub dtype: DType,
    pub numel: usize,
}

/// A gradient's place in its bucket: `grad` indexes the planner's input list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub grad: usize,
    pub offset: usize,
    pub numel: usize,
}

/// One flat buffer of gradients of one dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub dtype: DType,
    /// In production order, at increasing offsets, end to end from 0.
    pub members: Vec<Member>,
    /// Elements of the gradients (`numel <= padded`).
    pub numel: usize,
    /// `numel` rounded up to a multiple of `world`.
    pub padded: usize,
}

impl Bucket {
    /// Bytes of the gradients (without padding).
    pub fn bytes(&self) -> usize {
        self.numel * self.dtype.size_in_bytes()
    }
    /// Elements of one rank's shard (`padded / world`).
    pub fn shard(&self, world: usize) -> usize {
        self.padded / world
    }
    /// The flat range rank `rank` holds after a reduce-scatter.
    pub fn shard_range(&self, world: usize, rank: usize) -> std::ops::Range<usize> {
        let s = self.shard(world);
        rank * s..(rank + 1) * s
    }
    /// The index of the gradient produced last: the bucket is ready after it.
    pub fn last_grad(&self) -> usize {
        self.members.iter().map(|m| m.grad).max().unwrap_or(0)
    }
    fn push(&mut self, grad: usize, numel: usize) {
        self.members.push(Member { grad, offset: self.numel, numel });
        self.numel += numel;
    }
}

/// Plans the buckets of `grads` (given in the order the backward produces them) for `world`
/// ranks and buckets of at most `bucket_bytes` (see the module docs).
pub fn plan_buckets(grads: &[GradSpec], world: usize, bucket_bytes: usize) -> Result<Vec<Bucket>> {
    if world == 0 || bucket_bytes == 0 {
        return Err(Error::msg(format!(
            "data_parallel: world ({world}) and bucket_bytes ({bucket_bytes}) must be at least 1"
        )));
    }
    let mut open: Vec<Bucket> = Vec::new();
    let mut closed: Vec<Bucket> = Vec::new();
    let empty = |dtype| Bucket { dtype, members: Vec::new(), numel: 0, padded: 0 };
    for (i, gr) in grads.iter().enumerate() {
        let bytes = gr.numel.checked_mul(gr.dtype.size_in_bytes()).ok_or_else(|| {
            Error::msg(format!("data_parallel: gradient `{}` ({} elements) overflows a size", gr.name, gr.numel))
        })?;
        if bytes > bucket_bytes {
            let mut b = empty(gr.dtype);
            b.push(i, gr.numel);
            closed.push(b);
            continue;
        }
        let slot = match open.iter().position(|b| b.dtype == gr.dtype) {
            Some(k) if open[k].bytes() + bytes > bucket_bytes => {
                closed.push(std::mem::replace(&mut open[k], empty(gr.dtype)));
                k
            }
            Some(k) => k,
            None => {
                open.push(empty(gr.dtype));
                open.len() - 1
            }
        };
        open[slot].push(i, gr.numel);
        if open[slot].bytes() == bucket_bytes {
            closed.push(std::mem::replace(&mut open[slot], empty(gr.dtype)));
        }
    }
    closed.extend(open.into_iter().filter(|b| !b.members.is_empty()));
    closed.sort_by_key(Bucket::last_grad);
    for b in &mut closed {
        b.padded = b.numel.div_ceil(world).checked_mul(world).ok_or_else(|| {
            Error::msg(format!("data_parallel: a bucket of {} elements overflows when padded", b.numel))
        })?;
    }
    Ok(closed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: DType, numel: usize) -> GradSpec {
        GradSpec { name: name.into(), dtype, numel }
    }
    fn grads_of(b: &Bucket) -> Vec<usize> {
        b.members.iter().map(|m| m.grad).collect()
    }

    #[test]
    fn buckets_follow_production_order_and_respect_the_limit() {
        // f32: 10, 6, 5, 20 elements; limit 64 bytes = 16 elements.
        let g =
            [spec("d", DType::F32, 10), spec("c", DType::F32, 6), spec("b", DType::F32, 5), spec("a", DType::F32, 20)];
        let b = plan_buckets(&g, 4, 64).unwrap();
        // 10 + 6 fills 16 exactly (closes); 5 opens the next, which stays open to the end but
        // is ready (its last gradient exists) before 20 (80 bytes), a bucket of its own.
        assert_eq!(b.iter().map(grads_of).collect::<Vec<_>>(), vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(b[0].members[1], Member { grad: 1, offset: 10, numel: 6 });
        assert!(b.iter().filter(|b| b.members.len() > 1).all(|b| b.bytes() <= 64));
        assert_eq!((b[2].numel, b[2].padded), (20, 20));
        assert_eq!((b[1].numel, b[1].padded, b[1].shard(4)), (5, 8, 2));
        assert_eq!(b[1].shard_range(4, 3), 6..8);
    }

    #[test]
    fn padding_makes_equal_shards() {
        for world in 1..=5 {
            for n in [1, 7, 12, 13] {
                let b = plan_buckets(&[spec("w", DType::BF16, n)], world, 1 << 20).unwrap();
                assert_eq!(b.len(), 1);
                assert_eq!(b[0].padded % world, 0);
                assert!(b[0].padded >= n && b[0].padded - n < world, "n {n} world {world}: {}", b[0].padded);
            }
        }
    }

    #[test]
    fn dtypes_never_share_a_bucket() {
        let g = [
            spec("a", DType::F32, 4),
            spec("b", DType::BF16, 4),
            spec("c", DType::F32, 4),
            spec("d", DType::BF16, 4),
            spec("e", DType::F32, 4),
        ];
        let b = plan_buckets(&g, 2, 32).unwrap();
        // f32 holds 8 elements a bucket, bf16 16: f32 [a, c] closes full at c, then [e];
        // bf16 [b, d] stays open to the end.
        assert_eq!(b.iter().map(grads_of).collect::<Vec<_>>(), vec![vec![0, 2], vec![1, 3], vec![4]]);
        assert_eq!(b.iter().map(|b| b.dtype).collect::<Vec<_>>(), vec![DType::F32, DType::BF16, DType::F32]);
        for bk in &b {
            assert!(bk.members.iter().all(|m| g[m.grad].dtype == bk.dtype));
        }
    }

    proptest::proptest! {
        #[test]
        fn every_plan_keeps_the_rules(
            grads in proptest::collection::vec((0usize..3, 1usize..300), 1..40),
            world in 1usize..9,
            limit in 1usize..2000,
        ) {
            let dtypes = [DType::F32, DType::BF16, DType::F64];
            let g: Vec<GradSpec> =
                grads.iter().enumerate().map(|(i, &(d, n))| spec(&format!("g{i}"), dtypes[d], n)).collect();
            let b = plan_buckets(&g, world, limit).unwrap();
            let mut seen = vec![0; g.len()];
            for (k, bk) in b.iter().enumerate() {
                let mut offset = 0;
                for (j, m) in bk.members.iter().enumerate() {
                    seen[m.grad] += 1;
                    assert_eq!((m.offset, m.numel, g[m.grad].dtype), (offset, g[m.grad].numel, bk.dtype));
                    assert!(j == 0 || m.grad > bk.members[j - 1].grad, "production order within a bucket");
                    offset += m.numel;
                }
                assert_eq!(offset, bk.numel);
                assert!(bk.bytes() <= limit || bk.members.len() == 1, "only a lone gradient passes the limit");
                assert!(bk.padded % world == 0 && bk.padded >= bk.numel && bk.padded - bk.numel < world);
                assert!(k == 0 || b[k - 1].last_grad() < bk.last_grad(), "buckets in the order they are ready");
            }
            assert!(seen.iter().all(|&s| s == 1), "every gradient in exactly one bucket");
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        let g = [spec("a", DType::F32, 4)];
        assert!(plan_buckets(&g, 0, 64).unwrap_err().to_string().contains("world (0)"));
        assert!(plan_buckets(&g, 2, 0).unwrap_err().to_string().contains("bucket_bytes (0)"));
        let huge = [spec("h", DType::F64, usize::MAX / 4)];
        assert!(plan_buckets(&huge, 2, 64).unwrap_err().to_string().contains("`h`"));
    }
}
