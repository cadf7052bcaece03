//! The run folder (`--out`): checked, locked and given its log before the first step, so a
//! failing run never destroys an earlier one.
//!
//! - **Checked first** ([`check`], no writes): `--out` is a folder or absent; its outputs
//!   (`model.safetensors`, `config.json`, `loss.jsonl`) are absent or regular files (never
//!   links, FIFOs or folders); a non-empty folder is refused unless `--overwrite` (replace its
//!   run) or `--resume DIR` (continue it); `--init-from` never writes into its own folder.
//! - **Locked** ([`RunDir::open`]): `OUT/.rumble.lock` held with `flock` for the whole run, so two
//!   runs cannot share a folder. The kernel drops the lock when the process ends, SIGKILL
//!   included; the file itself stays (deleting a lock file races with the next run's open).
//! - **Stale temporary files** (`.NAME.tmp-PID`, left by atomic writes of killed processes, see
//!   `rumble_models::weights::write_atomic`) whose process is gone are removed, in the folder
//!   and its subfolders one level down.
//! - **The loss log** ([`LossLog`]): `loss.jsonl` opened for append, never through a symbolic
//!   link (`O_NOFOLLOW`), each line written whole and flushed. `--overwrite` empties it only when
//!   the first new line is written (a run that fails before its first step leaves it as it was);
//!   `--resume` trims a line cut short by a kill and the lines of steps past the checkpoint it
//!   continues from ([`LossLog::keep_through`]), then appends.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use clap::Args;
use rumble_models::{ModelError, Result};

/// The files a run writes at the top of its folder.
pub const OUTPUTS: [&str; 3] = ["model.safetensors", "config.json", "loss.jsonl"];

/// The lock file's name.
pub const LOCK: &str = ".rumble.lock";

/// What may already be in `--out`.
#[derive(Args, Clone, Debug, Default)]
pub struct RunDirArgs {
    /// Replace the run in a non-empty --out (its checkpoint and loss log are replaced once the
    /// new run has taken its first step). Without it a non-empty --out is refused.
    #[arg(long)]
    pub overwrite: bool,
    /// Continue the run in DIR from its newest checkpoint (DIR is the --out; --steps is the
    /// total). The loss log is appended to.
    #[arg(long, value_name = "DIR", conflicts_with = "overwrite")]
    pub resume: Option<PathBuf>,
}

/// How the run treats what is already in its folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The folder must be absent or empty.
    Fresh,
    /// Replace the run in it.
    Overwrite,
    /// Continue the run in it.
    Resume,
}

impl RunDirArgs {
    pub fn mode(&self) -> Mode {
        match (&self.resume, self.overwrite) {
            (Some(_), _) => Mode::Resume,
            (None, true) => Mode::Overwrite,
            (None, false) => Mode::Fresh,
        }
    }

    /// The run folder: `--resume DIR`, or `out` (which must agree with it when both are given).
    pub fn folder(&self, out: Option<&Path>, default: PathBuf) -> Result<PathBuf> {
        match (&self.resume, out) {
            (Some(r), Some(o)) if r != o => Err(ModelError::Usage(format!(
                "--resume {} continues the run in that folder: --out {} names another",
                r.display(),
                o.display()
            ))),
            (Some(r), _) => Ok(r.clone()),
            (None, Some(o)) => Ok(o.to_path_buf()),
            (None, None) => Ok(default),
        }
    }
}

fn bad(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::BadFile { path: path.into(), msg: msg.into() }
}

