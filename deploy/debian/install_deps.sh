#!/usr/bin/env bash
# Installs, with apt-get, every Debian 12 package that building, running and
# testing mha-serve needs and that this machine does not have yet.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config clang-14 libclang-rt-14-dev clang-format-14 git
  libdnnl-dev ocl-icd-opencl-dev
  libabsl-dev libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev  # the server's logger
  nlohmann-json3-dev libmicrohttpd-dev libgnutls28-dev zlib1g-dev  # JSON; the HTTP front end
  libgoogle-perftools-dev  # TCMalloc, mha_server's allocator (CMakeLists.txt)
  python3 python3-numpy python3-torch python3-grpcio python3-protobuf curl openssl
  python3-pip python3-setuptools python3-wheel python3-venv  # installing client/python
  libopenblas0-pthread  # the BLAS PyTorch uses in the benchmark (Debian default is reference BLAS)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
echo "Installing: ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq \
  --no-install-recommends "${missing[@]}"
