#include "engine/ops/linear_layer.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>

#include "engine/ops/kernels.h"

namespace mha {

using onednn::dt;
namespace {

using tag = dnnl::memory::format_tag;

// The m at which a linear layer's weight format is chosen; primitives for
// other m reuse that format.
constexpr int64_t kReferenceRows = 256;

}  // namespace

LinearLayer::LinearLayer(const dnnl::engine& engine, int64_t n, int64_t k, dt act_dt, dt dst_dt,
                         LinearPrecision precision)
    : engine_(engine),
      n_(n),
      k_(k),
      act_dt_(act_dt),
      dst_dt_(dst_dt),
      precision_(precision),
      by_m_(kMaxEntries) {
  weights_desc_ =
      MakePd(kReferenceRows, dnnl::memory::desc({k, n}, weights_dt(), tag::any)).weights_desc();
}

LinearLayer::LinearLayer(const dnnl::engine& engine, const std::vector<float>& weight,
                         const std::vector<float>& bias, int64_t n, int64_t k, dt act_dt, dt dst_dt,
                         LinearPrecision precision)
    : LinearLayer(engine, n, k, act_dt, dst_dt, precision) {
  weights_ = dnnl::memory(weights_desc_, engine_);
  if (int8()) {
    PackInt8(weight);
  } else {
    // W^T as a [k, n] matrix is W's [n, k] row-major bytes read with strides.
    const dnnl::memory::desc plain({k, n}, dt::f32, tag::ba);
    dnnl::memory plain_mem(plain, engine_, const_cast<float*>(weight.data()));
    dnnl::stream stream(engine_);
    dnnl::reorder(plain_mem, weights_).execute(stream, plain_mem, weights_);
    stream.wait();
  }
  bias_ = dnnl::memory({{1, n}, dt::f32, tag::ab}, engine_);
  std::memcpy(bias_.get_data_handle(), bias.data(), sizeof(float) * n);
  weights_data_ = static_cast<const uint8_t*>(weights_.get_data_handle());
  bias_data_ = static_cast<const uint8_t*>(bias_.get_data_handle());
  FitScratchpad();
}

void LinearLayer::PackInt8(const std::vector<float>& weight) {
  auto columns = std::make_shared<Int8Columns>();
  columns->scale.resize(n_);
  columns->offset_share.resize(n_);
  std::vector<int8_t> quantized(n_ * k_);
  for (int64_t j = 0; j < n_; ++j) {
    const float* row = weight.data() + j * k_;
    float max = 0.0f;
    for (int64_t c = 0; c < k_; ++c) max = std::max(max, std::fabs(row[c]));
    const float inverse = max > 0.0f ? 127.0f / max : 0.0f;
    int32_t sum = 0;
    for (int64_t c = 0; c < k_; ++c) {
      const float q = std::clamp(std::nearbyint(row[c] * inverse), -127.0f, 127.0f);
      quantized[j * k_ + c] = static_cast<int8_t>(q);
      sum += static_cast<int32_t>(q);
    }
    columns->scale[j] = max / 127.0f;
    columns->offset_share[j] = 128 * sum;
  }
  const dnnl::memory::desc plain({k_, n_}, dt::s8, tag::ba);
  dnnl::memory plain_mem(plain, engine_, quantized.data());
  dnnl::stream stream(engine_);
  dnnl::reorder(plain_mem, weights_).execute(stream, plain_mem, weights_);
  stream.wait();
  int8_ = std::move(columns);
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
  std::unique_ptr<LinearLayer> part(new LinearLayer(fused.engine_, count, fused.k_, fused.act_dt_,
                                                    fused.dst_dt_, fused.precision_));
  const int64_t element = static_cast<int64_t>(dnnl::memory::data_type_size(fused.weights_dt()));
  int64_t offset = ColumnOffset(fused.weights_desc_.data, part->weights_desc_.data, first, count);
  if (offset >= 0) {
    if ((offset + static_cast<int64_t>(part->weights_desc_.get_size()) / element) * element >
        static_cast<int64_t>(fused.weights_desc_.get_size())) {
      return nullptr;
    }
  } else if (RowMajor(fused.weights_desc_.data)) {
    // (gemm-based matmuls, e.g. on AVX2.) The same implementation must take
    // the strided columns as it would take a layer of their own.
    const dnnl::memory::desc strided = PlainDesc(
        2, {fused.k_, count}, {fused.weights_desc_.data.format_desc.blocking.strides[0], 1},
        fused.weights_dt());
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
  part->int8_ = fused.int8_;
  part->first_column_ = fused.first_column_ + first;
  part->owns_weights_ = false;
  part->weights_data_ = fused.weights_data_ + offset * element;
  part->bias_data_ = fused.bias_data_ + first * static_cast<int64_t>(sizeof(float));
  part->FitScratchpad();
  return part;
}

dnnl::matmul::primitive_desc LinearLayer::MakePd(int64_t m, const dnnl::memory::desc& wei) const {
  if (int8()) {  // u8 x s8 -> s32; the bias is added with the dequantization
    const dnnl::memory::desc src({m, k_}, dt::u8, tag::ab);
    const dnnl::memory::desc dst({m, n_}, dt::s32, tag::ab);
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), MakeAttr(1.0f), engine_);
  }
  const dnnl::memory::desc src({m, k_}, act_dt_, tag::ab);
  const dnnl::memory::desc bias({1, n_}, dt::f32, tag::ab);
  const dnnl::memory::desc dst({m, n_}, dst_dt_, tag::ab);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, bias, dst), MakeAttr(1.0f),
                                      engine_);
}

