// Flash attention kernels on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): the forward
// (fwd_wg, where the bucket sets FA_FWD_WG) and dQ (bwd_dq_wg, FA_DQ_WG) at padded head sizes 64
// and 128. src/flash.rs appends this file to flash_attn.cu (whose helpers it uses) and compiles
// the module for sm_90a; it defines the entry points flash_fwd / flash_bwd_dq that flash_attn.cu
// then leaves out. No CPU emulation (tests/flash_emu/ covers the mma.sync kernels only).
//
// wgmma m64nNk16 with f32 accumulators, operands from shared memory through matrix descriptors
// (128-byte swizzle) or A from registers (operand types MMA_AB, as flash_attn.cu's mma.sync);
// plus the fences it needs.
#ifdef FLASH_EMU
#error "the wgmma kernels have no CPU emulation"
#endif
typedef unsigned long long u64;
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// The compiler sees a wgmma's accumulators written when the asm issues it, not when wg_wait0
// returns, so it may move plain register arithmetic on them above the wait (stale values). A
// volatile asm that "rewrites" them after the wait (and before the next issue) pins every use
// after it: volatile asms keep their order.
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
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wg_rs_n64(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." MMA_AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wg_rs_n128(float* d, const u32* a, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

namespace fa {
// ---- forward on Hopper's warpgroup MMA (FA_FWD_WG: DP 128). A block of 256 threads (two
// warpgroups) owns BM = 128 queries of one (batch, query head); warpgroup wg its rows 64 wg ..
// +64, warp w of it rows 16 w .. +16. Keys in tiles of BN = 64, K and V double-buffered by
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
// load_sw: rows [row0, row0 + R) of rows rs apart (`valid` of them from row0 on) into such a
// swizzled tile by NTH threads; zeros past `valid` and past column d.
template <int R, int NTH>
__device__ __forceinline__ void load_sw(unsigned char* sm, const T* g, i64 row0, i64 valid, int d, int rs, bool vec) {
  constexpr int CH = DP / 8;  // 16-byte chunks per row
  const int v = valid < 0 ? 0 : valid > R ? R : (int)valid;
  const T* base = v > 0 ? g + row0 * rs : g;
#pragma unroll
  for (int i = 0; i < (R * CH + NTH - 1) / NTH; ++i) {
    const int e = threadIdx.x + i * NTH, r = e / CH, c = e % CH;
    if ((R * CH) % NTH == 0 || e < R * CH) {
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

// The K/V pipeline of both wgmma kernels: `ntiles` tiles of BN keys of K and V (rows of `kh`,
// `vh`, krs apart) through two swizzled shared stages each (`sk`, `sv`). Stage 0 is issued here
// and committed with whatever the caller issued before (its Q and dO tiles); then each tile's
// successor loads while `tile(j0, ks, vs)` works on it (keys j0 .. j0 + BN), called once the
// tile and everything committed before it are in shared memory and visible to wgmma (the async
// proxy). A barrier ends each tile: the next iteration's loads overwrite the stage just read.
template <int BN, int NTH, class F>
__device__ __forceinline__ void wg_kv_tiles(unsigned char* sk, unsigned char* sv, const T* kh, const T* vh, i64 S,
                                            int d, int krs, bool vec, int ntiles, F tile) {
  constexpr int STAGE = BN * DP * 2;  // bytes
  if (ntiles > 0) {
    load_sw<BN, NTH>(sk, kh, 0, S, d, krs, vec);
    load_sw<BN, NTH>(sv, vh, 0, S, d, krs, vec);
  }
  cp_commit();
  for (int it = 0; it < ntiles; ++it) {
    const int j0 = it * BN;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_sw<BN, NTH>(sk + st * STAGE, kh, j0 + BN, S - j0 - BN, d, krs, vec);
      load_sw<BN, NTH>(sv + st * STAGE, vh, j0 + BN, S - j0 - BN, d, krs, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    fence_async_smem();  // this thread's tile writes, visible to the wgmma (async proxy) reads
    FLASH_SYNC();
    tile(j0, sk + (it & 1) * STAGE, sv + (it & 1) * STAGE);
    FLASH_SYNC();  // the stage is read before the next iteration's loads overwrite it
  }
  cp_wait<0>();
}

// BN / 16 A fragments (rounded to T) of a row of accumulator tiles x[BN / 2] (mma.sync's layout,
// 4 floats per 8 columns: two neighbouring tiles are one fragment, as in mma_pb_m).
template <int BN>
__device__ __forceinline__ void wg_pack_a(u32 (*a)[4], const float* x) {
#pragma unroll
  for (int kc = 0; kc < BN / 16; ++kc) {
    a[kc][0] = pack2(x[8 * kc + 0], x[8 * kc + 1]);
    a[kc][1] = pack2(x[8 * kc + 2], x[8 * kc + 3]);
    a[kc][2] = pack2(x[8 * kc + 4], x[8 * kc + 5]);
    a[kc][3] = pack2(x[8 * kc + 6], x[8 * kc + 7]);
  }
}
// acc[DP / 2] += A B: A the BN / 16 fragments `a` (BN keys), B the tile `b` of BN rows of DP
// (fwd_wg's V, bwd_dq_wg's K: MN-major), by BN / 16 wgmma m64nDPk16; waited for.
template <int BN>
__device__ __forceinline__ void wg_acc_ab(float* acc, const u32 (*a)[4], const unsigned char* b) {
  wg_hold<DP / 2>(acc);
  wg_fence();
#pragma unroll
  for (int kc = 0; kc < BN / 16; ++kc) {
    const u64 db = wg_desc(b + kc * 16 * 128, BN * 128, 1024);
    if constexpr (DP == 128)
      wg_rs_n128(acc, a[kc], db);
    else
      wg_rs_n64(acc, a[kc], db);
  }
  wg_commit();
  wg_wait0();
  wg_hold<DP / 2>(acc);
}
// The thread's columns 8 j + 2 tq (+ 1) of its row `i` (0: row g, 1: g + 8) of acc[DP / 2],
// times `mul`, into `row` (columns past d are not written).
__device__ __forceinline__ void wg_store_row(T* row, const float* acc, int i, float mul, int tq, i64 d) {
#pragma unroll
  for (int j = 0; j < DP / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const i64 c = 8 * j + 2 * tq + e;
      if (c < d) st(&row[c], acc[4 * j + 2 * i + e] * mul);
    }
}

#if FA_FWD_WG
__device__ __forceinline__ void fwd_wg(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                       T* __restrict__ o, float* __restrict__ lse, Dims dm, double scale, int causal,
                                       i64 blk, const i64* __restrict__ pos) {
  constexpr int BM = FBR, BN = FBC;
  static_assert(DP == 128 && BM == 128 && BN == 64 && FNT == 256, "fwd_wg: two warpgroups, 128 queries, 64 keys");
  FLASH_SMEM(raw);
  unsigned char* sq = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
  unsigned char* sk = sq + BM * DP * 2;  // 2 stages of BN x DP
  unsigned char* sv = sk + 2 * BN * DP * 2;
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t;
  const QBlock qb = q_block<BM, BN>(dm, causal, blk);
  const CachedKeys ck = cached_keys<BM, BN>(dm, pos, qb);
  const i64 q0 = qb.q0, bh = qb.bh, qh = q_at(dm, qb.b, qb.h), S = ck.s;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  // In 32 bits from here on (src/flash.rs keeps T, S and the cache positions under 2^30).
  const int Si = (int)S, q0i = (int)q0, offi = (int)ck.off;
  const float sl2 = log2_scale(scale);
  // The softmax scales the scores first (any sign of scale; m in log2 units) and rescales the
  // accumulator on every tile: on the H200 faster here than fwd's conditional rescaling (which
  // spilled) and than keeping the maximum on the raw scores (a second path for a negative scale,
  // which spilled too).
  const int wrow = q0i + wg * 64 + w * 16, row0 = wrow + g;  // the warp's first row; the thread's rows row0, row0 + 8
  const int crow = wrow + offi;                                // its position (causal comparisons)
  const int wglast = q0i + wg * 64 + 63 + offi;               // the warpgroup's last row's position

  load_sw<BM, FNT>(sq, q + qh, q0, T_ - q0, (int)d, (int)dm.qrs, vec);
  float acc[DP / 2];
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) acc[i] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // running maximum of the scaled scores (log2 units)

  wg_kv_tiles<BN, FNT>(sk, sv, k + qb.kv, v + qb.kv, S, (int)d, (int)dm.krs, vec, ck.ntiles,
                       [&](const int j0, const unsigned char* ks, const unsigned char* vs) {
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
      const bool mask = j0 + BN > Si || (causal && j0 + BN - 1 > crow);  // warp-uniform
      // In 32 bits, relative to the tile: keys at or past kmax are out; causal: key k is out of
      // row r when k - r > crow - j0 (at least -63 here: the tile is visible to the warpgroup).
      const int kmax = min(Si - j0, BN), rel = causal ? min(crow - j0, BN) : BN;
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
      wg_pack_a<BN>(pa, s);
      wg_acc_ab<BN>(acc, pa, vs);  // O += P V
    }
  });
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float lt = quad_sum(l[i]);
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    const i64 r = row0 + 8 * i;
    if (r < T_) {
      if (tq == 0) lse[bh * T_ + r] = lt > 0.f ? (m[i] + log2f(lt)) * LN2 : NEG_INF;
      wg_store_row(o + qh + r * dm.qrs, acc, i, inv, tq, d);
    }
  }
}
#endif  // FA_FWD_WG

#if FA_DQ_WG
// ---- backward: dQ of BM = 128 queries of one (batch, query head) on wgmma (FA_DQ_WG), two
// warpgroups as fwd_wg, keys in tiles of 64 (K and V double-buffered). Per tile: S = Q K^T and
// dP = dO V^T (DP/16 wgmma m64n64k16 each, all operands K-major in shared memory, one commit
// group), P = 2^(S scale log2 e - lse log2 e), dS = P (dP - delta) in registers, then dQ += dS K
// (4 wgmma m64nDPk16, dS from registers, K from shared memory MN-major as fwd_wg's V). Q and dO
// are [halves][128][64] swizzled tiles, K and V as in fwd_wg. ----
__device__ __forceinline__ void bwd_dq_wg(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                          const float* __restrict__ lse, const T* __restrict__ dout,
                                          const float* __restrict__ delta, T* __restrict__ dq, Dims dm, double scale,
                                          int causal, i64 blk) {
  constexpr int BM = BR, BN = BC;
  static_assert((DP == 64 || DP == 128) && BM == 128 && BN == 64 && QNT == 256,
                "bwd_dq_wg: two warpgroups, 128 queries, 64 keys, head size 64 or 128");
  FLASH_SMEM(raw);
  unsigned char* sq = (unsigned char*)(((unsigned long long)raw + 1023) & ~1023ull);
  unsigned char* sdo = sq + BM * DP * 2;
  unsigned char* sk = sdo + BM * DP * 2;  // 2 stages of BN x DP
  unsigned char* sv = sk + 2 * BN * DP * 2;
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const QBlock qb = q_block<BM, BN>(dm, causal, blk);
  const i64 q0 = qb.q0, bh = qb.bh, qh = q_at(dm, qb.b, qb.h);
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const float sl2 = log2_scale(scale);
  const i64 wrow = q0 + wg * 64 + w * 16, row0 = wrow + g;
  const i64 wglast = q0 + wg * 64 + 63;

  load_sw<BM, QNT>(sq, q + qh, q0, T_ - q0, (int)d, (int)dm.qrs, vec);
  load_sw<BM, QNT>(sdo, dout + qh, q0, T_ - q0, (int)d, (int)dm.qrs, vec);
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

  wg_kv_tiles<BN, QNT>(sk, sv, k + qb.kv, v + qb.kv, S, (int)d, (int)dm.krs, vec, qb.ntiles,
                       [&](const int j0i, const unsigned char* ks, const unsigned char* vs) {
    const i64 j0 = j0i;
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
      wg_pack_a<BN>(da, dp);
      wg_acc_ab<BN>(acc, da, ks);  // dQ += dS K
    }
  });
  const float sc = (float)scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const i64 r = row0 + 8 * i;
    if (r < T_) wg_store_row(dq + qh + r * dm.qrs, acc, i, sc, tq, d);
  }
}
#endif  // FA_DQ_WG
}  // namespace fa

