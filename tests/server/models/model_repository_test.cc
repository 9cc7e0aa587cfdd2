// What the repository reads from disk (version folders, policies, content
// fingerprints) and the per-version metric series.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "server/models/content_hash.h"
#include "server/models/model_upload.h"
#include "server/models/repository_scan.h"
#include "server/observability/metrics.h"
#include "tests/server/models/test_folder.h"

namespace mha::server {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

class RepositoryScanTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = FreshTestFolder("mha_scan_"); }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const fs::path& path, const std::string& text) {
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  }
  void Config(const std::string& extra = "") {
    Write(dir_ / "config.pbtxt", "embed_dim: 8\nnum_heads: 2\n" + extra);
  }
  std::vector<int64_t> Versions(const ModelOnDisk& m) {
    std::vector<int64_t> v;
    for (const VersionOnDisk& x : m.versions) v.push_back(x.version);
    return v;
  }

  fs::path dir_;
  FingerprintCache cache_;
};

TEST_F(RepositoryScanTest, LatestPolicyServesTheNewestVersions) {
  for (const char* v : {"1", "2", "10"}) Write(dir_ / v / "weights.safetensors", v);
  Write(dir_ / "notes" / "weights.safetensors", "not a version");
  Config();
  absl::StatusOr<ModelOnDisk> scan = ScanModelFolder(dir_.string(), cache_);
  ASSERT_TRUE(scan.ok()) << scan.status();
  EXPECT_THAT(Versions(*scan), ElementsAre(10));
  Config("version_policy { latest { num_versions: 2 } }\n");
  scan = ScanModelFolder(dir_.string(), cache_);
  ASSERT_TRUE(scan.ok()) << scan.status();
  EXPECT_THAT(Versions(*scan), ElementsAre(2, 10));
  Config("version_policy { all {} }\n");
  scan = ScanModelFolder(dir_.string(), cache_);
  EXPECT_THAT(Versions(*scan), ElementsAre(1, 2, 10));
}

TEST_F(RepositoryScanTest, SpecificPolicyReportsMissingVersions) {
  Write(dir_ / "1" / "weights.safetensors", "a");
  Config("version_policy { specific { versions: [4, 1] } }\n");
  absl::StatusOr<ModelOnDisk> scan = ScanModelFolder(dir_.string(), cache_);
  ASSERT_TRUE(scan.ok()) << scan.status();
  EXPECT_THAT(Versions(*scan), ElementsAre(1));
  ASSERT_EQ(scan->missing.count(4), 1u);
  EXPECT_THAT(scan->missing[4], HasSubstr("does not exist"));
  Config("version_policy { specific { versions: [0] } }\n");
  EXPECT_EQ(ScanModelFolder(dir_.string(), cache_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RepositoryScanTest, FlatWeightsAreVersionOneUnlessVersionFoldersExist) {
  Write(dir_ / "weights.safetensors", "flat");
  Config();
  absl::StatusOr<ModelOnDisk> scan = ScanModelFolder(dir_.string(), cache_);
  ASSERT_TRUE(scan.ok()) << scan.status();
  EXPECT_THAT(Versions(*scan), ElementsAre(1));
  EXPECT_EQ(scan->versions[0].weights_path, (dir_ / "weights.safetensors").string());
  Write(dir_ / "3" / "weights.safetensors", "three");
  scan = ScanModelFolder(dir_.string(), cache_);
  EXPECT_THAT(Versions(*scan), ElementsAre(3));
}

TEST_F(RepositoryScanTest, NoWeightsOrABadConfigIsAnError) {
  Config();
  EXPECT_EQ(ScanModelFolder(dir_.string(), cache_).status().code(), absl::StatusCode::kNotFound);
  Write(dir_ / "1" / "weights.safetensors", "a");
  Write(dir_ / "config.pbtxt", "embed_dim: 9\nnum_heads: 2\n");
  const absl::Status bad = ScanModelFolder(dir_.string(), cache_).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("config.pbtxt"));
}

TEST_F(RepositoryScanTest, DefaultPriorityLevelMustBeALevel) {
  Write(dir_ / "1" / "weights.safetensors", "a");
  Config("dynamic_batching { priority_levels: 2 default_priority_level: 2 }\n");
  EXPECT_TRUE(ScanModelFolder(dir_.string(), cache_).ok());
  Config("dynamic_batching { priority_levels: 2 default_priority_level: 3 }\n");
  const absl::Status bad = ScanModelFolder(dir_.string(), cache_).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()),
              HasSubstr("default_priority_level 3 is above priority_levels 2"));
}

