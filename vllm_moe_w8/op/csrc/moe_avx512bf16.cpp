// Native CPU body of the neuron-w8 MoE op, AVX-512 variant (F + BW + VBMI + BF16): exact FP8-weight MoE
// with 1-byte experts and BF16 dot products.
//
// Built at first use by vllm_moe_w8/op/native.py (g++ -O3 -mavx512f -mavx512bw -mavx512vbmi -mavx512bf16
// -fopenmp) on hosts that have those flags (or when VLLM_MOE_W8_CPU_ISA=avx512bf16), loaded with ctypes.
//
// Numbers:
//   decode: every finite E4M3/E4M3FN value is exactly a bf16 (4 significant bits, exponents -9..8). A byte
//           s.eeee.mmm becomes the bf16 of its magnitude by two 128-entry byte lookups (vpermi2b: the low and
//           the high byte of the bf16 bits), then the sign bit is or-ed in -- no rounding anywhere.
//   dot:    vdpbf16ps multiplies bf16 pairs exactly into float32 and accumulates in float32. The activations
//           are split into bf16 "planes" that sum to them: a bf16 input is one plane, float16 two, float32
//           three (8 + 8 + 8 significant bits: exact). h = silu(gate) * up (float32) is split into h_planes
//           planes: two represent it to 2^-18 relative -- below the float32 summation error of the dot
//           products it feeds (the exact path); one is h rounded to nearest bf16 (2^-9 relative), what
//           vLLM's BF16 MoE does with its intermediate, and half the down projection's dot products.
//   scale:  the sum over one (bn, bk) tile of code_value * activation is multiplied by the tile's float32
//           scale and added to the row's float32 total.
//
// Layout: codes are decoded 64 at a time into two bf16 vectors in a fixed lane order (see kPos); each
// activation row is stored in that order, padded with zeros to a multiple of 64, so the dot products pair
// the right elements and a masked tail needs no special case. Rows of any length that is a multiple of 16 work;
// the scale tiles must be whole groups (bk a multiple of 64, or 0).
//
// Algorithm: the same two phases and work split as the AVX2 variant (moe_common.h). An expert routed to at
// most kFusedTokens pairs decodes each 64 codes into registers and uses them at once for all of its pairs
// (reads 1 byte per weight: the memory-bound regime); an expert with one pair (nearly all at T <= 8) has its rows
// decoded four at a time from four sequential streams (fused_tiles); more pairs: four rows at a time are decoded
// into an L1-resident bf16 panel that a 4 x 3 register tile of (row, pair) dot products reuses (prefill).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "moe_common.h"

// Profiling builds pass -DMOE_NOINLINE='__attribute__((noinline))' so perf attributes time to each stage.
#ifndef MOE_NOINLINE
#define MOE_NOINLINE
#endif

namespace {

using moe_w8::Grid;
using moe_w8::Routing;

constexpr int kGroup = 64;        // codes decoded at once
constexpr int kPanelRows = 4;     // rows decoded into the panel at once (prefill)
constexpr int kTokenTile = 3;     // pairs per register tile (prefill)
constexpr int kTokenBlock = 32;   // pairs whose activations stay in L2 while a panel is reused
constexpr int kFusedTokens = 3;   // at most this many pairs: decode into registers, no panel (measured: the panel
                                  // path is 5-9 % faster from 4 pairs on, about equal at 2-3)
constexpr int kPrefetch = 512;    // bytes of codes ahead (fused path)
constexpr int kRowTile = 4;       // rows of lone pairs decoded together (fused path): measured on L1-resident codes,
                                  // 1.2-1.5x one row's speed; two rows gain little, eight spill registers
constexpr int kDecodeChunk1 = 512;  // most rows per phase-1 / phase-2 work item when decoding (see moe_w8_forward)
constexpr int kDecodeChunk2 = 256;
constexpr int kSerialSplitTokens = 64;  // up to this many tokens, x is split into planes before the parallel region

inline int64_t padded(int64_t k) { return (k + kGroup - 1) / kGroup * kGroup; }

// Position, inside its group of 64, of code j after decode64 (two vectors of 32 bf16, four 128-bit lanes each).
inline int pos_in_group(int j) { return 32 * ((j % 16) / 8) + 8 * (j / 16) + j % 8; }

struct Tables {  // bf16 bits of the 128 magnitudes s=0 .eeee.mmm: low bytes and high bytes, 64 per vector
  __m512i lo0, lo1, hi0, hi1;
};

Tables make_tables() {
  alignas(64) uint8_t lo[128], hi[128];
  for (int m = 0; m < 128; ++m) {
    const int e = m >> 3, f = m & 7;
    const float v = e ? std::ldexp(1.0f + f / 8.0f, e - 7) : std::ldexp(f / 8.0f, -6);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    lo[m] = static_cast<uint8_t>(bits >> 16);
    hi[m] = static_cast<uint8_t>(bits >> 24);
  }
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi), _mm512_load_si512(hi + 64)};
}

