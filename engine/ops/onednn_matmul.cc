#include "engine/ops/onednn_matmul.h"

#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mha {

const dnnl::engine& onednn::CpuEngine() {
  static const dnnl::engine* const engine = [] {
    // oneDNN's own primitive cache (what lets models of equal shapes share
    // one primitive's code) gets the capacity of ours, so that together
    // they hold about PrimitiveBudget's count, not its 1024 beyond it,
    // unless the user set DNNL_PRIMITIVE_CACHE_CAPACITY.
    if (std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY") == nullptr) {
      dnnl::set_primitive_cache_capacity(static_cast<int>(PrimitiveBudget::kDefaultCapacity));
    }
    return new dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return *engine;  // never destroyed: workspaces may outlive static destruction order
}

using onednn::dt;
namespace {

using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;

// The m at which a linear layer's weight format is chosen; primitives for
// other m reuse that format.
constexpr int64_t kReferenceRows = 256;

}  // namespace

uint64_t MatmulPrimitive::NewId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace {

dnnl::memory::desc PlainDesc(int ndims, const MatmulSpec::Dims& dims,
                             const MatmulSpec::Dims& strides, dt type) {
  dnnl_memory_desc_t md;
  dnnl_dims_t d, st;
  for (int i = 0; i < ndims; ++i) d[i] = dims[i], st[i] = strides[i];
  dnnl::error::wrap_c_api(
      dnnl_memory_desc_init_by_strides(&md, ndims, d, static_cast<dnnl_data_type_t>(type), st),
      "could not create a memory descriptor");
  return dnnl::memory::desc(md);
}

// Points `m` at `data` unless it already does. (Setting a handle zeroes a
// blocked layout's padding: the shared, reordered weights of a linear layer
// keep their handle, so they are never written to.)
void Rebind(const dnnl::memory& m, const void* data) {
  if (m.get_data_handle() == data) return;
  dnnl::error::wrap_c_api(dnnl_memory_set_data_handle_v2(m.get(), const_cast<void*>(data), nullptr),
                          "could not set a memory handle");
}

// Executes with the arguments `a` holds (bias only when `with_bias`) and
// waits: a stack array through the C API, no argument map.
void ExecuteBound(const MatmulPrimitive& p, Workspace& ws, const BoundArgs& a, bool with_bias) {
  dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, a.src.get()},
                             {DNNL_ARG_WEIGHTS, a.weights.get()},
                             {DNNL_ARG_DST, a.dst.get()},
                             {DNNL_ARG_SCRATCHPAD, a.scratchpad.get()},
                             {DNNL_ARG_BIAS, with_bias ? a.bias.get() : nullptr}};
  dnnl::error::wrap_c_api(
      dnnl_primitive_execute(p.primitive.get(), ws.stream().get(), with_bias ? 5 : 4, args),
      "could not execute a matmul");
  ws.stream().wait();
}

// The C API query: the C++ one (pd.scratchpad_desc()) allocates a vector.
void* Scratchpad(const MatmulPrimitive& p, Workspace& ws) {
  const dnnl_memory_desc_t* md =
      dnnl_primitive_desc_query_md(p.pd.get(), dnnl_query_scratchpad_md, 0);
  return ws.Get(Workspace::kOnednnScratchpad, md == nullptr ? 0 : dnnl_memory_desc_get_size(md));
}

}  // namespace

dnnl::memory::desc MatmulSpec::SrcDesc() const {
  return PlainDesc(ndims, src_dims, src_strides, src_dt);
}
dnnl::memory::desc MatmulSpec::WeightsDesc() const {
  return PlainDesc(ndims, wei_dims, wei_strides, wei_dt);
}
dnnl::memory::desc MatmulSpec::DstDesc() const {
  return PlainDesc(ndims, dst_dims, dst_strides, dst_dt);
}

namespace {

// A row-major stride: the product, or run time when either factor is.
int64_t StrideOf(int64_t a, int64_t b) {
  return a == DNNL_RUNTIME_DIM_VAL || b == DNNL_RUNTIME_DIM_VAL ? DNNL_RUNTIME_DIM_VAL : a * b;
}

// `spec` (3-D) without its batch dimension when `batch` is 0.
MatmulSpec Batched(MatmulSpec spec, int64_t batch) {
  if (batch != 0) return spec;
  spec.ndims = 2;
  for (MatmulSpec::Dims* d : {&spec.src_dims, &spec.src_strides, &spec.wei_dims, &spec.wei_strides,
                              &spec.dst_dims, &spec.dst_strides}) {
    *d = {(*d)[1], (*d)[2], 0};
  }
  return spec;
}

}  // namespace

