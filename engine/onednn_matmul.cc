#include "engine/onednn_matmul.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mha {
namespace {

using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;

// The m at which a linear layer's weight format is chosen; primitives for
// other m reuse that format.
constexpr int64_t kReferenceRows = 256;

}  // namespace

std::string MatmulSpec::Key() const {
  return absl::StrCat(static_cast<int>(src_dt), ",", static_cast<int>(wei_dt),
                      ",", static_cast<int>(dst_dt), "|",
                      absl::StrJoin(src_dims, ","), "/", absl::StrJoin(src_strides, ","),
                      "|", absl::StrJoin(wei_dims, ","), "/",
                      absl::StrJoin(wei_strides, ","), "|",
                      absl::StrJoin(dst_dims, ","), "/", absl::StrJoin(dst_strides, ","),
                      "|", scale);
}

dnnl::primitive_attr MakeAttr(float scale) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (scale != 1.0f) attr.set_output_scales(0, {scale});
  return attr;
}

void ExecuteMatmul(const MatmulPrimitive& p, Workspace& ws, const void* src,
                   const void* weights, const void* bias, void* dst) {
  const dnnl::engine engine = p.pd.get_engine();
  const dnnl::memory::desc scratch_md = p.pd.scratchpad_desc();
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, dnnl::memory(p.pd.src_desc(), engine, const_cast<void*>(src))},
      {DNNL_ARG_WEIGHTS,
       dnnl::memory(p.pd.weights_desc(), engine, const_cast<void*>(weights))},
      {DNNL_ARG_DST, dnnl::memory(p.pd.dst_desc(), engine, dst)},
      {DNNL_ARG_SCRATCHPAD,
       dnnl::memory(scratch_md, engine,
                    ws.Get(Workspace::kOnednnScratchpad, scratch_md.get_size()))}};
  if (p.has_bias) {
    args.emplace(DNNL_ARG_BIAS,
                 dnnl::memory(p.pd.bias_desc(), engine, const_cast<void*>(bias)));
  }
  p.primitive.execute(ws.stream(), args);
  ws.stream().wait();
}

void ExecuteMatmul(const MatmulPrimitive& p, const MatmulSpec& actual, Workspace& ws,
                   const void* src, const void* weights, void* dst) {
  const dnnl::engine engine = p.pd.get_engine();
  const dnnl::memory::desc scratch_md = p.pd.scratchpad_desc();
  using md = dnnl::memory::desc;
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, dnnl::memory(md(actual.src_dims, actual.src_dt, actual.src_strides),
                                  engine, const_cast<void*>(src))},
      {DNNL_ARG_WEIGHTS, dnnl::memory(md(actual.wei_dims, actual.wei_dt, actual.wei_strides),
                                      engine, const_cast<void*>(weights))},
      {DNNL_ARG_DST, dnnl::memory(md(actual.dst_dims, actual.dst_dt, actual.dst_strides),
                                  engine, dst)},
      {DNNL_ARG_SCRATCHPAD,
       dnnl::memory(scratch_md, engine,
                    ws.Get(Workspace::kOnednnScratchpad, scratch_md.get_size()))}};
  p.primitive.execute(ws.stream(), args);
  ws.stream().wait();
}

MatmulPrimitive MakeRuntimeDimsMatmul(const dnnl::engine& engine, const MatmulSpec& spec) {
  using md = dnnl::memory::desc;
  const md src(spec.src_dims, spec.src_dt, spec.src_strides);
  const md wei(spec.wei_dims, spec.wei_dt, spec.wei_strides);
  const md dst(spec.dst_dims, spec.dst_dt, spec.dst_strides);
  MatmulPrimitive p;
  p.pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), MakeAttr(spec.scale),
                                      engine);
  p.primitive = dnnl::matmul(p.pd);
  return p;
}

