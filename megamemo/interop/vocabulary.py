"""A checkpoint's vocabulary: what a single-device checkpoint records of the data it was trained on (data_meta:
the tokenizer and the vocabulary's symbols; a subword tokenizer's file copied beside it, checked by sha256), the
vocabulary to encode and decode with (vocab_for: --data's, the checkpoint's file, its symbols, or its training data
directory's) and text encoded with it (encode_prompt). convert writes the record; generate, the harness and the
exports read it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import yaml

from megamemo.data import load_manifest, load_vocab
from megamemo.data.remote import manifest_of
from megamemo.data.tokenizer import SubwordTokenizer, load_recorded, same_tokenizer
from megamemo.data.vocab import Vocab
from megamemo.util.errors import UsageError


def data_meta(data_dir) -> dict:
    """What generation needs from the shard directory: the tokenizer and the vocabulary's symbols. A subword
    tokenizer is recorded as {"kind": "subword", "vocab_size", "file", "sha256", ...}: to_single copies that file
    beside config.json (generate and exports read it from there, checked by its sha256)."""
    m = load_manifest(data_dir)
    v = load_vocab(data_dir)
    vocab = (
        {"kind": v.kind, "file": v.file_name, "size": len(v)}
        if isinstance(v, SubwordTokenizer)
        else {"kind": v.kind, "symbols": v.symbols}
    )
    return {
        "data": {"dir": str(data_dir), "corpus": m.get("corpus")},
        "tokenizer": m.get("tokenizer", {}),
        "vocab": vocab,
    }


def copy_tokenizer(meta: dict, out: Path) -> None:
    """A subword tokenizer's file from the data directory into the converted checkpoint, checked by sha256."""
    tok = meta.get("tokenizer") or {}
    if tok.get("kind") != "subword":
        return
    src = Path((meta.get("data") or {}).get("dir", ""))
    load_recorded(src, tok, f"{src / 'manifest.json'}")  # raises on a changed or missing file
    shutil.copyfile(src / tok["file"], out / tok["file"])


def run_data_meta(step_dir: Path) -> dict:
    """data_meta of the run's data.dir (from <run_dir>/config.yaml), when it is there."""
    cfg = step_dir.parent.parent / "config.yaml"
    try:
        d = (yaml.safe_load(cfg.read_text()) or {}).get("data", {}).get("dir") if cfg.is_file() else None
        return data_meta(d) if d and (Path(d) / "manifest.json").is_file() else {}
    except Exception:  # the vocabulary is a convenience for generate
        return {}


def vocab_for(meta: dict, data_dir=None, ckpt=None):
    """The vocabulary or subword tokenizer to encode the prompt and decode with: --data's (which must hold the
    tokenizer the checkpoint records), else the file the checkpoint carries (tokenizer.json beside config.json,
    checked by sha256), else its symbols, else its training data directory's."""
    tok = meta.get("tokenizer") or {}
    if data_dir:  # a local directory or an s3:// gs:// https:// one
        theirs = manifest_of(data_dir).get("tokenizer") or {}
        if tok and not same_tokenizer(tok, theirs):
            raise UsageError(
                f"--data {data_dir}: its tokenizer ({theirs.get('kind')}, sha256 "
                f"{str(theirs.get('sha256'))[:12]}) differs from the one the checkpoint was trained "
                f"with ({tok.get('kind')}, sha256 {str(tok.get('sha256'))[:12]})"
            )
        return load_vocab(data_dir)
    if tok.get("kind") == "subword":
        if ckpt and (Path(ckpt) / str(tok.get("file"))).is_file():
            return load_recorded(ckpt, tok, f"{Path(ckpt) / 'config.json'}")
        d = (meta.get("data") or {}).get("dir")
        if d and (Path(d) / "manifest.json").is_file():
            return vocab_for({"tokenizer": tok}, d)
        raise UsageError(
            f"the checkpoint records the subword tokenizer {tok.get('file')} (sha256 "
            f"{str(tok.get('sha256'))[:12]}) but neither it nor its data directory is there: pass "
            f"--data SHARD_DIR"
        )
    v = meta.get("vocab")
    if isinstance(v, dict) and "symbols" in v and "kind" in v:
        return Vocab(v["kind"], list(v["symbols"]))
    d = (meta.get("data") or {}).get("dir")
    if d and (Path(d) / "manifest.json").is_file():
        return load_vocab(d)
    raise UsageError(
        "the checkpoint records no vocabulary (config.json meta.vocab / meta.data.dir): pass "
        "--data SHARD_DIR to use that directory's vocabulary"
    )


def encode_prompt(vocab, raw: bytes, where: str) -> list[int]:
    if vocab.kind == "subword":
        try:
            return vocab.encode(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UsageError(f"{where}: not UTF-8 text (byte {e.start})") from None
    if vocab.kind in ("bytes", "chars"):
        return [int(i) for i in vocab.encode_bytes(np.frombuffer(raw, dtype=np.uint8), where=where)]
    text = raw.decode("utf-8")
    ids: list[int] = []
    lines = text.split("\n")
    for k, line in enumerate(lines):
        words = line.split()
        if k < len(lines) - 1:
            words.append("<eos>")
        got, _ = vocab.encode_words(words, where=where)
        ids += got
    return ids


# What starts a stream that has no context of its own (an empty lm-eval context, the BOS/EOS of an exported
# tokenizer): <eos> for words, else a newline, else a space (text8's "_").
START_SYMBOLS = ("<eos>", "10", "_", "32")


def start_symbol(vocab) -> str | None:
    """The first of START_SYMBOLS the vocabulary has; None for a vocabulary with none of them."""
    return next((s for s in START_SYMBOLS if s in vocab.sym2idx), None)
