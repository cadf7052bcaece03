// rumble CUDA prelude: storage types, conversions with the CPU reference's rounding, and the
// status word. Compiled into every module; needs no CUDA header.
typedef unsigned char u8;
typedef long long i64;
struct bf16 { unsigned short x; };
struct f16 { unsigned short x; };
#define F32_INF __int_as_float(0x7f800000)
#define F64_INF __longlong_as_double(0x7ff0000000000000LL)
#define F32_NAN __int_as_float(0x7fc00000)
#define F64_NAN __longlong_as_double(0x7ff8000000000000LL)
__device__ __forceinline__ bool nan_(float x) { return x != x; }
__device__ __forceinline__ bool nan_(double x) { return x != x; }
__device__ __forceinline__ bool inf_(float x) { return x == F32_INF || x == -F32_INF; }

// Programmatic dependent launch (sm_90 on): every kernel's first statement. Where the launch
// let this kernel start while the one before it in the stream still runs (launch.rs,
// `Device::pdl`), `griddepcontrol.wait` holds the block until that kernel has finished and its
// writes are visible, so everything after it reads and writes as if the launches were
// serialised; `launch_dependents` then lets the next such kernel's blocks be scheduled (to
// wait in their turn) while this one runs. On a plain launch both are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Overloads of the math the templates use (plain C names exist for each type).
__device__ __forceinline__ float ex_(float x) { return expf(x); }
__device__ __forceinline__ double ex_(double x) { return exp(x); }
__device__ __forceinline__ float ln_(float x) { return logf(x); }
__device__ __forceinline__ double ln_(double x) { return log(x); }
__device__ __forceinline__ float fmax_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double fmax_(double a, double b) { return fmax(a, b); }

// ---- rounding to storage precision (round to nearest even, NaN stays NaN) ----
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
// f64 -> f32 rounded to odd: a later rounding to bf16/f16 then equals one rounding from f64.
__device__ __forceinline__ float f64_to_f32_odd(double d) {
  if (nan_(d)) return (float)d;
  float f = __double2float_rz(d);
  unsigned u = __float_as_uint(f);
  if ((double)f != d && !inf_(f)) u |= 1u;
  return __uint_as_float(u);
}
// Values of a bf16/f16 node, held in f32.
__device__ __forceinline__ float rnd_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }
__device__ __forceinline__ float rnd_f16(float f) { return f16_bits_to_f32(f32_to_f16_bits(f)); }
// Conversions of a computed value (float, double or integer) to each dtype's value type.
__device__ __forceinline__ float to_f32v(float x) { return x; }
__device__ __forceinline__ float to_f32v(double x) { return (float)x; }
__device__ __forceinline__ float to_f32v(i64 x) { return (float)(double)x; }
__device__ __forceinline__ float to_f32v(int x) { return (float)x; }
__device__ __forceinline__ double to_f64v(float x) { return (double)x; }
__device__ __forceinline__ double to_f64v(double x) { return x; }
__device__ __forceinline__ double to_f64v(i64 x) { return (double)x; }
__device__ __forceinline__ double to_f64v(int x) { return (double)x; }
__device__ __forceinline__ float to_bf16v(float x) { return rnd_bf16(x); }
__device__ __forceinline__ float to_bf16v(double x) { return rnd_bf16(f64_to_f32_odd(x)); }
__device__ __forceinline__ float to_bf16v(i64 x) { return to_bf16v((double)x); }
__device__ __forceinline__ float to_bf16v(int x) { return rnd_bf16((float)x); }
__device__ __forceinline__ float to_f16v(float x) { return rnd_f16(x); }
__device__ __forceinline__ float to_f16v(double x) { return rnd_f16(f64_to_f32_odd(x)); }
__device__ __forceinline__ float to_f16v(i64 x) { return to_f16v((double)x); }
__device__ __forceinline__ float to_f16v(int x) { return rnd_f16((float)x); }
// Float -> integer truncates toward zero, saturating, NaN -> 0 (PTX cvt.rzi semantics).
__device__ __forceinline__ i64 to_i64v(float x) { return (i64)x; }
__device__ __forceinline__ i64 to_i64v(double x) { return (i64)x; }
__device__ __forceinline__ i64 to_i64v(i64 x) { return x; }
__device__ __forceinline__ i64 to_i64v(int x) { return (i64)x; }
__device__ __forceinline__ i64 to_i32v(float x) { return (i64)(int)(i64)x; }
__device__ __forceinline__ i64 to_i32v(double x) { return (i64)(int)(i64)x; }
__device__ __forceinline__ i64 to_i32v(i64 x) { return (i64)(int)x; }
__device__ __forceinline__ i64 to_i32v(int x) { return (i64)x; }
__device__ __forceinline__ int to_boolv(float x) { return x != 0.0f; }
__device__ __forceinline__ int to_boolv(double x) { return x != 0.0; }
__device__ __forceinline__ int to_boolv(i64 x) { return x != 0; }
__device__ __forceinline__ int to_boolv(int x) { return x != 0; }

