// RequestAttention: the attention of whole sequences from their
// token-major projections (see request_attention.h); the key-tiled
// sequences' blocks are dealt to threads in request_attention_tiled.cc.
#include "engine/request_attention.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "engine/ops/kernels.h"

namespace mha {
namespace {

using onednn::ActSize;
using onednn::dt;

// Attention blocks up to this many multiply-adds (q.k plus p.v) run in
// plain loops: below it a oneDNN call's fixed cost dominates.
constexpr int64_t kSmallAttentionMacs = int64_t{1} << 18;

// A block takes all heads at once only if it still gets this many query rows.
constexpr int64_t kMinBlockRows = 64;

// The mask as additive f32: F32 masks are used in place, BOOL ones become
// 0 / -inf in `slot`.
const float* AdditiveMask(const MaskView& m, Workspace& ws, Workspace::Slot slot) {
  if (!m.present()) return nullptr;
  if (m.dtype == DType::kF32) return static_cast<const float*>(m.data);
  float* out = ws.Get<float>(slot, static_cast<size_t>(m.num_elements));
  const auto* in = static_cast<const uint8_t*>(m.data);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < m.num_elements; ++i) out[i] = in[i] != 0 ? neg_inf : 0.0f;
  return out;
}

}  // namespace

// `count` consecutive sequences of equal lengths, query rows [row0, row0+rows),
// heads [head0, head0+heads).
struct RequestAttention::Block {
  int64_t first_seq = 0, count = 1;
  int64_t head0 = 0, heads = 1;
  int64_t q_len = 0, kv_len = 0;  // kv_len counts the appended key positions
  int64_t row0 = 0, rows = 0;
  int64_t weights_offset = 0;  // first sequence's weights in the output
};

RequestAttention::RequestAttention(const AttentionDims& dims, const EngineOptions& options,
                                   dt act_dt, std::vector<uint8_t> bias_k,
                                   std::vector<uint8_t> bias_v)
    : dims_(dims),
      options_(options),
      act_dt_(act_dt),
      bias_k_(std::move(bias_k)),
      bias_v_(std::move(bias_v)),
      attention_matmuls_(onednn::CpuEngine()) {
  tiled_ = std::make_unique<TiledAttention>(dims.qk_head_dim, dims.v_head_dim, act_dt_,
                                            dims_.score_scale(), options_.tile_keys,
                                            options_.one_pass, &attention_matmuls_);
  if (options_.runtime_dims_max_scores < 0) {
    options_.runtime_dims_max_scores = dims.bf16 ? 0 : 4 * 128 * 128;
  }
  if (options_.runtime_dims_max_scores > 0) {
    // The layouts of AttentionScores / AttentionContext with the block's
    // size (gh, rows, s) left to run time.
    constexpr int64_t rt = DNNL_RUNTIME_DIM_VAL;
    const int64_t dqk = dims.qk_head_dim, dv = dims.v_head_dim;
    runtime_scores_ = AttentionScoresSpec(act_dt_, rt, rt, rt, dqk, dims_.score_scale());
    runtime_context_ = AttentionContextSpec(act_dt_, act_dt_, rt, rt, rt, dv);
  }
  MakeRuntimePrimitives();
}

void RequestAttention::MakeRuntimePrimitives() const {
  if (runtime_scores_.has_value()) attention_matmuls_.Get(*runtime_scores_);
  if (runtime_context_.has_value()) attention_matmuls_.Get(*runtime_context_);
}

uint8_t* RequestAttention::Attend(const TokenMajor& t, const AttentionBatch& batch,
                                  const AttentionOutputs& out, int64_t context_rows,
                                  Workspace& ws) const {
  const bool weights = !out.weights.empty();
  const Projected p = Project(t, batch, weights, ws);
  AttendSequences(p, batch, out, ws);
  // The token-major projections are dead once split into heads: their
  // buffer takes the context (this bounds scratch memory at long lengths).
  auto* context =
      ws.Get<uint8_t>(Workspace::kProjQ, context_rows * dims_.v_width() * ActSize(act_dt_));
  MergeContexts(p, batch, weights, context);
  return context;
}

