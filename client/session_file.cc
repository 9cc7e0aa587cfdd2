#include "client/session_file.h"

#include <cstdio>
#include <fstream>
#include <vector>

#include "client/client_common.h"
#include "mha/v1/session_file.h"

namespace mha::client {

int ExportSessionToFile(v1::AttentionService::Stub& stub, const std::string& session_id,
                        const std::string& path, std::unique_ptr<grpc::ClientContext> context) {
  context->AddMetadata("x-session-id", session_id);
  v1::ExportSessionRequest request;
  request.set_session_id(session_id);
  auto reader = stub.ExportSession(context.get(), request);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return 2;
  }
  v1::SessionFileWriter file(out);
  v1::SessionChunk chunk;
  int64_t blocks = 0, position = 0;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) position = chunk.header().position();
    if (chunk.part_case() == v1::SessionChunk::kBlock) ++blocks;
    file.Write(chunk);
  }
  const grpc::Status status = reader->Finish();
  out.close();
  if (!status.ok()) {
    std::remove(path.c_str());
    return ReportError(status);
  }
  std::printf("session %s: position %lld, %lld blocks written to %s\n", session_id.c_str(),
              static_cast<long long>(position), static_cast<long long>(blocks), path.c_str());
  return 0;
}

int ImportSessionFromFile(v1::AttentionService::Stub& stub, const std::string& path,
                          const std::string& new_id, std::unique_ptr<grpc::ClientContext> context) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return 2;
  }
  v1::SessionFileReader file(in);
  std::vector<v1::SessionChunk> chunks;
  absl::Status read = file.Open();
  while (read.ok()) {
    absl::StatusOr<bool> more = file.Next(chunks.emplace_back());
    read = more.status();
    if (read.ok() && !*more) {
      chunks.pop_back();
      break;
    }
  }
  if (!read.ok()) {
    std::fprintf(stderr, "%s: %s\n", path.c_str(), std::string(read.message()).c_str());
    return 2;
  }
  if (chunks.empty() || !chunks[0].has_header()) {
    std::fprintf(stderr, "%s: no session header\n", path.c_str());
    return 2;
  }
  // The header stays as written (its checksum covers it); the new id goes beside it.
  if (!new_id.empty()) chunks[0].set_import_as(new_id);
  context->AddMetadata("x-session-id", new_id.empty() ? chunks[0].header().session_id() : new_id);
  v1::Session session;
  auto writer = stub.ImportSession(context.get(), &session);
  for (const v1::SessionChunk& chunk : chunks) {
    if (!writer->Write(chunk)) break;  // the server ended the call: Finish says why
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return ReportError(status);
  std::printf("session %s on %s version %lld, position %lld\n", session.session_id().c_str(),
              session.model().c_str(), static_cast<long long>(session.model_version()),
              static_cast<long long>(session.position()));
  return 0;
}

}  // namespace mha::client
