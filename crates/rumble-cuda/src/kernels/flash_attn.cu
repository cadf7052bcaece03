// Flash attention on the tensor cores (bf16 / f16 operands, f32 accumulation), forward and
// backward, for grouped-query heads and any head size up to 256 (zero-padded to FDP, a multiple
// of 16). Tiles of Q, K, V (and dO) live in shared memory; scores and probabilities only in
// registers; the forward saves o and the log-sum-exp, the backward recomputes P from them.
//
// One module per (FT, FDP): src/flash.rs puts the prelude, the module's `#define`s (FT, FDP and
// the tile sizes and launch shape of the head-size bucket, `Tiles` there: FA_FWD_ROWS ...) and
// flash_common.cuh before this file, and flash_wg.cuh after it where Hopper's warpgroup MMA
// takes the forward (FA_FWD_WG) or dQ (FA_DQ_WG). This file has no tile decision of its own.
// Warp-level building blocks (mma.sync m16n8k16, ldmatrix, cp.async) are wrapped in small
// functions so that the CPU emulator (tests/flash_emu/) can stand in for them.
//
// A warp owns 16 x MT rows of the first operand of each product (MT m-tiles: each fragment of
// the second operand read from shared memory then feeds MT mma). Every kernel here has 4 warps.
// Fragment layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4, an accumulator
// tile c[4] holds rows (g, g, g+8, g+8) and columns (2t, 2t+1, 2t, 2t+1); an A fragment a[4]
// holds rows g / g+8 and columns 2t..2t+1 / 8+2t..8+2t+1; a B fragment b[2] holds k rows
// 2t..2t+1 and 8+2t..8+2t+1 of column g. Two neighbouring accumulator tiles are therefore one A
// fragment, which is how P (and dS) go from one product to the next without leaving registers.
//
// Deterministic: no atomics. The backward runs three kernels, delta = rowsum(dO * O), then dK/dV
// with each block owning a block of keys (looping over the query heads of its group and their
// queries in a fixed order), then dQ with each block owning a block of queries. S and dP are
// computed in one interleaved loop (mma_abt2_m). Where a kv head's group of query heads is split
// over several dK/dV blocks (Split, below), one more kernel adds their f32 partial sums in a
// fixed order.

