"""What crosses the launchers' boundaries on a cluster (issue 35, item 7), with fake `srun`, `scontrol`, `mpirun` and
`docker` recording what they are given (no cluster, no training):

  * the network settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME) and the CUDA ones
    (CUDA_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF) reach the ranks where the starter passes only what it is told
    to: Open MPI's mpirun (launch/mpi/train.sh, `-x NAME`) and docker/podman (launch/slurm/task.sh, `--env NAME`);
    srun (--export=ALL), apptainer, pyxis and MPICH's Hydra pass the whole environment;
  * train.sbatch's MASTER_PORT (launch/slurm/port.sh): from the full job id, so jobs 2,000 apart no longer share one
    (it was 10000 + (id mod 2000) * 10), and moved off a port something already listens on at the first node."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fake_bin import SCONTROL, fake_binary, fake_env, recorded_env, recorder

REPO = Path(__file__).resolve().parents[2]
NETWORK = {
    "NCCL_SOCKET_IFNAME": "ib0",
    "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    "GLOO_SOCKET_IFNAME": "ib0",
    "NCCL_DEBUG": "WARN",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


@pytest.fixture
def fakes(tmp_path):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    fake_binary(bin_dir, "nvidia-smi", "exit 1")
    fake_binary(bin_dir, "scontrol", SCONTROL)
    for name in ("srun", "docker", "podman"):
        fake_binary(bin_dir, name, recorder(name))
    fake_binary(
        bin_dir,
        "mpirun",
        '[ "$1" = --version ] && { echo "mpirun (Open MPI) 4.1.4"; exit 0; }; '
        'printf "%s\\n" "$@" > "$FAKE_OUT/mpirun.args"',
    )
    return bin_dir, out


def _named(args: list[str], flag: str) -> set[str]:
    """The NAMEs of `flag NAME` pairs in a recorded argument list."""
    return {args[i + 1] for i, a in enumerate(args[:-1]) if a == flag}


# ---- the network and CUDA settings ---------------------------------------------------------------------------------
def test_open_mpi_ranks_get_the_network_and_cuda_settings(fakes):
    bin_dir, out = fakes
    env = fake_env(
        bin_dir,
        out,
        MEGAMEMO_VENV=Path(sys.executable).parents[1],
        MEGAMEMO_GPU_PROBE="echo 2",
        MEGAMEMO_TRAIN_CMD="true",
        MPIRUN=bin_dir / "mpirun",
        UNRELATED_SETTING="x",
        **NETWORK,
    )
    r = subprocess.run(
        ["bash", str(REPO / "launch/mpi/train.sh"), "2", "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    args = (out / "mpirun.args").read_text().splitlines()
    forwarded = _named(args, "-x")
    assert set(NETWORK) <= forwarded, sorted(set(NETWORK) - forwarded)
    assert {
        "PATH",
        "MEGAMEMO_DEVICE",
        "DS_ACCELERATOR",
        "MASTER_ADDR",
        "OMP_NUM_THREADS",
        "CUDA_DEVICE_MAX_CONNECTIONS",
    } <= forwarded, forwarded
    assert "UNRELATED_SETTING" not in forwarded and "HOME" not in forwarded, forwarded


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_docker_ranks_get_the_network_and_cuda_settings(fakes, runtime):
    bin_dir, out = fakes
    env = fake_env(
        bin_dir,
        out,
        MEGAMEMO_CONTAINER="megamemo:latest",
        MEGAMEMO_CONTAINER_RUNTIME=runtime,
        MEGAMEMO_DEVICE="gpu",
        MEGAMEMO_ROOT=REPO,
        SLURM_SUBMIT_DIR=out,
        SLURM_PROCID=0,
        SLURM_NTASKS=2,
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT=12345,
        DS_ACCELERATOR="cuda",
        UNRELATED_SETTING="x",
        **NETWORK,
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
    forwarded = _named((out / f"{runtime}.args").read_text().splitlines(), "--env")
    assert set(NETWORK) <= forwarded, sorted(set(NETWORK) - forwarded)
    assert {
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "MEGAMEMO_DEVICE",
        "DS_ACCELERATOR",
    } <= forwarded, forwarded
    # the image's own PATH and HOME stay: the host's would point at nothing inside it
    assert not forwarded & {"PATH", "HOME", "LD_LIBRARY_PATH", "UNRELATED_SETTING"}, forwarded


# ---- MASTER_PORT ---------------------------------------------------------------------------------------------------
def _sbatch_port(bin_dir: Path, out: Path, job_id: int, restarts: int = 0) -> tuple[int, str]:
    """train.sbatch as Slurm starts it for job `job_id`: the MASTER_PORT its training step gets, and its output."""
    (out / "srun.env").unlink(missing_ok=True)
    env = fake_env(
        bin_dir,
        out,
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NAME="megamemo",
        SLURM_SUBMIT_DIR=out,
        SLURM_JOB_NODELIST="node1",
        SLURM_NTASKS=1,
        SLURM_JOB_NUM_NODES=1,
        SLURM_NTASKS_PER_NODE=1,
        SLURM_RESTART_COUNT=restarts,
        MEGAMEMO_ROOT=REPO,
        MEGAMEMO_TRAIN_CMD="true",
        MEGAMEMO_VENV=out / "no-venv",
        MEGAMEMO_GPU_PROBE="echo 0",
    )
    r = subprocess.run(
        ["bash", str(REPO / "launch/slurm/train.sbatch"), "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    step = recorded_env(out / "srun.env")
    return int(step["MASTER_PORT"]), r.stdout + r.stderr


def test_jobs_2000_apart_get_different_ports(fakes):
    """The old derivation, 10000 + (id mod 2000) * 10 + restarts, gave jobs 4242 and 6242 both 12420."""
    bin_dir, out = fakes
    a, _ = _sbatch_port(bin_dir, out, 4242)
    b, _ = _sbatch_port(bin_dir, out, 6242)
    assert a != b and 10000 <= min(a, b) and max(a, b) < 32768, (a, b)
    again, _ = _sbatch_port(bin_dir, out, 4242, restarts=1)  # a requeue moves on (TIME_WAIT)
    assert again == a + 1, (a, again)


def test_candidate_ports_never_collide_within_2272_job_ids():
    """The candidate of port.sh without the probe, over job ids with gaps 1..2272 (2,000 among them), every restart
    count: all distinct, all below the kernel's ephemeral ports (32768)."""
    script = f"""source "{REPO}/launch/slurm/port.sh"
megamemo_port_in_use() {{ return 1; }}     # nothing listens: the candidate itself
for id in 7 4242 1000000 987654321; do
  for gap in 0 1 2 9 10 1999 2000 2001 2272; do
    for r in 0 1 9; do echo "$id $gap $r $(megamemo_master_port $(( id + gap )) $r 127.0.0.1)"; done
  done
done"""
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [tuple(map(int, line.split())) for line in r.stdout.splitlines()]
    assert len(rows) == 4 * 9 * 3
    for base in {row[0] for row in rows}:
        ports = [p for b, gap, restarts, p in rows if b == base]
        assert len(set(ports)) == len(ports), sorted(ports)
        assert all(10000 <= p <= 32729 for p in ports), ports


