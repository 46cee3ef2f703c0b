"""Kill-and-restart soak: a job whose ranks are killed with -9 at random moments (seeded) and which restarts itself
each time (launch/local.sh --max-restarts, megamemo/runtime/launcher.py) must end as if it had never been interrupted.

    python bench/soak.py [--kills 100] [--seed N] [--minutes 15] [--world 2] [--steps S] [--out runs/soak]
                         [--config FILE --data SHARDS]     (default: the tests' tiny config on the enwik8 fixture)

1. An uninterrupted run (`python -m megamemo.commands.launch N` = launch/local.sh without its shell) gives every
   step's loss.
2. The same command with `--max-restarts K` (K = the kills), checkpointing every step with asynchronous saves on
   (keep_last 2, so that retention removes checkpoints all the time). Each start of the job is one round; the round
   draws a moment from the seeded generator:
     start-up    a rank (drawn) SIGKILLs itself when built and resumed, before its first step;
     step        a rank (drawn) SIGKILLs itself in the middle of the (N+1)-th new step, N drawn from 1-2 (its
                 forward, backward and optimizer step done, the step not yet committed; a background save is
                 often in flight);
     save / commit / retention / removal
                 a rank SIGKILLs itself at that point of the checkpoint protocol, the N-th time it gets there in
                 that start (the windows are milliseconds long, a kill from outside would land there only by luck).
   Every kill is a point of the program and a count, never a time (megamemo/checkpoint/faults.py; the whole plan
   is one MEGAMEMO_FAULT_KILL_AT "POINT:N[:RANK]@START,..." for the job's starts), so a seed replays the same kills
   on any host under any load.
   The launcher kills the other ranks, records the interruption and starts the job again by itself. A restart must
   train again: resume from the newest committed checkpoint (or start afresh when none was committed yet); one
   that is refused counts as a failed restart.
3. After the last kill (or when --minutes are used up) the job runs to the end; every step's loss must equal the
   uninterrupted run's bit for bit, each step logged once. The run's goodput (megamemo/runtime/goodput.py) and its
   interruption records are reported.

Prints one line per kill and a summary; writes OUT/summary.json. Exit 0 when every restart resumed and every loss
is equal. Run it under `flock /tmp/megamemo-cpu.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("start-up", "step", "save", "commit", "retention", "removal")
TINY = """
model: {variant: lamemo, n_token: 256, n_layer: 2, d_model: 32, n_head: 2, d_head: 16, d_inner: 64,
        dropout: 0.1, dropatt: 0.0, tgt_len: 16, mem_len: 16}
data: {batch_size: 4, roll: true}
optim: {lr: 2.0e-3, clip: 0.25, warmup_steps: 2}
precision: {dtype: fp32}
parallel: {zero_stage: 1}
log: {every: 1, tensorboard: false}
"""


def job_command(
    world: int, cfg: Path, shards: Path, run_dir: Path, steps: int, keep_last: int = 2, max_restarts: int = 0
) -> list[str]:
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [
        sys.executable,
        "-m",
        "megamemo.commands.launch",
        *restarts,
        str(world),
        "--config",
        str(cfg),
        "--data",
        str(shards),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(steps),
        "--save-every",
        "1",
        "--set",
        f"checkpoint.keep_last={keep_last}",
        "--set",
        "checkpoint.async_save=true",
        "--set",
        "checkpoint.probe=false",
        "--set",
        "log.tensorboard=false",
    ]


def job_env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra)


def train_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            rec = json.loads(line)
            if rec.get("kind") == "train":
                out.append(rec)
    return out


def new_steps(run_dir: Path, since: float) -> int:
    """Steps logged at or after wall-clock time `since` (a restart trims what it redoes, so counting lines would
    not do)."""
    return sum(r["time"] >= since for r in train_records(run_dir))


def losses(run_dir: Path) -> dict[int, float]:
    """Every step's loss; a step logged twice is an error (a restart must trim what it redoes)."""
    out: dict[int, float] = {}
    for rec in train_records(run_dir):
        if rec["step"] in out:
            raise AssertionError(f"{run_dir}: step {rec['step']} logged twice")
        out[rec["step"]] = rec["loss"]
    return out


