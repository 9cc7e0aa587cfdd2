// The responses written around their tensors' bytes (proto/wire/): each
// output filled once, from the engine's f32 result in its wire dtype, into
// a buffer gRPC sends as it is; the other fields through protobuf.
#ifndef MHA_SERVER_FRONTENDS_WIRE_RESPONSES_H_
#define MHA_SERVER_FRONTENDS_WIRE_RESPONSES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "engine/dtype.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.pb.h"
#include "server/frontends/common/front_end_gate.h"
#include "server/frontends/common/kserve_codec.h"
#include "server/frontends/common/session_codec.h"
#include "wire/wire_writer.h"

namespace mha::server {

// Field `number` of the message being written: a Tensor of `values` in
// `dtype` with `shape`. F32 values with an `owner` (which keeps them alive)
// and `values` already `converted` are sent from where they are; others are
// written once into the message.
void AppendWireTensor(int number, absl::Span<const float> values, const std::vector<int64_t>& shape,
                      DType dtype, const std::shared_ptr<const void>& owner,
                      wire::WireWriter& writer, const ConvertedOutput& converted = {});

// An AttendResponse of `result` from version `version` of `model`.
void WriteAttendResponse(const std::string& model, int64_t version, const ResultLayout& layout,
                         const AttentionResult& result, wire::WireWriter& writer);
// An AppendResponse of a step's result.
void WriteAppendResponse(const StepLayout& layout, const StepResult& result,
                         wire::WireWriter& writer);
// A ModelInferResponse filled with its inline outputs deferred
// (FillInferResponse): those written from their values, the others as they
// are in `response` (empty entries for outputs in shared memory).
void WriteInferResponse(const inference::ModelInferResponse& response,
                        const std::vector<DeferredOutput>& deferred, wire::WireWriter& writer);

// The same as whole messages.
grpc::ByteBuffer AttendResponseBytes(const std::string& model, int64_t version,
                                     const ResultLayout& layout, const AttentionResult& result);
grpc::ByteBuffer AppendResponseBytes(const StepLayout& layout, const StepResult& result);
// `message` serialized by protobuf, as gRPC's buffer.
grpc::ByteBuffer MessageBytes(const google::protobuf::MessageLite& message);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_WIRE_RESPONSES_H_