MatmulSpec AttentionScoresSpec(onednn::dt dt, int64_t batch, int64_t rows, int64_t keys, int64_t d,
                               float scale) {
  MatmulSpec spec;
  spec.src_dt = spec.wei_dt = dt;
  spec.src_dims = {batch, rows, d};
  spec.src_strides = {StrideOf(rows, d), d, 1};
  spec.wei_dims = {batch, d, keys};
  spec.wei_strides = {StrideOf(keys, d), 1, d};
  spec.dst_dims = {batch, rows, keys};
  spec.dst_strides = {StrideOf(rows, keys), keys, 1};
  spec.scale = scale;
  return Batched(spec, batch);
}

MatmulSpec AttentionContextSpec(onednn::dt dt, onednn::dt out_dt, int64_t batch, int64_t rows,
                                int64_t keys, int64_t dv) {
  MatmulSpec spec;
  spec.src_dt = spec.wei_dt = dt;
  spec.dst_dt = out_dt;
  spec.src_dims = {batch, rows, keys};
  spec.src_strides = {StrideOf(rows, keys), keys, 1};
  spec.wei_dims = {batch, keys, dv};
  spec.wei_strides = {StrideOf(keys, dv), dv, 1};
  spec.dst_dims = {batch, rows, dv};
  spec.dst_strides = {StrideOf(rows, dv), dv, 1};
  return Batched(spec, batch);
}

dnnl::primitive_attr MakeAttr(float scale) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (scale != 1.0f) attr.set_output_scales(0, {scale});
  return attr;
}

BoundArgs& BoundMemories::Find(uint64_t id, const MatmulSpec& shape, bool& created) {
  return by_key_.FindOrInsert(std::make_pair(id, shape), created);
}

void ExecuteMatmul(const MatmulPrimitive& p, Workspace& ws, const void* src, const void* weights,
                   const void* bias, void* dst) {
  bool created = false;
  BoundArgs& a = ws.bound_memories().Find(p.id, MatmulSpec{}, created);
  void* scratch = Scratchpad(p, ws);
  if (created) {
    const dnnl::engine engine = p.pd.get_engine();
    a.src = dnnl::memory(p.pd.src_desc(), engine, const_cast<void*>(src));
    a.weights = dnnl::memory(p.pd.weights_desc(), engine, const_cast<void*>(weights));
    a.dst = dnnl::memory(p.pd.dst_desc(), engine, dst);
    a.scratchpad = dnnl::memory(p.pd.scratchpad_desc(), engine, scratch);
    if (p.has_bias) a.bias = dnnl::memory(p.pd.bias_desc(), engine, const_cast<void*>(bias));
  } else {
    Rebind(a.src, src);
    Rebind(a.weights, weights);
    Rebind(a.dst, dst);
    Rebind(a.scratchpad, scratch);
    if (p.has_bias) Rebind(a.bias, bias);
  }
  ExecuteBound(p, ws, a, p.has_bias);
}

void ExecuteMatmul(const MatmulPrimitive& p, const MatmulSpec& actual, Workspace& ws,
                   const void* src, const void* weights, void* dst) {
  bool created = false;
  BoundArgs& a = ws.bound_memories().Find(p.id, actual, created);
  void* scratch = Scratchpad(p, ws);
  if (created) {
    const dnnl::engine engine = p.pd.get_engine();
    a.src = dnnl::memory(actual.SrcDesc(), engine, const_cast<void*>(src));
    a.weights = dnnl::memory(actual.WeightsDesc(), engine, const_cast<void*>(weights));
    a.dst = dnnl::memory(actual.DstDesc(), engine, dst);
    a.scratchpad = dnnl::memory(p.pd.scratchpad_desc(), engine, scratch);
  } else {
    Rebind(a.src, src);
    Rebind(a.weights, weights);
    Rebind(a.dst, dst);
    Rebind(a.scratchpad, scratch);
  }
  ExecuteBound(p, ws, a, /*with_bias=*/false);
}

int PrimitiveThreads() { return omp_get_max_threads(); }

MatmulCache::MatmulCache(const dnnl::engine& engine, size_t capacity)
    : engine_(engine), primitives_(capacity) {}

std::shared_ptr<const MatmulPrimitive> MatmulCache::Get(const MatmulSpec& s) {
  return primitives_.Get(
      {s, PrimitiveThreads()},
      [&] {
        auto created = std::make_shared<MatmulPrimitive>();
        created->pd = dnnl::matmul::primitive_desc(
            dnnl::matmul::desc(s.SrcDesc(), s.WeightsDesc(), s.DstDesc()), MakeAttr(s.scale),
            engine_);
        created->primitive = dnnl::matmul(created->pd);
        return created;
      },
      misses_);
}

