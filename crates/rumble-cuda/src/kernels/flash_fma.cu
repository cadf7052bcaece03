// Flash attention in f32 with plain FMA (exact f32, no TF32), forward and backward, for
// grouped-query heads and any head size up to 256 (FDPF: the head size rounded up to 32).
// The same entry points and arguments as flash_attn.cu (the tensor-core kernels for bf16 and
// f16); one module per FDPF.
//
// A block is 128 threads seen as 16 x 8 (ty = tid / 8, tx = tid % 8). A score tile is held in
// registers as a register micro-tile: rows ty * RM + r, columns h * 32 + tx * 4 + j. The
// operands of the score products sit in shared memory transposed ([head dim][row]), so each
// step of the dot products is one 16-byte load per operand; probabilities go back through
// shared memory ([key][row]) to be multiplied by V (row-major). Only o and the log-sum-exp
// are saved. Deterministic: no atomics (dK/dV and dQ are separate kernels, as for the
// tensor-core kernels).

#ifndef FLASH_EMU
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
#define FLASH_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define FLASH_SYNC() __syncthreads()
#endif

namespace fa {
typedef float T;
struct Dims { i64 b, hq, hkv, t, s, d; };
constexpr int NT = 128;
constexpr int DP = FDPF;  // head size rounded up to 32
// forward: 64 queries a block (4 per thread row), keys in tiles of FBC
constexpr int FBR = 64, FBC = DP <= 64 ? 64 : 32;
// backward: 32 queries (dq) / 32 keys (dk, dv) a block, the other side in tiles of 32
constexpr int BR = 32, BC = 32;
constexpr int DC = DP <= 128 ? DP : 128;  // dk/dv: head dims accumulated per block
// Launch shape (mirrored by src/flash.rs): rows of the grid's x axis per block, shared bytes.
constexpr int FWD_ROWS = FBR, DQ_ROWS = BR, DKDV_KEYS = BC, NCHUNK = (DP + DC - 1) / DC;
constexpr int SMEM_FWD = (DP * (FBR + 4) + DP * (FBC + 4) + FBC * DP + FBC * (FBR + 4)) * 4;
constexpr int SMEM_DQ = (2 * DP * (BR + 4) + 2 * DP * (BC + 4) + BC * DP + BC * (BR + 4)) * 4;
constexpr int SMEM_DKDV = (2 * DP * (BC + 4) + 2 * DP * (BR + 4) + 2 * BR * DP + 2 * BR * (BC + 4) + 2 * BR) * 4;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
#define NEG_INF (-F32_INF)

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }

// Rows [row0, row0 + ROWS) of a row-major [*, d] matrix, transposed into sm[c * LDT + r]
// (c < d); rows at or past `valid` are zeros. A warp takes a row, its lanes the columns.
template <int ROWS, int LDT>
__device__ __forceinline__ void load_t(float* sm, const float* g, i64 row0, i64 valid, i64 d) {
  for (int r = threadIdx.x >> 5; r < ROWS; r += NT / 32) {
    const float* src = g + (row0 + r) * d;
    for (int c = threadIdx.x & 31; c < (int)d; c += 32) sm[c * LDT + r] = r < valid ? src[c] : 0.f;
  }
}
// The same rows as they are, into sm[r * DP + c]; columns d..DP and invalid rows are zeros.
template <int ROWS>
__device__ __forceinline__ void load_r(float* sm, const float* g, i64 row0, i64 valid, i64 d) {
  for (int r = threadIdx.x >> 5; r < ROWS; r += NT / 32) {
    const float* src = g + (row0 + r) * d;
    for (int c = threadIdx.x & 31; c < DP; c += 32) sm[r * DP + c] = (r < valid && c < d) ? src[c] : 0.f;
  }
}
__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float2 ld2(const float* p) { return *(const float2*)p; }
// Sum / max over the 8 threads of one thread row (lanes differing in the low 3 bits).
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

