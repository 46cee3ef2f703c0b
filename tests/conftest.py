"""Test-session rules. Data comes from the repository's own fixtures (tests/fixture_data.py), never ../shared.

Skips. A test may skip only for a capability the machine lacks (root for the Slurm dev cluster, CUDA), with its
reason. With MEGAMEMO_FORBID_SKIPS=1 (what .ci/run sets) any skip fails the session. GPU tests (`@pytest.mark.gpu`)
are deselected, not skipped, where torch sees no CUDA device, unless asked for with `-m gpu` (then they skip with
the reason). The session ends with one line: how many tests ran, passed, failed and skipped.
"""
import os

import pytest


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run with `pytest -m gpu`)")
    config.addinivalue_line("markers", "multiproc: starts training or distributed worker processes; the fast subset "
                                       "is `pytest -m 'not multiproc'`")


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    asked = "gpu" in (config.getoption("markexpr") or "")
    for item in items:
        if item.get_closest_marker("gpu") is not None and asked:
            item.add_marker(pytest.mark.skip(reason="no CUDA device visible to torch"))
    if asked:
        return
    keep = [i for i in items if i.get_closest_marker("gpu") is None]
    dropped = [i for i in items if i.get_closest_marker("gpu") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        config._megamemo_gpu_deselected = len(dropped)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = terminalreporter.stats
    count = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
             for k in ("passed", "failed", "error", "skipped")}
    ran = count["passed"] + count["failed"]
    gpu = getattr(config, "_megamemo_gpu_deselected", 0)
    terminalreporter.write_line(
        f"megamemo: {ran} tests ran ({count['passed']} passed, {count['failed']} failed, {count['error']} errors), "
        f"{count['skipped']} skipped" + (f", {gpu} GPU tests deselected (no CUDA device)" if gpu else ""))


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("MEGAMEMO_FORBID_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        for r in skipped:
            reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
            print(f"\nmegamemo: skipped in CI (MEGAMEMO_FORBID_SKIPS=1): {r.nodeid}: {reason}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
