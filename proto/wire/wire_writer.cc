#include "wire/wire_writer.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "engine/large_buffer.h"

namespace mha::wire {
void AppendVarint(uint64_t value, std::string& out) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

namespace {

// Payloads from this size on are allocated apart from gRPC's slices (or
// sent from where they are, kViewMinBytes).
constexpr size_t kLargePayloadBytes = kViewMinBytes;

// What a view's slice calls once gRPC is done with it.
void ReleaseOwner(void* held) { delete static_cast<std::shared_ptr<const void>*>(held); }

// A large payload's buffer from TakeLarge, given back (kept for the next
// call) once gRPC is done with its slice: a fresh one of 8 MiB (an fp16
// output of 16 MiB of f32) was mapped and faulted in afresh every call.
struct TakenBuffer {
  void* data;
  size_t capacity;
};
void ReturnTaken(void* taken) {
  const auto* t = static_cast<TakenBuffer*>(taken);
  ReturnLarge(t->data, t->capacity);
  delete t;
}

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) value >>= 7, ++n;
  return n;
}

}  // namespace

size_t BytesFieldOverhead(int number, size_t size) {
  return VarintSize(static_cast<uint64_t>(number) << 3 | 2) + VarintSize(size);
}

void WireWriter::Append(const google::protobuf::MessageLite& fields) {
  const size_t before = pending_.size();
  fields.AppendToString(&pending_);
  size_ += pending_.size() - before;
}

void WireWriter::AppendTag(int number) {
  const size_t before = pending_.size();
  AppendVarint(static_cast<uint64_t>(number) << 3 | 2, pending_);
  size_ += pending_.size() - before;
}

void WireWriter::AppendPayload(size_t size, Fill fill) {
  const size_t before = pending_.size();
  AppendVarint(size, pending_);
  size_ += pending_.size() - before;
  if (size == 0) return;
  Flush();
  if (size < kLargePayloadBytes) {
    grpc::Slice slice(size);  // uninitialised: `fill` writes every byte
    fill(const_cast<uint8_t*>(slice.begin()));
    slices_.push_back(std::move(slice));
  } else {  // on huge pages (large_buffer.h), owned by the slice
    auto taken = std::make_unique<TakenBuffer>();
    taken->data = TakeLarge(size, &taken->capacity);
    fill(static_cast<uint8_t*>(taken->data));
    void* data = taken->data;
    slices_.reserve(slices_.size() + 1);  // nothing throws past here
    slices_.emplace_back(data, size, &ReturnTaken, taken.release());
  }
  size_ += size;
}

void WireWriter::AppendPayload(absl::Span<const uint8_t> bytes, std::shared_ptr<const void> owner) {
  if (bytes.size() < kViewMinBytes) {
    AppendPayload(bytes.size(),
                  [&](uint8_t* out) { std::memcpy(out, bytes.data(), bytes.size()); });
    return;
  }
  const size_t before = pending_.size();
  AppendVarint(bytes.size(), pending_);
  size_ += pending_.size() - before;
  if (bytes.empty()) return;
  Flush();
  // The slice holds its own reference to the owner; gRPC drops it once sent.
  auto* held = new std::shared_ptr<const void>(std::move(owner));
  slices_.emplace_back(const_cast<uint8_t*>(bytes.data()), bytes.size(), &ReleaseOwner, held);
  size_ += bytes.size();
}

void WireWriter::AppendBytes(int number, size_t size, Fill fill) {
  AppendTag(number);
  AppendPayload(size, fill);
}

void WireWriter::AppendBytes(int number, absl::Span<const uint8_t> bytes,
                             std::shared_ptr<const void> owner) {
  AppendTag(number);
  AppendPayload(bytes, std::move(owner));
}

void WireWriter::AppendMessageHeader(int number, const google::protobuf::MessageLite& fields,
                                     int data_number, size_t size) {
  const size_t fields_size = fields.ByteSizeLong();
  AppendTag(number);
  const size_t before = pending_.size();
  AppendVarint(fields_size + BytesFieldOverhead(data_number, size) + size, pending_);
  size_ += pending_.size() - before;
  Append(fields);
}

void WireWriter::AppendMessageWithBytes(int number, const google::protobuf::MessageLite& fields,
                                        int data_number, size_t size, Fill fill) {
  AppendMessageHeader(number, fields, data_number, size);
  AppendBytes(data_number, size, fill);
}

void WireWriter::AppendMessageWithBytes(int number, const google::protobuf::MessageLite& fields,
                                        int data_number, absl::Span<const uint8_t> bytes,
                                        std::shared_ptr<const void> owner) {
  AppendMessageHeader(number, fields, data_number, bytes.size());
  AppendBytes(data_number, bytes, std::move(owner));
}

void WireWriter::AppendMessage(int number, WireWriter& inner) {
  AppendTag(number);
  const size_t before = pending_.size();
  AppendVarint(inner.size_, pending_);
  size_ += pending_.size() - before;
  inner.Flush();
  if (!inner.slices_.empty()) {
    Flush();
    for (grpc::Slice& slice : inner.slices_) slices_.push_back(std::move(slice));
  }
  size_ += inner.size_;
  inner.slices_.clear();
  inner.size_ = 0;
}

void WireWriter::Flush() {
  if (pending_.empty()) return;
  slices_.emplace_back(pending_);
  pending_.clear();
}

grpc::ByteBuffer WireWriter::Finish() {
  Flush();
  grpc::ByteBuffer buffer(slices_.data(), slices_.size());
  slices_.clear();
  size_ = 0;
  return buffer;
}

}  // namespace mha::wire
