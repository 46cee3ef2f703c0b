"""A training job's failures as its supervisor sees them (launch/local.sh --max-restarts: runtime/launcher.py;
launch/slurm/train.sbatch): the exit codes and their classes, one record per failure in
`<run_dir>/interruptions.jsonl`, and whether to start the job again.

Exit codes of `megamemo train`:
  0  done, or stopped by a signal after saving          2  bad usage, config, data or a refused checkpoint
  1  an error of this rank (a crash, a diverged run)     3  hung: the watchdog found no step for too long
  4  a peer is gone (a collective failed because another rank died or hung): a consequence, never the cause
  5  node-suspect: the data-parallel replicas disagree (megamemo/train/numerics.py); the ranks at fault are named in
     their heartbeats ("replicas"), the record is of kind node, and the run resumes from its newest checkpoint,
     written only once its replicas agreed
A signal ends a rank as 128 + N (a shell's view) or -N (Python's Popen).

Classes. Exit 2 is never retried: starting again cannot help. A crash (a signal, exit 1, an NCCL/gloo error), a
hang or a lost node is retried. A failure that repeats at the same step SAME_STEP_LIMIT times in a row is
deterministic (a bad batch, a NaN that skipping does not cure): the supervisor stops, saying so in one line.

A record (one JSON line): time (of the failure, epoch seconds), started (when the failed start began), step (the
last step the run reached), committed (the newest committed checkpoint's step), kind (crash | hang | node), rank,
node, exit_code, signal, seconds_lost (the time since the last commit, or since the failed start's first step
when it committed nothing new, or its whole time when it never reached one: work to be done again), restart (how
many restarts came before), launcher (local | slurm) and, under Slurm, job.

Standard library only: launch/slurm/failure.sh runs scripts/slurm_failure.py by path, isolated (`python3 -I
.../scripts/slurm_failure.py slurm ...`), on the batch host, which need not have megamemo installed (a container
job); that script loads this file by its path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_ERROR, EXIT_USAGE, EXIT_HUNG, EXIT_PEER_LOST, EXIT_NODE_SUSPECT = 1, 2, 3, 4, 5
SAME_STEP_LIMIT = 3
USAGE = "exit code 2 (bad usage, config, data or checkpoint): starting again cannot help"
RECORDS = "interruptions.jsonl"
HEARTBEATS = "heartbeats"  # <run_dir>/heartbeats/rank<N>.json, written by each rank's watchdog
RUN_DIR_FILE = "MEGAMEMO_RUN_DIR_FILE"  # where rank 0 tells its supervisor the run directory (an absolute path)


def signal_of(code: int) -> int | None:
    """The signal that ended a process: -N (Popen) or 128 + N (a shell, srun's task.sh); None for an exit."""
    n = -code if code < 0 else (code - 128 if 128 < code < 128 + 65 else None)
    return n if n else None


def describe(code: int) -> str:
    n = signal_of(code)
    if n is None:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(n).name}"
    except ValueError:
        return f"signal {n}"


def kind_of(code: int) -> str:
    return {EXIT_USAGE: "usage", EXIT_HUNG: "hang", EXIT_PEER_LOST: "peer-lost", EXIT_NODE_SUSPECT: "node"}.get(
        code, "crash"
    )


def retryable(code: int) -> bool:
    """Whether a start that ended with `code` may be started again: not a success, not a usage error (bad config,
    data or a locked run directory, which a restart would meet again)."""
    return code not in (0, EXIT_USAGE)


@dataclass
class Exit:
    """How one rank ended: `killed` when its supervisor ended it after another's failure (not a cause)."""

    rank: int
    code: int
    time: float
    node: str | None = None
    killed: bool = False

    def consequence(self) -> bool:
        return self.killed or self.code == EXIT_PEER_LOST or signal_of(self.code) == signal.SIGABRT


