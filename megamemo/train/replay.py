"""`megamemo replay --ckpt RUN_DIR --step S`: recompute a run's steps from its newest checkpoint before S up to S and
compare them with what the run recorded: "was it the data or the device?" answered by recomputation.

The replay is a training run of its own, started through the launcher (runtime/launcher.py) in a temporary run
directory: the run's resolved config (RUN_DIR/config.yaml), resumed from that checkpoint (any layout reads it), to
step S, saved there, with nothing else (no probe, no validation, no spike rule, no injected faults but a bad batch's:
a fault of the data, which the replay reads again). The run's rollbacks (interruptions.jsonl, kind spike) are copied,
so it skips the batches the run skipped. By default it runs in one process whatever the run's layout; `--tp/--pp/--dp`
choose one. Then, per replayed step, the loss, gradient norm and LR against RUN_DIR/metrics.jsonl, and where S is a
checkpoint step of the run, every tensor its checkpoint holds (weights, fp32 masters, Adam's moments, memory) against
the replay's, read whole under either layout.

`--rolled-back` replays the attempt at S that a loss spike's rollback undid (the spike itself, as it first happened):
only the rollbacks before that one are copied (its batches as that attempt took them, the spike's unskipped), and
the steps are compared with that attempt's records, which the rollback moved to RUN_DIR/metrics.rolled_back.jsonl.
Identical: the spike comes from the data (or the numerics), and a rollback past it is the answer; differs: the
process or device that trained it.

Verdict, one line:
  replay: identical                      every number bit for bit (the run's own layout)
  replay: within <tolerance>             under another layout, whose reductions add in another order (see tolerance)
  replay: differs at step N: <what>      the first step, and the first number, that does not match
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from megamemo.checkpoint.index import open_reader
from megamemo.checkpoint.layout import RunLayout
from megamemo.checkpoint.store import tag_for
from megamemo.train.metrics import ROLLED_BACK, rolled_back_steps
from megamemo.train.rollback import KIND, checkpoint_before, spike_records
from megamemo.util.errors import MegamemoError

DATA_FAULT = "MEGAMEMO_FAULT_BAD_BATCH"  # an injected fault of the data (checkpoint/faults.py)
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}


class ReplayError(MegamemoError, ValueError):
    """A replay that cannot be made (no such step, no checkpoint before it); the message says why."""


@dataclass
class Plan:
    run_dir: Path
    step: int
    start: Path  # the checkpoint the replay resumes
    config: dict  # the run's resolved config
    layout: tuple[int, int, int]  # (dp, tp, pp) of the replay
    same_layout: bool
    recorded: dict[int, dict]  # {step: the run's "train" record} of the attempt replayed
    spikes: list[dict]  # the run's rollbacks that attempt had behind it (its skipped batches)
    rolled_back: bool = False  # an attempt a rollback undid (metrics.rolled_back.jsonl), not metrics.jsonl's


def plan(
    ckpt: str | Path, step: int, dp: int | None, tp: int | None, pp: int | None, rolled_back: bool = False
) -> Plan:
    run_dir = Path(ckpt)
    if run_dir.parent.name == "checkpoints":  # a step directory given: its run
        run_dir = run_dir.parent.parent
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ReplayError(f"--ckpt {ckpt}: no config.yaml in {run_dir} (not a run directory)")
    config = yaml.safe_load(cfg_path.read_text())
    recorded, spikes = attempt(run_dir, step, rolled_back)
    start = checkpoint_before(run_dir / "checkpoints", step)
    if start is None:
        raise ReplayError(f"--step {step}: no committed checkpoint before it in {run_dir / 'checkpoints'}")
    marker = json.loads((start / "COMMITTED").read_text())
    was = RunLayout.from_record(marker.get("layout"))
    run = (was.dp or 1, was.tp or 1, was.pp or 1)
    layout = (dp or 1, tp or 1, pp or 1)
    return Plan(run_dir, step, start, config, layout, layout == run, recorded, spikes, rolled_back)


def attempt(run_dir: Path, step: int, rolled_back: bool) -> tuple[dict[int, dict], list[dict]]:
    """(the records to compare with, the rollbacks before them) of the attempt at `step` replayed: the run's as it
    stands (metrics.jsonl, every rollback), or with `rolled_back` the newest one that a rollback undid past `step`
    (metrics.rolled_back.jsonl, the rollbacks before that one: its batches as that attempt took them)."""
    spikes = spike_records(run_dir)
    if not rolled_back:
        recorded = recorded_steps(run_dir)
        if step not in recorded:
            raise ReplayError(f"--step {step}: {Path(run_dir) / 'metrics.jsonl'} records no such step")
        return recorded, spikes
    undid = [i for i, r in enumerate(spikes) if int(r["rollback_to"]) < step <= int(r["step"])]
    if not undid:
        raise ReplayError(
            f"--step {step} --rolled-back: no rollback in {Path(run_dir) / 'interruptions.jsonl'} undid it"
        )
    i = undid[-1]
    recorded = rolled_back_steps(run_dir, int(spikes[i]["step"]))
    if step not in recorded:
        raise ReplayError(f"--step {step} --rolled-back: {Path(run_dir) / ROLLED_BACK} keeps no record of it")
    return recorded, spikes[:i]


def recorded_steps(run_dir: Path) -> dict[int, dict]:
    out = {}
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "train":
            out[int(rec["step"])] = rec
    return out


def run_threads(run_dir: Path) -> int | None:
    """The intra-op threads of the run's newest start (its "start" record in metrics.jsonl), if it says."""
    path = Path(run_dir) / "metrics.jsonl"
    starts = [json.loads(line) for line in path.read_text().splitlines() if '"kind": "start"' in line]
    return int(starts[-1]["threads"]) if starts and "threads" in starts[-1] else None


