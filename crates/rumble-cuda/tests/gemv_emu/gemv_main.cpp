// gemv_tn and gemv_wr (R = 1 and 2, for the row buckets of 1 and 4) of src/kernels/gemv.cu on
// the CPU emulator of tests/flash_emu/emu.h, each against the product in double precision. The kernel's text is given by tests/gemv_emulation.rs as
// `gemv.cuh`, cut from gemv.cu (its entry points left out).
//
// usage: gemv DTYPE OUT M N K BETA [ADDEND [MISALIGN [PRE]]]   (DTYPE, OUT: bf16 or f32; exit 1
// past the tolerance). ADDEND 0: c [M, N] beside d; 1: c and d are one buffer; 2: c is a row [N]
// added to every row (row stride 0, a bias); MISALIGN 1: a starts 2 bytes into its buffer (the
// element-by-element path); PRE: none, norm or swiglu, the prologue of matmul_pre (OUT = DTYPE),
// the reference then taking the made rows as the unfolded op rounds them.
#include "../flash_emu/prelude_emu.h"
#include <random>
#include <string>
#include "gemv.cuh"

// v rounded to T, as a store and a load of T would give.
template <typename T>
static float rnd_as(float v) {
  T t;
  stf(&t, v);
  return ldf(t);
}
static i64 j_blocks(i64 n, i64 rows) { return (n + rows - 1) / rows; }
// A set of one projection: all n rows of b, its blocks of `rows` rows each.
template <typename T>
static GemvSet<T> one_set(const T* b, const T* c, T* d, i64 n, i64 ldc, i64 rows) {
  GemvSet<T> s;
  for (int j = 0; j < GEMV_SETS; ++j) {
    s.b[j] = b; s.c[j] = c; s.d[j] = d; s.n[j] = j == 0 ? n : 0; s.ldc[j] = ldc;
    s.first[j] = 0;
  }
  s.first[GEMV_SETS] = j_blocks(n, rows);
  for (int j = 1; j < GEMV_SETS; ++j) s.first[j] = s.first[GEMV_SETS];
  return s;
}

