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

uint64_t MatmulPrimitive::NewId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

namespace {

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

}  // namespace mha
