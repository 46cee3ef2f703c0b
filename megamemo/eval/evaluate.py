"""`megamemo eval`: bits per character or perplexity of a checkpoint on a split, at any lengths, with TRAMS.

    megamemo eval --ckpt CKPT --data DIR|URL --split valid|test [--json OUT]
                  [--tgt-len N] [--mem-len N] [--clamp-len N] [--same-length | --no-same-length] [--batch-size B]
                  [--max-segments K] [--trams-topk K --trams-recent R [--trams-metric code|paper]]
                  [--mem-ratios 1,2,4,... [--ratio-base N] [--plot FILE.png] [--table FILE.tsv]] [--memory FILE]

CKPT is a single-device checkpoint directory (megamemo/checkpoint/single.py) or a training run / checkpoint
directory (converted in memory, see `megamemo convert`); --ckpt may be repeated to compare models.

The loop is the reference `evaluate()` (spec §4.3): B contiguous columns (the training layout with one rank),
memory carried down each column from empty, and the exact per-token mean NLL in nats over the split. bpc = nll /
ln 2 for byte/character corpora, ppl = exp(nll) for word-level and subword ones (from the shard manifest's
tokenizer); subword ones also bits_per_byte = the scored tokens' total NLL in bits / the UTF-8 bytes they stand for
(the unit lm-evaluation-harness reports, comparable across tokenizers). A checkpoint that records a subword
tokenizer is not scored on data made with another one.
Defaults are the checkpoint's training lengths and batch 10 (the Transformer-XL scripts' eval batch); the score
depends on B because the first token of every column is never predicted.

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

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from megamemo.model.memory import Memory
from megamemo.model.scoring import score_segments
from megamemo.model.trams import METRICS, TramsConfig
from megamemo.model.trams import forward as trams_forward
from megamemo.util.units import metric_value
from megamemo.util.precision import NAMES as PRECISIONS, torch_dtype



# ---- metrics ---------------------------------------------------------------------------------------------------
def metric_name(manifest: dict) -> str:
    """'bpc' for byte- and character-level corpora, 'ppl' for word-level and subword ones (the manifest's
    tokenizer); subword results also carry bits_per_byte."""
    from data_pipeline.vocab import unit_of

    kind = (manifest.get("tokenizer") or {}).get("kind") or (manifest.get("vocab") or {}).get("kind")
    if kind not in ("bytes", "chars", "words", "subword"):
        raise ValueError(f"manifest.json: tokenizer.kind {kind!r} is not one of bytes | chars | words | subword")
    return unit_of(kind)


def check_tokenizer(meta: dict, manifest: dict, ckpt, data_dir) -> None:
    """A checkpoint trained on one subword tokenizer is not scored or sampled with another: one line naming both."""
    from data_pipeline.tokenizer import same_tokenizer

    mine, theirs = meta.get("tokenizer"), manifest.get("tokenizer")
    if mine and not same_tokenizer(mine, theirs):
        raise ValueError(f"{data_dir}: its tokenizer ({theirs.get('kind')}, sha256 {str(theirs.get('sha256'))[:12]})"
                         f" differs from the one checkpoint {ckpt} was trained with ({mine.get('kind')}, sha256 "
                         f"{str(mine.get('sha256'))[:12]})")


def token_bytes_of(data_dir, manifest: dict):
    """int64 tensor [V]: UTF-8 bytes each id stands for, for a subword corpus (bits per byte); None otherwise."""
    if (manifest.get("tokenizer") or {}).get("kind") != "subword":
        return None
    from data_pipeline import load_vocab

    return torch.from_numpy(load_vocab(data_dir).token_bytes())


# ---- the loop --------------------------------------------------------------------------------------------------
def evaluate(model, batches, *, mem_len=None, same_length=None, clamp_len=None, trams: TramsConfig | None = None,
             max_segments: int = 0, device=None, log=None, total_segments: int | None = None,
             log_every: float = 10.0, bar: bool | None = False, token_bytes: torch.Tensor | None = None,
             on_segment=None, memory: Memory | None = None) -> dict:
    """Exact per-token mean NLL (nats) of `model` over `batches` of (input, target) [L, B], memory carried from
    `memory` (None: empty), through the one scorer (megamemo/model/scoring.py).
    Progress: a line to `log` every `log_every` seconds, or a tqdm bar (bar=True; None: on a terminal).
    token_bytes (int64 [V], subword corpora): also the UTF-8 bytes of the scored target tokens ("bytes").
    on_segment(nll [L, B], hit [L, B] bool): told each segment's per-token NLL and whether each target was the
    most likely token (the harness's loglikelihood; without TRAMS).
    -> {"nll", "tokens", "segments", "seconds"[, "bytes", "bits_per_byte"]}."""
    from megamemo.util.progress import Progress

    if trams is not None and on_segment is not None:
        raise ValueError("on_segment is not available with TRAMS")
    lengths = {"mem_len": mem_len, "same_length": same_length, "clamp_len": clamp_len}
    forward = None
    if trams is not None:
        del lengths["mem_len"]                  # the TRAMS pool is the memory length
        forward = functools.partial(trams_forward, select=trams)
    elif on_segment is not None:
        forward = functools.partial(_forward_with_hits, on_segment)
    n_bytes = 0
    t0 = time.perf_counter()
    n_seg = min(total_segments, max_segments or total_segments) if total_segments else (max_segments or None)
    show = log is not None or bool(bar)
    progress = Progress("[eval]", total=n_seg, unit="seg", every=log_every if show else float("inf"),
                        bar=bar if show else False, log=log, line=_progress_line)

    def counted(scores, inp, tgt, nll):
        nonlocal n_bytes
        if token_bytes is not None:
            n_bytes += int(token_bytes[tgt.cpu()].sum())
        progress.update(1, tokens=scores.tokens, nll=lambda: scores.mean)  # nll: a device sync, when shown

    try:
        scores = score_segments(model, batches, memory=memory, forward=forward, max_segments=max_segments or None,
                                device=device, on_segment=counted, **lengths)
    finally:
        progress.close()
    out = {"nll": scores.mean, "tokens": scores.tokens, "segments": scores.segments,
           "seconds": time.perf_counter() - t0}
    if token_bytes is not None:
        from megamemo.util.units import bits_per_byte

        out["bytes"], out["bits_per_byte"] = n_bytes, bits_per_byte(float(scores.nll), n_bytes)
    return out


def _forward_with_hits(on_segment, model, inp, tgt, mem, **lengths):
    """The model's log-probs: the targets' NLL, and whether each target was the most likely token (on_segment)."""
    logp, mem = model(inp, None, mem, **lengths)
    nll = -logp.gather(2, tgt.long()[..., None]).squeeze(2)
    on_segment(nll, logp.argmax(2) == tgt)
    return nll, mem


def _progress_line(p) -> str:
    of = f"/{p.total}" if p.total else ""
    return (f"[eval] segment {p.n}{of}: {p.info['tokens']:,} tokens, {p.info['tokens'] / p.elapsed:,.0f} tokens/s, "
            f"running nll {p.info['nll']:.4f}")


def open_batches(data_dir, split: str, batch_size: int, tgt_len: int):
    """The evaluation batches: the training reader's layout with one rank and no roll, one pass."""
    from data_pipeline import StreamReader

    return StreamReader(data_dir, split, batch_size, tgt_len, world_size=1, rank=0, epochs=1)


def run_one(model, meta: dict, data_dir, split: str, *, tgt_len: int, mem_len: int, clamp_len: int,
            same_length: bool, batch_size: int, trams: TramsConfig | None = None, max_segments: int = 0,
            metric: str, device=None, log=print, bar: bool | None = False,
            token_bytes: torch.Tensor | None = None, memory: Memory | None = None) -> dict:
    reader = open_batches(data_dir, split, batch_size, tgt_len)
    try:
        out = evaluate(model, reader, mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, trams=trams,
                       max_segments=max_segments, device=device, log=log, total_segments=reader.steps_per_epoch,
                       bar=bar, token_bytes=token_bytes, memory=memory)
    finally:
        reader.close()
    out[metric] = metric_value(out["nll"], metric)
    out.update({"metric": metric, "split": split, "tgt_len": tgt_len, "mem_len": mem_len, "clamp_len": clamp_len,
                "same_length": same_length, "batch_size": batch_size, "variant": model.cfg.variant,
                "tokens_per_s": out["tokens"] / max(out["seconds"], 1e-9)})
    if trams is not None:
        out["trams"] = {"pool": trams.pool, "attend": trams.attend, "recent": trams.recent, "topk": trams.topk,
                        "metric": trams.metric}
    return out


# ---- the command -----------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="megamemo eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", action="append", required=True,
                   help="single-device checkpoint dir, or a training run / checkpoint dir (repeatable)")
    p.add_argument("--data", required=True,
                   help="shard directory made by `megamemo prepare`, or an s3:// gs:// https:// URL of one (read "
                        "through the verified cache in $XDG_CACHE_HOME/megamemo/shards, default ~/.cache/...)")
    p.add_argument("--split", default="valid", help="valid | test (or any split of the manifest)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--tgt-len", type=int, help="segment length (default: the checkpoint's tgt_len)")
    p.add_argument("--mem-len", type=int, help="memory length (default: the checkpoint's mem_len); the TRAMS pool")
    p.add_argument("--clamp-len", type=int, help="clamp relative distances (default: the checkpoint's)")
    p.add_argument("--same-length", dest="same_length", action="store_true", default=None)
    p.add_argument("--no-same-length", dest="same_length", action="store_false")
    p.add_argument("--batch-size", type=int, default=10, help="columns (streams); default 10 as in the XL scripts")
    p.add_argument("--max-segments", type=int, default=0, help="stop after K segments (0: the whole split)")
    p.add_argument("--trams-topk", type=int, help="TRAMS: older memory rows selected per layer/head/stream")
    p.add_argument("--trams-recent", type=int, default=0, help="TRAMS: newest memory rows always attended")
    p.add_argument("--trams-metric", choices=METRICS, default="code",
                   help="code: ||K'||*|sum K'| (reference code); paper: cos<K',1>*||K'||")
    p.add_argument("--mem-ratios", help="extrapolation sweep: comma-separated mem_len / ratio-base ratios")
    p.add_argument("--ratio-base", type=int, help="base of --mem-ratios (default: the checkpoint's mem_len)")
    p.add_argument("--plot", default="mem_sweep.png", help="sweep plot (PNG)")
    p.add_argument("--table", help="sweep table (TSV; default: the plot's name with .tsv)")
    p.add_argument("--memory", help="start every column from this memory (memory.safetensors of `megamemo convert "
                                    "to-single --memory`, or its directory; its streams must be --batch-size)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attention", choices=("auto", "eager", "flex"), default="auto",
                   help="attention form: auto (flex on CUDA, eager on the CPU), eager, flex (FlexAttention)")
    p.add_argument("--dtype", choices=(*PRECISIONS, "checkpoint"), default="checkpoint",
                   help="run the model in this dtype (default: as stored)")
    return p.parse_args(argv)




