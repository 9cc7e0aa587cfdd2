#include "engine/workspace.h"

#include <algorithm>

#include "engine/ops/onednn_matmul.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {

Workspace::Workspace(const dnnl::engine& engine)
    : stream_(std::make_unique<dnnl::stream>(engine)), bound_(std::make_unique<BoundMemories>()) {}

Workspace::~Workspace() = default;

void* Workspace::Get(Slot slot, size_t bytes) {
  constexpr size_t kAlign = 64;
  Buffer& b = buffers_[slot];
  if (bytes > b.capacity || b.aligned == nullptr) {
    // Room to grow a little, at most 1 MiB (long sequences stay bounded).
    const size_t capacity = bytes + std::min<size_t>(bytes / 4, size_t{1} << 20);
    b.storage.reset(new uint8_t[capacity + kAlign]);
    const auto address = reinterpret_cast<uintptr_t>(b.storage.get());
    b.aligned = b.storage.get() + ((kAlign - address % kAlign) % kAlign);
    b.capacity = capacity;
  }
  return b.aligned;
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
