#include "server/scheduling/batcher.h"

#include <malloc.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <new>
#include <optional>
#include <shared_mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/mha_engine.h"
#include "engine/threads.h"

namespace mha::server {

namespace {

std::unique_ptr<WorkerPool> OwnPool(const BatcherOptions& o) {
  if (o.pool != nullptr) return nullptr;
  return std::make_unique<WorkerPool>(WorkerPoolOptions{
      .workers = o.workers, .compute_threads = o.compute_threads, .clock = o.clock});
}

}  // namespace

Batcher::Batcher(std::string model, const MhaEngine& engine, BatcherOptions options,
                 ModelMetrics& metrics)
    : model_(std::move(model)),
      engine_(engine),
      options_(options),
      metrics_(metrics),
      clock_(options.clock != nullptr ? *options.clock : RealClock::Get()),
      own_pool_(OwnPool(options)),
      pool_(options.pool != nullptr ? *options.pool : *own_pool_),
      max_batch_tokens_(options.max_batch_tokens > 0
                            ? options.max_batch_tokens
                            : BatcherOptions::kTokensPerThread * pool_.ThreadsPerCall()),
      tokens_with_steps_(options.max_batch_tokens_with_steps > 0
                             ? std::min(options.max_batch_tokens_with_steps, max_batch_tokens_)
                             : max_batch_tokens_),
      reported_misses_(engine.PrimitiveCacheMisses()) {  // warm-up misses are not counted
  registration_ = pool_.Attach(this);
}

Batcher::~Batcher() {
  Stop();
  pool_.Detach(registration_);
}

void Batcher::Enqueue(std::unique_ptr<AttendCall> request) {
  absl::Status admitted;
  try {
    admitted = Admit(request);
  } catch (const std::bad_alloc&) {  // the queue could not grow: nothing changed
    admitted = absl::ResourceExhaustedError("out of memory queueing the request; retry later");
  }
  if (!admitted.ok()) {
    request->Fail(admitted);  // outside the lock
    return;
  }
  pool_.Wake(registration_);
}

absl::Status Batcher::Admit(std::unique_ptr<AttendCall>& request) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_size) {
    metrics_.CountDropped("queue_full");
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", model_, "': queue full (", options_.max_queue_size, " requests waiting)"));
  }
  if (queued_bytes_ + request->input().wire_bytes() > options_.max_queue_bytes) {
    metrics_.CountDropped("queue_full");
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", model_, "': queue full (", queued_bytes_, " bytes waiting, this request ",
        request->input().wire_bytes(), ", limit ", options_.max_queue_bytes, ")"));
  }
  MemoryBudget* memory = options_.memory;
  if (memory != nullptr && !memory->TryReserveQueued(request->queued_bytes, *request->memory)) {
    metrics_.CountDropped("memory");
    return absl::ResourceExhaustedError(absl::StrCat(
        "server memory budget full: requests in flight hold ", WithCommas(memory->reserved()),
        " of ", WithCommas(memory->capacity()), " bytes and this one needs ",
        WithCommas(request->queued_bytes), " to wait in the queue; retry later"));
  }
  request->enqueued = clock_.Now();
  const int64_t tokens = request->input().tokens(), bytes = request->input().wire_bytes();
  // Behind every request of its level or a higher one (a lower number).
  const uint64_t levels = options_.priority_levels;
  const uint64_t asked = request->priority;
  request->priority = levels == 0 ? 0
                      : (asked == 0 || asked > levels) ? options_.default_priority_level
                                                       : asked;
  auto behind = queue_.end();
  while (behind != queue_.begin() && (*std::prev(behind))->priority > request->priority) {
    --behind;
  }
  queue_.insert(behind, std::move(request));  // if it throws, nothing has changed
  queued_tokens_ += tokens;
  queued_bytes_ += bytes;
  metrics_.queue_depth->Set(static_cast<double>(queue_.size()));
  return absl::OkStatus();
}

void Batcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  pool_.Wake(registration_);  // what is queued goes now
  std::unique_lock<std::mutex> lock(mu_);
  drained_cv_.wait(lock, [this] { return Drained(); });
}

