//! One GPU: its libraries loaded at run time, its primary context, the one stream every
//! executor launches on, the cuBLASLt handle, the compiled-kernel cache and the device status
//! word that kernels use to report bad data (an id out of range) without a host round trip.
//!
//! Nothing here panics when CUDA is absent: [`Device::new`] checks each library first and
//! returns [`CudaError::NoDevice`] or [`CudaError::Library`].

use std::any::{Any, TypeId};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::{result as drv, sys};

use crate::error::{CudaError, DriverContext, Result};
use crate::knobs::Knobs;

/// Block counters a device holds beside its status word (`Device::counters_ptr`).
pub(crate) const COUNTERS: usize = 1 << 16;
/// Where the counters start in the status allocation.
const COUNTERS_AT: usize = 256;

/// A CUDA device ready to run kernels.
pub struct Device {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub capability: (i32, i32),
    /// `sm_90` for an H100/H200: NVRTC compiles for exactly this.
    pub arch: String,
    pub multiprocessors: usize,
    pub total_memory: usize,
    cu_device: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    blas: ltsys::cublasLtHandle_t,
    /// cuBLAS's classic handle (one more matmul candidate, see `matmul`): created on first use,
    /// `None` inside when libcublas cannot be loaded.
    classic: std::sync::OnceLock<Option<ClassicHandle>>,
    /// Four `int`s on the device: `[0]` is the first failing node's tag (node index + 1),
    /// `[1]` a reason code, `[2..4]` the offending value (low, high words).
    status: sys::CUdeviceptr,
    /// The caches of the layers above (compiled modules, matmul plans): [`Device::cache`].
    caches: Mutex<Vec<CacheSlot>>,
    /// Op names (as the IR's text form prints them) whose nodes run on the host through the CPU
    /// reference: `RUMBLE_HOST_OPS=name,name` at start, [`Device::set_host_ops`] later.
    host_ops: Mutex<Vec<String>>,
    /// The environment's settings ([`crate::knobs::process`] at start, [`Device::set_knobs`] later).
    knobs: Mutex<Knobs>,
    /// Whether rumble's kernels launch with programmatic dependent launch: `Knobs::pdl` on a
    /// device of compute capability 9.0 or later (read at every launch, so not under the lock).
    pdl: std::sync::atomic::AtomicBool,
}

/// A cache that a layer above keeps per device (compiled modules, matmul plans), one per type:
/// [`Device::cache`]. `release` frees what it holds on the device; it runs when the device is
/// dropped, with its context current.
pub(crate) trait DeviceCache: Default + Send + 'static {
    fn release(&mut self);
}

/// One cache: its type, the `Mutex<T>` itself, and how to release it without knowing `T`.
type CacheSlot = (TypeId, Arc<dyn Any + Send + Sync>, fn(&(dyn Any + Send + Sync)));

fn release_slot<T: DeviceCache>(cache: &(dyn Any + Send + Sync)) {
    if let Some(Ok(mut c)) = cache.downcast_ref::<Mutex<T>>().map(|m| m.lock()) {
        c.release();
    }
}

/// A cuBLAS (classic API) handle bound to the device's stream.
pub(crate) struct ClassicHandle(pub(crate) cudarc::cublas::sys::cublasHandle_t);

// The raw handles are owned by this struct and only used after `bind()` makes the context
// current on the calling thread; the mutable caches sit behind mutexes.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

/// True when a CUDA driver library can be loaded and reports at least one device.
pub fn available() -> bool {
    Device::new(0).is_ok()
}

fn lib_present(lib: &'static str) -> Result<()> {
    let present = std::panic::catch_unwind(|| unsafe {
        match lib {
            "libcuda" => sys::is_culib_present(),
            "libnvrtc" => cudarc::nvrtc::sys::is_culib_present(),
            _ => ltsys::is_culib_present(),
        }
    })
    .unwrap_or(false);
    if present {
        Ok(())
    } else {
        Err(CudaError::Library { lib, why: "not found on the library path (is the CUDA toolkit installed?)".into() })
    }
}

