"""The trainer's side of megamemo.data: checks of the shard directories before start-up, and readers. Each function
takes the data section (megamemo/data/config.py) alone, but the start-up check, which holds the data against the
run's model and validation.

Each data-parallel rank reads its own B/W contiguous columns with megamemo.data.StreamReader (data.dir: a local
directory or an s3:// gs:// https:// URL) or megamemo.data.blend.BlendReader (data.blend); its state is the data
cursor saved in every checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from megamemo.data import ManifestError, ShardError, load_manifest
from megamemo.data.blend import BlendError, BlendReader, tokenizer_identity
from megamemo.data.config import DataConfig
from megamemo.data.remote import RemoteShards, is_remote
from megamemo.data.stream import StreamReader
from megamemo.data.vocab import unit_of
from megamemo.train.config import RunConfig
from megamemo.util.errors import MegamemoError


class DataError(MegamemoError, ValueError):
    """A missing or unusable data directory; the message names it."""


def _remote_manifest(data: DataConfig, splits: list[str], url: str, field: str) -> dict:
    try:
        remote = RemoteShards(url, data.remote_options())
        try:  # one listing: missing or wrong-sized objects named before the model is built
            remote.check_listing(
                [e for name, sp in remote.manifest["splits"].items() if name in splits for e in sp["shards"]]
            )
        finally:
            remote.close()
    except ShardError:
        raise  # names the object itself
    except ManifestError as e:
        raise DataError(f"{field}: {e}") from None
    return remote.manifest


def _sources(data: DataConfig) -> list[tuple[str, str]]:
    """(config field, directory or URL) of every data source: data.dir, or each data.blend entry."""
    if data.blend:
        return [(f"data.blend[{i}].dir", str(e["dir"])) for i, e in enumerate(data.blend)]
    return [("data.dir", data.dir)]


def _manifest_of(data: DataConfig, splits: list[str], field: str, d: str) -> dict:
    if not d:
        raise DataError("data.dir: no shard directory given (--data DIR or data.dir in the config)")
    if is_remote(d):
        return _remote_manifest(data, splits, d, field)
    if not Path(d).is_dir():
        raise DataError(f"{field}: {d} does not exist (build it with `megamemo prepare CORPUS --raw PATH --out {d}`)")
    try:
        return load_manifest(d)
    except ManifestError as e:
        raise DataError(f"{field}: {e}") from None


def _manifest(data: DataConfig) -> dict:
    """The manifest of data.dir (of the first source of a blend)."""
    return _manifest_of(data, [data.split], *_sources(data)[0])


def check_data_dir(cfg: RunConfig) -> dict:
    """The manifest of data.dir (the first blend source) after checking the splits, vocabulary and, for a blend,
    the one tokenizer that the run needs (the run's data against its model and validation)."""
    data = cfg.data
    used = [data.split] + ([cfg.eval.split] if cfg.eval.every else [])
    first = None
    for i, (field, d) in enumerate(_sources(data)):
        m = _manifest_of(data, used, field, d)
        for s in used if i == 0 else [data.split]:  # validation reads the first source
            if s not in m["splits"]:
                raise DataError(f"{field}: {d} has no split {s!r} (has {sorted(m['splits'])})")
        v = int(m["vocab"]["size"])
        if v > cfg.model.vocab_size:
            what = "n_vocab" if cfg.model.n_vocab is not None else "n_token"
            raise DataError(f"model.{what}: {cfg.model.vocab_size} is smaller than the vocabulary of {d} ({v} symbols)")
        if first is None:
            first = m
            continue
        a, b = tokenizer_identity(first), tokenizer_identity(m)
        diff = [f"{k} {b[k]!r} vs {a[k]!r}" for k in a if a[k] != b[k]]
        if diff:
            raise DataError(
                f"{field}: {d} has another tokenizer than data.blend[0].dir ({', '.join(diff)}); the "
                f"sources of a blend must share one"
            )
    assert first is not None  # _sources gives data.dir at least
    return first


def unused_ids(cfg: RunConfig, manifest: dict | None) -> str | None:
    """One warning line where the model's vocabulary (an explicit n_token, or n_vocab) has ids the data's vocabulary
    never holds - rows trained in the softmax without ever being a target - naming them; None where it has none
    (n_token: auto sizes the tables to the data), or no data directory (check_data_dir's None)."""
    if manifest is None:
        return None
    v, n = int(manifest["vocab"]["size"]), cfg.model.vocab_size
    if v >= n:
        return None
    what = "n_vocab" if cfg.model.n_vocab is not None else "n_token"
    ids = f"id {v}" if n - v == 1 else f"ids {v}..{n - 1}"
    return (
        f"model.{what}: {n} symbols, but the data's vocabulary has {v}: {ids} ({n - v}) never occur and are "
        f"trained in the softmax unseen (model.n_token: auto sizes the tables to the data)"
    )


def unit_for(data: DataConfig) -> str:
    """bpc for character/byte-level corpora, perplexity for word-level and subword ones."""
    try:
        kind = _manifest(data)["tokenizer"].get("kind", "")
    except DataError:
        return "bpc"
    return unit_of(kind)


def bytes_per_token(data: DataConfig) -> dict[str, float]:
    """Per split, the UTF-8 bytes of its text over its tokens (subword corpora record n_bytes): training and
    validation lines report bits per byte = loss / ln 2 / this ratio. {} for other corpora."""
    try:
        m = _manifest(data)
    except DataError:
        return {}
    return {
        s: sp["n_bytes"] / sp["n_tokens"]
        for s, sp in m["splits"].items()
        if isinstance(sp.get("n_bytes"), int) and sp["n_bytes"] > 0 and sp["n_tokens"] > 0
    }


def stream(
    data: DataConfig,
    split: str,
    batch_size: int,
    tgt_len: int,
    world_size: int,
    rank: int,
    *,
    roll: bool,
    epochs: int | None,
    prefetch: int = 0,
    block_tokens: int = 1 << 20,
    mix_every: int = 0,
):
    """The reader of a run's data: a StreamReader of data.dir, or for data.blend (training split) a
    BlendReader. Evaluation of a blend reads the first source's split."""
    if data.blend and split == data.split and epochs is None:
        return BlendReader(
            [(e["dir"], e["weight"]) for e in data.blend],
            split,
            batch_size,
            tgt_len,
            world_size,
            rank,
            seed=data.seed,
            mix_every=mix_every,
            log=lambda m: print(m, flush=True),
            remote_options=data.remote_options(),
        )
    return StreamReader(
        _sources(data)[0][1],
        split,
        batch_size,
        tgt_len,
        world_size,
        rank,
        roll=roll,
        seed=data.seed,
        epochs=epochs,
        prefetch=prefetch,
        block_tokens=block_tokens,
        remote_options=data.remote_options(),
    )


def open_reader(
    data: DataConfig,
    split: str,
    batch_size: int,
    tgt_len: int,
    dp: int,
    dp_rank: int,
    *,
    train: bool,
    mix_every: int = 0,
):
    """This data-parallel rank's reader of the training split (train) or the validation split; mix_every: how often
    a blend reports its token mix (steps; 0: never)."""
    if batch_size % dp:
        where = "data.batch_size" if train else "eval.batch_size"
        raise DataError(f"{where}: {batch_size} streams do not split over {dp} data-parallel ranks")
    try:
        return stream(
            data,
            split,
            batch_size,
            tgt_len,
            dp,
            dp_rank,
            roll=data.roll and train,
            epochs=None if train else 1,
            prefetch=data.prefetch if train else 0,
            mix_every=mix_every,
        )
    except BlendError as e:
        raise DataError(f"data.blend: {e}") from None
    except ValueError as e:  # e.g. a split too short for the batch
        raise DataError(f"{'data' if train else 'eval'}.batch_size: {e}") from None
