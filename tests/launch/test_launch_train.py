"""launch/: the same tiny training through launch/local.sh (torchrun), through the real sbatch script on a real
local two-node Slurm cluster (launch/slurm/dev-cluster.sh, 2 nodes x 1 task) and through launch/mpi/train.sh
(mpirun -np 2) gives the same per-step losses; a Slurm job signalled with USR1 mid-run saves, requeues itself,
resumes from its checkpoint and finishes with the losses of the uninterrupted run; one whose rank on the second
node is killed with -9 requeues itself too (excluding no node: node2 is healthy) and finishes with them.

The dev cluster installs slurm-wlm and munge with apt-get when they are missing (CI runs as root on a fresh
Debian machine); the Slurm tests skip only when that install is impossible."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers.env import cpu_env

from megamemo.checkpoint.store import newest_complete

pytestmark = (
    pytest.mark.multiproc
)  # starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
DEV_CLUSTER = REPO / "launch" / "slurm" / "dev-cluster.sh"
TRAIN_SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
STEPS = 60
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _env() -> dict:
    """cpu_env without the Slurm configuration of the shell (the dev cluster's is set by its tests), DeepSpeed's
    compiled extensions cached in the repository."""
    return cpu_env(
        "SLURM_CONF", TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", REPO / ".cache" / "torch_extensions")
    )


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def train_args(shards: Path, run_dir: Path) -> list[str]:
    return [
        "--config",
        str(CONFIG),
        "--data",
        str(shards),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(STEPS),
        "--save-every",
        "0",
        "--set",
        "eval.every=0",
    ]


def read_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the training steps in <run_dir>/metrics.jsonl; each step must appear exactly once."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"steps logged out of order or twice: {steps}"
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def local_losses(shards, tmp_path_factory) -> dict[int, float]:
    """The reference: launch/local.sh with 2 processes (torchrun, gloo)."""
    run_dir = tmp_path_factory.mktemp("launch-local") / "run"
    r = subprocess.run(
        ["bash", str(REPO / "launch" / "local.sh"), "2", *train_args(shards, run_dir)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, _tail(out)
    assert "world 2 (env)" in out, _tail(out)  # two torchrun ranks, not one process
    losses = read_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


# ---------------------------------------------------------------------------------------------- Slurm
class Cluster:
    def __init__(self, env: dict, state_dir: Path):
        self.env = env
        self.dir = state_dir

    def run(self, *cmd, timeout=60, check=True, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([str(c) for c in cmd], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check:
            assert r.returncode == 0, f"{' '.join(map(str, cmd))}: rc={r.returncode}\n{r.stdout}{r.stderr}"
        return r

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float = 420) -> dict[str, str]:
        t0 = time.time()
        while time.time() - t0 < timeout:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        pytest.fail(f"job {job_id} did not finish within {timeout} s: {self.job(job_id)}")

    def daemon_log_tail(self) -> str:
        logs = sorted((self.dir / "log").glob("*.log")) if (self.dir / "log").exists() else []
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs)


def _free_port_block(n: int = 3) -> int:
    """A port P with P..P+n-1 free, in 17000-17999 (below the ephemeral range)."""
    for _ in range(200):
        base = random.randrange(17000, 17999 - n)
        try:
            for p in range(base, base + n):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block in 17000-17999")


def _slurm_installed() -> bool:
    return all(
        Path(p).exists() for p in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch")
    )


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the dev Slurm cluster runs slurmd, which needs root (CI runs as root)")
    state = tmp_path_factory.mktemp("slurm")
    env = _env()
    env.update(MEGAMEMO_SLURM_DIR=str(state), MEGAMEMO_SLURM_PORT=str(_free_port_block()), MEGAMEMO_SLURM_NODES="2")
    r = subprocess.run(["bash", str(DEV_CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        if not _slurm_installed():
            pytest.skip(f"Slurm is not installed and could not be installed with apt-get:\n{_tail(r.stderr, 1500)}")
        subprocess.run(["bash", str(DEV_CLUSTER), "stop"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"dev cluster did not start:\n{r.stdout}{r.stderr}")
    env["SLURM_CONF"] = str(state / "slurm.conf")
    cluster = Cluster(env, state)
    yield cluster
    subprocess.run(["bash", str(DEV_CLUSTER), "stop"], env=env, capture_output=True, timeout=120)


def _submit(cluster: Cluster, submit_dir: Path, args: list[str]) -> str:
    r = cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=00:15:00",
        TRAIN_SBATCH,
        *args,
        cwd=submit_dir,
    )
    return r.stdout.strip().split(";")[0]


def _job_logs(cluster: Cluster, submit_dir: Path, job_id: str) -> str:
    parts = [p for p in submit_dir.glob(f"slurm-*-{job_id}.out")]
    parts += sorted((submit_dir / "logs" / "slurm").glob(f"*-{job_id}/*"))
    text = "\n".join(f"--- {p.name}\n{_tail(p.read_text(errors='replace'), 2500)}" for p in parts)
    return text + "\n" + cluster.daemon_log_tail()


def test_sbatch_two_nodes_matches_local(slurm, shards, local_losses, tmp_path):
    run_dir = tmp_path / "run"
    job_id = _submit(slurm, tmp_path, train_args(shards, run_dir))
    info = slurm.wait(job_id)
    logs = _job_logs(slurm, tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{logs}"
    assert info["NodeList"] == "node[1-2]" and info["NumTasks"] == "2", info
    rank_logs = sorted(p.name for p in (tmp_path / "logs" / "slurm").glob(f"*-{job_id}/rank*.log"))
    assert rank_logs == ["rank0.log", "rank1.log"], logs
    assert "world 2 (slurm)" in logs, logs  # ranks mapped from SLURM_* across the two nodes
    assert read_losses(run_dir) == local_losses


@pytest.mark.parametrize("when", ["mid-run", "start-up"])
def test_usr1_saves_requeues_resumes_with_same_losses(slurm, shards, local_losses, tmp_path, when):
    """What Slurm's --signal=B:USR1@<seconds> does before a time limit: USR1 to the batch shell only. Mid-run:
    after a few steps. Start-up: before the ranks have even imported torch (Slurm may send the signal up to 60 s
    early, so a short job can get it at once); the rank must neither die of it nor lose it."""
    run_dir = tmp_path / "run"
    job_id = _submit(slurm, tmp_path, train_args(shards, run_dir))
    metrics = run_dir / "metrics.jsonl"
    t0 = time.time()
    while True:
        state = slurm.job(job_id).get("JobState")
        assert state not in FINAL_STATES, (
            f"job ended before it could be signalled\n{_job_logs(slurm, tmp_path, job_id)}"
        )
        assert time.time() - t0 < 300, f"job not running / no steps after 300 s\n{_job_logs(slurm, tmp_path, job_id)}"
        # The batch script writes job.txt once its USR1 trap is set, before it starts the step.
        if when == "start-up" and list((tmp_path / "logs" / "slurm").glob(f"*-{job_id}/job.txt")):
            break
        if when == "mid-run" and metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    if when == "start-up":
        assert not metrics.exists(), "training had already started: the start-up case was not exercised"

    info = slurm.wait(job_id)
    logs = _job_logs(slurm, tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{logs}"
    assert info["Restarts"] == "1", f"{info}\n{logs}"
    job_txt = next((tmp_path / "logs" / "slurm").glob(f"*-{job_id}/job.txt")).read_text()
    starts = re.findall(r"^start .* restart=(\d+)", job_txt, flags=re.M)
    ends = re.findall(r"^end .* restart=(\d+) rc=(\d+) usr1=(\d)", job_txt, flags=re.M)
    assert starts == ["0", "1"] and ends == [("0", "0", "1"), ("1", "0", "0")], job_txt
    rank0 = next((tmp_path / "logs" / "slurm").glob(f"*-{job_id}/rank0.log")).read_text()
    resumed = re.findall(r"resum\w* (?:at|from) step (\d+)", rank0)
    first = 3 if when == "mid-run" else 1
    assert len(resumed) == 1 and first <= int(resumed[0]) < STEPS, f"the requeued start did not resume mid-run\n{rank0}"
    assert read_losses(run_dir) == local_losses


def _rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of the training process of that rank of that Slurm job (its environment says which), or None."""
    for p in Path("/proc").glob("[0-9]*"):
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"SLURM_JOB_ID={job_id}".encode() in env
            and f"SLURM_PROCID={rank}".encode() in env
            and b"train" in cmd
            and not any(c.endswith(b"task.sh") for c in cmd)
        ):
            return int(p.name)
    return None


