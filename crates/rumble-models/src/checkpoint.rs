//! Checkpoints a run can resume from, and the files that make them.
//!
//! A checkpoint is a folder: the model folder of [`Trainer::save_checkpoint`] (in the config's
//! dtype, what transformers loads), then [`OPTIMIZER_FILE`] (every optimizer state by its trace
//! name and, when the step keeps its parameters in another dtype than the model folder (f32
//! masters under bf16-mixed), those exact masters as `master.{name}`), then [`STATE_FILE`]
//! ([`TrainerState`]: step, schedule, learning rate, data position, precision, the arguments
//! that shape the step, and the size and CRC-32 of every other file).
//!
//! Writes are safe against a crash at any moment: `OUT/checkpoint-STEP/` folders are written
//! whole under a hidden temporary name and renamed into place ([`save_step`]); at the run's root
//! each file is written atomically and `trainer_state.json` last, and [`newest`] only takes a
//! checkpoint whose files match the hashes its state lists, so a half-written root falls back to
//! the newest complete `checkpoint-STEP`.

use std::collections::BTreeMap;
use std::hash::Hasher;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::trainer::{LrSchedule, ScheduleKind, Trainer};
use crate::weights::{Weights, read_safetensors, write_atomic, write_safetensors};

/// The trainer's state file in a checkpoint folder.
pub const STATE_FILE: &str = "trainer_state.json";
/// Optimizer states (and f32 masters) in a checkpoint folder.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The prefix of a master parameter's name in [`OPTIMIZER_FILE`].
pub const MASTER_PREFIX: &str = "master.";
/// The prefix of a periodic checkpoint's folder name (`checkpoint-STEP`).
pub const STEP_PREFIX: &str = "checkpoint-";

/// The learning-rate schedule as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    pub peak: f64,
    pub warmup: u64,
    pub total: u64,
    /// `constant` or `cosine`.
    pub kind: String,
}

impl From<&LrSchedule> for ScheduleState {
    fn from(s: &LrSchedule) -> Self {
        let kind = match s.kind {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Cosine => "cosine",
        };
        ScheduleState { peak: s.peak, warmup: s.warmup, total: s.total, kind: kind.into() }
    }
}

impl ScheduleState {
    /// The schedule, running to `total` steps (a resumed run may be given a new total).
    pub fn schedule(&self, total: u64) -> Result<LrSchedule> {
        let kind = match self.kind.as_str() {
            "constant" => ScheduleKind::Constant,
            "cosine" => ScheduleKind::Cosine,
            k => return Err(ModelError::Usage(format!("{STATE_FILE}: unknown schedule kind `{k}`"))),
        };
        Ok(LrSchedule { peak: self.peak, warmup: self.warmup, total, kind })
    }
}

/// A file's size and CRC-32 (hex): enough to tell a file from another version. Checkpoints
/// written before the CRC carry an FNV-1a 64-bit hash instead, still checked as such.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fnv1a64: Option<String>,
}

impl FileDigest {
    /// The digest of the file at `path`, read in blocks (never whole into memory).
    pub fn of(path: &Path) -> Result<FileDigest> {
        Self::with(path, true)
    }

    /// The digest of `path` of the kind `self` holds, to compare with it.
    fn again(&self, path: &Path) -> Result<FileDigest> {
        Self::with(path, self.fnv1a64.is_none())
    }

    fn with(path: &Path, crc: bool) -> Result<FileDigest> {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        let mut buf = vec![0u8; 8 << 20];
        let (mut c, mut h, mut bytes) = (crc32fast::Hasher::new(), fnv::FnvHasher::default(), 0u64);
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ModelError::io(path, e)),
            };
            if crc {
                c.update(&buf[..n]);
            } else {
                h.write(&buf[..n]);
            }
            bytes += n as u64;
        }
        Ok(if crc {
            FileDigest { bytes, crc32: Some(format!("{:08x}", c.finalize())), fnv1a64: None }
        } else {
            FileDigest { bytes, crc32: None, fnv1a64: Some(format!("{:016x}", h.finish())) }
        })
    }

    fn hash(&self) -> &str {
        self.crc32.as_deref().or(self.fnv1a64.as_deref()).unwrap_or("-")
    }
}

/// What a run needs besides tensors to continue exactly where it stopped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken.
    pub step: u64,
    /// The precision's name (`bf16-mixed`, ...), or `None` when the step ran as stored.
    pub precision: Option<String>,
    pub schedule: ScheduleState,
    /// The learning rate of the last step taken.
    pub lr: f64,
    pub seed: u64,
    /// Where the data stream stands (the caller's own description: generator states, offsets).
    pub data: serde_json::Value,
    /// The arguments that shape the step (batch, sequence, optimizer, ...), by name: a resumed
    /// run must be given the same ([`mismatches`]).
    pub args: BTreeMap<String, serde_json::Value>,
    /// Every other file of the checkpoint folder, checked by [`verify`].
    #[serde(default)]
    pub files: BTreeMap<String, FileDigest>,
}

impl TrainerState {
    pub fn read(dir: &Path) -> Result<TrainerState> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        serde_json::from_str(&text).map_err(|e| ModelError::Usage(format!("{}: {e}", path.display())))
    }
}

