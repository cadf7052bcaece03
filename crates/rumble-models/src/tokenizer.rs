//! Text to token ids and back: a model folder's Hugging Face `tokenizer.json` (read by the
//! `tokenizers` crate, the library transformers' fast tokenizers are), or bytes (token id =
//! byte value) for the tiny preset and folders without a `tokenizer.json`.
//!
//! The special tokens a data loader needs are found where transformers keeps them:
//! `tokenizer_config.json` (`bos_token` / `eos_token`, a string or an `AddedToken` object),
//! then `generation_config.json` and `config.json` (`bos_token_id` / `eos_token_id`, a number
//! or a list whose first entry is taken). Whether a BOS is prepended is the tokenizer's own
//! post-processor's business (LLaMA's adds one, Qwen2's does not): `encode(text, true)` does
//! what `tokenizer(text)` does in transformers.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{ModelError, Result};

/// The files of a Hugging Face model folder that describe its tokenizer (copied along with
/// checkpoints).
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
];

/// The byte that ends a document in byte-level data (a newline): bytes have no EOS token.
pub const BYTE_EOS: u32 = b'\n' as u32;

enum Kind {
    /// Token id = byte value; vocabulary 256.
    Bytes,
    Hf {
        tok: Box<tokenizers::Tokenizer>,
        file: PathBuf,
    },
}

/// A tokenizer with its special token ids.
pub struct Tokenizer {
    kind: Kind,
    bos: Option<u32>,
    eos: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Bytes => write!(f, "Tokenizer(bytes)"),
            Kind::Hf { file, .. } => write!(f, "Tokenizer({}, bos {:?}, eos {:?})", file.display(), self.bos, self.eos),
        }
    }
}

impl Tokenizer {
    /// Byte-level: each byte is a token; documents end with [`BYTE_EOS`].
    pub fn bytes() -> Tokenizer {
        Tokenizer { kind: Kind::Bytes, bos: None, eos: Some(BYTE_EOS) }
    }

    /// The tokenizer of a model folder: its `tokenizer.json` if it has one, else bytes.
    pub fn from_folder(dir: &Path) -> Result<Tokenizer> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Ok(Tokenizer::bytes());
        }
        Tokenizer::from_file(&file)
    }

    /// Reads a `tokenizer.json`; the special tokens come from the JSON files beside it.
    pub fn from_file(file: &Path) -> Result<Tokenizer> {
        let bytes = std::fs::read(file).map_err(|e| ModelError::io(file, e))?;
        Tokenizer::from_bytes(&bytes, file)
    }

    /// A `tokenizer.json`'s bytes, read as if from `file` (named in errors; the special tokens
    /// come from the JSON files beside it, where there are any).
    pub fn from_bytes(bytes: &[u8], file: &Path) -> Result<Tokenizer> {
        let bad = |msg: String| ModelError::Tokenizer { file: file.into(), msg };
        let tok = guarded(file, "reading it", || tokenizers::Tokenizer::from_bytes(bytes))?
            .map_err(|e| bad(format!("not a tokenizer.json: {e}")))?;
        let dir = file.parent().unwrap_or(Path::new("."));
        let mut t = Tokenizer { kind: Kind::Hf { tok: Box::new(tok), file: file.into() }, bos: None, eos: None };
        t.bos = t.special_id(dir, "bos")?;
        t.eos = t.special_id(dir, "eos")?;
        Ok(t)
    }

    /// `which` is "bos" or "eos": the token's id from tokenizer_config.json, else
    /// generation_config.json, else config.json.
    fn special_id(&self, dir: &Path, which: &str) -> Result<Option<u32>> {
        let Kind::Hf { tok, .. } = &self.kind else { return Ok(None) };
        let key = format!("{which}_token");
        let path = dir.join("tokenizer_config.json");
        if let Some(cfg) = read_json(&path)?
            && let Some(v) = cfg.get(&key).filter(|v| !v.is_null())
        {
            let content = match v {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => o.get("content").and_then(Value::as_str),
                _ => None,
            }
            .ok_or_else(|| {
                ModelError::config(
                    path.display().to_string(),
                    &key,
                    format!("expected a string or an object with `content`, got {v}"),
                )
            })?;
            let id = tok.token_to_id(content).ok_or_else(|| {
                ModelError::config(
                    path.display().to_string(),
                    &key,
                    format!("`{content}` is not in the tokenizer's vocabulary"),
                )
            })?;
            return Ok(Some(id));
        }
        let key = format!("{which}_token_id");
        for name in ["generation_config.json", "config.json"] {
            let path = dir.join(name);
            let Some(cfg) = read_json(&path)? else { continue };
            let v = match cfg.get(&key) {
                None | Some(Value::Null) => continue,
                Some(Value::Array(list)) => list.first().cloned().unwrap_or(Value::Null),
                Some(v) => v.clone(),
            };
            let id = v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| {
                ModelError::config(path.display().to_string(), &key, format!("expected a token id, got {v}"))
            })?;
            return Ok(Some(id));
        }
        Ok(None)
    }

    /// Whether this is the byte-level tokenizer.
    pub fn is_bytes(&self) -> bool {
        matches!(self.kind, Kind::Bytes)
    }

    /// The beginning-of-sequence token, where the folder names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The token that ends a document ([`BYTE_EOS`] for bytes).
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Ids the tokenizer can produce: 256 for bytes; the vocabulary with added tokens else.
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            Kind::Bytes => 256,
            Kind::Hf { tok, .. } => tok.get_vocab_size(true),
        }
    }

    /// Where this tokenizer was read from (`None` for bytes).
    pub fn file(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Bytes => None,
            Kind::Hf { file, .. } => Some(file),
        }
    }

    /// The ids of `text`; `special` adds what the tokenizer's post-processor adds (BOS for
    /// LLaMA), as `tokenizer(text)` does in transformers.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Kind::Hf { tok, file } => guarded(file, "encoding text", || tok.encode_fast(text, special))?
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ModelError::Tokenizer { file: file.clone(), msg: format!("cannot encode text: {e}") }),
        }
    }

    /// The text of `ids`; `skip_special` leaves special tokens out. Byte-level text that is
    /// not UTF-8 is decoded lossily.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.kind {
            Kind::Bytes => {
                let bytes = ids
                    .iter()
                    .map(|&i| {
                        u8::try_from(i).map_err(|_| ModelError::Usage(format!("token id {i} is not a byte (0..256)")))
                    })
                    .collect::<Result<Vec<u8>>>()?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Kind::Hf { tok, file } => guarded(file, "decoding ids", || tok.decode(ids, skip_special))?
                .map_err(|e| ModelError::Tokenizer { file: file.clone(), msg: format!("cannot decode ids: {e}") }),
        }
    }
}

