//! Documents to batches, as fine-tuning recipes do (litgpt, torchtune, TRL's packing): text and
//! JSONL files become documents, each document is tokenized (with the tokenizer's BOS where it
//! adds one) and ended with EOS, the documents are joined into one stream, and the stream is cut
//! into windows of `T + 1` tokens (the first `T` are the inputs, the last `T` the next-token
//! targets). Windows are visited in a seeded random order, a new order each epoch; the
//! position ([`LoaderState`]) is plain data, so a resumed run continues where it stopped.
//!
//! JSONL records hold a `text` string, or a `prompt` and a `response`: then the loss is on the
//! response only (targets of prompt tokens are [`IGNORE_INDEX`], as instruction tuning does).
//! Any other file is one text document. `--val-fraction` holds out the last documents (or, for
//! a single document, the last part of its tokens); `--val-data` reads another file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::data::Batch;
use crate::error::{ModelError, Result};
use crate::model::IGNORE_INDEX;
use crate::tokenizer::Tokenizer;
use rumble_core::cpu::Rng;

/// One document: its text, or a prompt and the response the loss is on.
#[derive(Clone, Debug, PartialEq)]
pub enum Document {
    Text(String),
    Pair { prompt: String, response: String },
}

/// The documents of `path`: JSONL records if its name ends in `.jsonl`, else the whole file
/// as one text document.
pub fn read_documents(path: &Path) -> Result<Vec<Document>> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    if path.extension().is_some_and(|e| e == "jsonl") {
        parse_jsonl(&text, path)
    } else {
        Ok(vec![Document::Text(text)])
    }
}

/// JSONL text: one object a non-empty line, with `text` or `prompt` + `response` strings.
pub fn parse_jsonl(text: &str, path: &Path) -> Result<Vec<Document>> {
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |msg: String| ModelError::Data { file: path.into(), msg: format!("line {}: {msg}", i + 1) };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let field = |key: &str| -> Result<Option<String>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(bad(format!("`{key}` must be a string, got {other}"))),
            }
        };
        if !v.is_object() {
            return Err(bad(format!("expected a JSON object, got {v}")));
        }
        docs.push(match (field("text")?, field("prompt")?, field("response")?) {
            (Some(t), None, None) => Document::Text(t),
            (None, Some(prompt), Some(response)) => Document::Pair { prompt, response },
            _ => return Err(bad("expected a `text` field, or `prompt` and `response` fields".into())),
        });
    }
    if docs.is_empty() {
        return Err(ModelError::Data { file: path.into(), msg: "no records".into() });
    }
    Ok(docs)
}

/// Token ids and, for each, whether it is a target of the loss.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenStream {
    pub ids: Vec<u32>,
    pub is_target: Vec<bool>,
}

impl TokenStream {
    /// Appends one document: its ids with the tokenizer's specials (BOS where it adds one),
    /// then EOS unless the tokenizer already ended it with one.
    pub fn push(&mut self, tok: &Tokenizer, doc: &Document) -> Result<()> {
        let (prompt, body) = match doc {
            Document::Text(t) => (vec![], tok.encode(t, true)?),
            Document::Pair { prompt, response } => (tok.encode(prompt, true)?, tok.encode(response, false)?),
        };
        self.ids.extend(&prompt);
        self.is_target.extend(std::iter::repeat_n(false, prompt.len()));
        let end = body.last().copied();
        self.ids.extend(&body);
        self.is_target.extend(std::iter::repeat_n(true, body.len()));
        if let Some(eos) = tok.eos()
            && end != Some(eos)
        {
            self.ids.push(eos);
            self.is_target.push(true);
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The part from `at` on.
    fn split_off(&mut self, at: usize) -> TokenStream {
        TokenStream { ids: self.ids.split_off(at), is_target: self.is_target.split_off(at) }
    }

    /// Windows of `seq + 1` tokens that fit, each starting `seq` after the previous.
    pub fn windows(&self, seq: usize) -> usize {
        self.len().saturating_sub(1).checked_div(seq).unwrap_or(0)
    }

    /// Window `w` as `seq` tokens and `seq` targets (ignored where the token is not a target).
    fn window(&self, w: usize, seq: usize, tokens: &mut Vec<i64>, targets: &mut Vec<i64>) {
        let at = w * seq;
        tokens.extend(self.ids[at..at + seq].iter().map(|&i| i as i64));
        targets
            .extend((at + 1..at + seq + 1).map(|i| if self.is_target[i] { self.ids[i] as i64 } else { IGNORE_INDEX }));
    }
}

/// Where a [`Loader`] is: the epoch, the windows of this epoch already served, and the seed of
/// the window order. Serializable, for resuming.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub seed: u64,
    pub epoch: u64,
    pub cursor: u64,
}

/// Training batches from a token stream, windows in a seeded order reshuffled every epoch.
pub struct Loader {
    stream: TokenStream,
    seq: usize,
    order: Vec<usize>,
    state: LoaderState,
}

impl Loader {
    /// Windows of `seq + 1` tokens of `stream`; `what` (a file name) names the data in errors.
    pub fn new(stream: TokenStream, seq: usize, seed: u64, what: &str) -> Result<Loader> {
        if stream.windows(seq) == 0 {
            return Err(ModelError::Usage(format!(
                "{what}: {} tokens do not fill one window of seq {seq} (+1 for the last target)",
                stream.len()
            )));
        }
        let mut l = Loader { stream, seq, order: vec![], state: LoaderState { seed, epoch: 0, cursor: 0 } };
        l.shuffle();
        Ok(l)
    }

