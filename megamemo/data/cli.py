"""`megamemo prepare` and `megamemo verify-shards` (also `python -m megamemo.data prepare|verify-shards`)."""

from __future__ import annotations

import argparse
import sys
import time

from . import corpora, text_files
from .shard_reader import verify_shards
from .shards import ManifestError, ShardError, build
from .subword import subword_text

CORPORA = ("enwik8", "text8", "wikitext-103", "text")
MODES = {"enwik8": ("bytes", "reference"), "text8": ("chars", "reference")}


def _prepare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megamemo prepare",
        description="Build zstd webdataset token shards and manifest.json from a raw corpus.",
        epilog="enwik8/text8: --raw FILE, split 90/5/5 by byte position (90M/5M/5M for the full file). "
        "wikitext-103: --raw DIR with wiki.{train,valid,test}.tokens. "
        "text: --raw FILE... (plain text or .jsonl), byte-level unless --vocab or --tokenizer is given.",
    )
    p.add_argument("corpus", choices=CORPORA, help="the corpus's kind: how --raw is read and split")
    p.add_argument("--raw", nargs="+", required=True, help="raw corpus file(s) or directory")
    p.add_argument("--out", required=True, help="output directory for shards + manifest.json")
    p.add_argument(
        "--mode",
        default=None,
        help="enwik8: bytes (default, keeps newlines) | reference (Transformer-XL: newlines dropped, "
        "frequency-ordered vocabulary); text8: chars (default) | reference",
    )
    p.add_argument("--vocab", default=None, help="vocabulary file, one symbol per line (wikitext-103, text)")
    p.add_argument("--valid", nargs="+", default=None, help="text: validation files")
    p.add_argument("--test", nargs="+", default=None, help="text: test files")
    p.add_argument("--split", default="90,5,5", help="text without --valid/--test: train,valid,test proportions")
    p.add_argument("--jsonl-field", default="text", help="text: field of each jsonl record holding the text")
    p.add_argument("--doc-sep", default="\n", help="text, byte-level jsonl: bytes appended after each document")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="text: subword tokenizer: bpe:N (train a byte-level BPE of N symbols on the train split) "
        "or a tokenizer.json / SentencePiece .model file; documents from .jsonl, .parquet, "
        "directories and text files, an end-of-document token after each",
    )
    p.add_argument("--workers", type=int, default=1, help="text with --tokenizer: tokenizing processes")
    p.add_argument(
        "--split-seed",
        type=int,
        default=1234,
        help="text with --tokenizer: seed of the split of whole documents into train/valid/test",
    )
    p.add_argument(
        "--dtype",
        choices=("u1", "u2", "u4"),
        default=None,
        help="token dtype (default: the smallest that holds the vocabulary)",
    )
    p.add_argument("--chunk-tokens", type=int, default=1 << 16, help="tokens per zstd chunk (default 65536)")
    p.add_argument("--shard-size", default="256M", help="target shard size, e.g. 64M, 1G (default 256M)")
    p.add_argument("--zstd-level", type=int, default=3, help="zstd compression level of the shards' token chunks")
    p.add_argument("--overwrite", action="store_true", help="replace shards of an existing manifest in --out")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _corpus(a) -> corpora.Corpus:
    if a.corpus in MODES and a.mode is not None and a.mode not in MODES[a.corpus]:
        raise ValueError(f"--mode {a.mode!r} is not one of {MODES[a.corpus]} for {a.corpus}")
    if a.corpus not in MODES and a.mode is not None:
        raise ValueError("--mode applies to enwik8 and text8 only")
    if a.corpus in ("enwik8", "text8", "wikitext-103") and len(a.raw) != 1:
        raise ValueError(f"{a.corpus}: --raw takes exactly one path, got {len(a.raw)}")
    if a.corpus != "text" and (a.valid or a.test):
        raise ValueError("--valid/--test apply to the text corpus only")
    if a.tokenizer and (a.corpus != "text" or a.vocab):
        raise ValueError("--tokenizer applies to the text corpus only, without --vocab")
    if a.corpus != "text" and (a.workers != 1 or a.dtype):
        raise ValueError("--dtype and --workers apply to the text corpus with --tokenizer only")
    if a.vocab and a.corpus in MODES:
        raise ValueError(f"--vocab does not apply to {a.corpus} (its vocabulary is fixed by --mode)")
    if a.corpus == "enwik8":
        return corpora.enwik8(a.raw[0], a.mode or "bytes")
    if a.corpus == "text8":
        return corpora.text8(a.raw[0], a.mode or "chars")
    if a.corpus == "wikitext-103":
        return corpora.wikitext103(a.raw[0], a.vocab)
    try:
        ratio = tuple(int(x) for x in a.split.split(","))
        assert len(ratio) == 3 and min(ratio) >= 0 and ratio[0] > 0
    except (ValueError, AssertionError):
        raise ValueError(f"--split must be three non-negative integers like 90,5,5, got {a.split!r}") from None
    if a.tokenizer:
        return subword_text(
            a.raw,
            a.valid,
            a.test,
            a.tokenizer,
            a.jsonl_field,
            ratio,
            a.split_seed,
            a.workers,
            "<" + a.dtype if a.dtype else None,
            log=None if a.quiet else _stderr,
        )
    if a.dtype or a.workers != 1:
        raise ValueError(
            "--dtype and --workers apply to the text corpus with --tokenizer only (byte, character and "
            "word corpora are prepared in one process)"
        )
    return text_files.text(a.raw, a.valid, a.test, a.vocab, a.jsonl_field, a.doc_sep, ratio)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare_main(argv: list[str]) -> int:
    a = _prepare_parser().parse_args(argv)
    try:
        corpus = _corpus(a)
        build(
            corpus,
            a.out,
            chunk_tokens=a.chunk_tokens,
            shard_bytes=a.shard_size,
            zstd_level=a.zstd_level,
            overwrite=a.overwrite,
            log=(lambda m: None) if a.quiet else None,
            bar=False if a.quiet else None,
        )  # a progress bar on a terminal, else periodic lines
    except (ValueError, OSError, ShardError) as e:
        print(f"megamemo prepare: error: {e}", file=sys.stderr)
        return 2
    return 0


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="megamemo verify-shards",
        description="Check every shard of a directory against its manifest.json: "
        "size, sha256, tar structure, zstd frames, token counts, id range.",
    )
    p.add_argument("dir", help="shard directory made by `megamemo prepare` (holds manifest.json)")
    p.add_argument("--split", nargs="+", default=None, help="only these splits")
    a = p.parse_args(argv)
    t0 = time.time()
    try:
        problems = verify_shards(a.dir, a.split)
    except (ManifestError, OSError) as e:
        problems = [str(e)]
    if problems:
        print(f"megamemo verify-shards: {len(problems)} problem(s) in {a.dir}:", file=sys.stderr)
        for msg in problems:
            print(f"  {msg}", file=sys.stderr)
        return 1
    print(f"megamemo verify-shards: {a.dir}: all shards match manifest.json ({time.time() - t0:.1f}s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"prepare": prepare_main, "verify-shards": verify_main, "verify": verify_main}
    if not argv or argv[0] not in cmds:
        print("usage: python -m megamemo.data {prepare|verify-shards} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return cmds[argv[0]](argv[1:])
