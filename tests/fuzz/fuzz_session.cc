// libFuzzer target: a mha.v1 StreamRequest decoded from fuzz bytes. Its
// OpenSession and Append messages go through the session codec's checks
// and, when valid, through the engine's session paths (memory projection,
// self and cross steps, a fork's copy-on-write) of a small self-attention
// model and a small cross-attention model with bias_kv and zero_attn;
// ForkSession and CloseSession ids through the manager. Inputs that start
// with "MHASESS1" are a session file instead: its chunks go through the
// import checks, and a session they accept must compute its next step. What the codec accepts must
// compute.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/mha_engine.h"
#include "google/protobuf/stubs/logging.h"
#include "server/frontends/common/session_codec.h"
#include "server/sessions/session_manager.h"
#include "server/sessions/session_stream.h"
#include "tests/engine/test_models.h"

namespace {

using mha::server::VersionPtr;

constexpr mha::server::RequestLimits kLimits{.max_tokens = 2048};
constexpr int64_t kPoolBytes = int64_t{64} << 20;

VersionPtr MakeVersion(int64_t kdim, bool extras) {
  auto v = std::make_shared<mha::server::ModelVersion>();
  mha::AttentionDims& d = v->loaded.dims;
  d.embed_dim = 8, d.num_heads = 2, d.kdim = kdim, d.vdim = kdim;
  d.qk_head_dim = d.v_head_dim = 4;
  d.add_bias_kv = d.add_zero_attn = extras;
  v->loaded.engine = mha::MhaEngine::Create(d, mha::testing::RandomWeights(d, 1)).value();
  v->name = "m";
  v->version = 1;
  return v;
}

// A step of `query` on `cache` must compute, with weights when asked.
void Step(const mha::MhaEngine& engine, mha::KvCache& cache, bool cross,
          const mha::AttentionRequest& query, mha::Workspace& ws) {
  const int64_t tokens = query.q_len();
  if (!cross && !cache.Reserve(cache.length() + tokens).ok()) return;
  mha::StepBatch batch{query.batch().query, {{&cache, tokens, cross}}};
  std::vector<float> output(batch.query.size());
  std::vector<float> weights(query.need_weights() ? engine.StepWeightsElements(batch) : 0);
  if (!engine.Step(batch, {absl::MakeSpan(output), absl::MakeSpan(weights)}, ws).ok()) {
    __builtin_trap();
  }
}

void OnOpen(const mha::v1::OpenSessionRequest& request, const VersionPtr& version,
            mha::Workspace& ws) {
  absl::StatusOr<mha::server::OpenParams> params =
      mha::server::DecodeOpenSession(request, version, kLimits);
  if (!params.ok() || !params->memory.has_value()) return;
  const mha::MhaEngine& engine = *version->loaded.engine;
  const mha::AttentionRequest& memory = *params->memory;
  mha::KvBlockPool pool(kPoolBytes);
  mha::KvCache cache(engine.kv_layout(), pool);
  if (!cache.Reserve(memory.kv_len()).ok()) return;
  const mha::AttentionBatch& b = memory.batch();
  if (!engine.ProjectEncoderMemory(b.key, b.value, memory.kv_len(), b.key_padding_mask, cache, ws)
           .ok()) {
    __builtin_trap();
  }
  // A one-token step on the memory.
  mha::v1::AppendRequest append;
  append.mutable_query()->set_dtype(mha::v1::DATA_TYPE_FP32);
  append.mutable_query()->add_shape(1);
  append.mutable_query()->add_shape(8);
  append.mutable_query()->set_data(std::string(8 * sizeof(float), '\0'));
  auto query = mha::server::DecodeAppend(append, engine.dims(), kLimits);
  if (!query.ok()) __builtin_trap();
  Step(engine, cache, /*cross=*/true, query->query, ws);
}

void OnAppend(const mha::v1::AppendRequest& request, const VersionPtr& version,
              mha::Workspace& ws) {
  const mha::MhaEngine& engine = *version->loaded.engine;
  absl::StatusOr<mha::server::StepParams> params =
      mha::server::DecodeAppend(request, engine.dims(), kLimits);
  if (!params.ok()) return;
  mha::KvBlockPool pool(kPoolBytes);
  mha::KvCache cache(engine.kv_layout(), pool);
  if (engine.CanAppendSelf()) {
    Step(engine, cache, /*cross=*/false, params->query, ws);  // empty cache
    Step(engine, cache, /*cross=*/false, params->query, ws);  // then with a prefix
    // A fork, then both branches appending: the shared last block is copied.
    std::unique_ptr<mha::KvCache> fork = cache.Fork(cache.length());
    Step(engine, *fork, /*cross=*/false, params->query, ws);
    Step(engine, cache, /*cross=*/false, params->query, ws);
  }
  mha::KvCache memory(engine.kv_layout(), pool);  // a 3-token memory of zeros
  const std::vector<float> zeros(3 * engine.dims().kdim, 0.0f);
  if (!memory.Reserve(3).ok() || !engine.ProjectEncoderMemory(zeros, {}, 3, {}, memory, ws).ok()) {
    __builtin_trap();
  }
  Step(engine, memory, /*cross=*/true, params->query, ws);
}

// A session file's chunks through the import checks; what they accept is
// built into a cache and must compute a step (self, or cross over it).
void OnSessionFile(const uint8_t* data, size_t size, const VersionPtr& version,
                   mha::Workspace& ws) {
  mha::server::SessionChunkReader reader(
      [&version](const std::string& model, int64_t number) -> absl::StatusOr<VersionPtr> {
        if (model != version->name || (number != 0 && number != version->version)) {
          return absl::NotFoundError("no such model version");
        }
        return version;
      },
      kPoolBytes);
  size_t pos = 8;
  mha::v1::SessionChunk chunk;
  while (pos + 4 <= size) {
    const uint32_t n = data[pos] | (data[pos + 1] << 8) | (data[pos + 2] << 16) |
                       (static_cast<uint32_t>(data[pos + 3]) << 24);
    pos += 4;
    if (n > size - pos || !chunk.ParseFromArray(data + pos, static_cast<int>(n))) return;
    pos += n;
    if (!reader.Add(chunk).ok()) return;
  }
  absl::StatusOr<mha::server::SessionImport> session = reader.Finish();
  if (!session.ok()) return;
  const mha::MhaEngine& engine = *version->loaded.engine;
  mha::KvBlockPool pool(kPoolBytes);
  mha::KvCache cache(engine.kv_layout(), pool);
  if (!cache.Reserve(session->position).ok()) return;
  for (size_t b = 0; b < session->blocks.size(); ++b) {
    cache.WriteBlock(static_cast<int64_t>(b),
                     reinterpret_cast<const uint8_t*>(session->blocks[b].data()));
  }
  cache.set_length(session->position);
  if (!session->key_padding.empty()) cache.set_key_padding(std::move(session->key_padding));
  std::vector<float> storage(2 * engine.dims().embed_dim, 0.5f);
  mha::RequestInputs in;
  in.query = mha::TensorView{mha::DType::kF32,
                             {1, 2, engine.dims().embed_dim},
                             absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(storage.data()),
                                                 storage.size() * sizeof(float)),
                             {}};
  mha::AttentionDims query_dims = engine.dims();
  query_dims.kdim = query_dims.vdim = query_dims.embed_dim;
  absl::StatusOr<mha::AttentionRequest> query =
      mha::AttentionRequest::Create(query_dims, in, 1 << 20, mha::DTypeSpelling::kMhaV1);
  if (!query.ok()) __builtin_trap();
  if (session->cross || engine.CanAppendSelf()) Step(engine, cache, session->cross, *query, ws);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const VersionPtr self = MakeVersion(8, false);
  static const VersionPtr cross = MakeVersion(6, true);
  static std::unique_ptr<mha::Workspace> ws = self->loaded.engine->NewWorkspace();
  static std::unique_ptr<mha::Workspace> cross_ws = cross->loaded.engine->NewWorkspace();
  static mha::server::SessionManager sessions({}, {});
  if (size >= 8 && std::memcmp(data, mha::v1::kSessionFileMagic, 8) == 0) {
    OnSessionFile(data, size, self, *ws);
    OnSessionFile(data, size, cross, *cross_ws);
    return 0;
  }
  mha::v1::StreamRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (request.has_open_session()) {
    OnOpen(request.open_session(), self, *ws);
    OnOpen(request.open_session(), cross, *cross_ws);
  } else if (request.has_append()) {
    OnAppend(request.append(), self, *ws);
    OnAppend(request.append(), cross, *cross_ws);
  } else if (request.has_fork_session()) {
    // No session is open here: NOT_FOUND with a message, never a crash.
    const auto& fork = request.fork_session();
    if (sessions.Fork(fork.session_id(), fork.new_session_id()).ok()) __builtin_trap();
  } else if (request.has_close_session()) {
    // Any id: NOT_FOUND with a message, never a crash.
    if (sessions.Close(request.close_session().session_id()).ok()) __builtin_trap();
  }
  return 0;
}
