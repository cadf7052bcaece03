// Flash attention on the tensor cores (bf16 / f16 operands, f32 accumulation), forward and
// backward, for grouped-query heads and any head size up to 256 (zero-padded to FDP, a multiple
// of 16). Tiles of Q, K, V (and dO) live in shared memory; scores and probabilities only in
// registers; the forward saves o and the log-sum-exp, the backward recomputes P from them.
//
// One module per (FT, FDP): the including source defines FT (bf16 or f16) and FDP first.
// Warp-level building blocks (mma.sync m16n8k16, ldmatrix, cp.async) are wrapped in small
// functions so that the CPU emulator (tests/flash_emu/) can stand in for them.
//
// Every block has 4 warps; a warp owns 16 rows of the first operand of each product (32 rows in
// the forward for head sizes up to 128, each K/V fragment then feeding two mma). Fragment
// layouts (PTX ISA, mma.m16n8k16): with g = lane / 4 and t = lane % 4, an accumulator tile c[4]
// holds rows (g, g, g+8, g+8) and columns (2t, 2t+1, 2t, 2t+1); an A fragment a[4] holds rows
// g / g+8 and columns 2t..2t+1 / 8+2t..8+2t+1; a B fragment b[2] holds k rows 2t..2t+1 and
// 8+2t..8+2t+1 of column g. Two neighbouring accumulator tiles are therefore one A fragment,
// which is how P (and dS) go from one product to the next without leaving registers.
//
// Deterministic: no atomics. The backward runs three kernels: delta = rowsum(dO * O), then
// dK/dV with each block owning a block of keys (looping over the query heads of its group and
// their queries in a fixed order), then dQ with each block owning a block of queries.

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
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
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

namespace fa {
typedef FT T;
struct Dims { i64 b, hq, hkv, t, s, d; };  // the blob every attention kernel takes
constexpr int NT = 128;                      // threads per block (4 warps)
constexpr int DP = FDP;                      // padded head size
constexpr int LD = DP + 8;                   // smem row stride (elements): ldmatrix rows hit distinct banks
constexpr int BR = 64;                       // dq: queries per block (16 per warp)
constexpr int BC = DP <= 128 ? 64 : 32;      // dq: keys per tile
constexpr int FMT = DP <= 128 ? 2 : 1;       // forward: 16-row m-tiles per warp (K/V fragments shared)
constexpr int FBR = 64 * FMT;                // forward: queries per block
constexpr int FBC = DP <= 64 ? 64 : 32;      // forward: keys per tile
constexpr int BK = 64;                       // dk/dv: keys per block (16 per warp)
constexpr int BQ = DP <= 64 ? 64 : 32;       // dk/dv: queries per tile
constexpr int DC = DP <= 128 ? DP : 128;     // dk/dv: head dims accumulated per block
// Launch shape (mirrored by src/flash.rs): rows of the grid's x axis per block, shared bytes.
constexpr int FWD_ROWS = FBR, DQ_ROWS = BR, DKDV_KEYS = BK, NCHUNK = (DP + DC - 1) / DC;
constexpr int SMEM_FWD = (FBR + 4 * FBC) * LD * 2;
constexpr int SMEM_DQ = (2 * BR + 4 * BC) * LD * 2;
constexpr int SMEM_DKDV = (2 * BK + 4 * BQ) * LD * 2 + 4 * BQ * 4;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
#define NEG_INF (-F32_INF)

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }

// Rows [row0, row0 + ROWS) of a row-major [*, d] matrix into a [ROWS][LD] shared tile; rows at
// or past `valid` and columns at or past d are zeros. `vec`: 16-byte cp.async (d % 8 == 0 and
// aligned pointers), else element by element (synchronous).
template <int ROWS>
__device__ __forceinline__ void load_tile(T* sm, const T* g, i64 row0, i64 valid, i64 d, bool vec) {
  if (vec) {
    constexpr int CH = DP / 8;
    for (int c = threadIdx.x; c < ROWS * CH; c += NT) {
      int r = c / CH, cc = c % CH;
      bool ok = r < valid && cc * 8 < d;
      const T* src = ok ? g + (row0 + r) * d + cc * 8 : g;
      cp_async16(sm + r * LD + cc * 8, src, ok ? 16 : 0);
    }
  } else {
    for (int e = threadIdx.x; e < ROWS * DP; e += NT) {
      int r = e / DP, c = e % DP;
      T x;
      x.x = 0;
      if (r < valid && c < d) x = g[(row0 + r) * d + c];
      sm[r * LD + c] = x;
    }
  }
}

