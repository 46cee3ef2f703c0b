"""A Google Cloud Storage emulator on 127.0.0.1 for tests: `gcp-storage-emulator` (in the dev extra) as a
subprocess, reached by gcsfs through the standard STORAGE_EMULATOR_HOST variable, anonymously. Loopback only.

gcsfs (2025.x and later) by default asks the Storage Control API, over gRPC, what kind of bucket it reads (for
zonal / hierarchical buckets); no emulator serves that API, and each ask waits 60 s for its timeout before falling
back to the JSON API. ``env()`` therefore sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (gcsfs's own switch,
read when gcsfs is imported), so the plain JSON-API filesystem, which every standard bucket supports, is used.
"""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.loopback import LoopbackServer, upload_dir


class LoopbackGCS(LoopbackServer):
    def __init__(self, timeout_s: float = 30):
        super().__init__(
            lambda port: [
                sys.executable,
                "-m",
                "gcp_storage_emulator",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--in-memory",
            ],
            "the GCS emulator did not start (pip install gcp-storage-emulator)",
            timeout_s,
        )

    def env(self) -> dict:
        """What gcsfs needs, through its standard variables (no credentials: the emulator takes anonymous calls)."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def upload(local: Path, bucket: str, prefix: str, damage=None) -> str:
    """Copy a shard directory to gs://bucket/prefix (gcsfs, pointed at the emulator by the environment) -> the
    URL. `damage(name, data) -> bytes | None` may alter or drop files (for tests)."""
    import gcsfs

    return upload_dir(gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True), local, bucket, prefix, "gs", damage)
