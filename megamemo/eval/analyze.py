"""What `megamemo analyze` does (megamemo/commands/analyze.py): what the memory does, as plots and numbers (the
LaMemo paper's Figures 1 and 6).

    megamemo analyze --ckpt CKPT [--ckpt CKPT ...] --data DIR [--split valid] [--out DIR] [--segments N]
                     [--batch-size B] [--tgt-len N] [--mem-len N]

Runs each checkpoint over the first N segments of the split (B contiguous streams, memory carried, as eval does)
and records, once the memory is full (M = mem_len; the warm-up segments are skipped):
  * attention weight by distance (Figure 1): for every layer, the attention probability of the current queries
    averaged over all (stream, head, query, key) pairs at each distance d = query position - key position,
    d = 0 .. mem_len + tgt_len - 1, plus the share of attention mass on memory keys. LaMemo vs XL: run both.
  * the memorizing coefficient alpha (Figure 6, LaMemo only): the weight of the cached context against the
    new look-ahead context in the memory interpolation, per layer and memory row (index 0 = the oldest row,
    mem_len - 1 = the newest), averaged over streams, heads and segments.
Writes DIR/attention_by_distance.png, DIR/alpha.png (when a LaMemo checkpoint is given) and DIR/analysis.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megamemo.eval.evaluate import open_batches
from megamemo.interop.load import open_model
from megamemo.model.scoring import score_segments
from megamemo.model.trams import forward as inspect_forward
from megamemo.util.errors import UsageError


class Recorder:
    """Observer for megamemo.model.trams.forward: accumulates attention-by-distance and alpha for full-memory
    segments."""

    def __init__(self, n_layer: int, tgt_len: int, mem_len: int):
        self.n_layer, self.L, self.M = n_layer, tgt_len, mem_len
        n_dist = mem_len + tgt_len
        self.att_sum = torch.zeros(n_layer, n_dist, dtype=torch.float64)
        self.att_cnt = torch.zeros(n_layer, n_dist, dtype=torch.float64)
        self.mem_mass = torch.zeros(n_layer, dtype=torch.float64)
        self.queries = torch.zeros(n_layer, dtype=torch.float64)
        self.alpha_sum = torch.zeros(n_layer, mem_len, dtype=torch.float64)
        self.alpha_cnt = torch.zeros(n_layer, dtype=torch.float64)
        self.active = False

    def __call__(self, layer: int, kind: str, **kw):
        if not self.active:
            return
        if kind == "causal":
            probs, mlen = kw["probs"].double(), kw["mlen"]
            B, n, L, klen = probs.shape
            i = torch.arange(L)[:, None]
            j = torch.arange(klen)[None, :]
            dist = (mlen + i - j).to(probs.device)
            valid = dist >= 0
            summed = probs.sum((0, 1))  # [L, klen]
            d = dist.clamp(min=0)[valid].cpu()
            self.att_sum[layer].index_add_(0, d, summed[valid].cpu())
            self.att_cnt[layer].index_add_(0, d, torch.full((d.numel(),), float(B * n), dtype=torch.float64))
            self.mem_mass[layer] += float(summed[:, :mlen].sum())
            self.queries[layer] += B * n * L
        elif kind == "alpha":
            a = kw["alpha"].double()  # [B, n, M]
            self.alpha_sum[layer] += a.sum((0, 1)).cpu()
            self.alpha_cnt[layer] += a.shape[0] * a.shape[1]

    def result(self) -> dict:
        att = (self.att_sum / self.att_cnt.clamp(min=1)).tolist()
        out = {
            "attention_by_distance": {f"layer_{li}": att[li] for li in range(self.n_layer)},
            "memory_mass": {
                f"layer_{li}": float(self.mem_mass[li] / max(float(self.queries[li]), 1.0))
                for li in range(self.n_layer)
            },
        }
        mean = (self.att_sum.sum(0) / self.att_cnt.sum(0).clamp(min=1)).tolist()
        out["attention_by_distance"]["mean"] = mean
        if float(self.alpha_cnt.sum()) > 0:
            alpha = (self.alpha_sum / self.alpha_cnt.clamp(min=1)[:, None]).tolist()
            out["alpha"] = {f"layer_{li}": alpha[li] for li in range(self.n_layer)}
        return out


def analyze(model, batches, *, tgt_len: int, mem_len: int, segments: int, device=None) -> dict:
    """Run `segments` segments (the one scorer, megamemo/model/scoring.py, with the inspectable forward); record
    the full-memory ones. -> the Recorder's result plus counts."""
    cfg = model.cfg
    if not cfg.has_memory:
        raise UsageError(f"{cfg.variant!r} has no memory to analyse")
    rec = Recorder(cfg.n_layer, tgt_len, mem_len)
    used = 0

    def observed(model, inp, tgt, mem):
        nonlocal used
        rec.active = mem is not None and mem.length == mem_len and inp.size(0) == tgt_len
        used += rec.active
        return inspect_forward(model, inp, tgt, mem, mem_len=mem_len, observe=rec)

    seen = score_segments(model, batches, forward=observed, max_segments=segments, device=device).segments
    if used == 0:
        raise UsageError(f"no segment with a full memory of {mem_len} rows in {seen} segments: raise --segments")
    out = rec.result()
    out.update(
        {
            "variant": cfg.variant,
            "tgt_len": tgt_len,
            "mem_len": mem_len,
            "segments_recorded": used,
            "n_layer": cfg.n_layer,
        }
    )
    return out


