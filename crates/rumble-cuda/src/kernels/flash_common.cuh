// What both flash-attention kernel files (flash_attn.cu: bf16 / f16 on the tensor cores;
// flash_fma.cu: f32 with FMA) share: the device primitives they call (cp.async, ex2, shuffles;
// the CPU emulator of tests/flash_emu/ defines its own stand-ins instead), the `Dims` blob every
// attention kernel takes, a forward / dQ block's queries and key tiles (`q_block`), and the
// causal block pairing. src/flash.rs puts this file after the
// prelude and the module's `#define`s and before the kernel file.

#ifndef FLASH_EMU
typedef unsigned u32;
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared, asynchronously; the bytes past `src_bytes` (0 or 16) are zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
// The same with a predicate: `ok` false writes 16 zeros and reads nothing (so `src` need not
// point anywhere valid): no select of a safe address.
__device__ __forceinline__ void cp_async16_if(void* dst, const void* src, bool ok) {
  asm volatile(
      "{\n .reg .pred p;\n setp.eq.u32 p, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"((u32)ok));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ bool warp_any(bool p) { return __any_sync(0xffffffffu, p); }
#define FLASH_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define FLASH_SYNC() __syncthreads()
#endif  // FLASH_EMU

namespace fa {
// The blob every attention kernel takes (src/flash.rs `dims_blob`): shapes, and the operands'
// layout as element strides (HeadLayout::strides) between heads and between positions of q, o,
// dO, dQ (qhs, qrs) and of k, v, dK, dV (khs, krs): [B, H, T, D] has (T d, d), [B, T, H, D]
// (d, H d); the batch stride is H T d in both. lse and delta are [B, Hq, T] either way.
struct Dims { i64 b, hq, hkv, t, s, d, qhs, qrs, khs, krs; };
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
#define NEG_INF (-F32_INF)

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }
// Offset of position 0 of query head h of batch b (in q, o, dO, dQ), of kv head h of batch b (in
// k, v, dK, dV). (From b and h, which the kernels have: no 64-bit divisions here.)
__device__ __forceinline__ i64 q_at(const Dims& dm, i64 b, i64 h) { return b * dm.hq * dm.t * dm.d + h * dm.qhs; }
__device__ __forceinline__ i64 k_at(const Dims& dm, i64 b, i64 h) { return b * dm.hkv * dm.s * dm.d + h * dm.khs; }
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }
// scale * log2(e) (computed in double, rounded once): scores in log2 units for ex2.
__device__ __forceinline__ float log2_scale(double scale) { return (float)(scale * 1.4426950408889634); }

// The query block of a forward or dQ CTA: ROWS queries from q0 of query head h of batch b (grid
// row bh = b hq + h; block 0 holds the last queries, the longest causal rows, first), `kv` the
// offset of its kv head in k and v (k_at), `ntiles` the tiles of BC keys its queries see.
struct QBlock { i64 q0, bh, b, h, kv; int ntiles; };
template <int ROWS, int BC>
__device__ __forceinline__ QBlock q_block(const Dims& dm, int causal, i64 blk) {
  QBlock x;
  x.q0 = ((dm.t + ROWS - 1) / ROWS - 1 - blk) * ROWS;
  x.bh = blockIdx.y;
  x.b = x.bh / dm.hq;
  x.h = x.bh % dm.hq;
  x.kv = k_at(dm, x.b, x.h / (dm.hq / dm.hkv));
  const i64 kend = causal ? min64(dm.s, x.q0 + ROWS) : dm.s;
  x.ntiles = (int)((kend + BC - 1) / BC);
  return x;
}

// A forward block over a KV cache (flash_fwd_cached, `pos` not null): its queries are cache
// positions pos[b] .. pos[b] + t - 1 of its sequence, which see the keys up to their own
// position and below s: `off` = pos[b] shifts every causal comparison, `s` = the keys its
// sequence has, `ntiles` the tiles of BC keys its queries see. Without `pos`: no shift, all s.
struct CachedKeys { i64 off, s; int ntiles; };
template <int ROWS, int BC>
__device__ __forceinline__ CachedKeys cached_keys(const Dims& dm, const i64* pos, const QBlock& qb) {
  if (!pos) return {0, dm.s, qb.ntiles};
  // Past the cache every key is visible, before -t none: clamped there, the same keys (and
  // 32-bit positions for fwd_wg).
  const i64 p = pos[qb.b], off = p < -dm.t ? -dm.t : min64(p, dm.s);
  const i64 s = min64(off + dm.t, dm.s);
  const i64 kend = qb.q0 + ROWS + off < 0 ? 0 : min64(s, qb.q0 + ROWS + off);
  return {off, s, (int)((kend + BC - 1) / BC)};
}

// ---- which blocks a CTA runs. Causal work grows with a block's index (the longest query rows
// first, the keys seen by the most queries first), so on a paired grid (gridDim.x < n * per:
// src/flash.rs `grid_columns` asks for one while half the CTAs still fill the device) CTA x runs
// block x and then block n - 1 - x, and every CTA gets about the same work (the middle block of
// an odd n runs once). `per` neighbouring grid columns share one block index (dK/dV's head-dim
// chunks). `each_block` calls `run(block)` for the CTA's one or two blocks. ----
__device__ __forceinline__ int passes(i64 n, int per) {
  const i64 x = (i64)blockIdx.x / per;
  return (i64)gridDim.x < n * per && n - 1 - x != x ? 2 : 1;
}
__device__ __forceinline__ i64 block_of(i64 n, int per, int pass) {
  const i64 x = (i64)blockIdx.x / per, c = (i64)blockIdx.x % per;
  return (pass == 0 ? x : n - 1 - x) * per + c;
}
template <class F>
__device__ __forceinline__ void each_block(i64 n, int per, F run) {
  const int np = passes(n, per);
#pragma unroll 1
  for (int p = 0; p < np; ++p) {
    if (p) FLASH_SYNC();  // the first block's last reads of shared memory are done
    run(block_of(n, per, p));
  }
}
}  // namespace fa
