// Model control: the modes, loads and unloads on the control thread (then
// `changed`), a poll that finds a model added later, and what is refused in
// mode none and after Stop. On copies of the demo model.
#include "server/models/model_control.h"

#include <atomic>
#include <filesystem>
#include <future>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/models/model_repository.h"
#include "server/observability/metrics.h"
#include "tests/server/models/test_folder.h"

namespace mha::server {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(ModelControlModeTest, ParsesTheThreeModesAndNamesThemOnError) {
  EXPECT_EQ(*ParseModelControlMode("none"), ModelControlMode::kNone);
  EXPECT_EQ(*ParseModelControlMode("poll"), ModelControlMode::kPoll);
  EXPECT_EQ(*ParseModelControlMode("explicit"), ModelControlMode::kExplicit);
  const absl::Status bad = ParseModelControlMode("sometimes").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("none, poll, explicit"));
}

// A repository folder of its own, and the repository over it.
class ModelControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestFolder("mha_control_");
    repository_ = std::make_unique<ModelRepository>(dir_.string(), RepositoryOptions{}, metrics_);
  }
  void TearDown() override {
    repository_.reset();
    fs::remove_all(dir_);
  }
  void AddDemo(const std::string& name) {
    fs::copy(fs::path(MHA_DEMO_REPOSITORY) / "demo", dir_ / name, fs::copy_options::recursive);
  }
  bool Ready(const std::string& name) {
    absl::StatusOr<ModelStatus> status = repository_->Status(name);
    return status.ok() && status->ready;
  }
  // Load or Unload, waiting for its answer.
  static absl::Status Sync(ModelControl& control, bool load, const std::string& name) {
    std::promise<absl::Status> answered;
    std::future<absl::Status> answer = answered.get_future();
    auto done = [&answered](absl::Status s) { answered.set_value(std::move(s)); };
    if (load) {
      control.Load(name, done);
    } else {
      control.Unload(name, done);
    }
    return answer.get();
  }

  fs::path dir_;
  Metrics metrics_;
  std::unique_ptr<ModelRepository> repository_;
};

TEST_F(ModelControlTest, ModeNoneRefusesAtOnceSayingHowToTurnControlOn) {
  ModelControl control(*repository_, ModelControlMode::kNone, absl::Hours(1), [] {});
  EXPECT_EQ(control.Allowed().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(control.Allowed().message(), HasSubstr("--model_control_mode"));
  absl::Status answer = absl::UnknownError("not answered");
  control.Load("demo", [&answer](absl::Status s) { answer = std::move(s); });
  EXPECT_EQ(answer.code(), absl::StatusCode::kFailedPrecondition) << "answered in the caller";
}

TEST_F(ModelControlTest, ExplicitLoadsAndUnloadsOnItsThreadThenSaysChanged) {
  AddDemo("a");
  std::atomic<int> changed{0};
  ModelControl control(*repository_, ModelControlMode::kExplicit, absl::Hours(1),
                       [&changed] { ++changed; });
  EXPECT_TRUE(control.Allowed().ok());
  EXPECT_FALSE(Ready("a")) << "explicit mode loads nothing by itself";
  ASSERT_TRUE(Sync(control, /*load=*/true, "a").ok());
  EXPECT_TRUE(Ready("a"));
  EXPECT_EQ(changed.load(), 1);
  ASSERT_TRUE(Sync(control, /*load=*/false, "a").ok());
  EXPECT_FALSE(Ready("a"));
  EXPECT_EQ(changed.load(), 2);
  EXPECT_FALSE(Sync(control, /*load=*/true, "absent").ok());
}

TEST_F(ModelControlTest, PollModeFindsAModelAddedLater) {
  ModelControl control(*repository_, ModelControlMode::kPoll, absl::Milliseconds(20), [] {});
  AddDemo("late");
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!Ready("late") && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(Ready("late"));
}

TEST_F(ModelControlTest, AfterStopEveryRequestIsUnavailable) {
  AddDemo("a");
  ModelControl control(*repository_, ModelControlMode::kExplicit, absl::Hours(1), [] {});
  control.Stop();
  const absl::Status answer = Sync(control, /*load=*/true, "a");
  EXPECT_EQ(answer.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(Ready("a"));
}

}  // namespace
}  // namespace mha::server

namespace mha::server {
namespace {

// KServe's storage initializer leaves a storageUri that names one model as
// that model's folder at /mnt/models: a repository folder that holds a
// config.pbtxt is that one model, named by --model_name or by the folder,
// and serves nothing else.
TEST(SingleModelRepositoryTest, AModelFolderAsTheRepositoryIsItsOneModel) {
  const fs::path root = FreshTestFolder("mha_single_");
  const fs::path dir = root / "mnt_models";
  fs::copy(fs::path(MHA_DEMO_REPOSITORY) / "demo", dir, fs::copy_options::recursive);
  for (const std::string flag : {"", "my-layer"}) {
    SCOPED_TRACE(flag);
    Metrics metrics;
    RepositoryOptions options;
    options.single_model_name = flag;
    ModelRepository repository(dir.string() + "/", options, metrics);
    const std::string name = flag.empty() ? "mnt_models" : flag;
    EXPECT_EQ(repository.single_model(), name);
    repository.SyncAll();
    EXPECT_TRUE(repository.Find(name, 0).ok()) << repository.Find(name, 0).status();
    EXPECT_EQ(repository.ReadyVersions(name), std::vector<int64_t>{1});
    EXPECT_EQ(repository.Load("demo", /*retry_failed=*/false).code(), absl::StatusCode::kNotFound);
    ASSERT_EQ(repository.Index().size(), 1u);
    EXPECT_EQ(repository.Index()[0].name, name);
  }
  Metrics metrics;
  EXPECT_EQ(ModelRepository(root.string(), RepositoryOptions{}, metrics).single_model(), "")
      << "a folder of model folders is a repository";
  fs::remove_all(root);
}

}  // namespace
}  // namespace mha::server
