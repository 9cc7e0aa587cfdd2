// The models a server serves: the folders of a repository, each with the
// versions its policy serves, loaded at start and (with model control)
// loaded, reloaded and unloaded while the server runs, without failing a
// request: a new version is loaded and warmed before it takes requests, and
// one replaced or unloaded finishes what it holds before it is freed.
#ifndef MHA_SERVER_MODELS_MODEL_REPOSITORY_H_
#define MHA_SERVER_MODELS_MODEL_REPOSITORY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/model.h"
#include "engine/mutex.h"
#include "mha/v1/model_config.pb.h"
#include "server/models/model_upload.h"
#include "server/models/repository_scan.h"
#include "server/observability/metrics.h"
#include "server/observability/model_statistics.h"
#include "server/scheduling/batcher.h"

namespace mha::server {

// One loaded version of a model: its engine and the batcher that borrows
// it. Immutable once loaded; shared by the repository and by every request
// in flight on it. Whoever drops the last reference must not be one of its
// batcher's workers (the repository keeps one until the version drained).
struct ModelVersion {
  std::string name;
  int64_t version = 0;
  uint64_t fingerprint = 0;  // what was loaded (see VersionOnDisk)
  LoadedModel loaded;        // its config, dims, layout and engine
  // Both outlive the batcher, which feeds them; the series leave /metrics
  // when the version is freed.
  std::shared_ptr<ModelMetrics> metrics;
  std::unique_ptr<ModelStatistics> statistics;
  std::unique_ptr<Batcher> batcher;

  // A request or step refused before it was queued, received at
  // `arrived`: counted once under `fail` (when the version has statistics).
  void CountRefusal(absl::Time arrived) const {
    if (statistics != nullptr) statistics->RecordFailure(absl::Now() - arrived);
  }
};
using VersionPtr = std::shared_ptr<const ModelVersion>;

// What a model in the table is: its state, its versions (newest first:
// ready ones and those that failed) and its newest ready version, which the
// front ends describe (config, layout, dims).
struct ModelStatus {
  struct Version {
    int64_t version = 0;
    bool ready = false;
    // Why it failed to load; for a ready version, why its last reload
    // failed (it serves what it had).
    std::string error;
  };
  std::string name;
  bool ready = false;  // some version serves
  std::string error;   // the model's own error (config, no version)
  std::vector<Version> versions;
  VersionPtr newest;  // null when none is ready
};

// Settings every model's batcher shares unless its config overrides them.
struct RepositoryOptions {
  WorkerPool* pool = nullptr;  // the server's engine workers (borrowed)
  bool force_batching_off = false;
  MemoryBudget* memory = nullptr;  // the server's budget (borrowed), or none
  // Where models sent over the API are written while they load ("": $TMPDIR
  // or /tmp): the repository's own UploadArea there, made when it is made
  // (removing what dead servers left), gone with it; each load's private
  // folder in it is removed once it is loaded.
  std::string upload_dir;
  // When the repository folder is itself a model folder (its config.pbtxt
  // at the top, as KServe's storage initializer leaves a storageUri that
  // names one model in /mnt/models): the one model's name ("": the
  // folder's own name).
  std::string single_model_name;
};

// Where a load reads a model from (Triton's load parameters): by default
// the repository's folder of the model and its config.pbtxt; `config`
// replaces the config.pbtxt; `files` (relative path -> bytes, valid during
// the load) make the model exactly those files, with `config`, instead of
// the folder.
struct ModelSource {
  std::optional<v1::ModelConfig> config;
  std::map<std::string, absl::string_view> files;
};

// Owns the table of models and their versions, and the versions retired
// from it until they drain. Lookups are thread-safe and never wait for a
// load; Load, Unload, SyncAll and CollectRetired are meant for one control
// thread (they serialize among themselves).
class ModelRepository {
 public:
  ModelRepository(std::string dir, RepositoryOptions options, Metrics& metrics);
  ~ModelRepository();  // Stop()

