// StepAttention: session steps' attention over their key/value caches
// (see step_attention.h).
#include "engine/step_attention.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/dtype.h"
#include "engine/ops/avx512_kernels.h"
#include "engine/ops/kernels.h"

namespace mha {

using onednn::dt;

StepAttention::StepAttention(const AttentionDims& dims, dt act_dt, std::vector<uint8_t> bias_k,
                             std::vector<uint8_t> bias_v)
    : dims_(dims), act_dt_(act_dt), bias_k_(std::move(bias_k)), bias_v_(std::move(bias_v)) {}

int64_t StepAttention::Keys(const CacheStep& step) const {
  const int64_t cached = step.cache->length() + (step.cross ? 0 : step.tokens);
  return cached + dims_.extra_keys();
}

// One (session step, group of heads) of StepAttention::Attend: where the step's
// query rows, context rows and per-head weights are, from its first head on
// (head g's columns g * head_dim further, its weights g * tokens * keys).
struct StepAttention::SessionHeads {
  const KvCache* cache = nullptr;
  bool cross = false;
  int64_t head = 0;   // the first
  int64_t heads = 1;  // how many
  int64_t tokens = 0;
  int64_t first = 0;           // cached tokens before the step (self); 0 for cross
  const uint8_t* q = nullptr;  // the step's first query row, this head
  int64_t ldq = 0;             // elements, also of the two below
  // A self step's first new key and value rows, first head: written into
  // the cache before the heads attend (cross steps: null).
  const uint8_t* new_keys = nullptr;
  const uint8_t* new_values = nullptr;
  uint8_t* context = nullptr;  // the step's first context row, this head
  int64_t ldc = 0;             // elements
  float* weights = nullptr;    // [heads, tokens, keys'], or null
};

namespace {

// One token's `n` elements of one head into the cache: out[c * stride] =
// in[c], converted from In to Out (f32 -> bf16 rounds to nearest even).
template <typename In, typename Out>
void CopyRow(const uint8_t* in, int64_t n, uint8_t* out, int64_t stride) {
  const auto* from = reinterpret_cast<const In*>(in);
  auto* to = reinterpret_cast<Out*>(out);
  for (int64_t c = 0; c < n; ++c) {
    if constexpr (std::is_same_v<In, Out>) {
      to[c * stride] = from[c];
    } else {
      to[c * stride] = FloatToBf16(from[c]);
    }
  }
}

}  // namespace

static_assert(KvLayout::kBlockTokens == 32, "BlockScores reads blocks of 32 tokens");

namespace {

// The step loops over one item's heads of one cache: a block's keys (or
// values) of heads [first, first + count) lie together, so an item reads
// each block in one run. Each loop fetches what is read `ahead` places
// later (a row's key blocks, then its value blocks; see kernels.h), some
// 8 KiB on, so that the fetches run ahead of the reads by more than the
// memory's latency.
class HeadsReader {
 public:
  HeadsReader(const KvCache& cache, int64_t first, int64_t count)
      : cache_(cache),
        first_(first),
        count_(count),
        dqk_(cache.layout().qk_head_dim),
        dv_(cache.layout().v_head_dim),
        ahead_(std::clamp<int64_t>(8192 / (count * kBt * dqk_ * cache.layout().elem_bytes), 1, 4)) {
  }