    fn shuffle(&mut self) {
        let n = self.stream.windows(self.seq);
        self.order = (0..n).collect();
        let mut rng = Rng::for_name(self.state.seed ^ self.state.epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15), "windows");
        for i in (1..n).rev() {
            self.order.swap(i, rng.below(i + 1));
        }
    }

    /// Windows per epoch.
    pub fn windows(&self) -> usize {
        self.order.len()
    }

    /// Tokens in the stream.
    pub fn tokens(&self) -> usize {
        self.stream.len()
    }

    /// The next `batch` windows (crossing into the next epoch, reshuffled, where needed).
    pub fn next_batch(&mut self, batch: usize) -> Batch {
        let mut tokens = Vec::with_capacity(batch * self.seq);
        let mut targets = Vec::with_capacity(batch * self.seq);
        for _ in 0..batch {
            if self.state.cursor as usize >= self.order.len() {
                self.state.epoch += 1;
                self.state.cursor = 0;
                self.shuffle();
            }
            let w = self.order[self.state.cursor as usize];
            self.stream.window(w, self.seq, &mut tokens, &mut targets);
            self.state.cursor += 1;
        }
        Batch { batch, seq: self.seq, tokens, targets }
    }

    /// The position, to save.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Continues from a saved position (of a loader over the same data and seq).
    pub fn restore(&mut self, state: LoaderState) -> Result<()> {
        if state.cursor as usize > self.order.len() {
            return Err(ModelError::Usage(format!(
                "data position {} is past the {} windows of an epoch: not this data or seq",
                state.cursor,
                self.order.len()
            )));
        }
        self.state = state;
        self.shuffle();
        Ok(())
    }

    /// Every window in order, as batches of `batch` (the last one padded with rows whose
    /// targets are all ignored): a validation pass.
    pub fn all_batches(&self, batch: usize) -> Vec<Batch> {
        let n = self.stream.windows(self.seq);
        let mut out = Vec::new();
        for first in (0..n).step_by(batch.max(1)) {
            let mut tokens = Vec::with_capacity(batch * self.seq);
            let mut targets = Vec::with_capacity(batch * self.seq);
            for w in first..first + batch {
                if w < n {
                    self.stream.window(w, self.seq, &mut tokens, &mut targets);
                } else {
                    tokens.extend(std::iter::repeat_n(0, self.seq));
                    targets.extend(std::iter::repeat_n(IGNORE_INDEX, self.seq));
                }
            }
            out.push(Batch { batch, seq: self.seq, tokens, targets });
        }
        out
    }
}

/// Where validation data comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum Validation {
    None,
    /// Another file.
    File(PathBuf),
    /// The last fraction (0 < F < 1) of the training documents.
    Fraction(f64),
}