std::shared_ptr<const MatmulPrimitive> LinearLayer::PrimitiveFor(int64_t m) const {
  return PrimitiveFor(m, PrimitiveThreads());
}

std::shared_ptr<const MatmulPrimitive> LinearLayer::PrimitiveFor(int64_t m, int threads) const {
  return by_m_.Get(
      {m, threads},
      [&] {
        auto created = std::make_shared<MatmulPrimitive>();
        created->pd = MakePd(m, weights_desc_);
        created->primitive = dnnl::matmul(created->pd);
        created->has_bias = !int8();
        return created;
      },
      misses_);
}

namespace {

constexpr int64_t kExactRows = 64;
// An int8 layer's chunks stop here: each is quantized, multiplied and
// dequantized in turn, its u8 rows and s32 sums staying in cache.
constexpr int64_t kInt8ChunkRows = 256;
// From this many rows per thread on, each thread of the team takes its own
// share of the rows through all three steps (see RunInt8PerThread).
constexpr int64_t kInt8ThreadMinRows = 128;

// The rows of the largest chunk Run cuts `m` rows into.
int64_t LargestChunk(int64_t m) {
  if (m < kExactRows) return m;
  int64_t chunk = kExactRows;
  while (chunk * 2 <= m) chunk *= 2;
  return chunk;
}

}  // namespace

int64_t LinearLayer::ChunkRows(int64_t m) const {
  return LargestChunk(int8() ? std::min(m, kInt8ChunkRows) : m);
}

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
  return std::max<int64_t>(0, scratchpad_base_ + scratchpad_per_row_ * ChunkRows(m));
}

int64_t LinearLayer::Int8ThreadRows(int64_t m, int threads) const {
  if (!int8() || threads < 2 || m < threads * kInt8ThreadMinRows) return 0;
  return (m + threads - 1) / threads;
}

int64_t LinearLayer::Int8RowsBytes(int64_t m) const {
  return int8() && m > 0 ? ChunkRows(m) * k_ : 0;
}
int64_t LinearLayer::Int8SumsBytes(int64_t m) const {
  return int8() && m > 0 ? ChunkRows(m) * n_ * static_cast<int64_t>(sizeof(int32_t)) : 0;
}
int64_t LinearLayer::Int8ScalesBytes(int64_t m) const {
  return int8() && m > 0 ? ChunkRows(m) * static_cast<int64_t>(sizeof(float)) : 0;
}

int64_t LinearLayer::bytes() const {
  if (!owns_weights_) return 0;
  int64_t held = static_cast<int64_t>(weights_.get_desc().get_size() + bias_.get_desc().get_size());
  if (int8_ != nullptr) held += n_ * static_cast<int64_t>(sizeof(float) + sizeof(int32_t));
  return held;
}

