//! Text to token ids and back: the seam where a model folder's tokenizer plugs in.
//!
//! A folder with no `tokenizer.json` (what `rumble train` writes for the byte-level presets)
//! is byte-level: token `i` is byte `i`. Folders with a `tokenizer.json` need the Hugging Face
//! tokenizer module; until it is wired in here, such a folder is refused by name.

use std::path::Path;

use crate::config::Config;
use crate::error::{ModelError, Result};

/// Encodes text and decodes token ids.
pub trait Tokenizer {
    fn encode(&self, text: &str) -> Result<Vec<i64>>;
    /// The bytes of token `id` (byte-level: the byte itself), for streaming.
    fn token_bytes(&self, id: i64) -> Vec<u8>;
}

/// Token `i` is byte `i` (vocabularies of at least 256).
pub struct ByteLevel;

impl Tokenizer for ByteLevel {
    fn encode(&self, text: &str) -> Result<Vec<i64>> {
        Ok(text.bytes().map(i64::from).collect())
    }
    fn token_bytes(&self, id: i64) -> Vec<u8> {
        u8::try_from(id).map(|b| vec![b]).unwrap_or_default()
    }
}

/// The tokenizer of model folder `dir` for `cfg`.
pub fn load(dir: &Path, cfg: &Config) -> Result<Box<dyn Tokenizer>> {
    let tj = dir.join("tokenizer.json");
    if tj.exists() {
        return Err(ModelError::Usage(format!(
            "{}: tokenizer.json models need the Hugging Face tokenizer, which `rumble generate` does not \
             load yet; byte-level folders (no tokenizer.json) work",
            tj.display()
        )));
    }
    if cfg.vocab_size < 256 {
        return Err(ModelError::Usage(format!(
            "{}: no tokenizer.json, and vocab_size {} is too small for byte-level tokens (256)",
            dir.display(),
            cfg.vocab_size
        )));
    }
    Ok(Box::new(ByteLevel))
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
