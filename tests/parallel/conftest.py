"""tests/parallel: test modules that run on every rank of a Horovod job (see driver.py).

Under a launcher (a rank in the environment) the modules' tests are collected as usual and,
with HVD_SPARSE_TEST_OUT set, every rank writes its outcomes for the driver. Elsewhere
(``pytest tests``) each module becomes one item per entry of its LAUNCHES: the item launches
the module on that many ranks and fails with the failing (rank, test) pairs.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from driver import OUT_VAR, Launch, LaunchError, RankReporter, cleanup, launches, rank, run

UNDER_LAUNCHER = rank() is not None


def pytest_configure(config: pytest.Config) -> None:
    if UNDER_LAUNCHER and os.environ.get(OUT_VAR) and not config.pluginmanager.has_plugin("rank"):
        out = Path(os.environ[OUT_VAR]) / f"rank{rank()}.jsonl"
        config.pluginmanager.register(RankReporter(out), "rank")


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    if UNDER_LAUNCHER:
        return None
    return LaunchFile.from_parent(parent, path=module_path)


class LaunchFile(pytest.File):
    """A parallel module seen from outside a launcher: one item per launch."""

    def collect(self):
        for launch in launches(self.path):
            if launch.gpu:  # run by tests/test_gpu.py, which scripts/checks/gpu_check.sh runs
                continue
            yield LaunchItem.from_parent(self, name=launch.name, launch=launch)


class LaunchItem(pytest.Item):
    def __init__(self, *, launch: Launch, **kw) -> None:
        super().__init__(**kw)
        self.launch = launch
        self.add_marker("parallel")
        if launch.extended:
            self.add_marker("extended")
        self.add_marker(pytest.mark.timeout(launch.timeout + 60))

    def runtest(self) -> None:
        out = Path(tempfile.mkdtemp(prefix=f"hvdpar-{self.path.stem}-{self.name}-"))
        outcome = run(self.path, self.launch, out)
        n = len(outcome.tests())
        print(f"{self.path.name}[{self.name}]: {n} tests x {self.launch.np} ranks, "
              f"{outcome.seconds:.0f} s")
        outcome.check()
        cleanup(out)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, LaunchError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}[{self.name}]"
