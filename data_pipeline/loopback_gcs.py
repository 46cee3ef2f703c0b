"""A Google Cloud Storage emulator on 127.0.0.1 for tests: `gcp-storage-emulator` (in the dev extra) as a
subprocess, reached by gcsfs through the standard STORAGE_EMULATOR_HOST variable, anonymously. Loopback only.

gcsfs (2025.x and later) by default asks the Storage Control API, over gRPC, what kind of bucket it reads (for
zonal / hierarchical buckets); no emulator serves that API, and each ask waits 60 s for its timeout before falling
back to the JSON API. ``env()`` therefore sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (gcsfs's own switch,
read when gcsfs is imported), so the plain JSON-API filesystem, which every standard bucket supports, is used.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from .loopback_s3 import _free_port


class LoopbackGCS:
    def __init__(self, timeout_s: float = 30):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--in-memory"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError("the GCS emulator did not start (pip install gcp-storage-emulator)") from None
                time.sleep(0.05)

    def env(self) -> dict:
        """What gcsfs needs, through its standard variables (no credentials: the emulator takes anonymous calls)."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def upload(local: Path, bucket: str, prefix: str, damage=None) -> str:
    """Copy a shard directory to gs://bucket/prefix (gcsfs, pointed at the emulator by the environment) -> the
    URL. `damage(name, data) -> bytes | None` may alter or drop files (for tests)."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for p in sorted(Path(local).iterdir()):
        data = p.read_bytes()
        if damage is not None:
            data = damage(p.name, data)
        if data is not None:
            fs.pipe_file(f"{bucket}/{prefix}/{p.name}", data)
    return f"gs://{bucket}/{prefix}"
