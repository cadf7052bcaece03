// gemv_tn and gemv_wr (R = 1 and 2, for the row buckets of 1 and 4) of src/kernels/gemv.cu on
// the CPU emulator of tests/flash_emu/emu.h, each against the product in double precision. The kernel's text is given by tests/gemv_emulation.rs as
// `gemv.cuh`, cut from gemv.cu (its entry points left out).
//
// usage: gemv DTYPE OUT M N K BETA [INPLACE [MISALIGN]]   (DTYPE, OUT: bf16 or f32; exit 1 past
// the tolerance). INPLACE 1: c and d are one buffer; MISALIGN 1: a starts 2 bytes into its
// buffer (the element-by-element path).
#include "../flash_emu/prelude_emu.h"
#include <random>
#include <string>
#include "gemv.cuh"

template <typename T, typename O, int MM>
static int run(int m, int n, int k, float beta, bool inplace, bool misalign) {
  std::mt19937 g(7); std::normal_distribution<float> nd(0, 1);
  std::vector<T> abuf(m * k + 8), b(n * k);
  std::vector<O> c(m * n), d(m * n);
  T* a = abuf.data() + (misalign ? 1 : 0);
  auto mk = [&](T* p, float f) { st(p, f); };
  for (int i = 0; i < m * k; ++i) mk(&a[i], nd(g));
  for (auto& x : b) mk(&x, nd(g));
  for (auto& x : c) st(&x, nd(g));
  const std::vector<O> c0 = c;
  O* dd = inplace ? c.data() : d.data();
  std::vector<double> want(m * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int q = 0; q < k; ++q) s += (double)ld(a[i * k + q]) * ld(b[j * k + q]);
      want[i * n + j] = s + (beta != 0 ? beta * (double)ld(c[i * n + j]) : 0.0);
    }
  int fails = 0;
  // variant 0: gemv_tn; 1, 2: gemv_wr with R = variant
  for (int variant = 0; variant <= (MM <= 4 ? 2 : 0); ++variant) {
    for (auto& x : d) st(&x, NAN);
    if (inplace)
      for (int i = 0; i < m * n; ++i) c[i] = c0[i];
    if (variant == 0)
      emu::launch({(unsigned)((n + GEMV_ROWS - 1) / GEMV_ROWS), 1, 1}, GEMV_WARPS * 32, 0,
                  [&] { gemv_tn<T, O, MM>(a, b.data(), c.data(), dd, m, n, k, beta); });
    else if (variant == 1)
      emu::launch({(unsigned)((n + GEMV_WR_WARPS - 1) / GEMV_WR_WARPS), 1, 1}, GEMV_WR_WARPS * 32, 0,
                  [&] { gemv_wr<T, O, MM, 1>(a, b.data(), c.data(), dd, m, n, k, beta); });
    else
      emu::launch({(unsigned)((n + 2 * GEMV_WR_WARPS - 1) / (2 * GEMV_WR_WARPS)), 1, 1}, GEMV_WR_WARPS * 32, 0,
                  [&] { gemv_wr<T, O, MM, 2>(a, b.data(), c.data(), dd, m, n, k, beta); });
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
    printf("%s %s M%d N%d K%d beta %g%s%s mm %d: rel %.2e\n", rel <= tol ? "ok  " : "FAIL",
           variant == 0 ? "tn " : variant == 1 ? "wr1" : "wr2", m, n, k, beta, inplace ? " in place" : "",
           misalign ? " misaligned" : "", MM, rel);
    fails += rel <= tol ? 0 : 1;
  }
  return fails ? 1 : 0;
}

template <typename T, typename O>
static int bucket(int m, int n, int k, float beta, bool inplace, bool misalign) {
  if (m <= 1) return run<T, O, 1>(m, n, k, beta, inplace, misalign);
  if (m <= 4) return run<T, O, 4>(m, n, k, beta, inplace, misalign);
  if (m <= 8) return run<T, O, 8>(m, n, k, beta, inplace, misalign);
  return run<T, O, 16>(m, n, k, beta, inplace, misalign);
}

int main(int argc, char** argv) {
  if (argc < 7) { fprintf(stderr, "usage: gemv DTYPE OUT M N K BETA [INPLACE [MISALIGN]]\n"); return 2; }
  std::string dt = argv[1], out = argv[2];
  int m = atoi(argv[3]), n = atoi(argv[4]), k = atoi(argv[5]);
  float beta = atof(argv[6]);
  bool inplace = argc > 7 && atoi(argv[7]), misalign = argc > 8 && atoi(argv[8]);
  if (dt == "bf16" && out == "bf16") return bucket<bf16, bf16>(m, n, k, beta, inplace, misalign);
  if (dt == "bf16" && out == "f32") return bucket<bf16, float>(m, n, k, beta, inplace, misalign);
  if (dt == "f32" && out == "f32") return bucket<float, float>(m, n, k, beta, inplace, misalign);
  fprintf(stderr, "unknown types %s %s\n", dt.c_str(), out.c_str());
  return 2;
}