bool Batcher::Drained() const {
  return queue_.empty() && tasks_.empty() && !steps_queued_ && in_flight_ == 0;
}

void Batcher::SetStepSource(StepSource* source) {
  {
    std::shared_lock<std::shared_mutex> lock(source_mu_);
    if (source_ == source) return;
  }
  std::unique_lock<std::shared_mutex> lock(source_mu_);
  source_ = source;
}

void Batcher::StepsQueued() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    steps_queued_ = true;
  }
  pool_.Wake(registration_, /*steps=*/true);
}

bool Batcher::RunOnWorker(std::function<void(Workspace&)> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
  }
  pool_.Wake(registration_);
  return true;
}

// A batch may close: it is full, its oldest request waited long enough, or
// batching is off, or the batcher is draining, or session steps go now.
// Requests that cannot join the oldest one's batch (another signature) do
// not fill it.
bool Batcher::BatchReady(bool steps) const {
  if (queue_.empty()) return false;
  if (steps || stopping_ || !options_.enabled) return true;
  if (clock_.Now() - queue_.front()->enqueued >= options_.max_queue_delay) return true;
  const int64_t limit = TokenLimit();
  return queued_tokens_ >= limit && TokensJoiningOldest(limit) >= limit;
}

int64_t Batcher::TokensJoiningOldest(int64_t limit) const {
  const BatchSignature& signature = queue_.front()->signature();
  int64_t tokens = 0;
  for (const auto& r : queue_) {
    if (r->signature() == signature) tokens += r->input().tokens();
    if (tokens >= limit) break;
  }
  return tokens;
}

int64_t Batcher::TokenLimit() const {
  return pool_.StepsRecently() ? tokens_with_steps_ : max_batch_tokens_;
}

MemoryBudget::Growth Batcher::ReserveActive(AttendCall& request) {
  if (options_.memory == nullptr) return MemoryBudget::Growth::kGrown;
  return options_.memory->TryGrowActive(request.active_bytes, *request.memory);
}

std::unique_ptr<PoolWork> Batcher::Hand(std::unique_ptr<Work> work) {
  ++in_flight_;
  work->counted = true;
  return work;
}

Batcher::Work::~Work() {
  if (!counted) return;  // never handed out (Poll holds the lock then)
  {
    std::lock_guard<std::mutex> lock(batcher.mu_);
    --batcher.in_flight_;
  }
  batcher.drained_cv_.notify_all();
}

void Batcher::Work::Run(Workspace& ws) {
  for (auto& task : tasks) task(ws);
  if (!batch.empty() || steps) batcher.Compute(std::move(batch), steps, ws);
}

std::unique_ptr<PoolWork> Batcher::Poll(Idle& idle) {
  std::lock_guard<std::mutex> lock(mu_);
  // Made first: once requests leave the queue, nothing allocates.
  auto work = std::make_unique<Work>(*this);
  if (!tasks_.empty()) {
    work->tasks.swap(tasks_);
    return Hand(std::move(work));
  }
  if (steps_queued_) {
    steps_queued_ = false;
    work->steps = true;
  }
  if (!BatchReady(work->steps)) {
    if (work->steps) return Hand(std::move(work));  // steps alone
    if (!queue_.empty()) idle.retry_at = queue_.front()->enqueued + options_.max_queue_delay;
    return nullptr;
  }
  // The oldest request first gets the memory to compute and answer it.
  AttendCall& oldest = *queue_.front();
  const MemoryBudget::Growth growth = ReserveActive(oldest);
  if (growth == MemoryBudget::Growth::kGrown) {
    work->batch = TakeBatch();
    return Hand(std::move(work));
  }
  if (work->steps) return Hand(std::move(work));  // steps do not wait for the memory
  const bool unwanted =
      clock_.Now() > oldest.deadline || oldest.Cancelled();
  if (!unwanted && growth == MemoryBudget::Growth::kFullUntilActiveReturns) {
    // Batches computing or answering will give memory back.
    idle.waiting_for_memory = true;
    return nullptr;
  }
  // Nothing will give memory back (queued requests hold it), or nobody
  // waits for this one any more: it leaves alone, and Compute drops it.
  if (!unwanted) {
    oldest.refusal = absl::ResourceExhaustedError(absl::StrCat(
        "server memory budget full: requests waiting hold ",
        WithCommas(options_.memory->reserved()), " of ", WithCommas(options_.memory->capacity()),
        " bytes and this one needs ", WithCommas(oldest.active_bytes),
        " more to compute; retry later"));
  }
  if (options_.memory != nullptr) options_.memory->MarkLeaving(*oldest.memory);
  queued_tokens_ -= oldest.input().tokens();
  queued_bytes_ -= oldest.input().wire_bytes();
  work->batch.push_back(std::move(queue_.front()));
  queue_.pop_front();
  metrics_.queue_depth->Set(static_cast<double>(queue_.size()));
  return Hand(std::move(work));
}

