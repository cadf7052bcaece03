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
#define GEMV_MAX_M 16
#define GEMV_ROWS 4
#define GEMV_WARPS 8
#define GEMV_WR_WARPS 4
#define GEMV_UNROLL 4
template <typename T, typename O, int MM>
__device__ void gemv_tn(const T* __restrict__ a, const T* __restrict__ b, const O* c, O* d, i64 m, i64 n, i64 k,
                        float beta) {
  __shared__ float part[GEMV_WARPS][GEMV_MAX_M * GEMV_ROWS];
  constexpr int V = Vec16<T>::n;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const i64 n0 = (i64)blockIdx.x * GEMV_ROWS;
  const bool vec = k % V == 0 && ((unsigned long long)a & 15) == 0 && ((unsigned long long)b & 15) == 0;
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
    if (beta != 0.0f) s += beta * ld(c[mm * n + col]);
    st(&d[mm * n + col], s);
  }
}

// gemv_wr's chunks ch, ch + 32, ..., ch + 32 (U - 1) (16-byte chunks of K) of its R rows from
// n0 against every row of a: every load of the group issued before the products.
template <int U, typename T, int MM, int R>
__device__ __forceinline__ void gemv_wr_chunks(const T* __restrict__ a, const T* __restrict__ b, i64 m, i64 n,
                                               i64 k, i64 n0, i64 ch, float (&acc)[MM][R]) {
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
template <typename T, typename O, int MM, int R>
__device__ void gemv_wr(const T* __restrict__ a, const T* __restrict__ b, const O* c, O* d, i64 m, i64 n, i64 k,
                        float beta) {
  constexpr int V = Vec16<T>::n, U = GEMV_UNROLL;
  const int lane = threadIdx.x & 31;
  const i64 n0 = ((i64)blockIdx.x * GEMV_WR_WARPS + (threadIdx.x >> 5)) * R;
  if (n0 >= n) return;  // the whole warp
  const bool vec = k % V == 0 && ((unsigned long long)a & 15) == 0 && ((unsigned long long)b & 15) == 0;
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
      if (beta != 0.0f) s += beta * ld(c[mm * n + col]);
      st(&d[mm * n + col], s);
    }
}

#define GEMV(T, SUF, O, OSUF, MM)                                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
      gemv_tn_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta) { \
    pdl_enter();                                                                                                 \
    gemv_tn<T, O, MM>(a, b, c, d, m, n, k, beta);                                                          \
  }
#define GEMV_WR(T, SUF, O, OSUF, MM, R)                                                                      \
  extern "C" __global__ void __launch_bounds__(GEMV_WR_WARPS * 32)                                         \
      gemv_wr##R##_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta) { \
    pdl_enter();                                                                                                      \
    gemv_wr<T, O, MM, R>(a, b, c, d, m, n, k, beta);                                                       \
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
