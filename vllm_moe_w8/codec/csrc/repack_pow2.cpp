// The pow2 repack (vllm_moe_w8/codec/fp8.py, mode "pow2") in one read and one write of the bytes per tile row.
//
// Built at first use by vllm_moe_w8/codec/repack_native.py (g++ -O3 [-mavx2]; plain C++ vectorised by the
// compiler, a team of the process's OpenMP threads: team.h), loaded with ctypes. Same bytes as the numpy body (repack_numpy.py), byte for byte:
//   a tile whose largest magnitude code is >= 0x78 (e4m3fn-only) is halved: magnitudes >= 0x10 lose one
//   exponent step (code - 8, exact); below 0x10 the magnitude is the value in units of 2^-9 and its half is
//   rounded to nearest even, which is again its own code; the sign bit is kept. Other tiles are copied.
// Per tile it reports the largest magnitude code (the caller refuses 0x7F, NaN) and, for a halved tile, how
// many values were rounded (odd magnitudes below 0x10).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "team.h"

namespace {

inline uint8_t halve(uint8_t c) {
  const uint8_t m = c & 0x7F;
  const uint8_t h = m >> 1;
  const uint8_t small = static_cast<uint8_t>((h + (m & h & 1)) | (c & 0x80));
  return m >= 0x10 ? static_cast<uint8_t>(c - 8) : small;
}

// Halve src[c0, c1) into dst, adding 1 to cc[c] for each rounded value (odd magnitude below 0x10). Most
// 64-byte groups hold no magnitude below 0x10 (exponent bits 0): those are one subtraction per byte.
inline void halve_tile_row(const uint8_t* src, uint8_t* dst, uint16_t* cc, int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 64 <= c1; c += 64) {
    uint8_t small = 0;
    for (int i = 0; i < 64; ++i) small |= static_cast<uint8_t>((src[c + i] & 0x70) == 0);
    if (!small) {
      for (int i = 0; i < 64; ++i) dst[c + i] = static_cast<uint8_t>(src[c + i] - 8);
      continue;
    }
    for (int i = 0; i < 64; ++i) {
      const uint8_t v = src[c + i];
      dst[c + i] = halve(v);
      cc[c + i] += static_cast<uint16_t>((((v & 0x7F) < 0x10) ? 1 : 0) & v);
    }
  }
  for (; c < c1; ++c) {
    const uint8_t v = src[c];
    dst[c] = halve(v);
    cc[c] += static_cast<uint16_t>((((v & 0x7F) < 0x10) ? 1 : 0) & v);
  }
}

// One tile row g: pass 1 finds each tile's largest magnitude (column maxima first, so the inner loop is a plain
// byte-vector loop), pass 2 (the tile row now in cache) halves the shifted tiles and copies the others.
struct Repack {
  const uint8_t* in;
  uint8_t* out;
  int64_t n, k, bn, bk, gn, gk;
  uint8_t* tile_max;
  int64_t* rounded;

  void tile_row(int64_t g, uint8_t* cm, uint16_t* cc) const {
    const int64_t r0 = g * bn, r1 = std::min(n, r0 + bn);
    uint8_t* tmax = tile_max + g * gk;
    int64_t* tround = rounded + g * gk;
    std::fill(cm, cm + k, 0);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = in + r * k;
      for (int64_t c = 0; c < k; ++c) cm[c] = std::max<uint8_t>(cm[c], src[c] & 0x7F);
    }
    for (int64_t j = 0; j < gk; ++j) {
      uint8_t m = 0;
      for (int64_t c = j * bk; c < std::min(k, (j + 1) * bk); ++c) m = std::max(m, cm[c]);
      tmax[j] = m;
      tround[j] = 0;
    }
    auto flush_counts = [&] {
      for (int64_t j = 0; j < gk; ++j) {
        int64_t sum = 0;
        for (int64_t c = j * bk; c < std::min(k, (j + 1) * bk); ++c) sum += cc[c];
        tround[j] += sum;
      }
      std::fill(cc, cc + k, 0);
    };
    std::fill(cc, cc + k, 0);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = in + r * k;
      uint8_t* dst = out + r * k;
      for (int64_t j = 0; j < gk; ++j) {
        const int64_t c0 = j * bk, c1 = std::min(k, c0 + bk);
        if (tmax[j] < 0x78) std::memcpy(dst + c0, src + c0, c1 - c0);
        else halve_tile_row(src, dst, cc, c0, c1);
      }
      if ((r - r0) % 65535 == 65534) flush_counts();  // uint16 column counts never overflow
    }
    flush_counts();
  }
};

// Tile rows handed out by an atomic counter to the team's threads (a thread that starts late finds fewer rows).
struct Job {
  Repack task;
  std::atomic<int64_t> next{0};

  void work() {
    std::vector<uint8_t> cm(task.k);
    std::vector<uint16_t> cc(task.k);
    for (int64_t g; (g = next.fetch_add(1)) < task.gn;) {
      task.tile_row(g, cm.data(), cc.data());
    }
  }
};

}  // namespace

extern "C" {

// in/out: [n, k] bytes (row-major); tiles (bn, bk), bk == k for whole rows; tile_max, rounded: [gn, gk].
// Up to nthreads team threads (one per ~1 MB).
void repack_pow2(const uint8_t* in, uint8_t* out, int64_t n, int64_t k, int64_t bn, int64_t bk,
                 uint8_t* tile_max, int64_t* rounded, int nthreads) {
  const int64_t gn = (n + bn - 1) / bn, gk = (k + bk - 1) / bk;
  Job job;
  job.task = Repack{in, out, n, k, bn, bk, gn, gk, tile_max, rounded};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>({int64_t{nthreads}, n * k >> 20, gn}));
  vllm_moe_w8_team::run(static_cast<int>(threads), [&job] { job.work(); });
}

}  // extern "C"