// With mu_ held, the oldest request's active memory reserved.
std::vector<std::unique_ptr<AttendCall>> Batcher::TakeBatch() {
  // The oldest request sets the signature; compatible ones join in order
  // while the batch has room, in tokens and in memory. Requests of another
  // signature are passed over, however large.
  std::vector<std::unique_ptr<AttendCall>> batch;
  const BatchSignature signature = queue_.front()->signature();
  const int64_t limit = TokenLimit();
  int64_t tokens = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (!((*it)->signature() == signature)) {
      ++it;
      continue;
    }
    const bool fits = batch.empty() || (options_.enabled &&
                                        tokens + (*it)->input().tokens() <= limit);
    if (!fits) break;
    if (!batch.empty() && ReserveActive(**it) != MemoryBudget::Growth::kGrown) break;
    tokens += (*it)->input().tokens();
    queued_tokens_ -= (*it)->input().tokens();
    queued_bytes_ -= (*it)->input().wire_bytes();
    batch.push_back(std::move(*it));
    it = queue_.erase(it);
    if (!options_.enabled) break;
  }
  metrics_.queue_depth->Set(static_cast<double>(queue_.size()));
  return batch;
}

int Batcher::ThreadsPerCall() const { return pool_.ThreadsPerCall(); }

void Batcher::Compute(std::vector<std::unique_ptr<AttendCall>> batch, bool steps,
                      Workspace& ws) {
  // Drop what nobody waits for any more, before spending compute on it.
  const absl::Time now = clock_.Now();
  std::vector<std::unique_ptr<AttendCall>> live;
  for (std::unique_ptr<AttendCall>& r : batch) {
    metrics_.queue_duration->Observe(absl::ToDoubleSeconds(now - r->enqueued));
    if (options_.statistics != nullptr) options_.statistics->Queued(now - r->enqueued);
    if (!r->refusal.ok()) {
      metrics_.CountDropped("memory");
      r->Fail(r->refusal);
    } else if (r->Cancelled()) {
      metrics_.CountDropped("cancelled");
      r->Fail(absl::CancelledError("client cancelled the request"));
    } else if (now > r->deadline) {
      metrics_.CountDropped("deadline");
      r->Fail(absl::DeadlineExceededError("deadline passed while the request was queued"));
    } else {
      live.push_back(std::move(r));
    }
  }
  // The source stays while its steps compute (SetStepSource waits).
  std::shared_lock<std::shared_mutex> source_lock(source_mu_, std::defer_lock);
  std::unique_ptr<StepGroup> group;
  size_t answered = 0;
  try {
    if (steps) {
      source_lock.lock();
      if (source_ != nullptr) group = source_->TakeSteps(engine_, max_batch_tokens_);
      if (group == nullptr) source_lock.unlock();
    }
    if (live.empty() && group == nullptr) return;
    ComputeLive(live, group, ws, answered);
  } catch (const std::bad_alloc&) {  // the batch fails, the server goes on
    const absl::Status status = absl::ResourceExhaustedError(
        "out of memory while computing this request's batch; retry later");
    if (group != nullptr) group->Finish(status, {}, {});
    for (size_t i = answered; i < live.size(); ++i) live[i]->Fail(status);
  }
}

