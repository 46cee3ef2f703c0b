"""The launchers' device decision on a machine without GPUs: fake `nvidia-smi`, `scontrol`, `srun` and container
runtimes on PATH stand for a GPU node, and record what the training step would have been started with.

  * scripts/env.sh picks DeepSpeed's CPU accelerator only where nvidia-smi lists no GPU;
  * launch/slurm/train.sbatch decides on the job's node and resets an inherited DS_ACCELERATOR=cpu (from env.sh on
    a login node) for a GPU job; it passes --cpus-per-task to srun (SRUN_CPUS_PER_TASK), and the GPU settings;
  * launch/slurm/task.sh asks the container runtime for the GPUs (--nv / --gpus all) exactly for a GPU job;
  * the launchers count the GPUs torch sees (launch/device.sh; MEGAMEMO_GPU_PROBE, a command printing the count,
    stands for torch's view here), the GPU presets require one, and launch/local.sh / launch/mpi/train.sh do not
    obey an inherited DS_ACCELERATOR=cpu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fake_bin import SCONTROL, devices_dir, fake_binary, fake_env, recorded_env, recorder

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fakes(tmp_path):
    """A bin directory with nvidia-smi listing $FAKE_GPUS GPUs, scontrol, and srun/apptainer/docker that record
    their environment and arguments into $FAKE_OUT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_binary(
        bin_dir,
        "nvidia-smi",
        'for ((i = 0; i < ${FAKE_GPUS:-0}; i++)); do echo "GPU $i: Tesla V100-SXM2-32GB (UUID: GPU-$i)"; done',
    )
    fake_binary(bin_dir, "scontrol", SCONTROL)
    for name in ("srun", "apptainer", "docker"):
        fake_binary(bin_dir, name, recorder(name))
    out = tmp_path / "out"
    out.mkdir()
    return bin_dir, out


