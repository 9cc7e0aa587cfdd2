// Session files (spill and export) checked whole: every byte of a small
// file, changed one at a time, is refused with DATA_LOSS naming the
// session, never restored; the format-1 files of earlier servers are still
// read when their blocks verify; a failed write leaves no partial file.
#include "server/sessions/session_stream.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/stubs/logging.h"
#include "gtest/gtest.h"
#include "server/models/content_hash.h"
#include "tests/engine/engine_cases.h"
#include "tests/engine/test_models.h"

namespace mha::server {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

VersionPtr SmallVersion() {
  const AttentionDims d = testing::MakeDims(8, 2);
  auto version = std::make_shared<ModelVersion>();
  version->name = "m";
  version->version = 1;
  version->fingerprint = 0x1234;
  version->loaded.dims = d;
  version->loaded.engine = testing::MakeEngine(d, testing::RandomWeights(d, 3));
  return version;
}

// A session of `position` tokens (random cache bytes), imported into
// `sessions` so that it can be written out.
void ImportRandom(SessionManager& sessions, const VersionPtr& version, const std::string& id,
                  int64_t position, bool cross) {
  const KvLayout& layout = version->loaded.engine->kv_layout();
  SessionImport in;
  in.version = version;
  in.id = id;
  in.position = position;
  in.cross = cross;
  in.max_tokens = 256;
  in.idle_timeout = in.idle_left = absl::Minutes(10);
  std::mt19937 random(7);
  for (int64_t b = 0; b < layout.BlocksFor(position); ++b) {
    std::string block(static_cast<size_t>(layout.block_bytes()), '\0');
    float* values = reinterpret_cast<float*>(block.data());
    for (size_t i = 0; i < block.size() / sizeof(float); ++i) values[i] = (random() % 200) * 0.01f;
    in.blocks.push_back(std::move(block));
  }
  if (cross) in.key_padding.assign(static_cast<size_t>(position), 0.0f);
  ASSERT_TRUE(sessions.Import(std::move(in)).ok());
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

class SessionStreamTest : public ::testing::Test {
 protected:
  // A folder of its own: ctest runs these cases in parallel processes.
  SessionStreamTest()
      : dir_(fs::temp_directory_path() /
             absl::StrCat("mha_session_stream_test_",
                          ::testing::UnitTest::GetInstance()->current_test_info()->name(), "_",
                          getpid())) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~SessionStreamTest() override { fs::remove_all(dir_); }

  absl::StatusOr<SessionImport> Read(const std::string& path) {
    SessionChunkReader reader([this](const std::string&, int64_t) { return version_; },
                              int64_t{1} << 30);
    return ReadSessionFile(path, reader);
  }

  // The file of session `id`, written as a spill writes it.
  std::string Written(const std::string& id) {
    const std::string path = (dir_ / (id + ".mhasession")).string();
    absl::StatusOr<SessionSnapshot> snapshot = sessions_.Snapshot(id);
    EXPECT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_TRUE(WriteSessionFile(path, *std::move(snapshot)).ok());
    return path;
  }

  const fs::path dir_;
  const VersionPtr version_ = SmallVersion();
  SessionManager sessions_{SessionOptions{}, {}};
};

TEST_F(SessionStreamTest, EveryChangedByteIsRefusedAsDataLoss) {
  ImportRandom(sessions_, version_, "self-1", 40, /*cross=*/false);
  ImportRandom(sessions_, version_, "cross-1", 3, /*cross=*/true);
  for (const auto& [id, position] : {std::pair<std::string, int>{"self-1", 40}, {"cross-1", 3}}) {
    const std::string path = Written(id);
    const std::string good = ReadBytes(path);
    absl::StatusOr<SessionImport> whole = Read(path);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(whole->id, id);
    const std::string changed_path = path + ".changed";
    for (size_t i = 0; i < good.size(); ++i) {
      // 0x02 turns a bool's 1 into 3 (still true to protobuf), 0x80 a
      // varint's end into a continuation.
      for (const unsigned char flip : {0x02, 0x80}) {
        google::protobuf::LogSilencer quiet;  // invalid UTF-8 in strings, as meant
        std::string bad = good;
        bad[i] = static_cast<char>(bad[i] ^ flip);
        WriteBytes(changed_path, bad);
        absl::StatusOr<SessionImport> read = Read(changed_path);
        ASSERT_FALSE(read.ok()) << id << ": byte " << i << " ^ " << int{flip} << " was read";
        ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss)
            << "byte " << i << ": " << read.status();
        ASSERT_THAT(read.status().message(), HasSubstr(changed_path));
      }
    }
    // The header's position (the 277 -> 276) names the session.
    std::string bad = good;
    // Field 10 as a varint (tag 0x50), then the position (one byte here).
    const size_t at = bad.find(std::string{'\x50', static_cast<char>(position)});
    ASSERT_NE(at, std::string::npos);
    bad[at + 1] = static_cast<char>(bad[at + 1] ^ 1);
    WriteBytes(changed_path, bad);
    EXPECT_THAT(Read(changed_path).status().message(),
                HasSubstr(absl::StrCat("session ", id, ": the header's checksum does not match")));
  }
}

TEST_F(SessionStreamTest, AFormatOneFileIsReadWhenItsBlocksVerify) {
  // Format 1, as servers before issue 64 wrote it: no header checksum, a
  // trailer of the blocks alone.
  ImportRandom(sessions_, version_, "old", 40, /*cross=*/false);
  absl::StatusOr<SessionSnapshot> snapshot = sessions_.Snapshot("old");
  ASSERT_TRUE(snapshot.ok());
  SessionChunkWriter writer(*std::move(snapshot));
  std::vector<v1::SessionChunk> chunks;
  for (v1::SessionChunk chunk; writer.Next(chunk);) chunks.push_back(chunk);
  ContentHash blocks;
  for (const v1::SessionChunk& chunk : chunks) {
    if (chunk.has_block()) blocks.Update(chunk.block());
  }
  chunks.front().mutable_header()->set_format_version(1);
  chunks.front().mutable_header()->clear_header_checksum();
  const std::string path = (dir_ / "old.mhasession").string();
  auto write = [&path](const std::vector<v1::SessionChunk>& all) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    v1::SessionFileWriter file(out);
    for (const v1::SessionChunk& chunk : all) file.Write(chunk);
  };
  chunks.back().mutable_trailer()->set_checksum(blocks.Finish());
  write(chunks);
  absl::StatusOr<SessionImport> read = Read(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->position, 40);
  chunks.back().mutable_trailer()->set_checksum(blocks.Finish() ^ 1);
  write(chunks);
  EXPECT_EQ(Read(path).status().code(), absl::StatusCode::kDataLoss);
  // A format this server does not read, whose header verifies: named.
  chunks = {};
  snapshot = sessions_.Snapshot("old");
  SessionChunkWriter again(*std::move(snapshot));
  for (v1::SessionChunk chunk; again.Next(chunk);) chunks.push_back(chunk);
  v1::SessionHeader& header = *chunks.front().mutable_header();
  auto seal = [&header] {
    ContentHash checksum;
    header.clear_header_checksum();
    checksum.Update(absl::string_view(v1::kSessionFileMagic, 8));
    checksum.Update(header.SerializeAsString());
    header.set_header_checksum(checksum.Finish());
  };
  header.set_format_version(3);
  seal();
  write(chunks);
  const absl::Status newer = Read(path).status();
  EXPECT_EQ(newer.code(), absl::StatusCode::kFailedPrecondition) << newer;
  EXPECT_THAT(newer.message(), HasSubstr("format version 3; this server reads 1 and 2 (a newer"));
  // import_as is a caller's request: never read from a file.
  header.set_format_version(2);
  seal();
  write(chunks);
  ASSERT_TRUE(Read(path).ok()) << "sealed again, it reads";
  chunks.front().set_import_as("other");
  write(chunks);
  const absl::Status renamed = Read(path).status();
  EXPECT_EQ(renamed.code(), absl::StatusCode::kDataLoss) << renamed;
  EXPECT_THAT(renamed.message(), HasSubstr("import_as"));
}