LinearLayer::LinearLayer(const dnnl::engine& engine, int64_t n, int64_t k, dt act_dt, dt dst_dt)
    : engine_(engine), n_(n), k_(k), act_dt_(act_dt), dst_dt_(dst_dt), by_m_(kMaxEntries) {
  weights_desc_ =
      MakePd(kReferenceRows, dnnl::memory::desc({k, n}, act_dt, tag::any)).weights_desc();
}

LinearLayer::LinearLayer(const dnnl::engine& engine, const std::vector<float>& weight,
                         const std::vector<float>& bias, int64_t n, int64_t k, dt act_dt, dt dst_dt)
    : LinearLayer(engine, n, k, act_dt, dst_dt) {
  // W^T as a [k, n] matrix is W's [n, k] row-major bytes read with strides.
  const dnnl::memory::desc plain({k, n}, dt::f32, tag::ba);
  dnnl::memory plain_mem(plain, engine_, const_cast<float*>(weight.data()));
  weights_ = dnnl::memory(weights_desc_, engine_);
  dnnl::stream stream(engine_);
  dnnl::reorder(plain_mem, weights_).execute(stream, plain_mem, weights_);
  bias_ = dnnl::memory({{1, n}, dt::f32, tag::ab}, engine_);
  std::memcpy(bias_.get_data_handle(), bias.data(), sizeof(float) * n);
  stream.wait();
  weights_data_ = static_cast<const uint8_t*>(weights_.get_data_handle());
  bias_data_ = static_cast<const uint8_t*>(bias_.get_data_handle());
  FitScratchpad();
}

namespace {

// Where packed column `first` of `fused` starts, in elements, if `part` (the
// layout chosen for `count` of its columns) is the same blocked layout cut
// to those columns: the same blocks and strides, whole column blocks
// outermost, `first` on a block boundary and the range ending on one (or at
// fused's last column, whose padding is fused's). -1 otherwise.
int64_t ColumnOffset(const dnnl_memory_desc_t& fused, const dnnl_memory_desc_t& part, int64_t first,
                     int64_t count) {
  if (fused.format_kind != dnnl_blocked || part.format_kind != dnnl_blocked) return -1;
  if (fused.extra.flags != 0 || part.extra.flags != 0) return -1;
  if (fused.offset0 != 0 || part.offset0 != 0) return -1;
  if (fused.padded_dims[0] != part.padded_dims[0]) return -1;  // the same padded k
  const dnnl_blocking_desc_t& f = fused.format_desc.blocking;
  const dnnl_blocking_desc_t& p = part.format_desc.blocking;
  if (f.inner_nblks != p.inner_nblks || f.strides[0] != p.strides[0] ||
      f.strides[1] != p.strides[1]) {
    return -1;
  }
  int64_t column_block = 1;
  for (int i = 0; i < f.inner_nblks; ++i) {
    if (f.inner_blks[i] != p.inner_blks[i] || f.inner_idxs[i] != p.inner_idxs[i]) return -1;
    if (f.inner_idxs[i] == 1) column_block *= f.inner_blks[i];
  }
  const int64_t n = fused.dims[1];
  if (column_block == 1 && f.strides[1] == 1) return -1;  // row-major: see RowMajorColumns
  if (first % column_block != 0) return -1;
  if (first + count != n && count % column_block != 0) return -1;
  // Column blocks outermost: the part is exactly its blocks end to end.
  const int64_t blocks = (count + column_block - 1) / column_block;
  if (part.padded_dims[1] != blocks * column_block) return -1;
  const int64_t elements = part.padded_dims[0] * part.padded_dims[1];
  if (blocks * p.strides[1] != elements) return -1;
  return first / column_block * f.strides[1];
}

// Whether `fused` is a plain row-major [k, n] (columns contiguous), whose
// columns [first, first + count) are then a [k, count] matrix of row stride
// n at element `first`.
bool RowMajor(const dnnl_memory_desc_t& fused) {
  return fused.format_kind == dnnl_blocked && fused.extra.flags == 0 && fused.offset0 == 0 &&
         fused.format_desc.blocking.inner_nblks == 0 && fused.format_desc.blocking.strides[1] == 1;
}

}  // namespace