int64_t RequestAttention::ScoreCap() const {
  return std::max<int64_t>(1, options_.max_score_bytes / static_cast<int64_t>(sizeof(float)));
}

int64_t RequestAttention::RowsPerBlock(int64_t q_len, int64_t kv_len) const {
  if (kv_len == 0) return std::max<int64_t>(1, q_len);
  const int64_t all_heads = ScoreCap() / (dims_.num_heads * kv_len);
  if (all_heads >= std::min(q_len, kMinBlockRows)) {
    return std::max<int64_t>(1, std::min(q_len, all_heads));
  }
  // Few rows would fit for all heads at once: every key would be read again
  // for each handful of rows. Take more rows and fewer heads per block.
  return std::max<int64_t>(1, std::min(q_len, ScoreCap() / kv_len));
}

int64_t RequestAttention::HeadsPerBlock(int64_t rows, int64_t kv_len) const {
  if (kv_len == 0) return dims_.num_heads;
  return std::clamp<int64_t>(ScoreCap() / (rows * kv_len), 1, dims_.num_heads);
}

bool RequestAttention::Tiled(int64_t q_len, int64_t kv_len, bool weights) const {
  if (weights || options_.tiled_min_keys <= 0) return false;
  if (options_.one_pass_min_rows > 0 && q_len >= options_.one_pass_min_rows && TiledInOnePass()) {
    return true;
  }
  return kv_len >= options_.tiled_min_keys && q_len >= options_.tiled_min_rows;
}

bool RequestAttention::TiledInOnePass() const {
  return tiled_ != nullptr && tiled_->UsesFlashBf16();
}

bool RequestAttention::InPlace(int64_t q_len, int64_t kv_len, bool weights) const {
  return dims_.extra_keys() == 0 && TiledInOnePass() && Tiled(q_len, kv_len, weights);
}

int64_t RequestAttention::QueryBlockRows(int64_t q_len, int64_t kv_len, bool weights) const {
  if (Tiled(q_len, kv_len, weights) && TiledInOnePass()) return OnePassBlockRows(q_len);
  if (Tiled(q_len, kv_len, weights)) {
    return std::clamp<int64_t>(options_.tile_rows, 1, std::max<int64_t>(1, q_len));
  }
  return RowsPerBlock(q_len, kv_len);
}

// One pass packs each key tile once per block: blocks as large as give
// every sequence kOnePassBlocks (head, rows) blocks to share out, in
// multiples of 8 rows (whole groups of the kernel), at least 64 rows, and at
// most kOnePassMaxRows (each block holds an f32 accumulator for its rows).
int64_t RequestAttention::OnePassBlockRows(int64_t q_len) const {
  constexpr int64_t kOnePassBlocks = 8, kOnePassMaxRows = 2048;
  const int64_t per_head = (kOnePassBlocks + dims_.num_heads - 1) / dims_.num_heads;
  const int64_t rows = ((q_len + per_head - 1) / per_head + 7) / 8 * 8;
  return std::max<int64_t>(1, std::min({std::max<int64_t>(rows, 64), kOnePassMaxRows, q_len}));
}

