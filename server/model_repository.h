// The models a server serves: every model folder of a repository, loaded
// once at start-up, each with its batcher.
#ifndef MHA_SERVER_MODEL_REPOSITORY_H_
#define MHA_SERVER_MODEL_REPOSITORY_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model.h"
#include "mha/v1/attention.pb.h"
#include "server/batcher.h"
#include "server/metrics.h"

namespace mha::server {

// One model folder: loaded and serving, or failed with its load error.
// Owns the engine and the batcher (which borrows the engine).
struct ServedModel {
  std::string name;
  absl::Status load_status;
  LoadedModel model;                  // engine null when the load failed
  std::unique_ptr<Batcher> batcher;   // null when the load failed
  v1::ModelInfo info;
};

// Settings every model's batcher shares unless its config overrides them.
struct RepositoryOptions {
  int workers = 1;
  int compute_threads = 0;
  bool force_batching_off = false;
  MemoryBudget* memory = nullptr;  // the server's budget (borrowed), or none
};

// Owns every ServedModel. Built once (Load), then read-only apart from
// Stop; lookups are thread-safe.
class ModelRepository {
 public:
  // Loads every sub-folder of `dir`. A folder that fails to load is kept
  // as failed (and logged); only an unreadable `dir` or no model folder at
  // all is an error.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Load(const std::string& dir,
                                                              const RepositoryOptions& options,
                                                              Metrics& metrics);

  // NOT_FOUND for an unknown name.
  absl::StatusOr<const ServedModel*> Find(const std::string& name) const;
  std::vector<const ServedModel*> All() const;
  // Stops every batcher after computing what is queued.
  void Stop();

 private:
  std::map<std::string, std::unique_ptr<ServedModel>> models_;
};

// Model names are folder names matching [A-Za-z0-9_.-]+ (and not "." or
// ".."), at most kMaxModelNameBytes long (they are label values, health
// service names and parts of every error message).
inline constexpr size_t kMaxModelNameBytes = 128;
bool IsValidModelName(const std::string& name);

// The batcher settings of a config (defaults for absent fields).
BatcherOptions BatcherOptionsFor(const v1::ModelConfig& config, const RepositoryOptions& options);

}  // namespace mha::server

#endif  // MHA_SERVER_MODEL_REPOSITORY_H_
