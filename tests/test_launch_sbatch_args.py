"""The batch scripts' own logic, with Slurm's commands replaced by recorders (no cluster, no training): what the
preset scripts and train.sbatch hand to srun (MEGAMEMO_PRECISION, arguments with spaces kept whole), and when they
requeue (after a SIGUSR1 and a clean save, up to MEGAMEMO_MAX_REQUEUES; never after a failure). The real Slurm runs
are in test_launch_train.py (a dev cluster, where one can be started)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "launch" / "slurm"

# srun: records its arguments (NUL-separated, so spaces stay visible), marks every task ready, then exits with
# $STUB_SRUN_RC, or waits for scancel's USR1 (recorded by scancel) and exits with $STUB_SRUN_RC_AFTER_USR1.
SRUN = r"""#!/bin/bash
printf '%s\0' "$@" > "$STUB_DIR/srun.args"
for ((i = 0; i < SLURM_NTASKS; i++)); do touch "$MEGAMEMO_TASKS_READY/task$i"; done
echo $$ > "$STUB_DIR/srun.pid"
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
  "show job") echo "JobId=$SLURM_JOB_ID JobName=t Command=$STUB_COMMAND" ;;
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 NodeAddr=127.0.0.1" ;;
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
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL),
                       ("nvidia-smi", "#!/bin/bash\nexit 1\n"), ("megamemo", "#!/bin/bash\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def batch(stubs: Path, script: str, *args: str, usr1_after: float | None = None, **env: str):
    """Run a batch script as sbatch would; -> (exit code, its output, srun's arguments or None, Slurm calls)."""
    for f in ("srun.args", "calls"):
        (stubs / f).unlink(missing_ok=True)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGAMEMO_", "DS_ACCELERATOR"))}
    e.update(PATH=f"{stubs / 'bin'}:{e['PATH']}", STUB_DIR=str(stubs), STUB_COMMAND=str(SLURM / script),
             SLURM_JOB_ID="4242", SLURM_JOB_NAME="t", SLURM_JOB_NODELIST="node1", SLURM_NTASKS="2",
             SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(stubs), MEGAMEMO_VENV=str(stubs / "no-venv"), **env)
    p = subprocess.Popen(["bash", str(SLURM / script), *args], env=e, cwd=stubs, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    if usr1_after is not None:
        deadline = time.time() + 30
        while not (stubs / "srun.pid").exists() and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(usr1_after)
        p.send_signal(signal.SIGUSR1)           # --signal=B:USR1@300: to the batch shell
    out, _ = p.communicate(timeout=60)
    (stubs / "srun.pid").unlink(missing_ok=True)
    srun = (stubs / "srun.args").read_bytes().decode().split("\0")[:-1] if (stubs / "srun.args").exists() else None
    calls = (stubs / "calls").read_text().splitlines() if (stubs / "calls").exists() else []
    return p.returncode, out, srun, calls


def train_args(srun: list[str]) -> list[str]:
    """What task.sh (so `megamemo train`) gets: srun's arguments after `bash .../task.sh`."""
    i = srun.index(str(SLURM / "task.sh"))
    return srun[i + 1:]


def test_presets_set_their_precision_which_the_environment_and_the_arguments_override(stubs):
    gpus = {"MEGAMEMO_GPU_PROBE": "echo 8"}     # the GPU presets require GPUs: torch's view, as launch/device.sh asks
    rc, out, srun, _ = batch(stubs, "a100-bf16.sbatch", "--config", "c.yaml", "--run-dir", "r", **gpus)
    assert rc == 0, out
    assert train_args(srun) == ["--set", "precision.dtype=bf16", "--config", "c.yaml", "--run-dir", "r"]
    rc, out, srun, _ = batch(stubs, "a100-bf16.sbatch", "--config", "c.yaml", "--run-dir", "r",
                             MEGAMEMO_PRECISION="fp32", **gpus)
    assert train_args(srun)[:2] == ["--set", "precision.dtype=fp32"]
    # a --set among the arguments comes after the preset's, so it wins (the config loader applies them in order)
    rc, out, srun, _ = batch(stubs, "a100-bf16.sbatch", "--config", "c.yaml", "--run-dir", "r", "--set",
                             "precision.dtype=fp32", **gpus)
    assert train_args(srun) == ["--set", "precision.dtype=bf16", "--config", "c.yaml", "--run-dir", "r", "--set",
                                "precision.dtype=fp32"]
    # a GPU preset on a node where torch sees no GPU: one error line, nothing started (issue 28)
    rc, out, srun, _ = batch(stubs, "v100-fp16.sbatch", "--config", "c.yaml", "--run-dir", "r",
                             MEGAMEMO_GPU_PROBE="echo 0")
    assert rc != 0 and "torch sees no CUDA device" in out and srun is None, out


def test_a_bad_precision_is_refused_before_anything_starts(stubs):
    rc, out, srun, _ = batch(stubs, "train.sbatch", "--config", "c.yaml", MEGAMEMO_PRECISION="fp8")
    assert rc == 1 and "MEGAMEMO_PRECISION must be fp32, bf16 or fp16 (got fp8)" in out and srun is None


def test_arguments_with_spaces_reach_the_trainer_whole(stubs):
    run_dir = stubs / "my runs" / "first try"
    rc, out, srun, _ = batch(stubs, "train.sbatch", "--config", "configs/a b.yaml", "--run-dir", str(run_dir),
                             "--set", "log.note=two words")
    assert rc == 0, out
    assert train_args(srun) == ["--config", "configs/a b.yaml", "--run-dir", str(run_dir), "--set",
                                "log.note=two words"]
    # no --run-dir: one is made from the job's name and id under MEGAMEMO_RUN_ROOT (spaces kept)
    rc, out, srun, _ = batch(stubs, "train.sbatch", "--config", "c.yaml", MEGAMEMO_RUN_ROOT=str(stubs / "run root"))
    assert train_args(srun) == ["--config", "c.yaml", "--run-dir", str(stubs / "run root" / "t-4242")]


def test_usr1_then_a_clean_save_requeues_up_to_the_cap(stubs):
    rc, out, srun, calls = batch(stubs, "train.sbatch", "--config", "c.yaml", usr1_after=0.3, STUB_SRUN_WAIT="1",
                                 SLURM_RESTART_COUNT="3")
    assert rc == 0, out
    assert "scancel --signal=USR1 4242" in calls and "scontrol requeue 4242" in calls, (calls, out)
    rc, out, srun, calls = batch(stubs, "train.sbatch", "--config", "c.yaml", usr1_after=0.3, STUB_SRUN_WAIT="1",
                                 SLURM_RESTART_COUNT="3", MEGAMEMO_MAX_REQUEUES="3")
    assert rc == 0 and "3 restarts already (MEGAMEMO_MAX_REQUEUES): not requeueing" in out, out
    assert "scancel --signal=USR1 4242" in calls and not any("requeue" in c for c in calls), calls


def test_no_requeue_after_a_failure(stubs):
    # the step failed after the USR1 (no checkpoint was saved): its exit code, no requeue
    rc, out, srun, calls = batch(stubs, "train.sbatch", "--config", "c.yaml", usr1_after=0.3, STUB_SRUN_WAIT="1",
                                 STUB_SRUN_RC_AFTER_USR1="2")
    assert rc == 2 and "not requeueing" in out, out
    assert not any("requeue" in c for c in calls), calls
    # the step failed on its own (bad config, say): its exit code, no requeue
    rc, out, srun, calls = batch(stubs, "train.sbatch", "--config", "c.yaml", STUB_SRUN_RC="2")
    assert rc == 2 and "training finished with exit code 2" in out, out
    assert not any("requeue" in c or "scancel" in c for c in calls), calls
