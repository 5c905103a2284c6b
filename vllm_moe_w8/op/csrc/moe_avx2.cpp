// Native CPU body of the neuron-w8 MoE op, AVX2 + FMA + F16C variant: exact FP8-weight MoE with 1-byte experts.
//
// Built at first use by vllm_moe_w8/op/native.py (g++ -O3 -mavx2 -mfma -mf16c -fopenmp) on hosts whose best
// instruction set is AVX2 (or when VLLM_MOE_W8_CPU_ISA=avx2), loaded with ctypes; no torch headers. Threads: the
// caller and nthreads - 1 helpers that it never waits to start (moe_common.h, run_phases).
//
// Numbers: every product and sum in float32. Panel path (many tokens): each weight is the float32 product
// code_value * tile_scale, rounded once -- exactly what fp8.dequantize computes. Few tokens: the exact code values
// are multiplied with the inputs and each scale tile's float32 partial sum is multiplied by its scale (one rounding
// per tile instead of one per weight; both within float32 summation error of the exact product).
//   decode: an E4M3/E4M3FN byte s.eeee.mmm placed as float16 bits s.0eeee.mmm0000000 is code_value / 256
//   (normals and subnormals alike; F16C converts float16 subnormals exactly), so
//   weight = fp32(half) * (256 * scale) with a single rounding. Codes must be finite in their format
//   (repack and the checkpoint reader guarantee it): e4m3's inf/NaN codes and e4m3fn's NaN code are not
//   special-cased here.
//
// Algorithm (routing and work split shared with the other variants, moe_common.h):
//   phase 1: work item = (expert, chunk of intermediate rows): decode a few gate (then up) rows into an
//            L1-resident float32 panel, multiply with every token routed to the expert, then SiLU(gate)*up
//            into h[pair, i].
//   phase 2: work item = chunk of hidden rows of W2 (output columns), looping over the routed experts:
//            decode a panel of W2 rows, dot with h of the expert's pairs, accumulate weight * y into the
//            float32 output -- each item owns its output columns, so there are no races.
// Never a whole expert is dequantised; each routed expert's codes are decoded once per call per token block.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "moe_common.h"

