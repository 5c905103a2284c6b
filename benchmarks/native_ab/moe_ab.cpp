// Same-process A/B of two builds of the native kernel's moe_w8_forward (vllm_moe_w8/op/csrc), one thread, thread
// CPU time, a fresh top-8 routing and fresh float32 inputs per call, the two builds alternating (order reversed every
// repetition), medians; also the max relative difference of their outputs. Qwen3.5-35B-A3B layer shape (H 2048,
// I 512, E 256, 128 x 128 scale tiles), random finite e4m3fn codes in 2 MiB pages. AB_STREAM=1 adds one pass of plain
// 32-byte loads over exactly the routed experts' codes (the memory floor of a call). No torch, no Python:
//   F="-O3 -std=c++17 -shared -fPIC -fopenmp -fno-math-errno -mavx2 -mfma -mf16c -Ivllm_moe_w8/op/csrc"
//   g++ $F -o /tmp/old.so <old moe_avx2.cpp>; g++ $F [-DMOE_PREFETCH=...] -o /tmp/new.so vllm_moe_w8/op/csrc/moe_avx2.cpp
//   g++ -O2 -mavx2 -std=c++17 -o /tmp/moe_ab benchmarks/native_ab/moe_ab.cpp -ldl
//   /tmp/moe_ab /tmp/old.so /tmp/new.so 1,8,64,128,512 9     # prints A/B = old time / new time per T
#include <dlfcn.h>
#include <sys/mman.h>
#include <time.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <immintrin.h>
#include <string>
typedef int (*fwd_t)(const float*, int, int, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                     const uint8_t*, const float*, const void*, int, const float*, int64_t, int64_t, int64_t, float,
                     int, float*, int64_t*);
static volatile int sink;
static double cpu_now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  if (argc < 4) { fprintf(stderr, "ab A.so B.so T [reps]\n"); return 1; }
  const int64_t H = 2048, I = 512, E = 256, K = 8, bn = 128, bk = 128;
  std::vector<int> Ts;
  for (char* p = strtok(argv[3], ","); p; p = strtok(nullptr, ",")) Ts.push_back(atoi(p));
  int reps = argc > 4 ? atoi(argv[4]) : 9;
  fwd_t f[2];
  for (int i = 0; i < 2; ++i) {
    void* h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    f[i] = (fwd_t)dlsym(h, "moe_w8_forward");
  }
  std::mt19937_64 g(1);
  const int64_t n13 = E * 2 * I * H, n2 = E * H * I;
  auto huge = [](int64_t n) {  // codes in 2 MiB pages, as the op's hugepages.py arranges
    const int64_t sz = (n + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    uint8_t* p = static_cast<uint8_t*>(aligned_alloc(2 << 20, sz));
    madvise(p, sz, MADV_HUGEPAGE);
    return p;
  };
  uint8_t* p13 = huge(n13); uint8_t* p2 = huge(n2);
  struct Span { uint8_t* b; int64_t n; uint8_t* begin() { return b; } uint8_t* end() { return b + n; } uint8_t* data() { return b; } };
  Span w13{p13, n13}, w2{p2, n2};
  for (auto* v : {&w13, &w2})
    for (int64_t q = 0; q < v->n; q += 8) {  // random finite e4m3fn codes (NaN 0x7F / 0xFF moved to 0x7E / 0xFE)
      uint64_t r = g();
      for (int b = 0; b < 8 && q + b < v->n; ++b, r >>= 8) { uint8_t c = r & 0xFF; if ((c & 0x7F) == 0x7F) c ^= 1; v->b[q + b] = c; }
    }
  const int64_t gI = I / bn, gH = H / bk, gH2 = H / bn, gI2 = I / bk;
  std::vector<float> s13(E * 2 * gI * gH), s2(E * gH2 * gI2);
  std::uniform_real_distribution<float> us(1e-4f, 1e-3f), ux(-1.f, 1.f);
  for (auto& s : s13) s = us(g);
  for (auto& s : s2) s = us(g);
  for (int T : Ts) {
    std::vector<float> x(T * H), tw(T * K), out[2] = {std::vector<float>(T * H), std::vector<float>(T * H)};
    std::vector<int32_t> ids(T * K);
    std::vector<double> tm[2], tm_stream;
    double maxrel = 0;
    for (int rep = 0; rep < reps; ++rep) {
      for (auto& v : x) v = ux(g);
      for (int t = 0; t < T; ++t) {
        std::vector<int> perm(E); for (int e = 0; e < E; ++e) perm[e] = e;
        for (int k = 0; k < K; ++k) { std::swap(perm[k], perm[k + g() % (E - k)]); ids[t * K + k] = perm[k]; tw[t * K + k] = ux(g); }
      }
      for (int o = 0; o < 2; ++o) {
        const int i = (rep & 1) ? 1 - o : o;
        std::fill(out[i].begin(), out[i].end(), 0.f);
        int64_t bad = 0;
        double t0 = cpu_now();
        int rc = f[i](x.data(), 3, 0, T, H, I, E, w13.data(), s13.data(), w2.data(), s2.data(), ids.data(), 1, tw.data(), K, bn, bk, 0.f, 1, out[i].data(), &bad);
        tm[i].push_back(cpu_now() - t0);
        if (rc) { fprintf(stderr, "rc %d\n", rc); return 1; }
      }
      if (getenv("AB_STREAM")) {  // the routed experts' codes read once, summed as bytes: the memory floor
        std::vector<char> hit(E, 0);
        for (int q = 0; q < T * K; ++q) hit[ids[q]] = 1;
        double t0 = cpu_now();
        __m256i acc = _mm256_setzero_si256();
        for (int e = 0; e < E; ++e) if (hit[e]) {
          for (const uint8_t* base : {w13.b + e * 2 * I * H, w2.b + e * H * I}) {
            const int64_t n = base == w2.b + e * H * I ? H * I : 2 * I * H;
            for (int64_t q = 0; q < n; q += 64) {
              acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i*)(base + q)));
              acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i*)(base + q + 32)));
            }
          }
        }
        tm_stream.push_back(cpu_now() - t0);
        sink += _mm256_extract_epi8(acc, 3);
      }
      double mx = 0, md = 0;
      for (int64_t q = 0; q < T * H; ++q) { mx = std::max(mx, (double)std::fabs(out[0][q])); md = std::max(md, (double)std::fabs(out[0][q] - out[1][q])); }
      maxrel = std::max(maxrel, md / mx);
    }
    double med[2];
    for (int i = 0; i < 2; ++i) { auto v = tm[i]; std::sort(v.begin(), v.end()); med[i] = v[v.size() / 2] * 1e3; }
    printf("T=%4d  A %8.2f ms  B %8.2f ms  A/B %.3fx  maxrel %.1e", T, med[0], med[1], med[0] / med[1], maxrel);
    if (!tm_stream.empty()) { std::sort(tm_stream.begin(), tm_stream.end()); printf("  stream-read %.2f ms", tm_stream[tm_stream.size() / 2] * 1e3); }
    printf("\n");
    fflush(stdout);
  }
}