/// `f()`, with a panic inside the `tokenizers` library (it panics on some malformed
/// tokenizer.json files, e.g. a BPE whose merges name tokens its vocabulary lacks) turned into
/// an error naming `file` and what was being done. The library's tokenizer holds no state a
/// failed call could leave half-changed (reading builds a new one; encode and decode take it
/// by shared reference), so carrying on after the error is sound.
fn guarded<T>(file: &Path, what: &str, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        ModelError::Tokenizer { file: file.into(), msg: format!("the tokenizers library failed {what}: {why}") }
    })
}

/// The JSON object in `path`, or `None` if there is no such file.
fn read_json(path: &Path) -> Result<Option<serde_json::Map<String, Value>>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        Ok(_) => Err(ModelError::config(path.display().to_string(), "<document>", "expected a JSON object")),
        Err(e) => Err(ModelError::config(path.display().to_string(), "<document>", format!("not valid JSON: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip() {
        let t = Tokenizer::bytes();
        let ids = t.encode("héllo\n", true).unwrap();
        assert_eq!(ids.len(), 7);
        assert_eq!(t.decode(&ids, false).unwrap(), "héllo\n");
        assert_eq!((t.bos(), t.eos(), t.vocab_size()), (None, Some(10), 256));
        assert!(t.decode(&[300], false).unwrap_err().to_string().contains("300"));
    }

    #[test]
    fn a_panic_in_the_library_is_an_error_naming_the_file() {
        let file = Path::new("models/x/tokenizer.json");
        assert_eq!(guarded(file, "encoding text", || 7).unwrap(), 7);
        let e = guarded(file, "encoding text", || -> u32 { panic!("merge `a b` out of range") }).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("models/x/tokenizer.json") && e.contains("failed encoding text"), "{e}");
        assert!(e.contains("merge `a b` out of range"), "{e}");
        let e = Tokenizer::from_bytes(b"{\"model\": 1}", file).unwrap_err().to_string();
        assert!(e.contains("models/x/tokenizer.json") && e.contains("not a tokenizer.json"), "{e}");
        // A file cut short inside its decoder (a partial download): the library's reader
        // panics (`expect("Helper")`) instead of returning its error.
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder":"#;
        let e = Tokenizer::from_bytes(json.as_bytes(), file).unwrap_err().to_string();
        assert!(e.contains("models/x/tokenizer.json") && e.contains("failed reading it"), "{e}");
    }
}
