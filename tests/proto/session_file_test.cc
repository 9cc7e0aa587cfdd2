// The session file format's one C++ module against the golden file
// (tests/proto/golden_session.mhasess), which the Python client's test reads
// and writes too: the same bytes in both directions. And what it refuses.
#include "mha/v1/session_file.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mha::v1 {
namespace {

using ::testing::HasSubstr;

// The chunks of the golden file (tests/proto/golden_session.py's values).
std::vector<SessionChunk> GoldenChunks() {
  std::vector<SessionChunk> chunks(4);
  SessionHeader& h = *chunks[0].mutable_header();
  h.set_format_version(1);
  h.set_session_id("golden-1");
  h.set_model("demo");
  h.set_model_version(2);
  h.set_fingerprint(0x0123456789ABCDEFull);
  h.set_heads(4);
  h.set_qk_head_dim(64);
  h.set_v_head_dim(64);
  h.set_cache_dtype("FP32");
  h.set_position(40);
  h.set_cross(false);
  h.set_max_tokens(4096);
  h.set_idle_timeout_ms(600000);
  h.set_idle_left_ms(1234);
  h.set_blocks(2);
  h.set_block_bytes(16);
  std::string block(16, '\0');
  for (int i = 0; i < 16; ++i) block[i] = static_cast<char>(i);
  chunks[1].set_block(block);
  for (int i = 0; i < 16; ++i) block[i] = static_cast<char>(16 + i);
  chunks[2].set_block(block);
  chunks[3].mutable_trailer()->set_checksum(0xFEEDFACECAFEBEEFull);
  return chunks;
}

std::string GoldenBytes() {
  std::ifstream in(MHA_GOLDEN_SESSION, std::ios::binary);
  EXPECT_TRUE(in) << MHA_GOLDEN_SESSION;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every chunk of `bytes`, or the reader's error.
absl::StatusOr<std::vector<SessionChunk>> ReadAll(const std::string& bytes) {
  std::istringstream in(bytes);
  SessionFileReader reader(in);
  if (absl::Status s = reader.Open(); !s.ok()) return s;
  std::vector<SessionChunk> chunks;
  SessionChunk chunk;
  while (true) {
    absl::StatusOr<bool> more = reader.Next(chunk);
    if (!more.ok()) return more.status();
    if (!*more) return chunks;
    chunks.push_back(chunk);
  }
}

TEST(SessionFileTest, WritesTheGoldenFileByteForByte) {
  std::ostringstream out;
  SessionFileWriter writer(out);
  for (const SessionChunk& chunk : GoldenChunks()) ASSERT_TRUE(writer.Write(chunk));
  EXPECT_EQ(out.str(), GoldenBytes());
}

TEST(SessionFileTest, ReadsTheGoldenFileChunkForChunk) {
  absl::StatusOr<std::vector<SessionChunk>> read = ReadAll(GoldenBytes());
  ASSERT_TRUE(read.ok()) << read.status();
  const std::vector<SessionChunk> golden = GoldenChunks();
  ASSERT_EQ(read->size(), golden.size());
  for (size_t i = 0; i < golden.size(); ++i) {
    EXPECT_EQ((*read)[i].SerializeAsString(), golden[i].SerializeAsString()) << "chunk " << i;
  }
}

TEST(SessionFileTest, RefusesOtherFilesAndTruncatedOrOversizedChunks) {
  const std::string golden = GoldenBytes();
  EXPECT_THAT(ReadAll("MHASESS2" + golden.substr(8)).status().message(),
              HasSubstr("not a session file"));
  EXPECT_THAT(ReadAll("MHA").status().message(), HasSubstr("not a session file"));
  EXPECT_THAT(ReadAll(golden.substr(0, golden.size() - 3)).status().message(),
              HasSubstr("truncated or corrupt"));
  EXPECT_THAT(ReadAll(golden.substr(0, 10)).status().message(), HasSubstr("truncated"));
  std::string oversized = golden.substr(0, 8) + std::string("\xff\xff\xff\x7f", 4);
  EXPECT_THAT(ReadAll(oversized).status().message(), HasSubstr("a chunk of"));
  absl::StatusOr<std::vector<SessionChunk>> empty = ReadAll(golden.substr(0, 8));
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty()) << "the magic alone is a file of no chunks";
}

}  // namespace
}  // namespace mha::v1
