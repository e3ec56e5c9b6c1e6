"""The fuzz targets' committed corpora (fuzz/corpus/NAME: seeds and the reproducers of every
finding, regress-*) replayed, so that a fix that regresses fails here, without clang, libFuzzer
or atheris (docs/testing.md, "Fuzzing"):

- each C++ target built with the system compiler (g++) under AddressSanitizer and UBSan, every
  finding fatal, with fuzz/replay_main.cpp for libFuzzer's driver (in build/fuzz-replay/,
  rebuilt only when a source or header changed), run over its corpus: a crash, a sanitizer's
  report or a target's own check fails the test;
- each Python target's test_one_input called on every input of its corpus in this process: an
  exception that is not one of the parser's clean refusals fails the test.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fuzz_module(name: str) -> ModuleType:
    """fuzz/NAME.py, importable by that name (the targets import pyharness) without putting
    fuzz/, and its scripts' names, on sys.path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "fuzz" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


targets = fuzz_module("targets")
load_target = fuzz_module("pyharness").load_target

OUT = ROOT / "build" / "fuzz-replay"
CXX = os.environ.get("CXX", "g++")
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
REPLAY = "fuzz/replay_main.cpp"


def has_dpdk() -> bool:
    return subprocess.run(["pkg-config", "--exists", "libdpdk"]).returncode == 0


def needs(name: str) -> str | None:
    """Why C++ target ``name`` cannot be built here, or None."""
    if shutil.which(CXX) is None:
        return f"no {CXX}"
    if "@libdpdk" in targets.CPP[name][1] and not has_dpdk():
        return "no libdpdk (pkg-config): DPDK's headers are not installed"
    return None


def build(name: str) -> Path:
    """The replay build of C++ target ``name``, up to date."""
    exe = OUT / name
    inputs = [*targets.cpp_inputs(name), ROOT / REPLAY]
    if exe.exists() and all(exe.stat().st_mtime > p.stat().st_mtime for p in inputs):
        return exe
    OUT.mkdir(parents=True, exist_ok=True)
    cmd = targets.cpp_command(name, CXX, SANITIZERS, exe, (REPLAY,))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
    return exe


@pytest.fixture(scope="module")
def built() -> dict[str, Path | str]:
    """Every C++ target's replay build (two compilers at once), or why it cannot be built."""
    names = list(targets.CPP)
    with ThreadPoolExecutor(2) as pool:
        futures = {n: pool.submit(build, n) for n in names if needs(n) is None}
    return {n: futures[n].result() if n in futures else needs(n) for n in names}


def replay(exe: Path, *inputs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *map(str, inputs)], cwd=ROOT, env={**os.environ, **ENV},
                          capture_output=True, text=True, timeout=300)


def corpus(name: str) -> list[Path]:
    files = sorted(p for p in (targets.CORPUS / name).iterdir() if p.is_file())
    assert files, f"fuzz/corpus/{name} is empty"
    return files


@pytest.mark.integration
@pytest.mark.parametrize("name", list(targets.CPP))
def test_cpp_corpus_replays_clean(built, name: str) -> None:
    exe = built[name]
    if isinstance(exe, str):
        pytest.skip(exe)
    files = corpus(name)
    r = replay(exe, targets.CORPUS / name)
    assert r.returncode == 0, f"{name}: a finding (exit {r.returncode}):\n{r.stderr[-6000:]}"
    assert f"replayed {len(files)} inputs" in r.stdout, r.stdout


@pytest.mark.integration
def test_replay_fails_on_a_crashing_input(tmp_path) -> None:
    """The driver reports what libFuzzer would: a target that aborts, or that reads past its
    input (AddressSanitizer), fails the replay."""
    src = tmp_path / "target.cpp"
    src.write_text('#include <cstdint>\n#include <cstdlib>\n#include <cstddef>\n'
                   'extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {\n'
                   '  if (n == 1 && d[0] == \'a\') std::abort();\n'
                   '  if (n == 1 && d[0] == \'r\') return d[1];  // one byte past the input\n'
                   '  return 0;\n}\n')
    exe = tmp_path / "target"
    subprocess.run([CXX, "-g", "-std=c++17", *SANITIZERS, str(src), str(ROOT / REPLAY), "-o",
                    str(exe)], check=True, timeout=300)
    for byte, want in ((b"x", 0), (b"a", "abort"), (b"r", "heap-buffer-overflow")):
        (tmp_path / "input").write_bytes(byte)
        r = replay(exe, tmp_path / "input")
        if want == 0:
            assert r.returncode == 0 and "replayed 1 inputs" in r.stdout, r.stderr
        else:
            assert r.returncode != 0, (byte, r.stdout)
            assert want == "abort" or want in r.stderr, r.stderr[-2000:]


# The reproducers of findings in the C++ code, each named for the bug it caught: replayed with
# the rest of their corpus above, and here by name, so that losing one is an error too.
CPP_FINDINGS = {
    # Engine::on_packet read the 56-byte header of any datagram, a runt's too: past its end
    # (from an empty one, through a null pointer)
    "worker_engine": ["regress-runt-datagram"],
    # frames::udp_checksum took the pseudo-header's length from the IP header: a datagram
    # whose IP payload holds padding after it failed its valid checksum (RFC 768 counts the
    # UDP length)
    "dpdk_frames": ["regress-udp-checksum-with-ip-padding"],
}


@pytest.mark.integration
@pytest.mark.parametrize("name,file", [(n, f) for n, fs in CPP_FINDINGS.items() for f in fs])
def test_cpp_finding_stays_fixed(built, name: str, file: str) -> None:
    exe = built[name]
    if isinstance(exe, str):
        pytest.skip(exe)
    path = targets.CORPUS / name / file
    assert path.is_file(), f"the reproducer {path} is gone"
    r = replay(exe, path)
    assert r.returncode == 0, f"{name}/{file}: found again:\n{r.stderr[-6000:]}"


@pytest.mark.unit
@pytest.mark.parametrize("name", targets.PYTHON)
def test_python_corpus_replays_clean(name: str) -> None:
    target = load_target(name)
    for path in corpus(name):
        try:
            target.test_one_input(path.read_bytes())
        except Exception as e:
            raise AssertionError(f"fuzz/corpus/{name}/{path.name}: a finding: {e!r}") from e