// 64 codes (fewer: masked, the rest decode to 0) -> bf16 bits in two vectors.
inline void decode64(const uint8_t* src, __mmask64 mask, const Tables& t, __m512i& a, __m512i& b) {
  const __m512i c = _mm512_maskz_loadu_epi8(mask, src);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, c, t.lo1);
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, c, t.hi1);
  hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (c & 0x80)
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

inline __m512 dot(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

inline __m512 bf16_to_fp32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// src: 64 float32 in natural order -> `planes` bf16 planes in decode order (dst + p * plane_stride).
MOE_NOINLINE inline void split_group(const float* src, int planes, uint16_t* dst, int64_t plane_stride) {
  __m512 r[4];
  for (int q = 0; q < 4; ++q) r[q] = _mm512_loadu_ps(src + 16 * q);
  for (int p = 0; p < planes; ++p) {
    __m256i y[4];
    for (int q = 0; q < 4; ++q) {
      y[q] = (__m256i)_mm512_cvtneps_pbh(r[q]);
      r[q] = _mm512_sub_ps(r[q], bf16_to_fp32(y[q]));  // exact residual
    }
    const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(y[0]), y[1], 1);
    const __m512i z23 = _mm512_inserti64x4(_mm512_castsi256_si512(y[2]), y[3], 1);
    uint16_t* d = dst + p * plane_stride;
    _mm512_storeu_si512(d, _mm512_shuffle_i64x2(z01, z23, 0x88));       // 128-bit lanes 0, 2 of each
    _mm512_storeu_si512(d + 32, _mm512_shuffle_i64x2(z01, z23, 0xDD));  // lanes 1, 3
  }
}

// A float32 row of n values -> planes of padded(n) bf16 (zeros past n), tmp: scratch of padded(n) floats.
void split_row(const float* src, int64_t n, int planes, uint16_t* dst, int64_t plane_stride, float* tmp) {
  const int64_t np = padded(n);
  const float* s = src;
  if (np != n) {
    std::memcpy(tmp, src, n * sizeof(float));
    std::memset(tmp + n, 0, (np - n) * sizeof(float));
    s = tmp;
  }
  for (int64_t k = 0; k < np; k += kGroup) split_group(s + k, planes, dst + k, plane_stride);
}

struct Matrix {  // one expert matrix [N, K] of codes with its scale grid
  const uint8_t* codes;
  const float* scales;  // [ceil(N/bn), gk]
  int64_t k, bn, bk, gk;
  int64_t block() const { return bk ? bk : k; }
};

struct Acts {  // the activations of the pairs one matmul serves: planes of padded(k) bf16 each
  const uint16_t* const* rows;  // rows[j]: first plane of pair j
  int planes;
  int64_t plane_stride;
};

inline __mmask64 group_mask(int64_t remaining) {
  return remaining >= kGroup ? ~__mmask64{0} : ((__mmask64{1} << remaining) - 1);
}

