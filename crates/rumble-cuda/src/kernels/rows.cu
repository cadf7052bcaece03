// Row-wise composite ops: RMSNorm (+ backward), RoPE, softmax / log-softmax (+ backward),
// cross-entropy (+ backward). One block per row; statistics in the arithmetic type (f32, f64
// for f64) with fixed-order block reductions, so results are deterministic.

// RMSNorm: one warp per row (rows of a few thousand at most: no block-wide synchronisation),
// 16-byte loads and stores where the row width and the pointers allow (`vec16`, vec16.cuh),
// statistics reduced by the warp's fixed-order shuffles. Its backward: a block per row group
// (below).
#define WARP_ROWS(row, rows)                                                                            \
  for (i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;                 \
       row += (i64)gridDim.x * (blockDim.x >> 5))

// The two halves of a row's RMSNorm over the elements thread `t` of the `nt` that share the
// row holds (16-byte vectors where `vec`): its part of the sum of squares, then y = x * r * w.
// Unrolled so that a thread's loads are in flight together (one row, a decode step's, is
// otherwise a chain of dependent memory latencies); the sum's order is unchanged by it.
template <typename T>
__device__ __forceinline__ typename Acc<T>::t rms_sumsq(const T* __restrict__ xr, i64 d, i64 t, i64 nt, bool vec) {
  typedef typename Acc<T>::t A;
  constexpr int N = Vec16<T>::n;
  A ss = 0;
  if (vec) {
#pragma unroll 4
    for (i64 c = t * N; c < d; c += nt * N) {
      A a[N];
      ld16(xr + c, a);
#pragma unroll
      for (int i = 0; i < N; ++i) ss += a[i] * a[i];
    }
  } else {
    for (i64 c = t; c < d; c += nt) {
      A v = ldf(xr[c]);
      ss += v * v;
    }
  }
  return ss;
}
template <typename T>
__device__ __forceinline__ void rms_scale(const T* __restrict__ xr, const T* __restrict__ w, T* __restrict__ yr,
                                          typename Acc<T>::t r, i64 d, i64 t, i64 nt, bool vec) {
  typedef typename Acc<T>::t A;
  constexpr int N = Vec16<T>::n;
  if (vec) {
#pragma unroll 4
    for (i64 c = t * N; c < d; c += nt * N) {
      A a[N], g[N];
      ld16(xr + c, a);
      ld16(w + c, g);
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] = a[i] * r * g[i];
      st16(yr + c, a);
    }
  } else {
    for (i64 c = t; c < d; c += nt) stf(&yr[c], ldf(xr[c]) * r * ldf(w[c]));
  }
}

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, i64 rows, i64 d, double eps) {
  typedef typename Acc<T>::t A;
  const int lane = threadIdx.x & 31;
  const bool vec = vec16<T>(d, x, w, y, y);
  WARP_ROWS(row, rows) {
    const A ss = warp_sum(rms_sumsq<T>(x + row * d, d, lane, 32, vec));
    const A r = (A)(1.0 / sqrt((double)ss / (double)d + eps));
    rms_scale<T>(x + row * d, w, y + row * d, r, d, lane, 32, vec);
  }
}

// RMSNorm of a few rows (fewer than the device has multiprocessors: a decode step's): one
// block per row, so a row's loads are spread over the block's warps and in flight together
// instead of queued in one warp; the sum of squares is reduced over the block in a fixed order.
template <typename T>
__device__ void rms_norm_block(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, i64 rows, i64 d,
                               double eps) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  const bool vec = vec16<T>(d, x, w, y, y);
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const A ss = block_sum(rms_sumsq<T>(x + row * d, d, threadIdx.x, blockDim.x, vec), buf);
    const A r = (A)(1.0 / sqrt((double)ss / (double)d + eps));
    rms_scale<T>(x + row * d, w, y + row * d, r, d, threadIdx.x, blockDim.x, vec);
  }
}