def run_replay(p: Plan, work: Path, log) -> Path:
    """Train the replay in `work`/run through the launcher -> its run directory."""
    out = work / "run"
    out.mkdir(parents=True)
    with open(out / "interruptions.jsonl", "w") as f:  # the run's rollbacks: the same batches skipped
        for rec in p.spikes:
            f.write(json.dumps({**rec, "kind": KIND}) + "\n")
    dp, tp, pp = p.layout
    sets = {
        "checkpoint.save_every": 0,
        "checkpoint.save_at_end": True,
        "checkpoint.probe": False,
        "checkpoint.async_save": False,
        "checkpoint.resume": str(p.start),
        "eval.every": 0,
        "log.tensorboard": False,
        "train.max_steps": p.step,
        "train.run_dir": str(out),
        "optim.decay_steps": p.config["optim"].get("decay_steps") or p.config["train"]["max_steps"],  # the LR
        "train.spike": {"rule": "off"},
        "parallel.tp": tp,
        "parallel.pp": pp,
    }
    args = [str(dp * tp * pp), "--config", str(p.run_dir / "config.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={json.dumps(v)}"]
    env = {
        k: v
        for k, v in os.environ.items()  # a bad batch stays: a fault of the data, which a replay reads too
        if k not in ("MEGAMEMO_RESTART",) and (k == DATA_FAULT or not k.startswith("MEGAMEMO_FAULT_"))
    }
    if run_threads(p.run_dir):  # a CPU kernel's sums split by its threads: as many as the run's
        env["OMP_NUM_THREADS"] = str(run_threads(p.run_dir))
    log(
        f"[replay] steps {int(p.start.name[5:]) + 1}..{p.step} of {p.run_dir} from {p.start}, in {dp * tp * pp} "
        f"process(es) (dp {dp}, tp {tp}, pp {pp}; {'the run' if p.same_layout else 'not the run'}'s layout)"
    )
    with open(work / "replay.log", "w") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "megamemo.commands.launch", *args], env=env, stdout=f, stderr=subprocess.STDOUT
        )
    if rc != 0:
        tail = (work / "replay.log").read_text().splitlines()[-15:]
        raise ReplayError(f"the replay's training failed with exit code {rc}:\n" + "\n".join(tail))
    return out


def tolerance(p: Plan, steps: int) -> tuple[float, str]:
    """The relative difference another layout may make, and how it is derived. A sum of n terms in another order
    differs by at most (n - 1) u sum|x| (u: the unit roundoff of the precision). Each step's loss sums the global
    batch's tokens and its gradient sums them too, and every replayed step starts from weights that carry the earlier
    steps' differences: so n = the tokens of a step, times the steps replayed."""
    c = p.config
    u = UNIT_ROUNDOFF[c["precision"]["dtype"]]
    tokens = int(c["data"]["batch_size"]) * int(c["model"]["tgt_len"])
    tol = steps * tokens * u
    return tol, f"{tol:.1e} relative = {steps} steps x {tokens} tokens x u {u:.1e}"


