//! Matmul time on the GPU, per shape: rumble's path (the algorithm `matmul_tune` chose among
//! cuBLASLt's candidates and cuBLAS's classic gemm) beside cuBLAS's classic
//! `cublasGemmStridedBatchedEx` alone with a 32 MiB workspace (its own heuristic, what PyTorch
//! calls for a plain f32 matmul), both exact f32 unless `RUMBLE_CUDA_TF32=1`.
//!
//! The default shapes are seed-llama's (2048 tokens, width 3200, MLP 8640, vocab 32000), each
//! projection alone and fused with its siblings (q|k|v: 9600 rows, gate|up: 17280), so the
//! table shows what one wider matmul buys over several narrow ones. `RUMBLE_MM_SHAPES` takes
//! other shapes: `m,n,k[,t][,dtype]` separated by `;`, where `t` is `nt` (B transposed, a linear
//! layer's forward), `nn` or `tn` (A transposed); dtype `f32` (default) or `bf16`.
//! `RUMBLE_MM_ITERS` sets the timed iterations (default 20). Without a GPU it prints
//! "skipped: no CUDA device".

use cudarc::driver::{result as drv, sys as dsys};
use rumble_core::ir::DType;
use rumble_cuda::Device;
use rumble_cuda::matmul::MatmulKey;
use rumble_cuda::memory::DeviceBuffer;

fn default_shapes() -> &'static str {
    "2048,3200,3200,nt;2048,9600,3200,nt;2048,8640,3200,nt;2048,17280,3200,nt;2048,3200,8640,nt;\
     2048,32000,3200,nt;2048,3200,3200,nn;2048,3200,9600,nn;2048,3200,8640,nn;2048,3200,17280,nn;\
     3200,3200,2048,tn;9600,3200,2048,tn;8640,3200,2048,tn;17280,3200,2048,tn;3200,8640,2048,tn"
}

fn parse(spec: &str) -> Vec<MatmulKey> {
    spec.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let f: Vec<&str> = s.split(',').map(str::trim).collect();
            let num =
                |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or_else(|| panic!("bad shape {s:?}"));
            let t = f.get(3).copied().unwrap_or("nt");
            let dtype = match f.get(4).copied().unwrap_or("f32") {
                "bf16" => DType::BF16,
                _ => DType::F32,
            };
            MatmulKey {
                dtype,
                out: dtype,
                ta: t.starts_with('t'),
                tb: t.ends_with('t'),
                batch: 1,
                m: num(0),
                n: num(1),
                k: num(2),
                row_addend: false,
            }
        })
        .collect()
}

/// Mean milliseconds of `f` over `iters` runs after two warm-ups (CUDA events).
fn time(dev: &Device, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    f();
    let e0 = drv::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).expect("event");
    let e1 = drv::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).expect("event");
    unsafe { drv::event::record(e0, dev.stream()) }.expect("record");
    for _ in 0..iters {
        f();
    }
    unsafe { drv::event::record(e1, dev.stream()) }.expect("record");
    dev.synchronize().expect("sync");
    let ms = unsafe { drv::event::elapsed(e0, e1) }.expect("elapsed") as f64 / iters as f64;
    unsafe {
        let _ = drv::event::destroy(e0);
        let _ = drv::event::destroy(e1);
    }
    ms
}

fn main() {
    if !rumble_cuda::device::available() {
        println!("skipped: no CUDA device");
        return;
    }
    let dev = Device::new(0).expect("device");
    let iters: usize = std::env::var("RUMBLE_MM_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let spec = std::env::var("RUMBLE_MM_SHAPES").unwrap_or_else(|_| default_shapes().to_string());
    let keys = parse(&spec);
    let tf32 = dev.knobs().tf32;
    let legacy_ws =
        DeviceBuffer::new(&dev, rumble_cuda::matmul::max_workspace(&dev.knobs()), "cublas workspace").expect("alloc");
    println!("matmul (row-major m x n x k), ms and TFLOP/s; {iters} iterations; tf32={tf32}");
    println!(
        "{:<28} {:>9} {:>7} {:>9} {:>7} {:>7}  tuned choice",
        "shape", "tuned ms", "TF/s", "cublas ms", "TF/s", "ws MB"
    );
    for key in keys {
        let el = key.dtype.size_in_bytes();
        let (m, n, k) = (key.m as usize, key.n as usize, key.k as usize);
        let a = DeviceBuffer::new(&dev, m * k * el, "a").expect("alloc");
        let b = DeviceBuffer::new(&dev, k * n * el, "b").expect("alloc");
        let c = DeviceBuffer::new(&dev, m * n * el, "c").expect("alloc");
        for (buf, len) in [(&a, m * k * el), (&b, k * n * el)] {
            unsafe { drv::memset_d8_sync(buf.ptr, 0x3c, len) }.expect("memset");
        }
        let ws_bytes = dev.matmul_workspace(&key).expect("matmul plan");
        let ws = DeviceBuffer::new(&dev, ws_bytes.max(256), "ws").expect("alloc");
        let lt_ms = time(&dev, iters, || {
            unsafe { dev.matmul(&key, [a.ptr, b.ptr, c.ptr, ws.ptr], ws_bytes, 0.0) }.expect("matmul")
        });
        let legacy_ms = time(&dev, iters, || {
            unsafe { dev.matmul_classic(&key, [a.ptr, b.ptr, c.ptr, legacy_ws.ptr], legacy_ws.bytes, 0.0) }
                .expect("classic cuBLAS matmul")
        });
        let chosen = dev.matmul_algorithm(&key).expect("matmul plan");
        let tf = |ms: f64| 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
        let t = format!("{}{}", if key.ta { 't' } else { 'n' }, if key.tb { 't' } else { 'n' });
        let name = format!("{m}x{n}x{k} {t} {}", key.dtype);
        println!(
            "{name:<28} {lt_ms:>9.3} {:>7.1} {legacy_ms:>9.3} {:>7.1} {:>7.1}  {chosen}",
            tf(lt_ms),
            tf(legacy_ms),
            ws_bytes as f64 / (1 << 20) as f64
        );
    }
}
