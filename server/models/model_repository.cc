#include "server/models/model_repository.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <new>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/large_buffer.h"
#include "engine/threads.h"
#include "server/models/model_upload.h"
#include "server/observability/logger.h"
#include "server/scheduling/heap_trim.h"

namespace mha::server {
namespace {

// Tells the log when a model computes in another type than its config asks
// for (this CPU lacks the instructions).
void WarnOfComputeType(const std::string& name, const AttentionDims& asked,
                       const AttentionDims& computed) {
  if (asked.int8) {
    if (!computed.int8) {
      LogWarning(
          absl::StrCat("model '", name,
                       "' asks for int8 compute, but this CPU has no int8 dot products (VNNI or "
                       "AMX-INT8): its projections compute in ",
                       computed.bf16 ? "bf16" : "fp32"));
    } else if (asked.bf16 && !computed.bf16) {
      LogInfo(absl::StrCat("model '", name,
                           "' computes its projections in int8 and its attention in fp32 (this CPU "
                           "has no bf16 instructions)"));
    }
    return;
  }
  if (asked.bf16 && !computed.bf16) {
    LogWarning(absl::StrCat("model '", name,
                            "' asks for bf16 compute, but oneDNN has no bf16 "
                            "kernels on this CPU (they need AVX-512): it computes in fp32"));
  } else if (asked.bf16 && !CpuHasNativeBf16()) {
    LogWarning(
        absl::StrCat("model '", name,
                     "' computes in bf16, but this CPU has no bf16 "
                     "instructions (AVX512-BF16 or AMX): it runs emulated, slower than fp32"));
  }
}

std::string VersionList(const std::map<int64_t, VersionPtr>& ready) {
  std::vector<int64_t> versions;
  for (const auto& [v, ptr] : ready) versions.push_back(v);
  return absl::StrJoin(versions, ", ");
}

}  // namespace

BatcherOptions BatcherOptionsFor(const v1::ModelConfig& config, const RepositoryOptions& options) {
  BatcherOptions b;
  const v1::DynamicBatching& db = config.dynamic_batching();
  b.enabled = !options.force_batching_off && (!db.has_enabled() || db.enabled());
  if (db.max_batch_tokens() > 0) b.max_batch_tokens = db.max_batch_tokens();
  if (db.has_max_batch_tokens_with_steps()) {
    b.max_batch_tokens_with_steps = std::max<int64_t>(0, db.max_batch_tokens_with_steps());
  }
  b.max_queue_delay = absl::Microseconds(std::max<int64_t>(0, db.max_queue_delay_us()));
  if (db.max_queue_size() > 0) b.max_queue_size = db.max_queue_size();
  if (db.max_queue_bytes() > 0) b.max_queue_bytes = db.max_queue_bytes();
  b.priority_levels = db.priority_levels();
  b.default_priority_level =
      db.default_priority_level() > 0 ? db.default_priority_level() : db.priority_levels();
  b.pool = options.pool;
  b.memory = options.memory;
  return b;
}

namespace {

// The single model's name when `dir` is a model folder, else "".
std::string SingleModelName(const std::string& dir, const std::string& flag) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(absl::StrCat(dir, "/", kConfigFileName), error)) return "";
  if (!flag.empty()) return flag;
  std::filesystem::path folder = std::filesystem::path(dir).lexically_normal();
  if (!folder.has_filename()) folder = folder.parent_path();  // "/mnt/models/"
  return folder.filename().string();
}

// The repository's upload area under `base`, logging what it removed.
absl::StatusOr<std::unique_ptr<UploadArea>> MakeUploadArea(const std::string& base) {
  std::vector<std::string> removed;
  absl::StatusOr<std::unique_ptr<UploadArea>> area = UploadArea::Create(base, &removed);
  for (const std::string& folder : removed) {
    LogInfo(absl::StrCat("removed ", folder,
                         ", the upload folder of a server that stopped "
                         "without removing it"));
  }
  if (!area.ok()) {
    LogWarning(absl::StrCat(area.status().message(),
                            "; models sent over the API are refused (see --upload_dir)"));
  }
  return area;
}

}  // namespace

ModelRepository::ModelRepository(std::string dir, RepositoryOptions options, Metrics& metrics)
    : dir_(std::move(dir)),
      options_(options),
      single_model_(SingleModelName(dir_, options_.single_model_name)),
      uploads_(MakeUploadArea(options_.upload_dir)),
      metrics_(metrics) {}

std::string ModelRepository::FolderOf(const std::string& name) const {
  if (!single_model_.empty()) return name == single_model_ ? dir_ : "";
  return absl::StrCat(dir_, "/", name);
}

absl::StatusOr<std::vector<std::string>> ModelRepository::FolderNames(bool log_skipped) const {
  if (!single_model_.empty()) return std::vector<std::string>{single_model_};
  return ModelFolderNames(dir_, log_skipped);
}