def compare_steps(run: dict[int, dict], replayed: dict[int, dict], steps: range, tol: float | None):
    """(first difference or None, largest relative difference) over the steps' losses, gradient norms and LRs (a
    step's loss and gradient norm come before its update: only its LR shows the schedule at the last step)."""
    worst = 0.0
    for s in steps:
        if s not in replayed:
            return f"step {s} was not replayed", worst
        for key in ("loss", "grad_norm", "lr"):  # the LR: the schedule's, seen at the replay's last step too
            a, b = run[s].get(key), replayed[s].get(key)
            d = _relative(a, b)
            worst = max(worst, d)
            if (tol is None and a != b) or (tol is not None and not d <= tol):
                return f"step {s}: {key} {b!r} replayed, {a!r} recorded (relative difference {d:.2e})", worst
    return None, worst


def compare_checkpoints(run_ckpt: Path, replay_ckpt: Path, tol: float | None):
    """(first difference or None, largest relative difference, tensors compared) over the tensors both hold."""
    a, b = open_reader(run_ckpt), open_reader(replay_ckpt)
    names = [n for n in a.names() if n in b]
    worst = 0.0
    for name in names:
        x, y = a.read(name).double(), b.read(name).double()
        if x.shape != y.shape:
            return f"{name}: shape {list(y.shape)} replayed, {list(x.shape)} in the checkpoint", worst, len(names)
        if tol is None:
            if not x.equal(y):
                return f"{name} differs from the checkpoint's ({int((x != y).sum())} elements)", worst, len(names)
            continue
        d = float((x - y).abs().max() / x.abs().max().clamp_min(1e-30)) if x.numel() else 0.0
        worst = max(worst, d)
        if not d <= tol:
            return f"{name}: largest difference {d:.2e} of its largest value", worst, len(names)
    return None, worst, len(names)


def _relative(a, b) -> float:
    if a == b:
        return 0.0
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), 1e-30)


@dataclass(frozen=True)
class Request:
    """What `megamemo replay` asks of a run: each field is one of its flags (megamemo/commands/replay.py makes them
    from these fields, their comments the flags' help)."""

    step: int  # the step to replay up to
    dp: int | None = None  # replay under this dp size (default 1: one process)
    tp: int | None = None  # replay under this tp size (default 1: one process)
    pp: int | None = None  # replay under this pp size (default 1: one process)
    # replay the attempt at S that a loss spike's rollback undid, against its records (metrics.rolled_back.jsonl),
    # its skipped batches unskipped
    rolled_back: bool = False
    keep: bool = False  # keep the replay's run directory (its path is said)


def replay(ckpt, request: Request, log=print) -> str:
    """The replay's verdict line (the module's doc)."""
    step = request.step
    p = plan(ckpt, step, request.dp, request.tp, request.pp, request.rolled_back)
    work = Path(tempfile.mkdtemp(prefix="megamemo-replay-"))
    try:
        out = run_replay(p, work, log)
        first = int(p.start.name[5:]) + 1
        steps = range(first, step + 1)
        tol, why = (None, "") if p.same_layout else tolerance(p, len(steps))
        diff, worst = compare_steps(p.recorded, recorded_steps(out), steps, tol)
        if diff is not None:
            return f"replay: differs at step {diff}" if not diff.startswith("step ") else f"replay: differs at {diff}"
        at = p.run_dir / "checkpoints" / tag_for(step)
        if (at / "COMMITTED").is_file() and not p.rolled_back:  # (a checkpoint of the attempt that stood)
            diff, w, n = compare_checkpoints(at, out / "checkpoints" / at.name, tol)
            worst = max(worst, w)
            if diff is not None:
                return f"replay: differs at step {step}: {diff}"
            log(f"[replay] step {step}'s checkpoint: {n} tensors compared")
        return "replay: identical" if tol is None else f"replay: within {why} (largest: {worst:.1e})"
    finally:
        if request.keep:
            log(f"[replay] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
