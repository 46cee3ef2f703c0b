"""The batch scripts' own logic, with Slurm's commands replaced by recorders (no cluster, no training): what the
preset scripts and train.sbatch hand to srun (MEGAMEMO_PRECISION, arguments with spaces kept whole), when they
requeue (after a SIGUSR1 and a clean save, up to MEGAMEMO_MAX_REQUEUES; after a crash, up to MEGAMEMO_MAX_FAILURES,
the last one included; never after exit 2 or the same step failing three times), which node they exclude (one Slurm
reports down, drained or draining, one MEGAMEMO_NODE_CHECK fails on; none for a crash on a healthy node) and the
restart inside the allocation on the healthy nodes (MEGAMEMO_SPARE_NODES). The real Slurm runs are in
test_launch_train.py (a dev cluster, where one can be started)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "launch" / "slurm"

# srun: records its arguments (NUL-separated, so spaces stay visible), marks every task ready, then exits with
# $STUB_SRUN_RC, or waits for scancel's USR1 (recorded by scancel) and exits with $STUB_SRUN_RC_AFTER_USR1.
# A node check (`srun ... --nodelist=NODE ... bash -c CHECK`) runs CHECK with SLURMD_NODENAME=NODE. A training step
# with $STUB_SRUN_RCS ("CODE:RANK:NODE ..." per step, "0" for a clean one) writes that rank's exit as task.sh does
# and ends with CODE; $STUB_RUN_DIR is what rank 0 announces as its run directory.
SRUN = r"""#!/bin/bash
printf '%s ' "$@" >> "$STUB_DIR/srun.log"; echo "MEGAMEMO_RESTART=${MEGAMEMO_RESTART:-}" >> "$STUB_DIR/srun.log"
if [ "${*: -2:1}" = "-c" ]; then
  for a in "$@"; do case "$a" in --nodelist=*) export SLURMD_NODENAME="${a#*=}" ;; esac; done
  exec bash -c "${*: -1}"
