#!/usr/bin/env bash
# The test command: installs what is missing, checks the C++ formatting
# (deploy/debian/format_check.sh), builds, and runs every test
# through ctest: unit tests, the PyTorch parity battery (through mha_run and
# through the server), the server and client tests against the real
# binaries. Then the deploy test (tests/deploy: Docker image, compose stacks,
# manifests), in the background while the two sanitizer builds compile. Then
# all of it again on a clang build (build-clang/) with
# AddressSanitizer and UndefinedBehaviorSanitizer, which must be clean (the
# C++ tests abort on a report, and the Python tests fail when a server's
# stderr has one), whose every file is compiled with the lock analysis as an
# error (-Werror=thread-safety), and which runs the libFuzzer targets. Then
# the engine and batcher tests on a ThreadSanitizer build (build-tsan/).
# ctest runs one test more at once than there are cores: most of the server
# tests wait on sockets and clocks, and at one test a core a quarter of the
# machine stood idle (the longest start first). At the end,
# pass or fail, it prints each stage's time, so that growth shows.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."

jobs=$(($(nproc) + 1))
stage_names=() stage_seconds=() stage_name="" stage_began=$SECONDS
# Starts stage "$1" (ending the one before) and says so.
stage() {
  end_stage
  stage_name="$1" stage_began=$SECONDS
  echo "== $1"
}
end_stage() {
  if [ -n "$stage_name" ]; then
    stage_names+=("$stage_name") stage_seconds+=($((SECONDS - stage_began)))
  fi
  stage_name=""
}
# Prints each stage's time; $1: the script's exit status.
print_stage_times() {
  local status=$1 i
  end_stage
  echo "== stage times ($([ $status -eq 0 ] && echo passed || echo "failed, exit $status"))"
  for i in "${!stage_names[@]}"; do
    printf '%6d:%02d  %s\n' $((stage_seconds[i] / 60)) $((stage_seconds[i] % 60)) "${stage_names[i]}"
  done
  printf '%6d:%02d  total\n' $((SECONDS / 60)) $((SECONDS % 60))
}
trap 'print_stage_times $?' EXIT

stage "install what is missing"
bash "$here/install_deps.sh"
stage "C++ formatting (.clang-format)"
bash "$here/format_check.sh"
stage "build (Release)"
bash "$here/build.sh"
stage "ctest (Release)"
(cd "$root/build" && ctest --output-on-failure --timeout 1800 -j "$jobs")

# The deploy test runs beside the clang and TSan builds: much of it waits on
# containers, Prometheus and nginx, and the builds take up that slack. Its
# output comes after the builds; it must pass before the next stage starts
# (which times things and wants the cores to itself).
deploy_log="$root/build/deploy_test.log"
deploy_began=$SECONDS
bash "$root/tests/deploy/deploy_test.sh" >"$deploy_log" 2>&1 &
deploy_pid=$!
stop_deploy() { kill "$deploy_pid" 2>/dev/null && wait "$deploy_pid" 2>/dev/null; true; }
trap 'status=$?; stop_deploy; print_stage_times $status' EXIT

stage "clang build: address + undefined sanitizers, locks checked, libFuzzer targets (the deploy test beside it)"
# One build, three checks: ASan and UBSan on every test; clang's lock
# analysis on every file of engine/, server/, client/ and proto/ (every clang
# build compiles with -Werror=thread-safety, CMakeLists.txt; a probe first
# shows that the analysis is live, deploy/debian/thread_safety_check.sh); and
# the fuzz targets, which need clang. A second compiler also finds what one
# lets pass: clang's `omp simd` max reduction starts at -FLT_MAX, not -inf,
# which broke fully masked rows (engine/ops/softmax_kernels.cc, RowMax).
bash "$here/thread_safety_check.sh"
cmake -S "$root" -B "$root/build-clang" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++-14 -DMHA_FUZZ=ON -DMHA_FUZZ_SECONDS="${MHA_FUZZ_SECONDS:-20}" \
  >/dev/null
cmake --build "$root/build-clang" -j "$(nproc)"

stage "ThreadSanitizer build (the deploy test beside it)"
# Debian's libgomp, gRPC and Abseil are not built with TSan, so what crosses
# them cannot be checked: this build runs the tests that drive our threads
# (concurrent engine runs, many clients against batcher workers) with one
# OpenMP thread per call; tests/tsan.supp lists only those libraries.
# One file at a time (no unity build): each of these files must compile alone
# (apart from the third-party headers precompiled for it, CMakeLists.txt).
# With clang: its precompiled headers made this build take half gcc's time.
cmake -S "$root" -B "$root/build-tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_SANITIZE=thread \
  -DMHA_UNITY_BUILD=OFF -DCMAKE_CXX_COMPILER=clang++-14 >/dev/null
cmake --build "$root/build-tsan" -j "$(nproc)" --target engine_test server_unit_test

stage "deploy: Docker image, compose + Prometheus, replicas behind nginx, K8s manifests (its end)"
deploy_status=0
wait "$deploy_pid" || deploy_status=$?
cat "$deploy_log"
echo "deploy test: exit $deploy_status after $((SECONDS - deploy_began)) s (begun with the clang build)"
[ "$deploy_status" -eq 0 ]

stage "ctest (address, undefined; each fuzz target for a bounded time)"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
(cd "$root/build-clang" && ctest --output-on-failure --timeout 1800 -j "$jobs")

stage "ThreadSanitizer: the engine and batcher tests (ctest -L threads)"
(cd "$root/build-tsan" &&
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/tests/tsan.supp" \
  OMP_NUM_THREADS=1 ctest --output-on-failure --timeout 1800 -L threads -j "$jobs")