// Lane offsets (in elements, into a [*][LD] tile) of ldmatrix x4 fetches:
// A operand 16x16 at (0,0) / B^T operand (rows are n) for two n-tiles / B via .trans (rows are k).
__device__ __forceinline__ int a_off(int lane) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8; }
__device__ __forceinline__ int bt_off(int lane) { return ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int b_off(int lane) { return a_off(lane); }

// acc[N/8][4] += A(16 x DP rows of `a`) * B^T where B^T is N rows of `b` (both [*][LD] tiles).
template <int N>
__device__ __forceinline__ void mma_abt(float (*acc)[4], const T* a, const T* b, int lane) {
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    u32 fa[4];
    ldsm_x4(fa, a + a_off(lane) + kk * 16);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      u32 fb[4];
      ldsm_x4(fb, b + np * 16 * LD + bt_off(lane) + kk * 16);
      mma16816(acc[2 * np], fa, fb[0], fb[1]);
      mma16816(acc[2 * np + 1], fa, fb[2], fb[3]);
    }
  }
}

// acc[NC/8][4] += P(16 x K, as accumulator tiles p[K/8][4]) * B(K rows of `b`, columns
// [c0, c0 + NC) clipped to DP).
template <int K, int NC>
__device__ __forceinline__ void mma_pb(float (*acc)[4], const float (*p)[4], const T* b, int c0, int lane) {
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    u32 fa[4] = {pack2(p[2 * kc][0], p[2 * kc][1]), pack2(p[2 * kc][2], p[2 * kc][3]),
                 pack2(p[2 * kc + 1][0], p[2 * kc + 1][1]), pack2(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int np = 0; np < NC / 16; ++np) {
      if (c0 + np * 16 < DP) {
        u32 fb[4];
        ldsm_x4_t(fb, b + kc * 16 * LD + b_off(lane) + c0 + np * 16);
        mma16816(acc[2 * np], fa, fb[0], fb[1]);
        mma16816(acc[2 * np + 1], fa, fb[2], fb[3]);
      }
    }
  }
}

