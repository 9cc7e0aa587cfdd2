// EngineImpl::ScratchBytes and StepScratchBytes: the workspace a Run or a
// session step needs, from the shape alone.
// It follows Compute slot by slot (see Workspace::Slot); the engine tests
// check it against what a fresh workspace really holds after the run.
#include <algorithm>

#include "engine/engine_impl.h"
#include "engine/ops/flash_bf16.h"

namespace mha {
namespace {

// What Workspace::Get allocates for a request of `bytes`: 25 % room to grow
// (at most 1 MiB) and the alignment.
int64_t Grown(int64_t bytes) {
  if (bytes <= 0) return 0;
  return bytes + std::min<int64_t>(bytes / 4, int64_t{1} << 20) + 64;
}

// An allowance for oneDNN's scratchpad (its GEMM kernels' packing
// buffers) per workspace that runs primitives; the engine tests check the
// whole estimate against what real runs hold.
constexpr int64_t kOnednnScratchpadAllowance = int64_t{4} << 20;

}  // namespace

int64_t EngineImpl::ProjectionScratchpad(int64_t q_rows, int64_t kv_rows) const {
  // One slot serves every primitive of the call: the largest counts.
  int64_t bytes = kOnednnScratchpadAllowance;
  auto need = [&](const std::unique_ptr<LinearLayer>& layer, int64_t rows) {
    if (layer != nullptr) bytes = std::max(bytes, Grown(layer->ScratchpadBytes(rows)));
  };
  // Self-attention rows (kv_rows 0) go through qkv_, or through q_ and the
  // key/value layers when a long request is split (ProjectEncoderMemory).
  const int64_t keys = kv_rows > 0 ? kv_rows : q_rows;
  for (const auto* layer : {&qkv_, &q_, &out_}) need(*layer, q_rows);
  for (const auto* layer : {&kv_, &k_, &v_}) need(*layer, keys);
  // Int8 layers' chunk of u8 rows, scales and s32 sums (a slot each).
  int64_t rows = 0, scales = 0, sums = 0;
  auto need_int8 = [&](const std::unique_ptr<LinearLayer>& layer, int64_t m) {
    if (layer == nullptr || !layer->int8()) return;
    rows = std::max(rows, Grown(layer->Int8RowsBytes(m)));
    scales = std::max(scales, Grown(layer->Int8ScalesBytes(m)));
    sums = std::max(sums, Grown(layer->Int8SumsBytes(m)));
  };
  for (const auto* layer : {&qkv_, &q_, &out_}) need_int8(*layer, q_rows);
  for (const auto* layer : {&kv_, &k_, &v_}) need_int8(*layer, keys);
  return bytes + rows + scales + sums;
}

int64_t EngineImpl::Int8ChildBytes(int64_t q_rows, int64_t kv_rows, int threads) const {
  const int64_t keys = kv_rows > 0 ? kv_rows : q_rows;
  int64_t slots = 0, scratchpad = 0;
  auto need = [&](const std::unique_ptr<LinearLayer>& layer, int64_t m) {
    const int64_t share = layer == nullptr ? 0 : layer->Int8ThreadRows(m, threads);
    if (share == 0) return;
    slots =
        std::max(slots, Grown(layer->Int8RowsBytes(share)) + Grown(layer->Int8ScalesBytes(share)) +
                            Grown(layer->Int8SumsBytes(share)));
    scratchpad = std::max(scratchpad, Grown(layer->ScratchpadBytes(share)));
  };
  for (const auto* layer : {&qkv_, &q_, &out_}) need(*layer, q_rows);
  for (const auto* layer : {&kv_, &k_, &v_}) need(*layer, keys);
  if (slots == 0) return 0;
  return slots + std::max(kOnednnScratchpadAllowance, scratchpad);
}

int64_t EngineImpl::ScratchBytes(const BatchShape& shape, int threads) const {
  const int64_t act = dims_.bf16 ? 2 : 4;
  const int64_t h = dims_.num_heads, dv = dims_.v_head_dim;
  const int64_t qk = dims_.qk_width(), vw = dims_.v_width(), e = dims_.embed_dim;
  const int64_t n = shape.rows;
  if (n <= 0 || shape.q_len <= 0) return 0;  // Run computes nothing
  const int64_t total_q = n * shape.q_len;
  const int64_t total_kv = shape.self_attention ? total_q : n * shape.kv_len;
  const int64_t keys = (shape.self_attention ? shape.q_len : shape.kv_len) + dims_.extra_keys();
  const int64_t total_keys = n * keys;
  int64_t bytes = ProjectionScratchpad(total_q, shape.self_attention ? 0 : total_kv);
  // The children of int8 layers that share their rows out thread by thread.
  int64_t int8_child = Int8ChildBytes(total_q, shape.self_attention ? 0 : total_kv, threads);
  if (in_dt_ == onednn::dt::bf16) {  // activations converted to bf16
    bytes += Grown(total_q * e * 2);
    if (!shape.self_attention) {
      bytes += Grown(total_kv * dims_.kdim * 2);
      if (!shape.value_is_key) bytes += Grown(total_kv * dims_.vdim * 2);
    }
  }
  // Token-major projections (kProjQ later holds the merged context).
  if (shape.self_attention) {
    bytes += Grown(total_q * (2 * qk + vw) * act);  // q|k|v, later the context
  } else {
    bytes += Grown(total_q * std::max(qk, vw) * act);
    bytes += Grown(total_kv * qk * act) + Grown(total_kv * vw * act);
  }
  // Head-major q, k, v and context; key offsets; masks made f32.
  bytes += Grown(total_q * qk * act) + Grown(total_keys * qk * act) + Grown(total_keys * vw * act) +
           Grown(total_q * vw * act);
  bytes += Grown((n + 1) * 8) + Grown(shape.bool_mask_elements * 4);
  if (sequences_->Tiled(shape.q_len, keys, shape.need_weights)) {
    // Each thread's child workspace holds one tile's scores and its
    // accumulators, and runs primitives of its own.
    const int64_t rows = sequences_->QueryBlockRows(shape.q_len, keys, false);
    const int64_t tile = std::min(sequences_->tile_keys(), keys);
    // In one pass: a tile's keys and values in pairs (and the block's query
    // rows), the accumulator and the running max and sum.
    const int64_t child = sequences_->TiledInOnePass()
                              ? Grown((kFlashBf16TileKeys + rows) * (dims_.qk_head_dim + dv) * 2) +
                                    Grown(rows * dv * 4) + Grown(2 * rows * 4)
                              : Grown(rows * tile * 4) + (dims_.bf16 ? Grown(rows * tile * 2) : 0) +
                                    2 * Grown(rows * dv * 4) + Grown(3 * rows * 4) +
                                    kOnednnScratchpadAllowance;
    // The int8 layers' use of the same children shares their scratchpad.
    if (int8_child > 0 && !sequences_->TiledInOnePass()) int8_child -= kOnednnScratchpadAllowance;
    return bytes + std::max(1, threads) * (child + int8_child);
  }
  // The largest block's scores (and bf16 probabilities), as RequestAttention cuts them.
  const int64_t per_seq = h * shape.q_len * keys;
  const int64_t count = per_seq <= sequences_->ScoreCap()
                            ? std::clamp<int64_t>(sequences_->ScoreCap() / per_seq, 1, n)
                            : 1;
  const int64_t rows = sequences_->RowsPerBlock(shape.q_len, keys);
  const int64_t scores = count * sequences_->HeadsPerBlock(rows, keys) * rows * keys;
  return bytes + Grown(scores * 4) + (dims_.bf16 ? Grown(scores * 2) : 0) +
         std::max(1, threads) * int8_child;
}

int64_t EngineImpl::StepScratchBytes(int64_t tokens, int64_t keys, bool need_weights,
                                     int threads) const {
  if (tokens <= 0) return 0;
  const int64_t eb = dims_.bf16 ? 2 : 4;
  const int64_t h = dims_.num_heads, dv = dims_.v_head_dim, e = dims_.embed_dim;
  const int64_t qk = dims_.qk_width(), vw = dims_.v_width();
  int64_t bytes = ProjectionScratchpad(tokens, 0);
  // The query made bf16, and its copy beside Attend rows in a mixed call.
  bytes += 2 * Grown(tokens * e * (in_dt_ == onednn::dt::bf16 ? 2 : 4));
  // q|k|v projected (cross steps too when another step is self), context.
  bytes += Grown(tokens * (2 * qk + vw) * eb) + Grown(tokens * vw * eb);
  if (need_weights) bytes += Grown(h * tokens * keys * 4);  // per head, then averaged
  // Each thread's child: a chunk of score rows of an item's heads (at most
  // kSessionScoreCap floats, or one row of each head when a row is longer;
  // see HeadsPerItem), an accumulator and a bf16 query row per head.
  const int64_t cols = std::max<int64_t>(keys, 1);
  const int64_t heads = std::min(h, std::max<int64_t>(1, StepAttention::kSessionScoreCap / cols));
  const int64_t scores =
      std::min(std::max(StepAttention::kSessionScoreCap, cols), heads * tokens * cols);
  const int64_t child = Grown(scores * 4) + Grown(h * dv * 4) + Grown(h * dims_.qk_head_dim * 2);
  return bytes + std::max(1, threads) * (child + Int8ChildBytes(tokens, 0, threads));
}

}  // namespace mha