void RequestAttention::SplitSequence(const TokenMajor& t, const AttentionBatch& batch, int64_t b,
                                     bool weights, const Projected& p) const {
  const int64_t h = dims_.num_heads, dqk = dims_.qk_head_dim, dv = dims_.v_head_dim;
  const int64_t qk = dims_.qk_width(), vw = dims_.v_width(), extra = dims_.extra_keys();
  const int64_t act = static_cast<int64_t>(ActSize(act_dt_));
  const std::vector<int64_t>& q_off = batch.q_offsets;
  const std::vector<int64_t>& kv_off = batch.self_attention() ? batch.q_offsets : batch.kv_offsets;
  const int64_t len = q_off[b + 1] - q_off[b], keys = kv_off[b + 1] - kv_off[b];
  const int64_t keys_ext = keys + extra;
  const HeadLayout q_layout{h, dqk * act, len, QueryBlockRows(len, keys_ext, weights)};
  if (InPlace(len, keys_ext, weights)) return;
  SplitHeads(t.q + q_off[b] * t.ldq * act, t.ldq * act, len, q_layout, p.q + q_off[b] * qk * act);
  const HeadLayout k_layout{h, dqk * act, keys_ext, keys_ext};
  const HeadLayout v_layout{h, dv * act, keys_ext, keys_ext};
  uint8_t* k = p.k + p.kv_offsets[b] * qk * act;
  uint8_t* v = p.v + p.kv_offsets[b] * vw * act;
  SplitHeads(t.k + kv_off[b] * t.ldk * act, t.ldk * act, keys, k_layout, k);
  SplitHeads(t.v + kv_off[b] * t.ldv * act, t.ldv * act, keys, v_layout, v);
  int64_t row = keys;
  if (dims_.add_bias_kv) {  // bias_k / bias_v as one more key position
    for (int64_t head = 0; head < h; ++head) {
      std::memcpy(k + k_layout.Offset(head, row), bias_k_.data() + head * dqk * act, dqk * act);
      std::memcpy(v + v_layout.Offset(head, row), bias_v_.data() + head * dv * act, dv * act);
    }
    ++row;
  }
  if (dims_.add_zero_attn) {  // and an all-zero one
    for (int64_t head = 0; head < h; ++head) {
      std::memset(k + k_layout.Offset(head, row), 0, dqk * act);
      std::memset(v + v_layout.Offset(head, row), 0, dv * act);
    }
  }
}

RequestAttention::Projected RequestAttention::Project(const TokenMajor& t,
                                                      const AttentionBatch& batch, bool weights,
                                                      Workspace& ws) const {
  const int64_t qk = dims_.qk_width(), vw = dims_.v_width(), extra = dims_.extra_keys();
  const int64_t n = batch.num_rows(), total_q = batch.q_offsets.back();
  const int64_t act = static_cast<int64_t>(ActSize(act_dt_));
  const std::vector<int64_t>& kv_off = batch.self_attention() ? batch.q_offsets : batch.kv_offsets;
  Projected p;
  p.tokens = t;
  p.kv_offsets = ws.Get<int64_t>(Workspace::kKvOffsets, n + 1);
  for (int64_t b = 0; b <= n; ++b) p.kv_offsets[b] = kv_off[b] + b * extra;
  p.q = ws.Get<uint8_t>(Workspace::kHeadQ, total_q * qk * act);
  p.k = ws.Get<uint8_t>(Workspace::kHeadK, p.kv_offsets[n] * qk * act);
  p.v = ws.Get<uint8_t>(Workspace::kHeadV, p.kv_offsets[n] * vw * act);
  p.context_heads = ws.Get<uint8_t>(Workspace::kHeadContext, total_q * vw * act);
  // Sequences in parallel when there are several (each split alone would
  // often be too small to share out); one alone shares out its rows. (Not
  // an `if` clause: a nested region inside an inactive one makes libgomp
  // start new threads on every call.) In contiguous halves, as oneDNN
  // shares out a batched product's batch: its threads then read heads their
  // own core wrote (8 x 128 bf16 on a VM slow to hand data between cores:
  // scores 0.24 -> 0.17-0.20 ms, context 0.22 -> 0.155 ms).
  const int64_t bytes = (total_q * qk + p.kv_offsets[n] * (qk + vw)) * act;
  if (n > 1 && bytes > kParallelCopyBytes) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; ++b) SplitSequence(t, batch, b, weights, p);
  } else {
    for (int64_t b = 0; b < n; ++b) SplitSequence(t, batch, b, weights, p);
  }
  p.key_padding = AdditiveMask(batch.key_padding_mask, ws, Workspace::kKeyPadF32);
  p.attn_mask = AdditiveMask(batch.attn_mask, ws, Workspace::kMaskF32);
  return p;
}