// ---- loads and stores of storage types ----
__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ double ld(double v) { return v; }
__device__ __forceinline__ float ld(bf16 v) { return bf16_bits_to_f32(v.x); }
__device__ __forceinline__ float ld(f16 v) { return f16_bits_to_f32(v.x); }
__device__ __forceinline__ i64 ld(int v) { return (i64)v; }
__device__ __forceinline__ i64 ld(i64 v) { return v; }
__device__ __forceinline__ int ld(u8 v) { return v != 0; }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(double* p, double v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { bf16 b; b.x = f32_to_bf16_bits(v); *p = b; }
__device__ __forceinline__ void st(f16* p, float v) { f16 h; h.x = f32_to_f16_bits(v); *p = h; }
__device__ __forceinline__ void st(int* p, i64 v) { *p = (int)v; }
__device__ __forceinline__ void st(i64* p, i64 v) { *p = v; }
__device__ __forceinline__ void st(u8* p, int v) { *p = (u8)(v != 0); }

// EW_VEC consecutive elements moved as one run of 16-byte (or 8-byte) accesses: the generated
// elementwise kernels' vector path. `p` is aligned to the run's size, rounded down to 16 bytes.
#define EW_VEC 8
template <typename T> __device__ __forceinline__ void ld_run(T (&r)[EW_VEC], const T* p) {
  constexpr int B = sizeof(T) * EW_VEC;
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int c = 0; c < B / 16; ++c) reinterpret_cast<uint4*>(r)[c] = reinterpret_cast<const uint4*>(p)[c];
  } else {
    static_assert(B % 8 == 0, "run of at least 8 bytes");
#pragma unroll
    for (int c = 0; c < B / 8; ++c) reinterpret_cast<uint2*>(r)[c] = reinterpret_cast<const uint2*>(p)[c];
  }
}
template <typename T> __device__ __forceinline__ void st_run(T* p, const T (&r)[EW_VEC]) {
  constexpr int B = sizeof(T) * EW_VEC;
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int c = 0; c < B / 16; ++c) reinterpret_cast<uint4*>(p)[c] = reinterpret_cast<const uint4*>(r)[c];
  } else {
#pragma unroll
    for (int c = 0; c < B / 8; ++c) reinterpret_cast<uint2*>(p)[c] = reinterpret_cast<const uint2*>(r)[c];
  }
}
__device__ __forceinline__ bool ew_aligned(const void* p) { return ((unsigned long long)p & 15) == 0; }