ModelRepository::~ModelRepository() { Stop(); }

absl::StatusOr<VersionPtr> ModelRepository::LoadVersion(const std::string& name,
                                                        const v1::ModelConfig& config,
                                                        const VersionOnDisk& on_disk) {
  absl::StatusOr<LoadedModel> loaded = absl::InternalError("not loaded");
  {
    // What reading and packing use (the file's tensors, the unpacked
    // weights, warm-up scratch) goes back to the system when done: only the
    // packed weights and the primitives stay.
    const TightHeapTrim give_back;
    try {  // a version too large for memory must not take the server down
      loaded = LoadModelVersion(config, on_disk.weights_path);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          absl::StrCat(on_disk.weights_path, ": out of memory loading this version"));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(on_disk.weights_path, ": ", e.what()));
    }
  }
  if (!loaded.ok()) return loaded.status();
  auto version = std::make_shared<ModelVersion>();
  version->name = name;
  version->version = on_disk.version;
  version->fingerprint = on_disk.fingerprint;
  version->loaded = *std::move(loaded);
  version->metrics = metrics_.ForVersion(name, absl::StrCat(on_disk.version));
  version->statistics = std::make_unique<ModelStatistics>();
  BatcherOptions batcher_options = BatcherOptionsFor(config, options_);
  batcher_options.statistics = version->statistics.get();
  version->batcher =
      std::make_unique<Batcher>(name, *version->loaded.engine, batcher_options, *version->metrics);
  WarnOfComputeType(name, version->loaded.dims, version->loaded.engine->dims());
  return VersionPtr(std::move(version));
}

absl::Status ModelRepository::Load(const std::string& name, bool retry_failed,
                                   const ModelSource& source) {
  MutexLock control(control_mu_);
  if (!IsValidModelName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("model names match [A-Za-z0-9_.-]+, at most ",
                                                   kMaxModelNameBytes, " characters"));
  }
  if (!source.files.empty() && !source.config.has_value()) {
    return absl::InvalidArgumentError("files sent over the API need a config with them");
  }
  std::optional<UploadFolder> upload;  // the files' private folder, removed once loaded
  std::string folder = FolderOf(name);
  if (!source.files.empty()) {
    if (!uploads_.ok()) return uploads_.status();
    absl::StatusOr<std::string> written = WriteUpload((*uploads_)->path(), source.files);
    if (!written.ok()) return written.status();
    folder = *written;
    upload.emplace(folder);
  }
  std::error_code error;
  if (folder.empty() || !std::filesystem::is_directory(folder, error)) {
    return absl::NotFoundError(
        absl::StrCat("model repository '", dir_, "' has no folder '", name, "'"));
  }
  std::map<int64_t, VersionPtr> current;
  std::map<int64_t, std::string> failed_before;
  std::map<int64_t, uint64_t> failed_fingerprints;
  {
    MutexLock lock(mu_);
    if (auto it = models_.find(name); it != models_.end()) {
      current = it->second.ready;
      failed_before = it->second.errors;
      failed_fingerprints = it->second.failed_fingerprints;
    }
  }
  absl::StatusOr<ModelOnDisk> scan =
      ScanModelFolder(folder, fingerprints_, source.config.has_value() ? &*source.config : nullptr);
  if (!scan.ok()) {  // what served before goes on serving
    const absl::Status failed = absl::FailedPreconditionError(
        absl::StrCat("model '", name, "' failed to load: ", scan.status().message()));
    MutexLock lock(mu_);
    Entry& entry = models_[name];
    if (entry.status != failed) {
      LogError(failed.message());
      metrics_.CountLoadFailure(name);
    }
    entry.status = failed;
    metrics_.SetLoaded(name, !entry.ready.empty());
    return failed;
  }
  std::map<int64_t, VersionPtr> next;
  std::map<int64_t, std::string> errors = scan->missing;
  std::map<int64_t, uint64_t> failed;
  absl::Status first_error;
  for (const VersionOnDisk& v : scan->versions) {
    auto old = current.find(v.version);
    if (old != current.end() && old->second->fingerprint == v.fingerprint) {
      next[v.version] = old->second;  // unchanged
      continue;
    }
    if (auto f = failed_fingerprints.find(v.version);
        !retry_failed && f != failed_fingerprints.end() && f->second == v.fingerprint) {
      errors[v.version] = failed_before[v.version];  // the same bytes: the same error
      failed[v.version] = v.fingerprint;
      if (old != current.end()) next[v.version] = old->second;
      continue;
    }
    absl::StatusOr<VersionPtr> loaded = LoadVersion(name, scan->config, v);
    if (loaded.ok()) {
      next[v.version] = *std::move(loaded);
      LogInfo(absl::StrCat("model '", name, "' version ", v.version,
                           old == current.end() ? " loaded" : " reloaded"));
      continue;
    }
    // Every attempt that failed counts (a poll tries again only bytes that
    // changed).
    const std::string message(loaded.status().message());
    LogError(
        absl::StrCat("model '", name, "' version ", v.version, " failed to load: ", message,
                     old != current.end() ? " (the version loaded before goes on serving)" : ""));
    metrics_.CountLoadFailure(name);
    errors[v.version] = message;
    failed[v.version] = v.fingerprint;
    if (first_error.ok()) {
      first_error = absl::Status(
          loaded.status().code(),
          absl::StrCat("model '", name, "' version ", v.version, " failed to load: ", message));
    }
    if (old != current.end()) next[v.version] = old->second;
  }
  // Versions that failed do not take down what served: versions the policy
  // no longer picks keep serving, newest first, while fewer than it asks for
  // are ready.
  for (auto it = current.rbegin(); it != current.rend(); ++it) {
    if (next.size() >= scan->versions.size()) break;
    if (next.count(it->first) == 0) next[it->first] = it->second;
  }
  MutexLock lock(mu_);
  Entry& entry = models_[name];
  std::vector<VersionPtr> retire;
  for (const auto& [v, ptr] : entry.ready) {
    auto kept = next.find(v);
    if (kept == next.end() || kept->second != ptr) retire.push_back(ptr);
  }
  for (const auto& [v, ptr] : entry.ready) {
    if (next.count(v) == 0) LogInfo(absl::StrCat("model '", name, "' version ", v, " unloaded"));
  }
  entry.ready = std::move(next);
  entry.errors = std::move(errors);
  entry.failed_fingerprints = std::move(failed);
  entry.status = entry.ready.empty()
                     ? absl::FailedPreconditionError(absl::StrCat(
                           "model '", name, "' failed to load: ",
                           entry.errors.empty() ? "no version" : entry.errors.rbegin()->second))
                     : absl::OkStatus();
  metrics_.SetLoaded(name, !entry.ready.empty());
  Retire(std::move(retire));
  return first_error;
}

