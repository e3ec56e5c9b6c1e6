#!/usr/bin/env bash
# Builds and installs Horovod from its sdist into the Python environment of PY, with the fix it
# needs for torch >= 2.1 (C++17), PyTorch only, Gloo and CPU operations; HOROVOD_* variables in
# the environment add to that (scripts/setup/setup.sh adds HOROVOD_WITH_MPI=1).
#   scripts/setup/build_horovod.sh PY horovod-X.Y.Z.tar.gz
set -euo pipefail
PY=${1:?usage: scripts/setup/build_horovod.sh PY SDIST}
SDIST=${2:?usage: scripts/setup/build_horovod.sh PY SDIST}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$SDIST" -C "$tmp"
src=$(echo "$tmp"/horovod-*)
# torch >= 2.1 headers need C++17; Horovod 0.28.1 pins C++14 in two places.
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
# pip's cmake 4.x rejects Gloo's CMakeLists (cmake_minimum_required below 3.5): the system's
# cmake where there is one, else cmake 4 told to accept them.
if [ -x /usr/bin/cmake ]; then "$PY" -m pip uninstall -q -y cmake 2>/dev/null || true; fi
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# GCC 13 no longer includes <cstdint>, <string> and <stdexcept> through other headers, which
# Gloo and Horovod rely on.
export CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept"
PATH=/usr/bin:$PATH HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_GLOO=1 MAKEFLAGS=-j"$(nproc)" \
  "$PY" -m pip install -q --no-build-isolation --no-deps "$src"
