"""helpers/distributed.py's run_distributed, which the multi-process tests rely on: a failing rank fails the test with
its own traceback and stops the others at once; a hang ends in a bounded time naming the ranks that hung, with their
stacks."""

import inspect
import time

import pytest
import torch.distributed as dist
from helpers.distributed import run_distributed

pytestmark = pytest.mark.multiproc


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one's own mistake")
    dist.barrier()  # rank 0 would wait here for rank 1 until gloo's timeout


def _rank1_hangs(rank, world):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_a_failing_rank_fails_the_test_with_its_traceback_and_stops_the_others():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)_rank1_raises: rank 1 of 2 failed.*ValueError: rank one's own"):
        run_distributed(_rank1_raises, 2, timeout=120)
    assert time.monotonic() - t0 < 60  # not gloo's or the harness's timeout


def test_a_hang_is_bounded_and_names_the_ranks_and_their_stacks():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"_rank1_hangs: ranks \[0, 1\] of 2 did not finish within 5s") as e:
        run_distributed(_rank1_hangs, 2, timeout=5)
    assert time.monotonic() - t0 < 60
    said = str(e.value)
    rank1 = said.split("--- rank 1 ---")[1]
    lines, first = inspect.getsourcelines(_rank1_hangs)  # the line of the sleep, wherever it is in this file
    sleep_line = first + next(i for i, line in enumerate(lines) if "time.sleep(3600)" in line)
    assert f"line {sleep_line} in _rank1_hangs" in rank1 and "in barrier" in said.split("--- rank 1 ---")[0], said
