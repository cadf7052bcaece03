// Flash attention on the tensor cores (bf16 / f16 operands, f32 accumulation), forward and
// backward, for grouped-query heads and any head size up to 256 (zero-padded to FDP, a multiple
// of 16). Tiles of Q, K, V (and dO) live in shared memory; scores and probabilities only in
// registers; the forward saves o and the log-sum-exp, the backward recomputes P from them.
//
// One module per (FT, FDP, FCFG): the including source defines FT (bf16 or f16), FDP and FCFG,
// the tiling configuration (the table at the top of namespace `fa`). Warp-level building blocks
// (mma.sync m16n8k16, ldmatrix, cp.async) are wrapped in small functions so that the CPU
// emulator (tests/flash_emu/) can stand in for them.
//
// A warp owns 16 x MT rows of the first operand of each product (MT m-tiles: each fragment of
// the second operand read from shared memory then feeds MT mma). The backward kernels have 4
// warps, the forward FNW. Fragment layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and
// t = lane % 4, an accumulator tile c[4] holds rows (g, g, g+8, g+8) and columns (2t, 2t+1, 2t,
// 2t+1); an A fragment a[4] holds rows g / g+8 and columns 2t..2t+1 / 8+2t..8+2t+1; a B fragment
// b[2] holds k rows 2t..2t+1 and 8+2t..8+2t+1 of column g. Two neighbouring accumulator tiles are
// therefore one A fragment, which is how P (and dS) go from one product to the next without
// leaving registers.
//
// Deterministic: no atomics. The backward runs three kernels, delta = rowsum(dO * O), then dK/dV
// with each block owning a block of keys (looping over the query heads of its group and their
// queries in a fixed order), then dQ with each block owning a block of queries; or, with FDELTA,
// two: dQ (which computes its rows' delta first and stores it), then dK/dV. Where a kv head's
// group of query heads is split over several dK/dV blocks (Split, below), one more kernel adds
// their f32 partial sums in a fixed order.