#if FA_FWD_WG
// Two blocks of 256 threads a multiprocessor: at most 128 registers a thread.
extern "C" __global__ void __launch_bounds__(FA_FWD_THREADS, 2)
    flash_fwd(const fa::T* q, const fa::T* k, const fa::T* v, fa::T* o, float* lse, fa::Dims dm, double scale,
              int causal) {
  pdl_enter();
  fa::each_block((dm.t + fa::FBR - 1) / fa::FBR, 1,
                 [&](i64 blk) { fa::fwd_wg(q, k, v, o, lse, dm, scale, causal, blk, nullptr); });
}
// The forward over a KV cache, as flash_attn.cu's flash_fwd_cached.
extern "C" __global__ void __launch_bounds__(FA_FWD_THREADS, 2)
    flash_fwd_cached(const fa::T* q, const fa::T* k, const fa::T* v, const i64* pos, fa::T* o, float* lse, fa::Dims dm,
                     double scale) {
  pdl_enter();
  fa::each_block((dm.t + fa::FBR - 1) / fa::FBR, 1,
                 [&](i64 blk) { fa::fwd_wg(q, k, v, o, lse, dm, scale, 1, blk, pos); });
}
#endif
#if FA_DQ_WG
extern "C" __global__ void __launch_bounds__(FA_DQ_THREADS)
    flash_bwd_dq(const fa::T* q, const fa::T* k, const fa::T* v, const float* lse, const fa::T* dout,
                 const float* delta, fa::T* dq, fa::Dims dm, double scale, int causal) {
  pdl_enter();
  fa::each_block((dm.t + fa::BR - 1) / fa::BR, 1,
                 [&](i64 blk) { fa::bwd_dq_wg(q, k, v, lse, dout, delta, dq, dm, scale, causal, blk); });
}
#endif
