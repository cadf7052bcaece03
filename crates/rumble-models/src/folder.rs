//! Hugging Face model folders, in and out: `config.json` beside `model.safetensors`, or beside
//! shards listed by `model.safetensors.index.json` (`{"metadata": {"total_size": N},
//! "weight_map": {tensor: shard file}}`), as transformers' `save_pretrained` writes them past
//! its `max_shard_size`; plus the tokenizer files, copied along with a checkpoint.
//!
//! Every file is written atomically ([`write_atomic`]); shards first, the index last, so an
//! index never names a shard that is not complete. A folder written again drops the files of
//! its previous layout (a stale `model.safetensors` would shadow a new index, as transformers
//! reads the single file first).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::host::HostTensor;
use crate::tokenizer::TOKENIZER_FILES;
use crate::weights::{Weights, read_safetensors, write_atomic, write_safetensors};

/// The single-file checkpoint of a folder.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// `save_pretrained`'s default shard limit (its "5GB": decimal bytes).
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// Every stored tensor of a checkpoint with the file it came from, and the path that errors
/// about a missing tensor should name (the file, or the index). `path` is a `.safetensors`
/// file, an index file, or a folder holding either (`model.safetensors` first, as
/// transformers looks).
pub type Stored = Vec<(String, (PathBuf, HostTensor))>;

/// Reads the checkpoint at `path` (see [`Stored`]).
pub fn read_checkpoint(path: &Path) -> Result<(PathBuf, Stored)> {
    let file = if path.is_dir() {
        let (single, index) = (path.join(SINGLE_FILE), path.join(INDEX_FILE));
        if single.is_file() {
            single
        } else if index.is_file() {
            index
        } else {
            return Err(ModelError::Usage(format!(
                "{}: not a model folder: it holds neither {SINGLE_FILE} nor {INDEX_FILE}",
                path.display()
            )));
        }
    } else {
        path.to_path_buf()
    };
    if file.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".index.json")) {
        return Ok((file.clone(), read_sharded(&file)?));
    }
    let tensors = read_safetensors(&file)?.into_iter().map(|(n, t)| (n, (file.clone(), t))).collect();
    Ok((file, tensors))
}

/// The `weight_map` of an index file: tensor name -> shard file name (a plain name in the
/// index's folder).
pub fn read_index(index: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
    let src = index.display().to_string();
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::config(&src, "<document>", format!("not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::config(&src, "weight_map", "missing, or not an object"))?;
    let mut out = BTreeMap::new();
    for (name, f) in map {
        let key = format!("weight_map.{name}");
        let f = f.as_str().ok_or_else(|| ModelError::config(&src, &key, format!("expected a file name, got {f}")))?;
        let plain = Path::new(f).file_name().is_some_and(|n| n == f) && f != ".." && f != ".";
        if !plain {
            return Err(ModelError::config(&src, &key, format!("`{f}` is not a file name in the index's folder")));
        }
        out.insert(name.clone(), f.to_string());
    }
    Ok(out)
}

/// The tensors the index lists, each read from its shard (each shard read once).
fn read_sharded(index: &Path) -> Result<Stored> {
    let map = read_index(index)?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, f) in &map {
        by_file.entry(f.as_str()).or_default().push(name.as_str());
    }
    let mut out = Vec::with_capacity(map.len());
    for (f, names) in by_file {
        let shard = dir.join(f);
        let mut held: HashMap<String, HostTensor> = read_safetensors(&shard)?.into_iter().collect();
        for name in names {
            let t = held.remove(name).ok_or_else(|| ModelError::Data {
                file: index.into(),
                msg: format!("`weight_map` puts tensor `{name}` in {f}, which does not hold it"),
            })?;
            out.push((name.to_string(), (shard.clone(), t)));
        }
    }
    Ok(out)
}

/// `tensors` cut into shards of at most `max_bytes` each, in order (a tensor larger than the
/// limit gets a shard of its own), as `save_pretrained` does.
fn shard(tensors: Vec<(String, HostTensor)>, max_bytes: usize) -> Vec<Vec<(String, HostTensor)>> {
    let mut shards: Vec<Vec<(String, HostTensor)>> = vec![vec![]];
    let mut size = 0;
    for (name, t) in tensors {
        let n = t.bytes.len();
        if size > 0 && size + n > max_bytes {
            shards.push(vec![]);
            size = 0;
        }
        size += n;
        if let Some(s) = shards.last_mut() {
            s.push((name, t));
        }
    }
    shards
}

/// The shard file name `save_pretrained` uses: `model-00001-of-00003.safetensors`.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

fn is_shard_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model-").and_then(|r| r.strip_suffix(".safetensors")) else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 14 && &rest[5..9] == "-of-" && b[..5].iter().chain(&b[9..]).all(u8::is_ascii_digit)
}

