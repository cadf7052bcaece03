// A CPU stand-in for the few CUDA features the flash-attention kernels use, so their indexing,
// masking, tiling and synchronisation can be checked without a GPU: every CUDA thread is a
// std::thread, __syncthreads is a block barrier, and the warp-level operations (shuffles,
// ldmatrix, mma.sync m16n8k16, cp.async) exchange values through per-warp slots between two
// warp barriers, following the PTX ISA's fragment layouts. Shared memory starts as NaN bytes
// (0xff) so a read of a never-written element poisons the result.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#define FLASH_EMU 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
// Blocks run one launch at a time here: nothing to wait for (src/kernels/prelude.cuh).
inline void pdl_enter() {}
#define __align__(n)

typedef long long i64;
typedef unsigned u32;
struct bf16 { unsigned short x; };
struct f16 { unsigned short x; };
struct Dim3 { unsigned x = 0, y = 0, z = 0; };

namespace emu {
struct Block {
  std::vector<unsigned char> smem;
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  // Per-warp exchange slots: 32 lanes x 8 words.
  std::vector<uint64_t> slots;
};
struct Thread {
  Dim3 tidx, bidx, gdim, bdim;
  Block* blk = nullptr;
};
inline thread_local Thread tl;

inline void warp_sync() { tl.blk->warp_bar[tl.tidx.x / 32]->arrive_and_wait(); }
inline uint64_t* wslot(int lane) { return &tl.blk->slots[((tl.tidx.x / 32) * 32 + lane) * 8]; }

// Runs `kernel` on a grid of blocks of `threads` threads with `smem` bytes of shared memory.
inline void launch(Dim3 grid, int threads, size_t smem, const std::function<void()>& kernel) {
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      Block blk;
      blk.smem.assign(smem + 16, 0xff);
      blk.bar = std::make_unique<std::barrier<>>(threads);
      for (int w = 0; w < (threads + 31) / 32; ++w) blk.warp_bar.push_back(std::make_unique<std::barrier<>>(32));
      blk.slots.assign(((threads + 31) / 32) * 32 * 8, 0);
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          tl.tidx = {(unsigned)t, 0, 0};
          tl.bidx = {bx, by, 0};
          tl.gdim = grid;
          tl.bdim = {(unsigned)threads, 1, 1};
          tl.blk = &blk;
          kernel();
        });
      for (auto& t : ts) t.join();
    }
}
}  // namespace emu

#define threadIdx (emu::tl.tidx)
#define blockIdx (emu::tl.bidx)
#define gridDim (emu::tl.gdim)
#define blockDim (emu::tl.bdim)
#define FLASH_SMEM(name) unsigned char* name = emu::tl.blk->smem.data()
#define FLASH_SYNC() emu::tl.blk->bar->arrive_and_wait()

static inline float u2f(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline u32 f2u(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
#define F32_INF (std::numeric_limits<float>::infinity())

// bf16 / f16 conversions, round to nearest even.
inline unsigned short f32_to_bf16_bits(float f) {
  u32 u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
inline float bf16_bits_to_f32(unsigned short b) { return u2f(((u32)b) << 16); }
inline unsigned short f32_to_f16_bits(float f) { _Float16 h = (_Float16)f; unsigned short b; std::memcpy(&b, &h, 2); return b; }
inline float f16_bits_to_f32(unsigned short b) { _Float16 h; std::memcpy(&h, &b, 2); return (float)h; }
inline float ld(float v) { return v; }
inline float ld(bf16 v) { return bf16_bits_to_f32(v.x); }
inline float ld(f16 v) { return f16_bits_to_f32(v.x); }
inline void st(float* p, float v) { *p = v; }
inline void st(bf16* p, float v) { p->x = f32_to_bf16_bits(v); }
inline void st(f16* p, float v) { p->x = f32_to_f16_bits(v); }

inline float ex2(float x) { return std::exp2(x); }

inline float shfl_xor(float v, int m) {
  int lane = threadIdx.x & 31;
  emu::wslot(lane)[0] = f2u(v);
  emu::warp_sync();
  float r = u2f((u32)emu::wslot(lane ^ m)[0]);
  emu::warp_sync();
  return r;
}

inline bool warp_any(bool p) {
  int lane = threadIdx.x & 31;
  emu::wslot(lane)[0] = p;
  emu::warp_sync();
  bool r = false;
  for (int i = 0; i < 32; ++i) r |= emu::wslot(i)[0] != 0;
  emu::warp_sync();
  return r;
}

inline void ldsm_impl(u32* r, const void* p, bool trans) {
  int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  emu::wslot(lane)[0] = (uint64_t)(uintptr_t)p;
  emu::warp_sync();
  for (int i = 0; i < 4; ++i) {
    auto row = [&](int rr) { return (const unsigned short*)(uintptr_t)emu::wslot(8 * i + rr)[0]; };
    unsigned short lo, hi;
    if (!trans) {
      lo = row(g)[2 * t];
      hi = row(g)[2 * t + 1];
    } else {
      lo = row(2 * t)[g];
      hi = row(2 * t + 1)[g];
    }
    r[i] = (u32)lo | ((u32)hi << 16);
  }
  emu::warp_sync();
}
inline void ldsm_x4(u32* r, const void* p) { ldsm_impl(r, p, false); }
inline void ldsm_x4_t(u32* r, const void* p) { ldsm_impl(r, p, true); }

inline void cp_async16(void* dst, const void* src, int src_bytes) {
  if (((uintptr_t)dst & 15) || ((uintptr_t)src & 15)) { fprintf(stderr, "cp.async misaligned\n"); abort(); }
  std::memset(dst, 0, 16);
  std::memcpy(dst, src, src_bytes);
}
// Predicated: `ok` false writes zeros and does not touch `src` (which may be out of bounds).
inline void cp_async16_if(void* dst, const void* src, bool ok) {
  if (((uintptr_t)dst & 15) || (ok && ((uintptr_t)src & 15))) { fprintf(stderr, "cp.async misaligned\n"); abort(); }
  std::memset(dst, 0, 16);
  if (ok) std::memcpy(dst, src, 16);
}
inline void cp_commit() {}
template <int N> inline void cp_wait() {}

#if FLASH_F16
inline float half_val(unsigned short b) { return f16_bits_to_f32(b); }
inline u32 pack2(float lo, float hi) { return (u32)f32_to_f16_bits(lo) | ((u32)f32_to_f16_bits(hi) << 16); }
#else
inline float half_val(unsigned short b) { return bf16_bits_to_f32(b); }
inline u32 pack2(float lo, float hi) { return (u32)f32_to_bf16_bits(lo) | ((u32)f32_to_bf16_bits(hi) << 16); }
#endif

// c[4] += A (16x16, fragments a[4] of the 32 lanes) * B (16x8, fragments b0, b1).
inline void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint64_t* s = emu::wslot(lane);
  for (int i = 0; i < 4; ++i) s[i] = a[i];
  s[4] = b0;
  s[5] = b1;
  emu::warp_sync();
  auto half = [](uint64_t w, int h) { return half_val((unsigned short)(((u32)w) >> (16 * h))); };
  for (int e = 0; e < 4; ++e) {
    int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double acc = 0;
    for (int k = 0; k < 16; ++k) {
      double av = half(emu::wslot((row % 8) * 4 + (k % 8) / 2)[(row / 8) + 2 * (k / 8)], k % 2);
      double bv = half(emu::wslot(col * 4 + (k % 8) / 2)[4 + k / 8], k % 2);
      acc += av * bv;
    }
    c[e] = (float)((double)c[e] + acc);
  }
  emu::warp_sync();
}

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
