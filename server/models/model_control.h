// Model control while the server runs (--model_control_mode): one thread
// that loads, reloads and unloads models in the repository, one request at
// a time, re-reads the repository periodically in poll mode, and frees
// versions retired from serving once their requests have finished.
#ifndef MHA_SERVER_MODELS_MODEL_CONTROL_H_
#define MHA_SERVER_MODELS_MODEL_CONTROL_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/mutex.h"
#include "server/models/model_repository.h"

namespace mha::server {

enum class ModelControlMode {
  kNone,      // the repository is read once, at start
  kPoll,      // re-read every poll interval; LoadModel / UnloadModel too
  kExplicit,  // only LoadModel / UnloadModel (and --load_model at start)
};
absl::StatusOr<ModelControlMode> ParseModelControlMode(absl::string_view name);

// What the server loads before it serves: every model folder (modes none
// and poll), or the folders named by --load_model (explicit). Load errors
// are logged and the models kept as failed; the error returned is for an
// unreadable repository, or one with no model folder in mode none.
absl::Status LoadAtStart(ModelRepository& repository, ModelControlMode mode,
                         const std::vector<std::string>& load_models);

// Owns the control thread; borrows the repository, which must outlive it.
// Load and Unload are thread-safe and never block their caller.
class ModelControl {
 public:
  // `changed` runs on the control thread after every load, unload or poll
  // (e.g. to update health).
  ModelControl(ModelRepository& repository, ModelControlMode mode, absl::Duration poll_interval,
               std::function<void()> changed);
  ~ModelControl();  // Stop()

  ModelControlMode mode() const { return mode_; }
  // FAILED_PRECONDITION in mode none (saying how to turn control on), or OK.
  absl::Status Allowed() const;
  // ModelRepository::Load / Unload on the control thread, then `done` with
  // the outcome, there. FAILED_PRECONDITION at once (in the caller) in mode
  // none; UNAVAILABLE when stopping.
  // `source` (Triton's config and files) must stay valid until `done`.
  void Load(std::string name, std::function<void(absl::Status)> done, ModelSource source = {});
  void Unload(std::string name, std::function<void(absl::Status)> done);
  // Answers what is queued with UNAVAILABLE and joins the thread.
  void Stop();

 private:
  using Task = std::function<void(bool run)>;  // run false: stopping
  // Runs `change` on the thread, then `changed_` and `done` with its status.
  void Change(std::function<absl::Status()> change, std::function<void(absl::Status)> done);
  void Post(Task task);
  void Loop();

  ModelRepository& repository_;
  const ModelControlMode mode_;
  const absl::Duration poll_interval_;
  const std::function<void()> changed_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_MODEL_CONTROL_H_