def committed(run_dir: Path) -> list[int]:
    from megamemo.checkpoint.store import list_checkpoints

    return [s for s, _, c in list_checkpoints(Path(run_dir) / "checkpoints") if c]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Job:
    """One start of the job: the launcher in a session of its own, its output appended to `log`."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log = log
        with open(log, "a") as f:
            self.p = subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        self.t0, self.t_wall = time.monotonic(), time.time()
        self.workers: list[int] = []

    def alive(self) -> bool:
        if self.p.poll() is None:
            self.workers = sorted(set(self.workers) | set(children(self.p.pid)))
            return True
        return False

    def kill9(self) -> None:
        """kill -9 of every process of the job (workers first: the launcher would otherwise kill them itself)."""
        self.alive()
        for pid in self.workers + [self.p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def end(self, timeout: float) -> int:
        """Wait for the launcher, then until no worker runs (zombies left as they are: see reap)."""
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            rc = self.p.wait(30)
            raise AssertionError(f"the job did not end within {timeout:.0f}s: {' '.join(self.p.args)}") from None
        deadline = time.monotonic() + 60
        while any(state(w) not in (None, "Z", "X") for w in self.workers):
            if time.monotonic() > deadline:
                for w in self.workers:
                    try:
                        os.kill(w, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.02)
        return rc

    def kill_rank(self, rank: int, start: int, timeout: float = 120) -> None:
        """kill -9 of the worker of `rank` in the job's start number `start` (MEGAMEMO_RESTART), once it exists; the
        launcher then stops the others and starts the job again."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            for w in children(self.p.pid):
                try:
                    env = Path(f"/proc/{w}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in env and f"MEGAMEMO_RESTART={start}".encode() in env:
                    try:
                        os.kill(w, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
            time.sleep(0.01)

    def wait_for_start(self, start: int, timeout: float) -> int | None:
        """Wait for the launcher's line announcing restart number `start` -> the log offset after it; None when the
        job ended instead."""
        line = f"[launch] restart {start}/".encode()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self.log.read_bytes()
            k = data.find(line)
            if k >= 0:
                end = data.find(b"\n", k)
                if end >= 0:
                    return end + 1
            if self.p.poll() is not None:
                return None
            time.sleep(0.02)
        self.kill9()
        raise AssertionError(f"the job did not restart nor end within {timeout:.0f}s")

    def reap(self) -> None:
        for w in self.workers:
            try:
                os.waitpid(w, os.WNOHANG)
            except ChildProcessError:
                pass


def _text(log: Path, start: int) -> str:
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def soak(
    cfg: Path,
    shards: Path,
    out: Path,
    *,
    kills: int,
    seed: int,
    steps: int,
    world: int = 2,
    minutes: float = 15.0,
    kinds: tuple[str, ...] | None = None,
    reference: dict[int, float] | None = None,
    keep_last: int = 2,
    finish: bool = True,
    nth: tuple[int, int] = (1, 2),
    say=print,
) -> dict:
    """Run the soak (see the module's doc); returns the summary. `kinds`: the moments in this order (cycled) instead
    of drawn at random; `reference`: the uninterrupted run's losses when the caller has them; `finish=False` leaves
    the last run to the caller (the job gets one restart fewer than kills and ends after the last; the test damages
    checkpoints first); `nth`: the range the N of a kill is drawn from (the N-th new step, or the N-th pass of a
    checkpoint point): from 2 up, every start commits a step before it is killed."""
    from megamemo.runtime import goodput
    from megamemo.runtime.interruptions import history

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    if reference is None:
        ref_dir = out / "reference"
        shutil.rmtree(ref_dir, ignore_errors=True)
        job = Job(job_command(world, cfg, shards, ref_dir, steps, keep_last), job_env(), out / "reference.log")
        assert job.end(900) == 0, _text(out / "reference.log", 0)[-3000:]
        reference = losses(ref_dir)
    run_dir, log = out / "run", out / "run.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    log.write_text("")
    # the rounds, drawn first: the in-process kills are a plan for the job's starts (MEGAMEMO_FAULT_KILL_AT)
    rounds = []
    for i in range(kills):
        kind = kinds[i % len(kinds)] if kinds else rng.choice(KINDS)
        rounds.append((kind, rng.randint(*nth), rng.randrange(world)))
    point = {"start-up": lambda n, r: f"start-up:1:{r}", "step": lambda n, r: f"step:{n + 1}:{r}"}
    plan = ",".join(point.get(k, lambda n, r, k=k: f"{k}:{n}")(n, r) + f"@{i}" for i, (k, n, r) in enumerate(rounds))
    cmd = job_command(world, cfg, shards, run_dir, steps, keep_last, max_restarts=kills if finish else kills - 1)
    job = Job(cmd, job_env(**({"MEGAMEMO_FAULT_KILL_AT": plan} if plan else {})), log)
    records, resumed, refused = [], 0, []
    deadline = t_start + minutes * 60
    at = 0  # this start's first byte in the log
    for i, (kind, nth_here, _rank) in enumerate(rounds):
        if time.monotonic() > deadline:
            say(f"[soak] {minutes:g} min used up after {i} kills")
            break
        had = committed(run_dir)
        where = kind
        nxt = job.wait_for_start(i + 1, 600)  # the launcher's restart, or the job's end
        text = _text(log, at)[: None if nxt is None else nxt - at]
        rc = job.p.returncode if nxt is None else None
        started = "fresh start" in text or "resuming at step" in text
        if i > 0:  # a restart: refused (the lock, a checkpoint), or not training, is a failure
            ok = "another trainer is running" not in text and (started or kind == "start-up")
            resumed += ok
            if not ok:
                refused.append(i + 1)
        if nxt is None and rc == 0 and "[fault]" not in text:
            where = f"none ({kind} #{nth_here} never reached: the run ended)"
        rec = {
            "kill": i + 1,
            "kind": kind,
            "where": where,
            "rc": rc,
            "committed_before": had[-1] if had else None,
            "steps_logged": len(train_records(run_dir)),
            "restart_trained": started,
            "log": "\n".join(x for x in text.splitlines() if "terminate called" in x or "[launch]" in x),
        }
        records.append(rec)
        this = "trained" if started else ("was killed in start-up" if kind == "start-up" else "DID NOT TRAIN")
        say(f"[soak] kill {i + 1}: {where}; this start {this}; newest committed {committed(run_dir)[-1:] or 'none'}")
        if nxt is None:
            break  # the job ended: the run reached its end between kills, or no restart was left
        at = nxt
    summary = {
        "seed": seed,
        "world": world,
        "steps": steps,
        "kills": len(records),
        "aborts": sum("terminate called" in r.get("log", "") for r in records),
        "by_kind": {k: sum(r["where"] == k for r in records) for k in KINDS},
        "restarts": max(0, len(records) - 1) + (1 if finish else 0),
        "records": records,
    }
    rc = job.end(900)
    summary["restarts_trained"], summary["refused"] = resumed, refused
    summary["interruptions"] = history(run_dir)
    g = goodput.of_run(run_dir)
    summary["goodput"] = g
    if not finish:
        return summary
    text = _text(log, at)
    resumed += ("resuming at step" in text or "fresh start" in text) and "another trainer is running" not in text
    got = losses(run_dir)
    differ = sorted(s for s in reference if got.get(s) != reference[s])
    summary.update(
        final_rc=rc,
        restarts_trained=resumed,
        refused=refused,
        steps_compared=len(reference),
        steps_differing=differ,
        extra_steps=sorted(set(got) - set(reference)),
        seconds=round(time.monotonic() - t_start, 1),
    )
    summary["ok"] = rc == 0 and not differ and not summary["extra_steps"] and resumed == summary["restarts"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    say(
        f"[soak] {summary['kills']} kills ({', '.join(f'{k} {v}' for k, v in summary['by_kind'].items())}); "
        f"{resumed}/{summary['restarts']} restarts trained; {len(reference) - len(differ)}/{len(reference)} steps' "
        f"losses bit-equal to the uninterrupted run; {summary['aborts']} surviving ranks aborted (SIGABRT) when a "
        f"peer was killed; {len(summary['interruptions'])} interruptions recorded; {summary['seconds']:.0f}s; "
        f"seed {seed}"
    )
    if g is not None:
        say(f"[soak] {goodput.describe(g)}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    p.add_argument("--minutes", type=float, default=15.0, help="stop killing after this long (then finish the run)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="default: 2 x kills + 10")
    p.add_argument("--config", type=Path)
    p.add_argument("--data", type=Path)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "soak")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else time.time_ns() % 100_000
    print(f"[soak] seed {seed} (replay with --seed {seed})", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    cfg, data = a.config, a.data
    if cfg is None:
        cfg = a.out / "tiny.yaml"
        cfg.write_text(TINY)
    if data is None:
        data = a.out / "shards"
        if not (data / "manifest.json").exists():
            sys.path.insert(0, str(REPO / "tests"))
            from helpers.fixture_data import ENWIK8

            from megamemo.data.cli import prepare_main

            shutil.rmtree(data, ignore_errors=True)
            assert prepare_main(["enwik8", "--raw", str(ENWIK8), "--out", str(data), "--quiet"]) == 0
    summary = soak(
        cfg, data, a.out, kills=a.kills, seed=seed, steps=a.steps or 2 * a.kills + 10, world=a.world, minutes=a.minutes
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