// RMSNorm backward in one pass over the rows. Block b of the grid takes rows [b*per, (b+1)*per)
// one after another; thread t holds the K 16-byte chunks c = (t + k*blockDim.x)*N of a row (the
// recipe sizes the block so that K chunks a thread cover the width). Per row it loads x, dy (and
// the addend) once, reduces sum(x^2) and sum(w*dy*x) over the block (fixed order, both behind
// one barrier a row where two block_sum calls would take six: two buffers, alternate rows, so
// one row's reads never race the next row's writes), writes
// dx = r*w*dy - x*r^3/D*sum(w*dy*x) (+ add, with ACC: the addend joins before the one rounding)
// and adds dy*x*r to its columns' dw partials, which go to part[b*d + c] after its last row.
// dx may be written over add (each element read before it is written by the same thread).
// With one chunk a thread and 16-byte loads (the common case), the next row's chunks are loaded
// before this row's reductions, so a block always has a row's loads in flight (one row at a
// time, a block waits a full memory latency per row: H100 probes of that ran at 1 TB/s).
// Rows of up to 1024 chunks take K = 1 (`rms_norm_backward_*`), wider ones K = RMS_BWD_WIDE
// (`rms_norm_backward_wide_*`); at most 1024 threads.
#define RMS_BWD_WIDE 4
template <typename T, bool ACC, int K>
__device__ void rms_norm_bwd(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                             const T* add, T* dx, typename Acc<T>::t* __restrict__ part, i64 rows, i64 d, double eps) {
  typedef typename Acc<T>::t A;
  constexpr int N = Vec16<T>::n;
  __shared__ A buf[2][2][32];
  const bool vec = vec16<T>(d, x, w, dy, dx) && (!ACC || ((unsigned long long)add & 15) == 0);
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  const i64 per = (rows + gridDim.x - 1) / gridDim.x;
  const i64 r0 = (i64)blockIdx.x * per, r1 = r0 + per < rows ? r0 + per : rows;
  // chunk k's first column; the chunk's elements at c + i < d are the thread's.
  i64 col[K];
  A acc[K][N];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    col[k] = ((i64)threadIdx.x + (i64)k * blockDim.x) * N;
#pragma unroll
    for (int i = 0; i < N; ++i) acc[k][i] = 0;
  }
  // Loads chunk k of row p (zeros past the width).
  auto load = [&](const T* p, int k, A* v) {
    const i64 c = col[k];
    if (vec) {
      if (c < d) {
        ld16(p + c, v);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = 0;
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = c + i < d ? ldf(p[c + i]) : (A)0;
    }
  };
  // One row from its chunks of x (a), dy (g) and the addend (s): the reductions, dx, the dw
  // partials.
  auto finish = [&](i64 row, A(&a)[K][N], A(&g)[K][N], A(&s)[K][N], int par) {
    A ss = 0, dot = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      A q[N];
      load(w, k, q);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        ss += a[k][i] * a[k][i];
        dot += q[i] * g[k][i] * a[k][i];
      }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (lane == 0) {
      buf[par][0][wi] = ss;
      buf[par][1][wi] = dot;
    }
    __syncthreads();
    ss = lane < nw ? buf[par][0][lane] : (A)0;
    dot = lane < nw ? buf[par][1][lane] : (A)0;
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const A r = (A)(1.0 / sqrt((double)ss / (double)d + eps));
    const A kk = r * r * r * dot / (A)d;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const i64 c = col[k];
      if (c >= d) continue;
      A q[N], o[N];
      load(w, k, q);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        o[i] = r * q[i] * g[k][i] - a[k][i] * kk;
        if (ACC) o[i] += s[k][i];
        acc[k][i] += g[k][i] * a[k][i] * r;
      }
      if (vec) {
        st16(dx + row * d + c, o);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i)
          if (c + i < d) stf(&dx[row * d + c + i], o[i]);
      }
    }
  };
  int par = 0;
  if (K == 1 && vec) {
    const i64 c = col[0];
    const bool on = c < d;
    // The next row's chunks, as stored.
    Pack16<T> px, pg, ps;
    auto fetch = [&](i64 row) {
      if (on && row < r1) {
        px.u = *reinterpret_cast<const uint4*>(x + row * d + c);
        pg.u = *reinterpret_cast<const uint4*>(dy + row * d + c);
        if (ACC) ps.u = *reinterpret_cast<const uint4*>(add + row * d + c);
      }
    };
    fetch(r0);
    for (i64 row = r0; row < r1; ++row, par ^= 1) {
      A a[K][N], g[K][N], s[K][N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        a[0][i] = on ? ldf(px.e[i]) : (A)0;
        g[0][i] = on ? ldf(pg.e[i]) : (A)0;
        s[0][i] = on && ACC ? ldf(ps.e[i]) : (A)0;
      }
      fetch(row + 1);
      finish(row, a, g, s, par);
    }
  } else {
    for (i64 row = r0; row < r1; ++row, par ^= 1) {
      A a[K][N], g[K][N], s[K][N];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        load(x + row * d, k, a[k]);
        load(dy + row * d, k, g[k]);
        if (ACC) load(add + row * d, k, s[k]);
      }
      finish(row, a, g, s, par);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (col[k] + i < d) part[(i64)blockIdx.x * d + col[k] + i] = acc[k][i];
}

