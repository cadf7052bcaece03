//! Training data. Here: the byte-level corpus of the tiny preset, read as bytes (token id = byte
//! value, vocab 256) and cut into random windows of `T + 1` bytes: the first `T` are the tokens,
//! the last `T` the next-token targets. [`packed`]: text and JSONL documents through a
//! tokenizer, packed into windows, with validation splits and a resumable position.

pub mod packed;

use std::path::Path;

use crate::error::{ModelError, Result};
use crate::model;
use rumble_core::cpu::Rng;

/// One micro-batch: token ids `(B, T)` and targets `(B*T)`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub tokens: Vec<i64>,
    pub targets: Vec<i64>,
}

impl Batch {
    /// Random token ids below `vocab` with Hugging Face's `labels = input_ids` targets: the
    /// benchmark workloads' input.
    pub fn random(rng: &mut Rng, vocab: usize, batch: usize, seq: usize) -> Batch {
        let tokens: Vec<i64> = (0..batch * seq).map(|_| rng.below(vocab) as i64).collect();
        let targets = model::hf_causal_targets(&tokens, batch, seq);
        Batch { batch, seq, tokens, targets }
    }

    /// Rank `rank`'s rows of this batch split evenly over `world` ranks: a data-parallel rank's
    /// share of the global batch one process would take (rows `rank * batch / world ..`).
    pub fn rank_rows(&self, rank: usize, world: usize) -> Result<Batch> {
        if rank >= world || !self.batch.is_multiple_of(world) {
            return Err(ModelError::Usage(format!(
                "rows of rank {rank} of a run of {world} ranks from a batch of {} rows",
                self.batch
            )));
        }
        let per = self.batch / world;
        let cut = |v: &[i64]| v[rank * per * self.seq..(rank + 1) * per * self.seq].to_vec();
        Ok(Batch { batch: per, seq: self.seq, tokens: cut(&self.tokens), targets: cut(&self.targets) })
    }

    /// Targets the loss counts (those not [`model::IGNORE_INDEX`]).
    pub fn counted_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != model::IGNORE_INDEX).count()
    }
}

/// A corpus of bytes to sample windows from.
pub struct Corpus {
    bytes: Vec<u8>,
}

impl Corpus {
    pub fn new(bytes: Vec<u8>) -> Corpus {
        Corpus { bytes }
    }

    /// Reads a data file whole: a regular file (devices and FIFOs are refused), no larger
    /// than the host memory free.
    pub fn from_file(path: &Path) -> Result<Corpus> {
        Ok(Corpus::new(crate::guard::read_in_memory(path, "data", 1)?))
    }

    /// Refuses, before a run starts, windows of `seq` tokens this corpus is too short for
    /// (`source` names the data in the error).
    pub fn check_window(&self, seq: usize, source: &str) -> Result<()> {
        if self.bytes.len() <= seq {
            return Err(ModelError::Usage(format!(
                "{source}: the data has {} bytes; windows of {seq} tokens need at least {}",
                self.bytes.len(),
                seq.saturating_add(1)
            )));
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// `batch` windows at random offsets.
    pub fn sample(&self, rng: &mut Rng, batch: usize, seq: usize) -> Result<Batch> {
        if self.bytes.len() <= seq {
            return Err(ModelError::Usage(format!(
                "the corpus has {} bytes; a window of seq {seq} needs at least {}",
                self.bytes.len(),
                seq.saturating_add(1)
            )));
        }
        let mut tokens = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        for _ in 0..batch {
            let at = rng.below(self.bytes.len() - seq);
            let w = &self.bytes[at..at + seq + 1];
            tokens.extend(w[..seq].iter().map(|&b| b as i64));
            targets.extend(w[1..].iter().map(|&b| b as i64));
        }
        Ok(Batch { batch, seq, tokens, targets })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_their_rows_and_targets_are_counted() {
        let b = Batch { batch: 4, seq: 2, tokens: (0..8).collect(), targets: vec![1, -100, 3, 4, -100, -100, 7, 8] };
        let r = b.rank_rows(1, 2).unwrap();
        assert_eq!((r.batch, r.tokens, r.targets), (2, vec![4, 5, 6, 7], vec![-100, -100, 7, 8]));
        assert_eq!(b.rank_rows(0, 1).unwrap(), b);
        assert_eq!(b.rank_rows(3, 4).unwrap().tokens, vec![6, 7]);
        assert_eq!((b.counted_targets(), b.rank_rows(0, 2).unwrap().counted_targets()), (5, 3));
        assert!(b.rank_rows(0, 3).unwrap_err().to_string().contains("a batch of 4 rows"));
    }

    #[test]
    fn windows_are_shifted_by_one() {
        let c = Corpus::new(b"abcdefghij".to_vec());
        let b = c.sample(&mut Rng::new(3), 4, 5).unwrap();
        for r in 0..4 {
            assert_eq!(b.tokens[r * 5 + 1..r * 5 + 5], b.targets[r * 5..r * 5 + 4]);
            assert_eq!(b.targets[r * 5] - b.tokens[r * 5], 1);
        }
        assert!(c.sample(&mut Rng::new(3), 1, 10).unwrap_err().to_string().contains("10 bytes"));
    }

    #[test]
    fn hf_targets_shift_left_and_ignore_the_last() {
        assert_eq!(model::hf_causal_targets(&[5, 6, 7, 8, 9, 10], 2, 3), vec![6, 7, -100, 9, 10, -100]);
    }
}