void Batcher::ReportPrimitiveCacheMisses() {
  const uint64_t now = engine_.PrimitiveCacheMisses();
  uint64_t reported = reported_misses_.load();
  while (now > reported && !reported_misses_.compare_exchange_weak(reported, now)) {
  }
  if (now > reported) metrics_.primitive_cache_misses->Increment(static_cast<double>(now - reported));
}

void Batcher::ComputeLive(const std::vector<std::unique_ptr<AttendCall>>& live,
                          std::unique_ptr<StepGroup>& steps, Workspace& ws, size_t& answered) {
  const absl::Time merging = absl::Now();
  std::vector<const AttentionRequest*> inputs;
  int64_t tokens = 0, sequences = 0;
  for (const auto& r : live) {
    inputs.push_back(&r->input());
    tokens += r->input().tokens();
    sequences += r->input().sequences();
  }
  // The steps' query rows go right after the requests' (one buffer, one
  // projection product, no copy in the engine).
  std::optional<RaggedBatch> merged;
  AppendBatch step_batch;
  if (steps != nullptr) step_batch = steps->batch();
  if (!live.empty()) {
    merged.emplace(inputs, step_batch.query);
    if (steps != nullptr) step_batch.query = merged->rows_after();
  }
  static const AttentionBatch kNoSequences;
  const int64_t request_elements = merged ? merged->output_elements() : 0;
  const int64_t step_elements = static_cast<int64_t>(step_batch.query.size());
  const int64_t step_weights_elements =
      steps != nullptr && steps->need_weights() ? engine_.AppendWeightsElements(step_batch) : 0;
  // Every element is written by the engine: no zero-fill.
  const std::unique_ptr<float[]> output(new float[request_elements + step_elements]);
  const std::unique_ptr<float[]> weights(new float[merged ? merged->weights_elements() : 0]);
  const std::unique_ptr<float[]> step_weights(new float[step_weights_elements]);
  const absl::Span<float> all_output(output.get(), request_elements);
  const absl::Span<float> all_weights(weights.get(), merged ? merged->weights_elements() : 0);
  const MixedOutputs out{absl::MakeSpan(output.get(), request_elements + step_elements),
                         all_weights, merged && merged->per_head_weights(),
                         absl::MakeSpan(step_weights.get(), step_weights_elements)};
  const absl::Time start = absl::Now();
  const absl::Status status =
      engine_.Run(merged ? merged->batch() : kNoSequences, step_batch, out, ws);
  metrics_.compute_duration->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  ReportPrimitiveCacheMisses();
  if (steps != nullptr) {  // if an answer throws, Compute has Finish answer the rest
    steps->Finish(status, out.output.subspan(request_elements), out.step_weights);
    steps.reset();
  }
  if (live.empty()) return;
  metrics_.batch_requests->Observe(static_cast<double>(live.size()));
  metrics_.batch_tokens->Observe(static_cast<double>(tokens));
  metrics_.tokens->Increment(static_cast<double>(tokens));

  const absl::Time answering = absl::Now();
  if (options_.statistics != nullptr && status.ok()) {
    options_.statistics->Executed(live.size(), sequences, start - merging, answering - start);
  }
  for (; answered < live.size(); ++answered) {
    const size_t i = answered;
    if (!status.ok()) {
      live[i]->Fail(status);
      continue;
    }
    const AttentionResult result{merged->OutputOf(i, all_output),
                                 merged->WeightsOf(i, all_weights)};
    if (FirstNonFinite(result.output) >= 0) {  // finite inputs that overflow f32
      live[i]->Fail(absl::InvalidArgumentError(
          "inputs too large: the attention overflows float32 (non-finite result)"));
      continue;
    }
    live[i]->Respond(result);
  }
  if (options_.statistics != nullptr && status.ok()) {
    options_.statistics->Answered(live.size(), sequences, absl::Now() - answering);
  }
}

}  // namespace mha::server
