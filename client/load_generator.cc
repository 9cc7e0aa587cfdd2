#include "client/load_generator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <thread>

#include "client/attend_wire.h"
#include "client/client_common.h"
#include "client/tensor_files.h"
#include "engine/mutex.h"

namespace mha::client {
namespace {

// Requests in the pool: 64, fewer when they are large, and a multiple of
// the models; at most kPoolFloats floats in all (8 MiB as f32). A client
// sends bytes it has just written: from a pool of 64 requests of 1 MiB (on
// 4 KiB pages, 64 MiB) the call's overhead was 2.7-3.4 ms against 1.4-1.6
// from a pool of 4, same server, alternated (AMD EPYC VM). 64 of 16 MiB
// took 8 s to make and 2 GiB.
constexpr int64_t kPoolRequests = 64, kPoolFloats = int64_t{2} << 20;
size_t PoolSize(const LoadOptions& o) {
  int64_t floats = 1;  // of the largest request
  for (const LoadTarget& t : o.models) {
    floats = std::max(floats, o.batch * (o.max_len * t.embed_dim + o.kv_len * t.kdim));
  }
  const int64_t models = static_cast<int64_t>(o.models.size());
  const int64_t fit = std::min(kPoolRequests, kPoolFloats / floats) / models * models;
  return static_cast<size_t>(std::max(models, fit));
}

// A pool of ready requests, so the loop measures the server, not encoding.
std::vector<v1::AttendRequest> MakePool(const LoadOptions& o) {
  std::mt19937 gen(o.seed);
  std::uniform_int_distribution<int64_t> len(o.min_len, o.max_len);
  std::vector<v1::AttendRequest> pool(PoolSize(o));
  for (size_t i = 0; i < pool.size(); ++i) {
    const LoadTarget& target = o.models[i % o.models.size()];
    v1::AttendRequest& r = pool[i];
    r.set_model(target.model);
    *r.mutable_query() =
        ToWireDtype(RandomTensor({o.batch, len(gen), target.embed_dim}, gen), o.dtype);
    if (o.kv_len > 0) {
      *r.mutable_key() = ToWireDtype(RandomTensor({o.batch, o.kv_len, target.kdim}, gen), o.dtype);
    }
  }
  return pool;
}

// Shared state of one run: the report and latencies under mu_. Calls
// finish on gRPC's threads; with --stream each slot runs on a thread of its
// own. Run() once; thread-safe inside.
class LoadRun {
 public:
  LoadRun(const std::shared_ptr<grpc::Channel>& channel, const LoadOptions& o)
      : stub_(v1::AttentionService::NewStub(channel)),
        generic_stub_(channel),
        options_(o),
        pool_(MakePool(o)) {
    for (const v1::AttendRequest& r : pool_) pool_bytes_.push_back(AttendRequestBytes(r));
  }

  LoadReport Run() {
    start_ = absl::Now();
    {
      MutexLock lock(mu_);
      counted_from_ = start_;
    }
    end_ = start_ + options_.duration;
    std::thread progress;
    if (options_.progress) progress = std::thread([this] { ShowProgress(); });
    std::thread retries([this] { RetryWhenDue(); });
    std::vector<std::thread> slots;
    if (options_.stream) {
      for (int i = 0; i < options_.concurrency; ++i) slots.emplace_back([this] { RunStream(); });
    } else if (options_.rate > 0) {
      OpenLoop();
    } else if (options_.concurrency == 1) {
      slots.emplace_back([this] { RunPolledSlot(); });
    } else {
      for (int i = 0; i < options_.concurrency; ++i) Issue(/*chain=*/true);
    }
    for (std::thread& t : slots) t.join();
    MutexLock lock(mu_);
    while (in_flight_ != 0 || !started_all_) done_cv_.Wait(lock);
    report_.seconds = absl::ToDoubleSeconds(absl::Now() - counted_from_);
    finished_ = true;
    retry_cv_.NotifyAll();
    lock.Unlock();
    retries.join();
    if (progress.joinable()) progress.join();
    MutexLock relock(mu_);
    Summarize();
    return report_;
  }

