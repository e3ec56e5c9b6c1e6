# hvd-sparse: `make demo` runs the main job, `make test` runs the tests. Both install what they
# need first (scripts/setup/setup.sh: Debian packages, .venv with torch and Horovod, idempotent).
# `make build` installs what a training host needs and no more (setup.sh's runtime mode: no
# Slurm, munge, DPDK, nftables, test or docs tools); the targets that test, benchmark or run the
# testbeds add the rest first (`dev`).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
NVCC ?= $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null))
EXT := hvd_sparse/_C$(shell python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
# .venv/bin first: torch's extension builder compiles incrementally when it finds ninja there
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup setup-dev dev wheel build install test test-extended test-fast test-compose demo lint bench clean cuda-check \
	sanitize sanitize-ext docs fuzz

setup:
	@HVD_SPARSE_SETUP=runtime bash scripts/setup/setup.sh

setup-dev:
	@bash scripts/setup/setup.sh

$(EXT): setup.py $(shell find csrc -name '*.cpp' -o -name '*.h') | setup
	@echo "[build] hvd_sparse._C"
	@$(PY) setup.py -q build_ext --inplace > build.log 2>&1 || { tail -40 build.log; exit 1; }

# Installs this checkout into the venv, editable (Python read from here, C++ rebuilt in place by
# the rule above), so a train.py anywhere imports hvd_sparse and `hvd-sparse` is pip's console
# script. Skipped while the venv's hvd_sparse is this checkout's and installed after the last
# change to setup.py or pyproject.toml: a no-op `make build` stays a few seconds.
INSTALLED_HERE := import importlib.util as u, sys; s = u.find_spec("hvd_sparse"); \
	sys.exit(s is None or s.origin != sys.argv[1] + "/hvd_sparse/__init__.py")
install: $(EXT)
	@$(PY) -I -c '$(INSTALLED_HERE)' "$(CURDIR)" && [ $(VENV)/bin/hvd-sparse -nt setup.py ] \
	  && [ $(VENV)/bin/hvd-sparse -nt pyproject.toml ] \
	  && grep -qs "hvd_sparse.tools.cli import main" $(VENV)/bin/hvd-sparse || { \
	  echo "[build] pip install --no-build-isolation -e . (into $(VENV))"; \
	  $(PY) -m pip install -q --no-build-isolation --no-deps -e . > build.log 2>&1 \
	  || { tail -40 build.log; exit 1; }; }

build: setup $(EXT) install

# build, and the development set-up: test and lint tools, Slurm and munge (tests/test_slurm.py),
# DPDK (the switch), nftables and libpcap (testbeds)
dev: setup-dev build

# A wheel of this checkout, built against the installed torch (which its requirements pin),
# into dist/: the extension, the protocol module and the aggregator binary.
wheel: build
	@mkdir -p dist
	@$(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist . > build.log 2>&1 \
	  || { tail -40 build.log; exit 1; }
	@ls dist/hvd_sparse-*.whl

lint: dev
	@$(VENV)/bin/ruff check hvd_sparse tests scripts

# tests/test_compose.py is `make test-compose` (a CI step of its own): a cold image build
# alone takes about as long as the rest of the tests.
# The default tier; `make test-extended` has the 4-rank reruns of the same paths and the long
# trainings (marker "extended"): CI runs both.
test: dev lint $(if $(NVCC),cuda-check)
	@$(PY) -m pytest -q -rs --durations=25 -m "not extended" tests --ignore=tests/test_compose.py

test-extended: dev
	@$(PY) -m pytest -q -rs --durations=25 -m extended tests --ignore=tests/test_compose.py

# The compose cluster for real (tests/test_compose.py): a Docker engine started where none
# runs (docker.io from apt) and stopped after, both images built (docker's layer cache keeps
# them between runs), a 4-worker job across the containers. Skipped where Docker cannot run.
# Cached: 1-5 min; cold: the worker image compiles Horovod and the extension, 10 min on a quiet
# machine, 59 beside a 4-rank training job, 90 at load 13-16 (docs/notes/benchmarks-history.md, Test time):
# longer than pytest's default timeout, so tests/test_compose.py sets its own; -s shows the
# build's progress as it comes.
test-compose: dev
	@$(PY) -m pytest -q -rs -s tests/test_compose.py

# The unit tier only: in-process tests, no other process, socket or Horovod job (under a minute).
test-fast: dev
	@$(PY) -m pytest -q -m unit tests

# Compiles every CUDA source for sm_80 and sm_90 and links the kernels into one library, then
# compiles the torch binding (syntax only: a CPU torch has the CUDA headers but not the
# libraries, nor the one generated header, stubbed here). No GPU needed; nothing here runs them.
CUDA_SRC := $(wildcard csrc/cuda/*) csrc/omni/halfconv.h csrc/host_device.h
CUDA_CHECK := build/cuda-check
cuda-check: $(CUDA_CHECK)/ok
$(CUDA_CHECK)/ok: $(CUDA_SRC) | setup
	@test -n "$(NVCC)" || { echo "cuda-check: nvcc not found"; exit 1; }
	@mkdir -p $(CUDA_CHECK)/c10/cuda/impl
	@for f in csrc/cuda/*.cu; do echo "[nvcc] $$f"; $(NVCC) -std=c++17 -gencode arch=compute_80,code=sm_80 \
	  -gencode arch=compute_90,code=sm_90 -Xcompiler -fPIC -Icsrc/cuda -c $$f \
	  -o $(CUDA_CHECK)/$$(basename $$f).o || exit 1; done
	@echo "[nvcc] link the kernels"; $(NVCC) -shared -o $(CUDA_CHECK)/kernels.so $(CUDA_CHECK)/*.cu.o
	@echo "[c++] csrc/cuda/binding.cpp (syntax)"
	@printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > $(CUDA_CHECK)/c10/cuda/impl/cuda_cmake_macros.h
	@TI=$$($(PY) -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))"); \
	  PI=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])"); \
	  $${CXX:-c++} -std=c++17 -fsyntax-only -w $$TI -I$$PI -I$(dir $(realpath $(NVCC)))../include \
	  -I$(CUDA_CHECK) -DTORCH_EXTENSION_NAME=_cuda csrc/cuda/binding.cpp
	@touch $@

# The aggregator and the emulated switch (the code that parses what the network sends) built
# with AddressSanitizer and UBSan, any finding fatal, under the tests that drive them with real
# and malformed packets: fuzzed junk, loss, duplication and reordering, sums of every dtype,
# the command line, IPv6 and dual-stack sockets; the switch's raw jobs, control plane and
# forged frames on the testbed.
SANITIZE := build/sanitize/hvd-sparse-aggregator
SANITIZE_SWITCH := build/sanitize/hvd-sparse-switch
SANITIZE_FLAGS := -O1 -g -std=c++17 -march=x86-64-v2 -Wall -pthread -fno-omit-frame-pointer \
	-fsanitize=address,undefined -fno-sanitize-recover=all -Icsrc
sanitize: dev
	@mkdir -p build/sanitize
	@echo "[c++] $(SANITIZE) (-fsanitize=address,undefined)"
	@$${CXX:-c++} $(SANITIZE_FLAGS) csrc/omni/aggregator/main.cpp csrc/omni/aggregator/core.cpp \
	  csrc/omni/auth.cpp csrc/omni/transport/udp/transport.cpp -o $(SANITIZE) -lcrypto
	@echo "[c++] $(SANITIZE_SWITCH) (-fsanitize=address,undefined)"
	@$${CXX:-c++} $(SANITIZE_FLAGS) $$(pkg-config --cflags libdpdk) csrc/switch/main.cpp \
	  csrc/switch/ports.cpp csrc/switch/control.cpp csrc/switch/pipeline.cpp \
	  -o $(SANITIZE_SWITCH) $$(pkg-config --libs libdpdk)
	@rm -f build/sanitize/report.*
	@HVD_SPARSE_AGGREGATOR_BINARY=$(CURDIR)/$(SANITIZE) \
	  ASAN_OPTIONS=log_path=$(CURDIR)/build/sanitize/report:detect_leaks=1 \
	  UBSAN_OPTIONS=log_path=$(CURDIR)/build/sanitize/report:print_stacktrace=1 \
	  $(PY) -m pytest -q tests/test_aggregator_junk.py tests/test_aggregator_loss.py \
	  tests/test_aggregator_sums.py tests/test_aggregator_cli.py tests/test_aggregator_jobs.py \
	  tests/test_ipv6.py
	@# DPDK's EAL keeps its memory to the end: leaks are not the switch's to report
	@HVD_SPARSE_SWITCH_BINARY=$(CURDIR)/$(SANITIZE_SWITCH) \
	  ASAN_OPTIONS=log_path=$(CURDIR)/build/sanitize/report:detect_leaks=0 \
	  UBSAN_OPTIONS=log_path=$(CURDIR)/build/sanitize/report:print_stacktrace=1 \
	  $(PY) -m pytest -q tests/test_switch_emu.py -k "network or two_jobs or hostile or control"
	@if ls build/sanitize/report.* >/dev/null 2>&1; then cat build/sanitize/report.*; \
	  echo "sanitize: findings above"; exit 1; fi
	@echo "sanitize: no findings"

# hvd_sparse._C under AddressSanitizer and UBSan: built by setup.py (HVD_SPARSE_SANITIZE=1) into
# its own package tree, build/sanitize-ext/hvd_sparse (the sanitized _C beside links to this
# checkout's Python files; the in-place _C is never touched), then the tests that feed _C real
# and malformed input in this process (its unit tests, and in-process workers against real
# aggregators and forged packets; tests that start Python processes would not use this _C).
# CPython is not instrumented, so the runtimes are preloaded: ASan must be the first library
# loaded to intercept malloc, and the extension needs UBSan's too. ASAN_OPTIONS:
# detect_leaks=0, CPython and torch keep memory to exit by design (reports would be theirs);
# log_path, so that findings are collected here and printed, not lost in pytest's capture;
# max_allocation_size_mb, so that an allocation sized by a forged field is a finding, not a
# machine swapping (ASan reserves without committing, then the code touches it all).
# -fno-sanitize-recover=all makes every finding fatal (the test run fails).
SANITIZE_EXT := build/sanitize-ext
SANITIZE_EXT_TESTS := -m "unit or integration" $(addprefix tests/,test_codec.py test_rows.py \
	test_sparsify_ops.py test_sparsifiers.py test_device.py test_cuda_host.py test_auth.py \
	test_aggregator_core.py test_switch_pipeline.py test_dissect.py test_aggregator_sums.py \
	test_aggregator_junk.py test_aggregator_loss.py test_aggregator_jobs.py) \
	--deselect tests/test_aggregator_sums.py::test_worker_processes  # its workers: other processes
sanitize-ext: dev
	@echo "[c++] hvd_sparse._C (-fsanitize=address,undefined) into $(SANITIZE_EXT)"
	@# the links first: a build must never write through one into this checkout's files
	@find $(SANITIZE_EXT)/hvd_sparse -maxdepth 1 -type l -delete 2>/dev/null || true
	@HVD_SPARSE_SANITIZE=1 $(PY) setup.py build_ext > $(SANITIZE_EXT).log 2>&1 \
	  || { tail -40 $(SANITIZE_EXT).log; exit 1; }
	@for f in hvd_sparse/*; do case $$f in hvd_sparse/_C.*|hvd_sparse/_protocol.*|hvd_sparse/__pycache__) ;; \
	  *) ln -sfn $(CURDIR)/$$f $(SANITIZE_EXT)/$$f ;; esac; done
	@rm -f $(SANITIZE_EXT)/report.* $(SANITIZE_EXT)/stderr
	@# -P: the working directory (this checkout, its unsanitized _C) stays off sys.path.
	@# --capture=sys: pytest's fd capture would swallow a report written as the process dies.
	@# UBSan ignores log_path beside ASan's runtime (GCC 12): its reports are kept from stderr.
	@LD_PRELOAD="$$($${CXX:-c++} -print-file-name=libasan.so) $$($${CXX:-c++} -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=log_path=$(CURDIR)/$(SANITIZE_EXT)/report:detect_leaks=0:max_allocation_size_mb=4096 \
	  UBSAN_OPTIONS=print_stacktrace=1 PYTHONPATH=$(CURDIR)/$(SANITIZE_EXT) \
	  $(PY) -P -m pytest -q -p no:cacheprovider --capture=sys --sanitized-ext $(SANITIZE_EXT_TESTS) \
	  2> $(SANITIZE_EXT)/stderr; rc=$$?; \
	  if ls $(SANITIZE_EXT)/report.* >/dev/null 2>&1 || grep -q "runtime error:" $(SANITIZE_EXT)/stderr; \
	  then cat $(SANITIZE_EXT)/report.* $(SANITIZE_EXT)/stderr 2>/dev/null; \
	  echo "sanitize-ext: findings above"; exit 1; fi; \
	  [ $$rc = 0 ] || { cat $(SANITIZE_EXT)/stderr; echo "sanitize-ext: tests failed"; exit $$rc; }
	@echo "sanitize-ext: no findings"

# Coverage-guided fuzzing of every parser that reads bytes from the network or from disk
# (docs/testing.md, "Fuzzing"): libFuzzer targets (fuzz/*.cpp, clang under ASan and UBSan)
# for the aggregator's, the switch's and the worker's packet decoders, protocol.h's checks and
# the DPDK frame parser; atheris targets (fuzz/*.py) for the dissector, the run file reader,
# the analyzer and the config parser. Each runs FUZZ_SECONDS on a scratch copy of its corpus
# (fuzz/corpus/, never written; FUZZ_TARGETS=a,b: those alone) and prints executions, coverage
# and new inputs; a finding fails, its reproducer left in build/fuzz/crashes/. clang and
# atheris (pinned in scripts/setup/versions.env) are installed when missing. 9 targets x 60 s: about
# 11 minutes. `make test` replays the corpora without either (tests/test_fuzz_corpus.py).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=
fuzz: dev
	@source scripts/setup/versions.env; missing=(); for p in $$FUZZ_APT_PACKAGES; do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$$p"); \
	  done; if [ $${#missing[@]} -gt 0 ]; then echo "[fuzz] apt-get install $${missing[*]}"; \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; $$SUDO apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends \
	  "$${missing[@]}" >/dev/null || exit 1; fi
	@source scripts/setup/versions.env; $(PY) -c 'import sys, importlib.metadata as m; \
	  sys.exit(m.version("atheris") != sys.argv[1])' "$$ATHERIS_VERSION" 2>/dev/null || { \
	  echo "[fuzz] pip install atheris==$$ATHERIS_VERSION (into $(VENV))"; \
	  $(PY) -m pip install -q --disable-pip-version-check "atheris==$$ATHERIS_VERSION"; }
	@$(PY) fuzz/run.py --seconds $(FUZZ_SECONDS) $(if $(FUZZ_TARGETS),--targets $(FUZZ_TARGETS))

# On a 4-host netns testbed at 1 Gbit/s when run as root, else on loopback (scripts/demo.py).
# DEMO_ON=compose: on the compose cluster (docker/), images built first (cached), torn down
# after; a Docker engine is started for it where none runs, and stopped after.
DEMO_ON ?= testbed
demo: dev
ifeq ($(DEMO_ON),compose)
	@$(PY) scripts/testbed/dockerd.py start
	@$(PY) scripts/testbed/compose.py run; rc=$$?; $(PY) scripts/testbed/dockerd.py stop; exit $$rc
else
	@$(PY) scripts/demo.py
endif

# The documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link, a page
# missing from the nav or an API reference that does not resolve fails. Its tools (pinned in
# scripts/setup/versions.env) go into .venv when missing; no build of the package is needed, since
# mkdocstrings reads the sources without importing them.
DOCS_DEPS = $(shell source scripts/setup/versions.env && echo $$PY_DOCS_DEPS)
docs:
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c 'import sys, importlib.metadata as m; sys.exit(any(m.version(n) != v for n, v in \
	  (d.split("==") for d in sys.argv[1:])))' $(DOCS_DEPS) 2>/dev/null \
	  || $(PY) -m pip install -q --disable-pip-version-check $(DOCS_DEPS)
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site

bench: dev
	@$(PY) scripts/bench/bench_codec.py
	@$(PY) scripts/bench/bench_sync.py

clean:
	rm -rf build build.log $(EXT) hvd_sparse/_protocol.*.so hvd_sparse/bin *.egg-info bench_results .pytest_cache