std::shared_ptr<const MatmulPrimitive> MatmulCache::Get(const MatmulSpec& s) {
  const std::string key = s.Key();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
  }
  const dnnl::memory::desc src(s.src_dims, s.src_dt, s.src_strides);
  const dnnl::memory::desc wei(s.wei_dims, s.wei_dt, s.wei_strides);
  const dnnl::memory::desc dst(s.dst_dims, s.dst_dt, s.dst_strides);
  auto created = std::make_shared<MatmulPrimitive>();
  created->pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst),
                                             MakeAttr(s.scale), engine_);
  created->primitive = dnnl::matmul(created->pd);
  std::lock_guard<std::mutex> lock(mu_);
  if (cache_.size() >= kMaxEntries) cache_.clear();
  return cache_.try_emplace(key, std::move(created)).first->second;
}

size_t MatmulCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

LinearLayer::LinearLayer(const dnnl::engine& engine, const std::vector<float>& weight,
                         const std::vector<float>& bias, int64_t n, int64_t k,
                         dt act_dt, dt dst_dt)
    : engine_(engine), n_(n), k_(k), act_dt_(act_dt), dst_dt_(dst_dt) {
  // W^T as a [k, n] matrix is W's [n, k] row-major bytes read with strides.
  const dnnl::memory::desc plain({k, n}, dt::f32, tag::ba);
  const dnnl::memory::desc any({k, n}, act_dt, tag::any);
  const dnnl::memory::desc chosen = MakePd(kReferenceRows, any).weights_desc();
  dnnl::memory plain_mem(plain, engine_, const_cast<float*>(weight.data()));
  weights_ = dnnl::memory(chosen, engine_);
  dnnl::stream stream(engine_);
  dnnl::reorder(plain_mem, weights_).execute(stream, plain_mem, weights_);
  bias_ = dnnl::memory({{1, n}, dt::f32, tag::ab}, engine_);
  std::memcpy(bias_.get_data_handle(), bias.data(), sizeof(float) * n);
  stream.wait();
}

dnnl::matmul::primitive_desc LinearLayer::MakePd(
    int64_t m, const dnnl::memory::desc& wei) const {
  const dnnl::memory::desc src({m, k_}, act_dt_, tag::ab);
  const dnnl::memory::desc bias({1, n_}, dt::f32, tag::ab);
  const dnnl::memory::desc dst({m, n_}, dst_dt_, tag::ab);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, bias, dst),
                                      MakeAttr(1.0f), engine_);
}

std::shared_ptr<const MatmulPrimitive> LinearLayer::PrimitiveFor(int64_t m) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_m_.find(m);
    if (it != by_m_.end()) return it->second;
  }
  auto created = std::make_shared<MatmulPrimitive>();
  created->pd = MakePd(m, weights_.get_desc());
  created->primitive = dnnl::matmul(created->pd);
  created->has_bias = true;
  std::lock_guard<std::mutex> lock(mu_);
  if (by_m_.size() >= kMaxEntries) by_m_.clear();
  return by_m_.try_emplace(m, std::move(created)).first->second;
}

// Rows are processed in chunks of power-of-two sizes (and one final chunk
// of fewer than kExactRows), so any number of rows needs at most a few dozen
// distinct primitives: a ragged batch of any total length never waits for
// a JIT compilation once these exist.
void LinearLayer::Run(Workspace& ws, const void* x, int64_t m, void* y) const {
  constexpr int64_t kExactRows = 64;
  const size_t x_row = k_ * (act_dt_ == dt::bf16 ? 2 : 4);
  const size_t y_row = n_ * (dst_dt_ == dt::bf16 ? 2 : 4);
  for (int64_t done = 0; done < m;) {
    const int64_t left = m - done;
    int64_t chunk = left;
    if (left >= kExactRows) {
      chunk = kExactRows;
      while (chunk * 2 <= left) chunk *= 2;
    }
    const std::shared_ptr<const MatmulPrimitive> p = PrimitiveFor(chunk);
    ExecuteMatmul(*p, ws, static_cast<const uint8_t*>(x) + done * x_row,
                  weights_.get_data_handle(), bias_.get_data_handle(),
                  static_cast<uint8_t*>(y) + done * y_row);
    done += chunk;
  }
}

}  // namespace mha
