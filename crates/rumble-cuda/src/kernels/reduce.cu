// Reductions along any axes (sum, mean, amax, sum of squares), one block per output element, fixed order:
// each thread folds its elements in index order, then a shuffle tree (deterministic).
// Few outputs over many elements (a loss's sum of all logits) split each output's reduced
// range into `parts` fixed pieces: reduce_part_* writes one accumulator per (output, piece)
// to scratch, reduce_fin_* folds the pieces in order. The split depends only on the shapes, so
// the result is the same on every run. `contig`: the reduced axes are the trailing ones, so
// reduced element r sits at base + r (no index arithmetic per element). Reductions over the
// leading axes (the kept ones trailing) read rows instead (reduce_cols_part).

// The input offset of output element o (kept dims) and of reduced element r (reduced dims).
__device__ __forceinline__ i64 offset_of(i64 idx, const i64* dims, const i64* strides, int rank) {
  i64 off = 0;
  for (int k = rank - 1; k >= 0; --k) {
    off += (idx % dims[k]) * strides[k];
    idx /= dims[k];
  }
  return off;
}

// Folds reduced elements [r0, r1) of output o into one accumulator per block (thread 0 holds it).
template <typename T>
__device__ __forceinline__ typename Acc<T>::t fold_range(const T* __restrict__ in, i64 base, Strides red, i64 r0,
                                                         i64 r1, int mode, int contig) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  A acc = mode == 2 ? (A)(-F64_INF) : (A)0;
  for (i64 r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
    A v = ldf(in[base + (contig ? r : offset_of(r, red.dims, red.in, red.rank))]);
    if (mode == 2) {
      if (!nan_(acc) && (nan_(v) || v > acc)) acc = v;
    } else {
      acc += mode == 3 ? v * v : v;
    }
  }
  if (mode != 2) return block_sum(acc, buf);
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  for (int s = 16; s > 0; s >>= 1) {
    A other = __shfl_xor_sync(0xffffffffu, acc, s);
    acc = (nan_(acc) || nan_(other)) ? (A)F64_NAN : (other > acc ? other : acc);
  }
  __syncthreads();
  if (lane == 0) buf[w] = acc;
  __syncthreads();
  A r = buf[0];
  for (int k = 1; k < nw; ++k) r = (nan_(r) || nan_(buf[k])) ? (A)F64_NAN : (buf[k] > r ? buf[k] : r);
  __syncthreads();
  return r;
}

// mode 0: sum, 1: mean, 2: max (NaN wins), 3: sum of squares. One block per output.
template <typename T>
__device__ void reduce_float(const T* __restrict__ in, T* __restrict__ out, Strides kept, Strides red, i64 n_out,
                             i64 n_red, int mode, int contig) {
  typedef typename Acc<T>::t A;
  for (i64 o = blockIdx.x; o < n_out; o += gridDim.x) {
    A r = fold_range<T>(in, offset_of(o, kept.dims, kept.in, kept.rank), red, 0, n_red, mode, contig);
    if (mode == 1) r = r / (A)n_red;
    if (threadIdx.x == 0) stf(&out[o], r);
  }
}

// Pass 1 of the split reduction: block (o, p) folds piece p (`chunk` reduced elements) of
// output o into part[o * parts + p].
template <typename T>
__device__ void reduce_part(const T* __restrict__ in, typename Acc<T>::t* __restrict__ part, Strides kept,
                            Strides red, i64 n_out, i64 n_red, i64 parts, i64 chunk, int mode, int contig) {
  for (i64 b = blockIdx.x; b < n_out * parts; b += gridDim.x) {
    const i64 o = b / parts, p = b % parts;
    const i64 base = offset_of(o, kept.dims, kept.in, kept.rank);
    const i64 r0 = p * chunk, r1 = r0 + chunk < n_red ? r0 + chunk : n_red;
    typename Acc<T>::t r = fold_range<T>(in, base, red, r0, r1, mode, contig);
    if (threadIdx.x == 0) part[b] = r;
  }
}

