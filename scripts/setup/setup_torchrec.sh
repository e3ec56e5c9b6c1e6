#!/usr/bin/env bash
# A venv at .venv-torchrec for scripts/bench/bench_torchrec.py (optional: nothing else needs it):
# TorchRec and FBGEMM's CPU build over the project's .venv (its torch, numpy, Horovod and this
# checkout's hvd_sparse, seen through a .pth file), so both sides of the comparison run the
# same torch. fbgemm-gpu-cpu 1.8 is the release built for torch 2.13 (1.9 needs torch 2.14);
# torchrec without its pins (it pins torchmetrics and names the CUDA fbgemm-gpu).
# Idempotent; a second run takes a second.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0
VENV=$ROOT/.venv-torchrec
STAMP=$VENV/.setup-$(sha1sum scripts/setup/setup_torchrec.sh | cut -c1-12)
log() { printf '\033[1;34m[setup-torchrec]\033[0m %s\n' "$*"; }
[ -f "$STAMP" ] && { log "ready ($VENV)"; exit 0; }
make -s build
BASE_SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__)")
rm -rf "$VENV"
.venv/bin/python -m venv "$VENV"
SITE=$("$VENV"/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir, not a path line: .venv's own .pth files (the editable hvd_sparse) must run too.
echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/hvd_sparse_base_venv.pth"
log "fbgemm-gpu-cpu $FBGEMM_VERSION, torchrec $TORCHREC_VERSION over .venv (torch $TORCH)"
PIP=("$VENV"/bin/python -m pip install -q --disable-pip-version-check)
echo "torch==$TORCH" > "$VENV/constraints.txt"
"${PIP[@]}" -c "$VENV/constraints.txt" "fbgemm-gpu-cpu==$FBGEMM_VERSION" pyre-extensions \
  tensordict torchmetrics iopath tqdm
"${PIP[@]}" --no-deps "torchrec==$TORCHREC_VERSION"
"$VENV"/bin/python -c "import torch, fbgemm_gpu, torchrec, hvd_sparse.ddp; \
assert torch.__version__ == '$TORCH', torch.__version__"
touch "$STAMP"
log "ready ($VENV)"