// res[j] = dot(row n, activations of pair j) for M pairs, P planes; each 64 codes decoded once, in registers.
// Two accumulators per pair (one per decoded vector) halve the vdpbf16ps dependency chain, which bounds
// the few-pair case.
template <int M, int P>
inline void fused_row_dot(const Matrix& m, int64_t n, const Acts& xs, const Tables& t, float* res) {
  const uint8_t* src = m.codes + n * m.k;
  const float* srow = m.scales + (n / m.bn) * m.gk;
  const int64_t bk = m.block();
  __m512 total[M], part_a[M], part_b[M];
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) total[j] = _mm512_setzero_ps();
  for (int64_t kb = 0, b = 0; kb < m.k; kb += bk, ++b) {
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) part_a[j] = part_b[j] = _mm512_setzero_ps();
    const int64_t kend = std::min(kb + bk, m.k);
    for (int64_t k = kb; k < kend; k += kGroup) {
      _mm_prefetch(reinterpret_cast<const char*>(src + k + kPrefetch), _MM_HINT_T0);
      __m512i a, bv;
      decode64(src + k, group_mask(kend - k), t, a, bv);
#pragma GCC unroll 8
      for (int j = 0; j < M; ++j)
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) {
          const uint16_t* x = xs.rows[j] + p * xs.plane_stride + k;
          part_a[j] = dot(part_a[j], a, x);
          part_b[j] = dot(part_b[j], bv, x + 32);
        }
    }
    const __m512 sc = _mm512_set1_ps(srow[b]);
#pragma GCC unroll 8
    for (int j = 0; j < M; ++j) total[j] = _mm512_fmadd_ps(_mm512_add_ps(part_a[j], part_b[j]), sc, total[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) res[j] = _mm512_reduce_add_ps(total[j]);
}

// One row of a lone pair's dot product on the register path: its codes, its scale row, its pair's first plane.
struct RowTask {
  const uint8_t* codes;
  const float* scales;
  const uint16_t* x;
};

