// The wire reader and writer (proto/wire/) against protobuf's own parser on
// any bytes: the reader accepts and refuses what protobuf does and yields
// the same fields (AttendRequest, AppendRequest, StreamRequest and
// ModelInferRequest, received in pieces of sizes the input's first bytes
// choose); what the writer writes parses to the same message
// (AttendResponse, StreamResponse and ModelInferResponse).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "tests/proto/wire/wire_check.h"

// Protobuf logs every string field that is not UTF-8: not an error here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // The first two bytes: the sizes of the pieces (1 to 256 bytes each).
  const std::vector<int> sizes = {data[0] + 1, data[1] + 1};
  const absl::string_view bytes(reinterpret_cast<const char*>(data + 2), size - 2);
  for (const std::string& error :
       {mha::wire::testing::CheckReadAgrees(bytes, mha::wire::testing::SplitInto(bytes, sizes)),
        mha::wire::testing::CheckWriteRoundTrips(bytes)}) {
    if (!error.empty()) {
      std::fprintf(stderr, "fuzz_wire: %s\n", error.c_str());
      std::abort();
    }
  }
  return 0;
}
