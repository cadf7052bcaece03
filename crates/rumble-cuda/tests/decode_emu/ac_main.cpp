// attention_cached and attention_cached_combine of src/kernels/decode.cu (f32) on the CPU
// emulator of tests/flash_emu/emu.h, against attention in double precision. The kernels' text
// is given by tests/decode_emulation.rs as `ac.cuh`, cut from decode.cu.
//
// usage: ac B T HQ HKV S D HEADS ROWS SPLITS CHUNK POS...   (exit 1 past 1e-4 of the reference)
#include "../flash_emu/prelude_emu.h"
#include <random>
inline float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o); return v; }
inline float warp_max(float v) { for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, shfl_xor(v, o)); return v; }
#include "ac.cuh"
int main(int argc, char** argv) {
  i64 b = atoi(argv[1]), t = atoi(argv[2]), hq = atoi(argv[3]), hkv = atoi(argv[4]), s = atoi(argv[5]), d = atoi(argv[6]);
  i64 gh = atoi(argv[7]), gt = atoi(argv[8]), splits = atoi(argv[9]), chunk = atoi(argv[10]);
  std::mt19937 g(5); std::normal_distribution<float> n(0, 1);
  std::vector<float> q(b*t*hq*d), k(b*s*hkv*d), v(b*s*hkv*d), o(b*t*hq*d, NAN);
  for (auto& x : q) x = n(g); for (auto& x : k) x = n(g); for (auto& x : v) x = n(g);
  std::vector<i64> pos(b); for (i64 i = 0; i < b; ++i) pos[i] = argc > 11 + i ? atoi(argv[11 + i]) : s / 2;
  i64 rows = b * t * hq;
  std::vector<float> part(rows * splits * d, NAN), ml(rows * splits * 2, NAN);
  i64 groups = b * ((t + gt - 1) / gt) * hkv * ((hq / hkv + gh - 1) / gh);
  double scale = 1.0 / sqrt((double)d);
  emu::launch({(unsigned)(groups * splits), 1, 1}, 256, 0, [&] {
    attention_cached<float>(q.data(), k.data(), v.data(), pos.data(), o.data(), part.data(), ml.data(), t, hq, s, hkv, d, gh, gt, splits, chunk, scale);
  });
  if (splits > 1) {
    int th = ((d + 31) / 32) * 32; if (th > 256) th = 256;
    emu::launch({(unsigned)rows, 1, 1}, th, 0, [&] { attention_cached_combine<float>(part.data(), ml.data(), o.data(), d, splits); });
  }
  double err = 0, ref_norm = 0;
  i64 g_ = hq / hkv;
  for (i64 bb = 0; bb < b; ++bb) for (i64 tt = 0; tt < t; ++tt) for (i64 h = 0; h < hq; ++h) {
    i64 nn = std::min(pos[bb] + tt + 1, s);
    std::vector<double> sc(nn); double m = -1e300;
    for (i64 j = 0; j < nn; ++j) { double dot = 0; for (i64 c = 0; c < d; ++c) dot += (double)q[((bb*t+tt)*hq+h)*d+c] * k[((bb*s+j)*hkv+h/g_)*d+c]; sc[j] = scale*dot; m = std::max(m, sc[j]); }
    double z = 0; for (auto& x : sc) { x = exp(x - m); z += x; }
    for (i64 c = 0; c < d; ++c) { double a = 0; for (i64 j = 0; j < nn; ++j) a += sc[j] * v[((bb*s+j)*hkv+h/g_)*d+c]; a /= z;
      double got = o[((bb*t+tt)*hq+h)*d+c]; err = std::max(err, std::isnan(got) ? 1e9 : fabs(got - a)); ref_norm = std::max(ref_norm, fabs(a)); }
  }
  printf("b %lld t %lld hq %lld hkv %lld s %lld d %lld gh %lld gt %lld splits %lld: max err %.3e (max |o| %.3f)\n", b, t, hq, hkv, s, d, gh, gt, splits, err, ref_norm);
  return err < 1e-4 ? 0 : 1;
}