// s[RM][4 * NH] += A^T B over k < d: A = a[k * LDA + row], rows ty * RM + r; B = b[k * LDB + col],
// columns h * 32 + tx * 4 + j.
template <int RM, int NH, int LDA, int LDB>
__device__ __forceinline__ void gemm_tn(float (*s)[4 * NH], const float* a, const float* b, i64 d, int ty, int tx) {
  for (int k = 0; k < (int)d; ++k) {
    float av[RM];
    if constexpr (RM == 4) {
      const float4 x = ld4(a + k * LDA + ty * 4);
      av[0] = x.x, av[1] = x.y, av[2] = x.z, av[3] = x.w;
    } else {
      const float2 x = ld2(a + k * LDA + ty * 2);
      av[0] = x.x, av[RM - 1] = x.y;
    }
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      const float4 bv = ld4(b + k * LDB + h * 32 + tx * 4);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        s[r][h * 4 + 0] += av[r] * bv.x;
        s[r][h * 4 + 1] += av[r] * bv.y;
        s[r][h * 4 + 2] += av[r] * bv.z;
        s[r][h * 4 + 3] += av[r] * bv.w;
      }
    }
  }
}
// acc[RM][NC / 8] += P B over k < K: P = p[k * LDP + row] (rows ty * RM + r), B = b[k * DP + col],
// columns c0 + u * 32 + tx * 4 + j (u < NC / 32, skipped past DP).
template <int RM, int NC, int K, int LDP>
__device__ __forceinline__ void gemm_pb(float (*acc)[NC / 8], const float* p, const float* b, int c0, int ty, int tx) {
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    float pv[RM];
    if constexpr (RM == 4) {
      const float4 x = ld4(p + k * LDP + ty * 4);
      pv[0] = x.x, pv[1] = x.y, pv[2] = x.z, pv[3] = x.w;
    } else {
      const float2 x = ld2(p + k * LDP + ty * 2);
      pv[0] = x.x, pv[RM - 1] = x.y;
    }
#pragma unroll
    for (int u = 0; u < NC / 32; ++u) {
      if (c0 + u * 32 < DP) {
        const float4 bv = ld4(b + k * DP + c0 + u * 32 + tx * 4);
#pragma unroll
        for (int r = 0; r < RM; ++r) {
          acc[r][u * 4 + 0] += pv[r] * bv.x;
          acc[r][u * 4 + 1] += pv[r] * bv.y;
          acc[r][u * 4 + 2] += pv[r] * bv.z;
          acc[r][u * 4 + 3] += pv[r] * bv.w;
        }
      }
    }
  }
}

// ---- forward: 64 queries of one (batch, query head) a block ----
__device__ void fwd(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    float* __restrict__ o, float* __restrict__ lse, Dims dm, double scale, int causal) {
  constexpr int RM = 4, NH = FBC / 32, SQ = FBR + 4, SK = FBC + 4;
  FLASH_SMEM(smem);
  float* qt = (float*)smem;  // [DP][SQ]
  float* kt = qt + DP * SQ;  // [DP][SK]
  float* vr = kt + DP * SK;  // [FBC][DP]
  float* pt = vr + FBC * DP; // [FBC][SQ]
  const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + FBR - 1) / FBR;
  const i64 q0 = (nqb - 1 - (i64)blockIdx.x) * FBR;
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = b * dm.hkv + h / (dm.hq / dm.hkv);
  const float* kh = k + kvh * S * d;
  const float* vh = v + kvh * S * d;
  const i64 kend = causal ? min64(S, q0 + FBR) : S;
  const float sl2 = (float)(scale * 1.4426950408889634);
  load_t<FBR, SQ>(qt, q + bh * T_ * d, q0, T_ - q0, d);
  float acc[RM][DP / 8];
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int c = 0; c < DP / 8; ++c) acc[r][c] = 0.f;
  float m[RM], l[RM];