// dw[c] = the sum over the row groups' partials, in a fixed order: a block takes 32 columns,
// lane = column (a warp's reads are 32 neighbouring values), its warps the groups in turn; then
// the first warp sums the warps' totals.
template <typename T>
__device__ void rms_norm_bwd_dw_sum(const typename Acc<T>::t* __restrict__ part, T* __restrict__ dw, i64 groups,
                                    i64 d) {
  typedef typename Acc<T>::t A;
  __shared__ A s[32][33];
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const i64 c = (i64)blockIdx.x * 32 + lane;
  A acc = 0;
  if (c < d) {
#pragma unroll 8
    for (i64 g = wi; g < groups; g += nw) acc += part[g * d + c];
  }
  s[wi][lane] = acc;
  __syncthreads();
  if (wi == 0) {
    A t = 0;
    for (int j = 0; j < nw; ++j) t += s[j][lane];
    if (c < d) stf(&dw[c], t);
  }
}

// Rotate-half RoPE on [B, H, T, D]; angle t * inv_freq_j in f32 (as Hugging Face), sin/cos in f64.
// The inverse frequencies come from the host (RopeFreqs in the prelude), passed by value.
// Two kernels: rope_table computes each (position, frequency) pair's cos and sign * sin once
// into the node's scratch (t_len x half pairs of A), rope applies them to every row: the same
// numbers as computing them per element, with 1 / (B * H) of the trigonometry.

template <typename T>
__device__ void rope_table(typename Acc<T>::t* __restrict__ tab, i64 t_len, i64 d, const RopeFreqs& f, double sign) {
  typedef typename Acc<T>::t A;
  __shared__ float inv[ROPE_MAX_HALF];
  i64 half = d / 2, total = t_len * half;
  stage_rope_freqs(inv, f, half);
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 tt = e / half, j = e % half;
    float t = (float)tt;
    double ang = (double)(t * inv[j]);
    tab[2 * e] = (A)cos(ang);
    tab[2 * e + 1] = (A)(sign * sin(ang));
  }
}

// Rows of d; row r is at position (r / per_pos) % t_len: per_pos = 1 for [B, H, T, D], H for
// [B, T, H, D].
template <typename T>
__device__ void rope(const T* __restrict__ x, T* __restrict__ y, const typename Acc<T>::t* __restrict__ tab, i64 rows,
                     i64 t_len, i64 d, i64 per_pos) {
  typedef typename Acc<T>::t A;
  constexpr int N = Vec16<T>::n;
  i64 half = d / 2, total = rows * half;
  if (vec16<T>(half, x, y, y, y)) {
    // N neighbouring frequencies a thread: 16-byte loads of both halves.
    const i64 hv = half / N;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < rows * hv; q += (i64)gridDim.x * blockDim.x) {
      const i64 row = q / hv, j = (q - row * hv) * N;
      const A* tb = tab + 2 * (((row / per_pos) % t_len) * half + j);
      A a[N], b[N];
      ld16(x + row * d + j, a);
      ld16(x + row * d + j + half, b);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const A c = tb[2 * i], sn = tb[2 * i + 1], ai = a[i];
        a[i] = ai * c - b[i] * sn;
        b[i] = b[i] * c + ai * sn;
      }
      st16(y + row * d + j, a);
      st16(y + row * d + j + half, b);
    }
    return;
  }
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 row = e / half, j = e % half;
    i64 k = ((row / per_pos) % t_len) * half + j;
    A c = tab[2 * k], s = tab[2 * k + 1];
    A a = ldf(x[row * d + j]), b = ldf(x[row * d + j + half]);
    stf(&y[row * d + j], a * c - b * s);
    stf(&y[row * d + j + half], b * c + a * s);
  }
}

template <typename T>
__device__ typename Acc<T>::t row_lse(const T* xr, i64 d, typename Acc<T>::t* buf) {
  typedef typename Acc<T>::t A;
  A m = (A)(-F64_INF);
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) m = fmax_(m, ldf(xr[c]));
  m = block_max(m, buf);
  A s = 0;
  for (i64 c = threadIdx.x; c < d; c += blockDim.x) s += ex_(ldf(xr[c]) - m);
  s = block_sum(s, buf);
  return m + ln_(s);
}

template <typename T>
__device__ void softmax(const T* __restrict__ x, T* __restrict__ y, i64 rows, i64 d, int log_) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * d;
    A lse = row_lse(xr, d, buf);
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
      A v = ldf(xr[c]) - lse;
      stf(&y[row * d + c], log_ ? v : ex_(v));
    }
  }
}

// softmax: dx = y*(dy - sum(dy*y)); log-softmax: dx = dy - exp(y)*sum(dy).
template <typename T>
__device__ void softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, i64 rows, i64 d, int log_) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* yr = y + row * d;
    const T* gr = dy + row * d;
    A s = 0;
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) s += log_ ? ldf(gr[c]) : ldf(gr[c]) * ldf(yr[c]);
    s = block_sum(s, buf);
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
      A g = ldf(gr[c]), v = ldf(yr[c]);
      stf(&dx[row * d + c], log_ ? g - ex_(v) * s : v * (g - s));
    }
  }
}

