#include "server/models/repository_scan.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "server/models/content_hash.h"
#include "server/observability/logger.h"

namespace mha::server {
namespace fs = std::filesystem;
namespace {

// The version folders under `dir` that hold weights, by number.
std::map<int64_t, std::string> NumberedVersions(const std::string& dir) {
  std::map<int64_t, std::string> found;
  std::error_code error;
  // Error-code overloads throughout: a folder changing while it is read
  // ends the listing early, never in an exception.
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    int64_t version = 0;
    if (!it->is_directory(error) || name.find_first_not_of("0123456789") != std::string::npos ||
        !absl::SimpleAtoi(name, &version) || version < 1) {
      continue;
    }
    const std::string weights = (it->path() / kWeightsFileName).string();
    if (fs::is_regular_file(weights, error)) found[version] = weights;
  }
  return found;
}

// The versions of `available` that `policy` serves.
absl::StatusOr<std::vector<int64_t>> Chosen(const v1::VersionPolicy& policy,
                                            const std::map<int64_t, std::string>& available,
                                            std::map<int64_t, std::string>& missing) {
  std::vector<int64_t> chosen;
  switch (policy.policy_choice_case()) {
    case v1::VersionPolicy::kAll:
      for (const auto& [v, path] : available) chosen.push_back(v);
      break;
    case v1::VersionPolicy::kSpecific:
      for (const int64_t v : policy.specific().versions()) {
        if (v < 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "version_policy: specific versions are positive folder numbers, got ", v));
        }
        if (available.count(v) > 0) {
          chosen.push_back(v);
        } else {
          missing[v] = absl::StrCat("version_policy names version ", v, ", but folder ", v, "/",
                                    kWeightsFileName, " does not exist");
        }
      }
      std::sort(chosen.begin(), chosen.end());
      chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
      break;
    default: {  // latest, the default
      const int64_t n = policy.latest().num_versions();
      if (n < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("version_policy: latest num_versions must be >= 0, got ", n));
      }
      for (auto it = available.rbegin(); it != available.rend(); ++it) {
        if (static_cast<int64_t>(chosen.size()) >= std::max<int64_t>(1, n)) break;
        chosen.insert(chosen.begin(), it->first);
      }
    }
  }
  return chosen;
}

}  // namespace

bool IsValidModelName(const std::string& name) {
  if (name.empty() || name[0] == '.' || name.size() > kMaxModelNameBytes) {
    return false;
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::StatusOr<std::vector<std::string>> ModelFolderNames(const std::string& repository,
                                                          bool log_skipped) {
  std::error_code error;
  fs::directory_iterator it(repository, error);
  if (error) {
    return absl::NotFoundError(
        absl::StrCat("model repository '", repository, "': ", error.message()));
  }
  std::vector<std::string> names;
  for (const fs::directory_iterator end; !error && it != end; it.increment(error)) {
    std::error_code not_a_folder;
    if (!it->is_directory(not_a_folder)) continue;
    const std::string name = it->path().filename().string();
    if (name[0] == '.') continue;  // hidden: e.g. a version being staged
    if (!IsValidModelName(name)) {
      if (!log_skipped) continue;
      LogWarning(absl::StrCat("skipping folder '", name,
                              "': model names match [A-Za-z0-9_.-]+, at most ", kMaxModelNameBytes,
                              " characters"));
      continue;
    }
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<uint64_t> FingerprintCache::Of(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  Entry now;
  now.inode = st.st_ino;
  now.size = static_cast<uint64_t>(st.st_size);
  now.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  now.ctime_ns = int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  auto it = entries_.find(path);
  if (it != entries_.end() && it->second.inode == now.inode && it->second.size == now.size &&
      it->second.mtime_ns == now.mtime_ns && it->second.ctime_ns == now.ctime_ns) {
    return it->second.hash;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<char> chunk(size_t{1} << 20);
  ContentHash hash(now.size);  // the same on every server: versions are compared across them
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    hash.Update(absl::string_view(chunk.data(), static_cast<size_t>(in.gcount())));
  }
  now.hash = hash.Finish();
  entries_[path] = now;
  return now.hash;
}

absl::StatusOr<ModelOnDisk> ScanModelFolder(const std::string& dir, FingerprintCache& cache,
                                            const v1::ModelConfig* config_given) {
  const std::string config_path = config_given != nullptr
                                      ? std::string("config (sent with the load)")
                                      : absl::StrCat(dir, "/", kConfigFileName);
  ModelOnDisk model;
  if (config_given != nullptr) {
    model.config = *config_given;
  } else {
    absl::StatusOr<v1::ModelConfig> config = ReadModelConfig(config_path);
    if (!config.ok()) return config.status();
    model.config = *std::move(config);
  }
  const absl::Status dims = ResolveDims(model.config).status();
  if (!dims.ok()) {
    return absl::Status(dims.code(), absl::StrCat(config_path, ": ", dims.message()));
  }
  const v1::DynamicBatching& batching = model.config.dynamic_batching();
  if (batching.default_priority_level() > batching.priority_levels()) {
    return absl::InvalidArgumentError(absl::StrCat(
        config_path, ": dynamic_batching: default_priority_level ",
        batching.default_priority_level(), " is above priority_levels ", batching.priority_levels(),
        " (levels are 1 to priority_levels; 1 is the highest)"));
  }
  absl::StatusOr<uint64_t> config_hash =
      config_given != nullptr
          ? absl::StatusOr<uint64_t>(HashBytes(config_given->SerializeAsString()))
          : cache.Of(config_path);
  if (!config_hash.ok()) return config_hash.status();

  std::map<int64_t, std::string> available = NumberedVersions(dir);
  const std::string flat_weights = absl::StrCat(dir, "/", kWeightsFileName);
  std::error_code error;
  if (available.empty() && fs::is_regular_file(flat_weights, error)) available[1] = flat_weights;
  absl::StatusOr<std::vector<int64_t>> chosen =
      Chosen(model.config.version_policy(), available, model.missing);
  if (!chosen.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": ", chosen.status().message()));
  }
  for (const int64_t v : *chosen) {
    absl::StatusOr<uint64_t> weights_hash = cache.Of(available[v]);
    if (!weights_hash.ok()) return weights_hash.status();
    model.versions.push_back({v, available[v], CombineHashes(*config_hash, *weights_hash)});
  }
  if (model.versions.empty() && model.missing.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": no ", kWeightsFileName,
                                            " beside the config nor in a numbered version "
                                            "folder (1/",
                                            kWeightsFileName, ")"));
  }
  return model;
}

}  // namespace mha::server
