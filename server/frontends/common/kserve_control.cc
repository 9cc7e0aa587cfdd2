// KServe v2's repository and shared-memory extensions (Triton's): the
// repository index, loading a model (from its folder or from the files and
// config the request carries) and unloading it, and registering system
// shared-memory regions (CUDA shared memory is refused: no GPU here).
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "mha/v1/model_config.pb.h"
#include "server/frontends/common/kserve_calls.h"
#include "server/models/model_upload.h"

namespace mha::server {

namespace {

using RepositoryParameters =
    google::protobuf::Map<std::string, inference::ModelRepositoryParameter>;

// An unload takes Triton's `unload_dependents` (bool), which tritonclient
// always sends: no model here has dependents, so either value unloads just
// the model.
absl::Status CheckUnloadParameters(const RepositoryParameters& parameters) {
  for (const auto& [name, value] : parameters) {
    if (name != "unload_dependents") {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter \"", name, "\": an unload takes only unload_dependents (bool)"));
    }
    if (value.parameter_choice_case() != inference::ModelRepositoryParameter::kBoolParam) {
      return absl::InvalidArgumentError("parameter unload_dependents: expected bool_param");
    }
  }
  return absl::OkStatus();
}

// A load's source from Triton's parameters: `config` (string_param, the
// JSON mapping of our model config: {"embed_dim": 256, "num_heads": 4})
// replaces config.pbtxt; `file:<path>` (bytes_param) are the model's files,
// with a config. Both only in explicit mode. The source views `parameters`.
absl::StatusOr<ModelSource> LoadSource(const RepositoryParameters& parameters,
                                       ModelControlMode mode) {
  ModelSource source;
  for (const auto& [name, value] : parameters) {
    const bool is_file = absl::StartsWith(name, "file:");
    if (name != "config" && !is_file) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter \"", name, "\": a load takes config (string) and file:<path> (bytes)"));
    }
    if (mode != ModelControlMode::kExplicit) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter \"", name,
                       "\": a model's config or files are taken only with "
                       "--model_control_mode explicit"));
    }
    if (is_file) {
      if (value.parameter_choice_case() != inference::ModelRepositoryParameter::kBytesParam) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", name, ": expected bytes_param"));
      }
      const std::string path = name.substr(strlen("file:"));
      RETURN_IF_ERROR(CheckUploadPath(path));
      source.files[path] = value.bytes_param();
      continue;
    }
    if (value.parameter_choice_case() != inference::ModelRepositoryParameter::kStringParam) {
      return absl::InvalidArgumentError("parameter config: expected string_param (JSON)");
    }
    v1::ModelConfig config;
    const auto parsed = google::protobuf::util::JsonStringToMessage(value.string_param(), &config);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter config: not a model config in JSON: ", parsed.message().as_string()));
    }
    source.config = std::move(config);
  }
  if (!source.files.empty() && !source.config.has_value()) {
    return absl::InvalidArgumentError(
        "file: parameters need a config parameter with them (as Triton)");
  }
  if (source.files.size() > kMaxUploadFiles) {
    return absl::InvalidArgumentError(
        absl::StrCat("at most ", kMaxUploadFiles, " file: parameters per load"));
  }
  return source;
}

}  // namespace

absl::Status KserveCalls::RepositoryCallAllowed(absl::string_view authorization,
                                                const std::string& repository_name) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  RETURN_IF_ERROR(control_.Allowed());
  if (!repository_name.empty() && repository_name != gate_.models().dir()) {
    return absl::InvalidArgumentError(
        absl::StrCat("repository_name: this server has one repository, '", gate_.models().dir(),
                     "' (or leave it empty)"));
  }
  return absl::OkStatus();
}

absl::Status KserveCalls::RepositoryIndex(absl::string_view authorization,
                                          const inference::RepositoryIndexRequest& request,
                                          inference::RepositoryIndexResponse* response) const {
  RETURN_IF_ERROR(RepositoryCallAllowed(authorization, request.repository_name()));
  for (const ModelRepository::IndexEntry& e : gate_.models().Index()) {
    if (request.ready() && !e.ready) continue;
    auto* model = response->add_models();
    model->set_name(e.name);
    if (e.version > 0) model->set_version(absl::StrCat(e.version));
    model->set_state(e.ready ? "READY" : "UNAVAILABLE");
    model->set_reason(e.reason);
  }
  return absl::OkStatus();
}

void KserveCalls::RepositoryModelLoad(absl::string_view authorization,
                                      const inference::RepositoryModelLoadRequest& request,
                                      Done done) {
  absl::Status status = RepositoryCallAllowed(authorization, request.repository_name());
  absl::StatusOr<ModelSource> source = absl::UnknownError("");
  if (status.ok()) source = LoadSource(request.parameters(), control_.mode());
  if (status.ok()) status = source.status();
  if (!status.ok()) return done(status);
  // The request (whose files the source views) lives until done.
  control_.Load(request.model_name(), std::move(done), *std::move(source));
}

void KserveCalls::RepositoryModelUnload(absl::string_view authorization,
                                        const inference::RepositoryModelUnloadRequest& request,
                                        Done done) {
  absl::Status status = RepositoryCallAllowed(authorization, request.repository_name());
  if (status.ok()) status = CheckUnloadParameters(request.parameters());
  if (!status.ok()) return done(status);
  control_.Unload(request.model_name(), std::move(done));
}

absl::Status KserveCalls::SystemSharedMemoryStatus(
    absl::string_view authorization, const inference::SystemSharedMemoryStatusRequest& request,
    inference::SystemSharedMemoryStatusResponse* response) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  ASSIGN_OR_RETURN(std::vector<SharedMemoryRegion> regions, shared_memory_.Status(request.name()));
  for (const SharedMemoryRegion& r : regions) {
    auto& out = (*response->mutable_regions())[r.name];
    out.set_name(r.name);
    out.set_key(r.key);
    out.set_offset(r.offset);
    out.set_byte_size(r.byte_size);
  }
  return absl::OkStatus();
}

absl::Status KserveCalls::SystemSharedMemoryRegister(
    absl::string_view authorization, const inference::SystemSharedMemoryRegisterRequest& request) {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  return shared_memory_.Register(request.name(), request.key(), request.offset(),
                                 request.byte_size());
}

absl::Status KserveCalls::SystemSharedMemoryUnregister(
    absl::string_view authorization,
    const inference::SystemSharedMemoryUnregisterRequest& request) {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  shared_memory_.Unregister(request.name());
  return absl::OkStatus();
}

absl::Status KserveCalls::CudaSharedMemoryStatus(
    absl::string_view authorization,
    const inference::CudaSharedMemoryStatusRequest& request) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  if (!request.name().empty()) {
    return absl::NotFoundError(absl::StrCat("no CUDA shared-memory region ", request.name(),
                                            " is registered (no GPU here)"));
  }
  return absl::OkStatus();
}

absl::Status KserveCalls::CudaSharedMemoryRegister(absl::string_view authorization) const {
  RETURN_IF_ERROR(gate_.Authorize(authorization));
  return absl::UnimplementedError(
      "CUDA shared memory is not served: this server computes on the CPU (use system shared "
      "memory)");
}

absl::Status KserveCalls::CudaSharedMemoryUnregister(absl::string_view authorization) const {
  return gate_.Authorize(authorization);  // none registered: done
}

}  // namespace mha::server
