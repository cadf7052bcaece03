// Matrix times a few vectors, for the matmuls of decoding (M = the batch, at most GEMV_MAX_M):
// d[m][n] = sum_k a[m][k] b[n][k] (+ beta c[m][n]), a [M, K] and b [N, K] row-major (b read
// transposed: the linear layers' [out, in] weights), f32 accumulation, one rounding to O. Two
// ways to split the work, each a candidate the matmul tuner (matmul_tune.rs) times beside
// cuBLASLt's algorithms, keeping the fastest for the shape:
// - gemv_tn: a block of GEMV_WARPS warps owns GEMV_ROWS neighbouring rows n. Lane l of warp w
//   takes the 16-byte chunks w * 32 + l, + GEMV_WARPS * 32, ... of those rows' K (each b chunk
//   is used for every m, each a chunk for every row), the warp sums its lanes (butterfly), and
//   the block adds its warps' sums in warp order. Suits short rows (K of a few chunks a lane)
//   and the larger M buckets, where a's chunks are shared by four rows.
// - gemv_wr: each warp owns R neighbouring rows and all of their K, no shared memory and no
//   block barrier; a lane takes chunks l, l + 32, ... and issues GEMV_UNROLL of them for every
//   row before using any, so that many loads are in flight. Suits long rows at M of 1 to 4.
// In both the order of the sums depends only on the shapes. Where K or a pointer does not allow
// 16-byte loads, element by element in the same pattern. c may be d (the addend in place):
// each output is read before it is written, by the same thread.
//
// A prologue PRE (matmul_pre: a decode step's norm or swiglu folded into the projections that
// read it) makes each row of a as it is loaded, rounded to T as that op's result would be, so
// the products see the values the unfolded pair gives:
// - PRE_NORM: rms_norm of a row x [K] with weight g, x * r * g, r = 1 / rms(x) taken first by
//   every warp over the whole row (pre_scales; the row is read again, from cache, by the loop);
// - PRE_SWIGLU: a row [gate | up] of 2K gives silu(gate) * up (swiglu_packed's arithmetic).
#define GEMV_MAX_M 16
#define PRE_NONE 0
#define PRE_NORM 1
#define PRE_SWIGLU 2