fi
printf '%s\0' "$@" > "$STUB_DIR/srun.args"
for ((i = 0; i < SLURM_NTASKS; i++)); do touch "$MEGAMEMO_TASKS_READY/task$i"; done
echo $$ > "$STUB_DIR/srun.pid"
[ -n "${STUB_RUN_DIR:-}" ] && echo "$STUB_RUN_DIR" > "$MEGAMEMO_RUN_DIR_FILE"
if [ -n "${STUB_SRUN_RCS:-}" ]; then
  n=$(( $(cat "$STUB_DIR/srun.n" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$STUB_DIR/srun.n"
  IFS=: read -r code rank node <<<"$(echo $STUB_SRUN_RCS | cut -d' ' -f"$n")"
  [ -n "$rank" ] && echo "$code $node $(date +%s.%N)" > "$MEGAMEMO_TASK_EXITS/$rank"
  exit "$code"
fi
if [ -n "${STUB_SRUN_WAIT:-}" ]; then
  trap 'exit "${STUB_SRUN_RC_AFTER_USR1:-0}"' USR1
  for ((i = 0; i < 600; i++)); do sleep 0.1; done
  exit 99
fi
exit "${STUB_SRUN_RC:-0}"
"""
SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$STUB_DIR/calls"
case "$1 $2" in
  "show job") echo "JobId=$SLURM_JOB_ID JobName=t Command=$STUB_COMMAND ExcNodeList=${STUB_EXCLUDED:-(null)}" ;;
  "show hostnames") printf '%s\n' ${STUB_HOSTNAMES:-node1} ;;
  "show node") state=IDLE; [[ " ${STUB_DOWN:-} " == *" $4 "* ]] && state=DOWN+NOT_RESPONDING
               [[ " ${STUB_DRAINING:-} " == *" $4 "* ]] && state=MIXED+DRAIN
               echo "NodeName=$4 NodeAddr=127.0.0.1 State=$state" ;;
  "requeue "*) ;;
esac
"""
SCANCEL = r"""#!/bin/bash
echo "scancel $*" >> "$STUB_DIR/calls"
kill -USR1 "$(cat "$STUB_DIR/srun.pid")"
"""


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("srun", SRUN),
        ("scontrol", SCONTROL),
        ("scancel", SCANCEL),
        ("nvidia-smi", "#!/bin/bash\nexit 1\n"),
        ("megamemo", "#!/bin/bash\nexit 0\n"),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def batch(stubs: Path, script: str, *args: str, usr1_after: float | None = None, **env: str):
    """Run a batch script as sbatch would; -> (exit code, its output, srun's arguments or None, Slurm calls)."""
    for f in ("srun.args", "calls"):
        (stubs / f).unlink(missing_ok=True)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGAMEMO_", "DS_ACCELERATOR"))}
    e.update(
        PATH=f"{stubs / 'bin'}:{e['PATH']}",
        STUB_DIR=str(stubs),
        STUB_COMMAND=str(SLURM / script),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="t",
        SLURM_JOB_NODELIST="node1",
        SLURM_NTASKS="2",
        SLURM_JOB_NUM_NODES="1",
        SLURM_SUBMIT_DIR=str(stubs),
        MEGAMEMO_VENV=str(stubs / "no-venv"),
    )
    e.update(env)
    p = subprocess.Popen(
        ["bash", str(SLURM / script), *args],
        env=e,
        cwd=stubs,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if usr1_after is not None:
        deadline = time.time() + 30
        while not (stubs / "srun.pid").exists() and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(usr1_after)
        p.send_signal(signal.SIGUSR1)  # --signal=B:USR1@300: to the batch shell
    out, _ = p.communicate(timeout=60)
    (stubs / "srun.pid").unlink(missing_ok=True)
    srun = (stubs / "srun.args").read_bytes().decode().split("\0")[:-1] if (stubs / "srun.args").exists() else None
    calls = (stubs / "calls").read_text().splitlines() if (stubs / "calls").exists() else []
    return p.returncode, out, srun, calls


def train_args(srun: list[str]) -> list[str]:
    """What task.sh (so `megamemo train`) gets: srun's arguments after `bash .../task.sh`."""
    i = srun.index(str(SLURM / "task.sh"))
    return srun[i + 1 :]


def test_presets_set_their_precision_which_the_environment_and_the_arguments_override(stubs):
    gpus = {"MEGAMEMO_GPU_PROBE": "echo 8"}  # the GPU presets require GPUs: torch's view, as launch/device.sh asks
    rc, out, srun, _ = batch(stubs, "a100-bf16.sbatch", "--config", "c.yaml", "--run-dir", "r", **gpus)
    assert rc == 0, out
    assert train_args(srun) == ["--set", "precision.dtype=bf16", "--config", "c.yaml", "--run-dir", "r"]
    rc, out, srun, _ = batch(
        stubs, "a100-bf16.sbatch", "--config", "c.yaml", "--run-dir", "r", MEGAMEMO_PRECISION="fp32", **gpus
    )
    assert train_args(srun)[:2] == ["--set", "precision.dtype=fp32"]
    # a --set among the arguments comes after the preset's, so it wins (the config loader applies them in order)
    rc, out, srun, _ = batch(
        stubs, "a100-bf16.sbatch", "--config", "c.yaml", "--run-dir", "r", "--set", "precision.dtype=fp32", **gpus
    )
    assert train_args(srun) == [
        "--set",
        "precision.dtype=bf16",
        "--config",
        "c.yaml",
        "--run-dir",
        "r",
        "--set",
        "precision.dtype=fp32",
    ]
    # a GPU preset on a node where torch sees no GPU: one error line, nothing started (issue 28)
    rc, out, srun, _ = batch(
        stubs, "v100-fp16.sbatch", "--config", "c.yaml", "--run-dir", "r", MEGAMEMO_GPU_PROBE="echo 0"
    )
    assert rc != 0 and "torch sees no CUDA device" in out and srun is None, out


def test_a_bad_precision_is_refused_before_anything_starts(stubs):
    rc, out, srun, _ = batch(stubs, "train.sbatch", "--config", "c.yaml", MEGAMEMO_PRECISION="fp8")
    assert rc == 1 and "MEGAMEMO_PRECISION must be fp32, bf16 or fp16 (got fp8)" in out and srun is None


def test_arguments_with_spaces_reach_the_trainer_whole(stubs):
    run_dir = stubs / "my runs" / "first try"
    rc, out, srun, _ = batch(
        stubs, "train.sbatch", "--config", "configs/a b.yaml", "--run-dir", str(run_dir), "--set", "log.note=two words"
    )
    assert rc == 0, out
    assert train_args(srun) == [
        "--config",
        "configs/a b.yaml",
        "--run-dir",
        str(run_dir),
        "--set",
        "log.note=two words",
    ]
    # no --run-dir: one is made from the job's name and id under MEGAMEMO_RUN_ROOT (spaces kept)
    rc, out, srun, _ = batch(stubs, "train.sbatch", "--config", "c.yaml", MEGAMEMO_RUN_ROOT=str(stubs / "run root"))
    assert train_args(srun) == ["--config", "c.yaml", "--run-dir", str(stubs / "run root" / "t-4242")]


def test_usr1_then_a_clean_save_requeues_up_to_the_cap(stubs):
    rc, out, srun, calls = batch(
        stubs, "train.sbatch", "--config", "c.yaml", usr1_after=0.3, STUB_SRUN_WAIT="1", SLURM_RESTART_COUNT="3"
    )
    assert rc == 0, out
    assert "scancel --signal=USR1 4242" in calls and "scontrol requeue 4242" in calls, (calls, out)
    rc, out, srun, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        usr1_after=0.3,
        STUB_SRUN_WAIT="1",
        SLURM_RESTART_COUNT="3",
        MEGAMEMO_MAX_REQUEUES="3",
    )
    assert rc == 0 and "3 restarts already (MEGAMEMO_MAX_REQUEUES): not requeueing" in out, out
    assert "scancel --signal=USR1 4242" in calls and not any("requeue" in c for c in calls), calls


def test_no_requeue_after_a_failure(stubs):
    # the step failed after the USR1 (no checkpoint was saved): its exit code, no requeue
    rc, out, srun, calls = batch(
        stubs, "train.sbatch", "--config", "c.yaml", usr1_after=0.3, STUB_SRUN_WAIT="1", STUB_SRUN_RC_AFTER_USR1="2"
    )
    assert rc == 2 and "not requeueing" in out, out
    assert not any("requeue" in c for c in calls), calls
    # the step failed on its own (bad config, say): its exit code, no requeue
    rc, out, srun, calls = batch(stubs, "train.sbatch", "--config", "c.yaml", STUB_SRUN_RC="2")
    assert rc == 2 and "training finished with exit code 2" in out, out
    assert not any("requeue" in c or "scancel" in c for c in calls), calls


# ---- failures: requeue, node exclusion, spares ------------------------------------------------------------------
TWO_NODES = {
    "SLURM_JOB_NODELIST": "node[1-2]",
    "STUB_HOSTNAMES": "node1 node2",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS_PER_NODE": "1",
}


def run_dir_at_step(stubs: Path, step: int = 7, committed: int = 6, past: list[int] = ()) -> Path:
    """A run directory as a failed start leaves it: steps 1..step logged, `committed` committed, and earlier
    interruption records at the steps in `past`."""
    d = stubs / "run"
    (d / "checkpoints" / f"step_{committed:08d}").mkdir(parents=True)
    (d / "checkpoints" / f"step_{committed:08d}" / "COMMITTED").write_text("{}")
    (d / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s, "time": 1.7e9 + s}) + "\n" for s in range(1, step + 1))
    )
    (d / "interruptions.jsonl").write_text(
        "".join(json.dumps({"kind": "crash", "step": s, "time": 1.7e9}) + "\n" for s in past)
    )
    return d


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "interruptions.jsonl").read_text().splitlines()]


