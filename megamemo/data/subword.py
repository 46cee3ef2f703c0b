"""The subword text corpus: documents -> a subword tokenizer -> one stream per split, tokenized in N processes.

    corpus = subword_text(["docs.jsonl"], tokenizer="bpe:32000", workers=8)     # or tokenizer="tokenizer.json"
    build(corpus, "data/mine")                                                  # megamemo.data.shards

Every document is followed by the tokenizer's end-of-document token. The input is read once per pass (a second
pass first, over the train split's documents only, when a BPE is trained). Blocks of whole documents (~1 MiB)
go to the workers in order; at most 2N+1 are in flight, and their results are written in input order, so the
shards are the same bytes for any N and memory does not grow with the corpus.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections import deque
from collections.abc import Iterator

import numpy as np

from .corpora import Corpus
from .documents import SPLITS, DocumentSplit, check_sources, iter_blocks, list_sources, parse_block
from .tokenizer import SubwordTokenizer, parse_spec, single_threaded, train_bpe

_WORKER_TOK: SubwordTokenizer | None = None


def encode_block(tok: SubwordTokenizer, block: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens per document incl. its end-of-document token, all ids as uint32, UTF-8 bytes per document)."""
    texts = parse_block(block)
    eod = tok.eod_id
    assert eod is not None  # prepare checked it (require_eod)
    flat: list[int] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for k, ids in enumerate(tok.encode_batch(texts)):
        flat += ids
        flat.append(eod)
        lengths[k] = len(ids) + 1
    nbytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    return lengths, np.asarray(flat, dtype=np.uint32), nbytes


def _init_worker(library: str, data: bytes) -> None:
    global _WORKER_TOK
    single_threaded()
    _WORKER_TOK = SubwordTokenizer.from_bytes(data, library, "tokenizer")


def _encode_in_worker(block: tuple):
    assert _WORKER_TOK is not None, "the worker's initializer loads the tokenizer"
    return encode_block(_WORKER_TOK, block)


def encoded_blocks(tok: SubwordTokenizer, blocks, workers: int) -> Iterator[tuple[int, tuple]]:
    """(input bytes, encode_block result) in input order; workers > 1: in that many processes."""
    if workers <= 1:
        for nb, block in blocks:
            yield nb, encode_block(tok, block)
        return
    pool = mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok.library, tok.data))
    pending: deque = deque()
    try:
        for nb, block in blocks:
            pending.append((nb, pool.apply_async(_encode_in_worker, (block,))))
            if len(pending) > 2 * workers:
                nb0, res = pending.popleft()
                yield nb0, res.get()
        while pending:
            nb0, res = pending.popleft()
            yield nb0, res.get()
    finally:
        pool.terminate()
        pool.join()


def subword_text(
    files,
    valid=None,
    test=None,
    tokenizer: str = "bpe:32000",
    field: str = "text",
    ratio=(90, 5, 5),
    seed: int = 1234,
    workers: int = 1,
    dtype: str | None = None,
    log=None,
) -> Corpus:
    """A Corpus whose splits are written together in one pass (`Corpus.interleaved`)."""
    single_threaded()
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    groups = {"train": list_sources(files)}
    if valid:
        groups["valid"] = list_sources(valid)
    if test:
        groups["test"] = list_sources(test)
    for srcs in groups.values():
        check_sources(srcs, field)
    if len(groups) == 1:
        plans = [(groups["train"], DocumentSplit(ratio, seed))]
    else:
        plans = [(srcs, DocumentSplit(fixed=s)) for s, srcs in groups.items()]
    names = list(SPLITS) if len(groups) == 1 else list(groups)
    all_files = [str(s.path) for srcs in groups.values() for s in srcs]

    how, arg = parse_spec(tokenizer)
    if how == "bpe":
        assert isinstance(arg, int)
        train_srcs, split = plans[0]
        (log or (lambda m: None))(f"[prepare] training a byte-level BPE of {arg} symbols on the train split")
        tok = train_bpe(_train_texts(train_srcs, field, split, all_files), arg)
        if tok.vocab_size < arg:  # a warning: said under --quiet too
            print(saturated(tok.vocab_size, arg), file=sys.stderr, flush=True)
    else:
        assert isinstance(arg, str)
        tok = SubwordTokenizer.from_file(arg)
    tok.require_eod()
    if dtype is not None:
        limit = np.iinfo(np.dtype(dtype)).max
        if tok.vocab_size - 1 > limit:
            raise ValueError(
                f"tokenizer {tok.where}: a vocabulary of {tok.vocab_size} symbols does not fit the "
                f"token dtype {dtype} (ids up to {limit})"
            )

    def interleaved(stats: dict) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        per = stats.setdefault("splits", {s: {"n_bytes": 0, "n_documents": 0} for s in names})
        for srcs, split in plans:
            doc = 0
            for nb, (lengths, ids, nbytes) in encoded_blocks(tok, iter_blocks(srcs, field), workers):
                stats["input_bytes"] = stats.get("input_bytes", 0) + nb
                which = split.assign(doc, lengths.size)
                doc += lengths.size
                for si in np.unique(which):
                    sel = which == si
                    s = SPLITS[int(si)]
                    per[s]["n_bytes"] += int(nbytes[sel].sum())
                    per[s]["n_documents"] += int(sel.sum())
                    yield s, (ids if sel.all() else ids[np.repeat(sel, lengths)]), lengths[sel]
        if not sum(p["n_documents"] for p in per.values()):
            raise ValueError(f"{', '.join(all_files)}: no documents")

    rec = tok.record()
    rec.update({"end_of_document": "after every document", "jsonl_field": field})
    sizes = {s: sum(x.size for x in srcs) for s, srcs in groups.items()}
    src = {
        "files": {s: [{"path": str(x.path), "bytes": x.size} for x in srcs] for s, srcs in groups.items()},
        "split": plans[0][1].record() if len(plans) == 1 else {"by": "one file group per split"},
    }
    return Corpus(
        "text",
        "subword",
        tok,
        rec,
        {s: None for s in names},
        {"all": sum(sizes.values())},
        src,
        interleaved=interleaved,
        dtype=dtype,
        documents=True,
    )


def saturated(got: int, asked: int) -> str:
    """The line prepare prints when a BPE stops short of its requested size (no pair left that occurs twice)."""
    return (
        f"[prepare] warning: the BPE saturated at {got:,} of the {asked:,} symbols asked for (no pair of the train "
        f"split left that occurs twice): the manifest records {got:,}; a config's model.n_token: auto sizes its "
        f"tables to it, an explicit n_token: {asked} would train {asked - got:,} ids that never occur"
    )


def _train_texts(srcs, field: str, split: DocumentSplit, files) -> Iterator[str]:
    doc = 0
    for _, block in iter_blocks(srcs, field):
        texts = parse_block(block)
        which = split.assign(doc, len(texts))
        doc += len(texts)
        for t, w in zip(texts, which, strict=True):
            if w == 0:
                yield t
    if doc == 0:
        raise ValueError(f"{', '.join(files)}: no documents")
