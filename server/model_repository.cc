#include "server/model_repository.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/threads.h"

namespace mha::server {
namespace {

v1::ModelInfo InfoFor(const ServedModel& m) {
  v1::ModelInfo info;
  info.set_name(m.name);
  if (!m.load_status.ok()) {
    info.set_state(v1::ModelInfo::STATE_FAILED);
    info.set_error(std::string(m.load_status.message()));
    return info;
  }
  info.set_state(v1::ModelInfo::STATE_READY);
  *info.mutable_config() = m.model.config;
  info.set_weight_layout(WeightLayoutName(m.model.layout));
  info.set_parameter_count(m.model.parameter_count);
  info.set_embed_dim(m.model.dims.embed_dim);
  info.set_num_heads(m.model.dims.num_heads);
  info.set_kdim(m.model.dims.kdim);
  info.set_vdim(m.model.dims.vdim);
  return info;
}

std::unique_ptr<ServedModel> LoadOne(const std::filesystem::path& dir,
                                     const RepositoryOptions& options, Metrics& metrics) {
  auto served = std::make_unique<ServedModel>();
  served->name = dir.filename().string();
  ModelMetrics& model_metrics = metrics.ForModel(served->name);
  absl::StatusOr<LoadedModel> loaded = LoadModel(dir.string());
  if (loaded.ok()) {
    served->model = std::move(*loaded);
    served->batcher = std::make_unique<Batcher>(
        served->name, *served->model.engine, BatcherOptionsFor(served->model.config, options),
        model_metrics, metrics);
    if (served->model.dims.bf16 && !served->model.engine->dims().bf16) {
      std::fprintf(stderr,
                   "mha_server: warning: model '%s' asks for bf16 compute, but oneDNN has no "
                   "bf16 kernels on this CPU (they need AVX-512): it computes in fp32\n",
                   served->name.c_str());
    } else if (served->model.dims.bf16 && !CpuHasNativeBf16()) {
      std::fprintf(stderr,
                   "mha_server: warning: model '%s' computes in bf16, but this CPU has no bf16 "
                   "instructions (AVX512-BF16 or AMX): it runs emulated, slower than fp32\n",
                   served->name.c_str());
    }
  } else {
    served->load_status = absl::FailedPreconditionError(
        absl::StrCat("model '", served->name, "' failed to load: ", loaded.status().message()));
    std::fprintf(stderr, "mha_server: %s\n", std::string(served->load_status.message()).c_str());
  }
  model_metrics.loaded->Set(served->load_status.ok() ? 1 : 0);
  served->info = InfoFor(*served);
  return served;
}

}  // namespace

bool IsValidModelName(const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.size() > kMaxModelNameBytes) {
    return false;
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

BatcherOptions BatcherOptionsFor(const v1::ModelConfig& config, const RepositoryOptions& options) {
  BatcherOptions b;
  const v1::DynamicBatching& db = config.dynamic_batching();
  b.enabled = !options.force_batching_off && (!db.has_enabled() || db.enabled());
  if (db.max_batch_tokens() > 0) b.max_batch_tokens = db.max_batch_tokens();
  b.max_queue_delay = absl::Microseconds(std::max<int64_t>(0, db.max_queue_delay_us()));
  if (db.max_queue_size() > 0) b.max_queue_size = db.max_queue_size();
  if (db.max_queue_bytes() > 0) b.max_queue_bytes = db.max_queue_bytes();
  b.workers = options.workers;
  b.compute_threads = options.compute_threads;
  b.memory = options.memory;
  return b;
}

absl::StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Load(
    const std::string& dir, const RepositoryOptions& options, Metrics& metrics) {
  std::error_code error;
  std::filesystem::directory_iterator it(dir, error);
  if (error) {
    return absl::NotFoundError(
        absl::StrCat("model repository '", dir, "': ", error.message()));
  }
  auto repo = std::unique_ptr<ModelRepository>(new ModelRepository());
  for (const std::filesystem::directory_entry& entry : it) {
    if (!entry.is_directory()) continue;
    const std::string name = entry.path().filename().string();
    if (!IsValidModelName(name)) {
      std::fprintf(stderr,
                   "mha_server: skipping folder '%s': model names match [A-Za-z0-9_.-]+, "
                   "at most %zu characters\n",
                   name.c_str(), kMaxModelNameBytes);
      continue;
    }
    repo->models_[name] = LoadOne(entry.path(), options, metrics);
  }
  if (repo->models_.empty()) {
    return absl::NotFoundError(absl::StrCat("model repository '", dir, "' has no model folder"));
  }
  return repo;
}

absl::StatusOr<const ServedModel*> ModelRepository::Find(const std::string& name) const {
  auto it = models_.find(name);
  if (it == models_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, m] : models_) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("model '", name, "' not found; this server has: ",
                                            absl::StrJoin(names, ", ")));
  }
  return it->second.get();
}

std::vector<const ServedModel*> ModelRepository::All() const {
  std::vector<const ServedModel*> all;
  for (const auto& [name, m] : models_) all.push_back(m.get());
  return all;
}

void ModelRepository::Stop() {
  for (auto& [name, m] : models_) {
    if (m->batcher != nullptr) m->batcher->Stop();
  }
}

}  // namespace mha::server
