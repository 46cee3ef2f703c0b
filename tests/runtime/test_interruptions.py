"""Failures and their bookkeeping, without training: which rank caused a failed start (megamemo/runtime/
interruptions.py), its record in <run_dir>/interruptions.jsonl against hand-computed values, when a supervisor
gives up, the watchdog's timeout rule, whom it blames and what it writes when it fires (runtime/watchdog.py; one
real process whose main thread hangs), and goodput computed by hand for a scripted interruption and for a running
restart after an ended start (runtime/goodput.py, with the records written by train/metrics.py; the process start
read from /proc in a fresh process)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megamemo.runtime import goodput, interruptions
from megamemo.runtime.interruptions import EXIT_HUNG, EXIT_PEER_LOST, Exit, culprit, decide
from megamemo.runtime.watchdog import Watchdog
from megamemo.train.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]


# ---- the cause of a failed start ----------------------------------------------------------------------------------
def test_the_culprit_is_the_first_failure_that_no_other_caused():
    killed = Exit(1, -signal.SIGKILL, 10.0)
    peer = Exit(0, EXIT_PEER_LOST, 10.0)  # saw its peer vanish: seen in the same poll, a lower rank
    assert culprit([peer, killed]) == killed
    # seen in the same poll, the abort of a peer (gloo) and the kill of the rest by the supervisor are consequences
    aborted = Exit(0, -signal.SIGABRT, 9.0)
    stopped = Exit(2, -signal.SIGKILL, 9.5, killed=True)
    assert culprit([aborted, stopped, Exit(1, 1, 10.0)]).rank == 1
    assert culprit([Exit(3, 1, 5.0), Exit(2, 1, 5.0)]).rank == 2  # a tie: the lowest rank
    assert culprit([Exit(1, EXIT_PEER_LOST, 7.0), Exit(0, EXIT_PEER_LOST, 6.0)]).rank == 0  # only consequences
    assert culprit([Exit(0, 0, 1.0)]) is None
    # two real failures, the higher rank's first: the earlier is the cause, whatever the ranks
    assert culprit([Exit(0, 1, 6.0), Exit(1, -signal.SIGSEGV, 5.0)]).rank == 1
    assert culprit([Exit(0, 137, 6.0), Exit(3, 1, 5.5), Exit(2, EXIT_PEER_LOST, 5.0)]).rank == 3
    assert interruptions.describe(137) == "signal SIGKILL" == interruptions.describe(-9)
    assert interruptions.describe(1) == "exit code 1" and not interruptions.retryable(2)
    assert interruptions.retryable(EXIT_HUNG) and interruptions.retryable(137)


def scripted_run(tmp_path: Path) -> Path:
    """A run directory as a failed start leaves it: steps 1-7 logged at t = 100 + step (step 6 committed), the start
    began at 95 (process) and trained from 100 (ready)."""
    d = tmp_path / "run"
    (d / "checkpoints" / "step_00000006").mkdir(parents=True)
    (d / "checkpoints" / "step_00000006" / "COMMITTED").write_text("{}")
    (d / "checkpoints" / "step_00000008").mkdir()  # an interrupted save: not committed
    recs = [{"kind": "start", "time": 95.0, "ready": 100.0, "step": 0}]
    recs += [{"kind": "train", "step": s, "loss": 1.0, "time": 100.0 + s} for s in range(1, 8)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tr')  # a cut line
    return d


def beat(d: Path, rank: int, node: str, step: int, when: float, **extra) -> None:
    (d / "heartbeats").mkdir(exist_ok=True)
    (d / "heartbeats" / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "node": node, "pid": 100 + rank, "step": step, "beat": when, **extra})
    )


def test_a_kill_9_is_recorded_with_its_rank_node_step_and_lost_time(tmp_path):
    d = scripted_run(tmp_path)
    beat(d, 0, "node1", 7, 109.0)
    beat(d, 1, "node2", 7, 109.0)
    rec = interruptions.record(
        d,
        [Exit(1, -signal.SIGKILL, 110.0), Exit(0, EXIT_PEER_LOST, 110.1)],
        started=94.0,
        now=111.5,
        restart=2,
        launcher="local",
    )
    assert rec == {
        "time": 111.5,
        "started": 94.0,
        "step": 7,
        "committed": 6,
        "kind": "crash",
        "rank": 1,
        "node": "node2",
        "exit_code": None,
        "signal": "SIGKILL",
        "seconds_lost": 111.5 - 106.0,  # since step 6 (the commit) ended, at 106
        "restart": 2,
        "launcher": "local",
    }
    assert interruptions.history(d) == [rec]
    line = interruptions.summary(rec)
    assert line == "crash of rank 1 on node2 (signal SIGKILL) after step 7 (last committed: 6; 5.5 s lost)"


def test_lost_time_without_a_new_commit_and_without_a_step(tmp_path):
    d = scripted_run(tmp_path)
    for p in (d / "checkpoints").glob("*/COMMITTED"):
        p.unlink()
    # nothing committed: lost since the start's first step (its start-up is goodput's start-up, counted there)
    rec = interruptions.record(d, [Exit(0, 1, 108.0)], started=94.0, now=108.0)
    assert (rec["committed"], rec["seconds_lost"], rec["exit_code"], rec["signal"]) == (None, 8.0, 1, None)
    # a start that wrote no "start" record (it failed before its first step) lost all of its time
    rec = interruptions.record(d, [Exit(0, 137, 130.0)], started=120.0, now=130.5)
    assert rec["seconds_lost"] == 10.5 and rec["signal"] == "SIGKILL"


def test_a_hang_is_recorded_against_the_rank_it_stopped(tmp_path):
    d = scripted_run(tmp_path)
    beat(d, 1, "node2", 7, 101.0)  # stopped: its heartbeat went stale
    beat(d, 0, "node1", 7, 112.0, hung={"stuck": [1], "by": 0, "step": 7})
    exits = [Exit(0, EXIT_HUNG, 112.0), Exit(1, -signal.SIGKILL, 112.05, killed=True)]
    rec = interruptions.record(d, exits, started=94.0, now=112.1, launcher="slurm", job="42")
    assert (rec["kind"], rec["rank"], rec["node"], rec["job"]) == ("hang", 1, "node2", "42")
    assert rec["signal"] is None and rec["exit_code"] is None  # it never ended by itself
    # every rank that ended saw a peer vanish, and one never ended by itself: that one hung
    d2 = scripted_run(tmp_path / "b")
    rec = interruptions.record(d2, [Exit(0, EXIT_PEER_LOST, 50.0), Exit(1, -9, 50.1, killed=True)], started=94.0)
    assert (rec["kind"], rec["rank"]) == ("hang", 1)
    # heartbeats older than the start are another start's: not read
    beat(d2, 0, "old", 3, 10.0, hung={"stuck": [0]})
    rec = interruptions.record(d2, [Exit(0, 1, 150.0)], started=94.0, now=150.0)
    assert (rec["kind"], rec["rank"], rec["node"]) == ("crash", 0, None)


def test_when_to_stop():
    rec = lambda step, kind="crash": {"kind": kind, "step": step}  # noqa: E731
    assert decide(rec(5), [], 1) == (True, "")
    assert decide(rec(5, "usage"), [], 9)[0] is False
    ok, why = decide(rec(5), [rec(5), rec(5)], 9)
    assert not ok and why.startswith("failed 3 times in a row after step 5: a deterministic failure")
    assert decide(rec(5), [rec(5), rec(4)], 9)[0]  # progress in between
    assert decide(rec(5), [rec(5), rec(5, "node")], 9)[0]  # a node at fault is not the step's
    assert decide(rec(5), [rec(5)], 0) == (False, "no restarts left")


def test_the_slurm_helper_prints_shell_assignments(tmp_path):
    d = scripted_run(tmp_path)
    exits = tmp_path / "exits"
    exits.mkdir()
    (exits / "1").write_text("137 node2 110.0\n")
    (exits / "0").write_text(f"{EXIT_PEER_LOST} node1 110.2\n")
    run_dir_file = tmp_path / "run-dir"
    run_dir_file.write_text(f"{d}\n")
    # as failure.sh runs it, isolated; -S too (no site-packages): megamemo is not importable, as on a batch host
    # without it (a container job)
    isolated = [sys.executable, "-I", "-S"]
    assert subprocess.run([*isolated, "-c", "import megamemo"], capture_output=True).returncode == 1
    helper = [*isolated, str(REPO / "scripts" / "slurm_failure.py"), "slurm"]
    common = ["--exits", str(exits), "--run-dir-file", str(run_dir_file), "--started", "94"]
    out = subprocess.run([*helper, "culprit", *common], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["c_rank=1", "c_node=node2", "c_suspects=''"]
    out = subprocess.run(
        [*helper, "record", *common, "--rc", "137", "--restarts-left", "3", "--job", "7"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = subprocess.run(
        ["bash", "-c", f'eval {json.dumps(out)}; echo "$verdict|$kind|$step|$line"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    rec = interruptions.history(d)[-1]
    assert got == f"retry|crash|7|{interruptions.summary(rec)}"
    assert (rec["rank"], rec["node"], rec["job"], rec["launcher"]) == (1, "node2", "7", "slurm")
    # rank 1 stopped, rank 0's collective timed out (exit 4), srun killed rank 1 (no exit written): rank 1 hung
    (exits / "1").unlink()
    beat(d, 1, "node2", 7, 100.0)
    out = subprocess.run([*helper, "culprit", *common], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["c_rank=1", "c_node=node2", "c_suspects=''"]
    subprocess.run([*helper, "record", *common, "--rc", "4"], capture_output=True, text=True, check=True)
    rec = interruptions.history(d)[-1]
    assert (rec["kind"], rec["rank"], rec["node"], rec["signal"]) == ("hang", 1, "node2", None), rec


# ---- the watchdog ---------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def test_the_auto_timeout_follows_the_slowest_step_after_the_first_ones(tmp_path):
    clock = Clock()
    wd = Watchdog(tmp_path, 0, 1, None, 120.0, clock=clock, wall=clock, exit=lambda c: None)
    assert wd.limit() == 600.0  # the first steps: 5 x the floor
    for s, secs in enumerate((400.0, 30.0, 2.0), 1):  # compilation, warm-up, then a 2 s step
        wd.step_done(s, secs)
    assert wd.limit() == 120.0  # 10 x 2 s is below the floor
    wd.step_done(4, 31.0)
    assert wd.limit() == 310.0  # 10 x the slowest since the warm-up
    assert Watchdog(tmp_path, 0, 1, 7.5, 120.0).limit() == 7.5 and not Watchdog(tmp_path, 0, 1, 0, 1).enabled


def test_the_watchdog_fires_past_the_timeout_outside_pauses_and_names_the_silent_peer(tmp_path):
    clock, wall, codes = Clock(), Clock(1000.0), []
    out = io.StringIO()
    wd = Watchdog(tmp_path, 0, 3, 10.0, 120.0, node="node1", out=out, clock=clock, wall=wall, exit=codes.append)
    wd.start(4)
    wd.stop()  # (no thread here: the test calls check itself)
    beat(tmp_path, 1, "node2", 5, 1000.0)  # heard from at the start, then silent
    beat(tmp_path, 2, "node3", 5, 1000.0)
    wd.step_done(5, 0.1)
    with wd.paused("save"):
        clock.t, wall.t = 30.0, 1030.0  # a long save: not a stall
        assert not wd.check()
    clock.t, wall.t = 39.0, 1039.0
    beat(tmp_path, 2, "node3", 5, 1038.0)  # rank 2 still beats (waiting like this one)
    assert not wd.check() and codes == []  # 9 s since the pause ended
    clock.t, wall.t = 41.0, 1041.0
    assert wd.check() and codes == [EXIT_HUNG]
    line = out.getvalue().splitlines()[-1]
    assert (
        line.startswith("[watchdog] rank 0 (node1, pid ")
        and "hung: no step for 11 s (train.hang_timeout_s=10) after step 5; stuck in " in line
    ), line
    assert (
        "rank 1 (node2, pid 101) not heard from for 41 s (its last heartbeat: step 5)" in line and "rank 2" not in line
    ), line
    mine = json.loads((tmp_path / "heartbeats" / "rank0.json").read_text())
    assert mine["hung"]["stuck"] == [1] and mine["hung"]["step"] == 5 and mine["node"] == "node1"


def test_the_watchdog_blames_no_fresh_peer_at_its_step_and_a_silent_one_only_past_the_stale_limit(tmp_path):
    """Several peers beating at this rank's own step: none is behind (the collective or the network hangs); those
    at a lower step are. A peer is silent only when its last beat is more than STALE_BEATS intervals old: exactly
    at that age it is still fresh."""
    from megamemo.runtime.watchdog import STALE_BEATS

    wall = Clock(1000.0)
    wd = Watchdog(tmp_path, 0, 4, 10.0, 120.0, node="node1", clock=Clock(), wall=wall, exit=lambda c: None)
    wd.step_done(5, 0.1)
    for r in (1, 2, 3):
        beat(tmp_path, r, f"node{r + 1}", 5, 1000.0)
    fresh = "every rank's heartbeat is fresh and at this step: a collective or the network hangs"
    assert wd.waiting_for() == ([], fresh)
    beat(tmp_path, 2, "node3", 4, 1000.0)
    beat(tmp_path, 3, "node4", 4, 1000.0)
    assert wd.waiting_for() == ([2, 3], "rank(s) 2, 3 behind at step 4")
    # the stale limit: STALE_BEATS x the interval (a fifth of the 10 s timeout) = 6 s
    assert STALE_BEATS * wd.interval == 6.0
    for r in (2, 3):
        beat(tmp_path, r, f"node{r + 1}", 5, 1005.0)
    wall.t = 1006.0  # rank 1's last beat exactly 6 s old: still fresh
    assert wd.waiting_for() == ([], fresh)
    wall.t = 1006.25  # just past it: silent; ranks 2 and 3 are not
    ranks, why = wd.waiting_for()
    assert ranks == [1] and why.startswith("rank 1 (node2, pid 101) not heard from for 6 s"), why


def test_overflowing_attempts_are_progress(tmp_path):
    """fp16 overflows retried on the same batch (up to precision.max_consecutive_skips) do not move the step, and
    are no hang."""
    clock, codes = Clock(), []
    wd = Watchdog(tmp_path, 0, 1, 10.0, 120.0, clock=clock, wall=clock, exit=codes.append, out=io.StringIO())
    wd.step_done(1, 1.0)
    for t in (6.0, 12.0, 18.0):
        clock.t = t
        wd.attempted()
        assert not wd.check()
    clock.t = 28.5
    assert wd.check() and codes == [EXIT_HUNG]


HANGING = textwrap.dedent("""
    import sys, threading, time
    from megamemo.runtime.watchdog import Watchdog
    wd = Watchdog(sys.argv[1], 0, 1, 1.0, 1.0, node="here")
    wd.start(0)
    wd.step_done(1, 0.01)
    def stuck_in_a_driver_call():
        threading.Event().wait()                # blocks for ever, the interpreter free for other threads
    stuck_in_a_driver_call()
