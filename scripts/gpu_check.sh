#!/usr/bin/env bash
# The GPU checks of hvd-sparse, on a host with a CUDA GPU, CUDA torch and nvcc but neither
# Horovod nor a network: builds Horovod from its sdist (Gloo, CPU operations) and this package
# (hvd_sparse._cuda included) into a venv over the host's Python, then runs the gpu tests and
# the codec benchmark on the device.
#
#   scripts/gpu_check.sh HOROVOD_SDIST OUT_DIR [WHEELHOUSE]
#
# HOROVOD_SDIST  horovod-0.28.1.tar.gz (pip download --no-deps --no-binary :all: horovod==0.28.1)
# OUT_DIR        where the test log and bench_codec's codec.{json,png} go
# WHEELHOUSE     wheels of the Python packages the host lacks (pip download -d DIR ...),
#                installed with --no-index; without it they must be there already
set -euo pipefail
SDIST=$(realpath "${1:?usage: scripts/gpu_check.sh HOROVOD_SDIST OUT_DIR [WHEELHOUSE]}")
OUT=$(realpath -m "${2:?usage: scripts/gpu_check.sh HOROVOD_SDIST OUT_DIR [WHEELHOUSE]}")
WHEELS=${3:-}
cd "$(dirname "$0")/.."
source scripts/versions.env
mkdir -p "$OUT"
log() { printf '\033[1;34m[gpu-check]\033[0m %s\n' "$*"; }

VENV=$PWD/.venv-gpu
PY=$VENV/bin/python
[ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"  # the host's CUDA torch
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
if [ -n "$WHEELS" ]; then
  log "installing Python packages from $WHEELS"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" $PY_BUILD_DEPS $PY_TEST_DEPS \
    $PY_APP_DEPS
fi
if ! "$PY" -c "import horovod.torch" 2>/dev/null; then
  log "building Horovod from $SDIST (Gloo, CPU operations)"
  HOROVOD_WITHOUT_MPI=1 scripts/build_horovod.sh "$PY" "$SDIST"
fi
log "building hvd-sparse (hvd_sparse._cuda with it)"
"$PY" setup.py -q build_ext --inplace
"$PY" -c "import hvd_sparse._cuda"

log "gpu tests (2 and 4 ranks share the GPU)"
"$PY" -m pytest -q -rs -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
log "codec benchmark on the GPU"
"$PY" scripts/bench_codec.py --device cuda --out-dir "$OUT" 2>&1 | tee "$OUT/bench_codec.log"
log "done: $OUT"
