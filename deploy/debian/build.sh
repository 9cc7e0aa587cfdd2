#!/usr/bin/env bash
# Configures and builds mha-serve into ./build (Release). Re-running is
# incremental.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