def test_a_crash_on_a_healthy_node_requeues_at_once_excluding_nothing(stubs):
    run_dir = run_dir_at_step(stubs)
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="137:1:node2",
        STUB_RUN_DIR=str(run_dir),
        MEGAMEMO_NODE_CHECK="true",
        **TWO_NODES,
    )
    assert rc == 0, out
    assert (
        "training failed (failure 1 of this job): crash of rank 1 on node2 (signal SIGKILL) after step 7 (last "
        "committed: 6;" in out
    ), out
    assert (
        "rank 1's node node2 is healthy (Slurm: IDLE, MEGAMEMO_NODE_CHECK passed): requeueing job 4242, excluding "
        "no node" in out
    ), out
    assert calls[-2:] == ["scontrol requeue 4242", "scontrol update JobId=4242 StartTime=now"], calls
    [rec] = records(run_dir)
    assert (rec["kind"], rec["rank"], rec["node"], rec["signal"], rec["launcher"], rec["job"]) == (
        "crash",
        1,
        "node2",
        "SIGKILL",
        "slurm",
        "4242",
    )
    assert "--nodelist=node2" in (stubs / "srun.log").read_text()  # the check ran on the failed rank's node


@pytest.mark.parametrize("why", ["down", "draining", "check"])
def test_a_node_at_fault_is_excluded_before_the_requeue(stubs, why):
    run_dir = run_dir_at_step(stubs)
    env = {
        "down": {"STUB_DOWN": "node2"},
        "draining": {"STUB_DRAINING": "node2"},
        "check": {"MEGAMEMO_NODE_CHECK": '[ "$SLURMD_NODENAME" != node2 ]'},
    }[why]
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="137:1:node2",
        STUB_RUN_DIR=str(run_dir),
        STUB_EXCLUDED="node7",
        **env,
        **TWO_NODES,
    )
    assert rc == 0, out
    reason = {
        "down": "Slurm reports it DOWN+NOT_RESPONDING",
        "draining": "Slurm reports it MIXED+DRAIN",
        "check": "MEGAMEMO_NODE_CHECK failed there",
    }[why]
    assert f"node(s) at fault: node2: {reason}" in out and "requeueing job 4242 with node2 excluded" in out, out
    assert calls[-2:] == ["scontrol requeue 4242", "scontrol update JobId=4242 StartTime=now ExcNodeList=node7,node2"]
    [rec] = records(run_dir)
    assert (rec["kind"], rec["node"]) == ("node", "node2") and reason in rec["node_fault"], rec


