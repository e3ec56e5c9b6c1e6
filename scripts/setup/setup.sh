#!/usr/bin/env bash
# Installs everything hvd-sparse needs on a fresh machine, idempotently:
#   Debian packages (Open MPI, cmake), a venv at .venv with torch, Horovod built from its
#   sdist with the C++17 fix, test/bench tools (not with HVD_SPARSE_SETUP=runtime), and
#   this package's C++ extension.
# A second run with everything in place takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
source scripts/setup/versions.env
# HVD_SPARSE_SETUP=runtime (docker/Dockerfile's runtime image): what building and running
# hvd-sparse needs, without the test and lint tools or the Debian packages only tests use.
MODE=${HVD_SPARSE_SETUP:-full}
case "$MODE" in
  full) ;;
  runtime) APT_PACKAGES=$APT_RUNTIME_PACKAGES; PY_TEST_DEPS="" ;;
  *) echo "setup.sh: HVD_SPARSE_SETUP=$MODE: expected full or runtime" >&2; exit 2 ;;
esac
VENV=$ROOT/.venv
PY=$VENV/bin/python
HASH=$(cat scripts/setup/versions.env scripts/setup/setup.sh | sha1sum | cut -c1-12)
STAMP=$VENV/.hvd-sparse-setup-$MODE-$HASH
# the full set-up holds the runtime one: `make build` after `make test` installs nothing
[ "$MODE" = runtime ] && [ -f "$VENV/.hvd-sparse-setup-full-$HASH" ] && STAMP=$VENV/.hvd-sparse-setup-full-$HASH
log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

# --- Debian packages -------------------------------------------------------------------------
missing=()
for p in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- venv, torch, Horovod ---------------------------------------------------------------------
if [ ! -f "$STAMP" ]; then
  [ -x "$PY" ] || { log "creating venv at .venv"; python3 -m venv "$VENV"; }
  PIP="$PY -m pip install -q --disable-pip-version-check"
  log "installing torch==$TORCH_VERSION and Python dependencies"
  $PIP "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" "pybind11==$PYBIND11_VERSION" \
       $PY_BUILD_DEPS $PY_TEST_DEPS $PY_APP_DEPS
  if ! "$PY" -c "import horovod, horovod.torch as h; assert horovod.__version__ == '$HOROVOD_VERSION'" 2>/dev/null; then
    log "building Horovod $HOROVOD_VERSION from its sdist (C++17 fix; ~4 min)"
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$tmp" "horovod==$HOROVOD_VERSION"
    HOROVOD_WITH_MPI=1 scripts/setup/build_horovod.sh "$PY" "$tmp"/horovod-*.tar.gz
    "$PY" -m pip install -q pyyaml psutil cloudpickle
    rm -rf "$tmp"
  fi
  "$PY" -c "import horovod.torch as hvd; assert hvd.gloo_built() and hvd.mpi_built()"
  find "$VENV" -maxdepth 1 -name '.hvd-sparse-setup-*' ! -name "*-$HASH" -delete  # stale pins
  touch "$STAMP"
fi
log "environment ready (.venv: torch $TORCH_VERSION, horovod $HOROVOD_VERSION)"
