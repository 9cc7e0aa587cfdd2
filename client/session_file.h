// mha_client export_session / import_session: a session to and from a file
// in the session stream format (MHASESS1, then length-prefixed
// SessionChunk messages: docs/SESSIONS.md), which --session_spill_dir files
// share.
#ifndef MHA_CLIENT_SESSION_FILE_H_
#define MHA_CLIENT_SESSION_FILE_H_

#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.grpc.pb.h"

namespace mha::client {

// Exit codes: 0 done; 1 the server refused (its code and message printed);
// 2 the file could not be written or read.
int ExportSessionToFile(v1::AttentionService::Stub& stub, const std::string& session_id,
                        const std::string& path, std::unique_ptr<grpc::ClientContext> context);
// `new_id` empty: the id in the file.
int ImportSessionFromFile(v1::AttentionService::Stub& stub, const std::string& path,
                          const std::string& new_id, std::unique_ptr<grpc::ClientContext> context);

}  // namespace mha::client

#endif  // MHA_CLIENT_SESSION_FILE_H_