absl::Status ModelRepository::Unload(const std::string& name) {
  MutexLock control(control_mu_);
  MutexLock lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model '", name, "' is not loaded; this server has: ", ServedNames()));
  }
  std::vector<VersionPtr> retire;
  for (const auto& [v, ptr] : it->second.ready) retire.push_back(ptr);
  models_.erase(it);
  metrics_.SetLoaded(name, false);
  Retire(std::move(retire));
  LogInfo(absl::StrCat("model '", name, "' unloaded"));
  return absl::OkStatus();
}

void ModelRepository::SyncAll() {
  absl::StatusOr<std::vector<std::string>> names = FolderNames(/*log_skipped=*/true);
  if (!names.ok()) {
    LogError(names.status().message());
    return;
  }
  for (const std::string& name : *names) {
    Load(name, /*retry_failed=*/false).IgnoreError();  // logged, kept in the table
  }
  std::vector<std::string> gone;
  {
    MutexLock lock(mu_);
    const std::set<std::string> on_disk(names->begin(), names->end());
    for (const auto& [name, entry] : models_) {
      if (on_disk.count(name) == 0) gone.push_back(name);
    }
  }
  for (const std::string& name : gone) Unload(name).IgnoreError();
}

void ModelRepository::Retire(std::vector<VersionPtr> versions) {
  for (VersionPtr& v : versions) retired_.push_back(std::move(v));
}

size_t ModelRepository::CollectRetired() {
  std::vector<VersionPtr> drained;
  size_t draining = 0;
  {
    MutexLock lock(mu_);
    // use_count() is exact here: a retired version is copied only by the
    // requests already holding it, so once they are gone it stays 1.
    auto first_drained = std::partition(retired_.begin(), retired_.end(),
                                        [](const VersionPtr& v) { return v.use_count() > 1; });
    std::move(first_drained, retired_.end(), std::back_inserter(drained));
    retired_.erase(first_drained, retired_.end());
    draining = retired_.size();
  }
  if (!drained.empty()) {
    const TightHeapTrim give_back;  // what they held goes back to the system
    drained.clear();                // stops their (idle) batchers and frees their engines, here
    ReleaseKeptLarge();             // a model's last calls' buffers (large_buffer.h) go too
  }
  return draining;
}

void ModelRepository::Stop() {
  std::vector<VersionPtr> all;
  {
    MutexLock lock(mu_);
    for (const auto& [name, entry] : models_) {
      for (const auto& [v, ptr] : entry.ready) all.push_back(ptr);
    }
    all.insert(all.end(), retired_.begin(), retired_.end());
  }
  for (const VersionPtr& v : all) v->batcher->Stop();
}