  // Scores of head g's query row against block b (of a row reading
  // `limit` keys) into out[0, n): q is f32 or bf16 (`q_bf16`).
  void Scores(int64_t g, int64_t b, int64_t limit, const void* q, bool q_bf16, float* out,
              float scale) const {
    const int64_t n = std::min(kBt, limit - b * kBt), head = first_ + g;
    const uint8_t* kt = cache_.keys(b, head);
    const uint8_t* next = ReadLater(g, b, limit);
    const auto* q16 = static_cast<const uint16_t*>(q);
    const auto* q32 = static_cast<const float*>(q);
    if (cache_.layout().int8()) {
      const auto* kt8 = reinterpret_cast<const int8_t*>(kt);
      const float* scales = cache_.key_scales(b, head);
      if (g == 0 && b + ahead_ < Blocks(limit)) FetchScales(cache_.key_scales(b + ahead_, head));
      if (q_bf16) return BlockScoresBf16Int8(q16, kt8, scales, out, n, dqk_, scale, next);
      return BlockScoresF32Int8(q32, kt8, scales, out, n, dqk_, scale, next);
    }
    if (cache_.layout().elem_bytes == 2) {
      const auto* kt16 = reinterpret_cast<const uint16_t*>(kt);
      if (q_bf16) return BlockScoresBf16(q16, kt16, out, n, dqk_, scale, next);
      return BlockScoresF32Bf16(q32, kt16, out, n, dqk_, scale, next);
    }
    BlockScores(q32, reinterpret_cast<const float*>(kt), out, n, dqk_, scale, next);
  }

  // acc[0, dv) += head g's probabilities of block b . its values (bf16
  // caches: in AccumulateContextBf16's split order).
  void Context(int64_t g, int64_t b, int64_t limit, const float* probs, float* acc) const {
    const int64_t n = std::min(kBt, limit - b * kBt), head = first_ + g;
    const uint8_t* v = cache_.values(b, head);
    const uint8_t* next = ReadLater(g, Blocks(limit) + b, limit);
    if (cache_.layout().int8()) {
      const float* scales = cache_.value_scales(b, head);
      if (g == 0 && b + ahead_ < Blocks(limit)) {
        FetchScales(cache_.value_scales(b + ahead_, head));
      }
      float scaled[kBt];  // the value scales fold into the probabilities
      for (int64_t j = 0; j < n; ++j) scaled[j] = probs[j] * scales[j];
      return AccumulateContextInt8(scaled, reinterpret_cast<const int8_t*>(v), acc, n, dv_, next);
    }
    if (cache_.layout().elem_bytes == 2) {
      return AccumulateContextBf16(probs, reinterpret_cast<const uint16_t*>(v), acc, n, dv_, next);
    }
    AccumulateContext(probs, reinterpret_cast<const float*>(v), acc, n, dv_, next);
  }

 private:
  static constexpr int64_t kBt = KvLayout::kBlockTokens;

  static int64_t Blocks(int64_t limit) { return (limit + kBt - 1) / kBt; }

  // Head g's data `ahead_` places after `place`, or null past the end. A
  // key loop fetches as many bytes as it reads: it runs on into the values
  // only when a head's values are as long as its keys.
  const uint8_t* ReadLater(int64_t g, int64_t place, int64_t limit) const {
    const int64_t later = place + ahead_, blocks = Blocks(limit);
    if (later < blocks) return cache_.keys(later, first_ + g);
    if (later < 2 * blocks && (place >= blocks || dv_ >= dqk_)) {
      return cache_.values(later - blocks, first_ + g);
    }
    return nullptr;
  }

  // The int8 scales of every head of the item (32 floats each, together).
  void FetchScales(const float* scales) const {
    for (int64_t i = 0; i < count_ * kBt; i += 16) __builtin_prefetch(scales + i);
  }