// Rows are processed in chunks of power-of-two sizes (and one final chunk
// of fewer than kExactRows), so any number of rows needs at most a few dozen
// distinct primitives: a ragged batch of any total length never waits for
// a JIT compilation once these exist.
void LinearLayer::Run(Workspace& ws, const void* x, int64_t m, void* y) const {
  if (int8()) return RunInt8(ws, x, m, y);
  const size_t x_row = k_ * (act_dt_ == dt::bf16 ? 2 : 4);
  const size_t y_row = n_ * (dst_dt_ == dt::bf16 ? 2 : 4);
  for (int64_t done = 0; done < m;) {
    const int64_t chunk = ChunkRows(m - done);
    const std::shared_ptr<const MatmulPrimitive> p = PrimitiveFor(chunk);
    ExecuteMatmul(*p, ws, static_cast<const uint8_t*>(x) + done * x_row, weights_data_, bias_data_,
                  static_cast<uint8_t*>(y) + done * y_row);
    done += chunk;
  }
}

void LinearLayer::RunInt8(Workspace& ws, const void* x, int64_t m, void* y) const {
  const int threads = omp_get_level() == 0 ? omp_get_max_threads() : 1;
  if (Int8ThreadRows(m, threads) > 0) return RunInt8PerThread(ws, x, m, y, threads);
  RunInt8Rows(ws, x, 0, m, y, PrimitiveThreads());
}

// Each thread quantizes, multiplies and dequantizes its own rows, in its
// child workspace, with single-threaded primitives. One region instead of
// three per chunk, and no step reads what another core just wrote: on a VM
// whose cores are slow to hand data to each other, int8 8 x 128 and cross
// 8 x 64 x 256 at E 512 ran 16 % and 23 % faster (docs/PERFORMANCE.md).
void LinearLayer::RunInt8PerThread(Workspace& ws, const void* x, int64_t m, void* y,
                                   int threads) const {
  auto range = [&](int t) { return m * t / threads; };
  // Every chunk's primitive, made or found before the region (as
  // TiledAttention does: inside it, each runs on its calling thread only).
  for (int t = 0; t < threads; ++t) {
    for (int64_t done = range(t); done < range(t + 1); done += ChunkRows(range(t + 1) - done)) {
      PrimitiveFor(ChunkRows(range(t + 1) - done), threads);
    }
  }
  ws.ReserveChildren(threads);
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    try {
      RunInt8Rows(ws.Child(t), x, range(t), range(t + 1), y, threads);
    } catch (...) {
#pragma omp critical(mha_int8_rows_error)
      if (error == nullptr) error = std::current_exception();
    }
  }
  if (error != nullptr) std::rethrow_exception(error);
}

void LinearLayer::RunInt8Rows(Workspace& ws, const void* x, int64_t first, int64_t last, void* y,
                              int threads) const {
  const bool bf16_in = act_dt_ == dt::bf16, bf16_out = dst_dt_ == dt::bf16;
  const size_t x_row = k_ * (bf16_in ? 2 : 4);
  const size_t y_row = n_ * (bf16_out ? 2 : 4);
  const int64_t most = ChunkRows(last - first);
  auto* rows = ws.Get<uint8_t>(Workspace::kInt8Rows, most * k_);
  auto* row_scales = ws.Get<float>(Workspace::kInt8RowScales, most);
  auto* sums = ws.Get<int32_t>(Workspace::kInt8Sums, most * n_);
  Int8Dequantization d;
  d.row_scales = row_scales;
  d.col_scales = int8_->scale.data() + first_column_;
  d.offset_share = int8_->offset_share.data() + first_column_;
  d.bias = reinterpret_cast<const float*>(bias_data_);
  for (int64_t done = first; done < last;) {
    const int64_t chunk = ChunkRows(last - done);
    QuantizeRowsU8(static_cast<const uint8_t*>(x) + done * x_row, bf16_in, chunk, k_, rows,
                   row_scales);
    ExecuteMatmul(*PrimitiveFor(chunk, threads), ws, rows, weights_data_, nullptr, sums);
    DequantizeRows(sums, chunk, n_, d, bf16_out, static_cast<uint8_t*>(y) + done * y_row);
    done += chunk;
  }
}

}  // namespace mha
