//! Model weights on the host: seeded initialisation, and safetensors files with Hugging Face
//! names and dtypes, so a checkpoint moves between rumble and transformers unchanged.
//!
//! A checkpoint is a single `.safetensors` file or a Hugging Face model folder: `config.json`
//! with `model.safetensors`, or with shards listed by `model.safetensors.index.json`
//! (`weight_map`: tensor name -> shard file), as `save_pretrained` writes past its
//! `max_shard_size` (see [`crate::folder`], which also writes them).
//!
//! Loading checks every tensor against the config (missing, shape, dtype, unexpected, NaN or infinity) and names
//! the file and the tensor when something is off (NaN or infinity too). Writes are atomic: a temporary file in the
//! same folder, flushed, then renamed over the target, so a crash never leaves half a checkpoint.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use rumble_core::{DType, TensorType};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::folder::read_checkpoint;
use crate::host::{self, HostTensor};
use crate::model::{Init, hf_parts, param_specs};
use rumble_core::cpu::Rng;

/// Named host tensors in a fixed order (for a model: `param_specs` order).
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    pub tensors: Vec<(String, HostTensor)>,
}

impl Weights {
    /// Hugging Face's initialisation, seeded: weights normal with std `initializer_range`,
    /// norms one, biases zero. Each tensor draws from its own stream (seed and its Hugging Face
    /// name: a packed parameter's parts draw as they would unpacked).
    pub fn init(cfg: &Config, seed: u64) -> Result<Weights> {
        // Each tensor has its own generator (seeded by its name), so they fill in parallel and
        // the values do not depend on the thread count.
        use rayon::prelude::*;
        let tensors = param_specs(cfg)
            .into_par_iter()
            .map(|spec| {
                let n = spec.ty.numel();
                let fill = |name: &str, n: usize| -> Vec<f32> {
                    match spec.init {
                        Init::Ones => vec![1.0; n],
                        Init::Zeros => vec![0.0; n],
                        Init::Normal(std) => {
                            let mut rng = Rng::for_name(seed, name);
                            (0..n).map(|_| (rng.normal() * std) as f32).collect()
                        }
                    }
                };
                let vals = match hf_parts(&spec.name) {
                    Some(parts) => parts.iter().flat_map(|p| fill(p, n / parts.len())).collect(),
                    None => fill(&spec.name, n),
                };
                Ok((spec.name, host::from_f32s(spec.ty.dtype, spec.ty.dims(), &vals)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights { tensors })
    }

    /// Reads a checkpoint for `cfg` (a safetensors file or a model folder, see
    /// [`crate::folder::read_checkpoint`]): every parameter must be there with its exact shape and dtype.
    pub fn load(path: &Path, cfg: &Config) -> Result<Weights> {
        Weights::load_as(path, cfg, OnDtypeMismatch::Error)
    }

    /// As [`Weights::load`]; a stored tensor of another float dtype than the config's is
    /// cast to it when `on_mismatch` says so (round to nearest even), else it is an error
    /// naming the tensor. A packed parameter ([`hf_parts`]) is found under its own name or as
    /// its Hugging Face parts (stacked here). A tied model accepts (and ignores) a stored
    /// `lm_head.weight`; rotary buffers (`*.rotary_emb.inv_freq`) of old checkpoints are
    /// ignored; any other extra tensor is an error, since it means the config and the file
    /// disagree.
    pub fn load_as(path: &Path, cfg: &Config, on_mismatch: OnDtypeMismatch) -> Result<Weights> {
        let (index_file, stored) = read_checkpoint(path)?;
        let mut stored: HashMap<String, (PathBuf, HostTensor)> = stored.into_iter().collect();
        let missing = |name: &str, ty: &TensorType| ModelError::MissingTensor {
            file: index_file.clone(),
            name: name.to_string(),
            expected: ty.to_string(),
        };
        let mut tensors = Vec::new();
        for spec in param_specs(cfg) {
            let t = match (stored.remove(&spec.name), hf_parts(&spec.name)) {
                (Some((file, t)), _) => checked(&file, &spec.name, &spec.ty, t, on_mismatch)?,
                (None, Some(parts)) => {
                    let mut dims = spec.ty.dims().to_vec();
                    dims[0] /= parts.len();
                    let part_ty = spec.ty.with_shape(dims);
                    let mut bytes = Vec::with_capacity(spec.ty.size_in_bytes());
                    for part in parts {
                        let (file, t) = stored.remove(&part).ok_or_else(|| missing(&part, &part_ty))?;
                        bytes.extend(checked(&file, &part, &part_ty, t, on_mismatch)?.bytes);
                    }
                    HostTensor { ty: spec.ty.clone(), bytes }
                }
                (None, None) => return Err(missing(&spec.name, &spec.ty)),
            };
            tensors.push((spec.name, t));
        }
        let mut extra: Vec<(String, PathBuf)> = stored
            .into_iter()
            .filter(|(n, _)| {
                let ignorable =
                    n.ends_with("rotary_emb.inv_freq") || (cfg.tie_word_embeddings && n == "lm_head.weight");
                !ignorable
            })
            .map(|(n, (file, _))| (n, file))
            .collect();
        extra.sort();
        if let Some((name, file)) = extra.into_iter().next() {
            return Err(ModelError::UnexpectedTensor { file, name });
        }
        Ok(Weights { tensors })
    }

    /// The tensors under Hugging Face's names: packed parameters split into their parts.
    pub fn hf_tensors(&self) -> Vec<(String, HostTensor)> {
        let mut out = Vec::with_capacity(self.tensors.len() + 8);
        for (name, t) in &self.tensors {
            out.extend(split_packed(name, t));
        }
        out
    }

    /// Writes the weights as a safetensors file with Hugging Face's names (atomically).
    pub fn save(&self, path: &Path) -> Result<()> {
        write_safetensors(path, &self.hf_tensors())
    }

    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    pub fn num_bytes(&self) -> usize {
        self.tensors.iter().map(|(_, t)| t.bytes.len()).sum()
    }
}

/// `(name, t)` as Hugging Face stores it: a packed parameter's parts (rows split evenly, in
/// [`hf_parts`] order; a gradient of one splits the same way), anything else as it is.
pub fn split_packed(name: &str, t: &HostTensor) -> Vec<(String, HostTensor)> {
    let Some(parts) = hf_parts(name) else { return vec![(name.to_string(), t.clone())] };
    let mut dims = t.ty.dims().to_vec();
    dims[0] /= parts.len();
    let ty = t.ty.with_shape(dims);
    let each = ty.size_in_bytes();
    parts
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, HostTensor { ty: ty.clone(), bytes: t.bytes[i * each..(i + 1) * each].to_vec() }))
        .collect()
}

/// What loading does with a stored float tensor whose dtype is not the model's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnDtypeMismatch {
    /// An error naming the file and the tensor.
    #[default]
    Error,
    /// Cast to the model's dtype (float to float only).
    Cast,
}

