// Stand-ins for the prelude pieces the fixed kernel files use (src/kernels/prelude.cuh), on
// top of emu.h, for the emulators of decode.cu (tests/decode_emu) and gemv.cu (tests/gemv_emu):
// static shared memory (blocks run one after another, so a function's static is its block's
// shared memory), the block barrier, the arithmetic type and its loads and stores, warp
// shuffles and the warp sum, the exponentials, CUDA's 16-byte vector; then the prelude's own 16-byte row access (vec16.cuh).
#pragma once
#include "emu.h"
#define __shared__ static
#define __syncthreads() emu::tl.blk->bar->arrive_and_wait()
template <typename T> struct Acc { typedef float t; };
template <typename T> inline float ldf(T v) { return ld(v); }
inline void stf(float* p, float v) { *p = v; }
inline void stf(bf16* p, float v) { st(p, v); }
inline void stf(f16* p, float v) { st(p, v); }
inline float __shfl_xor_sync(unsigned, float v, int o) { return shfl_xor(v, o); }
inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o);
  return v;
}
inline float __expf(float x) { return std::exp(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float ex_(float x) { return std::exp(x); }
struct alignas(16) uint4 { unsigned x, y, z, w; };
#include "../../src/kernels/vec16.cuh"
