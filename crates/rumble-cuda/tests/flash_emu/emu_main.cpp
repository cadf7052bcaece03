// Runs the flash-attention kernels of one module (flash_attn.cu for FT = bf16/f16, or
// flash_fma.cu for f32) under the CPU emulator (emu.h) on random inputs and compares o, lse,
// dq, dk and dv with attention computed exactly in double, as rumble_core's CPU reference does.
// Built with the module's `#define`s (src/flash.rs `Variant::defines`) in a header given to g++
// by `-include` (tests/flash_emulation.rs does this), and -DFLASH_FMA=1 for f32.
//   emu_main B HQ HKV T S D CAUSAL SEED [SCALE_MUL [LAYOUT [SPLIT [POS]]]]   prints one line; exits 1 over tolerance
// LAYOUT: bhtd (default; q [B, HQ, T, D]) or bthd (q [B, T, HQ, D], k and v [B, S, HKV, D]): the
// kernels then read and write the sequence-major copies, and their results are compared after
// permuting back. SPLIT (tensor-core kernels): the group's query heads split over SPLIT dK/dV
// block rows, whose partial sums flash_bwd_dkdv_sum adds (src/flash.rs dkdv_split); default 1.
// POS (tensor-core kernels): comma-separated cache positions, one per sequence: the forward over
// a KV cache (flash_fwd_cached: query i of sequence b sees keys up to pos[b] + i, below S) is run
// and checked instead of the attention and its backward.
#include "emu.h"
#ifndef FLASH_FMA
#define FLASH_FMA 0
#endif
#include <random>
#include <string>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../src/kernels/flash_common.cuh"
#if FLASH_FMA
#include "../../src/kernels/flash_fma.cu"
#else
#include "../../src/kernels/flash_attn.cu"
#endif

using fa::T;
static float val(T x) { return ld(x); }
static T mk(float f) { T x; st(&x, f); return x; }

struct Ref { std::vector<double> o, lse, dq, dk, dv; };

// Exact attention in double on the given (already rounded) inputs; `oin`, `lsein` are the
// forward results the backward is given.
static Ref reference(int B, int HQ, int HKV, int Tn, int S, int D, bool causal, double scale, const std::vector<float>& q,
                     const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dout,
                     const std::vector<float>* oin, const std::vector<float>* lsein,
                     const std::vector<long long>* pos = nullptr) {
  Ref r;
  r.o.assign((size_t)B * HQ * Tn * D, 0);
  r.lse.assign((size_t)B * HQ * Tn, 0);
  r.dq.assign(r.o.size(), 0);
  r.dk.assign((size_t)B * HKV * S * D, 0);
  r.dv.assign(r.dk.size(), 0);
  int group = HQ / HKV;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < HQ; ++h) {
      size_t bh = (size_t)b * HQ + h, kv = (size_t)b * HKV + h / group;
      for (int i = 0; i < Tn; ++i) {
        int n = !causal ? S : pos ? (int)std::min<long long>(S, (*pos)[b] + i + 1) : i + 1;
        std::vector<double> s(n);
        double m = -INFINITY;
        for (int j = 0; j < n; ++j) {
          double a = 0;
          for (int c = 0; c < D; ++c) a += (double)q[(bh * Tn + i) * D + c] * k[(kv * S + j) * D + c];
          s[j] = a * scale;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int j = 0; j < n; ++j) sum += std::exp(s[j] - m);
        double lse = m + std::log(sum);
        r.lse[bh * Tn + i] = lse;
        for (int c = 0; c < D; ++c) {
          double a = 0;
          for (int j = 0; j < n; ++j) a += std::exp(s[j] - lse) * v[(kv * S + j) * D + c];
          r.o[(bh * Tn + i) * D + c] = a;
        }
        if (!oin) continue;
        double L = (*lsein)[bh * Tn + i], delta = 0;
        for (int c = 0; c < D; ++c) delta += (double)dout[(bh * Tn + i) * D + c] * (*oin)[(bh * Tn + i) * D + c];
        for (int j = 0; j < n; ++j) {
          double p = std::exp(s[j] - L), dp = 0;
          for (int c = 0; c < D; ++c) dp += (double)dout[(bh * Tn + i) * D + c] * v[(kv * S + j) * D + c];
          double ds = p * (dp - delta);
          for (int c = 0; c < D; ++c) {
            r.dq[(bh * Tn + i) * D + c] += scale * ds * k[(kv * S + j) * D + c];
            r.dk[(kv * S + j) * D + c] += scale * ds * q[(bh * Tn + i) * D + c];
            r.dv[(kv * S + j) * D + c] += p * dout[(bh * Tn + i) * D + c];
          }
        }
      }
    }
  return r;
}

