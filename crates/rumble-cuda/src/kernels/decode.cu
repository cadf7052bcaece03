// The decoding ops (specs in rumble_core's ir/op.rs, CPU reference in cpu/decode.rs):
// rope_at, cache_write (and cache_write_kv), attention_cached and sample. Positions and sampling
// keys are i64.

// rope_at's rotation of one pair (u, v) = (x[j], x[j + d/2]) of a row at position p: the angle
// p * inv[j] in float, its cosine and sine in double rounded to A. The one formula of the three
// kernels that rotate (rope_at, cache_write_rope, attention_cached's queries), so that a
// rotation folded into a reader (`fold_rope_at`) gives rope_at's bits.
template <typename A>
__device__ __forceinline__ void rope_pair(float p, float inv_j, A u, A v, A& y0, A& y1) {
  const double ang = (double)(p * inv_j);
  const A c = (A)cos(ang), s = (A)sin(ang);
  y0 = u * c - v * s;
  y1 = v * c + u * s;
}

// RoPE at per-sequence positions: rows of d, row r = ((b * n1 + i1) * n2 + i2) with the position
// index t = i1 (layout bthd: n1 = T, n2 = H) or i2 (bhtd: n1 = H, n2 = T); position pos[b] + t.
// The inverse frequencies are rope's (RopeFreqs in the prelude, rescaled on the host as the
// op's `scaling` says), so position p gets the angles of rope's row p.
template <typename T>
__device__ void rope_at(const T* __restrict__ x, const i64* __restrict__ pos, T* __restrict__ y, i64 rows, i64 n1,
                        i64 n2, int seq_first, i64 d, const RopeFreqs& f) {
  __shared__ float inv[ROPE_MAX_HALF];
  i64 half = d / 2, total = rows * half;
  stage_rope_freqs(inv, f, half);
  typedef typename Acc<T>::t A;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 row = e / half, j = e % half;
    i64 i2 = row % n2, i1 = (row / n2) % n1, b = row / (n1 * n2);
    A y0, y1;
    const float p = (float)(pos[b] + (seq_first ? i1 : i2));
    rope_pair(p, inv[j], ldf(x[row * d + j]), ldf(x[row * d + j + half]), y0, y1);
    stf(&y[row * d + j], y0);
    stf(&y[row * d + j + half], y1);
  }
}

// Index e of [n2, n1, n0] as (i2, i1, i0), in 32 bits where `total` (the index space) fits: a
// 64-bit division is a long software routine, and the decode kernels do little else.
__device__ __forceinline__ void split3(i64 e, i64 total, i64 n1, i64 n0, i64& i2, i64& i1, i64& i0) {
  if (total <= 0x7fffffffLL) {
    const unsigned u = (unsigned)e, a = (unsigned)n0, m = (unsigned)n1, q = u / a;
    i0 = u - q * a;
    i1 = q % m;
    i2 = q / m;
  } else {
    const i64 q = e / n0;
    i0 = e - q * n0;
    i1 = q % n1;
    i2 = q / n1;
  }
}

// cache [B, S, R] (R = H * D elements a position) gets rows pos[b] .. pos[b] + t_len of new
// [B, T, R]. A row outside the cache is skipped and reported (code 1, the position).
template <typename T>
__device__ void cache_write(T* __restrict__ cache, const T* __restrict__ nw, const i64* __restrict__ pos, i64 b_len,
                            i64 s, i64 t_len, i64 r, int* status, int tag) {
  i64 total = b_len * t_len * r;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 b, t, c;
    split3(e, total, t_len, r, b, t, c);
    i64 p = pos[b] + t;
    if (p < 0 || p >= s) {
      if (c == 0) report(status, tag, 1, p);
      continue;
    }
    cache[(b * s + p) * r + c] = nw[e];
  }
}

