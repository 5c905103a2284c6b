// Running work on a team of the process's OpenMP threads (shared by the native repack and the native MoE kernel).
//
// The libraries are built with -fopenmp and loaded after torch, so they use torch's libgomp (same soname): the
// team is the pool every torch op runs on. That matters under vLLM's CPU worker, which binds each OpenMP thread to
// one CPU (OMP_PLACES + OMP_PROC_BIND, or GOMP_CPU_AFFINITY): a thread the library made itself would inherit the
// calling thread's one-CPU mask, so "helper" threads would all share the caller's CPU, and they would compete with
// the pool's threads, which spin for a while after each region. The team's threads are bound to the CPUs the host
// gave the process and are usually still spinning when the call arrives.
// Callers hand out their work items from atomic counters, so a team thread that starts late finds less to do; the
// region still ends when every team thread has arrived, as every torch op's does.
#pragma once

#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>

namespace vllm_moe_w8_team {

// The CPUs (ids below 64) that threads of any team ran on since the last team_cpus_seen(): a test's window on
// where the work went (under a binding, each team thread can only run on its own CPU).
inline std::atomic<uint64_t>& cpus_seen() {
  static std::atomic<uint64_t> mask{0};
  return mask;
}

inline void note_cpu() {
  const int cpu = sched_getcpu();
  if (cpu >= 0 && cpu < 64) cpus_seen().fetch_or(uint64_t{1} << cpu, std::memory_order_relaxed);
}

// f() on each of `threads` team threads (the calling thread is one of them); returns when all have returned.
template <class F>
void run(int threads, F&& f) {
  if (threads <= 1) {
    note_cpu();
    f();
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    note_cpu();
    f();
  }
}

}  // namespace vllm_moe_w8_team

// One definition per library (each library is one translation unit including this header).
extern "C" __attribute__((visibility("default"))) uint64_t team_cpus_seen(int reset) {
  return reset ? vllm_moe_w8_team::cpus_seen().exchange(0) : vllm_moe_w8_team::cpus_seen().load();
}
