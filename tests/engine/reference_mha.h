// A plain-loop multi-head attention (double accumulation), written straight
// from the PyTorch definition, that the engine's tests compare against.
#ifndef MHA_TESTS_REFERENCE_MHA_H_
#define MHA_TESTS_REFERENCE_MHA_H_

#include <cstdint>
#include <vector>

#include "engine/model_config.h"
#include "engine/weights.h"

namespace mha::testing {

// One sequence. Masks are additive (use -inf for a masked position).
struct ReferenceSequence {
  int64_t q_len = 0, kv_len = 0;
  std::vector<float> query;        // [L, E]
  std::vector<float> key, value;   // [S, kdim], [S, vdim]; empty: self
  std::vector<float> key_padding;  // [S] or empty
  std::vector<float> attn_mask;    // [L, S], [h, L, S] or empty
  bool causal = false;
};

struct ReferenceResult {
  std::vector<float> output;        // [L, E]
  std::vector<float> head_weights;  // [h, L, S + extra keys]
};

ReferenceResult ReferenceAttention(const AttentionDims& dims, const PackedWeights& w,
                                   const ReferenceSequence& seq);

}  // namespace mha::testing

#endif  // MHA_TESTS_REFERENCE_MHA_H_
