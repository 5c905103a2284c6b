// Same-process A/B of two builds of the native kernel's moe_w8_forward (vllm_moe_w8/op/csrc): both libraries loaded
// at once, called alternately (order reversed every repetition) with a fresh random top-k routing and fresh inputs
// per repetition; prints per T the medians of process CPU time and wall time, the medians of the paired CPU-time
// and wall-time ratios A/B (> 1: B faster; with NT > 1 the wall ratio is the one that counts: CPU time includes the
// team's spinning) and the largest output difference relative to A's largest |output|. Qwen3.5-35B-A3B
// layer shape by default (H 2048, I 512, E 256, top-8, 128 x 128 scale tiles), random finite E4M3 codes in 2 MiB
// pages. No torch, no Python. Environment: E, H_, I_, K_ (shape); X_PLANES (activation planes: 1 = BF16-valued
// inputs, default; 3 = float32 inputs); H_PLANES (avx512bf16's h: 2 = exact, default; 1 = BF16; the avx2 variant
// needs H_PLANES=0); NT (threads, default 1: an OpenMP team, as in the op; bind it as vLLM does with
// OMP_PLACES="{0},{1}" OMP_PROC_BIND=true OMP_NUM_THREADS=2); NT_B (B's threads, default NT: the same .so as A and B
// with NT=1 NT_B=2 gives the two-thread scaling as a paired ratio, both sides under the same load); AB_STREAM=1 adds
// one plain read of exactly the routed experts' codes (the memory floor of a call); AB_FLUSH=1 reads 64 MiB of other
// memory before every call (a cold L3, as in bench_moe_op; see below).
//   F="-O3 -std=c++17 -shared -fPIC -fopenmp -fno-math-errno"   # cxx_build.COMMON_FLAGS, plus the variant's flags:
//   g++ $F -mavx2 -mfma -mf16c -o /tmp/new.so vllm_moe_w8/op/csrc/moe_avx2.cpp     # or, for avx512bf16:
//   g++ $F -mavx512f -mavx512bw -mavx512vl -mavx512vbmi -mavx512bf16 -mfma -o /tmp/new.so vllm_moe_w8/op/csrc/moe_avx512bf16.cpp
//   (the old build from a checkout of the old commit, same flags, into /tmp/old.so)
//   g++ -O2 -mavx2 -std=c++17 -fopenmp -o /tmp/moe_ab benchmarks/native_ab/moe_ab.cpp -ldl
//   /tmp/moe_ab /tmp/old.so /tmp/new.so 1,8,64,128,512 9
#include <dlfcn.h>
#include <immintrin.h>
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

typedef int (*fwd_t)(const float*, int, int, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                     const uint8_t*, const float*, const void*, int, const float*, int64_t, int64_t, int64_t, float,
                     int, float*, int64_t*);
