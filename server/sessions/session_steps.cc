// SessionManager's side of the tasks it gives the batchers: a step (Step)
// becomes a StepCall, which the batcher admits and, as it forms a call,
// starts here (BeginStep), gives blocks (AllocateStep) and answers
// (FinishStep / FailStep); a cross session's memory becomes a
// EncoderProjection.
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/mha_engine.h"
#include "server/scheduling/admission.h"
#include "server/sessions/session_internal.h"
#include "server/sessions/session_manager.h"

namespace mha::server {
namespace {

// What a step of `tokens` attends to: the session's cached keys after it
// (a cross session's memory does not grow) and the model's extra keys.
int64_t StepKeys(const MhaEngine& engine, int64_t position, int64_t tokens, bool cross) {
  return position + (cross ? 0 : tokens) + engine.dims().extra_keys();
}

// A hash of a step's query rows (as converted to f32) and of what changes
// its answer: a step sent again has the same.
size_t QueryHash(const AttentionRequest& query) {
  const absl::Span<const float> rows = query.batch().query;
  const absl::string_view bytes(reinterpret_cast<const char*>(rows.data()),
                                rows.size() * sizeof(float));
  return absl::Hash<std::tuple<absl::string_view, bool, int>>{}(
      std::make_tuple(bytes, query.need_weights(), static_cast<int>(query.output_dtype())));
}

}  // namespace

SessionManager::StepCall::~StepCall() {
  memory->Release();
  session_.reset();  // a closed session's blocks go back to the pool here
  manager_.PublishCacheBytes();
  manager_.TaskGone();
}

void SessionManager::StepCall::CountDropped(const ModelMetrics&, const char* reason) {
  manager_.CountDropped(session_->version->name, reason);
}

SessionManager::EncoderProjection::~EncoderProjection() {
  memory->Release();
  session_.reset();
  params_.memory.reset();
  manager_.TaskGone();
}

void SessionManager::CountDropped(const std::string& model, const char* reason) {
  if (metrics_.steps_dropped == nullptr) return;
  metrics_.steps_dropped->Add({{"model", model}, {"reason", reason}}).Increment();
}

RequestCost SessionManager::CostLocked(const Session& s, const AttentionRequest& query) const {
  const MhaEngine& engine = *s.version->loaded.engine;
  return CostOfStep(query, StepKeys(engine, s.position, query.q_len(), s.cross), engine,
                    s.version->batcher->MaxThreadsPerCall());
}

void SessionManager::Step(StepParams params, StepDone done) {
  const absl::Time arrived = absl::Now();
  MutexLock lock(mu_);
  absl::Status refused;
  auto it = sessions_.end();
  if (stopping_) {
    refused = absl::UnavailableError("the server is shutting down");
  } else {
    ExpireIfIdleLocked(params.id);
    it = sessions_.find(params.id);
    if (it == sessions_.end()) {
      refused = NotFoundLocked(params.id);
    } else if (it->second->version != params.decoded_for) {
      refused = ReopenedLocked(*it->second);
    }
  }
  if (!refused.ok()) {
    lock.Unlock();
    // Counted once, in the statistics of the version it was decoded for.
    if (params.decoded_for != nullptr) params.decoded_for->CountRefusal(arrived);
    return done(std::move(refused));
  }
  Session& session = *it->second;
  // Its cost as of the position now: the batcher checks it against the
  // whole budget at once, and again when the step starts.
  const RequestCost cost = CostLocked(session, params.query);
  const absl::Time deadline = params.deadline;
  const int64_t wire_bytes = params.query.wire_bytes();
  auto step = std::make_unique<StepCall>(*this, it->second, std::move(params), std::move(done));
  step->query_hash_ = QueryHash(step->params_.query);
  step->deadline = deadline;
  step->statistics = session.version->statistics.get();  // a step is an inference (or null)
  step->wire_bytes = wire_bytes;
  step->queued_bytes = cost.queued_bytes;
  step->active_bytes = cost.active_bytes;
  ++session.queued;
  ++tasks_;
  // The step's session holds its version (and so the batcher) alive.
  Batcher& batcher = *session.version->batcher;
  lock.Unlock();
  batcher.Enqueue(std::move(step));
}

StepTask::Start SessionManager::BeginStep(StepCall& step, StepPlan& plan, absl::Status& why) {
  MutexLock lock(mu_);
  step.manager_.mu_.AssertHeld();  // step.manager_ is *this
  Session& s = *step.session_;
  if (refusing_) {
    why = absl::UnavailableError("the server is shutting down");
    return StepTask::Start::kRefused;
  }
  if (!IsOpenLocked(s)) {  // closed or evicted meanwhile
    why = NotFoundLocked(s.id);
    return StepTask::Start::kRefused;
  }
  if (s.busy) return StepTask::Start::kBusy;
  const int64_t position = s.position, t = step.tokens();
  const std::optional<int64_t>& expected = step.params_.expected_position;
  if (expected.has_value() && *expected != position) {
    why = NotAtExpectedLocked(s, step);
    return StepTask::Start::kRefused;  // with OK: answered again (StepCall::Fail)
  }
  if (!s.cross && position + t > s.max_tokens) {
    why = absl::OutOfRangeError(absl::StrCat("session ", s.id, " holds ", position, " tokens; ", t,
                                             " more would pass its max_tokens ", s.max_tokens));
    return StepTask::Start::kRefused;
  }
  step.active_bytes = CostLocked(s, step.params_.query).active_bytes;
  s.busy = true;
  --s.queued;
  step.started_ = true;
  step.position_after_ = position + (s.cross ? 0 : t);
  plan.step = CacheStep{s.cache.get(), t, s.cross};
  plan.query = step.params_.query.batch().query;
  plan.need_weights = step.params_.query.need_weights();
  plan.keys = step.position_after_ + s.version->loaded.engine->dims().extra_keys();
  return StepTask::Start::kRun;
}

absl::Status SessionManager::NotAtExpectedLocked(const Session& s, StepCall& step) {
  const int64_t expected = *step.params_.expected_position, position = s.position;
  const std::string not_there = absl::StrCat("session ", s.id, " is at position ", position,
                                             ", not at expected_position ", expected);
  const KeptStep& last = s.last_step;
  if (s.cross || !last.SentAgain(expected, position, step.query_hash_)) {
    return absl::FailedPreconditionError(
        absl::StrCat(not_there, "; ask ListSessions for its position and go on from there"));
  }
  if (last.answer == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        not_there, ": this step (positions ", last.from, " to ", last.to,
        ") was applied, but its answer was larger than the ", KeptStep::kKeptAnswerBytes,
        " bytes kept for a step sent again; go on from position ", position));
  }
  step.sent_again_ = last.answer;
  return absl::OkStatus();
}