#ifndef FLASH_EMU
typedef unsigned u32;
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
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
// c += a * b for one 16x8x16 tile; pack2 puts lo in the low half (the lower column).
#if FLASH_F16
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#else
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif
#endif  // FLASH_EMU
#ifndef FWG
#define FWG 0
#endif
#if FWG && defined(FLASH_EMU)
#error "the wgmma kernels (FWG) have no CPU emulation"
#endif
#if !defined(FLASH_EMU)
// ---- Hopper (sm_90a) warpgroup MMA, for the FWG kernels (fwd_wg, bwd_dq_wg): wgmma.mma_async
// m64nNk16 with f32 accumulators, operands from shared memory through matrix descriptors
// (128-byte swizzle) or A from registers; plus the fences it needs. Only compiled where FWG
// (src/flash.rs compiles those modules for sm_90a). ----
#if FWG
typedef unsigned long long u64;
#if FLASH_F16
#define WG_AB "f16.f16"
#else
#define WG_AB "bf16.bf16"
#endif
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// The compiler sees a wgmma's accumulators written when the asm issues it, not when wg_wait0
// returns, so it may move plain register arithmetic on them above the wait (stale values). A
// volatile asm that "rewrites" them after the wait (and before the next issue) pins every use
// after it: volatile asms keep their order. (A guard: the wrong d128 forward of session 7 runs
// 4 and 5 turned out to be a leftover loop, not this.)
template <int N>
__device__ __forceinline__ void wg_hold(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The shared-memory matrix descriptor of the operand at `p`: leading / stride byte offsets,
// 128-byte swizzle (PTX ISA, "Matrix Descriptor Format").
__device__ __forceinline__ u64 wg_desc(const void* p, u32 lbo, u32 sbo) {
  const u64 a = smem_u32(p);
  return ((a & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_ss_n64(float* d, u64 da, u64 db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_rs_n64(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wg_rs_n128(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#endif  // FWG
#endif

namespace fa {
typedef FT T;
// The blob every attention kernel takes: shapes, and the operands' layout as element strides
// (src/flash.rs, HeadLayout::strides) between heads and between positions of q, o, dO, dQ (qhs,
// qrs) and of k, v, dK, dV (khs, krs): [B, H, T, D] has (T d, d), [B, T, H, D] (d, H d); the
// batch stride is H T d in both. lse and delta are [B, Hq, T] either way.
struct Dims { i64 b, hq, hkv, t, s, d, qhs, qrs, khs, krs; };
constexpr int DP = FDP;                      // padded head size
constexpr int LD = DP + 8;                   // smem row stride (elements): ldmatrix rows hit distinct banks

// ---- the named tiling configurations (FCFG; src/flash.rs `Cfg` names them and mirrors the
// launch shapes below, checked by the static_assert at the end of this block) ----
//   0 base: 4-warp forward, 2 m-tiles per warp, 64 (d<=64) / 32 keys per tile; backward with
//           16 keys (dK/dV) / 16 queries (dQ) per warp and a separate delta kernel.
//   1 wide: forward stages of 128 (d<=64) / 64 (d<=128) keys, computed in steps of 64 / 32;
//           dK/dV 32 keys per warp (32-query tiles) for d<=64; dQ 32 queries per warp for
//           d<=128; delta computed inside the dQ kernel.
//   2 deep: the forward of wide; for d<=64 dK/dV with 16-query tiles and dQ with 32-key
//           tiles, for d in (64, 128] the base backward tiles; delta inside the dQ kernel.
//   3 w8:   the backward of wide, with an 8-warp forward (one m-tile per warp for d > 64).
//   4 pair: the fastest of the others per kernel in the H200 sweep: the forward of wide for
//           d<=64, for d in (64, 128] (but 112) 64-key stages taken in one softmax step (PF: half the
//           steps, and each Q fragment read from shared memory feeds 16 mma instead of 8;
//           ptxas spills ~40 bytes, yet 0.50 against 0.57 ms at d128 x seq 4096), base's
//           above; base's dK/dV but with 64-query tiles for d in (64, 128] too (half the tiles
//           and barriers, each K / V fragment read from shared memory feeds 8 mma instead of 4:
//           dK/dV 0.96 against 1.14 ms at d128 x seq 4096); dQ 32 queries per warp (wide's
//           tiles) for d=16 and d in (64, 128], base's dQ otherwise; a separate delta kernel; and the backward computes
//           S and dP in one interleaved loop (mma_abt2_m).
//   5 fa2:  pair, but for d <= 128 the 8-warp dK/dV kernel bwd_dkdv2 (64 keys per block, P and
//           dS through shared memory, warps splitting the head dims for dK += dS^T Q and
//           dV += P^T dO); pair's dK/dV above 128. Opt-in (RUMBLE_FLASH_CFG=fa2).
//   6 pair8: pair with an 8-warp dK/dV block (128 keys: each Q / dO tile loaded into shared
//           memory feeds twice the keys; one block of 8 warps per multiprocessor), and wide's
//           forward (64-key stages in 32-key steps for d in (64, 128]).
//   7 paird: pair with delta computed inside the dQ kernel (FDELTA), which then runs first.
static_assert(FCFG >= 0 && FCFG <= 7, "unknown flash configuration");
constexpr bool PAIR2 = FCFG >= 4;         // S and dP in one interleaved loop
constexpr int C = PAIR2 ? 0 : FCFG;      // pair (and fa2) start from base's tiles
constexpr bool D64 = DP <= 64, D128 = DP <= 128;
constexpr bool PQ2 = PAIR2 && D128 && (DP <= 16 || !D64);                      // pair: wide's dQ tiles
constexpr int FNW = C == 3 ? 8 : 4;                                             // forward warps
constexpr int FMT = !D128 || (C == 3 && !D64) ? 1 : 2;                          // forward m-tiles per warp
constexpr bool FW = C != 0 || FCFG == 6;                                        // wide's forward tiles
// pair's 64-key forward steps (not at d112, where ptxas spills 84 bytes; 36 at d128, none at 80, 96)
constexpr bool PF = FCFG != 6 && PAIR2 && !D64 && D128 && DP != 112;
constexpr int FBC = PF ? 64 : PAIR2 && D64 ? 128 : !FW ? (D64 ? 64 : 32) : D64 ? 128 : D128 ? 64 : 32;  // forward keys per stage
constexpr int FSUB = PF ? 64 : PAIR2 && D64 ? 64 : !FW ? FBC : D64 ? 64 : 32;     // forward keys per softmax step
constexpr int KMT = C != 0 && D64 ? 2 : 1;                                     // dk/dv: 16-key m-tiles per warp
constexpr int BQ = C == 0 ? (D64 || (PAIR2 && D128) ? 64 : 32) : C == 2 && D64 ? 16 : 32;  // dk/dv: queries per tile
constexpr int QMT = PQ2 ? 2 : C == 0 ? 1 : C == 2 ? (D64 ? 2 : 1) : D128 ? 2 : 1;  // dq: 16-query m-tiles per warp
constexpr int BC = PQ2 ? (D64 ? 64 : 32) : C == 0 ? (D128 ? 64 : 32) : C == 2 ? (D64 ? 32 : D128 ? 64 : 32) : D64 ? 64 : 32;  // dq: keys per tile
constexpr int FDELTA = C != 0 || FCFG == 7;                                     // delta inside the dq kernel

constexpr int NT = 128;                      // backward threads per block (4 warps)
constexpr int FNT = 32 * FNW;                // forward threads per block
constexpr int FBR = FNW * 16 * FMT;          // forward: queries per block
constexpr int BR = 4 * 16 * QMT;             // dq: queries per block
constexpr int DKNW = FCFG == 6 ? 8 : 4;      // dk/dv warps (bwd_dkdv)
constexpr int DKNT = 32 * DKNW;              // and threads
constexpr int BK = DKNW * 16 * KMT;          // dk/dv: keys per block
constexpr int DC = DP <= 128 ? DP : 128;     // dk/dv: head dims accumulated per block
// fa2's dK/dV (bwd_dkdv2, d <= 128; see the note above it): 8 warps, 64 keys per block,
// query tiles of 64 (d <= 64) / 32, P^T and dS^T tiles of [64][Q2 + 8] in shared memory.
constexpr bool FA2 = FCFG == 5 && DP <= 128;
constexpr int K2 = 64, Q2 = D64 ? 64 : 32, QW2 = Q2 / 2, LP2 = Q2 + 8;
constexpr int NB2 = DP / 16, NJ2 = (NB2 + 1) / 2;  // 16-column blocks of the head dims; per warp
constexpr int NT2 = 256;
// Launch shape (mirrored by src/flash.rs): rows of the grid's x axis per block, shared bytes.
// FWG (sm_90a, DP 64 or 128): dQ on wgmma (FWGQ below) and, at DP 128 (FWGF), the forward
// (fwd_wg), 128 queries by 256 threads (two warpgroups). (At DP 64 the wgmma forward took 0.34
// ms against mma.sync's 0.32 at seq 4096 on the H200.)
static_assert(!FWG || DP == 64 || DP == 128, "the wgmma kernels take head sizes 64 and 128");
constexpr bool FWGF = FWG && DP == 128;
constexpr int WBM = 128, WBN = 64, WNT = 256;
// FWGQ: dQ on wgmma too (bwd_dq_wg; not with FDELTA), 128 queries by 256 threads.
constexpr bool FWGQ = FWG && !FDELTA;
constexpr int FWD_ROWS = FWGF ? WBM : FBR, DQ_ROWS = FWGQ ? WBM : BR, DKDV_KEYS = FA2 ? K2 : BK,
              NCHUNK = FA2 ? 1 : (DP + DC - 1) / DC;
constexpr int DKDV_NT = FA2 ? NT2 : DKNT;    // dk/dv threads per block
constexpr int SMEM_FWD = FWGF ? (WBM + 4 * WBN) * DP * 2 + 1024 : (FBR + 4 * FBC) * LD * 2;
constexpr int FWD_NT = FWGF ? WNT : FNT;     // forward threads per block
constexpr int SMEM_DQ = FWGQ ? (2 * WBM + 4 * WBN) * DP * 2 + 1024 : (2 * BR + 4 * BC) * LD * 2 + (FDELTA ? BR * 4 : 0);
constexpr int DQ_NT = FWGQ ? WNT : NT;       // dQ threads per block
constexpr int SMEM_DKDV = FA2 ? (2 * K2 + 4 * Q2) * LD * 2 + 2 * K2 * LP2 * 2 + 4 * Q2 * 4
                              : (2 * BK + 4 * BQ) * LD * 2 + 4 * BQ * 4;
static_assert(FBC % FSUB == 0 && BK % BQ == 0 && K2 % Q2 == 0, "tile sizes");
#ifdef FEXPECT
static_assert(FWD_ROWS == FEXPECT_FWD_ROWS && DQ_ROWS == FEXPECT_DQ_ROWS && DKDV_KEYS == FEXPECT_DKDV_KEYS &&
                  NCHUNK == FEXPECT_NCHUNK && SMEM_FWD == FEXPECT_SMEM_FWD && SMEM_DQ == FEXPECT_SMEM_DQ &&
                  SMEM_DKDV == FEXPECT_SMEM_DKDV && DQ_NT == FEXPECT_DQ_THREADS && FWD_NT == FEXPECT_FWD_THREADS && FDELTA == FEXPECT_FUSED_DELTA &&
                  DKDV_NT == FEXPECT_DKDV_THREADS,
              "src/flash.rs Variant::shape disagrees with flash_attn.cu");
#endif
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
#define NEG_INF (-F32_INF)

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }
// Offset of position 0 of query head h of batch b (in q, o, dO, dQ), of kv head h of batch b (in
// k, v, dK, dV). (From b and h, which the kernels have: no 64-bit divisions here.)
__device__ __forceinline__ i64 q_at(const Dims& dm, i64 b, i64 h) { return b * dm.hq * dm.t * dm.d + h * dm.qhs; }
__device__ __forceinline__ i64 k_at(const Dims& dm, i64 b, i64 h) { return b * dm.hkv * dm.s * dm.d + h * dm.khs; }


// Rows [0, ROWS) of rows of d elements, rs apart from `g` (the tile's first row), into a
// [ROWS][LD] shared tile by NTH threads; rows at or past `valid` and columns at or past d are
// zeros. `vec`: 16-byte cp.async (d % 8 == 0, so rs, a multiple of d, too, and aligned
// pointers), else element by element (synchronous). The vector path is unrolled with 32-bit
// offsets inside the tile (src/flash.rs keeps ROWS x rs under 2^31): a thread's chunks are
// fixed columns of rows NTH / CH apart, a few instructions each (the generic 64-bit loop it
// replaced took ~30 per 16 bytes, a quarter of the forward's instructions at d128).
template <int NTH, int ROWS>
__device__ __forceinline__ void load_rows(T* sm, const T* g, int valid, int d, int rs, bool vec) {
  constexpr int CH = DP / 8;
  if (vec && NTH % CH == 0) {
    // A thread's chunks: column cc of rows r0, r0 + RS, ... : one pointer, advanced by RS rows.
    constexpr int RS = NTH / CH;
    const int r0 = threadIdx.x / CH, cc = threadIdx.x % CH;
    const bool colok = cc * 8 < d;
    const T* p = g + (unsigned)(r0 * rs + cc * 8);
    const long long step = (long long)RS * rs;
    T* q = sm + r0 * LD + cc * 8;
#pragma unroll
    for (int i = 0; i < (ROWS + RS - 1) / RS; ++i) {
      if (ROWS % RS == 0 || r0 + i * RS < ROWS) cp_async16_if(q + i * RS * LD, p, colok && r0 + i * RS < valid);
      p += step;
    }
  } else if (vec) {
#pragma unroll
    for (int i = 0; i < (ROWS * CH + NTH - 1) / NTH; ++i) {
      const int c = threadIdx.x + i * NTH, r = c / CH, cc = c % CH;
      if ((ROWS * CH) % NTH == 0 || c < ROWS * CH) {
        const bool ok = r < valid && cc * 8 < d;
        cp_async16(sm + r * LD + cc * 8, ok ? g + r * rs + cc * 8 : g, ok ? 16 : 0);
      }
    }
  } else {
    for (int e = threadIdx.x; e < ROWS * DP; e += NTH) {
      const int r = e / DP, c = e % DP;
      T x;
      x.x = 0;
      if (r < valid && c < d) x = g[r * rs + c];
      sm[r * LD + c] = x;
    }
  }
}
// Rows [row0, row0 + ROWS) of rows rs apart from `g`, `valid` of them from row0 on (any sign
// or size): load_rows from the tile's first row.
template <int NTH, int ROWS>
__device__ __forceinline__ void load_tile(T* sm, const T* g, i64 row0, i64 valid, i64 d, i64 rs, bool vec) {
  const int v = valid < 0 ? 0 : valid > ROWS ? ROWS : (int)valid;
  load_rows<NTH, ROWS>(sm, v > 0 ? g + row0 * rs : g, v, (int)d, (int)rs, vec);
}

// Lane offsets (in elements, into a [*][LD] tile) of ldmatrix x4 fetches:
// A operand 16x16 at (0,0) / B^T operand (rows are n) for two n-tiles / B via .trans (rows are k).
__device__ __forceinline__ int a_off(int lane) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8; }
__device__ __forceinline__ int bt_off(int lane) { return ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int b_off(int lane) { return a_off(lane); }

// acc[MT][N/8][4] += A * B^T: A = MT m-tiles of 16 x DP (rows a + mt * 16 * LD), B^T = N rows
// of `b`. Each B fragment loaded from shared memory feeds MT mma instructions. (Keeping the
// forward's Q fragments in registers instead does not fit: the forward already uses ~255.)
template <int MT, int N>
__device__ __forceinline__ void mma_abt_m(float (*acc)[N / 8][4], const T* a, const T* b, int lane) {
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    u32 fa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm_x4(fa[mt], a + mt * 16 * LD + a_off(lane) + kk * 16);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      u32 fb[4];
      ldsm_x4(fb, b + np * 16 * LD + bt_off(lane) + kk * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(acc[mt][2 * np], fa[mt], fb[0], fb[1]);
        mma16816(acc[mt][2 * np + 1], fa[mt], fb[2], fb[3]);
      }
    }
  }
}
// Two products at once, x += A1 * B1^T and y += A2 * B2^T (the backward's S and dP share their
// shapes and the reduction over the head dims): interleaved, so each kk step issues twice as
// many independent mma and the chains of accumulation into one tile wait on each other less.
template <int MT, int N>
__device__ __forceinline__ void mma_abt2_m(float (*x)[N / 8][4], const T* a1, const T* b1, float (*y)[N / 8][4],
                                           const T* a2, const T* b2, int lane) {
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    u32 f1[MT][4], f2[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      ldsm_x4(f1[mt], a1 + mt * 16 * LD + a_off(lane) + kk * 16);
      ldsm_x4(f2[mt], a2 + mt * 16 * LD + a_off(lane) + kk * 16);
    }
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      u32 g1[4], g2[4];
      ldsm_x4(g1, b1 + np * 16 * LD + bt_off(lane) + kk * 16);
      ldsm_x4(g2, b2 + np * 16 * LD + bt_off(lane) + kk * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(x[mt][2 * np], f1[mt], g1[0], g1[1]);
        mma16816(y[mt][2 * np], f2[mt], g2[0], g2[1]);
        mma16816(x[mt][2 * np + 1], f1[mt], g1[2], g1[3]);
        mma16816(y[mt][2 * np + 1], f2[mt], g2[2], g2[3]);
      }
    }
  }
}
// acc[MT][NC/8][4] += P * B: P = MT m-tiles of 16 x K as accumulator tiles p[MT][K/8][4]
// (rounded to T), B = K rows of `b`, columns [c0, c0 + NC) clipped to DP.
template <int MT, int K, int NC>
__device__ __forceinline__ void mma_pb_m(float (*acc)[NC / 8][4], const float (*p)[K / 8][4], const T* b, int c0,
                                         int lane) {
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    u32 fa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      fa[mt][0] = pack2(p[mt][2 * kc][0], p[mt][2 * kc][1]);
      fa[mt][1] = pack2(p[mt][2 * kc][2], p[mt][2 * kc][3]);
      fa[mt][2] = pack2(p[mt][2 * kc + 1][0], p[mt][2 * kc + 1][1]);
      fa[mt][3] = pack2(p[mt][2 * kc + 1][2], p[mt][2 * kc + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < NC / 16; ++np) {
      if (c0 + np * 16 < DP) {
        u32 fb[4];
        ldsm_x4_t(fb, b + kc * 16 * LD + b_off(lane) + c0 + np * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(acc[mt][2 * np], fa[mt], fb[0], fb[1]);
          mma16816(acc[mt][2 * np + 1], fa[mt], fb[2], fb[3]);
        }
      }
    }
  }
}
template <int MT, int N>
__device__ __forceinline__ void zero(float (*x)[N][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < N; ++n) x[mt][n][0] = x[mt][n][1] = x[mt][n][2] = x[mt][n][3] = 0.f;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, shfl_xor(v, 1));
  return fmaxf(v, shfl_xor(v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += shfl_xor(v, 1);
  return v + shfl_xor(v, 2);
}
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// ---- forward: one block per FBR queries of one (batch, query head); each warp FMT x 16 rows ----
// The running row maximum m is kept on the raw scores q.k (their minimum when NEG, a negative
// scale), so each probability is one FFMA and one ex2: p = 2^(s * scale * log2 e - m * |...|).
template <bool NEG>
__device__ __forceinline__ void fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                    T* __restrict__ o, float* __restrict__ lse, Dims dm, double scale, int causal, i64 blk) {
  constexpr int MT = FMT, BR = FBR, BC = FBC, SUB = FSUB, NTH = FNT;
  FLASH_SMEM(smem);
  T* sq = (T*)smem;
  T* sk = sq + BR * LD;      // 2 stages of BC rows
  T* sv = sk + 2 * BC * LD;  // 2 stages of BC rows
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BR - 1) / BR;
  const i64 q0 = (nqb - 1 - blk) * BR;  // block 0: the longest causal rows
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = h / (dm.hq / dm.hkv);  // the kv head, within batch b
  const T* qh = q + q_at(dm, b, h);
  const T* kh = k + k_at(dm, b, kvh);
  const T* vh = v + k_at(dm, b, kvh);
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  const i64 kend = causal ? min64(S, q0 + BR) : S;
  const int ntiles = (int)((kend + BC - 1) / BC);
  const float sl2 = (float)(scale * 1.4426950408889634);
  const float asl2 = NEG ? -sl2 : sl2;
  const float MASKV = NEG ? F32_INF : NEG_INF;     // a masked raw score: never the row's maximum
  const i64 wrow = q0 + w * 16 * MT;                // the warp's first row
  const i64 wlast = wrow + 16 * MT - 1;             // and its last

  load_tile<NTH, BR>(sq, qh, q0, T_ - q0, d, dm.qrs, vec);
  if (ntiles > 0) {
    load_tile<NTH, BC>(sk, kh, 0, S, d, dm.krs, vec);
    load_tile<NTH, BC>(sv, vh, 0, S, d, dm.krs, vec);
  }
  cp_commit();
  float acc[MT][DP / 8][4];
  float m[MT][2], l[MT][2];
  zero<MT, DP / 8>(acc);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = NEG_INF;
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int it = 0; it < ntiles; ++it) {
    const i64 j0 = (i64)it * BC;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_tile<NTH, BC>(sk + st * BC * LD, kh, j0 + BC, S - j0 - BC, d, dm.krs, vec);
      load_tile<NTH, BC>(sv + st * BC * LD, vh, j0 + BC, S - j0 - BC, d, dm.krs, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const T* ks = sk + (it & 1) * BC * LD;
    const T* vs = sv + (it & 1) * BC * LD;
#pragma unroll 1
    for (int sb = 0; sb < BC / SUB; ++sb) {
      const i64 kb0 = j0 + sb * SUB;
      if (kb0 >= S || (causal && kb0 > wlast)) continue;  // no key of this step is visible to the warp
      float s[MT][SUB / 8][4];
      zero<MT, SUB / 8>(s);
      mma_abt_m<MT, SUB>(s, sq + w * 16 * MT * LD, ks + sb * SUB * LD, lane);

      auto softmax = [&](const bool MASK) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const i64 row[2] = {wrow + mt * 16 + g, wrow + mt * 16 + g + 8};
          float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
          for (int n = 0; n < SUB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (MASK) {
                const i64 key = kb0 + n * 8 + 2 * tq + (e & 1);
                if (key >= S || (causal && key > row[e >> 1])) s[mt][n][e] = MASKV;
              }
              mx[e >> 1] = fmaxf(mx[e >> 1], NEG ? -s[mt][n][e] : s[mt][n][e]);
            }
          // The running maximum moves only when some row's maximum grows by more than 2^8
          // (conditional rescaling): until then p = 2^(s - m) < 256 with the old m, harmless in
          // f32 sums and bf16, and the DP/4 multiplications of the accumulator per row are
          // skipped on almost every tile. The warp votes, so its rows take one branch.
          float mnew[2];
          bool grow = false;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mnew[i] = fmaxf(m[mt][i], quad_max(mx[i]));
            grow |= mnew[i] != NEG_INF && (m[mt][i] == NEG_INF || (mnew[i] - m[mt][i]) * asl2 > 8.f);
          }
          if (warp_any(grow)) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const float mu = mnew[i] == NEG_INF ? 0.f : mnew[i];  // nothing visible yet: p stays 0
              const float alpha = m[mt][i] == NEG_INF ? 0.f : ex2((m[mt][i] - mu) * asl2);
              m[mt][i] = mnew[i];
              l[mt][i] *= alpha;
#pragma unroll
              for (int n = 0; n < DP / 8; ++n) {
                acc[mt][n][2 * i] *= alpha;
                acc[mt][n][2 * i + 1] *= alpha;
              }
            }
          }
          float nb[2];  // -(the running maximum) in log2 units
#pragma unroll
          for (int i = 0; i < 2; ++i) nb[i] = m[mt][i] == NEG_INF ? 0.f : -m[mt][i] * asl2;
#pragma unroll
          for (int n = 0; n < SUB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float p = ex2(fmaf(s[mt][n][e], sl2, nb[e >> 1]));
              if (MASK && s[mt][n][e] == MASKV) p = 0.f;  // (also right for a zero scale)
              s[mt][n][e] = p;
              l[mt][e >> 1] += p;
            }
        }
      };
      if (kb0 + SUB > S || (causal && kb0 + SUB - 1 > wrow))
        softmax(true);
      else
        softmax(false);
      mma_pb_m<MT, SUB, DP>(acc, s, vs + sb * SUB * LD, 0, lane);
    }
    FLASH_SYNC();
  }
  cp_wait<0>();

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float lt = quad_sum(l[mt][i]);
      const float inv = lt > 0.f ? 1.f / lt : 0.f;
      const i64 r = wrow + mt * 16 + g + 8 * i;
      if (r < T_) {
        if (tq == 0) lse[bh * T_ + r] = lt > 0.f ? (m[mt][i] * asl2 + log2f(lt)) * LN2 : NEG_INF;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const i64 c = n * 8 + 2 * tq + e;
            if (c < d) st(&o[q_at(dm, b, h) + r * dm.qrs + c], acc[mt][n][2 * i + e] * inv);
          }
      }
    }
}