// A reload follows the bytes: a rewrite that keeps the size and the mtime
// changes the fingerprint; touching the file does not.
TEST_F(RepositoryScanTest, FingerprintsFollowContentNotTimestamps) {
  const fs::path file = dir_ / "w";
  Write(file, "aaaa");
  struct stat before;
  ASSERT_EQ(stat(file.c_str(), &before), 0);
  absl::StatusOr<uint64_t> first = cache_.Of(file.string());
  ASSERT_TRUE(first.ok());
  Write(file, "bbbb");
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(utimensat(AT_FDCWD, file.c_str(), times, 0), 0);  // the old mtime back
  absl::StatusOr<uint64_t> rewritten = cache_.Of(file.string());
  ASSERT_TRUE(rewritten.ok());
  EXPECT_NE(*rewritten, *first);
  fs::last_write_time(file, fs::file_time_type::clock::now());  // touch
  EXPECT_EQ(*cache_.Of(file.string()), *rewritten);
  EXPECT_EQ(cache_.Of((dir_ / "missing").string()).status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelNameTest, HiddenAndOddNamesAreNotModels) {
  EXPECT_TRUE(IsValidModelName("demo-1.v2_x"));
  for (const char* bad : {"", ".", "..", ".staging", "a b", "a/b", "ü"}) {
    EXPECT_FALSE(IsValidModelName(bad)) << bad;
  }
  EXPECT_FALSE(IsValidModelName(std::string(kMaxModelNameBytes + 1, 'a')));
}

std::string Exposed(Metrics& metrics) {
  return prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
}

TEST(VersionMetricsTest, SeriesLeaveWhenTheLastHolderLetsGo) {
  Metrics metrics;
  std::shared_ptr<ModelMetrics> v1 = metrics.ForVersion("m", "1");
  std::shared_ptr<ModelMetrics> again = metrics.ForVersion("m", "1");
  EXPECT_EQ(v1.get(), again.get());
  v1->CountRequest("mha.v1", absl::StatusCode::kOk);
  v1->CountDropped("deadline");
  std::shared_ptr<ModelMetrics> v2 = metrics.ForVersion("m", "2");
  std::string text = Exposed(metrics);
  EXPECT_THAT(text, HasSubstr("mha_requests_total{api=\"mha.v1\",code=\"OK\",model=\"m\","
                              "version=\"1\"} 1"));
  EXPECT_THAT(text, HasSubstr("version=\"2\""));
  v1.reset();
  EXPECT_THAT(Exposed(metrics), HasSubstr("version=\"1\""));  // `again` still holds them
  again.reset();
  text = Exposed(metrics);
  EXPECT_THAT(text, ::testing::Not(HasSubstr("version=\"1\"")));
  EXPECT_THAT(text, HasSubstr("version=\"2\""));
  // A new holder of the same version starts from zero.
  std::shared_ptr<ModelMetrics> reloaded = metrics.ForVersion("m", "1");
  EXPECT_THAT(Exposed(metrics), ::testing::Not(HasSubstr("version=\"1\"} 1")));
}

// A model sent over the API lands in a private folder, exactly its files;
// a path that could land anywhere else is refused before anything is written.
TEST(ModelUploadTest, WritesOnlyTheFilesOfAModelFolder) {
  for (const char* ok :
       {"weights.safetensors", "1/weights.safetensors", "42/weights.safetensors"}) {
    EXPECT_TRUE(CheckUploadPath(ok).ok()) << ok;
  }
  for (const char* bad :
       {"", "/weights.safetensors", "../weights.safetensors", "1/../weights.safetensors",
        "0/weights.safetensors", "01/weights.safetensors", "a/weights.safetensors", "config.pbtxt",
        "1/weights.safetensors/x", "1//weights.safetensors", "./1/x"}) {
    EXPECT_EQ(CheckUploadPath(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  const fs::path root = fs::temp_directory_path() / "mha_upload_test";
  fs::remove_all(root);
  fs::create_directories(root);
  absl::StatusOr<std::string> refused =
      WriteUpload(root.string(), {{"1/weights.safetensors", "w"}, {"../escape", "x"}});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(fs::is_empty(root)) << "nothing written when one path is refused";

  absl::StatusOr<std::string> folder = WriteUpload(
      root.string(), {{"1/weights.safetensors", "one"}, {"2/weights.safetensors", "two"}});
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_EQ(fs::path(*folder).parent_path(), root);
  EXPECT_EQ(fs::status(*folder).permissions() & fs::perms::all, fs::perms::owner_all);
  std::ifstream one(fs::path(*folder) / "1" / "weights.safetensors");
  std::string text;
  one >> text;
  EXPECT_EQ(text, "one");
  EXPECT_TRUE(fs::is_regular_file(fs::path(*folder) / "2" / "weights.safetensors"));
  RemoveUpload(*folder);
  EXPECT_TRUE(fs::is_empty(root));
  fs::remove_all(root);
}

// A server's upload area: made locked, removed with the server; at start
// the areas of dead servers go (the lock nobody holds), and nothing else.
TEST(ModelUploadTest, AnAreaRemovesWhatDeadServersLeftAndNothingElse) {
  const fs::path root = fs::temp_directory_path() / absl::StrCat("mha_upload_area_test_", getpid());
  fs::remove_all(root);
  fs::create_directories(root);
  auto make = [](const fs::path& folder, bool lock) {
    fs::create_directories(folder);
    std::ofstream(folder / "upload-abcdef") << "weights";
    if (lock) std::ofstream(folder / "lock");
  };
  make(root / "mha-uploads-dead01", true);    // a killed server's: its lock is free
  make(root / "mha-uploads-nolock", false);   // not ours: no lock file
  make(root / "mha-uploads-toolong1", true);  // not a name mkdtemp made
  make(root / "elsewhere", true);
  fs::create_directory_symlink(root / "elsewhere", root / "mha-uploads-link01");
  std::ofstream(root / "mha-uploads-file01") << "a file";

  std::vector<std::string> removed;
  absl::StatusOr<std::unique_ptr<UploadArea>> live = UploadArea::Create(root.string(), &removed);
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(removed, std::vector<std::string>{(root / "mha-uploads-dead01").string()});
  for (const char* kept : {"mha-uploads-nolock", "mha-uploads-toolong1", "elsewhere",
                           "mha-uploads-link01", "mha-uploads-file01"}) {
    EXPECT_TRUE(fs::exists(root / kept)) << kept;
  }
  EXPECT_TRUE(fs::exists(root / "elsewhere" / "upload-abcdef")) << "the link is not followed";
  const fs::path area = (*live)->path();
  EXPECT_EQ(area.parent_path(), root);
  EXPECT_EQ(fs::status(area).permissions() & fs::perms::all, fs::perms::owner_all);

  // A second server beside it leaves the live area alone.
  removed.clear();
  absl::StatusOr<std::unique_ptr<UploadArea>> beside = UploadArea::Create(root.string(), &removed);
  ASSERT_TRUE(beside.ok());
  EXPECT_TRUE(removed.empty());
  EXPECT_TRUE(fs::exists(area));
  absl::StatusOr<std::string> upload = WriteUpload(area.string(), {{"weights.safetensors", "w"}});
  ASSERT_TRUE(upload.ok()) << upload.status();
  EXPECT_EQ(fs::path(*upload).parent_path(), area);
  live->reset();
  EXPECT_FALSE(fs::exists(area)) << "a server's area goes with it";
  beside->reset();
  fs::remove_all(root);
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// The hash that identifies a model version across servers: pieces do not
// matter, every byte does, and its value is fixed (a change would make
// servers of two builds disagree about the same files).
TEST(ContentHashTest, StableAndSensitiveToEveryByte) {
  std::string data(1000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 3);
  const uint64_t whole = HashBytes(data);
  for (const size_t cut : {1, 31, 32, 33, 500, 999}) {
    ContentHash pieces;
    pieces.Update(absl::string_view(data).substr(0, cut));
    pieces.Update(absl::string_view(data).substr(cut));
    EXPECT_EQ(pieces.Finish(), whole) << cut;
  }
  for (const size_t at : {0, 17, 511, 992, 999}) {
    std::string changed = data;
    changed[at] ^= 1;
    EXPECT_NE(HashBytes(changed), whole) << at;
  }
  EXPECT_NE(HashBytes(data.substr(0, 999)), whole);
  EXPECT_NE(HashBytes(data, 1), whole);
  EXPECT_NE(CombineHashes(1, 2), CombineHashes(2, 1));
  EXPECT_EQ(HashBytes("mha-serve"), uint64_t{3006346188108175024u});
  EXPECT_EQ(HashBytes(""), HashBytes("", 0));
}

}  // namespace
}  // namespace mha::server
