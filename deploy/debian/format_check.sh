#!/usr/bin/env bash
# Fails (exit 1, naming the files and lines) when a C++ file of the
# repository is not formatted as .clang-format says (Google style at 100
# columns). Fix with: git ls-files '*.cc' '*.h' | xargs clang-format-14 -i
set -euo pipefail
cd "$(dirname "$0")/../.."
mapfile -t files < <(git ls-files '*.cc' '*.h')
if ! clang-format-14 --dry-run --Werror "${files[@]}"; then
  echo "format_check: C++ not formatted as .clang-format says;" \
       "run: git ls-files '*.cc' '*.h' | xargs clang-format-14 -i" >&2
  exit 1
fi
echo "format_check: ${#files[@]} C++ files formatted"
