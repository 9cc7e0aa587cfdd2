// Per-caller scratch memory and oneDNN stream for MhaEngine::Compute.
#ifndef MHA_ENGINE_WORKSPACE_H_
#define MHA_ENGINE_WORKSPACE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engine/large_buffer.h"

namespace dnnl {
struct engine;  // oneapi/dnnl/dnnl.hpp
struct stream;
}  // namespace dnnl

namespace mha {

class BoundMemories;  // engine/ops/onednn_matmul.h

// Thrown by Workspace::BetweenBlocks when the call's stop check says stop;
// the engine's edge answers it with CANCELLED.
struct CallStopped {};

// Owns growable 64-byte-aligned buffers (one per Slot), the oneDNN stream a
// call executes on, and the memory objects bound to the primitives it ran.
// Buffers grow to the largest request seen and are then reused, so
// steady-state calls allocate nothing. Also owns child workspaces, one per
// thread of work that a call shares out. Not thread-safe: one Workspace per
// concurrent caller (e.g. per batch worker); ReserveChildren before a
// parallel region, then each thread uses only Child(its own index). Its
// caller may also give it a yield point, which the engine calls between the
// parts of a long call.
class Workspace {
 public:
  enum Slot {
    kQueryBf16,  // query (or key/value) converted to bf16
    kKeyBf16,
    kValueBf16,
    kProjQ,  // projected q (or q|k|v fused), token-major; later the
             // heads' outputs merged back, [tokens, h*dv]
    kProjK,  // projected k (or k|v fused)
    kProjV,
    kHeadQ,  // q, k, v, context split into heads: [h, len, d] per sequence
    kHeadK,
    kHeadV,
    kHeadContext,
    kScores,  // scores / probabilities, f32
    kProbsBf16,
    kMaskF32,  // masks converted to additive f32
    kKeyPadF32,
    kKvOffsets,  // key offsets with the appended positions, int64
    kOnednnScratchpad,
    kTileAcc,        // key-tiled attention: f32 accumulator [rows, dv],
    kTileProduct,    // one tile's probs . v [rows, dv],
    kTileStats,      // and running max, sum, rescale per row
    kTilePairs,      // the one-pass bf16 kernel's tile of keys and values in pairs (and q)
    kMixedQuery,     // a mixed call's query rows and session steps' rows together
    kStepProj,       // session steps' q|k|v when not projected with the batch
    kStepContext,    // session steps' context, token-major [tokens, h*dv]
    kInt8Rows,       // an int8 projection's rows in u8 (one chunk),
    kInt8RowScales,  // their scales,
    kInt8Sums,       // and the product's s32 sums
    kNumSlots
  };

  explicit Workspace(const dnnl::engine& engine);
  ~Workspace();

  // A buffer of at least `bytes` for `slot`; contents are not preserved
  // when it grows.
  void* Get(Slot slot, size_t bytes);
  template <typename T>
  T* Get(Slot slot, size_t count) {
    return static_cast<T*>(Get(slot, count * sizeof(T)));
  }

  // Makes sure children 0..n-1 exist (call outside parallel regions).
  void ReserveChildren(int n);
  Workspace& Child(int i) { return *children_[static_cast<size_t>(i)]; }
  int num_children() const { return static_cast<int>(children_.size()); }

  // Where the caller may run other short work during a long call: the
  // engine calls `between_blocks` after the projection of a call with
  // sequences and after each block of their attention (each wave of
  // key-tiled blocks), on the calling thread, outside parallel regions.
  // The work must not use this workspace (a server worker runs waiting
  // session steps there, on another one). It returns whether it wants
  // more such points in this call: while it says no, the engine runs its
  // key-tiled blocks in one go (waves cost a barrier each). Empty: none
  // (the default).
  void set_between_blocks(std::function<bool()> between_blocks) {
    between_blocks_ = std::move(between_blocks);
    wants_yields_ = static_cast<bool>(between_blocks_);
  }
  // A check made at the same points, after the yield, and between the
  // blocks of a parallel region: when it answers true, the call stops there
  // (nobody waits for it any more) and the engine returns CANCELLED with
  // its outputs not all written. It costs no barrier: key-tiled blocks run
  // in waves only for the yield point. Empty: none (the default). Set per
  // call, by whoever runs the call.
  void set_stop_check(std::function<bool()> stop_check) { stop_check_ = std::move(stop_check); }
  // Whether the yield point wants to be called (its last answer).
  bool yields() const { return wants_yields_; }
  // Whether the stop check says stop (false without one). The engine asks
  // it at BetweenBlocks, and inside a parallel region of blocks on its
  // thread 0 (the calling thread) between that thread's blocks.
  bool StopRequested() const { return stop_check_ && stop_check_(); }
  // The yield point, then the stop check (throws CallStopped). Called by
  // the engine outside parallel regions only.
  void BetweenBlocks() {
    if (between_blocks_) wants_yields_ = between_blocks_();
    if (StopRequested()) throw CallStopped{};
  }

  dnnl::stream& stream() { return *stream_; }
  // The oneDNN memory objects of the primitives run with this workspace.
  BoundMemories& bound_memories() { return *bound_; }
  // Total bytes currently held, children included (for tests and metrics).
  size_t bytes_held() const;
  // Frees every buffer (children's too) when more than `keep` bytes are
  // held, so one large call does not pin its memory; returns whether it did.
  bool ReleaseIfAbove(size_t keep);

 private:
  struct Buffer {
    std::unique_ptr<uint8_t, FreeLarge> storage;
    size_t capacity = 0;
  };
  // `bytes` (at least), from AllocateLarge. Throws std::bad_alloc.
  static std::unique_ptr<uint8_t, FreeLarge> AllocateBuffer(size_t bytes);
  std::array<Buffer, kNumSlots> buffers_;
  std::unique_ptr<dnnl::stream> stream_;
  std::unique_ptr<BoundMemories> bound_;
  std::vector<std::unique_ptr<Workspace>> children_;
  std::function<bool()> between_blocks_;
  std::function<bool()> stop_check_;
  bool wants_yields_ = false;
};

}  // namespace mha

#endif  // MHA_ENGINE_WORKSPACE_H_
