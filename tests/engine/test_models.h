// Test fixtures: random attention weights and their checkpoint tensors in
// each weight layout.
#ifndef MHA_TESTS_TEST_MODELS_H_
#define MHA_TESTS_TEST_MODELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "engine/mha_engine.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/weights.h"
#include "mha/v1/model_config.pb.h"

namespace mha::testing {

// Self-attention dims: kdim = vdim = embed_dim, head dims embed_dim / heads,
// everything else default.
AttentionDims MakeDims(int64_t embed_dim, int64_t num_heads);

// Deterministic values uniform in [-scale, scale).
std::vector<float> RandomVector(size_t n, uint32_t seed, float scale = 0.5f);

// The ModelConfig text form of `dims` (for LoadModel-style tests).
v1::ModelConfig ConfigFor(const AttentionDims& dims);

// Random weights of the shapes `dims` asks for (zero biases when !dims.bias).
PackedWeights RandomWeights(const AttentionDims& dims, uint32_t seed);

// The same weights as F32 tensors named as `layout` stores them, every name
// prefixed with `prefix`.
TensorMap WeightsAsTensors(const AttentionDims& dims, const PackedWeights& w, WeightLayout layout,
                           const std::string& prefix = "");

// Runs one self-attention request of `len` random tokens on `engine`
// (a gtest failure if it fails).
void RunSelf(const MhaEngine& engine, int64_t len);

}  // namespace mha::testing

#endif  // MHA_TESTS_TEST_MODELS_H_