// Per-row loss (lse - x[target], or 0 when ignored) into loss[row], validity into valid[row].
template <typename T, typename I>
__device__ void ce_rows(const T* __restrict__ x, const I* __restrict__ tg, double* loss, int* valid, i64 rows, i64 v,
                        i64 ignore, int* status, int tag) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    i64 t = (i64)tg[row];
    int ok = t != ignore;
    if (ok && (t < 0 || t >= v)) {
      if (threadIdx.x == 0) report(status, tag, 3, t);
      ok = 0;
    }
    if (!ok) {
      if (threadIdx.x == 0) { loss[row] = 0.0; valid[row] = 0; }
      continue;
    }
    const T* xr = x + row * v;
    A lse = row_lse(xr, v, buf);
    if (threadIdx.x == 0) { loss[row] = (double)lse - (double)ldf(xr[t]); valid[row] = 1; }
  }
}

// One block: mean of the valid rows' losses (0 if none), in f64, fixed order. Writes the count.
template <typename S>
__device__ void ce_mean(const double* loss, const int* valid, S* out, i64 rows) {
  __shared__ double buf[32];
  double s = 0, n = 0;
  for (i64 r = threadIdx.x; r < rows; r += blockDim.x) { s += loss[r]; n += valid[r]; }
  s = block_sum(s, buf);
  n = block_sum(n, buf);
  if (threadIdx.x == 0) {
    *out = (S)(s / (n > 0 ? n : 1.0));
  }
}

// One block: the number of rows whose target is not ignored.
template <typename I>
__device__ void ce_count(const I* tg, int* count, i64 rows, i64 ignore) {
  __shared__ double buf[32];
  double n = 0;
  for (i64 r = threadIdx.x; r < rows; r += blockDim.x) n += ((i64)tg[r] != ignore);
  n = block_sum(n, buf);
  if (threadIdx.x == 0) *count = (int)n;
}

// dx = (softmax(row) - onehot(target)) * dloss / count, 0 for ignored rows.
template <typename T, typename I>
__device__ void ce_bwd(const T* __restrict__ x, const I* __restrict__ tg, const typename Acc<T>::t* dloss, const int* count,
                       T* __restrict__ dx, i64 rows, i64 v, i64 ignore, int* status, int tag) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    i64 t = (i64)tg[row];
    T* dr = dx + row * v;
    if (t == ignore || t < 0 || t >= v) {
      if (t != ignore && threadIdx.x == 0) report(status, tag, 3, t);
      for (i64 c = threadIdx.x; c < v; c += blockDim.x) stf(&dr[c], (A)0);
      continue;
    }
    const T* xr = x + row * v;
    A lse = row_lse(xr, v, buf);
    int n = *count;
    A scale = (A)((double)*dloss / (double)(n > 0 ? n : 1));
    for (i64 c = threadIdx.x; c < v; c += blockDim.x) {
      A p = ex_(ldf(xr[c]) - lse) - (c == t ? (A)1 : (A)0);
      stf(&dr[c], p * scale);
    }
  }
}

// Cross-entropy over long rows (a vocabulary of 10^5) split across blocks: block b of a 1-D
// grid works on row b / splits, columns [s * span, min(v, (s + 1) * span)) with s = b % splits,
// so a chunk of a few hundred rows still fills the GPU. ce_split_stats writes each piece's
// (max, sum of exp(x - max)); ce_split_rows combines them in piece order into the row's
// log-sum-exp (deterministic), which the forward outputs and the backward (ce_split_bwd) reads
// back instead of recomputing it. The logits are read once: each thread
// keeps a running (max, sum) (online log-sum-exp), as float4 where the rows and pieces are
// multiples of 4 wide (`vec4`), and the block combines its threads' pairs in a fixed order.
template <typename T> struct IsF32 { static const bool v = false; };
template <> struct IsF32<float> { static const bool v = true; };

// Adds x to the running pair (m, s = sum of exp(. - m)). A NaN makes s NaN; -inf adds nothing.
template <typename A>
__device__ __forceinline__ void online_lse(A& m, A& s, A x) {
  if (x > m) {
    s = s * ex_(m - x) + (A)1;
    m = x;
  } else if (m != (A)(-F64_INF) || x != x) {
    s += ex_(x - m);
  }
}

