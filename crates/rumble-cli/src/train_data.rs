//! Where `rumble train`'s batches come from ([`DataSource`]): random windows of a byte corpus
//! (the tiny preset's text), or packed documents through a tokenizer; in a data-parallel run
//! each rank takes its rows of every global batch.

use rumble_core::cpu::Rng;
use rumble_models::data::Batch;
use rumble_models::{Corpus, Dataset, Document, Loader, LoaderState, ModelError, Result, Tokenizer, Validation};
use serde_json::{Value, json};

use crate::train::TrainArgs;

/// The corpus shipped in the repository (data/corpus.txt), built into the binary.
const CORPUS: &[u8] = include_bytes!("../../../data/corpus.txt");

/// The share of the byte corpus held out for validation when `--eval-every` is given.
const VAL_FRACTION: f64 = 0.1;

/// The corpus split into training and validation parts: the last `VAL_FRACTION` held out
/// when `eval` is asked for.
fn split_corpus(bytes: Vec<u8>, eval: bool) -> (Corpus, Option<Corpus>) {
    if !eval {
        return (Corpus::new(bytes), None);
    }
    let cut = bytes.len() - (bytes.len() as f64 * VAL_FRACTION) as usize;
    let val = bytes[cut..].to_vec();
    let mut train = bytes;
    train.truncate(cut);
    (Corpus::new(train), Some(Corpus::new(val)))
}

/// Where batches come from: random windows of a byte corpus (the tiny preset's text), or
/// packed documents through a tokenizer.
pub enum DataSource {
    /// `val`: the corpus's held-out tail under `--eval-every`.
    Corpus {
        corpus: Corpus,
        name: String,
        rng: Rng,
        val: Option<Corpus>,
    },
    Packed {
        train: Loader,
        val: Option<Loader>,
    },
}

impl DataSource {
    pub fn new(a: &TrainArgs, tok: &Tokenizer, vocab: usize, seq: usize, model: &str) -> Result<DataSource> {
        let validation = match (&a.val_data, a.val_fraction) {
            (Some(p), _) => Validation::File(p.clone()),
            (None, Some(f)) => Validation::Fraction(f),
            (None, None) => Validation::None,
        };
        let jsonl = a.data.as_ref().is_some_and(|p| p.extension().is_some_and(|e| e == "jsonl"));
        if tok.is_bytes() && !jsonl && validation == Validation::None {
            if vocab < 256 {
                return Err(ModelError::Usage(format!(
                    "byte-level training needs a vocabulary of at least 256, `{model}` has {vocab}"
                )));
            }
            let bytes = match &a.data {
                Some(p) => rumble_models::guard::read_in_memory(p, "data", 1)?,
                None => CORPUS.to_vec(),
            };
            let (corpus, val) = split_corpus(bytes, a.eval_every.is_some());
            let name = a.data.as_ref().map_or("the shipped corpus".to_string(), |p| p.display().to_string());
            return Ok(DataSource::Corpus { corpus, name, rng: Rng::for_name(a.seed, "batches"), val });
        }
        let (docs, what) = match &a.data {
            Some(path) => (rumble_models::data::packed::read_documents(path)?, path.display().to_string()),
            // The shipped corpus as one document, through the model's tokenizer.
            None => (vec![Document::Text(String::from_utf8_lossy(CORPUS).into_owned())], "the shipped corpus".into()),
        };
        let Dataset { train, val } = Dataset::new(docs, &what, &validation, tok, seq, vocab, a.seed)?;
        Ok(DataSource::Packed { train, val })
    }

    /// The data position (`--resume` restores it): the corpus sampler's state, or the packed
    /// loader's.
    pub fn state(&self) -> Value {
        match self {
            DataSource::Corpus { rng, .. } => rng.state(),
            DataSource::Packed { train, .. } => serde_json::to_value(train.state()).unwrap_or(Value::Null),
        }
    }

    /// Restores a position [`DataSource::state`] gave (from the checkpoint in `dir`).
    pub fn restore(&mut self, v: &Value, dir: &std::path::Path) -> Result<()> {
        let bad = || ModelError::Usage(format!("{}: no data position in trainer_state.json", dir.display()));
        match self {
            DataSource::Corpus { rng, .. } => *rng = Rng::from_state(v).ok_or_else(bad)?,
            DataSource::Packed { train, .. } => {
                let st: LoaderState = serde_json::from_value(v.clone()).map_err(|_| bad())?;
                train.restore(st)?;
            }
        }
        Ok(())
    }

