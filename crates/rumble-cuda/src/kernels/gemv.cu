// Matrix times a few vectors, for the matmuls of decoding (M = the batch, at most GEMV_MAX_M):
// d[m][n] = sum_k a[m][k] b[n][k] (+ beta c[m * ldc + n]), a [M, K] and b [N, K] row-major (b read
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
// 16-byte loads, element by element in the same pattern. The addend's row stride ldc is N (c
// [M, N]) or 0 (c a row [N] added to every row: a linear layer's bias). c may be d (the addend
// in place, ldc = N): each output is read before it is written, by the same thread.
//
// matmul_pre (a decode step's norm or swiglu folded into the projections that read it) runs
// gemv_pre: each block first makes the rows of a its prologue stands for into shared memory,
// rounded to T as the unfolded op would store them (pre_rows), so the products see the values
// the unfolded pair gives; then it takes blocks of rows blockIdx.x, + gridDim.x, ... of the
// launch's projections (GemvSet), on the split the tuner chose for the plain matmul of those
// rows. The rows are made once a block, not once a warp: a grid of a few blocks a
// multiprocessor shares the prologue's reads and arithmetic over many weight rows.
// - PRE_NORM: rms_norm of a row x [K] with weight g, x * r * g, r = 1 / rms(x) by a block sum;
// - PRE_SWIGLU: a row [gate | up] of 2K gives silu(gate) * up (swiglu_packed's arithmetic).
// Every kernel asks L2 for its block's first weight rows (gemv_prefetch) before it waits for the
// kernel before it (pdl_enter): the weights are no earlier kernel's result, so under
// programmatic dependent launch their reads start while that kernel still runs.
#define GEMV_MAX_M 16
#define PRE_NONE 0
#define PRE_NORM 1
#define PRE_SWIGLU 2
// Rows a prologue kernel makes at most (PROLOGUE_ROWS in rumble-core), and the warps of its
// gemv_wr blocks.
#define GEMV_PRE_M 4
#define GEMV_PRE_WR_WARPS 8

// Whether a and b allow 16-byte loads of rows of k elements.
template <typename T>
__device__ __forceinline__ bool gemv_vec(const T* a, const T* b, i64 k) {
  return k % Vec16<T>::n == 0 && (((unsigned long long)a | (unsigned long long)b) & 15) == 0;
}
// `rows` weight rows from row n0 of b into L2 (one bulk prefetch; sm_90 on, 16-byte rows).
template <typename T>
__device__ __forceinline__ void gemv_prefetch(const T* b, i64 n, i64 k, i64 n0, i64 rows) {
#if __CUDA_ARCH__ >= 900
  if (threadIdx.x != 0 || n0 >= n || !gemv_vec(b, b, k)) return;
  const i64 bytes = (n0 + rows < n ? rows : n - n0) * k * (i64)sizeof(T);
  if (bytes <= 0 || bytes >= (1ll << 31)) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(b + n0 * k), "r"((unsigned)bytes) : "memory");
#endif
}
#define GEMV_ROWS 4
#define GEMV_WARPS 8
#define GEMV_WR_WARPS 4
#define GEMV_UNROLL 4
// A block of gemv_tn: rows blk * GEMV_ROWS .. of b. Ends on a block barrier, so a block may
// take another (gemv_pre) and reuse `part`.
template <typename T, typename O, int MM>
__device__ void gemv_tn(const T* __restrict__ a, const T* __restrict__ b, const O* c, O* d, i64 m, i64 n, i64 k,
                        float beta, i64 ldc, i64 blk) {
  __shared__ float part[GEMV_WARPS][GEMV_MAX_M * GEMV_ROWS];
  constexpr int V = Vec16<T>::n;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const i64 n0 = blk * GEMV_ROWS;
  const bool vec = gemv_vec(a, b, k);
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
        ld16(a + mm * k + ch * V, av);
      } else {
        av[0] = ld(a[mm * k + ch]);
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
    if (beta != 0.0f) s += beta * ld(c[mm * ldc + col]);
    st(&d[mm * n + col], s);
  }
  __syncthreads();
}