// The arithmetic type of a storage type: f32 for f32/bf16/f16, f64 for f64.
template <typename T> struct Acc { typedef float t; };
template <> struct Acc<double> { typedef double t; };
template <typename T> __device__ __forceinline__ typename Acc<T>::t ldf(T v) { return ld(v); }
// Store from the arithmetic type, rounding once.
__device__ __forceinline__ void stf(float* p, float v) { *p = v; }
__device__ __forceinline__ void stf(double* p, double v) { *p = v; }
__device__ __forceinline__ void stf(bf16* p, float v) { st(p, v); }
__device__ __forceinline__ void stf(f16* p, float v) { st(p, v); }
// Four consecutive values from f32, rounding each once; p is aligned to four elements.
__device__ __forceinline__ void st4(float* p, float a, float b, float c, float d) {
  float4 f;
  f.x = a;
  f.y = b;
  f.z = c;
  f.w = d;
  *reinterpret_cast<float4*>(p) = f;
}
__device__ __forceinline__ void st4(bf16* p, float a, float b, float c, float d) {
  uint2 u;
  u.x = (unsigned)f32_to_bf16_bits(a) | ((unsigned)f32_to_bf16_bits(b) << 16);
  u.y = (unsigned)f32_to_bf16_bits(c) | ((unsigned)f32_to_bf16_bits(d) << 16);
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void st4(f16* p, float a, float b, float c, float d) {
  uint2 u;
  u.x = (unsigned)f32_to_f16_bits(a) | ((unsigned)f32_to_f16_bits(b) << 16);
  u.y = (unsigned)f32_to_f16_bits(c) | ((unsigned)f32_to_f16_bits(d) << 16);
  *reinterpret_cast<uint2*>(p) = u;
}

// ---- the status word: the first failing kernel writes its tag, a code and a value ----
__device__ __forceinline__ void report(int* status, int tag, int code, i64 v) {
  if (atomicCAS(status, 0, tag) == 0) {
    status[1] = code;
    status[2] = (int)(v & 0xffffffff);
    status[3] = (int)(v >> 32);
  }
}

// Index helpers: up to 8 dims, passed by value.
#define MAXR 8
struct Strides { i64 dims[MAXR]; i64 in[MAXR]; i64 out[MAXR]; int rank; };
// The input offset of flat output index i under a broadcast (s.in holds 0 on broadcast axes).
__device__ __forceinline__ i64 bidx(i64 i, const Strides& s) {
  i64 off = 0;
  for (int k = s.rank - 1; k >= 0; --k) {
    off += (i % s.dims[k]) * s.in[k];
    i /= s.dims[k];
  }
  return off;
}

// RoPE's inverse frequencies (RopeScaling::inv_freq in rumble-core: plain or rescaled, one
// table for every backend), passed by value to the rope kernels of rows.cu and decode.cu
// (recipe::rope_freqs packs it): head sizes up to 2 * ROPE_MAX_HALF.
#define ROPE_MAX_HALF 256
struct RopeFreqs { float inv[ROPE_MAX_HALF]; };
// Copies the first `half` frequencies into the block's shared `inv`: a warp reading 32
// different parameter words would be served one word at a time.
__device__ __forceinline__ void stage_rope_freqs(float* inv, const RopeFreqs& f, i64 half) {
  for (i64 j = threadIdx.x; j < half; j += blockDim.x) inv[j] = f.inv[j];
  __syncthreads();
}

// Fixed-order block reductions (deterministic): every warp reduces by shuffles, then warp 0
// reduces the warps' partials. `buf` holds 32 values.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_max(double v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// v summed (or, MAX, maximised) over the block; every thread gets the result.
template <bool MAX, typename A> __device__ __forceinline__ A block_reduce(A v, A* buf) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();
  if (lane == 0) buf[w] = v;
  __syncthreads();
  A r = (threadIdx.x < nw) ? buf[threadIdx.x] : MAX ? (A)(-F64_INF) : (A)0;
  if (w == 0) r = MAX ? warp_max(r) : warp_sum(r);
  if (threadIdx.x == 0) buf[0] = r;
  __syncthreads();
  r = buf[0];
  __syncthreads();
  return r;
}
template <typename A> __device__ __forceinline__ A block_sum(A v, A* buf) { return block_reduce<false>(v, buf); }
template <typename A> __device__ __forceinline__ A block_max(A v, A* buf) { return block_reduce<true>(v, buf); }
