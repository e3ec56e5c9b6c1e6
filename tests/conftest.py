"""Test tiers: every test gets exactly one of unit, integration, parallel, testbed, gpu
(pyproject.toml registers them; `pytest -m unit` is make test-fast). The aggregator fixtures
(helpers in aggregator_helpers.py). Parallel modules and their driver: tests/parallel/."""
from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "integration", "parallel", "testbed", "gpu")
# Each file's tier, for the tests that do not name theirs (a test's own marker wins).
FILE_TIERS = {
    "test_aggregator_core.py": "unit", "test_analyze.py": "unit", "test_codec.py": "unit",
    "test_costmodel.py": "unit", "test_cuda_host.py": "unit", "test_device.py": "unit",
    "test_dissect.py": "unit", "test_engine.py": "unit", "test_rows.py": "unit",
    "test_sparsifiers.py": "unit", "test_sparsify_ops.py": "unit",
    "test_switch_pipeline.py": "unit", "test_switch_program.py": "unit",
    "test_protocol_doc.py": "unit", "test_parallel_driver.py": "unit", "test_auth.py": "unit",
    "test_config.py": "unit",
    # its Python targets are unit tests; its C++ replays (compiler, processes) say integration
    "test_fuzz_corpus.py": "unit",
    "test_aggregator_sums.py": "integration", "test_aggregator_cli.py": "integration",
    "test_aggregator_loss.py": "integration", "test_aggregator_junk.py": "integration",
    "test_aggregator_jobs.py": "integration", "test_docker.py": "integration",
    "test_stale_epoch.py": "integration",
    "test_install.py": "integration", "test_torchfree.py": "integration",
    "test_job_faults.py": "parallel",
    "test_testbed.py": "testbed", "test_dpdk.py": "testbed", "test_switch_emu.py": "testbed",
    "test_hostile.py": "testbed", "test_testbed_colocated.py": "testbed",
    "test_testbed_budgets.py": "testbed", "test_compose.py": "testbed",
    "test_testbed_faults.py": "testbed", "test_soak.py": "testbed",
    "test_gpu.py": "gpu",
}
# Fixtures that start aggregator processes: a test using one is an integration test.
PROCESS_FIXTURES = {"aggs", "make_workers", "fuzz_job"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sanitized-ext", action="store_true",
                     help="make sanitize-ext: fail unless hvd_sparse._C is the sanitized build")


def pytest_configure(config: pytest.Config) -> None:
    # A stray sys.path entry (the checkout itself) would test the normal _C and pass silently.
    if config.getoption("--sanitized-ext"):
        import importlib.util
        origin = importlib.util.find_spec("hvd_sparse._C").origin
        if "sanitize-ext" not in Path(origin).parts:
            raise pytest.UsageError(f"--sanitized-ext, but hvd_sparse._C is {origin}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Gives every test exactly one tier marker; two, or none known, is a collection error."""
    for item in items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        if not tiers:
            if "parallel" in item.path.parent.name:  # a test on one rank of a Horovod job
                tier = "parallel"
            elif PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
                tier = "integration"
            else:
                tier = FILE_TIERS.get(item.path.name)
            if tier is None:
                raise pytest.UsageError(f"{item.nodeid}: no tier (add its file to FILE_TIERS "
                                        "in tests/conftest.py or mark the test)")
            item.add_marker(tier)
        elif len(set(tiers)) > 1:
            raise pytest.UsageError(f"{item.nodeid}: several tiers {sorted(set(tiers))}")


# ------------------------------------------------------------------------------------------
# Aggregator processes and in-process workers (tests/aggregator_helpers.py)
# ------------------------------------------------------------------------------------------

@pytest.fixture
def aggs(tmp_path):
    """start(workers, *flags, host=...) -> a running aggregator process bound to host
    (aggregator_helpers.HOST by default); all killed at teardown."""
    from aggregator_helpers import HOST, Agg

    started: list = []

    def start(workers: int, *flags: str, host: str = HOST):
        a = Agg(tmp_path / f"agg{len(started)}", workers, flags, host)
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()


@pytest.fixture
def make_workers():
    """make(aggregators, n, token, register=True, **kw) -> n OmniWorkers (registered); all
    closed at teardown."""
    from hvd_sparse import _C

    made: list = []

    def make(agg_list: list, n: int, token: int = 0x5EED, register: bool = True, **kw):
        ws = [_C.OmniWorker([a.addr for a in agg_list], token, r, n, **kw) for r in range(n)]
        made.extend(ws)
        if register:
            for w in ws:
                w.register(15.0)
        return ws

    yield make
    for w in made:
        w.close()


@pytest.fixture
def fuzz_job(aggs, make_workers):
    """The legitimate job of the junk tests (aggregator_helpers.Job) and a socket to fire from:
    (aggregator, workers, socket, [counter])."""
    import socket

    from aggregator_helpers import HOST, Job

    agg = aggs(Job.n, "--threads", "2")
    ws = make_workers([agg], Job.n, token=Job.token, payload_bytes=Job.payload,
                      slots_per_aggregator=Job.slots)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((HOST, 0))
    yield agg, ws, sock, [0]
    sock.close()
