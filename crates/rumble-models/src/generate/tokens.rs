//! Text to token ids and back for generation: a model folder's tokenizer
//! ([`crate::tokenizer::Tokenizer`]: its `tokenizer.json` through the Hugging Face `tokenizers`
//! crate, or bytes for folders without one, such as what `rumble train` writes for the
//! byte-level presets), its end-of-sequence ids, and a [`Detokenizer`] that turns generated
//! ids into text as they come.

use std::path::Path;

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;

/// The tokenizer of model folder `dir` for `cfg`: its `tokenizer.json`, or bytes where there is
/// none (then the vocabulary must hold the 256 byte values).
pub fn load(dir: &Path, cfg: &Config) -> Result<Tokenizer> {
    if dir.join("tokenizer.json").exists() {
        return Tokenizer::from_folder(dir);
    }
    if cfg.vocab_size < 256 {
        return Err(ModelError::Usage(format!(
            "{}: no tokenizer.json, and vocab_size {} is too small for byte-level tokens (256)",
            dir.display(),
            cfg.vocab_size
        )));
    }
    Ok(Tokenizer::bytes())
}

/// The ids of prompt `text` as transformers' `tokenizer(text)` gives them (a BOS where the
/// tokenizer's post-processor adds one), checked against the model's vocabulary.
pub fn encode_prompt(tok: &Tokenizer, text: &str, cfg: &Config) -> Result<Vec<i64>> {
    let ids = tok.encode(text, true)?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= cfg.vocab_size) {
        return Err(ModelError::Usage(format!(
            "the tokenizer gives id {bad} for the prompt, past the model's vocabulary of {}",
            cfg.vocab_size
        )));
    }
    Ok(ids.into_iter().map(i64::from).collect())
}

/// The end-of-sequence ids of model folder `dir`: `eos_token_id` (a number or a list) of
/// `generation_config.json` when present, else of `config.json`; none for byte-level folders
/// that name none.
pub fn eos_ids(dir: &Path) -> Result<Vec<i64>> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::config(path.display().to_string(), "(json)", e.to_string()))?;
        match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => return Ok(n.as_i64().into_iter().collect()),
            Some(serde_json::Value::Array(a)) => return Ok(a.iter().filter_map(|x| x.as_i64()).collect()),
            _ => {}
        }
    }
    Ok(Vec::new())
}

/// Tokens of context decoded before the new ones: enough for decoders that treat a text's
/// first token apart (SentencePiece's leading space).
const CONTEXT: usize = 5;

/// Turns a sequence's generated ids into the bytes to print, as they come. Byte-level ids are
/// their bytes, and an id past them (a model whose vocabulary is larger than the 256 bytes it
/// was trained on) prints as U+FFFD, the replacement character, so that it shows; callers say
/// so ([`past_vocabulary`]). Otherwise the ids are decoded together with a few tokens before them, and the
/// text is held back while it ends in an incomplete character (a byte-fallback or byte-level
/// token may carry part of one); special tokens are left out.
pub struct Detokenizer<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    /// Where the decoded context starts, and where the text already given ends.
    prefix: usize,
    read: usize,
}

impl<'a> Detokenizer<'a> {
    /// After `prompt` (its ids, the context of the first new token).
    pub fn new(tok: &'a Tokenizer, prompt: &[i64]) -> Self {
        let ids: Vec<u32> = prompt.iter().map(|&i| i as u32).collect();
        let read = ids.len();
        Detokenizer { tok, ids, prefix: read.saturating_sub(CONTEXT), read }
    }

    /// The bytes new token `id` completes (maybe none yet).
    pub fn push(&mut self, id: i64) -> Result<Vec<u8>> {
        if self.tok.is_bytes() {
            return Ok(u8::try_from(id).map(|b| vec![b]).unwrap_or_else(|_| REPLACEMENT.as_bytes().to_vec()));
        }
        self.ids.push(id as u32);
        self.emit(false)
    }

    /// What is still held back (a last incomplete character, as the decoder gives it).
    pub fn finish(&mut self) -> Result<Vec<u8>> {
        if self.tok.is_bytes() || self.read == self.ids.len() {
            return Ok(Vec::new());
        }
        self.emit(true)
    }

    fn emit(&mut self, last: bool) -> Result<Vec<u8>> {
        let before = self.tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = self.tok.decode(&self.ids[self.prefix..], true)?;
        let complete = last || !now.ends_with('\u{FFFD}');
        if now.len() <= before.len() || !complete || !now.is_char_boundary(before.len()) {
            return Ok(Vec::new());
        }
        let out = now.as_bytes()[before.len()..].to_vec();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(out)
    }
}

/// What a byte-level [`Detokenizer`] prints for an id that is not a byte.
const REPLACEMENT: &str = "\u{FFFD}";

/// How many of `generated` lie past the ids `tok` can produce, and the first of them: a note
/// for the user where there are any (a byte-level run of a model configured with a larger
/// vocabulary samples them until it has learnt not to).
pub fn past_vocabulary(tok: &Tokenizer, generated: &[i64]) -> Option<(usize, i64)> {
    let n = tok.vocab_size() as i64;
    let first = generated.iter().copied().find(|&id| id >= n)?;
    Some((generated.iter().filter(|&&id| id >= n).count(), first))
}

/// The note [`past_vocabulary`]'s count and first id make.
pub fn past_vocabulary_note(tok: &Tokenizer, (count, first): (usize, i64)) -> String {
    let what = match tok.file() {
        None => "the 256 byte ids (the folder has no tokenizer.json); they print as U+FFFD".to_string(),
        Some(f) => format!("the {} ids of {}; the tokenizer leaves them out", tok.vocab_size(), f.display()),
    };
    format!("note: {count} generated id(s) (the first {first}) lie past {what}")
}

/// The text of a sequence's generated ids after `prompt`, as a [`Detokenizer`] streams it.
pub fn decode_generated(tok: &Tokenizer, prompt: &[i64], generated: &[i64]) -> Result<Vec<u8>> {
    let mut d = Detokenizer::new(tok, prompt);
    let mut out = Vec::new();
    for &id in generated {
        out.extend(d.push(id)?);
    }
    out.extend(d.finish()?);
    Ok(out)
}
