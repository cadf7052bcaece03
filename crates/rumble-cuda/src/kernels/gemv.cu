// Matrix times a few vectors, for the matmuls of decoding (M = the batch, at most GEMV_MAX_M):
// d[m][n] = sum_k a[m][k] b[n][k] (+ beta c[m][n]), a [M, K] and b [N, K] row-major (b read
// transposed: the linear layers' [out, in] weights), f32 accumulation, one rounding to O.
// A block of GEMV_WARPS warps owns GEMV_ROWS neighbouring rows n. Lane l of warp w takes the
// 16-byte chunks w * 32 + l, + GEMV_WARPS * 32, ... of those rows' K (each b chunk is used for
// every m, each a chunk for every row), the warp sums its lanes (butterfly), and the block adds
// its warps' sums in warp order: the order depends only on the shapes. Where K or a pointer
// does not allow 16-byte loads, element by element in the same pattern. c may be d (the
// addend in place): each output is read before it is written, by the same thread. The matmul
// tuner (matmul_tune.rs) times this kernel beside cuBLASLt's algorithms and keeps the faster.
#define GEMV_MAX_M 16
#define GEMV_ROWS 4
#define GEMV_WARPS 8
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

#define GEMV(T, SUF, O, OSUF, MM)                                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
      gemv_tn_##SUF##_##OSUF##_##MM(const T* a, const T* b, const O* c, O* d, i64 m, i64 n, i64 k, float beta) { \
    gemv_tn<T, O, MM>(a, b, c, d, m, n, k, beta);                                                          \
  }
#define GEMV_ALL(T, SUF, O, OSUF) GEMV(T, SUF, O, OSUF, 1) GEMV(T, SUF, O, OSUF, 4) GEMV(T, SUF, O, OSUF, 8) GEMV(T, SUF, O, OSUF, 16)
GEMV_ALL(bf16, bf16, bf16, bf16)
GEMV_ALL(bf16, bf16, float, f32)
GEMV_ALL(f16, f16, f16, f16)
GEMV_ALL(f16, f16, float, f32)
GEMV_ALL(float, f32, float, f32)
