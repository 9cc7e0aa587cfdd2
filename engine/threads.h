// How many threads the engine's math uses on the calling thread.
#ifndef MHA_ENGINE_THREADS_H_
#define MHA_ENGINE_THREADS_H_

namespace mha {

// Sets the number of threads oneDNN and the engine's kernels use for calls
// made from the current thread (an OpenMP setting, per calling thread).
// n <= 0 leaves the default (all cores).
void SetComputeThreads(int n);

// Cores this process may use.
int AvailableCores();

}  // namespace mha

#endif  // MHA_ENGINE_THREADS_H_
