"""A loss spike rolled back past its data (train.spike.action: rollback; the rule: train/numerics.py SpikeWatch).

Every rank sees the same all-reduced loss, so every rank decides alike, in the same process (no restart):
  1. the spike's step S, its loss and the data position of its batch are recorded: rank 0 appends one line to
     interruptions.jsonl (kind "spike": the step, the loss, the checkpoint rolled back to, the skipped batches, the
     seconds lost, which goodput counts);
  2. every rank resumes from the newest committed checkpoint before S (weights, optimizer, memory, data cursor,
     RNG, the spike window) and metrics.jsonl is cut back to it (the undone steps' records move to
     metrics.rolled_back.jsonl: `megamemo replay --rolled-back` replays that attempt against them);
  3. the steps up to S - 1 run again on their own batches (bit for bit as before); step S then skips
     train.spike.skip_batches batches of every stream, from the spike's batch on.
The skip plan {S: N} is read back from interruptions.jsonl at every start (`skip_plan`), so a restart that resumes a
checkpoint from before the rollback skips the same batches, and `megamemo replay` (which copies the records) too:
the run stays replayable (`--rolled-back` copies only the rollbacks before the one that undid the attempt it
replays). After train.spike.max_rollbacks rollbacks the run stops with one line.
"""

from __future__ import annotations

import time
from pathlib import Path

from megamemo.checkpoint.store import list_checkpoints
from megamemo.runtime.interruptions import append, history, recent_records, restart_count

KIND = "spike"


def spike_records(run_dir: Path) -> list[dict]:
    return [r for r in history(run_dir) if r.get("kind") == KIND]


def skip_plan(run_dir: Path) -> dict[int, int]:
    """{step: batches of every stream skipped as that step takes its batch} from the run's rollbacks."""
    plan: dict[int, int] = {}
    for r in spike_records(run_dir):
        for s in r.get("skipped") or []:
            plan[int(s["step"])] = int(s["batches"])
    return plan


def checkpoint_before(root: Path, step: int) -> Path | None:
    """The newest committed checkpoint of a step before `step`."""
    done = [p for s, p, committed in list_checkpoints(root) if committed and s < step]
    return done[-1] if done else None


def seconds_since(run_dir: Path, step: int, now: float) -> float:
    """The time since step `step` was applied (the work a rollback to it loses), from metrics.jsonl."""
    times = [float(r["time"]) for r in recent_records(run_dir, step) if r["kind"] == "train" and r["step"] == step]
    return max(0.0, now - times[-1]) if times else 0.0


def record(run_dir: Path, step: int, loss: float, why: str, back_to: int, position: dict, batches: int) -> dict:
    """Rank 0: the rollback's line in interruptions.jsonl."""
    now = time.time()
    rec = {
        "time": round(now, 3),
        "started": round(now, 3),
        "step": step,
        "committed": back_to,
        "kind": KIND,
        "rank": None,
        "node": None,
        "exit_code": None,
        "signal": None,
        "seconds_lost": round(seconds_since(run_dir, back_to, now), 3),
        "restart": restart_count(),
        "launcher": "in-process",
        "loss": loss,
        "why": why,
        "rollback_to": back_to,
        "skipped": [{"step": step, "batches": batches, "from": {k: position.get(k) for k in ("epoch", "step")}}],
    }
    append(run_dir, rec)
    return rec


def describe(rec: dict, n: int, limit: int) -> str:
    s = rec["skipped"][0]
    return (
        f"[spike] step {rec['step']}: {rec['why']}; rolled back to step {rec['rollback_to']} "
        f"({rec['seconds_lost']:.1f} s lost), skipping {s['batches']} batches of every stream from the spike's "
        f"(epoch {s['from']['epoch']}, batch {s['from']['step']}); rollback {n}/{limit}"
    )


def roll_back(trainer, step: int, loss: float, why: str, stop: type[Exception]) -> None:
    """The loop's answer to a spike at `step` (the module's doc); `stop`: the error that ends the run."""
    spike = trainer.cfg.train.spike
    if spike.action == "stop":
        raise stop(f"step {step}: loss spike: {why} (train.spike.action=stop)")
    if trainer.rollbacks >= spike.max_rollbacks:
        raise stop(
            f"step {step}: loss spike: {why}; {trainer.rollbacks} rollbacks already in this run "
            f"(train.spike.max_rollbacks={spike.max_rollbacks}): stopping"
        )
    trainer._finish_saves()
    back = checkpoint_before(trainer.store.root, step) if trainer.store is not None else None
    if back is None:
        raise stop(f"step {step}: loss spike: {why}; no committed checkpoint before it to roll back to")
    trainer.rollbacks += 1
    trainer.skips[step] = spike.skip_batches
    if trainer.rank == 0:
        rec = record(
            Path(trainer.cfg.train.run_dir), step, loss, why, int(back.name[5:]), trainer._position, spike.skip_batches
        )
        print(describe(rec, trainer.rollbacks, spike.max_rollbacks), flush=True)
    trainer.resume(back)
    trainer._held, trainer._agreed = None, None
    trainer.metrics.rolled_back(trainer.counters.step, step)
