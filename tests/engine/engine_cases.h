// Engine test cases: ragged batches with masks built from a short
// description, run on the engine and checked against the plain-loop
// reference. Shared by the engine's test binaries.
#ifndef MHA_TESTS_ENGINE_CASES_H_
#define MHA_TESTS_ENGINE_CASES_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "engine/mha_engine.h"
#include "tests/engine/reference_mha.h"

namespace mha::testing {

inline constexpr float kInf = std::numeric_limits<float>::infinity();

enum class MaskKind { kNone, kBool, kFloat };

struct Case {
  const char* name;
  AttentionDims dims;
  std::vector<int64_t> q_lens, kv_lens;  // kv_lens empty: self-attention
  bool value_is_key = false;
  MaskKind key_padding = MaskKind::kNone;
  MaskKind attn_mask = MaskKind::kNone;
  bool attn_per_head = true;
  bool causal = false;
  bool per_head_weights = false;
};

AttentionDims Dims(int64_t e, int64_t h);
AttentionDims With(AttentionDims d, void (*edit)(AttentionDims&));

// A ragged batch with its own storage, plus each sequence for the reference.
struct Built {
  std::vector<float> query, key, value, key_pad_f32, mask_f32;
  std::vector<uint8_t> key_pad_bool, mask_bool;
  AttentionBatch batch;
  std::vector<ReferenceSequence> sequences;
};
Built Build(const Case& c, uint32_t seed);
// Points `view` at the bool or float copy of a mask (nothing for kNone).
void AttachMask(MaskKind kind, const std::vector<uint8_t>& bools, const std::vector<float>& floats,
                MaskView& view);

struct RunResult {
  std::vector<float> output, weights;
};
// Runs `b` on a new workspace (or on `ws` when given), asking for the
// attention weights unless `with_weights` is false.
RunResult RunEngine(const MhaEngine& engine, const Case& c, const Built& b,
                    bool with_weights = true, Workspace* ws = nullptr);

// Largest |a - b|, or infinity on NaN.
float MaxAbsDiff(const float* a, const float* b, size_t n);

// Compares every sequence's output (and, when `check_weights`, weights)
// with the reference.
void ExpectMatchesReference(const Case& c, const PackedWeights& w, const Built& b,
                            const RunResult& got, float tolerance, bool check_weights = true);

std::unique_ptr<MhaEngine> MakeEngine(const AttentionDims& d, const PackedWeights& w,
                                      EngineOptions options = {});

// Every option on odd sizes (E=24, h=3, L=1, S=1, L != S, ragged batches).
std::vector<Case> AllCases();

}  // namespace mha::testing

#endif  // MHA_TESTS_ENGINE_CASES_H_