template <typename T>
__device__ void ce_split_stats(const T* __restrict__ x, typename Acc<T>::t* __restrict__ stats, i64 rows, i64 v,
                               i64 splits, i64 span) {
  typedef typename Acc<T>::t A;
  __shared__ A buf[32];
  const bool vec4 = IsF32<T>::v && ((v | span) & 3) == 0 && ((unsigned long long)x & 15) == 0;
  for (i64 b = blockIdx.x; b < rows * splits; b += gridDim.x) {
    const i64 row = b / splits, c0 = (b % splits) * span, c1 = c0 + span < v ? c0 + span : v;
    const T* xr = x + row * v;
    A m = (A)(-F64_INF), s = 0;
    if constexpr (IsF32<T>::v) {
      if (vec4) {
        const float4* x4 = reinterpret_cast<const float4*>(xr + c0);
        const i64 n4 = c1 > c0 ? (c1 - c0) >> 2 : 0;
        for (i64 q = threadIdx.x; q < n4; q += blockDim.x) {
          const float4 f = x4[q];
          online_lse(m, s, f.x);
          online_lse(m, s, f.y);
          online_lse(m, s, f.z);
          online_lse(m, s, f.w);
        }
      }
    }
    if (!vec4)
      for (i64 c = c0 + threadIdx.x; c < c1; c += blockDim.x) online_lse(m, s, ldf(xr[c]));
    const A mb = block_max(m, buf);
    // A thread that saw nothing (s = 0) adds nothing; a NaN stays NaN.
    const A sum = block_sum(s == (A)0 ? (A)0 : s * ex_(m - mb), buf);
    if (threadIdx.x == 0) {
      stats[2 * b] = mb;
      stats[2 * b + 1] = sum;
    }
  }
}

template <typename A>
__device__ __forceinline__ A ce_combine(const A* st, i64 splits) {
  A m = (A)(-F64_INF);
  for (i64 s = 0; s < splits; ++s) m = fmax_(m, st[2 * s]);
  A sum = 0;
  for (i64 s = 0; s < splits; ++s)
    if (st[2 * s + 1] != (A)0) sum += st[2 * s + 1] * ex_(st[2 * s] - m);
  return m + ln_(sum);
}

// One thread per row: the row's log-sum-exp to lse (every row, ignored ones included),
// loss = lse - x[target] (f64), valid flag; ignored rows give loss 0.
template <typename T, typename I>
__device__ void ce_split_rows(const T* __restrict__ x, const I* __restrict__ tg, const typename Acc<T>::t* stats,
                              double* loss, int* valid, typename Acc<T>::t* lse, i64 rows, i64 v, i64 splits,
                              i64 ignore, int* status, int tag) {
  typedef typename Acc<T>::t A;
  for (i64 row = (i64)blockIdx.x * blockDim.x + threadIdx.x; row < rows; row += (i64)gridDim.x * blockDim.x) {
    const A l = ce_combine(stats + 2 * row * splits, splits);
    lse[row] = l;
    i64 t = (i64)tg[row];
    int ok = t != ignore;
    if (ok && (t < 0 || t >= v)) {
      report(status, tag, 3, t);
      ok = 0;
    }
    if (!ok) {
      loss[row] = 0.0;
      valid[row] = 0;
      continue;
    }
    loss[row] = (double)l - (double)ldf(x[row * v + t]);
    valid[row] = 1;
  }
}

// dx = (exp(row - lse[row]) - onehot(target)) * dloss / count over this block's piece (lse: the
// forward's log-sum-exp of each row), written in the operand dtype O (the matmuls that follow
// read it); 0 for ignored rows.
template <typename T, typename I, typename O>
__device__ void ce_split_bwd(const T* __restrict__ x, const I* __restrict__ tg, const typename Acc<T>::t* lse_in,
                             const typename Acc<T>::t* dloss, const int* count, O* __restrict__ dx, i64 rows, i64 v,
                             i64 splits, i64 span, i64 ignore, int* status, int tag) {
  typedef typename Acc<T>::t A;
  for (i64 b = blockIdx.x; b < rows * splits; b += gridDim.x) {
    const i64 row = b / splits, c0 = (b % splits) * span, c1 = c0 + span < v ? c0 + span : v;
    const i64 t = (i64)tg[row];
    O* dr = dx + row * v;
    if (t == ignore || t < 0 || t >= v) {
      if (t != ignore && threadIdx.x == 0 && c0 == 0) report(status, tag, 3, t);
      for (i64 c = c0 + threadIdx.x; c < c1; c += blockDim.x) stf(&dr[c], (A)0);
      continue;
    }
    const A lse = lse_in[row];
    const int n = *count;
    const A scale = (A)((double)*dloss / (double)(n > 0 ? n : 1));
    const T* xr = x + row * v;
    if constexpr (IsF32<T>::v) {
      if (((v | span) & 3) == 0 && (((unsigned long long)x | (unsigned long long)dx) & 15) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr + c0);
        const i64 n4 = c1 > c0 ? (c1 - c0) >> 2 : 0;
        for (i64 q = threadIdx.x; q < n4; q += blockDim.x) {
          const float4 f = x4[q];
          const i64 c = c0 + 4 * q;
          st4(&dr[c], (ex_(f.x - lse) - (c == t ? 1.0f : 0.0f)) * scale,
              (ex_(f.y - lse) - (c + 1 == t ? 1.0f : 0.0f)) * scale,
              (ex_(f.z - lse) - (c + 2 == t ? 1.0f : 0.0f)) * scale,
              (ex_(f.w - lse) - (c + 3 == t ? 1.0f : 0.0f)) * scale);
        }
        continue;
      }
    }
    for (i64 c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
      A p = ex_(ldf(xr[c]) - lse) - (c == t ? (A)1 : (A)0);
      stf(&dr[c], p * scale);
    }
  }
}

