// Shared by every instruction-set variant of the native CPU MoE kernel: the routing (pairs grouped by
// expert), the work split, the scale-grid geometry and the activation. No intrinsics here.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "../../codec/csrc/team.h"

namespace moe_w8 {

// (token, slot) pairs grouped by expert with a stable counting sort (token order kept per expert).
struct Routing {
  std::vector<int64_t> experts;  // active experts, ascending
  std::vector<int64_t> offsets;  // pairs of experts[a] are [offsets[a], offsets[a + 1])
  std::vector<int64_t> tokens;   // token of each grouped pair
  std::vector<float> weights;    // routing weight of each grouped pair
  int64_t pairs() const { return offsets.back(); }
  int64_t active() const { return static_cast<int64_t>(experts.size()); }
};

// Returns false (and *bad_id) when an id >= E; ids < 0 are routes to experts not on this rank.
inline bool group_by_expert(const void* topk_ids, bool ids_are_int32, const float* topk_weights, int64_t T,
                            int64_t k_top, int64_t E, Routing& r, int64_t* bad_id) {
  const int64_t n_pairs = T * k_top;
  auto id_at = [&](int64_t p) -> int64_t {
    return ids_are_int32 ? static_cast<const int32_t*>(topk_ids)[p] : static_cast<const int64_t*>(topk_ids)[p];
  };
  std::vector<int64_t> count(E + 1, 0), start(E, 0);
  for (int64_t p = 0; p < n_pairs; ++p) {
    const int64_t e = id_at(p);
    if (e >= E) { *bad_id = e; return false; }
    if (e >= 0) ++count[e];
  }
  r.offsets.assign(1, 0);
  for (int64_t e = 0; e < E; ++e)
    if (count[e]) {
      start[e] = r.offsets.back();
      r.experts.push_back(e);
      r.offsets.push_back(r.offsets.back() + count[e]);
    }
  r.tokens.resize(r.pairs());
  r.weights.resize(r.pairs());
  for (int64_t p = 0; p < n_pairs; ++p) {
    const int64_t e = id_at(p);
    if (e < 0) continue;
    const int64_t q = start[e]++;
    r.tokens[q] = p / k_top;
    r.weights[q] = topk_weights[p];
  }
  return true;
}

// Scale grid of the two expert matrices: w13 [2I, H] on (bn, bk) tiles, w2 [H, I] likewise; bk == 0: whole rows.
struct Grid {
  int64_t gI, gH, gH2, gI2;
  Grid(int64_t H, int64_t I, int64_t bn, int64_t bk)
      : gI((I + bn - 1) / bn), gH(bk ? (H + bk - 1) / bk : 1), gH2((H + bn - 1) / bn), gI2(bk ? (I + bk - 1) / bk : 1) {}
};

// Rows per phase-1 work item (expert, chunk of intermediate rows): enough items to keep every thread busy.
// max_chunk: the avx512bf16 variant's register path asks for longer items (longer sequential streams of codes).
inline int64_t phase1_chunk(int64_t n_active, int64_t I, int nthreads, int64_t min_chunk, int64_t max_chunk = 64) {
  int64_t chunk = max_chunk;
  while (chunk > min_chunk && n_active * ((I + chunk - 1) / chunk) < 4 * nthreads) chunk /= 2;
  return chunk;
}

// Rows of W2 (output columns) per phase-2 work item.
inline int64_t phase2_chunk(int64_t H, int nthreads, int64_t min_chunk, int64_t max_chunk = 64) {
  int64_t chunk = max_chunk;
  while (chunk > min_chunk && (H + chunk - 1) / chunk < 8 * nthreads) chunk /= 2;
  return chunk;
}

// Waking a thread costs more than a small call's whole work (and much more on a busy machine):
// below ~1 MB of routed codes, run on the calling thread only.
inline int threads_for(int64_t n_active, int64_t H, int64_t I, int nthreads) {
  return n_active * 3 * I * H < (int64_t{1} << 20) ? 1 : std::max(1, nthreads);
}

// Work items in up to kMaxPhases phases, run by a team of the process's OpenMP threads (team.h: the threads the
// host bound to its CPUs, the calling thread among them). Items are claimed from atomic counters; phase p + 1
// starts once every item of phase p is done (release/acquire on the done counters publishes what the items
// wrote), so a team thread that starts late finds less or nothing to do. Scratch is made lazily, once per
// thread that claims an item.
constexpr int kMaxPhases = 3;

template <class Scratch>
struct PhasedWork {
  int phases = 0;
  int64_t items[kMaxPhases] = {};
  std::atomic<int64_t> next[kMaxPhases], done[kMaxPhases];
  std::function<Scratch()> make;
  std::function<void(int, int64_t, Scratch&)> body;

  void work() {
    std::optional<Scratch> scratch;
    for (int p = 0; p < phases; ++p) {
      if (p)
        while (done[p - 1].load(std::memory_order_acquire) < items[p - 1]) std::this_thread::yield();
      for (int64_t i; (i = next[p].fetch_add(1, std::memory_order_relaxed)) < items[p];) {
        if (!scratch) scratch.emplace(make());
        body(p, i, *scratch);
        done[p].fetch_add(1, std::memory_order_release);
      }
    }
  }
};

template <class Scratch>
void run_phases(std::initializer_list<int64_t> items, int threads, std::function<Scratch()> make,
                std::function<void(int, int64_t, Scratch&)> body) {
  PhasedWork<Scratch> job;
  for (int64_t n : items) {
    job.next[job.phases] = 0;
    job.done[job.phases] = 0;
    job.items[job.phases++] = n;
  }
  job.make = std::move(make);
  job.body = std::move(body);
  vllm_moe_w8_team::run(threads, [&job] { job.work(); });
}

// Rows taken kTile at a time (fewer in the last tile) for f in [0, total): rows[r] = task(f0 + r), run(count, rows, res)
// computes their dot products into res, emit(f0 + r, res[r]) takes each. Callers order the rows so that each tile's rows
// come from different streams of codes (other matrices, or rows far apart) and each stream goes on in the next tile:
// the hardware prefetcher follows sequential streams (four adjacent rows per tile ran at 0.6x on avx512bf16).
template <int kTile, class Row, class Task, class Run, class Emit>
void row_tiles(int64_t total, Task task, Run run, Emit emit) {
  Row rows[kTile];
  float res[kTile];
  for (int64_t f0 = 0; f0 < total; f0 += kTile) {
    const int count = static_cast<int>(std::min<int64_t>(kTile, total - f0));
    for (int r = 0; r < count; ++r) rows[r] = task(f0 + r);
    run(count, rows, res);
    for (int r = 0; r < count; ++r) emit(f0 + r, res[r]);
  }
}

inline float silu_mul(float g, float u, float limit) {
  if (limit > 0.0f) {
    g = std::min(g, limit);
    u = std::max(std::min(u, limit), -limit);
  }
  return g / (1.0f + std::exp(-g)) * u;
}

}  // namespace moe_w8