/// Checks `dir` for a run in `mode` without writing anything (see the module doc).
/// `init_from` is the checkpoint (file or folder) the run starts from, if any.
pub fn check(dir: &Path, mode: Mode, init_from: Option<&Path>) -> Result<()> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(ModelError::io(dir, e)),
    };
    let Some(meta) = meta else {
        return match mode {
            Mode::Resume => Err(bad(dir, "--resume: there is no run folder here")),
            _ => Ok(()),
        };
    };
    if !meta.is_dir() {
        return Err(bad(dir, "--out must be a folder; this is a file"));
    }
    if let Some(src) = init_from {
        let src_dir =
            if src.is_dir() { src.to_path_buf() } else { src.parent().unwrap_or(Path::new(".")).to_path_buf() };
        let src_dir = if src_dir.as_os_str().is_empty() { PathBuf::from(".") } else { src_dir };
        if let (Ok(a), Ok(b)) = (dir.canonicalize(), src_dir.canonicalize())
            && a == b
            && mode != Mode::Resume
        {
            return Err(bad(
                dir,
                format!(
                    "is the folder --init-from {} comes from: choose another --out (rumble never writes over its source)",
                    src.display()
                ),
            ));
        }
    }
    for name in OUTPUTS {
        let p = dir.join(name);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(bad(
                    &p,
                    "is a symbolic link: rumble writes its outputs only as regular files, never through links",
                ));
            }
            Ok(m) if !m.is_file() => return Err(bad(&p, "is not a regular file (a folder, FIFO or device)")),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ModelError::io(&p, e)),
        }
    }
    if mode == Mode::Fresh {
        let mut held: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != LOCK && stale_pid(n).is_none_or(alive))
            .collect();
        if !held.is_empty() {
            held.sort();
            let shown = if held.len() > 4 { format!("{}, ...", held[..4].join(", ")) } else { held.join(", ") };
            return Err(bad(
                dir,
                format!(
                    "--out is not empty (it holds {shown}): pass --overwrite to replace its run, --resume {} to continue it, or choose another --out",
                    dir.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The PID of a temporary file `.NAME.tmp-PID`, if `name` is one.
fn stale_pid(name: &str) -> Option<u32> {
    let (_, pid) = name.strip_prefix('.')?.rsplit_once(".tmp-")?;
    pid.parse().ok()
}

/// Whether process `pid` is still running (on Linux: `/proc/PID` exists).
fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes `.NAME.tmp-PID` files of processes that are gone, in `dir` and its subfolders;
/// returns how many.
pub fn remove_stale_temps(dir: &Path) -> usize {
    let mut removed = 0;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() && !name.starts_with('.') {
            if let Ok(sub) = std::fs::read_dir(e.path()) {
                for s in sub.filter_map(|s| s.ok()) {
                    let n = s.file_name().to_string_lossy().into_owned();
                    if s.file_type().is_ok_and(|t| t.is_file())
                        && stale_pid(&n).is_some_and(|p| !alive(p))
                        && std::fs::remove_file(s.path()).is_ok()
                    {
                        removed += 1;
                    }
                }
            }
        } else if ft.is_file() && stale_pid(&name).is_some_and(|p| !alive(p)) && std::fs::remove_file(e.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// An open, locked run folder.
pub struct RunDir {
    /// Held (and locked) for the life of the run.
    _lock: File,
    pub log: LossLog,
    /// Stale temporary files removed at the start.
    pub removed_temps: usize,
}

impl RunDir {
    /// Checks `dir` ([`check`]), creates it, takes its lock, removes stale temporary files and
    /// opens the loss log.
    pub fn open(dir: &Path, mode: Mode, init_from: Option<&Path>) -> Result<RunDir> {
        check(dir, mode, init_from)?;
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let lock_path = dir.join(LOCK);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(|e| link_or_io(&lock_path, e))?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(bad(
                    dir,
                    format!(
                        "another rumble run is using this folder (it holds {LOCK}); wait for it or choose another --out"
                    ),
                ));
            }
            return Err(ModelError::io(&lock_path, e));
        }
        // Checked again under the lock: another run may have written here since.
        check(dir, mode, init_from)?;
        let removed_temps = remove_stale_temps(dir);
        let log = LossLog::open(&dir.join("loss.jsonl"), mode)?;
        Ok(RunDir { _lock: lock, log, removed_temps })
    }
}

fn link_or_io(path: &Path, e: std::io::Error) -> ModelError {
    if e.raw_os_error() == Some(libc::ELOOP) {
        bad(path, "is a symbolic link: rumble does not write through links")
    } else {
        ModelError::io(path, e)
    }
}

/// `loss.jsonl`, appended to one whole line at a time.
pub struct LossLog {
    pub path: PathBuf,
    file: File,
    /// `--overwrite`: empty the file before the first new line.
    empty_first: bool,
}

impl LossLog {
    pub fn open(path: &Path, mode: Mode) -> Result<LossLog> {
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| link_or_io(path, e))?;
        let meta = file.metadata().map_err(|e| ModelError::io(path, e))?;
        if !meta.is_file() {
            return Err(bad(path, "is not a regular file (a FIFO or device)"));
        }
        if mode == Mode::Resume && meta.len() > 0 {
            // A kill mid-write can leave a partial last line: cut it, so what follows is whole.
            let mut text = Vec::new();
            file.read_to_end(&mut text).map_err(|e| ModelError::io(path, e))?;
            let keep = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            if keep < text.len() {
                file.set_len(keep as u64).map_err(|e| ModelError::io(path, e))?;
            }
        }
        Ok(LossLog { path: path.to_path_buf(), file, empty_first: mode == Mode::Overwrite })
    }

    /// Keeps the lines up to `step` (lines of later steps are dropped: a resumed run rewrites
    /// what came after its checkpoint; lines without a step are kept).
    pub fn keep_through(&mut self, step: u64) -> Result<()> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| ModelError::io(&self.path, e))?;
        let kept: String = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_none_or(|s| s <= step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        if kept.len() != text.len() {
            self.file.set_len(0).map_err(|e| ModelError::io(&self.path, e))?;
            self.file
                .write_all(kept.as_bytes())
                .and_then(|_| self.file.flush())
                .map_err(|e| ModelError::io(&self.path, e))?;
        }
        Ok(())
    }

    /// Appends `line` and a newline in one write, flushed to the file.
    pub fn line(&mut self, line: &str) -> Result<()> {
        if std::mem::take(&mut self.empty_first) {
            self.file.set_len(0).map_err(|e| ModelError::io(&self.path, e))?;
        }
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        self.file.write_all(&bytes).and_then(|_| self.file.flush()).map_err(|e| ModelError::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rumble-rundir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_non_empty_folder_is_refused_unless_asked() {
        let d = tmp("nonempty");
        std::fs::create_dir_all(&d).unwrap();
        check(&d, Mode::Fresh, None).unwrap();
        std::fs::write(d.join("model.safetensors"), b"old").unwrap();
        let e = check(&d, Mode::Fresh, None).unwrap_err().to_string();
        assert!(e.contains("not empty") && e.contains("model.safetensors") && e.contains("--overwrite"), "{e}");
        check(&d, Mode::Overwrite, None).unwrap();
        // The source folder of --init-from is never the output.
        let e = check(&d, Mode::Overwrite, Some(&d.join("model.safetensors"))).unwrap_err().to_string();
        assert!(e.contains("--init-from"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// `RunDir::open` once the lock is free: a process another test spawns in parallel holds a
    /// copy of every open descriptor from its fork to its exec, the lock's too, for a moment.
    fn reopen(d: &Path, mode: Mode) -> RunDir {
        for _ in 0..200 {
            match RunDir::open(d, mode, None) {
                Err(e) if e.to_string().contains("another rumble run") => {
                    std::thread::sleep(std::time::Duration::from_millis(10))
                }
                r => return r.unwrap(),
            }
        }
        panic!("{}: the lock stayed held", d.display())
    }

    #[test]
    fn the_lock_keeps_a_second_run_out_and_stale_temps_go() {
        let d = tmp("lock");
        std::fs::create_dir_all(&d).unwrap();
        // A temp file of a process that cannot exist (PIDs stay below 2^22 on Linux).
        std::fs::write(d.join(".model.safetensors.tmp-4294967295"), b"partial").unwrap();
        check(&d, Mode::Fresh, None).unwrap();
        let mut run = RunDir::open(&d, Mode::Fresh, None).unwrap();
        assert_eq!(run.removed_temps, 1);
        assert!(!d.join(".model.safetensors.tmp-4294967295").exists());
        let e = RunDir::open(&d, Mode::Overwrite, None).err().unwrap().to_string();
        assert!(e.contains("another rumble run"), "{e}");
        run.log.line("{\"step\": 1}").unwrap();
        drop(run);
        // Resume trims a cut line and appends.
        std::fs::OpenOptions::new().append(true).open(d.join("loss.jsonl")).unwrap().write_all(b"{\"ste").unwrap();
        let mut run = reopen(&d, Mode::Resume);
        run.log.line("{\"step\": 2}").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("loss.jsonl")).unwrap(), "{\"step\": 1}\n{\"step\": 2}\n");
        drop(run);
        // A resume from step 1 drops the lines of later steps, keeping lines without a step.
        let mut run = reopen(&d, Mode::Resume);
        run.log.line("{\"event\": \"note\"}").unwrap();
        run.log.keep_through(1).unwrap();
        run.log.line("{\"step\": 2}").unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("loss.jsonl")).unwrap(),
            "{\"step\": 1}\n{\"event\": \"note\"}\n{\"step\": 2}\n"
        );
        drop(run);
        // Overwrite keeps the old log until the first new line.
        let mut run = reopen(&d, Mode::Overwrite);
        assert_eq!(std::fs::read_to_string(d.join("loss.jsonl")).unwrap().lines().count(), 3);
        run.log.line("{\"step\": 1}").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("loss.jsonl")).unwrap(), "{\"step\": 1}\n");
        drop(run);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_linked_log_is_refused() {
        let d = tmp("link");
        std::fs::create_dir_all(&d).unwrap();
        let target = d.join("precious.txt");
        std::fs::write(&target, b"keep me").unwrap();
        std::os::unix::fs::symlink(&target, d.join("loss.jsonl")).unwrap();
        let e = RunDir::open(&d, Mode::Overwrite, None).err().unwrap().to_string();
        assert!(e.contains("loss.jsonl") && e.contains("symbolic link"), "{e}");
        assert!(LossLog::open(&d.join("loss.jsonl"), Mode::Overwrite).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
