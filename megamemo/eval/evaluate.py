"""What `megamemo eval` does (megamemo/commands/eval.py): bits per character or perplexity of a checkpoint on a split,
at any lengths, with TRAMS.

    megamemo eval --ckpt CKPT --data DIR|URL --split valid|test [--json OUT]
                  [--tgt-len N] [--mem-len N] [--clamp-len N] [--same-length | --no-same-length] [--batch-size B]
                  [--max-segments K] [--trams-topk K --trams-recent R [--trams-metric code|paper]]
                  [--mem-ratios 1,2,4,... [--ratio-base N] [--plot FILE.png] [--table FILE.tsv]] [--memory FILE]

CKPT is a single-device checkpoint directory (megamemo/checkpoint/single.py) or a training run / checkpoint
directory (converted in memory, see `megamemo convert`); --ckpt may be repeated to compare models.

The loop is the reference `evaluate()` (spec §4.3; megamemo/model/scoring.py evaluate): B contiguous columns (the
training layout with one rank), memory carried down each column from empty, and the exact per-token mean NLL in nats
over the split. bpc = nll / ln 2 for byte/character corpora, ppl = exp(nll) for word-level and subword ones (from the
shard manifest's tokenizer); subword ones also bits_per_byte = the scored tokens' total NLL in bits / the UTF-8 bytes
they stand for (the unit lm-evaluation-harness reports, comparable across tokenizers). A checkpoint that records a
subword tokenizer is not scored on data made with another one. Defaults are the checkpoint's training lengths and batch
10 (the Transformer-XL scripts' eval batch); the score depends on B because the first token of every column is never
predicted.

TRAMS: --mem-len is the pool (the cache), the current tokens attend to the newest --trams-recent rows plus the
--trams-topk best older rows (see megamemo/model/trams.py). The TRAMS paper's setting is mem 400, topk 50, recent 150.

--memory FILE starts every column from a saved memory instead of an empty one: the memory.safetensors that
`megamemo convert to-single --memory COLUMNS` writes (or the converted directory holding it), one stream per column
(its streams must be --batch-size), checked against the model and mem_len (megamemo/eval/start_memory.py).

--mem-ratios runs the memory extrapolation sweep (the LaMemo paper's Figure 5): at the fixed --tgt-len, mem_len =
ratio x base (--ratio-base, default the checkpoint's training mem_len), one evaluation per ratio and checkpoint;
the table (TSV) and the plot (PNG) are written, and --json gets every result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megamemo.data import StreamReader, load_vocab
from megamemo.data.remote import manifest_of
from megamemo.data.tokenizer import SubwordTokenizer, same_tokenizer
from megamemo.data.vocab import unit_of
from megamemo.eval.start_memory import load_start_memory
from megamemo.interop.load import open_model
from megamemo.model.memory import Memory
from megamemo.model.scoring import evaluate
from megamemo.model.trams import TramsConfig
from megamemo.util.errors import UsageError
from megamemo.util.units import metric_value


# ---- metrics ---------------------------------------------------------------------------------------------------
def metric_name(manifest: dict) -> str:
    """'bpc' for byte- and character-level corpora, 'ppl' for word-level and subword ones (the manifest's
    tokenizer); subword results also carry bits_per_byte."""
    kind = (manifest.get("tokenizer") or {}).get("kind") or (manifest.get("vocab") or {}).get("kind")
    if kind not in ("bytes", "chars", "words", "subword"):
        raise UsageError(f"manifest.json: tokenizer.kind {kind!r} is not one of bytes | chars | words | subword")
    return unit_of(kind)


def check_tokenizer(meta: dict, manifest: dict, ckpt, data_dir) -> None:
    """A checkpoint trained on one subword tokenizer is not scored or sampled with another: one line naming both."""
    mine, theirs = meta.get("tokenizer"), manifest.get("tokenizer") or {}  # a manifest without one: bytes
    if mine and not same_tokenizer(mine, theirs):
        raise UsageError(
            f"{data_dir}: its tokenizer ({theirs.get('kind')}, sha256 {str(theirs.get('sha256'))[:12]})"
            f" differs from the one checkpoint {ckpt} was trained with ({mine.get('kind')}, sha256 "
            f"{str(mine.get('sha256'))[:12]})"
        )


def token_bytes_of(data_dir, manifest: dict):
    """int64 tensor [V]: UTF-8 bytes each id stands for, for a subword corpus (bits per byte); None otherwise."""
    if (manifest.get("tokenizer") or {}).get("kind") != "subword":
        return None
    vocab = load_vocab(data_dir)
    assert isinstance(vocab, SubwordTokenizer)  # the manifest records a subword tokenizer
    return torch.from_numpy(vocab.token_bytes())


def open_batches(data_dir, split: str, batch_size: int, tgt_len: int):
    """The evaluation batches: the training reader's layout with one rank and no roll, one pass."""
    return StreamReader(data_dir, split, batch_size, tgt_len, world_size=1, rank=0, epochs=1)


