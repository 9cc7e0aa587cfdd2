#include "engine/threads.h"

#include <omp.h>

#include <thread>

namespace mha {

void SetComputeThreads(int n) {
  if (n > 0) omp_set_num_threads(n);
}

int AvailableCores() {
  const int n = omp_get_num_procs();
  return n > 0 ? n : static_cast<int>(std::thread::hardware_concurrency());
}

}  // namespace mha
