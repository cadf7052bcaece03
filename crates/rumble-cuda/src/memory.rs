//! Device and pinned host memory: plain buffers (the planned executors' arena and persistent
//! region), the eager executor's caching allocator, and its statistics.

use std::collections::BTreeMap;

use cudarc::driver::{result as drv, sys};

use crate::device::Device;
use crate::error::{CudaError, DriverContext, Result};

/// Rounding of every caching-allocator block (as PyTorch's allocator rounds to 512 bytes).
pub const BLOCK_ROUND: usize = 512;

/// One device allocation, freed on drop.
pub struct DeviceBuffer {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1), or says how much was needed and free.
    pub fn new(dev: &Device, bytes: usize, what: &str) -> Result<Self> {
        dev.bind()?;
        match unsafe { drv::malloc_sync(bytes.max(1)) } {
            Ok(ptr) => Ok(DeviceBuffer { ptr, bytes }),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                let free = dev.mem_info().map(|m| m.0).unwrap_or(0);
                Err(CudaError::OutOfMemory { what: what.to_string(), needed: bytes, free })
            }
            Err(e) => Err(e).ctx(|| format!("cuMemAlloc of {bytes} bytes for {what}")),
        }
    }

    pub fn upload(&self, dev: &Device, offset: usize, data: &[u8]) -> Result<()> {
        if offset + data.len() > self.bytes {
            return Err(CudaError::usage(format!(
                "upload of {} bytes at {offset} overruns a {}-byte buffer",
                data.len(),
                self.bytes
            )));
        }
        upload(dev, self.ptr + offset as u64, data)
    }
}

// The device's stream is non-blocking: it does not wait for work on the legacy default stream,
// where cuMemcpyHtoD and cuMemsetD8 (the "synchronous" calls) run. Those return before the
// device has finished them (a pageable upload once the bytes are staged, a memset at once),
// so a kernel launched next on the stream could read the old bytes. Every copy to the device
// and every memset goes through the two functions below, in the stream's order.

/// Copies `data` to device address `ptr` in the device's stream order and waits for it.
pub fn upload(dev: &Device, ptr: sys::CUdeviceptr, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    dev.bind()?;
    unsafe { drv::memcpy_htod_async(ptr, data, dev.stream()) }.ctx(|| "cuMemcpyHtoDAsync".into())?;
    dev.synchronize()
}

/// Sets `bytes` bytes at device address `ptr` to `byte` in the device's stream order (later
/// work on the stream sees them; the host does not wait).
pub fn fill(dev: &Device, ptr: sys::CUdeviceptr, byte: u8, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    dev.bind()?;
    unsafe { drv::memset_d8_async(ptr, byte, bytes, dev.stream()) }.ctx(|| "cuMemsetD8Async".into())
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        unsafe {
            let _ = drv::free_sync(self.ptr);
        }
    }
}

/// Reads `bytes` bytes at device address `ptr` (synchronising the device's stream first).
pub fn download(dev: &Device, ptr: sys::CUdeviceptr, bytes: usize) -> Result<Vec<u8>> {
    dev.synchronize()?;
    let mut out = vec![0u8; bytes];
    if bytes > 0 {
        unsafe { drv::memcpy_dtoh_sync(&mut out, ptr) }.ctx(|| "cuMemcpyDtoH".into())?;
    }
    Ok(out)
}

/// Page-locked host memory, so copies to and from it can sit inside a CUDA graph.
pub struct PinnedBuffer {
    pub ptr: *mut u8,
    pub bytes: usize,
}

impl PinnedBuffer {
    pub fn new(dev: &Device, bytes: usize) -> Result<Self> {
        dev.bind()?;
        let ptr = unsafe { drv::malloc_host(bytes.max(1), 0) }.ctx(|| format!("cuMemHostAlloc of {bytes} bytes"))?;
        Ok(PinnedBuffer { ptr: ptr as *mut u8, bytes })
    }
    pub fn as_slice(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        unsafe {
            let _ = drv::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}

/// A block handed out by the caching allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub ptr: sys::CUdeviceptr,
    pub size: usize,
}

/// The eager executor's allocator: blocks rounded to 512 bytes, freed blocks cached by size
/// and reused for requests up to twice as small; cached blocks are released when the device
/// runs out. `allocated`/`peak_allocated` count blocks in use (what
/// `torch.cuda.max_memory_allocated` counts); `reserved` counts what is held from the driver.
#[derive(Default)]
pub struct CachingAllocator {
    free: BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    pub allocated: usize,
    pub peak_allocated: usize,
    pub reserved: usize,
    pub peak_reserved: usize,
}

impl CachingAllocator {
    pub fn alloc(&mut self, dev: &Device, bytes: usize, what: &str) -> Result<Block> {
        let size = bytes.max(1).div_ceil(BLOCK_ROUND) * BLOCK_ROUND;
        let found = self.free.range(size..=size * 2).next().map(|(&s, _)| s);
        let block = match found {
            Some(s) => {
                let list = self.free.get_mut(&s).expect("key just found");
                let ptr = list.pop().expect("lists are never left empty");
                if list.is_empty() {
                    self.free.remove(&s);
                }
                Block { ptr, size: s }
            }
            None => {
                dev.bind()?;
                let ptr = match unsafe { drv::malloc_sync(size) } {
                    Ok(p) => p,
                    Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                        self.release_cached(dev)?;
                        unsafe { drv::malloc_sync(size) }.map_err(|_| CudaError::OutOfMemory {
                            what: what.to_string(),
                            needed: size,
                            free: dev.mem_info().map(|m| m.0).unwrap_or(0),
                        })?
                    }
                    Err(e) => return Err(e).ctx(|| format!("cuMemAlloc of {size} bytes for {what}")),
                };
                self.reserved += size;
                self.peak_reserved = self.peak_reserved.max(self.reserved);
                Block { ptr, size }
            }
        };
        self.allocated += block.size;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        Ok(block)
    }

    /// Returns a block to the cache (the device may still be using it: later work on the same
    /// stream is ordered after earlier work, so reuse is safe).
    pub fn free(&mut self, b: Block) {
        self.allocated -= b.size;
        self.free.entry(b.size).or_default().push(b.ptr);
    }

    /// Frees every cached block back to the driver.
    pub fn release_cached(&mut self, dev: &Device) -> Result<()> {
        dev.synchronize()?;
        for (size, ptrs) in std::mem::take(&mut self.free) {
            for p in ptrs {
                unsafe { drv::free_sync(p) }.ctx(|| "cuMemFree".into())?;
                self.reserved -= size;
            }
        }
        Ok(())
    }

    pub fn reset_peak(&mut self) {
        self.peak_allocated = self.allocated;
        self.peak_reserved = self.reserved;
    }
}