  const KvCache& cache_;
  const int64_t first_, count_, dqk_, dv_, ahead_;
};

}  // namespace

int64_t StepAttention::HeadsPerItem(int64_t steps, int64_t keys) const {
  const int64_t h = dims_.num_heads, threads = omp_get_max_threads();
  int64_t group = std::min(h, std::max<int64_t>(1, kSessionScoreCap / std::max<int64_t>(keys, 1)));
  while (group > 1 && (h % group != 0 || steps * (h / group) < 4 * threads)) --group;
  return group;
}

void StepAttention::Attend(const StepBatch& batch, const uint8_t* proj, int64_t ldq,
                           uint8_t* context, absl::Span<float> out_weights, Workspace& ws) const {
  const int64_t h = dims_.num_heads, qk = dims_.qk_width(), vw = dims_.v_width();
  const int64_t eb = act_dt_ == dt::bf16 ? 2 : 4;
  const bool weights = !out_weights.empty();
  std::vector<SessionHeads> items;
  items.reserve(batch.steps.size() * static_cast<size_t>(h));
  std::vector<int64_t> step_keys;  // Keys before the caches grow
  int64_t weights_heads_total = 0;
  for (const CacheStep& step : batch.steps) {
    step_keys.push_back(Keys(step));
    weights_heads_total += h * step.tokens * step_keys.back();
  }
  float* weights_heads =
      weights ? ws.Get<float>(Workspace::kProbsBf16, weights_heads_total) : nullptr;
  int64_t row = 0, w_off = 0;
  for (size_t i = 0; i < batch.steps.size(); ++i) {
    const CacheStep& step = batch.steps[i];
    const uint8_t* rows = proj + row * ldq * eb;
    const int64_t first = step.cross ? 0 : step.cache->length();
    const int64_t keys = step_keys[i];
    const int64_t group = HeadsPerItem(static_cast<int64_t>(batch.steps.size()), keys);
    for (int64_t head = 0; head < h; head += group) {
      SessionHeads item;
      item.cache = step.cache;
      item.cross = step.cross;
      item.head = head;
      item.heads = group;
      item.tokens = step.tokens;
      item.first = first;
      item.q = rows + head * dims_.qk_head_dim * eb;
      item.ldq = ldq;
      if (!step.cross) {  // this head's new keys and values
        item.new_keys = rows + (qk + head * dims_.qk_head_dim) * eb;
        item.new_values = rows + (2 * qk + head * dims_.v_head_dim) * eb;
      }
      item.context = context + (row * vw + head * dims_.v_head_dim) * eb;
      item.ldc = vw;
      if (weights) item.weights = weights_heads + w_off + head * step.tokens * keys;
      items.push_back(item);
    }
    row += step.tokens;
    w_off += h * step.tokens * keys;
  }
  // Self steps' caches hold the new tokens from here on (each head writes
  // its own before it attends).
  for (const CacheStep& step : batch.steps) {
    if (!step.cross) step.cache->set_length(step.cache->length() + step.tokens);
  }
  ws.ReserveChildren(omp_get_max_threads());
  std::exception_ptr error;
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic)
  for (int64_t i = 0; i < n; ++i) {
    try {
      AttendSessionHeads(items[static_cast<size_t>(i)], ws.Child(omp_get_thread_num()));
    } catch (...) {
#pragma omp critical(mha_session_error)
      if (error == nullptr) error = std::current_exception();
    }
  }
  if (error != nullptr) std::rethrow_exception(error);
  if (!weights) return;
  int64_t in = 0, at = 0;
  for (size_t i = 0; i < batch.steps.size(); ++i) {
    const CacheStep& step = batch.steps[i];
    const int64_t keys = step_keys[i];
    AccumulateHeadMean(weights_heads + in, h, h, step.tokens, keys,
                       /*first=*/true, out_weights.data() + at);
    in += h * step.tokens * keys;
    at += step.tokens * keys;
  }
}