#define CE_SPLIT_BWD(T, SUF, O, OSUF, I, ISUF)                                                                    \
  extern "C" __global__ void ce_split_backward_##SUF##_##OSUF##_##ISUF(                                           \
      const T* x, const I* tg, const Acc<T>::t* lse, const Acc<T>::t* dloss, const int* count, O* dx, i64 rows,   \
      i64 v, i64 splits, i64 span, i64 ignore, int* status, int tag) {                                            \
    pdl_enter();                                                                                                  \
    ce_split_bwd<T, I, O>(x, tg, lse, dloss, count, dx, rows, v, splits, span, ignore, status, tag);              \
  }
#define CE_SPLIT(T, SUF, I, ISUF)                                                                                 \
  extern "C" __global__ void ce_split_rows_##SUF##_##ISUF(const T* x, const I* tg, const Acc<T>::t* stats,        \
                                                          double* loss, int* valid, Acc<T>::t* lse, i64 rows,     \
                                                          i64 v, i64 splits, i64 ignore, int* status, int tag) {  \
    pdl_enter();                                                                                                  \
    ce_split_rows<T, I>(x, tg, stats, loss, valid, lse, rows, v, splits, ignore, status, tag);                    \
  }
extern "C" __global__ void ce_split_stats_f32(const float* x, float* stats, i64 rows, i64 v, i64 splits, i64 span) {
  pdl_enter();
  ce_split_stats<float>(x, stats, rows, v, splits, span);
}
extern "C" __global__ void ce_split_stats_f64(const double* x, double* stats, i64 rows, i64 v, i64 splits, i64 span) {
  pdl_enter();
  ce_split_stats<double>(x, stats, rows, v, splits, span);
}
CE_SPLIT(float, f32, int, i32)
CE_SPLIT(float, f32, i64, i64)
CE_SPLIT(double, f64, int, i32)
CE_SPLIT(double, f64, i64, i64)
CE_SPLIT_BWD(float, f32, float, f32, int, i32)
CE_SPLIT_BWD(float, f32, float, f32, i64, i64)
CE_SPLIT_BWD(float, f32, bf16, bf16, int, i32)
CE_SPLIT_BWD(float, f32, bf16, bf16, i64, i64)
CE_SPLIT_BWD(float, f32, f16, f16, int, i32)
CE_SPLIT_BWD(float, f32, f16, f16, i64, i64)
CE_SPLIT_BWD(double, f64, double, f64, int, i32)
CE_SPLIT_BWD(double, f64, double, f64, i64, i64)