void RequestAttention::AttendSequences(const Projected& p, const AttentionBatch& batch,
                                       const AttentionOutputs& out, Workspace& ws) const {
  const bool weights = !out.weights.empty();
  const std::vector<int64_t>& q_off = batch.q_offsets;
  const int64_t h = dims_.num_heads, n = batch.num_rows();
  const int64_t score_cap = ScoreCap();
  auto kv_len = [&](int64_t b) { return p.kv_offsets[b + 1] - p.kv_offsets[b]; };
  int64_t weights_offset = 0;
  bool any_tiled = false;
  for (int64_t b = 0; b < n;) {
    if (Tiled(q_off[b + 1] - q_off[b], kv_len(b), weights)) {  // no weights to write
      any_tiled = true;                                        // all of them together below
      ++b;
      continue;
    }
    Block block;
    block.first_seq = b;
    block.weights_offset = weights_offset;
    block.q_len = q_off[b + 1] - q_off[b];
    block.kv_len = kv_len(b);
    const int64_t per_seq = h * block.q_len * block.kv_len;
    // Equal-length neighbours share one batched product.
    while (b + block.count < n && (block.count + 1) * per_seq <= score_cap &&
           q_off[b + block.count + 1] - q_off[b + block.count] == block.q_len &&
           kv_len(b + block.count) == block.kv_len) {
      ++block.count;
    }
    // A long sequence is processed in blocks of query rows (and heads).
    const int64_t row_cap = RowsPerBlock(block.q_len, block.kv_len);
    const int64_t head_cap = HeadsPerBlock(row_cap, block.kv_len);
    for (int64_t row0 = 0; row0 < block.q_len; row0 += row_cap) {
      block.row0 = row0;
      block.rows = std::min(row_cap, block.q_len - row0);
      for (int64_t head0 = 0; head0 < h; head0 += head_cap) {
        block.head0 = head0;
        block.heads = std::min(head_cap, h - head0);
        AttendBlock(block, p, batch, out, ws);
        ws.BetweenBlocks();
      }
    }
    b += block.count;
    weights_offset += block.count * (out.per_head_weights ? per_seq : per_seq / h);
  }
  if (any_tiled) AttendTiled(p, batch, ws);  // yields between its waves
}

void RequestAttention::MergeContexts(const Projected& p, const AttentionBatch& batch, bool weights,
                                     uint8_t* context) const {
  const std::vector<int64_t>& q_off = batch.q_offsets;
  const int64_t h = dims_.num_heads, n = batch.num_rows(), total_q = q_off.back();
  const int64_t vw = dims_.v_width(), act = static_cast<int64_t>(ActSize(act_dt_));
  auto merge = [&](int64_t b) {
    const int64_t len = q_off[b + 1] - q_off[b];
    const int64_t keys = p.kv_offsets[b + 1] - p.kv_offsets[b];
    const HeadLayout layout{h, dims_.v_head_dim * act, len, QueryBlockRows(len, keys, weights)};
    MergeHeads(p.context_heads + q_off[b] * vw * act, layout, len, context + q_off[b] * vw * act,
               vw * act);
  };
  if (n > 1 && total_q * vw * act > kParallelCopyBytes) {  // as in Project, halves too
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; ++b) merge(b);
  } else {
    for (int64_t b = 0; b < n; ++b) merge(b);
  }
}

