// mha_bench --decode: sessions (incremental attention over a key/value
// cache) against recomputing the whole sequence.
#ifndef MHA_TESTS_BENCH_DECODE_BENCH_H_
#define MHA_TESTS_BENCH_DECODE_BENCH_H_

namespace mha {

// Prints (JSON lines with `json`) the issue-22 targets, f32, E=512, h=8:
// one Append of 1 token at cached length 4096 against one causal Run over
// the 4097 tokens; and 64 sessions at cached length 1024 appending 1 token
// each in one batched call against one call each (tokens/s). First a
// streaming-read probe with the engine's threads: each decode row then
// reports the key/value bytes it read, their rate and its fraction of the
// probe's (a step's physical limit is the memory's read bandwidth).
void BenchDecode(bool json);

}  // namespace mha

#endif  // MHA_TESTS_BENCH_DECODE_BENCH_H_