/// `t` if it has type `want` (cast to it if allowed) and only finite values, else the error
/// naming the file, the tensor and both types (or the first non-finite element).
fn checked(path: &Path, name: &str, want: &TensorType, t: HostTensor, on: OnDtypeMismatch) -> Result<HostTensor> {
    if t.ty.dims() != want.dims() {
        return Err(ModelError::Shape {
            file: path.into(),
            name: name.to_string(),
            expected: want.dims().to_vec(),
            got: t.ty.dims().to_vec(),
        });
    }
    if t.ty.dtype != want.dtype && !(on == OnDtypeMismatch::Cast && t.ty.dtype.is_float() && want.dtype.is_float()) {
        return Err(ModelError::DType {
            file: path.into(),
            name: name.to_string(),
            expected: want.dtype.to_string(),
            got: t.ty.dtype.to_string(),
        });
    }
    // The finite check runs on the stored values (a cast to bf16 could overflow to infinity too).
    if let Some((index, value)) = crate::guard::first_non_finite(&t) {
        return Err(ModelError::NonFinite { file: path.into(), name: name.to_string(), index, value });
    }
    let t = if t.ty.dtype != want.dtype { HostTensor::from_f64(want.dtype, want.dims(), &t.to_f64())? } else { t };
    if let Some((index, value)) = crate::guard::first_non_finite(&t) {
        return Err(ModelError::NonFinite { file: path.into(), name: name.to_string(), index, value });
    }
    Ok(t)
}

