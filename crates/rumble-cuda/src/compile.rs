//! NVRTC: CUDA C source -> machine code (CUBIN) for the device's own architecture
//! (`--gpu-architecture=sm_90` on an H200), loaded as a module. Each distinct source is compiled
//! once per process (kept in [`Device`]'s module cache) and once per machine (CUBINs cached on
//! disk under `$RUMBLE_CUDA_CACHE`, else `$XDG_CACHE_HOME/rumble/cuda` or
//! `~/.cache/rumble/cuda`; set `RUMBLE_CUDA_CACHE=off` to skip the disk: [`Knobs::cache`]).

use std::collections::HashMap;
use std::ffi::CString;
use std::hash::Hasher;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as drv, sys};
use cudarc::nvrtc::{result as nv, sys as nvsys};

use crate::device::{Device, DeviceCache};
use crate::error::{CudaError, DriverContext, Result};
use crate::knobs::Knobs;

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

impl Func {
    /// Lets launches of this kernel on `dev` use `bytes` of dynamic shared memory (over the
    /// default 48 KB a block takes without asking; `what` names it in the error).
    pub(crate) fn allow_shared_memory(&self, dev: &Device, bytes: usize, what: &str) -> Result<()> {
        if bytes <= 48 * 1024 {
            return Ok(());
        }
        dev.bind()?;
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        unsafe { drv::function::set_function_attribute(self.0, attr, bytes as i32) }
            .ctx(|| format!("allowing {bytes} bytes of shared memory to {what}"))
    }

    /// The kernel's own (static) shared memory, bytes.
    pub(crate) fn static_shared_memory(&self) -> Result<usize> {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES;
        let v = unsafe { drv::function::get_function_attribute(self.0, attr) }
            .ctx(|| "the static shared memory of a kernel".into())?;
        Ok(v.max(0) as usize)
    }
}

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

/// The modules a device has loaded, by source hash, options and architecture.
#[derive(Default)]
struct ModuleCache(HashMap<String, Arc<Module>>);

impl DeviceCache for ModuleCache {
    fn release(&mut self) {
        for (_, m) in self.0.drain() {
            let _ = unsafe { drv::module::unload(m.module) };
        }
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

fn nvrtc_version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    let _ = unsafe { nvsys::nvrtcVersion(&mut a, &mut b) };
    (a, b)
}

/// NVRTC options for `arch` (e.g. `sm_90`).
fn nvrtc_options(arch: &str, opts: Options, knobs: &Knobs) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    options.push(format!("--fmad={}", opts.fmad));
    if knobs.lineinfo {
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
    let knobs = crate::knobs::process()?;
    let options = nvrtc_options(arch, opts, knobs);
    let key = format!(
        "{:016x}",
        fnv1a(&[source.as_bytes(), options.join(" ").as_bytes(), format!("nvrtc{ma}.{mi}").as_bytes()])
    );
    let dir = knobs.cache.clone();
    let path = dir.as_ref().map(|d| d.join(format!("{name}-{key}.cubin")));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok((bytes, key));
    }
    let bin = nvrtc(arch, name, source, &options)?.0;
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
        let cache = self.cache::<ModuleCache>();
        if let Some(m) = cache.lock().map_err(|_| CudaError::usage("module cache poisoned"))?.0.get(&mkey) {
            return Ok(m.clone());
        }
        // Every kernel is launched as a programmatic dependent launch (launch::kernel): one that
        // does not wait for the kernel ahead of it would race with it.
        let unguarded = crate::kernels::kernels_without_pdl_enter(source);
        if !unguarded.is_empty() {
            return Err(CudaError::usage(format!(
                "module `{name}`: kernels {unguarded:?} do not open with pdl_enter() (kernels/prelude.cuh)"
            )));
        }
        let (cubin, _) = cached_cubin(arch, name, source, opts)?;
        self.bind()?;
        let module =
            unsafe { drv::module::load_data(cubin.as_ptr() as *const _) }.ctx(|| format!("loading module `{name}`"))?;
        let m = Arc::new(Module { module, functions: Mutex::new(HashMap::new()), name: name.to_string() });
        cache.lock().map_err(|_| CudaError::usage("module cache poisoned"))?.0.insert(mkey, m.clone());
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

/// What ptxas reports of `source` compiled for `arch` (`-v`: registers, stack, spills of each
/// kernel), compiled now (no cache).
pub fn ptxas_report(arch: &str, name: &str, source: &str, opts: Options) -> Result<String> {
    if !nvrtc_available() {
        return Err(CudaError::Library { lib: "libnvrtc", why: "not found on the library path".into() });
    }
    let mut options = nvrtc_options(arch, opts, crate::knobs::process()?);
    options.push("--ptxas-options=-v".into());
    Ok(nvrtc(arch, name, source, &options)?.1)
}

/// The CUBIN of `source` and NVRTC's log.
fn nvrtc(arch: &str, name: &str, source: &str, options: &[String]) -> Result<(Vec<u8>, String)> {
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
            nvsys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut _)
                .result()
                .map_err(|e| err(e.to_string(), log.clone()))?;
            Ok((bin, log))
        },
    };
    let _ = unsafe { nv::destroy_program(prog) };
    out
}
