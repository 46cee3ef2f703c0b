"""The supervisor's decision by replay (opt-in: MEGAMEMO_REPLAY_SUSPECT=1): before it restarts a run that stopped as
node-suspect (exit 5: the data-parallel replicas disagreed after step S, runtime/interruptions.py kind "node"), or
looks at a spike's rollback (kind "spike"), it recomputes the suspect step in other processes with `megamemo replay`
(train/replay.py: from the newest checkpoint before S, under the layout of that checkpoint, within
MEGAMEMO_REPLAY_TIMEOUT_S seconds, default 600) and decides by its verdict:

  replay reproduces the recorded step (identical, within)  -> the data or the numerics, not a device:
      a spike: "rollback" (the rollback and its skip stand); node-suspect: "resume" (from the newest checkpoint,
      whose replicas agreed, on the same nodes: none excluded)
  replay differs                                             -> the device that computed it: "exclude" (its node
      left out where the supervisor can, launch/slurm/failure.sh; the run resumes from the newest agreeing checkpoint)
  no verdict (the replay failed or timed out)                -> "default": what the supervisor does without a replay

The verdict line, the decision and why go into the failure's record in interruptions.jsonl ("replay": {verdict,
decision, why, seconds}). A spike is replayed as it first happened (`megamemo replay --rolled-back`): the attempt the
rollback undid. What a replay cannot tell: a replica corrupted after its step's last recorded number (a bit flipped
in the weights after the update) leaves every recorded number intact, so the replay reproduces them; the replica
check's own verdict (the rank it names) still stands in the record.

Standard library only, like interruptions.py (launch/slurm/failure.sh runs it by path on the batch host).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from megamemo.checkpoint.layout import RunLayout

ENABLE = "MEGAMEMO_REPLAY_SUSPECT"
TIMEOUT = "MEGAMEMO_REPLAY_TIMEOUT_S"
COMMAND = "MEGAMEMO_REPLAY_CMD"  # the replay's command (default: this Python, -m megamemo replay)
KINDS = ("node", "spike")


def enabled(rec: dict, environ=None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENABLE, "") not in ("", "0") and rec.get("kind") in KINDS and rec.get("step") is not None


def decide(kind: str, verdict: str, step: int) -> tuple[str, str]:
    """(decision, why) from a replay's verdict line for a failure of `kind` at `step` (the module's doc)."""
    if verdict.startswith(("replay: identical", "replay: within")):
        if kind == "spike":
            return "rollback", (
                f"step {step} recomputes alike in another process: the data's (or the numerics') "
                f"spike, the rollback past its batch stands"
            )
        return "resume", (
            f"steps up to {step} recompute alike in another process: not the device's computation; "
            f"resuming from the newest agreeing checkpoint, no node excluded"
        )
    if verdict.startswith("replay: differs at "):
        return "exclude", (
            f"another process computes step {step} otherwise: the device's fault; excluding its node, "
            f"resuming from the newest agreeing checkpoint"
        )
    return "default", f"no replay verdict ({verdict or 'none'}): the supervisor's default"


def layout_of(run_dir: Path, step: int) -> list[str]:
    """--dp/--tp/--pp of the newest committed checkpoint before `step` (the replay's start), as its marker says."""
    done = sorted(
        (int(p.parent.name[5:]), p)
        for p in Path(run_dir).glob("checkpoints/step_*/COMMITTED")
        if p.parent.name[5:].isdigit() and int(p.parent.name[5:]) < step
    )
    if not done:
        return []
    try:
        layout = RunLayout.from_record(json.loads(done[-1][1].read_text()).get("layout"))
    except (OSError, ValueError):
        return []
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    return [a for k, n in sizes.items() for a in (f"--{k}", str(int(n or 1)))]


def command(run_dir: Path, rec: dict, environ=None) -> list[str]:
    env = os.environ if environ is None else environ
    base = shlex.split(env.get(COMMAND, "")) or [sys.executable, "-m", "megamemo", "replay"]
    step = int(rec["step"])
    return [
        *base,
        "--ckpt",
        str(run_dir),
        "--step",
        str(step),
        *layout_of(run_dir, step),
        *(["--rolled-back"] if rec.get("kind") == "spike" else []),
    ]


def replay(run_dir: Path, rec: dict, log=lambda m: None, environ=None) -> dict:
    """Run the replay of `rec`'s step -> {verdict, decision, why, seconds} for its record."""
    env = dict(os.environ if environ is None else environ)
    timeout = float(env.get(TIMEOUT) or 600)
    cmd = command(run_dir, rec, env)
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    log(f"[replay] {rec['kind']} at step {rec['step']}: {' '.join(cmd)} (within {timeout:.0f} s)")
    t0 = time.time()
    try:
        verdict = _verdict(cmd, env, timeout)
    except OSError as e:
        verdict = f"could not start: {e}"
    decision, why = decide(rec["kind"], verdict, int(rec["step"]))
    log(f"[replay] {verdict} -> {decision}: {why}")
    return {"verdict": verdict, "decision": decision, "why": why, "seconds": round(time.time() - t0, 3)}


def _verdict(cmd: list[str], env: dict, timeout: float) -> str:
    """The replay's verdict line, else its last line of error; past `timeout` its whole process group (the replay's
    launcher and workers) is killed."""
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return f"timed out after {timeout:.0f} s"
    lines = [x for x in out.splitlines() if x.startswith("replay: ")]
    return lines[-1] if lines else (err.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
