"""The data section's checks that do not need the data: cache size, retries, read-ahead threads and data.blend's
entries (the directories themselves are checked by megamemo.train.data when the run starts)."""
from __future__ import annotations


def check_data_source(d, error=ValueError) -> None:
    """data.cache_size, data.retries, ... and data.blend's entries of a DataConfig `d`; a bad one raises `error`
    (run.py's ConfigError) naming the key."""
    from data_pipeline.shards import _parse_size

    try:
        if _parse_size(d.cache_size) < 0:
            raise ValueError
    except ValueError:
        raise error(f"data.cache_size: expected a size like 50G or 800M, got {d.cache_size!r}") from None
    if d.retries < 0:
        raise error(f"data.retries: must be >= 0 (got {d.retries})")
    if d.retry_backoff_s < 0:
        raise error(f"data.retry_backoff_s: must be >= 0 (got {d.retry_backoff_s})")
    if d.fetch_threads < 1:
        raise error(f"data.fetch_threads: must be >= 1 (got {d.fetch_threads})")
    if d.blend and d.dir:
        raise error("data.blend: give either data.dir (--data) or data.blend, not both")
    for i, e in enumerate(d.blend):
        if set(e) != {"dir", "weight"}:
            raise error(f"data.blend[{i}]: expected {{dir, weight}}, got keys {sorted(e)}")
        if not isinstance(e["dir"], str) or not e["dir"]:
            raise error(f"data.blend[{i}].dir: expected a directory or URL, got {e['dir']!r}")
        w = e["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise error(f"data.blend[{i}].weight: expected a positive number, got {w!r}")