def test_drained_draining_down_failed_and_unresponsive_nodes_are_at_fault_busy_ones_are_not():
    """failure.sh's reading of `scontrol show node`'s State: a drained node is IDLE+DRAIN (DOWN+DRAIN), a draining
    one MIXED+DRAIN or ALLOCATED+DRAIN (sinfo's "drained" / "draining"), one not responding carries a '*' or
    NOT_RESPONDING; a node busy with other jobs or finishing one is healthy."""
    bad = [
        "DOWN",
        "DOWN+NOT_RESPONDING",
        "IDLE+DRAIN",
        "DOWN+DRAIN",
        "MIXED+DRAIN",
        "ALLOCATED+DRAIN",
        "DRAINED",
        "DRAINING",
        "FAIL",
        "MIXED+FAIL",
        "ALLOCATED+FAILING",
        "IDLE*",
        "IDLE+NOT_RESPONDING",
        "IDLE+POWERED_DOWN",
    ]
    good = ["IDLE", "MIXED", "ALLOCATED", "COMPLETING", "ALLOCATED+COMPLETING", "IDLE+RESERVED", "MIXED+PLANNED"]
    script = f'source "{SLURM / "failure.sh"}"; for s in "$@"; do megamemo_bad_state "$s" && echo "$s"; done; true'
    out = subprocess.run(["bash", "-c", script, "bash", *bad, *good], capture_output=True, text=True, check=True)
    assert out.stdout.split() == bad, out.stdout


def test_spare_nodes_restart_inside_the_allocation_without_the_node_at_fault(stubs):
    run_dir = run_dir_at_step(stubs)
    rc, out, srun, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="137:1:node2 0",
        STUB_RUN_DIR=str(run_dir),
        STUB_DOWN="node2",
        MEGAMEMO_SPARE_NODES="1",
        **TWO_NODES,
    )
    assert rc == 0, out
    assert "restarting inside the allocation on node1 (1 of MEGAMEMO_SPARE_NODES=1 spare nodes used)" in out, out
    assert not any("requeue" in c or "update" in c for c in calls), calls
    i = srun.index("bash")
    assert srun[i - 3 : i] == ["--nodes=1", "--ntasks=1", "--nodelist=node1"], srun  # the second start: one node
    steps = [x for x in (stubs / "srun.log").read_text().splitlines() if "task.sh" in x]
    assert [x.rsplit(" ", 1)[1] for x in steps] == ["MEGAMEMO_RESTART=0", "MEGAMEMO_RESTART=1"], steps
    job = (stubs / "logs" / "slurm" / "t-4242" / "job.txt").read_text()
    assert re.findall(r"^start .* restart=(\d+) nodes=(\S+) ntasks=(\d+)", job, flags=re.M) == [
        ("0", "node1,node2", "2"),
        ("1", "node1", "1"),
    ], job
    # no spare left (or none allowed): requeued with the node excluded instead
    (stubs / "srun.n").unlink()
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="137:1:node2 0",
        STUB_RUN_DIR=str(run_dir),
        STUB_DOWN="node2",
        **TWO_NODES,
    )
    assert rc == 0 and calls[-1] == "scontrol update JobId=4242 StartTime=now ExcNodeList=node2", (out, calls)