// cache_write with its new rows rotated first (Op::CacheWrite's `rope`): rope_at's rotation
// (layout bthd, position pos[b] + t; rope_pair) rounded to T, then written; one thread takes
// frequency j of a head, reading and writing its two elements j and j + d/2.
template <typename T>
__device__ void cache_write_rope(T* __restrict__ cache, const T* __restrict__ nw, const i64* __restrict__ pos,
                                 i64 b_len, i64 s, i64 t_len, i64 r, i64 d, const RopeFreqs& f, int* status,
                                 int tag) {
  __shared__ float inv[ROPE_MAX_HALF];
  const i64 half = d / 2, pairs = r / 2;  // r = H * d elements a row
  stage_rope_freqs(inv, f, half);
  typedef typename Acc<T>::t A;
  const i64 total = b_len * t_len * pairs;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 b, t, q;
    split3(e, total, t_len, pairs, b, t, q);
    const int hf = (int)half, h = (int)q / hf, j = (int)q - h * hf;  // q < pairs: 32 bits
    const i64 p = pos[b] + t;
    if (p < 0 || p >= s) {
      if (q == 0) report(status, tag, 1, p);
      continue;
    }
    const T* x = nw + (b * t_len + t) * r + h * d;
    T* y = cache + (b * s + p) * r + h * d;
    A y0, y1;
    rope_pair((float)p, inv[j], ldf(x[j]), ldf(x[j + half]), y0, y1);
    stf(&y[j], y0);
    stf(&y[j + half], y1);
  }
}

// A layer's keys and values written in one launch (Op::CacheWriteKv): new rows kn and vn
// [B, T, R] into caches kc and vc [B, S, R] at rows pos[b] + t. With `rope` a thread takes
// frequency j of a head: the keys' elements j and j + d/2 rotated as cache_write_rope rotates
// them, the values' same two elements copied; without, one element of each. Rows outside the
// cache are skipped and reported as cache_write does.
template <typename T>
__device__ void cache_write_kv(T* __restrict__ kc, T* __restrict__ vc, const T* __restrict__ kn,
                               const T* __restrict__ vn, const i64* __restrict__ pos, i64 b_len, i64 s, i64 t_len,
                               i64 r, i64 d, const RopeFreqs& f, int rope, int* status, int tag) {
  __shared__ float inv[ROPE_MAX_HALF];
  const i64 half = d / 2, units = rope ? r / 2 : r;  // r = H * d elements a row
  if (rope) stage_rope_freqs(inv, f, half);
  typedef typename Acc<T>::t A;
  const i64 total = b_len * t_len * units;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
    i64 b, t, q;
    split3(e, total, t_len, units, b, t, q);
    const i64 p = pos[b] + t;
    if (p < 0 || p >= s) {
      if (q == 0) report(status, tag, 1, p);
      continue;
    }
    const T* k = kn + (b * t_len + t) * r;
    const T* v = vn + (b * t_len + t) * r;
    T* kd = kc + (b * s + p) * r;
    T* vd = vc + (b * s + p) * r;
    if (rope) {
      const int hf = (int)half, h = (int)q / hf, j = (int)q - h * hf;  // q < units: 32 bits
      const i64 at = (i64)h * d + j;
      A y0, y1;
      rope_pair((float)p, inv[j], ldf(k[at]), ldf(k[at + half]), y0, y1);
      stf(&kd[at], y0);
      stf(&kd[at + half], y1);
      vd[at] = v[at];
      vd[at + half] = v[at + half];
    } else {
      kd[q] = k[q];
      vd[q] = v[q];
    }
  }
}