#pragma unroll
  for (int r = 0; r < RM; ++r) m[r] = NEG_INF, l[r] = 0.f;
  const i64 row0 = q0 + ty * RM;

  for (i64 j0 = 0; j0 < kend; j0 += FBC) {
    load_t<FBC, SK>(kt, kh, j0, S - j0, d);
    load_r<FBC>(vr, vh, j0, S - j0, d);
    FLASH_SYNC();
    float s[RM][4 * NH];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int c = 0; c < 4 * NH; ++c) s[r][c] = 0.f;
    gemm_tn<RM, NH, SQ, SK>(s, qt, kt, d, ty, tx);
    const bool mask = j0 + FBC > S || (causal && j0 + FBC - 1 > q0);
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      float mx = NEG_INF;
#pragma unroll
      for (int c = 0; c < 4 * NH; ++c) {
        float x = s[r][c] * sl2;
        if (mask) {
          const i64 key = j0 + (c >> 2) * 32 + tx * 4 + (c & 3);
          if (key >= S || (causal && key > row0 + r)) x = NEG_INF;
        }
        s[r][c] = x;
        mx = fmaxf(mx, x);
      }
      const float mn = fmaxf(m[r], row8_max(mx));
      const float mu = mn == NEG_INF ? 0.f : mn;
      const float alpha = ex2(m[r] - mu);
      m[r] = mn;
      l[r] *= alpha;
#pragma unroll
      for (int c = 0; c < DP / 8; ++c) acc[r][c] *= alpha;
#pragma unroll
      for (int c = 0; c < 4 * NH; ++c) {
        const float p = ex2(s[r][c] - mu);
        s[r][c] = p;
        l[r] += p;
      }
    }
#pragma unroll
    for (int c = 0; c < 4 * NH; ++c) {
      const int kc = (c >> 2) * 32 + tx * 4 + (c & 3);
      *(float4*)(pt + kc * SQ + ty * 4) = make_float4(s[0][c], s[1][c], s[2][c], s[3][c]);
    }
    FLASH_SYNC();
    gemm_pb<RM, DP, FBC, SQ>(acc, pt, vr, 0, ty, tx);
    FLASH_SYNC();
  }
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const float lt = row8_sum(l[r]);
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    const i64 i = row0 + r;
    if (i < T_) {
      if (tx == 0) lse[bh * T_ + i] = lt > 0.f ? m[r] * LN2 + logf(lt) : NEG_INF;
#pragma unroll
      for (int c = 0; c < DP / 8; ++c) {
        const i64 col = (c >> 2) * 32 + tx * 4 + (c & 3);
        if (col < d) o[(bh * T_ + i) * d + col] = acc[r][c] * inv;
      }
    }
  }
}

// ---- backward 1/3: delta = rowsum(dO * O), one warp per row ----
__device__ void bwd_delta(const float* __restrict__ o, const float* __restrict__ dout, float* __restrict__ delta,
                          i64 rows, i64 d) {
  const int lane = threadIdx.x & 31;
  for (i64 r = (i64)blockIdx.x * (NT / 32) + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * (NT / 32)) {
    float a = 0.f;
    for (i64 c = lane; c < d; c += 32) a += o[r * d + c] * dout[r * d + c];
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) a += shfl_xor(a, x);
    if (lane == 0) delta[r] = a;
  }
}