#if FWG
// ---- forward on Hopper's warpgroup MMA (FWGF: sm_90a, DP 128). A block of 256 threads (two
// warpgroups) owns WBM = 128 queries of one (batch, query head); warpgroup wg its rows 64 wg ..
// +64, warp w of it rows 16 w .. +16. Keys in tiles of WBN = 64, K and V double-buffered by
// cp.async. Per tile: S = Q K^T by DP/16 wgmma m64n64k16 (both operands from shared memory),
// the online softmax in registers (the accumulator layout is mma.sync's: rows g, g + 8, columns
// 8 j + 2 t + {0, 1}), then O += P V by 4 wgmma m64nDPk16 with P from registers (an A fragment
// is two accumulator tiles, as in mma_pb_m) and V from shared memory, transposed (V is [keys]
// [dims]: MN-major). Each wgmma group is waited for before its result is used (no overlap
// inside a warpgroup; the other warpgroup and the second block on the multiprocessor fill the
// gaps: __launch_bounds__(256, 2), 128 registers).
// Shared memory: Q [2 halves][128][64], K and V 2 stages of [DP/64 halves][64][64] each; rows of
// 64 elements (128 bytes), 16-byte chunk c of row r stored at chunk c ^ (r % 8) (the 128-byte
// swizzle the descriptors name), every 8-row group 1024 bytes and 1024-byte aligned: K-major
// descriptors (Q, K) step 32 bytes per 16 head dims inside a row and have stride offset 1024;
// V's (MN-major) leading offset 64 x 128 bytes (the next 64 dims), stride 1024 (the next 8
// keys). Scores are scaled before the running maximum (any sign of scale).
template <int R>
__device__ __forceinline__ void load_sw(unsigned char* sm, const T* g, i64 row0, i64 valid, int d, int rs, bool vec) {
  constexpr int CH = DP / 8;  // 16-byte chunks per row
  const int v = valid < 0 ? 0 : valid > R ? R : (int)valid;
  const T* base = v > 0 ? g + row0 * rs : g;
#pragma unroll
  for (int i = 0; i < (R * CH + WNT - 1) / WNT; ++i) {
    const int e = threadIdx.x + i * WNT, r = e / CH, c = e % CH;
    if ((R * CH) % WNT == 0 || e < R * CH) {
      unsigned char* dst = sm + (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
      if (vec) {
        cp_async16_if(dst, base + (unsigned)(r * rs + c * 8), r < v && c * 8 < d);
      } else {
        T x[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = c * 8 + j;
          x[j].x = 0;
          if (r < v && col < d) x[j] = base[r * rs + col];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) ((T*)dst)[j] = x[j];
      }
    }
  }
}
__device__ __forceinline__ void fwd_wg(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                       T* __restrict__ o, float* __restrict__ lse, Dims dm, double scale, int causal,
                                       i64 blk) {
  constexpr int BM = WBM, BN = WBN, NH = DP / 64;
  FLASH_SMEM(raw);
  unsigned char* sq = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
  unsigned char* sk = sq + BM * DP * 2;  // 2 stages of BN x DP
  unsigned char* sv = sk + 2 * BN * DP * 2;
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BM - 1) / BM;
  const i64 q0 = (nqb - 1 - blk) * BM;
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = h / (dm.hq / dm.hkv);
  const T* qh = q + q_at(dm, b, h);
  const T* kh = k + k_at(dm, b, kvh);
  const T* vh = v + k_at(dm, b, kvh);
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  // In 32 bits from here on (src/flash.rs keeps T and S under 2^30).
  const int Si = (int)S, q0i = (int)q0;
  const int kend = causal ? min(Si, q0i + BM) : Si;
  const int ntiles = (kend + BN - 1) / BN;
  const float sl2 = (float)(scale * 1.4426950408889634);
  // The softmax scales the scores first (any sign of scale; m in log2 units) and rescales the
  // accumulator on every tile. On the H200 (d128 x 4096, bthd, 2026-12-04 run 6) this took 0.43
  // ms against 0.47 with fwd's conditional rescaling (which spilled here) and 0.46 with the
  // maximum kept on the raw scores (one FFMA a probability, but a second path for a negative
  // scale: 124 bytes of spill).
  const int wrow = q0i + wg * 64 + w * 16, row0 = wrow + g;  // the warp's first row; the thread's rows row0, row0 + 8
  const int wglast = q0i + wg * 64 + 63;

  load_sw<BM>(sq, qh, q0, T_ - q0, (int)d, (int)dm.qrs, vec);
  if (ntiles > 0) {
    load_sw<BN>(sk, kh, 0, S, (int)d, (int)dm.krs, vec);
    load_sw<BN>(sv, vh, 0, S, (int)d, (int)dm.krs, vec);
  }
  cp_commit();
  float acc[DP / 2];
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) acc[i] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // running maximum of the scaled scores (log2 units)

  for (int it = 0; it < ntiles; ++it) {
    const int j0 = it * BN;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_sw<BN>(sk + st * BN * DP * 2, kh, j0 + BN, S - j0 - BN, (int)d, (int)dm.krs, vec);
      load_sw<BN>(sv + st * BN * DP * 2, vh, j0 + BN, S - j0 - BN, (int)d, (int)dm.krs, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    fence_async_smem();  // this thread's tile writes, visible to the wgmma (async proxy) reads
    FLASH_SYNC();
    const unsigned char* ks = sk + (it & 1) * BN * DP * 2;
    const unsigned char* vs = sv + (it & 1) * BN * DP * 2;
    if (!causal || j0 <= wglast) {  // some key of the tile is visible to the warpgroup
      float s[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) {
        const u64 da = wg_desc(sq + (kk >> 2) * (BM * 128) + wg * 64 * 128 + (kk & 3) * 32, 16, 1024);
        const u64 db = wg_desc(ks + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024);
        wg_ss_n64(s, da, db, kk > 0);
      }
      wg_commit();
      wg_wait0();
      wg_hold<BN / 2>(s);
      const bool mask = j0 + BN > Si || (causal && j0 + BN - 1 > wrow);  // warp-uniform
      // In 32 bits, relative to the tile: keys at or past kmax are out; causal: key k is out of
      // row r when k - r > wrow - j0 (at least -63 here: the tile is visible to the warpgroup).
      const int kmax = min(Si - j0, BN), rel = causal ? min(wrow - j0, BN) : BN;
      float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float u = s[4 * j + e] * sl2;
          if (mask) {
            const int kc = 8 * j + 2 * tq + (e & 1), rc = g + 8 * (e >> 1);
            if (kc >= kmax || kc - rc > rel) u = NEG_INF;
          }
          s[4 * j + e] = u;
          mx[e >> 1] = fmaxf(mx[e >> 1], u);
        }
      float nb[2];  // -(the running maximum); nothing visible yet: 0 (and every p is 2^-inf = 0)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float mn = fmaxf(m[i], quad_max(mx[i]));
        const float alpha = m[i] == NEG_INF ? 0.f : ex2(m[i] - mn);
        m[i] = mn;
        l[i] *= alpha;
#pragma unroll
        for (int j = 0; j < DP / 8; ++j) {
          acc[4 * j + 2 * i] *= alpha;
          acc[4 * j + 2 * i + 1] *= alpha;
        }
        nb[i] = mn == NEG_INF ? 0.f : -mn;
      }
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = ex2(s[4 * j + e] + nb[e >> 1]);
          s[4 * j + e] = p;
          l[e >> 1] += p;
        }
      u32 pa[BN / 16][4];
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        pa[kc][0] = pack2(s[8 * kc + 0], s[8 * kc + 1]);
        pa[kc][1] = pack2(s[8 * kc + 2], s[8 * kc + 3]);
        pa[kc][2] = pack2(s[8 * kc + 4], s[8 * kc + 5]);
        pa[kc][3] = pack2(s[8 * kc + 6], s[8 * kc + 7]);
      }
      wg_hold<DP / 2>(acc);
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        const u64 dv = wg_desc(vs + kc * 16 * 128, BN * 128, 1024);
        if constexpr (NH == 2)
          wg_rs_n128(acc, pa[kc], dv);
        else
          wg_rs_n64(acc, pa[kc], dv);
      }
      wg_commit();
      wg_wait0();
      wg_hold<DP / 2>(acc);
    }
    FLASH_SYNC();  // the stage is read before the next iteration's loads overwrite it
  }
  cp_wait<0>();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float lt = quad_sum(l[i]);
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    const i64 r = row0 + 8 * i;
    if (r < T_) {
      if (tq == 0) lse[bh * T_ + r] = lt > 0.f ? (m[i] + log2f(lt)) * LN2 : NEG_INF;
      T* orow = o + q_at(dm, b, h) + r * dm.qrs;
#pragma unroll
      for (int j = 0; j < DP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const i64 c = 8 * j + 2 * tq + e;
          if (c < d) st(&orow[c], acc[4 * j + 2 * i + e] * inv);
        }
    }
  }
}
#endif  // FWG