void RequestAttention::AttendBlock(const Block& blk, const Projected& p,
                                   const AttentionBatch& batch, const AttentionOutputs& out,
                                   Workspace& ws) const {
  const int64_t dqk = dims_.qk_head_dim, dv = dims_.v_head_dim;
  const int64_t b = blk.first_seq, rows = blk.rows, s = blk.kv_len;
  const int64_t gh = blk.count * blk.heads;  // count > 1 only with all heads
  const int64_t act = static_cast<int64_t>(ActSize(act_dt_));
  // The block's q and context: [gh, rows, d], contiguous (the row block's
  // [h, rows, d] from head0 on).
  const int64_t row_start = batch.q_offsets[b] + blk.row0;
  const int64_t q_elem = row_start * dims_.qk_width() + blk.head0 * rows * dqk;
  const int64_t ctx_elem = row_start * dims_.v_width() + blk.head0 * rows * dv;
  if (s == 0) {  // no keys at all: zero probabilities, zero context
    std::memset(p.context_heads + ctx_elem * act, 0, gh * rows * dv * act);
    return;
  }
  // Blocks this small cost more in oneDNN call overhead than in arithmetic.
  const bool small = gh * rows * s * (dqk + dv) <= kSmallAttentionMacs;
  const bool bf16 = act_dt_ == dt::bf16;
  const uint8_t* k = p.k + (p.kv_offsets[b] * dims_.qk_width() + blk.head0 * s * dqk) * act;
  const uint8_t* v = p.v + (p.kv_offsets[b] * dims_.v_width() + blk.head0 * s * dv) * act;
  // scores[gh, rows, s] = scale * q . k^T
  float* scores = ws.Get<float>(Workspace::kScores, gh * rows * s);
  if (small && bf16) {
    SmallScoresBf16(reinterpret_cast<const uint16_t*>(p.q + q_elem * act),
                    reinterpret_cast<const uint16_t*>(k), scores, gh, rows, s, dqk,
                    dims_.score_scale());
  } else if (small) {
    SmallScores(reinterpret_cast<const float*>(p.q + q_elem * act),
                reinterpret_cast<const float*>(k), scores, gh, rows, s, dqk, dims_.score_scale());
  } else {
    AttentionScores(blk, p.q + q_elem * act, k, scores, ws);
  }

  // The oneDNN bf16 product takes bf16 probabilities (f32 ones too only when
  // weights are asked for); the small loops take f32.
  uint16_t* probs_bf16 =
      bf16 && !small ? ws.Get<uint16_t>(Workspace::kProbsBf16, gh * rows * s) : nullptr;
  Softmax(blk, p, batch, scores, probs_bf16,
          /*f32_probs=*/!out.weights.empty());
  if (!out.weights.empty()) WriteWeights(blk, scores, out);
  const void* probs = probs_bf16 == nullptr ? static_cast<const void*>(scores) : probs_bf16;
  // context[g*h, rows, dv] = probs . v
  uint8_t* context = p.context_heads + ctx_elem * act;
  if (small && bf16) {
    SmallContextBf16(scores, reinterpret_cast<const uint16_t*>(v),
                     reinterpret_cast<uint16_t*>(context), gh, rows, s, dv);
  } else if (small) {
    SmallContext(scores, reinterpret_cast<const float*>(v), reinterpret_cast<float*>(context), gh,
                 rows, s, dv);
  } else {
    AttentionContext(blk, probs, v, context, ws);
  }
}

SoftmaxMasks RequestAttention::MasksFor(const Projected& p, const AttentionBatch& batch,
                                        int64_t seq, int64_t q_len, int64_t row0,
                                        int64_t head0) const {
  const int64_t extra = dims_.extra_keys();
  const int64_t keys = p.kv_offsets[seq + 1] - p.kv_offsets[seq] - extra;
  SoftmaxMasks masks;
  masks.masked_cols = keys;  // appended positions are never masked
  masks.causal = batch.is_causal;
  masks.first_row = row0;
  if (p.key_padding != nullptr) {
    masks.key_padding = p.key_padding + p.kv_offsets[seq] - seq * extra;
  }
  if (p.attn_mask != nullptr) {
    masks.attn_row_stride = keys;
    masks.attn_head_stride = batch.attn_mask_per_head ? q_len * keys : 0;
    masks.attn =
        p.attn_mask + batch.attn_mask_offsets[seq] + row0 * keys + head0 * masks.attn_head_stride;
  }
  return masks;
}

