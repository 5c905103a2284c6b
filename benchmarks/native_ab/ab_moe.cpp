// Same-process A/B of builds of the native MoE kernel (moe_w8_forward): loads each .so with dlopen, calls them
// alternately (order reversed every repetition) with a fresh random top-k routing and fresh BF16-valued activations
// per repetition, and prints the medians of process CPU time and wall time, the median of the paired CPU-time ratio
// (first / second library) and the largest difference of the outputs relative to the first's largest |output|.
// Qwen3.5-35B-A3B shape by default (H 2048, I 512, top-8; 128x128 scale tiles), random E4M3 codes (no NaN codes)
// in 2 MiB pages; env H_, I_, K_ override H, I, top-k; NT: threads passed to the kernel (default 1).
//
//   g++ -O2 -o /tmp/ab_moe benchmarks/native_ab/ab_moe.cpp -ldl
//   # each build as vllm_moe_w8/codec/cxx_build.py compiles it (COMMON_FLAGS + the variant's flags in op/native.py):
//   g++ -O3 -std=c++17 -shared -fPIC -fopenmp -fno-math-errno -mavx512f -mavx512bw -mavx512vl -mavx512vbmi \
//       -mavx512bf16 -mfma -Ivllm_moe_w8/op/csrc OLD.cpp -o old.so      (likewise new.so)
//   /tmp/ab_moe E T REPS H_PLANES ./old.so ./new.so     # e.g. /tmp/ab_moe 256 1 60 2 ./old.so ./new.so
#include <dlfcn.h>
#include <sys/mman.h>
#include <time.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <string>
#include <cmath>
typedef int (*fwd_t)(const float*, int, int, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                     const uint8_t*, const float*, const void*, int, const float*, int64_t, int64_t, int64_t, float,
                     int, float*, int64_t*);
static double now(clockid_t c) { timespec t; clock_gettime(c, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void* huge(size_t n) {
  size_t al = (n + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
  void* p = aligned_alloc(2u << 20, al);
  madvise(p, al, MADV_HUGEPAGE);
  return p;
}
static float bf16r(float v) { uint32_t b; memcpy(&b, &v, 4); b &= 0xFFFF0000u; memcpy(&v, &b, 4); return v; }
int main(int argc, char** argv) {
  // usage: harness E T reps hplanes lib1 [lib2 ...]
  int64_t E = atoi(argv[1]), T = atoi(argv[2]); int reps = atoi(argv[3]); int hp = atoi(argv[4]);
  const int64_t H = getenv("H_") ? atoi(getenv("H_")) : 2048, I = getenv("I_") ? atoi(getenv("I_")) : 512, K = getenv("K_") ? atoi(getenv("K_")) : 8, bn = 128, bk = 128;
  std::vector<fwd_t> fns; std::vector<std::string> names;
  for (int i = 5; i < argc; ++i) {
    void* h = dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    fns.push_back((fwd_t)dlsym(h, "moe_w8_forward")); names.push_back(argv[i]);
  }
  std::mt19937_64 rng(1);
  size_t n13 = E * 2 * I * H, n2 = E * H * I;
  uint8_t* w13 = (uint8_t*)huge(n13); uint8_t* w2 = (uint8_t*)huge(n2);
  for (size_t i = 0; i < n13; i += 8) { uint64_t r = rng(); for (int b = 0; b < 8; ++b) { uint8_t c = r >> (8 * b); if ((c & 0x7F) >= 0x78) c &= 0xB7; w13[i + b] = c; } }
  for (size_t i = 0; i < n2; i += 8) { uint64_t r = rng(); for (int b = 0; b < 8; ++b) { uint8_t c = r >> (8 * b); if ((c & 0x7F) >= 0x78) c &= 0xB7; w2[i + b] = c; } }
  int64_t gI = I / bn, gH = H / bk;
  std::vector<float> s13(E * 2 * gI * gH), s2(E * gH * gI);
  std::uniform_real_distribution<float> U(1e-3f, 2e-3f); std::normal_distribution<float> N(0, 1);
  for (auto& v : s13) v = U(rng); for (auto& v : s2) v = U(rng);
  std::vector<float> x(T * H), w(T * K); std::vector<int32_t> ids(T * K);
  std::vector<std::vector<float>> out(fns.size(), std::vector<float>(T * H));
  std::vector<std::vector<double>> cpu(fns.size()), wall(fns.size());
  double maxdiff = 0;
  for (int r = 0; r < reps; ++r) {
    for (auto& v : x) v = bf16r(N(rng));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> perm(E); for (int e = 0; e < E; ++e) perm[e] = e;
      for (int k = 0; k < K; ++k) { std::swap(perm[k], perm[k + rng() % (E - k)]); ids[t * K + k] = perm[k]; w[t * K + k] = 0.1f + 0.01f * k; }
    }
    for (size_t f0 = 0; f0 < fns.size(); ++f0) {
      size_t f = (r & 1) ? fns.size() - 1 - f0 : f0;
      std::fill(out[f].begin(), out[f].end(), 0.f);
      int64_t bad = 0;
      double c0 = now(CLOCK_PROCESS_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
      int rc = fns[f](x.data(), 1, hp, T, H, I, E, w13, s13.data(), w2, s2.data(), ids.data(), 1, w.data(), K, bn, bk, 0.f, getenv("NT") ? atoi(getenv("NT")) : 1, out[f].data(), &bad);
      double c1 = now(CLOCK_PROCESS_CPUTIME_ID), w1 = now(CLOCK_MONOTONIC);
      if (rc) { fprintf(stderr, "rc %d\n", rc); return 1; }
      if (r) { cpu[f].push_back(c1 - c0); wall[f].push_back(w1 - w0); }
    }
    for (size_t f = 1; f < fns.size(); ++f) {
      double mx = 0, d = 0; for (int64_t i = 0; i < T * H; ++i) { mx = std::max(mx, (double)fabsf(out[0][i])); d = std::max(d, (double)fabsf(out[f][i] - out[0][i])); }
      maxdiff = std::max(maxdiff, d / mx);
    }
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  double la[3]; getloadavg(la, 3);
  printf("E=%ld T=%ld reps=%d hp=%d load %.2f maxreldiff %.2e\n", E, T, reps, hp, la[0], maxdiff);
  for (size_t f = 0; f < fns.size(); ++f)
    printf("  %-40s cpu %.3f ms  wall %.3f ms  ratio_cpu(vs first) %.3f\n", names[f].c_str(), 1e3 * med(cpu[f]), 1e3 * med(wall[f]), med(cpu[0]) / med(cpu[f]));
  if (fns.size() == 2) {  // paired ratios median
    std::vector<double> pr; for (size_t i = 0; i < cpu[0].size(); ++i) pr.push_back(cpu[0][i] / cpu[1][i]);
    printf("  paired cpu ratio A/B median %.3f\n", med(pr));
  }
}
