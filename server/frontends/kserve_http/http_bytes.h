// Bytes an HTTP response sends as they are.
#ifndef MHA_SERVER_FRONTENDS_KSERVE_HTTP_HTTP_BYTES_H_
#define MHA_SERVER_FRONTENDS_KSERVE_HTTP_HTTP_BYTES_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"

namespace mha::server {

// A part of a response body: a string of its own, or a view of memory that
// `owner` keeps alive (an engine call's output, sent with no copy). Not
// thread-safe.
struct HttpBytes {
  HttpBytes() = default;
  explicit HttpBytes(std::string own) : owned(std::move(own)) {}
  HttpBytes(absl::string_view bytes, std::shared_ptr<const void> keeps_alive)
      : view(bytes), owner(std::move(keeps_alive)) {}

  absl::string_view bytes() const { return owner != nullptr ? view : absl::string_view(owned); }

  std::string owned;
  absl::string_view view;  // sent instead of `owned` when `owner` is set
  std::shared_ptr<const void> owner;
};

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_KSERVE_HTTP_HTTP_BYTES_H_