// Pass 2: one thread per output folds its `parts` accumulators in order; accumulator p of
// output o sits at part[o * so + p * sp] (reduce_part: so = parts, sp = 1).
template <typename T>
__device__ void fold_parts(const typename Acc<T>::t* __restrict__ part, T* __restrict__ out, i64 n_out, i64 n_red,
                           i64 parts, i64 so, i64 sp, int mode) {
  typedef typename Acc<T>::t A;
  for (i64 o = (i64)blockIdx.x * blockDim.x + threadIdx.x; o < n_out; o += (i64)gridDim.x * blockDim.x) {
    A r = part[o * so];
    for (i64 p = 1; p < parts; ++p) {
      A v = part[o * so + p * sp];
      if (mode == 2) {
        r = (nan_(r) || nan_(v)) ? (A)F64_NAN : (v > r ? v : r);
      } else {
        r += v;
      }
    }
    if (mode == 1) r = r / (A)n_red;
    stf(&out[o], r);
  }
}

// Folding one more element into an accumulator, and two accumulators into one (max: NaN wins).
template <typename A>
__device__ __forceinline__ A fold_one(A acc, A v, int mode) {
  if (mode == 2) return (!nan_(acc) && (nan_(v) || v > acc)) ? v : acc;
  return acc + (mode == 3 ? v * v : v);
}
template <typename A>
__device__ __forceinline__ A fold_two(A a, A b, int mode) {
  if (mode == 2) return (nan_(a) || nan_(b)) ? (A)F64_NAN : (b > a ? b : a);
  return a + b;
}