template <typename T, typename O, int MM, int PRE>
static int run(int m, int n, int k, float beta, int addend, bool misalign) {
  const bool inplace = addend == 1, row = addend == 2;
  const i64 ldc = row ? 0 : n;  // the addend's row stride
  std::mt19937 g(7); std::normal_distribution<float> nd(0, 1);
  const int ka = PRE == PRE_SWIGLU ? 2 * k : k;  // a's row length
  std::vector<T> abuf(m * ka + 8), b(n * k), gbuf(k + 8);
  std::vector<O> c(m * n), d(m * n);
  T* a = abuf.data() + (misalign ? 1 : 0);
  T* gw = gbuf.data() + (misalign ? 1 : 0);
  auto mk = [&](T* p, float f) { st(p, f); };
  for (int i = 0; i < m * ka; ++i) mk(&a[i], nd(g));
  for (int i = 0; i < k; ++i) mk(&gw[i], 1.0f + 0.5f * nd(g));
  for (auto& x : b) mk(&x, nd(g));
  // The rows the products take: a itself, or what rms_norm / swiglu_packed would store.
  std::vector<double> rows(m * k);
  for (int i = 0; i < m; ++i) {
    double ss = 0;
    for (int q = 0; q < k; ++q) ss += (double)ld(a[i * ka + q]) * ld(a[i * ka + q]);
    const float r = (float)(1.0 / std::sqrt(ss / k + 1e-5));
    for (int q = 0; q < k; ++q) {
      const float x = ld(a[i * ka + q]);
      float v = x;
      if (PRE == PRE_NORM) v = rnd_as<T>(x * r * ld(gw[q]));
      if (PRE == PRE_SWIGLU) v = rnd_as<T>((x / (1.0f + std::exp(-x))) * ld(a[i * ka + k + q]));
      rows[i * k + q] = v;
    }
  }
  // A row addend: only c's first row is read (the rest stays NaN, so a stride that is not 0
  // shows).
  for (int i = 0; i < m * n; ++i) st(&c[i], row && i >= n ? NAN : nd(g));
  const std::vector<O> c0 = c;
  O* dd = inplace ? c.data() : d.data();
  std::vector<double> want(m * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int q = 0; q < k; ++q) s += rows[i * k + q] * ld(b[j * k + q]);
      want[i * n + j] = s + (beta != 0 ? beta * (double)ld(c[i * ldc + j]) : 0.0);
    }
  int fails = 0;
  // variant 0: gemv_tn; 1, 2: gemv_wr with R = variant. With a prologue: gemv_pre on that split,
  // its rows made in dynamic shared memory, on a grid of 3 blocks that loop over the blocks of
  // rows.
  const size_t made = (size_t)m * k * sizeof(T);
  for (int variant = 0; variant <= (MM <= 4 ? 2 : 0); ++variant) {
    for (auto& x : d) st(&x, NAN);
    if (inplace)
      for (int i = 0; i < m * n; ++i) c[i] = c0[i];
    if constexpr (PRE != PRE_NONE && sizeof(O) == sizeof(T)) {
      const i64 rows = variant == 0 ? GEMV_ROWS : GEMV_PRE_WR_WARPS * variant;
      const GemvSet<T> set = one_set<T>(b.data(), c.data(), dd, n, ldc, rows);
      emu::launch({3, 1, 1}, 256, made, [&] {
        T* sm = reinterpret_cast<T*>(emu::tl.blk->smem.data());
        if (variant == 0) gemv_pre<PRE, 0, T, MM>(set, a, gw, m, k, beta, 1e-5, sm);
        if (variant == 1) gemv_pre<PRE, 1, T, MM>(set, a, gw, m, k, beta, 1e-5, sm);
        if (variant == 2) gemv_pre<PRE, 2, T, MM>(set, a, gw, m, k, beta, 1e-5, sm);
      });
    } else if (variant == 0) {
      emu::launch({(unsigned)((n + GEMV_ROWS - 1) / GEMV_ROWS), 1, 1}, GEMV_WARPS * 32, 0,
                  [&] { gemv_tn<T, O, MM>(a, b.data(), c.data(), dd, m, n, k, beta, ldc, blockIdx.x); });
    } else if (variant == 1) {
      emu::launch({(unsigned)((n + GEMV_WR_WARPS - 1) / GEMV_WR_WARPS), 1, 1}, GEMV_WR_WARPS * 32, 0, [&] {
        gemv_wr<T, O, MM, 1, GEMV_WR_WARPS>(a, b.data(), c.data(), dd, m, n, k, beta, ldc, blockIdx.x);
      });
    } else {
      emu::launch({(unsigned)((n + 2 * GEMV_WR_WARPS - 1) / (2 * GEMV_WR_WARPS)), 1, 1}, GEMV_WR_WARPS * 32, 0, [&] {
        gemv_wr<T, O, MM, 2, GEMV_WR_WARPS>(a, b.data(), c.data(), dd, m, n, k, beta, ldc, blockIdx.x);
      });
    }
    double num = 0, den = 0;
    bool unwritten = false;
    for (int i = 0; i < m * n; ++i) {
      double x = ld(dd[i]);
      if (std::isnan(x)) { printf("FAIL variant %d element %d not written\n", variant, i); unwritten = true; break; }
      num += (x - want[i]) * (x - want[i]);
      den += want[i] * want[i];
    }
    if (unwritten) { ++fails; continue; }
    double rel = std::sqrt(num / den), tol = sizeof(O) == 4 ? 1e-5 : 1e-2;
    printf("%s %s%s M%d N%d K%d beta %g%s%s mm %d: rel %.2e\n", rel <= tol ? "ok  " : "FAIL",
           variant == 0 ? "tn " : variant == 1 ? "wr1" : "wr2",
           PRE == PRE_NORM ? " norm" : PRE == PRE_SWIGLU ? " swiglu" : "", m, n, k, beta,
           inplace ? " in place" : row ? " row" : "", misalign ? " misaligned" : "", MM, rel);
    fails += rel <= tol ? 0 : 1;
  }
  // PRE: three projections of the same rows in one launch (GemvSet, gemv_set: the weight's rows
  // cut into three blocks of rows, each its own b, c and d), gemv_wr with one row a warp.
  if constexpr (PRE != PRE_NONE && sizeof(O) == sizeof(T)) {
    const int cut[4] = {0, n / 2, n / 2 + n / 3, n};
    GemvSet<T> set;
    std::vector<std::vector<T>> cs(3), ds(3);
    i64 first = 0;
    for (int j = 0; j < GEMV_SETS; ++j) {
      const int nj = j < 3 ? cut[j + 1] - cut[j] : 0;
      set.first[j] = first;
      if (j >= 3) continue;
      cs[j].resize(m * nj);
      for (int i = 0; i < m; ++i)
        for (int q = 0; q < nj; ++q) cs[j][i * nj + q] = c0[i * ldc + cut[j] + q];
      ds[j].assign(m * nj, T{});
      for (auto& x : ds[j]) st(&x, NAN);
      set.b[j] = b.data() + (i64)cut[j] * k;
      set.c[j] = cs[j].data();
      set.d[j] = inplace ? cs[j].data() : ds[j].data();
      set.n[j] = nj;
      set.ldc[j] = row ? 0 : nj;
      first += (nj + GEMV_PRE_WR_WARPS - 1) / GEMV_PRE_WR_WARPS;
    }
    for (int j = 3; j <= GEMV_SETS; ++j) set.first[j] = first;
    // As many blocks as the set has: each takes one.
    emu::launch({(unsigned)first, 1, 1}, 256, made, [&] {
      gemv_pre<PRE, 1, T, MM>(set, a, gw, m, k, beta, 1e-5, reinterpret_cast<T*>(emu::tl.blk->smem.data()));
    });
    double num = 0, den = 0;
    bool unwritten = false;
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < m; ++i)
        for (int q = 0; q < cut[j + 1] - cut[j]; ++q) {
          const double x = ld(set.d[j][i * (cut[j + 1] - cut[j]) + q]), y = want[i * n + cut[j] + q];
          unwritten |= std::isnan(x);
          num += (x - y) * (x - y);
          den += y * y;
        }
    const double rel = std::sqrt(num / den), tol = sizeof(O) == 4 ? 1e-5 : 1e-2;
    const bool ok = !unwritten && rel <= tol;
    printf("%s set of 3 wr1 M%d N%d K%d: rel %.2e%s\n", ok ? "ok  " : "FAIL", m, n, k, rel,
           unwritten ? " (unwritten)" : "");
    fails += ok ? 0 : 1;
  }
  return fails ? 1 : 0;
}

