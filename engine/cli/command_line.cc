#include "engine/cli/command_line.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mha {
namespace {

absl::Status Invalid(absl::string_view arg, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(arg, ": ", why, " (see --help)"));
}

// `text` wrapped at `width` columns, each line after `indent` spaces.
std::string Wrapped(absl::string_view text, size_t indent, size_t width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

std::string FlagText(const absl::CommandLineFlag& flag) {
  const std::string value = flag.DefaultValue();
  return absl::StrCat("  --", flag.Name(),
                      value.empty() ? "" : absl::StrCat(" (default ", value, ")"), "\n",
                      Wrapped(flag.Help(), 6, 100));
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(int argc, char** argv) {
  CommandLine line;
  line.args.push_back(argv[0]);
  bool flags_ended = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (flags_ended || arg.size() < 2 || arg[0] != '-') {
      line.args.push_back(argv[i]);
      continue;
    }
    if (arg == "--") {
      flags_ended = true;
      continue;
    }
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    const size_t equals = body.find('=');
    const absl::string_view name = body.substr(0, equals);
    if (name == "help" || name == "h" || name == "helpfull" || name == "helpshort") {
      line.help = true;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    std::string value;
    if (flag == nullptr && absl::StartsWith(name, "no") && equals == absl::string_view::npos) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag == nullptr || !flag->IsOfType<bool>()) return Invalid(arg, "unknown flag");
      value = "false";
    } else if (flag == nullptr || flag->IsRetired()) {
      return Invalid(arg, "unknown flag");
    } else if (equals != absl::string_view::npos) {
      value = std::string(body.substr(equals + 1));
    } else if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return Invalid(arg, "needs a value");
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) return Invalid(absl::StrCat("--", flag->Name()), error);
    line.given.insert(std::string(flag->Name()));
  }
  return line;
}

std::string HelpText(absl::string_view usage, const std::vector<FlagGroup>& groups,
                     absl::string_view own_prefix) {
  std::string out = absl::StrCat("usage: ", usage, "\n");
  const absl::flat_hash_map<absl::string_view, absl::CommandLineFlag*> all = absl::GetAllFlags();
  std::set<std::string> listed;
  for (const FlagGroup& group : groups) {
    absl::StrAppend(&out, "\n", group.title, ":\n");
    for (const std::string& name : group.flags) {
      auto it = all.find(name);
      if (it == all.end()) continue;
      absl::StrAppend(&out, FlagText(*it->second));
      listed.insert(name);
    }
  }
  std::map<std::string, const absl::CommandLineFlag*> others;  // sorted by name
  for (const auto& [name, flag] : all) {
    if (listed.count(std::string(name)) > 0 || flag->IsRetired()) continue;
    if (absl::StrContains(flag->Filename(), own_prefix)) others[std::string(name)] = flag;
  }
  if (!others.empty()) {
    absl::StrAppend(&out, "\nOther flags:\n");
    for (const auto& [name, flag] : others) absl::StrAppend(&out, FlagText(*flag));
  }
  return out;
}

CommandLine ParseCommandLineOrExit(int argc, char** argv, absl::string_view usage,
                                   const std::vector<FlagGroup>& groups,
                                   absl::string_view own_prefix) {
  absl::StatusOr<CommandLine> line = ParseCommandLine(argc, argv);
  if (!line.ok()) {
    std::fprintf(stderr, "%s\n", line.status().ToString().c_str());
    std::exit(2);
  }
  if (line->help) {
    std::fputs(HelpText(usage, groups, own_prefix).c_str(), stdout);
    std::exit(0);
  }
  return *std::move(line);
}

}  // namespace mha