// [B, H, N, D] <-> [B, N, H, D] (`to_bthd`; the inverse with `back`).
template <class X>
static std::vector<X> relayout(const X* x, int B, int H, int N, int D, bool back) {
  std::vector<X> y((size_t)B * H * N * D);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int n = 0; n < N; ++n)
        for (int c = 0; c < D; ++c) {
          size_t hm = (((size_t)b * H + h) * N + n) * D + c, sm = (((size_t)b * N + n) * H + h) * D + c;
          if (back) y[hm] = x[sm]; else y[sm] = x[hm];
        }
  return y;
}

static double rel_err(const std::vector<T>& got, const std::vector<double>& want, double* maxabs) {
  double num = 0, den = 0;
  *maxabs = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double g = val(got[i]);
    if (std::isnan(g)) return INFINITY;
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
    *maxabs = std::max(*maxabs, std::abs(g - want[i]));
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
static double rel_err_f(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

int main(int argc, char** argv) {
  if (argc < 9) { fprintf(stderr, "usage: emu_main B HQ HKV T S D CAUSAL SEED [SCALE_MUL [LAYOUT [SPLIT]]]\n"); return 2; }
  int B = atoi(argv[1]), HQ = atoi(argv[2]), HKV = atoi(argv[3]), Tn = atoi(argv[4]), S = atoi(argv[5]), D = atoi(argv[6]);
  bool causal = atoi(argv[7]);
  std::mt19937_64 rng(atoi(argv[8]));
  std::normal_distribution<float> nd(0.f, 1.f);
  // An optional 9th argument multiplies the usual scale (e.g. -1: the negative-scale path).
  double scale = (argc > 9 ? atof(argv[9]) : 1.0) / std::sqrt((double)D);
  const std::string layout = argc > 10 ? argv[10] : "bhtd";
  if (layout != "bhtd" && layout != "bthd") { fprintf(stderr, "unknown layout %s\n", layout.c_str()); return 2; }
  const bool bthd = layout == "bthd";
  if (D > fa::DP || (D <= fa::DP - (FLASH_FMA ? 32 : 16))) {
    fprintf(stderr, "head size %d does not belong to the module of DP %d\n", D, fa::DP);
    return 2;
  }
  auto rnd = [&](size_t n, std::vector<T>& t, std::vector<float>& f) {
    t.resize(n); f.resize(n);
    for (size_t i = 0; i < n; ++i) { t[i] = mk(nd(rng)); f[i] = val(t[i]); }
  };
  size_t nq = (size_t)B * HQ * Tn * D, nk = (size_t)B * HKV * S * D, rows = (size_t)B * HQ * Tn;
  std::vector<T> q, k, v, dout;
  std::vector<float> qf, kf, vf, df;
  rnd(nq, q, qf); rnd(nk, k, kf); rnd(nk, v, vf); rnd(nq, dout, df);
  // What the kernels read: the same values, in the layout under test (the reference is bhtd).
  auto dev_q = [&](const std::vector<T>& x) { return bthd ? relayout(x.data(), B, HQ, Tn, D, false) : x; };
  auto dev_k = [&](const std::vector<T>& x) { return bthd ? relayout(x.data(), B, HKV, S, D, false) : x; };
  auto host_q = [&](const T* x) { return bthd ? relayout(x, B, HQ, Tn, D, true) : std::vector<T>(x, x + nq); };
  auto host_k = [&](const T* x) { return bthd ? relayout(x, B, HKV, S, D, true) : std::vector<T>(x, x + nk); };
  const std::vector<T> qd = dev_q(q), kd = dev_k(k), vd = dev_k(v), dod = dev_q(dout);
  // Device buffers: 256-byte aligned like the planner's slots.
  auto alloc = [](size_t bytes) { return (unsigned char*)std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256); };
  T* o = (T*)alloc(nq * sizeof(T));
  float* lse = (float*)alloc(rows * 4);
  std::fill((unsigned char*)o, (unsigned char*)o + nq * sizeof(T), 0xff);
  std::fill((unsigned char*)lse, (unsigned char*)lse + rows * 4, 0xff);
  // Strides between heads and between positions (HeadLayout::strides in rumble-core).
  const i64 qhs = bthd ? D : (i64)Tn * D, qrs = bthd ? (i64)HQ * D : D;
  const i64 khs = bthd ? D : (i64)S * D, krs = bthd ? (i64)HKV * D : D;
  fa::Dims dm{B, HQ, HKV, Tn, S, D, qhs, qrs, khs, krs};
  // Causal grids pair block i with block n - 1 - i in one CTA (src/flash.rs grid_columns, here
  // whatever the size, so both passes run).
  auto cols = [&](int n) { return (unsigned)(causal && n >= 2 ? (n + 1) / 2 : n); };
#if !FLASH_FMA
  if (argc > 12) {  // the forward over a cache at positions POS
    const std::string at = argv[12];
    std::vector<long long> pos;
    for (char* t = std::strtok(argv[12], ","); t; t = std::strtok(nullptr, ",")) pos.push_back(atoll(t));
    if ((int)pos.size() != B || !causal) { fprintf(stderr, "POS wants %d positions and CAUSAL 1\n", B); return 2; }
    emu::launch({cols((Tn + FA_FWD_ROWS - 1) / FA_FWD_ROWS), (unsigned)(B * HQ), 1}, FA_FWD_THREADS, FA_SMEM_FWD,
                [&] { flash_fwd_cached(qd.data(), kd.data(), vd.data(), (const i64*)pos.data(), o, lse, dm, scale); });
    Ref r = reference(B, HQ, HKV, Tn, S, D, true, scale, qf, kf, vf, df, nullptr, nullptr, &pos);
    double m, e_o = rel_err(host_q(o), r.o, &m);
    double e_l = rel_err_f(std::vector<float>(lse, lse + rows), r.lse);
    bool ok = e_o <= 1e-2 && e_l <= 1e-2;
    printf("%s DP%d %s B%d HQ%d HKV%d T%d S%d D%d cached at %s: o %.2e lse %.2e (tol 1e-02)\n", ok ? "ok  " : "FAIL",
           fa::DP, layout.c_str(), B, HQ, HKV, Tn, S, D, at.c_str(), e_o, e_l);
    return ok ? 0 : 1;
  }
#endif
  emu::launch({cols((Tn + FA_FWD_ROWS - 1) / FA_FWD_ROWS), (unsigned)(B * HQ), 1}, FA_FWD_THREADS, FA_SMEM_FWD,
              [&] { flash_fwd(qd.data(), kd.data(), vd.data(), o, lse, dm, scale, causal); });
  Ref r0 = reference(B, HQ, HKV, Tn, S, D, causal, scale, qf, kf, vf, df, nullptr, nullptr);
  double mo, e_o = rel_err(host_q(o), r0.o, &mo);
  double e_l = rel_err_f(std::vector<float>(lse, lse + rows), r0.lse);
  // The backward gets the reference's o (rounded) and lse (f32), as the Rust tests feed the CPU's.
  std::vector<T> oref(nq);
  std::vector<float> oreff(nq), lsef(rows);
  for (size_t i = 0; i < nq; ++i) { oref[i] = mk((float)r0.o[i]); oreff[i] = val(oref[i]); }
  for (size_t i = 0; i < rows; ++i) lsef[i] = (float)r0.lse[i];
  const std::vector<T> orefd = dev_q(oref);
  Ref r1 = reference(B, HQ, HKV, Tn, S, D, causal, scale, qf, kf, vf, df, &oreff, &lsef);
  float* delta = (float*)alloc(rows * 4);
  T* dq = (T*)alloc(nq * sizeof(T));
  T* dk = (T*)alloc(nk * sizeof(T));
  T* dv = (T*)alloc(nk * sizeof(T));
  std::fill((unsigned char*)dq, (unsigned char*)dq + nq * sizeof(T), 0xff);
  std::fill((unsigned char*)dk, (unsigned char*)dk + nk * sizeof(T), 0xff);
  std::fill((unsigned char*)dv, (unsigned char*)dv + nk * sizeof(T), 0xff);
  std::fill((unsigned char*)delta, (unsigned char*)delta + rows * 4, 0xff);
#if FLASH_FMA
  const int nsplit = 1;
  auto dkdv = [&] {
    emu::launch({cols((S + FA_DKDV_KEYS - 1) / FA_DKDV_KEYS) * FA_NCHUNK, (unsigned)(B * HKV), 1}, FA_DKDV_THREADS,
                FA_SMEM_DKDV,
                [&] { flash_bwd_dkdv(qd.data(), kd.data(), vd.data(), lsef.data(), dod.data(), delta, dk, dv, dm, scale, causal); });
  };
#else
  // SPLIT: 1 (the default) writes dK/dV directly.
  const int nsplit = argc > 11 ? atoi(argv[11]) : 1;
  float* part = nsplit > 1 ? (float*)alloc((size_t)2 * nsplit * nk * 4) : nullptr;
  if (part) std::fill((unsigned char*)part, (unsigned char*)part + (size_t)2 * nsplit * nk * 4, 0xff);
  auto dkdv = [&] {
    emu::launch({cols((S + FA_DKDV_KEYS - 1) / FA_DKDV_KEYS) * FA_NCHUNK, (unsigned)(B * HKV * nsplit), 1},
                FA_DKDV_THREADS, FA_SMEM_DKDV, [&] {
                  flash_bwd_dkdv(qd.data(), kd.data(), vd.data(), lsef.data(), dod.data(), delta, dk, dv, part, nsplit,
                                 dm, scale, causal);
                });
    if (nsplit > 1)
      emu::launch({3, 1, 1}, FA_THREADS, 0, [&] { flash_bwd_dkdv_sum(part, dk, dv, dm, nsplit); });
  };
#endif
  auto dq_ = [&] {
    emu::launch({cols((Tn + FA_DQ_ROWS - 1) / FA_DQ_ROWS), (unsigned)(B * HQ), 1}, FA_DQ_THREADS, FA_SMEM_DQ, [&] {
      flash_bwd_dq(qd.data(), kd.data(), vd.data(), lsef.data(), dod.data(), delta, dq, dm, scale, causal);
    });
  };
  emu::launch({(unsigned)std::min<size_t>((rows + FA_THREADS / 32 - 1) / (FA_THREADS / 32), 64), 1, 1}, FA_THREADS, 0,
              [&] { flash_bwd_delta(orefd.data(), dod.data(), delta, dm); });
  dkdv();
  dq_();
  double m1, m2, m3;
  double e_dq = rel_err(host_q(dq), r1.dq, &m1);
  double e_dk = rel_err(host_k(dk), r1.dk, &m2);
  double e_dv = rel_err(host_k(dv), r1.dv, &m3);
  double tol = sizeof(T) == 4 ? 2e-5 : 1e-2;
  bool ok = e_o <= tol && e_l <= tol && e_dq <= tol && e_dk <= tol && e_dv <= tol;
  printf("%s DP%d %s B%d HQ%d HKV%d T%d S%d D%d causal%d split%d: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e (tol %.0e)\n",
         ok ? "ok  " : "FAIL", fa::DP, layout.c_str(), B, HQ, HKV, Tn, S, D, (int)causal, nsplit, e_o, e_l, e_dq,
         e_dk, e_dv, tol);
  return ok ? 0 : 1;
}
