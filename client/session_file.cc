#include "client/session_file.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "client/client_common.h"

namespace mha::client {
namespace {

constexpr char kMagic[] = "MHASESS1";

void WriteChunk(std::ofstream& out, const v1::SessionChunk& chunk) {
  const std::string bytes = chunk.SerializeAsString();
  const uint32_t n = static_cast<uint32_t>(bytes.size());
  const unsigned char prefix[4] = {
      static_cast<unsigned char>(n), static_cast<unsigned char>(n >> 8),
      static_cast<unsigned char>(n >> 16), static_cast<unsigned char>(n >> 24)};
  out.write(reinterpret_cast<const char*>(prefix), 4);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

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
  out.write(kMagic, 8);
  v1::SessionChunk chunk;
  int64_t blocks = 0, position = 0;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) position = chunk.header().position();
    if (chunk.part_case() == v1::SessionChunk::kBlock) ++blocks;
    WriteChunk(out, chunk);
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
  char magic[8];
  if (!in || !in.read(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) {
    std::fprintf(stderr, "%s: not a session file\n", path.c_str());
    return 2;
  }
  std::vector<v1::SessionChunk> chunks;
  unsigned char prefix[4];
  std::string bytes;
  while (in.read(reinterpret_cast<char*>(prefix), 4)) {
    const uint32_t n =
        prefix[0] | (prefix[1] << 8) | (prefix[2] << 16) | (static_cast<uint32_t>(prefix[3]) << 24);
    bytes.resize(n);
    if (n > (uint32_t{64} << 20) || !in.read(bytes.data(), n) ||
        !chunks.emplace_back().ParseFromString(bytes)) {
      std::fprintf(stderr, "%s: a truncated or corrupt chunk\n", path.c_str());
      return 2;
    }
  }
  if (chunks.empty() || !chunks[0].has_header()) {
    std::fprintf(stderr, "%s: no session header\n", path.c_str());
    return 2;
  }
  if (!new_id.empty()) chunks[0].mutable_header()->set_session_id(new_id);
  context->AddMetadata("x-session-id", chunks[0].header().session_id());
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