template <typename T, typename O, int PRE>
static int bucket(int m, int n, int k, float beta, int addend, bool misalign) {
  if (m <= 1) return run<T, O, 1, PRE>(m, n, k, beta, addend, misalign);
  if (m <= 4) return run<T, O, 4, PRE>(m, n, k, beta, addend, misalign);
  if (m <= 8) return run<T, O, 8, PRE>(m, n, k, beta, addend, misalign);
  return run<T, O, 16, PRE>(m, n, k, beta, addend, misalign);
}
template <typename T, typename O>
static int pre(const std::string& p, int m, int n, int k, float beta, int addend, bool misalign) {
  if (p == "norm") return bucket<T, O, PRE_NORM>(m, n, k, beta, addend, misalign);
  if (p == "swiglu") return bucket<T, O, PRE_SWIGLU>(m, n, k, beta, addend, misalign);
  return bucket<T, O, PRE_NONE>(m, n, k, beta, addend, misalign);
}

int main(int argc, char** argv) {
  if (argc < 7) { fprintf(stderr, "usage: gemv DTYPE OUT M N K BETA [ADDEND [MISALIGN [PRE]]]\n"); return 2; }
  std::string dt = argv[1], out = argv[2];
  int m = atoi(argv[3]), n = atoi(argv[4]), k = atoi(argv[5]);
  float beta = atof(argv[6]);
  int addend = argc > 7 ? atoi(argv[7]) : 0;
  bool misalign = argc > 8 && atoi(argv[8]);
  std::string p = argc > 9 ? argv[9] : "none";
  if (dt == "bf16" && out == "bf16") return pre<bf16, bf16>(p, m, n, k, beta, addend, misalign);
  if (dt == "bf16" && out == "f32" && p == "none") return pre<bf16, float>(p, m, n, k, beta, addend, misalign);
  if (dt == "f32" && out == "f32") return pre<float, float>(p, m, n, k, beta, addend, misalign);
  fprintf(stderr, "unknown types %s %s\n", dt.c_str(), out.c_str());
  return 2;
}