def culprit(exits: list[Exit]) -> Exit | None:
    """The failure that ended a start: the earliest that is not a consequence of another (a rank that saw its peer
    vanish exits 4; gloo aborts one with SIGABRT; the supervisor kills the rest), the lowest rank on a tie; if every
    failure is a consequence, the earliest of them."""
    failed = [e for e in exits if e.code != 0]
    causes = [e for e in failed if not e.consequence()] or failed
    return min(causes, key=lambda e: (e.time, e.rank)) if causes else None


def restart_count(environ=None) -> int:
    """How many restarts came before this start: MEGAMEMO_RESTART (set by launch/local.sh --max-restarts and by
    train.sbatch), else Slurm's requeues (SLURM_RESTART_COUNT)."""
    env = os.environ if environ is None else environ
    for key in ("MEGAMEMO_RESTART", "SLURM_RESTART_COUNT"):
        try:
            return int(env[key])
        except (KeyError, ValueError):
            continue
    return 0


def announce_run_dir(run_dir: str | Path, rank: int, environ=None) -> None:
    """Rank 0 tells the supervisor that started it (MEGAMEMO_RUN_DIR_FILE) which run directory it trains in, so
    that a failure can be recorded there; nothing without a supervisor."""
    path = (os.environ if environ is None else environ).get(RUN_DIR_FILE)
    if path and rank == 0:
        try:
            Path(path).write_text(str(Path(run_dir).resolve()) + "\n")
        except OSError:
            pass


# ---- what the run directory says -------------------------------------------------------------------------------
def read_heartbeats(run_dir: Path, since: float = 0.0) -> dict[int, dict]:
    """rank -> its last heartbeat (runtime/watchdog.py), those written at or after `since` only."""
    out = {}
    for p in sorted((Path(run_dir) / HEARTBEATS).glob("rank*.json")):
        try:
            beat = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(beat, dict) and float(beat.get("beat", 0)) >= since:
            out[int(beat["rank"])] = beat
    return out


def committed_step(run_dir: Path) -> int | None:
    """The newest committed checkpoint's step (a `checkpoints/step_N` directory with its COMMITTED marker:
    megamemo/checkpoint/store.py's layout, read here without importing it)."""
    steps = [
        int(p.parent.name[5:])
        for p in (Path(run_dir) / "checkpoints").glob("step_*/COMMITTED")
        if p.parent.name[5:].isdigit()
    ]
    return max(steps) if steps else None