def run_one(
    model,
    meta: dict,
    data_dir,
    split: str,
    *,
    tgt_len: int,
    mem_len: int,
    clamp_len: int,
    same_length: bool,
    batch_size: int,
    trams: TramsConfig | None = None,
    max_segments: int = 0,
    metric: str,
    device=None,
    log=print,
    bar: bool | None = False,
    token_bytes: torch.Tensor | None = None,
    memory: Memory | None = None,
) -> dict:
    reader = open_batches(data_dir, split, batch_size, tgt_len)
    try:
        out = evaluate(
            model,
            reader,
            mem_len=mem_len,
            same_length=same_length,
            clamp_len=clamp_len,
            trams=trams,
            max_segments=max_segments,
            device=device,
            log=log,
            total_segments=reader.steps_per_epoch,
            bar=bar,
            token_bytes=token_bytes,
            memory=memory,
        )
    finally:
        reader.close()
    out[metric] = metric_value(out["nll"], metric)
    out.update(
        {
            "metric": metric,
            "split": split,
            "tgt_len": tgt_len,
            "mem_len": mem_len,
            "clamp_len": clamp_len,
            "same_length": same_length,
            "batch_size": batch_size,
            "variant": model.cfg.variant,
            "tokens_per_s": out["tokens"] / max(out["seconds"], 1e-9),
        }
    )
    if trams is not None:
        out["trams"] = {
            "pool": trams.pool,
            "attend": trams.attend,
            "recent": trams.recent,
            "topk": trams.topk,
            "metric": trams.metric,
        }
    return out


def _lengths(model, a, mem_len=None) -> dict:
    c = model.cfg
    return {
        "tgt_len": a.tgt_len or c.tgt_len,
        "mem_len": (a.mem_len if a.mem_len is not None else c.mem_len) if mem_len is None else mem_len,
        "clamp_len": c.clamp_len if a.clamp_len is None else a.clamp_len,
        "same_length": c.same_length if a.same_length is None else a.same_length,
    }


def _trams(a, mem_len: int) -> TramsConfig | None:
    if a.trams_topk is None:
        return None
    return TramsConfig(
        pool=mem_len, attend=a.trams_topk + a.trams_recent, recent=a.trams_recent, metric=a.trams_metric
    ).validate()


def _fmt(r: dict) -> str:
    m = r["metric"]
    t = r.get("trams")
    extra = f" | TRAMS attend {t['attend']} of pool {t['pool']} (recent {t['recent']}, {t['metric']})" if t else ""
    bpb = f" | bits_per_byte {r['bits_per_byte']:.4f} ({r['bytes']:,} bytes)" if "bits_per_byte" in r else ""
    extra += f" | from memory {r['memory']}" if "memory" in r else ""
    return (
        f"{r['ckpt']}: {r['split']} {m} {r[m]:.4f} (nll {r['nll']:.5f} nats/token, {r['tokens']:,} tokens)"
        f"{bpb} | "
        f"{r['variant']} tgt {r['tgt_len']} mem {r['mem_len']} clamp {r['clamp_len']} "
        f"same_length {r['same_length']} B {r['batch_size']}{extra} | {r['tokens_per_s']:,.0f} tokens/s"
    )


@dataclass
class Request:
    """What `megamemo eval` asks of every checkpoint: each field is one of its flags (megamemo/commands/eval.py makes
    them from these fields, their comments the flags' help). A length left None is the checkpoint's; mem_ratios:
    the extrapolation sweep, mem_len = ratio x ratio_base (None: the checkpoint's)."""

    data: str  # shard directory made by `megamemo prepare`, or an s3:// gs:// https:// URL of
    # one (read through the verified cache in $XDG_CACHE_HOME/megamemo/shards,
    # default ~/.cache/...)
    split: str = "valid"  # valid | test (or any split of the manifest)
    batch_size: int = 10  # columns (streams); default 10 as in the XL scripts
    max_segments: int = 0  # stop after this many segments (0: the whole split)
    tgt_len: int | None = None  # segment length (default: the checkpoint's tgt_len)
    mem_len: int | None = None  # memory length (default: the checkpoint's mem_len); the TRAMS pool
    clamp_len: int | None = None  # clamp relative distances (default: the checkpoint's)
    same_length: bool | None = None  # every query attends over the same number of keys (no: over all keys before
    # it; default: the checkpoint's same_length)
    trams_topk: int | None = None  # TRAMS: older memory rows selected per layer/head/stream
    trams_recent: int = 0  # TRAMS: newest memory rows always attended
    trams_metric: str = "code"  # code: ||K'||*|sum K'| (reference code); paper: cos<K',1>*||K'||
    mem_ratios: list[float] | None = None  # extrapolation sweep: comma-separated mem_len / ratio-base ratios
    ratio_base: int | None = None  # base of the sweep's ratios (default: the checkpoint's mem_len)
    memory: str | None = None  # start every column from this memory (memory.safetensors of `megamemo convert
    # to-single --memory`, or its directory; its streams must be the batch size)
    device: str = "cpu"  # torch device: auto (the command resolves it: cuda when torch sees one, else
    # cpu), cpu, cuda, cuda:N
    dtype: str = "checkpoint"  # run the model in this dtype (default: as stored)
    attention: str = "auto"  # attention form: auto (flex on CUDA, eager on the CPU), eager, flex
    # (FlexAttention), fused (the Triton kernels; on the CPU only in Triton's
    # interpreter, TRITON_INTERPRET=1)


