// The AVX2 kernel's one-token inner loop with its codes in L1 (one 2 KiB row reused): cycles per 64 codes of three
// exact decodes (the kernel's F16C one, F16C on 8-code halves, float32 bits x 2^120), at the clock given by ghz
// (a dependent-add loop measures ~2.0 G adds/s on the 2-core EPYC VM). Used for docs/cpu-path.md's AVX2 profile:
//   g++ -O3 -mavx2 -mfma -mf16c -o /tmp/decode_cost benchmarks/native_ab/decode_cost.cpp && /tmp/decode_cost
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <ctime>
#include <cstring>
static double now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
alignas(64) uint8_t codes[2048];
alignas(64) float x[2048];
template <int V>
__attribute__((noinline)) float run(long reps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __m256i mask = _mm256_set1_epi16((short)0xBFFF);
  const __m256i m32 = _mm256_set1_epi32((int)0x87FFFFFF);
  const __m256 big = _mm256_set1_ps(0x1p120f);
  for (long r = 0; r < reps; ++r) {
    for (int k = 0; k < 2048; k += 32) {
      if (V == 0) {  // current: movsx ymm, sll, and, 2 cvtph (one via extract)
        for (int s = 0; s < 2; ++s) {
          __m256i w = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(codes + k + 16 * s))), 7), mask);
          __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
          if (s == 0) { a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + k), a0); a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + k + 8), a1); }
          else { a2 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + k + 16), a2); a3 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + k + 24), a3); }
        }
      } else if (V == 1) {  // xmm halves: movsx xmm from 8 bytes, sll, and, cvtph
        __m256* acc[4] = {&a0, &a1, &a2, &a3};
        for (int s = 0; s < 4; ++s) {
          __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(codes + k + 8 * s)));
          w = _mm_and_si128(_mm_slli_epi16(w, 7), _mm256_castsi256_si128(mask));
          *acc[s] = _mm256_fmadd_ps(_mm256_cvtph_ps(w), _mm256_loadu_ps(x + k + 8 * s), *acc[s]);
        }
      } else {  // fp32 bits: movsx to 32-bit, sll 20, and, mul 2^120 (denormal for e = 0)
        __m256* acc[4] = {&a0, &a1, &a2, &a3};
        for (int s = 0; s < 4; ++s) {
          __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(codes + k + 8 * s)));
          w = _mm256_and_si256(_mm256_slli_epi32(w, 20), m32);
          __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(w), big);
          *acc[s] = _mm256_fmadd_ps(f, _mm256_loadu_ps(x + k + 8 * s), *acc[s]);
        }
      }
    }
  }
  __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  float o[8]; _mm256_storeu_ps(o, t); return o[0] + o[5];
}
int main() {
  for (int i = 0; i < 2048; ++i) { codes[i] = (i * 37) & 0xFF; if ((codes[i] & 0x7F) == 0x7F) codes[i] ^= 1; x[i] = 1.0f / (1 + i % 7); }
  const long reps = 200000; const double ghz = 2.03;
  for (int pass = 0; pass < 2; ++pass) {
    double t0 = now(); float r0 = run<0>(reps); double t1 = now(); float r1 = run<1>(reps); double t2 = now(); float r2 = run<2>(reps); double t3 = now();
    double per = reps * 32.0;  // 64-code groups
    printf("cycles/64 codes @%.2fGHz: movsx-ymm+cvtph %.2f | xmm halves %.2f | fp32 bits+mul %.2f   (%g %g %g)\n", ghz,
           (t1 - t0) / per * ghz * 1e9, (t2 - t1) / per * ghz * 1e9, (t3 - t2) / per * ghz * 1e9, r0, r1, r2);
  }
}