#ifndef FLASH_EMU
// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
// c += a * b for one 16x8x16 tile; pack2 puts lo in the low half (the lower column).
#if FLASH_F16
#define MMA_AB "f16.f16"
#define CVT_X2 "f16x2"
#else
#define MMA_AB "bf16.bf16"
#define CVT_X2 "bf16x2"
#endif
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm("cvt.rn." CVT_X2 ".f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif  // FLASH_EMU

namespace fa {
typedef FT T;
constexpr int DP = FDP;     // padded head size
constexpr int LD = DP + 8;  // smem row stride (elements): ldmatrix rows hit distinct banks
// The bucket's tiles (src/flash.rs `Tiles`, as defines). Forward: FBR queries a block by FNT
// threads (FMT m-tiles a warp), keys in shared stages of FBC taken in softmax steps of FSUB. dK/dV:
// BK keys a block (16 a warp), head dims [c0, c0 + DC) (NCHUNK blocks per key block), queries in
// tiles of BQ. dQ: BR queries a block (QMT m-tiles a warp), keys in tiles of BC.
constexpr int FBR = FA_FWD_ROWS, FBC = FA_FWD_KEYS, FSUB = FA_FWD_STEP, FNT = FA_FWD_THREADS, FMT = FBR / (FNT / 2);
constexpr int BK = FA_DKDV_KEYS, BQ = FA_DKDV_QUERIES, DC = FA_DKDV_DIMS, NCHUNK = FA_NCHUNK, DKNT = FA_DKDV_THREADS;
constexpr int BR = FA_DQ_ROWS, BC = FA_DQ_KEYS, QNT = FA_DQ_THREADS, QMT = BR / (QNT / 2);
constexpr int NT = FA_THREADS;  // threads of the delta and partial-sum kernels
static_assert(FBC % FSUB == 0 && BK % BQ == 0 && BK == DKNT / 2 && NCHUNK * DC >= DP, "flash tile sizes");

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

// The K and V tiles of BC keys (rows of `kh`, `vh`, krs apart) that the forward and dQ stream
// through two shared stages each (sk, sv), loaded by NTH threads. kv_first issues tile 0 (the
// caller commits it with its own loads); kv_next(it) waits for tile `it` of `nt` (in stage
// it & 1), the next one loading into the other stage behind it.
template <int NTH, int BC>
__device__ __forceinline__ void kv_first(T* sk, T* sv, const T* kh, const T* vh, int nt, i64 S, i64 d, i64 krs,
                                         bool vec) {
  if (nt > 0) {
    load_tile<NTH, BC>(sk, kh, 0, S, d, krs, vec);
    load_tile<NTH, BC>(sv, vh, 0, S, d, krs, vec);
  }
}
template <int NTH, int BC>
__device__ __forceinline__ void kv_next(T* sk, T* sv, const T* kh, const T* vh, int it, int nt, i64 S, i64 d, i64 krs,
                                        bool vec) {
  const i64 j0 = (i64)it * BC;
  if (it + 1 < nt) {
    const int st = (it + 1) & 1;
    load_tile<NTH, BC>(sk + st * BC * LD, kh, j0 + BC, S - j0 - BC, d, krs, vec);
    load_tile<NTH, BC>(sv + st * BC * LD, vh, j0 + BC, S - j0 - BC, d, krs, vec);
    cp_commit();
    cp_wait<1>();
  } else {
    cp_wait<0>();
  }
  FLASH_SYNC();
}
// Calls put(r, c, mt, n, x) for every element acc[mt][n][x] of a warp's MT x N/8 accumulator
// tiles whose row r = r0 + 16 mt + g (+ 8) is below `rows` and whose column c = c0 + 8 n + 2 tq
// (+ 1) is below d: the kernels' epilogues.
template <int MT, int N, class F>
__device__ __forceinline__ void each_acc(i64 r0, i64 rows, i64 c0, i64 d, int g, int tq, F put) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const i64 r = r0 + mt * 16 + g + 8 * i;
      if (r < rows) {
#pragma unroll
        for (int n = 0; n < N / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const i64 c = c0 + n * 8 + 2 * tq + e;
            if (c < d) put(r, c, mt, n, 2 * i + e);
          }
      }
    }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, shfl_xor(v, 1));
  return fmaxf(v, shfl_xor(v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += shfl_xor(v, 1);
  return v + shfl_xor(v, 2);
}

#if !FA_FWD_WG
// ---- forward: one block per FBR queries of one (batch, query head); each warp FMT x 16 rows ----
// The running row maximum m is kept on the raw scores q.k (their minimum when NEG, a negative
// scale), so each probability is one FFMA and one ex2: p = 2^(s * scale * log2 e - m * |...|).
template <bool NEG>
__device__ __forceinline__ void fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                    T* __restrict__ o, float* __restrict__ lse, Dims dm, double scale, int causal, i64 blk,
                                    const i64* __restrict__ pos) {
  constexpr int MT = FMT, BR = FBR, BC = FBC, SUB = FSUB, NTH = FNT;
  FLASH_SMEM(smem);
  T* sq = (T*)smem;
  T* sk = sq + BR * LD;      // 2 stages of BC rows
  T* sv = sk + 2 * BC * LD;  // 2 stages of BC rows
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t;
  const QBlock qb = q_block<BR, BC>(dm, causal, blk);
  const CachedKeys ck = cached_keys<BR, BC>(dm, pos, qb);
  const i64 q0 = qb.q0, bh = qb.bh, S = ck.s;
  const int ntiles = ck.ntiles;
  T* const oh = o + q_at(dm, qb.b, qb.h);
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  const float sl2 = log2_scale(scale);
  const float asl2 = NEG ? -sl2 : sl2;
  const float MASKV = NEG ? F32_INF : NEG_INF;     // a masked raw score: never the row's maximum
  const i64 wrow = q0 + w * 16 * MT;                // the warp's first row
  const i64 crow = wrow + ck.off;                   // its position (causal comparisons)
  const i64 clast = crow + 16 * MT - 1;             // and its last row's

  load_tile<NTH, BR>(sq, q + q_at(dm, qb.b, qb.h), q0, T_ - q0, d, dm.qrs, vec);
  kv_first<NTH, BC>(sk, sv, k + qb.kv, v + qb.kv, ntiles, S, d, dm.krs, vec);
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
    kv_next<NTH, BC>(sk, sv, k + qb.kv, v + qb.kv, it, ntiles, S, d, dm.krs, vec);
    const T* ks = sk + (it & 1) * BC * LD;
    const T* vs = sv + (it & 1) * BC * LD;
#pragma unroll 1
    for (int sb = 0; sb < BC / SUB; ++sb) {
      const i64 kb0 = j0 + sb * SUB;
      if (kb0 >= S || (causal && kb0 > clast)) continue;  // no key of this step is visible to the warp
      float s[MT][SUB / 8][4];
      zero<MT, SUB / 8>(s);
      mma_abt_m<MT, SUB>(s, sq + w * 16 * MT * LD, ks + sb * SUB * LD, lane);

      auto softmax = [&](const bool MASK) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const i64 row[2] = {crow + mt * 16 + g, crow + mt * 16 + g + 8};
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
      if (kb0 + SUB > S || (causal && kb0 + SUB - 1 > crow))
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
            if (c < d) st(&oh[r * dm.qrs + c], acc[mt][n][2 * i + e] * inv);
          }
      }
    }
}
#endif  // !FA_FWD_WG