def evaluate_checkpoints(ckpts: list, a: Request, log=print) -> list[dict]:
    """Every checkpoint on the split (at every ratio of a sweep), one line each to `log` -> the results. A bad
    checkpoint, data directory or memory file raises the one-line error that names it."""
    manifest = manifest_of(a.data)  # a local directory or an s3:// gs:// https:// one
    metric = metric_name(manifest)
    if a.split not in manifest["splits"]:
        raise UsageError(f"{str(a.data).rstrip('/')}/manifest.json: no split {a.split!r}")
    token_bytes = token_bytes_of(a.data, manifest)
    results = []
    for ckpt in ckpts:
        model, meta = open_model(ckpt, a.device, a.dtype, a.attention)
        model.cfg.check_lengths(**{"--tgt-len": a.tgt_len, "--mem-len": a.mem_len, "--clamp-len": a.clamp_len})
        check_tokenizer(meta, manifest, ckpt, a.data)
        for ratio in [None] if a.mem_ratios is None else a.mem_ratios:
            mem_len = None
            if ratio is not None:
                base = a.ratio_base or model.cfg.mem_len
                mem_len = max(0, round(ratio * base))
            L = _lengths(model, a, mem_len)
            start = load_start_memory(a.memory, model, a.batch_size, L["mem_len"]) if a.memory else None
            r = run_one(
                model,
                meta,
                a.data,
                a.split,
                batch_size=a.batch_size,
                trams=_trams(a, L["mem_len"]),
                max_segments=a.max_segments,
                metric=metric,
                device=a.device,
                bar=None,
                token_bytes=token_bytes,
                memory=start,
                **L,
            )
            r["ckpt"] = str(ckpt)
            if a.memory:
                r["memory"] = str(a.memory)
            if ratio is not None:
                r["mem_ratio"], r["ratio_base"] = ratio, base
            log(_fmt(r))
            results.append(r)
    return results


# ---- sweep outputs ---------------------------------------------------------------------------------------------
def write_sweep(results: list[dict], plot: Path, table: Path | None = None, log=print) -> None:
    """The sweep's table (TSV; default: the plot's name with .tsv) and plot (PNG)."""
    table = Path(table) if table else Path(plot).with_suffix(".tsv")
    write_table(results, table)
    plot_sweep(results, Path(plot))
    log(f"[eval] sweep table {table}, plot {plot}")


def write_table(results: list[dict], path: Path) -> None:
    metric = results[0]["metric"]
    lines = ["\t".join(["ckpt", "variant", "mem_ratio", "tgt_len", "mem_len", "nll", metric, "tokens"])]
    for r in results:
        lines.append(
            "\t".join(
                str(x)
                for x in (
                    r["ckpt"],
                    r["variant"],
                    r.get("mem_ratio", ""),
                    r["tgt_len"],
                    r["mem_len"],
                    f"{r['nll']:.6f}",
                    f"{r[metric]:.6f}",
                    r["tokens"],
                )
            )
        )
    path.write_text("\n".join(lines) + "\n")


def plot_sweep(results: list[dict], path: Path) -> None:
    import matplotlib  # heavy, and only for the sweep's plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    metric = results[0]["metric"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ckpt in dict.fromkeys(r["ckpt"] for r in results):
        rs = [r for r in results if r["ckpt"] == ckpt]
        ax.plot(
            [r["mem_ratio"] for r in rs],
            [r[metric] for r in rs],
            marker="o",
            label=f"{rs[0]['variant']} ({Path(ckpt).name})",
        )
    ax.set_xlabel(f"memory length / {results[0]['ratio_base']} (tgt_len {results[0]['tgt_len']})")
    ax.set_ylabel(f"{results[0]['split']} {metric}")
    ax.set_title("memory length extrapolation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
