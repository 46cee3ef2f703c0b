"""A real S3-protocol server on 127.0.0.1 for tests and benchmarks: moto's standalone server (`moto[server]`, in
the dev extra) as a subprocess, reached by clients through the standard AWS_ENDPOINT_URL variable with dummy
credentials. Loopback only: it never listens on another address."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackS3:
    def __init__(self, timeout_s: float = 30):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError("moto's S3 server did not start (pip install 'moto[server]')") from None
                time.sleep(0.05)

    def env(self) -> dict:
        """What a client needs, all through the libraries' standard variables (dummy credentials)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def upload(local: Path, bucket: str, prefix: str, damage=None) -> str:
    """Copy a shard directory to s3://bucket/prefix (the client configured by the environment) -> the URL.
    `damage(name, data) -> bytes | None` may alter or drop files (for tests)."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for p in sorted(Path(local).iterdir()):
        data = p.read_bytes()
        if damage is not None:
            data = damage(p.name, data)
        if data is not None:
            fs.pipe_file(f"{bucket}/{prefix}/{p.name}", data)
    return f"s3://{bucket}/{prefix}"