#define ROWS(T, SUF)                                                                                            \
  extern "C" __global__ void rms_norm_##SUF(const T* x, const T* w, T* y, i64 rows, i64 d, double eps) {       \
    pdl_enter();                                                                                               \
    rms_norm<T>(x, w, y, rows, d, eps);                                                                         \
  }                                                                                                             \
  extern "C" __global__ void rms_norm_block_##SUF(const T* x, const T* w, T* y, i64 rows, i64 d, double eps) { \
    pdl_enter();                                                                                               \
    rms_norm_block<T>(x, w, y, rows, d, eps);                                                                   \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                                            \
      rms_norm_backward_##SUF(const T* x, const T* w, const T* dy, T* dx,                                       \
          Acc<T>::t* part, i64 rows, i64 d, double eps) {                                                       \
    pdl_enter();                                                                                                \
    rms_norm_bwd<T, false, 1>(x, w, dy, nullptr, dx, part, rows, d, eps);                                       \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                                            \
      rms_norm_backward_acc_##SUF(const T* x, const T* w, const T* dy, const T* add, T* dx,                     \
          Acc<T>::t* part, i64 rows, i64 d, double eps) {                                                       \
    pdl_enter();                                                                                                \
    rms_norm_bwd<T, true, 1>(x, w, dy, add, dx, part, rows, d, eps);                                            \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                                            \
      rms_norm_backward_wide_##SUF(const T* x, const T* w, const T* dy, T* dx,                                  \
          Acc<T>::t* part, i64 rows, i64 d, double eps) {                                                       \
    pdl_enter();                                                                                                \
    rms_norm_bwd<T, false, RMS_BWD_WIDE>(x, w, dy, nullptr, dx, part, rows, d, eps);                            \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(1024)                                                            \
      rms_norm_backward_wide_acc_##SUF(const T* x, const T* w, const T* dy, const T* add, T* dx,                \
          Acc<T>::t* part, i64 rows, i64 d, double eps) {                                                       \
    pdl_enter();                                                                                                \
    rms_norm_bwd<T, true, RMS_BWD_WIDE>(x, w, dy, add, dx, part, rows, d, eps);                                 \
  }                                                                                                             \
  extern "C" __global__ void rms_norm_backward_dw_sum_##SUF(const Acc<T>::t* part, T* dw, i64 groups, i64 d) {  \
    pdl_enter();                                                                                                \
    rms_norm_bwd_dw_sum<T>(part, dw, groups, d);                                                                \
  }                                                                                                             \
  extern "C" __global__ void rope_table_##SUF(typename Acc<T>::t* tab, i64 t_len, i64 d, RopeFreqs f, double sign) {  \
    pdl_enter();                                                                                                      \
    rope_table<T>(tab, t_len, d, f, sign);                                                                          \
  }                                                                                                                 \
  extern "C" __global__ void rope_##SUF(const T* x, T* y, const typename Acc<T>::t* tab, i64 rows, i64 t_len, i64 d, \
                                        i64 per_pos) {                                                          \
    pdl_enter();                                                                                                \
    rope<T>(x, y, tab, rows, t_len, d, per_pos);                                                                    \
  }                                                                                                             \
  extern "C" __global__ void softmax_##SUF(const T* x, T* y, i64 rows, i64 d, int log_) {                      \
    pdl_enter();                                                                                               \
    softmax<T>(x, y, rows, d, log_);                                                                            \
  }                                                                                                             \
  extern "C" __global__ void softmax_backward_##SUF(const T* y, const T* dy, T* dx, i64 rows, i64 d, int log_) { \
    pdl_enter();                                                                                                 \
    softmax_bwd<T>(y, dy, dx, rows, d, log_);                                                                   \
  }                                                                                                             \
  CE(T, SUF, int, i32)                                                                                          \
  CE(T, SUF, i64, i64)

#define CE(T, SUF, I, ISUF)                                                                                      \
  extern "C" __global__ void cross_entropy_rows_##SUF##_##ISUF(const T* x, const I* tg, double* loss, int* valid, \
                                                               i64 rows, i64 v, i64 ignore, int* status, int tag) { \
    pdl_enter();                                                                                                    \
    ce_rows<T, I>(x, tg, loss, valid, rows, v, ignore, status, tag);                                             \
  }                                                                                                              \
  extern "C" __global__ void cross_entropy_backward_##SUF##_##ISUF(const T* x, const I* tg, const Acc<T>::t* dloss,    \
                                                                   const int* count, T* dx, i64 rows, i64 v,     \
                                                                   i64 ignore, int* status, int tag) {           \
    pdl_enter();                                                                                                 \
    ce_bwd<T, I>(x, tg, dloss, count, dx, rows, v, ignore, status, tag);                                         \
  }

ROWS(float, f32)
ROWS(double, f64)
ROWS(bf16, bf16)
ROWS(f16, f16)

extern "C" __global__ void cross_entropy_mean_f32(const double* loss, const int* valid, float* out, i64 rows) {
  pdl_enter();
  ce_mean<float>(loss, valid, out, rows);
}
extern "C" __global__ void cross_entropy_mean_f64(const double* loss, const int* valid, double* out, i64 rows) {
  pdl_enter();
  ce_mean<double>(loss, valid, out, rows);
}
extern "C" __global__ void cross_entropy_count_i32(const int* tg, int* count, i64 rows, i64 ignore) {
  pdl_enter();
  ce_count<int>(tg, count, rows, ignore);
}
extern "C" __global__ void cross_entropy_count_i64(const i64* tg, int* count, i64 rows, i64 ignore) {
  pdl_enter();
  ce_count<i64>(tg, count, rows, ignore);
}

// Swiglu of rows [gate | up] (width 2f), as one projection to 2f gives them: y = silu(g) * u,
// and its gradient back into [dgate | dup]. One thread per (row, column < f), or per N
// neighbouring columns with 16-byte loads and stores where the rows allow (32-bit index
// arithmetic where the count fits). The arithmetic in the accumulator type, rounded once
// (sigmoid_ in vec16.cuh: gemv.cu's swiglu prologue computes the same).