/// Writes a Hugging Face model folder: `config.json` and the weights under Hugging Face's
/// names, as one `model.safetensors` up to `max_shard_bytes`, else as shards and their index.
/// Returns the weight files written (the index last).
pub fn save_folder(dir: &Path, cfg: &Config, weights: &Weights, max_shard_bytes: usize) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let tensors = weights.hf_tensors();
    let total: usize = tensors.iter().map(|(_, t)| t.bytes.len()).sum();
    let shards = shard(tensors, max_shard_bytes.max(1));
    let mut written = Vec::new();
    if shards.len() == 1 {
        let file = dir.join(SINGLE_FILE);
        write_safetensors(&file, &shards[0])?;
        written.push(file);
    } else {
        let n = shards.len();
        let mut map = BTreeMap::new();
        for (i, s) in shards.iter().enumerate() {
            let name = shard_name(i, n);
            write_safetensors(&dir.join(&name), s)?;
            map.extend(s.iter().map(|(t, _)| (t.clone(), name.clone())));
            written.push(dir.join(name));
        }
        let index = json!({"metadata": {"total_size": total}, "weight_map": map});
        let mut text = serde_json::to_string_pretty(&index).unwrap_or_default();
        text.push('\n');
        let file = dir.join(INDEX_FILE);
        write_atomic(&file, text.as_bytes())?;
        written.push(file);
    }
    remove_stale(dir, &written)?;
    write_atomic(&dir.join("config.json"), cfg.to_json_string().as_bytes())?;
    Ok(written)
}

/// Removes weight files of another layout than `kept` from `dir` (a previous save's).
fn remove_stale(dir: &Path, kept: &[PathBuf]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for e in entries {
        let path = e.map_err(|e| ModelError::io(dir, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let ours = name == SINGLE_FILE || name == INDEX_FILE || is_shard_name(&name);
        if ours && !kept.contains(&path) {
            std::fs::remove_file(&path).map_err(|e| ModelError::io(&path, e))?;
        }
    }
    Ok(())
}

/// Copies the tokenizer files [`TOKENIZER_FILES`] that `from` holds into `to` (each
/// atomically); returns their names. Nothing is copied onto itself.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<Vec<String>> {
    let same = match (from.canonicalize(), to.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let mut copied = Vec::new();
    if same {
        return Ok(copied);
    }
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        let bytes = std::fs::read(&src).map_err(|e| ModelError::io(&src, e))?;
        write_atomic(&to.join(name), &bytes)?;
        copied.push(name.to_string());
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_and_limits() {
        assert_eq!(shard_name(0, 2), "model-00001-of-00002.safetensors");
        assert!(is_shard_name("model-00002-of-00002.safetensors"));
        assert!(!is_shard_name("model-2-of-2.safetensors") && !is_shard_name("model.safetensors"));
        let t = |n: usize| HostTensor {
            ty: rumble_core::TensorType::new(rumble_core::DType::F32, [n]),
            bytes: vec![1; 4 * n],
        };
        let tensors = vec![("a".into(), t(10)), ("b".into(), t(10)), ("c".into(), t(100)), ("d".into(), t(1))];
        let sizes: Vec<Vec<String>> =
            shard(tensors, 80).into_iter().map(|s| s.into_iter().map(|(n, _)| n).collect()).collect();
        assert_eq!(sizes, vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
    }
}