// ---- backward, without FDELTA 1/3: delta = rowsum(dO * O) in f32, one warp per row (row r =
// bh * T + i) ----
__device__ void bwd_delta(const T* __restrict__ o, const T* __restrict__ dout, float* __restrict__ delta, Dims dm) {
  const int lane = threadIdx.x & 31;
  const i64 rows = dm.b * dm.hq * dm.t, d = dm.d;
  for (i64 r = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * (NT / 32)) {
    const i64 bh = r / dm.t, at = q_at(dm, bh / dm.hq, bh % dm.hq) + (r % dm.t) * dm.qrs;
    float a = 0.f;
    for (i64 c = lane; c < d; c += 32) a += ld(o[at + c]) * ld(dout[at + c]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) a += shfl_xor(a, x);
    if (lane == 0) delta[r] = a;
  }
}

// ---- backward, dK/dV: the split of a group's query heads. Grid row y = (b hkv + kvh) nsplit +
// sp: block row sp of its kv head's nsplit sums the group's query heads [h0, h1) (ceil(group /
// nsplit) each, the last ones possibly fewer or none). With nsplit = 1 it writes dK and dV
// itself; otherwise f32 partial sums into `part` ([2][nsplit][b hkv][s][d]: dK's (scaled) then
// dV's), which flash_bwd_dkdv_sum adds in split order (deterministic) into dK and dV. More
// blocks on the same keys: at seq 2048 the one-block-per-kv-head grid had 256 blocks of very
// unequal causal work for 132 multiprocessors. ----
struct Split { i64 bk, b, kvh, h0, h1; int sp; };
__device__ __forceinline__ Split split_of(const Dims& dm, int nsplit) {
  Split x;
  const i64 y = blockIdx.y, group = dm.hq / dm.hkv, per = (group + nsplit - 1) / nsplit;
  x.bk = y / nsplit;
  x.sp = (int)(y % nsplit);
  x.b = x.bk / dm.hkv;
  x.kvh = x.bk % dm.hkv;
  x.h0 = min64(group, x.sp * per);
  x.h1 = min64(group, x.h0 + per);
  return x;
}
// Element (key r, column c) of dK (already scaled) and dV of block row `x`.
__device__ __forceinline__ void store_dkdv(T* dk, T* dv, float* part, int nsplit, const Dims& dm, const Split& x, i64 r,
                                           i64 c, float gk, float gv) {
  if (nsplit == 1) {
    const i64 at = k_at(dm, x.b, x.kvh) + r * dm.krs + c;
    st(&dk[at], gk);
    st(&dv[at], gv);
  } else {
    const i64 plane = dm.b * dm.hkv * dm.s * dm.d, at = (x.bk * dm.s + r) * dm.d + c;
    part[x.sp * plane + at] = gk;
    part[(nsplit + x.sp) * plane + at] = gv;
  }
}

