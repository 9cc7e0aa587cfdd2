// RequestAttention's key-tiled path: the blocks ((row block, head) pairs)
// of every key-tiled sequence of a call, dealt to the threads in runs of
// about equal flops and run by TiledAttention (see request_attention.h).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#include "engine/attention_batch.h"
#include "engine/ops/kernels.h"
#include "engine/ops/onednn_matmul.h"
#include "engine/ops/parallel_for.h"
#include "engine/request_attention.h"
#include "engine/tiled_attention.h"
#include "engine/workspace.h"

namespace mha {
namespace {

using onednn::ActSize;

}  // namespace

// The blocks of every key-tiled sequence, numbered sequence by sequence,
// each sequence's (row block, head) pairs heads first.
struct RequestAttention::TiledItems {
  const RequestAttention& self;
  const Projected& p;
  const AttentionBatch& batch;

  int64_t Length(int64_t b) const { return batch.q_offsets[b + 1] - batch.q_offsets[b]; }
  int64_t Keys(int64_t b) const { return p.kv_offsets[b + 1] - p.kv_offsets[b]; }
  bool Tiled(int64_t b) const { return self.Tiled(Length(b), Keys(b), /*weights=*/false); }
  int64_t BlockRows(int64_t b) const {
    return self.QueryBlockRows(Length(b), Keys(b), /*weights=*/false);
  }
  // Items of sequence b: 0 unless it is tiled.
  int64_t Count(int64_t b) const {
    if (!Tiled(b)) return 0;
    const int64_t rows = BlockRows(b);
    return self.dims_.num_heads * ((Length(b) + rows - 1) / rows);
  }
  // Its flops (both products), about: under a causal mask its rows see
  // about as many keys as its middle row.
  int64_t Flops(int64_t b, int64_t item) const {
    const int64_t rows = BlockRows(b), row0 = (item / self.dims_.num_heads) * rows;
    const int64_t own = std::min(rows, Length(b) - row0);
    const int64_t keys =
        batch.is_causal ? std::min(Keys(b), row0 + own / 2 + 1 + self.dims_.extra_keys()) : Keys(b);
    return 2 * own * keys * (self.dims_.qk_head_dim + self.dims_.v_head_dim);
  }
  TiledBlock Block(int64_t b, int64_t item) const;
};

// Where an item is: its sequence, and the sequence's first item's number.
struct RequestAttention::TiledCursor {
  int64_t seq = 0, first_item = 0;
  // Moves on to the sequence of item `item` (not before this one).
  void To(int64_t item, const TiledItems& items) {
    while (item >= first_item + items.Count(seq)) first_item += items.Count(seq++);
  }
};

TiledBlock RequestAttention::TiledItems::Block(int64_t b, int64_t item) const {
  const AttentionDims& d = self.dims_;
  const int64_t h = d.num_heads, dqk = d.qk_head_dim, dv = d.v_head_dim;
  const int64_t act = static_cast<int64_t>(ActSize(self.act_dt_));
  const int64_t len = Length(b), s = Keys(b), block_rows = BlockRows(b);
  const HeadLayout q_layout{h, dqk * act, len, block_rows};
  const HeadLayout ctx_layout{h, dv * act, len, block_rows};
  const int64_t head = item % h, row0 = (item / h) * block_rows;
  TiledBlock blk;
  blk.rows = std::min(block_rows, len - row0);
  blk.keys = s;
  blk.q = p.q + batch.q_offsets[b] * d.qk_width() * act + q_layout.Offset(head, row0);
  blk.context =
      p.context_heads + batch.q_offsets[b] * d.v_width() * act + ctx_layout.Offset(head, row0);
  if (self.InPlace(len, s, /*weights=*/false)) {
    const TokenMajor& t = p.tokens;
    const int64_t kv0 = (batch.self_attention() ? batch.q_offsets : batch.kv_offsets)[b];
    blk.q = t.q + ((batch.q_offsets[b] + row0) * t.ldq + head * dqk) * act;
    blk.q_stride = t.ldq;
    blk.k = t.k + (kv0 * t.ldk + head * dqk) * act;
    blk.v = t.v + (kv0 * t.ldv + head * dv) * act;
    blk.k_stride = t.ldk;
    blk.v_stride = t.ldv;
  } else {
    blk.k = p.k + (p.kv_offsets[b] * d.qk_width() + head * s * dqk) * act;
    blk.v = p.v + (p.kv_offsets[b] * d.v_width() + head * s * dv) * act;
  }
  blk.masks = self.MasksFor(p, batch, b, len, row0, head);
  return blk;
}

// Items [first, end) from cursor `c` cut into `threads` runs of
// neighbours of about equal flops (CutIntoRuns): neighbours share a
// sequence's rows, which the projections' threads wrote in contiguous parts.
RequestAttention::RunBounds RequestAttention::DealItems(const TiledItems& items, TiledCursor c,
                                                        int64_t first, int64_t end,
                                                        int64_t threads) {
  RunBounds bounds(threads + 1);
  CutIntoRuns(
      first, end, threads,
      [&](auto visit) {
        TiledCursor walk = c;
        for (int64_t item = first; item < end; ++item) {
          walk.To(item, items);
          visit(items.Flops(walk.seq, item - walk.first_item));
        }
      },
      bounds.data());
  return bounds;
}

void RequestAttention::AttendTiled(const Projected& p, const AttentionBatch& batch,
                                   Workspace& ws) const {
  const TiledItems items{*this, p, batch};
  const int64_t n = batch.num_rows();
  int64_t total = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t count = items.Count(b);
    if (count > 0) tiled_->Prepare(items.BlockRows(b));
    total += count;
  }
  ws.ReserveChildren(omp_get_max_threads());
  // The blocks of all the tiled sequences in one region (a region costs
  // 0.4-5 us of wake-up and join, and a ragged batch has dozens of
  // sequences), dealt out in runs of neighbours of about equal flops
  // (DealItems; heads dealt round-robin made every thread read rows the
  // other core projected: int8 8 x 128 and cross, one pass 15-20 % slower
  // on the EPYC VM). Each thread runs on its own child workspace; oneDNN runs
  // single-threaded inside the region. A fixed deal, not a dynamic one:
  // each child then sees the same block shapes call after call, so warm
  // calls allocate nothing. Exceptions must not cross the region.
  // A workspace with a yield point runs them in waves of at least
  // options_.yield_wave_flops a thread (each wave a multiple of the threads'
  // count of blocks), yielding after each. Smaller waves cost more: a
  // barrier each, waiting for the slower thread (one block a wave cost 2 %
  // at 1 x 1024, E = 512; 5 % at 1 x 12000, E = 256). A stop check costs no
  // wave: thread 0 asks it between its blocks, and once it says stop every
  // thread skips the blocks it has left.
  const int64_t threads = omp_get_max_threads();
  std::atomic<bool> stopping{false};
  TiledCursor wave_start;
  for (int64_t first = 0, end = 0; first < total; first = end) {
    end = total;
    if (ws.yields()) {
      TiledCursor c = wave_start;
      int64_t flops = 0;
      for (end = first; end < total && flops < threads * options_.yield_wave_flops; ++end) {
        c.To(end, items);
        flops += items.Flops(c.seq, end - c.first_item);
      }
      end = std::min(total, (end + threads - 1) / threads * threads);
    }
    const RunBounds bounds = DealItems(items, wave_start, first, end, threads);
    std::exception_ptr error;
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), team = omp_get_num_threads();
      TiledCursor c = wave_start;
      const int64_t own_end = bounds[(t + 1) * threads / team];
      for (int64_t item = bounds[t * threads / team]; item < own_end; ++item) {
        if (stopping.load(std::memory_order_relaxed)) break;
        try {
          c.To(item, items);
          tiled_->Run(items.Block(c.seq, item - c.first_item), ws.Child(t));
          if (t == 0 && ws.StopRequested()) stopping = true;
        } catch (...) {
#pragma omp critical(mha_tiled_error)
          if (error == nullptr) error = std::current_exception();
        }
      }
    }
    if (error != nullptr) std::rethrow_exception(error);
    if (stopping) throw CallStopped{};
    if (end < total) wave_start.To(end, items);
    ws.BetweenBlocks();
  }
}

}  // namespace mha