def test_a_killed_rank_on_the_second_node_requeues_the_job_which_finishes_bit_exact(
    slurm, shards, local_losses, tmp_path
):
    """kill -9 of rank 1 (node2) mid-run: train.sbatch records the crash, finds node2 healthy, requeues the job
    (excluding nothing, released at once) and the requeued job resumes from the step-10 checkpoint and ends with the
    losses of the uninterrupted run (launch/local.sh), bit for bit."""
    run_dir = tmp_path / "run"
    job_id = _submit(
        slurm, tmp_path, train_args(shards, run_dir) + ["--save-every", "10", "--set", "checkpoint.probe=false"]
    )
    metrics = run_dir / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 14):
        assert slurm.job(job_id).get("JobState") not in FINAL_STATES and time.time() - t0 < 300, _job_logs(
            slurm, tmp_path, job_id
        )
        time.sleep(0.05)
    pid = _rank_pid(job_id, 1)
    assert pid is not None, _job_logs(slurm, tmp_path, job_id)
    os.kill(pid, 9)
    info = slurm.wait(job_id)
    logs = _job_logs(slurm, tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", f"{info}\n{logs}"
    assert info.get("ExcNodeList") in ("(null)", ""), info
    recs = [json.loads(x) for x in (run_dir / "interruptions.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["node"], r["signal"], r["launcher"], r["job"]) for r in recs] == [
        ("crash", 1, "node2", "SIGKILL", "slurm", job_id)
    ], recs
    assert "rank 1's node node2 is healthy (Slurm: " in logs and "excluding no node" in logs, logs
    assert read_losses(run_dir) == local_losses


def test_a_spare_node_takes_over_inside_the_allocation_under_a_smaller_world(slurm, shards, tmp_path, monkeypatch):
    """MEGAMEMO_SPARE_NODES=1 and a node check that fails on node2: after rank 1 (node2) is killed, the batch script
    records a node fault and restarts the step at once on node1 alone (no requeue, nothing excluded), and the run
    resumes its step-4 (or later) checkpoint under world size 1 through the relayout on load."""
    run_dir = tmp_path / "run"
    monkeypatch.setitem(slurm.env, "MEGAMEMO_SPARE_NODES", "1")
    monkeypatch.setitem(slurm.env, "MEGAMEMO_NODE_CHECK", '[ "$SLURMD_NODENAME" != node2 ]')
    job_id = _submit(
        slurm,
        tmp_path,
        train_args(shards, run_dir) + ["--max-steps", "24", "--save-every", "4", "--set", "checkpoint.probe=false"],
    )
    metrics = run_dir / "metrics.jsonl"
    t0 = time.time()
    # step 7 logged and the step-4 checkpoint committed (saves are asynchronous: under load the kill could otherwise
    # come before the commit, and the fault would record none)
    while not (
        metrics.exists()
        and len(metrics.read_text().splitlines()) >= 7
        and newest_complete(run_dir / "checkpoints") is not None
    ):
        assert slurm.job(job_id).get("JobState") not in FINAL_STATES and time.time() - t0 < 300, _job_logs(
            slurm, tmp_path, job_id
        )
        time.sleep(0.05)
    pid = _rank_pid(job_id, 1)
    assert pid is not None, _job_logs(slurm, tmp_path, job_id)
    os.kill(pid, 9)
    info = slurm.wait(job_id)
    logs = _job_logs(slurm, tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", f"{info}\n{logs}"
    assert "restarting inside the allocation on node1 (1 of MEGAMEMO_SPARE_NODES=1 spare nodes used)" in logs, logs
    [rec] = [json.loads(x) for x in (run_dir / "interruptions.jsonl").read_text().splitlines()]
    assert (rec["kind"], rec["rank"], rec["node"]) == ("node", 1, "node2") and rec["committed"] >= 4, rec
    rank0 = next((tmp_path / "logs" / "slurm").glob(f"*-{job_id}/rank0.log")).read_text()
    assert "world 1 (slurm)" in rank0 and "resuming under tp=1 pp=1 dp=1 (1 ranks" in rank0, rank0[-3000:]
    assert sorted(read_losses(run_dir)) == list(range(1, 25))


def test_dev_cluster_start_is_idempotent_and_stop_leaves_nothing(slurm):
    pids = [int(line.split()[1]) for line in (slurm.dir / "pids").read_text().splitlines()]
    assert len(pids) == 4  # munged, slurmctld, two slurmd
    r = slurm.run("bash", DEV_CLUSTER, "start")
    assert "already running" in r.stderr
    assert [int(line.split()[1]) for line in (slurm.dir / "pids").read_text().splitlines()] == pids
    slurm.run("bash", DEV_CLUSTER, "stop", timeout=120)
    assert not slurm.dir.exists()
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        alive = stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive, f"pid {pid} still running after stop"
    assert slurm.run("bash", DEV_CLUSTER, "status", check=False).returncode == 3


# ---------------------------------------------------------------------------------------------- mpirun, local.sh
def test_mpirun_two_ranks_matches_local(shards, local_losses, tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        ["bash", str(REPO / "launch" / "mpi" / "train.sh"), "2", *train_args(shards, run_dir)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, _tail(out)
    assert "world 2 (mpi)" in out, _tail(out)  # ranks from the MPI launcher / mpi4py
    assert read_losses(run_dir) == local_losses


def test_local_sh_fails_clearly_without_megamemo(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MEGAMEMO_VENV": str(tmp_path / "no-venv")}
    r = subprocess.run(
        ["bash", str(REPO / "launch" / "local.sh"), "2", "--config", str(CONFIG)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "megamemo" in r.stderr and "not installed" in r.stderr, r.stderr
    r = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "zero"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "positive integer" in r.stderr, r.stderr