static volatile int sink;
static double now(clockid_t c) { timespec t; clock_gettime(c, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int64_t env_or(const char* name, int64_t fallback) { return getenv(name) ? atoll(getenv(name)) : fallback; }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
static float bf16_truncated(float v) { uint32_t b; memcpy(&b, &v, 4); b &= 0xFFFF0000u; memcpy(&v, &b, 4); return v; }

static uint8_t* random_codes(int64_t n, std::mt19937_64& g) {  // in 2 MiB pages, as the op's hugepages.py arranges
  const int64_t size = (n + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  uint8_t* p = static_cast<uint8_t*>(aligned_alloc(2 << 20, size));
  madvise(p, size, MADV_HUGEPAGE);
  for (int64_t q = 0; q < n; q += 8) {  // finite E4M3 codes (magnitudes >= 0x78 folded below: no NaN, no e4m3fn-only)
    uint64_t r = g();
    for (int b = 0; b < 8 && q + b < n; ++b, r >>= 8) {
      uint8_t c = r & 0xFF;
      if ((c & 0x7F) >= 0x78) c &= 0xB7;
      p[q + b] = c;
    }
  }
  return p;
}

int main(int argc, char** argv) {
  if (argc < 4) { fprintf(stderr, "usage: moe_ab A.so B.so T[,T...] [reps]\n"); return 1; }
  const int64_t H = env_or("H_", 2048), I = env_or("I_", 512), E = env_or("E", 256), K = env_or("K_", 8), bn = 128, bk = 128;
  const int x_planes = env_or("X_PLANES", 1), h_planes = env_or("H_PLANES", 2), threads = env_or("NT", 1);
  const int threads_b = env_or("NT_B", threads);  // B with another thread count: the scaling, paired
  std::vector<int64_t> Ts;
  for (char* p = strtok(argv[3], ","); p; p = strtok(nullptr, ",")) Ts.push_back(atoll(p));
  const int reps = argc > 4 ? atoi(argv[4]) : 9;
  fwd_t f[2];
  for (int i = 0; i < 2; ++i) {
    void* h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);
    if (!h || !(f[i] = (fwd_t)dlsym(h, "moe_w8_forward"))) { fprintf(stderr, "%s: %s\n", argv[1 + i], dlerror()); return 1; }
  }
  std::mt19937_64 g(1);
  uint8_t* w13 = random_codes(E * 2 * I * H, g);
  uint8_t* w2 = random_codes(E * H * I, g);
  std::vector<float> s13(E * 2 * (I / bn) * (H / bk)), s2(E * (H / bn) * (I / bk));
  std::uniform_real_distribution<float> scale(1e-4f, 1e-3f), weight(0.f, 1.f);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& s : s13) s = scale(g);
  for (auto& s : s2) s = scale(g);
  // AB_FLUSH=1: before every call, read 64 MiB of other memory (evicts the L3, as a model's other layers and vLLM's
  // kernel do between the op's calls in bench_moe_op; otherwise the second call of a repetition, same routing, finds
  // part of the first call's codes in the L3 -- fair to A and B, as the order alternates, but optimistic)
  const bool flush = getenv("AB_FLUSH") != nullptr;
  std::vector<uint8_t> flush_buf(flush ? (64 << 20) : 0, 1);
  double load[3];
  getloadavg(load, 3);
  printf("H %ld I %ld E %ld top-%ld, x planes %d, h planes %d, %d thread(s) (B: %d), %d reps, load %.2f\n", H, I, E, K,
         x_planes, h_planes, threads, threads_b, reps, load[0]);
  for (int64_t T : Ts) {
    std::vector<float> x(T * H), tw(T * K), out[2] = {std::vector<float>(T * H), std::vector<float>(T * H)};
    std::vector<int32_t> ids(T * K);
    std::vector<double> cpu[2], wall[2], paired, paired_wall, stream;
    double maxrel = 0;
    for (int rep = 0; rep < reps; ++rep) {
      for (auto& v : x) v = x_planes == 1 ? bf16_truncated(normal(g)) : normal(g);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int> perm(E);
        for (int e = 0; e < E; ++e) perm[e] = e;
        for (int k = 0; k < K; ++k) { std::swap(perm[k], perm[k + g() % (E - k)]); ids[t * K + k] = perm[k]; tw[t * K + k] = weight(g); }
      }
      double c[2], w[2];
      for (int o = 0; o < 2; ++o) {
        const int i = (rep & 1) ? 1 - o : o;
        std::fill(out[i].begin(), out[i].end(), 0.f);
        if (flush) {
          __m256i acc = _mm256_setzero_si256();
          for (size_t q = 0; q < flush_buf.size(); q += 32)
            acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i*)(flush_buf.data() + q)));
          sink += _mm256_extract_epi8(acc, 5);
        }
        int64_t bad = 0;
        const double c0 = now(CLOCK_PROCESS_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
        const int rc = f[i](x.data(), x_planes, h_planes, T, H, I, E, w13, s13.data(), w2, s2.data(), ids.data(), 1,
                            tw.data(), K, bn, bk, 0.f, i ? threads_b : threads, out[i].data(), &bad);
        c[i] = now(CLOCK_PROCESS_CPUTIME_ID) - c0;
        w[i] = now(CLOCK_MONOTONIC) - w0;
        wall[i].push_back(w[i]);
        cpu[i].push_back(c[i]);
        if (rc) { fprintf(stderr, "%s: rc %d\n", argv[1 + i], rc); return 1; }
      }
      paired.push_back(c[0] / c[1]);
      paired_wall.push_back(w[0] / w[1]);
      if (getenv("AB_STREAM")) {  // the routed experts' codes read once, summed as bytes: the memory floor
        std::vector<char> hit(E, 0);
        for (int64_t q = 0; q < T * K; ++q) hit[ids[q]] = 1;
        const double t0 = now(CLOCK_PROCESS_CPUTIME_ID);
        __m256i acc = _mm256_setzero_si256();
        for (int64_t e = 0; e < E; ++e) {
          if (!hit[e]) continue;
          for (auto [base, n] : {std::pair{w13 + e * 2 * I * H, 2 * I * H}, std::pair{w2 + e * H * I, H * I}})
            for (int64_t q = 0; q < n; q += 32) acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i*)(base + q)));
        }
        stream.push_back(now(CLOCK_PROCESS_CPUTIME_ID) - t0);
        sink += _mm256_extract_epi8(acc, 3);
      }
      double mx = 0, md = 0;
      for (int64_t q = 0; q < T * H; ++q) {
        mx = std::max(mx, (double)std::fabs(out[0][q]));
        md = std::max(md, (double)std::fabs(out[0][q] - out[1][q]));
      }
      maxrel = std::max(maxrel, md / mx);
    }
    printf("T=%4ld  A cpu %8.2f wall %8.2f ms  B cpu %8.2f wall %8.2f ms  paired A/B cpu %.3fx wall %.3fx  maxrel %.1e", T,
           1e3 * median(cpu[0]), 1e3 * median(wall[0]), 1e3 * median(cpu[1]), 1e3 * median(wall[1]), median(paired),
           median(paired_wall), maxrel);
    if (!stream.empty()) printf("  stream-read %.2f ms", 1e3 * median(stream));
    printf("\n");
    fflush(stdout);
  }
}
