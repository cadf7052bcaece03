//! The NCCL backend of data-parallel training (issue 20): the communicator a rank process
//! makes once, and the launch of `Op::Collective` nodes (`all_reduce`, `reduce_scatter`,
//! `all_gather`, each a sum) on the device's stream, so a rank's whole step, collectives
//! included, is captured into its CUDA graphs like any other node. The collectives' operands
//! and results are the plan's buffers: NCCL gets no buffer of its own from rumble.
//!
//! NCCL is loaded at run time (cudarc's dynamic loading, as the rest of CUDA): [`available`]
//! says whether it can be, and why not. cudarc looks for `libnccl.so` on the loader's path;
//! the library is usually installed as `libnccl.so.2` (the system package, or PyTorch's
//! `nvidia-nccl` wheel), so [`available`] names where it found such a file and what to link.
//! [`link_dir_for`] makes that link in a folder of rumble's own, for a launcher to put on its
//! rank processes' `LD_LIBRARY_PATH`.
//!
//! A process has at most one communicator ([`Comm::install`]: a rank is one process on one
//! device); a collective whose `world` and `rank` differ from it, or in a process without one,
//! is an error naming the op.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::nccl::{result as nr, sys as ns};
use rumble_core::ir::{CollectiveOp, DType};

use crate::device::Device;
use crate::error::{CudaError, Result};

/// Bytes of an NCCL unique id (what rank 0 makes and every rank needs).
pub const ID_BYTES: usize = 128;

/// Where a `libnccl.so.2` is looked for when `libnccl.so` cannot be loaded: the loader's path,
/// the usual system folders, and the `nvidia/nccl/lib` folder of a Python's site-packages.
fn candidates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    dirs.extend(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/lib", "/usr/local/cuda/lib64", "/usr/lib"]
            .iter()
            .map(PathBuf::from),
    );
    // Python wheels (PyTorch's nvidia-nccl-cuXX): site-packages/nvidia/nccl/lib.
    for root in ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with("python3") {
                    for sub in ["site-packages", "dist-packages"] {
                        dirs.push(e.path().join(sub).join("nvidia/nccl/lib"));
                    }
                }
            }
        }
    }
    dirs
}

/// The first `libnccl.so.2` (or `libnccl.so`) in the folders `candidates` lists (the loader's
/// path, the system's, Python wheels'), if any.
pub fn find_library() -> Option<PathBuf> {
    find_in(&candidates())
}

/// The first `libnccl.so` or `libnccl.so.2` in `dirs`, in order.
pub fn find_in(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().flat_map(|d| [d.join("libnccl.so"), d.join("libnccl.so.2")]).find(|p| p.is_file())
}

/// Whether NCCL can be loaded; the error says what was looked for and, where a
/// `libnccl.so.2` exists that the loader does not take under cudarc's names, how to link it.
pub fn available() -> Result<()> {
    if unsafe { ns::is_culib_present() } {
        return Ok(());
    }
    let why = match find_library() {
        Some(p) => format!(
            "`libnccl.so` is not on the loader's path, but {} is: link it as libnccl.so in a \
             folder on LD_LIBRARY_PATH",
            p.display()
        ),
        None => "no libnccl.so or libnccl.so.2 on LD_LIBRARY_PATH, in the system's library folders or in \
                 a Python's nvidia/nccl/lib (pip install nvidia-nccl-cu13 puts one there)"
            .into(),
    };
    Err(CudaError::Library { lib: "NCCL", why })
}