// ---- backward 1/3: delta = rowsum(dO * O) in f32, one warp per row (row r =
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
// 16 keys ----
__device__ void bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
                         T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ part, int nsplit, Dims dm,
                         double scale, int causal, i64 blk) {
  constexpr int MT = 1;
  FLASH_SMEM(smem);
  T* sk = (T*)smem;
  T* sv = sk + BK * LD;
  T* sq = sv + BK * LD;       // 2 stages of BQ rows
  T* sdo = sq + 2 * BQ * LD;  // 2 stages of BQ rows
  float* sl = (float*)(sdo + 2 * BQ * LD);  // 2 stages of BQ: lse * log2(e)
  float* sd = sl + 2 * BQ;                   // 2 stages of BQ: delta
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s, group = dm.hq / dm.hkv;
  const i64 k0 = (blk / NCHUNK) * BK;
  const int c0 = (int)(blk % NCHUNK) * DC;
  const Split x = split_of(dm, nsplit);
  const i64 b = x.b, kvh = x.kvh;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const float sl2 = log2_scale(scale);
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
      mma_abt2_m<MT, BQ>(s, sk + w * 16 * MT * LD, qs, dp, sv + w * 16 * MT * LD, dos, lane);  // S^T, dP^T
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
  each_acc<MT, DC>(kw, S, c0, d, g, tq, [&](i64 r, i64 c, int mt, int n, int e) {
    store_dkdv(dk, dv, part, nsplit, dm, x, r, c, gk[mt][n][e] * sc, gv[mt][n][e]);
  });
}