@pytest.mark.parametrize(
    "gpus, preset, want, device_file",
    [(0, None, "cpu", False), (8, None, "unset", False), (0, "cuda", "cuda", False), (0, None, "unset", True)],
)
def test_env_sh_picks_the_cpu_accelerator_only_without_gpus(fakes, gpus, preset, want, device_file):
    """The last case: nvidia-smi is not on PATH (the fake lists none) but the node has /dev/nvidia0: not the CPU
    (a `megamemo train` started from that shell would obey DS_ACCELERATOR=cpu)."""
    bin_dir, out = fakes
    if device_file:
        _device_files(out, 1)
    extra = {"FAKE_GPUS": gpus} | ({"DS_ACCELERATOR": preset} if preset else {})
    r = subprocess.run(
        ["bash", "-c", f'source "{REPO}/scripts/env.sh"; echo "${{DS_ACCELERATOR-unset}}"'],
        env=fake_env(bin_dir, out, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == want, r.stderr


def _device_files(out: Path, n: int) -> None:
    """n GPU device files where _env's MEGAMEMO_NVIDIA_DEVICES looks (nvidia0..., besides nvidiactl)."""
    dev = devices_dir(out)
    dev.mkdir(exist_ok=True)
    for name in ["nvidiactl"] + [f"nvidia{i}" for i in range(n)]:
        (dev / name).touch()


def _sbatch(bin_dir: Path, out: Path, gpus: int, **extra) -> subprocess.CompletedProcess:
    """train.sbatch as Slurm would start it on an 8-task node; the fake srun records the step's environment."""
    env = fake_env(
        bin_dir,
        out,
        FAKE_GPUS=gpus,
        SLURM_JOB_ID=4242,
        SLURM_JOB_NAME="megamemo",
        SLURM_SUBMIT_DIR=out,
        SLURM_JOB_NODELIST="node1",
        SLURM_NTASKS=8,
        SLURM_JOB_NUM_NODES=1,
        SLURM_NTASKS_PER_NODE=8,
        MEGAMEMO_ROOT=REPO,
        MEGAMEMO_TRAIN_CMD="true",
        MEGAMEMO_VENV=out / "no-venv",
        **extra,
    )
    return subprocess.run(
        ["bash", str(REPO / "launch/slurm/train.sbatch"), "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sbatch_resets_an_inherited_cpu_accelerator_for_a_gpu_job(fakes):
    bin_dir, out = fakes
    r = _sbatch(bin_dir, out, 8, DS_ACCELERATOR="cpu", SLURM_CPUS_PER_TASK=6)  # env.sh on a login node
    assert r.returncode == 0, r.stdout + r.stderr
    step = recorded_env(out / "srun.env")
    assert (step["DS_ACCELERATOR"], step["MEGAMEMO_DEVICE"]) == ("cuda", "gpu")
    assert step["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and step["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert step["SRUN_CPUS_PER_TASK"] == "6" and "CUDA_VISIBLE_DEVICES" not in step
    assert "launch/slurm/task.sh" in (out / "srun.args").read_text()


def test_sbatch_on_a_cpu_node_or_asked_for_cpu(fakes):
    bin_dir, out = fakes
    for gpus, extra in ((0, {}), (8, {"MEGAMEMO_DEVICE": "cpu"})):
        r = _sbatch(bin_dir, out, gpus, **extra)
        assert r.returncode == 0, r.stdout + r.stderr
        step = recorded_env(out / "srun.env")
        assert (step["DS_ACCELERATOR"], step["MEGAMEMO_DEVICE"], step["CUDA_VISIBLE_DEVICES"]) == ("cpu", "cpu", "")
        assert "SRUN_CPUS_PER_TASK" not in step and "CUDA_DEVICE_MAX_CONNECTIONS" not in step
    r = _sbatch(bin_dir, out, 8, MEGAMEMO_DEVICE="tpu")
    assert r.returncode == 1 and "MEGAMEMO_DEVICE must be auto, gpu or cpu" in r.stdout + r.stderr


# ---- the GPU count torch sees (issue 28): MEGAMEMO_GPU_PROBE stands for torch's view (launch/device.sh) ---------
def test_sbatch_decides_from_what_torch_sees_without_nvidia_smi(fakes):
    """A node whose nvidia-smi is not on PATH (the fake lists none) but whose torch sees 8 GPUs: a GPU job."""
    bin_dir, out = fakes
    r = _sbatch(bin_dir, out, 0, MEGAMEMO_GPU_PROBE="echo 8", DS_ACCELERATOR="cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    step = recorded_env(out / "srun.env")
    assert (step["DS_ACCELERATOR"], step["MEGAMEMO_DEVICE"]) == ("cuda", "gpu") and "CUDA_VISIBLE_DEVICES" not in step


# ---- auto on a node with GPUs that torch cannot use (issue 35, item 4): one error line, never the CPU ------------
GPU_NODE = {
    "slurm-gpus-on-node": {"SLURM_GPUS_ON_NODE": 4},
    "slurm-job-gpus": {"SLURM_JOB_GPUS": "0,1,2,3"},
    "nvidia-smi": {"FAKE_GPUS": 4},
    "device-files": {},
}


def _launch(launcher: str, bin_dir: Path, out: Path, **extra) -> subprocess.CompletedProcess:
    """One of the three launchers, MEGAMEMO_DEVICE unset (auto), with recorders for what it would start."""
    fake_binary(
        bin_dir, "mpirun", f'[ "$1" = --version ] && {{ echo "HYDRA build details"; exit 0; }}; env > {out}/mpirun.env'
    )
    if launcher == "train.sbatch":
        return _sbatch(bin_dir, out, extra.pop("FAKE_GPUS", 0), **extra)
    script = {"local.sh": "launch/local.sh", "mpi/train.sh": "launch/mpi/train.sh"}[launcher]
    env = _venv_env(
        bin_dir, out, MEGAMEMO_TRAIN_CMD=f"bash -c 'env > {out}/worker.env'", MPIRUN=bin_dir / "mpirun", **extra
    )
    return subprocess.run(
        ["bash", str(REPO / script), "2", "--config", "x.yaml"], env=env, capture_output=True, text=True, timeout=120
    )


def _started(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.env"))


@pytest.mark.parametrize("evidence", list(GPU_NODE))
@pytest.mark.parametrize("launcher", ["train.sbatch", "local.sh", "mpi/train.sh"])
def test_auto_on_a_gpu_node_where_torch_sees_none_stops_in_one_line(fakes, launcher, evidence):
    """launch/device.sh used to turn auto into cpu whenever torch saw no GPU, so a GPU job with a CPU-only torch
    (or a driver too old, or a container without GPUs) trained on the CPU and the Python check for such a node never
    ran. Now: the probe says 0, the node has GPUs (Slurm gave the job some, nvidia-smi lists some, or /dev/nvidia0
    exists): one error line naming the evidence, nothing started."""
    bin_dir, out = fakes
    if evidence == "device-files":
        _device_files(out, 2)
    r = _launch(launcher, bin_dir, out, MEGAMEMO_GPU_PROBE="echo 0", **GPU_NODE[evidence])
    said = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == (1 if launcher == "train.sbatch" else 3), r.stdout + r.stderr
    assert len(said) == 1 and "MEGAMEMO_DEVICE=auto on a node with NVIDIA GPUs" in said[0], said
    want = {
        "slurm-gpus-on-node": "SLURM_GPUS_ON_NODE=4",
        "slurm-job-gpus": "SLURM_JOB_GPUS=0,1,2,3",
        "nvidia-smi": "nvidia-smi lists 4 GPU(s)",
        "device-files": "nvidia0 exists",
    }[evidence]
    assert want in said[0] and "torch sees no CUDA device" in said[0] and "MEGAMEMO_DEVICE=cpu" in said[0], said
    assert _started(out) == [], _started(out)


@pytest.mark.parametrize("launcher", ["train.sbatch", "local.sh", "mpi/train.sh"])
def test_auto_without_gpu_evidence_or_asked_for_cpu_still_runs_on_the_cpu(fakes, launcher):
    """The other side: no GPU anywhere (probe 0, no Slurm GPUs, no nvidia-smi GPU, no device file) is a CPU job,
    and MEGAMEMO_DEVICE=cpu on a GPU node is obeyed."""
    bin_dir, out = fakes
    for extra in ({}, {"MEGAMEMO_DEVICE": "cpu", "SLURM_GPUS_ON_NODE": 4}):
        for f in out.glob("*.env"):
            f.unlink()
        r = _launch(launcher, bin_dir, out, MEGAMEMO_GPU_PROBE="echo 0", **extra)
        started = _started(out)
        assert r.returncode == 0 and len(started) == 1, (extra, r.stdout + r.stderr)
        step = recorded_env(out / started[0])
        assert (step["DS_ACCELERATOR"], step["MEGAMEMO_DEVICE"]) == ("cpu", "cpu"), extra


def test_auto_where_the_python_has_no_torch_to_ask_names_the_probe(fakes):
    """A container job's bare host: no torch to ask, no nvidia-smi on PATH, but /dev/nvidia0: not the CPU either."""
    bin_dir, out = fakes
    _device_files(out, 1)
    r = _sbatch(bin_dir, out, 0, MEGAMEMO_GPU_PROBE="true")
    errors = [line for line in (r.stdout + r.stderr).splitlines() if "error" in line]
    assert r.returncode == 1 and len(errors) == 1 and "MEGAMEMO_GPU_PROBE" in errors[0], r.stdout + r.stderr
    assert _started(out) == []


@pytest.mark.parametrize("preset", ["a100-bf16.sbatch", "v100-fp16.sbatch"])
def test_gpu_presets_require_a_gpu(fakes, preset):
    """The GPU presets set MEGAMEMO_DEVICE=gpu: where torch sees no GPU (even with nvidia-smi listing 8) the job
    stops with one error line and no training step; where it sees them, the step is a GPU one."""
    bin_dir, out = fakes
    env = dict(
        SLURM_JOB_ID=4242,
        SLURM_JOB_NAME="megamemo",
        SLURM_SUBMIT_DIR=out,
        SLURM_JOB_NODELIST="node1",
        SLURM_NTASKS=8,
        SLURM_JOB_NUM_NODES=1,
        SLURM_NTASKS_PER_NODE=8,
        MEGAMEMO_ROOT=REPO,
        MEGAMEMO_TRAIN_CMD="true",
        MEGAMEMO_VENV=out / "no-venv",
        FAKE_GPUS=8,
    )
    for seen in (0, 8):
        r = subprocess.run(
            ["bash", str(REPO / "launch/slurm" / preset), "--config", "x.yaml"],
            env=fake_env(bin_dir, out, MEGAMEMO_GPU_PROBE=f"echo {seen}", **env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if seen == 0:
            errors = [line for line in (r.stdout + r.stderr).splitlines() if "error" in line]
            assert r.returncode == 1 and len(errors) == 1 and "torch sees no CUDA device" in errors[0], r.stderr
            assert not (out / "srun.env").exists()
        else:
            assert r.returncode == 0, r.stdout + r.stderr
            assert recorded_env(out / "srun.env")["MEGAMEMO_DEVICE"] == "gpu"


def test_sbatch_fp16_on_the_cpu_is_an_error(fakes):
    bin_dir, out = fakes
    r = _sbatch(bin_dir, out, 0, MEGAMEMO_GPU_PROBE="echo 0", MEGAMEMO_PRECISION="fp16")
    assert r.returncode == 1 and "MEGAMEMO_PRECISION=fp16 needs GPUs" in r.stdout + r.stderr
    assert not (out / "srun.env").exists()


def _venv_env(bin_dir, out, **extra):
    """The real venv (local.sh checks that megamemo imports), this checkout first on the import path."""
    return fake_env(bin_dir, out, MEGAMEMO_VENV=Path(sys.executable).parents[1], PYTHONPATH=REPO, **extra)


def test_local_sh_ignores_an_inherited_cpu_accelerator_where_torch_sees_gpus(fakes):
    bin_dir, out = fakes
    cmd = f"bash -c 'env > {out}/worker.env'"
    r = subprocess.run(
        ["bash", str(REPO / "launch/local.sh"), "1", "--config", "x.yaml"],
        env=_venv_env(bin_dir, out, MEGAMEMO_GPU_PROBE="echo 2", DS_ACCELERATOR="cpu", MEGAMEMO_TRAIN_CMD=cmd),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 process(es) on gpu" in r.stderr and "ignoring the inherited DS_ACCELERATOR=cpu" in r.stderr, r.stderr
    worker = recorded_env(out / "worker.env")
    assert (worker["DS_ACCELERATOR"], worker["MEGAMEMO_DEVICE"]) == ("cuda", "gpu")
    r = subprocess.run(
        ["bash", str(REPO / "launch/local.sh"), "1", "--config", "x.yaml"],
        env=_venv_env(bin_dir, out, MEGAMEMO_GPU_PROBE="echo 0", MEGAMEMO_DEVICE="gpu", MEGAMEMO_TRAIN_CMD=cmd),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 3 and "torch sees no CUDA device" in r.stderr, r.stderr


def test_mpi_train_sh_ignores_an_inherited_cpu_accelerator_where_torch_sees_gpus(fakes):
    bin_dir, out = fakes
    fake_binary(
        bin_dir, "mpirun", f'[ "$1" = --version ] && {{ echo "HYDRA build details"; exit 0; }}; env > {out}/mpirun.env'
    )
    r = subprocess.run(
        ["bash", str(REPO / "launch/mpi/train.sh"), "2", "--config", "x.yaml"],
        env=_venv_env(
            bin_dir,
            out,
            MEGAMEMO_GPU_PROBE="echo 2",
            DS_ACCELERATOR="cpu",
            MEGAMEMO_TRAIN_CMD="true",
            MPIRUN=bin_dir / "mpirun",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    step = recorded_env(out / "mpirun.env")
    assert (step["DS_ACCELERATOR"], step["MEGAMEMO_DEVICE"]) == ("cuda", "gpu")


@pytest.mark.parametrize("runtime, flag", [("apptainer", ["--nv"]), ("docker", ["--gpus", "all"])])
@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_task_sh_gives_the_container_the_gpus_of_a_gpu_job(fakes, runtime, flag, device):
    bin_dir, out = fakes
    env = fake_env(
        bin_dir,
        out,
        MEGAMEMO_CONTAINER="megamemo.sif",
        MEGAMEMO_CONTAINER_RUNTIME=runtime,
        MEGAMEMO_DEVICE=device,
        MEGAMEMO_ROOT=REPO,
        SLURM_SUBMIT_DIR=out,
        SLURM_PROCID=0,
        DS_ACCELERATOR="cuda" if device == "gpu" else "cpu",
        CUDA_DEVICE_MAX_CONNECTIONS=1,
    )
    r = subprocess.run(
        ["bash", str(REPO / "launch/slurm/task.sh"), "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=out,
    )
    assert r.returncode == 0, r.stderr
    args = (out / f"{runtime}.args").read_text().splitlines()
    has = any(args[i : i + len(flag)] == flag for i in range(len(args)))
    assert has == (device == "gpu"), args
    if runtime == "docker":
        assert "CUDA_DEVICE_MAX_CONNECTIONS" in args and "DS_ACCELERATOR" in args


# ---- scripts/setup.sh -------------------------------------------------------------------------------------------
FAKE_PYTHON = r"""#!/bin/bash
# A venv python that records pip's arguments and plays torch's install: the build depends on the index asked for.
state="$FAKE_OUT/torch"
if [ "$1" = -m ] && [ "$2" = pip ]; then
  echo "$*" >> "$FAKE_OUT/pip.log"
  case "$*" in
    *torch==2.13.0*cu126*) echo "2.13.0+cu126 12.6" > "$state" ;;
    *torch==2.13.0*cu130*) echo "2.13.0+cu130 13.0" > "$state" ;;
    *torch==2.13.0*) echo "${FAKE_PIP_TORCH:-2.13.0+cpu None}" > "$state" ;;
    *" -e "*) [ -n "${FAKE_REPLACE_TORCH:-}" ] && echo "$FAKE_REPLACE_TORCH" > "$state" ;;
  esac
  exit 0
fi
if [ "$1" = -m ] && [ "$2" = megamemo.export.lm_eval_plugin ]; then echo "$*" >> "$FAKE_OUT/hook.log"; exit 0; fi
[ "$1" = -c ] && [ -f "$state" ] && { cat "$state"; exit 0; }
exit 1
"""


def _setup(tmp_path, **extra) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(out),
        "FAKE_OUT": str(out),
        "MEGAMEMO_VENV": str(venv),
        **{k: str(v) for k, v in extra.items()},
    }
    r = subprocess.run(["bash", str(REPO / "scripts/setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    return r, out


@pytest.mark.parametrize(
    "target, index, build",
    [
        (None, None, "2.13.0+cpu"),
        ("v100", "https://download.pytorch.org/whl/cu126", "2.13.0+cu126"),
        ("a100", "https://download.pytorch.org/whl/cu126", "2.13.0+cu126"),
        ("cu130", "https://download.pytorch.org/whl/cu130", "2.13.0+cu130"),
    ],
)
def test_setup_installs_the_targets_torch_first_then_holds_it(tmp_path, target, index, build):
    r, out = _setup(tmp_path, **({"MEGAMEMO_TARGET": target} if target else {}))
    assert r.returncode == 0, r.stderr
    first, second = (out / "pip.log").read_text().splitlines()
    assert first.split()[4:] == ["torch==2.13.0"] + (["--index-url", index] if index else [])
    constraints = tmp_path / "venv" / ".megamemo-constraints.txt"
    assert f"-c {constraints} -e {REPO}[dev,parquet,eval,s3,gcs,docs]" in second
    assert (out / "hook.log").read_text().split() == ["-m", "megamemo.export.lm_eval_plugin", "install"]
    assert constraints.read_text().strip() == f"torch=={build}"
    again, _ = _setup(tmp_path, **({"MEGAMEMO_TARGET": target} if target else {}))
    assert "up to date" in again.stdout and len((out / "pip.log").read_text().splitlines()) == 2


def test_setup_fails_loudly_when_torch_is_replaced_or_the_wrong_build(tmp_path):
    r, _ = _setup(tmp_path, FAKE_REPLACE_TORCH="2.14.1 13.0")
    assert r.returncode == 2 and "changed torch from 2.13.0+cpu (CUDA None) to 2.14.1 (CUDA 13.0)" in r.stderr
    r, _ = _setup(
        tmp_path,
        MEGAMEMO_TARGET="v100",
        MEGAMEMO_TORCH_INDEX="https://example.invalid/simple",
        FAKE_PIP_TORCH="2.13.0 13.0",
    )
    assert r.returncode == 2 and "wants a CUDA 12.6 build of torch" in r.stderr
    r, _ = _setup(tmp_path, MEGAMEMO_TORCH_SPEC="torch==2.5.1")
    assert r.returncode == 2 and "MEGAMEMO_TARGET" in r.stderr
    r, _ = _setup(tmp_path, MEGAMEMO_TARGET="p100")
    assert r.returncode == 2 and "MEGAMEMO_TARGET must be" in r.stderr