// v rounded to T, as a store and a load of T would give.
template <typename T>
__device__ __forceinline__ float rnd_as(float v) {
  T t;
  stf(&t, v);
  return ldf(t);
}
// Every lane's r of each row of a (PRE_NORM; 1 otherwise): the warp sums the squares of the
// row's K elements, its lanes taking chunks l, l + 32, ... (elements where !vec).
template <int PRE, typename T, int MM>
__device__ __forceinline__ void pre_scales(const T* __restrict__ a, i64 m, i64 k, bool vec, double eps,
                                           float (&r)[MM]) {
  constexpr int V = Vec16<T>::n;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mm = 0; mm < MM; ++mm) {
    r[mm] = 1.0f;
    if (PRE != PRE_NORM || mm >= m) continue;
    float ss = 0.0f;
    if (vec) {
      for (i64 ch = lane; ch < k / V; ch += 32) {
        float x[V];
        ld16(a + mm * k + ch * V, x);
#pragma unroll
        for (int i = 0; i < V; ++i) ss += x[i] * x[i];
      }
    } else {
      for (i64 e = lane; e < k; e += 32) {
        const float x = ld(a[mm * k + e]);
        ss += x * x;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    r[mm] = (float)(1.0 / sqrt((double)ss / (double)k + eps));
  }
}
// Elements e .. e + V of row mm of the (made) a: a 16-byte chunk of each stored row it reads.
template <int PRE, typename T>
__device__ __forceinline__ void ld_a16(const T* __restrict__ a, const T* __restrict__ g, i64 mm, i64 k, i64 e,
                                       float r, float* av) {
  constexpr int V = Vec16<T>::n;
  if constexpr (PRE == PRE_SWIGLU) {
    float u[V];
    ld16(a + mm * 2 * k + e, av);
    ld16(a + mm * 2 * k + k + e, u);
#pragma unroll
    for (int i = 0; i < V; ++i) av[i] = rnd_as<T>((av[i] * sigmoid_<T>(av[i])) * u[i]);
  } else {
    ld16(a + mm * k + e, av);
    if constexpr (PRE == PRE_NORM) {
      float w[V];
      ld16(g + e, w);
#pragma unroll
      for (int i = 0; i < V; ++i) av[i] = rnd_as<T>(av[i] * r * w[i]);
    }
  }
}
// Element e of row mm of the (made) a.
template <int PRE, typename T>
__device__ __forceinline__ float ld_a1(const T* __restrict__ a, const T* __restrict__ g, i64 mm, i64 k, i64 e,
                                       float r) {
  if constexpr (PRE == PRE_SWIGLU) {
    const float gate = ld(a[mm * 2 * k + e]);
    return rnd_as<T>((gate * sigmoid_<T>(gate)) * ld(a[mm * 2 * k + k + e]));
  } else if constexpr (PRE == PRE_NORM) {
    return rnd_as<T>(ld(a[mm * k + e]) * r * ld(g[e]));
  } else {
    return ld(a[mm * k + e]);
  }
}
// Whether a (and g) allow 16-byte loads of the made rows.
template <int PRE, typename T>
__device__ __forceinline__ bool pre_vec(const T* a, const T* g, const T* b, i64 k) {
  constexpr int V = Vec16<T>::n;
  const unsigned long long p = (unsigned long long)a | (unsigned long long)b | (PRE == PRE_NORM ? (unsigned long long)g : 0);
  return k % V == 0 && (p & 15) == 0;
}
#define GEMV_ROWS 4
#define GEMV_WARPS 8
#define GEMV_WR_WARPS 4
#define GEMV_UNROLL 4
template <typename T, typename O, int MM, int PRE>
__device__ void gemv_tn(const T* __restrict__ a, const T* __restrict__ g, const T* __restrict__ b, const O* c, O* d,
                        i64 m, i64 n, i64 k, float beta, double eps, i64 blk) {
  __shared__ float part[GEMV_WARPS][GEMV_MAX_M * GEMV_ROWS];
  constexpr int V = Vec16<T>::n;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const i64 n0 = blk * GEMV_ROWS;
  const bool vec = pre_vec<PRE>(a, g, b, k);
  float rs[MM];
  pre_scales<PRE, T, MM>(a, m, k, vec, eps, rs);
  float acc[MM][GEMV_ROWS];
#pragma unroll
  for (int mm = 0; mm < MM; ++mm)
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[mm][r] = 0.0f;
  const i64 chunks = vec ? k / V : k;  // units a lane takes: 16-byte chunks, or elements
  const int per = vec ? V : 1;
  for (i64 ch = (i64)w * 32 + lane; ch < chunks; ch += GEMV_WARPS * 32) {
    float bv[GEMV_ROWS][V];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      const bool in = n0 + r < n;
      if (vec) {
        if (in) {
          ld16(b + (n0 + r) * k + ch * V, bv[r]);
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) bv[r][i] = 0.0f;
        }
      } else {
        bv[r][0] = in ? ld(b[(n0 + r) * k + ch]) : 0.0f;
      }
    }
#pragma unroll
    for (int mm = 0; mm < MM; ++mm) {
      if (mm >= m) break;
      float av[V];
      if (vec) {
        ld_a16<PRE>(a, g, mm, k, ch * V, rs[mm], av);
      } else {
        av[0] = ld_a1<PRE>(a, g, mm, k, ch, rs[mm]);
      }
#pragma unroll
      for (int r = 0; r < GEMV_ROWS; ++r)
        for (int i = 0; i < per; ++i) acc[mm][r] += av[i] * bv[r][i];
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int mm = 0; mm < MM; ++mm)
#pragma unroll
      for (int r = 0; r < GEMV_ROWS; ++r) acc[mm][r] += __shfl_xor_sync(0xffffffffu, acc[mm][r], o);
  if (lane == 0)
#pragma unroll
    for (int mm = 0; mm < MM; ++mm)
#pragma unroll
      for (int r = 0; r < GEMV_ROWS; ++r) part[w][mm * GEMV_ROWS + r] = acc[mm][r];
  __syncthreads();
  for (int e = threadIdx.x; e < m * GEMV_ROWS; e += blockDim.x) {
    const int mm = e / GEMV_ROWS, r = e - mm * GEMV_ROWS;
    const i64 col = n0 + r;
    if (col >= n) continue;
    float s = part[0][e];
    for (int j = 1; j < GEMV_WARPS; ++j) s += part[j][e];
    if (beta != 0.0f) s += beta * ld(c[mm * n + col]);
    st(&d[mm * n + col], s);
  }
}

