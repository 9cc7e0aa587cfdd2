#!/usr/bin/env bash
# Shows that the thread-safety analysis the clang build runs
# (-Werror=thread-safety, CMakeLists.txt) is live: a probe with every read
# under its lock compiles, and the same probe with one guarded member read
# without its lock (tests/engine/mutex_analysis_check.cc) must fail, naming
# the mutex. The clang build of the test command then holds engine/, server/,
# client/ and proto/ to the same rule (it compiles every file).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
probe="$root/tests/engine/mutex_analysis_check.cc"
flags=(-std=c++20 -fsyntax-only -I "$root" -Wthread-safety -Werror=thread-safety)
clang++-14 "${flags[@]}" "$probe"
if out="$(clang++-14 "${flags[@]}" -DMHA_PLANT_UNGUARDED_READ "$probe" 2>&1)"; then
  echo "thread-safety check: a planted unguarded read compiled; the analysis is not running" >&2
  exit 1
fi
if ! grep -q "requires holding mutex 'mu_'" <<<"$out"; then
  echo "thread-safety check: the planted read failed for another reason:" >&2
  echo "$out" >&2
  exit 1
fi
echo "thread-safety check: the planted unguarded read is refused by clang:"
grep "error:" <<<"$out"
