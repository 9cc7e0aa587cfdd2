// mha.v1 ExportSession (a server stream of SessionChunk) and ImportSession
// (a client stream of them): the session stream format of
// server/sessions/session_stream.h over gRPC.
#ifndef MHA_SERVER_FRONTENDS_SESSION_TRANSFER_H_
#define MHA_SERVER_FRONTENDS_SESSION_TRANSFER_H_

#include "grpcpp/grpcpp.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/grpc/grpc_helpers.h"
#include "server/sessions/session_manager.h"

namespace mha::server {

// Streams the session's chunks, one write at a time, then finishes. The
// session stays open. Owns itself (deleted in OnDone); borrows the
// gate and sessions, which outlive the server.
grpc::ServerWriteReactor<v1::SessionChunk>* StartExportSession(
    grpc::CallbackServerContext* context, const v1::ExportSessionRequest& request,
    FrontEndGate& gate, SessionManager& sessions);

// Reads the chunks, checking each as it arrives (a bad header ends the call
// at once), then imports the session whole, with a fresh idle timer.
// Owns itself.
grpc::ServerReadReactor<v1::SessionChunk>* StartImportSession(grpc::CallbackServerContext* context,
                                                              v1::Session* response,
                                                              FrontEndGate& gate,
                                                              SessionManager& sessions);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_SESSION_TRANSFER_H_
