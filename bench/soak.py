"""Kill-and-requeue soak: a job killed with -9 at random moments (seeded), restarted each time with the same command as
Slurm's requeue does, must end as if it had never been interrupted.

    python bench/soak.py [--kills 100] [--seed N] [--minutes 15] [--world 2] [--steps S] [--out runs/soak]
                         [--config FILE --data SHARDS]     (default: the tests' tiny config on the enwik8 fixture)

1. An uninterrupted run (`python -m megamemo.runtime.launcher N` = launch/local.sh without its shell) gives every step's loss.
2. The same command under a supervisor, checkpointing every step with asynchronous saves on (keep_last 2, so that
   retention removes checkpoints all the time). Each round draws a moment from the seeded generator, always a point
   of the program and a count, never a time (megamemo/checkpoint/faults.py), so a seed replays the same kills on
   any host under any load:
     start-up    a rank drawn at random stops itself (SIGSTOP) when built and resumed, before its first step; then
                 kill -9 of the launcher and every worker;
     step        the same in the middle of the (N+1)-th new step, N drawn from 1-2 (its forward, backward and
                 optimizer step done, the step not yet committed; a background save is often in flight);
     save / commit / retention / removal
                 a rank SIGKILLs itself at that point of the checkpoint protocol, the N-th time it gets there
                 (the windows are milliseconds long, a kill from outside would land there only by luck); the
                 launcher then kills the other ranks.
   The killed workers are orphans of this process (a child subreaper, as a container's init is) and are reaped
   only after the restart has ended, so each restart meets its predecessor's zombies (rank 0 among them, named in
   the LOCK), as under a PID 1 that never reaps. A restart must train again: resume from the newest committed checkpoint (or start afresh when none was
   committed yet); one that is refused counts as a failed restart.
3. After the last kill (or when --minutes are used up) the job runs to the end; every step's loss must equal the
   uninterrupted run's bit for bit, each step logged once.

Prints one line per kill and a summary; writes OUT/summary.json. Exit 0 when every restart resumed and every loss
is equal. Run it under `flock /tmp/megamemo-cpu.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import ctypes
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


def job_command(world: int, cfg: Path, shards: Path, run_dir: Path, steps: int, keep_last: int = 2) -> list[str]:
    return [sys.executable, "-m", "megamemo.runtime.launcher", str(world), "--config", str(cfg), "--data", str(shards),
            "--run-dir", str(run_dir), "--max-steps", str(steps), "--save-every", "1",
            "--set", f"checkpoint.keep_last={keep_last}", "--set", "checkpoint.async_save=true",
            "--set", "checkpoint.probe=false", "--set", "log.tensorboard=false"]


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


def subreaper(on: bool) -> None:
    """Orphaned workers become this process's children (PR_SET_CHILD_SUBREAPER), as they would be PID 1's."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)


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
            self.p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                      start_new_session=True)
        self.t0, self.t_wall = time.monotonic(), time.time()
        self.workers: list[int] = []

    def alive(self) -> bool:
        if self.p.poll() is None:
            self.workers = sorted(set(self.workers) | set(children(self.p.pid)))
            return True
        return False

    def stopped(self) -> bool:
        """Wait until a worker has stopped itself at its fault point (True) or the job has ended (False)."""
        while self.alive():
            if any(state(w) == "T" for w in self.workers):
                return True
            time.sleep(0.01)
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
            raise AssertionError(f"the job did not end within {timeout:.0f}s: {' '.join(self.p.args)}")
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


def soak(cfg: Path, shards: Path, out: Path, *, kills: int, seed: int, steps: int, world: int = 2,
         minutes: float = 15.0, kinds: tuple[str, ...] | None = None, reference: dict[int, float] | None = None,
         keep_last: int = 2, finish: bool = True, nth: tuple[int, int] = (1, 2), say=print) -> dict:
    """Run the soak (see the module's doc); returns the summary. `kinds`: the moments in this order (cycled) instead
    of drawn at random; `reference`: the uninterrupted run's losses when the caller has them; `finish=False` leaves
    the last run to the caller (the test damages checkpoints first); `nth`: the range the N of a kill is drawn from
    (the N-th new step, or the N-th pass of a checkpoint point): from 2 up, every start commits a step before it is
    killed."""
    subreaper(True)
    try:
        return _soak(cfg, shards, out, kills=kills, seed=seed, steps=steps, world=world, minutes=minutes, kinds=kinds,
                     reference=reference, keep_last=keep_last, finish=finish, nth=nth, say=say)
    finally:
        subreaper(False)