// ---- backward 2/3: dK, dV of 32 keys of one (batch, kv head), head dims [c0, c0 + DC) ----
__device__ void bwd_dkdv(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                         const float* __restrict__ lse, const float* __restrict__ dout, const float* __restrict__ delta,
                         float* __restrict__ dk, float* __restrict__ dv, Dims dm, double scale, int causal) {
  constexpr int RM = 2, SK = BC + 4, SQ = BR + 4, NCH = (DP + DC - 1) / DC;
  FLASH_SMEM(smem);
  float* kt = (float*)smem;    // [DP][SK]  keys transposed
  float* vt = kt + DP * SK;    // [DP][SK]
  float* qt = vt + DP * SK;    // [DP][SQ]  queries transposed
  float* dot = qt + DP * SQ;   // [DP][SQ]
  float* qr = dot + DP * SQ;   // [BR][DP]  queries as rows
  float* dor = qr + BR * DP;   // [BR][DP]
  float* pq = dor + BR * DP;   // [BR][SK]  P^T stored per query
  float* dsq = pq + BR * SK;   // [BR][SK]
  float* sl = dsq + BR * SK;   // [BR] lse * log2(e)
  float* sd = sl + BR;         // [BR] delta
  const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
  const i64 d = dm.d, T_ = dm.t, S = dm.s, group = dm.hq / dm.hkv;
  const i64 k0 = ((i64)blockIdx.x / NCH) * BC;
  const int c0 = (int)(blockIdx.x % NCH) * DC;
  const i64 bk = blockIdx.y, b = bk / dm.hkv, kvh = bk % dm.hkv;
  const float sl2 = (float)(scale * 1.4426950408889634);
  const i64 qstart = causal ? k0 : 0;
  load_t<BC, SK>(kt, k + bk * S * d, k0, S - k0, d);
  load_t<BC, SK>(vt, v + bk * S * d, k0, S - k0, d);
  float gk[RM][DC / 8], gv[RM][DC / 8];
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int c = 0; c < DC / 8; ++c) gk[r][c] = gv[r][c] = 0.f;
  const i64 key0 = k0 + ty * RM;

  for (i64 gi = 0; gi < group; ++gi) {
    const i64 bh = b * dm.hq + kvh * group + gi;
    for (i64 i0 = qstart; i0 < T_; i0 += BR) {
      load_t<BR, SQ>(qt, q + bh * T_ * d, i0, T_ - i0, d);
      load_t<BR, SQ>(dot, dout + bh * T_ * d, i0, T_ - i0, d);
      load_r<BR>(qr, q + bh * T_ * d, i0, T_ - i0, d);
      load_r<BR>(dor, dout + bh * T_ * d, i0, T_ - i0, d);
      for (int e = tid; e < BR; e += NT) {
        const bool ok = i0 + e < T_;
        sl[e] = ok ? lse[bh * T_ + i0 + e] * LOG2E : 0.f;
        sd[e] = ok ? delta[bh * T_ + i0 + e] : 0.f;
      }
      FLASH_SYNC();
      float s[RM][4], dp[RM][4];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] = dp[r][c] = 0.f;
      gemm_tn<RM, 1, SK, SQ>(s, kt, qt, d, ty, tx);    // S^T = K Q^T
      gemm_tn<RM, 1, SK, SQ>(dp, vt, dot, d, ty, tx);  // dP^T = V dO^T
      const bool mask = i0 + BR > T_ || (causal && i0 < k0 + BC - 1);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int qc = tx * 4 + c;
        float pr[RM], dr[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
          float p = ex2(s[r][c] * sl2 - sl[qc]);
          if (mask) {
            const i64 qi = i0 + qc;
            if (qi >= T_ || (causal && qi < key0 + r)) p = 0.f;
          }
          pr[r] = p;
          dr[r] = p * (dp[r][c] - sd[qc]);
        }
        *(float2*)(pq + qc * SK + ty * 2) = make_float2(pr[0], pr[1]);
        *(float2*)(dsq + qc * SK + ty * 2) = make_float2(dr[0], dr[1]);
      }
      FLASH_SYNC();
      gemm_pb<RM, DC, BR, SK>(gv, pq, dor, c0, ty, tx);   // dV += P^T dO
      gemm_pb<RM, DC, BR, SK>(gk, dsq, qr, c0, ty, tx);   // dK += dS^T Q
      FLASH_SYNC();
    }
  }
  const float sc = (float)scale;
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const i64 j = key0 + r;
    if (j < S) {
#pragma unroll
      for (int c = 0; c < DC / 8; ++c) {
        const i64 col = c0 + (c >> 2) * 32 + tx * 4 + (c & 3);
        if (col < d) {
          dk[(bk * S + j) * d + col] = gk[r][c] * sc;
          dv[(bk * S + j) * d + col] = gv[r][c];
        }
      }
    }
  }
}

