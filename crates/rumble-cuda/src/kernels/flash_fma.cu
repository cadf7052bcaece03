// Flash attention in f32 with plain FMA (exact f32, no TF32), forward and backward, for
// grouped-query heads and any head size up to 256 (FDPF: the head size rounded up to 32).
// The same entry points and arguments as flash_attn.cu (the tensor-core kernels for bf16 and
// f16) but dK/dV's split and dQ's o; one module per FDPF. src/flash.rs puts the prelude, the
// module's `#define`s (FDPF, the tile sizes FA_*) and flash_common.cuh before this file.
//
// A block is 256 threads. Every tile (Q, K, V, dO) sits in shared memory row-major with a row
// stride of DP + 4 floats, filled by cp.async (16 bytes at a time when the head size is a
// multiple of 4, plain loads otherwise) and, where shared memory allows, double-buffered so the
// next tile streams in while this one is used. Products are register-blocked: each thread owns
// a micro-tile of every result (rows spaced by the number of thread rows, columns spaced by the
// number of thread columns, or float4 column chunks for head-dim results) and reads its
// operands as float4 along the contracted dimension:
//   - "nt" (S = Q K^T, dP = dO V^T and their transposes): both operands contract along the
//     head dim, rows ty + TY * i of one and tx + TX * j of the other; the stride DP + 4 keeps
//     the 8 rows a quarter-warp reads in different banks;
//   - "nn" (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q): P / dS rows (float4 along the
//     keys or queries) times row-major head-dim rows (float4 column chunks).
// Probabilities and dS go through shared memory between the two products. Only o and the
// log-sum-exp are saved. Deterministic: no atomics (dK/dV and dQ are separate kernels, as
// for the tensor-core kernels).
//
// The tiling: 64-key tiles in the forward, 64-query tiles in dK/dV up to head size 128 (32
// above), 32-key tiles in dQ; single-buffered where two buffers no longer fit.

