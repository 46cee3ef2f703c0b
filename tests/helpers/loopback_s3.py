"""A real S3-protocol server on 127.0.0.1 for tests and benchmarks: moto's standalone server (`moto[server]`, in
the dev extra) as a subprocess, reached by clients through the standard AWS_ENDPOINT_URL variable with dummy
credentials. Loopback only: it never listens on another address."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.loopback import LoopbackServer, upload_dir


class LoopbackS3(LoopbackServer):
    def __init__(self, timeout_s: float = 30):
        super().__init__(
            lambda port: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            "moto's S3 server did not start (pip install 'moto[server]')",
            timeout_s,
        )

    def env(self) -> dict:
        """What a client needs, all through the libraries' standard variables (dummy credentials)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def upload(local: Path, bucket: str, prefix: str, damage=None) -> str:
    """Copy a shard directory to s3://bucket/prefix (the client configured by the environment) -> the URL.
    `damage(name, data) -> bytes | None` may alter or drop files (for tests)."""
    import fsspec

    return upload_dir(fsspec.filesystem("s3", skip_instance_cache=True), local, bucket, prefix, "s3", damage)
