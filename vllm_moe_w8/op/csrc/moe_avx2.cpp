// Native CPU body of the neuron-w8 MoE op, AVX2 + FMA + F16C variant: exact FP8-weight MoE with 1-byte experts.
// Built at first use by vllm_moe_w8/op/native.py (g++ -O3 -mavx2 -mfma -mf16c) on hosts whose best instruction set is
// AVX2 (or VLLM_MOE_W8_CPU_ISA=avx2), loaded with ctypes; no torch headers. Threads: moe_common.h, run_phases.
//
// Numbers: every product and sum in float32. Panel path (many tokens): each weight is the float32 product
// code_value * tile_scale, rounded once -- exactly what fp8.dequantize computes. Few tokens: the exact code values
// are multiplied with the inputs and each scale tile's float32 partial sum is multiplied by its scale (one rounding
// per tile instead of one per weight; both within float32 summation error of the exact product).
//   decode: an E4M3/E4M3FN byte s.eeee.mmm placed as float16 bits s.0eeee.mmm0000000 is code_value / 256
//   (normals and subnormals alike; F16C converts float16 subnormals exactly), so weight = fp32(half) * (256 * scale)
//   with a single rounding. Codes must be finite in their format (repack and the checkpoint reader guarantee it).
//
// Algorithm (routing and work split shared with the other variants, moe_common.h):
//   phase 1: work item = (expert, chunk of intermediate rows): gate (then up) rows times every token routed to the
//            expert -- decoded in registers for few tokens, else through an L1 panel -- then SiLU(gate)*up into h.
//   phase 2: work item = chunk of hidden rows of W2 (output columns), looping over the routed experts: the rows
//            times h of the expert's pairs, weight * y accumulated into the float32 output (each item owns its
//            output columns: no races). Never a whole expert is dequantised.
//   lone pairs (an expert routed to one pair: nearly all of them at T <= 8): rows are decoded four at a time from
//   four sequential streams of codes (lone_tiles; phase 1: gate and up rows i and i + n/2 of the item, phase 2: row
//   n of four such experts), and decoding uses longer work items: more memory traffic in flight per thread.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "moe_common.h"

namespace {

// Tuning constants; these two overridable with -D for same-process A/B builds (benchmarks/native_ab/moe_ab.cpp).
#ifndef MOE_FUSED_TOKENS
#define MOE_FUSED_TOKENS 8
#endif
#ifndef MOE_PREFETCH
#define MOE_PREFETCH 2048
#endif
constexpr int kTileRows = 2;      // panel rows per register tile
constexpr int kPanelRows = 4;     // rows decoded into the panel at once (prefill)
constexpr int kTokenTile = 6;     // tokens per register tile: 2 x 6 float32 accumulators + 2 weights + 1 input
constexpr int kTokenBlock = 36;   // tokens whose inputs stay in L2 while a panel is reused
constexpr int64_t kPanelCols = 512;             // panel columns decoded at once (4 x 512 float32: 8 KiB, L1)
constexpr int kFusedTokens = MOE_FUSED_TOKENS;  // at most this many tokens: decode into registers, no panel
constexpr int64_t kPrefetch = MOE_PREFETCH;     // bytes of codes ahead (fused path), one prefetch per line and row
#ifndef MOE_LONE_PREFETCH
#define MOE_LONE_PREFETCH 512
#endif
#ifndef MOE_ROW_TILE
#define MOE_ROW_TILE 4
#endif
constexpr int64_t kLonePrefetch = MOE_LONE_PREFETCH;  // bytes of codes ahead per stream (lone pairs)
constexpr int kRowTile = MOE_ROW_TILE;  // rows of lone pairs decoded together, one stream each
#ifndef MOE_DECODE_CHUNK1
#define MOE_DECODE_CHUNK1 512
#endif
#ifndef MOE_DECODE_CHUNK2
#define MOE_DECODE_CHUNK2 256
#endif
constexpr int64_t kDecodeChunk1 = MOE_DECODE_CHUNK1;  // most rows per phase-1 / phase-2 work item when decoding
constexpr int64_t kDecodeChunk2 = MOE_DECODE_CHUNK2;

struct Matrix {  // one expert matrix [N, K] of codes with its scale grid
  const uint8_t* codes;
  const float* scales;  // [ceil(N/bn), gk]
  int64_t k;
  int64_t bn, bk, gk;
};

// 16 codes -> 16 float16 bit patterns, each the exact code value / 256: s at bit 15, eeee.mmm at 13..7.
// The byte sign-extended to 16 bits and shifted left by 7 has s at bits 15 and 14 and eeee.mmm at 13..7:
// clearing bit 14 leaves exactly that pattern (three operations per 16 codes).
inline __m256i decode16(const uint8_t* p) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
}
inline __m256 half_lo(__m256i w) { return _mm256_cvtph_ps(_mm256_castsi256_si128(w)); }
inline __m256 half_hi(__m256i w) { return _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)); }