// res[r] = dot(rows[r]) for R rows of k codes (scale tiles of bk columns), P planes each; every 64 codes decoded in
// registers once. R independent sums keep more decode and vdpbf16ps work in flight than one row's chains do.
template <int R, int P>
MOE_NOINLINE inline void fused_rows(const RowTask* rows, int64_t k_len, int64_t bk, int64_t plane_stride,
                                    const Tables& t, float* res) {
  __m512 total[R], part_a[R], part_b[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t kb = 0, b = 0; kb < k_len; kb += bk, ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) part_a[r] = part_b[r] = _mm512_setzero_ps();
    const int64_t kend = std::min(kb + bk, k_len);
    for (int64_t k = kb; k < kend; k += kGroup) {
      const __mmask64 mask = group_mask(kend - k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[r].codes + k + kPrefetch), _MM_HINT_T0);
        __m512i a, bv;
        decode64(rows[r].codes + k, mask, t, a, bv);
#pragma GCC unroll 3
        for (int p = 0; p < P; ++p) {
          part_a[r] = dot(part_a[r], a, rows[r].x + p * plane_stride + k);
          part_b[r] = dot(part_b[r], bv, rows[r].x + p * plane_stride + k + 32);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      total[r] = _mm512_fmadd_ps(_mm512_add_ps(part_a[r], part_b[r]), _mm512_set1_ps(rows[r].scales[b]), total[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) res[r] = _mm512_reduce_add_ps(total[r]);
}

// The tile loop of moe_common.h's row_tiles, written out: through row_tiles' lambda this variant measured 0.94x at
// T = 1 / 4 (native A/B, one thread, cold L3; the same bits), the avx2 variant 0.99-1.01x (it uses row_tiles).
template <int P, class Task, class Emit>
void fused_tiles_p(int64_t total, int64_t k_len, int64_t bk, int64_t plane_stride, const Tables& t, Task task, Emit emit) {
  RowTask rows[kRowTile];
  float res[kRowTile];
  for (int64_t f0 = 0; f0 < total; f0 += kRowTile) {
    const int count = static_cast<int>(std::min<int64_t>(kRowTile, total - f0));
    for (int r = 0; r < count; ++r) rows[r] = task(f0 + r);
    switch (count) {
      case 1: fused_rows<1, P>(rows, k_len, bk, plane_stride, t, res); break;
      case 2: fused_rows<2, P>(rows, k_len, bk, plane_stride, t, res); break;
      case 3: fused_rows<3, P>(rows, k_len, bk, plane_stride, t, res); break;
      default: fused_rows<4, P>(rows, k_len, bk, plane_stride, t, res); break;
    }
    for (int r = 0; r < count; ++r) emit(f0 + r, res[r]);
  }
}

// Rows of lone pairs, kRowTile at a time: task(f) is row f's RowTask, emit(f, value) takes its dot product, for f
// in [0, total). Callers order the rows so that each tile's rows come from different streams of codes (other
// matrices, or rows far apart) and each stream continues in the next tile: the hardware prefetcher follows
// sequential streams, and four adjacent rows per tile (a new stream for three of them every tile) ran at 0.6x.
template <class Task, class Emit>
void fused_tiles(int64_t total, int64_t k_len, int64_t bk, int planes, int64_t plane_stride, const Tables& t, Task task,
                 Emit emit) {
  switch (planes) {
    case 1: fused_tiles_p<1>(total, k_len, bk, plane_stride, t, task, emit); break;
    case 2: fused_tiles_p<2>(total, k_len, bk, plane_stride, t, task, emit); break;
    default: fused_tiles_p<3>(total, k_len, bk, plane_stride, t, task, emit); break;
  }
}

template <int P>
MOE_NOINLINE inline void fused_row_dot_m(int count, const Matrix& m, int64_t n, const Acts& xs, const Tables& t, float* res) {
  static_assert(kFusedTokens == 3, "one case per pair count up to kFusedTokens");
  switch (count) {
    case 1: fused_row_dot<1, P>(m, n, xs, t, res); break;
    case 2: fused_row_dot<2, P>(m, n, xs, t, res); break;
    default: fused_row_dot<3, P>(m, n, xs, t, res); break;
  }
}

// Decode rows [n0, n0 + rows) into panel (row r at panel + r * padded(k), decode order).
MOE_NOINLINE inline void decode_panel(const Matrix& m, int64_t n0, int rows, const Tables& t, uint16_t* panel) {
  const int64_t kp = padded(m.k);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* src = m.codes + (n0 + r) * m.k;
    uint16_t* dst = panel + r * kp;
    for (int64_t k = 0; k < kp; k += kGroup) {
      _mm_prefetch(reinterpret_cast<const char*>(src + kPanelRows * m.k + k), _MM_HINT_T1);  // the next panel's rows
      __m512i a, b;
      decode64(src + k, group_mask(m.k - k), t, a, b);
      _mm512_storeu_si512(dst + k, a);
      _mm512_storeu_si512(dst + k + 32, b);
    }
  }
}

// res[r][j] = dot(panel row r, pair j) for R rows, M pairs, P planes (scale tiles applied per block).
template <int R, int M, int P>
MOE_NOINLINE inline void panel_tile(const Matrix& m, int64_t n0, const uint16_t* panel, const uint16_t* const* xr, const Acts& xs,
                       float res[kPanelRows][kTokenTile]) {
  const int64_t kp = padded(m.k), bk = m.block();
  __m512 total[R][M], part[R][M];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) total[r][j] = _mm512_setzero_ps();
  for (int64_t kb = 0, b = 0; kb < m.k; kb += bk, ++b) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < M; ++j) part[r][j] = _mm512_setzero_ps();
    const int64_t kend = kb + bk >= m.k ? kp : kb + bk;  // the last block runs into the zero padding
    for (int64_t k = kb; k < kend; k += 32) {
      __m512i w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(panel + r * kp + k);
      for (int j = 0; j < M; ++j)
        for (int p = 0; p < P; ++p) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[j] + p * xs.plane_stride + k);
          for (int r = 0; r < R; ++r) part[r][j] = _mm512_dpbf16_ps(part[r][j], (__m512bh)w[r], xv);
        }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_set1_ps(m.scales[((n0 + r) / m.bn) * m.gk + b]);
      for (int j = 0; j < M; ++j) total[r][j] = _mm512_fmadd_ps(part[r][j], sc, total[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) res[r][j] = _mm512_reduce_add_ps(total[r][j]);
}