// Flash-decoding. Block (group, split), group = (b, run of `gt` query rows, kv head, chunk of
// `gh` of its query heads): the block's slots (row, head) share every K and V row it reads
// (several rows: a prefill chunk's). Slot (row t, head h) sees keys [0, pos[b] + t]; the block
// reads up to its last row's. Split `sp` takes the visible keys [sp * chunk, (sp + 1) * chunk),
// a tile of tk keys at a time (as many as AC_KVB bytes hold of K and V rows together, at most
// AC_TK). A decode step is latency-bound, so the kernel keeps its round trips to memory few:
// - the tile's K and V rows are copied into shared memory as stored, every thread's 16-byte
//   loads of both issued before any is used (ac_load, then ac_store): the first tile's before
//   the queries are read and rotated, each next tile's before the tile ahead of it is computed;
// - a warp per key computes the scores of all the block's slots (ac_scores), a warp per slot
//   the online softmax in f32, then a thread per (slot, column) accumulates p.v;
// - with one split the output is written normalised. Otherwise each (row, split) leaves (max,
//   sum) in `ml` and the unnormalised p.v in `part`, and the group's last block to finish
//   combines them (counting in `counters`; without counters, attention_cached_combine does, a
//   launch of its own): both through ac_combine, which reads every split's (max, sum) in one
//   round trip, weighs the splits once a row, then sums the partials. A split past a slot's
//   visible keys leaves (-inf, 0) and zeros.
// d <= 256, gt * gh * d <= AC_Q, gt * gh <= AC_H, splits <= AC_MAX_SPLITS (decode.rs's
// MAX_SPLITS), blockDim.x = 256.
#define AC_Q 2048
#define AC_H 16
#define AC_TK 64
#define AC_KVB 16384
#define AC_MAX_SPLITS 64
#define AC_THREADS 256
// 16-byte chunks of one tile's K (or V) rows a thread copies at most: AC_KVB / 2 bytes over
// AC_THREADS threads.
#define AC_PER (AC_KVB / 2 / 16 / AC_THREADS)
// A tile of cache rows [j0, j0 + n) of one head (rows `stride` apart from kb and vb; d elements
// each) into ks and vs ([n][d], as stored): with `vec`, every thread's 16-byte loads of K and V
// are issued before the first is stored (ac_load, then ac_store); otherwise element by element.
template <typename T>
struct AcTile {
  uint4 k[AC_PER], v[AC_PER];
};
template <typename T>
__device__ __forceinline__ void ac_load(AcTile<T>& r, const T* kb, const T* vb, i64 j0, int n, int d, i64 stride) {
  constexpr int V = Vec16<T>::n;
  const int per = d / V, total = n * per;  // 16-byte chunks a row, a tile
#pragma unroll
  for (int u = 0; u < AC_PER; ++u) {
    const int e = threadIdx.x + u * AC_THREADS;
    if (e < total) {
      const int jj = e / per, c = (e - jj * per) * V;
      r.k[u] = *reinterpret_cast<const uint4*>(kb + (j0 + jj) * stride + c);
      r.v[u] = *reinterpret_cast<const uint4*>(vb + (j0 + jj) * stride + c);
    }
  }
}
template <typename T>
__device__ __forceinline__ void ac_store(const AcTile<T>& r, T* ks, T* vs, int n, int d) {
  constexpr int V = Vec16<T>::n;
  const int total = n * (d / V);
#pragma unroll
  for (int u = 0; u < AC_PER; ++u) {
    const int e = threadIdx.x + u * AC_THREADS;
    if (e < total) {
      *reinterpret_cast<uint4*>(ks + e * V) = r.k[u];
      *reinterpret_cast<uint4*>(vs + e * V) = r.v[u];
    }
  }
}
template <typename T>
__device__ __forceinline__ void ac_stage_scalar(T* ks, T* vs, const T* kb, const T* vb, i64 j0, int n, int d,
                                                i64 stride) {
  for (int e = threadIdx.x; e < n * d; e += blockDim.x) {
    const int jj = e / d, c = e - jj * d;
    ks[e] = kb[(j0 + jj) * stride + c];
    vs[e] = vb[(j0 + jj) * stride + c];
  }
}
// The scores of a tile's keys (K rows in `ks`) for the block's ns <= NS slots: a warp per key,
// lanes over d; the NS slots' dot products first, then their warp sums interleaved (the
// shuffle chains of different slots overlap). Masked keys (past a slot's row) get -inf.
template <int NS, typename T>
__device__ __forceinline__ void ac_scores(float* sc, const float* qs, const T* ks, int tn, int di, int ns, i64 j0,
                                          i64 p0, const int* srow, float fs, int warp, int nw, int lane) {
  for (int jj = warp; jj < tn; jj += nw) {
    const T* kr = ks + jj * di;
    float dot[NS];
#pragma unroll
    for (int hh = 0; hh < NS; ++hh) dot[hh] = 0.0f;
    for (int e = lane; e < di; e += 32) {
      const float x = ldf(kr[e]);
#pragma unroll
      for (int hh = 0; hh < NS; ++hh)
        if (hh < ns) dot[hh] += qs[hh * di + e] * x;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int hh = 0; hh < NS; ++hh) dot[hh] += __shfl_xor_sync(0xffffffffu, dot[hh], o);
    if (lane == 0)
#pragma unroll
      for (int hh = 0; hh < NS; ++hh)
        if (hh < ns) sc[hh * AC_TK + jj] = j0 + jj <= p0 + srow[hh] ? fs * dot[hh] : -F32_INF;
  }
}
// Output rows rows[0..nrows) (d columns each) from the splits' partials, by the whole block:
// every split's (max, sum) of every row read at once (through L2: written by other blocks of
// the launch, or of the one before), a thread per row weighing its splits by their softmax
// rescaling exp(max_i - max), then a thread per (row, column) summing the weighted partials in
// split order over their weighted sum; a row that saw no key is zero. `buf`: shared memory of
// nrows * (3 * splits + 1) floats.
template <typename T>
__device__ __forceinline__ void ac_combine(const float* part, const float* ml, T* __restrict__ o, const i64* rows,
                                           int nrows, int d, int splits, float* buf) {
  float* mls = buf;                       // [nrows][splits][2]
  float* w = buf + nrows * splits * 2;    // [nrows][splits]
  float* ls = w + nrows * splits;         // [nrows]
  for (int e = threadIdx.x; e < nrows * splits * 2; e += blockDim.x) {
    const int sl = e / (2 * splits);
    mls[e] = __ldcg(ml + rows[sl] * splits * 2 + (e - sl * 2 * splits));
  }
  __syncthreads();
  for (int sl = threadIdx.x; sl < nrows; sl += blockDim.x) {
    const float* m = mls + sl * splits * 2;
    float mx = -F32_INF;
    for (int i = 0; i < splits; ++i) mx = fmaxf(mx, m[2 * i]);
    float l = 0.0f;
    for (int i = 0; i < splits; ++i) {
      const float wi = mx == -F32_INF ? 0.0f : expf(m[2 * i] - mx);
      w[sl * splits + i] = wi;
      l += m[2 * i + 1] * wi;
    }
    ls[sl] = l;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < nrows * d; e += blockDim.x) {
    const int sl = e / d, c = e - sl * d;
    const float l = ls[sl];
    float a = 0.0f;
    if (l > 0.0f) {
      const float* p = part + rows[sl] * splits * d + c;
      const float* ws = w + sl * splits;
#pragma unroll 8
      for (int i = 0; i < splits; ++i) a += __ldcg(p + (i64)i * d) * ws[i];
    }
    stf(&o[rows[sl] * d + c], (typename Acc<T>::t)(l > 0.0f ? a / l : 0.0f));
  }
}
// NS: the most slots (gt * gh) a block of this instance takes (4, 8 or AC_H): the scores'
// dot products and each thread's p.v sums are registers, as many as NS asks, so a block of few
// slots (a decode step's group of query heads) keeps few registers and more blocks fit a
// multiprocessor.
template <int NS, typename T>
__device__ void attention_cached(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 const i64* __restrict__ pos, T* __restrict__ o, float* __restrict__ part,
                                 float* __restrict__ ml, i64 t_len, i64 hq, i64 s, i64 hkv, i64 d, i64 gh,
                                 i64 gt, i64 splits, i64 chunk, double scale, const RopeFreqs& f, int rope,
                                 int* __restrict__ counters) {
  __shared__ float qs[AC_Q];
  __shared__ float inv[ROPE_MAX_HALF];  // with `rope`: the rotation's frequencies
  __shared__ float sc[AC_H * AC_TK];
  __shared__ float mh[AC_H], lh[AC_H], ch[AC_H];
  __shared__ int srow[AC_H];  // slot sl's row within the block: sl / nh
  __shared__ i64 rws[AC_H];   // slot sl's output row
  // The tile's K rows, then its V rows, as stored; the combine's buffer after the last tile.
  __shared__ __align__(16) unsigned char kvb[AC_KVB];
  // The block's place in 32 bits (the grid, the heads and the rows of a step all fit): a 64-bit
  // division is a long software routine, and a decode step's block does little else.
  const int spl = (int)splits, bid = (int)blockIdx.x;
  const int sp = bid % spl, grp = bid / spl;
  const int g = (int)(hq / hkv), ghi = (int)gh, gti = (int)gt, hkvi = (int)hkv;
  const int hchunks = (g + ghi - 1) / ghi, tchunks = (int)((t_len + gt - 1) / gt);
  const int hc = grp % hchunks, kvh = (grp / hchunks) % hkvi, tc = (grp / (hchunks * hkvi)) % tchunks;
  const i64 b = grp / (hchunks * hkvi * tchunks);
  const int h0 = kvh * g + hc * ghi, nh = g - hc * ghi < ghi ? g - hc * ghi : ghi;
  const i64 t0 = (i64)tc * gti, nt = t_len - t0 < gti ? t_len - t0 : gti, ns = nt * nh;  // rows, slots
  // Keys the block reads (its last row's), and slot sl's own: row t0 + sl / nh, head sl % nh.
  const i64 p0 = pos[b] + t0;  // the position of the block's first row
  i64 n = p0 + nt;
  if (n > s) n = s;
  if (n < 0) n = 0;
  i64 lo = sp * chunk, hi = lo + chunk < n ? lo + chunk : n;
#define AC_ROW(sl) ((b * t_len + t0 + (int)(sl) / nh) * hq + h0 + (int)(sl) % nh)
  // In 32 bits inside the block (ns * d <= AC_Q): no 64-bit divisions in the loops.
  const int di = (int)d, nsd = (int)(ns * d), nsi = (int)ns;
  const int fit = AC_KVB / (2 * di * (int)sizeof(T));
  const int tk = fit < AC_TK ? fit : AC_TK;  // keys a tile
  T* ks = reinterpret_cast<T*>(kvb);
  T* vs = ks + tk * di;
  const i64 kstride = hkv * d;
  const T* kb = k + (b * s * hkv + kvh) * d;
  const T* vb = v + (b * s * hkv + kvh) * d;
  // 16-byte rows: d a multiple of the vector, the row stride and the head's first row aligned.
  constexpr int VW = Vec16<T>::n;
  const bool vec = di % VW == 0 && (kstride * (i64)sizeof(T)) % 16 == 0 && ((unsigned long long)kb & 15) == 0 &&
                   ((unsigned long long)vb & 15) == 0;
  // The first tile's loads go out before the queries are read.
  AcTile<T> tile;
  int tn = hi - lo < tk ? (int)(hi - lo) : tk;
  if (tn < 0) tn = 0;
  if (vec) ac_load(tile, kb, vb, lo, tn, di, kstride);
  if (rope) stage_rope_freqs(inv, f, di / 2);  // `rope` is the same for every thread
  if (!rope) {
    for (int e = threadIdx.x; e < nsd; e += blockDim.x) {
      const int sl = e / di;
      qs[e] = ld(q[AC_ROW(sl) * d + (e - sl * di)]);
    }
  } else {
    // Op::AttentionCached's `rope`: rope_at's rotation at the slot's position (rope_pair),
    // rounded to T as rope_at's result would be; a thread a pair (j, j + d/2).
    const int half = di / 2;
    for (int e = threadIdx.x; e < nsi * half; e += blockDim.x) {
      const int sl = e / half, j = e - sl * half;
      const T* qr = q + AC_ROW(sl) * d;
      float y0, y1;
      rope_pair((float)(p0 + sl / nh), inv[j], ld(qr[j]), ld(qr[j + half]), y0, y1);
      T r0, r1;
      st(&r0, y0);
      st(&r1, y1);
      qs[sl * di + j] = ld(r0);
      qs[sl * di + j + half] = ld(r1);
    }
  }
  if (threadIdx.x < ns) {
    mh[threadIdx.x] = -F32_INF;
    lh[threadIdx.x] = 0.0f;
    srow[threadIdx.x] = (int)threadIdx.x / (int)nh;
    rws[threadIdx.x] = AC_ROW((i64)threadIdx.x);
  }
  if (vec)
    ac_store(tile, ks, vs, tn, di);
  else
    ac_stage_scalar(ks, vs, kb, vb, lo, tn, di, kstride);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  // Each thread's (slot, column) sums: ns * d <= NS * 256, and <= AC_Q, over AC_THREADS.
  constexpr int R = NS * 256 / AC_THREADS < AC_Q / AC_THREADS ? NS * 256 / AC_THREADS : AC_Q / AC_THREADS;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const float fs = (float)scale;
  for (i64 j0 = lo; j0 < hi; j0 += tk) {
    tn = hi - j0 < tk ? (int)(hi - j0) : tk;
    if (j0 != lo) {  // the first tile is in place; the others' loads went out a tile ahead
      if (vec)
        ac_store(tile, ks, vs, tn, di);
      else
        ac_stage_scalar(ks, vs, kb, vb, j0, tn, di, kstride);
      __syncthreads();
    }
    // The next tile's loads go out now and land while this one is computed (the loop's last
    // barrier keeps its store behind every read of this one).
    if (vec && j0 + tk < hi) ac_load(tile, kb, vb, j0 + tk, hi - j0 - tk < tk ? (int)(hi - j0 - tk) : tk, di, kstride);
    ac_scores<NS>(sc, qs, ks, tn, di, nsi, j0, p0, srow, fs, warp, nw, lane);
    __syncthreads();
    for (int hh = warp; hh < nsi; hh += nw) {
      float mt = -F32_INF;
      for (int jj = lane; jj < tn; jj += 32) mt = fmaxf(mt, sc[hh * AC_TK + jj]);
      mt = warp_max(mt);
      float mo = mh[hh], mn = fmaxf(mo, mt), lt = 0.0f;
      for (int jj = lane; jj < tn; jj += 32) {
        // A key past this slot's row is -inf: weight 0 (also while the slot has seen none).
        float x = sc[hh * AC_TK + jj];
        float p = x == -F32_INF ? 0.0f : expf(x - mn);
        sc[hh * AC_TK + jj] = p;
        lt += p;
      }
      lt = warp_sum(lt);
      if (lane == 0) {
        float corr = mo == -F32_INF ? 0.0f : expf(mo - mn);
        ch[hh] = corr;
        lh[hh] = lh[hh] * corr + lt;
        mh[hh] = mn;
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int e = threadIdx.x + r * blockDim.x;
      if (e < nsd) {
        const int hh = e / di, c = e - hh * di;
        const float* p = sc + hh * AC_TK;
        float a = acc[r] * ch[hh];
        for (int jj = 0; jj < tn; ++jj) a += p[jj] * ldf(vs[jj * di + c]);
        acc[r] = a;
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int e = threadIdx.x + r * blockDim.x;
    if (e < nsd) {
      const int hh = e / di, c = e - hh * di;
      const i64 row = rws[hh];
      if (splits == 1) {
        float l = lh[hh];
        stf(&o[row * d + c], (typename Acc<T>::t)(l > 0.0f ? acc[r] / l : 0.0f));
      } else {
        part[(row * splits + sp) * d + c] = acc[r];
        if (c == 0) {
          ml[(row * splits + sp) * 2] = mh[hh];
          ml[(row * splits + sp) * 2 + 1] = lh[hh];
        }
      }
    }
  }
  if (splits == 1 || counters == nullptr) return;
  // The group's last block to finish combines every split's partials (no combine launch): each
  // block makes its partials visible, then counts itself in; the one that counts `splits`
  // reads the others' through L2 (ld.cg) and puts the counter back to zero for the next kernel.
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&counters[grp], 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  ac_combine(part, ml, o, rws, nsi, di, (int)splits, reinterpret_cast<float*>(kvb));
  if (threadIdx.x == 0) counters[grp] = 0;
}

#undef AC_ROW

// One block per output row (where the attention kernel was given no counters).
template <typename T>
__device__ void attention_cached_combine(const float* __restrict__ part, const float* __restrict__ ml,
                                         T* __restrict__ o, i64 d, i64 splits) {
  __shared__ float buf[3 * AC_MAX_SPLITS + 1];
  __shared__ i64 row;
  if (threadIdx.x == 0) row = blockIdx.x;
  __syncthreads();
  ac_combine(part, ml, o, &row, 1, (int)d, (int)splits, buf);
}

// SplitMix64's finaliser and the sampler's uniform number (cpu::decode::uniform).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
// An order-preserving key of a float (larger float, larger key).
__device__ __forceinline__ unsigned fkey(float f) {
  unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Calls f(i, z) for each element i of the row xr (v elements) that this thread owns, z its value
// in float: 16-byte chunks t, t + blockDim.x, ... where the row allows (loads in flight
// together), else elements t, t + blockDim.x, ... Only for passes whose result does not depend
// on the order the elements are met in (maxima, the argmax with its lowest-index rule, counts):
// each thread still meets its own elements in index order.
template <typename T, typename F>
__device__ __forceinline__ void sample_each(const T* xr, i64 v, F f) {
  constexpr int V = Vec16<T>::n;
  if (v % V == 0 && ((unsigned long long)xr & 15) == 0) {
    const i64 chunks = v / V;
#pragma unroll 4
    for (i64 c = threadIdx.x; c < chunks; c += blockDim.x) {
      float z[V];
      ld16(xr + c * V, z);
#pragma unroll
      for (int i = 0; i < V; ++i) f(c * V + i, z[i]);
    }
  } else {
    for (i64 i = threadIdx.x; i < v; i += blockDim.x) f(i, ldf(xr[i]));
  }
}

// One block per row of logits [rows, v]. Greedy: the argmax, lowest index among equals.
// Otherwise z = x / temperature; top-k keeps z at or above the k-th largest (a search over the
// float keys); top-p keeps z whose kept mass strictly above is under top_p of the kept total;
// the draw walks the kept weights exp(z - max) in index order (each thread a contiguous chunk).
template <typename T>
__device__ void sample(const T* __restrict__ x, const i64* __restrict__ key, i64* __restrict__ ids, i64 v,
                       double temperature, i64 top_k, double top_p) {
  __shared__ float fbuf[32];
  __shared__ float tsum[1024];
  __shared__ int pick;
  i64 row = blockIdx.x;
  const T* xr = x + row * v;
  if (temperature == 0.0) {
    float best = -F32_INF;
    i64 bi = v;
    sample_each(xr, v, [&](i64 i, float z) {
      if (z == z && (bi == v || z > best)) {
        best = z;
        bi = i;
      }
    });
    __shared__ float bv[1024];
    __shared__ i64 bx[1024];
    bv[threadIdx.x] = best;
    bx[threadIdx.x] = bi;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) {
        float ov = bv[threadIdx.x + w];
        i64 oi = bx[threadIdx.x + w];
        if (oi < v && (bx[threadIdx.x] == v || ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bx[threadIdx.x]))) {
          bv[threadIdx.x] = ov;
          bx[threadIdx.x] = oi;
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) ids[row] = bx[0] == v ? 0 : bx[0];
    return;
  }
  float inv_t = (float)(1.0 / temperature);
  float m = -F32_INF;
  sample_each(xr, v, [&](i64, float z) { m = fmaxf(m, z * inv_t); });
  m = block_max(m, fbuf);
  // Top-k: the largest key kk with at least k values at or above it.
  unsigned kk = 0;
  if (top_k > 0 && top_k < v) {
    for (int bit = 31; bit >= 0; --bit) {
      unsigned cand = kk | (1u << bit);
      float cnt = 0.0f;
      sample_each(xr, v, [&](i64, float z) { cnt += fkey(z * inv_t) >= cand ? 1.0f : 0.0f; });
      cnt = block_sum(cnt, fbuf);
      if (cnt >= (float)top_k) kk = cand;
    }
  }
  float total = 0.0f;
  for (i64 i = threadIdx.x; i < v; i += blockDim.x) {
    float z = ld(xr[i]) * inv_t;
    if (fkey(z) >= kk) total += expf(z - m);
  }
  total = block_sum(total, fbuf);
  // Top-p: keep key > xp, xp the largest key whose kept mass strictly above is >= top_p.
  unsigned xp = 0;
  int use_p = top_p < 1.0;
  if (use_p) {
    float need = (float)top_p * total;
    for (int bit = 31; bit >= 0; --bit) {
      unsigned cand = xp | (1u << bit);
      float mass = 0.0f;
      for (i64 i = threadIdx.x; i < v; i += blockDim.x) {
        float z = ld(xr[i]) * inv_t;
        unsigned kz = fkey(z);
        if (kz >= kk && kz > cand) mass += expf(z - m);
      }
      mass = block_sum(mass, fbuf);
      if (mass >= need) xp = cand;
    }
  }
  // The draw, in index order: each thread sums its chunk, thread 0 scans the chunk sums.
  i64 chunk = (v + blockDim.x - 1) / blockDim.x;
  i64 lo = threadIdx.x * chunk, hi = lo + chunk < v ? lo + chunk : v;
  float mine = 0.0f;
  i64 last = -1;
  for (i64 i = lo; i < hi; ++i) {
    float z = ld(xr[i]) * inv_t;
    unsigned kz = fkey(z);
    if (kz >= kk && (!use_p || kz > xp)) { mine += expf(z - m); last = i; }
  }
  tsum[threadIdx.x] = mine;
  if (threadIdx.x == 0) pick = 0x7fffffff;
  __syncthreads();
  __shared__ float kept_total;
  if (threadIdx.x == 0) {
    float run = 0.0f;
    for (int i = 0; i < (int)blockDim.x; ++i) { float s = tsum[i]; tsum[i] = run; run += s; }
    kept_total = run;
  }
  __syncthreads();
  double u = (double)(mix64(mix64(mix64((unsigned long long)key[0]) ^ (unsigned long long)key[1]) ^
                            (unsigned long long)row) >> 11) * (1.0 / 9007199254740992.0);
  float target = (float)(u * (double)kept_total);
  if (mine > 0.0f && tsum[threadIdx.x] + mine > target) {
    float run = tsum[threadIdx.x];
    for (i64 i = lo; i < hi; ++i) {
      float z = ld(xr[i]) * inv_t;
      unsigned kz = fkey(z);
      if (kz >= kk && (!use_p || kz > xp)) {
        run += expf(z - m);
        if (run > target) { atomicMin(&pick, (int)i); break; }
      }
    }
  }
  __syncthreads();
  // Rounding left the target past every kept weight: the last kept token.
  __shared__ int last_kept;
  if (threadIdx.x == 0) last_kept = -1;
  __syncthreads();
  if (last >= 0) atomicMax(&last_kept, (int)last);
  __syncthreads();
  if (threadIdx.x == 0) ids[row] = pick != 0x7fffffff ? pick : (last_kept >= 0 ? last_kept : 0);
}

// attention_cached<NS>_<dtype>: blocks of at most NS slots (decode.rs picks the least that holds
// the plan's heads * rows).
#define AC_KERNEL(T, SUF, NS)                                                                                   \
  extern "C" __global__ void __launch_bounds__(AC_THREADS)                                                      \
      attention_cached##NS##_##SUF(const T* q, const T* k, const T* v, const i64* pos, T* o, float* part,       \
                                   float* ml, i64 t_len, i64 hq, i64 s, i64 hkv, i64 d, i64 gh, i64 gt,          \
                                   i64 splits, i64 chunk, double scale, RopeFreqs f, int rope, int* counters) {  \
    pdl_enter();                                                                                                \
    attention_cached<NS, T>(q, k, v, pos, o, part, ml, t_len, hq, s, hkv, d, gh, gt, splits, chunk, scale, f,   \
                            rope, counters);                                                                    \
  }
#define DECODE(T, SUF)                                                                                          \
  extern "C" __global__ void rope_at_##SUF(const T* x, const i64* pos, T* y, i64 rows, i64 n1, i64 n2,         \
                                           int seq_first, i64 d, RopeFreqs f) {                                 \
    pdl_enter();                                                                                                \
    rope_at<T>(x, pos, y, rows, n1, n2, seq_first, d, f);                                                       \
  }                                                                                                             \
  extern "C" __global__ void cache_write_##SUF(T* cache, const T* nw, const i64* pos, i64 b_len, i64 s,         \
                                               i64 t_len, i64 r, int* status, int tag) {                        \
    pdl_enter();                                                                                                \
    cache_write<T>(cache, nw, pos, b_len, s, t_len, r, status, tag);                                            \
  }                                                                                                             \
  extern "C" __global__ void cache_write_rope_##SUF(T* cache, const T* nw, const i64* pos, i64 b_len, i64 s,    \
                                                    i64 t_len, i64 r, i64 d, RopeFreqs f, int* status, int tag) {\
    pdl_enter();                                                                                                \
    cache_write_rope<T>(cache, nw, pos, b_len, s, t_len, r, d, f, status, tag);                                 \
  }                                                                                                             \
  extern "C" __global__ void cache_write_kv_##SUF(T* kc, T* vc, const T* kn, const T* vn, const i64* pos,     \
                                                  i64 b_len, i64 s, i64 t_len, i64 r, i64 d, RopeFreqs f,       \
                                                  int rope, int* status, int tag) {                             \
    pdl_enter();                                                                                                \
    cache_write_kv<T>(kc, vc, kn, vn, pos, b_len, s, t_len, r, d, f, rope, status, tag);                        \
  }                                                                                                             \
  AC_KERNEL(T, SUF, 4) AC_KERNEL(T, SUF, 8) AC_KERNEL(T, SUF, 16)                                              \
  extern "C" __global__ void attention_cached_combine_##SUF(const float* part, const float* ml, T* o, i64 d,    \
                                                            i64 splits) {                                       \
    pdl_enter();                                                                                                \
    attention_cached_combine<T>(part, ml, o, d, splits);                                                        \
  }                                                                                                             \
  extern "C" __global__ void sample_##SUF(const T* x, const i64* key, i64* ids, i64 v, double temperature,      \
                                          i64 top_k, double top_p) {                                            \
    pdl_enter();                                                                                                \
    sample<T>(x, key, ids, v, temperature, top_k, top_p);                                                       \
  }
DECODE(float, f32)
DECODE(bf16, bf16)
DECODE(f16, f16)
