#!/usr/bin/env bash
# The "try it" command: installs what is missing, builds, and starts
# mha_server on the built-in demo repository (models/: the demo model is
# nn.MultiheadAttention(256, 4)). gRPC on port 50051, KServe v2 over
# HTTP/REST on 8000, Prometheus metrics on 9464; Ctrl-C (SIGINT) or SIGTERM
# drains and stops it. Extra arguments go to mha_server (e.g. --port 0
# --http_port 0 --metrics_port 0).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bash "$here/install_deps.sh"
bash "$here/build.sh"
exec "$here/../../build/mha_server" --model_repository "$here/../../models" "$@"
