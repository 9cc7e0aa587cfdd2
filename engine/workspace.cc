#include "engine/workspace.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "engine/ops/onednn_matmul.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {

Workspace::Workspace(const dnnl::engine& engine)
    : stream_(std::make_unique<dnnl::stream>(engine)), bound_(std::make_unique<BoundMemories>()) {}

Workspace::~Workspace() = default;

void* Workspace::Get(Slot slot, size_t bytes) {
  Buffer& b = buffers_[slot];
  if (bytes > b.capacity || b.storage == nullptr) {
    // Room to grow a little, at most 1 MiB (long sequences stay bounded).
    const size_t capacity = bytes + std::min<size_t>(bytes / 4, size_t{1} << 20);
    b.storage.reset();  // the old buffer goes before the new one comes
    b.storage = AllocateBuffer(capacity);
    b.capacity = capacity;
  }
  return b.storage.get();
}

std::unique_ptr<uint8_t, FreeLarge> Workspace::AllocateBuffer(size_t bytes) {
  // Large buffers on huge pages (large_buffer.h): 8192 tokens' buffers took
  // 140 ms a call to fault in 4 KiB at a time on a paravirtual guest.
  return std::unique_ptr<uint8_t, FreeLarge>(static_cast<uint8_t*>(AllocateLarge(bytes)));
}

void Workspace::ReserveChildren(int n) {
  while (static_cast<int>(children_.size()) < n) {
    children_.push_back(std::make_unique<Workspace>(stream_->get_engine()));
  }
}

size_t Workspace::bytes_held() const {
  size_t total = 0;
  for (const Buffer& b : buffers_) total += b.capacity;
  for (const auto& child : children_) total += child->bytes_held();
  return total;
}

bool Workspace::ReleaseIfAbove(size_t keep) {
  if (bytes_held() <= keep) return false;
  for (Buffer& b : buffers_) b = Buffer{};
  for (auto& child : children_) child->ReleaseIfAbove(0);
  return true;
}

}  // namespace mha