TEST_F(SessionStreamTest, AFailedWriteLeavesNoPartialFile) {
  ImportRandom(sessions_, version_, "s", 40, /*cross=*/false);
  absl::StatusOr<SessionSnapshot> snapshot = sessions_.Snapshot("s");
  ASSERT_TRUE(snapshot.ok());
  // /dev/full takes the open and fails every write: a stand-in for a full disk
  // that needs no root; the rename target is a folder, so a rename fails too.
  const fs::path target = dir_ / "target";
  fs::create_directories(target / "x");
  EXPECT_FALSE(WriteSessionFile(target.string(), *std::move(snapshot)).ok());
  EXPECT_FALSE(fs::exists(target.string() + kPartialSuffix));
  if (fs::exists("/dev/full")) {
    snapshot = sessions_.Snapshot("s");
    fs::create_symlink("/dev/full", dir_ / ("full" + std::string(kPartialSuffix)));
    const absl::Status full = WriteSessionFile((dir_ / "full").string(), *std::move(snapshot));
    EXPECT_THAT(full.message(), HasSubstr("failed"));
    EXPECT_FALSE(fs::exists(dir_ / "full"));
    EXPECT_FALSE(fs::is_symlink(dir_ / ("full" + std::string(kPartialSuffix))));
  }
}

}  // namespace
}  // namespace mha::server