def load_for_eval(path, device, dtype: str = "checkpoint", attention: str = "auto"):
    from megamemo.interop.convert import load_model
    from megamemo.kernels import apply_attention, apply_kernels, resolve_attention

    model, meta = load_model(path)
    if dtype != "checkpoint":
        model = model.to(torch_dtype(dtype))
    apply_kernels(model, "auto", device)    # the CPU's attention masking on a CPU, plain PyTorch elsewhere
    apply_attention(model, resolve_attention(attention, device))    # --attention: FlexAttention on CUDA by default
    return model.to(device).eval(), meta


def _lengths(model, a, mem_len=None) -> dict:
    c = model.cfg
    return {"tgt_len": a.tgt_len or c.tgt_len,
            "mem_len": (a.mem_len if a.mem_len is not None else c.mem_len) if mem_len is None else mem_len,
            "clamp_len": c.clamp_len if a.clamp_len is None else a.clamp_len,
            "same_length": c.same_length if a.same_length is None else a.same_length}


def _trams(a, mem_len: int) -> TramsConfig | None:
    if a.trams_topk is None:
        return None
    return TramsConfig(pool=mem_len, attend=a.trams_topk + a.trams_recent, recent=a.trams_recent,
                       metric=a.trams_metric).validate()


def _fmt(r: dict) -> str:
    m = r["metric"]
    t = r.get("trams")
    extra = f" | TRAMS attend {t['attend']} of pool {t['pool']} (recent {t['recent']}, {t['metric']})" if t else ""
    bpb = f" | bits_per_byte {r['bits_per_byte']:.4f} ({r['bytes']:,} bytes)" if "bits_per_byte" in r else ""
    extra += f" | from memory {r['memory']}" if "memory" in r else ""
    return (f"{r['ckpt']}: {r['split']} {m} {r[m]:.4f} (nll {r['nll']:.5f} nats/token, {r['tokens']:,} tokens)"
            f"{bpb} | "
            f"{r['variant']} tgt {r['tgt_len']} mem {r['mem_len']} clamp {r['clamp_len']} "
            f"same_length {r['same_length']} B {r['batch_size']}{extra} | {r['tokens_per_s']:,.0f} tokens/s")