# ---- plots -----------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib  # heavy, and only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt


def plot_attention(results: list[dict], path: Path) -> None:
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        mean = r["attention_by_distance"]["mean"]
        label = f"{r['variant']} ({r['name']})"
        ax.plot(range(len(mean)), mean, label=label)
        total = sum(mean) or 1.0
        cum = torch.tensor(mean).cumsum(0) / total
        ax2.plot(range(len(mean)), cum.tolist(), label=label)
    L = results[0]["tgt_len"]
    for a in (ax, ax2):
        a.axvline(L - 0.5, color="grey", lw=0.8, ls=":")
        a.set_xlabel("distance (query position - key position)")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("mean attention weight (all layers)")
    ax.set_title("attention weight by distance")
    ax2.set_ylabel("cumulative share of the mean weight")
    ax2.set_title(f"beyond the dotted line: keys only memory holds (tgt_len {L})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_alpha(results: list[dict], path: Path) -> None:
    plt = _plt()
    lam = [r for r in results if "alpha" in r]
    fig, axes = plt.subplots(1, len(lam), figsize=(5.5 * len(lam), 4), squeeze=False)
    for ax, r in zip(axes[0], lam, strict=True):
        for name, vals in r["alpha"].items():
            ax.plot(range(len(vals)), vals, label=name.replace("_", " "))
        ax.set_xlabel("memory index (0 = oldest row)")
        ax.set_ylabel("memorizing coefficient alpha")
        ax.set_ylim(0, 1)
        ax.set_title(f"{r['variant']} ({r['name']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the runs ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What `megamemo analyze` asks of every checkpoint: each field is one of its flags (megamemo/commands/analyze.py
    makes them from these fields, their comments the flags' help). A length left None is the checkpoint's."""

    # shard directory made by `megamemo prepare`, or an s3:// gs:// https:// URL of one
    data: str
    split: str = "valid"  # the manifest's split to analyse
    segments: int = 50  # segments to run (the first mem_len/tgt_len warm up)
    batch_size: int = 10  # columns (streams)
    tgt_len: int | None = None  # default: the checkpoint's
    mem_len: int | None = None  # default: the checkpoint's
    # torch device: auto (the command resolves it: cuda when torch sees one, else cpu), cpu, cuda, cuda:N
    device: str = "cpu"


def analyze_checkpoints(ckpts: list, r: Request, log=print) -> list[dict]:
    """Each checkpoint over the first `segments` segments of the split (lengths None: the checkpoint's), a line or
    two to `log` each -> the results (write_analysis writes them). A bad checkpoint or data directory raises the
    one-line error that names it."""
    results = []
    for ckpt in ckpts:
        model, _ = open_model(ckpt, r.device, attention=None)
        L = r.tgt_len or model.cfg.tgt_len
        M = model.cfg.mem_len if r.mem_len is None else r.mem_len
        reader = open_batches(r.data, r.split, r.batch_size, L)
        try:
            found = analyze(model, reader, tgt_len=L, mem_len=M, segments=r.segments, device=r.device)
        finally:
            reader.close()
        found["ckpt"], found["name"] = str(ckpt), Path(ckpt).name
        results.append(found)
        mass = ", ".join(f"{v:.3f}" for v in found["memory_mass"].values())
        log(
            f"[analyze] {ckpt}: {found['variant']} tgt {L} mem {M}, {found['segments_recorded']} segments; "
            f"attention mass on memory per layer: {mass}"
        )
        if "alpha" in found:
            alphas = found["alpha"].values()
            log("[analyze]   mean alpha per layer: " + ", ".join(f"{sum(v) / len(v):.3f}" for v in alphas))
    return results


def write_analysis(results: list[dict], out, split: str, batch_size: int, log=print) -> Path:
    """DIR/attention_by_distance.png, DIR/alpha.png (when a LaMemo checkpoint is among them), DIR/analysis.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_attention(results, out / "attention_by_distance.png")
    if any("alpha" in r for r in results):
        plot_alpha(results, out / "alpha.png")
    (out / "analysis.json").write_text(
        json.dumps({"split": split, "batch_size": batch_size, "models": results}, indent=1) + "\n"
    )
    log(f"[analyze] wrote {out}/")
    return out