/// Training and validation loaders for `data` (documents) through `tok`.
pub struct Dataset {
    pub train: Loader,
    pub val: Option<Loader>,
}

impl Dataset {
    /// Tokenizes, splits and packs `docs` (named `what` in errors; from a file:
    /// [`read_documents`]). Every id must be below `vocab` (the model's).
    pub fn new(
        docs: Vec<Document>,
        what: &str,
        val: &Validation,
        tok: &Tokenizer,
        seq: usize,
        vocab: usize,
        seed: u64,
    ) -> Result<Dataset> {
        let (train, val_stream) = match val {
            Validation::None => (stream(tok, &docs, vocab, what)?, None),
            Validation::File(p) => {
                let v = stream(tok, &read_documents(p)?, vocab, &p.display().to_string())?;
                (stream(tok, &docs, vocab, what)?, Some((v, p.display().to_string())))
            }
            Validation::Fraction(f) => {
                if !(*f > 0.0 && *f < 1.0) {
                    return Err(ModelError::Usage(format!("--val-fraction {f}: must be between 0 and 1")));
                }
                let label = format!("{what} (validation fraction {f})");
                if docs.len() > 1 {
                    let n_val = ((docs.len() as f64 * f).round() as usize).clamp(1, docs.len() - 1);
                    let (t, v) = docs.split_at(docs.len() - n_val);
                    (stream(tok, t, vocab, what)?, Some((stream(tok, v, vocab, what)?, label)))
                } else {
                    let mut t = stream(tok, &docs, vocab, what)?;
                    let cut = t.len() - ((t.len() as f64 * f).round() as usize).min(t.len());
                    let v = t.split_off(cut);
                    (t, Some((v, label)))
                }
            }
        };
        let train = Loader::new(train, seq, seed, what)?;
        let val = match val_stream {
            Some((v, label)) => Some(Loader::new(v, seq, seed, &label)?),
            None => None,
        };
        Ok(Dataset { train, val })
    }
}

