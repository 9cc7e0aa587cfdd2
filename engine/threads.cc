#include "engine/threads.h"

#include <omp.h>

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "engine/mutex.h"
#include "engine/sanitizers.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {

void SetComputeThreads(int n) {
#ifdef MHA_TSAN
  // Debian's libgomp is not built with ThreadSanitizer: its barriers are
  // invisible to it, so every parallel region would be reported as a race.
  // The TSan build checks our threads (gRPC handlers, batcher workers), with
  // one compute thread each.
  n = 1;
#endif
  if (n > 0) omp_set_num_threads(n);
}

namespace {

Mutex call_thread_counts_mu;
std::vector<int>& CallThreadCountsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_thread_counts_mu) {
  static std::vector<int>* counts = new std::vector<int>();
  return *counts;
}

}  // namespace

void SetCallThreadCounts(std::vector<int> counts) {
  MutexLock lock(call_thread_counts_mu);
  CallThreadCountsLocked() = std::move(counts);
}

std::vector<int> CallThreadCounts() {
  MutexLock lock(call_thread_counts_mu);
  return CallThreadCountsLocked();
}

bool CallThreadCountsInclude(int n) {
  MutexLock lock(call_thread_counts_mu);
  const std::vector<int>& counts = CallThreadCountsLocked();
  return std::find(counts.begin(), counts.end(), n) != counts.end();
}

int ComputeThreads() { return omp_get_max_threads(); }

int AvailableCores() {
  const int n = omp_get_num_procs();
  return n > 0 ? n : static_cast<int>(std::thread::hardware_concurrency());
}

bool CpuHasNativeBf16() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

bool CpuHasAmx() { return dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx; }

bool CpuCanComputeBf16() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core || isa == dnnl::cpu_isa::avx512_core_vnni ||
         isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

bool CpuHasInt8Dot() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core_vnni || isa == dnnl::cpu_isa::avx512_core_bf16 ||
         isa == dnnl::cpu_isa::avx512_core_amx || isa == dnnl::cpu_isa::avx2_vnni;
}

}  // namespace mha
