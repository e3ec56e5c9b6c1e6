# hvd-sparse: `make demo` runs the main job, `make test` runs the tests. Both install what they
# need first (scripts/setup.sh: Debian packages, .venv with torch and Horovod, idempotent).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
NP ?= 4
EXT := hvd_sparse/_C$(shell python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup build test demo lint bench clean

setup:
	@bash scripts/setup.sh

$(EXT): setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.h) | setup
	@echo "[build] hvd_sparse._C"
	@$(PY) setup.py -q build_ext --inplace > build.log 2>&1 || { tail -40 build.log; exit 1; }

build: setup $(EXT)

lint: build
	@$(VENV)/bin/ruff check hvd_sparse tests scripts

test: build lint
	@$(PY) -m pytest -q tests

demo: build
	@$(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(PY) scripts/demo.py

bench: build
	@$(PY) scripts/bench_codec.py
	@$(PY) scripts/bench_sync.py

clean:
	rm -rf build build.log $(EXT) bench_results .pytest_cache
