#include "tests/engine/alloc_counter.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "oneapi/dnnl/dnnl.h"

namespace {
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_allocations_in_execute{0};
std::atomic<int64_t> g_executes{0};
// This thread's allocations: an execute on one thread must not count what
// another thread allocates meanwhile (the engine's key-tiled path runs
// executes on several threads at once).
thread_local int64_t t_allocations = 0;
}  // namespace

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  ++t_allocations;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

extern "C" dnnl_status_t __real_dnnl_primitive_execute(const_dnnl_primitive_t, dnnl_stream_t, int,
                                                       const dnnl_exec_arg_t*);
extern "C" dnnl_status_t __wrap_dnnl_primitive_execute(const_dnnl_primitive_t primitive,
                                                       dnnl_stream_t stream, int nargs,
                                                       const dnnl_exec_arg_t* args) {
  const int64_t before = t_allocations;
  const dnnl_status_t status = __real_dnnl_primitive_execute(primitive, stream, nargs, args);
  g_allocations_in_execute.fetch_add(t_allocations - before);
  g_executes.fetch_add(1);
  return status;
}

namespace mha::testing {

AllocationCounts CurrentAllocationCounts() {
  return {g_allocations.load(), g_allocations_in_execute.load(), g_executes.load()};
}

}  // namespace mha::testing