// The forward's products with MT m-tiles per warp (rows a + mt * 16 * LD): each B fragment
// loaded from shared memory feeds MT mma instructions.
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
template <int MT, int K>
__device__ __forceinline__ void mma_pb_m(float (*acc)[DP / 8][4], const float (*p)[K / 8][4], const T* b, int lane) {
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
    for (int np = 0; np < DP / 16; ++np) {
      u32 fb[4];
      ldsm_x4_t(fb, b + kc * 16 * LD + b_off(lane) + np * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(acc[mt][2 * np], fa[mt], fb[0], fb[1]);
        mma16816(acc[mt][2 * np + 1], fa[mt], fb[2], fb[3]);
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
__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// ---- forward: one block per FBR queries of one (batch, query head); each warp FMT x 16 rows ----
__device__ void fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                    float* __restrict__ lse, Dims dm, double scale, int causal) {
  constexpr int MT = FMT, BR = FBR, BC = FBC;
  FLASH_SMEM(smem);
  T* sq = (T*)smem;
  T* sk = sq + BR * LD;      // 2 stages of BC rows
  T* sv = sk + 2 * BC * LD;  // 2 stages of BC rows
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BR - 1) / BR;
  const i64 q0 = (nqb - 1 - (i64)blockIdx.x) * BR;  // the longest causal rows first
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = b * dm.hkv + h / (dm.hq / dm.hkv);
  const T* qh = q + bh * T_ * d;
  const T* kh = k + kvh * S * d;
  const T* vh = v + kvh * S * d;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  const i64 kend = causal ? min64(S, q0 + BR) : S;
  const int ntiles = (int)((kend + BC - 1) / BC);
  const float sl2 = (float)(scale * 1.4426950408889634);
  const i64 wrow = q0 + w * 16 * MT;  // the warp's first row

  load_tile<BR>(sq, qh, q0, T_ - q0, d, vec);
  if (ntiles > 0) {
    load_tile<BC>(sk, kh, 0, S, d, vec);
    load_tile<BC>(sv, vh, 0, S, d, vec);
  }
  cp_commit();
  float acc[MT][DP / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    m[mt][0] = m[mt][1] = NEG_INF;
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int it = 0; it < ntiles; ++it) {
    const i64 j0 = (i64)it * BC;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_tile<BC>(sk + st * BC * LD, kh, j0 + BC, S - j0 - BC, d, vec);
      load_tile<BC>(sv + st * BC * LD, vh, j0 + BC, S - j0 - BC, d, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const T* ks = sk + (it & 1) * BC * LD;
    const T* vs = sv + (it & 1) * BC * LD;
    float s[MT][BC / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    mma_abt_m<MT, BC>(s, sq + w * 16 * MT * LD, ks, lane);

    const bool mask = j0 + BC > S || (causal && j0 + BC - 1 > wrow);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const i64 row[2] = {wrow + mt * 16 + g, wrow + mt * 16 + g + 8};
      float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][n][e] * sl2;
          if (mask) {
            const i64 key = j0 + n * 8 + 2 * tq + (e & 1);
            if (key >= S || (causal && key > row[e >> 1])) x = NEG_INF;
          }
          s[mt][n][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      float mu[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float mn = fmaxf(m[mt][i], quad_max(mx[i]));
        mu[i] = mn == NEG_INF ? 0.f : mn;  // a row with nothing visible yet keeps p = 0
        const float alpha = ex2(m[mt][i] - mu[i]);
        m[mt][i] = mn;
        l[mt][i] *= alpha;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
          acc[mt][n][2 * i] *= alpha;
          acc[mt][n][2 * i + 1] *= alpha;
        }
      }
#pragma unroll
      for (int n = 0; n < BC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = ex2(s[mt][n][e] - mu[e >> 1]);
          s[mt][n][e] = p;
          l[mt][e >> 1] += p;
        }
    }
    mma_pb_m<MT, BC>(acc, s, vs, lane);
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
        if (tq == 0) lse[bh * T_ + r] = lt > 0.f ? (m[mt][i] + log2f(lt)) * LN2 : NEG_INF;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const i64 c = n * 8 + 2 * tq + e;
            if (c < d) st(&o[(bh * T_ + r) * d + c], acc[mt][n][2 * i + e] * inv);
          }
      }
    }
}

// ---- backward 1/3: delta = rowsum(dO * O) in f32, one warp per row ----
__device__ void bwd_delta(const T* __restrict__ o, const T* __restrict__ dout, float* __restrict__ delta, i64 rows, i64 d) {
  const int lane = threadIdx.x & 31;
  for (i64 r = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * (NT / 32)) {
    float a = 0.f;
    for (i64 c = lane; c < d; c += 32) a += ld(o[r * d + c]) * ld(dout[r * d + c]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) a += shfl_xor(a, x);
    if (lane == 0) delta[r] = a;
  }
}