 private:
  struct Call {
    grpc::ClientContext context;
    absl::Time sent;
    int64_t n = 0;  // which request (pool_[n % size])
    int64_t tokens = 0;
    absl::Duration backoff;    // of the retry before this one; 0: a first try
    absl::Time failing_since;  // of its first try that failed (retries only)
  };
  // A closed-loop call that found the server unavailable, tried again
  // (the same request) once `due`, after `backoff`.
  struct Retry {
    absl::Time due;
    int64_t n = 0;
    absl::Duration backoff;
    absl::Time failing_since;
  };
  static constexpr absl::Duration kFirstBackoff = absl::Milliseconds(10);
  static constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
  // A call unavailable this long fails (so a run without a duration ends).
  static constexpr absl::Duration kGiveUp = absl::Seconds(30);

  // The index of the next request, or -1 when the run is over.
  int64_t NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    started_all_ = true;
    const bool over =
        absl::Now() >= end_ ||
        (options_.max_requests > 0 && issued_ >= options_.max_requests + options_.warmup_requests);
    return over ? -1 : issued_++;
  }

  int64_t Next() {
    MutexLock lock(mu_);
    return NextLocked();
  }

  // A request answered OK after `ms`; false while warming up (not counted).
  bool RecordLocked(double ms, int64_t tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (warmed_up_ < options_.warmup_requests) {
      if (++warmed_up_ == options_.warmup_requests) counted_from_ = absl::Now();
      return false;
    }
    latencies_ms_.push_back(ms);
    ++report_.requests;
    report_.tokens += tokens;
    return true;
  }

  int64_t TokensOf(const v1::AttendRequest& request) const {
    return request.query().shape(0) *
           (request.query().shape(1) + (options_.kv_len > 0 ? options_.kv_len : 0));
  }

  // One slot of a streamed closed loop: requests one after another over one
  // Stream, each answered before the next is written. A request lost with
  // its stream counts as an error under the stream's status.
  void RunStream() {
    grpc::ClientContext context;
    AddToken(options_.token, context);
    auto stream = stub_->Stream(&context);
    v1::StreamRequest message;
    v1::StreamResponse answer;
    bool broken = false;
    for (int64_t n = Next(); n >= 0 && !broken; n = Next()) {
      const v1::AttendRequest& request = pool_[n % pool_.size()];
      *message.mutable_attend() = request;
      const absl::Time sent = absl::Now();
      const bool ok = stream->Write(message) && stream->Read(&answer);
      const double ms = absl::ToDoubleMilliseconds(absl::Now() - sent);
      MutexLock lock(mu_);
      if (!ok) {  // the stream broke: Finish says why
        broken = true;
      } else if (answer.code() != 0) {
        ++report_.errors[CodeName(static_cast<grpc::StatusCode>(answer.code()))];
      } else {
        RecordLocked(ms, TokensOf(request));
      }
    }
    if (!broken) stream->WritesDone();
    const grpc::Status status = stream->Finish();
    MutexLock lock(mu_);
    if (!status.ok() || broken) {
      ++report_.errors[CodeName(status.ok() ? grpc::StatusCode::UNKNOWN : status.error_code())];
    } else {
      ++report_.streams;
    }
  }

  // Starts calls on a fixed schedule, whatever the answers.
  void OpenLoop() {
    const absl::Duration interval = absl::Seconds(1.0 / options_.rate);
    absl::Time next = start_;
    while (Issue(/*chain=*/false)) {
      next += interval;
      const absl::Duration wait = next - absl::Now();
      if (wait > absl::ZeroDuration()) absl::SleepFor(wait);
    }
  }

  // A line on stderr about once a second: requests, errors, rate, p50/p99.
  void ShowProgress() {
    int64_t last = 0;
    while (true) {
      absl::SleepFor(absl::Seconds(1));
      MutexLock lock(mu_);
      if (finished_) break;
      std::vector<double> recent(latencies_ms_.end() - std::min<size_t>(latencies_ms_.size(), 2000),
                                 latencies_ms_.end());
      std::sort(recent.begin(), recent.end());
      auto at = [&](double q) {
        return recent.empty() ? 0.0
                              : recent[std::min(recent.size() - 1, size_t(q * recent.size()))];
      };
      int64_t errors = 0;
      for (const auto& [code, n] : report_.errors) errors += n;
      std::fprintf(stderr,
                   "\r%8lld requests  %5lld errors  %8.1f req/s  p50 %.3f ms  p99 %.3f ms   ",
                   static_cast<long long>(report_.requests), static_cast<long long>(errors),
                   static_cast<double>(report_.requests - last), at(0.5), at(0.99));
      last = report_.requests;
    }
    std::fprintf(stderr, "\n");
  }