// Decode columns [k0, k1) of rows [n0, n0 + rows) of m into panel (row-major, stride k1 - k0; k0, k1 multiples
// of 16): each weight is code_value * its tile's scale, one float32 rounding (the scale tiles' column edges are
// multiples of 16, so each 16 columns share one scale).
inline void decode_rows(const Matrix& m, int64_t n0, int rows, int64_t k0, int64_t k1, float* panel) {
  const int64_t bk = m.bk ? m.bk : m.k;
  for (int r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    const uint8_t* src = m.codes + n * m.k;
    const float* srow = m.scales + (n / m.bn) * m.gk;
    float* dst = panel + r * (k1 - k0) - k0;
    // codes used after this panel's dot products, from memory meanwhile: the row's next chunk, or after the
    // row's last chunk the first chunk of the next panel's row
    const uint8_t* ahead = k1 < m.k ? src + (k1 - k0) : src + rows * m.k - k0;
    for (int64_t kb = k0; kb < k1;) {
      const int64_t b = kb / bk, kend = std::min(k1, (b + 1) * bk);
      const __m256 sc = _mm256_set1_ps(srow[m.bk ? b : 0] * 256.0f);
      for (int64_t k = kb; k < kend; k += 16) {
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
        const __m256i w = decode16(src + k);
        _mm256_storeu_ps(dst + k, _mm256_mul_ps(half_lo(w), sc));
        _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(half_hi(w), sc));
      }
      kb = kend;
    }
  }
}

inline void in_register(__m256& v) { asm("" : "+x"(v)); }  // one load feeding several FMAs (g++ would fold it into each)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[r][j] += (panel row r) * (x row j) over columns [k0, k1) (panel stride kc = k1 - k0), as 8 partial sums each:
// R rows x M tokens of float32 vectors kept in memory between column chunks (one load and store per chunk).
// Per 8 columns: R + M loads, R * M FMAs (2 x 6: 8 loads for 12 FMAs, 15 of the 16 vector registers).
template <int R, int M>
inline void dot_tile(const float* panel, int64_t kc, int64_t k0, const float* const* xs, __m256* acc) {
  __m256 a[R][M];
  const float* x[M];
  for (int j = 0; j < M; ++j) x[j] = xs[j] + k0;
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int j = 0; j < M; ++j) a[r][j] = _mm256_load_ps(reinterpret_cast<const float*>(acc + r * kTokenTile + j));
  for (int64_t kk = 0; kk < kc; kk += 8) {
    __m256 w[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) w[r] = _mm256_loadu_ps(panel + r * kc + kk);
#pragma GCC unroll 6
    for (int j = 0; j < M; ++j) {
      __m256 xv = _mm256_loadu_ps(x[j] + kk);
      in_register(xv);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(w[r], xv, a[r][j]);
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int j = 0; j < M; ++j) _mm256_store_ps(reinterpret_cast<float*>(acc + r * kTokenTile + j), a[r][j]);
}

template <int R>
inline void dot_tile_m(int m, const float* panel, int64_t kc, int64_t k0, const float* const* xs, __m256* acc) {
  static_assert(kTokenTile == 6, "one case per token count up to kTokenTile");
  switch (m) {
    case 1: dot_tile<R, 1>(panel, kc, k0, xs, acc); break;
    case 2: dot_tile<R, 2>(panel, kc, k0, xs, acc); break;
    case 3: dot_tile<R, 3>(panel, kc, k0, xs, acc); break;
    case 4: dot_tile<R, 4>(panel, kc, k0, xs, acc); break;
    case 5: dot_tile<R, 5>(panel, kc, k0, xs, acc); break;
    default: dot_tile<R, 6>(panel, kc, k0, xs, acc); break;
  }
}