// ---- backward: dK, dV of BK keys of one (batch, kv head), head dims [c0, c0 + DC); each warp
// KMT x 16 keys, so each Q / dO fragment read from shared memory feeds KMT mma ----
__device__ void bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
                         T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ part, int nsplit, Dims dm,
                         double scale, int causal, i64 blk) {
  constexpr int MT = KMT;
  FLASH_SMEM(smem);
  T* sk = (T*)smem;
  T* sv = sk + BK * LD;
  T* sq = sv + BK * LD;       // 2 stages of BQ rows
  T* sdo = sq + 2 * BQ * LD;  // 2 stages of BQ rows
  float* sl = (float*)(sdo + 2 * BQ * LD);  // 2 stages of BQ: lse * log2(e)
  float* sd = sl + 2 * BQ;                   // 2 stages of BQ: delta
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s, group = dm.hq / dm.hkv;
  constexpr int NCH = (DP + DC - 1) / DC;
  const i64 k0 = (blk / NCH) * BK;
  const int c0 = (int)(blk % NCH) * DC;
  const Split x = split_of(dm, nsplit);
  const i64 b = x.b, kvh = x.kvh;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const float sl2 = (float)(scale * 1.4426950408889634);
  const i64 qstart = causal ? k0 : 0;  // k0 is a multiple of BQ
  const int nqt = T_ > qstart ? (int)((T_ - qstart + BQ - 1) / BQ) : 0;
  const int total = (int)(x.h1 - x.h0) * nqt;
  const i64 kw = k0 + w * 16 * MT;  // the warp's first key

  load_tile<DKNT, BK>(sk, k + k_at(dm, b, kvh), k0, S - k0, d, dm.krs, vec);
  load_tile<DKNT, BK>(sv, v + k_at(dm, b, kvh), k0, S - k0, d, dm.krs, vec);
  // Tile (hh, qt): query head b*hq + kvh*group + h0 + hh, queries from qstart + qt * BQ (the
  // loop steps hh and qt as counters: no division in the loop).
  auto load_q = [&](int hq_, int qt_, int st) {
    const i64 hh = kvh * group + x.h0 + hq_, bh = b * dm.hq + hh;
    const i64 i0 = qstart + (i64)qt_ * BQ;
    load_tile<DKNT, BQ>(sq + st * BQ * LD, q + q_at(dm, b, hh), i0, T_ - i0, d, dm.qrs, vec);
    load_tile<DKNT, BQ>(sdo + st * BQ * LD, dout + q_at(dm, b, hh), i0, T_ - i0, d, dm.qrs, vec);
    for (int e = threadIdx.x; e < BQ; e += DKNT) {
      const bool ok = i0 + e < T_;
      sl[st * BQ + e] = ok ? lse[bh * T_ + i0 + e] * LOG2E : 0.f;
      sd[st * BQ + e] = ok ? delta[bh * T_ + i0 + e] : 0.f;
    }
  };
  if (total > 0) load_q(0, 0, 0);
  cp_commit();

  float gk[MT][DC / 8][4], gv[MT][DC / 8][4];
  zero<MT, DC / 8>(gk);
  zero<MT, DC / 8>(gv);

  int hc = 0, qc = 0;  // the current tile
  for (int it = 0; it < total; ++it) {
    const int nh = qc + 1 < nqt ? hc : hc + 1, nq = qc + 1 < nqt ? qc + 1 : 0;  // the next tile
    if (it + 1 < total) {
      load_q(nh, nq, (it + 1) & 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const int st = it & 1;
    const T* qs = sq + st * BQ * LD;
    const T* dos = sdo + st * BQ * LD;
    const i64 i0 = qstart + (i64)qc * BQ;
    hc = nh;
    qc = nq;
    // Causal: a tile whose queries all come before the warp's first key adds nothing.
    if (!(causal && i0 + BQ - 1 < kw)) {
      float s[MT][BQ / 8][4], dp[MT][BQ / 8][4];
      zero<MT, BQ / 8>(s);
      zero<MT, BQ / 8>(dp);
      if (PAIR2) {
        mma_abt2_m<MT, BQ>(s, sk + w * 16 * MT * LD, qs, dp, sv + w * 16 * MT * LD, dos, lane);  // S^T, dP^T
      } else {
        mma_abt_m<MT, BQ>(s, sk + w * 16 * MT * LD, qs, lane);    // S^T = K Q^T
        mma_abt_m<MT, BQ>(dp, sv + w * 16 * MT * LD, dos, lane);  // dP^T = V dO^T
      }
      auto probs = [&](const bool MASK) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int ci = n * 8 + 2 * tq + (e & 1);
              float p = ex2(fmaf(s[mt][n][e], sl2, -sl[st * BQ + ci]));
              if (MASK) {
                const i64 qi = i0 + ci, key = kw + mt * 16 + g + 8 * (e >> 1);
                if (qi >= T_ || (causal && qi < key)) p = 0.f;
              }
              s[mt][n][e] = p;
              dp[mt][n][e] = p * (dp[mt][n][e] - sd[st * BQ + ci]);
            }
      };
      if (i0 + BQ > T_ || (causal && i0 < kw + 16 * MT - 1))
        probs(true);
      else
        probs(false);
      mma_pb_m<MT, BQ, DC>(gv, s, dos, c0, lane);  // dV += P^T dO
      mma_pb_m<MT, BQ, DC>(gk, dp, qs, c0, lane);  // dK += dS^T Q
    }
    FLASH_SYNC();
  }
  cp_wait<0>();

  const float sc = (float)scale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const i64 r = kw + mt * 16 + g + 8 * i;
      if (r < S) {
#pragma unroll
        for (int n = 0; n < DC / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const i64 c = c0 + n * 8 + 2 * tq + e;
            if (c < d) store_dkdv(dk, dv, part, nsplit, dm, x, r, c, gk[mt][n][2 * i + e] * sc, gv[mt][n][2 * i + e]);
          }
      }
    }
}