template <int R, int P>
inline void panel_tile_m(int m_count, const Matrix& m, int64_t n0, const uint16_t* panel, const uint16_t* const* xr,
                         const Acts& xs, float res[kPanelRows][kTokenTile]) {
  switch (m_count) {
    case 1: panel_tile<R, 1, P>(m, n0, panel, xr, xs, res); break;
    case 2: panel_tile<R, 2, P>(m, n0, panel, xr, xs, res); break;
    default: panel_tile<R, 3, P>(m, n0, panel, xr, xs, res); break;
  }
}

template <int P>
inline void panel_tile_any(int rows, int m_count, const Matrix& m, int64_t n0, const uint16_t* panel,
                           const uint16_t* const* xr, const Acts& xs, float res[kPanelRows][kTokenTile]) {
  switch (rows) {
    case 1: panel_tile_m<1, P>(m_count, m, n0, panel, xr, xs, res); break;
    case 2: panel_tile_m<2, P>(m_count, m, n0, panel, xr, xs, res); break;
    case 3: panel_tile_m<3, P>(m_count, m, n0, panel, xr, xs, res); break;
    default: panel_tile_m<4, P>(m_count, m, n0, panel, xr, xs, res); break;
  }
}

// For rows [n0, n1) of mat and pairs xs.rows[0..count): calls emit(pair_index, row, value).
template <int P, class Emit>
void matmul_rows_p(const Matrix& mat, int64_t n0, int64_t n1, const Acts& xs, int64_t count, const Tables& t,
                   uint16_t* panel, Emit emit) {
  if (count <= kFusedTokens) {  // memory-bound: no panel round trip
    float r[kFusedTokens];
    for (int64_t n = n0; n < n1; ++n) {
      fused_row_dot_m<P>(static_cast<int>(count), mat, n, xs, t, r);
      for (int64_t j = 0; j < count; ++j) emit(j, n, r[j]);
    }
    return;
  }
  float res[kPanelRows][kTokenTile];
  for (int64_t t0 = 0; t0 < count; t0 += kTokenBlock) {
    const int64_t t1 = std::min(t0 + kTokenBlock, count);
    for (int64_t n = n0; n < n1; n += kPanelRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, n1 - n));
      decode_panel(mat, n, rows, t, panel);
      for (int64_t j0 = t0, m_count = 0; j0 < t1; j0 += m_count) {
        m_count = t1 - j0 == 4 ? 2 : std::min<int64_t>(kTokenTile, t1 - j0);  // 4 = 2 + 2, not 3 + 1
        panel_tile_any<P>(rows, static_cast<int>(m_count), mat, n, panel, xs.rows + j0, xs, res);
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < m_count; ++j) emit(j0 + j, n + r, res[r][j]);
      }
    }
  }
}

template <class Emit>
void matmul_rows(const Matrix& mat, int64_t n0, int64_t n1, const Acts& xs, int64_t count, const Tables& t,
                 uint16_t* panel, Emit emit) {
  switch (xs.planes) {
    case 1: matmul_rows_p<1>(mat, n0, n1, xs, count, t, panel, emit); break;
    case 2: matmul_rows_p<2>(mat, n0, n1, xs, count, t, panel, emit); break;
    default: matmul_rows_p<3>(mat, n0, n1, xs, count, t, panel, emit); break;
  }
}

}  // namespace