def main(argv: list[str]) -> int:
    from data_pipeline import ManifestError, ShardError
    from data_pipeline.remote import manifest_of
    from megamemo.checkpoint.single import SingleCheckpointError
    from megamemo.eval.start_memory import load_start_memory

    a = parse_args(argv)
    try:
        manifest = manifest_of(a.data)          # a local directory or an s3:// gs:// https:// one
        metric = metric_name(manifest)
        if a.split not in manifest["splits"]:
            raise ValueError(f"{str(a.data).rstrip('/')}/manifest.json: no split {a.split!r}")
        token_bytes = token_bytes_of(a.data, manifest)
        ratios = [float(x) for x in a.mem_ratios.split(",")] if a.mem_ratios else None
        results = []
        for ckpt in a.ckpt:
            model, meta = load_for_eval(ckpt, a.device, a.dtype, a.attention)
            check_tokenizer(meta, manifest, ckpt, a.data)
            runs = [None] if ratios is None else ratios
            for ratio in runs:
                mem_len = None
                if ratio is not None:
                    base = a.ratio_base or model.cfg.mem_len
                    mem_len = max(0, round(ratio * base))
                L = _lengths(model, a, mem_len)
                start = load_start_memory(a.memory, model, a.batch_size, L["mem_len"]) if a.memory else None
                r = run_one(model, meta, a.data, a.split, batch_size=a.batch_size, trams=_trams(a, L["mem_len"]),
                            max_segments=a.max_segments, metric=metric, device=a.device, bar=None,
                            token_bytes=token_bytes, memory=start, **L)
                r["ckpt"] = str(ckpt)
                if a.memory:
                    r["memory"] = str(a.memory)
                if ratio is not None:
                    r["mem_ratio"], r["ratio_base"] = ratio, base
                print(_fmt(r), flush=True)
                results.append(r)
    except (ValueError, OSError, ManifestError, ShardError, SingleCheckpointError) as e:
        print(f"megamemo eval: error: {e}", file=sys.stderr)
        return 2
    if ratios is not None:
        table = Path(a.table) if a.table else Path(a.plot).with_suffix(".tsv")
        write_table(results, table)
        plot_sweep(results, Path(a.plot))
        print(f"[eval] sweep table {table}, plot {a.plot}", flush=True)
    if a.json:
        doc = results[0] if len(results) == 1 else {"results": results}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


# ---- sweep outputs ---------------------------------------------------------------------------------------------
def write_table(results: list[dict], path: Path) -> None:
    metric = results[0]["metric"]
    lines = ["\t".join(["ckpt", "variant", "mem_ratio", "tgt_len", "mem_len", "nll", metric, "tokens"])]
    for r in results:
        lines.append("\t".join(str(x) for x in (r["ckpt"], r["variant"], r.get("mem_ratio", ""), r["tgt_len"],
                                                 r["mem_len"], f"{r['nll']:.6f}", f"{r[metric]:.6f}", r["tokens"])))
    path.write_text("\n".join(lines) + "\n")


def plot_sweep(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = results[0]["metric"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ckpt in dict.fromkeys(r["ckpt"] for r in results):
        rs = [r for r in results if r["ckpt"] == ckpt]
        ax.plot([r["mem_ratio"] for r in rs], [r[metric] for r in rs], marker="o",
                label=f"{rs[0]['variant']} ({Path(ckpt).name})")
    ax.set_xlabel(f"memory length / {results[0]['ratio_base']} (tgt_len "
                  f"{results[0]['tgt_len']})")
    ax.set_ylabel(f"{results[0]['split']} {metric}")
    ax.set_title("memory length extrapolation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
