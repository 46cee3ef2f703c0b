"""Test-session rules. Data comes from the repository's own fixtures (tests/helpers/fixture_data.py), never
../shared. What the tests share lives in tests/helpers/ (imported as `helpers.X`: this folder is on sys.path).

Skips. A test may skip only for a capability the machine lacks (root for the Slurm dev cluster, CUDA), with its
reason. With MEGAMEMO_FORBID_SKIPS=1 (what .ci/run sets) any skip fails the session. GPU tests (`@pytest.mark.gpu`)
are deselected, not skipped, where torch sees no CUDA device, unless asked for with `-m gpu` (then they skip with
the reason); so are multi-GPU tests (`@pytest.mark.multigpu`, `-m multigpu`) where torch sees fewer than 2, and those
that need 4 (`@pytest.mark.gpu4`, beside multigpu) where it sees fewer than 4. The session ends with one line: how
many tests ran, passed, failed and skipped.
"""

import os
import sys
import time
from pathlib import Path

import pytest
from helpers.shards import ShardsBySize

# The test files live in folders that mirror the packages (tests/train/, tests/model/, ...; tests/helpers/ holds
# what they share), without __init__.py: pytest imports each by its basename, unique across the folders. Every
# folder is put on sys.path here, so that a test module imports another by that name (`from test_train_runs import
# run`) whatever order the folders are collected in, on every pytest-xdist worker alike.
TEST_FOLDERS = sorted(
    p
    for p in Path(__file__).resolve().parent.iterdir()
    if p.is_dir() and p.name not in ("fixtures", "helpers") and any(p.glob("test_*.py"))
)
sys.path[:0] = [str(p) for p in TEST_FOLDERS if str(p) not in sys.path]


def cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_available() -> bool:
    return cuda_count() > 0


# Triton's interpreter for the fused attention kernels (megamemo/kernels/fused.py) on CPU tensors: it must be on
# before triton is imported (here, before any test imports it), and is inherited by every process the tests start.
# Not where there is a GPU: there the kernels are compiled.
if not cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# marker -> CUDA devices its tests need
DEVICE_MARKERS = {"gpu": 1, "multigpu": 2, "gpu4": 4}


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def rendezvous_untouched():
    """A test that leaves a rendezvous variable set in this process (an in-process dist.init exports them) would
    hand every later process of the worker that port: they fail with EADDRINUSE far from the cause. Restored, and
    the test that leaked fails naming the variables."""
    before = {k: os.environ.get(k) for k in RENDEZVOUS}
    yield
    leaked = {k: os.environ.get(k) for k in RENDEZVOUS if os.environ.get(k) != before[k]}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not leaked, f"the test left rendezvous variables changed in the test process: {leaked}"


@pytest.fixture(scope="session")
def shards_by_size(tmp_path_factory) -> ShardsBySize:
    """The session's enwik8 shard directories, one per size (tests/helpers/shards.py). Read-only to tests."""
    return ShardsBySize(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="session")
def shards(shards_by_size):
    """Byte-level shards of the whole enwik8 fixture (`megamemo prepare enwik8`), once per session. Read-only to
    tests. A module that wants a smaller directory overrides it: `shards = sized(N)` (tests/helpers/shards.py)."""
    return shards_by_size.get(None)


@pytest.fixture(scope="session")
def tiny_cfg(tmp_path_factory):
    """The training tests' tiny config (tests/helpers/runs_cache.py TINY) as a file."""
    from helpers.runs_cache import TINY

    p = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    p.write_text(TINY)
    return p


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """The test run's cache of reference training runs (tests/helpers/runs_cache.py): each trained once, shared by the
    tests and by the pytest-xdist workers."""
    from helpers.runs_cache import ReferenceRuns

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # <run's root>/popen-gwN: the root is shared by the workers
        root = root.parent
    return ReferenceRuns(root / "references")


def pytest_configure(config):
    # the fault-injection test's seed: drawn once per test run (the pytest-xdist workers, started later, inherit it),
    # printed in the summary; MEGAMEMO_FAULT_SEED=N replays that run's kills anywhere (they fall at points of the
    # program and counts, never at times: megamemo/checkpoint/faults.py)
    os.environ.setdefault("MEGAMEMO_FAULT_SEED", str(time.time_ns() % 10_000))
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run with `pytest -m gpu`)")
    config.addinivalue_line("markers", "multigpu: needs 2 or more CUDA devices (run with `pytest -m multigpu`)")
    config.addinivalue_line(
        "markers",
        "gpu4: needs 4 or more CUDA devices (a multigpu test: `pytest -m multigpu` "
        "skips it naming the count where fewer are seen)",
    )
    config.addinivalue_line(
        "markers",
        "multiproc: starts training or distributed worker processes; the fast subset is `pytest -m 'not multiproc'`",
    )
    config.addinivalue_line(
        "markers",
        "numerics: a tolerance that depends on floating-point rounding; CI runs these a "
        "second time with torch's kernels on another instruction set "
        "(scripts/test_other_isa.sh)",
    )


def pytest_collection_modifyitems(config, items):
    have = cuda_count()
    expr = config.getoption("markexpr") or ""
    keep, dropped = [], []
    for item in items:
        need = max((n for m, n in DEVICE_MARKERS.items() if item.get_closest_marker(m) is not None), default=0)
        if need <= have:
            keep.append(item)
        elif any(m in expr for m, n in DEVICE_MARKERS.items() if item.get_closest_marker(m) is not None):
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), torch sees {have}"))
            keep.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        config._megamemo_gpu_deselected = len(dropped)
    # the multi-process tests first (a stable sort: file order within each group): they take 5-25 s each, the rest
    # well under one, so the pytest-xdist workers of scripts/test.sh end together, the short tests filling the gaps
    items.sort(key=lambda item: item.get_closest_marker("multiproc") is None)


def pytest_sessionfinish(session, exitstatus):
    """On a pytest-xdist worker: hand the GPU deselection count to the controller (see pytest_testnodedown)."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["gpu_deselected"] = getattr(session.config, "_megamemo_gpu_deselected", 0)
    _forbid_skips(session)


def pytest_testnodedown(node, error):
    """On the pytest-xdist controller (which collects nothing itself): the workers' GPU deselection count."""
    out = getattr(node, "workeroutput", {})
    if "gpu_deselected" in out:
        node.config._megamemo_gpu_deselected = out["gpu_deselected"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = terminalreporter.stats
    count = {
        k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
        for k in ("passed", "failed", "error", "skipped")
    }
    ran = count["passed"] + count["failed"]
    gpu = getattr(config, "_megamemo_gpu_deselected", 0)
    terminalreporter.write_line(
        f"megamemo: {ran} tests ran ({count['passed']} passed, {count['failed']} failed, {count['error']} errors), "
        f"{count['skipped']} skipped"
        + (f", {gpu} GPU tests deselected (too few CUDA devices)" if gpu else "")
        + f"; fault injection seed {os.environ['MEGAMEMO_FAULT_SEED']} (MEGAMEMO_FAULT_SEED replays it)"
    )


def _forbid_skips(session):
    if os.environ.get("MEGAMEMO_FORBID_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        for r in skipped:
            reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
            print(f"\nmegamemo: skipped in CI (MEGAMEMO_FORBID_SKIPS=1): {r.nodeid}: {reason}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