void RequestAttention::Softmax(const Block& blk, const Projected& p, const AttentionBatch& batch,
                               float* scores, uint16_t* probs_bf16, bool f32_probs) const {
  const int64_t h = blk.heads, b = blk.first_seq, rows = blk.rows, s = blk.kv_len;
  for (int64_t i = 0; i < blk.count; ++i) {
    const SoftmaxMasks masks = MasksFor(p, batch, b + i, blk.q_len, blk.row0, blk.head0);
    MaskedSoftmax(scores + i * h * rows * s, h, rows, s, masks,
                  probs_bf16 == nullptr ? nullptr : probs_bf16 + i * h * rows * s, f32_probs);
  }
}

void RequestAttention::AttentionScores(const Block& blk, const uint8_t* q, const uint8_t* k,
                                       float* scores, Workspace& ws) const {
  const int64_t gh = blk.count * blk.heads, dqk = dims_.qk_head_dim;
  const int64_t rows = blk.rows, s = blk.kv_len;
  const MatmulSpec spec = AttentionScoresSpec(act_dt_, gh, rows, s, dqk, dims_.score_scale());
  RunAttentionMatmul(blk, spec, runtime_scores_, q, k, scores, ws);
}

void RequestAttention::AttentionContext(const Block& blk, const void* probs, const uint8_t* v,
                                        uint8_t* context, Workspace& ws) const {
  const int64_t gh = blk.count * blk.heads, dv = dims_.v_head_dim;
  const int64_t rows = blk.rows, s = blk.kv_len;
  const MatmulSpec spec = AttentionContextSpec(act_dt_, act_dt_, gh, rows, s, dv);
  RunAttentionMatmul(blk, spec, runtime_context_, probs, v, context, ws);
}

void RequestAttention::RunAttentionMatmul(const Block& blk, const MatmulSpec& spec,
                                          const std::optional<MatmulSpec>& runtime, const void* src,
                                          const void* weights, void* dst, Workspace& ws) const {
  const int64_t scores = blk.count * blk.heads * blk.rows * blk.kv_len;
  if (runtime.has_value() && scores <= options_.runtime_dims_max_scores) {
    ExecuteMatmul(*attention_matmuls_.Get(*runtime), spec, ws, src, weights, dst);
  } else {
    ExecuteMatmul(*attention_matmuls_.Get(spec), ws, src, weights, nullptr, dst);
  }
}

void RequestAttention::WriteWeights(const Block& blk, const float* probs,
                                    const AttentionOutputs& out) const {
  const int64_t h = dims_.num_heads, rows = blk.rows, s = blk.kv_len;
  for (int64_t i = 0; i < blk.count; ++i) {
    const float* seq_probs = probs + i * blk.heads * rows * s;
    if (out.per_head_weights) {
      float* seq_out = out.weights.data() + blk.weights_offset + i * h * blk.q_len * s;
      for (int64_t head = 0; head < blk.heads; ++head) {
        std::memcpy(seq_out + ((blk.head0 + head) * blk.q_len + blk.row0) * s,
                    seq_probs + head * rows * s, sizeof(float) * rows * s);
      }
    } else {
      float* seq_out = out.weights.data() + blk.weights_offset + i * blk.q_len * s;
      AccumulateHeadMean(seq_probs, blk.heads, h, rows, s,
                         /*first=*/blk.head0 == 0, seq_out + blk.row0 * s);
    }
  }
}

}  // namespace mha