#if !FA_DQ_WG
// ---- backward: dQ of BR queries of one (batch, query head); each warp QMT x 16 queries ----
__device__ void bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
                       T* __restrict__ dq, Dims dm, double scale, int causal, i64 blk) {
  constexpr int MT = QMT;
  FLASH_SMEM(smem);
  T* sq = (T*)smem;
  T* sdo = sq + BR * LD;
  T* sk = sdo + BR * LD;                  // 2 stages of BC rows
  T* sv = sk + 2 * BC * LD;               // 2 stages of BC rows
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const QBlock qb = q_block<BR, BC>(dm, causal, blk);
  const i64 q0 = qb.q0, bh = qb.bh, qh = q_at(dm, qb.b, qb.h);
  const int ntiles = qb.ntiles;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const float sl2 = log2_scale(scale);
  const i64 wrow = q0 + w * 16 * MT, wlast = wrow + 16 * MT - 1;

  load_tile<QNT, BR>(sq, q + qh, q0, T_ - q0, d, dm.qrs, vec);
  load_tile<QNT, BR>(sdo, dout + qh, q0, T_ - q0, d, dm.qrs, vec);
  kv_first<QNT, BC>(sk, sv, k + qb.kv, v + qb.kv, ntiles, S, d, dm.krs, vec);
  cp_commit();
  float L[MT][2], D[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const i64 row = wrow + mt * 16 + g + 8 * i;
      const bool ok = row < T_;
      L[mt][i] = ok ? lse[bh * T_ + row] * LOG2E : 0.f;
      D[mt][i] = ok ? delta[bh * T_ + row] : 0.f;
    }
  float acc[MT][DP / 8][4];
  zero<MT, DP / 8>(acc);

  for (int it = 0; it < ntiles; ++it) {
    const i64 j0 = (i64)it * BC;
    kv_next<QNT, BC>(sk, sv, k + qb.kv, v + qb.kv, it, ntiles, S, d, dm.krs, vec);
    const T* ks = sk + (it & 1) * BC * LD;
    const T* vs = sv + (it & 1) * BC * LD;
    // Causal: a tile whose keys all come after the warp's last query adds nothing.
    if (!(causal && j0 > wlast)) {
      float s[MT][BC / 8][4], dp[MT][BC / 8][4];
      zero<MT, BC / 8>(s);
      zero<MT, BC / 8>(dp);
      mma_abt2_m<MT, BC>(s, sq + w * 16 * MT * LD, ks, dp, sdo + w * 16 * MT * LD, vs, lane);  // S, dP
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
  each_acc<MT, DP>(wrow, T_, 0, d, g, tq,
                   [&](i64 r, i64 c, int mt, int n, int e) { st(&dq[qh + r * dm.qrs + c], acc[mt][n][e] * sc); });
}
#endif  // !FA_DQ_WG
}  // namespace fa

// The entry points (flash_wg.cuh defines flash_fwd and flash_bwd_dq where wgmma takes them).
#if !FA_FWD_WG
extern "C" __global__ void __launch_bounds__(FA_FWD_THREADS) flash_fwd(const fa::T* q, const fa::T* k, const fa::T* v,
                                                                       fa::T* o, float* lse, fa::Dims dm, double scale,
                                                                       int causal) {
  pdl_enter();
  fa::each_block((dm.t + fa::FBR - 1) / fa::FBR, 1, [&](i64 blk) {
    if (scale < 0)
      fa::fwd<true>(q, k, v, o, lse, dm, scale, causal, blk, nullptr);
    else
      fa::fwd<false>(q, k, v, o, lse, dm, scale, causal, blk, nullptr);
  });
}
// The forward over a KV cache (attention_cached with a prefill chunk's rows): q [B, T, HQ, D]
// at positions pos[b] .., k and v the caches [B, S, HKV, D] (dm in the bthd layout), causal at
// those positions (fa::cached_keys).
extern "C" __global__ void __launch_bounds__(FA_FWD_THREADS)
    flash_fwd_cached(const fa::T* q, const fa::T* k, const fa::T* v, const i64* pos, fa::T* o, float* lse, fa::Dims dm,
                     double scale) {
  pdl_enter();
  fa::each_block((dm.t + fa::FBR - 1) / fa::FBR, 1, [&](i64 blk) {
    if (scale < 0)
      fa::fwd<true>(q, k, v, o, lse, dm, scale, 1, blk, pos);
    else
      fa::fwd<false>(q, k, v, o, lse, dm, scale, 1, blk, pos);
  });
}
#endif
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_delta(const fa::T* o, const fa::T* dout, float* delta,
                                                                         fa::Dims dm) {
  pdl_enter();
  fa::bwd_delta(o, dout, delta, dm);
}
extern "C" __global__ void __launch_bounds__(FA_DKDV_THREADS)
    flash_bwd_dkdv(const fa::T* q, const fa::T* k, const fa::T* v, const float* lse, const fa::T* dout,
                   const float* delta, fa::T* dk, fa::T* dv, float* part, int nsplit, fa::Dims dm, double scale,
                   int causal) {
  pdl_enter();
  fa::each_block((dm.s + fa::BK - 1) / fa::BK, fa::NCHUNK, [&](i64 blk) {
    fa::bwd_dkdv(q, k, v, lse, dout, delta, dk, dv, part, nsplit, dm, scale, causal, blk);
  });
}
// dK and dV from flash_bwd_dkdv's nsplit partial sums (split order, so deterministic); four
// elements a thread where d % 4 == 0 (16-byte loads of the partials: the scratch is 256-byte
// aligned and each plane a multiple of 4 elements).
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_bwd_dkdv_sum(const float* part, fa::T* dk, fa::T* dv,
                                                                        fa::Dims dm, int nsplit) {
  pdl_enter();
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
#if !FA_DQ_WG
extern "C" __global__ void __launch_bounds__(FA_DQ_THREADS)
    flash_bwd_dq(const fa::T* q, const fa::T* k, const fa::T* v, const float* lse, const fa::T* dout,
                 const float* delta, fa::T* dq, fa::Dims dm, double scale, int causal) {
  pdl_enter();
  fa::each_block((dm.t + fa::BR - 1) / fa::BR, 1, [&](i64 blk) {
    fa::bwd_dq(q, k, v, lse, dout, delta, dq, dm, scale, causal, blk);
  });
}
#endif