// Few tokens: res[r * M + j] = dot(row n + r of mat, xs[j]) for R rows and M <= kFusedTokens tokens, decoding
// straight into registers (each 16 codes decoded once, used by every token). Per scale tile the exact code values
// (x 2^-8, as float16 bits) are dotted with the inputs and the tile's partial sum is multiplied by 256 * scale: no
// multiply per weight. Two rows at once load each input vector once for both (a load per FMA bounds one row from
// 3 tokens on); C accumulators per (row, token) break the FMA latency chains of 1-2 tokens.
template <int R, int M, int C>
inline void fused_rows_dot(const Matrix& m, int64_t n, const float* const* xs, float* res) {
  static_assert(C == 1 || C == 2 || C == 4, "C: accumulators per (row, token)");
  const uint8_t* src[R];
  const float* srow[R];
  for (int r = 0; r < R; ++r) {
    src[r] = m.codes + (n + r) * m.k;
    srow[r] = m.scales + ((n + r) / m.bn) * m.gk;
  }
  const int64_t bk = m.bk ? m.bk : m.k;
  __m256 tot[R][M];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) tot[r][j] = _mm256_setzero_ps();
  for (int64_t kb = 0, b = 0; kb < m.k; kb += bk, ++b) {
    const int64_t kend = std::min(kb + bk, m.k);
    __m256 a[C][R][M];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < M; ++j) a[c][r][j] = _mm256_setzero_ps();
    // 16 codes at k into accumulator set c0 (low 8 columns) and c1 (high 8)
    auto step = [&](int64_t k, int c0, int c1) __attribute__((always_inline)) {
      __m256i w16[R];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) w16[r] = decode16(src[r] + k);
      {
        __m256 wf[R];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) wf[r] = half_lo(w16[r]);
#pragma GCC unroll 8
        for (int j = 0; j < M; ++j) {
          __m256 xv = _mm256_loadu_ps(xs[j] + k);
          if constexpr (R > 1) in_register(xv);
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r) a[c0][r][j] = _mm256_fmadd_ps(wf[r], xv, a[c0][r][j]);
        }
      }
      {
        __m256 wf[R];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) wf[r] = half_hi(w16[r]);
#pragma GCC unroll 8
        for (int j = 0; j < M; ++j) {
          __m256 xv = _mm256_loadu_ps(xs[j] + k + 8);
          if constexpr (R > 1) in_register(xv);
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r) a[c1][r][j] = _mm256_fmadd_ps(wf[r], xv, a[c1][r][j]);
        }
      }
    };
    constexpr int lo0 = 0, hi0 = C >= 2 ? 1 : 0, lo1 = C == 4 ? 2 : 0, hi1 = C == 4 ? 3 : hi0;
    int64_t k = kb;
    for (; k + 64 <= kend; k += 64) {
      // R rows are streamed side by side: past a row's end, the codes due next are R - 1 rows further on
      const int64_t ahead = k + kPrefetch >= m.k ? kPrefetch + (R - 1) * m.k : kPrefetch;
#pragma GCC unroll 2
      for (int r = 0; r < R && kPrefetch > 0; ++r) _mm_prefetch(reinterpret_cast<const char*>(src[r] + k + ahead), _MM_HINT_T0);
      step(k, lo0, hi0);
      step(k + 16, lo1, hi1);
      step(k + 32, lo0, hi0);
      step(k + 48, lo1, hi1);
    }
    for (; k < kend; k += 16) step(k, lo0, hi0);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const __m256 sc = _mm256_set1_ps(srow[r][b] * 256.0f);
