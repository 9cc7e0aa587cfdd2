// The differential checks of the wire reader and writer against protobuf's
// own parser, shared by wire_test.cc and the fuzzer tests/fuzz/fuzz_wire.cc.
#ifndef MHA_TESTS_PROTO_WIRE_WIRE_CHECK_H_
#define MHA_TESTS_PROTO_WIRE_WIRE_CHECK_H_

#include <string>

#include "absl/types/span.h"
#include "wire/wire_reader.h"

namespace mha::wire::testing {

// `bytes` split into pieces whose sizes cycle through `sizes` (each at
// least 1; the last piece takes the rest).
WirePieces SplitInto(absl::string_view bytes, absl::Span<const int> sizes);

// Reads `bytes` (in `pieces`) as each request the server reads around its
// tensors (AttendRequest, AppendRequest, StreamRequest, ModelInferRequest), and compares with
// protobuf's parse of the bytes: the same verdict, and when accepted the
// same message once the payloads are put back. "" when they agree, else
// what differed.
std::string CheckReadAgrees(absl::string_view bytes, const WirePieces& pieces);

// Parses `bytes` as an AttendResponse, a StreamResponse (with an attend
// answer: written nested) and a ModelInferResponse; for each that parses, writes it again through
// WireWriter (its tensors' data and raw outputs as payloads, some filled, some sent from
// buffers of their own as views) and parses what was written. "" when
// protobuf reads back the same message, else what differed.
std::string CheckWriteRoundTrips(absl::string_view bytes);

}  // namespace mha::wire::testing

#endif  // MHA_TESTS_PROTO_WIRE_WIRE_CHECK_H_
