// oneDNN matmul primitives for the engine: a shape-keyed primitive cache and
// a linear layer whose weights are reordered once. Internal to the engine:
// these throw dnnl::error, which MhaEngine turns into absl::Status.
#ifndef MHA_ENGINE_OPS_ONEDNN_MATMUL_H_
#define MHA_ENGINE_OPS_ONEDNN_MATMUL_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "engine/mutex.h"
#include "engine/ops/lru_cache.h"
#include "engine/ops/primitive_budget.h"
#include "engine/workspace.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {

namespace onednn {
// Short for oneDNN's data type, for the engine's internals only.
using dt = dnnl::memory::data_type;
// Bytes of an activation element: bf16, else f32.
inline size_t ActSize(dt type) { return type == dt::bf16 ? 2 : 4; }
// The process's one oneDNN CPU engine: every MhaEngine's primitives and
// every workspace's stream are made on it, so any workspace can run any
// model's primitives.
const dnnl::engine& CpuEngine();
}  // namespace onednn

// A created primitive and what executing it needs. Immutable; `id` is
// unique in the process (workspaces key their memory objects by it).
struct MatmulPrimitive {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  bool has_bias = false;
  uint64_t id = NewId();

  static uint64_t NewId();
};

// dst = scale * src x weights (+ bias), plain operands of up to 3 dims with
// explicit strides (so heads can be strided views into a projection's
// output). Dims and strides may be DNNL_RUNTIME_DIM_VAL: the primitive then
// serves every shape that agrees with the fixed ones (keep the inner
// dimension and unit strides fixed: oneDNN 2.6 falls back to its reference
// kernel otherwise). Fixed-size, so building, hashing and comparing one allocates
// nothing.
struct MatmulSpec {
  using Dims = std::array<int64_t, 3>;
  onednn::dt src_dt = onednn::dt::f32, wei_dt = onednn::dt::f32, dst_dt = onednn::dt::f32;
  int ndims = 3;
  Dims src_dims{}, src_strides{};
  Dims wei_dims{}, wei_strides{};
  Dims dst_dims{}, dst_strides{};
  float scale = 1.0f;

  dnnl::memory::desc SrcDesc() const;
  dnnl::memory::desc WeightsDesc() const;
  dnnl::memory::desc DstDesc() const;

  friend bool operator==(const MatmulSpec&, const MatmulSpec&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const MatmulSpec& s) {
    return H::combine(std::move(h), s.src_dt, s.wei_dt, s.dst_dt, s.ndims, s.src_dims,
                      s.src_strides, s.wei_dims, s.wei_strides, s.dst_dims, s.dst_strides, s.scale);
  }
};

// The two products of attention. `batch` 0 makes them 2-D (one block);
// DNNL_RUNTIME_DIM_VAL may stand for the batch, rows and keys.
// Scores: q [batch, rows, d] . k [batch, keys, d]^T -> f32 [batch, rows, keys],
// times `scale`.
MatmulSpec AttentionScoresSpec(onednn::dt dt, int64_t batch, int64_t rows, int64_t keys, int64_t d,
                               float scale);
// Context: probs [batch, rows, keys] . v [batch, keys, dv] -> [batch, rows, dv]
// in `out_dt`.
MatmulSpec AttentionContextSpec(onednn::dt dt, onednn::dt out_dt, int64_t batch, int64_t rows,
                                int64_t keys, int64_t dv);

// A plain memory descriptor of `ndims` dims with explicit strides.
dnnl::memory::desc PlainDesc(int ndims, const MatmulSpec::Dims& dims,
                             const MatmulSpec::Dims& strides, onednn::dt type);

// Attributes every engine primitive uses: user scratchpad (so concurrent
// calls never share one), and an optional output scale.
dnnl::primitive_attr MakeAttr(float scale);

// Runs `p` on raw pointers with the workspace's stream and scratchpad.
// Warm calls allocate nothing of ours: the memory objects come from the
// workspace's BoundMemories and only their data handles change.
void ExecuteMatmul(const MatmulPrimitive& p, Workspace& ws, const void* src, const void* weights,
                   const void* bias, void* dst);

// The same for a primitive created with runtime dimensions
// (DNNL_RUNTIME_DIM_VAL): `actual` gives this call's shapes and strides.
void ExecuteMatmul(const MatmulPrimitive& p, const MatmulSpec& actual, Workspace& ws,
                   const void* src, const void* weights, void* dst);

// The oneDNN memory objects one primitive's arguments are passed in.
struct BoundArgs {
  dnnl::memory src, weights, bias, dst, scratchpad;
};