std::string ModelRepository::ServedNames() const {
  std::vector<std::string> names;
  for (const auto& [name, entry] : models_) names.push_back(name);
  return names.empty() ? "no model" : absl::StrJoin(names, ", ");
}

absl::StatusOr<VersionPtr> ModelRepository::Find(const std::string& name, int64_t version) const {
  MutexLock lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model '", name, "' not found; this server has: ", ServedNames()));
  }
  const Entry& entry = it->second;
  if (entry.ready.empty()) return entry.status;
  if (version == 0) return entry.ready.rbegin()->second;
  auto v = entry.ready.find(version);
  if (v == entry.ready.end()) {
    return absl::NotFoundError(absl::StrCat("model '", name, "' has no ready version ", version,
                                            "; it serves version(s) ", VersionList(entry.ready)));
  }
  return v->second;
}

bool ModelRepository::Has(const std::string& name) const {
  MutexLock lock(mu_);
  return models_.count(name) > 0;
}

ModelStatus ModelRepository::StatusOf(const std::string& name, const Entry& entry) const {
  ModelStatus status;
  status.name = name;
  if (!entry.status.ok()) status.error = std::string(entry.status.message());
  std::set<int64_t, std::greater<>> versions;
  for (const auto& [v, ptr] : entry.ready) versions.insert(v);
  for (const auto& [v, error] : entry.errors) versions.insert(v);
  for (const int64_t v : versions) {
    ModelStatus::Version& version = status.versions.emplace_back();
    version.version = v;
    version.ready = entry.ready.count(v) > 0;
    if (auto e = entry.errors.find(v); e != entry.errors.end()) version.error = e->second;
  }
  status.ready = !entry.ready.empty();
  if (status.ready) status.newest = entry.ready.rbegin()->second;
  return status;
}

absl::StatusOr<ModelStatus> ModelRepository::Status(const std::string& name) const {
  MutexLock lock(mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model '", name, "' not found; this server has: ", ServedNames()));
  }
  return StatusOf(name, it->second);
}

std::vector<ModelStatus> ModelRepository::Statuses() const {
  MutexLock lock(mu_);
  std::vector<ModelStatus> all;
  for (const auto& [name, entry] : models_) all.push_back(StatusOf(name, entry));
  return all;
}

std::vector<std::string> ModelRepository::Ready() const {
  MutexLock lock(mu_);
  std::vector<std::string> names;
  for (const auto& [name, entry] : models_) {
    if (!entry.ready.empty()) names.push_back(name);
  }
  return names;
}

std::vector<int64_t> ModelRepository::ReadyVersions(const std::string& name) const {
  MutexLock lock(mu_);
  std::vector<int64_t> versions;
  if (auto it = models_.find(name); it != models_.end()) {
    for (const auto& [v, ptr] : it->second.ready) versions.push_back(v);
  }
  return versions;
}

absl::StatusOr<std::vector<VersionPtr>> ModelRepository::Select(const std::string& name,
                                                                int64_t version) const {
  std::vector<VersionPtr> selected;
  if (name.empty() && version != 0) {
    return absl::InvalidArgumentError("a version needs the model's name");
  }
  if (!name.empty()) {
    absl::StatusOr<VersionPtr> one = Find(name, version);
    if (!one.ok()) return one.status();
    if (version != 0) return std::vector<VersionPtr>{*one};
  }
  MutexLock lock(mu_);
  for (const auto& [model, entry] : models_) {
    if (!name.empty() && model != name) continue;
    for (const auto& [v, ptr] : entry.ready) selected.push_back(ptr);
  }
  return selected;
}

std::vector<ModelRepository::IndexEntry> ModelRepository::Index() const {
  std::vector<IndexEntry> index;
  absl::StatusOr<std::vector<std::string>> on_disk = FolderNames(/*log_skipped=*/false);
  MutexLock lock(mu_);
  std::set<std::string> names;
  for (const auto& [name, entry] : models_) names.insert(name);
  if (on_disk.ok()) names.insert(on_disk->begin(), on_disk->end());
  for (const std::string& name : names) {
    auto it = models_.find(name);
    if (it == models_.end()) {
      index.push_back({name, 0, false, "not loaded"});
      continue;
    }
    const Entry& entry = it->second;
    std::set<int64_t> versions;
    for (const auto& [v, ptr] : entry.ready) versions.insert(v);
    for (const auto& [v, error] : entry.errors) versions.insert(v);
    if (versions.empty()) index.push_back({name, 0, false, std::string(entry.status.message())});
    for (const int64_t v : versions) {
      auto error = entry.errors.find(v);
      index.push_back(
          {name, v, entry.ready.count(v) > 0, error == entry.errors.end() ? "" : error->second});
    }
  }
  return index;
}

}  // namespace mha::server