// ---- backward, fa2 (FCFG 5, d <= 128): dK, dV of 64 keys of one (batch, kv head) by 8 warps.
// Design. Per query tile (Q2 = 64 queries for d <= 64, else 32; double-buffered Q, dO, lse,
// delta), two phases between two block barriers:
//   1. S^T = K Q^T and dP^T = V dO^T (interleaved, mma_abt2_m): warp w owns keys 16 (w % 4) ..
//      +16 and queries (w / 4) Q2/2 .. +Q2/2 of the tile; P^T = exp2(S^T scale log2e - lse
//      log2e) and dS^T = P^T (dP^T - delta) are rounded to T and stored to shared memory
//      ([64][Q2 + 8] each; the pad keeps the 4-byte stores and the ldmatrix rows conflict-free).
//   2. dV += P^T dO and dK += dS^T Q (mma_sb): warp w owns the same 16 keys and the 16-column
//      blocks w / 4, w / 4 + 2, ... of the head dims, reducing over all Q2 queries of the tile
//      (A from the P^T / dS^T tiles by ldmatrix, B from dO / Q by ldmatrix.trans).
// So a warp accumulates 16 keys x DP/2 columns of dK and of dV (DP/2 floats per lane, 64 at
// d128) instead of pair's 16 keys x DP (128), and the block runs 8 warps instead of 4. The next
// tile's loads are issued right after the first barrier (its stage was last read before it).
// Deterministic: every sum runs in a fixed order (tiles in order, mma k-order fixed). GQA: the
// block walks the query heads of its group in order, as bwd_dkdv; causal: queries from the
// block's first key on (k0 is a multiple of Q2), fully masked warps write zero tiles and skip
// phase 2; the paired causal grid is kept (same block-of-keys work profile as pair).
// Resources. Registers, by hand: a lane holds DP/2 accumulator floats (dK and dV, 16 keys x
// DP/2 columns each: 64 at d128, 32 at d64), QW2/2 floats of S and dP (16 at d128, 32 at d64),
// ~16 fragment registers and ~30 of addresses and indices: ~110-125, under the 128 that
// __launch_bounds__(256, 2) asks for (two blocks of 8 warps, 16 warps per SM; pair's dK/dV has
// 242-255 registers x 4 warps, two blocks, 8 warps per SM). Measured (resources.py, NVRTC 13,
// sm_90): 121-128 registers and no spills for d16..d96 and d128; d112 128 with 20 bytes of
// spill stores/loads (stack 16). Since load_q addresses q and dO by strides (either head
// layout), the same tool gives d64 8/4, d112 128/448 and d128 60/120 bytes of spill
// stores/loads: to look at when fa2 is timed. (Fully unrolled, unbounded, ptxas takes 194 at d64, 211 at
// d128; the 64-bit tile arithmetic of load_tile in the loop, or a second masked copy of the
// softmax, cost ~20-30 registers each and spilled at d112/d128: hence load_rows and one
// masking path in 32-bit tile-relative indices.) Shared memory: (2 x 64 + 4 x Q2) x (DP + 8)
// x 2 + 2 x 64 x (Q2 + 8) x 2 + 16 Q2 bytes = 80384 at d128, 74752 at d64, 37888 at d16 (two
// blocks per SM: at most 2 x (80384 + 1024) of the H200's 233472). Per tile a warp issues, at
// d128, 32 mma (and 32 ldmatrix) in phase 1 and 32 mma (20 ldmatrix) in phase 2, with two
// block barriers; pair's warp, 128 mma (80 ldmatrix) and one barrier for the same 32 queries.

// acc[2 NJ2][4] += A (16 x K, rows of `a`, stride LDA) * B (K rows of `b`), column blocks
// 2 j + h (j < NJ2) of the head dims.
template <int K, int LDA>
__device__ __forceinline__ void mma_sb(float (*acc)[4], const T* a, const T* b, int h, int lane) {
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    u32 fa[4];
    ldsm_x4(fa, a + ((lane & 7) + ((lane >> 3) & 1) * 8) * LDA + (lane >> 4) * 8 + kc * 16);
#pragma unroll
    for (int j = 0; j < NJ2; ++j) {
      const int cb = 2 * j + h;
      if (NB2 % 2 == 0 || cb < NB2) {
        u32 fb[4];
        ldsm_x4_t(fb, b + kc * 16 * LD + b_off(lane) + cb * 16);
        mma16816(acc[2 * j], fa, fb[0], fb[1]);
        mma16816(acc[2 * j + 1], fa, fb[2], fb[3]);
      }
    }
  }
}

__device__ void bwd_dkdv2(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
                          T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ part, int nsplit, Dims dm,
                          double scale, int causal, i64 blk) {
  FLASH_SMEM(smem);
  T* sk = (T*)smem;
  T* sv = sk + K2 * LD;
  T* sq = sv + K2 * LD;       // 2 stages of Q2 rows
  T* sdo = sq + 2 * Q2 * LD;  // 2 stages of Q2 rows
  T* sp = sdo + 2 * Q2 * LD;  // P^T of the tile: [K2][LP2]
  T* sds = sp + K2 * LP2;     // dS^T of the tile
  float* sl = (float*)(sds + K2 * LP2);  // 2 stages of Q2: lse * log2(e)
  float* sd = sl + 2 * Q2;               // 2 stages of Q2: delta
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const int kg = w & 3, h = w >> 2;  // the warp's 16 keys; its half (phase 1 queries, phase 2 columns)
  const i64 d = dm.d, T_ = dm.t, S = dm.s, group = dm.hq / dm.hkv;
  const i64 k0 = blk * K2;
  const Split x = split_of(dm, nsplit);
  const i64 b = x.b, kvh = x.kvh;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const float sl2 = (float)(scale * 1.4426950408889634);
  // Query tiles, by head of the group (hh) then tile (qt): queries qstart + qt Q2 + [0, Q2).
  // In the loop everything is 32-bit and relative to qstart (registers are tight at d128).
  const i64 qstart = causal ? k0 : 0;  // k0 is a multiple of Q2
  const int qlen = T_ > qstart ? (int)(T_ - qstart) : 0;
  const int nqt = (qlen + Q2 - 1) / Q2;
  const i64 bh0 = b * dm.hq + kvh * group + x.h0;  // the block's first query head
  const int kr = causal ? 16 * kg : 0;      // the warp's first key relative to qstart (causal)
  const int qo = h * QW2;                   // phase 1: the warp's first query in the tile

  load_tile<NT2, K2>(sk, k + k_at(dm, b, kvh), k0, S - k0, d, dm.krs, vec);
  load_tile<NT2, K2>(sv, v + k_at(dm, b, kvh), k0, S - k0, d, dm.krs, vec);
  auto load_q = [&](int hh, int qt, int st) {
    const i64 row = (bh0 + hh) * T_ + qstart + (i64)qt * Q2;  // the tile's first row of lse, delta
    const i64 at = q_at(dm, b, kvh * group + x.h0 + hh) + (qstart + (i64)qt * Q2) * dm.qrs;  // and of q, dout
    const int valid = qlen - qt * Q2;
    load_rows<NT2, Q2>(sq + st * Q2 * LD, q + at, valid, (int)d, (int)dm.qrs, vec);
    load_rows<NT2, Q2>(sdo + st * Q2 * LD, dout + at, valid, (int)d, (int)dm.qrs, vec);
    for (int e = threadIdx.x; e < Q2; e += NT2) {
      const bool ok = e < valid;
      sl[st * Q2 + e] = ok ? lse[row + e] * LOG2E : 0.f;
      sd[st * Q2 + e] = ok ? delta[row + e] : 0.f;
    }
  };
  if (nqt > 0 && x.h1 > x.h0) load_q(0, 0, 0);
  cp_commit();

  float gk[2 * NJ2][4], gv[2 * NJ2][4];
  zero<1, 2 * NJ2>(&gk);
  zero<1, 2 * NJ2>(&gv);

  const int ng = (int)(x.h1 - x.h0);
  int hh = 0, qt = 0;  // the current tile
  for (int it = 0; nqt > 0 && hh < ng; ++it) {
    cp_wait<0>();
    FLASH_SYNC();  // tile `it` is in; every warp is done with tile it - 1 (its stage, P^T, dS^T)
    const int nh = qt + 1 < nqt ? hh : hh + 1, nq = qt + 1 < nqt ? qt + 1 : 0;  // the next tile
    if (nh < ng) load_q(nh, nq, (it + 1) & 1);
    cp_commit();
    const int st = it & 1;
    const T* qs = sq + st * Q2 * LD;
    const T* dos = sdo + st * Q2 * LD;
    const int q0 = qt * Q2;  // the tile's first query, relative to qstart
    // Phase 1: the warp's 16 x QW2 block of P^T and dS^T.
    if (causal && q0 + qo + QW2 - 1 < kr) {  // all its queries come before its first key
#pragma unroll
      for (int n = 0; n < QW2 / 8; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int o = (16 * kg + g + 8 * i) * LP2 + qo + n * 8 + 2 * tq;
          *(u32*)&sp[o] = 0u;
          *(u32*)&sds[o] = 0u;
        }
    } else {
      float s[1][QW2 / 8][4], dp[1][QW2 / 8][4];
      zero<1, QW2 / 8>(s);
      zero<1, QW2 / 8>(dp);
      mma_abt2_m<1, QW2>(s, sk + 16 * kg * LD, qs + qo * LD, dp, sv + 16 * kg * LD, dos + qo * LD, lane);  // S^T, dP^T
      // Masked: query q0 + ci past the end, or before key kr + g (+ 8); in 32 bits relative to
      // the tile (one code path: two compares a value cost less than a second copy's registers).
      const int qlim = qlen - q0 < Q2 ? qlen - q0 : Q2;
      const int kd = causal ? kr - q0 : -(1 << 30);
#pragma unroll
      for (int n = 0; n < QW2 / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ci = qo + n * 8 + 2 * tq + (e & 1);
          float p = ex2(fmaf(s[0][n][e], sl2, -sl[st * Q2 + ci]));
          if (ci >= qlim || ci - g - 8 * (e >> 1) < kd) p = 0.f;
          s[0][n][e] = p;
          dp[0][n][e] = p * (dp[0][n][e] - sd[st * Q2 + ci]);
        }
#pragma unroll
      for (int n = 0; n < QW2 / 8; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int o = (16 * kg + g + 8 * i) * LP2 + qo + n * 8 + 2 * tq;
          *(u32*)&sp[o] = pack2(s[0][n][2 * i], s[0][n][2 * i + 1]);
          *(u32*)&sds[o] = pack2(dp[0][n][2 * i], dp[0][n][2 * i + 1]);
        }
    }
    FLASH_SYNC();  // P^T and dS^T of the tile are complete
    // Phase 2: the warp's 16 keys x its column blocks, over the tile's Q2 queries.
    if (!(causal && q0 + Q2 - 1 < kr)) {
      mma_sb<Q2, LP2>(gv, sp + 16 * kg * LP2, dos, h, lane);   // dV += P^T dO
      mma_sb<Q2, LP2>(gk, sds + 16 * kg * LP2, qs, h, lane);  // dK += dS^T Q
    }
    hh = nh;
    qt = nq;
  }
  cp_wait<0>();

  const float sc = (float)scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const i64 r = k0 + 16 * kg + g + 8 * i;
    if (r < S) {
#pragma unroll
      for (int j = 0; j < NJ2; ++j) {
        const int cb = 2 * j + h;
        if (NB2 % 2 == 0 || cb < NB2)
#pragma unroll
          for (int nn = 0; nn < 2; ++nn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const i64 c = cb * 16 + nn * 8 + 2 * tq + e;
              if (c < d) store_dkdv(dk, dv, part, nsplit, dm, x, r, c, gk[2 * j + nn][2 * i + e] * sc, gv[2 * j + nn][2 * i + e]);
            }
      }
    }
  }
}