fn to_st_dtype(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::F64 => StDtype::F64,
        DType::BF16 => StDtype::BF16,
        DType::F16 => StDtype::F16,
        DType::I32 => StDtype::I32,
        DType::I64 => StDtype::I64,
        DType::Bool => StDtype::BOOL,
    }
}

fn from_st_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::F64 => DType::F64,
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::I32 => DType::I32,
        StDtype::I64 => DType::I64,
        StDtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// Every tensor of a safetensors file, in the file's name order.
/// The file must be a regular file, and twice its size (the file and the tensors copied out
/// of it) must fit in the host memory free.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, HostTensor)>> {
    let bytes = crate::guard::read_in_memory(path, "safetensors", 2)?;
    parse_safetensors(&bytes, path)
}

/// Every tensor of the safetensors bytes `bytes` (read from `path`, named in errors), in name
/// order. Never panics on malformed bytes (fuzzed in `tests/fuzz_readers.rs`).
pub fn parse_safetensors(bytes: &[u8], path: &Path) -> Result<Vec<(String, HostTensor)>> {
    let bad = |msg: String| ModelError::Safetensors { file: path.into(), msg };
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(describe(&e, bytes.len())))?;
    let mut out = Vec::with_capacity(st.len());
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    for name in names {
        let view = st.tensor(&name).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        let dtype = from_st_dtype(view.dtype())
            .ok_or_else(|| bad(format!("tensor `{name}` has dtype {:?}, which rumble does not read", view.dtype())))?;
        let ty = TensorType::new(dtype, view.shape().to_vec());
        match ty.checked_size_in_bytes() {
            Ok(n) if n == view.data().len() => {}
            Ok(n) => {
                return Err(bad(format!(
                    "tensor `{name}`: {ty} needs {n} bytes, the file gives {}",
                    view.data().len()
                )));
            }
            Err(e) => return Err(bad(format!("tensor `{name}`: {e}"))),
        }
        out.push((name, HostTensor { ty, bytes: view.data().to_vec() }));
    }
    Ok(out)
}

fn describe(e: &safetensors::SafeTensorError, len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer | E::InvalidOffset(_) => {
            format!("the file is truncated or its header does not match its data ({len} bytes): {e}")
        }
        E::HeaderTooSmall | E::InvalidHeaderLength => format!("the header is cut short ({len} bytes): {e}"),
        _ => e.to_string(),
    }
}

/// Writes `tensors` as a safetensors file with `{"format": "pt"}` metadata (what transformers
/// expects), atomically: streamed into a temporary file beside `path` (no copy of the whole
/// file in memory), synced, then renamed.
pub fn write_safetensors(path: &Path, tensors: &[(String, HostTensor)]) -> Result<()> {
    let bad = |msg: String| ModelError::Safetensors { file: path.into(), msg };
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if t.bytes.len() != t.ty.size_in_bytes() {
            return Err(bad(format!("tensor `{name}`: {} bytes do not hold a {}", t.bytes.len(), t.ty)));
        }
        let view = TensorView::new(to_st_dtype(t.ty.dtype), t.ty.dims().to_vec(), &t.bytes)
            .map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        views.push((name.as_str(), view));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut failed = None;
    write_atomic_with(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => e,
            e => {
                failed = Some(bad(e.to_string()));
                std::io::Error::other("not serialized")
            }
        })
    })
    .map_err(|e| failed.take().unwrap_or(e))
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| std::fs::File::create(tmp)?.write_all(bytes))
}

/// Has `write` create and fill a temporary file beside `path` (`.NAME.tmp-PID`), then syncs it
/// and renames it to `path`: a reader sees the old file or the whole new one, never a part. On
/// an error the temporary file is removed.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file_name =
        path.file_name().ok_or_else(|| ModelError::Usage(format!("{}: not a file path", path.display())))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp: PathBuf = dir.join(tmp_name);
    let result = (|| {
        write(&tmp)?;
        std::fs::OpenOptions::new().write(true).open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(ModelError::io(path, e));
    }
    Ok(())
}