// Memory objects a workspace has created for the primitives it ran, per
// primitive id (and per shape for runtime-shape primitives), so a warm call
// only resets data handles; the least recently used go when it is full.
// Owned by one Workspace; not thread-safe.
class BoundMemories {
 public:
  // The entry for primitive `id` and `shape` (a default MatmulSpec for
  // fixed-shape primitives); `created` tells whether it is new.
  BoundArgs& Find(uint64_t id, const MatmulSpec& shape, bool& created);

 private:
  static constexpr size_t kMaxEntries = 1024;
  LruCache<std::pair<uint64_t, MatmulSpec>, BoundArgs> by_key_{kMaxEntries};
};

// The threads a primitive created on the calling thread is made for: oneDNN
// (OpenMP runtime) fixes a primitive's thread count, work split and
// scratchpad when it is created, from the calling thread's OpenMP setting
// (SetComputeThreads), and runs it on that many threads wherever it is
// executed. The caches below key their primitives by it, so a call runs on
// the threads its caller set, whoever created a primitive of its shape.
int PrimitiveThreads();

// Owns the primitives of one cache by `Key`, the `capacity` most recently
// used, within the process-wide PrimitiveBudget: registered with it while
// alive (it may take the least recently used back) and telling it of each
// one added. A primitive is made outside the lock; when two threads make one
// for the same key, the first cached is the one both use. Thread-safe.
template <typename Key>
class BudgetedPrimitives final : public PrimitiveBudget::Cache {
 public:
  explicit BudgetedPrimitives(size_t capacity) : cache_(capacity) {
    PrimitiveBudget::Get().Register(this);
  }
  ~BudgetedPrimitives() override {
    PrimitiveBudget::Get().Unregister(this);
    PrimitiveBudget::Get().Removed(static_cast<int64_t>(size()));
  }

  // The primitive of `key`, made by `make()` when absent (counted in
  // `made`).
  template <typename Make>
  std::shared_ptr<const MatmulPrimitive> Get(const Key& key, Make make,
                                             std::atomic<uint64_t>& made) {
    PrimitiveBudget& budget = PrimitiveBudget::Get();
    const uint64_t tick = budget.Tick();
    {
      MutexLock lock(mu_);
      if (const auto* found = cache_.Find(key, tick)) return *found;
    }
    std::shared_ptr<const MatmulPrimitive> created = make();
    made.fetch_add(1, std::memory_order_relaxed);
    std::shared_ptr<const MatmulPrimitive> result;
    int64_t added = 0;
    {
      MutexLock lock(mu_);
      const size_t before = cache_.size();
      bool inserted = false;
      std::shared_ptr<const MatmulPrimitive>& entry = cache_.FindOrInsert(key, inserted, tick);
      if (inserted) entry = std::move(created);
      result = entry;
      added = static_cast<int64_t>(cache_.size()) - static_cast<int64_t>(before);
    }
    if (added > 0) budget.Added(added);  // outside the lock: it may evict from here
    return result;
  }
  size_t size() const {
    MutexLock lock(mu_);
    return cache_.size();
  }

  // PrimitiveBudget::Cache.
  uint64_t OldestUse() const override {
    MutexLock lock(mu_);
    return cache_.OldestUse();
  }
  bool EvictOldest() override {
    MutexLock lock(mu_);
    return cache_.EvictOldest();
  }

 private:
  mutable Mutex mu_;
  LruCache<Key, std::shared_ptr<const MatmulPrimitive>> cache_ ABSL_GUARDED_BY(mu_);
};

// Creates each distinct MatmulSpec's primitive once per thread count and
// keeps the `capacity` most recently used, within the process-wide
// PrimitiveBudget (which may take its least recently used ones back).
// Thread-safe.
class MatmulCache final {
 public:
  static constexpr size_t kDefaultCapacity = 4096;
  explicit MatmulCache(const dnnl::engine& engine, size_t capacity = kDefaultCapacity);
  std::shared_ptr<const MatmulPrimitive> Get(const MatmulSpec& spec);
  // Primitives created since construction (lookups that found none).
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  size_t size() const { return primitives_.size(); }

 private:
  dnnl::engine engine_;
  BudgetedPrimitives<std::pair<MatmulSpec, int>> primitives_;  // by (spec, PrimitiveThreads())
  std::atomic<uint64_t> misses_{0};
};

}  // namespace mha

#endif  // MHA_ENGINE_OPS_ONEDNN_MATMUL_H_
