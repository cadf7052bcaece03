// Scaled dot-product attention with grouped-query heads: a correct, deterministic kernel in
// the flash style (online softmax over key blocks; only o and the log-sum-exp are saved), one
// block per query row (forward, dq) or key row (dk, dv). Issue 6 replaces it with tiled
// tensor-core kernels; the interface (o, lse, scratch D) stays.
#define NT 128
#define MAXU 8  // head size up to NT * MAXU

#define NW (NT / 32)
// Shapes and the operands' layout as element strides between heads and between positions of
// q, o, dO, dQ (qhs, qrs) and of k, v, dK, dV (khs, krs): flash.rs `dims_blob`. lse and delta
// are [B, Hq, T] (indexed by the query row bh * t + i) in either layout.
struct AttnDims { i64 b, hq, hkv, t, s, d, qhs, qrs, khs, krs; };
// Offset of row i of query head bh = b * hq + h; of row j of kv head bk = b * hkv + h.
__device__ __forceinline__ i64 attn_q(const AttnDims& dm, i64 bh, i64 i) {
  return (bh / dm.hq) * dm.hq * dm.t * dm.d + (bh % dm.hq) * dm.qhs + i * dm.qrs;
}
__device__ __forceinline__ i64 attn_k(const AttnDims& dm, i64 bk, i64 j) {
  return (bk / dm.hkv) * dm.hkv * dm.s * dm.d + (bk % dm.hkv) * dm.khs + j * dm.krs;
}

// Query row `row` (= bh * t + i) of attention: the k and v rows of its kv head, its offset in
// q, o, dO and dQ, and how many keys it sees.
template <typename T>
struct QueryRow {
  const T* kb;
  const T* vb;
  i64 qo, n;
};
template <typename T>
__device__ __forceinline__ QueryRow<T> query_row(const AttnDims& dm, const T* k, const T* v, i64 row, int causal) {
  const i64 i = row % dm.t, bh = row / dm.t, h = bh % dm.hq, b = bh / dm.hq;
  const i64 bk = b * dm.hkv + h / (dm.hq / dm.hkv);
  return {k + attn_k(dm, bk, 0), v + attn_k(dm, bk, 0), attn_q(dm, bh, i), causal ? i + 1 : dm.s};
}

// x . row over d elements by one warp: lanes read consecutive elements (coalesced), then a
// fixed shuffle tree. Every lane gets the result.
template <typename T, typename A>
__device__ __forceinline__ A warp_dot(const A* x, const T* __restrict__ row, i64 d) {
  A acc = 0;
  for (i64 c = threadIdx.x & 31; c < d; c += 32) acc += x[c] * ldf(row[c]);
  return warp_sum(acc);
}

template <typename T>
__device__ void attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                         typename Acc<T>::t* __restrict__ lse, AttnDims dm, double scale_d, int causal) {
  typedef typename Acc<T>::t A;
  extern __shared__ double smem_d[];
  A* qs = (A*)smem_d;
  A* ps = qs + dm.d;
  __shared__ A buf[32];
  const A scale = (A)scale_d;
  const int tid = threadIdx.x;
  const i64 d = dm.d;
  for (i64 row = blockIdx.x; row < dm.b * dm.hq * dm.t; row += gridDim.x) {
    const QueryRow<T> r = query_row(dm, k, v, row, causal);
    const T *kb = r.kb, *vb = r.vb;
    const i64 qo = r.qo, n = r.n;
    __syncthreads();
    for (i64 c = tid; c < d; c += NT) qs[c] = ldf(q[qo + c]);
    __syncthreads();
    A m = (A)(-F64_INF), l = 0;
    A acc[MAXU];
#pragma unroll
    for (int u = 0; u < MAXU; ++u) acc[u] = 0;
    for (i64 j0 = 0; j0 < n; j0 += NT) {
      i64 cnt = n - j0 < NT ? n - j0 : NT;
      for (int jj = tid >> 5; jj < NT; jj += NW) {
        A sc = (A)(-F64_INF);
        if (jj < cnt) sc = warp_dot(qs, kb + (j0 + jj) * dm.krs, d) * scale;
        if ((tid & 31) == 0) ps[jj] = sc;
      }
      __syncthreads();
      A s = ps[tid];
      A mn = fmax_(m, block_max(s, buf));
      A p = tid < cnt ? ex_(s - mn) : (A)0;
      ps[tid] = p;
      A lb = block_sum(p, buf);
      A alpha = ex_(m - mn);
      l = l * alpha + lb;
#pragma unroll
      for (int u = 0; u < MAXU; ++u) {
        i64 c = tid + u * NT;
        if (c < d) {
          A a = acc[u] * alpha;
          for (i64 jj = 0; jj < cnt; ++jj) a += ps[jj] * ldf(vb[(j0 + jj) * dm.krs + c]);
          acc[u] = a;
        }
      }
      m = mn;
      __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < MAXU; ++u) {
      i64 c = tid + u * NT;
      if (c < d) stf(&o[qo + c], acc[u] / l);
    }
    if (tid == 0) lse[row] = m + ln_(l);
  }
}

