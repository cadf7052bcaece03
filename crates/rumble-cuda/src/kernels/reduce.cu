// Reductions along any axes (sum, mean, amax), one block per output element, fixed order:
// each thread folds its elements in index order, then a shuffle tree (deterministic).

// The input offset of output element o (kept dims) and of reduced element r (reduced dims).
__device__ __forceinline__ i64 offset_of(i64 idx, const i64* dims, const i64* strides, int rank) {
  i64 off = 0;
  for (int k = rank - 1; k >= 0; --k) {
    off += (idx % dims[k]) * strides[k];
    idx /= dims[k];
  }
  return off;
}

// mode 0: sum, 1: mean, 2: max (NaN wins)
template <typename T>
__device__ void reduce_float(const T* __restrict__ in, T* __restrict__ out, Strides kept, Strides red, i64 n_out,
                             i64 n_red, int mode) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  for (i64 o = blockIdx.x; o < n_out; o += gridDim.x) {
    i64 base = offset_of(o, kept.dims, kept.in, kept.rank);
    A acc = mode == 2 ? (A)(-F64_INF) : (A)0;
    for (i64 r = threadIdx.x; r < n_red; r += blockDim.x) {
      A v = ldf(in[base + offset_of(r, red.dims, red.in, red.rank)]);
      if (mode == 2) {
        if (!nan_(acc) && (nan_(v) || v > acc)) acc = v;
      } else {
        acc += v;
      }
    }
    A r;
    if (mode == 2) {
      // NaN-propagating max tree.
      int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
      for (int s = 16; s > 0; s >>= 1) {
        A other = __shfl_xor_sync(0xffffffffu, acc, s);
        acc = (nan_(acc) || nan_(other)) ? (A)F64_NAN : (other > acc ? other : acc);
      }
      __syncthreads();
      if (lane == 0) buf[w] = acc;
      __syncthreads();
      r = buf[0];
      for (int k = 1; k < nw; ++k) r = (nan_(r) || nan_(buf[k])) ? (A)F64_NAN : (buf[k] > r ? buf[k] : r);
      __syncthreads();
    } else {
      r = block_sum(acc, buf);
      if (mode == 1) r = r / (A)n_red;
    }
    if (threadIdx.x == 0) stf(&out[o], r);
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
                                          int mode) {                                                     \
    reduce_float<T>(in, out, kept, red, n_out, n_red, mode);                                              \
  }
REDUCE(float, f32)
REDUCE(double, f64)
REDUCE(bf16, bf16)
REDUCE(f16, f16)
extern "C" __global__ void reduce_max_i32(const int* in, int* out, Strides kept, Strides red, i64 n_out, i64 n_red) {
  reduce_int_max<int>(in, out, kept, red, n_out, n_red);
}
extern "C" __global__ void reduce_max_i64(const i64* in, i64* out, Strides kept, Strides red, i64 n_out, i64 n_red) {
  reduce_int_max<i64>(in, out, kept, red, n_out, n_red);
}
