// SessionManager's record of one session and the tasks it gives the
// batchers, shared by its .cc files (the registry; the steps; the
// transfers). Not part of the module's interface.
#ifndef MHA_SERVER_SESSIONS_SESSION_INTERNAL_H_
#define MHA_SERVER_SESSIONS_SESSION_INTERNAL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "engine/kv_cache.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// A step's answer as it was sent, kept for the same step sent again.
struct KeptAnswer {
  std::vector<float> output, weights;
  int64_t keys = 0;
};

// A self session's last step, kept so that the same step sent again at the
// same expected_position (its answer lost to the caller's deadline or
// connection) is answered again, not refused: where it went from and to, a
// hash of its query and options, and its answer when that is at most
// kKeptAnswerBytes (counted in SessionManager::kept_answer_bytes() until the
// session moves on or goes; docs/SESSIONS.md, "Retrying a step"). Movable,
// not copyable.
struct KeptStep {
  static constexpr int64_t kKeptAnswerBytes = kKeptAnswerBytesPerSession;
  int64_t from = -1, to = -1;
  size_t query_hash = 0;
  std::shared_ptr<const KeptAnswer> answer;  // null: not kept
  std::atomic<int64_t>* counted = nullptr;   // where answer_bytes are counted
  int64_t answer_bytes = 0;

  KeptStep() = default;
  KeptStep(KeptStep&& other) noexcept { *this = std::move(other); }
  KeptStep& operator=(KeptStep&& other) noexcept {
    if (this != &other) {
      Uncharge();
      from = other.from, to = other.to, query_hash = other.query_hash;
      answer = std::move(other.answer);
      counted = std::exchange(other.counted, nullptr);
      answer_bytes = std::exchange(other.answer_bytes, 0);
    }
    return *this;
  }
  ~KeptStep() { Uncharge(); }

  // Whether a step of `query_hash` expecting position `expected`, with the
  // session at `position`, is this step sent again.
  bool SentAgain(int64_t expected, int64_t position, size_t hash) const {
    return from == expected && to == position && query_hash == hash;
  }

 private:
  void Uncharge() {
    if (counted != nullptr) counted->fetch_sub(answer_bytes);
    counted = nullptr;
  }
};

// Guarded by SessionManager::mu_, except the cache's contents, which the
// worker computing the session's step writes.
struct SessionManager::Session {
  std::string id;
  VersionPtr version;
  std::unique_ptr<KvCache> cache;
  bool cross = false;
  int64_t max_tokens = 0;
  absl::Duration idle_timeout;
  absl::Time last_used;
  bool busy = false;   // a step (or its encoder memory's projection) started
  int64_t queued = 0;  // steps waiting in its batcher
  // The cache's length as of the last finished step: what other threads
  // read (the batcher worker computing its step writes the cache's own
  // length outside mu_).
  int64_t position = 0;
  KeptStep last_step;  // self sessions
};

// One Append as its batcher carries it: owns the decoded step, its answer
// callback and a reference to its session; the manager decides, under its
// lock, when it starts (BeginStep) and what its answer is. Answered exactly
// once (Finish or Fail). Not thread-safe: one owner at a time.
class SessionManager::StepCall final : public StepTask {
 public:
  StepCall(SessionManager& manager, SessionPtr session, StepParams params, StepDone done)
      : manager_(manager),
        session_(std::move(session)),
        params_(std::move(params)),
        done_(std::move(done)) {}
  // Its memory reservation and its session (whose blocks may go back to the pool) are
  // let go before the manager hears it is gone.
  ~StepCall() override;

  const void* session() const override { return session_.get(); }
  int64_t tokens() const override { return params_.query.q_len(); }
  bool Cancelled() const override { return params_.cancelled && params_.cancelled(); }
  void CountDropped(const ModelMetrics& model, const char* reason) override;
  Start Begin(StepPlan& plan, absl::Status& why) override {
    return manager_.BeginStep(*this, plan, why);
  }
  absl::Status Allocate() override { return manager_.AllocateStep(*this); }
  void Abandon() override { manager_.AbandonStep(*this); }
  void Finish(const absl::Status& status, absl::Span<const float> output,
              absl::Span<const float> weights) override {
    if (!once_.Claim()) return;
    if (!status.ok()) CountFailure();
    manager_.FinishStep(*this, status, output, weights);
  }
  void Fail(const absl::Status& status) override {
    if (!once_.Claim()) return;
    if (status.ok() && sent_again_ != nullptr) {  // BeginStep's "refusal" of a step sent again
      manager_.AnswerAgain(*this);
      return;
    }
    CountFailure();
    manager_.FailStep(*this, AnswerOnce::AsFailure(status));
  }

 private:
  friend class SessionManager;
  SessionManager& manager_;
  SessionPtr session_;
  StepParams params_;
  StepDone done_;
  bool started_ ABSL_GUARDED_BY(manager_.mu_) = false;  // Begin said kRun, not yet undone
  AnswerOnce once_;
  int64_t position_after_ = 0;  // set by Begin
  size_t query_hash_ = 0;       // set by Step: its query's bytes and options
  // Set by Begin when it is the session's last step sent again: the kept
  // answer it is given without computing (Begin refuses it with OK).
  std::shared_ptr<const KeptAnswer> sent_again_;
};

// A cross session's encoder memory as its batcher carries it: owns the open's
// parameters, its answer callback and the session being opened (busy until
// projected). Answered exactly once (Run or Fail). Not thread-safe.
class SessionManager::EncoderProjection final : public ProjectionTask {
 public:
  EncoderProjection(SessionManager& manager, OpenParams params, OpenDone done, SessionPtr session)
      : manager_(manager),
        params_(std::move(params)),
        done_(std::move(done)),
        session_(std::move(session)) {}
  ~EncoderProjection() override;

  void Run(Workspace& ws) override {
    if (once_.Claim()) manager_.RunOpen(*this, ws);
  }
  void Fail(const absl::Status& status) override {
    if (once_.Claim()) manager_.FailOpen(*this, AnswerOnce::AsFailure(status));
  }
  void CountDropped(const ModelMetrics& model, const char* reason) override {
    model.CountDropped(reason);
  }

 private:
  friend class SessionManager;
  SessionManager& manager_;
  OpenParams params_;
  OpenDone done_;
  SessionPtr session_;
  AnswerOnce once_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_SESSIONS_SESSION_INTERNAL_H_