namespace fa {
typedef float T;
constexpr int NT = 256;     // threads of every kernel here
constexpr int DP = FDPF;    // head size rounded up to 32
constexpr int LD = DP + 4;  // row stride of every head-dim tile in shared memory
// The tiles (src/flash.rs `Variant::Fma`, as defines). Forward and dQ: FBR queries a block,
// threads 32 x 8 (ty = tid / 8, tx = tid % 8), RQ rows each; the forward's keys in tiles of FBC
// (a thread's score tile: RQ x FBC / 8), dQ's in tiles of QBC (Q and dO stay resident). FNB,
// QNB, KNB: buffers of the streamed tiles (two where shared memory holds them).
constexpr int FTX = 8, FTY = NT / FTX;
constexpr int FBR = FA_FWD_ROWS, RQ = FBR / FTY;
constexpr int FBC = FA_FWD_KEYS, LPF = FBC + 8, FNB = FA_FWD_STAGES;
constexpr int QBC = FA_DQ_KEYS, LPQ = QBC + 8, QNB = FA_DQ_STAGES;
// dK/dV: BK keys a block, head dims [c0, c0 + DC); threads KTY x KTX (ty = tid / KTX), RK keys
// each, UK float4 column chunks; queries in tiles of BQ (score tile of a thread: RK x BQ / KTX).
constexpr int BK = FA_DKDV_KEYS, DC = FA_DKDV_DIMS, NCH = FA_NCHUNK, KNB = FA_DKDV_STAGES;
constexpr int KTX = DC % 64 == 0 ? 16 : 8, KTY = NT / KTX, RK = BK / KTY, UK = DC / (4 * KTX);
constexpr int BQ = FA_DKDV_QUERIES, LPK = BQ + KTX;
static_assert(FBR == FA_DQ_ROWS && NCH * DC >= DP && RK * KTY == BK, "flash_fma tile sizes");
__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float comp(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Rows [row0, row0 + ROWS) of rows of d elements, rs apart, into sm[r * LD + c] (c < DP); rows
// at or past `valid` and columns at or past d are zeros. Asynchronous (cp.async) when d % 4 == 0
// (rs, a multiple of d, keeps the rows 16-byte aligned): the caller commits and waits.
template <int ROWS>
__device__ __forceinline__ void load_tile(float* sm, const float* g, i64 row0, i64 valid, i64 d, i64 rs) {
  if ((d & 3) == 0) {
    constexpr int C4 = DP / 4;
    for (int e = threadIdx.x; e < ROWS * C4; e += NT) {
      const int r = e / C4, c = (e % C4) * 4;
      const bool ok = r < valid && c < d;
      cp_async16(sm + r * LD + c, ok ? g + (row0 + r) * rs + c : g, ok ? 16 : 0);
    }
  } else {
    for (int e = threadIdx.x; e < ROWS * DP; e += NT) {
      const int r = e / DP, c = e % DP;
      sm[r * LD + c] = (r < valid && c < d) ? g[(row0 + r) * rs + c] : 0.f;
    }
  }
}
// Sum / max over the 8 threads of one thread row of the 32 x 8 layout (the low 3 lane bits).
__device__ __forceinline__ float row8_sum(float v) {
  v += shfl_xor(v, 1);
  v += shfl_xor(v, 2);
  return v + shfl_xor(v, 4);
}
__device__ __forceinline__ float row8_max(float v) {
  v = fmaxf(v, shfl_xor(v, 1));
  v = fmaxf(v, shfl_xor(v, 2));
  return fmaxf(v, shfl_xor(v, 4));
}
template <int R, int C>
__device__ __forceinline__ void zero(float (*a)[C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) a[r][c] = 0.f;
}

// The K and V tiles of BC keys (rows of `kh`, `vh`, krs apart) that the forward and dQ stream
// through NB buffers each (with two, the next tile loads while this one is used). kv_first
// issues the first tile (the caller commits it with its own loads); kv_next(it) waits for tile
// `it` of `nt`, the next one loading behind it, and returns its buffer.
template <int BC, int NB>
__device__ __forceinline__ void kv_first(float* ks, float* vs, const float* kh, const float* vh, i64 nt, i64 S, i64 d,
                                         i64 krs) {
  if (NB == 2 && nt > 0) {
    load_tile<BC>(ks, kh, 0, S, d, krs);
    load_tile<BC>(vs, vh, 0, S, d, krs);
  }
}
template <int BC, int NB>
__device__ __forceinline__ int kv_next(float* ks, float* vs, const float* kh, const float* vh, i64 it, i64 nt, i64 S,
                                       i64 d, i64 krs) {
  const i64 j0 = it * BC;
  const int cur = NB == 2 ? (int)(it & 1) : 0;
  if (NB == 1) {
    load_tile<BC>(ks, kh, j0, S - j0, d, krs);
    load_tile<BC>(vs, vh, j0, S - j0, d, krs);
    cp_commit();
    cp_wait<0>();
  } else if (it + 1 < nt) {
    load_tile<BC>(ks + (cur ^ 1) * BC * LD, kh, j0 + BC, S - j0 - BC, d, krs);
    load_tile<BC>(vs + (cur ^ 1) * BC * LD, vh, j0 + BC, S - j0 - BC, d, krs);
    cp_commit();
    cp_wait<1>();
  } else {
    cp_wait<0>();
  }
  FLASH_SYNC();
  return cur;
}
// A thread's head-dim results of one row (float4 column chunks tx + FTX u, u < U) times `mul`
// into `out`, the row's first element (columns past d are not written).
template <int U>
__device__ __forceinline__ void store_row(float* out, const float* a, float mul, int tx, i64 d) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const i64 col = (tx + FTX * u) * 4 + e;
      if (col < d) out[col] = a[4 * u + e] * mul;
    }
}

// c[i][j] += sum_k a[i * RS * LD + k] * b[j * CS * LD + k] over k < kd (a multiple of 4): rows of
// two head-dim tiles, `a` and `b` already offset to the thread's first row.
template <int RM, int CN, int RS, int CS>
__device__ __forceinline__ void gemm_nt(float (*c)[CN], const float* a, const float* b, int kd) {
#pragma unroll 2
  for (int k = 0; k < kd; k += 4) {
    float4 av[RM], bv[CN];
#pragma unroll
    for (int i = 0; i < RM; ++i) av[i] = ld4(a + i * RS * LD + k);
#pragma unroll
    for (int j = 0; j < CN; ++j) bv[j] = ld4(b + j * CS * LD + k);
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < CN; ++j) {
        float x = c[i][j];
        x += av[i].x * bv[j].x;
        x += av[i].y * bv[j].y;
        x += av[i].z * bv[j].z;
        x += av[i].w * bv[j].w;
        c[i][j] = x;
      }
  }
}
// c[i][4u + e] += sum_k p[i * RS * LP + k] * b[k * LD + u * CS + e] over k < K: P rows (float4
// along k) times a head-dim tile's float4 column chunks u < ulim, `p` and `b` already offset to
// the thread's first row and first chunk.
template <int RM, int U, int RS, int LP, int CS, int K>
__device__ __forceinline__ void gemm_nn(float (*c)[4 * U], const float* p, const float* b, int ulim) {
#pragma unroll 2
  for (int k = 0; k < K; k += 4) {
    float4 pv[RM];
#pragma unroll
    for (int i = 0; i < RM; ++i) pv[i] = ld4(p + i * RS * LP + k);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u < ulim) {
          const float4 bv = ld4(b + (k + kk) * LD + u * CS);
#pragma unroll
          for (int i = 0; i < RM; ++i) {
            const float pk = comp(pv[i], kk);
            c[i][4 * u + 0] += pk * bv.x;
            c[i][4 * u + 1] += pk * bv.y;
            c[i][4 * u + 2] += pk * bv.z;
            c[i][4 * u + 3] += pk * bv.w;
          }
        }
      }
  }
}

