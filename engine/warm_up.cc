// MhaEngine::WarmUp and EngineImpl::PrimitiveCacheMisses: creating at load the oneDNN
// primitives that requests of known lengths will need (for each thread count
// calls run with), and counting those created later, on the request path.
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"
#include "engine/mha_engine.h"
#include "engine/thread_choice.h"
#include "engine/threads.h"
#include "engine/workspace.h"

namespace mha {

absl::Status MhaEngine::WarmUp(absl::Span<const int64_t> lengths) const {
  const ScopedAllThreads cold_calls;  // their times say nothing of warm ones
  std::vector<int> thread_counts = CallThreadCounts();
  if (thread_counts.empty()) return WarmUpOnThisThread(lengths);
  const int own = ComputeThreads();
  absl::Status status;
  for (const int threads : thread_counts) {
    SetComputeThreads(threads);
    status = WarmUpOnThisThread(lengths);
    if (!status.ok()) break;
  }
  SetComputeThreads(own);
  return status;
}

absl::Status MhaEngine::WarmUpOnThisThread(absl::Span<const int64_t> lengths) const {
  const absl::Status made = GuardEngineCall([&] { impl_->MakeRuntimePrimitives(); });
  if (!made.ok()) return made;
  const AttentionDims& d = dims();
  const bool self = d.kdim == d.embed_dim && d.vdim == d.embed_dim;
  const bool value_is_key = d.kdim == d.vdim;
  std::unique_ptr<Workspace> ws = NewWorkspace();
  for (const int64_t len : lengths) {
    // Zeros: the primitives depend on the shapes only.
    const std::vector<float> query(len * d.embed_dim, 0.0f);
    const std::vector<float> key(self ? 0 : len * d.kdim, 0.0f);
    const std::vector<float> value(self || value_is_key ? 0 : len * d.vdim, 0.0f);
    std::vector<float> output(len * d.embed_dim);
    AttentionBatch batch;
    batch.kind = self           ? AttentionKind::kSelf
                 : value_is_key ? AttentionKind::kCrossValueIsKey
                                : AttentionKind::kCross;
    batch.query = query;
    batch.key = key;
    batch.value = value;
    batch.q_offsets = {0, len};
    batch.kv_offsets = {0, self ? 0 : len};
    const absl::Status status = Run(batch, {absl::MakeSpan(output), {}, false}, *ws);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("warm-up at length ", len, ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

uint64_t EngineImpl::PrimitiveCacheMisses() const {
  uint64_t misses = sequences_->PrimitiveCacheMisses();
  for (const auto* layer : {&qkv_, &q_, &kv_, &k_, &v_, &out_}) {
    if (*layer != nullptr) misses += (*layer)->misses();
  }
  return misses;
}

int64_t EngineImpl::WeightBytes() const {
  int64_t bytes = 0;
  for (const auto* layer : {&qkv_, &q_, &kv_, &k_, &v_, &out_}) {
    if (*layer != nullptr) bytes += (*layer)->bytes();
  }
  return bytes;
}

}  // namespace mha