void StepAttention::AttendSessionHeads(const SessionHeads& item, Workspace& ws) const {
  const int64_t dqk = dims_.qk_head_dim, dv = dims_.v_head_dim, bt = KvLayout::kBlockTokens;
  const bool bf16 = act_dt_ == dt::bf16;  // the query, bias_kv and the context
  const int64_t eb = bf16 ? 2 : 4, heads = item.heads;
  const KvCache& cache = *item.cache;
  for (int64_t g = 0; g < heads && item.new_keys != nullptr; ++g) {
    WriteCacheHead(item.new_keys + g * dqk * eb, item.ldq, item.new_values + g * dv * eb, item.ldq,
                   item.tokens, item.first, item.head + g, cache);
  }
  const HeadsReader reader(cache, item.head, heads);
  // An fp32 model's bf16 cache where the CPU has bf16 pair dot products:
  // each query row is rounded to bf16 once and takes the bf16 loop.
  const bool round_query =
      cache.layout().elem_bytes == 2 && !bf16 && ActiveKernelIsa() == KernelIsa::kAvx512Bf16;
  uint16_t* q16 = round_query ? ws.Get<uint16_t>(Workspace::kQueryBf16, heads * dqk) : nullptr;
  const int64_t keys = item.cross ? cache.length() : item.first + item.tokens;
  const int64_t cols = keys + dims_.extra_keys();
  const int64_t chunk = std::clamp<int64_t>(kSessionScoreCap / (cols * heads), 1, item.tokens);
  float* scores = ws.Get<float>(Workspace::kScores, heads * chunk * cols);
  float* acc = ws.Get<float>(Workspace::kTileAcc, heads * dv);
  // The row's keys: all of a cross memory; a self step's up to itself.
  auto limit_of = [&](int64_t r) { return item.cross ? keys : item.first + r + 1; };
  for (int64_t r0 = 0; r0 < item.tokens; r0 += chunk) {
    const int64_t rows = std::min(chunk, item.tokens - r0);
    // Head g's row r of this chunk: scores [heads, rows, cols].
    auto row_of = [&](int64_t g, int64_t r) { return scores + (g * rows + r) * cols; };
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t limit = limit_of(r0 + r);
      const uint8_t* q = item.q + (r0 + r) * item.ldq * eb;  // head g's at + g * dqk
      for (int64_t g = 0; g < heads && round_query; ++g) {
        ConvertToBf16(reinterpret_cast<const float*>(q) + g * dqk, q16 + g * dqk, dqk);
      }
      auto q_of = [&](int64_t g) -> const void* {
        return round_query ? static_cast<const void*>(q16 + g * dqk) : q + g * dqk * eb;
      };
      for (int64_t b = 0; b * bt < limit; ++b) {
        for (int64_t g = 0; g < heads; ++g) {
          reader.Scores(g, b, limit, q_of(g), bf16 || round_query, row_of(g, r) + b * bt,
                        dims_.score_scale());
        }
      }
      for (int64_t g = 0; g < heads; ++g)
        ScoreExtraKeys(item.head + g, q + g * dqk * eb, row_of(g, r) + keys);
    }
    SoftmaxMasks masks;
    masks.masked_cols = keys;
    masks.causal = !item.cross;
    masks.first_row = item.first + r0;
    if (item.cross && !cache.key_padding().empty()) masks.key_padding = cache.key_padding().data();
    MaskedSoftmax(scores, heads, rows, cols, masks);
    for (int64_t g = 0; g < heads && item.weights != nullptr; ++g) {
      std::memcpy(item.weights + (g * item.tokens + r0) * cols, row_of(g, 0),
                  sizeof(float) * rows * cols);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t limit = limit_of(r0 + r);
      std::fill(acc, acc + heads * dv, 0.0f);
      for (int64_t b = 0; b * bt < limit; ++b) {
        for (int64_t g = 0; g < heads; ++g) {
          reader.Context(g, b, limit, row_of(g, r) + b * bt, acc + g * dv);
        }
      }
      for (int64_t g = 0; g < heads; ++g) {
        FinishContextRow(item.head + g, row_of(g, r) + keys, cache.layout().elem_bytes == 2,
                         acc + g * dv, item.context + ((r0 + r) * item.ldc + g * dv) * eb);
      }
    }
  }
}

void StepAttention::ScoreExtraKeys(int64_t head, const uint8_t* q, float* extra) const {
  const int64_t dqk = dims_.qk_head_dim;
  if (dims_.add_bias_kv) {
    if (act_dt_ == dt::bf16) {
      SmallScoresBf16(reinterpret_cast<const uint16_t*>(q),
                      reinterpret_cast<const uint16_t*>(bias_k_.data()) + head * dqk, extra, 1, 1,
                      1, dqk, dims_.score_scale());
    } else {
      SmallScores(reinterpret_cast<const float*>(q),
                  reinterpret_cast<const float*>(bias_k_.data()) + head * dqk, extra, 1, 1, 1, dqk,
                  dims_.score_scale());
    }
    ++extra;
  }
  if (dims_.add_zero_attn) *extra = 0.0f;
}