absl::Status SessionManager::AllocateStep(StepCall& step) {
  MutexLock lock(mu_);
  Session& s = *step.session_;
  if (s.cross) return absl::OkStatus();  // it reads its memory, appends nothing
  return ReserveLocked(s, s.position + step.tokens());
}

void SessionManager::AbandonStep(StepCall& step) {
  MutexLock lock(mu_);
  step.manager_.mu_.AssertHeld();  // step.manager_ is *this
  Session& s = *step.session_;
  s.busy = false;
  ++s.queued;
  step.started_ = false;
}

void SessionManager::FinishStep(StepCall& step, const absl::Status& status,
                                absl::Span<const float> output, absl::Span<const float> weights) {
  Session& s = *step.session_;
  StepResult result;
  result.output = output;
  result.weights = weights;
  result.position = step.position_after_;
  result.keys = step.position_after_ + s.version->loaded.engine->dims().extra_keys();
  // Kept before the session is free again: the same step sent again may
  // start as soon as it is, and must find this one as the last.
  KeptStep kept = status.ok() && !s.cross ? KeepLastStep(step, result) : KeptStep();
  {
    MutexLock lock(mu_);
    step.manager_.mu_.AssertHeld();  // step.manager_ is *this
    s.busy = false;
    s.last_used = clock_.Now();
    s.position = s.cache->length();
    step.started_ = false;
    if (!status.ok() && IsOpenLocked(s)) {  // a failed step leaves its cache unknown
      RemoveLocked(s.id, absl::StrCat("failed: ", status.message()), "failed");
    }
    if (kept.to >= 0 && s.position == kept.to) s.last_step = std::move(kept);
    PublishLocked();
  }
  if (!status.ok()) {
    step.done_(status);
    return;
  }
  const int64_t t = step.tokens();
  if (metrics_.append_tokens != nullptr) metrics_.append_tokens->Increment(static_cast<double>(t));
  if (metrics_.append_duration != nullptr) {
    metrics_.append_duration->Observe(absl::ToDoubleSeconds(clock_.Now() - step.enqueued));
  }
  if (metrics_.append_queue_duration != nullptr) {
    metrics_.append_queue_duration->Observe(absl::ToDoubleSeconds(step.waited));
    prometheus::Histogram* split =
        step.queued_behind_calls ? metrics_.append_queue_all_busy : metrics_.append_queue_some_free;
    if (split != nullptr) split->Observe(absl::ToDoubleSeconds(step.waited));
  }
  step.done_(result);
}