// ---- backward 2/3: dK, dV of 64 keys of one (batch, kv head), head dims [c0, c0 + DC) ----
__device__ void bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
                         T* __restrict__ dk, T* __restrict__ dv, Dims dm, double scale, int causal) {
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
  const i64 k0 = ((i64)blockIdx.x / NCH) * BK;
  const int c0 = (int)(blockIdx.x % NCH) * DC;
  const i64 bk = blockIdx.y, b = bk / dm.hkv, kvh = bk % dm.hkv;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const float sl2 = (float)(scale * 1.4426950408889634);
  const i64 qstart = causal ? k0 : 0;  // k0 is a multiple of BQ
  const int nqt = T_ > qstart ? (int)((T_ - qstart + BQ - 1) / BQ) : 0;
  const int total = (int)group * nqt;

  load_tile<BK>(sk, k + bk * S * d, k0, S - k0, d, vec);
  load_tile<BK>(sv, v + bk * S * d, k0, S - k0, d, vec);
  // Tile `it`: query head b*hq + kvh*group + it / nqt, queries from qstart + (it % nqt) * BQ.
  auto load_q = [&](int it, int st) {
    const i64 bh = b * dm.hq + kvh * group + it / nqt;
    const i64 i0 = qstart + (i64)(it % nqt) * BQ;
    load_tile<BQ>(sq + st * BQ * LD, q + bh * T_ * d, i0, T_ - i0, d, vec);
    load_tile<BQ>(sdo + st * BQ * LD, dout + bh * T_ * d, i0, T_ - i0, d, vec);
    for (int e = threadIdx.x; e < BQ; e += NT) {
      const bool ok = i0 + e < T_;
      sl[st * BQ + e] = ok ? lse[bh * T_ + i0 + e] * LOG2E : 0.f;
      sd[st * BQ + e] = ok ? delta[bh * T_ + i0 + e] : 0.f;
    }
  };
  if (total > 0) load_q(0, 0);
  cp_commit();

  float gk[DC / 8][4], gv[DC / 8][4];
#pragma unroll
  for (int n = 0; n < DC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) gk[n][e] = gv[n][e] = 0.f;
  const i64 key[2] = {k0 + w * 16 + g, k0 + w * 16 + g + 8};

  for (int it = 0; it < total; ++it) {
    if (it + 1 < total) {
      load_q(it + 1, (it + 1) & 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const int st = it & 1;
    const T* qs = sq + st * BQ * LD;
    const T* dos = sdo + st * BQ * LD;
    const i64 i0 = qstart + (i64)(it % nqt) * BQ;
    float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
    mma_abt<BQ>(s, sk + w * 16 * LD, qs, lane);    // S^T = K Q^T
    mma_abt<BQ>(dp, sv + w * 16 * LD, dos, lane);  // dP^T = V dO^T
    const bool mask = i0 + BQ > T_ || (causal && i0 < k0 + w * 16 + 15);
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ci = n * 8 + 2 * tq + (e & 1);
        float p = ex2(s[n][e] * sl2 - sl[st * BQ + ci]);
        if (mask) {
          const i64 qi = i0 + ci;
          if (qi >= T_ || (causal && qi < key[e >> 1])) p = 0.f;
        }
        s[n][e] = p;
        dp[n][e] = p * (dp[n][e] - sd[st * BQ + ci]);
      }
    mma_pb<BQ, DC>(gv, s, dos, c0, lane);  // dV += P^T dO
    mma_pb<BQ, DC>(gk, dp, qs, c0, lane);  // dK += dS^T Q
    FLASH_SYNC();
  }
  cp_wait<0>();

  const float sc = (float)scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const i64 r = key[i];
    if (r < S) {
#pragma unroll
      for (int n = 0; n < DC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const i64 c = c0 + n * 8 + 2 * tq + e;
          if (c < d) {
            st(&dk[(bk * S + r) * d + c], gk[n][2 * i + e] * sc);
            st(&dv[(bk * S + r) * d + c], gv[n][2 * i + e]);
          }
        }
    }
  }
}