/// The folder holding a `libnccl.so` that loads `lib` (what [`find_library`] found): `lib`'s
/// own where that is its name, else `root/nccl-lib` with a link made there (atomically; kept
/// where it already points at `lib`), for a launcher to put first on its rank processes'
/// `LD_LIBRARY_PATH`.
pub fn link_dir_for(lib: &Path, root: &Path) -> Result<PathBuf> {
    if lib.file_name().is_some_and(|n| n == "libnccl.so") {
        return Ok(lib.parent().map(Path::to_path_buf).unwrap_or_default());
    }
    let dir = root.join("nccl-lib");
    let link = dir.join("libnccl.so");
    let io = |e: std::io::Error| CudaError::usage(format!("linking {} at {}: {e}", lib.display(), link.display()));
    std::fs::create_dir_all(&dir).map_err(io)?;
    if std::fs::read_link(&link).ok().as_deref() != Some(lib) {
        let tmp = dir.join(format!(".libnccl.so.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(lib, &tmp).map_err(io)?;
        std::fs::rename(&tmp, &link).map_err(io)?;
    }
    Ok(dir)
}

fn nccl_err(what: &str, e: nr::NcclError) -> CudaError {
    CudaError::Driver { what: format!("NCCL {what}"), err: format!("{e:?}") }
}

/// A new NCCL unique id (rank 0 makes it; the launcher hands it to the other ranks).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    available()?;
    let id = nr::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// The NCCL version as a number (`22805` for 2.28.5).
pub fn version() -> Result<i32> {
    available()?;
    nr::get_nccl_version().map_err(|e| nccl_err("ncclGetVersion", e))
}

/// One rank's communicator over `world` ranks.
pub struct Comm {
    raw: ns::ncclComm_t,
    pub world: usize,
    pub rank: usize,
}

// The communicator is only read (its handle passed to NCCL) by the thread that launches the
// step; NCCL communicators may move between threads.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Joins the communicator of `id` as `rank` of `world` on `dev` (every rank calls this; it
    /// returns once all have).
    pub fn new(dev: &Device, id: &[u8; ID_BYTES], world: usize, rank: usize) -> Result<Comm> {
        available()?;
        if world == 0 || rank >= world {
            return Err(CudaError::usage(format!("NCCL: rank {rank} is not one of world {world}'s ranks")));
        }
        dev.bind()?;
        let uid = ns::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut raw = std::ptr::null_mut();
        unsafe { nr::comm_init_rank(&mut raw, world as i32, uid, rank as i32) }
            .map_err(|e| nccl_err(&format!("ncclCommInitRank (rank {rank} of {world})"), e))?;
        Ok(Comm { raw, world, rank })
    }

    /// Makes this the process's communicator, which every collective launches on (replacing
    /// any earlier one).
    pub fn install(self) -> Arc<Comm> {
        let comm = Arc::new(self);
        *INSTALLED.lock().unwrap_or_else(|e| e.into_inner()) = Some(comm.clone());
        comm
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Errors here cannot be reported; the rank is letting the communicator go.
        unsafe {
            let _ = nr::comm_destroy(self.raw);
        }
    }
}

/// The process's communicator ([`Comm::install`]).
static INSTALLED: Mutex<Option<Arc<Comm>>> = Mutex::new(None);

/// The communicator installed in this process, if any.
pub fn comm() -> Option<Arc<Comm>> {
    INSTALLED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// One rank of one: a new unique id and the communicator of a world of one, installed (what a
/// one-rank data-parallel step on `dev` needs).
pub fn install_single(dev: &Device) -> Result<Arc<Comm>> {
    Ok(Comm::new(dev, &unique_id()?, 1, 0)?.install())
}

/// NCCL's type for a float dtype.
fn nccl_type(dtype: DType) -> Option<ns::ncclDataType_t> {
    Some(match dtype {
        DType::F32 => ns::ncclDataType_t::ncclFloat32,
        DType::F64 => ns::ncclDataType_t::ncclFloat64,
        DType::F16 => ns::ncclDataType_t::ncclFloat16,
        DType::BF16 => ns::ncclDataType_t::ncclBfloat16,
        _ => return None,
    })
}

/// What one collective node launches: the op over `count` elements of its operand.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    pub op: CollectiveOp,
    pub world: usize,
    pub rank: usize,
    pub dtype: DType,
    /// Elements of the operand.
    pub count: usize,
    /// NCCL's name for `dtype`.
    nccl_dtype: ns::ncclDataType_t,
}

impl Collective {
    /// Checks what the launch will need (a type NCCL sums): at prepare time, so a trace with
    /// a collective NCCL cannot run is refused before its first step.
    pub fn new(op: CollectiveOp, world: usize, rank: usize, dtype: DType, count: usize) -> Result<Collective> {
        let nccl_dtype = nccl_type(dtype)
            .ok_or_else(|| CudaError::Unsupported(format!("{} of {} values through NCCL", op.name(), dtype.name())))?;
        Ok(Collective { op, world, rank, dtype, count, nccl_dtype })
    }

    /// Enqueues the collective from `src` into `dst` on `dev`'s stream.
    ///
    /// # Safety
    /// `src` and `dst` must be device buffers of the operand's and the result's sizes.
    pub unsafe fn launch(&self, dev: &Device, src: u64, dst: u64) -> Result<()> {
        unsafe { self.launch_on(dev.stream(), src, dst) }
    }

    /// [`Collective::launch`] on `stream` (a stream of `dev`'s context: the side stream of a
    /// collective that overlaps the backward).
    ///
    /// # Safety
    /// As [`Collective::launch`]; `stream` must be a live stream of the communicator's device.
    pub unsafe fn launch_on(&self, stream: cudarc::driver::sys::CUstream, src: u64, dst: u64) -> Result<()> {
        let name = self.op.name();
        let comm = comm().ok_or_else(|| {
            CudaError::usage(format!(
                "op `{name}` (rank {} of {}): this process has no NCCL communicator (`nccl::Comm::install`; \
                 `rumble train --data-parallel` installs one for a world of one)",
                self.rank, self.world
            ))
        })?;
        if (comm.world, comm.rank) != (self.world, self.rank) {
            return Err(CudaError::usage(format!(
                "op `{name}` was traced for rank {} of {}, but this process is rank {} of {}",
                self.rank, self.world, comm.rank, comm.world
            )));
        }
        let dt = self.nccl_dtype;
        let (send, recv) = (src as *const std::ffi::c_void, dst as *mut std::ffi::c_void);
        let stream = stream as ns::cudaStream_t;
        let sum = ns::ncclRedOp_t::ncclSum;
        let r = unsafe {
            match self.op {
                CollectiveOp::AllReduce => nr::all_reduce(send, recv, self.count, dt, sum, comm.raw, stream),
                CollectiveOp::ReduceScatter => {
                    nr::reduce_scatter(send, recv, self.count / self.world, dt, sum, comm.raw, stream)
                }
                CollectiveOp::AllGather => nr::all_gather(send, recv, self.count, dt, comm.raw, stream),
            }
        };
        r.map(|_| ()).map_err(|e| nccl_err(&format!("{name} of {} {} values", self.count, self.dtype.name()), e))
    }
}