void StepAttention::FinishContextRow(int64_t head, const float* extra_probs, bool split, float* acc,
                                     uint8_t* out) const {
  const int64_t dv = dims_.v_head_dim;
  const bool bf16 = act_dt_ == dt::bf16;
  if (split) MergeSplitContext(acc, dv);  // back in column order
  if (dims_.add_bias_kv) {                // the zero_attn position adds nothing
    const float p = extra_probs[0];
    if (bf16) {
      const auto* b16 = reinterpret_cast<const uint16_t*>(bias_v_.data()) + head * dv;
      for (int64_t c = 0; c < dv; ++c) acc[c] += p * Bf16ToFloat(b16[c]);
    } else {
      AccumulateContext(extra_probs, reinterpret_cast<const float*>(bias_v_.data()) + head * dv,
                        acc, 1, dv);
    }
  }
  if (bf16) {
    ConvertToBf16(acc, reinterpret_cast<uint16_t*>(out), dv);
  } else {
    std::memcpy(out, acc, sizeof(float) * dv);
  }
}

void StepAttention::WriteCache(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv,
                               int64_t tokens, int64_t first, KvCache& cache) const {
  const int64_t in_eb = act_dt_ == dt::bf16 ? 2 : 4;  // k and v as projected
  for (int64_t head = 0; head < dims_.num_heads; ++head) {
    WriteCacheHead(k + head * dims_.qk_head_dim * in_eb, ldk, v + head * dims_.v_head_dim * in_eb,
                   ldv, tokens, first, head, cache);
  }
}

void StepAttention::WriteCacheHead(const uint8_t* k, int64_t ldk, const uint8_t* v, int64_t ldv,
                                   int64_t tokens, int64_t first, int64_t head,
                                   const KvCache& cache) const {
  const int64_t dqk = dims_.qk_head_dim, dv = dims_.v_head_dim;
  const int64_t eb = cache.layout().elem_bytes, bt = KvLayout::kBlockTokens;
  const int64_t in_eb = act_dt_ == dt::bf16 ? 2 : 4;  // k and v as projected
  // An int8 cache's row of `n` projected elements as f32 (bf16 compute
  // widens it into `widened`).
  const bool int8 = cache.layout().int8();
  std::vector<float> widened(static_cast<size_t>(int8 && in_eb == 2 ? std::max(dqk, dv) : 0));
  auto as_f32 = [&](const uint8_t* row, int64_t n) -> const float* {
    if (in_eb == 4) return reinterpret_cast<const float*>(row);
    const auto* b16 = reinterpret_cast<const uint16_t*>(row);
    for (int64_t c = 0; c < n; ++c) widened[c] = Bf16ToFloat(b16[c]);
    return widened.data();
  };
  // Keys transposed, [dqk, 32]: element c of a token at c * 32 + slot.
  auto copy = in_eb == 2 ? CopyRow<uint16_t, uint16_t>
              : eb == 4  ? CopyRow<float, float>
                         : CopyRow<float, uint16_t>;  // an fp32 model's bf16 cache
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = first + t, block = pos / bt, slot = pos % bt;
    uint8_t* kt = cache.keys(block, head) + slot * eb;
    uint8_t* value = cache.values(block, head) + slot * dv * eb;
    const uint8_t* key_in = k + t * ldk * in_eb;
    const uint8_t* value_in = v + t * ldv * in_eb;
    if (int8) {
      cache.key_scales(block, head)[slot] =
          QuantizeInt8(as_f32(key_in, dqk), dqk, reinterpret_cast<int8_t*>(kt), bt);
      cache.value_scales(block, head)[slot] =
          QuantizeInt8(as_f32(value_in, dv), dv, reinterpret_cast<int8_t*>(value), 1);
    } else {
      copy(key_in, dqk, kt, bt);
      copy(value_in, dv, value, 1);
    }
  }
}

}  // namespace mha