impl Device {
    /// Opens device `ordinal`. Errors (never panics) when CUDA, NVRTC or cuBLASLt cannot be
    /// loaded or no device exists.
    pub fn new(ordinal: usize) -> Result<Arc<Device>> {
        lib_present("libcuda").map_err(|e| CudaError::NoDevice(e.to_string()))?;
        lib_present("libnvrtc")?;
        lib_present("libcublasLt")?;
        // cudarc panics on a missing symbol (an old driver): turn that into an error too.
        match std::panic::catch_unwind(|| Self::open(ordinal)) {
            Ok(r) => r.map(Arc::new),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(CudaError::NoDevice(format!("CUDA libraries failed to load: {msg}")))
            }
        }
    }

    /// How many devices the driver shows this process (after `CUDA_VISIBLE_DEVICES`), without
    /// making a context on any (a launcher's check holds no device memory).
    pub fn count() -> Result<usize> {
        lib_present("libcuda").map_err(|e| CudaError::NoDevice(e.to_string()))?;
        let counted = std::panic::catch_unwind(|| -> Result<usize> {
            drv::init().map_err(|e| CudaError::NoDevice(format!("cuInit: {}", crate::error::describe(&e))))?;
            Ok(drv::device::get_count().ctx(|| "cuDeviceGetCount".into())?.max(0) as usize)
        });
        counted.unwrap_or_else(|_| Err(CudaError::NoDevice("CUDA failed to load".into())))
    }

    fn open(ordinal: usize) -> Result<Device> {
        let knobs = crate::knobs::process()?.clone();
        drv::init().map_err(|e| CudaError::NoDevice(format!("cuInit: {}", crate::error::describe(&e))))?;
        let count = drv::device::get_count().ctx(|| "cuDeviceGetCount".into())?;
        if count <= 0 {
            return Err(CudaError::NoDevice("the driver reports no devices".into()));
        }
        if ordinal >= count as usize {
            return Err(CudaError::NoDevice(format!("device {ordinal} asked for, {count} present")));
        }
        let cu_device = drv::device::get(ordinal as i32).ctx(|| "cuDeviceGet".into())?;
        let ctx = unsafe { drv::primary_ctx::retain(cu_device) }.ctx(|| "cuDevicePrimaryCtxRetain".into())?;
        unsafe { drv::ctx::set_current(ctx) }.ctx(|| "cuCtxSetCurrent".into())?;
        let attr = |a: sys::CUdevice_attribute| unsafe { drv::device::get_attribute(cu_device, a) };
        use sys::CUdevice_attribute as A;
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).ctx(|| "cuDeviceGetAttribute".into())?;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).ctx(|| "cuDeviceGetAttribute".into())?;
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).ctx(|| "cuDeviceGetAttribute".into())?;
        let name = drv::device::get_name(cu_device).ctx(|| "cuDeviceGetName".into())?;
        let total_memory = unsafe { drv::device::total_mem(cu_device) }.ctx(|| "cuDeviceTotalMem".into())?;
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).ctx(|| "cuStreamCreate".into())?;
        let blas = lt::create_handle().map_err(|e| CudaError::Blas {
            op: "-".into(),
            what: "cublasLtCreate".into(),
            err: e.to_string(),
        })?;
        // The status word, then the block counters (`Device::counters_ptr`), all zero.
        let bytes = COUNTERS_AT + 4 * COUNTERS;
        let status = unsafe { drv::malloc_sync(bytes) }.ctx(|| "allocating the status word".into())?;
        // On the stream (non-blocking: a legacy-stream memset might land after its kernels).
        unsafe { drv::memset_d8_async(status, 0, bytes, stream) }.ctx(|| "clearing the status word".into())?;
        unsafe { drv::stream::synchronize(stream) }.ctx(|| "cuStreamSynchronize".into())?;
        Ok(Device {
            ordinal,
            name,
            capability: (major, minor),
            arch: format!("sm_{major}{minor}"),
            multiprocessors: sms as usize,
            total_memory,
            cu_device,
            ctx,
            stream,
            blas,
            classic: std::sync::OnceLock::new(),
            status,
            caches: Mutex::new(Vec::new()),
            host_ops: Mutex::new(knobs.host_ops.clone()),
            pdl: std::sync::atomic::AtomicBool::new(knobs.pdl && major >= 9),
            knobs: Mutex::new(knobs),
        })
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        unsafe { drv::ctx::set_current(self.ctx) }.ctx(|| "cuCtxSetCurrent".into())
    }

    /// The device's cache of type `T` (made empty on first use). Keyed by type, so this module
    /// depends on none of the layers that keep one.
    pub(crate) fn cache<T: DeviceCache>(&self) -> Arc<Mutex<T>> {
        let mut slots = self.caches.lock().unwrap_or_else(|e| e.into_inner());
        let id = TypeId::of::<T>();
        let any = match slots.iter().find(|s| s.0 == id) {
            Some(s) => s.1.clone(),
            None => {
                let any: Arc<dyn Any + Send + Sync> = Arc::new(Mutex::new(T::default()));
                slots.push((id, any.clone(), release_slot::<T>));
                any
            }
        };
        // Stored under T's id as a Mutex<T> just above: the downcast cannot fail.
        any.downcast::<Mutex<T>>().unwrap_or_else(|_| unreachable!("device cache keyed by type"))
    }

    /// The settings programs prepared now take ([`Knobs`]: the environment's, unless
    /// [`Device::set_knobs`] changed them).
    pub fn knobs(&self) -> Knobs {
        self.knobs.lock().map(|k| k.clone()).unwrap_or_default()
    }

    /// Replaces the settings for the programs prepared from now on (e.g. a test turning the
    /// wgmma flash kernels off). Host ops stay [`Device::set_host_ops`]'s.
    pub fn set_knobs(&self, knobs: Knobs) {
        self.pdl.store(knobs.pdl && self.capability.0 >= 9, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut k) = self.knobs.lock() {
            *k = knobs;
        }
    }

    /// Makes nodes of these ops run on the host (the CPU reference) in programs prepared from
    /// now on; `&[]` for none. Graphed programs split their graphs around such nodes.
    pub fn set_host_ops(&self, names: &[&str]) {
        if let Ok(mut h) = self.host_ops.lock() {
            *h = names.iter().map(|n| n.to_string()).collect();
        }
    }

    /// True if nodes of op `name` are to run on the host.
    pub fn is_host_op(&self, name: &str) -> bool {
        self.host_ops.lock().map(|h| h.iter().any(|n| n == name)).unwrap_or(false)
    }

    /// Whether rumble's kernels launch with programmatic dependent launch (`launch::kernel`).
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    pub(crate) fn blas(&self) -> ltsys::cublasLtHandle_t {
        self.blas
    }

    /// The classic cuBLAS handle on the device's stream, or `None` when libcublas is missing
    /// or its handle cannot be made (then matmuls use cuBLASLt only).
    pub(crate) fn classic_blas(&self) -> Option<cudarc::cublas::sys::cublasHandle_t> {
        use cudarc::cublas::{result as cb, sys as cbsys};
        self.classic
            .get_or_init(|| {
                let present = std::panic::catch_unwind(|| unsafe { cbsys::is_culib_present() }).unwrap_or(false);
                if !present {
                    return None;
                }
                let h = cb::create_handle().ok()?;
                match unsafe { cb::set_stream(h, self.stream as cbsys::cudaStream_t) } {
                    Ok(()) => Some(ClassicHandle(h)),
                    Err(_) => {
                        let _ = unsafe { cb::destroy_handle(h) };
                        None
                    }
                }
            })
            .as_ref()
            .map(|h| h.0)
    }

    pub(crate) fn status_ptr(&self) -> sys::CUdeviceptr {
        self.status
    }

    /// [`COUNTERS`] 32-bit counters, zero between kernels: a kernel whose blocks count their
    /// arrivals in them (the last to arrive finishing the work of all) sets its counters back to
    /// zero before it ends. Kernels on the device's stream run one after another, so they share
    /// these.
    pub(crate) fn counters_ptr(&self) -> sys::CUdeviceptr {
        self.status + COUNTERS_AT as u64
    }

    /// `(free, total)` bytes of device memory now (cuMemGetInfo).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        drv::mem_get_info().ctx(|| "cuMemGetInfo".into())
    }

    pub fn synchronize(&self) -> Result<()> {
        unsafe { drv::stream::synchronize(self.stream) }.ctx(|| "cuStreamSynchronize".into())
    }

    /// Waits for the stream and turns a nonzero status word into an error naming the node.
    /// `names` maps a node tag (index + 1) to its op name.
    pub fn check_status(&self, name_of: impl Fn(usize) -> String) -> Result<()> {
        self.synchronize()?;
        let mut s = [0i32; 4];
        unsafe { drv::memcpy_dtoh_sync(&mut s, self.status) }.ctx(|| "reading the status word".into())?;
        if s[0] == 0 {
            return Ok(());
        }
        unsafe { drv::memset_d8_async(self.status, 0, 16, self.stream) }.ctx(|| "clearing the status word".into())?;
        let node = s[0] as usize - 1;
        let value = (s[2] as u32 as i64) | ((s[3] as i64) << 32);
        let msg = match s[1] {
            1 => format!("index {value} out of range"),
            2 => "integer division by zero".to_string(),
            3 => format!("target {value} out of range (and not the ignore index)"),
            c => format!("error code {c}"),
        };
        Err(CudaError::DeviceData { op: name_of(node), node, msg })
    }

    pub fn cu_device(&self) -> sys::CUdevice {
        self.cu_device
    }

    /// The most shared memory a block may opt into (static and dynamic together), bytes.
    pub fn shared_memory_optin(&self) -> Result<usize> {
        let a = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        let v = unsafe { cudarc::driver::result::device::get_attribute(self.cu_device, a) }
            .ctx(|| "shared memory per block".into())?;
        Ok(v.max(0) as usize)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Errors here cannot be reported; the process is letting the device go.
        unsafe {
            let _ = drv::ctx::set_current(self.ctx);
            let _ = drv::stream::synchronize(self.stream);
            let slots = self.caches.lock().map(|mut s| std::mem::take(&mut *s)).unwrap_or_default();
            for (_, cache, release) in slots.iter().rev() {
                release(cache.as_ref());
            }
            let _ = lt::destroy_handle(self.blas);
            if let Some(Some(h)) = self.classic.get() {
                let _ = cudarc::cublas::result::destroy_handle(h.0);
            }
            let _ = drv::free_sync(self.status);
            let _ = drv::stream::destroy(self.stream);
            let _ = drv::primary_ctx::release(self.cu_device);
        }
    }
}