#pragma GCC unroll 8
      for (int j = 0; j < M; ++j) {
        __m256 part = a[0][r][j];
#pragma GCC unroll 3
        for (int c = 1; c < C; ++c) part = _mm256_add_ps(part, a[c][r][j]);
        tot[r][j] = _mm256_fmadd_ps(part, sc, tot[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) res[r * M + j] = hsum(tot[r][j]);
}

// rows (1 or 2) rows from n for count tokens; res[r * count + j].
// rows (1 or 2) rows from n for count tokens; res[r * count + j]. 1-2 tokens: one row at a time with 4 / 2
// accumulators per token (two rows streamed side by side measured 1.2-1.4x slower there); 3-5 tokens: two rows at
// once, each input load feeding both; 6-8: one row (two would need more than the 16 vector registers). Each count
// has one summation order per row, whichever path the row takes, so a row's bits never depend on its neighbour.
inline void fused_dot_any(int rows, int count, const Matrix& m, int64_t n, const float* const* xs, float* res) {
  if (rows == 2 && count >= 3 && count <= 5) {
    if (count == 3) fused_rows_dot<2, 3, 1>(m, n, xs, res);
    else if (count == 4) fused_rows_dot<2, 4, 1>(m, n, xs, res);
    else fused_rows_dot<2, 5, 1>(m, n, xs, res);
    return;
  }
  for (int r = 0; r < rows; ++r, res += count) {
    switch (count) {
      case 1: fused_rows_dot<1, 1, 4>(m, n + r, xs, res); break;
      case 2: fused_rows_dot<1, 2, 2>(m, n + r, xs, res); break;
      case 3: fused_rows_dot<1, 3, 1>(m, n + r, xs, res); break;
      case 4: fused_rows_dot<1, 4, 1>(m, n + r, xs, res); break;
      case 5: fused_rows_dot<1, 5, 1>(m, n + r, xs, res); break;
      case 6: fused_rows_dot<1, 6, 2>(m, n + r, xs, res); break;
      case 7: fused_rows_dot<1, 7, 1>(m, n + r, xs, res); break;
      default: fused_rows_dot<1, 8, 1>(m, n + r, xs, res); break;
    }
  }
}

// One row of a lone pair's dot product (an expert routed to one pair): its codes, its scale row, its input.
struct RowTask {
  const uint8_t* codes;
  const float* scales;
  const float* x;
};

// res[r] = dot(rows[r]) for R rows of k_len codes (scale tiles of bk columns), decoded in registers. The R rows are
// R independent streams of codes: more loads, conversions and FMA chains in flight than one row's (one row at a
// time streamed 10.5 GB/s here, vLLM's BF16 kernel 15.8). Per row and tile, two partial sums (the low and the high 8
// of every 16 columns) multiplied by 256 * scale: one summation order per row, whatever R and its neighbours are.
template <int R>
inline void lone_rows(const RowTask* rows, int64_t k_len, int64_t bk, float* res) {
  __m256 tot[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) tot[r] = _mm256_setzero_ps();
  for (int64_t kb = 0, b = 0; kb < k_len; kb += bk, ++b) {
    const int64_t kend = std::min(kb + bk, k_len);
    __m256 lo[R], hi[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    auto step = [&](int64_t k) __attribute__((always_inline)) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i w = decode16(rows[r].codes + k);
        lo[r] = _mm256_fmadd_ps(half_lo(w), _mm256_loadu_ps(rows[r].x + k), lo[r]);
        hi[r] = _mm256_fmadd_ps(half_hi(w), _mm256_loadu_ps(rows[r].x + k + 8), hi[r]);
      }
    };
    int64_t k = kb;
    for (; k + 64 <= kend; k += 64) {
#pragma GCC unroll 4
      for (int r = 0; r < R && kLonePrefetch > 0; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(rows[r].codes + k + kLonePrefetch), _MM_HINT_T0);
      step(k);
      step(k + 16);
      step(k + 32);
      step(k + 48);
    }
    for (; k < kend; k += 16) step(k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      tot[r] = _mm256_fmadd_ps(_mm256_add_ps(lo[r], hi[r]), _mm256_set1_ps(rows[r].scales[b] * 256.0f), tot[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) res[r] = hsum(tot[r]);
}

// Rows of lone pairs, kRowTile at a time, one stream of codes each (moe_common.h row_tiles: the order is the caller's).
template <class Task, class Emit>
void lone_tiles(int64_t total, int64_t k_len, int64_t bk, Task task, Emit emit) {
  static_assert(kRowTile >= 1 && kRowTile <= 4, "lone_rows has cases for 1..4 rows");
  moe_w8::row_tiles<kRowTile, RowTask>(total, task, [&](int count, const RowTask* rows, float* res) {
    switch (count) {
      case 1: lone_rows<1>(rows, k_len, bk, res); break;
      case 2: lone_rows<2>(rows, k_len, bk, res); break;
      case 3: lone_rows<3>(rows, k_len, bk, res); break;
      default: lone_rows<4>(rows, k_len, bk, res); break;
    }
  }, emit);
}

// Splits n items into ceil(n / most) parts as equal as possible; part q is [start(q), start(q + 1)).
struct EvenSplit {
  int64_t parts, base, extra;
  EvenSplit(int64_t n, int64_t most) : parts((n + most - 1) / most), base(n / parts), extra(n % parts) {}
  int64_t start(int64_t q) const { return q * base + std::min(q, extra); }
};

// For rows [n0, n1) of mat and tokens xs[0..count): calls emit(token_index, row, value).
template <class Emit>
void matmul_rows(const Matrix& mat, int64_t n0, int64_t n1, const float* const* xs, int64_t count, float* panel, Emit emit) {
  static_assert(kFusedTokens >= 1 && kFusedTokens <= 8, "fused_dot_any has cases for 1..8 tokens");
  if (count <= kFusedTokens) {  // decode-bound: no panel round trip
    float r[kTileRows * kFusedTokens];
    const int c = static_cast<int>(count);
    for (int64_t n = n0; n < n1; n += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n1 - n));
      fused_dot_any(rows, c, mat, n, xs, r);
      for (int q = 0; q < rows; ++q)
        for (int j = 0; j < c; ++j) emit(j, n + q, r[q * c + j]);
    }
    return;
  }
  // Panel path: per block of <= kTokenBlock tokens and kPanelRows rows, the columns in chunks of kPanelCols:
  // decode the chunk of the rows (an L1-resident panel), then every (2 rows x token tile)'s partial sums.
  const int64_t chunk = std::min<int64_t>(kPanelCols, mat.k);
  constexpr int kMaxTiles = (kTokenBlock + kTokenTile - 1) / kTokenTile;
  alignas(32) __m256 acc[kMaxTiles * kPanelRows * kTokenTile];
  const EvenSplit blocks(count, kTokenBlock);
  for (int64_t q = 0; q < blocks.parts; ++q) {
    const int64_t t0 = blocks.start(q), t1 = blocks.start(q + 1);
    const EvenSplit tiles(t1 - t0, kTokenTile);  // 7 tokens: 4 + 3, not 6 + 1
    for (int64_t n = n0; n < n1; n += kPanelRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n1 - n));
      std::fill(acc, acc + tiles.parts * kPanelRows * kTokenTile, _mm256_setzero_ps());
      for (int64_t k0 = 0; k0 < mat.k; k0 += chunk) {
        const int64_t k1 = std::min(k0 + chunk, mat.k), kc = k1 - k0;
        decode_rows(mat, n, rows, k0, k1, panel);
        for (int64_t tile = 0; tile < tiles.parts; ++tile) {
          const int64_t t = t0 + tiles.start(tile);
          const int toks = static_cast<int>(tiles.start(tile + 1) - tiles.start(tile));
          __m256* a = acc + tile * kPanelRows * kTokenTile;
          static_assert(kTileRows == 2, "a tile is a row pair (or the last, lone row)");
          for (int r = 0; r < rows; r += kTileRows) {
            if (rows - r >= 2) dot_tile_m<2>(toks, panel + r * kc, kc, k0, xs + t, a + r * kTokenTile);
            else dot_tile_m<1>(toks, panel + r * kc, kc, k0, xs + t, a + r * kTokenTile);
          }
        }
      }
      for (int64_t tile = 0; tile < tiles.parts; ++tile) {
        const int64_t t = t0 + tiles.start(tile);
        const int toks = static_cast<int>(tiles.start(tile + 1) - tiles.start(tile));
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

  // Decode (every expert on the register path): longer work items, i.e. longer sequential streams of codes per item.
  const bool decode = P <= kFusedTokens * n_active;
  const int64_t chunk1 = phase1_chunk(n_active, I, nthreads, kPanelRows * 2, decode ? kDecodeChunk1 : 64);
  const int64_t chunks1 = (I + chunk1 - 1) / chunk1;
  const int64_t items1 = n_active * chunks1;
  const int64_t chunk2 = phase2_chunk(H, nthreads, kPanelRows * 2, decode ? kDecodeChunk2 : 64);
  const int64_t items2 = (H + chunk2 - 1) / chunk2;
  const int threads = threads_for(n_active, H, I, nthreads);

  struct Scratch {
    std::vector<float> panel;
    std::vector<const float*> xs;
    std::vector<float> gate, up;
  };
  auto make = [&] { return Scratch{std::vector<float>(kPanelRows * std::max(H, I)), {}, {}, {}}; };
  // Phase 1: h[p, i] = silu(gate_i . x_p) * (up_i . x_p); items (expert, chunk of rows).
  // Claim order of the phase-1 items: round robin over `threads` contiguous bands of (expert, chunk) items, so the
  // team's threads, claiming in turn, stream separate experts (codes far apart) rather than neighbouring row chunks
  // of one expert; any claim order is correct (each item once), this one only spreads the memory streams.
  std::vector<int64_t> order1;
  order1.reserve(items1);
  const int64_t band = (items1 + threads - 1) / threads;
  for (int64_t q = 0; q < band; ++q)
    for (int64_t b = 0; b < threads; ++b)
      if (b * band + q < std::min(items1, (b + 1) * band)) order1.push_back(b * band + q);
  auto phase1 = [&](int64_t claim, Scratch& s) {
    const int64_t item = order1[claim];
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
    if (cnt == 1) {  // tiles of gate row i, up row i, gate row i + ni/2, up row i + ni/2: four sequential streams
      const int64_t half = ni / 2;  // ni is a multiple of 8
      auto row = [&](int64_t f) { return i0 + f / 4 + (f % 4 >= 2 ? half : 0); };
      lone_tiles(2 * ni, H, bk ? bk : H,
                 [&](int64_t f) {
                   const Matrix& m = f % 2 ? u : g;
                   return RowTask{m.codes + row(f) * H, m.scales + (row(f) / bn) * gH, s.xs[0]};
                 },
                 [&](int64_t f, float v) { (f % 2 ? upp : gp)[row(f) - i0] = v; });
    } else {
      matmul_rows(g, i0, i1, s.xs.data(), cnt, s.panel.data(), [&](int64_t j, int64_t n, float v) { gp[j * ni + (n - i0)] = v; });
      matmul_rows(u, i0, i1, s.xs.data(), cnt, s.panel.data(), [&](int64_t j, int64_t n, float v) { upp[j * ni + (n - i0)] = v; });
    }
    for (int64_t j = 0; j < cnt; ++j) {
      float* hrow = h + (p0 + j) * I + i0;
      for (int64_t i = 0; i < ni; ++i) hrow[i] = silu_mul(gp[j * ni + i], upp[j * ni + i], swiglu_limit);
    }
  };
  // Phase 2 (every h row complete): out[t, n] += w_p * (down_n . h_p), items own disjoint column ranges n. Experts
  // with one pair: tiles of row n of kRowTile such experts (one sequential stream each), then row n + 1; the others
  // one by one.
  std::vector<int64_t> lone;
  for (int64_t a = 0; a < n_active; ++a)
    if (offsets[a + 1] - offsets[a] == 1) lone.push_back(a);
  auto phase2 = [&](int64_t item, Scratch& s) {
    const int64_t n0 = item * chunk2, n1 = std::min(H, n0 + chunk2);
    for (size_t g0 = 0; g0 < lone.size(); g0 += kRowTile) {
      const int64_t members = std::min<int64_t>(kRowTile, lone.size() - g0);
      auto row = [&](int64_t f) { return n0 + f / members; };
      auto pair = [&](int64_t f) { return offsets[lone[g0 + f % members]]; };
      lone_tiles((n1 - n0) * members, I, bk ? bk : I,
                 [&](int64_t f) {
                   const int64_t e = experts[lone[g0 + f % members]];
                   return RowTask{w2 + (e * H + row(f)) * I, w2_s + (e * gH2 + row(f) / bn) * gI2, h + pair(f) * I};
                 },
                 [&](int64_t f, float v) { out[pair_tokens[pair(f)] * H + row(f)] += pair_weights[pair(f)] * v; });
    }
    for (int64_t a = 0; a < n_active; ++a) {
      const int64_t e = experts[a];
      const int64_t p0 = offsets[a], cnt = offsets[a + 1] - p0;
      if (cnt == 1) continue;
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