""")


def test_a_hung_process_dumps_every_stack_names_the_frame_and_exits_3(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", HANGING, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    took = time.monotonic() - t0
    assert r.returncode == EXIT_HUNG, r.stderr
    assert took < 30, took
    assert "Current thread" in r.stderr and "in stuck_in_a_driver_call" in r.stderr, r.stderr  # faulthandler's dump
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("[watchdog] rank 0 (here, pid ") and "after step 1; stuck in wait (" in line, line
    assert line.endswith("exiting with code 3") and "every rank's heartbeat is fresh" in line, line


# ---- goodput ------------------------------------------------------------------------------------------------------
def test_goodput_by_hand_for_a_scripted_interruption(tmp_path, monkeypatch, capsys):
    """Start 1: process start 1000, training from 1010, steps 1-5 of 1 s (ending 1011..1015), step 3 committed, rank 1
    killed at 1016. Start 2 (a restart): process start 1020, training from 1028, resumes at step 3, steps 4-6 of 1 s
    (1029..1031), ends at 1032. By hand: productive = 6 steps x 1 s = 6 s (steps 4 and 5 of start 1 were done
    again: trimmed); wall = 1032 - 1000 = 32 s; goodput = 6 / 32 = 18.75 %. Start-ups 10 + 8 = 18 s; lost 1016 -
    1013 = 3 s (since the commit); the rest 32 - 6 - 18 - 3 = 5 s (the 4 s from the kill to the next start, 1 s of
    ending)."""
    import megamemo.train.metrics as metrics_mod

    clock = Clock()
    monkeypatch.setattr(metrics_mod.time, "time", clock)
    step = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0, "tokens": 8, "seconds": 1.0}
    d = tmp_path / "run"
    m = Metrics(
        d,
        enabled=True,
        every=100,
        unit="bpc",
        tensorboard=False,
        start_step=0,
        start={"time": 1000.0, "step": 0, "world_size": 2, "restart": 0},
    )
    clock.t = 1010.0
    m.start_window()
    for s in range(1, 6):
        clock.t = 1010.0 + s
        m.train_step(dict(step, step=s))
    m.close()
    (d / "checkpoints" / "step_00000003").mkdir(parents=True)
    (d / "checkpoints" / "step_00000003" / "COMMITTED").write_text("{}")
    rec = interruptions.record(d, [Exit(1, -9, 1016.0), Exit(0, EXIT_PEER_LOST, 1016.1)], started=999.0, now=1016.0)
    assert rec["seconds_lost"] == 3.0 and rec["step"] == 5
    m = Metrics(
        d,
        enabled=True,
        every=100,
        unit="bpc",
        tensorboard=False,
        start_step=3,
        start={"time": 1020.0, "step": 3, "world_size": 2, "restart": 1},
    )
    clock.t = 1028.0
    m.start_window()
    for s in range(4, 7):
        clock.t = 1025.0 + s
        m.train_step(dict(step, step=s))
    clock.t = 1032.0
    m.end(6, "done")
    m.close()
    g = goodput.of_run(d)
    assert g["goodput"] == 6 / 32 == 0.1875
    assert (g["productive_s"], g["wall_s"], g["startup_s"], g["lost_s"], g["other_s"]) == (6.0, 32.0, 18.0, 3.0, 5.0)
    assert (g["starts"], g["interruptions"], g["steps"], g["ended"]) == (2, 1, 6, True)
    assert goodput.describe(g).startswith(
        "goodput 18.8%: 6.0 s of training steps in 32.0 s since the first start "
        "(2 starts, start-ups 18.0 s; 1 interruption, 3.0 s lost;"
    )
    # a fresh start that is not a restart begins a new history; one that is (before any commit) keeps it
    for restart, starts in ((1, 2), (0, 1)):
        m = Metrics(
            d,
            enabled=True,
            every=100,
            unit="bpc",
            tensorboard=False,
            start_step=0,
            start={"time": 2000.0, "step": 0, "world_size": 2, "restart": restart},
        )
        m.train_step(dict(step, step=1))
        m.close()
        assert goodput.of_run(d)["starts"] == starts


def test_goodput_of_a_running_restart_after_an_ended_start_and_with_older_interruptions():
    """By hand. Start 1 (process start 100, training from 104) ran steps 1-3 of 2 s and ended at 112 (stopped by a
    signal after saving: its "end" record); start 2 (a requeue, process start 130, training from 133) resumes and is
    still running: steps 4-5 (135, 137). Its wall ends at the newest record (137), not at start 1's end, and the
    run has not ended. interruptions.jsonl also holds a record of an earlier history (time 50, before the first
    start: a fresh start began a new history since): not this run's."""
    train = lambda s, t: {"kind": "train", "step": s, "seconds": 2.0, "time": t}  # noqa: E731
    records = [
        {"kind": "start", "time": 100.0, "ready": 104.0, "step": 0, "restart": 0},
        train(1, 106.0),
        train(2, 108.0),
        train(3, 110.0),
        {"kind": "end", "step": 3, "time": 112.0},
        {"kind": "start", "time": 130.0, "ready": 133.0, "step": 3, "restart": 1},
        train(4, 135.0),
        train(5, 137.0),
    ]
    older = {"time": 50.0, "kind": "crash", "step": 9, "seconds_lost": 20.0}
    g = goodput.compute(records, [older])
    assert (g["wall_s"], g["productive_s"], g["startup_s"], g["lost_s"]) == (37.0, 10.0, 7.0, 0.0)
    assert (g["ended"], g["end"], g["starts"], g["interruptions"], g["other_s"]) == (False, 137.0, 2, 0, 20.0)
    assert g["goodput"] == 10.0 / 37.0
    # the same history once start 2 ended (at 140), with an interruption of this run (at 120, 6 s lost)
    g = goodput.compute(
        records + [{"kind": "end", "step": 5, "time": 140.0}],
        [older, {"time": 120.0, "kind": "crash", "step": 3, "seconds_lost": 6.0}],
    )
    assert (g["ended"], g["wall_s"], g["interruptions"], g["lost_s"]) == (True, 40.0, 1, 6.0)


