// How many threads the engine's math uses on the calling thread, and what
// the CPU offers it.
#ifndef MHA_ENGINE_THREADS_H_
#define MHA_ENGINE_THREADS_H_

#include <vector>

namespace mha {

// Sets the number of threads oneDNN and the engine's kernels use for calls
// made from the current thread (an OpenMP setting, per calling thread).
// n <= 0 leaves the default (all cores).
void SetComputeThreads(int n);

// The thread counts this process's engine calls run with, for warm-up:
// MhaEngine::WarmUp creates its primitives for each (a oneDNN primitive runs
// on the threads it was created for; see PrimitiveThreads). The server's
// worker pool sets them at start (a call's share of the cores, and all of
// them); empty, the default: the calling thread's count only. Thread-safe.
void SetCallThreadCounts(std::vector<int> counts);
std::vector<int> CallThreadCounts();
// Whether `n` is one of them (allocates nothing).
bool CallThreadCountsInclude(int n);

// The calling thread's setting (what SetComputeThreads last set, or all
// cores).
int ComputeThreads();

// Cores this process may use.
int AvailableCores();

// Whether oneDNN finds bf16 instructions on this CPU (AVX512-BF16 or AMX).
// Without them bf16 compute is emulated and slower than fp32.
bool CpuHasNativeBf16();

// Whether oneDNN's products run on AMX tiles here (several times the
// AVX512-BF16 pair dot product's rate).
bool CpuHasAmx();

// Whether oneDNN can compute in bf16 here at all: its bf16 kernels (2.6)
// need AVX-512 (avx512_core, emulating bf16 without AVX512-BF16); below it
// no bf16 matmul can be created, and MhaEngine computes such models in fp32.
bool CpuCanComputeBf16();

// Whether oneDNN finds int8 dot-product instructions here (AVX512-VNNI,
// AVX-VNNI or AMX-INT8). Without them an int8 product sums pairs in 16
// bits, which a u8 x s8 pair can overflow: MhaEngine computes int8 models'
// projections in the core's type there.
bool CpuHasInt8Dot();

}  // namespace mha

#endif  // MHA_ENGINE_THREADS_H_