// ---- backward 3/3: dQ of 64 queries of one (batch, query head) ----
__device__ void bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
                       T* __restrict__ dq, Dims dm, double scale, int causal) {
  FLASH_SMEM(smem);
  T* sq = (T*)smem;
  T* sdo = sq + BR * LD;
  T* sk = sdo + BR * LD;     // 2 stages of BC rows
  T* sv = sk + 2 * BC * LD;  // 2 stages of BC rows
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BR - 1) / BR;
  const i64 q0 = (nqb - 1 - (i64)blockIdx.x) * BR;
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = b * dm.hkv + h / (dm.hq / dm.hkv);
  const T* kh = k + kvh * S * d;
  const T* vh = v + kvh * S * d;
  const bool vec = d % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout);
  const i64 kend = causal ? min64(S, q0 + BR) : S;
  const int ntiles = (int)((kend + BC - 1) / BC);
  const float sl2 = (float)(scale * 1.4426950408889634);

  load_tile<BR>(sq, q + bh * T_ * d, q0, T_ - q0, d, vec);
  load_tile<BR>(sdo, dout + bh * T_ * d, q0, T_ - q0, d, vec);
  if (ntiles > 0) {
    load_tile<BC>(sk, kh, 0, S, d, vec);
    load_tile<BC>(sv, vh, 0, S, d, vec);
  }
  cp_commit();
  const i64 row[2] = {q0 + w * 16 + g, q0 + w * 16 + g + 8};
  float L[2], D[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool ok = row[i] < T_;
    L[i] = ok ? lse[bh * T_ + row[i]] * LOG2E : 0.f;
    D[i] = ok ? delta[bh * T_ + row[i]] : 0.f;
  }
  float acc[DP / 8][4];
#pragma unroll
  for (int n = 0; n < DP / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int it = 0; it < ntiles; ++it) {
    const i64 j0 = (i64)it * BC;
    if (it + 1 < ntiles) {
      const int st = (it + 1) & 1;
      load_tile<BC>(sk + st * BC * LD, kh, j0 + BC, S - j0 - BC, d, vec);
      load_tile<BC>(sv + st * BC * LD, vh, j0 + BC, S - j0 - BC, d, vec);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const T* ks = sk + (it & 1) * BC * LD;
    const T* vs = sv + (it & 1) * BC * LD;
    float s[BC / 8][4], dp[BC / 8][4];
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
    mma_abt<BC>(s, sq + w * 16 * LD, ks, lane);
    mma_abt<BC>(dp, sdo + w * 16 * LD, vs, lane);
    const bool mask = j0 + BC > S || (causal && j0 + BC - 1 > q0 + w * 16);
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = ex2(s[n][e] * sl2 - L[e >> 1]);
        if (mask) {
          const i64 key = j0 + n * 8 + 2 * tq + (e & 1);
          if (key >= S || (causal && key > row[e >> 1])) p = 0.f;
        }
        dp[n][e] = p * (dp[n][e] - D[e >> 1]);
      }
    mma_pb<BC, DP>(acc, dp, ks, 0, lane);  // dQ += dS K
    FLASH_SYNC();
  }
  cp_wait<0>();

  const float sc = (float)scale;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const i64 r = row[i];
    if (r < T_) {
#pragma unroll
      for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const i64 c = n * 8 + 2 * tq + e;
          if (c < d) st(&dq[(bh * T_ + r) * d + c], acc[n][2 * i + e] * sc);
        }
    }
  }
}
}  // namespace fa

extern "C" __global__ void __launch_bounds__(fa::NT) flash_fwd(const fa::T* q, const fa::T* k, const fa::T* v,
                                                               fa::T* o, float* lse, fa::Dims dm, double scale,
                                                               int causal) {
  fa::fwd(q, k, v, o, lse, dm, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_delta(const fa::T* o, const fa::T* dout, float* delta,
                                                                     i64 rows, i64 d) {
  fa::bwd_delta(o, dout, delta, rows, d);
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_dkdv(const fa::T* q, const fa::T* k, const fa::T* v,
                                                                    const float* lse, const fa::T* dout,
                                                                    const float* delta, fa::T* dk, fa::T* dv,
                                                                    fa::Dims dm, double scale, int causal) {
  fa::bwd_dkdv(q, k, v, lse, dout, delta, dk, dv, dm, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_dq(const fa::T* q, const fa::T* k, const fa::T* v,
                                                                  const float* lse, const fa::T* dout,
                                                                  const float* delta, fa::T* dq, fa::Dims dm,
                                                                  double scale, int causal) {
  fa::bwd_dq(q, k, v, lse, dout, delta, dq, dm, scale, causal);
}