// gemv_wr's chunks ch, ch + 32, ..., ch + 32 (U - 1) (16-byte chunks of K) of its R rows from
// n0 against every row of a: every load of the group issued before the products.
template <int U, typename T, int MM, int R>
__device__ __forceinline__ void gemv_wr_chunks(const T* __restrict__ a, const T* __restrict__ b, i64 m, i64 n, i64 k,
                                               i64 n0, i64 ch, float (&acc)[MM][R]) {
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
      ld16(a + mm * k + (ch + 32 * u) * V, av);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[mm][r] += av[i] * bv[u][r][i];
    }
  }
}
// A block of gemv_wr: W warps of R rows each, rows blk * W * R ...
template <typename T, typename O, int MM, int R, int W>
__device__ void gemv_wr(const T* __restrict__ a, const T* __restrict__ b, const O* c, O* d, i64 m, i64 n, i64 k,
                        float beta, i64 ldc, i64 blk) {
  constexpr int V = Vec16<T>::n, U = GEMV_UNROLL;
  const int lane = threadIdx.x & 31;
  const i64 n0 = (blk * W + (threadIdx.x >> 5)) * R;
  if (n0 >= n) return;  // the whole warp
  const bool vec = gemv_vec(a, b, k);
  float acc[MM][R];
#pragma unroll
  for (int mm = 0; mm < MM; ++mm)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[mm][r] = 0.0f;
  if (vec) {
    const i64 chunks = k / V;
    i64 ch = lane;
    // Groups of U chunks a lane, then the rest a chunk at a time.
    for (; ch + 32 * (U - 1) < chunks; ch += 32 * U) gemv_wr_chunks<U>(a, b, m, n, k, n0, ch, acc);
    for (; ch < chunks; ch += 32) gemv_wr_chunks<1>(a, b, m, n, k, n0, ch, acc);
  } else {
    for (i64 e = lane; e < k; e += 32) {
      float bv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) bv[r] = n0 + r < n ? ld(b[(n0 + r) * k + e]) : 0.0f;
#pragma unroll
      for (int mm = 0; mm < MM; ++mm) {
        if (mm >= m) break;
        const float av = ld(a[mm * k + e]);
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
      if (beta != 0.0f) s += beta * ld(c[mm * ldc + col]);
      st(&d[mm * n + col], s);
    }
}

// matmul_pre's projections of one launch: weight j (b[j] [n[j], k], its addend c[j] of row stride
// ldc[j], its result d[j]) takes the blocks first[j] .. first[j + 1]; slots past the last repeat
// its end.
#define GEMV_SETS 4
template <typename T> struct GemvSet {
  const T* b[GEMV_SETS];
  const T* c[GEMV_SETS];
  T* d[GEMV_SETS];
  i64 n[GEMV_SETS];
  i64 ldc[GEMV_SETS];
  i64 first[GEMV_SETS + 1];
};
// The projection of block vb, and the block's index within it.
template <typename T> __device__ __forceinline__ int gemv_set(const GemvSet<T>& s, i64 vb, i64& blk) {
  int j = 0;
  while (j + 1 < GEMV_SETS && vb >= s.first[j + 1]) ++j;
  blk = vb - s.first[j];
  return j;
}

// The m <= GEMV_PRE_M rows of a the prologue makes, into `made` ([m][k] of T), by the whole
// block: for PRE_NORM each thread's share of every row's sum of squares, summed over the warps
// in warp order; then each element, 16 bytes at a time where a (and g) allow.
template <int PRE, typename T>
__device__ void pre_rows(const T* __restrict__ a, const T* __restrict__ g, i64 m, i64 k, double eps, T* made) {
  __shared__ float red[32][GEMV_PRE_M];
  __shared__ float rs[GEMV_PRE_M];
  constexpr int V = Vec16<T>::n;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const i64 ka = PRE == PRE_SWIGLU ? 2 * k : k;  // a's row length
  const bool vec = gemv_vec(a, PRE == PRE_NORM ? g : a, k);
  if constexpr (PRE == PRE_NORM) {
    float ss[GEMV_PRE_M];
#pragma unroll
    for (int mm = 0; mm < GEMV_PRE_M; ++mm) {
      ss[mm] = 0.0f;
      if (mm >= m) continue;
      if (vec) {
        for (i64 ch = threadIdx.x; ch < k / V; ch += blockDim.x) {
          float x[V];
          ld16(a + mm * ka + ch * V, x);
#pragma unroll
          for (int i = 0; i < V; ++i) ss[mm] += x[i] * x[i];
        }
      } else {
        for (i64 e = threadIdx.x; e < k; e += blockDim.x) {
          const float x = ld(a[mm * ka + e]);
          ss[mm] += x * x;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss[mm] += __shfl_xor_sync(0xffffffffu, ss[mm], o);
      if (lane == 0) red[w][mm] = ss[mm];
    }
    __syncthreads();
    if (threadIdx.x < m) {
      float t = 0.0f;
      for (int j = 0; j < nw; ++j) t += red[j][threadIdx.x];
      rs[threadIdx.x] = (float)(1.0 / sqrt((double)t / (double)k + eps));
    }
    __syncthreads();
  }
  for (i64 mm = 0; mm < m; ++mm) {
    const T* x = a + mm * ka;
    T* y = made + mm * k;
    const float r = PRE == PRE_NORM ? rs[mm] : 1.0f;
    if (vec) {
      for (i64 ch = threadIdx.x; ch < k / V; ch += blockDim.x) {
        float v[V], u[V];
        ld16(x + ch * V, v);
        if constexpr (PRE == PRE_NORM) {
          ld16(g + ch * V, u);
#pragma unroll
          for (int i = 0; i < V; ++i) v[i] = v[i] * r * u[i];
        } else {
          ld16(x + k + ch * V, u);
#pragma unroll
          for (int i = 0; i < V; ++i) v[i] = (v[i] * sigmoid_<T>(v[i])) * u[i];
        }
        st16(y + ch * V, v);
      }
    } else {
      for (i64 e = threadIdx.x; e < k; e += blockDim.x) {
        const float v = ld(x[e]);
        stf(&y[e], PRE == PRE_NORM ? v * r * ld(g[e]) : (v * sigmoid_<T>(v)) * ld(x[k + e]));
      }
    }
  }
}
// The rows a block of split S takes (0: gemv_tn; R: gemv_wr of R rows a warp).
template <int S> struct PreSplit {
  static const int rows = S == 0 ? GEMV_ROWS : GEMV_PRE_WR_WARPS * S;
};
// The weight rows of a prologue kernel's first block of rows into L2 (gemv_prefetch).
template <int S, typename T>
__device__ __forceinline__ void gemv_pre_prefetch(const GemvSet<T>& s, i64 k) {
  if ((i64)blockIdx.x < s.first[GEMV_SETS]) {
    i64 blk;
    const int j = gemv_set(s, (i64)blockIdx.x, blk);
    gemv_prefetch(s.b[j], s.n[j], k, blk * PreSplit<S>::rows, PreSplit<S>::rows);
  }
}
// A prologue kernel's body (after pdl_enter): `made` is the block's dynamic shared memory, m * k
// elements of T.
template <int PRE, int S, typename T, int MM>
__device__ void gemv_pre(const GemvSet<T>& s, const T* a, const T* g, i64 m, i64 k, float beta, double eps, T* made) {
  const i64 total = s.first[GEMV_SETS];
  pre_rows<PRE>(a, g, m, k, eps, made);
  __syncthreads();
  for (i64 vb = blockIdx.x; vb < total; vb += gridDim.x) {
    i64 blk;
    const int j = gemv_set(s, vb, blk);
    if constexpr (S == 0)
      gemv_tn<T, T, MM>(made, s.b[j], s.c[j], s.d[j], m, s.n[j], k, beta, s.ldc[j], blk);
    else
      gemv_wr<T, T, MM, S, GEMV_PRE_WR_WARPS>(made, s.b[j], s.c[j], s.d[j], m, s.n[j], k, beta, s.ldc[j], blk);
  }
}

#define GEMV(T, SUF, O, OSUF, MM)                                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
      gemv_tn_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta,   \
                                    i64 ldc) {                                                                   \
    gemv_prefetch(b, n, k, (i64)blockIdx.x * GEMV_ROWS, GEMV_ROWS);                                              \
    pdl_enter();                                                                                                 \
    gemv_tn<T, O, MM>(a, b, c, d, m, n, k, beta, ldc, blockIdx.x);                                               \
  }
#define GEMV_WR(T, SUF, O, OSUF, MM, R)                                                                      \
  extern "C" __global__ void __launch_bounds__(GEMV_WR_WARPS * 32)                                         \
      gemv_wr##R##_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta,   \
                                         i64 ldc) {                                                                   \
    gemv_prefetch(b, n, k, (i64)blockIdx.x * GEMV_WR_WARPS * R, GEMV_WR_WARPS * R);                                  \
    pdl_enter();                                                                                                      \
    gemv_wr<T, O, MM, R, GEMV_WR_WARPS>(a, b, c, d, m, n, k, beta, ldc, blockIdx.x);                                  \
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
// (pre: norm or swiglu; rows: the buckets of 1 and 4, GEMV_PRE_M), writing the operands'
// dtype: (set, a, g, m, k, beta, eps), g and eps read by norm only; m * k elements of T of
// dynamic shared memory; 256 threads (GEMV_WARPS, GEMV_PRE_WR_WARPS).
#define GEMV_PRE(T, SUF, PRE, PSUF, MM, S, NAME)                                                           \
  extern "C" __global__ void __launch_bounds__(256)                                                        \
      NAME##_##PSUF##_##SUF##_##MM(GemvSet<T> s, const T* a, const T* g, i64 m, i64 k, double beta, double eps) { \
    gemv_pre_prefetch<S>(s, k);                                                                               \
    pdl_enter();                                                                                              \
    extern __shared__ __align__(16) unsigned char made[];                                                     \
    gemv_pre<PRE, S, T, MM>(s, a, g, m, k, (float)beta, eps, reinterpret_cast<T*>(made));                    \
  }
#define GEMV_PRE_SPLITS(T, SUF, PRE, PSUF, MM)                                                                 \
  GEMV_PRE(T, SUF, PRE, PSUF, MM, 0, gemv_tn) GEMV_PRE(T, SUF, PRE, PSUF, MM, 1, gemv_wr1)                   \
  GEMV_PRE(T, SUF, PRE, PSUF, MM, 2, gemv_wr2)
#define GEMV_PRE_ALL(T, SUF)                                                                                   \
  GEMV_PRE_SPLITS(T, SUF, PRE_NORM, norm, 1) GEMV_PRE_SPLITS(T, SUF, PRE_NORM, norm, 4)                      \
  GEMV_PRE_SPLITS(T, SUF, PRE_SWIGLU, swiglu, 1) GEMV_PRE_SPLITS(T, SUF, PRE_SWIGLU, swiglu, 4)
GEMV_PRE_ALL(bf16, bf16)
GEMV_PRE_ALL(f16, f16)
GEMV_PRE_ALL(float, f32)