    /// The sequence length of validation windows (`None`: no validation data): the step's,
    /// shorter when the held-out text is.
    pub fn val_seq(&self, seq: usize) -> Option<usize> {
        match self {
            DataSource::Corpus { val, .. } => val.as_ref().map(|v| seq.min(v.len().saturating_sub(1)).max(1)),
            DataSource::Packed { val, .. } => val.as_ref().map(|_| seq),
        }
    }

    /// `n` validation micro-batches of `batch` rows of `seq` tokens, the same every time (so
    /// validation losses compare across steps); rank `rank` of `world` gets its rows of the
    /// `n` batches of `world * batch` rows one process would evaluate.
    pub fn val_batches(
        &self,
        seed: u64,
        (batch, seq, n): (usize, usize, usize),
        rank: usize,
        world: usize,
    ) -> Result<Option<Vec<Batch>>> {
        let global = match self {
            DataSource::Corpus { val: Some(v), .. } => {
                let mut vr = Rng::for_name(seed, "validation");
                (0..n).map(|_| v.sample(&mut vr, batch * world, seq)).collect::<Result<Vec<_>>>()?
            }
            DataSource::Packed { val: Some(v), .. } => v.all_batches(batch * world).into_iter().take(n).collect(),
            _ => return Ok(None),
        };
        global.iter().map(|b| b.rank_rows(rank, world)).collect::<Result<Vec<_>>>().map(Some)
    }

    /// Refuses windows of `seq` tokens longer than a byte corpus (packed documents are checked
    /// when they are loaded).
    pub fn check_window(&self, seq: usize) -> Result<()> {
        match self {
            DataSource::Corpus { corpus, name, .. } => corpus.check_window(seq, name),
            DataSource::Packed { .. } => Ok(()),
        }
    }

    /// One micro-batch of `batch` rows of `seq` tokens (packed windows are cut to `seq`, for
    /// shape buckets): rank `rank`'s rows of the next global batch of `world * batch` rows, as
    /// one process would draw it (so a run's data is the same on any number of ranks), and the
    /// rank's loss weight (`StepConfig::loss_weights`): its counted targets times `world` over
    /// the global batch's (1 for one rank).
    pub fn next(&mut self, batch: usize, seq: usize, rank: usize, world: usize) -> Result<(Batch, f64)> {
        let global = match self {
            DataSource::Corpus { corpus, rng, .. } => corpus.sample(rng, batch * world, seq)?,
            DataSource::Packed { train, .. } => {
                let b = train.next_batch(batch * world);
                if b.seq == seq {
                    b
                } else {
                    let cut = |v: &[i64]| v.chunks(b.seq).flat_map(|row| row[..seq].to_vec()).collect();
                    Batch { batch: b.batch, seq, tokens: cut(&b.tokens), targets: cut(&b.targets) }
                }
            }
        };
        if world == 1 {
            return Ok((global, 1.0));
        }
        let mine = global.rank_rows(rank, world)?;
        let all = global.counted_targets();
        let weight = if all == 0 { 1.0 } else { (mine.counted_targets() * world) as f64 / all as f64 };
        Ok((mine, weight))
    }

    /// Adds what the data is to the start line.
    pub fn describe(&self, start: &mut serde_json::Value, tok: &Tokenizer) {
        match self {
            DataSource::Corpus { corpus, val, .. } => {
                start["corpus_bytes"] = json!(corpus.len());
                start["val_bytes"] = json!(val.as_ref().map(Corpus::len));
            }
            DataSource::Packed { train, val } => {
                start["tokenizer"] = json!(tok.file().map(|f| f.display().to_string()).unwrap_or("bytes".into()));
                start["data_tokens"] = json!(train.tokens());
                start["data_windows"] = json!(train.windows());
                if let Some(v) = val {
                    start["val_tokens"] = json!(v.tokens());
                    start["val_windows"] = json!(v.windows());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_validation_split_is_the_tail() {
        let (train, val) = split_corpus((0..100u8).collect(), true);
        assert_eq!((train.len(), val.map(|v| v.len())), (90, Some(10)));
        let (train, val) = split_corpus(vec![1; 50], false);
        assert_eq!((train.len(), val.is_none()), (50, true));
    }
}
