// rms_norm_bwd and rms_norm_bwd_dw_sum of src/kernels/rows.cu (RMSNorm's backward in one pass,
// then its dw partials summed) on the CPU emulator of tests/flash_emu/emu.h, against the
// gradients in double precision. The kernels' text is given by tests/rows_emulation.rs as
// `rows.cuh`, cut from rows.cu (its entry points left out).
//
// usage: rows DTYPE ROWS D GROUPS WIDE ACC MISALIGN   (DTYPE: bf16 or f32; WIDE 1: the
// RMS_BWD_WIDE chunks a thread of the `_wide` kernels; ACC 0: none, 1: an addend beside dx,
// 2: dx written over it; MISALIGN 1: x starts one element into its buffer, the element-by-element
// path; exit 1 past the tolerance). The block size is the recipe's: the chunks a thread over
// the width, rounded up to a warp.
#include "../flash_emu/prelude_emu.h"
#include <random>
#include <string>
#include "rows.cuh"

template <typename T, int K>
static int run(i64 rows, i64 d, unsigned groups, int acc, bool misalign) {
  const double eps = 1e-5;
  std::mt19937 g(11);
  std::normal_distribution<float> nd(0, 1);
  std::vector<T> xb(rows * d + 8), w(d), dy(rows * d), add(rows * d), dxb(rows * d);
  T* x = xb.data() + (misalign ? 1 : 0);
  for (i64 i = 0; i < rows * d; ++i) {
    st(&x[i], nd(g));
    st(&dy[i], nd(g));
    st(&add[i], nd(g));
  }
  for (i64 i = 0; i < d; ++i) st(&w[i], 1.0f + 0.5f * nd(g));
  // The gradients in double precision, from the stored (rounded) operands.
  std::vector<double> want_dx(rows * d), want_dw(d, 0.0);
  for (i64 r = 0; r < rows; ++r) {
    double ss = 0, dot = 0;
    for (i64 c = 0; c < d; ++c) {
      const double a = ld(x[r * d + c]);
      ss += a * a;
      dot += (double)ld(w[c]) * ld(dy[r * d + c]) * a;
    }
    const double rs = 1.0 / std::sqrt(ss / d + eps);
    for (i64 c = 0; c < d; ++c) {
      const double a = ld(x[r * d + c]), gy = ld(dy[r * d + c]);
      want_dx[r * d + c] = rs * ld(w[c]) * gy - a * rs * rs * rs * dot / d + (acc ? (double)ld(add[r * d + c]) : 0.0);
      want_dw[c] += gy * a * rs;
    }
  }
  T* dx = acc == 2 ? add.data() : dxb.data();
  for (i64 i = 0; i < rows * d; ++i)
    if (acc != 2) st(&dx[i], NAN);
  std::vector<float> part((size_t)groups * d, NAN);
  std::vector<T> dw(d);
  for (auto& v : dw) st(&v, NAN);
  constexpr int N = Vec16<T>::n;
  const i64 chunks = (d + N - 1) / N;
  const int threads = (int)(((chunks + K - 1) / K + 31) / 32 * 32);
  emu::launch({groups, 1, 1}, threads, 0, [&] {
    if (acc)
      rms_norm_bwd<T, true, K>(x, w.data(), dy.data(), add.data(), dx, part.data(), rows, d, eps);
    else
      rms_norm_bwd<T, false, K>(x, w.data(), dy.data(), nullptr, dx, part.data(), rows, d, eps);
  });
  // The recipe's 1024 threads a block of 32 columns; for wide rows 128 (every thread a
  // std::thread here), which the kernel takes alike (any whole number of warps).
  emu::launch({(unsigned)((d + 31) / 32), 1, 1}, d > 1100 ? 128 : 1024, 0,
              [&] { rms_norm_bwd_dw_sum<T>(part.data(), dw.data(), (i64)groups, d); });
  // ||got - want|| / ||want|| of each result, and NaNs (an element never written).
  auto err = [](auto got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double gv = ld(got[i]);
      if (std::isnan(gv)) return (double)INFINITY;
      num += (gv - want[i]) * (gv - want[i]);
      den += want[i] * want[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
  };
  const double tol = sizeof(T) == 2 ? 8e-3 : 2e-6;
  const double edx = err(dx, want_dx), edw = err(dw.data(), want_dw);
  printf("rows=%lld d=%lld groups=%u threads=%d K=%d acc=%d misalign=%d: dx %.2e dw %.2e\n", rows, d, groups, threads,
         K, acc, (int)misalign, edx, edw);
  return edx <= tol && edw <= tol ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc < 8) {
    fprintf(stderr, "usage: rows DTYPE ROWS D GROUPS WIDE ACC MISALIGN\n");
    return 2;
  }
  const std::string t = argv[1];
  const i64 rows = atoll(argv[2]), d = atoll(argv[3]);
  const unsigned groups = (unsigned)atoi(argv[4]);
  const bool wide = atoi(argv[5]) != 0, mis = atoi(argv[7]) != 0;
  const int acc = atoi(argv[6]);
  if (t == "bf16") return wide ? run<bf16, RMS_BWD_WIDE>(rows, d, groups, acc, mis) : run<bf16, 1>(rows, d, groups, acc, mis);
  return wide ? run<float, RMS_BWD_WIDE>(rows, d, groups, acc, mis) : run<float, 1>(rows, d, groups, acc, mis);
}
