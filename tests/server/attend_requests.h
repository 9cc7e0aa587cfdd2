// mha.v1 Attend requests for the server's unit tests: wire tensors, a
// self-attention request of a 24-wide, 3-head model (Dims()), decoded.
#ifndef MHA_TESTS_SERVER_ATTEND_REQUESTS_H_
#define MHA_TESTS_SERVER_ATTEND_REQUESTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/attention_dims.h"
#include "engine/attention_request.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/common/request_codec.h"
#include "tests/engine/test_models.h"

namespace mha::server {

inline AttentionDims Dims() { return testing::MakeDims(24, 3); }

inline v1::Tensor Wire(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FP32);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  return t;
}

inline v1::Tensor BoolWire(const std::vector<int64_t>& shape, const std::vector<uint8_t>& values) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_BOOL);
  t.mutable_shape()->Assign(shape.begin(), shape.end());
  t.set_data(std::string(values.begin(), values.end()));
  return t;
}

// A self-attention request of one sequence of `len` tokens.
inline v1::AttendRequest Request(int64_t len, uint32_t seed, bool key_padding = false) {
  v1::AttendRequest r;
  r.set_model("m");
  *r.mutable_query() = Wire({1, len, 24}, testing::RandomVector(len * 24, seed));
  if (key_padding) {
    std::vector<uint8_t> mask(len, 0);
    mask[0] = 1;
    *r.mutable_key_padding_mask() = BoolWire({1, len}, mask);
  }
  return r;
}

// `r` decoded for Dims(), keeping a copy of the message its views point into.
inline AttentionRequest DecodeOwned(const v1::AttendRequest& r) {
  auto owned = std::make_shared<v1::AttendRequest>(r);
  AttentionRequest d = DecodeAttendRequest(*owned, Dims(), {}).value();
  d.KeepAlive(std::move(owned));
  return d;
}

}  // namespace mha::server

#endif  // MHA_TESTS_SERVER_ATTEND_REQUESTS_H_
