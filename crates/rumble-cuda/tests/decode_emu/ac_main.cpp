// attention_cached and attention_cached_combine of src/kernels/decode.cu (f32) on the CPU
// emulator of tests/flash_emu/emu.h, against attention in double precision. The kernels' text
// is given by tests/decode_emulation.rs as `ac.cuh`, cut from decode.cu.
//
// usage: ac B T HQ HKV S D HEADS ROWS SPLITS CHUNK POS...   (exit 1 past 1e-4 of the reference)
// With AC_COUNTERS set, the last block of each group combines the splits. With AC_ROPE_THETA set, the kernel rotates the queries itself (Op::AttentionCached's `rope`,
// plain frequencies of that base) and the reference attends with the queries rotated as
// rope_at does.
#include "../flash_emu/prelude_emu.h"
#include <random>
#include <string>
inline float warp_max(float v) { for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, shfl_xor(v, o)); return v; }
// Blocks run one after another here: an atomic is a plain update, a fence nothing, and a
// load through L2 a load.
inline int atomicAdd(int* p, int v) { int old = *p; *p += v; return old; }
inline void __threadfence() {}
inline float __ldcg(const float* p) { return *p; }
// The status word's report (src/kernels/prelude.cuh), for cache_write's rows out of the cache.
inline void report(int*, int, int, i64) {}
// The prelude's rotation frequencies (src/kernels/prelude.cuh).
#define ROPE_MAX_HALF 256
struct RopeFreqs { float inv[ROPE_MAX_HALF]; };
inline void stage_rope_freqs(float* inv, const RopeFreqs& f, i64 half) {
  for (i64 j = threadIdx.x; j < half; j += blockDim.x) inv[j] = f.inv[j];
  __syncthreads();
}
#include "ac.cuh"
// cw B T S H D POS...: cache_write and cache_write_rope (theta 10000) of new rows [B, T, H * D]
// into caches [B, S, H * D] at each sequence's position, and cache_write_kv (plain and
// rotating) writing those rows as keys and other rows as values into two caches, on a grid of 3
// blocks of 64 threads (so each thread takes several elements), against the rows copied (keys
// rotated as rope_pair does) by hand; rows past the cache are skipped. Exit 1 on any difference.
static int cache_writes(int argc, char** argv) {
  const i64 b = atoi(argv[2]), t = atoi(argv[3]), s = atoi(argv[4]), h = atoi(argv[5]), d = atoi(argv[6]);
  const i64 r = h * d;
  std::vector<i64> pos(b);
  for (i64 i = 0; i < b; ++i) pos[i] = argc > 7 + i ? atoi(argv[7 + i]) : 0;
  std::mt19937 g(9); std::normal_distribution<float> n(0, 1);
  std::vector<float> nw(b * t * r), vn(b * t * r);
  for (auto& x : nw) x = n(g);
  for (auto& x : vn) x = n(g);
  RopeFreqs f{};
  for (i64 j = 0; j < d / 2; ++j) f.inv[j] = (float)pow(10000.0, -2.0 * j / d);
  int fails = 0;
  auto report_diff = [&](const char* what, int rope, const std::vector<float>& got, const std::vector<float>& want) {
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
    printf("%s %s%s b %lld t %lld s %lld h %lld d %lld: %d elements differ\n", bad ? "FAIL" : "ok  ", what,
           rope ? " rope" : "", b, t, s, h, d, bad);
    fails += bad != 0;
  };
  // An odd head size has no rotation: only the plain writes.
  for (int rope = 0; rope < (d % 2 ? 1 : 2); ++rope) {
    // The keys' cache as expected (rotated with rope), and the values' (copied).
    std::vector<float> cache(b * s * r, -7.0f), want(cache), vcache(b * s * r, -5.0f), vwant(vcache);
    for (i64 bb = 0; bb < b; ++bb) for (i64 tt = 0; tt < t; ++tt) {
      const i64 p = pos[bb] + tt;
      if (p < 0 || p >= s) continue;
      for (i64 hh = 0; hh < h; ++hh) for (i64 j = 0; j < d; ++j) {
        const float* x = &nw[(bb * t + tt) * r + hh * d];
        float y = x[j];
        if (rope && j < d / 2) { float y0, y1; rope_pair((float)p, f.inv[j], x[j], x[j + d / 2], y0, y1); y = y0; }
        if (rope && j >= d / 2) { float y0, y1; rope_pair((float)p, f.inv[j - d / 2], x[j - d / 2], x[j], y0, y1); y = y1; }
        want[(bb * s + p) * r + hh * d + j] = y;
        vwant[(bb * s + p) * r + hh * d + j] = vn[(bb * t + tt) * r + hh * d + j];
      }
    }
    std::vector<float> kc(cache), vc(vcache);
    emu::launch({3, 1, 1}, 64, 0, [&] {
      if (rope) cache_write_rope<float>(cache.data(), nw.data(), pos.data(), b, s, t, r, d, f, nullptr, 0);
      else cache_write<float>(cache.data(), nw.data(), pos.data(), b, s, t, r, nullptr, 0);
    });
    report_diff(rope ? "cache_write_rope" : "cache_write", 0, cache, want);
    emu::launch({3, 1, 1}, 64, 0, [&] {
      cache_write_kv<float>(kc.data(), vc.data(), nw.data(), vn.data(), pos.data(), b, s, t, r, d, f, rope, nullptr, 0);
    });
    report_diff("cache_write_kv keys", rope, kc, want);
    report_diff("cache_write_kv values", rope, vc, vwant);
  }
  return fails ? 1 : 0;
}
int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "cw") return cache_writes(argc, argv);
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
  RopeFreqs f{};
  const char* theta = getenv("AC_ROPE_THETA");
  const int rope = theta != nullptr;
  if (rope)
    for (i64 j = 0; j < d / 2; ++j) f.inv[j] = (float)pow(atof(theta), -2.0 * j / d);
  // The queries the reference attends with: rotated as rope_at would (float products).
  std::vector<float> qr(q);
  if (rope)
    for (i64 bb = 0; bb < b; ++bb) for (i64 tt = 0; tt < t; ++tt) for (i64 h = 0; h < hq; ++h)
      for (i64 j = 0; j < d / 2; ++j) {
        float* x = &q[((bb*t+tt)*hq+h)*d];
        double ang = (double)((float)(pos[bb] + tt) * f.inv[j]);
        float c = (float)cos(ang), sn = (float)sin(ang);
        qr[((bb*t+tt)*hq+h)*d+j] = x[j] * c - x[j + d/2] * sn;
        qr[((bb*t+tt)*hq+h)*d+j+d/2] = x[j + d/2] * c + x[j] * sn;
      }
  // With AC_COUNTERS set, the group's last block combines the splits (the counters must be
  // zero again after); otherwise attention_cached_combine does.
  const bool counted = getenv("AC_COUNTERS") != nullptr;
  std::vector<int> counters(groups, 0);
  emu::launch({(unsigned)(groups * splits), 1, 1}, 256, 0, [&] {
    // The instance decode.rs launches: the least slot bound holding gh * gt.
    int* cp = counted ? counters.data() : nullptr;
    if (gh * gt <= 4)
      attention_cached<4, float>(q.data(), k.data(), v.data(), pos.data(), o.data(), part.data(), ml.data(), t, hq, s, hkv, d, gh, gt, splits, chunk, scale, f, rope, cp);
    else if (gh * gt <= 8)
      attention_cached<8, float>(q.data(), k.data(), v.data(), pos.data(), o.data(), part.data(), ml.data(), t, hq, s, hkv, d, gh, gt, splits, chunk, scale, f, rope, cp);
    else
      attention_cached<AC_H, float>(q.data(), k.data(), v.data(), pos.data(), o.data(), part.data(), ml.data(), t, hq, s, hkv, d, gh, gt, splits, chunk, scale, f, rope, cp);
  });
  if (splits > 1 && !counted) {
    int th = ((d + 31) / 32) * 32; if (th > 256) th = 256;
    emu::launch({(unsigned)rows, 1, 1}, th, 0, [&] { attention_cached_combine<float>(part.data(), ml.data(), o.data(), d, splits); });
  }
  for (int c : counters)
    if (c != 0) { printf("FAIL a counter left at %d\n", c); return 1; }
  double err = 0, ref_norm = 0;
  i64 g_ = hq / hkv;
  for (i64 bb = 0; bb < b; ++bb) for (i64 tt = 0; tt < t; ++tt) for (i64 h = 0; h < hq; ++h) {
    i64 nn = std::min(pos[bb] + tt + 1, s);
    std::vector<double> sc(nn); double m = -1e300;
    for (i64 j = 0; j < nn; ++j) { double dot = 0; for (i64 c = 0; c < d; ++c) dot += (double)qr[((bb*t+tt)*hq+h)*d+c] * k[((bb*s+j)*hkv+h/g_)*d+c]; sc[j] = scale*dot; m = std::max(m, sc[j]); }
    double z = 0; for (auto& x : sc) { x = exp(x - m); z += x; }
    for (i64 c = 0; c < d; ++c) { double a = 0; for (i64 j = 0; j < nn; ++j) a += sc[j] * v[((bb*s+j)*hkv+h/g_)*d+c]; a /= z;
      double got = o[((bb*t+tt)*hq+h)*d+c]; err = std::max(err, std::isnan(got) ? 1e9 : fabs(got - a)); ref_norm = std::max(ref_norm, fabs(a)); }
  }
  printf("b %lld t %lld hq %lld hkv %lld s %lld d %lld gh %lld gt %lld splits %lld%s%s: max err %.3e (max |o| %.3f)\n", b, t, hq, hkv, s, d, gh, gt, splits, rope ? " rope" : "", counted ? " counted" : "", err, ref_norm);
  return err < 1e-4 ? 0 : 1;
}