// ---- backward: dQ of BR queries of one (batch, query head); each warp QMT x 16 queries. With
// FDELTA it first computes delta = rowsum(dO * O) of its rows (and stores it for dK/dV, which
// then runs after it) ----
__device__ void bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ o, const float* __restrict__ lse, const T* __restrict__ dout,
                       float* __restrict__ delta, T* __restrict__ dq, Dims dm, double scale, int causal, i64 blk) {
  constexpr int MT = QMT;
  FLASH_SMEM(smem);
  T* sq = (T*)smem;
  T* sdo = sq + BR * LD;
  T* sk = sdo + BR * LD;                  // 2 stages of BC rows
  T* sv = sk + 2 * BC * LD;               // 2 stages of BC rows
  float* sdel = (float*)(sv + 2 * BC * LD);  // FDELTA: delta of the block's rows
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BR - 1) / BR;
  const i64 q0 = (nqb - 1 - blk) * BR;
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = h / (dm.hq / dm.hkv);  // the kv head, within batch b
  const T* kh = k + k_at(dm, b, kvh);
  const T* vh = v + k_at(dm, b, kvh);
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const i64 kend = causal ? min64(S, q0 + BR) : S;
  const int ntiles = (int)((kend + BC - 1) / BC);
  const float sl2 = (float)(scale * 1.4426950408889634);
  const i64 wrow = q0 + w * 16 * MT, wlast = wrow + 16 * MT - 1;

  load_tile<NT, BR>(sq, q + q_at(dm, b, h), q0, T_ - q0, d, dm.qrs, vec);
  load_tile<NT, BR>(sdo, dout + q_at(dm, b, h), q0, T_ - q0, d, dm.qrs, vec);
  if (ntiles > 0) {
    load_tile<NT, BC>(sk, kh, 0, S, d, dm.krs, vec);
    load_tile<NT, BC>(sv, vh, 0, S, d, dm.krs, vec);
  }
  cp_commit();
  if (FDELTA) {
    // One row at a time per warp, lanes across the head dims (while the tiles above arrive).
    for (int r = 0; r < 16 * MT; ++r) {
      const i64 row = wrow + r;
      float a = 0.f;
      if (row < T_)
        for (i64 c = lane; c < d; c += 32) {
          const i64 at = q_at(dm, b, h) + row * dm.qrs + c;
          a += ld(o[at]) * ld(dout[at]);
        }
#pragma unroll
      for (int x = 16; x > 0; x >>= 1) a += shfl_xor(a, x);
      if (lane == 0) {
        sdel[w * 16 * MT + r] = a;
        if (row < T_) delta[bh * T_ + row] = a;
      }
    }
    FLASH_SYNC();
  }
  float L[MT][2], D[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const i64 row = wrow + mt * 16 + g + 8 * i;
      const bool ok = row < T_;
      L[mt][i] = ok ? lse[bh * T_ + row] * LOG2E : 0.f;
      D[mt][i] = ok ? (FDELTA ? sdel[w * 16 * MT + mt * 16 + g + 8 * i] : delta[bh * T_ + row]) : 0.f;
    }
  float acc[MT][DP / 8][4];
  zero<MT, DP / 8>(acc);

  for (int it = 0; it < ntiles; ++it) {
    const i64 j0 = (i64)it * BC;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_tile<NT, BC>(sk + st * BC * LD, kh, j0 + BC, S - j0 - BC, d, dm.krs, vec);
      load_tile<NT, BC>(sv + st * BC * LD, vh, j0 + BC, S - j0 - BC, d, dm.krs, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const T* ks = sk + (it & 1) * BC * LD;
    const T* vs = sv + (it & 1) * BC * LD;
    // Causal: a tile whose keys all come after the warp's last query adds nothing.
    if (!(causal && j0 > wlast)) {
      float s[MT][BC / 8][4], dp[MT][BC / 8][4];
      zero<MT, BC / 8>(s);
      zero<MT, BC / 8>(dp);
      if (PAIR2) {
        mma_abt2_m<MT, BC>(s, sq + w * 16 * MT * LD, ks, dp, sdo + w * 16 * MT * LD, vs, lane);  // S, dP
      } else {
        mma_abt_m<MT, BC>(s, sq + w * 16 * MT * LD, ks, lane);
        mma_abt_m<MT, BC>(dp, sdo + w * 16 * MT * LD, vs, lane);
      }
      auto probs = [&](const bool MASK) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float p = ex2(fmaf(s[mt][n][e], sl2, -L[mt][e >> 1]));
              if (MASK) {
                const i64 key = j0 + n * 8 + 2 * tq + (e & 1), row = wrow + mt * 16 + g + 8 * (e >> 1);
                if (key >= S || (causal && key > row)) p = 0.f;
              }
              dp[mt][n][e] = p * (dp[mt][n][e] - D[mt][e >> 1]);
            }
      };
      if (j0 + BC > S || (causal && j0 + BC - 1 > wrow))
        probs(true);
      else
        probs(false);
      mma_pb_m<MT, BC, DP>(acc, dp, ks, 0, lane);  // dQ += dS K
    }
    FLASH_SYNC();
  }
  cp_wait<0>();

  const float sc = (float)scale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const i64 r = wrow + mt * 16 + g + 8 * i;
      if (r < T_) {
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const i64 c = n * 8 + 2 * tq + e;
            if (c < d) st(&dq[q_at(dm, b, h) + r * dm.qrs + c], acc[mt][n][2 * i + e] * sc);
          }
      }
    }
}