def test_no_restart_past_the_failure_cap_nor_after_the_same_step_three_times(stubs):
    run_dir = run_dir_at_step(stubs, past=[7, 7])
    rc, out, _, calls = batch(
        stubs, "train.sbatch", "--config", "c.yaml", STUB_SRUN_RCS="1:0:node1", STUB_RUN_DIR=str(run_dir), **TWO_NODES
    )
    assert rc == 1 and "not restarting: failed 3 times in a row after step 7: a deterministic failure" in out, out
    assert not any("requeue" in c for c in calls), calls
    logdir = stubs / "logs" / "slurm" / "t-4242"
    (logdir / "job.txt").write_text(
        "end x restart=0 rc=137 usr1=0\nend x restart=1 rc=0 usr1=1\nend x restart=2 rc=1 usr1=0\n"
    )  # 2 failures and a preemption before
    (stubs / "srun.n").unlink()
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="137:1:node2",
        STUB_RUN_DIR=str(run_dir_at_step(stubs / "b")),
        MEGAMEMO_MAX_FAILURES="2",
        **TWO_NODES,
    )
    assert rc == 137 and "not restarting: 3 failures (MEGAMEMO_MAX_FAILURES=2)" in out, out
    assert not any("requeue" in c for c in calls), calls


def test_a_failure_at_the_failure_cap_is_still_requeued(stubs):
    """MEGAMEMO_MAX_FAILURES=2: the job's second failure (one crash and a preemption before it) is requeued, the
    third is not (test_no_restart_past_the_failure_cap_nor_after_the_same_step_three_times)."""
    logdir = stubs / "logs" / "slurm" / "t-4242"
    logdir.mkdir(parents=True)
    (logdir / "job.txt").write_text("end x restart=0 rc=137 usr1=0\nend x restart=1 rc=0 usr1=1\n")
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="137:1:node2",
        STUB_RUN_DIR=str(run_dir_at_step(stubs)),
        MEGAMEMO_MAX_FAILURES="2",
        SLURM_RESTART_COUNT="2",
        **TWO_NODES,
    )
    assert rc == 0 and "training failed (failure 2 of this job)" in out and "not restarting" not in out, out
    assert calls[-2:] == ["scontrol requeue 4242", "scontrol update JobId=4242 StartTime=now"], calls


def test_a_start_that_died_with_its_node_is_recorded_by_the_next(stubs):
    """Slurm requeues a job itself when a node of it fails (NODE_FAIL), batch script included: the next start finds
    job.txt's last start without an end, records the lost start (kind node) and counts it as a failure."""
    run_dir = run_dir_at_step(stubs)
    logdir = stubs / "logs" / "slurm" / "t-4242"
    logdir.mkdir(parents=True)
    (logdir / "job.txt").write_text("start 2030-01-01T10:00:00+00:00 restart=0 nodes=node1,node2 ntasks=2\n")
    (logdir / ".run-dir").write_text(f"{run_dir}\n")
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_RUN_DIR=str(run_dir),
        SLURM_RESTART_COUNT="1",
        MEGAMEMO_MAX_FAILURES="0",
        STUB_SRUN_RCS="1:0:node1",
        **TWO_NODES,
    )
    assert "start 0 of job 4242 ended without its batch script (its node lost?)" in out, out
    [lost, crash] = records(run_dir)
    assert (lost["kind"], lost["restart"], lost["started"], lost["step"], lost["committed"]) == (
        "node",
        0,
        1893492000.0,
        7,
        6,
    ), lost
    assert "ended without its batch script" in lost["node_fault"]
    assert crash["restart"] == 1 and rc == 1 and "not restarting: 2 failures (MEGAMEMO_MAX_FAILURES=0)" in out, out