// gemv_wr's chunks ch, ch + 32, ..., ch + 32 (U - 1) (16-byte chunks of K) of its R rows from
// n0 against every row of a: every load of the group issued before the products.
template <int U, int PRE, typename T, int MM, int R>
__device__ __forceinline__ void gemv_wr_chunks(const T* __restrict__ a, const T* __restrict__ g,
                                               const T* __restrict__ b, i64 m, i64 n, i64 k, i64 n0, i64 ch,
                                               const float (&rs)[MM], float (&acc)[MM][R]) {
  constexpr int V = Vec16<T>::n;
  float bv[U][R][V];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (n0 + r < n) {
        ld16(b + (n0 + r) * k + (ch + 32 * u) * V, bv[u][r]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) bv[u][r][i] = 0.0f;
      }
    }
#pragma unroll
  for (int mm = 0; mm < MM; ++mm) {
    if (mm >= m) break;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float av[V];
      ld_a16<PRE>(a, g, mm, k, (ch + 32 * u) * V, rs[mm], av);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[mm][r] += av[i] * bv[u][r][i];
    }
  }
}
template <typename T, typename O, int MM, int R, int PRE>
__device__ void gemv_wr(const T* __restrict__ a, const T* __restrict__ g, const T* __restrict__ b, const O* c, O* d,
                        i64 m, i64 n, i64 k, float beta, double eps, i64 blk) {
  constexpr int V = Vec16<T>::n, U = GEMV_UNROLL;
  const int lane = threadIdx.x & 31;
  const i64 n0 = (blk * GEMV_WR_WARPS + (threadIdx.x >> 5)) * R;
  if (n0 >= n) return;  // the whole warp
  const bool vec = pre_vec<PRE>(a, g, b, k);
  float rs[MM];
  pre_scales<PRE, T, MM>(a, m, k, vec, eps, rs);
  float acc[MM][R];
#pragma unroll
  for (int mm = 0; mm < MM; ++mm)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[mm][r] = 0.0f;
  if (vec) {
    const i64 chunks = k / V;
    i64 ch = lane;
    // Groups of U chunks a lane, then the rest a chunk at a time.
    for (; ch + 32 * (U - 1) < chunks; ch += 32 * U) gemv_wr_chunks<U, PRE>(a, g, b, m, n, k, n0, ch, rs, acc);
    for (; ch < chunks; ch += 32) gemv_wr_chunks<1, PRE>(a, g, b, m, n, k, n0, ch, rs, acc);
  } else {
    for (i64 e = lane; e < k; e += 32) {
      float bv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) bv[r] = n0 + r < n ? ld(b[(n0 + r) * k + e]) : 0.0f;
#pragma unroll
      for (int mm = 0; mm < MM; ++mm) {
        if (mm >= m) break;
        const float av = ld_a1<PRE>(a, g, mm, k, e, rs[mm]);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[mm][r] += av * bv[r];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int mm = 0; mm < MM; ++mm)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[mm][r] += __shfl_xor_sync(0xffffffffu, acc[mm][r], o);
  // Every lane holds every sum; lane mm * R + r writes output (mm, n0 + r).
#pragma unroll
  for (int mm = 0; mm < MM; ++mm)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const i64 col = n0 + r;
      if (lane != mm * R + r || mm >= m || col >= n) continue;
      float s = acc[mm][r];
      if (beta != 0.0f) s += beta * ld(c[mm * n + col]);
      st(&d[mm * n + col], s);
    }
}