namespace {

constexpr int kPanelRows = 4;   // rows decoded at once
constexpr int kTokenTile = 3;   // tokens per register tile
constexpr int kTokenBlock = 32; // tokens whose inputs stay in L2 while a panel is reused
constexpr int64_t kChunk = 256; // panel columns decoded at once when one scale tile spans the row (bk == 0)

struct Matrix {  // one expert matrix [N, K] of codes with its scale grid
  const uint8_t* codes;
  const float* scales;  // [ceil(N/bn), gk]
  int64_t k;
  int64_t bn, bk, gk;
};

// Decode columns [k0, k1) of rows [n0, n0 + rows) of m into panel (row-major, stride k1 - k0; k0, k1 multiples
// of 16 inside one scale tile column, or bk == 0).
inline void decode_rows(const Matrix& m, int64_t n0, int rows, int64_t k0, int64_t k1, float* panel) {
  const __m256i sign_bit = _mm256_set1_epi16(0x4000);
  const int64_t b = m.bk ? k0 / m.bk : 0;
  for (int r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    const uint8_t* src = m.codes + n * m.k;
    float* dst = panel + r * (k1 - k0) - k0;
    const __m256 sc = _mm256_set1_ps(m.scales[(n / m.bn) * m.gk + b] * 256.0f);
    for (int64_t k = k0; k < k1; k += 16) {
      // the row's next chunk (or the next row), used after this panel's dot products: from memory meanwhile
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + k + (k1 - k0)), _MM_HINT_T0);
      __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
      w = _mm256_slli_epi16(w, 7);                              // s at bit 14, eeee.mmm at 13..7
      w = _mm256_add_epi16(w, _mm256_and_si256(w, sign_bit));  // move s to bit 15
      __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
      __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
      _mm256_storeu_ps(dst + k, _mm256_mul_ps(lo, sc));
      _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(hi, sc));
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[r][j] += (panel row r) * (x row j) over columns [k0, k1) (panel stride k1 - k0), as 8 partial sums each:
// R rows x M tokens of float32 vectors kept in memory between column chunks (one load and store per chunk).
template <int R, int M>
inline void dot_tile(const float* panel, int64_t k0, int64_t k1, const float* const* xs, __m256* acc) {
  __m256 a[R][M];
  const int64_t kc = k1 - k0;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < M; ++j) a[r][j] = _mm256_load_ps(reinterpret_cast<const float*>(acc + r * kTokenTile + j));
  for (int64_t kk = 0; kk < kc; kk += 8) {
    __m256 w[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) w[r] = _mm256_loadu_ps(panel + r * kc + kk);
#pragma GCC unroll 3
    for (int j = 0; j < M; ++j) {
      const __m256 xv = _mm256_loadu_ps(xs[j] + k0 + kk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(w[r], xv, a[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < M; ++j) _mm256_store_ps(reinterpret_cast<float*>(acc + r * kTokenTile + j), a[r][j]);
}

template <int R>
inline void dot_tile_m(int m, const float* panel, int64_t k0, int64_t k1, const float* const* xs, __m256* acc) {
  switch (m) {
    case 1: dot_tile<R, 1>(panel, k0, k1, xs, acc); break;
    case 2: dot_tile<R, 2>(panel, k0, k1, xs, acc); break;
    default: dot_tile<R, 3>(panel, k0, k1, xs, acc); break;
  }
}

inline void dot_tile_any(int r, int m, const float* panel, int64_t k0, int64_t k1, const float* const* xs, __m256* acc) {
  switch (r) {
    case 1: dot_tile_m<1>(m, panel, k0, k1, xs, acc); break;
    case 2: dot_tile_m<2>(m, panel, k0, k1, xs, acc); break;
    case 3: dot_tile_m<3>(m, panel, k0, k1, xs, acc); break;
    default: dot_tile_m<4>(m, panel, k0, k1, xs, acc); break;
  }
}

// Few tokens: res[j] = dot(row n of mat, xs[j]) for M <= kFusedTokens, decoding straight into registers
// (each 16 codes decoded once, used by every token). Per scale tile the exact code values (x 2^-8, as float16 bits)
// are dotted with the inputs and the tile's partial sum is multiplied by 256 * scale: no multiply per weight.
// M <= 6 keep two accumulators per token (two FMA chains: latency, not throughput, bounds one chain).
constexpr int kFusedTokens = 8;
constexpr int kPrefetch = 512;  // bytes of codes ahead
template <int M>
inline void fused_row_dot(const Matrix& m, int64_t n, const float* const* xs, float* res) {
  constexpr bool kSplit = M <= 6;
  const __m256i sign_bit = _mm256_set1_epi16(0x4000);
  const uint8_t* src = m.codes + n * m.k;
  const float* srow = m.scales + (n / m.bn) * m.gk;
  const int64_t bk = m.bk ? m.bk : m.k;
  __m256 tot[M];
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) tot[j] = _mm256_setzero_ps();
  for (int64_t kb = 0, b = 0; kb < m.k; kb += bk, ++b) {
    const int64_t kend = std::min(kb + bk, m.k);
    __m256 acc_lo[M], acc_hi[kSplit ? M : 1];
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) acc_lo[j] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < (kSplit ? M : 1); ++j) acc_hi[j] = _mm256_setzero_ps();
    for (int64_t k = kb; k < kend; k += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(src + k + kPrefetch), _MM_HINT_T0);
      __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
      w = _mm256_slli_epi16(w, 7);
      w = _mm256_add_epi16(w, _mm256_and_si256(w, sign_bit));
      const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
      const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
#pragma GCC unroll 8
      for (int j = 0; j < M; ++j) {
        acc_lo[j] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs[j] + k), acc_lo[j]);
        if constexpr (kSplit) {
          acc_hi[j] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs[j] + k + 8), acc_hi[j]);
        } else {
          acc_lo[j] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs[j] + k + 8), acc_lo[j]);
        }
      }
    }
    const __m256 sc = _mm256_set1_ps(srow[b] * 256.0f);
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) {
      if constexpr (kSplit) {
        tot[j] = _mm256_fmadd_ps(_mm256_add_ps(acc_lo[j], acc_hi[j]), sc, tot[j]);
      } else {
        tot[j] = _mm256_fmadd_ps(acc_lo[j], sc, tot[j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) res[j] = hsum(tot[j]);
}

inline void fused_row_dot_any(int count, const Matrix& m, int64_t n, const float* const* xs, float* res) {
  switch (count) {
    case 1: fused_row_dot<1>(m, n, xs, res); break;
    case 2: fused_row_dot<2>(m, n, xs, res); break;
    case 3: fused_row_dot<3>(m, n, xs, res); break;
    case 4: fused_row_dot<4>(m, n, xs, res); break;
    case 5: fused_row_dot<5>(m, n, xs, res); break;
    case 6: fused_row_dot<6>(m, n, xs, res); break;
    case 7: fused_row_dot<7>(m, n, xs, res); break;
    default: fused_row_dot<8>(m, n, xs, res); break;
  }
}

// For rows [n0, n1) of mat and tokens xs[0..count): calls emit(token_index, row, value).
template <class Emit>
void matmul_rows(const Matrix& mat, int64_t n0, int64_t n1, const float* const* xs, int64_t count, float* panel, Emit emit) {
  if (count <= kFusedTokens) {  // decode-bound: no panel round trip
    float r[kFusedTokens];
    for (int64_t n = n0; n < n1; ++n) {
      fused_row_dot_any(static_cast<int>(count), mat, n, xs, r);
      for (int64_t j = 0; j < count; ++j) emit(j, n, r[j]);
    }
    return;
  }
  // Panel path: per block of kTokenBlock tokens and kPanelRows rows, the columns in chunks of one scale tile
  // (at most kChunk): decode the chunk of the rows (an L1-resident panel), then every token tile's partial sums.
  const int64_t chunk = mat.bk ? mat.bk : std::min<int64_t>(kChunk, mat.k);
  constexpr int kTiles = (kTokenBlock + kTokenTile - 1) / kTokenTile;
  alignas(32) __m256 acc[kTiles * kPanelRows * kTokenTile];
  for (int64_t t0 = 0; t0 < count; t0 += kTokenBlock) {
    const int64_t t1 = std::min(t0 + kTokenBlock, count);
    for (int64_t n = n0; n < n1; n += kPanelRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n1 - n));
      std::fill(acc, acc + kTiles * kPanelRows * kTokenTile, _mm256_setzero_ps());
      for (int64_t k0 = 0; k0 < mat.k; k0 += chunk) {
        const int64_t k1 = std::min(k0 + chunk, mat.k);
        decode_rows(mat, n, rows, k0, k1, panel);
        for (int64_t t = t0, tile = 0; t < t1; t += kTokenTile, ++tile) {
          const int toks = static_cast<int>(std::min<int64_t>(kTokenTile, t1 - t));
          dot_tile_any(rows, toks, panel, k0, k1, xs + t, acc + tile * kPanelRows * kTokenTile);
        }
      }
      for (int64_t t = t0, tile = 0; t < t1; t += kTokenTile, ++tile) {
        const int toks = static_cast<int>(std::min<int64_t>(kTokenTile, t1 - t));
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < toks; ++j) emit(t + j, n + r, hsum(acc[tile * kPanelRows * kTokenTile + r * kTokenTile + j]));
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for unsupported shapes, 2 (and *bad_id) for an expert id >= E.
//   x [T, H] float32; x_planes is unused here (the float32 inputs are used as they are); h_planes must be 0
//   (h stays float32: FMA needs no bf16 planes);
//   topk_ids [T, k] (int32 if ids_are_int32 else int64, < 0: not on this rank); topk_weights [T, k] float32;
//   w13 [E, 2I, H] codes, w13_s [E, 2*gI, gH]; w2 [E, H, I] codes, w2_s [E, gH2, gI2];
//   out: [T, H] float32, zero on entry, accumulated.
int moe_w8_forward(const float* x, int x_planes, int h_planes, int64_t T, int64_t H, int64_t I, int64_t E,
                   const uint8_t* w13, const float* w13_s, const uint8_t* w2, const float* w2_s,
                   const void* topk_ids, int ids_are_int32, const float* topk_weights, int64_t K_top,
                   int64_t bn, int64_t bk, float swiglu_limit, int nthreads, float* out, int64_t* bad_id) {
  (void)x_planes;  // float32 FMA: every input dtype is exact
  if (h_planes != 0) return 1;  // h stays float32 here (0); rounding it to bf16 would buy nothing
  using namespace moe_w8;
  if (H % 16 || I % 16 || (bk && bk % 16)) return 1;
  const Grid grid(H, I, bn, bk);
  const int64_t gI = grid.gI, gH = grid.gH, gH2 = grid.gH2, gI2 = grid.gI2;
  Routing routing;
  if (!group_by_expert(topk_ids, ids_are_int32, topk_weights, T, K_top, E, routing, bad_id)) return 2;
  const int64_t P = routing.pairs();
  if (P == 0) return 0;
  const int64_t n_active = routing.active();
  const std::vector<int64_t>& experts = routing.experts;
  const std::vector<int64_t>& offsets = routing.offsets;
  const int64_t* pair_tokens = routing.tokens.data();
  const float* pair_weights = routing.weights.data();
  std::unique_ptr<float[]> h_store(new float[P * I]);  // every row written in phase 1
  float* h = h_store.get();

  const int64_t chunk1 = phase1_chunk(n_active, I, nthreads, kPanelRows * 2);
  const int64_t chunks1 = (I + chunk1 - 1) / chunk1;
  const int64_t items1 = n_active * chunks1;
  const int64_t chunk2 = phase2_chunk(H, nthreads, kPanelRows * 2);
  const int64_t items2 = (H + chunk2 - 1) / chunk2;
  const int threads = threads_for(n_active, H, I, nthreads);

  struct Scratch {
    std::vector<float> panel;
    std::vector<const float*> xs;
    std::vector<float> gate, up;
  };
  auto make = [&] { return Scratch{std::vector<float>(kPanelRows * std::max(H, I)), {}, {}, {}}; };
  // Phase 1: h[p, i] = silu(gate_i . x_p) * (up_i . x_p); items (expert, chunk of rows).
  auto phase1 = [&](int64_t item, Scratch& s) {
    const int64_t a = item / chunks1, c = item % chunks1;
    const int64_t e = experts[a];
    const int64_t p0 = offsets[a], cnt = offsets[a + 1] - p0;
    const int64_t i0 = c * chunk1, i1 = std::min(I, i0 + chunk1), ni = i1 - i0;
    s.xs.resize(cnt);
    for (int64_t j = 0; j < cnt; ++j) s.xs[j] = x + pair_tokens[p0 + j] * H;
    s.gate.resize(cnt * ni);
    s.up.resize(cnt * ni);
    const Matrix g{w13 + e * 2 * I * H, w13_s + e * 2 * gI * gH, H, bn, bk, gH};
    const Matrix u{w13 + (e * 2 * I + I) * H, w13_s + (e * 2 * gI + gI) * gH, H, bn, bk, gH};
    float* gp = s.gate.data();
    float* upp = s.up.data();
    matmul_rows(g, i0, i1, s.xs.data(), cnt, s.panel.data(), [&](int64_t j, int64_t n, float v) { gp[j * ni + (n - i0)] = v; });
    matmul_rows(u, i0, i1, s.xs.data(), cnt, s.panel.data(), [&](int64_t j, int64_t n, float v) { upp[j * ni + (n - i0)] = v; });
    for (int64_t j = 0; j < cnt; ++j) {
      float* hrow = h + (p0 + j) * I + i0;
      for (int64_t i = 0; i < ni; ++i) hrow[i] = silu_mul(gp[j * ni + i], upp[j * ni + i], swiglu_limit);
    }
  };
  // Phase 2 (every h row complete): out[t, n] += w_p * (down_n . h_p), items own disjoint column ranges n.
  auto phase2 = [&](int64_t item, Scratch& s) {
    const int64_t n0 = item * chunk2, n1 = std::min(H, n0 + chunk2);
    for (int64_t a = 0; a < n_active; ++a) {
      const int64_t e = experts[a];
      const int64_t p0 = offsets[a], cnt = offsets[a + 1] - p0;
      s.xs.resize(cnt);
      for (int64_t j = 0; j < cnt; ++j) s.xs[j] = h + (p0 + j) * I;
      const Matrix d{w2 + e * H * I, w2_s + e * gH2 * gI2, I, bn, bk, gI2};
      matmul_rows(d, n0, n1, s.xs.data(), cnt, s.panel.data(), [&](int64_t j, int64_t n, float v) {
        out[pair_tokens[p0 + j] * H + n] += pair_weights[p0 + j] * v;
      });
    }
  };
  run_phases<Scratch>({items1, items2}, threads, make, [&](int phase, int64_t item, Scratch& s) {
    if (phase == 0) phase1(item, s);
    else phase2(item, s);
  });
  return 0;
}

}  // extern "C"