#if FWG
// ---- backward: dQ of WBM = 128 queries of one (batch, query head) on wgmma (FWGQ), two
// warpgroups as fwd_wg, keys in tiles of 64 (K and V double-buffered). Per tile: S = Q K^T and
// dP = dO V^T (DP/16 wgmma m64n64k16 each, all operands K-major in shared memory, one commit
// group), P = 2^(S scale log2 e - lse log2 e), dS = P (dP - delta) in registers, then dQ += dS K
// (4 wgmma m64nDPk16, dS from registers, K from shared memory MN-major as fwd_wg's V). Q and dO
// are [halves][128][64] swizzled tiles, K and V as in fwd_wg. ----
__device__ __forceinline__ void bwd_dq_wg(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                          const float* __restrict__ lse, const T* __restrict__ dout,
                                          const float* __restrict__ delta, T* __restrict__ dq, Dims dm, double scale,
                                          int causal, i64 blk) {
  constexpr int BM = WBM, BN = WBN, NH = DP / 64;
  FLASH_SMEM(raw);
  unsigned char* sq = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
  unsigned char* sdo = sq + BM * DP * 2;
  unsigned char* sk = sdo + BM * DP * 2;  // 2 stages of BN x DP
  unsigned char* sv = sk + 2 * BN * DP * 2;
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BM - 1) / BM;
  const i64 q0 = (nqb - 1 - blk) * BM;
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = h / (dm.hq / dm.hkv);
  const T* kh = k + k_at(dm, b, kvh);
  const T* vh = v + k_at(dm, b, kvh);
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const i64 kend = causal ? min64(S, q0 + BM) : S;
  const int ntiles = (int)((kend + BN - 1) / BN);
  const float sl2 = (float)(scale * 1.4426950408889634);
  const i64 wrow = q0 + wg * 64 + w * 16, row0 = wrow + g;
  const i64 wglast = q0 + wg * 64 + 63;

  load_sw<BM>(sq, q + q_at(dm, b, h), q0, T_ - q0, (int)d, (int)dm.qrs, vec);
  load_sw<BM>(sdo, dout + q_at(dm, b, h), q0, T_ - q0, (int)d, (int)dm.qrs, vec);
  if (ntiles > 0) {
    load_sw<BN>(sk, kh, 0, S, (int)d, (int)dm.krs, vec);
    load_sw<BN>(sv, vh, 0, S, (int)d, (int)dm.krs, vec);
  }
  cp_commit();
  float L[2], Dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const i64 row = row0 + 8 * i;
    const bool ok = row < T_;
    L[i] = ok ? lse[bh * T_ + row] * LOG2E : 0.f;
    Dl[i] = ok ? delta[bh * T_ + row] : 0.f;
  }
  float acc[DP / 2];
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) acc[i] = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    const i64 j0 = (i64)it * BN;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_sw<BN>(sk + st * BN * DP * 2, kh, j0 + BN, S - j0 - BN, (int)d, (int)dm.krs, vec);
      load_sw<BN>(sv + st * BN * DP * 2, vh, j0 + BN, S - j0 - BN, (int)d, (int)dm.krs, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    fence_async_smem();
    FLASH_SYNC();
    const unsigned char* ks = sk + (it & 1) * BN * DP * 2;
    const unsigned char* vs = sv + (it & 1) * BN * DP * 2;
    if (!causal || j0 <= wglast) {
      float s[BN / 2], dp[BN / 2];
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.f;
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) {
        const int off = (kk >> 2) * (BM * 128) + wg * 64 * 128 + (kk & 3) * 32, koff = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
        wg_ss_n64(s, wg_desc(sq + off, 16, 1024), wg_desc(ks + koff, 16, 1024), kk > 0);
        wg_ss_n64(dp, wg_desc(sdo + off, 16, 1024), wg_desc(vs + koff, 16, 1024), kk > 0);
      }
      wg_commit();
      wg_wait0();
      wg_hold<BN / 2>(s);
      wg_hold<BN / 2>(dp);
      const bool mask = j0 + BN > S || (causal && j0 + BN - 1 > wrow);
      const int kmax = (int)min64(S - j0, BN), rel = causal ? (int)min64(wrow - j0, BN) : BN;
      u32 da[BN / 16][4];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = ex2(fmaf(s[4 * j + e], sl2, -L[e >> 1]));
          if (mask) {
            const int kc = 8 * j + 2 * tq + (e & 1), rc = g + 8 * (e >> 1);
            if (kc >= kmax || kc - rc > rel) p = 0.f;
          }
          dp[4 * j + e] = p * (dp[4 * j + e] - Dl[e >> 1]);
        }
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        da[kc][0] = pack2(dp[8 * kc + 0], dp[8 * kc + 1]);
        da[kc][1] = pack2(dp[8 * kc + 2], dp[8 * kc + 3]);
        da[kc][2] = pack2(dp[8 * kc + 4], dp[8 * kc + 5]);
        da[kc][3] = pack2(dp[8 * kc + 6], dp[8 * kc + 7]);
      }
      wg_hold<DP / 2>(acc);
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) {
        const u64 dk = wg_desc(ks + kc * 16 * 128, BN * 128, 1024);
        if constexpr (NH == 2)
          wg_rs_n128(acc, da[kc], dk);
        else
          wg_rs_n64(acc, da[kc], dk);
      }
      wg_commit();
      wg_wait0();
      wg_hold<DP / 2>(acc);
    }
    FLASH_SYNC();
  }
  cp_wait<0>();
  const float sc = (float)scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const i64 r = row0 + 8 * i;
    if (r < T_) {
      T* row = dq + q_at(dm, b, h) + r * dm.qrs;
#pragma unroll
      for (int j = 0; j < DP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const i64 c = 8 * j + 2 * tq + e;
          if (c < d) st(&row[c], acc[4 * j + 2 * i + e] * sc);
        }
    }
  }
}
#endif  // FWG

// ---- which blocks a CTA runs. Causal work grows with a block's index (the longest query rows
// first, the keys seen by the most queries first), so on a paired grid (gridDim.x < n * per:
// src/flash.rs asks for one while half the CTAs still fill the device) CTA x runs block x and
// then block n - 1 - x, and every CTA gets about the same work (the middle block of an odd n
// runs once). `per` neighbouring grid columns share one block index (dK/dV's head-dim chunks). ----
__device__ __forceinline__ int passes(i64 n, int per) {
  const i64 x = (i64)blockIdx.x / per;
  return (i64)gridDim.x < n * per && n - 1 - x != x ? 2 : 1;
}
__device__ __forceinline__ i64 block_of(i64 n, int per, int pass) {
  const i64 x = (i64)blockIdx.x / per, c = (i64)blockIdx.x % per;
  return (pass == 0 ? x : n - 1 - x) * per + c;
}
}  // namespace fa

#if FWG && FDP == 128
#define FLASH_FWD_BOUNDS __launch_bounds__(fa::WNT, 2)
#else
#define FLASH_FWD_BOUNDS __launch_bounds__(fa::FNT)
#endif
extern "C" __global__ void FLASH_FWD_BOUNDS flash_fwd(const fa::T* q, const fa::T* k, const fa::T* v, fa::T* o, float* lse,
                                                      fa::Dims dm, double scale, int causal) {
  const i64 n = (dm.t + fa::FWD_ROWS - 1) / fa::FWD_ROWS;
  const int np = fa::passes(n, 1);
#pragma unroll 1
  for (int p = 0; p < np; ++p) {
    if (p) FLASH_SYNC();  // the first block's last reads of shared memory are done
    const i64 blk = fa::block_of(n, 1, p);
#if FWG && FDP == 128
    fa::fwd_wg(q, k, v, o, lse, dm, scale, causal, blk);
#else
    if (scale < 0)
      fa::fwd<true>(q, k, v, o, lse, dm, scale, causal, blk);
    else
      fa::fwd<false>(q, k, v, o, lse, dm, scale, causal, blk);
#endif
  }
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_delta(const fa::T* o, const fa::T* dout, float* delta,
                                                                     fa::Dims dm) {
  fa::bwd_delta(o, dout, delta, dm);
}
// fa2's dK/dV (8 warps) asks for two blocks per multiprocessor: at most 128 registers a thread.
#if FCFG == 5 && FDP <= 128
#define FLASH_DKDV_BOUNDS __launch_bounds__(fa::DKDV_NT, 2)
#else
#define FLASH_DKDV_BOUNDS __launch_bounds__(fa::DKDV_NT)
#endif
extern "C" __global__ void FLASH_DKDV_BOUNDS flash_bwd_dkdv(const fa::T* q, const fa::T* k, const fa::T* v,
                                                            const float* lse, const fa::T* dout, const float* delta,
                                                            fa::T* dk, fa::T* dv, float* part, int nsplit, fa::Dims dm,
                                                            double scale, int causal) {
  const i64 n = (dm.s + fa::DKDV_KEYS - 1) / fa::DKDV_KEYS;
  const int np = fa::passes(n, fa::NCHUNK);
#pragma unroll 1
  for (int p = 0; p < np; ++p) {
    if (p) FLASH_SYNC();  // the first block's last reads of shared memory are done
    if constexpr (fa::FA2)
      fa::bwd_dkdv2(q, k, v, lse, dout, delta, dk, dv, part, nsplit, dm, scale, causal, fa::block_of(n, fa::NCHUNK, p));
    else
      fa::bwd_dkdv(q, k, v, lse, dout, delta, dk, dv, part, nsplit, dm, scale, causal, fa::block_of(n, fa::NCHUNK, p));
  }
}
// dK and dV from flash_bwd_dkdv's nsplit partial sums (split order, so deterministic); four
// elements a thread where d % 4 == 0 (16-byte loads of the partials: the scratch is 256-byte
// aligned and each plane a multiple of 4 elements).
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_dkdv_sum(const float* part, fa::T* dk, fa::T* dv,
                                                                        fa::Dims dm, int nsplit) {
  const i64 d = dm.d, plane = dm.b * dm.hkv * dm.s * d;
  const int W = d % 4 == 0 ? 4 : 1;
  for (i64 e = ((i64)blockIdx.x * fa::NT + threadIdx.x) * W; e < plane; e += (i64)gridDim.x * fa::NT * W) {
    float a[4] = {0.f, 0.f, 0.f, 0.f}, c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < nsplit; ++j) {
      if (W == 4) {
        const float4 x = *(const float4*)&part[j * plane + e], y = *(const float4*)&part[(nsplit + j) * plane + e];
        a[0] += x.x, a[1] += x.y, a[2] += x.z, a[3] += x.w;
        c[0] += y.x, c[1] += y.y, c[2] += y.z, c[3] += y.w;
      } else {
        a[0] += part[j * plane + e];
        c[0] += part[(nsplit + j) * plane + e];
      }
    }
    const i64 col = e % d, r = (e / d) % dm.s, bk = e / (d * dm.s);
    const i64 at = fa::k_at(dm, bk / dm.hkv, bk % dm.hkv) + r * dm.krs + col;
    for (int i = 0; i < W; ++i) {
      st(&dk[at + i], a[i]);
      st(&dv[at + i], c[i]);
    }
  }
}
extern "C" __global__ void __launch_bounds__(fa::DQ_NT) flash_bwd_dq(const fa::T* q, const fa::T* k, const fa::T* v,
                                                                     const fa::T* o, const float* lse, const fa::T* dout,
                                                                     float* delta, fa::T* dq, fa::Dims dm, double scale,
                                                                     int causal) {
  const i64 n = (dm.t + fa::DQ_ROWS - 1) / fa::DQ_ROWS;
  const int np = fa::passes(n, 1);
#pragma unroll 1
  for (int p = 0; p < np; ++p) {
    if (p) FLASH_SYNC();  // the first block's last reads of shared memory are done
#if FWG
    if constexpr (fa::FWGQ) {
      fa::bwd_dq_wg(q, k, v, lse, dout, delta, dq, dm, scale, causal, fa::block_of(n, 1, p));
      continue;
    }
#endif
    fa::bwd_dq(q, k, v, o, lse, dout, delta, dq, dm, scale, causal, fa::block_of(n, 1, p));
  }
}