// ---- forward: FBR queries of one (batch, query head) a block ----
__device__ void fwd(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    float* __restrict__ o, float* __restrict__ lse, Dims dm, double scale, int causal, i64 blk) {
  constexpr int NJ = FBC / FTX, U = DP / 32;
  FLASH_SMEM(smem);
  float* qs = (float*)smem;         // [FBR][LD]
  float* ks = qs + FBR * LD;        // [FNB][FBC][LD]
  float* vs = ks + FNB * FBC * LD;  // [FNB][FBC][LD]
  float* ps = vs + FNB * FBC * LD;  // [FBR][LPF] probabilities
  const int tid = threadIdx.x, ty = tid / FTX, tx = tid % FTX;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const int kd = ((int)d + 3) & ~3;
  const QBlock qb = q_block<FBR, FBC>(dm, causal, blk);
  const i64 q0 = qb.q0, bh = qb.bh, nt = qb.ntiles;
  const float sl2 = log2_scale(scale);
  float* const orow0 = o + q_at(dm, qb.b, qb.h);  // the head's first row of o
  load_tile<FBR>(qs, q + q_at(dm, qb.b, qb.h), q0, T_ - q0, d, dm.qrs);
  kv_first<FBC, FNB>(ks, vs, k + qb.kv, v + qb.kv, nt, S, d, dm.krs);
  cp_commit();
  float acc[RQ][4 * U];
  zero<RQ, 4 * U>(acc);
  float m[RQ], l[RQ];
#pragma unroll
  for (int r = 0; r < RQ; ++r) m[r] = NEG_INF, l[r] = 0.f;

  for (i64 it = 0; it < nt; ++it) {
    const i64 j0 = it * FBC;
    const int cur = kv_next<FBC, FNB>(ks, vs, k + qb.kv, v + qb.kv, it, nt, S, d, dm.krs);
    const float* kb = ks + cur * FBC * LD;
    const float* vb = vs + cur * FBC * LD;
    float s[RQ][NJ];
    zero<RQ, NJ>(s);
    gemm_nt<RQ, NJ, FTY, FTX>(s, qs + ty * LD, kb + tx * LD, kd);  // S = Q K^T
    const bool mask = j0 + FBC > S || (causal && j0 + FBC - 1 > q0);
#pragma unroll
    for (int r = 0; r < RQ; ++r) {
      const i64 row = q0 + ty + FTY * r;
      float mx = NEG_INF;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        float x = s[r][j] * sl2;
        if (mask) {
          const i64 key = j0 + tx + FTX * j;
          if (key >= S || (causal && key > row)) x = NEG_INF;
        }
        s[r][j] = x;
        mx = fmaxf(mx, x);
      }
      const float mn = fmaxf(m[r], row8_max(mx));
      const float mu = mn == NEG_INF ? 0.f : mn;
      const float alpha = ex2(m[r] - mu);
      m[r] = mn;
      l[r] *= alpha;
#pragma unroll
      for (int c = 0; c < 4 * U; ++c) acc[r][c] *= alpha;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float p = ex2(s[r][j] - mu);
        l[r] += p;
        ps[(ty + FTY * r) * LPF + tx + FTX * j] = p;
      }
    }
    FLASH_SYNC();
    gemm_nn<RQ, U, FTY, LPF, 4 * FTX, FBC>(acc, ps + ty * LPF, vb + tx * 4, U);  // O += P V
    FLASH_SYNC();
  }
  cp_wait<0>();
