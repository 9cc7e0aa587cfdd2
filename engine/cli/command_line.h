// The command line of our programs (mha_server, mha_client): Abseil's flags,
// read by our own parser so that --help shows the program's own flags,
// grouped, and a bad command line exits 2 with "CODE: message" (Abseil's
// parser prints "ERROR: Illegal value" and exits 1; its --help filters flags
// by a file name that is not the program's, and printed "No flags matched").
#ifndef MHA_ENGINE_CLI_COMMAND_LINE_H_
#define MHA_ENGINE_CLI_COMMAND_LINE_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mha {

// A titled group of flags (by name, without dashes) in the --help text.
struct FlagGroup {
  std::string title;
  std::vector<std::string> flags;
};

// What ParseCommandLine read: the arguments that are not flags (the
// program's name first), and the names of the flags given.
struct CommandLine {
  std::vector<char*> args;
  std::set<std::string> given;
  bool help = false;  // --help, -h or --helpfull: print HelpText and exit 0
};

// Reads argv: `--name=value`, `--name value`, `--name` / `--noname` for a
// bool, `--` ends the flags. INVALID_ARGUMENT naming the flag for an unknown
// flag, a value that does not parse, or a missing value.
absl::StatusOr<CommandLine> ParseCommandLine(int argc, char** argv);

// The usage, then every group's flags with their defaults and help; flags
// of this program (defined in a file under `own_prefix`, e.g. "server/")
// in no group are listed under "Other flags".
std::string HelpText(absl::string_view usage, const std::vector<FlagGroup>& groups,
                     absl::string_view own_prefix);

// ParseCommandLine, or exit: 0 after printing HelpText to stdout for
// --help, 2 after printing "INVALID_ARGUMENT: ..." to stderr on an error.
CommandLine ParseCommandLineOrExit(int argc, char** argv, absl::string_view usage,
                                   const std::vector<FlagGroup>& groups,
                                   absl::string_view own_prefix);

}  // namespace mha

#endif  // MHA_ENGINE_CLI_COMMAND_LINE_H_
