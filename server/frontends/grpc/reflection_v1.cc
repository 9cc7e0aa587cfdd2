#include "server/frontends/grpc/reflection_v1.h"

#include <set>
#include <utility>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.pb.h"
#include "inference/grpc_service.pb.h"
#include "mha/v1/attention.pb.h"

namespace mha::server {
namespace {

namespace pb = google::protobuf;
namespace rv1 = grpc::reflection::v1;

// Adds `file` and, the first time in this stream, each of its dependencies
// (clients resolve imports from what they are sent).
void AddFile(const pb::FileDescriptor* file, std::set<std::string>& sent,
             rv1::FileDescriptorResponse* out) {
  if (!sent.insert(file->name()).second) return;
  pb::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) AddFile(file->dependency(i), sent, out);
}

void NotFound(const std::string& what, rv1::ServerReflectionResponse* response) {
  rv1::ErrorResponse* error = response->mutable_error_response();
  error->set_error_code(static_cast<int>(grpc::StatusCode::NOT_FOUND));
  error->set_error_message(what + " not found");
}

void Answer(const rv1::ServerReflectionRequest& request, const std::vector<std::string>& services,
            std::set<std::string>& sent, rv1::ServerReflectionResponse* response) {
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  const pb::FileDescriptor* file = nullptr;
  std::string missing;
  switch (request.message_request_case()) {
    case rv1::ServerReflectionRequest::kListServices:
      for (const std::string& name : services) {
        response->mutable_list_services_response()->add_service()->set_name(name);
      }
      return;
    case rv1::ServerReflectionRequest::kFileByFilename:
      file = pool->FindFileByName(request.file_by_filename());
      missing = "file " + request.file_by_filename();
      break;
    case rv1::ServerReflectionRequest::kFileContainingSymbol:
      file = pool->FindFileContainingSymbol(request.file_containing_symbol());
      missing = "symbol " + request.file_containing_symbol();
      break;
    case rv1::ServerReflectionRequest::kFileContainingExtension: {
      const rv1::ExtensionRequest& ext = request.file_containing_extension();
      const pb::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      const pb::FieldDescriptor* field =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, ext.extension_number());
      if (field != nullptr) file = field->file();
      missing =
          "extension " + std::to_string(ext.extension_number()) + " of " + ext.containing_type();
      break;
    }
    case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const pb::Descriptor* type =
          pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr)
        return NotFound("type " + request.all_extension_numbers_of_type(), response);
      std::vector<const pb::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      rv1::ExtensionNumberResponse* out = response->mutable_all_extension_numbers_response();
      out->set_base_type_name(type->full_name());
      for (const pb::FieldDescriptor* e : extensions) out->add_extension_number(e->number());
      return;
    }
    default: {
      rv1::ErrorResponse* error = response->mutable_error_response();
      error->set_error_code(static_cast<int>(grpc::StatusCode::UNIMPLEMENTED));
      error->set_error_message("unknown reflection request");
      return;
    }
  }
  if (file == nullptr) return NotFound(missing, response);
  AddFile(file, sent, response->mutable_file_descriptor_response());
}

}  // namespace

grpc::Status ReflectionV1Service::ServerReflectionInfo(
    grpc::ServerContext*,
    grpc::ServerReaderWriter<rv1::ServerReflectionResponse, rv1::ServerReflectionRequest>* stream) {
  std::set<std::string> sent;  // files this stream has been sent
  rv1::ServerReflectionRequest request;
  while (stream->Read(&request)) {
    rv1::ServerReflectionResponse response;
    response.set_valid_host(request.host());
    *response.mutable_original_request() = request;
    Answer(request, services_, sent, &response);
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

std::vector<std::string> ServedServiceNames() {
  // Naming each descriptor also keeps its generated code linked in, so the
  // generated pool (and both reflections) can describe it.
  return {v1::AttendRequest::descriptor()->file()->service(0)->full_name(),
          inference::ModelInferRequest::descriptor()->file()->service(0)->full_name(),
          grpc::health::v1::HealthCheckRequest::descriptor()->file()->service(0)->full_name(),
          rv1::ServerReflectionRequest::descriptor()->file()->service(0)->full_name(),
          "grpc.reflection.v1alpha.ServerReflection"};
}

}  // namespace mha::server
