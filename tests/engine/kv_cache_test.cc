// engine/kv_cache.h's block pool: its budget, and blocks kept for reuse.
#include "engine/kv_cache.h"

#include "gtest/gtest.h"

namespace mha {
namespace {

TEST(KvBlockPoolTest, KeepsItsBudgetAndReusesBlocks) {
  KvLayout layout{4, 8, 8, 4};  // 32 tokens x 4 heads x 16 x 4 B = 8 KiB blocks
  ASSERT_EQ(layout.block_bytes(), 8192);
  KvBlockPool pool(3 * 8192);
  {
    KvCache a(layout, pool), b(layout, pool);
    ASSERT_TRUE(a.Reserve(64).ok());  // two blocks
    EXPECT_EQ(pool.bytes_in_use(), 2 * 8192);
    const absl::Status full = b.Reserve(64);
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(b.num_blocks(), 0) << "a failed reserve keeps only what it had";
    EXPECT_EQ(pool.bytes_in_use(), 2 * 8192);
    ASSERT_TRUE(b.Reserve(1).ok());
    EXPECT_EQ(pool.bytes_in_use(), 3 * 8192);
    a.set_length(10);
    a.ReleaseUnused();
    EXPECT_EQ(a.num_blocks(), 1);
    EXPECT_EQ(pool.bytes_in_use(), 2 * 8192);
  }
  EXPECT_EQ(pool.bytes_in_use(), 0);
  EXPECT_EQ(pool.bytes_held(), 3 * 8192) << "freed blocks are kept for reuse";
  // A block of another size makes room by freeing kept ones.
  KvLayout wide{4, 16, 16, 4};
  KvCache c(wide, pool);
  ASSERT_TRUE(c.Reserve(1).ok());
  EXPECT_LE(pool.bytes_held(), pool.budget());
  EXPECT_EQ(pool.bytes_in_use(), 16384);
}

}  // namespace
}  // namespace mha
