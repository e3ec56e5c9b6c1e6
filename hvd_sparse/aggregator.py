"""The aggregator process: where its binary is, and starting local ones for a job.

``python -m hvd_sparse.aggregator --bind ADDR:PORT --workers N`` (or ``hvd-sparse aggregator``)
runs the C++ aggregator (csrc/omni/aggregator/, built by setup.py as a torch-free binary).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .auth import write_secret_file
from .config import format_address
from .errors import HvdSparseError

log = logging.getLogger("hvd_sparse")
BINARY = Path(__file__).resolve().parent / "bin" / "hvd-sparse-aggregator"


def binary() -> Path:
    """The aggregator executable: the package's, or HVD_SPARSE_AGGREGATOR_BINARY (another
    build of it, e.g. `make sanitize`'s)."""
    other = os.environ.get("HVD_SPARSE_AGGREGATOR_BINARY")
    if other:
        return Path(other)
    if not BINARY.exists():
        raise HvdSparseError(f"hvd_sparse: aggregator binary missing at {BINARY}: build the "
                             "package (make build, or pip install --no-build-isolation .)")
    return BINARY


class LocalAggregators:
    """Aggregator processes this rank started; they die with it (PR_SET_PDEATHSIG plus a
    parent check), so a killed rank leaves no orphans. With ``secret``, they share a fresh
    secret (``self.secret``, in a file of mode 0600 in a directory of mode 0700) and take only
    authenticated packets. ``secret`` may also be the secret itself: a job's aggregators on
    several hosts share one (session.py, colocated layout). ``args``: more of the binary's
    options (e.g. its fault injection, ``--drop-rate-out``), the same for each. A directory
    of their own (no ``log_dir``) goes when they stop, unless one of them had exited with an
    error: then only the secret goes, and a warning names the directory with their logs.
    ``bind``: the address they bind (port 0: any free one), IPv4 or IPv6 ("::": both)."""

    def __init__(self, count: int, workers: int, bind: str, log_dir: str | None = None,
                 secret: bool | bytes = False, args: Sequence[str] = (),
                 ports: tuple[int, int] = (0, 0)) -> None:
        self.dir = Path(log_dir or tempfile.mkdtemp(prefix="hvd_sparse_agg_"))
        self._own_dir = log_dir is None
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.secret = b""
        extra: list[str] = []
        try:
            if secret:
                path = self.dir / "secret"
                path.unlink(missing_ok=True)
                self.secret = write_secret_file(
                    path, secret if isinstance(secret, bytes) else None)
                extra = ["--secret-file", str(path)]
            if ports[0]:  # each takes the first free port of the job's range
                extra += ["--port-range", f"{ports[0]}-{ports[1]}"]
            for i in range(count):
                port_file = self.dir / f"agg{i}.port"
                port_file.unlink(missing_ok=True)
                with open(self.dir / f"agg{i}.log", "w") as out:  # (the child keeps its own)
                    self.procs.append(subprocess.Popen(
                        [str(binary()), "--bind", format_address(bind, 0), "--workers",
                         str(workers), "--parent-pid", str(os.getpid()), "--port-file",
                         str(port_file), *extra, *args],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                self.ports.append(self._wait_port(port_file, self.procs[-1], i))
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)

    def _wait_port(self, port_file: Path, proc: subprocess.Popen, i: int) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if port_file.exists():
                return int(port_file.read_text())
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        log = (self.dir / f"agg{i}.log").read_text(errors="replace")[-2000:]
        raise HvdSparseError(f"hvd_sparse: local aggregator {i} did not start: {log}")

    def stop(self) -> None:
        failed = [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()
        if self._own_dir:
            self._own_dir = False  # stop runs again at exit
            if failed:
                (self.dir / "secret").unlink(missing_ok=True)
                log.warning("hvd_sparse: local aggregator(s) %s had exited with an error; "
                            "their logs: %s", failed, self.dir)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    os.execv(binary(), [str(binary()), *args])


if __name__ == "__main__":
    main()
