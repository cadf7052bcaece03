//! NVRTC: CUDA C source -> machine code (CUBIN) for the device's own architecture
//! (`--gpu-architecture=sm_90` on an H200), loaded as a module. Each distinct source is compiled
//! once per process (kept in [`Device`]'s module cache) and once per machine (CUBINs cached on
//! disk under `$RUMBLE_CUDA_CACHE`, else `$XDG_CACHE_HOME/rumble/cuda` or
//! `~/.cache/rumble/cuda`; set `RUMBLE_CUDA_CACHE=off` to skip the disk).

use std::collections::HashMap;
use std::ffi::CString;
use std::hash::Hasher;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys};
use cudarc::nvrtc::{result as nv, sys as nvsys};

use crate::device::Device;
use crate::error::{CudaError, DriverContext, Result};

/// A loaded module and the functions looked up in it so far.
pub struct Module {
    pub(crate) module: sys::CUmodule,
    functions: Mutex<HashMap<String, Func>>,
    pub name: String,
}

/// A kernel ready to launch (a plain handle: valid while its device lives).
#[derive(Clone, Copy, Debug)]
pub struct Func(pub(crate) sys::CUfunction);
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    pub fn function(&self, kernel: &str) -> Result<Func> {
        let mut fns = self.functions.lock().map_err(|_| CudaError::usage("module cache poisoned"))?;
        if let Some(f) = fns.get(kernel) {
            return Ok(*f);
        }
        let cname = CString::new(kernel).map_err(|_| CudaError::usage(format!("bad kernel name {kernel:?}")))?;
        let f = unsafe { drv::module::get_function(self.module, cname) }
            .ctx(|| format!("cuModuleGetFunction `{kernel}` in module `{}`", self.name))?;
        fns.insert(kernel.to_string(), Func(f));
        Ok(Func(f))
    }
}

/// Compile options for a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Options {
    /// Allow contracting `a * b + c` into one fused multiply-add (off for elementwise code, so a
    /// fused chain rounds exactly as the ops would one by one).
    pub fmad: bool,
}

/// FNV-1a of `parts`, each ended by a 0xff byte: a 64-bit hash for cache keys that is stable
/// across builds, unlike std's hasher.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for p in parts {
        h.write(p);
        h.write_u8(0xff);
    }
    h.finish()
}

pub(crate) fn cache_dir() -> Option<PathBuf> {
    match std::env::var("RUMBLE_CUDA_CACHE") {
        Ok(v) if v == "off" => return None,
        Ok(v) if !v.is_empty() => return Some(PathBuf::from(v)),
        _ => {}
    }
    if let Ok(x) = std::env::var("XDG_CACHE_HOME")
        && !x.is_empty()
    {
        return Some(PathBuf::from(x).join("rumble/cuda"));
    }
    std::env::var("HOME").ok().map(|h| PathBuf::from(h).join(".cache/rumble/cuda"))
}

fn nvrtc_version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    let _ = unsafe { nvsys::nvrtcVersion(&mut a, &mut b) };
    (a, b)
}

/// NVRTC options for `arch` (e.g. `sm_90`).
fn nvrtc_options(arch: &str, opts: Options) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    options.push(format!("--fmad={}", opts.fmad));
    if std::env::var("RUMBLE_CUDA_LINEINFO").is_ok_and(|v| v == "1") {
        options.push("--generate-line-info".into());
    }
    options
}

/// True when NVRTC can be loaded (no GPU needed to compile).
pub fn nvrtc_available() -> bool {
    std::panic::catch_unwind(|| unsafe { nvsys::is_culib_present() }).unwrap_or(false)
}

/// The CUBIN of `source` for `arch`: from the disk cache, or compiled (and cached).
/// Returns the bytes and the cache key.
fn cached_cubin(arch: &str, name: &str, source: &str, opts: Options) -> Result<(Vec<u8>, String)> {
    let (ma, mi) = nvrtc_version();
    let options = nvrtc_options(arch, opts);
    let key = format!(
        "{:016x}",
        fnv1a(&[source.as_bytes(), options.join(" ").as_bytes(), format!("nvrtc{ma}.{mi}").as_bytes()])
    );
    let dir = cache_dir();
    let path = dir.as_ref().map(|d| d.join(format!("{name}-{key}.cubin")));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok((bytes, key));
    }
    let bin = nvrtc(arch, name, source, &options)?;
    if let (Some(d), Some(p)) = (&dir, &path) {
        // A cache that cannot be written only costs a recompile next time.
        let _ = std::fs::create_dir_all(d);
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &bin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok((bin, key))
}

impl Device {
    /// The module compiled from `source` (named `name` in errors), compiling and loading it
    /// on first use.
    pub fn module(&self, name: &str, source: &str, opts: Options) -> Result<Arc<Module>> {
        let arch = self.arch.clone();
        self.module_on(&arch, name, source, opts)
    }

    /// [`Device::module`] compiled for `arch` instead of the device's own architecture (e.g.
    /// `sm_90a`: the device's, with its architecture-specific features such as `wgmma`).
    pub fn module_on(&self, arch: &str, name: &str, source: &str, opts: Options) -> Result<Arc<Module>> {
        let mkey = format!("{:016x}{}{arch}", fnv1a(&[source.as_bytes()]), opts.fmad);
        if let Some(m) = self.modules.lock().map_err(|_| CudaError::usage("module cache poisoned"))?.get(&mkey) {
            return Ok(m.clone());
        }
        let (cubin, _) = cached_cubin(arch, name, source, opts)?;
        self.bind()?;
        let module =
            unsafe { drv::module::load_data(cubin.as_ptr() as *const _) }.ctx(|| format!("loading module `{name}`"))?;
        let m = Arc::new(Module { module, functions: Mutex::new(HashMap::new()), name: name.to_string() });
        self.modules.lock().map_err(|_| CudaError::usage("module cache poisoned"))?.insert(mkey, m.clone());
        Ok(m)
    }
}

/// Compiles `source` to a CUBIN for `arch` with NVRTC alone (no device needed).
pub fn compile_cubin(arch: &str, name: &str, source: &str, opts: Options) -> Result<Vec<u8>> {
    if !nvrtc_available() {
        return Err(CudaError::Library { lib: "libnvrtc", why: "not found on the library path".into() });
    }
    Ok(cached_cubin(arch, name, source, opts)?.0)
}

fn nvrtc(arch: &str, name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    let err =
        |e: String, log: String| CudaError::Compile { kernel: name.to_string(), arch: arch.to_string(), err: e, log };
    let src = CString::new(source).map_err(|_| err("source holds a NUL byte".into(), String::new()))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| err("bad name".into(), String::new()))?;
    let prog = nv::create_program(&src, Some(&cname)).map_err(|e| err(e.to_string(), String::new()))?;
    let compiled = unsafe { nv::compile_program(prog, options) };
    let log = unsafe { nv::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let out = match compiled {
        Err(e) => Err(err(e.to_string(), log)),
        Ok(()) => unsafe {
            let mut size = 0usize;
            nvsys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| err(e.to_string(), log.clone()))?;
            let mut bin = vec![0u8; size];
            nvsys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut _).result().map_err(|e| err(e.to_string(), log))?;
            Ok(bin)
        },
    };
    let _ = unsafe { nv::destroy_program(prog) };
    out
}
