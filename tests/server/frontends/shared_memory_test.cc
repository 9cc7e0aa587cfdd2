// The shared-memory registry: what it refuses to register, slices read and
// written through pread/pwrite at their offsets, a region that outlives its
// unregistering for a request holding it, and an object shrunk after
// registering (an error, never a SIGBUS).
#include "server/frontends/common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha::server {
namespace {

using ::testing::HasSubstr;

// A POSIX shared-memory object of `size` bytes holding 0, 1, 2, ... (mod
// 256), removed with the fixture.
class SharedMemoryTest : public ::testing::Test {
 protected:
  static constexpr int64_t kSize = 4096;

  void SetUp() override {
    key_ = absl::StrCat("/mha_shm_test_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fd_ = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd_, 0) << key_;
    ASSERT_EQ(ftruncate(fd_, kSize), 0);
    std::vector<uint8_t> bytes(kSize);
    for (int64_t i = 0; i < kSize; ++i) bytes[i] = static_cast<uint8_t>(i);
    ASSERT_EQ(pwrite(fd_, bytes.data(), bytes.size(), 0), kSize);
  }
  void TearDown() override {
    if (fd_ >= 0) close(fd_);
    shm_unlink(key_.c_str());
  }

  std::string key_;
  int fd_ = -1;
};

TEST_F(SharedMemoryTest, RefusesBadNamesKeysRangesAndTooManyRegions) {
  SharedMemoryRegistry registry(/*max_regions=*/2);
  EXPECT_EQ(registry.Register("", key_, 0, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("r", "no_slash", 0, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("r", "/a/b", 0, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("r", key_, 0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("r", key_ + "_absent", 0, 16).code(), absl::StatusCode::kNotFound);
  const absl::Status past_end = registry.Register("r", key_, kSize - 8, 16);
  EXPECT_EQ(past_end.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past_end.message(), HasSubstr("fewer than offset"));

  ASSERT_TRUE(registry.Register("a", key_, 0, 16).ok());
  EXPECT_EQ(registry.Register("a", key_, 0, 16).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.Register("b", key_, 16, 16).ok());
  EXPECT_EQ(registry.Register("c", key_, 0, 16).code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<std::vector<SharedMemoryRegion>> all = registry.Status("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 2u);
  EXPECT_EQ(registry.Status("c").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SharedMemoryTest, SlicesReadAndWriteAtTheirOffsetsWithinTheRegion) {
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register("r", key_, 1000, 100).ok());
  absl::StatusOr<SharedMemorySlice> slice = registry.Slice("r", 10, 4, "input query");
  ASSERT_TRUE(slice.ok()) << slice.status();
  std::vector<uint8_t> read(4);
  ASSERT_TRUE(slice->Read(absl::MakeSpan(read)).ok());
  EXPECT_THAT(read, ::testing::ElementsAre(1010 % 256, 1011 % 256, 1012 % 256, 1013 % 256));

  const std::vector<uint8_t> written = {7, 8, 9};
  ASSERT_TRUE(slice->Write(written).ok());
  std::vector<uint8_t> raw(3);
  ASSERT_EQ(pread(fd_, raw.data(), raw.size(), 1010), 3);
  EXPECT_EQ(raw, written);
  EXPECT_FALSE(slice->Write(std::vector<uint8_t>(5)).ok()) << "more than the slice holds";

  const absl::Status past_end = registry.Slice("r", 90, 20, "input query").status();
  EXPECT_EQ(past_end.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past_end.message(), HasSubstr("input query"));
  EXPECT_THAT(registry.Slice("other", 0, 1, "output output").status().message(),
              HasSubstr("output output: no shared-memory region other"));
}

TEST_F(SharedMemoryTest, AHeldSliceOutlivesUnregisterAndAShrunkObjectIsAnError) {
  SharedMemoryRegistry registry;
  ASSERT_TRUE(registry.Register("r", key_, 0, 64).ok());
  absl::StatusOr<SharedMemorySlice> slice = registry.Slice("r", 32, 8, "input key");
  ASSERT_TRUE(slice.ok());
  registry.Unregister("r");
  EXPECT_EQ(registry.Status("r").status().code(), absl::StatusCode::kNotFound);
  std::vector<uint8_t> read(8);
  ASSERT_TRUE(slice->Read(absl::MakeSpan(read)).ok()) << "the request keeps its region";
  EXPECT_EQ(read[0], 32);

  ASSERT_EQ(ftruncate(fd_, 16), 0);  // the client shrinks its object
  const absl::Status shrunk = slice->Read(absl::MakeSpan(read));
  EXPECT_EQ(shrunk.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shrunk.message(), HasSubstr("shorter than registered"));

  ASSERT_TRUE(registry.Register("s", key_, 0, 16).ok());
  registry.Unregister("");  // every region
  EXPECT_TRUE(registry.Status("")->empty());
}

}  // namespace
}  // namespace mha::server
