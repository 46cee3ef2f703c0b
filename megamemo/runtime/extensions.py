"""Where torch's JIT builds of C++/CUDA extensions go (DeepSpeed's ops, in an image built without DS_BUILD_OPS=1):
TORCH_EXTENSIONS_DIR, else torch's default, `<XDG_CACHE_HOME or ~/.cache>/torch_extensions/<python>_<cuda>`.

In a container that place is often not writable by the user the job runs as: `docker run --user UID:GID` (as
launch/slurm/task.sh starts it) for a UID without a home in the image (HOME=/), apptainer's read-only image and a
HOME that is not bound, or a path baked in for the image's own user. A build there fails with PermissionError when
DeepSpeed first loads an op, in the middle of start-up. So the `megamemo` command, before its subcommand, moves
TORCH_EXTENSIONS_DIR to a writable place when the one in force is not: `~/.cache/torch_extensions/<tag>`, else
`<tmp>/torch_extensions-<uid>/<tag>` (tag: the Python and torch versions, so builds for another torch are never
loaded). A writable place is left alone, whoever chose it."""

from __future__ import annotations

import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def can_write(path: str | Path) -> bool:
    """Whether this process could create `path` (or write into it): its nearest existing ancestor is a directory
    it may write to. Creates nothing."""
    p = Path(path).absolute()
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def in_force(env) -> Path:
    """The folder torch builds under now (TORCH_EXTENSIONS_DIR, else its default root)."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions"


def use_writable_extensions_dir(env=None) -> str | None:
    """Set TORCH_EXTENSIONS_DIR to a writable folder when the one in force is not; returns it (None: unchanged, or
    nowhere writable - then torch's own error says where it tried)."""
    env = os.environ if env is None else env
    if can_write(in_force(env)):
        return None
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{_torch_version()}"
    home = env.get("HOME") or os.path.expanduser("~")
    mine = Path(tempfile.gettempdir()) / f"torch_extensions-{os.getuid()}"
    for base in (Path(home) / ".cache" / "torch_extensions", mine):
        if base == mine and mine.exists() and mine.stat().st_uid != os.getuid():
            continue  # another user's folder of that name in a shared /tmp
        if can_write(base / tag):
            env["TORCH_EXTENSIONS_DIR"] = str(base / tag)
            return env["TORCH_EXTENSIONS_DIR"]
    return None