template <typename T, typename I>
__device__ __forceinline__ void swiglu_packed_vec(const T* __restrict__ x, T* __restrict__ y, I rows, I f) {
  typedef typename Acc<T>::t A;
  constexpr int N = Vec16<T>::n;
  const I fv = f / N, n = rows * fv;
  for (I q = (I)blockIdx.x * blockDim.x + threadIdx.x; q < n; q += (I)gridDim.x * blockDim.x) {
    const I r = q / fv, c = (q - r * fv) * N;
    A g[N], u[N];
    ld16(x + r * 2 * f + c, g);
    ld16(x + r * 2 * f + f + c, u);
#pragma unroll
    for (int i = 0; i < N; ++i) g[i] = (g[i] * sigmoid_<T>(g[i])) * u[i];
    st16(y + r * f + c, g);
  }
}

template <typename T>
__device__ void swiglu_packed(const T* __restrict__ x, T* __restrict__ y, i64 rows, i64 f) {
  typedef typename Acc<T>::t A;
  if (vec16<T>(f, x, y, y, y)) {
    if (rows * f < (1LL << 31)) {
      swiglu_packed_vec<T, unsigned>(x, y, (unsigned)rows, (unsigned)f);
    } else {
      swiglu_packed_vec<T, i64>(x, y, rows, f);
    }
    return;
  }
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < rows * f; e += (i64)gridDim.x * blockDim.x) {
    i64 r = e / f, c = e % f;
    A g = ldf(x[r * 2 * f + c]), u = ldf(x[r * 2 * f + f + c]);
    stf(&y[e], (g * sigmoid_<T>(g)) * u);
  }
}

template <typename T, typename I>
__device__ __forceinline__ void swiglu_packed_bwd_vec(const T* __restrict__ x, const T* __restrict__ dy,
                                                      T* __restrict__ dx, I rows, I f) {
  typedef typename Acc<T>::t A;
  const A one = 1;
  constexpr int N = Vec16<T>::n;
  const I fv = f / N, n = rows * fv;
  for (I q = (I)blockIdx.x * blockDim.x + threadIdx.x; q < n; q += (I)gridDim.x * blockDim.x) {
    const I r = q / fv, c = (q - r * fv) * N;
    A g[N], u[N], d[N];
    ld16(x + r * 2 * f + c, g);
    ld16(x + r * 2 * f + f + c, u);
    ld16(dy + r * f + c, d);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      A s = sigmoid_<T>(g[i]);
      A t = g[i] * (s * (A)-1 + one) + one;
      A du = (d[i] * g[i]) * s;
      g[i] = ((d[i] * u[i]) * s) * t;
      u[i] = du;
    }
    st16(dx + r * 2 * f + c, g);
    st16(dx + r * 2 * f + f + c, u);
  }
}

template <typename T>
__device__ void swiglu_packed_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, i64 rows,
                                  i64 f) {
  typedef typename Acc<T>::t A;
  const A one = 1;
  if (vec16<T>(f, x, dy, dx, dx)) {
    if (rows * f < (1LL << 31)) {
      swiglu_packed_bwd_vec<T, unsigned>(x, dy, dx, (unsigned)rows, (unsigned)f);
    } else {
      swiglu_packed_bwd_vec<T, i64>(x, dy, dx, rows, f);
    }
    return;
  }
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < rows * f; e += (i64)gridDim.x * blockDim.x) {
    i64 r = e / f, c = e % f;
    A g = ldf(x[r * 2 * f + c]), u = ldf(x[r * 2 * f + f + c]), d = ldf(dy[e]);
    A s = sigmoid_<T>(g);
    A t = g * (s * (A)-1 + one) + one;
    stf(&dx[r * 2 * f + c], ((d * u) * s) * t);
    stf(&dx[r * 2 * f + f + c], (d * g) * s);
  }
}
#define GLU(T, SUF)                                                                                             \
  extern "C" __global__ void swiglu_packed_##SUF(const T* x, T* y, i64 rows, i64 f) {                          \
    pdl_enter();                                                                                               \
    swiglu_packed<T>(x, y, rows, f);                                                                            \
  }                                                                                                             \
  extern "C" __global__ void swiglu_packed_backward_##SUF(const T* x, const T* dy, T* dx, i64 rows, i64 f) {   \
    pdl_enter();                                                                                               \
    swiglu_packed_bwd<T>(x, dy, dx, rows, f);                                                                   \
  }
GLU(float, f32)
GLU(double, f64)
GLU(bf16, bf16)
GLU(f16, f16)
