"""Test support (not shipped with megamemo): object-storage servers on 127.0.0.1 for tests and benchmarks: a server
subprocess started on a free port and waited for, and the upload of a shard directory to it. loopback_s3.py (moto) and
loopback_gcs.py (a GCS emulator) say which server and which client variables. Loopback only: a server never listens on
another address."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from megamemo.runtime.dist import free_port


class LoopbackServer:
    """`argv(port)` run as a subprocess; returns once the port takes connections (else RuntimeError: `hint`)."""

    def __init__(self, argv, hint: str, timeout_s: float = 30):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(argv(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(hint) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def upload_dir(fs, local: Path, bucket: str, prefix: str, scheme: str, damage=None) -> str:
    """Copy a shard directory to scheme://bucket/prefix through the fsspec filesystem `fs` -> the URL.
    `damage(name, data) -> bytes | None` may alter or drop files (for tests)."""
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for p in sorted(Path(local).iterdir()):
        data = p.read_bytes()
        if damage is not None:
            data = damage(p.name, data)
        if data is not None:
            fs.pipe_file(f"{bucket}/{prefix}/{p.name}", data)
    return f"{scheme}://{bucket}/{prefix}"
