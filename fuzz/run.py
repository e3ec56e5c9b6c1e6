"""`make fuzz`: builds every C++ fuzz target with clang (libFuzzer, AddressSanitizer, UBSan) and
runs each target, C++ and Python (atheris), for a budget on a scratch copy of its committed
corpus (fuzz/corpus/NAME, never written), one line per target: executions, coverage, features,
new inputs. A target that crashes fails the run; its reproducer stays in build/fuzz/crashes/NAME
and its log in build/fuzz/logs/NAME.log (docs/testing.md, "Fuzzing").

    python fuzz/run.py [--seconds 60] [--targets a,b] [--build-only]
    python fuzz/run.py --merge NAME DIR...   # minimize DIRs' inputs into NAME's corpus
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import targets

ROOT = targets.ROOT
OUT = ROOT / "build" / "fuzz"
CLANG = os.environ.get("FUZZ_CXX", "clang++-14")
SANITIZERS = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all"]
# libFuzzer: a unit running this long is a hang (a finding); memory beyond is one too
COMMON = ["-timeout=60", "-rss_limit_mb=3072", "-print_final_stats=1"]
# ASan's leak check at exit; UBSan reports fatal (also -fno-sanitize-recover above)
ENV = {"ASAN_OPTIONS": "detect_leaks=1:allocator_may_return_null=0",
       "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


def build(name: str) -> Path:
    """The clang build of C++ target ``name`` (rebuilt when a source or header is newer)."""
    exe = OUT / "bin" / name
    if exe.exists() and all(exe.stat().st_mtime > p.stat().st_mtime
                            for p in targets.cpp_inputs(name)):
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    print(f"[clang] {name}", flush=True)
    cmd = targets.cpp_command(name, CLANG, SANITIZERS, exe)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"fuzz: building {name} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
    return exe


def command(name: str) -> list[str]:
    if name in targets.CPP:
        return [str(build(name))]
    # An executable of its own: libFuzzer's -merge runs its argv[0] again (atheris_run.py)
    exe = OUT / "bin" / name
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f'#!/bin/sh\nFUZZ_SELF="$0" exec "{sys.executable}" '
                   f'"{ROOT / "fuzz" / "atheris_run.py"}" {name} "$@"\n')
    exe.chmod(0o755)
    return [str(exe)]


def stats(log: str) -> dict[str, str]:
    """What libFuzzer printed last: executions, coverage, features, corpus, new inputs."""
    out = {}
    for key in ("number_of_executed_units", "new_units_added", "average_exec_per_sec"):
        m = re.search(rf"stat::{key}:\s*(\d+)", log)
        out[key] = m.group(1) if m else "?"
    lines = re.findall(r"^#\d+\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)", log, re.M)
    out["cov"], out["ft"], out["corp"] = lines[-1] if lines else ("?", "?", "?")
    return out


def run(name: str, seconds: int) -> bool:
    """Fuzzes ``name`` for ``seconds`` on a scratch copy of its corpus; True when clean."""
    work, crashes = OUT / "work" / name, OUT / "crashes" / name
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(targets.CORPUS / name, work)
    crashes.mkdir(parents=True, exist_ok=True)
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    cmd = [*command(name), str(work), f"-max_total_time={seconds}",
           f"-artifact_prefix={crashes}/", *COMMON, *targets.OPTIONS[name]]
    started = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True)
    log = r.stdout + r.stderr
    (OUT / "logs" / f"{name}.log").write_text(" ".join(cmd) + "\n" + log)
    s = stats(log)
    ok = r.returncode == 0
    print(f"{name:16} {time.monotonic() - started:5.0f} s  {s['number_of_executed_units']:>10} "
          f"execs ({s['average_exec_per_sec']}/s)  cov {s['cov']:>5}  ft {s['ft']:>6}  "
          f"corpus {s['corp']:>4} (+{s['new_units_added']} new)  "
          f"{'ok' if ok else 'FINDING'}", flush=True)
    if not ok:
        found = sorted(crashes.glob("*"), key=lambda p: p.stat().st_mtime)
        print("\n".join(log.splitlines()[-40:]))
        print(f"fuzz: {name} failed (exit {r.returncode}); reproducer: "
              f"{found[-1] if found else 'none written'}; log: {OUT / 'logs' / name}.log")
    return ok


def merge(name: str, dirs: list[str]) -> None:
    """Minimizes the corpus fuzz/corpus/NAME and the inputs in ``dirs`` with libFuzzer's
    -merge=1 (a smallest set of them that keeps every feature) into that corpus. The
    reproducers of findings (regress-*) stay as they are, and are not merged."""
    into = targets.CORPUS / name
    into.mkdir(parents=True, exist_ok=True)
    tmp, old = OUT / "merge" / name, OUT / "merge" / f"{name}.old"
    for d in (tmp, old):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    for p in into.iterdir():
        if not p.name.startswith("regress-"):
            shutil.move(p, old / p.name)
    cmd = [*command(name), "-merge=1", str(tmp), str(old), *dirs, *targets.OPTIONS[name]]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, check=True,
                   capture_output=True)
    for p in tmp.iterdir():
        shutil.copy(p, into / p.name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=60, help="per target")
    p.add_argument("--targets", default=",".join(targets.TARGETS))
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--merge", nargs="+", metavar=("NAME", "DIR"))
    a = p.parse_args()
    if a.merge:
        merge(a.merge[0], a.merge[1:])
        return 0
    names = a.targets.split(",")
    unknown = set(names) - set(targets.TARGETS)
    if unknown:
        sys.exit(f"fuzz: unknown target(s) {sorted(unknown)}; known: {targets.TARGETS}")
    for n in names:
        command(n)  # the C++ builds; the Python targets' launchers
    if a.build_only:
        return 0
    failed = [n for n in names if not run(n, a.seconds)]
    if failed:
        print(f"fuzz: findings in {', '.join(failed)} (reproducers in {OUT / 'crashes'})")
        return 1
    print(f"fuzz: {len(names)} targets, {a.seconds} s each: no findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
