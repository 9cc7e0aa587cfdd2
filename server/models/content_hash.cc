#include "server/models/content_hash.h"

#include <algorithm>
#include <cstring>

namespace mha::server {
namespace {

constexpr uint64_t kMulA = 0x9E3779B185EBCA87ull;  // odd constants with well-spread bits
constexpr uint64_t kMulB = 0xC2B2AE3D27D4EB4Full;

uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A lane step: the word multiplied in, rotated, multiplied again.
uint64_t Mix(uint64_t lane, uint64_t word) { return Rotl(lane + word * kMulB, 31) * kMulA; }

// Spreads every input bit over every output bit.
uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h;
}

}  // namespace

ContentHash::ContentHash(uint64_t seed)
    : lanes_{seed + kMulA + kMulB, seed + kMulB, seed, seed - kMulA} {}

void ContentHash::Round(const unsigned char* block) {
  for (int i = 0; i < 4; ++i) lanes_[i] = Mix(lanes_[i], Load64(block + 8 * i));
}

void ContentHash::Update(absl::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  size_t n = bytes.size();
  total_ += n;
  if (pending_size_ > 0) {
    const size_t take = std::min<size_t>(n, 32 - pending_size_);
    std::memcpy(pending_ + pending_size_, p, take);
    pending_size_ += take;
    p += take;
    n -= take;
    if (pending_size_ < 32) return;
    Round(pending_);
    pending_size_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32) Round(p);
  std::memcpy(pending_, p, n);
  pending_size_ = n;
}

uint64_t ContentHash::Finish() const {
  uint64_t h = Rotl(lanes_[0], 1) + Rotl(lanes_[1], 7) + Rotl(lanes_[2], 12) + Rotl(lanes_[3], 18);
  for (int i = 0; i < 4; ++i) h = (h ^ Mix(0, lanes_[i])) * kMulA + kMulB;
  h += total_;
  for (uint64_t i = 0; i < pending_size_; ++i) h = Rotl(h ^ (pending_[i] * kMulB), 11) * kMulA;
  return Avalanche(h);
}

uint64_t HashBytes(absl::string_view bytes, uint64_t seed) {
  ContentHash hash(seed);
  hash.Update(bytes);
  return hash.Finish();
}

uint64_t CombineHashes(uint64_t a, uint64_t b) {
  return Avalanche(a ^ Rotl(b * kMulA, 29) ^ kMulB);
}

}  // namespace mha::server