def recent_records(run_dir: Path, back_to: int) -> list[dict]:
    """The "train" records of metrics.jsonl from step `back_to` on, and the "start" records among them, read from
    the end (the file grows with the run)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    size, chunk = path.stat().st_size, 1 << 16
    while True:
        with open(path, "rb") as f:
            f.seek(max(0, size - chunk))
            lines = f.read().decode(errors="replace").splitlines()[1 if size > chunk else 0 :]
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(rec, dict) and (
                rec.get("kind") == "start" or (rec.get("kind") == "train" and rec.get("step", -1) >= back_to)
            ):
                out.append(rec)
        if chunk >= size or any(r["kind"] == "train" and r["step"] <= back_to for r in out):
            return out
        chunk *= 4


def history(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / RECORDS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def append(run_dir: Path, record: dict) -> None:
    with open(Path(run_dir) / RECORDS, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def at_fault(exits: list[Exit], beats: dict[int, dict]) -> tuple[str, int | None]:
    """(kind, rank) of a failed start: the rank a watchdog named hung (its heartbeat's verdict); else the culprit
    among the exits; else, when every rank that ended did so because of a peer, one that never ended by itself
    (stopped, or stuck in a call that holds the interpreter, until its supervisor killed it): a hang."""
    named = [r for b in beats.values() for r in (b.get("hung") or {}).get("stuck", [])]
    if named:
        return "hang", min(named)
    suspects = replica_suspects(beats)
    if suspects:
        return "node", suspects[0]["rank"]
    first = culprit(exits)
    if first is None:
        return "crash", None
    silent = sorted(e.rank for e in exits if e.killed)
    if first.consequence() and silent:
        return "hang", silent[0]
    kind = kind_of(first.code)
    return ("crash" if kind == "peer-lost" else kind), first.rank


def replica_suspects(beats: dict[int, dict]) -> list[dict]:
    """The ranks a replica check found at fault ({rank, node}), as the ranks' heartbeats say (watchdog.note)."""
    for b in beats.values():
        found = (b.get("replicas") or {}).get("suspects")
        if found:
            return sorted(found, key=lambda s: s["rank"])
    return []


# ---- one failure -------------------------------------------------------------------------------------------------
def record(
    run_dir: Path | None,
    exits: list[Exit],
    *,
    started: float,
    now: float | None = None,
    restart: int = 0,
    launcher: str = "local",
    node_fault: str = "",
    node: str | None = None,
    consult=None,
    **extra,
) -> dict:
    """The record of a failed start (see the module's doc; the rank at fault: at_fault), appended to the run
    directory's interruptions.jsonl when there is one. `consult(rec)` -> fields added before it is written (the
    replay's verdict and decision: runtime/suspect.py)."""
    now = time.time() if now is None else now
    beats = read_heartbeats(run_dir, since=started) if run_dir else {}
    kind, rank = at_fault(exits, beats)
    code = next((e.code for e in exits if e.rank == rank and not e.killed), None)
    suspects = replica_suspects(beats)
    if suspects and not node_fault:
        node_fault = "replica mismatch: " + ", ".join(f"rank {s['rank']} ({s['node']})" for s in suspects)
        node = node or suspects[0]["node"]
    where = (
        node
        or (beats.get(rank, {}).get("node") if rank is not None else None)
        or next((e.node for e in exits if e.rank == rank), None)
    )
    step = max([b.get("step", 0) for b in beats.values()] + [0])
    committed = committed_step(run_dir) if run_dir else None
    recent = recent_records(run_dir, committed or 0) if run_dir else []
    times = {int(r["step"]): float(r["time"]) for r in recent if r["kind"] == "train"}
    step = max([step, *times])
    # the work lost: from the later of this start's first step (its start-up is goodput's start-up) and the last
    # commit, to the failure; a start that never reached a step lost all of its time
    ready = max(
        [float(r.get("ready", 0)) for r in recent if r["kind"] == "start" and r["time"] >= started - 1] + [started]
    )
    t_commit = times.get(committed, 0.0) if committed is not None else 0.0
    rec = {
        "time": round(now, 3),
        "started": round(started, 3),
        "step": step,
        "committed": committed,
        "kind": "node" if node_fault else kind,
        "rank": rank,
        "node": where,
        "exit_code": code if code is not None and signal_of(code) is None else None,
        "signal": describe(code)[7:] if code is not None and signal_of(code) else None,
        "seconds_lost": round(max(0.0, now - max(ready, t_commit)), 3),
        "restart": restart,
        "launcher": launcher,
        **({"node_fault": node_fault} if node_fault else {}),
        **extra,
    }
    if consult is not None and run_dir is not None:
        rec.update(consult(rec))
    if run_dir is not None:
        append(run_dir, rec)
    return rec


def summary(rec: dict) -> str:
    """One line: what failed, where, at which step."""
    who = f"rank {rec['rank']}" if rec.get("rank") is not None else "a rank"
    where = f" on {rec['node']}" if rec.get("node") else ""
    how = (
        f"signal {rec['signal']}"
        if rec.get("signal")
        else (f"exit code {rec['exit_code']}" if rec.get("exit_code") is not None else "")
    )
    what = {"hang": "hang of", "node": "node fault:", "usage": "error of"}.get(rec["kind"], "crash of")
    fault = f" ({rec['node_fault']})" if rec.get("node_fault") else ""
    committed = rec["committed"] if rec.get("committed") is not None else "none"
    return (
        f"{what} {who}{where}{fault}{f' ({how})' if how and rec['kind'] != 'node' else ''} after step "
        f"{rec['step']} (last committed: {committed}; {rec['seconds_lost']:.1f} s lost)"
    )


def decide(rec: dict, past: list[dict], restarts_left: int) -> tuple[bool, str]:
    """(start again?, why not). `past`: the run's earlier records, oldest first (without `rec`)."""
    if rec["kind"] == "usage":
        return False, USAGE
    same = [r for r in (past + [rec])[-SAME_STEP_LIMIT:] if r.get("kind") not in ("node", "spike")]
    if len(same) == SAME_STEP_LIMIT and all(r.get("step") == rec["step"] for r in same):
        return False, (
            f"failed {SAME_STEP_LIMIT} times in a row after step {rec['step']}: a deterministic failure "
            f"(a bad batch, a NaN that skipping does not cure), not a fault of the machines"
        )
    if restarts_left <= 0:
        return False, "no restarts left"
    return True, ""


# ---- the Slurm batch script's helper -----------------------------------------------------------------------------
def task_exits(folder: Path) -> list[Exit]:
    """launch/slurm/task.sh writes `<folder>/<rank>` = "CODE NODE TIME" when its training process ends."""
    out = []
    for p in sorted(Path(folder).glob("[0-9]*")):
        try:
            code, node, t = p.read_text().split()[:3]
            out.append(Exit(int(p.name), int(code), float(t), node))
        except (OSError, ValueError):
            continue
    return out


def read_run_dir(path: str | None) -> Path | None:
    try:
        text = Path(path).read_text().strip() if path else ""
    except OSError:
        return None
    return Path(text) if text and Path(text).is_dir() else None


def slurm_assignments(a) -> int:
    """What launch/slurm/failure.sh evals (scripts/slurm_failure.py prints it): `a` is that script's arguments."""
    exits = task_exits(Path(a.exits)) if a.exits else []
    run_dir = read_run_dir(a.run_dir_file)
    beats = read_heartbeats(run_dir, since=a.started) if run_dir else {}
    if exits:  # a rank that beat and left no exit was ended by srun (--kill-on-bad-exit)
        t = max(e.time for e in exits)
        exits += [
            Exit(r, -signal.SIGKILL, t, b.get("node"), killed=True)
            for r, b in beats.items()
            if r not in {e.rank for e in exits}
        ]
    if a.what == "culprit":
        _, rank = at_fault(exits, beats)
        node = (beats.get(rank, {}).get("node") if rank is not None else None) or next(
            (e.node for e in exits if e.rank == rank), ""
        )
        suspects = " ".join(dict.fromkeys(str(s["node"]) for s in replica_suspects(beats) if s.get("node")))
        print(
            f"c_rank={shlex.quote('' if rank is None else str(rank))} c_node={shlex.quote(node or '')} "
            f"c_suspects={shlex.quote(suspects)}"
        )
        return 0
    past = history(run_dir) if run_dir else []
    if not exits and a.rc:  # no task said how it ended (a container job, a lost node)
        exits = [Exit(-1, a.rc, time.time())]
    rec = record(
        run_dir,
        exits,
        started=a.started,
        restart=a.restart,
        launcher="slurm",
        node_fault=a.node_fault,
        node=a.node or None,
        job=a.job,
        consult=_consult(run_dir),
    )
    retry, why = decide(rec, past, a.restarts_left)
    replay = rec.get("replay") or {}
    print(
        f"verdict={'retry' if retry else 'stop'} kind={rec['kind']} step={rec['step']} "
        f"replay_decision={shlex.quote(replay.get('decision', ''))} "
        f"replay_verdict={shlex.quote(replay.get('verdict', ''))} "
        f"line={shlex.quote(summary(rec))} why={shlex.quote(why)} "
        f"recorded={shlex.quote(str(Path(run_dir) / RECORDS) if run_dir else '')}"
    )
    return 0


def _consult(run_dir: Path | None):
    """runtime/suspect.py's replay of a node-suspect stop (MEGAMEMO_REPLAY_SUSPECT=1), loaded from beside this file
    (train.sbatch runs this one by path, isolated: no package to import it from)."""
    if run_dir is None:
        return None
    spec = importlib.util.spec_from_file_location("megamemo_suspect", Path(__file__).with_name("suspect.py"))
    assert spec is not None and spec.loader is not None, "suspect.py beside interruptions.py"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731  (failure.sh: to job.txt)
    return lambda rec: {"replay": mod.replay(run_dir, rec, say)} if mod.enabled(rec) else {}
