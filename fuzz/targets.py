"""The fuzz targets, in one table: what `make fuzz` (fuzz/run.py), the corpus replay in
`make test` (tests/test_fuzz_corpus.py) and the seed generator (fuzz/seeds.py) build and run.
docs/testing.md ("Fuzzing") describes them. Imports nothing of hvd_sparse."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "fuzz" / "corpus"

# C++ targets: name -> (sources besides fuzz/<name>.cpp, extra compile flags, link flags).
# Compiled with -Icsrc; a target links only what its component needs.
CPP: dict[str, tuple[list[str], list[str], list[str]]] = {
    "aggregator_core": (["csrc/omni/aggregator/core.cpp", "csrc/omni/auth.cpp"], [],
                        ["-lcrypto"]),
    "switch_pipeline": (["csrc/switch/pipeline.cpp", "csrc/omni/auth.cpp"], [], ["-lcrypto"]),
    "worker_engine": (["csrc/omni/worker/engine.cpp", "csrc/omni/auth.cpp"], [], ["-lcrypto"]),
    "protocol_header": ([], [], []),
    # DPDK's headers only (frames.h is inline): its compile flags, none of its libraries
    "dpdk_frames": ([], ["@libdpdk"], []),
}
# Flags both builds share; the compilers add their own sanitizer and fuzzer flags.
CXXFLAGS = ["-O1", "-g", "-std=c++17", "-march=x86-64-v2", "-fno-omit-frame-pointer",
            "-pthread", "-Icsrc", "-Ifuzz"]

# Python targets (atheris): name -> module fuzz/<name>.py, which defines
# test_one_input(data: bytes) and CLEAN (the exceptions that are the parser's documented
# refusals; any other is a finding).
PYTHON = ["dissector", "run_file", "run_analysis", "config_env"]
# libFuzzer options per target (a larger input for datagram scripts, a dictionary for text)
OPTIONS: dict[str, list[str]] = {
    "aggregator_core": ["-max_len=16384"],
    "switch_pipeline": ["-max_len=16384"],
    "worker_engine": ["-max_len=16384"],
    "protocol_header": ["-max_len=4096"],
    "dpdk_frames": ["-max_len=2048"],
    "dissector": ["-max_len=8192"],
    "run_file": ["-max_len=8192", f"-dict={ROOT / 'fuzz' / 'run_file.dict'}"],
    "run_analysis": ["-max_len=8192", f"-dict={ROOT / 'fuzz' / 'run_file.dict'}"],
    "config_env": ["-max_len=1024"],
}
TARGETS = [*CPP, *PYTHON]


def pkg_config_flags(flags: list[str]) -> list[str]:
    """``@lib`` entries replaced by ``pkg-config --cflags lib``."""
    import shlex
    import subprocess
    out = []
    for f in flags:
        if f.startswith("@"):
            out += shlex.split(subprocess.run(["pkg-config", "--cflags", f[1:]], check=True,
                                              capture_output=True, text=True).stdout)
        else:
            out.append(f)
    return out


def cpp_sources(name: str) -> list[str]:
    return [f"fuzz/{name}.cpp", *CPP[name][0]]


def cpp_command(name: str, compiler: str, sanitizers: list[str], out: Path,
                extra: tuple[str, ...] = ()) -> list[str]:
    """The command line that builds C++ target ``name`` into ``out``."""
    srcs, cflags, libs = CPP[name]
    return [compiler, *CXXFLAGS, *sanitizers, *pkg_config_flags(cflags), *cpp_sources(name),
            *extra, "-o", str(out), *libs]


def cpp_inputs(name: str) -> list[Path]:
    """Every file a C++ target's build depends on (its sources and every header)."""
    return [ROOT / s for s in cpp_sources(name)] + [*ROOT.glob("csrc/**/*.h"),
                                                    *ROOT.glob("fuzz/*.h")]
