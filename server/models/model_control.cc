#include "server/models/model_control.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/observability/logger.h"

namespace mha::server {
namespace {

// How often the thread looks again at versions still draining.
constexpr absl::Duration kRetiredCheck = absl::Milliseconds(20);

}  // namespace

absl::StatusOr<ModelControlMode> ParseModelControlMode(absl::string_view name) {
  if (name == "none") return ModelControlMode::kNone;
  if (name == "poll") return ModelControlMode::kPoll;
  if (name == "explicit") return ModelControlMode::kExplicit;
  return absl::InvalidArgumentError(
      absl::StrCat("--model_control_mode: '", name, "' is not one of none, poll, explicit"));
}

absl::Status LoadAtStart(ModelRepository& repository, ModelControlMode mode,
                         const std::vector<std::string>& load_models) {
  if (mode == ModelControlMode::kExplicit) {
    for (const std::string& name : load_models) {
      // Failures of a model folder it read are logged by the repository;
      // a name it never took in (no such folder, a bad name) is said here.
      if (absl::Status s = repository.Load(name); !s.ok() && !repository.Has(name)) {
        LogError(absl::StrCat("--load_model ", name, ": ", s.message()));
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> names = repository.FolderNames();
  if (!names.ok()) return names.status();
  if (names->empty() && mode == ModelControlMode::kNone) {
    return absl::NotFoundError(
        absl::StrCat("model repository '", repository.dir(), "' has no model folder"));
  }
  repository.SyncAll();
  return absl::OkStatus();
}

ModelControl::ModelControl(ModelRepository& repository, ModelControlMode mode,
                           absl::Duration poll_interval, std::function<void()> changed)
    : repository_(repository),
      mode_(mode),
      poll_interval_(poll_interval),
      changed_(std::move(changed)) {
  if (mode_ != ModelControlMode::kNone) thread_ = std::thread([this] { Loop(); });
}

ModelControl::~ModelControl() { Stop(); }

absl::Status ModelControl::Allowed() const {
  if (mode_ != ModelControlMode::kNone) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "model control is off: start the server with --model_control_mode explicit (or poll) "
      "to load and unload models over the API");
}

void ModelControl::Load(std::string name, std::function<void(absl::Status)> done,
                        ModelSource source) {
  LogVerbose(1, absl::StrCat("model control: load '", name, "' asked"));
  Change(
      [this, name, source = std::move(source)] {
        return repository_.Load(name, /*retry_failed=*/true, source);
      },
      std::move(done));
}

void ModelControl::Unload(std::string name, std::function<void(absl::Status)> done) {
  LogVerbose(1, absl::StrCat("model control: unload '", name, "' asked"));
  Change([this, name] { return repository_.Unload(name); }, std::move(done));
}

void ModelControl::Change(std::function<absl::Status()> change,
                          std::function<void(absl::Status)> done) {
  if (absl::Status allowed = Allowed(); !allowed.ok()) return done(allowed);  // mode none
  Post([this, change = std::move(change), done = std::move(done)](bool run) {
    if (!run) return done(absl::UnavailableError("server is shutting down"));
    const absl::Status status = change();
    changed_();
    done(status);
  });
}

void ModelControl::Post(Task task) {
  {
    MutexLock lock(mu_);
    if (!stopping_ && thread_.joinable()) {
      tasks_.push_back(std::move(task));
      cv_.NotifyOne();
      return;
    }
  }
  task(false);
}

void ModelControl::Stop() {
  std::deque<Task> left;
  {
    MutexLock lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
  {
    MutexLock lock(mu_);
    left.swap(tasks_);
  }
  for (Task& task : left) task(false);
}

void ModelControl::Loop() {
  absl::Time next_poll = absl::Now() + poll_interval_;
  size_t draining = 0;
  while (true) {
    Task task;
    {
      MutexLock lock(mu_);
      absl::Time wake = mode_ == ModelControlMode::kPoll ? next_poll : absl::InfiniteFuture();
      if (draining > 0) wake = std::min(wake, absl::Now() + kRetiredCheck);
      while (!stopping_ && tasks_.empty() && absl::Now() < wake) {
        if (wake == absl::InfiniteFuture()) {
          cv_.Wait(lock);
        } else {
          cv_.WaitUntil(lock, wake);
        }
      }
      if (stopping_) return;
      if (!tasks_.empty()) {
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
    }
    // What reaches here unexpected (the repository turns load errors into
    // statuses) is logged; the thread and the server go on.
    try {
      if (task) task(true);
      if (mode_ == ModelControlMode::kPoll && absl::Now() >= next_poll) {
        LogVerbose(2, "model control: reading the repository again (poll)");
        repository_.SyncAll();
        changed_();
        next_poll = absl::Now() + poll_interval_;
      }
      draining = repository_.CollectRetired();
    } catch (const std::exception& e) {
      LogError(absl::StrCat("model control: ", e.what()));
      next_poll = absl::Now() + poll_interval_;
    }
  }
}

}  // namespace mha::server