def test_the_process_start_is_read_from_proc_as_wall_clock_time():
    """goodput's start-up begins at the process's start (Linux /proc: boot time + start ticks): in a fresh process,
    at most a second before (the boot time is whole seconds) and never after its first line's clock reading, and
    no more than its interpreter's start-up earlier."""
    code = (
        "import time; t = time.time(); from megamemo.runtime.goodput import process_started; "
        "print(t, process_started())"
    )
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    first_line, started = map(float, out.stdout.split())
    assert t0 - 1.0 <= started <= first_line + 0.01, (t0, started, first_line)


def test_a_fault_plan_holds_for_the_start_it_names():
    from megamemo.checkpoint.faults import FaultPoints

    plan = {"MEGAMEMO_FAULT_KILL_AT": "save:2@0,commit:1@2"}
    assert FaultPoints(0, plan).kill_at == ("save", 2, None)  # the first start
    assert FaultPoints(0, {**plan, "MEGAMEMO_RESTART": "1"}).kill_at is None  # no fault planned for it
    assert FaultPoints(1, {**plan, "MEGAMEMO_RESTART": "2"}).kill_at == ("commit", 1, None)
    every_start = {"MEGAMEMO_FAULT_KILL_AT": "removal:3", "MEGAMEMO_RESTART": "5"}
    assert FaultPoints(0, every_start).kill_at == ("removal", 3, None)


def test_the_replay_decision_runs_where_megamemo_is_not_importable(tmp_path):
    """runtime/suspect.py is loaded by path beside interruptions.py on the batch host (scripts/slurm_failure.py,
    python -I -S): it reads the replay's layout from a checkpoint marker with the standard library alone."""
    step = tmp_path / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text(json.dumps({"layout": {"world_size": 4, "dp": 2, "tp": 2, "pp": 1}}))
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('s', {str(REPO / 'megamemo' / 'runtime' / 'suspect.py')!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        f"print(' '.join(m.layout_of({str(tmp_path)!r}, 6)))"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["--dp", "2", "--tp", "2", "--pp", "1"], out.stderr
