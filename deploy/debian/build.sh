#!/usr/bin/env bash
# Configures and builds mha-serve into ./build (Release). Re-running is
# incremental. Compiles through ccache (build/ccache, CMakeLists.txt): the
# deploy test's Docker build reuses what this build compiled.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMHA_CCACHE=ON >/dev/null
cmake --build build -j "$(nproc)"