std::unique_ptr<LinearLayer> LinearLayer::ColumnsOf(const LinearLayer& fused, int64_t first,
                                                    int64_t count) {
  if (first < 0 || count <= 0 || first + count > fused.n_) return nullptr;
  std::unique_ptr<LinearLayer> part(
      new LinearLayer(fused.engine_, count, fused.k_, fused.act_dt_, fused.dst_dt_));
  const int64_t element = fused.act_dt_ == dt::bf16 ? 2 : 4;
  int64_t offset = ColumnOffset(fused.weights_desc_.data, part->weights_desc_.data, first, count);
  if (offset >= 0) {
    if ((offset + static_cast<int64_t>(part->weights_desc_.get_size()) / element) * element >
        static_cast<int64_t>(fused.weights_desc_.get_size())) {
      return nullptr;
    }
  } else if (RowMajor(fused.weights_desc_.data)) {
    // (gemm-based matmuls, e.g. on AVX2.) The same implementation must take
    // the strided columns as it would take a layer of their own.
    const dnnl::memory::desc strided =
        PlainDesc(2, {fused.k_, count},
                  {fused.weights_desc_.data.format_desc.blocking.strides[0], 1}, fused.act_dt_);
    const dnnl::memory::desc own = part->weights_desc_;
    try {
      const std::string with_strides = part->MakePd(kReferenceRows, strided).impl_info_str();
      if (with_strides != part->MakePd(kReferenceRows, own).impl_info_str()) return nullptr;
    } catch (const dnnl::error&) {
      return nullptr;
    }
    part->weights_desc_ = strided;
    offset = first;
  } else {
    return nullptr;
  }
  part->weights_ = fused.weights_;
  part->bias_ = fused.bias_;
  part->owns_weights_ = false;
  part->weights_data_ = fused.weights_data_ + offset * element;
  part->bias_data_ = fused.bias_data_ + first * static_cast<int64_t>(sizeof(float));
  part->FitScratchpad();
  return part;
}

dnnl::matmul::primitive_desc LinearLayer::MakePd(int64_t m, const dnnl::memory::desc& wei) const {
  const dnnl::memory::desc src({m, k_}, act_dt_, tag::ab);
  const dnnl::memory::desc bias({1, n_}, dt::f32, tag::ab);
  const dnnl::memory::desc dst({m, n_}, dst_dt_, tag::ab);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, bias, dst), MakeAttr(1.0f),
                                      engine_);
}

std::shared_ptr<const MatmulPrimitive> LinearLayer::PrimitiveFor(int64_t m) const {
  return by_m_.Get(
      {m, PrimitiveThreads()},
      [&] {
        auto created = std::make_shared<MatmulPrimitive>();
        created->pd = MakePd(m, weights_desc_);
        created->primitive = dnnl::matmul(created->pd);
        created->has_bias = true;
        return created;
      },
      misses_);
}

namespace {

constexpr int64_t kExactRows = 64;

// The rows of the largest chunk Run cuts `m` rows into.
int64_t LargestChunk(int64_t m) {
  if (m < kExactRows) return m;
  int64_t chunk = kExactRows;
  while (chunk * 2 <= m) chunk *= 2;
  return chunk;
}

}  // namespace

void LinearLayer::FitScratchpad() {
  constexpr int64_t kFew = kExactRows, kMany = 16384;
  const auto at = [&](int64_t rows) {
    return static_cast<int64_t>(MakePd(rows, weights_desc_).scratchpad_desc().get_size());
  };
  const int64_t few = at(kFew), many = at(kMany);
  scratchpad_per_row_ = std::max<int64_t>(0, (many - few + kMany - kFew - 1) / (kMany - kFew));
  scratchpad_base_ = std::max(few - scratchpad_per_row_ * kFew, many - scratchpad_per_row_ * kMany);
}

int64_t LinearLayer::ScratchpadBytes(int64_t m) const {
  if (m <= 0) return 0;
  return std::max<int64_t>(0, scratchpad_base_ + scratchpad_per_row_ * LargestChunk(m));
}

// Rows are processed in chunks of power-of-two sizes (and one final chunk
// of fewer than kExactRows), so any number of rows needs at most a few dozen
// distinct primitives: a ragged batch of any total length never waits for
// a JIT compilation once these exist.
void LinearLayer::Run(Workspace& ws, const void* x, int64_t m, void* y) const {
  const size_t x_row = k_ * (act_dt_ == dt::bf16 ? 2 : 4);
  const size_t y_row = n_ * (dst_dt_ == dt::bf16 ? 2 : 4);
  for (int64_t done = 0; done < m;) {
    const int64_t chunk = LargestChunk(m - done);
    const std::shared_ptr<const MatmulPrimitive> p = PrimitiveFor(chunk);
    ExecuteMatmul(*p, ws, static_cast<const uint8_t*>(x) + done * x_row, weights_data_, bias_data_,
                  static_cast<uint8_t*>(y) + done * y_row);
    done += chunk;
  }
}

}  // namespace mha
