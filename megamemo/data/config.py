"""The data section of a run config (`data.*`): where the shards are, the global batch, the roll, the remote
cache and blends. Declared and checked here without reading the data (the directories themselves are checked by
megamemo/train/data.py when the run starts)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from pydantic import model_validator

from megamemo.config.fields import Bool, Field, Float, Int, section
from megamemo.config.run import ConfigError

from .remote import RemoteOptions
from .shards import _parse_size


@section("data")
class DataConfig:
    dir: str = ""  # shard directory written by `megamemo prepare` (holds manifest.json); or a
    # remote one, s3://bucket/prefix, gs://bucket/prefix or https://host/path
    # (fsspec; pip install megamemo[s3] / megamemo[gcs]; credentials only from the
    # storage library's standard environment/config): its shards are fetched whole
    # into cache_dir, checked against the manifest's sha256 (megamemo/data/remote.py)
    split: str = "train"  # the split the run trains on
    # global batch B: contiguous streams (columns) over all data-parallel ranks
    batch_size: Annotated[Int, Field(ge=1)] = 22
    roll: Bool = False  # LaMemo's per-epoch, per-column seeded rotation of the streams
    seed: Int = 1111  # seed of the roll offsets
    prefetch: Annotated[Int, Field(ge=0)] = 0  # background prefetch depth of the reader (0: none)
    cache_dir: str = ""  # where a remote dir's shards are cached ("": $XDG_CACHE_HOME/megamemo/shards)
    cache_size: str = "50G"  # size limit of cache_dir (50G, 800M): least recently used shards evicted beyond it
    # retries of a transient storage error (backoff doubling from retry_backoff_s)
    retries: Annotated[Int, Field(ge=0)] = 5
    # first wait before a retry; doubled after each, at most 30 s
    retry_backoff_s: Annotated[Float, Field(ge=0)] = 1.0
    fetch_threads: Annotated[Int, Field(ge=1)] = 4  # concurrent shard downloads of the read-ahead
    # weighted blend of shard directories (local and remote mixed) instead of dir: [{dir: ..., weight: ...}, ...]
    blend: list[dict] = field(default_factory=list)

    @model_validator(mode="after")
    def _rules(self) -> DataConfig:
        """data.cache_size's form, data.blend against data.dir, and data.blend's entries."""
        try:
            if _parse_size(self.cache_size) < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"data.cache_size: expected a size like 50G or 800M, got {self.cache_size!r}") from None
        if self.blend and self.dir:
            raise ConfigError("data.blend: give either data.dir (--data) or data.blend, not both")
        for i, e in enumerate(self.blend):
            if set(e) != {"dir", "weight"}:
                raise ConfigError(f"data.blend[{i}]: expected {{dir, weight}}, got keys {sorted(e)}")
            if not isinstance(e["dir"], str) or not e["dir"]:
                raise ConfigError(f"data.blend[{i}].dir: expected a directory or URL, got {e['dir']!r}")
            w = e["weight"]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                raise ConfigError(f"data.blend[{i}].weight: expected a positive number, got {w!r}")
        return self

    def remote_options(self):
        """How s3:// gs:// https:// shard directories are read (data.cache_dir, data.cache_size, data.retries, ...)."""
        return RemoteOptions(
            cache_dir=self.cache_dir,
            cache_size=self.cache_size,
            retries=self.retries,
            retry_backoff_s=self.retry_backoff_s,
            fetch_threads=self.fetch_threads,
            log=lambda m: print(m, flush=True),
        )