/// The keys of `saved` whose values `now` changes, as `key: saved -> now` lines (empty: none).
pub fn mismatches(
    saved: &BTreeMap<String, serde_json::Value>,
    now: &BTreeMap<String, serde_json::Value>,
) -> Vec<String> {
    let null = serde_json::Value::Null;
    let mut keys: Vec<&String> = saved.keys().chain(now.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (saved.get(k).unwrap_or(&null), now.get(k).unwrap_or(&null));
            (a != b).then(|| format!("{k}: {a} -> {b}"))
        })
        .collect()
}

/// Whether a file of a checkpoint folder is one [`TrainerState::files`] covers: the model
/// folder's and the optimizer's safetensors and json files, not the state itself, the loss log
/// or hidden files.
fn covered(name: &str) -> bool {
    !name.starts_with('.') && name != STATE_FILE && (name.ends_with(".safetensors") || name.ends_with(".json"))
}

fn digests(dir: &Path) -> Result<BTreeMap<String, FileDigest>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))? {
        let e = e.map_err(|e| ModelError::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if covered(&name) && e.file_type().map_err(|err| ModelError::io(e.path(), err))?.is_file() {
            out.insert(name, FileDigest::of(&e.path())?);
        }
    }
    Ok(out)
}

/// Checks that `dir`'s files are the ones `state` lists; the error names the first that is not.
pub fn verify(dir: &Path, state: &TrainerState) -> Result<()> {
    if state.files.is_empty() {
        return Err(ModelError::Usage(format!("{}: {STATE_FILE} lists no files", dir.display())));
    }
    for (name, want) in &state.files {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(ModelError::Usage(format!("{}: missing (listed in {STATE_FILE})", path.display())));
        }
        let got = want.again(&path)?;
        if &got != want {
            return Err(ModelError::Usage(format!(
                "{}: {} bytes, hash {}, but {STATE_FILE} lists {} bytes, hash {} (a save was cut short)",
                path.display(),
                got.bytes,
                got.hash(),
                want.bytes,
                want.hash()
            )));
        }
    }
    Ok(())
}

/// Writes a checkpoint of `trainer` into `dir` (created if needed): the model folder, the
/// optimizer file (its optimizer states and, when its parameters are kept in another dtype than
/// the model folder's, the exact parameters), then `state` (with `files` filled in) last, all
/// from one read-back of the device. Each file is atomic; the set is made safe by [`verify`]
/// (see the module doc).
pub fn save(dir: &Path, trainer: &Trainer, state: &TrainerState) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let (params, mut resume) = trainer.snapshot()?;
    let stored = trainer.config().dtype;
    let model = if trainer.step_config().master_dtype(stored) != stored {
        let tensors = params.tensors.iter().map(|(n, t)| (n.clone(), t.cast(stored))).collect();
        resume.extend(params.tensors.into_iter().map(|(name, t)| (format!("{MASTER_PREFIX}{name}"), t)));
        Weights { tensors }
    } else {
        params
    };
    crate::trainer::save_checkpoint(dir, trainer.config(), &model)?;
    drop(model);
    write_safetensors(&dir.join(OPTIMIZER_FILE), &resume)?;
    drop(resume);
    let state = TrainerState { files: digests(dir)?, ..state.clone() };
    let text = serde_json::to_string_pretty(&state).map_err(|e| ModelError::Usage(e.to_string()))?;
    write_atomic(&dir.join(STATE_FILE), format!("{text}\n").as_bytes())
}

/// The step of a `checkpoint-STEP` folder name.
pub fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix(STEP_PREFIX)?.parse().ok()
}

