"""The trainer's side of data_pipeline: checks of the shard directory before start-up, and readers.

Each data-parallel rank reads its own B/W contiguous columns with data_pipeline.StreamReader; its state
(epoch, step) is the data cursor saved in every checkpoint.
"""
from __future__ import annotations

from pathlib import Path

from megamemo.config import RunConfig


class DataError(ValueError):
    """A missing or unusable data directory; the message names it."""


def remote_options(cfg: RunConfig):
    """How s3:// gs:// https:// shard directories are read (data.cache_dir, data.cache_size, data.retries, ...)."""
    from data_pipeline.remote import RemoteOptions

    d = cfg.data
    return RemoteOptions(cache_dir=d.cache_dir, cache_size=d.cache_size, retries=d.retries,
                         retry_backoff_s=d.retry_backoff_s, fetch_threads=d.fetch_threads,
                         log=lambda m: print(m, flush=True))


def _remote_manifest(cfg: RunConfig, url: str, field: str) -> dict:
    from data_pipeline import ManifestError, ShardError
    from data_pipeline.remote import RemoteShards

    try:
        remote = RemoteShards(url, remote_options(cfg))
    except (ManifestError, ShardError) as e:
        raise DataError(f"{field}: {e}") from None
    remote.close()
    return remote.manifest


def _manifest(cfg: RunConfig) -> dict:
    from data_pipeline import ManifestError, load_manifest
    from data_pipeline.remote import is_remote

    if not cfg.data.dir:
        raise DataError("data.dir: no shard directory given (--data DIR or data.dir in the config)")
    if is_remote(cfg.data.dir):
        return _remote_manifest(cfg, cfg.data.dir, "data.dir")
    d = Path(cfg.data.dir)
    if not d.is_dir():
        raise DataError(f"data.dir: {d} does not exist (build it with `megamemo prepare CORPUS --raw PATH --out {d}`)")
    try:
        return load_manifest(d)
    except ManifestError as e:
        raise DataError(f"data.dir: {e}") from None


def check_data_dir(cfg: RunConfig) -> dict:
    """The manifest of data.dir after checking the splits and vocabulary the run needs."""
    m = _manifest(cfg)
    splits = [cfg.data.split] + ([cfg.eval.split] if cfg.eval.every else [])
    for s in splits:
        if s not in m["splits"]:
            raise DataError(f"data.dir: {cfg.data.dir} has no split {s!r} (has {sorted(m['splits'])})")
    v = int(m["vocab"]["size"])
    if v > cfg.model.n_token:
        raise DataError(f"model.n_token: {cfg.model.n_token} is smaller than the vocabulary of {cfg.data.dir} "
                        f"({v} symbols)")
    return m


def unit_for(cfg: RunConfig) -> str:
    """bpc for character/byte-level corpora, perplexity for word-level ones."""
    try:
        kind = _manifest(cfg)["tokenizer"].get("kind", "")
    except DataError:
        return "bpc"
    from data_pipeline.vocab import word_level

    return "ppl" if word_level(kind) else "bpc"


def open_reader(cfg: RunConfig, split: str, batch_size: int, tgt_len: int, dp: int, dp_rank: int, *, train: bool):
    from data_pipeline import StreamReader

    if batch_size % dp:
        where = "data.batch_size" if train else "eval.batch_size"
        raise DataError(f"{where}: {batch_size} streams do not split over {dp} data-parallel ranks")
    try:
        return StreamReader(cfg.data.dir, split, batch_size, tgt_len, dp, dp_rank,
                            roll=cfg.data.roll and train, seed=cfg.data.seed, epochs=None if train else 1,
                            prefetch=cfg.data.prefetch if train else 0, remote_options=remote_options(cfg))
    except ValueError as e:         # e.g. a split too short for the batch
        raise DataError(f"{'data' if train else 'eval'}.batch_size: {e}") from None