// dq of each query row; also writes delta[row] = sum(do * o) for the dk/dv pass.
template <typename T>
__device__ void attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                            const T* __restrict__ o, const typename Acc<T>::t* __restrict__ lse, const T* __restrict__ dout,
                            T* __restrict__ dq, double* __restrict__ delta, AttnDims dm, double scale_d, int causal) {
  typedef typename Acc<T>::t A;
  extern __shared__ double smem_d[];
  A* qs = (A*)smem_d;
  A* gs = qs + dm.d;
  A* ps = gs + dm.d;
  __shared__ A buf[32];
  const A scale = (A)scale_d;
  const int tid = threadIdx.x;
  const i64 d = dm.d;
  for (i64 row = blockIdx.x; row < dm.b * dm.hq * dm.t; row += gridDim.x) {
    const QueryRow<T> r = query_row(dm, k, v, row, causal);
    __syncthreads();
    A di = 0;
    for (i64 c = tid; c < d; c += NT) {
      qs[c] = ldf(q[r.qo + c]);
      gs[c] = ldf(dout[r.qo + c]);
      di += gs[c] * ldf(o[r.qo + c]);
    }
    di = block_sum(di, buf);
    if (tid == 0) delta[row] = (double)di;
    A L = (A)lse[row];
    A acc[MAXU];
#pragma unroll
    for (int u = 0; u < MAXU; ++u) acc[u] = 0;
    for (i64 j0 = 0; j0 < r.n; j0 += NT) {
      i64 cnt = r.n - j0 < NT ? r.n - j0 : NT;
      for (int jj = tid >> 5; jj < NT; jj += NW) {
        A ds = 0;
        if (jj < cnt) {
          A s = warp_dot(qs, r.kb + (j0 + jj) * dm.krs, d);
          A dp = warp_dot(gs, r.vb + (j0 + jj) * dm.krs, d);
          ds = ex_(s * scale - L) * (dp - di);
        }
        if ((tid & 31) == 0) ps[jj] = ds;
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < MAXU; ++u) {
        i64 c = tid + u * NT;
        if (c < d)
          for (i64 jj = 0; jj < cnt; ++jj) acc[u] += ps[jj] * ldf(r.kb[(j0 + jj) * dm.krs + c]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < MAXU; ++u) {
      i64 c = tid + u * NT;
      if (c < d) stf(&dq[r.qo + c], acc[u] * scale);
    }
  }
}

// dk, dv of each key row, summed over the query heads of its group and the queries that see it.
template <typename T>
__device__ void attn_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const typename Acc<T>::t* __restrict__ lse, const T* __restrict__ dout, const double* __restrict__ delta,
                              T* __restrict__ dk, T* __restrict__ dv, AttnDims dm, double scale_d, int causal) {
  typedef typename Acc<T>::t A;
  extern __shared__ double smem_d[];
  A* ks = (A*)smem_d;
  A* vs = ks + dm.d;
  A* ps = vs + dm.d;
  A* dss = ps + NT;
  A scale = (A)scale_d;
  int tid = threadIdx.x;
  i64 group = dm.hq / dm.hkv, d = dm.d;
  for (i64 row = blockIdx.x; row < dm.b * dm.hkv * dm.s; row += gridDim.x) {
    i64 j = row % dm.s, bk = row / dm.s, kh = bk % dm.hkv, b = bk / dm.hkv;
    const i64 ko = attn_k(dm, bk, j);
    __syncthreads();
    for (i64 c = tid; c < d; c += NT) {
      ks[c] = ldf(k[ko + c]);
      vs[c] = ldf(v[ko + c]);
    }
    __syncthreads();
    A gk[MAXU], gv[MAXU];
#pragma unroll
    for (int u = 0; u < MAXU; ++u) gk[u] = gv[u] = 0;
    for (i64 g = 0; g < group; ++g) {
      i64 bh = b * dm.hq + kh * group + g;
      const T* qb = q + attn_q(dm, bh, 0);
      const T* gb = dout + attn_q(dm, bh, 0);
      i64 first = causal ? j : 0;
      for (i64 i0 = first; i0 < dm.t; i0 += NT) {
        i64 cnt = dm.t - i0 < NT ? dm.t - i0 : NT;
        for (int ii = tid >> 5; ii < NT; ii += NW) {
          A p = 0, ds = 0;
          if (ii < cnt) {
            i64 i = i0 + ii;
            A s = warp_dot(ks, qb + i * dm.qrs, d);
            A dp = warp_dot(vs, gb + i * dm.qrs, d);
            p = ex_(s * scale - (A)lse[bh * dm.t + i]);
            ds = p * (dp - (A)delta[bh * dm.t + i]);
          }
          if ((tid & 31) == 0) {
            ps[ii] = p;
            dss[ii] = ds;
          }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < MAXU; ++u) {
          i64 c = tid + u * NT;
          if (c < d)
            for (i64 ii = 0; ii < cnt; ++ii) {
              gv[u] += ps[ii] * ldf(gb[(i0 + ii) * dm.qrs + c]);
              gk[u] += dss[ii] * ldf(qb[(i0 + ii) * dm.qrs + c]);
            }
        }
        __syncthreads();
      }
    }
#pragma unroll
    for (int u = 0; u < MAXU; ++u) {
      i64 c = tid + u * NT;
      if (c < d) {
        stf(&dk[ko + c], gk[u] * scale);
        stf(&dv[ko + c], gv[u]);
      }
    }
  }
}

#define ATTN(T, SUF)                                                                                           \
  extern "C" __global__ void attention_##SUF(const T* q, const T* k, const T* v, T* o, Acc<T>::t* lse, AttnDims dm, \
                                             double scale, int causal) {                                       \
    pdl_enter();                                                                                               \
    attn_fwd<T>(q, k, v, o, lse, dm, scale, causal);                                                           \
  }                                                                                                            \
  extern "C" __global__ void attention_backward_dq_##SUF(const T* q, const T* k, const T* v, const T* o,        \
                                                         const Acc<T>::t* lse, const T* dout, T* dq, double* delta, \
                                                         AttnDims dm, double scale, int causal) {              \
    pdl_enter();                                                                                               \
    attn_bwd_dq<T>(q, k, v, o, lse, dout, dq, delta, dm, scale, causal);                                       \
  }                                                                                                            \
  extern "C" __global__ void attention_backward_dkdv_##SUF(const T* q, const T* k, const T* v, const Acc<T>::t* lse, \
                                                           const T* dout, const double* delta, T* dk, T* dv,    \
                                                           AttnDims dm, double scale, int causal) {            \
    pdl_enter();                                                                                               \
    attn_bwd_dkdv<T>(q, k, v, lse, dout, delta, dk, dv, dm, scale, causal);                                    \
  }
ATTN(float, f32)
ATTN(double, f64)
ATTN(bf16, bf16)
ATTN(f16, f16)