/// The documents as one stream; ids checked against the model's vocabulary.
fn stream(tok: &Tokenizer, docs: &[Document], vocab: usize, what: &str) -> Result<TokenStream> {
    let mut s = TokenStream::default();
    for d in docs {
        s.push(tok, d)?;
    }
    if let Some(&bad) = s.ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(ModelError::Usage(format!(
            "{what}: the tokenizer gives id {bad}, outside the model's vocabulary of {vocab}"
        )));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs(text: &str) -> Vec<Document> {
        parse_jsonl(text, Path::new("d.jsonl")).unwrap()
    }

    #[test]
    fn jsonl_records_and_errors() {
        let d = docs("{\"text\": \"ab\"}\n\n{\"prompt\": \"q\", \"response\": \"r\"}\n");
        assert_eq!(d, vec![Document::Text("ab".into()), Document::Pair { prompt: "q".into(), response: "r".into() }]);
        for (bad, want) in [
            ("{\"text\": 3}", "line 1: `text` must be a string"),
            ("{}\n", "line 1: expected a `text` field"),
            ("{\"text\": \"a\"}\n{\"prompt\": \"q\"}", "line 2: expected a `text` field"),
            ("[1]", "line 1: expected a JSON object"),
            ("{\"text\": ", "line 1: not valid JSON"),
        ] {
            let e = parse_jsonl(bad, Path::new("d.jsonl")).unwrap_err().to_string();
            assert!(e.starts_with("d.jsonl: ") && e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn prompt_tokens_are_not_targets_and_documents_end_with_eos() {
        let tok = Tokenizer::bytes();
        let mut s = TokenStream::default();
        for d in docs("{\"prompt\": \"ab\", \"response\": \"cd\"}\n{\"text\": \"ef\"}") {
            s.push(&tok, &d).unwrap();
        }
        assert_eq!(s.ids, b"abcd\nef\n".iter().map(|&b| b as u32).collect::<Vec<_>>());
        assert_eq!(s.is_target, [false, false, true, true, true, true, true, true]);
        // Windows of 3 + 1: "abcd" and "d\nef"; the target of `a` (b) is ignored.
        let l = Loader::new(s, 3, 0, "d").unwrap();
        let b = l.all_batches(2);
        assert_eq!(b.len(), 1);
        let c = |s: &str| s.bytes().map(|b| b as i64).collect::<Vec<_>>();
        assert_eq!(b[0].tokens, [c("abc"), c("d\ne")].concat());
        assert_eq!(b[0].targets, [vec![IGNORE_INDEX], c("cd\nef")].concat());
    }

    #[test]
    fn loader_state_resumes_the_same_batches() {
        let s = sentence();
        let mut a = Loader::new(s.clone(), 4, 7, "d").unwrap();
        assert_eq!(a.windows(), 10);
        let first: Vec<Batch> = (0..4).map(|_| a.next_batch(3)).collect();
        let saved = a.state();
        let rest: Vec<Batch> = (0..5).map(|_| a.next_batch(3)).collect();
        assert_eq!(a.state().epoch, 2);
        let mut b = Loader::new(s, 4, 7, "d").unwrap();
        b.restore(saved).unwrap();
        assert_eq!((0..5).map(|_| b.next_batch(3)).collect::<Vec<_>>(), rest);
        // Every window once per epoch, in a shuffled order.
        let mut seen: Vec<i64> = first.iter().flat_map(|b| b.tokens.chunks(4).map(|w| w[0])).collect();
        seen.truncate(10);
        assert_ne!(seen, (0..10).map(s_first).collect::<Vec<_>>());
        seen.sort();
        let mut want: Vec<i64> = (0..10).map(s_first).collect();
        want.sort();
        assert_eq!(seen, want);
    }

    /// The ranks of a data-parallel run together take what one loader takes at the same global
    /// batch, across an epoch's end, and leave the same position behind; a run saved on 2 ranks
    /// resumes on 3 with the windows one process would take next.
    #[test]
    fn ranks_split_the_global_batch_and_resume_on_any_count() {
        let s = sentence();
        let mut one = Loader::new(s.clone(), 4, 7, "d").unwrap();
        let mut ranks: Vec<Loader> = (0..2).map(|_| Loader::new(s.clone(), 4, 7, "d").unwrap()).collect();
        for _ in 0..4 {
            let want = one.next_batch(2 * 3);
            let parts: Vec<Batch> =
                ranks.iter_mut().enumerate().map(|(r, l)| l.next_batch(3 * 2).rank_rows(r, 2).unwrap()).collect();
            assert!(parts.iter().all(|b| b.batch == 3 && b.tokens.len() == 12));
            assert_eq!(parts.iter().flat_map(|b| b.tokens.clone()).collect::<Vec<_>>(), want.tokens);
            assert_eq!(parts.iter().flat_map(|b| b.targets.clone()).collect::<Vec<_>>(), want.targets);
            assert!(ranks.iter().all(|l| l.state() == one.state()));
        }
        assert_eq!(one.state().epoch, 2, "the test crosses epochs");
        let saved = one.state();
        let want = one.next_batch(3 * 2);
        let mut three: Vec<Loader> = (0..3).map(|_| Loader::new(s.clone(), 4, 7, "d").unwrap()).collect();
        three.iter_mut().for_each(|l| l.restore(saved).unwrap());
        let got: Vec<i64> = three
            .iter_mut()
            .enumerate()
            .flat_map(|(r, l)| l.next_batch(2 * 3).rank_rows(r, 3).unwrap().tokens)
            .collect();
        assert_eq!(got, want.tokens);
        let e = three[0].next_batch(6).rank_rows(3, 3).unwrap_err().to_string();
        assert!(e.contains("rank 3 of a run of 3 ranks"), "{e}");
        let e = three[0].next_batch(4).rank_rows(0, 3).unwrap_err().to_string();
        assert!(e.contains("a batch of 4 rows"), "{e}");
    }

    /// The test sentence as a byte-level token stream.
    fn sentence() -> TokenStream {
        let mut s = TokenStream::default();
        s.push(&Tokenizer::bytes(), &Document::Text("the quick brown fox jumps over the lazy dog".into())).unwrap();
        s
    }

    /// The first byte of window `w` of the test sentence.
    fn s_first(w: usize) -> i64 {
        b"the quick brown fox jumps over the lazy dog\n"[w * 4] as i64
    }
}