#pragma unroll
  for (int r = 0; r < RQ; ++r) {
    const float lt = row8_sum(l[r]);
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    const i64 i = q0 + ty + FTY * r;
    if (i < T_) {
      if (tx == 0) lse[bh * T_ + i] = lt > 0.f ? m[r] * LN2 + logf(lt) : NEG_INF;
      store_row<U>(orow0 + i * dm.qrs, acc[r], inv, tx, d);
    }
  }
}

// ---- backward 1/3: delta = rowsum(dO * O), one warp per row (row r = bh * T + i) ----
__device__ void bwd_delta(const float* __restrict__ o, const float* __restrict__ dout, float* __restrict__ delta,
                          Dims dm) {
  const int lane = threadIdx.x & 31;
  const i64 rows = dm.b * dm.hq * dm.t, d = dm.d;
  for (i64 r = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * (NT / 32)) {
    const i64 bh = r / dm.t, at = q_at(dm, bh / dm.hq, bh % dm.hq) + (r % dm.t) * dm.qrs;
    float a = 0.f;
    for (i64 c = lane; c < d; c += 32) a += o[at + c] * dout[at + c];
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) a += shfl_xor(a, x);
    if (lane == 0) delta[r] = a;
  }
}

// ---- backward 2/3: dK, dV of BK keys of one (batch, kv head), head dims [c0, c0 + DC) ----
__device__ void bwd_dkdv(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ lse, const float* __restrict__ dout, const float* __restrict__ delta,
                         float* __restrict__ dk, float* __restrict__ dv, Dims dm, double scale, int causal, i64 blk) {
  constexpr int NJ = BQ / KTX;
  FLASH_SMEM(smem);
  float* ks = (float*)smem;         // [BK][LD]
  float* vs = ks + BK * LD;         // [BK][LD]
  float* qs = vs + BK * LD;         // [KNB][BQ][LD]
  float* dos = qs + KNB * BQ * LD;  // [KNB][BQ][LD]
  float* pt = dos + KNB * BQ * LD;  // [BK][LPK]  P^T
  float* dst = pt + BK * LPK;       // [BK][LPK]  dS^T
  float* sl = dst + BK * LPK;       // [KNB][BQ]  lse * log2(e)
  float* sd = sl + KNB * BQ;        // [KNB][BQ]  delta
  const int tid = threadIdx.x, ty = tid / KTX, tx = tid % KTX;
  const i64 d = dm.d, T_ = dm.t, S = dm.s, group = dm.hq / dm.hkv;
  const int kd = ((int)d + 3) & ~3;
  const i64 k0 = (blk / NCH) * BK;
  const int c0 = (int)(blk % NCH) * DC;
  const i64 bk = blockIdx.y, b = bk / dm.hkv, kvh = bk % dm.hkv;
  const float sl2 = log2_scale(scale);
  const i64 qstart = causal ? k0 : 0;
  const i64 ntq = T_ > qstart ? (T_ - qstart + BQ - 1) / BQ : 0;  // query tiles per head
  const i64 nt = group * ntq;
  // The thread's head-dim chunks that lie inside DP (all of them unless DP > 128).
  const int rem = DP - c0 - tx * 4;
  const int ulim = NCH == 1 ? UK : (rem <= 0 ? 0 : (rem + 4 * KTX - 1) / (4 * KTX) < UK ? (rem + 4 * KTX - 1) / (4 * KTX) : UK);
  // Tile `t`: queries [i0, i0 + BQ) of query head `bh` into buffer `buf`.
  auto load_q = [&](i64 t, int buf) {
    const i64 hh = kvh * group + t / ntq, bh = b * dm.hq + hh, i0 = qstart + (t % ntq) * BQ;
    load_tile<BQ>(qs + buf * BQ * LD, q + q_at(dm, b, hh), i0, T_ - i0, d, dm.qrs);
    load_tile<BQ>(dos + buf * BQ * LD, dout + q_at(dm, b, hh), i0, T_ - i0, d, dm.qrs);
    for (int e = tid; e < BQ; e += NT) {
      const bool ok = i0 + e < T_;
      sl[buf * BQ + e] = ok ? lse[bh * T_ + i0 + e] * LOG2E : 0.f;
      sd[buf * BQ + e] = ok ? delta[bh * T_ + i0 + e] : 0.f;
    }
  };
  load_tile<BK>(ks, k + k_at(dm, b, kvh), k0, S - k0, d, dm.krs);
  load_tile<BK>(vs, v + k_at(dm, b, kvh), k0, S - k0, d, dm.krs);
  if (KNB == 2 && nt > 0) load_q(0, 0);
  cp_commit();
  float gk[RK][4 * UK], gv[RK][4 * UK];
  zero<RK, 4 * UK>(gk);
  zero<RK, 4 * UK>(gv);

  for (i64 t = 0; t < nt; ++t) {
    const i64 i0 = qstart + (t % ntq) * BQ;
    const int cur = KNB == 2 ? (int)(t & 1) : 0;
    if (KNB == 1) {
      load_q(t, 0);
      cp_commit();
      cp_wait<0>();
    } else if (t + 1 < nt) {
      load_q(t + 1, cur ^ 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    FLASH_SYNC();
    const float* qb = qs + cur * BQ * LD;
    const float* dob = dos + cur * BQ * LD;
    const float* slb = sl + cur * BQ;
    const float* sdb = sd + cur * BQ;
    float s[RK][NJ], dp[RK][NJ];
    zero<RK, NJ>(s);
    zero<RK, NJ>(dp);
    gemm_nt<RK, NJ, KTY, KTX>(s, ks + ty * LD, qb + tx * LD, kd);    // S^T = K Q^T
    gemm_nt<RK, NJ, KTY, KTX>(dp, vs + ty * LD, dob + tx * LD, kd);  // dP^T = V dO^T
    const bool mask = i0 + BQ > T_ || (causal && i0 < k0 + BK - 1);
#pragma unroll
    for (int r = 0; r < RK; ++r) {
      const i64 key = k0 + ty + KTY * r;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int qc = tx + KTX * j;
        float p = ex2(s[r][j] * sl2 - slb[qc]);
        if (mask) {
          const i64 qi = i0 + qc;
          if (qi >= T_ || (causal && qi < key)) p = 0.f;
        }
        pt[(ty + KTY * r) * LPK + qc] = p;
        dst[(ty + KTY * r) * LPK + qc] = p * (dp[r][j] - sdb[qc]);
      }
    }
    FLASH_SYNC();
    gemm_nn<RK, UK, KTY, LPK, 4 * KTX, BQ>(gv, pt + ty * LPK, dob + c0 + tx * 4, ulim);  // dV += P^T dO
    gemm_nn<RK, UK, KTY, LPK, 4 * KTX, BQ>(gk, dst + ty * LPK, qb + c0 + tx * 4, ulim);  // dK += dS^T Q
    FLASH_SYNC();
  }
  cp_wait<0>();
  const float sc = (float)scale;
#pragma unroll
  for (int r = 0; r < RK; ++r) {
    const i64 j = k0 + ty + KTY * r;
    if (j < S) {
#pragma unroll
      for (int u = 0; u < UK; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const i64 col = c0 + (tx + KTX * u) * 4 + e;
          if (col < d) {
            dk[k_at(dm, b, kvh) + j * dm.krs + col] = gk[r][4 * u + e] * sc;
            dv[k_at(dm, b, kvh) + j * dm.krs + col] = gv[r][4 * u + e];
          }
        }
    }
  }
}

// ---- backward 3/3: dQ of FBR queries of one (batch, query head) ----
__device__ void bwd_dq(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ lse, const float* __restrict__ dout, const float* __restrict__ delta,
                       float* __restrict__ dq, Dims dm, double scale, int causal, i64 blk) {
  constexpr int NJ = QBC / FTX, U = DP / 32;
  FLASH_SMEM(smem);
  float* qs = (float*)smem;         // [FBR][LD]
  float* dos = qs + FBR * LD;       // [FBR][LD]
  float* ks = dos + FBR * LD;       // [QNB][QBC][LD]
  float* vs = ks + QNB * QBC * LD;  // [QNB][QBC][LD]
  float* dss = vs + QNB * QBC * LD; // [FBR][LPQ] dS
  const int tid = threadIdx.x, ty = tid / FTX, tx = tid % FTX;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const int kd = ((int)d + 3) & ~3;
  const QBlock qb = q_block<FBR, QBC>(dm, causal, blk);
  const i64 q0 = qb.q0, bh = qb.bh, nt = qb.ntiles, qh = q_at(dm, qb.b, qb.h);
  const float* kh = k + qb.kv;
  const float* vh = v + qb.kv;
  const float sl2 = log2_scale(scale);
  load_tile<FBR>(qs, q + qh, q0, T_ - q0, d, dm.qrs);
  load_tile<FBR>(dos, dout + qh, q0, T_ - q0, d, dm.qrs);
  kv_first<QBC, QNB>(ks, vs, kh, vh, nt, S, d, dm.krs);
  cp_commit();
  float L[RQ], D[RQ];
#pragma unroll
  for (int r = 0; r < RQ; ++r) {
    const i64 row = q0 + ty + FTY * r;
    const bool ok = row < T_;
    L[r] = ok ? lse[bh * T_ + row] * LOG2E : 0.f;
    D[r] = ok ? delta[bh * T_ + row] : 0.f;
  }
  float acc[RQ][4 * U];
  zero<RQ, 4 * U>(acc);

  for (i64 it = 0; it < nt; ++it) {
    const i64 j0 = it * QBC;
    const int cur = kv_next<QBC, QNB>(ks, vs, kh, vh, it, nt, S, d, dm.krs);
    const float* kb = ks + cur * QBC * LD;
    const float* vb = vs + cur * QBC * LD;
    float s[RQ][NJ], dp[RQ][NJ];
    zero<RQ, NJ>(s);
    zero<RQ, NJ>(dp);
    gemm_nt<RQ, NJ, FTY, FTX>(s, qs + ty * LD, kb + tx * LD, kd);    // S = Q K^T
    gemm_nt<RQ, NJ, FTY, FTX>(dp, dos + ty * LD, vb + tx * LD, kd);  // dP = dO V^T
    const bool mask = j0 + QBC > S || (causal && j0 + QBC - 1 > q0);
#pragma unroll
    for (int r = 0; r < RQ; ++r) {
      const i64 row = q0 + ty + FTY * r;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int kc = tx + FTX * j;
        float p = ex2(s[r][j] * sl2 - L[r]);
        if (mask) {
          const i64 key = j0 + kc;
          if (key >= S || (causal && key > row)) p = 0.f;
        }
        dss[(ty + FTY * r) * LPQ + kc] = p * (dp[r][j] - D[r]);
      }
    }
    FLASH_SYNC();
    gemm_nn<RQ, U, FTY, LPQ, 4 * FTX, QBC>(acc, dss + ty * LPQ, kb + tx * 4, U);  // dQ += dS K
    FLASH_SYNC();
  }
  cp_wait<0>();
  const float sc = (float)scale;
#pragma unroll
  for (int r = 0; r < RQ; ++r) {
    const i64 i = q0 + ty + FTY * r;
    if (i < T_) store_row<U>(dq + qh + i * dm.qrs, acc[r], sc, tx, d);
  }
}

}  // namespace fa

