#!/usr/bin/env bash
# The GPU checks of hvd-sparse, on a host with a CUDA GPU, CUDA torch and nvcc but neither
# Horovod nor a network: builds this package (hvd_sparse._cuda included) and, alongside it,
# Horovod from its sdist (Gloo, CPU operations); runs the kernel tests, the codec benchmark and
# the staging profile on the device while Horovod builds, then the gpu tests under horovodrun
# and torchrun (the DDP hook on CUDA models: NCCL where each rank has a GPU, Gloo on CUDA
# tensors where ranks share one).
#
#   scripts/checks/gpu_check.sh HOROVOD_SDIST OUT_DIR [WHEELHOUSE]
#
# HOROVOD_SDIST  horovod-0.28.1.tar.gz (pip download --no-deps --no-binary :all: horovod==0.28.1)
# OUT_DIR        where the logs and bench_codec's codec.{json,png} go
# WHEELHOUSE     a folder of wheels of the Python packages the host lacks, every one installed
#                with --no-index --no-deps
#
# Python: where python3 is already a venv holding CUDA torch (GPU images often ship one), that
# venv is used as it is: a venv over it with --system-site-packages would see the base
# interpreter's packages, not its torch. Else a venv .venv-gpu over python3's site.
set -euo pipefail
SDIST=$(realpath "${1:?usage: scripts/checks/gpu_check.sh HOROVOD_SDIST OUT_DIR [WHEELHOUSE]}")
OUT=$(realpath -m "${2:?usage: scripts/checks/gpu_check.sh HOROVOD_SDIST OUT_DIR [WHEELHOUSE]}")
WHEELS=${3:-}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the scripts import hvd_sparse from here
log() { printf '\033[1;34m[gpu-check %(%T)T]\033[0m %s\n' -1 "$*"; }

if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  PY=$(python3 -c 'import sys; print(sys.executable)')
else
  PY=$PWD/.venv-gpu/bin/python
  [ -x "$PY" ] || python3 -m venv --system-site-packages .venv-gpu
fi
"$PY" -c "import sys, torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(sys.executable, 'torch', torch.__version__, 'CUDA', torch.version.cuda,
      torch.cuda.get_device_name())"
if [ -n "$WHEELS" ]; then
  log "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
fi

horovod_pid=
if ! "$PY" -c "import horovod.torch" 2>/dev/null; then
  log "building Horovod from $SDIST in the background (Gloo, CPU operations): $OUT/horovod_build.log"
  HOROVOD_WITHOUT_MPI=1 scripts/setup/build_horovod.sh "$PY" "$SDIST" >"$OUT/horovod_build.log" 2>&1 &
  horovod_pid=$!
fi
log "building hvd-sparse (hvd_sparse._cuda with it)"
MAX_JOBS=$(nproc) "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
"$PY" -c "import torch, hvd_sparse._cuda"

status=0
log "gpu tests of the kernels, staging and sparsifiers"
"$PY" -m pytest -q -rs -m gpu tests/test_gpu.py -k "not launcher" 2>&1 \
  | tee "$OUT/gpu_tests.log" || status=1
log "codec benchmark on the GPU"
"$PY" scripts/bench/bench_codec.py --device cuda --out-dir "$OUT" 2>&1 | tee "$OUT/bench_codec.log" \
  || status=1
log "staging on the GPU: a sparse gradient's round trip against the dense copies across the bus"
"$PY" scripts/bench/profile_staging.py --out-dir "$OUT" 2>&1 | tee "$OUT/profile_staging.log" \
  || status=1
if [ -n "$horovod_pid" ]; then
  log "waiting for Horovod's build"
  wait "$horovod_pid" || { tail -40 "$OUT/horovod_build.log"; exit 1; }
fi
log "gpu tests under horovodrun and torchrun (the DDP hook; 2 and 4 ranks share the GPU)"
"$PY" -m pytest -q -rs -m gpu tests/test_gpu.py -k launcher 2>&1 \
  | tee "$OUT/gpu_tests_horovodrun.log" || status=1
log "done ($status): $OUT"
exit $status
