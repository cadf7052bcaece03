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

// The same with 32-bit index arithmetic, for copies whose every index and offset fits in an int
// (the host checks): 64-bit division is several times slower on the GPU.
template <typename E>
__device__ void strided_copy32(const E* __restrict__ in, E* __restrict__ out, Strides s, i64 n64, i64 in_off,
                               i64 out_off) {
  const unsigned n = (unsigned)n64;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned rem = i, a = (unsigned)in_off, b = (unsigned)out_off;
    for (int k = s.rank - 1; k >= 0; --k) {
      const unsigned d = (unsigned)s.dims[k];
      const unsigned q = rem / d, idx = rem - q * d;
      rem = q;
      a += idx * (unsigned)s.in[k];
      b += idx * (unsigned)s.out[k];
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

// Deterministic scatter_add in two kernels over a links table (2 x n ints of the node's
// scratch): scatter_links finds, for every position i, whether it is the first holding its id
// (links[2i+1] = 1) and the next position holding the same id (links[2i], -1 at the last),
// one warp per position scanning the ids around it with ballots (O(n) per position at most,
// integers only). scatter_sum then walks each id's chain from its first position, summing the
// src rows in position order, one block per first position and threads over the columns. The
// output was zeroed before (rows no id names stay 0). Bad ids are reported and skipped.
template <typename I>
__device__ void scatter_links(const I* __restrict__ ids, int* __restrict__ links, i64 n, i64 rows, int* status, int tag) {
  int lane = threadIdx.x & 31;
  i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n; i += warps) {
    i64 id = (i64)ids[i];
    if (id < 0 || id >= rows) {
      if (lane == 0) {
        report(status, tag, 1, id);
        links[2 * i] = -1;
        links[2 * i + 1] = 0;
      }
      continue;
    }
    // The nearest earlier position with this id, scanning down from i - 1.
    bool first = true;
    for (i64 j0 = i - 1; j0 >= 0; j0 -= 32) {
      i64 j = j0 - lane;
      if (__any_sync(0xffffffffu, j >= 0 && (i64)ids[j] == id)) {
        first = false;
        break;
      }
    }
    // The nearest later position with this id.
    i64 next = -1;
    for (i64 j0 = i + 1; j0 < n; j0 += 32) {
      i64 j = j0 + lane;
      unsigned hit = __ballot_sync(0xffffffffu, j < n && (i64)ids[j] == id);
      if (hit) {
        next = j0 + __ffs(hit) - 1;
        break;
      }
    }
    if (lane == 0) {
      links[2 * i] = (int)next;
      links[2 * i + 1] = first ? 1 : 0;
    }
  }
}

template <typename T, typename I>
__device__ void scatter_sum(const I* __restrict__ ids, const int* __restrict__ links, const T* __restrict__ src,
                            T* __restrict__ out, i64 n, i64 d) {
  typedef typename Acc<T>::t A;
  for (i64 i = blockIdx.x; i < n; i += gridDim.x) {
    if (!links[2 * i + 1]) continue;
    i64 id = (i64)ids[i];
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
      A acc = 0;
      for (i64 j = i; j >= 0; j = links[2 * j]) acc += ldf(src[j * d + c]);
      stf(&out[id * d + c], acc);
    }
  }
}

#define COPY(E, SUF)                                                                                        \
  extern "C" __global__ void copy_##SUF(const E* in, E* out, Strides s, i64 n, i64 in_off, i64 out_off) {  \
    pdl_enter();                                                                                           \
    strided_copy<E>(in, out, s, n, in_off, out_off);                                                        \
  }
#define COPY32(E, SUF)                                                                                      \
  extern "C" __global__ void copy32_##SUF(const E* in, E* out, Strides s, i64 n, i64 in_off, i64 out_off) { \
    pdl_enter();                                                                                            \
    strided_copy32<E>(in, out, s, n, in_off, out_off);                                                      \
  }
COPY32(u8, 1)
COPY32(unsigned short, 2)
COPY32(unsigned int, 4)
COPY32(unsigned long long, 8)
COPY(u8, 1)
COPY(unsigned short, 2)
COPY(unsigned int, 4)
COPY(unsigned long long, 8)

#define GATHER(E, SUF, I, ISUF)                                                                             \
  extern "C" __global__ void gather_##SUF##_##ISUF(const E* t, const I* ids, E* out, i64 n, i64 rows, i64 d, \
                                                   int* status, int tag) {                                  \
    pdl_enter();                                                                                            \
    gather<E, I>(t, ids, out, n, rows, d, status, tag);                                                     \
  }
GATHER(unsigned short, 2, int, i32)
GATHER(unsigned short, 2, i64, i64)
GATHER(unsigned int, 4, int, i32)
GATHER(unsigned int, 4, i64, i64)
GATHER(unsigned long long, 8, int, i32)
GATHER(unsigned long long, 8, i64, i64)

#define SCATTER_LINKS(I, ISUF)                                                                            \
  extern "C" __global__ void scatter_links_##ISUF(const I* ids, int* links, i64 n, i64 rows, int* status, int tag) { \
    pdl_enter();                                                                                                     \
    scatter_links<I>(ids, links, n, rows, status, tag);                                                      \
  }
SCATTER_LINKS(int, i32)
SCATTER_LINKS(i64, i64)

#define SCATTER(T, SUF, I, ISUF)                                                                          \
  extern "C" __global__ void scatter_sum_##SUF##_##ISUF(const I* ids, const int* links, const T* src, T* out, i64 n, \
                                                        i64 d) {                                          \
    pdl_enter();                                                                                          \
    scatter_sum<T, I>(ids, links, src, out, n, d);                                                        \
  }
SCATTER(float, f32, int, i32)
SCATTER(float, f32, i64, i64)
SCATTER(double, f64, int, i32)
SCATTER(double, f64, i64, i64)
SCATTER(bf16, bf16, int, i32)
SCATTER(bf16, bf16, i64, i64)
SCATTER(f16, f16, int, i32)
SCATTER(f16, f16, i64, i64)