extern "C" {

// Same contract as the AVX2 variant's moe_w8_forward; x_planes: 1 if every x value is a bf16, 2 if a
// float16, 3 for float32; h_planes: bf16 planes of h (2: exact, 1: h rounded to bf16). Returns 1
// (unsupported) unless H, I are multiples of 16 and bk of 64 (or 0).
int moe_w8_forward(const float* x, int x_planes, int h_planes, int64_t T, int64_t H, int64_t I, int64_t E,
                   const uint8_t* w13, const float* w13_s, const uint8_t* w2, const float* w2_s,
                   const void* topk_ids, int ids_are_int32, const float* topk_weights, int64_t K_top,
                   int64_t bn, int64_t bk, float swiglu_limit, int nthreads, float* out, int64_t* bad_id) {
  using namespace moe_w8;
  if (H % 16 || I % 16 || (bk && bk % kGroup) || x_planes < 1 || x_planes > 3 || h_planes < 1 || h_planes > 2) return 1;
  const Grid grid(H, I, bn, bk);
  Routing routing;
  if (!group_by_expert(topk_ids, ids_are_int32, topk_weights, T, K_top, E, routing, bad_id)) return 2;
  const int64_t P = routing.pairs();
  if (P == 0) return 0;
  const int64_t n_active = routing.active();
  const int64_t Hp = padded(H), Ip = padded(I);
  const Tables tables = make_tables();

  // Activation planes: x per token [T][x_planes][Hp], h per pair [P][h_planes][Ip] (each row written once).
  std::unique_ptr<uint16_t[]> xq(new uint16_t[T * x_planes * Hp]);
  std::unique_ptr<uint16_t[]> hq(new uint16_t[P * h_planes * Ip]);
  // Decode (few pairs per expert): longer work items, i.e. longer sequential streams of codes per item (measured
  // 1.05-1.10x at T = 1-8 on one thread); prefill keeps the shorter ones its panels were tuned with.
  const bool decode = P <= kFusedTokens * n_active;
  const int64_t chunk1 = std::max<int64_t>(kGroup, phase1_chunk(n_active, I, nthreads, kGroup, decode ? kDecodeChunk1 : 64));  // whole groups
  const int64_t chunks1 = (I + chunk1 - 1) / chunk1;
  const int64_t items1 = n_active * chunks1;
  const int64_t chunk2 = phase2_chunk(H, nthreads, kPanelRows * 2, decode ? kDecodeChunk2 : 64);
  const int64_t items2 = (H + chunk2 - 1) / chunk2;
  const int threads = threads_for(n_active, H, I, nthreads);

  // Few tokens: split x on the calling thread (a parallel loop's barrier costs more than the work on a busy machine).
  const bool split_serially = T <= kSerialSplitTokens;
  if (split_serially) {
    std::vector<float> tmp(Hp);
    for (int64_t t = 0; t < T; ++t) split_row(x + t * H, H, x_planes, xq.get() + t * x_planes * Hp, Hp, tmp.data());
  }

  struct Scratch {
    std::unique_ptr<uint16_t[]> panel;
    std::vector<float> tmp, gate, up;
    std::vector<const uint16_t*> rows;
  };
  auto make = [&] { return Scratch{std::unique_ptr<uint16_t[]>(new uint16_t[kPanelRows * std::max(Hp, Ip)]),
                                   std::vector<float>(std::max(Hp, chunk1)), {}, {}, {}}; };
  // Phase 0 (many tokens): x split into planes, one token per item.
  auto split_x = [&](int64_t t, Scratch& s) { split_row(x + t * H, H, x_planes, xq.get() + t * x_planes * Hp, Hp, s.tmp.data()); };
  // Phase 1: h[p, i] = silu(gate_i . x_p) * (up_i . x_p), stored as planes; items (expert, chunk of rows).
  auto phase1 = [&](int64_t item, Scratch& s) {
    const int64_t a = item / chunks1, c = item % chunks1;
    const int64_t e = routing.experts[a];
    const int64_t p0 = routing.offsets[a], cnt = routing.offsets[a + 1] - p0;
    const int64_t i0 = c * chunk1, i1 = std::min(I, i0 + chunk1), ni = i1 - i0;
    s.rows.resize(cnt);
    for (int64_t j = 0; j < cnt; ++j) s.rows[j] = xq.get() + routing.tokens[p0 + j] * x_planes * Hp;
    const Acts xs{s.rows.data(), x_planes, Hp};
    s.gate.resize(cnt * ni);
    s.up.resize(cnt * ni);
    const Matrix g{w13 + e * 2 * I * H, w13_s + e * 2 * grid.gI * grid.gH, H, bn, bk, grid.gH};
    const Matrix u{w13 + (e * 2 * I + I) * H, w13_s + (e * 2 * grid.gI + grid.gI) * grid.gH, H, bn, bk, grid.gH};
    float* gp = s.gate.data();
    float* upp = s.up.data();
    if (cnt == 1) {  // tiles of gate row i, up row i, gate row i + ni/2, up row i + ni/2: four sequential streams
      const int64_t half = ni / 2;  // ni is a multiple of 16
      auto row = [&](int64_t f) { return i0 + f / 4 + (f % 4 >= 2 ? half : 0); };
      fused_tiles(2 * ni, H, g.block(), x_planes, Hp, tables,
                  [&](int64_t f) {
                    const Matrix& m = f % 2 ? u : g;
                    return RowTask{m.codes + row(f) * H, m.scales + (row(f) / bn) * grid.gH, s.rows[0]};
                  },
                  [&](int64_t f, float v) { (f % 2 ? upp : gp)[row(f) - i0] = v; });
    } else {
      matmul_rows(g, i0, i1, xs, cnt, tables, s.panel.get(), [&](int64_t j, int64_t n, float v) { gp[j * ni + (n - i0)] = v; });
      matmul_rows(u, i0, i1, xs, cnt, tables, s.panel.get(), [&](int64_t j, int64_t n, float v) { upp[j * ni + (n - i0)] = v; });
    }
    float* tmp = s.tmp.data();
    for (int64_t j = 0; j < cnt; ++j) {
      for (int64_t i = 0; i < ni; ++i) tmp[i] = silu_mul(gp[j * ni + i], upp[j * ni + i], swiglu_limit);
      std::fill(tmp + ni, tmp + padded(ni), 0.0f);  // the zero padding of h past I
      for (int64_t k = 0; k < ni; k += kGroup) split_group(tmp + k, h_planes, hq.get() + (p0 + j) * h_planes * Ip + i0 + k, Ip);
    }
  };
  // Phase 2: out[t, n] += w_p * (down_n . h_p), items own disjoint column ranges n. Experts with one pair: tiles of
  // row n of kRowTile such experts (one sequential stream each), then row n + 1; the others one by one.
  std::vector<int64_t> lone;
  for (int64_t a = 0; a < n_active; ++a)
    if (routing.offsets[a + 1] - routing.offsets[a] == 1) lone.push_back(a);
  auto phase2 = [&](int64_t item, Scratch& s) {
    const int64_t n0 = item * chunk2, n1 = std::min(H, n0 + chunk2);
    for (size_t g0 = 0; g0 < lone.size(); g0 += kRowTile) {
      const int64_t members = std::min<int64_t>(kRowTile, lone.size() - g0);
      auto row = [&](int64_t f) { return n0 + f / members; };
      auto pair = [&](int64_t f) { return routing.offsets[lone[g0 + f % members]]; };
      fused_tiles((n1 - n0) * members, I, bk ? bk : I, h_planes, Ip, tables,
                  [&](int64_t f) {
                    const int64_t e = routing.experts[lone[g0 + f % members]];
                    return RowTask{w2 + (e * H + row(f)) * I, w2_s + (e * grid.gH2 + row(f) / bn) * grid.gI2,
                                   hq.get() + pair(f) * h_planes * Ip};
                  },
                  [&](int64_t f, float v) {
                    out[routing.tokens[pair(f)] * H + row(f)] += routing.weights[pair(f)] * v;
                  });
    }
    for (int64_t a = 0; a < n_active; ++a) {
      const int64_t e = routing.experts[a];
      const int64_t p0 = routing.offsets[a], cnt = routing.offsets[a + 1] - p0;
      if (cnt == 1) continue;
      s.rows.resize(cnt);
      for (int64_t j = 0; j < cnt; ++j) s.rows[j] = hq.get() + (p0 + j) * h_planes * Ip;
      const Acts hs{s.rows.data(), h_planes, Ip};
      const Matrix d{w2 + e * H * I, w2_s + e * grid.gH2 * grid.gI2, I, bn, bk, grid.gI2};
      matmul_rows(d, n0, n1, hs, cnt, tables, s.panel.get(), [&](int64_t j, int64_t n, float v) {
        out[routing.tokens[p0 + j] * H + n] += routing.weights[p0 + j] * v;
      });
    }
  };
  run_phases<Scratch>({split_serially ? 0 : T, items1, items2}, threads, make, [&](int phase, int64_t item, Scratch& s) {
    if (phase == 0) split_x(item, s);
    else if (phase == 1) phase1(item, s);
    else phase2(item, s);
  });
  return 0;
}

}  // extern "C"