// matmul_pre's projections of one launch: weight j (b[j] [n[j], k], its addend c[j], its result
// d[j]) takes the grid's blocks first[j] .. first[j + 1]; slots past the last repeat its end.
#define GEMV_SETS 4
template <typename T> struct GemvSet {
  const T* b[GEMV_SETS];
  const T* c[GEMV_SETS];
  T* d[GEMV_SETS];
  i64 n[GEMV_SETS];
  i64 first[GEMV_SETS + 1];
};
// The projection of this block, and the block's index within it.
template <typename T> __device__ __forceinline__ int gemv_set(const GemvSet<T>& s, i64& blk) {
  int j = 0;
  while (j + 1 < GEMV_SETS && (i64)blockIdx.x >= s.first[j + 1]) ++j;
  blk = (i64)blockIdx.x - s.first[j];
  return j;
}

#define GEMV(T, SUF, O, OSUF, MM)                                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
      gemv_tn_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta) { \
    pdl_enter();                                                                                                 \
    gemv_tn<T, O, MM, PRE_NONE>(a, nullptr, b, c, d, m, n, k, beta, 0.0, blockIdx.x);                           \
  }
#define GEMV_WR(T, SUF, O, OSUF, MM, R)                                                                      \
  extern "C" __global__ void __launch_bounds__(GEMV_WR_WARPS * 32)                                         \
      gemv_wr##R##_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta) { \
    pdl_enter();                                                                                                      \
    gemv_wr<T, O, MM, R, PRE_NONE>(a, nullptr, b, c, d, m, n, k, beta, 0.0, blockIdx.x);                              \
  }
#define GEMV_ALL(T, SUF, O, OSUF)                                                                          \
  GEMV(T, SUF, O, OSUF, 1) GEMV(T, SUF, O, OSUF, 4) GEMV(T, SUF, O, OSUF, 8) GEMV(T, SUF, O, OSUF, 16)    \
  GEMV_WR(T, SUF, O, OSUF, 1, 1) GEMV_WR(T, SUF, O, OSUF, 1, 2) GEMV_WR(T, SUF, O, OSUF, 4, 1)           \
  GEMV_WR(T, SUF, O, OSUF, 4, 2)
GEMV_ALL(bf16, bf16, bf16, bf16)
GEMV_ALL(bf16, bf16, float, f32)
GEMV_ALL(f16, f16, f16, f16)
GEMV_ALL(f16, f16, float, f32)
GEMV_ALL(float, f32, float, f32)

// matmul_pre's kernels, `gemv_tn_<pre>_<dtype>_<rows>` and `gemv_wr<R>_<pre>_<dtype>_<rows>`
// (pre: norm or swiglu; rows: the buckets of 1 and 4, PROLOGUE_ROWS in rumble-core), writing
// the operands' dtype: (set, a, g, m, k, beta, eps), g and eps read by norm only.
#define GEMV_PRE_KERNEL(T, NAME, WARPS, BODY)                                                                  \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                     \
      NAME(GemvSet<T> s, const T* a, const T* g, i64 m, i64 k, double beta, double eps) {                       \
    pdl_enter();                                                                                             \
    i64 blk;                                                                                                 \
    const int j = gemv_set(s, blk);                                                                          \
    BODY(a, g, s.b[j], s.c[j], s.d[j], m, s.n[j], k, (float)beta, eps, blk);                                  \
  }
#define GEMV_PRE(T, SUF, PRE, PSUF, MM)                                                                        \
  GEMV_PRE_KERNEL(T, gemv_tn_##PSUF##_##SUF##_##MM, GEMV_WARPS, (gemv_tn<T, T, MM, PRE>))                     \
  GEMV_PRE_KERNEL(T, gemv_wr1_##PSUF##_##SUF##_##MM, GEMV_WR_WARPS, (gemv_wr<T, T, MM, 1, PRE>))              \
  GEMV_PRE_KERNEL(T, gemv_wr2_##PSUF##_##SUF##_##MM, GEMV_WR_WARPS, (gemv_wr<T, T, MM, 2, PRE>))
#define GEMV_PRE_ALL(T, SUF)                                                                                   \
  GEMV_PRE(T, SUF, PRE_NORM, norm, 1) GEMV_PRE(T, SUF, PRE_NORM, norm, 4)                                    \
  GEMV_PRE(T, SUF, PRE_SWIGLU, swiglu, 1) GEMV_PRE(T, SUF, PRE_SWIGLU, swiglu, 4)
GEMV_PRE_ALL(bf16, bf16)
GEMV_PRE_ALL(f16, f16)
GEMV_PRE_ALL(float, f32)
