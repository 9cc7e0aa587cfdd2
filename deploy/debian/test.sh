#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test
# (unit tests, the PyTorch parity battery) through ctest.
set -euo pipefail
here="$(dirname "$0")"
bash "$here/install_deps.sh"
bash "$here/build.sh"
cd "$here/../../build"
ctest --output-on-failure --timeout 1800