// ---- backward 3/3: dQ of 32 queries of one (batch, query head) ----
__device__ void bwd_dq(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                       const float* __restrict__ lse, const float* __restrict__ dout, const float* __restrict__ delta,
                       float* __restrict__ dq, Dims dm, double scale, int causal) {
  constexpr int RM = 2, SQ = BR + 4, SK = BC + 4;
  FLASH_SMEM(smem);
  float* qt = (float*)smem;    // [DP][SQ]
  float* dot = qt + DP * SQ;   // [DP][SQ]
  float* kt = dot + DP * SQ;   // [DP][SK]
  float* vt = kt + DP * SK;    // [DP][SK]
  float* kr = vt + DP * SK;    // [BC][DP]
  float* dst = kr + BC * DP;   // [BC][SQ]
  const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
  const i64 d = dm.d, T_ = dm.t, S = dm.s;
  const i64 nqb = (T_ + BR - 1) / BR;
  const i64 q0 = (nqb - 1 - (i64)blockIdx.x) * BR;
  const i64 bh = blockIdx.y, b = bh / dm.hq, h = bh % dm.hq;
  const i64 kvh = b * dm.hkv + h / (dm.hq / dm.hkv);
  const float* kh = k + kvh * S * d;
  const float* vh = v + kvh * S * d;
  const i64 kend = causal ? min64(S, q0 + BR) : S;
  const float sl2 = (float)(scale * 1.4426950408889634);
  load_t<BR, SQ>(qt, q + bh * T_ * d, q0, T_ - q0, d);
  load_t<BR, SQ>(dot, dout + bh * T_ * d, q0, T_ - q0, d);
  const i64 row0 = q0 + ty * RM;
  float L[RM], D[RM];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const bool ok = row0 + r < T_;
    L[r] = ok ? lse[bh * T_ + row0 + r] * LOG2E : 0.f;
    D[r] = ok ? delta[bh * T_ + row0 + r] : 0.f;
  }
  float acc[RM][DP / 8];
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int c = 0; c < DP / 8; ++c) acc[r][c] = 0.f;

  for (i64 j0 = 0; j0 < kend; j0 += BC) {
    load_t<BC, SK>(kt, kh, j0, S - j0, d);
    load_t<BC, SK>(vt, vh, j0, S - j0, d);
    load_r<BC>(kr, kh, j0, S - j0, d);
    FLASH_SYNC();
    float s[RM][4], dp[RM][4];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[r][c] = dp[r][c] = 0.f;
    gemm_tn<RM, 1, SQ, SK>(s, qt, kt, d, ty, tx);
    gemm_tn<RM, 1, SQ, SK>(dp, dot, vt, d, ty, tx);
    const bool mask = j0 + BC > S || (causal && j0 + BC - 1 > q0);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int kc = tx * 4 + c;
      float dr[RM];
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        float p = ex2(s[r][c] * sl2 - L[r]);
        if (mask) {
          const i64 key = j0 + kc;
          if (key >= S || (causal && key > row0 + r)) p = 0.f;
        }
        dr[r] = p * (dp[r][c] - D[r]);
      }
      *(float2*)(dst + kc * SQ + ty * 2) = make_float2(dr[0], dr[1]);
    }
    FLASH_SYNC();
    gemm_pb<RM, DP, BC, SQ>(acc, dst, kr, 0, ty, tx);  // dQ += dS K
    FLASH_SYNC();
  }
  const float sc = (float)scale;
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    const i64 i = row0 + r;
    if (i < T_) {
#pragma unroll
      for (int c = 0; c < DP / 8; ++c) {
        const i64 col = (c >> 2) * 32 + tx * 4 + (c & 3);
        if (col < d) dq[(bh * T_ + i) * d + col] = acc[r][c] * sc;
      }
    }
  }
}
}  // namespace fa

extern "C" __global__ void __launch_bounds__(fa::NT) flash_fwd(const float* q, const float* k, const float* v,
                                                               float* o, float* lse, fa::Dims dm, double scale,
                                                               int causal) {
  fa::fwd(q, k, v, o, lse, dm, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_delta(const float* o, const float* dout, float* delta,
                                                                     i64 rows, i64 d) {
  fa::bwd_delta(o, dout, delta, rows, d);
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_dkdv(const float* q, const float* k, const float* v,
                                                                    const float* lse, const float* dout,
                                                                    const float* delta, float* dk, float* dv,
                                                                    fa::Dims dm, double scale, int causal) {
  fa::bwd_dkdv(q, k, v, lse, dout, delta, dk, dv, dm, scale, causal);
}
extern "C" __global__ void __launch_bounds__(fa::NT) flash_bwd_dq(const float* q, const float* k, const float* v,
                                                                  const float* lse, const float* dout,
                                                                  const float* delta, float* dq, fa::Dims dm,
                                                                  double scale, int causal) {
  fa::bwd_dq(q, k, v, lse, dout, delta, dq, dm, scale, causal);
}