KeptStep SessionManager::KeepLastStep(StepCall& step, const StepResult& result) {
  KeptStep kept;
  kept.from = result.position - step.tokens();
  kept.to = result.position;
  kept.query_hash = step.query_hash_;
  const int64_t bytes =
      static_cast<int64_t>((result.output.size() + result.weights.size()) * sizeof(float));
  if (bytes <= KeptStep::kKeptAnswerBytes) {
    kept_answer_bytes_.fetch_add(bytes);
    kept.counted = &kept_answer_bytes_;
    kept.answer_bytes = bytes;
    auto answer = std::make_shared<KeptAnswer>();
    answer->output.assign(result.output.begin(), result.output.end());
    answer->weights.assign(result.weights.begin(), result.weights.end());
    answer->keys = result.keys;
    kept.answer = std::move(answer);
  }
  return kept;
}

void SessionManager::AnswerAgain(StepCall& step) {
  {
    MutexLock lock(mu_);
    Session& s = *step.session_;
    --s.queued;
    s.last_used = clock_.Now();
  }
  step.memory->Release();
  const KeptAnswer& kept = *step.sent_again_;
  StepResult result;
  result.output = kept.output;
  result.weights = kept.weights;
  result.position = *step.params_.expected_position + step.tokens();
  result.keys = kept.keys;
  step.done_(result);
}

void SessionManager::FailStep(StepCall& step, const absl::Status& status) {
  {
    MutexLock lock(mu_);
    step.manager_.mu_.AssertHeld();  // step.manager_ is *this
    Session& s = *step.session_;
    if (step.started_) {
      s.busy = false;
      step.started_ = false;
    } else {
      --s.queued;
    }
  }
  step.memory->Release();  // before the answer: the caller may send again at once
  step.done_(status);
}

void SessionManager::RunOpen(EncoderProjection& open, Workspace& ws) {
  Session& s = *open.session_;
  const AttentionBatch& memory = open.params_.memory->batch();
  const absl::Status projected = s.version->loaded.engine->ProjectEncoderMemory(
      memory.key, memory.value, open.params_.memory->kv_len(), memory.key_padding_mask, *s.cache,
      ws);
  MhaEngine::ReleaseLargeWorkspace(ws);
  MutexLock lock(mu_);
  s.busy = false;
  s.last_used = clock_.Now();
  s.position = s.cache->length();
  // Steps sent before the open answered wait for it: the batcher starts
  // them next, or they are refused (NOT_FOUND, saying why) when it failed.
  if (!projected.ok()) {
    if (IsOpenLocked(s)) RemoveLocked(s.id, absl::StrCat("not opened: ", projected.message()), "");
    lock.Unlock();
    open.done_(projected);
    return;
  }
  const SessionInfo info = InfoLocked(s);
  PublishLocked();
  lock.Unlock();
  open.done_(info);
}

void SessionManager::FailOpen(EncoderProjection& open, const absl::Status& status) {
  {
    MutexLock lock(mu_);
    Session& s = *open.session_;
    s.busy = false;
    if (IsOpenLocked(s)) RemoveLocked(s.id, absl::StrCat("not opened: ", status.message()), "");
  }
  open.done_(status);
}

}  // namespace mha::server