  // (Re)loads model `name` from its folder: versions its policy serves that
  // are new or whose bytes changed are loaded and warmed, then replace the
  // old ones; versions it no longer serves are retired. A version that
  // fails keeps what served before (if anything) and records the error,
  // which is also returned. A version that failed is tried again only when
  // its bytes changed, unless `retry_failed`. `source` says where from.
  absl::Status Load(const std::string& name, bool retry_failed = true,
                    const ModelSource& source = {});
  // Retires every version of `name` (NOT_FOUND if it is not loaded).
  absl::Status Unload(const std::string& name);
  // Loads every model folder; retires models whose folder is gone.
  void SyncAll();
  // Frees retired versions whose requests have all finished; returns how
  // many are still draining.
  size_t CollectRetired();
  // Computes what is queued everywhere and stops every batcher.
  void Stop();

  // The version a request names (0: the newest ready one). NOT_FOUND names
  // what is served; FAILED_PRECONDITION carries a failed model's error.
  absl::StatusOr<VersionPtr> Find(const std::string& name, int64_t version) const;
  // Whether `name` is in the table (loaded or failed).
  bool Has(const std::string& name) const;
  absl::StatusOr<ModelStatus> Status(const std::string& name) const;
  std::vector<ModelStatus> Statuses() const;
  // Names of models with at least one ready version.
  std::vector<std::string> Ready() const;
  // The ready versions of `name`, ascending (none when it is not loaded).
  std::vector<int64_t> ReadyVersions(const std::string& name) const;
  // Ready versions of `name` ("": every model), all of them or `version`;
  // NOT_FOUND when a named model or version is not served.
  absl::StatusOr<std::vector<VersionPtr>> Select(const std::string& name, int64_t version) const;

  // One line of the repository's index: a version of a model in the table,
  // or (version 0) a model folder that is not loaded.
  struct IndexEntry {
    std::string name;
    int64_t version = 0;
    bool ready = false;
    std::string reason;  // why it is not ready
  };
  std::vector<IndexEntry> Index() const;
  const std::string& dir() const { return dir_; }
  // The one model's name when the repository folder is a model folder,
  // else "".
  const std::string& single_model() const { return single_model_; }
  // The model folders' names on disk (the single model's alone); NOT_FOUND
  // when the repository cannot be read.
  absl::StatusOr<std::vector<std::string>> FolderNames(bool log_skipped = true) const;

 private:
  struct Entry {
    absl::Status status;  // the model's own error (config, no version)
    std::map<int64_t, VersionPtr> ready;
    std::map<int64_t, std::string> errors;            // version -> its last load error
    std::map<int64_t, uint64_t> failed_fingerprints;  // what failed, by version
  };
  absl::StatusOr<VersionPtr> LoadVersion(const std::string& name, const v1::ModelConfig& config,
                                         const VersionOnDisk& on_disk);
  // Moves `versions` out of the table into retired_ (caller holds mu_).
  void Retire(std::vector<VersionPtr> versions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string ServedNames() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ModelStatus StatusOf(const std::string& name, const Entry& entry) const;

  // The folder of model `name`: <dir>/<name>, or the repository itself for
  // its single model.
  std::string FolderOf(const std::string& name) const;

  const std::string dir_;
  const RepositoryOptions options_;
  const std::string single_model_;  // set when dir_ is a model folder
  // Where uploads are written (made at construction), or why there is none.
  const absl::StatusOr<std::unique_ptr<UploadArea>> uploads_;
  Metrics& metrics_;
  Mutex control_mu_;  // one Load / Unload / SyncAll at a time
  FingerprintCache fingerprints_ ABSL_GUARDED_BY(control_mu_);
  mutable Mutex mu_;
  std::map<std::string, Entry> models_ ABSL_GUARDED_BY(mu_);
  std::vector<VersionPtr> retired_ ABSL_GUARDED_BY(mu_);
};

// The batcher settings of a config (defaults for absent fields).
BatcherOptions BatcherOptionsFor(const v1::ModelConfig& config, const RepositoryOptions& options);

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_MODEL_REPOSITORY_H_