  // Starts one call unless the run is over; a chained call starts the next
  // one when it finishes (closed loop). The n-th call sends pool_[n % size],
  // so models alternate exactly. Returns whether it started.
  bool Issue(bool chain) {
    int64_t n = 0;
    {
      MutexLock lock(mu_);
      n = NextLocked();
      if (n < 0) return false;
      ++in_flight_;
    }
    Send(n, chain, absl::ZeroDuration(), absl::Now());
    return true;
  }

  // Sends request n (counted in flight already). A closed-loop call the
  // server could not take (UNAVAILABLE: it is down or restarting) is tried
  // again after a backoff, doubling to kMaxBackoff, instead of at once: one
  // failed call, however many tries, and no spinning client.
  void Send(int64_t n, bool chain, absl::Duration backoff, absl::Time failing_since) {
    Call* call = NewCall(n, backoff, failing_since);
    // The request's bytes were written once, with the pool; the response is
    // read around its tensors' bytes (client/attend_wire.h).
    CallAttend(generic_stub_, &call->context, pool_bytes_[n % pool_bytes_.size()],
               [this, call, chain](absl::Status status, std::unique_ptr<ReceivedAttendResponse>) {
                 if (chain && status.code() == absl::StatusCode::kUnavailable && TryLater(*call)) {
                   delete call;
                   return;
                 }
                 Finished(call, status);
                 if (chain) Issue(true);
                 MutexLock lock(mu_);
                 if (--in_flight_ == 0) done_cv_.NotifyAll();
               });
  }

  // Request n's call, timed from now.
  Call* NewCall(int64_t n, absl::Duration backoff, absl::Time failing_since) const {
    auto* call = new Call;
    call->n = n;
    call->tokens = TokensOf(pool_[n % pool_.size()]);
    call->backoff = backoff;
    call->failing_since = failing_since;
    AddToken(options_.token, call->context);
    call->sent = absl::Now();
    return call;
  }

  // `call`'s request's next try (counted), unless the run is over or the
  // server was unavailable to it for kGiveUp.
  std::optional<Retry> RetryOfLocked(const Call& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    const bool first = call.backoff == absl::ZeroDuration();
    const absl::Time failing_since = first ? now : call.failing_since;
    if (now >= end_ || now - failing_since > kGiveUp) return std::nullopt;
    const absl::Duration backoff = first ? kFirstBackoff : std::min(kMaxBackoff, 2 * call.backoff);
    ++report_.retries;
    return Retry{now + backoff, call.n, backoff, failing_since};
  }

  // Queues `call`'s request for another try (RetryOfLocked).
  bool TryLater(const Call& call) {
    MutexLock lock(mu_);
    const std::optional<Retry> retry = RetryOfLocked(call);
    if (!retry.has_value()) return false;
    retries_.push_back(*retry);
    retry_cv_.NotifyAll();
    return true;
  }

  // The closed loop of a lone slot, on this thread, which polls a
  // completion queue of its own (CallAttendPolling: no hand-over to gRPC's
  // callback threads, what a blocking client gets). A call the server
  // could not take is tried again as Send's are, the slot waiting out the
  // backoff itself.
  void RunPolledSlot() {
    grpc::CompletionQueue cq;
    std::optional<Retry> retry;
    for (int64_t n = Next(); n >= 0;) {
      Call* call = retry.has_value() ? NewCall(n, retry->backoff, retry->failing_since)
                                     : NewCall(n, absl::ZeroDuration(), absl::Now());
      ReceivedAttendResponse response;
      const absl::Status status = CallAttendPolling(
          generic_stub_, &call->context, pool_bytes_[n % pool_bytes_.size()], cq, response);
      if (status.code() == absl::StatusCode::kUnavailable) {
        MutexLock lock(mu_);
        retry = RetryOfLocked(*call);
      } else {
        retry.reset();
      }
      if (!retry.has_value()) {
        Finished(call, status);
        n = Next();
        continue;
      }
      delete call;
      absl::SleepFor(retry->due - absl::Now());
      if (absl::Now() >= end_) {  // as RetryWhenDue: the run ended first
        MutexLock lock(mu_);
        ++report_.errors[CodeName(grpc::StatusCode::UNAVAILABLE)];
        break;
      }
    }
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
  }

