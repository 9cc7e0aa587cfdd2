#include "server/scheduling/split_attend.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/kv_cache.h"
#include "engine/mutex.h"
#include "engine/ragged_batch.h"

namespace mha::server {
namespace {

// What the projection and the chunks of one split request share: the call
// (answered once, under mu), the projected keys and values (read-only once
// projected) and the output rows, which each chunk writes its own part of.
// Thread-safe: chunks may finish on different workers.
struct SplitState {
  SplitState(int64_t kv_len, const MhaEngine& e, const ModelMetrics& m, ModelStatistics* s)
      : engine(e),
        metrics(m),
        statistics(s),
        layout(e.kv_layout()),
        pool(layout.BlocksFor(kv_len) * layout.block_bytes()),
        cache(layout, pool) {}

  // Answers with `status` unless answered; counts a drop once.
  void Fail(const absl::Status& status, const char* dropped = nullptr) {
    MutexLock lock(mu);
    if (call->answered()) return;
    if (dropped != nullptr) call->CountDropped(metrics, dropped);
    call->Fail(status);
  }
  // A chunk's rows are in: the last one answers.
  void ChunkDone(absl::Duration compute) {
    MutexLock lock(mu);
    computing += compute;
    if (--chunks_left > 0 || call->answered()) return;
    const AttentionRequest& in = call->input();
    if (FirstNonFinite(output) >= 0) {
      call->Fail(absl::InvalidArgumentError(
          "inputs too large: the attention overflows float32 (non-finite result)"));
      return;
    }
    const absl::Time answering = absl::Now();
    metrics.tokens->Increment(static_cast<double>(in.tokens()));
    const absl::Status answer = call->Prepare(AttentionResult{output, {}, nullptr, {}});
    if (answer.ok() && statistics != nullptr) {
      // One execution of one request: its projection and chunks' compute.
      ModelStatistics::Call record;
      record.batch_requests = record.batch_rows = 1;
      record.infer = computing;
      const absl::Time now = absl::Now();
      record.output = now - answering;
      record.AddAnswer(now - call->arrived, call->waited, 1);
      statistics->Record(record);
      call->counted = true;
    }
    call->Answer(answer);
  }

  Mutex mu;
  // Set once; answered under mu (the analysis cannot guard a pointee's
  // state: answered() and Answer are read and called with mu held).
  std::unique_ptr<AttendCall> call;
  const MhaEngine& engine;
  const ModelMetrics& metrics;
  ModelStatistics* const statistics;
  const KvLayout layout;
  KvBlockPool pool;
  KvCache cache;              // written by the projection only
  std::vector<float> output;  // [q_len, embed_dim]
  int64_t chunks_left ABSL_GUARDED_BY(mu) = 0;
  absl::Duration computing ABSL_GUARDED_BY(mu);
};

// Rows [begin, begin + rows) of the request's query, attending to the
// projected keys and values as a cross session's step does. Owns a share
// of the state. Not thread-safe (one owner at a time).
class Chunk final : public StepTask {
 public:
  Chunk(std::shared_ptr<SplitState> state, int64_t begin, int64_t rows)
      : state_(std::move(state)), begin_(begin), rows_(rows) {
    deadline = state_->call->deadline;
  }
  // One chunk of a request per engine call: they share one cache.
  const void* session() const override { return state_.get(); }
  int64_t tokens() const override { return rows_; }
  bool attend_rows() const override { return true; }
  bool Cancelled() const override { return state_->call->Cancelled(); }
  void CountDropped(const ModelMetrics&, const char*) override {}  // counted by Fail
  Start Begin(StepPlan& plan, absl::Status& why) override {
    {
      MutexLock lock(state_->mu);
      if (state_->call->answered()) {  // an earlier chunk failed: nothing to compute
        why = absl::AbortedError("the request already failed");
        return Start::kRefused;
      }
    }
    const int64_t e = state_->engine.dims().embed_dim;
    plan.step = CacheStep{&state_->cache, rows_, /*cross=*/true};
    plan.query = state_->call->input().batch().query.subspan(begin_ * e, rows_ * e);
    plan.need_weights = false;
    plan.keys = state_->cache.length() + state_->engine.dims().extra_keys();
    started_ = absl::Now();
    return Start::kRun;
  }
  absl::Status Allocate() override { return absl::OkStatus(); }  // reads, appends nothing
  void Abandon() override {}
  void Finish(const absl::Status& status, absl::Span<const float> output,
              absl::Span<const float>) override {
    if (!status.ok()) return state_->Fail(status);
    const int64_t e = state_->engine.dims().embed_dim;
    std::memcpy(state_->output.data() + begin_ * e, output.data(), rows_ * e * sizeof(float));
    state_->ChunkDone(absl::Now() - started_);
  }
  void Fail(const absl::Status& status) override {
    const char* reason = status.code() == absl::StatusCode::kCancelled          ? "cancelled"
                         : status.code() == absl::StatusCode::kDeadlineExceeded ? "deadline"
                                                                                : nullptr;
    state_->Fail(status, reason);
  }

