"""Stand-in programs for the launcher tests: a folder of bash scripts put first on PATH (nvidia-smi, scontrol,
srun, docker ...) that answer as the real ones would on a cluster, or record how they were called, and a clean
environment to run the launchers in with them."""

from __future__ import annotations

from pathlib import Path

# scontrol of a one-node allocation
SCONTROL = (
    'case "$1 $2" in "show hostnames") echo node1 ;; "show node") echo "NodeName=node1 NodeAddr=127.0.0.1" ;; esac'
)


def fake_binary(bin_dir: Path, name: str, body: str) -> Path:
    """bin_dir/name: an executable bash script with this body."""
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    p.chmod(0o755)
    return p


def recorder(name: str) -> str:
    """The body of a stand-in that records its environment and arguments into $FAKE_OUT/NAME.env and NAME.args."""
    return f'env > "$FAKE_OUT/{name}.env"; printf "%s\\n" "$@" > "$FAKE_OUT/{name}.args"'


def recorded_env(path: Path) -> dict[str, str]:
    """A recorder's NAME.env as a dict."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def devices_dir(out: Path) -> Path:
    """Where fake_env's launchers look for GPU device files (nvidia0 ...): none unless the test creates some."""
    return out.parent / "dev"


def fake_env(bin_dir: Path, out: Path, **extra) -> dict[str, str]:
    """A clean environment: PATH with the stand-ins first and only the system's programs after, HOME and FAKE_OUT
    at `out`; this machine's own GPU device files are not looked at (MEGAMEMO_NVIDIA_DEVICES globs devices_dir(out)
    instead); `extra` set (values as str)."""
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(out),
        "FAKE_OUT": str(out),
        "MEGAMEMO_NVIDIA_DEVICES": str(devices_dir(out) / "nvidia[0-9]*"),
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env
