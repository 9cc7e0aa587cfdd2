// A fresh folder for one test of the model repository's: named after the
// process and the test, emptied if a crashed run left it.
#ifndef MHA_TESTS_SERVER_MODELS_TEST_FOLDER_H_
#define MHA_TESTS_SERVER_MODELS_TEST_FOLDER_H_

#include <unistd.h>

#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace mha::server {

inline std::filesystem::path FreshTestFolder(const std::string& prefix) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      (prefix + std::to_string(::getpid()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace mha::server

#endif  // MHA_TESTS_SERVER_MODELS_TEST_FOLDER_H_
