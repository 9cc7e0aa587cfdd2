// A 64-bit hash of bytes that is the same in every process, on every
// machine of one byte order: what identifies a model version across servers
// (absl::Hash is salted per process). Not cryptographic: it tells content
// apart and notices corruption, it does not resist an adversary.
#ifndef MHA_SERVER_MODELS_CONTENT_HASH_H_
#define MHA_SERVER_MODELS_CONTENT_HASH_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace mha::server {

// Accumulates bytes fed in any pieces: the result depends only on the
// concatenation. Plain value type.
class ContentHash {
 public:
  explicit ContentHash(uint64_t seed = 0);
  void Update(absl::string_view bytes);
  uint64_t Finish() const;

 private:
  void Round(const unsigned char* block);  // 32 bytes into the lanes

  uint64_t lanes_[4];
  unsigned char pending_[32];
  uint64_t pending_size_ = 0;
  uint64_t total_ = 0;
};

uint64_t HashBytes(absl::string_view bytes, uint64_t seed = 0);
// An order-dependent combination of two hashes.
uint64_t CombineHashes(uint64_t a, uint64_t b);

}  // namespace mha::server

#endif  // MHA_SERVER_MODELS_CONTENT_HASH_H_