  // Sends the retries when due; once the run is over, what waits fails
  // (counted once, as UNAVAILABLE).
  void RetryWhenDue() {
    MutexLock lock(mu_);
    while (true) {
      const absl::Time now = absl::Now();
      std::vector<Retry> due;
      for (auto it = retries_.begin(); it != retries_.end();) {
        if (it->due <= now || now >= end_) {
          due.push_back(*it);
          it = retries_.erase(it);
        } else {
          ++it;
        }
      }
      for (const Retry& r : due) {
        if (now < end_) {
          lock.Unlock();
          Send(r.n, /*chain=*/true, r.backoff, r.failing_since);
          lock.Lock();
        } else {
          ++report_.errors[CodeName(grpc::StatusCode::UNAVAILABLE)];
          if (--in_flight_ == 0) done_cv_.NotifyAll();
        }
      }
      if (finished_) return;
      absl::Time next = end_;  // may be infinite (--duration=inf with --requests)
      for (const Retry& r : retries_) next = std::min(next, r.due);
      const absl::Duration wait = next - absl::Now();
      if (wait > absl::ZeroDuration()) {  // at most a second: no overflow, and end_ is seen
        retry_cv_.WaitFor(lock, std::min(wait, absl::Seconds(1)) + absl::Milliseconds(1));
      } else if (now >= end_ && retries_.empty()) {
        retry_cv_.Wait(lock);  // until finished (or a late retry)
      }
    }
  }

  void Finished(Call* call, const absl::Status& status) {
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - call->sent);
    const auto& trailers = call->context.GetServerTrailingMetadata();
    // A trailer's microseconds in ms (negative: absent).
    auto trailer_ms = [&](const char* name) {
      const auto it = trailers.find(name);
      if (it == trailers.end()) return -1.0;
      return std::atof(std::string(it->second.data(), it->second.size()).c_str()) / 1e3;
    };
    const double compute_ms = trailer_ms("mha-compute-time-us");
    const double server_ms = trailer_ms("mha-server-time-us");
    MutexLock lock(mu_);
    if (status.ok()) {
      if (RecordLocked(ms, call->tokens)) {
        if (compute_ms >= 0) above_compute_ms_.push_back(ms - compute_ms);
        if (server_ms >= 0) above_server_ms_.push_back(ms - server_ms);
      }
    } else {
      ++report_.errors[CodeName(static_cast<grpc::StatusCode>(status.code()))];
    }
    delete call;
  }

  void Summarize() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!above_compute_ms_.empty()) {
      std::sort(above_compute_ms_.begin(), above_compute_ms_.end());
      report_.above_compute_p50_ms = above_compute_ms_[above_compute_ms_.size() / 2];
    }
    if (!above_server_ms_.empty()) {
      std::sort(above_server_ms_.begin(), above_server_ms_.end());
      report_.above_server_p50_ms = above_server_ms_[above_server_ms_.size() / 2];
    }
    std::vector<double>& v = latencies_ms_;
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    auto at = [](const std::vector<double>& sorted, double q) {
      return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
    };
    report_.p50_ms = at(v, 0.5), report_.p90_ms = at(v, 0.9), report_.p99_ms = at(v, 0.99);
    report_.p999_ms = at(v, 0.999), report_.max_ms = v.back();
  }

  std::unique_ptr<v1::AttentionService::Stub> stub_;  // Stream
  grpc::GenericStub generic_stub_;                    // Attend (attend_wire.h)
  const LoadOptions options_;
  const std::vector<v1::AttendRequest> pool_;
  std::vector<grpc::ByteBuffer> pool_bytes_;  // pool_ as gRPC sends it
  Mutex mu_;
  CondVar done_cv_;
  CondVar retry_cv_;  // a retry queued, or the run finished
  std::vector<Retry> retries_ ABSL_GUARDED_BY(mu_);
  absl::Time start_, end_;  // set by Run before any thread starts, then read only
  int64_t issued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t warmed_up_ ABSL_GUARDED_BY(mu_) = 0;    // answers not counted so far
  absl::Time counted_from_ ABSL_GUARDED_BY(mu_);  // the run's start, or the warm-up's end
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_all_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<double> latencies_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<double> above_compute_ms_ ABSL_GUARDED_BY(mu_);  // round trip - compute, per call
  std::vector<double> above_server_ms_ ABSL_GUARDED_BY(mu_);   // round trip - server time, per call
  LoadReport report_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

LoadReport RunLoad(const std::shared_ptr<grpc::Channel>& channel, const LoadOptions& options) {
  LoadRun run(channel, options);
  return run.Run();
}

}  // namespace mha::client