/// The `checkpoint-STEP` folders of `out`, oldest first.
pub fn step_dirs(out: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    if !out.is_dir() {
        return Ok(found);
    }
    for e in std::fs::read_dir(out).map_err(|e| ModelError::io(out, e))? {
        let e = e.map_err(|e| ModelError::io(out, e))?;
        if let Some(step) = step_of(&e.file_name().to_string_lossy())
            && e.path().is_dir()
        {
            found.push((step, e.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Writes `out/checkpoint-STEP/` whole: into a hidden temporary folder, then renamed into place
/// (replacing an older folder of the same step), then removes all but the newest `keep_last`
/// `checkpoint-*` folders (`None`: keep all). Returns the folder.
pub fn save_step(out: &Path, trainer: &Trainer, state: &TrainerState, keep_last: Option<usize>) -> Result<PathBuf> {
    let name = format!("{STEP_PREFIX}{}", state.step);
    let tmp = out.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    }
    save(&tmp, trainer, state)?;
    let dst = out.join(&name);
    if dst.exists() {
        let old = out.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(&dst, &old).map_err(|e| ModelError::io(&dst, e))?;
        std::fs::rename(&tmp, &dst).map_err(|e| ModelError::io(&dst, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| ModelError::io(&old, e))?;
    } else {
        std::fs::rename(&tmp, &dst).map_err(|e| ModelError::io(&dst, e))?;
    }
    if let Ok(d) = std::fs::File::open(out) {
        let _ = d.sync_all(); // the rename itself durable, where the platform allows
    }
    if let Some(k) = keep_last {
        let all = step_dirs(out)?;
        for (_, dir) in all.iter().take(all.len().saturating_sub(k.max(1))) {
            std::fs::remove_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        }
    }
    Ok(dst)
}

/// The checkpoint a resumed run starts from.
#[derive(Debug)]
pub struct Newest {
    pub dir: PathBuf,
    pub state: TrainerState,
    /// Newer checkpoints passed over, each with why (a save cut short).
    pub skipped: Vec<String>,
}

/// The newest complete checkpoint of the run in `out`: its root or a `checkpoint-STEP`
/// folder, whichever has the highest step among those whose files [`verify`].
pub fn newest(out: &Path) -> Result<Newest> {
    let mut candidates = vec![out.to_path_buf()];
    candidates.extend(step_dirs(out)?.into_iter().map(|(_, d)| d));
    let mut good: Vec<(PathBuf, TrainerState)> = Vec::new();
    let mut bad: Vec<(u64, String)> = Vec::new();
    for dir in candidates {
        if !dir.join(STATE_FILE).is_file() {
            continue;
        }
        match TrainerState::read(&dir).and_then(|s| verify(&dir, &s).map(|_| s)) {
            Ok(s) => good.push((dir, s)),
            Err(e) => bad.push((
                step_of(&dir.file_name().unwrap_or_default().to_string_lossy()).unwrap_or(u64::MAX),
                e.to_string(),
            )),
        }
    }
    let Some((dir, state)) = good.into_iter().max_by_key(|(_, s)| s.step) else {
        let why: Vec<String> = bad.into_iter().map(|(_, e)| e).collect();
        return Err(ModelError::Usage(format!(
            "--resume {}: no complete checkpoint (a folder with {STATE_FILE}) to resume from{}",
            out.display(),
            if why.is_empty() { String::new() } else { format!(": {}", why.join("; ")) }
        )));
    };
    let skipped = bad.into_iter().filter(|(s, _)| *s > state.step).map(|(_, e)| e).collect();
    Ok(Newest { dir, state, skipped })
}

/// Reads what `Trainer::new` needs to continue from the checkpoint in `dir` for `cfg` (the
/// config read from its config.json): the parameters (the exact masters where the checkpoint
/// holds them, else the model folder's) and the optimizer states, by name.
pub fn load(dir: &Path, cfg: &Config) -> Result<Weights> {
    // The single file where there is one; else the folder (a sharded model folder).
    let single = dir.join("model.safetensors");
    let model = Weights::load(if single.is_file() { &single } else { dir }, cfg)?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let mut masters = BTreeMap::new();
    let mut states = Vec::new();
    for (name, t) in read_safetensors(&opt_path)? {
        match name.strip_prefix(MASTER_PREFIX) {
            Some(p) => {
                masters.insert(p.to_string(), t);
            }
            None => states.push((name, t)),
        }
    }
    let mut tensors = Vec::with_capacity(model.tensors.len() + states.len());
    for (name, t) in model.tensors {
        tensors.push(match masters.remove(&name) {
            Some(m) if m.ty.dims() == t.ty.dims() => (name, m),
            Some(m) => {
                return Err(ModelError::Shape {
                    file: opt_path,
                    name: format!("{MASTER_PREFIX}{name}"),
                    expected: t.ty.dims().to_vec(),
                    got: m.ty.dims().to_vec(),
                });
            }
            None => (name, t),
        });
    }
    if let Some(name) = masters.into_keys().next() {
        return Err(ModelError::UnexpectedTensor { file: opt_path, name: format!("{MASTER_PREFIX}{name}") });
    }
    tensors.extend(states);
    Ok(Weights { tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// New digests are CRC-32 (the published check value of "123456789" is cbf43926), read in
    /// blocks, so files past the 8 MiB block hash the same as whole; a digest of the older
    /// kind (FNV-1a 64, its published test vectors) is checked as that kind.
    #[test]
    fn file_digests_crc32_new_and_fnv1a_64_old() {
        let dir = std::env::temp_dir().join(format!("rumble-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        let crc = |s: &str| Some(s.to_string());
        for (text, want) in [("", "00000000"), ("123456789", "cbf43926")] {
            std::fs::write(&p, text).unwrap();
            let got = FileDigest::of(&p).unwrap();
            assert_eq!(got, FileDigest { bytes: text.len() as u64, crc32: crc(want), fnv1a64: None });
        }
        let big: Vec<u8> = (0..(9u32 << 20) + 7).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        std::fs::write(&p, &big).unwrap();
        assert_eq!(FileDigest::of(&p).unwrap().crc32, Some(format!("{:08x}", crc32fast::hash(&big))));
        for (text, want) in [("", "cbf29ce484222325"), ("a", "af63dc4c8601ec8c"), ("foobar", "85944171f73967e8")] {
            std::fs::write(&p, text).unwrap();
            let old = FileDigest { bytes: text.len() as u64, crc32: None, fnv1a64: Some(want.into()) };
            assert_eq!(old.again(&p).unwrap(), old);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