def _soak(cfg, shards, out, *, kills, seed, steps, world, minutes, kinds, reference, keep_last, finish, nth,
          say) -> dict:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    if reference is None:
        ref_dir = out / "reference"
        shutil.rmtree(ref_dir, ignore_errors=True)
        job = Job(job_command(world, cfg, shards, ref_dir, steps, keep_last), job_env(), out / "reference.log")
        assert job.end(900) == 0, _text(out / "reference.log", 0)[-3000:]
        job.reap()
        reference = losses(ref_dir)
    run_dir, log = out / "run", out / "run.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    log.write_text("")
    cmd = job_command(world, cfg, shards, run_dir, steps, keep_last)
    records, resumed, refused = [], 0, []
    previous: Job | None = None
    deadline = t_start + minutes * 60
    for i in range(kills):
        if time.monotonic() > deadline:
            say(f"[soak] {minutes:g} min used up after {i} kills")
            break
        kind = (kinds[i % len(kinds)] if kinds else rng.choice(KINDS))
        env = job_env()
        nth_here = rng.randint(*nth)
        if kind in ("save", "commit", "retention", "removal"):
            env["MEGAMEMO_FAULT_KILL_AT"] = f"{kind}:{nth_here}"
        else:                       # a rank stops at the point, then the whole job is killed from outside
            rank = rng.randrange(world)
            point = "start-up:1" if kind == "start-up" else f"step:{nth_here + 1}"
            env["MEGAMEMO_FAULT_STOP_AT"] = f"{point}:{rank}"
        had = committed(run_dir)
        log_at = log.stat().st_size
        job = Job(cmd, env, log)
        where = kind
        if kind in ("start-up", "step") and job.stopped():
            job.kill9()
        rc = job.end(600)
        if previous is not None:
            previous.reap()         # the previous job's zombies lived through this whole restart
        text = _text(log, log_at)
        started = "fresh start" in text or "resuming at step" in text
        if i > 0:                   # a restart: refused (the lock, a checkpoint), or not training, is a failure
            ok = rc != 2 and "another trainer is running" not in text and (started or kind == "start-up")
            resumed += ok
            if not ok:
                refused.append(i + 1)
        if rc == 0 and "[fault]" not in text:
            where = f"none ({kind} #{nth_here} never reached: the run ended)"
        rec = {"kill": i + 1, "kind": kind, "where": where, "rc": rc, "committed_before": had[-1] if had else None,
               "steps_logged": len(train_records(run_dir)), "restart_trained": started,
               "log": "\n".join(x for x in text.splitlines() if "terminate called" in x or "[launch]" in x)}
        records.append(rec)
        this = "trained" if started else ("was killed in start-up" if kind == "start-up" else "DID NOT TRAIN")
        say(f"[soak] kill {i + 1}: {where} (exit {rc}); this start {this}; newest committed "
            f"{committed(run_dir)[-1:] or 'none'}")
        previous = job
        if rc == 0:
            break                   # the run reached its end between kills: no more to kill
    summary = {"seed": seed, "world": world, "steps": steps, "kills": len(records),
               "aborts": sum("terminate called" in r.get("log", "") for r in records),
               "by_kind": {k: sum(r["where"] == k for r in records) for k in KINDS},
               "restarts": max(0, len(records) - 1) + (1 if finish else 0), "records": records}
    if not finish:
        if previous is not None:
            previous.reap()
        summary["restarts_trained"] = resumed
        summary["refused"] = refused
        return summary
    log_at = log.stat().st_size
    last = Job(cmd, job_env(), log)
    rc = last.end(900)
    last.reap()
    if previous is not None:
        previous.reap()
    text = _text(log, log_at)
    resumed += ("resuming at step" in text or "fresh start" in text) and "another trainer is running" not in text
    got = losses(run_dir)
    differ = sorted(s for s in reference if got.get(s) != reference[s])
    summary.update(final_rc=rc, restarts_trained=resumed, refused=refused, steps_compared=len(reference),
                   steps_differing=differ, extra_steps=sorted(set(got) - set(reference)),
                   seconds=round(time.monotonic() - t_start, 1))
    summary["ok"] = (rc == 0 and not differ and not summary["extra_steps"] and
                     resumed == summary["restarts"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    say(f"[soak] {summary['kills']} kills ({', '.join(f'{k} {v}' for k, v in summary['by_kind'].items())}); "
        f"{resumed}/{summary['restarts']} restarts trained; {len(reference) - len(differ)}/{len(reference)} steps' "
        f"losses bit-equal to the uninterrupted run; {summary['aborts']} surviving ranks aborted (SIGABRT) when a "
        f"peer was killed; {summary['seconds']:.0f}s; seed {seed}")
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
            from fixture_data import ENWIK8

            from data_pipeline.cli import prepare_main
            shutil.rmtree(data, ignore_errors=True)
            assert prepare_main(["enwik8", "--raw", str(ENWIK8), "--out", str(data), "--quiet"]) == 0
    summary = soak(cfg, data, a.out, kills=a.kills, seed=seed, steps=a.steps or 2 * a.kills + 10, world=a.world,
                   minutes=a.minutes)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
