// Reading a whole file, for everything that loads one (model configs,
// safetensors checkpoints, TLS keys, tokens): one set of NOT_FOUND messages.
#ifndef MHA_ENGINE_FILE_READ_H_
#define MHA_ENGINE_FILE_READ_H_

#include <string>

#include "absl/status/statusor.h"

namespace mha {

// The bytes of the regular file at `path`. NOT_FOUND "no such file: <path>"
// when there is no regular file there, "cannot read <path>" when it cannot
// be opened or read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace mha

#endif  // MHA_ENGINE_FILE_READ_H_