def test_a_port_in_use_on_the_first_node_is_skipped(fakes):
    """Another job's rendezvous already listens on this job's candidate port at the first node (127.0.0.1 here):
    train.sbatch takes the next free one and says so."""
    bin_dir, out = fakes
    job = 4242
    want, _ = _sbatch_port(bin_dir, out, job)
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", want))
        except OSError:
            pytest.fail(f"port {want} is taken on this machine: cannot stage the collision")
        busy.listen()
        got, said = _sbatch_port(bin_dir, out, job)
    assert got != want and got % 10 == want % 10, (want, got)
    assert f"port {want} (from job id {job}) is in use on 127.0.0.1: using {got}" in said, said


def test_a_free_port_is_drawn_below_the_ephemeral_range_and_skips_a_taken_one(tmp_path, monkeypatch):
    """A rendezvous port the kernel never hands out by itself: the gloo connections of other jobs on the host (each
    on a port of the ephemeral range) cannot take it before rank 0 listens (a test once failed with EADDRINUSE at
    rank 0's TCPStore). A taken port is skipped; with no room below the range, the kernel chooses."""
    from megamemo.runtime import dist

    low, high = dist.ephemeral_ports()
    ports = {dist.free_port() for _ in range(16)}
    assert len(ports) > 1 and all(dist.PORTS_FROM <= p < low for p in ports), (ports, low)
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert dist.ephemeral_ports(str(f)) == (40000, 50000)
    assert dist.ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0 if low <= dist.PORTS_FROM else dist.PORTS_FROM + 7))
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, busy + 1])
        monkeypatch.setattr(dist.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert dist.free_port() == busy + 1
    monkeypatch.setattr(dist, "ephemeral_ports", lambda: (1024, 65535))  # nothing below: the kernel's choice
    assert low <= dist.free_port() <= high


# ---- at scale: node-local compile caches, the network interface from the route to MASTER_ADDR -------------------
# this node is 10.0.0.7 on ib0; MASTER_ADDR 10.0.0.1 (another node) is reached through ib0, node2 resolves to it
IP = r"""case "$*" in
  "-o route get 10.0.0.1") echo "10.0.0.1 dev ib0 src 10.0.0.7 uid 1000 \    cache" ;;
  "-o route get 10.0.0.7") echo "local 10.0.0.7 dev lo table local src 10.0.0.7 uid 1000 \    cache <local>" ;;
  "-o addr show to 10.0.0.7") echo "1: lo    inet 127.0.0.1/8 scope host lo"
                              echo "4: ib0    inet 10.0.0.7/16 brd 10.0.255.255 scope global ib0" ;;
  *) echo "RTNETLINK answers: Network is unreachable" >&2; exit 2 ;;
esac"""


def _task(bin_dir: Path, out: Path, **extra) -> tuple[dict, str]:
    """task.sh on the host: (the environment `megamemo train` got, task.sh's output)."""
    fake_binary(bin_dir, "ip", IP)
    fake_binary(bin_dir, "getent", '[ "$2" = node2 ] && echo "10.0.0.1        STREAM node2" || exit 2')
    fake_binary(bin_dir, "train", f'env > "{out}/train.env"')
    (out / "train.env").unlink(missing_ok=True)
    env = fake_env(bin_dir, out, MEGAMEMO_TRAIN_CMD=bin_dir / "train", SLURM_PROCID=0, **extra)
    r = subprocess.run(
        ["bash", str(REPO / "launch/slurm/task.sh"), "--config", "x.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=out,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = recorded_env(out / "train.env")
    return got, r.stdout


@pytest.mark.parametrize("master", ["10.0.0.1", "node2", "10.0.0.7"])
def test_the_socket_interfaces_are_the_route_to_master_addr(fakes, master):
    """Another node's address or name: the interface of the route to it; this node's own address (the route is
    the loopback): the interface that holds it. Printed in the rank's log."""
    got, out = _task(*fakes, MASTER_ADDR=master)
    assert got["NCCL_SOCKET_IFNAME"] == got["GLOO_SOCKET_IFNAME"] == "ib0", got
    assert "NCCL_SOCKET_IFNAME=ib0 (the route to" in out and "GLOO_SOCKET_IFNAME=ib0 (the route to" in out, out


def test_a_set_interface_is_kept_and_no_route_leaves_them_unset(fakes):
    got, out = _task(*fakes, MASTER_ADDR="10.0.0.1", NCCL_SOCKET_IFNAME="eth1")
    assert (got["NCCL_SOCKET_IFNAME"], got["GLOO_SOCKET_IFNAME"]) == ("eth1", "ib0"), got
    assert "NCCL_SOCKET_IFNAME=eth1 (set) GLOO_SOCKET_IFNAME=ib0 (the route to 10.0.0.1)" in out, out
    got, out = _task(*fakes, MASTER_ADDR="192.168.9.9")
    assert "NCCL_SOCKET_IFNAME" not in got and "GLOO_SOCKET_IFNAME" not in got, got
    assert "network: no route to MASTER_ADDR=192.168.9.9" in out, out  # and the training still starts


@pytest.mark.parametrize("script", ["train.sbatch", "a100-bf16.sbatch"])
def test_the_compile_caches_are_node_local_unless_set(fakes, script):
    """The ranks' TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: under MEGAMEMO_NODE_CACHE (else $TMPDIR, else
    /tmp), not ~/.triton; one the user set is kept. Printed in the job's output."""
    bin_dir, out = fakes
    base = dict(
        SLURM_JOB_ID=7,
        SLURM_JOB_NAME="megamemo",
        SLURM_SUBMIT_DIR=out,
        SLURM_JOB_NODELIST="node1",
        SLURM_NTASKS=1,
        SLURM_JOB_NUM_NODES=1,
        SLURM_NTASKS_PER_NODE=1,
        MEGAMEMO_ROOT=REPO,
        MEGAMEMO_TRAIN_CMD="true",
        MEGAMEMO_VENV=out / "no-venv",
        MEGAMEMO_GPU_PROBE="echo 1",
    )
    (out / "local").mkdir()
    for extra, inductor, triton in (
        ({"TMPDIR": out / "local"}, f"{out}/local/megamemo-cache-", f"{out}/local/"),
        ({"MEGAMEMO_NODE_CACHE": "/nvme", "TRITON_CACHE_DIR": "/mine"}, "/nvme/megamemo-cache-", "/mine"),
    ):
        r = subprocess.run(
            ["bash", str(REPO / "launch/slurm" / script), "--config", "x.yaml"],
            env=fake_env(bin_dir, out, **base, **extra),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        step = recorded_env(out / "srun.env")
        assert step["TORCHINDUCTOR_CACHE_DIR"].startswith(inductor), step["TORCHINDUCTOR_CACHE_DIR"]
        assert step["TORCHINDUCTOR_CACHE_DIR"].endswith("/inductor")
        assert step["TRITON_CACHE_DIR"].startswith(triton) and "/.triton" not in step["TRITON_CACHE_DIR"], step
        assert f"compile caches: TORCHINDUCTOR_CACHE_DIR={step['TORCHINDUCTOR_CACHE_DIR']}" in r.stdout, r.stdout
