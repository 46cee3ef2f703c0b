"""`model.n_token: auto`: the vocabulary of the run's data, padded for the hardware.

auto reads the vocabulary's size V from the manifest of data.dir (of data.blend's first source: a blend's sources
share one tokenizer) and gives the tables n_token = V rounded up to a multiple of 128 x parallel.tp rows, as
Megatron-LM's --make-vocab-size-divisible-by does: the softmax GEMM gets tensor-core friendly columns and every TP
rank the same number of rows. The padding ids V .. n_token-1 are recorded as model.n_vocab = V and masked out of the
softmax (megamemo/model/adaptive.py mask_padding), so NLL and bits per byte are the unpadded vocabulary's. Where V
is already such a multiple nothing is padded (n_vocab stays unset). An explicit n_token is used as given (the
trainer warns, in one line, when it has rows for ids the data never holds: train/data.py unused_ids).

Planning before the data exists (`megamemo plan --vocab N`): a local data directory with no manifest yet is taken
to hold N symbols - the caller's stated assumption (`fallback`), said once on stderr; training never assumes.

A resumed run keeps its checkpoint's tables: under another tp the checkpoint's n_token (the padding made under the
first layout) is taken when it holds the same vocabulary and splits over the new tp (adopt_checkpoint_vocab).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

from megamemo.config.run import ConfigError
from megamemo.data import ManifestError
from megamemo.data.remote import is_remote, manifest_of
from megamemo.model.config import PAD_MULTIPLE, padded_vocab  # noqa: F401 (the rule lives with the model's n_vocab)


def manifest_vocab(data, fallback: int | None = None) -> int:
    """The vocabulary size recorded in the manifest of data.dir (data.blend[0].dir; a remote one read as the data
    section says); a ConfigError names model.n_token and the directory when there is none. `fallback`: the size
    taken (and said) where a local directory has no manifest.json yet."""
    where, d = ("data.blend[0].dir", data.blend[0].get("dir")) if data.blend else ("data.dir", data.dir)
    if fallback is not None and not (d and (is_remote(d) or (Path(d) / "manifest.json").exists())):
        _say_assumed(where, d, fallback)
        return fallback
    if not d:
        raise ConfigError(
            "model.n_token: auto takes the vocabulary from the data's manifest, but no data directory is "
            "given (--data DIR or data.dir; or set model.n_token to a number)"
        )
    try:
        m = manifest_of(d, data.remote_options())
    except (ManifestError, OSError) as e:
        raise ConfigError(f"model.n_token: auto: cannot read the vocabulary from {where} {d}: {e}") from None
    size = (m.get("vocab") or {}).get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(
            f"model.n_token: auto: the manifest of {where} {d} records no vocabulary size (vocab.size {size!r})"
        )
    return size


@functools.cache
def _say_assumed(where: str, d, size: int) -> None:
    print(
        f"model.n_token: auto: {where} {d or '(none)'} has no manifest.json yet; assuming a vocabulary of {size} "
        f"symbols (--vocab)",
        file=sys.stderr,
        flush=True,
    )


def is_auto(model) -> bool:
    return isinstance(model, dict) and model.get("n_token") == "auto"


def resolve_auto(model: dict, data, tp: int, fallback: int | None = None) -> dict:
    """The model section (n_token: auto) with n_token the padded vocabulary (and n_vocab) of the data (of
    `fallback` symbols where a local data directory has no manifest yet: manifest_vocab)."""
    if model.get("n_vocab") is not None:
        raise ConfigError(
            "model.n_vocab: set by model.n_token: auto (the manifest's vocabulary); give n_vocab only "
            "with an explicit n_token"
        )
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        tp = 1  # parallel.tp's own check names it
    n_token, n_vocab = padded_vocab(manifest_vocab(data, fallback), tp)
    out = {**model, "n_token": n_token}
    out.pop("n_vocab", None)
    return out if n_vocab is None else {**out, "n_vocab": n_vocab}


def adopt_checkpoint_vocab(cfg, saved_model: dict) -> str | None:
    """A run whose n_token is auto, resuming: take the checkpoint's padded tables where they hold the same
    vocabulary, every other model field agrees, and they split over this run's tp (a resume under another layout
    than the one that padded them). In place on cfg.model; -> a line saying so, or None (nothing to adopt: the
    usual model comparison then speaks)."""
    mine = cfg.model.to_dict()
    rest = lambda d: {k: v for k, v in d.items() if k not in ("n_token", "n_vocab")}  # noqa: E731
    n = saved_model.get("n_token")
    if not isinstance(n, int) or n == cfg.model.n_token or rest(saved_model) != rest(mine):
        return None
    vocab = saved_model.get("n_vocab") or n
    if vocab != cfg.model.vocab_size or n % cfg.parallel.tp:
        return None
    cfg.model = dataclasses.replace(cfg.model, n_token=n, n_vocab=saved_model.get("n_vocab")).validate()
    return (
        f"model.n_token: auto keeps the checkpoint's {n} rows for the {vocab} symbols (padded under its layout; "
        f"tp={cfg.parallel.tp} would pad to {mine['n_token']})"
    )
