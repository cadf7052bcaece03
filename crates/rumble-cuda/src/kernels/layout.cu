// Layout and indexing kernels: strided copy (permute, broadcast, slice, concat), gather,
// scatter_add. Copies move raw elements of 1, 2, 4 or 8 bytes.

// out[out_off + sum idx_k * s.out[k]] = in[in_off + sum idx_k * s.in[k]] over the row-major
// index space s.dims.
template <typename E>
__device__ void strided_copy(const E* __restrict__ in, E* __restrict__ out, Strides s, i64 n, i64 in_off, i64 out_off) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    i64 rem = i, a = in_off, b = out_off;
    for (int k = s.rank - 1; k >= 0; --k) {
      i64 d = s.dims[k];
      i64 idx = rem % d;
      rem /= d;
      a += idx * s.in[k];
      b += idx * s.out[k];
    }
    out[b] = in[a];
  }
}

// out[i, :] = table[ids[i], :]
template <typename E, typename I>
__device__ void gather(const E* __restrict__ table, const I* __restrict__ ids, E* __restrict__ out, i64 n_ids, i64 rows,
                       i64 d, int* status, int tag) {
  i64 total = n_ids * d;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 i = e / d, c = e % d;
    i64 r = (i64)ids[i];
    if (r < 0 || r >= rows) {
      report(status, tag, 1, r);
      out[e] = (E)0;
    } else {
      out[e] = table[r * d + c];
    }
  }
}

// Deterministic scatter_add: one block per position i; only the first position holding each
// id writes, summing src rows of every position with that id in position order. The output
// was zeroed before (rows no id names stay 0).
template <typename T, typename I>
__device__ void scatter_add(const I* __restrict__ ids, const T* __restrict__ src, T* __restrict__ out, i64 n, i64 rows,
                            i64 d, int* status, int tag) {
  typedef typename Acc<T>::t A;
  __shared__ i64 chunk[1024];
  for (i64 i = blockIdx.x; i < n; i += gridDim.x) {
    i64 id = (i64)ids[i];
    if (id < 0 || id >= rows) {
      if (threadIdx.x == 0) report(status, tag, 1, id);
      continue;
    }
    int earlier = 0;
    for (i64 j = threadIdx.x; j < i; j += blockDim.x) earlier |= ((i64)ids[j] == id);
    if (__syncthreads_or(earlier)) continue;
    for (i64 c0 = 0; c0 < d; c0 += blockDim.x) {
      i64 c = c0 + threadIdx.x;
      A acc = 0;
      for (i64 j0 = i; j0 < n; j0 += 1024) {
        __syncthreads();
        for (int k = threadIdx.x; k < 1024 && j0 + k < n; k += blockDim.x) chunk[k] = (i64)ids[j0 + k];
        __syncthreads();
        i64 m = n - j0 < 1024 ? n - j0 : 1024;
        if (c < d)
          for (i64 k = 0; k < m; ++k)
            if (chunk[k] == id) acc += ldf(src[(j0 + k) * d + c]);
      }
      if (c < d) stf(&out[id * d + c], acc);
    }
  }
}

#define COPY(E, SUF)                                                                                        \
  extern "C" __global__ void copy_##SUF(const E* in, E* out, Strides s, i64 n, i64 in_off, i64 out_off) {  \
    strided_copy<E>(in, out, s, n, in_off, out_off);                                                        \
  }
COPY(u8, 1)
COPY(unsigned short, 2)
COPY(unsigned int, 4)
COPY(unsigned long long, 8)

#define GATHER(E, SUF, I, ISUF)                                                                             \
  extern "C" __global__ void gather_##SUF##_##ISUF(const E* t, const I* ids, E* out, i64 n, i64 rows, i64 d, \
                                                   int* status, int tag) {                                  \
    gather<E, I>(t, ids, out, n, rows, d, status, tag);                                                     \
  }
GATHER(unsigned short, 2, int, i32)
GATHER(unsigned short, 2, i64, i64)
GATHER(unsigned int, 4, int, i32)
GATHER(unsigned int, 4, i64, i64)
GATHER(unsigned long long, 8, int, i32)
GATHER(unsigned long long, 8, i64, i64)

#define SCATTER(T, SUF, I, ISUF)                                                                          \
  extern "C" __global__ void scatter_add_##SUF##_##ISUF(const I* ids, const T* src, T* out, i64 n, i64 rows, \
                                                        i64 d, int* status, int tag) {                    \
    scatter_add<T, I>(ids, src, out, n, rows, d, status, tag);                                            \
  }
SCATTER(float, f32, int, i32)
SCATTER(float, f32, i64, i64)
SCATTER(double, f64, int, i32)
SCATTER(double, f64, i64, i64)
SCATTER(bf16, bf16, int, i32)
SCATTER(bf16, bf16, i64, i64)
SCATTER(f16, f16, int, i32)
SCATTER(f16, f16, i64, i64)
