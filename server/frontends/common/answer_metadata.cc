#include "server/frontends/common/answer_metadata.h"

namespace mha::server {

std::string MessageOf(const absl::Status& status) {
  if (!status.message().empty()) return std::string(status.message());
  return absl::StatusCodeToString(status.code());
}

}  // namespace mha::server
