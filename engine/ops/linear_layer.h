// A linear layer (nn.Linear) on oneDNN matmuls, its weights packed once:
// in the activations' type (f32 or bf16), or W8A8 (weights int8 per output
// channel, each call's rows int8 per row, products accumulated in s32).
// Internal to the engine: it throws dnnl::error, which MhaEngine turns into
// absl::Status.
#ifndef MHA_ENGINE_OPS_LINEAR_LAYER_H_
#define MHA_ENGINE_OPS_LINEAR_LAYER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/ops/onednn_matmul.h"
#include "engine/workspace.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace mha {

// How a LinearLayer multiplies: in its activations' type, or in int8.
enum class LinearPrecision {
  kActivations,  // weights packed in the activations' type (f32 or bf16)
  // W8A8: weights quantized once, symmetric, per output channel; each
  // call's rows quantized per row (round to nearest even) and offset by 128
  // for a u8 x s8 product (VNNI, AMX-INT8), s32 sums; the offset's share
  // is taken back per column in the f32 dequantization, which also scales
  // and adds the bias.
  kInt8,
};

// The per-column numbers of an int8 layer: a weight row's scale (max |w| /
// 127) and 128 x the sum of its int8 values (the u8 offset's share of each
// product). Immutable; shared by the column ranges of a stacked layer.
struct Int8Columns {
  std::vector<float> scale;
  std::vector<int32_t> offset_share;
};

// y[m, N] = x[m, K] W^T + b for any m. Owns W (reordered once into the
// format oneDNN picks for this machine) and b, or shares them with the layer
// it is a column range of, and one primitive per m and thread count seen (the
// most recently used 1024, within the process-wide PrimitiveBudget). Immutable after
// construction apart from that cache; thread-safe.
class LinearLayer final {
 public:
  // `weight` is [n, k] row-major (nn.Linear), `bias` [n]. Activations are
  // `act_dt` (f32 or bf16); the output is `dst_dt`.
  LinearLayer(const dnnl::engine& engine, const std::vector<float>& weight,
              const std::vector<float>& bias, int64_t n, int64_t k, onednn::dt act_dt,
              onednn::dt dst_dt, LinearPrecision precision = LinearPrecision::kActivations);

  // Output columns [first, first + count) of `fused` (e.g. q of a stacked
  // q/k/v layer) reading fused's packed weights in place: no copy. Null when
  // this machine's packed format cannot be cut there (the column blocks do
  // not start at `first`, or a layer of `count` columns would be laid out
  // otherwise); the caller then packs the columns itself. `fused` must
  // outlive the result.
  static std::unique_ptr<LinearLayer> ColumnsOf(const LinearLayer& fused, int64_t first,
                                                int64_t count);

  void Run(Workspace& ws, const void* x, int64_t m, void* y) const;
  // What its own packed weights, bias and column numbers hold (0 for a
  // column range of another layer).
  int64_t bytes() const;
  bool shares_weights() const { return !owns_weights_; }
  // The scratchpad oneDNN needs to Run `m` rows (at most), on this
  // machine, at the thread count the layer was made with (the most a call
  // gets). It grows with the rows on some machines: a bf16 GEMM without
  // avx512_bf16 (gemm:jit) keeps an f32 copy of a chunk's output per
  // thread. A line fitted at construction from two primitive descriptors.
  int64_t ScratchpadBytes(int64_t m) const;
  // The workspace an int8 layer's Run of `m` rows takes besides oneDNN's
  // scratchpad (its rows in u8, their scales, the s32 sums), per slot as
  // requested (0 in the activations' type).
  int64_t Int8RowsBytes(int64_t m) const;
  int64_t Int8SumsBytes(int64_t m) const;
  int64_t Int8ScalesBytes(int64_t m) const;
  // The most rows each thread takes when an int8 Run of `m` rows is shared
  // out thread by thread (each in its own child workspace, holding the
  // Int8*Bytes and ScratchpadBytes of that many rows), or 0 when Run
  // shares out each step instead. `threads`: the team Run is called with.
  int64_t Int8ThreadRows(int64_t m, int threads) const;
  // Primitives created since construction (per number of rows and threads).
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  bool int8() const { return precision_ == LinearPrecision::kInt8; }

 private:
  LinearLayer(const dnnl::engine& engine, int64_t n, int64_t k, onednn::dt act_dt,
              onednn::dt dst_dt, LinearPrecision precision);
  dnnl::matmul::primitive_desc MakePd(int64_t m, const dnnl::memory::desc& wei) const;
  std::shared_ptr<const MatmulPrimitive> PrimitiveFor(int64_t m) const;
  // The one for a team of `threads` (the key inside that team's region).
  std::shared_ptr<const MatmulPrimitive> PrimitiveFor(int64_t m, int threads) const;
  // Sets ScratchpadBytes' line once weights_desc_ is final.
  void FitScratchpad();
  // The rows of the chunk Run multiplies next, `m` rows left.
  int64_t ChunkRows(int64_t m) const;
  // The weights quantized per row, packed into weights_; sets int8_.
  void PackInt8(const std::vector<float>& weight);
  void RunInt8(Workspace& ws, const void* x, int64_t m, void* y) const;
  void RunInt8PerThread(Workspace& ws, const void* x, int64_t m, void* y, int threads) const;
  // Rows [first, last) in chunks on `ws`, with the primitives of a team of
  // `threads`.
  void RunInt8Rows(Workspace& ws, const void* x, int64_t first, int64_t last, void* y,
                   int threads) const;
  // The element type of the packed weights.
  onednn::dt weights_dt() const { return int8() ? onednn::dt::s8 : act_dt_; }

  static constexpr size_t kMaxEntries = 1024;
  dnnl::engine engine_;
  int64_t n_, k_;
  onednn::dt act_dt_, dst_dt_;
  LinearPrecision precision_;
  // Own buffers, or the fused layer's (kept alive by these handles).
  dnnl::memory weights_;
  dnnl::memory bias_;
  std::shared_ptr<const Int8Columns> int8_;  // kInt8 only
  bool owns_weights_ = true;
  dnnl::memory::desc weights_desc_;  // this layer's [k, n] in its packed format
  const uint8_t* weights_data_ = nullptr;
  const uint8_t* bias_data_ = nullptr;
  int64_t first_column_ = 0;                                               // in int8_'s columns
  mutable BudgetedPrimitives<std::pair<int64_t, int>> by_m_{kMaxEntries};  // by (m, threads)
  mutable std::atomic<uint64_t> misses_{0};
  // ScratchpadBytes' line: bytes at 0 rows and per row (FitScratchpad).
  int64_t scratchpad_base_ = 0, scratchpad_per_row_ = 0;
};

}  // namespace mha

#endif  // MHA_ENGINE_OPS_LINEAR_LAYER_H_
