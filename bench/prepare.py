"""How fast `megamemo prepare text --tokenizer FILE --workers N` turns raw documents into shards, against the
tokenizer's own ceiling.

    python bench/prepare.py [--mb 32] [--vocab 8000] [--workers 1,2] [--repeats 2] [--json OUT]

The corpus: the fixture's 589 WikiText paragraphs (tests/fixtures/text/wiki_paragraphs.jsonl) repeated, each copy's
documents numbered so no two are equal, to --mb MB of text in one jsonl file. A byte-level BPE of --vocab symbols is
trained on the fixture once (not timed); the timed runs are the whole prepare (read, parse, tokenize, split,
compress, write shards and manifest) through `build(subword_text(...))`, in this process, best of --repeats.

The ceiling: `tokenizers`' batch encode (encode_batch_fast, as prepare calls it) of the same documents, already in
memory, in one process with its thread pool off (TOKENIZERS_PARALLELISM=false, as prepare's workers run), in batches of
the documents of one block - no I/O, no JSON, no compression. Reported: MB/s of raw text (UTF-8 bytes of the documents)
for each, and prepare / (ceiling x N), the goal being >= 0.8. Also the CPU seconds prepare spent (this process, and its
worker processes) against the ceiling's: that ratio is what the pipeline costs beyond tokenizing, whatever else runs on
the machine, where the MB/s figures fall as soon as another job takes a core; and the ceiling run in N processes at
once, each on 1/N of the documents: what N cores give to tokenizing alone at that moment. Run it under the machine's cpu
lock.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megamemo.data.documents import BLOCK_BYTES  # noqa: E402
from megamemo.data.shards import build  # noqa: E402
from megamemo.data.subword import subword_text  # noqa: E402
from megamemo.data.tokenizer import train_bpe  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "text" / "wiki_paragraphs.jsonl"


def make_corpus(path: Path, mb: float) -> tuple[list[str], int]:
    base = [json.loads(line)["text"] for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
    docs, size = [], 0
    copy = 0
    while size < mb * 1e6:
        for t in base:
            d = f"{t} ({copy})"
            docs.append(d)
            size += len(d.encode("utf-8"))
        copy += 1
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return docs, size


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # worker processes, once they have exited
    return r.ru_utime + r.ru_stime


def ceiling(tok, docs: list[str], repeats: int) -> float:
    """Seconds of the best batch-encode pass over all documents, batches of about one prepare block."""
    batches, cur, size = [], [], 0
    for d in docs:
        cur.append(d)
        size += len(d)
        if size >= BLOCK_BYTES:
            batches.append(cur)
            cur, size = [], 0
    if cur:
        batches.append(cur)
    encode = getattr(tok.impl, "encode_batch_fast", tok.impl.encode_batch)  # what prepare's workers call
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            encode(b, add_special_tokens=False)
        best = min(best, time.perf_counter() - t0)
    return best


def _encode_share(args) -> float:
    tok_data, share = args
    from megamemo.data.tokenizer import SubwordTokenizer

    tok = SubwordTokenizer.from_bytes(tok_data, "tokenizers", "bench")
    return ceiling(tok, share, 1)


def ceiling_in_processes(tok, docs: list[str], n: int, repeats: int) -> float:
    """Wall seconds of the ceiling run in n processes at once, each on 1/n of the documents: what n cores of this
    machine give to tokenizing alone right now (the ideal n-worker prepare)."""
    import multiprocessing as mp

    shares = [(tok.data, docs[i::n]) for i in range(n)]
    best = float("inf")
    with mp.get_context("fork").Pool(n) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            pool.map(_encode_share, shares)
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=32.0, help="MB of document text")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        raw = tmp / "docs.jsonl"
        docs, n_bytes = make_corpus(raw, a.mb)
        fixture_docs = [json.loads(line)["text"] for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
        tok = train_bpe(iter(fixture_docs), a.vocab)
        tok_file = tmp / "tokenizer.json"
        tok_file.write_bytes(tok.data)
        mb = n_bytes / 1e6
        print(
            f"corpus: {len(docs):,} documents, {mb:.1f} MB of text ({raw.stat().st_size / 1e6:.1f} MB of jsonl), "
            f"BPE of {len(tok)} symbols; cpu cores visible: {os.cpu_count()}",
            flush=True,
        )
        t_ceil = ceiling(tok, docs, a.repeats)
        ceil_mbs = mb / t_ceil
        print(f"ceiling (tokenizers batch encode, 1 process, in memory): {ceil_mbs:.2f} MB/s", flush=True)
        result = {"mb_text": mb, "documents": len(docs), "vocab": len(tok), "ceiling_mb_s": ceil_mbs, "runs": []}
        for n in (int(x) for x in a.workers.split(",")):
            best, cpu = float("inf"), None
            for _ in range(a.repeats):
                out = tmp / f"out-{n}"
                shutil.rmtree(out, ignore_errors=True)
                t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
                build(subword_text([raw], tokenizer=str(tok_file), workers=n), out, log=lambda m: None)
                dt = time.perf_counter() - t0
                if dt < best:
                    best, cpu = dt, (time.process_time() - c0, _children_cpu() - k0)
            mbs = mb / best
            ratio = mbs / (ceil_mbs * n)
            cpu_ratio = t_ceil / (cpu[0] + cpu[1])
            result["runs"].append(
                {
                    "workers": n,
                    "seconds": best,
                    "mb_s": mbs,
                    "ratio_to_ceiling_x_workers": ratio,
                    "cpu_s_main": cpu[0],
                    "cpu_s_workers": cpu[1],
                    "cpu_ratio": cpu_ratio,
                }
            )
            print(
                f"prepare --workers {n}: {best:.2f} s, {mbs:.2f} MB/s = {ratio:.2f} x (ceiling x {n})"
                f"{'  (goal >= 0.8)' if ratio < 0.8 else ''} | CPU s: main {cpu[0]:.2f}, workers {cpu[1]:.2f}; "
                f"ceiling CPU / prepare CPU = {cpu_ratio:.2f}",
                flush=True,
            )
            if n > 1:
                par = mb / ceiling_in_processes(tok, docs, n, a.repeats)
                result["runs"][-1].update({"ceiling_in_n_processes_mb_s": par, "ratio_to_that": mbs / par})
                print(
                    f"  the ceiling itself in {n} processes at once (encode only, in memory): {par:.2f} MB/s = "
                    f"{par / ceil_mbs:.2f} x the 1-process ceiling; prepare --workers {n} = {mbs / par:.2f} x that",
                    flush=True,
                )
        result["load_average"] = os.getloadavg()
        print(
            f"load average at the end (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