 private:
  std::shared_ptr<SplitState> state_;
  const int64_t begin_, rows_;
  absl::Time started_;
};

// Projects the request's keys and values, then queues its chunks.
class SplitProjection final : public ProjectionTask {
 public:
  SplitProjection(std::shared_ptr<SplitState> state, int64_t chunk_rows, QueueChunks queue)
      : state_(std::move(state)), chunk_rows_(chunk_rows), queue_(std::move(queue)) {}
  bool Cancelled() const override { return state_->call->Cancelled(); }
  void CountDropped(const ModelMetrics& model, const char* reason) override {
    MutexLock lock(state_->mu);
    state_->call->CountDropped(model, reason);
  }
  void Fail(const absl::Status& status) override { state_->Fail(status); }
  void Run(Workspace& ws) override {
    try {
      RunOrThrow(ws);
    } catch (const std::bad_alloc&) {
      state_->Fail(absl::ResourceExhaustedError(
          "out of memory while computing this request's batch; retry later"));
    }
  }

 private:
  void RunOrThrow(Workspace& ws) {
    SplitState& s = *state_;
    const AttentionRequest& in = s.call->input();
    const AttentionBatch& batch = in.batch();
    const absl::Time start = absl::Now();
    // Self-attention: the query is the key and the value.
    const absl::Span<const float> key = batch.self_attention() ? batch.query : batch.key;
    const absl::Span<const float> value =
        batch.kind == AttentionKind::kCross ? batch.value : absl::Span<const float>();
    absl::Status status = s.cache.Reserve(in.kv_len());
    if (status.ok()) {
      status = s.engine.ProjectEncoderMemory(key, value, in.kv_len(), batch.key_padding_mask,
                                             s.cache, ws);
    }
    MhaEngine::ReleaseLargeWorkspace(ws);
    if (!status.ok()) return s.Fail(status);
    const int64_t q_len = in.q_len();
    s.output.resize(q_len * s.engine.dims().embed_dim);
    std::vector<std::unique_ptr<StepTask>> chunks;
    for (int64_t begin = 0; begin < q_len; begin += chunk_rows_) {
      chunks.push_back(
          std::make_unique<Chunk>(state_, begin, std::min(chunk_rows_, q_len - begin)));
    }
    {
      MutexLock lock(s.mu);
      s.chunks_left = static_cast<int64_t>(chunks.size());
      s.computing = absl::Now() - start;
    }
    queue_(std::move(chunks));
  }

  std::shared_ptr<SplitState> state_;
  const int64_t chunk_rows_;
  QueueChunks queue_;
};

}  // namespace

bool Splittable(const AttentionRequest& request, const MhaEngine& engine) {
  const AttentionBatch& batch = request.batch();
  const AttentionDims& dims = engine.dims();
  return request.rows() == 1 && !request.need_weights() && !batch.attn_mask.present() &&
         !batch.is_causal && dims.kv_elem_bytes() == (dims.bf16 ? 2 : 4) &&
         (batch.self_attention() ? engine.CanAppendSelf() : true);
}

std::unique_ptr<ProjectionTask> SplitAttendCall(std::unique_ptr<AttendCall>& call,
                                                const MhaEngine& engine, int64_t chunk_rows,
                                                QueueChunks queue, const ModelMetrics& metrics,
                                                ModelStatistics* statistics) {
  auto state = std::make_shared<SplitState>(call->input().kv_len(), engine, metrics, statistics);
  auto task =
      std::make_unique<SplitProjection>(state, std::max<int64_t>(1, chunk_rows), std::move(queue));
  state->call = std::move(call);  // nothing allocates from here
  task->deadline = state->call->deadline;
  return task;
}

}  // namespace mha::server
