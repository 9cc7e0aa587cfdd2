#include "server/frontends/mha_v1/session_transfer.h"

#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "server/frontends/common/session_codec.h"
#include "server/sessions/session_stream.h"

namespace mha::server {
namespace {

class ExportReactor final : public grpc::ServerWriteReactor<v1::SessionChunk> {
 public:
  ExportReactor(grpc::CallbackServerContext* context, const v1::ExportSessionRequest& request,
                FrontEndGate& gate, SessionManager& sessions) {
    absl::Status status = gate.Authorize(AuthorizationOf(*context));
    absl::StatusOr<SessionSnapshot> snapshot =
        status.ok() ? sessions.Snapshot(request.session_id()) : status;
    if (!snapshot.ok()) {
      Finish(ToGrpcStatus(snapshot.status()));
      return;
    }
    writer_.emplace(*std::move(snapshot));
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (writer_->Next(chunk_)) return StartWrite(&chunk_);
    writer_.reset();
    Finish(grpc::Status::OK);
  }

  std::optional<SessionChunkWriter> writer_;
  v1::SessionChunk chunk_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::SessionChunk> {
 public:
  ImportReactor(grpc::CallbackServerContext* context, v1::Session* response, FrontEndGate& gate,
                SessionManager& sessions)
      : response_(response),
        sessions_(sessions),
        reader_(LookupIn(gate.models()), sessions.cache_budget()) {
    absl::Status status = gate.Admit(AuthorizationOf(*context));
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    StartRead(&chunk_);
  }
  void OnReadDone(bool ok) override {
    if (ok) {
      if (absl::Status s = reader_.Add(chunk_); !s.ok()) return Finish(ToGrpcStatus(s));
      return StartRead(&chunk_);
    }
    absl::StatusOr<SessionImport> session = reader_.Finish();
    if (!session.ok()) return Finish(ToGrpcStatus(session.status()));
    // A Triton sequence's session ("sequence/<model>/<id>") may move too.
    const bool sequence = absl::StartsWith(session->id, "sequence/") &&
                          session->id.size() <= 2 * kMaxSessionIdLength + 16;
    if (absl::Status s = CheckSessionId(session->id, "session_id"); !s.ok() && !sequence) {
      return Finish(ToGrpcStatus(s));
    }
    session->idle_left = session->idle_timeout;  // brought here on purpose: a fresh timer
    absl::StatusOr<SessionInfo> info = sessions_.Import(*std::move(session));
    if (info.ok()) EncodeSession(*info, response_);
    Finish(ToGrpcStatus(info.status()));
  }
  void OnDone() override { delete this; }

 private:
  v1::Session* const response_;
  SessionManager& sessions_;
  SessionChunkReader reader_;
  v1::SessionChunk chunk_;
};

}  // namespace

grpc::ServerWriteReactor<v1::SessionChunk>* StartExportSession(
    grpc::CallbackServerContext* context, const v1::ExportSessionRequest& request,
    FrontEndGate& gate, SessionManager& sessions) {
  return new ExportReactor(context, request, gate, sessions);
}

grpc::ServerReadReactor<v1::SessionChunk>* StartImportSession(grpc::CallbackServerContext* context,
                                                              v1::Session* response,
                                                              FrontEndGate& gate,
                                                              SessionManager& sessions) {
  return new ImportReactor(context, response, gate, sessions);
}

}  // namespace mha::server