// Reductions over the leading axes of a row-major [R, C] (the kept axes trailing: a bias
// gradient's sum over the tokens), in two passes of blocks of 8 warps. Pass 1, block (x, p):
// lane l of every warp owns the CV = 16 / sizeof(T) adjacent columns x * 32 CV + l CV (one
// 16-byte load a row where C % CV == 0 and the input is aligned, else element by element);
// warp w folds rows p * chunk + w, + w + 8, ... of the piece in order, then the block adds its 8
// warps' sums in warp order into part[p * C + c]. Pass 2 (reduce_cols_fin), block x: columns x
// * 32 .. + 32, warp w folds pieces [w * per, (w + 1) * per) in order, then the 8 warps' results
// in warp order. Every order depends only on the shapes: the same bits on every run.
#define RC_WARPS 8
template <typename T>
__device__ void reduce_cols_part(const T* __restrict__ in, typename Acc<T>::t* __restrict__ part, i64 rows, i64 cols,
                                 i64 parts, i64 chunk, int mode) {
  typedef typename Acc<T>::t A;
  constexpr int CV = Vec16<T>::n;
  __shared__ A sh[RC_WARPS][32 * CV];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const i64 c0 = ((i64)blockIdx.x * 32 + lane) * CV;
  const bool vec = cols % CV == 0 && ((unsigned long long)in & 15) == 0;
  for (i64 p = blockIdx.y; p < parts; p += gridDim.y) {
    const i64 r0 = p * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    A acc[CV];
#pragma unroll
    for (int i = 0; i < CV; ++i) acc[i] = mode == 2 ? (A)(-F64_INF) : (A)0;
    if (c0 < cols) {
#pragma unroll 4
      for (i64 r = r0 + w; r < r1; r += RC_WARPS) {
        const T* row = in + r * cols + c0;
        if (vec) {
          A x[CV];
          ld16(row, x);
#pragma unroll
          for (int i = 0; i < CV; ++i) acc[i] = fold_one(acc[i], x[i], mode);
        } else {
#pragma unroll
          for (int i = 0; i < CV; ++i)
            if (c0 + i < cols) acc[i] = fold_one(acc[i], ldf(row[i]), mode);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < CV; ++i) sh[w][lane * CV + i] = acc[i];
    __syncthreads();
    for (int e = threadIdx.x; e < 32 * CV; e += blockDim.x) {
      const i64 c = (i64)blockIdx.x * 32 * CV + e;
      A a = sh[0][e];
      for (int k = 1; k < RC_WARPS; ++k) a = fold_two(a, sh[k][e], mode);
      if (c < cols) part[p * cols + c] = a;
    }
    __syncthreads();
  }
}

template <typename T>
__device__ void reduce_cols_fin(const typename Acc<T>::t* __restrict__ part, T* __restrict__ out, i64 cols, i64 n_red,
                                i64 parts, int mode) {
  typedef typename Acc<T>::t A;
  __shared__ A sh[RC_WARPS][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const i64 per = (parts + RC_WARPS - 1) / RC_WARPS;
  for (i64 x = blockIdx.x; x * 32 < cols; x += gridDim.x) {
    const i64 c = x * 32 + lane, p0 = w * per, p1 = p0 + per < parts ? p0 + per : parts;
    A a = mode == 2 ? (A)(-F64_INF) : (A)0;
    if (c < cols)
      for (i64 p = p0; p < p1; ++p) a = fold_two(a, part[p * cols + c], mode);
    sh[w][lane] = a;
    __syncthreads();
    if (w == 0 && c < cols) {
      A r = sh[0][lane];
      for (int k = 1; k < RC_WARPS; ++k) r = fold_two(r, sh[k][lane], mode);
      if (mode == 1) r = r / (A)n_red;
      stf(&out[c], r);
    }
    __syncthreads();
  }
}

template <typename I>
__device__ void reduce_int_max(const I* __restrict__ in, I* __restrict__ out, Strides kept, Strides red, i64 n_out,
                               i64 n_red) {
  __shared__ i64 buf[32];
  for (i64 o = blockIdx.x; o < n_out; o += gridDim.x) {
    i64 base = offset_of(o, kept.dims, kept.in, kept.rank);
    i64 acc = (i64)0x8000000000000000ULL;
    for (i64 r = threadIdx.x; r < n_red; r += blockDim.x) {
      i64 v = (i64)in[base + offset_of(r, red.dims, red.in, red.rank)];
      acc = v > acc ? v : acc;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int s = 16; s > 0; s >>= 1) {
      i64 other = __shfl_xor_sync(0xffffffffu, acc, s);
      acc = other > acc ? other : acc;
    }
    __syncthreads();
    if (lane == 0) buf[w] = acc;
    __syncthreads();
    i64 r = buf[0];
    for (int k = 1; k < nw; ++k) r = buf[k] > r ? buf[k] : r;
    __syncthreads();
    if (threadIdx.x == 0) out[o] = (I)r;
  }
}

#define REDUCE(T, SUF)                                                                                    \
  extern "C" __global__ void reduce_##SUF(const T* in, T* out, Strides kept, Strides red, i64 n_out, i64 n_red, \
                                          int mode, int contig) {                                         \
    pdl_enter();                                                                                          \
    reduce_float<T>(in, out, kept, red, n_out, n_red, mode, contig);                                            \
  }
#define REDUCE_SPLIT(T, SUF)                                                                              \
  extern "C" __global__ void reduce_part_##SUF(const T* in, Acc<T>::t* part, Strides kept, Strides red, i64 n_out, \
                                               i64 n_red, i64 parts, i64 chunk, int mode, int contig) {   \
    pdl_enter();                                                                                          \
    reduce_part<T>(in, part, kept, red, n_out, n_red, parts, chunk, mode, contig);                         \
  }                                                                                                       \
  extern "C" __global__ void reduce_fin_##SUF(const Acc<T>::t* part, T* out, i64 n_out, i64 n_red, i64 parts, \
                                              int mode) {                                                 \
    pdl_enter();                                                                                          \
    fold_parts<T>(part, out, n_out, n_red, parts, parts, 1, mode);                                        \
  }                                                                                                       \
  extern "C" __global__ void reduce_cols_part_##SUF(const T* in, Acc<T>::t* part, i64 rows, i64 cols, i64 parts, \
                                                    i64 chunk, int mode) {                                \
    pdl_enter();                                                                                          \
    reduce_cols_part<T>(in, part, rows, cols, parts, chunk, mode);                                        \
  }                                                                                                       \
  extern "C" __global__ void reduce_cols_fin_##SUF(const Acc<T>::t* part, T* out, i64 cols, i64 n_red, i64 parts, \
                                                   int mode) {                                            \
    pdl_enter();                                                                                          \
    reduce_cols_fin<T>(part, out, cols, n_red, parts, mode);                                              \
  }
REDUCE_SPLIT(float, f32)
REDUCE_SPLIT(double, f64)
REDUCE_SPLIT(bf16, bf16)
REDUCE_SPLIT(f16, f16)
REDUCE(float, f32)
REDUCE(double, f64)
REDUCE(bf16, bf16)
REDUCE(f16, f16)
extern "C" __global__ void reduce_max_i32(const int* in, int* out, Strides kept, Strides red, i64 n_out, i64 n_red) {
  pdl_enter();
  reduce_int_max<int>(in, out, kept, red, n_out, n_red);
}
extern "C" __global__ void reduce_max_i64(const i64* in, i64* out, Strides kept, Strides red, i64 n_out, i64 n_red) {
  pdl_enter();
  reduce_int_max<i64>(in, out, kept, red, n_out, n_red);
}