def _replica_suspect(run_dir: Path, rank: int = 1, node: str = "node2") -> None:
    """The ranks' heartbeats as a replica check that named `rank` leaves them (train/numerics.py, watchdog.note)."""
    beats = run_dir / "heartbeats"
    beats.mkdir()
    note = {"suspects": [{"rank": rank, "node": node}], "step": 7, "line": "replica check after step 7: ..."}
    for r in range(2):
        (beats / f"rank{r}.json").write_text(
            json.dumps({"rank": r, "node": f"node{r + 1}", "beat": time.time() + 600, "step": 7, "replicas": note})
        )


def _fake_replay(stubs: Path, verdict: str) -> str:
    """MEGAMEMO_REPLAY_CMD: records its arguments, says `verdict`."""
    script = stubs / "bin" / "fake-replay"
    script.write_text(f'#!/bin/bash\necho "$@" > "{stubs}/replay.args"\necho "{verdict}"\n')
    script.chmod(0o755)
    return str(script)


def test_a_node_suspect_stop_excludes_the_node_of_the_rank_the_replica_check_named(stubs):
    """Exit 5 on node2's rank 1 (both nodes healthy as Slurm sees them): the replica check's suspect's node is at
    fault: requeued without it, or, with a spare node, restarted inside the allocation on the other one."""
    run_dir = run_dir_at_step(stubs)
    _replica_suspect(run_dir)
    rc, out, _, calls = batch(
        stubs, "train.sbatch", "--config", "c.yaml", STUB_SRUN_RCS="5:1:node2", STUB_RUN_DIR=str(run_dir), **TWO_NODES
    )
    assert rc == 0, out
    assert "node(s) at fault: node2: replica mismatch (exit 5); requeueing job 4242 with node2 excluded" in out, out
    assert calls[-2:] == ["scontrol requeue 4242", "scontrol update JobId=4242 StartTime=now ExcNodeList=node2"]
    [rec] = records(run_dir)
    assert (rec["kind"], rec["rank"], rec["node"], rec["exit_code"]) == ("node", 1, "node2", 5), rec
    assert "replay" not in rec  # opt-in
    (stubs / "srun.n").unlink()
    rc, out, srun, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="5:1:node2 0",
        STUB_RUN_DIR=str(run_dir),
        MEGAMEMO_SPARE_NODES="1",
        **TWO_NODES,
    )
    assert rc == 0 and "restarting inside the allocation on node1" in out, out
    assert not any("requeue" in c for c in calls) and "--nodelist=node1" in srun, (calls, srun)


@pytest.mark.parametrize("verdict", ["replay: identical", "replay: differs at step 7: loss 9.1 replayed, 5.2 recorded"])
def test_a_node_suspect_stop_is_replayed_first_when_asked_and_decided_by_the_verdict(stubs, verdict):
    run_dir = run_dir_at_step(stubs)
    _replica_suspect(run_dir)
    rc, out, _, calls = batch(
        stubs,
        "train.sbatch",
        "--config",
        "c.yaml",
        STUB_SRUN_RCS="5:1:node2",
        STUB_RUN_DIR=str(run_dir),
        MEGAMEMO_REPLAY_SUSPECT="1",
        MEGAMEMO_REPLAY_CMD=_fake_replay(stubs, verdict),
        **TWO_NODES,
    )
    assert rc == 0, out
    assert (stubs / "replay.args").read_text().split() == [
        "--ckpt",
        str(run_dir),
        "--step",
        "7",
        "--dp",
        "1",
        "--tp",
        "1",
        "--pp",
        "1",
    ]
    [rec] = records(run_dir)
    assert rec["kind"] == "node" and rec["replay"]["verdict"] == verdict, rec
    if "identical" in verdict:  # the recorded steps reproduce: no node excluded
        assert rec["replay"]["decision"] == "resume"
        assert "replay of step 7: replay: identical: not the device's computation; excluding none of node2" in out
        assert calls[-2:] == ["scontrol requeue 4242", "scontrol update JobId=4242 StartTime=now"], calls
    else:
        assert rec["replay"]["decision"] == "exclude"
        assert "node(s) at fault: node2: replica mismatch (exit 5), replay: differs at step 7: loss 9.1" in out, out
        assert calls[-1] == "scontrol update JobId=4242 StartTime=now ExcNodeList=node2", calls