// 256 threads, one block an SM (shared memory allows no more): all 255 registers may be used.
#ifdef FLASH_EMU
#define FA_BOUNDS
#else
#define FA_BOUNDS __launch_bounds__(fa::NT, 1)
#endif

extern "C" __global__ void FA_BOUNDS flash_fwd(const float* q, const float* k, const float* v, float* o, float* lse,
                                               fa::Dims dm, double scale, int causal) {
  pdl_enter();
  fa::each_block((dm.t + fa::FBR - 1) / fa::FBR, 1,
                 [&](i64 blk) { fa::fwd(q, k, v, o, lse, dm, scale, causal, blk); });
}
extern "C" __global__ void FA_BOUNDS flash_bwd_delta(const float* o, const float* dout, float* delta, fa::Dims dm) {
  pdl_enter();
  fa::bwd_delta(o, dout, delta, dm);
}
extern "C" __global__ void FA_BOUNDS flash_bwd_dkdv(const float* q, const float* k, const float* v, const float* lse,
                                                    const float* dout, const float* delta, float* dk, float* dv,
                                                    fa::Dims dm, double scale, int causal) {
  pdl_enter();
  fa::each_block((dm.s + fa::BK - 1) / fa::BK, fa::NCH,
                 [&](i64 blk) { fa::bwd_dkdv(q, k, v, lse, dout, delta, dk, dv, dm, scale, causal, blk); });
}
extern "C" __global__ void FA_BOUNDS flash_bwd_dq(const float* q, const float* k, const float* v, const float* lse,
                                                  const float* dout, const float* delta, float* dq, fa::Dims dm,
                                                  double scale, int causal) {
  pdl_enter();
  fa::each_block((dm.t + fa::FBR - 1) / fa::FBR, 1,
                 [&](i64 blk) { fa::bwd_dq(q, k, v, lse, dout, delta, dq, dm, scale, causal, blk); });
}
